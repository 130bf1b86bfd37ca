//! The pool with tiers below it: writeback, incompressible pages, gets from
//! tiers, tamper/replay detection, full tiers, flushes.

use rand_xoshiro::rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::sync::Arc;
use std::time::Duration;

use tmem_core::{
    GetOutcome, Incompressible, Key, PolicyConfig, PoolConfig, PutOutcome, Reject, StoreConfig, StoreError, TierChain,
    PAGE_SIZE,
};
use tmem_tier::seal::Sealer;
use tmem_tier::{MemTier, Tier, TierKey};

#[allow(clippy::cast_possible_truncation)] // byte patterns
fn page(i: u64) -> [u8; PAGE_SIZE] {
    let mut p = [0u8; PAGE_SIZE];
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(i);
    let mut x = rng.next_u64();
    for (j, b) in p.iter_mut().enumerate() {
        if j % 16 == 0 {
            x = rng.next_u64();
        }
        *b = (x >> ((j % 8) * 8)) as u8 & 0x1f;
    }
    p
}

#[allow(clippy::cast_possible_truncation)]
fn noise(i: u64) -> [u8; PAGE_SIZE] {
    let mut p = [0u8; PAGE_SIZE];
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(i);
    for b in &mut p {
        let x = rng.next_u64();
        *b = x as u8;
    }
    p
}

fn key(i: u64) -> Key {
    Key::new(1, i)
}

fn store(limit: u64) -> tmem_core::Store {
    StoreConfig { policy: PolicyConfig { max_pool_bytes: limit, ..Default::default() }, ..Default::default() }
        .build()
        .unwrap()
}

fn chain(tiers: Vec<Arc<dyn Tier>>) -> TierChain {
    TierChain::new(tiers, Arc::new(Sealer::random().unwrap())).unwrap()
}

fn get(p: &tmem_core::Pool, i: u64) -> Result<Option<[u8; PAGE_SIZE]>, StoreError> {
    let mut out = [0u8; PAGE_SIZE];
    Ok(match p.get(key(i), &mut out)? {
        GetOutcome::Hit => Some(out),
        GetOutcome::Miss => None,
    })
}

/// A 1 MiB store whose pool was given 3,000 pages (`page(0..3000)`), with
/// a memory tier below it that took what did not fit.
fn full_pool_over_a_tier() -> (tmem_core::Store, Arc<MemTier>, Arc<tmem_core::Pool>) {
    let s = store(1 << 20);
    let tier = Arc::new(MemTier::new(1 << 30));
    let p = s.create_pool_with_tiers(PoolConfig::persistent(), chain(vec![tier.clone()]));
    for i in 0..3000 {
        assert_eq!(p.put(key(i), &page(i)).unwrap(), PutOutcome::Stored, "put {i}");
    }
    (s, tier, p)
}

#[test]
fn full_pool_writes_back_instead_of_refusing() {
    let (s, tier, p) = full_pool_over_a_tier();
    let st = p.stats();
    assert_eq!(st.pool_limit_hit, 0, "{st:?}");
    assert!(st.written_back_pages > 1000, "{st:?}");
    assert_eq!(st.tier_pages, tier.capacity().stored_pages);
    assert!(s.mem_used_total() <= 1 << 20);
    for i in 0..3000 {
        assert_eq!(get(&p, i).unwrap().unwrap(), page(i), "page {i}");
    }
    assert!(p.stats().tier_gets > 1000);
    // The oldest pages went down first.
    let mut down: Vec<u64> = tier.keys().iter().map(|k| k.index).collect();
    down.sort_unstable();
    assert!(down[down.len() / 2] < 1500, "median written-back index {}", down[down.len() / 2]);
    // Flushes remove tier copies; destroying the pool clears the rest.
    for i in 0..100 {
        assert!(p.flush_page(key(i)).unwrap());
    }
    s.send_tier_removals();
    assert_eq!(p.stats().tier_pages, tier.capacity().stored_pages);
    s.destroy_pool(p.id()).unwrap();
    assert_eq!(tier.capacity().stored_pages, 0);
}

