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

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use tmem_lock::{Mutex, MutexGuard, Rank, RwLock};

use crate::alloc::{AllocConfig, Loc, ZsAlloc};
use crate::codec::{fill_page, same_filled, Codec, CodecConfig, CodecError, COMPRESS_BUF_SIZE};
use crate::policy::{Policy, PolicyConfig, PolicyError};
use crate::shard::{hash_key, Entry, Shard, F_INCOMPRESSIBLE, F_REFERENCED, F_SAME, F_TIER, MAX_CODECS};
use crate::stats::{PoolEvents, PoolStats, ShardCounters, Stats};
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

/// Kind of pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PoolKind {
    /// frontswap semantics: a stored page stays until flushed or taken.
    Persistent,
    /// cleancache semantics: the store may drop pages, oldest first.
    Ephemeral,
}

/// How to create a pool.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PoolConfig {
    /// Persistent or ephemeral.
    pub kind: PoolKind,
    /// A successful get removes the page (frontswap's exclusive loads).
    pub exclusive_gets: bool,
    /// A refused put leaves an older copy of the key in place. Off for
    /// frontswap/cleancache, where the caller then stores the page elsewhere
    /// and a stale copy here would shadow it; on for a block device, which
    /// is the page's only home and must not lose the rest of a page on a
    /// failed partial write.
    #[serde(default)]
    pub reject_keeps_old: bool,
}

impl PoolConfig {
    /// A persistent pool with shared (non-exclusive) gets.
    pub fn persistent() -> Self {
        Self { kind: PoolKind::Persistent, exclusive_gets: false, reject_keeps_old: false }
    }

    /// An ephemeral pool with shared gets.
    pub fn ephemeral() -> Self {
        Self { kind: PoolKind::Ephemeral, exclusive_gets: false, reject_keeps_old: false }
    }

    /// Sets exclusive gets.
    pub fn exclusive_gets(mut self, on: bool) -> Self {
        self.exclusive_gets = on;
        self
    }

    /// Sets whether a refused put keeps an older copy.
    pub fn reject_keeps_old(mut self, on: bool) -> Self {
        self.reject_keeps_old = on;
        self
    }
}

/// Why a put was refused. The page is not in the store afterwards, so the
/// caller must keep it elsewhere; an older copy under the same key is flushed
/// unless the pool was created with `reject_keeps_old`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reject {
    /// The store is at its limit (or refilling below the accept threshold).
    PoolLimit,
    /// Compressed size above `max_compressed_size` and policy says reject.
    CompressPoor,
    /// The compressor failed.
    CompressFail,
    /// No memory for the object.
    AllocFail,
    /// Puts are frozen.
    Frozen,
}

/// Result of a put.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum PutOutcome {
    /// The page is stored.
    Stored,
    /// The page was refused.
    Rejected(Reject),
}

/// Result of a get.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum GetOutcome {
    /// The page was copied into the output buffer.
    Hit,
    /// No page under this key.
    Miss,
}

/// Store errors: misuse or corruption, never normal outcomes.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No pool with this id.
    #[error("no pool {0}")]
    NoSuchPool(PoolId),
    /// The pool was destroyed.
    #[error("pool {0} was destroyed")]
    PoolDestroyed(PoolId),
    /// Stored data failed its checksum or did not decode. The page is still
    /// held (for inspection); its contents are lost.
    #[error("pool {pool} key {key:?}: stored page is corrupt: {reason}")]
    Corrupt {
        /// Pool.
        pool: PoolId,
        /// Key.
        key: Key,
        /// What failed.
        reason: String,
    },
    /// A lower tier could not return the page (node down, file error). The
    /// page is still recorded; a later get may succeed.
    #[error("pool {pool} key {key:?}: tier failed: {source}")]
    Tier {
        /// Pool.
        pool: PoolId,
        /// Key.
        key: Key,
        /// What the tier said.
        source: tmem_tier::TierError,
    },
    /// A tier chain was misconfigured.
    #[error("tier chain: {0}")]
    TierChain(String),
    /// Codec construction failed.
    #[error(transparent)]
    Codec(#[from] CodecError),
    /// Policy change refused.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// All codec ids are in use.
    #[error("at most {MAX_CODECS} codecs can be registered")]
    TooManyCodecs,
    /// No codec with this id.
    #[error("no codec {0}")]
    NoSuchCodec(u8),
}

/// How to build a store.
#[derive(Clone, Debug, Default)]
pub struct StoreConfig {
    /// Policy knobs.
    pub policy: PolicyConfig,
    /// Codec for new puts; `None` means lz4.
    pub codec: Option<CodecConfig>,
    /// Shards per pool, rounded up to a power of two; 0 means [`default_shards`].
    pub shards: usize,
    /// Allocator tuning.
    pub alloc: AllocConfig,
    /// Train a dictionary for the codec from the pool's own pages once the
    /// pool is big enough (see [`DictTraining`]).
    pub dictionary: Option<DictTraining>,
}

impl StoreConfig {
    /// Builds the store.
    pub fn build(self) -> Result<Store, StoreError> {
        let policy = Policy::new(&self.policy)?;
        let shared = Arc::new(Shared {
            alloc: ZsAlloc::with_config(self.alloc),
            policy,
            codecs: std::array::from_fn(|_| OnceLock::new()),
            codec_count: Mutex::new(Rank::CodecCount, 0),
            current_codec: AtomicU8::new(RAW_CODEC),
            reached_full: AtomicBool::new(false),
            index_meta: AtomicU64::new(0),
            codec_meta: AtomicU64::new(0),
            pools: RwLock::new(Rank::StorePools, Vec::new()),
            compaction: Mutex::new(Rank::StoreCompaction, ()),
            evict_cursor: AtomicUsize::new(0),
            next_version: AtomicU64::new(1),
            clock: std::time::Instant::now(),
            room_failed_at: AtomicU64::new(0),
            auto_dictionary: self
                .dictionary
                .map(|t| dictionary::AutoDictionary::new(self.codec.clone().unwrap_or(CodecConfig::LZ4), t)),
        });
        let shards = if self.shards == 0 { default_shards() } else { self.shards.next_power_of_two() };
        let store = Store { shared, shards };
        store.register_codec(&CodecConfig::Raw)?;
        let id = store.register_codec(&self.codec.unwrap_or(CodecConfig::LZ4))?;
        store.set_codec(id)?;
        Ok(store)
    }
}

