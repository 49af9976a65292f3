//! Lease API throughput of the real binary, measured from outside with `wrk`: the release
//! `proxy-operator standalone` with 1,000 External proxies over two real squids (all made
//! healthy before measuring) and `--ledger-durability normal`, driven by
//! `wrk -t2 -c32 -s benches/wrk/lease_pairs.lua` (each connection alternates an acquire and
//! the release of the lease it got), then by the same wrk settings on `GET /healthz` as the
//! framework floor. Prints acquire+release pairs/s, /healthz req/s, their ratio, the p99
//! latency, the operator's CPU per pair and the ledger's writes per batch (from its metrics,
//! over every replica; `-` for a binary without them) per run in one table, and exits non-zero when a run
//! answers anything but 201/204 (200 for /healthz) or misses the target (pair p99 < 10 ms).
//! The ratio to `/healthz` is printed, not a target: even a ledger that persists nothing
//! reaches only about 0.28 of the framework's floor, and crawlers feel latency at the load
//! they offer (the open-loop part below), not the breaking point.
//!
//! Then the same with a tenants file (`--tenants-file`: ten tenants, each with a scope and
//! quotas the run stays under), wrk calling as one of them, twice, then once more without
//! (with and without in the order A B B A): target, the mean with at least 0.9 × the mean
//! without (`tenants` rows). The PostgreSQL rows add the conflicts per pair (acquires decided
//! again, transactions retried) over every replica.
//!
//! Then, when PostgreSQL is installed (`apt-get install -y postgresql`), the same on a
//! PostgreSQL ledger (a server of the bench's own on loopback): one replica, and three
//! replicas over one database and one inventory with the 32 connections spread over them (one
//! wrk per replica; the p99 shown is the largest of the three). Targets there: one replica at
//! least 0.3 × the SQLite pairs/s, pair p99 < 25 ms. For scale, one row runs three replicas
//! with the tenants file, every connection's tenant having a quota, so every batch locks that
//! tenant's row (`pg×3 tenant`), and a last one runs one replica on a database with
//! `synchronous_commit = off` (`pg unsync`, with an open-loop run as well).
//!
//! Run with `cargo bench --bench api` (needs `wrk` and `squid`: `apt-get install -y wrk
//! squid`). Environment:
//! - `PROXY_OPERATOR_BENCH_BINARY`: the binary to measure (default: this build's).
//! - `PROXY_OPERATOR_BENCH_BASELINE`: another binary (e.g. one built from an older commit)
//!   measured the same way, before and after the first, for a before/after table.
//! - `PROXY_OPERATOR_BENCH_SECONDS`: length of each measured wrk run (default 10).
//! - `PROXY_OPERATOR_BENCH_CONNECTIONS`: wrk's connections, spread over the replicas
//!   (default 32). A replica's batch holds at most what its connections have in flight, so
//!   this is what sets the batches' size, and with it the database's cost per pair.
//! - `PROXY_OPERATOR_BENCH_LOG`: the binary's `RUST_LOG` (default `info`, the shipped
//!   default: one log line per request, written to a file).
//! - `PROXY_OPERATOR_BENCH_PARTS`: which runs besides the first SQLite one, comma-separated
//!   (default `sqlite,tenants,postgres`; `sqlite` alone measures the SQLite and baseline runs).
//!
//! **Latency at a given load**: after the saturated runs of `this` (SQLite) and `postgres`
//! (one replica), the same binary is offered a third of the pairs/s it reached, for
//! `PROXY_OPERATOR_BENCH_OPEN_SECONDS` (default 20), by an open-loop client
//! (`tests/support/open_loop.rs`: each request's latency from when it was due, as wrk2
//! counts it): p50, p99, p99.9 and max per request, in `PROXY_OPERATOR_BENCH_OPEN_ROUNDS`
//! (default 3) rounds, each followed by the HTTP floor: `GET /healthz` offered the same
//! requests/s (two per pair) on as many connections, so the tail is held against what the same
//! machine gives any route at that moment. Targets: SQLite p99 < 5 ms and p99.9 < 25 ms, and at
//! most 3 × the floor's p99 and 5 × its p99.9; PostgreSQL p99 < 10 ms; no errors. A baseline binary gets the same open-loop run. Below
//! each SQLite open-loop row, the writer's batch, commit and checkpoint times over the run
//! (from its `proxy_operator_ledger_*_seconds` histograms) show what the tail waited behind;
//! below the PostgreSQL one, the database server's checkpoints that started during the run
//! and the fsync time of those that ended in it (`pg_stat_bgwriter`; a checkpoint spreads its
//! writes over minutes, so one started before the run can still be writing in it), whose
//! fsyncs commits waiting for their WAL flush can queue behind.
//!
//! Everything shares the machine: the operator, the squids, the probe target and wrk.

#[path = "../tests/support/mod.rs"]
mod support;

use std::ffi::OsString;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use support::open_loop::{self, OpenLoopResult};
use support::operator::metric_sum;
use support::postgres::Postgres;
use support::wrk::{self, WrkResult};
use support::{Squid, Target, free_port};

