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
//! its own from its configuration).
//!
//! The exporter must keep writers out while it runs (the daemon pauses its
//! frontends first); each shard is read under its lock. The format is a
//! versioned little-endian stream; [`Store::import`] checks every length,
//! id and checksum against what it has read, so a truncated or corrupt
//! stream is one clear error and never a wrong page (fuzz target
//! `store_import`).
//!
//! Format 2 adds groups of cold pages (`store/grouping.rs`): each shard's
//! single pages are followed by its groups, each with its block exactly as
//! stored, its slots, its live slots and their pages' checksums, and the
//! pool's grouping counters. A successor that groups takes the groups as
//! they are; one that does not decodes them and stores their live pages
//! singly, in the codec new puts use. Format 1 streams are still read.
//!
//! Format 3 adds tiers: the store's sealing version counter, and for each
//! pool with tiers below it their number, whether gets promote, and its
//! sealer ([`Sealer::hand_over`]); a page that lives in a tier is a record
//! with its tier, its sealing version, its length and checksum, and no
//! bytes. The tiers themselves travel apart ([`Store::hold_tiers`],
//! [`tmem_tier::Tier::hand_over`]): the importer is given them, built from
//! what they handed over, by pool ([`Store::import_tiered`]).
//!
//! Format 4 adds automatic dictionary training
//! (`dictionary::HandedTraining`): whether it is armed, for which codec,
//! its thresholds and counts, and its status, so that the successor trains
//! when the predecessor would have (a restart before the pool held enough
//! used to leave it without a dictionary for good), does not train again
//! what was trained, and keeps a codec set by hand. Streams of formats 1-3
//! carry none: the successor then trains nothing, as before.
//!
//! # Images (zero-copy)
//!
//! A store built with [`StoreConfig::shared_memory`] keeps its pages in a
//! memfd. [`Store::export_image`] writes the same stream with magic
//! `TMEMIMAG`, the allocator's tables ([`crate::alloc::AllocImage`]) after
//! the header, and each object's location instead of its bytes; the
//! successor passes the memfd to [`Store::import_image`], which maps it and
//! rebuilds the index and the tables from the stream without reading or
//! copying a stored page. The exporter seals its store first
//! ([`Store::seal`]): from then on it allocates nothing and frees nothing,
//! so the pages stay as the image describes them. The imported store is
//! sealed too until its caller opens it ([`Store::seal`] with `false`),
//! once the predecessor can no longer resume; until then, background work
//! in either process changes no byte of the shared pages.
//!
//! Image format 4 lets the pages of a shard come ahead of the image, while
//! the exporter serves (`handover/precopy.rs`): each shard's records are
//! preceded by a byte, 0 for the records as before, 1 for the changes
//! since a snapshot ([`Store::export_snapshot`]) that the importer holds.

use std::io::{Read, Write};

use super::*;
use crate::shard::MAX_TIERS;
use tmem_tier::seal::Sealer;

mod precopy;
pub use precopy::Snapshot;

/// First bytes of an export.
const MAGIC: &[u8; 8] = b"TMEMSTOR";
/// Format version written; an import reads this one and the older ones.
pub const HANDOVER_VERSION: u32 = 4;
/// First bytes of an image ([`Store::export_image`]).
const IMAGE_MAGIC: &[u8; 8] = b"TMEMIMAG";
/// Image format version: images 1-3 carry a format 2-4 stream; image 4
/// carries format 4 and says, shard by shard, whether its pages came ahead
/// (`precopy`).
pub const IMAGE_VERSION: u32 = 4;
/// Most chunks of the arena an image may name (64 TiB).
const MAX_CHUNKS: u32 = 1 << 24;
/// The oldest format an import reads.
const OLDEST_VERSION: u32 = 1;
/// Entry flags in the stream.
const REC_SAME: u8 = 1;
const REC_INCOMPRESSIBLE: u8 = 2;
/// The page lives in a tier, whose index is in bits 4..7 (format 3).
const REC_TIER: u8 = 4;
const REC_TIER_SHIFT: u8 = 4;

/// An entry's flags as a page record (stream and image) carries them.
fn record_flags(e: &Entry) -> u8 {
    let tier = if e.has(F_TIER) {
        REC_TIER | (u8::try_from(e.tier()).expect("a tier index < 8") << REC_TIER_SHIFT)
    } else {
        0
    };
    (if e.has(F_SAME) { REC_SAME } else { 0 }) | if e.has(F_INCOMPRESSIBLE) { REC_INCOMPRESSIBLE } else { 0 } | tier
}

/// The tier of a record with [`REC_TIER`].
fn record_tier(record: u8) -> Option<usize> {
    (record & REC_TIER != 0).then_some(usize::from(record >> REC_TIER_SHIFT))
}

/// Tiers below the pools of a store being imported: for pool `id` with
/// `n` tiers, those tiers in chain order, built from what the exporter's
/// tiers handed over.
pub type ImportTiers<'a> = &'a mut dyn FnMut(u32, usize) -> Result<Vec<Arc<dyn tmem_tier::Tier>>, StoreError>;

/// An import given no tiers: a pool with tiers is an error.
fn no_tiers(id: u32, _: usize) -> Result<Vec<Arc<dyn tmem_tier::Tier>>, StoreError> {
    Err(bad(format!("pool {id} has tiers below it, and this import was given none")))
}

/// The entry flags of a stored (not same-filled) page record.
fn stored_flags(record: u8) -> u32 {
    if record & REC_INCOMPRESSIBLE != 0 {
        F_INCOMPRESSIBLE
    } else {
        0
    }
}
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

/// The image's byte for its shards' layout: 0 (each key hashed on its
/// own), [`crate::group::WINDOW_SHIFT`] (grouping, whose windows share a
/// shard), or that with [`WINDOWS_ONLY`] (windows without grouping).
/// Builds before windows without grouping wrote only the first two.
pub(super) fn layout_byte(sh: &Shared) -> u8 {
    let shift = u8::try_from(sh.window_shift).expect("a small shift");
    match (sh.group.is_some(), shift) {
        (false, 0) => 0,
        (true, s) => s,
        (false, s) => s | WINDOWS_ONLY,
    }
}

/// [`layout_byte`]'s mark of windows kept together without grouping.
const WINDOWS_ONLY: u8 = 0x40;

/// Whether a store built with `cfg` adopts an image of layout `byte`
/// ([`layout_byte`]) with its windows kept together. The image's entries
/// stay in their shards, so the layout must be the image's: grouping must
/// stay as it was, and a store that does not group takes either layout.
pub(super) fn adopted_windows(cfg: &StoreConfig, byte: u8) -> Result<bool, StoreError> {
    #[allow(clippy::cast_possible_truncation)] // 4, asserted below
    const GROUPED: u8 = crate::group::WINDOW_SHIFT as u8;
    const _: () = assert!(GROUPED as u32 == crate::group::WINDOW_SHIFT && GROUPED & WINDOWS_ONLY == 0);
    const WINDOWS: u8 = GROUPED | WINDOWS_ONLY;
    match (byte, cfg.group.is_some()) {
        (0, false) => Ok(false),
        (GROUPED, true) | (WINDOWS, false) => Ok(true),
        (0 | WINDOWS, true) => {
            Err(bad("the image never groups pages and this store does (grouping must stay as it was)"))
        }
        (GROUPED, false) => Err(bad("the image groups pages and this store does not (grouping must stay as it was)")),
        (b, _) => Err(bad(format!("the image's shard layout {b:#x} is unknown to this build"))),
    }
}

fn bad(what: impl Into<String>) -> StoreError {
    StoreError::Handover(what.into())
}

