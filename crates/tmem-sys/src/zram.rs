//! zram control: fresh devices of our own, their attributes and `mm_stat`.
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
//! The benchmark harness that drives such a device with real pages is
//! `tmem_bench::zram`.

use std::io;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::str::FromStr;
use std::thread;
use std::time::{Duration, Instant};

/// Page size the harness works in (and zram's logical block size on x86-64).
pub const PAGE_SIZE: usize = 4096;

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

/// `/sys/block/zramN/bd_stat`: the backing device's use, in 4 KiB pages.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct BdStat {
    /// Pages on the backing device now.
    pub count: u64,
    /// Pages read back from it.
    pub reads: u64,
    /// Pages written to it.
    pub writes: u64,
}

impl BdStat {
    /// Parses `bd_stat` (three numbers).
    pub fn parse(text: &str) -> Result<Self, ZramError> {
        let err = |reason: String| ZramError::Parse { what: "bd_stat", reason, input: text.to_owned() };
        let v: Vec<u64> = text
            .split_whitespace()
            .map(|w| w.parse::<u64>().map_err(|e| err(format!("{w:?}: {e}"))))
            .collect::<Result<_, _>>()?;
        match v[..] {
            [count, reads, writes, ..] => Ok(Self { count, reads, writes }),
            _ => Err(err(format!("{} fields, expected 3", v.len()))),
        }
    }
}

