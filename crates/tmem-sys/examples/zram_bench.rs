//! Benchmarks every zram algorithm on generated mixed pages.
//!
//! Usage: `cargo run --release -p tmem-sys --example zram_bench [MiB] [threads]`
//! (root, idle /dev/zram0).

#[path = "../tests/common/mod.rs"]
mod common;

use tmem_sys::zram;

fn main() {
    let mut args = std::env::args().skip(1);
    let mib: usize = args.next().map_or(8, |a| a.parse().expect("MiB"));
    let threads: usize = args.next().map_or(2, |a| a.parse().expect("threads"));
    if let Err(reason) = zram::check_available("zram0") {
        eprintln!("SKIP: {reason}");
        return;
    }
    let g = common::generate(mib * 256, 42);
    println!(
        "{} pages: {} same-filled ({} zero), {} pattern, {} text, {} random; {threads} threads",
        g.pages, g.same_filled, g.zero, g.pattern, g.text, g.random
    );
    println!(
        "{:<8} {:>7} {:>10} {:>10} {:>10} {:>10} {:>6}",
        "algo", "ratio", "put1t MB/s", "get1t MB/s", "putMT MB/s", "getMT MB/s", "huge"
    );
    for algorithm in zram::algorithms("zram0").expect("algorithms") {
        match zram::bench("zram0", &g.data, &algorithm, threads) {
            Ok(r) => println!(
                "{:<8} {:>7.3} {:>10.0} {:>10.0} {:>10.0} {:>10.0} {:>6}",
                algorithm,
                r.ratio(),
                r.mb_per_sec(r.put_secs_1t),
                r.mb_per_sec(r.get_secs_1t),
                r.mb_per_sec(r.put_secs_mt),
                r.mb_per_sec(r.get_secs_mt),
                r.mm_stat.huge_pages
            ),
            Err(e) => println!("{algorithm:<8} error: {e}"),
        }
    }
}
