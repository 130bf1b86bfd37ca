//! The front rows of the swap benches (issue 30): the kernel's own
//! compressed swap in front, keeping the hot pages, and a device below it
//! taking the pages it pushes out.
//!
//! * `zram+tmem`: `tmem swap up --front zram`: a zram device of the
//!   daemon's whose `backing_dev` is tmem's device; the daemon's policy
//!   writes idle pages back to tmem.
//! * `zswap+tmem`: `tmem swap up --front zswap`: zswap in front of tmem's
//!   device; zswap's shrinker writes cold pages back, the policy lets it or
//!   stops it.
//! * `zram+disk`: the kernel's own answer, without tmem: the bench hot-adds
//!   a zram device ([`tmem_front::zram::ZramFront`]) whose backing device is
//!   a loop device over a plain file in `--swap-dir`, swaps on it, and runs
//!   the same policy ([`tmem_front::policy::PolicyThread`], the same
//!   [`PolicyConfig`] as `zram+tmem`) in the bench process.
//!
//! The rows that need zram writeback (`CONFIG_ZRAM_WRITEBACK`) are skipped,
//! with the reason, where the kernel lacks it ([`Availability`]).

use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::anyhow;
use tmem_front::policy::{FrontOps, PolicyConfig, PolicyThread};
use tmem_front::zram::{ZramFront, ZramFrontConfig};
use tmem_front::{FrontStats, KernelFronts};
use tmem_sys::swap;

use super::backend::{BackendKind, PoolSample, RAM_PRIORITY};
use super::cmd;
use super::throttle::{DiskProfile, ThrottledLoop};
use crate::cache::setup::LoopDev;

/// The front rows' settings: one policy for `zram+tmem`, `zram+disk` and
/// `zswap+tmem` (as `tmem swap up --front-*`).
#[derive(clap::Args, Debug, Clone, serde::Serialize)]
pub struct FrontArgs {
    /// The front's budget (`tmem swap up --front-limit`; zram's `mem_limit`
    /// too). Default: 1/3 of the reference run's peak (of the job's limit
    /// for `bench ramp`), at least 16 MiB.
    ///
    /// zram alone packs this heap about 2.2x and held 26-34 MiB of a
    /// 128 MiB job at 50 % and 35 %: a third of the job holds what zram
    /// alone holds, so the hot ladder compares a front with the memory
    /// zram alone uses (an eighth, the old default, sent the front to its
    /// emergency writeback: 2.45x zram's wall time, most of it read back),
    /// and writeback still starts at `--front-fill` of it (a sixth of the
    /// job at 50 %).
    #[arg(long, value_parser = tmem_corpus::parse_size)]
    pub front_limit: Option<u64>,
    /// Seconds a page must go unread before it goes down (`--front-idle-age`).
    ///
    /// 5 s: well under a 20-60 s job, so its cold part (`--cold-share`,
    /// built in the first seconds and not read again until the checksum)
    /// goes down while the passes run; pages a pass reads again within the
    /// age stay in the front, and the policy doubles the age where
    /// written-back pages come back.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    pub front_idle_age: u64,
    /// Fill level of the budget, %, below which nothing goes down
    /// (`--front-fill`).
    ///
    /// 50, the policy's own default: a job whose swapped
    /// pages fit in half the front loses nothing to tiering, and the half
    /// above leaves the front room for a burst of swap-outs while
    /// writeback catches up (it refuses pages at its `mem_limit`). 0 would
    /// write back every idle page at once, a disk-swap-like front.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u64).range(0..=100))]
    pub front_fill: u64,
    /// Pages a second the policy may write back at most (`--front-rate`;
    /// the policy's default, 100 MiB/s).
    #[arg(long, default_value_t = PolicyConfig::default().rate, value_parser = clap::value_parser!(u64).range(1..))]
    pub front_rate: u64,
}

