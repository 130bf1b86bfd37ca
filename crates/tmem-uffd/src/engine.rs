//! The eviction and fault engine of one managed process: where each page
//! of its registered memory is, and the steps that move it, written against
//! two traits so that the same code runs on a real process ([`Mem`] over a
//! userfaultfd) and on the model in the tests.
//!
//! A page is in one of three places, and a write can never be lost between
//! them:
//! - **resident**: mapped in the program; on the CLOCK ring.
//! - **in flight**: moved out of the program by `UFFDIO_MOVE` into a slot of
//!   the staging area (in the program, owned by the agent), not yet stored.
//!   The move is atomic: a write after it faults, and the fault puts the
//!   page straight back from its slot.
//! - **stored**: compressed in the store under a key of this engine.
//!
//! Pages the engine has never seen are the kernel's zeros. The program's
//! own `munmap`, `madvise(MADV_DONTNEED)` and `mremap` arrive as events;
//! [`Engine::forget`] and [`Engine::remap`] drop or move what they concern,
//! so that a later fault gets zeros exactly where the kernel would give them.
//!
//! Eviction uses a CLOCK hand over the resident pages. A page is referenced
//! when it is faulted in, or filled with zeros ahead of such a fault
//! (userspace sees no accessed bits), so a page that came back recently
//! survives one pass of the hand.

use std::collections::VecDeque;

mod pages;
mod recent;

use crate::readahead::ReadAhead;
pub use crate::stats::EngineStats;
use crate::sys::{Outcome, PAGE};
use pages::Pages;
use recent::Recent;

/// A page number: an address divided by the page size.
pub type Pn = u64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Page {
    Resident {
        referenced: bool,
    },
    /// Mapped but not movable (shared with a `fork` child, pinned): not
    /// counted as resident until a scan finds it exclusive again.
    Pinned,
    InFlight {
        slot: u32,
    },
    Stored {
        key: u64,
    },
}

/// What serving a fault takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultPlan {
    /// Never seen (or dropped by the program): a page of zeros.
    Zero,
    /// Decompress this key from the store.
    FromStore(u64),
    /// Move the page back from this staging slot.
    FromSlot(u32),
    /// The engine holds it as mapped, yet it faulted: either another fault
    /// on the page was served first, or the program dropped it in a way no
    /// event reported yet (an `madvise` racing a scan's adoption). Either
    /// way its contents are zeros or already there: fill zeros, and a page
    /// that is there makes the fill fail harmlessly.
    Present,
}

/// What read-ahead maps at a page ([`Engine::next_ahead`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ahead {
    /// The page stored under this key.
    Stored(u64),
    /// Zeros: the engine never saw the page, so the kernel would give zeros.
    Zeros,
}

/// The program's memory, as the engine acts on it.
pub trait Mem {
    /// Maps a copy of `page` at `pn` and wakes its waiters.
    fn fill(&self, pn: Pn, page: &[u8; PAGE]) -> Outcome;
    /// Moves page `pages[i]` into staging slot `i`, for each `i`, and says
    /// how each went in `out[i]`.
    fn move_out(&self, pages: &[Pn], out: &mut [Outcome]);
    /// Puts the page in staging slot `slot` back at `pn` and wakes its
    /// waiters; `Busy` when the slot cannot be read.
    fn move_back(&self, slot: u32, pn: Pn) -> Outcome;
    /// Wakes threads waiting at `pn` (its page is already there).
    fn wake(&self, pn: Pn);
}

/// The store under the engine. A `get` that misses is a lost page.
pub trait Backing {
    /// Stores `page` under `key`; false when the store refused it (full).
    fn put(&self, key: u64, page: &[u8; PAGE]) -> bool;
    /// Reads the page under `key`; false when it is not there.
    fn get(&self, key: u64, out: &mut [u8; PAGE]) -> bool;
    /// As `get`, but false also when reading the page would wait on a lower
    /// tier's I/O (read-ahead's read).
    fn get_in_memory(&self, key: u64, out: &mut [u8; PAGE]) -> bool;
    fn remove(&self, key: u64);
}

