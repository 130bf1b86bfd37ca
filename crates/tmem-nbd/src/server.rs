//! The listener: unix socket (default) or loopback TCP, one thread per
//! connection, a bounded number of connections in all and per client (with
//! a polite refusal past it, after closing an idle connection if one stands
//! in the way), deadlines on the handshake, on requests and replies in
//! transit and optionally on idle connections, and a clean stop.

use std::collections::{HashMap, VecDeque};
use std::fs;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tmem_lock::{Mutex, MutexGuard, Rank};

use crate::limits::{Budget, Timer, Watch};
use crate::park::{Park, Parking, SessionState};
use crate::proto::{MAX_PAYLOAD, PREFERRED_BLOCK_SIZE};
use crate::session::{self, Limits, CHUNK, REQUEST_OVERHEAD};
use crate::stats::{bump, ServerStats};
use crate::{Export, Exports, NbdError, SessionEnd};

/// Default bound on simultaneous connections.
pub const DEFAULT_MAX_CONNECTIONS: usize = 64;
/// Default bound on the connections of one client (a user on a unix
/// socket, an address on TCP): half the default slots, so that one client
/// never locks the others out.
pub const DEFAULT_MAX_CONNECTIONS_PER_PEER: usize = 32;
/// Default time from accept to the end of option negotiation.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Default time without a request after which a connection may be closed
/// to make room for a new client. Closed only then: the kernel's NBD client
/// and QEMU send nothing between requests (no keepalive), and swap on them
/// can sit unused for hours, so a plain idle timeout would break swap.
/// 30 s is well past the gaps inside a burst of requests, and is how long
/// a new client waits at most while idle clients hold every slot.
pub const DEFAULT_IDLE_RECLAIM: Duration = Duration::from_secs(30);
/// Default socket timeout inside a message and on reply writes.
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(30);
/// Default time for a request to arrive in full, and for a reply with a
/// payload to be read, on top of 2 s per MiB of payload.
pub const DEFAULT_TRANSFER_TIMEOUT: Duration = Duration::from_secs(10);
/// Default budget of payload buffers across all connections: 256 MiB.
pub const DEFAULT_MAX_BUFFERED_BYTES: usize = 256 << 20;
/// Default longest wait of a request for buffer budget (as long as a
/// client that stops reading can hold its share: `io_timeout`).
pub const DEFAULT_BUFFER_WAIT: Duration = Duration::from_secs(30);
/// How often the accept loop looks at the stop flag and the deadlines.
const POLL_INTERVAL_MS: i32 = 100;
/// Refusals answered at once past the connection limit; beyond them a
/// connection is closed without a word.
const MAX_REFUSALS: u64 = 8;
/// New clients held (before the greeting) until an idle connection's slot
/// can be reclaimed; beyond them a client past the limit is refused.
const MAX_WAITING: usize = 8;
/// Longest a refusal may take (or the handshake timeout, if shorter).
const REFUSAL_TIMEOUT: Duration = Duration::from_secs(2);
/// Stack of a refusal thread: it only parses option headers.
const REFUSAL_STACK: usize = 256 << 10;
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
    /// Sessions served at once (handshake or transmission). A client past
    /// the limit takes the slot of a connection idle for `idle_reclaim`, or
    /// waits for one that will be; otherwise it gets the greeting, then
    /// `NBD_REP_ERR_SHUTDOWN` with the message "tmem: connection limit (N)
    /// reached" for its options, and is closed. Default
    /// [`DEFAULT_MAX_CONNECTIONS`] (64).
    pub max_connections: usize,
    /// Sessions one client may hold: one user (`SO_PEERCRED`) on a unix
    /// socket, one IPv4 address or IPv6 /64 on TCP. Past it the client's own
    /// idle connections make room, or it is refused as above ("connection
    /// limit per client"). Default [`DEFAULT_MAX_CONNECTIONS_PER_PEER`]
    /// (32, half of `max_connections`); lower it with `max_connections`.
    pub max_connections_per_peer: usize,
    /// Time from accept to entering transmission (`NBD_OPT_GO` or
    /// `NBD_OPT_EXPORT_NAME` done); past it the connection is cut, however
    /// much the client sends meanwhile. Default 10 s.
    pub handshake_timeout: Duration,
    /// A connection in transmission that has sent no request for this long
    /// (counted from the last reply) is closed when a new client needs its
    /// slot: the server, or the client's own share, is full. Never closed
    /// while slots are free, so swap over the kernel's client or QEMU,
    /// which send nothing while idle, keeps its connection. Of the idle
    /// connections, the client holding the most slots loses the one it
    /// opened last (a long-lived swap connection goes last). Default
    /// [`DEFAULT_IDLE_RECLAIM`] (30 s); `None`: never.
    pub idle_reclaim: Option<Duration>,
    /// Close a connection in transmission after this long without a
    /// request (counted from the last reply), whether its slot is needed or
    /// not. Breaks clients that keep an idle connection for swap (the
    /// kernel's, QEMU's). Default `None`: never.
    pub idle_timeout: Option<Duration>,
    /// A socket read inside a message, or a write of a reply, that makes
    /// no progress for this long ends the session, freeing its buffer. A
    /// stuck write first returns what went out, then fails after another
    /// timeout: a client that stops reading its replies is dropped within
    /// one to two of these. Default 30 s.
    pub io_timeout: Duration,
    /// A request must arrive in full (header, then write payload), and a
    /// reply with a payload (read data, block status) be read by the
    /// client, within this plus 2 s per MiB of payload; device time does
    /// not count. Past it the connection is closed: after an `EIO` reply to
    /// a late write payload, at once for a reply. A client that sends or
    /// reads a byte at a time thus holds its buffer for a bounded time.
    /// Default [`DEFAULT_TRANSFER_TIMEOUT`] (10 s: a 32 MiB write has 74 s).
    pub transfer_timeout: Duration,
    /// Largest READ / WRITE payload, advertised as the maximum block size
    /// (`NBD_INFO_BLOCK_SIZE`). A session serves one request at a time, so
    /// this also bounds what one connection buffers (plus a 28-byte reply
    /// header). Larger reads and writes get `EINVAL` (writes over 32 MiB
    /// are a hard disconnect). A multiple of 4096, at most 32 MiB (the
    /// default). Lower values break clients that ignore the advertised
    /// size, such as the Linux kernel.
    pub max_block_size: u32,
    /// Bytes of request and reply payload buffers all connections together
    /// may hold. A request holds at most one 1 MiB chunk (plus a 28-byte
    /// reply header), however large: reads are sent and writes stored a
    /// chunk at a time. So each connection's share is one chunk, and with
    /// the defaults (64 connections, 256 MiB) no request ever waits. With a
    /// smaller budget a request that would go over waits, and its
    /// connection reads no further requests, for at most `buffer_wait`. At
    /// least one chunk (`min(max_block_size, 1 MiB) + 28`). Default 256 MiB.
    pub max_buffered_bytes: usize,
    /// Longest a request waits for buffer budget; then it is answered with
    /// `ENOMEM` and the connection is closed. Default
    /// [`DEFAULT_BUFFER_WAIT`] (30 s).
    pub buffer_wait: Duration,
    /// Permit a TCP address that is not loopback (there is no TLS and no
    /// authentication: anyone who reaches the port can read and write).
    pub allow_remote: bool,
}

