//! Shared helpers of the fuzz targets: a byte cursor over the fuzz input and
//! page generators.

#![allow(dead_code)] // not every target uses every helper

use tmem_core::codec::fill_page;
use tmem_core::PAGE_SIZE;

pub type Page = [u8; PAGE_SIZE];

/// Reads the fuzz input front to back; past the end every read is 0.
pub struct Cursor<'a> {
    data: &'a [u8],
}

impl<'a> Cursor<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Self { data }
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    pub fn u8(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    pub fn u64(&mut self) -> u64 {
        let mut b = [0u8; 8];
        for x in &mut b {
            *x = self.u8();
        }
        u64::from_le_bytes(b)
    }

    /// Up to `max` bytes.
    pub fn bytes(&mut self, max: usize) -> &'a [u8] {
        let n = max.min(self.data.len());
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        head
    }

    /// A value in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        usize::from(self.u8()) % n
    }
}

pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

pub fn fill_random(dst: &mut [u8], seed: u64) {
    let mut r = Rng::new(seed);
    for b in dst {
        *b = r.next().to_le_bytes()[0];
    }
}

pub fn fill_text(dst: &mut [u8], seed: u64) {
    const WORDS: [&[u8]; 10] = [
        b"the ", b"page ", b"store ", b"{\"key\": ", b"\"value\"}, ", b"0x7f3a2c00 ", b"return ", b"static int ",
        b"\n    ", b"frontswap ",
    ];
    let mut r = Rng::new(seed);
    let mut i = 0;
    while i < dst.len() {
        let w = WORDS[usize::try_from(r.next() % WORDS.len() as u64).unwrap_or(0)];
        let n = w.len().min(dst.len() - i);
        dst[i..i + n].copy_from_slice(&w[..n]);
        i += n;
    }
}

/// A dictionary trained on 64 pages of [`fill_text`], for the codecs
/// that take one.
pub fn text_dictionary() -> std::sync::Arc<[u8]> {
    let samples: Vec<Page> = (0..64)
        .map(|i| {
            let mut p = [0u8; PAGE_SIZE];
            fill_text(&mut p, i);
            p
        })
        .collect();
    tmem_core::codec::train_dictionary(samples.iter(), 8192).expect("dictionary")
}

/// Repeats `pattern` over `dst` (zeros if it is empty).
pub fn tile(dst: &mut [u8], pattern: &[u8]) {
    if pattern.is_empty() {
        dst.fill(0);
        return;
    }
    for (d, s) in dst.iter_mut().zip(pattern.iter().cycle()) {
        *d = *s;
    }
}

/// A page chosen and shaped by the input: zero, same-filled, nearly
/// same-filled, text, random, random+text, or input bytes tiled.
pub fn page_from(c: &mut Cursor<'_>) -> Page {
    let mut p = [0u8; PAGE_SIZE];
    match c.below(8) {
        0 => {}
        1 => fill_page(&mut p, c.u64()),
        2 => {
            fill_page(&mut p, c.u64());
            let at = usize::from(c.u16()) % PAGE_SIZE;
            p[at] ^= c.u8() | 1;
        }
        3 => fill_text(&mut p, u64::from(c.u16())),
        4 => fill_random(&mut p, u64::from(c.u16())),
        5 => {
            let split = usize::from(c.u16()) % PAGE_SIZE;
            let seed = u64::from(c.u8());
            fill_random(&mut p[..split], seed);
            fill_text(&mut p[split..], seed);
        }
        _ => {
            let n = c.below(64) + 1;
            tile(&mut p, c.bytes(n));
        }
    }
    p
}
