//! Restart without losing a page (issue 12, `tmem swap restart`): a new
//! daemon process, possibly a newer binary, takes over from the running one
//! while the kernel keeps swapping.
//!
//! The running daemon listens on `handover.sock` in its runtime directory
//! (0600, owner only). A successor (`tmem daemon --takeover DIR`) connects:
//!
//! 1. successor → `HELLO`: its hand-over protocol, store export format and
//!    version. The running daemon refuses (`REFUSE` with the reason, and
//!    goes on serving) another protocol or format, FUSE over io_uring with
//!    a successor that cannot take ring entries over (`fuse_uring`), and
//!    tiers with a successor that does not take shared stores. A daemon
//!    under systemd hands over too: its `OFFER` names the
//!    notify socket and the watchdog, for a successor that `ExecReload`
//!    started;
//!
//!    **Pre-copy** (the successor says `precopy`, and every store keeps its
//!    pages in a memfd): before it pauses, the running daemon starts
//!    recording each store's changes and sends `SNAPSHOT` (its spec), then
//!    each store's index snapshot ([`tmem_core::Store::export_snapshot`]),
//!    all while it serves. The successor builds each store's index from it
//!    ([`tmem_core::Snapshot::read`]) and answers `PREBUILT`, a byte per
//!    store: 1 if the store it will build can complete the snapshot (same
//!    grouping and shards), else 0, and that store's index then travels
//!    whole in the pause. Requests wait from `PREBUILT` on, and the image
//!    in the pause carries only the changes since the snapshot: the pause
//!    grows with what the jobs did meanwhile, not with the pool;
//! 2. it pauses its FUSE workers (they answer what they have taken and take
//!    nothing more, so requests wait in the kernel; over io_uring, each
//!    ring entry is left holding a request, unanswered, which the
//!    successor answers and so takes the entry: `tmem_fuse::RingHandover`),
//!    its NBD sessions
//!    (each stops between two requests; clients' requests wait in the
//!    sockets, new clients in the listener's backlog) and its ublk queues
//!    (each stops before its next request, which stays taken): the stores
//!    are still;
//! 3. running → `OFFER`: its spec and status (devices, loop devices, steps),
//!    what each NBD session negotiated, and how the stores travel:
//!    * **shared** (`images`: both sides can, and every store keeps its
//!      pages in a memfd, as the daemon's stores do): nothing more until
//!      the successor says `READY`; then the running daemon seals its
//!      stores ([`tmem_core::Store::seal`]), sends the descriptors (below)
//!      with each store's memfd after them, and each store's image
//!      ([`tmem_core::Store::export_image`]): the index and the allocator's
//!      tables, no page. The successor maps the memfds and rebuilds the
//!      index and the tables: the pause grows with the number of pages,
//!      not with their bytes; after a pre-copy, with the number changed
//!      since the snapshot ([`tmem_core::Store::import_image_after`]).
//!    * **tiers** (before either): writeback to them is held
//!      ([`tmem_core::Store::hold_tiers`]) and each tier describes itself
//!      ([`tmem_tier::Tier::hand_over`]); the offer lists them, their
//!      states follow it, and their descriptors (a disk tier's file) come
//!      after the NBD sockets, before the memfds. The successor adopts them
//!      ([`crate::tiers::TierArgs::adopt`]) and imports its stores with
//!      them ([`tmem_core::Store::import_tiered`]); they own nothing
//!      ([`tmem_tier::Tier::set_owner`]) until it serves.
//!    * **streamed** (an older successor, or a store in private memory):
//!      each store's export ([`tmem_core::Store::export`]), pages and all;
//!      once the successor says `READY`, the descriptors.
//!
//!    The descriptors (`SCM_RIGHTS`): the runtime directory's lock, the
//!    FUSE connection, the memfds of its ring entries' buffers (io_uring),
//!    the NBD listener and each NBD session's socket;
//! 4. the successor imports the stores, builds the devices, its FUSE
//!    workers (paused) and its NBD server (not yet started), and answers
//!    `TAKEN`; or `FAILED` with the reason. It serves nothing, and an
//!    imported image stays sealed, until `TAKEN` is sent: a failed
//!    hand-over leaves the old process's pages as they were.
//! 5. On `TAKEN` the old process answers `GONE`, stops its workers and
//!    exits without unmounting; the mount, the loop devices and swap never
//!    change. With shared stores, or under a service manager, it first
//!    waits for `LOCKED`: the successor, serving by then, has faulted
//!    every pool page into itself (so that its `mlockall` locks them; until
//!    then the old process's mappings keep them locked, out of reclaim's
//!    reach) and has told systemd that it is the unit's main process now
//!    (`MAINPID=`, [`crate::supervisor`]), which systemd must hear before it
//!    sees the old main process end. On anything else (`FAILED`, a closed
//!    socket, no answer within [`ANSWER_TIMEOUT`]) it opens its stores
//!    again, stops recording changes, resumes and goes on serving.
//! 6. The successor serves once it reads `GONE`, or once the old process
//!    has ended; only then does it write the state file and bind the
//!    control and hand-over sockets, so a successor that fails before
//!    leaves the old process reachable. Its ublk devices come last, after
//!    `LOCKED`: the old process's end is what quiesces them (the kernel
//!    keeps their requests, and requeues those the old queues held), and
//!    the successor takes each with `START_USER_RECOVERY`
//!    ([`tmem_ublk::UblkDevice::recover`]); the kernel then reissues every
//!    kept request to it. If the old process still runs without saying
//!    `GONE` (it gave up waiting and resumed), the successor exits at once
//!    and serves nothing: two processes never serve the same pages.
//!
//! What a process sees meanwhile: its swap-ins and swap-outs wait for the
//! length of the pause (the successor logs it), and none fails.

