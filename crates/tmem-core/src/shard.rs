//! One shard of a pool's index: a hash table from key to entry handle, the
//! entries themselves, an LRU list through them, and the shard's counters.
//!
//! A shard is only ever used under its pool's per-shard mutex.

use hashbrown::HashTable;

use crate::alloc::Loc;
use crate::dirty::Dirty;
use crate::group::{BlockCache, Groups};
use crate::stats::ShardCounters;
use crate::Key;

/// "No entry" in LRU links and free lists.
pub(crate) const NIL: u32 = u32::MAX;

/// Entry flags, stored above the length and codec in `Entry::meta`.
const LEN_BITS: u32 = 13;
const CODEC_BITS: u32 = 5;
const CODEC_SHIFT: u32 = LEN_BITS;
const FLAG_SHIFT: u32 = LEN_BITS + CODEC_BITS;
/// Entry holds a page (free entries have this clear).
pub(crate) const F_LIVE: u32 = 1 << FLAG_SHIFT;
/// Page is one repeated word, kept in `Entry::loc`; nothing is allocated.
pub(crate) const F_SAME: u32 = 2 << FLAG_SHIFT;
/// Read since it was stored or last passed by the LRU hand (second chance).
pub(crate) const F_REFERENCED: u32 = 4 << FLAG_SHIFT;
/// Stored uncompressed because it did not compress well enough.
pub(crate) const F_INCOMPRESSIBLE: u32 = 8 << FLAG_SHIFT;
/// The page lives in a lower tier; `Entry::loc` holds its sealing version.
pub(crate) const F_TIER: u32 = 16 << FLAG_SHIFT;
/// Chosen for writeback and not replaced since (cleared when writeback ends).
pub(crate) const F_WB: u32 = 32 << FLAG_SHIFT;
/// On the shard's LRU list.
pub(crate) const F_INLRU: u32 = 64 << FLAG_SHIFT;
const TIER_SHIFT: u32 = FLAG_SHIFT + 7;
/// Read since recompression last visited it (recompression's own bit, so
/// that it does not take the LRU's second chance away).
pub(crate) const F_HOT: u32 = 1 << (TIER_SHIFT + 3);
/// Visited by recompression unread: recompressed on the next visit if it
/// is still unread then.
pub(crate) const F_SEEN: u32 = 2 << (TIER_SHIFT + 3);
/// Recompression tried and the other codec was not smaller enough: left
/// as it is until the page is replaced.
pub(crate) const F_KEEP: u32 = 4 << (TIER_SHIFT + 3);
/// The page is in a group (`crate::group`): `Entry::loc` holds the group's
/// id in its shard, `Entry::check` the CRC32 of the page itself, the codec
/// field the group's codec; the length is 0 (the entry holds no object).
pub(crate) const F_GROUP: u32 = 1 << 31;
const _: () = assert!(F_GROUP > F_KEEP && F_GROUP.count_ones() == 1, "the last free flag bit");
/// Tiers a pool can chain.
pub const MAX_TIERS: usize = 8;

/// Maximum codec id an entry can record.
pub const MAX_CODECS: usize = 1 << CODEC_BITS;

/// One stored page: 40 bytes. This is the stable handle of the page; the
/// allocator location inside it changes when compaction moves the object.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Entry {
    pub object: u64,
    pub index: u64,
    /// Packed [`Loc`], or the fill word when `F_SAME` is set.
    pub loc: u64,
    /// CRC32 of the stored bytes.
    pub check: u32,
    /// Stored length (13 bits), codec id (5 bits), flags.
    pub meta: u32,
    pub prev: u32,
    pub next: u32,
}

impl Entry {
    pub fn new(key: Key, loc: u64, check: u32, len: usize, codec: u8, flags: u32) -> Self {
        debug_assert!(len < 1 << LEN_BITS && usize::from(codec) < MAX_CODECS);
        let len = u32::try_from(len).expect("stored length fits 13 bits");
        Self {
            object: key.object,
            index: key.index,
            loc,
            check,
            meta: len | (u32::from(codec) << CODEC_SHIFT) | flags | F_LIVE,
            prev: NIL,
            next: NIL,
        }
    }

