//! Grouping cold pages (`StoreConfig::group`): a model-based property test
//! against a `BTreeMap` oracle (puts, overwrites, trims, flushes, gets,
//! grouping passes, compaction, hand-over), groups racing puts, gets,
//! flushes, compaction and writeback, writeback of grouped pages, hand-over
//! into stores that do and do not group, and the density gained on the
//! built-in corpora.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use rand_xoshiro::rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use tmem_core::codec::{train_dictionary, CodecConfig};
use tmem_core::{
    GetOutcome, GroupConfig, Grouping, Incompressible, Key, PolicyConfig, Pool, PoolConfig, PutOutcome, Store,
    StoreConfig, TierChain, PAGE_SIZE,
};
use tmem_tier::seal::Sealer;
use tmem_tier::MemTier;

mod common;
use common::{fill_writers, key, race_op, race_pool, race_writers, read, text_page as text, Page, RaceOp};

#[derive(Clone, Copy, Debug)]
enum Kind {
    Text(u64),
    /// One repeated word (no object).
    Same(u8),
    /// Half random: compresses a little, alone or together.
    Noisy(u64),
    /// Random: stored raw.
    Random(u64),
}

fn make(kind: Kind) -> Page {
    match kind {
        Kind::Text(s) => text(s),
        Kind::Same(b) => [b; PAGE_SIZE],
        Kind::Noisy(s) => {
            let mut p = text(s);
            Xoshiro256PlusPlus::seed_from_u64(s).fill_bytes(&mut p[..PAGE_SIZE / 2]);
            p
        }
        Kind::Random(s) => {
            let mut p = [0u8; PAGE_SIZE];
            Xoshiro256PlusPlus::seed_from_u64(s).fill_bytes(&mut p);
            p
        }
    }
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![
        8 => (0..64u64).prop_map(Kind::Text),
        1 => any::<u8>().prop_map(Kind::Same),
        1 => (0..8u64).prop_map(Kind::Noisy),
        1 => (0..8u64).prop_map(Kind::Random),
    ]
}

fn config(dictionary: bool) -> StoreConfig {
    let policy = PolicyConfig { incompressible: Incompressible::StoreRaw, ..Default::default() };
    let group = GroupConfig { dictionary, level: 3, cache_blocks: 1, ..Default::default() };
    StoreConfig { policy, group: Some(group), shards: 4, ..Default::default() }
}

const OBJECTS: u64 = 2;
const INDEXES: u64 = 80;

#[derive(Clone, Debug)]
enum Op {
    Put(u64, u64, Kind),
    /// Puts a run of text pages (a window's worth, so groups form).
    Fill(u64, u64, u8, u64),
    Get(u64, u64),
    Flush(u64, u64),
    /// Flushes `len` pages from `start` (a trim of a device range).
    Trim(u64, u64, u8),
    FlushObject(u64),
    /// A pass that ages pages and groups those unread since the last.
    Pass,
    GroupNow,
    Compact,
    /// Export, then import into a fresh store (which groups too).
    Handover,
}

fn op() -> impl Strategy<Value = Op> {
    let obj = 0..OBJECTS;
    prop_oneof![
        6 => (obj.clone(), 0..INDEXES, kind()).prop_map(|(o, i, k)| Op::Put(o, i, k)),
        3 => (obj.clone(), 0..INDEXES, 1..40u8, 0..1000u64).prop_map(|(o, i, n, s)| Op::Fill(o, i, n, s)),
        6 => (obj.clone(), 0..INDEXES).prop_map(|(o, i)| Op::Get(o, i)),
        2 => (obj.clone(), 0..INDEXES).prop_map(|(o, i)| Op::Flush(o, i)),
        2 => (obj.clone(), 0..INDEXES, 1..24u8).prop_map(|(o, i, n)| Op::Trim(o, i, n)),
        1 => obj.prop_map(Op::FlushObject),
        2 => Just(Op::Pass),
        3 => Just(Op::GroupNow),
        1 => Just(Op::Compact),
        1 => Just(Op::Handover),
    ]
}

struct Model {
    store: Store,
    pool: Arc<Pool>,
    grouping: Grouping,
    oracle: BTreeMap<Key, Page>,
}

