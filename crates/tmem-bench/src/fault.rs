//! `tmem bench fault`: the swap-in round trip on its own.
//!
//! One process (forked once, see [`child`]) maps `--mib` MiB of anonymous
//! memory, fills it with the built-in corpus pages (real compression
//! ratios), and for every backend (zram, the fuse-ram baseline, tmem; made
//! and removed exactly as `bench pressure` does) and every order (random,
//! sequential) on a fresh swap area: pushes every page out with
//! `MADV_PAGEOUT` (checked with `mincore`), then reads one byte of each page
//! from one thread, timing every touch. Per cell it reports the latency of
//! the touches that took a major fault (p50 / p99 / p99.9, µs), the pages
//! the kernel read per major fault (swap readahead: `pswpin` over majors),
//! and that every page read back right.
//!
//! `vm.page-cluster` (readahead: up to 2^N pages) is recorded, or set for the
//! run with `--page-cluster` and put back at the end, also on error or panic.
//! Every swap area, zram device and mount is undone as in `bench pressure`.

mod child;

use anyhow::anyhow;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, WaitOptions};
use tmem_sys::vmstat::CpuTimes;

use crate::pressure::backend::{Backend, BackendConfig, BackendKind, PoolSample, TmemRun};
use crate::pressure::{foreign_swap, install_signal_handlers, interrupted, zswap_off};
use crate::progress::Progress;
pub use child::{OutReport, TouchReport};
use child::{Reply, MIN_OUT_PERCENT};

/// Arguments of `tmem bench fault`.
#[derive(clap::Args, Debug, Clone, serde::Serialize)]
pub struct FaultArgs {
    /// Memory paged out and touched, MiB.
    #[arg(long, default_value_t = 256)]
    pub mib: u64,
    /// Swap backends to measure (as `bench pressure --backends`).
    #[arg(long, value_delimiter = ',', default_value = "zram,fuse-ram,tmem")]
    pub backends: Vec<BackendKind>,
    /// Orders in which the pages are touched.
    #[arg(long, value_delimiter = ',', default_value = "random,sequential")]
    pub orders: Vec<Order>,
    /// vm.page-cluster for the run (swap readahead of up to 2^N pages),
    /// restored afterwards; by default it is left as it is.
    #[arg(long)]
    pub page_cluster: Option<u32>,
    /// Seed of the random order.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Write every cell to this JSON file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Run even if other swap areas are active (they may take pages).
    #[arg(long)]
    pub allow_other_swap: bool,
    /// Give up on a step (paging out, or one pass) after this many seconds.
    #[arg(long, default_value_t = 600)]
    pub timeout: u64,
    /// Directory for the disk swap file (the disk and zswap backends).
    #[arg(long, default_value = "/var/tmp")]
    pub swap_dir: PathBuf,
    /// zram compression algorithm.
    #[arg(long, default_value = "lz4")]
    pub zram_algorithm: String,
    /// tmem codec (as `tmem swap up --codec`).
    #[arg(long, default_value = "lz4")]
    pub tmem_codec: String,
    /// `tmem run --read-ahead` of the tmem-run row (default: tmem run's).
    #[arg(long)]
    pub tmem_read_ahead: Option<u64>,
    /// tmem pool limit (size or % of RAM).
    #[arg(long, default_value = "50%")]
    pub tmem_pool_limit: String,
    /// FUSE over io_uring workers per CPU for tmem (0: /dev/fuse).
    #[arg(long, default_value_t = 0)]
    pub tmem_fuse_uring: usize,
    /// `/dev/fuse` workers of tmem and fuse-ram (0: the daemon's default).
    #[arg(long, default_value_t = 0)]
    pub tmem_fuse_threads: usize,
}

/// The order of the touches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Order {
    /// A seeded random permutation of the pages.
    Random,
    /// Ascending addresses.
    Sequential,
}

impl Order {
    /// Lower-case name.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Random => "random",
            Self::Sequential => "sequential",
        }
    }
}

