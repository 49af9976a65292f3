//! The Kubernetes Events about one Proxy, for its status page: what the reconciler recorded
//! (machine created, replaced, refused) is what an SRE reads next after the conditions.

use k8s_openapi::api::core::v1::Event;
use kube::api::{Api, ListParams};

use super::view::KubeEventRow;
use crate::resources::proxy::Proxy;

/// The most Events a proxy's page lists.
const MAX_EVENTS: usize = 20;

/// Where Events are read from: the cluster in operator mode, nowhere in standalone mode.
#[derive(Clone, Default)]
pub struct KubeEvents(Option<kube::Client>);

impl KubeEvents {
    /// Events read through `client`.
    pub fn new(client: kube::Client) -> Self {
        KubeEvents(Some(client))
    }

    /// The newest Events about `proxy` (by its UID, so a re-created Proxy starts afresh);
    /// none in standalone mode or when the API server cannot be read (logged).
    pub async fn of(&self, proxy: &Proxy) -> Vec<KubeEventRow> {
        let (Some(client), Some(namespace), Some(name)) = (
            &self.0,
            proxy.metadata.namespace.as_deref(),
            proxy.metadata.name.as_deref(),
        ) else {
            return Vec::new();
        };
        let mut fields = format!("involvedObject.kind=Proxy,involvedObject.name={name}");
        if let Some(uid) = &proxy.metadata.uid {
            fields.push_str(&format!(",involvedObject.uid={uid}"));
        }
        let api: Api<Event> = Api::namespaced(client.clone(), namespace);
        match api.list(&ListParams::default().fields(&fields)).await {
            Ok(list) => rows(list.items),
            Err(e) => {
                log::warn!("status page: cannot list the Events of Proxy {namespace}/{name}: {e}");
                Vec::new()
            }
        }
    }
}

/// The rows of `events`, newest first, at most [`MAX_EVENTS`].
fn rows(events: Vec<Event>) -> Vec<KubeEventRow> {
    let mut rows: Vec<(Option<jiff::Timestamp>, KubeEventRow)> = events
        .into_iter()
        .map(|e| {
            let last = e
                .series
                .as_ref()
                .and_then(|s| s.last_observed_time.as_ref().map(|t| t.0))
                .or(e.last_timestamp.as_ref().map(|t| t.0))
                .or(e.event_time.as_ref().map(|t| t.0));
            let row = KubeEventRow {
                type_: e.type_.unwrap_or_default(),
                reason: e.reason.unwrap_or_default(),
                message: e.message.unwrap_or_default(),
                count: e.series.and_then(|s| s.count).or(e.count).unwrap_or(1),
                last_seen: last.map(|t| t.to_string()),
            };
            (last, row)
        })
        .collect();
    rows.sort_by_key(|row| std::cmp::Reverse(row.0));
    rows.into_iter()
        .take(MAX_EVENTS)
        .map(|(_, row)| row)
        .collect()
}
