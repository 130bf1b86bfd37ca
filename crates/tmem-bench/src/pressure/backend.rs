//! The swap backends of `tmem bench pressure`: a disk swap file, kernel zram,
//! zswap in front of the disk swap file, and tmem, alone or with a small pool
//! over a lower tier (RAMster-style remote RAM on Redis servers, or a disk
//! backing file); and `fuse-ram`, tmem's FUSE + loop path over plain RAM,
//! which measures what that path costs without compression or a store.
//! The front rows (`zram+tmem`, `zswap+tmem`, `zram+disk`: the kernel's
//! compressed swap in front of tmem or of a disk file) are in [`super::front`].
//!
//! Each backend is *prepared* once (swap file created, zswap parameters set),
//! *activated* before every run (swapon on an empty area) and *deactivated*
//! after it (swapoff, zram reset, tmem daemon stopped), so every run starts
//! with an empty swap area. *Finishing* undoes the preparation. Every piece
//! also undoes itself on drop, so an error or a panic anywhere leaves no swap
//! area, zram device, zswap parameter, mount or daemon behind. zram runs on
//! a device hot-added for the bench, so a user's zram devices are never
//! touched.

use anyhow::anyhow;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use std::sync::Arc;

use rustix::process::{Pid, Signal};

use crate::zram;
use tmem_block::RamDevice;
use tmem_fuse::{Export, FuseConfig, FuseMount};
use tmem_sys::{swap, zswap};

use super::cmd;
use super::front::{FrontConfig, ZramDisk};
use super::net::{Namespace, NetProfile};
use super::throttle::{DiskProfile, ThrottledLoop};
use crate::cache::setup::current_exe;
use tmem_ctl::{self as ctl, Request};

/// Which backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// A swap file on the root filesystem.
    Disk,
    /// Kernel zram.
    Zram,
    /// zswap in front of the disk swap file.
    Zswap,
    /// tmem: `tmem swap up` on the transport `auto` picks (ublk where the
    /// kernel has it, else FUSE + loop) and swapon.
    Tmem,
    /// tmem on FUSE + loop whatever the kernel has (`--transport fuse`).
    #[value(name = "tmem-fuse")]
    #[serde(rename = "tmem-fuse")]
    TmemFuse,
    /// tmem on the kernel's ublk driver (`--transport ublk`; needs `ublk_drv`).
    #[value(name = "tmem-ublk")]
    #[serde(rename = "tmem-ublk")]
    TmemUblk,
    /// tmem on the kernel's NBD client instead of FUSE + loop
    /// (`tmem swap up --transport nbd`; needs `nbd.ko`).
    #[value(name = "tmem-nbd")]
    #[serde(rename = "tmem-nbd")]
    TmemNbd,
    /// tmem with background recompression of cold pages (`--recompress`).
    #[value(name = "tmem+recomp")]
    #[serde(rename = "tmem+recomp")]
    TmemRecomp,
    /// tmem with a small pool that writes back to remote RAM: 3 local
    /// redis-server processes, every page on 2 of them.
    #[value(name = "tmem+remote")]
    #[serde(rename = "tmem+remote")]
    TmemRemote,
    /// tmem+remote where the bench kills one Redis node (and, on a
    /// network profile, deletes its namespace) once the tier holds pages.
    #[value(name = "tmem+remote-kill")]
    #[serde(rename = "tmem+remote-kill")]
    TmemRemoteKill,
    /// tmem with a small pool that writes back to a disk backing file.
    #[value(name = "tmem+disk")]
    #[serde(rename = "tmem+disk")]
    TmemDisk,
    /// Baseline: tmem's FUSE + loop path over plain RAM (no compression, no
    /// store), served by the bench itself; what the transport alone costs.
    #[value(name = "fuse-ram")]
    #[serde(rename = "fuse-ram")]
    FuseRam,
    /// zram in front of tmem: `tmem swap up --front zram` (zram's backing
    /// device is tmem's; the daemon's policy writes idle pages back).
    #[value(name = "zram+tmem")]
    #[serde(rename = "zram+tmem")]
    ZramTmem,
    /// The kernel's own answer: zram writing idle pages back to a disk
    /// file, run by the same policy in the bench.
    #[value(name = "zram+disk")]
    #[serde(rename = "zram+disk")]
    ZramDisk,
    /// zswap in front of tmem: `tmem swap up --front zswap`.
    #[value(name = "zswap+tmem")]
    #[serde(rename = "zswap+tmem")]
    ZswapTmem,
    /// No swap: each job runs under `tmem run --memory BUDGET` (userfaultfd),
    /// its cgroup without a limit; the helpers, pools included, are in it.
    #[value(name = "tmem-run")]
    #[serde(rename = "tmem-run")]
    TmemRun,
}

impl BackendKind {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Disk => "disk",
            Self::Zram => "zram",
            Self::Zswap => "zswap",
            Self::Tmem => "tmem",
            Self::TmemNbd => "tmem-nbd",
            Self::TmemFuse => "tmem-fuse",
            Self::TmemUblk => "tmem-ublk",
            Self::TmemRecomp => "tmem+recomp",
            Self::TmemRemote => "tmem+remote",
            Self::TmemRemoteKill => "tmem+remote-kill",
            Self::TmemDisk => "tmem+disk",
            Self::FuseRam => "fuse-ram",
            Self::ZramTmem => "zram+tmem",
            Self::ZramDisk => "zram+disk",
            Self::ZswapTmem => "zswap+tmem",
            Self::TmemRun => "tmem-run",
        }
    }

    /// Whether the row needs zram with writeback (`CONFIG_ZRAM_WRITEBACK`).
    #[must_use]
    pub fn needs_zram_writeback(self) -> bool {
        matches!(self, Self::ZramTmem | Self::ZramDisk)
    }

    /// Whether the row has the kernel's compressed swap in front of another device.
    #[must_use]
    pub fn has_front(self) -> bool {
        matches!(self, Self::ZramTmem | Self::ZramDisk | Self::ZswapTmem)
    }
}

/// The names of the front rows (for the report, which has names only).
pub const FRONT_ROWS: [&str; 3] = ["zram+tmem", "zram+disk", "zswap+tmem"];

