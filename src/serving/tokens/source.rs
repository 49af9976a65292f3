//! Where the tokens come from: `DISCOVERY_TOKEN` (one token) and
//! `--discovery-token-file` (one token a line; re-read when its content changes, so a token can
//! be rotated without a restart). Both sources' tokens are valid at once. Start-up fails closed:
//! no usable token stops the process unless `--insecure-no-auth` is given.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::ApiToken;
use crate::serving::watched_file;

/// Shortest token accepted, in bytes.
pub const MIN_TOKEN_BYTES: usize = 16;

/// The environment variable holding one token.
pub const TOKEN_ENV: &str = "DISCOVERY_TOKEN";

/// A token source that cannot be used; the message names the variable, flag, file or line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct TokenError(pub String);

/// A non-empty set of valid tokens.
#[derive(Clone, PartialEq, Eq)]
pub struct TokenSet(Vec<Vec<u8>>);

impl std::fmt::Debug for TokenSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TokenSet({} tokens)", self.0.len())
    }
}

/// Why one token is unusable (`None`: usable). The token is already trimmed.
fn token_problem(token: &[u8]) -> Option<String> {
    if token.is_empty() {
        return Some("is empty".to_owned());
    }
    if std::str::from_utf8(token).is_err() {
        return Some("is not UTF-8".to_owned());
    }
    if !token.iter().all(|b| b.is_ascii_graphic()) {
        return Some(
            "contains a space, a control or a non-ASCII character (a bearer token must be printable ASCII)"
                .to_owned(),
        );
    }
    if token.len() < MIN_TOKEN_BYTES {
        return Some(format!(
            "is {} bytes long; at least {MIN_TOKEN_BYTES} are required (generate one with `openssl rand -hex 32`)",
            token.len()
        ));
    }
    None
}

fn trim(bytes: &[u8]) -> &[u8] {
    let start = bytes
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(bytes.len());
    let end = bytes
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map_or(start, |i| i + 1);
    &bytes[start..end.max(start)]
}

impl TokenSet {
    /// One token (surrounding whitespace ignored); `source` names where it came from.
    pub fn single(token: &[u8], source: &str) -> Result<TokenSet, TokenError> {
        let token = trim(token);
        match token_problem(token) {
            Some(problem) => Err(TokenError(format!("{source} {problem}"))),
            None => Ok(TokenSet(vec![token.to_vec()])),
        }
    }

    /// The content of a token file: one token a line, blank lines and surrounding whitespace
    /// ignored. Every token must be usable and at least one must be present.
    pub fn from_file_content(content: &[u8], path: &Path) -> Result<TokenSet, TokenError> {
        let mut tokens = Vec::new();
        for (index, line) in content.split(|b| *b == b'\n').enumerate() {
            let token = trim(line);
            if token.is_empty() {
                continue;
            }
            if let Some(problem) = token_problem(token) {
                return Err(TokenError(format!(
                    "--discovery-token-file {}: line {}: the token {problem}",
                    path.display(),
                    index + 1
                )));
            }
            if !tokens.iter().any(|t: &Vec<u8>| t.as_slice() == token) {
                tokens.push(token.to_vec());
            }
        }
        if tokens.is_empty() {
            return Err(TokenError(format!(
                "--discovery-token-file {}: the file holds no token (one token a line)",
                path.display()
            )));
        }
        Ok(TokenSet(tokens))
    }

    /// Both sets' tokens.
    pub fn union(mut self, other: &TokenSet) -> TokenSet {
        for token in &other.0 {
            if !self.0.contains(token) {
                self.0.push(token.clone());
            }
        }
        self
    }

    /// How many tokens are valid.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Always false: a set holds at least one token.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The tokens.
    pub(crate) fn tokens(&self) -> &[Vec<u8>] {
        &self.0
    }
}

/// The token configuration of a process, as given on the command line and in the environment.
/// (No `Debug`: it holds the token.)
#[derive(Clone, Default)]
pub struct TokenSources<'a> {
    /// The value of `DISCOVERY_TOKEN`, if set.
    pub env: Option<&'a OsStr>,
    /// `--discovery-token-file`.
    pub file: Option<&'a Path>,
    /// `--insecure-no-auth`.
    pub insecure_no_auth: bool,
    /// `--tenants-file` is given: its tokens are valid too, so the other sources may be
    /// absent.
    pub tenants_file: bool,
}

/// What start-up decided.
pub struct LoadedTokens {
    /// The token the API checks (open only with `--insecure-no-auth`).
    pub token: ApiToken,
    /// The tokens from `DISCOVERY_TOKEN`, kept across re-reads of the file.
    pub env_tokens: Option<TokenSet>,
    /// The file to watch and the content it was loaded from.
    pub file: Option<(PathBuf, Vec<u8>)>,
}

impl std::fmt::Debug for LoadedTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedTokens")
            .field("token", &self.token)
            .field("env_tokens", &self.env_tokens)
            .field("file", &self.file.as_ref().map(|(path, _)| path))
            .finish()
    }
}

fn read_file(path: &Path) -> Result<Vec<u8>, TokenError> {
    std::fs::read(path).map_err(|e| {
        TokenError(format!(
            "--discovery-token-file {}: cannot read: {e}",
            path.display()
        ))
    })
}

