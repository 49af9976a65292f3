//! `CONNECT host:port`: a tunnel through an upstream proxy. The upstream's own `CONNECT` must
//! be answered 2xx before the crawler gets its `200`, so an upstream that refuses, times out
//! or answers otherwise is reported `error` and another is tried. Once up, the tunnel is a byte
//! copy both ways, and its lease is renewed while it stays open.

use std::collections::HashSet;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::upgrade::OnUpgrade;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;

use super::choice::{Ask, ClientConnection, Held};
use super::upstream;
use super::{Attempts, Body, Outcome, full, lease_headers, refusal};
use crate::ledger::ReportResult;

/// Opens the tunnel `request` asks for and answers it.
pub(super) async fn open(
    connection: &ClientConnection,
    mut request: Request<Incoming>,
    ask: &Ask,
) -> (Outcome, Response<Body>) {
    let gateway = &connection.gateway;
    let authority = ask.target.authority();
    let mut tried = HashSet::new();
    let mut attempts = Attempts::default();
    loop {
        let (held, upstream) = match connection.choose_for_tunnel(ask, &tried).await {
            Ok(chosen) => chosen,
            Err(refused) if attempts.is_empty() => return refusal(&refused, gateway.clock.now()),
            Err(_) => return attempts.failed(),
        };
        if !attempts.is_empty() {
            gateway.metrics.retried();
        }
        match upstream::tunnel(&upstream, &authority, gateway.config.upstream_timeout).await {
            Ok(upstream_io) => {
                let mut response = Response::new(full(""));
                lease_headers(&mut response, &held, attempts.moved_from(&held));
                let client_io = hyper::upgrade::on(&mut request);
                let relayed = relay(gateway.clone(), held, client_io, upstream_io);
                gateway.tasks.spawn(relayed);
                return (Outcome::Tunneled, response);
            }
            Err(failure) => {
                log::info!(
                    "gateway: tunnel to {authority} through {} failed: {failure}",
                    held.proxy
                );
                gateway
                    .report_failure(&held, &ask.target.host, ReportResult::Error)
                    .await;
                connection.drop_lease(&held).await;
                tried.insert(held.proxy.uid.clone());
                attempts.push(&held, &failure);
                if attempts.len() > gateway.config.retries as usize {
                    return attempts.failed();
                }
            }
        }
    }
}

/// Copies bytes both ways until either side closes, renewing the lease meanwhile; then gives
/// a tunnel's own lease back (a session's stays with the session, used from now).
async fn relay(
    gateway: std::sync::Arc<super::Gateway>,
    held: Held,
    client: OnUpgrade,
    mut upstream_io: TokioIo<hyper::upgrade::Upgraded>,
) {
    let _in_use = held.uses.begin();
    let copied = async {
        let mut client_io = TokioIo::new(client.await.map_err(std::io::Error::other)?);
        tokio::io::copy_bidirectional(&mut client_io, &mut upstream_io).await
    };
    tokio::pin!(copied);
    let mut renewals = tokio::time::interval_at(
        tokio::time::Instant::now() + held.ttl / 2,
        (held.ttl / 2).max(Duration::from_secs(1)),
    );
    let result = loop {
        tokio::select! {
            result = &mut copied => break Some(result),
            _ = renewals.tick() => gateway.keep(&held).await,
            () = gateway.stopping.cancelled() => break None,
        }
    };
    match result {
        Some(Ok((up, down))) => gateway.metrics.relayed(up, down),
        Some(Err(e)) => log::debug!("gateway: tunnel through {} ended: {e}", held.proxy),
        None => log::debug!("gateway: tunnel through {} cut at shutdown", held.proxy),
    }
    gateway.done_with(&held).await;
}
