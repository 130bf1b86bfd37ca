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
//!
//! **Hand-over to a successor process** (`tmem swap restart`). An entry is
//! bound to no process: the kernel keeps its two buffer addresses from
//! `REGISTER`, and takes whatever `COMMIT_AND_FETCH` names the request it
//! holds (`commit_id`) as the entry's next command, copying the answer
//! from those addresses in the committing process. Nor can an entry be
//! given back: an entry that waits free is cancelled when its ring closes,
//! and a request the kernel gives it meanwhile is never answered. Hence:
//! - Each entry's buffers are a slot of a memfd ([`Region`]).
//! - The pause ([`UringWorkers::pause`]) leaves no entry free: the workers
//!   hold the requests they get, and free entries are filled with requests
//!   of our own (`statfs` from a thread on the entry's CPU). Entries of
//!   offline CPUs, which no request reaches, stay free; the successor
//!   registers fresh ones there.
//! - The successor maps each memfd at the predecessor's address and
//!   answers each held request from its slot with its own
//!   `COMMIT_AND_FETCH` ([`UringWorkers::adopt`]): the entries are its own
//!   from then on. A successor that fails before it serves answers nothing,
//!   and the predecessor resumes and answers them itself.
//! - The predecessor's workers then end without answering, and its rings
//!   close with no command in them.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tmem_lock::{Condvar, Mutex, Rank};

use io_uring::{cqueue, opcode, squeue, types, IoUring};

use crate::region::{slot_bytes, Region, PAGE};
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

/// The CPUs listed in `file` of `/sys/devices/system/cpu` ("0-3,8").
fn cpu_list(file: &str) -> io::Result<Vec<usize>> {
    let s = std::fs::read_to_string(format!("/sys/devices/system/cpu/{file}"))?;
    let parse = |x: &str| x.parse::<usize>().map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e));
    let mut cpus = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        cpus.extend(parse(a)?..=parse(b)?);
    }
    Ok(cpus)
}

/// Number of ring queues the kernel expects: one per possible CPU.
pub fn possible_cpus() -> io::Result<usize> {
    Ok(cpu_list("possible")?.into_iter().max().map_or(0, |m| m + 1))
}

/// `struct fuse_uring_cmd_req` in the 80-byte command area.
fn cmd_req(commit_id: u64, qid: u16) -> [u8; 80] {
    let mut c = [0u8; 80];
    c[8..16].copy_from_slice(&commit_id.to_ne_bytes());
    c[16..18].copy_from_slice(&qid.to_ne_bytes());
    c
}

/// A worker's state, as a pause reads it.
mod state {
    /// Its command is with the kernel: the entry is free, or a request is
    /// on its way to it.
    pub const WAITING: u8 = 0;
    /// It answers the request in its entry.
    pub const SERVING: u8 = 1;
    /// Paused with a request in its entry, which it has not answered.
    pub const HELD: u8 = 2;
    /// It has ended (unmounted, or its ring failed).
    pub const ENDED: u8 = 3;
}

/// One worker's entry and state, on a cache line of its own so that
/// workers never share one on the request path.
#[repr(align(128))]
struct Cell {
    state: AtomicU8,
    /// The request its entry holds (`commit_id`), while held.
    commit_id: AtomicU64,
    qid: u16,
    /// Its region, and its slot's offset there.
    region: usize,
    offset: usize,
}

/// What the workers of one mount share. The request path touches only
/// atomics: a worker that has a request sets its cell `SERVING`, then
/// reads `paused` (both `SeqCst`); a pause sets `paused`, then reads every
/// cell. Either the worker sees the pause and holds the request, or the
/// pause sees it serving and waits for it (as `devloop`'s pause).
struct Ctl {
    paused: AtomicBool,
    /// Set once a successor has the held requests: held workers end.
    stop: AtomicBool,
    cells: Box<[Cell]>,
    /// Under [`Rank::UringPark`]; guards nothing but the waits below.
    park: Mutex<()>,
    changed: Condvar,
    /// Requests served.
    served: AtomicU64,
    /// Why a worker ended early, if one did.
    failure: Mutex<Option<String>>,
}

