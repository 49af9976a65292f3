//! The standalone inventory: a multi-document YAML file of `Proxy` objects — the same file
//! `kubectl apply -f` accepts — checked with the CRD's own constraints and rules, and reloaded
//! when it changes (or on SIGHUP) without a restart. `kind: Secret` documents beside the
//! Proxies hold the upstream credentials their `credentialsSecretRef` names.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use serde_json::Value;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use k8s_openapi::api::core::v1::Secret;

use super::Inventory;
use crate::credentials::{CredentialStore, Credentials};
use crate::resources::proxy::{DEFAULT_NAMESPACE, Mode, Proxy};
use crate::resources::validation::{ProxyValidator, SchemaError};

const API_VERSION: &str = "crawl.example.com/v1alpha1";
const KIND: &str = "Proxy";
const SECRET_API_VERSION: &str = "v1";
const SECRET_KIND: &str = "Secret";

/// What an inventory file holds: its Proxies, and the credentials of its Secrets by
/// (namespace, name).
#[derive(Debug, Default)]
pub struct Loaded {
    /// The Proxies, in file order.
    pub proxies: Vec<Proxy>,
    /// Upstream credentials from the `kind: Secret` documents.
    pub credentials: HashMap<(String, String), Credentials>,
}

/// The most documents (proxies) one inventory file may hold.
pub const MAX_DOCUMENTS: usize = 100_000;
/// YAML parser events allowed per document on average; a Proxy document is about 50.
const EVENTS_PER_DOCUMENT: usize = 1_000;

/// The YAML parser's budget, scaled to a fleet: the default (1,024 documents, 1,000,000
/// events, 250,000 nodes) is sized for one config file and refuses a 10,000-proxy inventory.
/// The other limits (aliases, nesting, scalar bytes) keep their defaults.
fn parse_options() -> serde_saphyr::Options {
    let mut budget = serde_saphyr::Budget::default();
    budget.max_documents = MAX_DOCUMENTS;
    budget.max_events = MAX_DOCUMENTS * EVENTS_PER_DOCUMENT;
    budget.max_nodes = MAX_DOCUMENTS * EVENTS_PER_DOCUMENT;
    let mut options = serde_saphyr::Options::default();
    options.budget = Some(budget);
    options
}

/// Why an inventory file was refused. Every variant names the file; document-level variants
/// name the document (1-based) and the Proxy.
#[derive(Debug, thiserror::Error)]
pub enum InventoryError {
    /// The file could not be read.
    #[error("inventory {path}: cannot read: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Not valid YAML.
    #[error("inventory {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message, with the location.
        message: String,
    },
    /// One document is not an acceptable Proxy.
    #[error("inventory {path}: document {index} ({name}): {message}")]
    Document {
        /// The file.
        path: PathBuf,
        /// 1-based position of the document in the file.
        index: usize,
        /// `namespace/name` of the Proxy, or `unnamed`.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// Two documents describe the same namespace/name.
    #[error("inventory {path}: document {index} ({name}) repeats document {first}")]
    Duplicate {
        /// The file.
        path: PathBuf,
        /// 1-based position of the repeat.
        index: usize,
        /// 1-based position of the first occurrence.
        first: usize,
        /// `namespace/name`.
        name: String,
    },
}

/// Size and modification time of a file.
type Fingerprint = (u64, SystemTime);

/// A standalone inventory file and the validator its documents are checked with.
pub struct InventoryFile {
    path: PathBuf,
    validator: ProxyValidator,
    /// The fingerprint of the file as last loaded, so [`watch`] does not check the same
    /// content again at start (at 10,000 proxies a load takes seconds of CPU).
    loaded: Mutex<Option<Fingerprint>>,
}

