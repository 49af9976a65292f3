//! Spend: the money the proxies' `spec.cost` makes of the bytes the gateway relayed through
//! them and of the hours they existed.
//!
//! [`SpendBook`] keeps the running totals the metrics show, since this process started
//! counting. At each reading it prices what was added since the last one at the proxy's
//! current `cost`: the bytes it carried × `perGB`, and the time since the later of the
//! process's start and the proxy's creation (its first reading for a proxy without one) ×
//! `perHour`; so the totals only grow, and a new price applies from the reading that sees it
//! on. A tenant's total is the bytes relayed for it through each proxy × that proxy's `perGB`
//! (a proxy's hours are paid whoever uses it, so they are no one tenant's). A proxy gone from
//! the inventory leaves its tenants' spend behind, its last bytes priced at its last `cost`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use jiff::Timestamp;

use super::traffic::Counts;
use crate::resources::cost::Cost;

/// One proxy of the inventory, as the book reads it.
#[derive(Debug, Clone, Copy)]
pub struct Priced<'a> {
    /// Its UID.
    pub uid: &'a str,
    /// Its `spec.cost`.
    pub cost: Option<&'a Cost>,
    /// Its `metadata.creationTimestamp` (none for a standalone inventory's proxies).
    pub created: Option<Timestamp>,
}

/// One reading's spend.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Spends {
    /// Per proxy, in the order given; `None` for a proxy without `cost`.
    pub proxies: Vec<Option<ProxySpend>>,
    /// Per tenant that had bytes relayed through a proxy with a `perGB`.
    pub tenants: BTreeMap<Arc<str>, f64>,
    /// The UIDs counted in the traffic that are not in the inventory any more.
    pub gone: Vec<String>,
}

/// One proxy's spend so far, by what it paid for.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ProxySpend {
    /// Its bytes × `perGB`.
    pub bytes: f64,
    /// Its hours × `perHour`.
    pub hours: f64,
}

impl ProxySpend {
    /// The two together.
    pub fn total(&self) -> f64 {
        self.bytes + self.hours
    }
}

/// Seconds between `since` and `now`; none when `now` is earlier (a clock stepped back).
pub fn seconds_between(since: Timestamp, now: Timestamp) -> f64 {
    let millis = now.as_millisecond().saturating_sub(since.as_millisecond());
    millis.max(0) as f64 / 1000.0
}

/// What the book knows of one proxy.
#[derive(Debug)]
struct Running {
    /// Its `cost` at the last reading (nothing for none).
    cost: Cost,
    /// Bytes read so far, in all and per tenant.
    bytes: u64,
    tenants: HashMap<Arc<str>, u64>,
    /// Until when its hours are priced.
    billed_until: Timestamp,
    /// Its spend so far.
    spend: ProxySpend,
}

impl Running {
    /// Prices the tenants' bytes in `counted` beyond those read before at `self.cost`.
    fn tenants(&mut self, counted: &Counts, into: &mut BTreeMap<Arc<str>, f64>) {
        for (tenant, bytes) in &counted.tenants {
            let read = self.tenants.entry(tenant.clone()).or_default();
            let added = bytes.saturating_sub(*read);
            *read = *bytes;
            if added > 0 && self.cost.per_gb.is_some() {
                *into.entry(tenant.clone()).or_default() += self.cost.of_bytes(added);
            }
        }
    }
}

/// The running totals of spend since `started`.
#[derive(Debug)]
pub struct SpendBook {
    started: Timestamp,
    /// The proxies priced or that carried bytes, by UID.
    proxies: HashMap<String, Running>,
    tenants: BTreeMap<Arc<str>, f64>,
}

impl SpendBook {
    /// A book counting from `started`.
    pub fn new(started: Timestamp) -> Self {
        SpendBook {
            started,
            proxies: HashMap::new(),
            tenants: BTreeMap::new(),
        }
    }

