//! The duration syntax of a Proxy's `healthCheck.interval` and `healthCheck.timeout`: one
//! grammar, written once as [`PATTERN`], that both the operator's decoder and the CRD check.
//!
//! Three parsers read these strings and they disagree at the edges:
//! - the operator's, kube's `Duration` (`FromStr`), reads `""`, `"1s0"`, `"+-5s"` and `"1s+5s"`,
//!   and **panics** on `"1s-5s"` or a number too large for a `std::time::Duration`;
//! - the API server's CEL `duration()` is Go's `time.ParseDuration`: it refuses those, and any
//!   total past ±292 years;
//! - the client-side CEL evaluator (the `cel` crate, for standalone inventories) has no `µs`,
//!   refuses `"+0"`, and ignores what follows a valid prefix.
//!
//! So the accepted syntax is the part all three read the same way: `0`, or an optional sign
//! and one or more numbers each followed by a unit `h`, `m`, `s`, `ms`, `us` or `ns` (`30s`,
//! `1m30s`, `1.5h`, `.5s`, `500ms`), at most [`MAX_LENGTH`] characters, each number below
//! 10^18 ns (so no sum can overflow any of them). The CRD rejects every other string on the
//! server (a CEL `matches` rule on each field), and the decoder checks the same pattern before
//! kube's parser runs. A Proxy stored before the CRD had these rules may still hold anything;
//! the operator skips such an object (see `proxy_watch`) instead of failing on it.
//!
//! Positivity and `timeout <= interval` are rules of the CRD, not of the syntax: the decoder
//! reads a `0s` interval (the health engine then probes on every tick).

use std::sync::LazyLock;

use regex::Regex;
use serde::{Deserialize, Deserializer};

/// Longest duration string accepted (the CRD's `maxLength`).
pub const MAX_LENGTH: usize = 64;

/// One number before a unit: at most `$digits` digits before the decimal point (any after).
macro_rules! number {
    ($digits:literal) => {
        concat!("([0-9]{1,", $digits, "}([.][0-9]*)?|[.][0-9]+)")
    };
}

/// The accepted syntax as a regular expression that RE2 (the API server), the `regex` crate
/// (the operator and the client-side CEL evaluator) read alike. The digit limits keep every
/// number below 10^18 ns: 5 digits of hours, 7 of minutes, 9 of seconds, 12 of ms, 15 of us,
/// 18 of ns. `[.]` rather than `\.`, so the pattern needs no escaping inside a CEL string.
pub const PATTERN: &str = concat!(
    "^(0|[-+]?(",
    number!(5),
    "h|",
    number!(7),
    "m|",
    number!(9),
    "s|",
    number!(12),
    "ms|",
    number!(15),
    "us|",
    number!(18),
    "ns)+)$"
);

/// What a rejected value was missing, in the words of the CRD's rule message.
const EXPECTED: &str =
    "numbers each followed by a unit (h, m, s, ms, us, ns), e.g. 30s, 1m30s, 500ms or 1.5h";

/// Message of the CRD's rule on each duration field (the API server prefixes the field path).
pub const FIELD_MESSAGE: &str = "must be a positive duration: numbers each followed by a unit \
                                 (h, m, s, ms, us, ns), e.g. 30s, 1m30s, 500ms or 1.5h";

/// Message of the CRD's rule comparing the two health-check durations.
pub const TIMEOUT_MESSAGE: &str = "timeout must not be longer than interval";

/// The CEL rule on one duration field: the syntax, then a value above zero. `&&` keeps
/// `duration()` from ever seeing a string it cannot parse (an evaluation error would be
/// reported instead of the message).
pub fn field_rule() -> String {
    format!("self.matches('{PATTERN}') && duration(self) > duration('0s')")
}

/// The CEL rule on the health check: timeout at most interval, evaluated only when both are
/// present and have the accepted syntax (a malformed one is already reported by its own
/// field's rule). Both are always present once defaulted, but the API server also checks the
/// rule against the health check's own default, `{}`, where they are not.
pub fn timeout_rule() -> String {
    format!(
        "!has(self.interval) || !has(self.timeout) \
         || !self.interval.matches('{PATTERN}') || !self.timeout.matches('{PATTERN}') \
         || duration(self.timeout) <= duration(self.interval)"
    )
}

