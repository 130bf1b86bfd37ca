//! `tmem bench store`: the store against kernel zram on the same real pages.
//!
//! For every corpus (and their mix) and every codec, a fresh store receives
//! every page from one thread, then returns every page to one thread; the same
//! is repeated with all threads on disjoint key ranges. Every page read back is
//! compared with the original. Pool memory is the store's `mem_used_total`
//! (spans plus all metadata) after putting every page once, against zram's
//! `mem_used_total` for the same pages. Throughput is original bytes per
//! second (MB = 10^6 bytes), the median of `--rounds` runs; next to it, the
//! CPU time this process used per page over the same timed section (user +
//! system, all threads; for zram that is mostly the kernel compressing and
//! decompressing in the system time of the threads that write and read).
//!
//! Every figure is timed over at least 64 MiB of pages or 200 ms
//! ([`crate::zram::Budget`]): the corpus is repeated, under fresh keys for
//! puts, as many times as needed inside the timed section, so that small
//! corpora do not give figures timed over a few microseconds. zram runs on a
//! device hot-added for it and removed afterwards.
//!
//! The stores are built as the daemon builds its own: pages in a memfd
//! (`StoreConfig::shared_memory`), so a put pays what the daemon's puts pay
//! for fresh pool memory. Below the table, each tmem row's single-thread put
//! is split into its stages (`store/breakdown.rs`).
//!
//! Dictionaries ("+dict") are trained on a 1-in-16 sample of the corpus being
//! measured, as a daemon would train on the first pages it sees; the
//! dictionary's memory is part of the pool memory.
//!
//! A codec written `FAST>DENSE` (e.g. `lz4>zstd:1+dict`) measures background
//! recompression: puts use FAST; then, untimed, recompression passes move
//! every page to DENSE (its dictionary trained on the pool), as they would
//! once the pages have gone unread; pool memory and gets are measured after
//! that. The row also gives the CPU recompression spent per page moved.

mod breakdown;

use anyhow::anyhow;

use crate::median;
use crate::progress::Progress;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::zram::{Budget, TimedPhase};
use breakdown::PutBreakdown;
use tmem_core::codec::{train_dictionary, CodecChoice};
use tmem_core::{
    CodecConfig, DictTraining, GetOutcome, Incompressible, Key, PolicyConfig, PutOutcome, RecompressConfig, Store,
    StoreConfig, PAGE_SIZE,
};
use tmem_corpus::Corpus;
use tmem_sys::vmstat::{CpuMark, CpuSpent};

/// Arguments of `tmem bench store`.
#[derive(clap::Args, Debug)]
pub struct StoreBenchArgs {
    /// Corpus files (default: the built-in corpora). Each is measured alone and all together as "mix".
    #[arg(long = "corpus", num_args = 1..)]
    corpora: Vec<PathBuf>,
    /// Codecs to measure: lz4, zstd, zstd:LEVEL, with "+dict" for a trained dictionary;
    /// FAST>DENSE puts with FAST and recompresses every page to DENSE before measuring memory and gets.
    #[arg(long, value_delimiter = ',', default_value = "lz4,zstd:1,zstd:3+dict,zstd:9+dict,lz4>zstd:1+dict")]
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
    /// Draw pool ratio and single-thread put/get MB/s per codec, beside zram, for the
    /// last corpus measured (the mix when there are several) into this PNG (or .svg) file.
    #[arg(long)]
    plot: Option<PathBuf>,
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
    /// The timed figures.
    #[serde(flatten)]
    timings: Timings,
    threads: usize,
    same_filled_pages: u64,
    incompressible_pages: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    metadata_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    zram_device: Option<String>,
    /// `FAST>DENSE` rows: CPU time (user + system) recompression spent per
    /// page it moved, µs, and the pages it moved.
    #[serde(skip_serializing_if = "Option::is_none")]
    recompress_cpu_us_per_page: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    recompressed_pages: Option<u64>,
    /// tmem rows: CPU µs per page of each stage of a put, one thread
    /// (`store/breakdown.rs`).
    #[serde(skip_serializing_if = "Option::is_none")]
    put_breakdown: Option<PutBreakdown>,
}

