//! Pages written while [`PoolDevice::drop_stale`](crate::PoolDevice::drop_stale)
//! runs, so that a sweep skips them instead of stopping at the first write;
//! and pages read or written while
//! [`PoolDevice::keep_only_marked`](crate::PoolDevice::keep_only_marked)
//! runs its mark, which are the ones it keeps.
//!
//! A read marks its pages before it looks them up; the mark's reads come
//! through the kernel (zram, a loop or ublk device), whose completion of
//! the request orders the mark before the caller's sweep.
//!
//! A sweep drops the pages of freed swap slots; a page the kernel writes
//! once the sweep has begun may be a slot it has just taken, and must stay.
//! Without this mark the only safe answer was to stop the sweep at the
//! first write, which on a busy machine (another cgroup swapping to the
//! same area) left most freed pages in the pool.
//!
//! Ordering, in one place: a write counts itself in the device's
//! `write_ios` (SeqCst), then, under its page's stripe, loads
//! [`WrittenDuringSweep::active`] (SeqCst) and marks the page when set.
//! A sweep stores `active` (SeqCst) and then loads `write_ios` (SeqCst):
//! if that load does not see a write's count, the write's load of `active`
//! comes later in the single total order and sees it, so the page is
//! marked, under the stripe the sweep takes before it looks at the mark. A
//! write the sweep's load does see, but that came after the caller's
//! `writes_before`, is unknown to the sweep: it stops (`Interrupted`).
//! A mark left over from a write that saw the previous sweep's `active`
//! only keeps a page, never drops one.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// One bit per page of the device, set by writes while a sweep is active.
#[derive(Debug)]
pub(crate) struct WrittenDuringSweep {
    active: AtomicBool,
    bits: Box<[AtomicU64]>,
}

impl WrittenDuringSweep {
    /// For a device of `pages` pages (one bit each: 64 KiB for 2 GiB).
    pub(crate) fn new(pages: u64) -> Self {
        let words = usize::try_from(pages.div_ceil(64)).expect("a device's page count fits memory");
        Self { active: AtomicBool::new(false), bits: (0..words).map(|_| AtomicU64::new(0)).collect() }
    }

    /// Starts a sweep: clears the marks, then has writes mark their pages.
    /// Returns false, changing nothing, when another sweep is running.
    pub(crate) fn begin(&self) -> bool {
        if self.active.load(Ordering::SeqCst) {
            return false;
        }
        for w in &self.bits {
            w.store(0, Ordering::Relaxed);
        }
        self.active.compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst).is_ok()
    }

    /// Ends the sweep begun by [`begin`](Self::begin).
    pub(crate) fn end(&self) {
        self.active.store(false, Ordering::SeqCst);
    }

    /// Whether a sweep runs now.
    #[cfg(test)]
    pub(crate) fn active(&self) -> bool {
        self.active.load(Ordering::SeqCst)
    }

    /// Pages marked since [`begin`](Self::begin).
    pub(crate) fn count(&self) -> u64 {
        self.bits.iter().map(|w| u64::from(w.load(Ordering::SeqCst).count_ones())).sum()
    }

    /// Called by a read of pages `first..=last` before it looks them up.
    pub(crate) fn on_read(&self, first: u64, last: u64) {
        if self.active.load(Ordering::SeqCst) {
            for page in first..=last {
                let (word, bit) = Self::at(page);
                self.bits[word].fetch_or(bit, Ordering::SeqCst);
            }
        }
    }

    /// Called by a write under `page`'s stripe, after it counted itself.
    pub(crate) fn on_write(&self, page: u64) {
        if self.active.load(Ordering::SeqCst) {
            let (word, bit) = Self::at(page);
            self.bits[word].fetch_or(bit, Ordering::Relaxed);
        }
    }

    /// Whether `page` was written since [`begin`](Self::begin); read under
    /// its stripe, which orders it after a write that marked it.
    pub(crate) fn written(&self, page: u64) -> bool {
        let (word, bit) = Self::at(page);
        self.bits[word].load(Ordering::Relaxed) & bit != 0
    }

    fn at(page: u64) -> (usize, u64) {
        (usize::try_from(page / 64).expect("a page of the device"), 1 << (page % 64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_only_while_a_sweep_runs_and_one_sweep_at_a_time() {
        let w = WrittenDuringSweep::new(130);
        w.on_write(3);
        assert!(!w.written(3), "no sweep: no mark");
        assert!(w.begin());
        assert!(!w.begin(), "a second sweep waits its turn");
        w.on_write(3);
        w.on_write(129);
        assert!(w.written(3) && w.written(129) && !w.written(4) && !w.written(128));
        w.end();
        w.on_write(5);
        w.on_read(5, 7);
        assert!(!w.written(5) && !w.written(6));
        // The next sweep starts with no marks.
        assert!(w.begin());
        assert!(!w.written(3) && !w.written(129));
        w.on_read(63, 65);
        assert!(w.written(63) && w.written(64) && w.written(65) && !w.written(62) && !w.written(66));
        w.end();
    }
}
