//! Model-based property tests: random sequences of store operations on five
//! pools of one store (persistent/ephemeral × shared/exclusive gets, plus a
//! persistent pool whose refused puts keep the older copy), checked op by op
//! against a `HashMap` oracle and exact counters.
//!
//! The model predicts each put's outcome (stored same-filled, stored
//! compressed with a known length, stored raw, or refused) by compressing the
//! page with a codec built from the same configuration as the store's, so it
//! also checks `compr_data_size`, `stored_incompressible_pages` and the
//! compression counters exactly. Only admission at the pool limit and the
//! eviction of ephemeral pages are not predicted; they are bounded instead.

use rand_xoshiro::rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use proptest::prelude::*;
use tmem_core::codec::{fill_page, same_filled, train_dictionary, Codec, CodecConfig, COMPRESS_BUF_SIZE};
use tmem_core::{
    GetOutcome, Key, Pool, PoolConfig, PoolKind, PoolStats, PutOutcome, Reject, Store, StoreConfig, StoreError,
    PAGE_SIZE, RAW_CODEC,
};

type Page = [u8; PAGE_SIZE];

const OBJECTS: u8 = 2;
const INDEXES: u8 = 64;
/// Pool slots of every store: (kind, exclusive gets, refused puts keep the old copy).
const POOL_CONFIGS: [(PoolKind, bool, bool); 5] = [
    (PoolKind::Persistent, false, false),
    (PoolKind::Persistent, true, false),
    (PoolKind::Ephemeral, false, false),
    (PoolKind::Ephemeral, true, false),
    (PoolKind::Persistent, false, true),
];

// ---------------------------------------------------------------- pages

struct Rng(Xoshiro256PlusPlus);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(Xoshiro256PlusPlus::seed_from_u64(seed))
    }

    fn next(&mut self) -> u64 {
        self.0.next_u64()
    }
}

#[allow(clippy::cast_possible_truncation)] // truncating random words to bytes is the point
fn fill_random(dst: &mut [u8], seed: u64) {
    let mut r = Rng::new(seed);
    for b in dst {
        *b = r.next() as u8;
    }
}

#[allow(clippy::cast_possible_truncation)] // small indexes into word tables
fn fill_text(dst: &mut [u8], seed: u64) {
    const WORDS: [&[u8]; 12] = [
        b"the ",
        b"page ",
        b"store ",
        b"compressed ",
        b"{\"key\": ",
        b"\"value\"}, ",
        b"0x7f3a2c00 ",
        b"return ",
        b"static int ",
        b"memory ",
        b"\n    ",
        b"frontswap ",
    ];
    let mut r = Rng::new(seed);
    let mut i = 0;
    while i < dst.len() {
        let x = r.next();
        let w = WORDS[(x % WORDS.len() as u64) as usize];
        let n = w.len().min(dst.len() - i);
        dst[i..i + n].copy_from_slice(&w[..n]);
        i += n;
        // Sprinkle some numbers so pages differ beyond word order.
        if x & 0x700 == 0 && i + 4 <= dst.len() {
            dst[i..i + 4].copy_from_slice(&((x >> 20) as u32).to_le_bytes());
            i += 4;
        }
    }
}

/// Real pages from the built-in corpora, if any (they may be placeholders).
fn corpus_pages() -> &'static [Page] {
    static PAGES: OnceLock<Vec<Page>> = OnceLock::new();
    PAGES.get_or_init(|| {
        let corpora = std::panic::catch_unwind(tmem_corpus::Corpus::builtin).unwrap_or_default();
        let mut v = Vec::new();
        for c in &corpora {
            let n = c.page_count();
            // Up to 64 pages per corpus, spread over it.
            let step = (n / 64).max(1);
            v.extend((0..n).step_by(step).take(64).map(|i| *c.page(i)));
        }
        v
    })
}

#[derive(Clone, Copy, Debug)]
enum PageKind {
    Zero,
    /// One repeated 8-byte word.
    Same(u64),
    /// Same-filled except for one byte.
    NearlySame(u64, u16),
    Text(u64),
    Random(u64),
    /// `random` random bytes followed by text: compressed sizes spread over 0..4096.
    Mixed(u64, u16),
    /// A real page (falls back to text when the corpora are empty).
    Corpus(u16),
}

