//! `--tier` options: building the chain of tiers below a device's pool.
//!
//! `--tier remote=redis://h1:6379,redis://h2:6379` (RAMster on Redis/Valkey
//! servers), `--tier remote=redis+cluster://h1:7000,h2:7000` (on a
//! Redis/Valkey Cluster, from seed addresses) and `--tier
//! disk=/var/lib/tmem` (a directory: one backing file per device,
//! `DEVICE.back`) or `--tier disk=/dev/sdb1` (one device only), in the order
//! pages should move down. Every value leaving the process is sealed under a
//! subkey of its own device and run, derived from `--key-file` (owner-only)
//! or from a key generated for this run (see `tmem_tier::seal`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tmem_core::TierChain;
use tmem_tier::seal::{MasterKey, Sealer};

use crate::{limits, DaemonError};
use tmem_tier::{Tier, TierHandover};

/// One `--tier` option.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum TierSpec {
    /// Redis/Valkey nodes.
    Remote(Vec<String>),
    /// A directory for backing files, or one file or block device.
    Disk(PathBuf),
}

const REMOTE_SCHEMES: [&str; 4] = ["redis://", "rediss://", "redis+cluster://", "rediss+cluster://"];

/// Parses `remote=URL[,URL...]` or `disk=PATH`. After the first URL a bare
/// `HOST:PORT` takes the first URL's scheme and credentials.
pub fn parse_tier(s: &str) -> Result<TierSpec, String> {
    match s.split_once('=') {
        Some(("remote", urls)) => {
            let items: Vec<&str> = urls.split(',').map(str::trim).filter(|u| !u.is_empty()).collect();
            let bad = || {
                format!(
                    "{s:?}: expected remote=redis://HOST:PORT[,HOST:PORT...] (or rediss://, \
                     redis+cluster:// for a cluster's seeds, rediss+cluster://)"
                )
            };
            let first = *items.first().ok_or_else(bad)?;
            let scheme = REMOTE_SCHEMES.iter().find(|p| first.starts_with(**p)).ok_or_else(bad)?;
            let rest = &first[scheme.len()..];
            let auth =
                rest.find(['/', '?', '#']).map_or(rest, |end| &rest[..end]).rfind('@').map_or("", |at| &rest[..=at]);
            let nodes = items
                .iter()
                .map(|u| {
                    if !u.contains("://") {
                        Ok(format!("{scheme}{auth}{u}"))
                    } else if REMOTE_SCHEMES.iter().any(|p| u.starts_with(p)) {
                        Ok((*u).to_owned())
                    } else {
                        Err(bad())
                    }
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(TierSpec::Remote(nodes))
        }
        Some(("disk", path)) if !path.is_empty() => Ok(TierSpec::Disk(PathBuf::from(path))),
        _ => Err(format!("{s:?}: expected remote=URL[,URL...] or disk=PATH")),
    }
}

/// Options shared by everything that builds tiers.
#[derive(clap::Args, Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct TierArgs {
    /// A tier below the pool, in order: remote=redis://H:P[,H:P...] (standalone servers),
    /// remote=redis+cluster://H:P[,H:P...] (a cluster's seeds) or disk=DIR|FILE|BLOCKDEV.
    #[arg(long = "tier", value_parser = parse_tier)]
    pub tiers: Vec<TierSpec>,
    /// Copies of each page on the remote tier (RAMster's replication factor R).
    #[arg(long, default_value_t = 2)]
    pub replicas: usize,
    /// AEAD key file (32 bytes or 64 hex digits, mode 0600); default: a key generated for this run.
    #[arg(long)]
    pub key_file: Option<PathBuf>,
    /// Cluster id: names the group of machines sharing the remote servers.
    #[arg(long, default_value = "tmem")]
    pub cluster_id: String,
    /// Host id within the cluster (default: this machine's hostname).
    #[arg(long)]
    pub host_id: Option<String>,
    /// Disk tier capacity per device (default: 2× the device size, sparse).
    #[arg(long, value_parser = tmem_corpus::parse_size)]
    pub disk_capacity: Option<u64>,
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().chars().filter(|c| c.is_ascii_alphanumeric() || "._-".contains(*c)).collect())
        .ok()
        .filter(|h: &String| !h.is_empty())
        .unwrap_or_else(|| "host".into())
}