impl Ctl {
    fn fail(&self, why: String) {
        let mut f = self.failure.lock();
        f.get_or_insert(why);
    }

    /// Wakes whoever waits on `changed`; taking the lock first means a
    /// waiter that checked its condition under it cannot miss this.
    fn notify(&self) {
        let _g = self.park.lock();
        self.changed.notify_all();
    }

    /// Waits while paused; false once stopped.
    fn wait_while_paused(&self) -> bool {
        let mut g = self.park.lock();
        while self.paused.load(Ordering::SeqCst) && !self.stop.load(Ordering::SeqCst) {
            self.changed.wait(&mut g);
        }
        !self.stop.load(Ordering::SeqCst)
    }
}

/// One worker: one ring with one entry on queue `qid`, whose buffers are a
/// slot of a [`Region`].
struct Worker {
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
    fd: RawFd,
    index: usize,
    qid: u16,
    /// Keeps the slot mapped.
    _region: Arc<Region>,
    hdr: *mut RingHeader,
    payload: *mut u8,
    payload_len: usize,
    iov: Box<[libc::iovec; 2]>,
}

// SAFETY: `hdr` and `payload` point into `_region`, which the worker keeps
// alive, and no other worker uses its slot.
unsafe impl Send for Worker {}

impl Worker {
    fn new(fd: RawFd, index: usize, cell: &Cell, region: Arc<Region>, payload_bytes: usize) -> io::Result<Self> {
        let ring = IoUring::<squeue::Entry128, cqueue::Entry>::builder().build(2)?;
        let base = region.at(cell.offset, slot_bytes(payload_bytes))?;
        let hdr = base.cast::<RingHeader>();
        // SAFETY: the slot is slot_bytes long (checked by `at`): its header
        // page, then payload_bytes.
        let payload = unsafe { base.add(PAGE) };
        let iov = Box::new([
            libc::iovec { iov_base: hdr.cast(), iov_len: size_of::<RingHeader>() },
            libc::iovec { iov_base: payload.cast(), iov_len: payload_bytes },
        ]);
        Ok(Self { ring, fd, index, qid: cell.qid, _region: region, hdr, payload, payload_len: payload_bytes, iov })
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
        // SAFETY: the SQE points at `self.iov`, whose buffers are this
        // worker's slot, mapped as long as `self._region` lives; the kernel
        // writes them only until it completes the command, which we wait
        // for below before touching them.
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

    /// Registers the entry (or, `adopted`, starts from the request the
    /// entry holds), then serves requests until the connection ends.
    fn run(mut self, fs: &BlockFs, ctl: &Ctl, adopted: bool) {
        let cell = &ctl.cells[self.index];
        let mut res = if adopted {
            Ok(0)
        } else if ctl.wait_while_paused() {
            // A successor's fresh entries register only once it serves: one
            // that fails must leave no entry of its own behind.
            self.roundtrip(CMD_REGISTER, 0)
        } else {
            Err(io::Error::other("stopped"))
        };
        let mut registered = adopted;
        loop {
            match res {
                Ok(0) => registered = true,
                // Unmounted: the kernel ends waiting commands with -ENOTCONN,
                // and refuses commits with it.
                Ok(e) if registered && (-e == libc::ENOTCONN || -e == libc::ECONNABORTED) => break,
                // Registration refused (the kernel then keeps using /dev/fuse),
                // or the ring failed: this worker ends and says why.
                Ok(e) => {
                    ctl.fail(format!("io_uring command failed: {}", io::Error::from_raw_os_error(-e)));
                    break;
                }
                // Stopped before it registered (a successor that failed).
                Err(_) if ctl.stop.load(Ordering::SeqCst) => return,
                Err(e) => {
                    ctl.fail(format!("io_uring: {e}"));
                    break;
                }
            }
            // SAFETY: the kernel is done with the slot until our next
            // command; only this worker makes references into it.
            let (hdr, payload) =
                unsafe { (&mut *self.hdr, std::slice::from_raw_parts_mut(self.payload, self.payload_len)) };
            let commit_id = hdr.ent.commit_id;
            if !take(ctl, cell, commit_id) {
                // Stopped while holding: a successor answers it.
                return;
            }
            ctl.served.fetch_add(1, Ordering::Relaxed);
            let payload_in = (hdr.ent.payload_sz as usize).min(payload.len());
            let unique = u64_at(&hdr.in_out, 8);
            let (error, len) = match dispatch(fs, &hdr.in_out, &hdr.op_in, payload_in, payload) {
                Ok(len) => (0i32, len),
                Err(errno) => (-errno, 0),
            };
            let len32 = u32::try_from(len).unwrap_or(u32::MAX);
            let out = &mut hdr.in_out;
            out[..4].copy_from_slice(&(16 + len32).to_ne_bytes());
            out[4..8].copy_from_slice(&error.to_ne_bytes());
            out[8..16].copy_from_slice(&unique.to_ne_bytes());
            hdr.ent.payload_sz = len32;
            cell.state.store(state::WAITING, Ordering::SeqCst);
            res = self.roundtrip(CMD_COMMIT_AND_FETCH, commit_id);
        }
        cell.state.store(state::ENDED, Ordering::SeqCst);
        ctl.notify();
    }
}

/// A request `commit_id` is in `cell`'s entry: true to serve it now. While
/// paused, holds it until the pause ends (true) or a successor has it (false).
fn take(ctl: &Ctl, cell: &Cell, commit_id: u64) -> bool {
    cell.commit_id.store(commit_id, Ordering::Relaxed);
    cell.state.store(state::SERVING, Ordering::SeqCst);
    if !ctl.paused.load(Ordering::SeqCst) {
        return true;
    }
    cell.state.store(state::HELD, Ordering::SeqCst);
    ctl.notify();
    if !ctl.wait_while_paused() {
        return false;
    }
    cell.state.store(state::SERVING, Ordering::SeqCst);
    true
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

/// What a running mount's ring entries hand to a successor
/// ([`crate::FuseMount::ring_handover`]): where their buffers are, and the
/// request each holds. Their memfds travel beside it, in `regions` order.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct RingHandover {
    pub regions: Vec<RingRegion>,
    /// Each entry's payload buffer, in bytes.
    pub payload_bytes: u64,
    pub held: Vec<HeldEntry>,
    /// Entries that hold nothing, per queue: those of CPUs that are
    /// possible but offline, which no request reaches. The successor
    /// registers as many fresh entries there.
    pub fresh: Vec<FreshEntries>,
    /// Requests the pause asked for to fill free entries (for the log).
    #[serde(default)]
    pub filled: u64,
}

/// A region of entry buffers, mapped at `base` in the predecessor.
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
pub struct RingRegion {
    pub base: u64,
    pub len: u64,
}

/// An entry and the request it holds.
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
pub struct HeldEntry {
    /// Index into [`RingHandover::regions`].
    pub region: u32,
    /// Its slot's offset in the region.
    pub offset: u64,
    pub qid: u16,
    pub commit_id: u64,
}

/// Fresh entries to register on queue `qid`.
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
pub struct FreshEntries {
    pub qid: u16,
    pub count: u32,
}

/// Most regions, held entries and fresh entries a successor takes.
const MAX_HANDED_REGIONS: usize = 64;
const MAX_HANDED_ENTRIES: usize = 1 << 14;

/// A predecessor's ring entries for [`crate::FuseMount::adopt`].
#[derive(Debug)]
pub struct AdoptedRing {
    pub handover: RingHandover,
    /// The regions' memfds, in order.
    pub fds: Vec<OwnedFd>,
}

/// The io_uring workers of one mount.
pub(crate) struct UringWorkers {
    threads: Vec<JoinHandle<()>>,
    ctl: Arc<Ctl>,
    regions: Vec<Arc<Region>>,
    payload_bytes: usize,
    queues: usize,
    /// Fill requests the latest pause issued.
    filled: AtomicU64,
    _fd: Arc<OwnedFd>,
}

impl UringWorkers {
    /// Starts `per_queue` workers for each CPU's queue on the connection of
    /// `fd` (a `/dev/fuse` fd whose INIT has completed with io_uring).
    pub(crate) fn start(fs: Arc<BlockFs>, fd: OwnedFd, per_queue: usize, payload_bytes: usize) -> io::Result<Self> {
        let queues = possible_cpus()?;
        let per_queue = per_queue.max(1);
        let region = Arc::new(Region::new(queues * per_queue * slot_bytes(payload_bytes))?);
        let mut cells = Vec::with_capacity(queues * per_queue);
        for q in 0..queues {
            let qid = u16::try_from(q).map_err(|_| io::Error::other("too many CPUs"))?;
            for _ in 0..per_queue {
                cells.push(cell(state::WAITING, qid, 0, cells.len() * slot_bytes(payload_bytes), 0));
            }
        }
        Self::spawn(fs, fd, cells, vec![region], payload_bytes, queues, false)
    }

