//! A provider in memory for tests that need one without a cluster or a cloud: it records every
//! call, answers `get` and `create` as the test scripts them, lists the machines it holds, and
//! forgets a machine it is asked to delete.

use std::sync::{Mutex, PoisonError};

use proxy_operator::provider::{CreateRequest, ErrorClass, Instance, Provider, ProviderError};

/// What the stub answers and every call it received.
#[derive(Debug)]
pub struct StubProvider {
    name: String,
    calls: Mutex<Vec<String>>,
    /// The answer to every `get` (`None`: a `get` fails the test).
    pub get: Mutex<Option<Result<Instance, ErrorClass>>>,
    /// The answer to every `create` (`None`: a `create` fails the test).
    pub create: Mutex<Option<Result<Instance, ErrorClass>>>,
    /// The last create request.
    pub created: Mutex<Option<CreateRequest>>,
    /// What `list_managed` answers; `delete` removes a machine from it.
    pub machines: Mutex<Vec<Instance>>,
    /// `list_managed` fails transiently instead.
    list_fails: bool,
}

impl StubProvider {
    /// A stub named `name` holding no machine, that answers nothing it was not told to.
    pub fn new(name: &str) -> Self {
        StubProvider {
            name: name.to_owned(),
            calls: Mutex::default(),
            get: Mutex::default(),
            create: Mutex::default(),
            created: Mutex::default(),
            machines: Mutex::default(),
            list_fails: false,
        }
    }

    /// A stub named `name` holding `machines`.
    pub fn holding(name: &str, machines: Vec<Instance>) -> Self {
        StubProvider {
            machines: Mutex::new(machines),
            ..StubProvider::new(name)
        }
    }

    /// The same stub, whose `list_managed` fails transiently (an unreachable cloud).
    pub fn failing_lists(self) -> Self {
        StubProvider {
            list_fails: true,
            ..self
        }
    }

    /// Every call so far, in order: `create <name>`, `get <id>`, `delete <id>`, `list`.
    pub fn calls(&self) -> Vec<String> {
        lock(&self.calls).clone()
    }

    /// The provider IDs of the machines it holds.
    pub fn ids(&self) -> Vec<String> {
        lock(&self.machines)
            .iter()
            .map(|m| m.provider_id.clone())
            .collect()
    }

    fn record(&self, call: String) {
        lock(&self.calls).push(call);
    }

    fn answer(
        &self,
        stored: &Mutex<Option<Result<Instance, ErrorClass>>>,
        op: &'static str,
        id: &str,
    ) -> Result<Instance, ProviderError> {
        match lock(stored).clone() {
            Some(Ok(instance)) => Ok(instance),
            Some(Err(class)) => Err(ProviderError::new(
                class,
                op,
                &self.name,
                id,
                "stub says no",
            )),
            None => panic!("unexpected provider {op} {id}"),
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

#[async_trait::async_trait]
impl Provider for StubProvider {
    fn name(&self) -> &str {
        &self.name
    }

    async fn create(&self, request: &CreateRequest) -> Result<Instance, ProviderError> {
        self.record(format!("create {}", request.machine_name));
        *lock(&self.created) = Some(request.clone());
        self.answer(&self.create, "create", &request.machine_name)
    }

    async fn get(&self, id: &str) -> Result<Instance, ProviderError> {
        self.record(format!("get {id}"));
        self.answer(&self.get, "get", id)
    }

    async fn delete(&self, id: &str) -> Result<(), ProviderError> {
        self.record(format!("delete {id}"));
        lock(&self.machines).retain(|m| m.provider_id != id);
        Ok(())
    }

    async fn list_managed(&self) -> Result<Vec<Instance>, ProviderError> {
        self.record("list".to_owned());
        if self.list_fails {
            return Err(ProviderError::new(
                ErrorClass::Transient,
                "list",
                &self.name,
                "",
                "unreachable",
            ));
        }
        Ok(lock(&self.machines).clone())
    }
}
