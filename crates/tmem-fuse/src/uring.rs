//! FUSE over io_uring (Linux 6.14+, `fuse.enable_uring=1`).
//!
//! With `/dev/fuse`, each request costs the daemon a `read` and a `writev`
//! and lands on whichever worker is free. Over io_uring, the kernel keeps one
//! queue per CPU: a request goes to the queue of the CPU that issued it, is
//! copied straight into a buffer the worker registered, and the worker's
//! answer and its fetch of the next request are one `COMMIT_AND_FETCH`
//! command.
//!
//! Measured on the 2-vCPU test machine (50% rung of the pressure workload,
//! see docs/PRESSURE.md): not faster than `/dev/fuse` (29.3-32.6 s against
//! 28.0-31.4 s, alternating runs); an experimental build that pinned each
//! worker to its queue's CPU was slower still (29.9-36.2 s), so workers are
//! not pinned. Hence opt-in.
//!
//! The protocol (kernel `fs/fuse/dev_uring.c`, uapi `linux/fuse.h` 7.42):
//! - Each ring entry is two buffers: a 288-byte header ([`RingHeader`]) and a
//!   payload of at least the connection's largest request.
//! - `REGISTER` (sqe `addr` = the two iovecs, `len` = 2) hands an entry to
//!   queue `qid`. Once every queue has an entry, the kernel routes all
//!   requests but FORGET and INTERRUPT through the ring; those two still
//!   arrive on `/dev/fuse`, where the `/dev/fuse` workers (`devloop`) keep
//!   serving them.
//! - A request arrives as a completion: `fuse_in_header` in `in_out`, the
//!   operation's own header in `op_in`, any further arguments in the payload.
//! - The answer: `fuse_out_header` in `in_out`, all output arguments back to
//!   back in the payload and their size in `ring_ent.payload_sz`, then
//!   `COMMIT_AND_FETCH` with the request's `commit_id`.
//! - At unmount the kernel ends every waiting command with `-ENOTCONN`.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use std::thread::JoinHandle;
use tmem_lock::{Mutex, Rank};

use io_uring::{cqueue, opcode, squeue, types, IoUring};

use crate::{BlockFs, NodeKind, TTL};

/// The kernel's switch for FUSE over io_uring (off by default).
const ENABLE_URING: &str = "/sys/module/fuse/parameters/enable_uring";

/// Turns the kernel's switch on if it is off. Returns the value to put back
/// after INIT (`Some(false)`), or `None` when it was on already.
pub(crate) fn allow_in_kernel() -> Result<Option<bool>, String> {
    let now = std::fs::read_to_string(ENABLE_URING)
        .map_err(|e| format!("this kernel has no FUSE over io_uring ({ENABLE_URING}: {e}; needs Linux 6.14+)"))?;
    if now.trim() == "Y" {
        return Ok(None);
    }
    std::fs::write(ENABLE_URING, "Y").map_err(|e| format!("cannot turn on {ENABLE_URING}: {e}"))?;
    Ok(Some(false))
}

/// Puts the kernel's switch back (connections that negotiated io_uring keep it).
pub(crate) fn restore_kernel_switch(on: bool) {
    let _ = std::fs::write(ENABLE_URING, if on { "Y" } else { "N" });
}

const CMD_REGISTER: u32 = 1;
const CMD_COMMIT_AND_FETCH: u32 = 2;

/// Operation codes we serve (uapi `enum fuse_opcode`).
pub(crate) mod op {
    pub const LOOKUP: u32 = 1;
    pub const GETATTR: u32 = 3;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const WRITE: u32 = 16;
    pub const STATFS: u32 = 17;
    pub const RELEASE: u32 = 18;
    pub const FSYNC: u32 = 20;
    pub const FLUSH: u32 = 25;
    pub const OPENDIR: u32 = 27;
    pub const READDIR: u32 = 28;
    pub const RELEASEDIR: u32 = 29;
    pub const ACCESS: u32 = 34;
    pub const DESTROY: u32 = 38;
    pub const FALLOCATE: u32 = 43;
}

