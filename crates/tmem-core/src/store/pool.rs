//! A pool and its per-key paths: put, get, flush, eviction and its
//! counters, each under the one shard lock of the key.

use super::*;

#[repr(align(128))]
pub(super) struct PaddedShard(pub(super) Mutex<Shard>);

/// Outcome of the pool part of a get.
pub(super) enum LocalGet {
    /// Served: hit, miss or error.
    Done(Result<GetOutcome, StoreError>),
    /// The page is in a lower tier.
    InTier(Entry),
}

/// A pool: a namespace of pages with one kind and one get mode. Obtained
/// from [`Store::create_pool`] or [`Store::pool`]; holding the `Arc` lets a
/// frontend skip the id lookup on every operation.
pub struct Pool {
    pub(super) id: PoolId,
    pub(super) cfg: PoolConfig,
    pub(super) shards: Box<[PaddedShard]>,
    pub(super) events: PoolEvents,
    pub(super) destroyed: AtomicBool,
    pub(super) shared: Arc<Shared>,
    /// Tiers below the pool, if any.
    pub(super) chain: Option<TierChain>,
    /// Next shard writeback visits.
    pub(super) wb_cursor: AtomicUsize,
    /// Stale tier copies waiting to be removed.
    pub(super) removals: tiering::TierRemovals,
    /// A deferred put queued enough removals to send them ([`Pool::maintain`]).
    pub(super) removals_due: AtomicBool,
    /// A deferred put freed an object: compaction may be due ([`Pool::maintain`]).
    pub(super) compaction_due: AtomicBool,
    /// Orders writeback and incompressible puts of one key to the tiers.
    pub(super) tier_puts: tiering::TierPutLocks,
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

    /// The tiers below the pool, if any.
    pub fn tier_chain(&self) -> Option<&TierChain> {
        self.chain.as_ref()
    }

    pub(super) fn check_live(&self) -> Result<(), StoreError> {
        if self.destroyed.load(Ordering::Acquire) {
            return Err(StoreError::PoolDestroyed(self.id));
        }
        Ok(())
    }

    /// The shard of `key` (whose [`hash_key`] is `hash`). A store that groups
    /// cold pages places a whole window of indexes in one shard (the hash of
    /// the window picks it), so that a group's pages share its shard lock.
    pub(super) fn shard_of(&self, key: Key, hash: u64) -> &Mutex<Shard> {
        &self.shards[self.shard_index(key, hash)].0
    }

    pub(super) fn shard_index(&self, key: Key, hash: u64) -> usize {
        let h = match self.shared.window_shift {
            0 => hash,
            shift => hash_key(Key::new(key.object, key.index >> shift)),
        };
        usize::try_from(h >> 40).expect("24 bits fit usize") & (self.shards.len() - 1)
    }