/// What a backend needs to know.
#[derive(Clone, Debug)]
pub struct BackendConfig {
    /// Swap area size, bytes.
    pub swap_size: u64,
    /// Disk swap file (disk and zswap backends).
    pub swap_file: PathBuf,
    /// zram algorithm.
    pub zram_algorithm: String,
    /// zram `mem_limit`, bytes (None: no limit).
    pub zram_mem_limit: Option<u64>,
    /// zswap compressor.
    pub zswap_compressor: String,
    /// zswap max_pool_percent.
    pub zswap_max_pool_percent: u32,
    /// tmem runtime directory.
    pub tmem_runtime_dir: PathBuf,
    /// tmem --pool-limit.
    pub tmem_pool_limit: String,
    /// tmem --codec.
    pub tmem_codec: String,
    /// `tmem run --read-ahead` of the tmem-run row (None: tmem run's default).
    pub tmem_read_ahead: Option<u64>,
    /// tmem --fuse-uring.
    pub tmem_fuse_uring: usize,
    /// tmem --fuse-threads, also the fuse-ram baseline's worker count
    /// (0: the daemon's default, one per online CPU and at least 4).
    pub tmem_fuse_threads: usize,
    /// tmem --discard (how freed swap slots reach the pool).
    pub tmem_discard: tmem_sys::swap::SwapDiscard,
    /// tmem --recompress and --recompress-after of the tmem+recomp row.
    pub tmem_recompress: (String, f64),
    /// tmem --pool-limit of the tiered rows (tmem+remote, tmem+disk).
    pub tmem_tier_pool_limit: String,
    /// Directory for the tmem+disk backing file.
    pub tier_dir: PathBuf,
    /// The disk behind the disk swap file and the tmem+disk tier.
    pub disk_profile: DiskProfile,
    /// The network path to the tmem+remote rows' Redis nodes.
    pub net_profile: NetProfile,
    /// The front rows' budget and policy.
    pub front: FrontConfig,
    /// The zram+disk row's backing file.
    pub front_disk_file: PathBuf,
}

/// The `/dev/fuse` worker threads the tmem rows and fuse-ram run with for
/// `--tmem-fuse-threads n`: `n`, or the daemon's default when 0.
#[must_use]
pub fn fuse_threads(n: usize) -> usize {
    match n {
        0 => tmem_daemon::spec::default_fuse_threads(),
        n => n,
    }
}

impl BackendConfig {
    /// The defaults of the benches for swap areas of `swap_size` bytes,
    /// with this process's names: the disk swap file and the tier in
    /// `swap_dir`, the runtime directory in /run; zram lz4, zswap lzo-rle
    /// (20 %), tmem lz4 with a pool of 50 % of RAM (64 MiB over a tier),
    /// `--discard once`, no recompression, the host's disk, loopback; the
    /// front rows' budget 1/3 of the swap area (see [`FrontConfig`]).
    #[must_use]
    pub fn new(swap_size: u64, swap_dir: &Path) -> Self {
        let pid = std::process::id();
        Self {
            swap_size,
            swap_file: swap_dir.join(format!("tmem-bench-swap-{pid}")),
            zram_algorithm: "lz4".into(),
            zram_mem_limit: None,
            zswap_compressor: "lzo-rle".into(),
            zswap_max_pool_percent: 20,
            tmem_runtime_dir: PathBuf::from(format!("/run/tmem-bench-{pid}")),
            tmem_pool_limit: "50%".into(),
            tmem_codec: "lz4".into(),
            tmem_read_ahead: None,
            tmem_fuse_uring: 0,
            tmem_fuse_threads: 0,
            tmem_discard: tmem_sys::swap::SwapDiscard::Once,
            tmem_recompress: (String::new(), 0.0),
            tmem_tier_pool_limit: "64M".into(),
            tier_dir: swap_dir.join(format!("tmem-bench-tier-{pid}")),
            disk_profile: DiskProfile::Host,
            net_profile: NetProfile::Loopback,
            front: FrontConfig::for_reference(swap_size),
            front_disk_file: swap_dir.join(format!("tmem-bench-zram-backing-{pid}")),
        }
    }
}

/// Priority of the disk swap file (and of zswap's).
pub const DISK_PRIORITY: i32 = 10;
/// Priority of zram and tmem.
pub const RAM_PRIORITY: i32 = 100;

/// Pool memory of a backend at one instant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PoolSample {
    /// Memory the pool uses (compressed data, fragmentation, metadata).
    pub pool_bytes: u64,
    /// Uncompressed bytes of the pages it holds.
    pub stored_bytes: u64,
    /// Pages held in tiers below the pool (tmem with tiers).
    pub tier_pages: u64,
    /// Values the tiers below the pool have returned since the daemon
    /// started (their gets less their misses).
    pub tier_values_read: u64,
    /// Read requests the tiers made to their backing stores meanwhile
    /// (`TierStats::backing_reads`: a merged read counts once).
    pub tier_backing_reads: u64,
    /// Writebacks a swap write waited for since the daemon started
    /// (`Stats::writeback_waits`).
    pub writeback_waits: u64,
    /// Writes the device refused since it started (tmem: the pool was full).
    pub failed_writes: u64,
    /// Of `pool_bytes`, the front's pool (the front rows: zram's
    /// `mem_used_total` or zswap's pool, in front of tmem or a disk file).
    pub front_pool_bytes: u64,
    /// Pages the front wrote back to the device below it since the run began.
    pub written_back: u64,
    /// Written-back pages the front read back from it since the run began.
    pub read_back: u64,
}

/// A prepared backend.
pub enum Backend {
    /// Disk swap file.
    Disk(DiskSwap),
    /// zram.
    Zram(Zram),
    /// zswap over a disk swap file. Fields drop in order: swapoff, then the
    /// parameters are restored, then debugfs is unmounted.
    Zswap {
        /// The swap file behind zswap.
        disk: DiskSwap,
        /// Saved parameters.
        settings: zswap::ZswapSettings,
        /// debugfs, for zswap's counters.
        debugfs: Option<zswap::DebugfsMount>,
    },
    /// tmem daemon.
    Tmem(Tmem),
    /// FUSE + loop over plain RAM.
    FuseRam(FuseRam),
    /// zram writing back to a disk file, its policy in the bench.
    ZramDisk(ZramDisk),
    /// `tmem run` around each job: nothing to set up.
    TmemRun(TmemRun),
}

