//! Results of `tmem bench pressure`: raw runs, per-cell summaries, the table.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use tmem_sys::vmstat::{ProcessCpu, RoleCpu, SwapCounters};

use super::workload::JobResult;
use crate::median;

/// How a run ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Outcome {
    /// Every job printed the reference checksum.
    Ok,
    /// The OOM killer killed a job.
    Oom,
    /// A job printed a checksum different from the reference run's.
    Wrong,
    /// A job failed otherwise (exit code, signal).
    Fail,
    /// The run took longer than the timeout and was killed.
    Timeout,
}

impl Outcome {
    /// Upper-case marker.
    pub fn marker(self) -> &'static str {
        match self {
            Self::Ok => "OK",
            Self::Oom => "OOM",
            Self::Wrong => "WRONG",
            Self::Fail => "FAIL",
            Self::Timeout => "TIMEOUT",
        }
    }
}

/// CPU a run cost: the backend's server, the machine, per swapped page.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct RunCpu {
    /// CPU time in user mode of the backend's user-space server over the
    /// run (tmem's daemon; for fuse-ram the bench process, which serves it),
    /// from `/proc/PID/stat`, seconds; `None` for backends the kernel serves
    /// alone (disk, zram, zswap) and for the reference run.
    pub daemon_cpu_user_secs: Option<f64>,
    /// The same, in the kernel on its behalf.
    pub daemon_cpu_system_secs: Option<f64>,
    /// Busy CPU time of the whole machine over the run, all CPUs
    /// (`/proc/stat`: total − idle − iowait − steal), seconds.
    pub machine_busy_cpu_secs: Option<f64>,
    /// Pages moved to and from swap over the run: pswpin + pswpout, plus
    /// zswpin + zswpout (pages zswap keeps never reach pswp*; 0 for the
    /// other backends, zswap being off for them).
    pub swapped_pages: u64,
    /// Daemon CPU (user + system) per swapped page, µs; `None` without a
    /// daemon or where fewer than [`MIN_SWAPPED_PAGES`] pages were swapped.
    pub daemon_cpu_us_per_swapped_page: Option<f64>,
    /// (Machine busy CPU of this run − of the reference run) per swapped
    /// page, µs: what swapping cost the machine, kernel work included, so
    /// it compares fairly with zram, whose work is in the kernel. `None`
    /// where fewer than [`MIN_SWAPPED_PAGES`] pages were swapped.
    pub machine_cpu_us_per_swapped_page_above_reference: Option<f64>,
}

impl RunCpu {
    /// The figures of a run that moved `vmstat`'s pages, where the daemon
    /// used `daemon`, the machine `machine_busy` and the same work without
    /// swapping `reference_busy` busy seconds.
    #[must_use]
    pub fn of(
        vmstat: &SwapCounters,
        daemon: Option<ProcessCpu>,
        machine_busy: Option<f64>,
        reference_busy: Option<f64>,
    ) -> Self {
        let swapped_pages = vmstat.pswpin + vmstat.pswpout + vmstat.zswpin + vmstat.zswpout;
        let pages = (swapped_pages >= MIN_SWAPPED_PAGES).then_some(swapped_pages as f64);
        Self {
            daemon_cpu_user_secs: daemon.map(|d| d.user_secs),
            daemon_cpu_system_secs: daemon.map(|d| d.system_secs),
            machine_busy_cpu_secs: machine_busy,
            swapped_pages,
            daemon_cpu_us_per_swapped_page: daemon.zip(pages).map(|(d, p)| d.total_secs() * 1e6 / p),
            machine_cpu_us_per_swapped_page_above_reference: machine_busy
                .zip(reference_busy)
                .zip(pages)
                .map(|((b, r), p)| (b - r) * 1e6 / p),
        }
    }
}

