//! What the two servers crawlers talk to, the lease API and the gateway, share: the tokens
//! that admit a crawler, the candidate set of an acquire, the gateway's sticky sessions (which
//! the API reads for a session's ban report), the upstream credentials sent through a proxy,
//! and the `Retry-After` both answer with.

pub mod candidates;
pub mod credentials;
pub mod retry_after;
pub mod sessions;
pub mod tokens;
