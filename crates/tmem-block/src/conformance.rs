//! The conformance suite every [`BlockDevice`] that stores data passes
//! (like `tmem_tier::conformance` for tiers): it behaves like a byte array
//! of its size. Call [`check`] from a test of the implementation with a
//! fresh device of at least 1 MiB; property tests drive [`check_ops`] with
//! generated operations. [`check_data`] is the suite without extents, for
//! a device that cannot tell holes from zeros: a transport's block device
//! seen through the kernel ([`crate::NodeDevice`]).

use crate::{BlockDevice, BlockError, PAGE_SIZE};

/// One operation on a device, replayed on a byte-array oracle as well.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Writes `len` bytes of [`pattern`]`(len, seed)` at `offset`.
    Write {
        /// Byte offset.
        offset: u64,
        /// Length.
        len: usize,
        /// Pattern seed.
        seed: u64,
    },
    /// Reads `len` bytes at `offset` and compares them with the oracle.
    Read {
        /// Byte offset.
        offset: u64,
        /// Length.
        len: usize,
    },
    /// Discards a range.
    Trim {
        /// Byte offset.
        offset: u64,
        /// Length.
        len: u64,
    },
    /// Zeroes a range.
    Zero {
        /// Byte offset.
        offset: u64,
        /// Length.
        len: u64,
    },
}

/// Deterministic bytes, compressible but not same-filled.
#[allow(clippy::cast_possible_truncation)] // byte patterns
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len as u64).map(|i| ((i * 7 + (seed % 1000) * 13) % 97) as u8).collect()
}

fn at(offset: u64) -> usize {
    usize::try_from(offset).expect("device offsets fit in usize on the targets tmem runs on")
}

/// Replays `ops` on `dev` and on a byte array, comparing every read, the
/// final contents, and the extents (they cover the device; holes read as
/// zeros). Panics on the first difference.
pub fn check_ops(dev: &dyn BlockDevice, ops: &[Op]) {
    replay(dev, ops, true);
}

fn replay(dev: &dyn BlockDevice, ops: &[Op], extents: bool) {
    let mut oracle = vec![0u8; at(dev.size())];
    for op in ops {
        match *op {
            Op::Write { offset, len, seed } => {
                let data = pattern(len, seed);
                dev.write_at(&data, offset).unwrap_or_else(|e| panic!("write {offset}+{len}: {e}"));
                oracle[at(offset)..at(offset) + len].copy_from_slice(&data);
            }
            Op::Read { offset, len } => {
                let mut buf = vec![0xAA; len];
                dev.read_at(&mut buf, offset).unwrap_or_else(|e| panic!("read {offset}+{len}: {e}"));
                assert!(buf == oracle[at(offset)..at(offset) + len], "read {offset}+{len} differs");
            }
            Op::Trim { offset, len } => {
                dev.trim(offset, len).unwrap_or_else(|e| panic!("trim {offset}+{len}: {e}"));
                oracle[at(offset)..at(offset + len)].fill(0);
            }
            Op::Zero { offset, len } => {
                dev.write_zeroes(offset, len).unwrap_or_else(|e| panic!("write-zeroes {offset}+{len}: {e}"));
                oracle[at(offset)..at(offset + len)].fill(0);
            }
        }
    }
    let mut all = vec![0u8; oracle.len()];
    dev.read_at(&mut all, 0).expect("read the whole device");
    assert!(all == oracle, "final contents differ");
    if !extents {
        return;
    }
    let ext = dev.extents(0, dev.size()).expect("extents of the whole device");
    assert_eq!(ext.iter().map(|e| e.len).sum::<u64>(), dev.size(), "extents cover the device");
    let mut pos = 0usize;
    for e in ext {
        if e.hole {
            assert!(oracle[pos..pos + at(e.len)].iter().all(|&b| b == 0), "a hole at {pos} holds data");
        }
        pos += at(e.len);
    }
}

/// The whole suite on a fresh device of at least 1 MiB: unaligned writes
/// across page boundaries, partial and whole-page trims and zeroing, a
/// flush, ranges beyond the end refused with EINVAL, and the oracle replay.
pub fn check(dev: &dyn BlockDevice) {
    suite(dev, true);
}

/// [`check`] without extents.
pub fn check_data(dev: &dyn BlockDevice) {
    suite(dev, false);
}

fn suite(dev: &dyn BlockDevice, extents: bool) {
    let size = dev.size();
    assert!(
        size >= 1 << 20 && size.is_multiple_of(PAGE_SIZE as u64),
        "the suite needs a page-aligned device of at least 1 MiB"
    );
    let page = PAGE_SIZE as u64;
    // A fresh device reads as zeros and is one hole.
    let mut head = vec![0xAAu8; 3 * PAGE_SIZE];
    dev.read_at(&mut head, 0).expect("read a fresh device");
    assert!(head.iter().all(|&b| b == 0), "a fresh device reads as zeros");
    if extents {
        assert!(dev.extents(0, size).expect("extents").iter().all(|e| e.hole), "a fresh device is one hole");
    }
    let ops = [
        Op::Write { offset: 100, len: 3 * PAGE_SIZE, seed: 1 },
        Op::Read { offset: 0, len: 4 * PAGE_SIZE },
        Op::Write { offset: page - 1, len: 2, seed: 2 },
        Op::Read { offset: page - 10, len: 20 },
        Op::Trim { offset: page, len: page },
        Op::Read { offset: 0, len: 4 * PAGE_SIZE },
        Op::Zero { offset: 50, len: 100 },
        Op::Write { offset: size - 3 * page - 5, len: 3 * PAGE_SIZE + 5, seed: 3 },
        Op::Trim { offset: size - page - 1, len: 1 },
        Op::Zero { offset: size - 2 * page, len: 2 * page },
        Op::Read { offset: size - 4 * page, len: 4 * PAGE_SIZE },
        Op::Write { offset: 5 * page, len: 64 * PAGE_SIZE, seed: 4 },
        Op::Trim { offset: 5 * page + 100, len: 10 * page },
        Op::Read { offset: 4 * page, len: 70 * PAGE_SIZE },
    ];
    replay(dev, &ops, extents);
    dev.flush().expect("flush");
    let out_of_range = |r: Result<(), BlockError>, what: &str| match r {
        Err(e) => assert_eq!(e.errno(), libc::EINVAL, "{what}: {e}"),
        Ok(()) => panic!("{what} beyond the end was accepted"),
    };
    out_of_range(dev.write_at(&[1, 2], size - 1), "write");
    out_of_range(dev.read_at(&mut [0u8; 2], size - 1), "read");
    out_of_range(dev.trim(size, 1), "trim");
    out_of_range(dev.write_zeroes(u64::MAX, 2), "write-zeroes");
    if extents {
        assert!(dev.extents(size - 1, 2).is_err(), "extents beyond the end");
    }
}