/// Samples the quantile of `per_mille` (500, 990, 999) needs: 10 beyond it
/// (20 for p50, 1,000 for p99, 10,000 for p99.9); fewer give no figure.
#[must_use]
pub fn min_samples(per_mille: u64) -> u64 {
    10_000 / (1000 - per_mille.min(999))
}

/// Latencies of a set of touches, µs. A quantile is `None` with fewer
/// samples than [`min_samples`].
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Latency {
    /// Samples.
    pub count: u64,
    /// Mean.
    pub mean_us: Option<f64>,
    /// Median.
    pub p50_us: Option<f64>,
    /// 99th percentile.
    pub p99_us: Option<f64>,
    /// 99.9th percentile.
    pub p999_us: Option<f64>,
    /// Largest.
    pub max_us: Option<f64>,
}

impl Latency {
    /// Sorts `ns` (nanoseconds) and takes nearest-rank quantiles.
    pub fn of(ns: &mut [u64]) -> Self {
        ns.sort_unstable();
        let n = ns.len() as u64;
        let us = |v: u64| v as f64 / 1000.0;
        // Nearest rank: the ceil(q n)-th smallest.
        let q = |per_mille: u64| {
            (n >= min_samples(per_mille)).then(|| {
                let rank = (per_mille * n).div_ceil(1000).clamp(1, n);
                us(ns[usize::try_from(rank - 1).unwrap_or(0)])
            })
        };
        Self {
            count: n,
            mean_us: (n > 0).then(|| ns.iter().map(|&v| v as f64).sum::<f64>() / n as f64 / 1000.0),
            p50_us: q(500),
            p99_us: q(990),
            p999_us: q(999),
            max_us: ns.last().map(|&v| us(v)),
        }
    }
}

/// One backend and order.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Cell {
    /// Backend.
    pub backend: String,
    /// Order of the touches.
    pub order: Order,
    /// The swap device (`/dev/zramN`, `/dev/loopN`).
    pub swap_device: Option<String>,
    /// Its `queue/rotational` (swap readahead is by slot, not by address, while a rotational area is on).
    pub rotational: Option<bool>,
    /// Paging out.
    pub out: OutReport,
    /// The backend's pool once the pages were out.
    pub pool: PoolSample,
    /// The pass.
    pub touch: TouchReport,
    /// Pages read from swap per major fault: (`pswpin` + `zswpin`) / majors.
    pub pages_read_per_major: Option<f64>,
    /// CPU steal during the pass, %.
    pub cpu_steal_percent: f64,
    /// Swap areas not ours seen during the cell.
    pub foreign_swap: Vec<String>,
    /// swapon of a fresh area, seconds.
    pub setup_secs: f64,
    /// swapoff and teardown, seconds.
    pub teardown_secs: f64,
}

/// Everything one bench measured.
#[derive(Clone, Debug, serde::Serialize)]
pub struct FaultReport {
    /// The arguments.
    pub args: FaultArgs,
    /// Where it ran.
    pub machine: crate::machine::Machine,
    /// `vm.page-cluster` during the run.
    pub page_cluster: u32,
    /// `/sys/kernel/mm/swap/vma_ra_enabled` (readahead by address rather than by swap slot).
    pub vma_readahead: Option<bool>,
    /// Pages in the region.
    pub pages: u64,
    /// Swap area size, bytes.
    pub swap_size_bytes: u64,
    /// The zram device hot-added for the zram cells (removed since).
    pub zram_device: Option<String>,
    /// CPU steal over the whole bench, %.
    pub cpu_steal_percent: f64,
    /// Every cell run.
    pub cells: Vec<Cell>,
    /// Errors (a backend that could not be set up, a failed cell).
    pub errors: Vec<String>,
}

const PAGE_CLUSTER: &str = "/proc/sys/vm/page-cluster";

fn read_page_cluster() -> anyhow::Result<u32> {
    let s = std::fs::read_to_string(PAGE_CLUSTER).map_err(|e| anyhow!("{PAGE_CLUSTER}: {e}"))?;
    s.trim().parse().map_err(|_| anyhow!("{PAGE_CLUSTER}: bad value {s:?}"))
}