impl InventoryFile {
    /// An inventory read from `path`.
    pub fn new(path: impl Into<PathBuf>) -> Result<Self, SchemaError> {
        Ok(InventoryFile {
            path: path.into(),
            validator: ProxyValidator::new()?,
            loaded: Mutex::new(None),
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads and checks the file.
    pub fn load(&self) -> Result<Loaded, InventoryError> {
        // Taken first: a change while reading shows as a changed fingerprint later.
        let fingerprint = fingerprint(&self.path);
        let text = std::fs::read_to_string(&self.path).map_err(|source| InventoryError::Read {
            path: self.path.clone(),
            source,
        })?;
        let loaded = self.parse(&text)?;
        *self.loaded.lock().unwrap_or_else(PoisonError::into_inner) = fingerprint;
        Ok(loaded)
    }

    /// Checks `text` as the file's content. Empty documents are skipped.
    pub fn parse(&self, text: &str) -> Result<Loaded, InventoryError> {
        let documents: Documents =
            serde_saphyr::from_str_multiple_with_options(text, parse_options()).map_err(|e| {
                InventoryError::Parse {
                    path: self.path.clone(),
                    message: e.to_string(),
                }
            })?;
        let mut loaded = Loaded {
            proxies: Vec::with_capacity(documents.0.len()),
            credentials: HashMap::new(),
        };
        let mut seen: HashMap<String, usize> = HashMap::new();
        for (i, json) in documents.0.into_iter().enumerate() {
            let index = i + 1;
            let document: Value =
                serde_json::from_str(&json).map_err(|e| InventoryError::Document {
                    path: self.path.clone(),
                    index,
                    name: "unnamed".into(),
                    message: e.to_string(),
                })?;
            if document.is_null() {
                continue;
            }
            let entry =
                self.document(document)
                    .map_err(|(name, message)| InventoryError::Document {
                        path: self.path.clone(),
                        index,
                        name,
                        message,
                    })?;
            let key = match &entry {
                Entry::Proxy(proxy) => proxy.key(),
                Entry::Secret(namespace, name, _) => format!("Secret {namespace}/{name}"),
            };
            if let Some(&first) = seen.get(&key) {
                return Err(InventoryError::Duplicate {
                    path: self.path.clone(),
                    index,
                    first,
                    name: key,
                });
            }
            seen.insert(key, index);
            match entry {
                Entry::Proxy(proxy) => loaded.proxies.push(*proxy),
                Entry::Secret(namespace, name, credentials) => {
                    loaded.credentials.insert((namespace, name), credentials);
                }
            }
        }
        Ok(loaded)
    }

    /// Checks one document; the error carries the object's name and the reason.
    fn document(&self, mut document: Value) -> Result<Entry, (String, String)> {
        let Some(object) = document.as_object_mut() else {
            return Err(("unnamed".into(), "not a mapping".into()));
        };
        let metadata = object
            .entry("metadata")
            .or_insert_with(|| Value::Object(Default::default()));
        let name = metadata
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        if let Some(meta) = metadata.as_object_mut() {
            meta.entry("namespace")
                .or_insert_with(|| Value::String(DEFAULT_NAMESPACE.into()));
        }
        let namespace = metadata
            .get("namespace")
            .and_then(Value::as_str)
            .unwrap_or(DEFAULT_NAMESPACE)
            .to_owned();
        let label = if name.is_empty() {
            "unnamed".to_owned()
        } else {
            format!("{namespace}/{name}")
        };
        let fail = |message: String| (label.clone(), message);
        if name.is_empty() {
            return Err(fail("metadata.name is required".into()));
        }
        let api_version = object.get("apiVersion").and_then(Value::as_str);
        let kind = object.get("kind").and_then(Value::as_str);
        if api_version == Some(SECRET_API_VERSION) && kind == Some(SECRET_KIND) {
            let secret: Secret =
                serde_json::from_value(document).map_err(|e| fail(format!("Secret: {e}")))?;
            let credentials =
                Credentials::from_secret(&secret).map_err(|e| fail(format!("Secret {e}")))?;
            return Ok(Entry::Secret(namespace, name, credentials));
        }
        if api_version != Some(API_VERSION) || kind != Some(KIND) {
            return Err(fail(format!(
                "expected apiVersion {API_VERSION} and kind {KIND} (or a v1 Secret of \
                 credentials), found {} {}",
                api_version.unwrap_or("(none)"),
                kind.unwrap_or("(none)")
            )));
        }
        if let Err(violations) = self.validator.validate_create(&document) {
            let text: Vec<String> = violations.iter().map(ToString::to_string).collect();
            return Err(fail(text.join("; ")));
        }
        let proxy: Proxy = serde_json::from_value(document).map_err(|e| fail(e.to_string()))?;
        if proxy.spec.mode == Mode::Managed {
            return Err(fail(
                "mode Managed needs the operator (`proxy-operator run`); standalone mode serves External proxies only".into(),
            ));
        }
        Ok(Entry::Proxy(Box::new(proxy)))
    }
}

/// One document of the file.
enum Entry {
    Proxy(Box<Proxy>),
    /// A Secret's namespace, name and credentials.
    Secret(String, String, Credentials),
}

/// The documents of a file as the YAML parser hands them over, each kept as compact JSON
/// until it is checked: a document parsed into a `serde_json::Value` takes about 3.7 KB (a
/// B-tree node per mapping), 37 MB for 10,000 proxies all parsed before the first is checked;
/// its JSON text takes a tenth of that.
#[derive(Default)]
struct Documents(Vec<Box<str>>);

impl Extend<Value> for Documents {
    fn extend<I: IntoIterator<Item = Value>>(&mut self, documents: I) {
        self.0.extend(
            documents
                .into_iter()
                .map(|d| d.to_string().into_boxed_str()),
        );
    }
}

/// Size and modification time: cheap to poll, changes on every save.
fn fingerprint(path: &Path) -> Option<Fingerprint> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.len(), meta.modified().ok()?))
}

