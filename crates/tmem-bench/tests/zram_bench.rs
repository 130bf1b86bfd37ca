//! Drives real zram devices when it can (root, zram module): each run on a
//! device hot-added for it and removed afterwards; otherwise prints
//! "SKIP: <reason>" and passes (fails where `TMEM_REQUIRE` requires root or
//! zram: see `tmem_testkit::skip`).

mod common;

use tmem_bench::zram::{self, ZramError};
use tmem_testkit::{skip, Feature};

const PAGES: usize = 2048; // 8 MiB
const THREADS: usize = 2;

/// `disksize` and `comp_algorithm` of the user's zram0, which must stay untouched.
fn zram0() -> Option<(u64, String)> {
    Some((zram::disksize("zram0").ok()?, zram::current_algorithm("zram0").ok()?))
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
    let algorithms = match zram::probe() {
        Ok(a) => a,
        Err(reason) => {
            let feature = if tmem_sys::is_root() { Feature::Zram } else { Feature::Root };
            skip(feature, &reason.to_string());
            return;
        }
    };
    let before = zram0();

    let g = common::generate(PAGES, 42);
    let same_filled = g.data.chunks(common::PAGE).filter(|p| common::is_same_filled(p)).count();
    let pages = u64::try_from(PAGES).unwrap();

    // Unknown algorithm: clear error, and the device is removed again.
    match zram::bench(&g.data, "no-such-algo", THREADS) {
        Err(ZramError::UnknownAlgorithm { available, .. }) => assert_eq!(available, algorithms),
        other => panic!("expected UnknownAlgorithm, got {other:?}"),
    }

    for algorithm in ["lz4", "lzo-rle"] {
        if !algorithms.iter().any(|a| a == algorithm) {
            assert_ne!(algorithm, "lz4", "lz4 must be offered by the kernel");
            skip(Feature::Zram, &format!("{algorithm} is not offered by this kernel's zram"));
            continue;
        }
        // bench verifies every byte read back (single- and multi-thread) and
        // returns ZramError::Mismatch otherwise, so Ok means verification passed.
        let run = zram::bench(&g.data, algorithm, THREADS).unwrap_or_else(|e| panic!("bench {algorithm}: {e}"));
        let m = &run.mm_stat;
        let mbs = |p: zram::TimedPhase| p.mb_per_sec().unwrap_or(f64::NAN);
        let us = |p: zram::TimedPhase| p.cpu_us_per_page().unwrap_or(f64::NAN);
        println!(
            "{algorithm} on {}: {} pages ({} same-filled, {} random), orig {} B, compr {} B, mem_used_total {} B, \
             ratio {:.3}, huge {}; put 1t {:.0} MB/s {:.2} us/page, get 1t {:.0} MB/s {:.2} us/page, \
             put {}t {:.0} MB/s, get {}t {:.0} MB/s",
            run.device,
            run.pages,
            same_filled,
            g.random,
            m.orig_data_size,
            m.compr_data_size,
            m.mem_used_total,
            run.ratio(),
            m.huge_pages,
            mbs(run.put_1t),
            us(run.put_1t),
            mbs(run.get_1t),
            us(run.get_1t),
            run.threads,
            mbs(run.put_mt),
            run.threads,
            mbs(run.get_mt),
        );
        assert_eq!(run.algorithm, algorithm);
        assert_eq!(run.pages, pages);
        assert_eq!(run.threads, THREADS);
        assert_ne!(run.device, "zram0", "a fresh device, not the user's zram0");
        assert_eq!(m.orig_data_size, pages * 4096);
        assert_eq!(m.same_pages, u64::try_from(same_filled).unwrap());
        assert!(m.mem_used_total > 0);
        assert!(m.compr_data_size > 0 && m.compr_data_size < m.orig_data_size);
        // Random pages do not compress: zram stores them as huge pages.
        assert!(m.huge_pages >= u64::try_from(g.random).unwrap(), "{m:?}");
        for p in [run.put_1t, run.get_1t, run.put_mt, run.get_mt] {
            assert!(p.secs.is_finite() && p.secs > 0.0 && p.pages >= pages, "{p:?}");
            assert!(p.mb_per_sec().is_some() && p.cpu_us_per_page().is_some(), "{p:?}");
        }
        assert_eq!(zram0(), before, "zram0 touched by the {algorithm} run");
    }
}
