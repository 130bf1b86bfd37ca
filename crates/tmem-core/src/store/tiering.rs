//! Tiers below the pool: writeback of the oldest pages, incompressible
//! pages sent straight down, gets served from a tier, and the background
//! writeback worker.
//!
//! A page that moves down keeps its entry in the shard (so the key still
//! resolves), flagged `F_TIER` with the tier index and the *version* it was
//! sealed under. Every value leaving the process is sealed
//! ([`tmem_tier::seal::Sealer`]) with that version, so a tier can return a
//! page only as it was written for that key.
//!
//! Writeback keeps the pool below its accept threshold so new pages are not
//! refused (zswap's "LRU inversion": refusing new pages while old ones sit in
//! the pool). The worker starts writing back at `accept - 5%` of the limit and
//! stops at `accept - 10%`; a put that finds the store full writes back
//! synchronously before it would refuse.

use std::cell::RefCell;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use tmem_lock::{Mutex, MutexGuard, Rank};

use tmem_tier::seal::Sealer;
use tmem_tier::{Tier, TierError, TierGet, TierKey, TierPut, TierStats};

use super::{GetOutcome, Pool, PoolEvents, PutOutcome, Shared, Store, StoreError, Work, RAW_CODEC};
use crate::codec::COMPRESS_BUF_SIZE;
use crate::shard::{hash_key, Entry, F_GROUP, F_INCOMPRESSIBLE, F_TIER, F_WB, MAX_TIERS};
use crate::{Key, PAGE_SIZE};