/// What serving one fault came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Served {
    /// Mapped (or the page had already come back).
    Done,
    /// The memory map is changing: read the pending events, then retry.
    Retry,
    /// The address is no longer mapped: an unmap event is on its way.
    Gone,
    /// The store did not have a page it holds for this address.
    Lost,
}

/// What one pass of [`Engine::bring_back`] came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BroughtBack {
    /// Every page away when the pass began is back, or no longer mapped;
    /// `lost` of them the store did not have.
    Done { lost: u64 },
    /// The memory map is changing: apply the events read, then pass again.
    Retry,
}

/// How long a doomed range waits for its zap before its pages are taken
/// as never zapped ([`Engine::settle_doomed`]). A `madvise` goes from its
/// event to its zap in microseconds unless its thread is preempted in
/// between; scans can come every few milliseconds when the program
/// touches memory fast, so the wait is a time, not a count of scans.
pub const DOOMED_FOR: std::time::Duration = std::time::Duration::from_secs(1);
/// Most doomed ranges kept; a new one pushes out the oldest.
const MAX_DOOMED: usize = 1024;

/// Most ranges kept in [`Engine::unmapped`]; a scan that began before the
/// oldest kept adopts nothing.
const MAX_UNMAPPED: usize = 1024;

/// Most moves' sources kept waiting for their unmap. A move counts two
/// ranges in [`Engine::map_epoch`], so at most half this many are ever
/// within [`TRAILING_WITHIN`]; `remap` drops the older ones.
const MAX_MOVED_FROM: usize = 256;

/// How many ranges may be dropped or moved away ([`Engine::map_epoch`])
/// between an `mremap`'s move and the unmap of its source that the kernel
/// sends after it, for that unmap to be taken as the move's
/// ([`Engine::forget`]). The kernel queues it as soon as the move's event
/// is read; in the stress job (8 threads) it came at most 5 events later,
/// 982 times of 982.
const TRAILING_WITHIN: u64 = MAX_MOVED_FROM as u64;

/// The source of a move (`remap`) whose unmap is still to come.
#[derive(Clone, Debug)]
struct MovedFrom {
    /// [`Engine::map_epoch`] just after the move.
    epoch: u64,
    start: Pn,
    end: Pn,
    /// The parts of it that later moves took their pages to.
    moved_in: Vec<(Pn, Pn)>,
}

/// A range the program dropped with `madvise`, its zap maybe still to come.
#[derive(Clone, Copy, Debug)]
struct Doomed {
    start: Pn,
    end: Pn,
    /// When its event was applied.
    since: std::time::Instant,
}

/// Where every page of one process is.
#[derive(Debug)]
pub struct Engine {
    pages: Pages,
    /// CLOCK ring of resident pages; entries whose page left are skipped.
    clock: VecDeque<Pn>,
    /// Staging slot → the page in it, `None` once it came back or was dropped.
    slots: Vec<Option<Pn>>,
    resident: u64,
    stored: u64,
    /// Pages that became `Pinned`, to retry later (some may have left since).
    pinned: Vec<Pn>,
    next_key: u64,
    /// Pauses in force: `fork`s between their fill and their return.
    pauses: u32,
    /// The program's sequential streams, for read-ahead.
    ahead: ReadAhead,
    /// Ranges the program dropped with `madvise` whose pages may still be
    /// there: the kernel reports the drop before it zaps the pages, so a
    /// page present in such a range may be doomed. A scan must not adopt
    /// it: evicted before its zap, it would come back with its old data
    /// where the program now reads zeros ([`Engine::settle_doomed`]).
    /// Oldest first.
    doomed: Recent<Doomed>,
    /// The ranges dropped or moved away (`forget`, `remap`'s source), each
    /// numbered from 1, oldest first: a scan adopts
    /// no page in one dropped after it began ([`Engine::adopt_since`]).
    unmapped: Recent<(u64, Pn, Pn)>,
    /// Sources of moves (`remap`) whose unmap is still to come, oldest
    /// first, none older than [`TRAILING_WITHIN`].
    moved_from: Recent<MovedFrom>,
    stats: EngineStats,
}

