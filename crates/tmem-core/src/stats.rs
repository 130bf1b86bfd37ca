//! Counters. Names follow zswap, frontswap and zram where the meaning is the
//! same. Hot counters live in each shard and change under the shard lock, so
//! put and get touch no shared cache line; rare events are pool-wide atomics.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::alloc::AllocStats;
use crate::policy::PolicyConfig;
use crate::{PoolKind, PAGE_SIZE};

/// Counters kept per shard, under its lock.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ShardCounters {
    /// Pages held, same-filled and incompressible included (zswap `stored_pages`).
    pub stored_pages: u64,
    /// Pages held as one repeated word, using no pool memory (zswap `same_filled_pages`, zram `same_pages`).
    pub same_filled_pages: u64,
    /// Pages held uncompressed because they compress poorly (zswap `stored_incompressible_pages`, zram `huge_pages`).
    pub stored_incompressible_pages: u64,
    /// Bytes of stored objects, before class rounding (zram `compr_data_size`).
    pub compr_data_size: u64,
    /// Puts that stored the page (frontswap `succ_stores`).
    pub succ_puts: u64,
    /// Gets that returned a page (frontswap `loads`).
    pub succ_gets: u64,
    /// Gets that missed (frontswap `failed loads`).
    pub failed_gets: u64,
    /// Pages removed by flush_page/flush_object (frontswap `invalidates`).
    pub flushes: u64,
    /// Ephemeral pages dropped to make room.
    pub evicted_pages: u64,
    /// Pages compressed and stored.
    pub compressions: u64,
    /// Pages decompressed by successful gets.
    pub decompressions: u64,
    /// Pages held in lower tiers.
    pub tier_pages: u64,
    /// Pages moved from the pool to a lower tier (zswap `written_back_pages`).
    pub written_back_pages: u64,
    /// Gets served from a lower tier.
    pub tier_gets: u64,
    /// Incompressible pages sent straight to a lower tier.
    pub incompressible_to_tier: u64,
}

/// Rare events, counted pool-wide.
#[derive(Debug, Default)]
pub(crate) struct PoolEvents {
    /// Puts refused because the store was at its limit (zswap `pool_limit_hit`).
    pub pool_limit_hit: AtomicU64,
    /// Puts refused because the page compressed to more than `max_compressed_size` (zswap `reject_compress_poor`).
    pub reject_compress_poor: AtomicU64,
    /// Puts refused because the compressor failed (zswap `reject_compress_fail`).
    pub reject_compress_fail: AtomicU64,
    /// Puts refused because the allocator could not get memory (zswap `reject_alloc_fail`).
    pub reject_alloc_fail: AtomicU64,
    /// Puts refused because the store was frozen (zcache `freeze`).
    pub reject_frozen: AtomicU64,
    /// Gets whose stored data failed its checksum or did not decode (zswap `decompress_fail`).
    pub decompress_fail: AtomicU64,
    /// Compressions whose result was then refused as poor.
    pub compressions_rejected: AtomicU64,
    /// Gets whose page a lower tier could not return (down, lost) or that failed authentication.
    pub tier_get_fail: AtomicU64,
    /// Writeback batches a tier refused or failed.
    pub tier_put_fail: AtomicU64,
}

impl PoolEvents {
    pub fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// Snapshot of one pool's counters, or of the sum over pools.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PoolStats {
    /// Pool id (absent for totals).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pool_id: Option<u32>,
    /// Persistent or ephemeral (absent for totals).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kind: Option<PoolKind>,
    /// Pages held, same-filled and incompressible included.
    pub stored_pages: u64,
    /// Pages held as one repeated word (no pool memory).
    pub same_filled_pages: u64,
    /// Pages held uncompressed because they compress poorly.
    pub stored_incompressible_pages: u64,
    /// Uncompressed bytes of the pages held in the pool (zram `orig_data_size`; lower tiers excluded).
    pub orig_data_size: u64,
    /// Bytes of stored objects before class rounding (zram `compr_data_size`).
    pub compr_data_size: u64,
    /// Put attempts.
    pub puts: u64,
    /// Puts that stored the page.
    pub succ_puts: u64,
    /// Gets that returned a page.
    pub succ_gets: u64,
    /// Gets that missed.
    pub failed_gets: u64,
    /// Pages removed by flushes.
    pub flushes: u64,
    /// Ephemeral pages dropped under pressure.
    pub evicted_pages: u64,
    /// Puts refused at the pool limit.
    pub pool_limit_hit: u64,
    /// Puts refused as poorly compressible.
    pub reject_compress_poor: u64,
    /// Puts refused because the compressor failed.
    pub reject_compress_fail: u64,
    /// Puts refused for lack of memory.
    pub reject_alloc_fail: u64,
    /// Puts refused while frozen.
    pub reject_frozen: u64,
    /// Pages compressed.
    pub compressions: u64,
    /// Pages decompressed.
    pub decompressions: u64,
    /// Gets that found corrupt data.
    pub decompress_fail: u64,
    /// Pages held in lower tiers.
    pub tier_pages: u64,
    /// Pages written back to lower tiers.
    pub written_back_pages: u64,
    /// Gets served from lower tiers.
    pub tier_gets: u64,
    /// Gets a lower tier could not serve, or whose value failed authentication.
    pub tier_get_fail: u64,
    /// Pages a lower tier refused or failed to take.
    pub tier_put_fail: u64,
    /// Incompressible pages sent straight to a lower tier.
    pub incompressible_to_tier: u64,
}

