//! `tmem bench soak` (issue 26 item 5): checksum jobs keep swapping against
//! a pool with a remote tier (two Redis servers, R = 2) and a disk tier
//! below it, while events arrive at seeded random intervals:
//!
//! * `restart`: `tmem swap restart` (a live hand-over, tiers included);
//! * `node-kill`: SIGKILL of one Redis server, which comes back empty a few
//!   seconds later (the remote tier copies its pages again);
//! * `set`: `tmem set` of the pool limit;
//! * `recompress`: `tmem set codec=zstd:3+dict` (a dictionary trained on the
//!   stored pages) or back to lz4, under the recompression thread that runs
//!   throughout (`--recompress zstd:3`);
//! * `daemon-kill`: SIGKILL of the daemon, then recovery (`tmem swap down`)
//!   and a new `swap up`. The jobs running then had pages in it: they are
//!   ended and counted apart.
//!
//! Events come in rounds, each a seeded shuffle of all five, so that a run
//! of five events or more sees each. A job ([`JOB`]) lives 20-60 s, then
//! its slot starts another. The report lists every event, every job's
//! result, the pages lost (failed reads, outside daemon kills: must be 0),
//! the corrupt jobs (must be 0) and the longest stall a job saw. The run
//! fails if any of those is not as it must be, or an event did not recover.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use rand_xoshiro::rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use tmem_ctl::Request;
use tmem_sys::cgroup::{Layout, MemCgroup};

use crate::pressure::workload::{kill_group, spawn_in_cgroups};
use crate::pressure::{install_signal_handlers, interrupted, tmem_in};
use crate::redis::{redis_server_binary, RedisOptions, RedisServer};

/// The checksum job (Python).
const JOB: &str = include_str!("soak/job.py");

/// Arguments of `tmem bench soak`.
#[derive(clap::Args, Debug, Clone, serde::Serialize)]
pub struct SoakArgs {
    /// How long events keep coming; the jobs then finish their run.
    #[arg(long, default_value_t = 10.0)]
    pub minutes: f64,
    /// Seed of the events, their intervals and the jobs.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Jobs running at once, each in a memory cgroup of its own.
    #[arg(long, default_value_t = 2)]
    pub jobs: u32,
    /// Memory each job holds, MiB.
    #[arg(long, default_value_t = 96)]
    pub job_mib: u32,
    /// Each job's memory limit, MiB: the rest of its memory is swapped.
    #[arg(long, default_value_t = 48)]
    pub limit_mib: u32,
    /// tmem's pool limit: the pages past it go to the tiers.
    #[arg(long, default_value = "16M")]
    pub pool_limit: String,
    /// Seconds between events: a seeded draw in MIN..MAX.
    #[arg(long, default_value = "5..15", value_parser = parse_range)]
    pub every: (u64, u64),
    /// Seconds each job runs: a seeded draw in MIN..MAX.
    #[arg(long, default_value = "20..60", value_parser = parse_range)]
    pub job_life: (u64, u64),
    /// Write the report to this JSON file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

impl SoakArgs {
    /// One clear error for the first argument out of range.
    fn check(&self) -> anyhow::Result<()> {
        if !(self.minutes.is_finite() && self.minutes > 0.0 && self.minutes <= 7.0 * 24.0 * 60.0) {
            return Err(anyhow!("--minutes {}: expected more than 0, at most a week", self.minutes));
        }
        for (name, v, max) in
            [("--jobs", self.jobs, 64), ("--job-mib", self.job_mib, 1 << 16), ("--limit-mib", self.limit_mib, 1 << 16)]
        {
            if v == 0 || v > max {
                return Err(anyhow!("{name} {v}: expected 1..={max}"));
            }
        }
        Ok(())
    }
}

fn parse_range(s: &str) -> Result<(u64, u64), String> {
    let bad = || format!("{s:?}: expected MIN..MAX seconds, 1 <= MIN <= MAX");
    let (a, b) = s.split_once("..").ok_or_else(bad)?;
    let (a, b) = (a.trim().parse().map_err(|_| bad())?, b.trim().parse().map_err(|_| bad())?);
    if a == 0 || a > b {
        return Err(bad());
    }
    Ok((a, b))
}

/// The kinds of event, in the order a round starts from before its shuffle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum EventKind {
    /// `tmem swap restart`.
    Restart,
    /// SIGKILL of one Redis server.
    NodeKill,
    /// That server back, empty (not drawn: it follows each `node-kill`).
    NodeBack,
    /// `tmem set pool-limit=`.
    Set,
    /// `tmem set codec=` (a dictionary trained now, or lz4).
    Recompress,
    /// SIGKILL of the daemon, then recovery and `swap up`.
    DaemonKill,
}

