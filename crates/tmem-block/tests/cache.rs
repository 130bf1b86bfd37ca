//! The cache device (issue 14): the conformance suite, a model-based test
//! against a plain file, the shared budget with a swap device, and backing
//! store errors.

// Test code indexes byte arrays with device offsets; the tests run on 64-bit targets.
#![allow(clippy::cast_possible_truncation)]

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use proptest::prelude::*;
use tmem_block::conformance::{self, pattern};
use tmem_block::{BlockDevice, CacheConfig, CacheDevice, DeviceConfig};
use tmem_core::{Eviction, Key, PolicyConfig, StoreConfig, PAGE_SIZE};

const SIZE: u64 = 1 << 20;

/// A sparse backing file of `size` bytes in `dir`.
fn backing(dir: &Path, size: u64) -> std::path::PathBuf {
    let path = dir.join("backing.img");
    std::fs::File::create(&path).unwrap().set_len(size).unwrap();
    path
}

fn cache(path: &Path, pool_bytes: u64, eviction: Eviction) -> CacheDevice {
    CacheConfig {
        name: "cache0".into(),
        backing: path.to_owned(),
        store: StoreConfig {
            policy: PolicyConfig { max_pool_bytes: pool_bytes, ..Default::default() },
            ..Default::default()
        },
        eviction,
        backing_latency: std::time::Duration::ZERO,
    }
    .build()
    .unwrap()
}

#[test]
fn cache_devices_pass_the_conformance_suite() {
    for (pool_bytes, eviction) in [(0, Eviction::Sieve), (64 << 10, Eviction::Sieve), (64 << 10, Eviction::Lru)] {
        let dir = tempfile::tempdir().unwrap();
        let dev = cache(&backing(dir.path(), 4 * SIZE), pool_bytes, eviction);
        conformance::check(&dev);
        let st = dev.stats();
        let b = st.backing.as_ref().unwrap();
        assert!(b.backing_reads > 0 && b.backing_writes > 0 && b.backing_syncs == 1, "{b:?}");
    }
}

#[test]
fn reads_are_served_from_the_pool_once_cached() {
    let dir = tempfile::tempdir().unwrap();
    let path = backing(dir.path(), SIZE);
    let data = pattern(SIZE as usize, 7);
    std::fs::File::options().write(true).open(&path).unwrap().write_all_at(&data, 0).unwrap();
    let dev = cache(&path, 0, Eviction::Sieve);
    let mut buf = vec![0u8; SIZE as usize];
    dev.read_at(&mut buf, 0).unwrap();
    assert_eq!(buf, data);
    let first = dev.stats().backing.unwrap().backing_read_bytes;
    assert_eq!(first, SIZE, "the first read comes from the backing store");
    for _ in 0..3 {
        dev.read_at(&mut buf, 0).unwrap();
        assert_eq!(buf, data);
    }
    let st = dev.stats();
    assert_eq!(st.backing.unwrap().backing_read_bytes, first, "later reads come from the pool");
    assert_eq!(st.store.total.succ_gets, 3 * SIZE / PAGE_SIZE as u64);
}

#[derive(Clone, Debug)]
enum CacheOp {
    Io(conformance::Op),
    Flush,
    /// Drops one page from the pool, as eviction would.
    Evict(u64),
    /// Drops every page.
    EvictAll,
}

fn cache_op() -> impl Strategy<Value = CacheOp> {
    use conformance::Op;
    let off = 0..SIZE - 300_000;
    prop_oneof![
        4 => (off.clone(), 1usize..300_000, any::<u64>())
            .prop_map(|(offset, len, seed)| CacheOp::Io(Op::Write { offset, len, seed })),
        5 => (off.clone(), 1usize..300_000).prop_map(|(offset, len)| CacheOp::Io(Op::Read { offset, len })),
        1 => (off.clone(), 1u64..40_000).prop_map(|(offset, len)| CacheOp::Io(Op::Trim { offset, len })),
        1 => (off, 1u64..40_000).prop_map(|(offset, len)| CacheOp::Io(Op::Zero { offset, len })),
        1 => Just(CacheOp::Flush),
        2 => (0..SIZE / PAGE_SIZE as u64).prop_map(CacheOp::Evict),
        1 => Just(CacheOp::EvictAll),
    ]
}

