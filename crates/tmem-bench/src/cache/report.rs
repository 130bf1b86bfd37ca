//! Results of `tmem bench cache`: one record per row, the figures derived
//! from them (against the plain-loop row of the same level), the table.

use tmem_sys::vmstat::ProcessCpu;

/// Rows that read fewer pages through the device than this get no
/// per-page CPU figure: a few ticks of CPU over a handful of pages is noise.
pub const MIN_PAGES_FOR_CPU_PER_PAGE: u64 = 10_000;
/// Backing bytes of the plain-loop row below which no ratio to it is given.
pub const MIN_PLAIN_BACKING_BYTES: u64 = 1 << 20;
/// Jobs shorter than this get no wall-time ratio (timer and start-up noise).
pub const MIN_WALL_SECS: f64 = 0.5;

/// Which row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RowKind {
    /// No memory limit, plain loop device: the upper bound (once).
    NoLimit,
    /// Plain loop device (direct I/O), limit L.
    Plain,
    /// Plain loop device, limit 2L: the RAM of a tmem row (job L + pool L).
    #[value(name = "plain-2x")]
    Plain2x,
    /// tmem cache, lz4, SIEVE.
    TmemLz4,
    /// tmem cache, zstd with a trained dictionary, SIEVE.
    TmemZstdDict,
    /// tmem cache, lz4, strict LRU (against SIEVE's hit ratio).
    TmemLz4Lru,
}

impl RowKind {
    /// Every row, in the order run.
    pub const ALL: [Self; 6] =
        [Self::NoLimit, Self::Plain, Self::Plain2x, Self::TmemLz4, Self::TmemZstdDict, Self::TmemLz4Lru];

    /// Title in the table.
    #[must_use]
    pub fn title(self) -> &'static str {
        match self {
            Self::NoLimit => "no limit",
            Self::Plain => "plain loop",
            Self::Plain2x => "plain loop, 2x RAM",
            Self::TmemLz4 => "tmem lz4",
            Self::TmemZstdDict => "tmem zstd+dict",
            Self::TmemLz4Lru => "tmem lz4 lru",
        }
    }

    /// `(codec, eviction)` of the tmem rows.
    #[must_use]
    pub fn tmem(self) -> Option<(&'static str, &'static str)> {
        match self {
            Self::TmemLz4 => Some(("lz4", "sieve")),
            Self::TmemZstdDict => Some(("zstd+dict", "sieve")),
            Self::TmemLz4Lru => Some(("lz4", "lru")),
            Self::NoLimit | Self::Plain | Self::Plain2x => None,
        }
    }
}

/// How a row ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Outcome {
    /// Every lookup found its row and the checksum matched the first row's.
    Ok,
    /// The checksum differs from the first row's: the device returned wrong data.
    Wrong,
    /// The job failed (exit code, signal, OOM kill).
    Fail,
    /// Killed after the timeout.
    Timeout,
}

/// The cache device's counters over a row (deltas of counters, gauges at the end).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct TmemFigures {
    /// `--codec`.
    pub codec: String,
    /// `--eviction`.
    pub eviction: String,
    /// `--pool-limit`, bytes.
    pub pool_limit_bytes: u64,
    /// Emulated latency per backing read the daemon reports, µs.
    pub backing_latency_us: u64,
    /// Pages found in the pool.
    pub hits: u64,
    /// Pages not in the pool (read from the backing store).
    pub misses: u64,
    /// Missed pages the pool did not take.
    pub fills_refused: u64,
    /// Pages evicted from the pool.
    pub evicted_pages: u64,
    /// Pool memory at the end (`mem_used_total`).
    pub pool_mem_bytes: u64,
    /// Uncompressed bytes held at the end (`orig_data_size`).
    pub pool_orig_bytes: u64,
    /// Pages held at the end.
    pub pool_stored_pages: u64,
    /// The store's own ratio at the end.
    pub store_ratio: f64,
    /// Writes to the backing store (0: the job only reads).
    pub backing_write_bytes: u64,
}

