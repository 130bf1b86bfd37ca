//! Groups: cold pages of one object's aligned window of [`MAX_GROUP_PAGES`]
//! indexes, compressed together as one block (issue 30, item 3).
//!
//! A 4 KiB page is short context for a compressor: the same headers and
//! pointers recur on its neighbours, which it cannot see. Compressed
//! together, 16 adjacent pages of a heap take 1.18-1.26x fewer bytes than
//! each alone in zstd at level 9, and 1.02-1.11x fewer with a dictionary
//! trained on the heap (64 MiB captures of python, java and redis heaps,
//! `examples/group_density.rs`; 1.04-1.09x of all memory held with the
//! dictionary on python and java, none on redis). The price is the read: a
//! page is decoded with its block, so the store keeps a few decoded blocks
//! per shard, and neighbours read after it cost a copy; and the grouping
//! pass's CPU, some 25-35 MiB of pages a second.
//!
//! This module is the block format and the pieces the store keeps per
//! shard; `store/grouping.rs` is the store side (which pages, when, the
//! races). Format of a block: the pages of the slots it holds (a 16-bit set
//! of window slots, kept beside the block, never in it), in slot order,
//! concatenated and compressed by one codec that supports blocks
//! ([`Codec::supports_blocks`]: zstd). [`decode_block`] checks everything it
//! is given (length, slot set, the decoded length), so any bytes give pages
//! or one [`GroupError`], never a panic (fuzz target `group_block`).
//!
//! Storage: the allocator's largest object is one page, so a block is stored
//! as chunks of [`CHUNK_BYTES`] (the raw class: one slot per span, no waste)
//! and one shorter tail chunk in an ordinary size class. Each chunk is an
//! allocator object like a page's, so compaction moves the tail chunks as it
//! moves pages (full chunks sit alone in their spans and never need to move);
//! a multi-page span per block would waste half a page per block on average
//! (some 12% of a 16 KiB block) and could not be compacted.

use crate::alloc::{AllocError, Loc, ZsAlloc};
use crate::codec::{Codec, CodecError};
use crate::dirty::Dirty;
use crate::{Key, PAGE_SIZE};

/// Pages of a window: a group holds up to this many pages of one aligned
/// window of indexes of one object.
pub const MAX_GROUP_PAGES: usize = 16;
/// `MAX_GROUP_PAGES == 1 << WINDOW_SHIFT`.
pub const WINDOW_SHIFT: u32 = 4;
/// Slots of a window.
const SLOTS: u32 = 1 << WINDOW_SHIFT;
const _: () = assert!(MAX_GROUP_PAGES == 1 << WINDOW_SHIFT && MAX_GROUP_PAGES <= 16, "slot sets are u16");
/// Bytes of a decoded block of a full window.
pub const BLOCK_BYTES: usize = MAX_GROUP_PAGES * PAGE_SIZE;
/// Longest stored (compressed) block accepted: above zstd's bound for
/// [`BLOCK_BYTES`] of input.
pub const MAX_STORED_BLOCK: usize = BLOCK_BYTES + BLOCK_BYTES / 128 + 1024;
/// A block is stored in chunks of at most this many bytes.
pub const CHUNK_BYTES: usize = PAGE_SIZE;

