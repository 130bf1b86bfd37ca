//! Block devices on the tmem store: a persistent pool addressed by byte
//! offset, 4 KiB pages, with read-modify-write for partial pages.
//!
//! [`BlockDevice`] is the boundary every frontend (FUSE file, NBD server)
//! serves. [`PoolDevice`] implements it on its own [`Store`], so each device
//! has its own size, codec, limit and counters, as ramzswap's devices did.
//! [`ZeroDevice`] is the no-op implementation: it reads zeros and drops writes.
//!
//! Semantics: unwritten, trimmed and zeroed ranges read as zeros; trim and
//! write-zeroes free whole pages and zero the covered part of partial pages;
//! a write the pool refuses (limit, no memory) fails with an error and keeps
//! the page's previous contents.
//!
//! Panic containment: every request to a [`PoolDevice`] runs under
//! `catch_unwind`. A panic fails that request alone with
//! [`BlockError::Panicked`] (EIO), is counted in `panics`, and the device
//! goes on serving; the panic hook (the daemon's) logs the backtrace. Locks
//! a panic leaves poisoned are taken over by the next request.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tmem_counters::counters;
use tmem_lock::{Mutex, MutexGuard, Rank};

use tmem_core::{
    GetOutcome, Grouper, Grouping, Key, Pool, PoolConfig, PutOutcome, RecompressConfig, Recompression, Recompressor,
    Reject, Stats, Store, StoreConfig, StoreError, TierChain, WritebackWorker, PAGE_SIZE,
};

const PAGE: u64 = PAGE_SIZE as u64;
/// Page-lock stripes; writes to one page serialise on its stripe.
const STRIPES: usize = 1024;

/// Block I/O errors, each mapping to one errno for the frontends.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    /// The range lies (partly) beyond the end of the device (EINVAL).
    #[error("range {offset}+{len} is beyond the device size {size}")]
    OutOfRange {
        /// Start of the request.
        offset: u64,
        /// Length of the request.
        len: u64,
        /// Device size.
        size: u64,
    },
    /// The pool refused the page and there is no lower tier (ENOSPC).
    #[error("pool refused page {page}: {reason:?}")]
    NoSpace {
        /// Page index.
        page: u64,
        /// Why.
        reason: Reject,
    },
    /// Stored data is corrupt (EIO).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The backing store of a cache device failed; its errno reaches the client.
    #[error("backing store: {op} at {offset}: {source}")]
    Backing {
        /// pread, pwrite, fdatasync, fallocate.
        op: &'static str,
        /// Byte offset in the backing store.
        offset: u64,
        /// The error.
        source: std::io::Error,
    },
    /// Serving the request panicked; the request failed alone (EIO).
    #[error("{op} panicked: {message}")]
    Panicked {
        /// The request: read, write, trim, extents.
        op: &'static str,
        /// The panic's message.
        message: String,
    },
}

impl BlockError {
    /// The errno a frontend reports for this error.
    pub fn errno(&self) -> i32 {
        match self {
            BlockError::OutOfRange { .. } => libc::EINVAL,
            BlockError::NoSpace { .. } => libc::ENOSPC,
            BlockError::Backing { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            BlockError::Store(_) | BlockError::Panicked { .. } => libc::EIO,
        }
    }
}

/// One run of pages with the same allocation state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// Length in bytes.
    pub len: u64,
    /// Nothing is stored here; it reads as zeros (NBD `HOLE|ZERO`).
    pub hole: bool,
}

/// What a block frontend serves.
pub trait BlockDevice: Send + Sync {
    /// Size in bytes (a multiple of 4096).
    fn size(&self) -> u64;
    /// Reads `buf.len()` bytes at `offset`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError>;
    /// Writes `buf` at `offset`.
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError>;
    /// Makes completed writes durable (memory devices: nothing to do).
    fn flush(&self) -> Result<(), BlockError>;
    /// Discards a range; it reads as zeros afterwards.
    fn trim(&self, offset: u64, len: u64) -> Result<(), BlockError>;
    /// Zeroes a range, freeing what it can.
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), BlockError>;
    /// Allocation map of a range, page-granular, in order, covering it exactly.
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>, BlockError>;
}

