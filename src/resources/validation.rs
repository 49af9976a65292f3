//! Client-side checks of a Proxy object against the generated CRD: the OpenAPI value
//! constraints (types, required fields, `minLength`, ranges, enums) and the CEL rules
//! (`x-kubernetes-validations`). Both are read from the generated schema, so they cannot drift
//! from what the API server enforces.
//!
//! Used wherever a Proxy does not pass through an API server (the standalone inventory file)
//! and by the tests of the rules themselves.

use kube_cel::{CompiledSchema, Validator, compile_schema};
use serde_json::Value;

use super::crd;

/// The Proxy schema with its constraints and rules compiled once.
pub struct ProxyValidator {
    constraints: jsonschema::Validator,
    rules: CompiledSchema,
    evaluator: Validator,
}

/// One broken constraint or rule: where (a JSON path) and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleViolation {
    /// Path of the offending value, e.g. `spec`, `spec.cloudInit` or `/spec/endpoint/port`.
    pub path: String,
    /// What is wrong (the rule's message for CEL rules).
    pub message: String,
}

impl std::fmt::Display for RuleViolation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// The generated schema could not be compiled (a bug in the Rust types, never user input).
#[derive(Debug, thiserror::Error)]
#[error("the generated Proxy schema does not compile: {0}")]
pub struct SchemaError(String);

impl ProxyValidator {
    /// Compiles the constraints and rules of the generated CRD.
    pub fn new() -> Result<Self, SchemaError> {
        let schema = crd::openapi_schema();
        let constraints =
            jsonschema::validator_for(&schema).map_err(|e| SchemaError(e.to_string()))?;
        let rules = compile_schema(&schema);
        if rules.has_errors() {
            let errors: Vec<String> = rules
                .compilation_errors()
                .iter()
                .map(ToString::to_string)
                .collect();
            return Err(SchemaError(errors.join("; ")));
        }
        Ok(ProxyValidator {
            constraints,
            rules,
            evaluator: Validator::new(),
        })
    }

    /// Checks a whole Proxy object (as JSON) as the API server does on create: value
    /// constraints, then the rules over the defaulted object, skipping rules that mention
    /// `oldSelf`.
    pub fn validate_create(&self, object: &Value) -> Result<(), Vec<RuleViolation>> {
        self.run(object, None)
    }

    /// Checks an update of `old` to `object`, including the transition (`oldSelf`) rules.
    pub fn validate_update(&self, object: &Value, old: &Value) -> Result<(), Vec<RuleViolation>> {
        self.run(object, Some(old))
    }

    fn run(&self, object: &Value, old: Option<&Value>) -> Result<(), Vec<RuleViolation>> {
        let mut violations: Vec<RuleViolation> = self
            .constraints
            .iter_errors(object)
            .map(|e| RuleViolation {
                path: e.instance_path().to_string(),
                message: e.to_string(),
            })
            .collect();
        if let Err(errors) = self.evaluator.validate_compiled(&self.rules, object, old) {
            violations.extend(errors.into_iter().map(|e| RuleViolation {
                path: e.field_path,
                message: e.message,
            }));
        }
        if violations.is_empty() {
            Ok(())
        } else {
            Err(violations)
        }
    }
}
