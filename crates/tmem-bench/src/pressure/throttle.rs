//! Disk profiles for the rows that swap to disk (`disk`, `zswap`) and the
//! tmem+disk tier: the disk file is put behind a loop device with direct
//! I/O (so the page cache cannot absorb what should reach the disk), and
//! that device's I/O is throttled to the profile's bandwidth and IOPS.
//!
//! Why the root group of the cgroup v1 blkio hierarchy: on v1 the kernel
//! charges swap-out writes to the root blkio group whatever memory cgroup
//! the page belongs to, and the daemon's tier I/O runs there too, so a rule
//! in the root group for this one loop device throttles all of it and
//! nothing else. The rule is cleared before the device is detached (a rule
//! left behind would throttle the next user of that loop device). cgroup v2
//! has no limits at its root; profiles are not built for it.

use anyhow::anyhow;
use std::path::{Path, PathBuf};

use crate::cache::setup::{blkio_root, LoopDev, Mounted};

use super::cmd;

/// A disk profile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DiskProfile {
    /// The host's disk as it is (it may cache in the hypervisor).
    Host,
    /// NVMe class: 2,000 MB/s read, 1,500 MB/s write, 200,000 IOPS each way.
    Nvme,
    /// Cloud volume class (a general-purpose cloud SSD volume's baseline):
    /// 125 MB/s and 3,000 IOPS each way.
    Cloud,
}

/// Throttle limits (bytes/s, I/Os per s).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DiskLimits {
    /// Read bandwidth.
    pub read_bps: u64,
    /// Write bandwidth.
    pub write_bps: u64,
    /// Read IOPS.
    pub read_iops: u64,
    /// Write IOPS.
    pub write_iops: u64,
}

impl DiskProfile {
    /// Its limits; `None` for the host's disk.
    #[must_use]
    pub fn limits(self) -> Option<DiskLimits> {
        const MB: u64 = 1_000_000;
        match self {
            Self::Host => None,
            Self::Nvme => Some(DiskLimits {
                read_bps: 2_000 * MB,
                write_bps: 1_500 * MB,
                read_iops: 200_000,
                write_iops: 200_000,
            }),
            Self::Cloud => {
                Some(DiskLimits { read_bps: 125 * MB, write_bps: 125 * MB, read_iops: 3_000, write_iops: 3_000 })
            }
        }
    }

    /// For reports.
    #[must_use]
    pub fn describe(self) -> String {
        match self.limits() {
            None => "the host's disk, unthrottled".into(),
            Some(l) => format!(
                "{} read {} MB/s {} IOPS, write {} MB/s {} IOPS",
                match self {
                    Self::Nvme => "NVMe class:",
                    _ => "cloud volume class:",
                },
                l.read_bps / 1_000_000,
                l.read_iops,
                l.write_bps / 1_000_000,
                l.write_iops
            ),
        }
    }
}

/// The throttle files of the blkio root and their values for `l`.
fn rules(l: DiskLimits) -> [(&'static str, u64); 4] {
    [
        ("blkio.throttle.read_bps_device", l.read_bps),
        ("blkio.throttle.write_bps_device", l.write_bps),
        ("blkio.throttle.read_iops_device", l.read_iops),
        ("blkio.throttle.write_iops_device", l.write_iops),
    ]
}

/// Throttle rules for one device in the blkio root; cleared on drop.
struct RootRules {
    root: PathBuf,
    maj_min: String,
    cleared: bool,
}

impl RootRules {
    fn clear(&mut self) -> anyhow::Result<()> {
        if std::mem::replace(&mut self.cleared, true) {
            return Ok(());
        }
        let mut errs = Vec::new();
        for (file, _) in rules(DiskLimits { read_bps: 0, write_bps: 0, read_iops: 0, write_iops: 0 }) {
            let p = self.root.join(file);
            if let Err(e) = std::fs::write(&p, format!("{} 0", self.maj_min)) {
                errs.push(format!("{}: {e}", p.display()));
            }
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(anyhow!(errs.join("; ")))
        }
    }
}

impl Drop for RootRules {
    fn drop(&mut self) {
        if let Err(e) = self.clear() {
            tracing::warn!(
                "throttle of {} not cleared: {e}; write \"{} 0\" to those files",
                self.maj_min,
                self.maj_min
            );
        }
    }
}

/// A file behind a throttled loop device. Fields drop in order: the
/// filesystem (if one was made) is unmounted, the rules cleared, the device
/// detached; the file itself is its owner's.
pub struct ThrottledLoop {
    mount: Option<Mounted>,
    rules: RootRules,
    dev: LoopDev,
}

impl ThrottledLoop {
    /// Attaches `file` with direct I/O and throttles it to `limits`.
    pub fn attach(file: &Path, limits: DiskLimits) -> anyhow::Result<Self> {
        let root = blkio_root().ok_or_else(|| {
            anyhow!(
                "disk profiles need the cgroup v1 blkio hierarchy (they throttle at its root); not built for cgroup v2"
            )
        })?;
        let dev = LoopDev::attach(file, true, false)?;
        let name = dev.path().file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let sys = format!("/sys/block/{name}/dev");
        let maj_min = std::fs::read_to_string(&sys).map_err(|e| anyhow!("{sys}: {e}"))?.trim().to_owned();
        let rules_guard = RootRules { root: root.clone(), maj_min: maj_min.clone(), cleared: false };
        for (f, v) in rules(limits) {
            let p = root.join(f);
            std::fs::write(&p, format!("{maj_min} {v}")).map_err(|e| anyhow!("{}: {e}", p.display()))?;
        }
        Ok(Self { mount: None, rules: rules_guard, dev })
    }

    /// The loop device.
    #[must_use]
    pub fn dev(&self) -> &Path {
        self.dev.path()
    }

    /// Makes an ext4 filesystem on the device and mounts it at `dir` (which must exist).
    pub fn mount_ext4(&mut self, dir: &Path) -> anyhow::Result<()> {
        cmd("mkfs.ext4", &["-q", "-F", "-E", "lazy_itable_init=1,lazy_journal_init=1", &self.dev().to_string_lossy()])?;
        self.mount = Some(Mounted::ext4(self.dev(), dir, "noatime")?);
        Ok(())
    }

    /// Unmounts, clears the rules and detaches now, reporting failures.
    pub fn release(self) -> anyhow::Result<()> {
        let Self { mount, mut rules, dev } = self;
        if let Some(m) = mount {
            m.unmount()?;
        }
        rules.clear()?;
        dev.detach()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles() {
        assert_eq!(DiskProfile::Host.limits(), None);
        let c = DiskProfile::Cloud.limits().unwrap();
        assert_eq!((c.read_bps, c.read_iops), (125_000_000, 3_000));
        assert_eq!(
            DiskProfile::Cloud.describe(),
            "cloud volume class: read 125 MB/s 3000 IOPS, write 125 MB/s 3000 IOPS"
        );
        assert_eq!(rules(c)[3], ("blkio.throttle.write_iops_device", 3_000));
    }
}
