//! What every pool of a store shares: policy, allocator, codecs, the pool
//! table, and the admission path (limit, making room, compaction).

use std::sync::atomic::AtomicU32;

use super::*;

pub(super) struct Shared {
    pub(super) alloc: ZsAlloc,
    pub(super) policy: Policy,
    pub(super) codecs: [OnceLock<Arc<dyn Codec>>; MAX_CODECS],
    /// What each codec was built from (a hand-over sends these).
    pub(super) codec_configs: [OnceLock<CodecConfig>; MAX_CODECS],
    pub(super) codec_count: Mutex<usize>,
    pub(super) current_codec: AtomicU8,
    /// Set when the limit was hit; cleared once usage is below the accept threshold.
    pub(super) reached_full: AtomicBool,
    /// Index metadata (entries, hash tables) over all pools.
    pub(super) index_meta: AtomicU64,
    /// Codec metadata (dictionaries).
    pub(super) codec_meta: AtomicU64,
    /// Pools by id; destroyed pools leave `None`, ids are not reused.
    pub(super) pools: RwLock<Vec<Option<Arc<Pool>>>>,
    /// One compaction at a time.
    pub(super) compaction: Mutex<()>,
    pub(super) evict_cursor: AtomicUsize,
    /// Sealing versions: never reused, so (key, version) nonces are unique.
    pub(super) next_version: AtomicU64,
    /// Time base for `room_failed_at`.
    pub(super) clock: std::time::Instant,
    /// When making room last failed (ns since `clock`; 0: it did not).
    pub(super) room_failed_at: AtomicU64,
    /// Writebacks a put's own thread ran to make room (`Stats::writeback_waits`).
    pub(super) writeback_waits: AtomicU64,
    /// Automatic dictionary training, if configured or armed by hand.
    pub(super) auto_dictionary: std::sync::OnceLock<dictionary::AutoDictionary>,
    /// Background recompression's codec and state, once set up.
    pub(super) recompress_status: Mutex<Option<String>>,
    /// The codec id recompression moves pages to ([`NO_RECOMPRESSION`]
    /// while none): gets of its pages are counted.
    pub(super) recompress_target: AtomicU8,
    /// Recompression runs a pass every this many periods (1, or more while
    /// backing off).
    pub(super) recompress_stride: AtomicU32,
    /// Grouping of cold pages, if configured (`store/grouping.rs`).
    pub(super) group: Option<GroupConfig>,
    /// Indexes of a window share a shard: `crate::group::WINDOW_SHIFT` when
    /// grouping is configured, else 0 (each key hashed on its own).
    pub(super) window_shift: u32,
    /// Codec id of new group blocks ([`grouping::NO_GROUP_CODEC`] until set up).
    pub(super) group_codec: AtomicU8,
    /// Grouping's state, for its status line.
    pub(super) group_state: AtomicU8,
}

/// [`Shared::recompress_target`] when no recompression runs.
pub(super) const NO_RECOMPRESSION: u8 = u8::MAX;

impl Shared {
    pub(super) fn register_codec(&self, cfg: &CodecConfig) -> Result<u8, StoreError> {
        let codec = cfg.build()?;
        let mut n = self.codec_count.lock();
        if *n >= MAX_CODECS {
            return Err(StoreError::TooManyCodecs);
        }
        self.codec_meta.fetch_add(codec.meta_bytes() as u64, Ordering::Relaxed);
        if self.codecs[*n].set(codec).is_err() || self.codec_configs[*n].set(cfg.clone()).is_err() {
            unreachable!("codec slots are filled in order under codec_count");
        }
        let id = u8::try_from(*n).expect("fewer than 32 codecs");
        *n += 1;
        Ok(id)
    }

    pub(super) fn set_codec(&self, id: u8) -> Result<(), StoreError> {
        self.codec(id)?;
        self.current_codec.store(id, Ordering::Relaxed);
        Ok(())
    }

    pub(super) fn total_bytes(&self) -> u64 {
        self.alloc.total_bytes() + self.index_meta.load(Ordering::Relaxed) + self.codec_meta.load(Ordering::Relaxed)
    }

    /// Finds a registered codec built from `cfg`, or registers it.
    pub(super) fn find_or_register_codec(&self, cfg: &CodecConfig) -> Result<u8, StoreError> {
        let count = *self.codec_count.lock();
        if let Some(id) = (0..count).find(|&i| self.codec_configs[i].get() == Some(cfg)) {
            return Ok(u8::try_from(id).expect("at most 32 codecs"));
        }
        self.register_codec(cfg)
    }

    pub(super) fn codec(&self, id: u8) -> Result<&Arc<dyn Codec>, StoreError> {
        self.codecs.get(usize::from(id)).and_then(OnceLock::get).ok_or(StoreError::NoSuchCodec(id))
    }

