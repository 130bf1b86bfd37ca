use super::*;
use crate::policy::Incompressible;
use rand_xoshiro::rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

#[allow(clippy::cast_possible_truncation)] // byte extraction
fn page(seed: u64) -> [u8; PAGE_SIZE] {
    let mut p = [0u8; PAGE_SIZE];
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut x = rng.next_u64();
    for (i, b) in p.iter_mut().enumerate() {
        // Compressible but not same-filled: runs of pseudo-random bytes.
        if i % 16 == 0 {
            x = rng.next_u64();
        }
        *b = (x >> ((i % 8) * 8)) as u8 & 0x3f;
    }
    p
}

fn key(i: u64) -> Key {
    Key { object: 1, index: i }
}

fn store(policy: PolicyConfig) -> Store {
    StoreConfig { policy, ..Default::default() }.build().unwrap()
}

#[test]
fn put_get_replace_flush() {
    let s = store(PolicyConfig::default());
    let p = s.create_pool(PoolConfig::persistent());
    let mut out = [0u8; PAGE_SIZE];
    assert_eq!(p.get(key(1), &mut out).unwrap(), GetOutcome::Miss);
    assert_eq!(p.put(key(1), &page(1)).unwrap(), PutOutcome::Stored);
    assert_eq!(p.put(key(1), &page(2)).unwrap(), PutOutcome::Stored);
    assert_eq!(p.get(key(1), &mut out).unwrap(), GetOutcome::Hit);
    assert_eq!(out, page(2));
    assert_eq!(p.stats().stored_pages, 1);
    assert!(p.flush_page(key(1)).unwrap());
    assert!(!p.flush_page(key(1)).unwrap());
    let st = s.stats();
    assert_eq!(st.total.stored_pages, 0);
    assert_eq!(st.total.compr_data_size, 0);
    assert_eq!(st.alloc.objects, 0);
    assert_eq!((st.total.succ_gets, st.total.failed_gets, st.total.flushes, st.total.puts), (1, 1, 1, 2));
}

#[test]
fn exclusive_gets_free_the_copy() {
    let s = store(PolicyConfig::default());
    let p = s.create_pool(PoolConfig::persistent().exclusive_gets(true));
    let mut out = [0u8; PAGE_SIZE];
    assert_eq!(p.put(key(3), &page(3)).unwrap(), PutOutcome::Stored);
    assert_eq!(p.get(key(3), &mut out).unwrap(), GetOutcome::Hit);
    assert_eq!(out, page(3));
    assert_eq!(p.get(key(3), &mut out).unwrap(), GetOutcome::Miss);
    assert_eq!(s.stats().alloc.objects, 0);
}

#[test]
fn same_filled_pages_use_no_pool_memory() {
    let s = store(PolicyConfig::default());
    let p = s.create_pool(PoolConfig::persistent());
    let mut pg = [0u8; PAGE_SIZE];
    fill_page(&mut pg, 0x0102_0304_0506_0708);
    for i in 0..100 {
        assert_eq!(p.put(key(i), &pg).unwrap(), PutOutcome::Stored);
    }
    let st = s.stats();
    assert_eq!(st.total.same_filled_pages, 100);
    assert_eq!(st.alloc.span_bytes, 0);
    let mut out = [1u8; PAGE_SIZE];
    assert_eq!(p.get(key(42), &mut out).unwrap(), GetOutcome::Hit);
    assert_eq!(out, pg);
}

#[allow(clippy::cast_possible_truncation)] // byte extraction
fn random_page(seed: u64) -> [u8; PAGE_SIZE] {
    let mut p = [0u8; PAGE_SIZE];
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    for b in p.iter_mut() {
        let x = rng.next_u64();
        *b = x as u8;
    }
    p
}

