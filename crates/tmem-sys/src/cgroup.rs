//! Memory cgroups: a throw-away group with a limit, for running a workload
//! under memory pressure, on every layout a machine may have.
//!
//! [`Layout::detect`] reads `/proc/self/mounts`: cgroup v2 only (the
//! unified hierarchy at `/sys/fs/cgroup`, what current distributions and
//! systemd use), v1 (a `memory` controller hierarchy), or hybrid (v1's
//! memory controller plus a v2 mount without it, e.g. at
//! `/sys/fs/cgroup/unified`). The memory controller is used where it is: v1
//! wherever it is mounted, else v2 (enabled in the root's
//! `cgroup.subtree_control` if it is not yet).
//!
//! [`MemCgroup::create`] makes `<root>/<name>` in that hierarchy; the
//! workload joins it by writing its own pid to [`MemCgroup::procs_file`]
//! before it execs (so every page it allocates is charged there). Each
//! method names the file of its version: the limit is `memory.limit_in_bytes`
//! (v1) or `memory.max` (v2, with `memory.swap.max` left at `max`); the peak
//! `memory.max_usage_in_bytes` or `memory.peak`; limit hits `memory.failcnt`
//! or `memory.events`' `max`; OOM kills `memory.oom_control` or
//! `memory.events`' `oom_kill`. [`MemCgroup::remove`] (or dropping the value)
//! kills whatever still runs in it (`cgroup.kill` on v2) and removes the
//! directory.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Where the mount table is read from.
pub const MOUNTS: &str = "/proc/self/mounts";

/// A cgroup version.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Version {
    /// cgroup v1 (one hierarchy per controller).
    V1,
    /// cgroup v2 (the unified hierarchy).
    V2,
}

/// How the machine mounts its cgroups.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Layout {
    /// Only the unified hierarchy (`cgroup2` at `root`).
    V2 {
        /// Mount point, usually `/sys/fs/cgroup`.
        root: PathBuf,
    },
    /// v1 hierarchies only; `memory` is the memory controller's mount point.
    V1 {
        /// Mount point of the memory controller, usually `/sys/fs/cgroup/memory`.
        memory: PathBuf,
    },
    /// v1's memory controller plus a v2 mount (without the memory controller).
    Hybrid {
        /// Mount point of the v1 memory controller.
        memory: PathBuf,
        /// Mount point of the v2 hierarchy, usually `/sys/fs/cgroup/unified`.
        unified: PathBuf,
    },
}

impl Layout {
    /// The layout of this machine.
    pub fn detect() -> Result<Self, CgroupError> {
        let text = std::fs::read_to_string(MOUNTS).map_err(|source| CgroupError::Io {
            op: "read".into(),
            path: MOUNTS.into(),
            source,
        })?;
        Self::from_mounts(&text)
    }

    /// The layout that a mount table (`/proc/self/mounts` format) describes.
    pub fn from_mounts(mounts: &str) -> Result<Self, CgroupError> {
        let mut v1_memory = None;
        let mut v2 = None;
        for line in mounts.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            let [_, target, fstype, options, ..] = f[..] else { continue };
            let target = PathBuf::from(unescape_mount_path(target));
            match fstype {
                "cgroup2" => v2 = v2.or(Some(target)),
                "cgroup" if options.split(',').any(|o| o == "memory") => v1_memory = Some(target),
                _ => {}
            }
        }
        match (v1_memory, v2) {
            (Some(memory), Some(unified)) => Ok(Self::Hybrid { memory, unified }),
            (Some(memory), None) => Ok(Self::V1 { memory }),
            (None, Some(root)) => Ok(Self::V2 { root }),
            (None, None) => Err(CgroupError::NoController),
        }
    }

    /// Short name: `v2`, `v1` or `hybrid`.
    #[must_use]
    pub fn name(&self) -> &'static str {
        match self {
            Self::V2 { .. } => "v2",
            Self::V1 { .. } => "v1",
            Self::Hybrid { .. } => "hybrid",
        }
    }

    /// The hierarchy that has the memory controller, and its version.
    #[must_use]
    pub fn memory_hierarchy(&self) -> (&Path, Version) {
        match self {
            Self::V2 { root } => (root, Version::V2),
            Self::V1 { memory } | Self::Hybrid { memory, .. } => (memory, Version::V1),
        }
    }

    /// Checks that memory cgroups can be made here: on v2, turns the memory
    /// controller on for the root's children if it is off (systemd has it on).
    pub fn ensure_memory_controller(&self) -> Result<(), CgroupError> {
        let (root, version) = self.memory_hierarchy();
        match version {
            Version::V1 if root.join("memory.limit_in_bytes").exists() => Ok(()),
            Version::V1 => Err(CgroupError::NoController),
            Version::V2 => {
                let read = |f: &str| std::fs::read_to_string(root.join(f)).unwrap_or_default();
                let has = |text: String| text.split_whitespace().any(|c| c == "memory");
                if !has(read("cgroup.controllers")) {
                    return Err(CgroupError::NoController);
                }
                if has(read("cgroup.subtree_control")) {
                    return Ok(());
                }
                let path = root.join("cgroup.subtree_control");
                std::fs::write(&path, "+memory").map_err(|source| CgroupError::Io {
                    op: "write \"+memory\" to".into(),
                    path,
                    source,
                })
            }
        }
    }
}

