//! The engine against a model of memory: a simulated page table and staging
//! area that act as the kernel's ioctls do, random program operations
//! interleaved with the phases of eviction batches, and the oracle: every
//! read returns the last value written, or zero after `munmap`, `madvise`
//! or never writing. Mappings a scan has not registered yet take writes
//! without faults and send no events, as the kernel's do.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeSet, HashMap};

use proptest::prelude::*;

use super::*;

fn value(page: &[u8; PAGE]) -> u64 {
    u64::from_ne_bytes(page[..8].try_into().unwrap())
}

fn page_of(v: u64) -> [u8; PAGE] {
    let mut p = [0u8; PAGE];
    p[..8].copy_from_slice(&v.to_ne_bytes());
    p
}

/// The kernel side: mapped page numbers, those registered with the
/// userfaultfd, present pages (their value), the staging slots, and an
/// injected "memory map is changing" state.
#[derive(Default)]
struct Sim {
    mapped: RefCell<BTreeSet<Pn>>,
    registered: RefCell<BTreeSet<Pn>>,
    ptes: RefCell<HashMap<Pn, u64>>,
    staging: RefCell<HashMap<u32, u64>>,
    changing: Cell<bool>,
    /// Fills that succeed before the map starts changing (`None`: no limit).
    fills_left: Cell<Option<u32>>,
    /// Unmaps the kernel has prepared and not yet had read: every fill and
    /// move fails with EAGAIN meanwhile (`mmap_changing`).
    unread_unmaps: Cell<usize>,
}

impl Sim {
    /// Whether the next fill finds the map changing, counting it.
    fn fill_changing(&self) -> bool {
        if self.unread_unmaps.get() > 0 {
            return true;
        }
        match self.fills_left.get() {
            Some(0) => return true,
            Some(k) => self.fills_left.set(Some(k - 1)),
            None => {}
        }
        self.changing.get()
    }

    fn move_one(&self, pn: Pn, slot: u32) -> Outcome {
        if self.changing.get() || self.unread_unmaps.get() > 0 {
            return Outcome::Retry;
        }
        if self.staging.borrow().contains_key(&slot) {
            return Outcome::Gone;
        }
        let Some(v) = self.ptes.borrow_mut().remove(&pn) else { return Outcome::Gone };
        self.staging.borrow_mut().insert(slot, v);
        Outcome::Done
    }
}

impl Mem for Sim {
    fn fill(&self, pn: Pn, page: &[u8; PAGE]) -> Outcome {
        if self.fill_changing() {
            return Outcome::Retry;
        }
        if !self.registered.borrow().contains(&pn) || self.ptes.borrow().contains_key(&pn) {
            return Outcome::Gone;
        }
        self.ptes.borrow_mut().insert(pn, value(page));
        Outcome::Done
    }

    fn move_out(&self, pages: &[Pn], out: &mut [Outcome]) {
        for (i, &pn) in pages.iter().enumerate() {
            #[allow(clippy::cast_possible_truncation)]
            let slot = i as u32;
            out[i] = self.move_one(pn, slot);
        }
    }

    fn move_back(&self, slot: u32, pn: Pn) -> Outcome {
        if self.fill_changing() {
            return Outcome::Retry;
        }
        if !self.registered.borrow().contains(&pn) || self.ptes.borrow().contains_key(&pn) {
            return Outcome::Gone;
        }
        let Some(v) = self.staging.borrow_mut().remove(&slot) else { return Outcome::Gone };
        self.ptes.borrow_mut().insert(pn, v);
        Outcome::Done
    }

    fn wake(&self, _pn: Pn) {}
}

#[derive(Default)]
struct Store {
    pages: RefCell<HashMap<u64, u64>>,
    refuse: Cell<bool>,
}

impl Backing for Store {
    fn put(&self, key: u64, page: &[u8; PAGE]) -> bool {
        if self.refuse.get() {
            return false;
        }
        self.pages.borrow_mut().insert(key, value(page));
        true
    }

    fn get(&self, key: u64, out: &mut [u8; PAGE]) -> bool {
        match self.pages.borrow().get(&key) {
            Some(v) => {
                *out = page_of(*v);
                true
            }
            None => false,
        }
    }

    fn get_in_memory(&self, key: u64, out: &mut [u8; PAGE]) -> bool {
        self.get(key, out)
    }

    fn remove(&self, key: u64) {
        self.pages.borrow_mut().remove(&key);
    }
}

const SPACE: u64 = 48;