/// One run of the workload.
#[derive(Clone, Debug, serde::Serialize)]
pub struct RunRecord {
    /// Backend name (`none` for the reference run).
    pub backend: String,
    /// Pressure level, % of the measured peak (100: no limit).
    pub level: u32,
    /// memory.limit_in_bytes set (None: no limit).
    pub limit_bytes: Option<u64>,
    /// Run number, from 1.
    pub run: u32,
    /// How it ended.
    pub outcome: Outcome,
    /// Wall time of the workload (first job started to last job ended), seconds.
    pub wall_secs: f64,
    /// /proc/vmstat deltas over the run, pages.
    pub vmstat: SwapCounters,
    /// Highest pool memory seen (sampled, and the kernel's high-water mark where there is one).
    pub pool_peak_bytes: u64,
    /// Uncompressed bytes the pool held at that peak sample.
    pub pool_stored_bytes_at_peak: u64,
    /// Pool memory averaged over the run's time, each sample holding until
    /// the next (None: fewer than two samples).
    #[serde(default)]
    pub pool_mean_bytes: Option<u64>,
    /// Most pages seen in tiers below the pool (tiered tmem rows).
    #[serde(default)]
    pub tier_peak_pages: u64,
    /// Pool memory `--after-exit-secs` after the jobs exited (None: no pool, or the run timed out).
    #[serde(default)]
    pub pool_after_exit_bytes: Option<u64>,
    /// Swap in use in the backend's areas (/proc/swaps) at the same moment.
    #[serde(default)]
    pub swap_used_after_exit_bytes: Option<u64>,
    /// Swap writes the device refused during the run (tmem rows; None elsewhere).
    #[serde(default)]
    pub refused_writes: Option<u64>,
    /// Reads of the lower tiers' backing stores per page they returned
    /// (a merged read of neighbours counts once; None: none came back).
    #[serde(default)]
    pub tier_reads_per_page: Option<f64>,
    /// Writebacks to lower tiers that swap writes waited for (the daemon's
    /// `writeback_waits`; None: no daemon).
    #[serde(default)]
    pub writeback_waits: Option<u64>,
    /// The Redis node the run killed (tmem+remote-kill).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub killed_node: Option<super::KilledNode>,
    /// The front's figures (the front rows: zram+tmem, zram+disk, zswap+tmem).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub front: Option<FrontRecord>,
    /// Number of pool samples taken.
    pub pool_samples: u64,
    /// memory.max_usage_in_bytes of the run's cgroup.
    pub cgroup_max_usage_bytes: u64,
    /// memory.failcnt of the run's cgroup.
    pub cgroup_failcnt: u64,
    /// Tasks the OOM killer killed in the run's cgroup.
    pub oom_kills: u64,
    /// Share of all CPU time the hypervisor gave to other guests during the
    /// run (`/proc/stat` steal): a noisy host shows here, not in the code.
    #[serde(default)]
    pub cpu_steal_percent: f64,
    /// CPU spent over the run, and per swapped page.
    #[serde(flatten)]
    pub cpu: RunCpu,
    /// The daemon's CPU over the run by thread role (its FUSE workers, the
    /// front's policy thread, the store's background threads), of the
    /// threads alive as the jobs ended; the rest of `cpu`'s daemon time
    /// went to threads that exited.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub daemon_threads: Vec<RoleCpu>,
    /// Seconds to set the backend up (swapon ...).
    pub setup_secs: f64,
    /// Seconds to tear it down (swapoff ...).
    pub teardown_secs: f64,
    /// Every job.
    pub jobs: Vec<JobResult>,
    /// What went wrong, if anything.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Swap areas that were active and not ours (other activity on the machine).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub foreign_swap: Vec<String>,
    /// Backend counters over the run (zswap debugfs deltas).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend_counters: Option<BTreeMap<String, u64>>,
}

/// What a front row's front did in one run.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct FrontRecord {
    /// Of `pool_peak_bytes`, the front's pool at the peak sample (the rest
    /// is tmem's); in `bench ramp`, the front's pool as the job ended.
    pub pool_bytes_at_peak: u64,
    /// Pages the front wrote back to the device below it (zram `bd_stat`
    /// writes; zswap's `zswpwb`), as the jobs ended.
    pub written_back_pages: u64,
    /// Written-back pages read back from it (zram `bd_stat` reads; for
    /// zswap, every read of tmem's device).
    pub read_back_pages: u64,
    /// Mean time of a read request of the device below the front over the
    /// run, µs (`/sys/block/<dev>/stat`: read ticks / read I/Os, ms
    /// resolution summed over the requests): the read-back latency as the
    /// front waits for it. `None` without reads.
    pub read_back_mean_us: Option<f64>,
    /// Those read requests.
    pub backing_reads: u64,
    /// The front's own counters as the jobs ended (`tmem stat --json`'s
    /// `front`, or zram+disk's policy): idle age, backoffs, state.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stats: Option<serde_json::Value>,
}

/// Runs that swapped fewer pages than this get no per-page CPU figures: a
/// few seconds of CPU spread over a handful of pages is noise.
pub const MIN_SWAPPED_PAGES: u64 = 10_000;

impl RunRecord {
    /// Fills the CPU figures from the daemon's CPU time, the machine's busy
    /// seconds and the reference run's.
    pub fn set_cpu(&mut self, daemon: Option<ProcessCpu>, machine_busy: Option<f64>, reference_busy: Option<f64>) {
        self.cpu = RunCpu::of(&self.vmstat, daemon, machine_busy, reference_busy);
    }

    /// Daemon CPU seconds, user + system.
    #[must_use]
    pub fn daemon_cpu_secs(&self) -> Option<f64> {
        Some(self.cpu.daemon_cpu_user_secs? + self.cpu.daemon_cpu_system_secs?)
    }
}

