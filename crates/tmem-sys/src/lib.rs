//! Kernel interfaces for tmem: swap areas and loop devices ([`swap`]), memory
//! cgroups ([`cgroup`]), CPU and swap counters ([`vmstat`]), and zram and
//! zswap control ([`zram`], [`zswap`]), and direct block and file I/O
//! ([`blockio`], [`aligned`]), and block devices' read counters ([`blockstat`]). The benchmarks that drive them live in
//! `tmem-bench`.

pub mod aligned;
pub mod blockio;
pub mod blockstat;
pub mod zram;

/// `true` when the process runs with effective UID 0.
///
/// Configuring zram (writing `/sys/block/zramN/*`, opening `/dev/zramN` for
/// writing) requires root; callers use this to decide early whether to skip.
#[must_use]
pub fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}
pub mod swap;

/// Whether process `pid` runs (a zombie, exited but not yet reaped by its
/// parent, does not).
#[must_use]
pub fn process_runs(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| !rest.starts_with('Z')))
        .unwrap_or(false)
}

pub mod cgroup;
pub mod procmaps;
pub mod vmstat;
pub mod zswap;
