//! Grouping cold pages: a denser cold tier (issue 30, item 3).
//!
//! With [`StoreConfig::group`] set, a low-priority thread (one [`Worker`],
//! like recompression's) compresses the cold pages of each aligned window of
//! [`MAX_GROUP_PAGES`] indexes of an object together, as one block
//! (`crate::group`), with zstd at a high level and, optionally, a dictionary
//! trained on the pool. For `PoolDevice` (object 0, index = page of the
//! device) a window is 64 KiB of adjacent device offsets.
//!
//! # Placement
//! A group's pages must share one lock: the block is read, rewritten,
//! compacted and freed under it. So a store that groups places each window
//! in one shard: the shard is picked by the hash of (object, index / 16)
//! instead of the key's ([`Pool::shard_of`]). The hash table inside a shard
//! still hashes whole keys. A store without grouping keeps its placement.
//!
//! # Which pages
//! Every [`GroupConfig::after`] the thread visits each shard of each
//! persistent pool once, under its lock, and ages the entries with the bits
//! recompression uses (`F_HOT`, set by gets; `F_SEEN`, set by a visit): an
//! entry still unread at its second visit is cold. The cold single pages of
//! a window (at most [`GroupConfig::pages`] per group, at least two; a hot,
//! same-filled, raw, written-back or written-back-in-flight page between
//! them stays single) are copied out under the lock, decoded, compressed
//! together outside it, and switched into the group under the lock again
//! only if every one of them still holds the bytes copied (and no writeback
//! picked it); otherwise the block is freed and the race counted. A window
//! that does not come out a thirty-second smaller than its pages is
//! marked `F_KEEP` (shared with recompression: left as it is until the page
//! is replaced); the comparison is of memory: the pages' allocator slots
//! against the block's chunks' slots and its group's record.
//!
//! # Grouped entries and tombstones
//! A grouped entry holds no memory of its own: its location is its group's
//! id in the shard, its checksum the CRC32 of the page, so a read checks the
//! page it copies out of the block. A grouped page overwritten, flushed,
//! trimmed, read exclusively or written back becomes a tombstone: its slot
//! stays in the block, the group's live set loses it. A group with no live
//! page is freed at once; one with at most
//! [`GroupConfig::rewrite_live_percent`] of its slots live is rewritten by
//! the next pass from its live pages (a single live page goes back to being
//! a single page in the codec new puts use).
//!
//! # Reads
//! A read of a grouped page decodes its block into one of the shard's
//! [`GroupConfig::cache_blocks`] cache buffers (allocated when first needed,
//! counted as metadata, dropped by a pass that finds them unused since the
//! last one), so reading the neighbours costs a copy and a CRC.
//!
//! # The rest of the store
//! Writeback takes a grouped page out of its group as a single page (encoded
//! with the codec new puts use, outside the shard lock) and leaves a
//! tombstone; recompression and dictionary sampling skip grouped pages;
//! compaction moves the blocks' tail chunks; a hand-over sends groups as
//! they are (format 2).

use std::cell::RefCell;
use std::sync::Arc;
use std::time::Duration;

use super::worker::{StopFlag, Worker};
use super::*;
use crate::codec::COMPRESS_BUF_SIZE;
use crate::group::{
    chunk_slot_bytes, decode_block, encode_block, free_chunks, page_in, slot_of, store_chunks, window_base, Group,
    BLOCK_BYTES, MAX_GROUP_PAGES, MAX_STORED_BLOCK,
};
use crate::shard::F_GROUP;