#[test]
fn incompressible_pages_by_policy() {
    let s = store(PolicyConfig::default());
    let p = s.create_pool(PoolConfig::persistent());
    assert_eq!(p.put(key(1), &page(1)).unwrap(), PutOutcome::Stored);
    // Default (zswap): reject, and the key's older copy is gone.
    assert_eq!(p.put(key(2), &page(2)).unwrap(), PutOutcome::Stored);
    assert_eq!(p.put(key(2), &random_page(9)).unwrap(), PutOutcome::Rejected(Reject::CompressPoor));
    let mut out = [0u8; PAGE_SIZE];
    assert_eq!(p.get(key(2), &mut out).unwrap(), GetOutcome::Miss, "stale copy must not survive a refused put");
    assert_eq!(p.stats().reject_compress_poor, 1);
    s.set_policy("incompressible", "store_raw").unwrap();
    assert_eq!(p.put(key(2), &random_page(9)).unwrap(), PutOutcome::Stored);
    assert_eq!(p.get(key(2), &mut out).unwrap(), GetOutcome::Hit);
    assert_eq!(out, random_page(9));
    assert_eq!(p.stats().stored_incompressible_pages, 1);
    // A tighter threshold makes ordinary pages incompressible too.
    s.set_policy("max_compressed_size", "64").unwrap();
    s.set_policy("incompressible", "reject").unwrap();
    assert_eq!(p.put(key(3), &page(3)).unwrap(), PutOutcome::Rejected(Reject::CompressPoor));
}

#[test]
fn freeze_refuses_puts_but_serves_gets() {
    let s = store(PolicyConfig::default());
    let p = s.create_pool(PoolConfig::persistent());
    assert_eq!(p.put(key(1), &page(1)).unwrap(), PutOutcome::Stored);
    s.set_policy("frozen", "1").unwrap();
    assert_eq!(p.put(key(2), &page(2)).unwrap(), PutOutcome::Rejected(Reject::Frozen));
    let mut out = [0u8; PAGE_SIZE];
    assert_eq!(p.get(key(1), &mut out).unwrap(), GetOutcome::Hit);
    assert!(p.flush_page(key(1)).unwrap());
    assert_eq!(p.stats().reject_frozen, 1);
    s.set_policy("frozen", "0").unwrap();
    assert_eq!(p.put(key(2), &page(2)).unwrap(), PutOutcome::Stored);
}

#[test]
fn pool_limit_rejects_persistent_and_evicts_ephemeral() {
    let s = store(PolicyConfig { max_pool_bytes: 2 << 20, ..Default::default() });
    let persistent = s.create_pool(PoolConfig::persistent());
    let mut stored = 0;
    let mut rejected = 0;
    for i in 0..4000 {
        match persistent.put(key(i), &page(i)).unwrap() {
            PutOutcome::Stored => stored += 1,
            PutOutcome::Rejected(Reject::PoolLimit) => rejected += 1,
            other => panic!("{other:?}"),
        }
    }
    assert!(stored > 100 && rejected > 0, "stored {stored} rejected {rejected}");
    assert!(persistent.stats().pool_limit_hit > 0);
    assert!(s.mem_used_total() <= (2 << 20) + PAGE_SIZE as u64 * 16);
    // Every stored persistent page is still there.
    let mut out = [0u8; PAGE_SIZE];
    let mut hits = 0;
    for i in 0..4000 {
        if p_get(&persistent, i, &mut out) {
            assert_eq!(out, page(i));
            hits += 1;
        }
    }
    assert_eq!(hits, persistent.stats().stored_pages);

    // Ephemeral pages make way for each other, oldest first.
    persistent.flush_object(1).unwrap();
    s.compact();
    let eph = s.create_pool(PoolConfig::ephemeral());
    for i in 0..4000 {
        assert_eq!(eph.put(key(i), &page(i)).unwrap(), PutOutcome::Stored, "ephemeral put {i}");
    }
    let st = eph.stats();
    assert!(st.evicted_pages > 0);
    assert!(p_get(&eph, 3999, &mut out), "newest page kept");
    assert!(!p_get(&eph, 0, &mut out), "oldest page dropped");
}