/// Where [`leave_workload_cgroup`] put this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Placement {
    /// It stays in the cgroup of its own systemd unit (e.g.
    /// `/system.slice/tmem.service`), which holds no workload.
    OwnUnit(String),
    /// It moved to the root of the memory hierarchy, whose `cgroup.procs` is given.
    Root(PathBuf),
}

/// Moves this process out of whatever memory cgroup it was started in, so a
/// workload's memory limit never applies to the daemon that holds its pages:
/// to the root of the memory hierarchy, except under systemd on v2, where
/// the process stays in its own service's cgroup (moving it would hide it
/// from systemd). Leaves no cgroup behind: it creates none.
pub fn leave_workload_cgroup(layout: &Layout) -> Result<Placement, CgroupError> {
    let (root, version) = layout.memory_hierarchy();
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let under_systemd = std::env::var_os("INVOCATION_ID").is_some();
    if let Some(unit) = own_unit_cgroup(&own, version).filter(|_| under_systemd) {
        return Ok(Placement::OwnUnit(unit));
    }
    let procs = root.join("cgroup.procs");
    std::fs::write(&procs, std::process::id().to_string()).map_err(|source| CgroupError::Io {
        op: "write our pid to".into(),
        path: procs.clone(),
        source,
    })?;
    Ok(Placement::Root(procs))
}

/// This process's cgroup in the memory hierarchy of `version` (from
/// `/proc/self/cgroup`) when it is a systemd service's own (`*.service`).
#[must_use]
pub fn own_unit_cgroup(proc_self_cgroup: &str, version: Version) -> Option<String> {
    proc_self_cgroup.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
        let ours = match version {
            Version::V2 => controllers.is_empty(),
            Version::V1 => controllers.split(',').any(|c| c == "memory"),
        };
        (ours && path.ends_with(".service")).then(|| path.to_owned())
    })
}

/// Undoes the octal escapes of `/proc/mounts` (`\040` for a space).
fn unescape_mount_path(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('\\') {
        out.push_str(&rest[..i]);
        let code = rest.get(i + 1..i + 4).and_then(|o| u8::from_str_radix(o, 8).ok());
        match code {
            Some(c) => {
                out.push(char::from(c));
                rest = &rest[i + 4..];
            }
            None => {
                out.push('\\');
                rest = &rest[i + 1..];
            }
        }
    }
    out.push_str(rest);
    out
}

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
    /// No memory controller in any mounted cgroup hierarchy.
    #[error("no memory cgroup controller: neither a cgroup v1 memory hierarchy nor a cgroup v2 hierarchy with the memory controller is mounted ({MOUNTS})")]
    NoController,
    /// The version has no such file (e.g. per-group swappiness on v2).
    #[error("cgroup {version:?} has no {what}")]
    Unsupported {
        /// The cgroup version.
        version: Version,
        /// What it lacks.
        what: &'static str,
    },
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

/// A memory cgroup we created; removed by [`MemCgroup::remove`] or on drop.
#[derive(Debug)]
pub struct MemCgroup {
    path: PathBuf,
    version: Version,
    removed: bool,
}

impl MemCgroup {
    /// Creates `<name>` in the memory hierarchy of `layout`. Fails if it
    /// already exists (it would not be ours to remove).
    pub fn create(layout: &Layout, name: &str) -> Result<Self, CgroupError> {
        let (root, version) = layout.memory_hierarchy();
        Self::create_in(root, version, name)
    }

    /// Creates `<root>/<name>` of cgroup `version` (tests use a plain directory).
    pub fn create_in(root: &Path, version: Version, name: &str) -> Result<Self, CgroupError> {
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
        Ok(Self { path, version, removed: false })
    }

