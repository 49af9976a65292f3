//! A plain-HTTP and an HTTPS listener on free loopback ports, served on a thread and runtime of
//! their own (so sync tests, async tests and benches can all use them), until dropped. Each
//! accepted connection (after the TLS handshake, on the HTTPS one) goes to a handler.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

/// A connection a handler serves: a TCP stream, or a TLS stream over one.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send {}

impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// The two running listeners; stopped on drop.
#[derive(Debug)]
pub struct LoopbackServers {
    /// The plain-HTTP address.
    pub http: SocketAddr,
    /// The HTTPS address (the certificate is for `127.0.0.1`).
    pub https: SocketAddr,
    accepted: Arc<AtomicU64>,
    shutdown: CancellationToken,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LoopbackServers {
    /// Starts both listeners, on threads named `thread_name`, HTTPS with `acceptor`; every
    /// connection is served by `handle(connection, peer)` in a task of its own.
    pub fn start<H, F>(thread_name: &'static str, acceptor: TlsAcceptor, handle: H) -> Self
    where
        H: Fn(Box<dyn Io>, SocketAddr) -> F + Clone + Send + Sync + 'static,
        F: Future<Output = ()> + Send + 'static,
    {
        let std_http = super::loopback_listener();
        let std_https = super::loopback_listener();
        let http = std_http.local_addr().expect("the HTTP address");
        let https = std_https.local_addr().expect("the HTTPS address");
        for listener in [&std_http, &std_https] {
            listener.set_nonblocking(true).expect("non-blocking");
        }
        let accepted = Arc::new(AtomicU64::new(0));
        let shutdown = CancellationToken::new();
        let thread = {
            let shutdown = shutdown.clone();
            let accepted = accepted.clone();
            std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .thread_name(thread_name)
                    .enable_all()
                    .build()
                    .expect("the servers' runtime");
                runtime.block_on(async move {
                    let http = TcpListener::from_std(std_http).expect("HTTP listener");
                    let https = TcpListener::from_std(std_https).expect("HTTPS listener");
                    tokio::spawn(serve(http, None, accepted.clone(), handle.clone()));
                    tokio::spawn(serve(https, Some(acceptor), accepted, handle));
                    shutdown.cancelled().await;
                });
                runtime.shutdown_background();
            })
        };
        LoopbackServers {
            http,
            https,
            accepted,
            shutdown,
            thread: Some(thread),
        }
    }

    /// TCP connections accepted so far, on both listeners.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for LoopbackServers {
    fn drop(&mut self) {
        self.shutdown.cancel();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn serve<H, F>(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    accepted: Arc<AtomicU64>,
    handle: H,
) where
    H: Fn(Box<dyn Io>, SocketAddr) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = ()> + Send + 'static,
{
    loop {
        let Ok((stream, peer)) = listener.accept().await else {
            continue;
        };
        accepted.fetch_add(1, Ordering::SeqCst);
        let tls = tls.clone();
        let handle = handle.clone();
        tokio::spawn(async move {
            match tls {
                Some(acceptor) => {
                    if let Ok(stream) = acceptor.accept(stream).await {
                        handle(Box::new(stream), peer).await;
                    }
                }
                None => handle(Box::new(stream), peer).await,
            }
        });
    }
}