/// `vm.page-cluster` set for the run; the old value is written back on drop.
struct PageCluster {
    old: u32,
}

impl PageCluster {
    fn set(n: u32) -> anyhow::Result<Self> {
        let old = read_page_cluster()?;
        std::fs::write(PAGE_CLUSTER, n.to_string()).map_err(|e| anyhow!("setting {PAGE_CLUSTER} to {n}: {e}"))?;
        Ok(Self { old })
    }
}

impl Drop for PageCluster {
    fn drop(&mut self) {
        if let Err(e) = std::fs::write(PAGE_CLUSTER, self.old.to_string()) {
            tracing::warn!("{PAGE_CLUSTER} not restored to {}: {e}", self.old);
        }
    }
}

/// The process that holds the pages (forked, or a `tmem run` of
/// `tmem bench fault-toucher`); killed and reaped on drop.
struct Toucher {
    pid: Pid,
    commands: std::fs::File,
    replies: BufReader<std::fs::File>,
    timeout: Duration,
    /// Its pages go out by themselves (`tmem run` evicts them past its
    /// budget, this many pages): it is told `settle`, not `out`.
    evicts_itself: Option<u64>,
}

impl Toucher {
    /// Forks it and waits until its pages are filled.
    fn start(pages: usize, seed: u64, timeout: Duration) -> anyhow::Result<Self> {
        let (command_rx, command_tx) = std::io::pipe()?;
        let (reply_rx, reply_tx) = std::io::pipe()?;
        let parent = rustix::process::getpid();
        // SAFETY: the child runs only `child::serve`: allocation (glibc's
        // fork takes and resets malloc's locks), pipes, system calls; it
        // takes no other lock a thread of the parent may have held at the
        // fork (it prints nothing but a panic's message), and it leaves with
        // `_exit`, so none of the parent's destructors or exit handlers run.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            drop((command_tx, reply_rx));
            // SAFETY: PR_SET_PDEATHSIG takes a signal number and changes only this process.
            unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
            let code = if rustix::process::getppid() == Some(parent) {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    child::serve(pages, seed, command_rx, reply_tx)
                }))
                .unwrap_or(101)
            } else {
                1
            };
            // SAFETY: ends this forked process at once, as described above.
            unsafe { libc::_exit(code) };
        }
        if pid < 0 {
            return Err(anyhow!("fork: {}", std::io::Error::last_os_error()));
        }
        let pid = Pid::from_raw(pid).ok_or_else(|| anyhow!("fork returned pid {pid}"))?;
        drop((command_rx, reply_tx));
        let commands = std::fs::File::from(std::os::fd::OwnedFd::from(command_tx));
        let replies = BufReader::new(std::fs::File::from(std::os::fd::OwnedFd::from(reply_rx)));
        Self { pid, commands, replies, timeout, evicts_itself: None }.ready()
    }

    /// Starts `tmem bench fault-toucher` under `tmem run --memory BUDGET`:
    /// its pages go to tmem run's store once past the budget.
    fn start_under_run(run: &TmemRun, budget: u64, pages: usize, seed: u64, timeout: Duration) -> anyhow::Result<Self> {
        let exe = crate::cache::setup::current_exe()?.to_string_lossy().into_owned();
        let (pages_s, seed_s) = (pages.to_string(), seed.to_string());
        let (program, args) =
            run.wrap(budget, &exe, &["bench", "fault-toucher", "--pages", &pages_s, "--seed", &seed_s]);
        let mut child = std::process::Command::new(&program)
            .args(&args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| anyhow!("cannot start {program}: {e}"))?;
        let pid = Pid::from_raw(i32::try_from(child.id())?).ok_or_else(|| anyhow!("bad pid"))?;
        let commands = std::fs::File::from(std::os::fd::OwnedFd::from(child.stdin.take().expect("piped")));
        let replies = std::fs::File::from(std::os::fd::OwnedFd::from(child.stdout.take().expect("piped")));
        // Reaped by pid in `drop`, as the forked toucher is.
        drop(child);
        Self { pid, commands, replies: BufReader::new(replies), timeout, evicts_itself: Some(budget / 4096) }.ready()
    }

    fn ready(mut self) -> anyhow::Result<Self> {
        match self.recv()? {
            Reply::Ready { .. } => Ok(self),
            other => Err(anyhow!("the touching process did not start: {other:?}")),
        }
    }

    /// Has the region go out: `MADV_PAGEOUT` to swap, or, under tmem run,
    /// waits for its eviction to settle.
    ///
    /// Under tmem run, the budget is then raised past the region, so that
    /// the pass measures faults served from the pool alone, with no
    /// eviction going on (it is put back before the next `settle`).
    fn out(&mut self) -> anyhow::Result<OutReport> {
        let command = match self.evicts_itself {
            Some(budget) => {
                self.set_run_memory(budget * 4096)?;
                format!("settle {budget}")
            }
            None => "out".to_owned(),
        };
        let out = match self.call(&command)? {
            Reply::Out(out) => out,
            other => return Err(anyhow!("unexpected reply to {command}: {other:?}")),
        };
        if self.evicts_itself.is_some() {
            self.set_run_memory(out.pages * 4096 * 2 + (64 << 20))?;
        }
        Ok(out)
    }

    /// `tmem set run-PID memory=BYTES` on the tmem run this toucher is under.
    fn set_run_memory(&self, bytes: u64) -> anyhow::Result<()> {
        let pid = self.pid.as_raw_nonzero().get();
        let req =
            tmem_ctl::Request::Set { device: format!("run-{pid}"), key: "memory".into(), value: bytes.to_string() };
        tmem_ctl::call_ok(&tmem_ctl::runs_dir().join(pid.to_string()), &req, Duration::from_secs(10))
            .map(drop)
            .map_err(|e| anyhow!("tmem run (pid {pid}): memory={bytes}: {e}"))
    }

    fn call(&mut self, command: &str) -> anyhow::Result<Reply> {
        writeln!(self.commands, "{command}").map_err(|e| anyhow!("the touching process is gone: {e}"))?;
        self.recv()
    }

    /// The next reply, waiting in short slices so that a signal or the timeout ends the wait.
    fn recv(&mut self) -> anyhow::Result<Reply> {
        let deadline = Instant::now() + self.timeout;
        while self.replies.buffer().is_empty() {
            if interrupted() {
                return Err(anyhow!("interrupted"));
            }
            if Instant::now() > deadline {
                return Err(anyhow!("the touching process did not answer within {} s", self.timeout.as_secs()));
            }
            let fd = self.replies.get_ref().as_fd();
            let mut pfd = [rustix::event::PollFd::new(&fd, rustix::event::PollFlags::IN)];
            let slice = rustix::event::Timespec { tv_sec: 0, tv_nsec: 200_000_000 };
            match rustix::event::poll(&mut pfd, Some(&slice)) {
                Ok(0) | Err(rustix::io::Errno::INTR) => continue,
                Ok(_) => break,
                Err(e) => return Err(anyhow!("poll: {e}")),
            }
        }
        let mut line = String::new();
        if self.replies.read_line(&mut line)? == 0 {
            return Err(anyhow!("the touching process died"));
        }
        match serde_json::from_str(&line)? {
            Reply::Failed(e) => Err(anyhow!("{e}")),
            r => Ok(r),
        }
    }
}

