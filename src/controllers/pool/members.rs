//! A pool's members as objects: the template hash, their deterministic names, the Proxy made
//! from the template, and what the plan needs to know of each member that exists.
//!
//! A member is named `<pool>-<template hash>-<index>`, the index the lowest one free for that
//! hash. A create repeated after a crash or by a restarted leader names the same object, so the
//! API server's "already exists" stops a second one; the hash in the name means a roll-out's
//! new members never collide with the old ones they replace.

use std::collections::BTreeMap;

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::{Resource, ResourceExt};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::resources::pool::{POOL_LABEL, ProxyPool, ProxyTemplate, TEMPLATE_HASH_LABEL};
use crate::resources::proxy::{CONDITION_PROVISIONED, Phase, Proxy, REASON_QUOTA};

/// Characters of the template hash in names and labels (base32: 40 bits).
const HASH_LENGTH: usize = 8;

/// The template's hash: base32 of SHA-256 over its canonical JSON (labels, annotations, spec
/// but its `cost`). Any other change to the template changes it, and with it the names of new
/// members; a new price is written onto the members in place ([`repriced`]), never rolled out.
pub fn template_hash(template: &ProxyTemplate) -> String {
    let mut hashed = template.clone();
    hashed.spec.cost = None;
    let canonical = serde_json::to_value(&hashed).unwrap_or(Value::Null);
    let digest = Sha256::digest(canonical.to_string().as_bytes());
    let mut encoded = base32::encode(
        base32::Alphabet::Rfc4648Lower { padding: false },
        &digest[..5],
    );
    encoded.truncate(HASH_LENGTH);
    encoded
}

/// `<pool>-<hash>-<index>`.
pub fn member_name(pool: &str, hash: &str, index: u32) -> String {
    format!("{pool}-{hash}-{index}")
}

/// The index in a member's name, when it is `<pool>-<hash>-<index>`.
pub fn member_index(pool: &str, hash: &str, name: &str) -> Option<u32> {
    name.strip_prefix(pool)?
        .strip_prefix('-')?
        .strip_prefix(hash)?
        .strip_prefix('-')?
        .parse()
        .ok()
}

/// The member Proxy number `index` of `pool` with template hash `hash`: the template's labels
/// plus the pool and hash labels, its annotations, its spec, and the pool as controller owner.
pub fn build_member(pool: &ProxyPool, hash: &str, index: u32) -> Proxy {
    let pool_name = pool.name_any();
    let template = &pool.spec.template;
    let mut labels: BTreeMap<String, String> = template.metadata.labels.clone();
    labels.insert(POOL_LABEL.to_owned(), pool_name.clone());
    labels.insert(TEMPLATE_HASH_LABEL.to_owned(), hash.to_owned());
    let owner = OwnerReference {
        api_version: ProxyPool::api_version(&()).into_owned(),
        kind: ProxyPool::kind(&()).into_owned(),
        name: pool_name.clone(),
        uid: pool.uid().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    };
    Proxy {
        metadata: ObjectMeta {
            name: Some(member_name(&pool_name, hash, index)),
            namespace: pool.namespace(),
            labels: Some(labels),
            annotations: (!template.metadata.annotations.is_empty())
                .then(|| template.metadata.annotations.clone()),
            owner_references: Some(vec![owner]),
            ..ObjectMeta::default()
        },
        spec: template.spec.clone(),
        status: None,
    }
}

/// What the plan knows of one existing member.
#[derive(Debug, Clone, PartialEq)]
pub struct Member {
    /// Its name.
    pub name: String,
    /// Whether it matches the pool's current template (hash label, labels and spec).
    pub current: bool,
    /// Its index, when its name is the scheme's for the current template hash (a member
    /// edited by hand keeps its name but is not current: its index stays taken).
    pub index: Option<u32>,
    /// In phase Ready.
    pub ready: bool,
    /// Active leases on it.
    pub leases: u32,
    /// Its lease capacity (`maxLeases`).
    pub capacity: u32,
    /// When it was created.
    pub created: Timestamp,
    /// Being deleted (draining, its machine going): it still counts towards the bound.
    pub deleting: bool,
    /// Its provider refused to create its machine for quota.
    pub quota_refused: bool,
}

/// Reads `proxy`, a member of `pool` whose current template hash is `hash`, with `leases`
/// active leases.
pub fn member_of(pool: &ProxyPool, hash: &str, proxy: &Proxy, leases: u32) -> Member {
    let name = proxy.name_any();
    let labels = proxy.labels();
    let template = &pool.spec.template;
    let labelled = labels.get(TEMPLATE_HASH_LABEL).map(String::as_str) == Some(hash);
    let current = labelled && matches_template(proxy, template);
    Member {
        index: member_index(&pool.name_any(), hash, &name),
        current,
        ready: proxy.status.as_ref().and_then(|s| s.phase) == Some(Phase::Ready),
        leases,
        capacity: proxy.spec.max_leases(),
        created: proxy
            .metadata
            .creation_timestamp
            .as_ref()
            .map_or(Timestamp::UNIX_EPOCH, |t| t.0),
        deleting: proxy.metadata.deletion_timestamp.is_some(),
        quota_refused: proxy
            .status
            .as_ref()
            .and_then(|s| s.condition(CONDITION_PROVISIONED))
            .is_some_and(|c| c.reason == REASON_QUOTA),
        name,
    }
}

