//! userfaultfd itself: creating one without `UFFD_USER_MODE_ONLY`, the API
//! handshake, and the range ioctls tmem uses.
//!
//! Written against the uapi (`linux-raw-sys`) rather than the `userfaultfd`
//! crate: that crate has no `UFFDIO_MOVE`, and its `Uffd` is created in the
//! calling process, while here the descriptor is made in the program (the
//! agent) and used from the helper, which only ever holds a raw fd.

use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;

use linux_raw_sys::general as uapi;
use linux_raw_sys::ioctl as nr;

/// Bytes of a page: the only size tmem moves.
pub const PAGE: usize = 4096;

/// `UFFDIO_MOVE`: `_IOWR(0xAA, _UFFDIO_MOVE, struct uffdio_move)`; the
/// uapi crate has the struct and the command number but not the ioctl.
const UFFDIO_MOVE: u32 = ioc_readwrite(uapi::_UFFDIO_MOVE, std::mem::size_of::<uapi::uffdio_move>());
/// `USERFAULTFD_IOC_NEW`: `_IO(0xAA, 0)` on `/dev/userfaultfd`.
const USERFAULTFD_IOC_NEW: u32 = 0xAA00;

const fn ioc_readwrite(command: u32, size: usize) -> u32 {
    // _IOC(_IOC_READ | _IOC_WRITE, 0xAA, command, size) on x86_64 and aarch64.
    #[allow(clippy::cast_possible_truncation)]
    let size = size as u32;
    (3 << 30) | (size << 16) | (0xAA << 8) | command
}

/// The features `tmem run` needs from the kernel: the program's own
/// `munmap`, `mremap` and `madvise` reported, and `UFFDIO_MOVE` for
/// eviction.
pub const FEATURES: u64 = (uapi::UFFD_FEATURE_EVENT_REMAP
    | uapi::UFFD_FEATURE_THREAD_ID
    | uapi::UFFD_FEATURE_EVENT_REMOVE
    | uapi::UFFD_FEATURE_EVENT_UNMAP
    | uapi::UFFD_FEATURE_MOVE) as u64;

/// Why no userfaultfd could be made. Each names the setting that would allow it.
#[derive(Debug, thiserror::Error)]
pub enum AccessError {
    #[error(
        "userfaultfd is not allowed for this user: the syscall needs vm.unprivileged_userfaultfd=1 \
         (it is {sysctl}), and /dev/userfaultfd {device}. Give the user /dev/userfaultfd once, as root: \
         `groupadd -f userfaultfd && usermod -aG userfaultfd $USER && chgrp userfaultfd /dev/userfaultfd && chmod 660 /dev/userfaultfd` \
         (the tmem package ships a udev rule that keeps it so), then log in again. \
         tmem never falls back to UFFD_USER_MODE_ONLY: there, a page the kernel touches in a system call fails with EFAULT"
    )]
    NotAllowed { sysctl: String, device: String },
    #[error("the userfaultfd syscall is blocked ({0}): a seccomp profile (container runtimes' defaults do this) forbids it; run with one that allows userfaultfd, or outside the container's default profile")]
    Blocked(io::Error),
    #[error("this kernel has no userfaultfd (CONFIG_USERFAULTFD)")]
    NoKernelSupport,
    #[error("this kernel's userfaultfd lacks {missing} (tmem run needs Linux 6.8 or later for UFFDIO_MOVE)")]
    MissingFeatures { missing: String },
    #[error("userfaultfd: {0}")]
    Other(io::Error),
}

/// What one read from a userfaultfd said.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// Thread `tid` touched a missing page at `addr` (page-aligned).
    Fault { addr: u64, write: bool, tid: u32 },
    /// `madvise(MADV_DONTNEED/FREE/REMOVE)` over `[start, end)`.
    Remove { start: u64, end: u64 },
    /// `munmap` (or a `mremap` that shrank, or `MAP_FIXED` over) `[start, end)`.
    Unmap { start: u64, end: u64 },
    /// `mremap` moved `len` bytes from `from` to `to`.
    Remap { from: u64, to: u64, len: u64 },
    /// An event tmem did not ask for (fork): ignored.
    Other(u8),
}

/// What a range ioctl reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Done,
    /// The program's memory map is changing (an event is pending): read the
    /// events first, then try again.
    Retry,
    /// The address is no longer mapped or registered, or already has a page.
    Gone,
    /// The page cannot be moved (shared with a child after `fork`, the zero
    /// page, pinned).
    Busy,
}

/// A userfaultfd, held by the helper; it may have been made in another
/// process, whose memory its ioctls then act on.
#[derive(Debug)]
pub struct Uffd(OwnedFd);