thread_local! {
    /// Each thread's buffer for a tier's answer to a single get, so that a
    /// get allocates nothing.
    static TIER_VALUE: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Pages taken from one shard per writeback visit.
const WB_BATCH: usize = 64;
/// Queued tier removals that make the queuing put send them at once.
const REMOVE_BATCH: usize = 256;
/// Stripes of [`TierPutLocks`].
const TIER_PUT_STRIPES: usize = 256;

/// Orders the paths that put a key's page to a tier.
///
/// * One writeback per shard at a time (`writeback`): an entry's `F_WB` mark
///   then always belongs to the one writeback in flight, so a second
///   writeback can't mistake a replacement it marked for the page the first
///   one copied (and switch the entry to the old page's tier copy).
/// * Per key (`stripes`): writeback of the pool's copy against an
///   incompressible put of a new page. Without it, writeback could send the
///   old page after the new one went down, and the tier would hold a value
///   sealed under a version the entry no longer has: a lost page. Writeback
///   locks the stripes of its victims (sorted) and keeps only victims still
///   marked `F_WB`; an incompressible put holds its key's stripe from its tier
///   put to its entry insert.
///
/// Lock order (docs/ARCHITECTURE.md): `Rank::Writeback` → `Rank::TierPutStripe`
/// (several, in index order) → `Rank::Shard`.
pub(super) struct TierPutLocks {
    writeback: Box<[Mutex<()>]>,
    stripes: Box<[Mutex<()>]>,
    /// Writeback is held off for a hand-over ([`Store::hold_tiers`]): a
    /// writeback that takes its shard's lock while this is set moves nothing.
    held: std::sync::atomic::AtomicBool,
}

impl TierPutLocks {
    /// Locks for a pool of `shards` shards.
    pub(super) fn new(shards: usize) -> Self {
        let locks = |n: usize, rank| (0..n).map(|_| Mutex::new(rank, ())).collect();
        Self {
            writeback: locks(shards, Rank::Writeback),
            stripes: locks(TIER_PUT_STRIPES, Rank::TierPutStripe),
            held: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Holds writeback off (once every writeback in flight has ended), or
    /// lets it go on.
    pub(super) fn set_held(&self, held: bool) {
        self.held.store(held, Ordering::SeqCst);
        if held {
            for m in self.writeback.iter() {
                drop(m.lock());
            }
        }
    }

    fn stripe(hash: u64) -> usize {
        usize::try_from(hash % TIER_PUT_STRIPES as u64).expect("fits")
    }

    /// Locks the stripe of one key.
    fn lock_one(&self, hash: u64) -> MutexGuard<'_, ()> {
        self.stripes[Self::stripe(hash)].lock()
    }

    /// Locks the stripes of `hashes`, in order.
    fn lock_all(&self, hashes: impl Iterator<Item = u64>) -> Vec<MutexGuard<'_, ()>> {
        let mut ids: Vec<usize> = hashes.map(Self::stripe).collect();
        ids.sort_unstable();
        ids.dedup();
        ids.into_iter().map(|i| self.stripes[i].lock()).collect()
    }
}

/// Tier copies made stale by puts, removed later in batches.
///
/// Removing a replaced page's tier copy inside the put that replaced it would
/// put a network round trip (remote tier) on every overwrite of a written-back
/// page, the common case for swap. The copy is unreachable as soon as its
/// entry is gone (and sealed under an old version), so its removal can wait;
/// what must not happen is a removal overtaking a *later* put of the same key
/// to the same tier, which would delete the new copy. Hence:
/// * a removal is queued under the shard lock that removed or replaced the
///   entry, so by the time a writeback can pick the key's next page (under
///   that lock), the removal is in the queue;
/// * every tier put first calls [`TierRemovals::send`], which sends
///   everything queued so far and holds `sending` while it does, so a put
///   that follows can't overtake it.
///
/// Lock order (docs/ARCHITECTURE.md): `Rank::TierRemovalSending` →
/// `Rank::Shard` → `Rank::TierRemovalQueue`; `sending` is never taken under
/// a shard lock.
pub(super) struct TierRemovals {
    /// (tier index, key) of stale copies, in the order they became stale.
    queue: Mutex<Vec<(usize, TierKey)>>,
    /// Held while a batch is being sent.
    sending: Mutex<()>,
}

impl Default for TierRemovals {
    fn default() -> Self {
        Self {
            queue: Mutex::new(Rank::TierRemovalQueue, Vec::new()),
            sending: Mutex::new(Rank::TierRemovalSending, ()),
        }
    }
}

impl TierRemovals {
    /// Queues the removal of `tkey` from tier `t`; returns whether the queue
    /// is long enough to send now.
    fn push(&self, t: usize, tkey: TierKey) -> bool {
        let mut q = self.queue.lock();
        q.push((t, tkey));
        q.len() >= REMOVE_BATCH
    }

    /// Sends every queued removal, one batch per tier. A failed removal
    /// leaves an unreachable sealed value behind, cleared with the pool.
    pub(super) fn send(&self, chain: &TierChain) {
        let _sending = self.sending.lock();
        let batch = std::mem::take(&mut *self.queue.lock());
        if batch.is_empty() {
            return;
        }
        for (t, tier) in chain.tiers.iter().enumerate() {
            let keys: Vec<TierKey> = batch.iter().filter(|(i, _)| *i == t).map(|(_, k)| *k).collect();
            if !keys.is_empty() {
                let _ = tier.remove_batch(&keys);
            }
        }
    }
}

/// The tiers below one pool, in order, and the sealer for values sent there.
#[derive(Clone)]
pub struct TierChain {
    pub(super) tiers: Vec<Arc<dyn Tier>>,
    pub(super) sealer: Arc<Sealer>,
    pub(super) promote_on_get: bool,
}

impl std::fmt::Debug for TierChain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.tiers.iter().map(|t| t.name()).collect();
        f.debug_struct("TierChain").field("tiers", &names).field("promote_on_get", &self.promote_on_get).finish()
    }
}

impl TierChain {
    /// A chain of 1..=8 tiers, tried in order.
    pub fn new(tiers: Vec<Arc<dyn Tier>>, sealer: Arc<Sealer>) -> Result<Self, StoreError> {
        if tiers.is_empty() || tiers.len() > MAX_TIERS {
            return Err(StoreError::TierChain(format!("a chain has 1..={MAX_TIERS} tiers, not {}", tiers.len())));
        }
        Ok(Self { tiers, sealer, promote_on_get: false })
    }

