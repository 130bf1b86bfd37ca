//! zsmalloc-style size-class allocator for compressed pages.
//!
//! # Design
//!
//! Compressed pages are 16..4096 bytes. Like zsmalloc, objects are packed into
//! *spans* (zsmalloc: zspages) of 1..=16 physically unrelated-to-size pages,
//! one size class per span, so an object may straddle a page boundary and the
//! tail waste of a span is spread over many objects.
//!
//! * **Size steps** are [`CLASS_DELTA`] = 8 bytes, half of zsmalloc's 16.
//!   Each step gets its own geometry: the smallest span (1..=`max_span_pages`
//!   pages, default 8, as zsmalloc's chain size) whose tail waste is at most
//!   1/32 of the span, else the span with the least waste.
//! * **Classes** merge runs of steps, walking down from 4096: a step joins the
//!   next larger class when that costs at most `merge_permille` (default 10,
//!   i.e. 1%) more span bytes per object than a class of its own. zsmalloc
//!   merges only equal geometries; merging a little more means fewer classes,
//!   so fewer partly filled spans (one per class), which is what dominates
//!   the waste of pools of a few hundred MiB. Measured on the 256 MiB mix of
//!   the four corpora (`examples/alloc_tuning.rs`): span bytes are 3.2% over
//!   the compressed bytes, about what zsmalloc spends (3.5%, its 8-byte
//!   in-object handles included).
//! * **No per-object header**: zsmalloc stores an 8-byte handle in every
//!   object so compaction can find its owner; here the store walks its
//!   entries instead (see below).
//! * **Raw pages** (4096 bytes) are a class of their own with one page per span.
//! * **Spans** come from [`PageArena`], which reserves 4 MiB of address space
//!   at a time (private memory, or a memfd a successor process can adopt)
//!   and returns freed spans to the kernel (`MADV_DONTNEED`, or a punched
//!   hole). An empty span is freed at once, as zsmalloc frees empty zspages.
//! * **Free slots** keep a u16 link to the next free slot in their first two
//!   bytes, so free-slot tracking costs no memory beyond the span itself;
//!   never-used slots are handed out by a bump index, so a new span is not
//!   touched before use.
//!
//! # Handles and compaction
//!
//! An allocation is addressed by a [`Loc`] (class, span, slot). The stable
//! *handle* that callers keep is one level up: the store's entry for a key,
//! which holds the `Loc` and is rewritten when the object moves. Compaction
//! therefore runs in three steps driven by the owner of the handles:
//! [`ZsAlloc::plan_compaction`] picks, per class, the emptiest partial spans
//! whose objects fit into the free slots of the others and stops allocating
//! from them; the owner walks its handles and calls [`ZsAlloc::migrate`] for
//! every object in a victim span; [`ZsAlloc::finish_compaction`] frees the
//! victims that became empty and returns any others to service. An object
//! that its owner could not reach (for example one being freed concurrently)
//! only delays the release of its span; it is never lost.
//!
//! # Locking
//!
//! One mutex per size class guards that class's spans and their free lists.
//! Lock order: docs/ARCHITECTURE.md (`Rank::Shard` → `Rank::AllocClass` → `Rank::AllocArena`).

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use tmem_counters::counters;
use tmem_lock::{Mutex, MutexGuard, Rank};

use crate::mem::{ArenaImage, MemError, PageArena, SpanPlace, SpanPtr, MAX_SPAN_PAGES};
use crate::PAGE_SIZE;

/// Spacing between size classes, in bytes.
pub const CLASS_DELTA: usize = 8;
/// Smallest slot: a free slot must hold its u16 free-list link, and this keeps
/// the slot count of a span within 12 bits.
pub const MIN_SLOT: usize = 16;
/// Number of size steps: `CLASS_DELTA, 2*CLASS_DELTA, ..., PAGE_SIZE`. Steps
/// with the same cost per object share a class.
pub const NUM_SIZES: usize = PAGE_SIZE / CLASS_DELTA;
/// Largest tail waste a class accepts before growing its span: 1/32.
const WASTE_SHIFT: usize = 5;
const NO_SLOT: u16 = u16::MAX;
const NOT_PARTIAL: u32 = u32::MAX;

const SLOT_BITS: u32 = 12;
const SPAN_BITS: u32 = 23;
const CLASS_BITS: u32 = 9;
/// Bits of a packed [`Loc`]; callers may use the bits above for their own data.
pub const LOC_BITS: u32 = SLOT_BITS + SPAN_BITS + CLASS_BITS;
const MAX_SPANS_PER_CLASS: usize = 1 << SPAN_BITS;

/// Where an object lives: size class, span within the class, slot within the span.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Loc {
    class: u16,
    span: u32,
    slot: u16,
}

