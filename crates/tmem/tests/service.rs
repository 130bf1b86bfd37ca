//! tmem as a service: the systemd unit (checked by systemd-analyze), the
//! configuration file (flags override it; a bad one starts nothing), and the
//! sd_notify protocol of `swap up --foreground` (READY once swap is on,
//! watchdog pings, STOPPING) spoken to a real notify socket.

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const TMEM: &str = env!("CARGO_BIN_EXE_tmem");

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn root() -> bool {
    rustix::process::geteuid().is_root()
}

fn have(tool: &str) -> bool {
    Command::new("sh").arg("-c").arg(format!("command -v {tool}")).output().is_ok_and(|o| o.status.success())
}

fn tmem(args: &[&str]) -> (bool, String) {
    let out = Command::new(TMEM).args(args).output().expect("run tmem");
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn the_unit_file_verifies_and_says_what_a_swap_daemon_needs() {
    let unit = std::fs::read_to_string(repo().join("packaging/tmem.service")).unwrap();
    for line in [
        "Type=notify",
        "OOMScoreAdjust=-1000",
        "LimitMEMLOCK=infinity",
        "ExecStop=/usr/bin/tmem swap down --unless-restarting",
        "ExecReload=/usr/bin/tmem swap restart",
        "NotifyAccess=all",
        "SendSIGKILL=no",
        "LimitCORE=0",
        "Before=swap.target shutdown.target",
        "WatchdogSec=",
        "ExecStart=/usr/bin/tmem swap up --foreground --take-over-running --config /etc/tmem/tmem.toml",
    ] {
        assert!(unit.contains(line), "the unit lacks {line:?}");
    }
    if !have("systemd-analyze") {
        return tmem_testkit::skip(
            tmem_testkit::Feature::Tools,
            "systemd-analyze is not installed (apt-get install systemd)",
        );
    }
    // verify checks that ExecStart's program exists: point it at this build.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tmem.service");
    std::fs::write(&path, unit.replace("/usr/bin/tmem", TMEM)).unwrap();
    let out = Command::new("systemd-analyze").arg("verify").arg(&path).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && stderr.trim().is_empty(), "systemd-analyze verify: {stderr}");
    // And it does catch mistakes.
    std::fs::write(&path, unit.replace("/usr/bin/tmem", TMEM).replace("Type=notify", "Type=notifyy")).unwrap();
    let out = Command::new("systemd-analyze").arg("verify").arg(&path).output().unwrap();
    assert!(!String::from_utf8_lossy(&out.stderr).trim().is_empty(), "a bad unit draws a complaint");
}

#[test]
fn a_bad_config_file_gets_one_line_naming_file_line_and_key() {
    if !root() {
        return tmem_testkit::skip(tmem_testkit::Feature::Root, "swap up needs root");
    }
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("tmem.toml");
    std::fs::write(&cfg, "[swap]\nsize = \"64M\"\npool-limit = \"0%\"\n").unwrap();
    let run = dir.path().join("run");
    let (ok, text) = tmem(&["swap", "up", "--config", cfg.to_str().unwrap(), "--runtime-dir", run.to_str().unwrap()]);
    assert!(!ok, "{text}");
    assert_eq!(text.trim().lines().count(), 1, "{text}");
    assert!(text.contains(&format!("{}:3:14: swap.pool-limit", cfg.display())), "{text}");
    assert!(!run.exists(), "nothing started");
}

/// Receives sd_notify datagrams until one holds `want`, or the deadline.
fn wait_for(sock: &UnixDatagram, want: &str, within: Duration) -> String {
    let deadline = Instant::now() + within;
    let mut all = String::new();
    let mut buf = [0u8; 4096];
    while Instant::now() < deadline {
        if let Ok(n) = sock.recv(&mut buf) {
            all.push_str(&String::from_utf8_lossy(&buf[..n]));
            all.push('\n');
            if all.contains(want) {
                return all;
            }
        }
    }
    panic!("no {want:?} within {within:?}; got:\n{all}");
}

/// Stops the foreground daemon (by its pid) if a test fails half way.
struct Foreground(Child, String);

