//! The listener: unix socket (default) or loopback TCP, one thread per
//! connection, a bounded number of connections, and a clean stop.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::stats::{bump, ServerStats};
use crate::{serve_connection, Export, Exports, NbdError};

/// Default bound on simultaneous connections.
pub const DEFAULT_MAX_CONNECTIONS: usize = 64;
/// How often the accept loop looks at the stop flag.
const POLL_INTERVAL_MS: i32 = 100;
/// How long a stop waits for sessions to finish their current request
/// before cutting their sockets.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest unix socket path (sun_path without the NUL).
const SUN_PATH_MAX: usize = 107;

/// Where the server listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Listen {
    /// A unix socket at this path, mode 0600, removed when the server stops.
    Unix(PathBuf),
    /// A TCP address; only loopback unless `NbdConfig::allow_remote`.
    Tcp(SocketAddr),
}

/// Percent-encodes everything but RFC 3986 unreserved characters (and `/`
/// when `keep_slash`).
fn pct(s: &[u8], keep_slash: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for &b in s {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) || (keep_slash && b == b'/') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl Listen {
    /// The NBD URI of `export` on this address (libnbd / QEMU syntax), e.g.
    /// `nbd+unix:///?socket=/run/tmem.sock` or `nbd://127.0.0.1:10809/disk`.
    pub fn uri(&self, export: &str) -> String {
        match self {
            Listen::Unix(p) => {
                format!(
                    "nbd+unix:///{}?socket={}",
                    pct(export.as_bytes(), false),
                    pct(p.as_os_str().as_encoded_bytes(), true)
                )
            }
            Listen::Tcp(a) => format!("nbd://{a}/{}", pct(export.as_bytes(), false)),
        }
    }
}

/// Server configuration.
#[derive(Clone, Debug)]
pub struct NbdConfig {
    /// Exports; the first is the default export (empty name).
    pub exports: Vec<Export>,
    /// Where to listen.
    pub listen: Listen,
    /// Connections served at once; more are closed right after `accept`.
    pub max_connections: usize,
    /// Permit a TCP address that is not loopback (there is no TLS and no
    /// authentication: anyone who reaches the port can read and write).
    pub allow_remote: bool,
}

impl NbdConfig {
    /// A configuration with the default connection bound, loopback only.
    pub fn new(exports: Vec<Export>, listen: Listen) -> Self {
        Self { exports, listen, max_connections: DEFAULT_MAX_CONNECTIONS, allow_remote: false }
    }
}

enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

impl Listener {
    fn fd(&self) -> RawFd {
        match self {
            Listener::Unix(l) => l.as_raw_fd(),
            Listener::Tcp(l) => l.as_raw_fd(),
        }
    }

    fn accept(&self) -> io::Result<Conn> {
        match self {
            Listener::Unix(l) => Ok(Conn::Unix(l.accept()?.0)),
            Listener::Tcp(l) => {
                let (s, _) = l.accept()?;
                s.set_nodelay(true)?;
                Ok(Conn::Tcp(s))
            }
        }
    }
}

enum Conn {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Conn {
    fn try_clone(&self) -> io::Result<Conn> {
        Ok(match self {
            Conn::Unix(s) => Conn::Unix(s.try_clone()?),
            Conn::Tcp(s) => Conn::Tcp(s.try_clone()?),
        })
    }

    fn shutdown(&self, how: Shutdown) {
        // The peer may be gone already; nothing to do about errors here.
        let _ = match self {
            Conn::Unix(s) => s.shutdown(how),
            Conn::Tcp(s) => s.shutdown(how),
        };
    }
}

/// The unix socket file we created; removed on drop if it is still ours.
#[derive(Debug)]
struct SocketFile {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        if let Ok(m) = fs::symlink_metadata(&self.path) {
            if m.dev() == self.dev && m.ino() == self.ino {
                let _ = fs::remove_file(&self.path);
            }
        }
    }
}

/// Binds a unix socket at `path` with mode 0600 from the start: it is bound
/// in a fresh 0700 directory, chmod'ed, then renamed into place, so no one
/// can connect through a wider mode. A stale socket (nobody listening) at
/// `path` is replaced; a live one is an error.
fn bind_unix(path: &Path) -> Result<(UnixListener, SocketFile), NbdError> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => match UnixStream::connect(path) {
            Ok(_) => return Err(NbdError::SocketInUse(path.to_path_buf())),
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => match fs::remove_file(path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e.into()),
                _ => {}
            },
            Err(e) => return Err(e.into()),
        },
        Ok(_) => {
            return Err(NbdError::Config(format!("{} exists and is not a socket", path.display())));
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e.into()),
    }
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let tmpdir = parent.join(format!(".tmem-nbd-{}-{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed)));
    let tmp = tmpdir.join("s");
    let listener = if tmp.as_os_str().len() > SUN_PATH_MAX {
        // No room for the detour: bind in place and narrow the mode at once.
        let l = UnixListener::bind(path)?;
        fs::set_permissions(path, fs::Permissions::from_mode(0o600))?;
        l
    } else {
        fs::DirBuilder::new().mode(0o700).create(&tmpdir)?;
        let r = (|| -> io::Result<UnixListener> {
            let l = UnixListener::bind(&tmp)?;
            fs::set_permissions(&tmp, fs::Permissions::from_mode(0o600))?;
            fs::rename(&tmp, path)?;
            Ok(l)
        })();
        let _ = fs::remove_file(&tmp);
        let _ = fs::remove_dir(&tmpdir);
        r?
    };
    let m = fs::symlink_metadata(path)?;
    Ok((listener, SocketFile { path: path.to_path_buf(), dev: m.dev(), ino: m.ino() }))
}

/// Waits up to `timeout_ms` for `fd` to become readable.
fn wait_readable(fd: RawFd, timeout_ms: i32) -> io::Result<bool> {
    let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: `pfd` is a valid, exclusively borrowed pollfd for the whole
    // call and the count (1) matches; poll does not retain the pointer.
    let r = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
    match r {
        0 => Ok(false),
        r if r > 0 => Ok(true),
        _ => {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                Ok(false)
            } else {
                Err(e)
            }
        }
    }
}

