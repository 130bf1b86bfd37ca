//! `tmem bench tier`: put/get pages per second, latency and bytes on the
//! wire for each tier on loopback.
//!
//! Values are what writeback sends: pages of the built-in corpus (or
//! `--corpus`), compressed with lz4 and sealed. For each tier: batched puts
//! (`put_batch` of `--batch` values) and batched gets over all pages, then
//! single gets and single puts of a sample for latency. The remote tier runs
//! against `--redis` servers, or starts three throwaway `redis-server`s on
//! loopback (noeviction, no persistence) and stops them afterwards;
//! `remote-cluster` starts a Redis Cluster of three masters on loopback.

use anyhow::anyhow;

use crate::progress::Progress;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use crate::redis::{cluster::RedisCluster, RedisOptions, RedisServer};
use tmem_core::codec::{CodecConfig, COMPRESS_BUF_SIZE};
use tmem_tier::seal::{MasterKey, SealAlgorithm, Sealer};
use tmem_tier::{LatencyHistogram, MemTier, Tier, TierGet, TierKey, TierPut};

/// Arguments of `tmem bench tier`.
#[derive(clap::Args, Debug)]
pub struct TierBenchArgs {
    /// Tiers to measure: mem, disk, remote, remote-cluster.
    #[arg(long, value_delimiter = ',', default_value = "mem,disk,remote")]
    tiers: Vec<String>,
    /// Pages to write and read per tier.
    #[arg(long, default_value_t = 50_000)]
    pages: usize,
    /// Values per batch.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Batches in flight at once (one thread each), as the store's writeback
    /// keeps that many.
    #[arg(long, default_value_t = 1)]
    inflight: usize,
    /// Pages timed one by one for latency.
    #[arg(long, default_value_t = 2000)]
    latency_samples: usize,
    /// Redis/Valkey servers for the remote tier (default: start three on loopback).
    #[arg(long, value_delimiter = ',')]
    redis: Vec<String>,
    /// Remote replication factor.
    #[arg(long, default_value_t = 2)]
    replicas: usize,
    /// Backing file for the disk tier.
    #[arg(long, default_value = "/var/tmp/tmem-bench-tier.back")]
    disk_path: PathBuf,
    /// Corpus file for page contents (default: the built-in corpora).
    #[arg(long)]
    corpus: Option<PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, serde::Serialize)]
struct TierResult {
    tier: String,
    pages: usize,
    value_bytes_avg: f64,
    put_batch_pages_per_s: f64,
    /// CPU time of this process (user + system, all threads) per page over
    /// the batched puts, µs (a tier's servers, such as the remote tier's
    /// redis-servers, are other processes: not included).
    put_batch_cpu_us_per_page: f64,
    /// The same over the batched gets.
    get_batch_cpu_us_per_page: f64,
    /// CPU time the hypervisor gave to other guests during the batched puts and gets, percent.
    cpu_steal_percent: f64,
    get_batch_pages_per_s: f64,
    get_p50_us: u64,
    get_p99_us: u64,
    put_p50_us: u64,
    put_p99_us: u64,
    wire_bytes_out_per_page: f64,
    wire_bytes_in_per_page: f64,
}

fn values(args: &TierBenchArgs) -> anyhow::Result<Vec<Vec<u8>>> {
    let corpus = match &args.corpus {
        Some(p) => tmem_corpus::Corpus::read(p)?,
        None => tmem_corpus::Corpus::mix(&tmem_corpus::Corpus::builtin()),
    };
    if corpus.page_count() == 0 {
        return Err(anyhow!("corpus has no pages"));
    }
    let codec = CodecConfig::LZ4.build()?;
    let sealer = Sealer::random()?;
    let mut buf = [0u8; COMPRESS_BUF_SIZE];
    let mut out = Vec::with_capacity(args.pages);
    for i in 0..args.pages {
        let page = corpus.page(i % corpus.page_count());
        let n = codec.compress(page, &mut buf)?;
        let plain = if n < tmem_core::PAGE_SIZE { &buf[..n] } else { &page[..] };
        let mut v = Vec::new();
        sealer.seal(key(i), i as u64 + 1, plain, &mut v);
        out.push(v);
    }
    Ok(out)
}

fn key(i: usize) -> TierKey {
    TierKey { pool: 7, object: 0, index: i as u64 }
}

