//! Pool memory of the allocator under different tunings, on corpus files:
//! `cargo run --release -p tmem-core --example alloc_tuning -- FILE...`.
use tmem_core::alloc::AllocConfig;
use tmem_core::{Incompressible, Key, PolicyConfig, PoolConfig, PutOutcome, StoreConfig};

fn main() {
    let parts: Vec<tmem_corpus::Corpus> = std::env::args()
        .skip(1)
        .map(|p| tmem_corpus::Corpus::read(std::path::Path::new(&p)).expect("read corpus"))
        .collect();
    let corpus = tmem_corpus::Corpus::mix(&parts);
    println!("{} pages", corpus.page_count());
    for max_span_pages in [4, 8, 16] {
        for merge_permille in [0, 10, 30] {
            let store = StoreConfig {
                policy: PolicyConfig { incompressible: Incompressible::StoreRaw, ..Default::default() },
                alloc: AllocConfig { max_span_pages, merge_permille },
                ..Default::default()
            }
            .build()
            .expect("store");
            let pool = store.create_pool(PoolConfig::persistent());
            for (i, p) in corpus.pages().enumerate() {
                assert_eq!(pool.put(Key::new(0, i as u64), p).expect("put"), PutOutcome::Stored);
            }
            let s = store.stats();
            println!(
                "span {max_span_pages:>2} merge {merge_permille:>2}: mem {} spans {} slots {} compr {} meta {}",
                s.mem_used_total, s.alloc.span_bytes, s.alloc.slot_bytes, s.total.compr_data_size, s.metadata_bytes
            );
        }
    }
}
