//! Handing a store to a successor process (issue 12, `tmem swap restart`):
//! [`Store::export`] writes everything a new process needs to go on serving
//! the same pages, and [`Store::import`] builds that store again.
//!
//! What travels: the policy in force, every registered codec (dictionaries
//! included), the codec new puts use, every pool (its configuration, its
//! cumulative counters and rare-event counts, and each page: its key, its
//! checksum, its codec and its stored bytes exactly as they are, so nothing
//! is recompressed). What does not: the allocator layout (the successor
//! allocates afresh and compacts as it goes), LRU order and reference bits
//! (pages arrive oldest-unknown), background workers (the successor starts
//! its own from its configuration). A store with lower tiers is refused:
//! their indexes would have to travel too.
//!
//! The exporter must keep writers out while it runs (the daemon pauses its
//! frontends first); each shard is read under its lock. The format is a
//! versioned little-endian stream; [`Store::import`] checks every length,
//! id and checksum against what it has read, so a truncated or corrupt
//! stream is one clear error and never a wrong page (fuzz target
//! `store_import`).

use std::io::{Read, Write};

use super::*;

/// First bytes of an export.
const MAGIC: &[u8; 8] = b"TMEMSTOR";
/// Format version; an import refuses any other.
pub const HANDOVER_VERSION: u32 = 1;
/// Entry flags in the stream.
const REC_SAME: u8 = 1;
const REC_INCOMPRESSIBLE: u8 = 2;
/// Largest dictionary accepted (zstd's own trainer stays far below).
const MAX_DICTIONARY: u32 = 16 << 20;
/// Most pools an import creates (a daemon has a handful).
const MAX_POOLS: u32 = 1 << 16;

/// What an export or import moved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HandoverSummary {
    /// Pools (destroyed ones included, to keep ids).
    pub pools: u32,
    /// Pages.
    pub pages: u64,
    /// Bytes of stored objects.
    pub object_bytes: u64,
}

fn io_err(e: std::io::Error) -> StoreError {
    StoreError::Handover(format!("stream: {e}"))
}

fn bad(what: impl Into<String>) -> StoreError {
    StoreError::Handover(what.into())
}

/// Writes the stream, keeping a CRC-32 of everything written.
struct W<'a>(&'a mut dyn Write, crc32fast::Hasher);

impl W<'_> {
    fn bytes(&mut self, b: &[u8]) -> Result<(), StoreError> {
        self.1.update(b);
        self.0.write_all(b).map_err(io_err)
    }
    fn u8(&mut self, v: u8) -> Result<(), StoreError> {
        self.bytes(&[v])
    }
    fn u32(&mut self, v: u32) -> Result<(), StoreError> {
        self.bytes(&v.to_le_bytes())
    }
    fn i32(&mut self, v: i32) -> Result<(), StoreError> {
        self.bytes(&v.to_le_bytes())
    }
    fn u64(&mut self, v: u64) -> Result<(), StoreError> {
        self.bytes(&v.to_le_bytes())
    }
}

/// Reads the stream, keeping a CRC-32 of everything read: a flipped bit
/// anywhere (a key, a count) fails the import at the end, not only in data.
struct R<'a>(&'a mut dyn Read, crc32fast::Hasher);

impl R<'_> {
    fn fill(&mut self, b: &mut [u8]) -> Result<(), StoreError> {
        self.0.read_exact(b).map_err(io_err)?;
        self.1.update(b);
        Ok(())
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], StoreError> {
        let mut b = [0u8; N];
        self.fill(&mut b)?;
        Ok(b)
    }
    fn u8(&mut self) -> Result<u8, StoreError> {
        Ok(self.array::<1>()?[0])
    }
    fn u32(&mut self) -> Result<u32, StoreError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn i32(&mut self) -> Result<i32, StoreError> {
        Ok(i32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, StoreError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn bool(&mut self, what: &str) -> Result<bool, StoreError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(bad(format!("{what}: {v} is not a boolean"))),
        }
    }
}

/// The cumulative counters of a pool, in stream order.
fn cumulative(c: &mut ShardCounters) -> [&mut u64; 12] {
    [
        &mut c.succ_puts,
        &mut c.succ_gets,
        &mut c.failed_gets,
        &mut c.flushes,
        &mut c.evicted_pages,
        &mut c.evicted_for_persistent,
        &mut c.evicted_for_ephemeral,
        &mut c.compressions,
        &mut c.decompressions,
        &mut c.written_back_pages,
        &mut c.tier_gets,
        &mut c.incompressible_to_tier,
    ]
}