/// Whether a member still is what the template makes: its template labels and its spec, apart
/// from `cordoned` (an operational switch an SRE may flip on one member) and `cost` (written
/// onto it in place, see [`repriced`]).
fn matches_template(proxy: &Proxy, template: &ProxyTemplate) -> bool {
    let labels = proxy.labels();
    let labels_match = template
        .metadata
        .labels
        .iter()
        .all(|(k, v)| labels.get(k) == Some(v));
    let mut spec = proxy.spec.clone();
    spec.cordoned = template.spec.cordoned;
    spec.cost.clone_from(&template.spec.cost);
    labels_match && spec == template.spec
}

/// The members of `owned` (not being deleted) whose `cost` is not the template's: a price
/// changed on the template is patched onto them, since a price is no reason for a new machine.
pub fn repriced<'a>(template: &ProxyTemplate, owned: &'a [Proxy]) -> Vec<&'a Proxy> {
    owned
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none() && p.spec.cost != template.spec.cost)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool() -> ProxyPool {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "crawl.example.com/v1alpha1",
            "kind": "ProxyPool",
            "metadata": {"name": "eu", "namespace": "crawl", "uid": "pool-uid"},
            "spec": {
                "replicas": 2,
                "template": {
                    "metadata": {"labels": {"geo": "eu"}, "annotations": {"team": "a"}},
                    "spec": {"mode": "Managed", "provider": "local", "port": 3128}
                }
            }
        }))
        .unwrap()
    }

    #[test]
    fn names_carry_pool_hash_and_index_and_read_back() {
        assert_eq!(member_name("eu", "abcd2345", 3), "eu-abcd2345-3");
        assert_eq!(member_index("eu", "abcd2345", "eu-abcd2345-3"), Some(3));
        for other in [
            "eu-abcd2345-",
            "eu-zzzz2345-3",
            "eu2-abcd2345-3",
            "eu-abcd2345-x",
        ] {
            assert_eq!(member_index("eu", "abcd2345", other), None, "{other}");
        }
    }

    #[test]
    fn the_hash_follows_every_template_field() {
        let base = pool();
        let hash = template_hash(&base.spec.template);
        assert_eq!(hash.len(), HASH_LENGTH);
        assert_eq!(hash, template_hash(&pool().spec.template), "deterministic");
        let mut labels = pool();
        labels
            .spec
            .template
            .metadata
            .labels
            .insert("tier".into(), "a".into());
        let mut port = pool();
        port.spec.template.spec.port = 3129;
        let mut annotations = pool();
        annotations.spec.template.metadata.annotations.clear();
        for changed in [labels, port, annotations] {
            assert_ne!(template_hash(&changed.spec.template), hash);
        }
    }

    #[test]
    fn a_member_is_the_template_owned_by_the_pool() {
        let pool = pool();
        let member = build_member(&pool, "abcd2345", 1);
        assert_eq!(member.name_any(), "eu-abcd2345-1");
        assert_eq!(member.namespace().as_deref(), Some("crawl"));
        let labels = member.labels();
        assert_eq!(labels.get("geo").map(String::as_str), Some("eu"));
        assert_eq!(labels.get(POOL_LABEL).map(String::as_str), Some("eu"));
        assert_eq!(
            labels.get(TEMPLATE_HASH_LABEL).map(String::as_str),
            Some("abcd2345")
        );
        assert_eq!(
            member.annotations().get("team").map(String::as_str),
            Some("a")
        );
        let owner = &member.owner_references()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str()),
            ("ProxyPool", "eu", "pool-uid")
        );
        assert_eq!(owner.controller, Some(true));
        assert_eq!(member.spec, pool.spec.template.spec);
    }

    #[test]
    fn a_new_price_keeps_the_hash_and_the_members_and_is_patched_onto_them() {
        let priced = |per_gb: &str| {
            let mut pool = pool();
            pool.spec.template.spec.cost = Some(
                serde_json::from_value(serde_json::json!({"perGB": per_gb, "perHour": "0.01"}))
                    .unwrap(),
            );
            pool
        };
        let unpriced = pool();
        let hash = template_hash(&unpriced.spec.template);
        for pool in [priced("8.40"), priced("2")] {
            assert_eq!(
                template_hash(&pool.spec.template),
                hash,
                "the price is not hashed"
            );
        }
        let old = build_member(&unpriced, &hash, 0);
        let mut gone = build_member(&unpriced, &hash, 1);
        gone.metadata.deletion_timestamp = Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Timestamp::UNIX_EPOCH),
        );
        let now = priced("8.40");
        let current = build_member(&now, &hash, 2);
        assert!(
            member_of(&now, &hash, &old, 0).current,
            "an old price is no roll-out"
        );
        let owned = [old, gone, current];
        let names: Vec<String> = repriced(&now.spec.template, &owned)
            .into_iter()
            .map(|p| p.name_any())
            .collect();
        assert_eq!(names, [owned[0].name_any()]);
        assert!(repriced(&unpriced.spec.template, &owned[..2]).is_empty());
    }

    #[test]
    fn a_member_edited_by_hand_is_not_current_but_a_cordon_is_kept() {
        let pool = pool();
        let hash = template_hash(&pool.spec.template);
        let mut member = build_member(&pool, &hash, 0);
        assert!(member_of(&pool, &hash, &member, 0).current);
        assert_eq!(member_of(&pool, &hash, &member, 0).index, Some(0));
        member.spec.cordoned = true;
        assert!(member_of(&pool, &hash, &member, 0).current);
        member.spec.port = 4000;
        assert!(!member_of(&pool, &hash, &member, 0).current);
        let mut relabelled = build_member(&pool, &hash, 0);
        relabelled
            .metadata
            .labels
            .as_mut()
            .unwrap()
            .insert("geo".into(), "us".into());
        assert!(!member_of(&pool, &hash, &relabelled, 0).current);
        assert!(!member_of(&pool, "otherhash", &build_member(&pool, &hash, 0), 0).current);
    }
}
