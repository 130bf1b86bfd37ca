//! Capturing live processes. Skips (with a message, see tmem-testkit) where
//! /proc/PID/mem is not readable or a program is not installed.

use std::fs::{self, File};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::FileExt;
use std::process::{Child, ChildStdout, Command, Stdio};

use tmem_corpus::{capture_pid, spawn_and_capture, CorpusError, SpawnKind, PAGE_SIZE};
use tmem_testkit::{have_tool, skip, Feature};

/// A 16-byte marker; the child fills 64 pages with it.
const MARKER: &[u8; 16] = b"TMEMCAPTURETEST!";

const CHILD: &str = r#"
import mmap, sys
marker = bytearray(b"TMEMCAPTURETEST!" * 256 * 64)
untouched = mmap.mmap(-1, 256 << 20, flags=mmap.MAP_PRIVATE)
print("ready", flush=True)
for line in sys.stdin:
    print("echo", line.strip(), flush=True)
"#;

struct Killer(Child);

impl Drop for Killer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn mem_readable(pid: u32) -> bool {
    match File::open(format!("/proc/{pid}/mem")) {
        Ok(_) => true,
        Err(e) => {
            skip(Feature::Root, &format!("/proc/{pid}/mem is not readable ({e}); run as root"));
            false
        }
    }
}

/// Present pages of the 256 MiB mapping (the only one that large) in `pid`.
fn present_in_big_mapping(pid: u32) -> usize {
    let maps = fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let (start, end) = maps
        .lines()
        .filter_map(|l| {
            let (a, b) = l.split_whitespace().next()?.split_once('-')?;
            Some((u64::from_str_radix(a, 16).ok()?, u64::from_str_radix(b, 16).ok()?))
        })
        .find(|(a, b)| b - a == 256 << 20)
        .expect("the 256 MiB mapping");
    let pagemap = File::open(format!("/proc/{pid}/pagemap")).unwrap();
    let pages = usize::try_from((end - start) / 4096).unwrap();
    let mut buf = vec![0u8; pages * 8];
    pagemap.read_exact_at(&mut buf, start / 4096 * 8).unwrap();
    buf.chunks_exact(8).filter(|e| u64::from_ne_bytes((*e).try_into().unwrap()) & (1 << 63) != 0).count()
}

fn read_line(r: &mut BufReader<ChildStdout>) -> String {
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    line.trim_end().to_string()
}

#[test]
fn captures_a_python_child() {
    if !have_tool("python3") {
        skip(Feature::Tools, "python3 not installed");
        return;
    }
    let child =
        Command::new("python3").args(["-c", CHILD]).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let mut child = Killer(child);
    let pid = child.0.id();
    let mut out = BufReader::new(child.0.stdout.take().unwrap());
    assert_eq!(read_line(&mut out), "ready");
    if !mem_readable(pid) {
        return;
    }
    assert_eq!(present_in_big_mapping(pid), 0);

    let corpus = capture_pid(i32::try_from(pid).unwrap(), 1 << 30).unwrap();
    assert_eq!(corpus.meta.program, "pid");
    let source = &corpus.meta.source;
    assert!(source.starts_with(&format!("pid {pid} (")) && source.contains("python3 -c import mmap"), "{source}");
    assert_eq!(corpus.meta.pages, u64::try_from(corpus.page_count()).unwrap());
    // The marker pages are there.
    let marker_pages = corpus.pages().filter(|p| p.chunks_exact(16).all(|c| c == MARKER)).count();
    assert!(marker_pages >= 63, "found {marker_pages} marker pages");
    // The untouched 256 MiB were neither captured nor faulted in.
    assert!(corpus.page_count() < (256 << 20) / PAGE_SIZE / 2, "{}", corpus.page_count());
    assert_eq!(present_in_big_mapping(pid), 0, "capture faulted in untouched pages");

    // The child was continued after the capture and still works.
    let mut stdin = child.0.stdin.take().unwrap();
    writeln!(stdin, "ping").unwrap();
    assert_eq!(read_line(&mut out), "echo ping");
    let state = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let state = state.rsplit(')').next().unwrap().trim_start().chars().next().unwrap();
    assert_ne!(state, 'T');

    // max_bytes is honoured.
    let small = capture_pid(i32::try_from(pid).unwrap(), 10 * 4096 + 100).unwrap();
    assert_eq!(small.page_count(), 10);
}

#[test]
fn captures_itself() {
    let pid = std::process::id();
    if !mem_readable(pid) {
        return;
    }
    let keep = vec![0x5Au8; 8 * PAGE_SIZE];
    let corpus = capture_pid(i32::try_from(pid).unwrap(), 1 << 30).unwrap();
    assert!(corpus.page_count() >= 8);
    assert!(corpus.pages().any(|p| p.iter().all(|&b| b == 0x5A)));
    drop(keep);
}

#[test]
fn missing_process_is_a_clear_error() {
    let e = capture_pid(i32::MAX, 1 << 20).unwrap_err();
    assert!(matches!(e, CorpusError::ProcessNotFound { .. }), "{e}");
    assert!(e.to_string().contains("2147483647"), "{e}");
}

fn spawn_small(kind: SpawnKind, program: &str) {
    if !have_tool(program) {
        skip(Feature::Tools, &format!("{program} not installed"));
        return;
    }
    let max = 8u64 << 20;
    let c = match spawn_and_capture(kind, max) {
        Ok(c) => c,
        Err(CorpusError::PermissionDenied { .. }) => {
            skip(Feature::Root, "not allowed to read process memory; run as root");
            return;
        }
        Err(e) => panic!("{kind}: {e}"),
    };
    assert_eq!(c.meta.program, kind.name());
    assert_eq!(c.page_count(), usize::try_from(max).unwrap() / PAGE_SIZE, "{kind}");
    let stats = c.stats();
    assert!(stats.zero < c.page_count() / 2, "{kind}: {stats:?}");
    println!("{kind}: {stats:?} from {}", c.meta.source);
}

#[test]
fn spawn_python() {
    spawn_small(SpawnKind::Python, "python3");
}

#[test]
fn spawn_java() {
    spawn_small(SpawnKind::Java, "javac");
}

#[test]
fn spawn_cc() {
    spawn_small(SpawnKind::Cc, "gcc");
}

#[test]
fn spawn_redis() {
    spawn_small(SpawnKind::Redis, "redis-server");
}