impl Engine {
    /// An engine with `slots` staging slots, reading ahead at most
    /// `read_ahead` pages after a fault.
    #[must_use]
    pub fn new(slots: u32, read_ahead: u64) -> Self {
        Self {
            pages: Pages::default(),
            clock: VecDeque::new(),
            slots: vec![None; slots as usize],
            resident: 0,
            stored: 0,
            pinned: Vec::new(),
            next_key: 0,
            pauses: 0,
            ahead: ReadAhead::new(read_ahead),
            doomed: Recent::new(MAX_DOOMED),
            unmapped: Recent::new(MAX_UNMAPPED),
            moved_from: Recent::new(MAX_MOVED_FROM),
            stats: EngineStats::default(),
        }
    }

    #[must_use]
    pub fn resident(&self) -> u64 {
        self.resident
    }

    #[must_use]
    pub fn stored(&self) -> u64 {
        self.stored
    }

    #[must_use]
    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    /// Stops eviction until as many [`Engine::resume`]s (a `fork` between
    /// its fill and its return). Pauses nest: glibc runs two threads'
    /// `fork` preparations at once, then their forks one after the other,
    /// and the first to return must not let eviction go on under the second.
    pub fn pause(&mut self) {
        self.pauses += 1;
    }

    /// Ends one [`Engine::pause`].
    pub fn resume(&mut self) {
        self.pauses = self.pauses.saturating_sub(1);
    }

    #[must_use]
    pub fn plan(&self, pn: Pn) -> FaultPlan {
        match self.pages.get(pn) {
            None => FaultPlan::Zero,
            Some(Page::Resident { .. } | Page::Pinned) => FaultPlan::Present,
            Some(Page::InFlight { slot }) => FaultPlan::FromSlot(slot),
            Some(Page::Stored { key }) => FaultPlan::FromStore(key),
        }
    }

    /// Serves a fault at `pn`; `buf` is the caller's page buffer.
    pub fn serve(&mut self, mem: &impl Mem, backing: &impl Backing, pn: Pn, buf: &mut [u8; PAGE]) -> Served {
        let plan = self.plan(pn);
        if let FaultPlan::FromStore(key) = plan {
            if !backing.get(key, buf) {
                return Served::Lost;
            }
        }
        self.serve_planned(mem, backing, pn, plan, buf)
    }

    /// Serves a fault at `pn` by `plan`, which must be [`Engine::plan`]'s
    /// now; for [`FaultPlan::FromStore`], `buf` already holds the page.
    /// A caller that reads the store without the engine's lock (so that
    /// faults of several threads decompress at once) plans, reads, locks
    /// again and comes here if the plan still holds: keys are never reused,
    /// so an unchanged plan means the page read is still the page.
    pub fn serve_planned(
        &mut self,
        mem: &impl Mem,
        backing: &impl Backing,
        pn: Pn,
        plan: FaultPlan,
        buf: &mut [u8; PAGE],
    ) -> Served {
        debug_assert_eq!(self.plan(pn), plan, "planned under another state");
        let outcome = match plan {
            FaultPlan::Zero | FaultPlan::Present => {
                buf.fill(0);
                mem.fill(pn, buf)
            }
            FaultPlan::FromStore(_) => mem.fill(pn, buf),
            FaultPlan::FromSlot(slot) => mem.move_back(slot, pn),
        };
        match outcome {
            Outcome::Done => {
                match plan {
                    FaultPlan::Zero => self.stats.zero_fills += 1,
                    FaultPlan::Present => {
                        self.stats.dropped_unseen += 1;
                        if self.pages.set_referenced(pn, true).is_some() {
                            return Served::Done;
                        }
                    }
                    FaultPlan::FromStore(key) => {
                        backing.remove(key);
                        self.stored -= 1;
                        self.stats.store_fills += 1;
                    }
                    FaultPlan::FromSlot(slot) => {
                        self.slots[slot as usize] = None;
                        self.stats.slot_returns += 1;
                    }
                }
                self.make_resident(pn, true);
                Served::Done
            }
            Outcome::Retry => Served::Retry,
            Outcome::Gone | Outcome::Busy if plan == FaultPlan::Present => {
                mem.wake(pn);
                Served::Done
            }
            Outcome::Gone | Outcome::Busy => Served::Gone,
        }
    }

