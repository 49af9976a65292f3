//! Creating a machine: the credentials its proxy checks (a Secret made once per Proxy), the
//! create itself between the create-pending marker and the spec-hash annotations, the
//! recovery of an interrupted create, and the wait until the machine runs.

use std::collections::BTreeMap;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::controller;
use kube::runtime::events::EventType;
use kube::{Api, Resource, ResourceExt};
use serde_json::Value;

use super::failure::{cloud_init_missing, failure};
use super::machine::{Machine, find_by_name};
use super::step::{RetryEffect, Step, hold_message, new_reason_event, requeue_at, waiting_text};
use crate::controllers::proxy::error::Error;
use crate::controllers::proxy::status::{
    FieldChange, REASON_PROVISIONING, StatusChange, annotations_patch,
};
use crate::credentials::{
    CREDENTIALS_SECRET_LABEL, Credentials, HTPASSWD_SECRET_KEY, PASSWORD_KEY, USERNAME_KEY,
    machine_secret_name,
};
use crate::events::event;
use crate::provider::{MachineCredentials, Waiting, machine_labels};
use crate::resources::phase::Provisioning;
use crate::resources::proxy::{
    CREATE_PENDING_ANNOTATION, ConditionStatus, Proxy, ProxyStatus, ROTATE_ANNOTATION,
    ROTATED_ANNOTATION, SPEC_HASH_ANNOTATION, SPEC_HASH_VERSION_ANNOTATION,
};
use crate::resources::spec_hash::SPEC_HASH_VERSION;

/// Finds the machine an interrupted create may have made (by its deterministic name) and
/// records it; creates one when there is none.
pub(super) async fn recover(
    machine: &Machine<'_>,
    current: &ProxyStatus,
    api: &Api<Proxy>,
    hash: &str,
) -> Result<Step, Error> {
    let provider = machine.provider()?;
    let proxy = machine.proxy;
    let config = &machine.ctx.config;
    Ok(match find_by_name(machine, provider).await {
        Ok(Some(instance)) => {
            log::info!(
                "Proxy {}: recovered machine {} from an interrupted create",
                proxy.key(),
                instance.provider_id
            );
            Step::new(
                Some(provisioning(FieldChange::Set(instance.provider_id))),
                controller::Action::requeue(config.provisioning_poll),
            )
            .with_annotations(Some(record_created(proxy, hash)))
            .with_port(proxy.spec.port)
        }
        Ok(None) => match machine.desired_hash {
            Some(hash) => create(machine, current, api, hash).await?,
            None => cloud_init_missing("cloud-init cannot be resolved", config),
        },
        Err(e) => failure(machine, current, e)?,
    })
}

/// A create held after a failure: say so until `until` (when the hold is still the one
/// decided on), and look again then.
pub(super) fn hold_create(machine: &Machine<'_>, until: Timestamp) -> Step {
    let hold = machine
        .ctx
        .pacing
        .get(&machine.uid())
        .hold
        .filter(|h| h.until == until);
    let status = hold.map(|hold| {
        StatusChange::new(
            Provisioning::Waiting,
            ConditionStatus::False,
            hold.reason.clone(),
            hold_message(&hold),
        )
    });
    Step::new(status, requeue_at(until, machine.now)).with_retry(RetryEffect::Neutral)
}

/// The machine is not running yet: say why, with an Event when the provider's reason is new.
pub(super) fn await_provisioning(
    machine: &Machine<'_>,
    current: &ProxyStatus,
    waiting: Option<Waiting>,
    requeue: controller::Action,
) -> Step {
    let Some(waiting) = waiting else {
        return Step::new(Some(provisioning(FieldChange::Keep)), requeue);
    };
    let id = machine.provider_id.unwrap_or_default();
    let message = format!("machine {id} is not running: {}", waiting_text(&waiting));
    let event = new_reason_event(
        current,
        EventType::Warning,
        &waiting.reason,
        "Provision",
        &message,
    );
    Step::new(
        Some(
            StatusChange::new(
                Provisioning::InProgress,
                ConditionStatus::False,
                waiting.reason,
                message,
            )
            .ip(FieldChange::Clear),
        ),
        requeue,
    )
    .with_event(event)
}

