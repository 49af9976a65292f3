//! Monitoring assets (`manifests/monitoring/`): being written.