/// Replays `ops` on a cache device and on a byte array: every read matches
/// the array, and the backing file holds exactly the array after every
/// operation (write-through: an acknowledged write is in the backing store).
fn check_against_file(ops: &[CacheOp], pool_bytes: u64, eviction: Eviction) {
    use conformance::Op;
    let dir = tempfile::tempdir().unwrap();
    let path = backing(dir.path(), SIZE);
    let dev = cache(&path, pool_bytes, eviction);
    let file = std::fs::File::open(&path).unwrap();
    let mut oracle = vec![0u8; SIZE as usize];
    let mut on_disk = vec![0u8; SIZE as usize];
    for (i, op) in ops.iter().enumerate() {
        match op {
            CacheOp::Io(Op::Write { offset, len, seed }) => {
                let data = pattern(*len, *seed);
                dev.write_at(&data, *offset).unwrap();
                oracle[*offset as usize..*offset as usize + len].copy_from_slice(&data);
            }
            CacheOp::Io(Op::Read { offset, len }) => {
                let mut buf = vec![0xEEu8; *len];
                dev.read_at(&mut buf, *offset).unwrap();
                assert!(buf == oracle[*offset as usize..*offset as usize + len], "op {i}: read {offset}+{len} differs");
            }
            CacheOp::Io(Op::Trim { offset, len }) => {
                dev.trim(*offset, *len).unwrap();
                oracle[*offset as usize..(*offset + len) as usize].fill(0);
            }
            CacheOp::Io(Op::Zero { offset, len }) => {
                dev.write_zeroes(*offset, *len).unwrap();
                oracle[*offset as usize..(*offset + len) as usize].fill(0);
            }
            CacheOp::Flush => dev.flush().unwrap(),
            CacheOp::Evict(page) => drop(dev.pool().flush_page(Key::new(0, *page)).unwrap()),
            CacheOp::EvictAll => drop(dev.pool().flush_object(0).unwrap()),
        }
        file.read_exact_at(&mut on_disk, 0).unwrap();
        assert!(on_disk == oracle, "op {i} ({op:?}): the backing file differs");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]
    #[test]
    fn cache_device_matches_a_plain_file(ops in prop::collection::vec(cache_op(), 1..30)) {
        check_against_file(&ops, 0, Eviction::Sieve);
    }

    /// A 48 KiB pool: most fills and writes evict other pages.
    #[test]
    fn a_tiny_cache_matches_a_plain_file(ops in prop::collection::vec(cache_op(), 1..30), lru in any::<bool>()) {
        check_against_file(&ops, 48 << 10, if lru { Eviction::Lru } else { Eviction::Sieve });
    }
}

/// Pages that compress about 2:1: half random bytes, half zeros.
fn half_random(len: usize, seed: u64) -> Vec<u8> {
    use rand_xoshiro::rand_core::{RngCore, SeedableRng};
    let mut rng = rand_xoshiro::Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut v = vec![0u8; len];
    for page in v.chunks_mut(PAGE_SIZE) {
        let half = page.len() / 2;
        rng.fill_bytes(&mut page[..half]);
    }
    v
}

/// The shared budget at device level: swap writes into the store the cache
/// filled evict cached pages, are never refused while any remain, and the
/// cache never evicts a swap page.
#[test]
fn swap_writes_evict_cached_pages_and_never_the_reverse() {
    let swap = DeviceConfig {
        name: "swap0".into(),
        size: 8 * SIZE,
        store: StoreConfig {
            policy: PolicyConfig { max_pool_bytes: 2 << 20, ..Default::default() },
            ..Default::default()
        },
        tiers: None,
        recompress: None,
    }
    .build()
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = backing(dir.path(), 8 * SIZE);
    std::fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .write_all_at(&half_random(8 * SIZE as usize, 3), 0)
        .unwrap();
    let cfg = CacheConfig {
        name: "cache0".into(),
        backing: path,
        store: StoreConfig::default(),
        eviction: Eviction::Sieve,
        backing_latency: std::time::Duration::ZERO,
    };
    let cache = cfg.build_on(swap.shared_store()).unwrap();
    let mut buf = vec![0u8; 8 * SIZE as usize];
    cache.read_at(&mut buf, 0).unwrap();
    let cached = cache.pool().stats().stored_pages;
    assert!(cached > 200 && cached < 2048, "the cache took the budget: {cached} pages");
    // Swap writes compressible pages through a 2 MiB budget shared
    // with the cache: each is stored while cache pages remain.
    let page = half_random(PAGE_SIZE, 9);
    let mut written = 0u64;
    while cache.pool().stats().stored_pages > 0 && written < 8 * SIZE {
        match swap.write_at(&page, written) {
            Ok(()) => written += PAGE_SIZE as u64,
            Err(e) => {
                // Refused only once eviction has emptied the cache.
                let left = cache.pool().stats().stored_pages;
                assert_eq!(left, 0, "swap write at {written} refused with {left} cache pages left: {e}");
                break;
            }
        }
    }
    let st = cache.pool().stats();
    assert!(st.evicted_for_persistent > 0 && st.stored_pages < cached, "{st:?}");
    // Cache reads now refill without touching a swap page.
    let swap_pages = swap.stats().store.pools[0].stored_pages;
    cache.read_at(&mut buf, 0).unwrap();
    assert!(buf == half_random(8 * SIZE as usize, 3));
    assert_eq!(swap.stats().store.pools[0].stored_pages, swap_pages, "a cache fill moved a swap page");
    let mut back = vec![0u8; PAGE_SIZE];
    for p in 0..written / PAGE_SIZE as u64 {
        swap.read_at(&mut back, p * PAGE_SIZE as u64).unwrap();
        assert!(back == page, "swap page {p}");
    }
}

/// A backing store error fails the request with its errno; it is never
/// answered with cached or zero data.
#[test]
fn backing_store_errors_reach_the_client() {
    let dir = tempfile::tempdir().unwrap();
    let path = backing(dir.path(), SIZE);
    let dev = Arc::new(cache(&path, 0, Eviction::Sieve));
    let mut buf = vec![0u8; 2 * PAGE_SIZE];
    dev.read_at(&mut buf, 0).unwrap();
    // The backing file shrinks under the device: uncached pages cannot be read.
    std::fs::File::options().write(true).open(&path).unwrap().set_len(SIZE / 2).unwrap();
    let e = dev.read_at(&mut buf, SIZE - 2 * PAGE_SIZE as u64).unwrap_err();
    assert_eq!(e.errno(), libc::EIO, "{e}");
    assert!(e.to_string().contains("backing store"), "{e}");
    let st = dev.stats();
    assert_eq!(st.failed_reads, 1);
    assert_eq!(st.backing.unwrap().backing_errors, 1);
    // A read through the same pages the cache holds still works.
    dev.read_at(&mut buf, 0).unwrap();
}