#[derive(Clone, Debug)]
enum Op {
    Write(Pn, u64),
    Read(Pn),
    /// Phase 1 of a batch: move up to n victims out.
    EvictStart(usize),
    /// Phase 2: read the staging slots (unlocked in the manager).
    EvictRead,
    /// Phase 3: store what is still in its slot, then drop the staging area.
    EvictCommit {
        refuse: bool,
    },
    Remove(Pn, u64),
    Unmap(Pn, u64),
    /// `munmap` whose event the engine has not had yet: the pages leave the
    /// program at once, the engine forgets them at the next
    /// [`Op::Events`] (or any op that changes the map, as the kernel's
    /// event must be read before the `munmap` returns).
    UnmapLate(Pn, u64),
    /// The events read so far are applied, and the unmaps of moves'
    /// sources that the kernel sends after each move.
    Events,
    /// `madvise(MADV_DONTNEED)` as the kernel runs it: its event is read
    /// and applied first, and the pages are zapped later, at [`Op::Zap`].
    RemoveLate(Pn, u64),
    /// The zaps of the removes so far happen.
    Zap,
    /// A scan reads which pages of a range are present (`pagemap`)...
    ScanRead(Pn, u64),
    /// ...and adopts them, maybe after other ops ran meanwhile.
    ScanAdopt,
    /// A mapping registered at once.
    Map(Pn, u64),
    /// A mapping no scan has registered yet, where the holes are: its
    /// pages are written without faults, and dropping or moving them sends
    /// no event. A scan whose range covers it registers it.
    MapUnseen(Pn, u64),
    Remap(Pn, Pn, u64),
    /// The memory map starts changing (ioctls answer EAGAIN) until the next op.
    Changing,
    /// `fork`: everything away comes back, as the manager's `fill_all`
    /// brings it. With `Some((k, from, to, n))`, the map starts changing
    /// after `k` fills, and what it waited for is an `mremap` of `n` pages
    /// from `from` to `to`, applied before the next pass.
    ForkFill(Option<(u32, Pn, Pn, u64)>),
    /// The program drops a mapped page and no event says so yet (an
    /// `madvise` racing a scan's adoption).
    DropUnseen(Pn),
    /// A read-ahead plans the page at `pn` (and reads it, if stored)
    /// without the engine's lock...
    AheadRead(Pn),
    /// ...and maps it, maybe after other ops changed the page meanwhile.
    AheadMap,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..SPACE, 1..u64::MAX).prop_map(|(p, v)| Op::Write(p, v)),
        3 => (0..SPACE).prop_map(Op::Read),
        2 => (1..8usize).prop_map(Op::EvictStart),
        2 => Just(Op::EvictRead),
        3 => Just(Op::EvictCommit { refuse: false }),
        1 => Just(Op::EvictCommit { refuse: true }),
        1 => (0..SPACE, 1..6u64).prop_map(|(p, n)| Op::Remove(p, n)),
        1 => (0..SPACE, 1..6u64).prop_map(|(p, n)| Op::Unmap(p, n)),
        1 => (0..SPACE, 1..6u64).prop_map(|(p, n)| Op::UnmapLate(p, n)),
        1 => Just(Op::Events),
        2 => (0..SPACE, 1..6u64).prop_map(|(p, n)| Op::RemoveLate(p, n)),
        1 => Just(Op::Zap),
        2 => (0..SPACE, 1..24u64).prop_map(|(p, n)| Op::ScanRead(p, n)),
        2 => Just(Op::ScanAdopt),
        1 => (0..SPACE, 1..6u64).prop_map(|(p, n)| Op::Map(p, n)),
        1 => (0..SPACE, 1..6u64).prop_map(|(p, n)| Op::MapUnseen(p, n)),
        1 => (0..SPACE, 0..SPACE, 1..6u64).prop_map(|(a, b, n)| Op::Remap(a, b, n)),
        1 => Just(Op::Changing),
        1 => Just(Op::ForkFill(None)),
        1 => (0..4u32, 0..SPACE, 0..SPACE, 1..6u64).prop_map(|(k, a, b, n)| Op::ForkFill(Some((k, a, b, n)))),
        1 => (0..SPACE).prop_map(Op::DropUnseen),
        1 => (0..SPACE).prop_map(Op::AheadRead),
        1 => Just(Op::AheadMap),
    ]
}

struct World {
    sim: Sim,
    store: Store,
    engine: Engine,
    /// The oracle: what each mapped page must read as (absent: zero).
    truth: HashMap<Pn, u64>,
    batch: Option<(Batch, Option<HashMap<u32, u64>>)>,
    /// Pages dropped behind the engine's back, still counted as resident by it.
    unseen: usize,
    /// A read-ahead between its plan (and its read of the store) and its mapping.
    ahead: Option<(Pn, Ahead, Box<[u8; PAGE]>)>,
    /// Unmaps the engine has not applied yet ([`Op::UnmapLate`]).
    late: Vec<(Pn, Pn)>,
    /// The unmaps of moves' sources, still to come ([`Op::Events`]): the
    /// kernel unmaps the source before the move's event, and sends this
    /// after it, so other changes to the map may come between; no fill or
    /// move succeeds until it is read ([`Sim::unread_unmaps`]).
    trailing: Vec<(Pn, Pn)>,
    /// Removes applied whose pages are not zapped yet ([`Op::RemoveLate`]),
    /// with when each was applied.
    zaps: Vec<(Pn, Pn, std::time::Instant)>,
    /// Pages a scan read as present, not adopted yet ([`Op::ScanRead`]).
    scan: Option<(u64, Vec<Pn>)>,
    /// Pages put in memory outside the engine (unit tests).
    outside: BTreeSet<Pn>,
    /// The time: each scan takes a sixteenth of [`DOOMED_FOR`].
    now: std::time::Instant,
}

impl World {
    fn new() -> Self {
        let sim = Sim::default();
        sim.mapped.borrow_mut().extend(0..SPACE);
        sim.registered.borrow_mut().extend(0..SPACE);
        Self {
            sim,
            store: Store::default(),
            engine: Engine::new(8, crate::readahead::MAX_WINDOW),
            truth: HashMap::new(),
            batch: None,
            unseen: 0,
            ahead: None,
            late: Vec::new(),
            trailing: Vec::new(),
            zaps: Vec::new(),
            scan: None,
            outside: BTreeSet::new(),
            now: std::time::Instant::now(),
        }
    }