/// `struct fuse_uring_req_header` (uapi `linux/fuse.h` 7.42): request/answer
/// header, operation header, and the entry's `fuse_uring_ent_in_out`.
///
/// Written by hand: no maintained crate exposes the FUSE-over-io_uring UAPI
/// structs (checked: io-uring 0.7, libc 0.2.191, linux-raw-sys 0.12.1 whose
/// `fuse` module stops before them, fuser 0.18). The layout is asserted
/// below at compile time; the two headers whose contents depend on the
/// operation stay byte arrays, read with the `fuse_in_header` offsets.
#[repr(C, align(64))]
struct RingHeader {
    in_out: [u8; 128],
    op_in: [u8; 128],
    ent: EntInOut,
}

/// `struct fuse_uring_ent_in_out`.
#[repr(C)]
struct EntInOut {
    flags: u64,
    /// Which entry an answer commits (set by the kernel, echoed back).
    commit_id: u64,
    /// Bytes of payload: the request's, then the answer's.
    payload_sz: u32,
    padding: u32,
    reserved: u64,
}

// The kernel's layout: in_out at 0, op_in at 128, ring_ent_in_out at 256
// (288 bytes; ours is padded to 320 by the alignment, which the kernel allows).
const _: () = assert!(std::mem::offset_of!(RingHeader, op_in) == 128);
const _: () = assert!(std::mem::offset_of!(RingHeader, ent) == 256);
const _: () = assert!(std::mem::size_of::<EntInOut>() == 32);
const _: () = assert!(std::mem::offset_of!(EntInOut, commit_id) == 8);
const _: () = assert!(std::mem::offset_of!(EntInOut, payload_sz) == 16);

pub(crate) fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_ne_bytes(a)
}

pub(crate) fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_ne_bytes(a)
}

/// Little writer for reply structs.
struct Out<'a> {
    buf: &'a mut [u8],
    len: usize,
}

impl<'a> Out<'a> {
    fn new(buf: &'a mut [u8]) -> Self {
        Self { buf, len: 0 }
    }
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.buf[self.len..self.len + b.len()].copy_from_slice(b);
        self.len += b.len();
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.bytes(&v.to_ne_bytes())
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes(&v.to_ne_bytes())
    }
    fn zeros(&mut self, n: usize) -> &mut Self {
        self.buf[self.len..self.len + n].fill(0);
        self.len += n;
        self
    }
}