/// Loads the tokens at start-up, failing closed: a missing, empty, non-UTF-8 or short token is
/// an error unless `--insecure-no-auth` is given (which then refuses any token, so the
/// configuration cannot be read two ways).
pub fn load(sources: &TokenSources<'_>) -> Result<LoadedTokens, TokenError> {
    if sources.insecure_no_auth {
        let env_set = sources
            .env
            .is_some_and(|v| !trim(v.as_encoded_bytes()).is_empty());
        if env_set || sources.file.is_some() || sources.tenants_file {
            return Err(TokenError(format!(
                "--insecure-no-auth cannot be combined with {TOKEN_ENV}, --discovery-token-file \
                 or --tenants-file: drop the flag to require the token, or unset the tokens to \
                 run without authentication"
            )));
        }
        return Ok(LoadedTokens {
            token: ApiToken::open(),
            env_tokens: None,
            file: None,
        });
    }
    let env_tokens = sources
        .env
        .map(|value| TokenSet::single(value.as_encoded_bytes(), TOKEN_ENV))
        .transpose()?;
    let file = sources
        .file
        .map(|path| {
            let content = read_file(path)?;
            let set = TokenSet::from_file_content(&content, path)?;
            Ok::<_, TokenError>((path.to_path_buf(), content, set))
        })
        .transpose()?;
    let set = match (&env_tokens, &file) {
        (Some(env), Some((_, _, from_file))) => from_file.clone().union(env),
        (Some(env), None) => env.clone(),
        (None, Some((_, _, from_file))) => from_file.clone(),
        (None, None) if sources.tenants_file => {
            return Ok(LoadedTokens {
                token: ApiToken::of_tenants(Vec::new()),
                env_tokens: None,
                file: None,
            });
        }
        (None, None) => {
            return Err(TokenError(format!(
                "no API token: set {TOKEN_ENV} (at least {MIN_TOKEN_BYTES} bytes, e.g. \
                 `export {TOKEN_ENV}=\"$(openssl rand -hex 32)\"`), --discovery-token-file or \
                 --tenants-file, or pass --insecure-no-auth to serve the API without \
                 authentication"
            )));
        }
    };
    Ok(LoadedTokens {
        token: ApiToken::new(set),
        env_tokens,
        file: file.map(|(path, content, _)| (path, content)),
    })
}

/// Re-reads the token file every `poll` (see [`watched_file`]) and, when its content changed,
/// replaces the valid tokens with the file's (plus `DISCOVERY_TOKEN`'s). A read or parse
/// failure keeps the previous tokens and is logged: it never opens the API.
pub async fn watch_file(
    path: PathBuf,
    content: Vec<u8>,
    env_tokens: Option<TokenSet>,
    token: ApiToken,
    poll: Duration,
    shutdown: CancellationToken,
) {
    let file = path.clone();
    let apply = move |new: &[u8]| {
        let set = TokenSet::from_file_content(new, &file).map_err(|e| e.0)?;
        let set = match &env_tokens {
            Some(env) => set.union(env),
            None => set,
        };
        let count = set.len();
        token.replace(set);
        Ok(format!("{count} valid API token(s)"))
    };
    let keeping = "keeping the previous API tokens";
    let flag = "--discovery-token-file";
    watched_file::watch(flag, path, content, apply, keeping, poll, shutdown).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "0123456789abcdef";

    #[test]
    fn single_token_rules() {
        let cases: [(&[u8], Option<&str>); 7] = [
            (GOOD.as_bytes(), None),
            (b"  0123456789abcdef\n", None),
            (b"", Some("DISCOVERY_TOKEN is empty")),
            (b" \t\n", Some("DISCOVERY_TOKEN is empty")),
            (b"0123456789abcde", Some("is 15 bytes long; at least 16")),
            (b"0123456789abcdef\xff", Some("is not UTF-8")),
            (b"0123456789 abcdef", Some("printable ASCII")),
        ];
        for (token, expected) in cases {
            let result = TokenSet::single(token, TOKEN_ENV);
            match expected {
                None => assert_eq!(result.map(|s| s.len()), Ok(1), "{token:?}"),
                Some(message) => {
                    let e = result.unwrap_err().0;
                    assert!(e.contains(message), "{token:?}: {e}");
                }
            }
        }
    }

    #[test]
    fn file_content_names_the_line() {
        let path = Path::new("/run/tokens");
        let set = TokenSet::from_file_content(b"\n  0123456789abcdef \n\nfedcba9876543210\n", path)
            .unwrap();
        assert_eq!(set.len(), 2);
        let e = TokenSet::from_file_content(b"0123456789abcdef\n\nshort\n", path)
            .unwrap_err()
            .0;
        assert!(
            e.contains("--discovery-token-file /run/tokens: line 3:") && e.contains("5 bytes"),
            "{e}"
        );
        let e = TokenSet::from_file_content(b" \n\n", path).unwrap_err().0;
        assert!(e.contains("holds no token"), "{e}");
    }

    #[test]
    fn start_up_fails_closed() {
        let e = load(&TokenSources::default()).unwrap_err().0;
        assert!(
            e.contains("DISCOVERY_TOKEN") && e.contains("--insecure-no-auth"),
            "{e}"
        );
        let open = load(&TokenSources {
            insecure_no_auth: true,
            env: Some(OsStr::new("")),
            ..TokenSources::default()
        })
        .unwrap();
        assert!(!open.token.is_required());
        let e = load(&TokenSources {
            insecure_no_auth: true,
            env: Some(OsStr::new(GOOD)),
            ..TokenSources::default()
        })
        .unwrap_err()
        .0;
        assert!(e.contains("cannot be combined"), "{e}");
        let e = load(&TokenSources {
            file: Some(Path::new("/nonexistent/tokens")),
            env: Some(OsStr::new(GOOD)),
            ..TokenSources::default()
        })
        .unwrap_err()
        .0;
        assert!(
            e.contains("--discovery-token-file /nonexistent/tokens: cannot read"),
            "{e}"
        );
    }
}