impl Model {
    fn new() -> Self {
        let store = config(false).build().unwrap();
        let pool = store.create_pool(PoolConfig::persistent());
        let grouping = store.grouping().unwrap();
        Self { store, pool, grouping, oracle: BTreeMap::new() }
    }

    fn put(&mut self, key: Key, page: &Page) {
        assert_eq!(self.pool.put(key, page).unwrap(), PutOutcome::Stored, "{key:?}");
        self.oracle.insert(key, *page);
    }

    fn get(&self, key: Key) {
        let mut out = [0u8; PAGE_SIZE];
        let got = match self.pool.get(key, &mut out).unwrap() {
            GetOutcome::Hit => Some(out),
            GetOutcome::Miss => None,
        };
        assert!(got == self.oracle.get(&key).copied(), "{key:?}: the store and the oracle differ");
    }

    fn flush(&mut self, key: Key) {
        assert_eq!(self.pool.flush_page(key).unwrap(), self.oracle.remove(&key).is_some(), "{key:?}");
    }

    fn apply(&mut self, op: &Op) {
        match *op {
            Op::Put(o, i, k) => self.put(Key::new(o, i), &make(k)),
            Op::Fill(o, i, n, seed) => {
                for j in i..i + u64::from(n) {
                    self.put(Key::new(o, j), &text(seed + j));
                }
            }
            Op::Get(o, i) => self.get(Key::new(o, i)),
            Op::Flush(o, i) => self.flush(Key::new(o, i)),
            Op::Trim(o, i, n) => (i..i + u64::from(n)).for_each(|j| self.flush(Key::new(o, j))),
            Op::FlushObject(o) => {
                let n = self.oracle.keys().filter(|k| k.object == o).count() as u64;
                assert_eq!(self.pool.flush_object(o).unwrap(), n);
                self.oracle.retain(|k, _| k.object != o);
            }
            Op::Pass => self.grouping.pass(),
            Op::GroupNow => self.grouping.group_now(),
            Op::Compact => drop(self.store.compact()),
            Op::Handover => {
                let mut stream = Vec::new();
                let sent = self.store.export(&mut stream).unwrap();
                let (store, got) = Store::import(config(false), &mut stream.as_slice()).unwrap();
                assert_eq!(sent, got);
                assert_eq!(store.stats().total.group_pages, self.store.stats().total.group_pages);
                self.pool = store.pool(0).unwrap();
                self.grouping = store.grouping().unwrap();
                self.store = store;
            }
        }
        self.check();
    }

    fn check(&self) {
        self.store.check_groups();
        let st = self.store.stats();
        let t = &st.total;
        assert_eq!(t.stored_pages, self.oracle.len() as u64);
        let held: u64 = st.codecs.iter().map(|c| c.pages).sum();
        assert_eq!(held + t.same_filled_pages, t.stored_pages, "{:?}", st.codecs);
        let bytes: u64 = st.codecs.iter().map(|c| c.bytes).sum();
        assert_eq!(bytes, t.compr_data_size, "{:?}", st.codecs);
        assert!(t.group_bytes <= t.compr_data_size);
        assert_eq!(st.mem_used_total, st.metadata_bytes + st.alloc.span_bytes);
    }