impl Loc {
    /// Packs into the low [`LOC_BITS`] bits of a u64.
    pub fn pack(self) -> u64 {
        u64::from(self.slot) | (u64::from(self.span) << SLOT_BITS) | (u64::from(self.class) << (SLOT_BITS + SPAN_BITS))
    }

    /// Inverse of [`Loc::pack`]; bits above [`LOC_BITS`] are ignored.
    #[allow(clippy::cast_possible_truncation)] // each field is masked to its width first
    pub fn unpack(v: u64) -> Self {
        Self {
            slot: (v & ((1 << SLOT_BITS) - 1)) as u16,
            span: ((v >> SLOT_BITS) & ((1 << SPAN_BITS) - 1)) as u32,
            class: ((v >> (SLOT_BITS + SPAN_BITS)) & ((1 << CLASS_BITS) - 1)) as u16,
        }
    }

    /// Span identity across classes, used in compaction plans.
    fn span_key(self) -> u32 {
        (u32::from(self.class) << SPAN_BITS) | self.span
    }
}

/// Allocation failures.
#[derive(Debug, thiserror::Error)]
pub enum AllocError {
    /// Object size outside 1..=PAGE_SIZE.
    #[error("object size {0} is outside 1..={PAGE_SIZE}")]
    BadSize(usize),
    /// A class ran out of span ids.
    #[error("size class {0} has no free span ids")]
    TooManySpans(usize),
    /// The kernel refused memory.
    #[error(transparent)]
    Mem(#[from] MemError),
}

/// Geometry of one size class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClassGeometry {
    /// Slot size in bytes.
    pub size: usize,
    /// Pages per span.
    pub pages: usize,
    /// Slots per span.
    pub slots: usize,
}

impl ClassGeometry {
    fn for_size(size: usize, max_pages: usize) -> Self {
        let waste = |pages: usize| (pages * PAGE_SIZE) % size;
        let pages = (1..=max_pages).find(|&p| waste(p) <= (p * PAGE_SIZE) >> WASTE_SHIFT).unwrap_or_else(|| {
            (1..=max_pages).min_by(|&a, &b| (waste(a) * b).cmp(&(waste(b) * a))).expect("range is not empty")
        });
        Self { size, pages, slots: pages * PAGE_SIZE / size }
    }

    /// Bytes lost at the end of each span.
    pub fn tail_waste(&self) -> usize {
        self.pages * PAGE_SIZE - self.slots * self.size
    }

    /// Span bytes each object costs, in 1/1024 bytes.
    fn cost(&self) -> usize {
        self.pages * PAGE_SIZE * 1024 / self.slots
    }
}

/// Allocator tuning.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocConfig {
    /// Largest span, in pages (1..=16).
    pub max_span_pages: usize,
    /// A size joins the next larger class when that costs at most this many
    /// per mille more memory per object than a class of its own.
    pub merge_permille: usize,
}

impl Default for AllocConfig {
    fn default() -> Self {
        Self { max_span_pages: 8, merge_permille: 10 }
    }
}

/// Size-to-class mapping: sizes in steps of [`CLASS_DELTA`], merged where a
/// larger class serves them at (almost) the same cost per object.
fn build_classes(cfg: AllocConfig) -> (Vec<ClassGeometry>, Vec<u16>) {
    let mut geos: Vec<ClassGeometry> = Vec::new();
    let mut map = vec![0u16; NUM_SIZES];
    for i in (0..NUM_SIZES).rev() {
        let size = (i + 1) * CLASS_DELTA;
        let own = ClassGeometry::for_size(size.max(MIN_SLOT), cfg.max_span_pages);
        let join = geos.last().is_some_and(|c| c.cost() * 1000 <= own.cost() * (1000 + cfg.merge_permille));
        if !join {
            geos.push(own);
        }
        map[i] = u16::try_from(geos.len() - 1).expect("fewer classes than sizes");
    }
    // Classes were numbered from the largest; renumber from the smallest.
    let n = geos.len();
    geos.reverse();
    for m in &mut map {
        *m = u16::try_from(n - 1 - usize::from(*m)).expect("class index fits");
    }
    (geos, map)
}

/// Index of the size step serving objects of `len` bytes.
fn size_index(len: usize) -> Result<usize, AllocError> {
    if len == 0 || len > PAGE_SIZE {
        return Err(AllocError::BadSize(len));
    }
    Ok(len.max(MIN_SLOT).div_ceil(CLASS_DELTA) - 1)
}

struct Span {
    ptr: Option<SpanPtr>,
    used: u16,
    /// Slots below `bump` have been handed out at least once.
    bump: u16,
    free_head: u16,
    /// Position in `Class::partial`, or NOT_PARTIAL.
    partial_pos: u32,
    evacuating: bool,
}

