//! What the Python client's Scrapy middleware costs a crawl: `clients/python/benches/crawl.py`
//! run against this (release) build of the binary — 2,000 loopback pages through the
//! middleware and the gateway against the same crawl on a fixed proxy list of the same squids,
//! same run. Fails when the pages/s ratio is below 0.8.
//!
//! Run with `cargo bench --bench scrapy` (needs squid, and the client installed:
//! `pip install -r tests/python/requirements.txt -e 'clients/python[test]'`).
//! `PROXY_OPERATOR_BENCH_PAGES` sets the crawl's length (default 2000).

use std::path::Path;
use std::process::{Command, ExitCode};

fn main() -> ExitCode {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("clients/python/benches/crawl.py");
    let status = Command::new("python3")
        .arg(&script)
        .env("PROXY_OPERATOR_BIN", env!("CARGO_BIN_EXE_proxy-operator"))
        .status();
    match status {
        Ok(status) if status.success() => ExitCode::SUCCESS,
        Ok(status) => {
            eprintln!("the Scrapy bench failed ({status})");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("cannot run python3 {}: {e}", script.display());
            ExitCode::FAILURE
        }
    }
}