fn make_page(kind: PageKind) -> Page {
    let mut p = [0u8; PAGE_SIZE];
    match kind {
        PageKind::Zero => {}
        PageKind::Same(w) => fill_page(&mut p, w),
        PageKind::NearlySame(w, pos) => {
            fill_page(&mut p, w);
            p[usize::from(pos) % PAGE_SIZE] ^= 0x5a;
        }
        PageKind::Text(seed) => fill_text(&mut p, seed),
        PageKind::Random(seed) => fill_random(&mut p, seed),
        PageKind::Mixed(seed, random) => {
            let split = usize::from(random) % PAGE_SIZE;
            fill_random(&mut p[..split], seed);
            fill_text(&mut p[split..], seed ^ 0xabcd);
        }
        PageKind::Corpus(i) => {
            let pages = corpus_pages();
            if pages.is_empty() {
                fill_text(&mut p, u64::from(i) | 1 << 40);
            } else {
                p = pages[usize::from(i) % pages.len()];
            }
        }
    }
    p
}

fn page_kind() -> impl Strategy<Value = PageKind> {
    prop_oneof![
        2 => Just(PageKind::Zero),
        2 => prop_oneof![Just(0xffff_ffff_ffff_ffffu64), Just(1), any::<u64>()].prop_map(PageKind::Same),
        1 => (any::<u64>(), any::<u16>()).prop_map(|(w, p)| PageKind::NearlySame(w, p)),
        5 => (0..32u64).prop_map(PageKind::Text),
        2 => (0..32u64).prop_map(PageKind::Random),
        3 => ((0..32u64), (0..4096u16)).prop_map(|(s, r)| PageKind::Mixed(s, r)),
        2 => any::<u16>().prop_map(PageKind::Corpus),
    ]
}

fn dictionary() -> Arc<[u8]> {
    static DICT: OnceLock<Arc<[u8]>> = OnceLock::new();
    Arc::clone(DICT.get_or_init(|| {
        let pages: Vec<Page> = (0..64).map(|i| make_page(PageKind::Text(1000 + i))).collect();
        train_dictionary(pages.iter(), 8192).expect("dictionary trains on text pages")
    }))
}

// ---------------------------------------------------------------- ops

#[derive(Clone, Debug)]
enum Op {
    Put {
        pool: usize,
        key: Key,
        page: PageKind,
    },
    Get {
        pool: usize,
        key: Key,
    },
    FlushPage {
        pool: usize,
        key: Key,
    },
    FlushObject {
        pool: usize,
        object: u64,
    },
    /// Put pages of similar compressed size under every index of `object`
    /// (fills spans of one size class): text, or `split` random bytes then text.
    Fill {
        pool: usize,
        object: u64,
        seed: u64,
        split: Option<u16>,
    },
    /// Flush every index of `object` not divisible by `keep_every` (leaves holes in spans).
    Thin {
        pool: usize,
        object: u64,
        keep_every: u64,
    },
    /// Destroy the pool in this slot and create a fresh one with the same config.
    Recreate {
        pool: usize,
    },
    Compact,
    /// `None`: unlimited; `Some(kib)`: limit = current usage + kib KiB (at least one page).
    Limit(Option<i32>),
    AcceptThreshold(u32),
    Frozen(bool),
    StoreRaw(bool),
    MaxCompressedSize(u32),
    /// Index into the model's codec table.
    Codec(usize),
}

fn key() -> impl Strategy<Value = Key> {
    (0..OBJECTS, 0..INDEXES).prop_map(|(o, i)| Key::new(u64::from(o), u64::from(i)))
}

