//! The workload of `tmem bench pressure`: `--jobs` Python processes, each
//! growing a realistic heap of `--workload-mib / --jobs` MiB and making
//! passes over it (crates/tmem-bench/workload/heap.py, embedded in the binary).
//!
//! Each job joins the run's memory cgroup before it execs Python (a shell
//! writes its own pid to `cgroup.procs`, then execs), so every page it ever
//! allocates is charged to the cgroup. Jobs run in their own process groups,
//! so a Ctrl-C on the terminal reaches only the bench, which kills them.

use super::backend::TmemRun;
use anyhow::anyhow;
use std::fs::File;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};

/// The Python program.
pub const SCRIPT: &str = include_str!("../../workload/heap.py");

/// Where the script and the jobs' outputs live for one bench; removed on drop.
pub struct Workload {
    dir: PathBuf,
    script: PathBuf,
    python: String,
    /// MiB per job.
    pub mib_per_job: u64,
    /// Jobs in parallel.
    pub jobs: u32,
    /// Passes over the heap.
    pub passes: u32,
    /// % of each job's heap built first and then left alone by the passes
    /// (heap.py `--cold-share`; 0: the uniform job).
    pub cold_share: u32,
}

/// The largest `--cold-share`: the passes need a hot part to work on.
pub const MAX_COLD_SHARE: u32 = 90;

impl Workload {
    /// Writes the script to a fresh private directory `dir`.
    pub fn install(
        dir: &Path,
        python: &str,
        total_mib: u64,
        jobs: u32,
        passes: u32,
        cold_share: u32,
    ) -> anyhow::Result<Self> {
        if jobs == 0 || total_mib / u64::from(jobs) < 16 {
            return Err(anyhow!("--workload-mib {total_mib} over --jobs {jobs}: need at least 16 MiB per job"));
        }
        if cold_share > MAX_COLD_SHARE {
            return Err(anyhow!("--cold-share {cold_share}: at most {MAX_COLD_SHARE} (% of each job's heap)"));
        }
        std::os::unix::fs::DirBuilderExt::mode(&mut std::fs::DirBuilder::new(), 0o700)
            .create(dir)
            .map_err(|e| anyhow!("cannot create {}: {e}", dir.display()))?;
        let w = Self {
            dir: dir.to_owned(),
            script: dir.join("heap.py"),
            python: python.to_owned(),
            mib_per_job: total_mib / u64::from(jobs),
            jobs,
            passes,
            cold_share,
        };
        std::fs::write(&w.script, SCRIPT).map_err(|e| anyhow!("cannot write {}: {e}", w.script.display()))?;
        Ok(w)
    }

    /// Seed of job `i` (each job builds a different heap, like different compilation units).
    #[must_use]
    pub fn seed(i: u32) -> u32 {
        i + 1
    }

    /// The arguments of job `i` (after the interpreter). `--cold-share`
    /// is passed only when set, so the default job is today's, exactly.
    #[must_use]
    pub fn job_args(&self, i: u32) -> Vec<String> {
        let mut args = vec![
            self.script.to_string_lossy().into_owned(),
            "--mib".into(),
            self.mib_per_job.to_string(),
            "--seed".into(),
            Self::seed(i).to_string(),
            "--passes".into(),
            self.passes.to_string(),
        ];
        if self.cold_share > 0 {
            args.extend(["--cold-share".into(), self.cold_share.to_string()]);
        }
        args
    }

    /// Starts every job; each joins the cgroup whose `cgroup.procs` is
    /// `procs` first. With `run`, each job runs under `tmem run` with an
    /// even share of the budget.
    pub fn spawn(&self, procs: &Path, run: Option<(&TmemRun, u64)>) -> anyhow::Result<Running> {
        let mut running = Running { jobs: Vec::new() };
        for i in 0..self.jobs {
            let seed = Self::seed(i);
            let out_path = self.dir.join(format!("job{i}.out"));
            let err_path = self.dir.join(format!("job{i}.err"));
            let out = File::create(&out_path).map_err(|e| anyhow!("{}: {e}", out_path.display()))?;
            let err = File::create(&err_path).map_err(|e| anyhow!("{}: {e}", err_path.display()))?;
            let args = self.job_args(i);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let (program, args) = match run {
                Some((r, budget)) => r.wrap(budget / u64::from(self.jobs), &self.python, &args),
                None => (self.python.clone(), args.iter().map(|s| (*s).to_owned()).collect()),
            };
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let child = spawn_in_cgroups(&[procs], &program, &args, out, err)
                .map_err(|e| anyhow!("cannot start the workload (sh, {program}): {e}"))?;
            running.jobs.push(Job { seed, child, out_path, err_path, status: None });
        }
        Ok(running)
    }
}