/// `struct fuse_attr` (88 bytes).
fn put_attr(o: &mut Out<'_>, fs: &BlockFs, ino: u64, kind: &NodeKind) {
    let t = fs.started.duration_since(std::time::SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (size, perm, nlink) = kind.size_perm_nlink();
    let mode = u32::from(perm) | if matches!(kind, NodeKind::Dir) { libc::S_IFDIR } else { libc::S_IFREG };
    o.u64(ino).u64(size).u64(size / 512).u64(t).u64(t).u64(t);
    o.u32(0).u32(0).u32(0).u32(mode).u32(nlink).u32(fs.uid).u32(fs.gid).u32(0).u32(4096).u32(0);
}

/// Serves one request: `in_hdr` is its `fuse_in_header`, `arg` the
/// operation's own header, `payload[..payload_in]` the rest of it (a name,
/// written data); the answer is written to `payload`. Returns the answer's
/// length, or an errno. Shared by the ring and the `/dev/fuse` loop.
pub(crate) fn dispatch(
    fs: &BlockFs,
    in_hdr: &[u8],
    arg: &[u8],
    payload_in: usize,
    payload: &mut [u8],
) -> Result<usize, i32> {
    let opcode = u32_at(in_hdr, 4);
    let nodeid = u64_at(in_hdr, 16);
    let ttl = TTL.as_secs();
    match opcode {
        op::READ => {
            let (offset, size) = (u64_at(arg, 8), u32_at(arg, 16));
            let e = fs.export(nodeid).ok_or(libc::ENOENT)?;
            let len = fs.read_len(e, offset, size).min(payload.len());
            e.device.read_at(&mut payload[..len], offset).map_err(|err| err.errno())?;
            Ok(len)
        }
        op::WRITE => {
            let (offset, size) = (u64_at(arg, 8), u32_at(arg, 16) as usize);
            let e = fs.export(nodeid).ok_or(libc::ENOENT)?;
            if size > payload_in {
                return Err(libc::EINVAL);
            }
            e.device.write_at(&payload[..size], offset).map_err(|err| err.errno())?;
            let written = u32::try_from(size).map_err(|_| libc::EINVAL)?;
            Ok(Out::new(payload).u32(written).u32(0).len)
        }
        op::FALLOCATE => {
            let (offset, length, mode) = (u64_at(arg, 8), u64_at(arg, 16), u32_at(arg, 24));
            let mode = i32::try_from(mode).map_err(|_| libc::EOPNOTSUPP)?;
            fs.fallocate(nodeid, offset, length, mode).map(|()| 0)
        }
        op::FLUSH | op::FSYNC => fs.flush(nodeid).map(|()| 0),
        op::GETATTR => {
            let kind = fs.node(nodeid).ok_or(libc::ENOENT)?;
            let mut o = Out::new(payload);
            o.u64(ttl).u32(0).u32(0);
            put_attr(&mut o, fs, nodeid, &kind);
            Ok(o.len)
        }
        op::LOOKUP => {
            let name = payload[..payload_in].split(|&b| b == 0).next().unwrap_or_default();
            let ino = fs.lookup_ino(nodeid, name).ok_or(libc::ENOENT)?;
            let kind = fs.node(ino).ok_or(libc::ENOENT)?;
            let mut o = Out::new(payload);
            o.u64(ino).u64(0).u64(ttl).u64(ttl).u32(0).u32(0);
            put_attr(&mut o, fs, ino, &kind);
            Ok(o.len)
        }
        op::OPEN => {
            let flags = fs.open_flags(nodeid)?;
            Ok(Out::new(payload).u64(0).u32(flags).u32(0).len)
        }
        op::OPENDIR => {
            if nodeid != crate::ROOT {
                return Err(libc::ENOTDIR);
            }
            Ok(Out::new(payload).u64(0).u32(0).u32(0).len)
        }
        op::READDIR => {
            if nodeid != crate::ROOT {
                return Err(libc::ENOTDIR);
            }
            let (offset, size) = (u64_at(arg, 8), u32_at(arg, 16) as usize);
            let mut o = Out::new(payload);
            for (i, (ino, kind, name)) in fs.entries().enumerate().skip(usize::try_from(offset).unwrap_or(usize::MAX)) {
                // struct fuse_dirent, padded to 8 bytes.
                let rec = (24 + name.len()).next_multiple_of(8);
                if o.len + rec > size.min(o.buf.len()) {
                    break;
                }
                let dtype = if matches!(kind, NodeKind::Dir) { libc::DT_DIR } else { libc::DT_REG };
                let namelen = u32::try_from(name.len()).map_err(|_| libc::ENAMETOOLONG)?;
                o.u64(ino).u64(i as u64 + 1).u32(namelen).u32(u32::from(dtype)).bytes(name.as_bytes());
                o.zeros(rec - 24 - name.len());
            }
            Ok(o.len)
        }
        op::STATFS => {
            let blocks = fs.total_blocks();
            let files = u64::try_from(fs.exports.len()).unwrap_or(0);
            let mut o = Out::new(payload);
            o.u64(blocks).u64(0).u64(0).u64(files).u64(0).u32(4096).u32(255).u32(4096).u32(0).zeros(24);
            Ok(o.len)
        }
        op::RELEASE | op::RELEASEDIR | op::ACCESS | op::DESTROY => Ok(0),
        _ => Err(libc::ENOSYS),
    }
}

/// Number of ring queues the kernel expects: one per possible CPU.
pub fn possible_cpus() -> io::Result<usize> {
    let s = std::fs::read_to_string("/sys/devices/system/cpu/possible")?;
    let mut n = 0;
    for part in s.trim().split(',') {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let parse = |x: &str| x.parse::<usize>().map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e));
        n = n.max(parse(b)? + 1);
        let _ = parse(a)?;
    }
    Ok(n)
}

