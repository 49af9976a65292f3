//! The install as a user renders it: `kubectl kustomize` of a copy of `manifests/` (with the
//! token file the README tells users to create) and `helm template` of `charts/proxy-operator/`,
//! each parsed into one JSON value per object.
//!
//! `kubectl` (1.31) and `helm` (3.17) are installed by `.ci/run`; without them a test is
//! skipped, unless `CI` is set, where a missing tool fails it.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use tempfile::TempDir;

/// The repository root.
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `tool` (`kubectl`, `helm`) when `<tool> version --client` runs; see
/// [`required_tool`](super::required_tool).
pub fn tool(tool: &'static str) -> Option<&'static str> {
    super::required_tool(
        tool,
        &["version", "--client"],
        ".ci/run installs the pinned one",
    )
}

/// Parses a multi-document YAML stream, skipping empty documents.
pub fn parse_objects(yaml: &str) -> Vec<Value> {
    let docs: Vec<Value> = serde_saphyr::from_multiple(yaml)
        .unwrap_or_else(|e| panic!("rendered YAML does not parse: {e}\n{yaml}"));
    docs.into_iter().filter(|doc| !doc.is_null()).collect()
}

/// Runs `command`, panicking with its stderr when it fails; returns its stdout.
pub fn run(command: &mut Command) -> String {
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("{command:?}: {e}"));
    assert!(
        output.status.success(),
        "{command:?} failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("UTF-8 output")
}

/// A temp copy of `manifests/` with `discovery-tokens` holding `token`, as the README's install
/// step leaves it, beside a copy of the chart's `dashboards/`, which `manifests/monitoring/`
/// includes. Edit files in [`Manifests::dir`] to try a broken install.
pub struct Manifests {
    /// Holds both copies; removed on drop.
    root: TempDir,
    dir: PathBuf,
}

impl Manifests {
    pub fn copy(token: &str) -> Self {
        let root = tempfile::tempdir().expect("a temp dir");
        let dir = root.path().join("manifests");
        for (from, to) in [
            (repo().join("manifests"), dir.clone()),
            (
                chart().join("dashboards"),
                root.path().join("charts/proxy-operator/dashboards"),
            ),
        ] {
            std::fs::create_dir_all(&to).expect("create a directory");
            copy_dir(&from, &to);
        }
        std::fs::write(dir.join("discovery-tokens"), format!("{token}\n"))
            .expect("write discovery-tokens");
        Manifests { root, dir }
    }

    /// The copy of `manifests/`.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `kubectl kustomize` of the copy, or `None` when kubectl is missing (outside CI).
    pub fn kustomize(&self) -> Option<Vec<Value>> {
        self.kustomize_at("")
    }

    /// `kubectl kustomize` of a directory of the copy (e.g. `monitoring`), or `None` when
    /// kubectl is missing (outside CI).
    pub fn kustomize_at(&self, relative: &str) -> Option<Vec<Value>> {
        let kubectl = tool("kubectl")?;
        let yaml = run(Command::new(kubectl)
            .arg("kustomize")
            .arg(self.dir().join(relative)));
        Some(parse_objects(&yaml))
    }
}

fn copy_dir(from: &Path, to: &Path) {
    for entry in std::fs::read_dir(from).unwrap_or_else(|e| panic!("{}: {e}", from.display())) {
        let entry = entry.expect("a directory entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("its type").is_dir() {
            std::fs::create_dir_all(&target).expect("create a directory");
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copy a file");
        }
    }
}

/// `helm template <release> charts/proxy-operator --namespace <namespace> <args…>` (e.g.
/// `--set key=value`), or `None` when helm is missing (outside CI).
pub fn helm_template(release: &str, namespace: &str, args: &[&str]) -> Option<Vec<Value>> {
    let yaml = run(&mut helm_template_command(release, namespace, args)?);
    Some(parse_objects(&yaml))
}

/// The error `helm template` (as [`helm_template`]) prints for values the chart refuses;
/// panics when it renders. `None` when helm is missing (outside CI).
pub fn helm_template_error(release: &str, namespace: &str, args: &[&str]) -> Option<String> {
    let mut command = helm_template_command(release, namespace, args)?;
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("{command:?}: {e}"));
    assert!(!output.status.success(), "{command:?} rendered");
    Some(String::from_utf8_lossy(&output.stderr).into_owned())
}

fn helm_template_command(release: &str, namespace: &str, args: &[&str]) -> Option<Command> {
    let mut command = Command::new(tool("helm")?);
    command
        .args(["template", release])
        .arg(chart())
        .args(["--namespace", namespace, "--include-crds"])
        .args(args);
    Some(command)
}

/// `charts/proxy-operator/`.
pub fn chart() -> PathBuf {
    repo().join("charts/proxy-operator")
}

/// `helm <args…>` (e.g. `lint <chart> --strict`), its output, panicking when it fails; `None`
/// when helm is missing (outside CI).
pub fn helm<S: AsRef<std::ffi::OsStr>>(args: impl IntoIterator<Item = S>) -> Option<String> {
    Some(run(Command::new(tool("helm")?).args(args)))
}
