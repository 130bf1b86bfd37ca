//! Where each page of a process is, in 8 bytes a page: leaves of 64
//! pages, each page's state packed in one word, in a map ordered by address.
//!
//! The engine holds every page it ever mapped or stored, resident and away
//! alike, in the helper's own memory, which `tmem bench pressure` counts in
//! the stack it compares with zram. A `BTreeMap<Pn, Page>` spent a node of
//! up to 11 keys and 16-byte values, most of them part full, where a leaf
//! here spends a word. A program's pages come in runs (heap arenas, a
//! runtime's regions), so leaves are mostly full; an isolated page costs
//! one leaf (520 bytes) until it leaves. On the python job of `tmem bench
//! pressure` (512 MiB, 50 % / 35 %) the stack's peak fell from 378-379 /
//! 337 MiB to 373-374 / 334 MiB with the same pools (docs/PRESSURE.md).

use std::collections::BTreeMap;

use super::{Page, Pn};

const LEAF_BITS: u32 = 6;
const LEAF: usize = 1 << LEAF_BITS;
/// The state's tag in a word's low bits; 0 is "no page".
const TAG_BITS: u32 = 3;
const TAG_RESIDENT: u64 = 1;
const TAG_PINNED: u64 = 2;
const TAG_IN_FLIGHT: u64 = 3;
const TAG_STORED: u64 = 4;

/// The largest store key a word can hold (keys count up from 1).
const MAX_KEY: u64 = u64::MAX >> TAG_BITS;

fn encode(page: Page) -> u64 {
    match page {
        Page::Resident { referenced } => TAG_RESIDENT | u64::from(referenced) << TAG_BITS,
        Page::Pinned => TAG_PINNED,
        Page::InFlight { slot } => TAG_IN_FLIGHT | u64::from(slot) << TAG_BITS,
        Page::Stored { key } => {
            assert!(key <= MAX_KEY, "store key {key} does not fit a page word");
            TAG_STORED | key << TAG_BITS
        }
    }
}

fn decode(word: u64) -> Option<Page> {
    let value = word >> TAG_BITS;
    match word & ((1 << TAG_BITS) - 1) {
        0 => None,
        TAG_RESIDENT => Some(Page::Resident { referenced: value & 1 == 1 }),
        TAG_PINNED => Some(Page::Pinned),
        TAG_IN_FLIGHT => Some(Page::InFlight { slot: u32::try_from(value).expect("slots are u32") }),
        TAG_STORED => Some(Page::Stored { key: value }),
        tag => unreachable!("page word with tag {tag}"),
    }
}

struct Leaf {
    words: [u64; LEAF],
    /// Words that hold a page; the leaf is dropped when none do.
    used: u32,
}

/// The pages of one process, by page number.
#[derive(Default)]
pub struct Pages {
    leaves: BTreeMap<u64, Box<Leaf>>,
    len: usize,
}

impl std::fmt::Debug for Pages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pages").field("len", &self.len).field("leaves", &self.leaves.len()).finish()
    }
}

fn split(pn: Pn) -> (u64, usize) {
    let at = usize::try_from(pn & (LEAF as u64 - 1)).expect("under 64");
    (pn >> LEAF_BITS, at)
}

impl Pages {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn get(&self, pn: Pn) -> Option<Page> {
        let (leaf, at) = split(pn);
        self.leaves.get(&leaf).and_then(|l| decode(l.words[at]))
    }

    /// Sets the state of `pn`; returns the one it replaced.
    pub fn insert(&mut self, pn: Pn, page: Page) -> Option<Page> {
        let (leaf, at) = split(pn);
        let l = self.leaves.entry(leaf).or_insert_with(|| Box::new(Leaf { words: [0; LEAF], used: 0 }));
        let old = decode(std::mem::replace(&mut l.words[at], encode(page)));
        if old.is_none() {
            l.used += 1;
            self.len += 1;
        }
        old
    }

    /// Sets the referenced bit of `pn` if it is resident, in one lookup;
    /// returns the bit it had (`None`: not resident, nothing changed).
    pub fn set_referenced(&mut self, pn: Pn, referenced: bool) -> Option<bool> {
        let (leaf, at) = split(pn);
        let word = &mut self.leaves.get_mut(&leaf)?.words[at];
        let Some(Page::Resident { referenced: was }) = decode(*word) else { return None };
        *word = encode(Page::Resident { referenced });
        Some(was)
    }

    pub fn remove(&mut self, pn: Pn) -> Option<Page> {
        let (leaf, at) = split(pn);
        let l = self.leaves.get_mut(&leaf)?;
        let old = decode(std::mem::take(&mut l.words[at]))?;
        l.used -= 1;
        self.len -= 1;
        if l.used == 0 {
            self.leaves.remove(&leaf);
        }
        Some(old)
    }

