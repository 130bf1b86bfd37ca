//! The kernel side of `tmem bench store`: [`bench()`] stores a
//! caller-supplied set of 4 KiB pages in a zram device hot-added for the run
//! ([`ZramDevice`]) with a chosen compression algorithm, reads them back,
//! verifies every byte, and reports timings, the CPU time used and the
//! device's `mm_stat` memory figures, so the userspace store can be compared
//! with the kernel on the *same* pages.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{OnceLock, RwLock};
use std::thread;
use std::time::{Duration, Instant};

use tmem_sys::vmstat::{CpuMark, CpuSpent};
pub use tmem_sys::zram::{current_algorithm, disksize, probe, ZramDevice, ZramError, ZramMmStat, PAGE_SIZE};

/// Bytes transferred per `pwrite`/`pread` system call.
///
/// 64 KiB = 16 pages per syscall. One page per syscall would make the benchmark
/// measure mostly syscall and block-layer overhead rather than compression; much
/// larger requests would hide per-page costs a real swap-out/swap-in pays
/// (swap I/O is issued in small batches). 16 pages keeps the fixed per-syscall
/// cost to a few percent of the per-page compress/decompress work while still
/// looking like swap traffic. zram handles each bio page by page either way.
pub const CHUNK_BYTES: usize = 16 * PAGE_SIZE;

/// A timed figure moves at least this much data, or runs at least [`MIN_TIMED`].
pub const MIN_TIMED_BYTES: u64 = 64 << 20;

/// A timed figure runs at least this long, or moves at least [`MIN_TIMED_BYTES`].
pub const MIN_TIMED: Duration = Duration::from_millis(200);

/// Extra bytes added to `disksize` beyond the (page-rounded) data size.
const DISKSIZE_SLACK: u64 = 1 << 20;

/// How much work a timed figure needs: a section repeats its pages until it
/// has moved at least [`MIN_TIMED_BYTES`] or lasted at least [`MIN_TIMED`],
/// whichever comes first, so that no figure is timed over a few microseconds
/// of work. Threads working in one section share one budget.
#[derive(Debug, Default)]
pub struct Budget {
    start: OnceLock<Instant>,
    bytes: AtomicU64,
}

impl Budget {
    /// A budget whose clock has not started.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts the clock; only the first call (of any thread) counts.
    pub fn begin(&self) {
        self.start.get_or_init(Instant::now);
    }

    /// Counts `bytes` more done; `true` once the section has done enough.
    pub fn add(&self, bytes: u64) -> bool {
        let total = self.bytes.fetch_add(bytes, Ordering::Relaxed).saturating_add(bytes);
        total >= MIN_TIMED_BYTES || self.start.get().is_some_and(|s| s.elapsed() >= MIN_TIMED)
    }

    /// Whether `bytes` moved in `secs` seconds is enough work for a figure.
    #[must_use]
    pub fn enough(bytes: u64, secs: f64) -> bool {
        bytes > 0 && secs > 0.0 && (bytes >= MIN_TIMED_BYTES || secs >= MIN_TIMED.as_secs_f64())
    }

    /// Copies of `len` bytes that together reach [`MIN_TIMED_BYTES`] (at least 1).
    #[must_use]
    pub fn copies_for(len: usize) -> usize {
        usize::try_from(MIN_TIMED_BYTES).unwrap_or(usize::MAX).div_ceil(len.max(1)).max(1)
    }

    /// Why a figure is not given, for legends.
    #[must_use]
    pub fn reason() -> String {
        format!("timed over less than {} MiB and {} ms", MIN_TIMED_BYTES >> 20, MIN_TIMED.as_millis())
    }
}

/// One timed figure (of a [`bench()`] run, or of the userspace store's
/// benchmark, which times its figures the same way).
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct TimedPhase {
    /// Pages moved in the timed section (the data, repeated as needed).
    pub pages: u64,
    /// Wall seconds of the section.
    pub secs: f64,
    /// CPU used over the section: this process's user + system time (zram
    /// compresses and decompresses in the system time of the threads that
    /// write and read), and the whole machine's busy time.
    pub cpu: CpuSpent,
}