impl NbdConfig {
    /// A configuration with the default limits, loopback only.
    pub fn new(exports: Vec<Export>, listen: Listen) -> Self {
        Self {
            exports,
            listen,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_connections_per_peer: DEFAULT_MAX_CONNECTIONS_PER_PEER,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            idle_reclaim: Some(DEFAULT_IDLE_RECLAIM),
            idle_timeout: None,
            io_timeout: DEFAULT_IO_TIMEOUT,
            transfer_timeout: DEFAULT_TRANSFER_TIMEOUT,
            max_block_size: MAX_PAYLOAD,
            max_buffered_bytes: DEFAULT_MAX_BUFFERED_BYTES,
            buffer_wait: DEFAULT_BUFFER_WAIT,
            allow_remote: false,
        }
    }

    /// Checks the limits (the exports and the address are checked by bind).
    fn check_limits(&self) -> Result<(), NbdError> {
        let bad = |what: &str| Err(NbdError::Config(what.into()));
        if self.max_connections == 0 || self.max_connections_per_peer == 0 {
            return bad("max_connections and max_connections_per_peer must be at least 1");
        }
        let zero = [self.handshake_timeout, self.io_timeout, self.transfer_timeout, self.buffer_wait]
            .into_iter()
            .chain(self.idle_timeout)
            .chain(self.idle_reclaim)
            .any(|t| t.is_zero());
        if zero {
            return bad("timeouts must not be zero");
        }
        let b = self.max_block_size;
        if !(PREFERRED_BLOCK_SIZE..=MAX_PAYLOAD).contains(&b) || !b.is_multiple_of(PREFERRED_BLOCK_SIZE) {
            return bad("max_block_size must be a multiple of 4096 from 4096 to 32 MiB");
        }
        if self.max_buffered_bytes
            < usize::try_from(b.min(CHUNK)).unwrap_or(usize::MAX).saturating_add(REQUEST_OVERHEAD)
        {
            return bad("max_buffered_bytes must hold one chunk: min(max_block_size, 1 MiB) + 28 bytes");
        }
        Ok(())
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

    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Listener::Unix(l) => l.as_fd(),
            Listener::Tcp(l) => l.as_fd(),
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
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Conn::Unix(s) => s.as_fd(),
            Conn::Tcp(s) => s.as_fd(),
        }
    }

    fn try_clone(&self) -> io::Result<Conn> {
        Ok(match self {
            Conn::Unix(s) => Conn::Unix(s.try_clone()?),
            Conn::Tcp(s) => Conn::Tcp(s.try_clone()?),
        })
    }

    /// Read and write timeouts of the socket.
    fn set_timeouts(&self, t: Duration) -> io::Result<()> {
        match self {
            Conn::Unix(s) => {
                s.set_read_timeout(Some(t))?;
                s.set_write_timeout(Some(t))
            }
            Conn::Tcp(s) => {
                s.set_read_timeout(Some(t))?;
                s.set_write_timeout(Some(t))
            }
        }
    }

    fn shutdown(&self, how: Shutdown) {
        // The peer may be gone already; nothing to do about errors here.
        let _ = match self {
            Conn::Unix(s) => s.shutdown(how),
            Conn::Tcp(s) => s.shutdown(how),
        };
    }

    /// The client, for the per-client slot cap.
    fn peer(&self) -> Peer {
        match self {
            Conn::Unix(s) => {
                rustix::net::sockopt::socket_peercred(s).map_or(Peer::Unknown, |c| Peer::Uid(c.uid.as_raw()))
            }
            Conn::Tcp(s) => s.peer_addr().map_or(Peer::Unknown, |a| Peer::of_ip(a.ip())),
        }
    }
}

