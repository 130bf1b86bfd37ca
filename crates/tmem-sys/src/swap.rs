//! Swap plumbing: loop devices, mkswap/swapon/swapoff, and the process
//! settings a daemon that serves swap needs (mlockall, PR_SET_IO_FLUSHER,
//! leaving the memory cgroup it serves).
//!
//! Commands come from util-linux (`losetup`, `mkswap`, `swapon`, `swapoff`);
//! each failure carries the command line and what it printed.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Errors of the swap plumbing.
#[derive(Debug, thiserror::Error)]
pub enum SwapError {
    /// A command could not be started.
    #[error("cannot run {cmd}: {source}")]
    Spawn {
        /// Command line.
        cmd: String,
        /// Cause.
        source: std::io::Error,
    },
    /// A command failed.
    #[error("{cmd} failed ({status}): {stderr}")]
    Failed {
        /// Command line.
        cmd: String,
        /// Exit status.
        status: String,
        /// What it printed on stderr.
        stderr: String,
    },
    /// A system call failed.
    #[error("{call}: {source}")]
    Sys {
        /// Which call.
        call: &'static str,
        /// errno.
        source: std::io::Error,
    },
    /// A /proc file could not be read or parsed.
    #[error("{path}: {reason}")]
    Proc {
        /// File.
        path: String,
        /// Why.
        reason: String,
    },
}

/// Runs a command and returns its stdout.
pub fn run(program: &str, args: &[&str]) -> Result<String, SwapError> {
    let cmd = std::iter::once(program).chain(args.iter().copied()).collect::<Vec<_>>().join(" ");
    let out =
        Command::new(program).args(args).output().map_err(|source| SwapError::Spawn { cmd: cmd.clone(), source })?;
    if !out.status.success() {
        return Err(SwapError::Failed {
            cmd,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// Attaches `file` to a free loop device with direct I/O; returns the device path.
pub fn loop_attach(file: &Path) -> Result<PathBuf, SwapError> {
    let f = file.to_string_lossy();
    run("losetup", &["--direct-io=on", "--find", "--show", &f]).map(PathBuf::from)
}

/// Turns off writeback throttling (WBT) on a loop device's queue. WBT holds
/// back writes when read latency rises; for a swap device that means the
/// reclaim which would free memory waits behind swap-ins. Returns the setting
/// written, or `None` when the kernel has no WBT for this queue.
pub fn loop_disable_wbt(dev: &Path) -> Result<Option<String>, SwapError> {
    let name = dev.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let path = format!("/sys/block/{name}/queue/wbt_lat_usec");
    if !Path::new(&path).exists() {
        return Ok(None);
    }
    std::fs::write(&path, "0").map_err(|e| SwapError::Proc { path: path.clone(), reason: e.to_string() })?;
    Ok(Some(format!("{path}=0")))
}

/// Detaches a loop device.
pub fn loop_detach(dev: &Path) -> Result<(), SwapError> {
    run("losetup", &["--detach", &dev.to_string_lossy()]).map(drop)
}

/// Loop devices backed by `file` (from `losetup -j`).
pub fn loops_of(file: &Path) -> Result<Vec<PathBuf>, SwapError> {
    let out = run("losetup", &["--associated", &file.to_string_lossy(), "--noheadings", "--output", "NAME"])?;
    Ok(out.lines().map(str::trim).filter(|l| !l.is_empty()).map(PathBuf::from).collect())
}

/// Loop devices whose backing file lies under `dir`, with that file, from
/// `/sys/block/loop*/loop/backing_file` (which names the file even when it
/// can no longer be opened, as on a dead FUSE mount).
pub fn loops_under(dir: &Path) -> Result<Vec<(PathBuf, PathBuf)>, SwapError> {
    let sys = Path::new("/sys/block");
    let entries =
        std::fs::read_dir(sys).map_err(|e| SwapError::Proc { path: "/sys/block".into(), reason: e.to_string() })?;
    let mut out = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("loop") {
            continue;
        }
        let Ok(backing) = std::fs::read_to_string(e.path().join("loop/backing_file")) else { continue };
        let backing = PathBuf::from(backing.trim_end_matches('\n').trim_end_matches(" (deleted)"));
        if backing.starts_with(dir) {
            out.push((PathBuf::from("/dev").join(&name), backing));
        }
    }
    out.sort();
    Ok(out)
}

/// Lazily unmounts `path` (`umount -l`): it goes at once from the namespace,
/// and for good once nothing uses it (a dead FUSE daemon's mount included).
pub fn unmount_lazy(path: &Path) -> Result<(), SwapError> {
    run("umount", &["--lazy", &path.to_string_lossy()]).map(drop)
}

/// Writes a swap signature.
pub fn mkswap(dev: &Path, label: &str) -> Result<(), SwapError> {
    run("mkswap", &["--label", label, &dev.to_string_lossy()]).map(drop)
}

/// What the kernel tells the device about freed swap slots (`swapon --discard`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SwapDiscard {
    /// Discard the whole area once at swapon. The kernel then reuses freed
    /// slots in partly used clusters first, so a stale page is soon
    /// overwritten and the store frees it: the pool stays close to the data
    /// the kernel holds. Freed slots keep their memory until reused or swapoff.
    #[default]
    Once,
    /// Also discard each 2 MiB cluster when it becomes free, which releases
    /// memory soon after a process exits; but the kernel then prefers fresh
    /// clusters over reusing freed slots, so up to the whole device size of
    /// stale pages can sit in the pool while swap is busy.
    Pages,
}

impl SwapDiscard {
    /// The `swapon --discard=` value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Once => "once",
            Self::Pages => "pages",
        }
    }
}

