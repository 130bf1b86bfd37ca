//! A small store against a `HashMap` oracle: puts, gets, flushes, compaction,
//! policy and codec changes and pool re-creation chosen by the input, on
//! persistent (shared, exclusive, keep-old-on-reject) and ephemeral pools.
//! Same invariants as tests/model.rs, without predicting compressed sizes.

#![no_main]

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::{page_from, Cursor, Page};
use libfuzzer_sys::fuzz_target;
use tmem_core::codec::{same_filled, CodecConfig};
use tmem_core::{
    GetOutcome, Key, Pool, PoolConfig, PoolKind, PutOutcome, Reject, Store, StoreConfig, StoreError, PAGE_SIZE,
    RAW_CODEC,
};

struct Slot {
    pool: Arc<Pool>,
    oracle: HashMap<Key, Page>,
}

impl Slot {
    fn persistent(&self) -> bool {
        self.pool.config().kind == PoolKind::Persistent
    }
}

struct Model {
    store: Store,
    slots: Vec<Slot>,
    codecs: Vec<u8>,
    limited: bool,
    frozen: bool,
    store_raw: bool,
}

fn configs() -> [PoolConfig; 5] {
    [
        PoolConfig::persistent(),
        PoolConfig::persistent().exclusive_gets(true),
        PoolConfig::persistent().reject_keeps_old(true),
        PoolConfig::ephemeral(),
        PoolConfig::ephemeral().exclusive_gets(true),
    ]
}

impl Model {
    fn new() -> Self {
        let store = StoreConfig::default().build().expect("store");
        let mut codecs = vec![RAW_CODEC];
        for cfg in [CodecConfig::LZ4, CodecConfig::Zstd { level: 1, dictionary: None }] {
            codecs.push(store.register_codec(&cfg).expect("codec"));
        }
        let slots = configs().into_iter().map(|cfg| Slot { pool: store.create_pool(cfg), oracle: HashMap::new() }).collect();
        Self { store, slots, codecs, limited: false, frozen: false, store_raw: false }
    }

    fn put(&mut self, i: usize, key: Key, page: &Page) {
        let (frozen, limited, store_raw) = (self.frozen, self.limited, self.store_raw);
        let s = &mut self.slots[i];
        let outcome = s.pool.put(key, page).expect("put");
        let old = s.oracle.remove(&key);
        match outcome {
            PutOutcome::Stored => {
                assert!(!frozen, "stored while frozen");
                s.oracle.insert(key, *page);
            }
            PutOutcome::Rejected(why) => {
                match why {
                    Reject::Frozen => assert!(frozen, "Frozen while not frozen"),
                    Reject::PoolLimit => assert!(limited && !frozen, "PoolLimit without a limit"),
                    Reject::CompressPoor => {
                        assert!(!frozen && !store_raw && same_filled(page).is_none(), "CompressPoor")
                    }
                    other => panic!("unexpected rejection {other:?}"),
                }
                if s.pool.config().reject_keeps_old {
                    if let Some(old) = old {
                        s.oracle.insert(key, old);
                    }
                }
            }
        }
        let held = s.pool.contains(key).expect("contains");
        if s.persistent() {
            assert_eq!(held, s.oracle.contains_key(&key), "pool {i}: {key:?} after {outcome:?}");
        } else {
            assert!(!held || s.oracle.contains_key(&key), "pool {i}: stale {key:?} after {outcome:?}");
        }
    }

    fn get(&mut self, i: usize, key: Key) {
        let s = &mut self.slots[i];
        let mut out = [0x5au8; PAGE_SIZE];
        match s.pool.get(key, &mut out).expect("get") {
            GetOutcome::Hit => {
                let want = s.oracle.get(&key).unwrap_or_else(|| panic!("pool {i}: hit on {key:?}, never stored"));
                assert!(out == *want, "pool {i}: {key:?} returned different bytes");
                if s.pool.config().exclusive_gets {
                    s.oracle.remove(&key);
                }
            }
            GetOutcome::Miss => {
                assert!(!s.persistent() || !s.oracle.contains_key(&key), "pool {i}: miss on stored {key:?}");
                s.oracle.remove(&key);
            }
        }
    }

