//! What a daemon runs ([`DaemonSpec`]), and the checks every value passes
//! before anything starts: pool limits, device sizes against what their
//! metadata would cost, codecs.

use std::net::SocketAddr;
use std::path::PathBuf;

use tmem_block::CacheConfig;
use tmem_core::{DictTraining, Eviction, GroupConfig, Incompressible, PolicyConfig, RecompressConfig, StoreConfig};

use crate::{auto_codec, limits, DaemonError};

/// Fewest `/dev/fuse` worker threads by default: on 2 vCPUs 4 workers keep
/// the loop device's queue busy while others wait in the kernel.
pub const MIN_DEFAULT_FUSE_THREADS: usize = 4;

/// `/dev/fuse` worker threads of `tmem swap up` (and of the bench's fuse-ram
/// baseline) by default: one per online CPU, at least
/// [`MIN_DEFAULT_FUSE_THREADS`]. Issue 11 measured, on a 16-core machine,
/// 1.3-2.0x zram's time at 50 % with a fixed 4 and 1.1-1.2x with 12.
/// Never more than [`crate::limits::fuse_threads`] allows here.
pub fn default_fuse_threads() -> usize {
    let n = std::thread::available_parallelism().map_or(1, usize::from).max(MIN_DEFAULT_FUSE_THREADS);
    let max = crate::limits::Machine::this().map_or(crate::limits::MAX_FUSE_THREADS, |m| m.max_fuse_threads());
    n.min(usize::try_from(max).unwrap_or(usize::MAX))
}

/// Smallest pool limit given in bytes.
pub const MIN_POOL_LIMIT: u64 = 1 << 20;
/// Smallest device.
pub const MIN_DEVICE_SIZE: u64 = 1 << 20;
/// Kernel memory per 4 KiB page of a swap area: `swap_map` (1 byte), the
/// swap cgroup map (2), the swap table (8) and cluster info. Measured: a
/// 4 TiB area (2^30 pages) raised `VmallocUsed` by 13.4 GB, 12.5 bytes a
/// page; rounded up.
pub const SWAP_METADATA_PER_PAGE: u64 = 13;
/// Share of RAM that the kernel's metadata for tmem's swap areas may take.
pub const MAX_METADATA_RAM_DIVISOR: u64 = 16;

/// One device to create.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct DeviceSpec {
    /// Name, e.g. `swap0`.
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// Codec: lz4, zstd, zstd:LEVEL; "+dict" trains a dictionary once the
    /// pool holds 8 MiB, and newer ones as it grows; auto (see
    /// [`auto_codec`]) until the daemon resolves it.
    pub codec: String,
    /// The pool limit.
    pub pool_limit: PoolLimit,
    /// Background recompression of cold pages.
    #[serde(default)]
    pub recompress: RecompressArgs,
    /// Background grouping of cold pages.
    #[serde(default)]
    pub group: GroupArgs,
}

/// Background recompression options, shared by every command that builds devices.
#[derive(clap::Args, Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RecompressArgs {
    /// Recompress pages that go unread for a while with this denser codec, in a
    /// low-priority thread: zstd, zstd:LEVEL, "+dict" to train a dictionary first.
    #[arg(long)]
    pub recompress: Option<String>,
    /// Seconds a page goes unread before it is recompressed (it is taken after one to two of these).
    #[arg(long, default_value_t = RecompressConfig::DEFAULT_AFTER.as_secs_f64(), value_parser = parse_after)]
    pub recompress_after: f64,
}

impl Default for RecompressArgs {
    fn default() -> Self {
        Self { recompress: None, recompress_after: RecompressConfig::DEFAULT_AFTER.as_secs_f64() }
    }
}

/// `--recompress-after`: a number of seconds, 0.01 to 86400.
pub fn parse_after(s: &str) -> Result<f64, String> {
    s.trim().parse::<f64>().map_err(|_| format!("{s:?} is not a number of seconds")).and_then(check_after)
}

/// `swap.recompress-after` (and `--recompress-after`): 0.01 to 86400 seconds.
pub fn check_after(secs: f64) -> Result<f64, String> {
    if (0.01..=86_400.0).contains(&secs) {
        Ok(secs)
    } else {
        Err(format!("{secs} seconds is outside 0.01..86400"))
    }
}