use std::io::{BufReader, BufWriter, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, IntoRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use tmem_block::{CacheDevice, DeviceConfig, PoolDevice};
use tmem_core::{Snapshot, Store, HANDOVER_VERSION};
use tmem_ctl::Status;
use tmem_fuse::{AdoptedRing, Export, FuseConfig, FuseMount, Transport};

use crate::daemon::{log, Daemon, MOUNT_DIR};
use crate::runtime::RuntimeDir;
use crate::spec::store_config;
use crate::supervisor::Supervisor;
use crate::{DaemonError, DaemonSpec};

/// The socket a successor connects to, in the runtime directory.
pub const SOCKET: &str = "handover.sock";
/// This build's hand-over protocol; a successor speaking another is refused.
pub const PROTOCOL: u32 = 1;
/// How long the running daemon, paused, waits for the successor's answer.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(120);
/// How long NBD sessions may take to reach a pause between two requests.
const NBD_PAUSE_TIMEOUT: Duration = Duration::from_secs(5);
/// Set once this process has told a successor that it is gone: from then
/// on it never serves again, even after a panic.
static SAID_GONE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// Largest frame (spec and status JSON).
const MAX_FRAME: u32 = 16 << 20;

const HELLO: u8 = b'H';
const REFUSE: u8 = b'R';
const OFFER: u8 = b'O';
const READY: u8 = b'Y';
const TAKEN: u8 = b'K';
const FAILED: u8 = b'F';
const GONE: u8 = b'G';
const LOCKED: u8 = b'L';
const SNAPSHOT: u8 = b'S';
const PREBUILT: u8 = b'P';
/// A successor's state from `LOCKED` until its ublk devices are taken.
const RECOVERING: &str = "recovering ublk devices";
/// What a successor's step says of a ublk device it could not take.
pub const UBLK_NOT_RECOVERED: &str = "user recovery failed";

#[derive(serde::Serialize, serde::Deserialize)]
struct Hello {
    protocol: u32,
    store_format: u32,
    version: String,
    /// The successor adopts shared stores (memfds and images); successors
    /// before zero-copy hand-over leave it out.
    #[serde(default)]
    images: bool,
    /// The successor takes the kernel's NBD devices over (the NBD
    /// transport); successors before it leave it out.
    #[serde(default)]
    kernel_nbd: bool,
    /// The successor takes ublk devices over (user recovery); successors
    /// before the ublk transport leave it out.
    #[serde(default)]
    ublk: bool,
    /// The successor builds the index from a snapshot taken while the
    /// running daemon serves (pre-copy); successors before it leave it out.
    #[serde(default)]
    precopy: bool,
    /// The successor takes FUSE-over-io_uring entries over, with the
    /// requests they hold; successors before it leave it out.
    #[serde(default)]
    fuse_uring: bool,
}

/// What comes before the snapshots of a pre-copy hand-over: the spec, from
/// which the successor knows how it will build each store.
#[derive(serde::Serialize, serde::Deserialize)]
struct SnapshotOffer {
    spec: DaemonSpec,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Offer {
    spec: DaemonSpec,
    status: Status,
    /// What each NBD session negotiated, in the order their sockets follow.
    nbd_sessions: Vec<tmem_nbd::SessionState>,
    /// The stores follow as images, their memfds after the descriptors.
    #[serde(default)]
    images: bool,
    /// The service manager that supervises the running daemon (systemd),
    /// for a successor to tell it the new main process.
    #[serde(default)]
    supervisor: Option<crate::supervisor::Handed>,
    /// Per store, what its tiers handed over, in chain order per pool. The
    /// states follow the offer, one frame each; the descriptors come
    /// before the memfds.
    #[serde(default)]
    tiers: Vec<Vec<HandedTier>>,
    /// Each device's, then each cache's, counters when it paused: the
    /// successor counts on from them ([`PoolDevice::carry_on`]).
    #[serde(default)]
    counters: Vec<tmem_block::DeviceStats>,
    /// The kernel's NBD devices (the NBD transport); their sockets follow
    /// the NBD server's, in this order.
    #[serde(default)]
    kernel_nbd: Vec<HandedNbd>,
    /// The ublk devices (the ublk transport), paused; the successor takes
    /// each with `START_USER_RECOVERY` once this process has ended.
    #[serde(default)]
    ublk: Vec<HandedUblk>,
    /// FUSE over io_uring: the ring entries, each holding a request, and
    /// where their buffers are; the buffers' memfds follow the FUSE
    /// connection, in [`tmem_fuse::RingHandover::regions`] order.
    #[serde(default)]
    fuse_ring: Option<tmem_fuse::RingHandover>,
}

/// The kernel's block devices on this daemon, paused for a hand-over.
struct KernelDevices {
    /// Each NBD device, with copies of its sockets.
    nbd: Vec<(HandedNbd, Vec<OwnedFd>)>,
    ublk: Vec<HandedUblk>,
}

/// One `/dev/ublkbN` of the ublk transport, its queues paused.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct HandedUblk {
    /// Its export: a device, or a cache after the devices.
    pub(crate) export: usize,
    /// N of `/dev/ublkbN`.
    pub(crate) id: u32,
}

/// One `/dev/nbdN` of the NBD transport, paused between two requests.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct HandedNbd {
    /// Its export: a device, or a cache after the devices.
    export: usize,
    /// N of `/dev/nbdN`.
    index: u32,
    /// Each connection's session, in the order of their sockets.
    sessions: Vec<tmem_nbd::SessionState>,
}

/// One tier's part of the offer ([`tmem_tier::Tier::hand_over`]).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct HandedTier {
    /// The store's pool it sits below.
    pool: u32,
    kind: String,
    /// Bytes of its state frame.
    state_bytes: u64,
    /// Its descriptors.
    fds: usize,
}

/// Largest tier state frame: an index of 2^28 values and then some.
const MAX_TIER_STATE: u64 = 16 << 30;

/// Sends a tier's state: its length, then its bytes.
fn send_state_frame(w: &mut impl Write, state: &[u8]) -> Result<(), DaemonError> {
    w.write_all(&(state.len() as u64).to_le_bytes()).and_then(|()| w.write_all(state)).map_err(err)
}

/// Reads a tier's state of `len` bytes, as the offer announced it.
fn recv_state_frame(r: &mut impl Read, len: u64) -> Result<Vec<u8>, DaemonError> {
    let mut head = [0u8; 8];
    r.read_exact(&mut head).map_err(err)?;
    if u64::from_le_bytes(head) != len || len > MAX_TIER_STATE {
        return Err(err(format!("a tier state of {} bytes where the offer said {len}", u64::from_le_bytes(head))));
    }
    let mut state = vec![0u8; usize::try_from(len).map_err(err)?];
    r.read_exact(&mut state).map_err(err)?;
    Ok(state)
}

fn err(e: impl std::fmt::Display) -> DaemonError {
    DaemonError::Lifecycle(format!("hand-over: {e}"))
}

fn send(w: &mut impl Write, tag: u8, body: &[u8]) -> Result<(), DaemonError> {
    let len = u32::try_from(body.len()).map_err(err)?;
    w.write_all(&[tag]).and_then(|()| w.write_all(&len.to_le_bytes())).and_then(|()| w.write_all(body)).map_err(err)?;
    w.flush().map_err(err)
}

fn recv(r: &mut impl Read) -> Result<(u8, Vec<u8>), DaemonError> {
    let mut head = [0u8; 5];
    r.read_exact(&mut head).map_err(err)?;
    let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]);
    if len > MAX_FRAME {
        return Err(err(format!("a frame of {len} bytes")));
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body).map_err(err)?;
    Ok((head[0], body))
}

/// Most descriptors one hand-over passes (the kernel's `SCM_MAX_FD`): the
/// lock, the FUSE connection, the NBD listener and its sessions.
const MAX_FDS: usize = 253;