/// A cache device's counters at one instant (from its `DeviceStats`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TmemCounters {
    /// Read requests through the device.
    pub read_ios: u64,
    /// Bytes read through the device.
    pub read_bytes: u64,
    /// Pool hits (`succ_gets`).
    pub hits: u64,
    /// Pool misses (`failed_gets`).
    pub misses: u64,
    /// `evicted_pages`.
    pub evicted_pages: u64,
    /// `backing_reads`.
    pub backing_reads: u64,
    /// `backing_read_bytes`.
    pub backing_read_bytes: u64,
    /// `backing_write_bytes`.
    pub backing_write_bytes: u64,
    /// `fills_refused`.
    pub fills_refused: u64,
    /// The emulated latency the daemon uses.
    pub latency_us: u64,
    /// `mem_used_total`.
    pub mem_used_total: u64,
    /// `orig_data_size`.
    pub orig_data_size: u64,
    /// `stored_pages`.
    pub stored_pages: u64,
    /// The store's ratio.
    pub ratio: f64,
}

impl From<&tmem_block::DeviceStats> for TmemCounters {
    fn from(d: &tmem_block::DeviceStats) -> Self {
        let b = d.backing.clone().unwrap_or_default();
        let t = &d.store.total;
        Self {
            read_ios: d.read_ios,
            read_bytes: d.read_bytes,
            hits: t.succ_gets,
            misses: t.failed_gets,
            evicted_pages: t.evicted_pages,
            backing_reads: b.backing_reads,
            backing_read_bytes: b.backing_read_bytes,
            backing_write_bytes: b.backing_write_bytes,
            fills_refused: b.fills_refused,
            latency_us: b.latency_us,
            mem_used_total: d.store.mem_used_total,
            orig_data_size: t.orig_data_size,
            stored_pages: t.stored_pages,
            ratio: d.store.ratio,
        }
    }
}

/// The tmem device's figures over a row: counters as deltas since
/// `before`, gauges as they are at the end.
#[must_use]
pub fn tmem_figures(
    codec: &str,
    eviction: &str,
    pool_limit: u64,
    before: Option<&TmemCounters>,
    s: &TmemCounters,
) -> TmemFigures {
    let b = before.copied().unwrap_or_default();
    TmemFigures {
        codec: codec.into(),
        eviction: eviction.into(),
        pool_limit_bytes: pool_limit,
        backing_latency_us: s.latency_us,
        hits: s.hits.saturating_sub(b.hits),
        misses: s.misses.saturating_sub(b.misses),
        fills_refused: s.fills_refused.saturating_sub(b.fills_refused),
        evicted_pages: s.evicted_pages.saturating_sub(b.evicted_pages),
        pool_mem_bytes: s.mem_used_total,
        pool_orig_bytes: s.orig_data_size,
        pool_stored_pages: s.stored_pages,
        store_ratio: s.ratio,
        backing_write_bytes: s.backing_write_bytes.saturating_sub(b.backing_write_bytes),
    }
}

/// One row: the job on one device at one limit.
#[derive(Clone, Debug, serde::Serialize)]
pub struct RowRecord {
    /// Which row.
    pub kind: RowKind,
    /// Its title.
    pub title: String,
    /// Memory limit, % of the database size (None: no limit).
    pub level: Option<u32>,
    /// `memory.limit_in_bytes` of the job's cgroup.
    pub limit_bytes: Option<u64>,
    /// How it ended.
    pub outcome: Outcome,
    /// What went wrong.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The loop device the filesystem was mounted from.
    pub device: String,
    /// Wall time of the job (spawn to exit), seconds.
    pub wall_secs: f64,
    /// Lookups made.
    pub queries: u64,
    /// Seconds of the lookups inside Python (start-up excluded).
    pub query_secs: Option<f64>,
    /// The job's checksum.
    pub checksum: Option<u64>,
    /// Bytes read through the block device the filesystem is on (plain: the
    /// loop device's read sectors ×512; tmem: the device's `read_bytes`).
    pub device_read_bytes: u64,
    /// Bytes read from the loop device the filesystem is mounted from, as
    /// the kernel counts them (`/sys/block/loopN/stat` read sectors ×512).
    pub loop_read_bytes: u64,
    /// Bytes read from the backing store (plain: the same; tmem: `backing_read_bytes`).
    pub backing_read_bytes: u64,
    /// Reads from the backing store (plain: the loop device's reads completed; tmem: `backing_reads`).
    pub backing_reads: u64,
    /// The tmem device's figures (tmem rows).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tmem: Option<TmemFigures>,
    /// `memory.max_usage_in_bytes` of the job's cgroup.
    pub cgroup_max_usage_bytes: u64,
    /// OOM kills in the job's cgroup.
    pub oom_kills: u64,
    /// CPU time of the tmem daemon over the job.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub daemon_cpu: Option<ProcessCpu>,
    /// Busy CPU seconds of the whole machine over the job.
    pub machine_busy_cpu_secs: Option<f64>,
    /// Share of CPU time stolen by the hypervisor over the job.
    pub cpu_steal_percent: f64,
    /// Seconds to set the device up and mount it.
    pub setup_secs: f64,
    /// Seconds to unmount and tear it down.
    pub teardown_secs: f64,
    /// Derived figures.
    #[serde(flatten)]
    pub derived: Derived,
}

