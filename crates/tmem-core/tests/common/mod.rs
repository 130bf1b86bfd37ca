//! Pages, and writers racing the store's background work against oracles,
//! shared by the store's integration tests.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use proptest::prelude::*;
use rand_xoshiro::rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use tmem_core::{GetOutcome, Key, Pool, PoolConfig, PutOutcome, Store, TierChain, PAGE_SIZE};
use tmem_tier::seal::Sealer;
use tmem_tier::MemTier;

/// One page of a test.
pub type Page = [u8; PAGE_SIZE];

/// Log-like text: every page different, neighbours alike; lz4 gets about
/// 2x, zstd noticeably more.
pub fn text_page(seed: u64) -> Page {
    const WORDS: [&str; 10] = [
        "GET /api/v1/items ",
        "200 ",
        "user=",
        "session=",
        "latency_ms=",
        "INFO ",
        "WARN ",
        "\n",
        "cache miss ",
        "ok ",
    ];
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut p = [0u8; PAGE_SIZE];
    let mut i = 0;
    while i < PAGE_SIZE {
        let x = rng.next_u64();
        let w = WORDS[usize::try_from(x % 10).unwrap()];
        let num = format!("{} ", x >> 44);
        for b in w.bytes().chain(num.bytes()) {
            if i == PAGE_SIZE {
                break;
            }
            p[i] = b;
            i += 1;
        }
    }
    p
}

/// The key of index `i` in the races' object.
pub fn key(i: u64) -> Key {
    Key::new(7, i)
}

/// Page `i`, if the pool holds it.
pub fn read(pool: &Pool, i: u64) -> Option<Page> {
    let mut out = [0u8; PAGE_SIZE];
    (pool.get(key(i), &mut out).unwrap() == GetOutcome::Hit).then_some(out)
}

/// One step of a writer racing the store's background work: on one of its
/// 48 keys, a put of text page `seed`, a get or a flush.
#[derive(Clone, Copy, Debug)]
pub enum RaceOp {
    Put(u8, u16),
    Get(u8),
    Flush(u8),
}

/// Writers' steps, puts, gets and flushes weighted `put`, `get`, `flush`.
pub fn race_op(put: u32, get: u32, flush: u32) -> impl Strategy<Value = RaceOp> {
    prop_oneof![
        put => (any::<u8>(), any::<u16>()).prop_map(|(k, s)| RaceOp::Put(k % 48, s)),
        get => any::<u8>().prop_map(|k| RaceOp::Get(k % 48)),
        flush => any::<u8>().prop_map(|k| RaceOp::Flush(k % 48)),
    ]
}

/// Writer `w` runs `ops` on its keys (`1000 * w` and up) of `pool`, checking
/// each get against `oracle`; a put the pool refuses keeps the older copy.
/// Returns the oracle.
pub fn run_writer(pool: &Pool, w: usize, ops: &[RaceOp], mut oracle: HashMap<u64, Page>) -> HashMap<u64, Page> {
    let base = 1000 * w as u64;
    for op in ops {
        match *op {
            RaceOp::Put(k, seed) => {
                let (k, p) = (base + u64::from(k), text_page(u64::from(seed)));
                if pool.put(key(k), &p).unwrap() == PutOutcome::Stored {
                    oracle.insert(k, p);
                }
            }
            RaceOp::Get(k) => {
                let k = base + u64::from(k);
                assert_eq!(read(pool, k), oracle.get(&k).copied(), "writer {w} key {k}");
            }
            RaceOp::Flush(k) => {
                let k = base + u64::from(k);
                assert_eq!(pool.flush_page(key(k)).unwrap(), oracle.remove(&k).is_some());
            }
        }
    }
    oracle
}

/// Every key of every writer reads as its oracle says.
pub fn check_oracles(pool: &Pool, oracles: &[HashMap<u64, Page>]) {
    for (w, oracle) in oracles.iter().enumerate() {
        for k in 0..48 {
            let k = 1000 * w as u64 + k;
            assert_eq!(read(pool, k), oracle.get(&k).copied(), "writer {w} key {k} at the end");
        }
    }
}

/// Runs `writers` on `pool`, each from its oracle, while `work` (a
/// background pass) runs in a loop on one thread and compaction of `store`
/// on another; then checks every page against the oracles.
pub fn race_writers(
    store: &Store,
    pool: &Pool,
    writers: &[Vec<RaceOp>],
    oracles: Vec<HashMap<u64, Page>>,
    mut work: impl FnMut() + Send,
) {
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                work();
            }
        });
        s.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                store.compact();
                std::thread::yield_now();
            }
        });
        let handles: Vec<_> = writers
            .iter()
            .zip(oracles)
            .enumerate()
            .map(|(w, (ops, oracle))| s.spawn(move || run_writer(pool, w, ops, oracle)))
            .collect();
        let oracles: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        done.store(true, Ordering::Relaxed);
        check_oracles(pool, &oracles);
    });
}

/// The races' pool: persistent, keeping the old copy when a put is
/// refused, over a memory tier when `with_tier`.
pub fn race_pool(store: &Store, with_tier: bool) -> Arc<Pool> {
    let cfg = PoolConfig::persistent().reject_keeps_old(true);
    if with_tier {
        let chain = TierChain::new(vec![Arc::new(MemTier::new(1 << 30))], Arc::new(Sealer::random().unwrap())).unwrap();
        store.create_pool_with_tiers(cfg, chain)
    } else {
        store.create_pool(cfg)
    }
}

/// Puts text page `k` at each of the 48 keys of each of `writers`
/// writers; returns their oracles.
pub fn fill_writers(pool: &Pool, writers: usize) -> Vec<HashMap<u64, Page>> {
    let mut oracles: Vec<HashMap<u64, Page>> = vec![HashMap::new(); writers];
    for (w, oracle) in oracles.iter_mut().enumerate() {
        for k in 1000 * w as u64..1000 * w as u64 + 48 {
            if pool.put(key(k), &text_page(k)).unwrap() == PutOutcome::Stored {
                oracle.insert(k, text_page(k));
            }
        }
    }
    oracles
}
