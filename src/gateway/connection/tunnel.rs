//! `CONNECT host:port`: a tunnel through an upstream proxy. The upstream's own `CONNECT` must
//! be answered 2xx (a SOCKS5 upstream's stream granted) before the crawler gets its `200`, so
//! an upstream that refuses, times out or answers otherwise is reported `error` and another is
//! tried. Once up, the tunnel is a byte
//! copy both ways, and its lease is renewed while it stays open.

use std::collections::HashSet;
use std::io::IoSlice;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::Incoming;
use hyper::upgrade::{OnUpgrade, Upgraded};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

use super::{ClientConnection, Failed, LeaseFor, Through};
use crate::gateway::answers::{Body, RequestOutcome, full, lease_headers};
use crate::gateway::ask::Ask;
use crate::gateway::choice::{Gateway, Held};
use crate::gateway::timeouts::Timed;
use crate::gateway::upstream::{self, Tunnel};
use crate::serving::outcomes::Outcome;

/// Opens the tunnel `request` asks for and answers it.
pub(super) async fn open(
    connection: &ClientConnection,
    mut request: Request<Incoming>,
    ask: &Ask,
) -> (RequestOutcome, Response<Body>) {
    let gateway = &connection.gateway;
    let authority = ask.target.authority();
    let timeout = gateway.config.upstream_timeout;
    let what = format!("tunnel to {authority}");
    let through = connection
        .through_upstream(
            ask,
            LeaseFor::Tunnel,
            &what,
            &HashSet::new(),
            |_, upstream| {
                let authority = &authority;
                async move {
                    upstream::tunnel(&upstream, authority, timeout)
                        .await
                        .map_err(|failure| Failed {
                            failure,
                            // Nothing reached the target or the crawler before the tunnel is up.
                            retriable: true,
                        })
                }
            },
        )
        .await;
    let Through {
        value: upstream_io,
        held,
        moved_from,
    } = match through {
        Ok(through) => through,
        Err(answer) => return answer,
    };
    gateway.fleet.outcomes.record(
        &held.tenant,
        &held.proxy,
        Some(&ask.target.host),
        Outcome::TunnelOpened,
    );
    let mut response = Response::new(full(""));
    lease_headers(&mut response, &held, moved_from);
    let client_io = hyper::upgrade::on(&mut request);
    gateway
        .tasks
        .spawn(relay(gateway.clone(), held, client_io, upstream_io));
    (RequestOutcome::Tunneled, response)
}

/// Copies bytes both ways until either side closes, renewing the lease meanwhile; counts what
/// went each way however it ended (a crawler that resets its connection at the end is common);
/// then gives a tunnel's own lease back (a session's stays with the session, used from now).
async fn relay(gateway: Arc<Gateway>, held: Held, client: OnUpgrade, upstream: Tunnel) {
    let _in_use = held.uses.begin();
    let (up, down) = (AtomicU64::new(0), AtomicU64::new(0));
    let copied = async {
        let client = client.await.map_err(std::io::Error::other)?;
        pipe(client, upstream, &up, &down).await
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
    let (up, down) = (up.load(Ordering::Relaxed), down.load(Ordering::Relaxed));
    gateway.relayed((&held).into(), up, down);
    match result {
        Some(Ok(())) => {}
        Some(Err(e)) => log::debug!("gateway: tunnel through {} ended: {e}", held.proxy),
        None => log::debug!("gateway: tunnel through {} cut at shutdown", held.proxy),
    }
    gateway.done_with(&held).await;
}

/// Bytes each direction of a tunnel reads at once: large reads and writes keep the system
/// calls per byte of a bulk transfer low.
const TUNNEL_BUFFER: usize = 64 << 10;

/// Copies both ways between the crawler's and the upstream's connections, on the TCP streams
/// (what was read past the heads goes first), adding the bytes written up and down to `up` and
/// `down` as they go.
async fn pipe(
    client: Upgraded,
    upstream: Tunnel,
    up: &AtomicU64,
    down: &AtomicU64,
) -> std::io::Result<()> {
    let (client, client_early) = tcp(client)?;
    let mut client = Counting {
        inner: client,
        written: down,
    };
    let mut upstream_side = Counting {
        inner: upstream.stream,
        written: up,
    };
    upstream_side.write_all(&client_early).await?;
    client.write_all(&upstream.early).await?;
    tokio::io::copy_bidirectional_with_sizes(
        &mut client,
        &mut upstream_side,
        TUNNEL_BUFFER,
        TUNNEL_BUFFER,
    )
    .await?;
    Ok(())
}

/// A stream that counts the bytes written to it, so a tunnel's bytes are known however the
/// copy ends (its error carries no counts).
struct Counting<'a> {
    inner: TcpStream,
    written: &'a AtomicU64,
}

impl Counting<'_> {
    fn count(&self, polled: Poll<std::io::Result<usize>>) -> Poll<std::io::Result<usize>> {
        if let Poll::Ready(Ok(n)) = &polled {
            self.written.fetch_add(*n as u64, Ordering::Relaxed);
        }
        polled
    }
}

impl AsyncRead for Counting<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Counting<'_> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.count(polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.count(polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The TCP stream under the crawler's upgraded connection, out of its timers (a tunnel is
/// quiet as long as its crawler likes), and the bytes hyper read past its head.
fn tcp(upgraded: Upgraded) -> std::io::Result<(TcpStream, bytes::Bytes)> {
    let parts = upgraded
        .downcast::<TokioIo<Timed<TcpStream>>>()
        .map_err(|_| std::io::Error::other("an upgraded connection that is not TCP"))?;
    Ok((parts.io.into_inner().into_inner(), parts.read_buf))
}