    pub fn key(&self) -> Key {
        Key { object: self.object, index: self.index }
    }

    pub fn len(&self) -> usize {
        (self.meta & ((1 << LEN_BITS) - 1)) as usize
    }

    pub fn codec(&self) -> u8 {
        u8::try_from((self.meta >> CODEC_SHIFT) & ((1 << CODEC_BITS) - 1)).expect("5-bit field")
    }

    pub fn has(&self, flag: u32) -> bool {
        self.meta & flag != 0
    }

    /// Allocator location: for entries holding an object of their own
    /// (not same-filled, in a tier or in a group).
    pub fn alloc_loc(&self) -> Option<Loc> {
        (self.meta & (F_SAME | F_TIER | F_GROUP) == 0).then(|| Loc::unpack(self.loc))
    }

    /// Id of the group holding the page (with `F_GROUP`).
    pub fn group_id(&self) -> Option<u32> {
        self.has(F_GROUP).then(|| u32::try_from(self.loc).expect("group ids fit u32"))
    }

    /// Now holds the same page re-encoded: object `loc` of `len` bytes with
    /// `codec`, checksum `check`. Flags are kept.
    pub fn recode(&mut self, loc: u64, check: u32, len: usize, codec: u8) {
        debug_assert!(len < 1 << LEN_BITS && usize::from(codec) < MAX_CODECS);
        let len = u32::try_from(len).expect("stored length fits 13 bits");
        let fields = (1 << FLAG_SHIFT) - 1;
        self.meta = (self.meta & !fields) | len | (u32::from(codec) << CODEC_SHIFT);
        self.loc = loc;
        self.check = check;
    }

    /// Records codec id `codec` (a successor mapping its predecessor's ids).
    pub fn set_codec(&mut self, codec: u8) {
        debug_assert!(usize::from(codec) < MAX_CODECS);
        self.meta = (self.meta & !(((1 << CODEC_BITS) - 1) << CODEC_SHIFT)) | (u32::from(codec) << CODEC_SHIFT);
    }

    /// Index of the tier holding the page (with `F_TIER`).
    pub fn tier(&self) -> usize {
        ((self.meta >> TIER_SHIFT) & 7) as usize
    }

    /// Marks the entry as living in tier `tier` under sealing `version`.
    pub fn set_tier(&mut self, tier: usize, version: u64) {
        debug_assert!(tier < MAX_TIERS);
        let tier = u32::try_from(tier).expect("tier index < 8");
        self.meta = (self.meta & !(7 << TIER_SHIFT) & !F_WB) | F_TIER | (tier << TIER_SHIFT);
        self.loc = version;
    }
}

/// A handle that holds no entry.
const BLANK: Entry = Entry { object: 0, index: 0, loc: 0, check: 0, meta: 0, prev: NIL, next: NIL };

const FIRST_SEG: usize = 16;
/// Shards smaller than this never rebuild their storage to shrink it.
const SHRINK_MIN_ENTRIES: usize = 256;
/// Segments double up to this size, then stay at it, so a shard never holds
/// more than this many unused entries beyond its high-water mark.
const MAX_SEG: usize = 128;
const DOUBLING_SEGS: usize = (MAX_SEG / FIRST_SEG).trailing_zeros() as usize + 1;
const DOUBLING_END: usize = FIRST_SEG * ((1 << DOUBLING_SEGS) - 1);

/// Segmented entry storage: grows without moving entries and without
/// over-allocating more than one segment.
pub(crate) struct Entries {
    segs: Vec<Box<[Entry]>>,
    high_water: usize,
    free_head: u32,
    live: usize,
    /// Handles written since a pre-copy snapshot began (`None`: none runs).
    dirty: Option<Dirty>,
}

