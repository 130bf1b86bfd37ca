//! Regression tests for the security review's findings, end to end with the
//! real binary (root: the daemon locks its memory, swap up mounts FUSE).
//! Each daemon started here is stopped by pid, and each directory removed,
//! even when an assertion fails.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use tmem_testkit::{have_tool, is_root, skip, Feature};

const TMEM: &str = env!("CARGO_BIN_EXE_tmem");

/// Whether `tmem swap up` can run here (root, FUSE, loop devices, swap, the
/// util-linux tools); reports the skip naming what is missing when not.
fn can_swap_up() -> bool {
    if !is_root() {
        skip(Feature::Root, "swap up needs root");
        return false;
    }
    for (path, feature) in
        [("/dev/fuse", Feature::Fuse), ("/dev/loop-control", Feature::Loop), ("/proc/swaps", Feature::Swap)]
    {
        if !Path::new(path).exists() {
            skip(feature, &format!("{path} is missing"));
            return false;
        }
    }
    for tool in ["losetup", "mkswap", "swapon", "swapoff"] {
        if !have_tool(tool) {
            skip(Feature::Tools, &format!("{tool} is not installed (util-linux)"));
            return false;
        }
    }
    true
}

fn tmem(args: &[&str]) -> (Output, String, Duration) {
    let t = Instant::now();
    let out = Command::new(TMEM).args(args).stdin(Stdio::null()).output().expect("run tmem");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out, text, t.elapsed())
}

/// A scratch directory and the `tmem serve nbd` daemons started in it;
/// the daemons are stopped by pid and the directory removed on drop.
struct Scratch {
    dir: tempfile::TempDir,
    servers: Vec<Child>,
}