/// One (backend, level) cell.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Summary {
    /// Backend.
    pub backend: String,
    /// Level.
    pub level: u32,
    /// Runs.
    pub runs: usize,
    /// Outcome of each run.
    pub outcomes: Vec<Outcome>,
    /// Median wall seconds of the correct runs.
    pub median_wall_secs: Option<f64>,
    /// Median peak pool MiB over all runs.
    pub median_pool_peak_mib: Option<f64>,
    /// Median of the pool memory averaged over each run's time, MiB.
    pub median_pool_mean_mib: Option<f64>,
    /// Median pool ratio (stored / pool bytes at the peak).
    pub median_pool_ratio: Option<f64>,
    /// Median memory of the whole stack, MiB: the jobs' cgroup peak, plus
    /// the pool's peak where the pool is outside that cgroup (all rows but
    /// tmem-run, whose helpers run in it).
    pub median_stack_mib: Option<f64>,
    /// Median of the most uncompressed MiB held in lower tiers.
    pub median_tier_peak_mib: Option<f64>,
    /// Median reads of the lower tiers' backing stores per page read back.
    pub median_tier_reads_per_page: Option<f64>,
    /// Median writebacks that swap writes waited for.
    pub median_writeback_waits: Option<f64>,
    /// Median pool MiB `--after-exit-secs` after the jobs exited.
    pub median_pool_after_exit_mib: Option<f64>,
    /// Median swap in use (MiB) at the same moment.
    pub median_swap_used_after_exit_mib: Option<f64>,
    /// Median swap writes refused.
    pub median_refused_writes: Option<f64>,
    /// Median pswpout (pages).
    pub median_pswpout: Option<f64>,
    /// Median pswpin (pages).
    pub median_pswpin: Option<f64>,
    /// Median zswpout (pages).
    pub median_zswpout: Option<f64>,
    /// Median zswpin (pages).
    pub median_zswpin: Option<f64>,
    /// Median daemon CPU seconds (user + system) of the correct runs.
    pub median_daemon_cpu_secs: Option<f64>,
    /// Median busy CPU seconds of the whole machine of the correct runs.
    pub median_machine_busy_cpu_secs: Option<f64>,
    /// Median daemon CPU µs per swapped page of the correct runs that have the figure.
    pub median_daemon_cpu_us_per_swapped_page: Option<f64>,
    /// Median machine CPU µs per swapped page above the reference run, of
    /// the correct runs that have the figure.
    pub median_machine_cpu_us_per_swapped_page_above_reference: Option<f64>,
    /// Median of the front's pool at the peak sample, MiB (front rows).
    pub median_front_pool_peak_mib: Option<f64>,
    /// Median pages the front wrote back (front rows).
    pub median_written_back: Option<f64>,
    /// Median pages it read back (front rows).
    pub median_read_back: Option<f64>,
    /// Median of the mean read-back time, µs (front rows with reads).
    pub median_read_back_us: Option<f64>,
}

const MIB: f64 = 1_048_576.0;

