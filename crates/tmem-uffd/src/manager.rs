//! The helper side of `tmem run`: it accepts the agents of the program (and
//! of whatever it `exec`s), registers their anonymous memory, serves their
//! faults from a tmem store, and evicts their coldest pages to keep all of
//! them within one budget.
//!
//! Threads, and what each may wait on:
//! - **acceptor**: one per run; takes each agent's hello, registers the
//!   process's memory, answers ready.
//! - **fault threads**: per process, one to start with, and more as the
//!   program runs more threads, up to the CPUs. One at a time holds the
//!   reader role: it polls the userfaultfd (spinning on it for a while
//!   after a fault), reads what is there, queues the faults and hands the
//!   events to the engine's next holder; then every thread serves the
//!   queued faults, decompressing without the engine's lock. Events are
//!   applied before any fill that comes after their read (`Process::events`
//!   says how): a fault served after a `MADV_DONTNEED` must see zeros. A
//!   fault that would take the process past the budget plus its slack waits
//!   in the queue until eviction makes room. Faults on the staging area
//!   (the helper reading a slot whose page already went back) and faults
//!   of the agent's own thread are served with zeros at once by the
//!   reader, without the engine: eviction may be waiting on them.
//! - **evictor**: one per run; rescans each process's maps (every 20 ms
//!   while they change, backing off to every 320 ms while they do not, or
//!   at once when `statm` shows a slack's worth of pages touched outside
//!   them), and while the resident total is over the budget, has the
//!   agent move a batch of victims out of the process with the most
//!   resident pages (holding that engine, so no fault sees a page half
//!   moved), reads them with one `process_vm_readv`, stores them with the
//!   engine's lock dropped, records them, then asks the agent to empty the
//!   staging area.
//! - **fork thread**: one per process; before a `fork` waits for the batch
//!   in flight, brings every page back and pauses eviction; after it resumes.
//!
//! Lock order (`tmem_lock::Rank`, docs/ARCHITECTURE.md): the process list,
//! then a process's agent channel, its registered ranges, its reader role,
//! its engine, its unapplied events, then the store's own locks; its fault
//! queue is a leaf. The evictor waits on the agent while it holds an
//! engine; that cannot deadlock, because the agent thread runs on a stack
//! the helper never registers, allocates nothing, and the faults it can
//! still take (on a victim the program just dropped) are served without
//! the engine.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::os::fd::OwnedFd;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, ExitStatus};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags};
use tmem_core::{GetOutcome, Key, Pool, PoolConfig, PutOutcome, RecompressConfig, Store, StoreConfig, TierChain};
use tmem_counters::Counters;
use tmem_lock::{Condvar, Mutex, MutexGuard, Rank};

use crate::engine::{Ahead, Backing, Batch, BroughtBack, Engine, FaultPlan, Mem, Pn, Served};
use crate::maps::{self, PageMap, Range, Statm};
use crate::proto::{self, Hello};
use crate::stats::{EngineStats, RunStats};
use crate::sys::{Event, Outcome, Uffd, PAGE};

const P: u64 = PAGE as u64;
/// How often the evictor rescans the processes' maps for new ranges while
/// they change.
const RESCAN: Duration = Duration::from_millis(20);
/// The longest wait between two rescans: each rescan that finds every
/// process's maps as they were doubles the wait, up to this, and one that
/// finds a change (or an unmap or remap read since) starts again at
/// [`RESCAN`]. An idle program's maps do not change, and reading them 50
/// times a second, with a `UFFDIO_REGISTER` per range twice in each, was
/// most of what an idle run cost: for a JVM asleep with 100 MB in
/// `--memory 64M`, 443-456 ms of the helper's CPU in 10 s, against 100-122
/// ms with this back-off (`perf stat -e task-clock`; the rest is mostly
/// the `statm` poll's 500 wake-ups a second). Pages touched in a mapping
/// made meanwhile are still caught by that poll, within a slack.
const MAX_RESCAN: Duration = Duration::from_millis(320);
/// How often the evictor reads each process's anonymous resident count
/// between scans. Pages touched in a mapping made since the last scan are
/// resident but not yet registered: once they are a slack's worth, the
/// evictor scans at once, and until then faults count them against the
/// budget. Without this a program that filled a new mapping faster than
/// 20 ms of scans went 11.5 MiB over a 40 MiB budget (a CI run of
/// `a_python_heap_stays_within_its_memory_and_reads_back_whole`).
const UNSEEN_POLL: Duration = Duration::from_millis(2);
/// How long a fault thread keeps reading its userfaultfd after a fault
/// before it sleeps in `poll`. A thread running through cold memory faults
/// again a few µs after it is served, and waking a sleeping reader costs
/// each such fault a wake-up of another vCPU (`scripts/uffd-floor.c` on the
/// 2-vCPU VM: 48-58 µs a fault sleeping, 14-16 µs spinning).
const SPIN: Duration = Duration::from_micros(50);
/// How far under its budget, in slacks, a run must be for its fault
/// threads to spin outright; nearer, where a fault may soon wait for
/// eviction, the evictor needs the CPU, and they yield it at each turn.
const SPIN_ROOM: u64 = 4;
/// How long a fault thread whose fault waits for room keeps yielding the
/// CPU (to the evictor, which makes the room) before it sleeps until the
/// evictor signals: an eviction batch takes about a millisecond, and a
/// sleeping reader's wake-up costs as much as the fault.
const ROOM_WAIT: Duration = Duration::from_millis(1);
/// How often the writeback worker looks at the pool's fill (as a device's).
const WRITEBACK_PERIOD: Duration = Duration::from_millis(20);
/// How long the program may run before its agent says hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(20);

/// What `tmem run` was asked to do.
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// The most anonymous memory the program may keep resident.
    pub memory_bytes: u64,
    /// The store: codec, dictionary, pool limit. Poorly compressible pages
    /// are kept raw (`Incompressible::StoreRaw`) whatever it says: a page
    /// the store refused would go back to the program, over its budget.
    pub store: StoreConfig,
    /// Tiers below every process's pool (one chain: their keys carry the pool's id).
    pub tiers: Option<TierChain>,
    /// Background recompression of cold pages.
    pub recompress: Option<RecompressConfig>,
    /// Largest read-ahead window, pages (`crate::readahead`; 0: none).
    pub read_ahead: u64,
    /// The agent library to preload.
    pub agent: PathBuf,
    pub program: OsString,
    pub args: Vec<OsString>,
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("--memory {0} bytes is less than 1 MiB: the staging area and the slack alone take that")]
    TooSmall(u64),
    #[error("store: {0}")]
    Store(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("cannot start {program}: {source}")]
    Spawn { program: String, source: std::io::Error },
    #[error("{0}")]
    Refused(String),
    #[error("{program} did not load the tmem agent within {secs} s (it clears LD_PRELOAD, or its loader ignores it): stopped rather than run unmanaged")]
    NoAgent { program: String, secs: u64 },
}

/// What a run came to.
#[derive(Clone, Debug, Default)]
pub struct RunReport {
    pub status: Option<ExitStatus>,
    /// The counters at the end.
    pub stats: RunStats,
    /// The pages the pool held (not its tiers) when it held the most bytes.
    pub peak_pool_pages: u64,
    pub codec: String,
}

/// A run in progress, seen from outside (`tmem stat --runs`, the metrics).
#[derive(Clone)]
pub struct Observer(Arc<Shared>);