fn op() -> impl Strategy<Value = Op> {
    let pool = 0..POOL_CONFIGS.len();
    prop_oneof![
        40 => (pool.clone(), key(), page_kind()).prop_map(|(pool, key, page)| Op::Put { pool, key, page }),
        30 => (pool.clone(), key()).prop_map(|(pool, key)| Op::Get { pool, key }),
        8 => (pool.clone(), key()).prop_map(|(pool, key)| Op::FlushPage { pool, key }),
        2 => (pool.clone(), 0..u64::from(OBJECTS) + 1).prop_map(|(pool, object)| Op::FlushObject { pool, object }),
        2 => (pool.clone(), 0..u64::from(OBJECTS), 0..1000u64, prop::option::of(16..3500u16))
            .prop_map(|(pool, object, seed, split)| Op::Fill { pool, object, seed, split }),
        2 => (pool.clone(), 0..u64::from(OBJECTS), 2..5u64)
            .prop_map(|(pool, object, keep_every)| Op::Thin { pool, object, keep_every }),
        1 => pool.prop_map(|pool| Op::Recreate { pool }),
        4 => Just(Op::Compact),
        3 => prop_oneof![Just(None), Just(Some(-64)), Just(Some(0)), Just(Some(16)), Just(Some(64)), Just(Some(512))]
            .prop_map(Op::Limit),
        1 => prop_oneof![Just(0u32), Just(50), Just(90), Just(100)].prop_map(Op::AcceptThreshold),
        2 => prop::bool::weighted(0.2).prop_map(Op::Frozen),
        2 => any::<bool>().prop_map(Op::StoreRaw),
        2 => prop_oneof![Just(64u32), Just(1024), Just(2048), Just(3000), Just(4095), Just(4096)]
            .prop_map(Op::MaxCompressedSize),
        2 => (0..CODECS).prop_map(Op::Codec),
    ]
}

// ---------------------------------------------------------------- model

/// How the store holds a page, as predicted by the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Held {
    Same,
    Compressed(usize),
    Raw,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Predicted {
    Held(Held),
    Poor,
}

#[derive(Clone)]
struct Stored {
    page: Box<Page>,
    held: Held,
}

/// Counters the model expects, compared with the pool's after every op.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Expected {
    puts: u64,
    succ_puts: u64,
    succ_gets: u64,
    failed_gets: u64,
    flushes: u64,
    pool_limit_hit: u64,
    reject_compress_poor: u64,
    reject_frozen: u64,
    compressions: u64,
    decompressions: u64,
}

impl Expected {
    fn from_stats(s: &PoolStats) -> Self {
        Self {
            puts: s.puts,
            succ_puts: s.succ_puts,
            succ_gets: s.succ_gets,
            failed_gets: s.failed_gets,
            flushes: s.flushes,
            pool_limit_hit: s.pool_limit_hit,
            reject_compress_poor: s.reject_compress_poor,
            reject_frozen: s.reject_frozen,
            compressions: s.compressions,
            decompressions: s.decompressions,
        }
    }
}

struct PoolModel {
    pool: Arc<Pool>,
    oracle: HashMap<Key, Stored>,
    expected: Expected,
}

impl PoolModel {
    fn persistent(&self) -> bool {
        self.pool.config().kind == PoolKind::Persistent
    }

    fn exclusive(&self) -> bool {
        self.pool.config().exclusive_gets
    }

    fn keeps_old(&self) -> bool {
        self.pool.config().reject_keeps_old
    }
}

const CODECS: usize = 5;

struct Model {
    store: Store,
    pools: Vec<PoolModel>,
    /// (store codec id, the same codec built by the test).
    codecs: Vec<(u8, Arc<dyn Codec>)>,
    codec: usize,
    limited: bool,
    frozen: bool,
    store_raw: bool,
    max_compressed_size: usize,
}

fn pool_config(kind: PoolKind, exclusive: bool, keeps_old: bool) -> PoolConfig {
    let cfg = match kind {
        PoolKind::Persistent => PoolConfig::persistent(),
        PoolKind::Ephemeral => PoolConfig::ephemeral(),
    };
    cfg.exclusive_gets(exclusive).reject_keeps_old(keeps_old)
}

