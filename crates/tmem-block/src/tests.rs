// Test code indexes byte arrays with device offsets; the tests run on 64-bit targets.
#![allow(clippy::cast_possible_truncation)]

use proptest::prelude::*;
use tmem_core::{PolicyConfig, StoreConfig};

use super::*;
use crate::conformance::{check_ops, pattern, Op};
use rand_xoshiro::rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;

const SIZE: u64 = 1 << 20;

fn device(policy: PolicyConfig) -> PoolDevice {
    DeviceConfig {
        name: "t0".into(),
        size: SIZE,
        store: StoreConfig { policy, ..Default::default() },
        tiers: None,
        recompress: None,
    }
    .build()
    .unwrap()
}

fn op() -> impl Strategy<Value = Op> {
    let off = 0..SIZE - 20_000;
    prop_oneof![
        4 => (off.clone(), 1usize..20_000, any::<u64>()).prop_map(|(offset, len, seed)| Op::Write { offset, len, seed }),
        4 => (off.clone(), 1usize..20_000).prop_map(|(offset, len)| Op::Read { offset, len }),
        1 => (off.clone(), 1u64..20_000).prop_map(|(offset, len)| Op::Trim { offset, len }),
        1 => (off, 1u64..20_000).prop_map(|(offset, len)| Op::Zero { offset, len }),
    ]
}

/// A device whose 64 KiB pool writes back to a memory tier at once, so most
/// pages are read from the tier, many of them in multi-page batches.
fn tiered_device() -> PoolDevice {
    let tier: Arc<dyn tmem_tier::Tier> = Arc::new(tmem_tier::MemTier::new(1 << 30));
    let chain = TierChain::new(vec![tier], Arc::new(tmem_tier::seal::Sealer::random().unwrap())).unwrap();
    let policy = PolicyConfig { max_pool_bytes: 64 << 10, ..Default::default() };
    DeviceConfig {
        name: "t1".into(),
        size: SIZE,
        store: StoreConfig { policy, ..Default::default() },
        tiers: Some(chain),
        recompress: None,
    }
    .build()
    .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn pool_device_matches_byte_array(ops in prop::collection::vec(op(), 1..40)) {
        check_ops(&device(PolicyConfig::default()), &ops);
    }

    #[test]
    fn ram_device_matches_byte_array(ops in prop::collection::vec(op(), 1..40)) {
        check_ops(&RamDevice::new(SIZE), &ops);
    }

    #[test]
    fn tiered_pool_device_matches_byte_array(ops in prop::collection::vec(op(), 1..40)) {
        check_ops(&tiered_device(), &ops);
    }
}

#[test]
fn every_storing_device_passes_the_conformance_suite() {
    conformance::check(&device(PolicyConfig::default()));
    conformance::check(&RamDevice::new(SIZE));
    conformance::check(&tiered_device());
}

#[test]
fn multi_page_reads_fetch_tier_pages_in_batches() {
    let dev = tiered_device();
    // Half noise, half zeros per page: about 2 KiB compressed, 512 KiB in all.
    let data: Vec<u8> =
        (0..SIZE).map(|i| if i % 4096 < 2048 { (i.wrapping_mul(2_654_435_761) >> 13) as u8 } else { 0 }).collect();
    dev.write_at(&data, 0).unwrap();
    let st = dev.stats().store.total;
    assert!(st.tier_pages > 200, "most pages are in the tier: {st:?}");
    // Unaligned, so the batch sits between a partial first and last page.
    let mut back = vec![0u8; data.len() - 8192];
    dev.read_at(&mut back, 4000).unwrap();
    assert!(back == data[4000..4000 + back.len()], "contents differ");
    assert!(dev.stats().store.total.tier_gets >= 200);
}

#[test]
fn zero_device_reads_zeros_and_checks_ranges() {
    let d = ZeroDevice::new(SIZE);
    d.write_at(&[1, 2, 3], 10).unwrap();
    let mut b = [9u8; 3];
    d.read_at(&mut b, 10).unwrap();
    assert_eq!(b, [0, 0, 0]);
    assert!(matches!(d.read_at(&mut b, SIZE - 1), Err(BlockError::OutOfRange { .. })));
    assert_eq!(d.extents(0, SIZE).unwrap(), vec![Extent { len: SIZE, hole: true }]);
}