impl Observer {
    /// Changes the budget: lower, eviction starts at once; higher, waiting
    /// faults go on (the fault threads look again within 200 ms at most).
    ///
    /// # Errors
    /// Under 1 MiB, as `--memory`.
    pub fn set_memory(&self, bytes: u64) -> Result<(), RunError> {
        if bytes < 1 << 20 {
            return Err(RunError::TooSmall(bytes));
        }
        self.0.limit.store(bytes / P, Ordering::SeqCst);
        self.0.stuck.store(false, Ordering::SeqCst);
        self.0.wake_evictor();
        for p in self.0.procs.lock().iter() {
            signal(&p.room);
        }
        Ok(())
    }

    /// The run's counters now, and its store's.
    #[must_use]
    pub fn snapshot(&self) -> (RunStats, tmem_core::Stats) {
        (self.0.stats(), self.0.store.stats())
    }
}

struct PoolBacking<'a>(&'a Pool);

impl Backing for PoolBacking<'_> {
    fn put(&self, key: u64, page: &[u8; PAGE]) -> bool {
        matches!(self.0.put(Key::new(0, key), page), Ok(PutOutcome::Stored))
    }

    fn get(&self, key: u64, out: &mut [u8; PAGE]) -> bool {
        matches!(self.0.get(Key::new(0, key), out), Ok(GetOutcome::Hit))
    }

    fn get_in_memory(&self, key: u64, out: &mut [u8; PAGE]) -> bool {
        matches!(self.0.get_in_memory(Key::new(0, key), out), Ok(Some(GetOutcome::Hit)))
    }

    fn remove(&self, key: u64) {
        let _ = self.0.flush_page(Key::new(0, key));
    }
}

/// The program's memory: its userfaultfd for fills, its agent for moves
/// (the caller holds the process's agent channel), `process_vm_readv` for
/// the staging slots.
struct Real<'a> {
    p: &'a Process,
}

impl Mem for Real<'_> {
    fn fill(&self, pn: Pn, page: &[u8; PAGE]) -> Outcome {
        self.p.fill(pn, page)
    }

    /// Under the events lock with none unapplied, as a fill: the kernel
    /// refuses the move (EAGAIN) while an unmap's event is unread, but once
    /// it is read the `munmap` returns, and another thread can map the same
    /// address and write a page there without a fault (not registered yet).
    /// A move then, with the unmap not yet applied, would take that page
    /// for the old mapping's, and the unmap would drop it.
    fn move_out(&self, pages: &[Pn], out: &mut [Outcome]) {
        // Held until the agent's reply: no read of the userfaultfd meanwhile.
        let pending = self.p.events.lock();
        if !pending.is_empty() {
            out.fill(Outcome::Retry);
            return;
        }
        out.fill(Outcome::Gone);
        let n = pages.len().min(proto::MAX_EVICT);
        let mut msg = [0u8; 2 + 8 * proto::MAX_EVICT];
        msg[0] = proto::EVICT;
        #[allow(clippy::cast_possible_truncation)]
        let count = n as u8;
        msg[1] = count;
        for (i, pn) in pages[..n].iter().enumerate() {
            msg[2 + 8 * i..10 + 8 * i].copy_from_slice(&(pn * P).to_le_bytes());
        }
        if rustix::net::send(&self.p.sock, &msg[..2 + 8 * n], rustix::net::SendFlags::NOSIGNAL).is_err() {
            return;
        }
        let mut reply = [0u8; 2 + proto::MAX_EVICT];
        // The agent has the request: a reply given up on here would leave
        // its pages moved out while the engine holds them as resident.
        let got = loop {
            match rustix::net::recv(&self.p.sock, &mut reply, rustix::net::RecvFlags::empty()) {
                Ok((got, _)) => break got,
                Err(rustix::io::Errno::INTR) => {}
                Err(_) => return,
            }
        };
        if got < 2 + n || reply[0] != proto::EVICTED {
            return;
        }
        for (o, &code) in out.iter_mut().zip(&reply[2..2 + n]) {
            *o = proto::outcome_of(code);
        }
    }

    fn move_back(&self, slot: u32, pn: Pn) -> Outcome {
        let mut page = [[0u8; PAGE]; 1];
        if read_slots(self.p, &[slot], &mut page).is_err() {
            // The slot is unreadable (the process is ending), not the
            // address gone: the page stays in its slot.
            return Outcome::Busy;
        }
        self.p.fill(pn, &page[0])
    }

    fn wake(&self, pn: Pn) {
        let _ = self.p.uffd.wake(pn * P, P);
    }
}

struct Process {
    pid: u32,
    uffd: Uffd,
    sock: OwnedFd,
    fork: OwnedFd,
    staging: Range,
    slots: u32,
    stack: Range,
    agent_tid: u32,
    pool: Arc<Pool>,
    /// Held by whoever talks to the agent on `sock` (evictor, release).
    chan: Mutex<()>,
    engine: Mutex<Engine>,
    /// The engine's resident count, readable without its lock.
    resident: AtomicU64,
    statm: Statm,
    /// The anonymous pages resident outside the engine's count at the last
    /// scan (the agent's stack, the staging area, unregistrable ranges).
    unseen_base: AtomicU64,
    /// Those resident outside it beyond that base, at the last poll: pages
    /// touched in mappings the evictor has not scanned yet.
    unseen: AtomicU64,
    /// Ranges registered at the last scan.
    registered: Mutex<Vec<Range>>,
    /// An unmap or remap was read since the last scan began. The maps can
    /// then read as they were while a range in them is a new mapping,
    /// never registered (a `munmap` and an `mmap` at the same place), so
    /// the next scan registers every range again.
    maps_moved: AtomicBool,
    pagemap: PageMap,
    /// Written by the evictor when it made room; the fault thread polls it.
    room: OwnedFd,
    gone: AtomicBool,
    /// The reader role, with what it spins on.
    reader: Mutex<Reader>,
    /// Events read and not yet applied to the engine.
    ///
    /// The kernel lets a `munmap`, `mremap` or `madvise` go on as soon as
    /// its event is read; until the event is applied, the engine still holds
    /// what it dropped or moved, and a fill then would put old data where
    /// the program now has zeros. So each read of the userfaultfd pushes its
    /// events here under this lock, and each fill happens under it with
    /// nothing here: a fill either comes before the read (and the program's
    /// own zap after it), or finds the event and has it applied first. An
    /// eviction batch's moves happen under it the same way (`Real::move_out`).
    events: Mutex<Vec<Event>>,
    /// Faults read and not yet served, oldest first.
    faults: Mutex<VecDeque<u64>>,
    /// A fill met EAGAIN with no event to apply: the next read waits 1 ms at most.
    retry: AtomicBool,
    /// Fault threads running; the last one to end finishes the process.
    handlers: AtomicU32,
}

