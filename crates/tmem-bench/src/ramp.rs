//! `tmem bench ramp`: throughput of a Java job whose live heap grows step
//! by step past its memory limit (seed 001: zswap's SPECjbb2005 ramp).
//!
//! The job (`crates/tmem-bench/workload/Ramp.java`, run by the JDK's
//! source launcher) grows a live set of orders to each step's size (a
//! percentage of the memory cgroup's limit), then runs a fixed mix of
//! operations for `--step-secs` and prints how many it did. For every
//! backend (disk swap file, zswap over it, zram, tmem, tmem over a disk
//! tier) the bench runs the job once in a fresh cgroup over a fresh swap
//! area and records, per step, operations per second, swap pages per second
//! and the machine's busy CPU over the timed part; per row, the daemon's
//! CPU per swapped page. At the end the job checks every order against the
//! sum it recorded when it made it: a page swapped back wrong fails the row.
//!
//! What is set up is undone after each row, also on error, panic or Ctrl-C
//! (the pressure bench's backends, the front rows `zram+tmem`, `zram+disk`
//! and `zswap+tmem` included: rows that need zram writeback are skipped,
//! with the reason, where the kernel lacks it).

mod report;

use anyhow::anyhow;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::pressure::backend::{Backend, BackendConfig, BackendKind};
use crate::pressure::front::{Availability, BlockReads, FrontArgs, Skipped};
use crate::pressure::report::FrontRecord;
use crate::pressure::workload::{kill_group, spawn_in_cgroups};
use crate::pressure::{cmd, install_signal_handlers, interrupted, zswap_off, DiskProfile};
use crate::progress::Progress;
use tmem_sys::cgroup::{Layout, MemCgroup, Version};
use tmem_sys::vmstat::{CpuTimes, ProcessCpu, SwapCounters};

use report::{RowRecord, StepRecord};

/// The job.
const SOURCE: &str = include_str!("../workload/Ramp.java");

/// Arguments of `tmem bench ramp`.
#[derive(clap::Args, Debug, Clone, serde::Serialize)]
pub struct RampArgs {
    /// The job's memory cgroup limit, MiB.
    #[arg(long, default_value_t = 512)]
    pub limit_mib: u64,
    /// Live heap of each step, % of the limit.
    #[arg(long, value_delimiter = ',', default_value = "50,75,100,125,150,175,200")]
    pub steps: Vec<u64>,
    /// Seconds of operations timed at each step.
    #[arg(long, default_value_t = 20.0)]
    pub step_secs: f64,
    /// Swap backends to compare.
    #[arg(long, value_delimiter = ',', default_value = "disk,zswap,zram,tmem,tmem+disk")]
    pub backends: Vec<BackendKind>,
    /// zram compression algorithm.
    #[arg(long, default_value = "lz4")]
    pub zram_algorithm: String,
    /// zswap compressor (one the kernel's crypto API has).
    #[arg(long, default_value = "lzo-rle")]
    pub zswap_compressor: String,
    /// zswap max_pool_percent.
    #[arg(long, default_value_t = 20)]
    pub zswap_max_pool_percent: u32,
    /// tmem codec.
    #[arg(long, default_value = "lz4")]
    pub tmem_codec: String,
    /// tmem pool limit (size or % of RAM).
    #[arg(long, default_value = "50%")]
    pub tmem_pool_limit: String,
    /// Pool limit of tmem+disk: small, so that pages move to the tier.
    #[arg(long, default_value = "64M")]
    pub tmem_tier_pool_limit: String,
    /// Directory for the disk swap file and the disk tier.
    #[arg(long, default_value = "/var/tmp")]
    pub swap_dir: PathBuf,
    /// The disk behind the disk swap file and the tier (as `bench pressure --disk-profile`).
    #[arg(long, default_value = "host")]
    pub disk_profile: DiskProfile,
    /// Kill a row's job after this many seconds.
    #[arg(long, default_value_t = 1800)]
    pub timeout: u64,
    /// Also run the job under `tmem run --memory LIMIT --codec TMEM_CODEC`
    /// (userfaultfd, no swap; its cgroup has no limit): the `tmem-run` row,
    /// run last. `--backends ...,tmem-run` does the same.
    #[arg(long)]
    pub tmem_run: bool,
    /// Run even if other swap areas are active.
    #[arg(long)]
    pub allow_other_swap: bool,
    /// Write every row to this JSON file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw throughput against heap size, a line per backend, into this PNG (or .svg).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// The JDK's java launcher (11 or later: it runs the source file).
    #[arg(long, default_value = "java")]
    pub java: String,
    /// The front rows' budget and policy (the budget's default: 1/3 of the job's limit).
    #[command(flatten)]
    #[serde(flatten)]
    pub front: FrontArgs,
}