    /// A fault at `pn` was served from the store or with zeros: how many
    /// pages after it to map ahead ([`ReadAhead`]).
    pub fn read_ahead_window(&mut self, pn: Pn) -> u64 {
        self.ahead.window(pn)
    }

    /// The first page of `pages` that read-ahead maps, and what it maps
    /// there: resident and in-flight pages are passed over. A page the
    /// engine never saw gets zeros, as its fault would (a fill past the end
    /// of the mapping fails, and that ends the window).
    #[must_use]
    pub fn next_ahead(&self, pages: std::ops::RangeInclusive<Pn>) -> Option<(Pn, Ahead)> {
        pages.into_iter().find_map(|pn| match self.plan(pn) {
            FaultPlan::FromStore(key) => Some((pn, Ahead::Stored(key))),
            FaultPlan::Zero => Some((pn, Ahead::Zeros)),
            FaultPlan::Present | FaultPlan::FromSlot(_) => None,
        })
    }

    /// Maps the page at `pn` ahead of a fault near it: for
    /// [`Ahead::Stored`], `buf` holds the page under its key (read while
    /// the engine was free, as for [`Engine::serve_planned`]); for
    /// [`Ahead::Zeros`], `buf` is overwritten with zeros. A stored page
    /// comes in unreferenced: if the program does not touch it, it is the
    /// hand's first victim. Zeros come in referenced, as a first touch's
    /// do: the program is writing its fresh memory in order, and what it
    /// writes there is its newest data. False, and nothing changed, when
    /// `pn` no longer holds what was planned, or the fill failed (the map
    /// is changing, or `pn` is not mapped).
    pub fn serve_ahead(
        &mut self,
        mem: &impl Mem,
        backing: &impl Backing,
        pn: Pn,
        ahead: Ahead,
        buf: &mut [u8; PAGE],
    ) -> bool {
        let planned = match ahead {
            Ahead::Stored(key) => FaultPlan::FromStore(key),
            Ahead::Zeros => FaultPlan::Zero,
        };
        if self.plan(pn) != planned {
            return false;
        }
        if ahead == Ahead::Zeros {
            buf.fill(0);
        }
        if mem.fill(pn, buf) != Outcome::Done {
            return false;
        }
        match ahead {
            Ahead::Stored(key) => {
                backing.remove(key);
                self.stored -= 1;
                self.stats.read_ahead += 1;
            }
            Ahead::Zeros => self.stats.zeros_ahead += 1,
        }
        self.make_resident(pn, ahead == Ahead::Zeros);
        true
    }

    fn make_resident(&mut self, pn: Pn, referenced: bool) {
        self.pages.insert(pn, Page::Resident { referenced });
        self.resident += 1;
        self.clock.push_back(pn);
    }

    /// Takes in a page that a scan found present; false if the engine knew
    /// it, or if the program dropped it and its zap may be still to come.
    pub fn adopt(&mut self, pn: Pn) -> bool {
        if self.doomed.iter().any(|d| (d.start..d.end).contains(&pn)) {
            self.stats.adopt_doomed += 1;
            return false;
        }
        match self.pages.get(pn) {
            Some(Page::Pinned) => {}
            Some(_) => return false,
            None => self.stats.adopted += 1,
        }
        self.make_resident(pn, false);
        true
    }

