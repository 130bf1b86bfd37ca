//! Background recompression: cold pages move to a denser codec.
//!
//! Puts compress with the fast codec (lz4), so the swap path keeps its
//! speed. Like zram's `recompress type=idle` with a `recomp_algorithm`, but
//! automatic: a low-priority thread re-encodes the pages that have gone
//! unread for a while with a stronger codec (zstd, optionally with a
//! dictionary trained on the pool's own pages), and the pool converges
//! towards that codec's size. A page read back often stays in the fast codec.
//!
//! # Which pages
//! Every period the worker visits each shard once, under its lock, and ages
//! its entries with two bits of their own (the LRU's second chance keeps
//! `F_REFERENCED`): a get sets `F_HOT`; a visit clears `F_HOT` and `F_SEEN`
//! on a hot entry, marks an unread one `F_SEEN`, and picks one already
//! `F_SEEN`, which has gone unread for at least a period. Pages in a tier,
//! same-filled, stored raw, under writeback, already in the target codec,
//! or tried before (`F_KEEP`) are skipped.
//!
//! # Backing off
//! A page recompressed and then read back was recompressed for nothing, and
//! its get pays the dense codec's decode. Gets count the pages they decode
//! from the target codec (per shard, under the lock they already hold); the
//! thread reads that count as it visits the shards. After each pass, when
//! the recompressed pages read back since the last pass outnumber half the
//! pages it recompressed, the next pass comes twice as many periods later
//! (at most [`MAX_STRIDE`]); under an eighth, half as many ([`next_stride`]).
//! On a job that reads its whole heap back every few seconds, recompression
//! then does little and costs little; on cold pages it runs every period.
//!
//! # Racing puts, gets, compaction and writeback
//! A picked object's bytes are copied under the shard lock; decoding,
//! recompression and the new object's allocation happen outside it. Under
//! the lock again the entry is switched only if it still holds the very
//! bytes copied (same codec, length and checksum, and equal byte for byte
//! at its current location, which compaction may have moved) and no
//! writeback has picked it (`F_WB`): writeback copies an object's bytes and
//! trusts the entry's codec when it reads them back. Otherwise the new
//! object is freed and the race counted. Replaced objects are freed once
//! the lock is dropped, as a put frees the object it replaces.

use std::sync::Arc;
use std::time::Duration;

use super::worker::{StopFlag, Worker};
use super::*;
use crate::codec::{CodecChoice, CompressBuf};

/// Pages re-encoded per shard lock hold.
const BATCH: usize = 64;

/// Most periods between two passes while backing off.
pub const MAX_STRIDE: u32 = 32;

/// Periods until the pass after this one, from `stride` now and, since the
/// last pass, `done` pages recompressed and `reads` recompressed pages read
/// back: twice as many when `reads` is over half of `done`, half as many
/// when it is under an eighth. Fewer than 64 of both together say nothing.
#[must_use]
pub(super) fn next_stride(stride: u32, done: u64, reads: u64) -> u32 {
    if done + reads < 64 {
        stride
    } else if reads * 2 > done {
        (stride * 2).min(MAX_STRIDE)
    } else if reads * 8 < done {
        (stride / 2).max(1)
    } else {
        stride
    }
}

/// Background recompression settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecompressConfig {
    /// The codec cold pages move to.
    pub codec: CodecConfig,
    /// Train a dictionary for it on the pool's own pages first (`+dict`);
    /// recompression starts once that is done.
    pub dictionary: Option<DictTraining>,
    /// How long a page goes unread before it is recompressed: the worker
    /// visits every shard this often, and takes a page on the second visit
    /// that finds it unread (so after one to two periods).
    pub after: Duration,
    /// CPU priority of the worker thread (`nice`, 0..=19).
    pub nice: i32,
}

impl RecompressConfig {
    /// Default idle time before a page is recompressed.
    pub const DEFAULT_AFTER: Duration = Duration::from_secs(2);

