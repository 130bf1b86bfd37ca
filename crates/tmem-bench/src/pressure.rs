//! `tmem bench pressure`: the zcache/RAMster memory-pressure ladder.
//!
//! A memory-hungry workload (Python jobs growing a realistic heap and making
//! passes over it, see `crates/tmem-bench/workload/heap.py`) first runs once in an
//! unlimited memory cgroup without swap: that reference run gives its peak
//! (`memory.max_usage_in_bytes`) and its checksums. Then, for every backend
//! (disk swap file, zram, zswap over the disk file, tmem) and every pressure
//! level (a cgroup v1 memory limit of 100 = none, 75, 50, 35, 25 % of the
//! peak), the workload runs `--runs` times in a fresh cgroup with a fresh,
//! empty swap area of that backend: wall time, correctness against the
//! reference checksums, OOM kills, pswpin/pswpout, the backend's peak pool
//! memory (sampled every 100 ms), and CPU time (the backend's daemon's, and
//! the whole machine's busy time, also for the reference run, so that what
//! swapping cost per page can be given for every backend) are recorded.
//!
//! With `--cold-share N` each job builds N % of its heap first and leaves it
//! alone until its checksum (a cold part, as real programs have); the front
//! rows (`zram+tmem`, `zram+disk`, `zswap+tmem`, see [`front`]) put the
//! kernel's compressed swap in front of tmem or of a disk file, and report
//! the pages written back and read back.
//!
//! Every kernel setting touched is put back at the end, on error, on panic
//! and on Ctrl-C/SIGTERM (the signal only sets a flag; the run in progress is
//! killed and the guards undo what was set up). See docs/PRESSURE.md.

pub(crate) mod backend;
pub(crate) mod front;
mod net;
pub(crate) mod report;
mod throttle;
pub(crate) mod workload;

use anyhow::anyhow;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use crate::zram;
use tmem_sys::cgroup::{CgroupError, Layout, MemCgroup, Version};
use tmem_sys::vmstat::{CpuTimes, ProcessCpu, RoleCpu, SwapCounters, ThreadsCpu};
use tmem_sys::{swap, zswap};

pub use backend::BackendKind;
use backend::{Backend, BackendConfig, PoolSample};
pub use front::FrontArgs;
use front::{Availability, BlockReads, Skipped};
pub use net::NetProfile;
use report::{Outcome, RunRecord};
pub use throttle::DiskProfile;

use crate::progress::Progress;
use workload::Workload;

/// Arguments of `tmem bench pressure`.
#[derive(clap::Args, Debug, Clone, serde::Serialize)]
pub struct PressureArgs {
    /// Target peak memory of the whole workload, MiB (split evenly over --jobs processes).
    #[arg(long, default_value_t = 1536)]
    pub workload_mib: u64,
    /// Workload processes running in parallel, like make -jJ.
    #[arg(long, default_value_t = 2)]
    pub jobs: u32,
    /// Passes the workload makes over its heap (read + modify).
    #[arg(long, default_value_t = 3)]
    pub passes: u32,
    /// % of each job's heap built first, as records of its own, and then
    /// not touched again until the final checksum; the passes touch only
    /// the rest (0: every record is touched at every pass).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=i64::from(workload::MAX_COLD_SHARE)))]
    pub cold_share: u32,
    /// Pressure levels: memory limit in % of the measured peak (100 = no limit).
    #[arg(long, value_delimiter = ',', default_value = "100,75,50,35,25")]
    pub levels: Vec<u32>,
    /// Swap backends to compare.
    #[arg(long, value_delimiter = ',', default_value = "disk,zram,zswap,tmem")]
    pub backends: Vec<BackendKind>,
    /// Runs per (backend, level); the table shows medians.
    #[arg(long, default_value_t = 2)]
    pub runs: u32,
    /// Write every run (raw) and the summary to this JSON file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw the figures (wall time, machine CPU per swapped page and peak
    /// pool memory against the memory limit, a line per backend) into this PNG (or .svg) file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Run even if other swap areas are active (results are then less clean).
    #[arg(long)]
    pub allow_other_swap: bool,
    /// Kill a run after this many seconds (0: 20x the reference run, at least 300).
    #[arg(long, default_value_t = 0)]
    pub timeout: u64,
    /// Directory for the disk swap file (the disk and zswap backends).
    #[arg(long, default_value = "/var/tmp")]
    pub swap_dir: PathBuf,
    /// zram compression algorithm (zram runs on a device hot-added for the
    /// bench and removed afterwards; existing zram devices are left alone).
    #[arg(long, default_value = "lz4")]
    pub zram_algorithm: String,
    /// zswap compressor.
    #[arg(long, default_value = "lzo-rle")]
    pub zswap_compressor: String,
    /// zswap max_pool_percent.
    #[arg(long, default_value_t = 20)]
    pub zswap_max_pool_percent: u32,
    /// tmem pool limit (size or % of RAM).
    #[arg(long, default_value = "50%")]
    pub tmem_pool_limit: String,
    /// tmem codec (as `tmem swap up --codec`). lz4 compares codec for
    /// codec with zram lz4; `auto` (swap up's default: lz4 with no front,
    /// zstd:3+dict behind one) measures what `tmem swap up` runs; the
    /// tmem-run row takes named codecs only.
    #[arg(long, default_value = "lz4")]
    pub tmem_codec: String,
    /// `tmem run --read-ahead` of the tmem-run row (default: tmem run's).
    #[arg(long)]
    pub tmem_read_ahead: Option<u64>,
    /// FUSE over io_uring workers per CPU for the tmem rows (as `tmem swap up
    /// --fuse-uring`; 0: /dev/fuse).
    #[arg(long, default_value_t = 0)]
    pub tmem_fuse_uring: usize,
    /// `/dev/fuse` worker threads of the tmem rows and the fuse-ram baseline
    /// (as `tmem swap up --fuse-threads`; 0: the daemon's default, one per
    /// online CPU and at least 4).
    #[arg(long, default_value_t = 0)]
    pub tmem_fuse_threads: usize,
    /// How freed swap slots reach tmem's pools (as `tmem swap up --discard`): once or pages.
    #[arg(long, default_value = "once")]
    pub tmem_discard: tmem_sys::swap::SwapDiscard,
    /// Recompression codec of the tmem+recomp row (as `tmem swap up --recompress`).
    #[arg(long, default_value = "zstd:3+dict")]
    pub tmem_recompress: String,
    /// Seconds unread before the tmem+recomp row recompresses a page.
    #[arg(long, default_value_t = 1.0, value_parser = tmem_daemon::spec::parse_after)]
    pub tmem_recompress_after: f64,
    /// Pool limit of the tiered tmem rows (tmem+remote, tmem+disk): small, so
    /// that most pages move down to the tier.
    #[arg(long, default_value = "64M")]
    pub tmem_tier_pool_limit: String,
    /// memory.swappiness of the workload's cgroup (cgroup v1; v2 has none, vm.swappiness applies).
    #[arg(long, default_value_t = 60)]
    pub swappiness: u32,
    /// Pool sampling interval, ms.
    #[arg(long, default_value_t = 100)]
    pub sample_ms: u64,
    /// Seconds after the jobs exit at which the pool is measured again, against
    /// the swap the kernel still uses: what freed swap slots leave behind.
    #[arg(long, default_value_t = 5)]
    pub after_exit_secs: u64,
    /// Python interpreter for the workload.
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// Where the tmem+remote rows' Redis nodes run: loopback, or each in a
    /// network namespace of its own behind a veth pair at 25g (25 Gbit/s,
    /// 20 us each way) or 10g (10 Gbit/s, 50 us each way).
    #[arg(long, default_value = "loopback")]
    pub net: NetProfile,
    /// The disk behind the disk swap file (disk, zswap) and the tmem+disk
    /// tier: host (as it is), nvme or cloud (a throttled loop device; cgroup v1).
    #[arg(long, default_value = "host")]
    pub disk_profile: DiskProfile,
    /// tmem+remote-kill: kill a Redis node once the tier holds this many pages.
    #[arg(long, default_value_t = 2000)]
    pub kill_node_at_tier_pages: u64,
    /// The front rows' budget and policy.
    #[command(flatten)]
    #[serde(flatten)]
    pub front: FrontArgs,
}