/// The timed figures of a row.
#[derive(Debug, Clone, Default, serde::Serialize)]
struct Timings {
    /// MB/s; `None` (null) where a figure was timed over too little work.
    put_mbs_1t: Option<f64>,
    get_mbs_1t: Option<f64>,
    put_mbs_mt: Option<f64>,
    get_mbs_mt: Option<f64>,
    /// CPU time of this process (user + system, all threads) per page over
    /// the same timed sections, µs.
    put_cpu_us_per_page_1t: Option<f64>,
    get_cpu_us_per_page_1t: Option<f64>,
    put_cpu_us_per_page_mt: Option<f64>,
    get_cpu_us_per_page_mt: Option<f64>,
    /// Busy CPU time of the whole machine (`/proc/stat`, other load on the
    /// machine included) per page over the same sections, µs.
    put_machine_busy_us_per_page_1t: Option<f64>,
    get_machine_busy_us_per_page_1t: Option<f64>,
    put_machine_busy_us_per_page_mt: Option<f64>,
    get_machine_busy_us_per_page_mt: Option<f64>,
    /// Pages each figure was timed over (put 1T, get 1T, put MT, get MT; first round).
    timed_pages: [u64; 4],
}

/// The timed figures of a row: put 1T, get 1T, put MT, get MT, per round.
type Rounds = Vec<[TimedPhase; 4]>;

/// Medians over the rounds that have the figure.
fn medians(rounds: &[[TimedPhase; 4]], f: impl Fn(&TimedPhase) -> Option<f64>) -> [Option<f64>; 4] {
    std::array::from_fn(|i| median(rounds.iter().filter_map(|r| f(&r[i])).collect()))
}

/// Fills the timed figures of `row` from `rounds`.
fn set_figures(row: &mut Row, rounds: &[[TimedPhase; 4]]) {
    [row.timings.put_mbs_1t, row.timings.get_mbs_1t, row.timings.put_mbs_mt, row.timings.get_mbs_mt] =
        medians(rounds, TimedPhase::mb_per_sec);
    [
        row.timings.put_cpu_us_per_page_1t,
        row.timings.get_cpu_us_per_page_1t,
        row.timings.put_cpu_us_per_page_mt,
        row.timings.get_cpu_us_per_page_mt,
    ] = medians(rounds, TimedPhase::cpu_us_per_page);
    [
        row.timings.put_machine_busy_us_per_page_1t,
        row.timings.get_machine_busy_us_per_page_1t,
        row.timings.put_machine_busy_us_per_page_mt,
        row.timings.get_machine_busy_us_per_page_mt,
    ] = medians(rounds, TimedPhase::machine_busy_us_per_page);
    if let Some(first) = rounds.first() {
        row.timings.timed_pages = first.map(|p| p.pages);
    }
}

#[derive(Debug, serde::Serialize)]
struct CorpusResult {
    corpus: String,
    pages: usize,
    rows: Vec<Row>,
    #[serde(skip_serializing_if = "Option::is_none")]
    zram_skipped: Option<String>,
    /// CPU time the hypervisor gave to other guests while this corpus's
    /// rows were measured, percent of all CPU time.
    cpu_steal_percent: f64,
}

struct CodecSpec {
    label: String,
    choice: CodecChoice,
    /// `FAST>DENSE`: recompression to DENSE after the puts.
    recompress: Option<RecompressConfig>,
}

fn parse_codec(s: &str, dict_size: usize) -> anyhow::Result<CodecSpec> {
    let (fast, dense) = match s.split_once('>') {
        Some((f, d)) => (f, Some(d)),
        None => (s, None),
    };
    let recompress = dense
        .map(|d| -> anyhow::Result<RecompressConfig> {
            let mut r = RecompressConfig::parse(d)?;
            // Train on whatever the pool holds: corpora may be small.
            r.dictionary = r.dictionary.map(|_| DictTraining {
                after_bytes: 0,
                sample_pages: 2048,
                dict_bytes: dict_size,
                max_dictionaries: 1,
            });
            r.codec.build()?;
            Ok(r)
        })
        .transpose()
        .map_err(|e| anyhow!("codec {s:?}: {e}"))?;
    Ok(CodecSpec { label: s.to_owned(), choice: CodecChoice::parse(fast)?, recompress })
}