impl TimedPhase {
    /// Bytes moved.
    #[must_use]
    pub fn bytes(&self) -> u64 {
        self.pages.saturating_mul(u64_from(PAGE_SIZE))
    }

    fn enough(&self) -> bool {
        Budget::enough(self.bytes(), self.secs)
    }

    /// Throughput in MB/s (10^6 bytes per second); `None` where the section
    /// did too little work for the figure to mean anything ([`Budget::enough`]).
    #[must_use]
    pub fn mb_per_sec(&self) -> Option<f64> {
        self.enough().then(|| self.bytes() as f64 / self.secs / 1e6)
    }

    /// CPU time of this process (user + system, all threads) per page, µs;
    /// `None` as for [`Self::mb_per_sec`].
    #[must_use]
    pub fn cpu_us_per_page(&self) -> Option<f64> {
        self.enough().then(|| self.cpu.process.total_secs() * 1e6 / self.pages as f64)
    }

    /// Busy CPU time of the whole machine per page, µs (other load on the
    /// machine included); `None` as for [`Self::mb_per_sec`], or where
    /// `/proc/stat` could not be read.
    #[must_use]
    pub fn machine_busy_us_per_page(&self) -> Option<f64> {
        self.cpu.machine_busy_secs.filter(|_| self.enough()).map(|s| s * 1e6 / self.pages as f64)
    }
}

/// Result of one [`bench()`] run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ZramRun {
    /// The hot-added device it ran on (removed again since).
    pub device: String,
    /// Compression algorithm used.
    pub algorithm: String,
    /// Number of 4 KiB pages of the data.
    pub pages: u64,
    /// `mm_stat` right after writing the data once (+fsync).
    pub mm_stat: ZramMmStat,
    /// Writing (and fsync) from one thread.
    pub put_1t: TimedPhase,
    /// Reading back from one thread (verification excluded).
    pub get_1t: TimedPhase,
    /// Writing (and fsync) with `threads` threads on disjoint ranges.
    pub put_mt: TimedPhase,
    /// Reading back with `threads` threads (verification excluded).
    pub get_mt: TimedPhase,
    /// Threads used for the `_mt` figures.
    pub threads: usize,
}

impl ZramRun {
    /// Bytes of page data (`pages * 4096`).
    #[must_use]
    pub fn bytes(&self) -> u64 {
        self.pages.saturating_mul(u64_from(PAGE_SIZE))
    }

    /// Memory-saving ratio: `orig_data_size / mem_used_total` (∞ if nothing was allocated).
    #[must_use]
    pub fn ratio(&self) -> f64 {
        self.mm_stat.orig_data_size as f64 / self.mm_stat.mem_used_total as f64
    }
}

/// Benchmarks zram on `data` (a whole number of 4 KiB pages) with `algorithm`,
/// on a device hot-added for the run and removed afterwards (also on error
/// and on panic).
///
/// 1. Memory: select `algorithm`, set `disksize`, write the data once with
///    `pwrite` in [`CHUNK_BYTES`] requests through `O_DIRECT`, `fsync`, read
///    `mm_stat` (the memory figures).
/// 2. One thread, on a reset device: write copies of the data one after the
///    other (`put_1t`) until the section has moved [`MIN_TIMED_BYTES`] or
///    lasted [`MIN_TIMED`], `fsync`; then read the copies back, round and
///    round, until the same holds (`get_1t`); verify every byte read.
/// 3. The same with `threads` threads on disjoint page ranges of each copy
///    (`put_mt`, `get_mt`).
///
/// Every figure comes with the CPU time this process used over it (user +
/// system: zram compresses in the writing threads' system time, and
/// decompresses in the reading threads') and the machine's busy time.
///
/// The data is copied, outside the timed regions, into a page-aligned buffer
/// (`O_DIRECT` needs aligned buffers), so the kernel reads the pages straight
/// from user memory, as the userspace store does. Read-back lands in that
/// same buffer after it has been poisoned (every page's bytes set to the
/// complement of the expected first byte) and is compared against `data`.
pub fn bench(data: &[u8], algorithm: &str, threads: usize) -> Result<ZramRun, ZramError> {
    bench_with_hook(data, algorithm, threads, &|_, _| {})
}

