//! Pre-copy hand-over (`Store::track_changes`, `Store::export_snapshot`,
//! `Snapshot::read`, `Store::import_image_after`): the store a successor
//! completes from a snapshot taken while the exporter served, and the
//! image of what changed since, holds every page and counter the exporter
//! holds, whatever ran meanwhile (puts, flushes, grouping, compaction,
//! recompression, writeback to a tier, a new codec, new pools).

// Test data: byte extraction from u64s.
#![allow(clippy::cast_possible_truncation)]

use proptest::prelude::*;
use std::io::Write;
use std::sync::Arc;
use tmem_core::codec::CodecConfig;
use tmem_core::{
    GroupConfig, Key, PolicyConfig, Pool, PoolConfig, PoolStats, RecompressConfig, Snapshot, Store, StoreConfig,
    TierChain, PAGE_SIZE,
};
use tmem_tier::seal::Sealer;
use tmem_tier::{MemTier, Tier};

mod mixed;
use mixed::page;

use mixed::Op;

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        13 => mixed::page_op(600, [8, 2, 3]),
        1 => Just(Op::Group),
        1 => Just(Op::Compact),
        1 => Just(Op::Recompress),
        1 => Just(Op::WriteBack),
        1 => Just(Op::Zstd),
        1 => Just(Op::NewPool),
    ]
}

fn config(grouped: bool) -> StoreConfig {
    StoreConfig {
        shared_memory: true,
        shards: 4,
        group: grouped.then(|| GroupConfig { dictionary: false, level: 3, ..Default::default() }),
        policy: PolicyConfig { max_pool_bytes: 0, ..Default::default() },
        ..Default::default()
    }
}

/// A store with a tiered persistent pool, a persistent and an ephemeral
/// pool, and what runs operations on it.
struct Exporter {
    store: Store,
    pools: std::cell::RefCell<Vec<Arc<Pool>>>,
    tier: Arc<MemTier>,
    grouped: bool,
    /// Made once: each one registers its codec.
    recompression: std::cell::RefCell<Option<tmem_core::Recompression>>,
    /// Registered once: each registration takes an id.
    zstd: std::cell::Cell<Option<u8>>,
}

impl Exporter {
    fn new(grouped: bool) -> Self {
        let store = config(grouped).build().unwrap();
        let tier = Arc::new(MemTier::new(64 << 20));
        let chain = TierChain::new(vec![tier.clone() as Arc<dyn Tier>], Arc::new(Sealer::random().unwrap())).unwrap();
        let pools = vec![
            store.create_pool_with_tiers(PoolConfig::persistent().reject_keeps_old(true), chain),
            store.create_pool(PoolConfig::persistent()),
            store.create_pool(PoolConfig::ephemeral()),
        ];
        Exporter { store, pools: pools.into(), tier, grouped, recompression: None.into(), zstd: None.into() }
    }

    fn pool(&self, i: usize) -> Arc<Pool> {
        let pools = self.pools.borrow();
        Arc::clone(&pools[i % pools.len()])
    }

    fn run(&self, op: &Op) {
        let mut out = [0u8; PAGE_SIZE];
        match *op {
            Op::Put { pool, index, kind, seed } => {
                let _ = self.pool(pool).put(Key::new(1, index), &page(kind, seed)).unwrap();
            }
            Op::Get { pool, index } => {
                let _ = self.pool(pool).get(Key::new(1, index), &mut out).unwrap();
            }
            Op::Flush { pool, index } => {
                let _ = self.pool(pool).flush_page(Key::new(1, index)).unwrap();
            }
            Op::Group if self.grouped => self.store.grouping().unwrap().group_now(),
            Op::Group => {}
            Op::Compact => {
                self.store.compact();
            }
            Op::Recompress => {
                let mut r = self.recompression.borrow_mut();
                let r = r.get_or_insert_with(|| {
                    self.store.recompression(RecompressConfig::parse("zstd:5").unwrap()).unwrap()
                });
                // A page is taken on the second pass that finds it unread.
                r.pass();
                r.pass();
            }
            Op::WriteBack => {
                let _ = self.pool(0).write_back(16);
            }
            Op::Zstd => match self.zstd.get() {
                Some(id) => self.store.set_codec(id).unwrap(),
                None => self
                    .zstd
                    .set(Some(self.store.use_codec(&CodecConfig::Zstd { level: 1, dictionary: None }).unwrap())),
            },
            Op::NewPool if self.pools.borrow().len() < 6 => {
                let p = self.store.create_pool(PoolConfig::persistent());
                for i in 0..20 {
                    let _ = p.put(Key::new(1, i), &page(0, i)).unwrap();
                }
                self.pools.borrow_mut().push(p);
            }
            Op::NewPool => {}
        }
    }
}

