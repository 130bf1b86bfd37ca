//! The server against real NBD clients from Debian packages: qemu-io and
//! qemu-img (qemu-utils), nbdinfo and nbdcopy (libnbd-bin). A test whose
//! client is missing prints `SKIP:` and passes, unless `TMEM_REQUIRE`
//! requires tools (see `tmem_testkit::skip`).

mod common;

use std::fs;
use std::io::{Seek, SeekFrom, Write};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use common::{disk, pool_device, qemu_io, run_ok, spawn, start_unix, Rng, TempDir, CHILD_TIMEOUT};
use tmem_block::BlockDevice;
use tmem_nbd::{Export, Listen, NbdConfig, ServerHandle};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn pattern(i: u64) -> u8 {
    u8::try_from(i % 250 + 1).unwrap()
}

/// (1) A few hundred scattered writes of mixed sizes and alignments over a
/// 4 GiB sparse device, read back with pattern checks, the gaps around
/// them checked for zeros, and the device itself checked in-process.
#[test]
fn qemu_io_random_writes_on_4g_sparse_device() {
    require!("qemu-io");
    let dir = TempDir::new("random");
    let dev = pool_device("big", 4 * GIB);
    let server = start_unix(&dir, disk(Arc::clone(&dev)));
    let uri = server.uri("");

    let mut rng = Rng::new(0x5eed_1234);
    let n = 300u64;
    let slot = 4 * GIB / n;
    let lens = [512u64, 4096, 65536, 131_072 + 7, 1_048_576];
    let mut writes = Vec::new();
    for i in 0..n {
        let len = if i % 4 == 3 { 1 + rng.below(20_000) } else { lens[usize::try_from(i % 5).unwrap()] };
        let mut off = i * slot + 4096 + rng.below(slot - len - 8192);
        if i % 3 == 0 {
            off &= !4095; // page-aligned; the others are unaligned
        }
        writes.push((off, len, pattern(i)));
    }
    // The last bytes of the device, unaligned.
    writes.push((4 * GIB - 777, 777, 0xee));

    let mut cmds: Vec<String> = writes.iter().map(|(o, l, p)| format!("write -P {p:#x} {o} {l}")).collect();
    qemu_io(&uri, &cmds);

    cmds = writes.iter().map(|(o, l, p)| format!("read -P {p:#x} {o} {l}")).collect();
    for &(o, l, _) in &writes {
        // Zeros just before and after each write (within its slot).
        cmds.push(format!("read -P 0 {} 4096", o - 4096));
        if o + l + 4096 <= 4 * GIB {
            cmds.push(format!("read -P 0 {} 4096", o + l));
        }
    }
    let out = qemu_io(&uri, &cmds);
    assert_eq!(out.matches("read ").count(), cmds.len(), "every read ran");

    // The device holds exactly what was written.
    for &(o, l, p) in writes.iter().step_by(7) {
        let mut buf = vec![0u8; usize::try_from(l).unwrap()];
        dev.read_at(&mut buf, o).unwrap();
        assert!(buf.iter().all(|&b| b == p), "device content at {o}+{l}");
    }
    let st = dev.stats();
    let touched: u64 = writes.iter().map(|w| w.1 / 4096 + 2).sum();
    assert!(st.store.total.stored_pages <= touched, "sparse: {} pages stored", st.store.total.stored_pages);

    let stats = server.stats();
    let e = &stats.exports[0];
    assert!(e.writes >= u64::try_from(writes.len()).unwrap(), "{e:?}");
    assert_eq!(e.bytes_written, writes.iter().map(|w| w.1).sum::<u64>());
    assert_eq!(e.errors, 0);
    server.stop().unwrap();
    assert!(!dir.join("nbd.sock").exists(), "socket removed on stop");
}

