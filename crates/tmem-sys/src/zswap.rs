//! zswap: its module parameters (saved, changed, and put back), its pool size
//! and its debugfs counters.
//!
//! [`ZswapSettings`] snapshots every parameter under
//! `/sys/module/zswap/parameters` before anything is changed; [`ZswapSettings::set`]
//! records what it changes and [`ZswapSettings::restore`] (or dropping the value)
//! writes the original values back, in an order that never leaves zswap enabled
//! with a half-restored configuration.
//!
//! The pool size comes from `/proc/meminfo` (`Zswap:`, kernels 5.19+) or from
//! debugfs (`/sys/kernel/debug/zswap/pool_total_size`); [`DebugfsMount`]
//! mounts debugfs when it is not mounted and unmounts it again on drop.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

/// The module parameter directory.
pub const PARAMS_DIR: &str = "/sys/module/zswap/parameters";
/// Where debugfs is normally mounted.
pub const DEBUGFS: &str = "/sys/kernel/debug";

/// Errors of the zswap plumbing.
#[derive(Debug, thiserror::Error)]
pub enum ZswapError {
    /// zswap is not built into this kernel.
    #[error("zswap is not available ({PARAMS_DIR} missing)")]
    Unavailable,
    /// Reading a file failed.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// File.
        path: PathBuf,
        /// Cause.
        source: io::Error,
    },
    /// Writing a parameter failed.
    #[error("cannot write {value:?} to {}: {source}", path.display())]
    Write {
        /// File.
        path: PathBuf,
        /// Value.
        value: String,
        /// Cause.
        source: io::Error,
    },
    /// A parameter did not take the value written.
    #[error("{name}: wrote {wrote:?} but it reads {reads:?}")]
    NotApplied {
        /// Parameter.
        name: String,
        /// Value written.
        wrote: String,
        /// Value read back.
        reads: String,
    },
    /// Unknown parameter.
    #[error("zswap has no parameter {0:?}")]
    UnknownParam(String),
    /// Mounting or unmounting debugfs failed.
    #[error("{0}")]
    Mount(String),
    /// A restore failed; the message says what to write by hand.
    #[error("zswap parameters not restored: {0}")]
    Restore(String),
}

/// Whether this kernel has zswap.
#[must_use]
pub fn available() -> bool {
    Path::new(PARAMS_DIR).join("enabled").exists()
}

/// The compressors the kernel's crypto API offers (`/proc/crypto` entries
/// of type `scomp` or `acomp`): what zswap's `compressor` may name. zram
/// has its own back ends, so a zram algorithm may be missing here. (While
/// zswap is not yet set up the kernel takes any name, and falls back to its
/// built-in default when it starts: check before setting.)
#[must_use]
pub fn compressors() -> Vec<String> {
    parse_compressors(&std::fs::read_to_string("/proc/crypto").unwrap_or_default())
}