/// Runs one request under `catch_unwind`: a panic fails it alone with
/// [`BlockError::Panicked`] and is counted in `panics` (see the crate docs).
fn contained<T>(
    panics: &AtomicU64,
    op: &'static str,
    f: impl FnOnce() -> Result<T, BlockError>,
) -> Result<T, BlockError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        bump(panics, 1);
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(no message)".into());
        Err(BlockError::Panicked { op, message })
    })
}

fn check_range(offset: u64, len: u64, size: u64) -> Result<(), BlockError> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(BlockError::OutOfRange { offset, len, size }),
    }
}

/// Reads zeros, drops writes: the no-op device.
#[derive(Debug)]
pub struct ZeroDevice {
    size: u64,
}

impl ZeroDevice {
    /// A zero device of `size` bytes.
    pub fn new(size: u64) -> Self {
        Self { size }
    }
}

impl BlockDevice for ZeroDevice {
    fn size(&self) -> u64 {
        self.size
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        check_range(offset, buf.len() as u64, self.size)?;
        buf.fill(0);
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        check_range(offset, buf.len() as u64, self.size)
    }
    fn flush(&self) -> Result<(), BlockError> {
        Ok(())
    }
    fn trim(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        check_range(offset, len, self.size)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        check_range(offset, len, self.size)
    }
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>, BlockError> {
        check_range(offset, len, self.size)?;
        Ok(if len == 0 { Vec::new() } else { vec![Extent { len, hole: true }] })
    }
}

/// How to build a [`PoolDevice`].
#[derive(Clone, Debug)]
pub struct DeviceConfig {
    /// Name, e.g. `swap0`.
    pub name: String,
    /// Size in bytes; rounded down to whole pages.
    pub size: u64,
    /// Store configuration: codec, policy (pool limit), shards, and grouping
    /// of cold pages (`store.group`: the device runs its worker; a window
    /// is 64 KiB of adjacent device offsets).
    pub store: StoreConfig,
    /// Tiers below the pool (writeback, incompressible pages). Without them
    /// a page the pool refuses fails the write with ENOSPC.
    pub tiers: Option<TierChain>,
    /// Background recompression of cold pages, if wanted.
    pub recompress: Option<RecompressConfig>,
}

/// How often the writeback worker looks at the pool's fill.
const WRITEBACK_PERIOD: std::time::Duration = std::time::Duration::from_millis(20);

impl DeviceConfig {
    /// Builds the device.
    pub fn build(self) -> Result<PoolDevice, StoreError> {
        let store = self.store.clone().build()?;
        let cfg = PoolConfig::persistent().reject_keeps_old(true);
        let (pool, writeback) = match self.tiers.clone() {
            Some(chain) => {
                let pool = store.create_pool_with_tiers(cfg, chain);
                let worker = store.start_writeback(WRITEBACK_PERIOD);
                (pool, Some(worker))
            }
            None => (store.create_pool(cfg), None),
        };
        self.finish(store, pool, writeback)
    }

    /// The device on a store handed over by a predecessor process
    /// (`Store::import`), whose pool 0 holds its pages. Its tiers came with
    /// the store (`Store::import_tiered`), not from `self.tiers`, which must
    /// be `None`; writeback to them starts here.
    pub fn adopt(self, store: Store) -> Result<PoolDevice, StoreError> {
        if self.tiers.is_some() {
            return Err(StoreError::Handover("an adopted device's tiers come with its store".into()));
        }
        let pool = store.pool(0)?;
        let writeback = pool.tier_chain().is_some().then(|| store.start_writeback(WRITEBACK_PERIOD));
        self.finish(store, pool, writeback)
    }

    fn finish(
        self,
        store: Store,
        pool: Arc<Pool>,
        writeback: Option<WritebackWorker>,
    ) -> Result<PoolDevice, StoreError> {
        let recompressor = self.recompress.map(|r| store.recompression(r)).transpose()?.map(Recompression::spawn);
        let grouper = self.store.group.is_some().then(|| store.grouping()).transpose()?.map(Grouping::spawn);
        Ok(PoolDevice {
            _writeback: writeback,
            _recompressor: recompressor,
            _grouper: grouper,
            name: self.name,
            size: self.size / PAGE * PAGE,
            store: Arc::new(store),
            pool,
            stripes: (0..STRIPES).map(|_| Mutex::new(Rank::BlockStripe, ())).collect(),
            io: IoCounters::default(),
            written: WrittenDuringSweep::new(self.size / PAGE),
        })
    }
}

