//! cgroup v1 memory controller: a throw-away memory cgroup with a limit, for
//! running a workload under memory pressure.
//!
//! [`MemCgroup::create`] makes `/sys/fs/cgroup/memory/<name>`; the workload
//! joins it by writing its own pid to [`MemCgroup::procs_file`] before it
//! execs (so every page it allocates is charged there). [`MemCgroup::remove`]
//! (or dropping the value) kills whatever still runs in it and removes the
//! directory.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Mount point of the cgroup v1 memory controller.
pub const MEMORY_V1_ROOT: &str = "/sys/fs/cgroup/memory";

/// How long [`MemCgroup::remove`] waits for killed tasks to go away.
const REMOVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors of the cgroup plumbing.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// A cgroup file or directory operation failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was attempted (`mkdir`, `read`, `write 123 to`, `rmdir`).
        op: String,
        /// Path.
        path: PathBuf,
        /// Cause.
        source: io::Error,
    },
    /// A file had unexpected content.
    #[error("{}: cannot parse {text:?}", path.display())]
    Parse {
        /// File.
        path: PathBuf,
        /// Its content.
        text: String,
    },
    /// No cgroup v1 memory controller.
    #[error("no cgroup v1 memory controller at {MEMORY_V1_ROOT} (memory.limit_in_bytes missing)")]
    NoController,
}

/// `memory.oom_control`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct OomControl {
    /// The OOM killer is disabled for the group.
    pub oom_kill_disable: bool,
    /// Tasks are waiting for memory right now.
    pub under_oom: bool,
    /// Tasks the OOM killer killed in this group (0 on kernels without the field).
    pub oom_kill: u64,
}

/// Parses `memory.oom_control` (`oom_kill_disable 0\nunder_oom 0\noom_kill 1\n`).
pub fn parse_oom_control(text: &str) -> Option<OomControl> {
    let m = parse_flat_keyed(text)?;
    Some(OomControl {
        oom_kill_disable: *m.get("oom_kill_disable")? != 0,
        under_oom: *m.get("under_oom")? != 0,
        oom_kill: m.get("oom_kill").copied().unwrap_or(0),
    })
}

/// Parses a flat keyed file (`memory.stat`, `memory.oom_control`): `key value` lines.
pub fn parse_flat_keyed(text: &str) -> Option<BTreeMap<String, u64>> {
    let mut m = BTreeMap::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let mut f = line.split_whitespace();
        let (Some(k), Some(v), None) = (f.next(), f.next(), f.next()) else { return None };
        m.insert(k.to_owned(), v.parse().ok()?);
    }
    Some(m)
}

/// Parses a single-value file such as `memory.max_usage_in_bytes`.
pub fn parse_u64(text: &str) -> Option<u64> {
    text.trim().parse().ok()
}

/// Parses `cgroup.procs` (one pid per line).
pub fn parse_pids(text: &str) -> Option<Vec<i32>> {
    text.split_whitespace().map(|p| p.parse().ok()).collect()
}

/// Whether the cgroup v1 memory controller is mounted where we expect it.
pub fn v1_memory_available() -> Result<(), CgroupError> {
    if Path::new(MEMORY_V1_ROOT).join("memory.limit_in_bytes").exists() {
        Ok(())
    } else {
        Err(CgroupError::NoController)
    }
}

/// A memory cgroup we created; removed by [`MemCgroup::remove`] or on drop.
#[derive(Debug)]
pub struct MemCgroup {
    path: PathBuf,
    removed: bool,
}

impl MemCgroup {
    /// Creates `/sys/fs/cgroup/memory/<name>`. Fails if it already exists
    /// (it would not be ours to remove).
    pub fn create(name: &str) -> Result<Self, CgroupError> {
        Self::create_in(Path::new(MEMORY_V1_ROOT), name)
    }

    /// Creates `<root>/<name>` (tests use a plain directory).
    pub fn create_in(root: &Path, name: &str) -> Result<Self, CgroupError> {
        if name.is_empty() || name.contains('/') || name.starts_with('.') {
            return Err(CgroupError::Io {
                op: "create".into(),
                path: root.join(name),
                source: io::Error::new(io::ErrorKind::InvalidInput, "bad cgroup name"),
            });
        }
        let path = root.join(name);
        std::fs::create_dir(&path).map_err(|source| CgroupError::Io {
            op: "mkdir".into(),
            path: path.clone(),
            source,
        })?;
        Ok(Self { path, removed: false })
    }