/// A line the job printed.
#[derive(Debug, PartialEq)]
enum JobLine {
    Begin,
    Step { mib: u64, ops: u64, secs: f64 },
    Verified(u64),
    Corrupt(u64),
}

fn parse_line(l: &str) -> Option<JobLine> {
    let f: Vec<&str> = l.split_whitespace().collect();
    match f[..] {
        ["begin", _] => Some(JobLine::Begin),
        ["step", mib, "ops", ops, "secs", secs, "checksum", _] => {
            Some(JobLine::Step { mib: mib.parse().ok()?, ops: ops.parse().ok()?, secs: secs.parse().ok()? })
        }
        ["verified", n] => Some(JobLine::Verified(n.parse().ok()?)),
        ["CORRUPT", n] => Some(JobLine::Corrupt(n.parse().ok()?)),
        _ => None,
    }
}

/// A snapshot at a step boundary.
#[derive(Clone, Copy)]
struct Mark {
    at: Instant,
    vm: SwapCounters,
    cpu: Option<CpuTimes>,
}

impl Mark {
    fn now() -> anyhow::Result<Self> {
        Ok(Self { at: Instant::now(), vm: SwapCounters::now()?, cpu: CpuTimes::now() })
    }
}

struct Ctx<'a> {
    args: &'a RampArgs,
    layout: Layout,
    dir: PathBuf,
    progress: Progress,
    cpus: usize,
}

