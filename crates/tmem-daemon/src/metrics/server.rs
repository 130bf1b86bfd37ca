//! The `/metrics` HTTP endpoint, with limits a local user cannot get past.
//!
//! The daemon that serves it holds other processes' pages, mlocked and
//! spared by the OOM killer, so every byte and thread a client can make it
//! hold is bounded here:
//!
//! - **One thread.** A current-thread tokio runtime on `tmem-metrics` runs
//!   every connection as a task: 1,000 slow clients are 1,000 small tasks
//!   at most (and far fewer, below), never 1,000 threads. Nothing of the
//!   swap path runs there; a scrape's snapshot takes the same short reads
//!   `tmem stat` takes and never waits on a client while it holds them.
//! - **Request head cap.** hyper's HTTP/1 parser buffers at most
//!   [`MAX_HEAD_BYTES`]; a longer head gets `431` and the connection closes.
//! - **Head deadline.** The whole request head must arrive within
//!   [`Limits::head_timeout`] (hyper's `header_read_timeout`), however slowly its
//!   bytes drip in.
//! - **Idle and write deadlines.** A connection that moves no byte either
//!   way for [`Limits::idle_timeout`], or whose reply cannot be written for
//!   [`Limits::write_timeout`] (a client that pipelines GETs and never reads), is
//!   closed. hyper answers one request at a time per connection, so an
//!   unread reply is the only one buffered, besides the kernel's socket
//!   buffer.
//! - **Connection cap.** At most [`Limits::max_connections`] at once. One more
//!   closes the oldest (a scrape takes milliseconds, so the oldest is a
//!   slow, idle or stalled client), so a fresh scrape always gets in.
//! - **Shutdown.** [`MetricsServer::stop`] ends the runtime, dropping every
//!   connection at once: it never waits for a client.
//!
//! Each limit is a [`MetricsServerStats`] counter in the exposition itself.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::AbortHandle;
use tokio::time::{Instant, Sleep};

use super::{encode_with_server, to_classic, Source, CLASSIC_CONTENT_TYPE, CONTENT_TYPE};
use crate::DaemonError;

/// Bytes of a request head hyper buffers (its smallest allowed buffer).
pub const MAX_HEAD_BYTES: usize = 8 * 1024;

/// The endpoint's limits; [`Limits::default`] is what the daemon uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connections served at once (Prometheus keeps one per target).
    pub max_connections: usize,
    /// Time for a whole request head to arrive.
    pub head_timeout: Duration,
    /// A connection that moves no byte for this long is closed
    /// (Prometheus reconnects on its next scrape).
    pub idle_timeout: Duration,
    /// A reply that cannot be written for this long closes its connection.
    pub write_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 16,
            head_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(10),
            write_timeout: Duration::from_secs(5),
        }
    }
}

tmem_counters::counters! {
    /// The metrics endpoint's own counters: its limits and how often each
    /// was reached.
    #[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
    pub struct MetricsServerStats {
        /// Connections accepted.
        connections: Counter(Events),
        /// Connections open now.
        connections_open: Gauge(Objects),
        /// The most connections served at once (the cap).
        connections_max: Max(Objects),
        /// Connections closed to make room for a new one at the cap (the oldest).
        connections_evicted: Counter(Events),
        /// Requests answered.
        requests: Counter(Events),
        /// The most bytes a request head may take (the cap).
        head_max_bytes: Max(Bytes),
        /// Requests refused with 431: their head was over the cap.
        head_too_large: Counter(Events),
        /// Connections closed because a request head took longer than its deadline.
        head_timeouts: Counter(Events),
        /// Connections closed after moving no byte for the idle timeout.
        idle_timeouts: Counter(Events),
        /// Connections closed because their reply could not be written in time (an unread pipeline).
        write_timeouts: Counter(Events),
        /// Connections closed on a malformed request or a socket error.
        errors: Counter(Events),
    }
}

