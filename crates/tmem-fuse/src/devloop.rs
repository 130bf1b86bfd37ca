//! Our own `/dev/fuse` workers, in place of `fuser`'s session loop once
//! `fuser` has mounted and answered INIT.
//!
//! Why by hand: a hand-over to a successor process (`tmem swap restart`)
//! needs the workers to stop taking requests without unmounting, leaving
//! every request they have not read queued in the kernel for the successor,
//! and `fuser`'s workers block in `read` with no way to make them stop
//! short of unmounting. Here each worker has its own clone of the
//! connection (`FUSE_DEV_IOC_CLONE`), opened non-blocking, and waits in
//! `epoll` on it and on a pause pipe; [`DevWorkers::pause`] returns once no
//! worker is between taking a request and answering it, so the store is
//! still and nothing is held. A successor adopts the connection
//! ([`crate::FuseMount::adopt`]) and starts its own workers on it.
//!
//! Every clone shares the connection's one input queue, and the kernel
//! wakes every `poll` waiter on that queue for each request it queues: with
//! `poll`, each request woke all idle workers, and all but one went back to
//! sleep having found nothing (a thundering herd: 7 % of the daemon's CPU
//! per swapped page in docs/PRESSURE.md's A/B). Each worker therefore waits in an epoll set
//! of its own that holds its clone with `EPOLLEXCLUSIVE`, so the kernel
//! wakes one idle worker per request, as a blocking `read` would, while the
//! pause pipe (not exclusive) still wakes them all.
//!
//! A worker that finds the queue empty polls it for a while before it
//! sleeps, if requests have been coming close together. A swap-in waits
//! for its request's wake-up of a sleeping worker, and on a virtual machine
//! whose guest does not halt-poll (`guest_halt_poll_ns` 0) a sleeping vCPU
//! halts, so that wake-up is a trip through the host: `tmem bench fault`
//! measured fuse-ram's random swap-in at 123-387 µs at p50 without the
//! poll and 36-56 µs with it (docs/PRESSURE.md). The poll adapts as the
//! guest kernel's haltpoll governor does ([`PollWindow`]); one worker polls
//! at a time, so an idle daemon never spins, and it yields the CPU at each
//! turn to whatever else is runnable there (the ladder's CPU per swapped
//! page did not grow; a job that faults one page at a time sees the
//! machine busier, with time its vCPUs would have spent halted).
//!
//! Requests are read into one buffer per worker, allocated when it starts:
//! `fuse_in_header`, the operation's header, then its data; the answer is
//! written in place of the data and sent with one `writev`. FORGET,
//! BATCH_FORGET and INTERRUPT get no answer (nothing is cached per inode,
//! and every request completes anyway).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tmem_lock::{Condvar, Mutex, Rank};

use crate::uring::{dispatch, op, u32_at, u64_at};
use crate::{BlockFs, MAX_IO};

/// `FUSE_DEV_IOC_CLONE`: `_IOR(229, 0, uint32_t)`.
const FUSE_DEV_IOC_CLONE: libc::Ioctl = libc::_IOR::<u32>(229, 0);
const FORGET: u32 = 2;
const INTERRUPT: u32 = 36;
const BATCH_FORGET: u32 = 42;
/// `fuse_in_header` and `fuse_out_header`.
const IN_HDR: usize = 40;
const OUT_HDR: usize = 16;
/// The largest operation header we read (`fuse_read_in`, `fuse_write_in`).
const ARG_MAX: usize = 40;
/// Where a request is read into the worker's buffer, and where its data
/// (and the answer) then starts: READ and WRITE, whose headers are
/// `ARG_MAX` bytes, need no copy.
const READ_AT: usize = 0;
const PAYLOAD_AT: usize = READ_AT + IN_HDR + ARG_MAX;

/// Bytes of the operation's own header after `fuse_in_header` (uapi `linux/fuse.h`).
fn arg_len(opcode: u32) -> usize {
    match opcode {
        op::READ | op::WRITE | op::READDIR => 40,
        op::FALLOCATE => 32,
        op::RELEASE | op::RELEASEDIR | op::FLUSH => 24,
        op::GETATTR | op::FSYNC => 16,
        op::OPEN | op::OPENDIR | op::ACCESS => 8,
        _ => 0,
    }
}