    /// Settings for a codec spec such as `zstd:3+dict` (see [`CodecChoice`]),
    /// with the default idle time and lowest priority.
    pub fn parse(spec: &str) -> Result<Self, CodecError> {
        let choice = CodecChoice::parse(spec)?;
        if choice.codec == CodecConfig::Raw {
            return Err(CodecError::Config { codec: spec.to_owned(), reason: "raw copies cannot be denser".into() });
        }
        Ok(Self {
            codec: choice.codec,
            dictionary: choice.dictionary.then(DictTraining::default),
            after: Self::DEFAULT_AFTER,
            nice: 19,
        })
    }
}

/// The recompression worker's state between passes.
struct Job {
    shared: Arc<Shared>,
    cfg: RecompressConfig,
    /// Codec id pages move to, once registered (after training, with `+dict`).
    target: Option<u8>,
    /// With `+dict`, while the target is the codec alone because training
    /// failed: the tries that failed and the pool's compressed bytes at
    /// which to try again.
    retrain: Option<(u32, u64)>,
    /// Periods so far (the spawned thread's ticks).
    ticks: u64,
    /// Pool-wide recompressed pages and reads of them at the last pass.
    seen: (u64, u64),
    scratch: Scratch,
}

/// Buffers reused across batches, so a pass allocates nothing per page.
struct Scratch {
    keys: Vec<Key>,
    picks: Vec<Pick>,
    /// The picked objects' bytes, back to back.
    bytes: Vec<u8>,
    /// Objects to free once the shard lock is dropped.
    free: Vec<Loc>,
    page: Box<[u8; PAGE_SIZE]>,
    out: Box<CompressBuf>,
    /// Reads of recompressed pages, summed over the shards visited so far
    /// in this pass.
    reads: u64,
}

/// One page being recompressed.
struct Pick {
    key: Key,
    hash: u64,
    /// The entry as copied.
    old: Entry,
    /// Where its bytes are in `Scratch::bytes`.
    start: usize,
    result: Recoded,
}

enum Recoded {
    /// Not re-encoded (it did not decode, or memory ran out): left alone.
    Skipped,
    /// The target codec was not smaller enough: mark it `F_KEEP`.
    Kept,
    /// A new object of `len` bytes with checksum `check`.
    New { loc: Loc, len: usize, check: u32 },
}

/// Whether recompression may take `e` into codec `to` at all.
fn recompressible(e: &Entry, to: u8) -> bool {
    e.alloc_loc().is_some()
        && !e.has(F_INCOMPRESSIBLE)
        && !e.has(F_WB)
        && !e.has(F_KEEP)
        && e.codec() != to
        && e.codec() != RAW_CODEC
}

/// Worth switching: the new object saves at least an eighth.
fn smaller_enough(new: usize, old: usize) -> bool {
    new * 8 <= old * 7
}

impl Job {
    /// One pass over every pool. Registers the target codec first (training
    /// its dictionary once the pool is big enough, if asked to).
    /// Returns whether it visited every shard.
    fn pass(&mut self, stop: Option<&StopFlag>) -> bool {
        if self.retrain.is_some_and(|(_, at)| self.shared.alloc.total_bytes() >= at) {
            self.train_again();
        }
        // RAW_CODEC marks a codec that could not be set up: nothing to do.
        let Some(to) = self.target.or_else(|| self.prepare()).filter(|&t| t != RAW_CODEC) else { return false };
        let Ok(codec) = self.shared.codec(to).cloned() else { return false };
        self.shared.recompress_target.store(to, Ordering::Relaxed);
        self.scratch.reads = 0;
        for pool in self.shared.pools_snapshot() {
            for i in 0..pool.shards.len() {
                if stop.is_some_and(StopFlag::is_set) {
                    return false;
                }
                pool.recompress_shard(i, to, &*codec, &mut self.scratch);
            }
        }
        self.shared.maybe_compact();
        true
    }

