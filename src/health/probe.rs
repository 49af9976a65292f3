//! One probe: an HTTP(S) request to the probe URL *through* the proxy, on a fresh connection:
//! through an HTTP proxy, or a SOCKS5 one as a `socks5h://` proxy URL (reqwest's `socks`
//! feature: the probe target's name is resolved by the proxy, as the gateway's requests are,
//! and the credentials go as RFC 1929 username/password).
//!
//! A [`ProbeClient`] is kept per proxy until the proxy's probe settings change. It holds the
//! checked settings only: each probe builds a one-request reqwest client (the proxy URL and
//! the timeouts are client-level settings) and drops it afterwards. With the TLS
//! configuration shared and preconfigured ([`ProbeTls`], whose root store is loaded once) a
//! build costs a few microseconds, while a reqwest client kept alive costs about 3.8 KB of
//! heap (its proxy matcher, connector, pool and headers): 38 MB at 10,000 proxies, for
//! nothing, since connection pooling is off anyway. Every probe opens a new TCP connection
//! and, for `https://` probe URLs, a new CONNECT tunnel — a cached tunnel would hide a broken
//! proxy.

use std::collections::BTreeMap;
use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::credentials::{self, CredentialStore, Credentials, SecretName};
use crate::resources::proxy::Proxy;
use crate::resources::rotating::{Fill, Rotating, vendor_session};

/// Why a probe failed. The names are the `result` label of the probe counter and the
/// `lastFailure.kind` of the proxy list (schema `ProbeFailureKind` in the OpenAPI document).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
#[schema(as = ProbeFailureKind)]
pub enum ProbeErrorKind {
    /// The proxy itself refused the TCP connection (it is down or not listening).
    ConnectRefused,
    /// The proxy accepted the connection but refused the CONNECT tunnel (ACL denial, or it could
    /// not reach the target).
    ConnectTunnelRefused,
    /// Connecting, the TLS handshake or the response took longer than the probe timeout.
    Timeout,
    /// The TLS handshake with the probe target failed (certificate, protocol).
    Tls,
    /// A response arrived, but its status is not one of the expected status codes.
    UnexpectedStatus,
    /// The probe settings are unusable (bad proxy address or probe URL, TLS setup failure).
    InvalidConfig,
    /// Any other transport failure (connection reset, protocol error, ...).
    Other,
}

impl ProbeErrorKind {
    /// Every kind, for removing all per-proxy metric series.
    pub const ALL: [ProbeErrorKind; 7] = [
        ProbeErrorKind::ConnectRefused,
        ProbeErrorKind::ConnectTunnelRefused,
        ProbeErrorKind::Timeout,
        ProbeErrorKind::Tls,
        ProbeErrorKind::UnexpectedStatus,
        ProbeErrorKind::InvalidConfig,
        ProbeErrorKind::Other,
    ];

    /// Stable snake_case name, used as a metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            ProbeErrorKind::ConnectRefused => "connect_refused",
            ProbeErrorKind::ConnectTunnelRefused => "connect_tunnel_refused",
            ProbeErrorKind::Timeout => "timeout",
            ProbeErrorKind::Tls => "tls",
            ProbeErrorKind::UnexpectedStatus => "unexpected_status",
            ProbeErrorKind::InvalidConfig => "invalid_config",
            ProbeErrorKind::Other => "other",
        }
    }
}

impl fmt::Display for ProbeErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A failed probe: its kind, the status if a response arrived, and a human-readable message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct ProbeError {
    /// Classification of the failure.
    pub kind: ProbeErrorKind,
    /// HTTP status of the response, when one arrived.
    pub status: Option<u16>,
    /// What went wrong, including the underlying error chain.
    pub message: String,
}

impl ProbeError {
    fn new(kind: ProbeErrorKind, message: impl Into<String>) -> Self {
        ProbeError {
            kind,
            status: None,
            message: message.into(),
        }
    }
}

