//! HTTPS inside, for `benches/gateway.rs`: intercepted against tunnelled requests and
//! connections through the same gateway, a leaf's cost, and mitmproxy in upstream mode
//! through the same squid.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use proxy_operator::gateway::intercept::{CaFiles, InterceptCa};

use crate::support::gateway_ca::GatewayCa;
use crate::support::site::Site;
use crate::support::squid::Squid;
use crate::support::tls_load::{self, Load, Via};

/// Connections of every load.
const CONNECTIONS: usize = 32;
/// Intercepted requests/s against tunnelled ones, at least.
const MIN_INTERCEPTED_RATIO: f64 = 0.5;
/// The gateway's intercepted requests/s against mitmproxy's, at least.
const MIN_AGAINST_MITMPROXY: f64 = 3.0;
/// A leaf minted, at p99, under.
const MAX_MINT_P99: Duration = Duration::from_millis(5);
/// A leaf from the cache, at p99, under.
const MAX_CACHED_P99: Duration = Duration::from_micros(50);

/// What the measurements run against.
pub struct Setup<'a> {
    /// The gateway's `host:port`.
    pub gateway: String,
    /// Its token.
    pub token: &'a str,
    /// The site, on HTTPS.
    pub site: &'a Site,
    /// The site's CA, PEM.
    pub site_ca: Vec<u8>,
    /// The CA the gateway intercepts with.
    pub gateway_ca: &'a GatewayCa,
    /// The squid behind the gateway (mitmproxy goes through it too).
    pub squid: &'a Squid,
    /// A directory for mitmproxy's files.
    pub dir: &'a Path,
    /// How long each load runs.
    pub seconds: Duration,
}

fn authorization(user: &str, token: &str) -> String {
    use base64::Engine;
    let pair = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{token}"));
    format!("Proxy-Authorization: Basic {pair}\r\n")
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len() as f64
}

fn checked(load: Load, what: &str) -> Load {
    assert!(
        load.errors == 0,
        "{what}: {} errors, first: {:?}",
        load.errors,
        load.first_error
    );
    load
}

/// The p99 of `samples`.
fn p99(mut samples: Vec<Duration>) -> Duration {
    samples.sort_unstable();
    samples[(samples.len() * 99 / 100).min(samples.len() - 1)]
}

/// Runs every measurement, prints them, and says whether each met its target.
pub async fn measure(setup: Setup<'_>) -> bool {
    let target = ("127.0.0.1".to_owned(), setup.site.https_port());
    let gateway_ca_pem = std::fs::read(&setup.gateway_ca.cert).expect("the gateway's CA");
    let tunnel = Via {
        proxy: setup.gateway.clone(),
        authorization: authorization("bench", setup.token),
        target: target.clone(),
        roots: Via::trusting(&setup.site_ca),
    };
    let inspect = Via {
        authorization: authorization("bench;tls=inspect", setup.token),
        roots: Via::trusting(&gateway_ca_pem),
        ..tunnel.clone()
    };
    let warm = Duration::from_secs(1);
    checked(
        tls_load::run(&tunnel, "/ip", CONNECTIONS, warm, true).await,
        "warm-up",
    );
    checked(
        tls_load::run(&inspect, "/ip", CONNECTIONS, warm, true).await,
        "warm-up",
    );
    let (mut tunnelled, mut intercepted) = (Vec::new(), Vec::new());
    let (mut new_tunnels, mut new_intercepted) = (Vec::new(), Vec::new());
    for _ in 0..2 {
        tunnelled.push(
            checked(
                tls_load::run(&tunnel, "/ip", CONNECTIONS, setup.seconds, true).await,
                "tunnelled",
            )
            .rate(),
        );
        intercepted.push(
            checked(
                tls_load::run(&inspect, "/ip", CONNECTIONS, setup.seconds, true).await,
                "intercepted",
            )
            .rate(),
        );
        new_tunnels.push(
            checked(
                tls_load::run(&tunnel, "/ip", CONNECTIONS, setup.seconds, false).await,
                "new tunnels",
            )
            .connection_rate(),
        );
        new_intercepted.push(
            checked(
                tls_load::run(&inspect, "/ip", CONNECTIONS, setup.seconds, false).await,
                "new intercepted",
            )
            .connection_rate(),
        );
    }
    let (mint_p99, cached_p99) = leaves(setup.gateway_ca);
    let mitmproxy = mitmproxy(&setup, &target).await;

    let ratio = mean(&intercepted) / mean(&tunnelled);
    println!(
        "\nHTTPS, {CONNECTIONS} connections, {}s, 2 runs each (means): GET https://{}:{}/ip",
        setup.seconds.as_secs(),
        target.0,
        target.1
    );
    println!("{:<40} {:>12}", "kept alive", "requests/s");
    println!(
        "{:<40} {:>12.0}",
        "tunnelled through the gateway",
        mean(&tunnelled)
    );
    println!(
        "{:<40} {:>12.0}",
        "intercepted by the gateway",
        mean(&intercepted)
    );
    println!("ratio {ratio:.2} (at least {MIN_INTERCEPTED_RATIO})");
    println!("{:<40} {:>12}", "a connection per request", "connections/s");
    println!(
        "{:<40} {:>12.0}",
        "tunnelled (one TLS handshake)",
        mean(&new_tunnels)
    );
    println!(
        "{:<40} {:>12.0}",
        "intercepted (two TLS handshakes)",
        mean(&new_intercepted)
    );
    println!(
        "ratio {:.2} (reported)",
        mean(&new_intercepted) / mean(&new_tunnels)
    );
    println!(
        "a leaf certificate: minted p99 {mint_p99:.2?} (under {MAX_MINT_P99:?}), from the cache \
         p99 {cached_p99:.2?} (under {MAX_CACHED_P99:?})"
    );
    let against = match mitmproxy {
        Ok(rate) => {
            let against = mean(&intercepted) / rate;
            println!(
                "mitmproxy (mitmdump --mode upstream, same squid, same client), kept alive: \
                 {rate:.0} requests/s; the gateway {against:.2} times it (at least \
                 {MIN_AGAINST_MITMPROXY})"
            );
            against
        }
        Err(e) => {
            println!("mitmproxy: {e}");
            0.0
        }
    };
    ratio >= MIN_INTERCEPTED_RATIO
        && mint_p99 < MAX_MINT_P99
        && cached_p99 < MAX_CACHED_P99
        && against >= MIN_AGAINST_MITMPROXY
}

