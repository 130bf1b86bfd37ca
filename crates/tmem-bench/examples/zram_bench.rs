//! Benchmarks every zram algorithm on generated mixed pages.
//!
//! Usage: `cargo run --release -p tmem-bench --example zram_bench [MiB] [threads]`
//! (root; each run on a zram device hot-added for it).

#[path = "../tests/common/mod.rs"]
mod common;

use tmem_bench::zram;

fn main() {
    let mut args = std::env::args().skip(1);
    let mib: usize = args.next().map_or(8, |a| a.parse().expect("MiB"));
    let threads: usize = args.next().map_or(2, |a| a.parse().expect("threads"));
    let algorithms = match zram::probe() {
        Ok(a) => a,
        Err(reason) => {
            eprintln!("SKIP: {reason}");
            return;
        }
    };
    let g = common::generate(mib * 256, 42);
    println!(
        "{} pages: {} same-filled ({} zero), {} pattern, {} text, {} random; {threads} threads",
        g.pages, g.same_filled, g.zero, g.pattern, g.text, g.random
    );
    println!(
        "{:<8} {:>7} {:>10} {:>10} {:>10} {:>10} {:>6}",
        "algo", "ratio", "put1t MB/s", "get1t MB/s", "putMT MB/s", "getMT MB/s", "huge"
    );
    let mbs = |p: zram::TimedPhase| p.mb_per_sec().unwrap_or(f64::NAN);
    for algorithm in algorithms {
        match zram::bench(&g.data, &algorithm, threads) {
            Ok(r) => println!(
                "{:<8} {:>7.3} {:>10.0} {:>10.0} {:>10.0} {:>10.0} {:>6}",
                algorithm,
                r.ratio(),
                mbs(r.put_1t),
                mbs(r.get_1t),
                mbs(r.put_mt),
                mbs(r.get_mt),
                r.mm_stat.huge_pages
            ),
            Err(e) => println!("{algorithm:<8} error: {e}"),
        }
    }
}