/// A writer that runs the next operation each time `every` more bytes
/// went through it: the exporter changes while its snapshot is written.
struct Meddling<'a> {
    out: Vec<u8>,
    every: usize,
    since: usize,
    ex: &'a Exporter,
    ops: std::slice::Iter<'a, Op>,
}

impl Write for Meddling<'_> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.out.extend_from_slice(b);
        self.since += b.len();
        while self.since >= self.every {
            self.since -= self.every;
            if let Some(op) = self.ops.next() {
                self.ex.run(op);
            }
        }
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The counters a successor carries on with (as the image test says), but
/// for the block cache's hits and misses: each process has a cache of its
/// own, and the successor's starts empty.
fn carried(s: &PoolStats) -> PoolStats {
    PoolStats { compr_data_size: 0, group_cache_hits: 0, group_cache_misses: 0, ..s.clone() }
}

/// Hands `ex` over by pre-copy: tracks, writes the snapshot while
/// `during` runs, runs `after`, then [`complete`]s.
fn hand_over(ex: &Exporter, during: &[Op], after: &[Op], every: usize) -> Store {
    ex.store.track_changes(true);
    let mut w = Meddling { out: Vec::new(), every, since: 0, ex, ops: during.iter() };
    ex.store.export_snapshot(&mut w).unwrap();
    let rest: Vec<Op> = w.ops.cloned().collect();
    let snap_bytes = w.out;
    for op in rest.iter().chain(after) {
        ex.run(op);
    }
    let snapshot = Snapshot::read(&mut snap_bytes.as_slice()).unwrap();
    assert_eq!(snapshot.unusable_with(&config(ex.grouped)), None);
    complete(ex, Some(snapshot)).0
}

/// Holds writeback, seals, writes the image and imports it (with the
/// snapshot, if any) beside the tier's state, as the daemon does; returns
/// the successor and the image's length.
fn complete(ex: &Exporter, snapshot: Option<Snapshot>) -> (Store, usize) {
    let hold = ex.store.hold_tiers();
    let mut states = hold.hand_over().unwrap();
    let (tiered, mut handed) = states.pop().unwrap();
    let next = Arc::new(MemTier::adopt(&handed.pop().unwrap()).unwrap());
    ex.store.seal(true);
    let mut image = Vec::new();
    ex.store.export_image(&mut image).unwrap();
    let fd = ex.store.memfd().unwrap().try_clone_to_owned().unwrap();
    let mut tiers = |id: u32, n: usize| {
        assert_eq!((id, n), (tiered, 1));
        Ok(vec![next.clone() as Arc<dyn Tier>])
    };
    let cfg = config(ex.grouped);
    let (b, _) = match snapshot {
        Some(snap) => Store::import_image_after(cfg, &mut image.as_slice(), fd, &mut tiers, snap),
        None => Store::import_tiered(cfg, &mut image.as_slice(), Some(fd), &mut tiers),
    }
    .unwrap();
    drop(hold);
    (b, image.len())
}