#[test]
fn unwritten_is_hole_trim_frees_and_ranges_are_checked() {
    let d = device(PolicyConfig::default());
    assert_eq!(d.extents(0, SIZE).unwrap(), vec![Extent { len: SIZE, hole: true }]);
    d.write_at(&pattern(3 * PAGE_SIZE, 1), PAGE).unwrap();
    assert_eq!(
        d.extents(0, 5 * PAGE).unwrap(),
        vec![Extent { len: PAGE, hole: true }, Extent { len: 3 * PAGE, hole: false }, Extent { len: PAGE, hole: true }]
    );
    d.trim(PAGE, 3 * PAGE).unwrap();
    assert_eq!(d.store().stats().total.stored_pages, 0);
    assert!(matches!(d.write_at(&[1], SIZE), Err(BlockError::OutOfRange { .. })));
    assert!(matches!(d.trim(u64::MAX, 2), Err(BlockError::OutOfRange { .. })));
    let s = d.stats();
    assert_eq!((s.invalid_io, s.discard_ios, s.write_ios), (2, 1, 1));
}

#[test]
fn drop_stale_frees_every_page_but_the_header_unless_a_write_came_in() {
    for d in [device(PolicyConfig::default()), tiered_device()] {
        d.write_at(&pattern(64 * PAGE_SIZE, 7), 0).unwrap();
        let before = d.writes();
        // A write after the count was read: the sweep must keep everything.
        d.write_at(&pattern(PAGE_SIZE, 8), 100 * PAGE).unwrap();
        assert_eq!(d.drop_stale(before), StaleSweep::Interrupted);
        let mut back = vec![0u8; PAGE_SIZE];
        d.read_at(&mut back, 100 * PAGE).unwrap();
        assert_eq!(back, pattern(PAGE_SIZE, 8));
        // No write since: every page but page 0 (a swap header) goes, in
        // the pool and in the tier.
        assert_eq!(d.drop_stale(d.writes()), StaleSweep::Done { dropped: 64, kept: 0 });
        let total = d.store().stats().total;
        assert_eq!(total.stored_pages, 1, "{total:?}");
        d.read_at(&mut back, 0).unwrap();
        assert_eq!(back, pattern(64 * PAGE_SIZE, 7)[..PAGE_SIZE]);
        d.read_at(&mut back, 3 * PAGE).unwrap();
        assert!(back.iter().all(|b| *b == 0));
        let s = d.stats();
        assert_eq!((s.stale_pages_dropped, s.stale_sweeps_interrupted, s.stale_pages_kept), (64, 1, 0));
    }
}

#[test]
fn keep_only_marked_keeps_the_pages_read_while_it_marks_and_drops_the_rest() {
    for d in [device(PolicyConfig::default()), tiered_device()] {
        d.write_at(&pattern(64 * PAGE_SIZE, 7), 0).unwrap();
        let mut back = vec![0u8; 2 * PAGE_SIZE];
        // A mark that fails drops nothing.
        assert_eq!(d.keep_only_marked(&mut || None), StaleSweep::Interrupted);
        // Nor does a mark that reached fewer pages than the caller knows are live.
        assert_eq!(d.keep_only_marked(&mut || Some(1)), StaleSweep::Interrupted);
        assert_eq!(d.store().stats().total.stored_pages, 64);
        // Pages 10 and 11 read in one request, page 20 written: they stay.
        let mut mark = || {
            d.read_at(&mut back, 10 * PAGE).unwrap();
            d.write_at(&pattern(PAGE_SIZE, 20), 20 * PAGE).unwrap();
            Some(3)
        };
        // 64 stored; kept: 10, 11 and 20 (page 0 too is dropped: no header below zram).
        assert_eq!(d.keep_only_marked(&mut mark), StaleSweep::Done { dropped: 61, kept: 3 });
        assert_eq!(d.store().stats().total.stored_pages, 3);
        let mut one = vec![0u8; PAGE_SIZE];
        d.read_at(&mut one, 11 * PAGE).unwrap();
        assert_eq!(one, pattern(64 * PAGE_SIZE, 7)[11 * PAGE_SIZE..12 * PAGE_SIZE]);
        d.read_at(&mut one, 20 * PAGE).unwrap();
        assert_eq!(one, pattern(PAGE_SIZE, 20));
        d.read_at(&mut one, 0).unwrap();
        assert!(one.iter().all(|b| *b == 0));
        // Outside a mark, reads mark nothing: the next sweep starts clean.
        assert_eq!(d.keep_only_marked(&mut || Some(0)), StaleSweep::Done { dropped: 3, kept: 0 });
        let s = d.stats();
        assert_eq!((s.stale_pages_dropped, s.stale_sweeps_interrupted), (64, 2));
    }
}

