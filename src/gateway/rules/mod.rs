//! Per-target rules (`--gateway-rules-file`, see `file`): for a target host, what in its
//! answer is a ban (a status, a header, a pattern in the first KiB of the body), reported as
//! what and cooled down for how long when the target sends no `Retry-After`, and what the
//! gateway does with it (pass the answer through, or retry an idempotent request on another
//! exit). Hosts no rule names get the default rule, `--gateway-ban-statuses`, so an install
//! without a rules file behaves as before.
//!
//! Judging runs on every answer: patterns are compiled and hosts lower-cased at load, and a
//! host match is a few string comparisons.

mod file;

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use hyper::HeaderMap;
use hyper::header::HeaderName;
use regex::Regex;

pub use file::{MAX_CHAIN_STEPS, MAX_RULES, Parsed, RulesError, RulesFile, watch};

use super::bans::BanRule;
use crate::egress::host::{self, Host};
use crate::ledger::ReportResult;
use crate::serving::candidates::Selector;

/// How many bytes of a body a body condition reads: enough for a captcha page's title, and
/// a bound on what the gateway holds back of a streamed answer.
pub const BODY_PREFIX: usize = 1024;

/// The name of the rule built from `--gateway-ban-statuses`, which applies to hosts no rule of
/// the file names (so the file may not use it).
pub const DEFAULT_RULE: &str = "default";

/// What the gateway does with an answer that is a ban.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Action {
    /// Relay the answer to the client (after reporting it).
    #[default]
    Pass,
    /// For an idempotent request, try it again on other exits (moving its session), at most
    /// `times` of them.
    Retry {
        /// Other exits tried at most (1 to 5).
        times: u32,
    },
}

/// A fallback chain (`chains` in the rules file): selectors tried in order, e.g. the team's
/// own proxies first and a vendor's next. An acquire walks it until a step has a proxy that can
/// take the lease, so a ban that cools the first step's proxies for a target sends the next
/// request for it to the next step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chain {
    /// Its name: a metric label, and what a proxy URL's `fallback=` names.
    pub name: Arc<str>,
    /// The steps' selectors, each added to the request's own.
    pub steps: Vec<Selector>,
}

/// An answer judged a ban: by which rule, reported as what, cooled down for how long when
/// the target sends no `Retry-After` (`None`: the server's `--lease-cooldown`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ban {
    /// The rule's name (a metric label).
    pub rule: Arc<str>,
    /// What the ban is reported as.
    pub result: ReportResult,
    /// The cooldown when the target asks for none.
    pub cooldown: Option<Duration>,
}

/// The hosts a rule is for (and `--gateway-intercept-exclude` names).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostPattern {
    /// This host only (lower-cased; an address in its usual spelling).
    Exact(String),
    /// Any subdomain of a name, not the name itself: holds `.name`.
    Subdomains(String),
    /// Every host.
    Any,
}

impl HostPattern {
    /// Reads `example.com`, `*.example.com` or `*`, in any case; an IPv6 address with or
    /// without brackets. Answers why it is none.
    pub fn parse(text: &str) -> Result<HostPattern, String> {
        let lower = text.trim().to_ascii_lowercase();
        if lower == "*" {
            return Ok(HostPattern::Any);
        }
        if let Some(name) = lower.strip_prefix("*.") {
            return match host_name(name) {
                Some(Host::Name(name) | Host::Metadata(name)) => {
                    Ok(HostPattern::Subdomains(format!(".{name}")))
                }
                _ => Err(format!(
                    "{text:?} is not `*.` and a host name (`*.example.com`)"
                )),
            };
        }
        match host_name(&lower) {
            Some(Host::Ip(ip)) => Ok(HostPattern::Exact(ip.to_string())),
            Some(Host::Name(name) | Host::Metadata(name)) => Ok(HostPattern::Exact(name)),
            None => Err(format!(
                "{text:?} is not a host (`example.com`, an address), `*.` and a host name, \
                 or `*`"
            )),
        }
    }

    /// Whether `host` (lower-cased, as a target's host is) is one of these hosts.
    pub fn matches(&self, host: &str) -> bool {
        match self {
            HostPattern::Exact(exact) => host == exact,
            HostPattern::Subdomains(suffix) => {
                host.len() > suffix.len() && host.ends_with(&**suffix)
            }
            HostPattern::Any => true,
        }
    }
}