/// Runs the benchmark.
pub fn run(args: &TierBenchArgs) -> anyhow::Result<()> {
    if args.pages == 0 || args.batch == 0 {
        return Err(anyhow!("--pages and --batch must be positive"));
    }
    let vals = values(args)?;
    let mut results = Vec::new();
    let mut servers = Vec::new();
    let mut cluster = None;
    let progress = if args.json { Progress::hidden() } else { Progress::new(args.tiers.len() + 1) };
    for name in &args.tiers {
        let tier: Arc<dyn Tier> = match name.as_str() {
            "mem" => Arc::new(MemTier::new(u64::MAX)),
            "disk" => {
                Arc::new(tmem_daemon::tiers::disk_tier(&args.disk_path, 2 * (args.pages as u64) * 4200 + (64 << 20))?)
            }
            "remote" => {
                let nodes = if args.redis.is_empty() {
                    let opts = RedisOptions { policy: "noeviction".into(), ..Default::default() };
                    for _ in 0..3 {
                        servers.push(RedisServer::start(&opts).map_err(|e| anyhow!("cannot start redis-server: {e}"))?);
                    }
                    servers.iter().map(RedisServer::url).collect()
                } else {
                    args.redis.clone()
                };
                let mut cfg = tmem_tier_remote::RemoteTierConfig::new(nodes, "tmem-bench", "tier");
                cfg.replicas = args.replicas.min(cfg.nodes.len()).max(1);
                Arc::new(cfg.build()?)
            }
            "remote-cluster" => {
                let c = RedisCluster::start(3, 0).map_err(|e| anyhow!("cannot start a redis cluster: {e}"))?;
                let mut cfg = tmem_tier_remote::RemoteTierConfig::new(c.seeds(), "tmem-bench", "tier");
                cfg.replicas = args.replicas.clamp(1, 3);
                cluster = Some(c);
                Arc::new(cfg.build()?)
            }
            other => return Err(anyhow!("unknown tier {other:?} (mem, disk, remote, remote-cluster)")),
        };
        progress.show(&format!("measuring {name}"), true);
        results.push(measure(name, tier.as_ref(), &vals, args)?);
        progress.steps_done(1);
        drop(tier);
        if name == "disk" {
            let _ = std::fs::remove_file(&args.disk_path);
        }
    }
    drop(servers);
    drop(cluster);
    progress.show("measuring sealing", true);
    let sealing = [SealAlgorithm::Aes256Gcm, SealAlgorithm::ChaCha20Poly1305]
        .into_iter()
        .map(|alg| measure_sealing(alg, &vals))
        .collect::<Result<Vec<_>, _>>()?;
    progress.finish();
    if args.json {
        let all = serde_json::json!({ "tiers": results, "sealing": sealing });
        println!("{}", serde_json::to_string_pretty(&all)?);
        return Ok(());
    }
    let mut t = crate::table::plain([
        "tier",
        "pages",
        "value B",
        "put pages/s",
        "put us/pg",
        "get pages/s",
        "get us/pg",
        "get p50",
        "get p99",
        "put p50",
        "put p99",
        "wire out",
        "wire in",
        "steal",
    ]);
    for r in &results {
        t.add_row([
            r.tier.clone(),
            r.pages.to_string(),
            format!("{:.0}", r.value_bytes_avg),
            format!("{:.0}", r.put_batch_pages_per_s),
            format!("{:.2}", r.put_batch_cpu_us_per_page),
            format!("{:.0}", r.get_batch_pages_per_s),
            format!("{:.2}", r.get_batch_cpu_us_per_page),
            format!("{}us", r.get_p50_us),
            format!("{}us", r.get_p99_us),
            format!("{}us", r.put_p50_us),
            format!("{}us", r.put_p99_us),
            format!("{:.0}B", r.wire_bytes_out_per_page),
            format!("{:.0}B", r.wire_bytes_in_per_page),
            format!("{:.1}%", r.cpu_steal_percent),
        ]);
    }
    println!("{t}");
    println!(
        "({} batch(es) of {} values in flight; us/pg: CPU time of this process (user + system, all threads) per page \
         over the batched puts or gets, a tier's server processes (redis-server) not included; latency of single \
         operations; wire bytes per page from the tier's own counters, 0 where it has none; \
         steal: CPU time the hypervisor gave to other guests during the batched puts and gets)",
        args.inflight.max(1),
        args.batch
    );
    println!();
    let mut t =
        crate::table::plain(["sealing (1 core)", "value B", "seal GB/s", "open GB/s", "seal/page", "open/page", ""]);
    for r in &sealing {
        t.add_row([
            r.algorithm.to_owned(),
            format!("{:.0}", r.value_bytes_avg),
            format!("{:.2}", r.seal_gb_per_s),
            format!("{:.2}", r.open_gb_per_s),
            format!("{:.2}us", r.seal_us_per_page),
            format!("{:.2}us", r.open_us_per_page),
            if r.algorithm == SealAlgorithm::preferred().name() { "(used on this CPU)".into() } else { String::new() },
        ]);
    }
    println!("{t}");
    println!("(each figure timed over at least {SEAL_MIN_BYTES_MIB} MiB and {SEAL_MIN_MS} ms of the values above)");
    Ok(())
}

