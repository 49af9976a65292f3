//! What the crawler gateway costs on top of the upstream proxy, measured from outside in one
//! run: `wrk -t2 -c32` plain-HTTP GETs through the release binary's gateway → squid → a
//! loopback site, against the same wrk straight to the same squid (`benches/wrk/proxy_get.lua`
//! sends the absolute-form request and the `Proxy-Authorization` header, as a proxy client
//! does), each twice, alternating. Then the latency the gateway adds at a load it handles, not
//! at its breaking point: a third of the gateway's requests/s offered at a fixed rate by an
//! open-loop client (each request's latency counted from when it was due; 32 connections),
//! straight to squid and through the gateway, each twice, alternating. Then a 256 MiB download
//! through a CONNECT tunnel (`curl -p`) through the gateway against straight through squid.
//! Prints requests/s, percentiles and transfer rates with their ratios, and the CPU a gateway
//! request costs against squid's, and exits non-zero when the requests/s ratio is below 0.6,
//! the gateway adds 2 ms or more to the p99 at the fixed load, or the transfer ratio is below
//! 0.8.
//!
//! Then HTTPS inside: GETs on kept-alive connections the gateway intercepts (`tls=inspect`)
//! against the same GETs through its byte tunnels, and new connections per second both ways
//! (two handshakes each when intercepted, one when tunnelled), each twice, alternating; a leaf
//! certificate minted and served from the cache, in process; and the same intercepted load
//! through mitmproxy in upstream mode (`mitmdump --mode upstream:` the same squid, same site,
//! same client). Fails when intercepted requests/s are below 0.5 of tunnelled ones, a leaf's
//! p99 is 5 ms or more to mint or 50 µs or more from the cache, or the gateway is below 3 times
//! mitmproxy.
//!
//! Then rented exits: requests/s through a gateway session on a rotating upstream against one
//! on an ordinary External proxy, both to one squid playing a vendor; fails below 0.9. Then
//! plain HTTP through a SOCKS5 upstream (danted): curl's GETs through the gateway against the
//! same curl straight to danted; fails below 0.6 of the direct requests/s (the same curl
//! through a relay that parses nothing, haproxy in `mode tcp`, is printed beside it for
//! reference: what one more hop costs on this machine). Then the ledger's
//! byte accounting: the same wrk through a gateway with it on against one with
//! `--gateway-no-traffic-ledger`, three runs each, alternating; fails below 0.95 (it may cost
//! at most 5 % of the requests/s).
//!
//! Run with `cargo bench --bench gateway` (needs `wrk`, `squid`, `curl`, `danted` and
//! mitmproxy: `apt-get install -y wrk squid curl dante-server`, `pip install mitmproxy`;
//! `haproxy` for the reference row, left out without it).
//! `PROXY_OPERATOR_BENCH_SECONDS` sets the length of each run (default 10). Everything shares
//! the machine: the load, the gateway, squid and the site.

#[path = "../tests/support/mod.rs"]
mod support;

#[path = "gateway/accounting.rs"]
mod accounting;

#[path = "gateway/interception.rs"]
mod interception;

#[path = "gateway/relay.rs"]
mod relay;

#[path = "gateway/rented.rs"]
mod rented;

#[path = "gateway/socks.rs"]
mod socks;

use std::process::{Command, ExitCode};
use std::time::Duration;

use support::open_loop::{self, OpenLoopResult};
use support::site::Site;
use support::squid::Squid;
use support::standalone::{ExternalProxy, Standalone};
use support::wrk::{self, WrkResult};

const TOKEN: &str = "gateway-bench-token-0123456789";
const CONNECTIONS: u32 = 32;
const THREADS: u32 = 2;
const WARM_UP: Duration = Duration::from_secs(2);
const BULK_BYTES: u64 = 256 << 20;
const MIN_RATE_RATIO: f64 = 0.6;
/// The gateway's added p99 at [`FIXED_LOAD_SHARE`] of its requests/s.
const MAX_ADDED_P99: Duration = Duration::from_millis(2);
const FIXED_LOAD_SHARE: f64 = 1.0 / 3.0;
const MIN_BULK_RATIO: f64 = 0.8;

/// Bytes per second of one `curl -p` download of `url` through `proxy`.
fn download_rate(proxy: &str, url: &str) -> f64 {
    let output = Command::new("curl")
        .args([
            "-sS",
            "-p",
            "-o",
            "/dev/null",
            "-w",
            "%{speed_download} %{size_download}",
        ])
        .args(["-x", proxy, url])
        .output()
        .unwrap_or_else(|e| panic!("cannot run curl ({e}); install it: apt-get install -y curl"));
    let text = String::from_utf8_lossy(&output.stdout);
    let (rate, size) = text.split_once(' ').unwrap_or_default();
    assert!(
        output.status.success() && size.parse::<u64>().ok() == Some(BULK_BYTES),
        "curl through {proxy} failed: {text} {}",
        String::from_utf8_lossy(&output.stderr)
    );
    rate.parse().expect("curl's speed_download")
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len() as f64
}