    /// Takes a predecessor's entries over ([`RingHandover`]): maps their
    /// buffers where it had them and starts a worker on each, paused, with
    /// the request the entry holds; and workers for fresh entries, which
    /// register once resumed. Requests flow on [`UringWorkers::resume`].
    pub(crate) fn adopt(fs: Arc<BlockFs>, fd: OwnedFd, ring: AdoptedRing) -> io::Result<Self> {
        let AdoptedRing { handover: h, fds } = ring;
        let bad = |what: String| io::Error::other(format!("FUSE ring hand-over: {what}"));
        let fresh: usize = h.fresh.iter().map(|f| f.count as usize).sum();
        if h.regions.len() != fds.len() || h.regions.len() > MAX_HANDED_REGIONS {
            return Err(bad(format!("{} regions with {} descriptors", h.regions.len(), fds.len())));
        }
        if h.held.len() + fresh > MAX_HANDED_ENTRIES || h.held.len() + fresh == 0 {
            return Err(bad(format!("{} held and {fresh} fresh entries", h.held.len())));
        }
        let payload_bytes = usize::try_from(h.payload_bytes).ok().filter(|b| (PAGE..=64 << 20).contains(b));
        let payload_bytes =
            payload_bytes.ok_or_else(|| bad(format!("payload buffers of {} bytes", h.payload_bytes)))?;
        let queues = possible_cpus()?;
        let mut regions = Vec::with_capacity(h.regions.len() + 1);
        for (r, fd) in h.regions.iter().zip(fds) {
            let len = usize::try_from(r.len).map_err(|_| bad(format!("a region of {} bytes", r.len)))?;
            regions.push(Arc::new(Region::adopt(fd, r.base, len)?));
        }
        let mut cells = Vec::with_capacity(h.held.len() + fresh);
        let mut slots = std::collections::HashSet::with_capacity(h.held.len());
        for e in &h.held {
            let region = regions.get(e.region as usize).ok_or_else(|| bad(format!("region {}", e.region)))?;
            if !slots.insert((e.region, e.offset)) {
                return Err(bad(format!("two entries at {} of region {}", e.offset, e.region)));
            }
            if usize::from(e.qid) >= queues {
                return Err(bad(format!("queue {} on a machine of {queues} possible CPUs", e.qid)));
            }
            let offset = usize::try_from(e.offset).map_err(|_| bad(format!("offset {}", e.offset)))?;
            let hdr = region.at(offset, slot_bytes(payload_bytes))?.cast::<RingHeader>();
            // SAFETY: a slot inside the region (checked by `at`); the kernel
            // wrote its request before the predecessor held it, and nothing
            // writes it until a worker answers it.
            let in_slot = unsafe { (*hdr).ent.commit_id };
            if in_slot != e.commit_id {
                return Err(bad(format!("the entry at {offset} holds request {in_slot}, not {}", e.commit_id)));
            }
            cells.push(cell(state::HELD, e.qid, e.region as usize, offset, e.commit_id));
        }
        if fresh > 0 {
            regions.push(Arc::new(Region::new(fresh * slot_bytes(payload_bytes))?));
            let mut at = 0;
            for f in &h.fresh {
                if usize::from(f.qid) >= queues {
                    return Err(bad(format!("queue {} on a machine of {queues} possible CPUs", f.qid)));
                }
                for _ in 0..f.count {
                    cells.push(cell(state::WAITING, f.qid, regions.len() - 1, at * slot_bytes(payload_bytes), 0));
                    at += 1;
                }
            }
        }
        Self::spawn(fs, fd, cells, regions, payload_bytes, queues, true)
    }