    /// What the spawned thread does every period: a pass, unless it is
    /// backing off (see the module notes), then the next stride.
    fn tick(&mut self, stop: Option<&StopFlag>) {
        self.ticks += 1;
        let stride = self.shared.recompress_stride.load(Ordering::Relaxed);
        if !self.ticks.is_multiple_of(u64::from(stride)) || !self.pass(stop) {
            return;
        }
        let done: u64 =
            self.shared.pools_snapshot().iter().map(|p| p.events.recompressed_pages.load(Ordering::Relaxed)).sum();
        let now = (done, self.scratch.reads);
        let (d, r) = (now.0.saturating_sub(self.seen.0), now.1.saturating_sub(self.seen.1));
        self.seen = now;
        self.shared.recompress_stride.store(next_stride(stride, d, r), Ordering::Relaxed);
    }

    fn prepare(&mut self) -> Option<u8> {
        let sh = &*self.shared;
        let mut untrained = None;
        let registered = match &self.cfg.dictionary {
            None => sh.register_codec(&self.cfg.codec),
            Some(t) if sh.alloc.total_bytes() < t.after_bytes => {
                sh.set_recompress_status(format!(
                    "{}+dict: waiting for {} MiB in the pool to train on",
                    self.cfg.codec.build().map(|c| c.name().to_owned()).unwrap_or_default(),
                    t.after_bytes >> 20
                ));
                return None;
            }
            Some(t) => match sh.sample_and_train(t) {
                Ok((dict, _)) => sh.register_codec(&self.cfg.codec.with_dictionary(dict)),
                // Too little to train on, say: the codec alone is still
                // denser, and training is tried again once the pool grows.
                Err(e) => {
                    self.retrain = Some((1, dictionary::next_training_bytes(sh.alloc.total_bytes(), t.after_bytes)));
                    untrained = Some(e);
                    sh.register_codec(&self.cfg.codec)
                }
            },
        };
        match registered.and_then(|id| Ok((id, sh.codec(id)?.name().to_owned()))) {
            Ok((id, name)) => {
                let why = untrained.map(|e| self.untrained_because(&e));
                sh.set_recompress_status(format!("{name}{}", why.unwrap_or_default()));
                self.target = Some(id);
                Some(id)
            }
            Err(e) => {
                sh.set_recompress_status(format!("failed: {e}"));
                // Do not retry every period: a failed codec stays failed.
                self.target = Some(RAW_CODEC);
                self.retrain = None;
                None
            }
        }
        .filter(|&id| id != RAW_CODEC)
    }

    /// Why the target has no dictionary, for the status: the error, and
    /// when training is tried again.
    fn untrained_because(&self, e: &StoreError) -> String {
        match self.retrain {
            Some((failed, at)) => format!(
                " (without a dictionary: training failed: {e}; try {failed} of {}, next at {} KiB in the pool)",
                dictionary::TRAINING_TRIES,
                at.div_ceil(1024)
            ),
            None => format!(" (without a dictionary: training failed: {e}; no more tries)"),
        }
    }

    /// Tries training the dictionary again; on success, pages move to the
    /// codec with it from now on (those in the codec alone included, when
    /// that saves an eighth).
    fn train_again(&mut self) {
        let (Some((failed, at)), Some(t)) = (self.retrain, &self.cfg.dictionary) else { return };
        let sh = &*self.shared;
        let name = |id| sh.codec(id).map(|c| c.name().to_owned()).unwrap_or_default();
        match sh.sample_and_train(t) {
            Ok((dict, _)) => {
                self.retrain = None;
                match sh.register_codec(&self.cfg.codec.with_dictionary(dict)) {
                    Ok(id) => {
                        self.target = Some(id);
                        sh.set_recompress_status(name(id));
                    }
                    Err(e) => sh.set_recompress_status(format!(
                        "{} (without a dictionary: {e}; no more tries)",
                        self.target.map(name).unwrap_or_default()
                    )),
                }
            }
            Err(e) => {
                let failed = failed + 1;
                self.retrain = (failed < dictionary::TRAINING_TRIES)
                    .then(|| (failed, dictionary::next_training_bytes(sh.alloc.total_bytes(), at)));
                let why = self.untrained_because(&e);
                sh.set_recompress_status(format!("{}{why}", self.target.map(name).unwrap_or_default()));
            }
        }
    }
}

