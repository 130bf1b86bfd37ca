//! `tmem bench capacity`: how much a process can allocate before the OOM
//! killer ends it (ccache's capacity test, seed 004, pages 12-13).
//!
//! A job (`crates/tmem-bench/workload/fill.py`) allocates memory 1 MiB at a
//! time and fills it with a data set (text, already-compressed files, real
//! heaps; see [`data`]), keeping everything, until its memory cgroup's OOM
//! killer ends it. Every row gets the same RAM budget B: the job's cgroup
//! is limited to B, and the compressed pool may use B more (zram
//! `mem_limit`, zswap's pool limit, tmem `--pool-limit`). The row with no
//! swap has only the cgroup's B. What the job held when it was killed is
//! the row's capacity; with it the pool's ratio at its peak, the time to
//! OOM and the CPU per swapped page.
//!
//! zswap's limit is `max_pool_percent` of RAM on cgroup v1 (the whole
//! percentage closest to B, at least 1: the report says what it was), and
//! `memory.zswap.max` = B on v2. zswap and tmem+disk spill to disk when
//! their pool is full, so they are bounded by the swap area instead; every
//! swap area has the same size, `--swap-budgets` times B.
//!
//! The job must be killed by its cgroup's OOM killer, never the machine's
//! (the global `oom_kill` count must not rise more than the cgroup's), and
//! every row leaves the machine as it found it: the cgroup, swap area, zram
//! device, zswap setting and daemon are undone after each, also on error,
//! panic or Ctrl-C (the pressure bench's backends, which undo themselves).

mod data;
mod report;

use anyhow::anyhow;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::pressure::backend::{Backend, BackendConfig, BackendKind, PoolSample};
use crate::pressure::report::RunCpu;
use crate::pressure::{cmd, install_signal_handlers, interrupted, zswap_off};
use crate::progress::Progress;
use crate::zram;
use tmem_sys::cgroup::{Layout, MemCgroup, Version};
use tmem_sys::vmstat::{CpuTimes, ProcessCpu, SwapCounters};
use tmem_sys::{swap, zswap};

pub use data::DataKind;
use report::{Outcome, RowRecord};

/// The job.
const SCRIPT: &str = include_str!("../workload/fill.py");

/// Arguments of `tmem bench capacity`.
#[derive(clap::Args, Debug, Clone, serde::Serialize)]
pub struct CapacityArgs {
    /// RAM budget of every row, MiB: the job's memory cgroup limit, and the
    /// same again for the compressed pool.
    #[arg(long, default_value_t = 256)]
    pub budget_mib: u64,
    /// Size of every swap area, in budgets (it bounds the rows that spill to disk).
    #[arg(long, default_value_t = 16)]
    pub swap_budgets: u64,
    /// Data sets to fill memory with.
    #[arg(long, value_delimiter = ',', default_value = "text,compressed,mix")]
    pub data: Vec<DataKind>,
    /// Rows: no swap, the kernel's zram and zswap, and tmem.
    #[arg(long, value_delimiter = ',', default_value = "none,zram,zswap,tmem,tmem-max,tmem+disk")]
    pub rows: Vec<Row>,
    /// zram compression algorithm.
    #[arg(long, default_value = "lz4")]
    pub zram_algorithm: String,
    /// zswap compressor (one the kernel's crypto API has: zswap cannot use
    /// zram's own lz4 where the crypto API lacks it).
    #[arg(long, default_value = "lzo-rle")]
    pub zswap_compressor: String,
    /// Codec of the tmem and tmem+disk rows.
    #[arg(long, default_value = "lz4")]
    pub tmem_codec: String,
    /// Codec of the tmem-max row: tmem's densest.
    #[arg(long, default_value = "zstd:9+dict")]
    pub tmem_max_codec: String,
    /// Kill a row's job after this many seconds.
    #[arg(long, default_value_t = 600)]
    pub timeout: u64,
    /// Directory for the disk swap file (zswap) and the disk tier (tmem+disk).
    #[arg(long, default_value = "/var/tmp")]
    pub swap_dir: PathBuf,
    /// Run even if other swap areas are active (results are then less clean).
    #[arg(long)]
    pub allow_other_swap: bool,
    /// Write every row and the machine's description to this JSON file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw MiB held at OOM per row, a panel per data set, into this PNG (or .svg).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Python interpreter for the job.
    #[arg(long, default_value = "python3")]
    pub python: String,
}