/// Per-device I/O counters, after zram's `io_stat` and `stat`.
#[derive(Debug, Default)]
struct IoCounters {
    read_ios: AtomicU64,
    write_ios: AtomicU64,
    read_bytes: AtomicU64,
    write_bytes: AtomicU64,
    /// Trim and write-zeroes requests.
    discard_ios: AtomicU64,
    /// Partial-page writes done by read-modify-write.
    rmw_pages: AtomicU64,
    /// Reads that failed (corrupt data).
    failed_reads: AtomicU64,
    /// Writes that failed (pool refused the page).
    failed_writes: AtomicU64,
    /// Requests outside the device.
    invalid_io: AtomicU64,
    /// Requests that panicked (failed with EIO).
    panics: AtomicU64,
    /// Pages dropped by [`PoolDevice::drop_stale`].
    stale_pages_dropped: AtomicU64,
    /// Sweeps of [`PoolDevice::drop_stale`] stopped by a write.
    stale_sweeps_interrupted: AtomicU64,
    /// Pages such sweeps kept because the kernel wrote them meanwhile.
    stale_pages_kept: AtomicU64,
    /// Times the device's idle swap area was emptied ([`PoolDevice::count_area_emptied`]).
    swap_areas_emptied: AtomicU64,
    /// A predecessor's counters, carried on after a restart ([`IoCounters::carry_on`]).
    carried: std::sync::OnceLock<DeviceStats>,
}

impl IoCounters {
    /// Counts on from a predecessor's `counters` of the same device (a
    /// restart): its events are added to every snapshot. Its gauges are
    /// not (they are this device's own). Only the first call counts.
    fn carry_on(&self, counters: &DeviceStats) {
        // Only the counter fields are added (not `store`, which travels with
        // the store, nor `front`, which travels with the front).
        let events = DeviceStats { disksize: 0, front: None, ..counters.clone() };
        let _ = self.carried.set(events);
    }

    /// The device's counters with its store's; no backing store.
    fn snapshot(&self, name: &str, size: u64, store: Stats) -> DeviceStats {
        let mut s = self.counted(name, size, store);
        if let Some(before) = self.carried.get() {
            tmem_counters::Counters::add_counters(&mut s, before);
        }
        s
    }

    fn counted(&self, name: &str, size: u64, store: Stats) -> DeviceStats {
        let r = Ordering::Relaxed;
        DeviceStats {
            name: name.to_owned(),
            store,
            backing: None,
            front: None,
            run: None,
            transport: None,
            disksize: size,
            read_ios: self.read_ios.load(r),
            write_ios: self.write_ios.load(r),
            read_bytes: self.read_bytes.load(r),
            write_bytes: self.write_bytes.load(r),
            discard_ios: self.discard_ios.load(r),
            rmw_pages: self.rmw_pages.load(r),
            failed_reads: self.failed_reads.load(r),
            failed_writes: self.failed_writes.load(r),
            invalid_io: self.invalid_io.load(r),
            panics: self.panics.load(r),
            stale_pages_dropped: self.stale_pages_dropped.load(r),
            stale_sweeps_interrupted: self.stale_sweeps_interrupted.load(r),
            stale_pages_kept: self.stale_pages_kept.load(r),
            swap_areas_emptied: self.swap_areas_emptied.load(r),
        }
    }
}

impl DeviceStats {
    /// A `tmem run` instance as a device of `tmem stat` and the metrics:
    /// its store, its counters, its `--memory` as the size; no I/O.
    #[must_use]
    pub fn of_run(name: &str, store: Stats, run: tmem_uffd::stats::RunStats) -> Self {
        let size = run.memory_limit_bytes;
        Self { run: Some(run), ..IoCounters::default().counted(name, size, store) }
    }
}

/// How the kernel reaches a device: the transport, its block device node
/// and why that transport was chosen.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TransportStats {
    /// `fuse` (a loop device on the FUSE file) or `nbd` (the kernel's NBD client).
    pub kind: String,
    /// The block device the kernel swaps to or caches through (`/dev/loopN`, `/dev/nbdN`).
    pub node: std::path::PathBuf,
    /// Why this transport was chosen.
    pub reason: String,
}