    /// The cgroup directory.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file a task writes its pid to, to join.
    #[must_use]
    pub fn procs_file(&self) -> PathBuf {
        self.path.join("cgroup.procs")
    }

    fn file(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// Reads a control file.
    pub fn read(&self, name: &str) -> Result<String, CgroupError> {
        let path = self.file(name);
        std::fs::read_to_string(&path).map_err(|source| CgroupError::Io { op: "read".into(), path, source })
    }

    /// Writes a control file.
    pub fn write(&self, name: &str, value: &str) -> Result<(), CgroupError> {
        let path = self.file(name);
        std::fs::write(&path, value).map_err(|source| CgroupError::Io {
            op: format!("write {value:?} to"),
            path,
            source,
        })
    }

    fn read_u64(&self, name: &str) -> Result<u64, CgroupError> {
        let text = self.read(name)?;
        parse_u64(&text).ok_or_else(|| CgroupError::Parse { path: self.file(name), text })
    }

    /// Sets `memory.limit_in_bytes`; `None` removes the limit.
    pub fn set_limit(&self, bytes: Option<u64>) -> Result<(), CgroupError> {
        self.write("memory.limit_in_bytes", &bytes.map_or_else(|| "-1".to_owned(), |b| b.to_string()))
    }

    /// `memory.limit_in_bytes` (a huge number when unlimited).
    pub fn limit(&self) -> Result<u64, CgroupError> {
        self.read_u64("memory.limit_in_bytes")
    }

    /// Sets `memory.swappiness`.
    pub fn set_swappiness(&self, swappiness: u32) -> Result<(), CgroupError> {
        self.write("memory.swappiness", &swappiness.to_string())
    }

    /// `memory.usage_in_bytes`.
    pub fn usage(&self) -> Result<u64, CgroupError> {
        self.read_u64("memory.usage_in_bytes")
    }

    /// `memory.max_usage_in_bytes`: the high-water mark since creation.
    pub fn max_usage(&self) -> Result<u64, CgroupError> {
        self.read_u64("memory.max_usage_in_bytes")
    }

    /// `memory.failcnt`: how often the limit was hit.
    pub fn failcnt(&self) -> Result<u64, CgroupError> {
        self.read_u64("memory.failcnt")
    }

    /// `memory.oom_control`.
    pub fn oom_control(&self) -> Result<OomControl, CgroupError> {
        let text = self.read("memory.oom_control")?;
        parse_oom_control(&text).ok_or_else(|| CgroupError::Parse { path: self.file("memory.oom_control"), text })
    }

    /// `memory.stat`.
    pub fn stat(&self) -> Result<BTreeMap<String, u64>, CgroupError> {
        let text = self.read("memory.stat")?;
        parse_flat_keyed(&text).ok_or_else(|| CgroupError::Parse { path: self.file("memory.stat"), text })
    }

    /// Pids in the group.
    pub fn pids(&self) -> Result<Vec<i32>, CgroupError> {
        let text = self.read("cgroup.procs")?;
        parse_pids(&text).ok_or_else(|| CgroupError::Parse { path: self.procs_file(), text })
    }

    /// Sends SIGKILL to every task in the group; returns how many there were.
    pub fn kill_all(&self) -> Result<usize, CgroupError> {
        let pids = self.pids()?;
        for &pid in &pids {
            if pid > 0 {
                // SAFETY: kill(2) takes plain integers and touches no memory of ours.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        Ok(pids.len())
    }

    /// Kills what still runs in the group, waits for it to exit, and
    /// removes the directory.
    pub fn remove(mut self) -> Result<(), CgroupError> {
        self.removed = true;
        self.remove_now()
    }

    fn remove_now(&self) -> Result<(), CgroupError> {
        let deadline = Instant::now() + REMOVE_TIMEOUT;
        loop {
            let left = if self.procs_file().exists() { self.kill_all()? } else { 0 };
            let res: io::Result<()> = if left == 0 {
                match std::fs::remove_dir(&self.path) {
                    Ok(()) => return Ok(()),
                    Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
                    Err(e) => Err(e),
                }
            } else {
                Err(io::Error::other(format!("{left} task(s) still in the group")))
            };
            if let Err(source) = res {
                if Instant::now() > deadline {
                    return Err(CgroupError::Io { op: "rmdir".into(), path: self.path.clone(), source });
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for MemCgroup {
    fn drop(&mut self) {
        if !self.removed {
            if let Err(e) = self.remove_now() {
                tracing::warn!("could not remove memory cgroup {}: {e}; remove it by hand", self.path.display());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cgroup_files() {
        let oom = "oom_kill_disable 0\nunder_oom 1\noom_kill 3\n";
        assert_eq!(parse_oom_control(oom), Some(OomControl { oom_kill_disable: false, under_oom: true, oom_kill: 3 }));
        // Older kernels have no oom_kill line.
        assert_eq!(parse_oom_control("oom_kill_disable 1\nunder_oom 0\n").map(|o| o.oom_kill), Some(0));
        assert_eq!(parse_oom_control("under_oom 0\n"), None);
        let stat = parse_flat_keyed("cache 4096\nrss 8192\nswap 0\ntotal_rss 8192\n").unwrap();
        assert_eq!(stat["rss"], 8192);
        assert_eq!(stat.len(), 4);
        assert!(parse_flat_keyed("cache x\n").is_none());
        assert_eq!(parse_u64("9223372036854771712\n"), Some(9_223_372_036_854_771_712));
        assert_eq!(parse_u64("-1"), None);
        assert_eq!(parse_pids("12\n345\n"), Some(vec![12, 345]));
        assert_eq!(parse_pids(""), Some(vec![]));
        assert_eq!(parse_pids("1\nx\n"), None);
    }

    #[test]
    fn plain_directory_group_is_created_and_removed() {
        let root = std::env::temp_dir().join(format!("tmem-cgroup-test-{}", std::process::id()));
        std::fs::create_dir_all(&root).unwrap();
        assert!(MemCgroup::create_in(&root, "a/b").is_err());
        assert!(MemCgroup::create_in(&root, "").is_err());
        {
            let g = MemCgroup::create_in(&root, "g").unwrap();
            assert!(MemCgroup::create_in(&root, "g").is_err(), "exists already");
            g.set_limit(Some(1 << 20)).unwrap();
            assert_eq!(g.limit().unwrap(), 1 << 20);
            g.set_limit(None).unwrap();
            assert_eq!(g.read("memory.limit_in_bytes").unwrap(), "-1");
            std::fs::write(g.file("memory.oom_control"), "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n").unwrap();
            assert_eq!(g.oom_control().unwrap().oom_kill, 2);
            // A plain directory with files cannot be rmdir'ed: empty it as the kernel would.
            for f in ["memory.limit_in_bytes", "memory.oom_control"] {
                std::fs::remove_file(g.file(f)).unwrap();
            }
        } // dropped: removed
        assert!(!root.join("g").exists());
        let g = MemCgroup::create_in(&root, "h").unwrap();
        g.remove().unwrap();
        assert!(!root.join("h").exists());
        std::fs::remove_dir(&root).unwrap();
    }

    #[test]
    fn real_memory_cgroup_when_root() {
        if !crate::is_root() {
            tmem_testkit::skip(tmem_testkit::Feature::Root, "needs root to create a memory cgroup");
            return;
        }
        if let Err(e) = v1_memory_available() {
            tmem_testkit::skip(tmem_testkit::Feature::Memcg, &format!("no cgroup v1 memory controller: {e}"));
            return;
        }
        let g = MemCgroup::create(&format!("tmem-sys-test-{}", std::process::id())).unwrap();
        g.set_limit(Some(64 << 20)).unwrap();
        assert_eq!(g.limit().unwrap(), 64 << 20);
        g.set_swappiness(60).unwrap();
        // A task that joins and sleeps; remove() must kill it.
        let procs = g.procs_file();
        let mut child = std::process::Command::new("sh")
            .arg("-c")
            .arg("echo $$ > \"$0\" && exec sleep 30")
            .arg(&procs)
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while g.pids().unwrap().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(g.pids().unwrap().len(), 1);
        assert!(g.max_usage().unwrap() > 0);
        assert_eq!(g.oom_control().unwrap().oom_kill, 0);
        assert!(g.stat().unwrap().contains_key("rss"));
        let path = g.path().to_owned();
        g.remove().unwrap();
        assert!(!path.exists());
        assert!(!child.wait().unwrap().success());
    }
}