fn locate(h: usize) -> (usize, usize) {
    if h < DOUBLING_END {
        let seg = (h / FIRST_SEG + 1).ilog2() as usize;
        (seg, h - FIRST_SEG * ((1 << seg) - 1))
    } else {
        let r = h - DOUBLING_END;
        (DOUBLING_SEGS + r / MAX_SEG, r % MAX_SEG)
    }
}

fn seg_len(seg: usize) -> usize {
    if seg < DOUBLING_SEGS {
        FIRST_SEG << seg
    } else {
        MAX_SEG
    }
}

impl Default for Entries {
    fn default() -> Self {
        Self::new()
    }
}

impl Entries {
    pub fn new() -> Self {
        Self { segs: Vec::new(), high_water: 0, free_head: NIL, live: 0, dirty: None }
    }

    pub fn get(&self, h: u32) -> &Entry {
        let (s, o) = locate(h as usize);
        &self.segs[s][o]
    }

    /// The entry at `h`, to change: marked dirty while a snapshot runs.
    pub fn get_mut(&mut self, h: u32) -> &mut Entry {
        if let Some(d) = &mut self.dirty {
            d.mark(h);
        }
        let (s, o) = locate(h as usize);
        &mut self.segs[s][o]
    }

    /// Starts (`true`) or ends recording which handles change.
    pub fn track(&mut self, on: bool) {
        self.dirty = on.then(Dirty::default);
    }

    /// The handles changed since [`Entries::track`] began, if it runs.
    pub fn dirty(&self) -> Option<&Dirty> {
        self.dirty.as_ref()
    }

    /// Whether handle `h` holds an entry.
    pub fn is_live(&self, h: u32) -> bool {
        (h as usize) < self.high_water && self.get(h).has(F_LIVE)
    }

    /// Puts `e` at handle `h`, which holds no live entry (a pre-copy
    /// successor keeps its predecessor's handles). Handles skipped on the
    /// way are holes off the free list until [`Entries::relink_free`].
    pub fn insert_at(&mut self, h: u32, e: Entry) {
        let (seg, _) = locate(h as usize);
        while self.segs.len() <= seg {
            self.segs.push(vec![BLANK; seg_len(self.segs.len())].into_boxed_slice());
        }
        self.high_water = self.high_water.max(h as usize + 1);
        debug_assert!(!self.get(h).has(F_LIVE));
        self.live += 1;
        *self.get_mut(h) = e;
    }

    /// Rebuilds the free list from every handle below the high-water mark
    /// that holds no entry (after [`Entries::insert_at`]s and removals).
    pub fn relink_free(&mut self) {
        self.free_head = NIL;
        for h in (0..self.high_water).rev() {
            let h = u32::try_from(h).expect("fewer than 2^32 entries per shard");
            let (s, o) = locate(h as usize);
            let e = &mut self.segs[s][o];
            if !e.has(F_LIVE) {
                e.next = self.free_head;
                self.free_head = h;
            }
        }
    }

    pub fn insert(&mut self, e: Entry) -> u32 {
        self.live += 1;
        if self.free_head != NIL {
            let h = self.free_head;
            self.free_head = self.get(h).next;
            *self.get_mut(h) = e;
            return h;
        }
        let h = self.high_water;
        let (s, _) = locate(h);
        if s == self.segs.len() {
            self.segs.push(vec![BLANK; seg_len(s)].into_boxed_slice());
        }
        self.high_water += 1;
        let h = u32::try_from(h).expect("fewer than 2^32 entries per shard");
        *self.get_mut(h) = e;
        h
    }

    pub fn remove(&mut self, h: u32) -> Entry {
        let free_head = self.free_head;
        let e = self.get_mut(h);
        let old = *e;
        debug_assert!(old.has(F_LIVE));
        e.meta = 0;
        e.next = free_head;
        self.free_head = h;
        self.live -= 1;
        old
    }

