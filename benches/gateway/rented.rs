//! Rented exits, for `benches/gateway.rs`: what a gateway session on a rotating upstream costs
//! against one on an ordinary External proxy. Both proxies lead to one squid playing a vendor
//! (any password taken, the username picking the exit), behind one gateway process of their
//! own, so the only difference is the gateway's: spelling the vendor username and keying bans
//! by vendor session. `wrk -t2 -c32` plain-HTTP GETs through one session each, twice,
//! alternating.

use std::path::Path;
use std::time::Duration;

use crate::support::site::Site;
use crate::support::squid::{Squid, SquidOptions};
use crate::support::standalone::Standalone;
use crate::support::wrk::{self, WrkResult};
use crate::{CONNECTIONS, THREADS, TOKEN, WARM_UP, mean};

/// Requests/s through a session on the rotating upstream against one on the ordinary proxy,
/// at least.
const MIN_ROTATING_RATIO: f64 = 0.9;

/// The two proxies: `ordinary` sends a fixed username, `rotating` spells one per session.
fn inventory(squid: &Squid, probe: &str) -> String {
    let proxy = |name: &str, endpoint: &str| {
        format!(
            "apiVersion: crawl.example.com/v1alpha1
kind: Proxy
metadata: {{name: {name}, labels: {{kind: {name}}}}}
spec:
  mode: External
  maxLeases: 256
  endpoint:
    host: 127.0.0.1
    port: {port}
    credentialsSecretRef: {{name: vendor}}
{endpoint}  healthCheck: {{probeURL: \"{probe}\", interval: 10s}}
---
",
            port = squid.port()
        )
    };
    format!(
        "apiVersion: v1
kind: Secret
metadata: {{name: vendor}}
stringData: {{username: acme, password: vendor-secret}}
---
{}{}",
        proxy("ordinary", ""),
        proxy(
            "rotating",
            "    rotating:
      usernameTemplate: \"customer-{username}-cc-{geo}-sessid-{session}\"
      defaults: {geo: us}
      maxSessions: 256
",
        )
    )
}

/// Runs the measurement, prints it, and says whether it met its target.
pub fn measure(site: &Site, dir: &Path, seconds: Duration) -> bool {
    let squid = Squid::start_with(SquidOptions {
        vendor: true,
        ..SquidOptions::default()
    });
    let ca = dir.join("site-ca.pem");
    let ports = format!("{},{}", site.http_port(), site.https_port());
    let yaml = inventory(&squid, &site.http("/generate_204"));
    let args = [
        "--gateway-allowed-ports",
        &ports,
        "--gateway-allowed-destinations",
        "127.0.0.0/8",
    ];
    let mut operator = Standalone::start_inventory(dir, &yaml, &ca, TOKEN, &args);
    let runtime = tokio::runtime::Runtime::new().expect("a runtime");
    runtime.block_on(operator.wait_healthy(TOKEN, 2, Duration::from_secs(60)));
    let target = site.http("/ip");
    let gateway = format!("http://{}", operator.gateway());
    let session = |kind: &str| {
        proxy_operator::credentials::Credentials {
            username: format!("bench;session=bench-{kind};kind={kind}"),
            password: TOKEN.into(),
        }
        .basic()
    };
    let (ordinary, rotating) = (session("ordinary"), session("rotating"));
    let load = |auth: &str, duration| {
        wrk::run(
            "proxy_get.lua",
            &gateway,
            (THREADS, CONNECTIONS),
            duration,
            &[&target, auth],
        )
    };
    load(&ordinary, WARM_UP);
    load(&rotating, WARM_UP);
    let (mut on_ordinary, mut on_rotating): (Vec<WrkResult>, Vec<WrkResult>) =
        (Vec::new(), Vec::new());
    for _ in 0..2 {
        on_ordinary.push(load(&ordinary, seconds));
        on_rotating.push(load(&rotating, seconds));
    }
    let failed: Vec<String> = on_ordinary
        .iter()
        .chain(&on_rotating)
        .filter(|r| r.errors() > 0)
        .map(|r| format!("{} errors, first: {:?}", r.errors(), r.first_failure))
        .collect();
    if !failed.is_empty() {
        eprintln!("rented exits: failed requests: {failed:?}");
        return false;
    }
    let rate = |runs: &[WrkResult]| mean(&runs.iter().map(WrkResult::rate).collect::<Vec<_>>());
    let ratio = rate(&on_rotating) / rate(&on_ordinary);
    println!(
        "\nrented exits: one gateway session each, wrk -t{THREADS} -c{CONNECTIONS} -d{}s, 2 runs",
        seconds.as_secs()
    );
    println!(
        "on an ordinary External proxy {:>10.0} requests/s\non a rotating upstream        \
         {:>10.0} requests/s\nratio {ratio:.2} (at least {MIN_ROTATING_RATIO})",
        rate(&on_ordinary),
        rate(&on_rotating),
    );
    ratio >= MIN_ROTATING_RATIO
}
