//! What `tmem bench capacity` reports: a record per (row, data set), the
//! table (a block per data set), the JSON file and the figure.

use anyhow::anyhow;
use std::path::Path;

use super::data::{DataKind, DataSet};
use super::{CapacityArgs, Row};
use crate::plot::{Bars, Figure};
use crate::pressure::report::{RunCpu, MIN_SWAPPED_PAGES};
use tmem_daemon::human;
use tmem_sys::vmstat::SwapCounters;

/// How a row's job ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Killed by its memory cgroup's OOM killer: the capacity was reached.
    Oom,
    /// Allocated the swap area and the budget over without being killed.
    HeldAll,
    /// Still running at `--timeout`.
    TimedOut,
    /// The machine's OOM killer ran too (outside the cgroup): the row is void.
    MachineOom,
    /// The job ended any other way (see its stderr).
    Failed,
}

impl Outcome {
    /// For notes and errors.
    #[must_use]
    pub fn describe(self) -> &'static str {
        match self {
            Self::Oom => "killed by its cgroup's OOM killer",
            Self::HeldAll => "held more than budget + swap area without being killed",
            Self::TimedOut => "still running at --timeout",
            Self::MachineOom => "the machine's OOM killer ran, not only the cgroup's",
            Self::Failed => "the job failed (see stderr_tail in the JSON)",
        }
    }
}

/// One row over one data set.
#[derive(Clone, Debug, serde::Serialize)]
pub struct RowRecord {
    /// Row name.
    pub row: &'static str,
    /// Data set.
    pub data: DataKind,
    /// How the job ended.
    pub outcome: Outcome,
    /// Bytes the job had allocated and filled when it ended: the capacity.
    pub allocated_bytes: u64,
    /// Seconds from start to the end (the OOM kill).
    pub wall_secs: f64,
    /// Highest pool memory seen (sampled every 100 ms, and zram's `mem_used_max`).
    pub pool_peak_bytes: u64,
    /// Uncompressed bytes in the pool at that sample.
    pub pool_stored_bytes_at_peak: u64,
    /// Pages in tiers below the pool at that sample (tmem+disk).
    pub tier_pages_at_peak: u64,
    /// Most swap in use in the row's swap area (/proc/swaps).
    pub swap_peak_bytes: u64,
    /// Swap writes the device refused (tmem rows).
    pub refused_writes: Option<u64>,
    /// OOM kills in the job's cgroup.
    pub cgroup_oom_kills: u64,
    /// OOM kills on the whole machine over the row (/proc/vmstat `oom_kill`).
    pub machine_oom_kills: u64,
    /// CPU steal over the row, %.
    pub cpu_steal_percent: f64,
    /// CPU spent; the machine's figure per swapped page is above what
    /// filling the same memory cost without swap (the `none` row's busy
    /// CPU per allocated page over the same data).
    #[serde(flatten)]
    pub cpu: RunCpu,
    /// /proc/vmstat deltas over the row.
    pub vmstat: SwapCounters,
    /// What bounded the capacity.
    pub limited_by: &'static str,
    /// The end of the job's stderr.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub stderr_tail: String,
}

impl RowRecord {
    /// Uncompressed bytes per byte of pool at the peak.
    #[must_use]
    pub fn ratio(&self) -> Option<f64> {
        (self.pool_peak_bytes > 0 && self.pool_stored_bytes_at_peak > 0)
            .then(|| self.pool_stored_bytes_at_peak as f64 / self.pool_peak_bytes as f64)
    }
}

/// What bounded a row's capacity: its pool (it was within 10 % of the
/// budget), its swap area (within 5 %), RAM alone (no swap), or unknown.
#[must_use]
pub fn limited_by(
    row: Row,
    outcome: Outcome,
    pool_peak: u64,
    budget: u64,
    swap_peak: u64,
    swap_size: u64,
) -> &'static str {
    if outcome != Outcome::Oom {
        return "-";
    }
    if row == Row::None {
        "RAM (no swap)"
    } else if swap_peak * 20 >= swap_size * 19 {
        "swap area full"
    } else if pool_peak * 10 >= budget * 9 {
        "pool full"
    } else {
        "neither (see the JSON)"
    }
}

