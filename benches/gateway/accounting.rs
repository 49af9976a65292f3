//! What the ledger's byte accounting costs the gateway, for `benches/gateway.rs`: the same
//! `wrk` plain-HTTP GETs through two gateways in front of the same squid and site, one with
//! the accounting on (the default: bytes added up in memory and written to the ledger's
//! hourly traffic rows every second) and one with `--gateway-no-traffic-ledger`, [`ROUNDS`]
//! times each, alternating, in the same run. Fails when the requests/s with the accounting on
//! are below [`MIN_RATIO`] of those with it off.

use std::path::Path;
use std::time::Duration;

use crate::support::site::Site;
use crate::support::squid::Squid;
use crate::support::standalone::{ExternalProxy, Standalone};
use crate::support::wrk::{self, WrkResult};

/// Runs each way, alternating.
const ROUNDS: usize = 3;
/// wrk's threads and connections, as the main comparison's.
const LOAD: (u32, u32) = (2, 32);
/// Requests/s with the accounting on against off, at least (it costs at most 5 %).
const MIN_RATIO: f64 = 0.95;

/// A binary in `dir` in front of `squid`, with `extra` flags, once its proxy is healthy.
fn gateway(
    runtime: &tokio::runtime::Runtime,
    site: &Site,
    squid: &Squid,
    dir: &Path,
    token: &str,
    extra: &[&str],
) -> Standalone {
    std::fs::create_dir_all(dir).expect("a directory for the binary");
    let ca = dir.join("site-ca.pem");
    std::fs::write(&ca, site.ca_pem()).expect("write the site's CA");
    let proxy = ExternalProxy {
        name: "bench-accounting".into(),
        labels: vec![],
        host: "127.0.0.1".into(),
        port: squid.port(),
        max_leases: 256,
        probe_url: site.http("/generate_204"),
        interval: "10s",
        cordoned: false,
        socks5: false,
        credentials: None,
        cost: None,
    };
    let ports = format!("{},{}", site.http_port(), site.https_port());
    let mut args = vec![
        "--gateway-allowed-ports",
        &ports,
        "--gateway-allowed-destinations",
        "127.0.0.0/8",
    ];
    args.extend_from_slice(extra);
    let mut operator = Standalone::start(dir, &[proxy], &ca, token, &args);
    runtime.block_on(operator.wait_healthy(token, 1, Duration::from_secs(60)));
    operator
}

/// Runs the comparison with its own two binaries under `dir`; whether it met its target.
pub fn measure(
    runtime: &tokio::runtime::Runtime,
    site: &Site,
    squid: &Squid,
    dir: &Path,
    token: &str,
    seconds: Duration,
) -> bool {
    let on = gateway(runtime, site, squid, &dir.join("on"), token, &[]);
    let off = gateway(
        runtime,
        site,
        squid,
        &dir.join("off"),
        token,
        &["--gateway-no-traffic-ledger"],
    );
    let target = site.http("/ip");
    let basic = proxy_operator::credentials::Credentials {
        username: "bench".into(),
        password: token.into(),
    }
    .basic();
    let load = |operator: &Standalone, duration| {
        let through = format!("http://{}", operator.gateway());
        wrk::run(
            "proxy_get.lua",
            &through,
            LOAD,
            duration,
            &[&target, &basic],
        )
    };
    load(&on, Duration::from_secs(2));
    load(&off, Duration::from_secs(2));
    let (mut with, mut without): (Vec<WrkResult>, Vec<WrkResult>) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        without.push(load(&off, seconds));
        with.push(load(&on, seconds));
    }
    let failed = with.iter().chain(&without).any(|r| r.errors() > 0);
    let rate = |runs: &[WrkResult]| {
        runs.iter().map(WrkResult::rate).sum::<f64>() / runs.len().max(1) as f64
    };
    let ratio = rate(&with) / rate(&without);
    println!(
        "\nthe ledger's byte accounting: wrk -t{} -c{} -d{}s, {ROUNDS} runs each (means)",
        LOAD.0,
        LOAD.1,
        seconds.as_secs()
    );
    println!("{:<34} {:>12}", "plain HTTP", "requests/s");
    println!("{:<34} {:>12.0}", "accounting off", rate(&without));
    println!(
        "{:<34} {:>12.0}",
        "accounting on (the default)",
        rate(&with)
    );
    println!("ratio {ratio:.3} (at least {MIN_RATIO})");
    if failed {
        eprintln!("failed requests in the accounting comparison");
    }
    !failed && ratio >= MIN_RATIO
}