#[test]
fn a_get_from_memory_leaves_tier_pages_where_they_are() {
    let (_store, tier, p) = full_pool_over_a_tier();
    let mut out = [0u8; PAGE_SIZE];
    let (mut in_memory, mut in_tier) = (0, 0);
    for i in 0..3000 {
        match p.get_in_memory(key(i), &mut out).unwrap() {
            Some(GetOutcome::Hit) => {
                assert_eq!(out, page(i), "page {i}");
                in_memory += 1;
            }
            None => {
                // (Writeback may still be moving pages down, never up.)
                assert!(tier.keys().iter().any(|k| k.index == i), "page {i} said to be in a tier");
                in_tier += 1;
            }
            Some(GetOutcome::Miss) => panic!("page {i} missing"),
        }
    }
    assert!(in_memory > 0 && in_tier > 1000, "{in_memory} in memory, {in_tier} in the tier");
    assert_eq!(p.stats().tier_gets, 0, "nothing was read from the tier");
    assert_eq!(p.get_in_memory(key(5000), &mut out).unwrap(), Some(GetOutcome::Miss));
}

#[test]
fn incompressible_pages_go_straight_down() {
    let s = store(0);
    let tier = Arc::new(MemTier::new(1 << 30));
    let p = s.create_pool_with_tiers(PoolConfig::persistent(), chain(vec![tier.clone()]));
    assert_eq!(p.put(key(1), &noise(1)).unwrap(), PutOutcome::Stored);
    assert_eq!(p.put(key(2), &page(2)).unwrap(), PutOutcome::Stored);
    let st = p.stats();
    assert_eq!((st.incompressible_to_tier, st.tier_pages, st.stored_pages), (1, 1, 2));
    assert_eq!(get(&p, 1).unwrap().unwrap(), noise(1));
    assert_eq!(s.stats().alloc.objects, 1, "only the compressible page uses the pool");
    // Replacing it with a compressible page removes the tier copy (queued).
    assert_eq!(p.put(key(1), &page(1)).unwrap(), PutOutcome::Stored);
    assert_eq!(tier.capacity().stored_pages, 1);
    s.send_tier_removals();
    assert_eq!(tier.capacity().stored_pages, 0);
}

#[test]
fn tampered_moved_and_replayed_values_fail_cleanly() {
    let s = store(0);
    let tier = Arc::new(MemTier::new(1 << 30));
    let p = s.create_pool_with_tiers(PoolConfig::persistent(), chain(vec![tier.clone()]));
    let tk = |i: u64| TierKey { pool: p.id(), object: 1, index: i };
    for i in 1..=3 {
        assert_eq!(p.put(key(i), &noise(i)).unwrap(), PutOutcome::Stored);
    }
    // Tampered.
    tier.with_value(tk(1), |v| v[10] ^= 0x40).unwrap();
    let err = get(&p, 1).unwrap_err();
    assert!(matches!(&err, StoreError::Corrupt { reason, .. } if reason.contains("authentication")), "{err}");
    // Moved: key 3's value copied under key 2.
    let v3 = tier.with_value(tk(3), |v| v.clone()).unwrap();
    tier.with_value(tk(2), |v| *v = v3.clone()).unwrap();
    assert!(matches!(get(&p, 2), Err(StoreError::Corrupt { .. })));
    // Replayed: an older version of key 3 after it was rewritten.
    assert_eq!(p.put(key(3), &noise(33)).unwrap(), PutOutcome::Stored);
    assert_eq!(get(&p, 3).unwrap().unwrap(), noise(33));
    tier.with_value(tk(3), |v| *v = v3.clone()).unwrap();
    assert!(matches!(get(&p, 3), Err(StoreError::Corrupt { .. })));
    assert_eq!(p.stats().tier_get_fail, 3);
}

#[test]
fn full_tier_spills_to_the_next_and_then_the_pool_refuses() {
    let s = store(256 << 10);
    let small = Arc::new(MemTier::new(200 << 10));
    let second = Arc::new(MemTier::new(300 << 10));
    let p = s.create_pool_with_tiers(PoolConfig::persistent(), chain(vec![small.clone(), second.clone()]));
    let mut stored = Vec::new();
    let mut refused = 0;
    for i in 0..2000 {
        match p.put(key(i), &page(i)).unwrap() {
            PutOutcome::Stored => stored.push(i),
            PutOutcome::Rejected(Reject::PoolLimit) => refused += 1,
            other => panic!("{other:?}"),
        }
    }
    assert!(small.capacity().stored_pages > 0 && second.capacity().stored_pages > 0);
    assert!(refused > 0, "pool + tiers hold ~750 KiB; 2000 pages need more");
    for i in stored {
        assert_eq!(get(&p, i).unwrap().unwrap(), page(i), "page {i}");
    }
}

