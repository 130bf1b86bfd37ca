//! What the server imposes beyond the protocol: the budget of payload
//! buffers shared by all sessions, and each connection's deadline.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tmem_lock::{Condvar, Mutex, MutexGuard, Rank};

use crate::stats::bump;

fn len64(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// Bytes of request and reply payload buffers that all sessions together
/// may hold. A session takes its share before it allocates a buffer and
/// gives it back once the reply is written (or the write payload stored);
/// while the budget is spent it waits, and so stops reading requests.
#[derive(Debug)]
pub(crate) struct Budget {
    limit: usize,
    used: Mutex<usize>,
    freed: Condvar,
    /// `used` and its high-water mark, readable without the lock.
    now: AtomicU64,
    peak: AtomicU64,
    /// Takes that had to wait.
    waits: AtomicU64,
}

impl Budget {
    pub(crate) fn new(limit: usize) -> Self {
        Self {
            limit,
            used: Mutex::new(Rank::NbdBudget, 0),
            freed: Condvar::new(),
            now: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            waits: AtomicU64::new(0),
        }
    }

    fn used(&self) -> MutexGuard<'_, usize> {
        self.used.lock()
    }

    /// Takes `n` bytes, waiting while that would go over the limit. The
    /// server's configuration check makes `n <= limit` for every take.
    pub(crate) fn take(&self, n: usize) -> Held<'_> {
        debug_assert!(n <= self.limit, "take of {n} over the budget {}", self.limit);
        let n = n.min(self.limit);
        let mut used = self.used();
        if *used + n > self.limit {
            bump(&self.waits, 1);
            while *used + n > self.limit {
                self.freed.wait(&mut used);
            }
        }
        *used += n;
        self.now.store(len64(*used), Ordering::Relaxed);
        self.peak.fetch_max(len64(*used), Ordering::Relaxed);
        Held { budget: self, n }
    }

    fn give(&self, n: usize) {
        let mut used = self.used();
        *used -= n;
        self.now.store(len64(*used), Ordering::Relaxed);
        drop(used);
        self.freed.notify_all();
    }

    /// Bytes held now.
    pub(crate) fn held(&self) -> u64 {
        self.now.load(Ordering::Relaxed)
    }

    /// Most bytes held at once.
    pub(crate) fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }

    /// Takes that waited for others to give back.
    pub(crate) fn waits(&self) -> u64 {
        self.waits.load(Ordering::Relaxed)
    }
}

/// A share of a [`Budget`], given back on drop.
#[derive(Debug)]
pub(crate) struct Held<'a> {
    budget: &'a Budget,
    n: usize,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.budget.give(self.n);
    }
}

/// What a connection's deadline bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Timer {
    /// From accept to the end of option negotiation.
    Handshake,
    /// Waiting for the next request in transmission.
    Idle,
    /// Answering a client over the connection limit.
    Refusal,
}

impl Timer {
    fn code(self) -> u64 {
        match self {
            Timer::Handshake => 1,
            Timer::Idle => 2,
            Timer::Refusal => 3,
        }
    }

    fn from_code(c: u64) -> Option<Timer> {
        match c {
            1 => Some(Timer::Handshake),
            2 => Some(Timer::Idle),
            3 => Some(Timer::Refusal),
            _ => None,
        }
    }
}

/// Set once the deadline fired; the connection is being cut.
const CUT: u64 = 1 << 63;
/// The timer code sits above the deadline.
const TIMER_SHIFT: u32 = 56;
/// Deadline in milliseconds since the watch was made.
const MS_MASK: u64 = (1 << TIMER_SHIFT) - 1;

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).min(MS_MASK)
}

/// A connection's deadline: armed and disarmed by its thread, checked by
/// the accept loop, which cuts the socket once it passed. One word:
/// 0 (none) or timer code and deadline, plus [`CUT`] once fired.
#[derive(Debug)]
pub(crate) struct Watch {
    epoch: Instant,
    state: AtomicU64,
}

impl Watch {
    /// A watch armed with `timer` firing `after` from now.
    pub(crate) fn new(timer: Timer, after: Duration) -> Self {
        let w = Watch { epoch: Instant::now(), state: AtomicU64::new(0) };
        w.arm(timer, after);
        w
    }

    /// Replaces the deadline (unless it already fired).
    pub(crate) fn arm(&self, timer: Timer, after: Duration) {
        let at = millis(self.epoch.elapsed().saturating_add(after));
        self.put(timer.code() << TIMER_SHIFT | at);
    }

    /// Removes the deadline (unless it already fired).
    pub(crate) fn disarm(&self) {
        self.put(0);
    }

    fn put(&self, v: u64) {
        // Err: the deadline fired; it stays fired.
        let _ = self.state.fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| (s & CUT == 0).then_some(v));
    }

    /// Marks the watch fired if its deadline passed; returns the timer, and
    /// the caller then cuts the connection.
    pub(crate) fn expire(&self) -> Option<Timer> {
        let s = self.state.load(Ordering::Acquire);
        if s == 0 || s & CUT != 0 || millis(self.epoch.elapsed()) < s & MS_MASK {
            return None;
        }
        self.state.compare_exchange(s, s | CUT, Ordering::AcqRel, Ordering::Acquire).ok()?;
        Timer::from_code(s >> TIMER_SHIFT)
    }

    /// Did the deadline fire?
    pub(crate) fn fired(&self) -> bool {
        self.state.load(Ordering::Acquire) & CUT != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watch_fires_once_and_stays_fired() {
        let w = Watch::new(Timer::Handshake, Duration::from_secs(60));
        assert_eq!(w.expire(), None);
        w.arm(Timer::Idle, Duration::ZERO);
        assert_eq!(w.expire(), Some(Timer::Idle));
        assert!(w.fired());
        assert_eq!(w.expire(), None, "fires once");
        w.disarm();
        assert!(w.fired(), "a fired watch cannot be disarmed");
        let w = Watch::new(Timer::Refusal, Duration::ZERO);
        w.disarm();
        assert_eq!(w.expire(), None);
        assert!(!w.fired());
    }

    #[test]
    fn budget_waits_for_room() {
        let b = std::sync::Arc::new(Budget::new(100));
        let a = b.take(60);
        assert_eq!((b.held(), b.peak()), (60, 60));
        std::thread::scope(|s| {
            let t = s.spawn(|| {
                let _c = b.take(50);
                b.held()
            });
            while b.waits() == 0 {
                std::thread::yield_now();
            }
            drop(a);
            assert_eq!(t.join().unwrap(), 50);
        });
        assert_eq!((b.held(), b.peak(), b.waits()), (0, 60, 1));
    }
}
