//! The body of `GET /v1/proxies`. For a fleet of thousands of proxies the list is megabytes of
//! JSON, and copying and escaping every name, address and label set on each request dominated
//! its cost. So each proxy's entry is serialised once per inventory snapshot — by
//! [`ProxyView`]'s own `Serialize`, so the shape cannot drift — and cut around the fields that
//! change between requests (health, latency, lease count); a request writes only those.

use std::fmt::Write as _;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use super::types::ProxyView;
use crate::health::{LastFailure, ProxyHealth};
use crate::inventory::InventorySnapshot;
use crate::resources::proxy::{Proxy, ProxyId, proxy_url};

/// What a [`ProxyView`] with placeholder values for the changing fields serialises to between
/// its static head and tail. Every string before it is escaped, so its first occurrence is
/// the field itself.
const PLACEHOLDER: &str = r#","healthy":false,"activeLeases":0,"#;

/// Host and port of a proxy, when it has an address.
pub fn address(proxy: &Proxy) -> Option<(&str, i32)> {
    let host = proxy.spec.effective_host(proxy.status.as_ref())?;
    Some((host, proxy.spec.effective_port(proxy.status.as_ref())))
}

/// The fields of a listed proxy that change between requests.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dynamic {
    /// Whether it passes health checks.
    pub healthy: bool,
    /// Latency of the last probe, in milliseconds.
    pub latency_ms: Option<u64>,
    /// The most recent probe failure; listed only for an unhealthy proxy.
    pub last_failure: Option<LastFailure>,
    /// Leases currently held on it.
    pub active_leases: u32,
}

impl Dynamic {
    /// The changing fields of a proxy with `health` (none yet: unknown) and `active_leases`.
    /// The last failure is kept only when the proxy is unhealthy (not when healthy or unknown).
    pub fn new(health: Option<&ProxyHealth>, active_leases: u32) -> Dynamic {
        Dynamic {
            healthy: health.and_then(|h| h.healthy) == Some(true),
            latency_ms: health
                .and_then(|h| h.latency)
                .map(|l| u64::try_from(l.as_millis()).unwrap_or(u64::MAX)),
            last_failure: health.and_then(ProxyHealth::unhealthy_because),
            active_leases,
        }
    }
}

/// One proxy's entry as serialised JSON, cut around its changing fields.
#[derive(Debug)]
struct Fragment {
    /// `{"name":…,"url":"…"`.
    head: Box<str>,
    /// `"maxLeases":…,"cordoned":…,"draining":…,"labels":{…}}`.
    tail: Box<str>,
}

impl Fragment {
    /// The entry of a proxy with an address; `None` for one without (it is not listed).
    fn new(id: &ProxyId, proxy: &Proxy) -> Option<Fragment> {
        let (host, port) = address(proxy)?;
        let view = ProxyView {
            name: id.name.clone(),
            namespace: id.namespace.clone(),
            host: host.to_owned(),
            port,
            url: proxy_url(proxy.spec.protocol(), host, port),
            healthy: false,
            latency_ms: None,
            last_failure: None,
            active_leases: 0,
            max_leases: proxy.spec.max_leases(),
            cordoned: proxy.spec.cordoned,
            draining: proxy.is_draining(),
            labels: proxy.labels(),
        };
        let json = serde_json::to_string(&view).ok()?;
        let cut = json.find(PLACEHOLDER)?;
        Some(Fragment {
            head: json[..cut].into(),
            tail: json[cut + PLACEHOLDER.len()..].into(),
        })
    }
}

/// The fragments of every proxy of one inventory snapshot, in the snapshot's order.
#[derive(Debug)]
pub struct Fragments {
    snapshot: Weak<InventorySnapshot>,
    entries: Vec<Option<Fragment>>,
}

impl Fragments {
    fn new(snapshot: &Arc<InventorySnapshot>) -> Fragments {
        Fragments {
            snapshot: Arc::downgrade(snapshot),
            entries: snapshot
                .entries()
                .map(|(id, proxy)| Fragment::new(id, proxy))
                .collect(),
        }
    }
}

/// The fragments of the current inventory snapshot, shared by the API's workers and rebuilt
/// on the first list after the inventory changes.
#[derive(Debug, Clone, Default)]
pub struct ProxyListCache {
    current: Arc<Mutex<Option<Arc<Fragments>>>>,
}