impl Process {
    fn real(&self) -> Real<'_> {
        Real { p: self }
    }

    fn in_staging(&self, addr: u64) -> bool {
        self.staging.start <= addr && addr < self.staging.end
    }

    /// Registers the process's anonymous ranges and adopts the present pages
    /// of those it did not have before.
    ///
    /// The maps read can be stale by the time a range is registered: a
    /// mapping that grew in place meanwhile is split at the old end, and
    /// until its new part is registered too (which merges the two again),
    /// an `mremap` of the whole fails with EFAULT (the agent's `mremap`
    /// retries it). So every range is registered again at once, in a second
    /// pass: registering a registered range changes nothing and costs one
    /// call, and the second pass mends what the first split.
    ///
    /// Unless `force`, maps that read exactly as the last scan left them,
    /// with no unmap or remap read since, are not registered again: every
    /// range in them is registered. The base of unseen pages is taken
    /// again either way. Returns whether the maps were registered again.
    fn rescan(&self, shared: &Shared, force: bool) -> std::io::Result<bool> {
        let mut found = Vec::new();
        // Taken before the maps are read: a page found in a range dropped
        // or moved after this is not adopted (`Engine::adopt_since`).
        let epoch = self.engine_applied(shared).map_epoch();
        let mut registered = self.registered.lock();
        // Taken before the read: an unmap read after it counts for the next scan.
        let moved = self.maps_moved.swap(false, Ordering::SeqCst);
        shared.map_scans.fetch_add(1, Ordering::Relaxed);
        let mut ranges = maps::anonymous_ranges(self.pid, &[self.stack])?;
        let again = force || moved || ranges != *registered;
        let passes = if again { 2 } else { 0 };
        for pass in 0..passes {
            if pass > 0 {
                shared.map_scans.fetch_add(1, Ordering::Relaxed);
                ranges = maps::anonymous_ranges(self.pid, &[self.stack])?;
            }
            for r in &ranges {
                if let Err(e) = self.uffd.register(r.start, r.end - r.start) {
                    // Unmapped meanwhile, or a range the kernel will not register (mlocked, special).
                    tracing::debug!(pid = self.pid, "register {:#x}-{:#x}: {e}", r.start, r.end);
                    continue;
                }
                if registered.contains(r) || (self.in_staging(r.start) && self.in_staging(r.end - 1)) {
                    continue;
                }
                self.pagemap.present(*r, |addr| {
                    if !self.in_staging(addr) {
                        found.push(addr / P);
                    }
                })?;
            }
            *registered = std::mem::take(&mut ranges);
        }
        drop(registered);
        let mut engine = self.engine_applied(shared);
        engine.settle_doomed(Instant::now(), |start, end| {
            let mut present = Vec::new();
            let range = maps::Range { start: start * P, end: end * P };
            self.pagemap.present(range, |addr| present.push(addr / P)).ok().map(|()| present)
        });
        for pn in found {
            engine.adopt_since(epoch, pn);
        }
        shared.sync_resident(self, &engine);
        // Read under the engine's lock, so no fault or eviction moves the
        // count between the two reads.
        let anon = self.statm.anon_pages()?;
        drop(engine);
        self.unseen_base.store(anon.saturating_sub(self.resident.load(Ordering::SeqCst)), Ordering::SeqCst);
        self.unseen.store(0, Ordering::SeqCst);
        Ok(again)
    }

    /// Reads the anonymous pages resident outside the engine's count beyond
    /// the last scan's base into `unseen`.
    fn poll_unseen(&self) -> u64 {
        let Ok(anon) = self.statm.anon_pages() else { return 0 };
        let outside = anon.saturating_sub(self.resident.load(Ordering::SeqCst));
        let now = outside.saturating_sub(self.unseen_base.load(Ordering::SeqCst));
        self.unseen.store(now, Ordering::SeqCst);
        now
    }
}

struct Shared {
    program: String,
    tiers: Option<TierChain>,
    store: Arc<Store>,
    /// The budget in pages (`--memory`, or as set since).
    limit: AtomicU64,
    slack: u64,
    /// Largest read-ahead window, pages.
    read_ahead: u64,
    /// CPUs this run may use: the most fault threads a process gets.
    cpus: usize,
    procs: Mutex<Vec<Arc<Process>>>,
    total: AtomicU64,
    /// The live processes' `unseen` pages summed (written by the evictor
    /// alone): faults count them against the budget.
    unseen: AtomicU64,
    peak: AtomicU64,
    peak_pool: AtomicU64,
    peak_pool_pages: AtomicU64,
    lost: AtomicU64,
    /// `RunStats::room_waits`, `room_wait_us`, `evict_us` and `map_scans`.
    room_waits: AtomicU64,
    room_wait_us: AtomicU64,
    evict_us: AtomicU64,
    map_scans: AtomicU64,
    /// Over the budget with nothing movable (every resident page busy):
    /// faults go on past the slack and the evictor waits for its next scan.
    stuck: AtomicBool,
    /// The program has ended: no process joins any more.
    closing: AtomicBool,
    stop: AtomicBool,
    evict_wanted: Mutex<bool>,
    evict_cv: Condvar,
    done_stats: Mutex<(EngineStats, u64)>,
    hello: Mutex<Option<Result<u32, String>>>,
    hello_cv: Condvar,
}

impl Shared {
    fn limit(&self) -> u64 {
        self.limit.load(Ordering::SeqCst)
    }

    /// The counters now: the ended processes' engines plus the live ones'.
    fn stats(&self) -> RunStats {
        let procs: Vec<Arc<Process>> = self.procs.lock().clone();
        let (mut engine, ended) = *self.done_stats.lock();
        let mut stored = 0;
        for p in procs.iter().filter(|p| !p.gone.load(Ordering::SeqCst)) {
            let e = p.engine.lock();
            engine.add_counters(&e.stats());
            stored += e.stored();
        }
        RunStats {
            pid: std::process::id(),
            program: self.program.clone(),
            engine,
            memory_limit_bytes: self.limit() * P,
            slack_pages: self.slack,
            resident_pages: self.total.load(Ordering::SeqCst),
            resident_peak_pages: self.peak.load(Ordering::SeqCst),
            stored_pages: stored,
            pool_peak_bytes: self.peak_pool.load(Ordering::SeqCst),
            processes: procs.len() as u64,
            fault_threads: procs
                .iter()
                .filter(|p| !p.gone.load(Ordering::SeqCst))
                .map(|p| u64::from(p.handlers.load(Ordering::SeqCst)))
                .sum(),
            processes_ended: ended,
            lost_pages: self.lost.load(Ordering::SeqCst),
            room_waits: self.room_waits.load(Ordering::Relaxed),
            room_wait_us: self.room_wait_us.load(Ordering::Relaxed),
            evict_us: self.evict_us.load(Ordering::Relaxed),
            map_scans: self.map_scans.load(Ordering::Relaxed),
        }
    }

    /// Brings the process's mirror and the total up to date with its engine.
    fn sync_resident(&self, p: &Process, engine: &Engine) {
        let new = engine.resident();
        let old = p.resident.swap(new, Ordering::SeqCst);
        let total = if new >= old {
            self.total.fetch_add(new - old, Ordering::SeqCst) + (new - old)
        } else {
            self.total.fetch_sub(old - new, Ordering::SeqCst) - (old - new)
        };
        self.peak.fetch_max(total, Ordering::SeqCst);
        if total > self.limit() && !self.stuck.load(Ordering::SeqCst) {
            self.wake_evictor();
        }
    }