impl FrontArgs {
    /// The settings, with the default budget relative to `reference` bytes
    /// (the reference run's peak, or the job's limit) where none was given.
    #[must_use]
    pub fn config(&self, reference: u64) -> FrontConfig {
        FrontConfig {
            limit: self.front_limit.unwrap_or_else(|| FrontConfig::relative_limit(reference)),
            idle_age_secs: self.front_idle_age,
            fill_percent: self.front_fill,
            rate: self.front_rate,
        }
    }
}

/// The front rows' settings, resolved.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct FrontConfig {
    /// The front's budget, bytes (zram's `mem_limit`).
    pub limit: u64,
    /// Idle age, seconds.
    pub idle_age_secs: u64,
    /// Fill level, % of the budget.
    pub fill_percent: u64,
    /// Pages a second, at most.
    pub rate: u64,
}

/// The least default budget.
const MIN_DEFAULT_LIMIT: u64 = 16 << 20;
/// The default budget is this share of the reference (see [`FrontArgs::front_limit`]).
const DEFAULT_LIMIT_SHARE: u64 = 3;
/// The longest idle age backing off reaches, in idle ages, and the least
/// rate, in 1/64 of the rate: what `tmem swap up` derives from its flags
/// (`tmem_daemon::front::FrontArgs::policy`), so that `zram+disk` runs the
/// daemon's policy.
const MAX_AGE_FACTOR: u32 = 32;
const MIN_RATE_DIVISOR: u64 = 64;

impl FrontConfig {
    /// 1/[`DEFAULT_LIMIT_SHARE`] of `reference` bytes, at least 16 MiB, in whole MiB.
    #[must_use]
    pub fn relative_limit(reference: u64) -> u64 {
        (reference / DEFAULT_LIMIT_SHARE).max(MIN_DEFAULT_LIMIT).div_ceil(1 << 20) << 20
    }

    /// The defaults for a job of `reference` bytes.
    #[must_use]
    pub fn for_reference(reference: u64) -> Self {
        let p = PolicyConfig::default();
        Self { limit: Self::relative_limit(reference), idle_age_secs: 5, fill_percent: p.fill_percent, rate: p.rate }
    }

    /// The policy every writeback row runs.
    #[must_use]
    pub fn policy(&self) -> PolicyConfig {
        let idle_age = Duration::from_secs(self.idle_age_secs);
        PolicyConfig {
            idle_age,
            max_idle_age: idle_age * MAX_AGE_FACTOR,
            budget: self.limit,
            fill_percent: self.fill_percent,
            rate: self.rate,
            min_rate: (self.rate / MIN_RATE_DIVISOR).max(1),
            ..PolicyConfig::default()
        }
    }

    /// `tmem swap up` arguments for a `front` (`zram` or `zswap`) compressing with `algorithm`.
    #[must_use]
    pub fn daemon_args(&self, front: &str, algorithm: &str) -> Vec<String> {
        [
            ("--front", front.to_owned()),
            ("--front-limit", self.limit.to_string()),
            ("--front-algorithm", algorithm.to_owned()),
            ("--front-idle-age", self.idle_age_secs.to_string()),
            ("--front-fill", self.fill_percent.to_string()),
            ("--front-rate", self.rate.to_string()),
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_owned(), v])
        .collect()
    }

    /// In words, for the report.
    #[must_use]
    pub fn describe(&self) -> String {
        format!(
            "front budget {} (zram mem_limit), idle age {} s (up to {} s when pages come back), fill {} %, at most {} pages/s",
            tmem_daemon::human(self.limit),
            self.idle_age_secs,
            self.idle_age_secs * u64::from(MAX_AGE_FACTOR),
            self.fill_percent,
            self.rate
        )
    }
}

/// Which front rows this kernel can run.
#[derive(Clone, Debug)]
pub struct Availability {
    /// zram with writeback (`None`: not probed, no row needs it).
    zram_writeback: Option<Result<(), String>>,
    zswap: Result<(), String>,
}

impl Availability {
    /// Looks at what `kinds` need: zram writeback is probed (a zram device
    /// hot-added and removed) only when a row needs it.
    #[must_use]
    pub fn probe(kinds: &[BackendKind]) -> Self {
        let zram_writeback = kinds.iter().any(|k| k.needs_zram_writeback()).then(|| {
            let k = KernelFronts::probe();
            k.zram_writeback
        });
        let zswap = match tmem_sys::zswap::available() {
            true => Ok(()),
            false => Err("this kernel has no zswap".to_owned()),
        };
        Self { zram_writeback, zswap }
    }

