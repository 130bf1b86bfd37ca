//! Pre-copy hand-over (issue 26): the index travels while the predecessor
//! still serves, and the pause carries only what changed since.
//!
//! An image ([`Store::export_image`]) names every page, so rebuilding the
//! index from it costs about 100 ns a page on each side, all of it inside
//! the pause: half a second at 5 GiB of pool. Instead:
//!
//! 1. the predecessor starts recording which entry handles and group ids
//!    each shard writes ([`Store::track_changes`]; `crate::dirty`), then
//!    writes a snapshot while it serves ([`Store::export_snapshot`]): each
//!    shard's groups and entries with their handles, read under the
//!    shard's lock at once (so a shard's groups and grouped pages agree),
//!    then the allocator's tables, the sealing counter and the codec count
//!    as they stand at its end;
//! 2. the successor builds each shard from it, keeping the predecessor's
//!    handles and group ids ([`Snapshot::read`]); it checks every record
//!    against the tables at the snapshot's end, and notes the ones that
//!    fail (a page moved or freed after its shard was read): each of
//!    those must come back changed, or pass the checks in the pause, or
//!    the hand-over fails;
//! 3. in the pause, the image carries each tracked shard as its changes
//!    only: every recorded handle and id, with what it holds now or that
//!    it holds nothing. The successor removes what it had there, inserts
//!    what is there now (both checked against the final tables), and
//!    swaps the shard into its store ([`Store::import_image_after`]).
//!
//! Handles are stable (`crate::shard::Entries`: an entry never moves
//! while its shard tracks; `Shard::shrink_if_sparse` waits), every write
//! goes through `Entries::get_mut`, `insert`, `remove` or `clear`, and
//! every group write through `Groups::get_mut`, `insert` or `remove`:
//! those mark. So a handle not marked holds in the end what it held when
//! its shard was read. A pool created after tracking began is not tracked
//! and travels whole; one destroyed is dropped.
//!
//! Records use the image's page record ([`IMAGE_RECORD`]) with
//! [`REC_GROUP`] for a grouped page (its location is the group's id), and
//! keep the predecessor's codec ids: the successor maps them once, at the
//! end, and only where its ids differ.

use super::*;
use crate::alloc::SlotTable;
use crate::group::{self, Group, MAX_GROUP_PAGES, MAX_STORED_BLOCK};

/// First bytes of a snapshot.
const SNAP_MAGIC: &[u8; 8] = b"TMEMSNAP";
/// Snapshot format version.
const SNAP_VERSION: u32 = 1;
/// A grouped page, in snapshot and change records only: the record's
/// location is its group's id, its length 0.
const REC_GROUP: u8 = 8;
/// Bytes of one entry's change: handle, present, record.
const ENTRY_CHANGE: usize = 4 + 1 + IMAGE_RECORD;

/// A store's index as its predecessor's snapshot gave it, built while the
/// predecessor served; [`Store::import_image_after`] completes it.
pub struct Snapshot {
    /// The image's shard layout (`handover::layout_byte`).
    layout: u8,
    pools: Vec<Option<Vec<SnapShard>>>,
    pages: u64,
}

/// One shard of a snapshot, and the handles and ids that failed the
/// checks at the snapshot's end (each must be among the changes).
struct SnapShard {
    shard: Shard,
    suspect_entries: Vec<u32>,
    suspect_groups: Vec<u32>,
}

/// The exporter's state that a record is checked against: the
/// allocator's slots, the sealing counter, the number of codecs.
#[derive(Clone, Copy)]
struct EndState<'a> {
    slots: &'a SlotTable,
    next_version: u64,
    codecs: u8,
}

/// What a changed record is checked against at once.
struct Checks<'a> {
    /// The end state (`None`: checked later, as suspects).
    end: Option<EndState<'a>>,
    /// Tiers below the pool.
    tiers: usize,
}

/// What a shard's changes are checked and mapped with: the exporter's
/// codecs (how many, and each id's in this store) and the adopted slots.
#[derive(Clone, Copy)]
pub(super) struct Adopted<'a> {
    pub codecs: u8,
    pub new_id: &'a dyn Fn(u8) -> Result<u8, StoreError>,
    pub slots: &'a SlotTable,
}