thread_local! {
    /// Each thread's buffer for a block's bytes gathered from its chunks
    /// before decoding, so a read allocates nothing per page.
    static GATHER: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Background grouping settings ([`StoreConfig::group`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupConfig {
    /// Most pages per group, 2..=16 (of one aligned window of 16 indexes).
    pub pages: usize,
    /// zstd level of the blocks.
    pub level: i32,
    /// Compress with a dictionary: the newest one the store has registered
    /// (automatic training, recompression's `+dict`), else one trained on
    /// the pool once it holds 8 MiB (until then nothing is grouped).
    pub dictionary: bool,
    /// How long a page goes unread before it is grouped: the worker visits
    /// every shard this often, and takes a page on the second visit that
    /// finds it unread (so after one to two periods).
    pub after: Duration,
    /// A group with at most this share of its slots live (in percent) is
    /// rewritten from its live pages.
    pub rewrite_live_percent: u32,
    /// Decoded blocks kept per shard, 1..=64 (64 KiB each).
    pub cache_blocks: usize,
    /// CPU priority of the worker thread (`nice`, 0..=19).
    pub nice: i32,
}

impl Default for GroupConfig {
    fn default() -> Self {
        Self {
            pages: MAX_GROUP_PAGES,
            level: 9,
            dictionary: true,
            after: Self::DEFAULT_AFTER,
            rewrite_live_percent: 50,
            cache_blocks: 2,
            nice: 19,
        }
    }
}

impl GroupConfig {
    /// Default idle time before a page is grouped.
    pub const DEFAULT_AFTER: Duration = Duration::from_secs(10);

    /// Checks every setting and builds the block codec it names (without
    /// its dictionary, which comes from the pool).
    pub fn build(&self) -> Result<Arc<dyn Codec>, StoreError> {
        let bad = |reason: String| StoreError::Group(reason);
        if !(2..=MAX_GROUP_PAGES).contains(&self.pages) {
            return Err(bad(format!("pages per group must be 2..={MAX_GROUP_PAGES}, not {}", self.pages)));
        }
        if self.rewrite_live_percent > 99 {
            return Err(bad(format!("rewrite_live_percent must be 0..=99, not {}", self.rewrite_live_percent)));
        }
        if !(1..=64).contains(&self.cache_blocks) {
            return Err(bad(format!("cache_blocks must be 1..=64, not {}", self.cache_blocks)));
        }
        if self.after.is_zero() {
            return Err(bad("the grouping period must not be zero".into()));
        }
        Ok(CodecConfig::Zstd { level: self.level, dictionary: None }.build()?)
    }

    /// The codec spec of the blocks, for status lines.
    fn codec(&self, dictionary: Option<Arc<[u8]>>) -> CodecConfig {
        CodecConfig::Zstd { level: self.level, dictionary }
    }
}

/// [`Shared::group_codec`] before grouping has a codec.
pub(super) const NO_GROUP_CODEC: u8 = u8::MAX;
/// [`Shared::group_state`] values.
pub(super) const GROUP_OFF: u8 = 0;
const GROUP_WAITING: u8 = 1;
const GROUP_RUNNING: u8 = 2;
const GROUP_UNTRAINED: u8 = 3;
const GROUP_FAILED: u8 = 4;

/// Whether grouping may take `e` at all: a single page holding an object
/// that is not raw, not under writeback and not kept as it is.
fn groupable(e: &Entry) -> bool {
    e.alloc_loc().is_some() && e.meta & (F_INCOMPRESSIBLE | F_WB | F_KEEP) == 0 && e.codec() != RAW_CODEC
}

/// Worth grouping: the block, stored ([`crate::group::block_cost`]: its
/// chunks' slots and its group's record), saves at least a thirty-second
/// of the slots its pages hold alone (against pages already in zstd with a
/// dictionary, a window often saves only 3-10%; less is not worth decoding
/// neighbours for).
fn smaller_enough(block: usize, singles: usize) -> bool {
    block * 32 <= singles * 31
}

/// One page copied out for grouping.
struct Snap {
    key: Key,
    hash: u64,
    old: Entry,
    /// Where its object's bytes are in `Scratch::bytes`.
    start: usize,
    /// Bytes of the allocator slot holding its object.
    slot: usize,
    /// CRC32 of the page, once decoded.
    page_check: u32,
}

/// Buffers reused across windows, so a pass allocates nothing per page.
struct Scratch {
    cands: Vec<Key>,
    rewrites: Vec<(u32, u64)>,
    snaps: Vec<Snap>,
    /// Copied objects, or a gathered block.
    bytes: Vec<u8>,
    /// Pages of a block, decoded or to encode.
    pages: Vec<u8>,
    /// An encoded block.
    out: Vec<u8>,
    single: Box<CompressBuf>,
    free: Vec<Loc>,
}

impl Scratch {
    fn new() -> Self {
        Self {
            cands: Vec::new(),
            rewrites: Vec::new(),
            snaps: Vec::with_capacity(MAX_GROUP_PAGES),
            bytes: Vec::with_capacity(MAX_STORED_BLOCK),
            pages: vec![0; BLOCK_BYTES],
            out: vec![0; MAX_STORED_BLOCK],
            single: Box::new([0; COMPRESS_BUF_SIZE]),
            free: Vec::with_capacity(MAX_GROUP_PAGES),
        }
    }
}

/// What a rewrite puts in place of a group.
enum Rewritten {
    /// A group of the live pages: its chunks, length and checksum.
    Group { chunks: Box<[u64]>, len: usize, check: u32 },
    /// The one live page as a single page.
    Single { loc: Loc, len: usize, check: u32, codec: u8, raw: bool },
}

/// The grouping worker's state between passes.
struct Job {
    shared: Arc<Shared>,
    cfg: GroupConfig,
    /// Codec id of new blocks, once registered ([`RAW_CODEC`]: it failed).
    codec: Option<u8>,
    /// Whether that codec has a dictionary.
    with_dictionary: bool,
    sc: Scratch,
}

impl Job {
    /// One pass over every pool; `aging`: only pages unread since the last
    /// visit (else every page that may be grouped). Returns whether it
    /// visited every shard.
    fn pass(&mut self, stop: Option<&StopFlag>, aging: bool) -> bool {
        let Some(to) = self.prepare().filter(|&t| t != RAW_CODEC) else { return false };
        let Ok(codec) = self.shared.codec(to).cloned() else { return false };
        for pool in self.shared.pools_snapshot() {
            // Ephemeral pages are dropped one by one under pressure, and a
            // dropped grouped page frees nothing: only persistent pools
            // group (an imported ephemeral group is still rewritten).
            let make = pool.cfg.kind == PoolKind::Persistent;
            for i in 0..pool.shards.len() {
                if stop.is_some_and(StopFlag::is_set) || pool.destroyed.load(Ordering::Acquire) {
                    break;
                }
                pool.group_shard(i, to, &*codec, &self.cfg, make && aging, make, &mut self.sc);
            }
            if stop.is_some_and(StopFlag::is_set) {
                return false;
            }
        }
        self.shared.maybe_compact();
        true
    }

    /// The block codec: registered once (with the store's newest dictionary
    /// if asked, training one if there is none); later passes move to a
    /// dictionary registered since.
    fn prepare(&mut self) -> Option<u8> {
        let shared = Arc::clone(&self.shared);
        let sh = &*shared;
        if let Some(id) = self.codec {
            if id == RAW_CODEC || !self.cfg.dictionary || self.with_dictionary {
                return Some(id);
            }
            if let Some(dict) = sh.newest_dictionary() {
                self.register(Some(dict));
            }
            return self.codec;
        }
        let dict = if self.cfg.dictionary {
            let training = DictTraining::default();
            match sh.newest_dictionary() {
                Some(d) => Some(d),
                None if sh.alloc.total_bytes() < training.after_bytes => {
                    sh.group_state.store(GROUP_WAITING, Ordering::Relaxed);
                    return None;
                }
                None => sh.sample_and_train(&training).ok().map(|(d, _)| d),
            }
        } else {
            None
        };
        let untrained = self.cfg.dictionary && dict.is_none();
        self.register(dict);
        if untrained && self.codec != Some(RAW_CODEC) {
            sh.group_state.store(GROUP_UNTRAINED, Ordering::Relaxed);
        }
        self.codec
    }

    fn register(&mut self, dict: Option<Arc<[u8]>>) {
        let sh = &*self.shared;
        let with = dict.is_some();
        match sh.find_or_register_codec(&self.cfg.codec(dict)) {
            Ok(id) => {
                self.codec = Some(id);
                self.with_dictionary = with;
                sh.group_codec.store(id, Ordering::Relaxed);
                sh.group_state.store(GROUP_RUNNING, Ordering::Relaxed);
            }
            Err(_) => {
                // Do not retry every period: no codec id is left.
                if self.codec.is_none() {
                    self.codec = Some(RAW_CODEC);
                    sh.group_state.store(GROUP_FAILED, Ordering::Relaxed);
                }
            }
        }
    }
}

impl Pool {
    /// Groups shard `i`'s cold pages (`make`; all of them unless `aging`)
    /// into codec `to`, rewrites its sparse groups, and drops its block
    /// cache if it went unused since the last visit.
    #[allow(clippy::too_many_arguments)]
    fn group_shard(
        &self,
        i: usize,
        to: u8,
        codec: &dyn Codec,
        cfg: &GroupConfig,
        aging: bool,
        make: bool,
        sc: &mut Scratch,
    ) {
        sc.cands.clear();
        sc.rewrites.clear();
        {
            let mut s = self.shards[i].0.lock();
            if (!s.cache.take_used() || s.groups.is_empty()) && s.cache.meta_bytes() > 0 {
                s.cache.clear();
                self.account(&mut s);
            }
            if make {
                let handles: Vec<u32> = s.entries.live_handles().collect();
                for h in handles {
                    let e = s.entries.get_mut(h);
                    if !groupable(e) {
                        continue;
                    }
                    if !aging {
                        sc.cands.push(e.key());
                    } else if e.has(F_HOT) {
                        e.meta &= !(F_HOT | F_SEEN);
                    } else if !e.has(F_SEEN) {
                        e.meta |= F_SEEN;
                    } else {
                        sc.cands.push(e.key());
                    }
                }
            }
            let pct = u64::from(cfg.rewrite_live_percent);
            for id in s.groups.ids() {
                let g = s.groups.get(id).expect("listed");
                if u64::from(g.live.count_ones()) * 100 <= pct * u64::from(g.slots.count_ones()) {
                    sc.rewrites.push((id, g.serial));
                }
            }
        }
        let rewrites = std::mem::take(&mut sc.rewrites);
        for &(id, serial) in &rewrites {
            self.rewrite_group(i, id, serial, to, codec, sc);
        }
        sc.rewrites = rewrites;
        let mut cands = std::mem::take(&mut sc.cands);
        cands.sort_unstable();
        cands.dedup();
        for window in cands.chunk_by(|a, b| a.object == b.object && window_base(a.index) == window_base(b.index)) {
            for members in window.chunks(cfg.pages) {
                if members.len() >= 2 {
                    self.group_window(i, members, to, codec, aging, sc);
                }
            }
        }
        sc.cands = cands;
    }

    /// Groups `members` (keys of one window of shard `i`, in index order);
    /// with `aging`, those read since they were picked stay single.
    fn group_window(&self, i: usize, members: &[Key], to: u8, codec: &dyn Codec, aging: bool, sc: &mut Scratch) {
        let alloc = &self.shared.alloc;
        // 1. Copy the objects out.
        sc.snaps.clear();
        sc.bytes.clear();
        let mut slots = 0u16;
        {
            let s = self.shards[i].0.lock();
            for &key in members {
                let hash = hash_key(key);
                let Some(h) = s.find(key, hash) else { continue };
                let e = *s.entries.get(h);
                let cold = !aging || !e.has(F_HOT);
                let Some(loc) = e.alloc_loc().filter(|_| groupable(&e) && cold) else { continue };
                let start = sc.bytes.len();
                // SAFETY: the entry is live in this shard and we hold its
                // lock, so the object is neither freed nor moved meanwhile.
                sc.bytes.extend_from_slice(unsafe { alloc.object(loc, e.len()) });
                let slot = alloc.slot_size(loc);
                sc.snaps.push(Snap { key, hash, old: e, start, slot, page_check: 0 });
                slots |= 1 << slot_of(key.index);
            }
        }
        if sc.snaps.len() < 2 {
            return;
        }
        // 2. Decode them and compress them together, outside the lock.
        let mut page = [0u8; PAGE_SIZE];
        for (k, p) in sc.snaps.iter_mut().enumerate() {
            let data = &sc.bytes[p.start..p.start + p.old.len()];
            let Ok(from) = self.shared.codec(p.old.codec()) else { return };
            // A corrupt object is left for its get to report.
            if crc32fast::hash(data) != p.old.check || from.decompress(data, &mut page).is_err() {
                return;
            }
            p.page_check = crc32fast::hash(&page);
            sc.pages[k * PAGE_SIZE..(k + 1) * PAGE_SIZE].copy_from_slice(&page);
        }
        let n_pages = sc.snaps.len();
        let Ok(n) = encode_block(codec, slots, &sc.pages[..n_pages * PAGE_SIZE], &mut sc.out) else { return };
        let singles: usize = sc.snaps.iter().map(|p| p.slot).sum();
        let gain = smaller_enough(crate::group::block_cost(alloc, n), singles);
        let chunks = if gain {
            match store_chunks(alloc, &sc.out[..n]) {
                Ok(c) => Some(c),
                // Out of memory: leave them single.
                Err(_) => return,
            }
        } else {
            None
        };
        // 3. Switch the entries, if every one still holds what was copied.
        let mut s = self.shards[i].0.lock();
        let unchanged = sc.snaps.iter().all(|p| {
            s.find(p.key, p.hash).is_some_and(|h| {
                let cur = s.entries.get(h);
                cur.alloc_loc().is_some_and(|loc| {
                    groupable(cur)
                        && cur.codec() == p.old.codec()
                        && cur.len() == p.old.len()
                        && cur.check == p.old.check
                        // SAFETY: live entry, shard lock held (as above).
                        && unsafe { alloc.object(loc, cur.len()) } == &sc.bytes[p.start..p.start + p.old.len()]
                })
            })
        });
        let chunks = match (chunks, unchanged) {
            (Some(chunks), true) => chunks,
            (None, true) => {
                for p in &sc.snaps {
                    let h = s.find(p.key, p.hash).expect("checked above");
                    s.entries.get_mut(h).meta |= F_KEEP;
                }
                drop(s);
                self.events.group_kept.fetch_add(n_pages as u64, Ordering::Relaxed);
                return;
            }
            (chunks, false) => {
                drop(s);
                if let Some(c) = chunks {
                    free_chunks(alloc, &c);
                }
                PoolEvents::bump(&self.events.group_raced);
                return;
            }
        };
        let first = sc.snaps[0].key;
        let group = Group {
            object: first.object,
            base: window_base(first.index),
            serial: 0,
            chunks,
            len: u32::try_from(n).expect("a block is under 4 GiB"),
            check: crc32fast::hash(&sc.out[..n]),
            codec: to,
            slots,
            live: slots,
        };
        Self::count_group(&mut s.c, &group);
        let id = s.groups.insert(group);
        for p in &sc.snaps {
            let h = s.find(p.key, p.hash).expect("checked above");
            let cur = *s.entries.get(h);
            Self::uncount(&mut s.c, &cur);
            sc.free.push(cur.alloc_loc().expect("checked above"));
            let e = s.entries.get_mut(h);
            e.recode(u64::from(id), p.page_check, 0, to);
            e.meta |= F_GROUP;
            let e = *e;
            Self::count(&mut s.c, &e);
        }
        self.account(&mut s);
        drop(s);
        // 4. Free what nothing reaches any more.
        for loc in sc.free.drain(..) {
            alloc.free(loc);
        }
        self.events.pages_grouped.fetch_add(n_pages as u64, Ordering::Relaxed);
    }

    /// Rewrites group `id` (serial `serial`) of shard `i` from its live pages.
    fn rewrite_group(&self, i: usize, id: u32, serial: u64, to: u8, codec: &dyn Codec, sc: &mut Scratch) {
        let sh = &*self.shared;
        // 1. Copy the block out.
        sc.bytes.clear();
        let (slots, live, from, check) = {
            let s = self.shards[i].0.lock();
            let Some(g) = s.groups.get(id).filter(|g| g.serial == serial) else { return };
            // SAFETY: the group is live in this shard and we hold its lock,
            // so its chunks are neither freed nor moved meanwhile.
            unsafe { crate::group::gather(&sh.alloc, &g.chunks, g.len as usize, &mut sc.bytes) };
            (g.slots, g.live, g.codec, g.check)
        };
        // 2. Decode it and keep the live pages, in slot order.
        let Ok(old_codec) = sh.codec(from) else { return };
        if crc32fast::hash(&sc.bytes) != check || decode_block(&**old_codec, &sc.bytes, slots, &mut sc.pages).is_err() {
            // A corrupt block is left for its gets to report.
            return;
        }
        let mut kept = 0;
        for slot in Group::slots_in(live) {
            let at = crate::group::position(slots, slot).expect("live slots are in the block") * PAGE_SIZE;
            sc.pages.copy_within(at..at + PAGE_SIZE, kept * PAGE_SIZE);
            kept += 1;
        }
        let new = if kept >= 2 {
            let Ok(n) = encode_block(codec, live, &sc.pages[..kept * PAGE_SIZE], &mut sc.out) else { return };
            let Ok(chunks) = store_chunks(&sh.alloc, &sc.out[..n]) else { return };
            Rewritten::Group { chunks, len: n, check: crc32fast::hash(&sc.out[..n]) }
        } else {
            let page: &[u8; PAGE_SIZE] = sc.pages[..PAGE_SIZE].try_into().expect("one page");
            let id = sh.current_codec.load(Ordering::Relaxed);
            let n = sh.codec(id).ok().and_then(|c| c.compress(page, &mut sc.single).ok());
            let (data, codec, raw): (&[u8], u8, bool) = match n {
                Some(n) if n <= sh.policy.max_compressed_size() && n < PAGE_SIZE => (&sc.single[..n], id, false),
                // The page is stored already: raw rather than refused.
                _ => (&page[..], RAW_CODEC, true),
            };
            let Ok(loc) = sh.alloc.alloc_write(data) else { return };
            Rewritten::Single { loc, len: data.len(), check: crc32fast::hash(data), codec, raw }
        };
        // 3. Switch, if the group still has the same live pages.
        let mut s = self.shards[i].0.lock();
        if !s.groups.get(id).is_some_and(|g| g.serial == serial && g.live == live) {
            drop(s);
            match new {
                Rewritten::Group { chunks, .. } => free_chunks(&sh.alloc, &chunks),
                Rewritten::Single { loc, .. } => sh.alloc.free(loc),
            }
            PoolEvents::bump(&self.events.group_raced);
            return;
        }
        let (object, base) = s.groups.get(id).map(|g| (g.object, g.base)).expect("checked above");
        let members: Vec<u32> = Group::slots_in(live)
            .map(|slot| {
                let key = Key::new(object, base + u64::from(slot));
                let h = s.find(key, hash_key(key)).expect("a live slot has its entry");
                debug_assert_eq!(s.entries.get(h).group_id(), Some(id));
                h
            })
            .collect();
        match new {
            Rewritten::Group { chunks, len, check } => {
                let group = Group {
                    object,
                    base,
                    serial: 0,
                    chunks,
                    len: u32::try_from(len).expect("a block is under 4 GiB"),
                    check,
                    codec: to,
                    slots: live,
                    live,
                };
                Self::count_group(&mut s.c, &group);
                let new_id = s.groups.insert(group);
                for h in members {
                    let cur = *s.entries.get(h);
                    Self::uncount(&mut s.c, &cur);
                    let e = s.entries.get_mut(h);
                    e.recode(u64::from(new_id), cur.check, 0, to);
                    let e = *e;
                    Self::count(&mut s.c, &e);
                }
            }
            Rewritten::Single { loc, len, check, codec, raw } => {
                let h = members[0];
                let cur = *s.entries.get(h);
                Self::uncount(&mut s.c, &cur);
                let e = s.entries.get_mut(h);
                e.recode(loc.pack(), check, len, codec);
                e.meta &= !F_GROUP;
                if raw {
                    e.meta |= F_INCOMPRESSIBLE;
                }
                let e = *e;
                Self::count(&mut s.c, &e);
            }
        }
        let old = s.groups.remove(id);
        Self::uncount_group(&mut s.c, &old);
        s.cache.forget(old.serial);
        self.account(&mut s);
        drop(s);
        free_chunks(&sh.alloc, &old.chunks);
        PoolEvents::bump(&self.events.group_rewrites);
    }

    /// Counts a group's block in (its pages are counted with their entries).
    pub(super) fn count_group(c: &mut ShardCounters, g: &Group) {
        c.groups += 1;
        c.group_bytes += u64::from(g.len);
        c.compr_data_size += u64::from(g.len);
        c.group_codec_bytes[usize::from(g.codec)] += u64::from(g.len);
        c.group_dead_pages += g.dead();
    }

    /// Counts a group's block out.
    pub(super) fn uncount_group(c: &mut ShardCounters, g: &Group) {
        c.groups -= 1;
        c.group_bytes -= u64::from(g.len);
        c.compr_data_size -= u64::from(g.len);
        c.group_codec_bytes[usize::from(g.codec)] -= u64::from(g.len);
        c.group_dead_pages -= g.dead();
    }

    /// Turns grouped entry `e`, just removed from shard `s` (or leaving its
    /// group) and uncounted, into a tombstone of its group; frees the group
    /// if that was its last page. Returns the slot bytes freed.
    pub(super) fn tombstone(&self, s: &mut Shard, e: &Entry) -> u64 {
        let Some(id) = e.group_id() else { return 0 };
        let bit = 1u16 << slot_of(e.index);
        let Some(g) = s.groups.get_mut(id) else {
            debug_assert!(false, "grouped entry {:?} without its group {id}", e.key());
            return 0;
        };
        debug_assert!(g.live & bit != 0, "tombstone of a dead slot");
        g.live &= !bit;
        s.c.group_dead_pages += 1;
        if g.live != 0 {
            return 0;
        }
        let g = s.groups.remove(id);
        Self::uncount_group(&mut s.c, &g);
        s.cache.forget(g.serial);
        if s.groups.is_empty() {
            s.cache.clear();
        }
        let alloc = &self.shared.alloc;
        let bytes = chunk_slot_bytes(alloc, &g.chunks);
        free_chunks(alloc, &g.chunks);
        bytes
    }

    /// Copies the page of grouped entry `e` of shard `s` (locked by the
    /// caller) into `out`, decoding its block unless the shard's cache has
    /// it; checks the block's and the page's checksums. Returns whether the
    /// cache allocated a buffer (the caller accounts for it).
    pub(super) fn read_grouped(&self, s: &mut Shard, e: &Entry, out: &mut [u8; PAGE_SIZE]) -> Result<bool, String> {
        let id = e.group_id().ok_or("not a grouped page")?;
        let slot = slot_of(e.index);
        let (serial, slots, codec) = {
            let g = s.groups.get(id).ok_or_else(|| format!("group {id} is missing"))?;
            (g.serial, g.slots, g.codec)
        };
        let mut grew = false;
        if let Some((block, slots)) = s.cache.lookup(serial) {
            out.copy_from_slice(page_in(block, slots, slot).map_err(|err| err.to_string())?);
            s.c.group_cache_hits += 1;
        } else {
            s.c.group_cache_misses += 1;
            let codec = self.shared.codec(codec).map_err(|err| err.to_string())?;
            let cap = self.shared.group.as_ref().map_or(1, |c| c.cache_blocks);
            GATHER.with(|cell| {
                let mut own = Vec::new();
                let mut slot_buf = cell.try_borrow_mut();
                let buf = match &mut slot_buf {
                    Ok(b) => &mut **b,
                    Err(_) => &mut own,
                };
                buf.clear();
                let g = s.groups.get(id).expect("looked up above");
                // SAFETY: the group is live in this shard, whose lock the
                // caller holds: its chunks are neither freed nor moved.
                unsafe { crate::group::gather(&self.shared.alloc, &g.chunks, g.len as usize, buf) };
                if crc32fast::hash(buf) != g.check {
                    return Err("group block checksum mismatch".to_owned());
                }
                let (i, g2) = s.cache.slot(cap);
                grew = g2;
                decode_block(&**codec, buf, slots, s.cache.buffer(i)).map_err(|err| err.to_string())?;
                s.cache.commit(i, serial, slots);
                Ok(())
            })?;
            let (block, slots) = s.cache.lookup(serial).expect("just decoded");
            out.copy_from_slice(page_in(block, slots, slot).map_err(|err| err.to_string())?);
        }
        if crc32fast::hash(out) != e.check {
            return Err("grouped page checksum mismatch".into());
        }
        Ok(grew)
    }
}

impl Shared {
    /// The dictionary of the newest registered codec that has one.
    pub(super) fn newest_dictionary(&self) -> Option<Arc<[u8]>> {
        let n = *self.codec_count.lock();
        (0..n).rev().find_map(|i| match self.codec_configs[i].get()? {
            CodecConfig::Lz4 { dictionary: Some(d) } | CodecConfig::Zstd { dictionary: Some(d), .. } => Some(d.clone()),
            _ => None,
        })
    }

    /// Grouping's status line, if grouping is configured.
    pub(super) fn group_status(&self) -> Option<String> {
        let cfg = self.group.as_ref()?;
        let name = |id: u8| self.codec(id).map(|c| c.name().to_owned()).unwrap_or_default();
        let codec = self.group_codec.load(Ordering::Relaxed);
        Some(match self.group_state.load(Ordering::Relaxed) {
            GROUP_WAITING => format!(
                "zstd-{} waiting for {} MiB in the pool to train a dictionary on",
                cfg.level,
                DictTraining::default().after_bytes >> 20
            ),
            GROUP_RUNNING => format!("{}, up to {} pages a group", name(codec), cfg.pages),
            GROUP_UNTRAINED => {
                format!("{}, up to {} pages a group (without a dictionary, training failed)", name(codec), cfg.pages)
            }
            GROUP_FAILED => "failed (no codec id left for the block codec)".into(),
            _ => "starting".into(),
        })
    }
}

/// Background grouping thread (stopped when dropped).
pub type Grouper = Worker;

/// Grouping of a store's cold pages (see the module notes): run passes on
/// this thread with [`Grouping::pass`] (tests, benches), or hand it to a
/// low-priority thread of its own with [`Grouping::spawn`].
pub struct Grouping(Job);

impl std::fmt::Debug for Grouping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grouping").field("cfg", &self.0.cfg).field("codec", &self.0.codec).finish()
    }
}

impl Grouping {
    /// One pass over every shard of every pool: ages the pages, groups those
    /// gone unread since the previous pass, rewrites sparse groups.
    pub fn pass(&mut self) {
        self.0.pass(None, true);
    }

    /// A pass that groups every page that may be grouped, read or not.
    pub fn group_now(&mut self) {
        self.0.pass(None, false);
    }

    /// Runs a pass every `after` on a thread at the configured priority.
    pub fn spawn(self) -> Grouper {
        let (after, nice) = (self.0.cfg.after, self.0.cfg.nice);
        let mut job = self.0;
        Worker::start("tmem-group", after, nice, move |stop| {
            job.pass(Some(stop), true);
        })
    }
}

impl Store {
    /// Sets up grouping of every persistent pool's cold pages, as
    /// [`StoreConfig::group`] says (an error if it is not set).
    pub fn grouping(&self) -> Result<Grouping, StoreError> {
        let cfg = self
            .shared
            .group
            .clone()
            .ok_or_else(|| StoreError::Group("the store was built without grouping".into()))?;
        Ok(Grouping(Job {
            shared: Arc::clone(&self.shared),
            cfg,
            codec: None,
            with_dictionary: false,
            sc: Scratch::new(),
        }))
    }

    /// Checks that every grouped page points at a live slot of its group and
    /// that every live slot has its page, and that the group counters agree
    /// (tests; panics on a violation).
    #[doc(hidden)]
    pub fn check_groups(&self) {
        for pool in self.shared.pools_snapshot() {
            for shard in pool.shards.iter() {
                let s = shard.0.lock();
                let (mut pages, mut bytes, mut dead) = (0u64, 0u64, 0u64);
                for h in s.entries.live_handles() {
                    let e = s.entries.get(h);
                    let Some(id) = e.group_id() else { continue };
                    let g = s.groups.get(id).unwrap_or_else(|| panic!("{:?}: group {id} is missing", e.key()));
                    assert_eq!((g.object, g.base), (e.object, window_base(e.index)), "{:?} in group {id}", e.key());
                    assert!(g.live & (1 << slot_of(e.index)) != 0, "{:?}: dead slot", e.key());
                    assert_eq!(e.codec(), g.codec);
                    pages += 1;
                }
                for id in s.groups.ids() {
                    let g = s.groups.get(id).expect("listed");
                    assert!(
                        g.live != 0 && g.live & !g.slots == 0,
                        "group {id}: live {:#x} slots {:#x}",
                        g.live,
                        g.slots
                    );
                    for slot in Group::slots_in(g.live) {
                        let key = g.key(slot);
                        let h = s.find(key, hash_key(key)).unwrap_or_else(|| panic!("{key:?}: live slot, no entry"));
                        assert_eq!(s.entries.get(h).group_id(), Some(id), "{key:?}");
                    }
                    bytes += u64::from(g.len);
                    dead += g.dead();
                }
                assert_eq!(
                    (s.c.group_pages, s.c.groups, s.c.group_bytes, s.c.group_dead_pages),
                    (pages, s.groups.len() as u64, bytes, dead),
                    "group counters of a shard"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand_xoshiro::rand_core::{RngCore, SeedableRng};
    use rand_xoshiro::Xoshiro256PlusPlus;

    /// Log-like text: every page different, neighbours alike.
    fn page(seed: u64) -> [u8; PAGE_SIZE] {
        const WORDS: [&str; 8] = ["GET /api/items ", "200 ", "user=", "latency_ms=", "INFO ", "WARN ", "\n", "ok "];
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        let mut p = [0u8; PAGE_SIZE];
        let mut i = 0;
        while i < PAGE_SIZE {
            let x = rng.next_u64();
            let w = WORDS[usize::try_from(x % 8).unwrap()];
            for b in w.bytes().chain(format!("{} ", x >> 50).bytes()) {
                if i == PAGE_SIZE {
                    break;
                }
                p[i] = b;
                i += 1;
            }
        }
        p
    }

    fn key(i: u64) -> Key {
        Key::new(3, i)
    }

    fn grouping_store(cfg: GroupConfig) -> Store {
        StoreConfig { group: Some(cfg), shards: 4, ..Default::default() }.build().unwrap()
    }

    fn plain() -> GroupConfig {
        GroupConfig { dictionary: false, level: 3, ..Default::default() }
    }

    fn read(pool: &Pool, i: u64) -> Option<[u8; PAGE_SIZE]> {
        let mut out = [0u8; PAGE_SIZE];
        (pool.get(key(i), &mut out).unwrap() == GetOutcome::Hit).then_some(out)
    }

    #[test]
    fn a_window_lives_in_one_shard_only_when_grouping() {
        let grouped = grouping_store(plain());
        let pool = grouped.create_pool(PoolConfig::persistent());
        let shard = |p: &Pool, i: u64| p.shard_index(key(i), hash_key(key(i)));
        assert!((0..16).all(|i| shard(&pool, i) == shard(&pool, 0)));
        assert!((0..64).any(|i| shard(&pool, i) != shard(&pool, 0)));
        let plain_store = StoreConfig { shards: 4, ..Default::default() }.build().unwrap();
        let p2 = plain_store.create_pool(PoolConfig::persistent());
        assert!((0..16).any(|i| shard(&p2, i) != shard(&p2, 0)), "a store that does not group keeps its placement");
        assert!(matches!(plain_store.grouping(), Err(StoreError::Group(_))));
    }

    #[test]
    fn bad_settings_are_refused() {
        for cfg in [
            GroupConfig { pages: 1, ..plain() },
            GroupConfig { pages: 17, ..plain() },
            GroupConfig { level: 99, ..plain() },
            GroupConfig { cache_blocks: 0, ..plain() },
            GroupConfig { rewrite_live_percent: 100, ..plain() },
            GroupConfig { after: Duration::ZERO, ..plain() },
        ] {
            assert!(StoreConfig { group: Some(cfg.clone()), ..Default::default() }.build().is_err(), "{cfg:?}");
        }
    }

    #[test]
    fn cold_pages_are_grouped_hot_pages_stay_and_neighbours_hit_the_cache() {
        let store = grouping_store(plain());
        let pool = store.create_pool(PoolConfig::persistent());
        for i in 0..64 {
            assert_eq!(pool.put(key(i), &page(i)).unwrap(), PutOutcome::Stored);
        }
        // A same-filled page and a lone page in a window of its own stay single.
        assert_eq!(pool.put(key(70), &[0u8; PAGE_SIZE]).unwrap(), PutOutcome::Stored);
        assert_eq!(pool.put(key(100), &page(100)).unwrap(), PutOutcome::Stored);
        let before = store.stats().total.compr_data_size;
        let mut g = store.grouping().unwrap();
        g.pass(); // marks every page seen
        assert_eq!(store.stats().total.group_pages, 0);
        for i in 16..20 {
            assert_eq!(read(&pool, i), Some(page(i)));
        }
        g.pass(); // the unread ones go: 16 + 12 + 16 + 16; the 4 read stay single
        let st = store.stats();
        assert_eq!((st.total.group_pages, st.total.groups, st.total.pages_grouped), (60, 4, 60));
        assert_eq!(st.total.stored_pages, 66);
        assert!(st.total.compr_data_size * 10 < before * 9, "{before} -> {}", st.total.compr_data_size);
        assert_eq!(st.grouping.as_deref(), Some("zstd-3, up to 16 pages a group"));
        let rows: u64 = st.codecs.iter().map(|c| c.bytes).sum();
        assert_eq!(rows, st.total.compr_data_size, "{:?}", st.codecs);
        assert!(st.codecs.iter().any(|c| c.codec == "zstd-3 groups" && c.pages == 60), "{:?}", st.codecs);
        store.check_groups();
        for i in (0..64).chain([100]) {
            assert_eq!(read(&pool, i), Some(page(i)), "page {i}");
        }
        assert_eq!(read(&pool, 70), Some([0u8; PAGE_SIZE]));
        let t = store.stats().total;
        // One decode per group, the other pages from the cache.
        assert_eq!((t.group_cache_misses, t.group_cache_hits), (4, 56));
        // Reading a group back does not make it single again, and the
        // cache's memory is counted until a pass finds it idle.
        let with_cache = store.mem_used_total();
        g.pass(); // the cache was used; the 4 read pages lose F_HOT
        g.pass(); // the cache was not: dropped; the 4 are seen
        assert!(store.mem_used_total() < with_cache);
        assert_eq!(store.stats().total.group_pages, 60);
        g.pass(); // and grouped, a second group in their window
        let t = store.stats().total;
        assert_eq!((t.group_pages, t.groups), (64, 5));
        for i in 0..64 {
            assert_eq!(read(&pool, i), Some(page(i)), "page {i}");
        }
        store.check_groups();
    }

    #[test]
    fn tombstones_rewrites_and_frees() {
        let store = grouping_store(plain());
        let pool = store.create_pool(PoolConfig::persistent());
        for i in 0..32 {
            assert_eq!(pool.put(key(i), &page(i)).unwrap(), PutOutcome::Stored);
        }
        let mut g = store.grouping().unwrap();
        g.group_now();
        assert_eq!(store.stats().total.groups, 2);
        // Window 0: 9 pages overwritten or flushed, 7 live: at most half, rewritten.
        for i in 0..5 {
            assert_eq!(pool.put(key(i), &page(1000 + i)).unwrap(), PutOutcome::Stored);
        }
        for i in 5..9 {
            assert!(pool.flush_page(key(i)).unwrap());
        }
        // Window 1: 15 pages go, one stays: back to a single page.
        for i in 16..31 {
            assert!(pool.flush_page(key(i)).unwrap());
        }
        let t = store.stats().total;
        assert_eq!((t.group_dead_pages, t.groups, t.group_pages), (24, 2, 8));
        store.check_groups();
        g.pass();
        let t = store.stats().total;
        assert_eq!((t.group_rewrites, t.group_dead_pages, t.groups, t.group_pages), (2, 0, 1, 7));
        store.check_groups();
        for i in 0..32 {
            let want = match i {
                0..5 => Some(page(1000 + i)),
                5..9 | 16..31 => None,
                _ => Some(page(i)),
            };
            assert_eq!(read(&pool, i), want, "page {i}");
        }
        // A group whose pages all go is freed at once.
        for i in 9..16 {
            assert!(pool.flush_page(key(i)).unwrap());
        }
        assert_eq!(store.stats().total.groups, 0);
        assert_eq!(pool.flush_object(3).unwrap(), 6);
        let st = store.stats();
        assert_eq!((st.alloc.objects, st.alloc.span_bytes, st.total.compr_data_size), (0, 0, 0));
        assert_eq!(st.mem_used_total, 0, "nothing left: no index, no group table, no cache");
    }

    #[test]
    fn compaction_moves_block_chunks() {
        let store = grouping_store(plain());
        let pool = store.create_pool(PoolConfig::persistent());
        for i in 0..(64 * 16) {
            assert_eq!(pool.put(key(i), &page(i)).unwrap(), PutOutcome::Stored);
        }
        let mut g = store.grouping().unwrap();
        g.group_now();
        // Free every other group: their tail chunks leave holes in spans.
        for w in (0..64).step_by(2) {
            for i in w * 16..w * 16 + 16 {
                pool.flush_page(key(i)).unwrap();
            }
        }
        let before = store.stats().alloc;
        assert!(store.compact() > 0);
        let after = store.stats().alloc;
        assert!(after.objects_migrated > before.objects_migrated && after.span_bytes < before.span_bytes);
        store.check_groups();
        for w in (1..64).step_by(2) {
            for i in w * 16..w * 16 + 16 {
                assert_eq!(read(&pool, i), Some(page(i)), "page {i}");
            }
        }
    }

    #[test]
    fn a_corrupt_block_is_an_error_not_a_page() {
        let store = grouping_store(plain());
        let pool = store.create_pool(PoolConfig::persistent());
        for i in 0..16 {
            assert_eq!(pool.put(key(i), &page(i)).unwrap(), PutOutcome::Stored);
        }
        store.grouping().unwrap().group_now();
        {
            let hash = hash_key(key(0));
            let s = pool.shard_of(key(0), hash).lock();
            let g = s.groups.get(0).unwrap();
            // SAFETY: shard lock held; the byte is inside the first chunk.
            unsafe { store.shared.alloc.corrupt_object(Loc::unpack(g.chunks[0]), 10) };
        }
        let mut out = [1u8; PAGE_SIZE];
        assert!(matches!(pool.get(key(3), &mut out), Err(StoreError::Corrupt { .. })));
        assert_eq!(out, [0u8; PAGE_SIZE]);
        assert_eq!(store.stats().total.decompress_fail, 1);
        // The pages are still held; flushing them frees the group.
        assert_eq!(pool.flush_object(3).unwrap(), 16);
        assert_eq!(store.stats().alloc.objects, 0);
    }

    #[test]
    fn grouping_waits_for_a_dictionary_and_takes_the_stores() {
        let store = grouping_store(GroupConfig { dictionary: true, ..plain() });
        let pool = store.create_pool(PoolConfig::persistent());
        for i in 0..64 {
            assert_eq!(pool.put(key(i), &page(i)).unwrap(), PutOutcome::Stored);
        }
        let mut g = store.grouping().unwrap();
        g.group_now();
        assert_eq!(store.stats().total.groups, 0);
        assert!(store.stats().grouping.unwrap().contains("waiting"), "{:?}", store.stats().grouping);
        // A dictionary the store trained (here on demand) is taken.
        let training = DictTraining { sample_pages: 64, dict_bytes: 8192, ..Default::default() };
        store.train_dictionary(&CodecConfig::Zstd { level: 1, dictionary: None }, &training).unwrap();
        g.group_now();
        let st = store.stats();
        assert_eq!(st.total.group_pages, 64, "{:?}", st.grouping);
        assert_eq!(st.grouping.as_deref(), Some("zstd-3+dict, up to 16 pages a group"));
        for i in 0..64 {
            assert_eq!(read(&pool, i), Some(page(i)));
        }
    }

    #[test]
    fn windows_that_do_not_shrink_are_kept_and_exclusive_gets_leave_tombstones() {
        let store = grouping_store(plain());
        let pool = store.create_pool(PoolConfig::persistent().exclusive_gets(true));
        // Pages that share nothing (random bytes, a run of zeros any codec
        // takes): no better together than apart.
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(9);
        let mut pages = Vec::new();
        for i in 0..16 {
            let mut p = [0u8; PAGE_SIZE];
            rng.fill_bytes(&mut p[..PAGE_SIZE - 600]);
            pages.push(p);
            assert_eq!(pool.put(key(i), &p).unwrap(), PutOutcome::Stored);
        }
        let mut g = store.grouping().unwrap();
        g.group_now();
        let t = store.stats().total;
        assert_eq!((t.groups, t.group_kept), (0, 16));
        g.group_now();
        assert_eq!(store.stats().total.group_kept, 16, "kept pages are not tried again");
        for i in 16..32 {
            assert_eq!(pool.put(key(i), &page(i)).unwrap(), PutOutcome::Stored);
        }
        g.group_now();
        assert_eq!(store.stats().total.group_pages, 16);
        for i in 16..32 {
            assert_eq!(read(&pool, i), Some(page(i)));
            assert_eq!(read(&pool, i), None, "exclusive");
        }
        let t = store.stats().total;
        assert_eq!((t.groups, t.group_pages, t.group_dead_pages), (0, 0, 0));
        for (i, p) in (0..16).zip(pages) {
            assert_eq!(read(&pool, i), Some(p));
        }
    }
}
