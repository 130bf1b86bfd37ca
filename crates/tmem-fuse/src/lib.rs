//! FUSE frontend: a directory with one file per block device.
//!
//! Files are opened with `FOPEN_DIRECT_IO`, so the kernel sends every read
//! and write straight to us without the page cache. `losetup --direct-io=on`
//! on such a file gives a loop device the kernel can swap to, on machines
//! without nbd or ublk. Discards from swap (`swapon --discard`) reach us as
//! `fallocate(PUNCH_HOLE)` and free the pages.
//!
//! Loop over FUSE can deadlock when the daemon needs memory to serve the
//! writes that would free memory. The defences: direct I/O (no dirty page
//! cache of ours), a daemon that calls `mlockall` and `PR_SET_IO_FLUSHER`
//! (done by the daemon, not this crate), per-thread I/O buffers allocated
//! once when a worker starts, so the request path does not allocate, and a
//! daemon that lives outside the memory cgroup it serves.

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use fuser::{Config, FopenFlags, KernelConfig, MountOption, Request, SessionACL};
use tmem_block::BlockDevice;

mod devloop;
mod region;
mod uring;

pub use uring::{possible_cpus, AdoptedRing, FreshEntries, HeldEntry, RingHandover, RingRegion};

/// How long a pause over io_uring may take to leave no entry free.
const URING_PAUSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Largest read we accept from the kernel; also each worker's buffer size.
pub const MAX_IO: u32 = 1 << 20;
/// Largest write per request. The kernel splits a bigger direct write into
/// several requests that our workers serve in parallel, so a 1 MiB swap
/// writeout does not wait for one thread to compress 256 pages.
pub const MAX_WRITE: u32 = 128 << 10;
/// Async direct I/O requests count as background requests; past this many
/// in flight the submitter (loop's worker) waits. Measured on the 25% and 50%
/// rungs of `tmem bench pressure` (3 runs each): 64 was fastest; 32 starved
/// the workers, and 256 let so much writeback pile up (pages pinned in the
/// workload's cgroup) that one 25% run was OOM-killed. The kernel's default
/// is 12.
const MAX_BACKGROUND: u16 = 64;
const ROOT: u64 = 1;
const TTL: Duration = Duration::from_secs(1);

/// FUSE frontend errors.
#[derive(Debug, thiserror::Error)]
pub enum FuseError {
    /// Device names must be plain file names.
    #[error("invalid device name {0:?}")]
    BadName(String),
    /// Two devices with one name.
    #[error("duplicate device name {0:?}")]
    DuplicateName(String),
    /// Mounting failed.
    #[error("cannot mount FUSE at {path}: {source}")]
    Mount {
        /// Mount point.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// Unmounting failed.
    #[error("cannot unmount {path}: {source}")]
    Unmount {
        /// Mount point.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
}

/// One exported file.
pub struct Export {
    /// File name (e.g. `swap0`).
    pub name: String,
    /// The device behind it.
    pub device: Arc<dyn BlockDevice>,
}

/// How to mount.
pub struct FuseConfig {
    /// Existing empty directory to mount on.
    pub mountpoint: PathBuf,
    /// Files to export.
    pub exports: Vec<Export>,
    /// Worker threads reading `/dev/fuse` (each with its own cloned fd).
    pub threads: usize,
    /// io_uring workers per CPU queue; 0 serves everything on `/dev/fuse`.
    /// Used when the kernel offers FUSE over io_uring (see [`uring`]);
    /// otherwise the mount falls back to `/dev/fuse` and says so.
    pub uring_per_queue: usize,
}

/// How requests reach the workers of a mount.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transport {
    /// `read`/`writev` on `/dev/fuse`.
    DevFuse,
    /// FUSE over io_uring: this many workers, per-CPU queues.
    IoUring {
        /// Workers in all.
        workers: usize,
    },
    /// io_uring was asked for but is unavailable; why.
    DevFuseFallback(String),
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::DevFuse => write!(f, "/dev/fuse"),
            Self::IoUring { workers } => write!(f, "io_uring ({workers} workers on per-CPU queues)"),
            Self::DevFuseFallback(why) => write!(f, "/dev/fuse (io_uring unavailable: {why})"),
        }
    }
}

/// What a node is.
enum NodeKind {
    Dir,
    File { size: u64 },
}