/// `FAST>DENSE` rows: recompresses every page of `store` now (one pass
/// trains the dictionary and marks the pages unread, the next moves them),
/// then compacts, as the daemon's automatic compaction would in time.
/// Returns the CPU the moving pass took and the pages it moved.
fn recompress_all(store: &Store, spec: &CodecSpec) -> anyhow::Result<Option<(CpuSpent, u64)>> {
    let Some(cfg) = &spec.recompress else { return Ok(None) };
    let mut r = store.recompression(cfg.clone())?;
    r.pass();
    let mark = CpuMark::now();
    r.pass();
    let spent = mark.spent();
    if let Some(status) = store.stats().recompression.filter(|s| s.starts_with("failed")) {
        return Err(anyhow!("{}: recompression {status}", spec.label));
    }
    store.compact();
    Ok(Some((spent, store.stats().total.recompressed_pages)))
}

/// Runs the benchmark and prints tables or JSON.
pub fn run_store(args: &StoreBenchArgs) -> anyhow::Result<()> {
    let specs: Vec<CodecSpec> = args.codecs.iter().map(|s| parse_codec(s, args.dict_size)).collect::<Result<_, _>>()?;
    if args.rounds == 0 {
        return Err(anyhow!("--rounds must be at least 1"));
    }
    let threads = args.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from)).max(1);
    let parts: Vec<Corpus> = if args.corpora.is_empty() {
        Corpus::builtin()
    } else {
        args.corpora.iter().map(|p| Corpus::read(p)).collect::<Result<_, _>>()?
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
    // Hot-adds a zram device and removes it again: can zram be measured here?
    let zram_state = if args.no_zram {
        Err("not requested".to_owned())
    } else {
        crate::zram::probe().map(drop).map_err(|e| e.to_string())
    };
    if let Err(why) = &zram_state {
        tracing::warn!("zram comparison skipped: {why}");
    }
    let zram_algs: &[String] = if zram_state.is_ok() { &args.zram } else { &[] };
    let steps = sets.len() * (specs.len() + zram_algs.len());
    let progress = if args.json { Progress::hidden() } else { Progress::new(steps) };
    let mut results = Vec::new();
    for (name, corpus) in &sets {
        let cpu_before = tmem_sys::vmstat::CpuTimes::now();
        let mut rows = Vec::new();
        for spec in &specs {
            progress.show(&format!("{name}: tmem {}", spec.label), false);
            rows.push(bench_tmem(corpus, spec, threads, args.rounds, args.dict_size)?);
            progress.steps_done(1);
        }
        for alg in zram_algs {
            progress.show(&format!("{name}: zram {alg}"), false);
            rows.push(bench_zram(corpus, alg, threads)?);
            progress.steps_done(1);
        }
        let r = CorpusResult {
            corpus: name.clone(),
            pages: corpus.page_count(),
            rows,
            zram_skipped: zram_state.clone().err(),
            cpu_steal_percent: tmem_sys::vmstat::CpuTimes::steal_percent_from(cpu_before),
        };
        if !args.json {
            progress.suspend(|| print_table(&r));
        }
        results.push(r);
    }
    progress.finish();
    if let (Some(path), Some(last)) = (&args.plot, results.last()) {
        plot(path, last)?;
        if !args.json {
            println!("figures: {}", path.display());
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&results)?);
    }
    Ok(())
}

/// The codec a row puts with ("+dict": a dictionary trained on a 1-in-16
/// sample of the corpus).
fn put_codec(corpus: &Corpus, spec: &CodecSpec, dict_size: usize) -> anyhow::Result<CodecConfig> {
    Ok(if spec.choice.dictionary {
        let sample = corpus.pages().step_by(16);
        let dict = train_dictionary(sample, dict_size)?;
        spec.choice.codec.with_dictionary(dict)
    } else {
        spec.choice.codec.clone()
    })
}

/// The policy of the bench's stores: like zram, keep every page, storing
/// poorly compressible ones raw.
fn store_policy() -> PolicyConfig {
    PolicyConfig { incompressible: Incompressible::StoreRaw, ..Default::default() }
}

/// A store as the daemon builds one: its pages in a memfd (`shared_memory`,
/// which a restart hands over), putting with `codec`.
fn build_store(codec: &CodecConfig) -> anyhow::Result<Store> {
    let cfg =
        StoreConfig { policy: store_policy(), codec: Some(codec.clone()), shared_memory: true, ..Default::default() };
    Ok(cfg.build()?)
}

/// Key of page `i` of copy `copy` of a corpus of `n` pages.
fn key(copy: usize, n: usize, i: usize) -> Key {
    Key::new(0, (copy * n + i) as u64)
}

