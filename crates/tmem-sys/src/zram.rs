//! zram: fresh devices of our own, and the benchmark harness (the kernel side
//! of `tmem bench store`).
//!
//! [`ZramDevice::hot_add`] creates a new device through
//! `/sys/class/zram-control/hot_add` (loading the zram module with
//! `num_devices=0` first where it is not loaded), so nothing here touches a
//! zram device someone else set up: a user's `zram0` stays as it is.
//! Dropping the [`ZramDevice`] (or [`ZramDevice::remove`]) removes it again
//! through `hot_remove`, which resets it and frees its memory; that happens
//! on error and on panic too, even in a worker thread. A process killed with
//! `SIGKILL` cannot run its destructors; then `echo N >
//! /sys/class/zram-control/hot_remove` removes `zramN` by hand.
//!
//! [`bench()`] stores a caller-supplied set of 4 KiB pages in such a device
//! with a chosen compression algorithm, reads them back, verifies every byte,
//! and reports timings, the CPU time used and the device's `mm_stat` memory
//! figures, so the userspace store can be compared with the kernel on the
//! *same* pages.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{OnceLock, RwLock};
use std::thread;
use std::time::{Duration, Instant};

use crate::vmstat::{CpuMark, CpuSpent};

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

/// A timed figure moves at least this much data, or runs at least [`MIN_TIMED`].
pub const MIN_TIMED_BYTES: u64 = 64 << 20;

/// A timed figure runs at least this long, or moves at least [`MIN_TIMED_BYTES`].
pub const MIN_TIMED: Duration = Duration::from_millis(200);

/// Extra bytes added to `disksize` beyond the (page-rounded) data size.
const DISKSIZE_SLACK: u64 = 1 << 20;

/// How long to keep retrying `reset` and `hot_remove` while something briefly
/// holds the device open (e.g. udev's blkid probe after we close it).
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a hot-added device may take to show up in sysfs and `/dev`.
const APPEAR_TIMEOUT: Duration = Duration::from_secs(5);

/// The zram control directory (`hot_add`, `hot_remove`).
const CONTROL_DIR: &str = "/sys/class/zram-control";

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

/// Everything that can go wrong with zram.
#[derive(Debug, thiserror::Error)]
pub enum ZramError {
    /// The device name is not of the form `zramN`.
    #[error("invalid zram device name {0:?}: expected \"zramN\", e.g. \"zram0\"")]
    InvalidDevice(String),
    /// zram cannot be used here (not root, no zram module, ...).
    #[error("zram unavailable: {0}")]
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
    /// A worker thread could not be spawned.
    #[error("cannot spawn benchmark worker thread: {0}")]
    Spawn(io::Error),
    /// A worker thread panicked.
    #[error("a benchmark worker thread panicked during the {phase} phase")]
    WorkerPanicked { phase: &'static str },
    /// A hot-added device could not be removed.
    #[error(
        "{dev} could not be removed: {source}{}; remove it by hand: swapoff /dev/{dev}; echo {id} > {CONTROL_DIR}/hot_remove",
        earlier.as_ref().map(|e| format!(" (the benchmark had already failed: {e})")).unwrap_or_default()
    )]
    Remove { dev: String, id: u32, source: Box<ZramError>, earlier: Option<Box<ZramError>> },
}

/// Ids of the devices this process removed, for the tests.
#[cfg(test)]
static REMOVED: std::sync::Mutex<Vec<u32>> = std::sync::Mutex::new(Vec::new());

/// A zram device hot-added for its owner alone; reset and removed on drop.
#[derive(Debug)]
pub struct ZramDevice {
    id: u32,
    name: String,
    removed: bool,
}

impl ZramDevice {
    /// Creates a fresh device (`/sys/class/zram-control/hot_add`), loading
    /// the zram module with `num_devices=0` first if it is not loaded (so it
    /// creates no device of its own). Needs root.
    pub fn hot_add() -> Result<Self, ZramError> {
        if !crate::is_root() {
            return Err(ZramError::Unavailable(
                "creating a zram device requires root (run as root or via sudo)".into(),
            ));
        }
        ensure_module()?;
        let path = Path::new(CONTROL_DIR).join("hot_add");
        let text = std::fs::read_to_string(&path).map_err(|source| ZramError::SysfsRead { path, source })?;
        let id: u32 = text.trim().parse().map_err(|e| ZramError::Parse {
            what: "hot_add",
            reason: format!("{e}"),
            input: text.clone(),
        })?;
        // From here on, dropping `dev` removes the device (also when it never shows up).
        let dev = Self { id, name: format!("zram{id}"), removed: false };
        let deadline = Instant::now() + APPEAR_TIMEOUT;
        loop {
            match check_present(&dev.name) {
                Ok(()) => return Ok(dev),
                Err(why) if Instant::now() > deadline => {
                    return Err(ZramError::Unavailable(format!("hot-added {} did not appear: {why}", dev.name)));
                }
                Err(_) => thread::sleep(Duration::from_millis(10)),
            }
        }
    }

    /// The device number N of `zramN`.
    #[must_use]
    pub fn id(&self) -> u32 {
        self.id
    }

    /// `zramN`.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `/dev/zramN`.
    #[must_use]
    pub fn node(&self) -> PathBuf {
        dev_node(&self.name)
    }