/// Sealing throughput of one algorithm on one core.
#[derive(Debug, serde::Serialize)]
struct SealResult {
    algorithm: &'static str,
    value_bytes_avg: f64,
    seal_gb_per_s: f64,
    open_gb_per_s: f64,
    seal_us_per_page: f64,
    open_us_per_page: f64,
}

const SEAL_MIN_BYTES_MIB: usize = 256;
const SEAL_MIN_MS: u128 = 300;

/// Seals, then opens, the bench's values (compressed pages) over and over on
/// this thread, each for at least [`SEAL_MIN_BYTES_MIB`] MiB and
/// [`SEAL_MIN_MS`] ms, so each figure is timed over enough work.
fn measure_sealing(alg: SealAlgorithm, vals: &[Vec<u8>]) -> anyhow::Result<SealResult> {
    let sealer = Sealer::with_algorithm(&MasterKey::random()?, alg)?;
    let plains: Vec<&[u8]> = vals.iter().map(|v| &v[..v.len() - tmem_tier::seal::SEAL_OVERHEAD]).collect();
    let mut sealed: Vec<Vec<u8>> = plains.iter().map(|p| Vec::with_capacity(p.len() + 16)).collect();
    let mut version = 0u64;
    let timed = |work: &mut dyn FnMut() -> anyhow::Result<usize>| -> anyhow::Result<(f64, f64, usize)> {
        let t = Instant::now();
        let (mut bytes, mut pages) = (0usize, 0usize);
        while bytes < SEAL_MIN_BYTES_MIB << 20 || t.elapsed().as_millis() < SEAL_MIN_MS {
            bytes += work()?;
            pages += plains.len();
        }
        Ok((t.elapsed().as_secs_f64(), bytes as f64, pages))
    };
    let (seal_s, seal_bytes, seal_pages) = timed(&mut || {
        let mut bytes = 0;
        for (i, (p, out)) in plains.iter().zip(sealed.iter_mut()).enumerate() {
            version += 1;
            sealer.seal(key(i), version, p, out);
            bytes += p.len();
        }
        Ok(bytes)
    })?;
    // Open the last round's values again and again (opening never reuses a nonce).
    let first = version - plains.len() as u64 + 1;
    let mut buf = Vec::with_capacity(tmem_core::PAGE_SIZE + 16);
    let (open_s, open_bytes, open_pages) = timed(&mut || {
        let mut bytes = 0;
        for (i, v) in sealed.iter().enumerate() {
            buf.clear();
            buf.extend_from_slice(v);
            sealer.open(key(i), first + i as u64, &mut buf).map_err(|e| anyhow!("{}: {e}", alg.name()))?;
            bytes += buf.len();
        }
        Ok(bytes)
    })?;
    Ok(SealResult {
        algorithm: alg.name(),
        value_bytes_avg: seal_bytes / seal_pages as f64,
        seal_gb_per_s: seal_bytes / seal_s / 1e9,
        open_gb_per_s: open_bytes / open_s / 1e9,
        seal_us_per_page: seal_s * 1e6 / seal_pages as f64,
        open_us_per_page: open_s * 1e6 / open_pages as f64,
    })
}

/// Work on one batch: (batch number, its values).
type BatchWork<'a> = dyn Fn(usize, &[Vec<u8>]) -> anyhow::Result<()> + Sync + 'a;