/// Keeps `inventory` and `credentials` in step with the file: reloads when its size or
/// modification time changes
/// (checked every `poll`, starting with a check right away against the file's last
/// [`load`](InventoryFile::load)) or when `reload` yields (SIGHUP).
/// A load that yields the proxies already in the inventory changes nothing; a broken edit keeps
/// the last good inventory and logs why. Returns when `shutdown` fires.
pub async fn watch(
    file: InventoryFile,
    inventory: Inventory,
    credentials: CredentialStore,
    poll: Duration,
    mut reload: mpsc::Receiver<()>,
    shutdown: CancellationToken,
) {
    let mut last_seen = *file.loaded.lock().unwrap_or_else(PoisonError::into_inner);
    let mut ticker = tokio::time::interval(poll);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let forced = tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = ticker.tick() => false,
            Some(()) = reload.recv() => true,
        };
        let current = fingerprint(file.path());
        if !forced && current == last_seen {
            continue;
        }
        last_seen = current;
        match file.load() {
            Ok(loaded) => {
                credentials.replace(loaded.credentials);
                if !same_proxies(&inventory, &loaded.proxies) {
                    log::info!(
                        "inventory {}: loaded {} proxies",
                        file.path().display(),
                        loaded.proxies.len()
                    );
                    inventory.replace(loaded.proxies);
                }
            }
            Err(e) => log::warn!("{e}; keeping the last good inventory"),
        }
    }
}