/// Bytes of small writes (or reads) gathered before they are hashed at
/// once: CRC-32 costs about as much per call as per 64 bytes, and an image
/// is mostly fields of 1-8 bytes (the allocator's tables: 40 % of an
/// export's time and a quarter of an import's went to those calls).
const GATHER: usize = 8 << 10;

/// A CRC-32 of many small pieces, hashed [`GATHER`] bytes at a time.
struct GatheredCrc {
    crc: crc32fast::Hasher,
    /// Taken, not yet hashed.
    pending: Vec<u8>,
}

impl GatheredCrc {
    fn new() -> Self {
        GatheredCrc { crc: crc32fast::Hasher::new(), pending: Vec::with_capacity(GATHER) }
    }
    /// Takes `b`. Each run of bytes hashed (a full gather, or `b` itself
    /// when it is as large) is passed to `out` in order, so a writer gets
    /// the same gathers the CRC did.
    fn take(&mut self, b: &[u8], out: &mut impl FnMut(&[u8]) -> std::io::Result<()>) -> std::io::Result<()> {
        if self.pending.len() + b.len() > GATHER {
            self.flush(out)?;
        }
        if b.len() >= GATHER {
            self.crc.update(b);
            return out(b);
        }
        self.pending.extend_from_slice(b);
        Ok(())
    }
    /// Hashes what was taken and not yet hashed, and passes it to `out`.
    fn flush(&mut self, out: &mut impl FnMut(&[u8]) -> std::io::Result<()>) -> std::io::Result<()> {
        self.crc.update(&self.pending);
        out(&self.pending)?;
        self.pending.clear();
        Ok(())
    }
    /// The CRC-32 of everything taken so far; what was pending goes to `out`.
    fn value(&mut self, out: &mut impl FnMut(&[u8]) -> std::io::Result<()>) -> std::io::Result<u32> {
        self.flush(out)?;
        Ok(self.crc.clone().finalize())
    }
}

/// Writes the stream, keeping a CRC-32 of everything written. Small writes
/// are gathered ([`GATHER`]): each gather is hashed and written at once, as
/// a call per field cost as much again.
struct W<'a>(&'a mut dyn Write, GatheredCrc);

impl W<'_> {
    fn bytes(&mut self, b: &[u8]) -> Result<(), StoreError> {
        let W(out, gathered) = self;
        gathered.take(b, &mut |g| out.write_all(g)).map_err(io_err)
    }
    /// The CRC-32 of everything written so far, all of it passed to the writer.
    fn crc(&mut self) -> Result<u32, StoreError> {
        let W(out, gathered) = self;
        gathered.value(&mut |g| out.write_all(g)).map_err(io_err)
    }
    /// Passes what is gathered to the writer and flushes it.
    fn finish(&mut self) -> Result<(), StoreError> {
        let W(out, gathered) = self;
        gathered.flush(&mut |g| out.write_all(g)).map_err(io_err)?;
        out.flush().map_err(io_err)
    }
    fn u8(&mut self, v: u8) -> Result<(), StoreError> {
        self.bytes(&[v])
    }
    fn u16(&mut self, v: u16) -> Result<(), StoreError> {
        self.bytes(&v.to_le_bytes())
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
struct R<'a>(&'a mut dyn Read, GatheredCrc);

impl R<'_> {
    fn fill(&mut self, b: &mut [u8]) -> Result<(), StoreError> {
        self.0.read_exact(b).map_err(io_err)?;
        self.1.take(b, &mut |_| Ok(())).map_err(io_err)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], StoreError> {
        let mut b = [0u8; N];
        self.fill(&mut b)?;
        Ok(b)
    }
    fn u8(&mut self) -> Result<u8, StoreError> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, StoreError> {
        Ok(u16::from_le_bytes(self.array()?))
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

/// The cumulative counters of a pool, in stream order: format 1 has the
/// first [`CUMULATIVE_V1`].
fn cumulative(c: &mut ShardCounters) -> [&mut u64; 14] {
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
        &mut c.group_cache_hits,
        &mut c.group_cache_misses,
    ]
}

/// Cumulative counters in a format 1 stream.
const CUMULATIVE_V1: usize = 12;
/// Rare-event counters in a format 1 stream.
const EVENTS_V1: usize = 13;

/// A pool's rare-event counters, in stream order (a new one bumps
/// [`HANDOVER_VERSION`]): format 1 has the first [`EVENTS_V1`].
fn events(e: &PoolEvents) -> [&AtomicU64; 17] {
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
        &e.pages_grouped,
        &e.group_rewrites,
        &e.group_kept,
        &e.group_raced,
    ]
}