impl RecompressArgs {
    /// The store's recompression settings, if recompression is on.
    pub fn config(&self) -> Result<Option<RecompressConfig>, DaemonError> {
        let Some(spec) = &self.recompress else { return Ok(None) };
        let bad = |e: String| DaemonError::Invalid(format!("recompression codec {spec:?}: {e}"));
        let mut cfg = RecompressConfig::parse(spec).map_err(|e| bad(e.to_string()))?;
        cfg.codec.build().map_err(|e| bad(e.to_string()))?;
        cfg.after = std::time::Duration::from_secs_f64(check_after(self.recompress_after).map_err(bad)?);
        Ok(Some(cfg))
    }
}

/// Grouping of cold pages, shared by every command that builds swap devices.
#[derive(clap::Args, Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GroupArgs {
    /// Compress the cold pages of each 64 KiB of adjacent swap slots
    /// together, in a low-priority thread: "zstd:LEVEL" (1..=22), with
    /// "+dict" to use the store's dictionary (trained on the pool first).
    /// Denser than any per-page codec; a read decodes its block (cached for
    /// the neighbours). Off by default.
    #[arg(long, value_name = "zstd:LEVEL[+dict]", value_parser = parse_group)]
    pub group: Option<String>,
    /// Seconds a page goes unread before it is grouped (it is taken after one to two of these).
    #[arg(long, default_value_t = GroupConfig::DEFAULT_AFTER.as_secs_f64(), value_parser = parse_after)]
    pub group_after: f64,
}

impl Default for GroupArgs {
    fn default() -> Self {
        Self { group: None, group_after: GroupConfig::DEFAULT_AFTER.as_secs_f64() }
    }
}

/// `--group` (and `swap.group`): `zstd:LEVEL[+dict]`, level 1..=22.
pub fn parse_group(s: &str) -> Result<String, String> {
    group_codec(s).map(|_| s.trim().to_owned())
}

/// The level and dictionary choice of a `--group` spec.
fn group_codec(s: &str) -> Result<(i32, bool), String> {
    let t = s.trim();
    let (codec, dictionary) = t.strip_suffix("+dict").map_or((t, false), |c| (c, true));
    let level = match codec.split_once(':') {
        None if codec == "zstd" => 9,
        Some(("zstd", l)) => l.trim().parse::<i32>().map_err(|_| format!("{s:?}: level {l:?} is not a number"))?,
        _ => return Err(format!("{s:?}: groups are compressed with zstd: zstd, zstd:LEVEL, with +dict or not")),
    };
    if !(1..=22).contains(&level) {
        return Err(format!("{s:?}: zstd level {level} is outside 1..=22"));
    }
    Ok((level, dictionary))
}

impl GroupArgs {
    /// The store's grouping settings, if grouping is on.
    pub fn config(&self) -> Result<Option<GroupConfig>, DaemonError> {
        let Some(spec) = &self.group else { return Ok(None) };
        let bad = |e: String| DaemonError::Invalid(format!("grouping {spec:?}: {e}"));
        let (level, dictionary) = group_codec(spec).map_err(bad)?;
        let after = std::time::Duration::from_secs_f64(check_after(self.group_after).map_err(bad)?);
        let cfg = GroupConfig { level, dictionary, after, ..GroupConfig::default() };
        cfg.build().map_err(|e| bad(e.to_string()))?;
        Ok(Some(cfg))
    }
}

/// A pool limit: bytes, or a percentage of RAM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum PoolLimit {
    /// At most this many bytes.
    Bytes(u64),
    /// At most this share of RAM.
    Percent(u32),
}

impl std::str::FromStr for PoolLimit {
    type Err = DaemonError;