impl Span {
    fn unmapped() -> Self {
        Self { ptr: None, used: 0, bump: 0, free_head: NO_SLOT, partial_pos: NOT_PARTIAL, evacuating: false }
    }
}

/// One mapped span in an [`AllocImage`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpanImage {
    /// Where its pages are.
    pub place: SpanPlace,
    /// Slots in use.
    pub used: u16,
    /// Slots handed out at least once.
    pub bump: u16,
    /// First free slot below `bump` (`u16::MAX`: none); the list runs
    /// through the free slots themselves, in the shared pages.
    pub free_head: u16,
}

/// An allocator as a successor adopts it: [`ZsAlloc::image`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocImage {
    /// The tuning that made its classes.
    pub config: AllocConfig,
    /// The arena's chunks and free spans.
    pub arena: ArenaImage,
    /// Per class, per span id: the span, or `None` for a free id.
    pub classes: Vec<Vec<Option<SpanImage>>>,
    /// Pages compacted, objects migrated, compactions (cumulative).
    pub compacted: [u64; 3],
}

struct Class {
    geo: ClassGeometry,
    spans: Vec<Span>,
    free_ids: Vec<u32>,
    /// Spans with at least one free slot that new objects may use.
    partial: Vec<u32>,
}

impl Class {
    fn partial_remove(&mut self, id: u32) {
        let pos = self.spans[id as usize].partial_pos;
        if pos == NOT_PARTIAL {
            return;
        }
        self.partial.swap_remove(pos as usize);
        if let Some(&moved) = self.partial.get(pos as usize) {
            self.spans[moved as usize].partial_pos = pos;
        }
        self.spans[id as usize].partial_pos = NOT_PARTIAL;
    }

    fn partial_push(&mut self, id: u32) {
        debug_assert_eq!(self.spans[id as usize].partial_pos, NOT_PARTIAL);
        self.spans[id as usize].partial_pos = u32::try_from(self.partial.len()).expect("span ids fit u32");
        self.partial.push(id);
    }

    fn meta_bytes(&self) -> usize {
        self.spans.capacity() * std::mem::size_of::<Span>() + (self.free_ids.capacity() + self.partial.capacity()) * 4
    }
}

counters! {
    /// Counters of the allocator.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
    pub struct AllocStats {
        /// Bytes in spans (what the allocator holds from the kernel).
        span_bytes: Gauge(Bytes),
        /// Bytes in allocated slots (object sizes rounded up to their class).
        slot_bytes: Gauge(Bytes),
        /// Live objects.
        objects: Gauge(Objects),
        /// Bookkeeping bytes (span tables, lists).
        meta_bytes: Gauge(Bytes),
        /// Pages released by compaction, as zram's `pages_compacted`.
        pages_compacted: Counter(Pages),
        /// Objects moved by compaction.
        objects_migrated: Counter(Objects),
        /// Completed compaction runs.
        compactions: Counter(Events),
    }
}

/// Spans chosen for evacuation by [`ZsAlloc::plan_compaction`].
#[derive(Debug, Default)]
pub struct CompactionPlan {
    victims: HashSet<u32>,
}

impl CompactionPlan {
    /// True when no span needs moving.
    pub fn is_empty(&self) -> bool {
        self.victims.is_empty()
    }

    /// Number of spans to evacuate.
    pub fn len(&self) -> usize {
        self.victims.len()
    }

    /// True when the object at `loc` must be migrated.
    pub fn contains(&self, loc: Loc) -> bool {
        self.victims.contains(&loc.span_key())
    }
}

/// The size-class allocator. See the module documentation for the design.
pub struct ZsAlloc {
    config: AllocConfig,
    arena: PageArena,
    classes: Box<[Mutex<Class>]>,
    /// Size step -> class.
    size_class: Box<[u16]>,
    slot_bytes: AtomicU64,
    objects: AtomicU64,
    meta_bytes: AtomicU64,
    pages_compacted: AtomicU64,
    objects_migrated: AtomicU64,
    compactions: AtomicU64,
}

impl Default for ZsAlloc {
    fn default() -> Self {
        Self::new()
    }
}

/// The slots a sealed allocator has handed out ([`ZsAlloc::slot_table`]).
pub struct SlotTable {
    /// Per class: its slot size, and each span's bump (0: no span).
    classes: Vec<(usize, Vec<u16>)>,
}

impl AllocImage {
    /// The slots this image names (what [`ZsAlloc::slot_table`] of the
    /// allocator adopted from it gives), without adopting it.
    pub fn slot_table(&self) -> SlotTable {
        let (geos, _) = build_classes(self.config);
        let classes = self
            .classes
            .iter()
            .enumerate()
            .map(|(i, spans)| {
                let size = geos.get(i).map_or(0, |g| g.size);
                (size, spans.iter().map(|s| s.as_ref().map_or(0, |s| s.bump)).collect())
            })
            .collect();
        SlotTable { classes }
    }
}

