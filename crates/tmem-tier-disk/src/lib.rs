//! The disk tier: a backing file or block device below the compressed pool,
//! like zswap's writeback target or compcache's backing device.
//!
//! ```no_run
//! use tmem_tier::{Tier, TierKey};
//! use tmem_tier_disk::DiskTierConfig;
//! let tier = DiskTierConfig { capacity_bytes: 1 << 30, ..DiskTierConfig::new("/var/tmp/tmem.tier") }.build()?;
//! let key = TierKey { pool: 1, object: 2, index: 3 };
//! let _ = tier.put(key, b"sealed page bytes")?;
//! let mut out = Vec::new();
//! let _ = tier.get(key, &mut out)?;
//! # Ok::<(), tmem_tier::TierError>(())
//! ```
//!
//! # Contents do not outlive the tier
//!
//! The file (or device) is scratch space for one daemon run: swap content
//! must not outlive its daemon. [`DiskTierConfig::build`] treats whatever is
//! in the file as garbage — a regular file is truncated to zero and re-sized
//! (which also frees its blocks), a block device is discarded (best effort) —
//! and dropping the [`DiskTier`] empties a regular file again. Nothing is
//! ever read back from a previous run; there is no on-disk superblock. The
//! one exception is a restart that hands the tier over (below).
//!
//! # Hand-over
//!
//! `tmem swap restart` moves the tier to a successor process.
//! [`Tier::hand_over`] writes the open segment's new pages and waits for
//! every queued segment write and discard (under the writer lock; a write
//! that keeps failing fails the hand-over), then gives a duplicate of the
//! file's descriptor (the same open file: its `O_DIRECT` mode and `flock`
//! travel) and a state: configuration, segment table (state, used and live
//! bytes, generation), free list, open segment and its write offset, the
//! index, and the counters (latency histograms start afresh), versioned,
//! little endian, with a CRC-32 (layout in `handover.rs`). The predecessor
//! is unchanged and goes on serving if the hand-over fails.
//!
//! [`DiskTier::adopt`] checks the checksum and every number against the
//! others and the file (segment size and count against the file's size, the
//! descriptor's type, access and `O_DIRECT` mode against the state; states,
//! used ≥ live bytes, a free list of free segments without repeats, index
//! entries inside their segment's records, not overlapping, summing to each
//! segment's live bytes), reads the open segment back into its buffer, checks
//! the record headers there against the index, and goes on appending to it:
//! [`Capacity`] is the same before and after. Anything wrong is one
//! [`TierError::Config`] naming it. Records of sealed segments are not read
//! back (that would read the whole file); values are authenticated by the
//! caller anyway (below).
//!
//! Ownership: only the owner's drop empties a regular file. A built tier
//! owns its file; an adopted one does not until [`Tier::set_owner`]`(true)`,
//! so a successor that fails leaves the predecessor's values alone, and the
//! predecessor that handed over calls `set_owner(false)` before it exits.
//!
//! # Authentication is the caller's job
//!
//! The tier stores and returns opaque bytes. Values are expected to be sealed
//! ([`tmem_tier::seal::Sealer`]) before they are put; a value altered on disk
//! is returned as it is, and it is [`Sealer::open`](tmem_tier::seal::Sealer::open)
//! in the caller that rejects it.
//!
//! # Design
//!
//! **Layout.** The file is an array of fixed-size *segments* (1 MiB by
//! default, [`DiskTierConfig::segment_bytes`]). A segment is a log of
//! *records* packed back to back with no alignment: a 24-byte header (pool,
//! object, index, length; little endian) followed by the value. Values are
//! sealed compressed pages of 300–4160 bytes, so packing instead of giving each
//! a 4 KiB slot fits 2–3× more; the header costs ~1.5 % of a typical value.
//!
//! **Writes.** Puts append records to the *open segment*, an in-memory
//! page-aligned buffer. A full segment is written with one aligned `pwrite`
//! (the unwritten tail of its last page zeroed); [`DiskTier::flush`] and the end
//! of [`Tier::put_batch`] write the open segment's new pages and keep it open.
//! Until its write completes, a segment's values are served from its buffer,
//! so a value is readable as soon as `put` returns. Three segment buffers are
//! allocated at build time (the open one and two being written), one more for
//! the GC's reads and one for flush copies on first use: five segments of RAM
//! in all (5 MiB by default), recycled, never reallocated.
//!
//! **Index.** `HashMap<TierKey, Loc { segment, offset, len }>` in memory, plus
//! per-segment used and live byte counts. Replacing or removing a value only
//! marks its bytes dead. A sealed segment whose live count reaches zero is
//! freed at once: its range is discarded (`fallocate(PUNCH_HOLE)` on a file,
//! `BLKDISCARD` on a device, best effort), so the file's disk use follows the
//! live data, and it goes back on the free list. An open segment whose live
//! count reaches zero simply starts over at offset 0. The records' headers
//! make each segment self-describing, so the GC needs no per-segment list of
//! keys in memory (which would cost ~32 bytes of RAM per value — the resource
//! this whole system exists to save); the index costs ~40 bytes per value
//! plus the hash table's slack.
//!
//! **Garbage collection.** Greedy, on demand, inside `put`: when a put needs a
//! new segment and only the GC reserve (one segment) is free, the GC reads the
//! sealed segment with the fewest live bytes with one `pread`, re-appends its
//! still-live records (checked against the index) to the open segment — the
//! reserve segment guarantees room for them — and the victim, now dead, is
//! freed. A victim must give back at least max(1/16 segment, two largest
//! records), so one victim always makes room for the put; a put runs at most
//! three GC rounds (bounded work) and is answered [`TierPut::Full`] when no
//! segment qualifies; a put answered `Full` drops any older value under its
//! key (superseded either way). Worst-case *waste*: with live bytes spread
//! evenly, the tier is full at ~15/16 of its segments minus the reserve
//! segment, plus < one record of unused tail per segment (0.4 % at 1 MiB).
//! The price of running that full is write amplification: near the limit each
//! collected segment gives back as little as 1/16 of itself, so up to ~16
//! bytes are copied per byte put; size the file with headroom (at half full,
//! greedy victims are mostly dead). Greedy rather than LFS cost-benefit: swap
//! pages have no stable hot/cold split to exploit, and greedy is simple and
//! bounded.
//!
//! **Reads.** A get looks the key up under the lock. Values of the open
//! segment or a segment being written are copied from memory; otherwise the
//! lock is dropped and the aligned page range covering the value (usually one
//! or two pages) is `pread`. Each segment has a *generation* counter, bumped
//! under the lock whenever the segment is freed (before it is discarded or
//! reused); the reader compares generations before and after its `pread` and
//! retries on a change (the value has moved or gone). After three lost races
//! the read is done under the lock. (The generation is bumped with `SeqCst`
//! before the discard or rewrite is even queued, and those happen in other
//! syscalls, so a read that saw changed bytes sees the new generation.)
//! A batched get sorts its values by place on disk and reads each run of
//! values within a page of one another (up to 256 KiB) with one `pread`:
//! pages written back together are read back together by swap readahead.
//! A single get reads 16 KiB from its value's page into one of 32 spans
//! (512 KiB more RAM, allocated at build), and gets of the values inside a
//! span are copied from it while its segment's generation holds
//! (`around.rs`): the kernel asks for most neighbours one request each.
//!
//! **Locks.** `state` (index, segments, buffers) is held only for memory
//! work: lookups, appends, `memcpy`. All disk *mutations* (segment writes,
//! flushes, discards) run under a separate `writer` lock, outside `state`,
//! in the order they were queued; whoever queues work tries to become the
//! writer and otherwise leaves it to the current one (who re-checks for work
//! after unlocking). The GC is serialised by its own lock, which owns its
//! read buffer. Lock order: docs/ARCHITECTURE.md (`Rank::DiskGc` → `DiskWriter` → `DiskState`).
//!
//! **Why `pread`/`pwrite` and not io_uring.** The callers are synchronous
//! (a FUSE/swap thread waits for its page anyway), the machine has two cores
//! so there is no parallelism for an async engine to exploit, writes are
//! already batched into whole segments (one syscall per MiB) and reads are one
//! syscall per page-in (or per run of a batched get); io_uring would add a dependency, `unsafe` buffer
//! lifetime management and a completion thread for no measurable gain here.
//!
//! **I/O mode.** The file is opened `O_DIRECT` by default so pages are not
//! cached twice (once in the pool, once in the page cache). Where the
//! filesystem refuses it (open or a probe write fails with `EINVAL`), the
//! tier falls back to buffered I/O and reports
//! `Health::Degraded("buffered I/O: O_DIRECT unsupported")`.
//! I/O errors make the tier report [`Health::Down`] until an I/O succeeds
//! again with no segment write outstanding; a segment whose write failed
//! keeps its buffer (its values stay readable) and is retried by the next
//! [`DiskTier::flush`] or buffer shortage.
//!
//! **Counters.** `bytes_written`/`bytes_read` count value bytes;
//! `wire_bytes_out`/`wire_bytes_in` count bytes actually written to and read
//! from the file (page alignment, GC copies and re-written partial pages
//! included). [`DiskTier::disk_stats`] adds segment, GC and discard counters.