/// Writes group `g` of shard `s` (locked): its place, codec, slots, live
/// slots, block length and checksum, its live pages' checksums, its block.
fn write_group(
    w: &mut W<'_>,
    sh: &Shared,
    s: &Shard,
    g: &crate::group::Group,
    sum: &mut HandoverSummary,
    image: bool,
) -> Result<(), StoreError> {
    w.u64(g.object)?;
    w.u64(g.base)?;
    w.u8(g.codec)?;
    w.u16(g.slots)?;
    w.u16(g.live)?;
    w.u32(g.len)?;
    w.u32(g.check)?;
    for slot in crate::group::Group::slots_in(g.live) {
        let key = g.key(slot);
        let h = s.find(key, hash_key(key)).ok_or_else(|| bad(format!("{key:?}: a live slot without its page")))?;
        w.u32(s.entries.get(h).check)?;
        sum.pages += 1;
    }
    if image {
        w.u32(u32::try_from(g.chunks.len()).expect("a block has few chunks"))?;
        for &c in &g.chunks {
            w.u64(c)?;
        }
        sum.object_bytes += u64::from(g.len);
        return Ok(());
    }
    let mut block = Vec::with_capacity(g.len as usize);
    // SAFETY: the group is live in shard `s`, whose lock the caller holds,
    // so its chunks are neither freed nor moved while we read them.
    unsafe { crate::group::gather(&sh.alloc, &g.chunks, g.len as usize, &mut block) };
    w.bytes(&block)?;
    sum.object_bytes += block.len() as u64;
    Ok(())
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

/// Largest training status read (the trainer writes a line or two).
const MAX_STATUS: u32 = 4 << 10;
/// Most pages a handed-over training may sample (the default is 2048).
const MAX_SAMPLE_PAGES: u64 = 1 << 20;

fn write_training(w: &mut W<'_>, t: &dictionary::HandedTraining) -> Result<(), StoreError> {
    w.u64(t.cfg.after_bytes)?;
    w.u64(t.cfg.sample_pages as u64)?;
    w.u64(t.cfg.dict_bytes as u64)?;
    w.u32(t.cfg.max_dictionaries)?;
    write_codec(w, &t.base)?;
    w.u8(u8::from(t.armed))?;
    w.u8(u8::from(t.finished))?;
    w.u64(t.next_bytes)?;
    w.u32(t.failures)?;
    w.u32(t.dictionaries)?;
    w.u8(t.codec_id)?;
    w.u64(t.tried_bytes)?;
    w.u64(t.seen_pages)?;
    w.u64(t.seen_bytes)?;
    // Cut on a character's boundary: the reader checks it is UTF-8.
    let cut = (0..=t.status.len().min(MAX_STATUS as usize)).rev().find(|&i| t.status.is_char_boundary(i));
    let status = &t.status.as_bytes()[..cut.unwrap_or(0)];
    w.u32(u32::try_from(status.len()).expect("capped"))?;
    w.bytes(status)
}

/// Reads what [`write_training`] wrote; `new_id` maps the predecessor's
/// codec ids to this store's.
fn read_training(
    r: &mut R<'_>,
    new_id: &dyn Fn(u8) -> Result<u8, StoreError>,
) -> Result<dictionary::HandedTraining, StoreError> {
    let (after_bytes, sample_pages, dict_bytes, max_dictionaries) = (r.u64()?, r.u64()?, r.u64()?, r.u32()?);
    if sample_pages > MAX_SAMPLE_PAGES || dict_bytes > u64::from(MAX_DICTIONARY) || max_dictionaries > MAX_DICTIONARIES
    {
        return Err(bad(format!(
            "dictionary training of {sample_pages} pages into {dict_bytes} bytes, {max_dictionaries} dictionaries \
             (at most {MAX_SAMPLE_PAGES}, {MAX_DICTIONARY}, {MAX_DICTIONARIES})"
        )));
    }
    let cfg = DictTraining {
        after_bytes,
        sample_pages: usize::try_from(sample_pages).expect("capped"),
        dict_bytes: usize::try_from(dict_bytes).expect("capped"),
        max_dictionaries,
    };
    let base = read_codec(r)?;
    let (armed, finished) = (r.bool("training armed")?, r.bool("training finished")?);
    let (next_bytes, failures, dictionaries) = (r.u64()?, r.u32()?, r.u32()?);
    if dictionaries > max_dictionaries {
        return Err(bad(format!("{dictionaries} dictionaries trained, at most {max_dictionaries} allowed")));
    }
    let newest = r.u8()?;
    // The newest dictionary's codec is one of the stream's (a store that
    // trained none records 0, which it may not have registered).
    let codec_id = if dictionaries > 0 { new_id(newest)? } else { 0 };
    let (tried_bytes, seen_pages, seen_bytes) = (r.u64()?, r.u64()?, r.u64()?);
    let len = r.u32()?;
    if len > MAX_STATUS {
        return Err(bad(format!("a training status of {len} bytes (at most {MAX_STATUS})")));
    }
    let mut status = vec![0u8; len as usize];
    r.fill(&mut status)?;
    let status = String::from_utf8(status).map_err(|_| bad("a training status that is not UTF-8"))?;
    Ok(dictionary::HandedTraining {
        cfg,
        base,
        armed,
        finished,
        next_bytes,
        failures,
        dictionaries,
        codec_id,
        tried_bytes,
        seen_pages,
        seen_bytes,
        status,
    })
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

/// Writes an allocator image; its spans as fixed records ([`SPAN_RECORD`])
/// with `fixed` (image 4, snapshots), else field by field (images 1-3).
fn write_alloc_image(w: &mut W<'_>, a: &crate::alloc::AllocImage, fixed: bool) -> Result<(), StoreError> {
    w.u32(u32::try_from(a.config.max_span_pages).expect("at most 16"))?;
    w.u32(u32::try_from(a.config.merge_permille).map_err(|_| bad("merge_permille over 2^32"))?)?;
    for v in a.compacted {
        w.u64(v)?;
    }
    w.u32(a.arena.chunks)?;
    w.u32(a.arena.bump)?;
    w.u64(a.arena.free.len() as u64)?;
    for &(pages, place) in &a.arena.free {
        w.u8(pages)?;
        w.u32(place.chunk)?;
        w.u32(place.page)?;
    }
    w.u32(u32::try_from(a.classes.len()).expect("few classes"))?;
    let mut buf = [0u8; SPAN_BATCH * SPAN_RECORD];
    for spans in &a.classes {
        w.u32(u32::try_from(spans.len()).expect("span ids fit u32"))?;
        if !fixed {
            for span in spans {
                let rec = span_record(span.as_ref());
                w.bytes(if span.is_some() { &rec[..] } else { &rec[..1] })?;
            }
            continue;
        }
        for batch in spans.chunks(SPAN_BATCH) {
            for (span, b) in batch.iter().zip(buf.chunks_exact_mut(SPAN_RECORD)) {
                *b.first_chunk_mut().expect("a record") = span_record(span.as_ref());
            }
            w.bytes(&buf[..batch.len() * SPAN_RECORD])?;
        }
    }
    Ok(())
}

/// Bytes of one span in an allocator image: mapped (1), chunk (4), page
/// (4), used (2), bump (2), free head (2). Written and read in batches of
/// [`SPAN_BATCH`]: per-field calls took most of the time of a pause that
/// carried a few GiB's span tables.
const SPAN_RECORD: usize = 15;
const SPAN_BATCH: usize = 256;

fn span_record(span: Option<&crate::alloc::SpanImage>) -> [u8; SPAN_RECORD] {
    let mut b = [0u8; SPAN_RECORD];
    if let Some(sp) = span {
        b[0] = 1;
        b[1..5].copy_from_slice(&sp.place.chunk.to_le_bytes());
        b[5..9].copy_from_slice(&sp.place.page.to_le_bytes());
        b[9..11].copy_from_slice(&sp.used.to_le_bytes());
        b[11..13].copy_from_slice(&sp.bump.to_le_bytes());
        b[13..15].copy_from_slice(&sp.free_head.to_le_bytes());
    }
    b
}

fn read_span(b: &[u8; SPAN_RECORD]) -> Result<Option<crate::alloc::SpanImage>, StoreError> {
    let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
    let u16_at = |i: usize| u16::from_le_bytes(b[i..i + 2].try_into().expect("2 bytes"));
    match b[0] {
        0 if b[1..].iter().all(|&x| x == 0) => Ok(None),
        1 => Ok(Some(crate::alloc::SpanImage {
            place: crate::mem::SpanPlace { chunk: u32_at(1), page: u32_at(5) },
            used: u16_at(9),
            bump: u16_at(11),
            free_head: u16_at(13),
        })),
        _ => Err(bad("image: a span record that is neither mapped nor free")),
    }
}

/// Reads what [`write_alloc_image`] wrote, with the same `fixed`.
fn read_alloc_image(r: &mut R<'_>, fixed: bool) -> Result<crate::alloc::AllocImage, StoreError> {
    use crate::alloc::{AllocConfig, AllocImage};
    use crate::mem::{ArenaImage, SpanPlace, CHUNK_PAGES};
    let config = AllocConfig { max_span_pages: r.u32()? as usize, merge_permille: r.u32()? as usize };
    if !(1..=crate::mem::MAX_SPAN_PAGES).contains(&config.max_span_pages) {
        return Err(bad(format!("image: spans of {} pages", config.max_span_pages)));
    }
    let compacted = [r.u64()?, r.u64()?, r.u64()?];
    let (chunks, bump) = (r.u32()?, r.u32()?);
    if chunks > MAX_CHUNKS {
        return Err(bad(format!("image: {chunks} chunks (at most {MAX_CHUNKS})")));
    }
    let total_pages = u64::from(chunks) * CHUNK_PAGES as u64;
    let free_n = r.u64()?;
    if free_n > total_pages {
        return Err(bad(format!("image: {free_n} free spans in {chunks} chunks")));
    }
    // Counts are checked against the chunks, which the memfd's size checks
    // later: reserve no more than a little ahead of the bytes read.
    let mut free = Vec::with_capacity(usize::try_from(free_n.min(1 << 16)).map_err(bad_len)?);
    for _ in 0..free_n {
        free.push((r.u8()?, SpanPlace { chunk: r.u32()?, page: r.u32()? }));
    }
    let n_classes = r.u32()?;
    if n_classes as usize > crate::alloc::NUM_SIZES {
        return Err(bad(format!("image: {n_classes} size classes")));
    }
    let mut classes = Vec::with_capacity(n_classes as usize);
    for _ in 0..n_classes {
        let n = u64::from(r.u32()?);
        if n > total_pages {
            return Err(bad(format!("image: {n} spans in {chunks} chunks")));
        }
        let mut spans = Vec::with_capacity(usize::try_from(n.min(1 << 16)).map_err(bad_len)?);
        let mut buf = [0u8; SPAN_BATCH * SPAN_RECORD];
        if !fixed {
            for _ in 0..n {
                let mut b = [0u8; SPAN_RECORD];
                b[0] = u8::from(r.bool("span mapped")?);
                if b[0] == 1 {
                    r.fill(&mut b[1..])?;
                }
                spans.push(read_span(&b)?);
            }
            classes.push(spans);
            continue;
        }
        let mut left = n;
        while left > 0 {
            let k = usize::try_from(left.min(SPAN_BATCH as u64)).expect("at most a batch");
            r.fill(&mut buf[..k * SPAN_RECORD])?;
            for b in buf[..k * SPAN_RECORD].chunks_exact(SPAN_RECORD) {
                spans.push(read_span(b.try_into().expect("a record"))?);
            }
            left -= k as u64;
        }
        classes.push(spans);
    }
    Ok(AllocImage { config, arena: ArenaImage { chunks, bump, free }, classes, compacted })
}

/// Bytes of one page in an image: key (16), flags, codec, checksum (4),
/// object length (4; 0 when same-filled), location or fill word (8). One
/// fixed record, written and read whole: an image's cost is per page.
const IMAGE_RECORD: usize = 34;

/// Where the page records of one exported shard go, and what checks them.
struct ImagePages<'a> {
    pool: &'a Pool,
    /// The shard they all belong to, when the store has as many shards as
    /// the exporter had (else each finds its own).
    into: Option<usize>,
    slots: &'a crate::alloc::SlotTable,
    new_id: &'a dyn Fn(u8) -> Result<u8, StoreError>,
}

/// Most entries one exported shard reserves room for before its records
/// arrive (4 Mi pages: 16 GiB of pool in one shard).
const MAX_RESERVE: u64 = 1 << 22;

/// The fields of a page record as [`image_record`] wrote them, unchecked.
struct RecordFields {
    key: Key,
    flags: u8,
    codec: u8,
    check: u32,
    len: usize,
    loc: u64,
}

impl RecordFields {
    fn of(b: &[u8; IMAGE_RECORD]) -> Self {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        RecordFields {
            key: Key::new(u64_at(0), u64_at(8)),
            flags: b[16],
            codec: b[17],
            check: u32_at(18),
            len: u32_at(22) as usize,
            loc: u64_at(26),
        }
    }
}

fn image_record(e: &Entry) -> [u8; IMAGE_RECORD] {
    let mut b = [0u8; IMAGE_RECORD];
    b[0..8].copy_from_slice(&e.object.to_le_bytes());
    b[8..16].copy_from_slice(&e.index.to_le_bytes());
    b[16] = record_flags(e);
    b[17] = e.codec();
    b[18..22].copy_from_slice(&e.check.to_le_bytes());
    let len = if e.has(F_SAME) { 0 } else { u32::try_from(e.len()).expect("an object is under a page") };
    b[22..26].copy_from_slice(&len.to_le_bytes());
    // A same-filled page keeps its word where others keep their location.
    b[26..34].copy_from_slice(&e.loc.to_le_bytes());
    b
}

/// Records written (and read) at once: one CRC update and one write per
/// batch, not per page (a third of the export's time went to per-record
/// calls).
const IMAGE_BATCH: usize = 256;

/// The entries of `s` that hold a page of their own (not one in a group).
fn singles(s: &Shard) -> impl Iterator<Item = &Entry> + '_ {
    s.entries.live_handles().map(|h| s.entries.get(h)).filter(|e| !e.has(F_GROUP))
}

