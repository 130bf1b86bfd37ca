//! Test support for tmem's crates: skips that fail where a feature is required.
//!
//! Tests that need root, a kernel feature or an installed program call
//! [`skip`] and `return` when it is missing. On a developer's machine that
//! prints `SKIP: ...` and the test passes; where the environment variable
//! `TMEM_REQUIRE` names the feature (as `scripts/test.sh` does for CI, which
//! has all of them) the skip panics instead, so a missing feature or a broken
//! check cannot hide a test.

use std::fmt;

/// The environment variable listing the features that must be present.
pub const ENV: &str = "TMEM_REQUIRE";

/// Something a test needs from the machine it runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Feature {
    /// Running as root (mounts, swap, mlockall, other processes' memory).
    Root,
    /// `/dev/fuse`.
    Fuse,
    /// FUSE over io_uring (Linux 6.14+, `/sys/module/fuse/parameters/enable_uring`).
    FuseUring,
    /// Loop devices (`/dev/loop-control`).
    Loop,
    /// Kernel swap support (`/proc/swaps`).
    Swap,
    /// The zram module (devices hot-added through `/sys/class/zram-control`).
    Zram,
    /// A memory cgroup controller: cgroup v1 `memory`, or v2 with `memory` in `cgroup.controllers`.
    Memcg,
    /// A program the tests drive (qemu-io, nbdinfo, redis-server, python3, losetup, ...).
    Tools,
    /// Miri (the nightly toolchain's `miri` component), which `scripts/test.sh`
    /// runs on tmem-core's unsafe core.
    Miri,
    /// userfaultfd with `UFFDIO_MOVE` and the non-cooperative events (Linux 6.8+), for `tmem run`.
    Userfaultfd,
}

impl Feature {
    /// Every feature, in the order `all` stands for.
    pub const ALL: [Feature; 10] = [
        Feature::Root,
        Feature::Fuse,
        Feature::FuseUring,
        Feature::Loop,
        Feature::Swap,
        Feature::Zram,
        Feature::Memcg,
        Feature::Tools,
        Feature::Miri,
        Feature::Userfaultfd,
    ];

    /// The name used in `TMEM_REQUIRE`.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Feature::Root => "root",
            Feature::Fuse => "fuse",
            Feature::FuseUring => "fuse-uring",
            Feature::Loop => "loop",
            Feature::Swap => "swap",
            Feature::Zram => "zram",
            Feature::Memcg => "memcg",
            Feature::Tools => "tools",
            Feature::Miri => "miri",
            Feature::Userfaultfd => "userfaultfd",
        }
    }
}