/// Reads a debugfs file that prints whole lines per read: a read whose
/// buffer cannot hold the next line returns 0, which `read_to_string`'s
/// first small read takes for the end (it then returns nothing at all),
/// so every read here offers 1 MiB.
fn read_whole_lines(mut file: &std::fs::File) -> io::Result<String> {
    use std::io::Read;
    let mut out = Vec::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match file.read(&mut buf)? {
            0 => break,
            n => out.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8(out).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// The slots flagged `w` (written back) in a debugfs `block_state` text:
/// one line per allocated slot, `INDEX SECS.USECS FLAGS`, the flags a
/// run of letters or `.` (`s` same-filled, `w` written back, `h` huge, `i`
/// idle, ...).
pub fn parse_written_back_slots(text: &str) -> Result<Vec<u64>, ZramError> {
    let err = |reason: String| ZramError::Parse { what: "block_state", reason, input: text.to_owned() };
    let mut slots = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [index, _, flags] = fields[..] else {
            return Err(err(format!("{line:?}: expected 3 fields")));
        };
        let index: u64 = index.parse().map_err(|e| err(format!("{line:?}: index: {e}")))?;
        if flags.contains('w') {
            slots.push(index);
        }
    }
    Ok(slots)
}

/// The zram devices whose backing device is `dev` (by `backing_dev`, which
/// names the block device's node): what a dead daemon's zram front left.
#[must_use]
pub fn backed_by(dev: &Path) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/sys/block") else { return Vec::new() };
    let mut ids: Vec<u32> = dir
        .filter_map(|e| {
            let name = e.ok()?.file_name().into_string().ok()?;
            let id = name.strip_prefix("zram")?.parse::<u32>().ok()?;
            let backing = std::fs::read_to_string(sysfs_dir(&name).join("backing_dev")).ok()?;
            (Path::new(backing.trim()) == dev).then_some(id)
        })
        .collect();
    ids.sort_unstable();
    ids
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

/// Ids of the devices this process removed, in order (see [`removed_ids`]).
static REMOVED: parking_lot::Mutex<Vec<u32>> = parking_lot::Mutex::new(Vec::new());

/// Ids of the zram devices this process removed, in order: tests check with
/// it that every device they or a benchmark hot-added is gone again.
#[must_use]
pub fn removed_ids() -> Vec<u32> {
    REMOVED.lock().clone()
}

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
        self.check_offered(algorithm)?;
        configure(&self.name, algorithm, disksize)
    }

    /// Refuses an algorithm the device does not offer with
    /// [`ZramError::UnknownAlgorithm`].
    fn check_offered(&self, algorithm: &str) -> Result<(), ZramError> {
        let (available, _) = self.algorithms()?;
        if !available.iter().any(|a| a == algorithm) {
            return Err(ZramError::UnknownAlgorithm {
                dev: self.name.clone(),
                algorithm: algorithm.to_owned(),
                available,
            });
        }
        Ok(())
    }

    /// Caps the memory the device may use for compressed pages
    /// (`mem_limit`, bytes; 0 = none); a write past it fails. Set after
    /// [`ZramDevice::configure`].
    pub fn set_mem_limit(&self, bytes: u64) -> Result<(), ZramError> {
        write_attr(&self.name, "mem_limit", &bytes.to_string())
    }

    /// Takes over device `zramN` made by another process of ours (a
    /// daemon handing over to its successor): it is removed on drop like
    /// one hot-added here. Fails if the device does not exist.
    pub fn adopt(id: u32) -> Result<Self, ZramError> {
        let dev = Self { id, name: format!("zram{id}"), removed: false };
        if let Err(why) = check_present(&dev.name) {
            // Not ours to remove: it is not there.
            std::mem::forget(dev);
            return Err(ZramError::Unavailable(why));
        }
        Ok(dev)
    }

    /// Gives the device up without removing it (for a successor to
    /// [`ZramDevice::adopt`]); returns its id.
    #[must_use]
    pub fn release(mut self) -> u32 {
        self.removed = true;
        self.id
    }

    /// Whether the kernel built zram with writeback (`CONFIG_ZRAM_WRITEBACK`):
    /// the device has a `backing_dev` attribute.
    #[must_use]
    pub fn has_writeback(&self) -> bool {
        sysfs_dir(&self.name).join("backing_dev").is_file()
    }

    /// Sets the backing device that `writeback` writes pages to (a block
    /// device). Only before [`ZramDevice::configure`] sets `disksize`;
    /// `configure` resets the device, which keeps the backing device.
    pub fn set_backing_dev(&self, dev: &Path) -> Result<(), ZramError> {
        write_attr(&self.name, "backing_dev", &dev.to_string_lossy())
    }

    /// Selects `algorithm` and sets `disksize` without the reset that
    /// [`ZramDevice::configure`] does first (so a backing device set before
    /// stays). The device must be fresh or reset.
    pub fn initialise(&self, algorithm: &str, disksize: u64) -> Result<(), ZramError> {
        self.check_offered(algorithm)?;
        write_attr(&self.name, "comp_algorithm", algorithm)?;
        write_attr(&self.name, "disksize", &disksize.to_string())
    }

    /// Its `bd_stat`: pages on the backing device now, read from it and
    /// written to it since `disksize` was set.
    pub fn bd_stat(&self) -> Result<BdStat, ZramError> {
        BdStat::parse(&read_attr(&self.name, "bd_stat")?)
    }

    /// Marks pages idle: every stored page (`age` `None`, `echo all > idle`),
    /// or those not accessed for `age` seconds (`echo SECS > idle`, where
    /// the kernel tracks access times: `CONFIG_ZRAM_TRACK_ENTRY_ACTIME`).
    /// An access clears a page's mark. Returns `Ok(false)` when the kernel
    /// refuses an age (no access times), so the caller marks `all` instead.
    pub fn mark_idle(&self, age: Option<u64>) -> Result<bool, ZramError> {
        match age {
            None => write_attr(&self.name, "idle", "all").map(|()| true),
            Some(secs) => match write_attr(&self.name, "idle", &secs.to_string()) {
                Err(ZramError::SysfsWrite { source, .. }) if source.raw_os_error() == Some(libc::EINVAL) => Ok(false),
                other => other.map(|()| true),
            },
        }
    }

    /// Writes back pages of the given kind (`idle`, `huge`, `huge_idle`,
    /// `incompressible`) to the backing device, at most the writeback
    /// limit. The kernel answers `EIO` when the limit is spent and
    /// `ENOMEM`/`EAGAIN` when the backing device is full or busy: none is a
    /// failure here, the caller reads what moved from [`ZramDevice::bd_stat`].
    pub fn writeback(&self, kind: &str) -> Result<(), ZramError> {
        match write_attr(&self.name, "writeback", kind) {
            Err(ZramError::SysfsWrite { source, .. })
                if matches!(source.raw_os_error(), Some(libc::EIO | libc::ENOMEM | libc::EAGAIN)) =>
            {
                Ok(())
            }
            other => other,
        }
    }

    /// Bounds the pages [`ZramDevice::writeback`] may write from now on
    /// (`writeback_limit_enable` 1, `writeback_limit` in 4 KiB pages).
    pub fn set_writeback_limit(&self, pages: u64) -> Result<(), ZramError> {
        write_attr(&self.name, "writeback_limit_enable", "1")?;
        write_attr(&self.name, "writeback_limit", &pages.to_string())
    }

    /// Resets the device (frees its pages, `disksize` 0), retrying for a
    /// while when something holds it open for a moment. It must not be swap.
    pub fn reset(&self) -> Result<(), ZramError> {
        reset(&self.name)
    }

    /// The reads it served (`/sys/block/zramN/stat`), those of written-back
    /// pages included; `None` where the kernel does not count them.
    #[must_use]
    pub fn reads(&self) -> Option<crate::blockstat::BlockReads> {
        crate::blockstat::BlockReads::of(&self.node())
    }

    /// The slots whose pages are on the backing device now (flag `w` in
    /// debugfs `block_state`: `CONFIG_ZRAM_MEMORY_TRACKING`, debugfs at
    /// `/sys/kernel/debug`); `Unavailable` where there is no such file.
    pub fn written_back_slots(&self) -> Result<Vec<u64>, ZramError> {
        let path = Path::new("/sys/kernel/debug/zram").join(&self.name).join("block_state");
        let file = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(ZramError::Unavailable(format!(
                    "{}: no such file (zram without CONFIG_ZRAM_MEMORY_TRACKING, or debugfs not mounted)",
                    path.display()
                )))
            }
            Err(source) => return Err(ZramError::SysfsRead { path, source }),
        };
        let text = read_whole_lines(&file).map_err(|source| ZramError::SysfsRead { path, source })?;
        parse_written_back_slots(&text)
    }

    /// Reads each of `slots` through the device (`O_DIRECT`, one page
    /// each): for a written-back slot, zram reads its block from the
    /// backing device, which sees every block zram still uses. Reading
    /// changes nothing in zram but the slots' access times.
    pub fn read_slots(&self, slots: &[u64]) -> Result<(), ZramError> {
        use std::os::unix::fs::{FileExt, OpenOptionsExt};
        let path = self.node();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .map_err(|source| ZramError::Open { path: path.clone(), source })?;
        let mut buf = crate::aligned::AlignedBuf::zeroed(4096);
        for &slot in slots {
            let offset = slot * 4096;
            file.read_exact_at(&mut buf, offset).map_err(|source| ZramError::Read {
                path: path.clone(),
                offset,
                len: 4096,
                source,
            })?;
        }
        Ok(())
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
        REMOVED.lock().push(self.id);
        Ok(())
    }
}

impl Drop for ZramDevice {
    fn drop(&mut self) {
        if let Err(e) = self.remove_now() {
            tracing::warn!(
                "could not remove {}: {e}; remove it by hand: \
                 swapoff /dev/{0}; echo {} > {CONTROL_DIR}/hot_remove",
                self.name,
                self.id
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
pub fn probe() -> Result<Vec<String>, ZramError> {
    let dev = ZramDevice::hot_add()?;
    let algorithms = dev.algorithms();
    dev.remove()?;
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

#[cfg(test)]
mod tests;
