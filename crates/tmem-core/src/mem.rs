//! Raw page memory: the only place that touches `mmap`'d bytes through pointers.
//!
//! [`PageArena`] reserves address space in large chunks and hands out spans of
//! whole pages. [`SpanPtr`] is the small access type the allocator uses to read
//! and write inside a span; every raw access in the crate goes through it.
//!
//! Accounting: a span's pages count as used from `alloc_span` until
//! `free_span`. A freed span is returned to the kernel (`MADV_DONTNEED`, or
//! a punched hole in a memfd) before it is kept for reuse, so resident
//! memory and the count agree.
//!
//! # Shared arenas (zero-copy hand-over)
//!
//! [`PageArena::shared`] backs the chunks with one memfd instead of private
//! memory: chunk `i` is bytes `i * 4 MiB..` of the file. A successor process
//! receives the descriptor and the arena's [`ArenaImage`] and maps the same
//! pages ([`PageArena::adopt`]); nothing stored is read or copied. Spans are
//! named across processes by [`SpanPlace`] (chunk, page), as addresses differ.
//!
//! While two processes map the pages, only one may change them:
//! [`PageArena::seal`] makes every later `alloc_span` fail and every
//! `free_span` a no-op that touches neither the pages nor the tables, so a
//! sealed predecessor leaves the memory exactly as its image describes
//! (racing frees leak their span into the successor; they never free it).

// The mappings are made with `libc`, not `rustix`: Miri runs this module
// (scripts/test.sh) and emulates libc's mmap/madvise, not raw syscalls.
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use tmem_lock::{Mutex, MutexGuard, Rank};

use crate::PAGE_SIZE;

/// Address space reserved per `mmap` call. Untouched pages cost nothing.
const CHUNK_BYTES: usize = 4 << 20;

/// Largest span, in pages.
pub const MAX_SPAN_PAGES: usize = 16;

/// Start of a span: `pages * PAGE_SIZE` bytes of mapped, page-aligned memory
/// owned by one allocator size class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpanPtr {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: a SpanPtr is an address into an mmap'd region that lives as long as
// the PageArena; synchronisation of the bytes is done by the allocator's locks.
unsafe impl Send for SpanPtr {}
// SAFETY: as above; shared SpanPtr values only read the address.
unsafe impl Sync for SpanPtr {}

impl SpanPtr {
    /// Length of the span in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Spans are never empty; provided for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check(&self, offset: usize, len: usize) {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            "span access out of bounds: {offset}+{len} > {}",
            self.len
        );
    }

    /// Copies `src` into the span at `offset`.
    ///
    /// # Safety
    /// The caller owns bytes `offset..offset+src.len()` exclusively (an
    /// allocated slot that no other thread reads or writes concurrently), and
    /// the span has not been freed.
    pub unsafe fn write(&self, offset: usize, src: &[u8]) {
        self.check(offset, src.len());
        // SAFETY: bounds checked above; exclusivity and liveness are the
        // caller's contract; src cannot overlap a span we own exclusively.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.base.as_ptr().add(offset), src.len());
        }
    }

    /// Borrows `len` bytes at `offset`, for no longer than `arena` (the
    /// arena the span came from, whose mappings it points into) is borrowed.
    ///
    /// # Safety
    /// The span came from `arena`; no thread writes these bytes while the
    /// returned slice lives, and the span is not freed during that time.
    pub unsafe fn slice<'a>(&self, arena: &'a PageArena, offset: usize, len: usize) -> &'a [u8] {
        let _ = arena;
        self.check(offset, len);
        // SAFETY: bounds checked; the memory is mapped and initialised (mmap
        // zero-fills); the caller guarantees no concurrent writer or free.
        unsafe { std::slice::from_raw_parts(self.base.as_ptr().add(offset), len) }
    }

    /// Reads a little-endian u16 at `offset` (free-list links in free slots).
    ///
    /// # Safety
    /// As for [`SpanPtr::slice`].
    pub unsafe fn read_u16(&self, offset: usize) -> u16 {
        self.check(offset, 2);
        // SAFETY: bounds checked; mapped and initialised; the caller
        // guarantees no concurrent writer or free. Read by value: no borrow outlives the call.
        u16::from_le_bytes(unsafe { std::ptr::read_unaligned(self.base.as_ptr().add(offset).cast::<[u8; 2]>()) })
    }

    /// Writes a little-endian u16 at `offset`.
    ///
    /// # Safety
    /// As for [`SpanPtr::write`].
    pub unsafe fn write_u16(&self, offset: usize, v: u16) {
        // SAFETY: forwarded contract.
        unsafe { self.write(offset, &v.to_le_bytes()) }
    }

    /// Copies `len` bytes from `src_off` in `self` to `dst_off` in `dst`.
    ///
    /// # Safety
    /// Both ranges satisfy the contracts of `slice` and `write` respectively,
    /// and they do not overlap.
    pub unsafe fn copy_to(&self, src_off: usize, dst: &SpanPtr, dst_off: usize, len: usize) {
        self.check(src_off, len);
        dst.check(dst_off, len);
        // SAFETY: both ranges are in bounds and mapped; the caller
        // guarantees exclusive use of both and that they do not overlap
        // (distinct allocated slots never do).
        unsafe {
            std::ptr::copy_nonoverlapping(self.base.as_ptr().add(src_off), dst.base.as_ptr().add(dst_off), len);
        }
    }

    /// Flips bits of the byte at `offset` (corruption tests).
    ///
    /// # Safety
    /// As for [`SpanPtr::write`].
    #[cfg(test)]
    pub(crate) unsafe fn xor_byte(&self, offset: usize, bits: u8) {
        self.check(offset, 1);
        // SAFETY: in bounds; exclusivity and liveness are the caller's contract.
        unsafe { *self.base.as_ptr().add(offset) ^= bits };
    }
}

