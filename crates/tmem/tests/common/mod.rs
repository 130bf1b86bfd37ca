//! Shared by the benches' smoke tests (`pressure_smoke`, `ramp_smoke`, `soak_smoke`,
//! `capacity_smoke`): what a bench needs from the machine, and the check
//! that it left nothing behind: no swap area, loop device, memory cgroup,
//! mount, runtime directory or file of its own, its hot-added zram device
//! gone, a zram0 that was there before untouched, zswap as it was.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use tmem_testkit::Feature;

fn read(path: &str) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// Active swap areas.
pub fn swap_areas() -> Vec<String> {
    read("/proc/swaps").lines().skip(1).filter_map(|l| l.split_whitespace().next().map(str::to_owned)).collect()
}

/// Loop devices backed by a file under /run/tmem-bench-*.
fn bench_loops() -> Vec<String> {
    let out = Command::new("losetup").args(["--list", "--noheadings", "--output", "NAME,BACK-FILE"]).output();
    let text = out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default();
    text.lines().filter(|l| l.contains("/run/tmem-bench-")).map(str::to_owned).collect()
}

fn bench_cgroups() -> Vec<String> {
    let layout = tmem_sys::cgroup::Layout::detect().unwrap();
    bench_entries(layout.memory_hierarchy().0)
}

/// disksize and comp_algorithm of zram0, if there is one (the user's: a bench must leave it alone).
fn zram0_state() -> Option<(String, String)> {
    Path::new("/sys/block/zram0")
        .exists()
        .then(|| (read("/sys/block/zram0/disksize"), read("/sys/block/zram0/comp_algorithm")))
}

/// Whether /sys/block/DEV is gone within a few seconds (other tests may
/// hot-add devices meanwhile, and get the same number for a moment).
fn gone(dev: &str) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Path::new("/sys/block").join(dev).exists() {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    true
}

fn bench_mounts() -> Vec<String> {
    read("/proc/mounts")
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1).map(str::to_owned))
        .filter(|m| m.starts_with("/run/tmem-bench-"))
        .collect()
}

use tmem_testkit::bench_entries;

/// Why a swap bench cannot run here, if it cannot.
pub fn missing_feature() -> Option<(Feature, &'static str)> {
    if !tmem_testkit::is_root() {
        return Some((Feature::Root, "needs root"));
    }
    if tmem_sys::cgroup::Layout::detect().and_then(|l| l.ensure_memory_controller()).is_err() {
        return Some((Feature::Memcg, "no memory cgroup controller"));
    }
    if !Path::new("/sys/class/zram-control").exists()
        && Command::new("modprobe").args(["--dry-run", "zram"]).status().map_or(true, |s| !s.success())
    {
        return Some((Feature::Zram, "no zram module"));
    }
    if !Path::new("/dev/fuse").exists() {
        return Some((Feature::Fuse, "no /dev/fuse"));
    }
    for line in tmem_testkit::recover_stale_runtime_dirs(Path::new(env!("CARGO_BIN_EXE_tmem")), tmem_sys::process_runs)
    {
        eprintln!("note: {line}");
    }
    // A bench measures swap alone: other active swap areas would take pages.
    if !swap_areas().is_empty() {
        return Some((Feature::Swap, "other swap areas are active"));
    }
    if !tmem_testkit::have_tool("python3") {
        return Some((Feature::Tools, "no python3"));
    }
    None
}

/// What a bench must leave as it found it.
pub struct Before {
    cgroups: Vec<String>,
    zram0: Option<(String, String)>,
    zswap_enabled: String,
    var_tmp: Vec<String>,
}

impl Before {
    /// Now, before the bench.
    pub fn now() -> Self {
        Self {
            cgroups: bench_cgroups(),
            zram0: zram0_state(),
            zswap_enabled: read("/sys/module/zswap/parameters/enabled"),
            var_tmp: bench_entries("/var/tmp"),
        }
    }

