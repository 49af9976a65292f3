//! Interception of HTTPS at the gateway, opt-in three times over: the operator has a CA
//! (`ca`), the caller's tenant may use it, and the request asks for it in its proxy URL's
//! user part (`tls=inspect`). Never fleet-wide by surprise: a target then sees the gateway's
//! TLS, not the client's.
//!
//! Two handshakes a connection: the client's, with a leaf for the CONNECT host (a client SNI
//! naming another host is refused), and the gateway's own to the target through the
//! upstream's tunnel, always verified (the system's roots and `--gateway-target-ca-file`).

pub mod ca;

use std::io;
use std::sync::Arc;
use std::time::SystemTime;

use rustls::pki_types::ServerName;
use rustls::server::{Acceptor, ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::{LazyConfigAcceptor, TlsConnector, client, server};

pub use ca::{CaError, CaFiles, InterceptCa, Leaf};

/// What the gateway intercepts with: its CA, and how it verifies targets.
pub struct Interception {
    ca: InterceptCa,
    target_tls: Arc<rustls::ClientConfig>,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl std::fmt::Debug for Interception {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Interception").finish_non_exhaustive()
    }
}

/// Why a client's handshake failed (a metric label each).
#[derive(Debug)]
pub enum ClientRefused {
    /// Its SNI named another host than the CONNECT.
    SniMismatch(String),
    /// No leaf could be made for the host.
    Leaf(String),
    /// The handshake itself failed (the client does not trust the CA, or spoke no TLS).
    Handshake(io::Error),
}

impl ClientRefused {
    /// The label of the failure.
    pub fn reason(&self) -> &'static str {
        match self {
            ClientRefused::SniMismatch(_) => "sni_mismatch",
            ClientRefused::Leaf(_) => "leaf",
            ClientRefused::Handshake(_) => "handshake",
        }
    }
}

impl std::fmt::Display for ClientRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClientRefused::SniMismatch(sni) => {
                write!(
                    f,
                    "the client's SNI {sni:?} names another host than its CONNECT"
                )
            }
            ClientRefused::Leaf(e) => write!(f, "no certificate for the host: {e}"),
            ClientRefused::Handshake(e) => write!(f, "the client's TLS handshake failed: {e}"),
        }
    }
}

/// Why the gateway's own handshake with a target failed.
#[derive(Debug)]
pub enum TargetRefused {
    /// The target's certificate did not verify (self-signed, another name, expired, ...).
    Certificate(String),
    /// The handshake failed otherwise (the connection closed, no TLS).
    Handshake(io::Error),
}

impl TargetRefused {
    /// The label of the failure.
    pub fn reason(&self) -> &'static str {
        match self {
            TargetRefused::Certificate(_) => "certificate",
            TargetRefused::Handshake(_) => "handshake",
        }
    }
}

impl std::fmt::Display for TargetRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TargetRefused::Certificate(e) => write!(f, "the target's certificate: {e}"),
            TargetRefused::Handshake(e) => write!(f, "the TLS handshake with the target: {e}"),
        }
    }
}

/// Serves one certificate, whatever the hello asks (the hello was checked before).
#[derive(Debug)]
struct OneCertificate(Arc<CertifiedKey>);

impl ResolvesServerCert for OneCertificate {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }
}

impl Interception {
    /// Interception with `ca`, verifying targets against the system's roots and `extra_roots`
    /// (DER).
    pub fn new(ca: InterceptCa, extra_roots: &[Vec<u8>]) -> Result<Self, rustls::Error> {
        Ok(Interception {
            ca,
            target_tls: crate::tls::client_config(extra_roots)?,
            provider: Arc::new(rustls::crypto::aws_lc_rs::default_provider()),
        })
    }

    /// The CA.
    pub fn ca(&self) -> &InterceptCa {
        &self.ca
    }

