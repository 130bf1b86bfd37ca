//! Background recompression: cold pages move to the denser codec, hot ones
//! stay, counters add up, and no page is lost or changed while puts, gets,
//! flushes, compaction and writeback race the recompression passes.

use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use rand_xoshiro::rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use tmem_core::{
    DictTraining, PolicyConfig, PoolConfig, PutOutcome, RecompressConfig, Store, StoreConfig, MAX_STRIDE, PAGE_SIZE,
};

mod common;
use common::{fill_writers, key, race_op, race_pool, race_writers, read, text_page as page, RaceOp};

fn zstd3() -> RecompressConfig {
    RecompressConfig::parse("zstd:3").unwrap()
}

fn codec_pages(store: &Store, name: &str) -> u64 {
    store.codec_usage().iter().find(|c| c.codec == name).map_or(0, |c| c.pages)
}

#[test]
fn cold_pages_move_to_the_denser_codec_and_hot_pages_stay() {
    let store = StoreConfig::default().build().unwrap();
    let pool = store.create_pool(PoolConfig::persistent());
    for i in 0..1000 {
        assert_eq!(pool.put(key(i), &page(i)).unwrap(), PutOutcome::Stored);
    }
    let before = store.stats().total.compr_data_size;
    let mut rec = store.recompression(zstd3()).unwrap();
    rec.pass(); // registers zstd-3 and marks every page seen
    assert_eq!(codec_pages(&store, "lz4"), 1000);
    for i in 0..100 {
        assert_eq!(read(&pool, i), Some(page(i)));
    }
    rec.pass(); // the 900 unread pages move; the 100 read ones stay
    assert_eq!(codec_pages(&store, "lz4"), 100);
    assert_eq!(codec_pages(&store, "zstd-3"), 900);
    let st = store.stats();
    assert_eq!(st.total.recompressed_pages, 900);
    assert_eq!(st.total.recompress_raced, 0);
    assert_eq!(st.recompression.as_deref(), Some("zstd-3"));
    assert_eq!(before - st.total.compr_data_size, st.total.recompress_saved_bytes);
    assert!(st.total.compr_data_size * 10 < before * 9, "{} -> {}", before, st.total.compr_data_size);
    let usage: u64 = st.codecs.iter().map(|c| c.bytes).sum();
    assert_eq!(usage, st.total.compr_data_size);
    // The read pages were aged by that pass; two more unread passes take them.
    rec.pass();
    rec.pass();
    assert_eq!(codec_pages(&store, "lz4"), 0);
    for i in 0..1000 {
        assert_eq!(read(&pool, i), Some(page(i)), "page {i}");
    }
    // A replaced page starts over in the fast codec.
    assert_eq!(pool.put(key(5), &page(5000)).unwrap(), PutOutcome::Stored);
    assert_eq!(codec_pages(&store, "lz4"), 1);
    assert_eq!(read(&pool, 5), Some(page(5000)));
}

#[test]
fn recompression_backs_off_while_its_pages_are_read_back() {
    let store = StoreConfig::default().build().unwrap();
    let pool = store.create_pool(PoolConfig::persistent());
    for i in 0..1000 {
        assert_eq!(pool.put(key(i), &page(i)).unwrap(), PutOutcome::Stored);
    }
    let mut rec = store.recompression(zstd3()).unwrap();
    rec.tick(); // marks every page seen
    rec.tick(); // recompresses them: nothing read back, no back-off
    assert_eq!(codec_pages(&store, "zstd-3"), 1000);
    assert_eq!(rec.stride(), 1);
    // A hot job reads every page back every period: passes spread out.
    let mut strides = Vec::new();
    for _ in 0..40 {
        for i in 0..1000 {
            assert_eq!(read(&pool, i), Some(page(i)));
        }
        rec.tick();
        strides.push(rec.stride());
    }
    assert_eq!(strides.last(), Some(&MAX_STRIDE), "{strides:?}");
    assert!(strides.windows(2).all(|w| w[1] >= w[0]), "{strides:?}");
    let status = store.stats().recompression.unwrap();
    assert!(status.starts_with("zstd-3; backing off, a pass every 32 periods"), "{status}");
    // Cold pages again: they are recompressed, and passes come closer.
    for i in 1000..3000 {
        assert_eq!(pool.put(key(i), &page(i)).unwrap(), PutOutcome::Stored);
    }
    for _ in 0..200 {
        rec.tick();
    }
    assert!(rec.stride() < MAX_STRIDE, "stride {}", rec.stride());
    assert_eq!(codec_pages(&store, "lz4"), 0);
    assert_eq!(codec_pages(&store, "zstd-3"), 3000);
    for i in 0..3000 {
        assert_eq!(read(&pool, i), Some(page(i)), "page {i}");
    }
}

