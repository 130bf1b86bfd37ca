//! `tmem bench cache`: tmem's caching block device (a backing file served
//! through a compressed ephemeral pool, `tmem cache up`) in front of a slow
//! backing store, under a read-heavy job on a real filesystem in a memory
//! cgroup limited well below its working set.
//!
//! Once, at the start, a backing image is built in a scratch directory
//! under `--work-dir`: an ext4 filesystem holding an SQLite database of
//! about `--db-mib` MiB (a table of realistic text rows and a secondary
//! index, crates/tmem-bench/workload/cache_build.py). Then, for every row,
//! the image is attached afresh (so the page cache starts empty) and
//! mounted read-only, and the job (`--queries` random lookups by rowid and
//! through the index, cache_query.py) runs in a fresh memory cgroup limited
//! to a level's % of the database size; the page cache of the filesystem is
//! charged to that cgroup, so what does not fit reaches the block device:
//!
//! * `no limit` (once): plain loop device, no limit, the upper bound;
//! * `plain loop`: `losetup --direct-io=on --read-only`, limit L;
//! * `plain loop, 2x RAM`: the same with limit 2L, the RAM a tmem row uses
//!   (job L + pool L);
//! * `tmem lz4`, `tmem zstd+dict`, `tmem lz4 lru`: `tmem cache up --backing
//!   IMAGE --pool-limit L` with that codec and eviction (SIEVE, or strict
//!   LRU for comparison), its loop device mounted.
//!
//! A slow backing store is made real with `--backing-iops`/`--backing-bps`:
//! a cgroup v1 blkio throttle on the disk holding the image, which the job
//! and the tmem daemon both run in (a loop device charges its backing I/O
//! to the cgroup that issued it), so every row is slowed alike; the throttle
//! is measured with `dd` before the rows. `--backing-latency-us` instead
//! asks the tmem daemon to emulate a latency per backing read: only the tmem
//! rows are slowed then, and the plain rows say so.
//!
//! Every figure printed comes from the run: wall time, backing bytes
//! (plain: the loop device's read sectors; tmem: `backing_read_bytes`), the
//! pool's hits, misses, memory and evictions, the daemon's CPU time and the
//! machine's. Everything set up is undone at the end, on error, panic and
//! Ctrl-C (guards in [`setup`]).

mod job;
mod report;
pub(crate) mod setup;

use anyhow::anyhow;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tmem_sys::cgroup::{Layout, MemCgroup};
use tmem_sys::vmstat::{CpuTimes, ProcessCpu};

use crate::pressure::{cmd, interrupted};
use crate::progress::Progress;
pub use report::RowKind;
use report::{Outcome, RowRecord};
use setup::{BlkioThrottle, LoopDev, Mounted, Scratch, TmemCache};

/// Arguments of `tmem bench cache`.
#[derive(clap::Args, Debug, Clone, serde::Serialize)]
pub struct CacheBenchArgs {
    /// Size of the SQLite database, MiB.
    #[arg(long, default_value_t = 1024)]
    pub db_mib: u64,
    /// Memory limits of the job: % of the database size.
    #[arg(long, value_delimiter = ',', default_value = "50,25")]
    pub levels: Vec<u32>,
    /// Rows to run (no-limit runs once; the others at every level).
    #[arg(long, value_delimiter = ',', default_value = "no-limit,plain,plain-2x,tmem-lz4,tmem-zstd-dict,tmem-lz4-lru")]
    pub rows: Vec<RowKind>,
    /// Lookups per row (0: 4 per 4 KiB page of the database).
    #[arg(long, default_value_t = 0)]
    pub queries: u64,
    /// Skew of the rows looked up: a power law, 1 = uniform, 2 = a quarter
    /// of the rows get half of the lookups (hot rows scattered over the file).
    #[arg(long, default_value_t = 2.0)]
    pub skew: f64,
    /// Share of the lookups made through the secondary index (the rest by rowid).
    #[arg(long, default_value_t = 0.5)]
    pub index_share: f64,
    /// Seed of the lookups (the same in every row).
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Slow backing store, for real: limit reads from the disk holding the
    /// image to this many I/Os per second (cgroup v1 blkio throttle; the job
    /// and the tmem daemon run under it alike; 0: none).
    #[arg(long, default_value_t = 0)]
    pub backing_iops: u64,
    /// The same, in bytes per second (0: none).
    #[arg(long, default_value_t = 0)]
    pub backing_bps: u64,
    /// Slow backing store, emulated by the tmem daemon: microseconds added
    /// to every backing read (`tmem cache up --backing-latency-us`; 500 is
    /// the documented value). Only the tmem rows are slowed then.
    #[arg(long, default_value_t = 0)]
    pub backing_latency_us: u64,
    /// Where the scratch directory (image, scripts, mount point) is made;
    /// it is removed at the end.
    #[arg(long, default_value = "/var/tmp/tmem-bench-cache")]
    pub work_dir: PathBuf,
    /// Write every row (raw) to this JSON file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw the wall time of every row, a panel per level, into this PNG (or .svg) file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Kill a job after this many seconds.
    #[arg(long, default_value_t = 1800)]
    pub timeout: u64,
    /// The tmem binary that runs `tmem cache up` and `down` (default: this program).
    #[arg(long)]
    pub tmem_exe: Option<PathBuf>,
    /// Python interpreter (with its sqlite3 module).
    #[arg(long, default_value = "python3")]
    pub python: String,
}

