//! Restarts that keep every page: `tmem swap restart`, and the systemd
//! unit's reload and restart.
//!
//! - `tmem swap restart` (by hand, or as the unit's `ExecReload`): a new
//!   daemon process takes over from the running one
//!   (`tmem_daemon::handover`); under systemd it then tells the manager
//!   that it is the unit's main process (`MAINPID=`).
//! - `systemctl restart` stops the unit, then starts it. Its stop
//!   (`ExecStop=tmem swap down --unless-restarting`) sees the restart job
//!   and, instead of swapoff (which reads every page back, and can OOM a
//!   job confined to its memory limit), hands the daemon over to a
//!   successor outside the unit's cgroup, which the stop does not kill.
//!   The start (`ExecStart=tmem swap up --foreground --take-over-running`)
//!   takes that one over in its own process: two hand-overs, and no page
//!   leaves the pool. If the start never comes, the successor outside
//!   goes on serving, and `tmem swap down` stops it.

use std::os::unix::fs::OpenOptionsExt as _;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tmem_ctl::{self as ctl, Request, Status};
use tmem_daemon::handover::Successor;
use tmem_daemon::limits;

/// Arguments of `tmem swap restart`.
#[derive(clap::Args, Debug)]
pub struct RestartArgs {
    /// Runtime directory of the running daemon.
    #[arg(long, default_value = ctl::RUNTIME_DIR)]
    runtime_dir: PathBuf,
    /// Seconds to wait for the new daemon to take over.
    #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..))]
    wait: u64,
}

/// `tmem swap restart`: a new daemon process takes over from the running
/// one (see `tmem_daemon::handover`); if it cannot, the running one goes on.
pub fn restart(a: &RestartArgs) -> anyhow::Result<()> {
    limits::wait("--wait", a.wait)?;
    let done = hand_over(&a.runtime_dir, a.wait, Successor::InService)?;
    for s in &done.steps {
        println!("{s}");
    }
    println!("tmem swap restarted: daemon pid {} -> {}{}", done.old, done.new, done.since);
    done.every_ublk_taken()
}

/// The stop of a `systemctl restart` (`swap down --unless-restarting`):
/// hands the daemon over to a successor outside the unit. Returns false
/// (and does nothing) unless systemd is restarting the unit this process
/// runs in.
pub fn hand_over_for_restart(dir: &Path, wait: u64) -> anyhow::Result<bool> {
    let Some(unit) = own_service() else { return Ok(false) };
    if !restart_job_running(&unit)? {
        return Ok(false);
    }
    println!(
        "systemd restarts {unit}: the daemon goes to a process outside the unit, which the unit's start takes over"
    );
    let done = hand_over(dir, wait, Successor::OutsideService)?;
    for s in &done.steps {
        println!("{s}");
    }
    println!("tmem swap handed over: daemon pid {} -> {} (outside {unit}){}", done.old, done.new, done.since);
    done.every_ublk_taken()?;
    Ok(true)
}

/// A finished hand-over.
struct Done {
    old: u32,
    new: u32,
    /// The new daemon's steps since the old one's.
    steps: Vec<String>,
    /// What happened since, when another restart replaced the new daemon.
    since: String,
}

impl Done {
    /// An error where the new daemon serves but could not take a ublk
    /// device over (its step, printed above, says which and what to do).
    fn every_ublk_taken(&self) -> anyhow::Result<()> {
        if self.steps.iter().any(|s| s.contains(tmem_daemon::handover::UBLK_NOT_RECOVERED)) {
            anyhow::bail!(
                "daemon pid {} serves, but a ublk device was not taken over and its requests wait (see above)",
                self.new
            );
        }
        Ok(())
    }
}

