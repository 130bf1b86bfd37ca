//! Raw page memory: the only place that touches `mmap`'d bytes through pointers.
//!
//! [`PageArena`] reserves address space in large chunks and hands out spans of
//! whole pages. [`SpanPtr`] is the small access type the allocator uses to read
//! and write inside a span; every raw access in the crate goes through it.
//!
//! Accounting: a span's pages count as used from `alloc_span` until
//! `free_span`. A freed span is returned to the kernel with `MADV_DONTNEED`
//! before it is kept for reuse, so resident memory and the count agree.

// The mappings are made with `libc`, not `rustix`: Miri runs this module
// (scripts/test.sh) and emulates libc's mmap/madvise, not raw syscalls.
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
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

struct ArenaInner {
    chunks: Vec<Chunk>,
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
}

impl Default for PageArena {
    fn default() -> Self {
        Self::new()
    }
}

impl PageArena {
    /// Creates an empty arena; no memory is mapped until the first span.
    pub fn new() -> Self {
        Self {
            inner: Mutex::new(
                Rank::AllocArena,
                ArenaInner {
                    chunks: Vec::new(),
                    bump: CHUNK_BYTES,
                    free: (0..MAX_SPAN_PAGES).map(|_| Vec::new()).collect(),
                },
            ),
            used_pages: AtomicU64::new(0),
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
                let base = map_chunk()?;
                g.chunks.push(Chunk { base });
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
        let pages = span.len / PAGE_SIZE;
        let addr = span.base.as_ptr().cast::<libc::c_void>();
        // SAFETY: the range is a whole span we mapped; nobody uses it any more
        // (caller contract). MADV_DONTNEED on private anonymous memory makes
        // later reads return zeros, which is what a fresh span needs.
        #[cfg(not(miri))]
        let mut rc = unsafe { libc::madvise(addr, span.len, libc::MADV_DONTNEED) };
        // Miri has no madvise: zero the span by hand below.
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
        if rc != 0 {
            // The pages stay resident; zero them so reuse is still correct.
            // SAFETY: same exclusive range as above.
            unsafe { std::ptr::write_bytes(span.base.as_ptr(), 0, span.len) };
        }
        self.used_pages.fetch_sub(pages as u64, Ordering::Relaxed);
        self.lock().free[pages - 1].push((span.base, unlocked));
    }
}

/// Private anonymous memory; no swap reservation (untouched pages cost
/// nothing). Miri supports only the first two flags.
#[cfg(not(miri))]
const MAP_FLAGS: libc::c_int = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
#[cfg(miri)]
const MAP_FLAGS: libc::c_int = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;

fn map_chunk() -> Result<NonNull<u8>, MemError> {
    // SAFETY: anonymous private mapping with no address hint; the result is
    // checked for MAP_FAILED before use.
    let p =
        unsafe { libc::mmap(std::ptr::null_mut(), CHUNK_BYTES, libc::PROT_READ | libc::PROT_WRITE, MAP_FLAGS, -1, 0) };
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

    #[test]
    #[should_panic(expected = "out of bounds")]
    fn out_of_bounds_panics() {
        let a = PageArena::new();
        let s = a.alloc_span(1).unwrap();
        // SAFETY: single thread; the bounds check panics before any access.
        unsafe { s.write(PAGE_SIZE - 1, &[0, 0]) };
    }
}