const KINDS: [EventKind; 5] =
    [EventKind::Restart, EventKind::NodeKill, EventKind::Set, EventKind::Recompress, EventKind::DaemonKill];

/// One event and how it went.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Event {
    /// Seconds into the run.
    pub at_s: f64,
    pub kind: EventKind,
    /// What was done, in words.
    pub what: String,
    /// Whether it recovered (the command succeeded, the node or daemon came back).
    pub recovered: bool,
    /// How long it took, ms.
    pub took_ms: u64,
}

/// How a job ended.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(rename_all = "kebab-case", tag = "outcome")]
pub enum JobOutcome {
    /// Every pass read back what it wrote.
    Ok { passes: u64, worst_ms: f64 },
    /// A chunk read back wrong: a corrupt page.
    Mismatch { line: String },
    /// It died or printed nothing it should have.
    Died { status: String, stderr: String },
    /// Ended with the daemon that held its pages (`daemon-kill`).
    EndedWithDaemon,
}

/// One job.
#[derive(Clone, Debug, serde::Serialize)]
pub struct JobRecord {
    pub slot: u32,
    pub seed: u64,
    pub started_s: f64,
    pub ended_s: f64,
    #[serde(flatten)]
    pub outcome: JobOutcome,
}

/// What `tmem bench soak` reports.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct SoakReport {
    pub args: Option<SoakArgs>,
    pub events: Vec<Event>,
    pub jobs: Vec<JobRecord>,
    /// Reads that failed, summed over every daemon (each read a lost page).
    pub lost_pages: u64,
    /// Jobs that read back a wrong chunk.
    pub corrupt_jobs: u64,
    /// Jobs that died outside a daemon kill.
    pub died_jobs: u64,
    /// Jobs ended with a killed daemon (expected; counted apart).
    pub ended_with_daemon: u64,
    /// Pages the recoveries after daemon kills reported lost, at most
    /// (expected; counted apart): the swap area's use when the daemon died,
    /// slots that only the swap cache held included.
    pub lost_with_killed_daemons: u64,
    /// The longest one 1 MiB chunk took to read back in any job, ms.
    pub longest_stall_ms: f64,
    /// The longest pause a restart reported, ms.
    pub longest_restart_ms: u64,
    /// Pages the tiers held at the end of the last daemon's run.
    pub tier_pages: u64,
    /// Pages written back to the tiers, summed over daemons.
    pub written_back_pages: u64,
    pub seconds: f64,
}

impl SoakReport {
    /// What is wrong with the run, if anything.
    pub fn failures(&self) -> Vec<String> {
        let mut f = Vec::new();
        if self.lost_pages > 0 {
            f.push(format!("{} pages lost outside daemon kills", self.lost_pages));
        }
        if self.corrupt_jobs > 0 {
            f.push(format!("{} jobs read back a wrong page", self.corrupt_jobs));
        }
        if self.died_jobs > 0 {
            f.push(format!("{} jobs died outside daemon kills", self.died_jobs));
        }
        for e in self.events.iter().filter(|e| !e.recovered) {
            f.push(format!("{:?} at {:.0} s did not recover: {}", e.kind, e.at_s, e.what));
        }
        f
    }
}

/// A running job.
struct Running {
    child: Child,
    seed: u64,
    started: Instant,
    out: PathBuf,
    err: PathBuf,
}

/// Everything set up, undone on drop.
struct Rig {
    exe: PathBuf,
    dir: PathBuf,
    disk: tempfile::TempDir,
    nodes: Vec<RedisServer>,
    groups: Vec<MemCgroup>,
    work: tempfile::TempDir,
    up: bool,
    args: SoakArgs,
}