    /// Reads every key, then removes everything: nothing may be left.
    fn finish(mut self) {
        for o in 0..OBJECTS {
            for i in 0..INDEXES + 64 {
                self.get(Key::new(o, i));
            }
        }
        for o in 0..OBJECTS {
            self.apply(&Op::FlushObject(o));
        }
        self.grouping.pass();
        let st = self.store.stats();
        let t = &st.total;
        assert_eq!((t.stored_pages, t.groups, t.group_pages, t.group_bytes, t.group_dead_pages), (0, 0, 0, 0, 0));
        assert_eq!((st.alloc.objects, st.alloc.span_bytes, t.compr_data_size), (0, 0, 0));
        // No dictionary: codecs hold no memory; index, groups and cache gave theirs back.
        assert_eq!(st.mem_used_total, 0, "{st:?}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn grouping_matches_the_model(ops in prop::collection::vec(op(), 1..120)) {
        let mut m = Model::new();
        for op in &ops {
            m.apply(op);
        }
        m.finish();
    }
}

#[test]
fn fixed_sequence_covers_rewrites_and_handover() {
    let mut m = Model::new();
    let ops = [
        Op::Fill(0, 0, 40, 7),
        Op::GroupNow,
        Op::Put(0, 3, Kind::Same(9)),
        Op::Trim(0, 4, 6),
        Op::Put(0, 17, Kind::Random(1)),
        Op::Get(0, 20),
        Op::Handover,
        Op::Pass,
        Op::Compact,
        Op::Get(0, 2),
        Op::Fill(1, 60, 20, 3),
        Op::Pass,
        Op::Pass,
        Op::Handover,
        Op::Trim(0, 30, 8),
        Op::GroupNow,
    ];
    for op in &ops {
        m.apply(op);
    }
    let t = m.store.stats().total;
    assert!(t.group_rewrites > 0 && t.groups > 0, "{t:?}");
    m.finish();
}

/// Writers (each on its own keys, checked against its own oracle) race
/// grouping passes and compaction, and, with a tier, writeback.
fn race(writers: Vec<Vec<RaceOp>>, with_tier: bool) {
    let mut cfg = config(false);
    cfg.policy.max_pool_bytes = if with_tier { 160 << 10 } else { 0 };
    let store = Arc::new(cfg.build().unwrap());
    let pool = race_pool(&store, with_tier);
    let oracles = fill_writers(&pool, writers.len());
    let mut grouping = store.grouping().unwrap();
    grouping.group_now();
    assert!(store.stats().total.group_pages > 0, "{:?}", store.stats().total);
    let _writeback = with_tier.then(|| store.start_writeback(Duration::from_millis(1)));
    let mut n = 0u32;
    race_writers(&store, &pool, &writers, oracles, || {
        if n.is_multiple_of(2) {
            grouping.group_now();
        } else {
            grouping.pass();
        }
        n += 1;
    });
    store.check_groups();
    let st = store.stats();
    assert_eq!(st.total.decompress_fail + st.total.tier_get_fail, 0);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn grouping_racing_puts_gets_flushes_and_compaction_loses_nothing(
        writers in prop::collection::vec(prop::collection::vec(race_op(3, 5, 1), 200..600), 3)
    ) {
        race(writers, false);
    }

    #[test]
    fn grouping_racing_writeback_loses_nothing(
        writers in prop::collection::vec(prop::collection::vec(race_op(3, 5, 1), 200..600), 3)
    ) {
        race(writers, true);
    }
}

#[test]
fn writeback_takes_grouped_pages_out_as_single_pages() {
    let store = config(false).build().unwrap();
    let chain = TierChain::new(vec![Arc::new(MemTier::new(1 << 30))], Arc::new(Sealer::random().unwrap())).unwrap();
    let pool = store.create_pool_with_tiers(PoolConfig::persistent(), chain);
    for i in 0..64 {
        assert_eq!(pool.put(key(i), &text(i)).unwrap(), PutOutcome::Stored);
    }
    store.grouping().unwrap().group_now();
    assert_eq!(store.stats().total.groups, 4);
    let r = pool.write_back(64);
    assert_eq!(r.pages, 64);
    let st = store.stats();
    assert_eq!((st.total.tier_pages, st.total.groups, st.total.group_pages), (64, 0, 0));
    assert!(r.slot_bytes > 0, "the groups died with their last page: their chunks are freed");
    assert_eq!((st.alloc.objects, st.alloc.span_bytes), (0, 0));
    store.check_groups();
    for i in 0..64 {
        assert_eq!(read(&pool, i), Some(text(i)), "page {i}");
    }
    assert_eq!(store.stats().total.tier_gets, 64);
}

#[test]
fn handover_into_a_store_without_grouping_expands_the_groups() {
    let store = config(false).build().unwrap();
    let pool = store.create_pool(PoolConfig::persistent());
    for i in 0..40 {
        assert_eq!(pool.put(key(i), &text(i)).unwrap(), PutOutcome::Stored);
    }
    store.grouping().unwrap().group_now();
    assert!(pool.flush_page(key(3)).unwrap());
    let t = store.stats().total;
    assert_eq!((t.group_pages, t.group_dead_pages), (39, 1));
    let mut stream = Vec::new();
    let sent = store.export(&mut stream).unwrap();
    assert_eq!(sent.pages, 39);
    // A successor that groups gets the groups as they are.
    let (same, _) = Store::import(config(false), &mut stream.as_slice()).unwrap();
    let ts = same.stats().total;
    assert_eq!((ts.group_pages, ts.groups, ts.group_bytes, ts.group_dead_pages), (39, t.groups, t.group_bytes, 1));
    assert_eq!((ts.pages_grouped, ts.group_cache_misses), (t.pages_grouped, t.group_cache_misses));
    same.check_groups();
    // One that does not stores each page singly.
    let plain = StoreConfig { shards: 4, ..Default::default() };
    let (single, got) = Store::import(plain, &mut stream.as_slice()).unwrap();
    assert_eq!(got.pages, 39);
    let tp = single.stats().total;
    assert_eq!((tp.stored_pages, tp.group_pages, tp.groups), (39, 0, 0));
    for s in [&same, &single] {
        let p = s.pool(0).unwrap();
        for i in 0..40 {
            assert_eq!(read(&p, i), (i != 3).then(|| text(i)), "page {i}");
        }
    }
    // A damaged group record is one error.
    let at = stream.len() / 2;
    stream[at] ^= 0x40;
    assert!(Store::import(config(false), &mut stream.as_slice()).is_err());
}

/// Object bytes the store holds for `pages` stored at adjacent indexes in
/// `codec`, before and after grouping them (with the store's dictionary
/// when `codec` has one); every page is read back.
fn density(pages: &[Page], codec: CodecConfig) -> (u64, u64) {
    let dictionary = matches!(codec, CodecConfig::Zstd { dictionary: Some(_), .. });
    let group = GroupConfig { level: 9, dictionary, ..Default::default() };
    let policy = PolicyConfig { incompressible: Incompressible::StoreRaw, ..Default::default() };
    let store = StoreConfig { codec: Some(codec), policy, group: Some(group), ..Default::default() }.build().unwrap();
    let pool = store.create_pool(PoolConfig::persistent());
    for (i, p) in pages.iter().enumerate() {
        assert_eq!(pool.put(Key::new(0, i as u64), p).unwrap(), PutOutcome::Stored);
    }
    let single = store.stats().total.compr_data_size;
    store.grouping().unwrap().group_now();
    let grouped = store.stats().total.compr_data_size;
    for (i, p) in pages.iter().enumerate() {
        let mut out = [0u8; PAGE_SIZE];
        assert_eq!(pool.get(Key::new(0, i as u64), &mut out).unwrap(), GetOutcome::Hit);
        assert!(out == *p, "page {i}");
    }
    (single, grouped)
}

/// The density check on the built-in corpora (`examples/group_density.rs`
/// runs it on any corpus file, with span and total memory too). They are
/// 512-page random samples of larger captures, so neighbours are not
/// neighbours in the program: a floor for what adjacent pages give.
/// Grouped blocks hold the pages in fewer bytes than each page alone in
/// zstd-9; with a dictionary (trained on the same corpus) in no more.
#[test]
fn grouped_pages_are_denser_than_single_zstd9_pages_on_the_builtin_corpora() {
    for c in &tmem_corpus::Corpus::builtin() {
        let pages: Vec<Page> = c.pages().copied().collect();
        let dict = train_dictionary(pages.iter().step_by(4), 64 << 10).unwrap();
        let zstd9 = CodecConfig::Zstd { level: 9, dictionary: None };
        let (single, grouped) = density(&pages, zstd9.clone());
        let (single_dict, grouped_dict) = density(&pages, zstd9.with_dictionary(dict));
        let name = &c.meta.program;
        println!(
            "{name}: {} pages; zstd-9 {single} -> {grouped} bytes ({:.3}x); zstd-9+dict {single_dict} -> {grouped_dict} ({:.3}x)",
            pages.len(),
            single as f64 / grouped as f64,
            single_dict as f64 / grouped_dict as f64
        );
        assert!(grouped * 20 < single * 19, "{name}: grouping saves at least 5%: {single} -> {grouped}");
        assert!(grouped_dict <= single_dict, "{name}: {single_dict} -> {grouped_dict}");
    }
}
