//! TLS the process speaks as a client (health probes through a proxy, the gateway's own TLS to
//! an intercepted target): one client configuration built once, verifying against the system's
//! roots plus extra ones (a private CA in front of a target), and reading PEM bundles.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

/// A client configuration that verifies servers against the system's roots and `extra_roots`
/// (DER), speaking HTTP/1.1 (ALPN). Loading the system's roots costs milliseconds: build it
/// once and share it.
pub fn client_config(extra_roots: &[Vec<u8>]) -> Result<Arc<rustls::ClientConfig>, rustls::Error> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let roots = extra_roots
        .iter()
        .map(|der| CertificateDer::from(der.clone()));
    let verifier =
        rustls_platform_verifier::Verifier::new_with_extra_roots(roots, provider.clone())?;
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The certificates of the PEM file at `path`, as DER; the error says what is wrong with it
/// (unreadable, not PEM, no certificate).
pub fn pem_certificates(path: &Path) -> Result<Vec<Vec<u8>>, String> {
    let pem = std::fs::read(path).map_err(|e| format!("cannot read: {e}"))?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .map(|c| c.map(|c| c.to_vec()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("not a PEM certificate bundle: {e}"))?;
    if certs.is_empty() {
        return Err("no PEM certificate in the file".to_owned());
    }
    Ok(certs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bundle_is_read_whole_and_a_file_without_certificates_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let one = rcgen::generate_simple_self_signed(vec!["a.test".to_owned()]).unwrap();
        let two = rcgen::generate_simple_self_signed(vec!["b.test".to_owned()]).unwrap();
        let bundle = dir.path().join("bundle.pem");
        std::fs::write(&bundle, format!("{}{}", one.cert.pem(), two.cert.pem())).unwrap();
        let read = pem_certificates(&bundle).unwrap();
        assert_eq!(read, [one.cert.der().to_vec(), two.cert.der().to_vec()]);
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "nothing here\n").unwrap();
        assert_eq!(
            pem_certificates(&empty).unwrap_err(),
            "no PEM certificate in the file"
        );
        let missing = pem_certificates(&dir.path().join("missing.pem")).unwrap_err();
        assert!(missing.starts_with("cannot read"), "{missing}");
        assert!(client_config(&read).is_ok());
    }
}