/// Group block failures.
#[derive(Debug, thiserror::Error)]
pub enum GroupError {
    /// A group holds at least one page.
    #[error("a group with no pages")]
    NoSlots,
    /// The pages given do not match the slots.
    #[error("{got} bytes of pages for {slots} slot(s)")]
    PageCount {
        /// Bytes given.
        got: usize,
        /// Slots in the group.
        slots: u32,
    },
    /// A stored block of an impossible length.
    #[error("a stored block of {0} bytes (1..={MAX_STORED_BLOCK})")]
    BlockSize(usize),
    /// The block did not decode to one page per slot.
    #[error("block decoded to {got} bytes, expected {expected}")]
    Length {
        /// Bytes decoded.
        got: usize,
        /// One page per slot.
        expected: usize,
    },
    /// The slot asked for is not in the group.
    #[error("slot {0} is not in the group")]
    NoSuchSlot(u32),
    /// The codec failed (corrupt data, or it has no block mode).
    #[error(transparent)]
    Codec(#[from] CodecError),
    /// No memory for the block's chunks.
    #[error(transparent)]
    Alloc(#[from] AllocError),
}

/// Slot of `index` in its window.
#[allow(clippy::cast_possible_truncation)] // masked to 4 bits
pub fn slot_of(index: u64) -> u32 {
    (index & (MAX_GROUP_PAGES as u64 - 1)) as u32
}

/// First index of the window of `index`.
pub fn window_base(index: u64) -> u64 {
    index & !(MAX_GROUP_PAGES as u64 - 1)
}

/// Where the page of `slot` is in a block holding `slots`, in pages.
pub fn position(slots: u16, slot: u32) -> Option<usize> {
    if slot >= SLOTS || slots & (1 << slot) == 0 {
        return None;
    }
    Some((slots & ((1 << slot) - 1)).count_ones() as usize)
}

/// Compresses the pages of a group (`pages`: one page per slot, in slot
/// order) into `dst`; returns the block's length.
pub fn encode_block(codec: &dyn Codec, slots: u16, pages: &[u8], dst: &mut [u8]) -> Result<usize, GroupError> {
    if slots == 0 {
        return Err(GroupError::NoSlots);
    }
    if pages.len() != slots.count_ones() as usize * PAGE_SIZE {
        return Err(GroupError::PageCount { got: pages.len(), slots: slots.count_ones() });
    }
    let n = codec.compress_block(pages, dst)?;
    if n == 0 || n > MAX_STORED_BLOCK {
        return Err(GroupError::BlockSize(n));
    }
    Ok(n)
}

/// Decodes a stored block holding `slots` into `dst` (at least
/// [`BLOCK_BYTES`] long); returns the bytes decoded, one page per slot in
/// slot order. Any input gives pages or an error.
pub fn decode_block(codec: &dyn Codec, src: &[u8], slots: u16, dst: &mut [u8]) -> Result<usize, GroupError> {
    if slots == 0 {
        return Err(GroupError::NoSlots);
    }
    if src.is_empty() || src.len() > MAX_STORED_BLOCK {
        return Err(GroupError::BlockSize(src.len()));
    }
    let expected = slots.count_ones() as usize * PAGE_SIZE;
    let room = dst.len().min(BLOCK_BYTES);
    let got = codec.decompress_block(src, &mut dst[..room])?;
    if got != expected {
        return Err(GroupError::Length { got, expected });
    }
    Ok(got)
}

/// The page of `slot` in a decoded block holding `slots`.
pub fn page_in(block: &[u8], slots: u16, slot: u32) -> Result<&[u8; PAGE_SIZE], GroupError> {
    let at = position(slots, slot).ok_or(GroupError::NoSuchSlot(slot))? * PAGE_SIZE;
    block
        .get(at..at + PAGE_SIZE)
        .and_then(|p| p.try_into().ok())
        .ok_or(GroupError::Length { got: block.len(), expected: at + PAGE_SIZE })
}

/// Length of chunk `i` of a block of `len` bytes.
pub(crate) fn chunk_len(len: usize, i: usize) -> usize {
    (len - i * CHUNK_BYTES).min(CHUNK_BYTES)
}

/// Stores `block` in the allocator as chunks; returns their packed
/// locations, in order. Nothing stays allocated on failure.
pub(crate) fn store_chunks(alloc: &ZsAlloc, block: &[u8]) -> Result<Box<[u64]>, AllocError> {
    let mut chunks = Vec::with_capacity(block.len().div_ceil(CHUNK_BYTES));
    for piece in block.chunks(CHUNK_BYTES) {
        match alloc.alloc_write(piece) {
            Ok(loc) => chunks.push(loc.pack()),
            Err(e) => {
                free_chunks(alloc, &chunks);
                return Err(e);
            }
        }
    }
    Ok(chunks.into_boxed_slice())
}

/// Memory a block of `len` bytes costs stored: its chunks' slots and its
/// group's record (what grouping weighs against the pages' own slots).
pub(crate) fn block_cost(alloc: &ZsAlloc, len: usize) -> usize {
    let chunks = len.div_ceil(CHUNK_BYTES);
    let tail = len - (chunks - 1) * CHUNK_BYTES;
    let tail_slot = alloc.class_of(tail).map_or(CHUNK_BYTES, |c| alloc.geometry(c).size);
    (chunks - 1) * CHUNK_BYTES + tail_slot + std::mem::size_of::<Option<Group>>() + chunks * std::mem::size_of::<u64>()
}

/// Frees the chunks of a block.
pub(crate) fn free_chunks(alloc: &ZsAlloc, chunks: &[u64]) {
    for &c in chunks {
        alloc.free(Loc::unpack(c));
    }
}

/// Bytes of the allocator's slots holding `chunks`.
pub(crate) fn chunk_slot_bytes(alloc: &ZsAlloc, chunks: &[u64]) -> u64 {
    chunks.iter().map(|&c| alloc.slot_size(Loc::unpack(c)) as u64).sum()
}

/// Appends the `len` bytes of a block stored in `chunks` to `out`.
///
/// # Safety
/// The chunks are live allocations of `alloc` holding a block of `len`
/// bytes, and the caller keeps them from being freed or migrated while it
/// runs (the store holds the group's shard lock).
pub(crate) unsafe fn gather(alloc: &ZsAlloc, chunks: &[u64], len: usize, out: &mut Vec<u8>) {
    for (i, &c) in chunks.iter().enumerate() {
        // SAFETY: the caller's contract; chunk `i` is `chunk_len(len, i)` long.
        out.extend_from_slice(unsafe { alloc.object(Loc::unpack(c), chunk_len(len, i)) });
    }
}

/// One group: a block, the window slots it holds, and which of those still
/// belong to a page (the others are tombstones: overwritten or flushed).
#[derive(Debug)]
pub(crate) struct Group {
    pub object: u64,
    /// First index of the window.
    pub base: u64,
    /// Unique in its shard (ids are reused, serials never): what the block
    /// cache knows a block by.
    pub serial: u64,
    /// Packed allocator locations of the block's chunks.
    pub chunks: Box<[u64]>,
    /// Stored block length.
    pub len: u32,
    /// CRC32 of the stored block.
    pub check: u32,
    /// Codec id of the block.
    pub codec: u8,
    /// Window slots the block holds.
    pub slots: u16,
    /// Slots whose page is still this group's.
    pub live: u16,
}

impl Group {
    /// Key of the page in `slot`.
    pub fn key(&self, slot: u32) -> Key {
        Key::new(self.object, self.base + u64::from(slot))
    }

    /// Slots in the block whose page is gone.
    pub fn dead(&self) -> u64 {
        u64::from((self.slots & !self.live).count_ones())
    }

    /// Iterates the set bits of `set`.
    pub fn slots_in(set: u16) -> impl Iterator<Item = u32> {
        (0..SLOTS).filter(move |s| set & (1 << s) != 0)
    }
}

/// A shard's groups: a slab of [`Group`]s whose index is the id grouped
/// entries hold. Memory is given back once it holds none.
#[derive(Debug, Default)]
pub(crate) struct Groups {
    table: Vec<Option<Group>>,
    free: Vec<u32>,
    live: usize,
    /// Chunk locations held, for [`Groups::meta_bytes`] in O(1).
    chunk_words: usize,
    serial: u64,
    /// Ids written since a pre-copy snapshot began (`None`: none runs).
    dirty: Option<Dirty>,
}

impl Groups {
    /// Adds `g` (its serial is set here); returns its id.
    pub fn insert(&mut self, g: Group) -> u32 {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                self.table.push(None);
                u32::try_from(self.table.len() - 1).expect("fewer than 2^32 groups per shard")
            }
        };
        self.insert_at(id, g);
        id
    }