/// Whether the inventory already holds exactly `proxies` (the file order does not matter).
fn same_proxies(inventory: &Inventory, proxies: &[Proxy]) -> bool {
    let snapshot = inventory.snapshot();
    snapshot.is_synced()
        && snapshot.len() == proxies.len()
        && proxies
            .iter()
            .all(|p| snapshot.get(&p.id()).is_some_and(|current| **current == *p))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file() -> InventoryFile {
        InventoryFile::new("/srv/inventory.yaml").unwrap()
    }

    const GOOD: &str = "\
apiVersion: crawl.example.com/v1alpha1
kind: Proxy
metadata: {name: a, labels: {geo: eu}}
spec:
  mode: External
  endpoint: {host: 127.0.0.1, port: 3128}
---
apiVersion: crawl.example.com/v1alpha1
kind: Proxy
metadata: {name: b, namespace: crawl}
spec:
  mode: External
  endpoint: {host: 127.0.0.2, port: 3129}
  maxLeases: 0
---
";

    #[test]
    fn parses_documents_with_defaults() {
        let proxies = file().parse(GOOD).unwrap().proxies;
        assert_eq!(proxies.len(), 2);
        assert_eq!(proxies[0].key(), "default/a");
        assert_eq!(proxies[0].labels()["geo"], "eu");
        assert_eq!(proxies[0].spec.max_leases(), 5);
        assert_eq!(proxies[0].spec.health_check().failure_threshold(), 3);
        assert_eq!(proxies[1].key(), "crawl/b");
        assert_eq!(proxies[1].spec.max_leases(), 0);
        assert_eq!(proxies[1].spec.effective_port(None), 3129);
        assert!(!proxies[0].spec.cordoned && !proxies[1].spec.cordoned);
        let cordoned = GOOD.replace("  maxLeases: 0\n", "  maxLeases: 0\n  cordoned: true\n");
        let proxies = file().parse(&cordoned).unwrap().proxies;
        assert!(!proxies[0].spec.cordoned);
        assert!(proxies[1].spec.cordoned);
    }

    fn error(text: &str) -> String {
        file().parse(text).unwrap_err().to_string()
    }

    #[test]
    fn refusals_name_the_file_document_and_reason() {
        let header = "apiVersion: crawl.example.com/v1alpha1\nkind: Proxy\n";
        let cases = [
            (
                format!(
                    "{header}metadata: {{name: m}}\nspec: {{mode: Managed, provider: local}}\n"
                ),
                "document 1 (default/m): mode Managed needs the operator",
            ),
            (
                format!("{header}metadata: {{name: e}}\nspec: {{mode: External}}\n"),
                "endpoint is required when mode is External",
            ),
            (
                format!(
                    "{header}metadata: {{name: p}}\nspec: {{mode: External, endpoint: {{host: h, port: 0}}}}\n"
                ),
                "/spec/endpoint/port",
            ),
            (
                format!("{header}spec: {{mode: External, endpoint: {{host: h, port: 1}}}}\n"),
                "document 1 (unnamed): metadata.name is required",
            ),
            (
                "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n".to_owned(),
                "expected apiVersion crawl.example.com/v1alpha1 and kind Proxy (or a v1 Secret of credentials), found v1 ConfigMap",
            ),
            (
                format!(
                    "{GOOD}{header}metadata: {{name: a}}\nspec: {{mode: External, endpoint: {{host: h, port: 1}}}}\n"
                ),
                "document 3 (default/a) repeats document 1",
            ),
            ("key: [unclosed\n".to_owned(), "/srv/inventory.yaml"),
            (
                format!(
                    "{header}metadata: {{name: d}}\nspec: {{mode: External, endpoint: {{host: h, port: 1}}, healthCheck: {{interval: '30'}}}}\n"
                ),
                "document 1 (default/d): spec.healthCheck.interval: must be a positive duration: numbers each followed by a unit",
            ),
            (
                format!(
                    "{header}metadata: {{name: t}}\nspec: {{mode: External, endpoint: {{host: h, port: 1}}, healthCheck: {{interval: 1s, timeout: 2s}}}}\n"
                ),
                "document 1 (default/t): spec.healthCheck: timeout must not be longer than interval",
            ),
            (
                format!(
                    "{header}metadata: {{name: c}}\nspec: {{mode: External, endpoint: {{host: h, port: 1}}, cordoned: 'yes'}}\n"
                ),
                "document 1 (default/c): /spec/cordoned: \"yes\" is not of type \"boolean\"",
            ),
        ];
        for (text, expected) in cases {
            let message = error(&text);
            assert!(message.contains(expected), "{message:?} lacks {expected:?}");
            assert!(message.contains("/srv/inventory.yaml"), "{message}");
        }
    }

    fn fleet(size: usize) -> String {
        (0..size)
            .map(|i| {
                format!(
                    "apiVersion: crawl.example.com/v1alpha1\nkind: Proxy\n\
                     metadata: {{name: p{i}, labels: {{pool: a, geo: eu, shard: s{}}}}}\n\
                     spec:\n  mode: External\n  endpoint: {{host: 127.0.0.1, port: 3128}}\n  \
                     healthCheck: {{interval: 30s, timeout: 5s}}\n---\n",
                    i % 10
                )
            })
            .collect()
    }

    #[test]
    fn parses_a_fleet_over_the_yaml_parsers_default_budget() {
        // 7,000 documents of ~40 nodes: over the default 1,024 documents and 250,000 nodes.
        let proxies = file().parse(&fleet(7_000)).unwrap().proxies;
        assert_eq!(proxies.len(), 7_000);
        assert_eq!(proxies[6_999].key(), "default/p6999");
    }

    #[test]
    fn refuses_more_documents_than_the_limit() {
        let text = "---\n{}\n".repeat(MAX_DOCUMENTS + 1);
        let message = error(&text);
        assert!(message.contains("Documents"), "{message}");
        assert!(message.contains("/srv/inventory.yaml"), "{message}");
    }

    /// A watch of an inventory file holding `GOOD`, polled every `poll`, started right after
    /// the file was loaded (as at start-up); the inventory gets what was loaded when `fill`.
    struct Watched {
        _dir: tempfile::TempDir,
        path: std::path::PathBuf,
        /// How many proxies the load before the watch read.
        loaded: usize,
        inventory: Inventory,
        reload: mpsc::Sender<()>,
        shutdown: CancellationToken,
        task: tokio::task::JoinHandle<()>,
    }

    impl Watched {
        fn start(poll: Duration, fill: bool) -> Watched {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("inventory.yaml");
            std::fs::write(&path, GOOD).unwrap();
            let file = InventoryFile::new(&path).unwrap();
            let inventory = Inventory::new();
            let proxies = file.load().unwrap().proxies;
            let loaded = proxies.len();
            if fill {
                inventory.replace(proxies);
            }
            let (reload, reload_rx) = mpsc::channel(1);
            let shutdown = CancellationToken::new();
            let task = tokio::spawn(watch(
                file,
                inventory.clone(),
                CredentialStore::default(),
                poll,
                reload_rx,
                shutdown.clone(),
            ));
            Watched {
                _dir: dir,
                path,
                loaded,
                inventory,
                reload,
                shutdown,
                task,
            }
        }

        async fn stop(self) {
            self.shutdown.cancel();
            self.task.await.unwrap();
        }
    }

    #[test]
    fn secrets_beside_the_proxies_hold_their_credentials() {
        let text = format!(
            "{GOOD}apiVersion: v1\nkind: Secret\nmetadata: {{name: paid, namespace: crawl}}\n\
             stringData: {{username: u1, password: p1}}\n---\n\
             apiVersion: v1\nkind: Secret\nmetadata: {{name: other}}\n\
             data: {{username: dTI=, password: cDI=}}\n"
        );
        let loaded = file().parse(&text).unwrap();
        assert_eq!(loaded.proxies.len(), 2);
        let get =
            |ns: &str, name: &str| loaded.credentials[&(ns.to_owned(), name.to_owned())].clone();
        assert_eq!(
            get("crawl", "paid"),
            Credentials {
                username: "u1".into(),
                password: "p1".into()
            }
        );
        assert_eq!(get("default", "other").username, "u2");
        assert_eq!(get("default", "other").password, "p2");

        let broken = format!(
            "{GOOD}apiVersion: v1\nkind: Secret\nmetadata: {{name: paid}}\n\
             stringData: {{username: u1}}\n"
        );
        let message = error(&broken);
        assert!(message.contains("document 3 (default/paid)"), "{message}");
        assert!(message.contains("has no key \"password\""), "{message}");
        let twice = format!(
            "{GOOD}apiVersion: v1\nkind: Secret\nmetadata: {{name: s}}\n\
             stringData: {{username: u, password: p}}\n---\n\
             apiVersion: v1\nkind: Secret\nmetadata: {{name: s}}\n\
             stringData: {{username: u, password: p}}\n"
        );
        assert!(
            error(&twice).contains("repeats document 3"),
            "{}",
            error(&twice)
        );
    }

    #[tokio::test]
    async fn watch_does_not_check_again_what_was_just_loaded() {
        // Left empty on purpose: a reload of the unchanged file would fill it.
        let watched = Watched::start(Duration::from_millis(10), false);
        assert_eq!(watched.loaded, 2);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(watched.inventory.snapshot().version(), 0);
        watched.stop().await;
    }

    #[tokio::test]
    async fn watch_picks_up_a_cordon_and_its_removal() {
        let watched = Watched::start(Duration::from_millis(10), true);
        let (path, inventory) = (&watched.path, &watched.inventory);
        let cordoned_names = || -> Vec<String> {
            inventory
                .snapshot()
                .leasable()
                .iter()
                .filter(|l| l.cordoned)
                .map(|l| l.id.name.clone())
                .collect()
        };
        let wait_for = |expected: &[&str]| {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            let expected: Vec<String> = expected.iter().map(|s| (*s).to_owned()).collect();
            async move {
                while cordoned_names() != expected {
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "cordoned proxies never became {expected:?}"
                    );
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        };
        let cordon_a = GOOD.replacen(
            "  endpoint: {host: 127.0.0.1, port: 3128}\n",
            "  endpoint: {host: 127.0.0.1, port: 3128}\n  cordoned: true\n",
            1,
        );
        std::fs::write(path, &cordon_a).unwrap();
        wait_for(&["a"]).await;
        assert_eq!(inventory.snapshot().len(), 2);
        std::fs::write(path, GOOD).unwrap();
        wait_for(&[]).await;
        watched.stop().await;
    }

    #[tokio::test]
    async fn watch_reloads_on_change_and_keeps_last_good_on_a_broken_edit() {
        let watched = Watched::start(Duration::from_millis(20), true);
        let (path, inventory, reload_tx) = (&watched.path, &watched.inventory, &watched.reload);
        let wait_for = |expected: usize| {
            let inventory = inventory.clone();
            async move {
                let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
                while inventory.snapshot().len() != expected {
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "inventory never reached {expected}"
                    );
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        };
        let one = GOOD.split("---").next().unwrap().to_owned();
        std::fs::write(path, &one).unwrap();
        wait_for(1).await;

        // A broken edit is logged and ignored; the SIGHUP path forces a re-read.
        std::fs::write(path, "apiVersion: [").unwrap();
        reload_tx.send(()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(inventory.snapshot().len(), 1);

        std::fs::write(path, GOOD).unwrap();
        reload_tx.send(()).await.unwrap();
        wait_for(2).await;
        watched.stop().await;
    }
}