/// Summarises runs per (backend, level), in the given order.
#[must_use]
pub fn summarize(runs: &[RunRecord], backends: &[&str], levels: &[u32]) -> Vec<Summary> {
    let mut out = Vec::new();
    for &b in backends {
        for &l in levels {
            let rs: Vec<&RunRecord> = runs.iter().filter(|r| r.backend == b && r.level == l).collect();
            if rs.is_empty() {
                continue;
            }
            let med = |f: &dyn Fn(&RunRecord) -> f64| median(rs.iter().map(|r| f(r)).collect());
            // CPU figures: correct runs only (a run cut short did less work than the reference).
            let med_ok = |f: &dyn Fn(&RunRecord) -> Option<f64>| {
                median(rs.iter().filter(|r| r.outcome == Outcome::Ok).filter_map(|r| f(r)).collect())
            };
            let ok: Vec<f64> = rs.iter().filter(|r| r.outcome == Outcome::Ok).map(|r| r.wall_secs).collect();
            let ratios: Vec<f64> = rs
                .iter()
                // Only when the pool held something worth a ratio (not just a swap header).
                .filter(|r| r.pool_peak_bytes > 0 && r.pool_stored_bytes_at_peak >= 1 << 20)
                .map(|r| r.pool_stored_bytes_at_peak as f64 / r.pool_peak_bytes as f64)
                .collect();
            out.push(Summary {
                backend: b.to_owned(),
                level: l,
                runs: rs.len(),
                outcomes: rs.iter().map(|r| r.outcome).collect(),
                median_wall_secs: median(ok),
                median_pool_peak_mib: med(&|r| r.pool_peak_bytes as f64 / MIB),
                median_pool_mean_mib: median(
                    rs.iter().filter_map(|r| r.pool_mean_bytes).map(|b| b as f64 / MIB).collect(),
                ),
                median_stack_mib: med(&|r| {
                    let outside = if r.backend == "tmem-run" { 0 } else { r.pool_peak_bytes };
                    (r.cgroup_max_usage_bytes + outside) as f64 / MIB
                }),
                median_pool_ratio: median(ratios),
                median_tier_peak_mib: med(&|r| r.tier_peak_pages as f64 * 4096.0 / MIB),
                median_tier_reads_per_page: median(rs.iter().filter_map(|r| r.tier_reads_per_page).collect()),
                median_writeback_waits: median(rs.iter().filter_map(|r| r.writeback_waits).map(|n| n as f64).collect()),
                median_pool_after_exit_mib: median(
                    rs.iter().filter_map(|r| r.pool_after_exit_bytes).map(|b| b as f64 / MIB).collect(),
                ),
                median_swap_used_after_exit_mib: median(
                    rs.iter().filter_map(|r| r.swap_used_after_exit_bytes).map(|b| b as f64 / MIB).collect(),
                ),
                median_refused_writes: median(rs.iter().filter_map(|r| r.refused_writes).map(|n| n as f64).collect()),
                median_pswpout: med(&|r| r.vmstat.pswpout as f64),
                median_pswpin: med(&|r| r.vmstat.pswpin as f64),
                median_zswpout: med(&|r| r.vmstat.zswpout as f64),
                median_zswpin: med(&|r| r.vmstat.zswpin as f64),
                median_daemon_cpu_secs: med_ok(&RunRecord::daemon_cpu_secs),
                median_machine_busy_cpu_secs: med_ok(&|r| r.cpu.machine_busy_cpu_secs),
                median_daemon_cpu_us_per_swapped_page: med_ok(&|r| r.cpu.daemon_cpu_us_per_swapped_page),
                median_machine_cpu_us_per_swapped_page_above_reference: med_ok(&|r| {
                    r.cpu.machine_cpu_us_per_swapped_page_above_reference
                }),
                median_front_pool_peak_mib: median(
                    rs.iter().filter_map(|r| r.front.as_ref()).map(|f| f.pool_bytes_at_peak as f64 / MIB).collect(),
                ),
                median_written_back: median(
                    rs.iter().filter_map(|r| r.front.as_ref()).map(|f| f.written_back_pages as f64).collect(),
                ),
                median_read_back: median(
                    rs.iter().filter_map(|r| r.front.as_ref()).map(|f| f.read_back_pages as f64).collect(),
                ),
                median_read_back_us: median(rs.iter().filter_map(|r| r.front.as_ref()?.read_back_mean_us).collect()),
            });
        }
    }
    out
}

/// Column title of a level.
#[must_use]
pub fn level_title(level: u32) -> String {
    if level >= 100 {
        "none".to_owned()
    } else {
        format!("{level}%")
    }
}

/// The wall-time cell: the median of correct runs, with markers for the others.
#[must_use]
pub fn time_cell(s: &Summary) -> String {
    let mut bad: BTreeMap<Outcome, usize> = BTreeMap::new();
    for o in s.outcomes.iter().filter(|o| **o != Outcome::Ok) {
        *bad.entry(*o).or_default() += 1;
    }
    let marks: Vec<String> = bad
        .iter()
        .map(|(o, n)| if *n == s.runs { o.marker().to_owned() } else { format!("+{n}{}", o.marker()) })
        .collect();
    match s.median_wall_secs {
        Some(t) if marks.is_empty() => format!("{t:.1}"),
        Some(t) => format!("{t:.1} {}", marks.join(",")),
        None => marks.join(","),
    }
}

/// A CPU figure, or "n/a" where there is none.
fn or_na(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| "n/a".to_owned(), |v| format!("{v:.decimals$}"))
}

fn thousands(v: f64) -> String {
    let k = v / 1000.0;
    if k < 10.0 {
        format!("{k:.1}")
    } else {
        format!("{k:.0}")
    }
}