    /// Its cgroup version.
    #[must_use]
    pub fn version(&self) -> Version {
        self.version
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

    /// Sets the memory limit (`memory.limit_in_bytes`, or `memory.max` with
    /// `memory.swap.max` left unlimited); `None` removes it.
    pub fn set_limit(&self, bytes: Option<u64>) -> Result<(), CgroupError> {
        match self.version {
            Version::V1 => {
                self.write("memory.limit_in_bytes", &bytes.map_or_else(|| "-1".to_owned(), |b| b.to_string()))
            }
            Version::V2 => {
                self.write("memory.max", &bytes.map_or_else(|| "max".to_owned(), |b| b.to_string()))?;
                self.write("memory.swap.max", "max")
            }
        }
    }

    /// The memory limit (`u64::MAX`, or v1's huge number, when unlimited).
    pub fn limit(&self) -> Result<u64, CgroupError> {
        match self.version {
            Version::V1 => self.read_u64("memory.limit_in_bytes"),
            Version::V2 => self.read_u64_or_max("memory.max"),
        }
    }

    /// Sets `memory.swappiness` (v1 only: v2 has no per-group swappiness,
    /// `vm.swappiness` applies to every group).
    pub fn set_swappiness(&self, swappiness: u32) -> Result<(), CgroupError> {
        match self.version {
            Version::V1 => self.write("memory.swappiness", &swappiness.to_string()),
            Version::V2 => Err(CgroupError::Unsupported {
                version: Version::V2,
                what: "per-group swappiness (vm.swappiness applies)",
            }),
        }
    }

    /// Sets `memory.zswap.max` (v2 only, and only on kernels with zswap; v1
    /// does not charge zswap to groups).
    pub fn set_zswap_max(&self, bytes: Option<u64>) -> Result<(), CgroupError> {
        match self.version {
            Version::V1 => Err(CgroupError::Unsupported { version: Version::V1, what: "memory.zswap.max" }),
            Version::V2 if !self.file("memory.zswap.max").exists() => Err(CgroupError::Unsupported {
                version: Version::V2,
                what: "memory.zswap.max (a kernel without zswap)",
            }),
            Version::V2 => self.write("memory.zswap.max", &bytes.map_or_else(|| "max".to_owned(), |b| b.to_string())),
        }
    }

    /// Memory charged now (`memory.usage_in_bytes` or `memory.current`).
    pub fn usage(&self) -> Result<u64, CgroupError> {
        self.read_u64(match self.version {
            Version::V1 => "memory.usage_in_bytes",
            Version::V2 => "memory.current",
        })
    }

    /// The high-water mark since creation (`memory.max_usage_in_bytes` or `memory.peak`).
    pub fn max_usage(&self) -> Result<u64, CgroupError> {
        self.read_u64(match self.version {
            Version::V1 => "memory.max_usage_in_bytes",
            Version::V2 => "memory.peak",
        })
    }

    /// How often the limit was hit (`memory.failcnt`, or `max` of `memory.events`).
    pub fn failcnt(&self) -> Result<u64, CgroupError> {
        match self.version {
            Version::V1 => self.read_u64("memory.failcnt"),
            Version::V2 => Ok(self.events()?.get("max").copied().unwrap_or(0)),
        }
    }

    /// OOM state: `memory.oom_control` on v1; on v2 `oom_kill` of
    /// `memory.events` (the OOM killer cannot be disabled per group there).
    pub fn oom_control(&self) -> Result<OomControl, CgroupError> {
        match self.version {
            Version::V1 => {
                let text = self.read("memory.oom_control")?;
                parse_oom_control(&text)
                    .ok_or_else(|| CgroupError::Parse { path: self.file("memory.oom_control"), text })
            }
            Version::V2 => {
                let ev = self.events()?;
                Ok(OomControl {
                    oom_kill_disable: false,
                    under_oom: false,
                    oom_kill: ev.get("oom_kill").copied().unwrap_or(0),
                })
            }
        }
    }

    /// `memory.events` (v2).
    pub fn events(&self) -> Result<BTreeMap<String, u64>, CgroupError> {
        self.flat_keyed("memory.events")
    }

    /// `memory.stat` (keys differ: v1 `rss`, `swap`; v2 `anon`, `zswap`, ...).
    pub fn stat(&self) -> Result<BTreeMap<String, u64>, CgroupError> {
        self.flat_keyed("memory.stat")
    }

    fn flat_keyed(&self, name: &str) -> Result<BTreeMap<String, u64>, CgroupError> {
        let text = self.read(name)?;
        parse_flat_keyed(&text).ok_or_else(|| CgroupError::Parse { path: self.file(name), text })
    }

    fn read_u64_or_max(&self, name: &str) -> Result<u64, CgroupError> {
        let text = self.read(name)?;
        if text.trim() == "max" {
            return Ok(u64::MAX);
        }
        parse_u64(&text).ok_or_else(|| CgroupError::Parse { path: self.file(name), text })
    }

    /// Pids in the group.
    pub fn pids(&self) -> Result<Vec<i32>, CgroupError> {
        let text = self.read("cgroup.procs")?;
        parse_pids(&text).ok_or_else(|| CgroupError::Parse { path: self.procs_file(), text })
    }

    /// Sends SIGKILL to every task in the group (`cgroup.kill` on v2, which
    /// also catches tasks forking meanwhile); returns how many there were.
    pub fn kill_all(&self) -> Result<usize, CgroupError> {
        let pids = self.pids()?;
        if self.version == Version::V2 && !pids.is_empty() && self.file("cgroup.kill").exists() {
            self.write("cgroup.kill", "1")?;
            return Ok(pids.len());
        }
        for &pid in &pids {
            // Tasks of a group we made; a pid gone meanwhile is fine.
            if let Some(pid) = rustix::process::Pid::from_raw(pid) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
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
        assert!(MemCgroup::create_in(&root, Version::V1, "a/b").is_err());
        assert!(MemCgroup::create_in(&root, Version::V1, "").is_err());
        {
            let g = MemCgroup::create_in(&root, Version::V1, "g").unwrap();
            assert!(MemCgroup::create_in(&root, Version::V1, "g").is_err(), "exists already");
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
        let g = MemCgroup::create_in(&root, Version::V1, "h").unwrap();
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
        let layout = match Layout::detect().and_then(|l| l.ensure_memory_controller().map(|()| l)) {
            Ok(l) => l,
            Err(e) => {
                tmem_testkit::skip(tmem_testkit::Feature::Memcg, &format!("no memory cgroup controller: {e}"));
                return;
            }
        };
        let g = MemCgroup::create(&layout, &format!("tmem-sys-test-{}", std::process::id())).unwrap();
        g.set_limit(Some(64 << 20)).unwrap();
        assert_eq!(g.limit().unwrap(), 64 << 20);
        match g.version() {
            Version::V1 => g.set_swappiness(60).unwrap(),
            Version::V2 => assert!(g.set_swappiness(60).is_err(), "v2 has no per-group swappiness"),
        }
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
        let stat = g.stat().unwrap();
        assert!(stat.contains_key("rss") || stat.contains_key("anon"), "{stat:?}");
        let path = g.path().to_owned();
        g.remove().unwrap();
        assert!(!path.exists());
        assert!(!child.wait().unwrap().success());
    }

    /// Mount tables recorded on real machines, one per layout.
    const MOUNTS_HYBRID: &str = "sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup /sys/fs/cgroup/systemd cgroup rw,relatime,name=systemd 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
";
    const MOUNTS_V2: &str = "proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0
cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate,memory_recursiveprot 0 0
/dev/vda1 / ext4 rw,relatime,errors=remount-ro 0 0
";
    const MOUNTS_V1: &str = "tmpfs /sys/fs/cgroup tmpfs ro,nosuid,nodev,noexec,mode=755 0 0
cgroup /sys/fs/cgroup/systemd cgroup rw,nosuid,nodev,noexec,relatime,xattr,name=systemd 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,nosuid,nodev,noexec,relatime,memory 0 0
cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,nosuid,nodev,noexec,relatime,cpuacct,cpu 0 0
";

    #[test]
    fn the_three_layouts_are_told_apart() {
        let hybrid = Layout::from_mounts(MOUNTS_HYBRID).unwrap();
        assert_eq!(
            hybrid,
            Layout::Hybrid { memory: "/sys/fs/cgroup/memory".into(), unified: "/sys/fs/cgroup/unified".into() }
        );
        assert_eq!(hybrid.memory_hierarchy(), (Path::new("/sys/fs/cgroup/memory"), Version::V1));
        let v2 = Layout::from_mounts(MOUNTS_V2).unwrap();
        assert_eq!(v2, Layout::V2 { root: "/sys/fs/cgroup".into() });
        assert_eq!(v2.memory_hierarchy(), (Path::new("/sys/fs/cgroup"), Version::V2));
        assert_eq!(Layout::from_mounts(MOUNTS_V1).unwrap(), Layout::V1 { memory: "/sys/fs/cgroup/memory".into() });
        assert!(matches!(Layout::from_mounts("proc /proc proc rw 0 0\n"), Err(CgroupError::NoController)));
        let escaped = "cgroup2 /mnt/my\\040cgroups cgroup2 rw 0 0\n";
        assert_eq!(Layout::from_mounts(escaped).unwrap(), Layout::V2 { root: "/mnt/my cgroups".into() });
        assert_eq!([hybrid.name(), v2.name()], ["hybrid", "v2"]);
    }

    /// A v2 group recorded from a real one (the files the bench touches), in a plain directory.
    #[test]
    fn a_recorded_v2_group_is_read_and_written_through_v2_files() {
        let root = tempfile::tempdir().unwrap();
        std::fs::write(root.path().join("cgroup.controllers"), "cpuset cpu io memory pids\n").unwrap();
        std::fs::write(root.path().join("cgroup.subtree_control"), "cpu\n").unwrap();
        let layout = Layout::V2 { root: root.path().to_owned() };
        layout.ensure_memory_controller().unwrap();
        assert_eq!(std::fs::read_to_string(root.path().join("cgroup.subtree_control")).unwrap(), "+memory");
        let g = MemCgroup::create(&layout, "job").unwrap();
        let put = |f: &str, v: &str| std::fs::write(g.path().join(f), v).unwrap();
        put("memory.max", "max\n");
        put("memory.peak", "335544320\n");
        put("memory.current", "8192\n");
        put("memory.events", "low 0\nhigh 0\nmax 1234\noom 2\noom_kill 1\noom_group_kill 0\n");
        put("memory.stat", "anon 4096\nfile 0\nzswap 512\nzswapped 4096\n");
        assert_eq!(g.limit().unwrap(), u64::MAX);
        g.set_limit(Some(150 << 20)).unwrap();
        assert_eq!(g.read("memory.max").unwrap(), (150u64 << 20).to_string());
        assert_eq!(g.read("memory.swap.max").unwrap(), "max", "swap is never limited");
        assert!(matches!(g.set_zswap_max(None), Err(CgroupError::Unsupported { .. })), "no zswap in this kernel");
        put("memory.zswap.max", "max\n");
        g.set_zswap_max(Some(1 << 20)).unwrap();
        assert_eq!(g.read("memory.zswap.max").unwrap(), "1048576");
        assert_eq!((g.max_usage().unwrap(), g.usage().unwrap(), g.failcnt().unwrap()), (335_544_320, 8192, 1234));
        assert_eq!(g.oom_control().unwrap().oom_kill, 1);
        assert_eq!(g.stat().unwrap()["zswap"], 512);
        assert!(matches!(g.set_swappiness(60), Err(CgroupError::Unsupported { version: Version::V2, .. })));
        for f in [
            "memory.max",
            "memory.swap.max",
            "memory.zswap.max",
            "memory.peak",
            "memory.current",
            "memory.events",
            "memory.stat",
        ] {
            std::fs::remove_file(g.path().join(f)).unwrap();
        }
        g.remove().unwrap();
    }

    #[test]
    fn a_service_keeps_its_own_cgroup() {
        let v2 = "0::/system.slice/tmem.service\n";
        assert_eq!(own_unit_cgroup(v2, Version::V2).as_deref(), Some("/system.slice/tmem.service"));
        assert_eq!(own_unit_cgroup("0::/user.slice/user-0.slice/session-3.scope\n", Version::V2), None);
        let hybrid = "12:memory:/system.slice/tmem.service\n1:name=systemd:/system.slice/tmem.service\n0::/system.slice/tmem.service\n";
        assert_eq!(own_unit_cgroup(hybrid, Version::V1).as_deref(), Some("/system.slice/tmem.service"));
        assert_eq!(own_unit_cgroup("12:memory:/tmem-bench-42\n0::/\n", Version::V1), None);
    }

    #[test]
    fn a_v2_root_without_the_memory_controller_is_refused() {
        let root = tempfile::tempdir().unwrap();
        std::fs::write(root.path().join("cgroup.controllers"), "cpu io pids\n").unwrap();
        let layout = Layout::V2 { root: root.path().to_owned() };
        assert!(matches!(layout.ensure_memory_controller(), Err(CgroupError::NoController)));
        let v1 = Layout::V1 { memory: root.path().to_owned() };
        assert!(matches!(v1.ensure_memory_controller(), Err(CgroupError::NoController)));
    }
}