const PROXIES: usize = 1_000;
const SQUIDS: usize = 2;
const WRK_THREADS: u32 = 2;
const DEFAULT_CONNECTIONS: u32 = 32;
/// Leases a proxy grants at once: far above what 32 connections can hold, so no acquire is
/// refused for capacity.
const MAX_LEASES: u32 = 1_000;
const TOKEN: &str = "bench-token-0123456789abcdef";
const DEFAULT_SECONDS: u64 = 10;
/// A short unmeasured run first, so page cache, allocator and connection set-up are warm.
const WARM_UP: Duration = Duration::from_secs(2);
const HEALTHY_DEADLINE: Duration = Duration::from_secs(120);
const P99_TARGET: Duration = Duration::from_millis(10);
/// The share of a run's saturated pairs/s offered to it open-loop.
const OPEN_LOOP_SHARE: f64 = 1.0 / 3.0;
const DEFAULT_OPEN_SECONDS: u64 = 20;
/// Open-loop rounds (pairs, then the floor) per measurement.
const DEFAULT_OPEN_ROUNDS: usize = 3;
/// The lease pairs' latency against the floor's (`GET /healthz` at the same requests/s), at
/// most: p99 and p99.9.
const FLOOR_P99_RATIO: f64 = 3.0;
const FLOOR_P999_RATIO: f64 = 5.0;
/// Open-loop targets, per request, at a third of saturation.
const OPEN_P99_TARGET: Duration = Duration::from_millis(5);
const OPEN_P999_TARGET: Duration = Duration::from_millis(25);
const OPEN_POSTGRES_P99_TARGET: Duration = Duration::from_millis(10);
/// The run on a database with `synchronous_commit = off`: figures for scale, no targets.
const UNFLUSHED: &str = "pg unsync";
/// The run with a tenants file against the same run without.
const TENANTS_RATIO_TARGET: f64 = 0.9;
/// Tenants in the tenants file.
const TENANTS: usize = 10;
/// The token wrk calls with in the runs with a tenants file: the first tenant's.
const TENANT_TOKEN: &str = "bench-tenant-0-token-0123456789";
/// One PostgreSQL replica's pairs/s against the SQLite run's.
const POSTGRES_RATIO_TARGET: f64 = 0.3;
const POSTGRES_P99_TARGET: Duration = Duration::from_millis(25);

/// The figures of one binary.
#[derive(Debug, Clone)]
struct Figures {
    label: String,
    pairs: WrkResult,
    healthz: WrkResult,
    /// CPU seconds the operator used during the measured pair run.
    pairs_cpu: f64,
    /// Writes per ledger transaction during the pair run (`None`: a binary that does not
    /// export the writer's batch counters).
    writes_per_batch: Option<f64>,
    /// PostgreSQL: acquires decided again (or transactions retried) per pair, over every
    /// replica, during the pair run.
    conflicts_per_pair: Option<f64>,
    /// The open-loop rounds at a third of `pairs`, when they were asked for.
    open_loop: Vec<OpenRound>,
    /// The SQLite writer's histograms over the open-loop run (`None`: not asked for, or a
    /// ledger or binary without them).
    open_writer: Option<WriterTimes>,
    /// PostgreSQL: the database server's checkpoints over the open-loop run.
    open_database: Option<DatabaseCheckpoints>,
}

/// One open-loop round: the pairs, then the HTTP floor (`GET /healthz`) offered the same
/// requests/s (two per pair) on the same connections.
#[derive(Debug, Clone)]
struct OpenRound {
    pairs: OpenLoopResult,
    floor: OpenLoopResult,
}

/// The database server's checkpoints so far (`pg_stat_bgwriter`): a checkpoint ends with an
/// fsync of every file it wrote, which commits waiting for their WAL flush can queue behind.
#[derive(Debug, Clone, Copy)]
struct DatabaseCheckpoints {
    /// Started because `checkpoint_timeout` passed (counted when they start).
    timed: i64,
    /// Started because the WAL reached `max_wal_size` (counted when they start).
    requested: i64,
    /// Milliseconds spent in the fsyncs of the checkpoints that ended.
    sync_ms: f64,
}

impl DatabaseCheckpoints {
    /// Read from the database at `url`; `None` without one, or when it cannot be read (a
    /// figure, not a target).
    async fn read(url: Option<&str>) -> Option<DatabaseCheckpoints> {
        let (client, connection) = tokio_postgres::connect(url?, tokio_postgres::NoTls)
            .await
            .ok()?;
        let connection = tokio::spawn(connection);
        let row = client
            .query_one(
                "SELECT checkpoints_timed, checkpoints_req, checkpoint_sync_time \
                 FROM pg_stat_bgwriter",
                &[],
            )
            .await
            .ok();
        drop(client);
        let _ = connection.await;
        let row = row?;
        Some(DatabaseCheckpoints {
            timed: row.try_get(0).ok()?,
            requested: row.try_get(1).ok()?,
            sync_ms: row.try_get(2).ok()?,
        })
    }

    fn since(&self, before: &DatabaseCheckpoints) -> DatabaseCheckpoints {
        DatabaseCheckpoints {
            timed: self.timed - before.timed,
            requested: self.requested - before.requested,
            sync_ms: self.sync_ms - before.sync_ms,
        }
    }
}

/// One histogram of the operator's `/metrics` over a window.
#[derive(Debug, Clone, Default)]
struct HistogramWindow {
    count: f64,
    /// Seconds observed.
    sum: f64,
    /// Cumulative counts per upper bound (seconds), as exported.
    buckets: Vec<(f64, f64)>,
}