/// Renders the ladder: one block per metric, rows = backends, columns = levels.
#[must_use]
pub fn render_table(sums: &[Summary], backends: &[&str], levels: &[u32]) -> String {
    const W: usize = 14;
    let cell = |b: &str, l: u32| sums.iter().find(|s| s.backend == b && s.level == l);
    let mut t = String::new();
    let _ = write!(t, "{:<22}", "memory limit");
    for &l in levels {
        let _ = write!(t, "{:>W$}", level_title(l));
    }
    t.push('\n');
    type Fmt<'a> = &'a dyn Fn(&Summary) -> Option<String>;
    let block = |t: &mut String, title: &str, rows: &[(&str, Fmt<'_>)]| {
        let _ = writeln!(t, "{title}");
        for (b, f) in rows {
            let _ = write!(t, "  {b:<20}");
            for &l in levels {
                let v = cell(b, l).and_then(f).unwrap_or_else(|| "-".to_owned());
                let _ = write!(t, "{v:>W$}");
            }
            t.push('\n');
        }
    };
    let time: Fmt<'_> = &|s| Some(time_cell(s));
    let pool: Fmt<'_> = &|s| s.median_pool_peak_mib.map(|m| format!("{m:.0}"));
    let ratio: Fmt<'_> = &|s| s.median_pool_ratio.map(|m| format!("{m:.2}"));
    let pswp: Fmt<'_> = &|s| Some(format!("{}/{}", thousands(s.median_pswpout?), thousands(s.median_pswpin?)));
    let zswp: Fmt<'_> = &|s| Some(format!("{}/{}", thousands(s.median_zswpout?), thousands(s.median_zswpin?)));
    fn rows<'a>(backends: &[&'a str], f: Fmt<'a>) -> Vec<(&'a str, Fmt<'a>)> {
        backends.iter().map(|b| (*b, f)).collect()
    }
    block(&mut t, "wall time, s (median of correct runs)", &rows(backends, time));
    block(&mut t, "peak pool memory, MiB", &rows(backends, pool));
    let mean: Fmt<'_> = &|s| s.median_pool_mean_mib.map(|m| format!("{m:.0}"));
    block(&mut t, "pool memory averaged over the run, MiB", &rows(backends, mean));
    // zswap's pool is charged to the cgroup on v2 and not on v1: no exact figure for it here.
    let stacked: Vec<&str> = backends.iter().copied().filter(|b| !b.starts_with("zswap")).collect();
    let stack: Fmt<'_> = &|s| s.median_stack_mib.map(|m| format!("{m:.0}"));
    block(
        &mut t,
        "memory of the whole stack, MiB (the jobs' cgroup peak + the pool outside it)",
        &rows(&stacked, stack),
    );
    let with_pool: Vec<(&str, Fmt<'_>)> = backends.iter().filter(|b| **b != "disk").map(|b| (*b, ratio)).collect();
    if !with_pool.is_empty() {
        block(&mut t, "pool ratio (stored / pool memory at the peak)", &with_pool);
    }
    let tiered: Vec<&str> = backends.iter().copied().filter(|b| matches!(*b, "tmem+remote" | "tmem+disk")).collect();
    if !tiered.is_empty() {
        let tier: Fmt<'_> = &|s| s.median_tier_peak_mib.map(|m| format!("{m:.0}"));
        block(&mut t, "pages in the lower tier at most, MiB uncompressed", &rows(&tiered, tier));
        let reads: Fmt<'_> = &|s| s.median_tier_reads_per_page.map(|m| format!("{m:.2}"));
        block(&mut t, "lower tier: reads of its disk or server per page read back", &rows(&tiered, reads));
        let waits: Fmt<'_> = &|s| s.median_writeback_waits.map(|n| format!("{n:.0}"));
        block(&mut t, "lower tier: writebacks a swap write waited for", &rows(&tiered, waits));
    }
    let after: Fmt<'_> =
        &|s| Some(format!("{:.0}/{:.1}", s.median_pool_after_exit_mib?, s.median_swap_used_after_exit_mib?));
    let pooled: Vec<&str> = backends.iter().copied().filter(|b| !matches!(*b, "disk" | "zswap")).collect();
    if !pooled.is_empty() {
        block(&mut t, "after the jobs exit (--after-exit-secs): pool / swap still in use, MiB", &rows(&pooled, after));
    }
    let fronts: Vec<&str> = backends.iter().copied().filter(|b| super::backend::FRONT_ROWS.contains(b)).collect();
    if !fronts.is_empty() {
        let share: Fmt<'_> = &|s| s.median_front_pool_peak_mib.map(|m| format!("{m:.0}"));
        block(&mut t, "front rows: the front's share of the peak pool memory, MiB", &rows(&fronts, share));
        let wb: Fmt<'_> =
            &|s| Some(format!("{}/{}", thousands(s.median_written_back?), thousands(s.median_read_back?)));
        block(&mut t, "front rows: pages written back/read back, thousands", &rows(&fronts, wb));
        let lat: Fmt<'_> = &|s| Some(or_na(s.median_read_back_us, 0));
        block(
            &mut t,
            "front rows: read-back latency, us (mean read of the device below the front)",
            &rows(&fronts, lat),
        );
    }
    let daemon_rows: Vec<&str> = backends
        .iter()
        .copied()
        .filter(|b| (b.starts_with("tmem") || b.ends_with("+tmem")) && *b != "tmem-run")
        .collect();
    if !daemon_rows.is_empty() {
        let refused: Fmt<'_> = &|s| s.median_refused_writes.map(|n| format!("{n:.0}"));
        block(&mut t, "swap writes refused (pool full)", &rows(&daemon_rows, refused));
    }
    block(&mut t, "pswpout/pswpin, thousands of pages", &rows(backends, pswp));
    let zswapping: Vec<&str> = backends.iter().copied().filter(|b| b.starts_with("zswap")).collect();
    if !zswapping.is_empty() {
        block(&mut t, "zswpout/zswpin (zswap stores/loads), thousands of pages", &rows(&zswapping, zswp));
    }
    let daemon: Fmt<'_> = &|s| Some(or_na(s.median_daemon_cpu_secs, 1));
    let busy: Fmt<'_> = &|s| Some(or_na(s.median_machine_busy_cpu_secs, 1));
    let daemon_pp: Fmt<'_> = &|s| Some(or_na(s.median_daemon_cpu_us_per_swapped_page, 1));
    let machine_pp: Fmt<'_> = &|s| Some(or_na(s.median_machine_cpu_us_per_swapped_page_above_reference, 1));
    block(&mut t, "daemon CPU, s (user + system; median of correct runs)", &rows(backends, daemon));
    block(&mut t, "machine busy CPU, s (all CPUs; median of correct runs)", &rows(backends, busy));
    block(&mut t, "daemon CPU per swapped page, us", &rows(backends, daemon_pp));
    block(&mut t, "machine CPU per swapped page above the reference run, us", &rows(backends, machine_pp));
    t
}

