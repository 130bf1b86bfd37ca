//! Bytes held per page, single pages against groups, on corpora:
//! `cargo run --release -p tmem-core --example group_density [-- FILE.tcorp ...]`
//! (the built-in corpora when no file is given).
//!
//! With `--dict DICT --each PAGES` first, the first PAGES pages of each file
//! are measured together, in order, with that dictionary (zstd's format):
//! the pages and dictionary `tmem corpus export` wrote for zram's
//! `algorithm_params dict=`, so that both stores hold the same pages with
//! the same dictionary.
//!
//! Each corpus is stored at adjacent indexes of one object (as a swap
//! device's pages are) in a store whose codec is zstd-9 with a 64 KiB
//! dictionary trained on every 16th page of the corpus's first half, and
//! measured: the objects' bytes and the span bytes (what the allocator
//! holds), and below each row where the rest goes, per page: slots
//! rounded up to their class, span tails and free slots, the allocator's
//! tables, and the index and codecs. Then every page is grouped (16 pages
//! a group, zstd-9 with the same dictionary, `Grouping::group_now`),
//! compacted and measured again; every page is read back and compared.
//! Rows: per page alone, grouped with the dictionary, and grouped without
//! one (against zstd-9 pages).
use std::sync::Arc;

use tmem_core::codec::{train_dictionary, CodecConfig};
use tmem_core::{GetOutcome, GroupConfig, Incompressible, Key, PolicyConfig, PoolConfig, StoreConfig, PAGE_SIZE};

/// CPU time this thread has used (the machine may be busy with others:
/// wall time would measure them too).
fn thread_cpu() -> std::time::Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid timespec to write into; the clock id is a constant.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0);
    std::time::Duration::new(u64::try_from(ts.tv_sec).unwrap(), u32::try_from(ts.tv_nsec).unwrap())
}

/// Stores `pages` in codec `codec`, groups them with `dictionary` or not;
/// returns (stats before grouping, stats after, CPU time of the grouping).
fn run(
    pages: &[&[u8; PAGE_SIZE]],
    codec: CodecConfig,
    dictionary: bool,
) -> (tmem_core::Stats, tmem_core::Stats, std::time::Duration) {
    let group = GroupConfig { level: 9, dictionary, ..Default::default() };
    let policy = PolicyConfig { incompressible: Incompressible::StoreRaw, ..Default::default() };
    let store = StoreConfig { codec: Some(codec), policy, group: Some(group), ..Default::default() }.build().unwrap();
    let pool = store.create_pool(PoolConfig::persistent());
    for (i, p) in pages.iter().enumerate() {
        let _ = pool.put(Key::new(0, i as u64), p).unwrap();
    }
    store.compact();
    let single = store.stats();
    let t = thread_cpu();
    store.grouping().unwrap().group_now();
    let took = thread_cpu() - t;
    store.compact();
    let grouped = store.stats();
    let mut out = [0u8; PAGE_SIZE];
    for (i, p) in pages.iter().enumerate() {
        assert_eq!(pool.get(Key::new(0, i as u64), &mut out).unwrap(), GetOutcome::Hit);
        assert!(out == **p, "page {i} came back different");
    }
    (single, grouped, took)
}

fn row(name: &str, what: &str, pages: usize, s: &tmem_core::Stats) {
    let n = pages as f64;
    println!(
        "{name:>8} {what:<28} objects {:>7.0} B/page  spans {:>7.0} B/page  mem_used_total {:>7.0} B/page  ({} grouped, {} groups)",
        s.total.compr_data_size as f64 / n,
        s.alloc.span_bytes as f64 / n,
        s.mem_used_total as f64 / n,
        s.total.group_pages,
        s.total.groups,
    );
    println!(
        "{name:>8} {:<28} slots {:>7.1}  tails and free slots {:>7.1}  allocator tables {:>5.1}  index and codecs {:>5.1} B/page",
        "",
        (s.alloc.slot_bytes - s.total.compr_data_size) as f64 / n,
        (s.alloc.span_bytes - s.alloc.slot_bytes) as f64 / n,
        s.alloc.meta_bytes as f64 / n,
        (s.metadata_bytes - s.alloc.meta_bytes) as f64 / n,
    );
}

/// The per-page and grouped rows of `pages`, with dictionary `dict` and
/// without, under `name`.
fn measure(name: &str, all: &[&[u8; PAGE_SIZE]], dict: &Arc<[u8]>) {
    let zstd9 = CodecConfig::Zstd { level: 9, dictionary: None };
    for (with, codec) in [("with dictionary", zstd9.with_dictionary(Arc::clone(dict))), ("without", zstd9.clone())] {
        let label = codec.build().expect("codec").name().to_owned();
        let (single, grouped, took) = run(all, codec, with != "without");
        row(name, &format!("{label} per page"), all.len(), &single);
        row(name, &format!("{label} 16-page groups"), all.len(), &grouped);
        let bytes = (all.len() * PAGE_SIZE) as f64;
        println!(
            "{name:>8} {with}: grouped/single objects {:.3}x, spans {:.3}x, mem_used_total {:.3}x; \
             grouping pass {took:.2?} CPU ({:.1} MiB/s of pages); ratio per page {:.3}, grouped {:.3}",
            single.total.compr_data_size as f64 / grouped.total.compr_data_size as f64,
            single.alloc.span_bytes as f64 / grouped.alloc.span_bytes as f64,
            single.mem_used_total as f64 / grouped.mem_used_total as f64,
            bytes / f64::from(1 << 20) / took.as_secs_f64(),
            bytes / single.mem_used_total as f64,
            bytes / grouped.mem_used_total as f64,
        );
    }
}

fn main() {
    let mut files: Vec<String> = std::env::args().skip(1).collect();
    if files.first().is_some_and(|a| a == "--dict") {
        assert!(files.len() >= 5 && files[2] == "--each", "--dict DICT --each PAGES FILE.tcorp ...");
        let dict: Arc<[u8]> = std::fs::read(&files[1]).expect("read the dictionary").into();
        let each: usize = files[3].parse().expect("--each: a number of pages");
        let corpora: Vec<tmem_corpus::Corpus> = files
            .drain(4..)
            .map(|f| tmem_corpus::Corpus::read(std::path::Path::new(&f)).expect("read corpus"))
            .collect();
        let all: Vec<&[u8; PAGE_SIZE]> = corpora.iter().flat_map(|c| c.pages().take(each)).collect();
        measure("all", &all, &dict);
        return;
    }
    let corpora: Vec<tmem_corpus::Corpus> = if files.is_empty() {
        tmem_corpus::Corpus::builtin()
    } else {
        files.iter().map(|f| tmem_corpus::Corpus::read(std::path::Path::new(f)).expect("read corpus")).collect()
    };
    for c in &corpora {
        let all: Vec<&[u8; PAGE_SIZE]> = c.pages().collect();
        let half = all.len() / 2;
        let dict = train_dictionary(all[..half].iter().step_by(16).copied(), 64 << 10)
            .or_else(|_| train_dictionary(all.iter().copied(), 64 << 10))
            .expect("train a dictionary");
        measure(&c.meta.program, &all, &dict);
    }
}