/// Set by SIGINT/SIGTERM/SIGHUP.
static INTERRUPTED: LazyLock<Arc<AtomicBool>> = LazyLock::new(Arc::default);

pub(crate) fn install_signal_handlers() -> anyhow::Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    for sig in [SIGINT, SIGTERM, SIGHUP] {
        signal_hook::flag::register(sig, Arc::clone(&INTERRUPTED))?;
    }
    Ok(())
}

pub(crate) fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

const INTERRUPTED_MSG: &str = "interrupted; everything set up was undone";

/// Runs a helper command in its own process group (a terminal Ctrl-C must
/// not interrupt a swapoff half way); returns its stdout.
pub(crate) fn cmd(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let line = std::iter::once(program).chain(args.iter().copied()).collect::<Vec<_>>().join(" ");
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .process_group(0)
        .output()
        .map_err(|e| anyhow!("cannot run {line}: {e}"))?;
    if !out.status.success() {
        let mut msg = String::from_utf8_lossy(&out.stderr).trim().to_owned();
        if msg.is_empty() {
            msg = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        }
        return Err(anyhow!("{line} failed ({}): {msg}", out.status));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// `EXE ARGS --runtime-dir DIR` (a `tmem` command for the daemon in DIR),
/// run as [`cmd`] runs it.
pub(crate) fn tmem_in(exe: &Path, dir: &Path, args: &[&str]) -> anyhow::Result<String> {
    let dir = dir.to_string_lossy();
    let mut all = args.to_vec();
    all.extend(["--runtime-dir", &dir]);
    cmd(&exe.to_string_lossy(), &all)
}

/// What a run needs.
struct Ctx<'a> {
    args: &'a PressureArgs,
    workload: Workload,
    cgroup_name: String,
    /// The machine's cgroup layout; the workload's group is made in its memory hierarchy.
    layout: Layout,
    /// Reference output of each job.
    expected: Vec<String>,
    timeout: Duration,
    progress: Progress,
    /// Busy CPU seconds of the whole machine in the reference run.
    reference_busy_secs: Option<f64>,
    /// Tier pages at which the current run kills a Redis node (tmem+remote-kill).
    kill_node_at: Option<u64>,
}

/// Everything a run measured.
/// The mean of a sampled figure over time: each sample holds until the next.
#[derive(Debug, Default)]
struct TimeMean {
    last: Option<(Instant, u64)>,
    weighted: f64,
    secs: f64,
}

impl TimeMean {
    fn add(&mut self, at: Instant, value: u64) {
        if let Some((t, prev)) = self.last {
            let dt = at.saturating_duration_since(t).as_secs_f64();
            self.weighted += prev as f64 * dt;
            self.secs += dt;
        }
        self.last = Some((at, value));
    }

    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    fn mean(&self) -> Option<u64> {
        (self.secs > 0.0).then(|| (self.weighted / self.secs) as u64)
    }
}

struct Measured {
    wall: Duration,
    timed_out: bool,
    vmstat: SwapCounters,
    peak: PoolSample,
    /// Pool memory averaged over the run's time (None: no samples).
    pool_mean_bytes: Option<u64>,
    tier_peak_pages: u64,
    samples: u64,
    max_usage: u64,
    failcnt: u64,
    oom_kills: u64,
    /// Share of CPU time the hypervisor gave to other guests during the run.
    steal_percent: f64,
    /// CPU time of the backend's user-space server (None: it has none).
    daemon_cpu: Option<ProcessCpu>,
    /// The same by thread role, of the threads alive as the jobs ended.
    daemon_threads: Vec<RoleCpu>,
    /// Busy CPU seconds of the whole machine, all CPUs.
    machine_busy_secs: Option<f64>,
    jobs: Vec<workload::JobResult>,
    /// Swap areas not ours seen during the run.
    foreign: Vec<String>,
    /// `--after-exit-secs` after the jobs exited: the pool, and what the
    /// kernel still held in our swap areas.
    after_exit: Option<(PoolSample, u64)>,
    /// Writes the device refused during the run.
    refused_writes: Option<u64>,
    /// Reads of the lower tiers' backing stores per page they returned
    /// during the run (None: no page came from a tier).
    tier_reads_per_page: Option<f64>,
    /// Writebacks that swap writes waited for during the run.
    writeback_waits: Option<u64>,
    /// The Redis node the run killed (tmem+remote-kill).
    killed_node: Option<KilledNode>,
    /// The backend's last sample as the jobs ended (the front's counters).
    last: PoolSample,
    /// Mean read time of the device below the front, µs, and the reads.
    backing_reads: Option<(f64, u64)>,
    /// The front's counters as the jobs ended.
    front_stats: Option<serde_json::Value>,
}

/// A Redis node a run killed.
#[derive(Clone, Debug, serde::Serialize)]
pub struct KilledNode {
    /// Seconds into the run.
    pub at_secs: f64,
    /// What was done.
    pub what: String,
}

/// Bytes in use in the swap areas `ours`, from /proc/swaps.
pub(crate) fn swap_used(ours: &[std::path::PathBuf]) -> u64 {
    tmem_sys::swap::swaps().unwrap_or_default().iter().filter(|a| ours.contains(&a.path)).map(|a| a.used).sum()
}

impl Ctx<'_> {
    /// A fresh memory cgroup for one run, limited to `limit`. Made before
    /// the backend's swap comes up, so that zswap+tmem can name it to the
    /// daemon (cgroup v2), whose zswap limit then wins over the `max` set here.
    fn run_cgroup(&mut self, limit: Option<u64>) -> anyhow::Result<MemCgroup> {
        let cg = MemCgroup::create(&self.layout, &self.cgroup_name)?;
        match cg.version() {
            Version::V1 => {
                if let Err(e) = cg.set_swappiness(self.args.swappiness) {
                    self.progress.note(&format!("note: {e}"));
                }
            }
            // zswap may use as much as it wants (its default), as on v1, where it is not charged at all.
            Version::V2 => match cg.set_zswap_max(None) {
                Ok(()) | Err(CgroupError::Unsupported { .. }) => {}
                Err(e) => return Err(e.into()),
            },
        }
        cg.set_limit(limit)?;
        Ok(cg)
    }

    /// Runs the workload once in `cg` (from [`Ctx::run_cgroup`], removed
    /// here), sampling `backend`'s pool. The tmem-run row's jobs run under
    /// `tmem run` with `budget` between them (the level's limit, which
    /// its cgroup then does not have).
    fn measure(
        &mut self,
        mut backend: Option<&mut Backend>,
        cg: MemCgroup,
        label: &str,
        budget: Option<u64>,
    ) -> anyhow::Result<Measured> {
        let ours = backend.as_deref().map(Backend::swap_paths).unwrap_or_default();
        let mut foreign = foreign_swap(&ours);
        let below = backend.as_deref().and_then(Backend::backing_dev);
        let reads_before = below.as_deref().and_then(BlockReads::of);
        let before = SwapCounters::now()?;
        let server = backend.as_deref().and_then(Backend::server_pid);
        let server_before = server.and_then(ProcessCpu::of_pid);
        let threads_before = server.and_then(ThreadsCpu::of_pid);
        let cpu_before = CpuTimes::now();
        // Only tmem refuses a swap write (its pool is full and no tier takes the page).
        let refusing = backend.as_deref().is_some_and(|b| matches!(b, Backend::Tmem(_)));
        // The daemon's counters as the run starts (tmem rows only).
        let daemon_before = backend.as_deref().filter(|_| refusing).map(Backend::sample);
        let failed_before = daemon_before.map(|s| s.failed_writes);
        let mut kill_at = self.kill_node_at;
        let mut killed_node = None;
        let start = Instant::now();
        let run = match backend.as_deref() {
            Some(Backend::TmemRun(r)) => budget.map(|b| (r, b)),
            _ => None,
        };
        let mut running = self.workload.spawn(&cg.procs_file(), run)?;
        let sample_every = Duration::from_millis(self.args.sample_ms.max(10));
        let mut next_sample = start;
        let mut next_swap_check = start;
        let mut peak = PoolSample::default();
        let mut pool_mean = TimeMean::default();
        let mut tier_peak_pages = 0;
        let mut samples = 0;
        let mut timed_out = false;
        loop {
            if running.poll()? {
                break;
            }
            if interrupted() {
                running.kill();
                return Err(anyhow!(INTERRUPTED_MSG));
            }
            if start.elapsed() > self.timeout {
                running.kill();
                timed_out = true;
                break;
            }
            let now = Instant::now();
            if now >= next_sample {
                next_sample = now + sample_every;
                if let Some(b) = backend.as_deref_mut() {
                    let s = b.sample();
                    samples += 1;
                    pool_mean.add(now, s.pool_bytes);
                    tier_peak_pages = tier_peak_pages.max(s.tier_pages);
                    if s.pool_bytes > peak.pool_bytes {
                        peak = s;
                    }
                    if kill_at.is_some_and(|at| s.tier_pages >= at) {
                        kill_at = None;
                        let what = b.kill_remote_node()?;
                        self.progress.note(&format!("{label}: {what} at {:.1} s", start.elapsed().as_secs_f64()));
                        killed_node = Some(KilledNode { at_secs: start.elapsed().as_secs_f64(), what });
                    }
                }
                self.progress.show(label, false);
            }
            if now >= next_swap_check {
                next_swap_check = now + Duration::from_secs(1);
                for f in foreign_swap(&ours) {
                    if !foreign.contains(&f) {
                        foreign.push(f);
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let wall = start.elapsed();
        let reads_after = below.as_deref().and_then(BlockReads::of);
        let cpu_after = CpuTimes::now();
        let daemon_cpu = server_before.zip(server.and_then(ProcessCpu::of_pid)).map(|(b, a)| a.since(&b));
        let daemon_threads = threads_before
            .zip(server.and_then(ThreadsCpu::of_pid))
            .map(|(b, a)| a.by_role_since(&b))
            .unwrap_or_default();
        let vmstat = SwapCounters::now()?.since(&before);
        let cpu = cpu_before.zip(cpu_after);
        let steal_percent = cpu.map_or(0.0, |(b, a)| a.steal_percent_since(&b));
        let machine_busy_secs = cpu.map(|(b, a)| a.busy_secs_since(&b));
        if let Some(hw) = backend.as_deref().and_then(Backend::pool_high_water) {
            peak.pool_bytes = peak.pool_bytes.max(hw);
        }
        let last = backend.as_deref().map(Backend::sample).unwrap_or_default();
        let front_stats = backend.as_deref().and_then(Backend::front_stats);
        let backing_reads = reads_before.zip(reads_after).and_then(|(b, a)| a.mean_since(&b));
        let refused_writes = failed_before.map(|b| last.failed_writes.saturating_sub(b));
        let writeback_waits = daemon_before.map(|b| last.writeback_waits.saturating_sub(b.writeback_waits));
        let tier_reads_per_page = daemon_before.and_then(|b| {
            let values = last.tier_values_read.saturating_sub(b.tier_values_read);
            let reads = last.tier_backing_reads.saturating_sub(b.tier_backing_reads);
            (values > 0 && reads > 0).then(|| reads as f64 / values as f64)
        });
        let after_exit = match backend.as_deref() {
            Some(b) if !timed_out && !ours.is_empty() => {
                let secs = self.args.after_exit_secs;
                self.progress.show(&format!("{label}: pool {secs} s after the jobs exit"), false);
                std::thread::sleep(Duration::from_secs(secs));
                Some((b.sample(), swap_used(&ours)))
            }
            _ => None,
        };
        let m = Measured {
            wall,
            timed_out,
            vmstat,
            peak,
            pool_mean_bytes: pool_mean.mean(),
            tier_peak_pages,
            samples,
            max_usage: cg.max_usage()?,
            failcnt: cg.failcnt()?,
            oom_kills: cg.oom_control()?.oom_kill,
            steal_percent,
            daemon_cpu,
            daemon_threads,
            machine_busy_secs,
            jobs: running.results(),
            foreign,
            after_exit,
            refused_writes,
            tier_reads_per_page,
            writeback_waits,
            killed_node,
            last,
            backing_reads,
            front_stats,
        };
        drop(running);
        cg.remove()?;
        Ok(m)
    }

    /// Classifies a run against the reference output.
    fn outcome(&self, m: &Measured) -> (Outcome, Option<String>) {
        classify(&self.expected, m)
    }

    /// Waits (up to 15 minutes) until no swap area other than `ours` is active,
    /// unless other swap is allowed.
    fn wait_for_other_swap(&mut self, ours: &[PathBuf], label: &str) -> anyhow::Result<()> {
        if self.args.allow_other_swap {
            return Ok(());
        }
        let deadline = Instant::now() + Duration::from_secs(900);
        let mut said = false;
        loop {
            let foreign = foreign_swap(ours);
            if foreign.is_empty() {
                return Ok(());
            }
            if interrupted() {
                return Err(anyhow!(INTERRUPTED_MSG));
            }
            if Instant::now() > deadline {
                return Err(anyhow!("other swap areas stayed active for 15 minutes: {}", foreign.join(", ")));
            }
            if !said {
                self.progress.note(&format!(
                    "{label}: waiting for other swap areas to go away ({}; someone else's test?)",
                    foreign.join(", ")
                ));
                said = true;
            }
            self.progress.show(&format!("{label}: waiting for other swap to go away"), false);
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// One run of `backend` at `level`, repeated (up to 3 times) while other
    /// swap areas appear during it, unless other swap is allowed.
    fn run_one(
        &mut self,
        backend: &mut Backend,
        name: &str,
        level: u32,
        run: u32,
        peak: u64,
    ) -> anyhow::Result<RunRecord> {
        let label = format!("{name}@{} run {run}", report::level_title(level));
        let mut attempt = 1;
        loop {
            self.wait_for_other_swap(&backend.swap_paths(), &label)?;
            self.progress.show(&label, true);
            let r = self.attempt(backend, name, level, run, peak, &label)?;
            if r.foreign_swap.is_empty() || self.args.allow_other_swap || attempt == 3 {
                return Ok(r);
            }
            self.progress.note(&format!(
                "{label}: other swap areas were active during the run ({}); repeating it",
                r.foreign_swap.join(", ")
            ));
            attempt += 1;
        }
    }

    /// One run: fresh swap area, workload, teardown.
    fn attempt(
        &mut self,
        backend: &mut Backend,
        name: &str,
        level: u32,
        run: u32,
        peak: u64,
        label: &str,
    ) -> anyhow::Result<RunRecord> {
        let limit = limit_for(level, peak);
        // tmem run keeps the jobs within the limit itself; their cgroup only counts.
        let under_run = matches!(backend, Backend::TmemRun(_));
        let cg = self.run_cgroup(if under_run { None } else { limit })?;
        backend.set_run_cgroup((cg.version() == Version::V2).then(|| cg.path()));
        let t = Instant::now();
        if let Err(e) = backend.activate() {
            if let Err(d) = backend.deactivate() {
                return Err(anyhow!("{e}; then, undoing it: {d}"));
            }
            return Err(e);
        }
        let setup_secs = t.elapsed().as_secs_f64();
        let counters_before = backend.counters();
        self.kill_node_at = (name == BackendKind::TmemRemoteKill.name()).then_some(self.args.kill_node_at_tier_pages);
        let measured = self.measure(Some(&mut *backend), cg, label, limit);
        let counters = backend.counters().map(|after| counter_deltas(counters_before.as_ref(), &after));
        let t = Instant::now();
        let down = backend.deactivate();
        let teardown_secs = t.elapsed().as_secs_f64();
        let m = measured?;
        down?;
        let (outcome, message) = self.outcome(&m);
        let mut r = RunRecord {
            backend: name.to_owned(),
            level,
            limit_bytes: limit,
            run,
            outcome,
            wall_secs: m.wall.as_secs_f64(),
            vmstat: m.vmstat,
            pool_peak_bytes: m.peak.pool_bytes,
            pool_stored_bytes_at_peak: m.peak.stored_bytes,
            pool_mean_bytes: m.pool_mean_bytes,
            tier_peak_pages: m.tier_peak_pages,
            pool_after_exit_bytes: m.after_exit.map(|(s, _)| s.pool_bytes),
            swap_used_after_exit_bytes: m.after_exit.map(|(_, u)| u),
            refused_writes: m.refused_writes,
            tier_reads_per_page: m.tier_reads_per_page,
            writeback_waits: m.writeback_waits,
            killed_node: m.killed_node.clone(),
            front: backend_has_front(name).then(|| report::FrontRecord {
                pool_bytes_at_peak: m.peak.front_pool_bytes,
                written_back_pages: m.last.written_back,
                read_back_pages: m.last.read_back,
                read_back_mean_us: m.backing_reads.map(|(us, _)| us),
                backing_reads: m.backing_reads.map_or(0, |(_, n)| n),
                stats: m.front_stats.clone(),
            }),
            pool_samples: m.samples,
            cgroup_max_usage_bytes: m.max_usage,
            cgroup_failcnt: m.failcnt,
            oom_kills: m.oom_kills,
            cpu_steal_percent: m.steal_percent,
            cpu: report::RunCpu::default(),
            daemon_threads: m.daemon_threads.clone(),
            setup_secs,
            teardown_secs,
            jobs: m.jobs,
            message,
            foreign_swap: m.foreign,
            backend_counters: counters,
        };
        r.set_cpu(m.daemon_cpu, m.machine_busy_secs, self.reference_busy_secs);
        if self.kill_node_at.is_some() && r.killed_node.is_none() {
            r.message = Some(format!(
                "no Redis node was killed: the tier never held {} pages",
                self.args.kill_node_at_tier_pages
            ));
        }
        Ok(r)
    }
}

/// Whether the row `name` has a front.
fn backend_has_front(name: &str) -> bool {
    backend::FRONT_ROWS.contains(&name)
}

/// How a run ended, given the reference outputs: a wrong checksum beats
/// everything (it must never go unnoticed), then OOM kills, timeouts, other failures.
fn classify(expected: &[String], m: &Measured) -> (Outcome, Option<String>) {
    let wrong: Vec<String> = m
        .jobs
        .iter()
        .zip(expected)
        .filter(|(j, want)| j.code == Some(0) && j.output != **want)
        .map(|(j, want)| format!("job seed {}: got {:?}, expected {want:?}", j.seed, j.output))
        .collect();
    if !wrong.is_empty() {
        return (Outcome::Wrong, Some(wrong.join("; ")));
    }
    if m.oom_kills > 0 {
        return (Outcome::Oom, Some(format!("the OOM killer killed {} task(s)", m.oom_kills)));
    }
    if m.timed_out {
        return (Outcome::Timeout, Some(format!("killed after {:.0} s", m.wall.as_secs_f64())));
    }
    let failed: Vec<String> = m
        .jobs
        .iter()
        .filter(|j| j.code != Some(0))
        .map(|j| format!("job seed {}: exit {:?} signal {:?}: {}", j.seed, j.code, j.signal, j.stderr_tail))
        .collect();
    if !failed.is_empty() {
        return (Outcome::Fail, Some(failed.join("; ")));
    }
    (Outcome::Ok, None)
}

/// memory.limit_in_bytes for a level (None: no limit), page aligned.
fn limit_for(level: u32, peak: u64) -> Option<u64> {
    (level < 100).then(|| u64::try_from(u128::from(peak) * u128::from(level) / 100).unwrap_or(u64::MAX) & !4095)
}

/// Active swap areas that are not `ours`.
pub(crate) fn foreign_swap(ours: &[PathBuf]) -> Vec<String> {
    swap::swaps()
        .map(|v| v.into_iter().filter(|a| !ours.contains(&a.path)).map(|a| a.path.display().to_string()).collect())
        .unwrap_or_default()
}

fn counter_deltas(
    before: Option<&std::collections::BTreeMap<String, u64>>,
    after: &std::collections::BTreeMap<String, u64>,
) -> std::collections::BTreeMap<String, u64> {
    after
        .iter()
        .map(|(k, v)| {
            // Gauges (pool sizes, stored pages) are kept as they are; counters become deltas.
            let gauge = k.contains("size") || k.contains("stored") || k.contains("same_filled");
            let d = if gauge { *v } else { v.saturating_sub(before.and_then(|b| b.get(k)).copied().unwrap_or(0)) };
            (k.clone(), d)
        })
        .collect()
}

/// Rounds up to a multiple of 64 MiB.
fn round_up_64m(b: u64) -> u64 {
    const M: u64 = 64 << 20;
    b.div_ceil(M) * M
}

fn preflight(a: &PressureArgs) -> anyhow::Result<Layout> {
    if !tmem_sys::is_root() {
        return Err(anyhow!("tmem bench pressure needs root (memory cgroups, swapon, zram, zswap)"));
    }
    if a.levels.is_empty() || a.levels.iter().any(|l| *l == 0 || *l > 100) {
        return Err(anyhow!("--levels must be percentages in 1..=100 (100 = no limit)"));
    }
    if a.backends.is_empty() {
        return Err(anyhow!("--backends is empty"));
    }
    if a.runs == 0 {
        return Err(anyhow!("--runs must be at least 1"));
    }
    let mut seen = a.backends.clone();
    seen.sort();
    seen.dedup();
    if seen.len() != a.backends.len() {
        return Err(anyhow!("--backends lists a backend twice"));
    }
    refuse_other_swap(a.allow_other_swap)?;
    cmd(&a.python, &["-c", "import sys; assert sys.version_info >= (3, 6)"])
        .map_err(|e| anyhow!("the workload needs Python 3 ({}): {e}", a.python))?;
    for b in &a.backends {
        match b {
            BackendKind::Zram => {
                // Hot-adds a device, reads what it offers, removes it.
                let algs = zram::probe().map_err(|e| anyhow!("zram backend: {e}"))?;
                if !algs.contains(&a.zram_algorithm) {
                    return Err(anyhow!(
                        "zram backend: zram does not offer {} (it offers {})",
                        a.zram_algorithm,
                        algs.join(", ")
                    ));
                }
            }
            BackendKind::Zswap if !zswap::available() => {
                return Err(anyhow!("zswap backend: this kernel has no zswap"))
            }
            BackendKind::TmemRemote | BackendKind::TmemRemoteKill if crate::redis::redis_server_binary().is_none() => {
                return Err(anyhow!("tmem+remote backend: redis-server is not installed (apt install redis-server)"));
            }
            BackendKind::Disk | BackendKind::Zswap | BackendKind::TmemDisk | BackendKind::ZramDisk
                if !a.swap_dir.is_dir() =>
            {
                return Err(anyhow!("--swap-dir {} is not a directory", a.swap_dir.display()));
            }
            _ => {}
        }
    }
    let remote = a.backends.iter().any(|b| matches!(b, BackendKind::TmemRemote | BackendKind::TmemRemoteKill));
    if remote && a.net != NetProfile::Loopback {
        cmd("ip", &["netns", "list"]).map_err(|e| anyhow!("--net {}: needs ip (iproute2): {e}", a.net.describe()))?;
        cmd("tc", &["-V"]).map_err(|e| anyhow!("--net {}: needs tc (iproute2): {e}", a.net.describe()))?;
    }
    let on_disk = a
        .backends
        .iter()
        .any(|b| matches!(b, BackendKind::Disk | BackendKind::Zswap | BackendKind::TmemDisk | BackendKind::ZramDisk));
    if on_disk && a.disk_profile != DiskProfile::Host && crate::cache::setup::blkio_root().is_none() {
        return Err(anyhow!(
            "--disk-profile {:?} needs the cgroup v1 blkio hierarchy (it throttles at its root); not built for cgroup v2",
            a.disk_profile
        ));
    }
    let layout = Layout::detect()?;
    layout.ensure_memory_controller()?;
    Ok(layout)
}

/// Refuses to run while other swap areas are active (they would take
/// pages in every run), unless `allowed`.
pub(crate) fn refuse_other_swap(allowed: bool) -> anyhow::Result<()> {
    let areas = swap::swaps()?;
    if !areas.is_empty() && !allowed {
        let list: Vec<String> = areas.iter().map(|s| s.path.display().to_string()).collect();
        return Err(anyhow!(
            "other swap areas are active ({}); they would take pages in every run. \
             swapoff them first, or pass --allow-other-swap",
            list.join(", ")
        ));
    }
    Ok(())
}

/// A bench's end: an error if it was interrupted or anything failed.
pub(crate) fn bench_result(errors: &[String]) -> anyhow::Result<()> {
    if interrupted() {
        return Err(anyhow!(INTERRUPTED_MSG));
    }
    if !errors.is_empty() {
        return Err(anyhow!("{} error(s): {}", errors.len(), errors.join("; ")));
    }
    Ok(())
}

/// Turns zswap off if it is on; the returned guard turns it back on.
pub(crate) fn zswap_off() -> anyhow::Result<Option<zswap::ZswapSettings>> {
    if !zswap::available() {
        return Ok(None);
    }
    let mut s = zswap::ZswapSettings::save()?;
    if !zswap::is_on(&s.get("enabled")?) {
        return Ok(None);
    }
    s.set("enabled", "N")?;
    tracing::info!("zswap was enabled; it is disabled during the bench and re-enabled afterwards");
    Ok(Some(s))
}

/// The JSON file.
#[derive(serde::Serialize)]
struct JsonOut<'a> {
    tool: &'static str,
    args: &'a PressureArgs,
    kernel: String,
    /// `v2`, `v1` or `hybrid`: the workload's group is made in the memory hierarchy.
    cgroup_layout: &'static str,
    cpus: usize,
    mem_total_bytes: u64,
    peak_bytes: u64,
    swap_size_bytes: u64,
    /// The zram device hot-added for the zram rows (removed since).
    #[serde(skip_serializing_if = "Option::is_none")]
    zram_device: Option<String>,
    /// The Redis nodes' network path.
    net: String,
    /// Whether its delay was applied (None: loopback).
    net_delay_applied: Option<bool>,
    /// The disk behind the disk rows.
    disk: String,
    /// Runs that swapped fewer pages than this get no per-page CPU figures.
    min_swapped_pages_for_cpu_per_page: u64,
    /// % of each job's heap built first and left alone by its passes.
    cold_share_percent: u32,
    /// The front rows' budget and policy (where one ran).
    #[serde(skip_serializing_if = "Option::is_none")]
    front: Option<&'a front::FrontConfig>,
    /// Rows not run, and why (zram without writeback).
    skipped: &'a [Skipped],
    reference: &'a RunRecord,
    runs: &'a [RunRecord],
    summary: &'a [report::Summary],
    errors: &'a [String],
}

/// `tmem bench pressure`.
pub fn run(a: &PressureArgs) -> anyhow::Result<()> {
    let layout = preflight(a)?;
    install_signal_handlers()?;
    // zswap, if on, would sit in front of every backend: off for the bench (restored on drop).
    let _zswap_off = zswap_off()?;
    let pid = std::process::id();
    let workload = Workload::install(
        &std::env::temp_dir().join(format!("tmem-bench-{pid}")),
        &a.python,
        a.workload_mib,
        a.jobs,
        a.passes,
        a.cold_share,
    )?;
    // Rows this kernel cannot run (zram without writeback) are skipped, with the reason.
    let available = Availability::probe(&a.backends);
    let skipped: Vec<Skipped> = available.skipped(&a.backends);
    let kinds: Vec<BackendKind> =
        a.backends.iter().copied().filter(|k| !skipped.iter().any(|s| s.backend == k.name())).collect();
    for s in &skipped {
        println!("{s}");
    }
    let total = 1 + kinds.len() * a.levels.len() * usize::try_from(a.runs).unwrap_or(usize::MAX);
    let mut ctx = Ctx {
        args: a,
        workload,
        cgroup_name: format!("tmem-bench-{pid}"),
        layout,
        expected: Vec::new(),
        timeout: Duration::from_secs(if a.timeout > 0 { a.timeout } else { 3600 }),
        progress: Progress::new(total),
        reference_busy_secs: None,
        kill_node_at: None,
    };

    // Reference run: no limit, no swap of ours; gives the peak and the checksums.
    ctx.progress.show("reference run (no limit, no swap)", true);
    let cg = ctx.run_cgroup(None)?;
    let m = ctx.measure(None, cg, "reference run", None)?;
    if m.timed_out || m.oom_kills > 0 || m.jobs.iter().any(|j| j.code != Some(0) || j.output.is_empty()) {
        return Err(anyhow!("the reference run failed: {:?}", m.jobs));
    }
    ctx.expected = m.jobs.iter().map(|j| j.output.clone()).collect();
    let peak = m.max_usage;
    if a.timeout == 0 {
        ctx.timeout = Duration::from_secs_f64((m.wall.as_secs_f64() * 20.0).max(300.0));
    }
    let mut reference = RunRecord {
        backend: "none".into(),
        level: 100,
        limit_bytes: None,
        run: 1,
        outcome: Outcome::Ok,
        wall_secs: m.wall.as_secs_f64(),
        vmstat: m.vmstat,
        pool_peak_bytes: 0,
        pool_stored_bytes_at_peak: 0,
        pool_mean_bytes: None,
        tier_peak_pages: 0,
        pool_after_exit_bytes: None,
        swap_used_after_exit_bytes: None,
        refused_writes: None,
        tier_reads_per_page: None,
        writeback_waits: None,
        killed_node: None,
        front: None,
        pool_samples: 0,
        cgroup_max_usage_bytes: m.max_usage,
        cgroup_failcnt: m.failcnt,
        oom_kills: 0,
        cpu_steal_percent: m.steal_percent,
        cpu: report::RunCpu::default(),
        daemon_threads: vec![],
        setup_secs: 0.0,
        teardown_secs: 0.0,
        jobs: m.jobs,
        message: None,
        foreign_swap: m.foreign,
        backend_counters: None,
    };
    reference.set_cpu(None, m.machine_busy_secs, m.machine_busy_secs);
    ctx.reference_busy_secs = m.machine_busy_secs;
    ctx.progress.steps_done(1);
    let swap_size = round_up_64m(peak);
    ctx.progress.note(&format!(
        "reference run: {:.1} s, peak {} (memory.max_usage_in_bytes), {} job(s) of {} MiB; swap areas of {}",
        reference.wall_secs,
        tmem_daemon::human(peak),
        a.jobs,
        ctx.workload.mib_per_job,
        tmem_daemon::human(swap_size)
    ));

    let cfg = BackendConfig {
        zram_algorithm: a.zram_algorithm.clone(),
        zswap_compressor: a.zswap_compressor.clone(),
        zswap_max_pool_percent: a.zswap_max_pool_percent,
        tmem_pool_limit: a.tmem_pool_limit.clone(),
        tmem_codec: a.tmem_codec.clone(),
        tmem_read_ahead: a.tmem_read_ahead,
        tmem_fuse_uring: a.tmem_fuse_uring,
        tmem_fuse_threads: a.tmem_fuse_threads,
        tmem_recompress: (a.tmem_recompress.clone(), a.tmem_recompress_after),
        tmem_discard: a.tmem_discard,
        tmem_tier_pool_limit: a.tmem_tier_pool_limit.clone(),
        disk_profile: a.disk_profile,
        net_profile: a.net,
        front: a.front.config(peak),
        ..BackendConfig::new(swap_size, &a.swap_dir)
    };
    let mut runs: Vec<RunRecord> = Vec::new();
    let mut errors: Vec<String> = Vec::new();
    let mut zram_device = None;
    let mut net_delay_applied = None;
    'backends: for &kind in &kinds {
        if interrupted() {
            break;
        }
        let name = kind.name();
        ctx.progress.show(&format!("{name}: preparing"), true);
        let mut backend = match Backend::prepare(kind, &cfg) {
            Ok(b) => {
                zram_device = zram_device.or_else(|| b.zram_device());
                net_delay_applied = net_delay_applied.or_else(|| b.net_delay_applied());
                b
            }
            Err(e) => {
                ctx.progress.note(&format!("{name}: cannot prepare: {e}"));
                errors.push(format!("{name}: {e}"));
                ctx.progress.steps_done(a.levels.len() * usize::try_from(a.runs).unwrap_or(0));
                continue;
            }
        };
        for &level in &a.levels {
            for run in 1..=a.runs {
                match ctx.run_one(&mut backend, name, level, run, peak) {
                    Ok(r) => {
                        if r.outcome == Outcome::Wrong {
                            ctx.progress.note(&format!(
                                "!!! WRONG OUTPUT: {name}@{}% run {run}: {}",
                                level,
                                r.message.as_deref().unwrap_or("")
                            ));
                        } else if r.outcome != Outcome::Ok {
                            ctx.progress.note(&format!(
                                "{name}@{}: run {run}: {} ({})",
                                report::level_title(level),
                                r.outcome.marker(),
                                r.message.as_deref().unwrap_or("")
                            ));
                        }
                        runs.push(r);
                    }
                    Err(e) => {
                        ctx.progress.note(&format!("{name}@{}: run {run}: error: {e}", report::level_title(level)));
                        errors.push(format!("{name}@{level}% run {run}: {e}"));
                        if interrupted() {
                            break 'backends;
                        }
                        // The backend may be in a bad state: give up on it.
                        if let Err(e) = backend.finish() {
                            errors.push(format!("{name}: cleanup: {e}"));
                        }
                        continue 'backends;
                    }
                }
                ctx.progress.steps_done(1);
            }
        }
        ctx.progress.show(&format!("{name}: cleaning up"), true);
        if let Err(e) = backend.finish() {
            ctx.progress.note(&format!("{name}: cleanup: {e}"));
            errors.push(format!("{name}: cleanup: {e}"));
        }
    }
    ctx.progress.finish();

    let names: Vec<&str> = kinds.iter().map(|b| b.name()).collect();
    let summary = report::summarize(&runs, &names, &a.levels);
    let shown = Shown { zram_device: zram_device.as_deref(), net_delay_applied, front: &cfg.front, skipped: &skipped };
    print_report(a, &ctx.layout, &reference, peak, &runs, &summary, &names, &shown);
    if let Some(path) = &a.plot {
        plot(path, a, &summary, &names)?;
        println!("figures: {}", path.display());
    }
    if let Some(path) = &a.json {
        let out = JsonOut {
            tool: "tmem bench pressure",
            args: a,
            kernel: cmd("uname", &["-r"]).unwrap_or_default(),
            cgroup_layout: ctx.layout.name(),
            cpus: std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
            mem_total_bytes: swap::total_ram_bytes().unwrap_or(0),
            peak_bytes: peak,
            swap_size_bytes: swap_size,
            zram_device,
            net: a.net.describe(),
            net_delay_applied,
            disk: a.disk_profile.describe(),
            min_swapped_pages_for_cpu_per_page: report::MIN_SWAPPED_PAGES,
            cold_share_percent: a.cold_share,
            front: kinds.iter().any(|k| k.has_front()).then_some(&cfg.front),
            skipped: &skipped,
            reference: &reference,
            runs: &runs,
            summary: &summary,
            errors: &errors,
        };
        let text = serde_json::to_string_pretty(&out)?;
        std::fs::write(path, text + "\n").map_err(|e| anyhow!("{}: {e}", path.display()))?;
        println!("raw runs written to {}", path.display());
    }
    let wrong = runs.iter().filter(|r| r.outcome == Outcome::Wrong).count();
    if wrong > 0 {
        return Err(anyhow!("{wrong} run(s) produced WRONG output: data was corrupted under memory pressure"));
    }
    bench_result(&errors)
}

/// What the report says besides the runs.
struct Shown<'a> {
    zram_device: Option<&'a str>,
    net_delay_applied: Option<bool>,
    front: &'a front::FrontConfig,
    skipped: &'a [Skipped],
}

/// The report's first line: the job, its cold share and its peak.
fn headline(a: &PressureArgs, peak: u64, wall_secs: f64) -> String {
    let cold = match a.cold_share {
        0 => "cold share 0 % (every record touched at every pass)".to_owned(),
        n => format!("cold share {n} % (built first, untouched until the checksum)"),
    };
    format!(
        "tmem bench pressure: workload {} MiB in {} job(s), {} pass(es), {cold}; measured peak {} in {:.1} s (no limit, no swap)",
        a.workload_mib,
        a.jobs,
        a.passes,
        tmem_daemon::human(peak),
        wall_secs
    )
}

#[allow(clippy::too_many_arguments)]
fn print_report(
    a: &PressureArgs,
    layout: &Layout,
    reference: &RunRecord,
    peak: u64,
    runs: &[RunRecord],
    summary: &[report::Summary],
    names: &[&str],
    shown: &Shown<'_>,
) {
    let (zram_device, net_delay_applied) = (shown.zram_device, shown.net_delay_applied);
    println!("{}", headline(a, peak, reference.wall_secs));
    println!(
        "backends: disk = swap file in {} (prio {}); zram = /dev/{} (hot-added for the bench) {} (prio {}); \
         zswap = {} max_pool_percent {} over the disk file; \
         tmem = tmem swap up --codec {} --pool-limit {} --fuse-uring {} --fuse-threads {} --discard {} (prio {}). \
         {} run(s) per cell.",
        a.swap_dir.display(),
        backend::DISK_PRIORITY,
        zram_device.unwrap_or("zramN"),
        a.zram_algorithm,
        backend::RAM_PRIORITY,
        a.zswap_compressor,
        a.zswap_max_pool_percent,
        a.tmem_codec,
        a.tmem_pool_limit,
        a.tmem_fuse_uring,
        backend::fuse_threads(a.tmem_fuse_threads),
        a.tmem_discard.as_str(),
        backend::RAM_PRIORITY,
        a.runs
    );
    if names.contains(&"tmem+recomp") {
        println!(
            "tmem+recomp = tmem with --recompress {} --recompress-after {}: cold pages recompressed in the background.",
            a.tmem_recompress, a.tmem_recompress_after
        );
    }
    if names.iter().any(|n| n.starts_with("tmem+remote")) {
        let delay = match net_delay_applied {
            Some(false) => " (THE DELAY IS NOT APPLIED: this kernel has no sch_netem; the rate is, with tbf)",
            _ => "",
        };
        println!(
            "tmem+remote = pool of {} over {} redis-server nodes, every page on {}; network: {}{delay}.",
            a.tmem_tier_pool_limit,
            backend::REMOTE_NODES,
            backend::REMOTE_REPLICAS,
            a.net.describe()
        );
    }
    if names.contains(&"tmem+remote-kill") {
        println!(
            "tmem+remote-kill = tmem+remote, and one node is killed once the tier holds {} pages.",
            a.kill_node_at_tier_pages
        );
        for r in runs.iter().filter(|r| r.backend == "tmem+remote-kill") {
            match &r.killed_node {
                Some(k) => println!("  {}% run {}: {} at {:.1} s", r.level, r.run, k.what, k.at_secs),
                None => println!("  {}% run {}: no node killed", r.level, r.run),
            }
        }
    }
    if names.iter().any(|n| ["disk", "zswap", "tmem+disk"].contains(n)) {
        println!("disk: {}.", a.disk_profile.describe());
    }
    if names.contains(&"fuse-ram") {
        println!(
            "fuse-ram = tmem's FUSE + loop swap path over plain RAM, served by the bench (no compression, no store; \
             prio {}): what the path itself costs.",
            backend::RAM_PRIORITY
        );
    }
    if names.contains(&"tmem-run") {
        println!(
            "tmem-run = each job under tmem run --memory (limit / {}) --codec {}{}: userfaultfd, no swap; the jobs' \
             cgroup has no limit and holds the tmem run helpers, their pools included; pool = their pools.",
            a.jobs,
            a.tmem_codec,
            a.tmem_read_ahead.map(|n| format!(" --read-ahead {n}")).unwrap_or_default()
        );
    }
    if names.iter().any(|n| backend_has_front(n)) {
        println!("front rows, one policy: {}.", shown.front.describe());
        if names.contains(&"zram+tmem") {
            println!(
                "zram+tmem = tmem swap up --front zram (zram {} in front, tmem's device its backing device); \
                 pool = zram's + tmem's.",
                a.zram_algorithm
            );
        }
        if names.contains(&"zram+disk") {
            println!(
                "zram+disk = a zram device ({}) of the bench's, writing back to a loop device over a file in {} \
                 ({}), the same policy run by the bench; pool = zram's.",
                a.zram_algorithm,
                a.swap_dir.display(),
                a.disk_profile.describe()
            );
        }
        if names.contains(&"zswap+tmem") {
            println!(
                "zswap+tmem = tmem swap up --front zswap (zswap {} in front of tmem's device{}); pool = zswap's + tmem's.",
                a.zswap_compressor,
                if layout.memory_hierarchy().1 == Version::V2 {
                    ", --front-cgroup the run's cgroup"
                } else {
                    "; cgroup v1: no per-cgroup zswap limit, only max_pool_percent"
                }
            );
        }
    }
    println!();
    print!("{}", report::render_table(summary, names, &a.levels));
    for s in shown.skipped {
        println!("{s}");
    }
    println!();
    let (_, version) = layout.memory_hierarchy();
    println!("cgroups: {} layout; the workload's group is a cgroup {version:?} memory group.", layout.name());
    if names.contains(&"zswap") && version == Version::V2 {
        println!(
            "note: on cgroup v2 zswap charges its compressed pool to the workload's memory cgroup \
             (memory.zswap.max = max), so zswap's pool counts against the limit; zram's is uncharged kernel \
             memory and tmem's belongs to its daemon outside the workload's cgroup."
        );
    } else if names.contains(&"zswap") {
        println!(
            "note: zswap charges its compressed pool to the workload's memory cgroup only on cgroup v2 \
             (obj_cgroup_charge_zswap() returns early on v1); with the v1 controller used here no backend's pool \
             counts against the limit: zram's is uncharged kernel memory, tmem's belongs to its daemon in the root \
             cgroup, zswap's is uncharged too."
        );
    } else {
        println!(
            "note: no backend's pool counts against the workload's limit: zram's is uncharged kernel memory, \
             tmem's belongs to its daemon in the root cgroup{}{}.",
            if names.contains(&"fuse-ram") { ", fuse-ram's to the bench process" } else { "" },
            if names.contains(&"tmem-run") {
                "; tmem-run's jobs have no limit, tmem run keeps them within it"
            } else {
                ""
            }
        );
    }
    println!(
        "note: pswpout/pswpin are system-wide /proc/vmstat deltas over each run; pages zswap keeps count as zswpout/zswpin."
    );
    println!();
    print!("{}", report::render_cpu_runs(reference, runs));
    let steal: Vec<f64> = runs.iter().map(|r| r.cpu_steal_percent).collect();
    if let Some(med) = crate::median(steal.clone()) {
        println!(
            "note: CPU steal (time the hypervisor gave to other guests) per run: median {med:.1}%, max {:.1}% \
             (reference run {:.1}%); wall times from runs with high steal are not comparable.",
            steal.iter().copied().fold(0.0, f64::max),
            reference.cpu_steal_percent
        );
    }
    for r in runs.iter().filter(|r| r.outcome != Outcome::Ok) {
        println!(
            "{} {}@{} run {}: {}",
            if r.outcome == Outcome::Wrong { "!!! WRONG:" } else { r.outcome.marker() },
            r.backend,
            report::level_title(r.level),
            r.run,
            r.message.as_deref().unwrap_or("")
        );
    }
    let foreign: Vec<&RunRecord> = runs.iter().filter(|r| !r.foreign_swap.is_empty()).collect();
    if !foreign.is_empty() {
        println!(
            "warning: {} run(s) had other swap areas active: {}",
            foreign.len(),
            foreign[0].foreign_swap.join(", ")
        );
    }
}

/// The figures of the ladder: a panel per figure, a line per backend, over the levels.
fn plot(path: &Path, a: &PressureArgs, summary: &[report::Summary], names: &[&str]) -> anyhow::Result<()> {
    use crate::plot::{Figure, Panel, Series};
    type Value = fn(&report::Summary) -> Option<f64>;
    let panel = |title: &str, y_label: &str, f: Value| {
        Figure::Lines(Panel {
            title: title.into(),
            x_label: "memory limit, % of the peak".into(),
            y_label: y_label.into(),
            series: names
                .iter()
                .map(|b| Series {
                    name: (*b).to_owned(),
                    points: a
                        .levels
                        .iter()
                        .map(|&l| {
                            let y = summary.iter().find(|s| s.backend == *b && s.level == l).and_then(f);
                            (f64::from(l), y)
                        })
                        .collect(),
                })
                .collect(),
        })
    };
    let panels = [
        panel("wall time (median of correct runs)", "s", |s| s.median_wall_secs),
        panel("machine CPU per swapped page, above the reference run", "us", |s| {
            s.median_machine_cpu_us_per_swapped_page_above_reference
        }),
        panel("peak pool memory", "MiB", |s| s.median_pool_peak_mib),
    ];
    let caption = format!(
        "tmem bench pressure: {} MiB workload, {} job(s), cold share {} %",
        a.workload_mib, a.jobs, a.cold_share
    );
    crate::plot::draw(path, &caption, &panels)
}

#[cfg(test)]
mod tests {
    use super::*;
    use workload::JobResult;

    fn job(code: Option<i32>, signal: Option<i32>, out: &str) -> JobResult {
        JobResult { seed: 1, code, signal, output: out.into(), stderr_tail: String::new() }
    }

    #[test]
    fn the_mean_over_time_weighs_each_sample_by_how_long_it_held() {
        let t0 = Instant::now();
        let mut m = TimeMean::default();
        m.add(t0, 100);
        assert_eq!(m.mean(), None, "one sample spans no time");
        m.add(t0 + Duration::from_secs(3), 400);
        m.add(t0 + Duration::from_secs(4), 0);
        // 100 for 3 s, 400 for 1 s: 700 / 4.
        assert_eq!(m.mean(), Some(175));
    }

    fn measured(jobs: Vec<JobResult>, oom: u64, timed_out: bool) -> Measured {
        Measured {
            wall: Duration::from_secs(3),
            timed_out,
            vmstat: SwapCounters::default(),
            peak: PoolSample::default(),
            pool_mean_bytes: None,
            tier_peak_pages: 0,
            samples: 0,
            max_usage: 0,
            failcnt: 0,
            oom_kills: oom,
            steal_percent: 0.0,
            daemon_cpu: None,
            daemon_threads: vec![],
            machine_busy_secs: None,
            jobs,
            foreign: vec![],
            after_exit: None,
            refused_writes: None,
            tier_reads_per_page: None,
            writeback_waits: None,
            killed_node: None,
            last: PoolSample::default(),
            backing_reads: None,
            front_stats: None,
        }
    }

    #[test]
    fn runs_are_classified() {
        let exp = vec!["checksum a".to_owned(), "checksum b".to_owned()];
        let ok = measured(vec![job(Some(0), None, "checksum a"), job(Some(0), None, "checksum b")], 0, false);
        assert_eq!(classify(&exp, &ok).0, Outcome::Ok);
        let wrong = measured(vec![job(Some(0), None, "checksum a"), job(Some(0), None, "checksum X")], 1, false);
        assert_eq!(classify(&exp, &wrong).0, Outcome::Wrong, "wrong output wins over OOM");
        let oom = measured(vec![job(None, Some(9), ""), job(Some(0), None, "checksum b")], 1, false);
        assert_eq!(classify(&exp, &oom).0, Outcome::Oom);
        let t = measured(vec![job(None, Some(9), ""), job(None, Some(9), "")], 0, true);
        assert_eq!(classify(&exp, &t).0, Outcome::Timeout);
        let f = measured(vec![job(Some(1), None, ""), job(Some(0), None, "checksum b")], 0, false);
        let (o, msg) = classify(&exp, &f);
        assert_eq!(o, Outcome::Fail);
        assert!(msg.unwrap().contains("exit Some(1)"));
    }

    #[test]
    fn limits_and_sizes() {
        assert_eq!(limit_for(100, 1 << 30), None);
        assert_eq!(limit_for(50, 1 << 30), Some(1 << 29));
        assert_eq!(limit_for(35, 1_000_000_000), Some(349_999_104));
        assert_eq!(round_up_64m(1), 64 << 20);
        assert_eq!(round_up_64m(64 << 20), 64 << 20);
        assert_eq!(round_up_64m((64 << 20) + 1), 128 << 20);
    }

    #[test]
    fn counter_deltas_keep_gauges() {
        let b: std::collections::BTreeMap<String, u64> =
            [("pool_total_size".to_owned(), 100), ("reject_alloc_fail".to_owned(), 5)].into_iter().collect();
        let a: std::collections::BTreeMap<String, u64> =
            [("pool_total_size".to_owned(), 50), ("reject_alloc_fail".to_owned(), 7), ("new".to_owned(), 1)]
                .into_iter()
                .collect();
        let d = counter_deltas(Some(&b), &a);
        assert_eq!(d["pool_total_size"], 50);
        assert_eq!(d["reject_alloc_fail"], 2);
        assert_eq!(d["new"], 1);
    }

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: PressureArgs,
    }

    #[test]
    fn the_cold_share_is_an_argument_in_the_header_and_the_json() {
        use clap::Parser;
        let a = Cli::parse_from(["pressure"]).args;
        assert_eq!(a.cold_share, 0, "the default job is today's uniform one");
        assert!(headline(&a, 1 << 30, 12.0).contains("cold share 0 %"), "{}", headline(&a, 1 << 30, 12.0));
        let a =
            Cli::parse_from(["pressure", "--cold-share", "75", "--backends", "zram,zram+tmem,zram+disk,zswap+tmem"])
                .args;
        let h = headline(&a, 1 << 30, 12.0);
        assert!(h.contains("cold share 75 % (built first, untouched until the checksum)"), "{h}");
        let json = serde_json::to_value(&a).unwrap();
        assert_eq!(json["cold_share"], 75);
        assert_eq!(json["front_idle_age"], 5, "the front's flags are flattened into the args: {json}");
        assert_eq!(json["backends"][1], "zram+tmem");
        assert!(Cli::try_parse_from(["pressure", "--cold-share", "91"]).is_err());
        let kinds: Vec<BackendKind> = a.backends.clone();
        assert!(kinds.iter().all(|k| k.has_front() == backend_has_front(k.name())));
        assert_eq!(kinds.iter().filter(|k| k.needs_zram_writeback()).count(), 2);
    }

    #[test]
    fn workload_script_is_embedded() {
        assert!(workload::SCRIPT.contains("def main"));
        assert!(workload::SCRIPT.starts_with("#!/usr/bin/env python3"));
    }
}