/// The outcome of one probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeResult {
    /// The response status on success, or why the probe failed.
    pub outcome: Result<u16, ProbeError>,
    /// Wall time of the request, from sending to the response head (or the failure).
    pub latency: Duration,
}

impl ProbeResult {
    /// Whether the probe succeeded (no transport error and an expected status).
    pub fn is_success(&self) -> bool {
        self.outcome.is_ok()
    }

    /// The `result` label of the probe counter: `ok` or the error kind.
    pub fn label(&self) -> &'static str {
        match &self.outcome {
            Ok(_) => "ok",
            Err(e) => e.kind.as_str(),
        }
    }
}

/// What a probe of one proxy needs; a change to any field rebuilds the proxy's client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeSettings {
    /// `http://host:port` (`socks5h://host:port` for a SOCKS5 proxy) of the proxy.
    pub proxy_url: String,
    /// URL requested through the proxy.
    pub probe_url: String,
    /// Connect, TLS and total response timeout.
    pub timeout: Duration,
    /// Statuses that count as success.
    pub expected_status_codes: Vec<u16>,
    /// The Secret whose credentials go upstream, when the proxy asks for some.
    pub credentials: Option<SecretName>,
    /// A rotating upstream is probed through one vendor session of its own.
    pub vendor: Option<VendorProbe>,
}

/// How a rotating upstream's probe spells its username.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VendorProbe {
    /// The templates.
    pub rotating: Rotating,
    /// The Proxy's labels (template fields without a request come from them).
    pub labels: BTreeMap<String, String>,
    /// The probe's vendor session: one per proxy, stable.
    pub session: String,
}

/// What seeds the vendor session of a rotating upstream's probes.
const PROBE_SESSION_SEED: &str = "health-probe";

impl ProbeSettings {
    /// Settings for a proxy, or `None` when it has no address yet (a Managed proxy without an
    /// IP is not probed).
    pub fn for_proxy(proxy: &Proxy) -> Option<ProbeSettings> {
        let proxy_url = proxy.spec.proxy_url(proxy.status.as_ref())?;
        let check = proxy.spec.health_check();
        Some(ProbeSettings {
            proxy_url,
            probe_url: check.probe_url.clone(),
            timeout: check.timeout(),
            expected_status_codes: check
                .expected_status_codes
                .iter()
                .filter_map(|&c| u16::try_from(c).ok())
                .collect(),
            credentials: credentials::secret_of(proxy),
            vendor: proxy.spec.rotating().map(|rotating| VendorProbe {
                rotating: rotating.clone(),
                labels: proxy.metadata.labels.clone().unwrap_or_default(),
                session: vendor_session(
                    proxy.metadata.uid.as_deref().unwrap_or_default(),
                    PROBE_SESSION_SEED,
                ),
            }),
        })
    }

    /// What a probe sends upstream: the credentials Secret's (from `store`), or for a rotating
    /// upstream the username and password spelled for the probe's vendor session (none when a
    /// template field has no value: the probe then fails with the vendor's `407`).
    pub fn upstream_credentials(&self, store: &CredentialStore) -> Option<Credentials> {
        let secret = self
            .credentials
            .as_ref()
            .and_then(|secret| store.get(&secret.namespace, &secret.name));
        let Some(vendor) = &self.vendor else {
            return secret;
        };
        let fill = Fill {
            session: &vendor.session,
            selector: &BTreeMap::new(),
            labels: Some(&vendor.labels),
            secret: None,
        };
        credentials::vendor_credentials(&vendor.rotating, fill, secret.as_ref()).ok()
    }
}

/// The TLS client configuration shared by every probe client: the system roots plus any extra
/// roots, parsed once.
#[derive(Clone)]
pub struct ProbeTls {
    config: Result<Arc<rustls::ClientConfig>, String>,
}

impl fmt::Debug for ProbeTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProbeTls")
            .field("ready", &self.config.is_ok())
            .finish()
    }
}

