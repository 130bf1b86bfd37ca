//! The front in the daemon (`--front`, crate `tmem_front`): which one,
//! set up per swap device, its policy thread, its counters, and undoing
//! it on `swap down`, after a crash and across a hand-over.
//!
//! * `zram`: per swap device, a zram device of the daemon's own whose
//!   backing device is the device's loop device; swap goes on the zram
//!   device alone, and a policy thread per zram device writes idle pages
//!   back. Recorded in the device's status (`front_node`, `front_zram`), so
//!   the state file names it for crash recovery, and a successor adopts it.
//! * `zswap`: the loop devices are swap as without a front; zswap's
//!   parameters and the managed cgroups' limits are saved to
//!   [`FRONT_FILE`] before they change, restored on `swap down`, by crash
//!   recovery and by the last daemon of a hand-over chain. One policy
//!   thread for the machine.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tmem_front::policy::{PolicyConfig, PolicyThread};
use tmem_front::zram::{Below, ZramFront, ZramFrontConfig};
use tmem_front::zswap::{Saved, ZswapFront, ZswapFrontConfig};
use tmem_front::{Choice, Front, FrontKind, FrontStats};

use crate::runtime::RuntimeDir;
use crate::spec::{check_after, parse_after, PoolLimit};
use crate::DaemonError;

/// zswap's values before the daemon changed them, in the runtime directory.
pub const FRONT_FILE: &str = "front.json";

/// `--front` and its settings, shared by every command that sets up swap.
#[derive(clap::Args, Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FrontArgs {
    /// The kernel's compressed swap in front of tmem: zram (with writeback
    /// to tmem's device), zswap, none, or auto (zram where the kernel has
    /// zram writeback, otherwise none).
    #[arg(long, default_value = "auto", value_parser = parse_kind)]
    pub front: FrontKind,
    /// The front's budget: writeback to tmem starts at --front-fill of it;
    /// also zram's mem_limit. A size, or a percentage of RAM.
    #[arg(long, default_value = "10%")]
    pub front_limit: PoolLimit,
    /// The front's compressor: zram's comp_algorithm, zswap's compressor.
    #[arg(long, default_value = "lz4")]
    pub front_algorithm: String,
    /// Seconds a page must go unaccessed in the front before it goes down
    /// to tmem (the policy lengthens it when pages come back).
    #[arg(long, default_value_t = 30.0, value_parser = parse_age)]
    pub front_idle_age: f64,
    /// Fill level of the budget, %, below which nothing goes down.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u64).range(0..=100))]
    pub front_fill: u64,
    /// Pages a second the front may write back to tmem, at most (it starts
    /// at 1/64 of it, and doubles while what goes down stays down).
    #[arg(long, default_value_t = 25_600, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    pub front_rate: u64,
    /// zswap on cgroup v2: a cgroup directory whose memory.zswap.max is set
    /// to the budget while tmem runs. Repeatable.
    #[arg(long = "front-cgroup", value_name = "DIR")]
    pub front_cgroups: Vec<PathBuf>,
}

impl Default for FrontArgs {
    fn default() -> Self {
        Self {
            front: FrontKind::Auto,
            front_limit: PoolLimit::Percent(10),
            front_algorithm: "lz4".into(),
            front_idle_age: 30.0,
            front_fill: 50,
            front_rate: 25_600,
            front_cgroups: Vec::new(),
        }
    }
}

fn parse_kind(s: &str) -> Result<FrontKind, String> {
    s.parse().map_err(|e: tmem_front::FrontError| e.to_string())
}

/// `--front-idle-age`: 1 to 86400 seconds.
pub fn parse_age(s: &str) -> Result<f64, String> {
    let secs = parse_after(s)?;
    check_age(secs)
}

/// `swap.front-idle-age` and `--front-idle-age`: 1 to 86400 seconds (zram
/// counts ages in whole seconds).
pub fn check_age(secs: f64) -> Result<f64, String> {
    check_after(secs).and_then(|s| match s >= 1.0 {
        true => Ok(s),
        false => Err(format!("{s} seconds is below the shortest idle age, 1 s")),
    })
}

impl FrontArgs {
    /// The budget in bytes.
    #[must_use]
    pub fn budget(&self, total_ram: u64) -> u64 {
        match self.front_limit {
            PoolLimit::Bytes(b) => b,
            PoolLimit::Percent(p) => total_ram.saturating_mul(u64::from(p)) / 100,
        }
    }