impl Drop for Toucher {
    fn drop(&mut self) {
        let _ = writeln!(self.commands, "quit");
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match rustix::process::waitpid(Some(self.pid), WaitOptions::NOHANG) {
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
                Ok(None) => {
                    let _ = rustix::process::kill_process(self.pid, Signal::KILL);
                    let _ = rustix::process::waitpid(Some(self.pid), WaitOptions::empty());
                    return;
                }
                _ => return,
            }
        }
    }
}

fn preflight(a: &FaultArgs) -> anyhow::Result<()> {
    if !tmem_sys::is_root() {
        return Err(anyhow!("tmem bench fault needs root (swapon, zram, FUSE mounts)"));
    }
    if a.mib == 0 {
        return Err(anyhow!("--mib must be at least 1"));
    }
    if a.backends.is_empty() || a.orders.is_empty() {
        return Err(anyhow!("--backends and --orders must not be empty"));
    }
    let mut seen = a.backends.clone();
    seen.sort();
    seen.dedup();
    if seen.len() != a.backends.len() {
        return Err(anyhow!("--backends lists a backend twice"));
    }
    // The region, and as much again in fuse-ram's plain pages.
    let need = (a.mib << 20) * 2 + (256 << 20);
    let avail = tmem_sys::swap::meminfo_field("MemAvailable")?;
    if need > avail {
        return Err(anyhow!(
            "--mib {}: needs about {} of free memory, {} is available",
            a.mib,
            tmem_daemon::human(need),
            tmem_daemon::human(avail)
        ));
    }
    crate::pressure::refuse_other_swap(a.allow_other_swap)
}