impl Backend {
    /// Prepares `kind`.
    pub fn prepare(kind: BackendKind, c: &BackendConfig) -> anyhow::Result<Self> {
        match kind {
            BackendKind::Disk => Ok(Self::Disk(DiskSwap::create(&c.swap_file, c.swap_size, c.disk_profile)?)),
            BackendKind::Zram => Ok(Self::Zram(Zram::prepare(&c.zram_algorithm, c.swap_size, c.zram_mem_limit)?)),
            BackendKind::Zswap => {
                let offered = zswap::compressors();
                if !offered.contains(&c.zswap_compressor) {
                    return Err(anyhow!(
                        "zswap: the kernel's crypto API has no {} compressor (it has {})",
                        c.zswap_compressor,
                        offered.join(", ")
                    ));
                }
                let mut settings = zswap::ZswapSettings::save()?;
                let set = |s: &mut zswap::ZswapSettings, k: &str, v: &str| {
                    s.set(k, v).map_err(|e| anyhow!("zswap: setting {k}={v}: {e}"))
                };
                set(&mut settings, "compressor", &c.zswap_compressor)?;
                set(&mut settings, "max_pool_percent", &c.zswap_max_pool_percent.to_string())?;
                set(&mut settings, "enabled", "Y")?;
                let debugfs = match zswap::DebugfsMount::ensure() {
                    Ok(d) => Some(d),
                    Err(e) => {
                        tracing::info!("no zswap debugfs counters: {e}");
                        None
                    }
                };
                let disk = DiskSwap::create(&c.swap_file, c.swap_size, c.disk_profile)?;
                Ok(Self::Zswap { disk, settings, debugfs })
            }
            BackendKind::Tmem => Ok(Self::Tmem(Tmem::prepare(c, TmemTier::None)?)),
            BackendKind::TmemNbd | BackendKind::TmemFuse | BackendKind::TmemUblk => {
                let transport = match kind {
                    BackendKind::TmemNbd => "nbd",
                    BackendKind::TmemUblk => "ublk",
                    _ => "fuse",
                };
                let mut t = Tmem::prepare(c, TmemTier::None)?;
                t.extra_args = vec!["--transport".into(), transport.into()];
                Ok(Self::Tmem(t))
            }
            BackendKind::TmemRecomp => {
                let mut t = Tmem::prepare(c, TmemTier::None)?;
                let (codec, after) = &c.tmem_recompress;
                t.extra_args =
                    vec!["--recompress".into(), codec.clone(), "--recompress-after".into(), after.to_string()];
                Ok(Self::Tmem(t))
            }
            BackendKind::TmemRemote | BackendKind::TmemRemoteKill => {
                Ok(Self::Tmem(Tmem::prepare(c, TmemTier::Remote)?))
            }
            BackendKind::TmemDisk => Ok(Self::Tmem(Tmem::prepare(c, TmemTier::Disk)?)),
            BackendKind::FuseRam => Ok(Self::FuseRam(FuseRam::prepare(c)?)),
            BackendKind::ZramTmem => {
                let mut t = Tmem::prepare(c, TmemTier::None)?;
                t.front = Some(TmemFront::new(FrontRow::Zram, c.front.daemon_args("zram", &c.zram_algorithm)));
                Ok(Self::Tmem(t))
            }
            BackendKind::ZswapTmem => {
                let mut t = Tmem::prepare(c, TmemTier::None)?;
                t.front = Some(TmemFront::new(FrontRow::Zswap, c.front.daemon_args("zswap", &c.zswap_compressor)));
                Ok(Self::Tmem(t))
            }
            BackendKind::TmemRun => Ok(Self::TmemRun(TmemRun::prepare(c)?)),
            BackendKind::ZramDisk => Ok(Self::ZramDisk(ZramDisk::prepare(
                &c.front_disk_file,
                c.swap_size,
                &c.zram_algorithm,
                &c.front,
                c.disk_profile,
            )?)),
        }
    }

    /// The memory cgroup of the next run (`None`: not cgroup v2): the
    /// zswap+tmem row passes it to `tmem swap up --front-cgroup`, whose
    /// zswap limit the daemon then sets (and restores). Set before
    /// [`Backend::activate`].
    pub fn set_run_cgroup(&mut self, v2_cgroup: Option<&Path>) {
        if let Self::Tmem(Tmem { front: Some(f), .. }) = self {
            f.cgroup = v2_cgroup.filter(|_| f.row == FrontRow::Zswap).map(Path::to_owned);
        }
    }

    /// The block device below the front, whose reads are the front's reads
    /// back (tmem's loop device, or zram+disk's): `None` without a front.
    pub fn backing_dev(&self) -> Option<PathBuf> {
        match self {
            Self::Tmem(t) if t.front.is_some() => t.loop_devs.first().cloned(),
            Self::ZramDisk(z) => z.backing_dev().map(Path::to_owned),
            _ => None,
        }
    }

    /// The front's counters now (its policy's state, backoffs ...), as
    /// `tmem stat --json` shows them: `None` without a front.
    pub fn front_stats(&self) -> Option<serde_json::Value> {
        match self {
            Self::Tmem(t) if t.front.is_some() => t.front_stats(),
            Self::ZramDisk(z) => z.front_stats(),
            _ => None,
        }
    }

    /// Swap paths this backend puts in /proc/swaps (known once active).
    pub fn swap_paths(&self) -> Vec<PathBuf> {
        match self {
            Self::Disk(d) | Self::Zswap { disk: d, .. } => vec![d.swap_path().to_owned()],
            Self::Zram(z) => z.dev.as_ref().map(zram::ZramDevice::node).into_iter().collect(),
            Self::Tmem(t) => t.loop_devs.iter().chain(t.front.iter().flat_map(|f| f.nodes.iter())).cloned().collect(),
            Self::FuseRam(f) => f.active.iter().filter_map(|a| a.loop_dev.clone()).collect(),
            Self::ZramDisk(z) => z.node().map(Path::to_owned).into_iter().collect(),
            Self::TmemRun(_) => Vec::new(),
        }
    }

    /// swapon on an empty area.
    pub fn activate(&mut self) -> anyhow::Result<()> {
        match self {
            Self::Disk(d) | Self::Zswap { disk: d, .. } => d.activate(),
            Self::Zram(z) => z.activate(),
            Self::Tmem(t) => t.activate(),
            Self::FuseRam(f) => f.activate(),
            Self::ZramDisk(z) => z.activate(),
            Self::TmemRun(_) => Ok(()),
        }
    }

    /// swapoff and empty the area.
    pub fn deactivate(&mut self) -> anyhow::Result<()> {
        match self {
            Self::Disk(d) | Self::Zswap { disk: d, .. } => d.deactivate(),
            Self::Zram(z) => z.deactivate(),
            Self::Tmem(t) => t.deactivate(),
            Self::FuseRam(f) => f.deactivate(),
            Self::ZramDisk(z) => z.deactivate(),
            Self::TmemRun(_) => Ok(()),
        }
    }

    /// Pool memory now.
    pub fn sample(&self) -> PoolSample {
        match self {
            Self::Disk(_) => PoolSample::default(),
            Self::Zram(z) => z
                .mm_stat()
                .map(|m| PoolSample {
                    pool_bytes: m.mem_used_total,
                    stored_bytes: m.orig_data_size,
                    ..Default::default()
                })
                .unwrap_or_default(),
            Self::Zswap { .. } => {
                let (pool_bytes, stored_bytes) = (zswap::pool_bytes().unwrap_or(0), zswap::stored_bytes());
                PoolSample { pool_bytes, stored_bytes, ..Default::default() }
            }
            Self::Tmem(t) => t.sample(),
            Self::FuseRam(f) => f.sample(),
            Self::ZramDisk(z) => z.sample(),
            Self::TmemRun(_) => TmemRun::sample(),
        }
    }