/// What `text` names as the gateway reads a target's host, if it is written as one: dot-
/// separated labels of letters, digits, `-` and `_`, or an address (an IPv6 one with or
/// without brackets).
fn host_name(text: &str) -> Option<Host> {
    let bare = match text.strip_prefix('[') {
        Some(inner) => inner.strip_suffix(']').filter(|v6| v6.contains(':'))?,
        None => text,
    };
    // A `:` makes it an IPv6 address or nothing, which `host::parse` decides.
    let written_as_host = bare.contains(':')
        || (bare.len() <= 253
            && bare.split('.').all(|label| {
                (1..=63).contains(&label.len())
                    && label
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            }));
    if !written_as_host {
        return None;
    }
    host::parse(bare).ok()
}

/// A header a ban condition looks for.
#[derive(Debug, Clone)]
struct HeaderMatch {
    name: HeaderName,
    /// The value, compared ASCII case-insensitively; `None`: any value.
    value: Option<String>,
}

/// One way an answer is a ban: every condition given must hold (at least one is given).
#[derive(Debug, Clone)]
struct Trigger {
    statuses: Option<Vec<u16>>,
    header: Option<HeaderMatch>,
    /// Searched in the body's first [`BODY_PREFIX`] bytes, read as lossy UTF-8.
    body: Option<Regex>,
    result: ReportResult,
}

impl Trigger {
    /// Whether the answer meets every condition; `text` is the body prefix as text, made on
    /// first use so that answers no body condition reaches are not converted.
    fn holds<'a>(
        &self,
        status: u16,
        headers: &HeaderMap,
        body: &'a [u8],
        text: &mut Option<Cow<'a, str>>,
    ) -> bool {
        if let Some(statuses) = &self.statuses
            && !statuses.contains(&status)
        {
            return false;
        }
        if let Some(header) = &self.header {
            let mut values = headers.get_all(&header.name).iter();
            let found = match &header.value {
                None => values.next().is_some(),
                Some(want) => values.any(|v| v.as_bytes().eq_ignore_ascii_case(want.as_bytes())),
            };
            if !found {
                return false;
            }
        }
        match &self.body {
            None => true,
            Some(pattern) => {
                let text = text.get_or_insert_with(|| String::from_utf8_lossy(body));
                pattern.is_match(text)
            }
        }
    }
}

/// A rule: the hosts it is for, what is a ban there, and what to do.
#[derive(Debug, Clone)]
pub struct Rule {
    name: Arc<str>,
    hosts: Vec<HostPattern>,
    bans: Vec<Trigger>,
    cooldown: Option<Duration>,
    action: Action,
    /// `action: fallback`: the chain acquires for its hosts walk (a ban is retried like
    /// `action: retry`, on the chain's next usable step).
    fallback: Option<Arc<Chain>>,
}

impl Rule {
    /// The chain acquires for its hosts walk, if it says `action: fallback`.
    pub fn fallback(&self) -> Option<&Arc<Chain>> {
        self.fallback.as_ref()
    }

    /// Its name: a metric label, `default` for the rule of `--gateway-ban-statuses`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What to do with an answer that is a ban.
    pub fn action(&self) -> Action {
        self.action
    }

    /// Whether judging needs the body's first bytes: only then does the gateway hold them
    /// back (at most [`BODY_PREFIX`]).
    pub fn reads_body(&self) -> bool {
        self.bans.iter().any(|b| b.body.is_some())
    }

    /// The ban an answer is, if any: the first ban entry whose conditions all hold.
    /// `body_prefix` is the body's first bytes, at most [`BODY_PREFIX`] of them are read (empty
    /// when [`reads_body`](Rule::reads_body) is false).
    pub fn judge(&self, status: u16, headers: &HeaderMap, body_prefix: &[u8]) -> Option<Ban> {
        let body = body_prefix.get(..BODY_PREFIX).unwrap_or(body_prefix);
        let mut text = None;
        let trigger = self
            .bans
            .iter()
            .find(|t| t.holds(status, headers, body, &mut text))?;
        Some(Ban {
            rule: self.name.clone(),
            result: trigger.result,
            cooldown: self.cooldown,
        })
    }