/// Shortest `spec.maxLifetime` the CRD accepts: a shorter life would keep the fleet replacing
/// machines faster than a drain and a start-up take.
pub const MIN_MAX_LIFETIME: &str = "1m";
/// [`MIN_MAX_LIFETIME`] as a value (a unit test keeps the two equal).
pub const MIN_MAX_LIFETIME_VALUE: std::time::Duration = std::time::Duration::from_secs(60);

/// Message of the CRD's rule on the least `spec.maxLifetime`.
pub const MAX_LIFETIME_MESSAGE: &str = "must be at least 1m (a machine must live longer than its \
                                        drain and its start-up)";

/// The CEL rule that a duration field is at least `minimum` (a string in the accepted syntax,
/// written into the rule). Like [`timeout_rule`] it passes a malformed value, which its
/// [`field_rule`] already reports, so `duration()` never sees a string it cannot parse.
pub fn at_least_rule(minimum: &str) -> String {
    format!("!self.matches('{PATTERN}') || duration(self) >= duration('{minimum}')")
}

static SYNTAX: LazyLock<Regex> = LazyLock::new(|| {
    // A constant, checked by the unit tests: never input-dependent.
    Regex::new(PATTERN).expect("PATTERN is a valid regular expression")
});

/// A duration string outside the accepted syntax.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{value:?} is not a duration: {reason}")]
pub struct DurationError {
    /// The offending value, cut to a readable length.
    value: String,
    /// What is wrong.
    reason: String,
}

impl DurationError {
    fn new(value: &str, reason: impl Into<String>) -> Self {
        const SHOWN: usize = MAX_LENGTH + 8;
        let value = match value.char_indices().nth(SHOWN) {
            Some((cut, _)) => format!("{}...", &value[..cut]),
            None => value.to_owned(),
        };
        DurationError {
            value,
            reason: reason.into(),
        }
    }
}

/// Whether `text` has the accepted syntax.
pub fn is_valid(text: &str) -> bool {
    text.len() <= MAX_LENGTH && SYNTAX.is_match(text)
}

/// Parses a duration of the accepted syntax. Negative and zero values parse (they are refused
/// by the CRD's rules, not by the syntax).
pub fn parse(text: &str) -> Result<kube::core::Duration, DurationError> {
    if text.len() > MAX_LENGTH {
        return Err(DurationError::new(
            text,
            format!("longer than {MAX_LENGTH} characters"),
        ));
    }
    if !SYNTAX.is_match(text) {
        return Err(DurationError::new(text, format!("expected {EXPECTED}")));
    }
    // Within the syntax kube's parser neither fails nor panics: one leading sign, unsigned
    // finite numbers, known units, totals far below its range.
    text.parse()
        .map_err(|e: kube::core::duration::ParseError| DurationError::new(text, e.to_string()))
}

/// `#[serde(deserialize_with = ...)]` for a `kube::core::Duration` field: the accepted syntax
/// only, so an object the CRD would refuse never decodes into something else.
pub fn deserialize<'de, D>(deserializer: D) -> Result<kube::core::Duration, D::Error>
where
    D: Deserializer<'de>,
{
    let text = String::deserialize(deserializer)?;
    parse(&text).map_err(serde::de::Error::custom)
}