    /// How many ranges have been dropped or moved away: a scan takes it
    /// before it reads the maps, for [`Engine::adopt_since`].
    #[must_use]
    pub fn map_epoch(&self) -> u64 {
        self.unmapped.newest().map_or(0, |&(n, ..)| n)
    }

    /// As [`Engine::adopt`], for a page that a scan which began at `epoch`
    /// ([`Engine::map_epoch`]) found present; false, and not adopted, when
    /// its range was dropped or moved away since.
    ///
    /// Such a page may no longer be the page the scan saw: the program
    /// unmapped the range, and a new mapping at the same place (not yet
    /// registered) holds a page there that the program wrote without a
    /// fault. Adopted, it would be evicted out of a range that faults
    /// nothing: the program would read the kernel's zeros where it wrote,
    /// and, once it unmapped that range (no event: not registered), a
    /// later mapping there would fault the stored page back where it
    /// expects zeros. A page left out stays present and unmanaged.
    pub fn adopt_since(&mut self, epoch: u64, pn: Pn) -> bool {
        let forgotten = self.unmapped.oldest().is_some_and(|&(n, ..)| n > epoch + 1);
        if forgotten
            || self.unmapped.iter().rev().take_while(|&&(n, ..)| n > epoch).any(|&(_, s, e)| (s..e).contains(&pn))
        {
            self.stats.adopt_unmapped += 1;
            return false;
        }
        self.adopt(pn)
    }

    /// Counts `[start, end)` as dropped or moved away, for [`Engine::adopt_since`].
    fn unmapped(&mut self, start: Pn, end: Pn) {
        let n = self.map_epoch() + 1;
        self.unmapped.push((n, start, end));
    }

    /// Drops every page in `[start, end)`: the program unmapped it (or an
    /// `mremap` moved pages over it). Stored keys are removed from `backing`;
    /// in-flight pages are cancelled (their batch skips them).
    ///
    /// The unmap of a move's source, which the kernel sends after the move
    /// ([`Engine::remap`]), keeps the pages that later moves took there:
    /// the kernel had unmapped the source before either event, so other
    /// threads can move their mappings to that place meanwhile (an
    /// `mremap` each; 982 of 982 moves in the stress job had their source's
    /// unmap come 1 to 5 events later). Anything else there is dropped. No
    /// fill or move succeeds between the two events (the kernel prepared
    /// this unmap before it sent the move, and answers EAGAIN until it is
    /// read; the events lock holds them off until it is applied), so only a
    /// scan can have put pages there: present ones, which stay present. And
    /// where `MREMAP_DONTUNMAP` left the source mapped, no unmap follows the
    /// move, and the program's own unmap of it, within [`TRAILING_WITHIN`],
    /// is taken for it: what the program put there since is dropped then.
    pub fn forget(&mut self, backing: &impl Backing, start: Pn, end: Pn) {
        let epoch = self.map_epoch();
        let trailing =
            self.moved_from.iter().position(|m| (m.start, m.end) == (start, end) && epoch - m.epoch <= TRAILING_WITHIN);
        self.unmapped(start, end);
        let Some(i) = trailing else {
            self.drop_pages(backing, start, end);
            return;
        };
        let moved = self.moved_from.remove(i).expect("found above");
        self.stats.unmap_after_move += 1;
        let mut at = start;
        let mut kept = moved.moved_in;
        kept.sort_unstable();
        for (s, e) in kept {
            if at < s {
                self.drop_pages(backing, at, s);
            }
            at = at.max(e);
        }
        if at < end {
            self.drop_pages(backing, at, end);
        }
    }

    /// Drops the pages of `[start, end)`, as [`Engine::forget`] and
    /// [`Engine::forget_removed`] both do.
    fn drop_pages(&mut self, backing: &impl Backing, start: Pn, end: Pn) {
        self.undoom(start, end);
        for (pn, state) in self.pages.range(start, end) {
            self.pages.remove(pn);
            match state {
                Page::Resident { .. } => self.resident -= 1,
                Page::Pinned => {}
                Page::InFlight { slot } => {
                    self.slots[slot as usize] = None;
                    self.stats.dropped_away += 1;
                }
                Page::Stored { key } => {
                    backing.remove(key);
                    self.stored -= 1;
                    self.stats.dropped_away += 1;
                }
            }
        }
    }