#[derive(Default)]
struct Conns {
    next_id: u64,
    /// Clones of the live sessions' sockets, to shut them down on stop.
    streams: HashMap<u64, Conn>,
    threads: Vec<JoinHandle<()>>,
}

struct Shared {
    exports: Exports,
    conns: Mutex<Conns>,
    accepted: AtomicU64,
    refused: AtomicU64,
    active: AtomicU64,
    session_errors: AtomicU64,
}

impl Shared {
    fn conns(&self) -> MutexGuard<'_, Conns> {
        self.conns.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn stats(&self) -> ServerStats {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        ServerStats {
            connections_accepted: l(&self.accepted),
            connections_refused: l(&self.refused),
            connections_active: l(&self.active),
            session_errors: l(&self.session_errors),
            exports: self.exports.stats(),
        }
    }

    /// Joins finished session threads; returns how many are still running.
    fn reap(&self) -> usize {
        let done: Vec<JoinHandle<()>> = {
            let mut c = self.conns();
            let (done, live) = std::mem::take(&mut c.threads).into_iter().partition(|h| h.is_finished());
            c.threads = live;
            done
        };
        for h in done {
            if h.join().is_err() {
                bump(&self.session_errors, 1);
            }
        }
        self.conns().threads.len()
    }
}

/// A bound NBD server. [`NbdServer::run_until`] serves it on the calling
/// thread; [`NbdServer::spawn`] runs it on a thread of its own.
pub struct NbdServer {
    listener: Listener,
    local: Listen,
    max_connections: usize,
    shared: Arc<Shared>,
    /// Dropped last: removes the unix socket file.
    _socket_file: Option<SocketFile>,
}

impl std::fmt::Debug for NbdServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NbdServer").field("local", &self.local).field("exports", &self.shared.exports).finish()
    }
}

impl NbdServer {
    /// Validates the configuration and binds the listener.
    pub fn bind(config: NbdConfig) -> Result<NbdServer, NbdError> {
        let exports = Exports::new(config.exports)?;
        if config.max_connections == 0 {
            return Err(NbdError::Config("max_connections must be at least 1".into()));
        }
        let (listener, local, socket_file) = match config.listen {
            Listen::Tcp(addr) => {
                if !config.allow_remote && !addr.ip().is_loopback() {
                    return Err(NbdError::RemoteNotAllowed(addr));
                }
                let l = TcpListener::bind(addr)?;
                let local = Listen::Tcp(l.local_addr()?);
                (Listener::Tcp(l), local, None)
            }
            Listen::Unix(path) => {
                let (l, file) = bind_unix(&path)?;
                (Listener::Unix(l), Listen::Unix(path), Some(file))
            }
        };
        let shared = Arc::new(Shared {
            exports,
            conns: Mutex::default(),
            accepted: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            active: AtomicU64::new(0),
            session_errors: AtomicU64::new(0),
        });
        Ok(NbdServer { listener, local, max_connections: config.max_connections, shared, _socket_file: socket_file })
    }

    /// The address actually bound (the TCP port is resolved).
    pub fn local_addr(&self) -> &Listen {
        &self.local
    }

    /// The exports and their counters.
    pub fn exports(&self) -> &Exports {
        &self.shared.exports
    }

    /// Counters of the server and its exports.
    pub fn stats(&self) -> ServerStats {
        self.shared.stats()
    }

