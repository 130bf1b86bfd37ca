//! zram benchmark harness: the kernel side of `tmem bench store`.
//!
//! [`bench()`] stores a caller-supplied set of 4 KiB pages in a real zram block
//! device (`/dev/zramN`) with a chosen compression algorithm, reads them back,
//! verifies every byte, and reports timings plus the device's `mm_stat` memory
//! figures, so the userspace store can be compared with the kernel on the *same*
//! pages.
//!
//! # Safety of the device
//!
//! The harness only ever touches a device that is idle (see [`check_available`]):
//! not initialised (`initstate` 0, `disksize` 0), not used as swap, not mounted and
//! without holders. Whatever happens during the run (I/O error, verification
//! failure, panic, even in a worker thread) the device is put back the way it was
//! found: reset, original `comp_algorithm`, original `mem_limit`, `disksize` 0.
//! The only state that cannot be restored is `algorithm_params` (write-only in
//! sysfs, cleared by every reset). A process killed with `SIGKILL` cannot run its
//! destructors; in that case run `echo 1 > /sys/block/zramN/reset` by hand.
//!
//! Concurrent tmem processes are serialised with an advisory `flock(2)` on
//! `/run/lock/tmem-sys-zramN.lock` (falls back to the temp dir).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::RwLock;
use std::thread;
use std::time::{Duration, Instant};

/// Page size the harness works in (and zram's logical block size on x86-64).
pub const PAGE_SIZE: usize = 4096;

/// Bytes transferred per `pwrite`/`pread` system call.
///
/// 64 KiB = 16 pages per syscall. One page per syscall would make the benchmark
/// measure mostly syscall and block-layer overhead rather than compression; much
/// larger requests would hide per-page costs a real swap-out/swap-in pays
/// (swap I/O is issued in small batches). 16 pages keeps the fixed per-syscall
/// cost to a few percent of the per-page compress/decompress work while still
/// looking like swap traffic. zram handles each bio page by page either way.
pub const CHUNK_BYTES: usize = 16 * PAGE_SIZE;

/// Extra bytes added to `disksize` beyond the (page-rounded) data size.
const DISKSIZE_SLACK: u64 = 1 << 20;

/// How long [`bench()`] / [`check_available`] wait for another tmem process that
/// is benchmarking the same device.
const LOCK_TIMEOUT: Duration = Duration::from_secs(300);

/// How long to keep retrying `reset` while something briefly holds the device
/// open (e.g. udev's blkid probe after we close it).
const RESET_TIMEOUT: Duration = Duration::from_secs(5);

/// Memory statistics from `/sys/block/zramN/mm_stat`.
///
/// The first five fields are bytes; `same_pages`, `pages_compacted` and
/// `huge_pages` are page counts.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ZramMmStat {
    /// Uncompressed size of the data stored (bytes), including same-filled pages.
    pub orig_data_size: u64,
    /// Compressed size of the data stored (bytes).
    pub compr_data_size: u64,
    /// Memory allocated by the allocator for compressed data, including
    /// fragmentation and metadata overhead (bytes). This is the real cost.
    pub mem_used_total: u64,
    /// Memory limit (bytes, 0 = none).
    pub mem_limit: u64,
    /// High-water mark of `mem_used_total` (bytes).
    pub mem_used_max: u64,
    /// Pages that were same-filled (every machine word equal) and stored without
    /// allocating memory.
    pub same_pages: u64,
    /// Pages freed by compaction.
    pub pages_compacted: u64,
    /// Incompressible pages stored uncompressed.
    pub huge_pages: u64,
}