    /// The kernel's own high-water mark of pool memory, where there is one
    /// (zram `mem_used_max`).
    pub fn pool_high_water(&self) -> Option<u64> {
        match self {
            Self::Zram(z) => z.mm_stat().map(|m| m.mem_used_max),
            Self::ZramDisk(z) => z.pool_high_water(),
            _ => None,
        }
    }

    /// The process that serves the swap device in user space, whose CPU
    /// time is the run's daemon CPU: tmem's daemon, or for fuse-ram this
    /// process (the bench serves its FUSE itself). `None` for the backends
    /// the kernel serves alone (disk, zram, zswap, and zram+disk, whose
    /// policy thread in the bench only tells zram what to write back: the
    /// writeback's CPU is in the machine's busy time).
    pub fn server_pid(&self) -> Option<i32> {
        match self {
            Self::Tmem(t) => t.pid,
            Self::FuseRam(_) => i32::try_from(std::process::id()).ok(),
            // tmem run's helpers are in the run's cgroup: their CPU is in the machine's busy time.
            Self::Disk(_) | Self::Zram(_) | Self::Zswap { .. } | Self::ZramDisk(_) | Self::TmemRun(_) => None,
        }
    }

    /// Kills one of tmem+remote's Redis nodes (see [`Tmem::kill_node`]).
    pub fn kill_remote_node(&mut self) -> anyhow::Result<String> {
        match self {
            Self::Tmem(t) if !t.servers.is_empty() => t.kill_node(0),
            _ => Err(anyhow!("this backend has no Redis nodes")),
        }
    }

    /// Whether its Redis nodes' links carry the network profile's delay
    /// (`None`: no namespaces).
    pub fn net_delay_applied(&self) -> Option<bool> {
        match self {
            Self::Tmem(t) if !t.namespaces.is_empty() => Some(t.namespaces.iter().all(|n| n.delay_applied)),
            _ => None,
        }
    }

    /// The zram device the zram backend hot-added.
    pub fn zram_device(&self) -> Option<String> {
        match self {
            Self::Zram(z) => z.dev.as_ref().map(|d| d.name().to_owned()),
            _ => None,
        }
    }

    /// Counters worth keeping with each run (zswap's debugfs counters).
    pub fn counters(&self) -> Option<std::collections::BTreeMap<String, u64>> {
        match self {
            Self::Zswap { debugfs: Some(_), .. } => zswap::debug_stats().ok(),
            // Where debugfs is mounted already (the bench mounts it for the zswap row only).
            Self::Tmem(Tmem { front: Some(TmemFront { row: FrontRow::Zswap, .. }), .. }) => zswap::debug_stats().ok(),
            _ => None,
        }
    }

    /// Undoes the preparation; reports every failure.
    pub fn finish(self) -> anyhow::Result<()> {
        match self {
            Self::Disk(d) => d.remove(),
            Self::Zram(mut z) => z.finish(),
            Self::Zswap { disk, mut settings, debugfs } => {
                let mut errs = Vec::new();
                if let Err(e) = disk.remove() {
                    errs.push(e.to_string());
                }
                if let Err(e) = settings.restore() {
                    errs.push(e.to_string());
                }
                if let Some(d) = debugfs {
                    if let Err(e) = d.release() {
                        errs.push(e.to_string());
                    }
                }
                if errs.is_empty() {
                    Ok(())
                } else {
                    Err(anyhow!(errs.join("; ")))
                }
            }
            Self::Tmem(mut t) => t.finish(),
            Self::FuseRam(mut f) => f.deactivate(),
            Self::ZramDisk(mut z) => z.finish(),
            Self::TmemRun(_) => Ok(()),
        }
    }
}

/// The tmem-run row: each job under `tmem run`.
pub struct TmemRun {
    exe: PathBuf,
    codec: String,
    read_ahead: Option<u64>,
}

impl TmemRun {
    fn prepare(c: &BackendConfig) -> anyhow::Result<Self> {
        Ok(Self { read_ahead: c.tmem_read_ahead, ..Self::new(&c.tmem_codec)? })
    }

    /// This binary's `tmem run` with `--codec codec`.
    pub fn new(codec: &str) -> anyhow::Result<Self> {
        Ok(Self { exe: current_exe()?, codec: codec.to_owned(), read_ahead: None })
    }

    /// `PROGRAM ARGS` under `tmem run --memory BUDGET --codec C [--read-ahead N]`.
    #[must_use]
    pub fn wrap(&self, budget: u64, program: &str, args: &[&str]) -> (String, Vec<String>) {
        let mut wrapped: Vec<String> =
            ["run", "--memory", &budget.to_string(), "--codec", &self.codec].map(str::to_owned).to_vec();
        if let Some(n) = self.read_ahead {
            wrapped.extend(["--read-ahead".to_owned(), n.to_string()]);
        }
        wrapped.extend(["--".to_owned(), program.to_owned()]);
        wrapped.extend(args.iter().map(|s| (*s).to_owned()));
        (self.exe.to_string_lossy().into_owned(), wrapped)
    }

    /// The pools of this user's `tmem run` instances (the bench's own, as
    /// no other runs during a bench), from their control sockets.
    fn sample() -> PoolSample {
        let mut s = PoolSample::default();
        for (_, dir) in ctl::runs() {
            let Ok(v) = ctl::call_ok(&dir, &Request::Stat, Duration::from_secs(2)) else { continue };
            let Ok(devs) = serde_json::from_value::<Vec<tmem_block::DeviceStats>>(v) else { continue };
            for d in devs {
                s.pool_bytes += d.store.mem_used_total;
                s.stored_bytes += d.store.total.orig_data_size;
            }
        }
        s
    }
}

/// A swap file we created: swapped on directly, or (with a disk profile)
/// through a throttled loop device over it.
pub struct DiskSwap {
    path: PathBuf,
    created: bool,
    active: bool,
    throttled: Option<ThrottledLoop>,
}

impl DiskSwap {
    /// Creates the file (it must not exist), allocates it fully, puts it
    /// behind a throttled loop device for a `profile` with limits, and
    /// writes a swap signature.
    pub fn create(path: &Path, size: u64, profile: DiskProfile) -> anyhow::Result<Self> {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(|e| anyhow!("cannot create swap file {}: {e}", path.display()))?;
        drop(f);
        let mut d = Self { path: path.to_owned(), created: true, active: false, throttled: None };
        let p = path.to_string_lossy();
        cmd("fallocate", &["-l", &size.to_string(), &p])?;
        if let Some(limits) = profile.limits() {
            d.throttled = Some(ThrottledLoop::attach(path, limits)?);
        }
        cmd("mkswap", &["--label", "tmem-bench", &d.swap_path().to_string_lossy()])?;
        Ok(d)
    }

