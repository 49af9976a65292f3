//! Time limits on a client connection between its requests: a request head must arrive whole
//! within the header timeout of its first byte (and a new connection's first head within the
//! header timeout of the accept), and a kept-alive connection with no request under way is
//! closed after the idle timeout. While a request is under way (its response included) neither
//! runs: a slow target or a long download is not the client's delay.
//!
//! hyper's own header timeout starts when it starts waiting for a head, so it would close an
//! idle kept-alive connection at the header timeout; this wrapper of the client's stream keeps
//! the two apart. hyper reads the stream whenever it waits for a head, so the wrapper sees
//! every moment a timer matters.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// Which timeout closed a connection (a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expired {
    /// A request head did not arrive whole in time.
    Header,
    /// No request came in time on a kept-alive connection.
    Idle,
}

impl Expired {
    /// Every value.
    pub const ALL: [Expired; 2] = [Expired::Header, Expired::Idle];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Expired::Header => "header_timeout",
            Expired::Idle => "idle_timeout",
        }
    }
}

/// The two limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// For a request head, from its first byte.
    pub header: Duration,
    /// Between requests on a kept-alive connection.
    pub idle: Duration,
}

/// What the connection's requests tell its stream: how many are under way, how many began,
/// and which timeout closed it, if one did.
#[derive(Debug, Default)]
pub struct Activity {
    in_flight: AtomicUsize,
    began: AtomicU64,
    expired: AtomicU8,
}

impl Activity {
    /// A request began; it is under way until the guard drops (with its response's body).
    pub fn begin(self: &Arc<Self>) -> UnderWay {
        self.began.fetch_add(1, Ordering::AcqRel);
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        UnderWay(self.clone())
    }

    /// The timeout that closed the connection, if one did.
    pub fn expired(&self) -> Option<Expired> {
        match self.expired.load(Ordering::Acquire) {
            1 => Some(Expired::Header),
            2 => Some(Expired::Idle),
            _ => None,
        }
    }
}

/// A request under way (see [`Activity::begin`]).
#[derive(Debug)]
pub struct UnderWay(Arc<Activity>);

impl Drop for UnderWay {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Where the connection is between requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the first byte of a head (after a response): the idle timer runs.
    Idle,
    /// A head has begun (or the connection is new): the header timer runs.
    Head,
    /// A request is under way: no timer.
    Busy,
}

/// The client's stream with the timers.
pub struct Timed<S> {
    inner: S,
    activity: Arc<Activity>,
    timeouts: Timeouts,
    phase: Phase,
    /// [`Activity::began`] when the phase was set: a request that began and ended between
    /// two reads still ends the phase.
    began: u64,
    timer: Pin<Box<Sleep>>,
}

impl<S> Timed<S> {
    /// `inner`, just accepted: its first head is due within the header timeout.
    pub fn new(inner: S, activity: Arc<Activity>, timeouts: Timeouts) -> Self {
        Timed {
            inner,
            activity,
            timeouts,
            phase: Phase::Head,
            began: 0,
            timer: Box::pin(tokio::time::sleep(timeouts.header)),
        }
    }

    /// The stream itself (for a tunnel, which the timers do not govern).
    pub fn into_inner(self) -> S {
        self.inner
    }