/// A clone of the connection `master`, non-blocking, for one worker.
fn clone_fd(master: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    use rustix::fs::{Mode, OFlags};
    let fd = rustix::fs::open("/dev/fuse", OFlags::RDWR | OFlags::NONBLOCK | OFlags::CLOEXEC, Mode::empty())?;
    let mut from = u32::try_from(master.as_raw_fd()).map_err(|_| io::Error::from_raw_os_error(libc::EBADF))?;
    // SAFETY: `fd` is an open /dev/fuse descriptor we own; FUSE_DEV_IOC_CLONE
    // reads one u32 (the descriptor to clone) through the pointer, which
    // points to a live u32 on our stack.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), FUSE_DEV_IOC_CLONE, &raw mut from) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// The first poll, once requests come close together.
const POLL_START: Duration = Duration::from_micros(10);
/// The longest poll (haltpoll's default `guest_halt_poll_ns`); a request
/// that comes later than this after the queue went empty is not "close",
/// and the poll shrinks. A swap-in's round trip is 40-60 µs with the poll
/// on the 2-vCPU VM, so 50 µs was too short to ever catch one (measured:
/// no change from no poll at all).
const POLL_MAX: Duration = Duration::from_micros(200);

/// How long one worker polls an empty queue before it sleeps, adapted
/// after each wait as the guest haltpoll governor adapts its halt-poll
/// (`drivers/cpuidle/governors/haltpoll.c`): a request that came after the
/// poll gave up but within [`POLL_MAX`] doubles it (from [`POLL_START`]);
/// one that came later halves it, to nothing below [`POLL_START`]. A
/// request found while polling leaves it as it is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct PollWindow(Duration);

impl PollWindow {
    /// After a wait of `waited` in all (poll and sleep) that the poll did
    /// not end.
    fn slept(&mut self, waited: Duration) {
        self.0 = if waited <= POLL_MAX {
            (self.0 * 2).clamp(POLL_START, POLL_MAX)
        } else if self.0 / 2 < POLL_START {
            Duration::ZERO
        } else {
            self.0 / 2
        };
    }
}

/// One worker's "between taking a request and answering it" flag, on a
/// cache line of its own so that workers never share one on the hot path.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Busy(AtomicBool);

/// Pause and stop control. The hot path touches only atomics: a worker
/// raises its own [`Busy`] flag, then reads `paused` (both `SeqCst`); a
/// pause sets `paused`, then reads every flag. Either the worker sees the
/// pause and backs off, or the pause sees the worker busy and waits for it
/// (Dekker's handshake). The lock and condition variable are for the slow
/// paths alone: parking while paused, and waking a waiting pause.
#[derive(Debug)]
struct Ctl {
    paused: AtomicBool,
    stop: AtomicBool,
    /// A worker is polling the queue: the others sleep.
    polling: AtomicBool,
    /// Polls of an empty queue, and those that found a request (touched
    /// by the one polling worker only).
    polls: AtomicU64,
    poll_hits: AtomicU64,
    busy: Box<[Busy]>,
    /// Under [`Rank::FuseLoop`]; guards nothing but the waits below.
    park: Mutex<()>,
    changed: Condvar,
    /// Readable while paused or stopping: wakes workers out of `epoll_wait`.
    wake_rx: OwnedFd,
    wake_tx: OwnedFd,
}

impl Ctl {
    fn signal(&self) {
        let _ = rustix::io::write(&self.wake_tx, &[1]);
    }
    fn drain(&self) {
        let mut b = [0u8; 64];
        while matches!(rustix::io::read(&self.wake_rx, &mut b), Ok(n) if n > 0) {}
    }
    fn any_busy(&self) -> bool {
        self.busy.iter().any(|b| b.0.load(Ordering::SeqCst))
    }
    /// Wakes whoever waits on `changed`; taking the lock first means a
    /// waiter that checked its condition under it cannot miss this.
    fn notify(&self) {
        let _g = self.park.lock();
        self.changed.notify_all();
    }
}

/// The workers serving one connection.
pub(crate) struct DevWorkers {
    ctl: Arc<Ctl>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for DevWorkers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevWorkers").field("threads", &self.threads.len()).finish_non_exhaustive()
    }
}