/// Starts `tmem daemon --takeover DIR` and waits until it serves and the
/// old daemon has exited.
fn hand_over(dir: &Path, wait: u64, role: Successor) -> anyhow::Result<Done> {
    let st = |v| serde_json::from_value::<Status>(v);
    let old = st(ctl::call_ok(dir, &Request::Status, Duration::from_secs(10))?)?;
    // The new daemon logs where `swap up`'s does (a foreground daemon logs to its terminal; then the file starts here).
    let log = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(dir.join(tmem_daemon::runtime::LOG_FILE))?;
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.arg("daemon").arg("--takeover").arg(dir);
    if role == Successor::OutsideService {
        // Without INVOCATION_ID the daemon leaves the unit's cgroup for the
        // root one (tmem_sys::cgroup::leave_workload_cgroup), where the
        // unit's stop does not reach it; nor does it speak to systemd.
        cmd.arg("--outside-service");
        for var in ["INVOCATION_ID", "NOTIFY_SOCKET", "WATCHDOG_PID", "WATCHDOG_USEC", "MAINPID"] {
            cmd.env_remove(var);
        }
    }
    let mut child =
        cmd.stdin(std::process::Stdio::null()).stdout(log.try_clone()?).stderr(log).process_group(0).spawn()?;
    let new = child.id();
    let deadline = std::time::Instant::now() + Duration::from_secs(wait);
    loop {
        if let Some(status) = child.try_wait()? {
            if status.success() {
                // A successor exits 0 only after serving: it took over, and
                // another restart (or a swap down) has replaced it since.
                let now = tmem_daemon::handover::who_serves(dir, new);
                return Ok(Done { old: old.pid, new, steps: Vec::new(), since: format!("; since then, {now}") });
            }
            let tail = tmem_daemon::runtime::RuntimeDir::open(dir).map(|d| d.log_tail(5)).unwrap_or_default();
            anyhow::bail!(
                "the new daemon (pid {new}) exited ({status}) without taking over; {}. Its log:\n{tail}",
                tmem_daemon::handover::who_serves(dir, old.pid)
            );
        }
        if let Ok(v) = ctl::call_ok(dir, &Request::Status, Duration::from_secs(5)) {
            let now = st(v)?;
            if now.pid == new && now.state == "up" {
                // The old process exits once it has heard the new one took
                // over, and (shared pools) once the new one has mapped them.
                let within = Duration::from_secs(wait.max(10));
                if !tmem_daemon::handover::wait_for_exit(old.pid, within) {
                    anyhow::bail!(
                        "daemon pid {new} took over, but the old one (pid {}) still runs after {} s",
                        old.pid,
                        within.as_secs()
                    );
                }
                let now = ctl::call_ok(dir, &Request::Status, Duration::from_secs(5))
                    .ok()
                    .and_then(|v| st(v).ok())
                    .filter(|s| s.pid == new)
                    .unwrap_or(now);
                let steps = now.steps.into_iter().skip(old.steps.len()).collect();
                return Ok(Done { old: old.pid, new, steps, since: String::new() });
            }
        }
        if std::time::Instant::now() > deadline {
            anyhow::bail!("the new daemon (pid {new}) did not take over within {wait} s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The systemd service this process runs in (`tmem.service`), if any.
fn own_service() -> Option<String> {
    std::env::var_os("INVOCATION_ID")?;
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    service_of(&own)
}

/// The service named by a `/proc/self/cgroup`: the last path component
/// ending in `.service`, on the unified (v2) line or systemd's own (v1).
fn service_of(proc_self_cgroup: &str) -> Option<String> {
    proc_self_cgroup.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
        let unit = path.rsplit('/').next()?;
        ((controllers.is_empty() || controllers == "name=systemd") && unit.ends_with(".service"))
            .then(|| unit.to_owned())
    })
}

/// Whether systemd runs a restart job for `unit` (`systemctl restart`,
/// `try-restart`, `reload-or-restart`): a line `ID UNIT restart running`
/// of `systemctl list-jobs`.
fn restart_job_running(unit: &str) -> anyhow::Result<bool> {
    let out = std::process::Command::new("systemctl").args(["list-jobs", "--no-legend", "--no-pager"]).output()?;
    if !out.status.success() {
        anyhow::bail!("systemctl list-jobs: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(restart_job_in(&String::from_utf8_lossy(&out.stdout), unit))
}

fn restart_job_in(list_jobs: &str, unit: &str) -> bool {
    list_jobs.lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.get(1) == Some(&unit) && f.get(2) == Some(&"restart")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_service_comes_from_the_unified_or_systemd_line() {
        assert_eq!(service_of("0::/system.slice/tmem.service\n").as_deref(), Some("tmem.service"));
        let v1 = "12:memory:/system.slice/tmem.service\n1:name=systemd:/system.slice/tmem.service\n0::/\n";
        assert_eq!(service_of(v1).as_deref(), Some("tmem.service"));
        assert_eq!(service_of("0::/user.slice/user-0.slice/session-1.scope\n"), None);
        assert_eq!(service_of("12:memory:/system.slice/x.service\n0::/init.scope\n"), None);
    }

    #[test]
    fn only_a_restart_job_of_this_unit_counts() {
        let jobs = "71 tmem.service restart running\n72 swap.target start waiting\n";
        assert!(restart_job_in(jobs, "tmem.service"));
        assert!(!restart_job_in(jobs, "other.service"));
        assert!(!restart_job_in("71 tmem.service stop running\n", "tmem.service"));
        assert!(!restart_job_in("", "tmem.service"));
    }
}