mod dictionary;
mod tiering;
pub use dictionary::{DictTraining, TrainedDictionary};
pub use tiering::{TierChain, WritebackReport, WritebackWorker};

#[repr(align(128))]
struct PaddedShard(Mutex<Shard>);

struct Shared {
    alloc: ZsAlloc,
    policy: Policy,
    codecs: [OnceLock<Arc<dyn Codec>>; MAX_CODECS],
    codec_count: Mutex<usize>,
    current_codec: AtomicU8,
    /// Set when the limit was hit; cleared once usage is below the accept threshold.
    reached_full: AtomicBool,
    /// Index metadata (entries, hash tables) over all pools.
    index_meta: AtomicU64,
    /// Codec metadata (dictionaries).
    codec_meta: AtomicU64,
    /// Pools by id; destroyed pools leave `None`, ids are not reused.
    pools: RwLock<Vec<Option<Arc<Pool>>>>,
    /// One compaction at a time.
    compaction: Mutex<()>,
    evict_cursor: AtomicUsize,
    /// Sealing versions: never reused, so (key, version) nonces are unique.
    next_version: AtomicU64,
    /// Time base for `room_failed_at`.
    clock: std::time::Instant,
    /// When making room last failed (ns since `clock`; 0: it did not).
    room_failed_at: AtomicU64,
    /// Automatic dictionary training, if configured.
    auto_dictionary: Option<dictionary::AutoDictionary>,
}

impl Shared {
    fn register_codec(&self, cfg: &CodecConfig) -> Result<u8, StoreError> {
        let codec = cfg.build()?;
        let mut n = self.codec_count.lock();
        if *n >= MAX_CODECS {
            return Err(StoreError::TooManyCodecs);
        }
        self.codec_meta.fetch_add(codec.meta_bytes() as u64, Ordering::Relaxed);
        if self.codecs[*n].set(codec).is_err() {
            unreachable!("codec slots are filled in order under codec_count");
        }
        let id = u8::try_from(*n).expect("fewer than 32 codecs");
        *n += 1;
        Ok(id)
    }

    fn set_codec(&self, id: u8) -> Result<(), StoreError> {
        self.codec(id)?;
        self.current_codec.store(id, Ordering::Relaxed);
        Ok(())
    }

    fn total_bytes(&self) -> u64 {
        self.alloc.total_bytes() + self.index_meta.load(Ordering::Relaxed) + self.codec_meta.load(Ordering::Relaxed)
    }

    fn codec(&self, id: u8) -> Result<&Arc<dyn Codec>, StoreError> {
        self.codecs.get(usize::from(id)).and_then(OnceLock::get).ok_or(StoreError::NoSuchCodec(id))
    }

    fn pools_snapshot(&self) -> Vec<Arc<Pool>> {
        self.pools.read().iter().flatten().cloned().collect()
    }

    /// zswap's admission: after hitting the limit, refuse until usage falls
    /// below the accept threshold. Ephemeral pages are dropped first.
    fn admit(&self, pool: &Pool, work: Work) -> bool {
        let limit = self.policy.limit_bytes();
        if limit == u64::MAX {
            return true;
        }
        let accept = self.policy.accept_bytes();
        let inline = work == Work::Inline;
        if self.reached_full.load(Ordering::Relaxed) {
            if self.total_bytes() < accept || (inline && self.may_retry_room() && self.make_room(accept)) {
                self.reached_full.store(false, Ordering::Relaxed);
                return true;
            }
            PoolEvents::bump(&pool.events.pool_limit_hit);
            return false;
        }
        if self.total_bytes() < limit {
            return true;
        }
        if inline && self.may_retry_room() && self.make_room(accept) {
            return true;
        }
        self.reached_full.store(true, Ordering::Relaxed);
        PoolEvents::bump(&pool.events.pool_limit_hit);
        false
    }

    /// Makes room (evicting, writing back, compacting) if the store is at
    /// its limit and may try now; returns whether puts are admitted again.
    fn make_room_if_full(&self) -> bool {
        let limit = self.policy.limit_bytes();
        if limit == u64::MAX || !self.reached_full.load(Ordering::Relaxed) {
            return true;
        }
        let accept = self.policy.accept_bytes();
        if self.total_bytes() < accept || (self.may_retry_room() && self.make_room(accept)) {
            self.reached_full.store(false, Ordering::Relaxed);
            return true;
        }
        false
    }