/// Figures derived from a row (and the plain-loop row of its level).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Derived {
    /// Lookups per second of wall time.
    pub queries_per_sec: Option<f64>,
    /// backing_read_bytes / the plain-loop row's.
    pub backing_bytes_vs_plain: Option<f64>,
    /// wall_secs / the plain-loop row's.
    pub wall_vs_plain: Option<f64>,
    /// hits / (hits + misses) (tmem rows).
    pub hit_ratio: Option<f64>,
    /// orig_data_size / mem_used_total: working set held per byte of pool RAM.
    pub pool_effective_ratio: Option<f64>,
    /// Pages read through the device (device_read_bytes / 4096).
    pub pages_read: u64,
    /// Daemon CPU (user + system) per page read through the device, µs.
    pub daemon_cpu_us_per_page: Option<f64>,
    /// Backing reads per second of wall time (to check a throttle).
    pub backing_reads_per_sec: Option<f64>,
}

impl RowRecord {
    /// Daemon CPU seconds (user + system).
    #[must_use]
    pub fn daemon_cpu_secs(&self) -> Option<f64> {
        self.daemon_cpu.map(|c| c.total_secs())
    }
}

/// Fills every row's derived figures.
pub fn derive(rows: &mut [RowRecord]) {
    let plain: Vec<(Option<u32>, u64, f64, bool)> = rows
        .iter()
        .filter(|r| r.kind == RowKind::Plain)
        .map(|r| (r.level, r.backing_read_bytes, r.wall_secs, r.outcome == Outcome::Ok))
        .collect();
    for r in rows.iter_mut() {
        let ok = r.outcome == Outcome::Ok;
        let mut d = Derived { pages_read: r.device_read_bytes / 4096, ..Derived::default() };
        if ok && r.wall_secs >= MIN_WALL_SECS {
            d.queries_per_sec = Some(r.queries as f64 / r.wall_secs);
            d.backing_reads_per_sec = Some(r.backing_reads as f64 / r.wall_secs);
        }
        if let Some(&(_, bytes, wall, plain_ok)) = plain.iter().find(|p| p.0 == r.level && r.level.is_some()) {
            if ok && plain_ok && bytes >= MIN_PLAIN_BACKING_BYTES {
                d.backing_bytes_vs_plain = Some(r.backing_read_bytes as f64 / bytes as f64);
            }
            if ok && plain_ok && wall >= MIN_WALL_SECS && r.wall_secs >= MIN_WALL_SECS {
                d.wall_vs_plain = Some(r.wall_secs / wall);
            }
        }
        if let Some(t) = &r.tmem {
            let lookups = t.hits + t.misses;
            d.hit_ratio = (lookups > 0).then(|| t.hits as f64 / lookups as f64);
            d.pool_effective_ratio = (t.pool_mem_bytes > 0).then(|| t.pool_orig_bytes as f64 / t.pool_mem_bytes as f64);
        }
        if d.pages_read >= MIN_PAGES_FOR_CPU_PER_PAGE {
            d.daemon_cpu_us_per_page = r.daemon_cpu_secs().map(|s| s * 1e6 / d.pages_read as f64);
        }
        r.derived = d;
    }
}