impl ZramMmStat {
    /// Parses the content of `mm_stat`. At least eight whitespace-separated
    /// unsigned integers are required; extra trailing fields (newer kernels add
    /// e.g. `huge_pages_since`) are ignored.
    pub fn parse(text: &str) -> Result<Self, ZramError> {
        let err = |reason: String| ZramError::Parse { what: "mm_stat", reason, input: text.to_owned() };
        let mut values = [0_u64; 8];
        let mut fields = text.split_whitespace();
        for (i, slot) in values.iter_mut().enumerate() {
            let field = fields.next().ok_or_else(|| err(format!("expected at least 8 fields, found {i}")))?;
            *slot = field.parse().map_err(|e| err(format!("field {} ({field:?}): {e}", i + 1)))?;
        }
        let [orig_data_size, compr_data_size, mem_used_total, mem_limit, mem_used_max, same_pages, pages_compacted, huge_pages] =
            values;
        Ok(Self {
            orig_data_size,
            compr_data_size,
            mem_used_total,
            mem_limit,
            mem_used_max,
            same_pages,
            pages_compacted,
            huge_pages,
        })
    }
}

impl FromStr for ZramMmStat {
    type Err = ZramError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// Result of one [`bench()`] run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ZramRun {
    /// Compression algorithm used.
    pub algorithm: String,
    /// Number of 4 KiB pages stored.
    pub pages: u64,
    /// `mm_stat` right after the single-threaded write (+fsync).
    pub mm_stat: ZramMmStat,
    /// Seconds to write all pages (and fsync) from one thread.
    pub put_secs_1t: f64,
    /// Seconds to read all pages back from one thread (verification excluded).
    pub get_secs_1t: f64,
    /// Seconds to write all pages (and fsync) with `threads` threads.
    pub put_secs_mt: f64,
    /// Seconds to read all pages back with `threads` threads (verification excluded).
    pub get_secs_mt: f64,
    /// Threads used for the `_mt` figures.
    pub threads: usize,
}

impl ZramRun {
    /// Bytes of page data stored (`pages * 4096`).
    #[must_use]
    pub fn bytes(&self) -> u64 {
        self.pages.saturating_mul(u64_from(PAGE_SIZE))
    }

    /// Memory-saving ratio: `orig_data_size / mem_used_total` (∞ if nothing was allocated).
    #[must_use]
    pub fn ratio(&self) -> f64 {
        self.mm_stat.orig_data_size as f64 / self.mm_stat.mem_used_total as f64
    }

    /// Throughput in MB/s (10^6 bytes per second) for a phase that took `secs`.
    #[must_use]
    pub fn mb_per_sec(&self, secs: f64) -> f64 {
        self.bytes() as f64 / secs / 1e6
    }
}