/// Who a connection comes from, for the per-client slot cap. On loopback
/// TCP every local user can pick any address of 127.0.0.0/8, so there the
/// cap holds only against one address; the unix socket (mode 0600) names
/// the user.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Peer {
    /// A unix socket peer's user (`SO_PEERCRED`).
    Uid(u32),
    /// A TCP peer's IPv4 address (IPv4-mapped IPv6 included).
    V4(Ipv4Addr),
    /// A TCP peer's IPv6 /64: one host commonly holds a whole /64.
    V6(u64),
    /// Not known (the lookup failed): such connections share one cap.
    Unknown,
}

impl Peer {
    fn of_ip(ip: IpAddr) -> Peer {
        match ip {
            IpAddr::V4(a) => Peer::V4(a),
            IpAddr::V6(a) => match a.to_ipv4_mapped() {
                Some(v4) => Peer::V4(v4),
                None => Peer::V6(u64::try_from(a.to_bits() >> 64).unwrap_or(u64::MAX)),
            },
        }
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
    // SAFETY: the caller's socket `fd` stays open for this call.
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    let mut pfd = [rustix::event::PollFd::new(&fd, rustix::event::PollFlags::IN)];
    // A negative timeout waits forever, as poll(2)'s does.
    let timeout = (timeout_ms >= 0).then(|| rustix::event::Timespec {
        tv_sec: i64::from(timeout_ms / 1000),
        tv_nsec: i64::from(timeout_ms % 1000) * 1_000_000,
    });
    match rustix::event::poll(&mut pfd, timeout.as_ref()) {
        Ok(n) => Ok(n > 0),
        Err(rustix::io::Errno::INTR) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// A live connection (session or refusal) as the accept loop sees it.
struct Tracked {
    /// A clone of its socket, to cut it on a deadline or on stop.
    stream: Conn,
    watch: Arc<Watch>,
    /// The client whose slot it holds; `None` for refusals, and once its
    /// slot was reclaimed.
    slot: Option<Peer>,
}

/// A new client past a limit, held before its greeting until an idle
/// connection's slot can be reclaimed.
struct Waiting {
    conn: Conn,
    peer: Peer,
    since: Instant,
}

/// Why a client is turned away.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Full {
    /// `max_connections` sessions are open.
    Server,
    /// Its client holds `max_connections_per_peer` sessions.
    Peer,
}

/// What a new client gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Admission {
    /// A slot, taken for it.
    Slot,
    /// Nothing yet: an idle connection will be reclaimable soon.
    Wait(Full),
    /// Nothing.
    Refuse(Full),
}

#[derive(Default)]
struct Conns {
    next_id: u64,
    live: HashMap<u64, Tracked>,
    threads: Vec<JoinHandle<()>>,
    /// Slots held, in all and per client.
    slots: usize,
    peers: HashMap<Peer, usize>,
    waiting: VecDeque<Waiting>,
}

impl Conns {
    fn held_by(&self, peer: Peer) -> usize {
        self.peers.get(&peer).copied().unwrap_or(0)
    }

