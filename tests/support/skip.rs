//! The one rule for a test that cannot run here for want of a tool or a privilege: with `CI`
//! set it fails (CI installs everything, so a missing one is a broken install); otherwise it
//! passes as skipped. `cargo test` hides a passing test's output, so each skip is also
//! remembered, and the integration-test binary lists them all when it exits
//! ([`forget_previous`] at its start, [`report`] at its exit), on stderr and in
//! `target/skipped-tests.txt`.

use std::fmt::Display;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

/// One skip: the test's name (its libtest path, e.g. `ledger::bound::…`) and why.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Skip {
    pub test: String,
    pub reason: String,
}

/// Every skip of this process so far.
static SKIPPED: Mutex<Vec<Skip>> = Mutex::new(Vec::new());

/// Skips the current test for `reason` (what is missing and how to get it): panics with it
/// when `CI` is set; otherwise prints `skipped: <reason>` and records it for the list at exit.
/// The caller then returns early.
#[track_caller]
pub fn skip(reason: impl Display) {
    let reason = reason.to_string();
    assert!(
        std::env::var_os("CI").is_none(),
        "{reason} (CI is set, so this fails the test instead of skipping it)"
    );
    eprintln!("skipped: {reason}");
    let test = current_test();
    SKIPPED
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push(Skip { test, reason });
}

/// The running test's name: libtest runs each test on a thread named after it.
fn current_test() -> String {
    match std::thread::current().name() {
        Some(name) if name != "main" => name.to_owned(),
        Some(_) | None => "(a test on an unnamed thread)".to_owned(),
    }
}

/// `skipped-tests.txt` in the target directory (the parent of this build's
/// `CARGO_TARGET_TMPDIR`).
pub fn list_path() -> PathBuf {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    tmp.parent().unwrap_or(tmp).join("skipped-tests.txt")
}

/// Removes the list an earlier run left, so a crashed or skip-free run leaves no stale one.
pub fn forget_previous() {
    let _ = std::fs::remove_file(list_path());
}

/// The list's lines for `skips`: a heading counting the tests, then `  <test>: <reason>` per
/// distinct skip, sorted, each reason on one line and cut to its first sentence, so a hundred
/// tests skipped for one reason stay readable; each reason that was cut follows once in full,
/// under `How to run them:`. Empty when nothing was skipped.
pub fn summary(skips: &[Skip]) -> Vec<String> {
    let mut skips: Vec<Skip> = skips
        .iter()
        .map(|skip| Skip {
            test: skip.test.clone(),
            reason: skip.reason.split_whitespace().collect::<Vec<_>>().join(" "),
        })
        .collect();
    skips.sort();
    skips.dedup();
    if skips.is_empty() {
        return Vec::new();
    }
    let mut tests: Vec<&str> = skips.iter().map(|skip| skip.test.as_str()).collect();
    tests.dedup();
    let count = match tests.len() {
        1 => "1 test".to_owned(),
        n => format!("{n} tests"),
    };
    let mut lines = vec![format!("{count} skipped for a missing tool or privilege:")];
    let mut cut: Vec<&str> = Vec::new();
    for skip in &skips {
        let reason = match skip.reason.split_once(". ") {
            Some((first, _)) => {
                if !cut.contains(&skip.reason.as_str()) {
                    cut.push(&skip.reason);
                }
                format!("{first}.")
            }
            None => skip.reason.clone(),
        };
        lines.push(format!("  {}: {reason}", skip.test));
    }
    if !cut.is_empty() {
        lines.push("How to run them:".to_owned());
        lines.extend(cut.iter().map(|reason| format!("  {reason}")));
    }
    lines
}

/// Prints this process's skips to stderr (past the test harness's capture) and writes them to
/// [`list_path`]; with none, prints nothing and leaves no list. Never panics: it runs at exit.
pub fn report() {
    let skips = std::mem::take(&mut *SKIPPED.lock().unwrap_or_else(PoisonError::into_inner));
    let lines = summary(&skips);
    let path = list_path();
    if lines.is_empty() {
        let _ = std::fs::remove_file(&path);
        return;
    }
    let text = lines.join("\n") + "\n";
    let written = match std::fs::write(&path, &text) {
        Ok(()) => format!("(this list is in {})\n", path.display()),
        Err(e) => format!("(cannot write this list to {}: {e})\n", path.display()),
    };
    let _ = std::io::stderr().write_all(format!("\n{text}{written}").as_bytes());
}

#[cfg(test)]
mod tests {
    use super::{Skip, summary};

    fn skip(test: &str, reason: &str) -> Skip {
        Skip {
            test: test.to_owned(),
            reason: reason.to_owned(),
        }
    }

    #[test]
    fn the_list_counts_tests_sorts_drops_repeats_and_gives_a_long_reason_once() {
        const ASSETS: &str = "No assets. Get them: `setup-envtest use 1.28.x`.";
        let lines = summary(&[
            skip("b::second", "no promtool\n  (apt-get install prometheus)"),
            skip("a::first", ASSETS),
            skip("b::second", "no promtool (apt-get install prometheus)"),
            skip("a::first", "not root"),
            skip("c::third", ASSETS),
        ]);
        assert_eq!(
            lines,
            [
                "3 tests skipped for a missing tool or privilege:",
                "  a::first: No assets.",
                "  a::first: not root",
                "  b::second: no promtool (apt-get install prometheus)",
                "  c::third: No assets.",
                "How to run them:",
                &format!("  {ASSETS}"),
            ]
        );
    }

    #[test]
    fn one_skip_is_one_test_and_none_is_no_list() {
        assert_eq!(
            summary(&[skip("only", "why")]),
            [
                "1 test skipped for a missing tool or privilege:",
                "  only: why"
            ]
        );
        assert!(summary(&[]).is_empty());
    }
}
