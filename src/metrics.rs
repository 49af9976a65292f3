//! Prometheus metrics of the fleet, in a registry passed around (never the global one), and the
//! server that serves every registered metric on `--metrics-addr` at `/metrics`. The lease
//! API, the health engine, the reconciler and the SQLite ledger register their own beside them.
//!
//! Gauges that describe state (proxies per phase, active leases, active cooldowns) are computed
//! at scrape time from the inventory, the health snapshot and the ledger, so they can never
//! drift or leak series the way incremented gauges do.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use actix_web::dev::Server;
use actix_web::{App, HttpResponse, HttpServer, web};
use prometheus::core::{Collector, Desc};
use prometheus::proto::{Counter, Gauge, Metric, MetricFamily, MetricType};
use prometheus::{Encoder, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder};

use crate::health::{HealthSnapshot, PerProxyGauge, label_pair, scraped_family};
use crate::inventory::{Inventory, InventorySnapshot};
use crate::ledger::Clock;
use crate::ledger::{Ledger, NAMED_TARGETS, OTHER_TARGETS, TargetCooldowns};
use crate::resources::phase::shown_phase;
use crate::resources::pool::member_of;
use crate::resources::proxy::{Phase, ProxyId};
use crate::serving::candidates::CandidateIndex;
use crate::serving::spend::{Priced, ProxySpend, SpendBook, Spends};
use crate::serving::traffic::{Counts, Traffic};

/// Scrape-time gauges over the inventory, health snapshot and ledger.
pub struct FleetCollector {
    inventory: Inventory,
    health: HealthSnapshot,
    /// Health-table positions of the inventory's proxies, kept until either changes.
    positions: CandidateIndex,
    ledger: Arc<dyn Ledger>,
    proxies: IntGaugeVec,
    leases_active: IntGauge,
    /// `maxLeases` summed over the Ready proxies, so active leases can be read against it.
    lease_capacity: IntGauge,
    proxy_leases_active: PerProxyGauge,
    cooldowns_active: IntGauge,
    target_cooldowns: TargetCooldownGauge,
    /// Leases counting per tenant, a gateway session's included.
    tenant_leases: IntGaugeVec,
    /// Gateway sessions' leases counting per tenant.
    tenant_sessions: IntGaugeVec,
    /// Bytes through the gateway per proxy.
    traffic: Traffic,
    proxy_bytes: ProxyBytesCounter,
    /// Money spent per proxy and per tenant (`spec.cost`), in `--cost-currency`.
    spend: SpendCounters,
    /// Spend so far, kept between scrapes; holding it serializes scrapes, which reset and
    /// refill the gauges.
    scrape: Mutex<SpendBook>,
    clock: Arc<dyn Clock>,
}

