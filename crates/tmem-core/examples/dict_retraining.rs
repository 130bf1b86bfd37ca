//! What training new dictionaries as the pool grows gives, on corpora put
//! one after the other (as a machine's programs swap in turn):
//! `cargo run --release -p tmem-core --example dict_retraining [-- CODEC FILE.tcorp ...]`
//! (CODEC: a `--codec` spec with "+dict", default `zstd:9+dict`; the
//! built-in corpora when no file is given).
//!
//! Three stores get the same pages in the same order: automatic training
//! with one dictionary only (trained when the pool first holds 8 MiB), with
//! new ones as it grows (the default), and, as the bound, a dictionary
//! trained beforehand on an even sample of all the pages (what zram is
//! given with `algorithm_params dict=`). Rows: the pool's memory
//! (`mem_used_total`) per page and its ratio; every page is read back and
//! compared.
use std::time::{Duration, Instant};

use tmem_core::codec::{train_dictionary, CodecChoice};
use tmem_core::{
    DictTraining, GetOutcome, Incompressible, Key, PolicyConfig, PoolConfig, Stats, Store, StoreConfig, PAGE_SIZE,
};

/// Waits (at most 60 s) until the store's background training is idle.
fn settled(store: &Store) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let status = store.stats().dictionary.unwrap_or_default();
        if status != "training" || Instant::now() > deadline {
            return status;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Puts `pages` in order, pausing at each training so that the pages after
/// it meet the dictionary it made (as in a daemon, where a training takes
/// a moment against minutes of swapping); returns the stats and the status.
fn run(pages: &[&[u8; PAGE_SIZE]], cfg: StoreConfig) -> (Stats, String) {
    let store = cfg.build().unwrap();
    let pool = store.create_pool(PoolConfig::persistent());
    for (i, p) in pages.iter().enumerate() {
        let _ = pool.put(Key::new(0, i as u64), p).unwrap();
        if i % 256 == 0 {
            settled(&store);
        }
    }
    let status = settled(&store);
    store.compact();
    let stats = store.stats();
    let mut out = [0u8; PAGE_SIZE];
    for (i, p) in pages.iter().enumerate() {
        assert_eq!(pool.get(Key::new(0, i as u64), &mut out).unwrap(), GetOutcome::Hit);
        assert!(out == **p, "page {i} came back different");
    }
    (stats, status)
}

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let spec = if args.first().is_some_and(|a| !a.ends_with(".tcorp")) { args.remove(0) } else { "zstd:9+dict".into() };
    let choice = CodecChoice::parse(&spec).expect("a codec spec");
    assert!(choice.dictionary, "{spec}: a codec with +dict");
    let corpora: Vec<tmem_corpus::Corpus> = if args.is_empty() {
        tmem_corpus::Corpus::builtin()
    } else {
        args.iter().map(|f| tmem_corpus::Corpus::read(std::path::Path::new(f)).expect("read corpus")).collect()
    };
    let pages: Vec<&[u8; PAGE_SIZE]> = corpora.iter().flat_map(|c| c.pages()).collect();
    let names: Vec<&str> = corpora.iter().map(|c| c.meta.program.as_str()).collect();
    println!("{} pages ({} MiB) of {} in that order, {spec}", pages.len(), pages.len() >> 8, names.join(", "));
    let policy = PolicyConfig { incompressible: Incompressible::StoreRaw, ..Default::default() };
    let store_cfg = |dictionary| StoreConfig {
        codec: Some(choice.codec.clone()),
        dictionary,
        policy: policy.clone(),
        ..Default::default()
    };
    let row = |what: &str, s: &Stats, status: &str| {
        println!(
            "{what:<34} {:>7.0} B/page  ratio {:.3}  {status}",
            s.mem_used_total as f64 / pages.len() as f64,
            s.total.orig_data_size as f64 / s.mem_used_total as f64,
        );
    };
    let once = DictTraining { max_dictionaries: 1, ..Default::default() };
    let (one, status) = run(&pages, store_cfg(Some(once)));
    row("one dictionary, at 8 MiB", &one, &status);
    let (grown, status) = run(&pages, store_cfg(Some(DictTraining::default())));
    row("new ones as the pool grows", &grown, &status);
    let sample = pages.iter().step_by((pages.len() / 2048).max(1)).copied();
    let dict = train_dictionary(sample, DictTraining::default().dict_bytes).expect("train");
    let (bound, _) = run(&pages, StoreConfig { codec: Some(choice.codec.with_dictionary(dict)), ..store_cfg(None) });
    row("one trained on all pages first", &bound, "");
    println!(
        "memory, new ones as the pool grows / one at 8 MiB: {:.3}x; / trained on all first: {:.3}x",
        grown.mem_used_total as f64 / one.mem_used_total as f64,
        grown.mem_used_total as f64 / bound.mem_used_total as f64,
    );
}