/// The p99 of a leaf minted for a new host, and of one served from the cache, in process.
fn leaves(ca: &GatewayCa) -> (Duration, Duration) {
    let ca = InterceptCa::load(&CaFiles {
        cert: ca.cert.clone(),
        key: ca.key.clone(),
    })
    .expect("the CA loads");
    let now = SystemTime::now();
    let mut minted = Vec::new();
    for i in 0..2000 {
        let host = format!("host-{i}.bench.example");
        let start = Instant::now();
        ca.leaf(&host, now).expect("a leaf");
        minted.push(start.elapsed());
    }
    let mut cached = Vec::new();
    for i in 0..100_000 {
        let host = format!("host-{}.bench.example", i % 2000);
        let start = Instant::now();
        ca.leaf(&host, now).expect("a leaf");
        cached.push(start.elapsed());
    }
    (p99(minted), p99(cached))
}

/// mitmdump on a free port, upstream to the same squid; killed on drop.
struct Mitmdump(Child);

impl Drop for Mitmdump {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The intercepted requests/s of the same load through mitmproxy, two runs' mean.
async fn mitmproxy(setup: &Setup<'_>, target: &(String, u16)) -> Result<f64, String> {
    let confdir = setup.dir.join("mitmproxy");
    std::fs::create_dir_all(&confdir).map_err(|e| e.to_string())?;
    let site_ca = setup.dir.join("mitm-site-ca.pem");
    std::fs::write(&site_ca, &setup.site_ca).map_err(|e| e.to_string())?;
    let port = crate::support::free_port();
    let child = Command::new("mitmdump")
        .args([
            "--listen-host",
            "127.0.0.1",
            "--listen-port",
            &port.to_string(),
        ])
        .arg("--mode")
        .arg(format!("upstream:{}", setup.squid.url()))
        .args(["--set", &format!("confdir={}", confdir.display())])
        .args([
            "--set",
            &format!("ssl_verify_upstream_trusted_ca={}", site_ca.display()),
        ])
        .args(["--set", "termlog_verbosity=error", "--quiet"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot run mitmdump ({e}): pip install mitmproxy"))?;
    let _running = Mitmdump(child);
    let ca = confdir.join("mitmproxy-ca-cert.pem");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !(ca.exists() && std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()) {
        if Instant::now() > deadline {
            return Err("mitmdump did not start within 60 s".to_owned());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let via = Via {
        proxy: format!("127.0.0.1:{port}"),
        authorization: String::new(),
        target: target.clone(),
        roots: Via::trusting(&std::fs::read(&ca).map_err(|e| e.to_string())?),
    };
    checked(
        tls_load::run(&via, "/ip", CONNECTIONS, Duration::from_secs(1), true).await,
        "mitmproxy warm-up",
    );
    let mut rates = Vec::new();
    for _ in 0..2 {
        rates.push(
            checked(
                tls_load::run(&via, "/ip", CONNECTIONS, setup.seconds, true).await,
                "mitmproxy",
            )
            .rate(),
        );
    }
    Ok(mean(&rates))
}
