//! Deterministic mixed page generator shared by the zram test and example.
#![allow(dead_code)]

pub const PAGE: usize = 4096;

/// What [`generate`] produced.
pub struct Pages {
    pub data: Vec<u8>,
    pub pages: usize,
    /// Zero pages plus nonzero same-filled pages (every 8-byte word equal).
    pub same_filled: usize,
    pub zero: usize,
    pub pattern: usize,
    pub text: usize,
    pub random: usize,
}

/// splitmix64: tiny, good-enough deterministic PRNG.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform-ish value in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        let n64 = u64::try_from(n).unwrap();
        usize::try_from(self.next_u64() % n64).unwrap()
    }
    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

/// zram's notion of a same-filled page: every machine word (8 bytes) equal.
pub fn is_same_filled(page: &[u8]) -> bool {
    let first = &page[..8];
    page.chunks(8).all(|w| w == first)
}

const WORDS: &str = "the page memory kernel swap compress store pool of and to zram frontswap \
    cleancache allocator fn let mut return error struct impl { } ( ) ; 0x0 NULL if else while for \
    transcendent hypervisor balloon a is in with that value";

/// Generates `pages` pages: ~20% zero, ~5% byte-filled, ~5% word-filled (all
/// three same-filled), ~25% short repeating patterns (period not a divisor of 8,
/// so not same-filled), ~25% text-like, ~20% random.
pub fn generate(pages: usize, seed: u64) -> Pages {
    let words: Vec<&str> = WORDS.split_whitespace().collect();
    let mut rng = Rng::new(seed);
    let mut data = vec![0_u8; pages * PAGE];
    let (mut zero, mut same, mut pattern, mut text, mut random) = (0, 0, 0, 0, 0);
    for page in data.chunks_mut(PAGE) {
        match rng.below(20) {
            0..=3 => zero += 1,
            4 => {
                page.fill(u8::try_from(1 + rng.below(255)).unwrap());
                same += 1;
            }
            5 => {
                let word = (rng.next_u64() | 1).to_le_bytes();
                for w in page.chunks_mut(8) {
                    w.copy_from_slice(&word);
                }
                same += 1;
            }
            6..=10 => {
                // Period in 9..=200, never a multiple of 8's divisors only.
                let mut period = 9 + rng.below(192);
                if period.is_multiple_of(8) {
                    period += 1;
                }
                let mut pat = vec![0_u8; period];
                rng.fill(&mut pat);
                for (i, b) in page.iter_mut().enumerate() {
                    *b = pat[i % period];
                }
                pattern += 1;
            }
            11..=15 => {
                let mut pos = 0;
                while pos < PAGE {
                    let word = words[rng.below(words.len())].as_bytes();
                    let sep: &[u8] = if rng.below(12) == 0 { b"\n" } else { b" " };
                    for &b in word.iter().chain(sep) {
                        if pos < PAGE {
                            page[pos] = b;
                            pos += 1;
                        }
                    }
                }
                text += 1;
            }
            _ => {
                rng.fill(page);
                random += 1;
            }
        }
    }
    Pages { data, pages, same_filled: zero + same, zero, pattern, text, random }
}
