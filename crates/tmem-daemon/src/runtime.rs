//! The daemon's runtime directory (`/run/tmem` by default): control socket,
//! FUSE mount point, log, lock.
//!
//! The daemon runs as root, and the directory may be given on the command
//! line, so nothing in it is trusted:
//! - it is created 0700, and refused if it is not owned by the daemon's user
//!   or if others may write to it;
//! - every file in it is opened relative to the directory's descriptor with
//!   `O_NOFOLLOW`, and new files are created with `O_EXCL` after the old name
//!   is unlinked, so a planted symlink is never followed;
//! - `daemon.lock` is held with `flock` for the daemon's whole life. That
//!   lock, not a probe of the control socket, says whether a daemon runs
//!   here, so a silent client can neither hide a daemon nor let a second one
//!   take over its socket and mount.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FlockOperation, Mode, OFlags};
use rustix::io::Errno;

/// Name of the lock file.
pub const LOCK_FILE: &str = "daemon.lock";
/// Name of the log file.
pub const LOG_FILE: &str = "daemon.log";
/// Name of the state file: what the daemon set up, for recovery after it died.
pub const STATE_FILE: &str = "state.json";

/// Runtime directory errors.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The directory or a file in it cannot be used.
    #[error("{path}: {source}")]
    Io {
        /// Path.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// The directory is not safe to use.
    #[error("runtime directory {path}: {reason}")]
    Unsafe {
        /// Path.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// Another daemon holds the lock.
    #[error("a tmem daemon{} already runs in {path}; see `tmem stat --runtime-dir {path}`", pid.map(|p| format!(" (pid {p})")).unwrap_or_default())]
    Held {
        /// Path of the directory.
        path: PathBuf,
        /// Its pid, when it wrote one.
        pid: Option<u32>,
    },
}

/// An open, checked runtime directory.
#[derive(Debug)]
pub struct RuntimeDir {
    path: PathBuf,
    fd: OwnedFd,
}

/// The daemon's lifetime lock: `flock` on `daemon.lock`, released when the
/// last descriptor of its open file is closed (also when the daemon dies).
#[derive(Debug)]
pub struct DaemonLock {
    file: File,
}

impl AsFd for DaemonLock {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.file.as_fd()
    }
}

fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

impl RuntimeDir {
    /// Creates the directory (0700) if it is missing, then opens and checks it.
    pub fn create(path: &Path) -> Result<Self, RuntimeError> {
        match rustix::fs::mkdir(path, Mode::from_raw_mode(0o700)) {
            Ok(()) | Err(Errno::EXIST) => {}
            Err(e) => return Err(io(path, e)),
        }
        Self::open(path)
    }

    /// Opens and checks an existing directory: not a symlink, owned by the
    /// daemon's user, not writable by group or others.
    pub fn open(path: &Path) -> Result<Self, RuntimeError> {
        let fd = rustix::fs::open(
            path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| match e {
            Errno::LOOP | Errno::NOTDIR => unsafe_dir(path, "is a symbolic link or not a directory"),
            e => io(path, e),
        })?;
        let st = rustix::fs::fstat(&fd).map_err(|e| io(path, e))?;
        if st.st_uid != euid() {
            return Err(unsafe_dir(
                path,
                &format!("owned by uid {}, not by the daemon's user (uid {})", st.st_uid, euid()),
            ));
        }
        if st.st_mode & 0o022 != 0 {
            return Err(unsafe_dir(
                path,
                &format!(
                    "mode {:o} lets group or others write to it; use a directory with mode 0700",
                    st.st_mode & 0o7777
                ),
            ));
        }
        Ok(Self { path: path.to_owned(), fd })
    }

