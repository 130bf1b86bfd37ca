//! What `tmem bench ramp` reports: a record per backend with one per step,
//! the tables (throughput, swap rate, CPU), the JSON file and the figure
//! (throughput against heap size, as the seed draws it).

use anyhow::anyhow;
use std::path::Path;
use std::process::ExitStatus;

use super::RampArgs;
use crate::plot::{Figure, Panel, Series};
use crate::pressure::front::Skipped;
use crate::pressure::report::{FrontRecord, RunCpu};
use tmem_daemon::human;
use tmem_sys::vmstat::SwapCounters;

/// How a row's job ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Every step ran and every order checked out.
    Ok,
    /// The job found orders that no longer match their sums.
    Corrupt,
    /// The cgroup's OOM killer ended it.
    Oom,
    /// Still running at `--timeout`.
    TimedOut,
    /// Ended any other way (see stderr).
    Failed,
}

/// The outcome from how the job ended and what it printed.
#[must_use]
pub fn outcome(
    status: Option<ExitStatus>,
    timed_out: bool,
    oom_kills: u64,
    verified: Option<u64>,
    corrupt: Option<u64>,
) -> Outcome {
    if corrupt.is_some() {
        Outcome::Corrupt
    } else if timed_out {
        Outcome::TimedOut
    } else if oom_kills > 0 {
        Outcome::Oom
    } else if status.is_some_and(|s| s.success()) && verified.is_some() {
        Outcome::Ok
    } else {
        Outcome::Failed
    }
}

/// The timed part of one step.
#[derive(Clone, Debug, serde::Serialize)]
pub struct StepRecord {
    /// Live heap the job grew to, MiB.
    pub live_mib: u64,
    /// That, in % of the memory limit.
    pub live_percent_of_limit: f64,
    /// Operations per second.
    pub ops_per_sec: f64,
    /// pswpin + pswpout + zswpin + zswpout per second.
    pub swapped_pages_per_sec: f64,
    /// Pages swapped in per second (pswpin + zswpin).
    pub pswpin_per_sec: f64,
    /// Pages swapped out per second (pswpout + zswpout).
    pub pswpout_per_sec: f64,
    /// Busy CPU of the whole machine, % of all CPUs.
    pub machine_busy_percent: Option<f64>,
    /// CPU steal, %.
    pub steal_percent: f64,
}

/// One backend's run.
#[derive(Clone, Debug, serde::Serialize)]
pub struct RowRecord {
    /// Backend name (`no limit` for the reference).
    pub backend: String,
    /// How it ended.
    pub outcome: Outcome,
    /// Its steps, in order.
    pub steps: Vec<StepRecord>,
    /// Orders the job checked at the end.
    pub verified_orders: Option<u64>,
    /// Orders that did not match (none, unless swap damaged data).
    pub corrupt_orders: Option<u64>,
    /// Seconds from start to end, growth included.
    pub wall_secs: f64,
    /// CPU over the whole run, and per swapped page.
    #[serde(flatten)]
    pub cpu: RunCpu,
    /// CPU steal over the run, %.
    pub cpu_steal_percent: f64,
    /// OOM kills in the job's cgroup.
    pub oom_kills: u64,
    /// /proc/vmstat deltas over the run.
    pub vmstat: SwapCounters,
    /// The end of the job's stderr.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub stderr_tail: String,
    /// The front's figures as the job ended (the front rows).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub front: Option<FrontRecord>,
}

impl RowRecord {
    fn at(&self, live_mib: u64) -> Option<&StepRecord> {
        self.steps.iter().find(|s| s.live_mib == live_mib)
    }
}

/// The machine and the settings.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Machine {
    /// The machine.
    #[serde(flatten)]
    pub machine: crate::machine::Machine,
    /// The job's memory limit.
    pub limit_bytes: u64,
    /// Every swap area's size.
    pub swap_size_bytes: u64,
    /// The disk profile.
    pub disk: String,
    /// The zram device hot-added for the zram row (removed since).
    pub zram_device: Option<String>,
}

fn cell(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.digits$}"))
}

