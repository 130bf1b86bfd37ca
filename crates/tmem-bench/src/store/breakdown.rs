//! Where a put's CPU time goes: `Pool::put`'s stages, each timed alone over
//! the same pages, one thread.
//!
//! A put of a page scans it for one repeated word, compresses it,
//! checksums the compressed bytes, copies them into an allocator slot, and
//! inserts the entry into its shard's index (with the counters and the
//! shard lock). The first four run here alone, each over every page a put
//! gives it, into an allocator built as the daemon's (its pages in a memfd,
//! so the page faults of fresh slots are counted where a put takes them).
//! Then whole puts run into a store built the same way. "Index and the
//! rest" is the put less the four stages.
//!
//! Each stage repeats the corpus until it has run for [`MIN_STAGE`] and
//! over [`crate::zram::MIN_TIMED_BYTES`], and is timed with the thread's
//! own CPU clock (nanoseconds; the process tick of `/proc` is 10 ms, too
//! coarse for a stage of a few hundred milliseconds). The stages are
//! separate runs, so on a noisy machine their sum can exceed the put
//! ("index, rest" below zero): compare rows of one run, and runs.

use std::time::{Duration, Instant};

use anyhow::anyhow;
use tmem_core::alloc::{AllocConfig, ZsAlloc};
use tmem_core::codec::{same_filled, CompressBuf, COMPRESS_BUF_SIZE};
use tmem_core::{CodecConfig, Key, PAGE_SIZE};
use tmem_corpus::Corpus;

/// Least time a stage runs.
pub const MIN_STAGE: Duration = Duration::from_millis(200);

/// CPU µs per page of each stage of a put.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct PutBreakdown {
    /// Looking for one repeated word (every page).
    pub scan_us: f64,
    /// The codec's compression (every page that is not one repeated word).
    pub compress_us: f64,
    /// CRC32 of the compressed bytes.
    pub checksum_us: f64,
    /// An allocator slot, the copy into it, and the page faults of fresh spans.
    pub allocate_us: f64,
    /// The whole put.
    pub put_us: f64,
}

impl PutBreakdown {
    /// The put less the stages timed alone: the index, the counters, the
    /// shard lock and whatever else a put does.
    #[must_use]
    pub fn rest_us(&self) -> f64 {
        self.put_us - self.scan_us - self.compress_us - self.checksum_us - self.allocate_us
    }
}

/// This thread's CPU time.
fn thread_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(u64::try_from(t.tv_sec).unwrap_or(0), u32::try_from(t.tv_nsec).unwrap_or(0))
}

/// Runs `pass` until the stage has done enough; CPU µs per page put. A
/// pass handles `pages` pages of a corpus of `corpus_pages`: a stage that
/// only some pages reach costs a put its time spread over all of them.
fn stage(pages: usize, corpus_pages: usize, mut pass: impl FnMut(usize) -> anyhow::Result<()>) -> anyhow::Result<f64> {
    if pages == 0 {
        return Ok(0.0);
    }
    let bytes = (pages * PAGE_SIZE) as u64;
    let (start, cpu) = (Instant::now(), thread_cpu());
    let mut passes = 0;
    while passes == 0 || start.elapsed() < MIN_STAGE || passes as u64 * bytes < crate::zram::MIN_TIMED_BYTES {
        pass(passes)?;
        passes += 1;
    }
    Ok((thread_cpu() - cpu).as_secs_f64() * 1e6 / (passes * corpus_pages) as f64)
}

/// One run of every stage over `corpus`, putting with `codec` into the
/// bench's stores (`super::build_store`; incompressible pages stored raw).
pub fn measure(corpus: &Corpus, codec: &CodecConfig) -> anyhow::Result<PutBreakdown> {
    let (policy, store) = (super::store_policy(), super::build_store(codec)?);
    let codec = codec.build()?;
    let pages: Vec<&[u8; PAGE_SIZE]> = corpus.pages().collect();
    let mut seen = 0u64;
    let n = pages.len();
    let scan_us = stage(n, n, |_| {
        for p in &pages {
            seen = seen.wrapping_add(same_filled(p).unwrap_or(1));
        }
        Ok(())
    })?;
    std::hint::black_box(seen);

    // What each page that is not one repeated word stores: its compressed
    // bytes, or the page itself where they are not smaller enough. Made
    // untimed, for the stages after compression.
    let singles: Vec<&[u8; PAGE_SIZE]> = pages.iter().copied().filter(|p| same_filled(p).is_none()).collect();
    let mut buf: Box<CompressBuf> = Box::new([0u8; COMPRESS_BUF_SIZE]);
    let max = usize::try_from(policy.max_compressed_size).unwrap_or(PAGE_SIZE);
    let mut stored: Vec<u8> = Vec::new();
    let mut spans: Vec<(usize, usize)> = Vec::with_capacity(singles.len());
    for p in &singles {
        let n = codec.compress(p, &mut buf).map_err(|e| anyhow!("compress: {e}"))?;
        let kept: &[u8] = if n <= max && n < PAGE_SIZE { &buf[..n] } else { &p[..] };
        spans.push((stored.len(), kept.len()));
        stored.extend_from_slice(kept);
    }
    let mut sizes = 0usize;
    let compress_us = stage(singles.len(), n, |_| {
        for p in &singles {
            sizes += codec.compress(p, &mut buf).map_err(|e| anyhow!("compress: {e}"))?;
        }
        Ok(())
    })?;
    std::hint::black_box(sizes);
    let objects: Vec<&[u8]> = spans.iter().map(|&(at, len)| &stored[at..at + len]).collect();

    let mut sum = 0u32;
    let checksum_us = stage(objects.len(), n, |_| {
        for o in &objects {
            sum ^= crc32fast::hash(o);
        }
        Ok(())
    })?;
    std::hint::black_box(sum);

    let alloc = ZsAlloc::shared(AllocConfig::default()).map_err(|e| anyhow!("allocator: {e}"))?;
    let allocate_us = stage(objects.len(), n, |_| {
        for o in &objects {
            alloc.alloc_write(o).map_err(|e| anyhow!("allocate: {e}"))?;
        }
        Ok(())
    })?;
    drop(alloc);

    let pool = store.create_pool(tmem_core::PoolConfig::persistent());
    let put_us = stage(n, n, |pass| {
        for (i, p) in pages.iter().enumerate() {
            super::expect_stored(pool.put(Key::new(0, (pass * n + i) as u64), p), i)?;
        }
        Ok(())
    })?;
    Ok(PutBreakdown { scan_us, compress_us, checksum_us, allocate_us, put_us })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_stage_is_measured_on_a_builtin_corpus() {
        let corpus = Corpus::builtin().into_iter().next().expect("a built-in corpus");
        let codec = CodecConfig::parse("lz4").expect("lz4");
        let b = measure(&corpus, &codec).expect("measured");
        for (stage, us) in [
            ("scan", b.scan_us),
            ("compress", b.compress_us),
            ("checksum", b.checksum_us),
            ("allocate", b.allocate_us),
            ("put", b.put_us),
        ] {
            assert!(us.is_finite() && us > 0.0, "{stage}: {us} us per page");
        }
        let sum = b.scan_us + b.compress_us + b.checksum_us + b.allocate_us;
        assert!((b.rest_us() - (b.put_us - sum)).abs() < 1e-9);
    }
}