impl Model {
    fn new() -> Self {
        let store = StoreConfig::default().build().expect("default store");
        let pools = POOL_CONFIGS
            .iter()
            .map(|&(kind, excl, keep)| PoolModel {
                pool: store.create_pool(pool_config(kind, excl, keep)),
                oracle: HashMap::new(),
                expected: Expected::default(),
            })
            .collect();
        let mut codecs: Vec<(u8, Arc<dyn Codec>)> = vec![(RAW_CODEC, CodecConfig::Raw.build().expect("raw"))];
        for cfg in [
            CodecConfig::LZ4,
            CodecConfig::Zstd { level: 1, dictionary: None },
            CodecConfig::Zstd { level: 3, dictionary: Some(dictionary()) },
            CodecConfig::LZ4.with_dictionary(dictionary()),
        ] {
            let id = store.register_codec(&cfg).expect("register codec");
            codecs.push((id, cfg.build().expect("codec builds")));
        }
        assert_eq!(codecs.len(), CODECS);
        // The store was built with lz4 as its current codec.
        assert_eq!(store.codec_name(), "lz4");
        Self {
            store,
            pools,
            codecs,
            codec: 1,
            limited: false,
            frozen: false,
            store_raw: false,
            max_compressed_size: PAGE_SIZE - 1,
        }
    }