/// Fills in each row's machine CPU per swapped page above the fill cost,
/// which the `none` row over the same data gives.
pub fn fill_machine_cpu(records: &mut [RowRecord]) {
    let fill_cost: Vec<(DataKind, f64)> = records
        .iter()
        .filter(|r| r.row == Row::None.name() && r.outcome == Outcome::Oom && r.allocated_bytes > 0)
        .filter_map(|r| Some((r.data, r.cpu.machine_busy_cpu_secs? / r.allocated_bytes as f64)))
        .collect();
    for r in records.iter_mut().filter(|r| r.row != Row::None.name()) {
        let per_byte = fill_cost.iter().find(|(d, _)| *d == r.data).map(|(_, c)| *c);
        let pages = (r.cpu.swapped_pages >= MIN_SWAPPED_PAGES).then_some(r.cpu.swapped_pages as f64);
        r.cpu.machine_cpu_us_per_swapped_page_above_reference = r
            .cpu
            .machine_busy_cpu_secs
            .zip(per_byte)
            .zip(pages)
            .map(|((busy, c), p)| (busy - c * r.allocated_bytes as f64) * 1e6 / p);
    }
}

/// The machine and the bench's settings, for the report and the JSON.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Machine {
    /// The machine.
    #[serde(flatten)]
    pub machine: crate::machine::Machine,
    /// The budget B.
    pub budget_bytes: u64,
    /// Every swap area's size.
    pub swap_size_bytes: u64,
    /// zswap's pool limit as set (v1: a whole percentage of RAM).
    pub zswap_pool_limit_bytes: u64,
    /// The zram device hot-added for the zram row (removed since).
    pub zram_device: Option<String>,
}

fn mib(b: u64) -> String {
    format!("{:.0}", b as f64 / f64::from(1 << 20))
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.digits$}"))
}

/// Prints a block per data set.
pub fn print(a: &CapacityArgs, m: &Machine, sets: &[DataSet], records: &[RowRecord]) {
    println!(
        "tmem bench capacity: {} CPUs, {} RAM, kernel {}, cgroup {}; budget {} for the job + {} for the pool; swap areas of {}",
        m.machine.cpus,
        human(m.machine.mem_total_bytes),
        m.machine.kernel,
        m.machine.cgroup_layout,
        human(m.budget_bytes),
        human(m.budget_bytes),
        human(m.swap_size_bytes)
    );
    println!(
        "zram {} (mem_limit {}), zswap {} (pool limit {}), tmem {}, tmem-max {}",
        a.zram_algorithm,
        human(m.budget_bytes),
        a.zswap_compressor,
        human(m.zswap_pool_limit_bytes),
        a.tmem_codec,
        a.tmem_max_codec
    );
    for set in sets {
        println!("\n{}: {} ({} files, {})", set.kind.name(), set.source, set.files, human(set.bytes));
        let rows: Vec<&RowRecord> = records.iter().filter(|r| r.data == set.kind).collect();
        let zram = rows.iter().copied().find(|r| r.row == Row::Zram.name() && r.outcome == Outcome::Oom);
        let mut t = crate::table::plain([
            "row",
            "MiB at OOM",
            "x zram",
            "pool ratio",
            "pool peak MiB",
            "time to OOM s",
            "swapped pages",
            "daemon us/page",
            "machine us/page",
            "steal %",
            "limited by",
        ]);
        for r in &rows {
            let vs_zram = zram
                .filter(|z| z.allocated_bytes > 0 && r.outcome == Outcome::Oom)
                .map(|z| r.allocated_bytes as f64 / z.allocated_bytes as f64);
            let held =
                if r.outcome == Outcome::Oom { mib(r.allocated_bytes) } else { format!("({})", r.outcome.describe()) };
            t.add_row([
                r.row.to_owned(),
                held,
                opt(vs_zram, 2),
                opt(r.ratio(), 2),
                mib(r.pool_peak_bytes),
                format!("{:.1}", r.wall_secs),
                r.cpu.swapped_pages.to_string(),
                opt(r.cpu.daemon_cpu_us_per_swapped_page, 1),
                opt(r.cpu.machine_cpu_us_per_swapped_page_above_reference, 1),
                format!("{:.1}", r.cpu_steal_percent),
                r.limited_by.to_owned(),
            ]);
        }
        println!("{t}");
    }
    println!(
        "\nmachine us/page: busy CPU of the whole machine per swapped page (pswpin+pswpout+zswpin+zswpout), \
         above what filling as much memory cost without swap (the none row); per-page figures need {MIN_SWAPPED_PAGES} swapped pages"
    );
}