/// memory.limit_in_bytes for `level` % of `size`, page aligned.
#[must_use]
pub fn limit_for(level: u32, size: u64) -> u64 {
    u64::try_from(u128::from(size) * u128::from(level) / 100).unwrap_or(u64::MAX) & !4095
}

/// Level column.
#[must_use]
pub fn level_title(level: Option<u32>) -> String {
    level.map_or_else(|| "none".to_owned(), |l| format!("{l}%"))
}

fn mib(b: u64) -> String {
    format!("{:.1}", b as f64 / f64::from(1u32 << 20))
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.digits$}"))
}

/// The main table: a line per row.
#[must_use]
pub fn render_table(rows: &[RowRecord]) -> String {
    let mut t = crate::table::plain([
        "row",
        "limit",
        "wall s",
        "queries/s",
        "backing MiB",
        "x plain",
        "wall x plain",
        "hit %",
        "pool MiB",
        "pool ratio",
        "evicted",
    ]);
    for r in rows {
        let d = &r.derived;
        let wall = match r.outcome {
            Outcome::Ok => format!("{:.1}", r.wall_secs),
            o => format!("{o:?}").to_uppercase(),
        };
        let tm = r.tmem.as_ref();
        t.add_row([
            r.title.clone(),
            level_title(r.level),
            wall,
            opt(d.queries_per_sec, 0),
            mib(r.backing_read_bytes),
            opt(d.backing_bytes_vs_plain, 2),
            opt(d.wall_vs_plain, 2),
            opt(d.hit_ratio.map(|h| h * 100.0), 1),
            tm.map_or_else(|| "-".to_owned(), |t| mib(t.pool_mem_bytes)),
            opt(d.pool_effective_ratio, 2),
            tm.map_or_else(|| "-".to_owned(), |t| t.evicted_pages.to_string()),
        ]);
    }
    t.to_string() + "\n"
}

