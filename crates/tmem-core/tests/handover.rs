//! Store hand-over (`Store::export` → `Store::import`, and the zero-copy
//! `Store::export_image` → `Store::import_image`): every page, codec, pool
//! and counter arrives; a damaged or truncated stream is one error.

// Test data: byte extraction from u64s.
#![allow(clippy::cast_possible_truncation)]

use proptest::prelude::*;
use std::sync::Arc;
use tmem_core::codec::CodecConfig;
use tmem_core::{
    DictTraining, Eviction, GetOutcome, Key, PolicyConfig, PoolConfig, PoolStats, Store, StoreConfig, StoreError,
    TierChain, PAGE_SIZE,
};
use tmem_tier::seal::Sealer;
use tmem_tier::{MemTier, Tier};

mod mixed;
use mixed::page;

use mixed::Op;

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![9 => mixed::page_op(400, [6, 2, 1]), 1 => Just(Op::Zstd)]
}

fn config(limit: u64) -> StoreConfig {
    StoreConfig { policy: PolicyConfig { max_pool_bytes: limit, ..Default::default() }, ..Default::default() }
}

/// Runs `ops` on a store with a persistent, an ephemeral and a destroyed
/// pool; returns it with its pool ids.
fn build(ops: &[Op], limit: u64) -> (Store, Vec<u32>) {
    build_in(config(limit), ops)
}

fn build_in(cfg: StoreConfig, ops: &[Op]) -> (Store, Vec<u32>) {
    let store = cfg.build().unwrap();
    let gone = store.create_pool(PoolConfig::persistent());
    let pools = [
        store.create_pool(PoolConfig::persistent().reject_keeps_old(true)),
        store.create_pool(PoolConfig::ephemeral()),
        store.create_pool(PoolConfig::ephemeral().eviction(Eviction::Lru)),
    ];
    store.destroy_pool(gone.id()).unwrap();
    let mut out = [0u8; PAGE_SIZE];
    let mut zstd = None;
    for op in ops {
        match *op {
            Op::Put { pool, index, kind, seed } => {
                let _ = pools[pool].put(Key::new(1, index), &page(kind, seed)).unwrap();
            }
            Op::Get { pool, index } => {
                let _ = pools[pool].get(Key::new(1, index), &mut out).unwrap();
            }
            Op::Flush { pool, index } => {
                let _ = pools[pool].flush_page(Key::new(1, index)).unwrap();
            }
            Op::Zstd => match zstd {
                Some(id) => store.set_codec(id).unwrap(),
                None => zstd = Some(store.use_codec(&CodecConfig::Zstd { level: 1, dictionary: None }).unwrap()),
            },
            Op::Group | Op::Compact | Op::Recompress | Op::WriteBack | Op::NewPool => {
                unreachable!("not generated here")
            }
        }
    }
    (store, pools.iter().map(|p| p.id()).collect())
}

/// Runs `ops` on pools `ids` of `store` (as [`build_in`] numbers them).
fn run(store: &Store, ids: &[u32], ops: &[Op]) {
    let mut out = [0u8; PAGE_SIZE];
    for op in ops {
        match *op {
            Op::Put { pool, index, kind, seed } => {
                let _ = store.pool(ids[pool]).unwrap().put(Key::new(1, index), &page(kind, seed)).unwrap();
            }
            Op::Get { pool, index } => {
                let _ = store.pool(ids[pool]).unwrap().get(Key::new(1, index), &mut out).unwrap();
            }
            Op::Flush { pool, index } => {
                let _ = store.pool(ids[pool]).unwrap().flush_page(Key::new(1, index)).unwrap();
            }
            Op::Zstd => {}
            Op::Group | Op::Compact | Op::Recompress | Op::WriteBack | Op::NewPool => {
                unreachable!("not generated here")
            }
        }
    }
}

