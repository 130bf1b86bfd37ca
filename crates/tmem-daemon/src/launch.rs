//! Starting a daemon from the command line, and stopping it.
//!
//! `tmem swap up` takes the runtime directory's lock itself, before it
//! touches anything there, and hands the locked file to the daemon it
//! starts: so two commands racing for one directory cannot both start a
//! daemon, and the loser changes nothing (not even the log). If the daemon
//! does not come up in time, the command stops it with SIGTERM; the daemon
//! undoes what it set up between two steps, and the command waits for that,
//! so no daemon is left behind without a command line that knows of it.

use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tmem_ctl::{Request, Status};

use crate::runtime::{RuntimeDir, LOG_FILE};
use crate::{DaemonError, DaemonSpec};

/// How long a daemon that was asked to stop during setup may take to undo it.
pub const ROLLBACK_TIMEOUT: Duration = Duration::from_secs(300);

/// Starts `exe daemon --spec JSON` in the background for `spec` and waits up
/// to `timeout` until it is up; returns its status.
pub fn start(mut spec: DaemonSpec, exe: &Path, timeout: Duration) -> Result<Status, DaemonError> {
    let dir = RuntimeDir::create(&spec.runtime_dir)?;
    let lock = dir.lock()?;
    if dir.is_mounted(crate::daemon::MOUNT_DIR)? {
        return Err(DaemonError::Lifecycle(format!(
            "{} is still mounted (left by a daemon that died?); `tmem swap down --runtime-dir {}` cleans up",
            dir.join(crate::daemon::MOUNT_DIR).display(),
            dir.path().display()
        )));
    }
    let log = dir.create_file(LOG_FILE)?;
    spec.lock_fd = Some(lock.inheritable_fd().map_err(|e| DaemonError::Lifecycle(format!("lock: {e}")))?);
    let json = serde_json::to_string(&spec).map_err(|e| DaemonError::Lifecycle(e.to_string()))?;
    let mut child = Command::new(exe)
        .arg("daemon")
        .arg("--spec")
        .arg(json)
        .stdin(Stdio::null())
        .stdout(log.try_clone().map_err(|e| DaemonError::Lifecycle(e.to_string()))?)
        .stderr(log)
        .process_group(0)
        .spawn()
        .map_err(|e| DaemonError::Lifecycle(format!("cannot start the daemon: {e}")))?;
    // The child shares the locked file now; our copy may go.
    drop(lock);
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().map_err(|e| DaemonError::Lifecycle(e.to_string()))? {
            return Err(DaemonError::Lifecycle(format!(
                "the daemon exited during setup ({status}); its log:\n{}",
                dir.log_tail(LOG_TAIL_LINES)
            )));
        }
        if let Ok(r) = tmem_ctl::call_ok(dir.path(), &Request::Status, Duration::from_secs(5)) {
            let st: Status = serde_json::from_value(r).map_err(|e| DaemonError::Lifecycle(e.to_string()))?;
            if st.state == "up" {
                return Ok(st);
            }
        }
        if Instant::now() > deadline {
            return Err(roll_back(&mut child, &dir, timeout));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Stops a daemon that did not come up in time (SIGTERM: it undoes its
/// setup) and waits for it; the error says what happened.
fn roll_back(child: &mut Child, dir: &RuntimeDir, waited: Duration) -> DaemonError {
    let pid = rustix::process::Pid::from_child(child);
    let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    let deadline = Instant::now() + ROLLBACK_TIMEOUT;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return DaemonError::Lifecycle(format!(
                "the daemon did not come up within {} s, so it was stopped and undid its setup; its log:\n{}",
                waited.as_secs(),
                dir.log_tail(LOG_TAIL_LINES)
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
    DaemonError::Lifecycle(format!(
        "the daemon did not come up within {} s nor stop within {} s of SIGTERM, so it was killed; \
         `tmem swap down --runtime-dir {}` removes what it left; its log:\n{}",
        waited.as_secs(),
        ROLLBACK_TIMEOUT.as_secs(),
        dir.path().display(),
        dir.log_tail(LOG_TAIL_LINES)
    ))
}

/// Asks the daemon in `dir` for an orderly teardown and waits until it has
/// exited (its lock is free); returns the steps it took, and its pid.
pub fn stop(dir: &Path) -> Result<(Vec<String>, u32), DaemonError> {
    let status = |v| serde_json::from_value::<Status>(v).map_err(|e| DaemonError::Lifecycle(e.to_string()));
    let before = status(tmem_ctl::call_ok(dir, &Request::Status, Duration::from_secs(5))?)?;
    let rt = RuntimeDir::open(dir)?;
    // swapoff reads every page back: allow it time.
    let after = status(tmem_ctl::call_ok(dir, &Request::Down, Duration::from_secs(3600))?)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while rt.is_locked()? {
        if Instant::now() > deadline {
            return Err(DaemonError::Lifecycle(format!("daemon pid {} did not exit", after.pid)));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok((after.steps.into_iter().skip(before.steps.len()).collect(), after.pid))
}

/// Lines of the daemon's log shown when it fails to come up.
const LOG_TAIL_LINES: usize = 30;
