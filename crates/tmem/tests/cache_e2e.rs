//! The cache device end to end (root): `tmem cache up` under a real ext4,
//! write-through to the backing file, a daemon killed mid-writes, the same
//! cache over NBD with qemu-io, and a cache beside swap in one budget.
//! Loop devices, mounts and daemons are removed on drop, whatever happened.

// Test code: pids and page counts fit; 64-bit targets.
#![allow(clippy::cast_possible_truncation)]

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tmem_testkit::{have_tool, is_root, skip, Feature};

const TMEM: &str = env!("CARGO_BIN_EXE_tmem");

fn can_run(tools: &[&str]) -> bool {
    if !is_root() {
        skip(Feature::Root, "needs root");
        return false;
    }
    for (p, feature) in [("/dev/fuse", Feature::Fuse), ("/dev/loop-control", Feature::Loop)] {
        if !Path::new(p).exists() {
            skip(feature, &format!("{p} is missing"));
            return false;
        }
    }
    for tool in tools {
        if !have_tool(tool) {
            skip(Feature::Tools, &format!("{tool} is not installed"));
            return false;
        }
    }
    true
}

fn run(program: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new(program).args(args).output().unwrap_or_else(|e| panic!("{program}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

fn tmem(args: &[&str]) -> (bool, String) {
    run(TMEM, args)
}

/// A runtime directory, a backing file and a mount point; on drop: unmount,
/// `tmem cache down`, remove the files.
struct Setup {
    dir: PathBuf,
    backing: PathBuf,
    mnt: PathBuf,
    up: bool,
}

impl Setup {
    fn new(tag: &str, size: u64) -> Self {
        let dir = PathBuf::from(format!("/run/tmem-test-cache-{tag}-{}", std::process::id()));
        let scratch = std::env::temp_dir().join(format!("tmem-cache-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&scratch).unwrap();
        let backing = scratch.join("backing.img");
        std::fs::File::create(&backing).unwrap().set_len(size).unwrap();
        let mnt = scratch.join("mnt");
        std::fs::create_dir_all(&mnt).unwrap();
        Setup { dir, backing, mnt, up: false }
    }

    fn rd(&self) -> &str {
        self.dir.to_str().unwrap()
    }

    /// `tmem cache up` with `extra` flags; returns the loop device.
    fn up(&mut self, extra: &[&str]) -> String {
        let mut args = vec!["cache", "up", "--backing", self.backing.to_str().unwrap(), "--runtime-dir", self.rd()];
        args.extend_from_slice(extra);
        let (ok, out) = tmem(&args);
        self.up = ok;
        assert!(ok, "tmem cache up failed:\n{out}");
        loop_of(&out)
    }

    fn down(&mut self) -> String {
        let (ok, out) = tmem(&["cache", "down", "--runtime-dir", self.rd()]);
        assert!(ok, "tmem cache down failed:\n{out}");
        self.up = false;
        out
    }

    fn stat(&self) -> serde_json::Value {
        let (ok, out) = tmem(&["stat", "--json", "--runtime-dir", self.rd()]);
        assert!(ok, "{out}");
        serde_json::from_str(&out).unwrap()
    }

    fn mount(&self, dev: &str, opts: &str) {
        let (ok, out) = run("mount", &["-o", opts, dev, self.mnt.to_str().unwrap()]);
        assert!(ok, "mount {dev}: {out}");
    }

    fn umount(&self) {
        let (ok, out) = run("umount", &[self.mnt.to_str().unwrap()]);
        assert!(ok, "umount: {out}");
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
        if mounts.contains(self.mnt.to_str().unwrap()) {
            let _ = run("umount", &["-l", self.mnt.to_str().unwrap()]);
        }
        if self.up {
            let _ = tmem(&["cache", "down", "--runtime-dir", self.rd()]);
        }
        let _ = std::fs::remove_dir_all(self.backing.parent().unwrap());
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The loop device named in `tmem cache up`'s output.
fn loop_of(out: &str) -> String {
    let at = out.find("-> /dev/loop").unwrap_or_else(|| panic!("no loop device in:\n{out}"));
    out[at + 3..].split_whitespace().next().unwrap().to_owned()
}

/// Checksums of every file under `dir`, by relative path.
fn checksums(dir: &Path) -> Vec<(String, u64)> {
    let (ok, out) = run("sh", &["-c", &format!("cd {} && find . -type f | sort | xargs cksum", dir.display())]);
    assert!(ok, "{out}");
    out.lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[2].to_owned(), f[0].parse().unwrap())
        })
        .collect()
}

#[test]
fn a_filesystem_on_the_cache_is_written_through_and_read_from_the_pool() {
    if !can_run(&["losetup", "mkfs.ext4", "mount", "cksum"]) {
        return;
    }
    let mut s = Setup::new("fs", 128 << 20);
    let dev = s.up(&["--pool-limit", "64M"]);
    assert!(run("mkfs.ext4", &["-q", &dev]).0, "mkfs.ext4 {dev}");
    s.mount(&dev, "rw");
    // Compressible text (the sources) and 4 MiB of incompressible bytes.
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    for copy in ["src1", "src2", "src3"] {
        let (ok, out) = run("cp", &["-r", src.to_str().unwrap(), s.mnt.join(copy).to_str().unwrap()]);
        assert!(ok, "{out}");
    }
    // The built-in corpora are zstd frames: incompressible like the random file.
    let (ok, out) = run("find", &[s.mnt.to_str().unwrap(), "-name", "*.tcorp", "-delete"]);
    assert!(ok, "{out}");
    let (ok, out) =
        run("dd", &["if=/dev/urandom", &format!("of={}", s.mnt.join("random").display()), "bs=1M", "count=4"]);
    assert!(ok, "{out}");
    let written = checksums(&s.mnt);
    s.umount();
    // A fresh mount has an empty page cache: every read reaches the device.
    s.mount(&dev, "ro");
    assert_eq!(checksums(&s.mnt), written);
    let before = s.stat()[0].clone();
    s.umount();
    s.mount(&dev, "ro");
    assert_eq!(checksums(&s.mnt), written);
    let after = s.stat()[0].clone();
    s.umount();
    let backing_reads = |v: &serde_json::Value| v["backing"]["backing_read_bytes"].as_u64().unwrap();
    let hits = |v: &serde_json::Value| v["store"]["total"]["succ_gets"].as_u64().unwrap();
    let second_read = after["read_bytes"].as_u64().unwrap() - before["read_bytes"].as_u64().unwrap();
    let from_backing = backing_reads(&after) - backing_reads(&before);
    println!(
        "second pass: {second_read} bytes read, {from_backing} from the backing store, {} pool hits",
        hits(&after) - hits(&before)
    );
    assert!(second_read > 8 << 20, "{second_read}");
    // Random pages are refused by the pool and read again; text is served from it.
    assert!(from_backing < second_read / 2, "{from_backing} of {second_read} bytes came from the backing store");
    assert!(hits(&after) - hits(&before) > 1000);
    let down = s.down();
    assert!(down.contains("losetup --detach"), "{down}");
    // Everything is in the backing file itself.
    s.mount(s.backing.to_str().unwrap(), "ro,loop");
    assert_eq!(checksums(&s.mnt), written, "the backing file holds every write");
    s.umount();
}

/// Writes 4 KiB records `i` at offset `i * 4096` of the device, O_DIRECT and
/// O_DSYNC, printing each index once its write returned; stops at the first error.
const WRITER: &str = r#"
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_DIRECT | os.O_DSYNC)
buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT needs
for i in range(int(sys.argv[2])):
    buf.seek(0)
    buf.write(((b"record %08d " % i) * 200).ljust(4096, b"."))
    try:
        os.pwritev(fd, [buf], i * 4096)
    except OSError as e:
        print("error", e, flush=True)
        break
    print(i, flush=True)
"#;

fn record(i: u64) -> Vec<u8> {
    let mut r = format!("record {i:08} ").repeat(200).into_bytes();
    r.resize(4096, b'.');
    r
}

#[test]
fn a_killed_cache_daemon_loses_no_acknowledged_write() {
    if !can_run(&["losetup", "python3"]) {
        return;
    }
    let mut s = Setup::new("kill", 64 << 20);
    let dev = s.up(&["--pool-limit", "8M"]);
    let status = std::fs::read_to_string(s.dir.join("state.json")).unwrap();
    let pid: i32 = serde_json::from_str::<serde_json::Value>(&status).unwrap()["pid"].as_i64().unwrap() as i32;
    let mut writer = Command::new("python3")
        .args(["-c", WRITER, &dev, "16000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while s.stat()[0]["write_ios"].as_u64().unwrap() < 1000 {
        assert!(Instant::now() < deadline, "the writer never got going");
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: kill(2) on the daemon our `cache up` started, by its pid.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let status = tmem_testkit::wait_timeout(&mut writer, Duration::from_secs(60)).unwrap_or_else(|| {
        let _ = writer.kill();
        writer.wait().unwrap()
    });
    let mut out = String::new();
    std::io::Read::read_to_string(&mut writer.stdout.take().unwrap(), &mut out).unwrap();
    let acked = out.lines().filter_map(|l| l.parse::<u64>().ok()).max().map_or(0, |m| m + 1);
    println!("writer: {status:?}, {acked} records acknowledged before the daemon died");
    assert!((900..16000).contains(&acked), "{acked} records acknowledged; the kill came too late or too early");
    // One command cleans up what the dead daemon left.
    let (ok, text) = tmem(&["cache", "down", "--runtime-dir", s.rd()]);
    assert!(ok && text.contains("losetup --detach"), "{text}");
    s.up = false;
    // The backing file holds every acknowledged write.
    let file = std::fs::File::open(&s.backing).unwrap();
    let mut page = vec![0u8; 4096];
    for i in 0..acked {
        file.read_exact_at(&mut page, i * 4096).unwrap();
        assert!(page == record(i), "acknowledged record {i} is not in the backing file");
    }
    // A new cache serves what the backing store holds: nothing stale.
    let dev = s.up(&[]);
    let mut through = std::fs::File::open(&dev).unwrap();
    let mut all = vec![0u8; (acked as usize + 64) * 4096];
    std::io::Read::read_exact(&mut through, &mut all).unwrap();
    let mut expect = vec![0u8; all.len()];
    file.read_exact_at(&mut expect, 0).unwrap();
    assert!(all == expect, "the restarted cache differs from its backing file");
    drop(through);
    s.down();
}

#[test]
fn serve_nbd_backing_exports_the_cache_to_qemu_io() {
    if !can_run(&["qemu-io", "nbdinfo"]) {
        return;
    }
    let s = Setup::new("nbd", 32 << 20);
    let sock = s.backing.parent().unwrap().join("nbd.sock");
    let child = Command::new(TMEM)
        .args(["serve", "nbd", "--backing", s.backing.to_str().unwrap(), "--runtime-dir", s.rd()])
        .arg("--socket")
        .arg(&sock)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    struct Server(std::process::Child);
    impl Drop for Server {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut server = Server(child);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !sock.exists() {
        assert!(Instant::now() < deadline, "no NBD socket after 20 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    let uri = format!("nbd+unix:///cache0?socket={}", sock.display());
    let (ok, list) = run("nbdinfo", &["--list", &format!("nbd+unix:///?socket={}", sock.display())]);
    assert!(ok && list.contains("cache0") && !list.contains("disk0"), "{list}");
    let (ok, out) = run(
        "qemu-io",
        &["-f", "raw", "-c", "write -P 0x6b 1000 200k", "-c", "read -P 0x6b 1000 200k", "-c", "read -P 0 0 1000", &uri],
    );
    assert!(ok && !out.contains("Pattern verification failed"), "{out}");
    // A second client reads the pattern back (from the pool).
    let (ok, out) = run("qemu-io", &["-f", "raw", "-c", "read -P 0x6b 1000 200k", &uri]);
    assert!(ok && !out.contains("Pattern verification failed"), "{out}");
    // SAFETY: kill(2) on the server we spawned, by its pid.
    assert_eq!(unsafe { libc::kill(i32::try_from(server.0.id()).unwrap(), libc::SIGTERM) }, 0);
    tmem_testkit::wait_timeout(&mut server.0, Duration::from_secs(20)).expect("the server stops on SIGTERM");
    let mut data = vec![0u8; 200 << 10];
    std::fs::File::open(&s.backing).unwrap().read_exact_at(&mut data, 1000).unwrap();
    assert!(data.iter().all(|&b| b == 0x6b), "the backing file holds the write");
}

#[test]
fn a_cache_beside_swap_shares_its_budget() {
    if !can_run(&["losetup", "mkswap", "swapon"]) || !Path::new("/proc/swaps").exists() {
        return;
    }
    let mut s = Setup::new("swap", 16 << 20);
    // A second cache, read from nowhere, tells the two pools apart.
    let second = s.backing.with_file_name("second.img");
    std::fs::File::create(&second).unwrap().set_len(4 << 20).unwrap();
    let (ok, out) = tmem(&[
        "swap",
        "up",
        "--size",
        "64M",
        "--pool-limit",
        "32M",
        "--priority=-5",
        "--cache-backing",
        s.backing.to_str().unwrap(),
        "--cache-backing",
        second.to_str().unwrap(),
        "--runtime-dir",
        s.rd(),
    ]);
    s.up = ok;
    assert!(ok, "{out}");
    assert!(out.contains("cache0: cache of") && out.contains("shared with swap0"), "{out}");
    let dev = loop_of(&out[out.find("cache0: losetup").unwrap()..]);
    let mut buf = vec![0u8; 16 << 20];
    std::io::Read::read_exact(&mut std::fs::File::open(&dev).unwrap(), &mut buf).unwrap();
    let st = s.stat();
    assert_eq!(st[1]["name"], "cache0");
    let pools = st[1]["store"]["pools"].as_array().unwrap();
    assert_eq!(pools.len(), 3, "one store: the swap pool and the two cache pools: {pools:?}");
    assert_eq!(pools[1]["kind"], "ephemeral");
    assert_eq!(st[0]["store"]["pool_limit_bytes"], st[1]["store"]["pool_limit_bytes"]);
    // Each cache names its own pool, and `tmem stat` shows each one's hits.
    assert_eq!((st[1]["backing"]["pool"].as_u64(), st[2]["backing"]["pool"].as_u64()), (Some(1), Some(2)));
    let hits = pools[1]["succ_gets"].as_u64().unwrap();
    assert!(hits == 0 && pools[1]["failed_gets"].as_u64().unwrap() >= 4096, "cache0 read cold: {}", pools[1]);
    let (ok, table) = tmem(&["stat", "--runtime-dir", s.rd()]);
    let row = |name: &str| table.lines().find(|l| l.trim_start().starts_with(name) && l.contains(".img")).unwrap_or("");
    assert!(ok && row("cache0").split_whitespace().nth(3) == Some("4096"), "{table}");
    assert!(row("cache1").split_whitespace().nth(3) == Some("0"), "{table}");
    let (ok, out) = tmem(&["swap", "down", "--runtime-dir", s.rd()]);
    assert!(ok && out.contains("swapoff") && out.contains(&dev), "{out}");
    s.up = false;
}

#[test]
fn the_block_conformance_suite_passes_through_the_kernel_on_fuse_and_loop() {
    if !can_run(&[]) {
        return;
    }
    // A cache over a sparse file reads as zeros, like a fresh device: the
    // suite's oracle. The VM test runs the same suite on the NBD and ublk
    // transports (scripts/vm/transports.sh).
    let mut s = Setup::new("conformance", 16 << 20);
    let dev = s.up(&["--transport", "fuse"]);
    let node = tmem_block::NodeDevice::open(Path::new(&dev)).unwrap();
    tmem_block::conformance::check_data(&node);
    drop(node);
    s.down();
    let mut held = vec![0u8; 4096];
    let f = std::fs::File::open(&s.backing).unwrap();
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut held, 5 * 4096).unwrap();
    // The suite's fourth write (64 pages at page 5, trimmed from its 100th
    // byte on) reached the backing file.
    assert_eq!(held[..100], tmem_block::conformance::pattern(64 * 4096, 4)[..100]);
}