    /// Touches `pn` as the program would: a missing page faults, and a
    /// fault that must retry is retried once the map stops changing.
    fn touch(&mut self, pn: Pn) {
        if self.sim.ptes.borrow().contains_key(&pn) {
            return;
        }
        let mut buf = [0u8; PAGE];
        let mut plan = self.engine.plan(pn);
        let mut served = self.engine.serve(&self.sim, &self.store, pn, &mut buf);
        if served == Served::Retry {
            self.sim.changing.set(false);
            self.flush_trailing();
            plan = self.engine.plan(pn);
            served = self.engine.serve(&self.sim, &self.store, pn, &mut buf);
        }
        assert_eq!(served, Served::Done, "fault at {pn}");
        assert!(self.sim.ptes.borrow().contains_key(&pn), "a served fault maps the page");
        if matches!(plan, FaultPlan::FromStore(_) | FaultPlan::Zero) {
            // As the manager's `read_ahead`: the pages that follow.
            let end = pn + self.engine.read_ahead_window(pn);
            let mut from = pn + 1;
            while let Some((next, ahead)) = self.engine.next_ahead(from..=end) {
                from = next + 1;
                if let Ahead::Stored(key) = ahead {
                    assert!(self.store.get_in_memory(key, &mut buf), "a stored page is in the store");
                }
                if !self.engine.serve_ahead(&self.sim, &self.store, next, ahead, &mut buf) {
                    break;
                }
                self.check_mapped(next);
            }
        }
    }

    /// A mapped page holds what the program last wrote there, or zeros.
    fn check_mapped(&self, pn: Pn) {
        assert_eq!(self.sim.ptes.borrow()[&pn], self.truth.get(&pn).copied().unwrap_or(0), "page {pn}");
    }

    fn mapped(&self, pn: Pn) -> bool {
        self.sim.mapped.borrow().contains(&pn)
    }

    fn registered(&self, pn: Pn) -> bool {
        self.sim.registered.borrow().contains(&pn)
    }

    /// The runs of registered pages in `[start, end)`: the parts of a
    /// change to the map that the engine hears of.
    fn registered_runs(&self, start: Pn, end: Pn) -> Vec<(Pn, Pn)> {
        let mut runs: Vec<(Pn, Pn)> = Vec::new();
        for pn in (start..end).filter(|&pn| self.registered(pn)) {
            match runs.last_mut() {
                Some((_, e)) if *e == pn => *e += 1,
                _ => runs.push((pn, pn + 1)),
            }
        }
        runs
    }

    /// `[start, end)` leaves the map: the engine forgets its registered
    /// runs now, or at the next [`Op::Events`] when `late`.
    fn unmap(&mut self, start: Pn, end: Pn, late: bool) {
        for (s, e) in self.registered_runs(start, end) {
            if late {
                self.late.push((s, e));
            } else {
                self.engine.forget(&self.store, s, e);
            }
        }
        self.zap(start, end - start);
        for pn in start..end {
            self.truth.remove(&pn);
            self.outside.remove(&pn);
            self.sim.mapped.borrow_mut().remove(&pn);
            self.sim.registered.borrow_mut().remove(&pn);
        }
    }

    fn zap(&self, start: Pn, n: u64) {
        let mut ptes = self.sim.ptes.borrow_mut();
        for pn in start..start + n {
            ptes.remove(&pn);
        }
    }

    /// Applies the unmaps whose events were pending.
    fn events(&mut self) {
        for (start, end) in std::mem::take(&mut self.late) {
            self.engine.forget(&self.store, start, end);
        }
    }

    /// The unmaps of moves' sources still to come are read and applied.
    fn flush_trailing(&mut self) {
        for (start, end) in std::mem::take(&mut self.trailing) {
            self.trailing_unmap(start, end);
        }
        self.sim.unread_unmaps.set(0);
    }

    /// The unmap of a move's source comes. A mapping made there since keeps
    /// its present pages, which the engine may no longer count.
    fn trailing_unmap(&mut self, start: Pn, end: Pn) {
        self.engine.forget(&self.store, start, end);
        for pn in start..end {
            if self.sim.ptes.borrow().contains_key(&pn) && self.engine.plan(pn) == FaultPlan::Zero {
                self.outside.insert(pn);
            }
        }
    }

    /// `pn` was put in memory outside the engine (before a scan registered
    /// its range): the engine's count is short of it until it is adopted.
    fn unseen_present(&mut self, pn: Pn) {
        assert!(self.sim.ptes.borrow().contains_key(&pn));
        self.outside.insert(pn);
    }

    /// Whether `pn` is in a remove whose zap is still to come: the program's
    /// thread is inside that `madvise`, and the page is not read meanwhile.
    fn zapping(&self, pn: Pn) -> bool {
        self.zaps.iter().any(|&(s, e, _)| (s..e).contains(&pn))
    }

    fn zap_now(&mut self) {
        let zaps = std::mem::take(&mut self.zaps);
        self.zap_ranges(zaps);
    }

    fn zap_ranges(&mut self, zaps: Vec<(Pn, Pn, std::time::Instant)>) {
        for (start, end, _) in zaps {
            for pn in start..end {
                // A page mapped through the engine since the remove's event
                // (read ahead with zeros) goes, unseen by the engine.
                if self.sim.ptes.borrow_mut().remove(&pn).is_some() && self.engine.plan(pn) == FaultPlan::Present {
                    self.unseen += 1;
                }
            }
        }
    }