    /// What is swapped on: the file, or the loop device over it.
    pub fn swap_path(&self) -> &Path {
        self.throttled.as_ref().map_or(&self.path, ThrottledLoop::dev)
    }

    fn activate(&mut self) -> anyhow::Result<()> {
        self.active = true;
        cmd("swapon", &["--priority", &DISK_PRIORITY.to_string(), &self.swap_path().to_string_lossy()]).map(drop)
    }

    fn deactivate(&mut self) -> anyhow::Result<()> {
        if self.active && swap::is_swap(self.swap_path())? {
            cmd("swapoff", &[&self.swap_path().to_string_lossy()])?;
        }
        self.active = false;
        Ok(())
    }

    /// swapoff (if needed), release the loop device and delete the file.
    pub fn remove(mut self) -> anyhow::Result<()> {
        self.remove_now()
    }

    fn remove_now(&mut self) -> anyhow::Result<()> {
        self.active = self.active || swap::is_swap(self.swap_path()).unwrap_or(false);
        self.deactivate()?;
        if let Some(t) = self.throttled.take() {
            t.release()?;
        }
        if std::mem::take(&mut self.created) {
            std::fs::remove_file(&self.path).map_err(|e| anyhow!("cannot remove {}: {e}", self.path.display()))?;
        }
        Ok(())
    }
}

impl Drop for DiskSwap {
    fn drop(&mut self) {
        if let Err(e) = self.remove_now() {
            tracing::warn!("swap file {}: {e}; run swapoff and rm by hand", self.path.display());
        }
    }
}

/// zram used as swap, on a device hot-added for the bench (so a user's zram
/// devices are never touched): reset after every run, removed at the end
/// (on drop too).
pub struct Zram {
    /// `None` once removed.
    dev: Option<zram::ZramDevice>,
    algorithm: String,
    disksize: u64,
    mem_limit: Option<u64>,
    active: bool,
}

impl Zram {
    fn prepare(algorithm: &str, disksize: u64, mem_limit: Option<u64>) -> anyhow::Result<Self> {
        let dev = zram::ZramDevice::hot_add().map_err(|e| anyhow!("cannot hot-add a zram device: {e}"))?;
        let (algs, _) = dev.algorithms()?;
        if !algs.iter().any(|a| a == algorithm) {
            return Err(anyhow!("zram does not offer {algorithm} (it offers {})", algs.join(", ")));
        }
        Ok(Self { dev: Some(dev), algorithm: algorithm.to_owned(), disksize, mem_limit, active: false })
    }

    fn dev(&self) -> anyhow::Result<&zram::ZramDevice> {
        self.dev.as_ref().ok_or_else(|| anyhow!("the zram device was removed already"))
    }

    fn mm_stat(&self) -> Option<zram::ZramMmStat> {
        self.dev.as_ref()?.mm_stat().ok()
    }

    fn activate(&mut self) -> anyhow::Result<()> {
        self.active = true;
        let dev = self.dev()?;
        dev.configure(&self.algorithm, self.disksize)?;
        if let Some(limit) = self.mem_limit {
            dev.set_mem_limit(limit)?;
        }
        let node = dev.node();
        let node = node.to_string_lossy();
        cmd("mkswap", &["--label", "tmem-bench-zram", &node])?;
        cmd("swapon", &["--discard", "--priority", &RAM_PRIORITY.to_string(), &node]).map(drop)
    }

    fn deactivate(&mut self) -> anyhow::Result<()> {
        if !self.active {
            return Ok(());
        }
        let dev = self.dev()?;
        let node = dev.node();
        if swap::is_swap(&node)? {
            cmd("swapoff", &[&node.to_string_lossy()])?;
        }
        // Frees its memory now; udev may briefly hold the device open after swapoff (retried).
        dev.reset()?;
        self.active = false;
        Ok(())
    }

    /// swapoff, and remove the device.
    fn finish(&mut self) -> anyhow::Result<()> {
        self.deactivate()?;
        match self.dev.take() {
            Some(d) => Ok(d.remove()?),
            None => Ok(()),
        }
    }
}

impl Drop for Zram {
    fn drop(&mut self) {
        if let Err(e) = self.finish() {
            let (name, id) = self.dev.as_ref().map_or(("zram?".to_owned(), 0), |d| (d.name().to_owned(), d.id()));
            tracing::warn!(
                "{name} not removed: {e}; do: swapoff /dev/{name}; echo {id} > /sys/class/zram-control/hot_remove"
            );
        }
    }
}

/// The tier below a bench daemon's pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TmemTier {
    None,
    Remote,
    Disk,
}

/// Redis servers of the tmem+remote row (RAMster's "other machines").
pub const REMOTE_NODES: usize = 3;
/// Copies of each page on them.
pub const REMOTE_REPLICAS: usize = 2;

/// A tmem daemon started with `tmem swap up`. Fields drop after
/// [`Drop::drop`] has stopped the daemon, so the Redis servers and the tier
/// directory outlive it.
pub struct Tmem {
    exe: PathBuf,
    dir: PathBuf,
    size: u64,
    pool_limit: String,
    codec: String,
    fuse_uring: String,
    /// `--fuse-threads`, or the daemon's default when 0.
    fuse_threads: usize,
    discard: tmem_sys::swap::SwapDiscard,
    /// `--tier ...` arguments of `swap up`.
    tier_args: Vec<String>,
    /// Other arguments of `swap up` (the tmem+recomp row's).
    extra_args: Vec<String>,
    active: bool,
    pid: Option<i32>,
    loop_devs: Vec<PathBuf>,
    servers: Vec<crate::redis::RedisServer>,
    /// The servers' namespaces (a network profile): dropped after the servers.
    namespaces: Vec<Namespace>,
    net_profile: NetProfile,
    /// Nodes [`Tmem::kill_node`] killed: revived before the next run.
    killed: Vec<usize>,
    tier_dir: Option<PathBuf>,
    /// The tier's throttled filesystem (a disk profile), mounted at
    /// `tier_dir`, and its image file.
    tier_disk: Option<(ThrottledLoop, PathBuf)>,
    /// The kernel's compressed swap in front of the daemon's device (the front rows).
    front: Option<TmemFront>,
}

/// Which front a tmem row has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FrontRow {
    Zram,
    Zswap,
}

