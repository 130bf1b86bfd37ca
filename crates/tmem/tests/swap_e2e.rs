//! Kernel swap end to end (root): `tmem swap up`, a memory-hungry program in a
//! memory cgroup limited to half its peak, `tmem stat`, `tmem swap down`.
//! Everything set up is torn down even when an assertion fails.

use std::path::{Path, PathBuf};
use std::process::Command;
use tmem_sys::cgroup::{Layout, MemCgroup};

const TMEM: &str = env!("CARGO_BIN_EXE_tmem");

/// Writes `mib` MiB of pages (1 KiB random + 3 KiB zeros, compressible like
/// a heap), hashing them as it goes; then, after later pages have pushed the
/// early ones out to swap, reads everything back and hashes it again.
const HOG: &str = r#"
import hashlib, random, sys
mib = int(sys.argv[1])
random.seed(7)
h1 = hashlib.sha256()
chunks = []
for i in range(mib):
    c = b"".join(random.randbytes(1024) + bytes(3072) for _ in range(256))
    h1.update(c)
    chunks.append(bytearray(c))
h2 = hashlib.sha256()
for c in chunks:
    h2.update(c)
print("OK" if h1.digest() == h2.digest() else "MISMATCH", h1.hexdigest())
"#;

/// Locks the interpreter's memory, then maps `argv[1]` MiB of its own,
/// fills it, pages it out (MADV_PAGEOUT) and prints OUT; on a line from
/// stdin it checks every page and prints OK or MISMATCH.
const SLEEPER: &str = r#"
import ctypes, mmap, sys
assert ctypes.CDLL(None, use_errno=True).mlockall(1) == 0
n = int(sys.argv[1]) << 20
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
word = lambda i: ((i * 2654435761) % 2**64).to_bytes(8, "little")
for i in range(0, n, 4096):
    m[i:i + 8] = word(i)
m.madvise(getattr(mmap, "MADV_PAGEOUT", 21))  # 21: Linux uapi
print("OUT", flush=True)
sys.stdin.readline()
bad = sum(1 for i in range(0, n, 4096) if m[i:i + 8] != word(i))
print("OK" if bad == 0 else "MISMATCH %d" % bad, flush=True)
"#;

/// Whether these tests can run here: root, FUSE, loop devices, swap, the
/// memory cgroup controller (v1 or v2) and the tools. When not, reports the skip
/// naming the feature that is missing (see `tmem_testkit::skip`).
fn can_run() -> bool {
    use tmem_testkit::{skip, Feature};
    if !tmem_testkit::is_root() {
        skip(Feature::Root, "needs root");
        return false;
    }
    for (p, feature) in
        [("/dev/fuse", Feature::Fuse), ("/dev/loop-control", Feature::Loop), ("/proc/swaps", Feature::Swap)]
    {
        if !Path::new(p).exists() {
            skip(feature, &format!("{p} is missing"));
            return false;
        }
    }
    if let Err(e) = Layout::detect().and_then(|l| l.ensure_memory_controller()) {
        skip(Feature::Memcg, &e.to_string());
        return false;
    }
    for tool in ["losetup", "mkswap", "swapon", "swapoff", "python3"] {
        if !tmem_testkit::have_tool(tool) {
            skip(Feature::Tools, &format!("{tool} is not installed"));
            return false;
        }
    }
    for line in tmem_testkit::recover_stale_runtime_dirs(Path::new(TMEM), tmem_sys::process_runs) {
        eprintln!("note: {line}");
    }
    true
}

/// Whether this process has CAP_SYS_RESOURCE (bit 24 of CapEff), which
/// lowering `oom_score_adj` needs.
fn has_cap_sys_resource() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let eff = status.lines().find_map(|l| l.strip_prefix("CapEff:")).unwrap().trim();
    u64::from_str_radix(eff, 16).unwrap() & (1 << 24) != 0
}

fn tmem(args: &[&str]) -> (bool, String) {
    tmem_env(args, &[])
}

