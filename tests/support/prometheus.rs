//! A real Prometheus server for tests: being written.
