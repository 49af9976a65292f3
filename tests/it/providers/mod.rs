//! The machine providers: the Kubernetes Pod provider on a real API server, the Compute Engine
//! provider against its REST API on loopback, and the providers file that names them.

mod gcp;
mod kubernetes;
mod registry;
