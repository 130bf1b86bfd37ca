//! What a process has mapped: the private anonymous ranges of
//! `/proc/PID/maps` that `tmem run` manages, and which of their pages are
//! present (`/proc/PID/pagemap`, bit 63, readable by the owner), and how
//! many anonymous pages it has resident (`/proc/PID/statm`).

use std::fs::File;
use std::io::{self, BufRead, BufReader};
use std::os::unix::fs::FileExt;

use crate::sys::PAGE;

/// A range `[start, end)` of a process's address space.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Range {
    pub start: u64,
    pub end: u64,
}

/// The range of one line of `/proc/PID/maps`, if it is private anonymous
/// read-write memory that is not executable: a page moves only into a
/// mapping with the same access flags, and the staging area is `rw-`.
fn anonymous(line: &str) -> Option<Range> {
    let (start, end, perms, name) = tmem_sys::procmaps::parse_line(line)?;
    (perms == "rw-p" && tmem_sys::procmaps::is_private_anonymous(perms, name)).then_some(Range { start, end })
}

/// The private anonymous read-write ranges of `pid`, less `exclude`.
pub fn anonymous_ranges(pid: u32, exclude: &[Range]) -> io::Result<Vec<Range>> {
    let file = File::open(format!("/proc/{pid}/maps"))?;
    let mut out = Vec::new();
    for line in BufReader::new(file).lines() {
        if let Some(r) = anonymous(&line?) {
            subtract(r, exclude, &mut out);
        }
    }
    Ok(out)
}

/// Pushes the parts of `r` outside every range of `exclude`.
fn subtract(r: Range, exclude: &[Range], out: &mut Vec<Range>) {
    let mut parts = vec![r];
    for x in exclude {
        parts = parts
            .into_iter()
            .flat_map(|p| {
                if x.end <= p.start || p.end <= x.start {
                    return vec![p];
                }
                let mut v = Vec::new();
                if p.start < x.start {
                    v.push(Range { start: p.start, end: x.start });
                }
                if x.end < p.end {
                    v.push(Range { start: x.end, end: p.end });
                }
                v
            })
            .collect();
    }
    out.extend(parts);
}

/// A process's page map, for finding present pages.
pub struct PageMap(File);

impl PageMap {
    pub fn open(pid: u32) -> io::Result<Self> {
        Ok(Self(File::open(format!("/proc/{pid}/pagemap"))?))
    }

    /// Calls `f` with the address of every present page in `r` (bit 63).
    /// Some may be shared (the zero page, a `fork` child's): the agent makes
    /// such a page the process's own before it moves it.
    pub fn present(&self, r: Range, mut f: impl FnMut(u64)) -> io::Result<()> {
        const CHUNK: u64 = 4096;
        let mut buf = vec![0u8; 8 * 4096];
        let mut pn = r.start / PAGE as u64;
        let end = r.end / PAGE as u64;
        while pn < end {
            let n = (end - pn).min(CHUNK);
            #[allow(clippy::cast_possible_truncation)]
            let bytes = &mut buf[..n as usize * 8];
            self.0.read_exact_at(bytes, pn * 8)?;
            for (i, e) in bytes.chunks_exact(8).enumerate() {
                let entry = u64::from_ne_bytes(e.try_into().expect("8 bytes"));
                if entry >> 63 & 1 == 1 {
                    f((pn + i as u64) * PAGE as u64);
                }
            }
            pn += n;
        }
        Ok(())
    }
}

/// A process's `statm`, open for reading again and again.
pub struct Statm(File);

impl Statm {
    pub fn open(pid: u32) -> io::Result<Self> {
        Ok(Self(File::open(format!("/proc/{pid}/statm"))?))
    }

    /// The anonymous pages the process has resident: `resident` less
    /// `shared` (the kernel's `MM_ANONPAGES`; `shared` counts file and shmem
    /// pages). Allocates nothing: the evictor reads it every few ms.
    pub fn anon_pages(&self) -> io::Result<u64> {
        let mut buf = [0u8; 160];
        let n = self.0.read_at(&mut buf, 0)?;
        parse_statm_anon(&buf[..n])
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "statm: fewer than 3 numbers"))
    }
}