    pub fn live(&self) -> usize {
        self.live
    }

    /// Handles of every live entry.
    pub fn live_handles(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.high_water).filter_map(move |h| {
            let h = u32::try_from(h).ok()?;
            self.get(h).has(F_LIVE).then_some(h)
        })
    }

    pub fn meta_bytes(&self) -> usize {
        let segs: usize = (0..self.segs.len()).map(seg_len).sum();
        segs * std::mem::size_of::<Entry>() + self.segs.capacity() * std::mem::size_of::<Box<[Entry]>>()
    }

    /// Drops every entry (a running snapshot then counts every handle
    /// it knew as changed).
    pub fn clear(&mut self) {
        let mut dirty = self.dirty.take();
        if let Some(d) = &mut dirty {
            d.mark_below(self.high_water);
        }
        *self = Self::new();
        self.dirty = dirty;
    }
}

/// Mixes a key into a 64-bit hash. Bits 40.. pick the shard; hashbrown uses
/// the low bits for the bucket and the top 7 bits as its tag.
pub(crate) fn hash_key(k: Key) -> u64 {
    let mut h = k.object.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ k.index;
    h = (h ^ (h >> 32)).wrapping_mul(0xD6E8_FEB8_6659_FD93);
    h = (h ^ (h >> 29)).wrapping_mul(0x94D0_49BB_1331_11EB);
    h ^ (h >> 31)
}

/// The index and LRU of one shard.
pub(crate) struct Shard {
    table: HashTable<u32>,
    pub entries: Entries,
    /// Most recently stored.
    lru_head: u32,
    /// Least recently stored.
    lru_tail: u32,
    /// SIEVE's hand: the next entry [`Shard::sieve_victim`] looks at (NIL:
    /// start at the tail). It walks from old to young and wraps.
    hand: u32,
    pub c: ShardCounters,
    /// Metadata bytes last reported to the store.
    pub meta_reported: usize,
    /// Groups of this shard's pages (`crate::group`; a store that groups
    /// places a whole window of indexes in one shard).
    pub groups: Groups,
    /// Decoded group blocks, for reads of their neighbours.
    pub cache: BlockCache,
}

impl Shard {
    pub fn new() -> Self {
        Self {
            table: HashTable::new(),
            entries: Entries::new(),
            lru_head: NIL,
            lru_tail: NIL,
            hand: NIL,
            c: ShardCounters::default(),
            meta_reported: 0,
            groups: Groups::default(),
            cache: BlockCache::default(),
        }
    }

    /// Makes room in the table for `more` entries, so that inserting them
    /// rehashes nothing.
    pub fn reserve(&mut self, more: usize) {
        let entries = &self.entries;
        self.table.reserve(more, |&x| hash_key(entries.get(x).key()));
    }

    pub fn find(&self, key: Key, hash: u64) -> Option<u32> {
        let entries = &self.entries;
        self.table.find(hash, |&h| entries.get(h).key() == key).copied()
    }

    /// Inserts a new entry or replaces the existing one for the same key;
    /// returns the replaced entry.
    pub fn insert(&mut self, e: Entry, hash: u64) -> Option<Entry> {
        let key = e.key();
        let old = self.remove_key(key, hash);
        let h = self.entries.insert(e);
        let entries = &self.entries;
        self.table.insert_unique(hash, h, |&x| hash_key(entries.get(x).key()));
        // A page in a tier holds no pool memory: nothing to evict or write
        // back, so it stays off the list those walk (writeback skips what
        // it finds there, and a list full of them starves it).
        if !e.has(F_TIER) {
            self.lru_push_front(h);
        }
        old
    }

    /// Starts (`true`) or ends recording which entries and groups change,
    /// for a pre-copy hand-over (`store/precopy.rs`).
    pub fn track(&mut self, on: bool) {
        self.entries.track(on);
        self.groups.track(on);
    }

