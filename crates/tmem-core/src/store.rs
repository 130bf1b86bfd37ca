//! The tmem page store: pools of pages addressed by `(pool, object, index)`.
//!
//! # Locking
//!
//! * Each pool has [`default_shards`] (or configured) shard mutexes; a key's shard is fixed by its
//!   hash. put/get/flush of one key take exactly one shard lock.
//! * Lock order: docs/ARCHITECTURE.md, "Lock order" (`tmem_lock::Rank`):
//!   compaction, pools, then per key the tier-put locks, the shard, the
//!   allocator's class and arena.
//! * Compression runs before any lock; decompression runs under the shard
//!   lock, which is what keeps compaction from moving the object meanwhile.
//! * Grouping (`grouping.rs`) adds no lock: a store that groups places each
//!   window of 16 indexes of an object in one shard, and a group, its
//!   block's chunks and the shard's cache of decoded blocks are that
//!   shard's, under its lock (`Rank::Shard`, then `Rank::AllocClass` for
//!   the chunks, as for any page).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use tmem_lock::{Mutex, MutexGuard, Rank, RwLock};

use crate::alloc::{AllocConfig, Loc, ZsAlloc};
use crate::codec::CompressBuf;
use crate::codec::{fill_page, same_filled, Codec, CodecConfig, CodecError, COMPRESS_BUF_SIZE};
use crate::policy::{Policy, PolicyConfig, PolicyError};
use crate::shard::{
    hash_key, Entry, Shard, F_GROUP, F_HOT, F_INCOMPRESSIBLE, F_KEEP, F_REFERENCED, F_SAME, F_SEEN, F_TIER, F_WB,
    MAX_CODECS,
};
use crate::stats::{CodecUsage, PoolEvents, PoolStats, ShardCounters, Stats};
use crate::{Key, PoolId, PAGE_SIZE};

/// Shards per pool: enough that threads rarely meet on one lock, few enough
/// that per-shard slack stays small: 4 per CPU, a power of two in 8..=256.
pub fn default_shards() -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    (4 * cpus).next_power_of_two().clamp(8, 256)
}
/// Codec id of the raw (uncompressed) codec, always registered.
pub const RAW_CODEC: u8 = 0;
/// Compaction does not run automatically below this much span memory.
const AUTO_COMPACT_MIN_BYTES: u64 = 4 << 20;
/// After making room failed, puts are refused this long before trying again.
const ROOM_RETRY_NS: u64 = 5_000_000;
/// Pages evicted from one shard per visit when making room.
const EVICT_BATCH: usize = 32;

/// Whether a put does the slow work it makes due (making room, compaction,
/// tier removals) itself, or leaves it to [`Pool::maintain`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Work {
    Inline,
    Deferred,
}

mod config;
mod dictionary;
mod grouping;
mod handover;
mod outcome;
mod pool;
mod recompress;
mod shared;
mod tiering;
mod worker;
pub use config::{Eviction, PoolConfig, PoolKind, StoreConfig};
pub use dictionary::{
    DictTraining, DictionaryCodec, Retraining, TrainedDictionary, MAX_DICTIONARIES, MIN_TRAINING_PAGES, RETRAIN_GROWTH,
    TRAINING_TRIES,
};
pub use grouping::{GroupConfig, Grouper, Grouping};
pub use handover::{HandoverSummary, ImportTiers, Snapshot, HANDOVER_VERSION};
pub use outcome::{GetOutcome, PutOutcome, Reject, StoreError};
use pool::PaddedShard;
pub use pool::Pool;
pub use recompress::{RecompressConfig, Recompression, Recompressor, MAX_STRIDE};
use shared::Shared;
pub use tiering::{TierChain, TierHold, WritebackReport, WritebackWorker};

/// The page store.
pub struct Store {
    shared: Arc<Shared>,
    shards: usize,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").finish_non_exhaustive()
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // Break the Pool -> Shared -> pools cycle.
        self.shared.pools.write().clear();
    }
}

impl Store {
    /// Creates a pool and returns it.
    pub fn create_pool(&self, cfg: PoolConfig) -> Arc<Pool> {
        self.create_pool_inner(cfg, None, true)
    }