/// A timed section of `pages` pages that started at `start` and `mark`.
fn phase(pages: usize, start: Instant, mark: &CpuMark) -> TimedPhase {
    TimedPhase { pages: pages as u64, secs: start.elapsed().as_secs_f64(), cpu: mark.spent() }
}

fn bench_tmem(
    corpus: &Corpus,
    spec: &CodecSpec,
    threads: usize,
    rounds: usize,
    dict_size: usize,
) -> anyhow::Result<Row> {
    let n = corpus.page_count();
    if n == 0 {
        return Err(anyhow!("corpus has no pages"));
    }
    let codec = put_codec(corpus, spec, dict_size)?;
    // Memory figures: every page once, untimed.
    let st = {
        let store = build_store(&codec)?;
        let pool = store.create_pool(tmem_core::PoolConfig::persistent());
        for (i, p) in corpus.pages().enumerate() {
            expect_stored(pool.put(key(0, n, i), p), i)?;
        }
        (store.stats(), recompress_all(&store, spec)?.map(|r| (r, store.stats())))
    };
    let (st, recompressed) = match st {
        (_, Some(((cpu, moved), after))) => (after, Some((cpu, moved))),
        (st, None) => (st, None),
    };
    // Room for every copy a timed section may get back; filled so that its
    // pages are faulted in before any timed region.
    let mut out = vec![1u8; Budget::copies_for(n * PAGE_SIZE) * n * PAGE_SIZE];
    let mut all: Rounds = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        all.push(tmem_round(corpus, spec, &codec, threads, &mut out)?);
    }
    // One run: its stages are timed with the thread's own CPU clock.
    let stages = breakdown::measure(corpus, &codec)?;
    let mut row = Row {
        backend: format!("tmem {}", spec.label),
        pages: n as u64,
        orig_bytes: st.total.orig_data_size,
        compr_data_size: st.total.compr_data_size,
        mem_used_total: st.mem_used_total,
        ratio: st.ratio,
        timings: Timings::default(),
        threads,
        same_filled_pages: st.total.same_filled_pages,
        incompressible_pages: st.total.stored_incompressible_pages,
        metadata_bytes: Some(st.metadata_bytes),
        zram_device: None,
        // Timed over enough work only (as every figure: crate::zram::Budget).
        recompress_cpu_us_per_page: recompressed.and_then(|(cpu, moved)| {
            let secs = cpu.process.total_secs();
            (moved > 0 && (moved >= 16_384 || secs >= 0.2)).then(|| secs * 1e6 / moved as f64)
        }),
        recompressed_pages: recompressed.map(|(_, moved)| moved),
        put_breakdown: Some(stages),
    };
    set_figures(&mut row, &all);
    Ok(row)
}

