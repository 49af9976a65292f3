//! Accepting client connections: each one counted against the process's cap and served on
//! its timed stream (see `timeouts`), one over the cap answered and closed; and the shutdown
//! that ends them and gives their leases back.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::json;
use tokio::net::TcpListener;
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

/// Serves the gateway on `listener` until `shutdown` fires, writing the bytes relayed to the
/// ledger every second meanwhile; then stops accepting, ends the connections and tunnels under
/// way, gives their leases back (a session's stays, so the session finds it again after a
/// restart) and writes the last bytes.
pub async fn serve(listener: TcpListener, gateway: Arc<Gateway>, shutdown: CancellationToken) {
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
    // The bytes of the connections that ended, the last of them included.
    let _ = flushes.await;
    gateway.flush_traffic().await;
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