counters! {
    /// Snapshot of a device's counters.
    #[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
    pub struct DeviceStats {
        extra {
            /// Device name.
            pub name: String,
            /// The device's store.
            pub store: Stats,
            /// A cache device's backing store (absent for swap devices).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub backing: Option<BackingStats>,
            /// The kernel's pool in front of the device, when there is one
            /// (filled in by the daemon).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub front: Option<tmem_front::FrontStats>,
            /// A `tmem run` instance, when this is one (filled in by `tmem run`).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub run: Option<tmem_uffd::stats::RunStats>,
            /// How the kernel reaches the device, once it does (filled in
            /// by the daemon).
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub transport: Option<TransportStats>,
        }
        /// Size in bytes (zram `disksize`).
        disksize: Gauge(Bytes),
        /// Read requests.
        read_ios: Counter(Events),
        /// Write requests.
        write_ios: Counter(Events),
        /// Bytes read.
        read_bytes: Counter(Bytes),
        /// Bytes written.
        write_bytes: Counter(Bytes),
        /// Trim and write-zeroes requests.
        discard_ios: Counter(Events),
        /// Pages written by read-modify-write.
        rmw_pages: Counter(Pages),
        /// Failed reads.
        failed_reads: Counter(Events),
        /// Failed writes.
        failed_writes: Counter(Events),
        /// Requests outside the device.
        invalid_io: Counter(Events),
        /// Requests that panicked and failed alone with EIO.
        panics: Counter(Events),
        /// Pages of freed swap slots dropped when the kernel's swap area
        /// on the device had no slot in use, and pages of blocks zram freed
        /// (dropped when it read every block it still uses).
        stale_pages_dropped: Counter(Pages),
        /// Such sweeps that stopped at once: a write came in between the
        /// reading of /proc/swaps and the sweep's start, or zram's marking
        /// of the blocks it uses failed.
        stale_sweeps_interrupted: Counter(Events),
        /// Pages such sweeps kept because the kernel wrote them during the
        /// sweep (it may have taken their slots), or read them while zram
        /// marked the blocks it uses.
        stale_pages_kept: Counter(Pages),
        /// Times the daemon emptied the device's idle swap area (swapoff,
        /// mkswap, swapon) to give back freed slots' pages.
        swap_areas_emptied: Counter(Events),
    }
}

/// What [`PoolDevice::drop_stale`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StaleSweep {
    /// Went over the whole device: dropped and kept (written during the
    /// sweep) this many pages.
    Done {
        /// Pages dropped.
        dropped: u64,
        /// Pages kept because they were written during the sweep.
        kept: u64,
    },
    /// A write came in before the sweep began: it dropped nothing.
    Interrupted,
}

/// A block device on a persistent pool of its own store.
pub struct PoolDevice {
    /// Background writeback to the tiers (declared first: stops before the store drops).
    _writeback: Option<WritebackWorker>,
    /// Background recompression (also stops before the store drops).
    _recompressor: Option<Recompressor>,
    /// Background grouping of cold pages (also stops before the store drops).
    _grouper: Option<Grouper>,
    name: String,
    size: u64,
    /// Shared with cache devices whose ephemeral pool lives in it.
    store: Arc<Store>,
    pool: Arc<Pool>,
    /// Per-page locks across a read-modify-write and its store call; the store
    /// does no slow work under them (lock order: docs/ARCHITECTURE.md, `Rank::BlockStripe`).
    stripes: Box<[Mutex<()>]>,
    io: IoCounters,
    /// Pages written during a [`PoolDevice::drop_stale`] sweep.
    written: WrittenDuringSweep,
}

impl std::fmt::Debug for PoolDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolDevice").field("name", &self.name).field("size", &self.size).finish_non_exhaustive()
    }
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// Splits `[offset, offset+len)` into per-page pieces: (page, offset in page, length).
fn pieces(offset: u64, len: u64) -> impl Iterator<Item = (u64, usize, usize)> {
    let end = offset + len;
    let mut pos = offset;
    std::iter::from_fn(move || {
        if pos >= end {
            return None;
        }
        let page = pos / PAGE;
        let in_page = pos % PAGE;
        let n = (PAGE - in_page).min(end - pos);
        pos += n;
        Some((page, usize::try_from(in_page).expect("< 4096"), usize::try_from(n).expect("<= 4096")))
    })
}

