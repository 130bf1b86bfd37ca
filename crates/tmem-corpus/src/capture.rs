//! Capturing the resident private anonymous pages of a live process.

use std::fs::{self, File};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::{proc_path, Corpus, CorpusError, CorpusMeta, PAGE_SIZE};

/// pagemap entry bit 63: page present in RAM.
const PM_PRESENT: u64 = 1 << 63;
/// pagemap entry bit 62: page swapped out.
const PM_SWAPPED: u64 = 1 << 62;
/// pagemap entry bits 0-54: page frame number (only shown to CAP_SYS_ADMIN).
const PM_PFN_MASK: u64 = (1 << 55) - 1;

/// Pages of pagemap looked at per pread (64 KiB of entries, 32 MiB of address space).
const PAGEMAP_CHUNK: usize = 8192;
/// Largest run of pages read from /proc/PID/mem with one pread (1 MiB).
const MEM_RUN: usize = 256;
/// How long to wait for all threads to reach the stopped state after SIGSTOP.
const STOP_TIMEOUT: Duration = Duration::from_secs(2);

/// One line of /proc/PID/maps that we capture from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Mapping {
    pub(crate) start: u64,
    pub(crate) end: u64,
    pub(crate) name: String,
}

/// Captures up to `max_bytes` of the private, writable, anonymous memory of
/// process `pid` that is resident (or swapped out).
///
/// Candidate mappings are those of `/proc/PID/maps` whose permissions are
/// `rw?p` and that have no pathname or are `[heap]`, `[stack]`, or
/// `[anon:…]`. For every page `/proc/PID/pagemap` is consulted and only
/// pages that are present (bit 63) or swapped (bit 62) are read — with
/// `pread` on `/proc/PID/mem` — so untouched pages are never faulted in.
/// Pages mapping the kernel's shared zero page (detectable when the PFN is
/// visible, i.e. as root) are skipped too: they are not anonymous memory the
/// kernel could ever swap. Pages are taken in address order until `max_bytes`
/// is reached; ranges that cannot be read (EIO/EFAULT) are skipped.
///
/// The process is stopped with `SIGSTOP` for the duration of the capture and
/// continued with `SIGCONT` afterwards, also on error (a process that was
/// already stopped is left stopped; the calling process itself is never
/// stopped).
///
/// The corpus has program `"pid"` and source `"pid PID (command line)"`.
pub fn capture_pid(pid: i32, max_bytes: u64) -> Result<Corpus, CorpusError> {
    if pid <= 0 {
        return Err(CorpusError::InvalidArgument(format!("pid must be positive, got {pid}")));
    }
    let max_pages = usize::try_from(max_bytes / 4096).unwrap_or(usize::MAX);
    if max_pages == 0 {
        return Err(CorpusError::InvalidArgument(format!(
            "max_bytes must be at least one page (4096), got {max_bytes}"
        )));
    }
    let proc_dir = PathBuf::from(format!("/proc/{pid}"));
    if let Err(e) = fs::metadata(&proc_dir) {
        return Err(proc_error(pid, &proc_dir, e));
    }
    let description = describe_process(pid);

    // Opening these checks ptrace access, so permission problems surface
    // before the process is stopped.
    let mem_path = proc_path(pid, "mem");
    let mem = File::open(&mem_path).map_err(|e| proc_error(pid, &mem_path, e))?;
    let pagemap_path = proc_path(pid, "pagemap");
    let pagemap = File::open(&pagemap_path).map_err(|e| proc_error(pid, &pagemap_path, e))?;
    let zero_pfn = zero_page_pfn();

    let data = {
        let _stopped = StopGuard::stop(pid)?;
        let mappings = read_maps(pid)?;
        read_pages(pid, &mappings, &pagemap, &mem, zero_pfn, max_pages)?
        // `_stopped` sends SIGCONT here, on success and on error alike.
    };

    Corpus::new(CorpusMeta::now("pid", format!("pid {pid} ({description})")), data)
}