impl Ctx<'_> {
    /// The job's memory cgroup, limited or not. Made before the backend's
    /// swap comes up, so that zswap+tmem can name it to the daemon (v2).
    fn cgroup(&self, limited: bool) -> anyhow::Result<MemCgroup> {
        let cg = MemCgroup::create(&self.layout, &format!("tmem-bench-ramp-{}", std::process::id()))?;
        if cg.version() == Version::V1 {
            cg.set_swappiness(60)?;
        }
        cg.set_limit(limited.then_some(self.args.limit_mib << 20))?;
        Ok(cg)
    }

    /// Runs the job in `cg` (removed here) over `backend` (or none: the
    /// whole ramp in RAM, no limit), or, with `under_tmem_run`, inside
    /// `tmem run --memory LIMIT`.
    fn run_job(
        &self,
        backend: Option<&Backend>,
        cg: MemCgroup,
        name: &str,
        under_tmem_run: bool,
    ) -> anyhow::Result<RowRecord> {
        let a = self.args;
        let limit = a.limit_mib << 20;
        let steps_mib: Vec<u64> = a.steps.iter().map(|p| a.limit_mib * p / 100).collect();
        let max = steps_mib.iter().copied().max().unwrap_or(0);
        let xmx = format!("-Xmx{}m", max * 2 + 64);
        let out_path = self.dir.join("job.out");
        let err_path = self.dir.join("job.err");
        let out = std::fs::File::create(&out_path).map_err(|e| anyhow!("{}: {e}", out_path.display()))?;
        let err = std::fs::File::create(&err_path).map_err(|e| anyhow!("{}: {e}", err_path.display()))?;
        let list = steps_mib.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
        let source = self.dir.join("Ramp.java").to_string_lossy().into_owned();
        let secs = a.step_secs.to_string();
        // A small young generation: the footprint is then the live heap, the
        // old generation's free share, 48 MiB and the JVM's own (tighter
        // free ratios made full collections, and OOM kills, more frequent).
        let args = [&*xmx, "-Xmn48m", "-XX:+UseSerialGC", &source, &list, &secs, "1"];
        let server = backend.and_then(Backend::server_pid);
        let server_before = server.and_then(ProcessCpu::of_pid);
        let below = backend.and_then(Backend::backing_dev);
        let reads_before = below.as_deref().and_then(BlockReads::of);
        let row_start = Mark::now()?;
        let (program, args): (String, Vec<String>) = if under_tmem_run {
            crate::pressure::backend::TmemRun::new(&a.tmem_codec)?.wrap(limit, &a.java, &args)
        } else {
            (a.java.clone(), args.iter().map(|s| (*s).to_owned()).collect())
        };
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut child = spawn_in_cgroups(&[&cg.procs_file()], &program, &args, out, err)
            .map_err(|e| anyhow!("cannot start the job ({program}): {e}"))?;
        let timeout = Duration::from_secs(a.timeout);
        let (mut seen, mut begin, mut steps) = (0, None, Vec::new());
        let (mut verified, mut corrupt, mut timed_out) = (None, None, false);
        let status = loop {
            let done = child.try_wait()?;
            let text = std::fs::read_to_string(&out_path).unwrap_or_default();
            // Only whole lines: the job may be writing the last one.
            let lines: Vec<&str> = text.split_inclusive('\n').filter_map(|l| l.strip_suffix('\n')).collect();
            let complete = lines.len();
            for l in &lines[seen.min(complete)..complete] {
                match parse_line(l) {
                    Some(JobLine::Begin) => begin = Some(Mark::now()?),
                    Some(JobLine::Step { mib, ops, secs }) => {
                        let end = Mark::now()?;
                        if let Some(b) = begin.take() {
                            steps.push(self.step(b, end, mib, limit, ops, secs));
                        }
                    }
                    Some(JobLine::Verified(n)) => verified = Some(n),
                    Some(JobLine::Corrupt(n)) => corrupt = Some(n),
                    None => {}
                }
            }
            seen = seen.max(complete);
            if done.is_some() {
                break done;
            }
            if interrupted() || row_start.at.elapsed() > timeout {
                timed_out = !interrupted();
                break kill_group(&mut child);
            }
            self.progress.show(&format!("{name}: step {} of {}", steps.len() + 1, a.steps.len()), false);
            std::thread::sleep(Duration::from_millis(100));
        };
        kill_group(&mut child);
        let row_end = Mark::now()?;
        let reads = reads_before.zip(below.as_deref().and_then(BlockReads::of)).and_then(|(b, e)| e.mean_since(&b));
        let front = backend.filter(|_| crate::pressure::backend::FRONT_ROWS.contains(&name)).map(|b| {
            let s = b.sample();
            FrontRecord {
                pool_bytes_at_peak: s.front_pool_bytes,
                written_back_pages: s.written_back,
                read_back_pages: s.read_back,
                read_back_mean_us: reads.map(|(us, _)| us),
                backing_reads: reads.map_or(0, |(_, n)| n),
                stats: b.front_stats(),
            }
        });
        let daemon_cpu = server_before.zip(server.and_then(ProcessCpu::of_pid)).map(|(b, a)| a.since(&b));
        let oom_kills = cg.oom_control()?.oom_kill;
        cg.remove()?;
        if interrupted() {
            return Err(anyhow!("interrupted; everything set up was undone"));
        }
        let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
        let lines: Vec<&str> = stderr.lines().collect();
        let vm = row_end.vm.since(&row_start.vm);
        let busy = row_start.cpu.zip(row_end.cpu).map(|(b, e)| e.busy_secs_since(&b));
        Ok(RowRecord {
            backend: name.to_owned(),
            outcome: report::outcome(status, timed_out, oom_kills, verified, corrupt),
            steps,
            verified_orders: verified,
            corrupt_orders: corrupt,
            wall_secs: row_end.at.duration_since(row_start.at).as_secs_f64(),
            cpu: crate::pressure::report::RunCpu::of(&vm, daemon_cpu, busy, None),
            cpu_steal_percent: row_start.cpu.zip(row_end.cpu).map_or(0.0, |(b, e)| e.steal_percent_since(&b)),
            oom_kills,
            vmstat: vm,
            stderr_tail: lines[lines.len().saturating_sub(5)..].join("\n"),
            front,
        })
    }

    fn step(&self, b: Mark, e: Mark, mib: u64, limit: u64, ops: u64, secs: f64) -> StepRecord {
        let wall = e.at.duration_since(b.at).as_secs_f64().max(1e-3);
        let vm = e.vm.since(&b.vm);
        let swapped = vm.pswpin + vm.pswpout + vm.zswpin + vm.zswpout;
        StepRecord {
            live_mib: mib,
            live_percent_of_limit: (mib << 20) as f64 * 100.0 / limit as f64,
            ops_per_sec: ops as f64 / secs.max(1e-3),
            swapped_pages_per_sec: swapped as f64 / wall,
            pswpin_per_sec: (vm.pswpin + vm.zswpin) as f64 / wall,
            pswpout_per_sec: (vm.pswpout + vm.zswpout) as f64 / wall,
            machine_busy_percent: b
                .cpu
                .zip(e.cpu)
                .map(|(x, y)| y.busy_secs_since(&x) * 100.0 / (wall * self.cpus as f64)),
            steal_percent: b.cpu.zip(e.cpu).map_or(0.0, |(x, y)| y.steal_percent_since(&x)),
        }
    }
}

