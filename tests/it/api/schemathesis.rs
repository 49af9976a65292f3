//! The API contract, judged from outside: schemathesis (PyPI, the version pinned below and
//! installed by `.ci/run`) runs every check it has (`--checks all`, less `use_after_free`)
//! against the real `proxy-operator standalone` binary and the document it serves at
//! `/v1/openapi.json`, with the bearer token, including the stateful phase that follows the
//! document's links from an acquire to reading, renewing, reporting on and releasing the lease.
//! 20 External proxies behind two real squids are healthy, with room for every lease the run
//! takes, so acquires are granted rather than all answered 409. Two tenants are configured
//! (`--tenants-file`), and the run calls as one of them: its scope holds the 20 proxies, the
//! other's none of them.
//!
//! `use_after_free` is the one check left out, by design: a released lease stays readable
//! (`GET /v1/leases/{id}` answers 200 with `state: released`) through the cooldown window so
//! that a late report still lands, where the check expects a 404 after the DELETE. The other
//! settings are in `tests/schemathesis.toml`, each explained there.
//!
//! Without schemathesis the test prints how to install it and passes as skipped, except when
//! `CI` is set: then it fails.

use crate::support;

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use support::skip::skip;
use support::standalone::{ExternalProxy, Standalone};
use support::{Squid, Target};

/// The schemathesis release this test is written against (`.ci/run` installs it).
const SCHEMATHESIS_VERSION: &str = "4.32.5";

/// How to install it.
const INSTALL: &str = "pip install schemathesis==4.32.5";

const TOKEN: &str = "schemathesis-token-0123456789abcdef";

/// The token of the tenant the run calls as.
const TENANT_TOKEN: &str = "schemathesis-tenant-token-0123456789";