impl DevWorkers {
    /// Starts `n` workers on clones of `master`; `paused`: they take no
    /// request until [`DevWorkers::resume`].
    pub(crate) fn start(fs: Arc<BlockFs>, master: BorrowedFd<'_>, n: usize, paused: bool) -> io::Result<Self> {
        use rustix::pipe::PipeFlags;
        let (wake_rx, wake_tx) = rustix::pipe::pipe_with(PipeFlags::NONBLOCK | PipeFlags::CLOEXEC)?;
        let n = n.max(1);
        let ctl = Arc::new(Ctl {
            paused: AtomicBool::new(paused),
            stop: AtomicBool::new(false),
            polling: AtomicBool::new(false),
            polls: AtomicU64::new(0),
            poll_hits: AtomicU64::new(0),
            busy: (0..n).map(|_| Busy::default()).collect(),
            park: Mutex::new(Rank::FuseLoop, ()),
            changed: Condvar::new(),
            wake_rx,
            wake_tx,
        });
        let mut threads = Vec::with_capacity(n);
        for i in 0..n {
            let worker = Worker::new(i, clone_fd(master)?, &ctl.wake_rx)?;
            let (fs, ctl) = (Arc::clone(&fs), Arc::clone(&ctl));
            let t = std::thread::Builder::new().name(format!("tmem-fuse-{i}")).spawn(move || worker.run(&fs, &ctl))?;
            threads.push(t);
        }
        Ok(Self { ctl, threads })
    }

    /// Stops taking requests; returns once every request taken is answered.
    /// Requests not taken stay queued in the kernel.
    pub(crate) fn pause(&self) {
        let mut g = self.ctl.park.lock();
        self.ctl.paused.store(true, Ordering::SeqCst);
        self.ctl.signal();
        while self.ctl.any_busy() {
            self.ctl.changed.wait(&mut g);
        }
    }

    /// Polls of an empty queue so far, and those that found a request
    /// before the worker would have slept.
    pub(crate) fn polls(&self) -> (u64, u64) {
        (self.ctl.polls.load(Ordering::Relaxed), self.ctl.poll_hits.load(Ordering::Relaxed))
    }

    /// Takes requests again after [`DevWorkers::pause`].
    pub(crate) fn resume(&self) {
        let _g = self.ctl.park.lock();
        self.ctl.paused.store(false, Ordering::SeqCst);
        self.ctl.drain();
        self.ctl.changed.notify_all();
    }

    /// Stops the workers and waits for them (after an unmount, or for good
    /// after a hand-over).
    pub(crate) fn stop(self) {
        self.ctl.stop.store(true, Ordering::SeqCst);
        self.ctl.signal();
        self.ctl.notify();
        for t in self.threads {
            let _ = t.join();
        }
    }
}

struct Worker {
    /// Index of this worker's [`Busy`] flag.
    index: usize,
    fd: OwnedFd,
    /// This worker's epoll set: `fd` (exclusive) and the pause pipe.
    epoll: OwnedFd,
    /// Request in, answer out: header, operation header, data.
    buf: Vec<u8>,
    poll: PollWindow,
}

/// What one read brought.
enum Served {
    /// A request, answered.
    One,
    /// Nothing was queued.
    Nothing,
    /// The connection ended (unmounted or aborted).
    Ended,
}

impl Worker {
    fn new(index: usize, fd: OwnedFd, wake_rx: &OwnedFd) -> io::Result<Self> {
        use rustix::event::epoll::{self, CreateFlags, EventData, EventFlags};
        let epoll = epoll::create(CreateFlags::CLOEXEC)?;
        epoll::add(&epoll, &fd, EventData::new_u64(0), EventFlags::IN | EventFlags::EXCLUSIVE)?;
        epoll::add(&epoll, wake_rx, EventData::new_u64(1), EventFlags::IN)?;
        Ok(Self { index, fd, epoll, buf: vec![0u8; PAYLOAD_AT + MAX_IO as usize], poll: PollWindow::default() })
    }

    /// Reads and answers requests; waits in `epoll` only when none is queued,
    /// so a busy worker makes two system calls per request.
    fn run(mut self, fs: &BlockFs, ctl: &Ctl) {
        let busy = &ctl.busy[self.index].0;
        loop {
            busy.store(true, Ordering::SeqCst);
            if ctl.paused.load(Ordering::SeqCst) || ctl.stop.load(Ordering::SeqCst) {
                busy.store(false, Ordering::SeqCst);
                ctl.notify();
                let mut g = ctl.park.lock();
                while ctl.paused.load(Ordering::SeqCst) && !ctl.stop.load(Ordering::SeqCst) {
                    ctl.changed.wait(&mut g);
                }
                if ctl.stop.load(Ordering::SeqCst) {
                    return;
                }
                continue;
            }
            let served = self.serve_one(fs);
            busy.store(false, Ordering::SeqCst);
            if ctl.paused.load(Ordering::SeqCst) {
                ctl.notify();
            }
            match served {
                Served::One => {}
                Served::Ended => return,
                Served::Nothing => self.wait(ctl),
            }
        }
    }