/// The CPU table: a line per row.
#[must_use]
pub fn render_cpu(rows: &[RowRecord]) -> String {
    let mut t = crate::table::plain([
        "row",
        "limit",
        "pages read",
        "daemon CPU s",
        "daemon us/page",
        "machine CPU s",
        "steal %",
        "backing reads/s",
    ]);
    for r in rows {
        let d = &r.derived;
        t.add_row([
            r.title.clone(),
            level_title(r.level),
            d.pages_read.to_string(),
            opt(r.daemon_cpu_secs(), 2),
            opt(d.daemon_cpu_us_per_page, 1),
            opt(r.machine_busy_cpu_secs, 1),
            format!("{:.1}", r.cpu_steal_percent),
            opt(d.backing_reads_per_sec, 0),
        ]);
    }
    t.to_string() + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn row(kind: RowKind, level: Option<u32>, wall: f64, backing: u64) -> RowRecord {
        RowRecord {
            kind,
            title: kind.title().into(),
            level,
            limit_bytes: None,
            outcome: Outcome::Ok,
            message: None,
            device: "/dev/loop0".into(),
            wall_secs: wall,
            queries: 1000,
            query_secs: None,
            checksum: Some(1),
            device_read_bytes: 80_000 * 4096,
            loop_read_bytes: 80_000 * 4096,
            backing_read_bytes: backing,
            backing_reads: 100,
            tmem: None,
            cgroup_max_usage_bytes: 0,
            oom_kills: 0,
            daemon_cpu: None,
            machine_busy_cpu_secs: None,
            cpu_steal_percent: 0.0,
            setup_secs: 0.0,
            teardown_secs: 0.0,
            derived: Derived::default(),
        }
    }

    #[test]
    fn figures_are_derived_against_the_plain_row_of_the_same_level() {
        let mut rows = vec![
            row(RowKind::NoLimit, None, 1.0, 10 << 20),
            row(RowKind::Plain, Some(50), 10.0, 100 << 20),
            row(RowKind::TmemLz4, Some(50), 4.0, 25 << 20),
            row(RowKind::Plain, Some(25), 20.0, 200 << 20),
            row(RowKind::TmemLz4, Some(25), 30.0, 100 << 20),
        ];
        rows[2].tmem = Some(TmemFigures {
            hits: 300,
            misses: 100,
            pool_mem_bytes: 1 << 20,
            pool_orig_bytes: 3 << 20,
            ..TmemFigures::default()
        });
        rows[2].daemon_cpu = Some(ProcessCpu { user_secs: 0.6, system_secs: 0.2 });
        derive(&mut rows);
        assert_eq!(rows[0].derived.backing_bytes_vs_plain, None, "no plain row without a limit");
        assert_eq!(rows[1].derived.backing_bytes_vs_plain, Some(1.0));
        assert_eq!(rows[2].derived.backing_bytes_vs_plain, Some(0.25));
        assert_eq!(rows[2].derived.wall_vs_plain, Some(0.4));
        assert_eq!(rows[2].derived.hit_ratio, Some(0.75));
        assert_eq!(rows[2].derived.pool_effective_ratio, Some(3.0));
        assert_eq!(rows[2].derived.queries_per_sec, Some(250.0));
        assert_eq!(rows[2].derived.pages_read, 80_000);
        assert!((rows[2].derived.daemon_cpu_us_per_page.unwrap() - 10.0).abs() < 1e-9);
        assert_eq!(rows[4].derived.backing_bytes_vs_plain, Some(0.5));
        assert_eq!(rows[4].derived.wall_vs_plain, Some(1.5));
        // Too little work: no per-page CPU, no ratios.
        rows[2].device_read_bytes = 100 * 4096;
        rows[1].backing_read_bytes = 1000;
        rows[1].wall_secs = 0.1;
        derive(&mut rows);
        assert_eq!(rows[2].derived.daemon_cpu_us_per_page, None);
        assert_eq!(rows[2].derived.backing_bytes_vs_plain, None);
        assert_eq!(rows[2].derived.wall_vs_plain, None);
        // A failed plain row gives no ratio either.
        rows[3].outcome = Outcome::Fail;
        derive(&mut rows);
        assert_eq!(rows[4].derived.backing_bytes_vs_plain, None);
        assert_eq!(rows[3].derived.queries_per_sec, None);
    }

    #[test]
    fn tmem_figures_are_deltas_of_counters_and_gauges_at_the_end() {
        let b = TmemCounters { hits: 10, misses: 5, evicted_pages: 3, mem_used_total: 100, ..Default::default() };
        let s = TmemCounters {
            hits: 110,
            misses: 25,
            evicted_pages: 4,
            mem_used_total: 1000,
            orig_data_size: 2000,
            latency_us: 500,
            ..Default::default()
        };
        let f = tmem_figures("lz4", "lru", 77, Some(&b), &s);
        assert_eq!((f.hits, f.misses, f.evicted_pages), (100, 20, 1));
        assert_eq!((f.pool_mem_bytes, f.pool_orig_bytes, f.backing_latency_us), (1000, 2000, 500));
        assert_eq!((f.codec.as_str(), f.eviction.as_str(), f.pool_limit_bytes), ("lz4", "lru", 77));
        assert_eq!(tmem_figures("lz4", "sieve", 1, None, &s).hits, 110);
    }

    #[test]
    fn limits_and_tables() {
        assert_eq!(limit_for(50, 1 << 30), 1 << 29);
        assert_eq!(limit_for(25, 1_000_000_000), 249_999_360);
        assert_eq!(level_title(None), "none");
        assert_eq!(level_title(Some(25)), "25%");
        let mut rows =
            vec![row(RowKind::Plain, Some(50), 10.0, 100 << 20), row(RowKind::TmemLz4, Some(50), 4.0, 25 << 20)];
        rows[1].outcome = Outcome::Timeout;
        derive(&mut rows);
        let t = render_table(&rows);
        assert!(t.contains("plain loop") && t.contains("TIMEOUT") && t.contains("100.0"), "{t}");
        let c = render_cpu(&rows);
        assert!(c.contains("daemon us/page") && c.contains("80000"), "{c}");
        assert_eq!(RowKind::TmemZstdDict.tmem(), Some(("zstd+dict", "sieve")));
        assert_eq!(RowKind::Plain2x.tmem(), None);
    }
}
