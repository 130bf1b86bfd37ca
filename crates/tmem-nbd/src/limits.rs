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
/// while the budget is spent it waits, and so stops reading requests, for
/// at most its wait deadline.
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
    /// Takes that gave up waiting.
    wait_timeouts: AtomicU64,
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
            wait_timeouts: AtomicU64::new(0),
        }
    }

    fn used(&self) -> MutexGuard<'_, usize> {
        self.used.lock()
    }

    /// Takes `n` bytes, waiting at most `wait` while that would go over the
    /// limit; `None` if the wait ran out. The server's configuration check
    /// makes `n <= limit` for every take.
    pub(crate) fn take(&self, n: usize, wait: Duration) -> Option<Held<'_>> {
        debug_assert!(n <= self.limit, "take of {n} over the budget {}", self.limit);
        let n = n.min(self.limit);
        let mut used = self.used();
        if *used + n > self.limit {
            bump(&self.waits, 1);
            // None: a wait too long to represent, i.e. no deadline.
            let deadline = Instant::now().checked_add(wait);
            while *used + n > self.limit {
                match deadline.map(|d| d.saturating_duration_since(Instant::now())) {
                    Some(left) if left.is_zero() => {
                        bump(&self.wait_timeouts, 1);
                        return None;
                    }
                    Some(left) => {
                        self.freed.wait_for(&mut used, left);
                    }
                    None => self.freed.wait(&mut used),
                }
            }
        }
        *used += n;
        self.now.store(len64(*used), Ordering::Relaxed);
        self.peak.fetch_max(len64(*used), Ordering::Relaxed);
        Some(Held { budget: self, n })
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

    /// Takes that gave up waiting.
    pub(crate) fn wait_timeouts(&self) -> u64 {
        self.wait_timeouts.load(Ordering::Relaxed)
    }

    /// The limit.
    pub(crate) fn limit(&self) -> usize {
        self.limit
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
    /// Waiting for the next request in transmission. The word holds when
    /// the wait began; it fires only after the watch's idle timeout, if
    /// any, and marks the connection as one whose slot may be reclaimed.
    Idle,
    /// Answering a client over the connection limit.
    Refusal,
    /// A request arriving in full: its header, then its payload.
    Request,
    /// A reply with a payload going out.
    Reply,
}

impl Timer {
    fn code(self) -> u64 {
        match self {
            Timer::Handshake => 1,
            Timer::Idle => 2,
            Timer::Refusal => 3,
            Timer::Request => 4,
            Timer::Reply => 5,
        }
    }

    fn from_code(c: u64) -> Option<Timer> {
        match c {
            1 => Some(Timer::Handshake),
            2 => Some(Timer::Idle),
            3 => Some(Timer::Refusal),
            4 => Some(Timer::Request),
            5 => Some(Timer::Reply),
            _ => None,
        }
    }
}

/// Set once the deadline fired; the connection is being cut.
const CUT: u64 = 1 << 63;
/// The timer code sits above the time.
const TIMER_SHIFT: u32 = 56;
/// Milliseconds since the watch was made: the deadline, or for
/// [`Timer::Idle`] the start of the wait.
const MS_MASK: u64 = (1 << TIMER_SHIFT) - 1;
const IDLE: u64 = 2 << TIMER_SHIFT;

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).min(MS_MASK)
}

/// A connection's deadline: armed and disarmed by its thread, checked by
/// the accept loop, which cuts the socket once it passed (or reclaims the
/// slot of a connection idle long enough). One word: 0 (none) or timer
/// code and time, plus [`CUT`] once fired.
#[derive(Debug)]
pub(crate) struct Watch {
    epoch: Instant,
    state: AtomicU64,
    /// How long [`Timer::Idle`] runs before it fires, in ms; [`MS_MASK`]:
    /// never.
    idle_after: u64,
}

impl Watch {
    /// A watch armed with `timer` firing `after` from now; an idle wait
    /// fires after `idle_timeout`, if given.
    pub(crate) fn new(timer: Timer, after: Duration, idle_timeout: Option<Duration>) -> Self {
        let idle_after = idle_timeout.map_or(MS_MASK, millis);
        let w = Watch { epoch: Instant::now(), state: AtomicU64::new(0), idle_after };
        w.arm(timer, after);
        w
    }

    fn now(&self) -> u64 {
        millis(self.epoch.elapsed())
    }

    /// Replaces the deadline; `false` (and no change) if it already fired.
    pub(crate) fn arm(&self, timer: Timer, after: Duration) -> bool {
        debug_assert!(timer != Timer::Idle, "use Watch::idle");
        let at = millis(self.epoch.elapsed().saturating_add(after));
        self.put(timer.code() << TIMER_SHIFT | at)
    }

    /// Marks the connection idle from now; `false` if the deadline fired.
    pub(crate) fn idle(&self) -> bool {
        self.put(IDLE | self.now())
    }

    /// Removes the deadline; `false` if it already fired.
    pub(crate) fn disarm(&self) -> bool {
        self.put(0)
    }

    /// Removes the deadline and returns what was left of it (`None`: no
    /// deadline, or an idle wait), to arm it again after work that is not
    /// the client's to hurry; zero if it fired.
    pub(crate) fn pause(&self) -> Option<Duration> {
        let s = self.state.load(Ordering::Acquire);
        if s & CUT != 0 {
            return Some(Duration::ZERO);
        }
        if s == 0 || s & !MS_MASK == IDLE {
            return None;
        }
        if !self.disarm() {
            return Some(Duration::ZERO);
        }
        Some(Duration::from_millis((s & MS_MASK).saturating_sub(self.now())))
    }

