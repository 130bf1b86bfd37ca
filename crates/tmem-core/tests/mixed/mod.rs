//! The pages and operations of the hand-over tests, shared by
//! `handover.rs` and `precopy.rs`.

use proptest::prelude::*;
use tmem_core::{GetOutcome, Key, Store, PAGE_SIZE};

/// One step of a hand-over test's store. Each test generates the kinds it
/// runs, so some are never made in one of them.
#[derive(Clone, Debug)]
#[allow(dead_code)]
pub enum Op {
    Put {
        pool: usize,
        index: u64,
        kind: u8,
        seed: u64,
    },
    Get {
        pool: usize,
        index: u64,
    },
    Flush {
        pool: usize,
        index: u64,
    },
    /// Switches new puts to zstd:1 (a codec registered mid-way).
    Zstd,
    /// A grouping pass that groups every page it may.
    Group,
    Compact,
    Recompress,
    WriteBack,
    /// Creates a pool and puts into it.
    NewPool,
}

/// Puts, gets and flushes of indexes below `indexes` in pools 0-2, in
/// the proportions `weights`.
pub fn page_op(indexes: u64, weights: [u32; 3]) -> impl Strategy<Value = Op> {
    prop_oneof![
        weights[0] => (0..3usize, 0..indexes, any::<u8>(), any::<u64>())
            .prop_map(|(pool, index, kind, seed)| Op::Put { pool, index, kind, seed }),
        weights[1] => (0..3usize, 0..indexes).prop_map(|(pool, index)| Op::Get { pool, index }),
        weights[2] => (0..3usize, 0..indexes).prop_map(|(pool, index)| Op::Flush { pool, index }),
    ]
}

/// A page of one of three kinds: compressible text-like bytes, random bytes
/// (stored raw or refused), or one repeated word.
pub fn page(kind: u8, seed: u64) -> [u8; PAGE_SIZE] {
    let mut p = [0u8; PAGE_SIZE];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for (i, b) in p.iter_mut().enumerate() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = match kind % 3 {
            0 => b"the quick brown fox "[(i + (x as usize % 3)) % 20],
            1 => x.to_le_bytes()[0],
            _ => (seed as u8) | 1,
        };
    }
    p
}

/// Pages 0..`indexes` of pool `id` (object 1) are the same in `a` and
/// `b`, byte for byte, and so are the pool's settings.
pub fn same_pages_of(a: &Store, b: &Store, id: u32, indexes: u64) {
    let (mut x, mut y) = ([0u8; PAGE_SIZE], [0u8; PAGE_SIZE]);
    let (pa, pb) = (a.pool(id).unwrap(), b.pool(id).unwrap());
    assert_eq!(pa.config(), pb.config());
    for index in 0..indexes {
        let key = Key::new(1, index);
        let ga = pa.get(key, &mut x).unwrap();
        let gb = pb.get(key, &mut y).unwrap();
        assert_eq!(ga, gb, "pool {id} page {index}");
        if ga == GetOutcome::Hit {
            assert!(x == y, "pool {id} page {index} differs");
        }
    }
}