/// `resident - shared` of a `statm` line (`size resident shared text lib data dt`).
fn parse_statm_anon(line: &[u8]) -> Option<u64> {
    let mut fields = std::str::from_utf8(line).ok()?.split_ascii_whitespace().skip(1);
    let resident: u64 = fields.next()?.parse().ok()?;
    let shared: u64 = fields.next()?.parse().ok()?;
    Some(resident.saturating_sub(shared))
}

/// How many threads `pid` has (`num_threads`, field 20 of its `stat`).
pub fn threads(pid: u32) -> io::Result<usize> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The name (field 2) is in parentheses and may hold anything: count after the last one.
    let after = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or_default();
    after
        .split_whitespace()
        .nth(17)
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("/proc/{pid}/stat: no thread count")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statm_gives_resident_less_shared() {
        assert_eq!(parse_statm_anon(b"2000 700 300 10 0 900 0\n"), Some(400));
        assert_eq!(parse_statm_anon(b"2000 700"), None);
        assert_eq!(parse_statm_anon(b"x 700 300"), Some(400));
        assert_eq!(parse_statm_anon(b"2000 y 300"), None);
        let statm = Statm::open(std::process::id()).unwrap();
        let before = statm.anon_pages().unwrap();
        let v = vec![1u8; 4096 * PAGE];
        let after = statm.anon_pages().unwrap();
        // The kernel may read its per-CPU counters without summing them
        // (get_mm_counter): each CPU's part may lag by max(32, 2 x CPUs) pages.
        assert!(after >= before + 2048, "{before} -> {after}");
        drop(v);
    }

    #[test]
    fn thread_counts_come_from_stat() {
        let mut sleep = std::process::Command::new("sleep").arg("10").spawn().unwrap();
        let one = threads(sleep.id());
        let _ = sleep.kill();
        let _ = sleep.wait();
        assert_eq!(one.unwrap(), 1, "sleep runs one thread");
        // Other tests' threads may come and go: at least this one and the one held here.
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let held = std::thread::spawn(move || rx.recv());
        assert!(threads(std::process::id()).unwrap() >= 2);
        drop(tx);
        let _ = held.join();
    }

    #[test]
    fn only_private_anonymous_writable_ranges_count() {
        assert_eq!(anonymous("7f00-7f10 rw-p 00000000 00:00 0 "), Some(Range { start: 0x7f00, end: 0x7f10 }));
        assert_eq!(anonymous("1000-2000 rw-p 00000000 00:00 0    [heap]"), Some(Range { start: 0x1000, end: 0x2000 }));
        assert_eq!(anonymous("1000-2000 rw-s 00000000 00:01 5    /memfd:x (deleted)"), None);
        assert_eq!(anonymous("1000-2000 rw-p 00001000 08:01 77   /usr/lib/libc.so.6"), None);
        assert_eq!(anonymous("1000-2000 r--p 00000000 00:00 0    [vvar]"), None);
    }

    #[test]
    fn excluded_ranges_are_cut_out() {
        let mut out = Vec::new();
        subtract(
            Range { start: 0, end: 100 },
            &[Range { start: 10, end: 20 }, Range { start: 90, end: 200 }],
            &mut out,
        );
        assert_eq!(out, vec![Range { start: 0, end: 10 }, Range { start: 20, end: 90 }]);
    }

    #[test]
    fn this_process_has_present_anonymous_pages() {
        let v = vec![7u8; 4 * PAGE];
        let addr = v.as_ptr() as u64;
        let ranges = anonymous_ranges(std::process::id(), &[]).unwrap();
        let r = ranges.iter().find(|r| r.start <= addr && addr < r.end).expect("the heap is anonymous");
        let mut present = 0;
        PageMap::open(std::process::id()).unwrap().present(*r, |_| present += 1).unwrap();
        assert!(present >= 3, "{present}");
        drop(v);
    }
}
