//! Dictionaries trained on the pool's own pages.
//!
//! A 4 KiB page is too short for lz4 (or zstd) to find much to refer back
//! to, but the pages of one workload share a lot: object headers, type
//! pointers, field names, padding. A dictionary of such bytes gives every
//! page something to refer to. Measured with `examples/codec_speed.rs`
//! (64 KiB dictionary from the first half of a corpus, ratio on the second
//! half), lz4's ratio rose by 3–14% on the 64 MiB python, java, cc and
//! redis captures; in
//! `tmem bench pressure` the pool ratio went from 2.18–2.22 to 2.35–2.46.
//! The price is compression speed: attaching a dictionary about halves lz4's
//! throughput on a 4 KiB page.
//!
//! Training is done once it works, when the pool first holds
//! [`DictTraining::after_bytes`] of compressed data: a background thread
//! decodes an even sample of the stored pages, trains a dictionary on them
//! (zstd's trainer; lz4 uses its last 64 KiB as raw history), registers the
//! codec with that dictionary and makes it current. Pages stored before keep
//! their codec id, so nothing is recompressed and nothing needs migrating.
//!
//! Training fails when the sample is too small or too uniform for zstd's
//! trainer (a pool of mostly same-filled pages, say). It is tried again once
//! the pool's compressed bytes have doubled, [`TRAINING_TRIES`] times in all
//! ([`next_training_bytes`]); background recompression retries the same way.
//!
//! The first 8 MiB may be one program's pages, and a pool grows to hold
//! others. So every [`DictTraining::after_bytes`] of growth the thread
//! looks at the pages stored with the current dictionary since its last
//! look: when they compress a sixteenth worse than those before them, or
//! the pool holds [`RETRAIN_GROWTH`] times what it held at the last try, a
//! new dictionary is trained on an even sample, half of the
//! whole pool and half of the pages stored with the current dictionary
//! (the newest: they say most of the pages to come), every other page of
//! each; the rest of the newest are held out and both dictionaries
//! compress them. The new one replaces the current one for new puts only
//! if it saves at least a thirty-second of those bytes ([`Retraining`]). Pages keep the dictionary they were stored with, so
//! the old ones stay registered; at most [`DictTraining::max_dictionaries`]
//! are trained.
//! A codec set by hand since (`tmem set`) ends it.
//!
//! A dictionary codec set by hand ([`Store::use_dictionary_codec`]) is
//! trained at once on the pages stored now. When they are fewer than
//! [`MIN_TRAINING_PAGES`], new puts use the base codec alone and automatic
//! training is armed for it, as if the store had been built with it.
//! Arming and ending bump a generation under the plan's lock; a try that
//! started under another generation changes no codec, so a codec set by
//! hand is never overridden by a try that was under way.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use tmem_lock::{Mutex, Rank};

use super::{Pool, Shared, Store, StoreError};
use crate::codec::{train_dictionary, CodecConfig};
use crate::PAGE_SIZE;

/// When and how to train a dictionary from the pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DictTraining {
    /// Train once the pool's compressed objects reach this many bytes.
    pub after_bytes: u64,
    /// Pages sampled for training, at most (spread evenly over the pool).
    pub sample_pages: usize,
    /// Dictionary size, bytes (lz4 uses at most 64 KiB).
    pub dict_bytes: usize,
    /// Dictionaries trained at most as the pool grows, the first included
    /// (1: never a second one).
    pub max_dictionaries: u32,
}

impl Default for DictTraining {
    fn default() -> Self {
        Self { after_bytes: 8 << 20, sample_pages: 2048, dict_bytes: 64 << 10, max_dictionaries: MAX_DICTIONARIES }
    }
}

/// A trained dictionary in use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TrainedDictionary {
    /// Codec id new puts now use.
    pub codec_id: u8,
    /// Dictionary size, bytes.
    pub bytes: usize,
    /// Pages it was trained on.
    pub sample_pages: usize,
}

/// Tries of a training, the first included, before giving up.
pub const TRAINING_TRIES: u32 = 3;

/// Compressed bytes the pool must hold before training is tried again, after
/// a try failed at `now` bytes with `last` the threshold of that try: twice
/// the larger, and at least 64 KiB.
#[must_use]
pub(super) fn next_training_bytes(now: u64, last: u64) -> u64 {
    now.max(last).saturating_mul(2).max(64 << 10)
}

/// Once a dictionary is in use, a new one is tried when the pool's
/// compressed bytes reach this many times what it held at the last try (or
/// sooner, when new pages compress worse: see [`AutoDictionary::due`]).
pub const RETRAIN_GROWTH: u64 = 4;

/// Compressible pages a dictionary is trained on at least. zstd's trainer
/// refuses fewer than 5 samples, and a 64 KiB dictionary from fewer than
/// 64 pages (256 KiB) is mostly those pages themselves.
pub const MIN_TRAINING_PAGES: usize = 64;

/// Dictionaries automatic training registers at most, the first included
/// (the default of [`DictTraining::max_dictionaries`]).
pub const MAX_DICTIONARIES: u32 = 4;

/// What a try at a new dictionary for a pool that has one came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retraining {
    /// The new dictionary is in use (codec id).
    Switched {
        /// Codec id new puts now use.
        codec_id: u8,
        /// Held-out bytes with the old dictionary, and with the new one.
        old_bytes: usize,
        /// See `old_bytes`.
        new_bytes: usize,
        /// Pages held out.
        held_out: usize,
    },
    /// The current dictionary stays: the new one did not save enough.
    Kept {
        /// Held-out bytes with the current dictionary, and with the new one.
        old_bytes: usize,
        /// See `old_bytes`.
        new_bytes: usize,
        /// Pages held out.
        held_out: usize,
    },
}

