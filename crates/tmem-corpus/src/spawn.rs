//! Spawning representative programs, letting them build a heap, and
//! capturing them with [`capture_pid`].

use std::fs;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::{Duration, Instant};

use crate::capture::capture_pid;
use crate::{proc_path, Corpus, CorpusError, SplitMix64};

mod cgen;

/// Python heap builder, written to a temp file and run with `python3`.
const PYTHON_SCRIPT: &str = include_str!("programs/heap.py");
/// Java heap builder, compiled with `javac` into a temp dir.
const JAVA_SOURCE: &str = include_str!("programs/CorpusHeap.java");

/// Keep at most this much of a child's stdout/stderr for error messages.
const OUTPUT_TAIL: usize = 16 * 1024;

/// A representative program to spawn and capture.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum SpawnKind {
    /// python3 running a script that builds a mixed heap of parsed JSON
    /// records, dicts, strings, lists, numbers, a word index and objects.
    Python,
    /// A Java program (compiled with javac) holding HashMaps/ArrayLists of
    /// objects with strings, boxed numbers and byte arrays.
    Java,
    /// gcc's `cc1`, captured mid-compile of a large generated C file at -O2.
    Cc,
    /// redis-server filled over RESP with sessions, hashes, lists, sorted
    /// sets, sets and counters.
    Redis,
}

impl SpawnKind {
    /// The corpus `program` name: `"python"`, `"java"`, `"cc"` or `"redis"`.
    pub fn name(self) -> &'static str {
        match self {
            SpawnKind::Python => "python",
            SpawnKind::Java => "java",
            SpawnKind::Cc => "cc",
            SpawnKind::Redis => "redis",
        }
    }

    /// All kinds, in built-in corpus order.
    pub const ALL: [SpawnKind; 4] = [SpawnKind::Python, SpawnKind::Java, SpawnKind::Cc, SpawnKind::Redis];
}

impl std::fmt::Display for SpawnKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Spawns a representative program, waits until it has built a heap
/// somewhat larger than `max_bytes` (1.25×), captures up to `max_bytes` of
/// it with [`capture_pid`], then kills the program (its whole process group,
/// which it leads) and removes its temporary files.
///
/// The corpus has `program` set to [`SpawnKind::name`]. Fails with
/// [`CorpusError::ProgramNotFound`] if the program is not installed.
pub fn spawn_and_capture(kind: SpawnKind, max_bytes: u64) -> Result<Corpus, CorpusError> {
    if max_bytes < 4096 {
        return Err(CorpusError::InvalidArgument(format!(
            "max_bytes must be at least one page (4096), got {max_bytes}"
        )));
    }
    let mut corpus = match kind {
        SpawnKind::Python => spawn_python(max_bytes),
        SpawnKind::Java => spawn_java(max_bytes),
        SpawnKind::Cc => spawn_cc(max_bytes),
        SpawnKind::Redis => spawn_redis(max_bytes),
    }?;
    corpus.meta.program = kind.name().to_string();
    Ok(corpus)
}

/// The C source `--spawn cc` compiles when cc1 should reach `target_bytes`
/// of anonymous memory (deterministic; useful for calibration).
pub fn generated_c_source(target_bytes: u64) -> String {
    cgen::generate(cgen::units_for(target_bytes))
}

/// Anonymous memory the spawned program should build: 1.25 × max_bytes.
fn heap_target(max_bytes: u64) -> u64 {
    max_bytes.saturating_add(max_bytes / 4)
}

/// Generous time limit for building a heap of `target` bytes.
fn build_timeout(target: u64) -> Duration {
    Duration::from_secs(120 + target / (2 << 20)).min(Duration::from_secs(3600))
}

// ----- helpers -------------------------------------------------------------

/// Finds `program` in `$PATH`: the first executable file of that name.
pub fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|p| fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
}

fn require(program: &str, hint: &str) -> Result<PathBuf, CorpusError> {
    which(program).ok_or_else(|| CorpusError::ProgramNotFound { program: program.to_string(), hint: hint.to_string() })
}

