//! `tmem bench fault` at a small size on zram and the fuse-ram baseline
//! (tmem's own row needs the tmem binary: `scripts/test.sh` runs it): every
//! page comes back right, the fault and readahead counts add up, `--page-cluster` is put back,
//! and nothing the bench set up remains. Needs root, zram, FUSE and no
//! other swap area; otherwise prints "SKIP: <reason>" (fails where
//! `TMEM_REQUIRE` requires the feature: see `tmem_testkit::skip`).

use std::path::Path;

use clap::Parser;
use tmem_bench::fault::{FaultArgs, Order};
use tmem_testkit::{skip, Feature};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: FaultArgs,
}

fn page_cluster() -> String {
    std::fs::read_to_string("/proc/sys/vm/page-cluster").unwrap().trim().to_owned()
}

/// Why the bench cannot run here, if it cannot.
fn missing() -> Option<(Feature, String)> {
    if !tmem_sys::is_root() {
        return Some((Feature::Root, "needs root".into()));
    }
    if !Path::new("/dev/fuse").exists() {
        return Some((Feature::Fuse, "no /dev/fuse".into()));
    }
    if let Err(e) = tmem_bench::zram::probe() {
        return Some((Feature::Zram, e.to_string()));
    }
    match tmem_sys::swap::swaps() {
        Ok(a) if a.is_empty() => None,
        Ok(_) => Some((Feature::Swap, "other swap areas are active".into())),
        Err(e) => Some((Feature::Swap, e.to_string())),
    }
}

#[test]
fn fault_bench_reads_every_page_back() {
    if let Some((feature, why)) = missing() {
        return skip(feature, &why);
    }
    let before = page_cluster();
    let set = if before == "2" { "1" } else { "2" };
    let a = Cli::parse_from(["fault", "--mib", "16", "--backends", "zram,fuse-ram", "--page-cluster", set]).args;
    let pid = std::process::id();
    let result = tmem_bench::fault::bench(&a);

    // Nothing remains, whatever happened.
    assert_eq!(page_cluster(), before, "vm.page-cluster not restored");
    assert!(tmem_sys::swap::swaps().unwrap().is_empty(), "swap areas left");
    assert!(!Path::new(&format!("/run/tmem-bench-{pid}-fuse-ram")).exists(), "fuse-ram directory left");
    let r = result.unwrap();
    if let Some(d) = &r.zram_device {
        assert_ne!(d, "zram0");
        assert!(!Path::new("/sys/block").join(d).exists(), "{d} not removed");
    }

    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(r.page_cluster.to_string(), set);
    assert_eq!(r.pages, 4096);
    let cells: Vec<(&str, Order)> = r.cells.iter().map(|c| (c.backend.as_str(), c.order)).collect();
    assert_eq!(
        cells,
        [
            ("zram", Order::Random),
            ("zram", Order::Sequential),
            ("fuse-ram", Order::Random),
            ("fuse-ram", Order::Sequential)
        ]
    );
    print!("{}", tmem_bench::fault::render_table(&r.cells));
    let corpus = tmem_corpus::Corpus::mix(&tmem_corpus::Corpus::builtin());
    let zero_pages = (0..4096).filter(|i| corpus.page(i % corpus.page_count()).iter().all(|b| *b == 0)).count() as u64;
    for c in &r.cells {
        let (t, what) = (&c.touch, format!("{} {:?}: {c:?}", c.backend, c.order));
        assert_eq!((t.verified_pages, t.wrong_pages), (4096, 0), "{what}");
        assert!(c.out.pages_out * 100 >= 4096 * 95, "{what}");
        // Every page that was out faulted: a major fault, or a minor one on a page read ahead.
        assert!(t.touched >= c.out.pages_out * 95 / 100 && t.touched <= 4096, "{what}");
        assert_eq!(t.major_faults + t.minor_faults, t.touched, "{what}");
        assert!(t.major_faults >= 1, "{what}");
        assert_eq!(t.major.count, t.major_faults, "{what}");
        assert_eq!(t.all.count, t.touched, "{what}");
        // A major fault reads its page and any read ahead, except a zero
        // page, which the swap layer keeps itself and fills without I/O.
        let read = c.pages_read_per_major.unwrap();
        assert!(t.pswpin + zero_pages >= t.major_faults && read > 0.0, "{what}");
        assert!(t.major.p50_us.unwrap() > 0.0 && t.major.p99_us.unwrap() >= t.major.p50_us.unwrap(), "{what}");
        assert!(t.major.p999_us.is_none(), "{what}: p99.9 from fewer than 10,000 faults");
        assert!(c.pool.stored_bytes > 0, "{what}");
    }
    // zram reads each page on its own (no swap cache, no readahead).
    for c in r.cells.iter().filter(|c| c.backend == "zram") {
        assert_eq!(c.touch.minor_faults, 0, "{c:?}");
    }
}