/// A throttle in force and what `dd` measured.
#[derive(Clone, Debug, serde::Serialize)]
struct ThrottleInfo {
    /// MAJ:MIN of the disk.
    disk: String,
    iops: u64,
    bps: u64,
    /// 4 KiB O_DIRECT reads per second outside the group.
    measured_iops_unthrottled: f64,
    /// The same inside it.
    measured_iops_throttled: f64,
}

/// What every row needs.
struct Ctx<'a> {
    a: &'a CacheBenchArgs,
    layout: Layout,
    scratch: PathBuf,
    image: PathBuf,
    mnt: PathBuf,
    scripts: job::Scripts,
    built: job::Built,
    queries: u64,
    throttle: Option<BlkioThrottle>,
    progress: Progress,
    reference_checksum: Option<u64>,
    cgroup_name: String,
    runtime_dir: PathBuf,
    /// The tmem binary.
    exe: PathBuf,
}

/// The device a row's filesystem is on; torn down on drop.
enum Device {
    Plain(LoopDev),
    Tmem(TmemCache),
}

impl Device {
    fn path(&self) -> PathBuf {
        match self {
            Self::Plain(l) => l.path().to_owned(),
            Self::Tmem(t) => t.loop_dev.clone().unwrap_or_default(),
        }
    }

    fn teardown(self) -> anyhow::Result<()> {
        match self {
            Self::Plain(l) => l.detach(),
            Self::Tmem(t) => t.down(),
        }
    }
}

/// Counters of a device at one instant.
#[derive(Clone, Debug, Default)]
struct Sample {
    /// (reads, bytes) through the device the filesystem is on.
    device_reads: u64,
    device_bytes: u64,
    /// Bytes read from the loop device, as the kernel counts them.
    loop_bytes: u64,
    tmem: Option<report::TmemCounters>,
}