    /// Waits for a request, a pause or a stop: polls first when its window
    /// is open and no other worker polls, then sleeps in `epoll`.
    fn wait(&mut self, ctl: &Ctl) {
        use rustix::event::epoll;
        let mut events = [epoll::Event { flags: epoll::EventFlags::empty(), data: epoll::EventData::new_u64(0) }; 2];
        let start = Instant::now();
        if self.poll.0 > Duration::ZERO
            && ctl.polling.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok()
        {
            let zero = rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 };
            let found = loop {
                if matches!(epoll::wait(&self.epoll, &mut events[..], Some(&zero)), Ok(n) if n > 0) {
                    break true;
                }
                if start.elapsed() >= self.poll.0 {
                    break false;
                }
                // Whatever else is runnable on this CPU goes first.
                rustix::thread::sched_yield();
            };
            ctl.polling.store(false, Ordering::Release);
            ctl.polls.fetch_add(1, Ordering::Relaxed);
            if found {
                ctl.poll_hits.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
        let _ = epoll::wait(&self.epoll, &mut events[..], None);
        self.poll.slept(start.elapsed());
    }

    /// Reads one request, if one is queued, and answers it.
    fn serve_one(&mut self, fs: &BlockFs) -> Served {
        let n = match rustix::io::read(&self.fd, &mut self.buf[READ_AT..]) {
            Ok(n) => n,
            Err(rustix::io::Errno::AGAIN) => return Served::Nothing,
            Err(rustix::io::Errno::INTR | rustix::io::Errno::NOENT) => return Served::One,
            Err(_) => return Served::Ended,
        };
        if n < IN_HDR {
            return Served::One;
        }
        let mut hdr = [0u8; IN_HDR];
        hdr.copy_from_slice(&self.buf[READ_AT..READ_AT + IN_HDR]);
        let (opcode, unique) = (u32_at(&hdr, 4), u64_at(&hdr, 8));
        if matches!(opcode, FORGET | BATCH_FORGET | INTERRUPT) {
            return Served::One;
        }
        let alen = arg_len(opcode).min(n - IN_HDR);
        let mut arg = [0u8; ARG_MAX];
        let arg_at = READ_AT + IN_HDR;
        arg[..alen].copy_from_slice(&self.buf[arg_at..arg_at + alen]);
        let data_len = n - IN_HDR - alen;
        if alen != ARG_MAX {
            // Only READ and WRITE land their data at PAYLOAD_AT as read.
            self.buf.copy_within(arg_at + alen..arg_at + alen + data_len, PAYLOAD_AT);
        }
        let payload = &mut self.buf[PAYLOAD_AT..];
        let (error, len) = match dispatch(fs, &hdr, &arg[..alen], data_len, payload) {
            Ok(len) => (0i32, len),
            Err(errno) => (-errno, 0),
        };
        let mut out = [0u8; OUT_HDR];
        let total = u32::try_from(OUT_HDR + len).unwrap_or(u32::MAX);
        out[..4].copy_from_slice(&total.to_ne_bytes());
        out[4..8].copy_from_slice(&error.to_ne_bytes());
        out[8..16].copy_from_slice(&unique.to_ne_bytes());
        let iov = [io::IoSlice::new(&out), io::IoSlice::new(&payload[..len])];
        match rustix::io::writev(&self.fd, &iov) {
            // ENOENT: the request was interrupted and is gone; nothing to do.
            Ok(_) | Err(rustix::io::Errno::NOENT) => Served::One,
            Err(_) => Served::Ended,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_poll_window_grows_on_close_requests_and_shrinks_to_nothing_on_far_ones() {
        let us = Duration::from_micros;
        let mut w = PollWindow::default();
        w.slept(us(30));
        assert_eq!(w, PollWindow(POLL_START), "a close request opens the window");
        w.slept(us(30));
        w.slept(us(30));
        assert_eq!(w, PollWindow(us(40)));
        for _ in 0..3 {
            w.slept(POLL_MAX);
        }
        assert_eq!(w, PollWindow(POLL_MAX), "never past the most");
        w.slept(POLL_MAX + us(1));
        assert_eq!(w, PollWindow(POLL_MAX / 2), "a far request halves it");
        for _ in 0..3 {
            w.slept(Duration::from_secs(1));
        }
        assert_eq!(w, PollWindow(POLL_MAX / 16));
        w.slept(Duration::from_secs(1));
        assert_eq!(w, PollWindow(Duration::ZERO), "below the first poll: closed");
    }
}