use tmem_sys::aligned;
mod around;
mod gc;
mod handover;
mod read;
mod segment;
mod stats;
use tmem_sys::blockio as sys;
mod write;

pub use stats::DiskStats;
use stats::{add, get, Counters};
#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use std::time::Instant;
use tmem_lock::{Mutex, MutexGuard, Rank};

use tmem_tier::{
    check_len, Capacity, Health, LatencyHistogram, Tier, TierError, TierGet, TierHandover, TierKey, TierPut, TierStats,
    MAX_VALUE,
};

use aligned::{AlignedBuf, ALIGN};

/// Default segment size: 1 MiB.
pub const DEFAULT_SEGMENT_BYTES: u32 = 1 << 20;
/// Smallest accepted segment size.
pub const MIN_SEGMENT_BYTES: u32 = 64 << 10;
/// Largest accepted segment size.
pub const MAX_SEGMENT_BYTES: u32 = 256 << 20;
/// Fewest segments a tier may have (the open one, the GC reserve, and room to work).
pub const MIN_SEGMENTS: u64 = 4;
/// Bytes of record header in front of every value on disk.
pub const RECORD_HEADER: u32 = 24;

const NAME: &str = "disk";
const PAGE: u32 = 4096;
#[allow(clippy::cast_possible_truncation)] // 4160, asserted below
const MAX_VALUE_U32: u32 = MAX_VALUE as u32;
const _: () = assert!(MAX_VALUE as u64 == MAX_VALUE_U32 as u64 && PAGE as usize == ALIGN);
const MAX_RECORD: u32 = RECORD_HEADER + MAX_VALUE_U32;
/// Free segments user puts leave for the GC.
const RESERVE_SEGMENTS: usize = 1;
/// GC victims one put may collect.
const MAX_GC_ROUNDS: u32 = 3;
/// Lock-free read attempts before reading under the lock.
const OPTIMISTIC_READS: u32 = 3;
/// Largest single read of a batched get.
const MERGED_READ: u64 = 256 << 10;
/// Segment buffers besides the open one.
const SPARE_BUFFERS: usize = 2;
/// Blocking write drains a put may wait for when out of buffers.
const MAX_BUFFER_WAITS: u32 = 4;

