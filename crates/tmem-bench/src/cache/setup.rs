//! What `tmem bench cache` sets up, each piece undoing itself on drop (so an
//! error, a panic or Ctrl-C leaves no loop device, mount, daemon or cgroup
//! behind): the scratch directory, loop devices, mounts, the tmem cache
//! daemon, and the cgroup v1 blkio group that throttles the disk holding the
//! backing image.

use anyhow::anyhow;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal};
use tmem_ctl::{self as ctl, Request};

use crate::pressure::cmd;

/// A private directory, removed (with what is in it) on drop; the mount
/// guards, declared after it where it is held, are dropped first.
pub struct Scratch {
    dir: PathBuf,
    parent_created: Option<PathBuf>,
}

impl Scratch {
    /// Creates `parent/<name>` (0700); `parent` is created if missing and then
    /// removed again at the end if it is empty.
    pub fn create(parent: &Path, name: &str) -> anyhow::Result<Self> {
        let parent_created = if parent.exists() {
            None
        } else {
            std::fs::create_dir_all(parent).map_err(|e| anyhow!("cannot create {}: {e}", parent.display()))?;
            Some(parent.to_owned())
        };
        let dir = parent.join(name);
        std::os::unix::fs::DirBuilderExt::mode(&mut std::fs::DirBuilder::new(), 0o700)
            .create(&dir)
            .map_err(|e| anyhow!("cannot create {}: {e}", dir.display()))?;
        Ok(Self { dir, parent_created })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // Never remove through a mount that is still there.
        if mounted_under(&self.dir) {
            tracing::warn!("{} still has a mount under it; not removed", self.dir.display());
            return;
        }
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            tracing::warn!("cannot remove {}: {e}", self.dir.display());
        }
        if let Some(p) = &self.parent_created {
            let _ = std::fs::remove_dir(p);
        }
    }
}

/// Whether anything is mounted at or under `dir` (from /proc/mounts).
pub fn mounted_under(dir: &Path) -> bool {
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    let d = dir.to_string_lossy().into_owned();
    mounts.lines().any(|l| l.split_whitespace().nth(1).is_some_and(|m| m == d || m.starts_with(&format!("{d}/"))))
}

/// A loop device we attached; detached on drop.
pub struct LoopDev {
    path: Option<PathBuf>,
}

impl LoopDev {
    /// `losetup --find --show [--direct-io=on] [--read-only] FILE`.
    pub fn attach(file: &Path, direct_io: bool, read_only: bool) -> anyhow::Result<Self> {
        let f = file.to_string_lossy();
        let mut args = vec!["--find", "--show"];
        if direct_io {
            args.push("--direct-io=on");
        }
        if read_only {
            args.push("--read-only");
        }
        args.push(&f);
        let out = cmd("losetup", &args)?;
        let path = PathBuf::from(out.lines().last().unwrap_or_default().trim());
        if !path.starts_with("/dev/") {
            return Err(anyhow!("losetup printed {out:?}, not a device"));
        }
        Ok(Self { path: Some(path) })
    }

    /// The device node.
    pub fn path(&self) -> &Path {
        self.path.as_deref().unwrap_or(Path::new(""))
    }

    /// Detaches it now.
    pub fn detach(mut self) -> anyhow::Result<()> {
        self.detach_now()
    }

    fn detach_now(&mut self) -> anyhow::Result<()> {
        let Some(p) = self.path.take() else { return Ok(()) };
        // udev may hold the device open a moment after umount: retried.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match cmd("losetup", &["-d", &p.to_string_lossy()]) {
                Ok(_) => return Ok(()),
                Err(e) if Instant::now() > deadline => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }
}

impl Drop for LoopDev {
    fn drop(&mut self) {
        let name = self.path().display().to_string();
        if let Err(e) = self.detach_now() {
            tracing::warn!("loop device {name} not detached: {e}; run losetup -d {name}");
        }
    }
}

/// A filesystem we mounted; unmounted on drop (lazily if it is busy).
pub struct Mounted {
    dir: Option<PathBuf>,
}

impl Mounted {
    /// `mount -t ext4 -o OPTIONS DEV DIR`.
    pub fn ext4(dev: &Path, dir: &Path, options: &str) -> anyhow::Result<Self> {
        cmd("mount", &["-t", "ext4", "-o", options, &dev.to_string_lossy(), &dir.to_string_lossy()])?;
        Ok(Self { dir: Some(dir.to_owned()) })
    }