impl PoolDevice {
    /// Device name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device's store (policy and codec changes, compaction).
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The store, to put a cache device's pool in it ([`CacheConfig::build_on`]).
    pub fn shared_store(&self) -> Arc<Store> {
        Arc::clone(&self.store)
    }

    fn key(page: u64) -> Key {
        Key::new(0, page)
    }

    fn stripe(&self, page: u64) -> MutexGuard<'_, ()> {
        let i = usize::try_from(page % STRIPES as u64).expect("< STRIPES");
        self.stripes[i].lock()
    }

    fn read_page(&self, page: u64, out: &mut [u8; PAGE_SIZE]) -> Result<(), BlockError> {
        #[cfg(feature = "fault-injection")]
        fault::on_read(page);
        if self.pool.get(Self::key(page), out)? == GetOutcome::Miss {
            out.fill(0);
        }
        Ok(())
    }

    /// Reads `dst` (within one page) at byte `offset`.
    fn read_piece(&self, offset: u64, dst: &mut [u8]) -> Result<(), BlockError> {
        if dst.is_empty() {
            return Ok(());
        }
        let mut scratch = [0u8; PAGE_SIZE];
        let at = usize::try_from(offset % PAGE_SIZE as u64).expect("less than a page");
        self.read_page(offset / PAGE_SIZE as u64, &mut scratch)?;
        dst.copy_from_slice(&scratch[at..at + dst.len()]);
        Ok(())
    }

    /// Reads whole pages from page `first` on.
    fn read_pages(&self, first: u64, pages: &mut [[u8; PAGE_SIZE]]) -> Result<(), BlockError> {
        if let [one] = pages {
            return self.read_page(first, one);
        }
        if pages.is_empty() {
            return Ok(());
        }
        #[cfg(feature = "fault-injection")]
        (first..).take(pages.len()).for_each(fault::on_read);
        let keys: Vec<Key> = (first..).take(pages.len()).map(Self::key).collect();
        let results = self.pool.get_batch(&keys, pages);
        for (r, page) in results.into_iter().zip(pages) {
            if r? == GetOutcome::Miss {
                page.fill(0);
            }
        }
        Ok(())
    }

    /// Stores one page; called under its stripe, so the store does none of
    /// its slow work here (see [`PoolDevice::put_piece`]).
    fn put_page(&self, page: u64, data: &[u8; PAGE_SIZE]) -> Result<(), BlockError> {
        #[cfg(feature = "fault-injection")]
        fault::on_write(page);
        match self.pool.put_now(Self::key(page), data)? {
            PutOutcome::Stored => Ok(()),
            PutOutcome::Rejected(reason) => Err(BlockError::NoSpace { page, reason }),
        }
    }

    /// Runs `put` (which takes the page's stripe and stores) and, when the
    /// pool refused for lack of room, makes room with no stripe held
    /// (writeback, eviction, compaction) and tries once more. Then the
    /// store's other due work (compaction, tier removals), also unlocked.
    fn put_piece(&self, put: impl Fn() -> Result<(), BlockError>) -> Result<(), BlockError> {
        let mut r = put();
        if matches!(r, Err(BlockError::NoSpace { reason: Reject::PoolLimit, .. })) && self.pool.maintain() {
            r = put();
        }
        self.pool.maintain();
        r
    }

    /// Zeroes `[in_page, in_page+n)` of `page`, freeing it when whole.
    fn zero_piece(&self, page: u64, in_page: usize, n: usize) -> Result<(), BlockError> {
        self.put_piece(|| self.zero_piece_locked(page, in_page, n))
    }

    fn zero_piece_locked(&self, page: u64, in_page: usize, n: usize) -> Result<(), BlockError> {
        let _g = self.stripe(page);
        if n == PAGE_SIZE {
            self.pool.flush_page(Self::key(page))?;
            return Ok(());
        }
        let mut buf = [0u8; PAGE_SIZE];
        if self.pool.get(Self::key(page), &mut buf)? == GetOutcome::Miss {
            return Ok(());
        }
        buf[in_page..in_page + n].fill(0);
        bump(&self.io.rmw_pages, 1);
        self.put_page(page, &buf)
    }

    /// Runs one request; a panic fails it alone (see the crate docs).
    fn contained<T>(&self, op: &'static str, f: impl FnOnce() -> Result<T, BlockError>) -> Result<T, BlockError> {
        contained(&self.io.panics, op, f)
    }

    fn range(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        check_range(offset, len, self.size).inspect_err(|_| bump(&self.io.invalid_io, 1))
    }

    /// Write requests so far. Read it before learning that the device holds
    /// no live page, and pass it to [`drop_stale`](Self::drop_stale).
    pub fn writes(&self) -> u64 {
        self.io.write_ios.load(Ordering::Relaxed)
    }

    /// Drops every page of the device but the first (a swap area's header,
    /// which `swapon` reads), for a swap device whose kernel swap area had
    /// no slot in use after `writes_before` was read: every other page the
    /// device holds then belongs to a freed slot (a loop device is not told
    /// when the kernel frees one). A page written during the sweep stays
    /// (the kernel may have taken its slot), and so does every page when a
    /// write was counted between `writes_before` and the sweep's start
    /// (`Interrupted`): see [`sweep`](crate::sweep) for the ordering. One
    /// sweep at a time; a second one returns `Interrupted`.
    pub fn drop_stale(&self, writes_before: u64) -> StaleSweep {
        if !self.written.begin() {
            return StaleSweep::Interrupted;
        }
        if self.io.write_ios.load(Ordering::SeqCst) != writes_before {
            self.written.end();
            bump(&self.io.stale_sweeps_interrupted, 1);
            return StaleSweep::Interrupted;
        }
        self.sweep_unmarked(1)
    }

    /// Drops every page but those read or written while `mark` runs: for a
    /// device below zram, which never says which written-back blocks it
    /// freed. `mark` reads, through zram, every block zram still uses (each
    /// read reaches this device and marks its page) and returns how many
    /// pages at least must be marked now, or `None` when it could not read
    /// them all; then, or when fewer pages were marked (reads that did not
    /// reach this device), nothing is dropped (`Interrupted`).
    /// Nothing may write to the device meanwhile but what `mark` allows
    /// for (zram writes to it only when told to write back): a write keeps
    /// its page, as in [`drop_stale`](Self::drop_stale). Shares its one
    /// sweep at a time.
    pub fn keep_only_marked(&self, mark: &mut dyn FnMut() -> Option<u64>) -> StaleSweep {
        if !self.written.begin() {
            return StaleSweep::Interrupted;
        }
        if mark().is_none_or(|min| self.written.count() < min) {
            self.written.end();
            bump(&self.io.stale_sweeps_interrupted, 1);
            return StaleSweep::Interrupted;
        }
        self.sweep_unmarked(0)
    }

    /// Drops every unmarked page from page `first` on, and ends the sweep.
    fn sweep_unmarked(&self, first: u64) -> StaleSweep {
        let (mut dropped, mut kept) = (0, 0);
        for page in first..self.size / PAGE {
            let _g = self.stripe(page);
            if self.written.written(page) {
                kept += 1;
                continue;
            }
            // A pool that fails (it is being torn down) keeps its pages.
            if self.pool.flush_page(Self::key(page)).unwrap_or(false) {
                dropped += 1;
            }
        }
        self.written.end();
        bump(&self.io.stale_pages_dropped, dropped);
        bump(&self.io.stale_pages_kept, kept);
        self.pool.maintain();
        StaleSweep::Done { dropped, kept }
    }

    /// Counts one emptying of the device's idle swap area, done by its
    /// owner with swapoff, mkswap and swapon (the device cannot see it).
    pub fn count_area_emptied(&self) {
        bump(&self.io.swap_areas_emptied, 1);
    }

    /// Counters of the device and its store.
    pub fn stats(&self) -> DeviceStats {
        self.io.snapshot(&self.name, self.size, self.store.stats())
    }

    /// Counts on from the device's counters in a predecessor process
    /// (`counters`, its [`PoolDevice::stats`] when it handed over), so that
    /// a restart resets none of them. Only the first call counts.
    pub fn carry_on(&self, counters: &DeviceStats) {
        self.io.carry_on(counters);
    }
}

