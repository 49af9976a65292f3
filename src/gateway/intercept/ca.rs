//! The certificate authority the gateway intercepts HTTPS with, and the leaf certificates it
//! mints with it: one per CONNECT host, valid for a day, the host (or address) in its
//! subjectAltName, signed on the fly and kept in a bounded cache.
//!
//! The CA is the operator's only if given one (`--gateway-ca-cert`, `--gateway-ca-key`, from a
//! Secret); start-up refuses one that is unreadable, whose key does not match its
//! certificate, whose certificate is no CA, or whose key file others may read. Every leaf
//! shares one key pair, made at start: signing a certificate is then the only work a new host
//! costs.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use rcgen::{
    CertificateParams, DnType, ExtendedKeyUsagePurpose, Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::sign::CertifiedKey;

/// How long a leaf is valid: a short life, renewed long before its end.
const LEAF_VALIDITY: Duration = Duration::from_secs(24 * 3600);
/// How far back a leaf's validity starts: clients whose clock is behind accept it too.
const LEAF_BACKDATE: Duration = Duration::from_secs(3600);
/// A cached leaf is minted again when less than this is left of it.
const LEAF_RENEW_BEFORE: Duration = Duration::from_secs(3600);
/// Most leaves kept (one per host); the oldest goes first.
pub const LEAF_CACHE: usize = 4096;

/// Where the CA comes from: the two flags' files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaFiles {
    /// `--gateway-ca-cert`: the CA certificate, PEM.
    pub cert: PathBuf,
    /// `--gateway-ca-key`: its private key, PEM (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

/// Why the CA was refused; the message names the flag and the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CaError(pub String);

/// A leaf from the cache, or minted now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leaf {
    /// Served from the cache.
    Cached,
    /// Minted for this request.
    Minted,
}

/// The CA and the leaves minted with it.
pub struct InterceptCa {
    issuer: Issuer<'static, KeyPair>,
    ca_der: CertificateDer<'static>,
    leaf_key: KeyPair,
    leaf_signer: Arc<dyn rustls::sign::SigningKey>,
    leaves: Mutex<Leaves>,
}

impl std::fmt::Debug for InterceptCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("InterceptCa").finish_non_exhaustive()
    }
}

#[derive(Default)]
struct Leaves {
    by_host: HashMap<String, (Arc<CertifiedKey>, SystemTime)>,
    order: VecDeque<String>,
}

impl InterceptCa {
    /// Loads and checks the CA of `files`.
    pub fn load(files: &CaFiles) -> Result<Self, CaError> {
        let cert_flag = |problem: String| {
            CaError(format!(
                "--gateway-ca-cert {}: {problem}",
                files.cert.display()
            ))
        };
        let key_flag = |problem: String| {
            CaError(format!(
                "--gateway-ca-key {}: {problem}",
                files.key.display()
            ))
        };
        let cert_pem = std::fs::read_to_string(&files.cert)
            .map_err(|e| cert_flag(format!("cannot read: {e}")))?;
        check_key_file_mode(&files.key).map_err(key_flag)?;
        let key_pem = std::fs::read_to_string(&files.key)
            .map_err(|e| key_flag(format!("cannot read: {e}")))?;
        let ca_der = pem::first_certificate(&cert_pem).map_err(cert_flag)?;
        check_is_ca(&ca_der).map_err(cert_flag)?;
        let ca_key = KeyPair::from_pem(&key_pem)
            .map_err(|e| key_flag(format!("is not a private key in PEM: {e}")))?;
        if spki_key(&ca_der).map_err(cert_flag)? != ca_key.public_key_raw() {
            return Err(key_flag(format!(
                "is not the key of the certificate in --gateway-ca-cert {}",
                files.cert.display()
            )));
        }
        let issuer = Issuer::from_ca_cert_der(&ca_der, ca_key)
            .map_err(|e| cert_flag(format!("cannot sign with it: {e}")))?;
        Self::with_issuer(issuer, ca_der).map_err(|e| CaError(format!("--gateway-ca-key: {e}")))
    }