    /// The pages in `[start, end)`, in address order.
    pub fn range(&self, start: Pn, end: Pn) -> Vec<(Pn, Page)> {
        self.iter(start, end).collect()
    }

    /// Every page, in address order.
    pub fn all(&self) -> impl Iterator<Item = (Pn, Page)> + '_ {
        self.iter(0, Pn::MAX)
    }

    fn iter(&self, start: Pn, end: Pn) -> impl Iterator<Item = (Pn, Page)> + '_ {
        let (first, last) = (start >> LEAF_BITS, end.saturating_sub(1) >> LEAF_BITS);
        let leaves = if start < end { Some(self.leaves.range(first..=last)) } else { None };
        leaves.into_iter().flatten().flat_map(move |(&leaf, l)| {
            let base = leaf << LEAF_BITS;
            l.words.iter().enumerate().filter_map(move |(at, &word)| {
                let pn = base + at as u64;
                (start..end).contains(&pn).then(|| decode(word).map(|page| (pn, page))).flatten()
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn every_state_round_trips_through_a_word() {
        for page in [
            Page::Resident { referenced: false },
            Page::Resident { referenced: true },
            Page::Pinned,
            Page::InFlight { slot: 0 },
            Page::InFlight { slot: u32::MAX },
            Page::Stored { key: 1 },
            Page::Stored { key: MAX_KEY },
        ] {
            assert_eq!(decode(encode(page)), Some(page));
        }
        assert_eq!(decode(0), None);
    }

    #[test]
    #[should_panic(expected = "does not fit")]
    fn a_key_too_large_for_a_word_is_refused() {
        encode(Page::Stored { key: MAX_KEY + 1 });
    }

    #[test]
    fn a_leaf_goes_when_its_last_page_does() {
        let mut p = Pages::default();
        p.insert(70, Page::Pinned);
        p.insert(71, Page::Pinned);
        assert_eq!(p.leaves.len(), 1);
        p.remove(70);
        assert_eq!(p.leaves.len(), 1);
        p.remove(71);
        assert_eq!((p.leaves.len(), p.len()), (0, 0));
    }

    fn page() -> impl Strategy<Value = Page> {
        prop_oneof![
            any::<bool>().prop_map(|referenced| Page::Resident { referenced }),
            Just(Page::Pinned),
            any::<u32>().prop_map(|slot| Page::InFlight { slot }),
            (1..=MAX_KEY).prop_map(|key| Page::Stored { key }),
        ]
    }

    #[derive(Clone, Debug)]
    enum Op {
        Insert(Pn, Page),
        Remove(Pn),
        SetReferenced(Pn, bool),
        Range(Pn, Pn),
    }

    fn op() -> impl Strategy<Value = Op> {
        // Page numbers near leaf edges and far apart.
        let pn = prop_oneof![0..300u64, (u64::MAX >> 13) - 200..(u64::MAX >> 12)];
        prop_oneof![
            3 => (pn.clone(), page()).prop_map(|(p, s)| Op::Insert(p, s)),
            2 => pn.clone().prop_map(Op::Remove),
            2 => (pn.clone(), any::<bool>()).prop_map(|(p, r)| Op::SetReferenced(p, r)),
            1 => (pn.clone(), pn).prop_map(|(a, b)| Op::Range(a.min(b), a.max(b))),
        ]
    }

    proptest! {
        #[test]
        fn pages_behave_as_an_ordered_map(ops in proptest::collection::vec(op(), 1..200)) {
            let mut pages = Pages::default();
            let mut model = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Insert(pn, s) => prop_assert_eq!(pages.insert(pn, s), model.insert(pn, s)),
                    Op::Remove(pn) => prop_assert_eq!(pages.remove(pn), model.remove(&pn)),
                    Op::SetReferenced(pn, r) => {
                        let was = match model.get_mut(&pn) {
                            Some(Page::Resident { referenced }) => Some(std::mem::replace(referenced, r)),
                            _ => None,
                        };
                        prop_assert_eq!(pages.set_referenced(pn, r), was);
                    }
                    Op::Range(a, b) => {
                        let want: Vec<(Pn, Page)> = model.range(a..b).map(|(p, s)| (*p, *s)).collect();
                        prop_assert_eq!(pages.range(a, b), want);
                    }
                }
                prop_assert_eq!(pages.len(), model.len());
            }
            let all: Vec<(Pn, Page)> = model.iter().map(|(p, s)| (*p, *s)).collect();
            prop_assert_eq!(pages.all().collect::<Vec<_>>(), all);
            for (pn, s) in &model {
                prop_assert_eq!(pages.get(*pn), Some(*s));
            }
        }
    }
}
