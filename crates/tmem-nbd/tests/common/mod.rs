//! Helpers shared by the integration tests: temp dirs, servers, child
//! processes with timeouts, and a raw NBD client.
#![allow(dead_code)] // each test binary uses a different subset

use rand_xoshiro::rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tmem_block::{BlockDevice, DeviceConfig, PoolDevice};
use tmem_nbd::proto::*;
use tmem_nbd::{Export, Listen, NbdConfig, ServerHandle};

/// How long one client program may run.
pub const CHILD_TIMEOUT: Duration = Duration::from_secs(240);

/// A directory removed (with its contents) on drop.
pub struct TempDir(tempfile::TempDir);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        TempDir(tempfile::Builder::new().prefix(&format!("tmem-nbd-{tag}-")).tempdir().expect("create temp dir"))
    }
    pub fn path(&self) -> &Path {
        self.0.path()
    }
    pub fn join(&self, name: &str) -> PathBuf {
        self.0.path().join(name)
    }
}

/// A compressed in-memory device of `size` bytes that keeps incompressible
/// pages raw (the default store policy refuses them, as zswap does).
pub fn pool_device(name: &str, size: u64) -> Arc<PoolDevice> {
    let mut store = tmem_core::StoreConfig::default();
    store.policy.incompressible = tmem_core::Incompressible::StoreRaw;
    let cfg = DeviceConfig { name: name.into(), size, store, tiers: None, recompress: None };
    Arc::new(cfg.build().expect("build device"))
}

/// A device with the default store policy (incompressible pages refused).
pub fn strict_pool_device(name: &str, size: u64) -> Arc<PoolDevice> {
    let cfg = DeviceConfig {
        name: name.into(),
        size,
        store: tmem_core::StoreConfig::default(),
        tiers: None,
        recompress: None,
    };
    Arc::new(cfg.build().expect("build device"))
}

/// A server on `dir/nbd.sock` exporting `exports`.
pub fn start_unix(dir: &TempDir, exports: Vec<Export>) -> ServerHandle {
    ServerHandle::start(NbdConfig::new(exports, Listen::Unix(dir.join("nbd.sock")))).expect("start server")
}

/// One export named `disk` of `device`.
pub fn disk(device: Arc<PoolDevice>) -> Vec<Export> {
    vec![Export::new("disk", device as Arc<dyn BlockDevice>).with_description("test disk")]
}

/// Returns early from the test with `SKIP:` when a client program is missing
/// (a failure where `TMEM_REQUIRE` requires tools: see `tmem_testkit::skip`).
#[macro_export]
macro_rules! require {
    ($($bin:expr),+) => {
        for b in [$($bin),+] {
            if !tmem_testkit::have_tool(b) {
                tmem_testkit::skip(
                    tmem_testkit::Feature::Tools,
                    &format!("{b} is not installed (apt-get install qemu-utils libnbd-bin)"),
                );
                return;
            }
        }
    };
}

/// A child process, killed (and reaped) on drop unless waited for.
pub struct Running {
    child: Option<Child>,
    what: String,
    out: Option<std::thread::JoinHandle<Vec<u8>>>,
    err: Option<std::thread::JoinHandle<Vec<u8>>>,
}

fn drain(mut r: impl Read + Send + 'static) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = r.read_to_end(&mut v);
        v
    })
}

pub fn spawn(cmd: &mut Command) -> Running {
    let what = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {what}: {e}"));
    let out = child.stdout.take().map(drain);
    let err = child.stderr.take().map(drain);
    Running { child: Some(child), what, out, err }
}

