//! Upstream credentials: the user name and password a proxy asks of whoever goes through it.
//!
//! An External proxy names a Secret in its namespace (`spec.endpoint.credentialsSecretRef`,
//! keys `username` and `password`); a Managed proxy's machine checks the credentials the
//! operator generated for it, kept in the Secret [`machine_secret_name`] of its namespace. The
//! probe and the gateway send them upstream (`Proxy-Authorization: Basic`); crawlers behind
//! the gateway never see them.
//!
//! The [`CredentialStore`] holds the Secrets the process knows, by namespace and name: fed by
//! the watch of Secrets labelled [`CREDENTIALS_SECRET_LABEL`] in operator mode, by the
//! `kind: Secret` documents of the inventory file in standalone mode. A change reaches the
//! next probe and the next upstream connection without a restart.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, PoisonError, RwLock};

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::runtime::{WatchStreamExt, reflector, watcher};

use crate::resources::naming::machine_name;
use crate::resources::proxy::{Mode, Proxy};
use crate::resources::rotating::{Fill, FillError, Rotating};

/// Label of the Secrets holding proxy credentials: the operator watches those (and labels the
/// ones it generates with it).
pub const CREDENTIALS_SECRET_LABEL: &str = "crawl.example.com/proxy-credentials";
/// Key of the user name in a credentials Secret.
pub const USERNAME_KEY: &str = "username";
/// Key of the password in a credentials Secret.
pub const PASSWORD_KEY: &str = "password";
/// Key of the squid password-file line (`user:$6$...`) in a generated credentials Secret: what
/// the machine's squid checks against.
pub const HTPASSWD_SECRET_KEY: &str = "htpasswd";

/// The Secret holding the credentials the operator generated for the machine of the Proxy with
/// UID `uid` (in the Proxy's namespace): the machine's name with `-credentials`.
pub fn machine_secret_name(uid: &str) -> String {
    format!("{}-credentials", machine_name(uid))
}

/// What a rotating upstream asks for one vendor session: its templates spelled with `fill`
/// (whose `secret` is `secret`'s pair).
pub fn vendor_credentials(
    rotating: &Rotating,
    fill: Fill<'_>,
    secret: Option<&Credentials>,
) -> Result<Credentials, FillError> {
    let fill = Fill {
        secret: secret.map(|s| (s.username.as_str(), s.password.as_str())),
        ..fill
    };
    let (username, password) = rotating.credentials(&fill)?;
    Ok(Credentials { username, password })
}

/// A user name and password for a proxy. `Debug` never shows the password.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    /// The user name.
    pub username: String,
    /// The password.
    pub password: String,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.username)
            .field("password", &"<redacted>")
            .finish()
    }
}

impl Credentials {
    /// The value of a `Proxy-Authorization` header carrying them (`Basic <base64>`).
    pub fn basic(&self) -> String {
        let pair = format!("{}:{}", self.username, self.password);
        format!("Basic {}", STANDARD.encode(pair))
    }

    /// The credentials a Secret holds (keys [`USERNAME_KEY`] and [`PASSWORD_KEY`], in `data`
    /// or `stringData`), or why it holds none usable.
    pub fn from_secret(secret: &Secret) -> Result<Credentials, String> {
        let key = |key: &str| -> Result<String, String> {
            let bytes = secret
                .data
                .as_ref()
                .and_then(|d| d.get(key))
                .map(|b| b.0.clone())
                .or_else(|| {
                    secret
                        .string_data
                        .as_ref()
                        .and_then(|d| d.get(key))
                        .map(|s| s.clone().into_bytes())
                })
                .ok_or_else(|| format!("has no key {key:?}"))?;
            let text = String::from_utf8(bytes).map_err(|_| format!("key {key:?} is not UTF-8"))?;
            if text.is_empty() {
                return Err(format!("key {key:?} is empty"));
            }
            Ok(text)
        };
        let username = key(USERNAME_KEY)?;
        if username.contains(':') {
            return Err(format!("key {USERNAME_KEY:?} contains ':'"));
        }
        Ok(Credentials {
            username,
            password: key(PASSWORD_KEY)?,
        })
    }

    /// New random credentials for a machine: a fixed user name and a 32-hex-digit password
    /// from the OS's secure generator.
    pub fn generate() -> Credentials {
        Credentials {
            username: "proxy-operator".to_owned(),
            password: format!("{:032x}", rand::random::<u128>()),
        }
    }

    /// The squid password-file line for them: `user:` and the SHA-512 crypt hash of the
    /// password (what `basic_ncsa_auth` checks through the system's `crypt(3)`), with a
    /// random salt.
    pub fn htpasswd_line(&self) -> Result<String, String> {
        const SALT_CHARS: &[u8] =
            b"./0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
        let salt: String = (0..16)
            .map(|_| char::from(SALT_CHARS[rand::random_range(0..SALT_CHARS.len())]))
            .collect();
        let params = sha_crypt::Sha512Params::new(sha_crypt::ROUNDS_DEFAULT)
            .map_err(|e| format!("SHA-512 crypt parameters: {e:?}"))?;
        let hash = sha_crypt::sha512_crypt_b64(self.password.as_bytes(), salt.as_bytes(), &params)
            .map_err(|e| format!("SHA-512 crypt: {e:?}"))?;
        Ok(format!("{}:$6${salt}${hash}", self.username))
    }
}

/// The Secret a proxy's credentials are in.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SecretName {
    /// The Proxy's namespace.
    pub namespace: String,
    /// The Secret's name.
    pub name: String,
}

