//! Drives the real zram device when it is available (root, idle zram0);
//! otherwise prints "SKIP: <reason>" and passes.

mod common;

use tmem_sys::zram::{self, ZramError};

const DEV: &str = "zram0";
const PAGES: usize = 2048; // 8 MiB
const THREADS: usize = 2;

fn state() -> (u64, String, u64) {
    (zram::disksize(DEV).unwrap(), zram::current_algorithm(DEV).unwrap(), zram::mm_stat(DEV).unwrap().mem_limit)
}

#[test]
fn generator_counts_match_zram_definition() {
    let g = common::generate(PAGES, 42);
    let counted = g.data.chunks(common::PAGE).filter(|p| common::is_same_filled(p)).count();
    assert_eq!(counted, g.same_filled);
    assert_eq!(g.same_filled + g.pattern + g.text + g.random, PAGES);
    assert!(g.zero > 0 && g.same_filled > g.zero && g.pattern > 0 && g.text > 0 && g.random > 0);
}

#[test]
fn zram_bench_8mib_mixed_pages() {
    if let Err(reason) = zram::check_available(DEV) {
        println!("SKIP: {reason}");
        return;
    }
    let before = state();
    assert_eq!(before.0, 0);
    let algorithms = zram::algorithms(DEV).unwrap();
    assert!(algorithms.contains(&before.1));

    let g = common::generate(PAGES, 42);
    let same_filled = g.data.chunks(common::PAGE).filter(|p| common::is_same_filled(p)).count();
    let pages = u64::try_from(PAGES).unwrap();

    // Unknown algorithm: clear error, device untouched.
    match zram::bench(DEV, &g.data, "no-such-algo", THREADS) {
        Err(ZramError::UnknownAlgorithm { available, .. }) => assert_eq!(available, algorithms),
        other => panic!("expected UnknownAlgorithm, got {other:?}"),
    }
    assert_eq!(state(), before);

    for algorithm in ["lz4", "lzo-rle"] {
        if !algorithms.iter().any(|a| a == algorithm) {
            assert_ne!(algorithm, "lz4", "lz4 must be offered by the kernel");
            println!("SKIP {algorithm}: not offered by {DEV}");
            continue;
        }
        // bench verifies every byte read back (single- and multi-thread) and
        // returns ZramError::Mismatch otherwise, so Ok means verification passed.
        let run = zram::bench(DEV, &g.data, algorithm, THREADS).unwrap_or_else(|e| panic!("bench {algorithm}: {e}"));
        let m = &run.mm_stat;
        println!(
            "{algorithm}: {} pages ({} same-filled, {} random), orig {} B, compr {} B, mem_used_total {} B, \
             ratio {:.3}, huge {}; put 1t {:.0} MB/s, get 1t {:.0} MB/s, put {}t {:.0} MB/s, get {}t {:.0} MB/s",
            run.pages,
            same_filled,
            g.random,
            m.orig_data_size,
            m.compr_data_size,
            m.mem_used_total,
            run.ratio(),
            m.huge_pages,
            run.mb_per_sec(run.put_secs_1t),
            run.mb_per_sec(run.get_secs_1t),
            run.threads,
            run.mb_per_sec(run.put_secs_mt),
            run.threads,
            run.mb_per_sec(run.get_secs_mt),
        );
        assert_eq!(run.algorithm, algorithm);
        assert_eq!(run.pages, pages);
        assert_eq!(run.threads, THREADS);
        assert_eq!(m.orig_data_size, pages * 4096);
        assert_eq!(m.same_pages, u64::try_from(same_filled).unwrap());
        assert!(m.mem_used_total > 0);
        assert!(m.compr_data_size > 0 && m.compr_data_size < m.orig_data_size);
        // Random pages do not compress: zram stores them as huge pages.
        assert!(m.huge_pages >= u64::try_from(g.random).unwrap(), "{m:?}");
        for secs in [run.put_secs_1t, run.get_secs_1t, run.put_secs_mt, run.get_secs_mt] {
            assert!(secs.is_finite() && secs > 0.0);
        }
        assert_eq!(state(), before, "{DEV} not restored after {algorithm}");
    }
}
