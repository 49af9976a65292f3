//! What the crawler-facing servers (the lease API, the gateway, the status page) read of the
//! fleet and share, below them and below the controllers: the tokens that admit a crawler and
//! the tenant each names, the candidate set of an acquire, the pools a request may wake, the
//! gateway's sticky sessions (which the API reads for a session's ban report), the
//! `Retry-After` both answer with, how requests through each proxy ended (the success rate
//! both feed), and what the bytes through them cost.

pub mod candidates;
pub mod fleet;
pub mod no_match;
pub mod outcomes;
pub mod pools;
pub mod retry_after;
pub mod sessions;
pub mod spend;
pub mod tenants;
pub mod tokens;
pub mod traffic;
pub mod watched_file;

pub use fleet::Fleet;
