//! Decode-or-skip: each raw Proxy from the watch is decoded on its own, and the ones that do
//! not decode are tracked so they are reported once per resourceVersion and counted while
//! they last. Pure: no I/O, driven one watch event at a time.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Resource;
use kube::api::DynamicObject;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;

use crate::resources::proxy::{DEFAULT_NAMESPACE, Proxy};

/// Why a raw object is not a readable Proxy: the path of the offending field and the
/// decoder's reason, e.g. `spec.healthCheck.interval: "30" is not a duration: ...`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct DecodeError(String);

/// Decodes one raw object into a Proxy. Never panics: a decoder that panics on some input
/// (kube's duration parser does, on `"1s-5s"`) would otherwise take the whole watch down,
/// which is the failure this module exists to prevent.
///
/// `metadata.managedFields` is left out: nothing in the operator reads it, and it is the
/// larger part of a Proxy's metadata (one entry per writer: the creating client, the status
/// writer, a label editor), which a store of 10,000 Proxies would otherwise keep in memory.
pub fn decode(raw: &DynamicObject) -> Result<Proxy, DecodeError> {
    let mut value = serde_json::to_value(raw).map_err(|e| DecodeError(e.to_string()))?;
    if let Some(metadata) = value.get_mut("metadata").and_then(|m| m.as_object_mut()) {
        metadata.remove("managedFields");
    }
    let decoded = catch_unwind(AssertUnwindSafe(|| {
        serde_path_to_error::deserialize::<_, Proxy>(value)
    }));
    match decoded {
        Ok(Ok(proxy)) => Ok(proxy),
        Ok(Err(e)) => {
            let path = e.path().to_string();
            let inner = e.into_inner();
            Err(DecodeError(if path == "." {
                inner.to_string()
            } else {
                format!("{path}: {inner}")
            }))
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "no message".to_owned());
            Err(DecodeError(format!("the decoder panicked: {what}")))
        }
    }
}

/// A Proxy the operator skips because it does not decode: what its Warning Event and log
/// line say.
#[derive(Debug, Clone, PartialEq)]
pub struct Undecodable {
    /// `namespace/name`.
    pub key: String,
    /// The object, at the resourceVersion that failed, for the Event's `regarding`.
    pub reference: ObjectReference,
    /// Why it does not decode.
    pub error: DecodeError,
}

/// What one raw watch event means for the decoded Proxy store.
#[derive(Debug, Clone)]
pub enum StoreChange {
    /// Apply this decoded event.
    Forward(Box<watcher::Event<Proxy>>),
    /// The object no longer decodes: remove whatever earlier version the store holds.
    Evict(ObjectRef<Proxy>),
    /// Nothing to store.
    None,
}

/// The outcome of one raw watch event.
#[derive(Debug, Clone)]
pub struct Triage {
    /// What the store does.
    pub change: StoreChange,
    /// A Proxy newly found undecodable (or at a new resourceVersion), to report once.
    pub report: Option<Undecodable>,
    /// A Proxy that decodes again after being skipped, by `namespace/name`.
    pub recovered: Option<String>,
    /// The UID of a Proxy the API server deleted (decodable or not; never one only evicted
    /// from the store because it stopped decoding).
    pub deleted: Option<String>,
}

/// The Proxies currently skipped, with the resourceVersion each was reported at.
///
/// A Proxy that decoded before and no longer does is **evicted**: it leaves the store, so the
/// inventory (no probes, no leases) and the reconciler (no reconcile) drop it, while its
/// machine is left alone — the reconciler never acts on an object it does not see, and orphan
/// GC counts it as live (GC lists Proxy metadata, which still decodes). Keeping the last good
/// version instead would keep acting on a spec the user has since replaced: leasing a proxy
/// whose intended settings are unknown, or recreating a machine from an outdated spec. The
/// Event, the log line and the gauge say what happened; fixing the object brings it back.
#[derive(Debug, Default)]
pub struct SkipList {
    /// `namespace/name` → resourceVersion of every undecodable Proxy.
    current: HashMap<String, String>,
    /// The same, rebuilt during a re-list; replaces `current` when the list completes.
    relisting: Option<HashMap<String, String>>,
}

