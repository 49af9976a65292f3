//! A CA for the gateway to intercept HTTPS with, written as a user would mount it: the
//! certificate and, readable by its owner only, the key.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};

/// The CA's files.
pub struct GatewayCa {
    /// The certificate, PEM (what clients trust).
    pub cert: PathBuf,
    /// The key, PEM, mode 0600.
    pub key: PathBuf,
}

impl GatewayCa {
    /// A new CA written into `dir`.
    pub fn write(dir: &Path) -> GatewayCa {
        let key = KeyPair::generate().expect("generate the CA key");
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, "proxy-operator gateway test CA");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key).expect("self-sign the CA");
        let ca = GatewayCa {
            cert: dir.join("gateway-ca.crt"),
            key: dir.join("gateway-ca.key"),
        };
        std::fs::write(&ca.cert, cert.pem()).expect("write the CA certificate");
        std::fs::write(&ca.key, key.serialize_pem()).expect("write the CA key");
        std::fs::set_permissions(&ca.key, std::fs::Permissions::from_mode(0o600))
            .expect("chmod the CA key");
        ca
    }

    /// The flags that give the gateway this CA.
    pub fn args(&self) -> Vec<String> {
        vec![
            "--gateway-ca-cert".to_owned(),
            self.cert.display().to_string(),
            "--gateway-ca-key".to_owned(),
            self.key.display().to_string(),
        ]
    }
}