/// A raw image of `size` bytes with data islands and holes.
fn make_image(path: &std::path::Path, size: u64, seed: u64) -> Vec<u8> {
    let mut rng = Rng::new(seed);
    let mut f = fs::File::create(path).unwrap();
    f.set_len(size).unwrap();
    let mut islands: Vec<(u64, Vec<u8>)> = Vec::new();
    let mut random = vec![0u8; 65536];
    rng.fill(&mut random);
    islands.push((0, random));
    let mut odd = vec![0u8; 10_000];
    rng.fill(&mut odd);
    islands.push((MIB + 123, odd));
    let text: Vec<u8> = b"tmem compresses text like this well. ".iter().copied().cycle().take(1 << 20).collect();
    islands.push((3 * MIB, text));
    islands.push((size - 4096, vec![0x5a; 4096]));
    for (off, data) in &islands {
        f.seek(SeekFrom::Start(*off)).unwrap();
        f.write_all(data).unwrap();
    }
    f.sync_all().unwrap();
    fs::read(path).unwrap()
}

/// (2) qemu-img convert: file -> NBD -> file, byte for byte.
#[test]
fn qemu_img_convert_round_trip() {
    require!("qemu-img");
    let dir = TempDir::new("convert");
    let size = 8 * MIB;
    let src = dir.join("src.img");
    let original = make_image(&src, size, 42);
    let dev = pool_device("conv", size);
    let server = start_unix(&dir, disk(Arc::clone(&dev)));
    let uri = server.uri("disk");

    run_ok(Command::new("qemu-img").args(["convert", "-n", "-f", "raw", "-O", "raw"]).arg(&src).arg(&uri));
    let out = dir.join("out.img");
    run_ok(Command::new("qemu-img").args(["convert", "-f", "raw", "-O", "raw", &uri]).arg(&out));
    assert!(fs::read(&out).unwrap() == original, "round trip differs");
    run_ok(Command::new("qemu-img").args(["compare", "-f", "raw", "-F", "raw"]).arg(&src).arg(&uri));

    let mut all = vec![0u8; usize::try_from(size).unwrap()];
    dev.read_at(&mut all, 0).unwrap();
    assert!(all == original, "device content differs");
    assert_eq!(server.stats().exports[0].errors, 0);
}

/// One line of `nbdinfo --map`: offset, length, type (3 = hole,zero).
fn map(uri: &str) -> Vec<(u64, u64, u32)> {
    let out = run_ok(Command::new("nbdinfo").args(["--map", uri]));
    let mut v: Vec<(u64, u64, u32)> = Vec::new();
    for line in out.lines().filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (off, len, ty) = (f[0].parse().unwrap(), f[1].parse().unwrap(), f[2].parse().unwrap());
        match v.last_mut() {
            Some(last) if last.2 == ty && last.0 + last.1 == off => last.1 += len,
            _ => v.push((off, len, ty)),
        }
    }
    v
}

/// (3) `nbdinfo --map` (base:allocation) shows data where written and
/// holes after TRIM (`discard`) and after write-zeroes that may unmap;
/// write-zeroes with NO_HOLE keeps the range allocated.
#[test]
fn nbdinfo_map_shows_holes_after_trim() {
    require!("qemu-io", "nbdinfo");
    let dir = TempDir::new("map");
    let size = 64 * MIB;
    let dev = pool_device("map", size);
    let server = start_unix(&dir, disk(Arc::clone(&dev)));
    let uri = server.uri("");

    assert_eq!(map(&uri), vec![(0, size, 3)], "a fresh device is one hole");
    qemu_io(&uri, &["write -P 0x11 0 8M".into()]);
    assert_eq!(map(&uri), vec![(0, 8 * MIB, 0), (8 * MIB, 56 * MIB, 3)]);

    qemu_io(&uri, &["discard 2M 4M".into(), "read -P 0 2M 4M".into(), "read -P 0x11 0 2M".into()]);
    assert_eq!(map(&uri), vec![(0, 2 * MIB, 0), (2 * MIB, 4 * MIB, 3), (6 * MIB, 2 * MIB, 0), (8 * MIB, 56 * MIB, 3)]);

    // write -z: NBD_CMD_WRITE_ZEROES with NO_HOLE (stays allocated);
    // write -z -u: may unmap (becomes a hole).
    qemu_io(&uri, &["write -z 40M 1M".into(), "write -z -u 6M 1M".into(), "read -P 0 6M 1M".into()]);
    assert_eq!(
        map(&uri),
        vec![
            (0, 2 * MIB, 0),
            (2 * MIB, 5 * MIB, 3),
            (7 * MIB, MIB, 0),
            (8 * MIB, 32 * MIB, 3),
            (40 * MIB, MIB, 0),
            (41 * MIB, 23 * MIB, 3)
        ]
    );
    qemu_io(&uri, &["read -P 0 40M 1M".into()]);
    let e = &server.stats().exports[0];
    assert!(e.trims >= 1 && e.write_zeroes >= 2 && e.block_status >= 4, "{e:?}");
    assert_eq!(e.errors, 0);
}