#[test]
fn pages_that_do_not_shrink_are_kept_and_not_tried_again() {
    let store = StoreConfig::default().build().unwrap();
    let pool = store.create_pool(PoolConfig::persistent());
    for i in 0..200 {
        assert_eq!(pool.put(key(i), &page(i)).unwrap(), PutOutcome::Stored);
    }
    // lz4 again: never an eighth smaller than lz4.
    let mut rec = store.recompression(RecompressConfig::parse("lz4").unwrap()).unwrap();
    for _ in 0..3 {
        rec.pass();
    }
    let st = store.stats();
    assert_eq!((st.total.recompressed_pages, st.total.recompress_kept), (0, 200));
    rec.pass();
    assert_eq!(store.stats().total.recompress_kept, 200, "kept pages are not tried again");
}

#[test]
fn dictionary_is_trained_before_recompression_starts() {
    let store = StoreConfig::default().build().unwrap();
    let pool = store.create_pool(PoolConfig::persistent());
    let mut cfg = RecompressConfig::parse("zstd:3+dict").unwrap();
    cfg.dictionary =
        Some(DictTraining { after_bytes: 512 << 10, sample_pages: 256, dict_bytes: 16 << 10, max_dictionaries: 1 });
    let mut rec = store.recompression(cfg).unwrap();
    assert_eq!(pool.put(key(0), &page(0)).unwrap(), PutOutcome::Stored);
    rec.pass();
    assert!(store.stats().recompression.unwrap().contains("waiting"), "{:?}", store.stats().recompression);
    for i in 1..1000 {
        assert_eq!(pool.put(key(i), &page(i)).unwrap(), PutOutcome::Stored);
    }
    rec.pass();
    rec.pass();
    assert_eq!(store.stats().recompression.as_deref(), Some("zstd-3+dict"));
    assert!(codec_pages(&store, "zstd-3+dict") > 900);
    for i in 0..1000 {
        assert_eq!(read(&pool, i), Some(page(i)));
    }
}

#[test]
fn failed_dictionary_training_falls_back_to_the_plain_codec_then_trains_again() {
    let store = StoreConfig::default().build().unwrap();
    let pool = store.create_pool(PoolConfig::persistent());
    // Nothing to train on: a same-filled page holds no object.
    assert_eq!(pool.put(key(0), &[0u8; PAGE_SIZE]).unwrap(), PutOutcome::Stored);
    let mut cfg = RecompressConfig::parse("zstd:3+dict").unwrap();
    cfg.dictionary =
        Some(DictTraining { after_bytes: 0, sample_pages: 256, dict_bytes: 16 << 10, max_dictionaries: 1 });
    let mut rec = store.recompression(cfg).unwrap();
    rec.pass();
    let status = store.stats().recompression.unwrap();
    assert!(status.starts_with("zstd-3 (without a dictionary: training failed"), "{status}");
    assert!(status.contains("try 1 of 3, next at 64 KiB"), "{status}");
    // Too little for the next try yet (one span of at most 32 KiB): the
    // page moves to the codec alone.
    assert_eq!(pool.put(key(1), &page(1)).unwrap(), PutOutcome::Stored);
    rec.pass();
    rec.pass();
    assert_eq!(codec_pages(&store, "zstd-3"), 1, "{:?}", store.stats().recompression);
    // Once the pool holds 64 KiB, training is tried again; it works, and
    // cold pages (those in zstd-3 too) move to the codec with the dictionary.
    for i in 2..201 {
        assert_eq!(pool.put(key(i), &page(i)).unwrap(), PutOutcome::Stored);
    }
    rec.pass();
    assert_eq!(store.stats().recompression.unwrap(), "zstd-3+dict");
    rec.pass();
    assert_eq!(codec_pages(&store, "zstd-3+dict") + codec_pages(&store, "zstd-3"), 200);
    assert!(codec_pages(&store, "zstd-3+dict") > 192 / 2, "{:?}", store.codec_usage());
    for i in 1..201 {
        assert_eq!(read(&pool, i), Some(page(i)));
    }
}