/// Everything that can go wrong while benchmarking zram.
#[derive(Debug, thiserror::Error)]
pub enum ZramError {
    /// The device name is not of the form `zramN`.
    #[error("invalid zram device name {0:?}: expected \"zramN\", e.g. \"zram0\"")]
    InvalidDevice(String),
    /// [`check_available`] refused the device.
    #[error("zram device unavailable: {0}")]
    Unavailable(String),
    /// Bad arguments to [`bench()`].
    #[error("invalid benchmark input: {0}")]
    InvalidInput(String),
    /// The kernel does not offer the requested compression algorithm.
    #[error("compression algorithm {algorithm:?} is not supported by {dev} (available: {})", available.join(", "))]
    UnknownAlgorithm { dev: String, algorithm: String, available: Vec<String> },
    /// Reading a sysfs attribute failed.
    #[error("cannot read {}: {source}", path.display())]
    SysfsRead { path: PathBuf, source: io::Error },
    /// Writing a sysfs attribute failed.
    #[error("cannot write {value:?} to {}: {source}", path.display())]
    SysfsWrite { path: PathBuf, value: String, source: io::Error },
    /// A sysfs attribute had unexpected content.
    #[error("cannot parse {what}: {reason} (content: {input:?})")]
    Parse { what: &'static str, reason: String, input: String },
    /// The device node could not be opened.
    #[error("cannot open {} (read/write, O_DIRECT): {source}", path.display())]
    Open { path: PathBuf, source: io::Error },
    /// A `pwrite` to the device failed.
    #[error("writing {len} bytes at offset {offset} to {} failed: {source}", path.display())]
    Write { path: PathBuf, offset: u64, len: usize, source: io::Error },
    /// A `pread` from the device failed.
    #[error("reading {len} bytes at offset {offset} from {} failed: {source}", path.display())]
    Read { path: PathBuf, offset: u64, len: usize, source: io::Error },
    /// `fsync` of the device failed.
    #[error("fsync of {} failed: {source}", path.display())]
    Fsync { path: PathBuf, source: io::Error },
    /// Data read back differs from what was written.
    #[error("verification failed: data read back from zram differs from the data written, first difference at byte offset {offset}")]
    Mismatch { offset: u64 },
    /// The serialisation lock file could not be created or locked.
    #[error("cannot lock {} (serialises tmem zram benchmarks): {source}", path.display())]
    Lock { path: PathBuf, source: io::Error },
    /// Another tmem process kept the device busy for too long.
    #[error("timed out after {}s waiting for {}: another tmem process is benchmarking this zram device", waited.as_secs(), path.display())]
    LockTimeout { path: PathBuf, waited: Duration },
    /// A worker thread could not be spawned.
    #[error("cannot spawn benchmark worker thread: {0}")]
    Spawn(io::Error),
    /// A worker thread panicked.
    #[error("a benchmark worker thread panicked during the {phase} phase")]
    WorkerPanicked { phase: &'static str },
    /// After restoring, the device state is not what it was before.
    #[error("device state after restore differs from the original: {0}")]
    NotRestored(String),
    /// The device could not be put back the way it was found.
    #[error(
        "{dev} could not be restored to its original state: {source}{}; \
         restore it by hand: echo 1 > /sys/block/{dev}/reset; echo {algorithm} > /sys/block/{dev}/comp_algorithm",
        earlier.as_ref().map(|e| format!(" (the benchmark had already failed: {e})")).unwrap_or_default()
    )]
    Restore { dev: String, algorithm: String, source: Box<ZramError>, earlier: Option<Box<ZramError>> },
}

/// Checks whether `dev` (e.g. `"zram0"`) can be used by [`bench()`].
///
/// Returns `Ok(())` when `/dev/<dev>` exists, we are root and the device is idle
/// (`initstate` 0, `disksize` 0, not swap, not mounted, no holders). Otherwise
/// returns a human-readable reason; the caller prints it and skips zram.
///
/// If another tmem process is benchmarking the device right now (it holds the
/// tmem lock), this waits for it to finish (up to 5 minutes) before checking.
pub fn check_available(dev: &str) -> Result<(), String> {
    validate_dev(dev).map_err(|e| e.to_string())?;
    check_present(dev)?;
    let _lock = lock_device(dev, LOCK_TIMEOUT).map_err(|e| e.to_string())?;
    check_idle(dev)
}

/// Compression algorithms offered by `dev`, from `comp_algorithm`
/// (e.g. `["lzo-rle", "lzo", "lz4"]`). Does not need root.
pub fn algorithms(dev: &str) -> Result<Vec<String>, ZramError> {
    validate_dev(dev)?;
    Ok(read_comp_algorithm(dev)?.0)
}

/// The currently selected compression algorithm of `dev` (the bracketed entry
/// of `comp_algorithm`).
pub fn current_algorithm(dev: &str) -> Result<String, ZramError> {
    validate_dev(dev)?;
    Ok(read_comp_algorithm(dev)?.1)
}

/// Current `disksize` of `dev` in bytes (0 = not initialised).
pub fn disksize(dev: &str) -> Result<u64, ZramError> {
    validate_dev(dev)?;
    read_u64_attr(dev, "disksize")
}

/// Current `mm_stat` of `dev`.
pub fn mm_stat(dev: &str) -> Result<ZramMmStat, ZramError> {
    validate_dev(dev)?;
    ZramMmStat::parse(&read_attr(dev, "mm_stat")?)
}