    fn take_slot(&mut self, peer: Peer) {
        self.slots += 1;
        *self.peers.entry(peer).or_insert(0) += 1;
    }

    fn release_slot(&mut self, peer: Peer) {
        self.slots -= 1;
        if let Some(n) = self.peers.get_mut(&peer) {
            *n -= 1;
            if *n == 0 {
                self.peers.remove(&peer);
            }
        }
    }

    /// Stops tracking a connection, freeing its slot.
    fn untrack(&mut self, id: u64) {
        if let Some(Tracked { slot: Some(peer), .. }) = self.live.remove(&id) {
            self.release_slot(peer);
        }
    }

    /// Gives `peer` a slot if one is free, or reclaims one from an idle
    /// connection in its way (see [`NbdConfig::idle_reclaim`]).
    fn admit(&mut self, peer: Peer, lim: &ServerLimits, reclaims: &AtomicU64) -> Admission {
        let peer_full = self.held_by(peer) >= lim.max_connections_per_peer;
        let full = if self.slots >= lim.max_connections {
            Full::Server
        } else if peer_full {
            Full::Peer
        } else {
            self.take_slot(peer);
            return Admission::Slot;
        };
        let Some(after) = lim.idle_reclaim else { return Admission::Refuse(full) };
        // Under its own cap only the client's own connections make room.
        let scope = peer_full.then_some(peer);
        // Each failed reclaim is a connection that began a request since.
        for _ in 0..=self.live.len() {
            let mut soon = false;
            let mut best: Option<((usize, u64), u64, u64)> = None;
            for (&id, t) in &self.live {
                let Some(p) = t.slot else { continue };
                if scope.is_some_and(|s| s != p) {
                    continue;
                }
                let Some((word, idled)) = t.watch.idle_for() else { continue };
                if idled < after {
                    soon = true;
                    continue;
                }
                // The client holding the most slots first, then its newest
                // connection: a long-lived one (swap) goes last.
                let rank = (self.held_by(p), id);
                if best.is_none_or(|(r, ..)| rank > r) {
                    best = Some((rank, id, word));
                }
            }
            let Some((_, id, word)) = best else {
                return if soon { Admission::Wait(full) } else { Admission::Refuse(full) };
            };
            if let Some(t) = self.live.get_mut(&id) {
                if t.watch.reclaim(word) {
                    t.stream.shutdown(Shutdown::Both);
                    if let Some(p) = t.slot.take() {
                        self.release_slot(p);
                    }
                    bump(reclaims, 1);
                    self.take_slot(peer);
                    return Admission::Slot;
                }
            }
        }
        Admission::Refuse(full)
    }
}

struct Shared {
    exports: Exports,
    conns: Mutex<Conns>,
    budget: Budget,
    limits: ServerLimits,
    accepted: AtomicU64,
    refused_connection_limit: AtomicU64,
    refused_peer_limit: AtomicU64,
    slot_waits: AtomicU64,
    idle_reclaims: AtomicU64,
    handshake_timeouts: AtomicU64,
    idle_timeouts: AtomicU64,
    request_timeouts: AtomicU64,
    reply_timeouts: AtomicU64,
    io_timeouts: AtomicU64,
    active: AtomicU64,
    /// Refusal threads running.
    refusing: AtomicU64,
    session_errors: AtomicU64,
    /// The pause switch of a hand-over.
    parking: Parking,
}

impl Shared {
    fn conns(&self) -> MutexGuard<'_, Conns> {
        self.conns.lock()
    }