impl SkipList {
    /// Number of Proxies skipped now (the gauge's value).
    pub fn len(&self) -> usize {
        self.current.len()
    }

    /// Whether no Proxy is skipped.
    pub fn is_empty(&self) -> bool {
        self.current.is_empty()
    }

    /// Classifies one raw watch event.
    pub fn triage(&mut self, event: watcher::Event<DynamicObject>) -> Triage {
        match event {
            watcher::Event::Init => {
                self.relisting = Some(HashMap::new());
                Triage::forward(watcher::Event::Init)
            }
            watcher::Event::InitApply(raw) => match decode(&raw) {
                Ok(proxy) => Triage::forward(watcher::Event::InitApply(proxy)),
                Err(error) => {
                    let (key, version) = identity(&raw);
                    let report = self.is_new(&key, &version).then(|| report(&raw, error));
                    self.relisting
                        .get_or_insert_with(HashMap::new)
                        .insert(key, version);
                    // The store swaps in the new list at InitDone; nothing to evict.
                    Triage {
                        change: StoreChange::None,
                        report,
                        recovered: None,
                        deleted: None,
                    }
                }
            },
            watcher::Event::InitDone => {
                if let Some(relisted) = self.relisting.take() {
                    self.current = relisted;
                }
                Triage::forward(watcher::Event::InitDone)
            }
            watcher::Event::Apply(raw) => match decode(&raw) {
                Ok(proxy) => {
                    let (key, _) = identity(&raw);
                    let recovered = self.current.remove(&key).map(|_| key);
                    Triage {
                        change: StoreChange::Forward(Box::new(watcher::Event::Apply(proxy))),
                        report: None,
                        recovered,
                        deleted: None,
                    }
                }
                Err(error) => {
                    let (key, version) = identity(&raw);
                    let report = self.is_new(&key, &version).then(|| report(&raw, error));
                    self.current.insert(key, version);
                    Triage {
                        change: StoreChange::Evict(object_ref(&raw)),
                        report,
                        recovered: None,
                        deleted: None,
                    }
                }
            },
            watcher::Event::Delete(raw) => {
                let (key, _) = identity(&raw);
                self.current.remove(&key);
                let change = match decode(&raw) {
                    Ok(proxy) => StoreChange::Forward(Box::new(watcher::Event::Delete(proxy))),
                    Err(_) => StoreChange::Evict(object_ref(&raw)),
                };
                Triage {
                    change,
                    report: None,
                    recovered: None,
                    deleted: raw.metadata.uid.clone(),
                }
            }
        }
    }

    /// Whether `key` at `version` has not been reported yet (by the current list, or earlier
    /// in a re-list in progress).
    fn is_new(&self, key: &str, version: &str) -> bool {
        let seen = |set: &HashMap<String, String>| set.get(key).is_some_and(|v| v == version);
        !seen(&self.current) && !self.relisting.as_ref().is_some_and(seen)
    }
}

impl Triage {
    fn forward(event: watcher::Event<Proxy>) -> Self {
        Triage {
            change: StoreChange::Forward(Box::new(event)),
            report: None,
            recovered: None,
            deleted: None,
        }
    }
}

/// `namespace/name` and resourceVersion of a raw object.
fn identity(raw: &DynamicObject) -> (String, String) {
    let namespace = raw
        .metadata
        .namespace
        .as_deref()
        .unwrap_or(DEFAULT_NAMESPACE);
    let name = raw.metadata.name.as_deref().unwrap_or_default();
    let version = raw.metadata.resource_version.clone().unwrap_or_default();
    (format!("{namespace}/{name}"), version)
}

/// The store key of a raw Proxy (namespace and name).
fn object_ref(raw: &DynamicObject) -> ObjectRef<Proxy> {
    let name = raw.metadata.name.as_deref().unwrap_or_default();
    match raw.metadata.namespace.as_deref() {
        Some(namespace) => ObjectRef::new(name).within(namespace),
        None => ObjectRef::new(name),
    }
}