/// What [`Store::use_dictionary_codec`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DictionaryCodec {
    /// Trained on the pages stored now; new puts use it.
    Trained(TrainedDictionary),
    /// Too few pages to train on: new puts use the base codec alone, and a
    /// dictionary is trained in the background once the pool holds
    /// `after_bytes` of compressed data.
    Deferred {
        /// Compressible pages the pool held.
        pages: usize,
        /// Compressed bytes at which training starts.
        after_bytes: u64,
    },
}

/// A try that found the codec set by hand since it began.
fn set_by_hand_meanwhile() -> StoreError {
    StoreError::Codec(crate::codec::CodecError::Config {
        codec: "dictionary".into(),
        reason: "the codec was set by hand during training".into(),
    })
}

/// Share of the bytes a new dictionary saves on the held-out pages, in percent.
fn saved_percent(old: usize, new: usize) -> f64 {
    if old == 0 {
        return 0.0;
    }
    (old as f64 - new as f64) * 100.0 / old as f64
}

const WAITING: u8 = 0;
const TRAINING: u8 = 1;
const FINISHED: u8 = 2;

/// Automatic training: configured at build; the first dictionary is tried
/// at most [`TRAINING_TRIES`] times, then new ones as the pool grows, up to
/// [`DictTraining::max_dictionaries`].
pub(super) struct AutoDictionary {
    cfg: DictTraining,
    state: AtomicU8,
    /// The pool's compressed bytes at which the next try starts.
    next_bytes: AtomicU64,
    /// Tries of the first dictionary that failed.
    failures: AtomicU32,
    /// Dictionaries registered so far.
    dictionaries: AtomicU32,
    /// Codec id of the newest one (meaningful once `dictionaries` > 0).
    codec_id: AtomicU8,
    /// The pool's compressed bytes at the last try of a dictionary.
    tried_bytes: AtomicU64,
    /// Pages and bytes of the newest dictionary's codec at the last look.
    seen_pages: AtomicU64,
    /// See `seen_pages`.
    seen_bytes: AtomicU64,
    /// The codec, the generation and the status, changed together.
    plan: Mutex<Plan>,
}

/// Automatic training as a hand-over carries it (store format 4), so that
/// a successor trains when its predecessor would have, never trains again
/// what its predecessor trained, and keeps a codec set by hand.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct HandedTraining {
    pub cfg: DictTraining,
    pub base: CodecConfig,
    pub armed: bool,
    /// No more tries (the state `FINISHED`).
    pub finished: bool,
    pub next_bytes: u64,
    pub failures: u32,
    pub dictionaries: u32,
    /// The newest dictionary's codec id (with `dictionaries` > 0).
    pub codec_id: u8,
    pub tried_bytes: u64,
    pub seen_pages: u64,
    pub seen_bytes: u64,
    pub status: String,
}

/// What automatic training trains for, and what it last did.
struct Plan {
    /// The codec a dictionary is trained for.
    base: CodecConfig,
    /// Bumped when training is armed again or ended by hand.
    generation: u32,
    /// Whether training is wanted (false once a codec is set by hand).
    armed: bool,
    /// What happened, for stats: "waiting", "training", the result or the error.
    status: String,
}

impl AutoDictionary {
    /// Training for `base` in a new store: armed, waiting for
    /// [`DictTraining::after_bytes`].
    pub(super) fn new(base: CodecConfig, cfg: DictTraining) -> Self {
        Self::adopted(HandedTraining {
            next_bytes: cfg.after_bytes,
            cfg,
            base,
            armed: true,
            finished: false,
            failures: 0,
            dictionaries: 0,
            codec_id: 0,
            tried_bytes: 0,
            seen_pages: 0,
            seen_bytes: 0,
            status: "waiting".into(),
        })
    }

    /// Where training stands, for a successor ([`Self::adopted`]). A try
    /// under way is handed over as waiting at the same threshold: the
    /// successor makes it again on its first put.
    pub(super) fn handed(&self) -> HandedTraining {
        let plan = self.plan.lock();
        HandedTraining {
            cfg: self.cfg.clone(),
            base: plan.base.clone(),
            armed: plan.armed,
            finished: self.state.load(Ordering::Acquire) == FINISHED,
            next_bytes: self.next_bytes.load(Ordering::Relaxed),
            failures: self.failures.load(Ordering::Relaxed),
            dictionaries: self.dictionaries.load(Ordering::Relaxed),
            codec_id: self.codec_id.load(Ordering::Relaxed),
            tried_bytes: self.tried_bytes.load(Ordering::Relaxed),
            seen_pages: self.seen_pages.load(Ordering::Relaxed),
            seen_bytes: self.seen_bytes.load(Ordering::Relaxed),
            status: plan.status.clone(),
        }
    }

    /// Training that goes on where a predecessor's stood ([`Self::handed`];
    /// `codec_id` already in this store's ids).
    pub(super) fn adopted(h: HandedTraining) -> Self {
        Self {
            cfg: h.cfg,
            state: AtomicU8::new(if h.finished { FINISHED } else { WAITING }),
            next_bytes: AtomicU64::new(h.next_bytes),
            failures: AtomicU32::new(h.failures),
            dictionaries: AtomicU32::new(h.dictionaries),
            codec_id: AtomicU8::new(h.codec_id),
            tried_bytes: AtomicU64::new(h.tried_bytes),
            seen_pages: AtomicU64::new(h.seen_pages),
            seen_bytes: AtomicU64::new(h.seen_bytes),
            plan: Mutex::new(
                Rank::DictionaryPlan,
                Plan { base: h.base, generation: 0, armed: h.armed, status: h.status },
            ),
        }
    }

