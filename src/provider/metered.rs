//! The metering decorator: counts every provider call by provider, operation and result, so a
//! dashboard shows a cloud starting to refuse (quota, permissions) before the fleet shrinks.
//! Every provider gets it for free from the registry; no provider counts anything itself.

use std::sync::Arc;

use prometheus::{IntCounterVec, Opts, Registry};

use super::{CreateRequest, Instance, Provider, ProviderError, op};

/// Name of the counter.
pub const PROVIDER_REQUESTS_TOTAL: &str = "proxy_operator_provider_requests_total";
/// `result` label value of a successful call; failures use [`super::ErrorClass::as_str`].
pub const RESULT_OK: &str = "ok";

/// The provider-call counter, registered once per metrics registry and shared by every
/// [`MeteredProvider`].
#[derive(Clone)]
pub struct ProviderMetrics {
    requests: IntCounterVec,
}

impl ProviderMetrics {
    /// Creates the counter and registers it in `registry` (fails if it is already there).
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let requests = IntCounterVec::new(
            Opts::new(
                PROVIDER_REQUESTS_TOTAL,
                "Provider API calls by provider, operation and result (ok or the error class).",
            ),
            &["provider", "op", "result"],
        )?;
        registry.register(Box::new(requests.clone()))?;
        Ok(ProviderMetrics { requests })
    }

    fn observe<T>(&self, provider: &str, op: &str, result: &Result<T, ProviderError>) {
        let outcome = match result {
            Ok(_) => RESULT_OK,
            Err(e) => e.class.as_str(),
        };
        self.requests
            .with_label_values(&[provider, op, outcome])
            .inc();
    }
}

/// A provider whose calls are counted in [`ProviderMetrics`]; behaves exactly like `inner`.
pub struct MeteredProvider {
    inner: Arc<dyn Provider>,
    metrics: ProviderMetrics,
}

impl MeteredProvider {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Provider>, metrics: ProviderMetrics) -> Self {
        MeteredProvider { inner, metrics }
    }
}

#[async_trait::async_trait]
impl Provider for MeteredProvider {
    fn name(&self) -> &str {
        self.inner.name()
    }

    async fn create(&self, request: &CreateRequest) -> Result<Instance, ProviderError> {
        let result = self.inner.create(request).await;
        self.metrics.observe(self.name(), op::CREATE, &result);
        result
    }

    async fn get(&self, provider_id: &str) -> Result<Instance, ProviderError> {
        let result = self.inner.get(provider_id).await;
        self.metrics.observe(self.name(), op::GET, &result);
        result
    }

    async fn delete(&self, provider_id: &str) -> Result<(), ProviderError> {
        let result = self.inner.delete(provider_id).await;
        self.metrics.observe(self.name(), op::DELETE, &result);
        result
    }

    async fn force_delete(&self, provider_id: &str) -> Result<(), ProviderError> {
        let result = self.inner.force_delete(provider_id).await;
        self.metrics.observe(self.name(), op::FORCE_DELETE, &result);
        result
    }

    async fn list_managed(&self) -> Result<Vec<Instance>, ProviderError> {
        let result = self.inner.list_managed().await;
        self.metrics.observe(self.name(), op::LIST, &result);
        result
    }
}
