//! `tmem serve nbd` end to end with real NBD clients (qemu-io, nbdinfo).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const TMEM: &str = env!("CARGO_BIN_EXE_tmem");

fn have(tool: &str) -> bool {
    Command::new("sh").arg("-c").arg(format!("command -v {tool}")).output().is_ok_and(|o| o.status.success())
}

/// Stops the server (by its pid) even when an assertion fails.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn serve_nbd_exports_devices_to_real_clients() {
    for tool in ["qemu-io", "nbdinfo"] {
        if !have(tool) {
            println!("SKIP: {tool} is not installed (apt-get install qemu-utils libnbd-bin)");
            return;
        }
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("SKIP: the daemon calls mlockall, which needs root here");
        return;
    }
    let dir = std::env::temp_dir().join(format!("tmem-serve-nbd-{}", std::process::id()));
    let rd = dir.to_str().unwrap().to_owned();
    let child = Command::new(TMEM)
        .args(["serve", "nbd", "--size", "256M", "--devices", "2", "--runtime-dir", &rd])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut server = Server(child);
    let sock = dir.join("nbd.sock");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !sock.exists() {
        assert!(Instant::now() < deadline, "no NBD socket after 20 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    let uri = |e: &str| format!("nbd+unix:///{e}?socket={}", sock.display());
    let list = Command::new("nbdinfo").arg("--list").arg(uri("")).output().unwrap();
    let list = String::from_utf8_lossy(&list.stdout);
    assert!(list.contains("disk0") && list.contains("disk1"), "{list}");
    let io = Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0x6b 1000 200k", "-c", "read -P 0x6b 1000 200k", "-c", "read -P 0 0 1000"])
        .arg(uri("disk1"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&io.stdout);
    assert!(io.status.success() && !text.contains("Pattern verification failed"), "{text}");
    let stat = Command::new(TMEM).args(["stat", "--json", "--runtime-dir", &rd]).output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&stat.stdout).unwrap();
    assert_eq!(v[0]["name"], "disk0");
    assert_eq!(v[0]["write_ios"], 0);
    assert!(v[1]["store"]["total"]["stored_pages"].as_u64().unwrap() >= 50, "{}", v[1]);
    // SIGTERM: orderly stop, socket removed.
    // SAFETY: signalling our own child by pid.
    unsafe { libc::kill(libc::pid_t::try_from(server.0.id()).unwrap(), libc::SIGTERM) };
    let status = server.0.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert!(!sock.exists(), "socket removed on exit");
    let _ = std::fs::remove_dir_all(&dir);
}