impl PoolStats {
    pub(crate) fn from_parts(pool_id: u32, kind: PoolKind, c: &ShardCounters, ev: &PoolEvents) -> Self {
        let r = Ordering::Relaxed;
        let rejects = ev.pool_limit_hit.load(r)
            + ev.reject_compress_poor.load(r)
            + ev.reject_compress_fail.load(r)
            + ev.reject_alloc_fail.load(r)
            + ev.reject_frozen.load(r);
        Self {
            pool_id: Some(pool_id),
            kind: Some(kind),
            stored_pages: c.stored_pages,
            same_filled_pages: c.same_filled_pages,
            stored_incompressible_pages: c.stored_incompressible_pages,
            orig_data_size: (c.stored_pages - c.tier_pages) * PAGE_SIZE as u64,
            compr_data_size: c.compr_data_size,
            puts: c.succ_puts + rejects,
            succ_puts: c.succ_puts,
            succ_gets: c.succ_gets,
            failed_gets: c.failed_gets,
            flushes: c.flushes,
            evicted_pages: c.evicted_pages,
            pool_limit_hit: ev.pool_limit_hit.load(r),
            reject_compress_poor: ev.reject_compress_poor.load(r),
            reject_compress_fail: ev.reject_compress_fail.load(r),
            reject_alloc_fail: ev.reject_alloc_fail.load(r),
            reject_frozen: ev.reject_frozen.load(r),
            compressions: c.compressions + ev.compressions_rejected.load(r),
            decompressions: c.decompressions,
            decompress_fail: ev.decompress_fail.load(r),
            tier_pages: c.tier_pages,
            written_back_pages: c.written_back_pages,
            tier_gets: c.tier_gets,
            tier_get_fail: ev.tier_get_fail.load(r),
            tier_put_fail: ev.tier_put_fail.load(r),
            incompressible_to_tier: c.incompressible_to_tier,
        }
    }

    /// Adds `o` into `self` (ids and kinds are dropped).
    pub fn add(&mut self, o: &PoolStats) {
        self.pool_id = None;
        self.kind = None;
        self.stored_pages += o.stored_pages;
        self.same_filled_pages += o.same_filled_pages;
        self.stored_incompressible_pages += o.stored_incompressible_pages;
        self.orig_data_size += o.orig_data_size;
        self.compr_data_size += o.compr_data_size;
        self.puts += o.puts;
        self.succ_puts += o.succ_puts;
        self.succ_gets += o.succ_gets;
        self.failed_gets += o.failed_gets;
        self.flushes += o.flushes;
        self.evicted_pages += o.evicted_pages;
        self.pool_limit_hit += o.pool_limit_hit;
        self.reject_compress_poor += o.reject_compress_poor;
        self.reject_compress_fail += o.reject_compress_fail;
        self.reject_alloc_fail += o.reject_alloc_fail;
        self.reject_frozen += o.reject_frozen;
        self.compressions += o.compressions;
        self.decompressions += o.decompressions;
        self.decompress_fail += o.decompress_fail;
        self.tier_pages += o.tier_pages;
        self.written_back_pages += o.written_back_pages;
        self.tier_gets += o.tier_gets;
        self.tier_get_fail += o.tier_get_fail;
        self.tier_put_fail += o.tier_put_fail;
        self.incompressible_to_tier += o.incompressible_to_tier;
    }
}

/// Snapshot of a whole store.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Stats {
    /// All memory the store holds: spans plus every piece of metadata (zram `mem_used_total`).
    pub mem_used_total: u64,
    /// Same figure under zswap's name.
    pub pool_total_size: u64,
    /// Index, allocator and codec metadata included in `mem_used_total`.
    pub metadata_bytes: u64,
    /// Limit now in force (`u64::MAX` when unlimited).
    pub pool_limit_bytes: u64,
    /// `orig_data_size / mem_used_total`.
    pub ratio: f64,
    /// Codec used for new puts.
    pub codec: String,
    /// Automatic dictionary training: `waiting`, `training`, `trained: …` or
    /// `failed: …`; absent when not configured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dictionary: Option<String>,
    /// Sum over pools.
    pub total: PoolStats,
    /// Allocator counters (compaction included).
    pub alloc: AllocStats,
    /// Policy knobs in force.
    pub policy: PolicyConfig,
    /// Counters of the lower tiers of all pools.
    #[serde(default)]
    pub tiers: Vec<tmem_tier::TierStats>,
    /// Per-pool counters.
    pub pools: Vec<PoolStats>,
}
