//! The tenants file (`--tenants-file`, YAML, mounted from a Secret): each tenant's name, the
//! SHA-256 digests of its tokens (so the Secret holds no usable token), its scope and its
//! quotas. Read at start-up, where a bad file stops the process, and re-read when its content
//! changes, where a bad file is logged and the last good set stays in force: like the token
//! file, it fails closed. Every error names the file, the line and the field.
//!
//! ```yaml
//! tenants:
//!   - name: team-a
//!     tokens: ["sha256:<64 hex digits: printf %s "$TOKEN" | sha256sum>"]
//!     scope:
//!       namespaces: [crawl-a]
//!       selector: {team: a}
//!     quotas:
//!       leases: 20
//!       sessions: 10
//!       acquiresPerSecond: 5
//!       burst: 10
//!       bytesPerDay: 20GiB    # through the gateway per UTC day (a number of bytes, or units)
//!     interception: true      # may ask the gateway for tls=inspect (default false)
//! ```

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use serde_saphyr::Spanned;
use tokio_util::sync::CancellationToken;

use super::{Tenant, TokenDigest};
use crate::ledger::{DEFAULT_TENANT, Quotas, Rate};
use crate::serving::candidates::Selector;
use crate::serving::watched_file;

/// Most tenants one file may name: they are metric labels, so their number stays bounded.
pub const MAX_TENANTS: usize = 100;

/// Longest tenant name (a Kubernetes label value's length).
const MAX_NAME: usize = 63;

/// The prefix of a token digest.
const SHA256: &str = "sha256:";

