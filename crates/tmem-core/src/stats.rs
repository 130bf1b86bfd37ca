//! Counters. Names follow zswap, frontswap and zram where the meaning is the
//! same. Hot counters live in each shard and change under the shard lock, so
//! put and get touch no shared cache line; rare events are pool-wide atomics.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::alloc::AllocStats;
use crate::policy::PolicyConfig;
use tmem_counters::{counters, Counters as _};

use crate::shard::MAX_CODECS;
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
    /// Of those, dropped for a persistent page (swap pressure).
    pub evicted_for_persistent: u64,
    /// Of those, dropped for another ephemeral page (cache churn).
    pub evicted_for_ephemeral: u64,
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
    /// Gets decoded by the codec background recompression moves pages to:
    /// its back-off signal (not handed over, not shown).
    pub recompressed_reads: u64,
    /// Compressed pages held in the pool, by codec id.
    pub codec_pages: [u64; MAX_CODECS],
    /// Bytes of those pages' objects, by codec id.
    pub codec_bytes: [u64; MAX_CODECS],
    /// Pages held in groups (live members; also in `stored_pages`).
    pub group_pages: u64,
    /// Groups held.
    pub groups: u64,
    /// Bytes of the groups' blocks (also in `compr_data_size`).
    pub group_bytes: u64,
    /// Slots of groups whose page was overwritten or flushed (tombstones).
    pub group_dead_pages: u64,
    /// Grouped pages read from a decoded block kept in the shard's cache.
    pub group_cache_hits: u64,
    /// Grouped pages whose block had to be decoded.
    pub group_cache_misses: u64,
    /// Grouped pages by the codec of their group.
    pub group_codec_pages: [u64; MAX_CODECS],
    /// Block bytes of groups, by codec.
    pub group_codec_bytes: [u64; MAX_CODECS],
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
    /// Pages recompressed with the recompression codec.
    pub recompressed_pages: AtomicU64,
    /// Object bytes recompression saved, summed when each page was recompressed.
    pub recompress_saved_bytes: AtomicU64,
    /// Pages recompression tried and kept as they were (not smaller enough).
    pub recompress_kept: AtomicU64,
    /// Recompressions dropped because the page changed meanwhile.
    pub recompress_raced: AtomicU64,
    /// Pages moved into groups.
    pub pages_grouped: AtomicU64,
    /// Groups rewritten from their live pages (or back to single pages).
    pub group_rewrites: AtomicU64,
    /// Cold pages left single because their window did not compress enough better together.
    pub group_kept: AtomicU64,
    /// Groupings and rewrites dropped because a page changed meanwhile.
    pub group_raced: AtomicU64,
}

impl PoolEvents {
    pub fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}

counters! {
    /// Snapshot of one pool's counters, or of the sum over pools.
    #[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
    pub struct PoolStats {
        extra {
            /// Pool id (absent for totals).
            #[serde(skip_serializing_if = "Option::is_none")]
            pub pool_id: Option<u32>,
            /// Persistent or ephemeral (absent for totals).
            #[serde(skip_serializing_if = "Option::is_none")]
            pub kind: Option<PoolKind>,
        }
        /// Pages held, same-filled and incompressible included.
        stored_pages: Gauge(Pages),
        /// Pages held as one repeated word (no pool memory).
        same_filled_pages: Gauge(Pages),
        /// Pages held uncompressed because they compress poorly.
        stored_incompressible_pages: Gauge(Pages),
        /// Uncompressed bytes of the pages held in the pool (zram `orig_data_size`; lower tiers excluded).
        orig_data_size: Gauge(Bytes),
        /// Bytes of stored objects before class rounding (zram `compr_data_size`).
        compr_data_size: Gauge(Bytes),
        /// Put attempts.
        puts: Counter(Events),
        /// Puts that stored the page.
        succ_puts: Counter(Events),
        /// Gets that returned a page.
        succ_gets: Counter(Events),
        /// Gets that missed.
        failed_gets: Counter(Events),
        /// Pages removed by flushes.
        flushes: Counter(Pages),
        /// Ephemeral pages dropped under pressure.
        evicted_pages: Counter(Pages),
        /// Ephemeral pages dropped to make room for a persistent (swap) page.
        evicted_for_persistent: Counter(Pages),
        /// Ephemeral pages dropped to make room for another ephemeral page.
        evicted_for_ephemeral: Counter(Pages),
        /// Puts refused at the pool limit.
        pool_limit_hit: Counter(Events),
        /// Puts refused as poorly compressible.
        reject_compress_poor: Counter(Events),
        /// Puts refused because the compressor failed.
        reject_compress_fail: Counter(Events),
        /// Puts refused for lack of memory.
        reject_alloc_fail: Counter(Events),
        /// Puts refused while frozen.
        reject_frozen: Counter(Events),
        /// Pages compressed.
        compressions: Counter(Pages),
        /// Pages decompressed.
        decompressions: Counter(Pages),
        /// Gets that found corrupt data.
        decompress_fail: Counter(Events),
        /// Pages held in lower tiers.
        tier_pages: Gauge(Pages),
        /// Pages written back to lower tiers.
        written_back_pages: Counter(Pages),
        /// Gets served from lower tiers.
        tier_gets: Counter(Events),
        /// Gets a lower tier could not serve, or whose value failed authentication.
        tier_get_fail: Counter(Events),
        /// Pages a lower tier refused or failed to take.
        tier_put_fail: Counter(Pages),
        /// Incompressible pages sent straight to a lower tier.
        incompressible_to_tier: Counter(Pages),
        /// Cold pages recompressed in the background with the recompression codec.
        recompressed_pages: Counter(Pages),
        /// Object bytes saved by recompression, summed when each page was recompressed.
        recompress_saved_bytes: Counter(Bytes),
        /// Pages recompression tried and kept (the other codec was not smaller enough).
        recompress_kept: Counter(Pages),
        /// Recompressions dropped because the page changed meanwhile.
        recompress_raced: Counter(Events),
        /// Pages held in groups (cold pages compressed together; in `stored_pages`).
        group_pages: Gauge(Pages),
        /// Groups held.
        groups: Gauge(Objects),
        /// Bytes of the groups' compressed blocks (in `compr_data_size`).
        group_bytes: Gauge(Bytes),
        /// Pages of groups overwritten or flushed since (tombstones, until the group is rewritten).
        group_dead_pages: Gauge(Pages),
        /// Pages moved into groups.
        pages_grouped: Counter(Pages),
        /// Groups rewritten from their live pages (or back to single pages).
        group_rewrites: Counter(Events),
        /// Cold pages left single because their window did not compress enough better together.
        group_kept: Counter(Pages),
        /// Groupings and rewrites dropped because a page changed meanwhile.
        group_raced: Counter(Events),
        /// Grouped pages read from a decoded block kept in memory.
        group_cache_hits: Counter(Events),
        /// Grouped pages whose block had to be decoded.
        group_cache_misses: Counter(Events),
    }
}