impl HistogramWindow {
    /// `name`'s histogram with the label `by` (if given) in the metrics text `text` (`None`
    /// when it is not there).
    fn read(text: &str, name: &str, by: Option<&str>) -> Option<HistogramWindow> {
        let label = by.map_or_else(String::new, |by| format!("by=\"{by}\""));
        let labels: &[&str] = match by {
            Some(_) => &[&label],
            None => &[],
        };
        let prefix = match by {
            Some(_) => format!("{name}_bucket{{{label},le=\""),
            None => format!("{name}_bucket{{le=\""),
        };
        let buckets: Vec<(f64, f64)> = text
            .lines()
            .filter_map(|line| {
                let (le, value) = line.strip_prefix(&prefix)?.split_once("\"} ")?;
                Some((le.parse().ok()?, value.parse().ok()?))
            })
            .collect();
        (!buckets.is_empty()).then(|| HistogramWindow {
            count: metric_sum(text, &format!("{name}_count"), labels),
            sum: metric_sum(text, &format!("{name}_sum"), labels),
            buckets,
        })
    }

    /// What was observed after `before`.
    fn since(&self, before: &HistogramWindow) -> HistogramWindow {
        HistogramWindow {
            count: self.count - before.count,
            sum: self.sum - before.sum,
            buckets: self
                .buckets
                .iter()
                .zip(&before.buckets)
                .map(|(&(le, after), &(_, earlier))| (le, after - earlier))
                .collect(),
        }
    }

    /// The upper bound of the bucket holding quantile `q`, in seconds.
    fn quantile(&self, q: f64) -> f64 {
        self.buckets
            .iter()
            .find(|(_, count)| *count >= self.count * q)
            .map_or(f64::INFINITY, |(le, _)| *le)
    }
}

/// The SQLite writer's batch, commit and checkpoint histograms over a window.
#[derive(Debug, Clone)]
struct WriterTimes {
    batch: HistogramWindow,
    commit: HistogramWindow,
    /// Checkpoints by the writer, between batches.
    checkpoint: HistogramWindow,
    /// Checkpoints in the background.
    background: HistogramWindow,
}

impl WriterTimes {
    fn read(text: &str) -> Option<WriterTimes> {
        let read = |step: &str, by| {
            HistogramWindow::read(text, &format!("proxy_operator_ledger_{step}_seconds"), by)
        };
        Some(WriterTimes {
            batch: read("batch", None)?,
            commit: read("commit", None)?,
            checkpoint: read("checkpoint", Some("writer"))?,
            background: read("checkpoint", Some("background"))?,
        })
    }

    fn since(&self, before: &WriterTimes) -> WriterTimes {
        WriterTimes {
            batch: self.batch.since(&before.batch),
            commit: self.commit.since(&before.commit),
            checkpoint: self.checkpoint.since(&before.checkpoint),
            background: self.background.since(&before.background),
        }
    }
}

impl Figures {
    fn pairs_per_s(&self) -> f64 {
        // Each pair is two requests; a lease still held at the end counts half.
        (self.pairs.get("acquired") + self.pairs.get("released")) as f64
            / 2.0
            / self.pairs.seconds()
    }

    fn healthz_per_s(&self) -> f64 {
        self.healthz.get("ok") as f64 / self.healthz.seconds()
    }

    fn ratio(&self) -> f64 {
        self.pairs_per_s() / self.healthz_per_s()
    }
}

/// The operator process; killed on drop.
struct Operator {
    child: Child,
    api: String,
    metrics: String,
    log: PathBuf,
}

impl Operator {
    /// Starts `binary` on `inventory` with the ledger `ledger` (a file path or a URL) and
    /// `extra_args`.
    fn start(
        binary: &Path,
        dir: &Path,
        inventory: &Path,
        ledger: &str,
        extra_args: &[&str],
    ) -> Operator {
        let api_port = free_port();
        let metrics_port = free_port();
        let log = dir.join(format!("operator-{api_port}.log"));
        let log_file = std::fs::File::create(&log).expect("operator log");
        let rust_log = std::env::var("PROXY_OPERATOR_BENCH_LOG").unwrap_or_else(|_| "info".into());
        let child = Command::new(binary)
            .args(["standalone", "--inventory"])
            .arg(inventory)
            .args(["--ledger", ledger])
            .args(["--ledger-durability", "normal"])
            .args(["--discovery-addr", &format!("127.0.0.1:{api_port}")])
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")])
            // The environment, not the flag: a baseline binary from before the gateway
            // ignores it.
            .env("PROXY_OPERATOR_GATEWAY_ADDR", "off")
            .args(["--inventory-poll", "100ms"])
            .args(extra_args)
            .env("DISCOVERY_TOKEN", TOKEN)
            .env("RUST_LOG", rust_log)
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", binary.display()));
        Operator {
            child,
            api: format!("http://127.0.0.1:{api_port}"),
            metrics: format!("http://127.0.0.1:{metrics_port}/metrics"),
            log,
        }
    }

    /// The SQLite writer's histograms so far, if the binary and its ledger export them.
    async fn writer_times(&self, http: &reqwest::Client) -> Option<WriterTimes> {
        WriterTimes::read(&self.metrics_text(http).await?)
    }