    /// The program dropped `[start, end)` with `madvise`: as
    /// [`Engine::forget`], and until [`Engine::settle_doomed`] sees the
    /// kernel's zap done, no page there is adopted.
    pub fn forget_removed(&mut self, backing: &impl Backing, start: Pn, end: Pn, now: std::time::Instant) {
        self.drop_pages(backing, start, end);
        self.doomed.push(Doomed { start, end, since: now });
    }

    /// Takes `[start, end)` out of the doomed ranges: it was unmapped (the
    /// kernel zaps an unmapped range before it reports it), or an `mremap`
    /// moved it (the pages left with it), or it is doomed again.
    fn undoom(&mut self, start: Pn, end: Pn) {
        if self.doomed.is_empty() {
            return;
        }
        for d in self.doomed.take() {
            if d.end <= start || end <= d.start {
                self.doomed.push(d);
                continue;
            }
            if d.start < start {
                self.doomed.push(Doomed { end: start, ..d });
            }
            if end < d.end {
                self.doomed.push(Doomed { start: end, ..d });
            }
        }
    }

    /// Ends the doomed ranges whose zap is done. `present(start, end)` lists
    /// the pages present there now (`None`: unknown, the range stays).
    ///
    /// A range is done once every page present in it is one the engine
    /// knows: the range stays registered, so a page the program touches
    /// after the zap faults and is mapped through the engine, and only a
    /// page the zap has still to remove is present and unknown. The caller
    /// holds the engine from this call through its adoptions, so no fault
    /// or event changes what the pages read as between the two.
    ///
    /// A range still holding unknown pages [`DOOMED_FOR`] after its event
    /// was never zapped: `MADV_FREE` sends the same event as
    /// `MADV_DONTNEED` and leaves the pages until reclaim takes them, and
    /// the program may write them again without a fault. Those pages are
    /// adopted then, as a scan adopts the pages of a new mapping (a page
    /// freed and not written again reads as its old data or as zeros
    /// either way).
    pub fn settle_doomed(&mut self, now: std::time::Instant, mut present: impl FnMut(Pn, Pn) -> Option<Vec<Pn>>) {
        let mut never_zapped = Vec::new();
        for d in self.doomed.take() {
            let waiting = now.saturating_duration_since(d.since) < DOOMED_FOR;
            let Some(found) = present(d.start, d.end) else {
                if waiting {
                    self.doomed.push(d);
                }
                continue;
            };
            let mut unknown = found.into_iter().filter(|&pn| self.pages.get(pn).is_none()).peekable();
            if !waiting {
                never_zapped.extend(unknown);
            } else if unknown.peek().is_some() {
                self.doomed.push(d);
            }
        }
        // `adopt`, not `adopt_since`: `present` reads the pages now, under
        // the caller's hold of the engine with every event read applied, so
        // no range can have been dropped between the read and the adoption.
        for pn in never_zapped {
            self.adopt(pn);
        }
    }

    /// `mremap` moved `n` pages from `from` to `to`: whatever was at the
    /// destination is gone, and the pages keep their state at their new place.
    pub fn remap(&mut self, backing: &impl Backing, from: Pn, to: Pn, n: u64) {
        self.unmapped(from, from + n);
        let epoch = self.map_epoch();
        self.moved_from.drop_oldest_while(|m| epoch - m.epoch > TRAILING_WITHIN);
        for m in self.moved_from.iter_mut() {
            let (s, e) = (m.start.max(to), m.end.min(to + n));
            if s < e {
                m.moved_in.push((s, e));
            }
        }
        self.moved_from.push(MovedFrom { epoch: self.map_epoch(), start: from, end: from + n, moved_in: Vec::new() });
        self.undoom(from, from + n);
        let moved = self.pages.range(from, from + n);
        for (pn, _) in &moved {
            self.pages.remove(*pn);
        }
        self.unmapped(to, to + n);
        self.drop_pages(backing, to, to + n);
        for (pn, state) in moved {
            let new = pn - from + to;
            self.pages.insert(new, state);
            match state {
                Page::Resident { .. } => self.clock.push_back(new),
                Page::InFlight { slot } => self.slots[slot as usize] = Some(new),
                Page::Pinned | Page::Stored { .. } => {}
            }
        }
    }