    fn check(&self) {
        let st = self.store.stats();
        for (i, s) in self.slots.iter().enumerate() {
            let ps = s.pool.stats();
            let live = s.oracle.len() as u64;
            if s.persistent() {
                assert_eq!(ps.stored_pages, live, "pool {i} stored_pages");
                let same = s.oracle.values().filter(|p| same_filled(p).is_some()).count() as u64;
                assert_eq!(ps.same_filled_pages, same, "pool {i} same_filled_pages");
                assert_eq!(ps.evicted_pages, 0);
            } else {
                assert!(ps.stored_pages <= live, "pool {i}: more pages than stored");
                assert!(live - ps.stored_pages <= ps.evicted_pages, "pool {i}: pages lost without eviction");
            }
            assert_eq!(ps.decompress_fail, 0);
        }
        let t = &st.total;
        assert_eq!(st.alloc.objects, t.stored_pages - t.same_filled_pages, "allocator objects");
        assert!(st.alloc.slot_bytes >= t.compr_data_size && st.alloc.slot_bytes <= st.alloc.span_bytes);
        if st.alloc.objects == 0 {
            assert_eq!(st.alloc.span_bytes, 0);
        }
    }

    fn recreate(&mut self, i: usize) {
        let id = self.slots[i].pool.id();
        self.store.destroy_pool(id).expect("destroy");
        let old = Arc::clone(&self.slots[i].pool);
        let mut out = [0u8; PAGE_SIZE];
        assert!(matches!(old.put(Key::new(0, 0), &out), Err(StoreError::PoolDestroyed(_))));
        assert!(matches!(old.get(Key::new(0, 0), &mut out), Err(StoreError::PoolDestroyed(_))));
        assert!(matches!(self.store.destroy_pool(id), Err(StoreError::PoolDestroyed(_))));
        let pool = self.store.create_pool(old.config().clone());
        self.slots[i] = Slot { pool, oracle: HashMap::new() };
    }
}

fuzz_target!(|data: &[u8]| {
    let mut c = Cursor::new(data);
    let mut m = Model::new();
    while !c.is_empty() {
        let i = c.below(m.slots.len());
        let key = Key::new(u64::from(c.u8() & 1), u64::from(c.u8() & 15));
        match c.below(16) {
            0..=5 => {
                let page = page_from(&mut c);
                m.put(i, key, &page);
            }
            6..=8 => m.get(i, key),
            9 => {
                let s = &mut m.slots[i];
                let had = s.oracle.remove(&key).is_some();
                let removed = s.pool.flush_page(key).expect("flush_page");
                assert!(if s.persistent() { removed == had } else { had || !removed }, "flush_page({key:?})");
            }
            10 => {
                let s = &mut m.slots[i];
                let before = s.oracle.len();
                s.oracle.retain(|k, _| k.object != key.object);
                let had = (before - s.oracle.len()) as u64;
                let n = s.pool.flush_object(key.object).expect("flush_object");
                assert!(if s.persistent() { n == had } else { n <= had }, "flush_object");
            }
            11 => {
                m.store.compact();
            }
            12 => {
                let limit = match c.below(4) {
                    0 => 0,
                    1 => m.store.mem_used_total().saturating_sub(16 << 10).max(1),
                    2 => m.store.mem_used_total() + (16 << 10),
                    _ => u64::from(c.u16()) << 6,
                };
                m.store.set_policy("max_pool_bytes", &limit.to_string()).expect("limit");
                m.limited |= limit != 0;
            }
            13 => match c.below(3) {
                0 => {
                    m.frozen = !m.frozen;
                    m.store.set_policy("frozen", if m.frozen { "on" } else { "off" }).expect("frozen");
                }
                1 => {
                    m.store_raw = !m.store_raw;
                    m.store.set_policy("incompressible", if m.store_raw { "raw" } else { "reject" }).expect("raw");
                }
                _ => {
                    let n = usize::from(c.u16()) % (PAGE_SIZE + 2);
                    let r = m.store.set_policy("max_compressed_size", &n.to_string());
                    assert_eq!(r.is_ok(), (1..=PAGE_SIZE).contains(&n), "max_compressed_size={n}");
                }
            },
            14 => {
                let id = m.codecs[c.below(m.codecs.len())];
                m.store.set_codec(id).expect("set_codec");
            }
            _ => m.recreate(i),
        }
        m.check();
    }
    // Final sweep with no limit: persistent pools hold exactly the oracle.
    m.store.set_policy("max_pool_bytes", "0").expect("unlimit");
    for i in 0..m.slots.len() {
        for o in 0..2 {
            for x in 0..16 {
                m.get(i, Key::new(o, x));
            }
        }
    }
    m.check();
    for s in &m.slots {
        m.store.destroy_pool(s.pool.id()).expect("destroy");
    }
    let st = m.store.stats();
    assert_eq!((st.alloc.objects, st.alloc.span_bytes), (0, 0), "store not empty after destroying every pool");
});