#[test]
fn exclusive_get_from_a_tier_removes_it() {
    let s = StoreConfig {
        policy: PolicyConfig { incompressible: Incompressible::Reject, ..Default::default() },
        ..Default::default()
    }
    .build()
    .unwrap();
    let tier = Arc::new(MemTier::new(1 << 30));
    let p = s.create_pool_with_tiers(PoolConfig::persistent().exclusive_gets(true), chain(vec![tier.clone()]));
    assert_eq!(p.put(key(5), &noise(5)).unwrap(), PutOutcome::Stored);
    assert_eq!(get(&p, 5).unwrap().unwrap(), noise(5));
    assert_eq!(get(&p, 5).unwrap(), None);
    assert_eq!(tier.capacity().stored_pages, 1, "removal is queued");
    s.send_tier_removals();
    assert_eq!(tier.capacity().stored_pages, 0);
}

#[test]
fn promotion_brings_pages_back() {
    let s = store(0);
    let tier = Arc::new(MemTier::new(1 << 30));
    let p = s.create_pool_with_tiers(PoolConfig::persistent(), chain(vec![tier.clone()]).promote_on_get(true));
    for i in 0..50 {
        assert_eq!(p.put(key(i), &page(i)).unwrap(), PutOutcome::Stored);
    }
    assert_eq!(p.write_back(50).pages, 50);
    assert_eq!(tier.capacity().stored_pages, 50);
    assert_eq!(get(&p, 7).unwrap().unwrap(), page(7));
    s.send_tier_removals();
    assert_eq!(tier.capacity().stored_pages, 49);
    assert_eq!(p.stats().tier_pages, 49);
}

