//! Accepting client connections: each one counted against the process's cap and served on
//! its timed stream (see `timeouts`), one over the cap answered and closed; and the shutdown
//! that ends them and gives their leases back.
//!
//! Connections are served on the gateway's own threads, each running a single-threaded
//! runtime that accepts from the one listening socket. Everything a connection starts (its
//! upstream connections, tunnels and timers) stays on the thread that accepted it, so a
//! request and its answer are never handed between threads: on the process's multi-threaded
//! runtime the client and upstream halves of one request woke each other across workers and
//! woke idle workers to steal work, which cost more CPU than the relaying itself.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::net::TcpListener;
use tokio::runtime::Runtime;
use tokio_util::sync::CancellationToken;

use super::accounting;
use super::answers::{PROXY_STATUS, TOO_MANY_CONNECTIONS, proxy_status};
use super::choice::{self, Gateway};
use super::connection::ClientConnection;
use super::drain;
use super::limits;
use super::timeouts::{Activity, Timed};

/// How long connections and tunnels get to give their leases back at shutdown.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// The threads the gateway serves on, each with its runtime and its handle on the listening
/// socket; made before the gateway starts, so a failure stops start-up.
pub struct Workers {
    threads: Vec<(Runtime, std::net::TcpListener)>,
}

impl Workers {
    /// `threads` (at least one) runtimes accepting from `listener`.
    pub fn new(listener: std::net::TcpListener, threads: usize) -> std::io::Result<Self> {
        listener.set_nonblocking(true)?;
        let threads = (0..threads.max(1))
            .map(|_| {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                Ok((runtime, listener.try_clone()?))
            })
            .collect::<std::io::Result<_>>()?;
        Ok(Workers { threads })
    }
}

/// Serves the gateway on `workers` until `shutdown` fires, writing the bytes relayed to the
/// ledger every second meanwhile; then stops accepting, ends the connections and tunnels under
/// way, gives their leases back (a session's stays, so the session finds it again after a
/// restart) and writes the last bytes.
pub async fn serve(workers: Workers, gateway: Arc<Gateway>, shutdown: CancellationToken) {
    let housekeeping = tokio::spawn(choice::release_idle_sessions(
        gateway.clone(),
        shutdown.clone(),
    ));
    let flushes = tokio::spawn(accounting::flush_every_interval(
        gateway.clone(),
        shutdown.clone(),
    ));
    let connections = Arc::new(drain::Connections::default());
    let drains = tokio::spawn(drain::close_on_drain(
        gateway.clone(),
        connections.clone(),
        shutdown.clone(),
    ));
    // Cancelled once the connections have ended (or had their grace): the threads' runtimes
    // keep running their connections until then.
    let finished = CancellationToken::new();
    let mut threads = Vec::with_capacity(workers.threads.len());
    for (index, (runtime, listener)) in workers.threads.into_iter().enumerate() {
        let (gateway, connections) = (gateway.clone(), connections.clone());
        let (shutdown, finished) = (shutdown.clone(), finished.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("gateway-{index}"))
            .spawn(move || {
                runtime.block_on(async move {
                    match TcpListener::from_std(listener) {
                        Ok(listener) => accept(listener, gateway, connections, shutdown).await,
                        Err(e) => log::error!("gateway: thread {index} cannot listen: {e}"),
                    }
                    finished.cancelled().await;
                });
            });
        match spawned {
            Ok(thread) => threads.push(thread),
            Err(e) => log::error!("gateway: cannot start serving thread {index}: {e}"),
        }
    }
    shutdown.cancelled().await;
    housekeeping.abort();
    drains.abort();
    gateway.stopping.cancel();
    gateway.tasks.close();
    if tokio::time::timeout(STOP_GRACE, gateway.tasks.wait())
        .await
        .is_err()
    {
        log::warn!("gateway: connections did not end within {STOP_GRACE:?}; their leases expire");
    }
    finished.cancel();
    let joined = tokio::task::spawn_blocking(move || {
        for thread in threads {
            if thread.join().is_err() {
                log::error!("gateway: a serving thread panicked");
            }
        }
    });
    if let Err(e) = joined.await {
        log::error!("gateway: waiting for the serving threads failed: {e}");
    }
    // The bytes of the connections that ended, the last of them included.
    let _ = flushes.await;
    gateway.flush_traffic().await;
}

/// Accepts connections on `listener` until `shutdown` fires, each served on this thread.
async fn accept(
    listener: TcpListener,
    gateway: Arc<Gateway>,
    connections: Arc<drain::Connections>,
    shutdown: CancellationToken,
) {
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                let _ = stream.set_nodelay(true);
                gateway.metrics.connection();
                match gateway.limits.connection() {
                    Some(slot) => {
                        gateway.tasks.spawn(serve_connection(
                            stream,
                            peer,
                            gateway.clone(),
                            connections.clone(),
                            slot,
                        ));
                    }
                    None => {
                        gateway.metrics.connection_refused(limits::PROCESS_LIMIT);
                        gateway
                            .tasks
                            .spawn(refuse_connection(stream, gateway.limits.max_connections()));
                    }
                }
            }
            Err(e) => {
                log::warn!("gateway: accepting a connection failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// How long a connection over the cap gets to read its refusal.
const REFUSAL_WRITE_TIMEOUT: Duration = Duration::from_secs(1);

/// Answers a connection over the process's cap with `503 too_many_connections` and closes it,
/// without reading its request.
async fn refuse_connection(mut stream: tokio::net::TcpStream, cap: usize) {
    use tokio::io::AsyncWriteExt;
    let body = json!({
        "error": TOO_MANY_CONNECTIONS,
        "message": format!(
            "the gateway holds {cap} client connections, as many as it may \
             (--gateway-max-connections); retry later"
        ),
    })
    .to_string();
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         {PROXY_STATUS}: {}\r\nretry-after: 1\r\nconnection: close\r\n\
         content-length: {}\r\n\r\n{body}",
        proxy_status(TOO_MANY_CONNECTIONS),
        body.len()
    );
    let _ = tokio::time::timeout(REFUSAL_WRITE_TIMEOUT, async {
        stream.write_all(answer.as_bytes()).await?;
        stream.shutdown().await
    })
    .await;
}

/// Serves one client connection (known to the drain sweep through `connections` meanwhile),
/// then gives back the leases it held.
async fn serve_connection(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    gateway: Arc<Gateway>,
    connections: Arc<drain::Connections>,
    _slot: limits::Slot,
) {
    let _open = gateway.metrics.open_connection();
    let activity = Arc::new(Activity::default());
    let stream = Timed::new(stream, activity.clone(), gateway.config.timeouts);
    let connection = Arc::new(ClientConnection::new(gateway.clone(), activity.clone()));
    let registered = connections.add(&connection);
    let service = {
        let connection = connection.clone();
        service_fn(move |request| {
            let connection = connection.clone();
            async move { Ok::<_, Infallible>(connection.handle(request).await) }
        })
    };
    let served = http1::Builder::new()
        .keep_alive(true)
        .serve_connection(TokioIo::new(stream), service)
        .with_upgrades();
    tokio::select! {
        () = gateway.stopping.cancelled() => {}
        served = served => if let Err(e) = served {
            log::debug!("gateway: connection from {peer} ended: {e}");
        },
    }
    if let Some(expired) = activity.expired() {
        gateway.metrics.connection_closed(expired);
    }
    connections.remove(registered);
    connection.close().await;
}