impl Ctx<'_> {
    fn sample(&self, dev: &Device) -> anyhow::Result<Sample> {
        match dev {
            Device::Plain(l) => {
                let (device_reads, device_bytes) = setup::block_reads(l.path())?;
                Ok(Sample { device_reads, device_bytes, loop_bytes: device_bytes, tmem: None })
            }
            Device::Tmem(t) => {
                let s = report::TmemCounters::from(&t.stats()?);
                let loop_bytes = match &t.loop_dev {
                    Some(l) => setup::block_reads(l)?.1,
                    None => 0,
                };
                Ok(Sample { device_reads: s.read_ios, device_bytes: s.read_bytes, loop_bytes, tmem: Some(s) })
            }
        }
    }

    /// One row: attach, mount, run the job in a fresh cgroup, tear down.
    fn row(&mut self, kind: RowKind, level: Option<u32>) -> anyhow::Result<RowRecord> {
        let a = self.a;
        let db_bytes = self.built.bytes;
        let limit = match (kind, level) {
            (RowKind::NoLimit, _) | (_, None) => None,
            (RowKind::Plain2x, Some(l)) => Some(report::limit_for(2 * l, db_bytes)),
            (_, Some(l)) => Some(report::limit_for(l, db_bytes)),
        };
        let pool_limit = level.map_or(0, |l| report::limit_for(l, db_bytes));
        let t = Instant::now();
        let dev = match kind.tmem() {
            Some((codec, eviction)) => {
                let procs = self.throttle.as_ref().map(BlkioThrottle::procs_file);
                Device::Tmem(TmemCache::up(&setup::CacheUp {
                    backing: &self.image,
                    codec,
                    pool_limit,
                    eviction,
                    latency_us: a.backing_latency_us,
                    dir: &self.runtime_dir,
                    blkio_procs: procs.as_deref(),
                    exe: &self.exe,
                })?)
            }
            None => Device::Plain(LoopDev::attach(&self.image, true, true)?),
        };
        let dev_path = dev.path();
        // Declared after `dev`: dropped (unmounted) before it.
        let mount = Mounted::ext4(&dev_path, &self.mnt, "ro,noload")?;
        let setup_secs = t.elapsed().as_secs_f64();

        let cg = MemCgroup::create(&self.layout, &self.cgroup_name)?;
        cg.set_limit(limit)?;
        let mut procs = vec![cg.procs_file()];
        procs.extend(self.throttle.as_ref().map(BlkioThrottle::procs_file));
        let daemon_pid = match &dev {
            Device::Tmem(t) => t.pid,
            Device::Plain(_) => None,
        };
        let before = self.sample(&dev)?;
        let daemon_before = daemon_pid.and_then(ProcessCpu::of_pid);
        let cpu_before = CpuTimes::now();
        let db = self.mnt.join("bench.db");
        let q = job::QueryJob {
            db: &db,
            rows: self.built.rows,
            queries: self.queries,
            seed: a.seed,
            skew: a.skew,
            index_share: a.index_share,
        };
        let title = row_title(kind, a);
        let label = format!("{title} @ {}", report::level_title(level));
        let mut running = self.scripts.spawn_query(&q, &procs, &self.scratch)?;
        let start = Instant::now();
        let timeout = Duration::from_secs(a.timeout.max(1));
        let mut timed_out = false;
        while !running.poll()? {
            if interrupted() {
                running.kill();
                return Err(anyhow!("interrupted; everything set up was undone"));
            }
            if start.elapsed() > timeout {
                running.kill();
                timed_out = true;
                break;
            }
            self.progress.show(&label, false);
            std::thread::sleep(Duration::from_millis(20));
        }
        let ended = running.ended();
        let cpu = cpu_before.zip(CpuTimes::now());
        let daemon_cpu = daemon_before.zip(daemon_pid.and_then(ProcessCpu::of_pid)).map(|(b, a)| a.since(&b));
        let after = self.sample(&dev)?;
        let max_usage = cg.max_usage()?;
        let oom_kills = cg.oom_control()?.oom_kill;
        drop(running);
        cg.remove()?;

        let t = Instant::now();
        mount.unmount()?;
        dev.teardown()?;
        let teardown_secs = t.elapsed().as_secs_f64();

        let device_read_bytes = after.device_bytes.saturating_sub(before.device_bytes);
        let device_reads = after.device_reads.saturating_sub(before.device_reads);
        let tmem = after.tmem.as_ref().map(|s| {
            let (codec, eviction) = kind.tmem().unwrap_or_default();
            report::tmem_figures(codec, eviction, pool_limit, before.tmem.as_ref(), s)
        });
        let (backing_read_bytes, backing_reads) = match (&after.tmem, &before.tmem) {
            (Some(s), b) => (
                s.backing_read_bytes.saturating_sub(b.as_ref().map_or(0, |b| b.backing_read_bytes)),
                s.backing_reads.saturating_sub(b.as_ref().map_or(0, |b| b.backing_reads)),
            ),
            (None, _) => (device_read_bytes, device_reads),
        };
        let (mut outcome, mut message) = (Outcome::Ok, None);
        let out = ended.out;
        if timed_out {
            outcome = Outcome::Timeout;
            message = Some(format!("killed after {:.0} s", ended.wall.as_secs_f64()));
        } else if ended.code != Some(0) || out.is_none_or(|o| o.found != o.queries) {
            outcome = Outcome::Fail;
            message = Some(format!(
                "job exit {:?} signal {:?}, {} OOM kill(s), printed {out:?}: {}",
                ended.code, ended.signal, oom_kills, ended.stderr_tail
            ));
        } else if let (Some(want), Some(o)) = (self.reference_checksum, out) {
            if o.checksum != want {
                outcome = Outcome::Wrong;
                message = Some(format!("checksum {} but the first row read {want}", o.checksum));
            }
        }
        if outcome == Outcome::Ok && self.reference_checksum.is_none() {
            self.reference_checksum = out.map(|o| o.checksum);
        }
        Ok(RowRecord {
            kind,
            title,
            level,
            limit_bytes: limit,
            outcome,
            message,
            device: dev_path.display().to_string(),
            wall_secs: ended.wall.as_secs_f64(),
            queries: out.map_or(0, |o| o.queries),
            query_secs: out.map(|o| o.secs),
            checksum: out.map(|o| o.checksum),
            device_read_bytes,
            loop_read_bytes: after.loop_bytes.saturating_sub(before.loop_bytes),
            backing_read_bytes,
            backing_reads,
            tmem,
            cgroup_max_usage_bytes: max_usage,
            oom_kills,
            daemon_cpu,
            machine_busy_cpu_secs: cpu.map(|(b, a)| a.busy_secs_since(&b)),
            cpu_steal_percent: cpu.map_or(0.0, |(b, a)| a.steal_percent_since(&b)),
            setup_secs,
            teardown_secs,
            derived: report::Derived::default(),
        })
    }
}