fn main() -> ExitCode {
    if !wrk::installed() {
        eprintln!("wrk is not installed; install it: apt-get install -y wrk");
        return ExitCode::FAILURE;
    }
    let seconds = std::env::var("PROXY_OPERATOR_BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(Duration::from_secs(10), Duration::from_secs);
    let runtime = tokio::runtime::Runtime::new().expect("a runtime");
    let site = Site::start();
    let squid = Squid::start();
    let dir = tempfile::tempdir().expect("a temp dir");
    let ca = dir.path().join("site-ca.pem");
    std::fs::write(&ca, site.ca_pem()).expect("write the site's CA");
    let proxy = ExternalProxy {
        name: "bench".into(),
        labels: vec![],
        host: "127.0.0.1".into(),
        port: squid.port(),
        // One lease per wrk connection, and room to spare.
        max_leases: 256,
        probe_url: site.http("/generate_204"),
        interval: "10s",
        cordoned: false,
        socks5: false,
        credentials: None,
        cost: None,
    };
    let ports = format!("{},{}", site.http_port(), site.https_port());
    let gateway_ca = support::gateway_ca::GatewayCa::write(dir.path());
    let ca_path = ca.display().to_string();
    let mut args = vec![
        "--gateway-allowed-ports",
        &ports,
        "--gateway-allowed-destinations",
        "127.0.0.0/8",
        "--gateway-target-ca-file",
        &ca_path,
    ];
    let ca_args = gateway_ca.args();
    args.extend(ca_args.iter().map(String::as_str));
    let mut operator = Standalone::start(dir.path(), &[proxy], &ca, TOKEN, &args);
    runtime.block_on(operator.wait_healthy(TOKEN, 1, Duration::from_secs(60)));

    let target = site.http("/ip");
    let gateway = format!("http://{}", operator.gateway());
    let basic = proxy_operator::credentials::Credentials {
        username: "bench".into(),
        password: TOKEN.into(),
    }
    .basic();
    let load = |through: &str, auth: &str, duration| {
        wrk::run(
            "proxy_get.lua",
            through,
            (THREADS, CONNECTIONS),
            duration,
            &[&target, auth],
        )
    };
    load(&squid.url(), "", WARM_UP);
    load(&gateway, &basic, WARM_UP);
    let mut direct: Vec<WrkResult> = Vec::new();
    let mut through: Vec<WrkResult> = Vec::new();
    let (mut gateway_cpu, mut squid_cpu) = (0.0, 0.0);
    let squid_pid = squid.pid().expect("squid runs");
    for _ in 0..2 {
        direct.push(load(&squid.url(), "", seconds));
        let (gateway_before, squid_before) = (
            wrk::cpu_seconds(operator.pid()),
            wrk::cpu_seconds(squid_pid),
        );
        through.push(load(&gateway, &basic, seconds));
        gateway_cpu += wrk::cpu_seconds(operator.pid()) - gateway_before;
        squid_cpu += wrk::cpu_seconds(squid_pid) - squid_before;
    }
    let failures: Vec<String> = direct
        .iter()
        .chain(&through)
        .filter(|r| r.errors() > 0)
        .map(|r| format!("{} errors, first: {:?}", r.errors(), r.first_failure))
        .collect();
    if !failures.is_empty() {
        eprintln!("failed requests: {failures:?}");
        return ExitCode::FAILURE;
    }

    let rate = |runs: &[WrkResult]| mean(&runs.iter().map(WrkResult::rate).collect::<Vec<_>>());
    let gateway_with_user = format!("http://bench:{TOKEN}@{}", operator.gateway());
    let offered = rate(&through) * FIXED_LOAD_SHARE;
    let mut fixed_direct: Vec<OpenLoopResult> = Vec::new();
    let mut fixed_through: Vec<OpenLoopResult> = Vec::new();
    let fixed = |proxy: &str| {
        runtime.block_on(open_loop::gets(
            proxy,
            &target,
            CONNECTIONS as usize,
            offered,
            seconds,
        ))
    };
    for _ in 0..2 {
        fixed_direct.push(fixed(&squid.url()));
        fixed_through.push(fixed(&gateway_with_user));
    }
    let failures: Vec<String> = fixed_direct
        .iter()
        .chain(&fixed_through)
        .filter(|r| r.errors > 0)
        .map(|r| format!("{} errors, first: {:?}", r.errors, r.first_error))
        .collect();
    if !failures.is_empty() {
        eprintln!("failed requests at the fixed load: {failures:?}");
        return ExitCode::FAILURE;
    }

    let bulk = site.http(&format!("/bytes/{BULK_BYTES}"));
    let mut bulk_direct = Vec::new();
    let mut bulk_through = Vec::new();
    for _ in 0..2 {
        bulk_direct.push(download_rate(&squid.url(), &bulk));
        bulk_through.push(download_rate(&gateway_with_user, &bulk));
    }

    let p99 = |runs: &[WrkResult]| {
        Duration::from_secs_f64(mean(
            &runs
                .iter()
                .map(|r| r.p99().as_secs_f64())
                .collect::<Vec<_>>(),
        ))
    };
    let rate_ratio = rate(&through) / rate(&direct);
    let fixed_quantile = |runs: &[OpenLoopResult], q: f64| {
        Duration::from_secs_f64(mean(
            &runs
                .iter()
                .map(|r| r.quantile(q).as_secs_f64())
                .collect::<Vec<_>>(),
        ))
    };
    let added_p99 =
        fixed_quantile(&fixed_through, 0.99).saturating_sub(fixed_quantile(&fixed_direct, 0.99));
    let bulk_ratio = mean(&bulk_through) / mean(&bulk_direct);
    let requests: u64 = through.iter().map(|r| r.get("requests")).sum();
    let cpu_ratio = gateway_cpu / squid_cpu.max(1e-9);
    println!(
        "\nwrk -t{THREADS} -c{CONNECTIONS} -d{}s, 2 runs each, GET {target}",
        seconds.as_secs()
    );
    println!("{:<22} {:>12} {:>10}", "plain HTTP", "requests/s", "p99");
    println!(
        "{:<22} {:>12.0} {:>10.2?}",
        "straight to squid",
        rate(&direct),
        p99(&direct)
    );
    println!(
        "{:<22} {:>12.0} {:>10.2?}",
        "through the gateway",
        rate(&through),
        p99(&through)
    );
    println!(
        "ratio {rate_ratio:.2} (at least {MIN_RATE_RATIO}), added p99 at saturation {:.2?}",
        p99(&through).saturating_sub(p99(&direct))
    );
    println!(
        "\nat a fixed load: {offered:.0} GETs/s (a third of the gateway's), open loop, \
         {CONNECTIONS} connections, {}s, 2 runs each (means)",
        seconds.as_secs()
    );
    println!(
        "{:<22} {:>10} {:>10} {:>10} {:>10}",
        "plain HTTP", "p50", "p99", "p99.9", "max"
    );
    for (name, runs) in [
        ("straight to squid", &fixed_direct),
        ("through the gateway", &fixed_through),
    ] {
        println!(
            "{name:<22} {:>10.2?} {:>10.2?} {:>10.2?} {:>10.2?}",
            fixed_quantile(runs, 0.5),
            fixed_quantile(runs, 0.99),
            fixed_quantile(runs, 0.999),
            fixed_quantile(runs, 1.0),
        );
    }
    println!("added p99 {added_p99:.2?} (under {MAX_ADDED_P99:?})");
    println!(
        "CPU per request: gateway {:.1} µs, squid {:.1} µs, ratio {cpu_ratio:.2}",
        gateway_cpu / requests as f64 * 1e6,
        squid_cpu / requests as f64 * 1e6,
    );
    println!(
        "256 MiB through a CONNECT tunnel: straight {:.0} MiB/s, through the gateway {:.0} MiB/s, \
         ratio {bulk_ratio:.2} (at least {MIN_BULK_RATIO})",
        mean(&bulk_direct) / f64::from(1 << 20),
        mean(&bulk_through) / f64::from(1 << 20),
    );
    let inside = runtime.block_on(interception::measure(interception::Setup {
        gateway: operator.gateway().to_owned(),
        token: TOKEN,
        site: &site,
        site_ca: site.ca_pem().as_bytes().to_vec(),
        gateway_ca: &gateway_ca,
        squid: &squid,
        dir: dir.path(),
        seconds,
    }));
    let rented_dir = tempfile::tempdir().expect("a temp dir");
    std::fs::write(rented_dir.path().join("site-ca.pem"), site.ca_pem())
        .expect("write the site's CA");
    let rented = rented::measure(&site, rented_dir.path(), seconds);
    let socks_dir = tempfile::tempdir().expect("a temp dir");
    let through_socks = socks::measure(&runtime, &site, socks_dir.path(), TOKEN);
    let accounting_dir = tempfile::tempdir().expect("a temp dir");
    let accounted = accounting::measure(
        &runtime,
        &site,
        &squid,
        accounting_dir.path(),
        TOKEN,
        seconds,
    );
    let passed = rate_ratio >= MIN_RATE_RATIO
        && added_p99 < MAX_ADDED_P99
        && bulk_ratio >= MIN_BULK_RATIO
        && inside
        && rented
        && through_socks
        && accounted;
    if passed {
        ExitCode::SUCCESS
    } else {
        eprintln!("the gateway missed a target");
        ExitCode::FAILURE
    }
}
