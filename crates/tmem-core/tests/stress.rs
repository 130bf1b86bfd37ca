//! Multi-thread stress with verification.
//!
//! [`THREADS`] workers share one store with a persistent pool, a persistent
//! pool with exclusive gets and an ephemeral pool. Each worker owns one object
//! id (a disjoint key range) and a local oracle, and does random put / get /
//! flush operations; every hit is checked against the oracle as it happens.
//! Meanwhile a controller thread compacts, switches the codec, toggles the
//! pool limit and the incompressible policy. At the end every page is read
//! back and the pools' counters are compared with the workers' tallies.

use rand_xoshiro::rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tmem_core::codec::{fill_page, train_dictionary, CodecConfig};
use tmem_core::{GetOutcome, Key, Pool, PoolConfig, PutOutcome, Reject, Store, StoreConfig, PAGE_SIZE};

type Page = [u8; PAGE_SIZE];

const THREADS: usize = 4;
const OPS_PER_THREAD: usize = 20_000;
const KEYS_PER_THREAD: u64 = 192;
/// Pool slots: 0 persistent, 1 persistent with exclusive gets, 2 ephemeral.
const POOLS: usize = 3;
const BANK: usize = 96;

struct Rng(Xoshiro256PlusPlus);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(Xoshiro256PlusPlus::seed_from_u64(seed))
    }

    fn next(&mut self) -> u64 {
        self.0.next_u64()
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn index(&mut self, n: usize) -> usize {
        usize::try_from(self.below(n as u64)).expect("below n")
    }
}

/// A bank of page templates: same-filled, text, half random, random, corpus.
#[allow(clippy::cast_possible_truncation)] // truncation to bytes is intended
fn bank() -> Vec<Page> {
    let corpus: Vec<Page> = std::panic::catch_unwind(tmem_corpus::Corpus::builtin)
        .unwrap_or_default()
        .iter()
        .flat_map(|c| {
            let step = (c.page_count() / 8).max(1);
            (0..c.page_count()).step_by(step).take(8).map(|i| *c.page(i)).collect::<Vec<_>>()
        })
        .collect();
    let words: [&[u8]; 8] = [b"lorem ", b"ipsum ", b"dolor ", b"{\"a\": 1}, ", b"0x0000 ", b"sit ", b"amet\n", b"    "];
    (0..BANK)
        .map(|i| {
            let mut p = [0u8; PAGE_SIZE];
            let mut r = Rng::new(i as u64 + 1);
            match i % 6 {
                0 => fill_page(&mut p, if i % 12 == 0 { 0 } else { r.next() }),
                1 | 2 => {
                    let mut at = 0;
                    while at < PAGE_SIZE {
                        let w = words[r.index(words.len())];
                        let n = w.len().min(PAGE_SIZE - at);
                        p[at..at + n].copy_from_slice(&w[..n]);
                        at += n;
                    }
                }
                3 => {
                    let split = r.index(PAGE_SIZE);
                    for b in &mut p[..split] {
                        *b = r.next() as u8;
                    }
                }
                4 => p.iter_mut().for_each(|b| *b = r.next() as u8),
                _ if !corpus.is_empty() => p = corpus[i % corpus.len()],
                _ => p.iter_mut().enumerate().for_each(|(j, b)| *b = (j / 64) as u8 ^ (r.next() & 3) as u8),
            }
            p
        })
        .collect()
}

/// The page stored for (template, key, version): the template with the key
/// and version stamped in, so a page returned for the wrong key or from an
/// older put is caught. Same-filled templates stay same-filled.
fn page_for(bank: &[Page], template: usize, key: Key, version: u64) -> Page {
    let mut p = bank[template];
    if !template.is_multiple_of(6) {
        p[..8].copy_from_slice(&key.object.to_le_bytes());
        p[8..16].copy_from_slice(&key.index.to_le_bytes());
        p[16..24].copy_from_slice(&version.to_le_bytes());
    }
    p
}

#[derive(Default, Debug, Clone, Copy)]
struct Tally {
    puts: u64,
    stored: u64,
    hits: u64,
    misses: u64,
    flushes: u64,
    rejected: [u64; 3],
}

struct Worker<'a> {
    id: u64,
    rng: Rng,
    bank: &'a [Page],
    pools: &'a [Arc<Pool>],
    /// Per pool: index -> (template, version) of the last stored put.
    oracle: Vec<HashMap<u64, (usize, u64)>>,
    tally: [Tally; POOLS],
    version: u64,
}