    /// `2G`, `512M`, or `25%`: 1..100 percent, or at least 1 MiB.
    fn from_str(s: &str) -> Result<Self, DaemonError> {
        let bad = |why: String| DaemonError::Invalid(format!("pool limit {s:?}: {why}"));
        match s.trim().strip_suffix('%') {
            Some(p) => match p.trim().parse::<u32>() {
                Ok(p @ 1..=100) => Ok(Self::Percent(p)),
                _ => Err(bad("a percentage must be 1%..100%".into())),
            },
            None => {
                let b = tmem_corpus::parse_size(s).map_err(bad)?;
                if b < MIN_POOL_LIMIT {
                    return Err(bad(format!("{b} bytes is below the minimum of 1 MiB")));
                }
                Ok(Self::Bytes(b))
            }
        }
    }
}

/// One cache device to create: a backing file or block device served
/// through an ephemeral pool (`tmem cache up`).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct CacheSpec {
    /// Name, e.g. `cache0`.
    pub name: String,
    /// The file or block device it mirrors.
    pub backing: PathBuf,
    /// Codec and pool limit of its own store. Ignored when the daemon also
    /// serves swap devices: the cache's pool then lives in the first swap
    /// device's store and shares its budget (swap pages evict cached ones).
    pub codec: String,
    /// Pool limit of its own store (see `codec`).
    pub pool_limit: PoolLimit,
    /// Which cached page goes first.
    pub eviction: Eviction,
    /// Emulated latency per backing read, microseconds (benchmarks only).
    #[serde(default)]
    pub backing_latency_us: u64,
}

impl CacheSpec {
    /// The store configuration of a cache with a store of its own.
    pub fn store_config(&self, total_ram: u64) -> Result<StoreConfig, DaemonError> {
        let as_device = DeviceSpec {
            name: self.name.clone(),
            size: 0,
            codec: self.codec.clone(),
            pool_limit: self.pool_limit,
            recompress: RecompressArgs::default(),
            group: GroupArgs::default(),
        };
        let mut cfg = store_config(&as_device, total_ram)?;
        // A cache page that compresses poorly is cheaper to read again from
        // the backing store than to hold raw.
        cfg.policy.incompressible = Incompressible::Reject;
        Ok(cfg)
    }

    /// The cache device's configuration; `store` serves when it has its own.
    pub fn device_config(&self, store: StoreConfig) -> CacheConfig {
        CacheConfig {
            name: self.name.clone(),
            backing: self.backing.clone(),
            store,
            eviction: self.eviction,
            backing_latency: std::time::Duration::from_micros(self.backing_latency_us),
        }
    }
}

/// What the daemon runs.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct DaemonSpec {
    /// Runtime directory (control socket, FUSE mount, log, lock).
    pub runtime_dir: PathBuf,
    /// Devices.
    pub devices: Vec<DeviceSpec>,
    /// Cache devices (exported beside the devices, never used as swap).
    #[serde(default)]
    pub caches: Vec<CacheSpec>,
    /// Export the devices as FUSE files.
    pub fuse: bool,
    /// Turn each device into kernel swap (needs `fuse`).
    pub swap: bool,
    /// How the kernel reaches the devices when `fuse` is set (the name
    /// predates NBD: `fuse` means "give the devices to the kernel").
    #[serde(default)]
    pub transport: crate::transport::Transport,
    /// Serve the devices over NBD: a unix socket path, or `tcp:ADDR`.
    #[serde(default)]
    pub nbd: Option<String>,
    /// Allow a non-loopback NBD TCP address.
    #[serde(default)]
    pub nbd_allow_remote: bool,
    /// NBD: seconds without a request after which a connection may be
    /// closed to make room for a new client (`tmem_nbd::NbdConfig::idle_reclaim`);
    /// 0: never; `None`: the server's default (30).
    #[serde(default)]
    pub nbd_idle_reclaim: Option<u64>,
    /// NBD: seconds without a request after which a connection is closed
    /// even with slots free (`tmem_nbd::NbdConfig::idle_timeout`; breaks swap
    /// on the kernel's client); `None` or 0: never.
    #[serde(default)]
    pub nbd_idle_timeout: Option<u64>,
    /// Swap priority.
    pub priority: i32,
    /// FUSE worker threads.
    pub fuse_threads: usize,
    /// FUSE over io_uring workers per CPU (0: `/dev/fuse` only).
    #[serde(default)]
    pub fuse_uring: usize,
    /// `swapon --discard` policy.
    #[serde(default)]
    pub discard: tmem_sys::swap::SwapDiscard,
    /// Empty an idle swap area that holds a few slots and many freed ones
    /// by swapoff and swapon (crate::stale, `Recycle`).
    #[serde(default = "yes")]
    pub recycle_idle_swap: bool,
    /// Tiers below each device's pool.
    #[serde(default)]
    pub tiers: crate::tiers::TierArgs,
    /// The kernel's compressed swap in front of the devices (`--front`).
    #[serde(default)]
    pub front: crate::front::FrontArgs,
    /// Serve Prometheus metrics on this address (`/metrics`), e.g. `127.0.0.1:9848`.
    #[serde(default)]
    pub metrics: Option<SocketAddr>,
    /// Allow a non-loopback metrics address (`--allow-remote-metrics`).
    #[serde(default)]
    pub metrics_allow_remote: bool,
    /// The runtime directory's lock, inherited from the command that started
    /// the daemon (a descriptor number); `None`: the daemon takes it.
    #[serde(default)]
    pub lock_fd: Option<i32>,
}