/// A bar panel per data set: MiB held at OOM per row.
pub fn plot(path: &Path, m: &Machine, sets: &[DataSet], records: &[RowRecord]) -> anyhow::Result<()> {
    let panels: Vec<Figure> = sets
        .iter()
        .map(|s| {
            Figure::Bars(Bars {
                title: format!("{} data", s.kind.name()),
                y_label: "MiB allocated at OOM".into(),
                bars: records
                    .iter()
                    .filter(|r| r.data == s.kind && r.outcome == Outcome::Oom)
                    .map(|r| (r.row.to_owned(), r.allocated_bytes as f64 / f64::from(1 << 20)))
                    .collect(),
            })
        })
        .collect();
    let caption = format!(
        "tmem bench capacity: budget {} job + {} pool, {} CPUs, kernel {}",
        human(m.budget_bytes),
        human(m.budget_bytes),
        m.machine.cpus,
        m.machine.kernel
    );
    crate::plot::draw(path, &caption, &panels)
}

#[derive(serde::Serialize)]
struct JsonOut<'a> {
    tool: &'static str,
    args: &'a CapacityArgs,
    machine: &'a Machine,
    data: &'a [DataSet],
    rows: &'a [RowRecord],
    errors: &'a [String],
}

/// Writes the JSON file.
pub fn write_json(
    path: &Path,
    args: &CapacityArgs,
    machine: &Machine,
    data: &[DataSet],
    rows: &[RowRecord],
    errors: &[String],
) -> anyhow::Result<()> {
    let out = JsonOut { tool: "tmem bench capacity", args, machine, data, rows, errors };
    let text = serde_json::to_string_pretty(&out)?;
    std::fs::write(path, text + "\n").map_err(|e| anyhow!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(row: Row, data: DataKind, allocated: u64, busy: f64, swapped: u64) -> RowRecord {
        let vmstat = SwapCounters { pswpout: swapped, ..Default::default() };
        RowRecord {
            row: row.name(),
            data,
            outcome: Outcome::Oom,
            allocated_bytes: allocated,
            wall_secs: 1.0,
            pool_peak_bytes: 100,
            pool_stored_bytes_at_peak: 250,
            tier_pages_at_peak: 0,
            swap_peak_bytes: 0,
            refused_writes: None,
            cgroup_oom_kills: 1,
            machine_oom_kills: 1,
            cpu_steal_percent: 0.0,
            cpu: RunCpu::of(&vmstat, None, Some(busy), None),
            vmstat,
            limited_by: "pool full",
            stderr_tail: String::new(),
        }
    }

    #[test]
    fn machine_cpu_is_above_the_fill_cost_of_the_same_data() {
        let mut rs = vec![
            record(Row::None, DataKind::Text, 1 << 30, 1.0, 0),
            record(Row::Zram, DataKind::Text, 3 << 30, 5.0, 1_000_000),
            record(Row::Zram, DataKind::Mix, 3 << 30, 5.0, 1_000_000),
        ];
        fill_machine_cpu(&mut rs);
        // Filling 3 GiB costs 3 s without swap: 2 s over a million pages.
        let us = rs[1].cpu.machine_cpu_us_per_swapped_page_above_reference.unwrap();
        assert!((us - 2.0).abs() < 1e-9, "{us}");
        assert_eq!(rs[2].cpu.machine_cpu_us_per_swapped_page_above_reference, None, "no none row over mix");
        assert_eq!(rs[0].cpu.machine_cpu_us_per_swapped_page_above_reference, None);
        assert!((rs[1].ratio().unwrap() - 2.5).abs() < 1e-9);
    }

    #[test]
    fn what_bounded_a_row() {
        let (b, s) = (100, 1000);
        assert_eq!(limited_by(Row::None, Outcome::Oom, 0, b, 0, s), "RAM (no swap)");
        assert_eq!(limited_by(Row::Zswap, Outcome::Oom, 100, b, 960, s), "swap area full");
        assert_eq!(limited_by(Row::Tmem, Outcome::Oom, 95, b, 500, s), "pool full");
        assert_eq!(limited_by(Row::Tmem, Outcome::Oom, 50, b, 500, s), "neither (see the JSON)");
        assert_eq!(limited_by(Row::Tmem, Outcome::TimedOut, 100, b, 500, s), "-");
    }
}
