//! Python crawlers the tests drive (`tests/python/`, packages pinned in its
//! `requirements.txt`, installed by `.ci/run`).

use std::path::PathBuf;
use std::process::Command;

/// `python3` when it can import every module of `modules`; otherwise `None`, skipped (see
/// [`skip`](super::skip::skip)) saying how to install them.
pub fn python_with(modules: &[&str]) -> Option<&'static str> {
    let imports = modules.join(", ");
    let found = Command::new("python3")
        .args(["-c", &format!("import {imports}")])
        .output()
        .is_ok_and(|output| output.status.success());
    if found {
        return Some("python3");
    }
    super::skip::skip(format!(
        "python3 cannot import {imports}: python3 -m pip install -r tests/python/requirements.txt \
         -e 'clients/python[test]'"
    ));
    None
}

/// The path of script `name` in `tests/python/`.
pub fn script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/python")
        .join(name)
}
