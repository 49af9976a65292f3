//! What a proxy costs: `spec.cost` (`perGB` and `perHour`, in the fleet's one currency,
//! `--cost-currency`) and the arithmetic that turns bytes and hours into money.
//!
//! Prices are decimal strings in the resource (`"0.50"`), as Kubernetes asks of fractional
//! values (floats do not round-trip through every client), read exactly into billionths of the
//! currency unit. Money is added up as `f64`: a counter and a chart need no more, and a sum of
//! a day's spend is exact to far below a cent.

use std::fmt;

use kube::KubeSchema;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Bytes in a GB (decimal, as vendors bill).
pub const BYTES_PER_GB: f64 = 1e9;

/// Seconds in an hour.
const SECONDS_PER_HOUR: f64 = 3600.0;

/// Billionths of a currency unit in one unit.
const NANOS_PER_UNIT: u64 = 1_000_000_000;

/// The pattern every price matches: up to 9 digits, then optionally a point and up to 9 more.
pub const PRICE_PATTERN: &str = r"^[0-9]{1,9}(\.[0-9]{1,9})?$";

/// What a proxy costs. Neither price is part of the spec hash: changing one never replaces a
/// machine.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, Hash)]
#[schemars(transform = super::schema::strip_nullable)]
#[serde(rename_all = "camelCase")]
pub struct Cost {
    /// Per GB (10^9 bytes) relayed, e.g. `"8.40"`.
    #[serde(rename = "perGB", default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>", pattern(PRICE_PATTERN))]
    pub per_gb: Option<Price>,
    /// Per hour the proxy exists, e.g. `"0.02"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>", pattern(PRICE_PATTERN))]
    pub per_hour: Option<Price>,
}

impl Cost {
    /// The money `bytes` relayed through the proxy cost.
    pub fn of_bytes(&self, bytes: u64) -> f64 {
        self.per_gb
            .map_or(0.0, |price| price.as_f64() * bytes as f64 / BYTES_PER_GB)
    }

    /// The money `seconds` of the proxy existing cost.
    pub fn of_seconds(&self, seconds: f64) -> f64 {
        self.per_hour.map_or(0.0, |price| {
            price.as_f64() * seconds.max(0.0) / SECONDS_PER_HOUR
        })
    }

    /// The money of `bytes` relayed and `seconds` existed.
    pub fn of(&self, bytes: u64, seconds: f64) -> f64 {
        self.of_bytes(bytes) + self.of_seconds(seconds)
    }
}

/// A price: a non-negative decimal with at most 9 digits either side of the point, held
/// exactly as billionths of the currency unit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Price {
    nanos: u64,
}

/// Why a price could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "price {0:?}: a decimal number of at most 9 digits before and 9 after the point, as a string (\"0.50\")"
)]
pub struct PriceError(String);

impl Price {
    /// The price in currency units.
    pub fn as_f64(self) -> f64 {
        self.nanos as f64 / NANOS_PER_UNIT as f64
    }

    /// Reads `text` ([`PRICE_PATTERN`]).
    pub fn parse(text: &str) -> Result<Price, PriceError> {
        let error = || PriceError(text.to_owned());
        let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
        let digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
        let fraction_ok = !text.contains('.') || (1..=9).contains(&fraction.len());
        if !(1..=9).contains(&whole.len()) || !digits(whole) || !fraction_ok || !digits(fraction) {
            return Err(error());
        }
        let padded = format!("{fraction:0<9}");
        let whole: u64 = whole.parse().map_err(|_| error())?;
        let fraction: u64 = padded.parse().map_err(|_| error())?;
        Ok(Price {
            nanos: whole * NANOS_PER_UNIT + fraction,
        })
    }
}

impl fmt::Display for Price {
    /// The shortest decimal of the price: `8.4`, `0.0067`, `3`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let whole = self.nanos / NANOS_PER_UNIT;
        let fraction = self.nanos % NANOS_PER_UNIT;
        if fraction == 0 {
            return write!(f, "{whole}");
        }
        let digits = format!("{fraction:09}");
        write!(f, "{whole}.{}", digits.trim_end_matches('0'))
    }
}

impl std::str::FromStr for Price {
    type Err = PriceError;

    fn from_str(text: &str) -> Result<Price, PriceError> {
        Price::parse(text)
    }
}