struct Chunk {
    base: NonNull<u8>,
}

/// Where a span lives, the same in every process that maps the arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpanPlace {
    /// Chunk number (its offset in the memfd is `chunk * CHUNK_BYTES`).
    pub chunk: u32,
    /// First page of the span within the chunk.
    pub page: u32,
}

/// What a successor needs to map a shared arena as its predecessor left it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ArenaImage {
    /// Chunks mapped, in order.
    pub chunks: u32,
    /// Next unused byte in the newest chunk.
    pub bump: u32,
    /// Freed spans kept for reuse: (pages, place).
    pub free: Vec<(u8, SpanPlace)>,
}

/// Pages per chunk.
pub const CHUNK_PAGES: usize = CHUNK_BYTES / PAGE_SIZE;

/// What backs the chunks.
enum Backing {
    /// Private anonymous memory (a store of one process).
    Private,
    /// One memfd, chunk `i` at offset `i * CHUNK_BYTES` (a store a successor
    /// may adopt).
    Memfd(std::os::fd::OwnedFd),
}

impl ArenaInner {
    /// Records chunk number `n`, mapped at `base`.
    fn add_chunk(&mut self, base: NonNull<u8>, n: u32) {
        self.chunks.push(Chunk { base });
        let at = self.by_addr.partition_point(|&(b, _)| b < base.as_ptr() as usize);
        self.by_addr.insert(at, (base.as_ptr() as usize, n));
    }

    /// Where the span at `base` of `len` bytes lives.
    fn place(&self, base: NonNull<u8>, len: usize) -> SpanPlace {
        let addr = base.as_ptr() as usize;
        let i = self.by_addr.partition_point(|&(b, _)| b <= addr);
        let (start, chunk) = self.by_addr[i.checked_sub(1).expect("a span lies in a chunk of its arena")];
        debug_assert!(addr + len <= start + CHUNK_BYTES);
        SpanPlace { chunk, page: u32::try_from((addr - start) / PAGE_SIZE).expect("under 4 MiB") }
    }
}

struct ArenaInner {
    chunks: Vec<Chunk>,
    /// Chunk bases sorted by address, with their chunk numbers: finds the
    /// chunk of a span.
    by_addr: Vec<(usize, u32)>,
    /// Next unused byte in the newest chunk.
    bump: usize,
    /// Freed spans by page count (index = pages - 1); already `MADV_DONTNEED`.
    /// The flag says the span had to be unlocked first (the process called
    /// `mlockall`), so it is locked again when reused.
    free: Vec<Vec<(NonNull<u8>, bool)>>,
}