impl Scratch {
    fn new() -> Self {
        Self { dir: tempfile::tempdir().unwrap(), servers: Vec::new() }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Starts `tmem serve nbd ARGS --runtime-dir RUN` and waits for its control socket.
    fn serve(&mut self, args: &[&str]) -> PathBuf {
        let run = self.path("run");
        let child = Command::new(TMEM)
            .args(["serve", "nbd"])
            .args(args)
            .arg("--runtime-dir")
            .arg(&run)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.servers.push(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !run.join("nbd.sock").exists() {
            assert!(Instant::now() < deadline, "no NBD socket after 30 s");
            std::thread::sleep(Duration::from_millis(50));
        }
        run
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        for c in &mut self.servers {
            let _ = rustix::process::kill_process(rustix::process::Pid::from_child(c), rustix::process::Signal::TERM);
            let _ = tmem_testkit::wait_timeout(c, Duration::from_secs(10));
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A scratch directory with `tmem serve nbd ARGS` running in it, and its
/// runtime directory; `None` (a skip) where the daemon cannot run.
fn serving(args: &[&str]) -> Option<(Scratch, PathBuf)> {
    if !is_root() {
        skip(Feature::Root, "the daemon calls mlockall, which needs root here");
        return None;
    }
    let mut s = Scratch::new();
    let run = s.serve(args);
    Some((s, run))
}

/// Finding 2: one silent control client blocked `tmem stat`, and a second
/// daemon took over the socket. Also finding 6: `tmem set` accepted values
/// that `swap up` refuses.
#[test]
fn control_socket_cannot_be_held_or_taken_over() {
    let Some((_scratch, run)) = serving(&["--size", "64M"]) else { return };
    let run_s = run.to_str().unwrap().to_owned();
    let sock = run.join(tmem_ctl::SOCKET);
    let inode = std::fs::metadata(&sock).unwrap().ino();
    let silent: Vec<UnixStream> = (0..4).map(|_| UnixStream::connect(&sock).unwrap()).collect();

    let (out, text, took) = tmem(&["stat", "--json", "--runtime-dir", &run_s]);
    assert!(out.status.success() && took < Duration::from_secs(3), "stat took {took:?}: {text}");

    // A second daemon of either kind refuses at once and changes nothing.
    let (out, text, took) = tmem(&["serve", "nbd", "--size", "64M", "--runtime-dir", &run_s]);
    assert!(!out.status.success() && text.contains("already runs") && took < Duration::from_secs(5), "{text}");
    let (out, text, _) = tmem(&["swap", "up", "--size", "64M", "--runtime-dir", &run_s]);
    assert!(!out.status.success() && text.contains("already runs"), "{text}");
    assert_eq!(std::fs::metadata(&sock).unwrap().ino(), inode, "the live socket was not replaced");
    assert!(!run.join("daemon.log").exists(), "nothing was written into the live daemon's directory");

    for bad in ["pool-limit=0%", "pool-limit=1", "compact=garbage"] {
        let (out, text, _) = tmem(&["set", "--runtime-dir", &run_s, "disk0", bad]);
        let value = bad.split_once('=').unwrap().1;
        assert!(!out.status.success() && (text.contains(&format!("{value:?}")) || text.contains(bad)), "{bad}: {text}");
    }
    let (out, text, _) = tmem(&["set", "--runtime-dir", &run_s, "disk0", "pool-limit=2%"]);
    assert!(out.status.success(), "{text}");
    drop(silent);
}

/// Finding 1: devices of one daemon (and runs) with one key file sealed
/// under the same (key, nonce) pairs. The same data through two devices
/// must leave disk tier files that share no keystream.
#[test]
fn two_devices_with_one_key_file_share_no_keystream() {
    if !is_root() {
        skip(Feature::Root, "the daemon calls mlockall, which needs root here");
        return;
    }
    if !have_tool("nbdcopy") {
        skip(Feature::Tools, "nbdcopy is not installed (libnbd-bin)");
        return;
    }
    let mut s = Scratch::new();
    let key = s.path("key");
    std::fs::write(&key, [0x11u8; 32]).unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let tier = s.path("tier");
    std::fs::create_dir(&tier).unwrap();
    // 8 MiB of compressible but not same-filled pages, written to both devices.
    let data: Vec<u8> = (0..8u32 << 20)
        .map(|i| if i % 4096 < 1024 { i.wrapping_mul(2_654_435_761).to_le_bytes()[2] } else { 0 })
        .collect();
    let img = s.path("data.img");
    std::fs::write(&img, &data).unwrap();
    let run = s.serve(&[
        "--size",
        "64M",
        "--devices",
        "2",
        "--pool-limit",
        "1M",
        "--tier",
        &format!("disk={}", tier.display()),
        "--key-file",
        key.to_str().unwrap(),
    ]);
    for dev in ["disk0", "disk1"] {
        let uri = format!("nbd+unix:///{dev}?socket={}", run.join("nbd.sock").display());
        let mut copy = Command::new("nbdcopy").arg(&img).arg(&uri).stderr(Stdio::null()).spawn().unwrap();
        let Some(status) = tmem_testkit::wait_timeout(&mut copy, Duration::from_secs(60)) else {
            let _ = copy.kill();
            let _ = copy.wait();
            panic!("nbdcopy to {dev} did not finish within 60 s");
        };
        assert!(status.success(), "nbdcopy to {dev}: {status}");
    }
    // Wait until both devices wrote most of it back to their disk tier files.
    let deadline = Instant::now() + Duration::from_secs(30);
    let (a, b) = loop {
        let a = std::fs::read(tier.join("disk0.back")).unwrap_or_default();
        let b = std::fs::read(tier.join("disk1.back")).unwrap_or_default();
        let nonzero = |v: &[u8]| v.iter().filter(|&&x| x != 0).count();
        if nonzero(&a) > 256 << 10 && nonzero(&b) > 256 << 10 {
            break (a, b);
        }
        assert!(Instant::now() < deadline, "the disk tiers did not fill: {} / {} bytes", nonzero(&a), nonzero(&b));
        std::thread::sleep(Duration::from_millis(200));
    };
    let both = a.iter().zip(&b).filter(|(x, y)| **x != 0 && **y != 0).count();
    let equal = a.iter().zip(&b).filter(|(x, y)| **x != 0 && x == y).count();
    // Independent keystreams agree on about 1/256 of bytes; before the fix, 85.9%.
    assert!(equal * 20 < both, "{equal} of {both} sealed bytes are equal in disk0.back and disk1.back");
}

/// Finding 4: `--size 99999T` was accepted, and the daemon went on after the
/// command gave up. Finding 6: a FIFO key file hung `swap up`; a 3 GiB one
/// was read whole.
#[test]
fn bad_sizes_and_key_files_are_refused_at_once() {
    if !is_root() {
        skip(Feature::Root, "swap up needs root");
        return;
    }
    let s = Scratch::new();
    let run = s.path("run");
    let run_s = run.to_str().unwrap();
    let swaps = std::fs::read_to_string("/proc/swaps").unwrap();
    let (out, text, took) = tmem(&["swap", "up", "--size", "99999T", "--runtime-dir", run_s]);
    assert!(!out.status.success() && took < Duration::from_secs(10), "{took:?} {text}");
    assert!(text.contains("kernel memory") && text.contains("the largest total size here is"), "{text}");
    assert_eq!(std::fs::read_to_string("/proc/swaps").unwrap(), swaps);
    assert!(!run.exists(), "nothing was started");

    let tier = format!("disk={}", s.dir.path().display());
    let fifo = s.path("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    std::fs::set_permissions(&fifo, std::fs::Permissions::from_mode(0o600)).unwrap();
    let big = s.path("big");
    let f = std::fs::File::create(&big).unwrap();
    f.set_len(3 << 30).unwrap();
    std::fs::set_permissions(&big, std::fs::Permissions::from_mode(0o600)).unwrap();
    for (key, expect) in [(&fifo, "not a regular file"), (&big, "3221225472 bytes")] {
        let (out, text, took) = tmem(&[
            "swap",
            "up",
            "--size",
            "64M",
            "--tier",
            &tier,
            "--key-file",
            key.to_str().unwrap(),
            "--runtime-dir",
            run_s,
        ]);
        assert!(!out.status.success() && text.contains(expect) && took < Duration::from_secs(5), "{took:?} {text}");
    }
    assert!(!run.exists(), "nothing was started");
}

/// Finding 5: `--runtime-dir` followed a symlink planted under `daemon.log`
/// and overwrote a root-owned file; a world-writable directory was used.
#[test]
fn runtime_dir_is_checked_and_planted_symlinks_are_not_followed() {
    if !can_swap_up() {
        return;
    }
    let s = Scratch::new();
    let victim = s.path("victim");
    std::fs::write(&victim, "precious").unwrap();
    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).unwrap();

    let open = s.path("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let (out, text, _) = tmem(&["swap", "up", "--size", "64M", "--runtime-dir", open.to_str().unwrap()]);
    assert!(!out.status.success() && text.contains("lets group or others write"), "{text}");

    let run = s.path("run");
    std::fs::create_dir(&run).unwrap();
    std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::symlink(&victim, run.join("daemon.log")).unwrap();
    let run_s = run.to_str().unwrap();
    let (out, text, _) = tmem(&["swap", "up", "--size", "64M", "--pool-limit", "16M", "--runtime-dir", run_s]);
    let down = tmem(&["swap", "down", "--runtime-dir", run_s]);
    assert!(out.status.success(), "{text}");
    assert!(down.0.status.success(), "{}", down.1);
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious", "the symlink's target was not touched");
    assert!(!std::fs::symlink_metadata(run.join("daemon.log")).unwrap().file_type().is_symlink());
}

/// Finding 4: when `swap up` gave up waiting, the daemon went on and
/// activated swap a minute later. Now the command stops it, the daemon
/// undoes its setup, and nothing of it is left.
#[test]
fn swap_up_that_gives_up_leaves_nothing_behind() {
    if !can_swap_up() {
        return;
    }
    let s = Scratch::new();
    let run = s.path("run");
    let run_s = run.to_str().unwrap();
    let t = Instant::now();
    let out = Command::new(TMEM)
        .args(["swap", "up", "--size", "64M", "--wait", "2", "--runtime-dir", run_s])
        .env("TMEM_FAULT_STALL_SETUP_MS", "60000")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("did not come up within 2 s, so it was stopped and undid its setup"), "{text}");
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    assert!(text.contains("losetup --detach") && text.contains("FUSE unmounted"), "the log shows the rollback: {text}");
    let swaps = std::fs::read_to_string("/proc/swaps").unwrap();
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
    let loops = Command::new("losetup").arg("-a").output().unwrap();
    assert!(!swaps.contains(run_s) && !mounts.contains(run_s), "{swaps}{mounts}");
    assert!(!String::from_utf8_lossy(&loops.stdout).contains(run_s), "loop device left behind");
    // The directory is free for the next daemon.
    let (out, text, _) = tmem(&["stat", "--runtime-dir", run_s]);
    assert!(!out.status.success() && text.contains("no tmem daemon"), "{text}");
}

/// One run of the binary, measured by `wait4`.
struct Measured {
    status: std::process::ExitStatus,
    stderr: String,
    took: Duration,
    /// Peak resident set, bytes.
    max_rss: u64,
}

/// Runs `tmem ARGS` and measures its time and peak RSS; kills it after 20 s.
fn measured(args: &[&str]) -> Measured {
    use std::os::unix::process::ExitStatusExt;
    let dir = tempfile::tempdir().unwrap();
    let err = dir.path().join("stderr");
    let t = Instant::now();
    #[expect(clippy::zombie_processes, reason = "reaped below by wait4, for its rusage")]
    let child = Command::new(TMEM)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let pid = i32::try_from(child.id()).unwrap();
    let mut status = 0;
    // SAFETY: `rusage` is plain integers, for which all zeroes is valid.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: `pid` is our child, not yet waited for; `status` and `ru` are valid for writes.
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut ru) };
        if r == pid {
            break;
        }
        assert_eq!(r, 0, "wait4: {}", std::io::Error::last_os_error());
        if t.elapsed() > Duration::from_secs(20) {
            // SAFETY: as above; the child is killed, then reaped blocking.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::wait4(pid, &mut status, 0, &mut ru);
            }
            panic!("tmem {args:?} did not exit within 20 s");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let took = t.elapsed();
    Measured {
        status: std::process::ExitStatus::from_raw(status),
        stderr: std::fs::read_to_string(&err).unwrap(),
        took,
        max_rss: u64::try_from(ru.ru_maxrss).unwrap() * 1024,
    }
}

/// Asserts that `tmem ARGS` is refused: exit 1 (not a signal, not a
/// panic's 101), one line on stderr holding every one of `needles`, in
/// under 1 s and 50 MB of RSS.
fn assert_refused(args: &[&str], needles: &[&str]) {
    let m = measured(args);
    let what = format!("tmem {}: {:?}", args.join(" "), m.stderr);
    assert_eq!(m.status.code(), Some(1), "{what}: {} (a signal is an abort)", m.status);
    assert_eq!(m.stderr.lines().count(), 1, "{what}: one line");
    for n in needles {
        assert!(m.stderr.contains(n), "{what}: no {n:?}");
    }
    assert!(m.took < Duration::from_secs(1), "{what}: took {:?}", m.took);
    assert!(m.max_rss < 50 << 20, "{what}: peak RSS {} MiB", m.max_rss >> 20);
}

/// Findings: `--devices 4294967296` aborted on a 446 GB allocation (`swap
/// up` and `serve nbd`), `devices = 9223372036854775807` in the
/// configuration panicked, `--devices 10000000` peaked at 1.6 GB of RSS
/// before it was refused, and `--config` on a FIFO blocked in `open()`.
#[test]
fn counts_sizes_and_config_files_are_refused_at_once() {
    let s = Scratch::new();
    let run = s.path("run");
    let rd = run.to_str().unwrap();
    let config = s.path("tmem.toml");
    std::fs::write(&config, "[swap]\ndevices = 9223372036854775807\n").unwrap();
    let config = config.to_str().unwrap();
    let fifo = s.path("fifo.toml");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let fifo = fifo.to_str().unwrap();
    for (args, needles) in [
        (vec!["swap", "up", "--devices", "4294967296"], vec!["--devices 4294967296", "limit of 32"]),
        (vec!["serve", "nbd", "--devices", "4294967296"], vec!["--devices 4294967296", "limit of 256"]),
        (vec!["swap", "up", "--devices", "10000000"], vec!["--devices 10000000", "limit of 32"]),
        (vec!["serve", "nbd", "--devices", "10000000"], vec!["--devices 10000000", "limit of 256"]),
        (vec!["swap", "up", "--config", config], vec!["swap.devices: 9223372036854775807", "limit of 32"]),
        (vec!["swap", "up", "--config", fifo], vec![fifo, "a FIFO", "not a regular file of at most 1 MiB"]),
        (vec!["swap", "up", "--fuse-threads", "4294967296"], vec!["--fuse-threads 4294967296", "limit of"]),
        (vec!["swap", "up", "--fuse-uring", "4294967296"], vec!["--fuse-uring 4294967296", "limit of"]),
        (vec!["swap", "up", "--wait", "18446744073709551615"], vec!["--wait 18446744073709551615", "limit of 86400"]),
        (vec!["swap", "up", "--replicas", "1000"], vec!["--replicas 1000", "limit of 8"]),
        (vec!["swap", "up", "--pool-limit", "99999T"], vec!["--pool-limit 97.7 PiB", "above the limit of"]),
        (vec!["serve", "nbd", "--size", "99999T"], vec!["device size 97.7 PiB in all", "above the limit of"]),
        (vec!["serve", "nbd", "--pool-limit", "99999T"], vec!["--pool-limit 97.7 PiB", "above the limit of"]),
    ] {
        let mut args = args;
        args.extend(["--runtime-dir", rd]);
        assert_refused(&args, &needles);
        assert!(!run.exists(), "{args:?}: nothing was started");
    }
}

/// Finding: a `.tcorp` zstd stream with no recorded size was refused only
/// after 320 MiB, at 335 MB of RSS, from an 11 KB file.
#[test]
fn corpus_streams_stop_at_the_file_and_the_claim() {
    let s = Scratch::new();
    let streamed: u64 = 320 << 20;
    for (claim, needle) in [(1u64 << 40, "a zstd stream of this file's size can hold"), (streamed / 4096 + 1, "")] {
        let meta = tmem_corpus::CorpusMeta {
            program: "x".into(),
            source: "x".into(),
            captured_unix: 0,
            kernel: "x".into(),
            pages: claim,
        };
        let json = serde_json::to_vec(&meta).unwrap();
        let mut z = zstd::stream::write::Encoder::new(Vec::new(), 1).unwrap();
        let mut header = tmem_corpus::MAGIC.to_vec();
        for field in [&1u32.to_le_bytes()[..], &4096u32.to_le_bytes(), &claim.to_le_bytes()] {
            header.extend_from_slice(field);
        }
        header.extend_from_slice(&u32::try_from(json.len()).unwrap().to_le_bytes());
        header.extend_from_slice(&json);
        std::io::Write::write_all(&mut z, &header).unwrap();
        std::io::copy(&mut std::io::Read::take(std::io::repeat(0), streamed), &mut z).unwrap();
        let bytes = z.finish().unwrap();
        assert!(bytes.len() < 16 << 10, "{} bytes", bytes.len());
        let file = s.path("bomb.tcorp");
        std::fs::write(&file, &bytes).unwrap();
        assert_refused(&["corpus", "info", file.to_str().unwrap()], &["invalid corpus file", needle]);
    }
}

/// Finding: 16 control clients that each sent a byte every 4 s (under the
/// 5 s timeout, which was per read) kept `stat`, `set` and `swap down`
/// answering "busy" indefinitely.
#[test]
fn dripping_control_clients_cannot_keep_the_owner_out() {
    use std::io::Write;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let Some((_scratch, run)) = serving(&["--size", "64M"]) else { return };
    let rd = run.to_str().unwrap().to_owned();
    let stop = Arc::new(AtomicBool::new(false));
    // Each client sends a byte a second, never a whole request, and
    // connects again when it is cut off.
    let drips: Vec<_> = (0..16)
        .map(|_| {
            let (sock, stop) = (run.join(tmem_ctl::SOCKET), Arc::clone(&stop));
            std::thread::spawn(move || {
                while !stop.load(Ordering::Acquire) {
                    let Ok(mut c) = UnixStream::connect(&sock) else { return };
                    while !stop.load(Ordering::Acquire) && c.write_all(b"{").is_ok() {
                        std::thread::sleep(Duration::from_millis(1000));
                    }
                }
            })
        })
        .collect();
    /// Stops the dripping clients even when an assertion fails.
    struct Stop(Arc<AtomicBool>, Vec<std::thread::JoinHandle<()>>);
    impl Drop for Stop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
            for t in self.1.drain(..) {
                let _ = t.join();
            }
        }
    }
    let stop = Stop(stop, drips);
    std::thread::sleep(Duration::from_millis(500));
    // Before and after the 5 s deadline of the first clients.
    for round in 0..2 {
        let (out, text, took) = tmem(&["stat", "--json", "--runtime-dir", &rd]);
        assert!(out.status.success() && took < Duration::from_secs(3), "round {round}: stat took {took:?}: {text}");
        let (out, text, took) = tmem(&["set", "--runtime-dir", &rd, "disk0", "pool-limit=2%"]);
        assert!(out.status.success() && took < Duration::from_secs(3), "round {round}: set took {took:?}: {text}");
        std::thread::sleep(Duration::from_secs(6));
    }
    let (out, text, took) = tmem(&["swap", "down", "--runtime-dir", &rd]);
    assert!(out.status.success() && took < Duration::from_secs(10), "down took {took:?}: {text}");
    drop(stop);
}

/// Finding: of three concurrent `tmem swap restart`s, the two refused ones
/// said the old pid "goes on serving" after it had handed over and exited.
#[test]
fn concurrent_restarts_say_who_serves() {
    let Some((s, run)) = serving(&["--size", "64M"]) else { return };
    let rd = run.to_str().unwrap().to_owned();
    /// Stops whichever daemon serves the directory at the end.
    struct Down(String);
    impl Drop for Down {
        fn drop(&mut self) {
            let _ = Command::new(TMEM).args(["swap", "down", "--runtime-dir", &self.0]).output();
        }
    }
    let _down = Down(rd.clone());
    let old = s.servers[0].id();
    let restarts: Vec<_> = (0..3)
        .map(|_| {
            let rd = rd.clone();
            std::thread::spawn(move || tmem(&["swap", "restart", "--runtime-dir", &rd]))
        })
        .collect();
    let outputs: Vec<(bool, String)> =
        restarts.into_iter().map(|t| t.join().unwrap()).map(|(o, text, _)| (o.status.success(), text)).collect();
    let serving: tmem_ctl::Status =
        serde_json::from_value(tmem_ctl::call_ok(&run, &tmem_ctl::Request::Status, Duration::from_secs(10)).unwrap())
            .unwrap();
    assert_ne!(serving.pid, old, "{outputs:?}");
    assert!(outputs.iter().any(|(ok, _)| *ok), "one restart took over: {outputs:?}");
    for (ok, text) in &outputs {
        assert!(!text.contains(&format!("daemon pid {old} goes on serving")), "pid {old} has exited: {text}");
        if !ok {
            assert!(text.contains("another restart took over: daemon pid"), "{text}");
        }
    }
}

/// A free loopback port for `--metrics` (bound, then let go).
fn free_port() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

/// Opens a connection to `addr` that pipelines GETs and never reads a reply.
fn unread_pipeline(addr: std::net::SocketAddr) -> std::net::TcpStream {
    use std::io::Write;
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut s = loop {
        match std::net::TcpStream::connect(addr) {
            Ok(s) => break s,
            Err(e) => assert!(Instant::now() < deadline, "metrics at {addr}: {e}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    s.set_nonblocking(true).unwrap();
    let gets = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n".repeat(2000);
    let _ = s.write(&gets);
    std::thread::sleep(Duration::from_millis(300));
    s
}

/// One scrape on a fresh connection: its answer and how long it took.
fn scrape(addr: std::net::SocketAddr) -> (String, Duration) {
    use std::io::{Read, Write};
    let t = Instant::now();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut r = String::new();
    let _ = s.read_to_string(&mut r);
    (r, t.elapsed())
}

/// Finding: a metrics client that pipelined GETs and never read the
/// replies made every later scrape hang, kept `serve nbd` from ending on
/// SIGTERM for over 60 s, and kept `swap down` from unmounting for 62 s.
#[test]
fn an_unread_metrics_pipeline_delays_no_scrape_and_no_shutdown() {
    let addr = free_port();
    let Some((mut s, _)) = serving(&["--size", "64M", "--metrics", &addr.to_string()]) else { return };
    let stalled = unread_pipeline(addr);
    let (answer, took) = scrape(addr);
    assert!(answer.starts_with("HTTP/1.1 200") && took < Duration::from_secs(1), "{took:?}: {answer:.100}");
    let server = s.servers.last_mut().unwrap();
    let t = Instant::now();
    rustix::process::kill_process(rustix::process::Pid::from_child(server), rustix::process::Signal::TERM).unwrap();
    let status = tmem_testkit::wait_timeout(server, Duration::from_secs(30));
    assert!(status.is_some() && t.elapsed() < Duration::from_secs(2), "SIGTERM took {:?}", t.elapsed());
    eprintln!("serve nbd: scrape beside an unread pipeline {took:?}, SIGTERM to exit {:?}", t.elapsed());
    drop(stalled);

    if !can_swap_up() {
        return;
    }
    let run = s.path("swap-run");
    let rd = run.to_str().unwrap();
    let addr = free_port();
    let (out, text, _) = tmem(&["swap", "up", "--size", "64M", "--metrics", &addr.to_string(), "--runtime-dir", rd]);
    /// Takes swap down even when an assertion fails.
    struct Down<'a>(&'a str);
    impl Drop for Down<'_> {
        fn drop(&mut self) {
            let _ = Command::new(TMEM).args(["swap", "down", "--runtime-dir", self.0]).output();
        }
    }
    let _down = Down(rd);
    assert!(out.status.success(), "{text}");
    let stalled = unread_pipeline(addr);
    let (answer, took) = scrape(addr);
    assert!(answer.starts_with("HTTP/1.1 200") && took < Duration::from_secs(1), "{took:?}: {answer:.100}");
    let (out, text, took) = tmem(&["swap", "down", "--runtime-dir", rd]);
    assert!(out.status.success() && took < Duration::from_secs(5), "swap down took {took:?}: {text}");
    eprintln!("swap up: swap down beside an unread pipeline {took:?}");
    drop(stalled);
    // Only what a later `swap up` needs stays (README): the lock, and the
    // log for whoever asks what happened. No socket (`handover.sock` was
    // left behind), no state file, no mount point.
    let mut left: Vec<String> =
        std::fs::read_dir(&run).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    left.sort();
    assert_eq!(left, ["daemon.lock", "daemon.log"], "left in {rd}");
}