/// The live counters behind [`MetricsServerStats`].
#[derive(Debug)]
struct Counts {
    limits: Limits,
    connections: AtomicU64,
    open: AtomicU64,
    evicted: AtomicU64,
    requests: AtomicU64,
    head_too_large: AtomicU64,
    head_timeouts: AtomicU64,
    idle_timeouts: AtomicU64,
    write_timeouts: AtomicU64,
    errors: AtomicU64,
}

impl Counts {
    fn snapshot(&self) -> MetricsServerStats {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        MetricsServerStats {
            connections: l(&self.connections),
            connections_open: l(&self.open),
            connections_max: self.limits.max_connections as u64,
            connections_evicted: l(&self.evicted),
            requests: l(&self.requests),
            head_max_bytes: MAX_HEAD_BYTES as u64,
            head_too_large: l(&self.head_too_large),
            head_timeouts: l(&self.head_timeouts),
            idle_timeouts: l(&self.idle_timeouts),
            write_timeouts: l(&self.write_timeouts),
            errors: l(&self.errors),
        }
    }
}

fn bump(a: &AtomicU64) {
    a.fetch_add(1, Ordering::Relaxed);
}

/// The running metrics endpoint; [`MetricsServer::stop`] ends it.
pub struct MetricsServer {
    addr: SocketAddr,
    counts: Arc<Counts>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Listens on `addr` and serves `/metrics` from `source`. A non-loopback
    /// address is refused unless `allow_remote`: the endpoint has no
    /// authentication.
    pub fn start(addr: SocketAddr, allow_remote: bool, source: Source) -> Result<Self, DaemonError> {
        Self::start_with(addr, allow_remote, source, Limits::default())
    }

    /// [`MetricsServer::start`] with other limits.
    pub fn start_with(
        addr: SocketAddr,
        allow_remote: bool,
        source: Source,
        limits: Limits,
    ) -> Result<Self, DaemonError> {
        check_address(addr, allow_remote)?;
        let listener = std::net::TcpListener::bind(addr)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|e| DaemonError::Setup(format!("metrics: cannot listen on {addr}: {e}")))?;
        let local = listener.local_addr().map_err(|e| DaemonError::Setup(format!("metrics: {addr}: {e}")))?;
        let counts = Arc::new(Counts {
            limits,
            connections: AtomicU64::new(0),
            open: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            head_too_large: AtomicU64::new(0),
            head_timeouts: AtomicU64::new(0),
            idle_timeouts: AtomicU64::new(0),
            write_timeouts: AtomicU64::new(0),
            errors: AtomicU64::new(0),
        });
        let (stop_tx, stop_rx) = oneshot::channel();
        let c = Arc::clone(&counts);
        let thread = std::thread::Builder::new()
            .name("tmem-metrics".into())
            .spawn(move || run(listener, &source, &c, stop_rx))
            .map_err(|e| DaemonError::Setup(format!("metrics: cannot start its thread: {e}")))?;
        Ok(Self { addr: local, counts, stop: Some(stop_tx), thread: Some(thread) })
    }

    /// The address it listens on (the port chosen, for `:0`).
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The endpoint's own counters.
    #[must_use]
    pub fn stats(&self) -> MetricsServerStats {
        self.counts.snapshot()
    }

    /// Stops serving: every connection is dropped, none is waited for.
    pub fn stop(mut self) {
        self.shut();
    }

    fn shut(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.shut();
    }
}

/// Refuses a non-loopback address unless `allow_remote`.
pub fn check_address(addr: SocketAddr, allow_remote: bool) -> Result<(), DaemonError> {
    if allow_remote || addr.ip().is_loopback() {
        Ok(())
    } else {
        Err(DaemonError::Invalid(format!(
            "metrics: refusing to listen on {addr}, which is not a loopback address: /metrics has no \
             authentication (--allow-remote-metrics permits it)"
        )))
    }
}