/// Writes the image record of every single page (not in a group) of `s`.
fn write_image_records(w: &mut W<'_>, s: &Shard, sum: &mut HandoverSummary) -> Result<(), StoreError> {
    let mut buf = [0u8; IMAGE_BATCH * IMAGE_RECORD];
    let mut n = 0;
    for e in singles(s) {
        buf[n * IMAGE_RECORD..(n + 1) * IMAGE_RECORD].copy_from_slice(&image_record(e));
        n += 1;
        if e.alloc_loc().is_some() {
            sum.object_bytes += e.len() as u64;
        }
        sum.pages += 1;
        if n == IMAGE_BATCH {
            w.bytes(&buf)?;
            n = 0;
        }
    }
    w.bytes(&buf[..n * IMAGE_RECORD])
}

/// Writes every single page (not in a group) of `s` as a stream record,
/// its stored bytes included.
fn write_stream_records(w: &mut W<'_>, sh: &Shared, s: &Shard, sum: &mut HandoverSummary) -> Result<(), StoreError> {
    for e in singles(s) {
        w.u64(e.object)?;
        w.u64(e.index)?;
        w.u8(record_flags(e))?;
        w.u8(e.codec())?;
        w.u32(e.check)?;
        if e.has(F_SAME) {
            w.u64(e.loc)?;
        } else if e.has(F_TIER) {
            w.u32(u32::try_from(e.len()).expect("an object is under a page"))?;
            w.u64(e.loc)?;
        } else {
            let loc = e.alloc_loc().expect("a pool page without tiers has an object");
            // SAFETY: `e` is live in `s`, whose lock the caller holds, so
            // the object is neither freed nor moved while we read it, and
            // `e.len()` is its length.
            let data = unsafe { sh.alloc.object(loc, e.len()) };
            w.u32(u32::try_from(data.len()).expect("an object is under a page"))?;
            w.bytes(data)?;
            sum.object_bytes += data.len() as u64;
        }
        sum.pages += 1;
    }
    Ok(())
}

/// Writes whether a pool slot holds a pool (a destroyed one keeps its id
/// in the stream), counting the slot; returns the pool.
fn write_present<'p>(
    w: &mut W<'_>,
    pool: &'p Option<Arc<Pool>>,
    sum: &mut HandoverSummary,
) -> Result<Option<&'p Arc<Pool>>, StoreError> {
    sum.pools += 1;
    w.u8(u8::from(pool.is_some()))?;
    Ok(pool.as_ref())
}

fn bad_len(_: std::num::TryFromIntError) -> StoreError {
    bad("a count larger than this machine's address space")
}

impl Store {
    /// Writes the store to `w` for [`Store::import`] in a successor. The
    /// caller keeps writers out meanwhile. Refused for a store with tiers.
    pub fn export(&self, w: &mut dyn Write) -> Result<HandoverSummary, StoreError> {
        self.export_as(w, false)
    }

    /// Writes the store's image to `w` for [`Store::import_image`] in a
    /// successor that also receives [`Store::memfd`] (module docs). The
    /// store must be sealed ([`Store::seal`]) and built with
    /// [`StoreConfig::shared_memory`].
    pub fn export_image(&self, w: &mut dyn Write) -> Result<HandoverSummary, StoreError> {
        let arena = self.shared.alloc.arena();
        if arena.memfd().is_none() {
            return Err(bad("the store's pages are in private memory, not a memfd: it can only be streamed"));
        }
        if !arena.sealed() {
            return Err(bad("the store must be sealed before its image is written"));
        }
        self.export_as(w, true)
    }

