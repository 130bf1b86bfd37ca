//! How many pages to map ahead of a fault (stored pages, and zeros where
//! the program never had one): a window per sequential stream, grown while
//! the program walks through it, as the kernel's file readahead does.
//!
//! Userspace sees no accessed bits, so whether a page read ahead was used
//! cannot be asked. What can be seen is the program's next fault: one just
//! past a window (or inside it, where the read-ahead stopped short) says the
//! program walked that far, and the stream's window doubles. A fault that
//! continues no stream starts one with no read-ahead at all, so a program
//! that touches its pages at random pays nothing.
//!
//! A program runs several streams at once (an interpreter walks a list, its
//! objects and their strings, each in an arena of its own), so the last
//! [`STREAMS`] are kept, and the oldest makes way for a new one.
//!
//! Measured on the python job of `tmem bench pressure` (docs/PRESSURE.md,
//! "Read-ahead"): 84 % of its faults from the store came within 4 pages
//! after one of the previous 256 faults, though only 10 % came right after
//! the fault before them.

use crate::engine::Pn;

/// Streams followed at once.
pub const STREAMS: usize = 16;
/// The largest window, in pages, and `tmem run --read-ahead`'s default:
/// on the python job of `tmem bench pressure`, fixed windows of 8 and 16
/// pages took 1.03x and 0.99x zram's time at 50 % where none took 1.57x.
pub const MAX_WINDOW: u64 = 16;

#[derive(Clone, Copy, Debug, Default)]
struct Stream {
    /// The fault that opened the stream's last window.
    fault: Pn,
    /// The window read ahead after `fault`: pages `fault + 1 ..= fault + window`.
    window: u64,
    /// When the stream last moved (a count of faults), for replacing the oldest.
    used: u64,
}

impl Stream {
    /// Whether a fault at `pn` continues this stream: it comes after the
    /// window's first page and at most one page past its end.
    fn continued_by(&self, pn: Pn) -> bool {
        pn > self.fault && pn <= self.fault + self.window + 1
    }
}

/// The streams of one process.
#[derive(Debug)]
pub struct ReadAhead {
    streams: [Stream; STREAMS],
    faults: u64,
    /// The largest window (0: no read-ahead).
    max: u64,
}

impl ReadAhead {
    /// Windows of at most `max` pages (0: none at all).
    #[must_use]
    pub fn new(max: u64) -> Self {
        Self { streams: [Stream::default(); STREAMS], faults: 0, max }
    }

    /// A fault at `pn` was served from the store: how many pages after it
    /// to read ahead.
    pub fn window(&mut self, pn: Pn) -> u64 {
        self.faults += 1;
        let now = self.faults;
        let (slot, window) = match self.streams.iter().position(|s| s.used > 0 && s.continued_by(pn)) {
            Some(i) => (i, (self.streams[i].window * 2).max(2).min(self.max)),
            None => {
                let oldest = (0..STREAMS).min_by_key(|&i| self.streams[i].used).unwrap_or(0);
                (oldest, 0)
            }
        };
        self.streams[slot] = Stream { fault: pn, window, used: now };
        window
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sequential_walk_doubles_its_window_up_to_the_limit() {
        let mut ra = ReadAhead::new(MAX_WINDOW);
        let mut pn = 1000;
        let mut windows = Vec::new();
        for _ in 0..7 {
            let w = ra.window(pn);
            windows.push(w);
            pn += w + 1; // the program faults just past the window
        }
        assert_eq!(windows, [0, 2, 4, 8, 16, 16, 16]);
    }

    proptest::proptest! {
        #[test]
        fn faults_at_random_read_nothing_ahead(pages in proptest::collection::vec(0..1u64 << 14, 1..2000)) {
            let mut ra = ReadAhead::new(MAX_WINDOW);
            for p in pages {
                // Faults 64 pages apart never continue a stream.
                proptest::prop_assert_eq!(ra.window((1 << 20) + p * 64), 0);
            }
        }
    }

    #[test]
    fn interleaved_streams_each_keep_their_window() {
        let mut ra = ReadAhead::new(MAX_WINDOW);
        let starts = [0u64, 10_000, 20_000, 30_000];
        let mut next = starts;
        let mut last = [0u64; 4];
        for _ in 0..6 {
            for (i, n) in next.iter_mut().enumerate() {
                last[i] = ra.window(*n);
                *n += last[i] + 1;
            }
        }
        assert_eq!(last, [16; 4]);
    }

    #[test]
    fn a_fault_inside_a_window_cut_short_continues_it() {
        let mut ra = ReadAhead::new(MAX_WINDOW);
        assert_eq!(ra.window(50), 0);
        assert_eq!(ra.window(51), 2);
        assert_eq!(ra.window(53), 4, "past the window of 2");
        assert_eq!(ra.window(55), 8, "inside the window of 4 (the read-ahead stopped at page 55)");
        assert_eq!(ra.window(55), 0, "a fault on the window's own first page starts anew");
    }

    #[test]
    fn the_window_stops_at_its_maximum_and_zero_turns_it_off() {
        for (max, want) in [(0, [0, 0, 0, 0, 0]), (1, [0, 1, 1, 1, 1]), (5, [0, 2, 4, 5, 5])] {
            let mut ra = ReadAhead::new(max);
            let mut pn = 7;
            let windows: Vec<u64> = (0..5)
                .map(|_| {
                    let w = ra.window(pn);
                    pn += w + 1;
                    w
                })
                .collect();
            assert_eq!(windows, want, "max {max}");
        }
    }

    #[test]
    fn the_oldest_stream_makes_way() {
        let mut ra = ReadAhead::new(MAX_WINDOW);
        assert_eq!(ra.window(0), 0);
        for i in 1..=STREAMS as u64 {
            assert_eq!(ra.window(i * 1000), 0);
        }
        assert_eq!(ra.window(1), 0, "stream 0 was replaced by the 17th");
        assert_eq!(ra.window(2001), 2, "stream 2000 was still there");
    }
}