    /// Trains for `base` from now on, as from a new store: the next try
    /// comes at [`DictTraining::after_bytes`] of compressed data.
    fn arm(&self, base: CodecConfig) {
        let mut plan = self.plan.lock();
        plan.generation = plan.generation.wrapping_add(1);
        plan.base = base;
        plan.armed = true;
        plan.status = "waiting".into();
        for n in [&self.failures, &self.dictionaries] {
            n.store(0, Ordering::Relaxed);
        }
        for n in [&self.tried_bytes, &self.seen_pages, &self.seen_bytes] {
            n.store(0, Ordering::Relaxed);
        }
        self.next_bytes.store(self.cfg.after_bytes, Ordering::Relaxed);
        if self.state.load(Ordering::Acquire) != TRAINING {
            self.state.store(WAITING, Ordering::Release);
        }
    }

    /// Ends training: a codec was set by hand.
    fn end(&self) {
        let mut plan = self.plan.lock();
        if !plan.armed {
            return;
        }
        plan.generation = plan.generation.wrapping_add(1);
        plan.armed = false;
        plan.status = format!("{}; the codec was set by hand since: no more tries", plan.status);
        if self.state.load(Ordering::Acquire) != TRAINING {
            self.state.store(FINISHED, Ordering::Release);
        }
    }

    /// The codec trained for and the generation now.
    fn base(&self) -> (CodecConfig, u32) {
        let plan = self.plan.lock();
        (plan.base.clone(), plan.generation)
    }

    /// Records a failed try with `now` compressed bytes in the pool; returns
    /// the status to show and the state to go to.
    fn failed(&self, error: &StoreError, now: u64) -> (String, u8) {
        let failures = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if failures >= TRAINING_TRIES {
            return (format!("failed: {error} (try {failures} of {TRAINING_TRIES}; no more)"), FINISHED);
        }
        let next = next_training_bytes(now, self.next_bytes.load(Ordering::Relaxed));
        self.next_bytes.store(next, Ordering::Relaxed);
        let status = format!(
            "failed: {error} (try {failures} of {TRAINING_TRIES}; next at {} KiB in the pool)",
            next.div_ceil(1024)
        );
        (status, WAITING)
    }

    /// Ends a try begun under `generation`: its status and state stand
    /// unless training was armed again or ended by hand meanwhile.
    fn finish(&self, generation: u32, status: Option<String>, state: u8) {
        let plan = &mut *self.plan.lock();
        if plan.generation != generation {
            self.state.store(if plan.armed { WAITING } else { FINISHED }, Ordering::Release);
            return;
        }
        if let Some(status) = status {
            plan.status = status;
        }
        self.state.store(state, Ordering::Release);
    }

    /// After a try with `now` compressed bytes in the pool: the note on
    /// what comes next for the status, and the state to go to. The next
    /// look is [`DictTraining::after_bytes`] later.
    fn next_look(&self, now: u64) -> (String, u8) {
        let most = self.cfg.max_dictionaries;
        if self.dictionaries.load(Ordering::Relaxed) >= most {
            let s = if most == 1 { "y" } else { "ies" };
            return (format!("; no more tries ({most} dictionar{s})"), FINISHED);
        }
        self.next_bytes.store(now.saturating_add(self.cfg.after_bytes.max(64 << 10)), Ordering::Relaxed);
        (String::new(), WAITING)
    }

    /// Why a new dictionary is due with `now` compressed bytes in the pool,
    /// if it is: the pool has grown [`RETRAIN_GROWTH`] times since the last
    /// try, or the pages stored with dictionary `mine` since the last look
    /// compress a sixteenth worse than the ones before them. Keeps what it
    /// saw for the next look.
    fn due(&self, shared: &Shared, mine: u8, now: u64) -> Option<String> {
        let (pages, bytes) = shared.pools_snapshot().iter().fold((0u64, 0u64), |(p, b), pool| {
            let u = pool.codec_usage()[0];
            (p + u.0[usize::from(mine)], b + u.1[usize::from(mine)])
        });
        let (p0, b0) = (self.seen_pages.swap(pages, Ordering::Relaxed), self.seen_bytes.swap(bytes, Ordering::Relaxed));
        let ratio = |p: u64, b: u64| if b == 0 { 0.0 } else { (p * PAGE_SIZE as u64) as f64 / b as f64 };
        let (before, recent) = (ratio(p0, b0), ratio(pages.saturating_sub(p0), bytes.saturating_sub(b0)));
        if now >= self.tried_bytes.load(Ordering::Relaxed).saturating_mul(RETRAIN_GROWTH) {
            return Some(format!("the pool grew {RETRAIN_GROWTH}x"));
        }
        // Enough new pages (256) against enough old ones to tell.
        (p0 >= 256 && pages >= p0 + 256 && bytes > b0 && recent * 16.0 < before * 15.0)
            .then(|| format!("new pages compress {recent:.2}x against {before:.2}x before"))
    }