    fn put(&self, v: u64) -> bool {
        // Err: the deadline fired; it stays fired.
        self.state.fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| (s & CUT == 0).then_some(v)).is_ok()
    }

    /// Marks the watch fired if its deadline passed; returns the timer, and
    /// the caller then cuts the connection.
    pub(crate) fn expire(&self) -> Option<Timer> {
        let s = self.state.load(Ordering::Acquire);
        if s == 0 || s & CUT != 0 {
            return None;
        }
        let at = s & MS_MASK;
        let due = if s & !MS_MASK == IDLE { at.saturating_add(self.idle_after) } else { at };
        if self.now() < due {
            return None;
        }
        self.state.compare_exchange(s, s | CUT, Ordering::AcqRel, Ordering::Acquire).ok()?;
        Timer::from_code(s >> TIMER_SHIFT)
    }

    /// The timer that fired, if one did.
    pub(crate) fn fired(&self) -> Option<Timer> {
        let s = self.state.load(Ordering::Acquire);
        if s & CUT == 0 {
            return None;
        }
        Timer::from_code((s & !CUT) >> TIMER_SHIFT)
    }

    /// If the connection waits for its next request: how long it has, and
    /// the word to pass to [`Watch::reclaim`].
    pub(crate) fn idle_for(&self) -> Option<(u64, Duration)> {
        let s = self.state.load(Ordering::Acquire);
        (s & !MS_MASK == IDLE).then(|| (s, Duration::from_millis(self.now().saturating_sub(s & MS_MASK))))
    }

    /// Marks the watch fired if the connection is still in the idle wait
    /// `word` (from [`Watch::idle_for`]): a request that began since is
    /// never cut. The caller then cuts the connection.
    pub(crate) fn reclaim(&self, word: u64) -> bool {
        self.state.compare_exchange(word, word | CUT, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watch_fires_once_and_stays_fired() {
        let w = Watch::new(Timer::Handshake, Duration::from_secs(60), None);
        assert_eq!(w.expire(), None);
        assert!(w.arm(Timer::Request, Duration::ZERO));
        assert_eq!(w.expire(), Some(Timer::Request));
        assert_eq!(w.fired(), Some(Timer::Request));
        assert_eq!(w.expire(), None, "fires once");
        assert!(!w.disarm());
        assert!(!w.idle());
        assert_eq!(w.fired(), Some(Timer::Request), "a fired watch cannot be disarmed");
        assert_eq!(w.pause(), Some(Duration::ZERO));
        let w = Watch::new(Timer::Refusal, Duration::ZERO, None);
        assert!(w.disarm());
        assert_eq!(w.expire(), None);
        assert_eq!(w.fired(), None);
    }

    #[test]
    fn idle_waits_fire_after_the_idle_timeout_only() {
        let w = Watch::new(Timer::Handshake, Duration::from_secs(60), None);
        assert!(w.idle());
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(w.expire(), None, "no idle timeout: never fires");
        let (word, idled) = w.idle_for().unwrap();
        assert!(idled >= Duration::from_millis(15), "{idled:?}");
        assert_eq!(w.pause(), None);
        // A request began: the old idle word no longer reclaims.
        assert!(w.arm(Timer::Request, Duration::from_secs(5)));
        assert_eq!(w.idle_for(), None);
        assert!(!w.reclaim(word));
        let left = w.pause().unwrap();
        assert!(left <= Duration::from_secs(5) && left > Duration::from_secs(4), "{left:?}");
        assert!(w.idle());
        let (word, _) = w.idle_for().unwrap();
        assert!(w.reclaim(word));
        assert_eq!(w.fired(), Some(Timer::Idle));
        assert!(!w.arm(Timer::Request, Duration::from_secs(5)), "a reclaimed connection takes no request");

        let w = Watch::new(Timer::Handshake, Duration::from_secs(60), Some(Duration::from_millis(10)));
        assert!(w.idle());
        assert_eq!(w.expire(), None);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(w.expire(), Some(Timer::Idle));
    }

    #[test]
    fn budget_waits_for_room() {
        const LONG: Duration = Duration::from_secs(60);
        let b = std::sync::Arc::new(Budget::new(100));
        let a = b.take(60, LONG).unwrap();
        assert_eq!((b.held(), b.peak()), (60, 60));
        std::thread::scope(|s| {
            let t = s.spawn(|| {
                let _c = b.take(50, LONG).unwrap();
                b.held()
            });
            while b.waits() == 0 {
                std::thread::yield_now();
            }
            drop(a);
            assert_eq!(t.join().unwrap(), 50);
        });
        assert_eq!((b.held(), b.peak(), b.waits(), b.wait_timeouts()), (0, 60, 1, 0));
    }

    #[test]
    fn budget_wait_gives_up_at_its_deadline() {
        let b = Budget::new(100);
        let _a = b.take(60, Duration::ZERO).unwrap();
        let t = Instant::now();
        assert!(b.take(50, Duration::from_millis(50)).is_none());
        assert!(t.elapsed() >= Duration::from_millis(50));
        assert!(b.take(40, Duration::ZERO).is_some(), "what fits is taken without waiting");
        assert_eq!((b.held(), b.waits(), b.wait_timeouts()), (60, 1, 1));
    }
}