/// Marks the create pending, creates the machine, and records its ID and the hash.
pub(super) async fn create(
    machine: &Machine<'_>,
    current: &ProxyStatus,
    api: &Api<Proxy>,
    hash: &str,
) -> Result<Step, Error> {
    let provider = machine.provider()?;
    let proxy = machine.proxy;
    let marked = api
        .patch(
            &proxy.name_any(),
            &PatchParams::default(),
            &Patch::Merge(annotations_patch(&[(
                CREATE_PENDING_ANNOTATION,
                Some(hash),
            )])),
        )
        .await?;
    let request = machine.create_request(machine_credentials(machine).await?);
    match provider.create(&request).await {
        Ok(instance) => {
            log::info!(
                "Proxy {}: created machine {}",
                proxy.key(),
                instance.provider_id
            );
            let note = format!(
                "created machine {} with {}",
                instance.provider_id,
                provider.name()
            );
            let mut step = Step::new(
                Some(provisioning(FieldChange::Set(instance.provider_id))),
                controller::Action::requeue(machine.ctx.config.provisioning_poll),
            )
            .with_annotations(Some(record_created(proxy, hash)))
            .with_event(Some(event(EventType::Normal, "Created", "Create", note)));
            step.resource_version = marked.resource_version();
            Ok(step.with_port(request.port))
        }
        Err(e) => {
            let mut step = failure(machine, current, e)?;
            step.resource_version = marked.resource_version();
            Ok(step)
        }
    }
}

/// The credentials the Proxy's machines check: those of its credentials Secret, which is
/// created (owned by the Proxy, labelled so the operator's watch sees it) with new random ones
/// when it does not exist yet. Every machine of the Proxy checks the same ones until the
/// Secret is deleted; they are never logged and never part of the spec hash.
async fn machine_credentials(machine: &Machine<'_>) -> Result<MachineCredentials, Error> {
    let id = machine.proxy.id();
    let name = machine_secret_name(&id.uid);
    let secrets: Api<Secret> = Api::namespaced(machine.ctx.client.clone(), &id.namespace);
    let existing = match secrets.get_opt(&name).await? {
        Some(secret) => Some(secret),
        None => {
            let secret = credentials_secret(machine, &name)?;
            match secrets.create(&PostParams::default(), &secret).await {
                Ok(_) => {
                    log::info!(
                        "Proxy {}: generated the credentials of its machines (Secret {}/{name})",
                        machine.proxy.key(),
                        id.namespace
                    );
                    Some(secret)
                }
                // Created by a reconcile that raced this one: use what it wrote.
                Err(kube::Error::Api(status)) if status.code == 409 => {
                    secrets.get_opt(&name).await?
                }
                Err(e) => return Err(e.into()),
            }
        }
    };
    let htpasswd = existing.as_ref().and_then(htpasswd_of).ok_or_else(|| {
        Error::Credentials(format!(
            "Secret {}/{name} has no key {HTPASSWD_SECRET_KEY:?}: delete it, and the next machine \
             gets new credentials",
            id.namespace
        ))
    })?;
    Ok(MachineCredentials {
        secret_name: name,
        htpasswd,
    })
}

/// A new credentials Secret `name` for the machine's Proxy, with random credentials.
fn credentials_secret(machine: &Machine<'_>, name: &str) -> Result<Secret, Error> {
    let credentials = Credentials::generate();
    let htpasswd = credentials.htpasswd_line().map_err(Error::Credentials)?;
    let mut labels = machine_labels(&machine.uid(), &machine.ctx.install);
    labels.insert(CREDENTIALS_SECRET_LABEL.to_owned(), "true".to_owned());
    Ok(Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: machine.proxy.namespace(),
            labels: Some(labels),
            owner_references: machine.proxy.controller_owner_ref(&()).map(|o| vec![o]),
            ..ObjectMeta::default()
        },
        string_data: Some(BTreeMap::from([
            (USERNAME_KEY.to_owned(), credentials.username),
            (PASSWORD_KEY.to_owned(), credentials.password),
            (HTPASSWD_SECRET_KEY.to_owned(), htpasswd),
        ])),
        type_: Some("Opaque".to_owned()),
        ..Secret::default()
    })
}

/// The password-file line a credentials Secret holds (in `data` as the API server answers, or
/// in `stringData` as just written).
fn htpasswd_of(secret: &Secret) -> Option<String> {
    secret
        .data
        .as_ref()
        .and_then(|d| d.get(HTPASSWD_SECRET_KEY))
        .and_then(|b| String::from_utf8(b.0.clone()).ok())
        .or_else(|| {
            secret
                .string_data
                .as_ref()
                .and_then(|d| d.get(HTPASSWD_SECRET_KEY))
                .cloned()
        })
        .filter(|line| !line.is_empty())
}

