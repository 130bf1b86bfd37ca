//! Criterion benchmarks: codecs, the allocator and the store.
//!
//! Pages come from the built-in corpora when they hold pages, else from a
//! synthetic mix (text, half-random, zero and same-filled pages). Run with
//! `cargo bench -p tmem-core --bench store`; a filter such as `-- codec/lz4`
//! picks a subset. Measurement is kept short (20 samples, 2 s).

use rand_xoshiro::rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use tmem_core::alloc::ZsAlloc;
use tmem_core::codec::{fill_page, same_filled, train_dictionary, Codec, CodecConfig, COMPRESS_BUF_SIZE};
use tmem_core::{GetOutcome, Key, PoolConfig, PutOutcome, StoreConfig, PAGE_SIZE};

type Page = [u8; PAGE_SIZE];

/// Pages used by every benchmark.
const PAGES: usize = 512;

struct Rng(Xoshiro256PlusPlus);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(Xoshiro256PlusPlus::seed_from_u64(seed))
    }

    fn next(&mut self) -> u64 {
        self.0.next_u64()
    }
}

#[allow(clippy::cast_possible_truncation)] // truncation to bytes and small indexes is intended
fn synthetic_page(i: usize) -> Page {
    let words: [&[u8]; 10] = [
        b"the ",
        b"memory ",
        b"page ",
        b"{\"id\": ",
        b"\"name\": \"x\"}, ",
        b"0x00007f12 ",
        b"null, ",
        b"\n\t",
        b"int ",
        b"return 0;",
    ];
    let mut r = Rng::new(i as u64);
    let mut p = [0u8; PAGE_SIZE];
    match i % 8 {
        0 => {}
        1 => fill_page(&mut p, r.next()),
        2 => {
            // Half random, half text.
            p[..PAGE_SIZE / 2].iter_mut().for_each(|b| *b = r.next() as u8);
            fill_words(&mut p[PAGE_SIZE / 2..], &words, &mut r);
        }
        3 => {
            // Sparse: a few pointers in zeros (heap-like).
            for _ in 0..64 {
                let at = (r.next() as usize % (PAGE_SIZE / 8)) * 8;
                p[at..at + 8].copy_from_slice(&(0x7f00_0000_0000 | (r.next() & 0xff_fff0)).to_le_bytes());
            }
        }
        _ => fill_words(&mut p, &words, &mut r),
    }
    p
}

fn fill_words(dst: &mut [u8], words: &[&[u8]], r: &mut Rng) {
    let mut at = 0;
    while at < dst.len() {
        let w = words[usize::try_from(r.next() % words.len() as u64).expect("small")];
        let n = w.len().min(dst.len() - at);
        dst[at..at + n].copy_from_slice(&w[..n]);
        at += n;
    }
}

/// Real pages when the built-in corpora have them, synthetic ones otherwise.
fn pages() -> (String, Vec<Page>) {
    let corpora = std::panic::catch_unwind(tmem_corpus::Corpus::builtin).unwrap_or_default();
    let real: Vec<Page> = corpora
        .iter()
        .flat_map(|c| {
            let per = PAGES / corpora.len().max(1);
            let step = (c.page_count() / per.max(1)).max(1);
            (0..c.page_count()).step_by(step).take(per).map(|i| *c.page(i)).collect::<Vec<_>>()
        })
        .collect();
    if real.len() >= 64 {
        ("corpus".into(), real)
    } else {
        ("synthetic".into(), (0..PAGES).map(synthetic_page).collect())
    }
}

fn codecs(pages: &[Page]) -> Vec<Arc<dyn Codec>> {
    let mut v = vec![
        CodecConfig::LZ4.build().expect("lz4"),
        CodecConfig::Zstd { level: 1, dictionary: None }.build().expect("zstd:1"),
    ];
    let samples: Vec<&Page> = pages.iter().step_by(2).collect();
    match train_dictionary(samples, 16 << 10) {
        Ok(dict) => v.push(CodecConfig::Zstd { level: 3, dictionary: Some(dict) }.build().expect("zstd:3+dict")),
        Err(e) => eprintln!("no dictionary benchmark: {e}"),
    }
    v
}

fn bench_codecs(c: &mut Criterion) {
    let (source, pages) = pages();
    // Same-filled pages never reach a codec in the store.
    let pages: Vec<Page> = pages.into_iter().filter(|p| same_filled(p).is_none()).collect();
    for codec in codecs(&pages) {
        let mut g = c.benchmark_group(format!("codec/{}", codec.name()));
        g.throughput(Throughput::Bytes(PAGE_SIZE as u64));
        let mut buf = [0u8; COMPRESS_BUF_SIZE];
        let mut i = 0;
        g.bench_function(BenchmarkId::new("compress", &source), |b| {
            b.iter(|| {
                i = (i + 1) % pages.len();
                black_box(codec.compress(black_box(&pages[i]), &mut buf).expect("compress"))
            });
        });
        let compressed: Vec<Vec<u8>> = pages
            .iter()
            .map(|p| {
                let n = codec.compress(p, &mut buf).expect("compress");
                buf[..n].to_vec()
            })
            .collect();
        let total: usize = compressed.iter().map(Vec::len).sum();
        eprintln!(
            "{}: {source} pages compress to {:.1}%",
            codec.name(),
            total as f64 * 100.0 / (pages.len() * PAGE_SIZE) as f64
        );
        let mut out = [0u8; PAGE_SIZE];
        let mut i = 0;
        g.bench_function(BenchmarkId::new("decompress", &source), |b| {
            b.iter(|| {
                i = (i + 1) % compressed.len();
                codec.decompress(black_box(&compressed[i]), &mut out).expect("decompress");
                black_box(out[0])
            });
        });
        g.finish();
    }
}

