//! The process that owns the pages of `tmem bench fault` and touches them.
//!
//! It is forked once, before any backend exists, so the fuse-ram baseline's
//! FUSE workers (threads of the bench process) never share an address space
//! with the faulting thread: a worker growing its heap takes `mmap_lock`
//! for writing, which a fault or `MADV_PAGEOUT` holding it for reading
//! while it waits on I/O that worker serves would block for good. The child maps its pages after the fork, so no
//! page is shared with the parent (`MADV_PAGEOUT` skips shared pages).
//!
//! Commands come one per line on a pipe (`out`, `settle BUDGET`, `touch
//! random`, `touch sequential`, `quit`); each is answered with one JSON
//! line ([`Reply`]). Under `tmem run` it is `tmem bench fault-toucher`, and
//! its pipes are its standard input and output.

use std::io::{BufRead, BufReader, Write};
use std::time::{Duration, Instant};

use anyhow::anyhow;
use rand_xoshiro::rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use rustix::mm::{Advice, MapFlags, ProtFlags};
use tmem_corpus::{Corpus, PAGE_SIZE};

use super::{Latency, Order};

/// Give up paging out once this long passes with no more pages going out.
const PAGE_OUT_STALL: Duration = Duration::from_secs(20);
/// Share of the pages that must be out before a pass.
pub const MIN_OUT_PERCENT: u64 = 95;

/// What `out` did.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct OutReport {
    /// Pages in the region.
    pub pages: u64,
    /// Pages not in memory (mincore) when it finished.
    pub pages_out: u64,
    /// `MADV_PAGEOUT` calls it took.
    pub rounds: u32,
    /// Wall time, seconds.
    pub secs: f64,
}

/// What `touch` measured.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct TouchReport {
    /// Pages touched: those out when the pass began.
    pub touched: u64,
    /// Touches that took a major fault (`ru_majflt`: the fault waited for swap I/O).
    pub major_faults: u64,
    /// Touches that took only minor faults (the page was in the swap cache, read ahead).
    pub minor_faults: u64,
    /// `pswpin` over the pass (system-wide): pages read from swap devices.
    pub pswpin: u64,
    /// `zswpin` over the pass (pages loaded back from zswap).
    pub zswpin: u64,
    /// Latency of the touches that took a major fault.
    pub major: Latency,
    /// Latency of the touches that took only minor faults.
    pub minor: Latency,
    /// Latency of every touch.
    pub all: Latency,
    /// Wall time of the pass, seconds.
    pub secs: f64,
    /// Pages whose content was checked after the pass: all of them.
    pub verified_pages: u64,
    /// Pages that read back wrong.
    pub wrong_pages: u64,
    /// The first wrong page's index.
    pub first_wrong: Option<u64>,
}

/// One answer.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub enum Reply {
    /// Ready: the region is filled.
    Ready {
        /// Pages in it.
        pages: u64,
    },
    /// `out` done.
    Out(OutReport),
    /// `touch` done.
    Touched(Box<TouchReport>),
    /// A command failed.
    Failed(String),
}

/// Page `i` of the region: built-in corpus page `i mod n`, with `i` in its
/// last 8 bytes unless the page is same-filled (those stay same-filled, as
/// real zero pages do), so a page read back from the wrong slot shows.
pub fn expected_page(corpus: &Corpus, i: usize, out: &mut [u8; PAGE_SIZE]) {
    let src = corpus.page(i % corpus.page_count());
    out.copy_from_slice(src);
    if tmem_corpus::same_filled_word(src).is_none() {
        out[PAGE_SIZE - 8..].copy_from_slice(&(i as u64).to_le_bytes());
    }
}

/// A private anonymous mapping of whole pages, without huge pages; unmapped on drop.
struct Region {
    ptr: *mut u8,
    pages: usize,
}