/// Parses `comp_algorithm` content such as `"lzo [lz4] zstd\n"` into
/// `(available, current)`.
pub fn parse_comp_algorithm(text: &str) -> Result<(Vec<String>, String), ZramError> {
    let err =
        |reason: &str| ZramError::Parse { what: "comp_algorithm", reason: reason.to_owned(), input: text.to_owned() };
    let mut available = Vec::new();
    let mut current = None;
    for word in text.split_whitespace() {
        if let Some(name) = word.strip_prefix('[').and_then(|w| w.strip_suffix(']')) {
            if name.is_empty() {
                return Err(err("empty bracketed entry"));
            }
            if current.replace(name.to_owned()).is_some() {
                return Err(err("more than one selected ([bracketed]) algorithm"));
            }
            available.push(name.to_owned());
        } else if word.contains(['[', ']']) {
            return Err(err("unbalanced brackets"));
        } else {
            available.push(word.to_owned());
        }
    }
    let current = current.ok_or_else(|| err("no selected ([bracketed]) algorithm"))?;
    Ok((available, current))
}

/// Benchmarks zram on `data` (a whole number of 4 KiB pages) with `algorithm`.
///
/// 1. Reset the device, select `algorithm`, set `disksize` to the data size plus
///    1 MiB, open `/dev/<dev>` with `O_DIRECT`.
/// 2. Single thread: write all pages with `pwrite` in [`CHUNK_BYTES`] requests,
///    `fsync` (timed: `put_secs_1t`); read `mm_stat` (the memory figures); read
///    everything back with `pread` (timed: `get_secs_1t`), then verify every byte.
/// 3. Reset and reconfigure; `threads` threads each write a disjoint contiguous
///    range (timed incl. `fsync`: `put_secs_mt`), then read their ranges back
///    (timed: `get_secs_mt`), then verify every byte.
/// 4. Reset the device and restore the original `comp_algorithm` and `mem_limit`.
///    This also happens on error and on panic (drop guard).
///
/// The data is copied once, outside the timed regions, into a page-aligned
/// buffer (`O_DIRECT` needs aligned buffers), so the kernel reads the pages
/// straight from user memory, as the userspace store does. Read-back lands in
/// that same buffer after it has been poisoned (every page's bytes set to the
/// complement of the expected first byte) and is compared against `data` itself.
pub fn bench(dev: &str, data: &[u8], algorithm: &str, threads: usize) -> Result<ZramRun, ZramError> {
    bench_with_hook(dev, data, algorithm, threads, &|_| {})
}

