//! tmem behind the kernel: a front of the kernel's own compressed swap
//! (zram with writeback, or zswap) keeps the hot pages and answers their
//! faults in the kernel; tmem's device below it takes the pages the front
//! pushes out, denser, remote or sealed. This is frontswap's design (the
//! seeds' zcache in front of a swap device) with zram and zswap in the
//! place of zcache.
//!
//! * [`choose`] turns `--front auto|zram|zswap|none` into a [`Choice`]
//!   with its reason, from what the kernel offers ([`KernelFronts`]).
//! * [`zram::ZramFront`]: a zram device of tmem's own whose `backing_dev`
//!   is tmem's device; the kernel swaps on the zram device alone.
//! * [`zswap::ZswapFront`]: zswap's parameters (and, on cgroup v2, the
//!   zswap limits of the cgroups tmem is told to manage) with tmem's device
//!   as the swap device; saved first, restored on drop, on `swap down` and
//!   by crash recovery.
//! * [`policy::Policy`]: what goes down and when (idle age, fill level,
//!   rate), learning from the pages that come back; [`policy::PolicyThread`]
//!   runs it against a [`policy::FrontOps`].
//!
//! Nothing of the user's own zram devices or zswap settings is touched:
//! zram devices are hot-added for tmem alone, and zswap parameters are
//! put back to what they were.

pub mod policy;
pub mod zram;
pub mod zswap;

use std::str::FromStr;

/// Errors of the fronts.
#[derive(Debug, thiserror::Error)]
pub enum FrontError {
    /// `--front` named something else.
    #[error("unknown front {0:?}: expected auto, zram, zswap or none")]
    UnknownKind(String),
    /// The front asked for cannot run on this kernel.
    #[error("--front {front} is not available here: {why}")]
    Unavailable {
        /// The front asked for.
        front: &'static str,
        /// Why not.
        why: String,
    },
    /// zram failed.
    #[error(transparent)]
    Zram(#[from] tmem_sys::zram::ZramError),
    /// zswap failed.
    #[error(transparent)]
    Zswap(#[from] tmem_sys::zswap::ZswapError),
    /// A cgroup's zswap limit could not be read or set.
    #[error("{}: {what}: {source}", path.display())]
    Cgroup {
        /// The cgroup file.
        path: std::path::PathBuf,
        /// What was tried.
        what: &'static str,
        /// Cause.
        source: std::io::Error,
    },
    /// The device below the front could not be opened or locked.
    #[error("{}, the device below the front: cannot lock it: {source}", dev.display())]
    Below {
        /// The device below.
        dev: std::path::PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// zram's `block_state` named fewer written-back slots than `bd_stat`
    /// counts: the reclaim below did not run.
    #[error("reclaim below skipped: block_state lists {listed} written-back slots, bd_stat counts {live}")]
    Reclaim {
        /// Slots flagged written back.
        listed: u64,
        /// Pages zram counts below.
        live: u64,
    },
    /// The policy thread could not start.
    #[error("cannot start the front's policy thread: {0}")]
    Spawn(std::io::Error),
}

/// What `--front` asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FrontKind {
    /// zram with writeback where the kernel has it, else none.
    #[default]
    Auto,
    /// zram in front, tmem's device as its backing device.
    Zram,
    /// zswap in front of tmem's device.
    Zswap,
    /// tmem's device is the swap device, nothing in front.
    None,
}

impl FromStr for FrontKind {
    type Err = FrontError;
    fn from_str(s: &str) -> Result<Self, FrontError> {
        match s {
            "auto" => Ok(Self::Auto),
            "zram" => Ok(Self::Zram),
            "zswap" => Ok(Self::Zswap),
            "none" => Ok(Self::None),
            other => Err(FrontError::UnknownKind(other.to_owned())),
        }
    }
}

impl FrontKind {
    /// As written on the command line.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Zram => "zram",
            Self::Zswap => "zswap",
            Self::None => "none",
        }
    }
}

/// The front in use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Front {
    /// zram with tmem's device as its backing device.
    Zram,
    /// zswap in front of tmem's device.
    Zswap,
    /// None: tmem's device is the swap device.
    #[default]
    None,
}

impl Front {
    /// Its name.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Zram => "zram",
            Self::Zswap => "zswap",
            Self::None => "none",
        }
    }
}

/// The front chosen, and why.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Choice {
    /// The front.
    pub front: Front,
    /// Why it was chosen, in words.
    pub reason: String,
}