impl Running {
    /// Waits up to `timeout`; kills the child and panics past it.
    pub fn wait(mut self, timeout: Duration) -> Output {
        let deadline = Instant::now() + timeout;
        let mut child = self.child.take().expect("child");
        let status = loop {
            if let Some(s) = child.try_wait().expect("try_wait") {
                break s;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{} timed out after {timeout:?}", self.what);
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let stdout = self.out.take().map(|h| h.join().unwrap_or_default()).unwrap_or_default();
        let stderr = self.err.take().map(|h| h.join().unwrap_or_default()).unwrap_or_default();
        Output { status, stdout, stderr }
    }

    /// Waits and asserts success; returns stdout.
    pub fn wait_ok(self) -> String {
        let what = self.what.clone();
        check_ok(&what, self.wait(CHILD_TIMEOUT))
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn check_ok(what: &str, out: Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{what} failed ({}):\nstdout: {}\nstderr: {stderr}", out.status, tail(&stdout));
    stdout
}

fn tail(s: &str) -> &str {
    let n = s.len().saturating_sub(4000);
    let mut i = n;
    while !s.is_char_boundary(i) {
        i += 1;
    }
    &s[i..]
}

/// Runs `cmd` to completion and asserts success; returns stdout.
pub fn run_ok(cmd: &mut Command) -> String {
    spawn(cmd).wait_ok()
}

/// Runs qemu-io on `uri` with the given `-c` commands; asserts that it
/// succeeded and that no pattern check or command failed.
pub fn qemu_io(uri: &str, cmds: &[String]) -> String {
    let mut c = Command::new("qemu-io");
    c.args(["-f", "raw", uri]);
    for cmd in cmds {
        c.arg("-c").arg(cmd);
    }
    let what = format!("{c:?}");
    let out = spawn(&mut c).wait(CHILD_TIMEOUT);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!text.contains("Pattern verification failed"), "qemu-io pattern mismatch:\n{}", tail(&text));
    assert!(!text.to_lowercase().contains("failed"), "qemu-io command failed:\n{}", tail(&text));
    check_ok(&what, out)
}

/// Deterministic pseudo-random numbers (seeded xoshiro256++).
pub struct Rng(Xoshiro256PlusPlus);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(Xoshiro256PlusPlus::seed_from_u64(seed))
    }
    pub fn next(&mut self) -> u64 {
        self.0.next_u64()
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    pub fn fill(&mut self, buf: &mut [u8]) {
        self.0.fill_bytes(buf);
    }
}

// ---- a raw NBD client, for what libnbd and qemu cannot be told to do ----

/// One option reply.
#[derive(Debug)]
pub struct OptReply {
    pub option: u32,
    pub kind: u32,
    pub data: Vec<u8>,
}

/// One structured reply chunk.
#[derive(Debug)]
pub struct Chunk {
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    pub payload: Vec<u8>,
}

pub struct Client<S: Read + Write> {
    pub s: S,
}

pub fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes(b[..2].try_into().unwrap())
}
pub fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().unwrap())
}
pub fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().unwrap())
}

impl Client<std::os::unix::net::UnixStream> {
    pub fn unix(path: &Path) -> Self {
        let s = std::os::unix::net::UnixStream::connect(path).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        Client { s }
    }
}

impl Client<std::net::TcpStream> {
    pub fn tcp(addr: std::net::SocketAddr) -> Self {
        let s = std::net::TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        Client { s }
    }
}

impl<S: Read + Write> Client<S> {
    pub fn read_n(&mut self, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        self.s.read_exact(&mut v).expect("read from server");
        v
    }

    /// Reads the greeting, checks it, returns the handshake flags.
    pub fn greeting(&mut self) -> u16 {
        let g = self.read_n(18);
        assert_eq!(be64(&g), NBDMAGIC);
        assert_eq!(be64(&g[8..]), IHAVEOPT);
        be16(&g[16..])
    }

    pub fn send(&mut self, b: &[u8]) {
        self.s.write_all(b).expect("write to server");
    }

    /// Greeting plus client flags.
    pub fn start(&mut self, client_flags: u32) {
        let f = self.greeting();
        assert_eq!(f, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        self.send(&client_flags.to_be_bytes());
    }

    pub fn opt(&mut self, option: u32, data: &[u8]) {
        let mut b = IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&option.to_be_bytes());
        b.extend_from_slice(&u32::try_from(data.len()).unwrap().to_be_bytes());
        b.extend_from_slice(data);
        self.send(&b);
    }