/// `RssAnon` of a process in bytes (0 if unknown).
pub(crate) fn rss_anon(pid: i32) -> u64 {
    fs::read_to_string(proc_path(pid, "status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("RssAnon:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// A uniquely named private directory (`tempfile`), removed on drop.
struct TempDir(tempfile::TempDir);

impl TempDir {
    fn new(tag: &str) -> Result<TempDir, CorpusError> {
        tempfile::Builder::new()
            .prefix(&format!("tmem-corpus-{tag}-"))
            .tempdir()
            .map(TempDir)
            .map_err(|source| CorpusError::TempDir { path: std::env::temp_dir(), source })
    }

    fn path(&self) -> &Path {
        self.0.path()
    }

    fn write(&self, name: &str, contents: &[u8]) -> Result<PathBuf, CorpusError> {
        let path = self.path().join(name);
        fs::write(&path, contents).map_err(|source| CorpusError::TempDir { path: path.clone(), source })?;
        Ok(path)
    }
}

/// Appends to a bounded tail buffer.
fn push_tail(tail: &Mutex<Vec<u8>>, bytes: &[u8]) {
    let mut t = tail.lock();
    t.extend_from_slice(bytes);
    if t.len() > OUTPUT_TAIL {
        let cut = t.len() - OUTPUT_TAIL;
        t.drain(..cut);
    }
}

/// A spawned child in its own process group. Dropping it kills the whole
/// group (the child and anything it started) with SIGKILL and reaps the child.
struct Spawned {
    program: String,
    child: Child,
    pid: i32,
    reaped: bool,
    lines: Receiver<String>,
    output: Arc<Mutex<Vec<u8>>>,
}

impl Spawned {
    fn spawn(program: &str, cmd: &mut Command) -> Result<Spawned, CorpusError> {
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
        // SAFETY: the closure runs in the forked child before exec and only
        // calls prctl(2), which is async-signal-safe and touches no memory
        // of ours. PR_SET_PDEATHSIG makes the kernel SIGKILL the child if the
        // spawning thread dies without cleaning up (e.g. Ctrl-C); it is
        // preserved across the execve of a non-setuid program.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) == 0 {
                    Ok(())
                } else {
                    Err(io::Error::last_os_error())
                }
            });
        }
        let mut child = cmd.spawn().map_err(|source| CorpusError::Child {
            program: program.to_string(),
            action: "spawn".to_string(),
            source,
        })?;
        let pid = i32::try_from(child.id()).expect("pids fit in i32");
        let output = Arc::new(Mutex::new(Vec::new()));
        let (tx, lines) = mpsc::channel();
        if let Some(stdout) = child.stdout.take() {
            let output = Arc::clone(&output);
            std::thread::spawn(move || {
                let mut r = BufReader::new(stdout);
                let mut line = String::new();
                while r.read_line(&mut line).is_ok_and(|n| n > 0) {
                    push_tail(&output, line.as_bytes());
                    let _ = tx.send(line.trim_end().to_string());
                    line.clear();
                }
            });
        }
        if let Some(mut stderr) = child.stderr.take() {
            let output = Arc::clone(&output);
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n @ 1..) = stderr.read(&mut buf) {
                    push_tail(&output, &buf[..n]);
                }
            });
        }
        Ok(Spawned { program: program.to_string(), child, pid, reaped: false, lines, output })
    }

    /// Error describing an early exit (or other failure) of the child.
    fn failed(&mut self, what: &str) -> CorpusError {
        let status = match self.child.try_wait() {
            Ok(Some(s)) => {
                self.reaped = true;
                format!("{what}; exited with {s}")
            }
            _ => what.to_string(),
        };
        // Give the output readers a moment to collect the last words.
        std::thread::sleep(Duration::from_millis(100));
        let output = String::from_utf8_lossy(&self.output.lock()).into_owned();
        CorpusError::ChildFailed { program: self.program.clone(), status, output }
    }

    /// Waits for a stdout line starting with `prefix`.
    fn wait_for_line(&mut self, prefix: &str, timeout: Duration) -> Result<String, CorpusError> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left.min(Duration::from_millis(200))) {
                Ok(line) if line.starts_with(prefix) => return Ok(line),
                Ok(_) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    // stdout closed: the program exited (or closed stdout).
                    std::thread::sleep(Duration::from_millis(100));
                    return Err(self.failed(&format!("stdout closed before {prefix:?}")));
                }
                Err(RecvTimeoutError::Timeout) if left.is_zero() => {
                    return Err(CorpusError::Timeout {
                        what: format!("{} to print {prefix:?}", self.program),
                        secs: timeout.as_secs(),
                    })
                }
                Err(RecvTimeoutError::Timeout) => {}
            }
        }
    }

    /// Whether the child has exited (reaping it if so).
    fn exited(&mut self) -> bool {
        if !self.reaped && matches!(self.child.try_wait(), Ok(Some(_))) {
            self.reaped = true;
        }
        self.reaped
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        if !self.reaped && self.pid > 1 {
            // SAFETY: kill(2) has no memory-safety preconditions. `-pid`
            // names the process group the child leads (process_group(0));
            // the unreaped child keeps that id from being reused, so only
            // processes we started are signalled.
            unsafe { libc::kill(-self.pid, libc::SIGKILL) };
            let _ = self.child.wait();
        }
    }
}

