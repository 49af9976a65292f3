//! The reconciler's state machine: one pure decision per reconcile.
//!
//! [`decide`] turns what is known about a Proxy (its metadata, its status, the spec hash of what
//! it asks for, and what the provider said about its machine) into exactly one [`Action`]. The
//! I/O that carries an action out lives in `apply`, so every row of the design's table is tested
//! here without a cluster or a cloud.

use crate::provider::{ErrorClass, InstanceState};
use crate::proxy::Mode;
use crate::spec_hash::SPEC_HASH_VERSION;

/// What the provider said about the machine recorded in `status.providerID`.
#[derive(Debug, Clone, PartialEq)]
pub enum Observation {
    /// No `get` was made (no providerID, or no provider calls are allowed).
    NotQueried,
    /// The machine exists.
    Found {
        /// Its state.
        state: InstanceState,
        /// Its address, when running.
        ip: Option<String>,
    },
    /// The machine does not exist (an input, never an error).
    NotFound,
    /// The `get` failed.
    Error {
        /// The failure's class.
        class: ErrorClass,
        /// The failure, for the condition and the log.
        message: String,
    },
}

/// Everything [`decide`] looks at. Built by the caller from the object and the provider's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Inputs<'a> {
    /// `spec.mode`.
    pub mode: Mode,
    /// Whether the object has a deletionTimestamp.
    pub deleting: bool,
    /// Whether our finalizer is on the object.
    pub finalizer_present: bool,
    /// `status.providerID` (an empty string counts as unset).
    pub provider_id: Option<&'a str>,
    /// The spec-hash annotation (A).
    pub recorded_hash: Option<&'a str>,
    /// The spec-hash-version annotation.
    pub recorded_hash_version: Option<&'a str>,
    /// The create-pending annotation: the hash a create was started with.
    pub create_pending: Option<&'a str>,
    /// The computed spec hash (H); `None` when the cloud-init Secret cannot be read.
    pub desired_hash: Option<&'a str>,
    /// Why the cloud-init could not be resolved, when `desired_hash` is `None`.
    pub cloud_init_problem: Option<&'a str>,
    /// Whether a permanent provider failure was already recorded for this generation.
    pub failed_this_generation: bool,
    /// The provider's answer about `provider_id`.
    pub observation: &'a Observation,
}

/// The one thing a reconcile does.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Put our finalizer on the object; the update re-triggers a reconcile.
    AddFinalizer,
    /// Take our finalizer off; the machine is gone (or never existed).
    RemoveFinalizer,
    /// Mark the create as pending, create the machine, record its ID and the hash.
    Create {
        /// The hash the machine is created with.
        hash: String,
    },
    /// A create was started but its ID never recorded: find the machine by its deterministic
    /// name before creating anything.
    Recover {
        /// The hash that create was started with.
        hash: String,
    },
    /// The machine is being created: clear the IP, poll.
    AwaitProvisioning,
    /// The machine runs: record its IP, poll for drift.
    Running {
        /// The machine's address.
        ip: Option<String>,
    },
    /// The machine stopped or terminated: delete it (cattle), poll until it is gone.
    DeleteDead,
    /// The machine is gone: forget its ID and IP so the next pass creates a new one.
    Forget {
        /// Record this hash as A too (it differed from H).
        record_hash: Option<String>,
    },
    /// The spec changed: delete the machine, poll until NotFound, then re-create.
    Replace,
    /// Record the hash without replacing (annotation empty or from another hash version).
    Adopt {
        /// The hash to record as A.
        hash: String,
    },
    /// The Proxy is being deleted: delete its machine, poll until it is gone.
    DeleteForCleanup,
    /// An External proxy: no provider, the endpoint is the address.
    External,
    /// A transient failure: return an error so the controller backs off.
    Backoff {
        /// The failure.
        message: String,
    },
    /// The provider refused for quota: record the condition, retry in minutes.
    QuotaWait {
        /// The failure.
        message: String,
    },
    /// The provider refused permanently: phase Failed, no more provider calls.
    Fail {
        /// The failure.
        message: String,
    },
    /// A permanent failure was already recorded for this generation: do nothing.
    StayFailed,
    /// The referenced cloud-init Secret or key is missing: record why, retry later.
    AwaitCloudInit {
        /// What is missing.
        message: String,
    },
}