/// One round of the four timed figures on fresh stores. Puts store copies
/// of the corpus under fresh keys until the section has done enough
/// ([`Budget`]); gets read those copies back, round and round, into `out`
/// (room for every copy), verified afterwards.
fn tmem_round(
    corpus: &Corpus,
    spec: &CodecSpec,
    codec: &CodecConfig,
    threads: usize,
    out: &mut [u8],
) -> anyhow::Result<[TimedPhase; 4]> {
    let n = corpus.page_count();
    let len = n * PAGE_SIZE;
    let copies = out.len() / len;

    // One thread.
    let store = build_store(codec)?;
    let pool = store.create_pool(tmem_core::PoolConfig::persistent());
    let budget = Budget::new();
    budget.begin();
    let (mark, t) = (CpuMark::now(), Instant::now());
    let mut written = 0;
    loop {
        for (i, p) in corpus.pages().enumerate() {
            expect_stored(pool.put(key(written, n, i), p), i)?;
        }
        written += 1;
        if written == copies || budget.add(len as u64) {
            break;
        }
    }
    let put1 = phase(written * n, t, &mark);
    recompress_all(&store, spec)?;
    let budget = Budget::new();
    budget.begin();
    let (mark, t) = (CpuMark::now(), Instant::now());
    let mut reads = 0;
    loop {
        let c = reads % written;
        for (i, o) in out[c * len..(c + 1) * len].as_chunks_mut::<PAGE_SIZE>().0.iter_mut().enumerate() {
            expect_hit(pool.get(key(c, n, i), o), i)?;
        }
        reads += 1;
        if budget.add(len as u64) {
            break;
        }
    }
    let get1 = phase(reads * n, t, &mark);
    for copy in out[..reads.min(written) * len].chunks(len) {
        verify(corpus.data(), copy, 0)?;
    }
    out.fill(0);
    drop(pool);
    drop(store);

    // All threads, disjoint page ranges of every copy.
    let store = build_store(codec)?;
    let pool = store.create_pool(tmem_core::PoolConfig::persistent());
    let chunk = n.div_ceil(threads);
    let range = |t: usize| (t * chunk).min(n)..((t + 1) * chunk).min(n);
    let budget = Budget::new();
    let (secs, cpu, res) = timed_parallel(threads, |t| {
        let (pool, budget, r) = (Arc::clone(&pool), &budget, range(t));
        move || -> anyhow::Result<usize> {
            if r.is_empty() {
                return Ok(0);
            }
            budget.begin();
            let mut done = 0;
            loop {
                for i in r.clone() {
                    expect_stored(pool.put(key(done, n, i), corpus.page(i)), i)?;
                }
                done += 1;
                if done == copies || budget.add((r.len() * PAGE_SIZE) as u64) {
                    return Ok(done);
                }
            }
        }
    });
    let written_by = res?;
    let putm = timed(written_by.iter().enumerate().map(|(t, w)| range(t).len() * w).sum(), secs, cpu);
    recompress_all(&store, spec)?;

    // Thread t gets its range of every copy it put, into the same place of `out`.
    let mut mine: Vec<Vec<&mut [u8]>> = (0..threads).map(|_| Vec::with_capacity(copies)).collect();
    for copy in out.chunks_mut(len) {
        let mut rest = copy;
        for (t, slices) in mine.iter_mut().enumerate() {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(range(t).len() * PAGE_SIZE);
            slices.push(head);
            rest = tail;
        }
    }
    let slots: Vec<Mutex<Option<Vec<&mut [u8]>>>> = mine.into_iter().map(|m| Mutex::new(Some(m))).collect();
    let budget = Budget::new();
    let (secs, cpu, res) = timed_parallel(threads, |t| {
        let (pool, budget, r, w) = (Arc::clone(&pool), &budget, range(t), written_by[t]);
        let mut mine = slots[t].lock().ok().and_then(|mut m| m.take()).unwrap_or_default();
        move || -> anyhow::Result<usize> {
            if r.is_empty() || w == 0 {
                return Ok(0);
            }
            budget.begin();
            let mut reads = 0;
            loop {
                let c = reads % w;
                for (j, o) in mine[c].as_chunks_mut::<PAGE_SIZE>().0.iter_mut().enumerate() {
                    expect_hit(pool.get(key(c, n, r.start + j), o), r.start + j)?;
                }
                reads += 1;
                if budget.add((r.len() * PAGE_SIZE) as u64) {
                    return Ok(reads);
                }
            }
        }
    });
    drop(slots);
    let reads_by = res?;
    let getm = timed(reads_by.iter().enumerate().map(|(t, r)| range(t).len() * r).sum(), secs, cpu);
    for (t, (&w, &r)) in written_by.iter().zip(&reads_by).enumerate() {
        let pages = range(t);
        let want = &corpus.data()[pages.start * PAGE_SIZE..pages.end * PAGE_SIZE];
        for c in 0..r.min(w) {
            let at = c * len + pages.start * PAGE_SIZE;
            verify(want, &out[at..at + want.len()], pages.start)?;
        }
    }
    out.fill(0);
    Ok([put1, get1, putm, getm])
}

fn timed(pages: usize, secs: f64, cpu: CpuSpent) -> TimedPhase {
    TimedPhase { pages: pages as u64, secs, cpu }
}

/// Runs `make(t)()` on `threads` threads started together; returns wall
/// seconds, the CPU used meanwhile and every thread's result, in order.
fn timed_parallel<'a, F, G, R>(threads: usize, make: G) -> (f64, CpuSpent, anyhow::Result<Vec<R>>)
where
    G: Fn(usize) -> F,
    F: FnOnce() -> anyhow::Result<R> + Send + 'a,
    R: Send,
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
        // The threads wait at the barrier, using no CPU.
        let mark = CpuMark::now();
        barrier.wait();
        let start = Instant::now();
        let mut res = Ok(Vec::with_capacity(threads));
        for h in handles {
            let r = h.join().unwrap_or_else(|_| Err(anyhow!("benchmark thread panicked")));
            res = res.and_then(|mut v: Vec<R>| {
                v.push(r?);
                Ok(v)
            });
        }
        (start.elapsed().as_secs_f64(), mark.spent(), res)
    })
}

