//! The engine's short memories of what the program did to its maps
//! (ranges dropped, moved away, doomed): each keeps its newest entries up to
//! a cap, oldest first, so that a program that unmaps without end cannot
//! grow the helper's memory.

use std::collections::VecDeque;

/// At most `cap` entries, oldest first; a push at the cap drops the oldest.
#[derive(Clone, Debug)]
pub(super) struct Recent<T> {
    entries: VecDeque<T>,
    cap: usize,
}

impl<T> Recent<T> {
    pub(super) fn new(cap: usize) -> Self {
        assert!(cap > 0, "a log of no entries keeps nothing");
        Self { entries: VecDeque::new(), cap }
    }

    /// Adds `entry` as the newest, dropping the oldest at the cap.
    pub(super) fn push(&mut self, entry: T) {
        if self.entries.len() == self.cap {
            self.entries.pop_front();
        }
        self.entries.push_back(entry);
    }

    /// Takes every entry out, oldest first, to push back those that stay.
    pub(super) fn take(&mut self) -> VecDeque<T> {
        std::mem::take(&mut self.entries)
    }

    /// Removes and returns the entry at `i` (0 is the oldest).
    pub(super) fn remove(&mut self, i: usize) -> Option<T> {
        self.entries.remove(i)
    }

    /// Drops the oldest entries while `old` says so: for entries pushed in
    /// order of age, the ones past an age.
    pub(super) fn drop_oldest_while(&mut self, mut old: impl FnMut(&T) -> bool) {
        while self.entries.front().is_some_and(&mut old) {
            self.entries.pop_front();
        }
    }

    pub(super) fn iter(&self) -> impl DoubleEndedIterator<Item = &T> {
        self.entries.iter()
    }

    pub(super) fn iter_mut(&mut self) -> impl DoubleEndedIterator<Item = &mut T> {
        self.entries.iter_mut()
    }

    pub(super) fn oldest(&self) -> Option<&T> {
        self.entries.front()
    }

    pub(super) fn newest(&self) -> Option<&T> {
        self.entries.back()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::Recent;

    #[test]
    fn a_push_at_the_cap_drops_the_oldest() {
        let mut log = Recent::new(3);
        for i in 0..5 {
            log.push(i);
        }
        assert_eq!(log.iter().copied().collect::<Vec<_>>(), [2, 3, 4]);
        assert_eq!((log.oldest(), log.newest()), (Some(&2), Some(&4)));
    }

    #[test]
    fn only_the_oldest_run_of_old_entries_is_dropped() {
        let mut log = Recent::new(8);
        for i in [1, 2, 7, 3] {
            log.push(i);
        }
        log.drop_oldest_while(|&i| i < 5);
        assert_eq!(log.iter().copied().collect::<Vec<_>>(), [7, 3]);
    }

    #[test]
    fn entries_taken_and_pushed_back_stay_under_the_cap() {
        let mut log = Recent::new(2);
        log.push(1);
        log.push(2);
        for i in log.take() {
            // Each entry splits in two, as a range does around a hole.
            log.push(i * 10);
            log.push(i * 10 + 1);
        }
        assert_eq!(log.iter().copied().collect::<Vec<_>>(), [20, 21]);
    }
}