/// Phase-boundary callback, used by tests to inject failures.
type Hook<'a> = &'a (dyn Fn(&'static str) + Sync);

fn bench_with_hook(
    dev: &str,
    data: &[u8],
    algorithm: &str,
    threads: usize,
    hook: Hook<'_>,
) -> Result<ZramRun, ZramError> {
    validate_dev(dev)?;
    if data.is_empty() || !data.len().is_multiple_of(PAGE_SIZE) {
        return Err(ZramError::InvalidInput(format!(
            "data length {} is not a positive multiple of the page size {PAGE_SIZE}",
            data.len()
        )));
    }
    if threads == 0 {
        return Err(ZramError::InvalidInput("threads must be at least 1".into()));
    }
    check_present(dev).map_err(ZramError::Unavailable)?;
    // Declared before the guard, so it is released only after the guard restored the device.
    let _lock = lock_device(dev, LOCK_TIMEOUT)?;
    check_idle(dev).map_err(ZramError::Unavailable)?;

    let (available, original_algorithm) = read_comp_algorithm(dev)?;
    if !available.iter().any(|a| a == algorithm) {
        return Err(ZramError::UnknownAlgorithm { dev: dev.to_owned(), algorithm: algorithm.to_owned(), available });
    }
    let original_mem_limit = ZramMmStat::parse(&read_attr(dev, "mm_stat")?)?.mem_limit;

    let guard = RestoreGuard { dev, algorithm: original_algorithm, mem_limit: original_mem_limit, armed: true };
    let result = run(dev, data, algorithm, threads, hook);
    guard.finish(result)
}

/// The benchmark proper; the device is restored by the caller's guard.
fn run(dev: &str, data: &[u8], algorithm: &str, threads: usize, hook: Hook<'_>) -> Result<ZramRun, ZramError> {
    let path = dev_node(dev);
    let size = u64_from(data.len());
    let disksize = size + DISKSIZE_SLACK;
    let mut buf = AlignedBuf::new(data.len());
    buf.as_mut_slice().copy_from_slice(data);

    // --- single thread ---
    configure(dev, algorithm, disksize)?;
    hook("configured");
    let file = open_direct(&path)?;
    let start = Instant::now();
    write_range(&file, &path, buf.as_slice(), 0)?;
    fsync(&file, &path)?;
    let put_secs_1t = start.elapsed().as_secs_f64();
    hook("written");
    let mm_stat = ZramMmStat::parse(&read_attr(dev, "mm_stat")?)?;

    poison(buf.as_mut_slice(), data);
    let start = Instant::now();
    read_range(&file, &path, buf.as_mut_slice(), 0)?;
    let get_secs_1t = start.elapsed().as_secs_f64();
    verify(data, buf.as_slice())?;
    hook("verified");
    drop(file);

    // --- multiple threads ---
    // `buf` holds exactly `data` again (just verified), so it is the write source.
    configure(dev, algorithm, disksize)?;
    let file = open_direct(&path)?;
    let ranges = split_pages(data.len() / PAGE_SIZE, threads);

    let src = buf.as_slice();
    let items = ranges.iter().map(|&(first, n)| (first, &src[first * PAGE_SIZE..(first + n) * PAGE_SIZE])).collect();
    let start = run_parallel("multi-thread write", items, |(first, bytes)| {
        hook("mt-write");
        write_range(&file, &path, bytes, u64_from(first * PAGE_SIZE))
    })?;
    fsync(&file, &path)?;
    let put_secs_mt = start.elapsed().as_secs_f64();

    poison(buf.as_mut_slice(), data);
    let mut items = Vec::with_capacity(ranges.len());
    let mut rest = buf.as_mut_slice();
    for &(first, n) in &ranges {
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(n * PAGE_SIZE);
        items.push((first, head));
        rest = tail;
    }
    let start = run_parallel("multi-thread read", items, |(first, bytes)| {
        hook("mt-read");
        read_range(&file, &path, bytes, u64_from(first * PAGE_SIZE))
    })?;
    let get_secs_mt = start.elapsed().as_secs_f64();
    verify(data, buf.as_slice())?;
    drop(file);

    Ok(ZramRun {
        algorithm: algorithm.to_owned(),
        pages: u64_from(data.len() / PAGE_SIZE),
        mm_stat,
        put_secs_1t,
        get_secs_1t,
        put_secs_mt,
        get_secs_mt,
        threads,
    })
}

/// Runs `work` on every item in its own thread. All threads are released at
/// once through a gate; returns the instant the gate opened. The caller stops
/// the clock after this returns (all workers joined).
fn run_parallel<T, F>(phase: &'static str, items: Vec<T>, work: F) -> Result<Instant, ZramError>
where
    T: Send,
    F: Fn(T) -> Result<(), ZramError> + Sync,
{
    // Workers block on `read()` until the main thread drops its write guard. If
    // the main thread panicked meanwhile the lock is poisoned and workers quit.
    let gate = RwLock::new(());
    let abort = AtomicBool::new(false);
    thread::scope(|scope| {
        let held = gate.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut handles = Vec::with_capacity(items.len());
        let mut spawn_error = None;
        for (i, item) in items.into_iter().enumerate() {
            let (gate, abort, work) = (&gate, &abort, &work);
            let spawned = thread::Builder::new().name(format!("tmem-zram-{i}")).spawn_scoped(scope, move || {
                let opened = gate.read().is_ok();
                if !opened || abort.load(Ordering::Acquire) {
                    return Ok(());
                }
                work(item)
            });
            match spawned {
                Ok(handle) => handles.push(handle),
                Err(e) => {
                    spawn_error = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = spawn_error {
            abort.store(true, Ordering::Release);
            drop(held);
            for handle in handles {
                // Workers return immediately after seeing `abort`; ignore their result.
                let _ = handle.join();
            }
            return Err(ZramError::Spawn(e));
        }
        let start = Instant::now();
        drop(held);
        let mut first_error = None;
        for handle in handles {
            let result = handle.join().unwrap_or(Err(ZramError::WorkerPanicked { phase }));
            if let Err(e) = result {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(start), Err)
    })
}

/// Splits `pages` into at most `threads` contiguous, non-empty
/// `(first_page, page_count)` ranges of near-equal size.
fn split_pages(pages: usize, threads: usize) -> Vec<(usize, usize)> {
    let threads = threads.max(1);
    let (base, extra) = (pages / threads, pages % threads);
    let mut first = 0;
    let mut ranges = Vec::with_capacity(threads);
    for i in 0..threads {
        let n = base + usize::from(i < extra);
        if n > 0 {
            ranges.push((first, n));
        }
        first += n;
    }
    ranges
}

/// Puts the device back the way [`bench()`] found it, also on early return or panic.
struct RestoreGuard<'a> {
    dev: &'a str,
    algorithm: String,
    mem_limit: u64,
    armed: bool,
}

impl RestoreGuard<'_> {
    fn restore(&self) -> Result<(), ZramError> {
        reset(self.dev)?;
        write_attr(self.dev, "comp_algorithm", &self.algorithm)?;
        if self.mem_limit != 0 {
            write_attr(self.dev, "mem_limit", &self.mem_limit.to_string())?;
        }
        let disksize = read_u64_attr(self.dev, "disksize")?;
        let (_, algorithm) = read_comp_algorithm(self.dev)?;
        if disksize != 0 || algorithm != self.algorithm {
            return Err(ZramError::NotRestored(format!(
                "expected disksize 0 and comp_algorithm {}, found disksize {disksize} and comp_algorithm {algorithm}",
                self.algorithm
            )));
        }
        Ok(())
    }

    /// Restores now (normal path) and combines the outcome with the benchmark result.
    fn finish<T>(mut self, result: Result<T, ZramError>) -> Result<T, ZramError> {
        self.armed = false;
        match (result, self.restore()) {
            (result, Ok(())) => result,
            (result, Err(source)) => Err(ZramError::Restore {
                dev: self.dev.to_owned(),
                algorithm: self.algorithm.clone(),
                source: Box::new(source),
                earlier: result.err().map(Box::new),
            }),
        }
    }
}

impl Drop for RestoreGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            // Only reached while unwinding from a panic: there is no caller to
            // return an error to, so report on stderr.
            if let Err(e) = self.restore() {
                eprintln!(
                    "tmem-sys: WARNING: could not restore {} after a panic: {e}; \
                     run `echo 1 > /sys/block/{}/reset` by hand",
                    self.dev, self.dev
                );
            }
        }
    }
}

/// Page-aligned byte buffer for `O_DIRECT`, without `unsafe`: an over-allocated
/// `Vec` viewed at its first page-aligned offset.
struct AlignedBuf {
    storage: Vec<u8>,
    offset: usize,
    len: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> Self {
        let storage = vec![0_u8; len + PAGE_SIZE];
        let addr = storage.as_ptr().addr();
        let offset = (PAGE_SIZE - addr % PAGE_SIZE) % PAGE_SIZE;
        Self { storage, offset, len }
    }

    fn as_slice(&self) -> &[u8] {
        &self.storage[self.offset..self.offset + self.len]
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.storage[self.offset..self.offset + self.len]
    }
}

/// Overwrites `buf` so that every page differs from the expected page in
/// `data` (each page is filled with the complement of its expected first
/// byte), so a read that silently transfers nothing cannot pass verification.
fn poison(buf: &mut [u8], data: &[u8]) {
    for (dst, src) in buf.chunks_mut(PAGE_SIZE).zip(data.chunks(PAGE_SIZE)) {
        dst.fill(!src[0]);
    }
}

/// Compares `got` with `want`, reporting the first differing byte offset.
fn verify(want: &[u8], got: &[u8]) -> Result<(), ZramError> {
    for (i, (w, g)) in want.chunks(CHUNK_BYTES).zip(got.chunks(CHUNK_BYTES)).enumerate() {
        if w != g {
            let within = w.iter().zip(g).position(|(a, b)| a != b).unwrap_or(0);
            return Err(ZramError::Mismatch { offset: u64_from(i * CHUNK_BYTES + within) });
        }
    }
    if want.len() != got.len() {
        return Err(ZramError::Mismatch { offset: u64_from(want.len().min(got.len())) });
    }
    Ok(())
}

/// Writes `bytes` at device offset `base` in [`CHUNK_BYTES`] `pwrite`s.
fn write_range(file: &File, path: &Path, bytes: &[u8], base: u64) -> Result<(), ZramError> {
    let mut offset = base;
    for chunk in bytes.chunks(CHUNK_BYTES) {
        file.write_all_at(chunk, offset).map_err(|source| ZramError::Write {
            path: path.to_owned(),
            offset,
            len: chunk.len(),
            source,
        })?;
        offset += u64_from(chunk.len());
    }
    Ok(())
}

/// Fills `bytes` from device offset `base` with [`CHUNK_BYTES`] `pread`s.
fn read_range(file: &File, path: &Path, bytes: &mut [u8], base: u64) -> Result<(), ZramError> {
    let mut offset = base;
    for chunk in bytes.chunks_mut(CHUNK_BYTES) {
        let len = chunk.len();
        file.read_exact_at(chunk, offset).map_err(|source| ZramError::Read {
            path: path.to_owned(),
            offset,
            len,
            source,
        })?;
        offset += u64_from(len);
    }
    Ok(())
}

fn fsync(file: &File, path: &Path) -> Result<(), ZramError> {
    file.sync_all().map_err(|source| ZramError::Fsync { path: path.to_owned(), source })
}

fn open_direct(path: &Path) -> Result<File, ZramError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(|source| ZramError::Open { path: path.to_owned(), source })
}

/// Reset, select `algorithm`, set `disksize` (initialises the device).
fn configure(dev: &str, algorithm: &str, disksize: u64) -> Result<(), ZramError> {
    reset(dev)?;
    write_attr(dev, "comp_algorithm", algorithm)?;
    write_attr(dev, "disksize", &disksize.to_string())
}

/// `echo 1 > reset`, retrying for a while on `EBUSY` (something such as a
/// udev/blkid probe may hold the device open for a moment).
fn reset(dev: &str) -> Result<(), ZramError> {
    let deadline = Instant::now() + RESET_TIMEOUT;
    let mut pause = Duration::from_millis(5);
    loop {
        match write_attr(dev, "reset", "1") {
            Err(ZramError::SysfsWrite { source, .. })
                if source.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline =>
            {
                thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(200));
            }
            other => return other,
        }
    }
}