    /// One background try: the first dictionary, or, once the pool has one,
    /// a look at whether a new one is due and a try if it is. Returns the
    /// status (None: unchanged) and the state to go to.
    fn run(&self, shared: &Shared, base: &CodecConfig, generation: u32) -> (Option<String>, u8) {
        let now = shared.alloc.total_bytes();
        let had = self.dictionaries.load(Ordering::Relaxed);
        if had == 0 {
            let (status, state) = match shared.train_dictionary(base, &self.cfg, Some((self, generation))) {
                Ok(t) => {
                    self.codec_id.store(t.codec_id, Ordering::Relaxed);
                    self.dictionaries.store(1, Ordering::Relaxed);
                    self.tried_bytes.store(now, Ordering::Relaxed);
                    let (next, state) = self.next_look(now);
                    (format!("trained: {} bytes from {} pages{next}", t.bytes, t.sample_pages), state)
                }
                Err(e) => self.failed(&e, now),
            };
            return (Some(status), state);
        }
        let mine = self.codec_id.load(Ordering::Relaxed);
        if shared.current_codec.load(Ordering::Relaxed) != mine {
            return (Some("trained; the codec was set by hand since: no more tries".into()), FINISHED);
        }
        let Some(why) = self.due(shared, mine, now) else {
            let (next, state) = self.next_look(now);
            return ((!next.is_empty()).then(|| format!("trained{next}")), state);
        };
        self.tried_bytes.store(now, Ordering::Relaxed);
        let at = format!("at {} KiB in the pool ({why})", now.div_ceil(1024));
        let line = match shared.retrain_dictionary(base, &self.cfg, mine, Some((self, generation))) {
            Ok(Retraining::Switched { codec_id, old_bytes, new_bytes, held_out }) => {
                self.codec_id.store(codec_id, Ordering::Relaxed);
                self.dictionaries.store(had + 1, Ordering::Relaxed);
                self.seen_pages.store(0, Ordering::Relaxed);
                self.seen_bytes.store(0, Ordering::Relaxed);
                format!(
                    "retrained {at}: dictionary {} saves {:.1}% on {held_out} held-out pages",
                    had + 1,
                    saved_percent(old_bytes, new_bytes)
                )
            }
            Ok(Retraining::Kept { old_bytes, new_bytes, held_out }) => format!(
                "trained; kept dictionary {had}: a new one {at} saved {:.1}% on {held_out} held-out pages",
                saved_percent(old_bytes, new_bytes)
            ),
            Err(e) => format!("trained; kept dictionary {had}: a new one {at} failed: {e}"),
        };
        let (next, state) = self.next_look(now);
        (Some(line + &next), state)
    }
}

impl Pool {
    /// Decodes every `every`-th page held in the pool (not same-filled, not
    /// in a tier, not stored raw; of codec `codec` only, if given) into
    /// `out`, until `out` holds `max` pages.
    fn sample_pages(&self, every: usize, max: usize, codec: Option<u8>, out: &mut Vec<[u8; PAGE_SIZE]>) {
        let mut seen = 0usize;
        let mut page = [0u8; PAGE_SIZE];
        for shard in self.shards.iter() {
            let s = shard.0.lock();
            for h in s.entries.live_handles() {
                if out.len() >= max {
                    return;
                }
                let e = s.entries.get(h);
                let Some(loc) = e.alloc_loc() else { continue };
                if e.has(super::F_INCOMPRESSIBLE) || codec.is_some_and(|c| e.codec() != c) {
                    continue;
                }
                seen += 1;
                if seen.is_multiple_of(every) && self.decode(e, loc, &mut page).is_ok() {
                    out.push(page);
                }
            }
        }
    }
}

impl Shared {
    /// Trains a dictionary for `base` on a sample of the pools' pages,
    /// registers `base` with it and makes that the current codec (unless
    /// `guard`'s training was armed again or ended since: [`Self::commit_codec`]).
    pub(super) fn train_dictionary(
        &self,
        base: &CodecConfig,
        cfg: &DictTraining,
        guard: Option<(&AutoDictionary, u32)>,
    ) -> Result<TrainedDictionary, StoreError> {
        let (dict, sample_pages) = self.sample_and_train(cfg)?;
        let bytes = dict.len();
        let codec_id = self.commit_codec(&base.with_dictionary(dict), guard)?;
        Ok(TrainedDictionary { codec_id, bytes, sample_pages })
    }

    /// Registers `codec` and makes it current. With a `guard` (automatic
    /// training and the generation its try began under), this happens
    /// under the training's plan, and not at all if the generation changed:
    /// a codec set by hand meanwhile wins.
    fn commit_codec(&self, codec: &CodecConfig, guard: Option<(&AutoDictionary, u32)>) -> Result<u8, StoreError> {
        let plan = guard.map(|(auto, generation)| (auto.plan.lock(), generation));
        if plan.as_ref().is_some_and(|(p, generation)| p.generation != *generation) {
            return Err(set_by_hand_meanwhile());
        }
        let codec_id = self.register_codec(codec)?;
        self.set_codec(codec_id)?;
        Ok(codec_id)
    }

    /// Trains a dictionary on an even sample of the pools' pages; returns it
    /// and how many pages it was trained on.
    pub(super) fn sample_and_train(&self, cfg: &DictTraining) -> Result<(Arc<[u8]>, usize), StoreError> {
        let objects = usize::try_from(self.alloc.stats().objects).unwrap_or(usize::MAX);
        let sample = self.sample(cfg.sample_pages, objects, None);
        if sample.len() < MIN_TRAINING_PAGES {
            return Err(StoreError::TooFewPagesToTrain { pages: sample.len(), need: MIN_TRAINING_PAGES });
        }
        Ok((train_dictionary(sample.iter(), cfg.dict_bytes)?, sample.len()))
    }

    /// An even sample of at most `max` of the pools' `of` pages (decoded),
    /// of codec `codec` only, if given.
    fn sample(&self, max: usize, of: usize, codec: Option<u8>) -> Vec<[u8; PAGE_SIZE]> {
        let every = (of / max.max(1)).max(1);
        let mut sample = Vec::with_capacity(max.min(of));
        for p in self.pools_snapshot() {
            p.sample_pages(every, max, codec, &mut sample);
        }
        sample
    }