/// The tenants: `crawlers` (the run's, scoped to the proxies' label, with quotas far above
/// what the run takes) and `others`, scoped to a namespace holding none of them.
fn tenants_file() -> String {
    let digest = |token: &str| -> String {
        use sha2::Digest as _;
        sha2::Sha256::digest(token.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    };
    format!(
        "tenants:
  - name: crawlers
    tokens: [\"sha256:{}\"]
    scope: {{selector: {{pool: schemathesis}}}}
    quotas: {{leases: 1000000, sessions: 1000, acquiresPerSecond: 100000, burst: 100000}}
  - name: others
    tokens: [\"sha256:{}\"]
    scope: {{namespaces: [elsewhere]}}
    quotas: {{leases: 1}}
",
        digest(TENANT_TOKEN),
        digest("schemathesis-other-token-0123456789")
    )
}

/// Healthy proxies the run needs (several per squid).
const PROXIES: usize = 20;

/// Test cases per operation (`--max-examples`).
const MAX_EXAMPLES: &str = "300";

/// Longest the run may take before it is killed (it takes well under a minute here).
const RUN_DEADLINE: Duration = Duration::from_secs(600);

/// Checks that must have judged responses: `--checks all` less `use_after_free`, those that
/// apply to this API (object-level authorization and the response-time limit need settings
/// this run does not give, and pass without judging).
const CHECKS_THAT_MUST_RUN: [&str; 12] = [
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
    "positive_data_acceptance",
    "missing_required_header",
    "unsupported_method",
    "allow_header_conformance",
    "ensure_resource_availability",
    "ignored_auth",
];

/// A command line that runs schemathesis, and the version it reports.
struct Schemathesis {
    program: String,
    args: Vec<String>,
    version: String,
}

/// Finds schemathesis: the `schemathesis` or `st` console script pip installs (a pyenv shim
/// appears only after `pyenv rehash`), else the package through `python3 -m
/// schemathesis.cli` (the package itself has no `__main__`, so `-m schemathesis` does not
/// run). The first one whose `--version` answers wins.
fn find_schemathesis() -> Option<Schemathesis> {
    let candidates: [(&str, &[&str]); 4] = [
        ("schemathesis", &[]),
        ("st", &[]),
        ("python3", &["-m", "schemathesis.cli"]),
        ("python", &["-m", "schemathesis.cli"]),
    ];
    candidates.into_iter().find_map(|(program, args)| {
        let output = Command::new(program)
            .args(args)
            .arg("--version")
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&output.stdout);
        // "st, version 4.32.5" / "python -m schemathesis.cli, version 4.32.5"
        let version = text.rsplit_once("version ")?.1.trim().to_owned();
        output.status.success().then(|| Schemathesis {
            program: program.to_owned(),
            args: args.iter().map(|a| (*a).to_owned()).collect(),
            version,
        })
    })
}

/// What a run left: its exit status, its report on stdout, and its events (one JSON object a
/// line, `--report ndjson`).
struct Run {
    status: ExitStatus,
    stdout: String,
    events: String,
}

/// Runs schemathesis against the API at `api`, in `dir` (where its output and any file it
/// writes land), killing it after [`RUN_DEADLINE`].
fn run(st: &Schemathesis, api: &str, dir: &Path) -> Run {
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/schemathesis.toml");
    let stdout_path = dir.join("schemathesis.out");
    let events_path = dir.join("events.ndjson");
    let stdout = std::fs::File::create(&stdout_path).expect("create schemathesis.out");
    let mut child = Command::new(&st.program)
        .args(&st.args)
        .arg("--config-file")
        .arg(config)
        .arg("--no-color")
        .arg("run")
        .arg(format!("{api}/v1/openapi.json"))
        .args(["--header", &format!("Authorization: Bearer {TENANT_TOKEN}")])
        .args(["--checks", "all", "--exclude-checks", "use_after_free"])
        .args(["--max-examples", MAX_EXAMPLES])
        .args(["--report", "ndjson", "--report-ndjson-path"])
        .arg(&events_path)
        .current_dir(dir)
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(stdout.try_clone().expect("share schemathesis.out"))
        .stderr(stdout)
        .spawn()
        .expect("start schemathesis");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for schemathesis") {
            break status;
        }
        if started.elapsed() > RUN_DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "schemathesis still running after {RUN_DEADLINE:?}; its output:\n{}",
                std::fs::read_to_string(&stdout_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    Run {
        status,
        stdout: std::fs::read_to_string(&stdout_path).unwrap_or_default(),
        events: std::fs::read_to_string(&events_path).unwrap_or_default(),
    }
}

/// The block schemathesis ends its report with (operations, phases, failures, test cases).
fn summary(stdout: &str) -> &str {
    stdout
        .rfind("SUMMARY")
        .and_then(|i| stdout[..i].rfind('\n').map(|line| &stdout[line + 1..]))
        .unwrap_or(stdout)
}

/// How often each check passed and failed over every test case of the run.
fn check_counts(events: &str) -> BTreeMap<String, (u64, u64)> {
    let mut counts: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for line in events.lines() {
        let Ok(event) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        let Some(cases) = event["ScenarioFinished"]["recorder"]["checks"].as_object() else {
            continue;
        };
        for check in cases.values().filter_map(Value::as_array).flatten() {
            let name = check["name"].as_str().unwrap_or("?").to_owned();
            let entry = counts.entry(name).or_default();
            match check["status"].as_str() {
                Some("success") => entry.0 += 1,
                Some("failure") => entry.1 += 1,
                _ => {}
            }
        }
    }
    counts
}

/// `N` of schemathesis's "API Links: N covered / ..." line: links the stateful phase followed.
fn links_covered(stdout: &str) -> Option<u32> {
    let line = stdout.lines().find(|l| l.contains("API Links:"))?;
    line.split("API Links:")
        .nth(1)?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Writes past the test harness's capture, so the summary shows in `cargo test` output also
/// when the test passes.
fn show(text: &str) {
    let _ = std::io::stderr().write_all(text.as_bytes());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_nothing_with_every_check() {
    let Some(st) = find_schemathesis() else {
        skip(format!(
            "schemathesis is not installed; install it with `{INSTALL}` (then `pyenv rehash` \
             under pyenv)"
        ));
        return;
    };
    if st.version != SCHEMATHESIS_VERSION {
        assert!(
            std::env::var_os("CI").is_none(),
            "schemathesis {} found, {SCHEMATHESIS_VERSION} expected: `{INSTALL}`",
            st.version
        );
        show(&format!(
            "note: schemathesis {} found; this test is written against {SCHEMATHESIS_VERSION} \
             (`{INSTALL}`)\n",
            st.version
        ));
    }

    let target = Target::start();
    let squids = [Squid::start(), Squid::start()];
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = dir.path().join("probe-ca.pem");
    std::fs::write(&ca, target.ca_cert_pem()).expect("write the probe CA");
    let proxies: Vec<ExternalProxy> = (0..PROXIES)
        .map(|i| ExternalProxy {
            name: format!("st-{i:02}"),
            labels: vec![("pool".into(), "schemathesis".into())],
            host: "127.0.0.1".into(),
            port: squids[i % squids.len()].port(),
            // Far more than the run takes: acquires are granted, not refused for capacity.
            max_leases: 1_000_000,
            probe_url: target.https_url(),
            interval: "2s",
            // One cordoned proxy: listed with `cordoned: true`, never leased.
            cordoned: i == 0,
            socks5: false,
            credentials: None,
            cost: None,
        })
        .collect();
    let tenants = dir.path().join("tenants.yaml");
    std::fs::write(&tenants, tenants_file()).expect("write the tenants file");
    let tenants_arg = tenants.to_str().expect("a UTF-8 temp path");
    let mut operator = Standalone::start(
        dir.path(),
        &proxies,
        &ca,
        TOKEN,
        &["--tenants-file", tenants_arg],
    );
    operator
        .wait_healthy(TENANT_TOKEN, PROXIES, Duration::from_secs(90))
        .await;

    let api = operator.api().to_owned();
    let work = dir.path().to_owned();
    let started = Instant::now();
    let run = tokio::task::spawn_blocking(move || run(&st, &api, &work))
        .await
        .expect("schemathesis thread");
    let took = started.elapsed();
    if !run.status.success() {
        show(&run.stdout);
    }
    assert!(
        run.status.success(),
        "schemathesis found failures ({}); its report is above",
        run.status
    );

    let counts = check_counts(&run.events);
    let mut table = String::new();
    for (name, (passed, failed)) in &counts {
        table.push_str(&format!(
            "  {name:<30} {passed:>7} passed {failed:>4} failed\n"
        ));
    }
    let passed: u64 = counts.values().map(|c| c.0).sum();
    let links = links_covered(&run.stdout);
    show(&format!(
        "schemathesis {SCHEMATHESIS_VERSION} against proxy-operator standalone ({PROXIES} \
         proxies, two tenants), {:.0} s, {passed} checks passed, {} API links covered by the stateful phase:\n\
         {table}{}\n",
        took.as_secs_f64(),
        links.map_or_else(|| "?".to_owned(), |n| n.to_string()),
        summary(&run.stdout)
    ));
    // Not vacuous: every check judged responses, the excluded one never ran, and the stateful
    // phase followed the document's links from acquires to the operations on the lease.
    for check in CHECKS_THAT_MUST_RUN {
        assert!(
            counts.get(check).is_some_and(|c| c.0 > 0),
            "check {check} never ran: {counts:?}"
        );
    }
    assert!(!counts.contains_key("use_after_free"), "{counts:?}");
    assert!(
        links.is_some_and(|n| n >= 4),
        "the stateful phase covered {links:?} API links"
    );
    drop(operator);
}
