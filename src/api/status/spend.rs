//! What the status page shows of money and traffic over time, as data: spend per tenant, pool
//! and proxy over the current hour and day (`SpendView`), and per tenant and per target the
//! bytes and spend of each hour of the day and the success rate of each minute of the hour
//! (`ChartsView`). Built by pure functions from the ledger's hourly rows, the proxies' `cost`
//! and the gateway's outcomes.
//!
//! A window is whole UTC hours, as the ledger's rows are: the hour is the one now is in (since
//! its start), the day that hour and the 23 before. Spend is bytes ÷ 10^9 × the `perGB` of the
//! proxy that carried them, at its current price (a proxy no longer in the inventory has none:
//! its bytes show, unpriced), plus, for proxies and pools, `perHour` × the time each proxy of
//! the inventory existed within the window. A tenant's spend is per GB only: a proxy's hours
//! are paid whoever uses it, so they are the proxy's and its pool's, not any one tenant's; and
//! a tenant other than `default` sees only what its own bytes cost.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;
use utoipa::ToSchema;

use crate::ledger::{HOUR_MS, TrafficBytes, TrafficHour, hour_start};
use crate::resources::cost::Cost;
use crate::serving::outcomes::{OutcomeCounts, PerMinute};
use crate::serving::spend::seconds_between;

/// Hours in the day window.
pub const DAY_HOURS: i64 = 24;

/// Targets charted: the busiest of the day.
pub const CHARTED_TARGETS: usize = 10;

/// Proxies listed per window: those that cost the most.
pub const LISTED_PROXIES: usize = 100;

/// The start of the first minute of the hour of minutes at `now_ms` (the minute holding now
/// and the 59 before), as the gateway's outcomes count them.
pub fn minutes_start(now_ms: i64) -> i64 {
    (now_ms.div_euclid(60_000) - 59) * 60_000
}

/// The start of the 24 hours' window at `now_ms`: the hour now is in and the 23 before.
pub fn window_start(now_ms: i64) -> i64 {
    hour_start(now_ms) - (DAY_HOURS - 1) * HOUR_MS
}

/// A proxy of the inventory the viewer may see, as spend reads it.
#[derive(Debug, Clone, Copy)]
pub struct PricedProxy<'a> {
    /// Its namespace.
    pub namespace: &'a str,
    /// Its name.
    pub name: &'a str,
    /// Its ProxyPool (`crawl.example.com/pool`), if any.
    pub pool: Option<&'a str>,
    /// Its `spec.cost`.
    pub cost: Option<&'a Cost>,
    /// When it was created, ms since the epoch (none: before any window).
    pub created_ms: Option<i64>,
}

/// What spend and charts are built from.
#[derive(Debug, Clone, Copy)]
pub struct SpendInputs<'a> {
    /// Now, ms since the epoch.
    pub now_ms: i64,
    /// `--cost-currency`.
    pub currency: &'a str,
    /// The day's hourly rows the viewer may see (its own, or every tenant's).
    pub rows: &'a [TrafficHour],
    /// The proxies of the inventory in the viewer's scope.
    pub proxies: &'a [PricedProxy<'a>],
    /// Whether the proxies' hours are counted (the fleet's view; a tenant's is per GB only).
    pub hours: bool,
}

/// Spend of one tenant, pool or proxy over a window.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SpendRow {
    /// The tenant, `namespace/pool` or `namespace/name`.
    pub name: String,
    /// Bytes relayed, up and down.
    pub bytes: u64,
    /// What the bytes cost (`perGB`).
    pub bytes_spend: f64,
    /// What the hours cost (`perHour`); 0 for a tenant.
    pub hours_spend: f64,
    /// The two together.
    pub spend: f64,
}

/// Spend over one window.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SpendWindow {
    /// The start of the window (a UTC hour), ms since the epoch.
    pub since_ms: i64,
    /// Everything the viewer sees cost in the window.
    pub total: f64,
    /// Bytes relayed in the window.
    pub bytes: u64,
    /// Per tenant, costliest first.
    pub tenants: Vec<SpendRow>,
    /// Per ProxyPool (`namespace/pool`), costliest first.
    pub pools: Vec<SpendRow>,
    /// Per proxy, costliest first, at most 100.
    pub proxies: Vec<SpendRow>,
}