    fn spawn(
        fs: Arc<BlockFs>,
        fd: OwnedFd,
        cells: Vec<Cell>,
        regions: Vec<Arc<Region>>,
        payload_bytes: usize,
        queues: usize,
        paused: bool,
    ) -> io::Result<Self> {
        let fd = Arc::new(fd);
        let ctl = Arc::new(Ctl {
            paused: AtomicBool::new(paused),
            stop: AtomicBool::new(false),
            cells: cells.into_boxed_slice(),
            park: Mutex::new(Rank::UringPark, ()),
            changed: Condvar::new(),
            served: AtomicU64::new(0),
            failure: Mutex::new(Rank::UringFailure, None),
        });
        let mut threads = Vec::with_capacity(ctl.cells.len());
        for (index, c) in ctl.cells.iter().enumerate() {
            // A cell that starts held is a predecessor's entry with its request.
            let adopted = c.state.load(Ordering::Relaxed) == state::HELD;
            // Buffers are mapped here, once.
            let worker = Worker::new(fd.as_raw_fd(), index, c, Arc::clone(&regions[c.region]), payload_bytes)?;
            let (fs, ctl) = (Arc::clone(&fs), Arc::clone(&ctl));
            let name = format!("fuse-uring-{}.{index}", c.qid);
            threads.push(std::thread::Builder::new().name(name).spawn(move || worker.run(&fs, &ctl, adopted))?);
        }
        Ok(Self { threads, ctl, regions, payload_bytes, queues, filled: AtomicU64::new(0), _fd: fd })
    }