    /// Up to `max` resident pages chosen by the CLOCK hand.
    pub fn victims(&mut self, max: usize, out: &mut Vec<Pn>) {
        out.clear();
        if self.pauses > 0 {
            return;
        }
        if self.clock.len() > 2 * self.pages.len() + 1024 {
            self.rebuild_clock();
        }
        let mut budget = 2 * self.clock.len();
        while out.len() < max && budget > 0 {
            budget -= 1;
            let Some(pn) = self.clock.pop_front() else { break };
            if let Some(referenced) = self.pages.set_referenced(pn, false) {
                if referenced {
                    self.clock.push_back(pn);
                } else if !out.contains(&pn) {
                    out.push(pn);
                }
            }
        }
    }

    fn rebuild_clock(&mut self) {
        self.clock = self.pages.all().filter(|(_, s)| matches!(s, Page::Resident { .. })).map(|(p, _)| p).collect();
    }

    /// Records how moving victim `pn` into `slot` went (the caller's batch owns the slot).
    pub fn moved(&mut self, pn: Pn, slot: u32, outcome: Outcome) {
        debug_assert!(matches!(self.pages.get(pn), Some(Page::Resident { .. })), "victims are resident");
        match outcome {
            Outcome::Done => {
                debug_assert_eq!(self.slots[slot as usize], None, "slot {slot} still names a page of an earlier batch");
                self.pages.insert(pn, Page::InFlight { slot });
                self.resident -= 1;
                self.slots[slot as usize] = Some(pn);
            }
            Outcome::Busy => {
                self.stats.move_busy += 1;
                self.pages.insert(pn, Page::Pinned);
                self.pinned.push(pn);
                self.resident -= 1;
            }
            Outcome::Retry | Outcome::Gone => self.clock.push_back(pn),
        }
    }

    /// Makes pinned pages candidates again: a `fork` child that shared them
    /// may have ended. One that is still shared comes back pinned.
    pub fn unpin(&mut self) {
        for pn in std::mem::take(&mut self.pinned) {
            if self.pages.get(pn) == Some(Page::Pinned) {
                self.make_resident(pn, false);
            }
        }
    }

    /// The page still waiting in `slot`, if it has not come back.
    #[must_use]
    pub fn in_slot(&self, slot: u32) -> Option<Pn> {
        self.slots[slot as usize]
    }

    /// A new key for a page about to be stored.
    pub fn new_key(&mut self) -> u64 {
        self.next_key += 1;
        self.next_key
    }

    /// Finishes slot `slot` whose page was stored under `key`; false if the
    /// page left the slot meanwhile (the caller then removes `key`).
    pub fn stored_slot(&mut self, slot: u32, key: u64) -> bool {
        let Some(pn) = self.slots[slot as usize].take() else { return false };
        self.pages.insert(pn, Page::Stored { key });
        self.stored += 1;
        self.stats.evicted += 1;
        true
    }