fn us(x: u32) -> usize {
    usize::try_from(x).expect("u32 fits in usize")
}

fn align_up(x: u32) -> u32 {
    x.div_ceil(PAGE) * PAGE
}

fn align_down(x: u32) -> u32 {
    x - x % PAGE
}

fn encode_header(key: TierKey, len: u32) -> [u8; 24] {
    let mut h = [0u8; 24];
    h[..4].copy_from_slice(&key.pool.to_le_bytes());
    h[4..12].copy_from_slice(&key.object.to_le_bytes());
    h[12..20].copy_from_slice(&key.index.to_le_bytes());
    h[20..].copy_from_slice(&len.to_le_bytes());
    h
}

fn decode_header(h: &[u8]) -> (TierKey, u32) {
    let u32_at = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().expect("4 bytes"));
    let u64_at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().expect("8 bytes"));
    (TierKey { pool: u32_at(0), object: u64_at(4), index: u64_at(12) }, u32_at(20))
}

fn valid_segment_bytes(s: u32) -> bool {
    s.is_multiple_of(PAGE) && (MIN_SEGMENT_BYTES..=MAX_SEGMENT_BYTES).contains(&s)
}

fn config_err(reason: impl Into<String>) -> TierError {
    TierError::Config { tier: NAME.into(), reason: reason.into() }
}

fn io_err(source: io::Error) -> TierError {
    TierError::Io { tier: NAME.into(), source }
}

fn default_segment_bytes() -> u32 {
    DEFAULT_SEGMENT_BYTES
}

fn yes() -> bool {
    true
}