/// Starts `program ARGS` in its own process group, in every cgroup whose
/// `cgroup.procs` is in `procs`: a shell writes its own pid to each, then
/// execs the program, so every page (and I/O) of the job is charged to
/// them from the start. (Python's environment is set for the Python jobs.)
pub(crate) fn spawn_in_cgroups(
    procs: &[&Path],
    program: &str,
    args: &[&str],
    out: File,
    err: File,
) -> std::io::Result<Child> {
    // `sh -c SCRIPT N PROCS... PROGRAM ARGS...`: joins the N groups, then execs.
    Command::new("sh")
        .arg("-c")
        .arg("n=$0; while [ \"$n\" -gt 0 ]; do echo $$ > \"$1\" || exit 97; shift; n=$((n-1)); done; exec \"$@\"")
        .arg(procs.len().to_string())
        .args(procs)
        .arg(program)
        .args(args)
        .env("PYTHONHASHSEED", "0")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .process_group(0)
        .spawn()
}

/// SIGKILLs the process group of a job started by [`spawn_in_cgroup`]
/// (its own, led by our unreaped child, so the pid cannot have been reused)
/// and reaps it; its exit status, or `None` if it was reaped already.
pub(crate) fn kill_group(child: &mut Child) -> Option<ExitStatus> {
    if let Ok(Some(s)) = child.try_wait() {
        return Some(s);
    }
    if let Some(pid) = i32::try_from(child.id()).ok().and_then(rustix::process::Pid::from_raw) {
        let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
    }
    // A killed job exits at once unless the kernel holds it in an
    // uninterruptible wait (a swap-in that never completes): then say where,
    // once, before waiting on.
    let start = std::time::Instant::now();
    while start.elapsed() < UNKILLABLE_AFTER {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    tracing::warn!(
        "job {} still alive {} s after SIGKILL; kernel stacks of its threads:\n{}",
        child.id(),
        UNKILLABLE_AFTER.as_secs(),
        kernel_stacks(child.id())
    );
    child.wait().ok()
}

/// How long a SIGKILLed job may take to exit before [`kill_group`] reports it.
const UNKILLABLE_AFTER: std::time::Duration = std::time::Duration::from_secs(30);

/// State, wait channel and kernel stack (root only) of each thread of `pid`.
pub(crate) fn kernel_stacks(pid: impl std::fmt::Display) -> String {
    let dir = format!("/proc/{pid}/task");
    let Ok(tasks) = std::fs::read_dir(&dir) else { return format!("{dir}: gone") };
    let mut out = String::new();
    for t in tasks.flatten() {
        let p = t.path();
        let read = |f: &str| std::fs::read_to_string(p.join(f)).unwrap_or_default();
        let state = read("status").lines().find(|l| l.starts_with("State:")).unwrap_or("").to_owned();
        out += &format!("{} {state} wchan {}\n{}", p.display(), read("wchan"), read("stack"));
    }
    out
}

impl Drop for Workload {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

struct Job {
    seed: u32,
    child: Child,
    out_path: PathBuf,
    err_path: PathBuf,
    status: Option<ExitStatus>,
}

/// Jobs of one run; killed on drop if still running.
pub struct Running {
    jobs: Vec<Job>,
}

/// How one job ended.
#[derive(Clone, Debug, serde::Serialize)]
pub struct JobResult {
    /// Its seed.
    pub seed: u32,
    /// Exit code, if it exited.
    pub code: Option<i32>,
    /// Signal, if a signal killed it.
    pub signal: Option<i32>,
    /// Its output (one line: the checksum).
    pub output: String,
    /// The end of what it printed on stderr.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub stderr_tail: String,
}

impl Running {
    /// Reaps finished jobs; `Ok(true)` once every job has ended.
    pub fn poll(&mut self) -> anyhow::Result<bool> {
        let mut done = true;
        for j in &mut self.jobs {
            if j.status.is_none() {
                j.status = j.child.try_wait().map_err(|e| anyhow!("waiting for the workload: {e}"))?;
            }
            done &= j.status.is_some();
        }
        Ok(done)
    }

    /// SIGKILLs every job still running (its whole process group) and reaps it.
    pub fn kill(&mut self) {
        for j in &mut self.jobs {
            if j.status.is_none() {
                j.status = kill_group(&mut j.child);
            }
        }
    }

    /// Results, once every job has ended.
    #[must_use]
    pub fn results(&self) -> Vec<JobResult> {
        self.jobs
            .iter()
            .map(|j| {
                let output = std::fs::read_to_string(&j.out_path).unwrap_or_default().trim().to_owned();
                let err = std::fs::read_to_string(&j.err_path).unwrap_or_default();
                let lines: Vec<&str> = err.lines().collect();
                JobResult {
                    seed: j.seed,
                    code: j.status.and_then(|s| s.code()),
                    signal: j.status.and_then(|s| s.signal()),
                    output,
                    stderr_tail: lines[lines.len().saturating_sub(5)..].join("\n"),
                }
            })
            .collect()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// Runs a 16 MiB job with one pass through [`Workload::spawn`] (its
    /// "cgroup.procs" a plain file) and returns its output line.
    fn job_output(dir: &Path, name: &str, cold_share: u32) -> String {
        let w = Workload::install(&dir.join(name), "python3", 16, 1, 1, cold_share).unwrap();
        let procs = dir.join("procs");
        std::fs::write(&procs, "").unwrap();
        let mut running = w.spawn(&procs, None).unwrap();
        let deadline = Instant::now() + Duration::from_secs(120);
        while !running.poll().unwrap() {
            assert!(Instant::now() < deadline, "heap.py --mib 16 took over 2 minutes");
            std::thread::sleep(Duration::from_millis(20));
        }
        let r = running.results().remove(0);
        assert_eq!(r.code, Some(0), "heap.py failed: {}", r.stderr_tail);
        assert!(r.output.starts_with("checksum "), "{}", r.output);
        r.output
    }

    #[test]
    fn the_cold_share_reaches_the_job_and_its_checksum() {
        if !tmem_testkit::have_tool("python3") {
            return tmem_testkit::skip(tmem_testkit::Feature::Tools, "no python3");
        }
        let tmp = tempfile::tempdir().unwrap();
        let w = Workload::install(&tmp.path().join("args"), "python3", 32, 2, 3, 75).unwrap();
        let args = w.job_args(1);
        assert_eq!(&args[1..], ["--mib", "16", "--seed", "2", "--passes", "3", "--cold-share", "75"]);
        let uniform = Workload::install(&tmp.path().join("args0"), "python3", 32, 2, 3, 0).unwrap();
        assert!(!uniform.job_args(0).contains(&"--cold-share".to_owned()), "the default job is today's");
        assert!(Workload::install(&tmp.path().join("args91"), "python3", 32, 2, 3, 91).is_err());

        let none = job_output(tmp.path(), "none", 0);
        let half = job_output(tmp.path(), "half", 50);
        let again = job_output(tmp.path(), "again", 50);
        let most = job_output(tmp.path(), "most", 90);
        assert!(!none.contains("cold_records"), "{none}");
        assert_eq!(half, again, "the same args give the same checksum");
        assert_ne!(none, half, "the cold part is not modified by the passes, so the checksum changes");
        assert_ne!(half, most);
        // The same records are built whatever the share: only the passes differ.
        let records = |l: &str| l.split_whitespace().skip_while(|w| *w != "records").nth(1).unwrap().to_owned();
        assert_eq!(records(&none), records(&half));
        let cold = |l: &str| l.split_whitespace().skip_while(|w| *w != "cold_records").nth(1).unwrap().parse::<u64>();
        let (n, c50, c90) = (records(&none).parse::<u64>().unwrap(), cold(&half).unwrap(), cold(&most).unwrap());
        assert!(c50 > 0 && c50 < c90 && c90 < n, "{n} records, {c50} cold at 50 %, {c90} at 90 %");
    }
}