#[test]
fn recompression_stops_training_after_three_failed_tries() {
    let policy = PolicyConfig { incompressible: tmem_core::Incompressible::StoreRaw, ..Default::default() };
    let store = StoreConfig { policy, ..Default::default() }.build().unwrap();
    let pool = store.create_pool(PoolConfig::persistent());
    let mut cfg = RecompressConfig::parse("zstd:3+dict").unwrap();
    cfg.dictionary =
        Some(DictTraining { after_bytes: 0, sample_pages: 256, dict_bytes: 16 << 10, max_dictionaries: 1 });
    let mut rec = store.recompression(cfg).unwrap();
    // Random pages are stored raw: the pool grows, but gives no sample.
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(5);
    let mut i = 0;
    for _ in 0..12 {
        for _ in 0..64 {
            let mut p = [0u8; PAGE_SIZE];
            rng.fill_bytes(&mut p);
            assert_eq!(pool.put(key(i), &p).unwrap(), PutOutcome::Stored);
            i += 1;
        }
        rec.pass();
    }
    let status = store.stats().recompression.unwrap();
    assert!(status.starts_with("zstd-3 (without a dictionary") && status.ends_with("no more tries)"), "{status}");
    // Compressible pages now still go to the codec alone.
    for j in 0..64 {
        assert_eq!(pool.put(key(i + j), &page(j)).unwrap(), PutOutcome::Stored);
    }
    rec.pass();
    rec.pass();
    assert_eq!(store.stats().recompression.unwrap(), status);
    assert_eq!(codec_pages(&store, "zstd-3"), 64);
}

#[test]
fn bad_recompression_codecs_are_refused() {
    assert!(RecompressConfig::parse("raw").is_err());
    assert!(RecompressConfig::parse("zstd:99").is_ok_and(|c| c.codec.build().is_err()));
    let store = StoreConfig::default().build().unwrap();
    assert!(store.recompression(RecompressConfig::parse("zstd:99").unwrap()).is_err());
    assert!(RecompressConfig::parse("brotli").is_err());
}

/// Runs writers (each on its own keys, checked against its own oracle)
/// while other threads recompress and compact, and, with a tier, write
/// back; then checks every page.
fn race(writers: Vec<Vec<RaceOp>>, with_tier: bool) {
    let limit = if with_tier { 96 << 10 } else { 0 };
    let policy = PolicyConfig { max_pool_bytes: limit, ..Default::default() };
    let store = Arc::new(StoreConfig { policy, ..Default::default() }.build().unwrap());
    let pool = race_pool(&store, with_tier);
    // Every key starts with a page that two passes recompress, so the race
    // always has recompressed pages in it.
    let oracles = fill_writers(&pool, writers.len());
    let mut rec = store.recompression(zstd3()).unwrap();
    rec.pass();
    rec.pass();
    assert!(store.stats().total.recompressed_pages > 0, "{:?}", store.stats().total);
    let _writeback = with_tier.then(|| store.start_writeback(Duration::from_millis(1)));
    race_writers(&store, &pool, &writers, oracles, || rec.pass());
    let st = store.stats();
    assert_eq!(st.total.decompress_fail + st.total.tier_get_fail, 0);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn recompression_racing_puts_gets_flushes_and_compaction_loses_nothing(
        writers in prop::collection::vec(prop::collection::vec(race_op(4, 4, 1), 200..600), 3)
    ) {
        race(writers, false);
    }

    #[test]
    fn recompression_racing_writeback_loses_nothing(
        writers in prop::collection::vec(prop::collection::vec(race_op(4, 4, 1), 200..600), 3)
    ) {
        race(writers, true);
    }
}

#[test]
fn the_worker_thread_recompresses_on_its_own() {
    let store = StoreConfig::default().build().unwrap();
    let pool = store.create_pool(PoolConfig::persistent());
    for i in 0..500 {
        assert_eq!(pool.put(key(i), &page(i)).unwrap(), PutOutcome::Stored);
    }
    let mut cfg = zstd3();
    cfg.after = Duration::from_millis(20);
    let worker = store.recompression(cfg).unwrap().spawn();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while codec_pages(&store, "zstd-3") < 500 {
        assert!(std::time::Instant::now() < deadline, "not recompressed in 30 s: {:?}", store.codec_usage());
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(worker.is_running());
    drop(worker);
    for i in 0..500 {
        assert_eq!(read(&pool, i), Some(page(i)));
    }
}