impl Drop for Foreground {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = Command::new(TMEM).args(["swap", "down", "--runtime-dir", &self.1]).output();
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// A scratch directory with a notify socket bound in it where `swap up` can
/// run (root, FUSE, losetup); None, after saying why, where it cannot.
fn notify_socket() -> Option<(tempfile::TempDir, PathBuf, UnixDatagram)> {
    if !root() {
        tmem_testkit::skip(tmem_testkit::Feature::Root, "swap up needs root");
        return None;
    }
    if !Path::new("/dev/fuse").exists() {
        tmem_testkit::skip(tmem_testkit::Feature::Fuse, "/dev/fuse is missing");
        return None;
    }
    if !have("losetup") {
        tmem_testkit::skip(tmem_testkit::Feature::Tools, "losetup is not installed");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let notify = dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&notify).unwrap();
    sock.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    Some((dir, notify, sock))
}

#[test]
fn foreground_swap_up_speaks_sd_notify_and_takes_the_config() {
    let Some((dir, notify, sock)) = notify_socket() else { return };
    let cfg = dir.path().join("tmem.toml");
    // The file sets the codec and the pool limit; the command line's --size wins over the file's.
    std::fs::write(&cfg, "[swap]\nsize = \"1G\"\ncodec = \"zstd:1\"\npool-limit = \"16M\"\n").unwrap();
    let run = dir.path().join("run").to_str().unwrap().to_owned();
    let child = Command::new(TMEM)
        .args(["swap", "up", "--foreground", "--size", "64M", "--config", cfg.to_str().unwrap()])
        .args(["--runtime-dir", &run])
        .env("NOTIFY_SOCKET", &notify)
        .env("WATCHDOG_USEC", "1000000")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut fg = Foreground(child, run.clone());
    let got = wait_for(&sock, "READY=1", Duration::from_secs(60));
    assert!(got.contains("STATUS=serving 1 device(s)"), "{got}");
    let swaps = std::fs::read_to_string("/proc/swaps").unwrap();
    assert!(swaps.lines().any(|l| l.starts_with("/dev/loop")), "swap is on when READY is sent: {swaps}");
    wait_for(&sock, "WATCHDOG=1", Duration::from_secs(5));
    let (ok, stat) = tmem(&["stat", "--json", "--runtime-dir", &run]);
    assert!(ok, "{stat}");
    let v: serde_json::Value = serde_json::from_str(&stat).unwrap();
    assert_eq!(v[0]["disksize"], 64 << 20, "the flag wins over the file");
    assert_eq!(v[0]["store"]["codec"], "zstd-1", "the file's codec");
    assert_eq!(v[0]["store"]["pool_limit_bytes"], 16 << 20, "the file's pool limit");
    let (ok, down) = tmem(&["swap", "down", "--runtime-dir", &run]);
    assert!(ok, "{down}");
    wait_for(&sock, "STOPPING=1", Duration::from_secs(5));
    let status = fg.0.wait().unwrap();
    assert!(status.success(), "{status:?}");
}

/// Runs `tmem swap down` on drop: whichever process serves the directory
/// by then (a test that hands over leaves daemons that are no child of its).
struct DownOnDrop(String);

impl Drop for DownOnDrop {
    fn drop(&mut self) {
        let _ = Command::new(TMEM).args(["swap", "down", "--runtime-dir", &self.0]).output();
    }
}

/// The pid in the last `MAINPID=` line of `got`.
fn main_pid(got: &str) -> u32 {
    let line = got.lines().rev().find_map(|l| l.strip_prefix("MAINPID=")).expect("a MAINPID= line");
    line.parse().unwrap()
}

#[test]
fn a_supervised_daemon_hands_over_and_names_each_new_main_pid() {
    let Some((dir, notify, sock)) = notify_socket() else { return };
    let run = dir.path().join("run").to_str().unwrap().to_owned();
    let up = |extra: &[&str]| {
        Command::new(TMEM)
            .args(["swap", "up", "--foreground", "--size", "64M", "--pool-limit", "16M", "--front", "none"])
            .args(["--runtime-dir", &run])
            .args(extra)
            .env("NOTIFY_SOCKET", &notify)
            .env("WATCHDOG_USEC", "1000000")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let _down = DownOnDrop(run.clone());
    let mut first = Foreground(up(&["--take-over-running"]), run.clone());
    wait_for(&sock, "READY=1", Duration::from_secs(60));
    let first_pid = first.0.id();

    // As ExecReload runs it: no notify socket of its own, no watchdog.
    let out = Command::new(TMEM).args(["swap", "restart", "--runtime-dir", &run]).env_remove("NOTIFY_SOCKET").output();
    let out = out.unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let got = wait_for(&sock, "MAINPID=", Duration::from_secs(10));
    let reloaded = main_pid(&got);
    assert!(got.contains("READY=1"), "{got}");
    assert_ne!(reloaded, first_pid);
    assert!(first.0.wait().unwrap().success(), "the old main process exits 0 once it has handed over");
    // From here on only the new process can ping: it took the watchdog over.
    while sock.recv(&mut [0u8; 4096]).is_ok() {}
    wait_for(&sock, "WATCHDOG=1", Duration::from_secs(5));
    let (ok, stat) = tmem(&["stat", "--json", "--runtime-dir", &run]);
    assert!(ok, "{stat}");

    // As a restart's start runs it: it takes the running daemon over in its own process.
    let mut started = Foreground(up(&["--take-over-running"]), run.clone());
    let got = wait_for(&sock, "MAINPID=", Duration::from_secs(30));
    assert_eq!(main_pid(&got), started.0.id(), "{got}");
    assert!(tmem_daemon::handover::wait_for_exit(reloaded, Duration::from_secs(20)), "the reloaded daemon exited");
    let swaps = std::fs::read_to_string("/proc/swaps").unwrap();
    assert!(swaps.lines().any(|l| l.starts_with("/dev/loop")), "swap stayed on: {swaps}");

    // Not under systemd, --unless-restarting is a plain swap down.
    let (ok, down) = tmem(&["swap", "down", "--unless-restarting", "--runtime-dir", &run]);
    assert!(ok, "{down}");
    wait_for(&sock, "STOPPING=1", Duration::from_secs(5));
    assert!(started.0.wait().unwrap().success());
}