fn preflight(a: &RampArgs) -> anyhow::Result<Layout> {
    if !tmem_sys::is_root() {
        return Err(anyhow!("tmem bench ramp needs root (memory cgroups, swapon, zram, zswap)"));
    }
    if a.limit_mib < 64 {
        return Err(anyhow!("--limit-mib {}: at least 64 (the JVM alone needs ~40 MiB)", a.limit_mib));
    }
    if a.steps.is_empty() || a.steps.iter().any(|s| *s == 0 || *s > 400) {
        return Err(anyhow!("--steps must be percentages of the limit in 1..=400"));
    }
    if a.backends.is_empty() {
        return Err(anyhow!("--backends is empty"));
    }
    if a.step_secs < 1.0 {
        return Err(anyhow!("--step-secs {}: at least 1 s (fewer operations are noise)", a.step_secs));
    }
    crate::pressure::refuse_other_swap(a.allow_other_swap)?;
    let version = cmd(&a.java, &["-version"]).map_err(|e| anyhow!("the job needs a JDK ({}): {e}", a.java))?;
    tracing::debug!("java: {version}");
    let layout = Layout::detect()?;
    layout.ensure_memory_controller()?;
    Ok(layout)
}

/// `tmem bench ramp`.
pub fn run(a: &RampArgs) -> anyhow::Result<()> {
    let layout = preflight(a)?;
    install_signal_handlers()?;
    let _zswap_off = zswap_off()?;
    let dir = tempfile::Builder::new().prefix("tmem-bench-ramp-").tempdir()?;
    std::fs::write(dir.path().join("Ramp.java"), SOURCE)?;
    let limit = a.limit_mib << 20;
    let max_live = a.steps.iter().max().copied().unwrap_or(100) * limit / 100;
    let swap_size = (max_live * 2 + (256 << 20)).div_ceil(64 << 20) * (64 << 20);
    // `--backends tmem-run` is the `--tmem-run` row: the job under `tmem
    // run`, in a cgroup without a limit, not a swap backend under one.
    let tmem_run = a.tmem_run || a.backends.contains(&BackendKind::TmemRun);
    let backends: Vec<BackendKind> = a.backends.iter().copied().filter(|k| *k != BackendKind::TmemRun).collect();
    let ctx = Ctx {
        args: a,
        layout,
        dir: dir.path().to_owned(),
        progress: Progress::new(1 + backends.len() + usize::from(tmem_run)),
        cpus: std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
    };
    let cfg = BackendConfig {
        zram_algorithm: a.zram_algorithm.clone(),
        zswap_compressor: a.zswap_compressor.clone(),
        zswap_max_pool_percent: a.zswap_max_pool_percent,
        tmem_pool_limit: a.tmem_pool_limit.clone(),
        tmem_codec: a.tmem_codec.clone(),
        tmem_tier_pool_limit: a.tmem_tier_pool_limit.clone(),
        disk_profile: a.disk_profile,
        front: a.front.config(limit),
        ..BackendConfig::new(swap_size, &a.swap_dir)
    };
    let available = Availability::probe(&backends);
    let skipped: Vec<Skipped> = available.skipped(&backends);
    for s in &skipped {
        println!("{s}");
    }
    let mut rows = Vec::new();
    let mut errors = Vec::new();
    ctx.progress.show("reference: the whole ramp in RAM, no limit", true);
    let reference = ctx.run_job(None, ctx.cgroup(false)?, "no limit", false)?;
    ctx.progress.steps_done(1);
    if reference.outcome != report::Outcome::Ok {
        return Err(anyhow!("the reference run failed ({:?}): {}", reference.outcome, reference.stderr_tail));
    }
    let mut zram_device = None;
    for &kind in &backends {
        if interrupted() {
            break;
        }
        let name = kind.name();
        if skipped.iter().any(|s| s.backend == name) {
            ctx.progress.steps_done(1);
            continue;
        }
        ctx.progress.show(&format!("{name}: preparing"), true);
        let mut backend = match Backend::prepare(kind, &cfg) {
            Ok(b) => b,
            Err(e) => {
                errors.push(format!("{name}: {e}"));
                ctx.progress.steps_done(1);
                continue;
            }
        };
        zram_device = zram_device.or_else(|| backend.zram_device());
        ctx.progress.show(name, true);
        let r = ctx.cgroup(true).and_then(|cg| {
            backend.set_run_cgroup((cg.version() == Version::V2).then(|| cg.path()));
            backend.activate()?;
            ctx.run_job(Some(&backend), cg, name, false)
        });
        let down = backend.deactivate();
        match r.and_then(|r| down.map(|()| r)) {
            Ok(r) => {
                if r.outcome != report::Outcome::Ok {
                    ctx.progress.note(&format!("{name}: {:?} {}", r.outcome, r.stderr_tail));
                }
                rows.push(r);
            }
            Err(e) => errors.push(format!("{name}: {e}")),
        }
        if let Err(e) = backend.finish() {
            errors.push(format!("{name}: cleanup: {e}"));
        }
        ctx.progress.steps_done(1);
    }
    if tmem_run && !interrupted() {
        ctx.progress.show("tmem-run", true);
        match ctx.cgroup(false).and_then(|cg| ctx.run_job(None, cg, "tmem-run", true)) {
            Ok(r) => {
                if r.outcome != report::Outcome::Ok {
                    ctx.progress.note(&format!("tmem-run: {:?} {}", r.outcome, r.stderr_tail));
                }
                rows.push(r);
            }
            Err(e) => errors.push(format!("tmem-run: {e}")),
        }
        ctx.progress.steps_done(1);
    }
    ctx.progress.finish();
    let machine = report::Machine {
        machine: crate::machine::Machine::of(&ctx.layout),
        limit_bytes: limit,
        swap_size_bytes: swap_size,
        disk: a.disk_profile.describe(),
        zram_device,
    };
    report::print(a, &machine, &reference, &rows, &skipped);
    crate::write_outputs(
        a.plot.as_deref(),
        a.json.as_deref(),
        |p| report::plot(p, &machine, &reference, &rows),
        |p| report::write_json(p, a, &machine, &reference, &rows, &skipped, &errors),
    )?;
    crate::pressure::bench_result(&errors)?;
    if let Some(r) = rows.iter().find(|r| r.outcome == report::Outcome::Corrupt) {
        return Err(anyhow!("{}: the job found corrupted orders: data was damaged in swap", r.backend));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_lines_parse() {
        assert_eq!(parse_line("begin 256"), Some(JobLine::Begin));
        assert_eq!(
            parse_line("step 256 ops 1200 secs 2.001 checksum 77"),
            Some(JobLine::Step { mib: 256, ops: 1200, secs: 2.001 })
        );
        assert_eq!(parse_line("verified 12"), Some(JobLine::Verified(12)));
        assert_eq!(parse_line("CORRUPT 3"), Some(JobLine::Corrupt(3)));
        assert_eq!(parse_line("step x ops 1 secs 1 checksum 1"), None);
        assert_eq!(parse_line(""), None);
        assert!(SOURCE.contains("class Ramp"));
    }
}
