//! The configuration file (`/etc/tmem/tmem.toml` by default): what `tmem
//! swap up` runs, in TOML, with the same names and checks as its flags.
//!
//! ```toml
//! [swap]
//! devices = 1
//! size = "8G"
//! pool-limit = "25%"       # or "2G"
//! codec = "auto"           # lz4, zstd, zstd:3, lz4+dict, ... (auto: lz4, zstd:3+dict behind a front)
//! priority = 100
//! fuse-threads = 16       # default: one per online CPU, at least 4
//! fuse-uring = 0
//! discard = "once"         # or "pages"
//! transport = "auto"       # or "ublk", "nbd" (the kernel's NBD client), "fuse"
//! recycle-idle-swap = true # empty an idle area by swapoff + swapon
//! recompress = "zstd:3+dict"  # cold pages, in the background (off when absent)
//! recompress-after = 2     # seconds unread before a page is recompressed
//! group = "zstd:9+dict"    # cold neighbours compressed together (off when absent)
//! group-after = 10         # seconds unread before a page is grouped
//! runtime-dir = "/run/tmem"
//! wait = 60
//! metrics = "127.0.0.1:9848"  # Prometheus /metrics (off when absent)
//! allow-remote-metrics = false # permit a non-loopback metrics address
//!
//! [tiers]
//! tier = ["remote=redis://10.0.0.2:6379,redis://10.0.0.3:6379", "disk=/var/lib/tmem"]
//! replicas = 2
//! key-file = "/etc/tmem/key"
//! cluster-id = "tmem"
//! host-id = "web1"
//! disk-capacity = "16G"
//!
//! [front]                  # the kernel's compressed swap in front of tmem
//! kind = "auto"            # zram, zswap, none
//! limit = "10%"            # its budget (and zram's mem_limit)
//! algorithm = "lz4"        # zram comp_algorithm / zswap compressor
//! idle-age = 30            # seconds unaccessed before a page goes down
//! fill = 50                # % of the budget below which nothing goes down
//! rate = 25600             # pages a second at most
//! cgroups = ["/sys/fs/cgroup/jobs"]  # zswap on cgroup v2: memory.zswap.max
//! ```
//!
//! Flags given on the command line override the file. A bad file gets one
//! error naming the file, the line and column, and the key; nothing starts.

use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use toml::Spanned;

use crate::limits::{self, LimitError, Machine};
use crate::spec::{check_swap_size, PoolLimit, MIN_DEVICE_SIZE};
use crate::tiers::{parse_tier, TierSpec};