/// Why a tenants file was refused: the message names the file, and the line and field at
/// fault when there is one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct TenantsError(pub String);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileDoc {
    tenants: Spanned<Vec<Spanned<TenantDoc>>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantDoc {
    name: Spanned<String>,
    tokens: Spanned<Vec<Spanned<String>>>,
    #[serde(default)]
    scope: Option<Spanned<ScopeDoc>>,
    #[serde(default)]
    quotas: Option<QuotasDoc>,
    /// Whether its requests may ask the gateway to intercept their TLS.
    #[serde(default)]
    interception: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ScopeDoc {
    #[serde(default)]
    namespaces: Option<Spanned<Vec<Spanned<String>>>>,
    #[serde(default)]
    selector: Option<Spanned<BTreeMap<String, String>>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct QuotasDoc {
    #[serde(default)]
    leases: Option<Spanned<u32>>,
    #[serde(default)]
    sessions: Option<Spanned<u32>>,
    #[serde(default)]
    acquires_per_second: Option<Spanned<f64>>,
    #[serde(default)]
    burst: Option<Spanned<u32>>,
    #[serde(default)]
    bytes_per_day: Option<Spanned<ByteCount>>,
}

/// A number of bytes as the file spells it: a whole number, or with units (`20GiB`, `1.5TB`).
#[derive(Deserialize)]
#[serde(untagged)]
enum ByteCount {
    Bytes(u64),
    Text(String),
}

impl ByteCount {
    /// The bytes, or why the spelling is none.
    fn bytes(&self) -> Result<u64, String> {
        match self {
            ByteCount::Bytes(bytes) => Ok(*bytes),
            ByteCount::Text(text) => text
                .trim()
                .parse::<bytesize::ByteSize>()
                .map(|size| size.as_u64())
                .map_err(|e| format!("{text:?} is not a number of bytes: {e}")),
        }
    }
}

/// A tenants file, and what it says: every token digest with its tenant.
#[derive(Debug, Clone)]
pub struct TenantsFile {
    path: PathBuf,
}

/// What a load found: the tenants' tokens and the content they came from.
#[derive(Debug, Clone)]
pub struct LoadedTenants {
    /// Every token digest with its tenant, in the file's order.
    pub tokens: Vec<(TokenDigest, Arc<Tenant>)>,
    /// The tenants, in the file's order.
    pub tenants: Vec<Arc<Tenant>>,
    /// The content they were read from.
    pub content: Vec<u8>,
}

impl TenantsFile {
    /// The file at `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        TenantsFile { path: path.into() }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn error(
        &self,
        line: Option<u64>,
        field: &str,
        problem: impl std::fmt::Display,
    ) -> TenantsError {
        let at = line.map(|l| format!(" line {l}:")).unwrap_or_default();
        let field = if field.is_empty() {
            String::new()
        } else {
            format!(" {field}:")
        };
        TenantsError(format!(
            "--tenants-file {}:{at}{field} {problem}",
            self.path.display()
        ))
    }

    /// Reads and checks the file.
    pub fn load(&self) -> Result<LoadedTenants, TenantsError> {
        let content = std::fs::read(&self.path)
            .map_err(|e| self.error(None, "", format!("cannot read: {e}")))?;
        self.parse(content)
    }

    /// Checks `content` as the file's.
    pub fn parse(&self, content: Vec<u8>) -> Result<LoadedTenants, TenantsError> {
        let text = std::str::from_utf8(&content)
            .map_err(|e| self.error(None, "", format!("is not UTF-8: {e}")))?;
        let doc: FileDoc = serde_saphyr::from_str(text).map_err(|e| {
            let line = e.location().map(|l| l.line());
            // The parser's message carries its own location; the line is said first.
            self.error(line, "", e.to_string().lines().next().unwrap_or_default())
        })?;
        let line = |at: &serde_saphyr::Location| Some(at.line());
        if doc.tenants.value.is_empty() {
            return Err(self.error(
                line(&doc.tenants.referenced),
                "tenants",
                "names no tenant (remove --tenants-file to serve the token file's tokens only)",
            ));
        }
        if doc.tenants.value.len() > MAX_TENANTS {
            return Err(self.error(
                line(&doc.tenants.referenced),
                "tenants",
                format!(
                    "names {} tenants; at most {MAX_TENANTS}",
                    doc.tenants.value.len()
                ),
            ));
        }
        let mut tokens = Vec::new();
        let mut tenants = Vec::new();
        let mut names: HashMap<String, usize> = HashMap::new();
        let mut digests: HashMap<TokenDigest, String> = HashMap::new();
        for (index, entry) in doc.tenants.value.into_iter().enumerate() {
            let field = |name: &str| format!("tenants[{index}].{name}");
            let entry = entry.value;
            let name = entry.name.value;
            if let Some(problem) = name_problem(&name) {
                return Err(self.error(line(&entry.name.referenced), &field("name"), problem));
            }
            if let Some(first) = names.insert(name.clone(), index) {
                return Err(self.error(
                    line(&entry.name.referenced),
                    &field("name"),
                    format!("{name:?} is tenants[{first}]'s name too"),
                ));
            }
            if entry.tokens.value.is_empty() {
                return Err(self.error(
                    line(&entry.tokens.referenced),
                    &field("tokens"),
                    "names no token digest",
                ));
            }
            let mut own = Vec::new();
            for (t, token) in entry.tokens.value.iter().enumerate() {
                let at = line(&token.referenced);
                let field = field(&format!("tokens[{t}]"));
                let digest = parse_digest(&token.value).map_err(|p| self.error(at, &field, p))?;
                if let Some(owner) = digests.insert(digest, name.clone()) {
                    return Err(self.error(
                        at,
                        &field,
                        format!("this digest is also a token of tenant {owner:?}"),
                    ));
                }
                own.push(digest);
            }
            let scope = match entry.scope {
                Some(scope) => self.scope(index, scope.value)?,
                None => Selector::default(),
            };
            let quotas = match entry.quotas {
                Some(quotas) => self.quotas(index, quotas)?,
                None => Quotas::default(),
            };
            let tenant = Arc::new(Tenant {
                name: name.into(),
                scope,
                quotas,
                interception: entry.interception,
            });
            tokens.extend(own.into_iter().map(|digest| (digest, tenant.clone())));
            tenants.push(tenant);
        }
        Ok(LoadedTenants {
            tokens,
            tenants,
            content,
        })
    }

    fn scope(&self, index: usize, scope: ScopeDoc) -> Result<Selector, TenantsError> {
        let line = |at: &serde_saphyr::Location| Some(at.line());
        let mut selector = Selector::default();
        if let Some(labels) = scope.selector {
            if let Some(key) = labels.value.keys().find(|k| k.trim().is_empty()) {
                return Err(self.error(
                    line(&labels.referenced),
                    &format!("tenants[{index}].scope.selector"),
                    format!("the label key {key:?} is empty"),
                ));
            }
            selector = Selector::from(labels.value);
        }
        if let Some(namespaces) = scope.namespaces {
            let field = format!("tenants[{index}].scope.namespaces");
            if namespaces.value.is_empty() {
                return Err(self.error(
                    line(&namespaces.referenced),
                    &field,
                    "is empty: leave it out to allow every namespace",
                ));
            }
            for namespace in &namespaces.value {
                if let Some(problem) = name_problem(&namespace.value) {
                    return Err(self.error(line(&namespace.referenced), &field, problem));
                }
            }
            selector = selector.in_namespaces(namespaces.value.into_iter().map(|n| n.value));
        }
        Ok(selector)
    }

    fn quotas(&self, index: usize, quotas: QuotasDoc) -> Result<Quotas, TenantsError> {
        let line = |at: &serde_saphyr::Location| Some(at.line());
        let field = |name: &str| format!("tenants[{index}].quotas.{name}");
        let rate = match (quotas.acquires_per_second, quotas.burst) {
            (None, None) => None,
            (None, Some(burst)) => {
                return Err(self.error(
                    line(&burst.referenced),
                    &field("burst"),
                    "needs acquiresPerSecond",
                ));
            }
            (Some(rate), burst) => {
                if !(rate.value.is_finite() && rate.value > 0.0 && rate.value <= 1e6) {
                    return Err(self.error(
                        line(&rate.referenced),
                        &field("acquiresPerSecond"),
                        format!("{} is not above 0 and at most 1000000", rate.value),
                    ));
                }
                let burst = match burst {
                    Some(burst) if burst.value == 0 => {
                        return Err(self.error(
                            line(&burst.referenced),
                            &field("burst"),
                            "must be at least 1",
                        ));
                    }
                    Some(burst) => burst.value,
                    None => default_burst(rate.value),
                };
                Some(Rate {
                    per_second: rate.value,
                    burst,
                })
            }
        };
        let bytes_per_day = match quotas.bytes_per_day {
            None => None,
            Some(spelled) => match spelled.value.bytes() {
                Ok(0) => {
                    return Err(self.error(
                        line(&spelled.referenced),
                        &field("bytesPerDay"),
                        "must be at least 1 byte",
                    ));
                }
                Ok(bytes) => Some(bytes),
                Err(why) => {
                    return Err(self.error(line(&spelled.referenced), &field("bytesPerDay"), why));
                }
            },
        };
        Ok(Quotas {
            leases: quotas.leases.map(|l| l.value),
            sessions: quotas.sessions.map(|s| s.value),
            rate,
            bytes_per_day,
        })
    }
}

/// The burst of a rate that names none: one second's worth, at least one.
fn default_burst(per_second: f64) -> u32 {
    // Within u32: the rate is at most 1,000,000.
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "a positive rate of at most 1,000,000"
    )]
    let burst = per_second.ceil() as u32;
    burst.max(1)
}