impl Region {
    fn new(pages: usize) -> anyhow::Result<Self> {
        let len = pages * PAGE_SIZE;
        // SAFETY: a new anonymous mapping at an address the kernel picks; no existing memory changes.
        let ptr = unsafe {
            rustix::mm::mmap_anonymous(std::ptr::null_mut(), len, ProtFlags::READ | ProtFlags::WRITE, MapFlags::PRIVATE)
        }
        .map_err(|e| anyhow!("mmap of {len} bytes: {e}"))?;
        let r = Self { ptr: ptr.cast(), pages };
        // Huge pages would go out and come back 512 pages at a time.
        // SAFETY: the range is exactly the mapping made above; advice changes no content.
        unsafe { rustix::mm::madvise(ptr, len, Advice::LinuxNoHugepage) }
            .map_err(|e| anyhow!("MADV_NOHUGEPAGE: {e}"))?;
        Ok(r)
    }

    fn len(&self) -> usize {
        self.pages * PAGE_SIZE
    }

    fn page(&self, i: usize) -> &[u8; PAGE_SIZE] {
        assert!(i < self.pages);
        // SAFETY: page i lies inside the live mapping, which only this thread touches;
        // it may fault in from swap, which the kernel does transparently.
        unsafe { &*self.ptr.add(i * PAGE_SIZE).cast::<[u8; PAGE_SIZE]>() }
    }

    fn page_mut(&mut self, i: usize) -> &mut [u8; PAGE_SIZE] {
        assert!(i < self.pages);
        // SAFETY: as in `page`, and `&mut self` makes this the only reference.
        unsafe { &mut *self.ptr.add(i * PAGE_SIZE).cast::<[u8; PAGE_SIZE]>() }
    }

    /// Reads the first byte of page `i` (faulting it in).
    #[inline(always)]
    fn touch(&self, i: usize) -> u8 {
        debug_assert!(i < self.pages);
        // SAFETY: inside the live mapping; a volatile read so the access is never elided.
        unsafe { std::ptr::read_volatile(self.ptr.add(i * PAGE_SIZE)) }
    }

    /// `MADV_PAGEOUT` on the whole region.
    fn page_out(&self) -> anyhow::Result<()> {
        // SAFETY: the range is the live mapping; paging out keeps the content.
        unsafe { rustix::mm::madvise(self.ptr.cast(), self.len(), Advice::LinuxPageOut) }
            .map_err(|e| anyhow!("MADV_PAGEOUT: {e}"))
    }