/// The title of a row, saying which rows a latency emulation slows.
fn row_title(kind: RowKind, a: &CacheBenchArgs) -> String {
    let t = kind.title();
    match (a.backing_latency_us, kind.tmem()) {
        (0, _) => t.to_owned(),
        (us, Some(_)) => format!("{t} (+{us} us/read)"),
        (_, None) => format!("{t} (no delay)"),
    }
}

/// The tmem binary: `--tmem-exe`, else this program.
fn tmem_exe(a: &CacheBenchArgs) -> anyhow::Result<PathBuf> {
    a.tmem_exe.clone().map_or_else(setup::current_exe, Ok)
}

/// Whether `program` is on PATH (or in /sbin, /usr/sbin).
fn have(program: &str) -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).chain(["/sbin", "/usr/sbin"].map(PathBuf::from)).any(|d| d.join(program).is_file())
}

/// Everything the bench needs, or one error naming all that is missing.
fn preflight(a: &CacheBenchArgs) -> anyhow::Result<Layout> {
    if a.levels.is_empty() || a.levels.iter().any(|l| *l == 0 || *l >= 100) {
        return Err(anyhow!("--levels must be percentages in 1..=99 (the no-limit row runs once anyway)"));
    }
    if a.rows.is_empty() {
        return Err(anyhow!("--rows is empty"));
    }
    if a.db_mib < 8 {
        return Err(anyhow!("--db-mib must be at least 8"));
    }
    if !(a.skew >= 1.0 && a.skew.is_finite() && (0.0..=1.0).contains(&a.index_share)) {
        return Err(anyhow!("--skew must be >= 1 and --index-share in 0..=1"));
    }
    let tmem_rows = a.rows.iter().any(|r| r.tmem().is_some());
    let throttle = a.backing_iops > 0 || a.backing_bps > 0;
    let mut missing = Vec::new();
    if !tmem_sys::is_root() {
        missing.push("root (loop devices, mounts, memory cgroups)".to_owned());
    }
    if tmem_rows && !Path::new("/dev/fuse").exists() {
        missing.push("/dev/fuse (modprobe fuse)".to_owned());
    }
    if !Path::new("/dev/loop-control").exists() {
        missing.push("loop devices (/dev/loop-control; modprobe loop)".to_owned());
    }
    for p in ["losetup", "mkfs.ext4", "mount", "umount", "truncate"] {
        if !have(p) {
            missing.push(format!("{p} (util-linux / e2fsprogs / coreutils)"));
        }
    }
    if throttle && !have("dd") {
        missing.push("dd (coreutils), to measure the throttle".to_owned());
    }
    if cmd(&a.python, &["-c", "import sqlite3"]).is_err() {
        missing.push(format!("{} with its sqlite3 module", a.python));
    }
    if tmem_rows {
        let exe = tmem_exe(a)?;
        if cmd(&exe.to_string_lossy(), &["cache", "up", "--help"]).is_err() {
            missing.push(format!("a `cache up` command in {} (this build of tmem has none)", exe.display()));
        }
    }
    if throttle && setup::blkio_root().is_none() {
        missing.push(
            "a cgroup v1 blkio hierarchy with throttling (for --backing-iops/--backing-bps; \
             use --backing-latency-us instead)"
                .to_owned(),
        );
    }
    let layout = Layout::detect().and_then(|l| l.ensure_memory_controller().map(|()| l));
    if let Err(e) = &layout {
        missing.push(format!("a memory cgroup controller ({e})"));
    }
    if !missing.is_empty() {
        return Err(anyhow!("tmem bench cache cannot run here; missing: {}", missing.join("; ")));
    }
    Ok(layout?)
}

