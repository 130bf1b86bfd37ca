//! A caching block device: a backing file or block device served through an
//! ephemeral pool, cleancache at block level (issue 14; seeds 000, 002, 004).
//!
//! The page cache above a filesystem on this device drops clean pages under
//! memory pressure; when the file is read again the read reaches this device
//! and is served from the compressed pool at RAM speed instead of from the
//! slow backing store. The pool is ephemeral: the store drops its pages
//! whenever it needs room (SIEVE by default), persistent swap pages in the
//! same store always win, and a dropped page is simply read from the backing
//! store again. So the backing store is always the truth:
//!
//! * reads: each page comes from the pool, or from the backing store (one
//!   `pread` per run of missing pages), and is then inserted;
//! * writes are write-through: the backing store first, then each whole
//!   page is put into the pool (or, if the pool refuses it, dropped from it)
//!   before the write is acknowledged. A backing write that fails drops the
//!   pages it covered and fails the request;
//! * trim and write-zeroes reach the backing store (`fallocate`) and drop
//!   the pages; flush is `fdatasync` of the backing store;
//! * a backing store error reaches the client as that errno, never as
//!   cached or zero data.
//!
//! Consistency: each request holds the page stripes of the pages it covers
//! (in index order, [`Rank::BlockStripe`]) across its backing I/O and its
//! pool calls, so a read that missed cannot insert data older than a write
//! to the same page that ran meanwhile. Pool puts under stripes are
//! [`Pool::put_now`]: the eviction that makes room runs after the stripes
//! are dropped ([`Pool::maintain`]).
//!
//! The backing store is opened `O_DIRECT` when it allows it, so its pages do
//! not also sit in the daemon's page cache, outside every memory limit; I/O
//! then goes through a page-aligned buffer per thread, allocated once.

use std::cell::RefCell;
use std::fs::File;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use tmem_core::{Eviction, GetOutcome, Key, Pool, PoolConfig, PutOutcome, Store, StoreConfig, StoreError, PAGE_SIZE};
use tmem_counters::counters;
use tmem_lock::{Mutex, MutexGuard, Rank};
use tmem_sys::aligned::AlignedBuf;
use tmem_sys::blockio;

use crate::{
    bump, check_range, contained, pieces, BlockDevice, BlockError, DeviceStats, Extent, IoCounters, PAGE, STRIPES,
};

/// Pages one backing I/O covers at most; longer requests are served in
/// chunks of this many pages (each chunk holds its stripes only meanwhile).
const CHUNK_PAGES: usize = 64;