// ----- python ----------------------------------------------------------------

fn spawn_python(max_bytes: u64) -> Result<Corpus, CorpusError> {
    let python = require("python3", "install python3 (apt-get install python3)")?;
    let dir = TempDir::new("python")?;
    let script = dir.write("heap.py", PYTHON_SCRIPT.as_bytes())?;
    let target = heap_target(max_bytes);
    let mut child =
        Spawned::spawn("python3", Command::new(python).arg(&script).arg(target.to_string()).current_dir(dir.path()))?;
    child.wait_for_line("ready", build_timeout(target))?;
    capture_pid(child.pid, max_bytes)
}

// ----- java --------------------------------------------------------------------

fn spawn_java(max_bytes: u64) -> Result<Corpus, CorpusError> {
    let hint = "install a JDK (apt-get install default-jdk-headless)";
    let java = require("java", hint)?;
    let javac = require("javac", hint)?;
    let dir = TempDir::new("java")?;
    let source = dir.write("CorpusHeap.java", JAVA_SOURCE.as_bytes())?;
    let out = Command::new(javac)
        .arg("-d")
        .arg(dir.path())
        .arg(&source)
        .stdin(Stdio::null())
        .output()
        .map_err(|source| CorpusError::Child { program: "javac".to_string(), action: "run".to_string(), source })?;
    if !out.status.success() {
        return Err(CorpusError::ChildFailed {
            program: "javac".to_string(),
            status: out.status.to_string(),
            output: String::from_utf8_lossy(&[out.stdout, out.stderr].concat()).into_owned(),
        });
    }
    let target = heap_target(max_bytes);
    // Room for the live heap plus garbage, so GC stays cheap.
    let xmx_mib = (target / (1 << 20)).saturating_mul(3).saturating_add(256);
    let mut child = Spawned::spawn(
        "java",
        Command::new(java)
            .arg(format!("-Xmx{xmx_mib}m"))
            .arg("-cp")
            .arg(dir.path())
            .arg("CorpusHeap")
            .arg(target.to_string())
            .current_dir(dir.path()),
    )?;
    child.wait_for_line("ready", build_timeout(target))?;
    capture_pid(child.pid, max_bytes)
}

// ----- cc (gcc's cc1) ----------------------------------------------------------