impl TierArgs {
    /// Checks what can be checked without connecting.
    pub fn validate(&self, devices: usize) -> Result<(), DaemonError> {
        self.check(devices).map_err(DaemonError::Invalid)
    }

    fn check(&self, devices: usize) -> Result<(), String> {
        let disks = self.tiers.iter().filter(|t| matches!(t, TierSpec::Disk(_))).count();
        let remotes = self.tiers.iter().filter(|t| matches!(t, TierSpec::Remote(_))).count();
        if disks > 1 || remotes > 1 {
            return Err("at most one disk and one remote tier".into());
        }
        let count = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
        for t in &self.tiers {
            match t {
                TierSpec::Disk(p) => {
                    if devices > 1 && !p.is_dir() {
                        return Err(format!("with several devices, disk={} must be a directory", p.display()));
                    }
                    if let Some(cap) = self.disk_capacity {
                        limits::disk_capacity("disk tier capacity", cap, count(devices), p)
                            .map_err(|e| e.to_string())?;
                    }
                }
                TierSpec::Remote(nodes) => {
                    limits::remote_nodes("remote tier nodes", count(nodes.len())).map_err(|e| e.to_string())?;
                    limits::replicas("replicas", count(self.replicas)).map_err(|e| e.to_string())?;
                }
            }
        }
        if let Some(k) = &self.key_file {
            MasterKey::from_file(k).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// Builds the chain for device `device` of `size` bytes, or `None` without tiers.
    pub fn build(&self, device: &str, size: u64) -> Result<Option<TierChain>, DaemonError> {
        self.build_chain(device, size).map_err(|e| DaemonError::Tier(format!("{device}: {e}")))
    }

    fn build_chain(&self, device: &str, size: u64) -> Result<Option<TierChain>, String> {
        if self.tiers.is_empty() {
            return Ok(None);
        }
        let master = match &self.key_file {
            Some(k) => MasterKey::from_file(k),
            None => MasterKey::random(),
        }
        .map_err(|e| e.to_string())?;
        // A sealer of its own per device and run: a fresh salt, so a fresh subkey.
        let sealer = Sealer::new(&master).map_err(|e| e.to_string())?;
        let mut tiers: Vec<Arc<dyn Tier>> = Vec::new();
        for t in &self.tiers {
            tiers.push(match t {
                TierSpec::Remote(nodes) => Arc::new(self.remote(nodes, device).build().map_err(|e| e.to_string())?),
                TierSpec::Disk(p) => {
                    let path = if p.is_dir() { p.join(format!("{device}.back")) } else { p.clone() };
                    Arc::new(
                        disk_tier(&path, self.disk_capacity.unwrap_or(size.saturating_mul(2)))
                            .map_err(|e| e.to_string())?,
                    )
                }
            });
        }
        TierChain::new(tiers, Arc::new(sealer)).map(Some).map_err(|e| e.to_string())
    }

    /// The remote tier's configuration for device `device`.
    fn remote(&self, nodes: &[String], device: &str) -> tmem_tier_remote::RemoteTierConfig {
        let host = format!("{}-{device}", self.host_id.clone().unwrap_or_else(hostname));
        let mut cfg = tmem_tier_remote::RemoteTierConfig::new(nodes.to_vec(), self.cluster_id.clone(), host);
        // A cluster's masters are counted at build, which refuses R above them.
        let cluster = nodes.iter().any(|u| u.contains("+cluster://"));
        cfg.replicas = if cluster { self.replicas.max(1) } else { self.replicas.min(nodes.len()).max(1) };
        cfg.op_timeout = Duration::from_millis(500);
        cfg
    }

    /// The tiers of device `device` as a predecessor handed them over
    /// ([`Tier::hand_over`]), in the order of `--tier`. They own nothing
    /// until the caller serves ([`Tier::set_owner`]).
    pub fn adopt(&self, device: &str, handed: Vec<TierHandover>) -> Result<Vec<Arc<dyn Tier>>, DaemonError> {
        let fail = |e: String| DaemonError::Tier(format!("{device}: taking the tiers over: {e}"));
        if handed.len() != self.tiers.len() {
            return Err(fail(format!("{} tiers handed over, {} configured", handed.len(), self.tiers.len())));
        }
        let mut tiers: Vec<Arc<dyn Tier>> = Vec::new();
        for (t, h) in self.tiers.iter().zip(handed) {
            tiers.push(match t {
                TierSpec::Remote(nodes) => {
                    Arc::new(self.remote(nodes, device).adopt(&h).map_err(|e| fail(e.to_string()))?)
                }
                TierSpec::Disk(_) => Arc::new(tmem_tier_disk::DiskTier::adopt(h).map_err(|e| fail(e.to_string()))?),
            });
        }
        Ok(tiers)
    }
}

/// Opens a disk tier of `capacity` bytes at `path` (a new, empty tier).
pub fn disk_tier(path: &Path, capacity: u64) -> Result<tmem_tier_disk::DiskTier, DaemonError> {
    let mut cfg = tmem_tier_disk::DiskTierConfig::new(path);
    cfg.capacity_bytes = capacity;
    cfg.build().map_err(|e| DaemonError::Tier(format!("disk tier {}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_tier_options() {
        assert_eq!(
            parse_tier("remote=redis://a:1,rediss://b:2").unwrap(),
            TierSpec::Remote(vec!["redis://a:1".into(), "rediss://b:2".into()])
        );
        assert_eq!(parse_tier("disk=/var/lib/tmem").unwrap(), TierSpec::Disk("/var/lib/tmem".into()));
        assert_eq!(
            parse_tier("remote=redis+cluster://u:pw@a:1,b:2").unwrap(),
            TierSpec::Remote(vec!["redis+cluster://u:pw@a:1".into(), "redis+cluster://u:pw@b:2".into()])
        );
        assert_eq!(
            parse_tier("remote=redis://a:1,b:2/3").unwrap(),
            TierSpec::Remote(vec!["redis://a:1".into(), "redis://b:2/3".into()])
        );
        for bad in
            ["remote=", "remote=http://x", "remote=a:1", "remote=redis://a:1,http://b", "disk=", "ssd=/x", "disk"]
        {
            assert!(parse_tier(bad).is_err(), "{bad}");
        }
        let a = TierArgs { tiers: vec![TierSpec::Disk("/nonexistent/file".into())], ..Default::default() };
        assert!(a.validate(2).unwrap_err().to_string().contains("directory"));
        assert!(a.validate(1).is_ok());
    }

    #[test]
    fn tier_counts_and_sizes_are_bounded() {
        let nodes = (0..65).map(|i| format!("redis://h{i}:1")).collect();
        let a = TierArgs { tiers: vec![TierSpec::Remote(nodes)], replicas: 2, ..Default::default() };
        let e = a.validate(1).unwrap_err().to_string();
        assert!(e.starts_with("remote tier nodes 65 is above the limit of 64"), "{e}");
        let a =
            TierArgs { tiers: vec![TierSpec::Remote(vec!["redis://h:1".into()])], replicas: 9, ..Default::default() };
        assert!(a.validate(1).unwrap_err().to_string().starts_with("replicas 9 is above the limit of 8"));
        let dir = tempfile::tempdir().unwrap();
        let mut a = TierArgs { tiers: vec![TierSpec::Disk(dir.path().into())], ..Default::default() };
        a.disk_capacity = Some(1 << 60);
        let e = a.validate(2).unwrap_err().to_string();
        assert!(e.starts_with("disk tier capacity 1.0 EiB (2.0 EiB for 2 devices) is above the limit of"), "{e}");
        a.disk_capacity = Some(64 << 20);
        a.validate(2).unwrap();
    }
}