impl DaemonSpec {
    /// Resolves every `auto` codec for `front` (see [`auto_codec`]); the
    /// setup's steps, for the codecs that were `auto`.
    pub fn resolve_codecs(&mut self, front: tmem_front::Front) -> Vec<String> {
        let mut steps = Vec::new();
        let codecs = self.devices.iter_mut().map(|d| (&d.name, &mut d.codec));
        for (name, codec) in codecs.chain(self.caches.iter_mut().map(|c| (&c.name, &mut c.codec))) {
            if let Some(why) = auto_codec::reason(codec, front) {
                steps.push(format!("{name}: {why}"));
            }
            *codec = auto_codec::resolve(codec, front).to_owned();
        }
        steps
    }

    /// Checks everything that can be checked before the daemon starts:
    /// device sizes and count, codecs and limits, tiers and key file.
    pub fn validate(&self, total_ram: u64) -> Result<(), DaemonError> {
        if self.devices.is_empty() && self.caches.is_empty() {
            return Err(DaemonError::Invalid("need at least one device".into()));
        }
        let count = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
        limits::devices("devices", count(self.devices.len()), self.swap)?;
        limits::caches("caches", count(self.caches.len()), count(self.devices.len()))?;
        if self.fuse {
            limits::range("fuse threads", count(self.fuse_threads), 1..=limits::MAX_FUSE_THREADS, "the most threads")?;
            limits::range(
                "fuse io_uring workers",
                count(self.fuse_uring),
                0..=limits::MAX_FUSE_URING,
                "the most per CPU",
            )?;
        }
        for c in &self.caches {
            if self.devices.iter().any(|d| d.name == c.name)
                || self.caches.iter().filter(|o| o.name == c.name).count() > 1
            {
                return Err(DaemonError::Invalid(format!("two devices are named {:?}", c.name)));
            }
            let meta = std::fs::metadata(&c.backing)
                .map_err(|e| DaemonError::Invalid(format!("{}: backing store {}: {e}", c.name, c.backing.display())))?;
            if !(meta.is_file() || std::os::unix::fs::FileTypeExt::is_block_device(&meta.file_type())) {
                return Err(DaemonError::Invalid(format!(
                    "{}: backing store {} is neither a regular file nor a block device",
                    c.name,
                    c.backing.display()
                )));
            }
            limits::pool_limit(&format!("{}: pool limit", c.name), c.pool_limit, total_ram)?;
            if c.backing_latency_us > 1_000_000 {
                return Err(DaemonError::Invalid(format!(
                    "{}: backing latency {} us is above the maximum of 1 s",
                    c.name, c.backing_latency_us
                )));
            }
            c.store_config(total_ram)?.build().map_err(|e| DaemonError::Invalid(format!("{}: {e}", c.name)))?;
        }
        if self.swap {
            check_swap_size(self.devices.iter().map(|d| d.size), total_ram)?;
        }
        limits::device_sizes(&self.devices.iter().map(|d| d.size).collect::<Vec<_>>(), total_ram)?;
        for d in &self.devices {
            if d.size < MIN_DEVICE_SIZE {
                return Err(DaemonError::Invalid(format!("{}: size {} is below the minimum of 1 MiB", d.name, d.size)));
            }
            limits::pool_limit(&format!("{}: pool limit", d.name), d.pool_limit, total_ram)?;
            store_config(d, total_ram)?.build().map_err(|e| DaemonError::Invalid(format!("{}: {e}", d.name)))?;
            d.recompress.config()?;
        }
        if let Some(addr) = self.metrics {
            crate::metrics::server::check_address(addr, self.metrics_allow_remote)?;
        }
        if self.swap {
            self.front.validate(total_ram)?;
        } else if !matches!(self.front.front, tmem_front::FrontKind::Auto | tmem_front::FrontKind::None) {
            return Err(DaemonError::Invalid(format!(
                "--front {} puts the kernel's swap in front of tmem's: it needs swap devices (tmem swap up)",
                self.front.front.as_str()
            )));
        }
        self.tiers.validate(self.devices.len())
    }
}