/// A tmem row's front: `swap up`'s `--front*` arguments, and what the
/// daemon set up.
#[derive(Debug)]
struct TmemFront {
    row: FrontRow,
    args: Vec<String>,
    /// The run's cgroup, on cgroup v2 (`--front-cgroup`, zswap only).
    cgroup: Option<PathBuf>,
    /// The front's devices the kernel swaps on (zram: `/dev/zramN`, from
    /// `tmem stat`), learned after `swap up`.
    nodes: Vec<PathBuf>,
}

impl TmemFront {
    fn new(row: FrontRow, args: Vec<String>) -> Self {
        Self { row, args, cgroup: None, nodes: Vec::new() }
    }
}

/// A device's front in `tmem stat --json` (a `tmem_front::FrontStats`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct FrontSample {
    node: String,
    pool_bytes: u64,
    stored_bytes: u64,
    written_back: u64,
    read_back: u64,
}

impl FrontSample {
    /// The `front` object of one device of `tmem stat --json`, if it has one.
    fn of(device: &serde_json::Value) -> Option<Self> {
        let f = device.get("front").filter(|f| f.is_object())?;
        let get = |k: &str| f.get(k).and_then(serde_json::Value::as_u64).unwrap_or(0);
        Some(Self {
            node: f.get("node").and_then(serde_json::Value::as_str).unwrap_or_default().to_owned(),
            pool_bytes: get("pool_bytes"),
            stored_bytes: get("stored_bytes"),
            written_back: get("written_back"),
            read_back: get("read_back"),
        })
    }

    /// zram's own figures for its node, fresher than the daemon's (its
    /// policy samples once a tick): `mm_stat` and `bd_stat`.
    fn fresh_from_zram(&self) -> Option<Self> {
        let name = self.node.strip_prefix("/dev/").filter(|n| n.starts_with("zram"))?;
        let mm = tmem_sys::zram::mm_stat(name).ok()?;
        let bd = std::fs::read_to_string(format!("/sys/block/{name}/bd_stat")).ok()?;
        let bd = tmem_sys::zram::BdStat::parse(&bd).ok()?;
        Some(Self {
            node: self.node.clone(),
            pool_bytes: mm.mem_used_total,
            stored_bytes: mm.orig_data_size,
            written_back: bd.writes,
            read_back: bd.reads,
        })
    }
}

impl Tmem {
    fn prepare(c: &BackendConfig, tier: TmemTier) -> anyhow::Result<Self> {
        if !Path::new("/dev/fuse").exists() {
            return Err(anyhow!("/dev/fuse is missing (modprobe fuse)"));
        }
        if c.tmem_runtime_dir.exists() {
            return Err(anyhow!("{} exists already; is another bench running?", c.tmem_runtime_dir.display()));
        }
        let mut t = Self {
            exe: current_exe()?,
            dir: c.tmem_runtime_dir.clone(),
            size: c.swap_size,
            pool_limit: c.tmem_pool_limit.clone(),
            codec: c.tmem_codec.clone(),
            fuse_uring: c.tmem_fuse_uring.to_string(),
            fuse_threads: c.tmem_fuse_threads,
            discard: c.tmem_discard,
            tier_args: Vec::new(),
            extra_args: Vec::new(),
            active: false,
            pid: None,
            loop_devs: Vec::new(),
            servers: Vec::new(),
            namespaces: Vec::new(),
            net_profile: c.net_profile,
            killed: Vec::new(),
            tier_dir: None,
            tier_disk: None,
            front: None,
        };
        match tier {
            TmemTier::None => {}
            TmemTier::Remote => {
                use crate::redis::{RedisOptions, RedisServer};
                for i in 0..REMOTE_NODES {
                    let mut opts = RedisOptions::default();
                    if c.net_profile != NetProfile::Loopback {
                        let index = u8::try_from(i).unwrap_or(u8::MAX);
                        let ns = Namespace::create(index, c.net_profile)?;
                        opts.netns = Some((ns.name().to_owned(), ns.addr));
                        t.namespaces.push(ns);
                    }
                    let s = RedisServer::start(&opts)
                        .map_err(|e| anyhow!("tmem+remote: cannot start redis-server: {e}"))?;
                    t.servers.push(s);
                }
                let urls: Vec<String> = t.servers.iter().map(RedisServer::url).collect();
                t.tier_args = vec![
                    "--tier".into(),
                    format!("remote={}", urls.join(",")),
                    "--replicas".into(),
                    REMOTE_REPLICAS.to_string(),
                ];
                t.pool_limit = c.tmem_tier_pool_limit.clone();
            }
            TmemTier::Disk => {
                std::fs::create_dir(&c.tier_dir)
                    .map_err(|e| anyhow!("tmem+disk: cannot create {}: {e}", c.tier_dir.display()))?;
                t.tier_dir = Some(c.tier_dir.clone());
                let mut tier = c.tier_dir.clone();
                if let Some(limits) = c.disk_profile.limits() {
                    // An ext4 image as large as the swap area and a quarter, behind the throttle.
                    let image = c.tier_dir.with_extension("img");
                    cmd(
                        "truncate",
                        &["--size", &(c.swap_size + c.swap_size / 4).to_string(), &image.to_string_lossy()],
                    )?;
                    let attached = ThrottledLoop::attach(&image, limits);
                    let mut lo = match attached {
                        Ok(lo) => lo,
                        Err(e) => {
                            let _ = std::fs::remove_file(&image);
                            return Err(e);
                        }
                    };
                    let mounted = lo.mount_ext4(&c.tier_dir);
                    t.tier_disk = Some((lo, image));
                    mounted?;
                    tier = c.tier_dir.join("tier");
                    std::fs::create_dir(&tier).map_err(|e| anyhow!("{}: {e}", tier.display()))?;
                }
                t.tier_args = vec!["--tier".into(), format!("disk={}", tier.display())];
                t.pool_limit = c.tmem_tier_pool_limit.clone();
            }
        }
        Ok(t)
    }

    fn tmem(&self, args: &[&str]) -> anyhow::Result<String> {
        // Resolved every time: the binary may be rebuilt while the bench runs.
        let exe = current_exe().unwrap_or_else(|_| self.exe.clone());
        crate::pressure::tmem_in(&exe, &self.dir, args)
    }