    fn matches(&self, host: &str) -> bool {
        self.hosts.iter().any(|h| h.matches(host))
    }
}

/// The rules in force: the file's, in its order, then the default rule.
#[derive(Debug, Clone)]
pub struct RuleSet {
    rules: Vec<Rule>,
    default: Rule,
    chains: HashMap<String, Arc<Chain>>,
}

impl RuleSet {
    /// The file's `rules`, and `default` (`--gateway-ban-statuses`) as the rule named
    /// [`DEFAULT_RULE`] for every other host: its statuses are bans, the answer is passed.
    pub fn new(default: &BanRule, rules: Vec<Rule>) -> Self {
        // The statuses a ban rule reports, grouped by result: one entry per result.
        let bans = ReportResult::ALL
            .into_iter()
            .filter_map(|result| {
                let statuses: Vec<u16> = (100..=599)
                    .filter(|s| default.of(*s) == Some(result))
                    .collect();
                (!statuses.is_empty()).then_some(Trigger {
                    statuses: Some(statuses),
                    header: None,
                    body: None,
                    result,
                })
            })
            .collect();
        let default = Rule {
            name: DEFAULT_RULE.into(),
            hosts: vec![HostPattern::Any],
            bans,
            cooldown: None,
            action: Action::Pass,
            fallback: None,
        };
        RuleSet {
            rules,
            default,
            chains: HashMap::new(),
        }
    }

    /// The file's rules and chains (see [`new`](Self::new)).
    pub fn of_file(default: &BanRule, parsed: Parsed) -> Self {
        RuleSet {
            chains: parsed
                .chains
                .into_iter()
                .map(|chain| (chain.name.to_string(), chain))
                .collect(),
            ..RuleSet::new(default, parsed.rules)
        }
    }

    /// The chain named `name` (a proxy URL's `fallback=`).
    pub fn chain(&self, name: &str) -> Option<&Arc<Chain>> {
        self.chains.get(name)
    }

    /// The rule for `host` (lower-cased, as a target's host is): the first whose hosts match,
    /// else the default. A trailing dot names the same host.
    pub fn for_host(&self, host: &str) -> &Rule {
        let host = host.strip_suffix('.').unwrap_or(host);
        self.rules
            .iter()
            .find(|r| r.matches(host))
            .unwrap_or(&self.default)
    }

    /// Every rule's name, the default's last: the label values of the rule metrics.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.rules
            .iter()
            .chain(std::iter::once(&self.default))
            .map(Rule::name)
    }
}

/// The rules in force, shared by every connection; replaced whole when the file changes, so
/// an answer is judged by one version of the file.
#[derive(Debug, Clone)]
pub struct Rules(Arc<RwLock<Arc<RuleSet>>>);

impl Rules {
    /// `set` in force.
    pub fn new(set: RuleSet) -> Self {
        Rules(Arc::new(RwLock::new(Arc::new(set))))
    }

    /// The set in force now (a clone of a pointer: held for one answer, not for a
    /// connection's life).
    pub fn current(&self) -> Arc<RuleSet> {
        // A panicking writer cannot leave the set half-replaced: keep reading it.
        self.0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Puts `set` in force for every answer judged from now on.
    pub fn replace(&self, set: RuleSet) {
        *self.0.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(set);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::header::HeaderValue;

    /// The rules of a YAML rules file.
    fn rules(yaml: &str) -> Vec<Rule> {
        RulesFile::new("/run/rules.yaml")
            .parse(yaml.as_bytes())
            .unwrap_or_else(|e| panic!("{e}"))
            .rules
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, HeaderValue::from_static(value));
        }
        map
    }

