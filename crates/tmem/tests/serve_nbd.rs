//! `tmem serve nbd` end to end with real NBD clients (qemu-io, nbdinfo).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tmem_testkit::{have_tool, is_root, skip, Feature};

const TMEM: &str = env!("CARGO_BIN_EXE_tmem");

/// Whether the `tools` are installed and the daemon can run (root, for
/// mlockall); reports the skip naming what is missing when not.
fn can_serve(tools: &[&str]) -> bool {
    for tool in tools {
        if !have_tool(tool) {
            skip(Feature::Tools, &format!("{tool} is not installed (apt-get install qemu-utils libnbd-bin)"));
            return false;
        }
    }
    if !is_root() {
        skip(Feature::Root, "the daemon calls mlockall, which needs root here");
        return false;
    }
    true
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
    if !can_serve(&["qemu-io", "nbdinfo"]) {
        return;
    }
    let dir = std::env::temp_dir().join(format!("tmem-serve-nbd-{}", std::process::id()));
    let rd = dir.to_str().unwrap().to_owned();
    let metrics = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let child = Command::new(TMEM)
        .args(["serve", "nbd", "--size", "256M", "--devices", "2", "--runtime-dir", &rd, "--metrics", &metrics])
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
    // The counters table and the JSON come from one definition: every
    // counter is a line of the table, with the value the JSON has.
    let table = Command::new(TMEM).args(["stat", "--counters", "--runtime-dir", &rd]).output().unwrap();
    let table = String::from_utf8_lossy(&table.stdout);
    let line = |group: &str, name: &str| {
        table.lines().find(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.first() == Some(&"disk1") && l.contains(&format!(" {group} ")) && f.contains(&name)
        })
    };
    let total = v[1]["store"]["total"].as_object().unwrap();
    let counted = total.keys().filter(|k| !matches!(k.as_str(), "pool_id" | "kind")).count();
    assert_eq!(counted, <tmem_core::PoolStats as tmem_counters::Counters>::DEFS.len(), "{total:?}");
    for (name, value) in total {
        let l = line("pools", name).unwrap_or_else(|| panic!("no line for {name}:\n{table}"));
        let want = value.to_string();
        assert!(l.split_whitespace().any(|w| w == want), "{name}={value}: {l}");
    }
    assert!(line("device", "write_ios").is_some() && line("allocator", "span_bytes").is_some(), "{table}");
    // Prometheus metrics: the same counters, over HTTP; promtool accepts
    // them, and counters rise between two scrapes while pages move.
    let scrape = || {
        let mut http = std::net::TcpStream::connect(&metrics).unwrap();
        std::io::Write::write_all(&mut http, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
        let mut r = String::new();
        std::io::Read::read_to_string(&mut http, &mut r).unwrap();
        r.split_once("\r\n\r\n").map(|(_, body)| body.to_owned()).unwrap_or_default()
    };
    let sample = |text: &str, name: &str| -> u64 {
        let prefix = format!("{name}{{device=\"disk1\"}} ");
        let line =
            text.lines().find_map(|l| l.strip_prefix(&prefix)).unwrap_or_else(|| panic!("no {prefix}in\n{text}"));
        line.trim().parse().unwrap()
    };
    let first = scrape();
    let stored = v[1]["store"]["total"]["stored_pages"].as_u64().unwrap();
    assert_eq!(sample(&first, "tmem_pool_stored_pages"), stored, "{first}");
    if tmem_testkit::have_tool("promtool") {
        let mut check = Command::new("promtool")
            .args(["check", "metrics"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        std::io::Write::write_all(&mut check.stdin.take().unwrap(), first.as_bytes()).unwrap();
        let out = check.wait_with_output().unwrap();
        let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && said.trim().is_empty(), "promtool: {said}");
    } else {
        tmem_testkit::skip(tmem_testkit::Feature::Tools, "promtool not installed");
    }
    let more =
        Command::new("qemu-io").args(["-f", "raw", "-c", "write -P 0x3c 4M 1M"]).arg(uri("disk1")).output().unwrap();
    assert!(more.status.success(), "{}", String::from_utf8_lossy(&more.stderr));
    let second = scrape();
    for name in ["tmem_device_write_ios_total", "tmem_device_write_bytes_total", "tmem_pool_succ_puts_total"] {
        assert!(sample(&second, name) > sample(&first, name), "{name} did not rise");
    }
    // SIGTERM: orderly stop, socket removed.
    // SAFETY: signalling our own child by pid.
    unsafe { libc::kill(libc::pid_t::try_from(server.0.id()).unwrap(), libc::SIGTERM) };
    let status = server.0.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert!(!sock.exists(), "socket removed on exit");
    let _ = std::fs::remove_dir_all(&dir);
}

/// An injected panic on one page's read fails that request alone (EIO to
/// the client); the daemon serves every other page, and counts it.
#[test]
fn a_panic_fails_one_nbd_request_and_the_server_goes_on() {
    if !can_serve(&["qemu-io"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let rd = dir.path().join("run");
    let child = Command::new(TMEM)
        .args(["serve", "nbd", "--size", "64M", "--runtime-dir", rd.to_str().unwrap()])
        .env("TMEM_FAULT_PANIC_READ_PAGE", "3")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let _server = Server(child);
    let sock = rd.join("nbd.sock");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !sock.exists() {
        assert!(Instant::now() < deadline, "no NBD socket after 20 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    let io = |cmds: &[&str]| {
        let mut c = Command::new("qemu-io");
        c.args(["-f", "raw"]);
        for cmd in cmds {
            c.args(["-c", cmd]);
        }
        let out = c.arg(&uri).output().unwrap();
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
    };
    let w = io(&["write -P 0x5a 0 64k"]);
    assert!(w.contains("wrote 65536/65536"), "{w}");
    let bad = io(&["read -P 0x5a 12288 4k"]);
    assert!(bad.contains("Input/output error") && !bad.contains("read 4096/4096"), "{bad}");
    let good = io(&["read -P 0x5a 0 12k", "read -P 0x5a 16k 48k"]);
    assert!(good.contains("read 12288/12288") && good.contains("read 49152/49152"), "{good}");
    assert!(!good.contains("Pattern verification failed"), "{good}");
    let stat = Command::new(TMEM).args(["stat", "--json", "--runtime-dir", rd.to_str().unwrap()]).output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&stat.stdout).unwrap();
    assert_eq!(v[0]["panics"], 1, "{}", v[0]);
    assert_eq!(v[0]["failed_reads"], 1, "{}", v[0]);
}

/// `tmem swap restart` of an NBD server (issue 12): a qemu-io client
/// connected before the restart writes a pattern, the server is replaced by
/// a new process, and the same connection reads the pattern back.
#[test]
fn an_nbd_client_survives_a_restart() {
    use std::io::{BufRead, Write};
    if !can_serve(&["qemu-io"]) {
        return;
    }
    let dir = std::env::temp_dir().join(format!("tmem-nbd-restart-{}", std::process::id()));
    let rd = dir.to_str().unwrap().to_owned();
    let child = Command::new(TMEM)
        .args(["serve", "nbd", "--size", "64M", "--runtime-dir", &rd])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _first = Server(child);
    /// Stops whichever daemon serves the directory at the end.
    struct Down(String);
    impl Drop for Down {
        fn drop(&mut self) {
            let _ = Command::new(TMEM).args(["swap", "down", "--runtime-dir", &self.0]).output();
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _down = Down(rd.clone());
    let sock = dir.join("nbd.sock");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !sock.exists() {
        assert!(Instant::now() < deadline, "no NBD socket after 20 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    let uri = format!("nbd+unix:///disk0?socket={}", sock.display());
    let mut io = Command::new("qemu-io")
        .args(["-f", "raw", &uri])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = io.stdin.take().unwrap();
    let mut out = std::io::BufReader::new(io.stdout.take().unwrap());
    let mut until = |what: &str| -> String {
        let mut seen = String::new();
        let mut line = String::new();
        while !seen.contains(what) {
            line.clear();
            assert!(out.read_line(&mut line).unwrap() > 0, "qemu-io ended before {what:?}: {seen}");
            seen.push_str(&line);
        }
        seen
    };
    writeln!(stdin, "write -P 0x6b 4096 128k").unwrap();
    until("wrote 131072/131072");
    let (ok, text) = {
        let o = Command::new(TMEM).args(["swap", "restart", "--runtime-dir", &rd]).output().unwrap();
        (o.status.success(), format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
    };
    assert!(ok && text.contains("took over"), "{text}");
    writeln!(stdin, "read -P 0x6b 4096 128k").unwrap();
    let seen = until("read 131072/131072");
    assert!(!seen.contains("Pattern verification failed"), "{seen}");
    writeln!(stdin, "quit").unwrap();
    drop(stdin);
    assert!(io.wait().unwrap().success());
    // A new client reaches the new server through the same socket.
    let check = Command::new("qemu-io").args(["-f", "raw", "-c", "read -P 0x6b 4096 128k", &uri]).output().unwrap();
    let text = String::from_utf8_lossy(&check.stdout);
    assert!(check.status.success() && !text.contains("Pattern verification failed"), "{text}");
}
