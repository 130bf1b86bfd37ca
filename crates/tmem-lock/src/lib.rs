//! tmem's locks: `parking_lot` locks that carry their [`Rank`], the place
//! of their class in the daemon's one lock order (docs/ARCHITECTURE.md,
//! "Lock order"; the enum below is that order, outermost first).
//!
//! In debug builds every thread keeps the ranks it holds, and taking a lock
//! whose rank is not above every rank held panics, naming both: a test that
//! takes locks out of order fails even when it does not deadlock. A class
//! whose instances are taken several at once ([`Rank::nests`]: stripes
//! locked in index order) may be taken again above an instance of its own
//! rank at a higher address. `try_lock` cannot deadlock: it is recorded, not
//! checked. Release builds keep nothing: the locks are `parking_lot`'s.
//!
//! No poisoning: a panic while a lock is held (contained per request by the
//! block layer) leaves the data as the panicking code left it, which every
//! critical section here keeps consistent at each step.

use std::ops::{Deref, DerefMut};
use std::time::Duration;

/// Every lock class of the daemon, in the order in which they may be taken:
/// a thread holding a lock may take only locks of a higher rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Rank {
    /// `Daemon::teardown_gate`: serialises teardowns (a `down` and a signal).
    DaemonTeardown,
    /// `Daemon::state`: status, FUSE mount, NBD server, metrics server.
    DaemonState,
    /// `Daemon::events`: the sender that wakes the main thread.
    DaemonEvents,
    /// `Daemon::fronts`: the fronts and their policy threads.
    DaemonFronts,
    /// The control socket's clients being served (a leaf: nothing is taken under it).
    ControlClients,
    /// `tmem_nbd` server: its list of connections.
    NbdConns,
    /// `tmem_nbd` limits: bytes of replies buffered across connections.
    NbdBudget,
    /// `tmem_nbd` server: the pause switch of a hand-over and its parked sessions.
    NbdPark,
    /// `tmem run`: the list of managed processes.
    RunProcesses,
    /// `tmem run`: one process's agent channel, held across a whole
    /// eviction batch (move, read, store, drop) or a release.
    RunAgentChannel,
    /// `tmem run`: the ranges of one process registered at its last scan.
    RunRanges,
    /// `tmem run`: one process's reader role: its holder polls and reads
    /// the process's userfaultfd, the other fault threads wait for it.
    RunReader,
    /// `tmem run`: one process's engine (where each of its pages is), held
    /// across the store calls that serve or evict its pages.
    RunEngine,
    /// `tmem run`: one process's events read and not yet applied, held
    /// across each read of its userfaultfd and each fill of a page.
    RunEvents,
    /// `Shared::compaction`: one compaction at a time.
    StoreCompaction,
    /// `TierPutLocks::writeback`: one writeback pass per shard. Above the
    /// block layer's stripes on purpose: a put under a stripe must not write
    /// back (nor compact), and in debug builds it cannot.
    Writeback,
    /// `PoolDevice::stripes`, `CacheDevice::stripes`: one page of a block
    /// device, held across its read-modify-write and its store call (and a
    /// cache device's backing I/O); a cache request takes the stripes of all
    /// its pages, in index order.
    BlockStripe,
    /// `RamDevice` page slots.
    RamSlot,
    /// `TierPutLocks::stripes`: per key, writeback against an incompressible
    /// put; writeback takes several, in index order.
    TierPutStripe,
    /// `TierRemovals::sending`: a batch of stale tier copies being removed.
    TierRemovalSending,
    /// `Shared::pools` (read/write): the pool table.
    StorePools,
    /// A pool's shard: index, LRU and counters of the keys hashed to it.
    Shard,
    /// `TierRemovals::queue`: stale tier copies waiting to be removed.
    TierRemovalQueue,
    /// The allocator's size classes.
    AllocClass,
    /// The page arena under the allocator.
    AllocArena,
    /// Dictionary training's plan (codec, generation, status), held while a
    /// trained codec is registered, so a codec set by hand meanwhile wins.
    DictionaryPlan,
    /// The codec registry's count.
    CodecCount,
    /// A store background worker's stop flag (writeback, recompression),
    /// with its condition variable.
    WorkerStop,
    /// Recompression: its status line.
    RecompressStatus,
    /// Disk tier: garbage collection (one pass at a time).
    DiskGc,
    /// Disk tier: the open segment being written.
    DiskWriter,
    /// Disk tier: index and segment table.
    DiskState,
    /// Disk tier: the first I/O error seen.
    DiskIoError,
    /// Remote tier: a shard of the index of what is where.
    RemoteIndex,
    /// Remote tier: one node's connection state.
    RemoteNode,
    /// `MemTier`'s map.
    MemTier,
    /// FUSE over io_uring: the first failure of a ring.
    UringFailure,
    /// The `/dev/fuse` workers' pause waits (with their condition variable).
    FuseLoop,
    /// The io_uring workers' pause waits (with their condition variable).
    UringPark,
    /// A front's policy thread: its stop flag (with its condition variable).
    FrontStop,
    /// A front's policy: its latest counters (a leaf).
    FrontStats,
    /// Nonce audit of sealing (test builds only).
    SealAudit,
    /// `tmem run`: one process's faults read and not yet served (a leaf).
    RunFaults,
    /// `tmem run`: the evictor's wake-up flag (a leaf).
    RunEvictWanted,
    /// `tmem run`: the first agent's hello (a leaf).
    RunHello,
    /// `tmem run`: counters of ended processes (a leaf).
    RunDoneStats,
}