fn sysctl_value() -> String {
    std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd")
        .map_or_else(|_| "unreadable".into(), |s| s.trim().to_string())
}

impl Uffd {
    /// Makes a userfaultfd for the calling process in full mode (faults in
    /// system calls delivered too): the syscall first, then `/dev/userfaultfd`.
    pub fn create() -> Result<Self, AccessError> {
        let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
        // SAFETY: userfaultfd(2) takes one int of flags and returns a new fd or -1.
        let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) };
        if fd >= 0 {
            #[allow(clippy::cast_possible_truncation)]
            // SAFETY: the syscall returned a new descriptor that nothing else owns.
            return Ok(Self(unsafe { OwnedFd::from_raw_fd(fd as RawFd) }));
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::ENOSYS) => {
                // seccomp's default action in container runtimes is ENOSYS or EPERM;
                // a kernel without userfaultfd has no /proc entry either.
                if std::path::Path::new("/proc/sys/vm/unprivileged_userfaultfd").exists() {
                    return Err(AccessError::Blocked(err));
                }
                return Err(AccessError::NoKernelSupport);
            }
            Some(libc::EPERM) => {}
            _ => return Err(AccessError::Other(err)),
        }
        let device =
            match OpenOptions::new().read(true).write(true).custom_flags(libc::O_CLOEXEC).open("/dev/userfaultfd") {
                Ok(dev) => dev,
                Err(e) => {
                    let device = match e.kind() {
                        io::ErrorKind::NotFound => "does not exist (Linux 6.1+)".to_string(),
                        io::ErrorKind::PermissionDenied => "is not readable and writable by this user".to_string(),
                        _ => format!("cannot be opened: {e}"),
                    };
                    return Err(AccessError::NotAllowed { sysctl: sysctl_value(), device });
                }
            };
        // SAFETY: USERFAULTFD_IOC_NEW takes the new fd's flags as its argument.
        let fd = unsafe { libc::ioctl(device.as_raw_fd(), USERFAULTFD_IOC_NEW.into(), flags) };
        if fd < 0 {
            return Err(AccessError::Other(io::Error::last_os_error()));
        }
        // SAFETY: the ioctl returned a new descriptor that nothing else owns.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Takes a userfaultfd received from the agent.
    pub fn from_fd(fd: OwnedFd) -> Self {
        Self(fd)
    }

    pub fn into_fd(self) -> OwnedFd {
        self.0
    }

    pub fn raw(&self) -> RawFd {
        self.0.as_raw_fd()
    }

    /// The API handshake, asking for [`FEATURES`]; names what the kernel lacks.
    pub fn handshake(&self) -> Result<(), AccessError> {
        let mut api = uapi::uffdio_api { api: uapi::UFFD_API.into(), features: FEATURES, ioctls: 0 };
        if let Err(e) = self.ioctl(nr::UFFDIO_API, &mut api) {
            if e.raw_os_error() == Some(libc::EINVAL) {
                let mut probe = uapi::uffdio_api { api: uapi::UFFD_API.into(), features: 0, ioctls: 0 };
                // The kernel's supported features come back in `features` of a
                // handshake that asks for none (on a fresh fd only: this one is spent).
                let _ = Self::create().map(|u| u.ioctl(nr::UFFDIO_API, &mut probe));
                let missing = FEATURES & !probe.features;
                return Err(AccessError::MissingFeatures { missing: feature_names(missing) });
            }
            return Err(AccessError::Other(e));
        }
        Ok(())
    }

    fn ioctl<T>(&self, request: u32, arg: &mut T) -> io::Result<()> {
        // SAFETY: every caller passes the uapi struct that `request` reads and writes.
        let rc = unsafe { libc::ioctl(self.0.as_raw_fd(), request.into(), std::ptr::from_mut(arg)) };
        if rc < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    }

    /// Registers `[start, start + len)` for missing faults.
    pub fn register(&self, start: u64, len: u64) -> io::Result<()> {
        let mut reg = uapi::uffdio_register {
            range: uapi::uffdio_range { start, len },
            mode: uapi::UFFDIO_REGISTER_MODE_MISSING.into(),
            ioctls: 0,
        };
        self.ioctl(nr::UFFDIO_REGISTER, &mut reg)
    }

    /// Maps a copy of `page` at `dst` and wakes the threads waiting there.
    pub fn copy(&self, dst: u64, page: &[u8; PAGE]) -> Outcome {
        let mut c = uapi::uffdio_copy { dst, src: page.as_ptr() as u64, len: PAGE as u64, mode: 0, copy: 0 };
        outcome(self.ioctl(nr::UFFDIO_COPY, &mut c))
    }

    /// Moves the page at `src` to `dst` (`dst` registered and empty) and
    /// wakes any thread waiting at `dst`. Only the process that owns the
    /// memory may move (the kernel refuses cross-mm moves with EINVAL), so
    /// the agent calls this, on its own copy of the descriptor.
    pub fn move_page(fd: BorrowedFd<'_>, dst: u64, src: u64) -> Outcome {
        let mut m = uapi::uffdio_move { dst, src, len: PAGE as u64, mode: 0, move_: 0 };
        // SAFETY: UFFDIO_MOVE reads and writes one struct uffdio_move.
        let rc = unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_MOVE.into(), &raw mut m) };
        outcome(if rc < 0 { Err(io::Error::last_os_error()) } else { Ok(()) })
    }

    /// Wakes threads waiting on a fault in `[start, start + len)`.
    pub fn wake(&self, start: u64, len: u64) -> io::Result<()> {
        let mut r = uapi::uffdio_range { start, len };
        self.ioctl(nr::UFFDIO_WAKE, &mut r)
    }

    /// Reads up to `out.len()` events; 0 when none is pending (the fd is non-blocking).
    pub fn read_events(&self, out: &mut [Event]) -> io::Result<usize> {
        const MSG: usize = MSG_LEN;
        let mut raw = [0u8; MSG * 64];
        let want = out.len().min(64) * MSG;
        // SAFETY: reads at most `want` bytes into `raw`, which is at least that long.
        let n = unsafe { libc::read(self.0.as_raw_fd(), raw.as_mut_ptr().cast(), want) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::WouldBlock { Ok(0) } else { Err(e) };
        }
        #[allow(clippy::cast_sign_loss)]
        let count = n as usize / MSG;
        for (i, slot) in out.iter_mut().enumerate().take(count) {
            *slot = parse_msg(raw[i * MSG..(i + 1) * MSG].try_into().expect("one message"));
        }
        Ok(count)
    }
}