    fn stats(&self) -> ServerStats {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let n = |v: usize| u64::try_from(v).unwrap_or(u64::MAX);
        ServerStats {
            connections_accepted: l(&self.accepted),
            connections_active: l(&self.active),
            connections_max: n(self.limits.max_connections),
            connections_per_peer_max: n(self.limits.max_connections_per_peer),
            refused_connection_limit: l(&self.refused_connection_limit),
            refused_peer_limit: l(&self.refused_peer_limit),
            slot_waits: l(&self.slot_waits),
            idle_reclaims: l(&self.idle_reclaims),
            handshake_timeouts: l(&self.handshake_timeouts),
            idle_timeouts: l(&self.idle_timeouts),
            request_timeouts: l(&self.request_timeouts),
            reply_timeouts: l(&self.reply_timeouts),
            io_timeouts: l(&self.io_timeouts),
            session_errors: l(&self.session_errors),
            buffered_bytes: self.budget.held(),
            buffered_bytes_peak: self.budget.peak(),
            buffered_bytes_max: n(self.budget.limit()),
            buffer_waits: self.budget.waits(),
            buffer_wait_timeouts: self.budget.wait_timeouts(),
            exports: self.exports.stats(),
        }
    }

    /// Starts tracking a connection (holding a slot of `slot`'s, if given);
    /// returns its id.
    fn track(&self, stream: Conn, watch: Arc<Watch>, slot: Option<Peer>) -> u64 {
        let mut c = self.conns();
        let id = c.next_id;
        c.next_id += 1;
        c.live.insert(id, Tracked { stream, watch, slot });
        id
    }