/// Seals `a` and hands its image to a new store mapping the same memfd.
fn hand_image(a: &Store, cfg: StoreConfig) -> (Store, tmem_core::HandoverSummary, tmem_core::HandoverSummary) {
    a.seal(true);
    let mut image = Vec::new();
    let sent = a.export_image(&mut image).unwrap();
    let fd = a.memfd().unwrap().try_clone_to_owned().unwrap();
    let (b, got) = Store::import_image(cfg, &mut image.as_slice(), fd).unwrap();
    (b, sent, got)
}

fn shared(limit: u64) -> StoreConfig {
    StoreConfig { shared_memory: true, ..config(limit) }
}

/// Every page of `a` is in `b`, byte for byte, and nothing else is.
fn same_pages(a: &Store, b: &Store, ids: &[u32]) {
    for &id in ids {
        mixed::same_pages_of(a, b, id, 2500);
    }
}

/// The counters a successor carries on with: all but the gauges it
/// recomputes from the pages it holds.
fn carried(s: &PoolStats) -> PoolStats {
    PoolStats { compr_data_size: 0, ..s.clone() }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn an_imported_store_holds_every_page_and_counter(ops in prop::collection::vec(op(), 1..300), small in any::<bool>()) {
        let limit = if small { 256 << 10 } else { 0 };
        let (a, ids) = build(&ops, limit);
        let mut stream = Vec::new();
        let sent = a.export(&mut stream).unwrap();
        let (b, got) = Store::import(config(0), &mut stream.as_slice()).unwrap();
        prop_assert_eq!(sent, got);
        prop_assert_eq!(a.codec_name(), b.codec_name());
        prop_assert_eq!(a.policy().config(), b.policy().config());
        prop_assert!(matches!(b.pool(0), Err(StoreError::PoolDestroyed(0))));
        for &id in &ids {
            let (sa, sb) = (a.pool(id).unwrap().stats(), b.pool(id).unwrap().stats());
            prop_assert_eq!(carried(&sa), carried(&sb));
        }
        same_pages(&a, &b, &ids);
        // The successor goes on: puts and a second hand-over work.
        let p = b.pool(ids[0]).unwrap();
        prop_assert_eq!(p.put(Key::new(1, 7), &page(0, 99)).unwrap(), tmem_core::PutOutcome::Stored);
        let mut again = Vec::new();
        b.export(&mut again).unwrap();
        let (c, _) = Store::import(config(0), &mut again.as_slice()).unwrap();
        same_pages(&b, &c, &ids);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    /// The successor of an image holds every page and counter, reading
    /// none; the sealed predecessor changes nothing; once opened, the
    /// successor's puts and flushes (which reuse the predecessor's free
    /// slots and spans) keep every page right, against a streamed copy
    /// given the same operations.
    #[test]
    fn an_image_is_adopted_without_a_copy(
        ops in prop::collection::vec(op(), 1..300),
        more in prop::collection::vec(op(), 1..300),
        small in any::<bool>(),
        reshard in any::<bool>(),
    ) {
        let limit = if small { 256 << 10 } else { 0 };
        let (a, ids) = build_in(shared(limit), &ops);
        // A successor with other shards than the exporter's places each page itself.
        let successor = if reshard { StoreConfig { shards: 1, ..shared(0) } } else { shared(0) };
        let (b, sent, got) = hand_image(&a, successor);
        prop_assert_eq!(sent, got);
        prop_assert_eq!(b.populate().unwrap() * PAGE_SIZE as u64, a.stats().alloc.span_bytes, "every span is mapped");
        prop_assert_eq!(a.codec_name(), b.codec_name());
        prop_assert_eq!(a.stats().alloc.span_bytes, b.stats().alloc.span_bytes, "the memory is counted once, alike");
        prop_assert_eq!(a.stats().alloc.objects, b.stats().alloc.objects);
        for &id in &ids {
            let (sa, sb) = (a.pool(id).unwrap().stats(), b.pool(id).unwrap().stats());
            prop_assert_eq!(carried(&sa), carried(&sb));
        }
        same_pages(&a, &b, &ids);
        // Sealed: the predecessor and the successor refuse puts.
        let p = a.pool(ids[0]).unwrap();
        prop_assert!(!matches!(p.put(Key::new(1, 5000), &page(0, 1)).unwrap(), tmem_core::PutOutcome::Stored));
        let q = b.pool(ids[0]).unwrap();
        prop_assert!(!matches!(q.put(Key::new(1, 5000), &page(0, 1)).unwrap(), tmem_core::PutOutcome::Stored));
        // A streamed copy of the same pages as the oracle.
        let mut stream = Vec::new();
        a.export(&mut stream).unwrap();
        let (c, _) = Store::import(config(0), &mut stream.as_slice()).unwrap();
        b.seal(false);
        // The two count memory differently (the image reuses the
        // predecessor's spans, the copy packs afresh and compacts), so at a
        // limit they would evict different pages: the oracle runs unlimited.
        for s in [&b, &c] {
            s.policy().set("max_pool_bytes", "0").unwrap();
        }
        run(&b, &ids, &more);
        run(&c, &ids, &more);
        same_pages(&b, &c, &ids);
        // And a second image, from the successor to a third process.
        let (d, _, _) = hand_image(&b, shared(0));
        same_pages(&b, &d, &ids);
    }
}

#[test]
fn a_grouped_image_keeps_its_groups() {
    let grouped = || StoreConfig {
        group: Some(tmem_core::GroupConfig { dictionary: false, level: 3, ..Default::default() }),
        ..shared(0)
    };
    let ops: Vec<Op> = (0..256).map(|i| Op::Put { pool: 0, index: i, kind: 0, seed: i }).collect();
    let (a, ids) = build_in(grouped(), &ops);
    a.grouping().unwrap().group_now();
    let grouped_pages = a.stats().total.pages_grouped;
    assert!(grouped_pages >= 200, "only {grouped_pages} pages grouped");
    // Grouping must stay as it was.
    a.seal(true);
    let mut image = Vec::new();
    a.export_image(&mut image).unwrap();
    let fd = a.memfd().unwrap().try_clone_to_owned().unwrap();
    let e = Store::import_image(shared(0), &mut image.as_slice(), fd).unwrap_err().to_string();
    assert!(e.contains("grouping must stay as it was"), "{e}");
    a.seal(false);
    let (b, _, got) = hand_image(&a, grouped());
    assert_eq!(got.pages, 256);
    assert_eq!(b.stats().total.pages_grouped, grouped_pages);
    same_pages(&a, &b, &ids);
    // Overwrites and flushes inside the groups, against a streamed copy.
    let mut stream = Vec::new();
    a.export(&mut stream).unwrap();
    let (c, _) = Store::import(grouped(), &mut stream.as_slice()).unwrap();
    b.seal(false);
    let more: Vec<Op> =
        (0..256)
            .step_by(3)
            .map(|i| {
                if i % 2 == 0 {
                    Op::Flush { pool: 0, index: i }
                } else {
                    Op::Put { pool: 0, index: i, kind: 1, seed: i }
                }
            })
            .collect();
    run(&b, &ids, &more);
    run(&c, &ids, &more);
    same_pages(&b, &c, &ids);
}

#[test]
fn an_image_keeps_its_shard_layout() {
    let windows = || StoreConfig { shard_windows: true, ..shared(0) };
    let ops: Vec<Op> = (0..512).map(|i| Op::Put { pool: 0, index: i, kind: 0, seed: i }).collect();
    for (from, to) in [(windows(), shared(0)), (shared(0), windows()), (windows(), windows())] {
        let (a, ids) = build_in(from, &ops);
        // Whatever the successor's own setting, the image's layout holds:
        // a key looked up in another shard than its entry's would miss.
        let (b, _, got) = hand_image(&a, to);
        assert_eq!(got.pages, 512);
        same_pages(&a, &b, &ids);
        // And it goes on (the memfd is b's now: compare with a store of
        // its own that took the same puts).
        b.seal(false);
        run(&b, &ids, &ops);
        let (c, _) = build_in(shared(0), &ops);
        same_pages(&c, &b, &ids);
    }
    // Grouping still must stay as it was.
    let (a, _) = build_in(windows(), &ops);
    a.seal(true);
    let mut image = Vec::new();
    a.export_image(&mut image).unwrap();
    let fd = a.memfd().unwrap().try_clone_to_owned().unwrap();
    let grouped = StoreConfig { group: Some(tmem_core::GroupConfig::default()), ..shared(0) };
    let e = Store::import_image(grouped, &mut image.as_slice(), fd).unwrap_err().to_string();
    assert!(e.contains("never groups pages") && e.contains("grouping must stay as it was"), "{e}");
}

#[test]
fn a_damaged_image_is_one_error() {
    let ops: Vec<Op> =
        (0..300).map(|i| Op::Put { pool: (i % 3) as usize, index: i, kind: (i % 3) as u8, seed: i }).collect();
    let (a, _) = build_in(shared(0), &ops);
    a.seal(true);
    let mut image = Vec::new();
    a.export_image(&mut image).unwrap();
    let fd = || a.memfd().unwrap().try_clone_to_owned().unwrap();
    for cut in (0..image.len()).step_by(image.len() / 97 + 1) {
        let e = Store::import_image(shared(0), &mut &image[..cut], fd()).unwrap_err();
        assert!(matches!(e, StoreError::Handover(_)), "cut at {cut}: {e}");
    }
    for at in (0..image.len()).step_by(image.len() / 61 + 1) {
        let mut bad = image.clone();
        bad[at] ^= 0x10;
        let e = Store::import_image(shared(0), &mut bad.as_slice(), fd()).unwrap_err();
        assert!(e.to_string().contains("hand-over"), "flip at {at}: {e}");
    }
    // A stream is not an image, and a private store has none.
    let mut stream = Vec::new();
    a.export(&mut stream).unwrap();
    let e = Store::import_image(shared(0), &mut stream.as_slice(), fd()).unwrap_err().to_string();
    assert!(e.contains("not a tmem store image"), "{e}");
    let (private, _) = build(&ops, 0);
    private.seal(true);
    let e = private.export_image(&mut Vec::new()).unwrap_err().to_string();
    assert!(e.contains("private memory"), "{e}");
    let unsealed = shared(0).build().unwrap();
    let e = unsealed.export_image(&mut Vec::new()).unwrap_err().to_string();
    assert!(e.contains("sealed"), "{e}");
}

#[test]
fn a_dictionary_travels_with_the_pages_that_need_it() {
    let cfg = config(0);
    let base = cfg.codec.clone().unwrap_or(CodecConfig::LZ4);
    let a = cfg.build().unwrap();
    let p = a.create_pool(PoolConfig::persistent());
    for i in 0..2000 {
        assert_eq!(p.put(Key::new(1, i), &page(0, i)).unwrap(), tmem_core::PutOutcome::Stored);
    }
    // Trained here, not by the background trainer: that one starts as soon
    // as its threshold is passed and, on a loaded machine, could sample too
    // few pages and give up (a CI run saw it).
    let training = DictTraining { sample_pages: 512, ..DictTraining::default() };
    a.train_dictionary(&base, &training).unwrap();
    assert!(a.codec_name().contains("dict"), "no dictionary: {}", a.codec_name());
    for i in 2000..2500 {
        assert_eq!(p.put(Key::new(1, i), &page(0, i)).unwrap(), tmem_core::PutOutcome::Stored);
    }
    let mut stream = Vec::new();
    a.export(&mut stream).unwrap();
    let (b, sum) = Store::import(StoreConfig::default(), &mut stream.as_slice()).unwrap();
    assert_eq!(sum.pages, 2500);
    assert_eq!(b.codec_name(), a.codec_name());
    same_pages(&a, &b, &[0]);
}

#[test]
fn a_damaged_or_short_stream_is_one_error() {
    let ops: Vec<Op> =
        (0..300).map(|i| Op::Put { pool: (i % 3) as usize, index: i, kind: (i % 3) as u8, seed: i }).collect();
    let (a, _) = build(&ops, 0);
    let mut stream = Vec::new();
    a.export(&mut stream).unwrap();
    for cut in (0..stream.len()).step_by(stream.len() / 97 + 1).chain([stream.len() - 1]) {
        let e = Store::import(config(0), &mut &stream[..cut]).unwrap_err();
        assert!(matches!(e, StoreError::Handover(_)), "cut at {cut}: {e}");
    }
    for at in (0..stream.len()).step_by(stream.len() / 61 + 1) {
        let mut bad = stream.clone();
        bad[at] ^= 0x10;
        let e = Store::import(config(0), &mut bad.as_slice()).unwrap_err();
        assert!(e.to_string().contains("hand-over"), "flip at {at}: {e}");
    }
    let mut other = stream.clone();
    other[8] = 99;
    let e = Store::import(config(0), &mut other.as_slice()).unwrap_err().to_string();
    assert!(e.contains("export format 99"), "{e}");
}

/// A store whose pool has a tier below it, with pages in the pool and
/// pages written back to the tier.
fn tiered_store(cfg: StoreConfig, ops: &[Op]) -> (Store, Vec<u32>, Arc<MemTier>) {
    let store = cfg.build().unwrap();
    let tier = Arc::new(MemTier::new(64 << 20));
    let chain = TierChain::new(vec![tier.clone() as Arc<dyn Tier>], Arc::new(Sealer::random().unwrap())).unwrap();
    let pool = store.create_pool_with_tiers(PoolConfig::persistent().reject_keeps_old(true), chain);
    let plain = store.create_pool(PoolConfig::ephemeral());
    let ids = [pool.id(), plain.id()];
    for (i, op) in ops.iter().enumerate() {
        if let Op::Put { pool, index, kind, seed } = *op {
            let _ = store.pool(ids[pool % 2]).unwrap().put(Key::new(1, index), &page(kind, seed)).unwrap();
        }
        if i % 7 == 6 {
            let _ = pool.write_back(5);
        }
    }
    (store, ids.to_vec(), tier)
}

/// Hands `a` over with its tiers, streamed or as an image, as the daemon
/// does: writeback held, each tier's state adopted, the store imported
/// with them.
fn hand_tiered(a: &Store, image: bool) -> (Store, Arc<MemTier>) {
    let hold = a.hold_tiers();
    let mut states = hold.hand_over().unwrap();
    assert_eq!(states.len(), 1, "one pool has tiers");
    let (pool, mut handed) = states.pop().unwrap();
    let next = Arc::new(MemTier::adopt(&handed.pop().unwrap()).unwrap());
    let mut stream = Vec::new();
    let memfd = if image {
        a.seal(true);
        a.export_image(&mut stream).unwrap();
        Some(a.memfd().unwrap().try_clone_to_owned().unwrap())
    } else {
        a.export(&mut stream).unwrap();
        None
    };
    let given = next.clone();
    let mut tiers = |id: u32, n: usize| {
        assert_eq!((id, n), (pool, 1));
        Ok(vec![given.clone() as Arc<dyn Tier>])
    };
    let (b, _) = Store::import_tiered(shared(0), &mut stream.as_slice(), memfd, &mut tiers).unwrap();
    b.seal(false);
    (b, next)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    /// Pages in the pool and pages in a tier are all read back from the
    /// successor, which goes on writing back under the same sealer without
    /// ever reusing a sealing version (the nonce audit would panic), and
    /// can be handed over again.
    #[test]
    fn a_store_with_tiers_is_handed_over_with_them(
        ops in prop::collection::vec(op(), 20..300),
        more in prop::collection::vec(op(), 1..200),
        image in any::<bool>(),
    ) {
        let (a, ids, tier) = tiered_store(shared(256 << 10), &ops);
        let (b, next) = hand_tiered(&a, image);
        // The removals queued before the hand-over were sent first.
        prop_assert_eq!(next.keys().len(), tier.keys().len());
        prop_assert_eq!(a.stats().pools[0].tier_pages, b.stats().pools[0].tier_pages);
        same_pages(&a, &b, &ids);
        // The oracle: a map of what each pool holds, from the handed pages
        // on. (A second successor of `a` would seal under its key too.)
        let mut model = std::collections::HashMap::new();
        let mut out = [0u8; PAGE_SIZE];
        for (p, &id) in ids.iter().enumerate() {
            for index in 0..400 {
                if b.pool(id).unwrap().get(Key::new(1, index), &mut out).unwrap() == GetOutcome::Hit {
                    model.insert((p, index), out);
                }
            }
        }
        for (i, op) in more.iter().enumerate() {
            if let Op::Put { pool, index, kind, seed } = *op {
                let data = page(kind, seed);
                let put = b.pool(ids[pool % 2]).unwrap().put(Key::new(1, index), &data).unwrap();
                if put == tmem_core::PutOutcome::Stored {
                    model.insert((pool % 2, index), data);
                } else if pool % 2 == 1 {
                    model.remove(&(1, index));
                }
            }
            if i % 5 == 4 {
                let _ = b.pool(ids[0]).unwrap().write_back(8);
            }
        }
        for (p, &id) in ids.iter().enumerate() {
            for index in 0..400 {
                let got = b.pool(id).unwrap().get(Key::new(1, index), &mut out).unwrap();
                match model.get(&(p, index)) {
                    // The ephemeral pool may have dropped it.
                    Some(want) => prop_assert!(
                        (got == GetOutcome::Hit && out == *want) || (p == 1 && got != GetOutcome::Hit),
                        "pool {} page {}: {:?}", id, index, got
                    ),
                    None => prop_assert!(got != GetOutcome::Hit, "pool {} page {}: a page never put", id, index),
                }
            }
        }
        let (d, _) = hand_tiered(&b, image);
        same_pages(&b, &d, &ids);
    }
}

#[test]
fn tiered_pools_need_their_tiers() {
    let ops: Vec<Op> = (0..200).map(|i| Op::Put { pool: 0, index: i, kind: 0, seed: i }).collect();
    let (a, _, _) = tiered_store(config(128 << 10), &ops);
    let mut stream = Vec::new();
    a.export(&mut stream).unwrap();
    let e = Store::import(config(0), &mut stream.as_slice()).unwrap_err().to_string();
    assert!(e.contains("has tiers below it, and this import was given none"), "{e}");
    let mut none = |_: u32, _: usize| Ok(Vec::new());
    let e = Store::import_tiered(config(0), &mut stream.as_slice(), None, &mut none).unwrap_err().to_string();
    assert!(e.contains("0 tiers given for 1"), "{e}");
}

#[test]
fn an_adopted_pool_grows_past_the_chunks_it_was_handed() {
    let a = shared(0).build().unwrap();
    let p = a.create_pool(PoolConfig::persistent());
    for i in 0..200 {
        assert_eq!(p.put(Key::new(1, i), &page(0, i)).unwrap(), tmem_core::PutOutcome::Stored);
    }
    let (b, _, _) = hand_image(&a, shared(0));
    drop(a);
    b.seal(false);
    let q = b.pool(p.id()).unwrap();
    // Text pages: some 40 MiB of objects, many new 4 MiB chunks.
    for i in 200..40_000 {
        assert_eq!(q.put(Key::new(1, i), &page(0, i)).unwrap(), tmem_core::PutOutcome::Stored, "page {i}");
    }
    let mut out = [0u8; PAGE_SIZE];
    for i in 0..40_000 {
        assert_eq!(q.get(Key::new(1, i), &mut out).unwrap(), tmem_core::GetOutcome::Hit, "page {i}");
        assert_eq!(out, page(0, i), "page {i}");
    }
}

#[test]
fn a_tier_below_two_pools_is_not_handed_over() {
    let store = config(0).build().unwrap();
    let tier: Arc<dyn Tier> = Arc::new(MemTier::new(1 << 20));
    let sealer = Arc::new(Sealer::random().unwrap());
    for _ in 0..2 {
        let chain = TierChain::new(vec![tier.clone()], sealer.clone()).unwrap();
        store.create_pool_with_tiers(PoolConfig::persistent(), chain);
    }
    let e = store.hold_tiers().hand_over().unwrap_err().to_string();
    assert!(e.contains("tier mem is below two pools"), "{e}");
}
