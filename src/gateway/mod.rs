//! The crawler gateway (`--gateway-addr`, default `:8888`): one forward-proxy address any HTTP
//! client can use (curl, requests, Scrapy, Playwright), which leases an upstream proxy for the
//! crawler. It serves HTTP/1.1 `CONNECT host:port` tunnels and absolute-form requests
//! (`GET http://…`), keeps client connections alive, and reads the same inventory, health
//! snapshot and ledger as the lease API (parsing is hyper's; tunnels are byte copies).
//!
//! - **Who**: `Proxy-Authorization: Basic` whose password is an API token; the user part holds
//!   the options (`user`): a crawler name, `session`, `sessionTTL` and selector labels.
//! - **Which upstream** (`choice`, the [`Gateway`] every `connection` shares): a lease through the ledger, with the API's selection rules,
//!   for the target (the CONNECT host or the request's host): one per client connection and
//!   target, released when the connection closes; or one per (token, session), kept while its
//!   proxy stays usable for the target and moved (said in `X-Proxy-Session-Moved`) when not.
//! - **Failures** (`tunnel`, `forward`): an upstream that refuses, times out or answers the
//!   CONNECT with a non-2xx is reported `error` and another proxy is tried (`--gateway-retries`);
//!   then `502` saying what was tried. No usable proxy: `503` with `Retry-After`.
//! - **Bans** (`bans`): on plain HTTP, a target status in the ban rule is reported for that
//!   (proxy, target), cooling it down for as long as the target's `Retry-After` asks.
//! - **Waking pools** (`hold`): a request refused because the ProxyPool it would be served by
//!   has no Ready member is held, connection open, until one is (at most the pool's
//!   `wakeTimeout`), then relayed; its refusal is recorded as the pool's demand.
//! - **Drains** (`upstream`): a draining or deleted proxy's idle upstream connections are

mod accounting;
mod answers;
mod ask;
mod auth;
mod bans;
mod choice;
mod config;
mod connection;
mod drain;
mod hold;
pub mod intercept;
mod limits;
mod metrics;
pub mod rules;
mod server;
mod timeouts;
mod upstream;
pub mod user;

pub use accounting::FLUSH_INTERVAL;
pub use answers::{
    BAN_REPORTED_HEADER, Body, DESTINATION_NOT_ALLOWED, DESTINATION_UNRESOLVABLE,
    PROXY_LEASE_HEADER, PROXY_NAME_HEADER, PROXY_STATUS, RequestOutcome, SESSION_MOVED_HEADER,
    TOO_MANY_CONNECTIONS,
};
pub use bans::BanRule;
pub use choice::Gateway;
pub use config::GatewayConfig;
pub use metrics::GatewayMetrics;
pub use server::serve;
pub use timeouts::Timeouts;