    async fn metrics_text(&self, http: &reqwest::Client) -> Option<String> {
        http.get(&self.metrics).send().await.ok()?.text().await.ok()
    }

    /// User + system CPU seconds of the process so far.
    fn cpu_seconds(&self) -> f64 {
        wrk::cpu_seconds(self.child.id())
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn proxy_doc(yaml: &mut String, i: usize, port: u16, probe_url: &str) {
    write!(
        yaml,
        "apiVersion: crawl.example.com/v1alpha1
kind: Proxy
metadata:
  name: px-{i:04}
  labels: {{pool: bench}}
spec:
  mode: External
  endpoint: {{host: 127.0.0.1, port: {port}}}
  maxLeases: {MAX_LEASES}
  healthCheck:
    probeURL: {probe_url}
    interval: 1h
    timeout: 5s
---
"
    )
    .expect("writing to a String");
}

async fn healthy_count(http: &reqwest::Client, api: &str) -> Option<u64> {
    let response = http
        .get(format!("{api}/v1/proxies?healthy=true&selector=pool=bench"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .ok()?;
    let body: serde_json::Value = response.json().await.ok()?;
    body["count"].as_u64()
}

/// The tenants file of the runs with tenants: [`TENANTS`] tenants, `bench-tenant-N` with the
/// token `bench-tenant-N-token-…`, each scoped to the fleet's label (tenant 0) or to a label
/// of its own, each with quotas of leases, sessions and acquires far above what a run takes.
fn tenants_file() -> String {
    let mut yaml = String::from("tenants:\n");
    for n in 0..TENANTS {
        let token = TENANT_TOKEN.replace("tenant-0", &format!("tenant-{n}"));
        let digest: String = <sha2::Sha256 as sha2::Digest>::digest(token.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let pool = if n == 0 {
            "bench".to_owned()
        } else {
            format!("team-{n}")
        };
        let _ = write!(
            yaml,
            "  - name: bench-tenant-{n}
    tokens: [\"sha256:{digest}\"]
    scope: {{selector: {{pool: {pool}}}}}
    quotas: {{leases: 100000, sessions: 1000, acquiresPerSecond: 1000000, burst: 1000000}}
"
        );
    }
    yaml
}

/// Runs wrk with a script; returns its parsed result line.
fn wrk(script: &str, url: &str, fleet: &Fleet<'_>, args: &[&str]) -> WrkResult {
    wrk::run(
        script,
        url,
        (WRK_THREADS, fleet.connections),
        fleet.seconds,
        args,
    )
}

/// Starts `setup.replicas` processes of `binary` on its ledger, grows their inventory to the
/// full fleet (proxies that appear after start-up are probed at once, not spread over the 1 h
/// interval), waits until all are healthy on every replica, then measures, the connections
/// spread over the replicas. With `tenants`, the processes read [`tenants_file`] and wrk calls
/// as its first tenant; with `open_loop`, the first replica is then offered a third of the
/// pairs/s reached.
async fn measure(label: &str, binary: &Path, fleet: &Fleet<'_>, setup: Setup<'_>) -> Figures {
    let Setup {
        ledger,
        replicas,
        tenants,
        open_loop,
    } = setup;
    let dir = tempfile::tempdir().expect("temp dir");
    let inventory = dir.path().join("inventory.yaml");
    std::fs::write(&inventory, "").expect("write the inventory");
    let file = dir.path().join("ledger.db").display().to_string();
    let postgres = ledger;
    let ledger = ledger.unwrap_or(&file);
    let tenants_path = dir.path().join("tenants.yaml");
    std::fs::write(&tenants_path, tenants_file()).expect("write the tenants file");
    let tenants_arg = tenants_path.display().to_string();
    let extra: Vec<&str> = match tenants {
        true => vec!["--tenants-file", &tenants_arg],
        false => Vec::new(),
    };
    let token = if tenants { TENANT_TOKEN } else { TOKEN };
    let operators: Vec<Operator> = (0..replicas)
        .map(|_| Operator::start(binary, dir.path(), &inventory, ledger, &extra))
        .collect();
    let http = reqwest::Client::new();
    for operator in &operators {
        wait_ready(label, operator, &http).await;
    }
    let mut yaml = String::with_capacity(PROXIES * 400);
    for i in 0..PROXIES {
        proxy_doc(
            &mut yaml,
            i,
            fleet.squids[i % fleet.squids.len()].port(),
            fleet.probe_url,
        );
    }
    let staged = dir.path().join("inventory.yaml.new");
    std::fs::write(&staged, yaml).expect("write the inventory");
    std::fs::rename(&staged, &inventory).expect("replace the inventory");
    let started = Instant::now();
    for operator in &operators {
        loop {
            let healthy = healthy_count(&http, &operator.api).await.unwrap_or(0);
            if healthy == PROXIES as u64 {
                break;
            }
            assert!(
                started.elapsed() < HEALTHY_DEADLINE,
                "{label}: {healthy} of {PROXIES} proxies healthy after {HEALTHY_DEADLINE:?}:\n{}",
                operator.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    eprintln!(
        "{label}: {PROXIES} proxies healthy in {:.1} s; measuring {} s per run",
        started.elapsed().as_secs_f64(),
        fleet.seconds.as_secs()
    );

    let body = r#"{"selector":{"pool":"bench"},"ttlSeconds":60}"#;
    pair_runs(&operators, fleet.connections, WARM_UP, token, body);
    let before = LedgerTotals::of(&operators, &http).await;
    let cpu_before: f64 = operators.iter().map(Operator::cpu_seconds).sum();
    let pairs = pair_runs(&operators, fleet.connections, fleet.seconds, token, body);
    let pairs_done = (pairs.get("acquired") + pairs.get("released")) as f64 / 2.0;
    let pairs_cpu = operators.iter().map(Operator::cpu_seconds).sum::<f64>() - cpu_before;
    let after = LedgerTotals::of(&operators, &http).await;
    let conflicts_per_pair = before
        .conflicts
        .zip(after.conflicts)
        .map(|(before, after)| (after - before) / pairs_done.max(1.0));
    let writes_per_batch = before
        .batches
        .zip(after.batches)
        .map(|((b0, w0), (b1, w1))| (w1 - w0) / (b1 - b0).max(1.0));
    let (open_loop, open_writer, open_database) = match open_loop {
        true => {
            let offered = pairs_done / pairs.seconds().max(1e-9) * OPEN_LOOP_SHARE;
            let connections = fleet.connections as usize;
            let api = &operators[0].api;
            let before = operators[0].writer_times(&http).await;
            let database_before = DatabaseCheckpoints::read(postgres).await;
            let floor_url = format!("{api}/healthz");
            let mut rounds = Vec::with_capacity(fleet.open_rounds);
            for _ in 0..fleet.open_rounds {
                let pairs =
                    open_loop::pairs(api, token, body, connections, offered, fleet.open_seconds)
                        .await;
                let floor =
                    open_loop::floor(&floor_url, connections, 2.0 * offered, fleet.open_seconds)
                        .await;
                rounds.push(OpenRound { pairs, floor });
            }
            let after = operators[0].writer_times(&http).await;
            let writer = before.zip(after).map(|(b, a)| a.since(&b));
            let database = database_before
                .zip(DatabaseCheckpoints::read(postgres).await)
                .map(|(b, a)| a.since(&b));
            (rounds, writer, database)
        }
        false => (Vec::new(), None, None),
    };
    let healthz = wrk(
        "healthz.lua",
        &format!("{}/healthz", operators[0].api),
        fleet,
        &[],
    );
    for mut operator in operators {
        let _ = Command::new("kill")
            .args(["-TERM", &operator.child.id().to_string()])
            .status();
        let _ = operator.child.wait();
    }
    Figures {
        label: label.to_owned(),
        pairs,
        healthz,
        pairs_cpu,
        writes_per_batch,
        conflicts_per_pair,
        open_loop,
        open_writer,
        open_database,
    }
}

/// What the replicas' ledgers counted so far, summed over every replica from one scrape of
/// each; a figure is `None` when a replica does not export it.
struct LedgerTotals {
    /// Batches, and the writes they carried.
    batches: Option<(f64, f64)>,
    /// PostgreSQL conflicts.
    conflicts: Option<f64>,
}

impl LedgerTotals {
    async fn of(operators: &[Operator], http: &reqwest::Client) -> LedgerTotals {
        let mut totals = LedgerTotals {
            batches: Some((0.0, 0.0)),
            conflicts: Some(0.0),
        };
        for operator in operators {
            let text = operator.metrics_text(http).await.unwrap_or_default();
            let sum = |name: &str| text.contains(name).then(|| metric_sum(&text, name, &[]));
            let batches = sum("proxy_operator_ledger_batches_total")
                .zip(sum("proxy_operator_ledger_batched_writes_total"));
            totals.batches = totals
                .batches
                .zip(batches)
                .map(|((b, w), (more_b, more_w))| (b + more_b, w + more_w));
            totals.conflicts = totals
                .conflicts
                .zip(sum("proxy_operator_ledger_conflicts_total"))
                .map(|(c, more)| c + more);
        }
        totals
    }
}

/// What every measurement runs against.
struct Fleet<'a> {
    squids: &'a [Squid],
    probe_url: &'a str,
    seconds: Duration,
    /// wrk's connections, spread over the replicas.
    connections: u32,
    /// How long an open-loop run lasts.
    open_seconds: Duration,
    /// Open-loop rounds (pairs, then the floor) per measurement.
    open_rounds: usize,
}

/// One replica on a fresh SQLite file, measured saturated only.
const SQLITE: Setup<'static> = Setup {
    ledger: None,
    replicas: 1,
    tenants: false,
    open_loop: false,
};

/// How one measurement runs.
#[derive(Debug, Clone, Copy, Default)]
struct Setup<'a> {
    /// The ledger's URL (`None`: a fresh SQLite file).
    ledger: Option<&'a str>,
    replicas: usize,
    /// With the tenants file, wrk calling as its first tenant.
    tenants: bool,
    /// Then offered a third of its pairs/s, open-loop.
    open_loop: bool,
}

/// Polls `/readyz` until the operator answers 200.
async fn wait_ready(label: &str, operator: &Operator, http: &reqwest::Client) {
    let started = Instant::now();
    loop {
        if let Ok(r) = http.get(format!("{}/readyz", operator.api)).send().await
            && r.status().is_success()
        {
            return;
        }
        assert!(
            started.elapsed() < HEALTHY_DEADLINE,
            "{label}: not ready:\n{}",
            operator.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Acquire+release pairs for `duration` with `token`, the connections spread over `operators`
/// (one wrk each, side by side).
fn pair_runs(
    operators: &[Operator],
    total: u32,
    duration: Duration,
    token: &str,
    body: &str,
) -> WrkResult {
    let share = total / u32::try_from(operators.len()).unwrap_or(1);
    let runs: Vec<WrkResult> = std::thread::scope(|scope| {
        let handles: Vec<_> = operators
            .iter()
            .enumerate()
            .map(|(i, operator)| {
                // The first replica takes what the division leaves over.
                let connections = if i == 0 {
                    total - share * (u32::try_from(operators.len()).unwrap_or(1) - 1)
                } else {
                    share
                };
                let threads = WRK_THREADS.min(connections);
                scope.spawn(move || {
                    wrk::run(
                        "lease_pairs.lua",
                        &operator.api,
                        (threads, connections),
                        duration,
                        &[token, body],
                    )
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a wrk run"))
            .collect()
    });
    WrkResult::combined(&runs)
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

fn table(runs: &[Figures]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<10} {:>10} {:>12} {:>8} {:>10} {:>10} {:>12} {:>12} {:>12} {:>14} {:>8}",
        "binary",
        "pairs/s",
        "healthz/s",
        "ratio",
        "pair p50",
        "pair p99",
        "healthz p99",
        "CPU ms/pair",
        "writes/batch",
        "conflicts/pair",
        "errors"
    );
    for run in runs {
        let pairs_done = run.pairs_per_s() * run.pairs.seconds();
        let _ = writeln!(
            out,
            "{:<10} {:>10.0} {:>12.0} {:>8.3} {:>10} {:>10} {:>12} {:>12.3} {:>12} {:>14} {:>8}",
            run.label,
            run.pairs_per_s(),
            run.healthz_per_s(),
            run.ratio(),
            ms(Duration::from_micros(run.pairs.get("p50_us"))),
            ms(run.pairs.p99()),
            ms(run.healthz.p99()),
            run.pairs_cpu * 1000.0 / pairs_done.max(1.0),
            run.writes_per_batch
                .map_or_else(|| "-".to_owned(), |w| format!("{w:.1}")),
            run.conflicts_per_pair
                .map_or_else(|| "-".to_owned(), |c| format!("{c:.3}")),
            run.pairs.errors() + run.healthz.errors(),
        );
        for failure in [&run.pairs.first_failure, &run.healthz.first_failure]
            .into_iter()
            .flatten()
        {
            let _ = writeln!(out, "  first failure of {}: {failure}", run.label);
        }
    }
    out
}

/// Prints the open-loop rounds and whether they met their targets.
fn report_open_loop(runs: &[Figures]) -> bool {
    let mut ok = true;
    println!(
        "\nopen loop, a third of each run's saturated pairs/s, latency per request from when it \
         was due; each round's pairs, then the floor (GET /healthz at the same requests/s):"
    );
    println!(
        "{:<10} {:>14} {:>14} {:>9} {:>9} {:>10} {:>9} {:>7}",
        "binary", "offered/s", "done/s", "p50", "p99", "p99.9", "max", "errors"
    );
    for run in runs {
        if run.open_loop.is_empty() {
            continue;
        }
        let row = |label: &str, open: &OpenLoopResult| {
            println!(
                "{label:<10} {:>14.0} {:>14.0} {:>9} {:>9} {:>10} {:>9} {:>7}",
                open.offered,
                open.achieved(),
                ms(open.quantile(0.5)),
                ms(open.quantile(0.99)),
                ms(open.quantile(0.999)),
                ms(open.quantile(1.0)),
                open.errors
            );
            if let Some(error) = &open.first_error {
                println!("  first error of {label}: {error}");
            }
        };
        let (p99_target, p999_target, floor_targets) = match run.label.as_str() {
            UNFLUSHED => (None, None, false),
            label if label.starts_with("postgres") => (Some(OPEN_POSTGRES_P99_TARGET), None, false),
            _ => (Some(OPEN_P99_TARGET), Some(OPEN_P999_TARGET), true),
        };
        for round in &run.open_loop {
            let (open, floor) = (&round.pairs, &round.floor);
            row(&run.label, open);
            row("  floor", floor);
            let ratio =
                |q: f64| open.quantile(q).as_secs_f64() / floor.quantile(q).as_secs_f64().max(1e-6);
            let (p99_ratio, p999_ratio) = (ratio(0.99), ratio(0.999));
            let mut met = open.errors == 0 && floor.errors == 0;
            if let Some(target) = p99_target {
                met &= open.quantile(0.99) < target;
            }
            if let Some(target) = p999_target {
                met &= open.quantile(0.999) < target;
            }
            if floor_targets {
                met &= p99_ratio <= FLOOR_P99_RATIO && p999_ratio <= FLOOR_P999_RATIO;
            }
            match p99_target {
                None => println!(
                    "  against the floor: p99 {p99_ratio:.2}x, p99.9 {p999_ratio:.2}x; for scale, not a target"
                ),
                Some(p99) => println!(
                    "  against the floor: p99 {p99_ratio:.2}x, p99.9 {p999_ratio:.2}x{}; targets: p99 < {}{}, no errors: {}",
                    if floor_targets {
                        format!(" (at most {FLOOR_P99_RATIO}x, {FLOOR_P999_RATIO}x)")
                    } else {
                        String::new()
                    },
                    ms(p99),
                    p999_target.map_or_else(String::new, |t| format!(", p99.9 < {}", ms(t))),
                    if met { "met" } else { "MISSED" }
                ),
            }
            ok &= met;
        }
        let elapsed = run
            .open_loop
            .iter()
            .map(|round| round.pairs.elapsed + round.floor.elapsed)
            .sum();
        if let Some(writer) = &run.open_writer {
            report_writer_times(writer, elapsed);
        }
        if let Some(database) = &run.open_database {
            println!(
                "  database checkpoints started {} timed, {} by WAL volume; {:.0} ms in the fsyncs of those that ended",
                database.timed, database.requested, database.sync_ms
            );
        }
    }
    ok
}

/// Prints how long the writer's batches, commits and checkpoints took during an open-loop run,
/// and the share of the run each kept the writer busy: a step that is rare but long enough to
/// hold the writer for more than 1% of the run is what p99 waits behind.
fn report_writer_times(writer: &WriterTimes, elapsed: Duration) {
    for (step, histogram) in [
        ("batches", &writer.batch),
        ("commits", &writer.commit),
        ("checkpoints", &writer.checkpoint),
        ("background", &writer.background),
    ] {
        let mean = histogram.sum / histogram.count.max(1.0);
        println!(
            "  writer {step:<11} {:>8.0}, mean {:>7}, p99 <= {:>8}, max <= {:>8}, {:>5.2}% of the run",
            histogram.count,
            ms(Duration::from_secs_f64(mean)),
            bucket_ms(histogram.quantile(0.99)),
            bucket_ms(histogram.quantile(1.0)),
            100.0 * histogram.sum / elapsed.as_secs_f64().max(1e-9),
        );
    }
}

/// A bucket bound in milliseconds (`+Inf` as such).
fn bucket_ms(seconds: f64) -> String {
    match seconds.is_finite() {
        true => ms(Duration::from_secs_f64(seconds)),
        false => "+Inf".to_owned(),
    }
}

fn binary_from(var: &str) -> Option<PathBuf> {
    std::env::var_os(var)
        .filter(|v| !v.is_empty())
        .map(|v: OsString| PathBuf::from(v))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 1)]
async fn main() -> ExitCode {
    let binary = binary_from("PROXY_OPERATOR_BENCH_BINARY")
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_proxy-operator")));
    let baseline = binary_from("PROXY_OPERATOR_BENCH_BASELINE");
    let seconds = std::env::var("PROXY_OPERATOR_BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(Duration::from_secs(DEFAULT_SECONDS), Duration::from_secs);
    if !wrk::installed() {
        eprintln!("wrk is not installed; install it: apt-get install -y wrk");
        return ExitCode::from(2);
    }
    let target = Target::start();
    let probe_url = target.http_url();
    let squids: Vec<Squid> = (0..SQUIDS).map(|_| Squid::start()).collect();
    let open_seconds = std::env::var("PROXY_OPERATOR_BENCH_OPEN_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(
            Duration::from_secs(DEFAULT_OPEN_SECONDS),
            Duration::from_secs,
        );
    let connections = std::env::var("PROXY_OPERATOR_BENCH_CONNECTIONS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_CONNECTIONS);
    let open_rounds = std::env::var("PROXY_OPERATOR_BENCH_OPEN_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_OPEN_ROUNDS);
    let fleet = Fleet {
        squids: &squids,
        probe_url: &probe_url,
        seconds,
        connections,
        open_seconds,
        open_rounds,
    };

    let parts = std::env::var("PROXY_OPERATOR_BENCH_PARTS")
        .unwrap_or_else(|_| "sqlite,tenants,postgres".to_owned());
    let part = |name: &str| parts.split(',').any(|p| p.trim() == name);

    let mut runs = Vec::new();
    let open = Setup {
        open_loop: true,
        ..SQLITE
    };
    // A baseline is measured before and after, so drift in the machine's load shows.
    if let Some(baseline) = &baseline {
        runs.push(measure("before", baseline, &fleet, open).await);
    }
    runs.push(measure("this", &binary, &fleet, open).await);
    if part("tenants") {
        // With and without tenants in the order A B B A, so a drift of the machine's load
        // weighs on both alike.
        let tenants = Setup {
            tenants: true,
            ..SQLITE
        };
        runs.push(measure("tenants", &binary, &fleet, tenants).await);
        runs.push(measure("tenants", &binary, &fleet, tenants).await);
        runs.push(measure("this", &binary, &fleet, SQLITE).await);
    }
    if let Some(baseline) = &baseline {
        runs.push(measure("before", baseline, &fleet, SQLITE).await);
    }
    let postgres = part("postgres").then(Postgres::start).flatten();
    if let Some(postgres) = &postgres {
        let one = postgres.database().url();
        let setup = Setup {
            ledger: Some(&one),
            open_loop: true,
            ..SQLITE
        };
        runs.push(measure("postgres", &binary, &fleet, setup).await);
        let three = postgres.database().url();
        let setup = Setup {
            ledger: Some(&three),
            replicas: 3,
            ..SQLITE
        };
        runs.push(measure("postgres×3", &binary, &fleet, setup).await);
        let hot = postgres.database().url();
        let setup = Setup {
            ledger: Some(&hot),
            replicas: 3,
            tenants: true,
            ..SQLITE
        };
        runs.push(measure("pg×3 tenant", &binary, &fleet, setup).await);
        // For scale, not a target: the same without waiting for the WAL flush of each commit,
        // about what SQLite's `normal` durability waits for (a crash of the database server
        // may lose the last commits, one of the operator never).
        let unflushed = postgres.database();
        unflushed.psql(&format!(
            "ALTER DATABASE {} SET synchronous_commit = off",
            unflushed.name()
        ));
        // Its open-loop run beside the one replica's shows what of that run's tail is the wait
        // for the WAL flush.
        let url = unflushed.url();
        let setup = Setup {
            ledger: Some(&url),
            open_loop: true,
            ..SQLITE
        };
        runs.push(measure(UNFLUSHED, &binary, &fleet, setup).await);
    }

    println!(
        "\n{PROXIES} proxies over {SQUIDS} squids, wrk -t{WRK_THREADS} -c{connections} -d{}s, \
         --ledger-durability normal",
        seconds.as_secs()
    );
    println!("measured: {}", binary.display());
    if let Some(baseline) = &baseline {
        println!("before:   {}", baseline.display());
    }
    print!("{}", table(&runs));
    let Some(this) = runs.iter().find(|r| r.label == "this") else {
        return ExitCode::FAILURE;
    };
    if baseline.is_some() {
        let before: Vec<&Figures> = runs.iter().filter(|r| r.label == "before").collect();
        let mean = |f: fn(&Figures) -> f64| {
            before.iter().map(|r| f(r)).sum::<f64>() / before.len().max(1) as f64
        };
        println!(
            "this / before (mean of the two before runs): pairs/s x{:.2}, healthz/s x{:.2} ({:+.1} %)",
            this.pairs_per_s() / mean(Figures::pairs_per_s),
            this.healthz_per_s() / mean(Figures::healthz_per_s),
            (this.healthz_per_s() / mean(Figures::healthz_per_s) - 1.0) * 100.0
        );
    }
    let errors = this.pairs.errors() + this.healthz.errors();
    let p99_ok = this.pairs.p99() < P99_TARGET;
    let met = |ok: bool| if ok { "met" } else { "MISSED" };
    println!(
        "targets: pair p99 < {} {}, no errors {} (ratio to /healthz {:.3}, not a target)",
        ms(P99_TARGET),
        met(p99_ok),
        met(errors == 0),
        this.ratio(),
    );
    let mean_pairs = |label: &str| {
        let of: Vec<f64> = runs
            .iter()
            .filter(|r| r.label == label)
            .map(Figures::pairs_per_s)
            .collect();
        (!of.is_empty()).then(|| of.iter().sum::<f64>() / of.len() as f64)
    };
    let tenants_ok = match mean_pairs("tenants").zip(mean_pairs("this")) {
        Some((tenants, this)) => {
            let against = tenants / this;
            let errors: u64 = runs
                .iter()
                .filter(|r| r.label == "tenants")
                .map(|r| r.pairs.errors())
                .sum();
            println!(
                "tenants / this pairs/s (means of two runs each) x{against:.2}: >= \
                 {TENANTS_RATIO_TARGET} {}, no errors {}",
                met(against >= TENANTS_RATIO_TARGET),
                met(errors == 0)
            );
            against >= TENANTS_RATIO_TARGET && errors == 0
        }
        None => !part("tenants"),
    };
    if let Some(hot) = runs.iter().find(|r| r.label == "pg×3 tenant")
        && let Some(three) = runs.iter().find(|r| r.label == "postgres×3")
    {
        println!(
            "three replicas, one tenant's quota row hot / without tenants: pairs/s x{:.2}, \
             pair p99 {} / {}",
            hot.pairs_per_s() / three.pairs_per_s(),
            ms(hot.pairs.p99()),
            ms(three.pairs.p99())
        );
    }
    let open_ok = report_open_loop(&runs);
    let mut postgres_ok = true;
    if let Some(one) = runs.iter().find(|r| r.label == "postgres") {
        let against = one.pairs_per_s() / this.pairs_per_s();
        let ratio_ok = against >= POSTGRES_RATIO_TARGET;
        let p99_ok = one.pairs.p99() < POSTGRES_P99_TARGET;
        let errors: u64 = runs
            .iter()
            .filter(|r| r.label.starts_with("postgres"))
            .map(|r| r.pairs.errors() + r.healthz.errors())
            .sum();
        println!(
            "postgres / sqlite pairs/s x{against:.2}: >= {POSTGRES_RATIO_TARGET} {}, pair p99 < {} \
             {}, no errors {}",
            met(ratio_ok),
            ms(POSTGRES_P99_TARGET),
            met(p99_ok),
            met(errors == 0),
        );
        postgres_ok = ratio_ok && p99_ok && errors == 0;
    } else if part("postgres") {
        println!(
            "postgres: not measured (PostgreSQL is not installed: apt-get install -y postgresql)"
        );
    }
    if p99_ok && errors == 0 && postgres_ok && tenants_ok && open_ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