    /// The spend at `now` of `proxies` (the inventory) having carried `counts` (the traffic
    /// table, by UID).
    pub fn scrape(
        &mut self,
        now: Timestamp,
        proxies: &[Priced<'_>],
        counts: &HashMap<String, Counts>,
    ) -> Spends {
        let mut spends = Spends::default();
        let mut seen: HashSet<&str> = HashSet::with_capacity(proxies.len());
        for proxy in proxies {
            seen.insert(proxy.uid);
            let counted = counts.get(proxy.uid);
            if proxy.cost.is_none() && counted.is_none() && !self.proxies.contains_key(proxy.uid) {
                spends.proxies.push(None);
                continue;
            }
            let started = self.started;
            let running = self
                .proxies
                .entry(proxy.uid.to_owned())
                .or_insert_with(|| Running {
                    cost: Cost::default(),
                    bytes: 0,
                    tenants: HashMap::new(),
                    billed_until: proxy.created.unwrap_or(now).max(started),
                    spend: ProxySpend::default(),
                });
            running.cost = proxy.cost.cloned().unwrap_or_default();
            if let Some(counted) = counted {
                let bytes = counted.up.saturating_add(counted.down);
                running.spend.bytes += running.cost.of_bytes(bytes.saturating_sub(running.bytes));
                running.bytes = bytes;
                running.tenants(counted, &mut self.tenants);
            }
            running.spend.hours += running
                .cost
                .of_seconds(seconds_between(running.billed_until, now));
            running.billed_until = running.billed_until.max(now);
            spends.proxies.push(proxy.cost.map(|_| running.spend));
        }
        for (uid, counted) in counts {
            if seen.contains(uid.as_str()) {
                continue;
            }
            if let Some(mut running) = self.proxies.remove(uid) {
                running.tenants(counted, &mut self.tenants);
            }
            spends.gone.push(uid.clone());
        }
        self.proxies.retain(|uid, _| seen.contains(uid.as_str()));
        spends.gone.sort_unstable();
        spends.tenants = self.tenants.clone();
        spends
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(seconds).unwrap()
    }

    fn counts(tenants: &[(&str, u64)]) -> Counts {
        let total: u64 = tenants.iter().map(|(_, b)| b).sum();
        Counts {
            up: 0,
            down: total,
            tenants: tenants.iter().map(|(t, b)| (Arc::from(*t), *b)).collect(),
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn seconds_between_never_runs_backwards() {
        for (since, now, expected) in [(0, 3600, 3600.0), (100, 100, 0.0), (200, 100, 0.0)] {
            assert_eq!(
                seconds_between(at(since), at(now)),
                expected,
                "{since} {now}"
            );
        }
    }

    /// Each case: the proxy's cost, its creation, its bytes, the time of the scrape (the book
    /// started at 1000 s) and its spend.
    #[test]
    fn a_proxy_pays_its_bytes_and_its_hours_since_the_later_of_start_and_creation() {
        let cases = [
            (
                Cost::of_prices(Some("10"), None),
                Some(0),
                500_000_000,
                1000,
                Some(5.0),
            ),
            (
                Cost::of_prices(None, Some("1")),
                Some(0),
                0,
                1000 + 7200,
                Some(2.0),
            ),
            (
                Cost::of_prices(None, Some("1")),
                Some(1000 + 3600),
                0,
                1000 + 7200,
                Some(1.0),
            ),
            (
                Cost::of_prices(Some("2"), Some("0.5")),
                None,
                1_000_000_000,
                1000,
                Some(2.0),
            ),
            (
                Cost::of_prices(None, Some("1")),
                Some(9000),
                0,
                5000,
                Some(0.0),
            ),
        ];
        for (cost, created, bytes, now, expected) in cases {
            let mut book = SpendBook::new(at(1000));
            let table = HashMap::from([("p".to_owned(), counts(&[("a", bytes)]))]);
            let priced = [Priced {
                uid: "p",
                cost: Some(&cost),
                created: created.map(at),
            }];
            let got = book.scrape(at(now), &priced, &table).proxies[0].map(|s| s.total());
            assert!(
                got.zip(expected).is_some_and(|(g, e)| close(g, e)),
                "{cost:?} {created:?} {bytes} {now}: {got:?}"
            );
        }
    }

    #[test]
    fn without_cost_nothing_is_spent_and_nothing_is_kept() {
        let mut book = SpendBook::new(at(0));
        let table = HashMap::from([("p".to_owned(), counts(&[("a", 1_000_000_000)]))]);
        let priced = [Priced {
            uid: "p",
            cost: None,
            created: None,
        }];
        let spends = book.scrape(at(60), &priced, &table);
        assert_eq!(
            spends,
            Spends {
                proxies: vec![None],
                ..Spends::default()
            }
        );
        // Its bytes were read unpriced: a price set later does not charge them.
        let now_priced = Cost::of_prices(Some("1"), None);
        let priced = [Priced {
            uid: "p",
            cost: Some(&now_priced),
            created: None,
        }];
        assert_eq!(
            book.scrape(at(120), &priced, &table).proxies,
            [Some(ProxySpend::default())]
        );
    }

    #[test]
    fn a_proxy_without_creation_time_is_billed_from_its_first_reading() {
        let mut book = SpendBook::new(at(0));
        let hourly = Cost::of_prices(None, Some("1"));
        let priced = [Priced {
            uid: "p",
            cost: Some(&hourly),
            created: None,
        }];
        let none = HashMap::new();
        assert_eq!(
            book.scrape(at(3600), &priced, &none).proxies,
            [Some(ProxySpend::default())]
        );
        let later = book.scrape(at(3 * 3600), &priced, &none).proxies[0].unwrap();
        assert!(close(later.hours, 2.0) && later.bytes == 0.0, "{later:?}");
        // Gone from the inventory, then back: billed afresh.
        book.scrape(at(4 * 3600), &[], &none);
        assert_eq!(
            book.scrape(at(5 * 3600), &priced, &none).proxies,
            [Some(ProxySpend::default())]
        );
    }

    #[test]
    fn tenants_pay_per_gb_of_the_proxies_they_used_and_keep_it_when_a_proxy_goes() {
        let mut book = SpendBook::new(at(0));
        let vendor = Cost::of_prices(Some("8"), Some("100"));
        let vm = Cost::of_prices(None, Some("1"));
        let priced = [
            Priced {
                uid: "vendor",
                cost: Some(&vendor),
                created: Some(at(0)),
            },
            Priced {
                uid: "vm",
                cost: Some(&vm),
                created: Some(at(0)),
            },
            Priced {
                uid: "free",
                cost: None,
                created: Some(at(0)),
            },
        ];
        let table = HashMap::from([
            (
                "vendor".to_owned(),
                counts(&[("a", 500_000_000), ("b", 250_000_000)]),
            ),
            ("vm".to_owned(), counts(&[("a", 1_000_000_000)])),
            ("free".to_owned(), counts(&[("c", 1_000_000_000)])),
        ]);
        let spends = book.scrape(at(3600), &priced, &table);
        let tenant = |spends: &Spends, name: &str| spends.tenants.get(name).copied();
        assert_eq!(tenant(&spends, "a"), Some(4.0), "hours are no tenant's");
        assert_eq!(tenant(&spends, "b"), Some(2.0));
        assert_eq!(
            tenant(&spends, "c"),
            None,
            "a proxy without perGB costs no tenant"
        );
        let vendor_spend = spends.proxies[0].unwrap();
        assert!(close(vendor_spend.bytes, 6.0) && close(vendor_spend.hours, 100.0));
        assert!(spends.gone.is_empty());
        // The vendor endpoint goes; its last bytes count at its last price, once.
        let mut later = table.clone();
        later.insert(
            "vendor".into(),
            counts(&[("a", 1_000_000_000), ("b", 250_000_000)]),
        );
        let spends = book.scrape(at(7200), &priced[1..], &later);
        assert_eq!(spends.gone, ["vendor"]);
        assert_eq!(tenant(&spends, "a"), Some(8.0));
        later.remove("vendor");
        let spends = book.scrape(at(7300), &priced[1..], &later);
        assert_eq!(tenant(&spends, "a"), Some(8.0));
        assert_eq!(tenant(&spends, "b"), Some(2.0));
    }

    /// A counter never runs backwards: a new price applies to what is read from then on.
    #[test]
    fn a_new_price_applies_from_the_reading_that_sees_it() {
        let mut book = SpendBook::new(at(0));
        let steps = [
            // (perGB, perHour, bytes so far, now, spend)
            ("1", "0", 1_000_000_000, 0, 1.0),
            ("3", "0", 2_000_000_000, 0, 4.0),
            ("0", "3600", 3_000_000_000, 1, 5.0),
            ("0", "0", 3_000_000_000, 3600, 5.0),
        ];
        for (per_gb, per_hour, bytes, now, expected) in steps {
            let price = Cost::of_prices(Some(per_gb), Some(per_hour));
            let priced = [Priced {
                uid: "p",
                cost: Some(&price),
                created: Some(at(0)),
            }];
            let table = HashMap::from([("p".to_owned(), counts(&[("a", bytes)]))]);
            let got = book.scrape(at(now), &priced, &table).proxies[0]
                .unwrap()
                .total();
            assert!(
                close(got, expected),
                "{per_gb} {per_hour} {bytes} {now}: {got}"
            );
        }
    }
}