/// The legend of the CPU figures (of both tables).
#[must_use]
pub fn cpu_legend(reference: &RunRecord) -> String {
    format!(
        "swapped: pswpin + pswpout (+ zswpin + zswpout) pages over the run.\n\
         daemon: CPU time of the backend's user-space server, /proc/PID/stat (tmem's daemon; for fuse-ram the bench \
         process, which serves its FUSE); n/a for the backends the kernel serves alone (disk, zram, zswap).\n\
         busy: busy CPU time of the whole machine, all CPUs (/proc/stat: total - idle - iowait - steal; steal is its \
         own column); the reference run (no limit, no swap) used {} s.\n\
         us/page: daemon = daemon CPU (user + system) per swapped page; machine = (busy - the reference run's busy) \
         per swapped page: all that swapping cost, the kernel's work (reclaim, zram's compression) included, so it \
         compares across backends. n/a where a run swapped fewer than {} pages.\n",
        or_na(reference.cpu.machine_busy_cpu_secs, 1),
        MIN_SWAPPED_PAGES
    )
}

/// Where a run's daemon CPU went, by thread role, the busiest first:
/// `daemon threads: tmem-fuse-* (4) 3.10 s (2.51 sys), tmem-front 1.05 s
/// (0.90 sys), exited 0.02 s`; `None` without a daemon.
fn threads_line(r: &RunRecord) -> Option<String> {
    let total = r.daemon_cpu_secs()?;
    if r.daemon_threads.is_empty() {
        return None;
    }
    let mut line = String::from("daemon threads:");
    for (i, role) in r.daemon_threads.iter().enumerate() {
        let count = if role.threads > 1 { format!(" ({})", role.threads) } else { String::new() };
        let _ = write!(
            line,
            "{} {}{count} {:.2} s ({:.2} sys)",
            if i == 0 { "" } else { "," },
            role.role,
            role.cpu.total_secs(),
            role.cpu.system_secs
        );
    }
    let alive: f64 = r.daemon_threads.iter().map(|role| role.cpu.total_secs()).sum();
    // Clock ticks: a difference below one tick (10 ms) is rounding.
    if total - alive >= 0.01 {
        let _ = write!(line, ", exited {:.2} s", total - alive);
    }
    Some(line)
}

