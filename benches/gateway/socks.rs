//! Plain HTTP through a SOCKS5 upstream, for `benches/gateway.rs`: curl fetching the site's
//! `/ip` [`REQUESTS`] times over [`CONNECTIONS`] parallel connections through a gateway whose
//! one proxy is danted (`protocol: socks5`), against the same curl straight to that danted
//! (`socks5h://`), [`ROUNDS`] times each, alternating: one run takes a second or two on this
//! loopback, short enough for the machine's other work to tip a single pair. wrk speaks no
//! SOCKS, so curl is the client both ways. Prints the gateway's CPU per request too, and, for
//! reference, the same curl through a relay that parses nothing (haproxy in `mode tcp`, when
//! installed) in front of the same danted, in the same rounds: what one more hop costs here.
//! Fails when the gateway's requests/s are below [`MIN_RATIO`] of the direct ones.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::support::dante::{Dante, DanteOptions};
use crate::support::site::Site;
use crate::support::standalone::{ExternalProxy, Standalone};
use crate::support::wrk::cpu_seconds;

use super::relay::TcpRelay;

/// GETs per run.
const REQUESTS: usize = 20_000;
/// Runs each way, alternating.
const ROUNDS: usize = 5;
/// curl's parallel connections.
const CONNECTIONS: usize = 32;
/// Requests/s through the gateway against straight to danted, at least.
const MIN_RATIO: f64 = 0.6;

/// Requests/s of [`REQUESTS`] GETs of `url` through `proxy` (a curl proxy URL).
fn rate(proxy: &str, url: &str) -> f64 {
    let started = Instant::now();
    let output = Command::new("curl")
        .args([
            "-sS",
            "--parallel",
            "--parallel-max",
            &CONNECTIONS.to_string(),
        ])
        .args(["-x", proxy, "-w", "\n%{http_code}\n"])
        .arg(format!("{url}?n=[1-{REQUESTS}]"))
        .output()
        .unwrap_or_else(|e| panic!("cannot run curl ({e}); install it: apt-get install -y curl"));
    let elapsed = started.elapsed();
    let ok = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter(|line| *line == "200")
        .count();
    assert!(
        output.status.success() && ok == REQUESTS,
        "curl through {proxy}: {ok} of {REQUESTS} answered 200; {}",
        String::from_utf8_lossy(&output.stderr)
    );
    REQUESTS as f64 / elapsed.as_secs_f64()
}

/// Runs the comparison with its own danted and binary in `dir`; whether it met its target.
pub fn measure(runtime: &tokio::runtime::Runtime, site: &Site, dir: &Path, token: &str) -> bool {
    let Some(dante) = Dante::start(DanteOptions::default()) else {
        eprintln!("danted is not installed; install it: apt-get install -y dante-server");
        return false;
    };
    let ca = dir.join("site-ca.pem");
    std::fs::write(&ca, site.ca_pem()).expect("write the site's CA");
    let proxy = ExternalProxy {
        name: "bench-socks".into(),
        labels: vec![],
        host: dante.address().to_string(),
        port: dante.port(),
        max_leases: 256,
        probe_url: site.http("/generate_204"),
        interval: "10s",
        cordoned: false,
        socks5: true,
        credentials: None,
        cost: None,
    };
    let ports = format!("{},{}", site.http_port(), site.https_port());
    let args = [
        "--gateway-allowed-ports",
        &ports,
        "--gateway-allowed-destinations",
        "127.0.0.0/8",
    ];
    let mut operator = Standalone::start(dir, &[proxy], &ca, token, &args);
    runtime.block_on(operator.wait_healthy(token, 1, Duration::from_secs(60)));
    let gateway = format!("http://bench:{token}@{}", operator.gateway());
    let url = site.http("/ip");
    rate(&dante.url(), &url);
    rate(&gateway, &url);
    let relay = TcpRelay::start(dir, (dante.address(), dante.port()).into());
    let (mut direct, mut through, mut gateway_cpu) = (0.0, 0.0, 0.0);
    let mut relayed = 0.0;
    for _ in 0..ROUNDS {
        direct += rate(&dante.url(), &url) / ROUNDS as f64;
        if let Some(relay) = &relay {
            relayed += rate(&relay.socks_url(), &url) / ROUNDS as f64;
        }
        let before = cpu_seconds(operator.pid());
        through += rate(&gateway, &url) / ROUNDS as f64;
        gateway_cpu += cpu_seconds(operator.pid()) - before;
    }
    let ratio = through / direct;
    println!(
        "\nplain HTTP through a SOCKS5 upstream (danted): curl, {REQUESTS} GETs over \
         {CONNECTIONS} parallel connections, {ROUNDS} runs each (means)"
    );
    println!("{:<34} {:>12}", "", "requests/s");
    println!("{:<34} {direct:>12.0}", "curl straight to danted");
    println!("{:<34} {through:>12.0}", "through the gateway to danted");
    if relay.is_some() {
        println!("{:<34} {relayed:>12.0}", "through a TCP relay to danted");
    }
    println!("ratio {ratio:.2} (at least {MIN_RATIO})");
    if relay.is_some() {
        println!(
            "for reference: the TCP relay {:.2} of straight, the gateway {:.2} of the relay",
            relayed / direct,
            through / relayed
        );
    }
    println!(
        "gateway CPU per request through danted: {:.1} µs",
        gateway_cpu / (ROUNDS * REQUESTS) as f64 * 1e6
    );
    ratio >= MIN_RATIO
}