    /// Takes the client's TLS on `io` for a CONNECT to `host`: refuses a hello whose SNI names
    /// another host, answers with the host's leaf (said how it was had), offers HTTP/1.1.
    pub async fn accept_client<IO>(
        &self,
        io: IO,
        host: &str,
    ) -> Result<(server::TlsStream<IO>, Leaf), ClientRefused>
    where
        IO: AsyncRead + AsyncWrite + Unpin,
    {
        let start = LazyConfigAcceptor::new(Acceptor::default(), io)
            .await
            .map_err(ClientRefused::Handshake)?;
        if let Some(sni) = start.client_hello().server_name()
            && !sni.eq_ignore_ascii_case(host)
        {
            return Err(ClientRefused::SniMismatch(sni.to_owned()));
        }
        let (leaf, how) = self
            .ca
            .leaf(host, SystemTime::now())
            .map_err(ClientRefused::Leaf)?;
        let mut config = rustls::ServerConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| ClientRefused::Leaf(e.to_string()))?
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(OneCertificate(leaf)));
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let stream = start
            .into_stream(Arc::new(config))
            .await
            .map_err(ClientRefused::Handshake)?;
        Ok((stream, how))
    }

    /// The gateway's own TLS to `host` on `io` (a tunnel through an upstream), verified.
    pub async fn connect_target<IO>(
        &self,
        io: IO,
        host: &str,
    ) -> Result<client::TlsStream<IO>, TargetRefused>
    where
        IO: AsyncRead + AsyncWrite + Unpin,
    {
        let name = ServerName::try_from(host.to_owned())
            .map_err(|e| TargetRefused::Certificate(format!("{host:?} cannot be verified: {e}")))?;
        TlsConnector::from(self.target_tls.clone())
            .connect(name, io)
            .await
            .map_err(|e| {
                match e
                    .get_ref()
                    .and_then(|inner| inner.downcast_ref::<rustls::Error>())
                {
                    Some(rustls::Error::InvalidCertificate(cert)) => {
                        TargetRefused::Certificate(format!("{cert:?}"))
                    }
                    _ => TargetRefused::Handshake(e),
                }
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{CertificateParams, KeyPair};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// An interception whose CA is `ca` (cert, key PEM) and whose targets may be signed by
    /// `target_ca`.
    fn interception(dir: &std::path::Path, target_ca: &[Vec<u8>]) -> (Interception, Vec<u8>) {
        let (cert, key) = ca::tests::test_ca("gateway CA");
        let files = CaFiles {
            cert: dir.join("ca.crt"),
            key: dir.join("ca.key"),
        };
        std::fs::write(&files.cert, &cert).unwrap();
        std::fs::write(&files.key, &key).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&files.key, std::fs::Permissions::from_mode(0o600)).unwrap();
        let ca = InterceptCa::load(&files).unwrap();
        let der = ca.certificate().to_vec();
        (Interception::new(ca, target_ca).unwrap(), der)
    }

    /// A client configuration trusting `root` only, asking for `sni`.
    fn client_trusting(root: &[u8]) -> Arc<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(rustls::pki_types::CertificateDer::from(root.to_vec()))
            .unwrap();
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        Arc::new(
            rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth(),
        )
    }

    #[tokio::test]
    async fn a_client_trusting_the_ca_completes_its_handshake_for_the_connect_host_only() {
        let dir = tempfile::tempdir().unwrap();
        let (interception, ca_der) = interception(dir.path(), &[]);
        let interception = Arc::new(interception);
        for (sni, host, ok) in [
            ("shop.example.com", "shop.example.com", true),
            ("SHOP.example.com", "shop.example.com", true),
            ("elsewhere.example.com", "shop.example.com", false),
        ] {
            let (client_io, gateway_io) = tokio::io::duplex(16 * 1024);
            let gateway = {
                let interception = interception.clone();
                let host = host.to_owned();
                tokio::spawn(async move {
                    match interception.accept_client(gateway_io, &host).await {
                        Ok((mut tls, _)) => {
                            let mut buf = [0u8; 5];
                            tls.read_exact(&mut buf).await.unwrap();
                            tls.write_all(&buf).await.unwrap();
                            tls.flush().await.unwrap();
                            Ok(())
                        }
                        Err(e) => Err(e.reason()),
                    }
                })
            };
            let connector = TlsConnector::from(client_trusting(&ca_der));
            let name = ServerName::try_from(sni.to_owned()).unwrap();
            let client = async {
                let mut tls = connector.connect(name, client_io).await?;
                tls.write_all(b"hello").await?;
                let mut echo = [0u8; 5];
                tls.read_exact(&mut echo).await?;
                Ok::<_, io::Error>(echo)
            };
            let client = client.await;
            let served = gateway.await.unwrap();
            if ok {
                assert_eq!(client.unwrap(), *b"hello", "{sni}");
                assert!(served.is_ok());
            } else {
                assert!(client.is_err(), "{sni}");
                assert_eq!(served.unwrap_err(), "sni_mismatch");
            }
        }
    }

    #[tokio::test]
    async fn the_gateway_verifies_a_target_and_refuses_a_wrong_one() {
        // A target with a certificate of its own CA, for `target.test`.
        let target_key = KeyPair::generate().unwrap();
        let (target_ca_pem, target_ca_key_pem) = ca::tests::test_ca("target CA");
        let target_issuer = rcgen::Issuer::from_ca_cert_pem(
            &target_ca_pem,
            KeyPair::from_pem(&target_ca_key_pem).unwrap(),
        )
        .unwrap();
        let target_cert = CertificateParams::new(vec!["target.test".to_owned()])
            .unwrap()
            .signed_by(&target_key, &target_issuer)
            .unwrap();
        let server_config = Arc::new(
            rustls::ServerConfig::builder_with_provider(Arc::new(
                rustls::crypto::aws_lc_rs::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![target_cert.der().clone()],
                rustls::pki_types::PrivateKeyDer::try_from(target_key.serialize_der()).unwrap(),
            )
            .unwrap(),
        );
        let target_ca_der =
            rustls::pki_types::CertificateDer::from_pem_slice(target_ca_pem.as_bytes())
                .unwrap()
                .to_vec();
        use rustls::pki_types::pem::PemObject;
        let dir = tempfile::tempdir().unwrap();
        for (trusted, name, verifies) in [
            (vec![target_ca_der.clone()], "target.test", true),
            (vec![target_ca_der.clone()], "other.test", false),
            (vec![], "target.test", false),
        ] {
            let (interception, _) = interception(dir.path(), &trusted);
            let (gateway_io, target_io) = tokio::io::duplex(16 * 1024);
            let acceptor = tokio_rustls::TlsAcceptor::from(server_config.clone());
            let target = tokio::spawn(async move { acceptor.accept(target_io).await.is_ok() });
            let connected = interception.connect_target(gateway_io, name).await;
            match connected {
                Ok(_) => assert!(verifies, "{name} verified"),
                Err(e) => {
                    assert!(!verifies, "{name}: {e}");
                    assert_eq!(e.reason(), "certificate", "{name}: {e}");
                }
            }
            let _ = target.await;
        }
    }
}