impl std::str::FromStr for SwapDiscard {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "once" => Ok(Self::Once),
            "pages" => Ok(Self::Pages),
            _ => Err(format!("unknown discard policy {s:?} (once, pages)")),
        }
    }
}

/// Enables swap on `dev` with `priority` and the given discard policy.
pub fn swapon(dev: &Path, priority: i32, discard: SwapDiscard) -> Result<(), SwapError> {
    let discard = format!("--discard={}", discard.as_str());
    run("swapon", &[&discard, "--priority", &priority.to_string(), &dev.to_string_lossy()]).map(drop)
}

/// [`swapon`] for an area whose stale pages the caller drops itself: no
/// discard of the whole area at swapon, which is all `once` does (so it
/// becomes no `--discard` at all); `pages` stays.
pub fn swapon_without_area_discard(dev: &Path, priority: i32, discard: SwapDiscard) -> Result<(), SwapError> {
    let prio = priority.to_string();
    let dev = dev.to_string_lossy();
    match discard {
        SwapDiscard::Once => run("swapon", &["--priority", &prio, &dev]),
        SwapDiscard::Pages => run("swapon", &["--discard=pages", "--priority", &prio, &dev]),
    }
    .map(drop)
}

/// Disables swap on `dev`; the kernel reads every page back first.
pub fn swapoff(dev: &Path) -> Result<(), SwapError> {
    run("swapoff", &[&dev.to_string_lossy()]).map(drop)
}

/// One line of /proc/swaps.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SwapArea {
    /// Device or file path.
    pub path: PathBuf,
    /// Size in bytes.
    pub size: u64,
    /// Bytes in use.
    pub used: u64,
    /// Priority.
    pub priority: i32,
}

/// Parses /proc/swaps.
pub fn parse_swaps(text: &str) -> Result<Vec<SwapArea>, SwapError> {
    let bad = |line: &str| SwapError::Proc { path: "/proc/swaps".into(), reason: format!("bad line {line:?}") };
    let mut v = Vec::new();
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 5 {
            return Err(bad(line));
        }
        let num = |s: &str| s.parse::<u64>().map_err(|_| bad(line));
        v.push(SwapArea {
            path: PathBuf::from(f[0].replace("\\040", " ")),
            size: num(f[2])? * 1024,
            used: num(f[3])? * 1024,
            priority: f[4].parse().map_err(|_| bad(line))?,
        });
    }
    Ok(v)
}

/// Active swap areas.
pub fn swaps() -> Result<Vec<SwapArea>, SwapError> {
    let text = std::fs::read_to_string("/proc/swaps")
        .map_err(|e| SwapError::Proc { path: "/proc/swaps".into(), reason: e.to_string() })?;
    parse_swaps(&text)
}

/// Whether `dev` is an active swap area.
pub fn is_swap(dev: &Path) -> Result<bool, SwapError> {
    Ok(swaps()?.iter().any(|s| s.path == dev))
}

/// `MemTotal` from /proc/meminfo, in bytes.
pub fn total_ram_bytes() -> Result<u64, SwapError> {
    meminfo_field("MemTotal")
}

/// A `kB` field of /proc/meminfo, in bytes.
pub fn meminfo_field(name: &str) -> Result<u64, SwapError> {
    let text = std::fs::read_to_string("/proc/meminfo")
        .map_err(|e| SwapError::Proc { path: "/proc/meminfo".into(), reason: e.to_string() })?;
    parse_meminfo_field(&text, name)
}