    fn activate(&mut self) -> anyhow::Result<()> {
        self.revive_nodes()?;
        self.active = true;
        let size = self.size.to_string();
        let prio = RAM_PRIORITY.to_string();
        let mut args = vec!["swap", "up", "--size", &size, "--pool-limit", &self.pool_limit, "--codec", &self.codec];
        args.extend(["--fuse-uring", &self.fuse_uring, "--discard", self.discard.as_str()]);
        args.extend(["--priority", &prio]);
        let threads = self.fuse_threads.to_string();
        if self.fuse_threads > 0 {
            args.extend(["--fuse-threads", &threads]);
        }
        args.extend(self.tier_args.iter().chain(&self.extra_args).map(String::as_str));
        let cgroup = self.front.as_ref().and_then(|f| f.cgroup.as_ref()).map(|c| c.to_string_lossy().into_owned());
        match &self.front {
            Some(f) => args.extend(f.args.iter().map(String::as_str)),
            // tmem alone, also where `--front auto` would put zram (with writeback) in front.
            None => args.extend(["--front", "none"]),
        }
        if let Some(c) = &cgroup {
            args.extend(["--front-cgroup", c]);
        }
        let r = self.tmem(&args);
        // Whether or not `up` succeeded, learn what runs so that teardown can find it.
        let mut nodes = Vec::new();
        if let Ok(st) = ctl::call_ok(&self.dir, &Request::Status, Duration::from_secs(5)) {
            self.pid = st.get("pid").and_then(serde_json::Value::as_i64).and_then(|p| i32::try_from(p).ok());
            let devices =
                st.get("devices").and_then(serde_json::Value::as_array).map(Vec::as_slice).unwrap_or_default();
            let field = |name: &str| -> Vec<PathBuf> {
                devices.iter().filter_map(|d| d.get(name)?.as_str().map(PathBuf::from)).collect()
            };
            self.loop_devs = field("loop_dev");
            // The swap areas in front of the loop devices (zram's nodes).
            nodes = field("front_node");
        }
        if let Some(f) = self.front.as_mut() {
            f.nodes = nodes;
        }
        r.map(drop)
    }

    /// Every device's object of `tmem stat --json` (empty if the daemon does not answer).
    fn stat_devices(&self) -> Vec<serde_json::Value> {
        match ctl::call_ok(&self.dir, &Request::Stat, Duration::from_secs(2)) {
            Ok(serde_json::Value::Array(v)) => v,
            _ => Vec::new(),
        }
    }

    /// Each device's `front` object of `tmem stat --json` (one, or an array of them).
    fn front_stats(&self) -> Option<serde_json::Value> {
        let fronts: Vec<serde_json::Value> =
            self.stat_devices().iter().filter_map(|d| d.get("front").cloned()).collect();
        match fronts.len() {
            0 => None,
            1 => fronts.into_iter().next(),
            _ => Some(serde_json::Value::Array(fronts)),
        }
    }

    /// tmem's pools, and with a front the front's pool and counters too:
    /// zram's read from its sysfs files (its node from `tmem stat`'s
    /// `front`, else that object's figures), zswap's pool from
    /// /proc/meminfo, its counters from `front`.
    fn sample(&self) -> PoolSample {
        let devices = self.stat_devices();
        let mut s = PoolSample::default();
        for d in &devices {
            let get = |ptr: &str| d.pointer(ptr).and_then(serde_json::Value::as_u64).unwrap_or(0);
            s.pool_bytes += get("/store/mem_used_total");
            s.stored_bytes += get("/store/total/orig_data_size");
            s.tier_pages += get("/store/total/tier_pages");
            s.writeback_waits += get("/store/writeback_waits");
            for t in d.pointer("/store/tiers").and_then(serde_json::Value::as_array).into_iter().flatten() {
                let get = |k: &str| t.get(k).and_then(serde_json::Value::as_u64).unwrap_or(0);
                s.tier_values_read += get("reads").saturating_sub(get("misses"));
                s.tier_backing_reads += get("backing_reads");
            }
            s.failed_writes += get("/failed_writes");
        }
        match self.front.as_ref().map(|f| f.row) {
            Some(FrontRow::Zram) => {
                // A zram device per tmem device.
                for f in devices.iter().filter_map(FrontSample::of) {
                    let f = f.fresh_from_zram().unwrap_or(f);
                    s.front_pool_bytes += f.pool_bytes;
                    s.stored_bytes += f.stored_bytes;
                    s.written_back += f.written_back;
                    s.read_back += f.read_back;
                }
            }
            Some(FrontRow::Zswap) if !devices.is_empty() => {
                // One zswap for the machine: every device shows the same counters.
                if let Some(f) = devices.iter().find_map(FrontSample::of) {
                    (s.written_back, s.read_back) = (f.written_back, f.read_back);
                }
                s.front_pool_bytes = zswap::pool_bytes().unwrap_or(0);
                s.stored_bytes += zswap::stored_bytes();
            }
            _ => {}
        }
        s.pool_bytes += s.front_pool_bytes;
        s
    }