/// A row of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum, serde::Serialize)]
pub enum Row {
    /// No swap: the cgroup's budget alone.
    #[serde(rename = "none")]
    None,
    /// zram with `mem_limit` = the budget.
    #[serde(rename = "zram")]
    Zram,
    /// zswap over a disk swap file.
    #[serde(rename = "zswap")]
    Zswap,
    /// tmem, `--codec` = `--tmem-codec`.
    #[serde(rename = "tmem")]
    Tmem,
    /// tmem with its densest codec (`--tmem-max-codec`).
    #[value(name = "tmem-max")]
    #[serde(rename = "tmem-max")]
    TmemMax,
    /// tmem whose pool writes back to a disk tier.
    #[value(name = "tmem+disk")]
    #[serde(rename = "tmem+disk")]
    TmemDisk,
}

impl Row {
    /// Name in tables.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Zram => "zram",
            Self::Zswap => "zswap",
            Self::Tmem => "tmem",
            Self::TmemMax => "tmem-max",
            Self::TmemDisk => "tmem+disk",
        }
    }

    /// The swap backend, if any.
    fn backend(self) -> Option<BackendKind> {
        match self {
            Self::None => None,
            Self::Zram => Some(BackendKind::Zram),
            Self::Zswap => Some(BackendKind::Zswap),
            Self::Tmem | Self::TmemMax => Some(BackendKind::Tmem),
            Self::TmemDisk => Some(BackendKind::TmemDisk),
        }
    }
}

/// What the bench shares between rows.
struct Ctx<'a> {
    args: &'a CapacityArgs,
    layout: Layout,
    dir: PathBuf,
    budget: u64,
    swap_size: u64,
    progress: Progress,
}

/// What one row measured.
struct Measured {
    outcome: Outcome,
    allocated: u64,
    wall: Duration,
    peak: PoolSample,
    swap_peak: u64,
    vmstat: SwapCounters,
    daemon_cpu: Option<ProcessCpu>,
    machine_busy_secs: Option<f64>,
    steal_percent: f64,
    cgroup_oom_kills: u64,
    machine_oom_kills: u64,
    refused_writes: Option<u64>,
    stderr_tail: String,
}

fn machine_oom_kills() -> u64 {
    tmem_sys::vmstat::read().ok().and_then(|m| m.get("oom_kill").copied()).unwrap_or(0)
}

