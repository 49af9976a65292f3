//! Headless Chromium as a real browser in the tests: Debian's `chromium` driven by Playwright
//! scripts in `tests/python/browser/` (their shared module `chromium.py` launches it), each
//! given its config as JSON on stdin and printing its result as JSON on its last stdout line.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::AsyncWriteExt;

/// How to get what the browser tests need.
pub const HOW_TO_INSTALL: &str = "apt-get install -y chromium chromium-driver and python3 -m pip \
     install -r tests/python/requirements.txt (Playwright; never `playwright install`: the tests \
     launch /usr/bin/chromium)";

/// How long one script may take: a browser start and a few page loads on a loaded machine.
pub const SCRIPT_DEADLINE: Duration = Duration::from_secs(180);

/// Chromium's executable (`$CHROMIUM`, else `/usr/bin/chromium`) when it runs and Python can
/// import Playwright to drive it; otherwise `None`, skipped (see [`skip`](super::skip::skip))
/// saying how to install them.
pub fn chromium() -> Option<PathBuf> {
    let executable = std::env::var_os("CHROMIUM")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/chromium"));
    let runs = std::process::Command::new(&executable)
        .arg("--version")
        .output()
        .is_ok_and(|output| output.status.success());
    if !runs {
        super::skip::skip(format!(
            "{} does not run. Install it: {HOW_TO_INSTALL}",
            executable.display()
        ));
        return None;
    }
    super::python::python_with(&["playwright"])?;
    Some(executable)
}

/// Runs `python3 tests/python/browser/<name>` with `config` as JSON on stdin and returns the JSON of its last stdout line. Panics, with
/// the script's stdout and stderr, when it exits non-zero, prints no JSON last, or is still
/// running after [`SCRIPT_DEADLINE`] (then it is killed). Async, so servers on the test's own
/// runtime keep serving the browser meanwhile.
pub async fn run_script(name: &str, config: &Value) -> Value {
    let script = super::python::script(&format!("browser/{name}"));
    let mut command = tokio::process::Command::new("python3");
    command
        .arg(&script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = command
        .spawn()
        .unwrap_or_else(|e| panic!("start python3 {}: {e}", script.display()));
    let mut stdin = child.stdin.take().expect("a piped stdin");
    stdin
        .write_all(config.to_string().as_bytes())
        .await
        .unwrap_or_else(|e| panic!("write the config of {name}: {e}"));
    drop(stdin);
    let output = tokio::time::timeout(SCRIPT_DEADLINE, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("{name} still ran after {SCRIPT_DEADLINE:?}; killed it"))
        .unwrap_or_else(|e| panic!("wait for {name}: {e}"));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let result = stdout
        .lines()
        .rev()
        .find(|line| !line.trim().is_empty())
        .and_then(|line| serde_json::from_str(line).ok());
    match result {
        Some(result) if output.status.success() => result,
        _ => panic!(
            "{name} failed ({}) with config {config}\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}",
            output.status
        ),
    }
}

/// axe-core's `axe.min.js` (npm, `tests/js/package.json`, installed by `.ci/run` with
/// `npm ci --prefix tests/js`) when installed; otherwise `None`, skipped saying how.
pub fn axe_core() -> Option<PathBuf> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/js/node_modules/axe-core/axe.min.js");
    if path.is_file() {
        return Some(path);
    }
    super::skip::skip(format!(
        "{} is missing: npm ci --prefix tests/js",
        path.display()
    ));
    None
}