/// The `tmem-metrics` thread: the accept loop until `stop`, then every
/// connection is dropped with the runtime.
fn run(listener: std::net::TcpListener, source: &Source, counts: &Arc<Counts>, stop: oneshot::Receiver<()>) {
    let rt = match tokio::runtime::Builder::new_current_thread().enable_io().enable_time().build() {
        Ok(rt) => rt,
        Err(e) => {
            tracing::warn!("metrics: cannot start its runtime: {e}");
            return;
        }
    };
    rt.block_on(async {
        let listener = match TcpListener::from_std(listener) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!("metrics: {e}");
                return;
            }
        };
        tokio::select! {
            () = accept_loop(&listener, source, counts) => {}
            _ = stop => {}
        }
    });
    // Tasks are only futures: dropping the runtime drops them now.
    rt.shutdown_background();
}

/// One open connection, and how to close it.
struct Slot {
    id: u64,
    abort: AbortHandle,
}

async fn accept_loop(listener: &TcpListener, source: &Source, counts: &Arc<Counts>) {
    // Only this thread touches the slots; the mutex is for `Send`.
    let slots: Arc<Mutex<Vec<Slot>>> = Arc::new(Mutex::new(Vec::with_capacity(counts.limits.max_connections)));
    let mut next_id = 0_u64;
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                // EMFILE and the like: back off instead of spinning.
                tracing::warn!("metrics: accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        bump(&counts.connections);
        make_room(&slots, counts);
        next_id += 1;
        let id = next_id;
        let (src, c, s) = (Arc::clone(source), Arc::clone(counts), Arc::clone(&slots));
        counts.open.fetch_add(1, Ordering::Relaxed);
        let task = tokio::spawn(async move {
            serve_connection(stream, &src, &c).await;
            s.lock().unwrap_or_else(std::sync::PoisonError::into_inner).retain(|x| x.id != id);
            c.open.fetch_sub(1, Ordering::Relaxed);
        });
        slots.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(Slot { id, abort: task.abort_handle() });
    }
}

/// At the cap, closes the oldest connection. A scrape takes milliseconds,
/// so the oldest is a slow, idle or stalled one.
fn make_room(slots: &Mutex<Vec<Slot>>, counts: &Counts) {
    let mut slots = slots.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if slots.len() >= counts.limits.max_connections {
        let oldest = slots.remove(0);
        oldest.abort.abort();
        // The aborted task never reaches its own bookkeeping.
        counts.open.fetch_sub(1, Ordering::Relaxed);
        bump(&counts.evicted);
    }
}

async fn serve_connection(stream: tokio::net::TcpStream, source: &Source, counts: &Arc<Counts>) {
    let limits = counts.limits;
    let io = TokioIo::new(Deadlines::new(stream, Arc::clone(counts)));
    let service = hyper::service::service_fn(|req: Request<hyper::body::Incoming>| {
        bump(&counts.requests);
        let resp = respond(&req, source, counts);
        async move { Ok::<_, Infallible>(resp) }
    });
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.head_timeout)
        .max_buf_size(MAX_HEAD_BYTES)
        .keep_alive(true);
    let conn = http.serve_connection(io, service);
    if let Err(e) = conn.await {
        let counter = if e.is_parse_too_large() {
            &counts.head_too_large
        } else if e.is_timeout() {
            &counts.head_timeouts
        } else {
            let io = std::error::Error::source(&e).and_then(|s| s.downcast_ref::<io::Error>());
            if io.is_some_and(|e| e.kind() == io::ErrorKind::TimedOut && e.get_ref().is_some_and(|r| r.is::<Stall>())) {
                // Counted by `Deadlines` when it fired.
                return;
            }
            &counts.errors
        };
        bump(counter);
    }
}