/// Entry handles and group ids a record may name in one shard (16 Mi
/// entries, 64 GiB of pages; 4 Mi groups): a damaged stream must not make
/// a successor allocate what it names (640 MiB of entries at most).
const MAX_HANDLE: u32 = 1 << 24;
const MAX_GROUP_ID: u32 = 1 << 22;

fn group_head(out: &mut Vec<u8>, g: &Group) {
    out.extend_from_slice(&g.object.to_le_bytes());
    out.extend_from_slice(&g.base.to_le_bytes());
    out.push(g.codec);
    out.extend_from_slice(&g.slots.to_le_bytes());
    out.extend_from_slice(&g.live.to_le_bytes());
    out.extend_from_slice(&g.len.to_le_bytes());
    out.extend_from_slice(&g.check.to_le_bytes());
    out.extend_from_slice(&u32::try_from(g.chunks.len()).expect("a block has few chunks").to_le_bytes());
    for c in &g.chunks {
        out.extend_from_slice(&c.to_le_bytes());
    }
}

/// Appends the given groups and entries of shard `s` (locked) to `out`:
/// each with what it holds now, or that it holds nothing.
fn write_changes(out: &mut Vec<u8>, s: &Shard, groups: &[u32], handles: &[u32]) {
    out.extend_from_slice(&(groups.len() as u64).to_le_bytes());
    for &id in groups {
        out.extend_from_slice(&id.to_le_bytes());
        match s.groups.get(id) {
            Some(g) => {
                out.push(1);
                group_head(out, g);
            }
            None => out.push(0),
        }
    }
    out.extend_from_slice(&(handles.len() as u64).to_le_bytes());
    out.reserve(handles.len() * ENTRY_CHANGE);
    for &h in handles {
        out.extend_from_slice(&h.to_le_bytes());
        let live = s.entries.is_live(h);
        if !live {
            out.push(0);
            continue;
        }
        let e = s.entries.get(h);
        let mut rec = image_record(e);
        if e.has(F_GROUP) {
            rec[16] |= REC_GROUP;
        }
        out.push(1);
        out.extend_from_slice(&rec);
    }
}

/// Writes the changes shard `s` (locked, tracked) recorded, for an image.
pub(super) fn write_shard_changes(w: &mut W<'_>, s: &Shard) -> Result<(), StoreError> {
    let groups: Vec<u32> = s.groups.dirty().map(|d| d.handles().collect()).unwrap_or_default();
    let handles: Vec<u32> = s.entries.dirty().map(|d| d.handles().collect()).unwrap_or_default();
    let mut out = Vec::new();
    write_changes(&mut out, s, &groups, &handles);
    w.bytes(&out)
}

/// Reads a group's head (as [`group_head`] wrote it) and checks its shape.
fn read_group(r: &mut R<'_>) -> Result<Group, StoreError> {
    let (object, base) = (r.u64()?, r.u64()?);
    let codec = r.u8()?;
    let (slots, live) = (r.u16()?, r.u16()?);
    let (len, check) = (r.u32()?, r.u32()?);
    let what = format!("group of object {object} at {base}");
    if base % MAX_GROUP_PAGES as u64 != 0 {
        return Err(bad(format!("{what}: not at the start of a window")));
    }
    if usize::from(codec) >= MAX_CODECS {
        return Err(bad(format!("{what}: codec {codec}")));
    }
    if live == 0 || live & !slots != 0 {
        return Err(bad(format!("{what}: live slots {live:#06x} of {slots:#06x}")));
    }
    if len == 0 || len as usize > MAX_STORED_BLOCK {
        return Err(bad(format!("{what}: a block of {len} bytes")));
    }
    let n = r.u32()? as usize;
    if n != (len as usize).div_ceil(group::CHUNK_BYTES) {
        return Err(bad(format!("{what}: {n} chunks for a block of {len} bytes")));
    }
    let mut chunks = Vec::with_capacity(n);
    for _ in 0..n {
        chunks.push(r.u64()?);
    }
    Ok(Group { object, base, serial: 0, chunks: chunks.into_boxed_slice(), len, check, codec, slots, live })
}