/// Presence and permission checks that do not need the lock.
fn check_present(dev: &str) -> Result<(), String> {
    let sys = sysfs_dir(dev);
    if !sys.is_dir() {
        return Err(format!("{} does not exist (zram module not loaded? try `modprobe zram`)", sys.display()));
    }
    let node = dev_node(dev);
    match std::fs::metadata(&node) {
        Ok(meta) if meta.file_type().is_block_device() => {}
        Ok(_) => return Err(format!("{} is not a block device", node.display())),
        Err(e) => return Err(format!("cannot access {}: {e}", node.display())),
    }
    if !crate::is_root() {
        return Err(format!("configuring {dev} requires root (run as root or via sudo)"));
    }
    Ok(())
}

/// Idle checks; the caller holds the lock.
fn check_idle(dev: &str) -> Result<(), String> {
    let text = |e: ZramError| e.to_string();
    let node = dev_node(dev);
    let node = node.to_string_lossy();
    let swaps = std::fs::read_to_string("/proc/swaps").unwrap_or_default();
    if swaps.lines().skip(1).any(|l| l.split_whitespace().next() == Some(&*node)) {
        return Err(format!("{node} is in use as swap (/proc/swaps); refusing to touch it"));
    }
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    if let Some(line) = mounts.lines().find(|l| l.split_whitespace().next() == Some(&*node)) {
        let target = line.split_whitespace().nth(1).unwrap_or("?");
        return Err(format!("{node} is mounted on {target}; refusing to touch it"));
    }
    if let Ok(holders) = std::fs::read_dir(sysfs_dir(dev).join("holders")) {
        let names: Vec<String> =
            holders.filter_map(Result::ok).map(|e| e.file_name().to_string_lossy().into_owned()).collect();
        if !names.is_empty() {
            return Err(format!("{dev} is held by {}; refusing to touch it", names.join(", ")));
        }
    }
    let initstate = read_u64_attr(dev, "initstate").map_err(text)?;
    let disksize = read_u64_attr(dev, "disksize").map_err(text)?;
    if initstate != 0 || disksize != 0 {
        return Err(format!(
            "{dev} is already initialised (initstate {initstate}, disksize {disksize} bytes), \
             so something else is using it; refusing to touch it"
        ));
    }
    read_comp_algorithm(dev).map_err(text)?;
    Ok(())
}