    /// The memfd holding the pages of a store built with
    /// [`StoreConfig::shared_memory`].
    pub fn memfd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.shared.alloc.arena().memfd()
    }

    /// Seals the store's pages for a hand-over (`true`: every allocation
    /// fails and every free is skipped, so puts are refused), or opens them
    /// again (`false`): after a failed hand-over in the predecessor, after
    /// a finished one in the successor.
    pub fn seal(&self, sealed: bool) {
        self.shared.alloc.arena().seal(sealed);
        // Writeback would write to tiers that another process may go on
        // with, and free objects a sealed arena keeps.
        for p in self.shared.pools_snapshot() {
            p.tier_puts.set_held(sealed);
        }
    }

    /// Maps every page of an imported image into this process, which locks
    /// them under `mlockall(MCL_ONFAULT)`; returns the pages. Safe while
    /// the store serves: each span is mapped under its class's lock.
    pub fn populate(&self) -> std::io::Result<u64> {
        self.shared.alloc.populate()
    }

    fn export_as(&self, w: &mut dyn Write, image: bool) -> Result<HandoverSummary, StoreError> {
        let sh = &*self.shared;
        let pools = sh.pools.read().clone();
        let mut w = W(w, GatheredCrc::new());
        let mut sum = HandoverSummary::default();
        // Image 4 only after a snapshot: a successor that took none may be
        // one that reads up to image 3.
        let modes = image && self.tracks_changes();
        if image {
            w.bytes(IMAGE_MAGIC)?;
            w.u32(if modes { IMAGE_VERSION } else { 3 })?;
            w.u8(layout_byte(sh))?;
            write_alloc_image(&mut w, &sh.alloc.image(), modes)?;
        } else {
            w.bytes(MAGIC)?;
            w.u32(HANDOVER_VERSION)?;
        }
        write_policy(&mut w, &sh.policy.config())?;
        let codecs = *sh.codec_count.lock();
        w.u8(u8::try_from(codecs).expect("at most 32 codecs"))?;
        for id in 0..codecs {
            let cfg = sh.codec_configs[id].get().ok_or_else(|| bad(format!("codec {id} has no configuration")))?;
            write_codec(&mut w, cfg)?;
        }
        w.u8(sh.current_codec.load(Ordering::Relaxed))?;
        w.u64(sh.next_version.load(Ordering::SeqCst))?;
        match sh.auto_dictionary.get() {
            None => w.u8(0)?,
            Some(auto) => {
                w.u8(1)?;
                write_training(&mut w, &auto.handed())?;
            }
        }
        w.u32(u32::try_from(pools.len()).expect("fewer than 2^32 pools"))?;
        for pool in &pools {
            let Some(pool) = write_present(&mut w, pool, &mut sum)? else { continue };
            let c = &pool.cfg;
            w.u8(u8::from(c.kind == PoolKind::Ephemeral))?;
            w.u8(u8::from(c.exclusive_gets))?;
            w.u8(u8::from(c.reject_keeps_old))?;
            w.u8(u8::from(c.eviction == Eviction::Lru))?;
            match &pool.chain {
                None => w.u8(0)?,
                Some(chain) => {
                    w.u8(u8::try_from(chain.tiers.len()).expect("at most 8 tiers"))?;
                    w.u8(u8::from(chain.promote_on_get))?;
                    w.bytes(&chain.sealer.hand_over())?;
                }
            }
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
                if modes {
                    // Whether the importer holds this shard's snapshot
                    // (its changes are recorded from it on).
                    w.u8(u8::from(s.tracking()))?;
                    if s.tracking() {
                        sum.pages += s.entries.live() as u64;
                        sum.object_bytes += s.c.compr_data_size;
                        precopy::write_shard_changes(&mut w, &s)?;
                        continue;
                    }
                }
                w.u64(singles(&s).count() as u64)?;
                if image {
                    write_image_records(&mut w, &s, &mut sum)?;
                } else {
                    write_stream_records(&mut w, sh, &s, &mut sum)?;
                }
                w.u64(s.groups.len() as u64)?;
                for id in s.groups.ids() {
                    let g = s.groups.get(id).expect("listed");
                    write_group(&mut w, sh, &s, g, &mut sum, image)?;
                }
            }
        }
        w.bytes(if image { IMAGE_MAGIC } else { MAGIC })?;
        let crc = w.crc()?;
        w.u32(crc)?;
        w.finish()?;
        Ok(sum)
    }

    /// Builds a store from [`Store::export`]'s stream: `cfg` gives the
    /// allocator and shard count (and a codec, registered as usual); policy,
    /// codecs, pools, pages and counters come from the stream. Pool ids are
    /// kept. Any inconsistency (version, length, codec id, checksum) is an
    /// error naming it, and nothing is returned.
    pub fn import(cfg: StoreConfig, r: &mut dyn Read) -> Result<(Store, HandoverSummary), StoreError> {
        Self::import_as(cfg, r, None, &mut no_tiers, None)
    }

    /// [`Store::import`] (`memfd` `None`) or [`Store::import_image`] of a
    /// store whose pools may have tiers below them: `tiers` gives each such
    /// pool its tiers (module docs).
    pub fn import_tiered(
        cfg: StoreConfig,
        r: &mut dyn Read,
        memfd: Option<std::os::fd::OwnedFd>,
        tiers: ImportTiers<'_>,
    ) -> Result<(Store, HandoverSummary), StoreError> {
        Self::import_as(cfg, r, memfd, tiers, None)
    }

    /// Builds a store from [`Store::export_image`]'s stream and the
    /// exporter's memfd `fd`: maps the memfd and rebuilds the index and the
    /// allocator's tables, reading no stored page. The pages are faulted
    /// into this process later, by [`Store::populate`]. `cfg` must group pages
    /// as the exporter did; the allocator's tuning comes from the image.
    /// The store is returned sealed: see the module docs.
    pub fn import_image(
        cfg: StoreConfig,
        r: &mut dyn Read,
        fd: std::os::fd::OwnedFd,
    ) -> Result<(Store, HandoverSummary), StoreError> {
        Self::import_as(cfg, r, Some(fd), &mut no_tiers, None)
    }

    fn import_as(
        mut cfg: StoreConfig,
        r: &mut dyn Read,
        memfd: Option<std::os::fd::OwnedFd>,
        tiers: ImportTiers<'_>,
        mut snapshot: Option<Snapshot>,
    ) -> Result<(Store, HandoverSummary), StoreError> {
        let mut r = R(r, GatheredCrc::new());
        let magic = r.array::<8>()?;
        let image = memfd.is_some();
        let mut image_version = 0;
        let alloc = if let Some(fd) = memfd {
            if &magic != IMAGE_MAGIC {
                return Err(bad("not a tmem store image (bad magic)"));
            }
            image_version = r.u32()?;
            if !(1..=IMAGE_VERSION).contains(&image_version) {
                return Err(bad(format!("image format {image_version}, this build reads 1..={IMAGE_VERSION}")));
            }
            cfg.shard_windows = adopted_windows(&cfg, r.u8()?)?;
            let a = read_alloc_image(&mut r, image_version >= 4)?;
            Some(ZsAlloc::adopt(fd, &a).map_err(|e| bad(format!("image: {e}")))?)
        } else {
            if &magic != MAGIC {
                return Err(bad("not a tmem store export (bad magic)"));
            }
            None
        };
        let version = if image { image_version.min(3) + 1 } else { r.u32()? };
        // Image 4 says per shard whether its pages came ahead.
        let modes = image_version >= 4;
        if snapshot.is_some() && !modes {
            return Err(bad("a snapshot came ahead of an image that cannot complete it"));
        }
        if !(OLDEST_VERSION..=HANDOVER_VERSION).contains(&version) {
            return Err(bad(format!(
                "export format {version}, this build reads {OLDEST_VERSION}..={HANDOVER_VERSION}"
            )));
        }
        let (v2, v3, v4) = (version >= 2, version >= 3, version >= 4);
        cfg.policy = read_policy(&mut r)?;
        // The successor trains no dictionary of its own configuration: the
        // pages come with theirs, and training as it stood (format 4).
        cfg.dictionary = None;
        let store = match alloc {
            Some(alloc) => {
                alloc.arena().seal(true);
                cfg.build_with(alloc)?
            }
            None => cfg.build()?,
        };
        let sh = &*store.shared;
        // The adopted allocator is sealed: its slots are read once.
        let slots = image.then(|| sh.alloc.slot_table());
        let codecs = r.u8()?;
        let mut ids = Vec::with_capacity(usize::from(codecs));
        for _ in 0..codecs {
            ids.push(store.import_codec(&read_codec(&mut r)?)?);
        }
        let current = r.u8()?;
        let new_id = |old: u8| ids.get(usize::from(old)).copied().ok_or_else(|| bad(format!("no codec {old}")));
        store.set_codec(new_id(current)?)?;
        if v3 {
            sh.next_version.store(r.u64()?, Ordering::SeqCst);
        }
        if v4 && r.bool("dictionary training")? {
            let training = read_training(&mut r, &new_id)?;
            sh.auto_dictionary
                .set(dictionary::AutoDictionary::adopted(training))
                .map_err(|_| bad("dictionary training twice"))?;
        }
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
            let tiered = if v3 { usize::from(r.u8()?) } else { 0 };
            let pool = if tiered == 0 {
                store.create_pool(pc)
            } else {
                if tiered > MAX_TIERS {
                    return Err(bad(format!("pool {id}: {tiered} tiers (at most {MAX_TIERS})")));
                }
                let promote = r.bool("promote on get")?;
                let sealer = Sealer::adopt(&r.array()?).ok_or_else(|| bad(format!("pool {id}: an unknown sealer")))?;
                let below = tiers(id, tiered)?;
                if below.len() != tiered {
                    return Err(bad(format!("pool {id}: {} tiers given for {tiered}", below.len())));
                }
                let chain = TierChain::new(below, Arc::new(sealer))?.promote_on_get(promote);
                let pool = store.create_pool_inner(pc, Some(chain), false);
                // Sealed like the image until the caller opens the store.
                pool.tier_puts.set_held(image);
                pool
            };
            debug_assert_eq!(pool.id, id);
            let (events_in, cumulative_in) = if v2 { (usize::MAX, usize::MAX) } else { (EVENTS_V1, CUMULATIVE_V1) };
            for e in events(&pool.events).into_iter().take(events_in) {
                e.store(r.u64()?, Ordering::Relaxed);
            }
            let mut counted = ShardCounters::default();
            let shards = r.u32()?;
            for shard in 0..shards {
                let mut c = ShardCounters::default();
                for v in cumulative(&mut c).into_iter().take(cumulative_in) {
                    *v = r.u64()?;
                }
                for (into, v) in cumulative(&mut counted).into_iter().zip(cumulative(&mut c)) {
                    *into = into.saturating_add(*v);
                }
                if modes && r.bool("pages came ahead")? {
                    let snap = snapshot.as_mut().ok_or_else(|| bad("changes to a snapshot that never came"))?;
                    if shards as usize != pool.shards.len() {
                        return Err(bad(format!("pool {id}: changes for {shards} shards, {} here", pool.shards.len())));
                    }
                    let slots = slots.as_ref().expect("an image");
                    let adopted = precopy::Adopted { codecs, new_id: &new_id, slots };
                    store.install_shard(snap, &pool, shard as usize, &mut r, &adopted, &mut sum)?;
                    continue;
                }
                let entries = r.u64()?;
                match &slots {
                    Some(slots) => {
                        let into = (shards as usize == pool.shards.len()).then_some(shard as usize);
                        let image = ImagePages { pool: &pool, into, slots, new_id: &new_id };
                        store.import_image_pages(&image, entries, &mut r, &mut sum)?;
                    }
                    None => {
                        for _ in 0..entries {
                            store.import_page(&pool, &mut r, &new_id, &mut sum)?;
                        }
                    }
                }
                if v2 {
                    let groups = r.u64()?;
                    for _ in 0..groups {
                        store.import_group(&pool, &mut r, &new_id, &mut sum, slots.as_ref())?;
                    }
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
        if &r.array::<8>()? != if image { IMAGE_MAGIC } else { MAGIC } {
            return Err(bad("the export does not end where its counts say"));
        }
        let crc = r.1.value(&mut |_| Ok(())).map_err(io_err)?;
        if r.u32()? != crc {
            return Err(bad("the stream's checksum does not match: it was damaged on the way"));
        }
        if !image {
            // A sealed store compacts nothing; an image's successor compacts
            // once it serves.
            sh.maybe_compact();
        }
        Ok((store, sum))
    }

    /// Registers an imported codec, or finds the same one registered.
    fn import_codec(&self, cfg: &CodecConfig) -> Result<u8, StoreError> {
        self.shared.find_or_register_codec(cfg)
    }

    /// Reads one group record (format 2) and stores it as it is, or, in a
    /// store that does not group, its live pages one by one.
    fn import_group(
        &self,
        pool: &Pool,
        r: &mut R<'_>,
        new_id: &dyn Fn(u8) -> Result<u8, StoreError>,
        sum: &mut HandoverSummary,
        adopted: Option<&crate::alloc::SlotTable>,
    ) -> Result<(), StoreError> {
        use crate::group::{self, Group, MAX_GROUP_PAGES, MAX_STORED_BLOCK};
        let sh = &*self.shared;
        let (object, base) = (r.u64()?, r.u64()?);
        let codec = new_id(r.u8()?)?;
        let (slots, live) = (r.u16()?, r.u16()?);
        let (len, check) = (r.u32()? as usize, r.u32()?);
        let what = format!("group of object {object} at {base}");
        if base % MAX_GROUP_PAGES as u64 != 0 {
            return Err(bad(format!("{what}: not at the start of a window")));
        }
        if live == 0 || live & !slots != 0 {
            return Err(bad(format!("{what}: live slots {live:#06x} of {slots:#06x}")));
        }
        if len == 0 || len > MAX_STORED_BLOCK {
            return Err(bad(format!("{what}: a block of {len} bytes")));
        }
        let mut page_checks = [0u32; MAX_GROUP_PAGES];
        for slot in Group::slots_in(live) {
            page_checks[slot as usize] = r.u32()?;
        }
        if !sh.codec(codec)?.supports_blocks() {
            return Err(bad(format!("{what}: codec {codec} has no block mode")));
        }
        sum.object_bytes += len as u64;
        let chunks = if let Some(adopted) = adopted {
            if sh.group.is_none() {
                return Err(bad(format!("{what}: a group in the image of a store that does not group")));
            }
            let n = r.u32()? as usize;
            if n != len.div_ceil(group::CHUNK_BYTES) {
                return Err(bad(format!("{what}: {n} chunks for a block of {len} bytes")));
            }
            let mut chunks = Vec::with_capacity(n);
            for i in 0..n {
                let c = r.u64()?;
                if !adopted.holds(crate::alloc::Loc::unpack(c), group::chunk_len(len, i)) {
                    return Err(bad(format!("{what}: chunk {i} is not an allocated slot of the image")));
                }
                chunks.push(c);
            }
            chunks.into_boxed_slice()
        } else {
            let mut data = vec![0u8; len];
            r.fill(&mut data)?;
            if crc32fast::hash(&data) != check {
                return Err(bad(format!("{what}: checksum mismatch")));
            }
            if sh.group.is_none() {
                return self.import_group_expanded(pool, object, base, codec, slots, live, &data, &page_checks, sum);
            }
            group::store_chunks(&sh.alloc, &data).map_err(|e| bad(format!("{what}: no memory for it: {e}")))?
        };
        let g = Group {
            object,
            base,
            serial: 0,
            chunks,
            len: u32::try_from(len).expect("checked"),
            check,
            codec,
            slots,
            live,
        };
        let at = Key::new(object, base);
        let id = {
            let mut s = pool.shard_of(at, hash_key(at)).lock();
            Pool::count_group(&mut s.c, &g);
            let id = s.groups.insert(g);
            pool.account(&mut s);
            id
        };
        // Every key of the window lives in that shard: the entries go there.
        for slot in Group::slots_in(live) {
            let key = Key::new(object, base + u64::from(slot));
            let entry = Entry::new(key, u64::from(id), page_checks[slot as usize], 0, codec, F_GROUP);
            let stored = pool.insert_entry(key, hash_key(key), entry, Work::Deferred)?;
            debug_assert_eq!(stored, PutOutcome::Stored);
            sum.pages += 1;
        }
        Ok(())
    }

    /// Stores the live pages of an imported group one by one, in the codec
    /// new puts use (raw when that does not shrink them).
    #[allow(clippy::too_many_arguments)]
    fn import_group_expanded(
        &self,
        pool: &Pool,
        object: u64,
        base: u64,
        codec: u8,
        slots: u16,
        live: u16,
        data: &[u8],
        page_checks: &[u32; crate::group::MAX_GROUP_PAGES],
        sum: &mut HandoverSummary,
    ) -> Result<(), StoreError> {
        use crate::group::{decode_block, page_in, Group, BLOCK_BYTES};
        let sh = &*self.shared;
        let what = format!("group of object {object} at {base}");
        let mut block = vec![0u8; BLOCK_BYTES];
        decode_block(&**sh.codec(codec)?, data, slots, &mut block).map_err(|e| bad(format!("{what}: {e}")))?;
        let current = sh.current_codec.load(Ordering::Relaxed);
        let mut buf = [0u8; COMPRESS_BUF_SIZE];
        for slot in Group::slots_in(live) {
            let key = Key::new(object, base + u64::from(slot));
            let page = page_in(&block, slots, slot).map_err(|e| bad(format!("{what}: {e}")))?;
            if crc32fast::hash(page) != page_checks[slot as usize] {
                return Err(bad(format!("page {key:?}: checksum mismatch")));
            }
            let hash = hash_key(key);
            let entry = if let Some(word) = same_filled(page) {
                Entry::new(key, word, 0, 0, RAW_CODEC, F_SAME)
            } else {
                let n = sh.codec(current)?.compress(page, &mut buf).ok();
                let (bytes, id, flags): (&[u8], u8, u32) = match n {
                    Some(n) if n <= sh.policy.max_compressed_size() && n < PAGE_SIZE => (&buf[..n], current, 0),
                    _ => (&page[..], RAW_CODEC, F_INCOMPRESSIBLE),
                };
                let loc =
                    sh.alloc.alloc_write(bytes).map_err(|e| bad(format!("page {key:?}: no memory for it: {e}")))?;
                Entry::new(key, loc.pack(), crc32fast::hash(bytes), bytes.len(), id, flags)
            };
            let stored = pool.insert_entry(key, hash, entry, Work::Deferred)?;
            debug_assert_eq!(stored, PutOutcome::Stored);
            sum.pages += 1;
        }
        Ok(())
    }

    /// Reads the `n` page records of one exported shard and inserts them.
    /// Records go in batches: one read (and checksum update) and, where
    /// the shards are as they were exported, one shard lock per batch,
    /// with the shard's table sized for all of them first.
    fn import_image_pages(
        &self,
        image: &ImagePages<'_>,
        n: u64,
        r: &mut R<'_>,
        sum: &mut HandoverSummary,
    ) -> Result<(), StoreError> {
        let mut buf = [0u8; IMAGE_BATCH * IMAGE_RECORD];
        let pool = image.pool;
        if let Some(i) = image.into {
            // Capped: a damaged count must not reserve the machine's memory.
            let room = usize::try_from(n.min(MAX_RESERVE)).expect("capped");
            pool.shards[i].0.lock().reserve(room);
        }
        let mut left = n;
        while left > 0 {
            let k = usize::try_from(left.min(IMAGE_BATCH as u64)).expect("at most a batch");
            let records = &mut buf[..k * IMAGE_RECORD];
            r.fill(records)?;
            left -= k as u64;
            let Some(i) = image.into else {
                for b in records.chunks_exact(IMAGE_RECORD) {
                    let (key, entry) = self.image_entry(image, b.try_into().expect("a record"), sum)?;
                    let stored = pool.insert_entry(key, hash_key(key), entry, Work::Deferred)?;
                    debug_assert_eq!(stored, PutOutcome::Stored);
                }
                continue;
            };
            let mut s = pool.shards[i].0.lock();
            for b in records.chunks_exact(IMAGE_RECORD) {
                let (key, entry) = self.image_entry(image, b.try_into().expect("a record"), sum)?;
                let hash = hash_key(key);
                if pool.shard_index(key, hash) != i {
                    return Err(bad(format!("page {key:?}: in the image's shard {i}, which is not its shard")));
                }
                if !s.insert_new(entry, hash) {
                    return Err(bad(format!("page {key:?}: twice in the image")));
                }
                s.c.succ_puts += 1;
                Pool::count(&mut s.c, &entry);
                s.c.compressions += u64::from(entry.alloc_loc().is_some() && !entry.has(F_INCOMPRESSIBLE));
            }
            pool.account(&mut s);
        }
        Ok(())
    }

    /// The entry of one image record, checked against the adopted slots.
    fn image_entry(
        &self,
        image: &ImagePages<'_>,
        b: &[u8; IMAGE_RECORD],
        sum: &mut HandoverSummary,
    ) -> Result<(Key, Entry), StoreError> {
        let RecordFields { key, flags, codec, check, len, loc } = RecordFields::of(b);
        let codec = (image.new_id)(codec)?;
        let entry = if flags & REC_SAME != 0 {
            Entry::new(key, loc, 0, 0, RAW_CODEC, F_SAME)
        } else if let Some(t) = record_tier(flags) {
            self.tier_entry(image.pool, key, t, loc, check, len, codec, flags)?
        } else {
            let at = crate::alloc::Loc::unpack(loc);
            if len == 0 || len > PAGE_SIZE || !image.slots.holds(at, len) {
                return Err(bad(format!("page {key:?}: {len} bytes at {at:?} is not an allocated slot of the image")));
            }
            sum.object_bytes += len as u64;
            Entry::new(key, loc, check, len, codec, stored_flags(flags))
        };
        sum.pages += 1;
        Ok((key, entry))
    }

    /// The entry of a page that lives in tier `t` of `pool` under sealing
    /// `version`: `len` bytes with checksum `check` once opened.
    #[allow(clippy::too_many_arguments)]
    fn tier_entry(
        &self,
        pool: &Pool,
        key: Key,
        t: usize,
        version: u64,
        check: u32,
        len: usize,
        codec: u8,
        flags: u8,
    ) -> Result<Entry, StoreError> {
        let tiers = pool.chain.as_ref().map_or(0, |c| c.tiers.len());
        if t >= tiers {
            return Err(bad(format!("page {key:?}: in tier {t} of a pool with {tiers} tiers")));
        }
        if len == 0 || len > PAGE_SIZE {
            return Err(bad(format!("page {key:?}: a tier value of {len} bytes")));
        }
        // A version at or past the counter would be sealed again: a nonce reused.
        if version >= self.shared.next_version.load(Ordering::SeqCst) {
            return Err(bad(format!("page {key:?}: sealing version {version} is not below the store's counter")));
        }
        let mut e = Entry::new(key, 0, check, len, codec, stored_flags(flags));
        e.set_tier(t, version);
        Ok(e)
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
        } else if let Some(t) = record_tier(flags) {
            let (len, version) = (r.u32()? as usize, r.u64()?);
            self.tier_entry(pool, key, t, version, check, len, codec, flags)?
        } else {
            let len = r.u32()? as usize;
            if len == 0 || len > PAGE_SIZE {
                return Err(bad(format!("page {key:?}: an object of {len} bytes")));
            }
            let f = stored_flags(flags);
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
            Entry::new(key, loc.pack(), check, len, codec, f)
        };
        let stored = pool.insert_entry(key, hash, entry, Work::Deferred)?;
        debug_assert_eq!(stored, PutOutcome::Stored);
        sum.pages += 1;
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)] // test streams: small lengths and flag bytes
mod tests {
    use super::*;

