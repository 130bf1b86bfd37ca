//! `tmem run` end to end, on this machine's kernel: a C job of 8 threads
//! that writes, rewrites, unmaps, remaps and drops its memory and forks
//! checking children (tests/run/stress.c), a python job and a C job
//! filling a fresh mapping (tests/run/fresh.c) whose resident memory must
//! stay within `--memory`, and the unprivileged user: refused
//! with the setting to change when it lacks access, and served when it has
//! `/dev/userfaultfd` as the README says.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use tmem_testkit::{is_root, skip, Feature};

fn tmem() -> &'static str {
    env!("CARGO_BIN_EXE_tmem")
}

/// Whether this kernel and user give `tmem run` what it needs; skips (or
/// fails under `TMEM_REQUIRE`) when not.
fn userfaultfd() -> bool {
    match tmem_uffd::sys::Uffd::create().and_then(|u| u.handshake()) {
        Ok(()) => true,
        Err(e) => {
            skip(Feature::Userfaultfd, &format!("tmem run needs userfaultfd: {e}"));
            false
        }
    }
}

/// Builds the C job `tests/run/NAME.c` into `dir`.
fn build_c(dir: &Path, name: &str) -> Option<PathBuf> {
    if !tmem_testkit::have_tool("cc") {
        skip(Feature::Tools, "cc is not installed");
        return None;
    }
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/run/{name}.c"));
    let out = dir.join(name);
    let st = Command::new("cc").args(["-O2", "-pthread", "-Wall", "-o"]).arg(&out).arg(&src).status().unwrap();
    assert!(st.success(), "cc {}", src.display());
    Some(out)
}

/// The summary's "resident at most R MiB of --memory M MiB" and the fault slack.
fn resident(stderr: &str) -> (f64, f64, f64) {
    let line = stderr.lines().find(|l| l.starts_with("tmem run: ")).unwrap_or_else(|| panic!("no summary in {stderr}"));
    let num = |after: &str| -> f64 {
        let at = line.find(after).unwrap_or_else(|| panic!("{after:?} not in {line}")) + after.len();
        line[at..].split_whitespace().next().unwrap().parse().unwrap()
    };
    (num("resident at most "), num("of --memory "), num("faults wait past "))
}

fn count(stderr: &str, what: &str) -> u64 {
    let line = stderr.lines().find(|l| l.starts_with("tmem run: ")).unwrap();
    let at = line.find(what).unwrap_or_else(|| panic!("{what:?} not in {line}"));
    line[..at].split_whitespace().last().unwrap().parse().unwrap()
}

fn run(args: &[&str], program: &[&str]) -> Output {
    Command::new(tmem()).arg("run").args(args).arg("--").args(program).output().unwrap()
}

#[test]
fn the_stress_job_keeps_every_byte_at_a_quarter_of_its_memory() {
    if !userfaultfd() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let Some(job) = build_c(dir.path(), "stress") else { return };
    let job = job.to_str().unwrap();
    // 64 MiB of regions; natively the job peaks at about 60 MiB resident.
    // The `remap` mix moves and resizes regions a quarter of the time,
    // through the agent's `mremap` fallback (README, `tmem run` limits).
    for (seed, mix) in [("1", "default"), ("2", "default"), ("3", "remap")] {
        let out = run(&["--memory", "16M"], &[job, seed, "64", "20000", mix]);
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && stdout.starts_with("ok "), "seed {seed} ({mix}): {stdout}{stderr}");
        assert_eq!(count(&stderr, "lost"), 0, "{stderr}");
        assert!(count(&stderr, "pages evicted") > 0, "nothing was evicted: {stderr}");
        assert!(count(&stderr, "from the pool") > 0, "nothing came back from the pool: {stderr}");
    }
}