    /// Which pages are in memory (mapped, or in the swap cache): `mincore`.
    fn resident(&self, vec: &mut [u8]) -> anyhow::Result<()> {
        assert_eq!(vec.len(), self.pages);
        // SAFETY: the range is the live mapping and `vec` has one writable byte per page of it.
        if unsafe { libc::mincore(self.ptr.cast(), self.len(), vec.as_mut_ptr()) } != 0 {
            return Err(anyhow!("mincore: {}", std::io::Error::last_os_error()));
        }
        Ok(())
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`; nothing refers to it after drop.
        let _ = unsafe { rustix::mm::munmap(self.ptr.cast(), self.len()) };
    }
}

/// Major and minor faults of this process so far (`getrusage`).
fn faults() -> (u64, u64) {
    // SAFETY: an all-zero `rusage` is a valid value of this plain C struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is live and writable for the call; getrusage only writes into it.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &raw mut ru) };
    if rc != 0 {
        return (0, 0);
    }
    (u64::try_from(ru.ru_majflt).unwrap_or(0), u64::try_from(ru.ru_minflt).unwrap_or(0))
}

struct Child {
    corpus: Corpus,
    region: Region,
    seed: u64,
    /// Page residency, one byte per page.
    vec: Vec<u8>,
}

impl Child {
    fn new(pages: usize, seed: u64) -> anyhow::Result<Self> {
        let corpus = Corpus::mix(&Corpus::builtin());
        let mut region = Region::new(pages)?;
        for i in 0..pages {
            expected_page(&corpus, i, region.page_mut(i));
        }
        Ok(Self { corpus, region, seed, vec: vec![1; pages] })
    }

    fn resident_pages(&mut self) -> anyhow::Result<Vec<usize>> {
        self.region.resident(&mut self.vec)?;
        Ok(self.vec.iter().enumerate().filter(|(_, v)| *v & 1 != 0).map(|(i, _)| i).collect())
    }

    /// Pages the region out until no page is resident, or none has gone
    /// out for [`PAGE_OUT_STALL`]; fails under [`MIN_OUT_PERCENT`] out. A
    /// page written to an asynchronous device (a loop device) stays in the
    /// swap cache after its write, unmapped, where `MADV_PAGEOUT` does not
    /// see it: reading it maps it again (a minor fault, no I/O), and the next
    /// `MADV_PAGEOUT` drops it, clean, without writing it again.
    fn out(&mut self) -> anyhow::Result<OutReport> {
        let start = Instant::now();
        let (mut rounds, mut fewest, mut progress_at) = (0, usize::MAX, start);
        let resident = loop {
            self.region.page_out()?;
            rounds += 1;
            let resident = self.resident_pages()?;
            if resident.len() < fewest {
                (fewest, progress_at) = (resident.len(), Instant::now());
            }
            if resident.is_empty() || progress_at.elapsed() > PAGE_OUT_STALL {
                break resident;
            }
            for &i in &resident {
                std::hint::black_box(self.region.touch(i));
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let pages = self.region.pages as u64;
        let out = pages - resident.len() as u64;
        if out * 100 < pages * MIN_OUT_PERCENT {
            return Err(anyhow!(
                "only {out} of {pages} pages went to swap after {rounds} MADV_PAGEOUT rounds in {:.1} s \
                 (is the swap area full, or another one taking pages?)",
                start.elapsed().as_secs_f64()
            ));
        }
        Ok(OutReport { pages, pages_out: out, rounds, secs: start.elapsed().as_secs_f64() })
    }

    /// Under `tmem run`, which evicts past its budget of `budget` pages by
    /// itself: waits until all but the budget (and 4 MiB of the process's
    /// own) are out, for [`PAGE_OUT_STALL`] at most. (Its own faults wait
    /// meanwhile: tmem run holds a fault past the budget until eviction
    /// brings the process under it.)
    fn settle(&mut self, budget: u64) -> anyhow::Result<OutReport> {
        let start = Instant::now();
        let pages = self.region.pages as u64;
        let want = pages.saturating_sub(budget + 1024);
        let mut rounds = 0;
        loop {
            let out = pages - self.resident_pages()?.len() as u64;
            rounds += 1;
            if out >= want {
                return Ok(OutReport { pages, pages_out: out, rounds, secs: start.elapsed().as_secs_f64() });
            }
            if start.elapsed() > PAGE_OUT_STALL {
                return Err(anyhow!(
                    "only {out} of {pages} pages were out after {:.1} s (want {want})",
                    start.elapsed().as_secs_f64()
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Touches every page that is out, one at a time, in `order`, timing
    /// each; then checks every page of the region.
    fn touch(&mut self, order: Order) -> anyhow::Result<TouchReport> {
        let resident = self.resident_pages()?;
        let mut out: Vec<usize> = Vec::with_capacity(self.region.pages - resident.len());
        let mut r = resident.iter().peekable();
        for i in 0..self.region.pages {
            if r.peek() == Some(&&i) {
                r.next();
            } else {
                out.push(i);
            }
        }
        if order == Order::Random {
            // Fisher-Yates with a seeded generator: the same permutation every run.
            let mut rng = Xoshiro256PlusPlus::seed_from_u64(self.seed);
            for k in (1..out.len()).rev() {
                let j = usize::try_from(rng.next_u64() % (k as u64 + 1)).unwrap_or(0);
                out.swap(k, j);
            }
        }
        // Written now, so that storing a sample never faults inside a pass.
        let mut ns = vec![u64::MAX; out.len()];
        let mut major = vec![u8::MAX; out.len()];
        let vm_before = tmem_sys::vmstat::SwapCounters::now()?;
        let start = Instant::now();
        let (mut maj0, mut min0) = faults();
        let (mut majors, mut minors) = (0, 0);
        for (k, &i) in out.iter().enumerate() {
            let t = Instant::now();
            std::hint::black_box(self.region.touch(i));
            let d = t.elapsed();
            let (maj1, min1) = faults();
            ns[k] = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
            major[k] = u8::from(maj1 > maj0);
            majors += u64::from(maj1 > maj0);
            minors += u64::from(maj1 == maj0 && min1 > min0);
            (maj0, min0) = (maj1, min1);
        }
        let secs = start.elapsed().as_secs_f64();
        let vm = tmem_sys::vmstat::SwapCounters::now()?.since(&vm_before);
        let pick =
            |want: u8| -> Vec<u64> { ns.iter().zip(&major).filter(|(_, m)| **m == want).map(|(n, _)| *n).collect() };
        let (mut maj_ns, mut min_ns) = (pick(1), pick(0));
        let (mut wrong, mut first_wrong) = (0, None);
        let mut want = [0u8; PAGE_SIZE];
        for i in 0..self.region.pages {
            expected_page(&self.corpus, i, &mut want);
            if *self.region.page(i) != want {
                wrong += 1;
                first_wrong = first_wrong.or(Some(i as u64));
            }
        }
        Ok(TouchReport {
            touched: out.len() as u64,
            major_faults: majors,
            minor_faults: minors,
            pswpin: vm.pswpin,
            zswpin: vm.zswpin,
            major: Latency::of(&mut maj_ns),
            minor: Latency::of(&mut min_ns),
            all: Latency::of(&mut ns),
            secs,
            verified_pages: self.region.pages as u64,
            wrong_pages: wrong,
            first_wrong,
        })
    }
}

/// The child's life: fill the region, answer commands until `quit` or
/// end of input. Returns the exit status.
pub fn serve(pages: usize, seed: u64, commands: impl std::io::Read, mut replies: impl Write) -> i32 {
    let mut send = |r: &Reply| -> bool {
        serde_json::to_string(r).is_ok_and(|line| writeln!(replies, "{line}").and_then(|()| replies.flush()).is_ok())
    };
    let mut child = match Child::new(pages, seed) {
        Ok(c) => c,
        Err(e) => {
            send(&Reply::Failed(format!("{e:#}")));
            return 1;
        }
    };
    if !send(&Reply::Ready { pages: pages as u64 }) {
        return 1;
    }
    for line in BufReader::new(commands).lines() {
        let Ok(line) = line else { return 1 };
        let reply = match line.trim() {
            "quit" => return 0,
            "out" => child.out().map(Reply::Out),
            settle if settle.starts_with("settle ") => match settle["settle ".len()..].parse() {
                Ok(budget) => child.settle(budget).map(Reply::Out),
                Err(e) => Err(anyhow!("{settle:?}: {e}")),
            },
            "touch random" => child.touch(Order::Random).map(|t| Reply::Touched(Box::new(t))),
            "touch sequential" => child.touch(Order::Sequential).map(|t| Reply::Touched(Box::new(t))),
            other => Err(anyhow!("unknown command {other:?}")),
        };
        if !send(&reply.unwrap_or_else(|e| Reply::Failed(format!("{e:#}")))) {
            return 1;
        }
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_carry_their_index_unless_same_filled() {
        let corpus = Corpus::mix(&Corpus::builtin());
        let n = corpus.page_count();
        let (mut a, mut b) = ([0u8; PAGE_SIZE], [0u8; PAGE_SIZE]);
        let mut stamped = 0;
        for i in 0..n {
            expected_page(&corpus, i, &mut a);
            expected_page(&corpus, i + n, &mut b);
            let same = tmem_corpus::same_filled_word(corpus.page(i)).is_some();
            assert_eq!(a == b, same, "page {i}");
            assert_eq!(a[..PAGE_SIZE - 8], corpus.page(i)[..PAGE_SIZE - 8]);
            stamped += usize::from(!same);
        }
        assert!(stamped > n / 2, "{stamped} of {n}");
    }

    #[test]
    fn a_region_is_filled_and_answers_commands_without_swap() {
        // No swap needed: with none, `out` fails cleanly, and `touch` finds
        // every page in memory, touches none and checks them all.
        let mut replies = Vec::new();
        let code = serve(64, 1, &b"touch random\nbogus\nquit\n"[..], &mut replies);
        assert_eq!(code, 0);
        let lines: Vec<Reply> =
            String::from_utf8(replies).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert!(matches!(lines[0], Reply::Ready { pages: 64 }), "{lines:?}");
        match &lines[1] {
            Reply::Touched(t) => {
                assert_eq!((t.touched, t.verified_pages, t.wrong_pages), (0, 64, 0), "{t:?}");
                assert_eq!(t.all.count, 0);
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(&lines[2], Reply::Failed(m) if m.contains("bogus")), "{lines:?}");
        assert_eq!(lines.len(), 3);
    }
}