    /// Accepts and serves connections until `stop` is set (checked at
    /// least every 100 ms), then ends the sessions: each finishes its
    /// current request and sees end-of-stream; those still running after
    /// 5 s have their sockets cut. The listener stays bound until the
    /// server is dropped (which removes the unix socket file).
    pub fn run_until(&self, stop: &AtomicBool) -> Result<(), NbdError> {
        let fd = self.listener.fd();
        let result = loop {
            if stop.load(Ordering::Acquire) {
                break Ok(());
            }
            match wait_readable(fd, POLL_INTERVAL_MS) {
                Ok(false) => {}
                Ok(true) => {
                    if let Err(e) = self.accept_one() {
                        // Aborted handshakes, fd or memory exhaustion: back
                        // off briefly instead of spinning, keep serving.
                        if e.kind() != io::ErrorKind::Interrupted && e.kind() != io::ErrorKind::WouldBlock {
                            std::thread::sleep(Duration::from_millis(20));
                        }
                    }
                }
                Err(e) => break Err(e.into()),
            }
            self.shared.reap();
        };
        self.close_sessions();
        result
    }

    fn accept_one(&self) -> io::Result<()> {
        let conn = self.listener.accept()?;
        let shared = &self.shared;
        if shared.active.load(Ordering::Relaxed) >= u64::try_from(self.max_connections).unwrap_or(u64::MAX) {
            bump(&shared.refused, 1);
            return Ok(()); // dropping `conn` closes it
        }
        let clone = conn.try_clone()?;
        let id = {
            let mut c = shared.conns();
            let id = c.next_id;
            c.next_id += 1;
            c.streams.insert(id, clone);
            id
        };
        bump(&shared.active, 1);
        let thread_shared = Arc::clone(shared);
        let spawned = std::thread::Builder::new().name(format!("nbd-conn-{id}")).spawn(move || {
            let s = &thread_shared;
            let result = match conn {
                Conn::Unix(stream) => serve_connection(stream, &s.exports),
                Conn::Tcp(stream) => serve_connection(stream, &s.exports),
            };
            if result.is_err() {
                bump(&s.session_errors, 1);
            }
            s.conns().streams.remove(&id);
            s.active.fetch_sub(1, Ordering::Relaxed);
        });
        match spawned {
            Ok(h) => {
                bump(&shared.accepted, 1);
                shared.conns().threads.push(h);
                Ok(())
            }
            Err(e) => {
                shared.conns().streams.remove(&id);
                shared.active.fetch_sub(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    fn close_sessions(&self) {
        let shutdown_all = |how| {
            for s in self.shared.conns().streams.values() {
                s.shutdown(how);
            }
        };
        shutdown_all(Shutdown::Read);
        let deadline = Instant::now() + DRAIN_TIMEOUT;
        let mut forced = false;
        while self.shared.reap() > 0 {
            if !forced && Instant::now() >= deadline {
                shutdown_all(Shutdown::Both);
                forced = true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Runs the server on a new thread; see [`ServerHandle`].
    pub fn spawn(self) -> Result<ServerHandle, NbdError> {
        let stop = Arc::new(AtomicBool::new(false));
        let local = self.local.clone();
        let shared = Arc::clone(&self.shared);
        let thread_stop = Arc::clone(&stop);
        let thread = std::thread::Builder::new().name("nbd-server".into()).spawn(move || {
            let r = self.run_until(&thread_stop);
            drop(self);
            r
        })?;
        Ok(ServerHandle { stop, thread: Some(thread), local, shared })
    }
}

/// A server running on its own thread. Stopping it (explicitly or by drop)
/// ends the sessions, joins the threads and removes the unix socket.
pub struct ServerHandle {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<(), NbdError>>>,
    local: Listen,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for ServerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerHandle").field("local", &self.local).finish_non_exhaustive()
    }
}

impl ServerHandle {
    /// Binds and starts a server.
    pub fn start(config: NbdConfig) -> Result<ServerHandle, NbdError> {
        NbdServer::bind(config)?.spawn()
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> &Listen {
        &self.local
    }

    /// The NBD URI of `export` (empty: the default export).
    pub fn uri(&self, export: &str) -> String {
        self.local.uri(export)
    }

    /// Counters of the server and its exports.
    pub fn stats(&self) -> ServerStats {
        self.shared.stats()
    }

    /// Stops the server and waits for it; returns the accept loop's error,
    /// if it failed.
    pub fn stop(mut self) -> Result<(), NbdError> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<(), NbdError> {
        self.stop.store(true, Ordering::Release);
        match self.thread.take() {
            Some(t) => t.join().map_err(|_| NbdError::Panicked)?,
            None => Ok(()),
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris() {
        let u = Listen::Unix("/tmp/a b/s.sock".into());
        assert_eq!(u.uri(""), "nbd+unix:///?socket=/tmp/a%20b/s.sock");
        assert_eq!(u.uri("disk/1"), "nbd+unix:///disk%2F1?socket=/tmp/a%20b/s.sock");
        let t = Listen::Tcp("127.0.0.1:10809".parse().unwrap());
        assert_eq!(t.uri("d"), "nbd://127.0.0.1:10809/d");
    }
}