impl NodeKind {
    /// (size, permission bits, link count), the same over both transports.
    fn size_perm_nlink(&self) -> (u64, u16, u32) {
        match *self {
            Self::Dir => (0, 0o700, 2),
            Self::File { size } => (size, 0o600, 1),
        }
    }
}

struct BlockFs {
    exports: Vec<Export>,
    uid: u32,
    gid: u32,
    started: SystemTime,
    /// Ask the kernel for FUSE over io_uring at INIT.
    want_uring: bool,
    /// The kernel agreed (set during INIT).
    uring_negotiated: AtomicBool,
}

/// What `fuser` answers INIT with. Requests after INIT are served by our
/// `/dev/fuse` workers ([`devloop`]) and io_uring workers ([`uring`]), both
/// through `uring::dispatch` on the same `BlockFs`.
struct FuserFs(Arc<BlockFs>);

impl BlockFs {
    /// The exports, owned by this process's user.
    fn new(exports: Vec<Export>, want_uring: bool) -> Self {
        let (uid, gid) = (rustix::process::getuid().as_raw(), rustix::process::getgid().as_raw());
        Self { exports, uid, gid, started: SystemTime::now(), want_uring, uring_negotiated: AtomicBool::new(false) }
    }

    fn export(&self, ino: u64) -> Option<&Export> {
        let i = ino.checked_sub(ROOT + 1)?;
        self.exports.get(usize::try_from(i).ok()?)
    }

    fn node(&self, ino: u64) -> Option<NodeKind> {
        if ino == ROOT {
            Some(NodeKind::Dir)
        } else {
            self.export(ino).map(|e| NodeKind::File { size: e.device.size() })
        }
    }

    fn lookup_ino(&self, parent: u64, name: &[u8]) -> Option<u64> {
        if parent != ROOT {
            return None;
        }
        let i = self.exports.iter().position(|e| e.name.as_bytes() == name)?;
        Some(ROOT + 1 + i as u64)
    }

    /// `.`, `..` and the exports, as (inode, kind, name).
    fn entries(&self) -> impl Iterator<Item = (u64, NodeKind, &str)> {
        [(ROOT, NodeKind::Dir, "."), (ROOT, NodeKind::Dir, "..")].into_iter().chain(
            self.exports
                .iter()
                .enumerate()
                .map(|(i, e)| (ROOT + 1 + i as u64, NodeKind::File { size: e.device.size() }, e.name.as_str())),
        )
    }

    fn total_blocks(&self) -> u64 {
        self.exports.iter().map(|e| e.device.size() / 4096).sum()
    }

    /// Bytes a read of `size` at `offset` returns: short at the end, like a regular file.
    fn read_len(&self, e: &Export, offset: u64, size: u32) -> usize {
        let end = offset.saturating_add(u64::from(size)).min(e.device.size());
        usize::try_from(end.saturating_sub(offset)).unwrap_or(0)
    }

    /// FOPEN flags for an export; directories are not opened as files.
    fn open_flags(&self, ino: u64) -> Result<u32, i32> {
        if self.export(ino).is_none() {
            return Err(libc::EISDIR);
        }
        Ok((FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES).bits())
    }

    fn flush(&self, ino: u64) -> Result<(), i32> {
        match self.export(ino).map(|e| e.device.flush()) {
            Some(Ok(())) | None => Ok(()),
            Some(Err(err)) => Err(err.errno()),
        }
    }

    /// Punch hole (discard), zero range, or plain allocation (a no-op).
    fn fallocate(&self, ino: u64, offset: u64, length: u64, mode: i32) -> Result<(), i32> {
        let e = self.export(ino).ok_or(libc::ENOENT)?;
        let r = if mode == libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE {
            e.device.trim(offset, length)
        } else if mode & !libc::FALLOC_FL_KEEP_SIZE == libc::FALLOC_FL_ZERO_RANGE {
            e.device.write_zeroes(offset, length)
        } else if mode & !libc::FALLOC_FL_KEEP_SIZE == 0 {
            // Plain allocation: memory devices have nothing to reserve.
            return match offset.checked_add(length) {
                Some(end) if end <= e.device.size() => Ok(()),
                _ => Err(libc::EFBIG),
            };
        } else {
            return Err(libc::EOPNOTSUPP);
        };
        r.map_err(|err| err.errno())
    }
}