impl Rank {
    /// Whether instances of this class are taken several at once, in
    /// address order.
    #[must_use]
    pub fn nests(self) -> bool {
        matches!(self, Self::TierPutStripe | Self::BlockStripe)
    }
}

#[cfg(debug_assertions)]
mod check {
    use std::cell::RefCell;

    use super::Rank;

    thread_local! {
        /// (rank, lock address) of every lock this thread holds, in order taken.
        static HELD: RefCell<Vec<(Rank, usize)>> = const { RefCell::new(Vec::new()) };
    }

    /// A lock held by this thread; forgotten on drop.
    #[derive(Debug)]
    pub struct Held {
        rank: Rank,
        addr: usize,
    }

    /// Records taking the lock at `addr`; panics when it breaks the order
    /// (unless `checked` is false, for `try_lock`).
    pub fn acquire(rank: Rank, addr: usize, checked: bool) -> Held {
        HELD.with(|h| {
            let mut h = h.borrow_mut();
            if checked {
                if let Some(&(top, top_addr)) = h.iter().max_by_key(|(r, a)| (*r, *a)) {
                    let nested = rank == top && rank.nests() && addr > top_addr;
                    assert!(
                        rank > top || nested,
                        "lock order violated: taking {rank:?} while holding {top:?} \
                         (see docs/ARCHITECTURE.md, Lock order; held: {:?})",
                        h.iter().map(|(r, _)| *r).collect::<Vec<_>>()
                    );
                }
            }
            h.push((rank, addr));
        });
        Held { rank, addr }
    }

    impl Drop for Held {
        fn drop(&mut self) {
            // Guards may be dropped in any order: remove this one wherever it is.
            let _ = HELD.try_with(|h| {
                let mut h = h.borrow_mut();
                if let Some(i) = h.iter().rposition(|&(r, a)| r == self.rank && a == self.addr) {
                    h.remove(i);
                }
            });
        }
    }

    /// Ranks held by this thread now.
    pub fn held() -> Vec<Rank> {
        HELD.with(|h| h.borrow().iter().map(|(r, _)| *r).collect())
    }
}

#[cfg(not(debug_assertions))]
mod check {
    use super::Rank;

    /// Nothing is kept in release builds.
    #[derive(Debug)]
    pub struct Held;