/// Spend over the current hour and day.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct SpendView {
    /// The currency of every amount (`--cost-currency`).
    pub currency: String,
    /// Since the start of the current UTC hour.
    pub hour: SpendWindow,
    /// Since the start of the 23rd hour before it.
    pub day: SpendWindow,
}

/// One tenant's or target's series.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ChartSeries {
    /// The tenant or target.
    pub name: String,
    /// Bytes per hour of the day, oldest first (24).
    pub bytes: Vec<u64>,
    /// Spend (`perGB`) per hour of the day, oldest first (24).
    pub spend: Vec<f64>,
    /// Success rate per minute of the hour, oldest first (60), `null` for a minute without
    /// outcome; absent where the viewer may not see it (a target's, counted over every
    /// tenant, to the `default` tenant only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub success_rate: Option<Vec<Option<f64>>>,
}

/// Per tenant and per target, hour by hour over the day and minute by minute over the hour.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ChartsView {
    /// The currency of `spend`.
    pub currency: String,
    /// The start of the first hour of `bytes` and `spend`, ms since the epoch.
    pub hours_from_ms: i64,
    /// The start of the first minute of `successRate`, ms since the epoch.
    pub minutes_from_ms: i64,
    /// The tenants the viewer sees, by name.
    pub tenants: Vec<ChartSeries>,
    /// The day's busiest targets (at most 10), busiest first.
    pub targets: Vec<ChartSeries>,
}

/// The prices by `namespace/name`.
fn prices<'a>(proxies: &[PricedProxy<'a>]) -> HashMap<(&'a str, &'a str), &'a Cost> {
    proxies
        .iter()
        .filter_map(|p| Some(((p.namespace, p.name), p.cost?)))
        .collect()
}

/// What the bytes of `row` cost.
fn row_spend(prices: &HashMap<(&str, &str), &Cost>, row: &TrafficBytes) -> f64 {
    prices
        .get(&(row.namespace.as_str(), row.name.as_str()))
        .map_or(0.0, |cost| cost.of_bytes(row.total()))
}

/// Adds to the row named `name`.
fn add(
    rows: &mut BTreeMap<String, SpendRow>,
    name: String,
    bytes: u64,
    bytes_spend: f64,
    hours_spend: f64,
) {
    let row = rows.entry(name.clone()).or_insert(SpendRow {
        name,
        bytes: 0,
        bytes_spend: 0.0,
        hours_spend: 0.0,
        spend: 0.0,
    });
    row.bytes = row.bytes.saturating_add(bytes);
    row.bytes_spend += bytes_spend;
    row.hours_spend += hours_spend;
    row.spend = row.bytes_spend + row.hours_spend;
}

/// The rows, costliest first (then busiest, then by name), at most `limit`.
fn ranked(rows: BTreeMap<String, SpendRow>, limit: usize) -> Vec<SpendRow> {
    let mut rows: Vec<SpendRow> = rows.into_values().collect();
    rows.sort_by(|a, b| {
        b.spend
            .total_cmp(&a.spend)
            .then(b.bytes.cmp(&a.bytes))
            .then_with(|| a.name.cmp(&b.name))
    });
    rows.truncate(limit);
    rows
}