    /// Path of the directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Path of `name` in the directory (for messages and for programs that
    /// take paths: losetup, the kernel's bind and mount).
    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// Creates `name` anew (0600): unlinks what is there, then `O_CREAT |
    /// O_EXCL | O_NOFOLLOW`, so a symlink planted under that name is removed,
    /// never followed.
    pub fn create_file(&self, name: &str) -> Result<File, RuntimeError> {
        self.remove(name)?;
        let fd = rustix::fs::openat(
            &self.fd,
            name,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map_err(|e| io(&self.join(name), e))?;
        Ok(File::from(fd))
    }

    /// Opens `name` for reading (`O_NOFOLLOW | O_NONBLOCK`); `None` if absent.
    pub fn open_file(&self, name: &str) -> Result<Option<File>, RuntimeError> {
        match rustix::fs::openat(
            &self.fd,
            name,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => Ok(Some(File::from(fd))),
            Err(Errno::NOENT) => Ok(None),
            Err(e) => Err(io(&self.join(name), e)),
        }
    }

    /// Reads a small text file in the directory (at most `limit` bytes).
    pub fn read_file(&self, name: &str, limit: u64) -> Result<Option<String>, RuntimeError> {
        let Some(f) = self.open_file(name)? else { return Ok(None) };
        let mut text = String::new();
        f.take(limit).read_to_string(&mut text).map_err(|e| RuntimeError::Io { path: self.join(name), source: e })?;
        Ok(Some(text))
    }

    /// The last `lines` lines of the daemon's log (read from its last 64 KiB).
    pub fn log_tail(&self, lines: usize) -> String {
        let Ok(Some(mut f)) = self.open_file(LOG_FILE) else { return String::new() };
        let len = f.metadata().map_or(0, |m| m.len());
        let mut text = Vec::new();
        let read = std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(len.saturating_sub(64 << 10)))
            .and_then(|_| f.read_to_end(&mut text));
        if read.is_err() {
            return String::new();
        }
        let text = String::from_utf8_lossy(&text);
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Replaces `name` atomically with `bytes` (a new file, then rename).
    pub fn write_atomic(&self, name: &str, bytes: &[u8]) -> Result<(), RuntimeError> {
        let tmp = format!(".{name}.tmp");
        let mut f = self.create_file(&tmp)?;
        f.write_all(bytes)
            .and_then(|()| f.sync_data())
            .map_err(|e| RuntimeError::Io { path: self.join(&tmp), source: e })?;
        rustix::fs::renameat(&self.fd, tmp.as_str(), &self.fd, name).map_err(|e| io(&self.join(name), e))
    }

    /// Removes `name` (a file, socket or symlink) if it exists.
    pub fn remove(&self, name: &str) -> Result<(), RuntimeError> {
        match rustix::fs::unlinkat(&self.fd, name, AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => Ok(()),
            Err(e) => Err(io(&self.join(name), e)),
        }
    }

    /// Creates the subdirectory `name` (0700) if missing, and checks that
    /// nothing is mounted on it. A dead FUSE daemon's mount answers ENOTCONN.
    pub fn mount_point(&self, name: &str) -> Result<PathBuf, RuntimeError> {
        match rustix::fs::mkdirat(&self.fd, name, Mode::from_raw_mode(0o700)) {
            Ok(()) | Err(Errno::EXIST) => {}
            Err(e) => return Err(io(&self.join(name), e)),
        }
        if self.is_mounted(name)? {
            return Err(unsafe_dir(
                &self.path,
                &format!(
                    "{} is still mounted (left by a daemon that died?); `tmem swap down --runtime-dir {}` cleans up",
                    self.join(name).display(),
                    self.path.display()
                ),
            ));
        }
        Ok(self.join(name))
    }

    /// Whether something is mounted on `name` (or a dead mount is left there).
    pub fn is_mounted(&self, name: &str) -> Result<bool, RuntimeError> {
        let top = rustix::fs::fstat(&self.fd).map_err(|e| io(&self.path, e))?;
        match rustix::fs::statat(&self.fd, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => {
                if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
                    return Err(unsafe_dir(&self.path, &format!("{} is not a directory", self.join(name).display())));
                }
                Ok(st.st_dev != top.st_dev)
            }
            Err(Errno::NOTCONN) => Ok(true),
            Err(Errno::NOENT) => Ok(false),
            Err(e) => Err(io(&self.join(name), e)),
        }
    }