/// The reply to one request.
fn respond(req: &Request<hyper::body::Incoming>, source: &Source, counts: &Counts) -> Response<Full<Bytes>> {
    let text = |status: StatusCode, body: String| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        r
    };
    if req.method() != Method::GET {
        return text(StatusCode::METHOD_NOT_ALLOWED, "only GET\n".into());
    }
    if req.uri().path() != "/metrics" {
        return text(StatusCode::NOT_FOUND, "tmem: metrics are at /metrics\n".into());
    }
    let accept = req.headers().get_all(hyper::header::ACCEPT).iter().filter_map(|v| v.to_str().ok());
    let openmetrics = wants_openmetrics(accept);
    match encode_with_server(&source(), Some(counts.snapshot())) {
        Ok(body) => {
            let (body, ct) = if openmetrics { (body, CONTENT_TYPE) } else { (to_classic(&body), CLASSIC_CONTENT_TYPE) };
            let mut r = text(StatusCode::OK, body);
            r.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static(ct));
            r
        }
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("encoding failed: {e}\n")),
    }
}

/// Whether any `Accept` value asks for the OpenMetrics text format.
pub fn wants_openmetrics<'a>(mut accept: impl Iterator<Item = &'a str>) -> bool {
    accept.any(|v| v.contains("application/openmetrics-text"))
}

/// Which of [`Deadlines`]' timers closed a connection: the error it
/// returns (hyper ends an idle connection on it without saying why, so
/// the timer counts itself).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
enum Stall {
    #[error("metrics: idle timeout")]
    Idle,
    #[error("metrics: write timeout")]
    Write,
}

/// A socket that fails with `TimedOut` once it has moved no byte for its
/// idle timeout, or a write has waited its write timeout. By hand:
/// hyper's HTTP/1 server has a head deadline but no idle or write one.
struct Deadlines<S> {
    io: S,
    counts: Arc<Counts>,
    /// Reset by every byte read or written.
    idle: Pin<Box<Sleep>>,
    /// Armed when a write finds the socket full, disarmed by progress.
    write: Pin<Box<Sleep>>,
    write_armed: bool,
}

impl<S> Deadlines<S> {
    fn new(io: S, counts: Arc<Counts>) -> Self {
        let Limits { idle_timeout, write_timeout, .. } = counts.limits;
        Self {
            io,
            counts,
            idle: Box::pin(tokio::time::sleep(idle_timeout)),
            write: Box::pin(tokio::time::sleep(write_timeout)),
            write_armed: false,
        }
    }

    fn progress(&mut self) {
        let at = Instant::now() + self.counts.limits.idle_timeout;
        self.idle.as_mut().reset(at);
    }

    /// `Pending`, or the error of a timer that has fired (each timer
    /// registers `cx` to be woken when it fires).
    fn expired<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        let stall = if self.write_armed && self.write.as_mut().poll(cx).is_ready() {
            bump(&self.counts.write_timeouts);
            Stall::Write
        } else if self.idle.as_mut().poll(cx).is_ready() {
            bump(&self.counts.idle_timeouts);
            Stall::Idle
        } else {
            return Poll::Pending;
        };
        // Never polled again: a connection closes on its first error.
        Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, stall)))
    }

    /// Progress disarms the write timer; a full socket arms it.
    fn after_write(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<usize>>) -> Poll<io::Result<usize>> {
        match r {
            Poll::Ready(r) => {
                if matches!(r, Ok(n) if n > 0) {
                    self.progress();
                    self.write_armed = false;
                }
                Poll::Ready(r)
            }
            Poll::Pending => {
                if !self.write_armed {
                    self.write_armed = true;
                    let at = Instant::now() + self.counts.limits.write_timeout;
                    self.write.as_mut().reset(at);
                }
                self.expired(cx)
            }
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Deadlines<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.io).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if buf.filled().len() > before {
                    self.progress();
                }
                Poll::Ready(r)
            }
            Poll::Pending => self.expired(cx),
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Deadlines<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, data);
        self.after_write(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.after_write(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests;