impl fuser::Filesystem for FuserFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Best effort: the kernel may cap these; smaller values still work.
        let _ = config.set_max_write(MAX_WRITE);
        let _ = config.set_max_background(MAX_BACKGROUND);
        let _ = config.set_congestion_threshold(MAX_BACKGROUND / 4 * 3);
        // Without ASYNC_DIO the kernel turns an async direct I/O (what a loop
        // device with --direct-io=on submits) into a synchronous request, and
        // loop then waits for each one in turn.
        let _ = config.add_capabilities(fuser::InitFlags::FUSE_ASYNC_DIO);
        if self.0.want_uring && config.add_capabilities(fuser::InitFlags::FUSE_OVER_IO_URING).is_ok() {
            self.0.uring_negotiated.store(true, Ordering::Release);
        }
        Ok(())
    }
}

/// A mounted export directory. Dropping it unmounts.
pub struct FuseMount {
    /// The mount `fuser` made (dropping it unmounts); `None` for a mount
    /// adopted from a predecessor ([`FuseMount::adopt`]).
    session: Option<fuser::Session<FuserFs>>,
    /// The connection of an adopted mount.
    adopted: Option<std::os::fd::OwnedFd>,
    /// An adopted mount is this process's to unmount on drop only once it
    /// has served ([`FuseMount::resume`]): a successor that fails before
    /// leaves its predecessor's mount alone.
    served: AtomicBool,
    workers: Option<devloop::DevWorkers>,
    uring: Option<uring::UringWorkers>,
    transport: Transport,
    mountpoint: PathBuf,
}

impl std::fmt::Debug for FuseMount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FuseMount").field("mountpoint", &self.mountpoint).finish_non_exhaustive()
    }
}

impl FuseMount {
    /// Mounts the exports and starts the worker threads.
    pub fn mount(cfg: FuseConfig) -> Result<Self, FuseError> {
        let mut names = std::collections::HashSet::new();
        for e in &cfg.exports {
            if e.name.is_empty() || e.name.contains('/') || e.name == "." || e.name == ".." {
                return Err(FuseError::BadName(e.name.clone()));
            }
            if !names.insert(e.name.clone()) {
                return Err(FuseError::DuplicateName(e.name.clone()));
            }
        }
        // The kernel offers io_uring at INIT only while fuse.enable_uring is
        // on; a connection keeps it afterwards, so the switch is put back
        // right after the handshake.
        let (want_uring, restore, mut fallback) = match cfg.uring_per_queue {
            0 => (false, None, None),
            _ => match uring::allow_in_kernel() {
                Ok(restore) => (true, restore, None),
                Err(why) => (false, None, Some(why)),
            },
        };
        let fs = Arc::new(BlockFs::new(cfg.exports, want_uring));
        let mut options = Config::default();
        options.mount_options = vec![
            MountOption::FSName("tmem".into()),
            MountOption::Subtype("tmem".into()),
            MountOption::DefaultPermissions,
        ];
        options.acl = SessionACL::Owner;
        options.n_threads = Some(cfg.threads.max(1));
        options.clone_fd = true;
        // Session::new mounts and completes INIT before it returns.
        let session = fuser::Session::new(FuserFs(fs.clone()), &cfg.mountpoint, &options);
        if let Some(previous) = restore {
            uring::restore_kernel_switch(previous);
        }
        let session = session.map_err(|source| FuseError::Mount { path: cfg.mountpoint.clone(), source })?;
        let mut uring = None;
        if want_uring {
            if fs.uring_negotiated.load(Ordering::Acquire) {
                let workers = std::os::fd::AsFd::as_fd(&session)
                    .try_clone_to_owned()
                    .and_then(|fd| uring::UringWorkers::start(fs.clone(), fd, cfg.uring_per_queue, MAX_IO as usize));
                match workers {
                    Ok(w) => uring = Some(w),
                    Err(e) => fallback = Some(format!("cannot start io_uring workers: {e}")),
                }
            } else {
                fallback = Some("the kernel did not offer it at INIT".into());
            }
        }
        let workers = devloop::DevWorkers::start(fs, std::os::fd::AsFd::as_fd(&session), cfg.threads, false)
            .map_err(|source| FuseError::Mount { path: cfg.mountpoint.clone(), source })?;
        let transport = match (&uring, fallback) {
            (Some(w), _) => Transport::IoUring { workers: w.workers() },
            (None, Some(why)) => Transport::DevFuseFallback(why),
            (None, None) => Transport::DevFuse,
        };
        let m = Self {
            session: Some(session),
            adopted: None,
            served: AtomicBool::new(true),
            workers: Some(workers),
            uring,
            transport,
            mountpoint: cfg.mountpoint,
        };
        m.wait_for_ring();
        Ok(m)
    }

