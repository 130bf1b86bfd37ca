//! Which slots of a slab changed since a snapshot was taken: a bit per
//! handle, set by every write while a pre-copy hand-over runs
//! (`store/precopy.rs`). A slab not being snapshot carries none, and its
//! writes cost one branch.

/// A growable set of slab handles.
#[derive(Debug, Default, Clone)]
pub(crate) struct Dirty {
    words: Vec<u64>,
}

impl Dirty {
    /// Marks handle `h` changed.
    pub fn mark(&mut self, h: u32) {
        let w = (h / 64) as usize;
        if w >= self.words.len() {
            // Grows once per 64 new handles at most, and only while a
            // hand-over runs.
            self.words.resize(w + 1, 0);
        }
        self.words[w] |= 1 << (h % 64);
    }

    /// Marks every handle below `n` changed.
    pub fn mark_below(&mut self, n: usize) {
        let full = n / 64;
        if self.words.len() < n.div_ceil(64) {
            self.words.resize(n.div_ceil(64), 0);
        }
        self.words[..full].fill(u64::MAX);
        if !n.is_multiple_of(64) {
            self.words[full] |= (1 << (n % 64)) - 1;
        }
    }

    /// The changed handles, in order.
    pub fn handles(&self) -> impl Iterator<Item = u32> + '_ {
        self.words.iter().enumerate().flat_map(|(i, &w)| {
            let base = u32::try_from(i * 64).expect("handles are u32");
            BitIter(w).map(move |b| base + b)
        })
    }
}

/// The set bits of a word, lowest first.
struct BitIter(u64);

impl Iterator for BitIter {
    type Item = u32;
    fn next(&mut self) -> Option<u32> {
        if self.0 == 0 {
            return None;
        }
        let b = self.0.trailing_zeros();
        self.0 &= self.0 - 1;
        Some(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_come_back_in_order_once() {
        let mut d = Dirty::default();
        for h in [700, 3, 64, 3, 63, 0] {
            d.mark(h);
        }
        assert_eq!(d.handles().collect::<Vec<_>>(), [0, 3, 63, 64, 700]);
        let mut all = Dirty::default();
        all.mark(200);
        all.mark_below(130);
        assert_eq!(all.handles().collect::<Vec<_>>(), (0..130).chain([200]).collect::<Vec<_>>());
        let mut edge = Dirty::default();
        edge.mark_below(128);
        assert_eq!(edge.handles().count(), 128);
    }
}