impl Ctx<'_> {
    /// Runs the job once over `data` in a fresh cgroup limited to the budget.
    fn measure(&self, backend: Option<&Backend>, data: &data::DataSet, label: &str) -> anyhow::Result<Measured> {
        let ours = backend.map(Backend::swap_paths).unwrap_or_default();
        let name = format!("tmem-bench-capacity-{}", std::process::id());
        let cg = MemCgroup::create(&self.layout, &name)?;
        let zswapping = matches!(backend, Some(Backend::Zswap { .. }));
        match cg.version() {
            Version::V1 => cg.set_swappiness(60)?,
            Version::V2 => cg.set_zswap_max(zswapping.then_some(self.budget))?,
        }
        cg.set_limit(Some(self.budget))?;
        let out_path = self.dir.join("job.out");
        let err_path = self.dir.join("job.err");
        let out = std::fs::File::create(&out_path).map_err(|e| anyhow!("{}: {e}", out_path.display()))?;
        let err = std::fs::File::create(&err_path).map_err(|e| anyhow!("{}: {e}", err_path.display()))?;
        let script = self.dir.join("fill.py");
        let max = (self.budget + self.swap_size + (256 << 20)).to_string();
        let server = backend.and_then(Backend::server_pid);
        let server_before = server.and_then(ProcessCpu::of_pid);
        let refusing = backend.filter(|b| matches!(b, Backend::Tmem(_)));
        let failed_before = refusing.map(|b| b.sample().failed_writes);
        let vm_before = SwapCounters::now()?;
        let oom_before = machine_oom_kills();
        let cpu_before = CpuTimes::now();
        let start = Instant::now();
        let args = [&*script.to_string_lossy(), &*data.path.to_string_lossy(), &max];
        let mut child =
            crate::pressure::workload::spawn_in_cgroups(&[&cg.procs_file()], &self.args.python, &args, out, err)
                .map_err(|e| anyhow!("cannot start the job ({}): {e}", self.args.python))?;
        let timeout = Duration::from_secs(self.args.timeout);
        let (mut peak, mut swap_peak, mut timed_out) = (PoolSample::default(), 0, false);
        let status = loop {
            if let Some(s) = child.try_wait()? {
                break Some(s);
            }
            if interrupted() || start.elapsed() > timeout {
                timed_out = !interrupted();
                if let Some(pid) = server.filter(|_| timed_out) {
                    let stacks = crate::pressure::workload::kernel_stacks(pid);
                    tracing::warn!("{label}: the job ran past --timeout; the swap server's threads:\n{stacks}");
                }
                crate::pressure::workload::kill_group(&mut child);
                break None;
            }
            if let Some(b) = backend {
                let s = b.sample();
                if s.pool_bytes > peak.pool_bytes {
                    peak = s;
                }
                swap_peak = swap_peak.max(crate::pressure::swap_used(&ours));
            }
            self.progress.show(label, false);
            std::thread::sleep(Duration::from_millis(100));
        };
        let wall = start.elapsed();
        // The job's own children, if any, go with its group.
        crate::pressure::workload::kill_group(&mut child);
        let cpu = cpu_before.zip(CpuTimes::now());
        let daemon_cpu = server_before.zip(server.and_then(ProcessCpu::of_pid)).map(|(b, a)| a.since(&b));
        let vmstat = SwapCounters::now()?.since(&vm_before);
        if let Some(hw) = backend.and_then(Backend::pool_high_water) {
            peak.pool_bytes = peak.pool_bytes.max(hw);
        }
        let refused_writes = failed_before.zip(refusing).map(|(b, be)| be.sample().failed_writes.saturating_sub(b));
        let cgroup_oom_kills = cg.oom_control()?.oom_kill;
        let machine_oom_kills = machine_oom_kills().saturating_sub(oom_before);
        let text = std::fs::read_to_string(&out_path).unwrap_or_default();
        let last = text.lines().next_back().unwrap_or("");
        let allocated = text.lines().rev().find_map(|l| l.parse::<u64>().ok()).unwrap_or(0);
        let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
        let lines: Vec<&str> = stderr.lines().collect();
        let stderr_tail = lines[lines.len().saturating_sub(5)..].join("\n");
        cg.remove()?;
        if interrupted() {
            return Err(anyhow!("interrupted; everything set up was undone"));
        }
        let killed = status.and_then(|s| std::os::unix::process::ExitStatusExt::signal(&s)) == Some(9);
        let outcome = if timed_out {
            Outcome::TimedOut
        } else if machine_oom_kills > cgroup_oom_kills {
            Outcome::MachineOom
        } else if killed && cgroup_oom_kills > 0 {
            Outcome::Oom
        } else if last == "limit" {
            Outcome::HeldAll
        } else {
            Outcome::Failed
        };
        Ok(Measured {
            outcome,
            allocated,
            wall,
            peak,
            swap_peak,
            vmstat,
            daemon_cpu,
            machine_busy_secs: cpu.map(|(b, a)| a.busy_secs_since(&b)),
            steal_percent: cpu.map_or(0.0, |(b, a)| a.steal_percent_since(&b)),
            cgroup_oom_kills,
            machine_oom_kills,
            refused_writes,
            stderr_tail,
        })
    }

    /// One row over one data set: fresh swap area, job, teardown.
    fn row(&self, row: Row, backend: Option<&mut Backend>, data: &data::DataSet) -> anyhow::Result<RowRecord> {
        let label = format!("{} over {}", row.name(), data.kind.name());
        self.progress.show(&label, true);
        let m = match backend {
            None => self.measure(None, data, &label)?,
            Some(b) => {
                if let Err(e) = b.activate() {
                    if let Err(d) = b.deactivate() {
                        return Err(anyhow!("{e}; then, undoing it: {d}"));
                    }
                    return Err(e);
                }
                let m = self.measure(Some(b), data, &label);
                let down = b.deactivate();
                let m = m?;
                down?;
                m
            }
        };
        Ok(RowRecord {
            row: row.name(),
            data: data.kind,
            outcome: m.outcome,
            allocated_bytes: m.allocated,
            wall_secs: m.wall.as_secs_f64(),
            pool_peak_bytes: m.peak.pool_bytes,
            pool_stored_bytes_at_peak: m.peak.stored_bytes,
            tier_pages_at_peak: m.peak.tier_pages,
            swap_peak_bytes: m.swap_peak,
            refused_writes: m.refused_writes,
            cgroup_oom_kills: m.cgroup_oom_kills,
            machine_oom_kills: m.machine_oom_kills,
            cpu_steal_percent: m.steal_percent,
            cpu: RunCpu::of(&m.vmstat, m.daemon_cpu, m.machine_busy_secs, None),
            vmstat: m.vmstat,
            limited_by: report::limited_by(row, m.outcome, m.peak.pool_bytes, self.budget, m.swap_peak, self.swap_size),
            stderr_tail: m.stderr_tail,
        })
    }
}

