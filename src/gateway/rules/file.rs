//! The rules file (`--gateway-rules-file`, YAML): per host pattern, what is a ban and what to
//! do. Read at start-up, where a bad file stops the process, and re-read when its content
//! changes, where a bad file is logged and the last good rules stay in force. Every error
//! names the file, the line and the field. See `samples/gateway-rules.yaml`.
//!
//! ```yaml
//! rules:
//!   - name: shop-captcha
//!     hosts: [shop.example.com, "*.example.org"]
//!     bans:
//!       - status: [403, 429]
//!         result: blocked
//!       - header: {name: cf-mitigated, value: challenge}
//!         result: blocked
//!       - status: [200]
//!         body: "(?i)captcha|are you a robot"
//!         result: blocked
//!     cooldown: 10m
//!     action: retry
//!     retries: 2
//!   - name: shop
//!     hosts: [shop.example.net]
//!     bans: [{status: [429], result: rate_limited}]
//!     action: fallback
//!     chain: own-then-rented
//! chains:
//!   - name: own-then-rented
//!     steps: ["tier=own", "pool=rented"]
//! ```

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use hyper::header::{HeaderName, HeaderValue};
use regex::Regex;
use serde::Deserialize;
use serde_saphyr::{Location, Spanned};
use tokio_util::sync::CancellationToken;

use super::{
    Action, BanRule, Chain, DEFAULT_RULE, HeaderMatch, HostPattern, Rule, RuleSet, Rules, Trigger,
};
use crate::ledger::ReportResult;
use crate::serving::candidates::Selector;
use crate::serving::watched_file;

/// Most rules one file may hold: their names are metric labels, so their number stays
/// bounded.
pub const MAX_RULES: usize = 100;

/// Longest rule name (a Kubernetes label value's length).
const MAX_NAME: usize = 63;

/// Most other exits one request is retried on: each retry holds the client's answer back.
const MAX_RETRIES: u32 = 5;

/// Most steps of one fallback chain (a metric label value each).
pub const MAX_CHAIN_STEPS: usize = 8;

/// The flag that names the file, as messages say it.
const FLAG: &str = "--gateway-rules-file";

/// Why a rules file was refused: the message names the file, and the line and field at
/// fault when there is one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct RulesError(pub String);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileDoc {
    rules: Spanned<Vec<Spanned<RuleDoc>>>,
    #[serde(default)]
    chains: Vec<Spanned<ChainDoc>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ChainDoc {
    name: Spanned<String>,
    steps: Spanned<Vec<Spanned<String>>>,
}