impl AsFd for Uffd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl IntoRawFd for Uffd {
    fn into_raw_fd(self) -> RawFd {
        self.0.into_raw_fd()
    }
}

fn word(msg: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&msg[at..at + 8]);
    u64::from_ne_bytes(b)
}

/// Bytes of one `struct uffd_msg`.
pub const MSG_LEN: usize = 32;

/// One `struct uffd_msg` (packed): event at 0, its argument at 8.
#[must_use]
pub fn parse_msg(msg: &[u8; MSG_LEN]) -> Event {
    let event = u32::from(msg[0]);
    match event {
        uapi::UFFD_EVENT_PAGEFAULT => Event::Fault {
            addr: word(msg, 16) & !(PAGE as u64 - 1),
            write: word(msg, 8) & u64::from(uapi::UFFD_PAGEFAULT_FLAG_WRITE) != 0,
            #[allow(clippy::cast_possible_truncation)]
            tid: word(msg, 24) as u32,
        },
        uapi::UFFD_EVENT_REMOVE => Event::Remove { start: word(msg, 8), end: word(msg, 16) },
        uapi::UFFD_EVENT_UNMAP => Event::Unmap { start: word(msg, 8), end: word(msg, 16) },
        uapi::UFFD_EVENT_REMAP => Event::Remap { from: word(msg, 8), to: word(msg, 16), len: word(msg, 24) },
        _ => Event::Other(msg[0]),
    }
}

fn outcome(r: io::Result<()>) -> Outcome {
    match r {
        Ok(()) => Outcome::Done,
        Err(e) => match e.raw_os_error() {
            Some(libc::EAGAIN) => Outcome::Retry,
            Some(libc::EBUSY) => Outcome::Busy,
            _ => Outcome::Gone,
        },
    }
}

