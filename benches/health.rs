//! Health engine throughput: 1,000 External proxies (spread over a few real squids) probed every
//! 2 s for 20 s through CONNECT tunnels to a loopback HTTPS target, against a bare loop doing
//! the same probes with the same clients and the same concurrency.
//!
//! Prints probes/s and CPU seconds of each run and the engine/baseline ratio. CPU is reported
//! twice: the runtime threads that drive the probes (what the engine costs), and the whole
//! process from `getrusage` (which also includes the in-process probe target).
//!
//! Then the exit-check schedule of 10,000 proxies on a 10-minute interval: the checks due in
//! each second of one interval (busiest, quietest, mean), and the time to compute them.
//!
//! Run with `cargo bench --bench health`.

#[path = "../tests/support/mod.rs"]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus::Registry;
use proxy_operator::fixtures;
use proxy_operator::health::exits::ExitSchedule;
use proxy_operator::health::{
    EngineConfig, HealthEngine, HealthSnapshot, ProbeClient, ProbeMetrics, ProbeSettings, ProbeTls,
};
use proxy_operator::inventory::Inventory;
use proxy_operator::resources::proxy::Proxy;
use support::{Squid, Target};
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;

const PROXIES: usize = 1_000;
const SQUIDS: usize = 3;
const INTERVAL: Duration = Duration::from_secs(2);
const RUN: Duration = Duration::from_secs(20);
const WORKERS: usize = proxy_operator::health::engine::DEFAULT_WORKERS;
const RUNTIME_THREAD: &str = "bench-runtime";

/// What one run achieved.
struct Figures {
    probes: u64,
    ok: u64,
    runtime_cpu: Duration,
    process_cpu: Duration,
}

impl Figures {
    fn rate(&self) -> f64 {
        self.probes as f64 / RUN.as_secs_f64()
    }

    fn print(&self, name: &str) {
        println!(
            "{name:<9} {:>8.1} probes/s  ({} probes, {} ok)  runtime CPU {:>6.2} s ({:.3} ms/probe)  process CPU {:>6.2} s",
            self.rate(),
            self.probes,
            self.ok,
            self.runtime_cpu.as_secs_f64(),
            self.runtime_cpu.as_secs_f64() * 1000.0 / self.probes.max(1) as f64,
            self.process_cpu.as_secs_f64(),
        );
    }
}

fn main() {
    let squids: Vec<Squid> = (0..SQUIDS).map(|_| Squid::start()).collect();
    let target = Target::start();
    let proxies: Vec<Proxy> = (0..PROXIES)
        .map(|i| proxy(i, squids[i % SQUIDS].port(), &target.https_url()))
        .collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .thread_name(RUNTIME_THREAD)
        .enable_all()
        .build()
        .expect("bench runtime");
    println!(
        "{PROXIES} proxies over {SQUIDS} squids, interval {INTERVAL:?}, {RUN:?} per run, {WORKERS} workers"
    );
    let engine = measure(|| runtime.block_on(engine_run(&proxies, &target)));
    engine.print("engine");
    let bare = measure(|| runtime.block_on(bare_run(&proxies, &target)));
    bare.print("bare loop");
    println!("ratio engine/bare: {:.3}", engine.rate() / bare.rate());
    exit_schedule();
}

/// The exit checks of 10,000 proxies over one 10-minute interval, per second: spread by each
/// proxy's phase, never a burst at start.
fn exit_schedule() {
    const EXIT_PROXIES: usize = 10_000;
    let interval = Duration::from_secs(600);
    let start = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let began = std::time::Instant::now();
    let mut per_second = vec![0u32; 600];
    for i in 0..EXIT_PROXIES {
        let uid = format!("uid-{i:05}-bench");
        let due = ExitSchedule::new(&uid, interval).next_after(start) - start;
        let second = usize::try_from(due.as_secs()).unwrap_or(0).min(599);
        per_second[second] += 1;
    }
    let took = began.elapsed();
    let busiest = per_second.iter().max().copied().unwrap_or(0);
    let quietest = per_second.iter().min().copied().unwrap_or(0);
    println!(
        "exit checks: {EXIT_PROXIES} proxies, interval {interval:?}: mean {:.1}/s, busiest second {busiest}, quietest {quietest}; schedule computed in {took:?}",
        EXIT_PROXIES as f64 / 600.0
    );
}

fn proxy(i: usize, port: u16, probe_url: &str) -> Proxy {
    fixtures::external(&format!("p{i:04}"), "127.0.0.1", port)
        .namespace("bench")
        .uid(Some(&format!("uid-{i}")))
        .spec(
            "healthCheck",
            serde_json::json!({"probeURL": probe_url, "interval": "2s", "timeout": "5s"}),
        )
        .build()
}