/// [`compressors`] from `/proc/crypto`'s text.
#[must_use]
pub fn parse_compressors(text: &str) -> Vec<String> {
    let mut out: Vec<String> = text
        .split("\n\n")
        .filter_map(|entry| {
            let field = |k: &str| {
                entry.lines().find_map(|l| {
                    let (key, v) = l.split_once(':')?;
                    (key.trim() == k).then(|| v.trim().to_owned())
                })
            };
            matches!(field("type")?.as_str(), "scomp" | "acomp").then(|| field("name")).flatten()
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Reads every parameter of `dir` (file name → trimmed content).
pub fn read_params(dir: &Path) -> Result<BTreeMap<String, String>, ZswapError> {
    let rd = |source| ZswapError::Read { path: dir.to_owned(), source };
    let mut m = BTreeMap::new();
    for e in std::fs::read_dir(dir).map_err(rd)? {
        let e = e.map_err(rd)?;
        let path = e.path();
        let text = std::fs::read_to_string(&path).map_err(|source| ZswapError::Read { path: path.clone(), source })?;
        m.insert(e.file_name().to_string_lossy().into_owned(), text.trim().to_owned());
    }
    Ok(m)
}

/// Whether a boolean parameter value means "on" (`Y`, `y`, `1`).
#[must_use]
pub fn is_on(v: &str) -> bool {
    matches!(v.trim(), "Y" | "y" | "1")
}

/// Whether two parameter values mean the same (`Y` and `1`, `N` and `0`).
#[must_use]
pub fn same_value(a: &str, b: &str) -> bool {
    let norm = |v: &str| match v.trim() {
        "Y" | "y" | "1" => "Y".to_owned(),
        "N" | "n" | "0" => "N".to_owned(),
        other => other.to_owned(),
    };
    norm(a) == norm(b)
}

/// The writes that put `changed` parameters back to `original`, in order.
///
/// When zswap was originally disabled, `enabled` goes first (nothing else
/// then matters to a live pool); when it was originally enabled, it goes last,
/// after the compressor and limits are back. Parameters whose original value
/// is unknown are skipped.
#[must_use]
pub fn restore_plan(original: &BTreeMap<String, String>, changed: &[String]) -> Vec<(String, String)> {
    let mut plan: Vec<(String, String)> = Vec::new();
    for name in changed {
        if plan.iter().any(|(n, _)| n == name) {
            continue;
        }
        if let Some(v) = original.get(name) {
            plan.push((name.clone(), v.clone()));
        }
    }
    if let Some(i) = plan.iter().position(|(n, _)| n == "enabled") {
        let e = plan.remove(i);
        if is_on(&e.1) {
            plan.push(e);
        } else {
            plan.insert(0, e);
        }
    }
    plan
}

/// zswap parameters saved before a change; restored on [`ZswapSettings::restore`] or drop.
#[derive(Debug)]
pub struct ZswapSettings {
    dir: PathBuf,
    original: BTreeMap<String, String>,
    changed: Vec<String>,
}

impl ZswapSettings {
    /// Snapshots `/sys/module/zswap/parameters`.
    pub fn save() -> Result<Self, ZswapError> {
        if !available() {
            return Err(ZswapError::Unavailable);
        }
        Self::save_in(Path::new(PARAMS_DIR))
    }

    /// Snapshots the parameters in `dir` (tests use a plain directory).
    pub fn save_in(dir: &Path) -> Result<Self, ZswapError> {
        Ok(Self { dir: dir.to_owned(), original: read_params(dir)?, changed: Vec::new() })
    }

    /// Settings saved by another process (a daemon that died, or that hands
    /// over to its successor): `original` values, and the parameters it
    /// changed. [`ZswapSettings::restore`] (or drop) puts them back.
    #[must_use]
    pub fn resume(original: BTreeMap<String, String>, changed: Vec<String>) -> Self {
        Self { dir: PathBuf::from(PARAMS_DIR), original, changed }
    }

    /// Gives the settings up without restoring them (for a successor to
    /// [`ZswapSettings::resume`]): the original values and what changed.
    #[must_use]
    pub fn release(mut self) -> (BTreeMap<String, String>, Vec<String>) {
        (std::mem::take(&mut self.original), std::mem::take(&mut self.changed))
    }

    /// The parameters changed so far.
    #[must_use]
    pub fn changed(&self) -> &[String] {
        &self.changed
    }

    /// The values found when saved.
    #[must_use]
    pub fn original(&self) -> &BTreeMap<String, String> {
        &self.original
    }

    /// Reads one parameter now.
    pub fn get(&self, name: &str) -> Result<String, ZswapError> {
        let path = self.dir.join(name);
        std::fs::read_to_string(&path).map(|s| s.trim().to_owned()).map_err(|source| ZswapError::Read { path, source })
    }

    /// Sets a parameter (if it does not already have that value) and checks it
    /// took; remembers it for [`ZswapSettings::restore`].
    pub fn set(&mut self, name: &str, value: &str) -> Result<(), ZswapError> {
        if !self.original.contains_key(name) {
            return Err(ZswapError::UnknownParam(name.to_owned()));
        }
        if same_value(&self.get(name)?, value) {
            return Ok(());
        }
        if !self.changed.iter().any(|c| c == name) {
            self.changed.push(name.to_owned());
        }
        self.write(name, value)
    }

    fn write(&self, name: &str, value: &str) -> Result<(), ZswapError> {
        let path = self.dir.join(name);
        std::fs::write(&path, value).map_err(|source| ZswapError::Write { path, value: value.to_owned(), source })?;
        let reads = self.get(name)?;
        if !same_value(&reads, value) {
            return Err(ZswapError::NotApplied { name: name.to_owned(), wrote: value.to_owned(), reads });
        }
        Ok(())
    }

    /// Writes back the original value of every parameter changed; tries all
    /// of them even if one fails. Idempotent.
    pub fn restore(&mut self) -> Result<(), ZswapError> {
        let plan = restore_plan(&self.original, &self.changed);
        let mut failed = Vec::new();
        for (name, value) in &plan {
            if let Err(e) = self.write(name, value) {
                failed.push(format!("{e} (do: echo {value} > {})", self.dir.join(name).display()));
            }
        }
        self.changed.clear();
        if failed.is_empty() {
            Ok(())
        } else {
            Err(ZswapError::Restore(failed.join("; ")))
        }
    }
}

impl Drop for ZswapSettings {
    fn drop(&mut self) {
        if let Err(e) = self.restore() {
            tracing::warn!("{e}");
        }
    }
}

/// Whether `target` has a mount of type `fstype` in `/proc/mounts`-format `text`.
#[must_use]
pub fn is_mounted_in(text: &str, target: &str, fstype: &str) -> bool {
    text.lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.len() >= 3 && f[1] == target && f[2] == fstype
    })
}

/// debugfs at [`DEBUGFS`]; unmounted on drop if we mounted it.
#[derive(Debug)]
pub struct DebugfsMount {
    mounted_by_us: bool,
}

impl DebugfsMount {
    /// Mounts debugfs at [`DEBUGFS`] unless it is mounted already.
    pub fn ensure() -> Result<Self, ZswapError> {
        let mounts = std::fs::read_to_string("/proc/mounts")
            .map_err(|source| ZswapError::Read { path: "/proc/mounts".into(), source })?;
        if is_mounted_in(&mounts, DEBUGFS, "debugfs") {
            return Ok(Self { mounted_by_us: false });
        }
        let out = std::process::Command::new("mount")
            .args(["-t", "debugfs", "debugfs", DEBUGFS])
            .output()
            .map_err(|e| ZswapError::Mount(format!("cannot run mount: {e}")))?;
        if !out.status.success() {
            return Err(ZswapError::Mount(format!(
                "mount -t debugfs debugfs {DEBUGFS} failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(Self { mounted_by_us: true })
    }

    /// Whether this value mounted debugfs (and will unmount it).
    #[must_use]
    pub fn mounted_by_us(&self) -> bool {
        self.mounted_by_us
    }

    /// Unmounts debugfs if we mounted it.
    pub fn release(mut self) -> Result<(), ZswapError> {
        self.unmount()
    }

    fn unmount(&mut self) -> Result<(), ZswapError> {
        if !std::mem::take(&mut self.mounted_by_us) {
            return Ok(());
        }
        let out = std::process::Command::new("umount")
            .arg(DEBUGFS)
            .output()
            .map_err(|e| ZswapError::Mount(format!("cannot run umount: {e}")))?;
        if !out.status.success() {
            return Err(ZswapError::Mount(format!(
                "umount {DEBUGFS} failed: {}; unmount it by hand",
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(())
    }
}

impl Drop for DebugfsMount {
    fn drop(&mut self) {
        if let Err(e) = self.unmount() {
            tracing::warn!("{e}");
        }
    }
}

/// zswap's debugfs counters (`pool_total_size`, `stored_pages`,
/// `written_back_pages`, `reject_*`, `pool_limit_hit`, ...), if debugfs is mounted.
pub fn debug_stats() -> Result<BTreeMap<String, u64>, ZswapError> {
    let dir = Path::new(DEBUGFS).join("zswap");
    let rd = |source| ZswapError::Read { path: dir.clone(), source };
    let mut m = BTreeMap::new();
    for e in std::fs::read_dir(&dir).map_err(rd)? {
        let e = e.map_err(rd)?;
        if let Ok(text) = std::fs::read_to_string(e.path()) {
            if let Ok(v) = text.trim().parse::<u64>() {
                m.insert(e.file_name().to_string_lossy().into_owned(), v);
            }
        }
    }
    Ok(m)
}

/// Bytes of memory the zswap pool uses now: `Zswap:` of `/proc/meminfo`,
/// else debugfs `pool_total_size`.
pub fn pool_bytes() -> Result<u64, ZswapError> {
    if let Ok(b) = crate::swap::meminfo_field("Zswap") {
        return Ok(b);
    }
    let path = Path::new(DEBUGFS).join("zswap/pool_total_size");
    let text = std::fs::read_to_string(&path).map_err(|source| ZswapError::Read { path: path.clone(), source })?;
    text.trim().parse().map_err(|_| ZswapError::Read { path, source: io::Error::other(format!("bad value {text:?}")) })
}

/// Bytes of (uncompressed) pages zswap holds now: `Zswapped:` of `/proc/meminfo`
/// (0 when the kernel does not report it).
#[must_use]
pub fn stored_bytes() -> u64 {
    crate::swap::meminfo_field("Zswapped").unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compressors_are_the_scomp_and_acomp_entries() {
        let text = "name         : aes\ndriver       : aes-aesni\ntype         : cipher\n\n\
                    name         : lzo-rle\ndriver       : lzo-rle-scomp\ntype         : scomp\n\n\
                    name         : deflate\ntype         : acomp\n\n\
                    name         : lzo-rle\ndriver       : lzo-rle-generic\ntype         : scomp\n";
        assert_eq!(parse_compressors(text), ["deflate", "lzo-rle"]);
        assert!(parse_compressors("").is_empty());
    }

    fn map(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn restore_plan_orders_enabled() {
        let orig = map(&[("enabled", "N"), ("compressor", "lzo"), ("max_pool_percent", "20")]);
        let changed = vec!["compressor".to_owned(), "max_pool_percent".to_owned(), "enabled".to_owned()];
        let p = restore_plan(&orig, &changed);
        assert_eq!(p[0], ("enabled".to_owned(), "N".to_owned()), "disable first");
        assert_eq!(p.len(), 3);
        let orig = map(&[("enabled", "Y"), ("compressor", "zstd")]);
        let p = restore_plan(&orig, &["enabled".to_owned(), "compressor".to_owned(), "compressor".to_owned()]);
        assert_eq!(p, vec![("compressor".into(), "zstd".into()), ("enabled".into(), "Y".into())], "enable last");
        assert!(restore_plan(&orig, &["nope".to_owned()]).is_empty());
        assert!(restore_plan(&orig, &[]).is_empty());
    }

    #[test]
    fn values_compare_like_the_kernel_prints_them() {
        assert!(same_value("Y", "1") && same_value("N", "0") && same_value("lzo-rle\n", "lzo-rle"));
        assert!(!same_value("Y", "N") && !same_value("lzo", "lzo-rle"));
        assert!(is_on("Y") && is_on("1") && !is_on("N"));
    }

    #[test]
    fn settings_are_saved_changed_and_restored() {
        let dir = std::env::temp_dir().join(format!("tmem-zswap-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (k, v) in
            [("enabled", "N\n"), ("compressor", "lzo\n"), ("max_pool_percent", "20\n"), ("shrinker_enabled", "N\n")]
        {
            std::fs::write(dir.join(k), v).unwrap();
        }
        {
            let mut s = ZswapSettings::save_in(&dir).unwrap();
            assert_eq!(s.original()["compressor"], "lzo");
            s.set("compressor", "lzo-rle").unwrap();
            s.set("max_pool_percent", "20").unwrap(); // unchanged: not recorded
            s.set("enabled", "Y").unwrap();
            assert!(matches!(s.set("bogus", "1"), Err(ZswapError::UnknownParam(_))));
            assert_eq!(s.get("compressor").unwrap(), "lzo-rle");
            assert_eq!(s.changed, vec!["compressor".to_owned(), "enabled".to_owned()]);
            s.restore().unwrap();
            assert_eq!(s.get("compressor").unwrap(), "lzo");
            assert_eq!(s.get("enabled").unwrap(), "N");
            s.set("enabled", "1").unwrap();
        } // drop restores
        assert_eq!(std::fs::read_to_string(dir.join("enabled")).unwrap(), "N");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn mounts_are_parsed() {
        let t = "sysfs /sys sysfs rw 0 0\ndebugfs /sys/kernel/debug debugfs rw 0 0\n";
        assert!(is_mounted_in(t, "/sys/kernel/debug", "debugfs"));
        assert!(!is_mounted_in(t, "/sys/kernel/debug", "tracefs"));
        assert!(!is_mounted_in("", "/sys/kernel/debug", "debugfs"));
    }
}