/// Refuses swap areas whose kernel metadata would take more than
/// 1/[`MAX_METADATA_RAM_DIVISOR`] of RAM, with the numbers.
pub fn check_swap_size(sizes: impl Iterator<Item = u64>, total_ram: u64) -> Result<(), DaemonError> {
    let pages: u64 = sizes.map(|s| s / 4096).fold(0, u64::saturating_add);
    let metadata = pages.saturating_mul(SWAP_METADATA_PER_PAGE);
    let allowed = total_ram / MAX_METADATA_RAM_DIVISOR;
    if metadata > allowed {
        let largest = allowed / SWAP_METADATA_PER_PAGE * 4096;
        return Err(DaemonError::Invalid(format!(
            "swap of {} in all would need about {} of kernel memory for its metadata \
             ({SWAP_METADATA_PER_PAGE} bytes per 4 KiB page), more than 1/{MAX_METADATA_RAM_DIVISOR} of RAM ({}); \
             the largest total size here is {}",
            crate::human(pages.saturating_mul(4096)),
            crate::human(metadata),
            crate::human(allowed),
            crate::human(largest),
        )));
    }
    Ok(())
}

/// `count` device specs `PREFIX0..`, all alike.
pub fn device_specs(
    prefix: &str,
    count: usize,
    size: u64,
    codec: &str,
    pool_limit: PoolLimit,
    recompress: &RecompressArgs,
    group: &GroupArgs,
) -> Vec<DeviceSpec> {
    (0..count)
        .map(|i| DeviceSpec {
            name: format!("{prefix}{i}"),
            size,
            codec: codec.to_owned(),
            pool_limit,
            recompress: recompress.clone(),
            group: group.clone(),
        })
        .collect()
}

/// Cache specs `cache0..`, one per backing store, all alike.
pub fn cache_specs(backings: &[PathBuf], codec: &str, pool_limit: PoolLimit, opts: &CacheArgs) -> Vec<CacheSpec> {
    backings
        .iter()
        .enumerate()
        .map(|(i, b)| CacheSpec {
            name: format!("cache{i}"),
            backing: b.clone(),
            codec: codec.to_owned(),
            pool_limit,
            eviction: opts.eviction,
            backing_latency_us: opts.backing_latency_us,
        })
        .collect()
}

/// Options of cache devices, shared by `tmem cache up` and `tmem serve nbd
/// --backing`. Codec and pool limit are the command's own: with devices in
/// the same daemon the cache shares the first one's store.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct CacheArgs {
    /// Which cached page goes first: sieve or lru.
    #[arg(long, default_value = "sieve")]
    pub eviction: Eviction,
    /// Emulated latency added to each backing read, in microseconds (benchmarks of a slow volume; 0: none).
    #[arg(long, default_value_t = 0)]
    pub backing_latency_us: u64,
}