    /// Whether a full store may try to make room now: after a failed try,
    /// puts are refused for [`ROOM_RETRY_NS`] instead of each repeating the
    /// same futile eviction/writeback scan.
    fn may_retry_room(&self) -> bool {
        let now = u64::try_from(self.clock.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let last = self.room_failed_at.load(Ordering::Relaxed);
        last == 0 || now.saturating_sub(last) >= ROOM_RETRY_NS
    }

    /// Drops ephemeral pages, oldest first, until usage is below `target`.
    /// Returns whether it got there.
    fn make_room(&self, target: u64) -> bool {
        if self.evict_ephemeral(target) || self.write_back_until(target) {
            self.room_failed_at.store(0, Ordering::Relaxed);
            return true;
        }
        let now = u64::try_from(self.clock.elapsed().as_nanos()).unwrap_or(u64::MAX).max(1);
        self.room_failed_at.store(now, Ordering::Relaxed);
        false
    }

    fn evict_ephemeral(&self, target: u64) -> bool {
        let ephemeral: Vec<Arc<Pool>> =
            self.pools_snapshot().into_iter().filter(|p| p.cfg.kind == PoolKind::Ephemeral).collect();
        if ephemeral.is_empty() {
            return false;
        }
        loop {
            let mut evicted = 0;
            // Evict about as many bytes of objects as we are over, then compact
            // so that freed slots become freed spans.
            let over = self.total_bytes().saturating_sub(target);
            let mut slot_bytes_freed = 0u64;
            let mut idle_visits = 0;
            let shards = ephemeral[0].shards.len();
            while slot_bytes_freed < over && idle_visits < ephemeral.len() * shards {
                let cursor = self.evict_cursor.fetch_add(1, Ordering::Relaxed);
                let pool = &ephemeral[cursor % ephemeral.len()];
                let (n, bytes) = pool.evict_from_shard((cursor / ephemeral.len()) % shards, EVICT_BATCH);
                if n == 0 {
                    idle_visits += 1;
                } else {
                    idle_visits = 0;
                }
                evicted += n;
                slot_bytes_freed += bytes;
            }
            if evicted == 0 {
                return false;
            }
            self.compact();
            if self.total_bytes() < target {
                return true;
            }
        }
    }

    fn maybe_compact(&self) {
        let threshold = self.policy.compact_threshold_percent();
        if threshold < 100
            && self.alloc.stats().span_bytes >= AUTO_COMPACT_MIN_BYTES
            && self.alloc.fragmentation_percent() >= threshold
        {
            if let Some(guard) = self.compaction.try_lock() {
                self.compact_locked(&guard);
            }
        }
    }

    fn compact(&self) -> u64 {
        let guard = self.compaction.lock();
        self.compact_locked(&guard)
    }

    /// Moves objects out of sparse spans; returns pages released.
    fn compact_locked(&self, _guard: &MutexGuard<'_, ()>) -> u64 {
        let before = self.alloc.stats().pages_compacted;
        let plan = self.alloc.plan_compaction();
        if !plan.is_empty() {
            'pools: for pool in self.pools_snapshot() {
                for shard in pool.shards.iter() {
                    let mut s = shard.0.lock();
                    let handles: Vec<u32> = s.entries.live_handles().collect();
                    for h in handles {
                        let e = s.entries.get_mut(h);
                        let Some(loc) = e.alloc_loc() else { continue };
                        if !plan.contains(loc) {
                            continue;
                        }
                        match self.alloc.migrate(loc, e.len()) {
                            Ok(new) => e.loc = new.pack(),
                            // Out of memory while compacting: stop; nothing is lost.
                            Err(_) => break 'pools,
                        }
                    }
                }
            }
        }
        self.alloc.finish_compaction(plan);
        self.alloc.stats().pages_compacted - before
    }
}

/// Outcome of the pool part of a get.
enum LocalGet {
    /// Served: hit, miss or error.
    Done(Result<GetOutcome, StoreError>),
    /// The page is in a lower tier.
    InTier(Entry),
}

/// A pool: a namespace of pages with one kind and one get mode. Obtained
/// from [`Store::create_pool`] or [`Store::pool`]; holding the `Arc` lets a
/// frontend skip the id lookup on every operation.
pub struct Pool {
    id: PoolId,
    cfg: PoolConfig,
    shards: Box<[PaddedShard]>,
    events: PoolEvents,
    destroyed: AtomicBool,
    shared: Arc<Shared>,
    /// Tiers below the pool, if any.
    chain: Option<TierChain>,
    /// Next shard writeback visits.
    wb_cursor: AtomicUsize,
    /// Stale tier copies waiting to be removed.
    removals: tiering::TierRemovals,
    /// A deferred put queued enough removals to send them ([`Pool::maintain`]).
    removals_due: AtomicBool,
    /// A deferred put freed an object: compaction may be due ([`Pool::maintain`]).
    compaction_due: AtomicBool,
    /// Orders writeback and incompressible puts of one key to the tiers.
    tier_puts: tiering::TierPutLocks,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("id", &self.id).field("cfg", &self.cfg).finish_non_exhaustive()
    }
}

impl Pool {
    /// Pool id.
    pub fn id(&self) -> PoolId {
        self.id
    }