    pub fn opt_reply(&mut self) -> OptReply {
        let h = self.read_n(20);
        assert_eq!(be64(&h), OPT_REPLY_MAGIC, "option reply magic");
        let len = usize::try_from(be32(&h[16..])).unwrap();
        OptReply { option: be32(&h[8..]), kind: be32(&h[12..]), data: self.read_n(len) }
    }

    /// Replies up to and including the final ACK or error.
    pub fn opt_replies(&mut self) -> Vec<OptReply> {
        let mut v = Vec::new();
        loop {
            let r = self.opt_reply();
            let last = r.kind == REP_ACK || r.kind & (1 << 31) != 0;
            v.push(r);
            if last {
                return v;
            }
        }
    }

    pub fn request(&mut self, command: u16, flags: u16, cookie: u64, offset: u64, len: u32, payload: &[u8]) {
        let mut b = encode_request(&Request { flags, command, cookie, offset, len }).to_vec();
        b.extend_from_slice(payload);
        self.send(&b);
    }

    /// A simple reply; `data_len` bytes follow it when it succeeded.
    pub fn simple(&mut self, data_len: usize) -> (u32, u64, Vec<u8>) {
        let h = self.read_n(16);
        assert_eq!(be32(&h), SIMPLE_REPLY_MAGIC, "simple reply magic");
        let err = be32(&h[4..]);
        let data = if err == 0 { self.read_n(data_len) } else { Vec::new() };
        (err, be64(&h[8..]), data)
    }

    pub fn chunk(&mut self) -> Chunk {
        let h = self.read_n(20);
        assert_eq!(be32(&h), STRUCTURED_REPLY_MAGIC, "structured reply magic");
        let len = usize::try_from(be32(&h[16..])).unwrap();
        Chunk { flags: be16(&h[4..]), kind: be16(&h[6..]), cookie: be64(&h[8..]), payload: self.read_n(len) }
    }

    /// The server must have closed the connection.
    pub fn expect_eof(&mut self) {
        let mut b = [0u8; 1];
        match self.s.read(&mut b) {
            Ok(0) => {}
            Ok(_) => panic!("expected EOF, got data"),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            Err(e) => panic!("expected EOF, got {e}"),
        }
    }
}

/// NBD_OPT_GO on `name`; returns (size, transmission flags).
pub fn go<S: Read + Write>(c: &mut Client<S>, name: &str) -> (u64, u16) {
    c.opt(OPT_GO, &info_data(name, &[]));
    let replies = c.opt_replies();
    let last = replies.last().unwrap();
    assert_eq!(last.kind, REP_ACK, "{replies:?}");
    let export = replies
        .iter()
        .find(|r| r.kind == REP_INFO && be16(&r.data) == INFO_EXPORT)
        .expect("NBD_INFO_EXPORT before ACK");
    assert_eq!(export.data.len(), 12);
    (be64(&export.data[2..]), be16(&export.data[10..]))
}

/// Data of NBD_OPT_INFO / NBD_OPT_GO.
pub fn info_data(name: &str, requests: &[u16]) -> Vec<u8> {
    let mut v = prefixed(name.as_bytes(), &[]);
    v.extend_from_slice(&u16::try_from(requests.len()).unwrap().to_be_bytes());
    for r in requests {
        v.extend_from_slice(&r.to_be_bytes());
    }
    v
}

/// Data of the meta context options.
pub fn meta_data(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut v = prefixed(name.as_bytes(), &[]);
    v.extend_from_slice(&u32::try_from(queries.len()).unwrap().to_be_bytes());
    for q in queries {
        v.extend_from_slice(&prefixed(q.as_bytes(), &[]));
    }
    v
}

/// Waits until `f` holds (polling), up to 10 s.
pub fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}