fn preflight(a: &CapacityArgs) -> anyhow::Result<Layout> {
    if !tmem_sys::is_root() {
        return Err(anyhow!("tmem bench capacity needs root (memory cgroups, swapon, zram, zswap)"));
    }
    if a.budget_mib < 16 {
        return Err(anyhow!("--budget-mib {}: at least 16 MiB (the job's Python alone needs ~10)", a.budget_mib));
    }
    if a.swap_budgets < 2 {
        return Err(anyhow!("--swap-budgets {}: at least 2", a.swap_budgets));
    }
    for (what, n) in [("--rows", a.rows.len()), ("--data", a.data.len())] {
        if n == 0 {
            return Err(anyhow!("{what} is empty"));
        }
    }
    let (mut rows, mut data) = (a.rows.clone(), a.data.clone());
    rows.sort();
    rows.dedup();
    data.sort();
    data.dedup();
    if rows.len() != a.rows.len() || data.len() != a.data.len() {
        return Err(anyhow!("--rows or --data lists something twice"));
    }
    crate::pressure::refuse_other_swap(a.allow_other_swap)?;
    cmd(&a.python, &["-c", "import sys; assert sys.version_info >= (3, 7)"])
        .map_err(|e| anyhow!("the job needs Python 3.7 or later ({}): {e}", a.python))?;
    if a.rows.contains(&Row::Zram) {
        let algs = zram::probe().map_err(|e| anyhow!("zram row: {e}"))?;
        if !algs.contains(&a.zram_algorithm) {
            return Err(anyhow!("zram row: zram does not offer {} (it offers {})", a.zram_algorithm, algs.join(", ")));
        }
    }
    if a.rows.contains(&Row::Zswap) && !zswap::available() {
        return Err(anyhow!("zswap row: this kernel has no zswap"));
    }
    if (a.rows.contains(&Row::Zswap) || a.rows.contains(&Row::TmemDisk)) && !a.swap_dir.is_dir() {
        return Err(anyhow!("--swap-dir {} is not a directory", a.swap_dir.display()));
    }
    let layout = Layout::detect()?;
    layout.ensure_memory_controller()?;
    Ok(layout)
}

/// The whole `max_pool_percent` of `ram` closest to `budget` (at least 1).
fn zswap_percent(budget: u64, ram: u64) -> u32 {
    let ram = ram.max(1);
    u32::try_from(((budget * 100 + ram / 2) / ram).clamp(1, 100)).unwrap_or(100)
}