impl FleetCollector {
    /// A collector reading the given sources, counting spend in `currency` from `clock`'s
    /// now on; register it with `registry.register(Box::new(..))`.
    pub fn new(
        inventory: Inventory,
        health: HealthSnapshot,
        ledger: Arc<dyn Ledger>,
        traffic: Traffic,
        currency: &str,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, prometheus::Error> {
        Ok(FleetCollector {
            inventory,
            health,
            positions: CandidateIndex::default(),
            ledger,
            proxies: IntGaugeVec::new(
                Opts::new("proxy_operator_proxies", "Proxies by phase."),
                &["phase"],
            )?,
            leases_active: IntGauge::new(
                "proxy_operator_leases_active",
                "Leases currently counting towards capacity.",
            )?,
            lease_capacity: IntGauge::new(
                "proxy_operator_lease_capacity",
                "maxLeases summed over the proxies in phase Ready.",
            )?,
            proxy_leases_active: PerProxyGauge::new(
                "proxy_operator_proxy_leases_active",
                "Leases currently counting towards the proxy's capacity.",
            )?,
            cooldowns_active: IntGauge::new(
                "proxy_operator_cooldowns_active",
                "(proxy, target) pairs cooling down after a rate_limited or blocked report.",
            )?,
            target_cooldowns: TargetCooldownGauge::new()?,
            tenant_leases: IntGaugeVec::new(
                Opts::new(
                    "proxy_operator_tenant_leases_active",
                    "Leases counting per tenant (--tenants-file; default: the token file's), \
                     a gateway session's included.",
                ),
                &["tenant"],
            )?,
            tenant_sessions: IntGaugeVec::new(
                Opts::new(
                    "proxy_operator_tenant_sessions_active",
                    "Gateway sessions' leases counting per tenant.",
                ),
                &["tenant"],
            )?,
            traffic,
            proxy_bytes: ProxyBytesCounter::new()?,
            spend: SpendCounters::new(currency)?,
            scrape: Mutex::new(SpendBook::new(clock.now())),
            clock,
        })
    }
}

impl Collector for FleetCollector {
    fn desc(&self) -> Vec<&Desc> {
        let mut descs = self.proxies.desc();
        descs.extend(self.leases_active.desc());
        descs.extend(self.lease_capacity.desc());
        descs.push(self.proxy_leases_active.desc());
        descs.push(&self.proxy_bytes.desc);
        descs.push(&self.spend.proxies);
        descs.push(&self.spend.tenants);
        descs.extend(self.cooldowns_active.desc());
        descs.push(&self.target_cooldowns.desc);
        descs.extend(self.tenant_leases.desc());
        descs.extend(self.tenant_sessions.desc());
        descs
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let mut book = self.scrape.lock().unwrap_or_else(|e| e.into_inner());
        let mut counts = [0i64; Phase::ALL.len()];
        let mut capacity = 0u64;
        // The ledger's counts, read once from its memory (no query per scrape) and released
        // before the walk over the inventory, so a scrape never holds up the ledger's writes.
        let (leases, active_total, cooldowns_active, target_cooldowns, tenants) = {
            let ledger = self.ledger.counts();
            (
                ledger.active_counts(),
                ledger.active_total(),
                ledger.cooldowns_active(),
                ledger.target_cooldowns(),
                ledger.tenant_usage(),
            )
        };
        // Read before the inventory: a proxy that carried bytes was in it by then, so one
        // missing from it is gone, never one added since.
        let counted = self.traffic.counts();
        // Made on every scrape from the inventory: a proxy's series goes with the proxy.
        let (proxy_leases, proxy_bytes, spend) = {
            let snapshot = self.inventory.snapshot();
            let priced: Vec<Priced<'_>> = snapshot
                .entries()
                .map(|(id, proxy)| Priced {
                    uid: &id.uid,
                    cost: proxy.spec.cost.as_ref(),
                    created: proxy.metadata.creation_timestamp.as_ref().map(|t| t.0),
                })
                .collect();
            let spends = book.scrape(self.clock.now(), &priced, &counted);
            let health = self.positions.health(&snapshot, &self.health);
            let mut per_proxy: Vec<(&str, &str, f64)> = Vec::with_capacity(snapshot.len());
            for (position, (id, proxy)) in snapshot.entries().enumerate() {
                let healthy = health.at(position).and_then(|h| h.healthy);
                let phase = shown_phase(proxy, healthy);
                if let Some(i) = Phase::ALL.iter().position(|p| *p == phase) {
                    counts[i] += 1;
                }
                if phase == Phase::Ready {
                    capacity += u64::from(proxy.spec.max_leases());
                }
                // Two objects of one name (a re-created Proxy) share the name's series; the
                // snapshot is sorted by namespace/name, so they are neighbours.
                let active = f64::from(leases.get(&id.uid).copied().unwrap_or(0));
                match per_proxy.last_mut() {
                    Some((namespace, name, sum))
                        if *namespace == id.namespace && *name == id.name =>
                    {
                        *sum += active;
                    }
                    _ => per_proxy.push((&id.namespace, &id.name, active)),
                }
            }
            let bytes = self.proxy_bytes.family(&snapshot, &counted);
            let spend = self.spend.families(&snapshot, &spends);
            self.traffic.forget(&spends.gone);
            (self.proxy_leases_active.family(per_proxy), bytes, spend)
        };
        for (phase, count) in Phase::ALL.iter().zip(counts) {
            self.proxies.with_label_values(&[phase.as_str()]).set(count);
        }
        let mut families = self.proxies.collect();
        self.leases_active
            .set(i64::try_from(active_total).unwrap_or(i64::MAX));
        self.cooldowns_active
            .set(i64::try_from(cooldowns_active).unwrap_or(i64::MAX));
        self.lease_capacity
            .set(i64::try_from(capacity).unwrap_or(i64::MAX));
        families.extend(self.leases_active.collect());
        families.extend(self.lease_capacity.collect());
        families.push(proxy_leases);
        families.push(proxy_bytes);
        families.extend(spend);
        families.extend(self.cooldowns_active.collect());
        // Tenants come from the tenants file, so these series stay few; a tenant without a
        // lease has none.
        self.tenant_leases.reset();
        self.tenant_sessions.reset();
        for (tenant, usage) in &tenants {
            self.tenant_leases
                .with_label_values(&[tenant])
                .set(i64::from(usage.leases));
            self.tenant_sessions
                .with_label_values(&[tenant])
                .set(i64::from(usage.sessions));
        }
        families.extend(self.tenant_leases.collect());
        families.extend(self.tenant_sessions.collect());
        // At most 51 numbers copied from the ledger's memory; none when nothing cools down.
        if let Some(family) = self.target_cooldowns.family(&target_cooldowns) {
            families.push(family);
        }
        families
    }
}

/// `proxy_operator_proxy_bytes_total{namespace,name,pool,direction}`: bytes through the gateway
/// per proxy of the inventory that carried some, `pool` its ProxyPool (empty for a proxy of
/// none), so a pool's and a vendor endpoint's bytes are sums over their proxies. Made at every
/// scrape from [`Traffic`]. A proxy that carried nothing has no series: at 0, those of 10,000
/// idle proxies took a scrape from under 3 MiB to 4.2 MB.
struct ProxyBytesCounter {
    desc: Desc,
}

impl ProxyBytesCounter {
    fn new() -> Result<Self, prometheus::Error> {
        let desc = Desc::new(
            "proxy_operator_proxy_bytes_total".into(),
            "Bytes relayed by the gateway through the proxy: up (to the target) and down (to \
             the crawler)."
                .into(),
            ["direction", "name", "namespace", "pool"]
                .map(String::from)
                .to_vec(),
            HashMap::new(),
        )?;
        Ok(ProxyBytesCounter { desc })
    }