    /// Whether changes are being recorded.
    pub fn tracking(&self) -> bool {
        self.entries.dirty().is_some()
    }

    /// Inserts `e`, whose key is not in the shard, at handle `h`, which
    /// holds none (a pre-copy successor); false, and nothing changed, if
    /// the key is there or `h` holds an entry.
    pub fn insert_at(&mut self, h: u32, e: Entry, hash: u64) -> bool {
        !self.entries.is_live(h) && self.insert_vacant(e, hash, Some(h))
    }

    /// Inserts an entry whose key is not in the shard, with one probe of
    /// the table (a hand-over's import); false, and nothing changed, if
    /// the key is there.
    pub fn insert_new(&mut self, e: Entry, hash: u64) -> bool {
        self.insert_vacant(e, hash, None)
    }

    /// Inserts `e` at handle `at` (free), or at one from storage, if its
    /// key is not in the table; false, and nothing changed, if it is.
    fn insert_vacant(&mut self, e: Entry, hash: u64, at: Option<u32>) -> bool {
        let key = e.key();
        let entries = &self.entries;
        let hasher = |&x: &u32| hash_key(entries.get(x).key());
        let hashbrown::hash_table::Entry::Vacant(slot) =
            self.table.entry(hash, |&h| entries.get(h).key() == key, hasher)
        else {
            return false;
        };
        let h = match at {
            Some(h) => {
                self.entries.insert_at(h, e);
                h
            }
            None => self.entries.insert(e),
        };
        slot.insert(h);
        if !e.has(F_TIER) {
            self.lru_push_front(h);
        }
        true
    }

    pub fn remove_key(&mut self, key: Key, hash: u64) -> Option<Entry> {
        let entries = &self.entries;
        let found = self.table.find_entry(hash, |&h| entries.get(h).key() == key).ok()?;
        let (h, _) = found.remove();
        Some(self.unlink_and_free(h))
    }

    /// Removes entry `h`, which must be in the table.
    pub fn remove_handle(&mut self, h: u32) -> Entry {
        let hash = hash_key(self.entries.get(h).key());
        match self.table.find_entry(hash, |&x| x == h) {
            Ok(found) => drop(found.remove()),
            Err(_) => unreachable!("a live entry is in the table"),
        }
        self.unlink_and_free(h)
    }

    fn unlink_and_free(&mut self, h: u32) -> Entry {
        self.lru_unlink(h);
        self.entries.remove(h)
    }

    /// Gives index memory back once the shard is empty, or once at most a
    /// quarter of the entries it once held are live (a swap device's pages discarded after a
    /// job exits, a flushed pool): entries are moved into fresh storage and
    /// the table rebuilt, the LRU order kept. Handles change, so no caller
    /// may hold one across this; `Pool::account` calls it last, under the
    /// shard lock. Each rebuild costs O(live) after at least three times as
    /// many removals.
    pub fn shrink_if_sparse(&mut self) {
        if self.tracking() {
            // A running snapshot names entries by handle.
            return;
        }
        let (live, high_water) = (self.entries.live(), self.entries.high_water);
        let sparse = high_water >= SHRINK_MIN_ENTRIES && live * 4 <= high_water;
        let emptied = live == 0 && high_water > 0;
        if !(sparse || emptied) {
            return;
        }
        let old = std::mem::take(&mut self.entries);
        self.table = HashTable::with_capacity(live);
        let mut h = self.lru_tail;
        self.lru_head = NIL;
        self.lru_tail = NIL;
        // Handles change: SIEVE's hand starts over at the tail.
        self.hand = NIL;
        // Oldest first, so pushing each to the front rebuilds the same list.
        while h != NIL {
            let e = *old.get(h);
            let moved = self.add_unlinked(e);
            self.lru_push_front(moved);
            h = e.prev;
        }
        // Entries off the LRU (picked for writeback) stay off it.
        for h in old.live_handles() {
            let e = old.get(h);
            if !e.has(F_INLRU) {
                self.add_unlinked(*e);
            }
        }
        debug_assert_eq!(self.entries.live(), live);
    }