/// (4) Multi-conn: advertised, used by nbdcopy with 4 connections, and
/// several qemu-io processes writing at once.
#[test]
fn nbdcopy_multi_conn_round_trip() {
    require!("nbdinfo", "nbdcopy");
    let dir = TempDir::new("nbdcopy");
    let size = 16 * MIB;
    let src = dir.join("src.img");
    let original = make_image(&src, size, 7);
    let dev = pool_device("copy", size);
    let server = start_unix(&dir, disk(Arc::clone(&dev)));
    let uri = server.uri("");

    let can = spawn(Command::new("nbdinfo").args(["--can", "multi-conn", &uri])).wait(CHILD_TIMEOUT);
    assert!(can.status.success(), "nbdinfo --can multi-conn says no");

    let before = server.stats().exports[0].connections;
    run_ok(Command::new("nbdcopy").args(["--connections=4", "--threads=4", "--requests=8"]).arg(&src).arg(&uri));
    let used = server.stats().exports[0].connections - before;
    assert!(used >= 4, "nbdcopy used {used} connections");

    let out = dir.join("out.img");
    run_ok(Command::new("nbdcopy").args(["--connections=4", "--threads=4", &uri]).arg(&out));
    assert!(fs::read(&out).unwrap() == original, "nbdcopy round trip differs");
    assert_eq!(server.stats().exports[0].errors, 0);
}

#[test]
fn concurrent_qemu_io_processes() {
    require!("qemu-io");
    let dir = TempDir::new("concurrent");
    let dev = pool_device("conc", 256 * MIB);
    let server = start_unix(&dir, disk(Arc::clone(&dev)));
    let uri = server.uri("");
    let procs = 6u64;
    let region = 256 * MIB / procs;
    let block = 256 * 1024;
    let cmds_for = |p: u64, verb: &str| -> Vec<String> {
        (0..32u64)
            .map(|k| format!("{verb} -P {:#x} {} {block}", pattern(p * 32 + k), p * region + k * 2 * block))
            .collect()
    };
    let running: Vec<_> = (0..procs)
        .map(|p| {
            let mut c = Command::new("qemu-io");
            c.args(["-f", "raw", &uri]);
            for cmd in cmds_for(p, "write").into_iter().chain(cmds_for(p, "read")) {
                c.arg("-c").arg(cmd);
            }
            spawn(&mut c)
        })
        .collect();
    for r in running {
        let out = r.wait_ok();
        assert!(!out.contains("verification failed"), "{out}");
    }
    // Everything verified again from a single connection.
    let all: Vec<String> = (0..procs).flat_map(|p| cmds_for(p, "read")).collect();
    qemu_io(&uri, &all);
    let stats = server.stats();
    assert!(stats.exports[0].connections > procs, "{:?}", stats.exports[0]);
    common::eventually("sessions to end", || server.stats().connections_active == 0);
}