    /// Creates a pool whose pages move down `chain` when the store is full
    /// (and incompressible pages go there directly).
    pub fn create_pool_with_tiers(&self, cfg: PoolConfig, chain: TierChain) -> Arc<Pool> {
        self.create_pool_inner(cfg, Some(chain), true)
    }

    /// Creates a pool; `fresh`: whatever its tiers hold under its id is
    /// stale (not so for a pool imported with its tiers).
    fn create_pool_inner(&self, cfg: PoolConfig, chain: Option<TierChain>, fresh: bool) -> Arc<Pool> {
        let mut pools = self.shared.pools.write();
        let id = PoolId::try_from(pools.len()).expect("fewer than 2^32 pools");
        let pool = Arc::new(Pool {
            id,
            cfg,
            shards: (0..self.shards).map(|_| PaddedShard(Mutex::new(Rank::Shard, Shard::new()))).collect(),
            events: PoolEvents::default(),
            destroyed: AtomicBool::new(false),
            shared: Arc::clone(&self.shared),
            chain,
            wb_cursor: AtomicUsize::new(0),
            removals: tiering::TierRemovals::default(),
            removals_due: AtomicBool::new(false),
            compaction_due: AtomicBool::new(false),
            tier_puts: tiering::TierPutLocks::new(self.shards),
        });
        if let Some(c) = pool.chain.as_ref().filter(|_| fresh) {
            // Whatever an earlier pool with this id left in the tiers is stale.
            c.clear_pool(id);
        }
        pools.push(Some(Arc::clone(&pool)));
        pool
    }

    /// Looks a pool up by id.
    pub fn pool(&self, id: PoolId) -> Result<Arc<Pool>, StoreError> {
        let pools = self.shared.pools.read();
        match pools.get(id as usize) {
            Some(Some(p)) => Ok(Arc::clone(p)),
            Some(None) => Err(StoreError::PoolDestroyed(id)),
            None => Err(StoreError::NoSuchPool(id)),
        }
    }

    /// Ids of live pools.
    pub fn pool_ids(&self) -> Vec<PoolId> {
        self.shared.pools_snapshot().iter().map(|p| p.id).collect()
    }

    /// Frees every page of the pool and removes it.
    pub fn destroy_pool(&self, id: PoolId) -> Result<(), StoreError> {
        let pool = {
            let mut pools = self.shared.pools.write();
            match pools.get_mut(id as usize) {
                Some(slot @ Some(_)) => slot.take().expect("checked Some"),
                Some(None) => return Err(StoreError::PoolDestroyed(id)),
                None => return Err(StoreError::NoSuchPool(id)),
            }
        };
        pool.destroy();
        self.shared.maybe_compact();
        Ok(())
    }

    /// Puts a page into pool `id`; see [`Pool::put`].
    pub fn put(&self, id: PoolId, key: Key, page: &[u8; PAGE_SIZE]) -> Result<PutOutcome, StoreError> {
        self.pool(id)?.put(key, page)
    }

    /// Gets a page from pool `id`; see [`Pool::get`].
    pub fn get(&self, id: PoolId, key: Key, out: &mut [u8; PAGE_SIZE]) -> Result<GetOutcome, StoreError> {
        self.pool(id)?.get(key, out)
    }

    /// Flushes one page of pool `id`.
    pub fn flush_page(&self, id: PoolId, key: Key) -> Result<bool, StoreError> {
        self.pool(id)?.flush_page(key)
    }

    /// Flushes one object of pool `id`.
    pub fn flush_object(&self, id: PoolId, object: u64) -> Result<u64, StoreError> {
        self.pool(id)?.flush_object(object)
    }

    /// Compacts now; returns pages released.
    pub fn compact(&self) -> u64 {
        self.shared.compact()
    }

    /// Sends the queued removals of stale tier copies now. Puts queue them
    /// (and send them in batches); the writeback worker sends the rest every
    /// period.
    pub fn send_tier_removals(&self) {
        self.shared.send_tier_removals();
    }

    /// Writes back from pools with tiers until usage is below the accept
    /// threshold (or nothing more can move); returns whether it got there.
    pub fn write_back_now(&self) -> bool {
        self.shared.write_back_until(self.shared.policy.accept_bytes())
    }

    /// Starts the background writeback thread (stopped when dropped).
    pub fn start_writeback(&self, period: std::time::Duration) -> WritebackWorker {
        let shared = Arc::clone(&self.shared);
        worker::Worker::start("tmem-writeback", period, 0, move |_| tiering::writeback_job(&shared))
    }

