//! A fleet behind the gateway: real squids, each on its own loopback address (which it also
//! connects out from, so the site sees which proxy a request left through) and each asking
//! for its own credentials, listed as External proxies in the inventory of a running
//! `proxy-operator standalone`, in front of a loopback [`Site`].

use std::net::Ipv4Addr;
use std::path::Path;
use std::time::Duration;

use proxy_operator::credentials::Credentials;

use super::site::Site;
use super::squid::{Squid, SquidOptions};
use super::standalone::{ExternalProxy, Standalone};

/// What the fleet's gateway opens: loopback, where the site and the squids are.
pub const LOOPBACK: &str = "127.0.0.0/8";

/// The API token of every fleet.
pub const TOKEN: &str = "gateway-token-0123456789";

/// `spec.cost` of every proxy of a [`GatewayFleet`]: 2 a GB and 0.5 an hour.
pub const GATEWAY_FLEET_COST: &str = r#"{perGB: "2", perHour: "0.5"}"#;

/// The price of a GB through a [`GatewayFleet`]'s proxies.
pub const GATEWAY_FLEET_PER_GB: f64 = 2.0;

/// The price of an hour of a [`GatewayFleet`]'s proxies.
pub const GATEWAY_FLEET_PER_HOUR: f64 = 0.5;

/// The site, the squids and the binary in front of them.
pub struct GatewayFleet {
    /// The site crawled.
    pub site: Site,
    /// The upstream proxies, `gw-0`, `gw-1`, ... in order.
    pub squids: Vec<Squid>,
    /// The binary.
    pub operator: Standalone,
    proxies: Vec<ExternalProxy>,
    dir: std::path::PathBuf,
    args: Vec<String>,
}

impl GatewayFleet {
    /// Starts `count` squids and the binary (with `extra_args`) on an inventory listing them,
    /// relaying to the site's ports, and waits until every proxy is healthy.
    pub async fn start(dir: &Path, count: usize, extra_args: &[&str]) -> GatewayFleet {
        GatewayFleet::start_labelled(dir, count, |_| Vec::new(), extra_args).await
    }

    /// [`GatewayFleet::start`] with proxy `gw-i` also carrying the labels `labels(i)`.
    pub async fn start_labelled(
        dir: &Path,
        count: usize,
        labels: impl Fn(usize) -> Vec<(String, String)>,
        extra_args: &[&str],
    ) -> GatewayFleet {
        GatewayFleet::launch(dir, count, labels, Some(LOOPBACK), extra_args).await
    }

    /// [`GatewayFleet::start`] with no destination opened, as an install starts by default:
    /// the gateway refuses the site, on loopback (the proxies' probes reach it: they do not
    /// go through the gateway).
    pub async fn start_closed(dir: &Path, count: usize, extra_args: &[&str]) -> GatewayFleet {
        GatewayFleet::launch(dir, count, |_| Vec::new(), None, extra_args).await
    }