/// Spend over the window from `since_ms` to now.
pub fn spend_window(inputs: &SpendInputs<'_>, since_ms: i64) -> SpendWindow {
    let prices = prices(inputs.proxies);
    let mut tenants = BTreeMap::new();
    let mut pools = BTreeMap::new();
    let mut proxies = BTreeMap::new();
    let mut bytes_total = 0u64;
    for TrafficHour { bytes: row, .. } in inputs.rows.iter().filter(|r| r.hour_ms >= since_ms) {
        let bytes = row.total();
        let spend = row_spend(&prices, row);
        bytes_total = bytes_total.saturating_add(bytes);
        add(&mut tenants, row.tenant.clone(), bytes, spend, 0.0);
        add(
            &mut proxies,
            format!("{}/{}", row.namespace, row.name),
            bytes,
            spend,
            0.0,
        );
        if let Some(pool) = &row.pool {
            add(
                &mut pools,
                format!("{}/{pool}", row.namespace),
                bytes,
                spend,
                0.0,
            );
        }
    }
    if inputs.hours {
        for proxy in inputs.proxies {
            let Some(cost) = proxy.cost.filter(|c| c.per_hour.is_some()) else {
                continue;
            };
            let from = proxy.created_ms.unwrap_or(since_ms).max(since_ms);
            let seconds = seconds_between(
                jiff::Timestamp::from_millisecond(from).unwrap_or(jiff::Timestamp::UNIX_EPOCH),
                jiff::Timestamp::from_millisecond(inputs.now_ms)
                    .unwrap_or(jiff::Timestamp::UNIX_EPOCH),
            );
            let spend = cost.of_seconds(seconds);
            add(
                &mut proxies,
                format!("{}/{}", proxy.namespace, proxy.name),
                0,
                0.0,
                spend,
            );
            if let Some(pool) = proxy.pool {
                add(
                    &mut pools,
                    format!("{}/{pool}", proxy.namespace),
                    0,
                    0.0,
                    spend,
                );
            }
        }
    }
    let total = proxies.values().map(|r| r.spend).sum();
    SpendWindow {
        since_ms,
        total,
        bytes: bytes_total,
        tenants: ranked(tenants, usize::MAX),
        pools: ranked(pools, usize::MAX),
        proxies: ranked(proxies, LISTED_PROXIES),
    }
}

/// Spend over the current hour and day.
pub fn spend_view(inputs: &SpendInputs<'_>) -> SpendView {
    SpendView {
        currency: inputs.currency.to_owned(),
        hour: spend_window(inputs, hour_start(inputs.now_ms)),
        day: spend_window(inputs, window_start(inputs.now_ms)),
    }
}

/// Success rates of each minute of `minutes`.
pub fn success_rates(minutes: &PerMinute) -> Vec<Option<f64>> {
    minutes
        .minutes
        .iter()
        .map(OutcomeCounts::success_rate)
        .collect()
}

/// Bytes and spend per hour of the day of the rows `pick` keeps.
fn hourly(inputs: &SpendInputs<'_>, pick: impl Fn(&TrafficHour) -> bool) -> (Vec<u64>, Vec<f64>) {
    let prices = prices(inputs.proxies);
    let from = window_start(inputs.now_ms);
    let hours = usize::try_from(DAY_HOURS).unwrap_or(24);
    let (mut bytes, mut spend) = (vec![0u64; hours], vec![0.0; hours]);
    for row in inputs.rows.iter().filter(|r| pick(r)) {
        let Ok(slot) = usize::try_from((row.hour_ms - from).div_euclid(HOUR_MS)) else {
            continue;
        };
        if slot < hours {
            bytes[slot] = bytes[slot].saturating_add(row.bytes.total());
            spend[slot] += row_spend(&prices, &row.bytes);
        }
    }
    (bytes, spend)
}