/// Maps an error opening/reading a /proc file to the most helpful variant.
pub(crate) fn proc_error(pid: i32, path: &Path, e: io::Error) -> CorpusError {
    match e.raw_os_error() {
        Some(libc::ENOENT | libc::ESRCH) => CorpusError::ProcessNotFound { pid, path: path.to_path_buf() },
        Some(libc::EACCES | libc::EPERM) => CorpusError::PermissionDenied { pid, path: path.to_path_buf(), source: e },
        _ => CorpusError::Proc { pid, path: path.to_path_buf(), source: e },
    }
}

/// The command line of `pid` (whitespace collapsed, at most ~120 chars),
/// or its `comm` in brackets for kernel threads.
pub(crate) fn describe_process(pid: i32) -> String {
    let cmdline = fs::read(proc_path(pid, "cmdline")).unwrap_or_default();
    // Arguments are NUL-separated; collapse all whitespace (scripts passed
    // with -c contain newlines) so the description stays on one line.
    let mut s = String::from_utf8_lossy(&cmdline)
        .split(|c: char| c == '\0' || c.is_whitespace())
        .filter(|w| !w.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    if s.is_empty() {
        let comm = fs::read_to_string(proc_path(pid, "comm")).unwrap_or_default();
        s = format!("[{}]", comm.trim());
    }
    if s.chars().count() > 120 {
        s = s.chars().take(117).collect::<String>() + "...";
    }
    s
}

/// Parses /proc/PID/maps and keeps the private, writable, anonymous mappings.
fn read_maps(pid: i32) -> Result<Vec<Mapping>, CorpusError> {
    let path = proc_path(pid, "maps");
    let text = fs::read_to_string(&path).map_err(|e| proc_error(pid, &path, e))?;
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.is_empty()) {
        let bad = || CorpusError::BadMapsLine { pid, line: line.to_string() };
        let (start, end, perms, name) = tmem_sys::procmaps::parse_line(line).ok_or_else(bad)?;
        if tmem_sys::procmaps::is_private_anonymous(perms, name) && end > start {
            out.push(Mapping { start, end, name: name.to_string() });
        }
    }
    Ok(out)
}

/// Reads the present/swapped pages of `mappings`, in order, up to `max_pages`.
fn read_pages(
    pid: i32,
    mappings: &[Mapping],
    pagemap: &File,
    mem: &File,
    zero_pfn: Option<u64>,
    max_pages: usize,
) -> Result<Vec<u8>, CorpusError> {
    let page = u64::try_from(PAGE_SIZE).expect("usize fits in u64");
    let mut out: Vec<u8> = Vec::new();
    let mut entries = vec![0u8; PAGEMAP_CHUNK * 8];
    let mut pages_read = 0usize;
    'mappings: for m in mappings {
        let mut vpage = m.start / page;
        let end_page = m.end / page;
        while vpage < end_page {
            if pages_read >= max_pages {
                break 'mappings;
            }
            let chunk = usize::try_from(end_page - vpage).unwrap_or(usize::MAX).min(PAGEMAP_CHUNK);
            let buf = &mut entries[..chunk * 8];
            let n =
                read_up_to(pagemap, buf, vpage * 8).map_err(|e| proc_error(pid, &proc_path(pid, "pagemap"), e))? / 8;
            // Walk the entries, collecting runs of consecutive wanted pages.
            let mut i = 0;
            while i < n && pages_read < max_pages {
                if !wanted(entry(buf, i), zero_pfn) {
                    i += 1;
                    continue;
                }
                let mut j = i + 1;
                while j < n && j - i < MEM_RUN && wanted(entry(buf, j), zero_pfn) {
                    j += 1;
                }
                let run = (j - i).min(max_pages - pages_read);
                let addr = (vpage + u64::try_from(i).expect("usize fits in u64")) * page;
                pages_read += read_run(mem, addr, run, &mut out);
                i = j;
            }
            if n < chunk {
                // Short pagemap read: the rest of the mapping is gone.
                break;
            }
            vpage += u64::try_from(chunk).expect("usize fits in u64");
        }
    }
    Ok(out)
}

