//! What the two servers crawlers talk to, the lease API and the gateway, share: the tokens
//! that admit a crawler and the tenant each names, the candidate set of an acquire, the gateway's sticky sessions (which
//! the API reads for a session's ban report), the upstream credentials sent through a proxy,
//! the `Retry-After` both answer with, and how requests through each proxy ended (the success
//! rate both feed).

pub mod candidates;
pub mod credentials;
pub mod outcomes;
pub mod retry_after;
pub mod sessions;
pub mod tenants;
pub mod tokens;
pub mod watched_file;