    /// Cuts the connections whose deadline passed. A request that did not
    /// arrive in time is cut for reading only, so that the session can
    /// still send an error reply.
    fn enforce_deadlines(&self) {
        for t in self.conns().live.values() {
            let (counter, how) = match t.watch.expire() {
                None => continue,
                Some(Timer::Handshake) => (Some(&self.handshake_timeouts), Shutdown::Both),
                Some(Timer::Idle) => (Some(&self.idle_timeouts), Shutdown::Both),
                Some(Timer::Request) => (Some(&self.request_timeouts), Shutdown::Read),
                Some(Timer::Reply) => (Some(&self.reply_timeouts), Shutdown::Both),
                Some(Timer::Refusal) => (None, Shutdown::Both),
            };
            t.stream.shutdown(how);
            if let Some(c) = counter {
                bump(c, 1);
            }
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

/// The limits a bound server applies.
#[derive(Clone, Copy, Debug)]
struct ServerLimits {
    max_connections: usize,
    /// Never above `max_connections`.
    max_connections_per_peer: usize,
    handshake_timeout: Duration,
    idle_reclaim: Option<Duration>,
    idle_timeout: Option<Duration>,
    io_timeout: Duration,
    transfer_timeout: Duration,
    max_block_size: u32,
    buffer_wait: Duration,
}

/// A bound NBD server. [`NbdServer::run_until`] serves it on the calling
/// thread; [`NbdServer::spawn`] runs it on a thread of its own.
pub struct NbdServer {
    listener: Listener,
    local: Listen,
    limits: ServerLimits,
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
        let (listener, local, socket_file) = match &config.listen {
            Listen::Tcp(addr) => {
                if !config.allow_remote && !addr.ip().is_loopback() {
                    return Err(NbdError::RemoteNotAllowed(*addr));
                }
                let l = TcpListener::bind(addr)?;
                let local = Listen::Tcp(l.local_addr()?);
                (Listener::Tcp(l), local, None)
            }
            Listen::Unix(path) => {
                let (l, file) = bind_unix(path)?;
                (Listener::Unix(l), Listen::Unix(path.clone()), Some(file))
            }
        };
        Self::assemble(config, listener, local, socket_file)
    }

    /// A server on the listener and sessions a predecessor process handed
    /// over (`config.listen` says what the listener is), serving each
    /// session from its next request on.
    pub fn adopt(
        config: NbdConfig,
        listener: OwnedFd,
        sessions: Vec<(OwnedFd, SessionState)>,
    ) -> Result<NbdServer, NbdError> {
        let (listener, socket_file) = match &config.listen {
            Listen::Tcp(_) => (Listener::Tcp(TcpListener::from(listener)), None),
            Listen::Unix(path) => {
                let m = fs::symlink_metadata(path)?;
                let file = SocketFile { path: path.clone(), dev: m.dev(), ino: m.ino() };
                (Listener::Unix(UnixListener::from(listener)), Some(file))
            }
        };
        let local = config.listen.clone();
        let server = Self::assemble(config, listener, local, socket_file)?;
        for (fd, state) in sessions {
            let conn = match server.listener {
                Listener::Unix(_) => Conn::Unix(UnixStream::from(fd)),
                Listener::Tcp(_) => Conn::Tcp(TcpStream::from(fd)),
            };
            // Admitted by the predecessor: a slot even past the limits.
            let peer = conn.peer();
            server.shared.conns().take_slot(peer);
            if let Err(e) = server.start_session(conn, peer, Some(state)) {
                server.shared.conns().release_slot(peer);
                return Err(e.into());
            }
        }
        Ok(server)
    }

    fn assemble(
        config: NbdConfig,
        listener: Listener,
        local: Listen,
        socket_file: Option<SocketFile>,
    ) -> Result<NbdServer, NbdError> {
        config.check_limits()?;
        let limits = ServerLimits {
            max_connections: config.max_connections,
            max_connections_per_peer: config.max_connections_per_peer.min(config.max_connections),
            handshake_timeout: config.handshake_timeout,
            idle_reclaim: config.idle_reclaim,
            idle_timeout: config.idle_timeout,
            io_timeout: config.io_timeout,
            transfer_timeout: config.transfer_timeout,
            max_block_size: config.max_block_size,
            buffer_wait: config.buffer_wait,
        };
        let exports = Exports::new(config.exports)?;
        let shared = Arc::new(Shared {
            exports,
            conns: Mutex::new(Rank::NbdConns, Conns::default()),
            budget: Budget::new(config.max_buffered_bytes),
            limits,
            accepted: AtomicU64::new(0),
            refused_connection_limit: AtomicU64::new(0),
            refused_peer_limit: AtomicU64::new(0),
            slot_waits: AtomicU64::new(0),
            idle_reclaims: AtomicU64::new(0),
            handshake_timeouts: AtomicU64::new(0),
            idle_timeouts: AtomicU64::new(0),
            request_timeouts: AtomicU64::new(0),
            reply_timeouts: AtomicU64::new(0),
            io_timeouts: AtomicU64::new(0),
            active: AtomicU64::new(0),
            refusing: AtomicU64::new(0),
            session_errors: AtomicU64::new(0),
            parking: Parking::new()?,
        });
        Ok(NbdServer { listener, local, limits, shared, _socket_file: socket_file })
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
    /// least every 100 ms, as are the connections' deadlines), then ends
    /// the sessions: each finishes its
    /// current request and sees end-of-stream; those still running after
    /// 5 s have their sockets cut. The listener stays bound until the
    /// server is dropped (which removes the unix socket file).
    pub fn run_until(&self, stop: &AtomicBool) -> Result<(), NbdError> {
        let fd = self.listener.fd();
        let result = loop {
            if stop.load(Ordering::Acquire) {
                break Ok(());
            }
            if self.shared.parking.paused() {
                // Paused for a hand-over: new clients wait in the backlog.
                std::thread::sleep(Duration::from_millis(10));
                self.shared.enforce_deadlines();
                continue;
            }
            self.admit_waiting();
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
            self.shared.enforce_deadlines();
            self.shared.reap();
        };
        self.close_sessions();
        result
    }

    fn accept_one(&self) -> io::Result<()> {
        let conn = self.listener.accept()?;
        let peer = conn.peer();
        let shared = &self.shared;
        let admission = {
            let mut c = shared.conns();
            // No slot at once: it waits behind those already waiting.
            match c.admit(peer, &self.limits, &shared.idle_reclaims) {
                Admission::Wait(full) if c.waiting.len() >= MAX_WAITING => Admission::Refuse(full),
                Admission::Wait(_) => {
                    bump(&shared.slot_waits, 1);
                    c.waiting.push_back(Waiting { conn, peer, since: Instant::now() });
                    return Ok(());
                }
                a => a,
            }
        };
        match admission {
            Admission::Slot => self.open_session(conn, peer),
            Admission::Wait(full) | Admission::Refuse(full) => self.refuse(conn, full),
        }
    }

    /// Gives the waiting clients the slots of connections that have been
    /// idle long enough; refuses those whose wait is over.
    fn admit_waiting(&self) {
        let shared = &self.shared;
        // At most a reclaim's wait, plus the accept loop's period.
        let wait = self.limits.idle_reclaim.unwrap_or_default().saturating_add(Duration::from_secs(1));
        let mut start = Vec::new();
        let mut turn_away = Vec::new();
        {
            let mut c = shared.conns();
            if c.waiting.is_empty() {
                return;
            }
            for w in std::mem::take(&mut c.waiting) {
                match c.admit(w.peer, &self.limits, &shared.idle_reclaims) {
                    Admission::Slot => start.push(w),
                    Admission::Wait(_) if w.since.elapsed() < wait => c.waiting.push_back(w),
                    Admission::Wait(full) | Admission::Refuse(full) => turn_away.push((w.conn, full)),
                }
            }
        }
        for w in start {
            // A failed start has closed the client; the others go on.
            let _ = self.open_session(w.conn, w.peer);
        }
        for (conn, full) in turn_away {
            let _ = self.refuse(conn, full);
        }
    }

    /// Starts the session of a client admitted to a slot, or frees the slot.
    fn open_session(&self, conn: Conn, peer: Peer) -> io::Result<()> {
        self.start_session(conn, peer, None).inspect_err(|_| self.shared.conns().release_slot(peer))
    }

    /// Serves `conn`, which holds a slot of `peer`'s, on a thread of its
    /// own: from the handshake on, or, for a session handed over by a
    /// predecessor, from its next request. On error the caller frees the
    /// slot.
    fn start_session(&self, conn: Conn, peer: Peer, resumed: Option<SessionState>) -> io::Result<()> {
        let shared = &self.shared;
        let lim = self.limits;
        conn.set_timeouts(lim.io_timeout)?;
        let watch = Arc::new(Watch::new(Timer::Handshake, lim.handshake_timeout, lim.idle_timeout));
        let id = shared.track(conn.try_clone()?, Arc::clone(&watch), Some(peer));
        bump(&shared.active, 1);
        let thread_shared = Arc::clone(shared);
        let spawned = std::thread::Builder::new().name(format!("nbd-conn-{id}")).spawn(move || {
            let s = &thread_shared;
            let limits = Limits {
                max_block: lim.max_block_size,
                budget: Some(&s.budget),
                budget_wait: lim.buffer_wait,
                watch: Some(&watch),
                transfer: lim.transfer_timeout,
                park: Some(Park { parking: &s.parking, id, fd: conn.as_fd() }),
            };
            let result = match (&conn, resumed) {
                (Conn::Unix(stream), None) => session::serve(stream, &s.exports, limits),
                (Conn::Tcp(stream), None) => session::serve(stream, &s.exports, limits),
                (Conn::Unix(stream), Some(st)) => session::resume(stream, &s.exports, limits, st),
                (Conn::Tcp(stream), Some(st)) => session::resume(stream, &s.exports, limits, st),
            };
            match result {
                // Counted by the accept loop, which cut the connection.
                _ if watch.fired().is_some() => {}
                // The successor serves the socket through its own copy.
                Ok(SessionEnd::HandedOver) => {}
                Ok(_) => {}
                // Counted by the budget.
                Err(NbdError::BufferWait) => {}
                Err(NbdError::TimedOut) => bump(&s.io_timeouts, 1),
                Err(_) => bump(&s.session_errors, 1),
            }
            s.conns().untrack(id);
            s.active.fetch_sub(1, Ordering::Relaxed);
        });
        match spawned {
            Ok(h) => {
                bump(&shared.accepted, 1);
                shared.conns().threads.push(h);
                Ok(())
            }
            Err(e) => {
                // The caller frees the slot.
                shared.conns().live.remove(&id);
                shared.active.fetch_sub(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    /// Answers a client past a connection limit on a small thread of its
    /// own, under a short deadline; past [`MAX_REFUSALS`] of them at once,
    /// just closes it.
    fn refuse(&self, conn: Conn, full: Full) -> io::Result<()> {
        let shared = &self.shared;
        let (counter, message) = match full {
            Full::Server => (
                &shared.refused_connection_limit,
                format!("tmem: connection limit ({}) reached", self.limits.max_connections),
            ),
            Full::Peer => (
                &shared.refused_peer_limit,
                format!("tmem: connection limit per client ({}) reached", self.limits.max_connections_per_peer),
            ),
        };
        bump(counter, 1);
        if shared.refusing.fetch_add(1, Ordering::Relaxed) >= MAX_REFUSALS {
            shared.refusing.fetch_sub(1, Ordering::Relaxed);
            return Ok(()); // dropping `conn` closes it
        }
        let timeout = self.limits.handshake_timeout.min(REFUSAL_TIMEOUT);
        let watch = Arc::new(Watch::new(Timer::Refusal, timeout, None));
        let tracked = conn.set_timeouts(timeout).and_then(|()| conn.try_clone());
        let id = match tracked {
            Ok(clone) => shared.track(clone, watch, None),
            Err(e) => {
                shared.refusing.fetch_sub(1, Ordering::Relaxed);
                return Err(e);
            }
        };
        let thread_shared = Arc::clone(shared);
        let spawned =
            std::thread::Builder::new().name("nbd-refuse".into()).stack_size(REFUSAL_STACK).spawn(move || {
                let s = &thread_shared;
                // The client is turned away either way: errors do not matter.
                let _ = match conn {
                    Conn::Unix(stream) => session::refuse(stream, &s.exports, &message),
                    Conn::Tcp(stream) => session::refuse(stream, &s.exports, &message),
                };
                s.conns().live.remove(&id);
                s.refusing.fetch_sub(1, Ordering::Relaxed);
            });
        match spawned {
            Ok(h) => {
                shared.conns().threads.push(h);
                Ok(())
            }
            Err(e) => {
                shared.conns().live.remove(&id);
                shared.refusing.fetch_sub(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    fn close_sessions(&self) {
        // Closes the clients still waiting for a slot.
        drop(std::mem::take(&mut self.shared.conns().waiting));
        let shutdown_all = |how| {
            for t in self.shared.conns().live.values() {
                t.stream.shutdown(how);
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
        let listener = self.listener.as_fd().try_clone_to_owned()?;
        let thread_stop = Arc::clone(&stop);
        let thread = std::thread::Builder::new().name("nbd-server".into()).spawn(move || {
            let r = self.run_until(&thread_stop);
            drop(self);
            r
        })?;
        Ok(ServerHandle { stop, thread: Some(thread), local, shared, listener })
    }
}

/// A server running on its own thread. Stopping it (explicitly or by drop)
/// ends the sessions, joins the threads and removes the unix socket.
pub struct ServerHandle {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<(), NbdError>>>,
    local: Listen,
    shared: Arc<Shared>,
    /// A copy of the listening socket, to hand over.
    listener: OwnedFd,
}

/// What a paused server hands to a successor: its listening socket and its
/// sessions' sockets with what each negotiated.
#[derive(Debug)]
pub struct NbdHandover {
    /// The listening socket.
    pub listener: OwnedFd,
    /// Each session's socket and state.
    pub sessions: Vec<(OwnedFd, SessionState)>,
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

    /// Pauses for a hand-over: accepts no one, and every session stops
    /// between two requests (within `timeout`, or this resumes and says
    /// why). Returns copies of the sockets with the sessions' states.
    pub fn pause(&self, timeout: Duration) -> Result<NbdHandover, String> {
        let shared = &self.shared;
        let parked =
            shared.parking.pause(|| usize::try_from(shared.active.load(Ordering::Relaxed)).unwrap_or(0), timeout)?;
        let copies = (|| -> io::Result<NbdHandover> {
            let conns = shared.conns();
            let mut sessions = Vec::with_capacity(parked.len());
            for (id, state) in &parked {
                let t = conns.live.get(id).ok_or_else(|| io::Error::other(format!("session {id} is gone")))?;
                sessions.push((t.stream.as_fd().try_clone_to_owned()?, *state));
            }
            Ok(NbdHandover { listener: self.listener.try_clone()?, sessions })
        })();
        copies.map_err(|e| {
            shared.parking.resume();
            format!("cannot copy the NBD sockets: {e}")
        })
    }

    /// Goes on after [`ServerHandle::pause`].
    pub fn resume(&self) {
        self.shared.parking.resume();
    }

    /// Ends the paused sessions after a successor took their sockets over
    /// (closing this process's copies leaves the connections open).
    pub fn handed_over(&self) {
        self.shared.parking.handed_over();
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