impl ProbeTls {
    /// Loads the system roots once and adds `extra_roots` (DER certificates, e.g. a private CA
    /// in front of the probe target).
    ///
    /// A failure (an unparsable extra root, no roots at all) does not stop the engine: it is
    /// logged, and every probe fails with [`ProbeErrorKind::InvalidConfig`] and this message,
    /// so the cause shows up in each proxy's status.
    pub fn new(extra_roots: &[Vec<u8>]) -> ProbeTls {
        let config = crate::tls::client_config(extra_roots).map_err(|e| {
            let message = format!("probe TLS setup failed: {e}");
            log::error!("{message}");
            message
        });
        ProbeTls { config }
    }
}

/// The probe of one proxy: its settings, checked once, and the shared TLS configuration.
#[derive(Debug, Clone)]
pub struct ProbeClient {
    settings: ProbeSettings,
    /// The TLS configuration each probe's client starts from, or why the settings are unusable.
    tls: Result<Arc<rustls::ClientConfig>, ProbeError>,
}

impl ProbeClient {
    /// Checks `settings`. Unusable settings do not fail here: every probe then reports an
    /// [`ProbeErrorKind::InvalidConfig`] error, so the proxy turns unhealthy with the reason in
    /// its status.
    pub fn new(settings: ProbeSettings, tls: &ProbeTls) -> ProbeClient {
        let tls = Self::check(&settings, tls);
        if let Err(e) = &tls {
            log::warn!("cannot probe through {}: {e}", settings.proxy_url);
        }
        ProbeClient { settings, tls }
    }

    fn check(
        settings: &ProbeSettings,
        tls: &ProbeTls,
    ) -> Result<Arc<rustls::ClientConfig>, ProbeError> {
        let tls = tls
            .config
            .as_ref()
            .map_err(|e| ProbeError::new(ProbeErrorKind::InvalidConfig, e.clone()))?;
        reqwest::Url::parse(&settings.probe_url).map_err(|e| {
            invalid_config(&format!("invalid probe URL {:?}", settings.probe_url), &e)
        })?;
        // One client built and dropped now, so an unusable proxy address shows at once.
        Self::client(settings, tls, None)?;
        Ok(tls.clone())
    }

    /// A client for one probe: through the proxy (with `credentials`, if any), no pooled
    /// connections, no redirects.
    fn client(
        settings: &ProbeSettings,
        tls: &rustls::ClientConfig,
        credentials: Option<&Credentials>,
    ) -> Result<reqwest::Client, ProbeError> {
        let mut proxy = reqwest::Proxy::all(&settings.proxy_url).map_err(|e| {
            invalid_config(&format!("invalid proxy address {}", settings.proxy_url), &e)
        })?;
        if let Some(credentials) = credentials {
            proxy = proxy.basic_auth(&credentials.username, &credentials.password);
        }
        reqwest::Client::builder()
            .proxy(proxy)
            .pool_max_idle_per_host(0)
            .connect_timeout(settings.timeout)
            .timeout(settings.timeout)
            .redirect(reqwest::redirect::Policy::none())
            .tls_backend_preconfigured(rustls::ClientConfig::clone(tls))
            .build()
            .map_err(|e| invalid_config("cannot build the probe client", &e))
    }

    /// The settings this client was built from.
    pub fn settings(&self) -> &ProbeSettings {
        &self.settings
    }

    /// Requests the probe URL through the proxy once, sending `credentials` upstream when
    /// given, and classifies the outcome.
    pub async fn probe(&self, credentials: Option<&Credentials>) -> ProbeResult {
        let client = match &self.tls {
            Ok(tls) => Self::client(&self.settings, tls, credentials),
            Err(e) => Err(e.clone()),
        };
        let started = Instant::now();
        let outcome = match client {
            Ok(client) => self.request(&client).await,
            Err(e) => Err(e),
        };
        ProbeResult {
            outcome,
            latency: started.elapsed(),
        }
    }

    async fn request(&self, client: &reqwest::Client) -> Result<u16, ProbeError> {
        let response = self.response(client).await?;
        Ok(response.status().as_u16())
    }