#[test]
fn background_writeback_keeps_room_for_new_pages() {
    let s = store(2 << 20);
    let tier = Arc::new(MemTier::new(1 << 30));
    let p = s.create_pool_with_tiers(PoolConfig::persistent(), chain(vec![tier.clone()]));
    let worker = s.start_writeback(Duration::from_millis(5));
    let accept = s.policy().accept_bytes();
    for i in 0..1500 {
        assert_eq!(p.put(key(i), &page(i)).unwrap(), PutOutcome::Stored);
    }
    // Give the worker a moment, then usage sits below the accept threshold.
    for _ in 0..200 {
        if s.mem_used_total() < accept {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(s.mem_used_total() < accept, "{} >= {accept}", s.mem_used_total());
    assert!(worker.is_running());
    drop(worker);
    for i in 0..1500 {
        assert_eq!(get(&p, i).unwrap().unwrap(), page(i));
    }
}

#[test]
fn queued_removals_never_delete_a_newer_copy() {
    let s = store(0);
    let tier = Arc::new(MemTier::new(1 << 30));
    let p = s.create_pool_with_tiers(PoolConfig::persistent(), chain(vec![tier.clone()]));
    // Key 1 down to the tier, replaced in the pool (its removal is queued),
    // then written back again: the new copy must survive the queued removal.
    assert_eq!(p.put(key(1), &page(1)).unwrap(), PutOutcome::Stored);
    assert_eq!(p.write_back(10).pages, 1);
    assert_eq!(p.put(key(1), &page(11)).unwrap(), PutOutcome::Stored);
    assert_eq!(p.write_back(10).pages, 1);
    s.send_tier_removals();
    assert_eq!(tier.capacity().stored_pages, 1);
    assert_eq!(get(&p, 1).unwrap().unwrap(), page(11));
    // The same through the incompressible path, which puts to the tier directly.
    assert_eq!(p.put(key(2), &page(2)).unwrap(), PutOutcome::Stored);
    assert_eq!(p.write_back(10).pages, 1);
    assert_eq!(p.put(key(2), &page(22)).unwrap(), PutOutcome::Stored);
    assert_eq!(p.put(key(2), &noise(2)).unwrap(), PutOutcome::Stored);
    s.send_tier_removals();
    assert_eq!(get(&p, 2).unwrap().unwrap(), noise(2));
    assert_eq!(tier.capacity().stored_pages, 2);
}

#[test]
fn concurrent_overwrites_writeback_and_incompressible_puts_lose_nothing() {
    // A small pool, a writeback thread running all the time, four writers
    // overwriting a few keys each with compressible and incompressible pages
    // (the latter go straight to the tier), reading back as they go. A put
    // may be refused while writeback lags behind the writers (the pool is at
    // its limit); a refused put flushes the key, so it must then read as
    // absent. Refusals stay rare; what was stored is never lost or stale.
    let refused = std::sync::atomic::AtomicU64::new(0);
    let s = store(192 << 10);
    let tier = Arc::new(MemTier::new(1 << 30));
    let p = s.create_pool_with_tiers(PoolConfig::persistent(), chain(vec![tier.clone()]));
    let worker = s.start_writeback(Duration::from_millis(1));
    std::thread::scope(|sc| {
        for t in 0..4u64 {
            let (p, refused) = (&p, &refused);
            sc.spawn(move || {
                let mut latest = std::collections::HashMap::new();
                let mut rng = Xoshiro256PlusPlus::seed_from_u64(t + 1);
                for round in 0..4000u64 {
                    let x = rng.next_u64();
                    let k = t * 1000 + x % 48;
                    let v = round * 4 + t;
                    let data = if x % 4 == 0 { noise(v) } else { page(v) };
                    match p.put(key(k), &data).unwrap() {
                        PutOutcome::Stored => latest.insert(k, Some(data)),
                        PutOutcome::Rejected(tmem_core::Reject::PoolLimit) => {
                            refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            latest.insert(k, None)
                        }
                        other => panic!("put {k}: {other:?}"),
                    };
                    if x % 5 == 0 {
                        let k = t * 1000 + (x >> 8) % 48;
                        if let Some(want) = latest.get(&k) {
                            assert_eq!(&get(p, k).unwrap(), want, "key {k} in round {round}");
                        }
                    }
                }
                for (k, want) in &latest {
                    assert_eq!(&get(p, *k).unwrap(), want, "key {k} at the end");
                }
            });
        }
    });
    drop(worker);
    s.send_tier_removals();
    let refused = refused.into_inner();
    assert!(refused < 4 * 4000 / 20, "{refused} of 16000 puts refused: writeback does not keep up");
    let st = p.stats();
    assert!(st.written_back_pages > 1000 && st.incompressible_to_tier > 1000, "{st:?}");
    assert_eq!(st.tier_pages, tier.capacity().stored_pages, "no stale tier copies left");
    assert_eq!(st.tier_get_fail, 0);
}

/// A memory tier that records the order in which values arrive.
struct Recording(MemTier, std::sync::Mutex<Vec<u64>>);

impl Tier for Recording {
    fn name(&self) -> &str {
        self.0.name()
    }
    fn put(&self, key: TierKey, value: &[u8]) -> Result<tmem_tier::TierPut, tmem_tier::TierError> {
        self.1.lock().unwrap().push(key.index);
        self.0.put(key, value)
    }
    fn get(&self, key: TierKey, out: &mut Vec<u8>) -> Result<tmem_tier::TierGet, tmem_tier::TierError> {
        self.0.get(key, out)
    }
    fn remove(&self, key: TierKey) -> Result<bool, tmem_tier::TierError> {
        self.0.remove(key)
    }
    fn clear_pool(&self, pool: u32) -> Result<(), tmem_tier::TierError> {
        self.0.clear_pool(pool)
    }
    fn capacity(&self) -> tmem_tier::Capacity {
        self.0.capacity()
    }
    fn health(&self) -> tmem_tier::Health {
        self.0.health()
    }
    fn stats(&self) -> tmem_tier::TierStats {
        self.0.stats()
    }
}

/// Of the values a 1 MiB pool given `page(0..3000)` in order wrote back,
/// the share that followed their left neighbour.
fn neighbours_written_back_together(shard_windows: bool) -> f64 {
    let s = StoreConfig {
        policy: PolicyConfig { max_pool_bytes: 1 << 20, ..Default::default() },
        shard_windows,
        ..Default::default()
    }
    .build()
    .unwrap();
    let tier = Arc::new(Recording(MemTier::new(1 << 30), std::sync::Mutex::new(Vec::new())));
    let p = s.create_pool_with_tiers(PoolConfig::persistent(), chain(vec![tier.clone()]));
    for i in 0..3000 {
        assert_eq!(p.put(key(i), &page(i)).unwrap(), PutOutcome::Stored, "put {i}");
    }
    for i in 0..3000 {
        assert_eq!(get(&p, i).unwrap(), Some(page(i)), "get {i}");
    }
    let order = tier.1.lock().unwrap();
    assert!(order.len() > 1000, "{} written back", order.len());
    let next = order.windows(2).filter(|w| w[1] == w[0] + 1).count();
    next as f64 / (order.len() - 1) as f64
}

#[test]
fn windows_kept_in_a_shard_go_down_side_by_side() {
    let with = neighbours_written_back_together(true);
    let without = neighbours_written_back_together(false);
    assert!(with > 0.8, "{with:.2} of values followed their neighbour with windows");
    assert!(without < 0.5, "{without:.2} without");
}