fn entry(buf: &[u8], i: usize) -> u64 {
    u64::from_ne_bytes(buf[i * 8..i * 8 + 8].try_into().expect("8 bytes"))
}

/// A page is captured if present or swapped, unless it is the zero page.
fn wanted(entry: u64, zero_pfn: Option<u64>) -> bool {
    if entry & PM_SWAPPED != 0 {
        return true;
    }
    if entry & PM_PRESENT == 0 {
        return false;
    }
    match zero_pfn {
        Some(z) => entry & PM_PFN_MASK != z,
        None => true,
    }
}

/// Reads `pages` pages at `addr` from /proc/PID/mem, appending to `out`.
/// Unreadable pages are skipped. Returns the number of pages appended.
fn read_run(mem: &File, addr: u64, pages: usize, out: &mut Vec<u8>) -> usize {
    let old = out.len();
    out.resize(old + pages * PAGE_SIZE, 0);
    if read_up_to(mem, &mut out[old..], addr).ok() == Some(pages * PAGE_SIZE) {
        return pages;
    }
    // Part of the run is unreadable: retry page by page, keeping what works.
    out.truncate(old);
    let mut got = 0;
    let page = u64::try_from(PAGE_SIZE).expect("usize fits in u64");
    for k in 0..pages {
        let at = out.len();
        out.resize(at + PAGE_SIZE, 0);
        let a = addr + u64::try_from(k).expect("usize fits in u64") * page;
        if read_up_to(mem, &mut out[at..], a).ok() == Some(PAGE_SIZE) {
            got += 1;
        } else {
            out.truncate(at);
        }
    }
    got
}

/// pread until `buf` is full, EOF, or an error; returns bytes read. An error
/// after some bytes were read is reported as a short read.
fn read_up_to(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        let off = offset + u64::try_from(done).expect("usize fits in u64");
        match file.read_at(&mut buf[done..], off) {
            Ok(0) => break,
            Ok(k) => done += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if done == 0 => return Err(e),
            Err(_) => break,
        }
    }
    Ok(done)
}

/// PFN of the kernel's shared zero page, if pagemap shows PFNs to us.
fn zero_page_pfn() -> Option<u64> {
    static PFN: OnceLock<Option<u64>> = OnceLock::new();
    *PFN.get_or_init(|| {
        // SAFETY: an anonymous private read-only mapping of one page at an
        // address of the kernel's choosing: no existing memory is affected,
        // and the result is checked against MAP_FAILED before use.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), PAGE_SIZE, libc::PROT_READ, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        // SAFETY: `p` is a valid, readable, page-aligned mapping of
        // PAGE_SIZE bytes created above; reading it maps the zero page.
        let _ = unsafe { std::ptr::read_volatile(p.cast::<u8>()) };
        let addr = u64::try_from(p.addr()).expect("usize fits in u64");
        let pfn = File::open("/proc/self/pagemap").ok().and_then(|f| {
            let mut e = [0u8; 8];
            let off = addr / 4096 * 8;
            (read_up_to(&f, &mut e, off).ok()? == 8).then(|| u64::from_ne_bytes(e))
        });
        // SAFETY: `p` was returned by the successful mmap above with length
        // PAGE_SIZE, is not referenced anywhere else, and is unmapped once.
        unsafe { libc::munmap(p, PAGE_SIZE) };
        pfn.filter(|e| e & PM_PRESENT != 0).map(|e| e & PM_PFN_MASK).filter(|&pfn| pfn != 0)
    })
}