    /// Checks what can be checked before anything is set up.
    pub fn validate(&self, total_ram: u64) -> Result<(), DaemonError> {
        let bad = |why: String| Err(DaemonError::Invalid(why));
        if let Err(why) = check_age(self.front_idle_age) {
            return bad(format!("--front-idle-age: {why}"));
        }
        if self.front_fill > 100 {
            return bad(format!("--front-fill {} is above 100%", self.front_fill));
        }
        if self.front_rate == 0 {
            return bad("--front-rate must be at least 1 page a second".into());
        }
        if self.budget(total_ram) > total_ram {
            return bad(format!(
                "--front-limit {} is more than this machine's RAM",
                crate::human(self.budget(total_ram))
            ));
        }
        if self.front_algorithm.is_empty() || self.front_algorithm.len() > 64 {
            return bad(format!("--front-algorithm {:?}: expected a compressor's name", self.front_algorithm));
        }
        if !self.front_cgroups.is_empty() && self.front != FrontKind::Zswap {
            return bad("--front-cgroup sets zswap limits: it needs --front zswap".into());
        }
        for c in &self.front_cgroups {
            if !c.join("memory.zswap.max").is_file() {
                return bad(format!(
                    "--front-cgroup {}: no memory.zswap.max there (a cgroup v2 directory with the memory controller \
                     is needed)",
                    c.display()
                ));
            }
        }
        Ok(())
    }

    /// The policy's settings.
    #[must_use]
    pub fn policy(&self, total_ram: u64) -> PolicyConfig {
        let age = Duration::from_secs_f64(self.front_idle_age);
        PolicyConfig {
            idle_age: age,
            max_idle_age: age * 32,
            budget: self.budget(total_ram),
            fill_percent: self.front_fill,
            rate: self.front_rate,
            min_rate: (self.front_rate / 64).max(1),
            ..PolicyConfig::default()
        }
    }
}

/// A zram front of one device, and its policy.
struct ZramHandle {
    front: Arc<ZramFront>,
    policy: PolicyThread,
}

/// The zswap front, and its policy.
struct ZswapHandle {
    front: Arc<ZswapFront>,
    policy: PolicyThread,
}

/// The fronts a daemon runs.
#[derive(Default)]
pub struct Fronts {
    /// The choice and why.
    pub choice: Choice,
    zram: Vec<(usize, ZramHandle)>,
    zswap: Option<ZswapHandle>,
}

impl std::fmt::Debug for Fronts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fronts").field("choice", &self.choice).finish_non_exhaustive()
    }
}

fn front_err(e: tmem_front::FrontError) -> DaemonError {
    DaemonError::Setup(e.to_string())
}

fn base(choice: &Choice, node: String) -> FrontStats {
    FrontStats { front: choice.front.as_str().into(), node, reason: choice.reason.clone(), ..FrontStats::default() }
}

impl Fronts {
    /// Chooses the front for `args` on this kernel.
    pub fn choose(args: &FrontArgs) -> Result<Self, DaemonError> {
        let kernel = match args.front {
            FrontKind::None => {
                tmem_front::KernelFronts { zram_writeback: Err("not probed".into()), zswap: Err("not probed".into()) }
            }
            _ => tmem_front::KernelFronts::probe(),
        };
        let choice = tmem_front::choose(args.front, &kernel).map_err(|e| DaemonError::Invalid(e.to_string()))?;
        Ok(Self { choice, ..Self::default() })
    }

    /// A front chosen before (a successor's, from its predecessor's status).
    #[must_use]
    pub fn chosen(choice: Choice) -> Self {
        Self { choice, ..Self::default() }
    }

    /// The front in use.
    #[must_use]
    pub fn front(&self) -> Front {
        self.choice.front
    }

    /// Sets up zram in front of device `i`'s loop device `backing` (over
    /// `device`); returns the zram device's node (to mkswap and swapon)
    /// and id.
    pub fn zram_up(
        &mut self,
        i: usize,
        backing: &Path,
        device: &Arc<tmem_block::PoolDevice>,
        disksize: u64,
        args: &FrontArgs,
        total_ram: u64,
    ) -> Result<(PathBuf, u32), DaemonError> {
        let cfg =
            ZramFrontConfig { algorithm: args.front_algorithm.clone(), disksize, mem_limit: args.budget(total_ram) };
        let front = ZramFront::create(&cfg, backing).map_err(front_err)?.with_below(StoreBelow::of(device));
        let (node, id) = (front.node(), front.id());
        self.zram_policy(i, front, args, total_ram)?;
        Ok((node, id))
    }

    /// Adopts a predecessor's zram device `id` in front of `backing` (over
    /// `device`).
    pub fn zram_adopt(
        &mut self,
        i: usize,
        id: u32,
        backing: &Path,
        device: &Arc<tmem_block::PoolDevice>,
        args: &FrontArgs,
        total_ram: u64,
    ) -> Result<(), DaemonError> {
        let front = ZramFront::adopt(id, backing).map_err(front_err)?.with_below(StoreBelow::of(device));
        self.zram_policy(i, front, args, total_ram)
    }