/// Source of page-aligned spans, carved from `CHUNK_BYTES` mmap reservations.
pub struct PageArena {
    inner: Mutex<ArenaInner>,
    /// Pages in live spans.
    used_pages: AtomicU64,
    backing: Backing,
    /// Set once the pages are handed to a successor: see the module docs.
    sealed: AtomicBool,
}

// SAFETY: all raw pointers are guarded by the inner Mutex; the mappings are
// process-wide and valid from any thread.
unsafe impl Send for PageArena {}
// SAFETY: as above.
unsafe impl Sync for PageArena {}

/// Errors from the page arena.
#[derive(Debug, thiserror::Error)]
pub enum MemError {
    /// The kernel refused to map more memory.
    #[error("mmap of {bytes} bytes failed: {source}")]
    Mmap {
        /// Size asked for.
        bytes: usize,
        /// errno from the kernel.
        source: std::io::Error,
    },
    /// The memfd of a shared arena could not be made or grown.
    #[error("memfd of a shared pool: {0}")]
    Memfd(std::io::Error),
    /// The arena was handed to a successor: it changes no page any more.
    #[error("the pool was handed over to a successor and is sealed")]
    Sealed,
    /// An image names a span outside the memfd.
    #[error("arena image: {0}")]
    BadImage(String),
}

impl Default for PageArena {
    fn default() -> Self {
        Self::new()
    }
}

impl PageArena {
    fn with_backing(backing: Backing) -> Self {
        Self {
            inner: Mutex::new(
                Rank::AllocArena,
                ArenaInner {
                    chunks: Vec::new(),
                    by_addr: Vec::new(),
                    bump: CHUNK_BYTES,
                    free: (0..MAX_SPAN_PAGES).map(|_| Vec::new()).collect(),
                },
            ),
            used_pages: AtomicU64::new(0),
            backing,
            sealed: AtomicBool::new(false),
        }
    }

    /// Creates an empty arena of private memory; nothing is mapped until the
    /// first span.
    pub fn new() -> Self {
        Self::with_backing(Backing::Private)
    }

    /// Creates an empty arena backed by a memfd, which a successor process
    /// can adopt (module docs).
    pub fn shared() -> Result<Self, MemError> {
        let fd = rustix::fs::memfd_create("tmem-pool", rustix::fs::MemfdFlags::CLOEXEC)
            .map_err(|e| MemError::Memfd(e.into()))?;
        Ok(Self::with_backing(Backing::Memfd(fd)))
    }