/// Where `tmem swap up` looks for its configuration when `--config` is not given.
pub const DEFAULT_CONFIG: &str = "/etc/tmem/tmem.toml";
/// Largest configuration file read.
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Configuration errors: one line naming the file, where and what.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// The file is not valid, or a value is wrong.
    #[error("{path}:{line}:{column}: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// What is wrong, naming the key.
        message: String,
    },
    /// What this machine holds cannot be read.
    #[error(transparent)]
    Machine(#[from] LimitError),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    #[serde(default)]
    swap: RawSwap,
    #[serde(default)]
    tiers: RawTiers,
    #[serde(default)]
    front: RawFront,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RawFront {
    kind: Option<Spanned<String>>,
    limit: Option<Spanned<String>>,
    algorithm: Option<Spanned<String>>,
    idle_age: Option<Spanned<f64>>,
    fill: Option<Spanned<u64>>,
    rate: Option<Spanned<u64>>,
    cgroups: Option<Spanned<Vec<PathBuf>>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RawSwap {
    devices: Option<Spanned<u64>>,
    size: Option<Spanned<String>>,
    pool_limit: Option<Spanned<String>>,
    codec: Option<Spanned<String>>,
    priority: Option<Spanned<i64>>,
    fuse_threads: Option<Spanned<u64>>,
    fuse_uring: Option<Spanned<u64>>,
    discard: Option<Spanned<String>>,
    transport: Option<Spanned<String>>,
    recycle_idle_swap: Option<Spanned<bool>>,
    recompress: Option<Spanned<String>>,
    recompress_after: Option<Spanned<f64>>,
    group: Option<Spanned<String>>,
    group_after: Option<Spanned<f64>>,
    runtime_dir: Option<Spanned<PathBuf>>,
    wait: Option<Spanned<u64>>,
    metrics: Option<Spanned<String>>,
    allow_remote_metrics: Option<Spanned<bool>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RawTiers {
    tier: Option<Spanned<Vec<String>>>,
    replicas: Option<Spanned<u64>>,
    key_file: Option<Spanned<PathBuf>>,
    cluster_id: Option<Spanned<String>>,
    host_id: Option<Spanned<String>>,
    disk_capacity: Option<Spanned<String>>,
}

/// A checked configuration file; `None` where the file says nothing.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Config {
    /// The file it came from.
    pub path: Option<PathBuf>,
    /// `swap.devices`.
    pub devices: Option<usize>,
    /// `swap.size`, bytes.
    pub size: Option<u64>,
    /// `swap.pool-limit`.
    pub pool_limit: Option<PoolLimit>,
    /// `swap.codec`.
    pub codec: Option<String>,
    /// `swap.priority`.
    pub priority: Option<i32>,
    /// `swap.fuse-threads`.
    pub fuse_threads: Option<usize>,
    /// `swap.fuse-uring`.
    pub fuse_uring: Option<usize>,
    /// `swap.discard`.
    pub discard: Option<tmem_sys::swap::SwapDiscard>,
    /// `swap.transport`.
    pub transport: Option<crate::transport::Transport>,
    /// `swap.recycle-idle-swap`.
    pub recycle_idle_swap: Option<bool>,
    /// `swap.recompress`: the recompression codec.
    pub recompress: Option<String>,
    /// `swap.recompress-after`, seconds.
    pub recompress_after: Option<f64>,
    /// `swap.group`: grouping of cold pages, `zstd:LEVEL[+dict]`.
    pub group: Option<String>,
    /// `swap.group-after`, seconds.
    pub group_after: Option<f64>,
    /// `swap.runtime-dir`.
    pub runtime_dir: Option<PathBuf>,
    /// `swap.wait`, seconds.
    pub wait: Option<u64>,
    /// `swap.metrics`: where to serve Prometheus metrics.
    pub metrics: Option<std::net::SocketAddr>,
    /// `swap.allow-remote-metrics`: permit a non-loopback `swap.metrics`.
    pub allow_remote_metrics: Option<bool>,
    /// `tiers.tier`.
    pub tiers: Option<Vec<TierSpec>>,
    /// `tiers.replicas`.
    pub replicas: Option<usize>,
    /// `tiers.key-file`.
    pub key_file: Option<PathBuf>,
    /// `tiers.cluster-id`.
    pub cluster_id: Option<String>,
    /// `tiers.host-id`.
    pub host_id: Option<String>,
    /// `tiers.disk-capacity`, bytes.
    pub disk_capacity: Option<u64>,
    /// `front.kind`.
    pub front: Option<tmem_front::FrontKind>,
    /// `front.limit`.
    pub front_limit: Option<PoolLimit>,
    /// `front.algorithm`.
    pub front_algorithm: Option<String>,
    /// `front.idle-age`, seconds.
    pub front_idle_age: Option<f64>,
    /// `front.fill`, %.
    pub front_fill: Option<u64>,
    /// `front.rate`, pages a second.
    pub front_rate: Option<u64>,
    /// `front.cgroups`.
    pub front_cgroups: Option<Vec<PathBuf>>,
}

impl Config {
    /// Reads `path` (a regular file of at most 1 MiB) and checks every value.
    /// It is opened `O_NONBLOCK` and checked on the opened descriptor, so a
    /// FIFO or a device is refused at once instead of blocking the open.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let read = |source| ConfigError::Read { path: path.to_owned(), source };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)
            .map_err(read)?;
        let meta = file.metadata().map_err(read)?;
        if !meta.is_file() || meta.len() > MAX_CONFIG_BYTES {
            let what = describe(meta.file_type());
            return Err(read(std::io::Error::other(format!(
                "{what} of {} bytes: not a regular file of at most 1 MiB ({MAX_CONFIG_BYTES} bytes)",
                meta.len()
            ))));
        }
        let mut text = String::new();
        std::io::Read::read_to_string(&mut std::io::Read::take(file, MAX_CONFIG_BYTES), &mut text).map_err(read)?;
        Self::parse(&text, path)
    }

    /// The file given with `--config`, else the default one if it exists.
    pub fn load_default_or(path: Option<&Path>) -> Result<Self, ConfigError> {
        match path {
            Some(p) => Self::load(p),
            None if Path::new(DEFAULT_CONFIG).exists() => Self::load(Path::new(DEFAULT_CONFIG)),
            None => Ok(Self::default()),
        }
    }

    /// Parses and checks configuration text (`path` names it in errors)
    /// against what this machine holds.
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        Self::parse_on(text, path, &Machine::this()?)
    }

    /// Parses and checks configuration text against what `machine` holds.
    pub fn parse_on(text: &str, path: &Path, machine: &Machine) -> Result<Self, ConfigError> {
        let at = |span: Option<std::ops::Range<usize>>, message: String| {
            let (line, column) = line_column(text, span.map_or(0, |s| s.start));
            ConfigError::Invalid { path: path.to_owned(), line, column, message }
        };
        let raw: RawFile = toml::from_str(text).map_err(|e| at(e.span(), e.message().to_owned()))?;
        // Checks one value with `check`, naming `key` and pointing at it.
        macro_rules! checked {
            ($field:expr, $key:literal, $check:expr) => {
                match $field {
                    None => None,
                    Some(v) => {
                        let span = v.span();
                        #[allow(clippy::redundant_closure_call)]
                        let r: Result<_, String> = ($check)(v.into_inner());
                        Some(r.map_err(|e| at(Some(span), format!("{}: {e}", $key)))?)
                    }
                }
            };
        }
        // Every count and size is checked by `limits` before anything is built from it.
        let detail = |e: LimitError| e.detail();
        let s = raw.swap;
        let t = raw.tiers;
        let f = raw.front;
        Ok(Self {
            path: Some(path.to_owned()),
            devices: checked!(s.devices, "swap.devices", |n: u64| match n {
                0 => Err("need at least one device".to_owned()),
                n => limits::devices("", n, true).map_err(detail),
            }),
            size: checked!(s.size, "swap.size", |v: String| {
                let size = tmem_corpus::parse_size(&v)?;
                limits::range("", size, MIN_DEVICE_SIZE..=u64::MAX, "the smallest device is 1 MiB").map_err(detail)?;
                limits::device_sizes(&[size], machine.total_ram).map_err(detail)?;
                check_swap_size([size].into_iter(), machine.total_ram).map_err(|e| e.to_string())?;
                Ok::<_, String>(size)
            }),
            pool_limit: checked!(s.pool_limit, "swap.pool-limit", |v: String| v
                .parse::<PoolLimit>()
                .map_err(|e| e.to_string())
                .and_then(|l| limits::pool_limit("", l, machine.total_ram).map_err(detail))),
            codec: checked!(s.codec, "swap.codec", |v: String| crate::auto_codec::parse(&v)
                .map(|_| v)
                .map_err(|e| e.to_string())),
            priority: checked!(s.priority, "swap.priority", |p: i64| limits::priority("", p).map_err(detail)),
            fuse_threads: checked!(s.fuse_threads, "swap.fuse-threads", |n: u64| limits::fuse_threads("", n, machine)
                .map_err(detail)),
            fuse_uring: checked!(s.fuse_uring, "swap.fuse-uring", |n: u64| limits::fuse_uring("", n, machine)
                .map_err(detail)),
            discard: checked!(s.discard, "swap.discard", |v: String| v.parse::<tmem_sys::swap::SwapDiscard>()),
            transport: checked!(s.transport, "swap.transport", |v: String| v.parse::<crate::transport::Transport>()),
            recycle_idle_swap: checked!(s.recycle_idle_swap, "swap.recycle-idle-swap", Ok::<bool, String>),
            recompress: checked!(s.recompress, "swap.recompress", |v: String| {
                let args = crate::spec::RecompressArgs { recompress: Some(v.clone()), ..Default::default() };
                args.config().map(|_| v).map_err(|e| e.to_string())
            }),
            recompress_after: checked!(s.recompress_after, "swap.recompress-after", crate::spec::check_after),
            group: checked!(s.group, "swap.group", |v: String| crate::spec::parse_group(&v)),
            group_after: checked!(s.group_after, "swap.group-after", crate::spec::check_after),
            runtime_dir: checked!(s.runtime_dir, "swap.runtime-dir", |p: PathBuf| if p.is_absolute() {
                Ok(p)
            } else {
                Err("must be an absolute path".to_owned())
            }),
            wait: checked!(s.wait, "swap.wait", |n: u64| limits::wait("", n).map_err(detail)),
            metrics: checked!(s.metrics, "swap.metrics", |v: String| v
                .parse::<std::net::SocketAddr>()
                .map_err(|e| format!("{v:?} is not an IP address and port: {e}"))),
            allow_remote_metrics: checked!(s.allow_remote_metrics, "swap.allow-remote-metrics", |b: bool| Ok::<
                _,
                String,
            >(
                b
            )),
            tiers: checked!(t.tier, "tiers.tier", |v: Vec<String>| v.iter().map(|s| parse_tier(s)).collect()),
            replicas: checked!(t.replicas, "tiers.replicas", |n: u64| limits::replicas("", n).map_err(detail)),
            key_file: checked!(t.key_file, "tiers.key-file", |p: PathBuf| Ok::<_, String>(p)),
            cluster_id: checked!(t.cluster_id, "tiers.cluster-id", |v: String| Ok::<_, String>(v)),
            host_id: checked!(t.host_id, "tiers.host-id", |v: String| Ok::<_, String>(v)),
            disk_capacity: checked!(t.disk_capacity, "tiers.disk-capacity", |v: String| tmem_corpus::parse_size(&v)),
            front: checked!(f.kind, "front.kind", |v: String| v
                .parse::<tmem_front::FrontKind>()
                .map_err(|e| e.to_string())),
            front_limit: checked!(f.limit, "front.limit", |v: String| v
                .parse::<PoolLimit>()
                .map_err(|e| e.to_string())
                .and_then(|l| limits::pool_limit("", l, machine.total_ram).map_err(detail))),
            front_algorithm: checked!(f.algorithm, "front.algorithm", |v: String| match v.is_empty() || v.len() > 64 {
                true => Err("expected a compressor's name".to_owned()),
                false => Ok(v),
            }),
            front_idle_age: checked!(f.idle_age, "front.idle-age", crate::front::check_age),
            front_fill: checked!(f.fill, "front.fill", |n: u64| limits::range("", n, 0..=100, "a percentage")
                .map_err(detail)),
            front_rate: checked!(f.rate, "front.rate", |n: u64| limits::range("", n, 1..=10_000_000, "pages a second")
                .map_err(detail)),
            front_cgroups: checked!(f.cgroups, "front.cgroups", |v: Vec<PathBuf>| match v
                .iter()
                .all(|p| p.is_absolute())
            {
                true => Ok(v),
                false => Err("every cgroup must be an absolute path".to_owned()),
            }),
        })
    }
}