    /// Inserts a copy of `e`, off the LRU, into storage and table.
    fn add_unlinked(&mut self, mut e: Entry) -> u32 {
        e.meta &= !F_INLRU;
        (e.prev, e.next) = (NIL, NIL);
        let hash = hash_key(e.key());
        let h = self.entries.insert(e);
        let entries = &self.entries;
        self.table.insert_unique(hash, h, |&x| hash_key(entries.get(x).key()));
        h
    }

    /// Puts entry `h` at the young end of the LRU (no-op when already on it).
    pub fn lru_push_front(&mut self, h: u32) {
        if self.entries.get(h).has(F_INLRU) {
            return;
        }
        let head = self.lru_head;
        {
            let e = self.entries.get_mut(h);
            e.prev = NIL;
            e.next = head;
            e.meta |= F_INLRU;
        }
        if head == NIL {
            self.lru_tail = h;
        } else {
            self.entries.get_mut(head).prev = h;
        }
        self.lru_head = h;
    }

    /// Takes entry `h` off the LRU (no-op when not on it).
    pub fn lru_unlink(&mut self, h: u32) {
        let Entry { prev, next, meta, .. } = *self.entries.get(h);
        if meta & F_INLRU == 0 {
            return;
        }
        self.entries.get_mut(h).meta &= !F_INLRU;
        if self.hand == h {
            self.hand = prev;
        }
        if prev == NIL {
            self.lru_head = next;
        } else {
            self.entries.get_mut(prev).next = next;
        }
        if next == NIL {
            self.lru_tail = prev;
        } else {
            self.entries.get_mut(next).prev = prev;
        }
    }

    /// Picks the oldest entry, giving referenced entries a second chance
    /// (they move to the front once, with the flag cleared).
    pub fn lru_victim(&mut self) -> Option<u32> {
        let mut passes = self.entries.live();
        while self.lru_tail != NIL {
            let h = self.lru_tail;
            if passes > 0 && self.entries.get(h).has(F_REFERENCED) {
                passes -= 1;
                self.entries.get_mut(h).meta &= !F_REFERENCED;
                self.lru_unlink(h);
                self.lru_push_front(h);
                continue;
            }
            return Some(h);
        }
        None
    }

    /// SIEVE (Zhang et al., NSDI '24): the hand walks from the oldest entry
    /// towards the youngest, clearing `F_REFERENCED` on entries a get has
    /// touched and leaving them in place, and stops at the first untouched
    /// one, which is the victim; it resumes there next time and wraps to the
    /// tail. Unlike CLOCK-with-reinsertion ([`Shard::lru_victim`]) a hit
    /// never moves an entry, so survivors keep their age and new entries
    /// that are never read leave first. The caller removes the victim.
    pub fn sieve_victim(&mut self) -> Option<u32> {
        let mut h = if self.hand == NIL { self.lru_tail } else { self.hand };
        // Two sweeps at most: the first clears every flag it passes.
        for _ in 0..=2 * self.entries.live() {
            if h == NIL {
                h = self.lru_tail;
                if h == NIL {
                    return None;
                }
            }
            let e = self.entries.get_mut(h);
            if e.meta & F_REFERENCED == 0 {
                self.hand = e.prev;
                return Some(h);
            }
            e.meta &= !F_REFERENCED;
            h = e.prev;
        }
        unreachable!("two sweeps clear every reference flag")
    }

    /// The oldest entry on the list, as strict LRU evicts (hits move
    /// entries to the front with [`Shard::lru_touch`]).
    pub fn lru_tail(&self) -> Option<u32> {
        (self.lru_tail != NIL).then_some(self.lru_tail)
    }