    /// The rows of `kinds` that cannot run here, each with the reason.
    #[must_use]
    pub fn skipped(&self, kinds: &[BackendKind]) -> Vec<Skipped> {
        kinds
            .iter()
            .filter_map(|&k| self.why_not(k).map(|reason| Skipped { backend: k.name().to_owned(), reason }))
            .collect()
    }

    /// Why `kind` cannot run here, or `None`.
    #[must_use]
    pub fn why_not(&self, kind: BackendKind) -> Option<String> {
        if kind.needs_zram_writeback() {
            if let Some(Err(why)) = &self.zram_writeback {
                return Some(format!("needs zram writeback: {why}"));
            }
        }
        if kind == BackendKind::ZswapTmem {
            if let Err(why) = &self.zswap {
                return Some(why.clone());
            }
        }
        None
    }
}

/// A row not run, and why.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Skipped {
    /// The row.
    pub backend: String,
    /// Why.
    pub reason: String,
}

impl std::fmt::Display for Skipped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SKIP: {}: {}", self.backend, self.reason)
    }
}

pub use tmem_sys::blockstat::BlockReads;

/// The kernel's own zram with writeback to a disk file: the zram+disk row.
/// The file and its loop device live from `prepare` to `finish`; each run
/// hot-adds a fresh zram device over the loop device, swaps on it and
/// runs the policy on it, and removes it after the run.
pub struct ZramDisk {
    file: PathBuf,
    /// Whether we created `file` (and must remove it).
    created: bool,
    backing: Option<Backing>,
    zram: ZramFrontConfig,
    policy: PolicyConfig,
    run: Option<ZramDiskRun>,
}

/// The loop device over the backing file.
enum Backing {
    Plain(LoopDev),
    Throttled(ThrottledLoop),
}

impl Backing {
    fn dev(&self) -> &Path {
        match self {
            Self::Plain(l) => l.path(),
            Self::Throttled(t) => t.dev(),
        }
    }

    fn release(self) -> anyhow::Result<()> {
        match self {
            Self::Plain(l) => l.detach(),
            Self::Throttled(t) => t.release(),
        }
    }
}

/// One run's zram device and policy; torn down on drop.
struct ZramDiskRun {
    policy: Option<PolicyThread>,
    front: Option<Arc<ZramFront>>,
    node: PathBuf,
    swap_on: bool,
}

impl ZramDisk {
    /// Creates the backing file (`swap_size` bytes, allocated) in
    /// `swap_dir` and a direct-I/O loop device over it (throttled for a
    /// disk profile). Fails where zram has no writeback.
    pub fn prepare(
        file: &Path,
        swap_size: u64,
        algorithm: &str,
        front: &FrontConfig,
        profile: DiskProfile,
    ) -> anyhow::Result<Self> {
        if let Err(why) = KernelFronts::probe().zram_writeback {
            return Err(anyhow!("zram+disk: {why}"));
        }
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(file)
            .map_err(|e| anyhow!("cannot create {}: {e}", file.display()))?;
        let mut z = Self {
            file: file.to_owned(),
            created: true,
            backing: None,
            zram: ZramFrontConfig { algorithm: algorithm.to_owned(), disksize: swap_size, mem_limit: front.limit },
            policy: front.policy(),
            run: None,
        };
        cmd("fallocate", &["-l", &swap_size.to_string(), &file.to_string_lossy()])?;
        let backing = match profile.limits() {
            Some(limits) => Backing::Throttled(ThrottledLoop::attach(file, limits)?),
            None => Backing::Plain(LoopDev::attach(file, true, false)?),
        };
        // As tmem's loop device: no writeback throttling below swap.
        swap::loop_disable_wbt(backing.dev()).map_err(|e| anyhow!("zram+disk: {e}"))?;
        z.backing = Some(backing);
        Ok(z)
    }