/// A pool's rare-event counters, in stream order (a new one bumps [`HANDOVER_VERSION`]).
fn events(e: &PoolEvents) -> [&AtomicU64; 13] {
    [
        &e.pool_limit_hit,
        &e.reject_compress_poor,
        &e.reject_compress_fail,
        &e.reject_alloc_fail,
        &e.reject_frozen,
        &e.decompress_fail,
        &e.compressions_rejected,
        &e.tier_get_fail,
        &e.tier_put_fail,
        &e.recompressed_pages,
        &e.recompress_saved_bytes,
        &e.recompress_kept,
        &e.recompress_raced,
    ]
}

fn write_policy(w: &mut W<'_>, p: &PolicyConfig) -> Result<(), StoreError> {
    w.u64(p.max_pool_bytes)?;
    w.u32(p.max_pool_percent)?;
    w.u64(p.total_ram_bytes)?;
    w.u32(p.accept_threshold_percent)?;
    w.u32(p.max_compressed_size)?;
    w.u8(u8::from(p.incompressible == crate::policy::Incompressible::StoreRaw))?;
    w.u8(u8::from(p.frozen))?;
    w.u32(p.compact_threshold_percent)
}

fn read_policy(r: &mut R<'_>) -> Result<PolicyConfig, StoreError> {
    Ok(PolicyConfig {
        max_pool_bytes: r.u64()?,
        max_pool_percent: r.u32()?,
        total_ram_bytes: r.u64()?,
        accept_threshold_percent: r.u32()?,
        max_compressed_size: r.u32()?,
        incompressible: if r.bool("incompressible")? {
            crate::policy::Incompressible::StoreRaw
        } else {
            crate::policy::Incompressible::Reject
        },
        frozen: r.bool("frozen")?,
        compact_threshold_percent: r.u32()?,
    })
}

fn write_codec(w: &mut W<'_>, c: &CodecConfig) -> Result<(), StoreError> {
    let (tag, level, dictionary) = match c {
        CodecConfig::Raw => (0, 0, None),
        CodecConfig::Lz4 { dictionary } => (1, 0, dictionary.as_deref()),
        CodecConfig::Zstd { level, dictionary } => (2, *level, dictionary.as_deref()),
    };
    w.u8(tag)?;
    w.i32(level)?;
    let dictionary = dictionary.unwrap_or_default();
    w.u32(u32::try_from(dictionary.len()).map_err(|_| bad("dictionary over 4 GiB"))?)?;
    w.bytes(dictionary)
}

fn read_codec(r: &mut R<'_>) -> Result<CodecConfig, StoreError> {
    let (tag, level, len) = (r.u8()?, r.i32()?, r.u32()?);
    if len > MAX_DICTIONARY {
        return Err(bad(format!("a dictionary of {len} bytes (at most {MAX_DICTIONARY})")));
    }
    let mut dictionary = vec![0u8; len as usize];
    r.fill(&mut dictionary)?;
    let dictionary: Option<Arc<[u8]>> = (len > 0).then(|| dictionary.into());
    match tag {
        0 if dictionary.is_none() => Ok(CodecConfig::Raw),
        1 => Ok(CodecConfig::Lz4 { dictionary }),
        2 => Ok(CodecConfig::Zstd { level, dictionary }),
        _ => Err(bad(format!("unknown codec tag {tag}"))),
    }
}