    /// Moves entry `h` to the young end, if it is on the list (strict LRU's hit).
    pub fn lru_touch(&mut self, h: u32) {
        if self.entries.get(h).has(F_INLRU) {
            self.lru_unlink(h);
            self.lru_push_front(h);
        }
    }

    /// Entries in LRU order, oldest first (for tests and inspection).
    #[cfg(test)]
    pub fn lru_order(&self) -> Vec<Key> {
        let mut v = Vec::new();
        let mut h = self.lru_tail;
        while h != NIL {
            let e = self.entries.get(h);
            v.push(e.key());
            h = e.prev;
        }
        v
    }

    /// Removes every entry and returns them.
    pub fn drain(&mut self) -> Vec<Entry> {
        let out: Vec<Entry> = self.entries.live_handles().map(|h| *self.entries.get(h)).collect();
        self.table = HashTable::new();
        self.entries.clear();
        self.lru_head = NIL;
        self.lru_tail = NIL;
        self.hand = NIL;
        out
    }

    /// Bytes of index metadata: entries, hash table, groups and the
    /// decoded blocks cached.
    pub fn meta_bytes(&self) -> usize {
        let cap = self.table.capacity();
        let buckets = if cap == 0 { 0 } else { (cap * 8 / 7).next_power_of_two() };
        self.entries.meta_bytes()
            + buckets * (std::mem::size_of::<u32>() + 1)
            + self.groups.meta_bytes()
            + self.cache.meta_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locate_is_contiguous() {
        let mut expect = (0usize, 0usize);
        for h in 0..DOUBLING_END + 3 * MAX_SEG {
            assert_eq!(locate(h), expect, "handle {h}");
            expect.1 += 1;
            if expect.1 == seg_len(expect.0) {
                expect = (expect.0 + 1, 0);
            }
        }
    }

    fn key(i: u64) -> Key {
        Key { object: 7, index: i }
    }

    #[test]
    fn a_sparse_shard_shrinks_and_keeps_its_lru_order() {
        let mut s = Shard::new();
        for i in 0..1200 {
            assert!(s.insert(Entry::new(key(i), i, 0, 10, 1, 0), hash_key(key(i))).is_none());
        }
        // One entry off the LRU, as writeback leaves its victims.
        let off = s.find(key(7), hash_key(key(7))).unwrap();
        s.lru_unlink(off);
        let full = s.meta_bytes();
        for i in (0..1200).filter(|i| i % 10 != 0 && *i != 7) {
            s.remove_key(key(i), hash_key(key(i))).unwrap();
        }
        let order = s.lru_order();
        s.shrink_if_sparse();
        assert!(s.meta_bytes() * 4 < full, "{full} -> {}", s.meta_bytes());
        assert_eq!(s.lru_order(), order);
        assert_eq!(s.entries.live(), 121);
        for i in (0..1200).filter(|i| i % 10 == 0 || *i == 7) {
            let h = s.find(key(i), hash_key(key(i))).unwrap();
            assert_eq!(s.entries.get(h).loc, i);
            assert_eq!(s.entries.get(h).has(F_INLRU), i != 7);
        }
        assert!(s.find(key(11), hash_key(key(11))).is_none());
        // Below a quarter of the new high-water mark nothing moves again.
        let before = s.meta_bytes();
        s.shrink_if_sparse();
        assert_eq!(s.meta_bytes(), before);
    }

    #[test]
    fn insert_new_refuses_a_key_that_is_there_and_changes_nothing() {
        let mut s = Shard::new();
        assert!(s.insert_new(Entry::new(key(1), 10, 0, 10, 1, 0), hash_key(key(1))));
        assert!(s.insert_new(Entry::new(key(2), 20, 0, 10, 1, 0), hash_key(key(2))));
        let order = s.lru_order();
        assert!(!s.insert_new(Entry::new(key(1), 99, 0, 10, 1, 0), hash_key(key(1))));
        assert_eq!(s.entries.live(), 2);
        assert_eq!(s.lru_order(), order);
        let h = s.find(key(1), hash_key(key(1))).unwrap();
        assert_eq!(s.entries.get(h).loc, 10, "the entry that was there stays");
        // A page in a tier stays off the LRU, as with insert.
        let mut tiered = Entry::new(key(3), 0, 0, 10, 1, 0);
        tiered.set_tier(0, 7);
        assert!(s.insert_new(tiered, hash_key(key(3))));
        assert_eq!(s.lru_order(), order);
    }

    #[test]
    fn insert_replace_remove_and_lru() {
        let mut s = Shard::new();
        for i in 0..100 {
            assert!(s.insert(Entry::new(key(i), i, 0, 10, 1, 0), hash_key(key(i))).is_none());
        }
        let old = s.insert(Entry::new(key(5), 500, 0, 10, 1, 0), hash_key(key(5))).unwrap();
        assert_eq!(old.loc, 5);
        assert_eq!(s.entries.live(), 100);
        let order = s.lru_order();
        assert_eq!(order.first(), Some(&key(0)));
        assert_eq!(order.last(), Some(&key(5)), "replaced entry is newest");
        // Second chance: a referenced oldest entry is skipped once.
        let h0 = s.find(key(0), hash_key(key(0))).unwrap();
        s.entries.get_mut(h0).meta |= F_REFERENCED;
        let v = s.lru_victim().unwrap();
        assert_eq!(s.entries.get(v).key(), key(1));
        assert_eq!(s.remove_handle(v).key(), key(1));
        assert!(s.find(key(1), hash_key(key(1))).is_none());
        assert_eq!(s.remove_key(key(2), hash_key(key(2))).unwrap().loc, 2);
        assert_eq!(s.drain().len(), 98);
        assert_eq!(s.entries.live(), 0);
    }

    #[test]
    fn sieve_keeps_touched_entries_in_place_and_resumes_at_its_hand() {
        let mut s = Shard::new();
        for i in 0..10 {
            s.insert(Entry::new(key(i), i, 0, 10, 1, 0), hash_key(key(i)));
        }
        for i in [0, 2, 9] {
            let h = s.find(key(i), hash_key(key(i))).unwrap();
            s.entries.get_mut(h).meta |= F_REFERENCED;
        }
        let evict = |s: &mut Shard| {
            let h = s.sieve_victim().unwrap();
            s.remove_handle(h).key().index
        };
        // 0 and 2 lose their flag and stay; the hand resumes after each victim.
        assert_eq!(evict(&mut s), 1);
        assert_eq!(evict(&mut s), 3);
        // Removing the entry under the hand moves the hand on, not off the list.
        s.remove_key(key(4), hash_key(key(4))).unwrap();
        assert_eq!(evict(&mut s), 5);
        assert_eq!((evict(&mut s), evict(&mut s), evict(&mut s)), (6, 7, 8));
        // 9 was touched: the hand wraps to the tail, where 0 is no longer.
        assert_eq!(evict(&mut s), 0);
        // A new entry is young; an old untouched one leaves before it.
        s.insert(Entry::new(key(20), 20, 0, 10, 1, 0), hash_key(key(20)));
        assert_eq!(evict(&mut s), 2);
        assert_eq!(evict(&mut s), 9);
        assert_eq!(evict(&mut s), 20);
        assert_eq!(s.sieve_victim(), None);
        // Strict LRU: a touch moves an entry to the front.
        for i in 0..3 {
            s.insert(Entry::new(key(i), i, 0, 10, 1, 0), hash_key(key(i)));
        }
        let h0 = s.find(key(0), hash_key(key(0))).unwrap();
        s.lru_touch(h0);
        assert_eq!(s.lru_order(), vec![key(1), key(2), key(0)]);
        assert_eq!(s.entries.get(s.lru_tail().unwrap()).key(), key(1));
    }
}