    /// Whether a (non-exclusive) get from a tier moves the page back into the pool.
    pub fn promote_on_get(mut self, on: bool) -> Self {
        self.promote_on_get = on;
        self
    }

    /// The tiers.
    pub fn tiers(&self) -> &[Arc<dyn Tier>] {
        &self.tiers
    }

    pub(super) fn clear_pool(&self, pool: u32) {
        for t in &self.tiers {
            // Best effort: a tier that is down now is cleared when it returns
            // (tiers also clear their namespace when they start).
            let _ = t.clear_pool(pool);
        }
    }

    /// Seals `plain` and offers it to the tiers in order; returns the tier
    /// that took it and the version it was sealed under. The caller has sent
    /// the queued removals.
    fn put_one(&self, shared: &Shared, tkey: TierKey, plain: &[u8]) -> Option<(usize, u64)> {
        let version = shared.next_version.fetch_add(1, Ordering::Relaxed);
        let mut sealed = Vec::with_capacity(plain.len() + tmem_tier::seal::SEAL_OVERHEAD);
        self.sealer.seal(tkey, version, plain, &mut sealed);
        for (i, t) in self.tiers.iter().enumerate() {
            if let Ok(TierPut::Stored) = t.put(tkey, &sealed) {
                return Some((i, version));
            }
        }
        None
    }
}

/// Writeback to the tiers held off for a hand-over ([`Store::hold_tiers`]),
/// until this is dropped.
#[must_use]
pub struct TierHold {
    pools: Vec<Arc<Pool>>,
}

impl TierHold {
    /// Describes every tier below every pool for a successor
    /// ([`Tier::hand_over`]): per pool with tiers, its id and its tiers'
    /// states in chain order. A tier below two pools is refused: the
    /// successor would adopt it twice.
    pub fn hand_over(&self) -> Result<Vec<(u32, Vec<tmem_tier::TierHandover>)>, StoreError> {
        let all: Vec<&Arc<dyn Tier>> = self.pools.iter().flat_map(|p| p.chain.iter().flat_map(|c| &c.tiers)).collect();
        if let Some(t) = all.iter().enumerate().find(|(i, t)| all[..*i].iter().any(|o| Arc::ptr_eq(o, t))) {
            return Err(StoreError::TierChain(format!("hand-over: tier {} is below two pools", t.1.name())));
        }
        let mut out = Vec::new();
        for p in &self.pools {
            let chain = p.chain.as_ref().expect("held pools have tiers");
            let states = chain.tiers.iter().map(|t| t.hand_over()).collect::<Result<Vec<_>, _>>();
            out.push((p.id, states.map_err(|e| StoreError::TierChain(format!("hand-over: {e}")))?));
        }
        Ok(out)
    }
}

impl Drop for TierHold {
    fn drop(&mut self) {
        for p in &self.pools {
            p.tier_puts.set_held(false);
        }
    }
}

impl Store {
    /// Every distinct tier below the store's pools.
    pub fn tiers(&self) -> Vec<Arc<dyn Tier>> {
        distinct_tiers(&self.shared.pools_snapshot())
    }

    /// Holds writeback to the tiers off and sends the tier removals queued
    /// so far, so that the tiers hold exactly what the index names: for a
    /// hand-over ([`TierHold::hand_over`]), while the caller keeps writers
    /// (puts, removes, gets that promote) out.
    pub fn hold_tiers(&self) -> TierHold {
        let pools: Vec<Arc<Pool>> =
            self.shared.pools.read().iter().flatten().filter(|p| p.chain.is_some()).cloned().collect();
        for p in &pools {
            p.tier_puts.set_held(true);
            p.removals.send(p.chain.as_ref().expect("filtered"));
        }
        TierHold { pools }
    }
}

/// A page recorded in a tier of a pool without tiers.
fn no_chain() -> StoreError {
    StoreError::TierChain("page recorded in a tier but the pool has none".into())
}

/// A page recorded in a tier the chain doesn't have.
fn no_tier(e: &Entry) -> StoreError {
    StoreError::TierChain(format!("no tier {}", e.tier()))
}