/// Every page of `a`'s pools is in `b`, byte for byte, and nothing else,
/// with the counters a successor carries.
fn same_pages(a: &Store, b: &Store) {
    assert_eq!(a.pool_ids(), b.pool_ids());
    for id in a.pool_ids() {
        mixed::same_pages_of(a, b, id, 600);
        assert_eq!(carried(&a.pool(id).unwrap().stats()), carried(&b.pool(id).unwrap().stats()), "pool {id}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn a_snapshot_and_its_changes_make_the_same_store(
        before in prop::collection::vec(op(), 1..400),
        during in prop::collection::vec(op(), 0..200),
        after in prop::collection::vec(op(), 0..200),
        more in prop::collection::vec(op(), 0..200),
        grouped in any::<bool>(),
        every in 64usize..4096,
    ) {
        let ex = Exporter::new(grouped);
        for op in &before {
            ex.run(op);
        }
        let b = hand_over(&ex, &during, &after, every);
        if grouped {
            b.check_groups();
        }
        let (sa, sb) = (ex.store.stats(), b.stats());
        prop_assert_eq!(sa.alloc.span_bytes, sb.alloc.span_bytes, "the memory is counted once, alike");
        prop_assert_eq!(sa.alloc.objects, sb.alloc.objects);
        // The sealed exporter (writeback held) is the oracle.
        same_pages(&ex.store, &b);
        // The successor serves on with its predecessor's handles and ids
        // (its free lists rebuilt), and hands over by pre-copy again.
        b.seal(false);
        let pools: Vec<_> = b.pool_ids().iter().map(|&id| b.pool(id).unwrap()).collect();
        let tier = Arc::clone(&ex.tier);
        let next = Exporter { store: b, pools: pools.into(), tier, grouped, recompression: None.into(), zstd: None.into() };
        for op in &more {
            next.run(op);
        }
        let c = hand_over(&next, &more, &before, every);
        same_pages(&next.store, &c);
    }
}

#[test]
fn a_quiet_store_sends_few_changes_and_a_failed_one_stops_recording() {
    let ex = Exporter::new(true);
    for i in 0..3000 {
        ex.run(&Op::Put { pool: (i % 3) as usize, index: i / 3 % 600, kind: (i / 7 % 3) as u8, seed: i });
    }
    ex.run(&Op::Group);
    ex.store.track_changes(true);
    let mut snap = Vec::new();
    assert!(ex.store.export_snapshot(&mut snap).unwrap().pages > 1000);
    let snapshot = Snapshot::read(&mut snap.as_slice()).unwrap();
    let (b, quiet) = complete(&ex, Some(snapshot));
    same_pages(&ex.store, &b);
    // A hand-over that failed: recording stops, and the next image names
    // every page again.
    ex.store.track_changes(false);
    let (c, whole) = complete(&ex, None);
    same_pages(&ex.store, &c);
    assert!(quiet * 4 < whole, "changes {quiet} bytes, whole image {whole}");
    // A snapshot needs recording: without it the export is refused.
    let e = ex.store.export_snapshot(&mut Vec::new()).unwrap_err().to_string();
    assert!(e.contains("not recorded"), "{e}");
}

#[test]
fn a_damaged_snapshot_is_one_error() {
    let ex = Exporter::new(false);
    for i in 0..500 {
        ex.run(&Op::Put { pool: (i % 3) as usize, index: i, kind: (i % 3) as u8, seed: i });
    }
    ex.store.track_changes(true);
    let mut snap = Vec::new();
    ex.store.export_snapshot(&mut snap).unwrap();
    for at in [0, 9, 20, snap.len() / 2, snap.len() - 5] {
        let mut bad = snap.clone();
        bad[at] ^= 0x40;
        assert!(Snapshot::read(&mut bad.as_slice()).is_err(), "a flipped byte at {at} passed");
    }
    for len in [0, 7, 30, snap.len() / 3, snap.len() - 1] {
        assert!(Snapshot::read(&mut &snap[..len]).is_err(), "a snapshot cut at {len} passed");
    }
    let other = StoreConfig { shards: 8, ..config(false) };
    let ok = Snapshot::read(&mut snap.as_slice()).unwrap();
    assert!(ok.unusable_with(&other).unwrap().contains("shards"));
    assert!(ok.unusable_with(&config(true)).unwrap().contains("groups"));
}