    /// The family for the proxies of `snapshot` among `counted` (what [`Traffic::counts`]
    /// read).
    fn family(
        &self,
        snapshot: &InventorySnapshot,
        counted: &HashMap<String, Counts>,
    ) -> MetricFamily {
        // Two objects of one name (a re-created Proxy) share the name's series, as they do
        // `proxy_operator_proxy_leases_active`; the snapshot is sorted by namespace/name.
        let mut per_name: Vec<(&ProxyId, &str, u64, u64)> = Vec::new();
        for (id, proxy) in snapshot.entries() {
            let Some(&Counts { up, down, .. }) = counted.get(&id.uid) else {
                continue;
            };
            match per_name.last_mut() {
                Some((named, _, sum_up, sum_down))
                    if named.namespace == id.namespace && named.name == id.name =>
                {
                    *sum_up += up;
                    *sum_down += down;
                }
                _ => per_name.push((id, member_of(proxy).unwrap_or_default(), up, down)),
            }
        }
        let mut metrics = Vec::with_capacity(2 * per_name.len());
        for (id, pool, up, down) in per_name {
            if up == 0 && down == 0 {
                continue;
            }
            for (direction, bytes) in [("down", down), ("up", up)] {
                // Sorted by label name, as the registry's own series are.
                let mut metric = Metric::from_label(vec![
                    label_pair("direction", direction),
                    label_pair("name", &id.name),
                    label_pair("namespace", &id.namespace),
                    label_pair("pool", pool),
                ]);
                let mut counter = Counter::default();
                // Exact up to 2^53 bytes (8 PiB) per proxy.
                counter.set_value(bytes as f64);
                metric.set_counter(counter);
                metrics.push(metric);
            }
        }
        scraped_family(&self.desc, MetricType::COUNTER, metrics)
    }
}

/// `proxy_operator_proxy_spend_total{namespace,name,pool,currency,part}` and
/// `proxy_operator_tenant_spend_total{tenant,currency}`: money spent since this process started
/// counting (see `serving::spend`), made at every scrape. A proxy without `spec.cost` has no
/// series; one with a `perHour` has one from the start, bytes or none.
struct SpendCounters {
    proxies: Desc,
    tenants: Desc,
    currency: String,
}

impl SpendCounters {
    fn new(currency: &str) -> Result<Self, prometheus::Error> {
        let proxies = Desc::new(
            "proxy_operator_proxy_spend_total".into(),
            "Money spent on the proxy since this process started counting, in the currency the \
             label names (--cost-currency), by part: bytes (what the gateway relayed through it \
             / 10^9 x spec.cost.perGB; sum over replicas) and hours (the time it existed x \
             spec.cost.perHour; every replica counts them: take the max)."
                .into(),
            ["currency", "name", "namespace", "part", "pool"]
                .map(String::from)
                .to_vec(),
            HashMap::new(),
        )?;
        let tenants = Desc::new(
            "proxy_operator_tenant_spend_total".into(),
            "Money the tenant's gateway traffic cost since this process started counting: its \
             bytes through each proxy / 10^9 x that proxy's spec.cost.perGB (hours are \
             shared by every tenant and counted per proxy only), in the currency the label \
             names."
                .into(),
            ["currency", "tenant"].map(String::from).to_vec(),
            HashMap::new(),
        )?;
        Ok(SpendCounters {
            proxies,
            tenants,
            currency: currency.to_owned(),
        })
    }