/// Where `proxy`'s credentials are: an External proxy's `credentialsSecretRef`, a Managed
/// proxy's generated Secret; `None` for an External proxy that names none.
pub fn secret_of(proxy: &Proxy) -> Option<SecretName> {
    let name = match proxy.spec.mode {
        Mode::External => proxy
            .spec
            .endpoint
            .as_ref()?
            .credentials_secret_ref
            .as_ref()?
            .name
            .clone(),
        // The UID is worked out only here: a standalone one is hashed from namespace/name.
        Mode::Managed => machine_secret_name(&proxy.id().uid),
    };
    Some(SecretName {
        namespace: proxy.namespace_or_default().to_owned(),
        name,
    })
}

/// The credentials Secrets the process knows, by (namespace, name). Cheap to clone; every
/// clone sees the same set.
#[derive(Debug, Clone, Default)]
pub struct CredentialStore {
    secrets: Arc<RwLock<HashMap<(String, String), Credentials>>>,
}

impl CredentialStore {
    /// Makes `secrets` the whole set.
    pub fn replace(&self, secrets: HashMap<(String, String), Credentials>) {
        *self.secrets.write().unwrap_or_else(PoisonError::into_inner) = secrets;
    }

    /// The credentials in Secret `namespace/name`, if the store has it.
    pub fn get(&self, namespace: &str, name: &str) -> Option<Credentials> {
        self.secrets
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
    }

    /// What to send through `proxy` (see [`secret_of`]); `None` when it names none or the
    /// Secret is not known (a machine made before the operator generated credentials runs an
    /// open squid).
    pub fn for_proxy(&self, proxy: &Proxy) -> Option<Credentials> {
        let secret = secret_of(proxy)?;
        self.get(&secret.namespace, &secret.name)
    }
}

/// The credentials of every usable Secret of `secrets` by (namespace, name); a Secret that
/// holds none usable is left out and named in the returned problems.
pub fn from_secrets<'a>(
    secrets: impl IntoIterator<Item = &'a Secret>,
) -> (HashMap<(String, String), Credentials>, Vec<String>) {
    let mut found = HashMap::new();
    let mut problems = Vec::new();
    for secret in secrets {
        let namespace = secret
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| crate::resources::proxy::DEFAULT_NAMESPACE.to_owned());
        let name = secret.metadata.name.clone().unwrap_or_default();
        match Credentials::from_secret(secret) {
            Ok(credentials) => {
                found.insert((namespace, name), credentials);
            }
            Err(problem) => problems.push(format!("Secret {namespace}/{name} {problem}")),
        }
    }
    (found, problems)
}

/// Keeps `store` in step with the Secrets labelled [`CREDENTIALS_SECRET_LABEL`] that `secrets`
/// sees, until the watch ends (never, in practice: it retries with backoff). A Secret that
/// holds no usable credentials is named in the log when the set of such Secrets changes.
pub async fn watch(secrets: Api<Secret>, store: CredentialStore) {
    let (reader, writer) = reflector::store();
    let config = watcher::Config::default().labels(&format!("{CREDENTIALS_SECRET_LABEL}=true"));
    let events = reflector(writer, watcher(secrets, config)).default_backoff();
    futures::pin_mut!(events);
    let mut reported: Vec<String> = Vec::new();
    while let Some(event) = events.next().await {
        match event {
            Ok(watcher::Event::InitDone | watcher::Event::Apply(_) | watcher::Event::Delete(_)) => {
                let state = reader.state();
                let (found, problems) = from_secrets(state.iter().map(AsRef::as_ref));
                if problems != reported {
                    for problem in &problems {
                        log::warn!("proxy credentials: {problem}; proxies naming it get none");
                    }
                    reported = problems;
                }
                store.replace(found);
            }
            Ok(_) => {}
            Err(e) => log::warn!("proxy credentials watch: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::ByteString;
    use std::collections::BTreeMap;

    fn secret(data: &[(&str, &str)]) -> Secret {
        Secret {
            data: Some(
                data.iter()
                    .map(|(k, v)| ((*k).to_owned(), ByteString(v.as_bytes().to_vec())))
                    .collect::<BTreeMap<_, _>>(),
            ),
            ..Secret::default()
        }
    }

    #[test]
    fn a_secret_holds_credentials_or_says_what_is_missing() {
        let ok = Credentials::from_secret(&secret(&[("username", "u"), ("password", "p")]));
        assert_eq!(
            ok,
            Ok(Credentials {
                username: "u".into(),
                password: "p".into()
            })
        );
        for (data, problem) in [
            (vec![("password", "p")], "has no key \"username\""),
            (vec![("username", "u")], "has no key \"password\""),
            (vec![("username", ""), ("password", "p")], "is empty"),
            (vec![("username", "a:b"), ("password", "p")], "contains ':'"),
        ] {
            let err = Credentials::from_secret(&secret(&data)).unwrap_err();
            assert!(err.contains(problem), "{data:?}: {err}");
        }
    }

    #[test]
    fn credentials_go_upstream_as_basic_and_never_show_the_password() {
        let credentials = Credentials {
            username: "crawl".into(),
            password: "s3cret".into(),
        };
        assert_eq!(credentials.basic(), "Basic Y3Jhd2w6czNjcmV0");
        assert!(!format!("{credentials:?}").contains("s3cret"));
        let line = credentials.htpasswd_line().unwrap();
        assert!(line.starts_with("crawl:$6$"), "{line}");
        assert!(!line.contains("s3cret"));
        assert_ne!(
            line,
            credentials.htpasswd_line().unwrap(),
            "a new salt each time"
        );
        let generated = Credentials::generate();
        assert_eq!(generated.password.len(), 32);
        assert_ne!(generated, Credentials::generate());
    }
}