/// A write that comes in while a sweep runs keeps its page, whether the
/// sweep has passed the page already or not, and the sweep goes on.
#[test]
fn drop_stale_keeps_pages_written_during_the_sweep() {
    let d = device(PolicyConfig::default());
    d.write_at(&pattern(64 * PAGE_SIZE, 7), 0).unwrap();
    let before = d.writes();
    // The sweep stops at page 5's stripe until it is let go.
    let held = d.stripe(5);
    std::thread::scope(|s| {
        let sweep = s.spawn(|| d.drop_stale(before));
        while !d.written.active() {
            std::thread::yield_now();
        }
        // Page 3 (swept already: it was dropped) and page 40 (not yet).
        s.spawn(|| {
            d.write_at(&pattern(PAGE_SIZE, 3), 3 * PAGE).unwrap();
            d.write_at(&pattern(PAGE_SIZE, 40), 40 * PAGE).unwrap();
        })
        .join()
        .unwrap();
        drop(held);
        assert_eq!(sweep.join().unwrap(), StaleSweep::Done { dropped: 62, kept: 1 });
    });
    let mut back = vec![0u8; PAGE_SIZE];
    for (page, seed) in [(3, 3), (40, 40)] {
        d.read_at(&mut back, page * PAGE).unwrap();
        assert_eq!(back, pattern(PAGE_SIZE, seed), "page {page}");
    }
    assert_eq!(d.store().stats().total.stored_pages, 3, "the header and the two written pages");
    assert_eq!(d.stats().stale_pages_kept, 1);
}

#[test]
fn refused_write_is_enospc_and_keeps_old_contents() {
    // Incompressible pages and the zswap default policy: the pool refuses them.
    let d = device(PolicyConfig::default());
    let old = pattern(PAGE_SIZE, 5);
    d.write_at(&old, 0).unwrap();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(0x1234_5678_9abc_def1);
    let mut noise = vec![0u8; 100];
    rng.fill_bytes(&mut noise);
    // A partial write that leaves the page compressible succeeds...
    d.write_at(&noise, 0).unwrap();
    // ...a whole random page does not, and the previous page survives.
    let mut page = vec![0u8; PAGE_SIZE];
    rng.fill_bytes(&mut page);
    let err = d.write_at(&page, 0).unwrap_err();
    assert_eq!(err.errno(), libc::ENOSPC);
    let mut back = vec![0u8; PAGE_SIZE];
    d.read_at(&mut back, 0).unwrap();
    assert_eq!(&back[..100], &noise[..]);
    assert_eq!(&back[100..], &old[100..]);
    assert_eq!(d.stats().failed_writes, 1);
}

#[test]
fn ram_device_holds_memory_only_for_written_pages() {
    let dev = RamDevice::new(SIZE + 100);
    assert_eq!(dev.size(), SIZE, "rounded down to whole pages");
    dev.write_at(&[7; 10], 4096 * 3 + 5).unwrap();
    assert_eq!(dev.held_pages(), 1);
    // A partial zeroing keeps the page; a whole-page trim frees it.
    dev.write_zeroes(4096 * 3, 100).unwrap();
    assert_eq!(dev.held_pages(), 1);
    dev.trim(4096 * 3, 4096).unwrap();
    assert_eq!(dev.held_pages(), 0);
    assert!(matches!(dev.write_at(&[1; 2], SIZE - 1), Err(BlockError::OutOfRange { .. })));
    assert_eq!(dev.extents(0, SIZE).unwrap(), vec![Extent { len: SIZE, hole: true }]);
}

/// A device whose store groups cold pages (16 pages: 64 KiB of adjacent offsets).
fn grouping_device() -> PoolDevice {
    let group = tmem_core::GroupConfig { dictionary: false, level: 3, ..Default::default() };
    DeviceConfig {
        name: "g0".into(),
        size: SIZE,
        store: StoreConfig { group: Some(group), ..Default::default() },
        tiers: None,
        recompress: None,
    }
    .build()
    .unwrap()
}

/// A [`PoolDevice`] that groups every page it may before each request, so
/// every read, partial write, trim and zeroing meets grouped pages.
struct GroupingEveryOp {
    dev: PoolDevice,
    grouping: std::sync::Mutex<tmem_core::Grouping>,
}