/// Every distinct tier below `pools`.
fn distinct_tiers(pools: &[Arc<Pool>]) -> Vec<Arc<dyn Tier>> {
    let mut out: Vec<Arc<dyn Tier>> = Vec::new();
    for t in pools.iter().flat_map(|p| p.chain.iter().flat_map(|c| c.tiers.iter())) {
        if !out.iter().any(|o| Arc::ptr_eq(o, t)) {
            out.push(Arc::clone(t));
        }
    }
    out
}

/// Counters of every distinct tier of `pools`.
pub(super) fn tier_stats(pools: &[Arc<Pool>]) -> Vec<TierStats> {
    distinct_tiers(pools).iter().map(|t| TierStats { health: t.health().to_string(), ..t.stats() }).collect()
}

/// What one writeback pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct WritebackReport {
    /// Pages moved to a tier.
    pub pages: u64,
    /// Pool bytes (allocator slots) freed.
    pub slot_bytes: u64,
    /// Pages no tier would take.
    pub refused: u64,
}

struct Victim {
    key: Key,
    tkey: TierKey,
    /// What goes to the tier: the stored object, or (`raw`) the page of a
    /// grouped entry until it is encoded on its own.
    data: Vec<u8>,
    raw: bool,
    /// Codec, checksum and raw flag of `data` once encoded: the entry takes
    /// them when it switches to the tier.
    codec: u8,
    check: u32,
    incompressible: bool,
}

impl Pool {
    fn tier_key(&self, key: Key) -> TierKey {
        TierKey { pool: self.id, object: key.object, index: key.index }
    }

    /// Sends an incompressible page straight to the tiers and inserts its
    /// entry; `None` when no tier took it.
    pub(super) fn incompressible_to_tier(
        &self,
        key: Key,
        hash: u64,
        page: &[u8; PAGE_SIZE],
        work: Work,
    ) -> Option<Result<PutOutcome, StoreError>> {
        let chain = self.chain.as_ref()?;
        let _stripe = self.tier_puts.lock_one(hash);
        self.removals.send(chain);
        let (tier, version) = chain.put_one(&self.shared, self.tier_key(key), page)?;
        let mut e = Entry::new(key, 0, crc32fast::hash(page), PAGE_SIZE, RAW_CODEC, F_INCOMPRESSIBLE);
        e.set_tier(tier, version);
        self.shard_of(key, hash).lock().c.incompressible_to_tier += 1;
        Some(self.insert_entry(key, hash, e, work))
    }

    /// Queues the removal of the tier copy of `e`, which has just left its
    /// shard; call it under that shard's lock (see [`TierRemovals`]). Returns
    /// whether the queue should be sent (outside the lock).
    pub(super) fn queue_tier_copy(&self, key: Key, e: &Entry) -> bool {
        e.has(F_TIER)
            && self.chain.as_ref().is_some_and(|c| e.tier() < c.tiers.len())
            && self.removals.push(e.tier(), self.tier_key(key))
    }

    /// Sends the queued tier removals now.
    pub(super) fn send_tier_removals(&self) {
        if let Some(chain) = &self.chain {
            self.removals.send(chain);
        }
    }

    /// Serves a get whose page lives in a tier. Runs without the shard lock.
    pub(super) fn get_from_tier(
        &self,
        key: Key,
        hash: u64,
        e: Entry,
        out: &mut [u8; PAGE_SIZE],
    ) -> Result<GetOutcome, StoreError> {
        let fetched = match &self.chain {
            Some(chain) => self.fetch_from_tier(chain, key, &e, out),
            None => Err(no_chain()),
        };
        self.finish_tier_get(key, hash, e, fetched, out)
    }