    /// Tries a new dictionary for `base` against codec `current` (see the
    /// module notes): half of the sample is even over the whole pool, half
    /// over the pages stored with `current`, the newest, which say most of
    /// the pages to come. It trains on every other page of both halves, is
    /// measured on the other pages of the newest, and becomes current if it
    /// saves at least a thirty-second of their bytes.
    pub(super) fn retrain_dictionary(
        &self,
        base: &CodecConfig,
        cfg: &DictTraining,
        current: u8,
        guard: Option<(&AutoDictionary, u32)>,
    ) -> Result<Retraining, StoreError> {
        let objects = usize::try_from(self.alloc.stats().objects).unwrap_or(usize::MAX);
        let newest = self.pools_snapshot().iter().map(|p| p.codec_usage()[0].0[usize::from(current)]).sum::<u64>();
        let half = cfg.sample_pages / 2;
        let whole = self.sample(half, objects, None);
        let recent = self.sample(half, usize::try_from(newest).unwrap_or(usize::MAX), Some(current));
        let train = whole.iter().step_by(2).chain(recent.iter().step_by(2));
        let held: Vec<&[u8; PAGE_SIZE]> = recent.iter().skip(1).step_by(2).collect();
        let dict = train_dictionary(train, cfg.dict_bytes)?;
        let candidate = base.with_dictionary(dict);
        let new_codec = candidate.build()?;
        let old_codec = Arc::clone(self.codec(current)?);
        let mut buf = Box::new([0u8; crate::codec::COMPRESS_BUF_SIZE]);
        let mut size = |c: &dyn crate::codec::Codec| -> usize {
            held.iter().map(|p| c.compress(p, &mut buf).map_or(PAGE_SIZE, |n| n.min(PAGE_SIZE))).sum()
        };
        let (old_bytes, new_bytes) = (size(&*old_codec), size(&*new_codec));
        let held_out = held.len();
        if held_out == 0 || new_bytes * 32 > old_bytes * 31 {
            return Ok(Retraining::Kept { old_bytes, new_bytes, held_out });
        }
        let codec_id = self.commit_codec(&candidate, guard)?;
        Ok(Retraining::Switched { codec_id, old_bytes, new_bytes, held_out })
    }

    /// Starts automatic training in the background once the pool is big
    /// enough (cheap to call on every put).
    pub(super) fn maybe_train_dictionary(self: &Arc<Self>) {
        let Some(auto) = self.auto_dictionary.get() else { return };
        // Acquire: a failed try stores its next threshold before `WAITING`.
        if auto.state.load(Ordering::Acquire) != WAITING
            || self.alloc.total_bytes() < auto.next_bytes.load(Ordering::Relaxed)
        {
            return;
        }
        if auto.state.compare_exchange(WAITING, TRAINING, Ordering::AcqRel, Ordering::Relaxed).is_err() {
            return;
        }
        let (base, generation) = auto.base();
        if auto.dictionaries.load(Ordering::Relaxed) == 0 {
            let mut plan = auto.plan.lock();
            if plan.generation == generation {
                plan.status = "training".into();
            }
        }
        let shared = Arc::clone(self);
        let spawned = std::thread::Builder::new().name("tmem-dictionary".into()).spawn(move || {
            let Some(auto) = shared.auto_dictionary.get() else { return };
            let (status, state) = auto.run(&shared, &base, generation);
            auto.finish(generation, status, state);
        });
        if let Err(e) = spawned {
            auto.finish(generation, Some(format!("failed: cannot start the training thread: {e}")), FINISHED);
        }
    }

    /// Automatic training status, if configured or armed by hand.
    pub(super) fn dictionary_status(&self) -> Option<String> {
        self.auto_dictionary.get().map(|a| a.plan.lock().status.clone())
    }
}

impl Store {
    /// Trains a dictionary for `base` on a sample of the pages stored now,
    /// and switches new puts to `base` with that dictionary. Stored pages
    /// keep their codec. Fails (changing nothing) if the pool holds too few
    /// pages to train on.
    pub fn train_dictionary(&self, base: &CodecConfig, cfg: &DictTraining) -> Result<TrainedDictionary, StoreError> {
        self.shared.train_dictionary(base, cfg, None)
    }

    /// Sets `base` with a dictionary by hand: trains one on the pages stored
    /// now, or, when they are fewer than [`MIN_TRAINING_PAGES`], uses `base`
    /// alone and arms automatic training for it (with `cfg` if the store had
    /// none configured). Ends any automatic training of another codec.
    pub fn use_dictionary_codec(&self, base: &CodecConfig, cfg: &DictTraining) -> Result<DictionaryCodec, StoreError> {
        let shared = &self.shared;
        match shared.train_dictionary(base, cfg, None) {
            Ok(t) => {
                if let Some(auto) = shared.auto_dictionary.get() {
                    auto.end();
                }
                Ok(DictionaryCodec::Trained(t))
            }
            Err(StoreError::TooFewPagesToTrain { pages, .. }) => {
                let id = shared.find_or_register_codec(base)?;
                let auto = shared.auto_dictionary.get_or_init(|| AutoDictionary::new(base.clone(), cfg.clone()));
                auto.arm(base.clone());
                shared.set_codec(id)?;
                Ok(DictionaryCodec::Deferred { pages, after_bytes: auto.cfg.after_bytes })
            }
            Err(e) => Err(e),
        }
    }