    /// Pool configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.cfg
    }

    fn check_live(&self) -> Result<(), StoreError> {
        if self.destroyed.load(Ordering::Acquire) {
            return Err(StoreError::PoolDestroyed(self.id));
        }
        Ok(())
    }

    fn shard_of(&self, hash: u64) -> &Mutex<Shard> {
        &self.shards[usize::try_from(hash >> 40).expect("24 bits fit usize") & (self.shards.len() - 1)].0
    }

    /// Updates the store-wide metadata count after a shard changed size.
    fn account(&self, s: &mut Shard) {
        let now = s.meta_bytes();
        if now != s.meta_reported {
            if now > s.meta_reported {
                self.shared.index_meta.fetch_add((now - s.meta_reported) as u64, Ordering::Relaxed);
            } else {
                self.shared.index_meta.fetch_sub((s.meta_reported - now) as u64, Ordering::Relaxed);
            }
            s.meta_reported = now;
        }
    }

    /// Counts an entry in.
    fn count(c: &mut ShardCounters, e: &Entry) {
        c.stored_pages += 1;
        if e.has(F_TIER) {
            c.tier_pages += 1;
        } else if e.has(F_SAME) {
            c.same_filled_pages += 1;
        } else {
            c.compr_data_size += e.len() as u64;
        }
        if e.has(F_INCOMPRESSIBLE) {
            c.stored_incompressible_pages += 1;
        }
    }

    /// Counts an entry out.
    fn uncount(c: &mut ShardCounters, e: &Entry) {
        c.stored_pages -= 1;
        if e.has(F_TIER) {
            c.tier_pages -= 1;
        } else if e.has(F_SAME) {
            c.same_filled_pages -= 1;
        } else {
            c.compr_data_size -= e.len() as u64;
        }
        if e.has(F_INCOMPRESSIBLE) {
            c.stored_incompressible_pages -= 1;
        }
    }

    /// Releases the pool memory of an entry removed from its shard and fixes
    /// counters. A copy in a lower tier is queued for removal by
    /// [`Pool::queue_tier_copy`], under the same shard lock.
    fn forget(&self, c: &mut ShardCounters, e: &Entry) {
        Self::uncount(c, e);
        if let Some(loc) = e.alloc_loc() {
            self.shared.alloc.free(loc);
        }
    }

    /// Stores `page` under `key`, replacing any older copy. A refused put
    /// also flushes the older copy, so a later get never returns stale data.
    /// At the pool limit it makes room first (writeback, eviction,
    /// compaction), and it compacts and sends stale tier copies' removals
    /// when due: callers that hold a lock of their own use [`Pool::put_now`].
    pub fn put(&self, key: Key, page: &[u8; PAGE_SIZE]) -> Result<PutOutcome, StoreError> {
        self.put_with(key, page, Work::Inline)
    }

    /// [`Pool::put`] without the slow work: at the limit it refuses
    /// (`Reject::PoolLimit`) instead of making room, and it leaves
    /// compaction and tier removals to [`Pool::maintain`], which the caller
    /// runs once it has dropped its own locks (the block layer's page
    /// stripes). Compression and, for an incompressible page, its tier put
    /// still run here: they are the page's own storage.
    pub fn put_now(&self, key: Key, page: &[u8; PAGE_SIZE]) -> Result<PutOutcome, StoreError> {
        self.put_with(key, page, Work::Deferred)
    }

    /// The slow work [`Pool::put_now`] leaves: makes room if the store is at
    /// its limit, compacts if due, sends queued tier removals. Returns
    /// whether puts are admitted now (a refused put may be retried).
    pub fn maintain(&self) -> bool {
        let admitted = self.shared.make_room_if_full();
        if self.removals_due.swap(false, Ordering::Relaxed) {
            self.send_tier_removals();
        }
        if self.compaction_due.swap(false, Ordering::Relaxed) {
            self.shared.maybe_compact();
        }
        admitted
    }

    fn put_with(&self, key: Key, page: &[u8; PAGE_SIZE], work: Work) -> Result<PutOutcome, StoreError> {
        self.check_live()?;
        let sh = &*self.shared;
        if sh.policy.frozen() {
            return Ok(self.refuse(key, Reject::Frozen, &self.events.reject_frozen));
        }
        if !sh.admit(self, work) {
            return Ok(self.refuse(key, Reject::PoolLimit, &self.events.pool_limit_hit_counted()));
        }
        let hash = hash_key(key);
        let entry = if let Some(word) = same_filled(page) {
            Entry::new(key, word, 0, 0, RAW_CODEC, F_SAME)
        } else {
            let codec_id = sh.current_codec.load(Ordering::Relaxed);
            let codec = sh.codec(codec_id)?;
            let mut buf = [0u8; COMPRESS_BUF_SIZE];
            let n = match codec.compress(page, &mut buf) {
                Ok(n) => n,
                Err(_) => return Ok(self.refuse(key, Reject::CompressFail, &self.events.reject_compress_fail)),
            };
            let (data, codec_id, flags): (&[u8], u8, u32) = if n <= sh.policy.max_compressed_size() && n < PAGE_SIZE {
                (&buf[..n], codec_id, 0)
            } else if let Some(r) = self.incompressible_to_tier(key, hash, page, work) {
                // Straight to the next tier, as zswap's writeback does for them.
                return r;
            } else if sh.policy.store_raw() {
                (&page[..], RAW_CODEC, F_INCOMPRESSIBLE)
            } else {
                PoolEvents::bump(&self.events.compressions_rejected);
                return Ok(self.refuse(key, Reject::CompressPoor, &self.events.reject_compress_poor));
            };
            let loc = match sh.alloc.alloc_write(data) {
                Ok(loc) => loc,
                Err(_) => return Ok(self.refuse(key, Reject::AllocFail, &self.events.reject_alloc_fail)),
            };
            Entry::new(key, loc.pack(), crc32fast::hash(data), data.len(), codec_id, flags)
        };
        let r = self.insert_entry(key, hash, entry, work);
        self.shared.maybe_train_dictionary();
        r
    }

    /// Inserts a ready entry, replacing an older copy of the key.
    fn insert_entry(&self, key: Key, hash: u64, entry: Entry, work: Work) -> Result<PutOutcome, StoreError> {
        let (old, long) = {
            let mut s = self.shard_of(hash).lock();
            let old = s.insert(entry, hash);
            let c = &mut s.c;
            if let Some(old) = &old {
                // The older copy's object is freed below, outside the lock.
                Self::uncount(c, old);
            }
            c.succ_puts += 1;
            Self::count(c, &entry);
            c.compressions += u64::from(entry.alloc_loc().is_some() && !entry.has(F_INCOMPRESSIBLE));
            self.account(&mut s);
            // A new value in the same tier has already overwritten the old one.
            let long = old.as_ref().is_some_and(|old| {
                !(entry.has(F_TIER) && old.has(F_TIER) && entry.tier() == old.tier()) && self.queue_tier_copy(key, old)
            });
            (old, long)
        };
        match (long, work) {
            (true, Work::Inline) => self.send_tier_removals(),
            (true, Work::Deferred) => self.removals_due.store(true, Ordering::Relaxed),
            (false, _) => {}
        }
        if let Some(loc) = old.and_then(|o| o.alloc_loc()) {
            // Safe outside the shard lock: the entry is unreachable, so
            // neither gets nor compaction can see this object any more.
            self.shared.alloc.free(loc);
            match work {
                Work::Inline => self.shared.maybe_compact(),
                Work::Deferred => self.compaction_due.store(true, Ordering::Relaxed),
            }
        }
        Ok(PutOutcome::Stored)
    }

    fn refuse(&self, key: Key, why: Reject, counter: &AtomicU64) -> PutOutcome {
        if why != Reject::PoolLimit {
            PoolEvents::bump(counter);
        }
        if !self.cfg.reject_keeps_old {
            self.remove(key, false);
        }
        PutOutcome::Rejected(why)
    }

    /// Copies the page under `key` into `out`. Exclusive pools drop the page
    /// on a hit. Corrupt data is an error (counted as `decompress_fail`), and
    /// `out` then holds no page data.
    pub fn get(&self, key: Key, out: &mut [u8; PAGE_SIZE]) -> Result<GetOutcome, StoreError> {
        self.check_live()?;
        let hash = hash_key(key);
        match self.get_local(key, hash, out) {
            LocalGet::Done(r) => r,
            LocalGet::InTier(e) => self.get_from_tier(key, hash, e, out),
        }
    }

    /// Gets several pages: `outs[i]` receives the page of `keys[i]`, and the
    /// result for it is what [`Pool::get`] would return. Pages in lower tiers
    /// are fetched with one batch per tier, so a multi-page read costs one
    /// round trip rather than one per page.
    pub fn get_batch(&self, keys: &[Key], outs: &mut [[u8; PAGE_SIZE]]) -> Vec<Result<GetOutcome, StoreError>> {
        assert_eq!(keys.len(), outs.len(), "one output page per key");
        if self.check_live().is_err() {
            return keys.iter().map(|_| Err(StoreError::PoolDestroyed(self.id))).collect();
        }
        let mut results: Vec<Option<Result<GetOutcome, StoreError>>> = Vec::with_capacity(keys.len());
        let mut down = Vec::new();
        for (i, (&key, out)) in keys.iter().zip(outs.iter_mut()).enumerate() {
            let hash = hash_key(key);
            match self.get_local(key, hash, out) {
                LocalGet::Done(r) => results.push(Some(r)),
                LocalGet::InTier(e) => {
                    results.push(None);
                    down.push((i, key, hash, e));
                }
            }
        }
        if !down.is_empty() {
            self.get_batch_from_tiers(&down, outs, &mut results);
        }
        results.into_iter().map(|r| r.unwrap_or_else(|| Err(StoreError::TierChain("get not served".into())))).collect()
    }

    /// Serves a get from the pool, or says that the page is in a tier.
    fn get_local(&self, key: Key, hash: u64, out: &mut [u8; PAGE_SIZE]) -> LocalGet {
        let mut s = self.shard_of(hash).lock();
        let Some(h) = s.find(key, hash) else {
            s.c.failed_gets += 1;
            return LocalGet::Done(Ok(GetOutcome::Miss));
        };
        let e = *s.entries.get(h);
        if e.has(F_TIER) {
            return LocalGet::InTier(e);
        }
        if let Some(loc) = e.alloc_loc() {
            if let Err(reason) = self.decode(&e, loc, out) {
                PoolEvents::bump(&self.events.decompress_fail);
                out.fill(0);
                return LocalGet::Done(Err(StoreError::Corrupt { pool: self.id, key, reason }));
            }
            s.c.decompressions += u64::from(!e.has(F_INCOMPRESSIBLE));
        } else {
            fill_page(out, e.loc);
        }
        s.c.succ_gets += 1;
        if self.cfg.exclusive_gets {
            let e = s.remove_handle(h);
            self.forget(&mut s.c, &e);
            self.account(&mut s);
        } else {
            s.entries.get_mut(h).meta |= F_REFERENCED;
        }
        LocalGet::Done(Ok(GetOutcome::Hit))
    }

    /// Checks and decodes the object of `e`. The caller holds the shard lock.
    fn decode(&self, e: &Entry, loc: Loc, out: &mut [u8; PAGE_SIZE]) -> Result<(), String> {
        // SAFETY: `e` is live in a shard whose lock the caller holds, so the
        // object is neither freed nor migrated while we read it, and its
        // length is what was allocated for it.
        let data = unsafe { self.shared.alloc.object(loc, e.len()) };
        if crc32fast::hash(data) != e.check {
            return Err("checksum mismatch".into());
        }
        let codec = self.shared.codec(e.codec()).map_err(|err| err.to_string())?;
        codec.decompress(data, out).map_err(|err| err.to_string())
    }

    /// Whether a page is stored under `key` (no decompression, no counters).
    pub fn contains(&self, key: Key) -> Result<bool, StoreError> {
        self.check_live()?;
        let hash = hash_key(key);
        Ok(self.shard_of(hash).lock().find(key, hash).is_some())
    }

    /// Removes the page under `key`; returns whether there was one.
    pub fn flush_page(&self, key: Key) -> Result<bool, StoreError> {
        self.check_live()?;
        Ok(self.remove(key, true))
    }

    fn remove(&self, key: Key, count: bool) -> bool {
        let hash = hash_key(key);
        let mut s = self.shard_of(hash).lock();
        let Some(e) = s.remove_key(key, hash) else { return false };
        if count {
            s.c.flushes += 1;
        }
        self.forget(&mut s.c, &e);
        self.account(&mut s);
        let long = self.queue_tier_copy(key, &e);
        drop(s);
        if long {
            self.send_tier_removals();
        }
        self.shared.maybe_compact();
        true
    }

    /// Removes every page of `object`; returns how many. Walks every shard,
    /// so it costs O(pages in the pool), not O(pages in the object).
    pub fn flush_object(&self, object: u64) -> Result<u64, StoreError> {
        self.check_live()?;
        let mut n = 0;
        for shard in self.shards.iter() {
            let mut s = shard.0.lock();
            let victims: Vec<u32> = s.entries.live_handles().filter(|&h| s.entries.get(h).object == object).collect();
            let mut long = false;
            for h in victims {
                let e = s.remove_handle(h);
                s.c.flushes += 1;
                self.forget(&mut s.c, &e);
                long |= self.queue_tier_copy(e.key(), &e);
                n += 1;
            }
            self.account(&mut s);
            drop(s);
            if long {
                self.send_tier_removals();
            }
        }
        self.shared.maybe_compact();
        Ok(n)
    }

    /// Drops up to `max` of the oldest pages of shard `i`; returns pages and
    /// object bytes freed.
    fn evict_from_shard(&self, i: usize, max: usize) -> (usize, u64) {
        if self.destroyed.load(Ordering::Acquire) {
            return (0, 0);
        }
        let mut s = self.shards[i].0.lock();
        let mut n = 0;
        let mut bytes = 0;
        while n < max {
            let Some(h) = s.lru_victim() else { break };
            let e = s.remove_handle(h);
            if let Some(loc) = e.alloc_loc() {
                bytes += self.shared.alloc.slot_size(loc) as u64;
            }
            self.forget(&mut s.c, &e);
            s.c.evicted_pages += 1;
            n += 1;
        }
        self.account(&mut s);
        (n, bytes)
    }

    /// Counters of this pool.
    pub fn stats(&self) -> PoolStats {
        let mut c = ShardCounters::default();
        for shard in self.shards.iter() {
            let s = shard.0.lock();
            let x = &s.c;
            c.stored_pages += x.stored_pages;
            c.same_filled_pages += x.same_filled_pages;
            c.stored_incompressible_pages += x.stored_incompressible_pages;
            c.compr_data_size += x.compr_data_size;
            c.succ_puts += x.succ_puts;
            c.succ_gets += x.succ_gets;
            c.failed_gets += x.failed_gets;
            c.flushes += x.flushes;
            c.evicted_pages += x.evicted_pages;
            c.compressions += x.compressions;
            c.decompressions += x.decompressions;
            c.tier_pages += x.tier_pages;
            c.written_back_pages += x.written_back_pages;
            c.tier_gets += x.tier_gets;
            c.incompressible_to_tier += x.incompressible_to_tier;
        }
        PoolStats::from_parts(self.id, self.cfg.kind, &c, &self.events)
    }

    /// Destroys the pool's pages; later operations fail with `PoolDestroyed`.
    fn destroy(&self) {
        self.destroyed.store(true, Ordering::Release);
        for shard in self.shards.iter() {
            let mut s = shard.0.lock();
            for e in s.drain() {
                self.forget(&mut s.c, &e);
            }
            self.account(&mut s);
        }
        if let Some(chain) = &self.chain {
            chain.clear_pool(self.id);
        }
    }

    /// Flips a byte of the stored object under `key` (corruption tests).
    #[cfg(test)]
    pub(crate) fn corrupt_for_test(&self, key: Key) -> bool {
        let hash = hash_key(key);
        let s = self.shard_of(hash).lock();
        let Some(h) = s.find(key, hash) else { return false };
        let e = *s.entries.get(h);
        let Some(loc) = e.alloc_loc() else { return false };
        // SAFETY: shard lock held, so the object is live and unmoved, and no
        // other thread reads or writes it; the byte is inside it.
        unsafe { self.shared.alloc.corrupt_object(loc, e.len() / 2) };
        true
    }
}