    fn deactivate(&mut self) -> anyhow::Result<()> {
        if !self.active {
            return Ok(());
        }
        let down = self.tmem(&["swap", "down"]).map(drop);
        if let Some(pid) = self.pid.and_then(Pid::from_raw) {
            let alive = || rustix::process::test_kill_process(pid).is_ok();
            if down.is_err() && alive() {
                // SIGTERM makes the daemon tear down (swapoff first) and exit.
                let _ = rustix::process::kill_process(pid, Signal::TERM);
            }
            let deadline = Instant::now() + Duration::from_secs(600);
            while alive() {
                if Instant::now() > deadline {
                    return Err(anyhow!(
                        "tmem daemon pid {pid} did not exit ({down:?}); its log:\n{}",
                        self.log_tail()
                    ));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        } else if let Err(e) = &down {
            return Err(anyhow!("{e:#}"));
        }
        let nodes = self.front.as_ref().map(|f| f.nodes.as_slice()).unwrap_or_default();
        if self.loop_devs.iter().chain(nodes).any(|d| swap::is_swap(d).unwrap_or(true)) {
            return Err(anyhow!("tmem swap is still on after tmem swap down ({down:?})"));
        }
        if self.mounted() {
            return Err(anyhow!("{} is still mounted after tmem swap down ({down:?})", self.dir.display()));
        }
        if let Err(e) = down {
            tracing::info!("tmem swap down failed ({e}), but SIGTERM stopped the daemon cleanly");
        }
        self.active = false;
        self.pid = None;
        self.loop_devs.clear();
        if let Some(f) = self.front.as_mut() {
            f.nodes.clear();
        }
        Ok(())
    }

    /// Whether anything is mounted under the runtime directory.
    fn mounted(&self) -> bool {
        let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
        let dir = self.dir.to_string_lossy().into_owned();
        mounts
            .lines()
            .any(|l| l.split_whitespace().nth(1).is_some_and(|m| m == dir || m.starts_with(&format!("{dir}/"))))
    }

    fn finish(&mut self) -> anyhow::Result<()> {
        self.deactivate()?;
        if self.dir.exists() && !self.mounted() {
            std::fs::remove_dir_all(&self.dir).map_err(|e| anyhow!("cannot remove {}: {e}", self.dir.display()))?;
        }
        // The daemon is gone, so nothing uses the tiers any more.
        for mut s in self.servers.drain(..) {
            s.kill();
        }
        for mut ns in self.namespaces.drain(..) {
            ns.delete()?;
        }
        if let Some((lo, image)) = self.tier_disk.take() {
            lo.release()?;
            std::fs::remove_file(&image).map_err(|e| anyhow!("cannot remove {}: {e}", image.display()))?;
        }
        if let Some(d) = self.tier_dir.take() {
            std::fs::remove_dir_all(&d).map_err(|e| anyhow!("cannot remove {}: {e}", d.display()))?;
        }
        Ok(())
    }

    /// Brings back the nodes killed in the last run (a fresh namespace,
    /// an empty server), so that every run starts with all of them.
    fn revive_nodes(&mut self) -> anyhow::Result<()> {
        for i in std::mem::take(&mut self.killed) {
            if let Some(ns) = self.namespaces.get_mut(i) {
                *ns = Namespace::create(u8::try_from(i).unwrap_or(u8::MAX), self.net_profile)?;
            }
            self.servers[i].restart().map_err(|e| anyhow!("tmem+remote: cannot restart Redis node {i}: {e}"))?;
        }
        Ok(())
    }

    /// Kills Redis node `i` and, on a network profile, deletes its
    /// namespace (a machine that vanishes); says what it did.
    fn kill_node(&mut self, i: usize) -> anyhow::Result<String> {
        let s = self.servers.get_mut(i).ok_or_else(|| anyhow!("no Redis node {i}"))?;
        let addr = s.addr();
        s.kill();
        self.killed.push(i);
        match self.namespaces.get_mut(i) {
            Some(ns) => {
                ns.delete()?;
                Ok(format!("killed the Redis node at {addr} and deleted its network namespace"))
            }
            None => Ok(format!("killed the Redis node at {addr}")),
        }
    }

    /// The tail of the daemon log (for error messages).
    pub fn log_tail(&self) -> String {
        tmem_daemon::runtime::RuntimeDir::open(&self.dir).map(|d| d.log_tail(10)).unwrap_or_default()
    }
}

impl Drop for Tmem {
    fn drop(&mut self) {
        if let Err(e) = self.finish() {
            tracing::warn!(
                "tmem daemon in {} not stopped: {e}; run tmem swap down --runtime-dir {0}",
                self.dir.display()
            );
        }
    }
}

/// tmem's swap path without tmem's store: a [`RamDevice`] exported by the
/// bench process itself over FUSE (the same settings as `tmem swap up`:
/// direct I/O, async DIO, `/dev/fuse` workers), attached with
/// `losetup --direct-io=on`, writeback throttling off, `swapon
/// --discard=once`. Its pool is the uncompressed pages it holds.
pub struct FuseRam {
    dir: PathBuf,
    size: u64,
    /// `/dev/fuse` worker threads.
    threads: usize,
    active: Option<FuseRamSwap>,
}

/// One activation; tears itself down on drop.
struct FuseRamSwap {
    dir: PathBuf,
    dev: Arc<RamDevice>,
    mount: Option<FuseMount>,
    loop_dev: Option<PathBuf>,
    swap_on: bool,
}

impl FuseRam {
    fn prepare(c: &BackendConfig) -> anyhow::Result<Self> {
        if !Path::new("/dev/fuse").exists() {
            return Err(anyhow!("/dev/fuse is missing (modprobe fuse)"));
        }
        let mut dir = c.tmem_runtime_dir.clone().into_os_string();
        dir.push("-fuse-ram");
        let dir = PathBuf::from(dir);
        if dir.exists() {
            return Err(anyhow!("{} exists already; is another bench running?", dir.display()));
        }
        Ok(Self { dir, size: c.swap_size, threads: fuse_threads(c.tmem_fuse_threads), active: None })
    }

    fn activate(&mut self) -> anyhow::Result<()> {
        std::fs::create_dir_all(&self.dir).map_err(|e| anyhow!("{}: {e}", self.dir.display()))?;
        let dev = Arc::new(RamDevice::new(self.size));
        let a = self.active.insert(FuseRamSwap {
            dir: self.dir.clone(),
            dev: dev.clone(),
            mount: None,
            loop_dev: None,
            swap_on: false,
        });
        let mount = FuseMount::mount(FuseConfig {
            mountpoint: self.dir.clone(),
            exports: vec![Export { name: "swap0".into(), device: dev }],
            threads: self.threads,
            uring_per_queue: 0,
        })?;
        let file = mount.path_of("swap0");
        a.mount = Some(mount);
        let err = |e: swap::SwapError| anyhow!("fuse-ram: {e}");
        let l = a.loop_dev.insert(swap::loop_attach(&file).map_err(err)?).clone();
        swap::loop_disable_wbt(&l).map_err(err)?;
        swap::mkswap(&l, "tmem-fuse-ram").map_err(err)?;
        swap::swapon(&l, RAM_PRIORITY, swap::SwapDiscard::Once).map_err(err)?;
        a.swap_on = true;
        Ok(())
    }

    fn deactivate(&mut self) -> anyhow::Result<()> {
        match self.active.take() {
            Some(mut a) => a.teardown(),
            None => Ok(()),
        }
    }

    fn sample(&self) -> PoolSample {
        let held = self.active.as_ref().map_or(0, |a| a.dev.held_bytes());
        PoolSample { pool_bytes: held, stored_bytes: held, ..Default::default() }
    }
}

impl FuseRamSwap {
    /// swapoff (the kernel reads its pages back through FUSE), detach,
    /// unmount, remove the directory. Stops at the first failure; what is
    /// left is retried on drop.
    fn teardown(&mut self) -> anyhow::Result<()> {
        if let Some(l) = &self.loop_dev {
            if self.swap_on {
                swap::swapoff(l).map_err(|e| anyhow!("fuse-ram: {e}"))?;
                self.swap_on = false;
            }
            swap::loop_detach(l).map_err(|e| anyhow!("fuse-ram: {e}"))?;
            self.loop_dev = None;
        }
        if let Some(m) = self.mount.take() {
            m.unmount().map_err(|e| anyhow!("fuse-ram: {e}"))?;
        }
        if self.dir.exists() {
            std::fs::remove_dir(&self.dir)
                .map_err(|e| anyhow!("fuse-ram: cannot remove {}: {e}", self.dir.display()))?;
        }
        Ok(())
    }
}

impl Drop for FuseRamSwap {
    fn drop(&mut self) {
        if let Err(e) = self.teardown() {
            tracing::warn!("fuse-ram baseline not torn down: {e}");
        }
    }
}