impl EndState<'_> {
    /// Whether group `g`'s chunks and codec are in this state.
    fn group_passes(&self, g: &Group) -> bool {
        g.codec < self.codecs
            && g.chunks
                .iter()
                .enumerate()
                .all(|(i, &c)| self.slots.holds(crate::alloc::Loc::unpack(c), group::chunk_len(g.len as usize, i)))
    }

    /// Whether single (not grouped) entry `e`'s slot, sealing version and
    /// codec are in this state.
    fn entry_passes(&self, e: &Entry) -> bool {
        e.codec() < self.codecs
            && match e.alloc_loc() {
                Some(at) => self.slots.holds(at, e.len()),
                None => !e.has(F_TIER) || e.loc < self.next_version,
            }
    }
}

/// Decodes one entry record, with the checks that need no end state.
fn read_entry(b: &[u8; IMAGE_RECORD], s: &Shard, checks: &Checks<'_>) -> Result<Entry, StoreError> {
    let f = RecordFields::of(b);
    let key = f.key;
    if f.flags & REC_GROUP != 0 {
        let id = u32::try_from(f.loc).map_err(|_| bad(format!("page {key:?}: group id {}", f.loc)))?;
        let g = s.groups.get(id).ok_or_else(|| bad(format!("page {key:?}: in group {id}, which is not there")))?;
        let in_window = key.object == g.object && key.index.wrapping_sub(g.base) < MAX_GROUP_PAGES as u64;
        if !in_window || g.live & (1 << group::slot_of(key.index)) == 0 || f.codec != g.codec {
            return Err(bad(format!("page {key:?}: not a live page of group {id}")));
        }
        return Ok(Entry::new(key, u64::from(id), f.check, 0, f.codec, F_GROUP));
    }
    if usize::from(f.codec) >= MAX_CODECS {
        return Err(bad(format!("page {key:?}: codec {}", f.codec)));
    }
    let e = if f.flags & REC_SAME != 0 {
        Entry::new(key, f.loc, 0, 0, f.codec, F_SAME)
    } else if let Some(t) = record_tier(f.flags) {
        if t >= checks.tiers || f.len == 0 || f.len > PAGE_SIZE {
            return Err(bad(format!("page {key:?}: {} bytes in tier {t} of {} tiers", f.len, checks.tiers)));
        }
        let mut e = Entry::new(key, 0, f.check, f.len, f.codec, stored_flags(f.flags));
        e.set_tier(t, f.loc);
        e
    } else {
        if f.len == 0 || f.len > PAGE_SIZE {
            return Err(bad(format!("page {key:?}: {} bytes", f.len)));
        }
        Entry::new(key, f.loc, f.check, f.len, f.codec, stored_flags(f.flags))
    };
    if let Some(end) = checks.end {
        if !end.entry_passes(&e) {
            return Err(bad(format!(
                "page {key:?}: {} bytes of codec {} at {:#x} ({}) is not an allocated slot, a sealed version or a codec of the image",
                e.len(),
                e.codec(),
                e.loc,
                if e.has(F_TIER) { "tier" } else { "pool" }
            )));
        }
    }
    Ok(e)
}