    /// Takes the daemon lock, or says who holds it. Writes our pid into it.
    pub fn lock(&self) -> Result<DaemonLock, RuntimeError> {
        self.take_lock(self.lock_file()?)
    }

    /// Locks `file` (this directory's lock file) exclusively without
    /// waiting, and writes our pid into it.
    fn take_lock(&self, file: File) -> Result<DaemonLock, RuntimeError> {
        match rustix::fs::flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(Errno::WOULDBLOCK) => return Err(RuntimeError::Held { path: self.path.clone(), pid: self.lock_pid() }),
            Err(e) => return Err(io(&self.join(LOCK_FILE), e)),
        }
        let lock = DaemonLock { file };
        lock.write_pid(std::process::id()).map_err(|e| RuntimeError::Io { path: self.join(LOCK_FILE), source: e })?;
        Ok(lock)
    }

    /// Whether a live daemon holds the lock (a probe that takes and drops a
    /// shared lock; it never blocks).
    pub fn is_locked(&self) -> Result<bool, RuntimeError> {
        let file = match self.open_file(LOCK_FILE)? {
            Some(f) => f,
            None => return Ok(false),
        };
        match rustix::fs::flock(&file, FlockOperation::NonBlockingLockShared) {
            Ok(()) => Ok(false),
            Err(Errno::WOULDBLOCK) => Ok(true),
            Err(e) => Err(io(&self.join(LOCK_FILE), e)),
        }
    }

    /// The pid written into the lock file by the daemon that took it last.
    pub fn lock_pid(&self) -> Option<u32> {
        self.read_file(LOCK_FILE, 32).ok().flatten().and_then(|t| t.trim().parse().ok())
    }

    /// Takes over a lock handed down as an inherited descriptor (from
    /// `tmem swap up` to the daemon it starts). The descriptor must be this
    /// directory's lock file, and its lock is taken again (a no-op for the
    /// holder's open file), so a stray number cannot be adopted.
    pub fn adopt_lock(&self, raw: RawFd) -> Result<DaemonLock, RuntimeError> {
        let ours = self.lock_file()?;
        // SAFETY: `raw` was passed to this process, not closed-on-exec, by the
        // parent for this purpose; nothing else in the process owns it. It is
        // checked below to be our lock file before it is used.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(raw) });
        let (a, b) = (rustix::fs::fstat(&file), rustix::fs::fstat(&ours));
        match (a, b) {
            (Ok(a), Ok(b)) if a.st_dev == b.st_dev && a.st_ino == b.st_ino => {}
            _ => {
                return Err(unsafe_dir(
                    &self.path,
                    &format!("descriptor {raw} is not {}", self.join(LOCK_FILE).display()),
                ))
            }
        }
        drop(ours);
        rustix::io::fcntl_setfd(&file, rustix::io::FdFlags::CLOEXEC).map_err(|e| io(&self.join(LOCK_FILE), e))?;
        self.take_lock(file)
    }

    fn lock_file(&self) -> Result<File, RuntimeError> {
        // The lock file persists between daemons, so no O_EXCL; O_NOFOLLOW
        // still refuses a planted symlink.
        let fd = rustix::fs::openat(
            &self.fd,
            LOCK_FILE,
            OFlags::RDWR | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )
        .map_err(|e| io(&self.join(LOCK_FILE), e))?;
        let st = rustix::fs::fstat(&fd).map_err(|e| io(&self.join(LOCK_FILE), e))?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(unsafe_dir(&self.path, &format!("{} is not a regular file", self.join(LOCK_FILE).display())));
        }
        Ok(File::from(fd))
    }
}

impl DaemonLock {
    fn write_pid(&self, pid: u32) -> std::io::Result<()> {
        // At offset 0: the open file (and its offset) may be shared with the
        // command that handed the lock down.
        self.file.set_len(0)?;
        std::os::unix::fs::FileExt::write_all_at(&self.file, format!("{pid}\n").as_bytes(), 0)
    }