/// A python heap of text-like records, hashed, rewritten in part and hashed again.
const PY_JOB: &str = r#"
import hashlib, random, sys
random.seed(7)
words = [bytes(random.choice(b"etaoinshrdlu ") for _ in range(6)) for _ in range(300)]
blocks = [bytearray(b"".join(random.choice(words) for _ in range(4096 // 6 + 1))[:4096]) for _ in range(int(sys.argv[1]) * 256)]
h = hashlib.sha256(b"".join(blocks)).hexdigest()
for i in range(0, len(blocks), 5):
    blocks[i][0] ^= 0xff
    blocks[i][0] ^= 0xff
print("ok" if hashlib.sha256(b"".join(blocks)).hexdigest() == h else "MISMATCH")
"#;

#[test]
fn a_python_heap_stays_within_its_memory_and_reads_back_whole() {
    if !userfaultfd() {
        return;
    }
    if !tmem_testkit::have_tool("python3") {
        skip(Feature::Tools, "python3 is not installed");
        return;
    }
    // 96 MiB of records (about 110 MiB resident natively) in 40 MiB.
    let out = run(&["--memory", "40M"], &["python3", "-c", PY_JOB, "96"]);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && stdout.trim() == "ok", "{stdout}{stderr}");
    // Faults wait once the program is `slack` over; pages it touched in new
    // mappings before a scan registered them come on top.
    let (peak, limit, slack) = resident(&stderr);
    assert!(slack <= limit / 20.0, "{stderr}");
    assert!(peak <= limit * 1.15, "resident {peak} MiB, more than 15% over --memory {limit}: {stderr}");
    assert!(count(&stderr, "from the pool") > 1000, "{stderr}");
    // The hashes walk the records in order: faults there read ahead.
    assert!(count(&stderr, "stored pages read ahead of them") > 1000, "{stderr}");
    // The records are built in order in fresh memory: zeros go ahead of them.
    assert!(count(&stderr, "fresh ones filled with zeros ahead") > 1000, "{stderr}");
    assert_eq!(count(&stderr, "lost"), 0, "{stderr}");
}

/// A program that fills a fresh 64 MiB mapping at memset speed, in 16 MiB:
/// its pages are resident before any scan has registered the mapping. The
/// evictor's statm poll must see them and scan at once; with a scan every
/// 20 ms alone, 9 of 11 such runs peaked at 19.5-43.2 MiB (release build).
#[test]
fn a_fresh_mapping_filled_at_full_speed_stays_within_its_memory() {
    if !userfaultfd() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let Some(job) = build_c(dir.path(), "fresh") else { return };
    for round in 0..3 {
        let out = run(&["--memory", "16M"], &[job.to_str().unwrap(), "64"]);
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && stdout.trim() == "ok", "round {round}: {stdout}{stderr}");
        let (peak, limit, _) = resident(&stderr);
        assert!(peak <= limit * 1.15, "round {round}: resident {peak} MiB of --memory {limit}: {stderr}");
        assert!(count(&stderr, "pages evicted") > 8192, "{stderr}");
        assert_eq!(count(&stderr, "lost"), 0, "{stderr}");
    }
}

/// Holds 48 MiB, says so, and waits for its standard input to close.
const PY_HOLD: &str = r#"
import sys
held = [bytearray(bytes([i % 251]) * 4096) for i in range(48 * 256)]
print("holding", flush=True)
sys.stdin.read()
print("ok" if all(b[0] == i % 251 for i, b in enumerate(held)) else "MISMATCH")
"#;

/// A GET of `url` (`http://ADDR/PATH`) over a plain socket; the body.
fn http_get(url: &str) -> String {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").unwrap();
    let (addr, path) = rest.split_at(rest.find('/').unwrap());
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.split_once("\r\n\r\n").map(|(_, body)| body.to_owned()).unwrap_or_default()
}

/// A `tmem run` of a python script that holds its memory until its
/// standard input closes, in a runs directory of its own (other tests'
/// runs stay out of its listing).
struct Held {
    child: std::process::Child,
    stdout: std::io::BufReader<std::process::ChildStdout>,
    xdg: tempfile::TempDir,
}

impl Held {
    /// Starts `tmem run ARGS -- python3 -c SCRIPT` and waits for its
    /// "holding"; `None` (skipped) without userfaultfd or python3.
    fn start(args: &[&str], script: &str) -> Option<Self> {
        use std::io::BufRead;
        if !userfaultfd() {
            return None;
        }
        if !tmem_testkit::have_tool("python3") {
            skip(Feature::Tools, "python3 is not installed");
            return None;
        }
        let xdg = tempfile::tempdir().unwrap();
        let mut child = Command::new(tmem())
            .env("XDG_RUNTIME_DIR", xdg.path())
            .arg("run")
            .args(args)
            .args(["--", "python3", "-c", script])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "holding");
        Some(Self { child, stdout, xdg })
    }

    /// `tmem stat ARGS` as this run's user sees it.
    fn stat(&self, args: &[&str]) -> Output {
        Command::new(tmem()).env("XDG_RUNTIME_DIR", self.xdg.path()).arg("stat").args(args).output().unwrap()
    }

    /// Asks `tmem stat --runs --json` until `done` says yes of the one run
    /// listed (pages in mappings the last scan had not seen are counted by
    /// the next one), for 20 s at most; that run's entry.
    fn stat_until(&self, what: &str, done: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let out = self.stat(&["--runs", "--json"]);
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            let devs: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            let devs = devs.as_array().unwrap();
            assert_eq!(devs.len(), 1, "{devs:?}");
            if done(&devs[0]) {
                return devs[0].clone();
            }
            assert!(std::time::Instant::now() < deadline, "{what}: {}", devs[0]);
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }

    /// Closes its standard input; its last line ("ok" or "MISMATCH"), and how
    /// it ended (with its summary, where its standard error was not taken).
    fn finish(mut self) -> (String, Output) {
        drop(self.child.stdin.take());
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut self.stdout, &mut rest).unwrap();
        (rest.trim().to_owned(), self.child.wait_with_output().unwrap())
    }
}