/// `tmem bench fault-toucher`: the touching process on standard input and
/// output, for the tmem-run row (started under `tmem run`). Its exit code.
#[must_use]
pub fn toucher_main(pages: usize, seed: u64) -> i32 {
    child::serve(pages, seed, std::io::stdin().lock(), std::io::stdout().lock())
}

/// Runs the bench: every backend, every order; returns what it measured
/// (cells that failed are in `errors`). Everything set up is undone.
pub fn bench(a: &FaultArgs) -> anyhow::Result<FaultReport> {
    preflight(a)?;
    let pages = usize::try_from((a.mib << 20) / 4096)?;
    // Forked before any backend exists (no FUSE workers yet), and before the signal flags.
    let mut toucher = Toucher::start(pages, a.seed, Duration::from_secs(a.timeout.max(1)))?;
    install_signal_handlers()?;
    let _zswap_off = zswap_off()?;
    let _cluster = a.page_cluster.map(PageCluster::set).transpose()?;
    // Over twice the region: with swap more than half full (`vm_swap_full`)
    // the kernel frees a page's slot when it faults back in, which would
    // make every page re-read while paging out dirty again.
    let swap_size = ((a.mib << 21) + (64 << 20)).div_ceil(64 << 20) * (64 << 20);
    let cfg = BackendConfig {
        zram_algorithm: a.zram_algorithm.clone(),
        tmem_codec: a.tmem_codec.clone(),
        tmem_read_ahead: a.tmem_read_ahead,
        tmem_pool_limit: a.tmem_pool_limit.clone(),
        tmem_fuse_uring: a.tmem_fuse_uring,
        tmem_fuse_threads: a.tmem_fuse_threads,
        ..BackendConfig::new(swap_size, &a.swap_dir)
    };
    let progress = Progress::new(a.backends.len() * a.orders.len());
    let cpu_start = CpuTimes::now();
    let (mut cells, mut errors, mut zram_device) = (Vec::new(), Vec::new(), None);
    for &kind in &a.backends {
        if interrupted() {
            break;
        }
        let name = kind.name();
        progress.show(&format!("{name}: preparing"), true);
        let mut backend = match Backend::prepare(kind, &cfg) {
            Ok(b) => b,
            Err(e) => {
                progress.note(&format!("{name}: cannot prepare: {e:#}"));
                errors.push(format!("{name}: {e:#}"));
                progress.steps_done(a.orders.len());
                continue;
            }
        };
        zram_device = zram_device.or_else(|| backend.zram_device());
        // tmem-run: a toucher of its own, under `tmem run` with a budget of
        // 1/32 of the region (at least 4 MiB), for this row's cells.
        let mut own = match &backend {
            Backend::TmemRun(r) => {
                let budget = ((a.mib << 20) / 32).max(4 << 20);
                match Toucher::start_under_run(r, budget, pages, a.seed, Duration::from_secs(a.timeout.max(1))) {
                    Ok(t) => Some(t),
                    Err(e) => {
                        progress.note(&format!("{name}: {e:#}"));
                        errors.push(format!("{name}: {e:#}"));
                        progress.steps_done(a.orders.len());
                        continue;
                    }
                }
            }
            _ => None,
        };
        for &order in &a.orders {
            progress.show(&format!("{name}, {}", order.name()), true);
            let toucher = own.as_mut().unwrap_or(&mut toucher);
            match cell(toucher, &mut backend, name, order) {
                Ok(c) => {
                    if c.touch.wrong_pages > 0 {
                        progress.note(&format!(
                            "!!! {name}, {}: {} page(s) read back WRONG (first: page {:?})",
                            order.name(),
                            c.touch.wrong_pages,
                            c.touch.first_wrong
                        ));
                    }
                    cells.push(c);
                }
                Err(e) => {
                    progress.note(&format!("{name}, {}: {e:#}", order.name()));
                    errors.push(format!("{name}, {}: {e:#}", order.name()));
                }
            }
            progress.steps_done(1);
            if interrupted() {
                break;
            }
        }
        progress.show(&format!("{name}: cleaning up"), false);
        drop(own);
        if let Err(e) = backend.finish() {
            errors.push(format!("{name}: cleanup: {e:#}"));
        }
    }
    progress.finish();
    drop(toucher);
    if interrupted() {
        return Err(anyhow!("interrupted; everything set up was undone"));
    }
    Ok(FaultReport {
        args: a.clone(),
        machine: crate::machine::Machine::here(),
        page_cluster: read_page_cluster()?,
        vma_readahead: std::fs::read_to_string("/sys/kernel/mm/swap/vma_ra_enabled").ok().map(|s| s.trim() == "true"),
        pages: pages as u64,
        swap_size_bytes: swap_size,
        zram_device,
        cpu_steal_percent: CpuTimes::steal_percent_from(cpu_start),
        cells,
        errors,
    })
}