fn bench_alloc(c: &mut Criterion) {
    let mut g = c.benchmark_group("alloc");
    g.throughput(Throughput::Elements(1));
    let data = vec![0x5au8; PAGE_SIZE];
    // Object sizes typical of compressed pages.
    let sizes: Vec<usize> = {
        let mut r = Rng::new(7);
        (0..1024).map(|_| 64 + usize::try_from(r.next() % 3000).expect("small")).collect()
    };
    g.bench_function("alloc_free_steady", |b| {
        let a = ZsAlloc::new();
        // A ring of live objects: each iteration frees the oldest and allocates one.
        let mut ring: Vec<_> = sizes.iter().map(|&n| a.alloc_write(&data[..n]).expect("alloc")).collect();
        let mut i = 0;
        b.iter(|| {
            a.free(ring[i]);
            ring[i] = a.alloc_write(black_box(&data[..sizes[i]])).expect("alloc");
            i = (i + 1) % ring.len();
        });
    });
    g.bench_function("alloc_free_same_class", |b| {
        let a = ZsAlloc::new();
        b.iter(|| {
            let loc = a.alloc_write(black_box(&data[..1000])).expect("alloc");
            a.free(loc);
        });
    });
    g.bench_function("compact_4096_objects", |b| {
        b.iter_batched(
            || {
                let a = ZsAlloc::new();
                let mut locs: Vec<_> =
                    (0..4096).map(|i| a.alloc_write(&data[..sizes[i % 1024]]).expect("alloc")).collect();
                // Free 3 of 4: sparse spans to compact.
                let mut kept = Vec::new();
                for (i, l) in locs.drain(..).enumerate() {
                    if i % 4 == 0 {
                        kept.push((l, sizes[i % 1024]));
                    } else {
                        a.free(l);
                    }
                }
                (a, kept)
            },
            |(a, mut kept)| {
                let plan = a.plan_compaction();
                for (l, n) in &mut kept {
                    if plan.contains(*l) {
                        *l = a.migrate(*l, *n).expect("migrate");
                    }
                }
                a.finish_compaction(plan);
                a
            },
            criterion::BatchSize::LargeInput,
        );
    });
    g.finish();
}

fn bench_store(c: &mut Criterion) {
    let (source, pages) = pages();
    let mut g = c.benchmark_group("store");
    g.throughput(Throughput::Bytes(PAGE_SIZE as u64));
    for codec in [CodecConfig::LZ4, CodecConfig::Zstd { level: 1, dictionary: None }] {
        let store = StoreConfig { codec: Some(codec), ..StoreConfig::default() }.build().expect("store");
        store.set_policy("incompressible", "store_raw").expect("policy");
        let name = store.codec_name();
        let pool = store.create_pool(PoolConfig::persistent());
        let keys = u64::try_from(pages.len()).expect("fits");
        let mut i = 0u64;
        g.bench_function(BenchmarkId::new(format!("put/{name}"), &source), |b| {
            b.iter(|| {
                i = (i + 1) % (keys * 8);
                let page = &pages[usize::try_from(i % keys).expect("fits")];
                let r = pool.put(Key::new(1, i), black_box(page)).expect("put");
                assert_eq!(r, PutOutcome::Stored);
            });
        });
        for k in 0..keys {
            let r = pool.put(Key::new(2, k), &pages[usize::try_from(k).expect("fits")]).expect("put");
            assert_eq!(r, PutOutcome::Stored);
        }
        let mut out = [0u8; PAGE_SIZE];
        let mut i = 0u64;
        g.bench_function(BenchmarkId::new(format!("get/{name}"), &source), |b| {
            b.iter(|| {
                i = (i + 1) % keys;
                assert_eq!(pool.get(Key::new(2, i), &mut out).expect("get"), GetOutcome::Hit);
                black_box(out[0])
            });
        });
        let excl = store.create_pool(PoolConfig::persistent().exclusive_gets(true));
        let mut i = 0u64;
        g.bench_function(BenchmarkId::new(format!("put+exclusive_get/{name}"), &source), |b| {
            b.iter(|| {
                i = (i + 1) % keys;
                let key = Key::new(3, i);
                let r = excl.put(key, black_box(&pages[usize::try_from(i).expect("fits")])).expect("put");
                assert_eq!(r, PutOutcome::Stored);
                assert_eq!(excl.get(key, &mut out).expect("get"), GetOutcome::Hit);
                black_box(out[0])
            });
        });
    }
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(20)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500))
}

criterion_group! {
    name = benches;
    config = config();
    targets = bench_codecs, bench_alloc, bench_store
}
criterion_main!(benches);