    /// Serves several gets whose pages live in tiers, with one `get_batch`
    /// per tier: `(index into outs, key, hash, entry)` each. Runs without
    /// shard locks.
    pub(super) fn get_batch_from_tiers(
        &self,
        items: &[(usize, Key, u64, Entry)],
        outs: &mut [[u8; PAGE_SIZE]],
        results: &mut [Option<Result<GetOutcome, StoreError>>],
    ) {
        let Some(chain) = &self.chain else {
            for &(i, key, hash, e) in items {
                results[i] = Some(self.finish_tier_get(key, hash, e, Err(no_chain()), &mut outs[i]));
            }
            return;
        };
        for (t, tier) in chain.tiers.iter().enumerate() {
            let mine: Vec<&(usize, Key, u64, Entry)> = items.iter().filter(|it| it.3.tier() == t).collect();
            if mine.is_empty() {
                continue;
            }
            let tkeys: Vec<TierKey> = mine.iter().map(|it| self.tier_key(it.1)).collect();
            let values = tier.get_batch(&tkeys);
            for (&&(i, key, hash, e), value) in mine.iter().zip(values) {
                let out = &mut outs[i];
                let fetched = match value {
                    Ok(mut v) => self.open_fetched(chain, tier.as_ref(), key, &e, Ok(v.as_mut()), out),
                    Err(err) => self.open_fetched(chain, tier.as_ref(), key, &e, Err(err), out),
                };
                results[i] = Some(self.finish_tier_get(key, hash, e, fetched, &mut outs[i]));
            }
        }
        for &(i, key, hash, e) in items {
            if results[i].is_none() {
                results[i] = Some(self.finish_tier_get(key, hash, e, Err(no_tier(&e)), &mut outs[i]));
            }
        }
    }

    /// Counts a tier get and applies exclusive gets and promotion.
    fn finish_tier_get(
        &self,
        key: Key,
        hash: u64,
        e: Entry,
        fetched: Result<(), StoreError>,
        out: &mut [u8; PAGE_SIZE],
    ) -> Result<GetOutcome, StoreError> {
        if let Err(err) = fetched {
            PoolEvents::bump(&self.events.tier_get_fail);
            out.fill(0);
            return Err(err);
        }
        let Some(chain) = &self.chain else { return Ok(GetOutcome::Hit) };
        let mut s = self.shard_of(key, hash).lock();
        s.c.succ_gets += 1;
        s.c.tier_gets += 1;
        s.c.decompressions += u64::from(!e.has(F_INCOMPRESSIBLE));
        let promote = chain.promote_on_get && !self.cfg.exclusive_gets;
        // Act only if the key still holds the page we read.
        let same = s.find(key, hash).filter(|&h| {
            let cur = s.entries.get(h);
            cur.has(F_TIER) && cur.loc == e.loc
        });
        if let Some(h) = same {
            if self.cfg.exclusive_gets {
                let gone = s.remove_handle(h);
                self.forget(&mut s, &gone);
                self.account(&mut s);
                let long = self.queue_tier_copy(key, &gone);
                drop(s);
                if long {
                    self.send_tier_removals();
                }
            } else if promote {
                drop(s);
                // Re-inserting replaces the tier entry and removes the tier copy.
                let page = *out;
                let _ = self.put(key, &page)?;
            }
        }
        Ok(GetOutcome::Hit)
    }

    /// Reads, opens, checks and decodes the tier copy of `e` into `out`.
    fn fetch_from_tier(
        &self,
        chain: &TierChain,
        key: Key,
        e: &Entry,
        out: &mut [u8; PAGE_SIZE],
    ) -> Result<(), StoreError> {
        let tier = chain.tiers.get(e.tier()).ok_or_else(|| no_tier(e))?;
        TIER_VALUE.with(|cell| {
            let mut own = Vec::new();
            let mut slot = cell.try_borrow_mut();
            // Only a get made from inside another's: a buffer of its own.
            let buf = match &mut slot {
                Ok(b) => &mut **b,
                Err(_) => &mut own,
            };
            buf.clear();
            let got = tier.get(self.tier_key(key), buf);
            let value = got.map(|g| matches!(g, TierGet::Hit).then_some(&mut *buf));
            self.open_fetched(chain, tier.as_ref(), key, e, value, out)
        })
    }