/// `struct fuse_uring_cmd_req` in the 80-byte command area.
fn cmd_req(commit_id: u64, qid: u16) -> [u8; 80] {
    let mut c = [0u8; 80];
    c[8..16].copy_from_slice(&commit_id.to_ne_bytes());
    c[16..18].copy_from_slice(&qid.to_ne_bytes());
    c
}

/// One worker: one ring with one entry on queue `qid`.
struct Worker {
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
    fd: RawFd,
    qid: u16,
    hdr: Box<RingHeader>,
    payload: Vec<u8>,
    iov: Box<[libc::iovec; 2]>,
}

impl Worker {
    fn new(fd: RawFd, qid: u16, payload_bytes: usize) -> io::Result<Self> {
        let ring = IoUring::<squeue::Entry128, cqueue::Entry>::builder().build(2)?;
        let mut hdr = Box::new(RingHeader {
            in_out: [0; 128],
            op_in: [0; 128],
            ent: EntInOut { flags: 0, commit_id: 0, payload_sz: 0, padding: 0, reserved: 0 },
        });
        let mut payload = vec![0u8; payload_bytes];
        let iov = Box::new([
            libc::iovec { iov_base: std::ptr::from_mut(hdr.as_mut()).cast(), iov_len: size_of::<RingHeader>() },
            libc::iovec { iov_base: payload.as_mut_ptr().cast(), iov_len: payload.len() },
        ]);
        Ok(Self { ring, fd, qid, hdr, payload, iov })
    }

    /// Submits `cmd` and waits for its completion; returns its result.
    fn roundtrip(&mut self, cmd_op: u32, commit_id: u64) -> io::Result<i32> {
        let mut sqe = opcode::UringCmd80::new(types::Fd(self.fd), cmd_op)
            .cmd(cmd_req(commit_id, self.qid))
            .addr(Some(self.iov.as_ptr() as u64))
            .build();
        if cmd_op == CMD_REGISTER {
            set_sqe_len(&mut sqe, 2);
        }
        // SAFETY: the SQE points at `self.iov`, whose buffers `self.hdr` and
        // `self.payload` live as long as the ring (fields of self, never
        // reallocated); the kernel writes them only until it completes the
        // command, which we wait for below before touching them.
        unsafe { self.ring.submission().push(&sqe) }.map_err(|_| io::Error::other("io_uring submission queue full"))?;
        loop {
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return Err(e),
            }
            if let Some(cqe) = self.ring.completion().next() {
                return Ok(cqe.result());
            }
        }
    }

    /// Registers the entry, then serves requests until the connection ends.
    fn run(mut self, fs: &BlockFs, shared: &Shared) {
        let mut res = self.roundtrip(CMD_REGISTER, 0);
        let mut registered = false;
        loop {
            match res {
                Ok(0) => registered = true,
                // Unmounted: the kernel ends waiting commands with -ENOTCONN,
                // and refuses commits with it.
                Ok(e) if registered && (-e == libc::ENOTCONN || -e == libc::ECONNABORTED) => return,
                // Registration refused (the kernel then keeps using /dev/fuse),
                // or the ring failed: this worker ends and says why.
                Ok(e) => return shared.fail(format!("io_uring command failed: {}", io::Error::from_raw_os_error(-e))),
                Err(e) => return shared.fail(format!("io_uring: {e}")),
            }
            shared.served.fetch_add(1, Ordering::Relaxed);
            let commit_id = self.hdr.ent.commit_id;
            let payload_in = self.hdr.ent.payload_sz as usize;
            let unique = u64_at(&self.hdr.in_out, 8);
            let payload_in = payload_in.min(self.payload.len());
            let (error, len) = match dispatch(fs, &self.hdr.in_out, &self.hdr.op_in, payload_in, &mut self.payload) {
                Ok(len) => (0i32, len),
                Err(errno) => (-errno, 0),
            };
            let len32 = u32::try_from(len).unwrap_or(u32::MAX);
            let out = &mut self.hdr.in_out;
            out[..4].copy_from_slice(&(16 + len32).to_ne_bytes());
            out[4..8].copy_from_slice(&error.to_ne_bytes());
            out[8..16].copy_from_slice(&unique.to_ne_bytes());
            self.hdr.ent.payload_sz = len32;
            res = self.roundtrip(CMD_COMMIT_AND_FETCH, commit_id);
        }
    }
}