    fn wake_evictor(&self) {
        let mut wanted = self.evict_wanted.lock();
        if !*wanted {
            *wanted = true;
            self.evict_cv.notify_one();
        }
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

fn eventfd() -> std::io::Result<OwnedFd> {
    Ok(rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK)?)
}

fn signal(fd: &OwnedFd) {
    let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
}

fn drain(fd: &OwnedFd) {
    let mut b = [0u8; 8];
    let _ = rustix::io::read(fd, &mut b);
}

/// Runs `cfg.program` under `tmem run` and returns when it and every managed
/// descendant have ended (or been released).
/// `started` gets a view of the run before the program starts.
pub fn run(cfg: &RunConfig, started: impl FnOnce(Observer) -> std::io::Result<()>) -> Result<RunReport, RunError> {
    if cfg.memory_bytes < 1 << 20 {
        return Err(RunError::TooSmall(cfg.memory_bytes));
    }
    let limit = cfg.memory_bytes / P;
    let slack = (limit / 100).max(256);
    let mut store = cfg.store.clone();
    store.policy.incompressible = tmem_core::Incompressible::StoreRaw;
    let store = store.build().map_err(|e| RunError::Store(e.to_string()))?;
    // Writeback to the tiers, and recompression, run while the store lives.
    let _writeback = cfg.tiers.is_some().then(|| store.start_writeback(WRITEBACK_PERIOD));
    let _recompressor = cfg
        .recompress
        .clone()
        .map(|r| store.recompression(r))
        .transpose()
        .map_err(|e| RunError::Store(e.to_string()))?
        .map(tmem_core::Recompression::spawn);
    let shared = Arc::new(Shared {
        program: cfg.program.to_string_lossy().into_owned(),
        tiers: cfg.tiers.clone(),
        store: Arc::new(store),
        limit: AtomicU64::new(limit),
        slack,
        read_ahead: cfg.read_ahead,
        cpus: std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
        procs: Mutex::new(Rank::RunProcesses, Vec::new()),
        total: AtomicU64::new(0),
        unseen: AtomicU64::new(0),
        peak: AtomicU64::new(0),
        peak_pool: AtomicU64::new(0),
        peak_pool_pages: AtomicU64::new(0),
        lost: AtomicU64::new(0),
        room_waits: AtomicU64::new(0),
        room_wait_us: AtomicU64::new(0),
        evict_us: AtomicU64::new(0),
        map_scans: AtomicU64::new(0),
        stuck: AtomicBool::new(false),
        closing: AtomicBool::new(false),
        stop: AtomicBool::new(false),
        evict_wanted: Mutex::new(Rank::RunEvictWanted, false),
        evict_cv: Condvar::new(),
        done_stats: Mutex::new(Rank::RunDoneStats, (EngineStats::default(), 0)),
        hello: Mutex::new(Rank::RunHello, None),
        hello_cv: Condvar::new(),
    });
    started(Observer(Arc::clone(&shared)))?;
    let dir = tempfile::Builder::new().prefix("tmem-run-").tempdir()?;
    let path = dir.path().join("agent.sock");
    let listener = Arc::new(listen(&path)?);
    let acceptor = {
        let (shared, listener) = (Arc::clone(&shared), Arc::clone(&listener));
        std::thread::Builder::new().name("tmem-run-accept".into()).spawn(move || accept_loop(&shared, &listener))?
    };
    let evictor = {
        let shared = Arc::clone(&shared);
        std::thread::Builder::new().name("tmem-run-evict".into()).spawn(move || evict_loop(&shared))?
    };
    let mut preload = cfg.agent.clone().into_os_string();
    if let Some(old) = std::env::var_os("LD_PRELOAD") {
        preload.push(":");
        preload.push(old);
    }
    let mut cmd = Command::new(&cfg.program);
    cmd.args(&cfg.args).env("LD_PRELOAD", preload).env(proto::ENV_SOCKET, &path);
    // SAFETY: the closure runs in the child between fork and exec and calls
    // only prctl(2), which is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            // Ends the program if tmem dies: its evicted pages die with tmem.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // Transparent huge pages would be split by every 4 KiB move; the
            // setting is inherited across exec.
            if libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let program = cfg.program.to_string_lossy().into_owned();
    // The program decides what a signal means: a terminal's Ctrl-C or
    // Ctrl-\ reaches it directly (the same process group), and tmem, which
    // holds its evicted pages, must outlive it. So tmem takes these signals
    // itself and passes the ones sent to it alone on to the program.
    let mut signals = signal_hook::iterator::Signals::new([libc::SIGINT, libc::SIGQUIT, libc::SIGTERM, libc::SIGHUP])?;
    let mut child = cmd.spawn().map_err(|source| RunError::Spawn { program: program.clone(), source })?;
    let child_pid = child.id();
    let signal_handle = signals.handle();
    let forwarder = std::thread::Builder::new().name("tmem-run-signals".into()).spawn(move || {
        for sig in signals.forever() {
            if matches!(sig, libc::SIGTERM | libc::SIGHUP) {
                // SAFETY: kill(2) of the child this run spawned, not reaped
                // before this thread has stopped (see the wait below).
                unsafe { libc::kill(i32::try_from(child_pid).unwrap_or(i32::MAX), sig) };
            }
        }
    })?;
    // The agent holds the program in its constructor until the helper answers,
    // so a program that never says hello has not run managed code: stop it.
    let first = {
        let mut hello = shared.hello.lock();
        let deadline = Instant::now() + HELLO_TIMEOUT;
        while hello.is_none() && Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                break;
            }
            shared.hello_cv.wait_for(&mut hello, Duration::from_millis(50));
        }
        hello.take()
    };
    let failure = match first {
        Some(Ok(_)) => None,
        Some(Err(why)) => Some(RunError::Refused(why)),
        None if child.try_wait()?.is_some() => None,
        None => Some(RunError::NoAgent { program, secs: HELLO_TIMEOUT.as_secs() }),
    };
    if failure.is_some() {
        // SAFETY: kill(2) of the child this function spawned and has not reaped.
        unsafe { libc::kill(i32::try_from(child_pid).unwrap_or(i32::MAX), libc::SIGKILL) };
    }
    // Wait for the exit without reaping, so that the pid cannot be reused
    // while the forwarder may still signal it; then stop that, then reap.
    let pid = rustix::process::Pid::from_raw(i32::try_from(child_pid).unwrap_or(i32::MAX))
        .expect("a child's pid is positive");
    let exited = rustix::process::WaitIdOptions::EXITED | rustix::process::WaitIdOptions::NOWAIT;
    while let Err(rustix::io::Errno::INTR) = rustix::process::waitid(rustix::process::WaitId::Pid(pid), exited) {}
    signal_handle.close();
    let _ = forwarder.join();
    let status = child.wait()?;
    // No process joins from here on: one that starts now finds no helper
    // and runs unmanaged (the agent says so).
    shared.closing.store(true, Ordering::SeqCst);
    let _ = std::fs::remove_file(&path);
    let _ = rustix::net::shutdown(&*listener, rustix::net::Shutdown::Both);
    let _ = acceptor.join();
    // Descendants that outlive the program get their pages back and are let go.
    let left: Vec<Arc<Process>> = shared.procs.lock().clone();
    for p in left {
        if p.pid != child_pid && std::path::Path::new(&format!("/proc/{}", p.pid)).exists() {
            release(&shared, &p);
        }
    }
    // Each process's fault thread sees its agent's socket close and folds
    // its counters into the totals; wait for them.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !shared.procs.lock().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    shared.stop.store(true, Ordering::SeqCst);
    shared.wake_evictor();
    let _ = evictor.join();
    if let Some(e) = failure {
        return Err(e);
    }
    Ok(RunReport {
        status: Some(status),
        stats: shared.stats(),
        peak_pool_pages: shared.peak_pool_pages.load(Ordering::SeqCst),
        codec: shared.store.codec_name(),
    })
}

fn listen(path: &std::path::Path) -> std::io::Result<OwnedFd> {
    use rustix::net::{bind, listen, socket_with, AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let s = socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)?;
    bind(&s, &SocketAddrUnix::new(path)?)?;
    listen(&s, 64)?;
    Ok(s)
}

fn accept_loop(shared: &Arc<Shared>, listener: &OwnedFd) {
    loop {
        let accepted = rustix::net::accept_with(listener, rustix::net::SocketFlags::CLOEXEC);
        if shared.closing.load(Ordering::SeqCst) {
            return;
        }
        let Ok(sock) = accepted else { continue };
        let outcome = admit(shared, sock);
        let mut hello = shared.hello.lock();
        if hello.is_none() {
            *hello = Some(outcome);
            shared.hello_cv.notify_all();
        }
    }
}

