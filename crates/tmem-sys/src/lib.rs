//! Kernel interfaces for tmem: swap areas and loop devices ([`swap`]), memory
//! cgroups ([`cgroup`]), CPU and swap counters ([`vmstat`]), and zram and
//! zswap control ([`zram`], [`zswap`]), and direct block and file I/O
//! ([`blockio`], [`aligned`]). The benchmarks that drive them live in
//! `tmem-bench`.

pub mod aligned;
pub mod blockio;
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

pub mod cgroup;
pub mod vmstat;
pub mod zswap;