/// Prints the tables and the targets.
pub fn print(a: &RampArgs, m: &Machine, reference: &RowRecord, rows: &[RowRecord], skipped: &[Skipped]) {
    println!(
        "tmem bench ramp: {} CPUs, {} RAM, kernel {}, cgroup {}; job limited to {}; swap areas of {}; disk: {}",
        m.machine.cpus,
        human(m.machine.mem_total_bytes),
        m.machine.kernel,
        m.machine.cgroup_layout,
        human(m.limit_bytes),
        human(m.swap_size_bytes),
        m.disk
    );
    println!(
        "zram {}, zswap {} (max_pool_percent {}), tmem --codec {} --pool-limit {}, tmem+disk --pool-limit {}; {} s per step",
        a.zram_algorithm,
        a.zswap_compressor,
        a.zswap_max_pool_percent,
        a.tmem_codec,
        a.tmem_pool_limit,
        a.tmem_tier_pool_limit,
        a.step_secs
    );
    let all: Vec<&RowRecord> = std::iter::once(reference).chain(rows).collect();
    let header: Vec<String> = std::iter::once("live heap, % of limit".to_owned())
        .chain(reference.steps.iter().map(|s| format!("{:.0}%", s.live_percent_of_limit)))
        .collect();
    for (title, f, digits) in [
        (
            "\nthousand operations per second",
            (|s: &StepRecord| Some(s.ops_per_sec / 1e3)) as fn(&StepRecord) -> Option<f64>,
            0,
        ),
        ("\nswapped pages per second, thousands (in + out)", |s: &StepRecord| Some(s.swapped_pages_per_sec / 1e3), 1),
        ("\nmachine busy CPU, % of all CPUs", |s: &StepRecord| s.machine_busy_percent, 0),
    ] {
        println!("{title}");
        let mut t = crate::table::plain(&header);
        for r in &all {
            let cells = reference.steps.iter().map(|s| cell(r.at(s.live_mib).and_then(f), digits));
            t.add_row(std::iter::once(r.backend.clone()).chain(cells).collect::<Vec<_>>());
        }
        println!("{t}");
    }
    println!("\nper run");
    let mut t = crate::table::plain(["backend", "outcome", "wall s", "swapped pages", "daemon us/page", "steal %"]);
    for r in &all {
        t.add_row([
            r.backend.clone(),
            format!("{:?}", r.outcome),
            format!("{:.1}", r.wall_secs),
            r.cpu.swapped_pages.to_string(),
            cell(r.cpu.daemon_cpu_us_per_swapped_page, 1),
            format!("{:.1}", r.cpu_steal_percent),
        ]);
    }
    println!("{t}");
    let find = |n: &str| rows.iter().find(|r| r.backend == n && r.outcome == Outcome::Ok);
    // Throughput of `a` over `b` at each step from the limit on.
    let ratios = |a: &RowRecord, b: &RowRecord| -> String {
        let cells: Vec<String> = reference
            .steps
            .iter()
            .filter(|s| s.live_percent_of_limit >= 100.0)
            .filter_map(|s| {
                let (x, y) = (a.at(s.live_mib)?, b.at(s.live_mib)?);
                Some(format!("{:.0}%: {:.2}", s.live_percent_of_limit, x.ops_per_sec / y.ops_per_sec))
            })
            .collect();
        cells.join(", ")
    };
    if let (Some(tmem), Some(zram)) = (find("tmem"), find("zram")) {
        println!("tmem / zram throughput, from the step where the heap passes the limit: {}", ratios(tmem, zram));
    }
    if let (Some(tmem), Some(disk)) = (find("tmem"), find("disk")) {
        println!("tmem / disk swap file throughput: {}", ratios(tmem, disk));
    }
    if let (Some(run), Some(zram)) = (find("tmem-run"), find("zram")) {
        println!("tmem-run / zram throughput: {}", ratios(run, zram));
    }
    if let Some(run) = find("tmem-run") {
        // Its own summary: resident peak, pool, faults (the last lines of its stderr).
        if let Some(line) = run.stderr_tail.lines().find(|l| l.starts_with("tmem run: ")) {
            println!("{line}");
        }
    }
    if rows.iter().any(|r| r.front.is_some()) {
        println!("front rows: {}", a.front.config(m.limit_bytes).describe());
    }
    for r in rows {
        if let Some(f) = &r.front {
            println!(
                "{}: front pool {} as the job ended, {} pages written back, {} read back, read-back latency {} us ({} reads of the device below)",
                r.backend,
                human(f.pool_bytes_at_peak),
                f.written_back_pages,
                f.read_back_pages,
                cell(f.read_back_mean_us, 0),
                f.backing_reads
            );
        }
    }
    for s in skipped {
        println!("{s}");
    }
}

/// Throughput against live heap, a line per backend.
pub fn plot(path: &Path, m: &Machine, reference: &RowRecord, rows: &[RowRecord]) -> anyhow::Result<()> {
    let series = std::iter::once(reference)
        .chain(rows)
        .map(|r| Series {
            name: r.backend.clone(),
            points: r.steps.iter().map(|s| (s.live_percent_of_limit, Some(s.ops_per_sec / 1e3))).collect(),
        })
        .collect();
    let panel = Panel {
        title: "throughput against live heap".into(),
        x_label: "live heap, % of the memory limit".into(),
        y_label: "thousand operations per second".into(),
        series,
    };
    let caption = format!(
        "tmem bench ramp: limit {}, {} CPUs, kernel {}",
        human(m.limit_bytes),
        m.machine.cpus,
        m.machine.kernel
    );
    crate::plot::draw(path, &caption, &[Figure::Lines(panel)])
}

#[derive(serde::Serialize)]
struct JsonOut<'a> {
    tool: &'static str,
    args: &'a RampArgs,
    machine: &'a Machine,
    reference: &'a RowRecord,
    rows: &'a [RowRecord],
    /// Rows not run, and why (zram without writeback).
    skipped: &'a [Skipped],
    errors: &'a [String],
}

/// Writes the JSON file.
pub fn write_json(
    path: &Path,
    args: &RampArgs,
    machine: &Machine,
    reference: &RowRecord,
    rows: &[RowRecord],
    skipped: &[Skipped],
    errors: &[String],
) -> anyhow::Result<()> {
    let out = JsonOut { tool: "tmem bench ramp", args, machine, reference, rows, skipped, errors };
    let text = serde_json::to_string_pretty(&out)?;
    std::fs::write(path, text + "\n").map_err(|e| anyhow!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn outcomes() {
        let ok = Some(ExitStatus::from_raw(0));
        let killed = Some(ExitStatus::from_raw(9));
        assert_eq!(outcome(ok, false, 0, Some(5), None), Outcome::Ok);
        assert_eq!(outcome(ok, false, 0, Some(5), Some(1)), Outcome::Corrupt, "corruption wins");
        assert_eq!(outcome(killed, false, 1, None, None), Outcome::Oom);
        assert_eq!(outcome(killed, true, 0, None, None), Outcome::TimedOut);
        assert_eq!(outcome(ok, false, 0, None, None), Outcome::Failed, "no verification line");
    }
}