impl Pool {
    /// Ages shard `i`'s entries and recompresses the cold ones into `to`.
    fn recompress_shard(&self, i: usize, to: u8, codec: &dyn Codec, sc: &mut Scratch) {
        let mut keys = std::mem::take(&mut sc.keys);
        keys.clear();
        {
            let mut s = self.shards[i].0.lock();
            sc.reads += s.c.recompressed_reads;
            let handles: Vec<u32> = s.entries.live_handles().collect();
            for h in handles {
                let e = s.entries.get_mut(h);
                if !recompressible(e, to) {
                    continue;
                }
                if e.has(F_HOT) {
                    e.meta &= !(F_HOT | F_SEEN);
                } else if !e.has(F_SEEN) {
                    e.meta |= F_SEEN;
                } else {
                    keys.push(e.key());
                }
            }
        }
        for batch in keys.chunks(BATCH) {
            self.recompress_batch(i, batch, to, codec, sc);
        }
        sc.keys = keys;
    }

    fn recompress_batch(&self, i: usize, keys: &[Key], to: u8, codec: &dyn Codec, sc: &mut Scratch) {
        let alloc = &self.shared.alloc;
        // 1. Copy the objects out.
        sc.picks.clear();
        sc.bytes.clear();
        {
            let s = self.shards[i].0.lock();
            for &key in keys {
                let hash = hash_key(key);
                let Some(h) = s.find(key, hash) else { continue };
                let e = *s.entries.get(h);
                let Some(loc) = e.alloc_loc().filter(|_| recompressible(&e, to) && !e.has(F_HOT)) else { continue };
                let start = sc.bytes.len();
                // SAFETY: the entry is live in this shard and we hold its
                // lock, so the object is neither freed nor moved meanwhile.
                sc.bytes.extend_from_slice(unsafe { alloc.object(loc, e.len()) });
                sc.picks.push(Pick { key, hash, old: e, start, result: Recoded::Skipped });
            }
        }
        // 2. Re-encode outside the lock.
        for p in &mut sc.picks {
            let data = &sc.bytes[p.start..p.start + p.old.len()];
            let Ok(from) = self.shared.codec(p.old.codec()) else { continue };
            // A corrupt object is left for its get to report.
            if crc32fast::hash(data) != p.old.check || from.decompress(data, &mut sc.page).is_err() {
                continue;
            }
            let Ok(n) = codec.compress(&sc.page, &mut sc.out) else { continue };
            p.result = if !smaller_enough(n, p.old.len()) {
                Recoded::Kept
            } else {
                match alloc.alloc_write(&sc.out[..n]) {
                    Ok(loc) => Recoded::New { loc, len: n, check: crc32fast::hash(&sc.out[..n]) },
                    Err(_) => break,
                }
            };
        }
        // 3. Switch the entries that still hold what was copied.
        let (mut done, mut saved, mut kept, mut raced) = (0, 0, 0, 0);
        {
            let mut s = self.shards[i].0.lock();
            for p in &sc.picks {
                let old = &sc.bytes[p.start..p.start + p.old.len()];
                let h = s.find(p.key, p.hash).filter(|&h| {
                    let cur = s.entries.get(h);
                    cur.alloc_loc().is_some_and(|loc| {
                        !cur.has(F_WB)
                            && cur.codec() == p.old.codec()
                            && cur.len() == p.old.len()
                            && cur.check == p.old.check
                            // SAFETY: live entry, shard lock held (as above).
                            && unsafe { alloc.object(loc, cur.len()) } == old
                    })
                });
                match (&p.result, h) {
                    (Recoded::Skipped, _) => {}
                    (Recoded::Kept, Some(h)) => {
                        s.entries.get_mut(h).meta |= F_KEEP;
                        kept += 1;
                    }
                    (Recoded::New { loc, len, check }, Some(h)) => {
                        let cur = *s.entries.get(h);
                        Self::uncount(&mut s.c, &cur);
                        let e = s.entries.get_mut(h);
                        e.recode(loc.pack(), *check, *len, to);
                        let e = *e;
                        Self::count(&mut s.c, &e);
                        sc.free.push(cur.alloc_loc().expect("checked above"));
                        done += 1;
                        saved += (p.old.len() - len) as u64;
                    }
                    (Recoded::New { loc, .. }, None) => {
                        sc.free.push(*loc);
                        raced += 1;
                    }
                    (Recoded::Kept, None) => raced += 1,
                }
            }
        }
        // 4. Free what nothing reaches any more.
        for loc in sc.free.drain(..) {
            alloc.free(loc);
        }
        let ev = &self.events;
        ev.recompressed_pages.fetch_add(done, Ordering::Relaxed);
        ev.recompress_saved_bytes.fetch_add(saved, Ordering::Relaxed);
        ev.recompress_kept.fetch_add(kept, Ordering::Relaxed);
        ev.recompress_raced.fetch_add(raced, Ordering::Relaxed);
    }
}