    /// Copies a current-format stream of a store without groups, tiers or
    /// dictionary training into format 1: the same fields without those
    /// formats 2-4 added (the version counter and the training flag; per
    /// pool its tier count, 4 events; per shard 2 cumulative counters and
    /// the group count), version 1, and the checksum recomputed.
    fn to_v1(v3: &[u8]) -> Vec<u8> {
        struct Cut<'a> {
            src: &'a [u8],
            at: usize,
            out: Vec<u8>,
        }
        impl Cut<'_> {
            fn take(&mut self, n: usize) -> &[u8] {
                let b = &self.src[self.at..self.at + n];
                self.at += n;
                b
            }
            fn keep(&mut self, n: usize) -> u64 {
                let b = self.take(n).to_vec();
                self.out.extend_from_slice(&b);
                let mut v = [0u8; 8];
                v[..n.min(8)].copy_from_slice(&b[..n.min(8)]);
                u64::from_le_bytes(v)
            }
            fn skip(&mut self, n: usize) -> u64 {
                let b = self.take(n);
                let mut v = [0u8; 8];
                v[..n.min(8)].copy_from_slice(&b[..n.min(8)]);
                u64::from_le_bytes(v)
            }
        }
        let mut c = Cut { src: v3, at: 0, out: Vec::new() };
        c.keep(8);
        assert_eq!(c.skip(4), HANDOVER_VERSION.into());
        c.out.extend_from_slice(&1u32.to_le_bytes());
        c.keep(34); // policy
        for _ in 0..c.keep(1) {
            c.keep(5);
            let len = c.keep(4) as usize;
            c.keep(len);
        }
        c.keep(1);
        c.skip(8);
        assert_eq!(c.skip(1), 0, "no dictionary training in a format 1 stream");
        for _ in 0..c.keep(4) {
            if c.keep(1) == 0 {
                continue;
            }
            c.keep(4);
            assert_eq!(c.skip(1), 0, "no tiers in a format 1 stream");
            c.keep(8 * EVENTS_V1);
            c.skip(8 * (17 - EVENTS_V1));
            for _ in 0..c.keep(4) {
                c.keep(8 * CUMULATIVE_V1);
                c.skip(8 * (14 - CUMULATIVE_V1));
                for _ in 0..c.keep(8) {
                    c.keep(16);
                    let flags = c.keep(1);
                    c.keep(5);
                    if flags as u8 & REC_SAME != 0 {
                        c.keep(8);
                    } else {
                        let len = c.keep(4) as usize;
                        c.keep(len);
                    }
                }
                assert_eq!(c.skip(8), 0, "no groups in a format 1 stream");
            }
        }
        c.keep(8);
        let crc = crc32fast::hash(&c.out);
        c.out.extend_from_slice(&crc.to_le_bytes());
        assert_eq!(c.at + 4, v3.len());
        c.out
    }

    #[test]
    fn a_format_1_stream_is_still_imported() {
        let store = StoreConfig { shards: 2, ..Default::default() }.build().unwrap();
        let pool = store.create_pool(PoolConfig::persistent());
        let gone = store.create_pool(PoolConfig::ephemeral());
        store.destroy_pool(gone.id).unwrap();
        let page = |i: u64| {
            let mut p = [0u8; PAGE_SIZE];
            for (j, b) in p.iter_mut().enumerate() {
                *b = u8::try_from((j as u64 * (i + 3) / 7) % 251).unwrap();
            }
            p
        };
        for i in 0..50 {
            assert_eq!(pool.put(Key::new(1, i), &page(i)).unwrap(), PutOutcome::Stored);
        }
        assert_eq!(pool.put(Key::new(1, 99), &[7u8; PAGE_SIZE]).unwrap(), PutOutcome::Stored);
        let mut out = [0u8; PAGE_SIZE];
        assert_eq!(pool.get(Key::new(1, 3), &mut out).unwrap(), GetOutcome::Hit);
        let mut v3 = Vec::new();
        store.export(&mut v3).unwrap();
        let v1 = to_v1(&v3);
        assert!(v1.len() < v3.len());
        for cfg in [StoreConfig::default(), StoreConfig { group: Some(GroupConfig::default()), ..Default::default() }] {
            let (back, sum) = Store::import(cfg, &mut v1.as_slice()).unwrap();
            assert_eq!(sum.pages, 51);
            let p = back.pool(0).unwrap();
            for i in 0..50 {
                assert_eq!(p.get(Key::new(1, i), &mut out).unwrap(), GetOutcome::Hit);
                assert_eq!(out, page(i));
            }
            assert_eq!(p.get(Key::new(1, 99), &mut out).unwrap(), GetOutcome::Hit);
            assert_eq!(out, [7u8; PAGE_SIZE]);
            assert_eq!(back.stats().total.succ_gets, 1 + 51, "counters came along");
            assert!(matches!(back.pool(1), Err(StoreError::PoolDestroyed(1))));
        }
        // A version from the future is refused.
        let mut future = v3.clone();
        future[8..12].copy_from_slice(&(HANDOVER_VERSION + 1).to_le_bytes());
        assert!(Store::import(StoreConfig::default(), &mut future.as_slice()).is_err());
    }

    #[test]
    fn training_travels_whole_and_a_long_status_is_cut_on_a_character_boundary() {
        let t = dictionary::HandedTraining {
            cfg: DictTraining { after_bytes: 1 << 20, sample_pages: 300, dict_bytes: 4096, max_dictionaries: 2 },
            base: CodecConfig::Zstd { level: 3, dictionary: None },
            armed: true,
            finished: false,
            next_bytes: 5 << 20,
            failures: 1,
            dictionaries: 1,
            codec_id: 2,
            tried_bytes: 3 << 20,
            seen_pages: 700,
            seen_bytes: 900_000,
            // Byte 4096 falls inside a character.
            status: format!("x{}", "é".repeat(3000)),
        };
        let mut out = Vec::new();
        let mut w = W(&mut out, GatheredCrc::new());
        write_training(&mut w, &t).unwrap();
        w.finish().unwrap();
        let mut src = out.as_slice();
        let mut r = R(&mut src, GatheredCrc::new());
        let back = read_training(&mut r, &|id| Ok(id + 10)).unwrap();
        assert_eq!(back.status, format!("x{}", "é".repeat(2047)), "cut before the character at byte 4096");
        assert_eq!(back, dictionary::HandedTraining { codec_id: 12, status: back.status.clone(), ..t });
    }
}