/// Builds the image: ext4 on a plain loop device, the database on it.
fn build_image(scratch: &Path, scripts: &job::Scripts, mib: u64) -> anyhow::Result<(PathBuf, job::Built)> {
    let image = scratch.join("backing.img");
    let mnt = scratch.join("mnt");
    // Room for the database, the filesystem's metadata and journal.
    let size = (mib + mib / 8 + 64).next_multiple_of(4) << 20;
    cmd("truncate", &["-s", &size.to_string(), &image.to_string_lossy()])?;
    cmd(
        "mkfs.ext4",
        &[
            "-q",
            "-F",
            "-b",
            "4096",
            "-m",
            "0",
            "-E",
            "lazy_itable_init=0,lazy_journal_init=0",
            &image.to_string_lossy(),
        ],
    )?;
    let dev = LoopDev::attach(&image, false, false)?;
    let mount = Mounted::ext4(dev.path(), &mnt, "rw")?;
    let built = scripts.build(&mnt.join("bench.db"), mib)?;
    mount.unmount()?;
    dev.detach()?;
    cmd("sync", &[])?;
    Ok((image, built))
}

/// 4 KiB O_DIRECT reads per second from `image`, in the blkio group whose
/// `cgroup.procs` is `procs` (or where this process is).
fn measure_reads(image: &Path, procs: Option<&Path>, count: u64, skip: u64) -> anyhow::Result<f64> {
    let t = Instant::now();
    let procs = procs.map_or_else(|| "-".to_owned(), |p| p.to_string_lossy().into_owned());
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg("if [ \"$0\" != - ]; then echo $$ > \"$0\" || exit 97; fi; exec \"$@\"")
        .arg(&procs)
        .args(["dd", &format!("if={}", image.display()), "of=/dev/null", "bs=4096", "iflag=direct"])
        .args([format!("count={count}"), format!("skip={skip}")])
        .output()
        .map_err(|e| anyhow!("dd: {e}"))?;
    if !out.status.success() {
        return Err(anyhow!("dd failed: {}", String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(count as f64 / t.elapsed().as_secs_f64().max(1e-6))
}

/// The JSON file.
#[derive(serde::Serialize)]
struct JsonOut<'a> {
    tool: &'static str,
    args: &'a CacheBenchArgs,
    kernel: String,
    cgroup_layout: &'static str,
    cpus: usize,
    mem_total_bytes: u64,
    db: job::Built,
    image_bytes: u64,
    build_secs: f64,
    queries_per_row: u64,
    throttle: Option<&'a ThrottleInfo>,
    min_pages_for_cpu_per_page: u64,
    rows: &'a [RowRecord],
    errors: &'a [String],
}

/// `tmem bench cache`.
pub fn run(a: &CacheBenchArgs) -> anyhow::Result<()> {
    let layout = preflight(a)?;
    crate::pressure::install_signal_handlers()?;
    let pid = std::process::id();
    let throttle_on = a.backing_iops > 0 || a.backing_bps > 0;
    let levels_rows: Vec<RowKind> = a.rows.iter().copied().filter(|r| *r != RowKind::NoLimit).collect();
    let no_limit = a.rows.contains(&RowKind::NoLimit);
    let total = 1 + usize::from(throttle_on) + usize::from(no_limit) + levels_rows.len() * a.levels.len();
    let progress = Progress::new(total);

    // Declared first: dropped last, after every mount under it.
    let scratch = Scratch::create(&a.work_dir, &format!("run-{pid}"))?;
    let mnt = scratch.path().join("mnt");
    std::fs::create_dir(&mnt).map_err(|e| anyhow!("{}: {e}", mnt.display()))?;
    let scripts = job::Scripts::install(scratch.path(), &a.python)?;
    progress.show(&format!("building a {} MiB database on ext4", a.db_mib), true);
    let t = Instant::now();
    let (image, built) = build_image(scratch.path(), &scripts, a.db_mib)?;
    let build_secs = t.elapsed().as_secs_f64();
    // The image was written through the page cache: drop it, so that RAM is free
    // (the rows read the image with O_DIRECT, plain and tmem alike).
    if let Err(e) = std::fs::write("/proc/sys/vm/drop_caches", "1") {
        progress.note(&format!("note: cannot drop caches: {e}"));
    }
    progress.steps_done(1);
    let image_bytes = std::fs::metadata(&image).map(|m| m.len()).unwrap_or(0);
    progress.note(&format!(
        "database: {} rows, {} ({} s to build), image {}",
        built.rows,
        tmem_daemon::human(built.bytes),
        build_secs.round(),
        tmem_daemon::human(image_bytes)
    ));
    let queries = if a.queries > 0 { a.queries } else { (built.bytes / 4096) * 4 };

    let mut throttle_info = None;
    let throttle = if throttle_on {
        progress.show("measuring the backing store throttle", true);
        let disk = setup::disk_of(&image)?;
        let th = BlkioThrottle::create(&format!("tmem-bench-cache-{pid}"), disk, a.backing_iops, a.backing_bps)?;
        // About 3 s under the limit (the throttle lets a first burst through); different blocks each time.
        let ios = if a.backing_iops > 0 { (a.backing_iops * 3).clamp(300, 30_000) } else { 3000 };
        // Read a file of written data on the image's disk: holes in the
        // image would be answered without any device I/O, throttled or not.
        let probe = scratch.path().join("throttle-probe");
        cmd(
            "dd",
            &[
                "if=/dev/urandom",
                &format!("of={}", probe.display()),
                "bs=4096",
                &format!("count={}", 2 * ios),
                "oflag=direct",
                "conv=fsync",
            ],
        )?;
        let free = measure_reads(&probe, None, ios, 0);
        let limited = measure_reads(&probe, Some(&th.procs_file()), ios, ios);
        let _ = std::fs::remove_file(&probe);
        let (free, limited) = (free?, limited?);
        let info = ThrottleInfo {
            disk: format!("{}:{}", disk.0, disk.1),
            iops: a.backing_iops,
            bps: a.backing_bps,
            measured_iops_unthrottled: free,
            measured_iops_throttled: limited,
        };
        progress.note(&format!(
            "backing store throttle on {}: {} read IOPS{}; dd of 4 KiB O_DIRECT reads: {:.0}/s in the group, {:.0}/s outside",
            info.disk,
            a.backing_iops,
            if a.backing_bps > 0 { format!(", {} B/s", a.backing_bps) } else { String::new() },
            limited,
            free
        ));
        if a.backing_iops > 0 && limited > a.backing_iops as f64 * 1.5 {
            return Err(anyhow!(
                "the blkio throttle does not slow reads: {limited:.0} IOPS measured under a limit of {}",
                a.backing_iops
            ));
        }
        throttle_info = Some(info);
        progress.steps_done(1);
        Some(th)
    } else {
        None
    };

    let mut ctx = Ctx {
        a,
        layout,
        scratch: scratch.path().to_owned(),
        image,
        mnt,
        scripts,
        built,
        queries,
        throttle,
        progress,
        reference_checksum: None,
        cgroup_name: format!("tmem-bench-cache-{pid}"),
        runtime_dir: PathBuf::from(format!("/run/tmem-bench-cache-{pid}")),
        exe: tmem_exe(a)?,
    };
    let mut plan: Vec<(RowKind, Option<u32>)> = Vec::new();
    if no_limit {
        plan.push((RowKind::NoLimit, None));
    }
    for &l in &a.levels {
        plan.extend(levels_rows.iter().map(|&k| (k, Some(l))));
    }
    let mut rows: Vec<RowRecord> = Vec::new();
    let mut errors: Vec<String> = Vec::new();
    for (kind, level) in plan {
        if interrupted() {
            break;
        }
        let label = format!("{} @ {}", row_title(kind, a), report::level_title(level));
        ctx.progress.show(&label, true);
        match ctx.row(kind, level) {
            Ok(r) => {
                if r.outcome != Outcome::Ok {
                    ctx.progress.note(&format!("{label}: {:?}: {}", r.outcome, r.message.as_deref().unwrap_or("")));
                }
                rows.push(r);
            }
            Err(e) => {
                ctx.progress.note(&format!("{label}: error: {e:#}"));
                errors.push(format!("{label}: {e:#}"));
            }
        }
        ctx.progress.steps_done(1);
    }
    ctx.progress.finish();
    if let Some(th) = ctx.throttle.take() {
        if let Err(e) = th.remove() {
            errors.push(format!("blkio group: {e}"));
        }
    }
    report::derive(&mut rows);
    print_report(a, &ctx, throttle_info.as_ref(), &rows);
    if let Some(path) = &a.plot {
        plot(path, a, &ctx, &rows)?;
        println!("figure: {}", path.display());
    }
    if let Some(path) = &a.json {
        let out = JsonOut {
            tool: "tmem bench cache",
            args: a,
            kernel: cmd("uname", &["-r"]).unwrap_or_default(),
            cgroup_layout: ctx.layout.name(),
            cpus: std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
            mem_total_bytes: tmem_sys::swap::total_ram_bytes().unwrap_or(0),
            db: ctx.built,
            image_bytes,
            build_secs,
            queries_per_row: ctx.queries,
            throttle: throttle_info.as_ref(),
            min_pages_for_cpu_per_page: report::MIN_PAGES_FOR_CPU_PER_PAGE,
            rows: &rows,
            errors: &errors,
        };
        let text = serde_json::to_string_pretty(&out)?;
        std::fs::write(path, text + "\n").map_err(|e| anyhow!("{}: {e}", path.display()))?;
        println!("raw rows written to {}", path.display());
    }
    drop(ctx);
    drop(scratch);
    let wrong = rows.iter().filter(|r| r.outcome == Outcome::Wrong).count();
    if wrong > 0 {
        return Err(anyhow!("{wrong} row(s) read WRONG data"));
    }
    if interrupted() {
        return Err(anyhow!("interrupted; everything set up was undone"));
    }
    if !errors.is_empty() {
        return Err(anyhow!("{} error(s): {}", errors.len(), errors.join("; ")));
    }
    let failed = rows.iter().filter(|r| r.outcome != Outcome::Ok).count();
    if failed > 0 {
        return Err(anyhow!("{failed} row(s) failed"));
    }
    Ok(())
}

fn print_report(a: &CacheBenchArgs, ctx: &Ctx<'_>, throttle: Option<&ThrottleInfo>, rows: &[RowRecord]) {
    println!(
        "tmem bench cache: SQLite database of {} ({} rows) on ext4 in a {} image in {}; \
         {} lookups per row (skew {}, {:.0}% through the index), one job in a memory cgroup limited to \
         the level's % of the database size.",
        tmem_daemon::human(ctx.built.bytes),
        ctx.built.rows,
        tmem_daemon::human(std::fs::metadata(&ctx.image).map(|m| m.len()).unwrap_or(0)),
        ctx.scratch.display(),
        ctx.queries,
        a.skew,
        a.index_share * 100.0
    );
    println!(
        "devices: plain = losetup --direct-io=on --read-only; tmem = tmem cache up --pool-limit <the level's bytes> \
         (codec, eviction as named); both mounted -o ro,noload, afresh for every row."
    );
    match (throttle, a.backing_latency_us) {
        (Some(t), us) => {
            println!(
                "slow backing store: blkio throttle on disk {} ({} read IOPS{}) for the job and the tmem daemon \
                 alike (measured with dd: {:.0} 4 KiB reads/s in the group, {:.0}/s outside){}.",
                t.disk,
                t.iops,
                if t.bps > 0 { format!(", {} B/s", t.bps) } else { String::new() },
                t.measured_iops_throttled,
                t.measured_iops_unthrottled,
                if us > 0 { format!("; the tmem rows also add {us} us per backing read") } else { String::new() }
            );
        }
        (None, 0) => println!("backing store: the image file as it is, no throttle, no emulated latency."),
        (None, us) => println!(
            "slow backing store: EMULATED by the tmem daemon, {us} us added to every backing read of the tmem rows; \
             the plain rows are NOT delayed (their backing store is the image file as it is)."
        ),
    }
    println!();
    print!("{}", report::render_table(rows));
    println!();
    print!("{}", report::render_cpu(rows));
    println!(
        "backing MiB: read from the backing store (plain: the loop device's read sectors; tmem: backing_read_bytes). \
         x plain: against the plain-loop row of the same level. hit %: pool hits / (hits + misses). pool ratio: \
         orig_data_size / mem_used_total at the end (working set held per byte of pool RAM). daemon us/page: the \
         daemon's CPU per 4 KiB page read through the device (rows with at least {} pages). machine CPU s: busy \
         time of all CPUs over the job (/proc/stat; any other load on the machine included). The tmem pool is \
         the daemon's memory, outside the job's cgroup: a tmem row uses the job's limit plus the pool's.",
        report::MIN_PAGES_FOR_CPU_PER_PAGE
    );
    let steal: Vec<f64> = rows.iter().map(|r| r.cpu_steal_percent).collect();
    if let Some(med) = crate::median(steal.clone()) {
        println!(
            "CPU steal per row: median {med:.1}%, max {:.1}%; wall times of rows with high steal are not comparable.",
            steal.iter().copied().fold(0.0, f64::max)
        );
    }
    for r in rows.iter().filter(|r| r.outcome != Outcome::Ok) {
        println!(
            "{:?}: {} @ {}: {}",
            r.outcome,
            r.title,
            report::level_title(r.level),
            r.message.as_deref().unwrap_or("")
        );
    }
}

/// Wall time of every row: a bar panel per level (the no-limit row in each).
fn plot(path: &Path, a: &CacheBenchArgs, ctx: &Ctx<'_>, rows: &[RowRecord]) -> anyhow::Result<()> {
    use crate::plot::{Bars, Figure};
    let no_limit = rows.iter().find(|r| r.kind == RowKind::NoLimit && r.outcome == Outcome::Ok);
    let panels: Vec<Figure> = a
        .levels
        .iter()
        .map(|&l| {
            Figure::Bars(Bars {
                title: format!("job limited to {l}% of the database"),
                y_label: "wall time, s".into(),
                bars: no_limit
                    .into_iter()
                    .chain(rows.iter().filter(|r| r.level == Some(l) && r.outcome == Outcome::Ok))
                    .map(|r| (r.title.clone(), r.wall_secs))
                    .collect(),
            })
        })
        .collect();
    let caption =
        format!("tmem bench cache: {} database, {} lookups per row", tmem_daemon::human(ctx.built.bytes), ctx.queries);
    crate::plot::draw(path, &caption, &panels)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        a: CacheBenchArgs,
    }

    #[test]
    fn arguments_parse_and_titles_say_what_is_delayed() {
        let c = Cli::parse_from(["x"]);
        assert_eq!(c.a.db_mib, 1024);
        assert_eq!(c.a.levels, vec![50, 25]);
        assert_eq!(c.a.rows, RowKind::ALL.to_vec());
        let c = Cli::parse_from(["x", "--rows", "plain,tmem-lz4", "--backing-latency-us", "500", "--levels", "50"]);
        assert_eq!(c.a.rows, vec![RowKind::Plain, RowKind::TmemLz4]);
        assert_eq!(row_title(RowKind::Plain, &c.a), "plain loop (no delay)");
        assert_eq!(row_title(RowKind::TmemLz4, &c.a), "tmem lz4 (+500 us/read)");
        let c = Cli::parse_from(["x", "--rows", "plain-2x,tmem-zstd-dict,tmem-lz4-lru,no-limit"]);
        assert_eq!(row_title(RowKind::Plain2x, &c.a), "plain loop, 2x RAM");
        assert_eq!(c.a.rows.len(), 4);
    }
}