/// `#[serde(deserialize_with = ...)]` for an optional `kube::core::Duration` field (with
/// `#[serde(default)]`): absent or `null` is `None`, a string must have the accepted syntax.
pub fn deserialize_option<'de, D>(deserializer: D) -> Result<Option<kube::core::Duration>, D::Error>
where
    D: Deserializer<'de>,
{
    Option::<String>::deserialize(deserializer)?
        .map(|text| parse(&text).map_err(serde::de::Error::custom))
        .transpose()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn pattern_compiles_and_needs_no_escaping_in_cel() {
        assert!(Regex::new(PATTERN).is_ok());
        assert!(!PATTERN.contains('\\'), "{PATTERN}");
        assert!(!PATTERN.contains('\''), "{PATTERN}");
        assert!(field_rule().contains(PATTERN));
        assert!(timeout_rule().contains(PATTERN));
        assert!(at_least_rule(MIN_MAX_LIFETIME).contains(PATTERN));
        assert_eq!(
            parse(MIN_MAX_LIFETIME).map(Duration::from),
            Ok(MIN_MAX_LIFETIME_VALUE)
        );
        assert!(!MAX_LIFETIME_MESSAGE.contains('\''));
    }

    #[test]
    fn parses_values_like_kube() {
        let cases = [
            ("30s", Duration::from_secs(30)),
            ("1h30m", Duration::from_secs(5400)),
            ("1.5h", Duration::from_secs(5400)),
            (".5s", Duration::from_millis(500)),
            ("5.s", Duration::from_secs(5)),
            ("+5s", Duration::from_secs(5)),
            ("10.5s4m", Duration::from_millis(250_500)),
            ("1500us", Duration::from_micros(1500)),
            ("0", Duration::ZERO),
        ];
        for (text, expected) in cases {
            let parsed = parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(Duration::from(parsed), expected, "{text}");
        }
        let negative = parse("-5s").unwrap();
        assert!(negative.is_negative());
    }

    #[test]
    fn refusals_name_the_value_and_the_syntax() {
        for text in ["30", "1d", "5S", "", "1s0", "1s-5s", "12µs", "+0"] {
            let error = parse(text).unwrap_err().to_string();
            assert!(error.contains(&format!("{text:?}")), "{error}");
            assert!(error.contains("unit (h, m, s, ms, us, ns)"), "{error}");
            assert!(!is_valid(text), "{text}");
        }
        let long = "1s".repeat(33);
        let error = parse(&long).unwrap_err().to_string();
        assert!(error.contains("longer than 64 characters"), "{error}");
        let huge = "9".repeat(10_000);
        assert!(parse(&huge).unwrap_err().to_string().len() < 200);
    }

    #[test]
    fn deserializes_through_serde_with_the_reason() {
        #[derive(Deserialize)]
        struct Check {
            #[serde(deserialize_with = "deserialize")]
            interval: kube::core::Duration,
        }
        let ok: Check = serde_json::from_value(serde_json::json!({"interval": "2m"})).unwrap();
        assert_eq!(Duration::from(ok.interval), Duration::from_secs(120));
        let error = serde_json::from_value::<Check>(serde_json::json!({"interval": "30"}))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(error.contains("\"30\" is not a duration"), "{error}");
        assert!(
            serde_json::from_value::<Check>(serde_json::json!({"interval": 30})).is_err(),
            "a number is not a duration string"
        );
    }

    #[test]
    fn deserializes_optional_durations() {
        #[derive(Deserialize)]
        struct Spec {
            #[serde(default, deserialize_with = "deserialize_option")]
            lifetime: Option<kube::core::Duration>,
        }
        let cases = [
            (serde_json::json!({}), Ok(None)),
            (serde_json::json!({"lifetime": null}), Ok(None)),
            (
                serde_json::json!({"lifetime": "1m"}),
                Ok(Some(Duration::from_secs(60))),
            ),
            (
                serde_json::json!({"lifetime": "24h"}),
                Ok(Some(Duration::from_secs(86_400))),
            ),
            (
                serde_json::json!({"lifetime": "30"}),
                Err("\"30\" is not a duration"),
            ),
            (serde_json::json!({"lifetime": "1x"}), Err("unit (h, m, s")),
            (
                serde_json::json!({"lifetime": 60}),
                Err("expected a string"),
            ),
        ];
        for (input, expected) in cases {
            let got = serde_json::from_value::<Spec>(input.clone())
                .map(|s| s.lifetime.map(Duration::from))
                .map_err(|e| e.to_string());
            match (got, expected) {
                (Ok(got), Ok(expected)) => assert_eq!(got, expected, "{input}"),
                (Err(error), Err(needle)) => assert!(error.contains(needle), "{input}: {error}"),
                (got, expected) => panic!("{input}: got {got:?}, expected {expected:?}"),
            }
        }
    }
}