    /// The two families of one scrape (`spends` of the proxies of `snapshot`, in its order).
    fn families(&self, snapshot: &InventorySnapshot, spends: &Spends) -> Vec<MetricFamily> {
        // Two objects of one name share the name's series, as they do the bytes.
        let mut per_name: Vec<(&ProxyId, &str, ProxySpend)> = Vec::new();
        for ((id, proxy), spend) in snapshot.entries().zip(&spends.proxies) {
            let Some(spend) = spend else { continue };
            match per_name.last_mut() {
                Some((named, _, sum))
                    if named.namespace == id.namespace && named.name == id.name =>
                {
                    sum.bytes += spend.bytes;
                    sum.hours += spend.hours;
                }
                _ => per_name.push((id, member_of(proxy).unwrap_or_default(), *spend)),
            }
        }
        let counter = |labels, value| {
            let mut metric = Metric::from_label(labels);
            let mut counter = Counter::default();
            counter.set_value(value);
            metric.set_counter(counter);
            metric
        };
        let proxies = per_name
            .into_iter()
            .flat_map(|(id, pool, spend)| {
                [("bytes", spend.bytes), ("hours", spend.hours)].map(|(part, value)| {
                    counter(
                        vec![
                            label_pair("currency", &self.currency),
                            label_pair("name", &id.name),
                            label_pair("namespace", &id.namespace),
                            label_pair("part", part),
                            label_pair("pool", pool),
                        ],
                        value,
                    )
                })
            })
            .collect();
        let tenants = spends
            .tenants
            .iter()
            .map(|(tenant, spend)| {
                counter(
                    vec![
                        label_pair("currency", &self.currency),
                        label_pair("tenant", tenant),
                    ],
                    *spend,
                )
            })
            .collect();
        vec![
            scraped_family(&self.proxies, MetricType::COUNTER, proxies),
            scraped_family(&self.tenants, MetricType::COUNTER, tenants),
        ]
    }
}

/// `proxy_operator_target_cooldowns{target}`: cooldowns in force per target, for the
/// [`NAMED_TARGETS`] targets with the most and `_other` for the rest. Made at every scrape from
/// the ledger's ranking, so a target whose cooldowns ended has no series left behind.
struct TargetCooldownGauge {
    desc: Desc,
}

impl TargetCooldownGauge {
    fn new() -> Result<Self, prometheus::Error> {
        let help = format!(
            "(proxy, target) cooldowns in force per target, only for targets with one: the \
             {NAMED_TARGETS} targets with the most (ties by name), the others summed under \
             target=\"{OTHER_TARGETS}\"."
        );
        let desc = Desc::new(
            "proxy_operator_target_cooldowns".into(),
            help,
            vec!["target".into()],
            HashMap::new(),
        )?;
        Ok(TargetCooldownGauge { desc })
    }