/// One cell: a fresh swap area, page out, one pass, teardown.
fn cell(toucher: &mut Toucher, backend: &mut Backend, name: &str, order: Order) -> anyhow::Result<Cell> {
    let t = Instant::now();
    if let Err(e) = backend.activate() {
        if let Err(d) = backend.deactivate() {
            return Err(anyhow!("{e:#}; then, undoing it: {d:#}"));
        }
        return Err(e);
    }
    let setup_secs = t.elapsed().as_secs_f64();
    let measured = measure(toucher, backend, name, order);
    let t = Instant::now();
    let down = backend.deactivate();
    let mut c = measured?;
    down?;
    c.setup_secs = setup_secs;
    c.teardown_secs = t.elapsed().as_secs_f64();
    Ok(c)
}

fn measure(toucher: &mut Toucher, backend: &Backend, name: &str, order: Order) -> anyhow::Result<Cell> {
    let ours = backend.swap_paths();
    let mut foreign = foreign_swap(&ours);
    let out = toucher.out()?;
    let pool = backend.sample();
    let cpu = CpuTimes::now();
    let Reply::Touched(touch) = toucher.call(&format!("touch {}", order.name()))? else {
        return Err(anyhow!("unexpected reply to touch"));
    };
    let cpu_steal_percent = CpuTimes::steal_percent_from(cpu);
    foreign.extend(foreign_swap(&ours).into_iter().filter(|f| !foreign.contains(f)).collect::<Vec<_>>());
    let dev = ours.first();
    let rotational = dev.and_then(|d| d.file_name()).and_then(|n| {
        let p = Path::new("/sys/block").join(n).join("queue/rotational");
        std::fs::read_to_string(p).ok().map(|s| s.trim() == "1")
    });
    let pages_read = touch.pswpin + touch.zswpin;
    Ok(Cell {
        backend: name.to_owned(),
        order,
        swap_device: dev.map(|d| d.display().to_string()),
        rotational,
        out,
        pool,
        pages_read_per_major: (touch.major_faults > 0).then(|| pages_read as f64 / touch.major_faults as f64),
        touch: *touch,
        cpu_steal_percent,
        foreign_swap: foreign,
        setup_secs: 0.0,
        teardown_secs: 0.0,
    })
}

fn us(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| if v < 100.0 { format!("{v:.1}") } else { format!("{v:.0}") })
}