/// What one codec holds in the pool.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CodecUsage {
    /// Codec name, e.g. `lz4`, `zstd-3+dict`.
    pub codec: String,
    /// Pages compressed with it.
    pub pages: u64,
    /// Bytes of their objects, before class rounding.
    pub bytes: u64,
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
            evicted_for_persistent: c.evicted_for_persistent,
            evicted_for_ephemeral: c.evicted_for_ephemeral,
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
            recompressed_pages: ev.recompressed_pages.load(r),
            recompress_saved_bytes: ev.recompress_saved_bytes.load(r),
            recompress_kept: ev.recompress_kept.load(r),
            recompress_raced: ev.recompress_raced.load(r),
            group_pages: c.group_pages,
            groups: c.groups,
            group_bytes: c.group_bytes,
            group_dead_pages: c.group_dead_pages,
            pages_grouped: ev.pages_grouped.load(r),
            group_rewrites: ev.group_rewrites.load(r),
            group_kept: ev.group_kept.load(r),
            group_raced: ev.group_raced.load(r),
            group_cache_hits: c.group_cache_hits,
            group_cache_misses: c.group_cache_misses,
        }
    }

    /// Adds `o` into `self` (ids and kinds are dropped).
    pub fn add(&mut self, o: &PoolStats) {
        self.pool_id = None;
        self.kind = None;
        self.add_counters(o);
    }
}

counters! {
    /// Snapshot of a whole store.
    #[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    pub struct Stats {
        extra {
            /// `orig_data_size / mem_used_total`.
            pub ratio: f64,
            /// Codec used for new puts.
            pub codec: String,
            /// Automatic dictionary training: `waiting`, `training`, `trained: …`,
            /// `retrained …` (a newer dictionary from the grown pool), `trained;
            /// kept dictionary N: …` or `failed: …`; absent when not configured.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub dictionary: Option<String>,
            /// Background recompression: its codec and state; absent when off.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub recompression: Option<String>,
            /// Grouping of cold pages: its codec and state; absent when off.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub grouping: Option<String>,
            /// Compressed pages held in the pool and their bytes, by codec;
            /// pages held in groups are rows of their own (`zstd-9+dict groups`).
            #[serde(default)]
            pub codecs: Vec<CodecUsage>,
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
        /// All memory the store holds: spans plus every piece of metadata (zram `mem_used_total`).
        mem_used_total: Gauge(Bytes),
        /// Same figure under zswap's name.
        pool_total_size: Gauge(Bytes),
        /// Index, allocator and codec metadata included in `mem_used_total`.
        metadata_bytes: Gauge(Bytes),
        /// Limit now in force (`u64::MAX` when unlimited).
        pool_limit_bytes: Max(Bytes),
        /// Writebacks to lower tiers that a put (or the block layer's retry
        /// of a refused one) ran itself to make room, its write waiting on
        /// tier I/O: the background writeback had not kept up. Counted
        /// since this process built or adopted the store.
        writeback_waits: Counter(Events),
    }
}