    /// The memfd of a shared arena.
    pub fn memfd(&self) -> Option<BorrowedFd<'_>> {
        match &self.backing {
            Backing::Memfd(fd) => Some(fd.as_fd()),
            Backing::Private => None,
        }
    }

    /// Seals the arena (`true`) for a hand-over, or opens it again (`false`)
    /// when the hand-over failed: module docs.
    pub fn seal(&self, sealed: bool) {
        self.sealed.store(sealed, Ordering::SeqCst);
    }

    /// Whether the arena is sealed.
    pub fn sealed(&self) -> bool {
        self.sealed.load(Ordering::SeqCst)
    }

    /// Where `span` lives (shared arenas; any arena in tests).
    pub fn place(&self, span: SpanPtr) -> SpanPlace {
        self.lock().place(span.base, span.len)
    }

    /// The span of `pages` pages at `place`, if it lies inside the arena.
    pub fn span_at(&self, place: SpanPlace, pages: usize) -> Result<SpanPtr, MemError> {
        Self::span_in(&self.lock(), place, pages)
    }

    /// Calls `f` with [`PageArena::span_at`] under one hold of the lock (an
    /// adoption places every span of the image).
    pub fn with_span_at<T>(&self, f: impl FnOnce(&dyn Fn(SpanPlace, usize) -> Result<SpanPtr, MemError>) -> T) -> T {
        let g = self.lock();
        f(&|place, pages| Self::span_in(&g, place, pages))
    }

    fn span_in(g: &ArenaInner, place: SpanPlace, pages: usize) -> Result<SpanPtr, MemError> {
        let chunk = g
            .chunks
            .get(place.chunk as usize)
            .ok_or_else(|| MemError::BadImage(format!("chunk {} of {}", place.chunk, g.chunks.len())))?;
        if !(1..=MAX_SPAN_PAGES).contains(&pages) || place.page as usize + pages > CHUNK_PAGES {
            return Err(MemError::BadImage(format!("a span of {pages} pages at page {}", place.page)));
        }
        // SAFETY: page + pages <= CHUNK_PAGES, so the span lies inside the chunk.
        let base = unsafe { chunk.base.add(place.page as usize * PAGE_SIZE) };
        Ok(SpanPtr { base, len: pages * PAGE_SIZE })
    }

    /// The chunks and free spans, for a successor's [`PageArena::adopt`].
    pub fn image(&self) -> ArenaImage {
        let g = self.lock();
        let free = (1..=MAX_SPAN_PAGES)
            .flat_map(|pages| {
                let g = &g;
                g.free[pages - 1]
                    .iter()
                    .map(move |&(p, _)| (u8::try_from(pages).expect("at most 16 pages"), g.place(p, pages * PAGE_SIZE)))
            })
            .collect();
        ArenaImage {
            chunks: u32::try_from(g.chunks.len()).expect("fewer than 2^32 chunks"),
            bump: u32::try_from(g.bump).expect("under 4 MiB"),
            free,
        }
    }

    /// Maps the arena of a predecessor: `fd` is its memfd, `image` what it
    /// sent, `used_pages` the pages of its live spans. No page is read.
    pub fn adopt(fd: OwnedFd, image: &ArenaImage, used_pages: u64) -> Result<Self, MemError> {
        let size = rustix::fs::fstat(&fd).map_err(|e| MemError::Memfd(e.into()))?.st_size;
        let need = u64::from(image.chunks) * CHUNK_BYTES as u64;
        if u64::try_from(size).unwrap_or(0) < need {
            return Err(MemError::BadImage(format!("{} chunks in a memfd of {size} bytes", image.chunks)));
        }
        if image.bump as usize > CHUNK_BYTES || !(image.bump as usize).is_multiple_of(PAGE_SIZE) {
            return Err(MemError::BadImage(format!("bump {}", image.bump)));
        }
        let arena = Self::with_backing(Backing::Memfd(fd));
        {
            let mut g = arena.lock();
            for i in 0..image.chunks {
                g.add_chunk(map_chunk(&arena.backing, i as usize)?, i);
            }
            g.bump = if image.chunks == 0 { CHUNK_BYTES } else { image.bump as usize };
        }
        for &(pages, place) in &image.free {
            let span = arena.span_at(place, usize::from(pages))?;
            arena.lock().free[usize::from(pages) - 1].push((span.base, false));
        }
        arena.used_pages.store(used_pages, Ordering::Relaxed);
        Ok(arena)
    }

    /// Maps `span`'s pages into this process (and so locks them, under
    /// `mlockall(MCL_ONFAULT)`) without changing a byte: an adopted arena's
    /// pages would otherwise be locked only by the predecessor's mappings.
    /// A page mapped in a locked mapping is out of reclaim's reach: reclaim
    /// marks it mlocked when it meets it. So `Mlocked:` of /proc/meminfo
    /// may count only part of an adopted pool (about half, measured), while
    /// `Locked:` of the process's smaps counts all of it.
    pub fn populate(&self, span: SpanPtr) -> std::io::Result<()> {
        // SAFETY: the span is mapped by this arena; MADV_POPULATE_READ only
        // faults the pages in and changes no contents.
        let rc = unsafe { libc::madvise(span.base.as_ptr().cast(), span.len, libc::MADV_POPULATE_READ) };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }

    /// Bytes in live spans.
    pub fn used_bytes(&self) -> u64 {
        self.used_pages.load(Ordering::Relaxed) * PAGE_SIZE as u64
    }

    /// Bytes of arena bookkeeping (chunk and free lists), for metadata accounting.
    pub fn meta_bytes(&self) -> u64 {
        let g = self.lock();
        let free: usize = g.free.iter().map(|v| v.capacity() * std::mem::size_of::<(NonNull<u8>, bool)>()).sum();
        (g.chunks.capacity() * std::mem::size_of::<Chunk>() + free) as u64
    }

    fn lock(&self) -> MutexGuard<'_, ArenaInner> {
        self.inner.lock()
    }

    /// Returns a zero-filled span of `pages` pages.
    pub fn alloc_span(&self, pages: usize) -> Result<SpanPtr, MemError> {
        assert!((1..=MAX_SPAN_PAGES).contains(&pages));
        let len = pages * PAGE_SIZE;
        let mut g = self.lock();
        if self.sealed() {
            return Err(MemError::Sealed);
        }
        let base = if let Some((p, unlocked)) = g.free[pages - 1].pop() {
            if unlocked {
                // SAFETY: the range is a whole span of ours, unused; locking
                // on fault changes no contents.
                let rc = unsafe { libc::mlock2(p.as_ptr().cast(), len, libc::MLOCK_ONFAULT) };
                debug_assert_eq!(rc, 0, "mlock2 failed: {}", std::io::Error::last_os_error());
            }
            p
        } else {
            if g.bump + len > CHUNK_BYTES {
                let n = g.chunks.len();
                let base = map_chunk(&self.backing, n)?;
                g.add_chunk(base, u32::try_from(n).expect("fewer than 2^32 chunks"));
                g.bump = 0;
            }
            let chunk = g.chunks.last().expect("a chunk was just ensured").base;
            // SAFETY: bump + len <= CHUNK_BYTES, so the result stays inside the chunk.
            let p = unsafe { chunk.add(g.bump) };
            g.bump += len;
            p
        };
        self.used_pages.fetch_add(pages as u64, Ordering::Relaxed);
        Ok(SpanPtr { base, len })
    }

    /// Returns a span's pages to the kernel and keeps the range for reuse.
    ///
    /// # Safety
    /// `span` came from this arena's `alloc_span` and is not used afterwards.
    pub unsafe fn free_span(&self, span: SpanPtr) {
        if self.sealed() {
            // Handed over: the successor owns these pages now (module docs).
            return;
        }
        let pages = span.len / PAGE_SIZE;
        let (released, unlocked) = match &self.backing {
            Backing::Memfd(fd) => (self.punch(fd, span), false),
            // SAFETY: the caller's contract, forwarded.
            Backing::Private => unsafe { Self::dontneed(span) },
        };
        if !released {
            // The pages stay resident; zero them so reuse is still correct.
            // SAFETY: the span is ours and unused (caller contract).
            unsafe { std::ptr::write_bytes(span.base.as_ptr(), 0, span.len) };
        }
        self.used_pages.fetch_sub(pages as u64, Ordering::Relaxed);
        self.lock().free[pages - 1].push((span.base, unlocked));
    }

    /// Punches `span`'s pages out of the memfd; whether that worked.
    fn punch(&self, fd: &OwnedFd, span: SpanPtr) -> bool {
        let place = self.place(span);
        let offset = u64::from(place.chunk) * CHUNK_BYTES as u64 + u64::from(place.page) * PAGE_SIZE as u64;
        let punch = rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE;
        rustix::fs::fallocate(fd, punch, offset, span.len as u64).is_ok()
    }

    /// Returns `span`'s private pages with `MADV_DONTNEED`, unlocking them
    /// first under `mlockall`; whether that worked, and whether it unlocked.
    ///
    /// # Safety
    /// As for [`PageArena::free_span`].
    unsafe fn dontneed(span: SpanPtr) -> (bool, bool) {
        let addr = span.base.as_ptr().cast::<libc::c_void>();
        // SAFETY: the range is a whole span we mapped; nobody uses it any more
        // (caller contract). MADV_DONTNEED on private anonymous memory makes
        // later reads return zeros, which is what a fresh span needs.
        #[cfg(not(miri))]
        let mut rc = unsafe { libc::madvise(addr, span.len, libc::MADV_DONTNEED) };
        // Miri has no madvise: free_span zeroes the span by hand.
        #[cfg(miri)]
        let mut rc = -1;
        let mut unlocked = false;
        if rc != 0 && cfg!(not(miri)) {
            // Locked memory (mlockall) refuses DONTNEED: unlock the span first.
            // SAFETY: same exclusive range as above.
            rc = unsafe { libc::munlock(addr, span.len) };
            if rc == 0 {
                unlocked = true;
                // SAFETY: same exclusive range as above.
                rc = unsafe { libc::madvise(addr, span.len, libc::MADV_DONTNEED) };
            }
        }
        (rc == 0, unlocked)
    }
}