fn refuse(sock: &OwnedFd, why: String) -> Result<u32, String> {
    let mut msg = vec![proto::REFUSED];
    msg.extend_from_slice(why.as_bytes());
    let _ = proto::send_with_fds(sock, &msg, &[]);
    Err(why)
}

/// Takes one agent's hello: registers its process and starts its threads.
fn admit(shared: &Arc<Shared>, sock: OwnedFd) -> Result<u32, String> {
    let mut buf = [0u8; 1024];
    let (n, mut fds) = proto::recv_with_fds(&sock, &mut buf).map_err(|e| e.to_string())?;
    if buf.first() == Some(&proto::REFUSED) {
        return Err(String::from_utf8_lossy(&buf[1..n]).into_owned());
    }
    let hello = match Hello::decode(&buf[..n]) {
        Ok(h) => h,
        Err(e) => return refuse(&sock, e.to_string()),
    };
    if fds.len() != 2 {
        return refuse(&sock, proto::ProtoError::Fds(fds.len()).to_string());
    }
    let peer = rustix::net::sockopt::socket_peercred(&sock).map(|c| c.pid.as_raw_nonzero().get());
    if peer.ok().and_then(|p| u32::try_from(p).ok()) != Some(hello.pid) {
        return refuse(&sock, format!("the hello names pid {} but came from another process", hello.pid));
    }
    let fork = fds.pop().expect("two fds");
    let uffd = Uffd::from_fd(fds.pop().expect("two fds"));
    if let Err(e) = uffd.handshake() {
        return refuse(&sock, e.to_string());
    }
    let pagemap = match PageMap::open(hello.pid) {
        Ok(m) => m,
        Err(e) => return refuse(&sock, format!("/proc/{}/pagemap: {e}", hello.pid)),
    };
    let statm = match Statm::open(hello.pid) {
        Ok(m) => m,
        Err(e) => return refuse(&sock, format!("/proc/{}/statm: {e}", hello.pid)),
    };
    let room = eventfd().map_err(|e| e.to_string())?;
    let p = Arc::new(Process {
        pid: hello.pid,
        uffd,
        sock,
        fork,
        staging: Range { start: hello.staging, end: hello.staging + u64::from(hello.slots) * P },
        slots: hello.slots,
        stack: Range { start: hello.stack.0, end: hello.stack.1 },
        agent_tid: hello.tid,
        pool: match &shared.tiers {
            Some(chain) => shared.store.create_pool_with_tiers(PoolConfig::persistent(), chain.clone()),
            None => shared.store.create_pool(PoolConfig::persistent()),
        },
        chan: Mutex::new(Rank::RunAgentChannel, ()),
        engine: Mutex::new(Rank::RunEngine, Engine::new(hello.slots, shared.read_ahead)),
        resident: AtomicU64::new(0),
        statm,
        unseen_base: AtomicU64::new(0),
        unseen: AtomicU64::new(0),
        registered: Mutex::new(Rank::RunRanges, Vec::new()),
        maps_moved: AtomicBool::new(false),
        pagemap,
        room,
        gone: AtomicBool::new(false),
        reader: Mutex::new(Rank::RunReader, Reader { last_fault: Instant::now(), waiting_since: None }),
        events: Mutex::new(Rank::RunEvents, Vec::with_capacity(64)),
        faults: Mutex::new(Rank::RunFaults, VecDeque::with_capacity(64)),
        retry: AtomicBool::new(false),
        handlers: AtomicU32::new(0),
    });
    if let Err(e) = p.rescan(shared, true) {
        return refuse(&p.sock, format!("registering the memory of pid {}: {e}", p.pid));
    }
    shared.procs.lock().push(Arc::clone(&p));
    p.handlers.store(1, Ordering::SeqCst);
    spawn_handler(shared, &p).map_err(|e| e.to_string())?;
    {
        let (shared, p) = (Arc::clone(shared), Arc::clone(&p));
        std::thread::Builder::new()
            .name(format!("tmem-fork-{}", p.pid))
            .spawn(move || fork_loop(&shared, &p))
            .map_err(|e| e.to_string())?;
    }
    proto::send_byte(&p.sock, proto::READY).map_err(|e| e.to_string())?;
    Ok(p.pid)
}

/// Starts one more fault thread for `p` (the caller counted it in `handlers`).
fn spawn_handler(shared: &Arc<Shared>, p: &Arc<Process>) -> std::io::Result<()> {
    let (theirs, its) = (Arc::clone(shared), Arc::clone(p));
    let spawned =
        std::thread::Builder::new().name(format!("tmem-run-{}", p.pid)).spawn(move || fault_loop(&theirs, &its));
    if let Err(e) = spawned {
        if p.handlers.fetch_sub(1, Ordering::SeqCst) == 1 {
            finish(shared, p);
        }
        return Err(e);
    }
    Ok(())
}

/// Adds fault threads while `p` runs more threads than it has of them, up
/// to the CPUs: each program thread waits on at most one fault, so more
/// would only wait.
fn grow_handlers(shared: &Arc<Shared>, p: &Arc<Process>) {
    // The agent's thread takes no faults the engine serves.
    let want = maps::threads(p.pid).unwrap_or(1).saturating_sub(1).clamp(1, shared.cpus);
    while (p.handlers.load(Ordering::SeqCst) as usize) < want && !p.gone.load(Ordering::SeqCst) {
        // Only while one runs: the last one to end has finished the process.
        if p.handlers.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n > 0).then_some(n + 1)).is_err() {
            return;
        }
        if let Err(e) = spawn_handler(shared, p) {
            tracing::debug!(pid = p.pid, "a fault thread more: {e}");
            return;
        }
    }
}

/// A fault thread of one process. Whichever holds the reader role reads
/// the userfaultfd; then every thread serves the faults queued, so faults
/// of several program threads are decompressed at once.
fn fault_loop(shared: &Arc<Shared>, p: &Arc<Process>) {
    let mut events = [Event::Other(0); 64];
    let mut buf = Box::new([0u8; PAGE]);
    // TMEM_RUN_SPIN_US overrides SPIN, for measuring (docs/PRESSURE.md).
    let spin = std::env::var("TMEM_RUN_SPIN_US").ok().and_then(|v| v.parse().ok()).map_or(SPIN, Duration::from_micros);
    while !p.gone.load(Ordering::SeqCst) {
        if !read_faults(shared, p, &mut events, &mut buf, spin) {
            p.gone.store(true, Ordering::SeqCst);
            break;
        }
        serve_faults(shared, p, &mut buf);
    }
    if p.handlers.fetch_sub(1, Ordering::SeqCst) == 1 {
        finish(shared, p);
    }
}

/// Whether a fault must wait for eviction to make room.
fn over_budget(shared: &Shared) -> bool {
    shared.total.load(Ordering::SeqCst) + shared.unseen.load(Ordering::SeqCst) >= shared.limit() + shared.slack
        && !shared.stuck.load(Ordering::SeqCst)
}

/// What the reader role holds between two reads.
struct Reader {
    /// When it last read a fault.
    last_fault: Instant,
    /// Since when a queued fault has waited for room, if one does.
    waiting_since: Option<Instant>,
}

/// What the reader does before it reads the (non-blocking) userfaultfd again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pause {
    /// Reads at once: faults are queued and may be served.
    None,
    /// Spins once: within [`SPIN`] of a fault, well under the budget.
    Spin,
    /// Yields the CPU once: within [`SPIN`] of a fault near the budget, or
    /// within [`ROOM_WAIT`] of a fault's wait for room.
    Yield,
    /// Sleeps in `poll` (the userfaultfd, the agent's socket, the room
    /// signal) for at most this many milliseconds.
    Sleep(i64),
}