    /// One scrape's family; `None` when no target cools down (the registry would drop an
    /// empty family anyway).
    fn family(&self, cooldowns: &TargetCooldowns) -> Option<MetricFamily> {
        let other = (cooldowns.other > 0).then_some((OTHER_TARGETS, cooldowns.other));
        let metrics: Vec<Metric> = cooldowns
            .named
            .iter()
            .map(|(target, count)| (&**target, *count))
            .chain(other)
            .map(|(target, count)| {
                let mut metric = Metric::from_label(vec![label_pair("target", target)]);
                let mut gauge = Gauge::default();
                // Exact up to 2^53 cooldowns.
                gauge.set_value(count as f64);
                metric.set_gauge(gauge);
                metric
            })
            .collect();
        if metrics.is_empty() {
            return None;
        }
        Some(scraped_family(&self.desc, MetricType::GAUGE, metrics))
    }
}

/// Serves `registry` in the Prometheus text format at `/metrics` on `listener`.
pub fn serve(listener: std::net::TcpListener, registry: Registry) -> std::io::Result<Server> {
    let server = HttpServer::new(move || {
        let registry = registry.clone();
        App::new()
            .route(
                "/metrics",
                web::get().to(move || {
                    let registry = registry.clone();
                    async move { render(&registry) }
                }),
            )
            .route("/healthz", web::get().to(HttpResponse::Ok))
    })
    .workers(1)
    .listen(listener)?
    .disable_signals()
    .shutdown_timeout(2)
    .run();
    Ok(server)
}

fn render(registry: &Registry) -> HttpResponse {
    let mut buffer = Vec::new();
    match TextEncoder::new().encode(&registry.gather(), &mut buffer) {
        Ok(()) => HttpResponse::Ok()
            .content_type(prometheus::TEXT_FORMAT)
            .body(buffer),
        Err(e) => {
            log::error!("cannot encode metrics: {e}");
            HttpResponse::InternalServerError().finish()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::pool::POOL_LABEL;

    #[test]
    fn the_target_gauge_names_the_ranked_targets_then_other_and_nothing_when_none_cools_down() {
        let gauge = TargetCooldownGauge::new().unwrap();
        assert!(gauge.family(&TargetCooldowns::default()).is_none());
        let series = |cooldowns: &TargetCooldowns| -> Vec<(String, f64)> {
            let family = gauge.family(cooldowns).unwrap();
            assert_eq!(family.name(), "proxy_operator_target_cooldowns");
            assert!(family.help().contains("50 targets"), "{}", family.help());
            family
                .get_metric()
                .iter()
                .map(|m| {
                    let label = &m.get_label()[0];
                    assert_eq!(label.name(), "target");
                    (label.value().to_owned(), m.get_gauge().value())
                })
                .collect()
        };
        let named = TargetCooldowns {
            named: vec![("b.example".into(), 3), ("a.example".into(), 1)],
            other: 0,
        };
        assert_eq!(
            series(&named),
            [("b.example".to_owned(), 3.0), ("a.example".to_owned(), 1.0)]
        );
        let with_other = TargetCooldowns { other: 7, ..named };
        assert_eq!(series(&with_other)[2], ("_other".to_owned(), 7.0));
    }

    #[test]
    fn proxy_bytes_name_each_proxy_and_its_pool() {
        use crate::fixtures::external;
        let inventory = Inventory::new();
        let member = external("m-0", "10.0.0.1", 3128)
            .uid(Some("uid-m"))
            .labels(&[(POOL_LABEL, "res")])
            .build();
        let alone = external("alone", "10.0.0.2", 3128)
            .uid(Some("uid-a"))
            .build();
        let idle = external("idle", "10.0.0.3", 3128)
            .uid(Some("uid-i"))
            .build();
        inventory.replace([member, alone, idle]);
        let traffic = Traffic::default();
        let tenant: Arc<str> = "default".into();
        traffic.add("uid-m", &tenant, 10, 2048);
        traffic.add("uid-a", &tenant, 0, 5);
        // An answer without a body through the idle proxy: still nothing carried.
        traffic.add("uid-i", &tenant, 0, 0);
        traffic.add("uid-gone", &tenant, 1, 1);
        let counter = ProxyBytesCounter::new().unwrap();
        let family = counter.family(&inventory.snapshot(), &traffic.counts());
        assert_eq!(family.name(), "proxy_operator_proxy_bytes_total");
        assert_eq!(family.get_field_type(), MetricType::COUNTER);
        let series: Vec<(Vec<String>, f64)> = family
            .get_metric()
            .iter()
            .map(|m| {
                let labels = m.get_label().iter().map(|l| l.value().to_owned());
                (labels.collect(), m.get_counter().value())
            })
            .collect();
        // The idle proxy has none; the namespace is the fixtures'.
        let labels = |values: [&str; 4]| values.map(String::from).to_vec();
        assert_eq!(
            series,
            [
                (labels(["down", "alone", "crawl", ""]), 5.0),
                (labels(["up", "alone", "crawl", ""]), 0.0),
                (labels(["down", "m-0", "crawl", "res"]), 2048.0),
                (labels(["up", "m-0", "crawl", "res"]), 10.0),
            ]
        );
    }

    #[test]
    fn spend_series_name_the_priced_proxies_their_pool_and_the_currency() {
        use crate::fixtures::external;
        let priced = |name: &str, uid: &str| {
            let mut proxy = external(name, "10.0.0.1", 3128)
                .uid(Some(uid))
                .labels(&[(POOL_LABEL, "res")])
                .build();
            proxy.spec.cost =
                Some(serde_json::from_value(serde_json::json!({"perGB": "8"})).unwrap());
            proxy
        };
        let inventory = Inventory::new();
        let free = external("free", "10.0.0.2", 3128)
            .uid(Some("uid-f"))
            .build();
        inventory.replace([priced("m-0", "uid-m"), free]);
        let snapshot = inventory.snapshot();
        let spends = Spends {
            proxies: vec![
                None,
                Some(ProxySpend {
                    bytes: 4.0,
                    hours: 0.5,
                }),
            ],
            tenants: [(Arc::from("team-a"), 3.0)].into(),
            gone: Vec::new(),
        };
        let families = SpendCounters::new("EUR")
            .unwrap()
            .families(&snapshot, &spends);
        let series = |family: &MetricFamily| -> Vec<(Vec<String>, f64)> {
            family
                .get_metric()
                .iter()
                .map(|m| {
                    (
                        m.get_label().iter().map(|l| l.value().to_owned()).collect(),
                        m.get_counter().value(),
                    )
                })
                .collect()
        };
        assert_eq!(families[0].name(), "proxy_operator_proxy_spend_total");
        let labels = |part: &str| -> Vec<String> {
            ["EUR", "m-0", "crawl", part, "res"]
                .map(String::from)
                .to_vec()
        };
        assert_eq!(
            series(&families[0]),
            [(labels("bytes"), 4.0), (labels("hours"), 0.5)]
        );
        assert_eq!(families[1].name(), "proxy_operator_tenant_spend_total");
        assert_eq!(
            series(&families[1]),
            [(vec!["EUR".into(), "team-a".into()], 3.0)]
        );
    }
}