    /// Puts `g` at id `id`, which holds no group and is not on the free
    /// list (a pre-copy successor keeps its predecessor's ids; ids skipped
    /// on the way wait for [`Groups::relink_free`]).
    pub fn insert_at(&mut self, id: u32, mut g: Group) {
        self.serial += 1;
        g.serial = self.serial;
        self.live += 1;
        self.chunk_words += g.chunks.len();
        if self.table.len() <= id as usize {
            self.table.resize_with(id as usize + 1, || None);
        }
        if let Some(d) = &mut self.dirty {
            d.mark(id);
        }
        debug_assert!(self.table[id as usize].is_none());
        self.table[id as usize] = Some(g);
    }

    /// Rebuilds the free list from the ids that hold no group.
    pub fn relink_free(&mut self) {
        self.free = (0..self.table.len())
            .rev()
            .filter(|&i| self.table[i].is_none())
            .map(|i| u32::try_from(i).expect("fewer than 2^32 groups per shard"))
            .collect();
    }

    /// Starts (`true`) or ends recording which ids change.
    pub fn track(&mut self, on: bool) {
        self.dirty = on.then(Dirty::default);
    }

    /// The ids changed since [`Groups::track`] began, if it runs.
    pub fn dirty(&self) -> Option<&Dirty> {
        self.dirty.as_ref()
    }