/// The shared budget (issue 14): persistent pages evict ephemeral ones,
/// never the reverse, and ephemeral space grows back when persistent pages go.
#[test]
fn persistent_pages_evict_ephemeral_ones_and_never_the_reverse() {
    let s = store(PolicyConfig { max_pool_bytes: 2 << 20, ..Default::default() });
    let swap = s.create_pool(PoolConfig::persistent());
    let cache = s.create_pool(PoolConfig::ephemeral());
    let mut out = [0u8; PAGE_SIZE];
    // The cache fills the whole budget.
    for i in 0..4000 {
        assert_eq!(cache.put(key(i), &page(i)).unwrap(), PutOutcome::Stored, "cache put {i}");
    }
    let cached = cache.stats().stored_pages;
    assert!(cached > 500, "{cached}");
    // Swap takes the budget back page by page, through both put paths: not
    // one swap page is refused while cache pages remain.
    let mut i = 0;
    while cache.stats().stored_pages > 0 {
        let outcome = if i % 2 == 0 {
            swap.put(key(i), &page(i + 10_000)).unwrap()
        } else {
            match swap.put_now(key(i), &page(i + 10_000)).unwrap() {
                PutOutcome::Rejected(Reject::PoolLimit) if swap.maintain() => {
                    swap.put_now(key(i), &page(i + 10_000)).unwrap()
                }
                other => other,
            }
        };
        if outcome != PutOutcome::Stored {
            // Refused only once eviction has emptied the cache.
            assert_eq!(cache.stats().stored_pages, 0, "swap put {i} refused ({outcome:?}) with cache pages left");
            break;
        }
        i += 1;
    }
    let swapped = i;
    assert!(swapped > cached / 2, "{swapped} swap pages took the room of {cached} cache pages");
    let st = cache.stats();
    assert_eq!(st.evicted_for_persistent + st.evicted_for_ephemeral, st.evicted_pages);
    assert!(st.evicted_for_persistent >= cached - 64, "{st:?}");
    // Now the store is swap's: cache puts are refused, and no swap page moves.
    let refused = (0..200)
        .filter(|&j| cache.put(key(50_000 + j), &page(j)).unwrap() == PutOutcome::Rejected(Reject::PoolLimit))
        .count();
    assert!(refused >= 190, "{refused} of 200 cache puts refused");
    for j in 0..swapped {
        assert!(p_get(&swap, j, &mut out), "swap page {j} lost");
        assert_eq!(out, page(j + 10_000));
    }
    assert_eq!(swap.stats().stored_pages, swapped);
    // Swap shrinks: the cache grows back into the room.
    swap.flush_object(1).unwrap();
    s.compact();
    let evicted = cache.stats().evicted_pages;
    for j in 0..cached / 2 {
        assert_eq!(cache.put(key(j), &page(j)).unwrap(), PutOutcome::Stored, "cache put {j} after swap shrank");
    }
    assert_eq!(cache.stats().stored_pages, cached / 2);
    assert_eq!(cache.stats().evicted_pages, evicted, "room enough without evicting");
}

/// SIEVE keeps pages that are read again over pages read once, where
/// strict LRU loses both to a scan: the hit ratio on a hot set under a
/// one-pass scan.
#[test]
fn sieve_keeps_a_hot_set_through_a_scan() {
    let ratio = |eviction: Eviction| {
        let s = StoreConfig {
            policy: PolicyConfig { max_pool_bytes: 2 << 20, ..Default::default() },
            shards: 8,
            ..Default::default()
        }
        .build()
        .unwrap();
        let p = s.create_pool(PoolConfig::ephemeral().eviction(eviction));
        let mut out = [0u8; PAGE_SIZE];
        let (mut hits, mut gets) = (0u64, 0u64);
        let mut scan = 1_000_000;
        for round in 0..20 {
            for i in 0..300 {
                gets += 1;
                if p_get(&p, i, &mut out) {
                    hits += 1;
                } else {
                    assert_eq!(p.put(key(i), &page(i)).unwrap(), PutOutcome::Stored);
                }
            }
            if round >= 5 {
                for _ in 0..3000 {
                    assert_eq!(p.put(key(scan), &page(scan)).unwrap(), PutOutcome::Stored);
                    scan += 1;
                }
            }
        }
        hits as f64 / gets as f64
    };
    let (sieve, lru) = (ratio(Eviction::Sieve), ratio(Eviction::Lru));
    assert!(sieve > lru + 0.2, "hit ratio: sieve {sieve:.3}, lru {lru:.3}");
}

fn p_get(p: &Pool, i: u64, out: &mut [u8; PAGE_SIZE]) -> bool {
    p.get(key(i), out).unwrap() == GetOutcome::Hit
}

#[test]
fn corrupt_data_is_an_error() {
    let s = store(PolicyConfig { incompressible: Incompressible::StoreRaw, ..Default::default() });
    let p = s.create_pool(PoolConfig::persistent());
    assert_eq!(p.put(key(1), &page(1)).unwrap(), PutOutcome::Stored);
    assert_eq!(p.put(key(2), &random_page(2)).unwrap(), PutOutcome::Stored);
    for k in [key(1), key(2)] {
        assert!(p.corrupt_for_test(k));
        let mut out = [0u8; PAGE_SIZE];
        match p.get(k, &mut out) {
            Err(StoreError::Corrupt { reason, .. }) => assert!(reason.contains("checksum")),
            other => panic!("expected corruption error, got {other:?}"),
        }
        assert_eq!(out, [0u8; PAGE_SIZE]);
    }
    assert_eq!(p.stats().decompress_fail, 2);
}