    /// Updates the store-wide metadata count after a shard changed size,
    /// first shrinking its storage if it has become sparse (so callers hold
    /// no entry handle past this call).
    pub(super) fn account(&self, s: &mut Shard) {
        s.shrink_if_sparse();
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

    /// Counts an entry in. A grouped entry counts as a page of its group's
    /// codec; the group's block bytes are counted with the group.
    pub(super) fn count(c: &mut ShardCounters, e: &Entry) {
        c.stored_pages += 1;
        if e.has(F_TIER) {
            c.tier_pages += 1;
        } else if e.has(F_GROUP) {
            c.group_pages += 1;
            c.group_codec_pages[usize::from(e.codec())] += 1;
        } else if e.has(F_SAME) {
            c.same_filled_pages += 1;
        } else {
            c.compr_data_size += e.len() as u64;
            c.codec_pages[usize::from(e.codec())] += 1;
            c.codec_bytes[usize::from(e.codec())] += e.len() as u64;
        }
        if e.has(F_INCOMPRESSIBLE) {
            c.stored_incompressible_pages += 1;
        }
    }

    /// Counts an entry out.
    pub(super) fn uncount(c: &mut ShardCounters, e: &Entry) {
        c.stored_pages -= 1;
        if e.has(F_TIER) {
            c.tier_pages -= 1;
        } else if e.has(F_GROUP) {
            c.group_pages -= 1;
            c.group_codec_pages[usize::from(e.codec())] -= 1;
        } else if e.has(F_SAME) {
            c.same_filled_pages -= 1;
        } else {
            c.compr_data_size -= e.len() as u64;
            c.codec_pages[usize::from(e.codec())] -= 1;
            c.codec_bytes[usize::from(e.codec())] -= e.len() as u64;
        }
        if e.has(F_INCOMPRESSIBLE) {
            c.stored_incompressible_pages -= 1;
        }
    }

    /// Releases the pool memory of an entry removed from shard `s` and fixes
    /// counters; returns the allocator slot bytes freed. A grouped page
    /// becomes a tombstone of its group (freed with its last page). A copy
    /// in a lower tier is queued for removal by [`Pool::queue_tier_copy`],
    /// under the same shard lock.
    pub(super) fn forget(&self, s: &mut Shard, e: &Entry) -> u64 {
        Self::uncount(&mut s.c, e);
        self.release(s, e)
    }

    /// Frees what `e` holds (its object, or its slot in its group); the
    /// caller has uncounted it. Returns the slot bytes freed.
    pub(super) fn release(&self, s: &mut Shard, e: &Entry) -> u64 {
        if let Some(loc) = e.alloc_loc() {
            let bytes = self.shared.alloc.slot_size(loc) as u64;
            self.shared.alloc.free(loc);
            bytes
        } else if e.has(F_GROUP) {
            self.tombstone(s, e)
        } else {
            0
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
        let admitted = self.shared.make_room_if_full(self.cfg.kind);
        if self.removals_due.swap(false, Ordering::Relaxed) {
            self.send_tier_removals();
        }
        if self.compaction_due.swap(false, Ordering::Relaxed) {
            self.shared.maybe_compact();
        }
        admitted
    }

    pub(super) fn put_with(&self, key: Key, page: &[u8; PAGE_SIZE], work: Work) -> Result<PutOutcome, StoreError> {
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
    pub(super) fn insert_entry(&self, key: Key, hash: u64, entry: Entry, work: Work) -> Result<PutOutcome, StoreError> {
        let (old, long, group_freed) = {
            let mut s = self.shard_of(key, hash).lock();
            let old = s.insert(entry, hash);
            let mut group_freed = false;
            if let Some(old) = &old {
                // The older copy's object is freed below, outside the lock;
                // a grouped one is a tombstone of its group from now (and
                // the group is freed here if that was its last page).
                Self::uncount(&mut s.c, old);
                group_freed = old.has(F_GROUP) && self.tombstone(&mut s, old) > 0;
            }
            let c = &mut s.c;
            c.succ_puts += 1;
            Self::count(c, &entry);
            c.compressions += u64::from(entry.alloc_loc().is_some() && !entry.has(F_INCOMPRESSIBLE));
            self.account(&mut s);
            // A new value in the same tier has already overwritten the old one.
            let long = old.as_ref().is_some_and(|old| {
                !(entry.has(F_TIER) && old.has(F_TIER) && entry.tier() == old.tier()) && self.queue_tier_copy(key, old)
            });
            (old, long, group_freed)
        };
        match (long, work) {
            (true, Work::Inline) => self.send_tier_removals(),
            (true, Work::Deferred) => self.removals_due.store(true, Ordering::Relaxed),
            (false, _) => {}
        }
        let old_loc = old.and_then(|o| o.alloc_loc());
        if let Some(loc) = old_loc {
            // Safe outside the shard lock: the entry is unreachable, so
            // neither gets nor compaction can see this object any more.
            self.shared.alloc.free(loc);
        }
        if old_loc.is_some() || group_freed {
            match work {
                Work::Inline => self.shared.maybe_compact(),
                Work::Deferred => self.compaction_due.store(true, Ordering::Relaxed),
            }
        }
        Ok(PutOutcome::Stored)
    }

    pub(super) fn refuse(&self, key: Key, why: Reject, counter: &AtomicU64) -> PutOutcome {
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

    /// As [`Pool::get`], from the pool's own memory only: a page in a lower
    /// tier stays there, and `None` says so. For read-ahead, which must not
    /// wait on a tier's I/O.
    pub fn get_in_memory(&self, key: Key, out: &mut [u8; PAGE_SIZE]) -> Result<Option<GetOutcome>, StoreError> {
        self.check_live()?;
        match self.get_local(key, hash_key(key), out) {
            LocalGet::Done(r) => r.map(Some),
            LocalGet::InTier(_) => Ok(None),
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
    pub(super) fn get_local(&self, key: Key, hash: u64, out: &mut [u8; PAGE_SIZE]) -> LocalGet {
        let mut s = self.shard_of(key, hash).lock();
        let Some(h) = s.find(key, hash) else {
            s.c.failed_gets += 1;
            return LocalGet::Done(Ok(GetOutcome::Miss));
        };
        let e = *s.entries.get(h);
        if e.has(F_TIER) {
            return LocalGet::InTier(e);
        }
        let mut grew = false;
        if e.has(F_GROUP) {
            match self.read_grouped(&mut s, &e, out) {
                Ok(g) => grew = g,
                Err(reason) => {
                    PoolEvents::bump(&self.events.decompress_fail);
                    out.fill(0);
                    return LocalGet::Done(Err(StoreError::Corrupt { pool: self.id, key, reason }));
                }
            }
            s.c.decompressions += 1;
        } else if let Some(loc) = e.alloc_loc() {
            if let Err(reason) = self.decode(&e, loc, out) {
                PoolEvents::bump(&self.events.decompress_fail);
                out.fill(0);
                return LocalGet::Done(Err(StoreError::Corrupt { pool: self.id, key, reason }));
            }
            s.c.decompressions += u64::from(!e.has(F_INCOMPRESSIBLE));
            s.c.recompressed_reads += u64::from(e.codec() == self.shared.recompress_target.load(Ordering::Relaxed));
        } else {
            fill_page(out, e.loc);
        }
        s.c.succ_gets += 1;
        if self.cfg.exclusive_gets {
            let e = s.remove_handle(h);
            self.forget(&mut s, &e);
            self.account(&mut s);
        } else {
            s.entries.get_mut(h).meta |= F_REFERENCED | F_HOT;
            if self.cfg.kind == PoolKind::Ephemeral && self.cfg.eviction == Eviction::Lru {
                s.lru_touch(h);
            }
            if grew {
                // The block cache allocated a buffer: count it (last: this
                // may rebuild the shard's storage, and `h` with it).
                self.account(&mut s);
            }
        }
        LocalGet::Done(Ok(GetOutcome::Hit))
    }

    /// Checks and decodes the object of `e`. The caller holds the shard lock.
    pub(super) fn decode(&self, e: &Entry, loc: Loc, out: &mut [u8; PAGE_SIZE]) -> Result<(), String> {
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
        Ok(self.shard_of(key, hash).lock().find(key, hash).is_some())
    }

    /// Removes the page under `key`; returns whether there was one.
    pub fn flush_page(&self, key: Key) -> Result<bool, StoreError> {
        self.check_live()?;
        Ok(self.remove(key, true))
    }

    pub(super) fn remove(&self, key: Key, count: bool) -> bool {
        let hash = hash_key(key);
        let mut s = self.shard_of(key, hash).lock();
        let Some(e) = s.remove_key(key, hash) else { return false };
        if count {
            s.c.flushes += 1;
        }
        self.forget(&mut s, &e);
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
                self.forget(&mut s, &e);
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

    /// Drops up to `max` pages of shard `i`, chosen by the pool's eviction
    /// policy, to make room for a put into a pool of kind `for_kind`;
    /// returns pages and object bytes freed.
    pub(super) fn evict_from_shard(&self, i: usize, max: usize, for_kind: PoolKind) -> (usize, u64) {
        if self.destroyed.load(Ordering::Acquire) {
            return (0, 0);
        }
        let mut s = self.shards[i].0.lock();
        let mut n = 0;
        let mut bytes = 0;
        while n < max {
            let victim = match self.cfg.eviction {
                Eviction::Sieve => s.sieve_victim(),
                Eviction::Lru => s.lru_tail(),
            };
            let Some(h) = victim else { break };
            let e = s.remove_handle(h);
            bytes += self.forget(&mut s, &e);
            s.c.evicted_pages += 1;
            match for_kind {
                PoolKind::Persistent => s.c.evicted_for_persistent += 1,
                PoolKind::Ephemeral => s.c.evicted_for_ephemeral += 1,
            }
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
            c.evicted_for_persistent += x.evicted_for_persistent;
            c.evicted_for_ephemeral += x.evicted_for_ephemeral;
            c.compressions += x.compressions;
            c.decompressions += x.decompressions;
            c.tier_pages += x.tier_pages;
            c.written_back_pages += x.written_back_pages;
            c.tier_gets += x.tier_gets;
            c.incompressible_to_tier += x.incompressible_to_tier;
            c.group_pages += x.group_pages;
            c.groups += x.groups;
            c.group_bytes += x.group_bytes;
            c.group_dead_pages += x.group_dead_pages;
            c.group_cache_hits += x.group_cache_hits;
            c.group_cache_misses += x.group_cache_misses;
        }
        PoolStats::from_parts(self.id, self.cfg.kind, &c, &self.events)
    }

    /// Compressed pages and their bytes in the pool, by codec id: single
    /// pages, and pages held in groups.
    pub(super) fn codec_usage(&self) -> [([u64; MAX_CODECS], [u64; MAX_CODECS]); 2] {
        let mut usage = [([0; MAX_CODECS], [0; MAX_CODECS]); 2];
        for shard in self.shards.iter() {
            let s = shard.0.lock();
            for i in 0..MAX_CODECS {
                usage[0].0[i] += s.c.codec_pages[i];
                usage[0].1[i] += s.c.codec_bytes[i];
                usage[1].0[i] += s.c.group_codec_pages[i];
                usage[1].1[i] += s.c.group_codec_bytes[i];
            }
        }
        usage
    }

    /// Destroys the pool's pages; later operations fail with `PoolDestroyed`.
    pub(super) fn destroy(&self) {
        self.destroyed.store(true, Ordering::Release);
        for shard in self.shards.iter() {
            let mut s = shard.0.lock();
            for e in s.drain() {
                self.forget(&mut s, &e);
            }
            debug_assert!(s.groups.is_empty(), "a group outlived its pages");
            s.cache.clear();
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
        let s = self.shard_of(key, hash).lock();
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
    pub(super) fn pool_limit_hit_counted(&self) -> AtomicU64 {
        AtomicU64::new(0)
    }
}
