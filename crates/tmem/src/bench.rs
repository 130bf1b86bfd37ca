//! `tmem bench store`: the store against kernel zram on the same real pages.
//!
//! For every corpus (and their mix) and every codec, a fresh store receives
//! every page from one thread, then returns every page to one thread; the same
//! is repeated with all threads on disjoint key ranges. Every page read back is
//! compared with the original. Pool memory is the store's `mem_used_total`
//! (spans plus all metadata) after the single-thread puts, against zram's
//! `mem_used_total` for the same pages. Throughput is original bytes per
//! second (MB = 10^6 bytes), the median of `--rounds` runs.
//!
//! Dictionaries ("+dict") are trained on a 1-in-16 sample of the corpus being
//! measured, as a daemon would train on the first pages it sees; the
//! dictionary's memory is part of the pool memory.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use tmem_core::codec::{train_dictionary, CodecChoice};
use tmem_core::{GetOutcome, Incompressible, Key, PolicyConfig, PutOutcome, Store, StoreConfig, PAGE_SIZE};
use tmem_corpus::Corpus;

/// Arguments of `tmem bench store`.
#[derive(clap::Args, Debug)]
pub struct StoreBenchArgs {
    /// Corpus files (default: the built-in corpora). Each is measured alone and all together as "mix".
    #[arg(long = "corpus", num_args = 1..)]
    corpora: Vec<PathBuf>,
    /// Codecs to measure: lz4, zstd, zstd:LEVEL, with "+dict" for a trained dictionary.
    #[arg(long, value_delimiter = ',', default_value = "lz4,zstd:1,zstd:3+dict,zstd:9+dict")]
    codecs: Vec<String>,
    /// Threads for the multi-thread figures (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Timed runs per figure; the median is reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// zram algorithms to compare with.
    #[arg(long, value_delimiter = ',', default_value = "lz4,lzo-rle")]
    zram: Vec<String>,
    /// Do not compare with zram.
    #[arg(long)]
    no_zram: bool,
    /// Dictionary size for "+dict" codecs, bytes.
    #[arg(long, default_value_t = 16384)]
    dict_size: usize,
    /// Only the mix, not each corpus alone.
    #[arg(long)]
    mix_only: bool,
    /// Print JSON instead of tables.
    #[arg(long)]
    json: bool,
}

/// One row of results.
#[derive(Debug, Clone, serde::Serialize)]
struct Row {
    backend: String,
    pages: u64,
    orig_bytes: u64,
    compr_data_size: u64,
    mem_used_total: u64,
    ratio: f64,
    put_mbs_1t: f64,
    get_mbs_1t: f64,
    put_mbs_mt: f64,
    get_mbs_mt: f64,
    threads: usize,
    same_filled_pages: u64,
    incompressible_pages: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    metadata_bytes: Option<u64>,
}

#[derive(Debug, serde::Serialize)]
struct CorpusResult {
    corpus: String,
    pages: usize,
    rows: Vec<Row>,
    #[serde(skip_serializing_if = "Option::is_none")]
    zram_skipped: Option<String>,
}

struct CodecSpec {
    label: String,
    choice: CodecChoice,
}

fn parse_codec(s: &str) -> Result<CodecSpec, String> {
    Ok(CodecSpec { label: s.to_owned(), choice: CodecChoice::parse(s).map_err(|e| e.to_string())? })
}

/// Runs the benchmark and prints tables or JSON.
pub fn run_store(args: &StoreBenchArgs) -> Result<(), String> {
    let specs: Vec<CodecSpec> = args.codecs.iter().map(|s| parse_codec(s)).collect::<Result<_, _>>()?;
    if args.rounds == 0 {
        return Err("--rounds must be at least 1".into());
    }
    let threads = args.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from)).max(1);
    let parts: Vec<Corpus> = if args.corpora.is_empty() {
        Corpus::builtin()
    } else {
        args.corpora.iter().map(|p| Corpus::read(p).map_err(|e| e.to_string())).collect::<Result<_, _>>()?
    };
    let mut sets: Vec<(String, Corpus)> = Vec::new();
    if !args.mix_only || parts.len() == 1 {
        for c in &parts {
            sets.push((c.meta.program.clone(), c.clone()));
        }
    }
    if parts.len() > 1 {
        sets.push(("mix".into(), Corpus::mix(&parts)));
    }
    let zram_state =
        if args.no_zram { Err("not requested".to_owned()) } else { tmem_sys::zram::check_available("zram0") };
    if let Err(why) = &zram_state {
        if !args.json {
            eprintln!("zram comparison skipped: {why}");
        }
    }
    let mut results = Vec::new();
    for (name, corpus) in &sets {
        let mut rows = Vec::new();
        for spec in &specs {
            rows.push(bench_tmem(corpus, spec, threads, args.rounds, args.dict_size)?);
        }
        if zram_state.is_ok() {
            for alg in &args.zram {
                rows.push(bench_zram(corpus, alg, threads)?);
            }
        }
        let r = CorpusResult {
            corpus: name.clone(),
            pages: corpus.page_count(),
            rows,
            zram_skipped: zram_state.clone().err(),
        };
        if !args.json {
            print_table(&r);
        }
        results.push(r);
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&results).map_err(|e| e.to_string())?);
    }
    Ok(())
}