impl Worker<'_> {
    fn key(&self, index: u64) -> Key {
        Key::new(self.id, index)
    }

    fn run(&mut self, ops: usize) {
        for _ in 0..ops {
            let pool = self.rng.index(POOLS);
            let index = self.rng.below(KEYS_PER_THREAD);
            match self.rng.below(1000) {
                0..=449 => self.put(pool, index),
                450..=899 => self.get(pool, index),
                900..=997 => self.flush(pool, index),
                _ => self.flush_object(pool),
            }
        }
    }

    fn put(&mut self, pool: usize, index: u64) {
        let key = self.key(index);
        let template = self.rng.index(self.bank.len());
        self.version += 1;
        let page = page_for(self.bank, template, key, self.version);
        let outcome = self.pools[pool].put(key, &page).expect("put");
        let t = &mut self.tally[pool];
        t.puts += 1;
        match outcome {
            PutOutcome::Stored => {
                t.stored += 1;
                self.oracle[pool].insert(index, (template, self.version));
            }
            PutOutcome::Rejected(why) => {
                let slot = match why {
                    Reject::PoolLimit => 0,
                    Reject::CompressPoor => 1,
                    other => panic!("worker {}: unexpected rejection {other:?} of {key:?}", self.id),
                };
                t.rejected[slot] += 1;
                self.oracle[pool].remove(&index);
            }
        }
    }

    fn get(&mut self, pool: usize, index: u64) {
        let key = self.key(index);
        let mut out = [0u8; PAGE_SIZE];
        let got = self.pools[pool].get(key, &mut out).expect("get");
        let expected = self.oracle[pool].get(&index).copied();
        let t = &mut self.tally[pool];
        match got {
            GetOutcome::Hit => {
                t.hits += 1;
                let (template, version) =
                    expected.unwrap_or_else(|| panic!("worker {} pool {pool}: hit on {key:?}, never stored", self.id));
                let want = page_for(self.bank, template, key, version);
                if out != want {
                    let first = out.iter().zip(want.iter()).position(|(a, b)| a != b).unwrap_or(0);
                    panic!(
                        "worker {} pool {pool}: {key:?} (template {template}, version {version}) returned wrong \
                         bytes from offset {first}: got {:?} want {:?}",
                        self.id,
                        &out[first..(first + 16).min(PAGE_SIZE)],
                        &want[first..(first + 16).min(PAGE_SIZE)]
                    );
                }
                if pool == 1 {
                    self.oracle[pool].remove(&index);
                }
            }
            GetOutcome::Miss => {
                t.misses += 1;
                assert!(
                    pool == 2 || expected.is_none(),
                    "worker {} pool {pool}: miss on stored {key:?} (version {:?})",
                    self.id,
                    expected.map(|e| e.1)
                );
                self.oracle[pool].remove(&index);
            }
        }
    }

    fn flush(&mut self, pool: usize, index: u64) {
        let key = self.key(index);
        let had = self.oracle[pool].remove(&index).is_some();
        let removed = self.pools[pool].flush_page(key).expect("flush_page");
        self.tally[pool].flushes += u64::from(removed);
        if pool == 2 {
            assert!(had || !removed, "worker {}: flushed {key:?} that was never stored", self.id);
        } else {
            assert_eq!(removed, had, "worker {} pool {pool}: flush_page({key:?})", self.id);
        }
    }

    fn flush_object(&mut self, pool: usize) {
        let had = self.oracle[pool].len() as u64;
        self.oracle[pool].clear();
        let n = self.pools[pool].flush_object(self.id).expect("flush_object");
        self.tally[pool].flushes += n;
        if pool == 2 {
            assert!(n <= had, "worker {}: flush_object removed {n} > {had}", self.id);
        } else {
            assert_eq!(n, had, "worker {} pool {pool}: flush_object", self.id);
        }
    }

    /// Reads every key back and checks it against the oracle.
    fn verify(&mut self) {
        for pool in 0..POOLS {
            for index in 0..KEYS_PER_THREAD {
                self.get(pool, index);
            }
        }
        assert!(self.oracle[1].is_empty(), "exclusive gets took every page");
    }
}