    /// The kernel switches to the ring once every CPU's queue has a worker
    /// registered, which the workers do on their own threads. Returns once a
    /// request went over the ring, a worker failed, or 2 s passed (then the
    /// mount serves on `/dev/fuse` and `transport()` says so).
    fn wait_for_ring(&self) {
        let Some(w) = &self.uring else { return };
        let Ok(path) = std::ffi::CString::new(self.mountpoint.as_os_str().as_bytes()) else { return };
        let deadline = std::time::Instant::now() + Duration::from_secs(2);
        while w.served() == 0 && w.failure().is_none() {
            if std::time::Instant::now() > deadline {
                w.fail("the workers registered, but the kernel never sent a request over the ring".into());
                return;
            }
            // statfs is never cached, so each call is one request to us.
            let _ = rustix::fs::statfs(path.as_c_str());
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// How requests reach the workers. Workers whose io_uring registration
    /// failed show up here as a fallback once they have ended.
    pub fn transport(&self) -> Transport {
        match (&self.transport, &self.uring) {
            (Transport::IoUring { .. }, Some(w)) => match w.failure() {
                Some(why) => Transport::DevFuseFallback(why),
                None => self.transport.clone(),
            },
            (t, _) => t.clone(),
        }
    }

    /// Requests served over io_uring so far.
    pub fn uring_requests(&self) -> u64 {
        self.uring.as_ref().map_or(0, uring::UringWorkers::served)
    }

    /// `/dev/fuse` workers' polls of an empty queue so far, and those that
    /// found a request before the worker would have slept ([`devloop`]).
    pub fn polls(&self) -> (u64, u64) {
        self.workers.as_ref().map_or((0, 0), devloop::DevWorkers::polls)
    }

    /// Mount point.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Path of the file for device `name`.
    pub fn path_of(&self, name: &str) -> PathBuf {
        self.mountpoint.join(name)
    }

    /// Serves a mount that a predecessor process made, on its connection
    /// `fd` (passed over a unix socket), with `cfg`'s exports and threads;
    /// nothing is mounted and no INIT takes place. With `ring`, the
    /// predecessor's io_uring entries and the requests they hold are taken
    /// over too ([`FuseMount::ring_handover`]). The workers start paused:
    /// they take requests after [`FuseMount::resume`], once the predecessor
    /// can no longer serve.
    pub fn adopt(fd: std::os::fd::OwnedFd, cfg: FuseConfig, ring: Option<AdoptedRing>) -> Result<Self, FuseError> {
        let fs = Arc::new(BlockFs::new(cfg.exports, false));
        let mount_err = |source| FuseError::Mount { path: cfg.mountpoint.clone(), source };
        let uring = ring
            .map(|ring| {
                let conn = std::os::fd::AsFd::as_fd(&fd).try_clone_to_owned()?;
                uring::UringWorkers::adopt(fs.clone(), conn, ring)
            })
            .transpose()
            .map_err(mount_err)?;
        let workers =
            devloop::DevWorkers::start(fs, std::os::fd::AsFd::as_fd(&fd), cfg.threads, true).map_err(mount_err)?;
        let transport = match &uring {
            Some(w) => Transport::IoUring { workers: w.workers() },
            None => Transport::DevFuse,
        };
        Ok(Self {
            session: None,
            adopted: Some(fd),
            served: AtomicBool::new(false),
            workers: Some(workers),
            uring,
            transport,
            mountpoint: cfg.mountpoint,
        })
    }

    /// The FUSE connection, to pass to a successor.
    pub fn connection(&self) -> std::os::fd::BorrowedFd<'_> {
        match (&self.session, &self.adopted) {
            (Some(s), _) => std::os::fd::AsFd::as_fd(s),
            (None, Some(fd)) => std::os::fd::AsFd::as_fd(fd),
            (None, None) => unreachable!("a mount has a connection until it is dropped"),
        }
    }

    /// Stops taking requests; returns once every request taken is answered
    /// (those not taken wait in the kernel). Over io_uring, each entry that
    /// a request can reach is left holding one, unanswered, for
    /// [`FuseMount::ring_handover`] (`uring::UringWorkers::pause`).
    pub fn pause(&self) -> Result<(), String> {
        if let Some(w) = &self.workers {
            w.pause();
        }
        if let Some(u) = &self.uring {
            if let Err(why) = u.pause(&self.mountpoint, URING_PAUSE_TIMEOUT) {
                self.resume();
                return Err(why);
            }
        }
        Ok(())
    }

    /// Takes requests again after [`FuseMount::pause`], or for the first
    /// time after [`FuseMount::adopt`].
    pub fn resume(&self) {
        self.served.store(true, Ordering::Release);
        if let Some(u) = &self.uring {
            u.resume();
        }
        if let Some(w) = &self.workers {
            w.resume();
        }
    }

    /// After [`FuseMount::pause`], over io_uring: what a successor needs to
    /// take the ring entries over ([`FuseMount::adopt`]), with the memfds
    /// of their buffers, in [`RingHandover::regions`] order.
    /// `None` also when no entry serves (the ring failed at the start and
    /// the kernel serves on `/dev/fuse`).
    pub fn ring_handover(&self) -> Option<(RingHandover, Vec<std::os::fd::BorrowedFd<'_>>)> {
        let (h, fds) = self.uring.as_ref().map(uring::UringWorkers::handover)?;
        (!h.held.is_empty() || !h.fresh.is_empty()).then_some((h, fds))
    }

    /// Ends this process's part after a successor adopted the mount: the
    /// (paused) workers stop, leaving the requests they hold to the
    /// successor, and the mount stays.
    pub fn leave_mounted(mut self) {
        if let Some(w) = self.workers.take() {
            w.stop();
        }
        if let Some(u) = self.uring.take() {
            u.leave();
        }
        if let Some(s) = self.session.take() {
            // Dropping the session would unmount.
            std::mem::forget(s);
        }
        self.adopted.take();
    }

    /// Unmounts and waits for the workers.
    pub fn unmount(mut self) -> Result<(), FuseError> {
        let path = self.mountpoint.clone();
        let r = self.unmount_now().map_err(|source| FuseError::Unmount { path, source });
        self.join_uring_if(r.is_ok());
        r
    }

    /// Unmounts (the kernel then ends the connection, and the workers with it).
    fn unmount_now(&mut self) -> std::io::Result<()> {
        let r = match (self.session.is_some(), self.adopted.is_some()) {
            (true, _) => {
                // Ours first (fuser's takes its mount whether or not the
                // unmount worked, so it cannot be tried again), then
                // fuser's, which finds the connection gone.
                let r = unmount_when_free(&self.mountpoint);
                if let (Ok(()), Some(mut s)) = (&r, self.session.take()) {
                    let _ = s.unmount();
                }
                r
            }
            (false, true) => unmount_when_free(&self.mountpoint),
            (false, false) => Ok(()),
        };
        if r.is_ok() {
            if let Some(w) = self.workers.take() {
                w.stop();
            }
            self.adopted.take();
        }
        r
    }

    /// After a successful unmount the connection is gone and every io_uring
    /// worker's command ends, so they can be joined; after a failed one they
    /// are left running rather than waited for forever.
    fn join_uring_if(&mut self, unmounted: bool) {
        if let Some(w) = self.uring.take() {
            if unmounted {
                w.join();
            }
        }
    }
}

/// How long an unmount is tried again while the mount is busy.
pub const UNMOUNT_BUSY_WAIT: Duration = Duration::from_secs(5);

/// Unmounts `path`, trying again for [`UNMOUNT_BUSY_WAIT`] while it is
/// busy: a loop device detached a moment ago lets go of its file only once
/// its last user has closed it, which the kernel finishes after
/// `LOOP_CLR_FD` returns (seen under systemd: a `swap down` right after a
/// zram front let go of the loop device found the mount busy).
fn unmount_when_free(path: &Path) -> std::io::Result<()> {
    let deadline = std::time::Instant::now() + UNMOUNT_BUSY_WAIT;
    loop {
        match rustix::mount::unmount(path, rustix::mount::UnmountFlags::empty()) {
            Err(rustix::io::Errno::BUSY) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            r => return r.map_err(std::io::Error::from),
        }
    }
}

impl Drop for FuseMount {
    fn drop(&mut self) {
        if self.session.is_some() || (self.adopted.is_some() && self.served.load(Ordering::Acquire)) {
            let r = self.unmount_now();
            self.join_uring_if(r.is_ok());
        } else {
            // Adopted, never served: the workers end, leaving the requests
            // the ring entries hold to the predecessor, which still serves.
            if let Some(w) = self.workers.take() {
                w.stop();
            }
            if let Some(u) = self.uring.take() {
                u.leave();
            }
        }
    }
}