    pub fn get(&self, id: u32) -> Option<&Group> {
        self.table.get(id as usize).and_then(Option::as_ref)
    }

    /// Group `id`, to change: marked dirty while a snapshot runs.
    pub fn get_mut(&mut self, id: u32) -> Option<&mut Group> {
        if let Some(d) = &mut self.dirty {
            d.mark(id);
        }
        self.table.get_mut(id as usize).and_then(Option::as_mut)
    }

    /// Removes group `id`, which must exist.
    pub fn remove(&mut self, id: u32) -> Group {
        if let Some(d) = &mut self.dirty {
            d.mark(id);
        }
        let g = self.table[id as usize].take().expect("removing a live group");
        self.live -= 1;
        self.chunk_words -= g.chunks.len();
        if self.live == 0 {
            // Give the tables back; serials go on, so stale cache blocks never match.
            self.table = Vec::new();
            self.free = Vec::new();
        } else {
            self.free.push(id);
        }
        g
    }

    /// Ids of every group.
    pub fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.table.iter().enumerate().filter(|(_, g)| g.is_some()).filter_map(|(i, _)| u32::try_from(i).ok())
    }

    pub fn len(&self) -> usize {
        self.live
    }

    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Replaces chunk location `i` of group `id` (compaction moved it).
    pub fn move_chunk(&mut self, id: u32, i: usize, to: Loc) {
        if let Some(g) = self.get_mut(id) {
            g.chunks[i] = to.pack();
        }
    }

    pub fn meta_bytes(&self) -> usize {
        self.table.capacity() * std::mem::size_of::<Option<Group>>()
            + self.free.capacity() * std::mem::size_of::<u32>()
            + self.chunk_words * std::mem::size_of::<u64>()
    }
}

/// Decoded blocks a shard keeps, so that reading a group's other pages
/// costs a copy. Buffers are allocated when first needed (at most `cap`
/// per shard), reused round robin, and dropped by the group pass when a
/// period went by without a lookup, or when the shard holds no group.
#[derive(Debug, Default)]
pub(crate) struct BlockCache {
    blocks: Vec<CachedBlock>,
    /// Next buffer to reuse once `cap` are allocated.
    hand: usize,
    /// Looked up since [`BlockCache::take_used`].
    used: bool,
}

#[derive(Debug)]
struct CachedBlock {
    /// Serial of the group decoded in `data`; 0: none.
    serial: u64,
    /// Slots of that group (pages in `data`, in slot order).
    slots: u16,
    data: Box<[u8]>,
}

impl BlockCache {
    /// The decoded block of group `serial`, and its slots, if cached.
    pub fn lookup(&mut self, serial: u64) -> Option<(&[u8], u16)> {
        self.used = true;
        self.blocks.iter().find(|b| b.serial == serial && serial != 0).map(|b| (&*b.data, b.slots))
    }

    /// A buffer of [`BLOCK_BYTES`] to decode a block into, emptied; grows
    /// the cache up to `cap` buffers (then reuses the oldest). Returns its
    /// index and whether memory was allocated.
    pub fn slot(&mut self, cap: usize) -> (usize, bool) {
        if let Some(i) = self.blocks.iter().position(|b| b.serial == 0) {
            return (i, false);
        }
        if self.blocks.len() < cap.max(1) {
            self.blocks.push(CachedBlock { serial: 0, slots: 0, data: vec![0u8; BLOCK_BYTES].into_boxed_slice() });
            return (self.blocks.len() - 1, true);
        }
        let i = self.hand % self.blocks.len();
        self.hand = i + 1;
        self.blocks[i].serial = 0;
        (i, false)
    }

    /// Buffer `i`, to decode into.
    pub fn buffer(&mut self, i: usize) -> &mut [u8] {
        &mut self.blocks[i].data
    }

    /// Records that buffer `i` holds the block of group `serial`.
    pub fn commit(&mut self, i: usize, serial: u64, slots: u16) {
        self.blocks[i].serial = serial;
        self.blocks[i].slots = slots;
    }

