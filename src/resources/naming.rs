//! Deterministic machine names derived from the Proxy's UID.
//!
//! The name never changes for the life of a Proxy, so a create repeated after a crash finds the
//! machine it already made ("already exists" is success) instead of creating a second one.

use sha2::{Digest, Sha256};

/// Prefix of every machine name.
pub const MACHINE_NAME_PREFIX: &str = "proxy-";

/// `proxy-` + lowercase unpadded RFC 4648 base32 of the first 10 bytes of SHA-256(uid).
///
/// 80 bits keep collisions out of reach for any realistic fleet, base32 stays within the
/// `[a-z0-9-]` alphabet both Kubernetes and GCP accept, and 22 characters leave room for
/// names providers derive from it (a GCP boot disk, for example).
pub fn machine_name(uid: &str) -> String {
    let digest = Sha256::digest(uid.as_bytes());
    let encoded = base32::encode(
        base32::Alphabet::Rfc4648Lower { padding: false },
        &digest[..10],
    );
    format!("{MACHINE_NAME_PREFIX}{encoded}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn is_valid(name: &str) -> bool {
        name.len() == 22
            && name.starts_with(MACHINE_NAME_PREFIX)
            && name[MACHINE_NAME_PREFIX.len()..]
                .bytes()
                .all(|b| b.is_ascii_lowercase() || (b'2'..=b'7').contains(&b))
    }

    #[test]
    fn name_is_deterministic_and_well_formed() {
        let uid = "0f8c7e4a-3b1d-4c2e-9a55-6d7e8f901234";
        let name = machine_name(uid);
        assert_eq!(name, machine_name(uid));
        assert!(is_valid(&name), "{name}");
        let pattern = regex::Regex::new("^proxy-[a-z2-7]{16}$").unwrap();
        assert!(pattern.is_match(&name), "{name}");
    }

    #[test]
    fn known_vector() {
        // SHA-256("") starts e3 b0 c4 42 98 fc 1c 14 9a fb; base32 of those 10 bytes:
        assert_eq!(machine_name(""), "proxy-4oymiquy7qobjgx3");
    }

    #[test]
    fn ten_thousand_uids_give_ten_thousand_names() {
        let names: HashSet<String> = (0..10_000)
            .map(|_| machine_name(&uuid::Uuid::new_v4().to_string()))
            .collect();
        assert_eq!(names.len(), 10_000);
        assert!(names.iter().all(|n| is_valid(n)));
    }
}