    #[inline]
    pub fn acquire(_: Rank, _: usize, _: bool) -> Held {
        Held
    }

    pub fn held() -> Vec<Rank> {
        Vec::new()
    }
}

/// Ranks this thread holds now (empty in release builds), for tests and messages.
#[must_use]
pub fn held() -> Vec<Rank> {
    check::held()
}

/// A mutex with a place in the lock order.
#[derive(Debug)]
pub struct Mutex<T: ?Sized> {
    rank: Rank,
    inner: parking_lot::Mutex<T>,
}

/// A held [`Mutex`].
#[derive(Debug)]
pub struct MutexGuard<'a, T: ?Sized> {
    // Dropped first: the lock is released before the rank is forgotten.
    guard: parking_lot::MutexGuard<'a, T>,
    _held: check::Held,
}

impl<T> Mutex<T> {
    /// A mutex of class `rank` holding `value`.
    pub const fn new(rank: Rank, value: T) -> Self {
        Self { rank, inner: parking_lot::Mutex::new(value) }
    }

    /// The value, consuming the mutex.
    pub fn into_inner(self) -> T {
        self.inner.into_inner()
    }
}

impl<T: ?Sized> Mutex<T> {
    fn addr(&self) -> usize {
        std::ptr::from_ref(&self.inner).cast::<u8>().addr()
    }

    /// Takes the lock (checked against the order in debug builds).
    pub fn lock(&self) -> MutexGuard<'_, T> {
        let held = check::acquire(self.rank, self.addr(), true);
        MutexGuard { guard: self.inner.lock(), _held: held }
    }

    /// Takes the lock if it is free.
    pub fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
        let guard = self.inner.try_lock()?;
        Some(MutexGuard { guard, _held: check::acquire(self.rank, self.addr(), false) })
    }

    /// The value, through an exclusive borrow (no locking).
    pub fn get_mut(&mut self) -> &mut T {
        self.inner.get_mut()
    }
}

impl<T: ?Sized> Deref for MutexGuard<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T: ?Sized> DerefMut for MutexGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

/// A condition variable for [`Mutex`]es.
#[derive(Debug, Default)]
pub struct Condvar(parking_lot::Condvar);

impl Condvar {
    /// A condition variable.
    #[must_use]
    pub const fn new() -> Self {
        Self(parking_lot::Condvar::new())
    }

    /// Waits, releasing `guard`'s lock meanwhile.
    pub fn wait<T: ?Sized>(&self, guard: &mut MutexGuard<'_, T>) {
        self.0.wait(&mut guard.guard);
    }

    /// Waits at most `timeout`; `true` if it timed out.
    pub fn wait_for<T: ?Sized>(&self, guard: &mut MutexGuard<'_, T>, timeout: Duration) -> bool {
        self.0.wait_for(&mut guard.guard, timeout).timed_out()
    }

    /// Wakes one waiter.
    pub fn notify_one(&self) -> bool {
        self.0.notify_one()
    }

    /// Wakes every waiter.
    pub fn notify_all(&self) -> usize {
        self.0.notify_all()
    }
}

/// A reader-writer lock with a place in the lock order.
#[derive(Debug)]
pub struct RwLock<T: ?Sized> {
    rank: Rank,
    inner: parking_lot::RwLock<T>,
}

/// A [`RwLock`] held for reading.
#[derive(Debug)]
pub struct RwLockReadGuard<'a, T: ?Sized> {
    guard: parking_lot::RwLockReadGuard<'a, T>,
    _held: check::Held,
}

/// A [`RwLock`] held for writing.
#[derive(Debug)]
pub struct RwLockWriteGuard<'a, T: ?Sized> {
    guard: parking_lot::RwLockWriteGuard<'a, T>,
    _held: check::Held,
}

impl<T> RwLock<T> {
    /// A lock of class `rank` holding `value`.
    pub const fn new(rank: Rank, value: T) -> Self {
        Self { rank, inner: parking_lot::RwLock::new(value) }
    }
}