impl Rig {
    fn tmem(&self, args: &[&str]) -> anyhow::Result<String> {
        tmem_in(&self.exe, &self.dir, args)
    }

    fn swap_up(&mut self) -> anyhow::Result<()> {
        let remote = format!("remote={}", self.nodes.iter().map(RedisServer::url).collect::<Vec<_>>().join(","));
        let disk = format!("disk={}", self.disk.path().display());
        let pool_limit = self.args.pool_limit.clone();
        let args = [
            "swap",
            "up",
            "--size",
            "2G",
            "--pool-limit",
            &pool_limit,
            "--front",
            "none",
            "--tier",
            &remote,
            "--tier",
            &disk,
            "--replicas",
            "2",
            "--recompress",
            "zstd:3",
            "--recompress-after",
            "2",
        ];
        self.up = true;
        self.tmem(&args).map(drop)
    }

    fn stat(&self) -> Option<serde_json::Value> {
        tmem_ctl::call_ok(&self.dir, &Request::Stat, Duration::from_secs(5)).ok()
    }

    fn daemon_pid(&self) -> Option<i32> {
        let st = tmem_ctl::call_ok(&self.dir, &Request::Status, Duration::from_secs(5)).ok()?;
        st.get("pid")?.as_i64().and_then(|p| i32::try_from(p).ok())
    }