/// `tmem ARGS` with `env` set (fault injection reaches the daemon it starts).
fn tmem_env(args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let out = Command::new(TMEM).args(args).envs(env.iter().copied()).output().expect("run tmem");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// Tears down swap, loop, mount and cgroup on drop, whatever happened.
struct Setup {
    dir: PathBuf,
    cgroup_name: String,
    /// The hog's memory cgroup (v1 or v2, as the machine has it), made on
    /// first use; dropped (its tasks killed, the group removed) with the setup.
    cgroup: std::sync::OnceLock<MemCgroup>,
    up: bool,
}

impl Setup {
    fn new(tag: &str) -> Self {
        let id = format!("{tag}-{}", std::process::id());
        Setup {
            dir: PathBuf::from(format!("/run/tmem-test-{id}")),
            cgroup_name: format!("tmem-test-{id}"),
            cgroup: std::sync::OnceLock::new(),
            up: false,
        }
    }

    fn dir(&self) -> &str {
        self.dir.to_str().unwrap()
    }

    fn swap_up(&mut self, pool_limit: &str) -> String {
        self.swap_up_with(pool_limit, &[])
    }

    fn swap_up_with(&mut self, pool_limit: &str, extra: &[&str]) -> String {
        self.swap_up_env(pool_limit, extra, &[])
    }

    /// `swap up` with `env` set for the daemon (fault injection in test builds).
    fn swap_up_env(&mut self, pool_limit: &str, extra: &[&str], env: &[(&str, &str)]) -> String {
        let mut args = vec!["swap", "up", "--size", "2G", "--pool-limit", pool_limit, "--runtime-dir", self.dir()];
        // These tests are of tmem's own path: no front unless one is asked for.
        if !extra.contains(&"--front") {
            args.extend(["--front", "none"]);
        }
        args.extend_from_slice(extra);
        let (ok, out) = tmem_env(&args, env);
        self.up = ok;
        assert!(ok, "tmem swap up failed:\n{out}");
        out
    }

    fn loop_dev(&self) -> Option<String> {
        let out = Command::new("losetup")
            .args(["--associated", &format!("{}/dev/swap0", self.dir()), "--noheadings", "--output", "NAME"])
            .output()
            .ok()?;
        let s = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        (!s.is_empty()).then_some(s)
    }

    /// Runs the hog in a fresh memory cgroup limited to `limit_mib`.
    fn run_hog(&self, mib: u32, limit_mib: u32) -> std::process::Output {
        self.hog(mib, limit_mib)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .output()
            .unwrap()
    }

    /// The hog's command, to run in a fresh memory cgroup limited to `limit_mib`.
    fn hog(&self, mib: u32, limit_mib: u32) -> Command {
        self.in_cgroup(limit_mib, HOG, &[&mib.to_string()])
    }

    /// `python3 -c script args` in the test's memory cgroup, limited to `limit_mib`.
    fn in_cgroup(&self, limit_mib: u32, script: &str, args: &[&str]) -> Command {
        let cgroup = self.cgroup.get_or_init(|| {
            let layout = Layout::detect().unwrap();
            layout.ensure_memory_controller().unwrap();
            // Groups of earlier runs that were killed before they could clean up.
            tmem_testkit::remove_stale_cgroups(layout.memory_hierarchy().0, "tmem-test-", tmem_sys::process_runs);
            MemCgroup::create(&layout, &self.cgroup_name).unwrap()
        });
        cgroup.set_limit(Some(u64::from(limit_mib) << 20)).unwrap();
        let procs = cgroup.procs_file();
        let mut c = Command::new("sh");
        c.arg("-c")
            .arg(format!("echo $$ > {} && exec python3 -c \"$0\" \"$@\"", procs.display()))
            .arg(script)
            .args(args);
        c
    }

    /// The daemon's pid, from its state file.
    fn daemon_pid(&self) -> i32 {
        state_pid(&self.dir).expect("a state file with the daemon's pid")
    }

    fn stat(&self) -> serde_json::Value {
        let (ok, out) = tmem(&["stat", "--json", "--runtime-dir", self.dir()]);
        assert!(ok, "tmem stat failed: {out}");
        serde_json::from_str(&out).unwrap()
    }

    fn swap_down(&mut self) -> String {
        let (ok, out) = tmem(&["swap", "down", "--runtime-dir", self.dir()]);
        assert!(ok, "tmem swap down failed:\n{out}");
        self.up = false;
        out
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        if self.up {
            let pid = tmem(&["stat", "--json", "--runtime-dir", self.dir()]).0;
            let status = Command::new(TMEM).args(["swap", "down", "--runtime-dir", self.dir()]).output();
            let mut down = status.as_ref().is_ok_and(|o| o.status.success());
            // swapoff can fail for a moment under memory pressure: retry, then
            // take things apart by hand (our loop device, our daemon by pid).
            for _ in 0..5 {
                if down {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_secs(2));
                down = tmem(&["swap", "down", "--runtime-dir", self.dir()]).0;
            }
            if !down {
                eprintln!("cleanup: tmem swap down failed (daemon answering: {pid}); tearing down by hand");
                if let Some(dev) = self.loop_dev() {
                    let _ = Command::new("swapoff").arg(&dev).status();
                    let _ = Command::new("losetup").args(["--detach", &dev]).status();
                }
                let _ = tmem(&["swap", "down", "--runtime-dir", self.dir()]);
                let _ = Command::new("umount").arg("-l").arg(self.dir.join("dev")).status();
            }
        }
        // The hog's cgroup: what still runs in it is killed, then it is removed.
        drop(self.cgroup.take());
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn assert_clean(s: &Setup) {
    let swaps = std::fs::read_to_string("/proc/swaps").unwrap();
    assert!(s.loop_dev().is_none(), "loop device left behind");
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
    assert!(!mounts.contains(s.dir()), "mount left behind:\n{mounts}");
    assert!(!swaps.contains(&format!("{}/", s.dir())), "swap left behind:\n{swaps}");
}

#[test]
fn job_runs_in_half_its_memory_on_tmem_swap() {
    if !can_run() {
        return;
    }
    let (up, _, down) = half_memory_job("half", &[]);
    assert!(up.contains("requests via /dev/fuse"), "{up}");
    assert!(!down.contains("io_uring"), "{down}");
}

#[test]
fn job_runs_in_half_its_memory_over_fuse_io_uring() {
    if !can_run() {
        return;
    }
    if !Path::new("/sys/module/fuse/parameters/enable_uring").exists() {
        tmem_testkit::skip(tmem_testkit::Feature::FuseUring, "this kernel has no FUSE over io_uring (Linux 6.14+)");
        return;
    }
    let (up, _, down) = half_memory_job("half-uring", &["--fuse-uring", "2"]);
    assert!(up.contains("requests via io_uring"), "{up}");
    // The kernel's swap I/O went over the ring: far more than the handful of
    // requests from setting up loop and swap.
    let served = uring_requests_served(&down);
    assert!(served > 1000, "{served} requests over io_uring:\n{down}");
}

#[test]
fn job_runs_in_half_its_memory_with_background_recompression() {
    if !can_run() {
        return;
    }
    let (_, stat, _) = half_memory_job("half-recomp", &["--recompress", "zstd:1", "--recompress-after", "0.05"]);
    // "swap0: recompression zstd-1[; backing off ...]: N pages recompressed,
    // S saved, K kept as they were, R raced"
    let line = stat.lines().find(|l| l.contains("recompression zstd-1")).unwrap_or_else(|| panic!("{stat}"));
    let counts = line.split(": ").nth(2).unwrap_or_else(|| panic!("no counts in: {line}"));
    let count = |what: &str| -> u64 {
        let part = counts.split(", ").find(|p| p.ends_with(what)).unwrap_or_else(|| panic!("no {what:?} in: {line}"));
        part.split(' ').next().and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("bad {what:?} in: {line}"))
    };
    let (recompressed, kept) = (count("pages recompressed"), count("kept as they were"));
    // It backs off as the job reads its pages back, but re-encodes many first.
    assert!(recompressed > 0 && recompressed + kept > 1000, "pages re-encoded while the job ran: {line}");
    assert!(stat.contains("zstd-1"), "{stat}");
}

#[test]
fn job_runs_in_half_its_memory_with_cold_pages_grouped() {
    if !can_run() {
        return;
    }
    let (up, stat, _) = half_memory_job("half-group", &["--group", "zstd:3", "--group-after", "0.05"]);
    assert!(up.contains("cold pages grouped by 64 KiB of adjacent slots, zstd-3"), "{up}");
    // "swap0: grouping zstd-3, up to 16 pages a group: N pages in G groups
    // (...), D dead slots; P pages grouped, ..."
    let line = stat.lines().find(|l| l.contains(": grouping zstd-3")).unwrap_or_else(|| panic!("{stat}"));
    let grouped: u64 = line
        .split("; ")
        .nth(1)
        .and_then(|p| p.strip_suffix(" pages grouped").or_else(|| p.split(" pages grouped").next()))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no grouped count in: {line}"));
    // The job reads every page back at each pass, but the pages it left
    // alone for two of the worker's visits went into groups meanwhile, and
    // every page it read (grouped or not) was right (its checksum).
    println!("{line}");
    assert!(grouped > 1000, "pages grouped while the job ran: {line}");
}

/// `swap up` with `extra` arguments, a 512 MiB job in a 256 MiB cgroup,
/// checks on its output and the counters, `swap down`; returns what up,
/// `tmem stat` (once the job is done) and down printed.
fn half_memory_job(tag: &str, extra: &[&str]) -> (String, String, String) {
    let mut s = Setup::new(tag);
    let up = s.swap_up_with("1G", extra);
    assert!(up.contains("swapon"), "{up}");
    // 512 MiB of data plus the interpreter, in a 256 MiB cgroup.
    let out = s.run_hog(512, 256);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.starts_with("OK "),
        "workload failed: {:?} {stdout} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let peak = s.cgroup.get().unwrap().max_usage().unwrap();
    assert!(peak <= 256 << 20, "cgroup limit held: {peak}");
    let st = s.stat();
    let dev = &st[0];
    assert!(dev["write_ios"].as_u64().unwrap() > 0, "the kernel wrote to tmem: {dev}");
    assert!(
        dev["store"]["total"]["succ_puts"].as_u64().unwrap() > 16_384,
        "at least 64 MiB went through the pool: {dev}"
    );
    assert!(dev["store"]["total"]["succ_gets"].as_u64().unwrap() > 0, "pages came back: {dev}");
    assert_eq!(dev["failed_reads"].as_u64(), Some(0));
    assert_eq!(dev["store"]["total"]["decompress_fail"].as_u64(), Some(0));
    let (ok, table) = tmem(&["stat", "--runtime-dir", s.dir()]);
    assert!(ok && table.contains("swap0"), "{table}");
    // The job is gone: its freed slots' pages leave the pool.
    let how = pool_returns_to_swap_in_use(&s);
    println!("{how}");
    let st = s.stat();
    assert_eq!(st[0]["failed_writes"].as_u64(), Some(0), "{}", st[0]);
    let down = s.swap_down();
    assert!(down.contains("swapoff") && down.contains("exited"), "{down}");
    assert_clean(&s);
    (up, table, down)
}

/// Waits (30 s at most) until the pool's memory (`mem_used_total`) is at
/// most 1.1x the swap in use plus 1 MiB (the issue's bound), which happens
/// at once when the swap area has no slot in use, or, when some stay in
/// use, once the area has been quiet for two ticks and the daemon empties
/// it (swapoff, mkswap, swapon). Returns what happened, with the daemon's
/// log line.
fn pool_returns_to_swap_in_use(s: &Setup) -> String {
    let start = std::time::Instant::now();
    loop {
        let used: Vec<u64> = tmem_sys::swap::swaps().unwrap().iter().map(|a| a.used).collect();
        assert!(used.len() <= 1, "only this test's swap area: {used:?}");
        let used = used.first().copied().unwrap_or(0);
        let st = s.stat();
        let store = &st[0]["store"];
        let n = |v: &serde_json::Value| v.as_u64().unwrap();
        let pool = n(&store["mem_used_total"]);
        let log = std::fs::read_to_string(s.dir.join("daemon.log")).unwrap();
        let line = log.lines().rev().find(|l| l.contains("dropped") && l.contains("pages of freed slots"));
        if let Some(line) = line.filter(|_| pool <= used + used / 10 + (1 << 20)) {
            return format!(
                "pool {} KiB ({} pages, {} KiB of spans, {} KiB of metadata), {} KiB of swap in use, {:.1} s \
                 after the job; {line}",
                pool >> 10,
                n(&store["total"]["stored_pages"]),
                n(&store["alloc"]["span_bytes"]) >> 10,
                n(&store["metadata_bytes"]) >> 10,
                used >> 10,
                start.elapsed().as_secs_f64()
            );
        }
        assert!(
            start.elapsed().as_secs() < 30,
            "pool {} KiB, {} KiB of swap in use 30 s after the job: {}\n{log}",
            pool >> 10,
            used >> 10,
            st[0]
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// A process sleeps with 2 MiB of its memory in swap while a job swaps
/// through the pool and exits: "Used" never reaches 0, so the daemon
/// empties the idle area (swapoff reads the sleeper's pages back), the pool
/// gives back the job's pages, and the sleeper's data is intact.
#[test]
fn an_idle_swap_area_is_emptied_and_a_sleeping_process_keeps_its_pages() {
    if !can_run() {
        return;
    }
    let mut s = Setup::new("recycle");
    s.swap_up_with("1G", &[]);
    let mut sleeper = s
        .in_cgroup(512, SLEEPER, &["2"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(sleeper.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    assert_eq!(line.trim(), "OUT", "the sleeper paged its memory out");
    let used = tmem_sys::swap::swaps().unwrap()[0].used;
    assert!(used >= 1 << 20, "the sleeper's pages are in swap: {used}");
    let job = s.run_hog(512, 256);
    assert!(job.status.success() && job.stdout.starts_with(b"OK "), "{job:?}");
    let how = pool_returns_to_swap_in_use(&s);
    println!("{how}");
    assert!(how.contains("emptied the idle swap area"), "{how}");
    let st = s.stat();
    assert_eq!(st[0]["failed_writes"].as_u64(), Some(0), "{}", st[0]);
    assert!(st[0]["swap_areas_emptied"].as_u64() >= Some(1), "{}", st[0]);
    // The sleeper reads its pages, back in memory since the swapoff.
    std::io::Write::write_all(sleeper.stdin.as_mut().unwrap(), b"check\n").unwrap();
    line.clear();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    assert_eq!(line.trim(), "OK", "the sleeper's data survived the swapoff");
    assert!(sleeper.wait().unwrap().success());
    // Swap is on again and still works: another job swaps through it.
    let job = s.run_hog(256, 128);
    assert!(job.status.success() && job.stdout.starts_with(b"OK "), "{job:?}");
    s.swap_down();
    assert_clean(&s);
}

#[test]
fn full_pool_refuses_pages_without_corrupting_the_job() {
    if !can_run() {
        return;
    }
    let mut s = Setup::new("full");
    // 32 MiB of pool for a job that needs ~350 MiB of swap.
    s.swap_up("32M");
    let mut hog = s.hog(512, 192).stdout(std::process::Stdio::piped()).spawn().unwrap();
    // The job completes correctly (pages the pool refused stay in RAM) or the
    // kernel OOM-kills it; it never sees wrong data. Or it thrashes: a v1
    // memory cgroup whose swap writes fail can reclaim page cache forever
    // without calling its OOM killer (CI rehearsal 20: 13 million refused
    // writes in 13 minutes). zram past its `mem_limit` fails the kernel's
    // writes the same way (-ENOMEM from `zram_write_page`). The test stops
    // such a job after 60 s and checks the rest.
    let status = tmem_testkit::wait_timeout(&mut hog, std::time::Duration::from_secs(60));
    if status.is_none() {
        eprintln!("note: the job still thrashed on refused writes after 60 s: stopped");
        hog.kill().unwrap();
    }
    let out = hog.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!stdout.contains("MISMATCH"), "wrong data: {stdout}");
    if out.status.success() {
        assert!(stdout.starts_with("OK "), "{stdout}");
    } else {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGKILL),
            "only an OOM kill (or ours) is acceptable: {:?}",
            out.status
        );
    }
    let st = s.stat();
    let dev = &st[0];
    assert!(dev["store"]["total"]["pool_limit_hit"].as_u64().unwrap() > 0, "{dev}");
    assert!(dev["failed_writes"].as_u64().unwrap() > 0, "refusals reach the kernel as write errors: {dev}");
    assert!(dev["store"]["mem_used_total"].as_u64().unwrap() <= (32 << 20) + (1 << 20), "{dev}");
    s.swap_down();
    assert_clean(&s);
}

/// A remote tier on `n` Redis servers of `maxmemory` each (noeviction) and
/// a disk tier in a directory of its own, removed on drop; `None` (the test
/// skipped) without redis-server.
struct TestTiers {
    _nodes: Vec<tmem_bench::redis::RedisServer>,
    disk_dir: PathBuf,
    remote: String,
    disk: String,
}

impl TestTiers {
    fn start(n: usize, maxmemory: &str, tag: &str) -> Option<Self> {
        use tmem_bench::redis::{redis_server_binary, RedisOptions, RedisServer};
        if redis_server_binary().is_none() {
            tmem_testkit::skip(tmem_testkit::Feature::Tools, "redis-server not installed");
            return None;
        }
        let opts =
            RedisOptions { maxmemory: Some(maxmemory.into()), policy: "noeviction".into(), ..Default::default() };
        let nodes: Vec<RedisServer> = (0..n).map(|_| RedisServer::start(&opts).unwrap()).collect();
        let disk_dir = std::env::temp_dir().join(format!("tmem-test-{tag}-disk-{}", std::process::id()));
        std::fs::create_dir_all(&disk_dir).unwrap();
        let remote = format!("remote={}", nodes.iter().map(RedisServer::url).collect::<Vec<_>>().join(","));
        let disk = format!("disk={}", disk_dir.display());
        Some(Self { _nodes: nodes, disk_dir, remote, disk })
    }

    /// The `swap up` options: both tiers, R = 2.
    fn args(&self) -> [&str; 6] {
        ["--tier", &self.remote, "--tier", &self.disk, "--replicas", "2"]
    }
}

impl Drop for TestTiers {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.disk_dir);
    }
}

/// pool → remote (3 Redis servers, R=2, small maxmemory) → disk, under a job
/// that needs far more than the pool: pages spill to remote RAM, then to disk.
#[test]
fn pool_spills_to_remote_ram_and_disk() {
    if !can_run() {
        return;
    }
    let Some(below) = TestTiers::start(3, "24mb", "tiers") else { return };
    let mut s = Setup::new("tiers");
    let up = s.swap_up_with("32M", &below.args());
    assert!(up.contains("pool -> remote -> disk"), "{up}");
    let out = s.run_hog(512, 192);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.starts_with("OK "), "workload failed: {:?} {stdout}", out.status);
    let st = s.stat();
    let dev = &st[0];
    let t = &dev["store"]["total"];
    assert!(t["written_back_pages"].as_u64().unwrap() > 10_000, "{t}");
    assert!(t["tier_gets"].as_u64().unwrap() > 0, "{t}");
    assert_eq!(t["tier_get_fail"].as_u64(), Some(0), "{t}");
    assert_eq!(dev["failed_writes"].as_u64(), Some(0), "no write was refused: {dev}");
    let tiers = dev["store"]["tiers"].as_array().unwrap();
    let writes = |name: &str| tiers.iter().find(|x| x["name"] == name).map(|x| x["writes"].as_u64().unwrap()).unwrap();
    assert!(writes("remote") > 1000, "remote RAM took pages: {tiers:?}");
    assert!(writes("disk") > 1000, "a full remote spilled to disk: {tiers:?}");
    s.swap_down();
    assert_clean(&s);
}

/// pool → a Redis Cluster (3 masters, a replica each, R = 2): a master is
/// SIGKILLed while the job's pages are on the cluster, its replica takes
/// over, and the job's output is still right.
#[test]
fn a_job_swaps_to_a_redis_cluster_through_a_master_kill() {
    use tmem_bench::redis::{cluster::RedisCluster, redis_server_binary};
    if !can_run() {
        return;
    }
    if redis_server_binary().is_none() || !tmem_testkit::have_tool("redis-cli") {
        tmem_testkit::skip(tmem_testkit::Feature::Tools, "redis-server or redis-cli not installed");
        return;
    }
    let mut cluster = RedisCluster::start(3, 1).unwrap();
    let mut s = Setup::new("cluster");
    let remote = format!("remote={}", cluster.seeds().join(","));
    let up = s.swap_up_with("32M", &["--tier", &remote, "--replicas", "2"]);
    assert!(up.contains("pool -> remote"), "{up}");
    let mut hog = s.hog(512, 192).stdout(std::process::Stdio::piped()).spawn().unwrap();
    let remote_writes = |s: &Setup| {
        let st = s.stat();
        let tiers = st[0]["store"]["tiers"].as_array().cloned().unwrap_or_default();
        tiers.iter().find(|t| t["name"] == "remote").and_then(|t| t["writes"].as_u64()).unwrap_or(0)
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while remote_writes(&s) < 5_000 {
        assert!(std::time::Instant::now() < deadline, "the job's pages never reached the cluster");
        assert!(hog.try_wait().unwrap().is_none(), "the job ended before its pages reached the cluster");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let (old, new) = cluster.kill_master(0, std::time::Duration::from_secs(60)).unwrap();
    println!("killed master {old} with {} pages written to the cluster; {new} took over", remote_writes(&s));
    let status = tmem_testkit::wait_timeout(&mut hog, std::time::Duration::from_secs(300)).unwrap_or_else(|| {
        let _ = hog.kill();
        hog.wait().unwrap()
    });
    let mut out = String::new();
    std::io::Read::read_to_string(&mut hog.stdout.take().unwrap(), &mut out).unwrap();
    assert!(status.success() && out.starts_with("OK "), "the job's output: {status:?} {out}");
    let st = s.stat();
    let dev = &st[0];
    let t = &dev["store"]["total"];
    assert!(t["tier_gets"].as_u64().unwrap() > 0, "{t}");
    assert_eq!(t["tier_get_fail"].as_u64(), Some(0), "{t}");
    assert_eq!(dev["failed_writes"].as_u64(), Some(0), "no write was refused: {dev}");
    s.swap_down();
    assert_clean(&s);
}

/// A daemon killed with SIGKILL while a job has pages in its swap: `tmem
/// stat` says so, `tmem swap down` removes every piece and exits 0, and a
/// new `tmem swap up` works at once. Also: the daemon runs with
/// `oom_score_adj` -1000.
#[test]
fn a_killed_daemon_is_cleaned_up_by_swap_down() {
    if !can_run() {
        return;
    }
    let mut s = Setup::new("kill");
    s.swap_up("1G");
    let pid = s.daemon_pid();
    let adj = std::fs::read_to_string(format!("/proc/{pid}/oom_score_adj")).unwrap();
    if has_cap_sys_resource() {
        assert_eq!(adj.trim(), "-1000", "the OOM killer takes the daemon last");
    } else {
        // Lowering oom_score_adj needs CAP_SYS_RESOURCE, which this machine
        // withholds even from root: the daemon must say so, loudly.
        let log = std::fs::read_to_string(s.dir.join("daemon.log")).unwrap();
        assert!(log.contains("WARNING: could not set oom_score_adj -1000"), "{log}");
        println!("note: no CAP_SYS_RESOURCE here; oom_score_adj stays {}", adj.trim());
    }
    let mut hog = s.hog(512, 192).stdout(std::process::Stdio::piped()).spawn().unwrap();
    // Wait until the job has pages in swap.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while s.stat()[0]["store"]["total"]["stored_pages"].as_u64().unwrap() < 10_000 {
        assert!(std::time::Instant::now() < deadline, "the job never reached swap");
        assert!(hog.try_wait().unwrap().is_none(), "the job ended before it swapped");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    // SAFETY: kill(2) on the daemon our `swap up` started, by its pid.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    // The job touches its lost pages and dies of SIGBUS, or finishes on pages it still had.
    let status = tmem_testkit::wait_timeout(&mut hog, std::time::Duration::from_secs(120)).unwrap_or_else(|| {
        let _ = hog.kill();
        hog.wait().unwrap()
    });
    let mut out = String::new();
    std::io::Read::read_to_string(&mut hog.stdout.take().unwrap(), &mut out).unwrap();
    assert!(!out.contains("MISMATCH"), "never wrong data: {status:?} {out}");

    let (ok, text) = tmem(&["stat", "--runtime-dir", s.dir()]);
    assert!(!ok && text.contains(&format!("(pid {pid}) is dead and its swap is orphaned")), "{text}");
    let (ok, text) = tmem(&["swap", "down", "--runtime-dir", s.dir()]);
    assert!(ok, "swap down after a crash: {text}");
    assert!(text.contains("pages were lost") && text.contains("losetup --detach") && text.contains("umount"), "{text}");
    s.up = false;
    assert_clean(&s);
    for f in ["state.json", "ctl.sock", "dev"] {
        assert!(!s.dir.join(f).exists(), "{f} left in the runtime directory");
    }
    let (ok, text) = tmem(&["swap", "down", "--runtime-dir", s.dir()]);
    assert!(ok && text.contains("none left anything"), "swap down is idempotent: {text}");
    // A new daemon starts at once.
    s.swap_up("64M");
    s.swap_down();
    assert_clean(&s);
}

/// Injected panics in the put path: each fails its request alone (the
/// kernel keeps the page in RAM), the daemon goes on serving, and the job's
/// data is right.
#[test]
fn a_panic_fails_one_request_and_the_daemon_goes_on() {
    if !can_run() {
        return;
    }
    let mut s = Setup::new("panic");
    s.swap_up_env("1G", &[], &[("TMEM_FAULT_PANIC_WRITE_EVERY", "500")]);
    // A refused write keeps its page in RAM until the kernel writes it again:
    // a little more room than the half-memory job gets.
    let out = s.run_hog(512, 320);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.starts_with("OK "),
        "workload failed: {:?} {stdout} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let dev = &s.stat()[0];
    let panics = dev["panics"].as_u64().unwrap();
    assert!(panics > 10, "{dev}");
    assert!(dev["failed_writes"].as_u64().unwrap() >= panics, "{dev}");
    assert!(dev["store"]["total"]["succ_puts"].as_u64().unwrap() > 10 * panics, "later requests succeed: {dev}");
    let log = std::fs::read_to_string(s.dir.join("daemon.log")).unwrap();
    assert!(
        log.contains("fault injection: page write") && log.contains("stack backtrace")
            || log.contains("panic in thread"),
        "{log}"
    );
    s.swap_down();
    assert_clean(&s);
}

/// A teardown that panics part-way (it did, on a counter's underflow):
/// `swap down` is answered at once with an error instead of waiting for
/// ever, the daemon serves on, and a second `swap down` finishes the job.
#[test]
fn a_panic_in_swap_down_is_answered_and_the_next_swap_down_finishes() {
    if !can_run() {
        return;
    }
    let mut s = Setup::new("down-panic");
    s.swap_up_env("1G", &[], &[("TMEM_FAULT_PANIC_TEARDOWN", "1")]);
    let t = std::time::Instant::now();
    let (ok, out) = tmem(&["swap", "down", "--runtime-dir", s.dir()]);
    assert!(!ok && out.contains("a panic stopped the teardown part-way"), "{out}");
    assert!(t.elapsed() < std::time::Duration::from_secs(30), "answered after {:?}", t.elapsed());
    let (ok, status) = tmem(&["stat", "--runtime-dir", s.dir()]);
    assert!(ok, "the daemon serves on:\n{status}");
    // Its swap area is off (the panic came after swapoff), its device still serves.
    assert!(tmem_sys::swap::swaps().unwrap().is_empty(), "swapoff had run");
    s.swap_down();
    assert_clean(&s);
}

/// The pid in the state file of runtime directory `dir`, if it has one.
fn state_pid(dir: &std::path::Path) -> Option<i32> {
    let state: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("state.json")).ok()?).ok()?;
    i32::try_from(state["pid"].as_u64()?).ok()
}

/// Kills daemon `pid` with SIGKILL and waits up to 10 s for it to end (a
/// daemon this test started: its pid comes from its own runtime directory).
fn kill_daemon(pid: i32) {
    let _ = rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid).expect("a pid"),
        rustix::process::Signal::KILL,
    );
    tmem_daemon::handover::wait_for_exit(pid.unsigned_abs(), std::time::Duration::from_secs(10));
}