impl BlockDevice for PoolDevice {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        self.contained("read", || self.read_at_inner(buf, offset)).inspect_err(|e| {
            if matches!(e, BlockError::Panicked { .. }) {
                bump(&self.io.failed_reads, 1);
            }
        })
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        self.contained("write", || self.write_at_inner(buf, offset)).inspect_err(|e| {
            if matches!(e, BlockError::Panicked { .. }) {
                bump(&self.io.failed_writes, 1);
            }
        })
    }

    fn flush(&self) -> Result<(), BlockError> {
        self.contained("flush", || self.flush_inner())
    }

    fn trim(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        self.contained("trim", || self.trim_inner(offset, len))
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        self.contained("write-zeroes", || self.write_zeroes_inner(offset, len))
    }

    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>, BlockError> {
        self.contained("extents", || self.extents_inner(offset, len))
    }
}

impl PoolDevice {
    fn read_at_inner(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        self.range(offset, buf.len() as u64)?;
        bump(&self.io.read_ios, 1);
        bump(&self.io.read_bytes, buf.len() as u64);
        if !buf.is_empty() {
            self.written.on_read(offset / PAGE, (offset + buf.len() as u64 - 1) / PAGE);
        }
        // A partial first and last page one by one; the whole pages between in
        // one batch, so pages in a lower tier cost one round trip together.
        let page_len = PAGE_SIZE as u64;
        let head = usize::try_from(((page_len - offset % page_len) % page_len).min(buf.len() as u64))
            .expect("less than a page");
        let (first, rest) = buf.split_at_mut(head);
        let (whole, last) = rest.split_at_mut(rest.len() / PAGE_SIZE * PAGE_SIZE);
        let r = self
            .read_piece(offset, first)
            .and_then(|()| self.read_pages((offset + head as u64) / page_len, whole.as_chunks_mut().0))
            .and_then(|()| self.read_piece(offset + (head + whole.len()) as u64, last));
        r.inspect_err(|_| bump(&self.io.failed_reads, 1))
    }