/// `tmem bench capacity`.
pub fn run(a: &CapacityArgs) -> anyhow::Result<()> {
    let layout = preflight(a)?;
    install_signal_handlers()?;
    // zswap, if on, would sit in front of every row: off for the bench (restored on drop).
    let _zswap_off = zswap_off()?;
    let dir = tempfile::Builder::new().prefix("tmem-bench-capacity-").tempdir()?;
    std::fs::write(dir.path().join("fill.py"), SCRIPT)?;
    let budget = a.budget_mib << 20;
    let ram = swap::total_ram_bytes().unwrap_or(0);
    let ctx = Ctx {
        args: a,
        layout,
        dir: dir.path().to_owned(),
        budget,
        swap_size: budget * a.swap_budgets,
        progress: Progress::new(a.rows.len() * a.data.len()),
    };
    let mut sets = Vec::new();
    for &kind in &a.data {
        ctx.progress.show(&format!("preparing the {} data", kind.name()), true);
        sets.push(data::prepare(kind, dir.path(), &a.python)?);
    }
    // zswap's limit: (max_pool_percent, the bytes it means); on v2 the
    // cgroup's memory.zswap.max does the limiting.
    let (zswap_max_pool_percent, zswap_pool_limit) = match ctx.layout.memory_hierarchy().1 {
        Version::V1 => {
            let percent = zswap_percent(budget, ram);
            (percent, ram * u64::from(percent) / 100)
        }
        Version::V2 => (100, budget),
    };
    let base = BackendConfig {
        zram_algorithm: a.zram_algorithm.clone(),
        zram_mem_limit: Some(budget),
        zswap_compressor: a.zswap_compressor.clone(),
        zswap_max_pool_percent,
        tmem_pool_limit: budget.to_string(),
        tmem_codec: a.tmem_codec.clone(),
        tmem_tier_pool_limit: budget.to_string(),
        ..BackendConfig::new(ctx.swap_size, &a.swap_dir)
    };
    let mut records = Vec::new();
    let mut errors = Vec::new();
    let mut zram_device = None;
    'rows: for &row in &a.rows {
        let mut backend = match row.backend() {
            None => None,
            Some(kind) => {
                let mut c = base.clone();
                if row == Row::TmemMax {
                    c.tmem_codec.clone_from(&a.tmem_max_codec);
                }
                ctx.progress.show(&format!("{}: preparing", row.name()), true);
                match Backend::prepare(kind, &c) {
                    Ok(b) => {
                        zram_device = zram_device.or_else(|| b.zram_device());
                        Some(b)
                    }
                    Err(e) => {
                        ctx.progress.note(&format!("{}: cannot prepare: {e}", row.name()));
                        errors.push(format!("{}: {e}", row.name()));
                        ctx.progress.steps_done(sets.len());
                        continue;
                    }
                }
            }
        };
        for set in &sets {
            match ctx.row(row, backend.as_mut(), set) {
                Ok(r) => {
                    if r.outcome != Outcome::Oom {
                        ctx.progress.note(&format!(
                            "{} over {}: {}",
                            row.name(),
                            set.kind.name(),
                            r.outcome.describe()
                        ));
                    }
                    records.push(r);
                }
                Err(e) => {
                    ctx.progress.note(&format!("{} over {}: error: {e}", row.name(), set.kind.name()));
                    errors.push(format!("{} over {}: {e}", row.name(), set.kind.name()));
                    if interrupted() {
                        break 'rows;
                    }
                    break;
                }
            }
            ctx.progress.steps_done(1);
        }
        if let Some(b) = backend.take() {
            ctx.progress.show(&format!("{}: cleaning up", row.name()), true);
            if let Err(e) = b.finish() {
                errors.push(format!("{}: cleanup: {e}", row.name()));
            }
        }
    }
    ctx.progress.finish();
    report::fill_machine_cpu(&mut records);
    let machine = report::Machine {
        machine: crate::machine::Machine::of(&ctx.layout),
        budget_bytes: budget,
        swap_size_bytes: ctx.swap_size,
        zswap_pool_limit_bytes: zswap_pool_limit,
        zram_device,
    };
    report::print(a, &machine, &sets, &records);
    crate::write_outputs(
        a.plot.as_deref(),
        a.json.as_deref(),
        |p| report::plot(p, &machine, &sets, &records),
        |p| report::write_json(p, a, &machine, &sets, &records, &errors),
    )?;
    crate::pressure::bench_result(&errors)?;
    let bad: Vec<String> = records
        .iter()
        .filter(|r| matches!(r.outcome, Outcome::MachineOom | Outcome::Failed))
        .map(|r| format!("{} over {}: {}", r.row, r.data.name(), r.outcome.describe()))
        .collect();
    if !bad.is_empty() {
        return Err(anyhow!("{}", bad.join("; ")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zswap_percent_covers_the_budget() {
        let gib = 1u64 << 30;
        assert_eq!(zswap_percent(256 << 20, 24 * gib), 1, "1 % of 24 GiB is 246 MiB");
        assert_eq!(zswap_percent(400 << 20, 24 * gib), 2);
        assert_eq!(zswap_percent(1, 24 * gib), 1, "never 0");
        assert_eq!(zswap_percent(8 * gib, 4 * gib), 100);
    }

    #[test]
    fn the_job_is_embedded() {
        assert!(SCRIPT.contains("os.preadv"));
    }

    #[test]
    fn rows_map_to_backends() {
        assert_eq!(Row::None.backend(), None);
        assert_eq!(Row::TmemMax.backend(), Some(BackendKind::Tmem));
        assert_eq!(Row::TmemDisk.backend(), Some(BackendKind::TmemDisk));
    }
}