    #[test]
    fn host_patterns_match_exact_hosts_subdomains_and_every_host() {
        let cases = [
            ("shop.example.com", "shop.example.com", true),
            ("shop.example.com", "www.shop.example.com", false),
            ("shop.example.com", "example.com", false),
            ("Shop.Example.COM", "shop.example.com", true),
            ("*.example.org", "www.example.org", true),
            ("*.example.org", "a.b.example.org", true),
            ("*.example.org", "example.org", false),
            ("*.example.org", "badexample.org", false),
            ("*.example.org", "example.org.evil.com", false),
            ("*", "anything.example", true),
            ("*", "10.0.0.1", true),
            ("10.0.0.1", "10.0.0.1", true),
            ("127.1", "127.0.0.1", true),
            ("[::1]", "::1", true),
            ("0:0::1", "::1", true),
        ];
        for (pattern, host, expected) in cases {
            let parsed = HostPattern::parse(pattern).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(parsed.matches(host), expected, "{pattern} ~ {host}");
        }
    }

    #[test]
    fn ill_formed_host_patterns_are_refused() {
        for bad in [
            "",
            " ",
            "*example.com",
            "a.*.com",
            "*.",
            "**.example.com",
            "*.*.example.com",
            "*.10.0.0.1",
            "exa mple.com",
            "example.com.",
            ".example.com",
            "example.123",
            "http://example.com",
            "example.com:443",
            "[example.com]",
        ] {
            assert!(HostPattern::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_first_rule_whose_hosts_match_wins_and_the_default_takes_the_rest() {
        let set = RuleSet::new(
            &BanRule::parse("503=error,451=blocked,418=blocked").unwrap(),
            rules(
                "rules:
  - {name: shop, hosts: [shop.example.com], bans: [{status: [500], result: error}]}
  - {name: org, hosts: [\"*.example.org\", shop.example.com], bans: []}
  - {name: all, hosts: [\"*\"], bans: []}
",
            ),
        );
        for (host, rule) in [
            ("shop.example.com", "shop"),
            ("shop.example.com.", "shop"),
            ("www.example.org", "org"),
            ("example.org", "all"),
        ] {
            assert_eq!(set.for_host(host).name(), rule, "{host}");
        }
        assert_eq!(
            set.names().collect::<Vec<_>>(),
            ["shop", "org", "all", "default"]
        );

        let set = RuleSet::new(
            &BanRule::parse("503=error,451=blocked,418=blocked").unwrap(),
            rules("rules:\n  - {name: shop, hosts: [shop.example.com]}\n"),
        );
        let default = set.for_host("other.example");
        assert_eq!(default.name(), DEFAULT_RULE);
        assert_eq!(default.action(), Action::Pass);
        assert!(!default.reads_body());
        let none = HeaderMap::new();
        let ban = |result| {
            Some(Ban {
                rule: DEFAULT_RULE.into(),
                result,
                cooldown: None,
            })
        };
        for (status, expected) in [
            (503, ban(ReportResult::Error)),
            (451, ban(ReportResult::Blocked)),
            (418, ban(ReportResult::Blocked)),
            (429, None),
            (200, None),
        ] {
            assert_eq!(default.judge(status, &none, b""), expected, "{status}");
        }
        assert_eq!(
            set.for_host("shop.example.com").judge(503, &none, b""),
            None,
            "a named host is judged by its rule only"
        );
        let empty = RuleSet::new(&BanRule::parse("").unwrap(), Vec::new());
        assert_eq!(empty.for_host("x.example").judge(429, &none, b""), None);
        assert_eq!(empty.names().collect::<Vec<_>>(), [DEFAULT_RULE]);
    }

    #[test]
    fn a_ban_entry_holds_when_all_its_conditions_do() {
        let rule = &rules(
            "rules:
  - name: shop
    hosts: [\"*\"]
    bans:
      - {status: [429], result: rate_limited}
      - {status: [403, 451], header: {name: Server, value: CloudFront}, result: blocked}
      - {header: {name: cf-mitigated, value: challenge}, result: blocked}
      - {header: {name: x-robot-check}, result: error}
      - {status: [200], body: \"(?i)captcha\", result: blocked}
      - {header: {name: x-shop}, body: \"sorry\", result: rate_limited}
",
        )[0];
        assert!(rule.reads_body());
        use ReportResult::{Blocked, Error, RateLimited};
        /// A status, headers, a body, and the ban they are.
        type Case = (
            u16,
            &'static [(&'static str, &'static str)],
            &'static [u8],
            Option<ReportResult>,
        );
        let captcha = b"<title>CAPTCHA</title>";
        let cases: &[Case] = &[
            (429, &[], b"", Some(RateLimited)),
            (403, &[], b"", None),
            (403, &[("server", "cloudfront")], b"", Some(Blocked)),
            (451, &[("server", "CloudFront")], b"", Some(Blocked)),
            (500, &[("server", "CloudFront")], b"", None),
            (403, &[("server", "nginx")], b"", None),
            (
                200,
                &[("cf-mitigated", "other"), ("cf-mitigated", "Challenge")],
                b"",
                Some(Blocked),
            ),
            (200, &[("cf-mitigated", "challenged")], b"", None),
            (302, &[("x-robot-check", "")], b"", Some(Error)),
            (200, &[], captcha, Some(Blocked)),
            (404, &[], captcha, None),
            (200, &[], b"<title>Shop</title>", None),
            (500, &[("x-shop", "1")], b"sorry, busy", Some(RateLimited)),
            (500, &[], b"sorry, busy", None),
        ];
        for &(status, pairs, body, expected) in cases {
            assert_eq!(
                rule.judge(status, &headers(pairs), body).map(|b| b.result),
                expected,
                "{status} {pairs:?} {:?}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn a_body_pattern_is_searched_in_the_first_kib_only() {
        let rule = &rules(
            "rules:
  - name: r
    hosts: [\"*\"]
    bans: [{body: captcha, result: blocked}]
",
        )[0];
        let at = |offset: usize, invalid_utf8: bool| {
            let mut body = vec![if invalid_utf8 { 0xff } else { b' ' }; offset];
            body.extend_from_slice(b"captcha");
            body.resize(4 * BODY_PREFIX, b' ');
            rule.judge(200, &HeaderMap::new(), &body).is_some()
        };
        assert!(at(0, false));
        assert!(
            at(BODY_PREFIX - "captcha".len(), false),
            "ends at the last byte read"
        );
        assert!(
            !at(BODY_PREFIX - "captcha".len() + 1, false),
            "cut by the bound"
        );
        assert!(!at(BODY_PREFIX, false));
        assert!(
            at(100, true),
            "bytes that are not UTF-8 do not hide the rest"
        );
    }

    #[test]
    fn the_cooldown_and_the_action_are_carried() {
        let set = RuleSet::new(
            &BanRule::default(),
            rules(
                "rules:
  - {name: a, hosts: [a.example], bans: [{status: [403], result: blocked}], cooldown: 90s}
  - {name: b, hosts: [b.example], bans: [{status: [403], result: blocked}], action: retry}
  - name: c
    hosts: [c.example]
    bans: [{status: [429], result: rate_limited}]
    cooldown: 1h 30m
    action: retry
    retries: 3
  - {name: d, hosts: [d.example], bans: [{status: [403], result: blocked}], action: pass}
",
            ),
        );
        let cases = [
            (
                "a.example",
                403,
                Some(Duration::from_secs(90)),
                Action::Pass,
            ),
            ("b.example", 403, None, Action::Retry { times: 1 }),
            (
                "c.example",
                429,
                Some(Duration::from_secs(5400)),
                Action::Retry { times: 3 },
            ),
            ("d.example", 403, None, Action::Pass),
        ];
        for (host, status, cooldown, action) in cases {
            let rule = set.for_host(host);
            assert_eq!(rule.action(), action, "{host}");
            let ban = rule.judge(status, &HeaderMap::new(), b"");
            assert_eq!(
                ban,
                Some(Ban {
                    rule: rule.name().into(),
                    result: if status == 429 {
                        ReportResult::RateLimited
                    } else {
                        ReportResult::Blocked
                    },
                    cooldown,
                }),
                "{host}"
            );
        }
    }

    #[test]
    fn rules_are_replaced_whole() {
        let shared = Rules::new(RuleSet::new(&BanRule::default(), Vec::new()));
        let before = shared.current();
        shared.clone().replace(RuleSet::new(
            &BanRule::default(),
            rules("rules:\n  - {name: a, hosts: [\"*\"]}\n"),
        ));
        assert_eq!(before.names().collect::<Vec<_>>(), [DEFAULT_RULE]);
        assert_eq!(
            shared.current().names().collect::<Vec<_>>(),
            ["a", DEFAULT_RULE],
            "every clone sees the new set"
        );
    }
}