    fn write_at_inner(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        self.range(offset, buf.len() as u64)?;
        // SeqCst, against drop_stale's start (crate::sweep).
        self.io.write_ios.fetch_add(1, Ordering::SeqCst);
        bump(&self.io.write_bytes, buf.len() as u64);
        let mut done = 0;
        for (page, in_page, n) in pieces(offset, buf.len() as u64) {
            let src = &buf[done..done + n];
            let r = self.put_piece(|| {
                let _g = self.stripe(page);
                self.written.on_write(page);
                match <&[u8; PAGE_SIZE]>::try_from(src) {
                    Ok(whole) => self.put_page(page, whole),
                    Err(_) => {
                        bump(&self.io.rmw_pages, 1);
                        let mut scratch = [0u8; PAGE_SIZE];
                        self.read_page(page, &mut scratch).and_then(|()| {
                            scratch[in_page..in_page + n].copy_from_slice(src);
                            self.put_page(page, &scratch)
                        })
                    }
                }
            });
            r.inspect_err(|_| bump(&self.io.failed_writes, 1))?;
            done += n;
        }
        Ok(())
    }

    fn flush_inner(&self) -> Result<(), BlockError> {
        Ok(())
    }

    fn trim_inner(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        self.range(offset, len)?;
        bump(&self.io.discard_ios, 1);
        for (page, in_page, n) in pieces(offset, len) {
            self.zero_piece(page, in_page, n)?;
        }
        Ok(())
    }

    fn write_zeroes_inner(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        self.trim_inner(offset, len)
    }

    fn extents_inner(&self, offset: u64, len: u64) -> Result<Vec<Extent>, BlockError> {
        self.range(offset, len)?;
        let mut out: Vec<Extent> = Vec::new();
        for (page, _, n) in pieces(offset, len) {
            let hole = !self.pool.contains(Self::key(page))?;
            match out.last_mut() {
                Some(e) if e.hole == hole => e.len += n as u64,
                _ => out.push(Extent { len: n as u64, hole }),
            }
        }
        Ok(out)
    }
}

mod cache;
pub use cache::{BackingStats, CacheConfig, CacheDevice, CacheError};
pub mod conformance;
#[cfg(feature = "fault-injection")]
mod fault;
mod node;
pub use node::NodeDevice;
mod ram;
pub use ram::RamDevice;
mod sweep;
use sweep::WrittenDuringSweep;

#[cfg(test)]
mod tests;