    fn with_issuer(
        issuer: Issuer<'static, KeyPair>,
        ca_der: CertificateDer<'static>,
    ) -> Result<Self, String> {
        let leaf_key = KeyPair::generate().map_err(|e| format!("making the leaves' key: {e}"))?;
        let der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der()));
        let leaf_signer = rustls::crypto::aws_lc_rs::sign::any_supported_type(&der)
            .map_err(|e| format!("the leaves' key: {e}"))?;
        Ok(InterceptCa {
            issuer,
            ca_der,
            leaf_key,
            leaf_signer,
            leaves: Mutex::default(),
        })
    }

    /// The CA's certificate, DER (what clients trust).
    pub fn certificate(&self) -> &CertificateDer<'static> {
        &self.ca_der
    }

    /// The leaf for `host` (a name or an address), from the cache while it has more than an
    /// hour left, else minted now; `now` is the wall clock.
    pub fn leaf(&self, host: &str, now: SystemTime) -> Result<(Arc<CertifiedKey>, Leaf), String> {
        if let Some((leaf, until)) = self.lock().by_host.get(host)
            && until
                .duration_since(now)
                .is_ok_and(|left| left > LEAF_RENEW_BEFORE)
        {
            return Ok((leaf.clone(), Leaf::Cached));
        }
        let leaf = Arc::new(self.mint(host, now)?);
        let mut leaves = self.lock();
        if leaves
            .by_host
            .insert(host.to_owned(), (leaf.clone(), now + LEAF_VALIDITY))
            .is_none()
        {
            leaves.order.push_back(host.to_owned());
        }
        while leaves.order.len() > LEAF_CACHE {
            if let Some(oldest) = leaves.order.pop_front() {
                leaves.by_host.remove(&oldest);
            }
        }
        Ok((leaf, Leaf::Minted))
    }

    /// Leaves in the cache.
    pub fn cached(&self) -> usize {
        self.lock().by_host.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Leaves> {
        self.leaves.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn mint(&self, host: &str, now: SystemTime) -> Result<CertifiedKey, String> {
        let mut params = CertificateParams::default();
        let san = match host.parse::<IpAddr>() {
            Ok(ip) => SanType::IpAddress(ip),
            Err(_) => SanType::DnsName(
                host.try_into()
                    .map_err(|e| format!("{host:?} cannot be a certificate's name: {e}"))?,
            ),
        };
        params.subject_alt_names = vec![san];
        params.distinguished_name.push(DnType::CommonName, host);
        params.not_before = (now - LEAF_BACKDATE).into();
        params.not_after = (now + LEAF_VALIDITY).into();
        params.use_authority_key_identifier_extension = true;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let cert = params
            .signed_by(&self.leaf_key, &self.issuer)
            .map_err(|e| format!("signing a certificate for {host}: {e}"))?;
        Ok(CertifiedKey::new(
            vec![cert.der().clone(), self.ca_der.clone()],
            self.leaf_signer.clone(),
        ))
    }
}

/// Refuses a key file others may read, or a group other than the process's own: the CA's key
/// signs for every host. A Kubernetes Secret volume gives the file to the Pod's `fsGroup`,
/// the process's group, so `defaultMode: 0440` there passes.
fn check_key_file_mode(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot read: {e}"))?;
    let mode = meta.mode();
    if mode & 0o007 != 0 {
        return Err(format!(
            "is readable by others (mode {:o}): chmod o-rwx it, or mount the Secret with \
             defaultMode 0400 or 0440",
            mode & 0o777
        ));
    }
    if mode & 0o070 != 0 && !in_own_groups(meta.gid()) {
        return Err(format!(
            "is readable by group {} (mode {:o}), not this process's: chmod g-rwx it",
            meta.gid(),
            mode & 0o777
        ));
    }
    Ok(())
}

/// Whether `gid` is the process's group or one of its supplementary groups.
fn in_own_groups(gid: u32) -> bool {
    // SAFETY: getegid cannot fail; getgroups writes at most `len` entries into the buffer.
    unsafe {
        if libc::getegid() == gid {
            return true;
        }
        let len = libc::getgroups(0, std::ptr::null_mut());
        let Ok(capacity) = usize::try_from(len) else {
            return false;
        };
        let mut groups = vec![0 as libc::gid_t; capacity];
        let got = libc::getgroups(len, groups.as_mut_ptr());
        usize::try_from(got).is_ok_and(|n| groups[..n.min(capacity)].contains(&gid))
    }
}

/// Refuses a certificate that is not a CA: basicConstraints CA:TRUE, and keyCertSign when it
/// says its key usages.
fn check_is_ca(der: &CertificateDer<'_>) -> Result<(), String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| format!("is not an X.509 certificate: {e}"))?;
    let ca = cert
        .basic_constraints()
        .map_err(|e| format!("has unreadable basicConstraints: {e}"))?
        .is_some_and(|bc| bc.value.ca);
    if !ca {
        return Err("is not a CA certificate (no basicConstraints CA:TRUE)".to_owned());
    }
    let signs = cert
        .key_usage()
        .map_err(|e| format!("has an unreadable keyUsage: {e}"))?
        .is_none_or(|usage| usage.value.key_cert_sign());
    if !signs {
        return Err(
            "is a CA whose keyUsage lacks keyCertSign: it may not sign certificates".to_owned(),
        );
    }
    Ok(())
}

/// The public key a certificate names (its subjectPublicKey bits).
fn spki_key(der: &CertificateDer<'_>) -> Result<Vec<u8>, String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| format!("is not an X.509 certificate: {e}"))?;
    Ok(cert.public_key().subject_public_key.data.to_vec())
}

/// PEM reading.
mod pem {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;

    /// The first certificate of a PEM text.
    pub fn first_certificate(text: &str) -> Result<CertificateDer<'static>, String> {
        CertificateDer::pem_slice_iter(text.as_bytes())
            .next()
            .ok_or_else(|| "holds no PEM certificate".to_owned())?
            .map_err(|e| format!("is not a PEM certificate: {e}"))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A CA (certificate and key PEM) for tests, named `name`.
    pub(crate) fn test_ca(name: &str) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    /// Writes `cert` and `key` into a new directory in `dir` with the key at `mode`.
    fn files(dir: &Path, cert: &str, key: &str, mode: u32) -> CaFiles {
        let dir = tempfile::tempdir_in(dir).unwrap().keep();
        let files = CaFiles {
            cert: dir.join("ca.crt"),
            key: dir.join("ca.key"),
        };
        std::fs::write(&files.cert, cert).unwrap();
        std::fs::write(&files.key, key).unwrap();
        std::fs::set_permissions(&files.key, std::fs::Permissions::from_mode(mode)).unwrap();
        files
    }

    fn refusal(files: &CaFiles) -> String {
        InterceptCa::load(files).unwrap_err().0
    }

    #[test]
    fn every_bad_ca_is_refused_naming_the_flag() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = test_ca("test CA");
        let (_, other_key) = test_ca("other");
        let leaf = rcgen::generate_simple_self_signed(vec!["not-a-ca.test".to_owned()]).unwrap();
        let missing = CaFiles {
            cert: dir.path().join("none.crt"),
            key: dir.path().join("none.key"),
        };
        assert!(
            refusal(&missing).starts_with("--gateway-ca-cert"),
            "{}",
            refusal(&missing)
        );
        let cases = [
            (
                files(dir.path(), &cert, &other_key, 0o600),
                "--gateway-ca-key",
                "is not the key of the certificate",
            ),
            (
                files(
                    dir.path(),
                    &leaf.cert.pem(),
                    &leaf.signing_key.serialize_pem(),
                    0o600,
                ),
                "--gateway-ca-cert",
                "is not a CA certificate",
            ),
            (
                files(dir.path(), &cert, &key, 0o604),
                "--gateway-ca-key",
                "readable by others",
            ),
            (
                files(dir.path(), "not pem", &key, 0o600),
                "--gateway-ca-cert",
                "holds no PEM certificate",
            ),
            (
                files(dir.path(), &cert, "not a key", 0o600),
                "--gateway-ca-key",
                "is not a private key",
            ),
        ];
        for (files, flag, problem) in cases {
            let message = refusal(&files);
            assert!(
                message.starts_with(flag) && message.contains(problem),
                "{message}"
            );
        }
    }

    #[test]
    fn a_group_other_than_the_process_s_may_not_read_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = test_ca("test CA");
        let files = files(dir.path(), &cert, &key, 0o640);
        // The file belongs to the process's group here: allowed, as a Secret mounted for the
        // Pod's fsGroup is.
        assert!(InterceptCa::load(&files).is_ok());
        // SAFETY: geteuid cannot fail.
        if unsafe { libc::geteuid() } == 0 {
            // Root may hand the file to a group the process is not in.
            let foreign: libc::gid_t = 4242;
            let path = std::ffi::CString::new(files.key.to_str().unwrap()).unwrap();
            // SAFETY: a valid C string; -1 keeps the owner.
            assert_eq!(unsafe { libc::chown(path.as_ptr(), u32::MAX, foreign) }, 0);
            let message = refusal(&files);
            assert!(message.contains("readable by group 4242"), "{message}");
        }
    }

    #[test]
    fn leaves_name_their_host_chain_to_the_ca_and_come_from_the_cache_until_renewal() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = test_ca("test CA");
        let ca = InterceptCa::load(&files(dir.path(), &cert, &key, 0o600)).unwrap();
        let now = SystemTime::now();
        let (leaf, how) = ca.leaf("shop.example.com", now).unwrap();
        assert_eq!(how, Leaf::Minted);
        assert_eq!(leaf.cert.len(), 2, "leaf and CA");
        assert_eq!(&leaf.cert[1], ca.certificate());
        let (_, parsed) = x509_parser::parse_x509_certificate(&leaf.cert[0]).unwrap();
        let names: Vec<String> = parsed
            .subject_alternative_name()
            .unwrap()
            .unwrap()
            .value
            .general_names
            .iter()
            .map(|n| n.to_string())
            .collect();
        assert_eq!(names, ["DNSName(shop.example.com)"]);
        let validity = parsed.validity();
        let life = validity.not_after.timestamp() - validity.not_before.timestamp();
        assert_eq!(life as u64, (LEAF_VALIDITY + LEAF_BACKDATE).as_secs());
        // An address is an IP SAN.
        let (ip_leaf, _) = ca.leaf("127.0.0.1", now).unwrap();
        let (_, parsed) = x509_parser::parse_x509_certificate(&ip_leaf.cert[0]).unwrap();
        let san = parsed.subject_alternative_name().unwrap().unwrap();
        assert!(matches!(
            san.value.general_names[0],
            x509_parser::extensions::GeneralName::IPAddress(b) if b == [127, 0, 0, 1]
        ));
        // Cached while more than an hour is left, then minted again.
        let (again, how) = ca
            .leaf("shop.example.com", now + Duration::from_secs(60))
            .unwrap();
        assert_eq!(how, Leaf::Cached);
        assert!(Arc::ptr_eq(&leaf, &again));
        let late = now + LEAF_VALIDITY - LEAF_RENEW_BEFORE;
        assert_eq!(ca.leaf("shop.example.com", late).unwrap().1, Leaf::Minted);
        assert_eq!(ca.cached(), 2);
        assert!(ca.leaf("é.test", now).is_err());
    }

    #[test]
    fn the_cache_keeps_the_newest_hosts() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = test_ca("test CA");
        let ca = InterceptCa::load(&files(dir.path(), &cert, &key, 0o600)).unwrap();
        let now = SystemTime::now();
        for i in 0..LEAF_CACHE + 5 {
            ca.leaf(&format!("h{i}.test"), now).unwrap();
        }
        assert_eq!(ca.cached(), LEAF_CACHE);
        assert_eq!(ca.leaf("h0.test", now).unwrap().1, Leaf::Minted);
        assert_eq!(
            ca.leaf(&format!("h{}.test", LEAF_CACHE + 4), now)
                .unwrap()
                .1,
            Leaf::Cached
        );
    }
}
