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

use std::cell::RefCell;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use fuser::{
    Config, Errno, FileAttr, FileHandle, FileType, FopenFlags, Generation, INodeNo, KernelConfig, LockOwner,
    MountOption, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs,
    ReplyWrite, Request, SessionACL, WriteFlags,
};
use tmem_block::BlockDevice;

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
}

struct BlockFs {
    exports: Vec<Export>,
    uid: u32,
    gid: u32,
    started: SystemTime,
}

thread_local! {
    /// Per-worker I/O buffer: allocated on a worker's first request, reused after.
    static IO_BUF: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

fn errno(e: &tmem_block::BlockError) -> Errno {
    Errno::from_i32(e.errno())
}

impl BlockFs {
    fn export(&self, ino: INodeNo) -> Option<&Export> {
        let i = ino.0.checked_sub(ROOT + 1)?;
        self.exports.get(usize::try_from(i).ok()?)
    }

    fn attr(&self, ino: u64) -> Option<FileAttr> {
        let (kind, size, perm, nlink) = if ino == ROOT {
            (FileType::Directory, 0, 0o700, 2)
        } else {
            let e = self.export(INodeNo(ino))?;
            (FileType::RegularFile, e.device.size(), 0o600, 1)
        };
        Some(FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size / 512,
            atime: self.started,
            mtime: self.started,
            ctime: self.started,
            crtime: self.started,
            kind,
            perm,
            nlink,
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        })
    }
}

impl fuser::Filesystem for BlockFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Best effort: the kernel may cap these; smaller values still work.
        let _ = config.set_max_write(MAX_WRITE);
        let _ = config.set_max_background(MAX_BACKGROUND);
        let _ = config.set_congestion_threshold(MAX_BACKGROUND / 4 * 3);
        // Without ASYNC_DIO the kernel turns an async direct I/O (what a loop
        // device with --direct-io=on submits) into a synchronous request, and
        // loop then waits for each one in turn.
        let _ = config.add_capabilities(fuser::InitFlags::FUSE_ASYNC_DIO);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let found = (parent.0 == ROOT)
            .then(|| self.exports.iter().position(|e| OsStr::new(&e.name) == name))
            .flatten()
            .and_then(|i| self.attr(ROOT + 1 + i as u64));
        match found {
            Some(attr) => reply.entry(&TTL, &attr, Generation(0)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.attr(ino.0) {
            Some(a) => reply.attr(&TTL, &a),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        if self.export(ino).is_none() {
            return reply.error(Errno::EISDIR);
        }
        reply.opened(FileHandle(0), FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES);
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let Some(e) = self.export(ino) else { return reply.error(Errno::ENOENT) };
        // Reads at or past the end return short, like a regular file.
        let end = offset.saturating_add(u64::from(size)).min(e.device.size());
        let len = usize::try_from(end.saturating_sub(offset)).unwrap_or(0);
        IO_BUF.with(|b| {
            let mut buf = b.borrow_mut();
            if buf.len() < MAX_IO as usize {
                buf.resize(MAX_IO as usize, 0);
            }
            let len = len.min(buf.len());
            match e.device.read_at(&mut buf[..len], offset) {
                Ok(()) => reply.data(&buf[..len]),
                Err(err) => reply.error(errno(&err)),
            }
        });
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let Some(e) = self.export(ino) else { return reply.error(Errno::ENOENT) };
        match e.device.write_at(data, offset) {
            Ok(()) => reply.written(u32::try_from(data.len()).unwrap_or(u32::MAX)),
            Err(err) => reply.error(errno(&err)),
        }
    }

    fn flush(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _lock: LockOwner, reply: ReplyEmpty) {
        match self.export(ino).map(|e| e.device.flush()) {
            Some(Ok(())) | None => reply.ok(),
            Some(Err(err)) => reply.error(errno(&err)),
        }
    }

    fn fsync(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        match self.export(ino).map(|e| e.device.flush()) {
            Some(Ok(())) | None => reply.ok(),
            Some(Err(err)) => reply.error(errno(&err)),
        }
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let Some(e) = self.export(ino) else { return reply.error(Errno::ENOENT) };
        let r = if mode == libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE {
            e.device.trim(offset, length)
        } else if mode & !libc::FALLOC_FL_KEEP_SIZE == libc::FALLOC_FL_ZERO_RANGE {
            e.device.write_zeroes(offset, length)
        } else if mode & !libc::FALLOC_FL_KEEP_SIZE == 0 {
            // Plain allocation: memory devices have nothing to reserve.
            match offset.checked_add(length) {
                Some(end) if end <= e.device.size() => Ok(()),
                _ => return reply.error(Errno::EFBIG),
            }
        } else {
            return reply.error(Errno::EOPNOTSUPP);
        };
        match r {
            Ok(()) => reply.ok(),
            Err(err) => reply.error(errno(&err)),
        }
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        if ino.0 != ROOT {
            return reply.error(Errno::ENOTDIR);
        }
        let mut entries: Vec<(u64, FileType, &str)> =
            vec![(ROOT, FileType::Directory, "."), (ROOT, FileType::Directory, "..")];
        for (i, e) in self.exports.iter().enumerate() {
            entries.push((ROOT + 1 + i as u64, FileType::RegularFile, &e.name));
        }
        for (i, (ino, kind, name)) in
            entries.into_iter().enumerate().skip(usize::try_from(offset).unwrap_or(usize::MAX))
        {
            if reply.add(INodeNo(ino), i as u64 + 1, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let blocks: u64 = self.exports.iter().map(|e| e.device.size() / 4096).sum();
        reply.statfs(blocks, 0, 0, u64::try_from(self.exports.len()).unwrap_or(0), 0, 4096, 255, 4096);
    }
}

/// A mounted export directory. Dropping it unmounts.
pub struct FuseMount {
    session: Option<fuser::BackgroundSession>,
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
        // SAFETY: getuid/getgid have no preconditions and cannot fail.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        let fs = BlockFs { exports: cfg.exports, uid, gid, started: SystemTime::now() };
        let mut options = Config::default();
        options.mount_options = vec![
            MountOption::FSName("tmem".into()),
            MountOption::Subtype("tmem".into()),
            MountOption::DefaultPermissions,
        ];
        options.acl = SessionACL::Owner;
        options.n_threads = Some(cfg.threads.max(1));
        options.clone_fd = true;
        let session = fuser::spawn_mount(fs, &cfg.mountpoint, &options)
            .map_err(|source| FuseError::Mount { path: cfg.mountpoint.clone(), source })?;
        Ok(Self { session: Some(session), mountpoint: cfg.mountpoint })
    }

    /// Mount point.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Path of the file for device `name`.
    pub fn path_of(&self, name: &str) -> PathBuf {
        self.mountpoint.join(name)
    }

    /// Unmounts and waits for the workers.
    pub fn unmount(mut self) -> Result<(), FuseError> {
        let path = self.mountpoint.clone();
        match self.session.take() {
            Some(s) => s.umount_and_join().map_err(|source| FuseError::Unmount { path, source }),
            None => Ok(()),
        }
    }
}

impl Drop for FuseMount {
    fn drop(&mut self) {
        if let Some(s) = self.session.take() {
            let _ = s.umount_and_join();
        }
    }
}