impl fmt::Display for Feature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether `list` (the value of `TMEM_REQUIRE`: names separated by commas,
/// or `all`) requires `feature`.
#[must_use]
pub fn required(list: &str, feature: Feature) -> bool {
    names(list).any(|n| n == "all" || n == feature.name())
}

/// The first name in `list` that is neither a feature nor `all`, if any.
#[must_use]
pub fn unknown(list: &str) -> Option<&str> {
    names(list).find(|n| *n != "all" && !Feature::ALL.iter().any(|f| f.name() == *n))
}

fn names(list: &str) -> impl Iterator<Item = &str> {
    list.split(',').map(str::trim).filter(|n| !n.is_empty())
}

/// Reports that a test cannot run here because `feature` is missing (`why`).
///
/// Prints `SKIP: {why}` and returns, so the caller can `return`; but when the
/// environment variable `TMEM_REQUIRE` lists `feature` (comma-separated, or
/// `all`), it panics with a message naming the feature and `TMEM_REQUIRE`
/// instead. It also panics when `TMEM_REQUIRE` names an unknown feature, so a
/// typo cannot drop a requirement.
#[track_caller]
pub fn skip(feature: Feature, why: &str) {
    let list = std::env::var(ENV).unwrap_or_default();
    if let Some(bad) = unknown(&list) {
        let known: Vec<&str> = Feature::ALL.iter().map(|f| f.name()).collect();
        panic!("{ENV}={list:?} names {bad:?}, which is not one of: all, {}", known.join(", "));
    }
    if required(&list, feature) {
        panic!("{feature} is missing but {ENV}={list:?} requires it: {why}");
    }
    println!("SKIP: {why}");
}

/// Whether this process runs as root (effective uid 0).
#[must_use]
pub fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// Whether an executable file `name` is in a directory on `PATH`.
#[must_use]
pub fn have_tool(name: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let Some(path) = std::env::var_os("PATH") else { return false };
    std::env::split_paths(&path)
        .filter_map(|d| d.join(name).metadata().ok())
        .any(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Waits up to `within` for `child` to exit: its status, or `None` if it
/// is still running then (the caller decides whether to kill it).
pub fn wait_timeout(child: &mut std::process::Child, within: std::time::Duration) -> Option<std::process::ExitStatus> {
    let deadline = std::time::Instant::now() + within;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if std::time::Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Removes the groups `<root>/<prefix>...-<pid>` that test processes left
/// when they were killed before their cleanup could run (no destructor runs
/// on SIGKILL or an unhandled SIGTERM): only those whose pid does not run
/// (`runs`, e.g. `tmem_sys::process_runs`) and that hold no process.
/// Returns how many it removed.
pub fn remove_stale_cgroups(root: &std::path::Path, prefix: &str, runs: impl Fn(u32) -> bool) -> usize {
    let mut removed = 0;
    for (path, _) in left_by_dead(root, prefix, runs) {
        let empty = std::fs::read_to_string(path.join("cgroup.procs")).map_or(true, |p| p.trim().is_empty());
        if empty && std::fs::remove_dir(&path).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// The entries `<root>/<prefix>...-<pid>` whose pid does not run, with it.
fn left_by_dead(root: &std::path::Path, prefix: &str, runs: impl Fn(u32) -> bool) -> Vec<(std::path::PathBuf, u32)> {
    let Ok(dir) = std::fs::read_dir(root) else { return Vec::new() };
    dir.flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().into_owned();
            let pid = name.strip_prefix(prefix).and_then(|r| r.rsplit('-').next()?.parse::<u32>().ok())?;
            (!runs(pid)).then(|| (entry.path(), pid))
        })
        .collect()
}

/// Takes down what a test or bench process killed before its cleanup could
/// run left in `/run/tmem-test-*-<pid>` and `/run/tmem-bench-*-<pid>` (its
/// daemon, swap area, loop device and mount), with `tmem swap down`, the
/// recovery a user runs, and removes the directory. Only directories whose
/// pid does not run are touched, so one test that fails this way fails
/// alone instead of every swap test after it. Returns a line per directory.
pub fn recover_stale_runtime_dirs(tmem: &std::path::Path, runs: impl Fn(u32) -> bool) -> Vec<String> {
    let root = std::path::Path::new("/run");
    let stale = [left_by_dead(root, "tmem-test-", &runs), left_by_dead(root, "tmem-bench-", &runs)].concat();
    stale
        .into_iter()
        .map(|(dir, pid)| {
            let down = std::process::Command::new(tmem)
                .args(["swap", "down", "--runtime-dir"])
                .arg(&dir)
                .stdin(std::process::Stdio::null())
                .output();
            match down {
                Ok(out) if out.status.success() => {
                    let _ = std::fs::remove_dir_all(&dir);
                    let said = String::from_utf8_lossy(&out.stdout);
                    format!("recovered what pid {pid} left in {}: {}", dir.display(), said.lines().last().unwrap_or(""))
                }
                Ok(out) => format!(
                    "could not recover what pid {pid} left in {}: {}",
                    dir.display(),
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
                Err(e) => format!("could not run {}: {e}", tmem.display()),
            }
        })
        .collect()
}

/// Entries named `tmem-bench-*` in `dir` (what a bench leaves there), none
/// when it cannot be read.
pub fn bench_entries(dir: impl AsRef<std::path::Path>) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("tmem-bench-"))
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn only_groups_of_dead_test_processes_are_removed() {
        let root = std::env::temp_dir().join(format!("tmem-testkit-stale-{}", std::process::id()));
        let (me, dead) = (std::process::id(), u32::MAX);
        for name in [format!("tmem-test-a-{dead}"), format!("tmem-test-b-{me}"), format!("other-{dead}")] {
            std::fs::create_dir_all(root.join(name)).unwrap();
        }
        assert_eq!(remove_stale_cgroups(&root, "tmem-test-", |pid| pid == me), 1);
        assert!(!root.join(format!("tmem-test-a-{dead}")).exists());
        assert!(root.join(format!("tmem-test-b-{me}")).exists(), "a live process's group stays");
        assert!(root.join(format!("other-{dead}")).exists(), "other names stay");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn names_are_parsed() {
        assert!(!required("", Feature::Root));
        assert!(required("root", Feature::Root));
        assert!(!required("root", Feature::Fuse));
        assert!(required("root, fuse ,zram", Feature::Fuse));
        assert!(required("root,,zram,", Feature::Zram));
        assert!(!required("fuse", Feature::FuseUring), "fuse does not imply fuse-uring");
        assert!(required("fuse-uring", Feature::FuseUring));
        for f in Feature::ALL {
            assert!(required("all", f), "{f}");
            assert!(required(f.name(), f), "{f}");
        }
        assert_eq!(unknown("root,fuse-uring,loop,swap,zram,memcg,tools,all"), None);
        assert_eq!(unknown(""), None);
        assert_eq!(unknown("root,tool"), Some("tool"));
        assert_eq!(unknown("Root"), Some("Root"));
    }

    #[test]
    fn names_print_lowercase() {
        let all: Vec<String> = Feature::ALL.iter().map(ToString::to_string).collect();
        assert_eq!(
            all,
            ["root", "fuse", "fuse-uring", "loop", "swap", "zram", "memcg", "tools", "miri", "userfaultfd"]
        );
    }

    #[test]
    fn tools_are_found_on_path() {
        assert!(have_tool("sh"));
        assert!(!have_tool("no-such-tool-tmem-testkit"));
    }

    /// Not a test of its own: run by `skip_in_a_child` in a child process
    /// (marked by `TMEM_TESTKIT_CHILD`) with the `TMEM_REQUIRE` under test.
    #[test]
    fn child_skips_tools() {
        if std::env::var_os("TMEM_TESTKIT_CHILD").is_some() {
            skip(Feature::Tools, "frobnicate is not installed");
            println!("after the skip");
        }
    }

    /// Runs `child_skips_tools` in a child process of this test binary with
    /// `TMEM_REQUIRE` set to `require` (unset for `None`): (passed, output).
    fn child(require: Option<&str>) -> (bool, String) {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["--exact", "tests::child_skips_tools", "--nocapture", "--test-threads=1"]);
        cmd.env("TMEM_TESTKIT_CHILD", "1").env_remove("RUST_BACKTRACE");
        match require {
            Some(r) => cmd.env(ENV, r),
            None => cmd.env_remove(ENV),
        };
        let out = cmd.output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(text.contains("child_skips_tools"), "the child ran the test: {text}");
        (out.status.success(), text)
    }

    #[test]
    fn skip_in_a_child() {
        for require in [None, Some(""), Some("root,fuse,zram")] {
            let (ok, text) = child(require);
            assert!(ok, "{require:?}: {text}");
            assert!(text.contains("SKIP: frobnicate is not installed\n"), "{require:?}: {text}");
            assert!(text.contains("after the skip"), "{require:?}: {text}");
        }
        for require in ["tools", "root,tools", "all"] {
            let (ok, text) = child(Some(require));
            assert!(!ok, "{require}: {text}");
            assert!(!text.contains("SKIP:") && !text.contains("after the skip"), "{require}: {text}");
            assert!(
                text.contains(&format!("tools is missing but TMEM_REQUIRE={require:?} requires it: frobnicate")),
                "{require}: {text}"
            );
        }
        let (ok, text) = child(Some("root,tool"));
        assert!(!ok && text.contains("names \"tool\", which is not one of: all, root,"), "{text}");
    }
}