    /// Opens what `tier` answered for `e`'s key (`None`: it has no value).
    fn open_fetched(
        &self,
        chain: &TierChain,
        tier: &dyn Tier,
        key: Key,
        e: &Entry,
        value: Result<Option<&mut Vec<u8>>, TierError>,
        out: &mut [u8; PAGE_SIZE],
    ) -> Result<(), StoreError> {
        match value {
            Ok(Some(buf)) => self.open_tier_value(chain, tier, key, e, buf, out),
            Ok(None) => {
                Err(StoreError::Corrupt { pool: self.id, key, reason: format!("tier {} lost the page", tier.name()) })
            }
            Err(source) => Err(StoreError::Tier { pool: self.id, key, source }),
        }
    }

    /// Opens, checks and decodes a value read from `tier` for `e` into `out`.
    fn open_tier_value(
        &self,
        chain: &TierChain,
        tier: &dyn Tier,
        key: Key,
        e: &Entry,
        buf: &mut Vec<u8>,
        out: &mut [u8; PAGE_SIZE],
    ) -> Result<(), StoreError> {
        let corrupt = |reason: String| StoreError::Corrupt { pool: self.id, key, reason };
        chain
            .sealer
            .open(self.tier_key(key), e.loc, buf)
            .map_err(|err| corrupt(format!("tier {}: {err}", tier.name())))?;
        if buf.len() != e.len() || crc32fast::hash(buf) != e.check {
            return Err(corrupt(format!("tier {}: checksum mismatch", tier.name())));
        }
        let codec = self.shared.codec(e.codec())?;
        codec.decompress(buf, out).map_err(|err| {
            PoolEvents::bump(&self.events.decompress_fail);
            corrupt(err.to_string())
        })
    }

    /// Encodes the page of a grouped victim on its own, with the codec new
    /// puts use (raw when that does not shrink it, as an incompressible put
    /// to a tier is).
    fn encode_single(&self, v: &mut Victim) {
        let sh = &*self.shared;
        let id = sh.current_codec.load(Ordering::Relaxed);
        let mut buf = [0u8; COMPRESS_BUF_SIZE];
        let page: &[u8; PAGE_SIZE] = v.data.as_slice().try_into().expect("a grouped victim is one page");
        let n = sh.codec(id).ok().and_then(|c| c.compress(page, &mut buf).ok());
        match n {
            Some(n) if n <= sh.policy.max_compressed_size() && n < PAGE_SIZE => {
                (v.codec, v.incompressible) = (id, false);
                v.data = buf[..n].to_vec();
            }
            _ => (v.codec, v.incompressible) = (RAW_CODEC, true),
        }
        v.check = crc32fast::hash(&v.data);
        v.raw = false;
    }

    /// Moves up to `max_pages` of the oldest pool pages (second chance for
    /// referenced ones) to the tiers.
    pub fn write_back(&self, max_pages: usize) -> WritebackReport {
        let mut report = WritebackReport::default();
        let Some(chain) = &self.chain else { return report };
        let shards = self.shards.len();
        let mut idle = 0;
        let mut moved = 0usize;
        while moved < max_pages && idle < shards && !self.destroyed.load(Ordering::Acquire) {
            let i = self.wb_cursor.fetch_add(1, Ordering::Relaxed) % shards;
            let batch = WB_BATCH.min(max_pages - moved);
            let r = self.write_back_shard(chain, i, batch);
            if r.pages == 0 {
                idle += 1;
            } else {
                idle = 0;
            }
            report.pages += r.pages;
            moved += usize::try_from(r.pages).unwrap_or(usize::MAX);
            report.slot_bytes += r.slot_bytes;
            report.refused += r.refused;
            if r.refused > 0 && r.pages == 0 {
                // Every tier is full or failing: stop rather than spin.
                break;
            }
        }
        report
    }