impl GroupingEveryOp {
    fn new() -> Self {
        let dev = grouping_device();
        let grouping = std::sync::Mutex::new(dev.store().grouping().unwrap());
        Self { dev, grouping }
    }

    fn group(&self) {
        self.grouping.lock().unwrap().group_now();
        self.dev.store().check_groups();
    }
}

impl BlockDevice for GroupingEveryOp {
    fn size(&self) -> u64 {
        self.dev.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        self.group();
        self.dev.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        self.group();
        self.dev.write_at(buf, offset)
    }
    fn flush(&self) -> Result<(), BlockError> {
        self.dev.flush()
    }
    fn trim(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        self.group();
        self.dev.trim(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        self.group();
        self.dev.write_zeroes(offset, len)
    }
    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>, BlockError> {
        self.dev.extents(offset, len)
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]
    #[test]
    fn grouping_pool_device_matches_byte_array(ops in prop::collection::vec(op(), 1..40)) {
        check_ops(&GroupingEveryOp::new(), &ops);
    }
}

#[test]
fn a_grouping_device_passes_the_conformance_suite() {
    let dev = GroupingEveryOp::new();
    conformance::check(&dev);
    assert!(dev.dev.stats().store.total.pages_grouped > 0);
}

#[test]
fn trims_across_groups_leave_tombstones_rewrites_and_nothing_at_the_end() {
    let dev = grouping_device();
    let data = pattern(SIZE as usize, 5);
    dev.write_at(&data, 0).unwrap();
    dev.store().grouping().unwrap().group_now();
    let st = dev.stats().store;
    assert_eq!((st.total.group_pages, st.total.groups), (256, 16));
    // A trim from the middle of page 20 to the middle of page 41: pages
    // 21..=40 go (11 of group 1's pages 16..=31, 9 of group 2's), and 20
    // and 41 are written back partly zeroed as single pages: a tombstone
    // more in each group.
    let (from, to) = (20 * PAGE + 100, 41 * PAGE + 300);
    dev.trim(from, to - from).unwrap();
    let t = dev.stats().store.total;
    assert_eq!((t.groups, t.group_dead_pages, t.group_pages), (16, 12 + 10, 256 - 22), "{t:?}");
    let mut expect = data.clone();
    expect[from as usize..to as usize].fill(0);
    let mut got = vec![0u8; SIZE as usize];
    dev.read_at(&mut got, 0).unwrap();
    assert!(got == expect);
    let ext = dev.extents(0, SIZE).unwrap();
    assert_eq!(ext.iter().filter(|e| e.hole).map(|e| e.len).sum::<u64>(), 20 * PAGE);
    // Groups 1 and 2 are down to 4 and 6 live pages: the next pass rewrites them.
    dev.store().grouping().unwrap().pass();
    let t = dev.stats().store.total;
    assert_eq!((t.group_rewrites, t.group_dead_pages), (2, 0), "{t:?}");
    dev.read_at(&mut got, 0).unwrap();
    assert!(got == expect);
    dev.trim(0, SIZE).unwrap();
    let st = dev.stats().store;
    assert_eq!((st.total.stored_pages, st.total.groups, st.alloc.objects, st.mem_used_total), (0, 0, 0, 0));
}

/// A restart's successor counts on from its predecessor's I/O counters; its
/// size and its store's counters are its own.
#[test]
fn a_successor_counts_on_from_the_carried_counters() {
    let before = device(PolicyConfig::default());
    let page = [7u8; PAGE as usize];
    let mut out = [0u8; PAGE as usize];
    before.write_at(&page, 0).unwrap();
    before.read_at(&mut out, 0).unwrap();
    assert!(before.read_at(&mut out, SIZE).is_err(), "outside the device");
    let carried = before.stats();
    assert_eq!((carried.read_ios, carried.write_ios, carried.invalid_io), (1, 1, 1));

    let after = device(PolicyConfig::default());
    after.carry_on(&carried);
    after.carry_on(&carried); // only the first call counts
    after.read_at(&mut out, 0).unwrap();
    let s = after.stats();
    assert_eq!((s.read_ios, s.write_ios, s.invalid_io), (2, 1, 1));
    assert_eq!(s.read_bytes, carried.read_bytes + PAGE);
    assert_eq!(s.disksize, SIZE, "a gauge is not added");
    assert_eq!(s.store.total.stored_pages, 0, "the store's counters are its own");
}
