//! HTTP load from outside with `wrk` (Debian package `wrk`) for the benches: a Lua script in
//! `benches/wrk/` prints one `WRK_RESULT key=value ...` line that [`WrkResult`] reads.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// One `WRK_RESULT` line of the Lua scripts, as key=value pairs.
#[derive(Debug, Default, Clone)]
pub struct WrkResult {
    fields: Vec<(String, u64)>,
    /// The `WRK_FIRST_FAILURE` line, if the script printed one.
    pub first_failure: Option<String>,
}

impl WrkResult {
    fn parse(stdout: &str) -> Option<WrkResult> {
        let line = stdout.lines().find_map(|l| l.strip_prefix("WRK_RESULT "))?;
        let fields = line
            .split_whitespace()
            .filter_map(|kv| {
                let (k, v) = kv.split_once('=')?;
                Some((k.to_owned(), v.parse().ok()?))
            })
            .collect();
        let first_failure = stdout
            .lines()
            .find_map(|l| l.strip_prefix("WRK_FIRST_FAILURE "))
            .map(str::to_owned);
        Some(WrkResult {
            fields,
            first_failure,
        })
    }

    /// Several runs side by side (one wrk per replica) as one: counts add up; durations and
    /// latency percentiles are the largest of the runs' (an upper bound of the combined one).
    pub fn combined(runs: &[WrkResult]) -> WrkResult {
        let mut fields: Vec<(String, u64)> = Vec::new();
        for run in runs {
            for (key, value) in &run.fields {
                let largest = key.ends_with("_us");
                match fields.iter_mut().find(|(k, _)| k == key) {
                    Some((_, total)) if largest => *total = (*total).max(*value),
                    Some((_, total)) => *total += value,
                    None => fields.push((key.clone(), *value)),
                }
            }
        }
        WrkResult {
            fields,
            first_failure: runs.iter().find_map(|r| r.first_failure.clone()),
        }
    }

    /// A field (0 when absent).
    pub fn get(&self, key: &str) -> u64 {
        self.fields
            .iter()
            .find(|(k, _)| k == key)
            .map_or(0, |(_, v)| *v)
    }

    /// How long the run took.
    pub fn seconds(&self) -> f64 {
        self.get("duration_us") as f64 / 1e6
    }

    /// Requests answered per second.
    pub fn rate(&self) -> f64 {
        self.get("requests") as f64 / self.seconds().max(1e-9)
    }

    /// The 99th percentile latency.
    pub fn p99(&self) -> Duration {
        Duration::from_micros(self.get("p99_us"))
    }

    /// Failed answers and socket errors.
    pub fn errors(&self) -> u64 {
        self.get("failed") + self.get("socket_errors")
    }
}

/// Whether `wrk` runs here (else the bench says how to install it).
pub fn installed() -> bool {
    Command::new("wrk").arg("--version").output().is_ok()
}

/// Runs `wrk -t{threads} -c{connections}` for `duration` with `benches/wrk/{script}` against
/// `url`, passing `args` to the script; returns its result line.
pub fn run(
    script: &str,
    url: &str,
    (threads, connections): (u32, u32),
    duration: Duration,
    args: &[&str],
) -> WrkResult {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("benches/wrk")
        .join(script);
    let output = Command::new("wrk")
        .args([
            format!("-t{threads}"),
            format!("-c{connections}"),
            format!("-d{}s", duration.as_secs().max(1)),
            "--timeout".to_owned(),
            "10s".to_owned(),
        ])
        .arg("-s")
        .arg(&script)
        .arg(url)
        .arg("--")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run wrk ({e}); install it: apt-get install -y wrk"));
    let stdout = String::from_utf8_lossy(&output.stdout);
    match WrkResult::parse(&stdout) {
        Some(result) if output.status.success() => result,
        _ => panic!(
            "wrk failed ({}):\n{stdout}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        ),
    }
}

/// User + system CPU seconds process `pid` has used so far (0 once it is gone).
pub fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the parenthesised command name; utime and stime are the 14th and 15th.
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return 0.0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = [11, 12]
        .iter()
        .filter_map(|&i| fields.get(i).and_then(|f| f.parse::<u64>().ok()))
        .sum();
    // The kernel's USER_HZ is 100 on every Linux this runs on.
    ticks as f64 / 100.0
}