    /// Forgets the block of group `serial`, if cached (its group is gone).
    pub fn forget(&mut self, serial: u64) {
        for b in &mut self.blocks {
            if b.serial == serial {
                b.serial = 0;
            }
        }
    }

    /// Whether a lookup happened since the last call.
    pub fn take_used(&mut self) -> bool {
        std::mem::take(&mut self.used)
    }

    /// Drops every buffer.
    pub fn clear(&mut self) {
        *self = Self::default();
    }

    pub fn meta_bytes(&self) -> usize {
        self.blocks.capacity() * std::mem::size_of::<CachedBlock>() + self.blocks.len() * BLOCK_BYTES
    }
}

#[cfg(test)]
#[allow(clippy::cast_possible_truncation)] // test data: small values into bytes
mod tests {
    use super::*;

    fn group(object: u64, base: u64, chunks: usize) -> Group {
        Group {
            object,
            base,
            serial: 0,
            chunks: vec![0; chunks].into_boxed_slice(),
            len: 0,
            check: 0,
            codec: 0,
            slots: 0b1011,
            live: 0b0011,
        }
    }

    #[test]
    fn slots_and_positions() {
        assert_eq!((slot_of(35), window_base(35)), (3, 32));
        assert_eq!(position(0b1011, 0), Some(0));
        assert_eq!(position(0b1011, 1), Some(1));
        assert_eq!(position(0b1011, 2), None);
        assert_eq!(position(0b1011, 3), Some(2));
        assert_eq!(position(0xffff, 15), Some(15));
        assert_eq!(position(0xffff, 16), None);
        let g = group(7, 32, 0);
        assert_eq!(g.key(3), Key::new(7, 35));
        assert_eq!(g.dead(), 1);
        assert_eq!(Group::slots_in(0b1011).collect::<Vec<_>>(), vec![0, 1, 3]);
        let block: Vec<u8> = (0..3 * PAGE_SIZE).map(|i| (i / PAGE_SIZE) as u8).collect();
        assert_eq!(page_in(&block, 0b1011, 3).unwrap()[0], 2);
        assert!(matches!(page_in(&block, 0b1011, 2), Err(GroupError::NoSuchSlot(2))));
        assert!(page_in(&block[..PAGE_SIZE], 0b1011, 3).is_err());
    }

    #[test]
    fn group_table_reuses_ids_keeps_serials_and_gives_memory_back() {
        let mut t = Groups::default();
        let a = t.insert(group(1, 0, 3));
        let b = t.insert(group(1, 16, 2));
        assert_ne!(a, b);
        assert_eq!(t.len(), 2);
        let sa = t.get(a).unwrap().serial;
        assert!(t.meta_bytes() >= 5 * 8);
        t.remove(a);
        assert!(t.get(a).is_none());
        let c = t.insert(group(2, 0, 1));
        assert_eq!(c, a, "ids are reused");
        assert_ne!(t.get(c).unwrap().serial, sa, "serials are not");
        assert_eq!(t.ids().count(), 2);
        t.move_chunk(c, 0, Loc::unpack(77));
        assert_eq!(t.get(c).unwrap().chunks[0], 77);
        t.remove(b);
        t.remove(c);
        assert!(t.is_empty());
        assert_eq!(t.meta_bytes(), 0);
        let d = t.insert(group(3, 0, 0));
        assert!(t.get(d).unwrap().serial > sa + 2);
    }

    #[test]
    fn block_cache_grows_to_its_cap_and_reuses_round_robin() {
        let mut c = BlockCache::default();
        assert!(c.lookup(1).is_none());
        assert!(c.take_used());
        assert!(!c.take_used());
        let (i, grew) = c.slot(2);
        assert!(grew);
        c.buffer(i)[0] = 11;
        c.commit(i, 1, 0b1);
        let (j, grew) = c.slot(2);
        assert!(grew && j != i);
        c.commit(j, 2, 0b11);
        assert_eq!(c.meta_bytes(), c.blocks.capacity() * std::mem::size_of::<CachedBlock>() + 2 * BLOCK_BYTES);
        assert_eq!(c.lookup(1).map(|(d, s)| (d[0], s)), Some((11, 0b1)));
        // Full: the oldest buffer is reused and no longer answers for its block.
        let (k, grew) = c.slot(2);
        assert!(!grew);
        assert!(c.lookup(1).is_none() || c.lookup(2).is_none());
        c.commit(k, 3, 0b1);
        c.forget(3);
        assert!(c.lookup(3).is_none());
        assert_eq!(c.slot(2), (k, false), "a forgotten buffer is reused first");
        assert!(c.lookup(0).is_none(), "serial 0 is no block");
        c.clear();
        assert_eq!(c.meta_bytes(), 0);
    }