/// `nbdinfo --list` shows every export with its description and size.
#[test]
fn nbdinfo_list_shows_exports() {
    require!("nbdinfo");
    let dir = TempDir::new("list");
    let a = pool_device("a", 16 * MIB);
    let b = pool_device("b", 32 * MIB);
    let exports = vec![
        Export::new("alpha", a as Arc<dyn BlockDevice>).with_description("first device"),
        Export::new("beta", b as Arc<dyn BlockDevice>).with_description("second device"),
    ];
    let server = start_unix(&dir, exports);
    let out = run_ok(Command::new("nbdinfo").args(["--list", &server.uri("")]));
    for needle in ["export=\"alpha\"", "first device", "export=\"beta\"", "second device", "33554432"] {
        assert!(out.contains(needle), "{needle:?} missing from:\n{out}");
    }
    // The default export (empty name) is the first one.
    let out = run_ok(Command::new("nbdinfo").args(["--size", &server.uri("")]));
    assert_eq!(out.trim(), (16 * MIB).to_string());
    let out = run_ok(Command::new("nbdinfo").args(["--size", &server.uri("beta")]));
    assert_eq!(out.trim(), (32 * MIB).to_string());
    let missing = spawn(Command::new("nbdinfo").args(["--size", &server.uri("nope")])).wait(CHILD_TIMEOUT);
    assert!(!missing.status.success(), "unknown export must fail");
}

/// TCP on 127.0.0.1 with an ephemeral port.
#[test]
fn tcp_loopback_qemu_io() {
    require!("qemu-io");
    let dev = pool_device("tcp", 64 * MIB);
    let cfg = NbdConfig::new(disk(Arc::clone(&dev)), Listen::Tcp("127.0.0.1:0".parse().unwrap()));
    let server = ServerHandle::start(cfg).unwrap();
    let Listen::Tcp(addr) = server.local_addr().clone() else { panic!("tcp") };
    assert_ne!(addr.port(), 0);
    let uri = server.uri("disk");
    assert_eq!(uri, format!("nbd://127.0.0.1:{}/disk", addr.port()));
    qemu_io(&uri, &["write -P 0x42 1234 100000".into(), "read -P 0x42 1234 100000".into(), "read -P 0 0 1234".into()]);
    let mut buf = vec![0u8; 100_000];
    dev.read_at(&mut buf, 1234).unwrap();
    assert!(buf.iter().all(|&b| b == 0x42));
    let json = serde_json::to_string(&server.stats()).unwrap();
    assert!(json.contains("\"bytes_written\":100000"), "{json}");
    server.stop().unwrap();
    // The port is closed after stop.
    std::thread::sleep(Duration::from_millis(50));
    assert!(std::net::TcpStream::connect(addr).is_err(), "still listening after stop");
}

/// A client past `max_connections` is told why and exits at once, rather
/// than hanging or seeing a bare end of stream.
#[test]
fn qemu_io_reports_the_connection_limit() {
    require!("qemu-io");
    let dir = TempDir::new("limit");
    let mut cfg = NbdConfig::new(disk(pool_device("disk", MIB)), Listen::Unix(dir.join("nbd.sock")));
    cfg.max_connections = 1;
    let server = ServerHandle::start(cfg).unwrap();
    let _idle = std::os::unix::net::UnixStream::connect(dir.join("nbd.sock")).unwrap();
    common::eventually("the idle connection to be accepted", || server.stats().connections_active == 1);
    let t = std::time::Instant::now();
    let out = spawn(Command::new("qemu-io").args(["-f", "raw", "-c", "read 0 512", &server.uri("disk")]))
        .wait(Duration::from_secs(30));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "qemu-io must fail: {text}");
    assert!(text.contains("tmem: connection limit (1) reached"), "{text}");
    assert!(t.elapsed() < Duration::from_secs(5), "qemu-io took {:?}", t.elapsed());
    assert_eq!(server.stats().refused_connection_limit, 1);
}