#[test]
fn a_run_is_seen_by_tmem_stat_and_its_metrics_while_it_lasts() {
    use std::io::BufRead;
    let Some(mut held) = Held::start(&["--memory", "16M", "--metrics", "127.0.0.1:0"], PY_HOLD) else { return };
    let mut stderr = std::io::BufReader::new(held.child.stderr.take().unwrap());
    let mut line = String::new();
    stderr.read_line(&mut line).unwrap();
    let url = line.trim().strip_prefix("tmem run: metrics at ").unwrap_or_else(|| panic!("{line}")).to_owned();
    let name = format!("run-{}", held.child.id());
    // 48 MiB held in 16: at least 32 MiB of it is in the store.
    let dev = held.stat_until("the store never held 32 MiB", |dev| {
        let run = &dev["run"];
        assert_eq!(dev["name"], name.as_str());
        assert_eq!(run["memory_limit_bytes"], 16 << 20);
        assert_eq!(run["processes"], 1);
        // Pages touched before a scan registered their mapping come on top
        // of the budget until evicted (the python test bounds that).
        assert!(run["resident_pages"].as_u64().unwrap() <= run["resident_peak_pages"].as_u64().unwrap(), "{run}");
        run["stored_pages"].as_u64().unwrap() >= 32 * 256
    });
    let evicted = dev["run"]["engine"]["evicted"].as_u64().unwrap();
    assert!(evicted >= 32 * 256, "{dev}");
    assert!(dev["store"]["total"]["stored_pages"].as_u64().unwrap() >= 32 * 256, "{dev}");
    // The table and the metrics say the same.
    let table = String::from_utf8_lossy(&held.stat(&["--runs"]).stdout).into_owned();
    assert!(table.contains(&name) && table.contains("python3"), "{table}");
    let metrics = http_get(&url);
    let sample = metrics
        .lines()
        .find_map(|l| l.strip_prefix(&format!("tmem_run_evicted_total{{device=\"{name}\"}} ")))
        .unwrap_or_else(|| panic!("no tmem_run_evicted_total in\n{metrics}"));
    assert!(sample.parse::<u64>().unwrap() >= evicted);
    // `tmem set` changes its budget.
    let set = Command::new(tmem())
        .env("XDG_RUNTIME_DIR", held.xdg.path())
        .args(["set", &name, "memory=24M"])
        .output()
        .unwrap();
    assert!(set.status.success(), "{}", String::from_utf8_lossy(&set.stderr));
    held.stat_until("the new budget", |dev| dev["run"]["memory_limit_bytes"] == 24 << 20);
    let xdg_path = held.xdg.path().to_owned();
    let (last, out) = held.finish();
    assert_eq!(last, "ok");
    assert!(out.status.success());
    // Gone with it: its socket, and so its entry.
    let out = Command::new(tmem()).env("XDG_RUNTIME_DIR", &xdg_path).args(["stat", "--runs"]).output().unwrap();
    assert!(!out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no tmem run instance"));
}

/// An idle program's maps do not change, so the evictor reads them a few
/// times a second, not 50 (two reads and a `UFFDIO_REGISTER` per range
/// each time, which cost an idle JVM's run 4.4 % of a CPU).
#[test]
fn an_idle_program_has_its_maps_read_a_few_times_a_second() {
    let Some(held) = Held::start(&["--memory", "16M"], PY_HOLD) else { return };
    held.stat_until("the store never held 32 MiB", |dev| dev["run"]["stored_pages"].as_u64().unwrap() >= 32 * 256);
    let scans = || held.stat_until("one look at the run", |_| true)["run"]["map_scans"].as_u64().unwrap();
    // The wait between scans doubles from 20 ms to 320 ms in 1.2 s.
    std::thread::sleep(std::time::Duration::from_secs(2));
    let (before, t) = (scans(), std::time::Instant::now());
    std::thread::sleep(std::time::Duration::from_secs(3));
    let (after, secs) = (scans(), t.elapsed().as_secs_f64());
    let per_sec = (after - before) as f64 / secs;
    assert!(per_sec <= 8.0, "{per_sec:.1} reads of the maps a second while the program slept ({before} -> {after})");
    let (last, out) = held.finish();
    assert_eq!(last, "ok", "{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success());
}

/// Holds 48 MiB of half-random pages (about 2x compressible), says so, and
/// checks them once its standard input closes.
const PY_HOLD_RANDOM: &str = r#"
import hashlib, os, sys
held = [bytearray(os.urandom(2048) + bytes(2048)) for i in range(48 * 256)]
h = hashlib.sha256(b"".join(held)).hexdigest()
print("holding", flush=True)
sys.stdin.read()
print("ok" if hashlib.sha256(b"".join(held)).hexdigest() == h else "MISMATCH")
"#;

#[test]
fn a_run_with_a_small_pool_moves_pages_to_its_disk_tier_and_reads_them_back() {
    let tier = tempfile::tempdir().unwrap();
    let disk = format!("disk={}", tier.path().display());
    // 48 MiB held in 16 MiB, a pool of 4 MiB: most of it goes on to the disk
    // tier; a dictionary is trained and cold pages recompressed meanwhile.
    let args = [
        "--memory",
        "16M",
        "--pool-limit",
        "4M",
        "--tier",
        &disk,
        "--codec",
        "lz4+dict",
        "--recompress",
        "zstd",
        "--recompress-after",
        "0.5",
    ];
    let Some(held) = Held::start(&args, PY_HOLD_RANDOM) else { return };
    let file = tier.path().join(format!("run-{}.back", held.child.id()));
    assert!(file.exists(), "no {}", file.display());
    let dev = held.stat_until("the disk tier never held 16 MiB", |dev| {
        let tiers = dev["store"]["tiers"].as_array();
        let disk = tiers.and_then(|t| t.iter().find(|t| t["name"] == "disk"));
        disk.is_some_and(|d| d["stored_pages"].as_u64().unwrap() >= 16 * 256)
    });
    assert!(dev["store"]["mem_used_total"].as_u64().unwrap() <= 6 << 20, "{dev}");
    let (last, out) = held.finish();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(last, "ok", "{stderr}");
    assert!(out.status.success(), "{stderr}");
    assert_eq!(count(&stderr, "lost"), 0, "{stderr}");
    assert!(!file.exists(), "the run's tier file was left behind");
}

/// Puts /dev/userfaultfd's mode back when dropped.
struct DeviceMode(u32);

impl Drop for DeviceMode {
    fn drop(&mut self) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions("/dev/userfaultfd", std::fs::Permissions::from_mode(self.0)).unwrap();
    }
}

fn as_nobody(groups: &str, args: &[&str], program: &[&str]) -> Output {
    Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", groups, "--"])
        .arg(tmem())
        .arg("run")
        .args(args)
        .arg("--")
        .args(program)
        .env("TMPDIR", "/tmp")
        .output()
        .unwrap()
}

/// One test, not two: the refusal needs the device closed to the user, the
/// run needs it open, and tests run in parallel.
#[test]
fn a_user_without_userfaultfd_is_refused_and_one_given_the_device_runs() {
    use std::os::unix::fs::PermissionsExt;
    if !is_root() {
        skip(Feature::Root, "changing /dev/userfaultfd's mode and running as another user need root");
        return;
    }
    if !userfaultfd() {
        return;
    }
    let sysctl = std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd").unwrap_or_default();
    let Ok(meta) = std::fs::metadata("/dev/userfaultfd") else {
        skip(Feature::Userfaultfd, "no /dev/userfaultfd (Linux 6.1+)");
        return;
    };
    assert_eq!(sysctl.trim(), "0", "the refusal needs vm.unprivileged_userfaultfd=0, the default");
    let mode = meta.permissions().mode() & 0o7777;
    let _restore = DeviceMode(mode);
    std::fs::set_permissions("/dev/userfaultfd", std::fs::Permissions::from_mode(0o600)).unwrap();

    // Refused: one clear error naming both settings, and the program never ran.
    let out = as_nobody("--clear-groups", &["--memory", "64M"], &["/bin/sh", "-c", "echo RAN"]);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "{stdout}{stderr}");
    assert!(!stdout.contains("RAN"), "the program ran unmanaged: {stdout}");
    assert!(stderr.contains("vm.unprivileged_userfaultfd") && stderr.contains("/dev/userfaultfd"), "{stderr}");
    assert!(stderr.contains("UFFD_USER_MODE_ONLY"), "the error says why there is no fallback: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");

    // Given the device through a group, as the udev rule does (group root here).
    std::fs::set_permissions("/dev/userfaultfd", std::fs::Permissions::from_mode(0o660)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let Some(job) = build_c(dir.path(), "stress") else { return };
    let out = as_nobody("--groups=0", &["--memory", "16M"], &[job.to_str().unwrap(), "5", "64", "10000"]);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && stdout.starts_with("ok "), "{stdout}{stderr}");
    assert!(count(&stderr, "pages evicted") > 0, "{stderr}");
    assert_eq!(count(&stderr, "lost"), 0, "{stderr}");
}

#[test]
fn a_static_program_is_refused_before_it_runs() {
    if !userfaultfd() {
        return;
    }
    if !tmem_testkit::have_tool("cc") {
        skip(Feature::Tools, "cc is not installed");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("hello.c");
    std::fs::write(&src, "#include <stdio.h>\nint main(void) { puts(\"RAN\"); return 0; }\n").unwrap();
    let bin = dir.path().join("hello");
    let built = Command::new("cc").args(["-static", "-o"]).arg(&bin).arg(&src).status().unwrap();
    if !built.success() {
        skip(Feature::Tools, "cc cannot link statically (no static libc)");
        return;
    }
    let out = run(&["--memory", "64M"], &[bin.to_str().unwrap()]);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success() && !stdout.contains("RAN"), "{stdout}{stderr}");
    assert!(stderr.contains("statically linked"), "{stderr}");
}
