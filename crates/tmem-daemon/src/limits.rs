//! What one command may ask of this machine. Every count and size from the
//! command line or the configuration file passes these checks before
//! anything is allocated for it; a refusal is one line naming the value and
//! the limit (finding: `--devices 4294967296` aborted on a 446 GB
//! allocation, `devices = 9223372036854775807` panicked).

use std::ops::RangeInclusive;
use std::path::Path;

use crate::human;
use crate::spec::PoolLimit;

/// Most swap areas a kernel holds: a swap entry's type has 5 bits
/// (`MAX_SWAPFILES_SHIFT`), and kernels with migration, poison or
/// device-private entries hold fewer.
pub const MAX_SWAP_DEVICES: u64 = 32;
/// Most devices and caches one daemon serves.
pub const MAX_DEVICES: u64 = 256;
/// Most `/dev/fuse` worker threads.
pub const MAX_FUSE_THREADS: u64 = 256;
/// Most FUSE over io_uring workers per CPU queue.
pub const MAX_FUSE_URING: u64 = 64;
/// Share of RAM that FUSE workers' buffers may take (the daemon locks them in memory).
pub const MAX_BUFFER_RAM_DIVISOR: u64 = 16;
/// Bytes of buffer each FUSE worker holds: `tmem_fuse::MAX_IO`, the largest request.
fn fuse_worker_bytes() -> u64 {
    u64::from(tmem_fuse::MAX_IO)
}
/// Index bytes per stored 4 KiB page (`tmem_core`'s 40-byte entry).
pub const INDEX_BYTES_PER_PAGE: u64 = 40;
/// Share of RAM that the index of completely written devices may take.
pub const MAX_INDEX_RAM_DIVISOR: u64 = 4;
/// Longest `--wait`: a day.
pub const MAX_WAIT_SECS: u64 = 86_400;
/// Most copies of a page on the remote tier.
pub const MAX_REPLICAS: u64 = 8;
/// Most Redis/Valkey nodes in one remote tier (each is a connection per device).
pub const MAX_REMOTE_NODES: u64 = 64;
/// swapon's priority range.
pub const PRIORITY: RangeInclusive<i64> = -1..=32767;

/// A value this machine cannot hold: one line naming the value and the limit.
#[derive(Debug, thiserror::Error)]
pub enum LimitError {
    /// Above its limit.
    #[error("{name} {value} is above the limit of {limit}: {why}")]
    Above {
        /// The flag or key.
        name: String,
        /// The value as given.
        value: String,
        /// The largest value allowed.
        limit: String,
        /// Where the limit comes from.
        why: String,
    },
    /// Below its minimum.
    #[error("{name} {value} is below the minimum of {limit}: {why}")]
    Below {
        /// The flag or key.
        name: String,
        /// The value as given.
        value: String,
        /// The smallest value allowed.
        limit: String,
        /// Where the minimum comes from.
        why: String,
    },
    /// This machine's memory or CPUs cannot be read.
    #[error("cannot read what this machine holds: {0}")]
    Machine(String),
}

impl LimitError {
    /// The message without the name (where the caller names the key itself).
    pub fn detail(&self) -> String {
        match self {
            Self::Above { value, limit, why, .. } => format!("{value} is above the limit of {limit}: {why}"),
            Self::Below { value, limit, why, .. } => format!("{value} is below the minimum of {limit}: {why}"),
            Self::Machine(e) => e.clone(),
        }
    }
}

/// What this machine holds, read once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Machine {
    /// `MemTotal`, bytes.
    pub total_ram: u64,
    /// Possible CPUs (one FUSE io_uring queue each).
    pub cpus: u64,
}

impl Machine {
    /// Reads `/proc/meminfo` and the possible CPUs.
    pub fn this() -> Result<Self, LimitError> {
        let total_ram = tmem_sys::swap::total_ram_bytes().map_err(|e| LimitError::Machine(e.to_string()))?;
        let cpus = tmem_fuse::possible_cpus()
            .or_else(|_| std::thread::available_parallelism().map(usize::from))
            .map_err(|e| LimitError::Machine(format!("CPUs: {e}")))?;
        Ok(Self { total_ram, cpus: u64::try_from(cpus).unwrap_or(u64::MAX) })
    }

    /// Most `/dev/fuse` threads: [`MAX_FUSE_THREADS`], and their buffers
    /// within 1/[`MAX_BUFFER_RAM_DIVISOR`] of RAM.
    pub fn max_fuse_threads(&self) -> u64 {
        (self.total_ram / MAX_BUFFER_RAM_DIVISOR / fuse_worker_bytes()).clamp(1, MAX_FUSE_THREADS)
    }

    /// Most io_uring workers per CPU: [`MAX_FUSE_URING`], and their buffers
    /// within 1/[`MAX_BUFFER_RAM_DIVISOR`] of RAM.
    pub fn max_fuse_uring(&self) -> u64 {
        (self.total_ram / MAX_BUFFER_RAM_DIVISOR / fuse_worker_bytes() / self.cpus.max(1)).min(MAX_FUSE_URING)
    }
}