/// One line per run (the reference run first) with its CPU figures, and the legend.
#[must_use]
pub fn render_cpu_runs(reference: &RunRecord, runs: &[RunRecord]) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "{:<22} {:>6} {:>3} {:>7} {:>8} {:>13} {:>12} {:>7} {:>14} {:>15} {:>6}",
        "CPU per run",
        "limit",
        "run",
        "outcome",
        "swapped",
        "daemon user s",
        "daemon sys s",
        "busy s",
        "daemon us/page",
        "machine us/page",
        "steal"
    );
    for r in std::iter::once(reference).chain(runs) {
        let name = if r.backend == "none" { "reference (no swap)" } else { r.backend.as_str() };
        let _ = writeln!(
            t,
            "  {:<20} {:>6} {:>3} {:>7} {:>8} {:>13} {:>12} {:>7} {:>14} {:>15} {:>5.1}%",
            name,
            level_title(r.level),
            r.run,
            r.outcome.marker(),
            r.cpu.swapped_pages,
            or_na(r.cpu.daemon_cpu_user_secs, 2),
            or_na(r.cpu.daemon_cpu_system_secs, 2),
            or_na(r.cpu.machine_busy_cpu_secs, 1),
            or_na(r.cpu.daemon_cpu_us_per_swapped_page, 1),
            or_na(r.cpu.machine_cpu_us_per_swapped_page_above_reference, 1),
            r.cpu_steal_percent
        );
        if let Some(line) = threads_line(r) {
            let _ = writeln!(t, "    {line}");
        }
    }
    t.push_str(&cpu_legend(reference));
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(backend: &str, level: u32, outcome: Outcome, wall: f64, pool: u64) -> RunRecord {
        RunRecord {
            backend: backend.into(),
            level,
            limit_bytes: None,
            run: 1,
            outcome,
            wall_secs: wall,
            vmstat: SwapCounters { pswpout: 12_345, pswpin: 678, ..Default::default() },
            pool_peak_bytes: pool,
            pool_stored_bytes_at_peak: pool * 3,
            pool_mean_bytes: Some(pool / 2),
            tier_peak_pages: 0,
            pool_after_exit_bytes: None,
            swap_used_after_exit_bytes: None,
            refused_writes: None,
            tier_reads_per_page: None,
            writeback_waits: None,
            killed_node: None,
            front: None,
            pool_samples: 10,
            cgroup_max_usage_bytes: 0,
            cgroup_failcnt: 0,
            oom_kills: 0,
            cpu_steal_percent: 0.0,
            cpu: RunCpu::default(),
            daemon_threads: vec![],
            setup_secs: 0.0,
            teardown_secs: 0.0,
            jobs: vec![],
            message: None,
            foreign_swap: vec![],
            backend_counters: None,
        }
    }

    #[test]
    fn summary_and_table_show_markers() {
        let runs = vec![
            rec("zram", 100, Outcome::Ok, 10.0, 0),
            rec("zram", 100, Outcome::Ok, 12.0, 0),
            rec("zram", 25, Outcome::Ok, 20.0, 100 << 20),
            rec("zram", 25, Outcome::Oom, 5.0, 300 << 20),
            rec("disk", 25, Outcome::Oom, 5.0, 0),
            rec("disk", 25, Outcome::Oom, 6.0, 0),
            rec("tmem", 25, Outcome::Wrong, 6.0, 1 << 20),
        ];
        let s = summarize(&runs, &["disk", "zram", "tmem"], &[100, 25]);
        assert_eq!(s.len(), 4);
        let z25 = s.iter().find(|x| x.backend == "zram" && x.level == 25).unwrap();
        assert_eq!(z25.median_wall_secs, Some(20.0));
        assert_eq!(z25.median_pool_peak_mib, Some(200.0));
        assert_eq!(z25.median_pool_ratio, Some(3.0));
        assert_eq!(time_cell(z25), "20.0 +1OOM");
        assert_eq!(time_cell(&s[0]), "OOM");
        let t = render_table(&s, &["disk", "zram", "tmem"], &[100, 25]);
        assert!(t.contains("none") && t.contains("25%"), "{t}");
        assert!(t.contains("11.0"), "{t}");
        assert!(t.contains("WRONG"), "{t}");
        assert!(t.contains("12/0.7"), "{t}");
        assert!(!t.contains("zswpout"), "{t}");
        assert!(t.contains("daemon CPU per swapped page, us"), "{t}");
    }

    #[test]
    fn front_rows_show_their_share_writebacks_and_read_back_latency() {
        let mut runs = vec![rec("zram", 50, Outcome::Ok, 10.0, 100 << 20)];
        for (name, lat) in [("zram+tmem", Some(180.0)), ("zram+disk", Some(950.0)), ("zswap+tmem", None)] {
            let mut r = rec(name, 50, Outcome::Ok, 12.0, 80 << 20);
            r.front = Some(FrontRecord {
                pool_bytes_at_peak: 30 << 20,
                written_back_pages: 25_000,
                read_back_pages: 1_500,
                read_back_mean_us: lat,
                backing_reads: lat.map_or(0, |_| 1_400),
                stats: None,
            });
            runs.push(r);
        }
        let names = ["zram", "zram+tmem", "zram+disk", "zswap+tmem"];
        let s = summarize(&runs, &names, &[50]);
        assert_eq!(s[0].median_written_back, None, "zram has no front");
        assert_eq!(s[1].median_front_pool_peak_mib, Some(30.0));
        assert_eq!((s[2].median_written_back, s[2].median_read_back), (Some(25_000.0), Some(1_500.0)));
        assert_eq!(s[2].median_read_back_us, Some(950.0));
        assert_eq!(s[3].median_read_back_us, None);
        let t = render_table(&s, &names, &[50]);
        let block = |title: &str| {
            let i = t.find(title).unwrap_or_else(|| panic!("no {title:?} in\n{t}"));
            t[i..].lines().skip(1).take_while(|l| l.starts_with("  ")).map(str::to_owned).collect::<Vec<_>>()
        };
        let wb = block("front rows: pages written back/read back, thousands");
        assert_eq!(wb.len(), 3, "only the front rows: {t}");
        assert!(wb[0].contains("zram+tmem") && wb[0].contains("25/1.5"), "{t}");
        let lat = block("front rows: read-back latency");
        assert!(lat[0].contains("180") && lat[1].contains("950") && lat[2].contains("n/a"), "{t}");
        assert!(block("front rows: the front's share")[0].contains("30"), "{t}");
        let refused = block("swap writes refused");
        assert!(refused.iter().any(|l| l.contains("zram+tmem")) && refused.iter().any(|l| l.contains("zswap+tmem")));
        assert!(!refused.iter().any(|l| l.contains("zram+disk")), "{t}");
        assert!(block("zswpout/zswpin")[0].contains("zswap+tmem"), "{t}");
    }

    #[test]
    fn cpu_figures_per_swapped_page() {
        let mut r = rec("tmem", 50, Outcome::Ok, 10.0, 1 << 20);
        r.vmstat = SwapCounters { pswpout: 30_000, pswpin: 10_000, ..Default::default() };
        r.set_cpu(Some(ProcessCpu { user_secs: 0.3, system_secs: 0.1 }), Some(12.0), Some(10.0));
        assert_eq!(r.cpu.swapped_pages, 40_000);
        assert_eq!(r.daemon_cpu_secs(), Some(0.4));
        assert!((r.cpu.daemon_cpu_us_per_swapped_page.unwrap() - 10.0).abs() < 1e-9);
        assert!((r.cpu.machine_cpu_us_per_swapped_page_above_reference.unwrap() - 50.0).abs() < 1e-9);
        // Too few pages: no per-page figures, but the seconds stay.
        let mut few = rec("zram", 50, Outcome::Ok, 10.0, 1 << 20);
        few.vmstat = SwapCounters { pswpout: 9_000, pswpin: 999, ..Default::default() };
        few.set_cpu(None, Some(12.0), Some(10.0));
        assert_eq!(few.cpu.swapped_pages, 9_999);
        assert_eq!(few.cpu.daemon_cpu_us_per_swapped_page, None);
        assert_eq!(few.cpu.machine_cpu_us_per_swapped_page_above_reference, None);
        assert_eq!(few.cpu.machine_busy_cpu_secs, Some(12.0));
        // zswap's own stores count.
        let mut z = rec("zswap", 50, Outcome::Ok, 10.0, 1 << 20);
        z.vmstat = SwapCounters { zswpout: 20_000, zswpin: 5_000, pswpout: 1_000, ..Default::default() };
        z.set_cpu(None, Some(11.0), Some(10.0));
        assert_eq!(z.cpu.swapped_pages, 26_000);
        assert!(z.cpu.machine_cpu_us_per_swapped_page_above_reference.is_some());

        // Where the daemon's time went, by thread role.
        let role = |role: &str, threads, user_secs, system_secs| RoleCpu {
            role: role.into(),
            threads,
            cpu: ProcessCpu { user_secs, system_secs },
        };
        assert_eq!(threads_line(&r), None, "no thread figures, no line");
        r.daemon_threads = vec![role("tmem-fuse-*", 4, 0.1, 0.2), role("tmem-front", 1, 0.0, 0.05)];
        assert_eq!(
            threads_line(&r).unwrap(),
            "daemon threads: tmem-fuse-* (4) 0.30 s (0.20 sys), tmem-front 0.05 s (0.05 sys), exited 0.05 s"
        );
        assert!(render_cpu_runs(&few, &[r.clone()]).contains("\n    daemon threads: tmem-fuse-* (4)"));
        assert_eq!(threads_line(&few), None, "no daemon, no line");

        let s = summarize(&[r.clone(), few.clone()], &["tmem", "zram"], &[50]);
        assert_eq!(s[0].median_daemon_cpu_us_per_swapped_page, r.cpu.daemon_cpu_us_per_swapped_page);
        assert_eq!(s[1].median_daemon_cpu_us_per_swapped_page, None);
        assert_eq!(s[1].median_machine_busy_cpu_secs, Some(12.0));
        let t = render_table(&s, &["tmem", "zram"], &[50]);
        let line = |title: &str| {
            let i = t.find(title).unwrap();
            t[i..].lines().skip(1).take(2).map(str::to_owned).collect::<Vec<_>>()
        };
        let pp = line("daemon CPU per swapped page, us");
        assert!(pp[0].contains("10.0") && pp[1].contains("n/a"), "{t}");
        let mp = line("machine CPU per swapped page above the reference run, us");
        assert!(mp[0].contains("50.0") && mp[1].contains("n/a"), "{t}");
        let mut reference = rec("none", 100, Outcome::Ok, 9.0, 0);
        reference.set_cpu(None, Some(10.0), Some(10.0));
        let runs = render_cpu_runs(&reference, &[r, few]);
        assert!(runs.contains("reference (no swap)") && runs.contains("n/a"), "{runs}");
        assert!(runs.contains("fewer than 10000 pages") && runs.contains("used 10.0 s"), "{runs}");
        assert!(!runs.contains("n/as"), "{runs}");
    }
}