    fn zram_policy(&mut self, i: usize, front: ZramFront, args: &FrontArgs, total_ram: u64) -> Result<(), DaemonError> {
        let front = Arc::new(front);
        let stats = base(&self.choice, front.node().display().to_string());
        let policy = PolicyThread::spawn(Arc::clone(&front) as _, args.policy(total_ram), stats).map_err(front_err)?;
        self.zram.push((i, ZramHandle { front, policy }));
        Ok(())
    }

    /// Sets zswap up in front of the devices: saves its values to
    /// [`FRONT_FILE`] first. `reads` counts pages read from the devices.
    pub fn zswap_up(
        &mut self,
        dir: &RuntimeDir,
        args: &FrontArgs,
        total_ram: u64,
        reads: Box<dyn Fn() -> u64 + Send + Sync>,
    ) -> Result<String, DaemonError> {
        let budget = args.budget(total_ram);
        let percent = u32::try_from((budget.saturating_mul(100) / total_ram.max(1)).clamp(1, 100)).unwrap_or(100);
        // zswap takes only what the kernel's crypto API offers; elsewhere it keeps its own.
        let offered = tmem_sys::zswap::compressors();
        let compressor = offered.contains(&args.front_algorithm).then(|| args.front_algorithm.clone());
        let compressor_note = match &compressor {
            Some(c) => format!("compressor {c}"),
            None => format!(
                "compressor left as it is ({} is not in this kernel's crypto API, which offers {})",
                args.front_algorithm,
                offered.join(", ")
            ),
        };
        let cfg = ZswapFrontConfig {
            compressor,
            max_pool_percent: percent,
            cgroups: args.front_cgroups.clone(),
            cgroup_max: Some(budget),
        };
        let save = |s: &Saved| {
            let json = serde_json::to_vec_pretty(s).map_err(|e| std::io::Error::other(e.to_string()));
            json.and_then(|j| dir.write_atomic(FRONT_FILE, &j).map_err(|e| std::io::Error::other(e.to_string())))
                .map_err(|source| tmem_front::FrontError::Cgroup {
                    path: dir.join(FRONT_FILE),
                    what: "saving zswap's values before changing them",
                    source,
                })
        };
        let front = match ZswapFront::apply(&cfg, &save, reads) {
            Ok(f) => f,
            Err(e) => {
                // What was set went back when the front dropped.
                let _ = dir.remove(FRONT_FILE);
                return Err(front_err(e));
            }
        };
        self.zswap_policy(front, args, total_ram)?;
        Ok(format!(
            "zswap in front: {compressor_note}, max_pool_percent {percent}, shrinker on{} (values before saved in \
             {FRONT_FILE})",
            match args.front_cgroups.len() {
                0 => String::new(),
                n => format!(", memory.zswap.max {} in {n} cgroup(s)", crate::human(budget)),
            }
        ))
    }

    /// Takes over the zswap values a predecessor saved.
    pub fn zswap_adopt(
        &mut self,
        dir: &RuntimeDir,
        args: &FrontArgs,
        total_ram: u64,
        reads: Box<dyn Fn() -> u64 + Send + Sync>,
    ) -> Result<(), DaemonError> {
        let saved = read_saved(dir)?.ok_or_else(|| DaemonError::Setup(format!("no {FRONT_FILE} to take over")))?;
        self.zswap_policy(ZswapFront::resume(saved, reads), args, total_ram)
    }

    fn zswap_policy(&mut self, front: ZswapFront, args: &FrontArgs, total_ram: u64) -> Result<(), DaemonError> {
        let front = Arc::new(front);
        let policy =
            PolicyThread::spawn(Arc::clone(&front) as _, args.policy(total_ram), base(&self.choice, "zswap".into()))
                .map_err(front_err)?;
        self.zswap = Some(ZswapHandle { front, policy });
        Ok(())
    }

    /// The counters of device `i`'s front, if it has one.
    #[must_use]
    pub fn stats(&self, i: usize) -> Option<FrontStats> {
        if let Some((_, h)) = self.zram.iter().find(|(d, _)| *d == i) {
            return Some(h.policy.stats());
        }
        self.zswap.as_ref().map(|h| h.policy.stats())
    }

    /// Removes device `i`'s zram front (after its swapoff): its policy
    /// stops, and the zram device goes.
    pub fn zram_down(&mut self, i: usize) -> Result<Option<String>, DaemonError> {
        let Some(at) = self.zram.iter().position(|(d, _)| *d == i) else { return Ok(None) };
        let (_, h) = self.zram.remove(at);
        h.policy.stop();
        let front = Arc::try_unwrap(h.front).map_err(|_| DaemonError::Teardown("zram front still in use".into()))?;
        let node = front.node();
        front.remove().map_err(|e| DaemonError::Teardown(e.to_string()))?;
        Ok(Some(format!("{}: removed (hot_remove)", node.display())))
    }