fn spawn_cc(max_bytes: u64) -> Result<Corpus, CorpusError> {
    let gcc = require("gcc", "install gcc (apt-get install gcc)")?;
    let dir = TempDir::new("cc")?;
    let target = heap_target(max_bytes);
    let source = dir.write("big.c", generated_c_source(target).as_bytes())?;
    let mut child = Spawned::spawn(
        "gcc",
        Command::new(gcc)
            .args(["-O2", "-w", "-c"])
            .arg(&source)
            .arg("-o")
            .arg(dir.path().join("big.o"))
            .current_dir(dir.path()),
    )?;
    let timeout = build_timeout(target);
    let deadline = Instant::now() + timeout;
    let mut cc1 = None;
    let mut peak = 0;
    let mut last_growth = Instant::now();
    loop {
        if child.exited() {
            return Err(child.failed(&format!(
                "gcc finished before cc1 reached {target} bytes of anonymous memory \
                 (peak seen {peak})"
            )));
        }
        if Instant::now() > deadline {
            return Err(CorpusError::Timeout {
                what: format!("cc1 to reach {target} bytes of anonymous memory"),
                secs: timeout.as_secs(),
            });
        }
        if cc1.is_none() {
            cc1 = find_child(child.pid, "cc1");
        }
        if let Some(pid) = cc1 {
            let rss = rss_anon(pid);
            if rss > peak + peak / 100 {
                last_growth = Instant::now();
            }
            peak = peak.max(rss);
            // GCC's memory use is not linear in the source size; if cc1
            // plateaus below the target but holds max_bytes, take it.
            let plateau = rss >= max_bytes && last_growth.elapsed() > Duration::from_secs(10);
            if rss >= target || plateau {
                return capture_pid(pid, max_bytes);
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A child of `parent` whose command name is `comm`.
fn find_child(parent: i32, comm: &str) -> Option<i32> {
    let matches = |pid: i32| fs::read_to_string(proc_path(pid, "comm")).is_ok_and(|c| c.trim_end() == comm);
    // Fast path: /proc/PID/task/TID/children (CONFIG_PROC_CHILDREN).
    if let Ok(dir) = fs::read_dir(proc_path(parent, "task")) {
        for task in dir.flatten() {
            if let Ok(children) = fs::read_to_string(task.path().join("children")) {
                let found = children.split_whitespace().filter_map(|p| p.parse().ok()).find(|&p| matches(p));
                if found.is_some() {
                    return found;
                }
            }
        }
    }
    // Fallback: scan /proc for a process whose ppid is `parent`.
    fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let stat = fs::read_to_string(proc_path(pid, "stat")).ok()?;
        let ppid: i32 = stat[stat.rfind(')')? + 1..].split_whitespace().nth(1)?.parse().ok()?;
        (ppid == parent && matches(pid)).then_some(pid)
    })
}

// ----- redis ---------------------------------------------------------------------

fn spawn_redis(max_bytes: u64) -> Result<Corpus, CorpusError> {
    let server = require("redis-server", "install redis (apt-get install redis-server)")?;
    let dir = TempDir::new("redis")?;
    let port = {
        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(|source| CorpusError::Child {
            program: "redis-server".to_string(),
            action: "finding a free loopback port".to_string(),
            source,
        })?;
        l.local_addr()
            .map_err(|source| CorpusError::Child {
                program: "redis-server".to_string(),
                action: "finding a free loopback port".to_string(),
                source,
            })?
            .port()
    };
    let mut child = Spawned::spawn(
        "redis-server",
        Command::new(server)
            .args(["--port", &port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .args(["--daemonize", "no"])
            .args(["--protected-mode", "yes"])
            .arg("--dir")
            .arg(dir.path())
            .current_dir(dir.path()),
    )?;
    let mut conn = connect_redis(&mut child, port)?;
    let target = heap_target(max_bytes);
    let deadline = Instant::now() + build_timeout(target);
    let mut filler = RedisFiller::new();
    while rss_anon(child.pid) < target {
        if child.exited() {
            return Err(child.failed("redis-server exited while being filled"));
        }
        if Instant::now() > deadline {
            return Err(CorpusError::Timeout {
                what: format!("redis-server to reach {target} bytes of anonymous memory"),
                secs: build_timeout(target).as_secs(),
            });
        }
        let (batch, count) = filler.batch(2000);
        conn.send_batch(&batch, count)?;
    }
    capture_pid(child.pid, max_bytes)
}

fn connect_redis(child: &mut Spawned, port: u16) -> Result<Resp, CorpusError> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if child.exited() {
            return Err(child.failed("redis-server exited during startup"));
        }
        match TcpStream::connect((Ipv4Addr::LOCALHOST, port)) {
            Ok(stream) => {
                let mut conn = Resp::new(stream)?;
                // PING until the server answers (it may still be loading).
                let mut ping = Vec::new();
                resp_command(&mut ping, &[b"PING"]);
                conn.send_batch(&ping, 1)?;
                return Ok(conn);
            }
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Err(source) => {
                return Err(CorpusError::Child {
                    program: "redis-server".to_string(),
                    action: format!("connecting to 127.0.0.1:{port}"),
                    source,
                })
            }
        }
    }
}

/// Appends one RESP command (array of bulk strings).
fn resp_command(out: &mut Vec<u8>, args: &[&[u8]]) {
    out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
}

/// A minimal pipelining RESP client.
struct Resp {
    writer: TcpStream,
    reader: BufReader<TcpStream>,
}

impl Resp {
    fn new(stream: TcpStream) -> Result<Resp, CorpusError> {
        let io_err = |source| CorpusError::Child {
            program: "redis-server".to_string(),
            action: "configuring the connection".to_string(),
            source,
        };
        stream.set_read_timeout(Some(Duration::from_secs(60))).map_err(io_err)?;
        let reader = BufReader::new(stream.try_clone().map_err(io_err)?);
        Ok(Resp { writer: stream, reader })
    }

    /// Sends `count` pipelined commands and consumes their replies; any
    /// error reply fails the batch.
    fn send_batch(&mut self, commands: &[u8], count: usize) -> Result<(), CorpusError> {
        let io_err = |source| CorpusError::Child {
            program: "redis-server".to_string(),
            action: "talking RESP".to_string(),
            source,
        };
        self.writer.write_all(commands).map_err(io_err)?;
        for _ in 0..count {
            self.read_reply()?;
        }
        Ok(())
    }

    fn read_line(&mut self) -> Result<String, CorpusError> {
        let mut line = String::new();
        let n = self.reader.read_line(&mut line).map_err(|source| CorpusError::Child {
            program: "redis-server".to_string(),
            action: "reading a reply".to_string(),
            source,
        })?;
        if n == 0 {
            return Err(CorpusError::Redis("connection closed".to_string()));
        }
        Ok(line.trim_end_matches(['\r', '\n']).to_string())
    }

    fn read_reply(&mut self) -> Result<(), CorpusError> {
        let line = self.read_line()?;
        let (kind, rest) = line.split_at(line.len().min(1));
        let len = || rest.parse::<i64>().map_err(|_| CorpusError::Redis(format!("bad length in reply {line:?}")));
        match kind {
            "+" | ":" => Ok(()),
            "-" => Err(CorpusError::Redis(format!("error reply: {rest}"))),
            "$" => {
                if let Ok(n) = usize::try_from(len()?) {
                    let mut buf = vec![0u8; n + 2];
                    self.reader.read_exact(&mut buf).map_err(|source| CorpusError::Child {
                        program: "redis-server".to_string(),
                        action: "reading a bulk reply".to_string(),
                        source,
                    })?;
                }
                Ok(())
            }
            "*" => {
                for _ in 0..len()?.max(0) {
                    self.read_reply()?;
                }
                Ok(())
            }
            _ => Err(CorpusError::Redis(format!("unexpected reply {line:?}"))),
        }
    }
}

/// Generates a realistic stream of write commands.
struct RedisFiller {
    rng: SplitMix64,
    next: u64,
}

const WORDS: [&str; 48] = [
    "alpha",
    "bravo",
    "cart",
    "delta",
    "echo",
    "feed",
    "guest",
    "home",
    "index",
    "join",
    "kilo",
    "login",
    "mobile",
    "news",
    "order",
    "pay",
    "query",
    "refund",
    "search",
    "token",
    "user",
    "video",
    "web",
    "xray",
    "yield",
    "zone",
    "account",
    "billing",
    "checkout",
    "dashboard",
    "event",
    "friend",
    "group",
    "history",
    "inbox",
    "journal",
    "keyword",
    "like",
    "message",
    "notify",
    "offer",
    "profile",
    "review",
    "settings",
    "share",
    "upload",
    "wishlist",
    "zip",
];
const COUNTRIES: [&str; 10] = ["DE", "US", "FR", "JP", "BR", "IN", "GB", "NL", "SE", "CA"];
const AGENTS: [&str; 4] = [
    "Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) Chrome/124.0 Safari/537.36",
    "Mozilla/5.0 (iPhone; CPU iPhone OS 17_4 like Mac OS X) AppleWebKit/605.1.15 Mobile/15E148",
    "Mozilla/5.0 (Windows NT 10.0; Win64; x64; rv:125.0) Gecko/20100101 Firefox/125.0",
    "okhttp/4.12.0",
];

impl RedisFiller {
    fn new() -> Self {
        RedisFiller { rng: SplitMix64::new(0x7E3E_5EED), next: 0 }
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        let n = u64::try_from(items.len()).expect("usize fits in u64");
        items[usize::try_from(self.rng.below(n)).expect("index fits in usize")]
    }

    fn num(&mut self, n: u64) -> u64 {
        self.rng.below(n)
    }

    /// `min` to `min + extra - 1` words separated by spaces.
    fn words(&mut self, min: u64, extra: u64) -> String {
        let n = min + self.num(extra);
        (0..n).map(|_| self.pick(&WORDS)).collect::<Vec<_>>().join(" ")
    }

    /// `count` commands (RESP-encoded) and their number.
    fn batch(&mut self, count: usize) -> (Vec<u8>, usize) {
        let mut out = Vec::with_capacity(count * 200);
        for _ in 0..count {
            let id = self.next;
            self.next += 1;
            match self.num(100) {
                // Session blobs (JSON strings), some with a TTL.
                0..=29 => {
                    let key = format!("session:{:016x}", self.rng.next_u64());
                    let blob = format!(
                        "{{\"user_id\":{},\"csrf\":\"{:016x}{:016x}\",\"created\":{},\"ip\":\"10.{}.{}.{}\",\
                         \"ua\":\"{}\",\"cart\":[{}],\"flags\":{{\"beta\":{},\"dark\":{}}},\"last\":\"/{}/{}\"}}",
                        self.num(1_000_000),
                        self.rng.next_u64(),
                        self.rng.next_u64(),
                        1_714_521_600 + self.num(30_000_000),
                        self.num(256),
                        self.num(256),
                        self.num(256),
                        self.pick(&AGENTS),
                        (0..self.num(6)).map(|_| self.num(100_000).to_string()).collect::<Vec<_>>().join(","),
                        self.num(2) == 0,
                        self.num(3) == 0,
                        self.pick(&WORDS),
                        self.pick(&WORDS),
                    );
                    if self.num(3) == 0 {
                        resp_command(&mut out, &[b"SET", key.as_bytes(), blob.as_bytes(), b"EX", b"86400"]);
                    } else {
                        resp_command(&mut out, &[b"SET", key.as_bytes(), blob.as_bytes()]);
                    }
                }
                // User records as hashes.
                30..=54 => {
                    let key = format!("user:{id}");
                    let first = self.pick(&WORDS);
                    let last = self.pick(&WORDS);
                    let name = format!("{first} {last}");
                    let email = format!("{first}.{last}{id}@example.com");
                    let age = (18 + self.num(70)).to_string();
                    let country = self.pick(&COUNTRIES);
                    let created = (1_600_000_000 + self.num(130_000_000)).to_string();
                    let score =
                        format!("{:.3}", f64::from(u32::try_from(self.num(1_000_000)).expect("small")) / 1000.0);
                    let plan = self.pick(&["free", "pro", "team", "enterprise"]);
                    let bio = self.words(1, 12);
                    resp_command(
                        &mut out,
                        &[
                            b"HSET",
                            key.as_bytes(),
                            b"name",
                            name.as_bytes(),
                            b"email",
                            email.as_bytes(),
                            b"age",
                            age.as_bytes(),
                            b"country",
                            country.as_bytes(),
                            b"created",
                            created.as_bytes(),
                            b"score",
                            score.as_bytes(),
                            b"plan",
                            plan.as_bytes(),
                            b"bio",
                            bio.as_bytes(),
                        ],
                    );
                }
                // Activity timelines (lists).
                55..=69 => {
                    let key = format!("timeline:{}", self.num(20_000));
                    let event = format!(
                        "{}|{}|{}|{}",
                        1_714_521_600 + self.num(30_000_000),
                        self.pick(&WORDS),
                        self.num(1_000_000),
                        self.words(1, 4)
                    );
                    resp_command(&mut out, &[b"LPUSH", key.as_bytes(), event.as_bytes()]);
                }
                // Leaderboards (sorted sets).
                70..=81 => {
                    let key = format!("leaderboard:{}:{}", self.pick(&WORDS), self.num(20));
                    let score = self.num(10_000_000).to_string();
                    let member = format!("player:{}", self.num(2_000_000));
                    resp_command(&mut out, &[b"ZADD", key.as_bytes(), score.as_bytes(), member.as_bytes()]);
                }
                // Counters.
                82..=91 => {
                    let key = format!("counter:{}:{}:{}", self.pick(&WORDS), self.pick(&WORDS), self.num(50_000));
                    let by = (1 + self.num(20)).to_string();
                    resp_command(&mut out, &[b"INCRBY", key.as_bytes(), by.as_bytes()]);
                }
                // Tag sets.
                92..=97 => {
                    let key = format!("tag:{}:{}", self.pick(&WORDS), self.pick(&WORDS));
                    let member = self.num(5_000_000).to_string();
                    resp_command(&mut out, &[b"SADD", key.as_bytes(), member.as_bytes()]);
                }
                // Cached rendered fragments (larger strings).
                _ => {
                    let key = format!("cache:/{}/{}/{}", self.pick(&WORDS), self.pick(&WORDS), id);
                    let mut html = String::from("<div class=\"card\">");
                    for _ in 0..(3 + self.num(15)) {
                        let w = self.words(3, 10);
                        let href = self.pick(&WORDS);
                        html.push_str(&format!(
                            "<p><a href=\"/{href}/{}\">{w}</a> <span class=\"n\">{}</span></p>",
                            self.num(100_000),
                            self.num(1000)
                        ));
                    }
                    html.push_str("</div>");
                    resp_command(&mut out, &[b"SET", key.as_bytes(), html.as_bytes(), b"EX", b"3600"]);
                }
            }
        }
        (out, count)
    }
}