/// Advisory lock serialising tmem processes on one zram device; released on drop.
struct DeviceLock {
    _file: File,
}

fn lock_path(dev: &str) -> PathBuf {
    let dir = Path::new("/run/lock");
    let dir = if dir.is_dir() { dir.to_owned() } else { std::env::temp_dir() };
    dir.join(format!("tmem-sys-{dev}.lock"))
}

fn lock_device(dev: &str, timeout: Duration) -> Result<DeviceLock, ZramError> {
    let path = lock_path(dev);
    let lock_err = |source| ZramError::Lock { path: path.clone(), source };
    let file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(lock_err)?;
    let start = Instant::now();
    loop {
        // SAFETY: `file` is an open file owned by this function and stays alive
        // for the whole call, so its descriptor is valid; flock(2) takes no
        // pointers and only changes the advisory lock state of that descriptor.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc == 0 {
            return Ok(DeviceLock { _file: file });
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EWOULDBLOCK) if start.elapsed() < timeout => {
                thread::sleep(Duration::from_millis(50));
            }
            Some(libc::EWOULDBLOCK) => return Err(ZramError::LockTimeout { path, waited: start.elapsed() }),
            Some(libc::EINTR) => {}
            _ => return Err(lock_err(e)),
        }
    }
}

fn validate_dev(dev: &str) -> Result<(), ZramError> {
    match dev.strip_prefix("zram") {
        Some(n) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => Ok(()),
        _ => Err(ZramError::InvalidDevice(dev.to_owned())),
    }
}