/// Errors building a cache device.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// The backing store cannot be opened or sized.
    #[error("backing store {path}: {source}")]
    Backing {
        /// What was given.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The backing store is smaller than a page.
    #[error("backing store {0}: smaller than one 4 KiB page")]
    TooSmall(PathBuf),
    /// The store could not be built.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// How to build a [`CacheDevice`].
#[derive(Clone, Debug)]
pub struct CacheConfig {
    /// Name, e.g. `cache0`.
    pub name: String,
    /// The file or block device the cache mirrors.
    pub backing: PathBuf,
    /// Store of a device that has its own ([`CacheConfig::build`]): codec and limit.
    pub store: StoreConfig,
    /// Which cached page goes first.
    pub eviction: Eviction,
    /// Emulated latency added to each backing read (0: none). For the
    /// benchmark's slow-volume rows only; the delay is labelled as emulation.
    pub backing_latency: Duration,
}

impl CacheConfig {
    /// A cache of `backing` with its own store built from `store`.
    pub fn build(self) -> Result<CacheDevice, CacheError> {
        let store = Arc::new(self.store.clone().build()?);
        self.build_on(store)
    }

    /// A cache whose ephemeral pool lives in `store`, sharing its memory
    /// budget with the store's other pools: persistent (swap) pages evict
    /// cached pages, never the reverse.
    pub fn build_on(self, store: Arc<Store>) -> Result<CacheDevice, CacheError> {
        let pool = store.create_pool(PoolConfig::ephemeral().eviction(self.eviction));
        self.adopt(store, pool)
    }

    /// A cache on `pool`, an ephemeral pool of `store` that already holds
    /// pages (a store handed over by a predecessor process).
    pub fn adopt(self, store: Arc<Store>, pool: Arc<Pool>) -> Result<CacheDevice, CacheError> {
        let bad = |source| CacheError::Backing { path: self.backing.clone(), source };
        let open = |direct: bool| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(if direct { libc::O_DIRECT } else { 0 })
                .open(&self.backing)
        };
        let (file, direct) = match open(true) {
            Ok(f) => (f, true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => (open(false).map_err(bad)?, false),
            Err(e) => return Err(bad(e)),
        };
        let meta = file.metadata().map_err(bad)?;
        let block = meta.file_type().is_block_device();
        let len = if block { blockio::block_device_size(&file).map_err(bad)? } else { meta.len() };
        let size = len / PAGE * PAGE;
        if size == 0 {
            return Err(CacheError::TooSmall(self.backing));
        }
        Ok(CacheDevice {
            name: self.name,
            backing: self.backing,
            file,
            block,
            direct,
            size,
            latency: self.backing_latency,
            store,
            pool,
            stripes: (0..STRIPES).map(|_| Mutex::new(Rank::BlockStripe, ())).collect(),
            io: IoCounters::default(),
            back: BackingCounters::default(),
        })
    }
}

#[derive(Debug, Default)]
struct BackingCounters {
    reads: AtomicU64,
    read_bytes: AtomicU64,
    writes: AtomicU64,
    write_bytes: AtomicU64,
    syncs: AtomicU64,
    discards: AtomicU64,
    errors: AtomicU64,
    fills_refused: AtomicU64,
}

counters! {
    /// What a cache device asked of its backing store.
    #[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
    pub struct BackingStats {
        extra {
            /// The backing file or device.
            pub path: PathBuf,
            /// Id of the cache's pool in its store (which a swap device may share).
            #[serde(default)]
            pub pool: u32,
            /// Whether it is read and written with `O_DIRECT`.
            pub direct: bool,
            /// Emulated latency per backing read, microseconds (0: none).
            pub latency_us: u64,
        }
        /// Reads from the backing store (one per run of missed pages).
        backing_reads: Counter(Events),
        /// Bytes read from the backing store.
        backing_read_bytes: Counter(Bytes),
        /// Writes to the backing store.
        backing_writes: Counter(Events),
        /// Bytes written to the backing store.
        backing_write_bytes: Counter(Bytes),
        /// fdatasync calls (flush and FUA).
        backing_syncs: Counter(Events),
        /// Trim and write-zeroes requests passed to the backing store.
        backing_discards: Counter(Events),
        /// Backing store calls that failed (the request failed with their errno).
        backing_errors: Counter(Events),
        /// Missed pages read from the backing store that the pool did not take (full of swap, poor ratio).
        fills_refused: Counter(Pages),
    }
}

/// A block device that mirrors a backing store through an ephemeral pool.
pub struct CacheDevice {
    name: String,
    backing: PathBuf,
    file: File,
    block: bool,
    direct: bool,
    size: u64,
    latency: Duration,
    store: Arc<Store>,
    pool: Arc<Pool>,
    stripes: Box<[Mutex<()>]>,
    io: IoCounters,
    back: BackingCounters,
}

impl std::fmt::Debug for CacheDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheDevice")
            .field("name", &self.name)
            .field("backing", &self.backing)
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

/// Zeros for backing stores that cannot zero a range themselves.
static ZEROS: [u8; CHUNK_PAGES * PAGE_SIZE] = [0; CHUNK_PAGES * PAGE_SIZE];

thread_local! {
    /// Each serving thread's aligned I/O buffer, [`CHUNK_PAGES`] pages,
    /// allocated on the thread's first request.
    static CHUNK: RefCell<Option<AlignedBuf>> = const { RefCell::new(None) };
}

/// Runs `f` on this thread's chunk buffer.
fn with_chunk<T>(f: impl FnOnce(&mut [u8]) -> T) -> T {
    CHUNK.with(|c| {
        let mut c = c.borrow_mut();
        f(c.get_or_insert_with(|| AlignedBuf::zeroed(CHUNK_PAGES * PAGE_SIZE)))
    })
}

/// Where the request `[offset, end)` lies in the chunk of pages
/// `[start, start + n)`: its offset in the chunk and its length there.
fn span(offset: u64, end: u64, start: u64, n: usize) -> (usize, usize) {
    let from = offset.max(start * PAGE);
    let to = end.min((start + n as u64) * PAGE);
    (
        usize::try_from(from - start * PAGE).expect("within the chunk"),
        usize::try_from(to - from).expect("within the chunk"),
    )
}

/// Pages `[first, first + n)` split into runs of at most [`CHUNK_PAGES`].
fn chunks(first: u64, n: u64) -> impl Iterator<Item = (u64, usize)> {
    (0..n.div_ceil(CHUNK_PAGES as u64)).map(move |i| {
        let start = first + i * CHUNK_PAGES as u64;
        (start, usize::try_from((first + n - start).min(CHUNK_PAGES as u64)).expect("<= 64"))
    })
}

impl CacheDevice {
    /// Device name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The store the cache's pool lives in (shared with swap devices when built with [`CacheConfig::build_on`]).
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The cache's ephemeral pool.
    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    /// Whether the backing store is read and written with `O_DIRECT`.
    pub fn direct(&self) -> bool {
        self.direct
    }

    fn key(page: u64) -> Key {
        Key::new(0, page)
    }

    /// Locks the stripes of pages `[first, first + n)`, `n <= CHUNK_PAGES`,
    /// in stripe index order (the order `Rank::BlockStripe` nests in).
    fn lock_pages(&self, first: u64, n: usize) -> [Option<MutexGuard<'_, ()>>; CHUNK_PAGES] {
        let mut guards = [const { None }; CHUNK_PAGES];
        let start = usize::try_from(first % STRIPES as u64).expect("< STRIPES");
        // The pages map to stripes start.. (mod STRIPES): the wrapped part has the lower indices.
        let wrapped = (start + n).saturating_sub(STRIPES);
        let order = (0..wrapped).chain(start..(start + n).min(STRIPES));
        for (slot, i) in guards.iter_mut().zip(order) {
            *slot = Some(self.stripes[i].lock());
        }
        guards
    }

    fn backing_err(&self, op: &'static str, offset: u64, source: std::io::Error) -> BlockError {
        bump(&self.back.errors, 1);
        BlockError::Backing { op, offset, source }
    }

    /// Reads backing pages `[page, page + buf.len() / PAGE_SIZE)` into `buf` (aligned).
    fn read_backing(&self, page: u64, buf: &mut [u8]) -> Result<(), BlockError> {
        if !self.latency.is_zero() {
            std::thread::sleep(self.latency);
        }
        let offset = page * PAGE;
        bump(&self.back.reads, 1);
        bump(&self.back.read_bytes, buf.len() as u64);
        self.file.read_exact_at(buf, offset).map_err(|e| self.backing_err("pread", offset, e))
    }

    /// Fills the chunk buffer with pages `[first, first + n)`: from the pool,
    /// the missing runs from the backing store (then inserted). Called with
    /// the pages' stripes held. Returns whether the pool refused a fill.
    fn fill(&self, first: u64, n: usize, chunk: &mut [u8]) -> Result<bool, BlockError> {
        let pages = chunk[..n * PAGE_SIZE].as_chunks_mut::<PAGE_SIZE>().0;
        let mut missing = [false; CHUNK_PAGES];
        for (i, page) in pages.iter_mut().enumerate() {
            let key = Self::key(first + i as u64);
            missing[i] = match self.pool.get(key, page) {
                Ok(hit) => hit == GetOutcome::Miss,
                // A corrupt cached copy (counted by the store as
                // `decompress_fail`) is dropped and read again from the truth.
                Err(StoreError::Corrupt { .. }) => {
                    self.pool.flush_page(key)?;
                    true
                }
                Err(e) => return Err(e.into()),
            };
        }
        let mut refused = false;
        let mut i = 0;
        while i < n {
            if !missing[i] {
                i += 1;
                continue;
            }
            let run = missing[i..n].iter().take_while(|&&m| m).count();
            self.read_backing(first + i as u64, pages[i..i + run].as_flattened_mut())?;
            for (j, page) in pages[i..i + run].iter().enumerate() {
                refused |= self.insert(first + (i + j) as u64, page)?;
            }
            i += run;
        }
        Ok(refused)
    }

    /// Puts one page into the pool; a refused put leaves no older copy.
    /// Returns whether it was refused.
    fn insert(&self, page: u64, data: &[u8; PAGE_SIZE]) -> Result<bool, BlockError> {
        match self.pool.put_now(Self::key(page), data)? {
            PutOutcome::Stored => Ok(false),
            PutOutcome::Rejected(_) => {
                bump(&self.back.fills_refused, 1);
                Ok(true)
            }
        }
    }

    /// Drops pages `[first, first + n)` from the pool (their stripes held).
    fn invalidate(&self, first: u64, n: usize) -> Result<(), BlockError> {
        for p in first..first + n as u64 {
            self.pool.flush_page(Self::key(p))?;
        }
        Ok(())
    }

    /// Checks and counts a request of `len` bytes at `offset` (in `ios` and
    /// `bytes`), then runs `f(start, n, chunk)` for each chunk of the pages it
    /// covers, in this thread's chunk buffer. `f` says whether the pool
    /// refused a page; then the pool makes room, with no stripe held.
    fn chunked(
        &self,
        offset: u64,
        len: u64,
        (ios, bytes): (&AtomicU64, &AtomicU64),
        mut f: impl FnMut(u64, usize, &mut [u8]) -> Result<bool, BlockError>,
    ) -> Result<(), BlockError> {
        check_range(offset, len, self.size).inspect_err(|_| bump(&self.io.invalid_io, 1))?;
        bump(ios, 1);
        bump(bytes, len);
        if len == 0 {
            return Ok(());
        }
        let first = offset / PAGE;
        for (start, n) in chunks(first, (offset + len).div_ceil(PAGE) - first) {
            if with_chunk(|chunk| f(start, n, chunk))? {
                self.pool.maintain();
            }
        }
        Ok(())
    }

    fn read_at_inner(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        let end = offset + buf.len() as u64;
        let mut done = 0;
        self.chunked(offset, buf.len() as u64, (&self.io.read_ios, &self.io.read_bytes), |start, n, chunk| {
            let guards = self.lock_pages(start, n);
            let refused = self.fill(start, n, chunk)?;
            drop(guards);
            let (at, len) = span(offset, end, start, n);
            buf[done..done + len].copy_from_slice(&chunk[at..at + len]);
            done += len;
            Ok(refused)
        })
    }

    fn write_at_inner(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        let end = offset + buf.len() as u64;
        let mut done = 0;
        self.chunked(offset, buf.len() as u64, (&self.io.write_ios, &self.io.write_bytes), |start, n, chunk| {
            let _guards = self.lock_pages(start, n);
            let (at, len) = span(offset, end, start, n);
            let bytes = n * PAGE_SIZE;
            // A partial first or last page is read first (pool or backing).
            if at % PAGE_SIZE != 0 {
                bump(&self.io.rmw_pages, 1);
                self.fill(start, 1, chunk)?;
            }
            if (at + len) % PAGE_SIZE != 0 && (n > 1 || at % PAGE_SIZE == 0) {
                bump(&self.io.rmw_pages, 1);
                self.fill(start + n as u64 - 1, 1, &mut chunk[bytes - PAGE_SIZE..])?;
            }
            chunk[at..at + len].copy_from_slice(&buf[done..done + len]);
            done += len;
            let pos = start * PAGE;
            bump(&self.back.writes, 1);
            bump(&self.back.write_bytes, bytes as u64);
            if let Err(e) = self.file.write_all_at(&chunk[..bytes], pos) {
                // What the backing store holds now is unknown: cache none of it.
                self.invalidate(start, n)?;
                return Err(self.backing_err("pwrite", pos, e));
            }
            let mut refused = false;
            for (i, page) in chunk[..bytes].as_chunks::<PAGE_SIZE>().0.iter().enumerate() {
                refused |= self.insert(start + i as u64, page)?;
            }
            Ok(refused)
        })
    }

    fn flush_inner(&self) -> Result<(), BlockError> {
        bump(&self.back.syncs, 1);
        self.file.sync_data().map_err(|e| self.backing_err("fdatasync", 0, e))
    }

    /// Zeroes `[offset, offset + len)` of the backing store (`zero`: keep
    /// it allocated if the store can) and drops the pages it touches.
    fn discard(&self, offset: u64, len: u64, zero: bool) -> Result<(), BlockError> {
        check_range(offset, len, self.size).inspect_err(|_| bump(&self.io.invalid_io, 1))?;
        bump(&self.io.discard_ios, 1);
        bump(&self.back.discards, 1);
        if len == 0 {
            return Ok(());
        }
        let first = offset / PAGE;
        for (start, n) in chunks(first, (offset + len).div_ceil(PAGE) - first) {
            let from = offset.max(start * PAGE);
            let to = (offset + len).min((start + n as u64) * PAGE);
            let guards = self.lock_pages(start, n);
            match blockio::zero_range(&self.file, self.block, from, to - from, zero) {
                Ok(()) => self.invalidate(start, n)?,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::EINVAL)) => {
                    // The store cannot zero this range itself: write zeros
                    // (through the write path, which takes the stripes again).
                    drop(guards);
                    self.write_at_inner(&ZEROS[..usize::try_from(to - from).expect("a chunk")], from)?;
                }
                Err(e) => return Err(self.backing_err("fallocate", from, e)),
            }
        }
        Ok(())
    }

    /// Holes of the backing file, page-granular (a page is a hole only when
    /// all of it is); a block device is all data.
    fn extents_inner(&self, offset: u64, len: u64) -> Result<Vec<Extent>, BlockError> {
        check_range(offset, len, self.size).inspect_err(|_| bump(&self.io.invalid_io, 1))?;
        let mut out: Vec<Extent> = Vec::new();
        let mut hole_end = 0u64;
        let mut data_end = 0u64;
        for (page, _, n) in pieces(offset, len) {
            let start = page * PAGE;
            let hole = if self.block {
                false
            } else if start < hole_end {
                true
            } else if start < data_end {
                false
            } else {
                match blockio::next_data(&self.file, start).map_err(|e| self.backing_err("lseek", start, e))? {
                    Some(d) if d < start + PAGE => {
                        data_end = blockio::next_hole(&self.file, start)
                            .map_err(|e| self.backing_err("lseek", start, e))?
                            .div_ceil(PAGE)
                            * PAGE;
                        false
                    }
                    Some(d) => {
                        hole_end = d / PAGE * PAGE;
                        true
                    }
                    None => {
                        hole_end = u64::MAX;
                        true
                    }
                }
            };
            match out.last_mut() {
                Some(e) if e.hole == hole => e.len += n as u64,
                _ => out.push(Extent { len: n as u64, hole }),
            }
        }
        Ok(out)
    }

    /// Counters of the device, its backing store and its store.
    pub fn stats(&self) -> DeviceStats {
        let r = std::sync::atomic::Ordering::Relaxed;
        let b = &self.back;
        let mut stats = self.io.snapshot(&self.name, self.size, self.store.stats());
        let mut backing = BackingStats {
            path: self.backing.clone(),
            pool: self.pool.id(),
            direct: self.direct,
            latency_us: u64::try_from(self.latency.as_micros()).unwrap_or(u64::MAX),
            backing_reads: b.reads.load(r),
            backing_read_bytes: b.read_bytes.load(r),
            backing_writes: b.writes.load(r),
            backing_write_bytes: b.write_bytes.load(r),
            backing_syncs: b.syncs.load(r),
            backing_discards: b.discards.load(r),
            backing_errors: b.errors.load(r),
            fills_refused: b.fills_refused.load(r),
        };
        if let Some(before) = self.io.carried.get().and_then(|c| c.backing.as_ref()) {
            tmem_counters::Counters::add_counters(&mut backing, before);
        }
        stats.backing = Some(backing);
        stats
    }

    /// Counts on from the device's counters in a predecessor process, as
    /// [`crate::PoolDevice::carry_on`] does.
    pub fn carry_on(&self, counters: &DeviceStats) {
        self.io.carry_on(counters);
    }
}

impl BlockDevice for CacheDevice {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        contained(&self.io.panics, "read", || self.read_at_inner(buf, offset))
            .inspect_err(|_| bump(&self.io.failed_reads, 1))
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        contained(&self.io.panics, "write", || self.write_at_inner(buf, offset))
            .inspect_err(|_| bump(&self.io.failed_writes, 1))
    }

    fn flush(&self) -> Result<(), BlockError> {
        contained(&self.io.panics, "flush", || self.flush_inner())
    }

    fn trim(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        contained(&self.io.panics, "trim", || self.discard(offset, len, false))
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        contained(&self.io.panics, "write-zeroes", || self.discard(offset, len, true))
    }

    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>, BlockError> {
        contained(&self.io.panics, "extents", || self.extents_inner(offset, len))
    }
}