    async fn launch(
        dir: &Path,
        count: usize,
        labels: impl Fn(usize) -> Vec<(String, String)>,
        destinations: Option<&str>,
        extra_args: &[&str],
    ) -> GatewayFleet {
        let site = Site::start();
        let mut squids = Vec::new();
        let mut proxies = Vec::new();
        for i in 0..count {
            let credentials = Credentials {
                username: format!("upstream{i}"),
                password: format!("pass-{i}-{}", rand::random::<u32>()),
            };
            let address = exit_address(i);
            let squid = Squid::start_with(SquidOptions {
                address: Some(address),
                htpasswd: Some(credentials.htpasswd_line().expect("hash the password")),
                ..SquidOptions::default()
            });
            proxies.push(ExternalProxy {
                name: format!("gw-{i}"),
                labels: [("pool".to_owned(), "gateway".to_owned())]
                    .into_iter()
                    .chain(labels(i))
                    .collect(),
                host: address.to_string(),
                port: squid.port(),
                max_leases: 16,
                probe_url: site.http("/generate_204"),
                interval: "1s",
                cordoned: false,
                socks5: false,
                credentials: Some((credentials.username, credentials.password)),
                cost: Some(GATEWAY_FLEET_COST),
            });
            squids.push(squid);
        }
        let ca = dir.join("site-ca.pem");
        std::fs::write(&ca, site.ca_pem()).expect("write the site's CA");
        let ports = format!("{},{}", site.http_port(), site.https_port());
        // The squids and the site are on loopback, which the gateway opens only when told.
        let opened = destinations
            .map(|ranges| ["--gateway-allowed-destinations", ranges])
            .into_iter()
            .flatten();
        let args: Vec<String> = [
            "--gateway-allowed-ports",
            &ports,
            "--inventory-poll",
            "200ms",
        ]
        .into_iter()
        .chain(opened)
        .chain(extra_args.iter().copied())
        .map(str::to_owned)
        .collect();
        let operator = start(dir, &proxies, &args).await;
        GatewayFleet {
            site,
            squids,
            operator,
            proxies,
            dir: dir.to_owned(),
            args,
        }
    }

    /// Stops the binary (SIGKILL) and starts it again on the same ledger and inventory (on
    /// new ports), waiting until every proxy is healthy again.
    pub async fn restart(&mut self) {
        self.operator.kill();
        self.operator = start(&self.dir, &self.proxies, &self.args).await;
    }

    /// Starts one more process on the same proxies and flags in `dir` (a second replica, when
    /// the flags name a ledger database both share), waiting until every proxy is healthy.
    pub async fn start_replica(&self, dir: &Path) -> Standalone {
        std::fs::write(dir.join("site-ca.pem"), self.site.ca_pem()).expect("write the site's CA");
        start(dir, &self.proxies, &self.args).await
    }

    /// `http://{user}:TOKEN@<gateway>`: the proxy URL a crawler configures.
    pub fn proxy_url(&self, user: &str) -> String {
        proxy_url(&self.operator, user)
    }

    /// The proxy (`default/gw-N`) whose squid connects out from `ip`.
    pub fn proxy_of(&self, ip: &str) -> Option<String> {
        (0..self.squids.len())
            .find(|&i| exit_address(i).to_string() == ip)
            .map(|i| format!("default/gw-{i}"))
    }

    /// The squid of proxy `default/gw-N`.
    pub fn squid_of(&mut self, proxy: &str) -> &mut Squid {
        let index: usize = proxy
            .strip_prefix("default/gw-")
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{proxy} is not a fleet proxy"));
        &mut self.squids[index]
    }

    /// Rewrites the inventory without proxy `default/gw-N`.
    pub fn remove(&mut self, proxy: &str) {
        self.proxies
            .retain(|p| format!("default/{}", p.name) != proxy);
        self.operator.rewrite_inventory(&self.proxies);
    }

    /// The current metrics scrape.
    pub async fn metrics(&self) -> String {
        reqwest::get(self.operator.metrics_url())
            .await
            .expect("scrape the metrics")
            .text()
            .await
            .expect("the scrape's text")
    }
}

/// Starts the binary in `dir` on `proxies` and waits until all are healthy.
async fn start(dir: &Path, proxies: &[ExternalProxy], args: &[String]) -> Standalone {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let ca = dir.join("site-ca.pem");
    let mut operator = Standalone::start(dir, proxies, &ca, TOKEN, &args);
    operator
        .wait_healthy(TOKEN, proxies.len(), Duration::from_secs(60))
        .await;
    operator
}

/// `http://{user}:TOKEN@<gateway>` of `operator`.
pub fn proxy_url(operator: &Standalone, user: &str) -> String {
    format!("http://{user}:{TOKEN}@{}", operator.gateway())
}

/// The loopback address squid `i` listens on and connects out from.
pub fn exit_address(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, 0, 0, 10 + u8::try_from(i).expect("a small fleet"))
}