impl Serialize for Price {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Price {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Price, D::Error> {
        let text = String::deserialize(deserializer)?;
        Price::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// Default of `--cost-currency`.
pub const DEFAULT_CURRENCY: &str = "USD";

/// Reads `--cost-currency`: three ASCII capital letters, as ISO 4217 spells currencies.
pub fn currency(text: &str) -> Result<String, String> {
    if text.len() == 3 && text.bytes().all(|b| b.is_ascii_uppercase()) {
        Ok(text.to_owned())
    } else {
        Err(format!(
            "{text:?}: a currency code of three capital letters (ISO 4217), such as USD or EUR"
        ))
    }
}

#[cfg(test)]
impl Cost {
    /// A cost of the prices spelled `per_gb` and `per_hour`, for tests.
    pub(crate) fn of_prices(per_gb: Option<&str>, per_hour: Option<&str>) -> Cost {
        let price = |p: &str| Price::parse(p).unwrap();
        Cost {
            per_gb: per_gb.map(price),
            per_hour: per_hour.map(price),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prices_read_exactly_and_print_shortest() {
        let cases = [
            ("0", Some((0, "0"))),
            ("3", Some((3_000_000_000, "3"))),
            ("8.40", Some((8_400_000_000, "8.4"))),
            ("0.0067", Some((6_700_000, "0.0067"))),
            ("0.000000001", Some((1, "0.000000001"))),
            (
                "999999999.999999999",
                Some((999_999_999_999_999_999, "999999999.999999999")),
            ),
            ("007", Some((7_000_000_000, "7"))),
            ("", None),
            (".5", None),
            ("5.", None),
            ("-1", None),
            ("1e3", None),
            ("1,5", None),
            (" 1", None),
            ("0.0000000001", None),
            ("1000000000", None),
            ("NaN", None),
        ];
        for (text, expected) in cases {
            let got = Price::parse(text).map(|p| (p.nanos, p.to_string())).ok();
            let expected = expected.map(|(nanos, shown)| (nanos, shown.to_owned()));
            assert_eq!(got, expected, "{text:?}");
        }
    }

    #[test]
    fn the_pattern_agrees_with_the_parser() {
        let pattern = regex::Regex::new(PRICE_PATTERN).unwrap();
        for text in [
            "0",
            "8.40",
            "1.",
            ".1",
            "-1",
            "1e3",
            "0.0000000001",
            "123456789.1",
        ] {
            assert_eq!(
                pattern.is_match(text),
                Price::parse(text).is_ok(),
                "{text:?}"
            );
        }
    }

    #[test]
    fn spend_is_bytes_times_per_gb_plus_hours_times_per_hour() {
        let cases = [
            // (perGB, perHour, bytes, seconds, spend)
            (None, None, 5_000_000_000, 7200.0, 0.0),
            (Some("8.40"), None, 1_000_000_000, 7200.0, 8.4),
            (Some("8.40"), None, 500_000_000, 0.0, 4.2),
            (Some("8.40"), None, 0, 0.0, 0.0),
            (None, Some("0.02"), 1_000_000_000, 1800.0, 0.01),
            (None, Some("0.02"), 0, -60.0, 0.0),
            (Some("2"), Some("0.5"), 250_000_000, 3600.0 * 3.0, 0.5 + 1.5),
            (Some("0"), Some("0"), u64::MAX, 1e9, 0.0),
        ];
        for (per_gb, per_hour, bytes, seconds, expected) in cases {
            let got = Cost::of_prices(per_gb, per_hour).of(bytes, seconds);
            assert!(
                (got - expected).abs() < 1e-9,
                "{per_gb:?} {per_hour:?} {bytes} {seconds}: {got} != {expected}"
            );
        }
    }

    #[test]
    fn cost_round_trips_through_json_as_strings() {
        let json = serde_json::json!({"perGB": "8.40", "perHour": "0.0067"});
        let cost: Cost = serde_json::from_value(json).unwrap();
        assert_eq!(cost, Cost::of_prices(Some("8.4"), Some("0.0067")));
        assert_eq!(
            serde_json::to_value(&cost).unwrap(),
            serde_json::json!({"perGB": "8.4", "perHour": "0.0067"})
        );
        assert_eq!(
            serde_json::to_value(Cost::default()).unwrap(),
            serde_json::json!({})
        );
        for bad in [
            serde_json::json!({"perGB": 8.4}),
            serde_json::json!({"perHour": "-1"}),
        ] {
            assert!(
                serde_json::from_value::<Cost>(bad.clone()).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn currencies_are_three_capitals() {
        for (text, ok) in [
            ("USD", true),
            ("EUR", true),
            ("usd", false),
            ("US", false),
            ("€", false),
        ] {
            assert_eq!(currency(text).is_ok(), ok, "{text}");
        }
    }
}