/// Runs `f`, attributing CPU time to the runtime threads and to the whole process.
fn measure(f: impl FnOnce() -> (u64, u64)) -> Figures {
    let runtime_before = threads_cpu(RUNTIME_THREAD);
    let process_before = process_cpu();
    let (probes, ok) = f();
    Figures {
        probes,
        ok,
        runtime_cpu: threads_cpu(RUNTIME_THREAD).saturating_sub(runtime_before),
        process_cpu: process_cpu().saturating_sub(process_before),
    }
}

/// The engine for [`RUN`]; returns (probes finished, successful probes) from its metrics.
async fn engine_run(proxies: &[Proxy], target: &Target) -> (u64, u64) {
    let inventory = Inventory::new();
    inventory.replace(proxies.iter().cloned());
    let registry = Registry::new();
    let metrics = ProbeMetrics::register(&registry).expect("register metrics");
    let (sender, mut transitions) = mpsc::channel(PROXIES);
    let drain = tokio::spawn(async move { while transitions.recv().await.is_some() {} });
    let engine = HealthEngine::new(
        EngineConfig {
            workers: WORKERS,
            tick: Duration::from_secs(1),
            extra_root_certs: vec![target.ca_cert_der()],
            ..EngineConfig::default()
        },
        inventory,
        HealthSnapshot::new(),
        metrics,
        sender,
    );
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(engine.run(shutdown.clone()));
    tokio::time::sleep(RUN).await;
    let counts = probe_counts(&registry);
    shutdown.cancel();
    let _ = task.await;
    let _ = drain.await;
    counts
}

fn probe_counts(registry: &Registry) -> (u64, u64) {
    let mut total = 0;
    let mut ok = 0;
    for family in registry.gather() {
        if family.name() != "proxy_operator_probes_total" {
            continue;
        }
        for metric in family.get_metric() {
            let value = metric.get_counter().value() as u64;
            total += value;
            if metric
                .get_label()
                .iter()
                .any(|l| l.name() == "result" && l.value() == "ok")
            {
                ok += value;
            }
        }
    }
    (total, ok)
}

/// The baseline: the same per-proxy clients, every proxy once per interval, at most
/// [`WORKERS`] probes at once, no engine around it.
async fn bare_run(proxies: &[Proxy], target: &Target) -> (u64, u64) {
    let tls = ProbeTls::new(&[target.ca_cert_der()]);
    let clients: Vec<ProbeClient> = proxies
        .iter()
        .filter_map(ProbeSettings::for_proxy)
        .map(|settings| ProbeClient::new(settings, &tls))
        .collect();
    let slots = Arc::new(Semaphore::new(WORKERS));
    let probes = Arc::new(AtomicU64::new(0));
    let ok = Arc::new(AtomicU64::new(0));
    let start = tokio::time::Instant::now();
    let deadline = start + RUN;
    let mut round = start;
    'rounds: while tokio::time::Instant::now() < deadline {
        for client in &clients {
            let Ok(slot) = slots.clone().acquire_owned().await else {
                break 'rounds;
            };
            if tokio::time::Instant::now() >= deadline {
                break 'rounds;
            }
            let client = client.clone();
            let (probes, ok) = (probes.clone(), ok.clone());
            tokio::spawn(async move {
                let result = client.probe(None).await;
                if tokio::time::Instant::now() < deadline {
                    probes.fetch_add(1, Ordering::Relaxed);
                    if result.is_success() {
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                }
                drop(slot);
            });
        }
        round += INTERVAL;
        tokio::time::sleep_until(round).await;
    }
    tokio::time::sleep_until(deadline).await;
    (probes.load(Ordering::Relaxed), ok.load(Ordering::Relaxed))
}

/// CPU time (user + system) of this process's threads named `name`, from `/proc`.
fn threads_cpu(name: &str) -> Duration {
    // SAFETY: sysconf only reads a configuration value.
    let ticks_per_second = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) })
        .unwrap_or(100)
        .max(1);
    let mut ticks = 0u64;
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Duration::ZERO;
    };
    for task in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        if !stat[open + 1..close].starts_with(name) {
            continue;
        }
        // After the command: state is field 3, utime field 14, stime field 15.
        let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        let parse = |i: usize| {
            fields
                .get(i)
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        ticks += parse(11) + parse(12);
    }
    Duration::from_millis(ticks * 1000 / ticks_per_second)
}

/// CPU time (user + system) of the whole process, from `getrusage`.
fn process_cpu() -> Duration {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct it is given; RUSAGE_SELF is always valid.
    let usage = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr());
        usage.assume_init()
    };
    let time = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec.unsigned_abs())
            + Duration::from_micros(t.tv_usec.unsigned_abs())
    };
    time(usage.ru_utime) + time(usage.ru_stime)
}