/// Builds the store configuration of a device.
/// A codec still `auto` ([`DaemonSpec::resolve_codecs`] has not run: a
/// check before the front is chosen) builds as it would with no front
/// ([`auto_codec::parse`]).
pub fn store_config(d: &DeviceSpec, total_ram: u64) -> Result<StoreConfig, DaemonError> {
    let choice = auto_codec::parse(&d.codec).map_err(|e| DaemonError::Invalid(format!("codec {:?}: {e}", d.codec)))?;
    let (max_pool_bytes, max_pool_percent) = match d.pool_limit {
        PoolLimit::Bytes(b) => (b, 0),
        PoolLimit::Percent(p) => (0, p),
    };
    let policy = PolicyConfig {
        max_pool_bytes,
        max_pool_percent,
        total_ram_bytes: total_ram,
        // A swap device has no lower tier yet: keep poorly compressible
        // pages raw rather than failing the kernel's write (zram's huge pages).
        incompressible: Incompressible::StoreRaw,
        ..Default::default()
    };
    Ok(StoreConfig {
        policy,
        codec: Some(choice.codec),
        dictionary: choice.dictionary.then(DictTraining::default),
        group: d.group.config()?,
        // Neighbours leave together: a tier below reads a readahead's pages
        // back with one request.
        shard_windows: true,
        // A successor adopts the pool's memfd instead of copying it.
        shared_memory: true,
        ..Default::default()
    })
}

/// serde's default for flags that are on unless said otherwise.
fn yes() -> bool {
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_specs_name_what_is_wrong() {
        let cfg = |g: &str| GroupArgs { group: Some(g.into()), group_after: 5.0 }.config();
        let c = cfg("zstd:12+dict").unwrap().unwrap();
        assert_eq!((c.level, c.dictionary, c.after), (12, true, std::time::Duration::from_secs(5)));
        let c = cfg(" zstd ").unwrap().unwrap();
        assert_eq!((c.level, c.dictionary), (9, false));
        assert!(GroupArgs::default().config().unwrap().is_none());
        for (bad, why) in [
            ("lz4", "groups are compressed with zstd"),
            ("zstd:0", "zstd level 0 is outside 1..=22"),
            ("zstd:23+dict", "zstd level 23 is outside 1..=22"),
            ("zstd:x", "level \"x\" is not a number"),
            ("zstd+dict+dict", "groups are compressed with zstd"),
        ] {
            let e = cfg(bad).unwrap_err().to_string();
            assert!(e.contains(why) && e.contains(bad), "{bad}: {e}");
            assert!(parse_group(bad).is_err());
        }
        let e = GroupArgs { group: Some("zstd".into()), group_after: 0.0 }.config().unwrap_err().to_string();
        assert!(e.contains("0 seconds is outside 0.01..86400"), "{e}");
    }

    #[test]
    fn pool_limits_are_checked_like_swap_up_does() {
        assert_eq!("25%".parse::<PoolLimit>().unwrap(), PoolLimit::Percent(25));
        assert_eq!("2G".parse::<PoolLimit>().unwrap(), PoolLimit::Bytes(2 << 30));
        for bad in ["0%", "101%", "x%", "1", "1K", "garbage", ""] {
            let e = bad.parse::<PoolLimit>().unwrap_err().to_string();
            assert!(e.contains(&format!("{bad:?}")), "{bad}: {e}");
        }
    }

    /// Finding: `--size 99999T` was accepted and activated a 4 TiB area.
    #[test]
    fn swap_sizes_are_bounded_by_their_metadata() {
        let ram = 24 << 30;
        check_swap_size([8u64 << 30].into_iter(), ram).unwrap();
        check_swap_size([64u64 << 30; 4].into_iter(), ram).unwrap();
        let e = check_swap_size([99999u64 << 40].into_iter(), ram).unwrap_err().to_string();
        assert!(e.contains("kernel memory") && e.contains("the largest total size here is"), "{e}");
        // The largest size it names is accepted, and a page more is not.
        let largest = ram / MAX_METADATA_RAM_DIVISOR / SWAP_METADATA_PER_PAGE * 4096;
        check_swap_size([largest].into_iter(), ram).unwrap();
        assert!(check_swap_size([largest + 4096 * 2].into_iter(), ram).is_err());
        assert!(check_swap_size([u64::MAX, u64::MAX].into_iter(), ram).is_err());
    }
}
