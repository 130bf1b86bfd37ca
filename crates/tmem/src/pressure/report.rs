//! Results of `tmem bench pressure`: raw runs, per-cell summaries, the table.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use tmem_sys::vmstat::SwapCounters;

use super::workload::JobResult;

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
    /// Most pages seen in tiers below the pool (tiered tmem rows).
    #[serde(default)]
    pub tier_peak_pages: u64,
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

/// Median (mean of the two middle values for an even count).
#[must_use]
pub fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 })
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
    /// Median pool ratio (stored / pool bytes at the peak).
    pub median_pool_ratio: Option<f64>,
    /// Median of the most uncompressed MiB held in lower tiers.
    pub median_tier_peak_mib: Option<f64>,
    /// Median pswpout (pages).
    pub median_pswpout: Option<f64>,
    /// Median pswpin (pages).
    pub median_pswpin: Option<f64>,
    /// Median zswpout (pages).
    pub median_zswpout: Option<f64>,
    /// Median zswpin (pages).
    pub median_zswpin: Option<f64>,
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
                median_pool_ratio: median(ratios),
                median_tier_peak_mib: med(&|r| r.tier_peak_pages as f64 * 4096.0 / MIB),
                median_pswpout: med(&|r| r.vmstat.pswpout as f64),
                median_pswpin: med(&|r| r.vmstat.pswpin as f64),
                median_zswpout: med(&|r| r.vmstat.zswpout as f64),
                median_zswpin: med(&|r| r.vmstat.zswpin as f64),
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
    let with_pool: Vec<(&str, Fmt<'_>)> = backends.iter().filter(|b| **b != "disk").map(|b| (*b, ratio)).collect();
    if !with_pool.is_empty() {
        block(&mut t, "pool ratio (stored / pool memory at the peak)", &with_pool);
    }
    let tiered: Vec<&str> = backends.iter().copied().filter(|b| b.starts_with("tmem+")).collect();
    if !tiered.is_empty() {
        let tier: Fmt<'_> = &|s| s.median_tier_peak_mib.map(|m| format!("{m:.0}"));
        block(&mut t, "pages in the lower tier at most, MiB uncompressed", &rows(&tiered, tier));
    }
    block(&mut t, "pswpout/pswpin, thousands of pages", &rows(backends, pswp));
    if backends.contains(&"zswap") {
        block(&mut t, "zswpout/zswpin (zswap stores/loads), thousands of pages", &[("zswap", zswp)]);
    }
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
            tier_peak_pages: 0,
            pool_samples: 10,
            cgroup_max_usage_bytes: 0,
            cgroup_failcnt: 0,
            oom_kills: 0,
            cpu_steal_percent: 0.0,
            setup_secs: 0.0,
            teardown_secs: 0.0,
            jobs: vec![],
            message: None,
            foreign_swap: vec![],
            backend_counters: None,
        }
    }

    #[test]
    fn medians() {
        assert_eq!(median(vec![]), None);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0]), Some(2.5));
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
    }
}