/// The reader's pause: `retry`, a fault must be tried again after the
/// program's map changes; `queued`, faults wait to be served; `over`, the
/// run is past its budget and slack; `room`, it is [`SPIN_ROOM`] slacks
/// under its budget; `spun`, the last fault read is [`SPIN`] old (or the
/// `TMEM_RUN_SPIN_US` that replaces it); `waiting`, how long a queued
/// fault has waited for room.
///
/// Measured (docs/PRESSURE.md, "Yielding instead of sleeping"): spinning
/// outright near the budget cost the python job of `tmem bench pressure`
/// 17 % at 50 % on 2 CPUs, as the evictor lost the CPU; sleeping there cost
/// it a wake-up per fault, 1.3-1.8x the time of yielding.
fn pause(retry: bool, queued: bool, over: bool, room: bool, spun: bool, waiting: Duration) -> Pause {
    match (queued, over) {
        _ if retry => Pause::Sleep(1),
        (true, true) if waiting < ROOM_WAIT => Pause::Yield,
        (true, true) => Pause::Sleep(200),
        (true, false) => Pause::None,
        (false, _) if spun => Pause::Sleep(200),
        (false, _) if room => Pause::Spin,
        (false, _) => Pause::Yield,
    }
}

/// Takes the reader role, waits for the userfaultfd (or spins on it), and
/// reads all that is there: events to `p.events`, faults to `p.faults`.
/// False when the program's agent hung up.
fn read_faults(shared: &Shared, p: &Process, events: &mut [Event; 64], buf: &mut [u8; PAGE], spin: Duration) -> bool {
    let mut reader = p.reader.lock();
    if p.gone.load(Ordering::SeqCst) {
        return true;
    }
    let over = over_budget(shared);
    let queued = !p.faults.lock().is_empty();
    let retry = p.retry.swap(false, Ordering::SeqCst);
    let room = shared.total.load(Ordering::Relaxed) + SPIN_ROOM * shared.slack < shared.limit();
    let waiting = match (queued && over, reader.waiting_since) {
        (false, since) => {
            if let Some(since) = since {
                shared.room_wait_us.fetch_add(micros(since.elapsed()), Ordering::Relaxed);
            }
            reader.waiting_since = None;
            Duration::ZERO
        }
        (true, Some(since)) => since.elapsed(),
        (true, None) => {
            shared.room_waits.fetch_add(1, Ordering::Relaxed);
            reader.waiting_since = Some(Instant::now());
            Duration::ZERO
        }
    };
    match pause(retry, queued, over, room, reader.last_fault.elapsed() >= spin, waiting) {
        Pause::None => {}
        Pause::Spin => std::hint::spin_loop(),
        Pause::Yield => std::thread::yield_now(),
        Pause::Sleep(timeout) => {
            let uffd = p.uffd_fd();
            let mut fds = [
                PollFd::new(&uffd, PollFlags::IN),
                PollFd::new(&p.sock, PollFlags::RDHUP),
                PollFd::new(&p.room, PollFlags::IN),
            ];
            let _ = poll(&mut fds, Some(&rustix::event::Timespec { tv_sec: 0, tv_nsec: timeout * 1_000_000 }));
            if fds[2].revents().contains(PollFlags::IN) {
                drain(&p.room);
            }
            if fds[1].revents().intersects(PollFlags::HUP | PollFlags::RDHUP | PollFlags::ERR) {
                return false;
            }
        }
    }
    loop {
        let mut pending = p.events.lock();
        let n = p.uffd.read_events(events).unwrap_or_default();
        if n == 0 {
            break;
        }
        let mut faults = p.faults.lock();
        for ev in &events[..n] {
            match *ev {
                // The helper reading a staging slot whose page went back:
                // zeros, at once, since the evictor may be waiting on it. The
                // agent's thread touches no registered memory while it moves
                // pages (the evictor holds the events then, so its fault
                // would never be read); any other fault of it is served so.
                Event::Fault { addr, tid, .. } if p.in_staging(addr) || tid == p.agent_tid => {
                    buf.fill(0);
                    let _ = p.uffd.copy(addr, buf);
                }
                Event::Fault { addr, .. } => {
                    reader.last_fault = Instant::now();
                    faults.push_back(addr);
                }
                Event::Other(_) => {}
                event => {
                    if matches!(event, Event::Unmap { .. } | Event::Remap { .. }) {
                        p.maps_moved.store(true, Ordering::SeqCst);
                    }
                    pending.push(event);
                }
            }
        }
    }
    drop(reader);
    // Applied now if the engine is free, so that dropped pages leave the
    // store soon; else by the next to take it (an evictor holding it may be
    // waiting on a fault that only the next read serves: never wait here).
    if let Some(mut engine) = p.engine.try_lock() {
        p.apply_events(shared, &mut engine);
    }
    true
}

/// Serves queued faults while the run is under its budget plus slack.
fn serve_faults(shared: &Shared, p: &Process, buf: &mut [u8; PAGE]) {
    let backing = PoolBacking(&p.pool);
    loop {
        if over_budget(shared) {
            shared.wake_evictor();
            return;
        }
        let Some(addr) = p.faults.lock().pop_front() else { return };
        match serve_fault(shared, p, &backing, addr / P, buf) {
            (Served::Done, window) if window > 0 => read_ahead(shared, p, &backing, addr / P, window, buf),
            (Served::Done | Served::Gone, _) => {}
            (Served::Retry, _) => {
                p.faults.lock().push_front(addr);
                p.retry.store(true, Ordering::SeqCst);
                return;
            }
            (Served::Lost, _) => {
                shared.lost.fetch_add(1, Ordering::SeqCst);
                eprintln!(
                    "tmem run: the store lost the page at {addr:#x} of pid {}; killing it rather than let it read anything else",
                    p.pid
                );
                // SAFETY: kill(2) of a process that this run manages.
                unsafe { libc::kill(i32::try_from(p.pid).unwrap_or(i32::MAX), libc::SIGKILL) };
            }
        }
    }
}

/// Serves one fault at `pn`, reading the store without the engine's lock.
/// Returns how it went and, for a fault served from the store or with
/// zeros, how many pages after it to read ahead
/// (`Engine::read_ahead_window`; else 0).
fn serve_fault(shared: &Shared, p: &Process, backing: &PoolBacking<'_>, pn: Pn, buf: &mut [u8; PAGE]) -> (Served, u64) {
    loop {
        let mut engine = p.engine_applied(shared);
        let plan = engine.plan(pn);
        let mut read = true;
        if let FaultPlan::FromStore(key) = plan {
            drop(engine);
            read = backing.get(key, buf);
            engine = p.engine_applied(shared);
            if engine.plan(pn) != plan {
                continue; // dropped, moved or served meanwhile
            }
        }
        let served = if read { engine.serve_planned(&p.real(), backing, pn, plan, buf) } else { Served::Lost };
        shared.sync_resident(p, &engine);
        let window = match (served, plan) {
            (Served::Done, FaultPlan::FromStore(_) | FaultPlan::Zero) => engine.read_ahead_window(pn),
            _ => 0,
        };
        drop(engine);
        if served == Served::Retry && p.events_pending() {
            continue; // events came: apply them and plan again
        }
        return (served, window);
    }
}