/// Why `name` is no tenant (or namespace) name: 1 to 63 lowercase letters, digits and `-`,
/// starting and ending with a letter or digit; a tenant may not be called `default`.
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
    (name == DEFAULT_TENANT).then(|| {
        format!(
            "{DEFAULT_TENANT:?} is the tenant of DISCOVERY_TOKEN and --discovery-token-file; \
             name this one otherwise"
        )
    })
}

/// The digest `sha256:<64 hex digits>` names. The error never repeats the value: it may be a
/// token pasted by mistake, and errors are logged.
fn parse_digest(text: &str) -> Result<TokenDigest, String> {
    let problem = || {
        format!(
            "is not a token digest ({} characters): write sha256: and the 64 hex digits of \
             `printf %s \"$TOKEN\" | sha256sum`; if a token was written there, rotate it",
            text.chars().count()
        )
    };
    let hex = text.strip_prefix(SHA256).ok_or_else(problem)?;
    if hex.len() != 64 {
        return Err(problem());
    }
    let mut digest = [0u8; 32];
    for (i, byte) in digest.iter_mut().enumerate() {
        *byte = hex
            .get(2 * i..2 * i + 2)
            .and_then(|pair| u8::from_str_radix(pair, 16).ok())
            .ok_or_else(problem)?;
    }
    Ok(digest)
}

