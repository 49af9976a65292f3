//! The Helm chart (`charts/proxy-operator/`): being written.