impl<T: ?Sized> RwLock<T> {
    fn addr(&self) -> usize {
        std::ptr::from_ref(&self.inner).cast::<u8>().addr()
    }

    /// Takes it for reading.
    pub fn read(&self) -> RwLockReadGuard<'_, T> {
        let held = check::acquire(self.rank, self.addr(), true);
        RwLockReadGuard { guard: self.inner.read(), _held: held }
    }

    /// Takes it for writing.
    pub fn write(&self) -> RwLockWriteGuard<'_, T> {
        let held = check::acquire(self.rank, self.addr(), true);
        RwLockWriteGuard { guard: self.inner.write(), _held: held }
    }
}

impl<T: ?Sized> Deref for RwLockReadGuard<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T: ?Sized> Deref for RwLockWriteGuard<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T: ?Sized> DerefMut for RwLockWriteGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_order_is_fine_and_guards_may_drop_in_any_order() {
        let (a, b, c) = (Mutex::new(Rank::BlockStripe, 1), Mutex::new(Rank::Shard, 2), Mutex::new(Rank::AllocClass, 3));
        let ga = a.lock();
        let gb = b.lock();
        let gc = c.lock();
        assert_eq!(*ga + *gb + *gc, 6);
        drop(gb);
        drop(ga);
        drop(gc);
        assert!(held().is_empty());
        // Released: the same locks again, in order.
        let _gb = b.lock();
        let _gc = c.lock();
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "lock order violated: taking BlockStripe while holding Shard")]
    fn out_of_order_panics() {
        let (stripe, shard) = (Mutex::new(Rank::BlockStripe, ()), Mutex::new(Rank::Shard, ()));
        let _s = shard.lock();
        let _b = stripe.lock();
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "taking Shard while holding Shard")]
    fn two_of_a_class_that_does_not_nest_panic() {
        let shards = [Mutex::new(Rank::Shard, ()), Mutex::new(Rank::Shard, ())];
        let _a = shards[0].lock();
        let _b = shards[1].lock();
    }

    #[test]
    fn a_nesting_class_is_taken_in_address_order() {
        let stripes: Vec<_> = (0..4).map(|_| Mutex::new(Rank::TierPutStripe, ())).collect();
        let guards: Vec<_> = stripes.iter().map(Mutex::lock).collect();
        assert_eq!(held().len(), if cfg!(debug_assertions) { 4 } else { 0 });
        drop(guards);
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "taking TierPutStripe while holding TierPutStripe")]
    fn a_nesting_class_out_of_address_order_panics() {
        let stripes: Vec<_> = (0..2).map(|_| Mutex::new(Rank::TierPutStripe, ())).collect();
        let _b = stripes[1].lock();
        let _a = stripes[0].lock();
    }

    #[test]
    fn try_lock_is_recorded_but_never_refused_for_order() {
        let (stripe, shard) = (Mutex::new(Rank::BlockStripe, ()), Mutex::new(Rank::Shard, ()));
        let _s = shard.lock();
        let b = stripe.try_lock().expect("free");
        assert!(stripe.try_lock().is_none(), "held");
        drop(b);
    }

    #[test]
    fn condvar_waits_with_a_ranked_guard() {
        let pair = std::sync::Arc::new((Mutex::new(Rank::WorkerStop, false), Condvar::new()));
        let p2 = std::sync::Arc::clone(&pair);
        let t = std::thread::spawn(move || {
            *p2.0.lock() = true;
            p2.1.notify_all();
        });
        let mut g = pair.0.lock();
        while !*g {
            pair.1.wait_for(&mut g, Duration::from_millis(100));
        }
        drop(g);
        t.join().unwrap();
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "taking StorePools while holding Shard")]
    fn rwlocks_are_ranked_too() {
        let (pools, shard) = (RwLock::new(Rank::StorePools, ()), Mutex::new(Rank::Shard, ()));
        let _s = shard.lock();
        let _p = pools.read();
    }
}