    fn apply(&mut self, op: Op) {
        let changing = matches!(op, Op::Changing);
        // A `madvise` returns before its thread changes the map again.
        if matches!(
            op,
            Op::Map(..) | Op::Unmap(..) | Op::UnmapLate(..) | Op::Remap(..) | Op::Remove(..) | Op::ForkFill(_)
        ) {
            self.zap_now();
        }
        // Only the program's touches and the evictor's phases run while an
        // event is pending; whatever changes the map waits for it.
        if !matches!(
            op,
            Op::Write(..)
                | Op::Read(_)
                | Op::EvictStart(_)
                | Op::EvictRead
                | Op::EvictCommit { .. }
                | Op::UnmapLate(..)
        ) {
            self.events();
        }
        // The unmap of a move's source comes before the program's own drop
        // of that place (it is queued as soon as the move's event is read).
        if let Op::Unmap(start, n) | Op::UnmapLate(start, n) | Op::Remove(start, n) | Op::RemoveLate(start, n) = op {
            let end = (start + n).min(SPACE);
            let (due, kept) = std::mem::take(&mut self.trailing).into_iter().partition(|&(s, e)| s < end && start < e);
            self.trailing = kept;
            for (s, e) in due {
                self.trailing_unmap(s, e);
            }
            self.sim.unread_unmaps.set(self.trailing.len());
        }
        match op {
            Op::Write(pn, v) if self.mapped(pn) && !self.zapping(pn) => {
                if self.registered(pn) {
                    self.touch(pn);
                } else if !self.sim.ptes.borrow().contains_key(&pn) {
                    // The kernel gives the page; no fault comes.
                    self.outside.insert(pn);
                }
                self.sim.ptes.borrow_mut().insert(pn, v);
                self.truth.insert(pn, v);
            }
            Op::Read(pn) if self.mapped(pn) && !self.zapping(pn) => {
                if self.registered(pn) {
                    self.touch(pn);
                    self.check_mapped(pn);
                } else {
                    // The kernel's zero page where none is present.
                    let got = self.sim.ptes.borrow().get(&pn).copied().unwrap_or(0);
                    assert_eq!(got, self.truth.get(&pn).copied().unwrap_or(0), "unregistered page {pn}");
                }
            }
            Op::EvictStart(n) if self.batch.is_none() => {
                let mut b = Batch::default();
                let _ = b.move_out(&mut self.engine, &self.sim, n);
                self.batch = Some((b, None));
            }
            Op::EvictRead => {
                if let Some((_, snap @ None)) = &mut self.batch {
                    *snap = Some(self.sim.staging.borrow().clone());
                }
            }
            Op::EvictCommit { refuse } => {
                if let Some((b, Some(snap))) = self.batch.take_if(|(_, snap)| snap.is_some()) {
                    self.store.refuse.set(refuse);
                    for &slot in &b.slots {
                        // What the manager does under the engine's lock after
                        // reading the slots without it.
                        let Some(v) = snap.get(&slot) else { continue };
                        let Some(pn) = self.engine.in_slot(slot) else { continue };
                        let key = self.engine.new_key();
                        if self.store.put(key, &page_of(*v)) {
                            assert!(self.engine.stored_slot(slot, key));
                        } else {
                            self.sim.changing.set(false);
                            self.flush_trailing();
                            let outcome = self.engine.refused_slot(&self.sim, slot);
                            // Gone: unmapped, its event still pending.
                            assert!(
                                outcome == Outcome::Done
                                    || (outcome == Outcome::Gone
                                        && self.late.iter().any(|&(s, e)| (s..e).contains(&pn))),
                                "slot {slot}: {outcome:?}"
                            );
                        }
                    }
                    self.store.refuse.set(false);
                    // The agent drops the staging area.
                    for &slot in &b.slots {
                        assert!(self.engine.in_slot(slot).is_none(), "slot {slot} dropped with its page in it");
                    }
                    self.sim.staging.borrow_mut().clear();
                }
            }
            Op::Remove(start, n) => {
                let end = (start + n).min(SPACE);
                for (s, e) in self.registered_runs(start, end) {
                    self.engine.forget(&self.store, s, e);
                }
                self.zap(start, end - start);
                for pn in start..end {
                    self.truth.remove(&pn);
                    self.outside.remove(&pn);
                }
            }
            Op::Unmap(start, n) => self.unmap(start, (start + n).min(SPACE), false),
            Op::RemoveLate(start, n) => {
                let end = (start + n).min(SPACE);
                // Where no event is sent, nothing lets the map lock go
                // between the `madvise`'s start and its zap, so no scan
                // registers the range in between.
                for pn in start..end {
                    if !self.registered(pn) {
                        self.zap(pn, 1);
                        self.outside.remove(&pn);
                    }
                }
                for (s, e) in self.registered_runs(start, end) {
                    self.engine.forget_removed(&self.store, s, e, self.now);
                    self.zaps.push((s, e, self.now));
                }
                for pn in start..end {
                    self.truth.remove(&pn);
                }
            }
            Op::Zap => self.zap_now(),
            Op::Events => self.flush_trailing(),
            Op::ScanRead(start, n) if self.scan.is_none() => {
                let end = (start + n).min(SPACE);
                let epoch = self.engine.map_epoch();
                // The scan registers what it finds mapped, then reads `pagemap`.
                let mapped: Vec<Pn> = (start..end).filter(|&pn| self.mapped(pn)).collect();
                self.sim.registered.borrow_mut().extend(mapped);
                let ptes = self.sim.ptes.borrow();
                self.scan = Some((epoch, (start..end).filter(|pn| ptes.contains_key(pn)).collect()));
            }
            Op::ScanAdopt => {
                if let Some((epoch, found)) = self.scan.take() {
                    // What the engine assumes: a `madvise` zaps within
                    // `DOOMED_FOR` of its event.
                    self.now += DOOMED_FOR / 16;
                    let now = self.now;
                    let (due, waiting) =
                        std::mem::take(&mut self.zaps).into_iter().partition(|z| now - z.2 >= DOOMED_FOR);
                    self.zaps = waiting;
                    self.zap_ranges(due);
                    let ptes = self.sim.ptes.borrow().clone();
                    self.engine
                        .settle_doomed(self.now, |s, e| Some((s..e).filter(|pn| ptes.contains_key(pn)).collect()));
                    for pn in found {
                        // A page dropped since the read comes in as resident
                        // while it is not there, as `DropUnseen`'s.
                        if self.engine.adopt_since(epoch, pn) {
                            self.outside.remove(&pn);
                            if !ptes.contains_key(&pn) {
                                self.unseen += 1;
                            }
                        }
                    }
                }
            }
            Op::UnmapLate(start, n) => self.unmap(start, (start + n).min(SPACE), true),
            Op::Map(start, n) => {
                let end = (start + n).min(SPACE);
                for pn in start..end {
                    self.sim.mapped.borrow_mut().insert(pn);
                    self.sim.registered.borrow_mut().insert(pn);
                }
            }
            Op::MapUnseen(start, n) => {
                for pn in start..(start + n).min(SPACE) {
                    if !self.mapped(pn) {
                        self.sim.mapped.borrow_mut().insert(pn);
                    }
                }
            }
            Op::Remap(from, to, n) => {
                let n = n.min(SPACE - from).min(SPACE - to);
                let overlap = from < to + n && to < from + n;
                if n == 0 || overlap || !(from..from + n).all(|p| self.mapped(p)) {
                    return;
                }
                // One mapping moves, registered or not as a whole.
                let registered = self.registered(from);
                if (from..from + n).any(|p| self.registered(p) != registered) {
                    return;
                }
                let ptes: Vec<(Pn, Option<u64>, Option<u64>, bool)> = (from..from + n)
                    .map(|p| {
                        let pte = self.sim.ptes.borrow_mut().remove(&p);
                        self.sim.mapped.borrow_mut().remove(&p);
                        self.sim.registered.borrow_mut().remove(&p);
                        (p, pte, self.truth.remove(&p), self.outside.remove(&p))
                    })
                    .collect();
                // What was at the destination is unmapped: an event for its
                // registered part, within the move's own when it is registered.
                if !registered {
                    for (s, e) in self.registered_runs(to, to + n) {
                        self.engine.forget(&self.store, s, e);
                    }
                }
                self.zap(to, n);
                for p in to..to + n {
                    self.truth.remove(&p);
                    self.outside.remove(&p);
                    self.sim.registered.borrow_mut().remove(&p);
                }
                for (p, pte, t, outside) in ptes {
                    let new = p - from + to;
                    self.sim.mapped.borrow_mut().insert(new);
                    if registered {
                        self.sim.registered.borrow_mut().insert(new);
                    }
                    if let Some(v) = pte {
                        self.sim.ptes.borrow_mut().insert(new, v);
                    }
                    if let Some(v) = t {
                        self.truth.insert(new, v);
                    }
                    if outside {
                        self.outside.insert(new);
                    }
                }
                if registered {
                    self.engine.remap(&self.store, from, to, n);
                    self.trailing.push((from, from + n));
                    self.sim.unread_unmaps.set(self.trailing.len());
                }
            }
            Op::DropUnseen(pn) if self.sim.ptes.borrow().contains_key(&pn) => {
                self.sim.ptes.borrow_mut().remove(&pn);
                self.truth.remove(&pn);
                if !self.outside.remove(&pn) {
                    self.unseen += 1;
                }
            }
            Op::AheadRead(pn) if self.ahead.is_none() => {
                let mut buf = Box::new([0u8; PAGE]);
                match self.engine.plan(pn) {
                    FaultPlan::FromStore(key) => {
                        assert!(self.store.get(key, &mut buf));
                        self.ahead = Some((pn, Ahead::Stored(key), buf));
                    }
                    FaultPlan::Zero if self.mapped(pn) => self.ahead = Some((pn, Ahead::Zeros, buf)),
                    _ => {}
                }
            }
            Op::AheadMap => {
                if let Some((pn, ahead, mut buf)) = self.ahead.take() {
                    if self.engine.serve_ahead(&self.sim, &self.store, pn, ahead, &mut buf) {
                        self.check_mapped(pn);
                    }
                }
            }
            Op::ForkFill(mut change) => {
                let mut buf = [0u8; PAGE];
                self.sim.fills_left.set(change.map(|(k, ..)| k));
                loop {
                    match self.engine.bring_back(&self.sim, &self.store, &mut buf) {
                        BroughtBack::Done { lost } => {
                            assert_eq!(lost, 0);
                            // Fewer fills than `k` were needed: nothing changed.
                            self.sim.fills_left.set(None);
                            break;
                        }
                        BroughtBack::Retry => {
                            // The filler drops the engine; the events come
                            // and are applied; it passes again.
                            self.sim.fills_left.set(None);
                            self.sim.changing.set(false);
                            self.flush_trailing();
                            if let Some((_, from, to, n)) = change.take() {
                                self.apply(Op::Remap(from, to, n));
                            }
                        }
                    }
                }
                for pn in self.engine.away() {
                    assert!(!self.mapped(pn), "page {pn} is still away when the fork goes on");
                }
                let present: Vec<Pn> = self.sim.ptes.borrow().keys().copied().collect();
                for pn in present {
                    self.check_mapped(pn);
                }
            }
            _ => {}
        }
        self.sim.changing.set(changing);
        self.check_counts();
    }