/// Private anonymous memory; no swap reservation (untouched pages cost
/// nothing). Miri supports only the first two flags. Shared arenas map
/// their memfd with `MAP_SHARED | MAP_NORESERVE`.
#[cfg(not(miri))]
const MAP_FLAGS: libc::c_int = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
#[cfg(miri)]
const MAP_FLAGS: libc::c_int = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;

/// Maps chunk `index`; for a memfd, grows the file to hold it first.
fn map_chunk(backing: &Backing, index: usize) -> Result<NonNull<u8>, MemError> {
    use std::os::fd::AsRawFd;
    let (flags, fd, offset) = match backing {
        Backing::Private => (MAP_FLAGS, -1, 0),
        Backing::Memfd(fd) => {
            let end = (index as u64 + 1) * CHUNK_BYTES as u64;
            let size = rustix::fs::fstat(fd).map_err(|e| MemError::Memfd(e.into()))?.st_size;
            if u64::try_from(size).unwrap_or(0) < end {
                rustix::fs::ftruncate(fd, end).map_err(|e| MemError::Memfd(e.into()))?;
            }
            let offset = libc::off_t::try_from(index * CHUNK_BYTES)
                .map_err(|_| MemError::Memfd(std::io::Error::other("offset")))?;
            (libc::MAP_SHARED | libc::MAP_NORESERVE, fd.as_raw_fd(), offset)
        }
    };
    // SAFETY: a new mapping with no address hint (of our own memfd, or
    // anonymous); the result is checked for MAP_FAILED before use.
    let p =
        unsafe { libc::mmap(std::ptr::null_mut(), CHUNK_BYTES, libc::PROT_READ | libc::PROT_WRITE, flags, fd, offset) };
    if p == libc::MAP_FAILED {
        return Err(MemError::Mmap { bytes: CHUNK_BYTES, source: std::io::Error::last_os_error() });
    }
    NonNull::new(p.cast())
        .ok_or(MemError::Mmap { bytes: CHUNK_BYTES, source: std::io::Error::other("mmap returned null") })
}