/// Checks `value` against `range`, naming `name` and why the range is what it is.
pub fn range<T>(name: &str, value: T, range: RangeInclusive<T>, why: &str) -> Result<T, LimitError>
where
    T: PartialOrd + std::fmt::Display + Copy,
{
    let refuse = |limit: &T| (name.to_owned(), value.to_string(), limit.to_string(), why.to_owned());
    if value > *range.end() {
        let (name, value, limit, why) = refuse(range.end());
        return Err(LimitError::Above { name, value, limit, why });
    }
    if value < *range.start() {
        let (name, value, limit, why) = refuse(range.start());
        return Err(LimitError::Below { name, value, limit, why });
    }
    Ok(value)
}

/// A count as a `usize` (every count is bounded far below `usize::MAX` first).
fn to_usize(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// Devices of one kind: at most [`MAX_SWAP_DEVICES`] swap devices, else [`MAX_DEVICES`].
pub fn devices(name: &str, n: u64, swap: bool) -> Result<usize, LimitError> {
    let (max, why) = match swap {
        true => (MAX_SWAP_DEVICES, "a kernel holds at most 32 swap areas"),
        false => (MAX_DEVICES, "the most devices one daemon serves"),
    };
    range(name, n, 0..=max, why).map(to_usize)
}

/// Devices and caches of one daemon together: at most [`MAX_DEVICES`].
pub fn caches(name: &str, caches: u64, devices: u64) -> Result<(), LimitError> {
    let max = MAX_DEVICES.saturating_sub(devices);
    range(name, caches, 0..=max, &format!("{MAX_DEVICES} devices and caches in one daemon, {devices} of them devices"))
        .map(drop)
}

/// `/dev/fuse` worker threads.
pub fn fuse_threads(name: &str, n: u64, m: &Machine) -> Result<usize, LimitError> {
    let max = m.max_fuse_threads();
    let why = format!(
        "at most {MAX_FUSE_THREADS}, each holding a {} buffer, within 1/{MAX_BUFFER_RAM_DIVISOR} of RAM ({})",
        human(fuse_worker_bytes()),
        human(m.total_ram)
    );
    range(name, n, 1..=max, &why).map(to_usize)
}

/// FUSE over io_uring workers per CPU queue.
pub fn fuse_uring(name: &str, n: u64, m: &Machine) -> Result<usize, LimitError> {
    let max = m.max_fuse_uring();
    let why = format!(
        "at most {MAX_FUSE_URING} per CPU, each holding a {} buffer on each of {} CPUs, within 1/{MAX_BUFFER_RAM_DIVISOR} \
         of RAM ({})",
        human(fuse_worker_bytes()),
        m.cpus,
        human(m.total_ram)
    );
    range(name, n, 0..=max, &why).map(to_usize)
}

/// A swap priority.
pub fn priority(name: &str, p: i64) -> Result<i32, LimitError> {
    range(name, p, PRIORITY, "swapon's range is -1..32767").map(|p| i32::try_from(p).unwrap_or(i32::MAX))
}

/// Seconds to wait for a daemon.
pub fn wait(name: &str, secs: u64) -> Result<u64, LimitError> {
    range(name, secs, 1..=MAX_WAIT_SECS, "at least a second, at most a day")
}

/// Copies of a page on the remote tier.
pub fn replicas(name: &str, n: u64) -> Result<usize, LimitError> {
    range(name, n, 1..=MAX_REPLICAS, "RAMster's replication factor").map(to_usize)
}

/// Nodes of one remote tier.
pub fn remote_nodes(name: &str, n: u64) -> Result<(), LimitError> {
    range(name, n, 1..=MAX_REMOTE_NODES, "each node is a connection per device").map(drop)
}

/// A pool limit in bytes: at most this machine's RAM.
pub fn pool_limit(name: &str, limit: PoolLimit, total_ram: u64) -> Result<PoolLimit, LimitError> {
    if let PoolLimit::Bytes(b) = limit {
        if b > total_ram {
            return Err(LimitError::Above {
                name: name.to_owned(),
                value: human(b),
                limit: human(total_ram),
                why: "a pool holds at most this machine's RAM".into(),
            });
        }
    }
    Ok(limit)
}

/// Devices of `sizes`: the index of all of them written full (40 bytes per
/// 4 KiB page) may take at most 1/[`MAX_INDEX_RAM_DIVISOR`] of RAM.
pub fn device_sizes(sizes: &[u64], total_ram: u64) -> Result<(), LimitError> {
    let total: u64 = sizes.iter().copied().fold(0, u64::saturating_add);
    let allowed = total_ram / MAX_INDEX_RAM_DIVISOR;
    let largest = allowed / INDEX_BYTES_PER_PAGE * 4096;
    if total > largest {
        return Err(LimitError::Above {
            name: "device size".into(),
            value: format!("{} in all", human(total)),
            limit: human(largest),
            why: format!(
                "their index, written full, would take {} ({INDEX_BYTES_PER_PAGE} bytes per 4 KiB page), \
                 more than 1/{MAX_INDEX_RAM_DIVISOR} of RAM ({})",
                human((total / 4096).saturating_mul(INDEX_BYTES_PER_PAGE)),
                human(allowed)
            ),
        });
    }
    Ok(())
}

/// A disk tier of `capacity` bytes per device for `devices` devices at
/// `path` (a directory, or a file in one): at most what its file system holds.
pub fn disk_capacity(name: &str, capacity: u64, devices: u64, path: &Path) -> Result<(), LimitError> {
    let is_block =
        std::fs::metadata(path).is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_block_device(&m.file_type()));
    if is_block {
        // The disk tier checks a block device's own size when it opens it.
        return Ok(());
    }
    let dir = if path.is_dir() { path } else { path.parent().unwrap_or(Path::new("/")) };
    let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
    let Ok(fs) = rustix::fs::statvfs(dir) else {
        // A missing directory fails when the tier is built, naming it.
        return Ok(());
    };
    let fs_bytes = fs.f_blocks.saturating_mul(fs.f_frsize);
    let total = capacity.saturating_mul(devices.max(1));
    if total > fs_bytes {
        return Err(LimitError::Above {
            name: name.to_owned(),
            value: format!("{} ({} for {} devices)", human(capacity), human(total), devices.max(1)),
            limit: human(fs_bytes),
            why: format!("the size of the file system of {}", dir.display()),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL: Machine = Machine { total_ram: 1 << 30, cpus: 2 };
    const BIG: Machine = Machine { total_ram: 24 << 30, cpus: 16 };

    /// Finding: `--devices 4294967296` aborted, `devices = 9223372036854775807` panicked.
    #[test]
    fn counts_name_the_value_and_the_limit() {
        let e = devices("--devices", 4_294_967_296, true).unwrap_err().to_string();
        assert_eq!(e, "--devices 4294967296 is above the limit of 32: a kernel holds at most 32 swap areas");
        assert_eq!(devices("--devices", 32, true).unwrap(), 32);
        let e = devices("--devices", u64::MAX, false).unwrap_err().to_string();
        assert!(e.contains("18446744073709551615") && e.contains("limit of 256"), "{e}");
        assert_eq!(devices("--devices", 256, false).unwrap(), 256);
        let e = priority("--priority", 99_999).unwrap_err().to_string();
        assert!(e.contains("99999") && e.contains("32767"), "{e}");
        let e = priority("--priority", -2).unwrap_err().to_string();
        assert!(e.contains("below the minimum of -1"), "{e}");
        assert!(wait("--wait", u64::MAX).unwrap_err().to_string().contains("limit of 86400"));
        assert!(wait("--wait", 0).is_err());
        assert!(replicas("--replicas", 9).is_err() && replicas("--replicas", 8).is_ok());
        assert!(caches("--cache-backing", 250, 7).is_err() && caches("--cache-backing", 249, 7).is_ok());
        for e in [devices("--devices", 1 << 40, true).unwrap_err(), wait("--wait", 0).unwrap_err()] {
            assert_eq!(e.to_string().lines().count(), 1);
            assert!(!e.detail().starts_with("--"), "{}", e.detail());
        }
    }

    #[test]
    fn workers_are_bounded_by_ram() {
        // 1 GiB: 64 MiB of 1 MiB buffers.
        assert_eq!(SMALL.max_fuse_threads(), 64);
        assert_eq!(BIG.max_fuse_threads(), 256);
        assert!(fuse_threads("--fuse-threads", 65, &SMALL).unwrap_err().to_string().contains("limit of 64"));
        assert!(fuse_threads("--fuse-threads", 0, &BIG).is_err());
        assert_eq!(SMALL.max_fuse_uring(), 32);
        assert_eq!(BIG.max_fuse_uring(), 64);
        assert!(fuse_uring("--fuse-uring", 1 << 40, &BIG).is_err());
        assert_eq!(fuse_uring("--fuse-uring", 0, &SMALL).unwrap(), 0);
    }

    #[test]
    fn sizes_are_bounded_by_ram_and_disk() {
        assert!(pool_limit("--pool-limit", PoolLimit::Bytes(2 << 30), SMALL.total_ram).is_err());
        pool_limit("--pool-limit", PoolLimit::Bytes(1 << 30), SMALL.total_ram).unwrap();
        pool_limit("--pool-limit", PoolLimit::Percent(100), SMALL.total_ram).unwrap();
        // 1 GiB of RAM: a quarter of it indexes 25.6 GiB of pages.
        device_sizes(&[25 << 30], SMALL.total_ram).unwrap();
        let e = device_sizes(&[16 << 30, 16 << 30], SMALL.total_ram).unwrap_err().to_string();
        assert!(e.starts_with("device size 32.0 GiB in all is above the limit of 25.6 GiB"), "{e}");
        assert!(device_sizes(&[u64::MAX, u64::MAX], BIG.total_ram).is_err());
        let dir = tempfile::tempdir().unwrap();
        disk_capacity("--disk-capacity", 1 << 20, 2, dir.path()).unwrap();
        let e = disk_capacity("--disk-capacity", u64::MAX / 2, 3, dir.path()).unwrap_err().to_string();
        assert!(e.contains("--disk-capacity") && e.contains("file system"), "{e}");
    }
}