    /// The compression algorithms the device offers, and the selected one.
    pub fn algorithms(&self) -> Result<(Vec<String>, String), ZramError> {
        read_comp_algorithm(&self.name)
    }

    /// Resets the device, selects `algorithm` and sets `disksize` (bytes),
    /// which initialises it. An algorithm it does not offer is refused with
    /// [`ZramError::UnknownAlgorithm`].
    pub fn configure(&self, algorithm: &str, disksize: u64) -> Result<(), ZramError> {
        let (available, _) = self.algorithms()?;
        if !available.iter().any(|a| a == algorithm) {
            return Err(ZramError::UnknownAlgorithm {
                dev: self.name.clone(),
                algorithm: algorithm.to_owned(),
                available,
            });
        }
        configure(&self.name, algorithm, disksize)
    }

    /// Resets the device (frees its pages, `disksize` 0), retrying for a
    /// while when something holds it open for a moment. It must not be swap.
    pub fn reset(&self) -> Result<(), ZramError> {
        reset(&self.name)
    }

    /// Its `mm_stat`.
    pub fn mm_stat(&self) -> Result<ZramMmStat, ZramError> {
        ZramMmStat::parse(&read_attr(&self.name, "mm_stat")?)
    }

    /// Removes the device now (`hot_remove`, which also resets it),
    /// reporting failure; dropping it does the same, reporting on stderr.
    pub fn remove(mut self) -> Result<(), ZramError> {
        self.remove_now()
    }

    fn remove_now(&mut self) -> Result<(), ZramError> {
        if self.removed {
            return Ok(());
        }
        let path = Path::new(CONTROL_DIR).join("hot_remove");
        let id = self.id.to_string();
        retry_busy(|| {
            std::fs::write(&path, &id).map_err(|source| ZramError::SysfsWrite {
                path: path.clone(),
                value: id.clone(),
                source,
            })
        })?;
        self.removed = true;
        #[cfg(test)]
        REMOVED.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(self.id);
        Ok(())
    }
}

impl Drop for ZramDevice {
    fn drop(&mut self) {
        if let Err(e) = self.remove_now() {
            eprintln!(
                "tmem-sys: WARNING: could not remove {}: {e}; remove it by hand: \
                 swapoff /dev/{0}; echo {} > {CONTROL_DIR}/hot_remove",
                self.name, self.id
            );
        }
    }
}

/// Loads the zram module without devices of its own where it is not loaded.
fn ensure_module() -> Result<(), ZramError> {
    if Path::new(CONTROL_DIR).is_dir() {
        return Ok(());
    }
    let why = match Command::new("modprobe").args(["zram", "num_devices=0"]).stdin(Stdio::null()).output() {
        Ok(out) if out.status.success() => String::new(),
        Ok(out) => format!(": modprobe zram num_devices=0 failed: {}", String::from_utf8_lossy(&out.stderr).trim()),
        Err(e) => format!(": cannot run modprobe: {e}"),
    };
    if Path::new(CONTROL_DIR).is_dir() {
        return Ok(());
    }
    Err(ZramError::Unavailable(format!(
        "{CONTROL_DIR} does not exist (no zram module, or a kernel without hot_add){why}"
    )))
}

/// Retries `op` while it fails with `EBUSY`, for up to [`BUSY_TIMEOUT`].
fn retry_busy(mut op: impl FnMut() -> Result<(), ZramError>) -> Result<(), ZramError> {
    let deadline = Instant::now() + BUSY_TIMEOUT;
    let mut pause = Duration::from_millis(5);
    loop {
        match op() {
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

/// Whether fresh zram devices can be made here: hot-adds one, reads the
/// algorithms it offers and removes it again. Returns those algorithms, or
/// the reason why not.
pub fn probe() -> Result<Vec<String>, String> {
    let dev = ZramDevice::hot_add().map_err(|e| e.to_string())?;
    let algorithms = dev.algorithms().map_err(|e| e.to_string());
    dev.remove().map_err(|e| e.to_string())?;
    Ok(algorithms?.0)
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
    let (name, id) = (dev.name.clone(), dev.id);
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

/// Reset, select `algorithm`, set `disksize` (initialises the device).
fn configure(dev: &str, algorithm: &str, disksize: u64) -> Result<(), ZramError> {
    reset(dev)?;
    write_attr(dev, "comp_algorithm", algorithm)?;
    write_attr(dev, "disksize", &disksize.to_string())
}

/// `echo 1 > reset`, retrying for a while on `EBUSY` (something such as a
/// udev/blkid probe may hold the device open for a moment).
fn reset(dev: &str) -> Result<(), ZramError> {
    retry_busy(|| write_attr(dev, "reset", "1"))
}

/// Presence and permission checks.
fn check_present(dev: &str) -> Result<(), String> {
    let sys = sysfs_dir(dev);
    if !sys.join("comp_algorithm").is_file() {
        return Err(format!("{} does not exist", sys.join("comp_algorithm").display()));
    }
    let node = dev_node(dev);
    match std::fs::metadata(&node) {
        Ok(meta) if meta.file_type().is_block_device() => Ok(()),
        Ok(_) => Err(format!("{} is not a block device", node.display())),
        Err(e) => Err(format!("cannot access {}: {e}", node.display())),
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