impl PoolEvents {
    /// `pool_limit_hit` is counted by admission itself; refusals pass this dummy.
    fn pool_limit_hit_counted(&self) -> AtomicU64 {
        AtomicU64::new(0)
    }
}

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
        self.create_pool_inner(cfg, None)
    }

    /// Creates a pool whose pages move down `chain` when the store is full
    /// (and incompressible pages go there directly).
    pub fn create_pool_with_tiers(&self, cfg: PoolConfig, chain: TierChain) -> Arc<Pool> {
        self.create_pool_inner(cfg, Some(chain))
    }

    fn create_pool_inner(&self, cfg: PoolConfig, chain: Option<TierChain>) -> Arc<Pool> {
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
        if let Some(c) = &pool.chain {
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
        WritebackWorker::start(Arc::clone(&self.shared), period)
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

    /// Snapshot of every counter.
    pub fn stats(&self) -> Stats {
        let pools: Vec<PoolStats> = self.shared.pools_snapshot().iter().map(|p| p.stats()).collect();
        let mut total = PoolStats::default();
        for p in &pools {
            total.add(p);
        }
        let alloc = self.shared.alloc.stats();
        let mem = self.shared.total_bytes();
        let metadata_bytes = mem - alloc.span_bytes;
        Stats {
            mem_used_total: mem,
            pool_total_size: mem,
            metadata_bytes,
            pool_limit_bytes: self.shared.policy.limit_bytes(),
            ratio: if mem == 0 { 0.0 } else { total.orig_data_size as f64 / mem as f64 },
            codec: self.codec_name(),
            dictionary: self.shared.dictionary_status(),
            total,
            alloc,
            policy: self.shared.policy.config(),
            tiers: tiering::tier_stats(&self.shared.pools_snapshot()),
            pools,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Incompressible;

    #[allow(clippy::cast_possible_truncation)] // byte extraction
    fn page(seed: u64) -> [u8; PAGE_SIZE] {
        let mut p = [0u8; PAGE_SIZE];
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for (i, b) in p.iter_mut().enumerate() {
            // Compressible but not same-filled: runs of pseudo-random bytes.
            if i % 16 == 0 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
            }
            *b = (x >> ((i % 8) * 8)) as u8 & 0x3f;
        }
        p
    }

    fn key(i: u64) -> Key {
        Key { object: 1, index: i }
    }

    fn store(policy: PolicyConfig) -> Store {
        StoreConfig { policy, ..Default::default() }.build().unwrap()
    }

    #[test]
    fn put_get_replace_flush() {
        let s = store(PolicyConfig::default());
        let p = s.create_pool(PoolConfig::persistent());
        let mut out = [0u8; PAGE_SIZE];
        assert_eq!(p.get(key(1), &mut out).unwrap(), GetOutcome::Miss);
        assert_eq!(p.put(key(1), &page(1)).unwrap(), PutOutcome::Stored);
        assert_eq!(p.put(key(1), &page(2)).unwrap(), PutOutcome::Stored);
        assert_eq!(p.get(key(1), &mut out).unwrap(), GetOutcome::Hit);
        assert_eq!(out, page(2));
        assert_eq!(p.stats().stored_pages, 1);
        assert!(p.flush_page(key(1)).unwrap());
        assert!(!p.flush_page(key(1)).unwrap());
        let st = s.stats();
        assert_eq!(st.total.stored_pages, 0);
        assert_eq!(st.total.compr_data_size, 0);
        assert_eq!(st.alloc.objects, 0);
        assert_eq!((st.total.succ_gets, st.total.failed_gets, st.total.flushes, st.total.puts), (1, 1, 1, 2));
    }

    #[test]
    fn exclusive_gets_free_the_copy() {
        let s = store(PolicyConfig::default());
        let p = s.create_pool(PoolConfig::persistent().exclusive_gets(true));
        let mut out = [0u8; PAGE_SIZE];
        assert_eq!(p.put(key(3), &page(3)).unwrap(), PutOutcome::Stored);
        assert_eq!(p.get(key(3), &mut out).unwrap(), GetOutcome::Hit);
        assert_eq!(out, page(3));
        assert_eq!(p.get(key(3), &mut out).unwrap(), GetOutcome::Miss);
        assert_eq!(s.stats().alloc.objects, 0);
    }

    #[test]
    fn same_filled_pages_use_no_pool_memory() {
        let s = store(PolicyConfig::default());
        let p = s.create_pool(PoolConfig::persistent());
        let mut pg = [0u8; PAGE_SIZE];
        fill_page(&mut pg, 0x0102_0304_0506_0708);
        for i in 0..100 {
            assert_eq!(p.put(key(i), &pg).unwrap(), PutOutcome::Stored);
        }
        let st = s.stats();
        assert_eq!(st.total.same_filled_pages, 100);
        assert_eq!(st.alloc.span_bytes, 0);
        let mut out = [1u8; PAGE_SIZE];
        assert_eq!(p.get(key(42), &mut out).unwrap(), GetOutcome::Hit);
        assert_eq!(out, pg);
    }

    #[allow(clippy::cast_possible_truncation)] // byte extraction
    fn random_page(seed: u64) -> [u8; PAGE_SIZE] {
        let mut p = [0u8; PAGE_SIZE];
        let mut x = seed | 1;
        for b in p.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        p
    }

    #[test]
    fn incompressible_pages_by_policy() {
        let s = store(PolicyConfig::default());
        let p = s.create_pool(PoolConfig::persistent());
        assert_eq!(p.put(key(1), &page(1)).unwrap(), PutOutcome::Stored);
        // Default (zswap): reject, and the key's older copy is gone.
        assert_eq!(p.put(key(2), &page(2)).unwrap(), PutOutcome::Stored);
        assert_eq!(p.put(key(2), &random_page(9)).unwrap(), PutOutcome::Rejected(Reject::CompressPoor));
        let mut out = [0u8; PAGE_SIZE];
        assert_eq!(p.get(key(2), &mut out).unwrap(), GetOutcome::Miss, "stale copy must not survive a refused put");
        assert_eq!(p.stats().reject_compress_poor, 1);
        s.set_policy("incompressible", "store_raw").unwrap();
        assert_eq!(p.put(key(2), &random_page(9)).unwrap(), PutOutcome::Stored);
        assert_eq!(p.get(key(2), &mut out).unwrap(), GetOutcome::Hit);
        assert_eq!(out, random_page(9));
        assert_eq!(p.stats().stored_incompressible_pages, 1);
        // A tighter threshold makes ordinary pages incompressible too.
        s.set_policy("max_compressed_size", "64").unwrap();
        s.set_policy("incompressible", "reject").unwrap();
        assert_eq!(p.put(key(3), &page(3)).unwrap(), PutOutcome::Rejected(Reject::CompressPoor));
    }

    #[test]
    fn freeze_refuses_puts_but_serves_gets() {
        let s = store(PolicyConfig::default());
        let p = s.create_pool(PoolConfig::persistent());
        assert_eq!(p.put(key(1), &page(1)).unwrap(), PutOutcome::Stored);
        s.set_policy("frozen", "1").unwrap();
        assert_eq!(p.put(key(2), &page(2)).unwrap(), PutOutcome::Rejected(Reject::Frozen));
        let mut out = [0u8; PAGE_SIZE];
        assert_eq!(p.get(key(1), &mut out).unwrap(), GetOutcome::Hit);
        assert!(p.flush_page(key(1)).unwrap());
        assert_eq!(p.stats().reject_frozen, 1);
        s.set_policy("frozen", "0").unwrap();
        assert_eq!(p.put(key(2), &page(2)).unwrap(), PutOutcome::Stored);
    }

    #[test]
    fn pool_limit_rejects_persistent_and_evicts_ephemeral() {
        let s = store(PolicyConfig { max_pool_bytes: 2 << 20, ..Default::default() });
        let persistent = s.create_pool(PoolConfig::persistent());
        let mut stored = 0;
        let mut rejected = 0;
        for i in 0..4000 {
            match persistent.put(key(i), &page(i)).unwrap() {
                PutOutcome::Stored => stored += 1,
                PutOutcome::Rejected(Reject::PoolLimit) => rejected += 1,
                other => panic!("{other:?}"),
            }
        }
        assert!(stored > 100 && rejected > 0, "stored {stored} rejected {rejected}");
        assert!(persistent.stats().pool_limit_hit > 0);
        assert!(s.mem_used_total() <= (2 << 20) + PAGE_SIZE as u64 * 16);
        // Every stored persistent page is still there.
        let mut out = [0u8; PAGE_SIZE];
        let mut hits = 0;
        for i in 0..4000 {
            if p_get(&persistent, i, &mut out) {
                assert_eq!(out, page(i));
                hits += 1;
            }
        }
        assert_eq!(hits, persistent.stats().stored_pages);

        // Ephemeral pages make way for each other, oldest first.
        persistent.flush_object(1).unwrap();
        s.compact();
        let eph = s.create_pool(PoolConfig::ephemeral());
        for i in 0..4000 {
            assert_eq!(eph.put(key(i), &page(i)).unwrap(), PutOutcome::Stored, "ephemeral put {i}");
        }
        let st = eph.stats();
        assert!(st.evicted_pages > 0);
        assert!(p_get(&eph, 3999, &mut out), "newest page kept");
        assert!(!p_get(&eph, 0, &mut out), "oldest page dropped");
    }

    fn p_get(p: &Pool, i: u64, out: &mut [u8; PAGE_SIZE]) -> bool {
        p.get(key(i), out).unwrap() == GetOutcome::Hit
    }

    #[test]
    fn corrupt_data_is_an_error() {
        let s = store(PolicyConfig { incompressible: Incompressible::StoreRaw, ..Default::default() });
        let p = s.create_pool(PoolConfig::persistent());
        assert_eq!(p.put(key(1), &page(1)).unwrap(), PutOutcome::Stored);
        assert_eq!(p.put(key(2), &random_page(2)).unwrap(), PutOutcome::Stored);
        for k in [key(1), key(2)] {
            assert!(p.corrupt_for_test(k));
            let mut out = [0u8; PAGE_SIZE];
            match p.get(k, &mut out) {
                Err(StoreError::Corrupt { reason, .. }) => assert!(reason.contains("checksum")),
                other => panic!("expected corruption error, got {other:?}"),
            }
            assert_eq!(out, [0u8; PAGE_SIZE]);
        }
        assert_eq!(p.stats().decompress_fail, 2);
    }

    #[test]
    fn codec_switch_keeps_old_pages_readable() {
        let s = store(PolicyConfig::default());
        let p = s.create_pool(PoolConfig::persistent());
        for i in 0..50 {
            assert_eq!(p.put(key(i), &page(i)).unwrap(), PutOutcome::Stored);
        }
        s.use_codec(&CodecConfig::Zstd { level: 5, dictionary: None }).unwrap();
        assert_eq!(s.codec_name(), "zstd-5");
        for i in 50..100 {
            assert_eq!(p.put(key(i), &page(i)).unwrap(), PutOutcome::Stored);
        }
        let mut out = [0u8; PAGE_SIZE];
        for i in 0..100 {
            assert!(p_get(&p, i, &mut out));
            assert_eq!(out, page(i));
        }
    }

    #[test]
    fn compaction_keeps_pages_and_releases_memory() {
        let s = store(PolicyConfig { compact_threshold_percent: 100, ..Default::default() });
        let p = s.create_pool(PoolConfig::persistent());
        for i in 0..5000 {
            assert_eq!(p.put(key(i), &page(i)).unwrap(), PutOutcome::Stored);
        }
        for i in 0..5000 {
            if i % 3 != 0 {
                p.flush_page(key(i)).unwrap();
            }
        }
        let before = s.stats().alloc.span_bytes;
        assert!(s.compact() > 0);
        let after = s.stats().alloc.span_bytes;
        assert!(after * 2 < before, "{before} -> {after}");
        let mut out = [0u8; PAGE_SIZE];
        for i in (0..5000).step_by(3) {
            assert!(p_get(&p, i, &mut out));
            assert_eq!(out, page(i));
        }
    }

    #[test]
    fn destroyed_pool_errors_and_frees() {
        let s = store(PolicyConfig::default());
        let p = s.create_pool(PoolConfig::ephemeral());
        for i in 0..100 {
            assert_eq!(p.put(key(i), &page(i)).unwrap(), PutOutcome::Stored);
        }
        s.destroy_pool(p.id()).unwrap();
        assert!(matches!(p.put(key(1), &page(1)), Err(StoreError::PoolDestroyed(_))));
        assert!(matches!(s.pool(p.id()), Err(StoreError::PoolDestroyed(_))));
        assert!(matches!(s.pool(99), Err(StoreError::NoSuchPool(99))));
        assert_eq!(s.stats().alloc.objects, 0);
    }
}