/// The report's table: one row per cell.
#[must_use]
pub fn render_table(cells: &[Cell]) -> String {
    let mut t = crate::table::plain([
        "backend",
        "order",
        "pages out",
        "major",
        "minor",
        "read/major",
        "p50 us",
        "p99 us",
        "p99.9 us",
        "max us",
        "us/page",
        "ratio",
        "steal %",
    ]);
    for c in cells {
        // userfaultfd's faults count as minor (the kernel did no I/O): under
        // tmem run every touched page was out, so every touch is the fault.
        let m = if c.backend == BackendKind::TmemRun.name() { &c.touch.all } else { &c.touch.major };
        let per_page = c.touch.all.mean_us;
        let ratio = (c.pool.pool_bytes > 0).then(|| c.pool.stored_bytes as f64 / c.pool.pool_bytes as f64);
        t.add_row([
            c.backend.clone(),
            c.order.name().to_owned(),
            c.out.pages_out.to_string(),
            c.touch.major_faults.to_string(),
            c.touch.minor_faults.to_string(),
            c.pages_read_per_major.map_or_else(|| "-".to_owned(), |r| format!("{r:.2}")),
            us(m.p50_us),
            us(m.p99_us),
            us(m.p999_us),
            us(m.max_us),
            us(per_page),
            ratio.map_or_else(|| "-".to_owned(), |r| format!("{r:.2}")),
            format!("{:.1}", c.cpu_steal_percent),
        ]);
    }
    t.to_string() + "\n"
}

fn print_report(r: &FaultReport) {
    let a = &r.args;
    let m = &r.machine;
    println!(
        "tmem bench fault: {} MiB ({} pages of the built-in corpora), pushed to swap with MADV_PAGEOUT, \
         then one byte read from each page by one thread, in each order; a fresh swap area of {} per cell.",
        a.mib,
        r.pages,
        tmem_daemon::human(r.swap_size_bytes)
    );
    println!(
        "machine: kernel {}, {} CPUs, {} RAM; vm.page-cluster {} (swap readahead up to {} pages{}), \
         VMA readahead {}; CPU steal over the bench {:.1}%.",
        m.kernel,
        m.cpus,
        tmem_daemon::human(m.mem_total_bytes),
        r.page_cluster,
        1u64 << r.page_cluster.min(31),
        if a.page_cluster.is_some() { ", set for the run" } else { "" },
        r.vma_readahead.map_or("unknown", |v| if v { "on" } else { "off" }),
        r.cpu_steal_percent
    );
    println!(
        "backends: zram = /dev/{} (hot-added) {}; fuse-ram = tmem's FUSE + loop path over plain RAM, served by the \
         bench; tmem = tmem swap up --codec {} --pool-limit {} --fuse-uring {}; tmem-run = tmem run --codec {}{}.",
        r.zram_device.as_deref().unwrap_or("zramN"),
        a.zram_algorithm,
        a.tmem_codec,
        a.tmem_pool_limit,
        a.tmem_fuse_uring,
        a.tmem_codec,
        a.tmem_read_ahead.map(|n| format!(" --read-ahead {n}")).unwrap_or_default()
    );
    println!();
    print!("{}", render_table(&r.cells));
    println!();
    println!(
        "major: touches that took a major fault (waited for swap I/O); p50/p99/p99.9/max are theirs (tmem-run's: \
         every touch's, as userfaultfd's faults count as minor; its pages went out by tmem run's eviction past a \
         budget of 1/32 of the region, at least 4 MiB, raised past the region for the pass: the faults are served \
         from the pool with no eviction going on). minor: the \
         page was already in the swap cache (read ahead by an earlier fault); tmem-run's: its userfaultfd faults (a page \
         tmem run read ahead takes none). read/major: pages read from swap \
         (pswpin + zswpin, system-wide) per major fault; zero pages never reach a device (the swap layer keeps \
         them itself), so it can sit a little under 1. us/page: mean over every touch. ratio: uncompressed / pool \
         bytes once the pages were out (at least {MIN_OUT_PERCENT}% of them must be, by mincore, before a pass). \
         A quantile needs {} samples (p99) or {} (p99.9) in its cell; '-' where there were fewer.",
        min_samples(990),
        min_samples(999)
    );
    for c in &r.cells {
        if c.touch.wrong_pages > 0 {
            println!(
                "!!! WRONG: {}, {}: {} of {} pages read back wrong (first: page {:?})",
                c.backend,
                c.order.name(),
                c.touch.wrong_pages,
                c.touch.verified_pages,
                c.touch.first_wrong
            );
        }
        if !c.foreign_swap.is_empty() {
            println!(
                "warning: {}, {}: other swap areas were active: {}",
                c.backend,
                c.order.name(),
                c.foreign_swap.join(", ")
            );
        }
    }
    let checked: u64 = r.cells.iter().map(|c| c.touch.verified_pages).sum();
    println!("every page checked after each pass: {checked} page reads compared with what was written.");
}