    /// Unmounts it now.
    pub fn unmount(mut self) -> anyhow::Result<()> {
        self.unmount_now()
    }

    fn unmount_now(&mut self) -> anyhow::Result<()> {
        let Some(d) = self.dir.take() else { return Ok(()) };
        let d = d.to_string_lossy().into_owned();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match cmd("umount", &[&d]) {
                Ok(_) => return Ok(()),
                Err(e) if Instant::now() > deadline => {
                    let _ = cmd("umount", &["-l", &d]);
                    return Err(e);
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if let Some(d) = self.dir.clone() {
            if let Err(e) = self.unmount_now() {
                tracing::warn!("{} not unmounted cleanly ({e}); detached lazily", d.display());
            }
        }
    }
}

/// This binary's path (a rebuilt binary shows as "PATH (deleted)": use PATH).
pub fn current_exe() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let s = exe.to_string_lossy();
    Ok(s.strip_suffix(" (deleted)").map_or_else(|| exe.clone(), PathBuf::from))
}

/// How `tmem cache up` is started.
#[derive(Clone, Debug)]
pub struct CacheUp<'a> {
    /// The backing image.
    pub backing: &'a Path,
    /// `--codec`.
    pub codec: &'a str,
    /// `--pool-limit`, bytes.
    pub pool_limit: u64,
    /// `--eviction`.
    pub eviction: &'a str,
    /// `--backing-latency-us`.
    pub latency_us: u64,
    /// The runtime directory (must not exist).
    pub dir: &'a Path,
    /// `cgroup.procs` of a blkio group the daemon starts in (the throttle).
    pub blkio_procs: Option<&'a Path>,
    /// The tmem binary.
    pub exe: &'a Path,
}

/// A cache daemon started with `tmem cache up`; stopped with `tmem cache
/// down` (SIGTERM if that fails) on drop, and its runtime directory removed.
pub struct TmemCache {
    dir: PathBuf,
    exe: PathBuf,
    /// Daemon pid.
    pub pid: Option<i32>,
    /// The loop device the daemon attached over its FUSE file.
    pub loop_dev: Option<PathBuf>,
    /// What `tmem cache up` printed.
    pub up_output: String,
    started: bool,
}

impl TmemCache {
    /// `tmem cache up --backing ... --runtime-dir DIR --wait 60`, in the
    /// blkio group when one is given (the daemon inherits it; it leaves only
    /// its memory cgroup).
    pub fn up(u: &CacheUp<'_>) -> anyhow::Result<Self> {
        if u.dir.exists() {
            return Err(anyhow!("{} exists already; is another bench running?", u.dir.display()));
        }
        let mut t = Self {
            dir: u.dir.to_owned(),
            exe: u.exe.to_owned(),
            pid: None,
            loop_dev: None,
            up_output: String::new(),
            started: true,
        };
        let exe = u.exe;
        let mut args: Vec<String> = vec!["cache".into(), "up".into(), "--backing".into()];
        args.push(u.backing.to_string_lossy().into_owned());
        args.extend(["--codec".into(), u.codec.into()]);
        args.extend(["--pool-limit".into(), u.pool_limit.to_string(), "--eviction".into(), u.eviction.into()]);
        args.extend(["--backing-latency-us".into(), u.latency_us.to_string()]);
        args.extend(["--runtime-dir".into(), u.dir.to_string_lossy().into_owned(), "--wait".into(), "60".into()]);
        let procs = u.blkio_procs.map_or_else(|| "-".to_owned(), |p| p.to_string_lossy().into_owned());
        let out = Command::new("sh")
            .arg("-c")
            .arg("if [ \"$0\" != - ]; then echo $$ > \"$0\" || exit 97; fi; exec \"$@\"")
            .arg(&procs)
            .arg(exe)
            .args(&args)
            .stdin(Stdio::null())
            .process_group(0)
            .output()
            .map_err(|e| anyhow!("cannot run {} cache up: {e}", exe.display()))?;
        t.up_output = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        // Whether or not `up` succeeded, learn what runs so that teardown finds it.
        if let Ok(st) = ctl::call_ok(&t.dir, &Request::Status, Duration::from_secs(5)) {
            if let Ok(st) = serde_json::from_value::<ctl::Status>(st) {
                t.pid = i32::try_from(st.pid).ok().filter(|p| *p > 0);
                t.loop_dev = st.devices.iter().find_map(|d| d.loop_dev.clone());
            }
        }
        if !out.status.success() {
            return Err(anyhow!("tmem cache up failed ({}): {}", out.status, t.up_output.trim()));
        }
        if t.loop_dev.is_none() {
            t.loop_dev = loop_dev_from_up_output(&t.up_output);
        }
        if t.loop_dev.is_none() {
            return Err(anyhow!("tmem cache up attached no loop device: {}", t.up_output.trim()));
        }
        Ok(t)
    }