/// Configuration of a [`DiskTier`].
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DiskTierConfig {
    /// Backing regular file (created mode 0600 if missing) or block device.
    pub path: PathBuf,
    /// Bytes to use; 0 = the existing file's size or the device's size. A
    /// regular file is set to this length (sparse). Rounded down to whole segments.
    #[serde(default)]
    pub capacity_bytes: u64,
    /// Open with `O_DIRECT` (falling back to buffered I/O where unsupported).
    #[serde(default = "yes")]
    pub direct_io: bool,
    /// Segment size: a multiple of 4096 in
    /// [`MIN_SEGMENT_BYTES`]..=[`MAX_SEGMENT_BYTES`]; default [`DEFAULT_SEGMENT_BYTES`].
    #[serde(default = "default_segment_bytes")]
    pub segment_bytes: u32,
}

impl DiskTierConfig {
    /// Defaults for `path`: size from the file or device, `O_DIRECT`, 1 MiB segments.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self { path: path.into(), capacity_bytes: 0, direct_io: true, segment_bytes: DEFAULT_SEGMENT_BYTES }
    }

    /// Opens (creating a regular file if missing) and empties the backing store.
    pub fn build(&self) -> Result<DiskTier, TierError> {
        DiskTier::open(self)
    }
}

/// Where a value's record is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Loc {
    seg: u32,
    /// Offset of the record (its header) in the segment.
    off: u32,
    /// Value length.
    len: u32,
}