    fn predict(&self, page: &Page) -> Predicted {
        if same_filled(page).is_some() {
            return Predicted::Held(Held::Same);
        }
        let mut buf = [0u8; COMPRESS_BUF_SIZE];
        let n = self.codecs[self.codec].1.compress(page, &mut buf).expect("compression works");
        if n <= self.max_compressed_size && n < PAGE_SIZE {
            Predicted::Held(Held::Compressed(n))
        } else if self.store_raw {
            Predicted::Held(Held::Raw)
        } else {
            Predicted::Poor
        }
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Put { pool, key, page } => self.put(pool, key, &make_page(page)),
            Op::Get { pool, key } => self.get(pool, key),
            Op::FlushPage { pool, key } => self.apply_flush(pool, key),
            Op::FlushObject { pool, object } => {
                let m = &mut self.pools[pool];
                let before = m.oracle.len();
                m.oracle.retain(|k, _| k.object != object);
                let had = (before - m.oracle.len()) as u64;
                let n = m.pool.flush_object(object).expect("flush_object");
                if m.persistent() {
                    assert_eq!(n, had, "flush_object({object}) on persistent pool {pool}");
                } else {
                    assert!(n <= had, "flush_object({object}) removed {n} pages, model had {had}");
                }
                m.expected.flushes += n;
            }
            Op::Fill { pool, object, seed, split } => {
                for i in 0..u64::from(INDEXES) {
                    let kind = match split {
                        None => PageKind::Text(seed * 64 + i),
                        Some(split) => PageKind::Mixed(seed * 64 + i, split),
                    };
                    self.put(pool, Key::new(object, i), &make_page(kind));
                }
            }
            Op::Thin { pool, object, keep_every } => {
                for i in (0..u64::from(INDEXES)).filter(|i| i % keep_every != 0) {
                    self.apply_flush(pool, Key::new(object, i));
                }
            }
            Op::Recreate { pool } => self.recreate(pool),
            Op::Compact => {
                self.store.compact();
                self.verify_readable();
            }
            Op::Limit(headroom) => {
                let value = match headroom {
                    None => 0,
                    Some(kib) => {
                        let used = i64::try_from(self.store.mem_used_total()).expect("usage fits i64");
                        let limit = (used + i64::from(kib) * 1024).max(i64::try_from(PAGE_SIZE).expect("small"));
                        u64::try_from(limit).expect("positive")
                    }
                };
                self.store.set_policy("max_pool_bytes", &value.to_string()).expect("max_pool_bytes");
                self.limited |= value != 0;
                let want = if value == 0 { u64::MAX } else { value };
                assert_eq!(self.store.policy().limit_bytes(), want);
            }
            Op::AcceptThreshold(pct) => {
                self.store.set_policy("accept_threshold_percent", &pct.to_string()).expect("accept threshold");
                assert_eq!(self.store.policy().config().accept_threshold_percent, pct);
            }
            Op::Frozen(on) => {
                self.store.set_policy("frozen", if on { "1" } else { "off" }).expect("frozen");
                self.frozen = on;
            }
            Op::StoreRaw(raw) => {
                self.store
                    .set_policy("incompressible", if raw { "store_raw" } else { "reject" })
                    .expect("incompressible");
                self.store_raw = raw;
            }
            Op::MaxCompressedSize(n) => {
                self.store.set_policy("max_compressed_size", &n.to_string()).expect("max_compressed_size");
                self.max_compressed_size = n as usize;
            }
            Op::Codec(i) => {
                self.store.set_codec(self.codecs[i].0).expect("set_codec");
                self.codec = i;
                assert_eq!(self.store.codec_name(), self.codecs[i].1.name());
            }
        }
        self.check();
    }

    fn apply_flush(&mut self, pool: usize, key: Key) {
        let m = &mut self.pools[pool];
        let had = m.oracle.remove(&key).is_some();
        let removed = m.pool.flush_page(key).expect("flush_page");
        if m.persistent() {
            assert_eq!(removed, had, "flush_page({key:?}) on persistent pool {pool}");
        } else {
            assert!(had || !removed, "flush_page({key:?}) removed a page the model never stored");
        }
        m.expected.flushes += u64::from(removed);
    }

    fn put(&mut self, pool: usize, key: Key, page: &Page) {
        let predicted = self.predict(page);
        let (frozen, limited) = (self.frozen, self.limited);
        let m = &mut self.pools[pool];
        let outcome = m.pool.put(key, page).expect("put");
        m.expected.puts += 1;
        // An older copy is replaced, or flushed by a refusal unless the pool keeps it.
        let old = m.oracle.remove(&key);
        match outcome {
            PutOutcome::Stored => {
                assert!(!frozen, "put stored while frozen");
                let Predicted::Held(held) = predicted else {
                    panic!("put {key:?} stored a page the model predicted as poorly compressible");
                };
                m.expected.succ_puts += 1;
                m.expected.compressions += u64::from(matches!(held, Held::Compressed(_)));
                m.oracle.insert(key, Stored { page: Box::new(*page), held });
            }
            PutOutcome::Rejected(Reject::Frozen) => {
                assert!(frozen, "Frozen rejection while not frozen");
                m.expected.reject_frozen += 1;
            }
            PutOutcome::Rejected(Reject::PoolLimit) => {
                assert!(!frozen, "frozen is checked before the limit");
                assert!(limited && self.store.policy().limit_bytes() != u64::MAX, "PoolLimit without a limit");
                m.expected.pool_limit_hit += 1;
            }
            PutOutcome::Rejected(Reject::CompressPoor) => {
                assert!(!frozen, "frozen is checked before compression");
                assert_eq!(predicted, Predicted::Poor, "put {key:?} refused as poor");
                m.expected.reject_compress_poor += 1;
                m.expected.compressions += 1;
            }
            PutOutcome::Rejected(other) => panic!("unexpected rejection {other:?} for {key:?}"),
        }
        if !frozen && outcome != PutOutcome::Rejected(Reject::PoolLimit) {
            // Admitted: the outcome is exactly the predicted one.
            let got = match outcome {
                PutOutcome::Stored => "stored",
                _ => "refused",
            };
            let want = match predicted {
                Predicted::Held(_) => "stored",
                Predicted::Poor => "refused",
            };
            assert_eq!(got, want, "put {key:?}: predicted {predicted:?}, got {outcome:?}");
        }
        if outcome != PutOutcome::Stored {
            if m.keeps_old() {
                if let Some(old) = old {
                    m.oracle.insert(key, old);
                }
            } else {
                // A refused put leaves no copy behind, in either pool kind.
                assert!(!m.pool.contains(key).expect("contains"), "pool {pool}: stale copy of {key:?} survived");
            }
        }
        let held = m.pool.contains(key).expect("contains");
        if m.persistent() {
            assert_eq!(held, m.oracle.contains_key(&key), "pool {pool}: contains({key:?}) after {outcome:?}");
        } else {
            assert!(!held || m.oracle.contains_key(&key), "pool {pool}: contains({key:?}) after {outcome:?}");
        }
    }

    fn get(&mut self, pool: usize, key: Key) {
        let m = &mut self.pools[pool];
        let mut out = [0xa5u8; PAGE_SIZE];
        let got = m.pool.get(key, &mut out).expect("get");
        let evictions = m.pool.stats().evicted_pages;
        match got {
            GetOutcome::Hit => {
                let want = m.oracle.get(&key).unwrap_or_else(|| panic!("pool {pool}: hit on {key:?} never stored"));
                assert!(out == *want.page, "pool {pool}: {key:?} returned different bytes");
                m.expected.succ_gets += 1;
                m.expected.decompressions += u64::from(matches!(want.held, Held::Compressed(_)));
                if m.exclusive() {
                    m.oracle.remove(&key);
                }
            }
            GetOutcome::Miss => {
                if m.persistent() || evictions == 0 {
                    assert!(!m.oracle.contains_key(&key), "pool {pool}: miss on stored {key:?}");
                }
                m.oracle.remove(&key);
                m.expected.failed_gets += 1;
            }
        }
    }

    fn recreate(&mut self, pool: usize) {
        let old = Arc::clone(&self.pools[pool].pool);
        let id = old.id();
        self.store.destroy_pool(id).expect("destroy_pool");
        let mut out = [0u8; PAGE_SIZE];
        let key = Key::new(0, 0);
        assert!(matches!(old.put(key, &out), Err(StoreError::PoolDestroyed(i)) if i == id));
        assert!(matches!(old.get(key, &mut out), Err(StoreError::PoolDestroyed(i)) if i == id));
        assert!(matches!(old.flush_page(key), Err(StoreError::PoolDestroyed(i)) if i == id));
        assert!(matches!(old.flush_object(0), Err(StoreError::PoolDestroyed(i)) if i == id));
        assert!(matches!(self.store.destroy_pool(id), Err(StoreError::PoolDestroyed(i)) if i == id));
        assert!(matches!(self.store.pool(id), Err(StoreError::PoolDestroyed(i)) if i == id));
        assert!(!self.store.pool_ids().contains(&id));
        let cfg = old.config().clone();
        let new = self.store.create_pool(cfg);
        assert!(new.id() > id, "pool ids are not reused");
        self.pools[pool] = PoolModel { pool: new, oracle: HashMap::new(), expected: Expected::default() };
    }

    /// Reads back every page of the shared persistent pool (after compaction).
    fn verify_readable(&mut self) {
        let m = &mut self.pools[0];
        assert!(m.persistent() && !m.exclusive());
        let mut out = [0u8; PAGE_SIZE];
        for (key, want) in &m.oracle {
            assert_eq!(m.pool.get(*key, &mut out).expect("get"), GetOutcome::Hit, "{key:?} lost");
            assert!(out == *want.page, "{key:?} changed");
            m.expected.succ_gets += 1;
            m.expected.decompressions += u64::from(matches!(want.held, Held::Compressed(_)));
        }
    }

    fn check(&self) {
        let st = self.store.stats();
        for (i, m) in self.pools.iter().enumerate() {
            let ps = m.pool.stats();
            assert_eq!(Expected::from_stats(&ps), m.expected, "pool {i} counters");
            assert_eq!(ps.pool_id, Some(m.pool.id()));
            assert_eq!((ps.reject_compress_fail, ps.reject_alloc_fail, ps.decompress_fail), (0, 0, 0));
            assert!(m.persistent() || self.limited || ps.evicted_pages == 0, "eviction without a limit");
            let live = m.oracle.len() as u64;
            if m.persistent() || ps.evicted_pages == 0 {
                assert_eq!(ps.evicted_pages, 0);
                assert_eq!(ps.stored_pages, live, "pool {i} stored_pages");
                let same = m.oracle.values().filter(|s| s.held == Held::Same).count() as u64;
                let raw = m.oracle.values().filter(|s| s.held == Held::Raw).count() as u64;
                let bytes: u64 = m
                    .oracle
                    .values()
                    .map(|s| match s.held {
                        Held::Same => 0,
                        Held::Compressed(n) => n as u64,
                        Held::Raw => PAGE_SIZE as u64,
                    })
                    .sum();
                assert_eq!(ps.same_filled_pages, same, "pool {i} same_filled_pages");
                assert_eq!(ps.stored_incompressible_pages, raw, "pool {i} stored_incompressible_pages");
                assert_eq!(ps.compr_data_size, bytes, "pool {i} compr_data_size");
            } else {
                // Evicted pages are gone without the model knowing which.
                assert!(ps.stored_pages <= live, "pool {i}: {} stored > {live} in the model", ps.stored_pages);
                assert!(live - ps.stored_pages <= ps.evicted_pages, "pool {i}: more pages missing than evicted");
            }
            assert_eq!(ps.orig_data_size, ps.stored_pages * PAGE_SIZE as u64);
            assert!(ps.same_filled_pages + ps.stored_incompressible_pages <= ps.stored_pages);
        }
        assert_eq!(st.pools.len(), self.pools.len());
        let t = &st.total;
        assert_eq!(st.alloc.objects, t.stored_pages - t.same_filled_pages, "allocator objects vs stored pages");
        assert!(st.alloc.slot_bytes >= t.compr_data_size);
        assert!(st.alloc.slot_bytes <= st.alloc.span_bytes);
        if st.alloc.objects == 0 {
            assert_eq!((st.alloc.span_bytes, st.alloc.slot_bytes, t.compr_data_size), (0, 0, 0));
        }
        assert_eq!(st.mem_used_total, st.metadata_bytes + st.alloc.span_bytes);
        assert_eq!(st.policy.frozen, self.frozen);
        assert_eq!(st.policy.max_compressed_size as usize, self.max_compressed_size);
        assert_eq!(st.codec, self.codecs[self.codec].1.name());
    }

    /// Final sweep: every key of every pool against the oracle.
    fn verify_all(&mut self) {
        self.store.set_policy("max_pool_bytes", "0").expect("unlimit");
        for pool in 0..self.pools.len() {
            for o in 0..OBJECTS {
                for i in 0..INDEXES {
                    self.get(pool, Key::new(u64::from(o), u64::from(i)));
                }
            }
        }
        self.check();
        for pool in 0..self.pools.len() {
            let id = self.pools[pool].pool.id();
            self.store.destroy_pool(id).expect("destroy");
        }
        let st = self.store.stats();
        assert_eq!((st.total.stored_pages, st.alloc.objects, st.alloc.span_bytes), (0, 0, 0), "empty store");
    }
}