impl ProxyListCache {
    /// The fragments of `snapshot`, built if the cache holds another snapshot's.
    pub fn fragments(&self, snapshot: &Arc<InventorySnapshot>) -> Arc<Fragments> {
        let mut current = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        match current.as_ref() {
            Some(fragments) if Weak::ptr_eq(&fragments.snapshot, &Arc::downgrade(snapshot)) => {
                fragments.clone()
            }
            _ => {
                let fragments = Arc::new(Fragments::new(snapshot));
                *current = Some(fragments.clone());
                fragments
            }
        }
    }
}

/// A `{"proxies":[…],"count":N}` body being written.
#[derive(Debug)]
pub struct ListBody {
    json: String,
    count: usize,
}

impl Default for ListBody {
    fn default() -> Self {
        ListBody {
            json: r#"{"proxies":["#.to_owned(),
            count: 0,
        }
    }
}

impl ListBody {
    /// Appends the proxy at `index` of the snapshot the fragments were built from. A proxy
    /// without an address (no fragment) is skipped; returns whether it was listed.
    pub fn push(&mut self, fragments: &Fragments, index: usize, dynamic: Dynamic) -> bool {
        let Some(Some(fragment)) = fragments.entries.get(index) else {
            return false;
        };
        if self.count > 0 {
            self.json.push(',');
        }
        self.json.push_str(&fragment.head);
        // Writing to a String cannot fail.
        let _ = write!(self.json, r#","healthy":{}"#, dynamic.healthy);
        if let Some(latency) = dynamic.latency_ms {
            let _ = write!(self.json, r#","latencyMs":{latency}"#);
        }
        if let Some(failure) = dynamic.last_failure {
            // Neither the kind nor an RFC 3339 time needs escaping.
            let _ = write!(
                self.json,
                r#","lastFailure":{{"kind":"{}","at":"{}""#,
                failure.kind.as_str(),
                failure.at
            );
            if let Some(status) = failure.status {
                let _ = write!(self.json, r#","status":{status}"#);
            }
            self.json.push('}');
        }
        let _ = write!(self.json, r#","activeLeases":{},"#, dynamic.active_leases);
        self.json.push_str(&fragment.tail);
        self.count += 1;
        true
    }

    /// The finished body.
    pub fn finish(mut self) -> String {
        let _ = write!(self.json, r#"],"count":{}}}"#, self.count);
        self.json
    }
}

#[cfg(test)]
mod tests {

    use std::time::Duration;

    use super::*;
    use crate::api::types::{LastFailureView, ProxyList};
    use crate::health::ProbeErrorKind;
    use crate::inventory::Inventory;

    fn proxy(name: &str, host: Option<&str>, labels: &[(&str, &str)]) -> Proxy {
        let proxy = match host {
            Some(host) => crate::fixtures::external(name, host, 3128).max_leases(0),
            None => crate::fixtures::managed(name, "local"),
        };
        proxy.namespace("default").uid(None).labels(labels).build()
    }

    /// The body written from fragments equals serde's serialisation of the same list, for
    /// every kind of entry: with and without latency, escaped strings, an IPv6 host, a label
    /// named like a changing field, a cordoned and draining proxy, and a proxy without an
    /// address (not listed).
    #[test]
    fn body_matches_the_serde_shape() {
        let mut cordoned = proxy("a", Some("10.0.0.1"), &[("geo", "eu")]);
        cordoned.spec.cordoned = true;
        cordoned.metadata.deletion_timestamp = Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(jiff::Timestamp::UNIX_EPOCH),
        );
        let proxies = vec![
            cordoned,
            proxy("b\"quoted\\", Some("2001:db8::1"), &[]),
            proxy("c", None, &[("geo", "us")]),
            proxy("d-ünïcode", Some("h"), &[("healthy", "false"), ("x", "\n")]),
        ];
        let inventory = Inventory::new();
        inventory.replace(proxies);
        let snapshot = inventory.snapshot();
        let failure = LastFailure {
            kind: ProbeErrorKind::ConnectTunnelRefused,
            status: None,
            at: "2026-11-30T22:01:02.345678901Z".parse().unwrap(),
        };
        let dynamics = [
            Dynamic {
                healthy: true,
                latency_ms: Some(12),
                last_failure: None,
                active_leases: 3,
            },
            Dynamic {
                healthy: false,
                latency_ms: None,
                last_failure: Some(failure),
                active_leases: 0,
            },
            Dynamic {
                healthy: true,
                latency_ms: Some(1),
                last_failure: None,
                active_leases: 1,
            },
            Dynamic {
                healthy: false,
                latency_ms: Some(u64::MAX),
                last_failure: Some(LastFailure {
                    kind: ProbeErrorKind::UnexpectedStatus,
                    status: Some(503),
                    ..failure
                }),
                active_leases: u32::MAX,
            },
        ];
        let cache = ProxyListCache::default();
        let fragments = cache.fragments(&snapshot);
        let mut body = ListBody::default();
        let mut expected = Vec::new();
        for (index, ((id, p), dynamic)) in snapshot.entries().zip(dynamics).enumerate() {
            let listed = body.push(&fragments, index, dynamic);
            assert_eq!(listed, address(p).is_some(), "{}", id.name);
            if let Some((host, port)) = address(p) {
                expected.push(ProxyView {
                    name: id.name.clone(),
                    namespace: id.namespace.clone(),
                    host: host.to_owned(),
                    port,
                    url: proxy_url(p.spec.protocol(), host, port),
                    healthy: dynamic.healthy,
                    latency_ms: dynamic.latency_ms,
                    last_failure: dynamic.last_failure.map(LastFailureView::from),
                    active_leases: dynamic.active_leases,
                    max_leases: p.spec.max_leases(),
                    cordoned: p.spec.cordoned,
                    draining: p.is_draining(),
                    labels: p.labels(),
                });
            }
        }
        let expected = serde_json::to_string(&ProxyList {
            count: expected.len(),
            proxies: expected,
        })
        .unwrap();
        let body = body.finish();
        assert_eq!(body, expected);
        let parsed: ProxyList = serde_json::from_str(&body).unwrap();
        let flags: Vec<(bool, bool)> = parsed
            .proxies
            .iter()
            .map(|p| (p.cordoned, p.draining))
            .collect();
        assert_eq!(flags, [(true, true), (false, false), (false, false)]);
    }

    #[test]
    fn the_last_failure_is_listed_only_while_unhealthy() {
        let failure = LastFailure {
            kind: ProbeErrorKind::ConnectRefused,
            status: None,
            at: jiff::Timestamp::UNIX_EPOCH,
        };
        let health = |healthy: Option<bool>, last_failure: Option<LastFailure>| ProxyHealth {
            healthy,
            latency: Some(Duration::from_millis(7)),
            last_failure,
            ..ProxyHealth::default()
        };
        // (name, health, expected healthy, expected last failure)
        let cases = [
            ("not tracked", None, false, None),
            ("unknown", Some(health(None, Some(failure))), false, None),
            (
                "healthy",
                Some(health(Some(true), Some(failure))),
                true,
                None,
            ),
            (
                "unhealthy",
                Some(health(Some(false), Some(failure))),
                false,
                Some(failure),
            ),
            (
                "unhealthy, seeded",
                Some(health(Some(false), None)),
                false,
                None,
            ),
        ];
        for (name, health, healthy, last_failure) in cases {
            let dynamic = Dynamic::new(health.as_ref(), 2);
            assert_eq!(dynamic.healthy, healthy, "{name}");
            assert_eq!(dynamic.last_failure, last_failure, "{name}");
            assert_eq!(dynamic.active_leases, 2, "{name}");
            let latency = health.map(|_| 7);
            assert_eq!(dynamic.latency_ms, latency, "{name}");
        }
    }

    #[test]
    fn empty_list() {
        assert_eq!(ListBody::default().finish(), r#"{"proxies":[],"count":0}"#);
    }

    #[test]
    fn fragments_are_rebuilt_only_when_the_snapshot_changes() {
        let inventory = Inventory::new();
        inventory.replace(vec![proxy("a", Some("h"), &[])]);
        let cache = ProxyListCache::default();
        let first = cache.fragments(&inventory.snapshot());
        assert!(Arc::ptr_eq(&first, &cache.fragments(&inventory.snapshot())));
        inventory.replace(vec![proxy("a", Some("h2"), &[])]);
        let second = cache.fragments(&inventory.snapshot());
        assert!(!Arc::ptr_eq(&first, &second));
        let mut body = ListBody::default();
        let dynamic = Dynamic::new(None, 0);
        assert!(body.push(&second, 0, dynamic));
        assert!(body.finish().contains(r#""host":"h2""#));
    }
}