    fn check_counts(&self) {
        let resident = usize::try_from(self.engine.resident()).unwrap();
        // Pages still there for a zap to come are no longer the engine's,
        // unless it mapped them again since; nor are those put there outside it.
        let ptes = self
            .sim
            .ptes
            .borrow()
            .keys()
            .filter(|&&pn| {
                (!self.zapping(pn) && !self.outside.contains(&pn)) || self.engine.plan(pn) == FaultPlan::Present
            })
            .count();
        // Resident pages of a pending unmap are still counted by the engine.
        let late: usize = self.late.iter().map(|&(s, e)| usize::try_from(e - s).unwrap()).sum();
        assert!(
            resident >= ptes && resident <= ptes + self.unseen + late,
            "resident pages: engine {resident}, mapped {ptes}"
        );
        assert_eq!(usize::try_from(self.engine.stored()).unwrap(), self.store.pages.borrow().len(), "stored pages");
    }

    fn check_all(&mut self) {
        self.apply(Op::Events);
        self.zap_now();
        self.sim.changing.set(false);
        let mapped: Vec<Pn> = self.sim.mapped.borrow().iter().copied().collect();
        for pn in mapped {
            self.apply(Op::Read(pn));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn every_read_sees_the_last_write_or_zero(ops in proptest::collection::vec(op(), 1..200)) {
        let mut w = World::new();
        for op in ops {
            w.apply(op);
        }
        w.apply(Op::EvictRead);
        w.apply(Op::EvictCommit { refuse: false });
        w.check_all();
    }
}

#[test]
fn the_hand_spares_a_page_faulted_back_since_its_last_pass() {
    let mut w = World::new();
    for pn in 0..4 {
        w.apply(Op::Write(pn, pn + 1));
    }
    // The first pass clears the bits set by the first touches; the second
    // takes the oldest pages.
    w.apply(Op::EvictStart(2));
    assert_eq!((w.engine.in_slot(0), w.engine.in_slot(1)), (Some(0), Some(1)));
    w.apply(Op::EvictRead);
    w.apply(Op::EvictCommit { refuse: false });
    // Page 0 comes back through a fault: referenced again, behind 2 and 3.
    w.apply(Op::Read(0));
    w.apply(Op::EvictStart(2));
    assert_eq!((w.engine.in_slot(0), w.engine.in_slot(1)), (Some(2), Some(3)), "the page faulted back is spared");
    w.apply(Op::EvictRead);
    w.apply(Op::EvictCommit { refuse: false });
    w.check_all();
}

#[test]
fn a_fork_whose_fill_meets_an_mremap_brings_back_the_pages_it_moved() {
    let mut w = World::new();
    for pn in 0..4 {
        w.apply(Op::Write(pn, pn + 1));
    }
    // Two passes of the hand: the first clears the bits the writes set.
    for _ in 0..2 {
        for op in [Op::EvictStart(4), Op::EvictRead, Op::EvictCommit { refuse: false }] {
            w.apply(op);
        }
    }
    assert_eq!(w.engine.away().len(), 4);
    // Page 0 comes back, then the map changes: pages 0..4 move to 20..24,
    // where the first pass's list never looked.
    w.apply(Op::ForkFill(Some((1, 0, 20, 4))));
    assert!(w.engine.away().is_empty(), "away at the fork: {:?}", w.engine.away());
    for pn in 20..24 {
        assert_eq!(w.sim.ptes.borrow().get(&pn).copied(), Some(pn - 19), "page {pn}");
    }
    w.check_all();
}

#[test]
fn a_page_in_flight_comes_straight_back_on_a_fault() {
    let mut w = World::new();
    w.apply(Op::Write(3, 7));
    w.apply(Op::EvictStart(1));
    w.apply(Op::EvictStart(1)); // a second start is ignored while one runs
    w.apply(Op::EvictStart(1));
    assert_eq!(w.engine.in_slot(0), Some(3));
    w.apply(Op::Write(3, 9));
    assert_eq!(w.engine.stats().slot_returns, 1);
    w.apply(Op::EvictRead);
    w.apply(Op::EvictCommit { refuse: false });
    assert_eq!(w.engine.stored(), 0, "the page came back before its batch stored it");
    w.check_all();
}

#[test]
fn pauses_nest_so_the_first_fork_back_does_not_restart_eviction_under_the_second() {
    let mut w = World::new();
    for pn in 0..4 {
        w.apply(Op::Write(pn, pn + 1));
    }
    let mut victims = Vec::new();
    w.engine.pause();
    w.engine.pause();
    w.engine.resume();
    w.engine.victims(4, &mut victims);
    assert!(victims.is_empty(), "one fork is still between its fill and its return");
    w.engine.resume();
    // Two passes: the first clears the bits the writes set.
    w.engine.victims(4, &mut victims);
    assert_eq!(victims.len(), 4, "the last fork returned");
}

#[test]
fn a_walk_through_stored_pages_reads_ahead_and_every_page_reads_right() {
    let mut w = World::new();
    // Written downwards: no stream forms, so no zeros are mapped ahead.
    for pn in (0..16).rev() {
        w.apply(Op::Write(pn, pn + 100));
    }
    // Two passes of the hand: the first clears the bits the writes set.
    for _ in 0..4 {
        w.apply(Op::EvictStart(8));
        w.apply(Op::EvictRead);
        w.apply(Op::EvictCommit { refuse: false });
    }
    assert_eq!(w.engine.stored(), 16);
    for pn in 0..16 {
        w.apply(Op::Read(pn));
    }
    let s = w.engine.stats();
    // Faults at 0 (no stream yet), 1 (window 2: 2-3), 4 (4: 5-8), 9 (8: 10-15).
    assert_eq!((s.store_fills, s.read_ahead), (4, 12));
    w.check_all();
}

#[test]
fn a_read_ahead_that_lost_its_race_maps_nothing() {
    let mut w = World::new();
    w.apply(Op::Write(5, 1));
    for _ in 0..2 {
        w.apply(Op::EvictStart(1));
        w.apply(Op::EvictRead);
        w.apply(Op::EvictCommit { refuse: false });
    }
    w.apply(Op::AheadRead(5));
    w.apply(Op::Write(5, 2)); // the program faulted it back and wrote it,
    for _ in 0..2 {
        // and it went away again, under a new key
        w.apply(Op::EvictStart(1));
        w.apply(Op::EvictRead);
        w.apply(Op::EvictCommit { refuse: false });
    }
    assert_eq!(w.engine.stored(), 1);
    w.apply(Op::AheadMap);
    assert_eq!(w.engine.stats().read_ahead, 0);
    w.check_all();
}

#[test]
fn a_stream_of_first_touches_is_filled_with_zeros_ahead_and_stops_at_the_mapping_end() {
    let mut w = World::new();
    for pn in 0..16 {
        w.apply(Op::Write(pn, pn + 1));
    }
    let s = w.engine.stats();
    // Faults at 0 (no stream yet), 1 (window 2: 2-3), 4 (4: 5-8), 9 (8: 10-17).
    assert_eq!((s.zero_fills, s.zeros_ahead), (4, 14));
    // A stream that runs into the end of the mapping maps nothing past it.
    for pn in SPACE - 8..SPACE {
        w.apply(Op::Write(pn, pn + 1));
    }
    assert!(w.sim.ptes.borrow().keys().all(|&pn| pn < SPACE));
    w.check_all();
}

#[test]
fn zeros_ahead_never_cover_a_page_the_program_has_or_the_store_holds() {
    let mut w = World::new();
    // 3 is stored, 4 resident: a stream through 0..8 reads 3 back and passes 4 by.
    for pn in [3, 4] {
        w.apply(Op::Write(pn, 100 + pn));
    }
    for _ in 0..2 {
        w.apply(Op::EvictStart(1));
        w.apply(Op::EvictRead);
        w.apply(Op::EvictCommit { refuse: false });
    }
    w.apply(Op::Write(4, 104));
    assert!(matches!(w.engine.plan(3), FaultPlan::FromStore(_)));
    for pn in 0..8 {
        w.apply(Op::Read(pn));
    }
    let s = w.engine.stats();
    assert_eq!(s.read_ahead, 1, "3 came back ahead of its fault");
    w.check_all();
}

#[test]
fn a_refused_page_whose_address_is_gone_leaves_its_slot_to_the_next_batch() {
    let mut w = World::new();
    for pn in 0..2 {
        w.apply(Op::Write(pn, pn + 1));
    }
    // The first pass of the hand clears the bits the writes set.
    for op in [Op::EvictStart(2), Op::EvictRead, Op::EvictCommit { refuse: false }, Op::Read(0), Op::Read(1)] {
        w.apply(op);
    }
    w.apply(Op::EvictStart(1));
    let first = w.engine.in_slot(0).expect("a page in slot 0");
    // The program unmaps it; the store refuses it before the event is applied.
    w.apply(Op::UnmapLate(first, 1));
    w.apply(Op::EvictRead);
    w.apply(Op::EvictCommit { refuse: true });
    assert_eq!(w.engine.in_slot(0), None, "the page that could not go back still names slot 0");
    // The next batch's page takes slot 0; then the unmap event is applied.
    w.apply(Op::EvictStart(1));
    let second = w.engine.in_slot(0).expect("the other page in slot 0");
    assert_ne!(first, second);
    w.apply(Op::Events);
    assert_eq!(w.engine.in_slot(0), Some(second), "the unmap of the first page cleared the second's slot");
    w.apply(Op::EvictRead);
    w.apply(Op::EvictCommit { refuse: false });
    w.check_all();
}

#[test]
fn a_page_dropped_with_its_zap_still_to_come_is_not_adopted_nor_evicted() {
    let mut w = World::new();
    // A page the engine never saw (touched before its range was registered).
    w.sim.ptes.borrow_mut().insert(5, 9);
    w.truth.insert(5, 9);
    w.unseen_present(5);
    // A scan reads it present; the program drops it: the event is applied,
    // the zap is still to come; then the scan adopts what it read.
    w.apply(Op::ScanRead(5, 1));
    w.apply(Op::RemoveLate(5, 1));
    w.apply(Op::ScanAdopt);
    assert_eq!(w.engine.plan(5), FaultPlan::Zero, "a doomed page was adopted");
    assert_eq!(w.engine.stats().adopt_doomed, 1);
    // Nothing to evict; the zap comes, and the page reads as zeros.
    w.apply(Op::EvictStart(4));
    assert_eq!(w.engine.in_slot(0), None);
    w.apply(Op::Zap);
    w.apply(Op::Read(5));
    // Once the zap is seen done, the range is no longer doomed.
    w.engine.settle_doomed(w.now, |_, _| Some(Vec::new()));
    w.sim.ptes.borrow_mut().insert(7, 3);
    w.truth.insert(7, 3);
    w.unseen_present(7);
    assert!(w.engine.adopt(7));
    w.check_all();
}

#[test]
fn a_doomed_range_that_is_never_zapped_ends_after_its_time() {
    // MADV_FREE: the same event as MADV_DONTNEED, and its pages stay.
    let mut w = World::new();
    w.engine.forget_removed(&w.store, 10, 12, w.now);
    for i in 1..16 {
        w.engine.settle_doomed(w.now + DOOMED_FOR * i / 16, |s, e| Some((s..e).collect()));
    }
    assert!(!w.engine.adopt(10), "still doomed before DOOMED_FOR");
    assert_eq!(w.engine.plan(10), FaultPlan::Zero);
    // The first settle after it takes its pages as the program's again.
    w.engine.settle_doomed(w.now + DOOMED_FOR, |s, e| Some((s..e).collect()));
    assert_eq!((w.engine.plan(10), w.engine.plan(11)), (FaultPlan::Present, FaultPlan::Present));
    assert_eq!(w.engine.resident(), 2);
}

#[test]
fn a_page_found_before_its_range_was_unmapped_is_not_adopted() {
    let mut e = Engine::new(8, 0);
    let store = Store::default();
    let epoch = e.map_epoch();
    // The scan read pages 5 and 20 present; then the program unmapped 4..8
    // (and may have mapped it anew, unregistered) before the scan adopted.
    e.forget(&store, 4, 8);
    assert!(!e.adopt_since(epoch, 5), "a page of a range unmapped since the scan began");
    assert!(e.adopt_since(epoch, 20), "a page elsewhere");
    // An mremap's source counts as well.
    let epoch = e.map_epoch();
    e.remap(&store, 30, 40, 4);
    assert!(!e.adopt_since(epoch, 31));
    // A scan that began after the unmap adopts there.
    assert!(e.adopt_since(e.map_epoch(), 5));
    assert_eq!(e.stats().adopt_unmapped, 2);
    assert_eq!(e.stats().adopted, 2);
}

#[test]
fn a_scan_older_than_every_kept_unmap_adopts_nothing() {
    let mut e = Engine::new(8, 0);
    let store = Store::default();
    let epoch = e.map_epoch();
    for i in 0..=MAX_UNMAPPED as u64 {
        e.forget(&store, 1000 + i, 1001 + i);
    }
    assert!(!e.adopt_since(epoch, 5), "the unmaps since the scan began are no longer all known");
    assert!(e.adopt_since(e.map_epoch() - 1, 5));
}

#[test]
fn a_page_written_in_a_mapping_no_scan_registered_yet_is_left_to_the_next_scan() {
    let mut w = World::new();
    w.apply(Op::Write(30, 1));
    // A scan reads 30 present; meanwhile the program unmaps its range, maps
    // a new one there and writes it without a fault.
    w.apply(Op::ScanRead(28, 4));
    w.apply(Op::Unmap(28, 4));
    w.apply(Op::MapUnseen(28, 4));
    w.apply(Op::Write(30, 2));
    w.apply(Op::ScanAdopt);
    assert_eq!(w.engine.plan(30), FaultPlan::Zero, "adopted from a range unmapped during the scan");
    assert_eq!(w.engine.stats().adopt_unmapped, 1);
    for _ in 0..2 {
        for op in [Op::EvictStart(4), Op::EvictRead, Op::EvictCommit { refuse: false }] {
            w.apply(op);
        }
    }
    assert_eq!(w.engine.stored(), 0, "a page of a range that faults nothing was evicted");
    w.apply(Op::Read(30));
    // The next scan registers the new mapping and adopts the page.
    w.apply(Op::ScanRead(28, 4));
    w.apply(Op::ScanAdopt);
    assert_eq!(w.engine.plan(30), FaultPlan::Present);
    w.check_all();
}

#[test]
fn the_unmap_a_move_sends_for_its_source_spares_what_moved_there_since() {
    let mut w = World::new();
    for pn in (0..4).chain(30..34) {
        w.apply(Op::Write(pn, pn + 1));
    }
    // Two passes of the hand: the first clears the bits the writes set.
    for _ in 0..2 {
        for op in [Op::EvictStart(8), Op::EvictRead, Op::EvictCommit { refuse: false }] {
            w.apply(op);
        }
    }
    assert_eq!(w.engine.stored(), 8);
    // One thread moves 0..4 away; another moves 30..34 into the place it
    // left; then the kernel's unmap of the first move's source comes.
    w.apply(Op::Remap(0, 20, 4));
    w.apply(Op::Remap(30, 0, 4));
    w.apply(Op::Events);
    assert_eq!(w.engine.stats().unmap_after_move, 2);
    assert_eq!(w.engine.stored(), 8, "the unmap of a move's source dropped the pages moved there since");
    w.check_all();
}

#[test]
fn a_source_left_mapped_by_a_move_drops_what_the_program_put_there_at_its_unmap() {
    let mut w = World::new();
    w.apply(Op::Write(2, 3));
    // MREMAP_DONTUNMAP: the source stays mapped and no unmap follows the
    // move; the program writes there, and that page goes to the store.
    w.apply(Op::Remap(0, 20, 4));
    w.trailing.clear();
    w.sim.unread_unmaps.set(0);
    w.apply(Op::Map(0, 4));
    w.apply(Op::Write(1, 5));
    for _ in 0..2 {
        for op in [Op::EvictStart(8), Op::EvictRead, Op::EvictCommit { refuse: false }] {
            w.apply(op);
        }
    }
    assert!(matches!(w.engine.plan(1), FaultPlan::FromStore(_)));
    // Its unmap, taken for the move's, drops that page all the same.
    w.apply(Op::Unmap(0, 4));
    assert_eq!(w.engine.stats().unmap_after_move, 1);
    assert_eq!(w.engine.plan(1), FaultPlan::Zero);
    w.apply(Op::Map(0, 4));
    w.check_all();
}

#[test]
fn the_unmap_of_a_source_long_after_its_move_drops_everything_there() {
    for (others, kept) in [(0, 1), (TRAILING_WITHIN, 0)] {
        let mut e = Engine::new(8, 0);
        let store = Store::default();
        assert!(e.adopt(30));
        // 0..4 moves away, then 30..34 (one page) moves into its place.
        e.remap(&store, 0, 20, 4);
        e.remap(&store, 30, 0, 4);
        for i in 0..others {
            e.forget(&store, 1000 + i, 1001 + i);
        }
        e.forget(&store, 0, 4);
        assert_eq!(e.stats().unmap_after_move, kept, "{others} unmaps between");
        assert_eq!(e.resident(), kept, "{others} unmaps between");
    }
}