    /// Requests the probe URL through the proxy once, like [`probe`](Self::probe), and reads
    /// the body of an expected answer, at most `limit` bytes (a longer body is an error: an
    /// exit check's answer is an address).
    pub async fn fetch(
        &self,
        credentials: Option<&Credentials>,
        limit: usize,
    ) -> Result<Vec<u8>, ProbeError> {
        let client = match &self.tls {
            Ok(tls) => Self::client(&self.settings, tls, credentials)?,
            Err(e) => return Err(e.clone()),
        };
        let mut response = self.response(&client).await?;
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(|e| classify(&e))? {
            if body.len() + chunk.len() > limit {
                return Err(ProbeError::new(
                    ProbeErrorKind::Other,
                    format!("the answer is longer than {limit} bytes"),
                ));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    }

    /// The response to one GET of the probe URL, when its status is an expected one.
    async fn response(&self, client: &reqwest::Client) -> Result<reqwest::Response, ProbeError> {
        let response = client
            .get(&self.settings.probe_url)
            .send()
            .await
            .map_err(|e| classify(&e))?;
        let status = response.status().as_u16();
        if self.settings.expected_status_codes.contains(&status) {
            return Ok(response);
        }
        let proxy_error = response
            .headers()
            .get("x-squid-error")
            .and_then(|v| v.to_str().ok())
            .map(|v| format!(" (proxy error {v})"))
            .unwrap_or_default();
        Err(ProbeError {
            kind: ProbeErrorKind::UnexpectedStatus,
            status: Some(status),
            message: format!(
                "status {status} is not one of {:?}{proxy_error}",
                self.settings.expected_status_codes
            ),
        })
    }
}

fn invalid_config(what: &str, error: &dyn StdError) -> ProbeError {
    ProbeError::new(ProbeErrorKind::InvalidConfig, format!("{what}: {error}"))
}

/// Sorts a reqwest error into a [`ProbeErrorKind`] by walking its `source()` chain (reqwest does
/// not export its tunnel error type, so the CONNECT refusal is recognised by its text; a SOCKS
/// handshake error ends the chain, so its text tells a proxy that is down from one that
/// refused).
pub fn classify(error: &reqwest::Error) -> ProbeError {
    let chain = error_chain(error);
    let message = chain.join(": ");
    let kind = if error.is_timeout() {
        ProbeErrorKind::Timeout
    } else if chain.iter().any(|m| {
        m == "tunnel error: unsuccessful" || m == "tunnel error: proxy authorization required"
    }) {
        ProbeErrorKind::ConnectTunnelRefused
    } else if refused(error) || chain.iter().any(|m| m == SOCKS_NOT_CONNECTED) {
        ProbeErrorKind::ConnectRefused
    } else if chain.iter().any(|m| m.starts_with("SOCKS error: ")) {
        ProbeErrorKind::ConnectTunnelRefused
    } else if is_tls(error) {
        ProbeErrorKind::Tls
    } else {
        ProbeErrorKind::Other
    };
    ProbeError::new(kind, message)
}

/// hyper-util's SOCKS error when the TCP connection to the proxy failed (its cause is not in
/// the chain).
const SOCKS_NOT_CONNECTED: &str = "SOCKS error: failed to create underlying connection";

/// Every error in the chain, outermost first, including errors wrapped inside `io::Error`
/// (whose `source()` skips the wrapped error itself).
fn sources<'a>(error: &'a (dyn StdError + 'static)) -> Vec<&'a (dyn StdError + 'static)> {
    let mut out = Vec::new();
    let mut next = Some(error);
    while let Some(e) = next {
        out.push(e);
        next = match e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            Some(inner) => Some(inner as &(dyn StdError + 'static)),
            None => e.source(),
        };
    }
    out
}

fn error_chain(error: &reqwest::Error) -> Vec<String> {
    let mut messages: Vec<String> = Vec::new();
    for e in sources(error) {
        let text = e.to_string();
        if messages.last() != Some(&text) {
            messages.push(text);
        }
    }
    messages
}

fn refused(error: &reqwest::Error) -> bool {
    sources(error).iter().any(|e| {
        e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
    })
}

fn is_tls(error: &reqwest::Error) -> bool {
    sources(error)
        .iter()
        .any(|e| e.downcast_ref::<rustls::Error>().is_some())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::proxy::ProxySpec;

    fn proxy(spec: serde_json::Value) -> Proxy {
        let spec: ProxySpec = serde_json::from_value(spec).unwrap();
        Proxy::new("p", spec)
    }

    #[test]
    fn settings_follow_the_spec() {
        let p = proxy(serde_json::json!({
            "mode": "External",
            "endpoint": {"host": "10.1.2.3", "port": 8080},
            "healthCheck": {"probeURL": "http://example.com/", "timeout": "2s",
                            "expectedStatusCodes": [204]}
        }));
        let s = ProbeSettings::for_proxy(&p).unwrap();
        assert_eq!(s.proxy_url, "http://10.1.2.3:8080");
        assert_eq!(s.probe_url, "http://example.com/");
        assert_eq!(s.timeout, Duration::from_secs(2));
        assert_eq!(s.expected_status_codes, vec![204]);
    }

    #[test]
    fn a_socks5_proxy_is_probed_as_socks5h() {
        let p = proxy(serde_json::json!({
            "mode": "External",
            "endpoint": {"host": "10.1.2.3", "port": 1080, "protocol": "socks5"}
        }));
        let s = ProbeSettings::for_proxy(&p).unwrap();
        assert_eq!(s.proxy_url, "socks5h://10.1.2.3:1080");
        assert!(reqwest::Proxy::all(&s.proxy_url).is_ok());
    }

    #[test]
    fn ipv6_hosts_are_bracketed_and_managed_without_ip_is_not_probed() {
        let p = proxy(serde_json::json!({
            "mode": "External", "endpoint": {"host": "::1", "port": 3128}
        }));
        assert_eq!(
            ProbeSettings::for_proxy(&p).unwrap().proxy_url,
            "http://[::1]:3128"
        );
        let managed = proxy(serde_json::json!({"mode": "Managed", "provider": "local"}));
        assert_eq!(ProbeSettings::for_proxy(&managed), None);
    }

    #[tokio::test]
    async fn unusable_settings_fail_every_probe_with_a_clear_message() {
        let tls = ProbeTls::new(&[]);
        let cases = [
            ("http://127.0.0.1:3128", "not a url", "invalid probe URL"),
            (
                "http://bad host:3128",
                "http://example.com/",
                "invalid proxy address",
            ),
        ];
        for (proxy_url, probe_url, expected) in cases {
            let client = ProbeClient::new(
                ProbeSettings {
                    credentials: None,
                    vendor: None,
                    proxy_url: proxy_url.into(),
                    probe_url: probe_url.into(),
                    timeout: Duration::from_secs(1),
                    expected_status_codes: vec![204],
                },
                &tls,
            );
            let err = client.probe(None).await.outcome.unwrap_err();
            assert_eq!(err.kind, ProbeErrorKind::InvalidConfig);
            assert!(err.message.contains(expected), "{}", err.message);
        }
    }

    #[tokio::test]
    async fn a_bad_extra_root_is_reported_on_every_probe() {
        let tls = ProbeTls::new(&[b"not a certificate".to_vec()]);
        let client = ProbeClient::new(
            ProbeSettings {
                credentials: None,
                vendor: None,
                proxy_url: "http://127.0.0.1:3128".into(),
                probe_url: "https://example.com/".into(),
                timeout: Duration::from_secs(1),
                expected_status_codes: vec![204],
            },
            &tls,
        );
        let err = client.probe(None).await.outcome.unwrap_err();
        assert_eq!(err.kind, ProbeErrorKind::InvalidConfig);
        assert!(err.message.contains("probe TLS setup failed"), "{}", err);
    }

    #[test]
    fn labels_are_distinct() {
        let mut labels: Vec<&str> = ProbeErrorKind::ALL.iter().map(|k| k.as_str()).collect();
        labels.push("ok");
        let count = labels.len();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), count);
    }
}