impl Store {
    /// Writes the store to `w` for [`Store::import`] in a successor. The
    /// caller keeps writers out meanwhile. Refused for a store with tiers.
    pub fn export(&self, w: &mut dyn Write) -> Result<HandoverSummary, StoreError> {
        let sh = &*self.shared;
        let pools = sh.pools.read().clone();
        if pools.iter().flatten().any(|p| p.chain.is_some()) {
            return Err(bad("a store with lower tiers cannot be handed over (their indexes stay behind)"));
        }
        let mut w = W(w, crc32fast::Hasher::new());
        let mut sum = HandoverSummary::default();
        w.bytes(MAGIC)?;
        w.u32(HANDOVER_VERSION)?;
        write_policy(&mut w, &sh.policy.config())?;
        let codecs = *sh.codec_count.lock();
        w.u8(u8::try_from(codecs).expect("at most 32 codecs"))?;
        for id in 0..codecs {
            let cfg = sh.codec_configs[id].get().ok_or_else(|| bad(format!("codec {id} has no configuration")))?;
            write_codec(&mut w, cfg)?;
        }
        w.u8(sh.current_codec.load(Ordering::Relaxed))?;
        w.u32(u32::try_from(pools.len()).expect("fewer than 2^32 pools"))?;
        for pool in &pools {
            sum.pools += 1;
            let Some(pool) = pool else {
                w.u8(0)?;
                continue;
            };
            w.u8(1)?;
            let c = &pool.cfg;
            w.u8(u8::from(c.kind == PoolKind::Ephemeral))?;
            w.u8(u8::from(c.exclusive_gets))?;
            w.u8(u8::from(c.reject_keeps_old))?;
            w.u8(u8::from(c.eviction == Eviction::Lru))?;
            for e in events(&pool.events) {
                w.u64(e.load(Ordering::Relaxed))?;
            }
            w.u32(u32::try_from(pool.shards.len()).expect("few shards"))?;
            for shard in pool.shards.iter() {
                let s = shard.0.lock();
                let mut c = s.c;
                for v in cumulative(&mut c) {
                    w.u64(*v)?;
                }
                w.u64(s.entries.live() as u64)?;
                for h in s.entries.live_handles() {
                    let e = s.entries.get(h);
                    w.u64(e.object)?;
                    w.u64(e.index)?;
                    let flags = if e.has(F_SAME) { REC_SAME } else { 0 }
                        | if e.has(F_INCOMPRESSIBLE) { REC_INCOMPRESSIBLE } else { 0 };
                    w.u8(flags)?;
                    w.u8(e.codec())?;
                    w.u32(e.check)?;
                    if e.has(F_SAME) {
                        w.u64(e.loc)?;
                    } else {
                        let loc = e.alloc_loc().expect("a pool page without tiers has an object");
                        // SAFETY: `e` is live in this shard, whose lock we
                        // hold, so the object is neither freed nor moved
                        // while we read it, and `e.len()` is its length.
                        let data = unsafe { sh.alloc.object(loc, e.len()) };
                        w.u32(u32::try_from(data.len()).expect("an object is under a page"))?;
                        w.bytes(data)?;
                        sum.object_bytes += data.len() as u64;
                    }
                    sum.pages += 1;
                }
            }
        }
        w.bytes(MAGIC)?;
        let crc = w.1.clone().finalize();
        w.u32(crc)?;
        w.0.flush().map_err(io_err)?;
        Ok(sum)
    }