/// What kind of file `t` is, in words.
fn describe(t: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt as _;
    match () {
        () if t.is_file() => "a regular file",
        () if t.is_dir() => "a directory",
        () if t.is_fifo() => "a FIFO",
        () if t.is_socket() => "a socket",
        () if t.is_char_device() => "a character device",
        () if t.is_block_device() => "a block device",
        () => "a special file",
    }
}

/// 1-based line and column of byte `offset` in `text`.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, String> {
        Config::parse(text, Path::new("/etc/tmem/tmem.toml")).map_err(|e| e.to_string())
    }

    #[test]
    fn a_full_file_parses() {
        let c = parse(
            r#"
[swap]
devices = 2
size = "4G"
pool-limit = "30%"
codec = "zstd:3+dict"
priority = 50
fuse-threads = 8
fuse-uring = 1
discard = "pages"
transport = "nbd"
recycle-idle-swap = false
recompress = "zstd:3+dict"
recompress-after = 0.5
group = "zstd:9+dict"
group-after = 20
runtime-dir = "/run/tmem2"
wait = 90
metrics = "127.0.0.1:9848"

[tiers]
tier = ["disk=/var/lib/tmem"]
replicas = 2
key-file = "/etc/tmem/key"
cluster-id = "c"
host-id = "h"
disk-capacity = "16G"

[front]
kind = "zswap"
limit = "256M"
algorithm = "zstd"
idle-age = 5
fill = 20
rate = 1000
cgroups = ["/sys/fs/cgroup/jobs"]
"#,
        )
        .unwrap();
        assert_eq!(c.front, Some(tmem_front::FrontKind::Zswap));
        assert_eq!(c.front_limit, Some(PoolLimit::Bytes(256 << 20)));
        assert_eq!((c.front_algorithm.as_deref(), c.front_idle_age), (Some("zstd"), Some(5.0)));
        assert_eq!((c.front_fill, c.front_rate), (Some(20), Some(1000)));
        assert_eq!(c.front_cgroups, Some(vec![PathBuf::from("/sys/fs/cgroup/jobs")]));
        assert_eq!(c.devices, Some(2));
        assert_eq!(c.size, Some(4 << 30));
        assert_eq!(c.pool_limit, Some(PoolLimit::Percent(30)));
        assert_eq!(c.codec.as_deref(), Some("zstd:3+dict"));
        assert_eq!(c.discard, Some(tmem_sys::swap::SwapDiscard::Pages));
        assert_eq!(c.transport, Some(crate::transport::Transport::Nbd));
        assert_eq!(c.recycle_idle_swap, Some(false));
        assert_eq!((c.recompress.as_deref(), c.recompress_after), (Some("zstd:3+dict"), Some(0.5)));
        assert_eq!((c.group.as_deref(), c.group_after), (Some("zstd:9+dict"), Some(20.0)));
        assert_eq!(c.tiers, Some(vec![TierSpec::Disk("/var/lib/tmem".into())]));
        assert_eq!(c.disk_capacity, Some(16 << 30));
        assert_eq!(c.metrics, Some("127.0.0.1:9848".parse().unwrap()));
        assert_eq!(parse("").unwrap(), Config { path: c.path.clone(), ..Config::default() });
    }

    #[test]
    fn errors_name_the_file_line_and_key() {
        for (text, want) in [
            (
                "[swap]\nsize = \"8G\"\npool-limit = \"0%\"\n",
                "/etc/tmem/tmem.toml:3:14: swap.pool-limit: pool limit \"0%\"",
            ),
            ("[swap]\nsise = \"8G\"\n", "/etc/tmem/tmem.toml:2:1: unknown field `sise`"),
            ("[swap]\ncodec = \"gzip\"\n", "/etc/tmem/tmem.toml:2:9: swap.codec:"),
            ("[swap]\ndevices = 0\n", "/etc/tmem/tmem.toml:2:11: swap.devices: need at least one device"),
            ("[swap]\npriority = 99999\n", "swap.priority: 99999 is above the limit of 32767"),
            ("[swap]\nsize = 8\n", "/etc/tmem/tmem.toml:2:8: invalid type: integer `8`, expected a string"),
            ("[tiers]\ntier = [\"ssd=/x\"]\n", "/etc/tmem/tmem.toml:2:8: tiers.tier:"),
            ("[swap\n", "/etc/tmem/tmem.toml:1:"),
            ("[prometheus]\nlisten = \"x\"\n", "unknown field `prometheus`"),
            (
                "[swap]\nrecompress = \"raw\"\n",
                "/etc/tmem/tmem.toml:2:14: swap.recompress: recompression codec \"raw\"",
            ),
            (
                "[swap]\ngroup = \"lz4\"\n",
                "/etc/tmem/tmem.toml:2:9: swap.group: \"lz4\": groups are compressed with zstd: zstd, zstd:LEVEL, \
                 with +dict or not",
            ),
            (
                "[swap]\nrecompress-after = 0.0\n",
                "/etc/tmem/tmem.toml:2:20: swap.recompress-after: 0 seconds is outside 0.01..86400",
            ),
            (
                "[swap]\nmetrics = \"localhost\"\n",
                "/etc/tmem/tmem.toml:2:11: swap.metrics: \"localhost\" is not an IP address and port",
            ),
            ("[front]\nkind = \"zcache\"\n", "/etc/tmem/tmem.toml:2:8: front.kind: unknown front \"zcache\""),
            ("[front]\nidle-age = 0.5\n", "front.idle-age: 0.5 seconds is below the shortest idle age, 1 s"),
            ("[front]\nfill = 101\n", "front.fill: 101 is above the limit of 100"),
            ("[front]\nrate = 0\n", "front.rate: 0 is below the minimum of 1"),
            ("[front]\ncgroups = [\"jobs\"]\n", "front.cgroups: every cgroup must be an absolute path"),
        ] {
            let e = parse(text).unwrap_err();
            assert!(e.contains(want), "{text:?}: {e}");
            assert_eq!(e.lines().count(), 1, "one line: {e}");
        }
    }

    /// Finding: `devices = 9223372036854775807` panicked ("capacity overflow").
    #[test]
    fn counts_and_sizes_are_bounded_by_the_machine() {
        let m = Machine { total_ram: 1 << 30, cpus: 2 };
        let parse = |text: &str| Config::parse_on(text, Path::new("t.toml"), &m).map_err(|e| e.to_string());
        for (text, want) in [
            (
                "[swap]\ndevices = 9223372036854775807\n",
                "t.toml:2:11: swap.devices: 9223372036854775807 is above the limit of 32",
            ),
            ("[swap]\ndevices = 4294967296\n", "swap.devices: 4294967296 is above the limit of 32"),
            ("[swap]\nfuse-threads = 100000\n", "swap.fuse-threads: 100000 is above the limit of 64"),
            ("[swap]\nfuse-uring = 33\n", "swap.fuse-uring: 33 is above the limit of 32"),
            ("[swap]\nwait = 9223372036854775807\n", "swap.wait: 9223372036854775807 is above the limit of 86400"),
            ("[swap]\npool-limit = \"2G\"\n", "swap.pool-limit: 2.0 GiB is above the limit of 1.0 GiB"),
            ("[swap]\nsize = \"1T\"\n", "swap.size: 1.0 TiB in all is above the limit of 25.6 GiB"),
            ("[swap]\nsize = \"4K\"\n", "swap.size: 4096 is below the minimum of 1048576"),
            ("[tiers]\nreplicas = 100\n", "tiers.replicas: 100 is above the limit of 8"),
        ] {
            let e = parse(text).unwrap_err();
            assert!(e.contains(want), "{text:?}: {e}");
            assert_eq!(e.lines().count(), 1, "one line: {e}");
        }
        let c = parse("[swap]\ndevices = 32\nfuse-threads = 64\nsize = \"16G\"\npool-limit = \"1G\"\n").unwrap();
        assert_eq!((c.devices, c.fuse_threads), (Some(32), Some(64)));
    }

    /// Finding: `--config` on a FIFO blocked forever in `open()`.
    #[test]
    fn a_fifo_is_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo.toml");
        rustix::fs::mknodat(rustix::fs::CWD, &fifo, rustix::fs::FileType::Fifo, rustix::fs::Mode::from(0o600), 0)
            .unwrap();
        let t = std::time::Instant::now();
        let e = Config::load(&fifo).unwrap_err().to_string();
        assert!(e.contains("fifo.toml: a FIFO of 0 bytes: not a regular file"), "{e}");
        assert!(t.elapsed() < std::time::Duration::from_secs(1));
    }

    #[test]
    fn missing_and_oversized_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let e = Config::load(&dir.path().join("none.toml")).unwrap_err().to_string();
        assert!(e.contains("none.toml"), "{e}");
        assert!(Config::load(dir.path()).unwrap_err().to_string().contains("not a regular file"));
        let big = dir.path().join("big.toml");
        std::fs::File::create(&big).unwrap().set_len(MAX_CONFIG_BYTES + 1).unwrap();
        assert!(Config::load(&big).unwrap_err().to_string().contains("at most 1 MiB"));
    }
}

#[cfg(test)]
mod shipped {
    use super::*;

    /// The example configuration the Debian package installs parses.
    #[test]
    fn the_shipped_example_parses() {
        let text = include_str!("../../../packaging/tmem.toml");
        let c = Config::parse(text, Path::new("packaging/tmem.toml")).unwrap();
        assert_eq!(c.size, Some(8 << 30));
        assert_eq!(c.pool_limit, Some(PoolLimit::Percent(25)));
        assert_eq!(c.tiers, None);
        assert_eq!(c.front, Some(tmem_front::FrontKind::Auto));
        assert_eq!(c.front_limit, Some(PoolLimit::Percent(10)));
    }
}