impl Shared {
    fn set_recompress_status(&self, s: String) {
        *self.recompress_status.lock() = Some(s);
    }

    pub(super) fn recompress_status(&self) -> Option<String> {
        let status = self.recompress_status.lock().clone()?;
        Some(match self.recompress_stride.load(Ordering::Relaxed) {
            1 => status,
            // No ": " in it: `tmem stat` prints "recompression STATUS: N pages ...".
            n => format!("{status}; backing off, a pass every {n} periods (recompressed pages were read back)"),
        })
    }
}

/// Background recompression thread (stopped when dropped).
pub type Recompressor = Worker;

/// Recompression of a store's pools: run passes on this thread with
/// [`Recompression::pass`] (tests, benches), or hand it to a low-priority
/// thread of its own with [`Recompression::spawn`].
pub struct Recompression(Job);

impl std::fmt::Debug for Recompression {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recompression").field("cfg", &self.0.cfg).field("target", &self.0.target).finish()
    }
}

impl Recompression {
    /// One pass over every shard of every pool: ages the pages and
    /// recompresses those gone unread since the previous pass.
    pub fn pass(&mut self) {
        self.0.pass(None);
    }

    /// What the spawned thread does every `after`: a pass, or nothing while
    /// it backs off because recompressed pages are read back (see the module
    /// notes).
    pub fn tick(&mut self) {
        self.0.tick(None);
    }

    /// Periods between passes now: 1, or up to [`MAX_STRIDE`] while backing off.
    #[must_use]
    pub fn stride(&self) -> u32 {
        self.0.shared.recompress_stride.load(Ordering::Relaxed)
    }

    /// Ticks every `after` on a thread at the configured priority.
    pub fn spawn(self) -> Recompressor {
        let (after, nice) = (self.0.cfg.after, self.0.cfg.nice);
        let mut job = self.0;
        Worker::start("tmem-recompress", after, nice, move |stop| job.tick(Some(stop)))
    }
}

impl Store {
    /// Sets up recompression of every pool's cold pages into `cfg.codec`
    /// (see the module notes). Fails at once if the codec cannot be built.
    pub fn recompression(&self, cfg: RecompressConfig) -> Result<Recompression, StoreError> {
        let name = cfg.codec.build()?.name().to_owned();
        let shared = Arc::clone(&self.shared);
        shared.set_recompress_status(format!("{name}: starting"));
        Ok(Recompression(Job {
            shared,
            cfg,
            target: None,
            retrain: None,
            ticks: 0,
            seen: (0, 0),
            scratch: Scratch {
                keys: Vec::new(),
                picks: Vec::with_capacity(BATCH),
                bytes: Vec::with_capacity(BATCH * PAGE_SIZE),
                free: Vec::with_capacity(BATCH),
                page: Box::new([0; PAGE_SIZE]),
                out: Box::new([0; COMPRESS_BUF_SIZE]),
                reads: 0,
            },
        }))
    }
}