fn build_store(corpus: &Corpus, spec: &CodecSpec, dict_size: usize) -> Result<Store, String> {
    let codec = if spec.choice.dictionary {
        let sample = corpus.pages().step_by(16);
        let dict = train_dictionary(sample, dict_size).map_err(|e| e.to_string())?;
        spec.choice.codec.with_dictionary(dict)
    } else {
        spec.choice.codec.clone()
    };
    // Like zram: keep every page, storing poorly compressible ones raw.
    let policy = PolicyConfig { incompressible: Incompressible::StoreRaw, ..Default::default() };
    StoreConfig { policy, codec: Some(codec), ..Default::default() }.build().map_err(|e| e.to_string())
}

fn key(i: usize) -> Key {
    Key::new(0, i as u64)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn bench_tmem(
    corpus: &Corpus,
    spec: &CodecSpec,
    threads: usize,
    rounds: usize,
    dict_size: usize,
) -> Result<Row, String> {
    let n = corpus.page_count();
    if n == 0 {
        return Err("corpus has no pages".into());
    }
    let bytes = (n * PAGE_SIZE) as f64;
    // Filled so that its pages are faulted in before any timed region.
    let mut out = vec![1u8; n * PAGE_SIZE];
    let mut put1 = Vec::new();
    let mut get1 = Vec::new();
    let mut putm = Vec::new();
    let mut getm = Vec::new();
    let mut stats = None;
    for _ in 0..rounds {
        // One thread.
        let store = build_store(corpus, spec, dict_size)?;
        let pool = store.create_pool(tmem_core::PoolConfig::persistent());
        let t = Instant::now();
        for (i, p) in corpus.pages().enumerate() {
            expect_stored(pool.put(key(i), p), i)?;
        }
        put1.push(bytes / t.elapsed().as_secs_f64() / 1e6);
        stats.get_or_insert_with(|| store.stats());
        let t = Instant::now();
        for (i, o) in out.as_chunks_mut::<PAGE_SIZE>().0.iter_mut().enumerate() {
            expect_hit(pool.get(key(i), o), i)?;
        }
        get1.push(bytes / t.elapsed().as_secs_f64() / 1e6);
        verify(corpus, &out)?;
        drop(pool);
        drop(store);
        out.fill(0);

        // All threads, disjoint ranges.
        let store = build_store(corpus, spec, dict_size)?;
        let pool = store.create_pool(tmem_core::PoolConfig::persistent());
        let chunk = n.div_ceil(threads);
        let (secs, res) = timed_parallel(threads, |t| {
            let pool = Arc::clone(&pool);
            move || -> Result<(), String> {
                for i in (t * chunk)..((t + 1) * chunk).min(n) {
                    expect_stored(pool.put(key(i), corpus.page(i)), i)?;
                }
                Ok(())
            }
        });
        res?;
        putm.push(bytes / secs / 1e6);
        let outs: Vec<&mut [u8]> = out.chunks_mut(chunk * PAGE_SIZE).collect();
        let slots: Vec<std::sync::Mutex<Option<&mut [u8]>>> =
            outs.into_iter().map(|o| std::sync::Mutex::new(Some(o))).collect();
        let (secs, res) = timed_parallel(threads, |t| {
            let pool = Arc::clone(&pool);
            let mine = slots.get(t).and_then(|m| m.lock().ok()?.take());
            move || -> Result<(), String> {
                let Some(mine) = mine else { return Ok(()) };
                for (j, o) in mine.as_chunks_mut::<PAGE_SIZE>().0.iter_mut().enumerate() {
                    let i = t * chunk + j;
                    expect_hit(pool.get(key(i), o), i)?;
                }
                Ok(())
            }
        });
        res?;
        getm.push(bytes / secs / 1e6);
        verify(corpus, &out)?;
        out.fill(0);
    }
    let st = stats.expect("at least one round");
    Ok(Row {
        backend: format!("tmem {}", spec.label),
        pages: n as u64,
        orig_bytes: st.total.orig_data_size,
        compr_data_size: st.total.compr_data_size,
        mem_used_total: st.mem_used_total,
        ratio: st.ratio,
        put_mbs_1t: median(put1),
        get_mbs_1t: median(get1),
        put_mbs_mt: median(putm),
        get_mbs_mt: median(getm),
        threads,
        same_filled_pages: st.total.same_filled_pages,
        incompressible_pages: st.total.stored_incompressible_pages,
        metadata_bytes: Some(st.metadata_bytes),
    })
}

/// Runs `make(t)()` on `threads` threads started together; returns wall seconds.
fn timed_parallel<'a, F, G>(threads: usize, make: G) -> (f64, Result<(), String>)
where
    G: Fn(usize) -> F,
    F: FnOnce() -> Result<(), String> + Send + 'a,
{
    let barrier = std::sync::Barrier::new(threads + 1);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let f = make(t);
                let barrier = &barrier;
                s.spawn(move || {
                    barrier.wait();
                    f()
                })
            })
            .collect();
        barrier.wait();
        let start = Instant::now();
        let mut res = Ok(());
        for h in handles {
            let r = h.join().unwrap_or_else(|_| Err("benchmark thread panicked".into()));
            res = res.and(r);
        }
        (start.elapsed().as_secs_f64(), res)
    })
}