fn parse_meminfo_field(text: &str, name: &str) -> Result<u64, SwapError> {
    let bad = |reason: String| SwapError::Proc { path: "/proc/meminfo".into(), reason };
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix(name).and_then(|r| r.strip_prefix(':')) {
            let kb = rest.trim().trim_end_matches("kB").trim();
            return kb.parse::<u64>().map(|k| k * 1024).map_err(|_| bad(format!("bad {name} line {line:?}")));
        }
    }
    Err(bad(format!("no {name} line")))
}

/// `some total` of /proc/pressure/memory: microseconds in which some task
/// waited for memory, since boot. `None` where the kernel has no PSI
/// (`psi=0`, or built without it).
pub fn memory_stall_us() -> Option<u64> {
    parse_stall_us(&std::fs::read_to_string("/proc/pressure/memory").ok()?)
}

fn parse_stall_us(text: &str) -> Option<u64> {
    let some = text.lines().find_map(|l| l.strip_prefix("some "))?;
    some.split_whitespace().find_map(|f| f.strip_prefix("total="))?.parse().ok()
}

/// Locks all current and future memory, faulting pages in as they are
/// touched (`MCL_ONFAULT`), so pool memory is locked without being
/// populated up front.
pub fn mlockall_onfault() -> Result<(), SwapError> {
    use rustix::mm::{mlockall, MlockAllFlags};
    mlockall(MlockAllFlags::CURRENT | MlockAllFlags::FUTURE | MlockAllFlags::ONFAULT)
        .map_err(|e| SwapError::Sys { call: "mlockall", source: e.into() })
}

/// Marks the process as an I/O flusher (`PR_SET_IO_FLUSHER`): its memory
/// allocations do not recurse into I/O it may itself have to serve.
pub fn set_io_flusher() -> Result<(), SwapError> {
    rustix::process::configure_io_flusher_behavior(true)
        .map_err(|e| SwapError::Sys { call: "prctl(PR_SET_IO_FLUSHER)", source: e.into() })
}

/// Makes this process the OOM killer's last choice (`oom_score_adj` -1000,
/// as nbd-client `-swap` and nbdkit `--swap` do): the daemon holds other
/// processes' pages, so its death would kill them all. Returns the value
/// read back.
pub fn protect_from_oom() -> Result<i32, SwapError> {
    const PATH: &str = "/proc/self/oom_score_adj";
    let err = |reason: String| SwapError::Proc { path: PATH.into(), reason };
    std::fs::write(PATH, "-1000").map_err(|e| err(e.to_string()))?;
    let v = std::fs::read_to_string(PATH).map_err(|e| err(e.to_string()))?;
    v.trim().parse().map_err(|_| err(format!("unexpected contents {v:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_memory_stall_time() {
        let text = "some avg10=1.25 avg60=0.50 avg300=0.10 total=123\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=4\n";
        assert_eq!(parse_stall_us(text), Some(123));
        assert_eq!(parse_stall_us("full total=4\n"), None);
        assert_eq!(parse_stall_us("some total=x\n"), None);
    }

    #[test]
    fn parses_proc_swaps() {
        let t = "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n/dev/loop3                              partition\t8388604\t\t1024\t\t100\n/swap\\040file file 100 0 -2\n";
        let v = parse_swaps(t).unwrap();
        assert_eq!(v.len(), 2);
        assert_eq!(
            v[0],
            SwapArea { path: "/dev/loop3".into(), size: 8388604 * 1024, used: 1024 * 1024, priority: 100 }
        );
        assert_eq!(v[1].path, PathBuf::from("/swap file"));
        assert_eq!(v[1].priority, -2);
        assert!(parse_swaps("h\n/dev/x partition 1\n").is_err());
    }

    #[test]
    fn parses_meminfo() {
        let t = "MemTotal:       24576000 kB\nMemFree:        100 kB\n";
        assert_eq!(parse_meminfo_field(t, "MemTotal").unwrap(), 24576000 * 1024);
        assert_eq!(parse_meminfo_field(t, "MemFree").unwrap(), 100 * 1024);
        assert!(parse_meminfo_field(t, "SwapTotal").is_err());
        assert!(total_ram_bytes().unwrap() > 0);
    }

    #[test]
    fn failing_command_reports_stderr() {
        let e = run("ls", &["/definitely/not/here"]).unwrap_err();
        assert!(e.to_string().contains("/definitely/not/here"), "{e}");
        assert!(matches!(run("/no/such/program", &[]), Err(SwapError::Spawn { .. })));
    }
}