    /// The loop device below the zram device.
    #[must_use]
    pub fn backing_dev(&self) -> Option<&Path> {
        self.backing.as_ref().map(Backing::dev)
    }

    /// The zram device of the run in progress.
    #[must_use]
    pub fn node(&self) -> Option<&Path> {
        self.run.as_ref().map(|r| r.node.as_path())
    }

    /// A fresh zram device over the backing device, swapped on, with the policy running.
    pub fn activate(&mut self) -> anyhow::Result<()> {
        let backing = self.backing_dev().ok_or_else(|| anyhow!("zram+disk: no backing device"))?.to_owned();
        let front = Arc::new(ZramFront::create(&self.zram, &backing).map_err(|e| anyhow!("zram+disk: {e}"))?);
        let node = front.node();
        let run = self.run.insert(ZramDiskRun { policy: None, front: Some(front.clone()), node, swap_on: false });
        let node = run.node.to_string_lossy().into_owned();
        cmd("mkswap", &["--label", "tmem-bench-zram-disk", &node])?;
        run.swap_on = true;
        cmd("swapon", &["--discard", "--priority", &RAM_PRIORITY.to_string(), &node])?;
        let base = FrontStats {
            front: "zram".into(),
            node: node.clone(),
            reason: "tmem bench: zram+disk, the kernel's zram writing back to a disk file".into(),
            ..FrontStats::default()
        };
        let ops: Arc<dyn FrontOps> = front;
        run.policy = Some(PolicyThread::spawn(ops, self.policy.clone(), base).map_err(|e| anyhow!("zram+disk: {e}"))?);
        Ok(())
    }

    /// Stops the policy, swapoff, removes the zram device.
    pub fn deactivate(&mut self) -> anyhow::Result<()> {
        match self.run.take() {
            Some(mut r) => r.teardown(),
            None => Ok(()),
        }
    }

    /// The pool now (zram's `mem_used_total`) and its writeback counters (`bd_stat`).
    #[must_use]
    pub fn sample(&self) -> PoolSample {
        let Some(s) = self.run.as_ref().and_then(|r| r.front.as_ref()).and_then(|f| f.sample().ok()) else {
            return PoolSample::default();
        };
        PoolSample {
            pool_bytes: s.pool_bytes,
            stored_bytes: s.stored_bytes,
            front_pool_bytes: s.pool_bytes,
            written_back: s.written,
            read_back: s.read_back,
            ..PoolSample::default()
        }
    }

    /// zram's `mem_used_max`.
    #[must_use]
    pub fn pool_high_water(&self) -> Option<u64> {
        let node = self.node()?;
        let name = node.file_name()?.to_string_lossy().into_owned();
        tmem_sys::zram::mm_stat(&name).ok().map(|m| m.mem_used_max)
    }

    /// The policy's counters (idle age, backoffs ...) now.
    #[must_use]
    pub fn front_stats(&self) -> Option<serde_json::Value> {
        let stats = self.run.as_ref()?.policy.as_ref()?.stats();
        serde_json::to_value(stats).ok()
    }

    /// Undoes everything: the run, the loop device, the file.
    pub fn finish(&mut self) -> anyhow::Result<()> {
        self.deactivate()?;
        if let Some(b) = self.backing.take() {
            b.release()?;
        }
        if std::mem::take(&mut self.created) {
            std::fs::remove_file(&self.file).map_err(|e| anyhow!("cannot remove {}: {e}", self.file.display()))?;
        }
        Ok(())
    }
}

impl Drop for ZramDisk {
    fn drop(&mut self) {
        if let Err(e) = self.finish() {
            tracing::warn!(
                "zram+disk not torn down: {e}; swapoff its zram device, losetup -d, rm {}",
                self.file.display()
            );
        }
    }
}