fn expect_stored(r: Result<PutOutcome, tmem_core::StoreError>, i: usize) -> Result<(), String> {
    match r {
        Ok(PutOutcome::Stored) => Ok(()),
        Ok(PutOutcome::Rejected(why)) => Err(format!("page {i} was refused: {why:?}")),
        Err(e) => Err(format!("page {i}: {e}")),
    }
}

fn expect_hit(r: Result<GetOutcome, tmem_core::StoreError>, i: usize) -> Result<(), String> {
    match r {
        Ok(GetOutcome::Hit) => Ok(()),
        Ok(GetOutcome::Miss) => Err(format!("page {i} is missing")),
        Err(e) => Err(format!("page {i}: {e}")),
    }
}

fn verify(corpus: &Corpus, out: &[u8]) -> Result<(), String> {
    if let Some(pos) = corpus.data().iter().zip(out).position(|(a, b)| a != b) {
        return Err(format!("page {} came back different (byte {})", pos / PAGE_SIZE, pos % PAGE_SIZE));
    }
    Ok(())
}

fn bench_zram(corpus: &Corpus, alg: &str, threads: usize) -> Result<Row, String> {
    let r = tmem_sys::zram::bench("zram0", corpus.data(), alg, threads).map_err(|e| format!("zram {alg}: {e}"))?;
    let bytes = r.bytes() as f64;
    Ok(Row {
        backend: format!("zram {alg}"),
        pages: r.pages,
        orig_bytes: r.mm_stat.orig_data_size,
        compr_data_size: r.mm_stat.compr_data_size,
        mem_used_total: r.mm_stat.mem_used_total,
        ratio: r.ratio(),
        put_mbs_1t: bytes / r.put_secs_1t / 1e6,
        get_mbs_1t: bytes / r.get_secs_1t / 1e6,
        put_mbs_mt: bytes / r.put_secs_mt / 1e6,
        get_mbs_mt: bytes / r.get_secs_mt / 1e6,
        threads: r.threads,
        same_filled_pages: r.mm_stat.same_pages,
        incompressible_pages: r.mm_stat.huge_pages,
        metadata_bytes: None,
    })
}

fn print_table(r: &CorpusResult) {
    println!();
    println!("corpus {}: {} pages ({:.1} MiB)", r.corpus, r.pages, (r.pages * PAGE_SIZE) as f64 / 1048576.0);
    let threads = r.rows.first().map_or(1, |row| row.threads);
    println!(
        "{:<18} {:>6} {:>11} {:>9} {:>8} {:>8} {:>8} {:>8} {:>7} {:>7}",
        "backend",
        "ratio",
        "mem_used",
        "vs zram",
        "put 1T",
        "get 1T",
        format!("put {threads}T"),
        format!("get {threads}T"),
        "same",
        "huge"
    );
    let zram_lz4 = r.rows.iter().find(|row| row.backend == "zram lz4").map(|row| row.mem_used_total);
    for row in &r.rows {
        let vs = zram_lz4.map_or_else(
            || "-".to_owned(),
            |z| format!("{:+.1}%", (row.mem_used_total as f64 / z as f64 - 1.0) * 100.0),
        );
        println!(
            "{:<18} {:>6.3} {:>7.2} MiB {:>9} {:>8.0} {:>8.0} {:>8.0} {:>8.0} {:>7} {:>7}",
            row.backend,
            row.ratio,
            row.mem_used_total as f64 / 1048576.0,
            vs,
            row.put_mbs_1t,
            row.get_mbs_1t,
            row.put_mbs_mt,
            row.get_mbs_mt,
            row.same_filled_pages,
            row.incompressible_pages
        );
    }
    println!("(throughput in MB/s of original data; \"vs zram\" is pool memory relative to zram lz4's mem_used_total)");
    if let Some(why) = &r.zram_skipped {
        println!("(zram not measured: {why})");
    }
}