/// Scheduler state letter of each thread of `pid` (from /proc/PID/task/*/stat).
fn thread_states(pid: i32) -> Vec<u8> {
    let Ok(dir) = fs::read_dir(proc_path(pid, "task")) else {
        return Vec::new();
    };
    dir.filter_map(|t| {
        let stat = fs::read_to_string(t.ok()?.path().join("stat")).ok()?;
        // "tid (comm) S ..." — comm may contain spaces and parentheses.
        let after = &stat[stat.rfind(')')? + 1..];
        after.trim_start().bytes().next()
    })
    .collect()
}

fn is_stopped_state(s: u8) -> bool {
    matches!(s, b'T' | b't' | b'Z' | b'X' | b'x')
}

/// Holds a process stopped; sends SIGCONT when dropped.
struct StopGuard {
    pid: i32,
    stopped: bool,
}

impl StopGuard {
    fn stop(pid: i32) -> Result<StopGuard, CorpusError> {
        let states = thread_states(pid);
        let already_stopped = !states.is_empty() && states.iter().all(|&s| is_stopped_state(s));
        if i64::from(pid) == i64::from(std::process::id()) || already_stopped {
            return Ok(StopGuard { pid, stopped: false });
        }
        send_signal(pid, libc::SIGSTOP, "SIGSTOP")?;
        let guard = StopGuard { pid, stopped: true };
        // SIGSTOP is delivered asynchronously: wait until every thread has
        // stopped (threads in uninterruptible sleep stop when they wake). On
        // timeout we proceed anyway; the capture is then merely less coherent.
        let deadline = Instant::now() + STOP_TIMEOUT;
        while Instant::now() < deadline {
            let states = thread_states(pid);
            if states.is_empty() || states.iter().all(|&s| is_stopped_state(s)) {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(guard)
    }
}

impl Drop for StopGuard {
    fn drop(&mut self) {
        if self.stopped {
            // Nothing useful can be done if this fails (e.g. the process exited).
            let _ = send_signal(self.pid, libc::SIGCONT, "SIGCONT");
        }
    }
}

fn send_signal(pid: i32, sig: libc::c_int, name: &'static str) -> Result<(), CorpusError> {
    debug_assert!(pid > 0, "never signal process groups or everyone");
    // SAFETY: kill(2) has no memory-safety preconditions; `pid` is positive
    // (checked by capture_pid), so exactly one process is signalled.
    let rc = unsafe { libc::kill(pid, sig) };
    if rc == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    Err(match e.raw_os_error() {
        Some(libc::ESRCH) => CorpusError::ProcessNotFound { pid, path: PathBuf::from(format!("/proc/{pid}")) },
        Some(libc::EPERM) => {
            CorpusError::PermissionDenied { pid, path: PathBuf::from(format!("/proc/{pid}")), source: e }
        }
        _ => CorpusError::Signal { pid, signal: name, source: e },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pagemap_bits() {
        assert!(!wanted(0, None));
        assert!(wanted(PM_PRESENT | 5, None));
        assert!(wanted(PM_SWAPPED | 5, Some(5)));
        assert!(!wanted(PM_PRESENT | 5, Some(5)));
        assert!(wanted(PM_PRESENT | 6, Some(5)));
    }

    #[test]
    fn rejects_bad_pids() {
        assert!(matches!(capture_pid(0, 1 << 20), Err(CorpusError::InvalidArgument(_))));
        assert!(matches!(capture_pid(-1, 1 << 20), Err(CorpusError::InvalidArgument(_))));
        assert!(matches!(capture_pid(1, 100), Err(CorpusError::InvalidArgument(_))));
        // pid_max is at most 2^22, so this pid cannot exist.
        let err = capture_pid(i32::MAX, 1 << 20).unwrap_err();
        assert!(matches!(err, CorpusError::ProcessNotFound { pid: i32::MAX, .. }), "{err}");
        assert!(err.to_string().contains(&i32::MAX.to_string()));
    }
}