    /// Asserts that the bench that hot-added `zram_dev` (from its JSON) left
    /// nothing behind. Other tests on the machine may have swap areas of
    /// their own by now: only the bench's are checked.
    pub fn assert_nothing_left(&self, zram_dev: Option<&str>) {
        let ours: Vec<String> = swap_areas()
            .into_iter()
            .filter(|a| zram_dev.is_some_and(|d| *a == format!("/dev/{d}")) || a.contains("tmem-bench"))
            .collect();
        assert!(ours.is_empty(), "swap areas left: {ours:?}");
        assert!(bench_loops().is_empty(), "loop devices left: {:?}", bench_loops());
        assert_eq!(bench_cgroups(), self.cgroups, "memory cgroups left behind");
        assert_eq!(zram0_state(), self.zram0, "zram0 was touched");
        if let Some(d) = zram_dev {
            assert_ne!(d, "zram0", "the bench must hot-add a device of its own");
            assert!(gone(d), "the hot-added {d} was not removed");
        }
        assert!(bench_mounts().is_empty(), "mounts left: {:?}", bench_mounts());
        assert!(bench_entries("/run").is_empty(), "runtime directory left in /run: {:?}", bench_entries("/run"));
        assert_eq!(bench_entries("/var/tmp"), self.var_tmp, "swap file or tier left in /var/tmp");
        assert_eq!(read("/sys/module/zswap/parameters/enabled"), self.zswap_enabled, "zswap left changed");
    }
}

/// What one bench run gave.
pub struct BenchRun {
    /// Whether it exited 0.
    pub ok: bool,
    /// Its report.
    pub stdout: String,
    /// Its `--json` file, parsed (`Null` if it wrote none).
    pub json: serde_json::Value,
    /// Its `--plot` SVG.
    pub svg: String,
}

/// How long a bench may run before it is told to stop (SIGTERM), well
/// inside nextest's 600 s: a bench stopped that way undoes what it set up
/// and says which row it was on, where nextest's own kill would leave its
/// swap area behind for the tests after it.
const BENCH_DEADLINE: Duration = Duration::from_secs(420);
/// How long a stopped bench gets to undo what it set up.
const BENCH_TEARDOWN: Duration = Duration::from_secs(90);

/// Runs `tmem bench ARGS --json FILE`, with `--plot FILE.svg` where
/// `plot` (benches with figures), prints what it said and removes the files.
pub fn run_bench(args: &[&str], plot: bool) -> BenchRun {
    let json = std::env::temp_dir().join(format!("tmem-{}-smoke-{}.json", args[0], std::process::id()));
    let svg = json.with_extension("svg");
    let (out_path, err_path) = (json.with_extension("out"), json.with_extension("err"));
    let start = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_tmem"))
        .arg("bench")
        .args(args)
        .arg("--json")
        .arg(&json)
        .args(plot.then_some(["--plot".as_ref(), svg.as_os_str()]).into_iter().flatten())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap();
    let pid = rustix::process::Pid::from_child(&child);
    let mut stopped = None;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        let (since, limit, signal) = match stopped {
            None => (start, BENCH_DEADLINE, rustix::process::Signal::TERM),
            Some(at) => (at, BENCH_TEARDOWN, rustix::process::Signal::KILL),
        };
        if since.elapsed() > limit {
            eprintln!("the bench ran past {:.0} s: {signal:?} sent to it", start.elapsed().as_secs_f64());
            let _ = rustix::process::kill_process(pid, signal);
            stopped.get_or_insert_with(Instant::now);
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let take = |p: &Path| {
        let text = std::fs::read_to_string(p).unwrap_or_default();
        let _ = std::fs::remove_file(p);
        text
    };
    let (json_text, svg, stdout, stderr) = (take(&json), take(&svg), take(&out_path), take(&err_path));
    eprintln!("{stdout}\n{stderr}\n(took {:.0} s)", start.elapsed().as_secs_f64());
    BenchRun {
        ok: status.success() && stopped.is_none(),
        stdout,
        json: serde_json::from_str(&json_text).unwrap_or_default(),
        svg,
    }
}