impl SlotTable {
    /// Whether `loc` names a slot of a mapped span below its bump, big
    /// enough for `len` bytes.
    pub fn holds(&self, loc: Loc, len: usize) -> bool {
        self.classes.get(usize::from(loc.class)).is_some_and(|(size, bumps)| {
            len <= *size && bumps.get(loc.span as usize).is_some_and(|&bump| loc.slot < bump)
        })
    }
}

impl ZsAlloc {
    /// Creates an empty allocator.
    pub fn new() -> Self {
        Self::with_config(AllocConfig::default())
    }

    /// Creates an empty allocator with the given tuning.
    pub fn with_config(cfg: AllocConfig) -> Self {
        assert!((1..=MAX_SPAN_PAGES).contains(&cfg.max_span_pages), "max_span_pages must be 1..={MAX_SPAN_PAGES}");
        let (geos, size_class) = build_classes(cfg);
        let classes = geos
            .into_iter()
            .map(|geo| {
                Mutex::new(
                    Rank::AllocClass,
                    Class { geo, spans: Vec::new(), free_ids: Vec::new(), partial: Vec::new() },
                )
            })
            .collect();
        Self {
            config: cfg,
            arena: PageArena::new(),
            classes,
            size_class: size_class.into_boxed_slice(),
            slot_bytes: AtomicU64::new(0),
            objects: AtomicU64::new(0),
            meta_bytes: AtomicU64::new(0),
            pages_compacted: AtomicU64::new(0),
            objects_migrated: AtomicU64::new(0),
            compactions: AtomicU64::new(0),
        }
    }

    /// Creates an empty allocator whose pages a successor process can adopt
    /// ([`PageArena::shared`]).
    pub fn shared(cfg: AllocConfig) -> Result<Self, AllocError> {
        Ok(Self { arena: PageArena::shared()?, ..Self::with_config(cfg) })
    }

    /// The page arena (its memfd and seal).
    pub fn arena(&self) -> &PageArena {
        &self.arena
    }

    /// Everything a successor needs to adopt this allocator's pages, read
    /// once the arena is sealed (so that nothing changes while it is read).
    pub fn image(&self) -> AllocImage {
        let classes = (0..self.classes.len())
            .map(|i| {
                let c = self.lock(i);
                c.spans
                    .iter()
                    .map(|s| {
                        s.ptr.map(|p| SpanImage {
                            place: self.arena.place(p),
                            used: s.used,
                            bump: s.bump,
                            free_head: s.free_head,
                        })
                    })
                    .collect()
            })
            .collect();
        AllocImage {
            config: self.config,
            arena: self.arena.image(),
            classes,
            compacted: [
                self.pages_compacted.load(Ordering::Relaxed),
                self.objects_migrated.load(Ordering::Relaxed),
                self.compactions.load(Ordering::Relaxed),
            ],
        }
    }

    /// Adopts a predecessor's allocator: its memfd `fd` and its `image`.
    /// No page is read or written. Every span of the image is checked
    /// against its class and the memfd.
    pub fn adopt(fd: std::os::fd::OwnedFd, image: &AllocImage) -> Result<Self, AllocError> {
        let bad = |what: String| AllocError::Mem(MemError::BadImage(what));
        let mut a = Self::with_config(image.config);
        if image.classes.len() != a.classes.len() {
            return Err(bad(format!(
                "{} size classes, this configuration makes {}",
                image.classes.len(),
                a.classes.len()
            )));
        }
        let mut used_pages = 0u64;
        for (i, spans) in image.classes.iter().enumerate() {
            if spans.len() > MAX_SPANS_PER_CLASS {
                return Err(bad(format!("{} spans in class {i}", spans.len())));
            }
            used_pages += spans.iter().flatten().count() as u64 * a.classes[i].get_mut().geo.pages as u64;
        }
        a.arena = PageArena::adopt(fd, &image.arena, used_pages)?;
        let (mut slot_bytes, mut objects) = (0u64, 0u64);
        let arena = &a.arena;
        let classes = &mut a.classes;
        arena.with_span_at(|span_at| -> Result<(), AllocError> {
            for (i, spans) in image.classes.iter().enumerate() {
                let c = classes[i].get_mut();
                // One allocation, not a doubling series, in the pause.
                c.spans.reserve_exact(spans.len());
                let geo = c.geo;
                for (id, s) in spans.iter().enumerate() {
                    let id = u32::try_from(id).expect("checked against MAX_SPANS_PER_CLASS");
                    let Some(s) = s else {
                        c.spans.push(Span::unmapped());
                        c.free_ids.push(id);
                        continue;
                    };
                    let (used, bump, slots) = (usize::from(s.used), usize::from(s.bump), geo.slots);
                    if used > bump
                        || bump > slots
                        || (s.free_head != NO_SLOT && usize::from(s.free_head) >= bump)
                        || used == 0
                    {
                        return Err(bad(format!(
                            "class {i} span {id}: {used} used, bump {bump}, free head {} of {slots} slots",
                            s.free_head
                        )));
                    }
                    let ptr = span_at(s.place, geo.pages)?;
                    c.spans.push(Span {
                        ptr: Some(ptr),
                        used: s.used,
                        bump: s.bump,
                        free_head: s.free_head,
                        partial_pos: NOT_PARTIAL,
                        evacuating: false,
                    });
                    if used < slots {
                        c.partial_push(id);
                    }
                    slot_bytes += (used * geo.size) as u64;
                    objects += used as u64;
                }
            }
            Ok(())
        })?;
        let meta: usize = a.classes.iter_mut().map(|c| c.get_mut().meta_bytes()).sum();
        a.slot_bytes.store(slot_bytes, Ordering::Relaxed);
        a.objects.store(objects, Ordering::Relaxed);
        a.meta_bytes.store(meta as u64, Ordering::Relaxed);
        a.pages_compacted.store(image.compacted[0], Ordering::Relaxed);
        a.objects_migrated.store(image.compacted[1], Ordering::Relaxed);
        a.compactions.store(image.compacted[2], Ordering::Relaxed);
        Ok(a)
    }

