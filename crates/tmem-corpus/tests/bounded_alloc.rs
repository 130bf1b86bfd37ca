//! A corpus whose header claims more pages than its stream holds must not
//! make the reader allocate for them (findings: a zstd `.tcorp` claiming
//! 2^40 pages made `bench store` allocate 12.6 GB before it reported the
//! truncation; later, an 11 KB one was refused only after 320 MiB).
//!
//! A counting global allocator measures the peak; this file holds one test
//! so that nothing else allocates meanwhile.

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;
use std::sync::atomic::{AtomicUsize, Ordering};

use tmem_corpus::{Corpus, CorpusError, CorpusMeta, FORMAT_VERSION, MAGIC, READ_CHUNK};

struct Counting;

static NOW: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; the
// counters are only bookkeeping.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let now = NOW.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
        PEAK.fetch_max(now, Ordering::Relaxed);
        // SAFETY: same layout contract as ours.
        unsafe { System.alloc(layout) }
    }
    /// Forwarded to the system's realloc (glibc moves large blocks with
    /// mremap, without a copy), counting only the change in size.
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > layout.size() {
            let now = NOW.fetch_add(new_size - layout.size(), Ordering::Relaxed) + new_size - layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        } else {
            NOW.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
        }
        // SAFETY: `ptr` came from this allocator with `layout`; same contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        NOW.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// A zstd stream (no content size in its frame) whose header claims
/// `claimed` pages, followed by `zero_bytes` of zeros.
fn forged(claimed: u64, zero_bytes: usize) -> Vec<u8> {
    let mut enc = zstd::stream::write::Encoder::new(Vec::new(), 1).unwrap();
    enc.write_all(&forged_plain_header(claimed)).unwrap();
    let zeros = vec![0u8; 1 << 20];
    for _ in 0..zero_bytes >> 20 {
        enc.write_all(&zeros).unwrap();
    }
    enc.finish().unwrap()
}

#[test]
fn forged_page_counts_allocate_nothing() {
    let streamed = 320usize << 20;
    // With the content size recorded in the frame, the claim is refused before reading.
    let e = Corpus::from_bytes(&zstd::bulk::compress(&forged_plain_header(1 << 40), 1).unwrap()).unwrap_err();
    assert!(matches!(e, CorpusError::LengthMismatch { .. }), "{e}");

    // Without it: a claim beyond what the file can hold is refused before
    // decoding; one it could hold is measured first, keeping nothing.
    let pages = u64::try_from(streamed / 4096).unwrap();
    for (claim, what) in [(1 << 40, "far beyond the file"), (pages + 1, "one page more than streamed")] {
        let bomb = forged(claim, streamed);
        PEAK.store(NOW.load(Ordering::Relaxed), Ordering::Relaxed);
        let base = NOW.load(Ordering::Relaxed);
        let e = Corpus::from_bytes(&bomb).unwrap_err();
        let peak = PEAK.load(Ordering::Relaxed) - base;
        assert!(
            matches!(e, CorpusError::ClaimExceedsStream { .. } | CorpusError::LengthMismatch { .. }),
            "{what} ({} bytes of stream): {e}",
            bomb.len()
        );
        // The decoder's own buffers (a few MiB), no page data.
        assert!(peak < READ_CHUNK, "{what}: peak {} MiB", peak >> 20);
    }
}

/// The plain header of a corpus claiming `claimed` pages, with no data.
fn forged_plain_header(claimed: u64) -> Vec<u8> {
    let meta =
        CorpusMeta { program: "x".into(), source: "x".into(), captured_unix: 0, kernel: "x".into(), pages: claimed };
    let json = serde_json::to_vec(&meta).unwrap();
    let mut v = Vec::new();
    v.extend_from_slice(&MAGIC);
    v.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    v.extend_from_slice(&4096u32.to_le_bytes());
    v.extend_from_slice(&claimed.to_le_bytes());
    v.extend_from_slice(&u32::try_from(json.len()).unwrap().to_le_bytes());
    v.extend_from_slice(&json);
    v
}