/// How A relates to H.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HashState {
    /// A == H under the current hash version (or H is unknown: no drift decision possible).
    Current,
    /// A is empty or from another hash version: record H, never replace.
    Adoptable,
    /// A was computed by the current hash version and differs: the spec changed.
    Drifted,
}

fn hash_state(inputs: &Inputs<'_>) -> HashState {
    let Some(desired) = inputs.desired_hash else {
        return HashState::Current;
    };
    let recorded = inputs.recorded_hash.filter(|a| !a.is_empty());
    let same_version = inputs.recorded_hash_version == Some(SPEC_HASH_VERSION);
    match recorded {
        Some(a) if a == desired && same_version => HashState::Current,
        Some(a) if a != desired && same_version => HashState::Drifted,
        _ => HashState::Adoptable,
    }
}

/// The action for a failed provider call of the given class (from `get`, `create` or `delete`).
pub fn on_provider_error(class: ErrorClass, message: String) -> Action {
    match class {
        ErrorClass::QuotaExceeded => Action::QuotaWait { message },
        ErrorClass::Permanent => Action::Fail { message },
        // NotFound only means something for `get`, which `decide` handles as an input; from any
        // other call it is unexpected, and retrying is the safe answer.
        ErrorClass::Transient | ErrorClass::NotFound | ErrorClass::Refused => {
            Action::Backoff { message }
        }
    }
}