    fn start_job(&self, slot: u32, seed: u64, secs: u64) -> anyhow::Result<Running> {
        let out = self.work.path().join(format!("job-{slot}-{seed}.out"));
        let err = self.work.path().join(format!("job-{slot}-{seed}.err"));
        let script = self.work.path().join("job.py");
        let (mib, secs, seed_s) = (self.args.job_mib.to_string(), secs.to_string(), seed.to_string());
        let procs = self.groups[slot as usize].procs_file();
        let child = spawn_in_cgroups(
            &[procs.as_path()],
            "python3",
            &[&script.to_string_lossy(), &mib, &secs, &seed_s],
            File::create(&out)?,
            File::create(&err)?,
        )
        .context("cannot start a job (python3)")?;
        Ok(Running { child, seed, started: Instant::now(), out, err })
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        for g in &self.groups {
            let _ = g.kill_all();
        }
        if self.up {
            if let Err(e) = self.tmem(&["swap", "down"]) {
                tracing::warn!("soak: swap down: {e:#}");
                return;
            }
        }
        // `swap down` keeps the lock and the log for a later `swap up`.
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Seconds since `t0`.
fn secs(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64()
}

/// A draw in `lo..=hi`.
fn draw(rng: &mut Xoshiro256PlusPlus, lo: u64, hi: u64) -> u64 {
    lo + rng.next_u64() % (hi - lo + 1)
}

/// How a finished job ended, from its exit status and output.
fn outcome(status: std::process::ExitStatus, out: &Path, err: &Path) -> JobOutcome {
    let text = std::fs::read_to_string(out).unwrap_or_default();
    let last = text.lines().last().unwrap_or("").to_owned();
    if last.starts_with("MISMATCH") {
        return JobOutcome::Mismatch { line: last };
    }
    let ok = last.strip_prefix("OK ").and_then(|r| {
        let (p, w) = r.split_once(' ')?;
        Some((p.parse().ok()?, w.parse().ok()?))
    });
    match ok {
        Some((passes, worst_ms)) if status.success() => JobOutcome::Ok { passes, worst_ms },
        _ => {
            let stderr = std::fs::read_to_string(err).unwrap_or_default();
            let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
            JobOutcome::Died {
                status: status.to_string(),
                stderr: tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
            }
        }
    }
}

/// The counters of one daemon's run that the report sums.
#[derive(Clone, Copy, Default)]
struct Counts {
    failed_reads: u64,
    written_back: u64,
    tier_pages: u64,
}

impl Counts {
    fn of(st: &serde_json::Value) -> Self {
        let devices = st.as_array().map(Vec::as_slice).unwrap_or_default();
        let sum = |ptr: &str| devices.iter().filter_map(|d| d.pointer(ptr)?.as_u64()).sum();
        Counts {
            failed_reads: sum("/failed_reads"),
            written_back: sum("/store/total/written_back_pages"),
            tier_pages: sum("/store/total/tier_pages"),
        }
    }
}

/// The health of the first tier of a `tmem stat` answer that is not
/// healthy (a node down, or pages short of copies while re-replication
/// runs), if any.
fn unhealthy_tier(st: &serde_json::Value) -> Option<String> {
    let devices = st.as_array().map(Vec::as_slice).unwrap_or_default();
    devices
        .iter()
        .filter_map(|d| d.pointer("/store/tiers")?.as_array())
        .flatten()
        .filter_map(|t| t.get("health")?.as_str())
        .find(|h| *h != "healthy")
        .map(str::to_owned)
}

/// Runs the soak; returns its report (whose [`SoakReport::failures`] say
/// whether it passed).
pub fn soak(args: &SoakArgs) -> anyhow::Result<SoakReport> {
    args.check()?;
    if !rustix::process::geteuid().is_root() {
        return Err(anyhow!("tmem bench soak swaps: run it as root"));
    }
    if redis_server_binary().is_none() {
        return Err(anyhow!("tmem bench soak needs redis-server or valkey-server for its remote tier"));
    }
    install_signal_handlers()?;
    let layout = Layout::detect().map_err(|e| anyhow!("memory cgroups: {e}"))?;
    let id = std::process::id();
    let opts = RedisOptions { maxmemory: Some("16mb".into()), policy: "noeviction".into(), ..Default::default() };
    let nodes = (0..2).map(|_| RedisServer::start(&opts)).collect::<Result<Vec<_>, _>>()?;
    let groups = (0..args.jobs)
        .map(|i| {
            let g = MemCgroup::create(&layout, &format!("tmem-bench-soak-{id}-{i}"))?;
            g.set_limit(Some(u64::from(args.limit_mib) << 20))?;
            Ok(g)
        })
        .collect::<Result<Vec<_>, tmem_sys::cgroup::CgroupError>>()
        .map_err(|e| anyhow!("memory cgroup: {e}"))?;
    let mut rig = Rig {
        exe: std::env::current_exe()?,
        dir: PathBuf::from(format!("/run/tmem-bench-soak-{id}")),
        disk: tempfile::Builder::new().prefix("tmem-bench-soak-disk").tempdir_in("/var/tmp")?,
        nodes,
        groups,
        work: tempfile::tempdir()?,
        up: false,
        args: args.clone(),
    };
    std::fs::write(rig.work.path().join("job.py"), JOB)?;
    rig.swap_up()?;
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(args.seed);
    let mut report = SoakReport { args: Some(args.clone()), ..Default::default() };
    let t0 = Instant::now();
    let until = t0 + Duration::from_secs_f64(args.minutes * 60.0);
    let mut slots: Vec<Option<Running>> = (0..args.jobs).map(|_| None).collect();
    let mut round: Vec<EventKind> = Vec::new();
    let mut next_event = t0 + Duration::from_secs(draw(&mut rng, args.every.0, args.every.1));
    let mut node_back: Option<(Instant, usize)> = None;
    // The current daemon's counters, and the sum over the ones before it.
    let (mut now_counts, mut done) = (Counts::default(), Counts::default());
    let mut last_sample = t0;
    let (mut codec_dict, mut limit_step) = (false, 0usize);
    loop {
        if interrupted() {
            return Err(anyhow!("interrupted; everything set up was undone"));
        }
        let ending = Instant::now() >= until;
        // Jobs: record the finished, start the next while events still come.
        for (slot, run) in slots.iter_mut().enumerate() {
            if let Some(r) = run {
                if let Some(status) = r.child.try_wait()? {
                    let outcome = outcome(status, &r.out, &r.err);
                    let slot = u32::try_from(slot)?;
                    println!("{:7.1} s  job {slot} (seed {}) ended: {outcome:?}", secs(t0), r.seed);
                    let started_s = (r.started - t0).as_secs_f64();
                    report.jobs.push(JobRecord { slot, seed: r.seed, started_s, ended_s: secs(t0), outcome });
                    *run = None;
                }
            }
            if run.is_none() && !ending {
                let life = draw(&mut rng, args.job_life.0, args.job_life.1);
                *run = Some(rig.start_job(u32::try_from(slot)?, rng.next_u64() >> 16, life)?);
            }
        }
        if ending && slots.iter().all(Option::is_none) {
            break;
        }
        if let Some((at, i)) = node_back.filter(|(at, _)| Instant::now() >= *at) {
            let back = rig.nodes[i].restart();
            let took = at.elapsed().as_millis();
            report.events.push(Event {
                at_s: secs(t0),
                kind: EventKind::NodeBack,
                what: format!("Redis node {i} restarted (empty): {back:?}"),
                recovered: back.is_ok(),
                took_ms: u64::try_from(took)?,
            });
            node_back = None;
        }
        if last_sample.elapsed() >= Duration::from_secs(1) {
            if let Some(st) = rig.stat() {
                now_counts = Counts::of(&st);
            }
            last_sample = Instant::now();
        }
        if !ending && Instant::now() >= next_event {
            if round.is_empty() {
                round = KINDS.to_vec();
                for i in (1..round.len()).rev() {
                    round.swap(i, usize::try_from(rng.next_u64() % (i as u64 + 1))?);
                }
            }
            let kind = round.pop().expect("refilled");
            let at_s = secs(t0);
            let started = Instant::now();
            let (what, recovered) = match kind {
                EventKind::Restart => match rig.tmem(&["swap", "restart"]) {
                    Ok(out) => {
                        let line = out.lines().find(|l| l.contains("took over")).unwrap_or("").to_owned();
                        let ms = line.split(" in ").nth(1).and_then(|r| r.split(" ms").next()?.parse().ok());
                        report.longest_restart_ms = report.longest_restart_ms.max(ms.unwrap_or(0));
                        (line, true)
                    }
                    Err(e) => (format!("{e:#}"), false),
                },
                // One failure at a time, as R = 2 is built for: a node is
                // killed only once every page has both its copies again.
                EventKind::NodeKill if node_back.is_none() => match rig.stat().as_ref().map(unhealthy_tier) {
                    Some(None) => {
                        let i = usize::try_from(rng.next_u64() % rig.nodes.len() as u64)?;
                        rig.nodes[i].kill();
                        node_back = Some((Instant::now() + Duration::from_secs(draw(&mut rng, 2, 6)), i));
                        (format!("SIGKILL of Redis node {i}"), true)
                    }
                    Some(Some(why)) => (format!("a tier is not healthy yet ({why}): skipped"), true),
                    None => ("no answer to stat: skipped".into(), true),
                },
                EventKind::NodeKill | EventKind::NodeBack => ("a node is down already: skipped".into(), true),
                EventKind::Set => {
                    let limits = ["12M", "24M", args.pool_limit.as_str()];
                    let v = limits[limit_step % limits.len()];
                    limit_step += 1;
                    let r = rig.tmem(&["set", "swap0", &format!("pool-limit={v}")]);
                    (
                        format!("pool-limit={v}: {}", r.as_ref().map_or_else(|e| format!("{e:#}"), Clone::clone)),
                        r.is_ok(),
                    )
                }
                EventKind::Recompress => {
                    codec_dict = !codec_dict;
                    let v = if codec_dict { "zstd:3+dict" } else { "lz4" };
                    let r = rig.tmem(&["set", "swap0", &format!("codec={v}")]);
                    (format!("codec={v}: {}", r.as_ref().map_or_else(|e| format!("{e:#}"), Clone::clone)), r.is_ok())
                }
                EventKind::DaemonKill => {
                    let r = kill_daemon(&mut rig, &mut slots, &mut report, t0);
                    // The killed daemon's counters as last sampled; the new one starts at 0.
                    done.failed_reads += now_counts.failed_reads;
                    done.written_back += now_counts.written_back;
                    now_counts = Counts::default();
                    match r {
                        Ok(what) => (what, true),
                        Err(e) => (format!("{e:#}"), false),
                    }
                }
            };
            let took_ms = u64::try_from(started.elapsed().as_millis())?;
            println!("{at_s:7.1} s  {kind:?} ({took_ms} ms): {what}");
            report.events.push(Event { at_s, kind, what, recovered, took_ms });
            if !recovered {
                break;
            }
            next_event = Instant::now() + Duration::from_secs(draw(&mut rng, args.every.0, args.every.1));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    if let Some(st) = rig.stat() {
        now_counts = Counts::of(&st);
    }
    report.lost_pages = done.failed_reads + now_counts.failed_reads;
    report.written_back_pages = done.written_back + now_counts.written_back;
    report.tier_pages = now_counts.tier_pages;
    for j in &report.jobs {
        match &j.outcome {
            JobOutcome::Ok { worst_ms, .. } => report.longest_stall_ms = report.longest_stall_ms.max(*worst_ms),
            JobOutcome::Mismatch { .. } => report.corrupt_jobs += 1,
            JobOutcome::Died { .. } => report.died_jobs += 1,
            JobOutcome::EndedWithDaemon => report.ended_with_daemon += 1,
        }
    }
    report.seconds = secs(t0);
    // Jobs still running when an event failed: their pages must leave swap
    // before it goes down, and their cgroups' limits would refuse them.
    for (slot, run) in slots.iter_mut().enumerate() {
        if let Some(mut r) = run.take() {
            kill_group(&mut r.child);
            println!("{:7.1} s  job {slot} (seed {}) stopped: an event failed", secs(t0), r.seed);
        }
    }
    rig.tmem(&["swap", "down"]).context("swap down at the end")?;
    rig.up = false;
    Ok(report)
}

/// `daemon-kill`: SIGKILLs the daemon, ends the jobs that had pages in it,
/// recovers (`swap down`) and brings swap up again.
fn kill_daemon(
    rig: &mut Rig,
    slots: &mut [Option<Running>],
    report: &mut SoakReport,
    t0: Instant,
) -> anyhow::Result<String> {
    let pid = rig.daemon_pid().and_then(rustix::process::Pid::from_raw).ok_or_else(|| anyhow!("no daemon pid"))?;
    rustix::process::kill_process(pid, rustix::process::Signal::KILL)?;
    let gone = Instant::now() + Duration::from_secs(10);
    while rustix::process::test_kill_process(pid).is_ok() {
        if Instant::now() > gone {
            return Err(anyhow!("daemon pid {} did not end after SIGKILL", pid.as_raw_nonzero()));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut ended = 0;
    for (slot, run) in slots.iter_mut().enumerate() {
        if let Some(mut r) = run.take() {
            kill_group(&mut r.child);
            let started_s = (r.started - t0).as_secs_f64();
            let slot = u32::try_from(slot)?;
            report.jobs.push(JobRecord {
                slot,
                seed: r.seed,
                started_s,
                ended_s: secs(t0),
                outcome: JobOutcome::EndedWithDaemon,
            });
            ended += 1;
        }
    }
    let down = rig.tmem(&["swap", "down"]).context("recovery (swap down) after the kill")?;
    rig.up = false;
    rig.swap_up().context("swap up after the recovery")?;
    let recovered = down.lines().last().unwrap_or("").to_owned();
    report.lost_with_killed_daemons += lost_in(&recovered).unwrap_or(0);
    Ok(format!(
        "SIGKILL of daemon pid {}; {ended} jobs ended with it; recovery: {recovered}; swap up again",
        pid.as_raw_nonzero()
    ))
}

/// N of a recovery's "... (at most N pages were lost with the dead daemon)".
fn lost_in(line: &str) -> Option<u64> {
    line.split_once(" pages were lost").and_then(|(a, _)| a.rsplit([' ', '(']).next()?.parse().ok())
}

/// `tmem bench soak`: runs it, prints the report, fails when it must.
pub fn run(args: &SoakArgs) -> anyhow::Result<()> {
    let report = soak(args)?;
    println!(
        "\nsoak: {:.1} min, seed {}: {} events, {} jobs ({} ended with a killed daemon); \
         {} pages written back to the tiers, {} in them at the end",
        report.seconds / 60.0,
        args.seed,
        report.events.len(),
        report.jobs.len(),
        report.ended_with_daemon,
        report.written_back_pages,
        report.tier_pages
    );
    let mut kinds: Vec<String> = Vec::new();
    for k in KINDS.into_iter().chain([EventKind::NodeBack]) {
        let of: Vec<&Event> = report.events.iter().filter(|e| e.kind == k).collect();
        let ok = of.iter().filter(|e| e.recovered).count();
        kinds.push(format!("{k:?} {ok}/{}", of.len()));
    }
    println!("events recovered: {}", kinds.join(", "));
    println!(
        "lost pages (outside daemon kills): {}; lost with killed daemons: {}; corrupt jobs: {}; jobs died: {}; \
         longest stall: {:.1} ms; longest restart pause: {} ms",
        report.lost_pages,
        report.lost_with_killed_daemons,
        report.corrupt_jobs,
        report.died_jobs,
        report.longest_stall_ms,
        report.longest_restart_ms
    );
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?).with_context(|| path.display().to_string())?;
    }
    let failures = report.failures();
    if failures.is_empty() {
        println!("PASS");
        Ok(())
    } else {
        Err(anyhow!("soak failed:\n  {}", failures.join("\n  ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recovery_line_gives_the_pages_lost() {
        assert_eq!(lost_in("tmem swap is down (at most 6 pages were lost with the dead daemon)"), Some(6));
        assert_eq!(lost_in("tmem swap is down (12 pages were lost with the dead daemon)"), Some(12));
        assert_eq!(lost_in("tmem swap is down"), None);
    }

    #[test]
    fn arguments_out_of_range_are_one_clear_error() {
        let ok = SoakArgs {
            minutes: 1.0,
            seed: 1,
            jobs: 2,
            job_mib: 96,
            limit_mib: 48,
            pool_limit: "16M".into(),
            every: (5, 15),
            job_life: (20, 60),
            json: None,
        };
        ok.check().unwrap();
        for (bad, name) in [
            (SoakArgs { minutes: -1.0, ..ok.clone() }, "--minutes -1"),
            (SoakArgs { minutes: f64::NAN, ..ok.clone() }, "--minutes NaN"),
            (SoakArgs { jobs: 0, ..ok.clone() }, "--jobs 0"),
            (SoakArgs { job_mib: 0, ..ok.clone() }, "--job-mib 0"),
            (SoakArgs { limit_mib: 1 << 20, ..ok.clone() }, "--limit-mib 1048576"),
        ] {
            let e = bad.check().unwrap_err().to_string();
            assert!(e.starts_with(name), "{e}");
        }
    }

    #[test]
    fn event_intervals_parse() {
        assert_eq!(parse_range("5..15"), Ok((5, 15)));
        assert_eq!(parse_range("3..3"), Ok((3, 3)));
        for bad in ["0..4", "9..2", "5", "a..b", ""] {
            assert!(parse_range(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_report_fails_on_loss_corruption_death_or_an_unrecovered_event() {
        let mut r = SoakReport::default();
        assert!(r.failures().is_empty());
        r.events.push(Event { at_s: 1.0, kind: EventKind::Restart, what: "x".into(), recovered: false, took_ms: 1 });
        r.lost_pages = 1;
        r.corrupt_jobs = 1;
        r.died_jobs = 1;
        assert_eq!(r.failures().len(), 4);
    }

    #[test]
    fn a_job_outcome_is_read_from_its_last_line() {
        let dir = tempfile::tempdir().unwrap();
        let (out, err) = (dir.path().join("o"), dir.path().join("e"));
        std::fs::write(&err, "").unwrap();
        let ok = std::process::Command::new("true").status().unwrap();
        let failed = std::process::Command::new("false").status().unwrap();
        std::fs::write(&out, "READY\nOK 7 12.5\n").unwrap();
        assert_eq!(outcome(ok, &out, &err), JobOutcome::Ok { passes: 7, worst_ms: 12.5 });
        std::fs::write(&out, "READY\nMISMATCH 3 1\n").unwrap();
        assert!(matches!(outcome(failed, &out, &err), JobOutcome::Mismatch { .. }));
        std::fs::write(&out, "READY\n").unwrap();
        assert!(matches!(outcome(failed, &out, &err), JobOutcome::Died { .. }));
        assert!(matches!(outcome(failed, &out.with_extension("none"), &err), JobOutcome::Died { .. }));
    }
}