    /// The descriptor to hand to a child (cleared of close-on-exec): the
    /// child shares the open file, and so the lock.
    pub fn inheritable_fd(&self) -> Result<RawFd, std::io::Error> {
        rustix::io::fcntl_setfd(&self.file, rustix::io::FdFlags::empty())?;
        Ok(self.file.as_fd().as_raw_fd())
    }
}

fn io(path: &Path, e: Errno) -> RuntimeError {
    RuntimeError::Io { path: path.to_owned(), source: e.into() }
}

fn unsafe_dir(path: &Path, reason: &str) -> RuntimeError {
    RuntimeError::Unsafe { path: path.to_owned(), reason: reason.to_owned() }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn creates_0700_and_refuses_unsafe_directories() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("run");
        RuntimeDir::create(&p).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o700);
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = RuntimeDir::open(&p).unwrap_err().to_string();
        assert!(e.contains("lets group or others write"), "{e}");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o700)).unwrap();
        let link = t.path().join("link");
        std::os::unix::fs::symlink(&p, &link).unwrap();
        assert!(RuntimeDir::open(&link).unwrap_err().to_string().contains("symbolic link"));
        if euid() == 0 {
            std::os::unix::fs::chown(&p, Some(65534), None).unwrap();
            assert!(RuntimeDir::open(&p).unwrap_err().to_string().contains("owned by uid 65534"));
        }
    }

    /// A symlink planted under the log's name is replaced, and its target is
    /// left as it was (finding: `--runtime-dir` followed planted symlinks).
    #[test]
    fn planted_symlinks_are_never_followed() {
        let t = tempfile::tempdir().unwrap();
        let victim = t.path().join("victim");
        std::fs::write(&victim, "precious").unwrap();
        let p = t.path().join("run");
        let dir = RuntimeDir::create(&p).unwrap();
        std::os::unix::fs::symlink(&victim, p.join(LOG_FILE)).unwrap();
        std::os::unix::fs::symlink(&victim, p.join("state.json")).unwrap();
        dir.create_file(LOG_FILE).unwrap().write_all(b"log").unwrap();
        dir.write_atomic("state.json", b"{}").unwrap();
        assert!(dir.open_file("nothing").unwrap().is_none());
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        assert_eq!(std::fs::read_to_string(p.join(LOG_FILE)).unwrap(), "log");
        std::os::unix::fs::symlink(&victim, p.join("other")).unwrap();
        assert!(dir.open_file("other").is_err(), "reading through a symlink is refused");
        // A symlinked lock file is refused, not followed.
        std::os::unix::fs::symlink(&victim, p.join(LOCK_FILE)).unwrap();
        assert!(dir.lock().is_err());
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    }

    #[test]
    fn the_lock_is_exclusive_and_names_its_holder() {
        let t = tempfile::tempdir().unwrap();
        let dir = RuntimeDir::create(&t.path().join("run")).unwrap();
        assert!(!dir.is_locked().unwrap());
        let held = dir.lock().unwrap();
        assert!(dir.is_locked().unwrap());
        match dir.lock() {
            Err(RuntimeError::Held { pid, .. }) => assert_eq!(pid, Some(std::process::id())),
            other => panic!("{other:?}"),
        }
        drop(held);
        assert!(!dir.is_locked().unwrap());
        let again = dir.lock().unwrap();
        // Adopting a descriptor that is not the lock file is refused.
        let other = dir.create_file("x").unwrap();
        let raw = std::os::fd::IntoRawFd::into_raw_fd(rustix::io::fcntl_dupfd_cloexec(&other, 0).unwrap());
        assert!(dir.adopt_lock(raw).is_err());
        drop(again);
    }

    #[test]
    fn mount_point_refuses_a_mounted_directory() {
        let t = tempfile::tempdir().unwrap();
        let dir = RuntimeDir::create(&t.path().join("run")).unwrap();
        assert!(!dir.is_mounted("dev").unwrap());
        assert_eq!(dir.mount_point("dev").unwrap(), t.path().join("run/dev"));
        assert!(!dir.is_mounted("dev").unwrap());
    }
}