/// After a fault at `pn` served from the store or with zeros, maps the
/// pages of the `window` pages that follow it that a fault would map
/// (`Engine::next_ahead`: stored pages, and zeros where the engine never saw
/// one), while the run has room for them under its budget plus half its
/// slack (the other half stays for faults).
fn read_ahead(shared: &Shared, p: &Process, backing: &PoolBacking<'_>, pn: Pn, window: u64, buf: &mut [u8; PAGE]) {
    let (mut from, end) = (pn + 1, pn + window);
    while from <= end {
        let used = shared.total.load(Ordering::Relaxed) + shared.unseen.load(Ordering::Relaxed);
        if used + 1 >= shared.limit() + shared.slack / 2 {
            return;
        }
        let Some((next, ahead)) = p.engine_applied(shared).next_ahead(from..=end) else { return };
        from = next + 1;
        // A page in a lower tier is left for its fault. (A key that left
        // the store meanwhile left the engine too: the plan check in
        // `serve_ahead` then fails.)
        if let Ahead::Stored(key) = ahead {
            if !backing.get_in_memory(key, buf) {
                continue;
            }
        }
        let mut engine = p.engine_applied(shared);
        let mapped = engine.serve_ahead(&p.real(), backing, next, ahead, buf);
        shared.sync_resident(p, &engine);
        if !mapped {
            return;
        }
    }
}

impl Process {
    /// Applies the events read so far; the caller holds the engine.
    fn apply_events(&self, shared: &Shared, engine: &mut Engine) {
        let events = std::mem::take(&mut *self.events.lock());
        if events.is_empty() {
            return;
        }
        let backing = PoolBacking(&self.pool);
        for event in events {
            match event {
                // The kernel zaps a removed range after its event is read,
                // an unmapped one before.
                Event::Remove { start, end } => {
                    engine.forget_removed(&backing, start / P, end.div_ceil(P), Instant::now());
                }
                Event::Unmap { start, end } => engine.forget(&backing, start / P, end.div_ceil(P)),
                Event::Remap { from, to, len } => engine.remap(&backing, from / P, to / P, len / P),
                Event::Fault { .. } | Event::Other(_) => {}
            }
        }
        shared.sync_resident(self, engine);
    }

    /// The engine, with every event read so far applied.
    fn engine_applied(&self, shared: &Shared) -> MutexGuard<'_, Engine> {
        let mut engine = self.engine.lock();
        self.apply_events(shared, &mut engine);
        engine
    }

    fn events_pending(&self) -> bool {
        !self.events.lock().is_empty()
    }

    /// Maps `page` at `pn`, under the events lock with none unapplied (see
    /// `events`); `Retry` when there are some.
    fn fill(&self, pn: Pn, page: &[u8; PAGE]) -> Outcome {
        let pending = self.events.lock();
        if !pending.is_empty() {
            return Outcome::Retry;
        }
        self.uffd.copy(pn * P, page)
    }

    fn uffd_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        // SAFETY: the descriptor lives as long as `self.uffd`.
        unsafe { std::os::fd::BorrowedFd::borrow_raw(self.uffd.raw()) }
    }
}

/// The process ended: its pages and counters leave the run. The counters
/// are folded in before the process leaves the list, which `run` waits on.
fn finish(shared: &Shared, p: &Arc<Process>) {
    p.gone.store(true, Ordering::SeqCst);
    let engine = p.engine.lock();
    let old = p.resident.swap(0, Ordering::SeqCst);
    shared.total.fetch_sub(old, Ordering::SeqCst);
    let s = engine.stats();
    drop(engine);
    {
        let mut done = shared.done_stats.lock();
        done.0.add_counters(&s);
        done.1 += 1;
    }
    let _ = shared.store.destroy_pool(p.pool.id());
    shared.procs.lock().retain(|q| !Arc::ptr_eq(q, p));
}

/// Brings every page of `p` back into it, pausing eviction; false if one was lost.
fn fill_all(shared: &Shared, p: &Process) -> bool {
    if p.gone.load(Ordering::SeqCst) {
        return false;
    }
    let backing = PoolBacking(&p.pool);
    let mut buf = Box::new([0u8; PAGE]);
    let mut engine = p.engine_applied(shared);
    engine.pause();
    let ok = loop {
        match engine.bring_back(&p.real(), &backing, &mut buf) {
            BroughtBack::Done { lost } => {
                shared.lost.fetch_add(lost, Ordering::SeqCst);
                break lost == 0;
            }
            // The map is changing: once its events are read and applied,
            // pass again over what is away then. Never given up on: the
            // fork must not go on without its pages.
            BroughtBack::Retry if p.gone.load(Ordering::SeqCst) => return false,
            BroughtBack::Retry => {
                drop(engine);
                if !p.events_pending() {
                    std::thread::sleep(Duration::from_micros(100));
                }
                engine = p.engine_applied(shared);
            }
        }
    };
    shared.sync_resident(p, &engine);
    ok
}

fn fork_loop(shared: &Arc<Shared>, p: &Arc<Process>) {
    loop {
        match proto::recv_byte(&p.fork) {
            Ok(Some(proto::FORKING)) => {
                // No batch may be moving pages out while the child's copy of
                // the memory is taken: wait for the one in progress, and
                // `fill_all` pauses eviction until the parent says it forked.
                // Two threads' forks can be prepared at once (glibc runs the
                // prepare handlers unlocked), so the pauses nest, and either
                // thread may read either FILLED: both mean "filled and
                // paused since", which is all a fork needs.
                let _chan = p.chan.lock();
                fill_all(shared, p);
                if proto::send_byte(&p.fork, proto::FILLED).is_err() {
                    return;
                }
            }
            Ok(Some(proto::FORKED)) => p.engine.lock().resume(),
            Ok(Some(_)) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Ok(None) | Err(_) => return,
        }
    }
}

/// Gives a process its pages back and lets it go unmanaged.
fn release(shared: &Shared, p: &Arc<Process>) {
    let _chan = p.chan.lock();
    if fill_all(shared, p) && proto::send_byte(&p.sock, proto::RELEASE).is_ok() {
        let _ = proto::recv_byte(&p.sock);
    }
    p.gone.store(true, Ordering::SeqCst);
}

fn evict_loop(shared: &Arc<Shared>) {
    let mut last_scan = Instant::now() - RESCAN;
    let mut rescan_every = RESCAN;
    let mut procs_seen = 0;
    let mut batch = Batch::default();
    let mut bufs = vec![[0u8; PAGE]; 64];
    while !shared.stop.load(Ordering::SeqCst) {
        let woken = {
            let mut wanted = shared.evict_wanted.lock();
            if !*wanted {
                shared.evict_cv.wait_for(&mut wanted, UNSEEN_POLL);
            }
            std::mem::replace(&mut *wanted, false)
        };
        let procs: Vec<Arc<Process>> = shared.procs.lock().clone();
        let mut first = true;
        loop {
            let unseen_over = poll_unseen(shared, &procs);
            let stuck = shared.stuck.load(Ordering::SeqCst) && (woken || !first);
            // A process that joined maps its libraries and heap as it starts.
            if procs.len() != procs_seen || procs.iter().any(|p| p.maps_moved.load(Ordering::SeqCst)) {
                procs_seen = procs.len();
                rescan_every = RESCAN;
            }
            if last_scan.elapsed() >= rescan_every || unseen_over || stuck {
                let force = unseen_over || stuck;
                let mut changed = force;
                for p in &procs {
                    // A process whose maps cannot be read (it is ending) counts as changed.
                    changed |= p.rescan(shared, force).unwrap_or(true);
                    grow_handlers(shared, p);
                    let mut engine = p.engine.lock();
                    engine.unpin();
                    shared.sync_resident(p, &engine);
                }
                last_scan = Instant::now();
                rescan_every = if changed { RESCAN } else { (rescan_every * 2).min(MAX_RESCAN) };
                // The scan adopted what was unseen: the run's sum is taken again.
                poll_unseen(shared, &procs);
                if unseen_over {
                    // Faults that waited on the unseen pages go on (or wait for eviction).
                    for q in &procs {
                        signal(&q.room);
                    }
                }
            }
            first = false;
            let unseen = shared.unseen.load(Ordering::SeqCst);
            if shared.total.load(Ordering::SeqCst) + unseen <= shared.limit() || shared.stop.load(Ordering::SeqCst) {
                break;
            }
            let Some(p) = procs
                .iter()
                .filter(|p| !p.gone.load(Ordering::SeqCst))
                .max_by_key(|p| p.resident.load(Ordering::SeqCst))
            else {
                break;
            };
            let started = Instant::now();
            let (moved, retry) = evict_batch(shared, p, &mut batch, &mut bufs);
            shared.evict_us.fetch_add(micros(started.elapsed()), Ordering::Relaxed);
            for q in &procs {
                signal(&q.room);
            }
            if moved == 0 && retry > 0 {
                // The program's map is changing: its fault thread reads the
                // event, and the pages can move again a moment later.
                std::thread::sleep(Duration::from_micros(50));
                continue;
            }
            shared.stuck.store(moved == 0, Ordering::SeqCst);
            if moved == 0 {
                break;
            }
        }
        let pool = shared.store.mem_used_total();
        if pool > shared.peak_pool.fetch_max(pool, Ordering::SeqCst) {
            // The pages in the pool itself: those the tiers hold are not in its memory.
            let pages: u64 = procs.iter().map(|p| p.engine.lock().stored()).sum();
            let in_tiers = if shared.tiers.is_some() { shared.store.stats().total.tier_pages } else { 0 };
            shared.peak_pool_pages.store(pages.saturating_sub(in_tiers), Ordering::SeqCst);
        }
    }
}