    pub(super) fn pools_snapshot(&self) -> Vec<Arc<Pool>> {
        self.pools.read().iter().flatten().cloned().collect()
    }

    /// zswap's admission: after hitting the limit, refuse until usage falls
    /// below the accept threshold. Ephemeral pages are dropped first.
    pub(super) fn admit(&self, pool: &Pool, work: Work) -> bool {
        let limit = self.policy.limit_bytes();
        if limit == u64::MAX {
            return true;
        }
        let accept = self.policy.accept_bytes();
        let inline = work == Work::Inline;
        if self.reached_full.load(Ordering::Relaxed) {
            if self.total_bytes() < accept || (inline && self.may_retry_room() && self.make_room(accept, pool.cfg.kind))
            {
                self.reached_full.store(false, Ordering::Relaxed);
                return true;
            }
            PoolEvents::bump(&pool.events.pool_limit_hit);
            return false;
        }
        if self.total_bytes() < limit {
            return true;
        }
        if inline && self.may_retry_room() && self.make_room(accept, pool.cfg.kind) {
            return true;
        }
        self.reached_full.store(true, Ordering::Relaxed);
        PoolEvents::bump(&pool.events.pool_limit_hit);
        false
    }

    /// Makes room (evicting, writing back, compacting) if the store is at
    /// its limit and may try now; returns whether puts are admitted again.
    pub(super) fn make_room_if_full(&self, for_kind: PoolKind) -> bool {
        let limit = self.policy.limit_bytes();
        if limit == u64::MAX || !self.reached_full.load(Ordering::Relaxed) {
            return true;
        }
        let accept = self.policy.accept_bytes();
        if self.total_bytes() < accept || (self.may_retry_room() && self.make_room(accept, for_kind)) {
            self.reached_full.store(false, Ordering::Relaxed);
            return true;
        }
        false
    }

    /// Whether a full store may try to make room now: after a failed try,
    /// puts are refused for [`ROOM_RETRY_NS`] instead of each repeating the
    /// same futile eviction/writeback scan.
    pub(super) fn may_retry_room(&self) -> bool {
        let now = u64::try_from(self.clock.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let last = self.room_failed_at.load(Ordering::Relaxed);
        last == 0 || now.saturating_sub(last) >= ROOM_RETRY_NS
    }

    /// Makes room for a put into a pool of kind `for_kind` until usage is
    /// below `target`: drops ephemeral pages first, then (for a persistent
    /// put only) writes persistent pages back to lower tiers. An ephemeral
    /// put never moves a persistent page, and its failure does not hold back
    /// the next persistent put's try. Returns whether it got there.
    pub(super) fn make_room(&self, target: u64, for_kind: PoolKind) -> bool {
        let write_back = || {
            self.writeback_waits.fetch_add(1, Ordering::Relaxed);
            self.write_back_until(target)
        };
        if self.evict_ephemeral(target, for_kind) || (for_kind == PoolKind::Persistent && write_back()) {
            self.room_failed_at.store(0, Ordering::Relaxed);
            return true;
        }
        if for_kind == PoolKind::Ephemeral {
            return false;
        }
        let now = u64::try_from(self.clock.elapsed().as_nanos()).unwrap_or(u64::MAX).max(1);
        self.room_failed_at.store(now, Ordering::Relaxed);
        false
    }

    pub(super) fn evict_ephemeral(&self, target: u64, for_kind: PoolKind) -> bool {
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
                let (n, bytes) = pool.evict_from_shard((cursor / ephemeral.len()) % shards, EVICT_BATCH, for_kind);
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

    pub(super) fn maybe_compact(&self) {
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

    pub(super) fn compact(&self) -> u64 {
        let guard = self.compaction.lock();
        self.compact_locked(&guard)
    }

    /// Moves objects out of sparse spans; returns pages released.
    pub(super) fn compact_locked(&self, _guard: &MutexGuard<'_, ()>) -> u64 {
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
                    // Group blocks' chunks (in practice their tail chunks:
                    // a full chunk is alone in its span).
                    let groups: Vec<u32> = s.groups.ids().collect();
                    for id in groups {
                        let (chunks, len) = s.groups.get(id).map_or((0, 0), |g| (g.chunks.len(), g.len as usize));
                        for k in 0..chunks {
                            let loc = Loc::unpack(s.groups.get(id).expect("listed").chunks[k]);
                            if !plan.contains(loc) {
                                continue;
                            }
                            match self.alloc.migrate(loc, crate::group::chunk_len(len, k)) {
                                Ok(new) => s.groups.move_chunk(id, k, new),
                                Err(_) => break 'pools,
                            }
                        }
                    }
                }
            }
        }
        self.alloc.finish_compaction(plan);
        self.alloc.stats().pages_compacted - before
    }
}