    pub(crate) fn workers(&self) -> usize {
        self.threads.len()
    }

    pub(crate) fn served(&self) -> u64 {
        self.ctl.served.load(Ordering::Relaxed)
    }

    /// Records why io_uring is not serving this mount.
    pub(crate) fn fail(&self, why: String) {
        self.ctl.fail(why);
    }

    pub(crate) fn failure(&self) -> Option<String> {
        self.ctl.failure.lock().clone()
    }

    /// Stops answering: returns once no worker answers a request and every
    /// entry that a request can reach holds one, which it keeps. A free
    /// entry would be lost to a successor: the kernel can give it a
    /// request at any time, and only its registering process would hear
    /// of it (or, once that has gone, nobody). So the pause fills the free
    /// entries itself: a thread on each CPU with free entries asks for
    /// `statfs` of `mountpoint` (never cached: one request, on that CPU's
    /// queue) until none is free. Those requests are answered with the
    /// rest, by the successor or after [`UringWorkers::resume`]. Entries of
    /// offline CPUs, which no request reaches, stay free.
    pub(crate) fn pause(&self, mountpoint: &Path, within: Duration) -> Result<(), String> {
        let ctl = &self.ctl;
        ctl.paused.store(true, Ordering::SeqCst);
        let online = match cpu_list("online") {
            Ok(cpus) => cpus,
            Err(e) => {
                self.resume();
                return Err(format!("cannot read the online CPUs: {e}"));
            }
        };
        self.filled.store(0, Ordering::Relaxed);
        let deadline = Instant::now() + within;
        let mut last_fill: Vec<Option<Instant>> = vec![None; self.queues];
        // A bound on fills, should requests keep landing elsewhere.
        let most = 8 * ctl.cells.len();
        let mut g = ctl.park.lock();
        loop {
            let mut free = vec![0usize; self.queues];
            let mut serving = 0;
            for c in ctl.cells.iter() {
                match c.state.load(Ordering::SeqCst) {
                    state::WAITING => free[usize::from(c.qid)] += 1,
                    state::SERVING => serving += 1,
                    _ => {}
                }
            }
            let unfilled: Vec<usize> = (0..self.queues).filter(|q| free[*q] > 0 && online.contains(q)).collect();
            if serving == 0 && unfilled.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                drop(g);
                self.resume();
                return Err(format!(
                    "FUSE over io_uring did not pause within {within:?}: {serving} requests still being answered, \
                     free entries on CPUs {unfilled:?}"
                ));
            }
            for q in unfilled {
                // A fill per free entry, then again for those still free a
                // millisecond later (a fill lands in well under that; one
                // that came after another request took its entry waits in
                // the kernel's queue until a commit takes it).
                if last_fill[q].is_some_and(|t| t.elapsed() < Duration::from_millis(1))
                    || self.filled.load(Ordering::Relaxed) >= most as u64
                {
                    continue;
                }
                for _ in 0..free[q] {
                    if let Err(e) = fill(q, mountpoint) {
                        drop(g);
                        self.resume();
                        return Err(format!("cannot start a thread to fill CPU {q}'s ring entries: {e}"));
                    }
                    self.filled.fetch_add(1, Ordering::Relaxed);
                }
                last_fill[q] = Some(Instant::now());
            }
            ctl.changed.wait_for(&mut g, Duration::from_millis(1));
        }
    }