    fn write_back_shard(&self, chain: &TierChain, i: usize, max: usize) -> WritebackReport {
        let mut report = WritebackReport::default();
        let _one_writeback = self.tier_puts.writeback[i].lock();
        if self.tier_puts.held.load(Ordering::SeqCst) {
            return report;
        }
        // 1. Pick victims and copy their bytes out, under the shard lock.
        let mut victims = Vec::new();
        {
            let mut s = self.shards[i].0.lock();
            let mut skipped = Vec::new();
            while victims.len() < max {
                let Some(h) = s.lru_victim() else { break };
                s.lru_unlink(h);
                let e = *s.entries.get(h);
                let (data, raw) = if let Some(loc) = e.alloc_loc() {
                    // SAFETY: the entry is live in this shard and we hold its lock,
                    // so the object is neither freed nor migrated while we copy it.
                    (unsafe { self.shared.alloc.object(loc, e.len()) }.to_vec(), false)
                } else if e.has(F_GROUP) {
                    // Out of its group as a single page, encoded below,
                    // outside the lock; the group keeps a tombstone.
                    let mut page = [0u8; PAGE_SIZE];
                    match self.read_grouped(&mut s, &e, &mut page) {
                        Ok(_) => (page.to_vec(), true),
                        // Corrupt: left for its get to report.
                        Err(_) => (Vec::new(), false),
                    }
                } else {
                    (Vec::new(), false)
                };
                if data.is_empty() {
                    // Same-filled pages cost no pool memory: keep them.
                    skipped.push(h);
                    if skipped.len() > max {
                        break;
                    }
                    continue;
                }
                s.entries.get_mut(h).meta |= F_WB;
                victims.push(Victim {
                    key: e.key(),
                    tkey: self.tier_key(e.key()),
                    data,
                    raw,
                    codec: e.codec(),
                    check: e.check,
                    incompressible: e.has(F_INCOMPRESSIBLE),
                });
            }
            for h in skipped {
                s.lru_push_front(h);
            }
            // Decoding a group may have grown the block cache.
            self.account(&mut s);
        }
        if victims.is_empty() {
            return report;
        }
        // 2. Order against incompressible puts of the same keys (see
        // TierPutLocks): a victim replaced meanwhile has lost its F_WB mark.
        let _stripes = self.tier_puts.lock_all(victims.iter().map(|v| hash_key(v.key)));
        {
            let s = self.shards[i].0.lock();
            victims.retain(|v| s.find(v.key, hash_key(v.key)).is_some_and(|h| s.entries.get(h).has(F_WB)));
        }
        if victims.is_empty() {
            return report;
        }
        for v in victims.iter_mut().filter(|v| v.raw) {
            self.encode_single(v);
        }
        // In key order, so that a tier lays neighbours side by side and a
        // readahead's pages come back with one read (a shard keeps each
        // window of indexes together: `StoreConfig::shard_windows`).
        victims.sort_unstable_by_key(|v| (v.key.object, v.key.index));
        // 3. Seal and offer them to the tiers in order, in batches, after the
        // removals queued so far (some may be of these keys' older copies).
        self.removals.send(chain);
        let mut sealed: Vec<(u64, Vec<u8>)> = victims
            .iter()
            .map(|v| {
                let version = self.shared.next_version.fetch_add(1, Ordering::Relaxed);
                let mut out = Vec::with_capacity(v.data.len() + tmem_tier::seal::SEAL_OVERHEAD);
                chain.sealer.seal(v.tkey, version, &v.data, &mut out);
                (version, out)
            })
            .collect();
        let mut placed: Vec<Option<usize>> = vec![None; victims.len()];
        for (t, tier) in chain.tiers.iter().enumerate() {
            let pending: Vec<usize> = (0..victims.len()).filter(|&j| placed[j].is_none()).collect();
            if pending.is_empty() {
                break;
            }
            let items: Vec<(TierKey, &[u8])> =
                pending.iter().map(|&j| (victims[j].tkey, sealed[j].1.as_slice())).collect();
            for (r, &j) in tier.put_batch(&items).into_iter().zip(&pending) {
                if let Ok(TierPut::Stored) = r {
                    placed[j] = Some(t);
                }
            }
        }
        // 4. Under the lock again: switch entries that still hold the page we
        // copied to their tier; put the rest back on the LRU.
        let mut stale = Vec::new();
        {
            let mut s = self.shards[i].0.lock();
            for (j, v) in victims.iter().enumerate() {
                let hash = hash_key(v.key);
                let h = s.find(v.key, hash).filter(|&h| s.entries.get(h).has(F_WB));
                match (h, placed[j]) {
                    (Some(h), Some(t)) => {
                        let e = *s.entries.get(h);
                        Pool::uncount(&mut s.c, &e);
                        // Its object, or its slot in its group (a group
                        // rewrite may have moved it meanwhile: the page is
                        // the same, F_WB says so).
                        report.slot_bytes += self.release(&mut s, &e);
                        let cur = s.entries.get_mut(h);
                        // The entry describes what the tier now holds.
                        cur.recode(0, v.check, v.data.len(), v.codec);
                        cur.meta &= !(F_GROUP | F_INCOMPRESSIBLE);
                        if v.incompressible {
                            cur.meta |= F_INCOMPRESSIBLE;
                        }
                        cur.set_tier(t, sealed[j].0);
                        let cur = *cur;
                        Pool::count(&mut s.c, &cur);
                        s.c.written_back_pages += 1;
                        report.pages += 1;
                    }
                    (Some(h), None) => {
                        s.entries.get_mut(h).meta &= !F_WB;
                        s.lru_push_front(h);
                        report.refused += 1;
                    }
                    (None, Some(t)) => {
                        // Replaced or flushed meanwhile. A replacement that
                        // went to this same tier has overwritten our value.
                        let replaced_here = s.find(v.key, hash).is_some_and(|h| {
                            let e = s.entries.get(h);
                            e.has(F_TIER) && e.tier() == t
                        });
                        if !replaced_here {
                            stale.push((t, v.tkey));
                        }
                    }
                    (None, None) => {}
                }
            }
            self.account(&mut s);
        }
        if report.refused > 0 {
            PoolEvents::bump(&self.events.tier_put_fail);
        }
        // The key was replaced or flushed meanwhile: its tier copy is stale.
        // (Queued under the shard's writeback lock, which a writeback of the
        // key's next page must take.)
        let mut long = false;
        for (t, tkey) in stale {
            long |= self.removals.push(t, tkey);
        }
        if long {
            self.removals.send(chain);
        }
        sealed.clear();
        report
    }
}

