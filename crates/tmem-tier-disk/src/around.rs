//! Read-around: a single get from disk reads the [`AROUND_BYTES`] that
//! start at its value's page, and later gets of values inside that span are
//! copied from it.
//!
//! The pool writes its victims back sorted by key (neighbours side by
//! side), but the kernel asks for most swapped pages one at a time: on the
//! python job of `tmem bench pressure`, 1.2 pages a read request. So the
//! neighbours of a page read now come one request later each, and a read of
//! 16 KiB (about 9 values, one I/O on any disk) answers them. On that job
//! (640 MiB at 50 %, a 64 MiB pool) the reads per page read back fell from
//! 0.66 to 0.51 with 8 spans and to 0.43 with 32 (16 KiB each; 32 KiB
//! spans, 16 of them, gave 0.41). The [`SPANS`] buffers (512 KiB) are
//! allocated at build. A span is only as good as its segment's generation:
//! a freed segment bumps it under the state lock, so a span whose
//! generation still matches under that lock holds the bytes the index
//! points at (a sealed segment never changes in place).

use tmem_sys::aligned::AlignedBuf;

/// Bytes one single get reads: 4 pages.
pub(crate) const AROUND_BYTES: usize = 16 << 10;
/// Spans kept; a reader that finds none free reads as if there were none.
pub(crate) const SPANS: usize = 32;

/// Part of the file held in memory.
pub(crate) struct Span {
    buf: AlignedBuf,
    seg: u32,
    /// File offset of `buf[0]`.
    start: u64,
    /// Bytes of `buf` read (0: holds nothing).
    len: usize,
    /// The segment's generation over the read.
    gen: u64,
}

impl Span {
    /// The buffer to read `len` bytes into (at most [`AROUND_BYTES`]).
    pub(crate) fn buf(&mut self, len: usize) -> &mut [u8] {
        &mut self.buf[..len]
    }

    /// Marks the buffer as holding `len` bytes from `start` of segment
    /// `seg` at generation `gen`, or nothing (`len` 0).
    pub(crate) fn set(&mut self, seg: u32, start: u64, len: usize, gen: u64) {
        (self.seg, self.start, self.len, self.gen) = (seg, start, len, gen);
    }
}

/// The spans, under the tier's state lock.
pub(crate) struct ReadAround {
    spans: Vec<Option<Span>>,
    /// The slot the next [`ReadAround::take`] empties.
    next: usize,
}

impl ReadAround {
    pub(crate) fn new() -> Self {
        let span = || Some(Span { buf: AlignedBuf::zeroed(AROUND_BYTES), seg: 0, start: 0, len: 0, gen: 0 });
        Self { spans: (0..SPANS).map(|_| span()).collect(), next: 0 }
    }

    /// Copies the `len` bytes at file offset `at` of segment `seg` into
    /// `out` if a span read at generation `gen` holds them.
    pub(crate) fn copy(&self, seg: u32, at: u64, len: usize, gen: u64, out: &mut Vec<u8>) -> bool {
        let held = self.spans.iter().flatten().find(|s| {
            s.len > 0 && s.seg == seg && s.gen == gen && at >= s.start && at + len as u64 <= s.start + s.len as u64
        });
        let Some(s) = held else { return false };
        let skip = usize::try_from(at - s.start).expect("inside the span");
        out.extend_from_slice(&s.buf[skip..skip + len]);
        true
    }

    /// Takes the oldest span out to read into (None: every span is being
    /// read into by another get).
    pub(crate) fn take(&mut self) -> Option<Span> {
        for _ in 0..SPANS {
            let i = self.next;
            self.next = (self.next + 1) % SPANS;
            if let Some(s) = self.spans[i].take() {
                return Some(s);
            }
        }
        None
    }

    /// Forgets what every span holds.
    #[cfg(test)]
    pub(crate) fn clear(&mut self) {
        for s in self.spans.iter_mut().flatten() {
            s.len = 0;
        }
    }

    /// Puts a span back, filled or not.
    pub(crate) fn put(&mut self, span: Span) {
        let empty = self.spans.iter_mut().find(|s| s.is_none()).expect("a span taken leaves its slot empty");
        *empty = Some(span);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_span_answers_only_inside_itself_and_at_its_generation() {
        let mut a = ReadAround::new();
        let mut s = a.take().unwrap();
        let byte = |i: usize| u8::try_from(i % 251).unwrap();
        s.buf(AROUND_BYTES).iter_mut().enumerate().for_each(|(i, b)| *b = byte(i));
        s.set(3, 1 << 20, 8192, 7);
        a.put(s);
        let mut out = Vec::new();
        assert!(a.copy(3, (1 << 20) + 100, 50, 7, &mut out));
        assert_eq!(out, (100..150).map(byte).collect::<Vec<_>>());
        for (seg, at, len, gen) in
            [(4, (1 << 20) + 100, 50, 7), (3, (1 << 20) + 100, 50, 8), (3, (1 << 20) + 8000, 500, 7)]
        {
            assert!(!a.copy(seg, at, len, gen, &mut Vec::new()), "{seg} {at} {len} {gen}");
        }
        assert!(!a.copy(3, (1 << 20) - 1, 10, 7, &mut Vec::new()), "starts before the span");
    }

    #[test]
    fn every_span_can_be_taken_and_put_back() {
        let mut a = ReadAround::new();
        let taken: Vec<Span> = (0..SPANS).map(|_| a.take().unwrap()).collect();
        assert!(a.take().is_none(), "all out");
        for s in taken {
            a.put(s);
        }
        assert!(a.take().is_some());
    }
}
