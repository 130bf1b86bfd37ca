//! zswap in front: tmem's device is the swap device, and zswap (the
//! kernel's compressed cache in front of every swap device) keeps the hot
//! pages. tmem sets zswap's parameters and, on cgroup v2, the zswap limits
//! of the cgroups it is told to manage; zswap's shrinker writes the cold
//! pages back to tmem's device by itself, and the policy only lets it or
//! stops it (`shrinker_enabled`) by how many come back.
//!
//! Every value is saved before it is changed ([`Saved`]); the daemon
//! writes that to its runtime directory first, so `swap down`, a successor
//! and crash recovery can put each one back ([`ZswapFront::restore`],
//! [`restore_saved`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tmem_sys::zswap::ZswapSettings;

use crate::policy::{FrontOps, Sample};
use crate::FrontError;

/// zswap's settings while it is in front.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ZswapFrontConfig {
    /// Compressor (`None`: leave it).
    pub compressor: Option<String>,
    /// `max_pool_percent`: zswap's whole pool, % of RAM.
    pub max_pool_percent: u32,
    /// cgroup v2 directories whose `memory.zswap.max` is set.
    pub cgroups: Vec<PathBuf>,
    /// Their `memory.zswap.max`, bytes (`None`: `max`).
    pub cgroup_max: Option<u64>,
}

/// One cgroup's zswap files as they were.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SavedCgroup {
    /// The cgroup directory.
    pub path: PathBuf,
    /// `memory.zswap.max` before.
    pub zswap_max: String,
}

/// What was changed, and the values before.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Saved {
    /// Every zswap parameter before.
    pub params: BTreeMap<String, String>,
    /// The parameters changed.
    pub changed: Vec<String>,
    /// The cgroups changed.
    pub cgroups: Vec<SavedCgroup>,
}

/// zswap in front of tmem's device.
pub struct ZswapFront {
    settings: ZswapSettings,
    cgroups: Vec<SavedCgroup>,
    /// Pages read from tmem's device so far (the daemon's device counter).
    reads: Box<dyn Fn() -> u64 + Send + Sync>,
    /// `zswpwb` of /proc/vmstat when set up: zswap's writebacks since.
    written_base: u64,
}

impl std::fmt::Debug for ZswapFront {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZswapFront").field("settings", &self.settings).field("cgroups", &self.cgroups).finish()
    }
}

const ZSWAP_MAX: &str = "memory.zswap.max";

fn cgroup_err(path: PathBuf, what: &'static str) -> impl FnOnce(std::io::Error) -> FrontError {
    move |source| FrontError::Cgroup { path, what, source }
}

fn zswap_written() -> u64 {
    tmem_sys::vmstat::read().ok().and_then(|m| m.get("zswpwb").copied()).unwrap_or(0)
}

impl ZswapFront {
    /// Saves zswap's parameters and the cgroups' limits, hands them to
    /// `save` (which must make them durable: crash recovery restores from
    /// it), then sets them. `reads` counts the pages read from tmem's device.
    pub fn apply(
        cfg: &ZswapFrontConfig,
        save: &dyn Fn(&Saved) -> Result<(), FrontError>,
        reads: Box<dyn Fn() -> u64 + Send + Sync>,
    ) -> Result<Self, FrontError> {
        let settings = ZswapSettings::save()?;
        let mut cgroups = Vec::new();
        for dir in &cfg.cgroups {
            let path = dir.join(ZSWAP_MAX);
            let was = std::fs::read_to_string(&path)
                .map_err(cgroup_err(path.clone(), "reading it (cgroup v2 with zswap limits needed)"))?;
            cgroups.push(SavedCgroup { path: dir.clone(), zswap_max: was.trim().to_owned() });
        }
        let mut changed: Vec<String> =
            ["enabled", "max_pool_percent", "shrinker_enabled"].iter().map(|s| (*s).to_owned()).collect();
        if cfg.compressor.is_some() {
            changed.push("compressor".into());
        }
        changed.retain(|n| settings.original().contains_key(n));
        save(&Saved { params: settings.original().clone(), changed: changed.clone(), cgroups: cgroups.clone() })?;
        // Every parameter that may change is restored, also shrinker_enabled,
        // which the policy switches later without going through `set`.
        let (params, _) = settings.release();
        let settings = ZswapSettings::resume(params, changed);
        let mut front = Self { settings, cgroups: Vec::new(), reads, written_base: zswap_written() };
        if let Some(c) = &cfg.compressor {
            front.settings.set("compressor", c)?;
        }
        front.settings.set("max_pool_percent", &cfg.max_pool_percent.to_string())?;
        if front.settings.original().contains_key("shrinker_enabled") {
            front.settings.set("shrinker_enabled", "Y")?;
        }
        front.settings.set("enabled", "Y")?;
        let value = cfg.cgroup_max.map_or_else(|| "max".to_owned(), |b| b.to_string());
        for c in cgroups {
            let path = c.path.join(ZSWAP_MAX);
            // Recorded first: a failed write still gets restored.
            front.cgroups.push(c);
            std::fs::write(&path, &value).map_err(cgroup_err(path, "setting the zswap limit"))?;
        }
        Ok(front)
    }