fn run(ops: &[Op]) {
    let mut m = Model::new();
    for op in ops {
        m.apply(op);
    }
    m.verify_all();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn store_matches_model(ops in prop::collection::vec(op(), 1..200)) {
        run(&ops);
    }
}

/// Every put kind under a tight limit and a switch of every knob, as a fixed
/// sequence (quick to debug when the property fails for a basic reason).
#[test]
fn fixed_sequence() {
    let mut ops = Vec::new();
    let kinds = [
        PageKind::Zero,
        PageKind::Same(7),
        PageKind::NearlySame(7, 4095),
        PageKind::Text(1),
        PageKind::Random(2),
        PageKind::Mixed(3, 2500),
        PageKind::Corpus(5),
    ];
    for codec in 0..CODECS {
        ops.push(Op::Codec(codec));
        for (raw, max) in [(false, 4095), (true, 2048), (false, 64), (true, 4096)] {
            ops.push(Op::StoreRaw(raw));
            ops.push(Op::MaxCompressedSize(max));
            for (n, &page) in kinds.iter().enumerate() {
                for pool in 0..POOL_CONFIGS.len() {
                    let key = Key::new(n as u64 % 2, n as u64);
                    ops.push(Op::Put { pool, key, page });
                    ops.push(Op::Get { pool, key });
                }
            }
        }
    }
    ops.extend([Op::Compact, Op::Limit(Some(-64)), Op::Frozen(true)]);
    ops.extend((0..POOL_CONFIGS.len()).map(|pool| Op::Put { pool, key: Key::new(1, 1), page: PageKind::Text(9) }));
    ops.push(Op::Frozen(false));
    ops.extend((0..POOL_CONFIGS.len()).map(|pool| Op::Put { pool, key: Key::new(1, 2), page: PageKind::Text(9) }));
    ops.extend([Op::Limit(None), Op::FlushObject { pool: 0, object: 1 }, Op::Recreate { pool: 2 }, Op::Compact]);
    run(&ops);
}