impl Shared {
    /// Sends the queued tier removals of every pool.
    pub(super) fn send_tier_removals(&self) {
        for p in self.pools_snapshot() {
            p.send_tier_removals();
        }
    }

    /// Writes back from every pool with tiers until usage is below `target`.
    pub(super) fn write_back_until(&self, target: u64) -> bool {
        let pools: Vec<Arc<Pool>> = self.pools_snapshot().into_iter().filter(|p| p.chain.is_some()).collect();
        if pools.is_empty() {
            return false;
        }
        loop {
            let over = self.total_bytes().saturating_sub(target);
            if over == 0 {
                return true;
            }
            // Free about what we are over (plus a margin for fragmentation),
            // then compact so freed slots become freed spans.
            let mut freed = 0;
            let mut moved = 0;
            for p in &pools {
                while freed < over + over / 4 {
                    let r = p.write_back(WB_BATCH * 4);
                    freed += r.slot_bytes;
                    moved += r.pages;
                    if r.pages == 0 {
                        break;
                    }
                }
            }
            self.compact();
            if self.total_bytes() < target {
                return true;
            }
            if moved == 0 {
                return false;
            }
        }
    }
}

/// Background writeback: keeps usage under the accept threshold.
pub type WritebackWorker = super::worker::Worker;

/// The writeback thread's job: sends queued tier removals, and writes back
/// once usage nears the accept threshold, down to a little below it.
pub(super) fn writeback_job(shared: &Shared) {
    shared.send_tier_removals();
    let limit = shared.policy.limit_bytes();
    if limit == u64::MAX {
        return;
    }
    let accept = shared.policy.accept_bytes();
    let high = accept.saturating_sub(limit / 20);
    if shared.total_bytes() >= high {
        shared.write_back_until(accept.saturating_sub(limit / 10));
    }
}