fn measure(name: &str, tier: &dyn Tier, vals: &[Vec<u8>], args: &TierBenchArgs) -> anyhow::Result<TierResult> {
    let n = vals.len();
    let before = tier.stats();
    let cpu_before = tmem_sys::vmstat::CpuTimes::now();
    let chunks: Vec<&[Vec<u8>]> = vals.chunks(args.batch).collect();
    let inflight = args.inflight.max(1);
    // Thread `t` of `inflight` does every `inflight`-th batch.
    let in_parallel = |work: &BatchWork<'_>| -> anyhow::Result<()> {
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..inflight)
                .map(|t| {
                    let chunks = &chunks;
                    s.spawn(move || {
                        chunks.iter().enumerate().skip(t).step_by(inflight).try_for_each(|(c, chunk)| work(c, chunk))
                    })
                })
                .collect();
            handles.into_iter().try_for_each(|h| h.join().unwrap_or_else(|_| Err(anyhow!("a bench thread panicked"))))
        })
    };
    let (mark, t) = (tmem_sys::vmstat::CpuMark::now(), Instant::now());
    in_parallel(&|c, chunk| {
        let items: Vec<(TierKey, &[u8])> =
            chunk.iter().enumerate().map(|(j, v)| (key(c * args.batch + j), v.as_slice())).collect();
        for (j, r) in tier.put_batch(&items).into_iter().enumerate() {
            match r {
                Ok(TierPut::Stored) => {}
                Ok(TierPut::Full) => return Err(anyhow!("{name}: full after {} pages", c * args.batch + j)),
                Err(e) => return Err(anyhow!("{name}: {e}")),
            }
        }
        Ok(())
    })?;
    let put_s = t.elapsed().as_secs_f64();
    let put_cpu = mark.spent().process.total_secs();
    let (mark, t) = (tmem_sys::vmstat::CpuMark::now(), Instant::now());
    in_parallel(&|c, chunk| {
        let keys: Vec<TierKey> = (c * args.batch..c * args.batch + chunk.len()).map(key).collect();
        for (k, r) in keys.iter().zip(tier.get_batch(&keys)) {
            match r.map_err(|e| anyhow!("{name}: {e}"))? {
                Some(v) if v == vals[usize::try_from(k.index).unwrap_or(0)] => {}
                _ => return Err(anyhow!("{name}: page {} came back wrong or missing", k.index)),
            }
        }
        Ok(())
    })?;
    let get_s = t.elapsed().as_secs_f64();
    let get_cpu = mark.spent().process.total_secs();
    let steal = tmem_sys::vmstat::CpuTimes::steal_percent_from(cpu_before);
    let mid = tier.stats();
    let get_lat = LatencyHistogram::default();
    let put_lat = LatencyHistogram::default();
    let mut out = Vec::new();
    let step = (n / args.latency_samples.max(1)).max(1);
    for i in (0..n).step_by(step) {
        let t = Instant::now();
        if tier.get(key(i), &mut out)? != TierGet::Hit || out != vals[i] {
            return Err(anyhow!("{name}: single get of page {i} failed"));
        }
        get_lat.record(t.elapsed());
        let t = Instant::now();
        if tier.put(key(i), &vals[i])? != TierPut::Stored {
            return Err(anyhow!("{name}: single put of page {i} refused"));
        }
        put_lat.record(t.elapsed());
    }
    let _ = tier.clear_pool(7);
    let per = |a: u64, b: u64| (a.saturating_sub(b)) as f64 / n as f64;
    Ok(TierResult {
        tier: name.to_owned(),
        pages: n,
        value_bytes_avg: vals.iter().map(Vec::len).sum::<usize>() as f64 / n as f64,
        put_batch_pages_per_s: n as f64 / put_s,
        put_batch_cpu_us_per_page: put_cpu * 1e6 / n as f64,
        get_batch_pages_per_s: n as f64 / get_s,
        get_batch_cpu_us_per_page: get_cpu * 1e6 / n as f64,
        cpu_steal_percent: steal,
        get_p50_us: get_lat.quantile_us(0.5),
        get_p99_us: get_lat.quantile_us(0.99),
        put_p50_us: put_lat.quantile_us(0.5),
        put_p99_us: put_lat.quantile_us(0.99),
        wire_bytes_out_per_page: per(mid.wire_bytes_out, before.wire_bytes_out),
        wire_bytes_in_per_page: per(mid.wire_bytes_in, before.wire_bytes_in),
    })
}