#[test]
fn codec_switch_keeps_old_pages_readable() {
    let s = store(PolicyConfig::default());
    let p = s.create_pool(PoolConfig::persistent());
    for i in 0..50 {
        assert_eq!(p.put(key(i), &page(i)).unwrap(), PutOutcome::Stored);
    }
    s.use_codec(&CodecConfig::Zstd { level: 5, dictionary: None }).unwrap();
    assert_eq!(s.codec_name(), "zstd-5");
    for i in 50..100 {
        assert_eq!(p.put(key(i), &page(i)).unwrap(), PutOutcome::Stored);
    }
    let mut out = [0u8; PAGE_SIZE];
    for i in 0..100 {
        assert!(p_get(&p, i, &mut out));
        assert_eq!(out, page(i));
    }
}

#[test]
fn compaction_keeps_pages_and_releases_memory() {
    let s = store(PolicyConfig { compact_threshold_percent: 100, ..Default::default() });
    let p = s.create_pool(PoolConfig::persistent());
    for i in 0..5000 {
        assert_eq!(p.put(key(i), &page(i)).unwrap(), PutOutcome::Stored);
    }
    for i in 0..5000 {
        if i % 3 != 0 {
            p.flush_page(key(i)).unwrap();
        }
    }
    let before = s.stats().alloc.span_bytes;
    assert!(s.compact() > 0);
    let after = s.stats().alloc.span_bytes;
    assert!(after * 2 < before, "{before} -> {after}");
    let mut out = [0u8; PAGE_SIZE];
    for i in (0..5000).step_by(3) {
        assert!(p_get(&p, i, &mut out));
        assert_eq!(out, page(i));
    }
}

#[test]
fn destroyed_pool_errors_and_frees() {
    let s = store(PolicyConfig::default());
    let p = s.create_pool(PoolConfig::ephemeral());
    for i in 0..100 {
        assert_eq!(p.put(key(i), &page(i)).unwrap(), PutOutcome::Stored);
    }
    s.destroy_pool(p.id()).unwrap();
    assert!(matches!(p.put(key(1), &page(1)), Err(StoreError::PoolDestroyed(_))));
    assert!(matches!(s.pool(p.id()), Err(StoreError::PoolDestroyed(_))));
    assert!(matches!(s.pool(99), Err(StoreError::NoSuchPool(99))));
    assert_eq!(s.stats().alloc.objects, 0);
}

#[test]
fn an_emptied_pool_gives_its_index_memory_back() {
    let s = store(PolicyConfig::default());
    let p = s.create_pool(PoolConfig::persistent());
    let empty = s.stats().metadata_bytes;
    for i in 0..20_000 {
        assert_eq!(p.put(key(i), &page(i)).unwrap(), PutOutcome::Stored);
    }
    let full = s.stats().metadata_bytes;
    assert!(full > empty + 800_000, "20,000 entries of 40 bytes: {empty} -> {full}");
    // A swap device after its job exits: most pages discarded, a few left.
    for i in (0..20_000).filter(|i| i % 50 != 0) {
        assert!(p.flush_page(key(i)).unwrap());
    }
    let sparse = s.stats().metadata_bytes;
    assert!(sparse * 4 < full, "{empty} -> {full} -> {sparse} with 400 pages left");
    let mut out = [0u8; PAGE_SIZE];
    for i in (0..20_000).step_by(50) {
        assert!(p_get(&p, i, &mut out));
        assert_eq!(out, page(i));
    }
    for i in (0..20_000).step_by(50) {
        assert!(p.flush_page(key(i)).unwrap());
    }
    let after = s.stats().metadata_bytes;
    assert!(after <= empty + (128 << 10), "{empty} -> {full} -> {sparse} -> {after}");
    // The emptied shards fill again as before.
    for i in 0..1000 {
        assert_eq!(p.put(key(i), &page(i)).unwrap(), PutOutcome::Stored);
    }
    for i in 0..1000 {
        assert!(p_get(&p, i, &mut out));
        assert_eq!(out, page(i));
    }
}
