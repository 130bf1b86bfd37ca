//! The allocator against a `Vec` oracle: the input is a sequence of
//! alloc(len, fill) / free(i) / compact operations (compaction optionally
//! interleaved with frees and allocations). After each operation the objects
//! of the size class it touched are read back (every object after a
//! compaction, and all of them every 16 operations and at the end), and the
//! counters are checked against the oracle.

#![no_main]

mod common;

use common::Cursor;
use libfuzzer_sys::fuzz_target;
use tmem_core::alloc::{AllocConfig, AllocError, Loc, ZsAlloc};
use tmem_core::PAGE_SIZE;

const MAX_LIVE: usize = 384;
const SIZES: [usize; 12] = [1, 2, 15, 16, 17, 100, 1000, 1001, 2048, 3000, 4095, 4096];

struct Obj {
    loc: Loc,
    len: usize,
    id: u32,
    fill: u8,
}

fn contents(id: u32, fill: u8, len: usize) -> Vec<u8> {
    let salt = id.to_le_bytes();
    (0..len).map(|j| fill ^ salt[j % 4] ^ j.to_le_bytes()[0].wrapping_mul(31) ^ j.to_le_bytes()[1]).collect()
}

struct State {
    a: ZsAlloc,
    live: Vec<Obj>,
    next_id: u32,
}

impl State {
    fn read(&self, o: &Obj) -> &[u8] {
        // SAFETY: single-threaded; `o.loc` is a live allocation of `o.len`
        // bytes that is neither freed nor migrated while the slice is used.
        unsafe { self.a.object(o.loc, o.len) }
    }

    fn check(&self, o: &Obj, what: &str) {
        let want = contents(o.id, o.fill, o.len);
        let got = self.read(o);
        if got != want.as_slice() {
            let at = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
            panic!("{what}: object {} ({} bytes at {:?}) differs from byte {at}", o.id, o.len, o.loc);
        }
    }

    fn verify_class(&self, len: usize, what: &str) {
        let class = self.a.class_of(len).expect("valid size");
        for o in self.live.iter().filter(|o| self.a.class_of(o.len).ok() == Some(class)) {
            self.check(o, what);
        }
    }

    fn verify_all(&self, what: &str) {
        for o in &self.live {
            self.check(o, what);
        }
    }

    fn verify_stats(&self) {
        let st = self.a.stats();
        assert_eq!(st.objects, self.live.len() as u64, "object count");
        let slots: u64 = self.live.iter().map(|o| self.a.slot_size(o.loc) as u64).sum();
        assert_eq!(st.slot_bytes, slots, "slot bytes");
        assert!(st.span_bytes >= st.slot_bytes);
        if self.live.is_empty() {
            assert_eq!(st.span_bytes, 0, "empty allocator holds spans");
        }
        for o in &self.live {
            assert!(self.a.slot_size(o.loc) >= o.len);
        }
    }

    fn alloc(&mut self, len: usize, fill: u8) {
        let id = self.next_id;
        self.next_id += 1;
        let loc = self.a.alloc_write(&contents(id, fill, len)).expect("alloc of a valid size");
        assert!(self.live.iter().all(|o| o.loc != loc), "{loc:?} handed out twice");
        self.live.push(Obj { loc, len, id, fill });
        self.verify_class(len, "after alloc");
    }

    fn free(&mut self, i: usize) {
        let o = self.live.swap_remove(i);
        self.a.free(o.loc);
        self.verify_class(o.len, "after free");
    }

    /// Compaction; with `c`, objects may be freed or left unmigrated and new
    /// ones allocated while it runs.
    fn compact(&mut self, mut c: Option<&mut Cursor<'_>>) {
        let plan = self.a.plan_compaction();
        let mut i = 0;
        while i < self.live.len() {
            let action = c.as_deref_mut().map_or(0, |c| c.below(8));
            if plan.contains(self.live[i].loc) {
                match action {
                    // Freed by its owner before compaction reached it.
                    6 => {
                        let o = self.live.swap_remove(i);
                        self.a.free(o.loc);
                        continue;
                    }
                    // Not reached (the owner was busy): stays in its span.
                    7 => {}
                    _ => {
                        let o = &mut self.live[i];
                        o.loc = self.a.migrate(o.loc, o.len).expect("migrate");
                    }
                }
            }
            if action == 5 && self.live.len() < MAX_LIVE {
                if let Some(c) = c.as_deref_mut() {
                    let len = usize::from(c.u16()) % PAGE_SIZE + 1;
                    let fill = c.u8();
                    let id = self.next_id;
                    self.next_id += 1;
                    let loc = self.a.alloc_write(&contents(id, fill, len)).expect("alloc");
                    assert!(self.live.iter().all(|o| o.loc != loc), "{loc:?} handed out twice");
                    self.live.push(Obj { loc, len, id, fill });
                }
            }
            i += 1;
        }
        self.a.finish_compaction(plan);
        self.verify_all("after compaction");
    }
}

fuzz_target!(|data: &[u8]| {
    let mut c = Cursor::new(data);
    let cfg = AllocConfig {
        max_span_pages: c.below(16) + 1,
        merge_permille: [0, 30, 100, 1000][c.below(4)],
    };
    let mut s = State { a: ZsAlloc::with_config(cfg), live: Vec::new(), next_id: 0 };
    let mut ops = 0u32;
    while !c.is_empty() {
        match c.below(16) {
            0..=5 => {
                if s.live.len() >= MAX_LIVE {
                    let i = c.below(s.live.len());
                    s.free(i);
                } else {
                    let sel = c.u8();
                    let len = if sel & 0x80 != 0 {
                        SIZES[usize::from(sel) % SIZES.len()]
                    } else {
                        usize::from(c.u16()) % PAGE_SIZE + 1
                    };
                    // Runs of the same size fill spans of one class.
                    let count = if sel & 0x40 != 0 { usize::from(sel & 0x1f) + 1 } else { 1 };
                    let fill = c.u8();
                    for _ in 0..count.min(MAX_LIVE - s.live.len()) {
                        s.alloc(len, fill);
                    }
                }
            }
            6..=10 if !s.live.is_empty() => {
                let i = usize::from(c.u16()) % s.live.len();
                s.free(i);
            }
            11 if !s.live.is_empty() => {
                // Free every k-th object: sparse spans.
                let k = c.below(4) + 2;
                let mut i = 0;
                s.live.retain(|o| {
                    i += 1;
                    if i % k == 0 {
                        s.a.free(o.loc);
                        false
                    } else {
                        true
                    }
                });
            }
            12 | 13 => s.compact(None),
            14 => s.compact(Some(&mut c)),
            15 => {
                let bad = if c.u8() & 1 == 0 { 0 } else { PAGE_SIZE + 1 + usize::from(c.u8()) };
                assert!(matches!(s.a.alloc_write(&vec![0u8; bad]), Err(AllocError::BadSize(n)) if n == bad));
            }
            _ => {}
        }
        s.verify_stats();
        ops += 1;
        if ops % 16 == 0 {
            s.verify_all("periodic check");
        }
    }
    s.verify_all("at the end");
    s.compact(None);
    for o in s.live.drain(..) {
        s.a.free(o.loc);
    }
    let st = s.a.stats();
    assert_eq!((st.objects, st.slot_bytes, st.span_bytes), (0, 0, 0), "allocator not empty after freeing everything");
});