/// `tmem bench fault`.
pub fn run(a: &FaultArgs) -> anyhow::Result<()> {
    let r = bench(a)?;
    print_report(&r);
    crate::write_outputs(
        None,
        a.json.as_deref(),
        |_| Ok(()),
        |p| {
            let mut v = serde_json::to_value(&r)?;
            v["tool"] = "tmem bench fault".into();
            v["min_samples"] =
                serde_json::json!({"p50": min_samples(500), "p99": min_samples(990), "p999": min_samples(999)});
            std::fs::write(p, serde_json::to_string_pretty(&v)? + "\n").map_err(|e| anyhow!("{}: {e}", p.display()))
        },
    )?;
    crate::pressure::bench_result(&r.errors)?;
    let wrong: u64 = r.cells.iter().map(|c| c.touch.wrong_pages).sum();
    if wrong > 0 {
        return Err(anyhow!("{wrong} page(s) read back WRONG from swap"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_need_enough_samples() {
        assert_eq!((min_samples(500), min_samples(990), min_samples(999)), (20, 1000, 10_000));
        let mut ns: Vec<u64> = (1..=10_000).rev().map(|i| i * 1000).collect();
        let l = Latency::of(&mut ns);
        assert_eq!(l.count, 10_000);
        assert_eq!(
            (l.p50_us, l.p99_us, l.p999_us, l.max_us),
            (Some(5000.0), Some(9900.0), Some(9990.0), Some(10_000.0))
        );
        assert!((l.mean_us.unwrap() - 5000.5).abs() < 1e-9);
        let mut few: Vec<u64> = (1..=999).collect();
        let l = Latency::of(&mut few);
        assert_eq!((l.p50_us, l.p99_us, l.p999_us), (Some(0.5), None, None));
        let l = Latency::of(&mut []);
        assert_eq!(l, Latency { count: 0, ..Latency::default() });
    }

    #[test]
    fn orders_and_cells_render() {
        assert_eq!(Order::Random.name(), "random");
        let touch = TouchReport {
            touched: 100,
            major_faults: 13,
            minor_faults: 87,
            pswpin: 100,
            zswpin: 0,
            major: Latency { count: 13, p50_us: None, ..Latency::default() },
            minor: Latency::default(),
            all: Latency { count: 100, mean_us: Some(3.31), ..Latency::default() },
            secs: 0.1,
            verified_pages: 100,
            wrong_pages: 0,
            first_wrong: None,
        };
        let c = Cell {
            backend: "fuse-ram".into(),
            order: Order::Sequential,
            swap_device: Some("/dev/loop3".into()),
            rotational: Some(false),
            out: OutReport { pages: 100, pages_out: 100, rounds: 2, secs: 0.2 },
            pool: PoolSample { pool_bytes: 409_600, stored_bytes: 409_600, ..PoolSample::default() },
            touch,
            pages_read_per_major: Some(100.0 / 13.0),
            cpu_steal_percent: 0.0,
            foreign_swap: vec![],
            setup_secs: 0.0,
            teardown_secs: 0.0,
        };
        let t = render_table(&[c]);
        let row = t.lines().nth(1).unwrap();
        for want in ["fuse-ram", "sequential", "7.69", "3.3", "1.00"] {
            assert!(row.contains(want), "{want:?} not in {row:?}");
        }
    }
}