impl ZramDiskRun {
    /// Stops at the first failure; what is left is retried on drop.
    fn teardown(&mut self) -> anyhow::Result<()> {
        if let Some(p) = self.policy.take() {
            p.stop();
        }
        if self.swap_on {
            if swap::is_swap(&self.node)? {
                cmd("swapoff", &[&self.node.to_string_lossy()])?;
            }
            self.swap_on = false;
        }
        if let Some(front) = self.front.take() {
            // The policy thread, which held the other reference, has ended.
            match Arc::try_unwrap(front) {
                Ok(f) => f.remove().map_err(|e| anyhow!("zram+disk: {e}"))?,
                Err(f) => {
                    self.front = Some(f);
                    return Err(anyhow!("zram+disk: the zram device is still in use"));
                }
            }
        }
        Ok(())
    }
}

impl Drop for ZramDiskRun {
    fn drop(&mut self) {
        if let Err(e) = self.teardown() {
            tracing::warn!("zram+disk: {} not removed: {e}", self.node.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        front: FrontArgs,
    }

    #[test]
    fn defaults_are_relative_to_the_job_and_one_policy_for_every_row() {
        let a = Cli::parse_from(["x"]).front;
        let c = a.config(1 << 30);
        assert_eq!(c, FrontConfig { limit: 342 << 20, idle_age_secs: 5, fill_percent: 50, rate: 25_600 });
        assert_eq!(c, FrontConfig::for_reference(1 << 30));
        // Small jobs get the floor, whole MiB.
        assert_eq!(a.config(40 << 20).limit, 16 << 20);
        assert_eq!(FrontConfig::relative_limit(300 << 20), 100 << 20);
        assert_eq!(FrontConfig::relative_limit((300 << 20) + 3), 101 << 20);
        let p = c.policy();
        assert_eq!((p.idle_age, p.max_idle_age), (Duration::from_secs(5), Duration::from_secs(160)));
        assert_eq!((p.budget, p.fill_percent, p.rate), (342 << 20, 50, 25_600));
        assert_eq!((p.tick, p.min_rate), (PolicyConfig::default().tick, 400));
        // The daemon's policy for the same flags.
        let daemon = tmem_daemon::front::FrontArgs {
            front_limit: tmem_daemon::spec::PoolLimit::Bytes(c.limit),
            front_idle_age: 5.0,
            front_fill: c.fill_percent,
            front_rate: c.rate,
            ..tmem_daemon::front::FrontArgs::default()
        };
        assert_eq!(daemon.policy(1 << 34), p, "zram+disk runs the policy zram+tmem's daemon runs");
        let given = Cli::parse_from(["x", "--front-limit", "64M", "--front-idle-age", "2", "--front-fill", "0"]).front;
        let c = given.config(1 << 30);
        assert_eq!((c.limit, c.idle_age_secs, c.fill_percent), (64 << 20, 2, 0));
        assert_eq!(
            c.daemon_args("zram", "lz4").join(" "),
            "--front zram --front-limit 67108864 --front-algorithm lz4 --front-idle-age 2 --front-fill 0 --front-rate 25600"
        );
        assert!(Cli::try_parse_from(["x", "--front-fill", "101"]).is_err());
        assert!(Cli::try_parse_from(["x", "--front-idle-age", "0"]).is_err());
    }

    #[test]
    fn rows_without_zram_writeback_are_skipped_with_the_reason() {
        let a = Availability { zram_writeback: Some(Err("no backing_dev attribute".into())), zswap: Ok(()) };
        for k in [BackendKind::ZramTmem, BackendKind::ZramDisk] {
            let why = a.why_not(k).unwrap();
            assert!(why.contains("zram writeback") && why.contains("no backing_dev"), "{why}");
        }
        for k in [BackendKind::Zram, BackendKind::Tmem, BackendKind::ZswapTmem] {
            assert_eq!(a.why_not(k), None);
        }
        let no_zswap = Availability { zram_writeback: None, zswap: Err("this kernel has no zswap".into()) };
        assert_eq!(no_zswap.why_not(BackendKind::ZswapTmem).as_deref(), Some("this kernel has no zswap"));
        let s = Skipped { backend: "zram+disk".into(), reason: "needs zram writeback: x".into() };
        assert_eq!(s.to_string(), "SKIP: zram+disk: needs zram writeback: x");
    }
}