/// Loads the tenants file at start-up (a bad file is an error, the process does not start).
pub fn load(path: &Path) -> Result<LoadedTenants, TenantsError> {
    TenantsFile::new(path).load()
}

/// Re-reads the tenants file every `poll` until `shutdown` (see
/// [`watched_file`](crate::serving::watched_file)) and, when its content changed, hands its
/// tenants' tokens to `replace` (which makes them the valid ones). A read or parse failure
/// keeps the previous tenants and is logged: it never opens the API.
pub async fn watch_file(
    file: TenantsFile,
    content: Vec<u8>,
    replace: impl Fn(Vec<(TokenDigest, Arc<Tenant>)>) + Send,
    poll: Duration,
    shutdown: CancellationToken,
) {
    let path = file.path().to_path_buf();
    let apply = move |new: &[u8]| {
        let loaded = file.parse(new.to_vec()).map_err(|e| e.0)?;
        let applied = format!(
            "{} tenant(s), {} token(s)",
            loaded.tenants.len(),
            loaded.tokens.len()
        );
        replace(loaded.tokens);
        Ok(applied)
    };
    let keeping = "keeping the previous tenants";
    watched_file::watch(
        "--tenants-file",
        path,
        content,
        apply,
        keeping,
        poll,
        shutdown,
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    fn digest(token: &[u8]) -> TokenDigest {
        Sha256::digest(token).into()
    }

    fn hex(token: &str) -> String {
        hex::encode(digest(token.as_bytes()))
    }

    fn parse(text: &str) -> Result<LoadedTenants, TenantsError> {
        TenantsFile::new("/run/tenants.yaml").parse(text.as_bytes().to_vec())
    }

    #[test]
    fn a_file_names_tenants_their_token_digests_scope_and_quotas() {
        let text = format!(
            "tenants:
  - name: team-a
    tokens: [\"sha256:{a}\", \"sha256:{a2}\"]
    scope:
      namespaces: [crawl-a]
      selector: {{team: a}}
    quotas: {{leases: 20, sessions: 10, acquiresPerSecond: 2.5, burst: 8, bytesPerDay: 2GiB}}
  - name: team-b
    tokens: [\"sha256:{b}\"]
    quotas: {{acquiresPerSecond: 2.5, bytesPerDay: 1000000}}
",
            a = hex("team-a-token-0123456789"),
            a2 = hex("team-a-next-0123456789"),
            b = hex("team-b-token-0123456789"),
        );
        let loaded = parse(&text).unwrap();
        assert_eq!(loaded.tenants.len(), 2);
        assert_eq!(loaded.tokens.len(), 3);
        let a = &loaded.tenants[0];
        assert_eq!(&*a.name, "team-a");
        assert_eq!(
            a.quotas,
            Quotas {
                leases: Some(20),
                sessions: Some(10),
                rate: Some(Rate {
                    per_second: 2.5,
                    burst: 8
                }),
                bytes_per_day: Some(2 << 30),
            }
        );
        let labels = crate::fixtures::label_map(&[("team", "a")]);
        assert!(a.scope.matches("crawl-a", Some(&labels)));
        assert!(!a.scope.matches("crawl-b", Some(&labels)));
        assert_eq!(loaded.tokens[0].0, digest(b"team-a-token-0123456789"));
        let b = &loaded.tenants[1];
        assert!(b.sees_everything());
        assert_eq!(
            b.quotas.rate.map(|r| r.burst),
            Some(3),
            "one second's worth"
        );
        assert_eq!((b.quotas.leases, b.quotas.sessions), (None, None));
        assert_eq!(b.quotas.bytes_per_day, Some(1_000_000));
    }

    #[test]
    fn a_bad_file_names_its_line_and_field() {
        let a = hex("team-a-token-0123456789");
        let cases: Vec<(String, &str)> = vec![
            ("tenants: []\n".into(), "line 1: tenants: names no tenant"),
            (
                format!(
                    "tenants:\n  - name: a\n    tokens: [\"sha256:{a}\"]\n    quotas:\n      bytesPerDay: 0\n"
                ),
                "line 5: tenants[0].quotas.bytesPerDay: must be at least 1 byte",
            ),
            (
                format!(
                    "tenants:\n  - name: a\n    tokens: [\"sha256:{a}\"]\n    quotas:\n      bytesPerDay: lots\n"
                ),
                "line 5: tenants[0].quotas.bytesPerDay: \"lots\" is not a number of bytes",
            ),
            (
                format!("tenants:\n  - name: Team-A\n    tokens: [\"sha256:{a}\"]\n"),
                "line 2: tenants[0].name: \"Team-A\" is not",
            ),
            (
                format!("tenants:\n  - name: default\n    tokens: [\"sha256:{a}\"]\n"),
                "line 2: tenants[0].name: \"default\" is the tenant of DISCOVERY_TOKEN",
            ),
            (
                "tenants:\n  - name: team-a\n    tokens: [\"team-a-token-0123456789\"]\n".into(),
                "line 3: tenants[0].tokens[0]: is not a token digest (23 characters)",
            ),
            (
                format!(
                    "tenants:\n  - name: a\n    tokens: [\"sha256:{a}\"]\n  - name: b\n    tokens:\n      - \"sha256:{a}\"\n"
                ),
                "line 6: tenants[1].tokens[0]: this digest is also a token of tenant \"a\"",
            ),
            (
                format!(
                    "tenants:\n  - name: a\n    tokens: [\"sha256:{a}\"]\n  - name: a\n    tokens: [\"sha256:{}\"]\n",
                    hex("other-token-0123456789")
                ),
                "line 4: tenants[1].name: \"a\" is tenants[0]'s name too",
            ),
            (
                format!(
                    "tenants:\n  - name: a\n    tokens: [\"sha256:{a}\"]\n    quotas:\n      burst: 3\n"
                ),
                "line 5: tenants[0].quotas.burst: needs acquiresPerSecond",
            ),
            (
                format!(
                    "tenants:\n  - name: a\n    tokens: [\"sha256:{a}\"]\n    quotas:\n      acquiresPerSecond: 0\n"
                ),
                "line 5: tenants[0].quotas.acquiresPerSecond: 0 is not above 0",
            ),
            (
                format!(
                    "tenants:\n  - name: a\n    tokens: [\"sha256:{a}\"]\n    scope:\n      namespaces: []\n"
                ),
                "line 5: tenants[0].scope.namespaces: is empty",
            ),
            (
                format!("tenants:\n  - name: a\n    tokens: [\"sha256:{a}\"]\n    quota: {{}}\n"),
                "line 4:",
            ),
            (
                format!(
                    "tenants:\n  - name: a\n    tokens: [\"sha256:{a}\"]\n    quotas:\n      leases: -1\n"
                ),
                "line 5:",
            ),
        ];
        for (text, expected) in cases {
            let e = parse(&text).unwrap_err().0;
            assert!(
                e.starts_with("--tenants-file /run/tenants.yaml:") && e.contains(expected),
                "{text}\n=> {e}\nexpected {expected:?}"
            );
            assert!(
                !e.contains("team-a-token"),
                "a token is never repeated: {e}"
            );
        }
    }

    #[test]
    fn digests_are_64_hex_digits_after_sha256() {
        let a = hex("x");
        assert_eq!(parse_digest(&format!("sha256:{a}")), Ok(digest(b"x")));
        assert_eq!(
            parse_digest(&format!("sha256:{}", a.to_uppercase())),
            Ok(digest(b"x"))
        );
        for bad in [
            a.clone(),
            format!("sha256:{}", &a[1..]),
            format!("sha256:{a}0"),
            format!("sha256:{}zz", &a[2..]),
        ] {
            assert!(parse_digest(&bad).is_err(), "{bad}");
        }
    }
}
