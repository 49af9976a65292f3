//! proxy-operator: turns a fleet of HTTP egress proxies into Kubernetes `Proxy` objects,
//! health-checks them through the proxy, and leases them to crawlers from an on-disk ledger.

pub mod api;
pub mod cli;
pub mod controllers;
pub mod credentials;
pub mod egress;
pub mod events;
#[cfg(any(test, feature = "fixtures"))]
pub mod fixtures;
pub mod gateway;
pub mod geoip;
pub mod health;
pub mod inventory;
pub mod leader;
pub mod ledger;
pub mod metrics;
pub mod process;
pub mod provider;
pub mod proxy_watch;
pub mod rbac;
pub mod resources;
pub mod serving;
pub mod tls;