/// Phase-boundary callback (phase, device name), used by tests to inject failures.
type Hook<'a> = &'a (dyn Fn(&'static str, &str) + Sync);

fn bench_with_hook(data: &[u8], algorithm: &str, threads: usize, hook: Hook<'_>) -> Result<ZramRun, ZramError> {
    if data.is_empty() || !data.len().is_multiple_of(PAGE_SIZE) {
        return Err(ZramError::InvalidInput(format!(
            "data length {} is not a positive multiple of the page size {PAGE_SIZE}",
            data.len()
        )));
    }
    if threads == 0 {
        return Err(ZramError::InvalidInput("threads must be at least 1".into()));
    }
    let dev = ZramDevice::hot_add()?;
    let result = run(&dev, data, algorithm, threads, hook);
    let (name, id) = (dev.name().to_owned(), dev.id());
    match dev.remove() {
        Ok(()) => result,
        Err(source) => {
            Err(ZramError::Remove { dev: name, id, source: Box::new(source), earlier: result.err().map(Box::new) })
        }
    }
}

/// The benchmark proper, on `dev`, which the caller removes.
fn run(dev: &ZramDevice, data: &[u8], algorithm: &str, threads: usize, hook: Hook<'_>) -> Result<ZramRun, ZramError> {
    let name = dev.name();
    let path = dev.node();
    let len = data.len();
    let pages = len / PAGE_SIZE;
    let copies = Budget::copies_for(len);
    let mut buf = AlignedBuf::new(copies * len);
    let fill = |buf: &mut AlignedBuf| buf.as_mut_slice().chunks_mut(len).for_each(|c| c.copy_from_slice(data));
    fill(&mut buf);

    // --- memory: the data once ---
    dev.configure(algorithm, u64_from(len) + DISKSIZE_SLACK)?;
    hook("configured", name);
    let file = open_direct(&path)?;
    write_range(&file, &path, &buf.as_slice()[..len], 0)?;
    fsync(&file, &path)?;
    hook("written", name);
    let mm_stat = dev.mm_stat()?;
    drop(file);

    // --- one thread ---
    let disksize = u64_from(copies * len) + DISKSIZE_SLACK;
    dev.configure(algorithm, disksize)?;
    let file = open_direct(&path)?;
    let budget = Budget::new();
    budget.begin();
    let (mark, start) = (CpuMark::now(), Instant::now());
    let mut written = 0;
    loop {
        let off = written * len;
        write_range(&file, &path, &buf.as_slice()[off..off + len], u64_from(off))?;
        written += 1;
        if written == copies || budget.add(u64_from(len)) {
            break;
        }
    }
    fsync(&file, &path)?;
    let put_1t = phase(written * pages, start, &mark);

    for copy in buf.as_mut_slice()[..written * len].chunks_mut(len) {
        poison(copy, data);
    }
    let budget = Budget::new();
    budget.begin();
    let (mark, start) = (CpuMark::now(), Instant::now());
    let mut reads = 0;
    loop {
        let off = (reads % written) * len;
        read_range(&file, &path, &mut buf.as_mut_slice()[off..off + len], u64_from(off))?;
        reads += 1;
        if budget.add(u64_from(len)) {
            break;
        }
    }
    let get_1t = phase(reads * pages, start, &mark);
    for (c, copy) in buf.as_slice()[..reads.min(written) * len].chunks(len).enumerate() {
        verify_at(data, copy, c * len)?;
    }
    hook("verified", name);
    drop(file);

    // --- multiple threads ---
    fill(&mut buf);
    dev.configure(algorithm, disksize)?;
    let file = open_direct(&path)?;
    let ranges = split_pages(pages, threads);

    let src = buf.as_slice();
    let budget = Budget::new();
    let mark = CpuMark::now();
    let (start, written_by) = run_parallel("multi-thread write", ranges.clone(), |(first, n)| {
        budget.begin();
        hook("mt-write", name);
        let mut done = 0;
        loop {
            let off = done * len + first * PAGE_SIZE;
            write_range(&file, &path, &src[off..off + n * PAGE_SIZE], u64_from(off))?;
            done += 1;
            if done == copies || budget.add(u64_from(n * PAGE_SIZE)) {
                return Ok(done);
            }
        }
    })?;
    fsync(&file, &path)?;
    let put_mt = phase(ranges.iter().zip(&written_by).map(|(&(_, n), w)| n * w).sum(), start, &mark);

    buf.as_mut_slice().chunks_mut(len).for_each(|copy| poison(copy, data));
    // Each thread reads its range of the copies it wrote, into the same place of the buffer.
    let mut mine: Vec<Vec<&mut [u8]>> = ranges.iter().map(|_| Vec::with_capacity(copies)).collect();
    for copy in buf.as_mut_slice().chunks_mut(len) {
        let mut rest = copy;
        for (slices, &(_, n)) in mine.iter_mut().zip(&ranges) {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(n * PAGE_SIZE);
            slices.push(head);
            rest = tail;
        }
    }
    let items: Vec<_> =
        ranges.iter().zip(&written_by).zip(mine).map(|((&(first, n), &w), s)| (first, n, w, s)).collect();
    let budget = Budget::new();
    let mark = CpuMark::now();
    let (start, reads_by) = run_parallel("multi-thread read", items, |(first, n, w, mut slices)| {
        budget.begin();
        hook("mt-read", name);
        let mut reads = 0;
        loop {
            let c = reads % w.max(1);
            read_range(&file, &path, &mut *slices[c], u64_from(c * len + first * PAGE_SIZE))?;
            reads += 1;
            if budget.add(u64_from(n * PAGE_SIZE)) {
                return Ok(reads);
            }
        }
    })?;
    let get_mt = phase(ranges.iter().zip(&reads_by).map(|(&(_, n), r)| n * r).sum(), start, &mark);
    let got = buf.as_slice();
    for ((&(first, n), &w), &r) in ranges.iter().zip(&written_by).zip(&reads_by) {
        let want = &data[first * PAGE_SIZE..(first + n) * PAGE_SIZE];
        for c in 0..r.min(w) {
            let off = c * len + first * PAGE_SIZE;
            verify_at(want, &got[off..off + n * PAGE_SIZE], off)?;
        }
    }
    drop(file);

    Ok(ZramRun {
        device: name.to_owned(),
        algorithm: algorithm.to_owned(),
        pages: u64_from(pages),
        mm_stat,
        put_1t,
        get_1t,
        put_mt,
        get_mt,
        threads,
    })
}

/// A timed section of `pages` pages that started at `start` and `mark`.
fn phase(pages: usize, start: Instant, mark: &CpuMark) -> TimedPhase {
    TimedPhase { pages: u64_from(pages), secs: start.elapsed().as_secs_f64(), cpu: mark.spent() }
}

/// Runs `work` on every item in its own thread. All threads are released at
/// once through a gate; returns the instant the gate opened and every
/// worker's result, in order. The caller stops the clock after this returns
/// (all workers joined).
fn run_parallel<T, R, F>(phase: &'static str, items: Vec<T>, work: F) -> Result<(Instant, Vec<R>), ZramError>
where
    T: Send,
    R: Send,
    F: Fn(T) -> Result<R, ZramError> + Sync,
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
                    return None;
                }
                Some(work(item))
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
        let mut results = Vec::with_capacity(handles.len());
        for handle in handles {
            match handle.join() {
                Ok(Some(Ok(r))) => results.push(r),
                Ok(Some(Err(e))) => {
                    first_error.get_or_insert(e);
                }
                Ok(None) | Err(_) => {
                    first_error.get_or_insert(ZramError::WorkerPanicked { phase });
                }
            }
        }
        first_error.map_or(Ok((start, results)), Err)
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

/// [`verify`] of a part that starts at byte `base` of the buffer.
fn verify_at(want: &[u8], got: &[u8], base: usize) -> Result<(), ZramError> {
    verify(want, got).map_err(|e| match e {
        ZramError::Mismatch { offset } => ZramError::Mismatch { offset: offset + u64_from(base) },
        other => other,
    })
}

fn u64_from(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests;