/// The design's reconcile table: exactly one action for the given inputs.
pub fn decide(inputs: &Inputs<'_>) -> Action {
    if inputs.mode == Mode::External {
        return Action::External;
    }
    let provider_id = inputs.provider_id.filter(|id| !id.is_empty());
    if inputs.deleting {
        return match (provider_id, inputs.observation) {
            (None, _) | (Some(_), Observation::NotFound) => Action::RemoveFinalizer,
            (Some(_), Observation::Error { class, message }) => {
                on_provider_error(*class, message.clone())
            }
            (Some(_), _) => Action::DeleteForCleanup,
        };
    }
    if !inputs.finalizer_present {
        return Action::AddFinalizer;
    }
    if inputs.failed_this_generation {
        return Action::StayFailed;
    }
    let Some(_) = provider_id else {
        if let Some(hash) = inputs.create_pending.filter(|h| !h.is_empty()) {
            return Action::Recover {
                hash: hash.to_owned(),
            };
        }
        return match inputs.desired_hash {
            Some(hash) => Action::Create {
                hash: hash.to_owned(),
            },
            None => Action::AwaitCloudInit {
                message: inputs
                    .cloud_init_problem
                    .unwrap_or("cloud-init cannot be resolved")
                    .to_owned(),
            },
        };
    };
    if let Observation::Error { class, message } = inputs.observation {
        return on_provider_error(*class, message.clone());
    }
    if *inputs.observation == Observation::NotFound {
        let record_hash = inputs
            .desired_hash
            .filter(|h| inputs.recorded_hash != Some(*h))
            .map(str::to_owned);
        return Action::Forget { record_hash };
    }
    // The ID was recorded but the crash came before the pending marker was cleared: the machine
    // was created with the pending hash, so record that one.
    if let Some(hash) = inputs.create_pending.filter(|h| !h.is_empty()) {
        return Action::Adopt {
            hash: hash.to_owned(),
        };
    }
    match hash_state(inputs) {
        HashState::Adoptable => {
            return Action::Adopt {
                hash: inputs.desired_hash.unwrap_or_default().to_owned(),
            };
        }
        HashState::Drifted => return Action::Replace,
        HashState::Current => {}
    }
    match inputs.observation {
        Observation::Found {
            state: InstanceState::Provisioning,
            ..
        } => Action::AwaitProvisioning,
        Observation::Found {
            state: InstanceState::Running,
            ip,
        } => Action::Running { ip: ip.clone() },
        Observation::Found {
            state: InstanceState::Stopped | InstanceState::Terminated,
            ..
        } => Action::DeleteDead,
        // Not reachable for a Managed proxy with an ID (the caller always queries), but a missing
        // answer must never destroy anything: ask again.
        Observation::NotQueried | Observation::NotFound | Observation::Error { .. } => {
            Action::Backoff {
                message: "no answer from the provider".to_owned(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: &str = "hash-new";
    const A_OLD: &str = "hash-old";
    const V: &str = SPEC_HASH_VERSION;

    fn found(state: InstanceState) -> Observation {
        Observation::Found {
            state,
            ip: (state == InstanceState::Running).then(|| "10.0.0.9".to_owned()),
        }
    }

    fn error(class: ErrorClass) -> Observation {
        Observation::Error {
            class,
            message: "boom".into(),
        }
    }

    /// A Managed proxy with the finalizer, a recorded ID and A == H.
    fn base(observation: &Observation) -> Inputs<'_> {
        Inputs {
            mode: Mode::Managed,
            deleting: false,
            finalizer_present: true,
            provider_id: Some("ns/proxy-x"),
            recorded_hash: Some(H),
            recorded_hash_version: Some(V),
            create_pending: None,
            desired_hash: Some(H),
            cloud_init_problem: None,
            failed_this_generation: false,
            observation,
        }
    }

    #[test]
    fn every_row_of_the_managed_table() {
        let not_queried = Observation::NotQueried;
        let provisioning = found(InstanceState::Provisioning);
        let running = found(InstanceState::Running);
        let stopped = found(InstanceState::Stopped);
        let terminated = found(InstanceState::Terminated);
        let not_found = Observation::NotFound;
        let running_ip = Action::Running {
            ip: Some("10.0.0.9".into()),
        };
        type Case<'a> = (&'a str, Inputs<'a>, Action);
        let cases: Vec<Case<'_>> = vec![
            (
                "no finalizer -> add it",
                Inputs {
                    finalizer_present: false,
                    provider_id: None,
                    ..base(&not_queried)
                },
                Action::AddFinalizer,
            ),
            (
                "no ID -> create with H",
                Inputs {
                    provider_id: None,
                    recorded_hash: None,
                    ..base(&not_queried)
                },
                Action::Create { hash: H.into() },
            ),
            (
                "empty ID string counts as unset",
                Inputs {
                    provider_id: Some(""),
                    ..base(&not_queried)
                },
                Action::Create { hash: H.into() },
            ),
            (
                "A == H, Provisioning -> poll",
                base(&provisioning),
                Action::AwaitProvisioning,
            ),
            ("A == H, Running -> set ip", base(&running), running_ip),
            (
                "A == H, Stopped -> delete",
                base(&stopped),
                Action::DeleteDead,
            ),
            (
                "A == H, Terminated -> delete",
                base(&terminated),
                Action::DeleteDead,
            ),
            (
                "A == H, NotFound -> forget",
                base(&not_found),
                Action::Forget { record_hash: None },
            ),
            (
                "A != H, NotFound -> forget and record H (replacement completes)",
                Inputs {
                    recorded_hash: Some(A_OLD),
                    ..base(&not_found)
                },
                Action::Forget {
                    record_hash: Some(H.into()),
                },
            ),
            (
                "A != H, Running -> replace",
                Inputs {
                    recorded_hash: Some(A_OLD),
                    ..base(&running)
                },
                Action::Replace,
            ),
            (
                "A != H, Provisioning -> replace",
                Inputs {
                    recorded_hash: Some(A_OLD),
                    ..base(&provisioning)
                },
                Action::Replace,
            ),
            (
                "A != H, Terminated (still deleting) -> replace again, wait for NotFound",
                Inputs {
                    recorded_hash: Some(A_OLD),
                    ..base(&terminated)
                },
                Action::Replace,
            ),
            (
                "A empty, Running -> adopt",
                Inputs {
                    recorded_hash: None,
                    recorded_hash_version: None,
                    ..base(&running)
                },
                Action::Adopt { hash: H.into() },
            ),
            (
                "A empty string, Stopped -> adopt first",
                Inputs {
                    recorded_hash: Some(""),
                    ..base(&stopped)
                },
                Action::Adopt { hash: H.into() },
            ),
            (
                "hash version mismatch -> adopt, not drift",
                Inputs {
                    recorded_hash: Some(A_OLD),
                    recorded_hash_version: Some("0"),
                    ..base(&running)
                },
                Action::Adopt { hash: H.into() },
            ),
            (
                "hash version missing, A == H -> adopt records the version",
                Inputs {
                    recorded_hash_version: None,
                    ..base(&running)
                },
                Action::Adopt { hash: H.into() },
            ),
            (
                "deleting, no ID -> remove finalizer",
                Inputs {
                    deleting: true,
                    provider_id: None,
                    ..base(&not_queried)
                },
                Action::RemoveFinalizer,
            ),
            (
                "deleting, ID, NotFound -> remove finalizer",
                Inputs {
                    deleting: true,
                    ..base(&not_found)
                },
                Action::RemoveFinalizer,
            ),
            (
                "deleting, ID, Running -> delete",
                Inputs {
                    deleting: true,
                    ..base(&running)
                },
                Action::DeleteForCleanup,
            ),
            (
                "deleting, ID, Terminated -> delete",
                Inputs {
                    deleting: true,
                    ..base(&terminated)
                },
                Action::DeleteForCleanup,
            ),
            (
                "deleting after a permanent failure still deletes",
                Inputs {
                    deleting: true,
                    failed_this_generation: true,
                    ..base(&running)
                },
                Action::DeleteForCleanup,
            ),
        ];
        for (name, inputs, expected) in cases {
            assert_eq!(decide(&inputs), expected, "{name}");
        }
    }

    #[test]
    fn external_proxies_never_touch_finalizers_or_providers() {
        let obs = Observation::NotQueried;
        for (deleting, finalizer) in [(false, false), (true, false), (false, true)] {
            let inputs = Inputs {
                mode: Mode::External,
                deleting,
                finalizer_present: finalizer,
                provider_id: None,
                ..base(&obs)
            };
            assert_eq!(decide(&inputs), Action::External);
        }
    }

    #[test]
    fn error_classes_from_get() {
        let cases = [
            (ErrorClass::Transient, "Backoff"),
            (ErrorClass::QuotaExceeded, "QuotaWait"),
            (ErrorClass::Permanent, "Fail"),
        ];
        for (class, expected) in cases {
            let obs = error(class);
            for deleting in [false, true] {
                let action = decide(&Inputs {
                    deleting,
                    ..base(&obs)
                });
                let name = format!("{action:?}");
                assert!(name.starts_with(expected), "{class:?}: {name}");
            }
        }
    }

    #[test]
    fn error_classes_from_create_and_delete() {
        let m = || "x".to_owned();
        assert_eq!(
            on_provider_error(ErrorClass::Transient, m()),
            Action::Backoff { message: m() }
        );
        assert_eq!(
            on_provider_error(ErrorClass::QuotaExceeded, m()),
            Action::QuotaWait { message: m() }
        );
        assert_eq!(
            on_provider_error(ErrorClass::Permanent, m()),
            Action::Fail { message: m() }
        );
        assert_eq!(
            on_provider_error(ErrorClass::NotFound, m()),
            Action::Backoff { message: m() }
        );
    }

    #[test]
    fn permanent_failure_latches_until_the_spec_changes() {
        let obs = Observation::NotQueried;
        let inputs = Inputs {
            failed_this_generation: true,
            provider_id: None,
            ..base(&obs)
        };
        assert_eq!(decide(&inputs), Action::StayFailed);
        let running = found(InstanceState::Running);
        let inputs = Inputs {
            failed_this_generation: true,
            ..base(&running)
        };
        assert_eq!(decide(&inputs), Action::StayFailed);
    }

    #[test]
    fn create_pending_is_recovered_by_name_not_created_again() {
        let obs = Observation::NotQueried;
        let inputs = Inputs {
            provider_id: None,
            create_pending: Some(A_OLD),
            ..base(&obs)
        };
        assert_eq!(decide(&inputs), Action::Recover { hash: A_OLD.into() });
        // ID recorded, marker not yet cleared: the machine carries the pending hash.
        let running = found(InstanceState::Running);
        let inputs = Inputs {
            recorded_hash: None,
            create_pending: Some(A_OLD),
            ..base(&running)
        };
        assert_eq!(decide(&inputs), Action::Adopt { hash: A_OLD.into() });
    }

    #[test]
    fn unresolvable_cloud_init_blocks_create_but_never_replaces() {
        let obs = Observation::NotQueried;
        let inputs = Inputs {
            provider_id: None,
            desired_hash: None,
            cloud_init_problem: Some("Secret ns/ci not found"),
            ..base(&obs)
        };
        assert_eq!(
            decide(&inputs),
            Action::AwaitCloudInit {
                message: "Secret ns/ci not found".into()
            }
        );
        let running = found(InstanceState::Running);
        let inputs = Inputs {
            recorded_hash: Some(A_OLD),
            desired_hash: None,
            ..base(&running)
        };
        assert!(matches!(decide(&inputs), Action::Running { .. }));
    }
}
