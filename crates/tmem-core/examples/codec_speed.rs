//! Raw codec ratio and throughput on a corpus file:
//! `cargo run --release --example codec_speed -- FILE`.
//!
//! "+dict" rows use a 64 KiB dictionary trained on every 16th page of the
//! first half of the file and are measured on the second half, as a daemon
//! trains on the pages it has seen and compresses the ones that follow.
use std::time::Instant;
use tmem_core::codec::{CodecConfig, COMPRESS_BUF_SIZE};
use tmem_core::PAGE_SIZE;

fn main() {
    let path = std::env::args().nth(1).expect("corpus file");
    let corpus = tmem_corpus::Corpus::read(std::path::Path::new(&path)).expect("read corpus");
    let data = corpus.data();
    let pages: Vec<&[u8; PAGE_SIZE]> = data.as_chunks::<PAGE_SIZE>().0.iter().collect();
    let half = pages.len() / 2;
    let dict = tmem_core::codec::train_dictionary(pages[..half].iter().step_by(16).copied(), 64 << 10).unwrap();
    let zstd1 = CodecConfig::Zstd { level: 1, dictionary: None };
    for (cfg, pages) in [
        (CodecConfig::LZ4, &pages[half..]),
        (CodecConfig::LZ4.with_dictionary(dict.clone()), &pages[half..]),
        (zstd1.clone(), &pages[half..]),
        (zstd1.with_dictionary(dict), &pages[half..]),
    ] {
        let c = cfg.build().unwrap();
        let mut buf = [0u8; COMPRESS_BUF_SIZE];
        let mut out = [0u8; PAGE_SIZE];
        let mut comp = Vec::new();
        let t = Instant::now();
        let mut total = 0;
        for p in pages {
            let n = c.compress(p, &mut buf).unwrap();
            total += n;
            comp.push(buf[..n].to_vec());
        }
        let ct = t.elapsed().as_secs_f64();
        let t = Instant::now();
        for z in &comp {
            c.decompress(z, &mut out).unwrap();
        }
        let dt = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let mut x = 0u32;
        for z in &comp {
            x ^= crc32fast::hash(z);
        }
        let crc = t.elapsed().as_secs_f64();
        let mb = (pages.len() * PAGE_SIZE) as f64 / 1e6;
        println!(
            "{}: ratio {:.3} comp {:.0} MB/s decomp {:.0} MB/s crc {:.0} MB/s-equiv ({x})",
            c.name(),
            mb * 1e6 / total as f64,
            mb / ct,
            mb / dt,
            mb / crc
        );
    }
}