    /// The cache device's counters.
    pub fn stats(&self) -> anyhow::Result<tmem_block::DeviceStats> {
        let data = ctl::call_ok(&self.dir, &Request::Stat, Duration::from_secs(10))
            .map_err(|e| anyhow!("tmem stat ({}): {e}", self.dir.display()))?;
        let all: Vec<tmem_block::DeviceStats> =
            serde_json::from_value(data).map_err(|e| anyhow!("tmem stat: unexpected answer: {e}"))?;
        let n = all.len();
        all.into_iter()
            .find(|d| d.backing.is_some())
            .ok_or_else(|| anyhow!("tmem stat: none of the {n} device(s) has a backing store"))
    }

    /// `tmem cache down`, then waits for the daemon to exit.
    pub fn down(mut self) -> anyhow::Result<()> {
        self.down_now()
    }

    fn down_now(&mut self) -> anyhow::Result<()> {
        if !std::mem::take(&mut self.started) {
            return Ok(());
        }
        let down = cmd(&self.exe.to_string_lossy(), &["cache", "down", "--runtime-dir", &self.dir.to_string_lossy()]);
        if let Some(pid) = self.pid.and_then(Pid::from_raw) {
            let alive = || rustix::process::test_kill_process(pid).is_ok();
            if down.is_err() && alive() {
                // SIGTERM makes the daemon tear down and exit.
                let _ = rustix::process::kill_process(pid, Signal::TERM);
            }
            let deadline = Instant::now() + Duration::from_secs(120);
            while alive() {
                if Instant::now() > deadline {
                    return Err(anyhow!("tmem daemon pid {pid} did not exit ({down:?})"));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        } else if let Err(e) = &down {
            return Err(anyhow!("{e:#}"));
        }
        if mounted_under(&self.dir) {
            return Err(anyhow!("{} is still mounted after tmem cache down ({down:?})", self.dir.display()));
        }
        if self.dir.exists() {
            std::fs::remove_dir_all(&self.dir).map_err(|e| anyhow!("cannot remove {}: {e}", self.dir.display()))?;
        }
        if let Err(e) = down {
            tracing::info!("tmem cache down failed ({e}), but SIGTERM stopped the daemon cleanly");
        }
        Ok(())
    }
}

impl Drop for TmemCache {
    fn drop(&mut self) {
        if let Err(e) = self.down_now() {
            tracing::warn!(
                "tmem cache daemon in {} not stopped: {e}; run tmem cache down --runtime-dir {0}",
                self.dir.display()
            );
        }
    }
}

/// The loop device of a `... -> /dev/loopN` line of `tmem cache up`'s output.
pub fn loop_dev_from_up_output(out: &str) -> Option<PathBuf> {
    out.lines().filter(|l| l.contains("losetup")).find_map(|l| {
        let dev = l.rsplit("->").next()?.trim();
        dev.starts_with("/dev/loop").then(|| PathBuf::from(dev))
    })
}

/// The whole disk (MAJ:MIN) that holds `file`: the device of its
/// filesystem, or that device's parent when it is a partition.
pub fn disk_of(file: &Path) -> anyhow::Result<(u32, u32)> {
    let dev = std::fs::metadata(file).map_err(|e| anyhow!("{}: {e}", file.display()))?.dev();
    let (maj, min) = (rustix::fs::major(dev), rustix::fs::minor(dev));
    let sys = PathBuf::from(format!("/sys/dev/block/{maj}:{min}"));
    if maj == 0 || !sys.exists() {
        return Err(anyhow!(
            "{} is on a filesystem without a block device ({maj}:{min}: tmpfs, overlay?); no disk to throttle",
            file.display()
        ));
    }
    if sys.join("partition").exists() {
        let parent = std::fs::canonicalize(&sys).map_err(|e| anyhow!("{}: {e}", sys.display()))?.join("../dev");
        let text = std::fs::read_to_string(&parent).map_err(|e| anyhow!("{}: {e}", parent.display()))?;
        return parse_maj_min(&text).ok_or_else(|| anyhow!("{}: cannot parse {text:?}", parent.display()));
    }
    Ok((maj, min))
}

/// Parses `MAJ:MIN`.
pub fn parse_maj_min(text: &str) -> Option<(u32, u32)> {
    let (a, b) = text.trim().split_once(':')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

/// The cgroup v1 blkio hierarchy's mount point, when it has the throttle files.
pub fn blkio_root() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    mounts.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        let [_, target, "cgroup", options, ..] = f[..] else { return None };
        let dir = PathBuf::from(target);
        (options.split(',').any(|o| o == "blkio") && dir.join("blkio.throttle.read_iops_device").exists())
            .then_some(dir)
    })
}