/// The machine is being created.
fn provisioning(provider_id: FieldChange) -> StatusChange {
    StatusChange::new(
        Provisioning::InProgress,
        ConditionStatus::False,
        REASON_PROVISIONING,
        "machine is being created",
    )
    .provider_id(provider_id)
    .ip(FieldChange::Clear)
}

/// The annotations recorded once a machine is created: the spec hash it was made with, the
/// rotate annotation's value then (so only a new value rotates it), and the create-pending
/// marker cleared.
fn record_created(proxy: &Proxy, hash: &str) -> Value {
    let rotate = proxy
        .annotations()
        .get(ROTATE_ANNOTATION)
        .map(String::as_str);
    let [spec_hash, version, pending] = hash_annotations(hash);
    annotations_patch(&[spec_hash, version, pending, (ROTATED_ANNOTATION, rotate)])
}

/// Records the hash the machine was made from, and clears the create-pending marker.
pub(super) fn record_hash(hash: &str) -> Value {
    annotations_patch(&hash_annotations(hash))
}

fn hash_annotations(hash: &str) -> [(&'static str, Option<&str>); 3] {
    [
        (SPEC_HASH_ANNOTATION, Some(hash)),
        (SPEC_HASH_VERSION_ANNOTATION, Some(SPEC_HASH_VERSION)),
        (CREATE_PENDING_ANNOTATION, None),
    ]
}

#[cfg(test)]
mod tests {
    use k8s_openapi::ByteString;

    use super::*;
    use crate::fixtures;

    #[test]
    fn the_htpasswd_line_is_read_from_data_or_from_string_data() {
        let line = "u:$6$salt$hash";
        let with = |data: Option<&str>, string_data: Option<&str>| Secret {
            data: data
                .map(|d| BTreeMap::from([(HTPASSWD_SECRET_KEY.into(), ByteString(d.into()))])),
            string_data: string_data
                .map(|d| BTreeMap::from([(HTPASSWD_SECRET_KEY.into(), d.to_owned())])),
            ..Secret::default()
        };
        let cases = [
            (
                "as the API server answers",
                with(Some(line), None),
                Some(line),
            ),
            ("as just written", with(None, Some(line)), Some(line)),
            ("data wins", with(Some(line), Some("other")), Some(line)),
            ("empty is none", with(Some(""), None), None),
            ("missing key", Secret::default(), None),
        ];
        for (case, secret, want) in cases {
            assert_eq!(htpasswd_of(&secret).as_deref(), want, "{case}");
        }
        let not_utf8 = Secret {
            data: Some(BTreeMap::from([(
                HTPASSWD_SECRET_KEY.into(),
                ByteString(vec![0xff, 0xfe]),
            )])),
            ..Secret::default()
        };
        assert_eq!(htpasswd_of(&not_utf8), None);
    }

    #[test]
    fn a_create_records_its_hash_and_rotate_value_and_clears_the_pending_marker() {
        let mut proxy = fixtures::managed("p", "local").build();
        let recorded = record_created(&proxy, "h1");
        let annotations = &recorded["metadata"]["annotations"];
        assert_eq!(annotations[SPEC_HASH_ANNOTATION], "h1");
        assert_eq!(annotations[SPEC_HASH_VERSION_ANNOTATION], SPEC_HASH_VERSION);
        assert!(annotations[CREATE_PENDING_ANNOTATION].is_null());
        assert!(annotations[ROTATED_ANNOTATION].is_null());
        assert!(
            annotations
                .as_object()
                .unwrap()
                .contains_key(ROTATED_ANNOTATION)
        );

        proxy
            .annotations_mut()
            .insert(ROTATE_ANNOTATION.into(), "monday".into());
        let recorded = record_created(&proxy, "h2");
        assert_eq!(
            recorded["metadata"]["annotations"][ROTATED_ANNOTATION],
            "monday"
        );
        // An adoption records the hash only: the rotate value is left as it is.
        let adopted = record_hash("h3");
        let annotations = adopted["metadata"]["annotations"].as_object().unwrap();
        assert_eq!(annotations.len(), 3);
        assert!(!annotations.contains_key(ROTATED_ANNOTATION));
    }
}
