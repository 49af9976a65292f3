//! The Python client's own tests (`clients/python/tests`, pytest) against this build of the
//! binary: the client and the Scrapy middleware driven through real squids and the real
//! `proxy-operator standalone`, so `cargo test` runs them with everything else.

use std::path::PathBuf;
use std::process::Command;

use crate::support::python::python_with;
use crate::support::skip::skip;

#[test]
fn the_python_client_and_its_scrapy_middleware_pass_their_tests() {
    let Some(python) = python_with(&["pytest", "httpx", "scrapy", "proxy_operator"]) else {
        return;
    };
    let package = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("clients/python");
    let output = Command::new(python)
        .args(["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-x"])
        .arg(&package)
        .current_dir(&package)
        .env("PROXY_OPERATOR_BIN", env!("CARGO_BIN_EXE_proxy-operator"))
        .output()
        .expect("run pytest");
    let report = format!(
        "{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "pytest failed:\n{report}");
    eprintln!("{report}");
    // `-rs` lists each skipped pytest test as a `SKIPPED [n] file:line: reason` line.
    let skipped: Vec<&str> = report
        .lines()
        .filter(|line| line.starts_with("SKIPPED "))
        .collect();
    if !skipped.is_empty() {
        skip(format!(
            "pytest skipped some of its tests: {}",
            skipped.join("; ")
        ));
    }
}
