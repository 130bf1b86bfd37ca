//! Kernel plumbing for tmem.
//!
//! For now this crate holds the kernel side of `tmem bench store`: the [`zram`]
//! module drives a real `/dev/zramN` device with exactly the same pages that the
//! userspace page store is benchmarked on, so the two can be compared.

pub mod zram;

/// `true` when the process runs with effective UID 0.
///
/// Configuring zram (writing `/sys/block/zramN/*`, opening `/dev/zramN` for
/// writing) requires root; callers use this to decide early whether to skip.
#[must_use]
pub fn is_root() -> bool {
    // SAFETY: geteuid(2) takes no arguments, touches no memory owned by us,
    // is async-signal-safe and always succeeds; there are no invariants to uphold.
    let euid = unsafe { libc::geteuid() };
    euid == 0
}
pub mod swap;

pub mod cgroup;
pub mod vmstat;
pub mod zswap;