/// A ublk device that user recovery could not take (issue 28; fault
/// injection hands the daemon `/dev/ublkb77`, which does not exist, so
/// every try fails): it is tried again in the background, `swap down`
/// refuses before its swapoff (which would wait for ever) and says what to
/// do, `swap restart` offers it to the successor, which tries it too and
/// says so, and the documented way out (kill, then `swap down`) cleans up.
#[test]
fn a_ublk_device_not_taken_is_tried_again_and_offered_to_a_successor() {
    if !can_run() {
        return;
    }
    let mut s = Setup::new("ublk-waiting");
    s.swap_up_env("256M", &[], &[("TMEM_FAULT_UBLK_WAITING", "77")]);
    let first = s.daemon_pid();
    // Whatever fails below, no daemon of this test outlives it: the
    // Setup's drop then recovers with `swap down`.
    let dir = s.dir.clone();
    let _kill = scopeguard::guard((), move |()| {
        if let Some(pid) = state_pid(&dir) {
            kill_daemon(pid);
        }
    });
    let log = || std::fs::read_to_string(s.dir.join("daemon.log")).unwrap_or_default();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !log().contains("/dev/ublkb77: user recovery failed (try 3)") {
        assert!(std::time::Instant::now() < deadline, "not tried three times in 20 s:\n{}", log());
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let (ok, out) = tmem(&["swap", "down", "--runtime-dir", s.dir()]);
    assert!(!ok, "{out}");
    assert!(
        out.contains("/dev/ublkb77 not served (user recovery failed), so a swapoff would wait for ever")
            && out.contains(&format!("kill {first}")),
        "{out}"
    );
    assert!(tmem_sys::swap::swaps().unwrap().len() == 1, "its swap area is still on");
    let (ok, out) = tmem(&["swap", "restart", "--runtime-dir", s.dir()]);
    assert!(!ok, "a device was not taken: the restart says so: {out}");
    assert!(out.contains("/dev/ublkb77: user recovery failed (try 1)"), "the successor tried it: {out}");
    let next = s.daemon_pid();
    assert_ne!(next, first, "{out}");
    let (ok, out) = tmem(&["swap", "down", "--runtime-dir", s.dir()]);
    assert!(!ok && out.contains("/dev/ublkb77 not served"), "the successor keeps it waiting: {out}");
    kill_daemon(next);
    let out = s.swap_down();
    assert!(out.contains("dead"), "{out}");
    assert_clean(&s);
}

/// Holds `mib` MiB (1 KiB random + 3 KiB zeros per page) and reads it all
/// again and again until `stop` exists, checking each pass against the first
/// hash; prints the longest time one 1 MiB chunk took to read back (a swap
/// stall) and OK or MISMATCH.
const LONG_HOG: &str = r#"
import hashlib, os, random, sys, time
mib, stop = int(sys.argv[1]), sys.argv[2]
random.seed(11)
chunks = [bytearray(b"".join(random.randbytes(1024) + bytes(3072) for _ in range(256))) for _ in range(mib)]
first = hashlib.sha256(b"".join(chunks)).digest()
print("READY", flush=True)
worst, passes, ok = 0.0, 0, True
while not os.path.exists(stop) or passes < 2:
    h = hashlib.sha256()
    for c in chunks:
        t = time.monotonic()
        h.update(c)
        worst = max(worst, time.monotonic() - t)
    ok = ok and h.digest() == first
    passes += 1
print("OK" if ok else "MISMATCH", passes, "passes, longest chunk read %.1f ms" % (worst * 1000), flush=True)
"#;

/// [`LONG_HOG`] in the test's memory cgroup: it reads its heap over and
/// over until told to stop.
struct LongJob {
    child: std::process::Child,
    stop: PathBuf,
}

impl LongJob {
    /// `heap_mib` of heap under a limit of `limit_mib`.
    fn start(s: &Setup, limit_mib: u32, heap_mib: u32) -> Self {
        let stop = s.dir.join("stop-job");
        let child = s
            .in_cgroup(limit_mib, LONG_HOG, &[&heap_mib.to_string(), stop.to_str().unwrap()])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        Self { child, stop }
    }

    /// Waits (at most `within`) until `enough` says yes of `tmem stat`.
    fn wait_for(&mut self, s: &Setup, within: std::time::Duration, enough: impl Fn(&serde_json::Value) -> bool) {
        let deadline = std::time::Instant::now() + within;
        loop {
            let st = s.stat();
            if enough(&st) {
                return;
            }
            assert!(std::time::Instant::now() < deadline, "the job's pages never got there: {}", st[0]["store"]);
            self.assert_running("before the restarts");
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    }

    fn assert_running(&mut self, when: &str) {
        assert!(self.child.try_wait().unwrap().is_none(), "{when}: the job died");
    }

    /// Stops it; it must have read back what it wrote.
    fn finish(mut self) {
        std::fs::write(&self.stop, b"").unwrap();
        let status =
            tmem_testkit::wait_timeout(&mut self.child, std::time::Duration::from_secs(300)).expect("the job ends");
        let mut out = String::new();
        std::io::Read::read_to_string(&mut self.child.stdout.take().unwrap(), &mut out).unwrap();
        println!("job: {status:?} {out}");
        assert!(status.success() && out.contains("\nOK "), "the job read back what it wrote: {status:?} {out}");
    }
}

/// Pages in `tmem stat`'s first device's store.
fn stored_pages(st: &serde_json::Value) -> u64 {
    st[0]["store"]["total"]["stored_pages"].as_u64().unwrap()
}

/// How many requests `swap down` says went over io_uring.
fn uring_requests_served(down: &str) -> u64 {
    down.split(" requests were served over io_uring")
        .next()
        .and_then(|head| head.rsplit(['(', ' ']).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no io_uring count in:\n{down}"))
}

/// Bytes of `pid`'s memory that are resident and locked (`Locked:` of
/// smaps_rollup): under `mlockall(MCL_ONFAULT)`, the pages it has mapped.
fn locked_bytes(pid: i32) -> u64 {
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap();
    let kib = rollup.lines().find_map(|l| l.strip_prefix("Locked:")).expect("a Locked: line");
    kib.trim().trim_end_matches("kB").trim().parse::<u64>().unwrap() << 10
}

/// `tmem swap restart` under load (issue 12, issue 26): a job with over
/// 100 MiB in swap keeps running through three restarts and one refused
/// successor, never sees an error, and reads back what it wrote; counters
/// carry on. Rounds 0 and 2 share the pool's memory (memfd), round 1 is
/// streamed as a successor from before that asks; after each, the new
/// process holds the pool's pages locked.
#[test]
fn swap_restart_keeps_every_page_of_a_running_job() {
    if !can_run() {
        return;
    }
    let mut s = Setup::new("restart");
    s.swap_up_env("1G", &[], &[("TMEM_FAULT_HANDOVER_NOT_GONE", "1")]);
    let mut job = LongJob::start(&s, 160, 320);
    job.wait_for(&s, std::time::Duration::from_secs(180), |st| stored_pages(st) >= 25_600);
    let mut pid = s.daemon_pid();
    let mut before = s.stat()[0].clone();
    // A successor that speaks another protocol is refused; the daemon goes on.
    let (ok, out) = tmem_env(&["swap", "restart", "--runtime-dir", s.dir()], &[("TMEM_FAULT_HANDOVER_PROTOCOL", "99")]);
    assert!(!ok && out.contains("refused") && out.contains("protocol 99"), "{out}");
    assert_eq!(s.daemon_pid(), pid, "the running daemon goes on");
    // A successor whose TAKEN the daemon answers as one that gave up
    // waiting (once: TMEM_FAULT_HANDOVER_NOT_GONE) exits, and leaves the
    // daemon its state file and both sockets: `stat` answers with its pid,
    // and the next restarts go through its hand-over socket.
    let (ok, out) = tmem(&["swap", "restart", "--runtime-dir", s.dir()]);
    assert!(!ok && out.contains("answered 'F' to TAKEN and still runs"), "{out}");
    assert_eq!(s.daemon_pid(), pid, "the running daemon goes on");
    let (ok, out) = tmem(&["stat", "--runtime-dir", s.dir()]);
    assert!(ok, "the daemon that went on answers: {out}");
    job.assert_running("after a successor that was not let go on");
    // By default the index goes ahead while the daemon serves (pre-copy);
    // successors from before pre-copy, and from before zero-copy, are
    // served as they ask.
    for round in 0..4 {
        let (env, how): (&[(&str, &str)], &str) = match round {
            1 => (&[("TMEM_FAULT_HANDOVER_STREAMED", "1")], "by copying them (stream)"),
            2 => (&[("TMEM_FAULT_HANDOVER_NO_PRECOPY", "1")], "by sharing its memory (memfd; no page copied)"),
            _ => (&[], "pages went ahead while it served)"),
        };
        let (ok, out) = tmem_env(&["swap", "restart", "--runtime-dir", s.dir()], env);
        assert!(ok, "restart {round}: {out}");
        assert!(out.contains("took over from daemon pid") && out.contains("tmem swap restarted"), "{out}");
        assert!(out.contains(how), "restart {round}: {out}");
        println!("restart {round}: {}", out.lines().find(|l| l.contains("took over")).unwrap());
        let now = s.daemon_pid();
        assert_ne!(now, pid, "restart {round}: a new process serves");
        pid = now;
        // The successor maps and locks the adopted pool while it serves; the
        // old process waits for that (LOCKED) only so long (ANSWER_TIMEOUT),
        // which a loaded machine can outlast: give it as long again.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let (span, locked) = loop {
            let span = s.stat()[0]["store"]["alloc"]["span_bytes"].as_u64().unwrap();
            let locked = locked_bytes(pid);
            if locked >= span * 9 / 10 || std::time::Instant::now() > deadline {
                break (span, locked);
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        };
        println!("restart {round}: pool spans {} KiB, locked in the new process {} KiB", span >> 10, locked >> 10);
        assert!(locked >= span * 9 / 10, "restart {round}: {} KiB of {} KiB locked", locked >> 10, span >> 10);
        let after = s.stat()[0].clone();
        let (store_before, store_after) = (&before["store"]["total"], &after["store"]["total"]);
        for c in ["succ_puts", "succ_gets", "compressions", "decompressions"] {
            assert!(
                store_after[c].as_u64() >= store_before[c].as_u64(),
                "restart {round}: {c} went back: {store_before} -> {store_after}"
            );
        }
        // The device's I/O counters carry on too.
        for c in ["read_ios", "write_ios", "read_bytes", "write_bytes"] {
            let (was, is) = (before[c].as_u64().unwrap(), after[c].as_u64().unwrap());
            assert!(is >= was && (was > 0 || c.starts_with("read")), "restart {round}: {c} went back: {was} -> {is}");
        }
        job.assert_running(&format!("restart {round}"));
        std::thread::sleep(std::time::Duration::from_secs(2));
        before = s.stat()[0].clone();
    }
    job.finish();
    let st = s.stat();
    assert_eq!(st[0]["failed_reads"].as_u64(), Some(0));
    assert_eq!(st[0]["failed_writes"].as_u64(), Some(0));
    s.swap_down();
    assert_clean(&s);
}

/// `tmem swap restart` of a daemon on FUSE over io_uring (issue 26 item
/// 2): the running daemon leaves each ring entry holding a request, and
/// the successor answers them from the same buffers, which makes the
/// entries its own. A job with pages in swap keeps running through three
/// restarts and reads back what it wrote; a successor that cannot take
/// the ring is refused; the last successor still serves over io_uring.
#[test]
fn swap_restart_over_fuse_io_uring_keeps_every_page() {
    if !can_run() {
        return;
    }
    if !Path::new("/sys/module/fuse/parameters/enable_uring").exists() {
        tmem_testkit::skip(tmem_testkit::Feature::FuseUring, "this kernel has no FUSE over io_uring (Linux 6.14+)");
        return;
    }
    let mut s = Setup::new("restart-uring");
    let up = s.swap_up_with("1G", &["--fuse-uring", "2"]);
    assert!(up.contains("requests via io_uring"), "{up}");
    let mut job = LongJob::start(&s, 96, 192);
    job.wait_for(&s, std::time::Duration::from_secs(180), |st| stored_pages(st) >= 12_800);
    let mut pid = s.daemon_pid();
    let (ok, out) = tmem_env(&["swap", "restart", "--runtime-dir", s.dir()], &[("TMEM_FAULT_HANDOVER_NO_URING", "1")]);
    assert!(!ok && out.contains("cannot take FUSE over io_uring over"), "{out}");
    assert_eq!(s.daemon_pid(), pid, "the running daemon goes on");
    // A successor that fails after the pause, with the ring entries held
    // and the free ones filled: the running daemon answers them and goes on.
    let (ok, out) = tmem_env(&["swap", "restart", "--runtime-dir", s.dir()], &[("TMEM_FAULT_HANDOVER_FAIL_TAKE", "1")]);
    assert!(!ok && out.contains("fault injection"), "{out}");
    assert_eq!(s.daemon_pid(), pid, "the running daemon goes on");
    job.assert_running("after a failed hand-over");
    for round in 0..3 {
        let (ok, out) = tmem(&["swap", "restart", "--runtime-dir", s.dir()]);
        assert!(ok, "restart {round}: {out}");
        assert!(out.contains("took over from daemon pid") && out.contains("tmem swap restarted"), "{out}");
        assert!(out.contains("FUSE io_uring entries came along, each with the request it held"), "{out}");
        println!("restart {round}: {}", out.lines().find(|l| l.contains("took over")).unwrap());
        let now = s.daemon_pid();
        assert_ne!(now, pid, "restart {round}: a new process serves");
        pid = now;
        job.assert_running(&format!("restart {round}"));
        std::thread::sleep(std::time::Duration::from_secs(2));
    }
    job.finish();
    let st = s.stat();
    assert_eq!(st[0]["failed_reads"].as_u64(), Some(0));
    assert_eq!(st[0]["failed_writes"].as_u64(), Some(0));
    let down = s.swap_down();
    // The last successor served the job's swap-ins over the ring it took.
    let served = uring_requests_served(&down);
    assert!(served > 1000, "{served} requests over io_uring:\n{down}");
    assert_clean(&s);
}

/// `tmem swap restart` of a daemon with a remote tier (2 Redis servers,
/// R = 2) and a disk tier below its pool (issue 26 item 2): a job with
/// pages in all three keeps running through two restarts and reads back
/// what it wrote; the successor reads pages from both tiers, and no read
/// fails.
#[test]
fn swap_restart_keeps_the_pages_in_its_tiers() {
    if !can_run() {
        return;
    }
    let Some(below) = TestTiers::start(2, "16mb", "restart") else { return };
    let mut s = Setup::new("restart-tiers");
    let up = s.swap_up_with("24M", &below.args());
    assert!(up.contains("pool -> remote -> disk"), "{up}");
    let mut job = LongJob::start(&s, 128, 288);
    let writes = |st: &serde_json::Value, name: &str| {
        let tiers = st[0]["store"]["tiers"].as_array().cloned().unwrap_or_default();
        tiers.iter().find(|t| t["name"] == name).and_then(|t| t["writes"].as_u64()).unwrap_or(0)
    };
    job.wait_for(&s, std::time::Duration::from_secs(240), |st| {
        writes(st, "remote") > 2000 && writes(st, "disk") > 2000
    });
    let mut pid = s.daemon_pid();
    for round in 0..2 {
        let before = s.stat()[0]["store"]["total"].clone();
        let (ok, out) = tmem(&["swap", "restart", "--runtime-dir", s.dir()]);
        assert!(ok && out.contains("took over from daemon pid"), "restart {round}: {out}");
        assert!(out.contains("pages in its tiers (remote, disk) came along"), "restart {round}: {out}");
        println!("restart {round}: {}", out.lines().find(|l| l.contains("took over")).unwrap());
        let now = s.daemon_pid();
        assert_ne!(now, pid, "restart {round}: a new process serves");
        pid = now;
        job.assert_running(&format!("restart {round}"));
        // The successor serves pages from both tiers.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
        while s.stat()[0]["store"]["total"]["tier_gets"].as_u64() <= before["tier_gets"].as_u64() {
            assert!(std::time::Instant::now() < deadline, "restart {round}: no page came back from a tier");
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    }
    job.finish();
    let st = s.stat();
    let t = &st[0]["store"]["total"];
    let log = || std::fs::read_to_string(s.dir.join("daemon.log")).unwrap_or_default();
    assert_eq!(t["tier_get_fail"].as_u64(), Some(0), "{t}\n{}\n{}", st[0]["store"]["tiers"], log());
    assert_eq!(st[0]["failed_reads"].as_u64(), Some(0));
    assert_eq!(st[0]["failed_writes"].as_u64(), Some(0), "{}\n{}", st[0]["store"]["pools"][0], log());
    s.swap_down();
    assert_clean(&s);
}

/// zswap's parameters now.
fn zswap_params() -> std::collections::BTreeMap<String, String> {
    tmem_sys::zswap::read_params(Path::new(tmem_sys::zswap::PARAMS_DIR)).unwrap()
}

/// `--front zswap`: zswap's parameters are set while tmem runs, a job runs
/// through zswap and tmem's device, and after the daemon is killed,
/// `swap down` puts every parameter back and leaves nothing.
#[test]
fn zswap_in_front_is_put_back_after_a_crash() {
    if !can_run() {
        return;
    }
    if !tmem_sys::zswap::available() {
        tmem_testkit::skip(tmem_testkit::Feature::Swap, "this kernel has no zswap");
        return;
    }
    let before = zswap_params();
    let mut s = Setup::new("zswapfront");
    let up = s.swap_up_with("1G", &["--front", "zswap", "--front-limit", "64M"]);
    assert!(up.contains("front: zswap") && up.contains("zswap in front"), "{up}");
    assert!(up.contains("swap0: codec auto: zstd:3+dict, as zswap keeps the hot pages"), "{up}");
    assert!(s.stat()[0]["store"]["codec"].as_str().unwrap().starts_with("zstd"), "the cold tier's codec");
    assert!(tmem_sys::zswap::is_on(&zswap_params()["enabled"]), "zswap is on while tmem runs");
    assert!(s.dir.join("front.json").exists(), "the values before are saved first");
    let out = s.run_hog(256, 192);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.starts_with("OK "), "job: {:?} {stdout}", out.status);
    let front = s.stat()[0]["front"].clone();
    assert_eq!(front["front"], "zswap", "{front}");
    assert_eq!(front["budget_bytes"].as_u64(), Some(64 << 20), "{front}");
    let pid = s.daemon_pid();
    // SAFETY: kill(2) on the daemon our `swap up` started, by its pid.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while Path::new(&format!("/proc/{pid}")).exists() {
        assert!(std::time::Instant::now() < deadline, "the killed daemon is still there");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let (ok, text) = tmem(&["swap", "down", "--runtime-dir", s.dir()]);
    assert!(ok && text.contains("put zswap's settings back"), "{text}");
    s.up = false;
    assert_eq!(zswap_params(), before, "every zswap parameter is back");
    assert!(!s.dir.join("front.json").exists());
    assert_clean(&s);
}

/// `--front zram` needs zram writeback. Without it (this kernel) it is
/// refused with the reason and nothing is left; with it, a job runs over
/// zram, idle pages go down to tmem, and `swap down` removes the zram
/// device. `auto` names its choice and why.
#[test]
fn zram_in_front_writes_idle_pages_to_tmem_or_is_refused_with_the_reason() {
    if !can_run() {
        return;
    }
    let mut s = Setup::new("zramfront");
    let writeback = tmem_front::KernelFronts::probe().zram_writeback;
    let args = ["--front", "zram", "--front-limit", "48M", "--front-idle-age", "1", "--front-fill", "0"];
    if let Err(why) = &writeback {
        let mut cmd = vec!["swap", "up", "--size", "512M", "--runtime-dir", s.dir()];
        cmd.extend(args);
        let (ok, text) = tmem(&cmd);
        assert!(!ok && text.contains("--front zram is not available here") && text.contains(why.as_str()), "{text}");
        assert_clean(&s);
        let up = s.swap_up_with("1G", &["--front", "auto"]);
        assert!(up.contains("front: none (--front auto: no front"), "{up}");
        assert!(up.contains("swap0: codec auto: lz4, as no front"), "{up}");
        assert_eq!(s.stat()[0]["store"]["codec"], "lz4", "the fault path's codec");
        assert_eq!(s.stat()[0].get("front"), None, "no front, no front counters");
        s.swap_down();
        assert_clean(&s);
        return;
    }
    let up = s.swap_up_with("1G", &args);
    assert!(up.contains("front: zram") && up.contains("backing_dev /dev/loop"), "{up}");
    let node = s.stat()[0]["front"]["node"].as_str().unwrap().to_owned();
    let out = s.run_hog(256, 128);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.starts_with("OK "), "job: {:?} {stdout}", out.status);
    let front = s.stat()[0]["front"].clone();
    assert!(front["written_back"].as_u64().unwrap() > 0, "idle pages went down to tmem: {front}");
    let down = s.swap_down();
    assert!(down.contains(&format!("{node}: removed")), "{down}");
    assert!(!Path::new(&node).exists() || tmem_sys::zram::backed_by(Path::new("/dev/loop0")).is_empty());
    assert_clean(&s);
}

/// A kernel transport (`nbd`, `ublk`) by name. Where the kernel has it
/// (`here`), a job swaps over it (`up_says` in `swap up`'s steps) and `swap
/// down` removes the device (`down_says`); elsewhere `--transport T` is
/// refused with the kernel's reason, and `auto` takes what the kernel has.
/// This machine has neither; the Debian VMs run the other branch
/// (scripts/vm/transports.sh).
fn kernel_transport(t: &str, here: Result<(), String>, up_says: &str, down_says: [&str; 2]) {
    if !can_run() {
        return;
    }
    let mut s = Setup::new(&format!("{t}transport"));
    if let Err(why) = here {
        let (ok, text) = tmem(&["swap", "up", "--size", "512M", "--runtime-dir", s.dir(), "--transport", t]);
        assert!(!ok && text.contains(&format!("--transport {t}: ")), "{text}");
        assert!(text.contains(why.split(';').next().unwrap()), "the reason {why:?} in: {text}");
        assert_clean(&s);
        let auto = if tmem_ublk::available().is_ok() { "ublk" } else { "fuse" };
        let up = s.swap_up("1G");
        assert!(up.contains(&format!("transport: {auto} (auto: ")), "{up}");
        let transport = s.stat()[0]["transport"].clone();
        assert_eq!(transport["kind"], auto, "{transport}");
        if auto == "fuse" {
            // auto says why it did not take ublk.
            assert!(up.contains("as there is no ublk here"), "{up}");
            assert!(transport["node"].as_str().unwrap().starts_with("/dev/loop"), "{transport}");
        }
        s.swap_down();
        assert_clean(&s);
        return;
    }
    let up = s.swap_up_with("1G", &["--transport", t]);
    assert!(up.contains(up_says), "{up}");
    let transport = s.stat()[0]["transport"].clone();
    assert_eq!(transport["kind"], t, "{transport}");
    let out = s.run_hog(256, 128);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.starts_with("OK "), "job: {:?} {stdout}", out.status);
    let down = s.swap_down();
    assert!(down_says.iter().all(|w| down.contains(w)), "{down}");
    assert!(tmem_ublk::devices().is_empty(), "ublk devices left: {:?}", tmem_ublk::devices());
    assert_clean(&s);
}

#[test]
fn the_nbd_transport_runs_a_job_where_the_kernel_has_it_or_is_refused_with_the_reason() {
    kernel_transport(
        "nbd",
        tmem_nbd::kernel::available(),
        "the kernel's NBD client on /dev/nbd",
        ["NBD device", "disconnected"],
    );
}

#[test]
fn the_ublk_transport_runs_a_job_where_the_kernel_has_it_or_is_refused_with_the_reason() {
    kernel_transport("ublk", tmem_ublk::available(), "ublk device /dev/ublkb", ["ublk device", "deleted"]);
}