/// What a rules file says: its rules, in its order, and its fallback chains.
#[derive(Debug, Clone)]
pub struct Parsed {
    /// The rules.
    pub rules: Vec<Rule>,
    /// The chains.
    pub chains: Vec<Arc<Chain>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleDoc {
    name: Spanned<String>,
    hosts: Spanned<Vec<Spanned<String>>>,
    #[serde(default)]
    bans: Vec<Spanned<BanDoc>>,
    #[serde(default)]
    cooldown: Option<Spanned<String>>,
    #[serde(default)]
    action: Option<Spanned<String>>,
    #[serde(default)]
    retries: Option<Spanned<u32>>,
    #[serde(default)]
    chain: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BanDoc {
    #[serde(default)]
    status: Option<Spanned<Vec<Spanned<u32>>>>,
    #[serde(default)]
    header: Option<HeaderDoc>,
    #[serde(default)]
    body: Option<Spanned<String>>,
    result: Spanned<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HeaderDoc {
    name: Spanned<String>,
    #[serde(default)]
    value: Option<Spanned<String>>,
}

/// A rules file.
#[derive(Debug, Clone)]
pub struct RulesFile {
    path: PathBuf,
}

/// The line a value was written on.
fn line(at: &Location) -> Option<u64> {
    Some(at.line())
}

impl RulesFile {
    /// The file at `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        RulesFile { path: path.into() }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn error(&self, line: Option<u64>, field: &str, problem: impl std::fmt::Display) -> RulesError {
        let at = line.map(|l| format!(" line {l}:")).unwrap_or_default();
        let field = if field.is_empty() {
            String::new()
        } else {
            format!(" {field}:")
        };
        RulesError(format!(
            "{FLAG} {}:{at}{field} {problem}",
            self.path.display()
        ))
    }

    /// Reads and checks the file: its rules, and the content they came from (what the
    /// re-read compares against).
    pub fn load(&self) -> Result<(Parsed, Vec<u8>), RulesError> {
        let content = std::fs::read(&self.path)
            .map_err(|e| self.error(None, "", format!("cannot read: {e}")))?;
        let rules = self.parse(&content)?;
        Ok((rules, content))
    }

    /// Checks `content` as the file's: its rules, in its order, and its chains.
    pub fn parse(&self, content: &[u8]) -> Result<Parsed, RulesError> {
        let text = std::str::from_utf8(content)
            .map_err(|e| self.error(None, "", format!("is not UTF-8: {e}")))?;
        let doc: FileDoc = serde_saphyr::from_str(text).map_err(|e| {
            let line = e.location().map(|l| l.line());
            // The parser's message carries its own location; the line is said first.
            self.error(line, "", e.to_string().lines().next().unwrap_or_default())
        })?;
        if doc.rules.value.len() > MAX_RULES {
            return Err(self.error(
                line(&doc.rules.referenced),
                "rules",
                format!("holds {} rules; at most {MAX_RULES}", doc.rules.value.len()),
            ));
        }
        let chains = self.chains(doc.chains)?;
        let mut names: HashMap<String, usize> = HashMap::new();
        let mut rules = Vec::with_capacity(doc.rules.value.len());
        for (index, entry) in doc.rules.value.into_iter().enumerate() {
            let entry = entry.value;
            let name = &entry.name;
            let field = format!("rules[{index}].name");
            if let Some(problem) = name_problem(&name.value) {
                return Err(self.error(line(&name.referenced), &field, problem));
            }
            if let Some(first) = names.insert(name.value.clone(), index) {
                return Err(self.error(
                    line(&name.referenced),
                    &field,
                    format!("{:?} is rules[{first}]'s name too", name.value),
                ));
            }
            rules.push(self.rule(index, entry, &chains)?);
        }
        Ok(Parsed {
            rules,
            chains: chains.into_values().collect(),
        })
    }

    /// The file's chains by name.
    fn chains(
        &self,
        docs: Vec<Spanned<ChainDoc>>,
    ) -> Result<HashMap<String, Arc<Chain>>, RulesError> {
        if docs.len() > MAX_RULES {
            return Err(self.error(
                docs.get(MAX_RULES).and_then(|d| line(&d.referenced)),
                "chains",
                format!("holds {} chains; at most {MAX_RULES}", docs.len()),
            ));
        }
        let mut chains = HashMap::new();
        for (index, doc) in docs.into_iter().enumerate() {
            let doc = doc.value;
            let field = |name: &str| format!("chains[{index}].{name}");
            if let Some(problem) = name_problem(&doc.name.value) {
                return Err(self.error(line(&doc.name.referenced), &field("name"), problem));
            }
            let count = doc.steps.value.len();
            if !(2..=MAX_CHAIN_STEPS).contains(&count) {
                return Err(self.error(
                    line(&doc.steps.referenced),
                    &field("steps"),
                    format!("holds {count} steps; a chain has 2 to {MAX_CHAIN_STEPS}"),
                ));
            }
            let steps = doc
                .steps
                .value
                .iter()
                .enumerate()
                .map(|(s, step)| {
                    Selector::parse(&step.value).map_err(|problem| {
                        self.error(
                            line(&step.referenced),
                            &field(&format!("steps[{s}]")),
                            format!("{problem} (a step is a selector: `tier=own,geo=eu`)"),
                        )
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            let name = doc.name.value;
            let chain = Arc::new(Chain {
                name: name.as_str().into(),
                steps,
            });
            if chains.insert(name.clone(), chain).is_some() {
                return Err(self.error(
                    line(&doc.name.referenced),
                    &field("name"),
                    format!("{name:?} names another chain too"),
                ));
            }
        }
        Ok(chains)
    }

    fn rule(
        &self,
        index: usize,
        entry: RuleDoc,
        chains: &HashMap<String, Arc<Chain>>,
    ) -> Result<Rule, RulesError> {
        let field = |name: &str| format!("rules[{index}].{name}");
        if entry.hosts.value.is_empty() {
            return Err(self.error(
                line(&entry.hosts.referenced),
                &field("hosts"),
                "names no host (`*` is every host)",
            ));
        }
        let hosts = entry
            .hosts
            .value
            .iter()
            .enumerate()
            .map(|(h, host)| {
                HostPattern::parse(&host.value).map_err(|problem| {
                    self.error(
                        line(&host.referenced),
                        &field(&format!("hosts[{h}]")),
                        problem,
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let bans = entry
            .bans
            .into_iter()
            .enumerate()
            .map(|(b, ban)| self.trigger(&field(&format!("bans[{b}]")), ban))
            .collect::<Result<Vec<_>, _>>()?;
        let cooldown = match entry.cooldown {
            None => None,
            Some(cooldown) => Some(
                humantime::parse_duration(&cooldown.value)
                    .ok()
                    .filter(|d| !d.is_zero())
                    .ok_or_else(|| {
                        self.error(
                            line(&cooldown.referenced),
                            &field("cooldown"),
                            format!(
                                "{:?} is not a length above zero (`90s`, `10m`)",
                                cooldown.value
                            ),
                        )
                    })?,
            ),
        };
        let (retry, fallback) = match &entry.action {
            None => (false, false),
            Some(action) => match action.value.as_str() {
                "pass" => (false, false),
                "retry" => (true, false),
                "fallback" => (true, true),
                other => {
                    return Err(self.error(
                        line(&action.referenced),
                        &field("action"),
                        format!("{other:?} is not pass, retry or fallback"),
                    ));
                }
            },
        };
        let fallback = match (fallback, &entry.chain) {
            (false, None) => None,
            (false, Some(chain)) => {
                return Err(self.error(
                    line(&chain.referenced),
                    &field("chain"),
                    "needs `action: fallback`",
                ));
            }
            (true, None) => {
                let at = entry.action.as_ref().and_then(|a| line(&a.referenced));
                return Err(self.error(
                    at,
                    &field("chain"),
                    "`action: fallback` needs `chain`, the name of one of `chains`",
                ));
            }
            (true, Some(chain)) => Some(chains.get(&chain.value).cloned().ok_or_else(|| {
                self.error(
                    line(&chain.referenced),
                    &field("chain"),
                    format!("{:?} is not the name of one of `chains`", chain.value),
                )
            })?),
        };
        let action = match (retry, entry.retries) {
            (false, None) => Action::Pass,
            (false, Some(retries)) => {
                return Err(self.error(
                    line(&retries.referenced),
                    &field("retries"),
                    "needs `action: retry` or `action: fallback`",
                ));
            }
            (true, retries) => {
                let times = match retries {
                    None => 1,
                    Some(r) if (1..=MAX_RETRIES).contains(&r.value) => r.value,
                    Some(r) => {
                        return Err(self.error(
                            line(&r.referenced),
                            &field("retries"),
                            format!("{} is not 1 to {MAX_RETRIES}", r.value),
                        ));
                    }
                };
                Action::Retry { times }
            }
        };
        if retry && bans.is_empty() {
            let at = entry.action.as_ref().and_then(|a| line(&a.referenced));
            return Err(self.error(
                at,
                &field("action"),
                "retry is on a ban, and this rule names none (`bans`)",
            ));
        }
        Ok(Rule {
            name: entry.name.value.into(),
            hosts,
            bans,
            cooldown,
            action,
            fallback,
        })
    }

    /// One ban entry, `field` naming it (`rules[0].bans[1]`).
    fn trigger(&self, field: &str, ban: Spanned<BanDoc>) -> Result<Trigger, RulesError> {
        let at = line(&ban.referenced);
        let ban = ban.value;
        let sub = |name: &str| format!("{field}.{name}");
        if ban.status.is_none() && ban.header.is_none() && ban.body.is_none() {
            return Err(self.error(
                at,
                field,
                "has no condition: give status, header or body (or several, which must all hold)",
            ));
        }
        let statuses = match ban.status {
            None => None,
            Some(list) if list.value.is_empty() => {
                return Err(self.error(
                    line(&list.referenced),
                    &sub("status"),
                    "is empty: leave it out to match any status",
                ));
            }
            Some(list) => Some(
                list.value
                    .iter()
                    .enumerate()
                    .map(|(s, status)| {
                        u16::try_from(status.value)
                            .ok()
                            .filter(|s| (100..=599).contains(s))
                            .ok_or_else(|| {
                                self.error(
                                    line(&status.referenced),
                                    &sub(&format!("status[{s}]")),
                                    format!("{} is not an HTTP status (100 to 599)", status.value),
                                )
                            })
                    })
                    .collect::<Result<Vec<_>, _>>()?,
            ),
        };
        let header = match ban.header {
            None => None,
            Some(header) => Some(self.header(&sub("header"), header)?),
        };
        let body = match ban.body {
            None => None,
            Some(body) => Some(Regex::new(&body.value).map_err(|e| {
                self.error(
                    line(&body.referenced),
                    &sub("body"),
                    one_line(&e.to_string()),
                )
            })?),
        };
        let result = ban
            .result
            .value
            .parse::<ReportResult>()
            .ok()
            .filter(|r| *r != ReportResult::Ok)
            .ok_or_else(|| {
                self.error(
                    line(&ban.result.referenced),
                    &sub("result"),
                    format!(
                        "{:?} is not rate_limited, blocked or error",
                        ban.result.value
                    ),
                )
            })?;
        Ok(Trigger {
            statuses,
            header,
            body,
            result,
        })
    }

    fn header(&self, field: &str, header: HeaderDoc) -> Result<HeaderMatch, RulesError> {
        let name = HeaderName::from_bytes(header.name.value.as_bytes()).map_err(|_| {
            self.error(
                line(&header.name.referenced),
                &format!("{field}.name"),
                format!("{:?} is not a header name", header.name.value),
            )
        })?;
        let value = match header.value {
            None => None,
            Some(value) => {
                if HeaderValue::from_str(&value.value).is_err() {
                    return Err(self.error(
                        line(&value.referenced),
                        &format!("{field}.value"),
                        format!("{:?} is not a header value", value.value),
                    ));
                }
                Some(value.value)
            }
        };
        Ok(HeaderMatch { name, value })
    }
}

/// A multi-line message (a regex error draws the pattern and a caret) on one line, for logs.
fn one_line(message: &str) -> String {
    message
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Why `name` is no rule name: 1 to 63 lowercase letters, digits and `-`, starting and
/// ending with a letter or digit, and not the default rule's.
fn name_problem(name: &str) -> Option<String> {
    let valid = (1..=MAX_NAME).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if !valid {
        return Some(format!(
            "{name:?} is not 1 to {MAX_NAME} lowercase letters, digits and '-', starting and \
             ending with a letter or digit"
        ));
    }
    (name == DEFAULT_RULE).then(|| {
        format!(
            "{DEFAULT_RULE:?} is the rule of --gateway-ban-statuses, for the hosts no rule \
             names; name this one otherwise"
        )
    })
}

/// Re-reads the rules file every `poll` until `shutdown` (see
/// [`watched_file`](crate::serving::watched_file)) and, when its content changed, puts its
/// rules in force with `default` for the other hosts. A bad edit keeps the last good rules
/// and is logged once: a typo never drops every ban.
pub async fn watch(
    file: RulesFile,
    content: Vec<u8>,
    default: BanRule,
    rules: Rules,
    poll: Duration,
    shutdown: CancellationToken,
) {
    let path = file.path().to_path_buf();
    let apply = move |new: &[u8]| reload(&file, &default, &rules, new);
    watched_file::watch(
        FLAG,
        path,
        content,
        apply,
        "keeping the previous rules",
        poll,
        shutdown,
    )
    .await;
}

/// Puts `content`'s rules in force, or says why not (and changes nothing).
fn reload(
    file: &RulesFile,
    default: &BanRule,
    rules: &Rules,
    content: &[u8],
) -> Result<String, String> {
    let parsed = file.parse(content).map_err(|e| e.0)?;
    let applied = format!(
        "{} rule(s), {} chain(s)",
        parsed.rules.len(),
        parsed.chains.len()
    );
    rules.replace(RuleSet::of_file(default, parsed));
    Ok(applied)
}

#[cfg(test)]
mod tests {
    use std::fs::OpenOptions;
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    use std::sync::Arc;

    use hyper::HeaderMap;

    use super::*;

    /// How long a test waits for the watcher before it fails.
    const DEADLINE: Duration = Duration::from_secs(30);

    fn parse(text: &str) -> Result<Vec<Rule>, RulesError> {
        RulesFile::new("/run/rules.yaml")
            .parse(text.as_bytes())
            .map(|parsed| parsed.rules)
    }

    #[test]
    fn a_good_file_round_trips() {
        let rules = parse(
            "rules:
  - name: shop-captcha
    hosts: [Shop.Example.com, \"*.example.org\"]
    bans:
      - status: [403, 429]
        result: blocked
      - header: {name: CF-Mitigated, value: challenge}
        result: blocked
      - status: [200]
        body: \"(?i)captcha|are you a robot\"
        result: rate_limited
    cooldown: 10m
    action: retry
    retries: 2
  - name: rest
    hosts: [\"*\"]
",
        )
        .unwrap();
        let set = RuleSet::new(&BanRule::default(), rules);
        assert_eq!(
            set.names().collect::<Vec<_>>(),
            ["shop-captcha", "rest", "default"]
        );
        let shop = set.for_host("shop.example.com");
        assert_eq!(shop.name(), "shop-captcha");
        assert!(std::ptr::eq(shop, set.for_host("a.example.org")));
        assert_eq!(shop.action(), Action::Retry { times: 2 });
        assert!(shop.reads_body());
        let mut challenge = HeaderMap::new();
        challenge.insert("cf-mitigated", HeaderValue::from_static("Challenge"));
        let none = HeaderMap::new();
        let ban = |result| {
            Some(super::super::Ban {
                rule: "shop-captcha".into(),
                result,
                cooldown: Some(Duration::from_secs(600)),
            })
        };
        assert_eq!(shop.judge(429, &none, b""), ban(ReportResult::Blocked));
        assert_eq!(shop.judge(200, &challenge, b""), ban(ReportResult::Blocked));
        assert_eq!(
            shop.judge(200, &none, b"Are you a ROBOT?"),
            ban(ReportResult::RateLimited)
        );
        assert_eq!(shop.judge(200, &none, b"welcome"), None);
        let rest = set.for_host("example.org");
        assert_eq!(rest.name(), "rest");
        assert_eq!(rest.action(), Action::Pass);
        assert!(!rest.reads_body());
        assert_eq!(
            rest.judge(429, &none, b""),
            None,
            "no ban entry: nothing is a ban"
        );
    }

    #[test]
    fn an_empty_file_leaves_the_default_rule_only() {
        let set = RuleSet::new(&BanRule::default(), parse("rules: []\n").unwrap());
        assert_eq!(set.names().collect::<Vec<_>>(), [DEFAULT_RULE]);
        assert_eq!(
            set.for_host("x.example")
                .judge(429, &HeaderMap::new(), b"")
                .map(|b| b.result),
            Some(ReportResult::RateLimited)
        );
    }

    #[test]
    fn the_sample_loads() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("samples/gateway-rules.yaml");
        let (rules, content) = RulesFile::new(&path)
            .load()
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(content, std::fs::read(&path).unwrap());
        let set = RuleSet::of_file(&BanRule::default(), rules);
        assert_eq!(
            set.names().collect::<Vec<_>>(),
            ["shop-captcha", "api-partner", "marketplace", DEFAULT_RULE]
        );
        let chain = set.for_host("market.example.com").fallback();
        assert_eq!(chain.map(|c| &*c.name), Some("own-then-rented"));
        assert!(set.chain("own-then-rented").is_some());
        assert_eq!(
            set.for_host("www.example.org").action(),
            Action::Retry { times: 2 }
        );
        assert_eq!(
            set.for_host("api.partner.example")
                .judge(403, &HeaderMap::new(), b""),
            None
        );
    }

    #[test]
    fn a_fallback_rule_walks_its_chain_and_retries_like_retry() {
        let text = [
            "rules:",
            "  - name: shop",
            "    hosts: [shop.example]",
            "    bans: [{status: [429], result: rate_limited}]",
            "    action: fallback",
            "    chain: own-then-rented",
            "chains:",
            "  - name: own-then-rented",
            "    steps: [\"tier=own\", \"pool=rented,geo=eu\"]",
        ]
        .join("\n");
        let parsed = RulesFile::new("/run/rules.yaml")
            .parse(text.as_bytes())
            .unwrap_or_else(|e| panic!("{e}"));
        let set = RuleSet::of_file(&BanRule::default(), parsed);
        let chain = set.chain("own-then-rented").expect("the chain by name");
        assert_eq!(
            chain.steps,
            [
                Selector::parse("tier=own").unwrap(),
                Selector::parse("geo=eu,pool=rented").unwrap()
            ]
        );
        let rule = set.for_host("shop.example");
        assert_eq!(rule.action(), Action::Retry { times: 1 });
        assert_eq!(rule.fallback(), Some(chain));
        assert_eq!(set.for_host("other.example").fallback(), None);
        assert_eq!(set.chain("nope"), None);
    }

    #[test]
    fn a_file_that_cannot_be_read_is_named() {
        let e = RulesFile::new("/nonexistent/rules.yaml")
            .load()
            .unwrap_err()
            .0;
        assert!(
            e.starts_with("--gateway-rules-file /nonexistent/rules.yaml: cannot read:"),
            "{e}"
        );
    }

    #[test]
    fn a_bad_file_names_its_line_and_field() {
        // Each case: the file's lines, the line at fault, and what the message says there.
        const SHOP: [&str; 3] = ["rules:", "  - name: shop", "    hosts: [shop.example.com]"];
        let shop = |more: &[&'static str]| [&SHOP[..], more].concat();
        let long_name = format!("  - name: {}", "a".repeat(64));
        let cases: Vec<(Vec<&str>, u64, &str)> = vec![
            (vec!["rule: []"], 1, "unknown field `rule`"),
            (vec!["rules: {}"], 1, ""),
            (shop(&["    host: [x]"]), 4, "unknown field `host`"),
            (
                shop(&["    bans:", "      - {statuses: [403], result: blocked}"]),
                5,
                "unknown field `statuses`",
            ),
            (
                shop(&[
                    "    bans:",
                    "      - {header: {name: a, values: b}, result: blocked}",
                ]),
                5,
                "unknown field `values`",
            ),
            (
                vec!["rules:", "  - hosts: [a.example]"],
                2,
                "missing field `name`",
            ),
            (
                vec!["rules:", "  - name: \"\"", "    hosts: [a.example]"],
                2,
                "rules[0].name: \"\" is not 1 to 63 lowercase letters, digits and '-'",
            ),
            (
                vec!["rules:", "  - name: Shop", "    hosts: [a.example]"],
                2,
                "rules[0].name: \"Shop\" is not 1 to 63",
            ),
            (
                vec!["rules:", "  - name: shop_1", "    hosts: [a.example]"],
                2,
                "rules[0].name: \"shop_1\" is not",
            ),
            (
                vec!["rules:", "  - name: -shop", "    hosts: [a.example]"],
                2,
                "rules[0].name: \"-shop\" is not",
            ),
            (
                vec!["rules:", &long_name, "    hosts: [a.example]"],
                2,
                "rules[0].name: \"aaaa",
            ),
            (
                vec!["rules:", "  - name: default", "    hosts: [a.example]"],
                2,
                "rules[0].name: \"default\" is the rule of --gateway-ban-statuses",
            ),
            (
                shop(&[
                    "  - name: other",
                    "    hosts: [b.example]",
                    "  - name: shop",
                    "    hosts: [c.example]",
                ]),
                6,
                "rules[2].name: \"shop\" is rules[0]'s name too",
            ),
            (
                vec!["rules:", "  - name: shop", "    hosts: []"],
                3,
                "rules[0].hosts: names no host",
            ),
            (vec!["rules:", "  - name: shop"], 2, "missing field `hosts`"),
            (
                vec![
                    "rules:",
                    "  - name: shop",
                    "    hosts:",
                    "      - shop.example.com",
                    "      - \"a.*.example.com\"",
                ],
                5,
                "rules[0].hosts[1]: \"a.*.example.com\" is not a host",
            ),
            (
                vec!["rules:", "  - name: shop", "    hosts: [\"*.\"]"],
                3,
                "rules[0].hosts[0]: \"*.\" is not `*.` and a host name",
            ),
            (
                shop(&["    bans:", "      - result: blocked"]),
                5,
                "rules[0].bans[0]: has no condition",
            ),
            (
                shop(&["    bans:", "      - status: [403]"]),
                5,
                "missing field `result`",
            ),
            (
                shop(&["    bans:", "      - status: []", "        result: blocked"]),
                5,
                "rules[0].bans[0].status: is empty",
            ),
            (
                shop(&[
                    "    bans:",
                    "      - status:",
                    "          - 403",
                    "          - 700",
                    "        result: blocked",
                ]),
                7,
                "rules[0].bans[0].status[1]: 700 is not an HTTP status (100 to 599)",
            ),
            (
                shop(&[
                    "    bans:",
                    "      - status: [99]",
                    "        result: blocked",
                ]),
                5,
                "rules[0].bans[0].status[0]: 99 is not an HTTP status",
            ),
            (
                shop(&[
                    "    bans:",
                    "      - status: [-1]",
                    "        result: blocked",
                ]),
                5,
                "",
            ),
            (
                vec![
                    "rules:",
                    "  - name: a",
                    "    hosts: [a.example]",
                    "  - name: b",
                    "    hosts: [b.example]",
                    "    bans:",
                    "      - body: \"(captcha\"",
                    "        result: blocked",
                ],
                7,
                "rules[1].bans[0].body: regex parse error: (captcha ^ error: unclosed group",
            ),
            (
                shop(&[
                    "    bans:",
                    "      - header: {name: \"bad name\"}",
                    "        result: blocked",
                ]),
                5,
                "rules[0].bans[0].header.name: \"bad name\" is not a header name",
            ),
            (
                shop(&[
                    "    bans:",
                    "      - header: {name: x, value: \"a\\nb\"}",
                    "        result: blocked",
                ]),
                5,
                "rules[0].bans[0].header.value: \"a\\nb\" is not a header value",
            ),
            (
                shop(&[
                    "    bans:",
                    "      - status: [403]",
                    "        result: banned",
                ]),
                6,
                "rules[0].bans[0].result: \"banned\" is not rate_limited, blocked or error",
            ),
            (
                shop(&["    bans:", "      - status: [403]", "        result: ok"]),
                6,
                "rules[0].bans[0].result: \"ok\" is not rate_limited, blocked or error",
            ),
            (
                shop(&["    cooldown: soon"]),
                4,
                "rules[0].cooldown: \"soon\" is not a length above zero",
            ),
            (
                shop(&["    cooldown: 0s"]),
                4,
                "rules[0].cooldown: \"0s\" is not a length above zero",
            ),
            (
                shop(&["    action: drop"]),
                4,
                "rules[0].action: \"drop\" is not pass, retry or fallback",
            ),
            (
                shop(&[
                    "    bans: [{status: [403], result: blocked}]",
                    "    retries: 2",
                ]),
                5,
                "rules[0].retries: needs `action: retry`",
            ),
            (
                shop(&[
                    "    bans: [{status: [403], result: blocked}]",
                    "    action: pass",
                    "    retries: 2",
                ]),
                6,
                "rules[0].retries: needs `action: retry`",
            ),
            (
                shop(&[
                    "    bans: [{status: [403], result: blocked}]",
                    "    action: retry",
                    "    retries: 0",
                ]),
                6,
                "rules[0].retries: 0 is not 1 to 5",
            ),
            (
                shop(&[
                    "    bans: [{status: [403], result: blocked}]",
                    "    action: retry",
                    "    retries: 6",
                ]),
                6,
                "rules[0].retries: 6 is not 1 to 5",
            ),
            (
                shop(&["    action: retry"]),
                4,
                "rules[0].action: retry is on a ban, and this rule names none",
            ),
            (
                shop(&[
                    "    bans: [{status: [429], result: blocked}]",
                    "    action: fallback",
                ]),
                5,
                "rules[0].chain: `action: fallback` needs `chain`",
            ),
            (
                shop(&[
                    "    bans: [{status: [429], result: blocked}]",
                    "    action: fallback",
                    "    chain: nope",
                ]),
                6,
                "rules[0].chain: \"nope\" is not the name of one of `chains`",
            ),
            (
                shop(&["    chain: own"]),
                4,
                "rules[0].chain: needs `action: fallback`",
            ),
            (
                shop(&["chains:", "  - name: own", "    steps: [\"tier=own\"]"]),
                6,
                "chains[0].steps: holds 1 steps; a chain has 2 to 8",
            ),
            (
                shop(&[
                    "chains:",
                    "  - name: own",
                    "    steps: [\"tier=own\", \"pool\"]",
                ]),
                6,
                "chains[0].steps[1]: selector term \"pool\" is not key=value",
            ),
            (
                shop(&[
                    "chains:",
                    "  - {name: own, steps: [a=1, b=2]}",
                    "  - {name: own, steps: [a=1, b=2]}",
                ]),
                6,
                "chains[1].name: \"own\" names another chain too",
            ),
        ];
        let wrong: Vec<String> = cases
            .iter()
            .filter_map(|(lines, line, expected)| {
                let text = lines.join("\n") + "\n";
                let e = match parse(&text) {
                    Ok(_) => return Some(format!("{text}=> accepted\n")),
                    Err(e) => e.0,
                };
                let at = format!("--gateway-rules-file /run/rules.yaml: line {line}:");
                let right = e.starts_with(&at) && e.contains(expected) && !e.contains('\n');
                (!right).then(|| format!("{text}=> {e}\nexpected line {line}: {expected:?}\n"))
            })
            .collect();
        assert!(wrong.is_empty(), "{}", wrong.join("\n"));
        let e = RulesFile::new("/run/rules.yaml")
            .parse(b"rules: [\xff]\n")
            .unwrap_err()
            .0;
        assert!(
            e.starts_with("--gateway-rules-file /run/rules.yaml: is not UTF-8"),
            "{e}"
        );
    }

    #[test]
    fn at_most_100_rules() {
        let file = |count: usize| {
            let mut text = String::from("rules:\n");
            for i in 0..count {
                text.push_str(&format!("  - {{name: r{i}, hosts: [r{i}.example]}}\n"));
            }
            text
        };
        assert_eq!(parse(&file(MAX_RULES)).unwrap().len(), MAX_RULES);
        let e = parse(&file(MAX_RULES + 1)).unwrap_err().0;
        assert_eq!(
            e, "--gateway-rules-file /run/rules.yaml: line 2: rules: holds 101 rules; at most 100",
            "the line where the list starts"
        );
    }

    /// Makes `link` a symbolic link to `target` in one step, as a mounted Secret swaps its
    /// files.
    fn point(link: &Path, target: &Path) {
        let new = link.with_extension("new");
        let _ = std::fs::remove_file(&new);
        std::os::unix::fs::symlink(target, &new).unwrap();
        std::fs::rename(&new, link).unwrap();
    }

    /// Writes `content` into the FIFO `fifo` once a reader has opened it.
    async fn feed(fifo: &Path, content: &'static [u8]) {
        let writer = {
            let fifo = fifo.to_owned();
            tokio::task::spawn_blocking(move || std::fs::write(fifo, content))
        };
        match tokio::time::timeout(DEADLINE, writer).await {
            Ok(written) => written.unwrap().unwrap(),
            Err(_) => {
                // Opening the other end lets the blocked writer finish, so the test fails
                // instead of hanging.
                let _reader = OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_NONBLOCK)
                    .open(fifo);
                panic!("the watcher never read {}", fifo.display());
            }
        }
    }

    /// Hands `content` to a reader blocked opening `fifo`, if there is one.
    fn release(fifo: &Path, content: &[u8]) {
        // Without a reader, a non-blocking open for writing fails at once (ENXIO).
        if let Ok(mut writer) = OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(fifo)
        {
            writer.write_all(content).unwrap();
        }
    }

    async fn eventually(mut condition: impl FnMut() -> bool, what: &str) {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        while !condition() {
            assert!(tokio::time::Instant::now() < deadline, "never: {what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test]
    async fn watch_puts_a_good_edit_in_force_and_keeps_the_last_good_rules_on_a_bad_one() {
        let dir = tempfile::tempdir().unwrap();
        let version = |name: &str| format!("rules:\n  - {{name: {name}, hosts: [\"*\"]}}\n");
        let regular = |file: &str, content: &str| {
            let path = dir.path().join(file);
            std::fs::write(&path, content).unwrap();
            path
        };
        let path = dir.path().join("rules.yaml");
        point(&path, &regular("v1.yaml", &version("first")));
        let file = RulesFile::new(&path);
        let (loaded, content) = file.load().unwrap();
        let rules = Rules::new(RuleSet::of_file(&BanRule::default(), loaded));
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(watch(
            file,
            content,
            BanRule::default(),
            rules.clone(),
            Duration::from_millis(10),
            shutdown.clone(),
        ));
        let names = || {
            rules
                .current()
                .names()
                .map(str::to_owned)
                .collect::<Vec<_>>()
        };
        assert_eq!(names(), ["first", DEFAULT_RULE]);

        point(&path, &regular("v2.yaml", &version("second")));
        eventually(
            || names() == ["second", DEFAULT_RULE],
            "the good edit in force",
        )
        .await;

        // The bad edit goes through a FIFO, twice: the watcher reads one file at a time, so
        // once it opens the FIFO the second time, it has judged the first read.
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        let in_force = rules.current();
        point(&path, &fifo);
        for _ in 0..2 {
            feed(&fifo, b"rules:\n  - {name: Bad, hosts: [\"*\"]}\n").await;
        }
        assert!(
            Arc::ptr_eq(&in_force, &rules.current()),
            "the bad edit changed the rules: {:?}",
            names()
        );

        let third = version("third");
        point(&path, &regular("v3.yaml", &third));
        eventually(
            || {
                // The watcher may be waiting on the FIFO still.
                release(&fifo, third.as_bytes());
                names() == ["third", DEFAULT_RULE]
            },
            "the next good edit in force",
        )
        .await;

        shutdown.cancel();
        tokio::time::timeout(DEADLINE, task)
            .await
            .expect("the watcher stops at shutdown")
            .unwrap();
    }
}
