//! Client-side evaluation of the CRD's CEL rules (`x-kubernetes-validations`), read from the
//! generated CRD so they can never drift from what the API server enforces.
//!
//! Used wherever a Proxy does not pass through an API server (the standalone inventory file)
//! and by the tests of the rules themselves.

use kube_cel::{CompiledSchema, Validator, compile_schema};
use serde_json::Value;

use crate::crd;

/// The Proxy schema with its rules compiled once.
pub struct ProxyValidator {
    schema: CompiledSchema,
    validator: Validator,
}

/// One broken rule: where (a JSON path) and the rule's message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleViolation {
    /// Path of the object the rule is attached to, e.g. `spec` or `spec.cloudInit`.
    pub path: String,
    /// The rule's message.
    pub message: String,
}

impl std::fmt::Display for RuleViolation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

impl Default for ProxyValidator {
    fn default() -> Self {
        Self::new()
    }
}

impl ProxyValidator {
    /// Compiles the rules of the generated CRD.
    pub fn new() -> Self {
        ProxyValidator {
            schema: compile_schema(&crd::openapi_schema()),
            validator: Validator::new(),
        }
    }

    /// Whether every rule compiled (a rule that does not compile is a bug in the types).
    pub fn compiles(&self) -> bool {
        !self.schema.has_errors()
    }

    /// Checks a whole Proxy object (as JSON) as the API server does on create: schema defaults
    /// are applied first and rules mentioning `oldSelf` are not evaluated.
    pub fn validate_create(&self, object: &Value) -> Result<(), Vec<RuleViolation>> {
        self.run(object, None)
    }

    /// Checks an update of `old` to `object`, including the transition (`oldSelf`) rules.
    pub fn validate_update(&self, object: &Value, old: &Value) -> Result<(), Vec<RuleViolation>> {
        self.run(object, Some(old))
    }

    fn run(&self, object: &Value, old: Option<&Value>) -> Result<(), Vec<RuleViolation>> {
        self.validator
            .validate_compiled(&self.schema, object, old)
            .map_err(|errors| {
                errors
                    .into_iter()
                    .map(|e| RuleViolation {
                        path: e.field_path,
                        message: e.message,
                    })
                    .collect()
            })
    }
}