    /// Sets the codec of new puts by hand, without a dictionary; ends
    /// automatic training.
    pub fn use_codec_by_hand(&self, cfg: &CodecConfig) -> Result<u8, StoreError> {
        let id = self.shared.find_or_register_codec(cfg)?;
        if let Some(auto) = self.shared.auto_dictionary.get() {
            auto.end();
        }
        self.shared.set_codec(id)?;
        Ok(id)
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::{Key, PoolConfig, StoreConfig};
    use rand_xoshiro::rand_core::{RngCore, SeedableRng};
    use rand_xoshiro::Xoshiro256PlusPlus;

    /// JSON-like records: what a dictionary learns (keys, punctuation) recurs
    /// on every page, while the values differ.
    fn record_page(seed: u64) -> [u8; PAGE_SIZE] {
        let mut text = String::new();
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
        while text.len() < PAGE_SIZE {
            let x = rng.next_u64();
            text.push_str(&format!(
                "{{\"user_id\": {}, \"session\": \"{:x}\", \"balance\": {}.{:02}, \"flags\": [\"active\", \"verified\"]}},\n",
                x % 100_000,
                x >> 20,
                x % 9973,
                x % 100
            ));
        }
        let mut p = [0u8; PAGE_SIZE];
        p.copy_from_slice(&text.as_bytes()[..PAGE_SIZE]);
        p
    }

    fn key(i: u64) -> Key {
        Key::new(1, i)
    }

    /// Random bytes: stored raw, so they take room but give no sample.
    fn random_page(seed: u64) -> [u8; PAGE_SIZE] {
        let mut p = [0u8; PAGE_SIZE];
        Xoshiro256PlusPlus::seed_from_u64(seed).fill_bytes(&mut p);
        p
    }

    /// A store that trains after 64 KiB and keeps incompressible pages raw.
    fn store_training_early() -> Store {
        let training = store_cfg();
        let policy = crate::PolicyConfig { incompressible: crate::Incompressible::StoreRaw, ..Default::default() };
        StoreConfig { dictionary: Some(training), policy, ..Default::default() }.build().unwrap()
    }

    /// Shows `done` the training status until it returns true (for 30 s at
    /// most), and returns that status.
    fn settled_status(store: &Store, mut done: impl FnMut(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let status = store.stats().dictionary.unwrap();
            if done(&status) {
                return status;
            }
            assert!(Instant::now() < deadline, "training did not settle in 30 s: {status}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Puts `page(i)` at keys `from, from + 1, ...` until `done` holds for
    /// the training status; returns that status and the first key not put.
    fn put_until(
        store: &Store,
        pool: &Pool,
        from: u64,
        page: fn(u64) -> [u8; PAGE_SIZE],
        done: impl Fn(&str) -> bool,
    ) -> (String, u64) {
        let mut i = from;
        let status = settled_status(store, |s| {
            if !done(s) {
                assert_eq!(pool.put(key(i), &page(i)).unwrap(), crate::PutOutcome::Stored);
                i += 1;
            }
            done(s)
        });
        (status, i)
    }

    #[test]
    fn automatic_training_switches_codec_and_keeps_every_page() {
        let training =
            DictTraining { after_bytes: 256 << 10, sample_pages: 256, dict_bytes: 8192, max_dictionaries: 1 };
        let store = StoreConfig { dictionary: Some(training), ..Default::default() }.build().unwrap();
        let pool = store.create_pool(PoolConfig::persistent());
        assert_eq!(store.stats().dictionary.as_deref(), Some("waiting"));
        let compressed = |store: &Store| store.stats().total.compr_data_size;
        for i in 0..1000 {
            assert_eq!(pool.put(key(i), &record_page(i)).unwrap(), crate::PutOutcome::Stored);
        }
        let first = compressed(&store);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !store.stats().dictionary.unwrap().starts_with("trained") {
            let status = store.stats().dictionary.unwrap();
            assert!(!status.starts_with("failed"), "{status}");
            assert!(Instant::now() < deadline, "no dictionary after 30 s: {status}");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(store.codec_name(), "lz4+dict");
        for i in 1000..2000 {
            assert_eq!(pool.put(key(i), &record_page(i)).unwrap(), crate::PutOutcome::Stored);
        }
        let second = compressed(&store) - first;
        assert!(second * 20 < first * 19, "the dictionary saves at least 5%: {second} vs {first} bytes per 1000 pages");
        let mut out = [0u8; PAGE_SIZE];
        for i in 0..2000 {
            assert_eq!(pool.get(key(i), &mut out).unwrap(), crate::GetOutcome::Hit);
            assert_eq!(out, record_page(i), "page {i}");
        }
    }

    #[test]
    fn failed_automatic_training_is_tried_again_once_the_pool_has_doubled() {
        let store = store_training_early();
        let pool = store.create_pool(PoolConfig::persistent());
        for i in 0..32 {
            assert_eq!(pool.put(key(i), &random_page(i)).unwrap(), crate::PutOutcome::Stored);
        }
        let status = settled_status(&store, |s| s.starts_with("failed"));
        assert!(status.contains("try 1 of 3; next at"), "{status}");
        assert_eq!(store.codec_name(), "lz4");
        let (status, i) = put_until(&store, &pool, 1000, record_page, |s| s.starts_with("trained"));
        assert_eq!(store.codec_name(), "lz4+dict", "{status}");
        let mut out = [0u8; PAGE_SIZE];
        for j in (0..32).chain(1000..i) {
            assert_eq!(pool.get(key(j), &mut out).unwrap(), crate::GetOutcome::Hit);
            let want = if j < 32 { random_page(j) } else { record_page(j) };
            assert_eq!(out, want, "page {j}");
        }
    }

    #[test]
    fn automatic_training_gives_up_after_three_failed_tries() {
        let store = store_training_early();
        let pool = store.create_pool(PoolConfig::persistent());
        let (status, i) = put_until(&store, &pool, 0, random_page, |s| s.contains("no more"));
        assert!(status.starts_with("failed") && status.contains("try 3 of 3"), "{status}");
        // Tries at 64 KiB, then at twice what the pool held at each failure:
        // some 256 KiB of raw pages (64) in all.
        assert!((48..512).contains(&i), "gave up after {i} pages");
        for j in i..i + 512 {
            assert_eq!(pool.put(key(j), &random_page(j)).unwrap(), crate::PutOutcome::Stored);
        }
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(store.stats().dictionary.unwrap(), status, "no fourth try");
        assert_eq!(store.codec_name(), "lz4");
    }

    /// Log lines: nothing in common with [`record_page`]'s vocabulary.
    fn log_page(seed: u64) -> [u8; PAGE_SIZE] {
        let mut text = String::new();
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed ^ 0x5eed);
        while text.len() < PAGE_SIZE {
            let x = rng.next_u64();
            text.push_str(&format!(
                "Nov 26 12:{:02}:{:02} worker[{}]: GET /api/v2/orders?page={} status=200 took={}ms cache=miss\n",
                x % 60,
                (x >> 8) % 60,
                x % 977,
                (x >> 16) % 5000,
                (x >> 32) % 900
            ));
        }
        let mut p = [0u8; PAGE_SIZE];
        p.copy_from_slice(&text.as_bytes()[..PAGE_SIZE]);
        p
    }

    #[test]
    fn a_new_dictionary_is_trained_as_the_pool_grows_into_other_pages() {
        let store = store_training_early();
        let pool = store.create_pool(PoolConfig::persistent());
        let (status, i) = put_until(&store, &pool, 0, record_page, |s| s.starts_with("trained"));
        assert!(status.starts_with("trained: "), "{status}");
        let first = store.codec_name();
        // The pool grows into pages of another program: at four times its
        // size, a new dictionary trained on the whole pool replaces the first.
        let (status, j) = put_until(&store, &pool, 100_000, log_page, |s| s.starts_with("retrained"));
        assert!(status.contains("dictionary 2 saves") && status.contains(" KiB in the pool ("), "{status}");
        let saved: f64 = status.split(" saves ").nth(1).and_then(|t| t.split('%').next()).unwrap().parse().unwrap();
        assert!(saved >= 3.1, "{status}");
        assert_eq!(store.codec_name(), first, "the same codec, with another dictionary");
        assert_eq!(*store.shared.codec_count.lock(), 4, "raw, lz4 and both dictionaries stay registered");
        let mut out = [0u8; PAGE_SIZE];
        for k in (0..i).chain(100_000..j) {
            assert_eq!(pool.get(key(k), &mut out).unwrap(), crate::GetOutcome::Hit);
            assert_eq!(out, if k < i { record_page(k) } else { log_page(k) }, "page {k}");
        }
    }

    #[test]
    fn a_new_dictionary_that_saves_little_is_not_used_and_a_codec_set_by_hand_ends_training() {
        let store = store_training_early();
        let pool = store.create_pool(PoolConfig::persistent());
        let (_, i) = put_until(&store, &pool, 0, record_page, |s| s.starts_with("trained"));
        // A try on the same pool trains on the same pages: the second of two
        // in a row finds a dictionary no better than the current one (or,
        // when the first switched, no page of the new one to measure on).
        let id = || store.shared.current_codec.load(Ordering::Relaxed);
        store.shared.retrain_dictionary(&CodecConfig::LZ4, &store_cfg(), id(), None).unwrap();
        let before = id();
        let r = store.shared.retrain_dictionary(&CodecConfig::LZ4, &store_cfg(), before, None).unwrap();
        assert!(
            matches!(r, Retraining::Kept { old_bytes, new_bytes, .. } if new_bytes * 32 > old_bytes * 31 || old_bytes == 0),
            "{r:?}"
        );
        assert_eq!(id(), before, "nothing changed");
        // A codec set by hand since: the next automatic try ends training.
        let lz4 = store.register_codec(&CodecConfig::LZ4).unwrap();
        store.set_codec(lz4).unwrap();
        let (status, _) = put_until(&store, &pool, i, record_page, |s| s.contains("by hand"));
        assert_eq!(status, "trained; the codec was set by hand since: no more tries");
        assert_eq!(store.codec_name(), "lz4");
    }

    fn store_cfg() -> DictTraining {
        DictTraining { after_bytes: 64 << 10, sample_pages: 256, dict_bytes: 8192, max_dictionaries: MAX_DICTIONARIES }
    }

    #[test]
    fn tries_stop_after_the_last_dictionary() {
        let auto = AutoDictionary::new(CodecConfig::LZ4, store_cfg());
        auto.dictionaries.store(1, Ordering::Relaxed);
        assert_eq!(auto.next_look(1 << 20), (String::new(), WAITING));
        assert_eq!(auto.next_bytes.load(Ordering::Relaxed), (1 << 20) + (64 << 10), "the next look, after_bytes later");
        auto.dictionaries.store(MAX_DICTIONARIES, Ordering::Relaxed);
        assert_eq!(auto.next_look(8 << 20), ("; no more tries (4 dictionaries)".into(), FINISHED));
    }

    #[test]
    fn training_without_pages_fails_and_changes_nothing() {
        let store = StoreConfig::default().build().unwrap();
        let _pool = store.create_pool(PoolConfig::persistent());
        assert!(matches!(
            store.train_dictionary(&CodecConfig::LZ4, &DictTraining::default()),
            Err(StoreError::TooFewPagesToTrain { pages: 0, need: MIN_TRAINING_PAGES })
        ));
        assert_eq!(store.codec_name(), "lz4");
        assert_eq!(store.stats().dictionary, None);
    }

    /// A default store with one persistent pool holding `record_page(0..n)`.
    fn store_of_records(n: u64) -> (Store, Arc<Pool>) {
        store_of_records_in(StoreConfig::default(), n)
    }

    /// A store built from `cfg` with one persistent pool holding `record_page(0..n)`.
    fn store_of_records_in(cfg: StoreConfig, n: u64) -> (Store, Arc<Pool>) {
        let store = cfg.build().unwrap();
        let pool = store.create_pool(PoolConfig::persistent());
        for i in 0..n {
            assert_eq!(pool.put(key(i), &record_page(i)).unwrap(), crate::PutOutcome::Stored);
        }
        (store, pool)
    }

    #[test]
    fn a_dictionary_codec_set_on_a_small_pool_is_trained_once_the_pool_grows() {
        let (store, pool) = store_of_records(4);
        let zstd = CodecConfig::Zstd { level: 3, dictionary: None };
        let r = store.use_dictionary_codec(&zstd, &store_cfg()).unwrap();
        assert_eq!(r, DictionaryCodec::Deferred { pages: 4, after_bytes: 64 << 10 });
        assert_eq!(store.codec_name(), "zstd-3", "the base codec until there is a dictionary");
        assert_eq!(store.stats().dictionary.as_deref(), Some("waiting"));
        let (status, i) = put_until(&store, &pool, 4, record_page, |s| s.starts_with("trained"));
        assert!(status.starts_with("trained: "), "{status}");
        assert_eq!(store.codec_name(), "zstd-3+dict");
        let mut out = [0u8; PAGE_SIZE];
        for j in 0..i {
            assert_eq!(pool.get(key(j), &mut out).unwrap(), crate::GetOutcome::Hit);
            assert_eq!(out, record_page(j), "page {j}");
        }
        // Set by hand again, with enough pages: trained at once.
        let r = store.use_dictionary_codec(&CodecConfig::LZ4, &store_cfg()).unwrap();
        assert!(matches!(r, DictionaryCodec::Trained(_)), "{r:?}");
        assert_eq!(store.codec_name(), "lz4+dict");
    }

    #[test]
    fn a_codec_set_by_hand_ends_armed_training() {
        let store = StoreConfig::default().build().unwrap();
        let pool = store.create_pool(PoolConfig::persistent());
        let zstd = CodecConfig::Zstd { level: 3, dictionary: None };
        let r = store.use_dictionary_codec(&zstd, &store_cfg()).unwrap();
        assert!(matches!(r, DictionaryCodec::Deferred { pages: 0, .. }), "{r:?}");
        store.use_codec_by_hand(&CodecConfig::LZ4).unwrap();
        assert_eq!(
            store.stats().dictionary.as_deref(),
            Some("waiting; the codec was set by hand since: no more tries")
        );
        for i in 0..200 {
            assert_eq!(pool.put(key(i), &record_page(i)).unwrap(), crate::PutOutcome::Stored);
        }
        assert!(store.stats().total.compr_data_size > 64 << 10, "past the training threshold");
        assert_eq!(store.codec_name(), "lz4", "no training started");
        assert!(store.stats().dictionary.unwrap().ends_with("no more tries"));
    }

    #[test]
    fn explicit_training_samples_evenly_and_switches() {
        let (store, pool) = store_of_records(500);
        let zstd = CodecConfig::Zstd { level: 1, dictionary: None };
        let t = store.train_dictionary(&zstd, &DictTraining { sample_pages: 100, ..Default::default() }).unwrap();
        assert!((90..=100).contains(&t.sample_pages), "sampled {} pages", t.sample_pages);
        assert_eq!(store.codec_name(), "zstd-1+dict");
        assert_eq!(pool.put(key(9999), &record_page(9999)).unwrap(), crate::PutOutcome::Stored);
        let mut out = [0u8; PAGE_SIZE];
        for i in (0..500).chain([9999]) {
            assert_eq!(pool.get(key(i), &mut out).unwrap(), crate::GetOutcome::Hit);
            assert_eq!(out, record_page(i));
        }
    }

    /// `store` exported and imported into a new store built without
    /// automatic training (as a daemon's successor is).
    fn handed_over(store: &Store) -> Store {
        let mut stream = Vec::new();
        store.export(&mut stream).unwrap();
        Store::import(StoreConfig::default(), &mut stream.as_slice()).unwrap().0
    }

    /// Finding (session 17): a successor trained nothing, so a restart
    /// before the pool reached `after_bytes` left it without a dictionary
    /// for good.
    #[test]
    fn training_that_was_waiting_goes_on_in_the_successor() {
        let (store, pool) = store_of_records_in(StoreConfig { dictionary: Some(store_cfg()), ..Default::default() }, 4);
        assert_eq!(store.stats().dictionary.as_deref(), Some("waiting"));
        let next = handed_over(&store);
        assert_eq!(next.stats().dictionary.as_deref(), Some("waiting"));
        let pool = next.pool(pool.id).unwrap();
        let (status, end) = put_until(&next, &pool, 4, record_page, |s| s.starts_with("trained"));
        assert_eq!(next.codec_name(), "lz4+dict", "{status}");
        assert!(next.stats().total.compr_data_size >= 64 << 10, "trained at the predecessor's threshold");
        let mut out = [0u8; PAGE_SIZE];
        for i in 0..end {
            assert_eq!(pool.get(key(i), &mut out).unwrap(), crate::GetOutcome::Hit);
            assert_eq!(out, record_page(i), "page {i}");
        }
    }

    #[test]
    fn a_successor_does_not_train_again_what_was_trained() {
        let one = DictTraining { max_dictionaries: 1, ..store_cfg() };
        let store = StoreConfig { dictionary: Some(one), ..Default::default() }.build().unwrap();
        let pool = store.create_pool(PoolConfig::persistent());
        let (status, end) = put_until(&store, &pool, 0, record_page, |s| s.contains("no more tries"));
        let next = handed_over(&store);
        assert_eq!(next.stats().dictionary.as_deref(), Some(status.as_str()));
        assert_eq!(next.codec_name(), "lz4+dict");
        let pool = next.pool(pool.id).unwrap();
        for i in end..end + 200 {
            assert_eq!(pool.put(key(i), &record_page(i)).unwrap(), crate::PutOutcome::Stored);
        }
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(next.stats().dictionary.as_deref(), Some(status.as_str()), "no second dictionary");
        assert_eq!(next.codec_name(), "lz4+dict");
    }

    #[test]
    fn a_successor_keeps_a_codec_set_by_hand() {
        let store = StoreConfig::default().build().unwrap();
        let pool = store.create_pool(PoolConfig::persistent());
        let zstd = CodecConfig::Zstd { level: 3, dictionary: None };
        store.use_dictionary_codec(&zstd, &store_cfg()).unwrap();
        store.use_codec_by_hand(&CodecConfig::LZ4).unwrap();
        let next = handed_over(&store);
        assert_eq!(next.stats().dictionary, store.stats().dictionary);
        let pool = next.pool(pool.id).unwrap();
        for i in 0..200 {
            assert_eq!(pool.put(key(i), &record_page(i)).unwrap(), crate::PutOutcome::Stored);
        }
        assert!(next.stats().total.compr_data_size > 64 << 10, "past the training threshold");
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(next.codec_name(), "lz4", "no training started");
    }
}