fn expect_stored(r: Result<PutOutcome, tmem_core::StoreError>, i: usize) -> anyhow::Result<()> {
    match r {
        Ok(PutOutcome::Stored) => Ok(()),
        Ok(PutOutcome::Rejected(why)) => Err(anyhow!("page {i} was refused: {why:?}")),
        Err(e) => Err(anyhow!("page {i}: {e}")),
    }
}

fn expect_hit(r: Result<GetOutcome, tmem_core::StoreError>, i: usize) -> anyhow::Result<()> {
    match r {
        Ok(GetOutcome::Hit) => Ok(()),
        Ok(GetOutcome::Miss) => Err(anyhow!("page {i} is missing")),
        Err(e) => Err(anyhow!("page {i}: {e}")),
    }
}

/// Compares pages that came back with the corpus pages `want`, the first of which is page `first`.
fn verify(want: &[u8], got: &[u8], first: usize) -> anyhow::Result<()> {
    if let Some(pos) = want.iter().zip(got).position(|(a, b)| a != b) {
        return Err(anyhow!("page {} came back different (byte {})", first + pos / PAGE_SIZE, pos % PAGE_SIZE));
    }
    Ok(())
}

fn bench_zram(corpus: &Corpus, alg: &str, threads: usize) -> anyhow::Result<Row> {
    let r = crate::zram::bench(corpus.data(), alg, threads).map_err(|e| anyhow!("zram {alg}: {e}"))?;
    let mut row = Row {
        backend: format!("zram {alg}"),
        pages: r.pages,
        orig_bytes: r.mm_stat.orig_data_size,
        compr_data_size: r.mm_stat.compr_data_size,
        mem_used_total: r.mm_stat.mem_used_total,
        ratio: r.ratio(),
        timings: Timings::default(),
        threads: r.threads,
        same_filled_pages: r.mm_stat.same_pages,
        incompressible_pages: r.mm_stat.huge_pages,
        metadata_bytes: None,
        zram_device: Some(r.device.clone()),
        recompress_cpu_us_per_page: None,
        recompressed_pages: None,
        put_breakdown: None,
    };
    set_figures(&mut row, &[[r.put_1t, r.get_1t, r.put_mt, r.get_mt]]);
    Ok(row)
}

/// MB/s and CPU µs per page, or "n/a".
fn figure(mbs: Option<f64>, us: Option<f64>) -> [String; 2] {
    [
        mbs.map_or_else(|| "n/a".to_owned(), |v| format!("{v:.0}")),
        us.map_or_else(|| "n/a".to_owned(), |v| format!("{v:.2}")),
    ]
}

/// Ratio and single-thread MB/s of every row of `r`, as bars.
fn plot(path: &std::path::Path, r: &CorpusResult) -> anyhow::Result<()> {
    use crate::plot::{Bars, Figure};
    let bars = |title: &str, y: &str, f: fn(&Row) -> Option<f64>| {
        Figure::Bars(Bars {
            title: title.into(),
            y_label: y.into(),
            bars: r.rows.iter().filter_map(|row| Some((row.backend.clone(), f(row)?))).collect(),
        })
    };
    let figures = [
        bars("pool ratio (original / pool memory)", "x", |row| Some(row.ratio)),
        bars("put, 1 thread", "MB/s", |row| row.timings.put_mbs_1t),
        bars("get, 1 thread", "MB/s", |row| row.timings.get_mbs_1t),
    ];
    let caption = format!("tmem bench store: corpus {} ({} pages)", r.corpus, r.pages);
    crate::plot::draw(path, &caption, &figures)
}