fn sysfs_dir(dev: &str) -> PathBuf {
    Path::new("/sys/block").join(dev)
}

fn dev_node(dev: &str) -> PathBuf {
    Path::new("/dev").join(dev)
}

fn read_attr(dev: &str, attr: &str) -> Result<String, ZramError> {
    let path = sysfs_dir(dev).join(attr);
    std::fs::read_to_string(&path).map_err(|source| ZramError::SysfsRead { path, source })
}

fn write_attr(dev: &str, attr: &str, value: &str) -> Result<(), ZramError> {
    let path = sysfs_dir(dev).join(attr);
    std::fs::write(&path, value).map_err(|source| ZramError::SysfsWrite { path, value: value.to_owned(), source })
}

fn read_u64_attr(dev: &str, attr: &'static str) -> Result<u64, ZramError> {
    let text = read_attr(dev, attr)?;
    text.trim().parse().map_err(|e| ZramError::Parse { what: attr, reason: format!("{e}"), input: text.clone() })
}

fn read_comp_algorithm(dev: &str) -> Result<(Vec<String>, String), ZramError> {
    parse_comp_algorithm(&read_attr(dev, "comp_algorithm")?)
}

fn u64_from(n: usize) -> u64 {
    // usize is at most 64 bits on every target Rust supports for Linux.
    u64::try_from(n).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests;