/// Polls each live process's unseen pages and sums them into the run's;
/// whether one has a slack's worth (the evictor then scans at once).
fn poll_unseen(shared: &Shared, procs: &[Arc<Process>]) -> bool {
    let mut sum = 0;
    let mut over = false;
    for p in procs.iter().filter(|p| !p.gone.load(Ordering::SeqCst)) {
        let unseen = p.poll_unseen();
        sum += unseen;
        over |= unseen >= shared.slack;
    }
    shared.unseen.store(sum, Ordering::SeqCst);
    over
}

/// One batch: move out, read, store, empty the staging area. Returns the
/// pages moved and those to try again (the program's map was changing).
fn evict_batch(shared: &Shared, p: &Process, batch: &mut Batch, bufs: &mut [[u8; PAGE]]) -> (usize, usize) {
    let _chan = p.chan.lock();
    let max = bufs.len().min(p.slots as usize).min(proto::MAX_EVICT);
    let (moved, retry) = {
        let mut engine = p.engine_applied(shared);
        let outcome = batch.move_out(&mut engine, &p.real(), max);
        shared.sync_resident(p, &engine);
        outcome
    };
    if moved == 0 {
        return (0, retry);
    }
    let slots = &batch.slots;
    if read_slots(p, slots, bufs).is_err() {
        // Unreadable (the process is ending): every page goes back where it was.
        for &slot in slots {
            put_back(shared, p, slot);
        }
        return (0, 0);
    }
    let backing = PoolBacking(&p.pool);
    let mut keys = [0u64; proto::MAX_EVICT];
    {
        let mut engine = p.engine.lock();
        for key in &mut keys[..slots.len()] {
            *key = engine.new_key();
        }
    }
    let mut stored = [false; proto::MAX_EVICT];
    for (i, ok) in stored[..slots.len()].iter_mut().enumerate() {
        *ok = backing.put(keys[i], &bufs[i]);
    }
    {
        let mut engine = p.engine.lock();
        for (i, &slot) in slots.iter().enumerate() {
            if stored[i] && !engine.stored_slot(slot, keys[i]) {
                backing.remove(keys[i]);
            }
        }
        shared.sync_resident(p, &engine);
    }
    for (i, &slot) in slots.iter().enumerate() {
        if !stored[i] {
            put_back(shared, p, slot);
        }
    }
    if proto::send_byte(&p.sock, proto::DROP_STAGING).is_ok() {
        let _ = proto::recv_byte(&p.sock);
    }
    (moved, retry)
}

/// Puts the page of a slot whose store was refused back into the program,
/// retrying while the map changes: the staging area is emptied after the
/// batch, so a page left in it would be gone.
fn put_back(shared: &Shared, p: &Process, slot: u32) {
    loop {
        let mut engine = p.engine_applied(shared);
        let outcome = engine.refused_slot(&p.real(), slot);
        shared.sync_resident(p, &engine);
        drop(engine);
        if outcome != Outcome::Retry || p.gone.load(Ordering::SeqCst) {
            return;
        }
        if !p.events_pending() {
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// Reads the staging slots out of the process with one `process_vm_readv`.
fn read_slots(p: &Process, slots: &[u32], bufs: &mut [[u8; PAGE]]) -> std::io::Result<()> {
    let local: Vec<libc::iovec> = bufs
        .iter_mut()
        .take(slots.len())
        .map(|b| libc::iovec { iov_base: b.as_mut_ptr().cast(), iov_len: PAGE })
        .collect();
    let remote: Vec<libc::iovec> = slots
        .iter()
        .map(|&s| libc::iovec { iov_base: (p.staging.start + u64::from(s) * P) as *mut libc::c_void, iov_len: PAGE })
        .collect();
    #[allow(clippy::cast_possible_truncation)]
    let n = slots.len() as libc::c_ulong;
    // SAFETY: the local iovecs cover buffers owned by this thread; the remote
    // ones name the process's staging area, which the kernel checks.
    let rc = unsafe { libc::process_vm_readv(p.pid.cast_signed(), local.as_ptr(), n, remote.as_ptr(), n, 0) };
    #[allow(clippy::cast_sign_loss)]
    if rc < 0 || (rc as usize) < slots.len() * PAGE {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: Duration = Duration::ZERO;

    #[test]
    fn a_reader_spins_well_under_the_budget_and_yields_near_it_then_sleeps() {
        // No fault queued, the last one recent: spin where there is room, else yield.
        assert_eq!(pause(false, false, false, true, false, NOW), Pause::Spin);
        assert_eq!(pause(false, false, false, false, false, NOW), Pause::Yield);
        assert_eq!(pause(false, false, true, false, false, NOW), Pause::Yield);
        // The last fault is SPIN old: sleep until the next.
        assert_eq!(pause(false, false, false, true, true, NOW), Pause::Sleep(200));
        assert_eq!(pause(false, false, false, false, true, NOW), Pause::Sleep(200));
    }

    #[test]
    fn a_fault_waiting_for_room_yields_to_the_evictor_for_a_while_then_sleeps() {
        assert_eq!(pause(false, true, true, false, false, NOW), Pause::Yield);
        assert_eq!(pause(false, true, true, false, true, ROOM_WAIT / 2), Pause::Yield);
        assert_eq!(pause(false, true, true, false, false, ROOM_WAIT), Pause::Sleep(200));
        // Room again: serve at once.
        assert_eq!(pause(false, true, false, false, true, ROOM_WAIT * 2), Pause::None);
        assert_eq!(pause(false, true, false, true, false, NOW), Pause::None);
    }

    #[test]
    fn a_retry_sleeps_a_millisecond_whatever_else_holds() {
        for bits in 0..32u32 {
            let b = |i: u32| bits & (1 << i) != 0;
            let waiting = if b(4) { ROOM_WAIT } else { NOW };
            assert_eq!(pause(true, b(0), b(1), b(2), b(3), waiting), Pause::Sleep(1));
        }
    }
}