    /// Answers requests again after [`UringWorkers::pause`].
    pub(crate) fn resume(&self) {
        let _g = self.ctl.park.lock();
        self.ctl.paused.store(false, Ordering::SeqCst);
        self.ctl.changed.notify_all();
    }

    /// What a successor needs to take the paused entries over, and the
    /// memfds that go with it.
    pub(crate) fn handover(&self) -> (RingHandover, Vec<BorrowedFd<'_>>) {
        let mut used: Vec<usize> = Vec::new();
        let mut held = Vec::new();
        let mut fresh: Vec<FreshEntries> = Vec::new();
        for c in self.ctl.cells.iter() {
            match c.state.load(Ordering::SeqCst) {
                state::HELD => {
                    let region = used.iter().position(|&r| r == c.region).unwrap_or_else(|| {
                        used.push(c.region);
                        used.len() - 1
                    });
                    held.push(HeldEntry {
                        region: u32::try_from(region).unwrap_or(u32::MAX),
                        offset: c.offset as u64,
                        qid: c.qid,
                        commit_id: c.commit_id.load(Ordering::Relaxed),
                    });
                }
                state::WAITING => match fresh.iter_mut().find(|f| f.qid == c.qid) {
                    Some(f) => f.count += 1,
                    None => fresh.push(FreshEntries { qid: c.qid, count: 1 }),
                },
                _ => {}
            }
        }
        let regions =
            used.iter().map(|&r| RingRegion { base: self.regions[r].base(), len: self.regions[r].len() as u64 });
        let fds = used.iter().map(|&r| self.regions[r].fd()).collect();
        let filled = self.filled.load(Ordering::Relaxed);
        (
            RingHandover { regions: regions.collect(), payload_bytes: self.payload_bytes as u64, held, fresh, filled },
            fds,
        )
    }

    /// After a hand-over: the workers that hold requests end without
    /// answering them (the successor does), and the others are left to
    /// this process's end, which ends their commands.
    pub(crate) fn leave(self) {
        self.ctl.stop.store(true, Ordering::SeqCst);
        self.ctl.notify();
    }

    /// Waits for the workers (they end when the connection does).
    pub(crate) fn join(self) {
        for t in self.threads {
            let _ = t.join();
        }
    }
}

fn cell(state: u8, qid: u16, region: usize, offset: usize, commit_id: u64) -> Cell {
    Cell { state: AtomicU8::new(state), commit_id: AtomicU64::new(commit_id), qid, region, offset }
}

/// Starts a thread on CPU `q` that sends one `statfs` request of
/// `mountpoint` (on `q`'s queue) and ends once it is answered.
fn fill(q: usize, mountpoint: &Path) -> io::Result<()> {
    let path = mountpoint.to_owned();
    std::thread::Builder::new().name(format!("fuse-fill-{q}")).spawn(move || {
        let mut cpus = rustix::thread::CpuSet::new();
        cpus.set(q);
        if rustix::thread::sched_setaffinity(None, &cpus).is_ok() {
            let _ = rustix::fs::statfs(&path);
        }
    })?;
    Ok(())
}
