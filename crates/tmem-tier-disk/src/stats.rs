//! The disk tier's counters: the live atomics, and [`DiskStats`], the
//! snapshot beyond the common [`TierStats`].

use tmem_counters::counters;

use super::*;

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) writes: AtomicU64,
    pub(crate) full: AtomicU64,
    pub(crate) reads: AtomicU64,
    pub(crate) misses: AtomicU64,
    pub(crate) removes: AtomicU64,
    pub(crate) failures: AtomicU64,
    pub(crate) bytes_written: AtomicU64,
    pub(crate) bytes_read: AtomicU64,
    pub(crate) wire_out: AtomicU64,
    pub(crate) wire_in: AtomicU64,
    pub(crate) segment_writes: AtomicU64,
    pub(crate) flushes: AtomicU64,
    pub(crate) discards: AtomicU64,
    pub(crate) gc_runs: AtomicU64,
    pub(crate) gc_moved_values: AtomicU64,
    pub(crate) gc_moved_bytes: AtomicU64,
    pub(crate) read_retries: AtomicU64,
    pub(crate) file_reads: AtomicU64,
    pub(crate) around_hits: AtomicU64,
}

/// Fields of [`Counters`].
pub(crate) const COUNTERS: usize = 19;

impl Counters {
    /// Every counter, in declaration order (the hand-over state's order).
    pub(crate) fn all(&self) -> [&AtomicU64; COUNTERS] {
        [
            &self.writes,
            &self.full,
            &self.reads,
            &self.misses,
            &self.removes,
            &self.failures,
            &self.bytes_written,
            &self.bytes_read,
            &self.wire_out,
            &self.wire_in,
            &self.segment_writes,
            &self.flushes,
            &self.discards,
            &self.gc_runs,
            &self.gc_moved_values,
            &self.gc_moved_bytes,
            &self.read_retries,
            &self.file_reads,
            &self.around_hits,
        ]
    }
}

pub(crate) fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

pub(crate) fn get(c: &AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

counters! {
    /// Counters of a [`DiskTier`] beyond [`TierStats`].
    #[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
    pub struct DiskStats {
        extra {
            /// The common tier counters.
            pub tier: TierStats,
            /// The backing store is a block device.
            pub block_device: bool,
            /// I/O bypasses the page cache (`O_DIRECT`).
            pub direct_io: bool,
            /// Discards (hole punching / `BLKDISCARD`) work on this store.
            pub discard_supported: bool,
        }
        /// Segment size.
        segment_bytes: Gauge(Bytes),
        /// Segments in the file.
        segments: Gauge(Objects),
        /// Free segments (discarding ones included).
        free_segments: Gauge(Objects),
        /// Bytes of live records (values and their headers).
        live_bytes: Gauge(Bytes),
        /// Bytes of dead records in non-free segments (reclaimable by the GC).
        dead_bytes: Gauge(Bytes),
        /// Unused tails of sealed segments.
        waste_bytes: Gauge(Bytes),
        /// Whole-segment writes.
        segment_writes: Counter(Events),
        /// Partial writes of the open segment (flushes).
        flushes: Counter(Events),
        /// Segments discarded.
        discards: Counter(Events),
        /// Segments collected by the GC.
        gc_runs: Counter(Events),
        /// Values the GC moved.
        gc_moved_values: Counter(Objects),
        /// Value bytes the GC moved.
        gc_moved_bytes: Counter(Bytes),
        /// Lock-free reads retried because their segment was freed meanwhile.
        read_retries: Counter(Events),
        /// Reads of values from the file (`pread`s; a merged read of a
        /// batched get counts once, the GC's reads not at all).
        file_reads: Counter(Events),
        /// Gets of sealed segments' values answered from the span that a
        /// single get read around its own (`around.rs`), with no read.
        around_hits: Counter(Events),
        /// Segment writes that failed and wait for a retry.
        failed_writes: Gauge(Events),
    }
}

impl DiskTier {
    /// Counters beyond [`TierStats`].
    pub fn disk_stats(&self) -> DiskStats {
        let tier = self.stats();
        let st = self.lock();
        let used: u64 = st
            .segs
            .iter()
            .filter(|m| !matches!(m.state, SegState::Free | SegState::Discarding))
            .map(|m| u64::from(m.used))
            .sum();
        let c = &self.counters;
        DiskStats {
            tier,
            block_device: self.block,
            direct_io: self.direct_io(),
            discard_supported: self.discard_ok.load(Ordering::Relaxed),
            segment_bytes: u64::from(self.seg_bytes),
            segments: u64::from(self.nsegs),
            free_segments: u64::try_from(st.free.len() + st.discarding).unwrap_or(u64::MAX),
            live_bytes: st.live_bytes,
            dead_bytes: used - st.live_bytes,
            waste_bytes: st.waste_bytes,
            segment_writes: get(&c.segment_writes),
            flushes: get(&c.flushes),
            discards: get(&c.discards),
            gc_runs: get(&c.gc_runs),
            gc_moved_values: get(&c.gc_moved_values),
            gc_moved_bytes: get(&c.gc_moved_bytes),
            read_retries: get(&c.read_retries),
            file_reads: get(&c.file_reads),
            around_hits: get(&c.around_hits),
            failed_writes: u64::try_from(st.failed.len()).unwrap_or(u64::MAX),
        }
    }

    pub(crate) fn count_put(&self, r: &Result<TierPut, TierError>, len: usize) {
        let c = &self.counters;
        match r {
            Ok(TierPut::Stored) => {
                add(&c.writes, 1);
                add(&c.bytes_written, u64::try_from(len).unwrap_or(u64::MAX));
            }
            Ok(TierPut::Full) => add(&c.full, 1),
            Err(_) => add(&c.failures, 1),
        }
    }
}