/// The charts of `tenants` (with their minutes of outcomes) and of the day's busiest targets
/// (with theirs, where the viewer may see them: `target_minutes` gives `None` otherwise).
pub fn charts_view(
    inputs: &SpendInputs<'_>,
    tenants: &[(String, PerMinute)],
    target_minutes: impl Fn(&str) -> Option<PerMinute>,
    minutes_from_ms: i64,
) -> ChartsView {
    let tenants = tenants
        .iter()
        .map(|(name, minutes)| {
            let (bytes, spend) = hourly(inputs, |r| r.bytes.tenant == *name);
            ChartSeries {
                name: name.clone(),
                bytes,
                spend,
                success_rate: Some(success_rates(minutes)),
            }
        })
        .collect();
    let mut busiest: BTreeMap<&str, u64> = BTreeMap::new();
    for row in inputs
        .rows
        .iter()
        .filter(|r| r.hour_ms >= window_start(inputs.now_ms))
    {
        let sum = busiest.entry(row.bytes.target.as_str()).or_default();
        *sum = sum.saturating_add(row.bytes.total());
    }
    let mut busiest: Vec<(&str, u64)> = busiest.into_iter().collect();
    busiest.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(b.0)));
    busiest.truncate(CHARTED_TARGETS);
    let targets = busiest
        .into_iter()
        .map(|(target, _)| {
            let (bytes, spend) = hourly(inputs, |r| r.bytes.target == target);
            ChartSeries {
                name: target.to_owned(),
                bytes,
                spend,
                success_rate: target_minutes(target).map(|m| success_rates(&m)),
            }
        })
        .collect();
    ChartsView {
        currency: inputs.currency.to_owned(),
        hours_from_ms: window_start(inputs.now_ms),
        minutes_from_ms,
        tenants,
        targets,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2026-12-07 10:30 UTC.
    const NOW: i64 = 1_796_637_600_000 + 30 * 60_000;
    const TEN: i64 = 1_796_637_600_000;

    fn row(
        hour_ms: i64,
        tenant: &str,
        name: &str,
        pool: Option<&str>,
        target: &str,
        bytes: u64,
    ) -> TrafficHour {
        TrafficHour {
            hour_ms,
            bytes: TrafficBytes {
                tenant: tenant.into(),
                namespace: "crawl".into(),
                name: name.into(),
                pool: pool.map(str::to_owned),
                target: target.into(),
                up: bytes / 4,
                down: bytes - bytes / 4,
            },
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn windows_are_whole_utc_hours() {
        assert_eq!(hour_start(NOW), TEN);
        assert_eq!(hour_start(TEN), TEN);
        assert_eq!(window_start(NOW), TEN - 23 * HOUR_MS);
    }

    #[test]
    fn spend_is_bytes_times_per_gb_plus_existence_times_per_hour() {
        let vendor = Cost::of_prices(Some("8"), None);
        let vm = Cost::of_prices(Some("1"), Some("2"));
        let proxies = [
            PricedProxy {
                namespace: "crawl",
                name: "vendor",
                pool: None,
                cost: Some(&vendor),
                created_ms: None,
            },
            PricedProxy {
                namespace: "crawl",
                name: "vm-0",
                pool: Some("eu"),
                cost: Some(&vm),
                created_ms: Some(TEN - 2 * HOUR_MS),
            },
            PricedProxy {
                namespace: "crawl",
                name: "free",
                pool: None,
                cost: None,
                created_ms: None,
            },
        ];
        let rows = [
            row(
                TEN - 5 * HOUR_MS,
                "a",
                "vendor",
                None,
                "x.example",
                1_000_000_000,
            ),
            row(TEN, "a", "vendor", None, "x.example", 500_000_000),
            row(TEN, "b", "vm-0", Some("eu"), "y.example", 1_000_000_000),
            row(TEN, "b", "free", None, "y.example", 7),
            row(TEN, "b", "deleted", Some("eu"), "y.example", 1_000_000_000),
            row(
                TEN - 30 * HOUR_MS,
                "a",
                "vendor",
                None,
                "x.example",
                1_000_000_000,
            ),
        ];
        let inputs = SpendInputs {
            now_ms: NOW,
            currency: "EUR",
            rows: &rows,
            proxies: &proxies,
            hours: true,
        };
        let view = spend_view(&inputs);
        assert_eq!(view.currency, "EUR");
        let spend = |rows: &[SpendRow], name: &str| {
            rows.iter()
                .find(|r| r.name == name)
                .map(|r| (r.bytes, r.spend))
        };
        // The hour: vendor 0.5 GB x 8; vm-0 1 GB x 1 + half an hour x 2.
        let hour = &view.hour;
        assert_eq!(hour.since_ms, TEN);
        assert_eq!(spend(&hour.tenants, "a"), Some((500_000_000, 4.0)));
        assert_eq!(
            spend(&hour.tenants, "b"),
            Some((2_000_000_007, 1.0)),
            "hours are no tenant's; the deleted proxy is unpriced"
        );
        assert_eq!(
            spend(&hour.proxies, "crawl/vm-0"),
            Some((1_000_000_000, 2.0))
        );
        assert_eq!(
            spend(&hour.proxies, "crawl/deleted"),
            Some((1_000_000_000, 0.0))
        );
        assert_eq!(spend(&hour.pools, "crawl/eu"), Some((2_000_000_000, 2.0)));
        assert!(close(hour.total, 6.0), "{}", hour.total);
        assert_eq!(hour.proxies[0].name, "crawl/vendor", "costliest first");
        // The day: the row of 30 h ago is out; vm-0 existed 2.5 h of it.
        let day = &view.day;
        assert_eq!(spend(&day.tenants, "a"), Some((1_500_000_000, 12.0)));
        assert_eq!(
            spend(&day.proxies, "crawl/vm-0"),
            Some((1_000_000_000, 1.0 + 5.0))
        );
        assert_eq!(day.bytes, 1_500_000_000 + 2_000_000_007);
        // A tenant's view is per GB only.
        let tenant = spend_view(&SpendInputs {
            hours: false,
            ..inputs
        });
        assert_eq!(
            spend(&tenant.hour.proxies, "crawl/vm-0"),
            Some((1_000_000_000, 1.0))
        );
        assert!(close(tenant.hour.total, 5.0));
    }

    #[test]
    fn nothing_to_show_is_an_empty_window() {
        let inputs = SpendInputs {
            now_ms: NOW,
            currency: "USD",
            rows: &[],
            proxies: &[],
            hours: true,
        };
        let view = spend_view(&inputs);
        assert_eq!((view.day.total, view.day.bytes), (0.0, 0));
        assert!(
            view.day.tenants.is_empty() && view.day.pools.is_empty() && view.day.proxies.is_empty()
        );
    }

    #[test]
    fn charts_have_an_hour_per_slot_and_the_busiest_targets() {
        let vendor = Cost::of_prices(Some("10"), None);
        let proxies = [PricedProxy {
            namespace: "crawl",
            name: "vendor",
            pool: None,
            cost: Some(&vendor),
            created_ms: None,
        }];
        let mut rows = vec![
            row(
                TEN - 23 * HOUR_MS,
                "a",
                "vendor",
                None,
                "x.example",
                100_000_000,
            ),
            row(TEN, "a", "vendor", None, "x.example", 200_000_000),
            row(TEN, "b", "vendor", None, "y.example", 400_000_000),
        ];
        for i in 0..12 {
            rows.push(row(
                TEN,
                "b",
                "vendor",
                None,
                &format!("t{i:02}.example"),
                1000 + i,
            ));
        }
        let inputs = SpendInputs {
            now_ms: NOW,
            currency: "USD",
            rows: &rows,
            proxies: &proxies,
            hours: true,
        };
        let minutes = PerMinute {
            from_ms: NOW - 59 * 60_000,
            minutes: vec![OutcomeCounts::default(); 60],
        };
        let view = charts_view(
            &inputs,
            &[("a".into(), minutes.clone())],
            |t| (t == "x.example").then(|| minutes.clone()),
            minutes.from_ms,
        );
        assert_eq!(view.hours_from_ms, TEN - 23 * HOUR_MS);
        let a = &view.tenants[0];
        assert_eq!((a.bytes.len(), a.spend.len()), (24, 24));
        assert_eq!((a.bytes[0], a.bytes[23]), (100_000_000, 200_000_000));
        assert!(close(a.spend[23], 2.0));
        assert_eq!(a.success_rate.as_ref().map(Vec::len), Some(60));
        let names: Vec<&str> = view.targets.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names.len(), CHARTED_TARGETS);
        assert_eq!(&names[..3], ["y.example", "x.example", "t11.example"]);
        assert!(view.targets[1].success_rate.is_some());
        assert!(
            view.targets[0].success_rate.is_none(),
            "not the viewer's to see"
        );
    }
}