/// A cgroup v1 blkio group that limits reads from one disk; removed on drop.
pub struct BlkioThrottle {
    dir: PathBuf,
    removed: bool,
}

impl BlkioThrottle {
    /// Creates `<blkio root>/<name>` limiting reads from `disk` to `iops`
    /// and/or `bps` (0: no such limit).
    pub fn create(name: &str, disk: (u32, u32), iops: u64, bps: u64) -> anyhow::Result<Self> {
        let root = blkio_root().ok_or_else(|| anyhow!("no cgroup v1 blkio hierarchy with throttling is mounted"))?;
        let dir = root.join(name);
        std::fs::create_dir(&dir).map_err(|e| anyhow!("cannot create {}: {e}", dir.display()))?;
        let t = Self { dir, removed: false };
        let (maj, min) = disk;
        for (file, v) in [("blkio.throttle.read_iops_device", iops), ("blkio.throttle.read_bps_device", bps)] {
            if v > 0 {
                let p = t.dir.join(file);
                std::fs::write(&p, format!("{maj}:{min} {v}")).map_err(|e| anyhow!("{}: {e}", p.display()))?;
            }
        }
        Ok(t)
    }

    /// The file a task writes its pid to, to join.
    pub fn procs_file(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }

    /// Removes the group (waiting for its tasks to exit).
    pub fn remove(mut self) -> anyhow::Result<()> {
        self.removed = true;
        self.remove_now()
    }

    fn remove_now(&self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match std::fs::remove_dir(&self.dir) {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
                Err(e) if Instant::now() > deadline => {
                    let pids = std::fs::read_to_string(self.procs_file()).unwrap_or_default();
                    return Err(anyhow!("cannot remove {}: {e} (tasks: {})", self.dir.display(), pids.trim()));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }
}

impl Drop for BlkioThrottle {
    fn drop(&mut self) {
        if !self.removed {
            if let Err(e) = self.remove_now() {
                tracing::warn!("{e}; remove it by hand");
            }
        }
    }
}

/// Reads and reads completed of a block device (`/sys/block/NAME/stat`
/// fields 1 and 3, sectors ×512): (read I/Os, read bytes).
pub fn block_reads(dev: &Path) -> anyhow::Result<(u64, u64)> {
    let name = dev.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let p = format!("/sys/block/{name}/stat");
    let text = std::fs::read_to_string(&p).map_err(|e| anyhow!("{p}: {e}"))?;
    parse_block_stat(&text).ok_or_else(|| anyhow!("{p}: cannot parse {text:?}"))
}

/// (read I/Os, read bytes) of `/sys/block/*/stat` text.
pub fn parse_block_stat(text: &str) -> Option<(u64, u64)> {
    let f: Vec<u64> = text.split_whitespace().take(3).map(|v| v.parse().ok()).collect::<Option<_>>()?;
    (f.len() == 3).then(|| (f[0], f[2] * 512))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_what_the_kernel_and_tmem_print() {
        let up = "cache0: FUSE file /run/x/cache0\ncache0: losetup --direct-io=on /run/x/cache0 -> /dev/loop7\nup\n";
        assert_eq!(loop_dev_from_up_output(up), Some(PathBuf::from("/dev/loop7")));
        assert_eq!(loop_dev_from_up_output("nothing here\n"), None);
        assert_eq!(parse_maj_min("254:0\n"), Some((254, 0)));
        assert_eq!(parse_maj_min("254"), None);
        let stat =
            "    1234        5    98760      300        0        0        0        0        0      400      300\n";
        assert_eq!(parse_block_stat(stat), Some((1234, 98760 * 512)));
        assert_eq!(parse_block_stat("1 2"), None);
    }
}