/// Sends `fds` with one byte of data.
fn send_fds(s: &UnixStream, fds: &[BorrowedFd<'_>]) -> Result<(), DaemonError> {
    use rustix::net::{sendmsg, SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    let mut space = vec![std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut cmsg = SendAncillaryBuffer::new(&mut space);
    if !cmsg.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(err("no room for the descriptors"));
    }
    sendmsg(s, &[std::io::IoSlice::new(b"F")], &mut cmsg, SendFlags::empty()).map_err(err)?;
    Ok(())
}

/// Receives the descriptors [`send_fds`] sent.
fn recv_fds(s: &UnixStream) -> Result<Vec<OwnedFd>, DaemonError> {
    use rustix::net::{recvmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    let mut space = vec![std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut cmsg = RecvAncillaryBuffer::new(&mut space);
    let mut byte = [0u8; 1];
    recvmsg(s, &mut [std::io::IoSliceMut::new(&mut byte)], &mut cmsg, RecvFlags::CMSG_CLOEXEC).map_err(err)?;
    let mut fds = Vec::new();
    for m in cmsg.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = m {
            fds.extend(rights);
        }
    }
    Ok(fds)
}

fn hello() -> Hello {
    #[cfg(feature = "fault-injection")]
    let protocol = crate::fault::handover_protocol().unwrap_or(PROTOCOL);
    #[cfg(not(feature = "fault-injection"))]
    let protocol = PROTOCOL;
    #[cfg(feature = "fault-injection")]
    let images = !crate::fault::handover_streamed();
    #[cfg(not(feature = "fault-injection"))]
    let images = true;
    // A fault knob asks for no pre-copy, to measure the pause without it.
    #[cfg(feature = "fault-injection")]
    let precopy = !crate::fault::handover_no_precopy();
    #[cfg(not(feature = "fault-injection"))]
    let precopy = true;
    #[cfg(feature = "fault-injection")]
    let fuse_uring = !crate::fault::handover_no_uring();
    #[cfg(not(feature = "fault-injection"))]
    let fuse_uring = true;
    Hello {
        protocol,
        store_format: HANDOVER_VERSION,
        version: env!("CARGO_PKG_VERSION").into(),
        images,
        kernel_nbd: true,
        ublk: true,
        precopy: images && precopy,
        fuse_uring,
    }
}

/// The configuration of each store a daemon with `spec` hands over, in
/// order: the devices', or the caches' when there is no device.
fn handed_store_configs(spec: &DaemonSpec, total_ram: u64) -> Result<Vec<tmem_core::StoreConfig>, DaemonError> {
    if spec.devices.is_empty() {
        spec.caches.iter().map(|c| c.store_config(total_ram)).collect()
    } else {
        spec.devices.iter().map(|d| store_config(d, total_ram)).collect()
    }
}

/// The index that came ahead of the pause (pre-copy).
#[derive(Default)]
struct Ahead {
    /// Each handed store's snapshot, if this process completes it.
    snapshots: Vec<Option<Snapshot>>,
    /// Pages they hold.
    pages: u64,
}

/// Reads the snapshots that follow a `SNAPSHOT` frame with `body`: for each
/// store, its snapshot if the store this process builds can complete it.
/// Returns them and the `PREBUILT` answer.
fn read_snapshots(r: &mut impl Read, body: &[u8]) -> Result<(Ahead, Vec<u8>), DaemonError> {
    let offer: SnapshotOffer = serde_json::from_slice(body).map_err(err)?;
    let total_ram = tmem_sys::swap::total_ram_bytes().map_err(err)?;
    let (mut snapshots, mut answer, mut pages) = (Vec::new(), Vec::new(), 0);
    for cfg in handed_store_configs(&offer.spec, total_ram)? {
        let snap = Snapshot::read(r).map_err(err)?;
        match snap.unusable_with(&cfg) {
            None => {
                pages += snap.pages();
                snapshots.push(Some(snap));
                answer.push(1);
            }
            Some(why) => {
                log(&format!("hand-over: a store's index comes in the pause after all: {why}"));
                snapshots.push(None);
                answer.push(0);
            }
        }
    }
    Ok((Ahead { snapshots, pages }, answer))
}

/// Waits up to `within` for process `pid` to end; returns whether it did.
pub fn wait_for_exit(pid: u32, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while tmem_sys::process_runs(pid) {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    true
}

/// Who serves `dir` after a successor of daemon `old` did not take over,
/// in words that are true now (finding: of three concurrent restarts, the
/// two refused ones said the old pid "goes on serving" after it had
/// handed over and exited). Waits up to 5 s for a daemon that is taking
/// over to answer.
pub fn who_serves(dir: &Path, old: u32) -> String {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let now = tmem_ctl::call_ok(dir, &tmem_ctl::Request::Status, Duration::from_secs(5))
            .ok()
            .and_then(|v| serde_json::from_value::<Status>(v).ok());
        let old_runs = tmem_sys::process_runs(old);
        match now {
            Some(now) if now.pid == old => return format!("daemon pid {old} goes on serving"),
            Some(now) => {
                let old_state = if old_runs { "is exiting" } else { "has exited" };
                return format!("another restart took over: daemon pid {} serves now (pid {old} {old_state})", now.pid);
            }
            None if old_runs => return format!("daemon pid {old} still runs but does not answer"),
            None if Instant::now() >= deadline => {
                return format!("daemon pid {old} has exited, and no daemon answers in {}", dir.display())
            }
            None => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Listens for a successor on a thread of its own.
pub(crate) fn listen(daemon: &Arc<Daemon>) -> Result<(), DaemonError> {
    daemon.dir.remove(SOCKET)?;
    let path = daemon.dir.join(SOCKET);
    let listener = UnixListener::bind(&path).map_err(|e| err(format!("{}: {e}", path.display())))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
    let daemon = Arc::clone(daemon);
    std::thread::Builder::new()
        .name("tmem-handover".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let Ok(stream) = conn else { continue };
                if !crate::control::peer_is_owner(&stream) {
                    continue;
                }
                // A panic must not leave requests paused: contained here.
                let tried = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| daemon.hand_over(stream)));
                match tried {
                    Ok(Ok(())) => unreachable!("a finished hand-over exits the process"),
                    Ok(Err(e)) => crate::daemon::warn(&format!("{e}; this daemon goes on serving")),
                    Err(_) if SAID_GONE.load(std::sync::atomic::Ordering::Acquire) => {
                        crate::daemon::warn("the hand-over panicked after the successor took over; this process exits");
                        std::process::exit(1);
                    }
                    Err(_) => {
                        daemon.resume_serving();
                        crate::daemon::warn("the hand-over panicked (logged above); this daemon goes on serving");
                    }
                }
            }
        })
        .map(drop)
        .map_err(err)
}

impl Daemon {
    /// Why this daemon cannot be handed over, if it cannot.
    fn cannot_hand_over(&self, h: &Hello) -> Option<String> {
        // A successor reads every store format up to its own: this one's
        // must not be newer than the successor's.
        if h.protocol != PROTOCOL || h.store_format < HANDOVER_VERSION {
            return Some(format!(
                "the successor (tmem {}) speaks hand-over protocol {} with store format {}; this daemon (tmem {}) \
                 speaks {PROTOCOL} with {HANDOVER_VERSION}",
                h.version,
                h.protocol,
                h.store_format,
                env!("CARGO_PKG_VERSION")
            ));
        }
        if !h.kernel_nbd && !self.lock().kernel_nbd.is_empty() {
            return Some(format!("the successor (tmem {}) cannot take the kernel's NBD devices over", h.version));
        }
        if !h.ublk && !self.lock().ublk.is_empty() {
            return Some(format!("the successor (tmem {}) cannot take ublk devices over", h.version));
        }
        let over_uring = self.lock().fuse.as_ref().is_some_and(|f| matches!(f.transport(), Transport::IoUring { .. }));
        if over_uring && !h.fuse_uring {
            return Some(format!("the successor (tmem {}) cannot take FUSE over io_uring over", h.version));
        }
        if !self.spec.tiers.tiers.is_empty() && !h.images {
            return Some("devices with tiers are handed over only with their pools in shared memory (memfd)".into());
        }
        None
    }

    /// Serves one successor: see the module docs. Returns only when the
    /// hand-over did not happen (and this daemon serves again).
    fn hand_over(&self, stream: UnixStream) -> Result<(), DaemonError> {
        stream.set_read_timeout(Some(Duration::from_secs(10))).map_err(err)?;
        let mut r = BufReader::new(stream.try_clone().map_err(err)?);
        let mut w = BufWriter::with_capacity(1 << 20, stream.try_clone().map_err(err)?);
        let (tag, body) = recv(&mut r)?;
        let h: Hello = match tag {
            HELLO => serde_json::from_slice(&body).map_err(err)?,
            _ => return Err(err("expected HELLO")),
        };
        if let Some(why) = self.cannot_hand_over(&h) {
            send(&mut w, REFUSE, why.as_bytes())?;
            return Err(err(format!("refused a successor: {why}")));
        }
        let _gate = self.teardown_gate.lock();
        if self.exited.load(std::sync::atomic::Ordering::Acquire) {
            send(&mut w, REFUSE, b"this daemon is shutting down")?;
            return Err(err("refused a successor: shutting down"));
        }
        let stores = self.handed_stores();
        if h.precopy && h.images && stores.iter().all(|s| s.memfd().is_some()) {
            if let Err(e) = self.send_snapshots(&stores, &mut w, &mut r) {
                for store in &stores {
                    store.track_changes(false);
                }
                return Err(e);
            }
        }
        log(&format!("handing over to a successor (tmem {}): pausing FUSE requests", h.version));
        let paused = Instant::now();
        let resume = || self.resume_serving();
        if let Some(Err(why)) = self.lock().fuse.as_ref().map(FuseMount::pause) {
            // Nothing paused: only the recording a snapshot began ends.
            stores.iter().for_each(|s| s.track_changes(false));
            send(&mut w, REFUSE, why.as_bytes())?;
            return Err(err(format!("refused a successor: {why}")));
        }
        if let Some((ring, _)) = self.lock().fuse.as_ref().and_then(FuseMount::ring_handover) {
            let free: u32 = ring.fresh.iter().map(|f| f.count).sum();
            log(&format!(
                "FUSE over io_uring paused in {} µs: {} ring entries hold a request each ({} of them asked for by \
                 the pause to fill free entries), {free} on offline CPUs stay free",
                paused.elapsed().as_micros(),
                ring.held.len(),
                ring.filled
            ));
        }
        // The NBD server's sessions, then the kernel's NBD and ublk devices.
        let paused_all = (|| -> Result<_, String> {
            let nbd = self.lock().nbd.as_ref().map(|n| n.pause(NBD_PAUSE_TIMEOUT)).transpose()?;
            let kernel = KernelDevices { nbd: self.pause_kernel_nbd()?, ublk: self.pause_ublk()? };
            Ok((nbd, kernel))
        })();
        let (nbd, kernel) = match paused_all {
            Ok(paused_all) => paused_all,
            Err(why) => {
                resume();
                send(&mut w, REFUSE, why.as_bytes())?;
                return Err(err(format!("refused a successor: {why}")));
            }
        };
        match self.send_state(&stream, &mut w, &mut r, nbd.as_ref(), kernel, h.images) {
            Ok(images) => {
                log(&format!(
                    "handed over after {} ms; this process exits and leaves the mount and sockets",
                    paused.elapsed().as_millis()
                ));
                // The successor adopted the fronts as they are.
                self.fronts.lock().release();
                let mut g = self.lock();
                if let Some(f) = g.fuse.take() {
                    f.leave_mounted();
                }
                g.nbd.as_ref().inspect(|n| n.handed_over());
                g.kernel_nbd.iter().for_each(tmem_nbd::kernel::KernelDevice::handed_over);
                // Left to the successor: this process's end quiesces them.
                g.ublk.iter().for_each(tmem_ublk::UblkDevice::handed_over);
                if images || self.supervisor.handed().is_some() {
                    // This process's mappings keep the shared pages locked
                    // until the successor has mapped them; and a service
                    // manager must hear of the new main process (MAINPID=)
                    // before it sees this one end.
                    let _ = stream.set_read_timeout(Some(ANSWER_TIMEOUT));
                    match recv(&mut r) {
                        Ok((LOCKED, _)) => {
                            log("the successor serves, has locked what it mapped and told the service manager")
                        }
                        _ => crate::daemon::warn("the successor did not confirm it serves (LOCKED)"),
                    }
                }
                std::process::exit(0);
            }
            Err(e) => {
                resume();
                Err(e)
            }
        }
    }

    /// Sends each store's snapshot while this daemon serves (pre-copy:
    /// the module docs), recording what changes from then on; waits for
    /// the successor to have built them.
    fn send_snapshots(
        &self,
        stores: &[&Store],
        w: &mut BufWriter<UnixStream>,
        r: &mut BufReader<UnixStream>,
    ) -> Result<(), DaemonError> {
        let started = Instant::now();
        for store in stores {
            store.track_changes(true);
        }
        send(w, SNAPSHOT, &serde_json::to_vec(&SnapshotOffer { spec: self.spec.clone() }).map_err(err)?)?;
        let mut pages = 0;
        for store in stores {
            pages += store.export_snapshot(w).map_err(err)?.pages;
        }
        w.flush().map_err(err)?;
        // Building takes about as long as writing; this daemon serves meanwhile.
        r.get_ref().set_read_timeout(Some(ANSWER_TIMEOUT)).map_err(err)?;
        let (tag, body) = recv(r)?;
        r.get_ref().set_read_timeout(Some(Duration::from_secs(10))).map_err(err)?;
        match tag {
            PREBUILT if body.len() == stores.len() => {}
            FAILED => return Err(err(format!("the successor failed: {}", String::from_utf8_lossy(&body)))),
            _ => return Err(err("unexpected answer to the snapshots")),
        }
        // A store the successor cannot complete travels whole in the pause.
        for (store, &usable) in stores.iter().zip(&body) {
            if usable == 0 {
                store.track_changes(false);
            }
        }
        log(&format!(
            "sent the index of {pages} pages ahead in {} ms while serving; only what changed since goes in the pause",
            started.elapsed().as_millis()
        ));
        Ok(())
    }

    /// Serves again after a hand-over that did not happen.
    fn resume_serving(&self) {
        self.handing_over.store(false, std::sync::atomic::Ordering::Release);
        // Open the stores again first: a sealed store refuses puts. A
        // snapshot sent is of no more use: stop recording changes.
        for store in self.handed_stores() {
            store.seal(false);
            store.track_changes(false);
        }
        let g = self.lock();
        g.fuse.as_ref().inspect(|f| f.resume());
        g.nbd.as_ref().inspect(|n| n.resume());
        g.kernel_nbd.iter().for_each(tmem_nbd::kernel::KernelDevice::resume);
        g.ublk.iter().for_each(tmem_ublk::UblkDevice::resume);
    }

    /// Pauses every ublk device's queues before their next request (the
    /// kernel's requests wait); returns each device's part of the offer.
    fn pause_ublk(&self) -> Result<Vec<HandedUblk>, String> {
        let g = self.lock();
        let mut handed = Vec::with_capacity(g.ublk.len());
        for u in &g.ublk {
            let export = g.status.devices.iter().position(|d| d.ublk_id == Some(u.id()));
            let export = export.ok_or_else(|| format!("/dev/ublkb{} serves no device of the status", u.id()))?;
            u.pause(NBD_PAUSE_TIMEOUT)?;
            handed.push(HandedUblk { export, id: u.id() });
        }
        // Those this daemon could not take wait, quiesced: the successor
        // tries them too. They stay listed here in case the hand-over fails.
        handed.extend(g.ublk_waiting.iter().cloned());
        Ok(handed)
    }

    /// Pauses every kernel NBD device's sessions between two requests;
    /// returns each device's part of the offer with copies of its sockets.
    fn pause_kernel_nbd(&self) -> Result<Vec<(HandedNbd, Vec<OwnedFd>)>, String> {
        let g = self.lock();
        let mut handed = Vec::with_capacity(g.kernel_nbd.len());
        for k in &g.kernel_nbd {
            let export = g.status.devices.iter().position(|d| d.nbd_index == Some(k.index()));
            let export = export.ok_or_else(|| format!("/dev/nbd{} serves no device of the status", k.index()))?;
            let (fds, sessions) = k.pause(NBD_PAUSE_TIMEOUT)?.into_iter().unzip();
            handed.push((HandedNbd { export, index: k.index(), sessions }, fds));
        }
        Ok(handed)
    }

    /// The stores a hand-over passes, in order: each device's, or each
    /// cache's when there is no device (with a device, caches share its store).
    fn handed_stores(&self) -> Vec<&Store> {
        if self.devices.is_empty() {
            self.caches.iter().map(|c| c.store()).collect()
        } else {
            self.devices.iter().map(|d| d.store()).collect()
        }
    }

    /// Sends the offer, the stores and the descriptors; waits for the
    /// answer. Returns whether the stores went as images.
    fn send_state(
        &self,
        stream: &UnixStream,
        w: &mut BufWriter<UnixStream>,
        r: &mut impl Read,
        nbd: Option<&tmem_nbd::NbdHandover>,
        kernel: KernelDevices,
        successor_takes_images: bool,
    ) -> Result<bool, DaemonError> {
        let stores = self.handed_stores();
        let images = successor_takes_images && stores.iter().all(|s| s.memfd().is_some());
        let nbd_sessions = nbd.map(|h| h.sessions.iter().map(|(_, st)| *st).collect()).unwrap_or_default();
        let supervisor = self.supervisor.handed();
        // Writeback to the tiers stays off until this process exits, or
        // resumes with it (the holds drop) when the hand-over fails.
        let holds: Vec<tmem_core::TierHold> = stores.iter().map(|s| s.hold_tiers()).collect();
        let handed = holds.iter().map(tmem_core::TierHold::hand_over).collect::<Result<Vec<_>, _>>().map_err(err)?;
        if !images && handed.iter().any(|h| !h.is_empty()) {
            return Err(err("tiers are handed over only with their pools in shared memory (memfd)"));
        }
        let tiers = handed
            .iter()
            .map(|pools| {
                let each = pools.iter().flat_map(|(pool, ts)| ts.iter().map(move |t| (*pool, t)));
                each.map(|(pool, t)| HandedTier {
                    pool,
                    kind: t.kind.clone(),
                    state_bytes: t.state.len() as u64,
                    fds: t.fds.len(),
                })
                .collect()
            })
            .collect();
        let counters = self.devices.iter().map(|d| d.stats()).chain(self.caches.iter().map(|c| c.stats())).collect();
        let kernel_nbd = kernel.nbd.iter().map(|(h, _)| h.clone()).collect();
        let fuse_ring = self.lock().fuse.as_ref().and_then(FuseMount::ring_handover).map(|(h, _)| h);
        let offer = Offer {
            spec: self.spec.clone(),
            status: self.status(),
            nbd_sessions,
            images,
            supervisor,
            tiers,
            counters,
            kernel_nbd,
            ublk: kernel.ublk,
            fuse_ring: fuse_ring.clone(),
        };
        send(w, OFFER, &serde_json::to_vec(&offer).map_err(err)?)?;
        let handed: Vec<&tmem_tier::TierHandover> = handed.iter().flatten().flat_map(|(_, ts)| ts).collect();
        for t in &handed {
            send_state_frame(w, &t.state)?;
        }
        if !images {
            for store in &stores {
                store.export(w).map_err(err)?;
            }
        }
        w.flush().map_err(err)?;
        // The descriptors go once the successor has read every store byte,
        // so that they cannot arrive inside its read-ahead (a plain read
        // drops them).
        stream.set_read_timeout(Some(ANSWER_TIMEOUT)).map_err(err)?;
        match recv(r)? {
            (READY, _) => {}
            (FAILED, why) => return Err(err(format!("the successor failed: {}", String::from_utf8_lossy(&why)))),
            _ => return Err(err("unexpected answer")),
        }
        self.handing_over.store(true, std::sync::atomic::Ordering::Release);
        {
            let g = self.lock();
            let mut fds = vec![self.lock_file.as_fd()];
            fds.extend(g.fuse.as_ref().map(FuseMount::connection));
            if let Some((ring, ring_fds)) = g.fuse.as_ref().and_then(FuseMount::ring_handover) {
                // The workers hold still while paused: the same entries.
                if fuse_ring.as_ref().is_none_or(|offered| offered.held.len() != ring.held.len()) {
                    return Err(err("the FUSE ring entries changed while paused"));
                }
                fds.extend(ring_fds);
            }
            if let Some(h) = nbd {
                fds.push(h.listener.as_fd());
                fds.extend(h.sessions.iter().map(|(fd, _)| fd.as_fd()));
            }
            fds.extend(kernel.nbd.iter().flat_map(|(_, socks)| socks.iter().map(AsFd::as_fd)));
            fds.extend(handed.iter().flat_map(|t| t.fds.iter().map(AsFd::as_fd)));
            if images {
                fds.extend(stores.iter().filter_map(|s| s.memfd()));
            }
            if fds.len() > MAX_FDS {
                return Err(err(format!("{} descriptors to pass, at most {MAX_FDS}", fds.len())));
            }
            if images {
                // From here on this process changes none of the pages; a
                // failed hand-over opens the stores again (`resume`).
                for store in &stores {
                    store.seal(true);
                }
            }
            send_fds(stream, &fds)?;
        }
        if images {
            for store in &stores {
                store.export_image(w).map_err(err)?;
            }
            w.flush().map_err(err)?;
        }
        let answer = recv(r);
        if !matches!(answer, Ok((TAKEN, _))) {
            self.handing_over.store(false, std::sync::atomic::Ordering::Release);
        }
        match answer? {
            (TAKEN, _) => {
                #[cfg(feature = "fault-injection")]
                if crate::fault::handover_not_gone() {
                    self.handing_over.store(false, std::sync::atomic::Ordering::Release);
                    let _ = send(w, FAILED, b"fault injection");
                    return Err(err("fault injection: TAKEN is answered as by a daemon that gave up waiting"));
                }
                // Past this point this process never serves again.
                SAID_GONE.store(true, std::sync::atomic::Ordering::Release);
                let _ = send(w, GONE, &[]);
                Ok(images)
            }
            (FAILED, why) => Err(err(format!("the successor failed: {}", String::from_utf8_lossy(&why)))),
            _ => Err(err("unexpected answer")),
        }
    }
}

/// Whom a successor answers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Successor {
    /// Its predecessor's service manager, if any: `tmem swap restart`, by
    /// hand or as the unit's `ExecReload`; or systemd itself, when the
    /// unit's `ExecStart` takes over (`swap up --take-over-running`).
    InService,
    /// None: it runs outside the service that is stopping for a restart
    /// (`systemctl restart`), until the unit's next start takes it over.
    OutsideService,
}

/// Runs as the successor of the daemon in `runtime_dir`: takes its pages,
/// devices and mount over (see the module docs), then serves until a
/// teardown like any daemon.
pub fn run_successor(runtime_dir: PathBuf, role: Successor) -> Result<(), DaemonError> {
    crate::logging::init();
    let dir = RuntimeDir::open(&runtime_dir)?;
    // Protected (OOM score, cgroup, mlockall, I/O flusher) before the
    // running daemon pauses: none of this is part of the pause.
    let mut protected = Vec::new();
    crate::daemon::protect(&mut protected)?;
    let path = dir.join(SOCKET);
    let stream = UnixStream::connect(&path)
        .map_err(|e| err(format!("no running daemon to take over from ({}: {e})", path.display())))?;
    stream.set_read_timeout(Some(ANSWER_TIMEOUT)).map_err(err)?;
    let mut r = BufReader::with_capacity(1 << 20, stream.try_clone().map_err(err)?);
    let mut w = stream.try_clone().map_err(err)?;
    let peer = rustix::net::sockopt::socket_peercred(&stream).map_err(err)?.pid;
    // The running daemon pauses on HELLO, or once the snapshots it sends
    // first are built (pre-copy): requests wait from there.
    let mut started = Instant::now();
    send(&mut w, HELLO, &serde_json::to_vec(&hello()).map_err(err)?)?;
    let mut answer = recv(&mut r);
    let mut ahead = Ahead::default();
    if let Ok((SNAPSHOT, body)) = &answer {
        match read_snapshots(&mut r, body) {
            Ok((built, answer)) => {
                ahead = built;
                started = Instant::now();
                send(&mut w, PREBUILT, &answer)?;
            }
            Err(e) => {
                let _ = send(&mut w, FAILED, e.to_string().as_bytes());
                return Err(e);
            }
        }
        answer = recv(&mut r);
    }
    let offer: Offer = match answer {
        Ok((OFFER, body)) => serde_json::from_slice(&body).map_err(err)?,
        Ok((REFUSE, why)) => return Err(err(format!("the running daemon refused: {}", String::from_utf8_lossy(&why)))),
        Ok(_) => return Err(err("unexpected answer to HELLO")),
        // It served another successor first (it serves one at a time) and exited.
        Err(_) => {
            let old = u32::try_from(peer.as_raw_nonzero().get()).unwrap_or(0);
            return Err(err(format!(
                "daemon pid {old} closed the hand-over socket without answering; {}",
                who_serves(dir.path(), old)
            )));
        }
    };
    let old = offer.status.pid;
    match take(&dir, &stream, &mut r, &mut w, offer, protected, role, ahead) {
        Ok((daemon, rx, nbd, report)) => {
            send(&mut w, TAKEN, &[])?;
            if let Err(why) = predecessor_gone(&mut r, old) {
                // It serves on: this process must not touch the pages.
                crate::daemon::warn(&format!("hand-over: {why}; this process exits and serves nothing"));
                std::process::exit(1);
            }
            daemon.claim_runtime_dir();
            let ublk = daemon.serve_taken_over(nbd);
            let line = report.step(old, started.elapsed());
            log(&line);
            // Before the old process exits (it waits for LOCKED, or has
            // said GONE and exits): systemd must know the new main process
            // before it sees the old one end.
            if let Err(e) = daemon.supervisor.took_over(&line) {
                crate::daemon::warn(&format!("could not tell the service manager the new main pid: {e}"));
            }
            daemon.step(line);
            if report.images {
                daemon.lock_shared_pages();
            }
            let _ = send(&mut w, LOCKED, &[]);
            // After LOCKED: the old process ends only then, and its end
            // is what lets the kernel give its ublk devices to this one.
            daemon.recover_ublk(ublk);
            daemon.after_take_over();
            crate::daemon::serve(&daemon, &rx);
            Ok(())
        }
        Err(e) => {
            let _ = send(&mut w, FAILED, e.to_string().as_bytes());
            Err(e)
        }
    }
}

/// Waits for the old daemon `old` to say `GONE` after `TAKEN`, or to end:
/// an error while it still runs without having said it.
fn predecessor_gone(r: &mut impl Read, old: u32) -> Result<(), String> {
    match recv(r) {
        Ok((GONE, _)) => Ok(()),
        // An older daemon exits without a word.
        _ if wait_for_exit(old, Duration::from_secs(10)) => Ok(()),
        Ok((tag, _)) => Err(format!("daemon pid {old} answered {:?} to TAKEN and still runs", char::from(tag))),
        Err(e) => Err(format!("daemon pid {old} still runs and did not confirm ({e})")),
    }
}

/// What serves NBD and ublk after a hand-over, started once it is taken
/// (the stores are sealed until then): the NBD server, the kernel's NBD
/// devices with their sockets, and the ublk devices.
struct PendingNbd {
    server: Option<tmem_nbd::NbdServer>,
    kernel: Vec<(HandedNbd, Vec<OwnedFd>)>,
    ublk: Vec<HandedUblk>,
}

/// What a successor took over, for its step line.
struct TakeReport {
    pages: u64,
    bytes: u64,
    /// Shared stores (else streamed).
    images: bool,
    /// Pages whose index came ahead of the pause (pre-copy).
    ahead: u64,
    /// Pages in the tiers that came along, and the tiers' names.
    tier_pages: u64,
    tiers: Vec<String>,
    /// FUSE-over-io_uring entries taken over, each with the request it held.
    ring_entries: usize,
}

impl TakeReport {
    fn step(&self, old: u32, paused: Duration) -> String {
        let how = match (self.images, self.ahead) {
            (false, _) => "copying them (stream)".to_owned(),
            (true, 0) => "sharing its memory (memfd; no page copied)".to_owned(),
            (true, n) => {
                format!("sharing its memory (memfd; no page copied; the index of {n} pages went ahead while it served)")
            }
        };
        let tiers = if self.tiers.is_empty() {
            String::new()
        } else {
            format!("; {} pages in its tiers ({}) came along", self.tier_pages, self.tiers.join(", "))
        };
        let ring = match self.ring_entries {
            0 => String::new(),
            n => format!("; its {n} FUSE io_uring entries came along, each with the request it held"),
        };
        format!(
            "took over from daemon pid {old}: {} pages ({}) in {} ms, the longest that requests waited, by \
             {how}{tiers}{ring}",
            self.pages,
            crate::human(self.bytes),
            paused.as_millis()
        )
    }
}

/// Builds this process's daemon from the offer and the stores that follow
/// it; serves nothing yet ([`Daemon::serve_taken_over`] starts that).
#[allow(clippy::too_many_arguments)]
fn take(
    dir: &RuntimeDir,
    stream: &UnixStream,
    r: &mut impl Read,
    w: &mut impl Write,
    offer: Offer,
    protected: Vec<String>,
    role: Successor,
    ahead: Ahead,
) -> Result<(Arc<Daemon>, mpsc::Receiver<crate::daemon::Event>, PendingNbd, TakeReport), DaemonError> {
    let Offer { spec, status: old, nbd_sessions, images, supervisor, tiers, counters, kernel_nbd, ublk, fuse_ring } =
        offer;
    let supervisor = match role {
        Successor::InService => Supervisor::inherit(Supervisor::from_env(), supervisor),
        Successor::OutsideService => Supervisor::default(),
    };
    crate::daemon::log_panics();
    let (tx, rx) = mpsc::channel();
    let signalled = Arc::new(AtomicI32::new(0));
    crate::daemon::watch_signals(tx.clone(), Arc::clone(&signalled))?;
    let mut steps = old.steps.clone();
    steps.extend(protected);
    let total_ram = tmem_sys::swap::total_ram_bytes().map_err(err)?;
    let (mut pages, mut bytes) = (0, 0);
    let mut states = Vec::new();
    for t in tiers.iter().flatten() {
        states.push(recv_state_frame(r, t.state_bytes)?);
    }
    // Shared stores: the descriptors come first, then the tiers', the
    // memfds last.
    let mut fds = Vec::<OwnedFd>::new().into_iter();
    let mut memfds = Vec::<OwnedFd>::new().into_iter();
    let mut tier_fds = Vec::<OwnedFd>::new().into_iter();
    if images {
        send(w, READY, &[])?;
        let mut all = recv_fds(stream)?;
        let stores = if spec.devices.is_empty() { spec.caches.len() } else { spec.devices.len() };
        let few = || err("fewer descriptors arrived than the offer names");
        memfds = all.split_off(all.len().checked_sub(stores).ok_or_else(few)?).into_iter();
        let of_tiers = tiers.iter().flatten().map(|t| t.fds).sum::<usize>();
        tier_fds = all.split_off(all.len().checked_sub(of_tiers).ok_or_else(few)?).into_iter();
        fds = all.into_iter();
    }
    // Each store's tiers, by pool, as their states and descriptors arrived.
    let mut states = states.into_iter();
    let mut handed: Vec<Vec<(u32, Vec<tmem_tier::TierHandover>)>> = Vec::new();
    for store in &tiers {
        let mut pools: Vec<(u32, Vec<tmem_tier::TierHandover>)> = Vec::new();
        for t in store {
            let fds = tier_fds.by_ref().take(t.fds).collect();
            let state = states.next().expect("one state per tier");
            let h = tmem_tier::TierHandover { kind: t.kind.clone(), state, fds };
            match pools.last_mut() {
                Some((pool, ts)) if *pool == t.pool => ts.push(h),
                _ => pools.push((t.pool, vec![h])),
            }
        }
        handed.push(pools);
    }
    let mut handed = handed.into_iter();
    let mut snapshots = ahead.snapshots.into_iter();
    let mut import = |cfg: tmem_core::StoreConfig, r: &mut dyn Read, device: &str| {
        let mut below = handed.next().unwrap_or_default();
        let mut give = |id: u32, n: usize| {
            let at = below.iter().position(|(pool, ts)| *pool == id && ts.len() == n);
            let (_, ts) = at.map(|i| below.swap_remove(i)).ok_or_else(|| {
                tmem_core::StoreError::Handover(format!("pool {id}: its {n} tiers were not handed over"))
            })?;
            spec.tiers.adopt(device, ts).map_err(|e| tmem_core::StoreError::Handover(e.to_string()))
        };
        match (memfds.next(), snapshots.next().flatten()) {
            (Some(fd), Some(snap)) => Store::import_image_after(cfg, r, fd, &mut give, snap),
            (Some(fd), None) => Store::import_tiered(cfg, r, Some(fd), &mut give),
            (None, _) if images => Err(tmem_core::StoreError::Handover("a store image without its memfd".into())),
            (None, _) => Store::import(cfg, r),
        }
    };
    let mut devices: Vec<Arc<PoolDevice>> = Vec::new();
    for d in &spec.devices {
        let store_cfg = store_config(d, total_ram)?;
        let (store, sum) = import(store_cfg.clone(), r, &d.name).map_err(err)?;
        (pages, bytes) = (pages + sum.pages, bytes + sum.object_bytes);
        let cfg = DeviceConfig {
            name: d.name.clone(),
            size: d.size,
            store: store_cfg,
            tiers: None,
            recompress: d.recompress.config()?,
        };
        devices.push(Arc::new(cfg.adopt(store).map_err(err)?));
    }
    let mut caches: Vec<Arc<CacheDevice>> = Vec::new();
    for (i, c) in spec.caches.iter().enumerate() {
        let (store, pool) = match devices.first() {
            Some(swap) => {
                let store = swap.shared_store();
                let pool = store.pool(u32::try_from(i + 1).map_err(err)?).map_err(err)?;
                (store, pool)
            }
            None => {
                let (store, sum) = import(c.store_config(total_ram)?, r, &c.name).map_err(err)?;
                (pages, bytes) = (pages + sum.pages, bytes + sum.object_bytes);
                let store = Arc::new(store);
                let pool = store.pool(0).map_err(err)?;
                (store, pool)
            }
        };
        caches.push(Arc::new(c.device_config(tmem_core::StoreConfig::default()).adopt(store, pool).map_err(err)?));
    }
    // An older predecessor sends no counters: these start at 0 then.
    let mut counters = counters.iter();
    for d in &devices {
        counters.next().inspect(|c| d.carry_on(c));
    }
    for c in &caches {
        counters.next().inspect(|before| c.carry_on(before));
    }
    if !images {
        send(w, READY, &[])?;
        fds = recv_fds(stream)?.into_iter();
    }
    let missing = || err("fewer descriptors arrived than the offer names");
    let lock_file = dir.adopt_lock(fds.next().ok_or_else(missing)?.into_raw_fd())?;
    // A daemon on the NBD or ublk transport has no FUSE mount.
    let without_fuse = matches!(old.transport.as_deref(), Some("nbd" | "ublk"));
    let conn = if spec.fuse && !without_fuse { Some(fds.next().ok_or_else(missing)?) } else { None };
    let ring_entries = fuse_ring.as_ref().map_or(0, |h| h.held.len());
    let ring = match fuse_ring {
        Some(handover) => {
            let fds: Vec<OwnedFd> = fds.by_ref().take(handover.regions.len()).collect();
            if fds.len() != handover.regions.len() {
                return Err(missing());
            }
            Some(AdoptedRing { handover, fds })
        }
        None => None,
    };
    let nbd = match &spec.nbd {
        Some(_) => {
            let listener = fds.next().ok_or_else(missing)?;
            let sockets: Vec<OwnedFd> = fds.by_ref().take(nbd_sessions.len()).collect();
            if sockets.len() != nbd_sessions.len() {
                return Err(missing());
            }
            Some((listener, sockets.into_iter().zip(nbd_sessions).collect::<Vec<_>>()))
        }
        None => None,
    };
    let mut kernel = Vec::with_capacity(kernel_nbd.len());
    for h in kernel_nbd {
        let sockets: Vec<OwnedFd> = fds.by_ref().take(h.sessions.len()).collect();
        if sockets.len() != h.sessions.len() {
            return Err(missing());
        }
        kernel.push((h, sockets));
    }
    let exports =
        devices
            .iter()
            .map(|d| Export { name: d.name().to_owned(), device: Arc::clone(d) as Arc<dyn tmem_block::BlockDevice> })
            .chain(caches.iter().map(|c| Export {
                name: c.name().to_owned(),
                device: Arc::clone(c) as Arc<dyn tmem_block::BlockDevice>,
            }))
            .collect();
    let fuse = conn
        .map(|conn| {
            let mountpoint = dir.join(MOUNT_DIR);
            let cfg = FuseConfig { mountpoint, exports, threads: spec.fuse_threads, uring_per_queue: spec.fuse_uring };
            FuseMount::adopt(conn, cfg, ring)
        })
        .transpose()
        .map_err(err)?;
    let stores = devices.iter().map(|d| d.store());
    let tier_pages = stores.clone().map(|s| s.stats().total.tier_pages).sum();
    let tiers = stores.flat_map(|s| s.tiers()).map(|t| t.name().to_owned()).collect();
    let report = TakeReport { pages, bytes, images, ahead: ahead.pages, tier_pages, tiers, ring_entries };
    // With ublk devices to take (after LOCKED), "up" waits for them: `swap
    // restart` reports once the successor serves, so it reports their
    // recovery too.
    let state = if ublk.is_empty() { "up" } else { RECOVERING };
    let status = Status { state: state.into(), pid: std::process::id(), steps, ..old.clone() };
    let dir = RuntimeDir::open(dir.path())?;
    let daemon = Daemon::new(spec, dir, lock_file, (devices, caches), status, tx, signalled);
    daemon.lock().fuse = fuse;
    let daemon = Arc::new(Daemon { predecessor: Some(old.pid), supervisor, ..daemon });
    let fronts = adopt_fronts(&daemon, &old, total_ram)?;
    *daemon.fronts.lock() = fronts;
    let nbd = match (&daemon.spec.nbd, nbd) {
        (Some(listen), Some((listener, sessions))) => {
            let cfg = daemon.nbd_config(listen)?;
            Some(tmem_nbd::NbdServer::adopt(cfg, listener, sessions).map_err(err)?)
        }
        _ => None,
    };
    #[cfg(feature = "fault-injection")]
    if crate::fault::handover_fail_take() {
        return Err(err("fault injection: the successor fails once it has taken the stores and devices"));
    }
    // The state file and the sockets stay the running daemon's until it
    // says GONE (`claim_runtime_dir`): a successor that fails from here
    // on must leave it reachable.
    Ok((daemon, rx, PendingNbd { server: nbd, kernel, ublk }, report))
}

impl Daemon {
    /// Makes the state file and the control and hand-over sockets this
    /// process's, once its predecessor has said GONE (or ended). Past that
    /// point there is no going back: a socket that cannot be bound is
    /// warned of, and this process serves on without it.
    fn claim_runtime_dir(self: &Arc<Self>) {
        let status = self.status();
        self.save_state(&status);
        if let Err(e) = crate::daemon::bind_control(self).and_then(|()| listen(self)) {
            crate::daemon::warn(&format!(
                "{e}: this daemon serves, but tmem's commands cannot reach it; to end it, `kill {}` and \
                 run `tmem swap down`",
                std::process::id()
            ));
        }
    }

    /// Faults every page of the adopted pools into this process, which
    /// locks them (`mlockall`); the old process, which held them locked
    /// until now, exits once it hears `LOCKED` after this: until then an
    /// unmapped page could be reclaimed to swap, perhaps to this very daemon.
    fn lock_shared_pages(&self) {
        let started = Instant::now();
        let mut pages = 0;
        for store in self.handed_stores() {
            match store.populate() {
                Ok(n) => pages += n,
                Err(e) => crate::daemon::warn(&format!("mapping the adopted pool: {e}")),
            }
        }
        let line = format!(
            "{} of adopted pool mapped and locked in {} ms, while serving",
            crate::human(pages * tmem_core::PAGE_SIZE as u64),
            started.elapsed().as_millis()
        );
        log(&line);
        self.step(line);
    }

    /// Starts serving what [`take`] built: opens the stores, resumes the
    /// FUSE workers, starts the NBD server.
    fn serve_taken_over(&self, nbd: PendingNbd) -> Vec<HandedUblk> {
        for store in self.handed_stores() {
            store.seal(false);
            // The predecessor is gone: the tiers' files and keys are ours.
            for t in store.tiers() {
                t.set_owner(true);
            }
        }
        if let Some(f) = self.lock().fuse.as_ref() {
            f.resume();
        }
        let exports = self.exports();
        for (h, sockets) in nbd.kernel {
            let Some((name, device)) = exports.get(h.export) else {
                crate::daemon::warn(&format!(
                    "/dev/nbd{}: the offer names export {}, which is not here",
                    h.index, h.export
                ));
                continue;
            };
            let export = tmem_nbd::Export::new(name, Arc::clone(device));
            match tmem_nbd::kernel::KernelDevice::adopt(export, h.index, sockets.into_iter().zip(h.sessions).collect())
            {
                Ok(k) => self.lock().kernel_nbd.push(k),
                Err(e) => crate::daemon::warn(&format!("/dev/nbd{}: its sessions did not start: {e}", h.index)),
            }
        }
        if let Some(server) = nbd.server {
            match server.spawn() {
                Ok(handle) => self.lock().nbd = Some(handle),
                Err(e) => crate::daemon::warn(&format!("NBD: the adopted server did not start: {e}")),
            }
        }
        nbd.ublk
    }

    /// Takes the handed ublk devices with user recovery: each waits (up
    /// to 30 s) for the predecessor's end, which quiesces it; then the
    /// kernel reissues every request it kept to this process's queues.
    /// Each outcome is a step, so `swap restart` prints it; the state is
    /// `up` once all are tried. A device that could not be taken is tried
    /// again in the background ([`retry_ublk`]) until it is.
    pub(crate) fn recover_ublk(self: &Arc<Self>, handed: Vec<HandedUblk>) {
        if handed.is_empty() {
            return;
        }
        self.lock().ublk_waiting = handed;
        let all_taken = self.take_waiting_ublk(1).is_ok();
        self.lock().status.state = "up".into();
        let status = self.status();
        self.save_state(&status);
        if !all_taken {
            let daemon = Arc::clone(self);
            if let Err(e) = std::thread::Builder::new().name("ublk-recovery".into()).spawn(move || retry_ublk(&daemon))
            {
                crate::daemon::warn(&format!("cannot start the thread that tries the ublk devices again: {e}"));
            }
        }
    }

    /// Tries (try number `attempt`; 0: a teardown's) to take every ublk
    /// device still waiting; those that fail stay waiting. Err names them.
    pub(crate) fn take_waiting_ublk(&self, attempt: u32) -> Result<(), String> {
        let waiting = std::mem::take(&mut self.lock().ublk_waiting);
        if waiting.is_empty() {
            return Ok(());
        }
        let exports = self.exports();
        let mut left = Vec::new();
        for h in waiting {
            let Some((name, device)) = exports.get(h.export) else {
                crate::daemon::warn(&format!(
                    "/dev/ublkb{}: the offer names export {}, which is not here",
                    h.id, h.export
                ));
                continue;
            };
            let started = Instant::now();
            match tmem_ublk::UblkDevice::recover(h.id, Arc::clone(device)) {
                Ok(u) => {
                    let line = format!(
                        "{name}: took ublk device /dev/ublkb{} over (user recovery{}, {} ms after the predecessor \
                         was told to go; the requests it held were reissued here)",
                        h.id,
                        if attempt > 1 { format!(" on try {attempt}") } else { String::new() },
                        started.elapsed().as_millis()
                    );
                    log(&line);
                    self.step(line);
                    self.lock().ublk.push(u);
                }
                Err(e) => {
                    let again = if attempt == 0 { "" } else { "; tried again in the background, at most 30 s apart" };
                    let line = format!(
                        "warning: /dev/ublkb{}: {UBLK_NOT_RECOVERED} (try {attempt}), so its requests wait: {e}{again}; \
                         if it never succeeds, end this daemon (kill {}) and run `tmem swap down`, which takes the \
                         device over, fails its requests and removes it",
                        h.id,
                        std::process::id()
                    );
                    crate::daemon::warn(&line);
                    // The first failure is a step (`swap restart` prints
                    // it); later ones only go to the log, so that a device
                    // that never comes back does not grow the status.
                    if attempt <= 1 {
                        self.lock().status.steps.push(line);
                    }
                    left.push(h);
                }
            }
        }
        let not_served = left.iter().map(|h| format!("/dev/ublkb{}", h.id)).collect::<Vec<_>>().join(", ");
        self.lock().ublk_waiting.extend(left);
        if not_served.is_empty() {
            Ok(())
        } else {
            Err(format!("{not_served} not served"))
        }
    }
}

/// First wait before a ublk device that user recovery could not take is
/// tried again; each wait doubles, up to [`UBLK_RETRY_MOST`].
const UBLK_RETRY_FIRST: Duration = Duration::from_secs(1);
/// Longest wait between two tries.
const UBLK_RETRY_MOST: Duration = Duration::from_secs(30);

/// The waits between tries of a device that could not be taken: 1, 2,
/// 4, ... seconds, then 30 s each.
fn ublk_retry_waits() -> impl Iterator<Item = Duration> {
    std::iter::successors(Some(UBLK_RETRY_FIRST), |w| Some((*w * 2).min(UBLK_RETRY_MOST)))
}

/// Tries the waiting ublk devices again until none waits, the daemon
/// exits or it hands them to a successor. A try skips its turn while a
/// teardown or hand-over holds the gate (a hand-over offers them).
fn retry_ublk(daemon: &Daemon) {
    for (attempt, wait) in (2..).zip(ublk_retry_waits()) {
        std::thread::sleep(wait);
        if daemon.exited.load(Ordering::Acquire) || daemon.lock().ublk_waiting.is_empty() {
            return;
        }
        let Some(_gate) = daemon.teardown_gate.try_lock() else { continue };
        if daemon.take_waiting_ublk(attempt).is_ok() {
            let status = daemon.status();
            daemon.save_state(&status);
            return;
        }
    }
}

/// The predecessor's fronts, as its status names them: its zram devices
/// and their policies, or the zswap values it saved.
fn adopt_fronts(daemon: &Daemon, old: &Status, total_ram: u64) -> Result<crate::front::Fronts, DaemonError> {
    let front = match old.front.as_str() {
        "zram" => tmem_front::Front::Zram,
        "zswap" => tmem_front::Front::Zswap,
        _ => tmem_front::Front::None,
    };
    let mut fronts = crate::front::Fronts::chosen(tmem_front::Choice { front, reason: old.front_reason.clone() });
    for (i, d) in old.devices.iter().enumerate() {
        if let (Some(id), Some(backing)) = (d.front_zram, &d.loop_dev) {
            fronts.zram_adopt(i, id, backing, &daemon.devices[i], &daemon.spec.front, total_ram)?;
        }
    }
    if front == tmem_front::Front::Zswap {
        let reads = crate::front::pages_read(daemon.devices.clone());
        fronts.zswap_adopt(&daemon.dir, &daemon.spec.front, total_ram, reads)?;
    }
    Ok(fronts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ublk_device_not_taken_is_tried_again_sooner_first_then_every_30_s() {
        let waits: Vec<u64> = ublk_retry_waits().take(8).map(|w| w.as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30, 30]);
    }
}