    /// Puts zswap's values back (after every swapoff) and removes [`FRONT_FILE`].
    pub fn zswap_down(&mut self, dir: &RuntimeDir) -> Result<Option<String>, DaemonError> {
        let Some(h) = self.zswap.take() else { return Ok(None) };
        h.policy.stop();
        let front = Arc::try_unwrap(h.front).map_err(|_| DaemonError::Teardown("zswap front still in use".into()))?;
        front.restore().map_err(|e| DaemonError::Teardown(e.to_string()))?;
        dir.remove(FRONT_FILE)?;
        Ok(Some("zswap: every value put back as it was".into()))
    }

    /// Stops the policies and gives the fronts up as they are, for a
    /// successor (the process exits next).
    pub fn release(&mut self) {
        for (_, h) in self.zram.drain(..) {
            h.policy.stop();
            if let Ok(f) = Arc::try_unwrap(h.front) {
                let _ = f.release();
            }
        }
        if let Some(h) = self.zswap.take() {
            h.policy.stop();
            if let Ok(f) = Arc::try_unwrap(h.front) {
                let _ = f.release();
            }
        }
    }
}

/// A device's store, below its zram front: the policy reclaims the pages
/// of blocks zram freed ([`tmem_block::PoolDevice::keep_only_marked`]).
#[derive(Debug)]
struct StoreBelow(Arc<tmem_block::PoolDevice>);

impl StoreBelow {
    fn of(device: &Arc<tmem_block::PoolDevice>) -> Arc<dyn Below> {
        Arc::new(Self(Arc::clone(device)))
    }
}

impl Below for StoreBelow {
    fn stored_pages(&self) -> u64 {
        self.0.store().stats().total.stored_pages
    }

    fn keep_only_marked(&self, mark: &mut dyn FnMut() -> Option<u64>) -> Option<u64> {
        match self.0.keep_only_marked(mark) {
            tmem_block::StaleSweep::Done { dropped, .. } => Some(dropped),
            tmem_block::StaleSweep::Interrupted => None,
        }
    }
}

/// Pages read from `devices` so far: what zswap's policy weighs its
/// writebacks against.
#[must_use]
pub fn pages_read(devices: Vec<Arc<tmem_block::PoolDevice>>) -> Box<dyn Fn() -> u64 + Send + Sync> {
    Box::new(move || devices.iter().map(|d| d.stats().read_bytes / 4096).sum())
}

/// zswap's values saved in `dir` by a daemon, if any.
pub fn read_saved(dir: &RuntimeDir) -> Result<Option<Saved>, DaemonError> {
    let Some(text) = dir.read_file(FRONT_FILE, 1 << 20)? else { return Ok(None) };
    serde_json::from_str(&text).map(Some).map_err(|e| {
        DaemonError::Invalid(format!(
            "{}: {e} (it records zswap's values before tmem changed them)",
            dir.join(FRONT_FILE).display()
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn bad_settings_name_the_flag() {
        let bad = |f: FrontArgs| f.validate(8 * GIB).unwrap_err().to_string();
        let d = FrontArgs::default;
        assert!(bad(FrontArgs { front_idle_age: 0.5, ..d() }).contains("--front-idle-age"));
        assert!(bad(FrontArgs { front_limit: PoolLimit::Bytes(9 * GIB), ..d() }).contains("--front-limit"));
        assert!(bad(FrontArgs { front_algorithm: String::new(), ..d() }).contains("--front-algorithm"));
        let e = bad(FrontArgs { front_cgroups: vec!["/sys/fs/cgroup/x".into()], ..d() });
        assert!(e.contains("--front-cgroup") && e.contains("--front zswap"), "{e}");
        let e = bad(FrontArgs { front: FrontKind::Zswap, front_cgroups: vec!["/nonexistent/tmem-test".into()], ..d() });
        assert!(e.contains("no memory.zswap.max"), "{e}");
        d().validate(8 * GIB).unwrap();
    }

    #[test]
    fn the_policy_follows_the_flags() {
        let f = FrontArgs {
            front_limit: PoolLimit::Percent(10),
            front_idle_age: 5.0,
            front_rate: 6400,
            ..FrontArgs::default()
        };
        let p = f.policy(10 * GIB);
        assert_eq!(p.budget, GIB);
        assert_eq!((p.idle_age, p.max_idle_age), (Duration::from_secs(5), Duration::from_secs(160)));
        assert_eq!((p.rate, p.min_rate, p.fill_percent), (6400, 100, 50));
    }
}