    /// Which slots the allocator has handed out, read once under each
    /// class lock: an adopted index is checked against it without a lock
    /// per page (the adopted allocator is sealed and changes nothing).
    pub fn slot_table(&self) -> SlotTable {
        let classes = (0..self.classes.len())
            .map(|i| {
                let c = self.lock(i);
                let bumps = c.spans.iter().map(|s| if s.ptr.is_some() { s.bump } else { 0 }).collect();
                (c.geo.size, bumps)
            })
            .collect();
        SlotTable { classes }
    }

    /// Maps every live span's pages into this process (see
    /// [`PageArena::populate`]); returns the pages. Each span is mapped
    /// under its class's lock, so a span freed meanwhile is never faulted
    /// in again (which would fill its holes with fresh pages).
    pub fn populate(&self) -> std::io::Result<u64> {
        let mut pages = 0;
        for i in 0..self.classes.len() {
            let mut id = 0;
            loop {
                let c = self.lock(i);
                let Some(span) = c.spans.get(id) else { break };
                if let Some(p) = span.ptr {
                    self.arena.populate(p)?;
                    pages += (p.len() / PAGE_SIZE) as u64;
                }
                id += 1;
            }
        }
        Ok(pages)
    }

    /// Number of size classes.
    pub fn num_classes(&self) -> usize {
        self.classes.len()
    }

    /// Geometry of class `i`.
    pub fn geometry(&self, i: usize) -> ClassGeometry {
        self.lock(i).geo
    }

    /// Class serving objects of `len` bytes.
    pub fn class_of(&self, len: usize) -> Result<usize, AllocError> {
        Ok(usize::from(self.size_class[size_index(len)?]))
    }

    /// Slot size of the object at `loc`.
    pub fn slot_size(&self, loc: Loc) -> usize {
        self.lock(usize::from(loc.class)).geo.size
    }

