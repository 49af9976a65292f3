//! The HTTP client tests and benches call the binary's servers with.

use std::time::Duration;

/// How long a connection may sit idle in the client's pool: less than the servers' 5 s
/// keep-alive (actix-web's default), so the client never sends on a connection the server is
/// closing at that instant, which fails the request before it is sent (`IncompleteMessage`).
pub const POOL_IDLE: Duration = Duration::from_secs(2);

/// A client builder with the pool's idle timeout set, for clients that need more settings.
pub fn builder() -> reqwest::ClientBuilder {
    reqwest::Client::builder().pool_idle_timeout(POOL_IDLE)
}

/// A client with nothing else set.
pub fn client() -> reqwest::Client {
    builder().build().expect("an HTTP client")
}