    #[test]
    fn chunks_round_trip_through_the_allocator() {
        let alloc = ZsAlloc::new();
        for len in [1, 100, CHUNK_BYTES, CHUNK_BYTES + 1, 3 * CHUNK_BYTES + 17] {
            let block: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
            let chunks = store_chunks(&alloc, &block).unwrap();
            assert_eq!(chunks.len(), len.div_ceil(CHUNK_BYTES));
            assert!(chunk_slot_bytes(&alloc, &chunks) >= len as u64);
            let record = std::mem::size_of::<Option<Group>>() + chunks.len() * 8;
            assert_eq!(block_cost(&alloc, len) as u64, chunk_slot_bytes(&alloc, &chunks) + record as u64);
            let mut out = Vec::new();
            // SAFETY: the chunks are live and nothing else touches them.
            unsafe { gather(&alloc, &chunks, len, &mut out) };
            assert_eq!(out, block);
            free_chunks(&alloc, &chunks);
        }
        let s = alloc.stats();
        assert_eq!((s.objects, s.span_bytes), (0, 0));
        assert!(store_chunks(&alloc, &[]).unwrap().is_empty());
    }

    /// zstd is C: Miri does not run these.
    #[cfg_attr(miri, ignore)]
    #[test]
    fn blocks_round_trip_and_bad_input_is_an_error() {
        let codec = crate::CodecConfig::Zstd { level: 3, dictionary: None }.build().unwrap();
        let mut pages = vec![0u8; 3 * PAGE_SIZE];
        for (i, b) in pages.iter_mut().enumerate() {
            *b = (i % 13) as u8 ^ (i / PAGE_SIZE) as u8;
        }
        // Slots 0 and 15.
        const TWO: u16 = 0b1000_0000_0000_0001;
        let mut dst = vec![0u8; MAX_STORED_BLOCK];
        let n = encode_block(&*codec, TWO, &pages[..2 * PAGE_SIZE], &mut dst).unwrap();
        let mut out = vec![0u8; BLOCK_BYTES];
        assert_eq!(decode_block(&*codec, &dst[..n], TWO, &mut out).unwrap(), 2 * PAGE_SIZE);
        assert_eq!(&out[..2 * PAGE_SIZE], &pages[..2 * PAGE_SIZE]);
        assert_eq!(page_in(&out, TWO, 15).unwrap()[..], pages[PAGE_SIZE..2 * PAGE_SIZE]);
        // Slots that do not match the block.
        assert!(matches!(decode_block(&*codec, &dst[..n], 0b111, &mut out), Err(GroupError::Length { .. })));
        assert!(matches!(decode_block(&*codec, &dst[..n], 0b1, &mut out), Err(GroupError::Length { .. })));
        assert!(matches!(decode_block(&*codec, &dst[..n], 0, &mut out), Err(GroupError::NoSlots)));
        assert!(matches!(decode_block(&*codec, &[], 1, &mut out), Err(GroupError::BlockSize(0))));
        assert!(matches!(
            encode_block(&*codec, 0b111, &pages[..PAGE_SIZE], &mut dst),
            Err(GroupError::PageCount { .. })
        ));
        // Truncated or flipped blocks fail or decode to something, never panic.
        assert!(decode_block(&*codec, &dst[..n - 1], TWO, &mut out).is_err());
        for i in 0..n.min(64) {
            let mut bad = dst[..n].to_vec();
            bad[i] ^= 0xff;
            let _ = decode_block(&*codec, &bad, TWO, &mut out);
        }
        // A codec without a block mode says so.
        let lz4 = crate::CodecConfig::LZ4.build().unwrap();
        assert!(!lz4.supports_blocks() && codec.supports_blocks());
        assert!(matches!(encode_block(&*lz4, 1, &pages[..PAGE_SIZE], &mut dst), Err(GroupError::Codec(_))));
        assert!(matches!(decode_block(&*lz4, &dst[..n], 1, &mut out), Err(GroupError::Codec(_))));
    }
}