fn report(raw: &DynamicObject, error: DecodeError) -> Undecodable {
    let (key, _) = identity(raw);
    Undecodable {
        key,
        reference: ObjectReference {
            api_version: Some(Proxy::api_version(&()).into_owned()),
            kind: Some(Proxy::kind(&()).into_owned()),
            namespace: raw.metadata.namespace.clone(),
            name: raw.metadata.name.clone(),
            uid: raw.metadata.uid.clone(),
            resource_version: raw.metadata.resource_version.clone(),
            ..ObjectReference::default()
        },
        error,
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use serde_json::{Value, json};

    /// A raw Proxy object as the watch delivers it, with `interval` as stored (any JSON).
    pub(in crate::proxy_watch) fn raw(name: &str, version: &str, interval: Value) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "crawl.example.com/v1alpha1",
            "kind": "Proxy",
            "metadata": {"name": name, "namespace": "crawl", "uid": format!("uid-{name}"),
                         "resourceVersion": version},
            "spec": {
                "mode": "External",
                "endpoint": {"host": "10.0.0.1", "port": 3128},
                "healthCheck": {"interval": interval},
            },
        }))
        .unwrap()
    }

    /// A Proxy that decodes.
    pub(in crate::proxy_watch) fn good(name: &str, version: &str) -> DynamicObject {
        raw(name, version, json!("30s"))
    }

    /// A Proxy stored before the CRD checked durations: `interval: "30"` does not decode.
    pub(in crate::proxy_watch) fn bad(name: &str, version: &str) -> DynamicObject {
        raw(name, version, json!("30"))
    }

    #[test]
    fn decode_leaves_out_the_managed_fields_only() {
        let mut raw = good("a", "1");
        raw.metadata.labels = Some([("geo".to_owned(), "eu".to_owned())].into());
        raw.metadata.managed_fields = Some(vec![Default::default(), Default::default()]);
        let proxy = decode(&raw).unwrap();
        assert_eq!(proxy.metadata.managed_fields, None);
        assert_eq!(proxy.metadata.uid.as_deref(), Some("uid-a"));
        assert_eq!(proxy.metadata.resource_version.as_deref(), Some("1"));
        assert_eq!(proxy.labels().get("geo").map(String::as_str), Some("eu"));
        assert_eq!(proxy.spec.endpoint.map(|e| e.port), Some(3128));
    }

    #[test]
    fn decode_names_the_field_and_the_reason() {
        let mut missing_mode = good("m", "1");
        missing_mode.data["spec"]
            .as_object_mut()
            .unwrap()
            .remove("mode");
        let mut wrong_type = good("w", "1");
        wrong_type.data["spec"]["maxLeases"] = json!("five");
        let cases: Vec<(&str, DynamicObject, Result<(), &str>)> = vec![
            ("a good object", good("g", "1"), Ok(())),
            (
                "no unit",
                bad("b", "1"),
                Err("spec.healthCheck.interval: \"30\" is not a duration"),
            ),
            (
                "a string kube's parser panics on",
                raw("p", "1", json!("1s-5s")),
                Err("spec.healthCheck.interval: \"1s-5s\" is not a duration"),
            ),
            (
                "a missing field",
                missing_mode,
                Err("spec: missing field `mode`"),
            ),
            (
                "a wrong type",
                wrong_type,
                Err("spec.maxLeases: invalid type"),
            ),
        ];
        for (case, object, expected) in cases {
            match (decode(&object), expected) {
                (Ok(proxy), Ok(())) => assert_eq!(proxy.key(), "crawl/g", "{case}"),
                (Err(e), Err(text)) => assert!(e.to_string().starts_with(text), "{case}: {e}"),
                (got, _) => panic!("{case}: {got:?}"),
            }
        }
    }

    /// A compact view of a triage: the store change, then `+report` and `+recovered` flags and
    /// `+deleted <uid>`.
    fn summary(t: &Triage) -> String {
        let mut text = match &t.change {
            StoreChange::Forward(event) => match event.as_ref() {
                watcher::Event::Init => "init".to_owned(),
                watcher::Event::InitApply(p) => format!("init-apply {}", p.key()),
                watcher::Event::InitDone => "init-done".to_owned(),
                watcher::Event::Apply(p) => format!("apply {}", p.key()),
                watcher::Event::Delete(p) => format!("delete {}", p.key()),
            },
            StoreChange::Evict(r) => format!("evict {}", r.name),
            StoreChange::None => "none".to_owned(),
        };
        if t.report.is_some() {
            text.push_str(" +report");
        }
        if t.recovered.is_some() {
            text.push_str(" +recovered");
        }
        if let Some(uid) = &t.deleted {
            text.push_str(&format!(" +deleted {uid}"));
        }
        text
    }

    /// One step of a watch: what happens, the raw event, the triage, the skipped count after.
    type Step = (
        &'static str,
        watcher::Event<DynamicObject>,
        &'static str,
        usize,
    );

    #[test]
    fn triage_sequence_reports_once_per_version_and_counts_what_is_skipped() {
        use watcher::Event::{Apply, Delete, Init, InitApply, InitDone};
        let steps: Vec<Step> = vec![
            ("list starts", Init, "init", 0),
            (
                "good listed",
                InitApply(good("a", "1")),
                "init-apply crawl/a",
                0,
            ),
            (
                "bad listed: reported, not stored",
                InitApply(bad("b", "2")),
                "none +report",
                0,
            ),
            ("list done: b counted", InitDone, "init-done", 1),
            ("good edited", Apply(good("a", "3")), "apply crawl/a", 1),
            ("good turns bad", Apply(bad("a", "4")), "evict a +report", 2),
            (
                "same version: not reported again",
                Apply(bad("a", "4")),
                "evict a",
                2,
            ),
            (
                "edited, still bad",
                Apply(bad("a", "5")),
                "evict a +report",
                2,
            ),
            (
                "fixed",
                Apply(good("a", "6")),
                "apply crawl/a +recovered",
                1,
            ),
            ("re-list starts", Init, "init", 1),
            (
                "b unchanged: not reported again",
                InitApply(bad("b", "2")),
                "none",
                1,
            ),
            ("c new and bad", InitApply(bad("c", "7")), "none +report", 1),
            ("re-list done", InitDone, "init-done", 2),
            (
                "bad one deleted",
                Delete(bad("c", "8")),
                "evict c +deleted uid-c",
                1,
            ),
            (
                "good one deleted",
                Delete(good("a", "9")),
                "delete crawl/a +deleted uid-a",
                1,
            ),
            ("re-list without b (deleted meanwhile)", Init, "init", 1),
            ("re-list done: nothing skipped", InitDone, "init-done", 0),
            (
                "b re-created, bad",
                Apply(bad("b", "10")),
                "evict b +report",
                1,
            ),
        ];
        let mut skipped = SkipList::default();
        for (step, event, expected, count) in steps {
            let triage = skipped.triage(event);
            assert_eq!(summary(&triage), expected, "{step}");
            assert_eq!(skipped.len(), count, "{step}");
        }
    }

    #[test]
    fn reports_name_the_object_and_its_version() {
        let mut skipped = SkipList::default();
        let triage = skipped.triage(watcher::Event::Apply(bad("b", "42")));
        let report = triage.report.unwrap();
        assert_eq!(report.key, "crawl/b");
        assert_eq!(report.reference.name.as_deref(), Some("b"));
        assert_eq!(report.reference.namespace.as_deref(), Some("crawl"));
        assert_eq!(report.reference.uid.as_deref(), Some("uid-b"));
        assert_eq!(report.reference.resource_version.as_deref(), Some("42"));
        assert_eq!(report.reference.kind.as_deref(), Some("Proxy"));
        assert_eq!(
            report.reference.api_version.as_deref(),
            Some("crawl.example.com/v1alpha1")
        );
        assert!(
            report
                .error
                .to_string()
                .starts_with("spec.healthCheck.interval: \"30\" is not a duration"),
            "{}",
            report.error
        );
    }
}