    /// Builds a store from [`Store::export`]'s stream: `cfg` gives the
    /// allocator and shard count (and a codec, registered as usual); policy,
    /// codecs, pools, pages and counters come from the stream. Pool ids are
    /// kept. Any inconsistency (version, length, codec id, checksum) is an
    /// error naming it, and nothing is returned.
    pub fn import(mut cfg: StoreConfig, r: &mut dyn Read) -> Result<(Store, HandoverSummary), StoreError> {
        let mut r = R(r, crc32fast::Hasher::new());
        if &r.array::<8>()? != MAGIC {
            return Err(bad("not a tmem store export (bad magic)"));
        }
        let version = r.u32()?;
        if version != HANDOVER_VERSION {
            return Err(bad(format!("export format {version}, this build reads {HANDOVER_VERSION}")));
        }
        cfg.policy = read_policy(&mut r)?;
        // The successor trains no dictionary of its own: the pages come with theirs.
        cfg.dictionary = None;
        let store = cfg.build()?;
        let sh = &*store.shared;
        let codecs = r.u8()?;
        let mut ids = Vec::with_capacity(usize::from(codecs));
        for _ in 0..codecs {
            ids.push(store.import_codec(&read_codec(&mut r)?)?);
        }
        let current = r.u8()?;
        let new_id = |old: u8| ids.get(usize::from(old)).copied().ok_or_else(|| bad(format!("no codec {old}")));
        store.set_codec(new_id(current)?)?;
        let mut sum = HandoverSummary::default();
        let pools = r.u32()?;
        if pools > MAX_POOLS {
            return Err(bad(format!("{pools} pools (at most {MAX_POOLS})")));
        }
        for id in 0..pools {
            sum.pools += 1;
            if !r.bool("pool present")? {
                let p = store.create_pool(PoolConfig::persistent());
                store.destroy_pool(p.id)?;
                continue;
            }
            let kind = if r.bool("kind")? { PoolKind::Ephemeral } else { PoolKind::Persistent };
            let pc = PoolConfig {
                kind,
                exclusive_gets: r.bool("exclusive gets")?,
                reject_keeps_old: r.bool("reject keeps old")?,
                eviction: if r.bool("eviction")? { Eviction::Lru } else { Eviction::Sieve },
            };
            let pool = store.create_pool(pc);
            debug_assert_eq!(pool.id, id);
            for e in events(&pool.events) {
                e.store(r.u64()?, Ordering::Relaxed);
            }
            let mut counted = ShardCounters::default();
            let shards = r.u32()?;
            for _ in 0..shards {
                let mut c = ShardCounters::default();
                for v in cumulative(&mut c) {
                    *v = r.u64()?;
                }
                for (into, v) in cumulative(&mut counted).into_iter().zip(cumulative(&mut c)) {
                    *into = into.saturating_add(*v);
                }
                let entries = r.u64()?;
                for _ in 0..entries {
                    store.import_page(&pool, &mut r, &new_id, &mut sum)?;
                }
            }
            // Inserting counted each page as a put: carry the exporter's
            // counts instead, kept in the first shard.
            for (i, shard) in pool.shards.iter().enumerate() {
                let mut s = shard.0.lock();
                let mut from = counted;
                for (into, v) in cumulative(&mut s.c).into_iter().zip(cumulative(&mut from)) {
                    *into = if i == 0 { *v } else { 0 };
                }
            }
        }
        if &r.array::<8>()? != MAGIC {
            return Err(bad("the export does not end where its counts say"));
        }
        let crc = r.1.clone().finalize();
        if r.u32()? != crc {
            return Err(bad("the stream's checksum does not match: it was damaged on the way"));
        }
        sh.maybe_compact();
        Ok((store, sum))
    }

    /// Registers an imported codec, or finds the same one registered.
    fn import_codec(&self, cfg: &CodecConfig) -> Result<u8, StoreError> {
        let sh = &*self.shared;
        let count = *sh.codec_count.lock();
        if let Some(id) = (0..count).find(|&i| sh.codec_configs[i].get() == Some(cfg)) {
            return Ok(u8::try_from(id).expect("at most 32 codecs"));
        }
        self.register_codec(cfg)
    }

    /// Reads one page record and stores it as it is.
    fn import_page(
        &self,
        pool: &Pool,
        r: &mut R<'_>,
        new_id: &dyn Fn(u8) -> Result<u8, StoreError>,
        sum: &mut HandoverSummary,
    ) -> Result<(), StoreError> {
        let key = Key::new(r.u64()?, r.u64()?);
        let flags = r.u8()?;
        let codec = new_id(r.u8()?)?;
        let check = r.u32()?;
        let hash = hash_key(key);
        let entry = if flags & REC_SAME != 0 {
            Entry::new(key, r.u64()?, 0, 0, RAW_CODEC, F_SAME)
        } else {
            let len = r.u32()? as usize;
            if len == 0 || len > PAGE_SIZE {
                return Err(bad(format!("page {key:?}: an object of {len} bytes")));
            }
            let mut data = [0u8; PAGE_SIZE];
            r.fill(&mut data[..len])?;
            if crc32fast::hash(&data[..len]) != check {
                return Err(bad(format!("page {key:?}: checksum mismatch")));
            }
            let loc = self
                .shared
                .alloc
                .alloc_write(&data[..len])
                .map_err(|e| bad(format!("page {key:?}: no memory for it: {e}")))?;
            sum.object_bytes += len as u64;
            let f = if flags & REC_INCOMPRESSIBLE != 0 { F_INCOMPRESSIBLE } else { 0 };
            Entry::new(key, loc.pack(), check, len, codec, f)
        };
        let stored = pool.insert_entry(key, hash, entry, Work::Deferred)?;
        debug_assert_eq!(stored, PutOutcome::Stored);
        sum.pages += 1;
        Ok(())
    }
}