/// Reads one shard's changes (groups first: entries in them are checked
/// against them as they will be).
fn read_changes(r: &mut R<'_>, s: &mut Shard, checks: &Checks<'_>) -> Result<(), StoreError> {
    let mut changed_groups = Vec::new();
    let groups = r.u64()?;
    for _ in 0..groups {
        let id = r.u32()?;
        if id >= MAX_GROUP_ID {
            return Err(bad(format!("group id {id} out of range")));
        }
        let g = if r.bool("group present")? { Some(read_group(r)?) } else { None };
        if let (Some(g), Some(end)) = (&g, checks.end) {
            if !end.group_passes(g) {
                return Err(bad(format!("group {id}: a chunk or codec the image does not have")));
            }
        }
        changed_groups.push((id, g));
    }
    // Removals first: a page that moved to another handle is removed from
    // its old one before it is inserted at its new one.
    let entries = r.u64()?;
    let mut records = Vec::new();
    for _ in 0..entries {
        let h = r.u32()?;
        if h >= MAX_HANDLE {
            return Err(bad(format!("entry handle {h} out of range")));
        }
        let rec = r.bool("entry present")?.then(|| r.array::<IMAGE_RECORD>()).transpose()?;
        records.push((h, rec));
    }
    for &(h, _) in &records {
        remove_entry(s, h);
    }
    for (id, g) in changed_groups {
        if s.groups.get(id).is_some() {
            let old = s.groups.remove(id);
            Pool::uncount_group(&mut s.c, &old);
        }
        if let Some(g) = g {
            Pool::count_group(&mut s.c, &g);
            s.groups.insert_at(id, g);
        }
    }
    for (h, rec) in records {
        let Some(rec) = rec else { continue };
        let e = read_entry(&rec, s, checks)?;
        if !s.insert_at(h, e, hash_key(e.key())) {
            return Err(bad(format!("page {:?} at handle {h}: its key or its handle twice in one shard", e.key())));
        }
        Pool::count(&mut s.c, &e);
    }
    Ok(())
}

/// Removes the entry at handle `h` of a shard being built, if any.
fn remove_entry(s: &mut Shard, h: u32) {
    if s.entries.is_live(h) {
        let e = s.remove_handle(h);
        Pool::uncount(&mut s.c, &e);
    }
}

impl Store {
    /// Starts (`true`) or ends recording which entries and groups change
    /// in every shard of every pool, for [`Store::export_snapshot`] and the
    /// image that follows it (module docs). A failed hand-over ends it.
    pub fn track_changes(&self, on: bool) {
        for pool in self.shared.pools_snapshot() {
            for shard in pool.shards.iter() {
                shard.0.lock().track(on);
            }
        }
    }

    /// Whether any shard records its changes ([`Store::track_changes`]).
    pub fn tracks_changes(&self) -> bool {
        self.shared.pools_snapshot().iter().any(|p| p.shards.iter().any(|s| s.0.lock().tracking()))
    }

    /// Writes a snapshot of the index for [`Snapshot::read`] while the
    /// store serves; [`Store::track_changes`] must have begun. Each shard
    /// is read under its lock into memory, then written with no lock held.
    pub fn export_snapshot(&self, w: &mut dyn Write) -> Result<HandoverSummary, StoreError> {
        let sh = &*self.shared;
        let pools = sh.pools.read().clone();
        let mut w = W(w, GatheredCrc::new());
        let mut sum = HandoverSummary::default();
        w.bytes(SNAP_MAGIC)?;
        w.u32(SNAP_VERSION)?;
        w.u8(super::layout_byte(sh))?;
        w.u32(u32::try_from(pools.len()).expect("fewer than 2^32 pools"))?;
        let mut out = Vec::new();
        for pool in &pools {
            let Some(pool) = write_present(&mut w, pool, &mut sum)? else { continue };
            w.u8(u8::try_from(pool.chain.as_ref().map_or(0, |c| c.tiers.len())).expect("at most 8 tiers"))?;
            w.u32(u32::try_from(pool.shards.len()).expect("few shards"))?;
            for shard in pool.shards.iter() {
                out.clear();
                {
                    let s = shard.0.lock();
                    if !s.tracking() {
                        return Err(bad("a snapshot of a shard whose changes are not recorded"));
                    }
                    let groups: Vec<u32> = s.groups.ids().collect();
                    let handles: Vec<u32> = s.entries.live_handles().collect();
                    sum.pages += handles.len() as u64;
                    write_changes(&mut out, &s, &groups, &handles);
                }
                w.bytes(&out)?;
            }
        }
        // The end state the successor checks every record against.
        write_alloc_image(&mut w, &sh.alloc.image(), true)?;
        w.u64(sh.next_version.load(Ordering::SeqCst))?;
        w.u8(u8::try_from(*sh.codec_count.lock()).expect("at most 32 codecs"))?;
        w.bytes(SNAP_MAGIC)?;
        let crc = w.crc()?;
        w.u32(crc)?;
        w.finish()?;
        Ok(sum)
    }