    fn lock(&self, class: usize) -> MutexGuard<'_, Class> {
        self.classes[class].lock()
    }

    /// Bytes held from the kernel, span memory plus bookkeeping: zram's `mem_used_total`.
    pub fn total_bytes(&self) -> u64 {
        self.arena.used_bytes() + self.meta_bytes.load(Ordering::Relaxed)
    }

    /// Snapshot of the counters.
    pub fn stats(&self) -> AllocStats {
        AllocStats {
            span_bytes: self.arena.used_bytes(),
            slot_bytes: self.slot_bytes.load(Ordering::Relaxed),
            objects: self.objects.load(Ordering::Relaxed),
            meta_bytes: self.meta_bytes.load(Ordering::Relaxed) + self.arena.meta_bytes(),
            pages_compacted: self.pages_compacted.load(Ordering::Relaxed),
            objects_migrated: self.objects_migrated.load(Ordering::Relaxed),
            compactions: self.compactions.load(Ordering::Relaxed),
        }
    }

    /// Fraction of span bytes not holding an object, in percent.
    pub fn fragmentation_percent(&self) -> u64 {
        let span = self.arena.used_bytes();
        if span == 0 {
            return 0;
        }
        span.saturating_sub(self.slot_bytes.load(Ordering::Relaxed)) * 100 / span
    }

    /// Allocates a slot for `data.len()` bytes and copies `data` into it.
    pub fn alloc_write(&self, data: &[u8]) -> Result<Loc, AllocError> {
        let class = self.class_of(data.len())?;
        let mut c = self.lock(class);
        let loc = self.alloc_locked(&mut c, class)?;
        let span = c.spans[loc.span as usize].ptr.expect("allocated span is mapped");
        // SAFETY: the slot was just allocated under the class lock, so nobody
        // else reads or writes it; data.len() <= slot size.
        unsafe { span.write(usize::from(loc.slot) * c.geo.size, data) };
        Ok(loc)
    }

    fn alloc_locked(&self, c: &mut Class, class: usize) -> Result<Loc, AllocError> {
        if self.arena.sealed() {
            return Err(MemError::Sealed.into());
        }
        if c.partial.is_empty() {
            self.new_span(c, class)?;
        }
        let id = *c.partial.last().expect("a partial span exists");
        let size = c.geo.size;
        let slots = c.geo.slots;
        let s = &mut c.spans[id as usize];
        let ptr = s.ptr.expect("partial span is mapped");
        let slot = if s.free_head != NO_SLOT {
            let slot = s.free_head;
            // SAFETY: free slots belong to the allocator; we hold the class lock.
            s.free_head = unsafe { ptr.read_u16(usize::from(slot) * size) };
            slot
        } else {
            let slot = s.bump;
            s.bump += 1;
            slot
        };
        s.used += 1;
        if usize::from(s.used) == slots {
            c.partial_remove(id);
        }
        self.slot_bytes.fetch_add(size as u64, Ordering::Relaxed);
        self.objects.fetch_add(1, Ordering::Relaxed);
        Ok(Loc { class: u16::try_from(class).expect("class < 512"), span: id, slot })
    }

    fn new_span(&self, c: &mut Class, class: usize) -> Result<(), AllocError> {
        let ptr = self.arena.alloc_span(c.geo.pages)?;
        let span =
            Span { ptr: Some(ptr), used: 0, bump: 0, free_head: NO_SLOT, partial_pos: NOT_PARTIAL, evacuating: false };
        let before = c.meta_bytes();
        let id = if let Some(id) = c.free_ids.pop() {
            c.spans[id as usize] = span;
            id
        } else {
            if c.spans.len() >= MAX_SPANS_PER_CLASS {
                // SAFETY: the span was never handed out.
                unsafe { self.arena.free_span(ptr) };
                return Err(AllocError::TooManySpans(class));
            }
            c.spans.push(span);
            u32::try_from(c.spans.len() - 1).expect("span ids fit 23 bits")
        };
        c.partial_push(id);
        self.account_meta(before, c.meta_bytes());
        Ok(())
    }

    fn account_meta(&self, before: usize, after: usize) {
        if after >= before {
            self.meta_bytes.fetch_add((after - before) as u64, Ordering::Relaxed);
        } else {
            self.meta_bytes.fetch_sub((before - after) as u64, Ordering::Relaxed);
        }
    }

    /// Frees the object at `loc`.
    ///
    /// # Panics
    /// If `loc` is not a live allocation (a double free is a bug in the caller).
    pub fn free(&self, loc: Loc) {
        let class = usize::from(loc.class);
        let mut c = self.lock(class);
        self.free_locked(&mut c, loc);
    }

    fn free_locked(&self, c: &mut Class, loc: Loc) {
        if self.arena.sealed() {
            // Handed over: the slot stays as the successor's image has it
            // (a leak there, never a free of a page it may hold).
            return;
        }
        let size = c.geo.size;
        let slots = c.geo.slots;
        let before = c.meta_bytes();
        let s = &mut c.spans[loc.span as usize];
        let ptr = s.ptr.expect("free of an object in an unmapped span");
        assert!(s.used > 0 && loc.slot < s.bump, "free of a slot that is not allocated: {loc:?}");
        // SAFETY: the slot is being freed by its owner; we hold the class lock.
        unsafe { ptr.write_u16(usize::from(loc.slot) * size, s.free_head) };
        s.free_head = loc.slot;
        let was_full = usize::from(s.used) == slots;
        s.used -= 1;
        let empty = s.used == 0;
        let evacuating = s.evacuating;
        self.slot_bytes.fetch_sub(size as u64, Ordering::Relaxed);
        self.objects.fetch_sub(1, Ordering::Relaxed);
        if empty {
            c.partial_remove(loc.span);
            let s = &mut c.spans[loc.span as usize];
            s.ptr = None;
            s.evacuating = false;
            c.free_ids.push(loc.span);
            // SAFETY: the span holds no live object and is unreachable from
            // the class tables now.
            unsafe { self.arena.free_span(ptr) };
            if evacuating {
                self.pages_compacted.fetch_add(c.geo.pages as u64, Ordering::Relaxed);
            }
            if c.free_ids.len() == c.spans.len() {
                // The class holds nothing: give its tables back too (a pool
                // emptied after a swap job would keep them at their peak).
                // Span ids start over; a compaction plan naming old ones
                // finds them gone or not evacuating.
                c.spans = Vec::new();
                c.free_ids = Vec::new();
                c.partial = Vec::new();
            }
        } else if was_full && !evacuating {
            c.partial_push(loc.span);
        }
        self.account_meta(before, c.meta_bytes());
    }

    /// Borrows the `len` bytes of the object at `loc`.
    ///
    /// # Safety
    /// `loc` is live and `len` is at most its allocated length; the caller
    /// guarantees that the object is neither freed nor migrated while the
    /// returned slice lives (the store holds the owning shard lock).
    pub unsafe fn object(&self, loc: Loc, len: usize) -> &[u8] {
        let c = self.lock(usize::from(loc.class));
        assert!(len <= c.geo.size);
        let span = c.spans[loc.span as usize].ptr.expect("object in an unmapped span");
        // SAFETY: the caller keeps the object alive and unmoved; the slot lies
        // within the span (slot < slots, len <= size); only its owner writes it.
        unsafe { span.slice(&self.arena, usize::from(loc.slot) * c.geo.size, len) }
    }

    /// Flips bits of byte `at` of the object at `loc` (corruption tests).
    ///
    /// # Safety
    /// `loc` is live, `at` is inside it, and nothing else reads or writes
    /// the object meanwhile (the store holds the owning shard lock).
    #[cfg(test)]
    pub(crate) unsafe fn corrupt_object(&self, loc: Loc, at: usize) {
        let c = self.lock(usize::from(loc.class));
        assert!(at < c.geo.size);
        let span = c.spans[loc.span as usize].ptr.expect("object in an unmapped span");
        // SAFETY: the caller's contract; the byte lies in the object's slot.
        unsafe { span.xor_byte(usize::from(loc.slot) * c.geo.size + at, 0x55) };
    }

    /// Picks victim spans per class (see the module docs) and stops
    /// allocating from them.
    pub fn plan_compaction(&self) -> CompactionPlan {
        let mut plan = CompactionPlan::default();
        for class in 0..self.classes.len() {
            let mut c = self.lock(class);
            if c.partial.len() < 2 {
                continue;
            }
            let slots = c.geo.slots;
            let mut cand: Vec<(u16, u32)> = c.partial.iter().map(|&id| (c.spans[id as usize].used, id)).collect();
            cand.sort_unstable();
            // The k emptiest spans are victims if their objects fit into the
            // free slots of the others; the largest such k wins.
            let total_free: usize = cand.iter().map(|&(used, _)| slots - usize::from(used)).sum();
            let (mut victim_used, mut victim_free) = (0usize, 0usize);
            let mut victims = Vec::new();
            for &(used, id) in &cand {
                let used = usize::from(used);
                if victim_used + used > total_free - victim_free - (slots - used) {
                    break;
                }
                victim_used += used;
                victim_free += slots - used;
                victims.push(id);
            }
            for id in victims {
                c.partial_remove(id);
                c.spans[id as usize].evacuating = true;
                plan.victims.insert((u32::try_from(class).expect("class < 512") << SPAN_BITS) | id);
            }
        }
        plan
    }

    /// Moves the `len`-byte object at `loc` out of its span into a non-victim
    /// span of the same class and returns its new location.
    ///
    /// The caller holds whatever lock keeps `loc`'s owner from reading or
    /// freeing it concurrently, and stores the returned location.
    pub fn migrate(&self, loc: Loc, len: usize) -> Result<Loc, AllocError> {
        let class = usize::from(loc.class);
        let mut c = self.lock(class);
        let new = self.alloc_locked(&mut c, class)?;
        let size = c.geo.size;
        let src = c.spans[loc.span as usize].ptr.expect("object in an unmapped span");
        let dst = c.spans[new.span as usize].ptr.expect("allocated span is mapped");
        // SAFETY: the source object is live and its owner is locked out by the
        // caller; the destination slot was just allocated under this lock;
        // distinct slots never overlap.
        unsafe { src.copy_to(usize::from(loc.slot) * size, &dst, usize::from(new.slot) * size, len) };
        self.free_locked(&mut c, loc);
        self.objects_migrated.fetch_add(1, Ordering::Relaxed);
        Ok(new)
    }

    /// Ends a compaction: victims that still hold objects go back into service.
    pub fn finish_compaction(&self, plan: CompactionPlan) {
        for key in plan.victims {
            let class = (key >> SPAN_BITS) as usize;
            let id = key & ((1 << SPAN_BITS) - 1);
            let mut c = self.lock(class);
            let slots = c.geo.slots;
            let Some(s) = c.spans.get_mut(id as usize) else { continue };
            if s.evacuating {
                s.evacuating = false;
                if usize::from(s.used) < slots {
                    c.partial_push(id);
                }
            }
        }
        self.compactions.fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_waste_is_bounded() {
        let mut worst = 0.0f64;
        for i in 0..NUM_SIZES {
            let g = ClassGeometry::for_size(((i + 1) * CLASS_DELTA).max(MIN_SLOT), MAX_SPAN_PAGES);
            assert!(g.slots >= 1 && g.slots <= 1 << SLOT_BITS, "{g:?}");
            let w = g.tail_waste() as f64 / (g.pages * PAGE_SIZE) as f64;
            worst = worst.max(w);
        }
        assert!(worst < 0.07, "worst tail waste {worst}");
        assert_eq!(ClassGeometry::for_size(PAGE_SIZE, MAX_SPAN_PAGES).pages, 1);
    }

    #[test]
    #[cfg_attr(miri, ignore)] // arithmetic only, over every size: 18 s under Miri
    fn class_mapping() {
        let a = ZsAlloc::new();
        assert!(a.class_of(0).is_err());
        assert!(a.class_of(PAGE_SIZE + 1).is_err());
        assert_eq!(a.class_of(1).unwrap(), a.class_of(MIN_SLOT).unwrap());
        assert_eq!(a.class_of(PAGE_SIZE).unwrap(), a.num_classes() - 1);
        let mut prev = 0;
        for len in 1..=PAGE_SIZE {
            let c = a.class_of(len).unwrap();
            assert!(c >= prev, "classes grow with size");
            assert!(a.geometry(c).size >= len, "class {c} too small for {len}");
            prev = c;
        }
    }

    #[test]
    fn loc_pack_round_trip() {
        let l = Loc { class: 511, span: (1 << SPAN_BITS) - 1, slot: 4095 };
        assert_eq!(Loc::unpack(l.pack() | (0xABC << LOC_BITS)), l);
    }

    fn read(a: &ZsAlloc, loc: Loc, len: usize) -> Vec<u8> {
        // SAFETY: single-threaded test; loc is live.
        unsafe { a.object(loc, len) }.to_vec()
    }

    #[test]
    #[allow(clippy::cast_possible_truncation)] // values are < 251
    fn alloc_free_reuse_and_release() {
        let a = ZsAlloc::new();
        let mut locs = Vec::new();
        // Miri interprets every byte: fewer objects there, with sizes spread
        // over the whole range, so still every class kind.
        let (n, stride) = if cfg!(miri) { (40, 103) } else { (1000, 37) };
        for i in 0..n {
            let len = 1 + (i * stride) % PAGE_SIZE;
            let data: Vec<u8> = (0..len).map(|j| ((i + j) % 251) as u8).collect();
            locs.push((a.alloc_write(&data).unwrap(), data));
        }
        for (loc, data) in &locs {
            assert_eq!(&read(&a, *loc, data.len()), data);
        }
        for (loc, _) in locs.drain(..) {
            a.free(loc);
        }
        let s = a.stats();
        assert_eq!((s.span_bytes, s.slot_bytes, s.objects), (0, 0, 0));
        assert_eq!(s.meta_bytes, a.arena.meta_bytes(), "emptied classes give their tables back");
        // And the allocator still works after that.
        let loc = a.alloc_write(&[9u8; 300]).unwrap();
        assert_eq!(read(&a, loc, 300), vec![9u8; 300]);
    }

    #[test]
    fn compaction_moves_objects_and_frees_spans() {
        let a = ZsAlloc::new();
        let data = vec![0x5a; 1000];
        let n = if cfg!(miri) { 120 } else { 400 };
        let mut locs: Vec<Loc> = (0..n).map(|_| a.alloc_write(&data).unwrap()).collect();
        // Free 3 of every 4 objects: spans become sparse.
        let mut kept = Vec::new();
        for (i, l) in locs.drain(..).enumerate() {
            if i % 4 == 0 {
                kept.push(l);
            } else {
                a.free(l);
            }
        }
        let before = a.stats().span_bytes;
        let plan = a.plan_compaction();
        assert!(!plan.is_empty());
        for l in &mut kept {
            if plan.contains(*l) {
                *l = a.migrate(*l, data.len()).unwrap();
            }
        }
        a.finish_compaction(plan);
        let after = a.stats();
        assert!(after.span_bytes * 3 < before * 2, "{} -> {}", before, after.span_bytes);
        assert!(after.pages_compacted > 0);
        for l in &kept {
            assert_eq!(read(&a, *l, data.len()), data);
        }
    }

    #[test]
    #[should_panic(expected = "not allocated")]
    fn free_of_unallocated_slot_panics() {
        let a = ZsAlloc::new();
        let l1 = a.alloc_write(&[1; 100]).unwrap();
        a.free(Loc { slot: l1.slot + 5, ..l1 });
    }
}