    /// Takes over what a predecessor saved and set.
    #[must_use]
    pub fn resume(saved: Saved, reads: Box<dyn Fn() -> u64 + Send + Sync>) -> Self {
        Self {
            settings: ZswapSettings::resume(saved.params, saved.changed),
            cgroups: saved.cgroups,
            reads,
            written_base: zswap_written(),
        }
    }

    /// What it changed and the values before (for a successor).
    #[must_use]
    pub fn saved(&self) -> Saved {
        Saved {
            params: self.settings.original().clone(),
            changed: self.settings.changed().to_vec(),
            cgroups: self.cgroups.clone(),
        }
    }

    /// Gives everything up without restoring it (a hand-over).
    #[must_use]
    pub fn release(self) -> Saved {
        let Self { settings, cgroups, .. } = self;
        let (params, changed) = settings.release();
        Saved { params, changed, cgroups }
    }

    /// Puts every value back; tries all of them.
    pub fn restore(self) -> Result<(), FrontError> {
        restore_saved(self.release())
    }
}

/// Puts back what a (possibly dead) daemon saved: every cgroup limit, then
/// zswap's parameters in their safe order. Tries all; reports the first failure.
pub fn restore_saved(saved: Saved) -> Result<(), FrontError> {
    let mut first = None;
    for c in &saved.cgroups {
        let path = c.path.join(ZSWAP_MAX);
        // A cgroup that is gone needs nothing back.
        if !Path::new(&c.path).is_dir() {
            continue;
        }
        if let Err(e) = std::fs::write(&path, &c.zswap_max) {
            first.get_or_insert(FrontError::Cgroup { path, what: "restoring the zswap limit", source: e });
        }
    }
    let mut settings = ZswapSettings::resume(saved.params, saved.changed);
    if let Err(e) = settings.restore() {
        first.get_or_insert(e.into());
    }
    first.map_or(Ok(()), Err)
}

impl FrontOps for ZswapFront {
    fn sample(&self) -> Result<Sample, FrontError> {
        let read_back = (self.reads)();
        Ok(Sample {
            pool_bytes: tmem_sys::zswap::pool_bytes()?,
            stored_bytes: tmem_sys::zswap::stored_bytes(),
            written: zswap_written().saturating_sub(self.written_base),
            read_back,
            // zswpin counts the loads from zswap's pool alone.
            front_reads: tmem_sys::vmstat::SwapCounters::now().ok().map(|c| c.zswpin + read_back),
            // Its pages below are swap slots: the swap area's own discard frees them.
            below_pages: None,
            below_stored: None,
        })
    }

    fn write_back_idle(&self, _age: std::time::Duration, _max_pages: u64) -> Result<u64, FrontError> {
        // zswap's shrinker picks the cold pages itself.
        Ok(0)
    }

    fn allow_writeback(&self, on: bool) -> Result<(), FrontError> {
        if !self.settings.original().contains_key("shrinker_enabled") {
            return Ok(());
        }
        let path = Path::new(tmem_sys::zswap::PARAMS_DIR).join("shrinker_enabled");
        let value = if on { "Y" } else { "N" };
        std::fs::write(&path, value)
            .map_err(|source| tmem_sys::zswap::ZswapError::Write { path, value: value.to_owned(), source }.into())
    }
}