/// Which fronts this kernel offers; the error says why one is missing.
#[derive(Clone, Debug)]
pub struct KernelFronts {
    /// zram with writeback (`backing_dev`).
    pub zram_writeback: Result<(), String>,
    /// zswap.
    pub zswap: Result<(), String>,
}

impl KernelFronts {
    /// Looks: hot-adds a zram device to see whether it has `backing_dev`,
    /// and removes it again. Needs root for zram.
    #[must_use]
    pub fn probe() -> Self {
        let zram_writeback = match tmem_sys::zram::ZramDevice::hot_add() {
            Ok(dev) => {
                let has = dev.has_writeback();
                let _ = dev.remove();
                match has {
                    true => Ok(()),
                    false => Err("this kernel's zram has no writeback (built without CONFIG_ZRAM_WRITEBACK: no \
                                  backing_dev attribute)"
                        .to_owned()),
                }
            }
            Err(e) => Err(e.to_string()),
        };
        let zswap = match tmem_sys::zswap::available() {
            true => Ok(()),
            false => Err(tmem_sys::zswap::ZswapError::Unavailable.to_string()),
        };
        Self { zram_writeback, zswap }
    }
}

/// Turns `--front` into the front to set up, with the reason: `auto` takes
/// zram where it has writeback and none otherwise; a front asked for by
/// name that the kernel lacks is an error that says why.
pub fn choose(kind: FrontKind, kernel: &KernelFronts) -> Result<Choice, FrontError> {
    let choice = |front, reason: String| Ok(Choice { front, reason });
    match kind {
        FrontKind::None => choice(Front::None, "--front none: tmem's device is the swap device".into()),
        FrontKind::Zram => match &kernel.zram_writeback {
            Ok(()) => choice(Front::Zram, "--front zram: zram keeps the hot pages, tmem takes the idle ones".into()),
            Err(why) => Err(FrontError::Unavailable { front: "zram", why: why.clone() }),
        },
        FrontKind::Zswap => match &kernel.zswap {
            Ok(()) => choice(Front::Zswap, "--front zswap: zswap keeps the hot pages, tmem's device is the swap device".into()),
            Err(why) => Err(FrontError::Unavailable { front: "zswap", why: why.clone() }),
        },
        FrontKind::Auto => match &kernel.zram_writeback {
            Ok(()) => choice(
                Front::Zram,
                "--front auto: this kernel's zram has writeback, so zram keeps the hot pages and tmem takes the idle ones"
                    .into(),
            ),
            Err(why) => choice(Front::None, format!("--front auto: no front, tmem's device is the swap device ({why})")),
        },
    }
}

tmem_counters::counters! {
    /// A front's counters: the kernel's pool in front of tmem, and what its
    /// policy decided.
    #[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
    pub struct FrontStats {
        extra {
            /// `zram` or `zswap`.
            pub front: String,
            /// The front's device (`/dev/zramN`), or `zswap`.
            pub node: String,
            /// Why this front was chosen.
            pub reason: String,
            /// Whether the policy holds writeback back now, and why.
            pub state: String,
        }
        /// Memory the front's pool uses now (zram `mem_used_total`, zswap's pool).
        pool_bytes: Gauge(Bytes),
        /// Uncompressed bytes the front holds now.
        stored_bytes: Gauge(Bytes),
        /// The front's budget: writeback starts at the fill level of it.
        budget_bytes: Max(Bytes),
        /// Times pages were marked idle.
        idle_marks: Counter(Events),
        /// Writeback runs the policy started.
        writeback_runs: Counter(Events),
        /// Pages the front wrote back to tmem's device.
        written_back: Counter(Pages),
        /// Written-back pages read back from tmem's device.
        read_back: Counter(Pages),
        /// Times the policy backed off (longer age, lower rate, or a pause) because pages came back.
        backoffs: Counter(Events),
        /// Times it relaxed again because few came back.
        relaxes: Counter(Events),
        /// Times tmem dropped the pages of blocks zram had freed below (zram frees a written-back block only in its own bitmap).
        below_reclaims: Counter(Events),
        /// Pages of freed blocks below that tmem dropped.
        below_reclaimed: Counter(Pages),
        /// Pages the front served from its own pool (its reads less the reads back).
        front_reads: Counter(Pages),
        /// Idle age a page must reach before it goes down, now.
        idle_age_us: Max(Micros),
        /// Pages per second the policy lets the front write back, now.
        rate_pages: Max(Pages),
        /// Pool size at which writeback starts, now: the fill level, backed off.
        fill_bytes: Max(Bytes),
    }
}

#[cfg(test)]
mod tests;