/// Compacts, switches codecs and toggles the limit until `stop`.
fn control(store: &Store, codecs: &[u8], stop: &AtomicBool, rounds: &AtomicU64) {
    let mut r = Rng::new(99);
    while !stop.load(Ordering::Relaxed) {
        store.compact();
        store.set_codec(codecs[r.index(codecs.len())]).expect("set_codec");
        let limit = match r.below(4) {
            0 => 1 << 20,
            1 => 3 << 20,
            _ => 0,
        };
        store.set_policy("max_pool_bytes", &limit.to_string()).expect("limit");
        let raw = if r.below(2) == 0 { "store_raw" } else { "reject" };
        store.set_policy("incompressible", raw).expect("incompressible");
        rounds.fetch_add(1, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn threads_with_compaction_codec_and_limit_changes() {
    let start = Instant::now();
    let bank = bank();
    let dict_pages: Vec<Page> = (0..BANK).filter(|i| i % 6 == 1 || i % 6 == 2).map(|i| bank[i]).collect();
    let dict = train_dictionary(dict_pages.iter(), 4096).ok();
    let store = StoreConfig::default().build().expect("store");
    let mut codecs = vec![store.register_codec(&CodecConfig::LZ4).expect("lz4")];
    codecs.push(store.register_codec(&CodecConfig::Zstd { level: 1, dictionary: None }).expect("zstd"));
    if let Some(d) = dict {
        codecs.push(store.register_codec(&CodecConfig::Zstd { level: 3, dictionary: Some(d) }).expect("zstd+dict"));
    }
    let pools: Vec<Arc<Pool>> = vec![
        store.create_pool(PoolConfig::persistent()),
        store.create_pool(PoolConfig::persistent().exclusive_gets(true)),
        store.create_pool(PoolConfig::ephemeral()),
    ];
    let stop = AtomicBool::new(false);
    let rounds = AtomicU64::new(0);

    let mut workers: Vec<Worker<'_>> = (0..THREADS as u64)
        .map(|id| Worker {
            id,
            rng: Rng::new(id + 17),
            bank: &bank,
            pools: &pools,
            oracle: vec![HashMap::new(); POOLS],
            tally: [Tally::default(); POOLS],
            version: 0,
        })
        .collect();
    std::thread::scope(|s| {
        let controller = s.spawn(|| control(&store, &codecs, &stop, &rounds));
        let handles: Vec<_> = workers
            .iter_mut()
            .map(|w| {
                s.spawn(move || {
                    w.run(OPS_PER_THREAD);
                })
            })
            .collect();
        let mut panicked = None;
        for h in handles {
            if let Err(e) = h.join() {
                panicked = Some(e);
            }
        }
        stop.store(true, Ordering::Relaxed);
        controller.join().expect("controller");
        if let Some(e) = panicked {
            std::panic::resume_unwind(e);
        }
    });
    let run_time = start.elapsed();

    // Final check with no limit and no concurrent changes.
    store.set_policy("max_pool_bytes", "0").expect("unlimit");
    store.compact();
    let live: Vec<u64> = (0..POOLS).map(|p| workers.iter().map(|w| w.oracle[p].len() as u64).sum()).collect();
    let st = store.stats();
    assert_eq!(st.pools[0].stored_pages, live[0], "persistent pool page count");
    assert_eq!(st.pools[1].stored_pages, live[1], "exclusive pool page count");
    assert!(st.pools[2].stored_pages <= live[2], "ephemeral pool holds pages never stored");
    assert_eq!(st.alloc.objects, st.total.stored_pages - st.total.same_filled_pages);
    for w in &mut workers {
        w.verify();
    }
    let st = store.stats();
    for p in 0..POOLS {
        let sum = |f: fn(&Tally) -> u64| workers.iter().map(|w| f(&w.tally[p])).sum::<u64>();
        let ps = &st.pools[p];
        assert_eq!(ps.puts, sum(|t| t.puts), "pool {p} puts");
        assert_eq!(ps.succ_puts, sum(|t| t.stored), "pool {p} succ_puts");
        assert_eq!(ps.succ_gets, sum(|t| t.hits), "pool {p} succ_gets");
        assert_eq!(ps.failed_gets, sum(|t| t.misses), "pool {p} failed_gets");
        assert_eq!(ps.flushes, sum(|t| t.flushes), "pool {p} flushes");
        assert_eq!(ps.pool_limit_hit, sum(|t| t.rejected[0]), "pool {p} pool_limit_hit");
        assert_eq!(ps.reject_compress_poor, sum(|t| t.rejected[1]), "pool {p} reject_compress_poor");
        assert_eq!(ps.decompress_fail, 0);
    }
    assert_eq!(st.pools[1].stored_pages, 0);
    assert_eq!(st.alloc.objects, st.total.stored_pages - st.total.same_filled_pages);
    let evicted = st.pools[2].evicted_pages;
    let limit_hits = st.total.pool_limit_hit;
    for p in &pools {
        store.destroy_pool(p.id()).expect("destroy");
    }
    let st = store.stats();
    assert_eq!((st.alloc.objects, st.alloc.span_bytes), (0, 0));
    let rounds = rounds.load(Ordering::Relaxed);
    eprintln!(
        "stress: {THREADS} threads x {OPS_PER_THREAD} ops in {run_time:?}: {rounds} control rounds, {} compactions, \
         {} objects migrated, {evicted} ephemeral pages evicted, {limit_hits} puts refused at the limit",
        st.alloc.compactions, st.alloc.objects_migrated
    );
    assert!(rounds > 0, "the controller never ran");
}