fn feature_names(bits: u64) -> String {
    let names = [
        (uapi::UFFD_FEATURE_EVENT_REMAP, "EVENT_REMAP"),
        (uapi::UFFD_FEATURE_EVENT_REMOVE, "EVENT_REMOVE"),
        (uapi::UFFD_FEATURE_EVENT_UNMAP, "EVENT_UNMAP"),
        (uapi::UFFD_FEATURE_MOVE, "UFFDIO_MOVE"),
        (uapi::UFFD_FEATURE_THREAD_ID, "THREAD_ID"),
    ];
    let list: Vec<&str> = names.iter().filter(|(b, _)| bits & u64::from(*b) != 0).map(|(_, n)| *n).collect();
    if list.is_empty() {
        "a feature it did not name".into()
    } else {
        list.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_move_ioctl_number_is_the_kernels() {
        // _IOWR(0xAA, 5, struct uffdio_move) with a 40-byte struct, as <linux/userfaultfd.h> gives.
        assert_eq!(UFFDIO_MOVE, 0xC028_AA05);
        // The same formula reproduces a number the uapi crate does carry.
        assert_eq!(ioc_readwrite(uapi::_UFFDIO_COPY, std::mem::size_of::<uapi::uffdio_copy>()), nr::UFFDIO_COPY);
    }

    #[test]
    fn messages_parse_into_events() {
        let mut m = [0u8; 32];
        m[0] = 0x12; // PAGEFAULT
        m[8..16].copy_from_slice(&1u64.to_ne_bytes());
        m[16..24].copy_from_slice(&0x7f00_1234u64.to_ne_bytes());
        m[24..28].copy_from_slice(&42u32.to_ne_bytes());
        assert_eq!(parse_msg(&m), Event::Fault { addr: 0x7f00_1000, write: true, tid: 42 });
        m[0] = 0x14; // REMAP
        m[24..32].copy_from_slice(&8192u64.to_ne_bytes());
        assert_eq!(parse_msg(&m), Event::Remap { from: 1, to: 0x7f00_1234, len: 8192 });
        m[0] = 0x16; // UNMAP
        assert_eq!(parse_msg(&m), Event::Unmap { start: 1, end: 0x7f00_1234 });
    }
}

#[cfg(test)]
mod kernel {
    use super::*;

    fn map(pages: usize) -> u64 {
        map_with(pages, 0)
    }

    fn map_with(pages: usize, flags: libc::c_int) -> u64 {
        // SAFETY: a fresh private anonymous mapping owned by the test.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                pages * PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | flags,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        p as u64
    }

    /// A userfaultfd of this process after its handshake, or a skip.
    fn ready() -> Option<Uffd> {
        let Ok(uffd) = Uffd::create() else {
            tmem_testkit::skip(tmem_testkit::Feature::Userfaultfd, "no userfaultfd for this user");
            return None;
        };
        uffd.handshake().unwrap();
        Some(uffd)
    }

    #[test]
    fn a_page_moves_out_and_back_and_a_copy_fills_a_hole() {
        let Some(uffd) = ready() else { return };
        let (src, staging) = (map(4), map_with(4, libc::MAP_NORESERVE));
        // SAFETY: src is a 4-page mapping of this test; written before it is
        // registered, since no thread here serves faults.
        unsafe { *(src as *mut u64) = 0xfeed };
        uffd.register(staging, 4 * PAGE as u64).unwrap();
        uffd.register(src, 4 * PAGE as u64).unwrap();
        assert_eq!(Uffd::move_page(uffd.as_fd(), staging, src), Outcome::Done);
        // SAFETY: the staging page now holds the moved page.
        assert_eq!(unsafe { *(staging as *const u64) }, 0xfeed);
        assert_eq!(Uffd::move_page(uffd.as_fd(), src, staging), Outcome::Done);
        // SAFETY: the page is back at src.
        assert_eq!(unsafe { *(src as *const u64) }, 0xfeed);
        let mut page = [0u8; PAGE];
        page[..8].copy_from_slice(&7u64.to_ne_bytes());
        assert_eq!(uffd.copy(src + PAGE as u64, &page), Outcome::Done);
        assert_eq!(uffd.copy(src + PAGE as u64, &page), Outcome::Gone, "a second copy finds the page there");
    }

    /// What `tmem run` works around: on this kernel a page of a mapping
    /// that went through `fork` cannot be moved, even after the child is
    /// gone and the parent wrote it. A fresh mapping's page can.
    #[test]
    fn pages_of_a_forked_mapping_do_not_move() {
        let Some(uffd) = ready() else { return };
        let (src, staging) = (map(1), map(2));
        // SAFETY: src is this test's page.
        unsafe { *(src as *mut u64) = 5 };
        uffd.register(staging, 2 * PAGE as u64).unwrap();
        // SAFETY: the child exits at once, running nothing of the harness.
        let child = unsafe { libc::fork() };
        if child == 0 {
            // SAFETY: see above.
            unsafe { libc::_exit(0) };
        }
        let mut status = 0;
        // SAFETY: reaps the child forked above.
        unsafe { libc::waitpid(child, &raw mut status, 0) };
        // SAFETY: src is this test's page; an atomic add of zero is a write.
        unsafe { &*(src as *const std::sync::atomic::AtomicU64) }.fetch_add(0, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(Uffd::move_page(uffd.as_fd(), staging, src), Outcome::Busy);
        let fresh = map(1);
        // SAFETY: fresh is this test's page.
        unsafe { *(fresh as *mut u64) = 6 };
        assert_eq!(Uffd::move_page(uffd.as_fd(), staging + PAGE as u64, fresh), Outcome::Done);
    }
}