fn print_table(r: &CorpusResult) {
    println!();
    println!(
        "corpus {}: {} pages ({:.1} MiB); CPU steal during its rows {:.1}%",
        r.corpus,
        r.pages,
        (r.pages * PAGE_SIZE) as f64 / 1048576.0,
        r.cpu_steal_percent
    );
    let threads = r.rows.first().map_or(1, |row| row.threads);
    let mut t = crate::table::plain([
        "backend".to_owned(),
        "ratio".into(),
        "mem_used".into(),
        "vs zram".into(),
        "put 1T".into(),
        "us/pg".into(),
        "get 1T".into(),
        "us/pg".into(),
        format!("put {threads}T"),
        "us/pg".into(),
        format!("get {threads}T"),
        "us/pg".into(),
        "same".into(),
        "huge".into(),
    ]);
    let zram_lz4 = r.rows.iter().find(|row| row.backend == "zram lz4").map(|row| row.mem_used_total);
    for row in &r.rows {
        let vs = zram_lz4.map_or_else(
            || "-".to_owned(),
            |z| format!("{:+.1}%", (row.mem_used_total as f64 / z as f64 - 1.0) * 100.0),
        );
        let mut cells = vec![
            row.backend.clone(),
            format!("{:.3}", row.ratio),
            format!("{:.2} MiB", row.mem_used_total as f64 / 1048576.0),
            vs,
        ];
        let tm = &row.timings;
        for (mbs, us) in [
            (tm.put_mbs_1t, tm.put_cpu_us_per_page_1t),
            (tm.get_mbs_1t, tm.get_cpu_us_per_page_1t),
            (tm.put_mbs_mt, tm.put_cpu_us_per_page_mt),
            (tm.get_mbs_mt, tm.get_cpu_us_per_page_mt),
        ] {
            cells.extend(figure(mbs, us));
        }
        cells.extend([row.same_filled_pages.to_string(), row.incompressible_pages.to_string()]);
        t.add_row(cells);
    }
    println!("{t}");
    println!(
        "(MB/s of original data; us/pg: CPU time of this process (user + system, all threads) per page over the same \
         timed section: for tmem the store's work, for zram mostly the kernel's compression and decompression, done \
         in the system time of the threads writing and reading the device; JSON adds the whole machine's busy time per \
         page. Each figure timed over at least {} MiB of pages or {} ms, the corpus repeated as needed; n/a: {}. \
         \"vs zram\" is pool memory relative to zram lz4's mem_used_total)",
        crate::zram::MIN_TIMED_BYTES >> 20,
        crate::zram::MIN_TIMED.as_millis(),
        Budget::reason()
    );
    for row in r.rows.iter().filter(|row| row.recompressed_pages.is_some()) {
        println!(
            "({}: puts with the first codec; then background recompression moved {} pages to the second, {}; \
             ratio, memory (after a compaction) and gets are after that)",
            row.backend,
            row.recompressed_pages.unwrap_or(0),
            row.recompress_cpu_us_per_page
                .map_or_else(|| "too few to time".to_owned(), |us| format!("{us:.1} us of CPU per page")),
        );
    }
    if let Some(why) = &r.zram_skipped {
        println!("(zram not measured: {why})");
    }
    print_breakdown(r);
}

/// Where each tmem row's put goes, beside zram's whole put.
fn print_breakdown(r: &CorpusResult) {
    let rows: Vec<(&Row, PutBreakdown)> = r.rows.iter().filter_map(|row| Some((row, row.put_breakdown?))).collect();
    if rows.is_empty() {
        return;
    }
    let mut t = crate::table::plain([
        "put, 1 thread".to_owned(),
        "scan".into(),
        "compress".into(),
        "checksum".into(),
        "allocate".into(),
        "index, rest".into(),
        "put".into(),
    ]);
    for (row, b) in &rows {
        let mut cells = vec![row.backend.clone()];
        cells.extend(
            [b.scan_us, b.compress_us, b.checksum_us, b.allocate_us, b.rest_us(), b.put_us]
                .map(|us| format!("{us:.2}")),
        );
        t.add_row(cells);
    }
    for row in r.rows.iter().filter(|row| row.backend.starts_with("zram")) {
        let put = row.timings.put_cpu_us_per_page_1t.map_or_else(|| "n/a".to_owned(), |us| format!("{us:.2}"));
        t.add_row([row.backend.clone(), "".into(), "".into(), "".into(), "".into(), "".into(), put]);
    }
    println!("{t}");
    println!(
        "(CPU us per page put, one thread, each stage timed alone over the same pages with the thread's CPU clock, \
         for at least {} ms: scan for a repeated word; compress (pages that are not one repeated word); CRC32 of the \
         stored bytes; allocate a slot and copy into it, page faults of fresh memfd spans included; \
         \"index, rest\" is the whole put less those. zram's row is its whole put from the table above.)",
        breakdown::MIN_STAGE.as_millis()
    );
}