impl Drop for PageArena {
    fn drop(&mut self) {
        let g = self.inner.get_mut();
        for c in g.chunks.drain(..) {
            // SAFETY: each chunk was mapped by map_chunk with CHUNK_BYTES and
            // the arena (and so every span in it) is being dropped.
            unsafe { libc::munmap(c.base.as_ptr().cast(), CHUNK_BYTES) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_are_zeroed_and_reused() {
        let a = PageArena::new();
        let s = a.alloc_span(2).unwrap();
        assert_eq!(a.used_bytes(), 2 * PAGE_SIZE as u64);
        // SAFETY: fresh span, single thread.
        unsafe { s.write(100, &[7; 50]) };
        // SAFETY: not used afterwards.
        unsafe { a.free_span(s) };
        assert_eq!(a.used_bytes(), 0);
        let t = a.alloc_span(2).unwrap();
        assert_eq!(t, s, "freed span of the same size is reused");
        // SAFETY: fresh span, single thread.
        assert!(unsafe { t.slice(&a, 0, t.len()) }.iter().all(|&b| b == 0));
    }

    #[test]
    // Miri has no mlockall; this checks the kernel's behaviour, not memory safety.
    #[cfg_attr(miri, ignore)]
    fn spans_are_released_and_zeroed_under_mlockall() {
        // nextest runs each test in its own process, so locking is contained.
        // SAFETY: mlockall only changes how our own mappings are locked.
        if unsafe { libc::mlockall(libc::MCL_CURRENT | libc::MCL_FUTURE | libc::MCL_ONFAULT) } != 0 {
            let why = format!("mlockall refused: {}", std::io::Error::last_os_error());
            tmem_testkit::skip(tmem_testkit::Feature::Root, &why);
            return;
        }
        let a = PageArena::new();
        let s = a.alloc_span(4).unwrap();
        // SAFETY: fresh span, single thread.
        unsafe { s.write(0, &[0xAB; 3 * PAGE_SIZE]) };
        // SAFETY: not used afterwards.
        unsafe { a.free_span(s) };
        assert!(a.lock().free[3].last().is_some_and(|&(_, unlocked)| unlocked), "locked span was unlocked to free it");
        let t = a.alloc_span(4).unwrap();
        assert_eq!(t, s);
        // SAFETY: fresh span, single thread.
        assert!(unsafe { t.slice(&a, 0, t.len()) }.iter().all(|&b| b == 0));
        // SAFETY: undo the test's locking.
        unsafe { libc::munlockall() };
    }

    /// Bytes of the memfd backed by memory (not holes).
    fn memfd_bytes(a: &PageArena) -> u64 {
        let st = rustix::fs::fstat(a.memfd().unwrap()).unwrap();
        u64::try_from(st.st_blocks).unwrap() * 512
    }

    #[test]
    // Miri has no memfd_create.
    #[cfg_attr(miri, ignore)]
    fn a_shared_arena_is_adopted_as_it_is_and_sealed_changes_nothing() {
        let a = PageArena::shared().unwrap();
        let spans: Vec<SpanPtr> = (1..=8).map(|p| a.alloc_span(p).unwrap()).collect();
        for (i, s) in spans.iter().enumerate() {
            // SAFETY: fresh spans, single thread.
            unsafe { s.write(0, &[u8::try_from(i).unwrap() + 1; PAGE_SIZE / 2]) };
        }
        let before = memfd_bytes(&a);
        // SAFETY: not used afterwards.
        unsafe { a.free_span(spans[7]) };
        assert!(memfd_bytes(&a) < before, "a freed span's pages leave the memfd");
        assert_eq!(a.used_bytes(), 28 * PAGE_SIZE as u64);
        a.seal(true);
        assert!(matches!(a.alloc_span(1), Err(MemError::Sealed)));
        // SAFETY: sealed: a no-op, the span stays as it is.
        unsafe { a.free_span(spans[6]) };
        assert_eq!(a.used_bytes(), 28 * PAGE_SIZE as u64, "a sealed free changes nothing");
        let image = a.image();
        assert_eq!(image.free.len(), 1);
        let b = PageArena::adopt(a.memfd().unwrap().try_clone_to_owned().unwrap(), &image, 28).unwrap();
        for (i, s) in spans[..7].iter().enumerate() {
            let t = b.span_at(a.place(*s), i + 1).unwrap();
            assert_ne!(t, *s, "mapped again at another address");
            b.populate(t).unwrap();
            // SAFETY: no writer; the span is live in both arenas.
            let bytes = unsafe { t.slice(&b, 0, PAGE_SIZE / 2) };
            assert!(bytes.iter().all(|&x| usize::from(x) == i + 1), "span {i} arrives unchanged");
        }
        // The successor reuses the freed span first.
        let again = b.alloc_span(8).unwrap();
        assert_eq!(b.place(again), a.place(spans[7]));
        assert!(b.span_at(SpanPlace { chunk: 9, page: 0 }, 1).is_err());
        assert!(b.span_at(SpanPlace { chunk: 0, page: 1020 }, 8).is_err());
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn a_shared_span_is_released_under_mlockall() {
        // nextest runs each test in its own process, so locking is contained.
        // SAFETY: mlockall only changes how our own mappings are locked.
        if unsafe { libc::mlockall(libc::MCL_CURRENT | libc::MCL_FUTURE | libc::MCL_ONFAULT) } != 0 {
            let why = format!("mlockall refused: {}", std::io::Error::last_os_error());
            tmem_testkit::skip(tmem_testkit::Feature::Root, &why);
            return;
        }
        let a = PageArena::shared().unwrap();
        let s = a.alloc_span(4).unwrap();
        // SAFETY: fresh span, single thread.
        unsafe { s.write(0, &[0xAB; 4 * PAGE_SIZE]) };
        let held = memfd_bytes(&a);
        // SAFETY: not used afterwards.
        unsafe { a.free_span(s) };
        assert_eq!(held - memfd_bytes(&a), 4 * PAGE_SIZE as u64, "the locked pages left the memfd");
        let t = a.alloc_span(4).unwrap();
        // SAFETY: fresh span, single thread.
        assert!(unsafe { t.slice(&a, 0, t.len()) }.iter().all(|&b| b == 0));
        // SAFETY: undo the test's locking.
        unsafe { libc::munlockall() };
    }

    #[test]
    #[should_panic(expected = "out of bounds")]
    fn out_of_bounds_panics() {
        let a = PageArena::new();
        let s = a.alloc_span(1).unwrap();
        // SAFETY: single thread; the bounds check panics before any access.
        unsafe { s.write(PAGE_SIZE - 1, &[0, 0]) };
    }
}