    fn enter(&mut self, phase: Phase, began: u64) {
        self.phase = phase;
        self.began = began;
        let limit = match phase {
            Phase::Idle => self.timeouts.idle,
            Phase::Head | Phase::Busy => self.timeouts.header,
        };
        self.timer.as_mut().reset(Instant::now() + limit);
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Timed<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let began = this.activity.began.load(Ordering::Acquire);
        if this.activity.in_flight.load(Ordering::Acquire) > 0 {
            this.phase = Phase::Busy;
            this.began = began;
            return Pin::new(&mut this.inner).poll_read(cx, buf);
        }
        if this.phase == Phase::Busy || this.began != began {
            this.enter(Phase::Idle, began);
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if this.phase == Phase::Idle && buf.filled().len() > before {
                    this.enter(Phase::Head, began);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => match this.timer.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    let (expired, code) = match this.phase {
                        Phase::Idle => (Expired::Idle, 2),
                        Phase::Head | Phase::Busy => (Expired::Header, 1),
                    };
                    this.activity.expired.store(code, Ordering::Release);
                    Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        expired.as_str(),
                    )))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Timed<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// A response body that keeps its request under way until it has been sent whole (or
/// dropped): a long download is never the client's idleness.
pub struct Finishing<B> {
    inner: B,
    _under_way: UnderWay,
}

impl<B> Finishing<B> {
    /// `inner`, keeping `under_way` until done.
    pub fn new(inner: B, under_way: UnderWay) -> Self {
        Finishing {
            inner,
            _under_way: under_way,
        }
    }
}

impl<B: http_body::Body + Unpin> http_body::Body for Finishing<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<B::Data>, B::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const TIMEOUTS: Timeouts = Timeouts {
        header: Duration::from_secs(10),
        idle: Duration::from_secs(60),
    };

    /// Reads from `timed` until it errs or ends; the error's kind and how long it took.
    async fn read_until_closed<S: AsyncRead + Unpin>(
        timed: &mut Timed<S>,
    ) -> (Option<io::ErrorKind>, Duration) {
        let start = Instant::now();
        let mut buf = [0u8; 64];
        loop {
            match timed.read(&mut buf).await {
                Ok(0) => return (None, start.elapsed()),
                Ok(_) => {}
                Err(e) => return (Some(e.kind()), start.elapsed()),
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_head_that_never_ends_is_cut_at_the_header_timeout() {
        let (client, server) = tokio::io::duplex(1024);
        let activity = Arc::new(Activity::default());
        let mut timed = Timed::new(server, activity.clone(), TIMEOUTS);
        let mut client = client;
        let trickle = tokio::spawn(async move {
            // One byte every second: the head never ends.
            for _ in 0..30 {
                if client.write_all(b"G").await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
        let (kind, took) = read_until_closed(&mut timed).await;
        assert_eq!(kind, Some(io::ErrorKind::TimedOut));
        assert_eq!(took, TIMEOUTS.header);
        assert_eq!(activity.expired(), Some(Expired::Header));
        trickle.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_is_closed_at_the_idle_timeout_and_a_request_under_way_never() {
        let (mut client, server) = tokio::io::duplex(1024);
        let activity = Arc::new(Activity::default());
        let mut timed = Timed::new(server, activity.clone(), TIMEOUTS);
        client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        let mut buf = [0u8; 64];
        assert!(timed.read(&mut buf).await.unwrap() > 0);
        // The request is under way for longer than both timeouts: nothing fires.
        let under_way = activity.begin();
        let quiet = tokio::time::timeout(Duration::from_secs(600), timed.read(&mut buf)).await;
        assert!(
            quiet.is_err(),
            "a timer fired while a request was under way"
        );
        drop(under_way);
        let (kind, took) = read_until_closed(&mut timed).await;
        assert_eq!(kind, Some(io::ErrorKind::TimedOut));
        assert_eq!(took, TIMEOUTS.idle);
        assert_eq!(activity.expired(), Some(Expired::Idle));
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_that_began_and_ended_between_reads_restarts_the_idle_timer() {
        let (mut client, server) = tokio::io::duplex(1024);
        let activity = Arc::new(Activity::default());
        let mut timed = Timed::new(server, activity.clone(), TIMEOUTS);
        client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        let mut buf = [0u8; 64];
        assert!(timed.read(&mut buf).await.unwrap() > 0);
        tokio::time::sleep(Duration::from_secs(9)).await;
        drop(activity.begin());
        // Without the request, the head's timer would fire in a second; now the idle one runs.
        let (kind, took) = read_until_closed(&mut timed).await;
        assert_eq!((kind, took), (Some(io::ErrorKind::TimedOut), TIMEOUTS.idle));
    }
}