    /// The live policy.
    pub fn policy(&self) -> &Policy {
        &self.shared.policy
    }

    /// Sets one policy knob from text (`tmem set`), then applies its effect:
    /// a lower limit makes room at once by dropping ephemeral pages.
    pub fn set_policy(&self, key: &str, value: &str) -> Result<(), StoreError> {
        self.shared.policy.set(key, value)?;
        self.shared.maybe_compact();
        Ok(())
    }

    /// Registers a codec and returns its id; pages keep the id they were
    /// compressed with, so registered codecs are never removed.
    pub fn register_codec(&self, cfg: &CodecConfig) -> Result<u8, StoreError> {
        self.shared.register_codec(cfg)
    }

    /// Makes codec `id` the one new puts use.
    pub fn set_codec(&self, id: u8) -> Result<(), StoreError> {
        self.shared.set_codec(id)
    }

    /// Registers `cfg` and switches to it.
    pub fn use_codec(&self, cfg: &CodecConfig) -> Result<u8, StoreError> {
        let id = self.register_codec(cfg)?;
        self.set_codec(id)?;
        Ok(id)
    }

    /// Name of the codec new puts use.
    pub fn codec_name(&self) -> String {
        let id = self.shared.current_codec.load(Ordering::Relaxed);
        self.shared.codec(id).map(|c| c.name().to_owned()).unwrap_or_default()
    }

    /// All memory the store holds, metadata included (zram `mem_used_total`).
    pub fn mem_used_total(&self) -> u64 {
        self.shared.total_bytes()
    }

    /// Compressed pages and bytes per codec, over every pool; codecs that
    /// hold nothing are left out. Pages held in groups come after the single
    /// pages, one row per block codec, named `CODEC groups` (their bytes are
    /// the blocks', tombstones included).
    pub fn codec_usage(&self) -> Vec<CodecUsage> {
        let mut usage = [([0u64; MAX_CODECS], [0u64; MAX_CODECS]); 2];
        for p in self.shared.pools_snapshot() {
            for (sum, (pp, pb)) in usage.iter_mut().zip(p.codec_usage()) {
                for i in 0..MAX_CODECS {
                    sum.0[i] += pp[i];
                    sum.1[i] += pb[i];
                }
            }
        }
        let mut rows = Vec::new();
        for (grouped, (pages, bytes)) in usage.iter().enumerate() {
            rows.extend((0..MAX_CODECS).filter(|&i| pages[i] > 0 || bytes[i] > 0).filter_map(|i| {
                let id = u8::try_from(i).ok()?;
                let name = self.shared.codec(id).ok()?.name();
                let codec = if grouped == 1 { format!("{name} groups") } else { name.to_owned() };
                Some(CodecUsage { codec, pages: pages[i], bytes: bytes[i] })
            }));
        }
        rows
    }

    /// Snapshot of every counter.
    pub fn stats(&self) -> Stats {
        let pools: Vec<PoolStats> = self.shared.pools_snapshot().iter().map(|p| p.stats()).collect();
        let mut total = PoolStats::default();
        for p in &pools {
            total.add(p);
        }
        let alloc = self.shared.alloc.stats();
        let mem = self.shared.total_bytes();
        // Two reads of counters that puts move meanwhile: either may be the larger.
        let metadata_bytes = mem.saturating_sub(alloc.span_bytes);
        Stats {
            mem_used_total: mem,
            pool_total_size: mem,
            metadata_bytes,
            pool_limit_bytes: self.shared.policy.limit_bytes(),
            writeback_waits: self.shared.writeback_waits.load(std::sync::atomic::Ordering::Relaxed),
            ratio: if mem == 0 { 0.0 } else { total.orig_data_size as f64 / mem as f64 },
            codec: self.codec_name(),
            dictionary: self.shared.dictionary_status(),
            recompression: self.shared.recompress_status(),
            grouping: self.shared.group_status(),
            codecs: self.codec_usage(),
            total,
            alloc,
            policy: self.shared.policy.config(),
            tiers: tiering::tier_stats(&self.shared.pools_snapshot()),
            pools,
        }
    }
}

#[cfg(test)]
mod tests;