    /// The store refused the page in `slot`: it goes back to the program.
    ///
    /// [`Outcome::Retry`] leaves the slot as it was, for the caller to try
    /// again once the events are applied, and so does [`Outcome::Busy`]
    /// (the slot could not be read: the process is ending). Where the page
    /// cannot go back (its address is no longer mapped, and its unmap event
    /// is on its way), it is dropped here, as that event would drop it: the
    /// staging area is emptied after the batch, and a slot still naming
    /// this page then would be taken by the next batch's page, whose own
    /// bookkeeping this page's unmap would wipe (that page would then read
    /// as zeros).
    pub fn refused_slot(&mut self, mem: &impl Mem, slot: u32) -> Outcome {
        let Some(pn) = self.slots[slot as usize] else { return Outcome::Done };
        let outcome = mem.move_back(slot, pn);
        match outcome {
            Outcome::Done => {
                self.slots[slot as usize] = None;
                self.stats.put_refused += 1;
                self.make_resident(pn, true);
            }
            Outcome::Gone => {
                self.slots[slot as usize] = None;
                self.pages.remove(pn);
                self.stats.dropped_away += 1;
            }
            // Busy: the slot could not be read; the page stays in it.
            Outcome::Retry | Outcome::Busy => {}
        }
        outcome
    }

    /// Brings every page that is away back into the program, as a `fork`
    /// needs (its child is not managed: a page away there reads as zeros).
    ///
    /// A pass that meets a changing map ends at once with
    /// [`BroughtBack::Retry`]: the caller drops the engine for the events
    /// to be read, applies them, and passes again. Each pass starts from
    /// what is away then, never from an earlier pass's list: an `mremap`
    /// applied between two passes moves pages to addresses that list never
    /// had, and a fork made after such a pass left them away in the child.
    pub fn bring_back(&mut self, mem: &impl Mem, backing: &impl Backing, buf: &mut [u8; PAGE]) -> BroughtBack {
        let mut lost = 0;
        for pn in self.away() {
            match self.serve(mem, backing, pn, buf) {
                // Gone: no longer mapped; its unmap event is on its way.
                Served::Done | Served::Gone => {}
                Served::Lost => lost += 1,
                Served::Retry => return BroughtBack::Retry,
            }
        }
        BroughtBack::Done { lost }
    }

    /// Every page that is away (stored or in flight): what a `fork` brings back.
    #[must_use]
    pub fn away(&self) -> Vec<Pn> {
        self.pages
            .all()
            .filter(|(_, s)| matches!(s, Page::InFlight { .. } | Page::Stored { .. }))
            .map(|(p, _)| p)
            .collect()
    }

    /// Every stored key (for dropping the whole process).
    #[must_use]
    pub fn keys(&self) -> Vec<u64> {
        self.pages
            .all()
            .filter_map(|(_, s)| match s {
                Page::Stored { key } => Some(key),
                _ => None,
            })
            .collect()
    }
}

/// One eviction batch's bookkeeping: its slots and pages.
#[derive(Debug, Default)]
pub struct Batch {
    pub victims: Vec<Pn>,
    /// Slots filled by this batch, in order.
    pub slots: Vec<u32>,
}

impl Batch {
    /// Moves up to `max` victims out, victim `i` into slot `i`. Returns how
    /// many moved and how many must be tried again (the map was changing).
    pub fn move_out(&mut self, engine: &mut Engine, mem: &impl Mem, max: usize) -> (usize, usize) {
        let mut victims = std::mem::take(&mut self.victims);
        engine.victims(max, &mut victims);
        self.slots.clear();
        let mut outcomes = [Outcome::Gone; 256];
        let outcomes = &mut outcomes[..victims.len()];
        if !victims.is_empty() {
            mem.move_out(&victims, outcomes);
        }
        let mut retry = 0;
        for (i, (&pn, &outcome)) in victims.iter().zip(outcomes.iter()).enumerate() {
            #[allow(clippy::cast_possible_truncation)]
            let slot = i as u32;
            engine.moved(pn, slot, outcome);
            match outcome {
                Outcome::Done => self.slots.push(slot),
                Outcome::Retry => retry += 1,
                Outcome::Gone | Outcome::Busy => {}
            }
        }
        self.victims = victims;
        (self.slots.len(), retry)
    }
}

#[cfg(test)]
mod tests;