    /// [`Store::import_tiered`] of an image whose shards' pages came
    /// ahead in `snapshot` (module docs).
    pub fn import_image_after(
        cfg: StoreConfig,
        r: &mut dyn Read,
        memfd: std::os::fd::OwnedFd,
        tiers: ImportTiers<'_>,
        snapshot: Snapshot,
    ) -> Result<(Store, HandoverSummary), StoreError> {
        Self::import_as(cfg, r, Some(memfd), tiers, Some(snapshot))
    }

    /// Completes shard `i` of `pool` from `snapshot`: reads its changes
    /// from `r`, applies them, and swaps the shard in.
    pub(super) fn install_shard(
        &self,
        snapshot: &mut Snapshot,
        pool: &Pool,
        i: usize,
        r: &mut R<'_>,
        adopted: &Adopted<'_>,
        sum: &mut HandoverSummary,
    ) -> Result<(), StoreError> {
        let Adopted { codecs, new_id, slots } = *adopted;
        let sh = &*self.shared;
        let missing = || bad(format!("pool {} shard {i}: changes without its snapshot", pool.id));
        let shards = snapshot.pools.get_mut(pool.id as usize).and_then(Option::as_mut).ok_or_else(missing)?;
        if shards.len() != pool.shards.len() {
            return Err(bad(format!(
                "pool {}: {} shards in the snapshot, {} here",
                pool.id,
                shards.len(),
                pool.shards.len()
            )));
        }
        let taken = std::mem::replace(&mut shards[i], SnapShard::new(Shard::new()));
        let SnapShard { shard: mut built, suspect_entries, suspect_groups } = taken;
        let end = EndState { slots, next_version: sh.next_version.load(Ordering::SeqCst), codecs };
        let checks = Checks { end: Some(end), tiers: pool.chain.as_ref().map_or(0, |c| c.tiers.len()) };
        // Codec ids are the exporter's (`codecs` of them) until mapped below.
        read_changes(r, &mut built, &checks)?;
        // A suspect that its changes did not replace must pass now.
        for h in &suspect_entries {
            if built.entries.is_live(*h) {
                let e = *built.entries.get(*h);
                if !e.has(F_GROUP) && !end.entry_passes(&e) {
                    return Err(bad(format!(
                        "page {:?}: not an allocated slot of the image, and not changed",
                        e.key()
                    )));
                }
            }
        }
        for id in &suspect_groups {
            if built.groups.get(*id).is_some_and(|g| !end.group_passes(g)) {
                return Err(bad(format!(
                    "pool {} shard {i}: group {id} is not in the image, and not changed",
                    pool.id
                )));
            }
        }
        built.entries.relink_free();
        built.groups.relink_free();
        if (0..codecs).any(|id| new_id(id).ok() != Some(id)) {
            remap_codecs(&mut built, new_id)?;
        }
        sum.pages += built.c.stored_pages;
        sum.object_bytes += built.c.compr_data_size;
        let mut s = pool.shards[i].0.lock();
        if s.entries.live() != 0 || !s.groups.is_empty() {
            return Err(bad(format!("pool {} shard {i}: changes for a shard that has pages", pool.id)));
        }
        built.meta_reported = s.meta_reported;
        *s = built;
        pool.account(&mut s);
        Ok(())
    }
}

/// Maps every entry's and group's codec id from the exporter's to this
/// store's, counters along (only where the two differ).
fn remap_codecs(s: &mut Shard, new_id: &dyn Fn(u8) -> Result<u8, StoreError>) -> Result<(), StoreError> {
    let handles: Vec<u32> = s.entries.live_handles().collect();
    for h in handles {
        let e = *s.entries.get(h);
        Pool::uncount(&mut s.c, &e);
        let e2 = s.entries.get_mut(h);
        e2.set_codec(new_id(e.codec())?);
        let e2 = *e2;
        Pool::count(&mut s.c, &e2);
    }
    let ids: Vec<u32> = s.groups.ids().collect();
    for id in ids {
        let g = s.groups.get_mut(id).expect("listed");
        let codec = new_id(g.codec)?;
        Pool::uncount_group(&mut s.c, g);
        g.codec = codec;
        Pool::count_group(&mut s.c, g);
    }
    Ok(())
}