impl Loc {
    fn rec(self) -> u32 {
        RECORD_HEADER + self.len
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SegState {
    /// On the free list.
    Free,
    /// Freed, waiting for its discard; then free.
    Discarding,
    /// The open segment (its bytes are in the open buffer).
    Open,
    /// Full, its buffer queued for (or failed) writing; served from memory.
    Writing,
    /// On disk.
    Sealed,
}

#[derive(Clone, Copy, Debug)]
struct Seg {
    state: SegState,
    /// Bytes of records appended.
    used: u32,
    /// Bytes of live records.
    live: u32,
}

struct Open {
    seg: u32,
    buf: AlignedBuf,
    /// Bytes `[0, flushed)` are on disk.
    flushed: u32,
    /// Changes whenever a segment is opened or an open segment starts over.
    epoch: u64,
}

struct WriteItem {
    seg: u32,
    buf: Arc<AlignedBuf>,
    start: u32,
    end: u32,
}

enum Room {
    Ready,
    NoBuffer,
    NoSegment,
}

/// Everything behind the state lock.
struct State {
    seg_bytes: u32,
    index: HashMap<TierKey, Loc>,
    segs: Vec<Seg>,
    free: Vec<u32>,
    discards: Vec<u32>,
    /// Segments in `Discarding`.
    discarding: usize,
    open: Option<Open>,
    /// Buffers of `Writing` segments.
    inflight: Vec<(u32, Arc<AlignedBuf>)>,
    queue: VecDeque<WriteItem>,
    failed: Vec<WriteItem>,
    spares: Vec<AlignedBuf>,
    epoch: u64,
    /// Record bytes (headers included) of live values.
    live_bytes: u64,
    /// Value bytes of live values.
    value_bytes: u64,
    /// Unused tails of sealed segments.
    waste_bytes: u64,
    /// Spans of sealed segments that single gets read around their values.
    around: around::ReadAround,
}

impl State {
    /// Every segment free.
    fn new(seg_bytes: u32, nsegs: u32) -> Self {
        Self {
            seg_bytes,
            index: HashMap::new(),
            segs: vec![Seg { state: SegState::Free, used: 0, live: 0 }; us(nsegs)],
            // Popped from the end: segment 0 is used first.
            free: (0..nsegs).rev().collect(),
            discards: Vec::new(),
            discarding: 0,
            open: None,
            inflight: Vec::new(),
            queue: VecDeque::new(),
            failed: Vec::new(),
            spares: (0..=SPARE_BUFFERS).map(|_| AlignedBuf::zeroed(us(seg_bytes))).collect(),
            epoch: 0,
            live_bytes: 0,
            value_bytes: 0,
            waste_bytes: 0,
            around: around::ReadAround::new(),
        }
    }
}

/// Owned by the holder of the writer lock.
struct Writer {
    /// Copy of the open segment's dirty pages for a flush.
    flush_buf: Option<AlignedBuf>,
}

/// Owned by the holder of the GC lock.
struct Gc {
    buf: Option<AlignedBuf>,
}

/// A tier on a backing file or block device; see the [crate docs](crate).
pub struct DiskTier {
    file: File,
    path: PathBuf,
    block: bool,
    direct: bool,
    /// `O_DIRECT` was asked for but is not supported.
    fallback: bool,
    seg_bytes: u32,
    nsegs: u32,
    min_gain: u32,
    state: Mutex<State>,
    gens: Box<[AtomicU64]>,
    writer: Mutex<Writer>,
    gc: Mutex<Gc>,
    work_hint: AtomicBool,
    discard_ok: AtomicBool,
    failed_writes: AtomicUsize,
    io_error: Mutex<Option<String>>,
    io_error_set: AtomicBool,
    /// Drop empties a regular file ([`Tier::set_owner`]).
    owner: AtomicBool,
    counters: Counters,
    get_latency: LatencyHistogram,
    put_latency: LatencyHistogram,
    /// Tests: how many coming data writes fail with `EIO`.
    #[cfg(test)]
    fail_writes: std::sync::atomic::AtomicU32,
}

impl std::fmt::Debug for DiskTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskTier")
            .field("path", &self.path)
            .field("block", &self.block)
            .field("direct", &self.direct)
            .field("segment_bytes", &self.seg_bytes)
            .field("segments", &self.nsegs)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
thread_local! {
    /// Tests: make the `O_DIRECT` probe fail with `EINVAL`, as on a filesystem without it.
    static FAIL_DIRECT_PROBE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Writes and reads back one aligned block: some filesystems accept
/// `O_DIRECT` at open and refuse it at I/O time.
fn probe_direct(file: &File) -> io::Result<()> {
    #[cfg(test)]
    if FAIL_DIRECT_PROBE.with(std::cell::Cell::get) {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    let mut buf = AlignedBuf::zeroed(ALIGN);
    file.write_all_at(&buf, 0)?;
    file.read_exact_at(&mut buf, 0)
}

impl DiskTier {
    fn open(cfg: &DiskTierConfig) -> Result<Self, TierError> {
        let s = cfg.segment_bytes;
        if !valid_segment_bytes(s) {
            return Err(config_err(format!(
                "segment_bytes {s} must be a multiple of {PAGE} in {MIN_SEGMENT_BYTES}..={MAX_SEGMENT_BYTES}"
            )));
        }
        let path = &cfg.path;
        let shown = path.display();
        let block = match std::fs::metadata(path) {
            Ok(m) if m.file_type().is_block_device() => true,
            Ok(m) if m.is_file() => false,
            Ok(_) => return Err(config_err(format!("{shown} is not a regular file or a block device"))),
            Err(e) if e.kind() == io::ErrorKind::NotFound && cfg.capacity_bytes == 0 => {
                return Err(config_err(format!("{shown} does not exist and capacity_bytes is 0")));
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => false,
            Err(e) => return Err(io_err(e)),
        };
        let open = |direct: bool| {
            let mut o = OpenOptions::new();
            o.read(true).write(true);
            let mut flags = 0;
            if block {
                flags |= libc::O_EXCL; // fails with EBUSY if mounted or held exclusively
            } else {
                o.create(true).mode(0o600);
            }
            if direct {
                flags |= libc::O_DIRECT;
            }
            o.custom_flags(flags).open(path)
        };
        let opened = |r: io::Result<File>| {
            r.map_err(|e| match e.raw_os_error() {
                Some(libc::EBUSY) => config_err(format!("{shown} is busy (mounted or in use)")),
                _ => io_err(e),
            })
        };
        let mut fallback = false;
        let file = match open(cfg.direct_io) {
            Err(e) if cfg.direct_io && e.raw_os_error() == Some(libc::EINVAL) => {
                fallback = true;
                opened(open(false))?
            }
            r => opened(r)?,
        };
        sys::lock_exclusive(&file).map_err(|e| match e.raw_os_error() {
            Some(libc::EWOULDBLOCK) => config_err(format!("{shown} is in use by another disk tier")),
            _ => io_err(e),
        })?;

        let capacity = if block {
            let size = sys::block_device_size(&file).map_err(io_err)?;
            let lbs = sys::logical_block_size(&file).map_err(io_err)?;
            if lbs > PAGE {
                return Err(config_err(format!("{shown}: logical block size {lbs} exceeds {PAGE}")));
            }
            if cfg.capacity_bytes > size {
                return Err(config_err(format!(
                    "{shown}: capacity {} exceeds the device's {size}",
                    cfg.capacity_bytes
                )));
            }
            if cfg.capacity_bytes == 0 {
                size
            } else {
                cfg.capacity_bytes
            }
        } else {
            let size = file.metadata().map_err(io_err)?.len();
            let capacity = if cfg.capacity_bytes == 0 { size } else { cfg.capacity_bytes };
            // Whatever an earlier run left is garbage: drop its blocks.
            file.set_len(0).map_err(io_err)?;
            file.set_len(capacity).map_err(io_err)?;
            capacity
        };
        let nsegs = capacity / u64::from(s);
        if nsegs < MIN_SEGMENTS {
            return Err(config_err(format!(
                "{shown}: capacity {capacity} holds {nsegs} segments of {s} bytes; at least {MIN_SEGMENTS} needed"
            )));
        }
        let nsegs = u32::try_from(nsegs).map_err(|_| config_err(format!("{shown}: too many segments ({nsegs})")))?;

        let mut direct = cfg.direct_io && !fallback;
        if direct {
            match probe_direct(&file) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    sys::clear_direct(&file).map_err(io_err)?;
                    (direct, fallback) = (false, true);
                }
                Err(e) => return Err(io_err(e)),
            }
        }
        let discard_ok = if block {
            // Best effort: the previous run's pages become unreadable on devices that zero discarded blocks.
            sys::block_discard(&file, 0, u64::from(nsegs) * u64::from(s)).is_ok()
        } else {
            true
        };

        Ok(Self::assemble(file, path.clone(), block, (direct, fallback), State::new(s, nsegs), discard_ok))
    }

    /// A tier on an open, checked file with `state`; the owner of the file.
    fn assemble(file: File, path: PathBuf, block: bool, mode: (bool, bool), state: State, discard_ok: bool) -> Self {
        let (s, nsegs) = (state.seg_bytes, u32::try_from(state.segs.len()).expect("checked segment count"));
        Self {
            file,
            path,
            block,
            direct: mode.0,
            fallback: mode.1,
            seg_bytes: s,
            nsegs,
            min_gain: (s / 16).max(2 * MAX_RECORD),
            state: Mutex::new(Rank::DiskState, state),
            gens: (0..nsegs).map(|_| AtomicU64::new(0)).collect(),
            writer: Mutex::new(Rank::DiskWriter, Writer { flush_buf: None }),
            gc: Mutex::new(Rank::DiskGc, Gc { buf: None }),
            work_hint: AtomicBool::new(false),
            discard_ok: AtomicBool::new(discard_ok),
            failed_writes: AtomicUsize::new(0),
            io_error: Mutex::new(Rank::DiskIoError, None),
            io_error_set: AtomicBool::new(false),
            owner: AtomicBool::new(true),
            counters: Counters::default(),
            get_latency: LatencyHistogram::default(),
            put_latency: LatencyHistogram::default(),
            #[cfg(test)]
            fail_writes: std::sync::atomic::AtomicU32::new(0),
        }
    }

    /// The backing file or device.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether I/O bypasses the page cache: the file descriptor's flags
    /// include `O_DIRECT` (asked of the kernel, not remembered).
    pub fn direct_io(&self) -> bool {
        sys::is_direct(&self.file).unwrap_or(false)
    }

    /// Segment size in bytes.
    pub fn segment_bytes(&self) -> u32 {
        self.seg_bytes
    }

    /// Writes every full segment still in memory and the open segment's new
    /// pages (the open segment stays open). Values are readable without a
    /// flush; this bounds what only memory holds. Fails while segment writes fail.
    pub fn flush(&self) -> Result<(), TierError> {
        let mut w = self.writer.lock();
        let result = self.flush_locked(&mut w);
        drop(w);
        if self.work_hint.load(Ordering::SeqCst) {
            self.pump(false); // queued while we wrote, by threads that left it to us
        }
        result?;
        match self.failed_writes.load(Ordering::SeqCst) {
            0 => Ok(()),
            n => Err(TierError::Unavailable {
                tier: NAME.into(),
                reason: format!("{n} segment writes failing: {}", self.io_error_text()),
            }),
        }
    }

    /// With the writer lock held: queued work (failed writes retried), then
    /// the open segment's new pages. Fails if that last write fails.
    fn flush_locked(&self, w: &mut Writer) -> Result<(), TierError> {
        self.pump_locked(w, true);
        let mut st = self.lock();
        let pending = st.open.as_ref().map(|o| (o.seg, o.flushed, o.epoch, st.segs[us(o.seg)].used));
        let Some((seg, flushed, epoch, used)) = pending.filter(|&(_, flushed, _, used)| used > flushed) else {
            return Ok(());
        };
        // Copy the new pages under the state lock, write them outside it.
        let (start, end) = (align_down(flushed), align_up(used));
        let o = st.open.as_mut().expect("checked");
        o.buf[us(used)..us(end)].fill(0);
        let fb = w.flush_buf.get_or_insert_with(|| AlignedBuf::zeroed(us(self.seg_bytes)));
        fb[us(start)..us(end)].copy_from_slice(&o.buf[us(start)..us(end)]);
        drop(st);
        let at = self.seg_off(seg) + u64::from(start);
        match self.write_at(&fb[us(start)..us(end)], at) {
            Ok(()) => {
                add(&self.counters.wire_out, u64::from(end - start));
                add(&self.counters.flushes, 1);
                self.io_ok();
                let mut st = self.lock();
                // Unless the segment was sealed or started over meanwhile.
                if let Some(o) = st.open.as_mut().filter(|o| o.seg == seg && o.epoch == epoch) {
                    o.flushed = o.flushed.max(used);
                }
                Ok(())
            }
            Err(e) => {
                add(&self.counters.failures, 1);
                self.io_failed("write", &e);
                Err(io_err(e))
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }

    fn seg_off(&self, seg: u32) -> u64 {
        u64::from(seg) * u64::from(self.seg_bytes)
    }

    /// Drops the state lock; returns whether disk work is queued.
    fn release(&self, st: MutexGuard<'_, State>) -> bool {
        let work = st.has_work();
        if work {
            self.work_hint.store(true, Ordering::SeqCst);
        }
        drop(st);
        work
    }

    /// Drops the state lock and does (or leaves to the current writer) queued disk work.
    fn settle(&self, st: MutexGuard<'_, State>) {
        if self.release(st) {
            self.pump(false);
        }
    }

    fn io_failed(&self, what: &str, e: &io::Error) {
        *self.io_error.lock() = Some(format!("{what}: {e}"));
        self.io_error_set.store(true, Ordering::SeqCst);
    }

    fn io_ok(&self) {
        if self.io_error_set.load(Ordering::Relaxed) && self.failed_writes.load(Ordering::SeqCst) == 0 {
            *self.io_error.lock() = None;
            self.io_error_set.store(false, Ordering::SeqCst);
        }
    }

    fn io_error_text(&self) -> String {
        self.io_error.lock().clone().unwrap_or_default()
    }

    #[cfg(test)]
    /// Tests: the file offset of a value's bytes, once its segment is on disk.
    fn value_file_offset(&self, key: TierKey) -> Option<u64> {
        let st = self.lock();
        let loc = st.index.get(&key)?;
        Some(self.seg_off(loc.seg) + u64::from(loc.off + RECORD_HEADER))
    }
}

impl Tier for DiskTier {
    fn name(&self) -> &str {
        NAME
    }

    fn put(&self, key: TierKey, value: &[u8]) -> Result<TierPut, TierError> {
        let t0 = Instant::now();
        let r = self.put_inner(key, value);
        self.count_put(&r, value.len());
        self.put_latency.record(t0.elapsed());
        r
    }

    fn get(&self, key: TierKey, out: &mut Vec<u8>) -> Result<TierGet, TierError> {
        let t0 = Instant::now();
        out.clear();
        let r = self.get_inner(key, out);
        let c = &self.counters;
        add(&c.reads, 1);
        match &r {
            Ok(TierGet::Hit) => add(&c.bytes_read, u64::try_from(out.len()).unwrap_or(u64::MAX)),
            Ok(TierGet::Miss) => add(&c.misses, 1),
            Err(_) => {
                out.clear();
                add(&c.failures, 1);
            }
        }
        self.get_latency.record(t0.elapsed());
        r
    }

    fn get_batch(&self, keys: &[TierKey]) -> Vec<Result<Option<Vec<u8>>, TierError>> {
        let t0 = Instant::now();
        let r = self.get_batch_inner(keys);
        let c = &self.counters;
        add(&c.reads, keys.len() as u64);
        for v in &r {
            match v {
                Ok(Some(v)) => add(&c.bytes_read, v.len() as u64),
                Ok(None) => add(&c.misses, 1),
                Err(_) => add(&c.failures, 1),
            }
        }
        // Latency per value, amortised over the batch.
        let per = t0.elapsed() / u32::try_from(keys.len().max(1)).unwrap_or(u32::MAX);
        for _ in keys {
            self.get_latency.record(per);
        }
        r
    }

    fn remove(&self, key: TierKey) -> Result<bool, TierError> {
        add(&self.counters.removes, 1);
        let mut st = self.lock();
        let Some(loc) = st.index.remove(&key) else { return Ok(false) };
        st.kill(loc, &self.gens);
        self.settle(st);
        Ok(true)
    }

    /// Appends every value, writing each segment that fills once, then
    /// writes the open segment's new pages ([`DiskTier::flush`]). Latency is
    /// recorded per value, amortised over the batch.
    fn put_batch(&self, items: &[(TierKey, &[u8])]) -> Vec<Result<TierPut, TierError>> {
        let t0 = Instant::now();
        let results: Vec<_> = items
            .iter()
            .map(|(k, v)| {
                let r = self.put_inner(*k, v);
                self.count_put(&r, v.len());
                r
            })
            .collect();
        if results.iter().any(|r| matches!(r, Ok(TierPut::Stored))) {
            // A failing write leaves the values in memory, still readable: the
            // puts did store. The failure shows in health and counters.
            let _ = self.flush();
        }
        if let Ok(n) = u32::try_from(items.len()) {
            if n > 0 {
                let each = t0.elapsed() / n;
                for _ in 0..n {
                    self.put_latency.record(each);
                }
            }
        }
        results
    }

    fn clear_pool(&self, pool: u32) -> Result<(), TierError> {
        let mut st = self.lock();
        let mut dead = Vec::new();
        st.index.retain(|k, l| {
            let keep = k.pool != pool;
            if !keep {
                dead.push(*l);
            }
            keep
        });
        for loc in dead {
            st.kill(loc, &self.gens);
        }
        self.settle(st);
        Ok(())
    }

    /// `used_bytes`: live records (values and their 24-byte headers) plus the
    /// unusable tails of sealed segments; dead bytes are not counted (the GC
    /// reclaims them). `limit_bytes`: the segments' total size. Puts are
    /// answered `Full` somewhat before the limit: one segment is the GC's
    /// reserve, and a segment is only collected if it gives back 1/16 of itself.
    fn capacity(&self) -> Capacity {
        let st = self.lock();
        Capacity {
            stored_pages: u64::try_from(st.index.len()).unwrap_or(u64::MAX),
            used_bytes: st.live_bytes + st.waste_bytes,
            limit_bytes: Some(u64::from(self.nsegs) * u64::from(self.seg_bytes)),
        }
    }

    fn health(&self) -> Health {
        if let Some(e) = self.io_error.lock().clone() {
            return Health::Down(e);
        }
        if self.fallback {
            return Health::Degraded("buffered I/O: O_DIRECT unsupported".into());
        }
        Health::Healthy
    }

    /// Writes the open segment's new pages and waits for every queued
    /// write and discard (failed writes retried: they fail the hand-over),
    /// then hands over the state ([`DiskTier::adopt`]) and a duplicate of
    /// the file's descriptor (the same open file, `O_DIRECT` and lock).
    fn hand_over(&self) -> Result<TierHandover, TierError> {
        self.hand_over_inner()
    }

    fn set_owner(&self, owner: bool) {
        self.owner.store(owner, Ordering::SeqCst);
    }

    fn stats(&self) -> TierStats {
        let (pages, bytes) = {
            let st = self.lock();
            (u64::try_from(st.index.len()).unwrap_or(u64::MAX), st.value_bytes)
        };
        let c = &self.counters;
        TierStats {
            name: NAME.into(),
            health: String::new(),
            stored_pages: pages,
            stored_bytes: bytes,
            writes: get(&c.writes),
            full: get(&c.full),
            reads: get(&c.reads),
            misses: get(&c.misses),
            removes: get(&c.removes),
            failures: get(&c.failures),
            bytes_written: get(&c.bytes_written),
            bytes_read: get(&c.bytes_read),
            wire_bytes_out: get(&c.wire_out),
            wire_bytes_in: get(&c.wire_in),
            backing_reads: get(&c.file_reads),
            get_p50_us: self.get_latency.quantile_us(0.5),
            get_p99_us: self.get_latency.quantile_us(0.99),
            put_p50_us: self.put_latency.quantile_us(0.5),
            put_p99_us: self.put_latency.quantile_us(0.99),
        }
    }
}

impl Drop for DiskTier {
    /// Swap content does not outlive its tier: the owner of a regular file
    /// empties it (its blocks freed, its length kept).
    fn drop(&mut self) {
        if !self.block && self.owner.load(Ordering::SeqCst) {
            let len = self.file.metadata().map(|m| m.len());
            if let Ok(len) = len {
                let _ = self.file.set_len(0).and_then(|()| self.file.set_len(len));
            }
        }
    }
}