/// Sets `len` (bytes 24..28 of the SQE), which `UringCmd80` has no setter for.
fn set_sqe_len(sqe: &mut squeue::Entry128, len: u32) {
    // SAFETY: Entry128 is #[repr(C)] over two 64-byte halves, the first a
    // plain `struct io_uring_sqe` (C layout, 128 bytes in all, no padding
    // invariants: every bit pattern is a valid SQE); `len` is the u32 at
    // offset 24 of io_uring_sqe.
    unsafe {
        let bytes = std::ptr::from_mut(sqe).cast::<u8>();
        std::ptr::copy_nonoverlapping(len.to_ne_bytes().as_ptr(), bytes.add(24), 4);
    }
}

/// State the workers of one mount share.
struct Shared {
    /// Requests served.
    served: AtomicU64,
    /// Why a worker ended early, if one did.
    failure: Mutex<Option<String>>,
}

impl Default for Shared {
    fn default() -> Self {
        Self { served: AtomicU64::new(0), failure: Mutex::new(Rank::UringFailure, None) }
    }
}

impl Shared {
    fn fail(&self, why: String) {
        let mut f = self.failure.lock();
        f.get_or_insert(why);
    }
}

/// The io_uring workers of one mount.
pub(crate) struct UringWorkers {
    threads: Vec<JoinHandle<()>>,
    shared: Arc<Shared>,
    _fd: Arc<OwnedFd>,
}

impl UringWorkers {
    /// Starts `per_queue` workers for each CPU's queue on the connection of
    /// `fd` (a `/dev/fuse` fd whose INIT has completed with io_uring).
    pub(crate) fn start(fs: Arc<BlockFs>, fd: OwnedFd, per_queue: usize, payload_bytes: usize) -> io::Result<Self> {
        let queues = possible_cpus()?;
        let fd = Arc::new(fd);
        let shared = Arc::new(Shared::default());
        let mut threads = Vec::new();
        for q in 0..queues {
            let qid = u16::try_from(q).map_err(|_| io::Error::other("too many CPUs"))?;
            for i in 0..per_queue.max(1) {
                let (fs, fd, sh) = (fs.clone(), fd.clone(), shared.clone());
                let t = std::thread::Builder::new().name(format!("fuse-uring-{q}.{i}")).spawn(move || {
                    // Buffers are allocated here, once.
                    match Worker::new(fd.as_raw_fd(), qid, payload_bytes) {
                        Ok(worker) => worker.run(&fs, &sh),
                        Err(e) => sh.fail(format!("cannot set up an io_uring: {e}")),
                    }
                })?;
                threads.push(t);
            }
        }
        Ok(Self { threads, shared, _fd: fd })
    }

    pub(crate) fn workers(&self) -> usize {
        self.threads.len()
    }

    pub(crate) fn served(&self) -> u64 {
        self.shared.served.load(Ordering::Relaxed)
    }

    /// Records why io_uring is not serving this mount.
    pub(crate) fn fail(&self, why: String) {
        self.shared.fail(why);
    }

    pub(crate) fn failure(&self) -> Option<String> {
        self.shared.failure.lock().clone()
    }

    /// Waits for the workers (they end when the connection does).
    pub(crate) fn join(self) {
        for t in self.threads {
            let _ = t.join();
        }
    }
}