impl SnapShard {
    /// `shard` as read, its suspects not yet found.
    fn new(shard: Shard) -> Self {
        SnapShard { shard, suspect_entries: Vec::new(), suspect_groups: Vec::new() }
    }
}

impl Snapshot {
    /// Reads a snapshot written by [`Store::export_snapshot`] and builds
    /// its shards. Anything malformed is an error naming it; records that
    /// fail the end state's checks are kept as suspects (module docs).
    pub fn read(r: &mut dyn Read) -> Result<Snapshot, StoreError> {
        let mut r = R(r, GatheredCrc::new());
        if &r.array::<8>()? != SNAP_MAGIC {
            return Err(bad("not a tmem index snapshot (bad magic)"));
        }
        let version = r.u32()?;
        if version != SNAP_VERSION {
            return Err(bad(format!("snapshot format {version}, this build reads {SNAP_VERSION}")));
        }
        let layout = r.u8()?;
        let pools = r.u32()?;
        if pools > MAX_POOLS {
            return Err(bad(format!("{pools} pools (at most {MAX_POOLS})")));
        }
        let mut snap = Snapshot { layout, pools: Vec::new(), pages: 0 };
        for _ in 0..pools {
            if !r.bool("pool present")? {
                snap.pools.push(None);
                continue;
            }
            let tiers = usize::from(r.u8()?);
            let shards = r.u32()?;
            if tiers > MAX_TIERS || !shards.is_power_of_two() || shards > 1 << 16 {
                return Err(bad(format!("a pool of {tiers} tiers and {shards} shards")));
            }
            let checks = Checks { end: None, tiers };
            let mut built = Vec::with_capacity(shards as usize);
            for _ in 0..shards {
                let mut s = Shard::new();
                read_changes(&mut r, &mut s, &checks)?;
                snap.pages += s.entries.live() as u64;
                built.push(SnapShard::new(s));
            }
            snap.pools.push(Some(built));
        }
        let slots = read_alloc_image(&mut r, true)?.slot_table();
        let end = EndState { slots: &slots, next_version: r.u64()?, codecs: r.u8()? };
        if &r.array::<8>()? != SNAP_MAGIC {
            return Err(bad("the snapshot does not end where its counts say"));
        }
        let crc = r.1.value(&mut |_| Ok(())).map_err(io_err)?;
        if r.u32()? != crc {
            return Err(bad("the snapshot's checksum does not match: it was damaged on the way"));
        }
        for shard in snap.pools.iter_mut().flatten().flatten() {
            let s = &shard.shard;
            shard.suspect_entries = s
                .entries
                .live_handles()
                .filter(|&h| {
                    let e = s.entries.get(h);
                    !e.has(F_GROUP) && !end.entry_passes(e)
                })
                .collect();
            shard.suspect_groups =
                s.groups.ids().filter(|&id| !end.group_passes(s.groups.get(id).expect("listed"))).collect();
        }
        Ok(snap)
    }

    /// Pages the snapshot holds.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Why a store built with `cfg` cannot complete this snapshot, if it
    /// cannot: it must group as the exporter did (and so lay out its shards
    /// as it did) and have as many shards.
    pub fn unusable_with(&self, cfg: &StoreConfig) -> Option<String> {
        if let Err(e) = super::adopted_windows(cfg, self.layout) {
            return Some(format!("the snapshot's store lays out its shards differently: {e}"));
        }
        let shards = if cfg.shards == 0 { default_shards() } else { cfg.shards.next_power_of_two() };
        self.pools
            .iter()
            .flatten()
            .find(|p| p.len() != shards)
            .map(|p| format!("{} shards in the snapshot, {shards} here", p.len()))
    }
}
