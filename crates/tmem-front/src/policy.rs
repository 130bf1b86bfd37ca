//! What goes down from the front to tmem, and when.
//!
//! Every tick (1 s) the policy samples the front: its pool, the pages it
//! wrote back to tmem's device and the pages it read back from it. Then:
//!
//! * **Fill level.** Nothing goes down while the front's pool is below
//!   `fill_percent` of its budget: a front with room keeps every page, and
//!   a job that fits loses nothing to tiering.
//! * **Idle age.** Above it, pages not accessed for `idle_age` go down, at
//!   most `rate` pages a second (zram's `writeback_limit`). A page read
//!   again within the age is not idle, so a hot page stays in the front.
//! * **Slow start.** The rate starts at `min_rate` and doubles at each
//!   judgement that finds what went down stayed down, up to `rate`: before
//!   anything has had the time to come back, a uniformly hot job, whose
//!   pages all look idle between two passes, sends few of them down.
//! * **Learning from reads back.** The pages written back and the pages
//!   read back are averaged over a horizon of twice the current age, at
//!   least [`MIN_HORIZON_TICKS`] (reads lag the writes they answer, by up
//!   to the job's period, so they are weighed against the writes of that
//!   horizon, not the same tick's). Every [`JUDGE_TICKS`] ticks in which
//!   pages went down, when more than `backoff_percent` of what went down
//!   came back, the age doubles and the rate halves (up to `max_idle_age`,
//!   down to `min_rate`); at both bounds writeback pauses for one age.
//!   Under a quarter of that, age, rate and fill level step back towards
//!   their configured values. A uniformly hot job (every page read at each
//!   pass) thus stops tiering after its first pages come back.
//! * **The fill level backs off too.** Each back-off also raises the fill
//!   level by [`FILL_STEP`] points, up to [`MAX_FILL_PERCENT`]: a job whose
//!   pages come back whatever their age (one slower than the longest age)
//!   keeps what fits in the front there. Each relax lowers it again, and so
//!   does a quiet age (nothing read back for one current age; little goes
//!   down then, so there is nothing to judge), so a front left full of
//!   pages that turned cold tiers them again. A job that is still hot pays
//!   one more round of writeback per age for that probe.
//! * **Freed blocks below.** zram marks a written-back block free only in
//!   its own bitmap, so tmem keeps the block's page until zram writes the
//!   block again. When tmem holds more than twice the pages zram counts
//!   below (`bd_stat`), plus [`RECLAIM_SLACK_PAGES`], at most once every
//!   [`RECLAIM_TICKS`], the policy has the front reclaim them
//!   ([`FrontOps::reclaim_below`]): under a lock its writebacks take too,
//!   zram reads every block it still uses, and tmem drops every page of
//!   its device that was not read.
//! * **Emergency.** At [`EMERGENCY_PERCENT`] of the budget the front is
//!   about to refuse pages (zram's `mem_limit`): the shortest age and the
//!   full rate apply, pause or not.
//!
//! [`Policy`] is plain arithmetic over [`Sample`]s (tested against a
//! simulated front); [`PolicyThread`] runs it against a real front through
//! [`FrontOps`].

use std::sync::Arc;
use std::time::Duration;

use tmem_lock::{Condvar, Mutex, Rank};

use crate::{FrontError, FrontStats};

/// The shortest horizon, in ticks, of the averaged written and read-back
/// pages. The horizon is twice the current age where that is longer: a page
/// written back comes back no sooner than the job's period less the age, so
/// a shorter horizon forgets the writes before their reads arrive and
/// relaxes on a job whose pages all come back (a sim of a job with a period
/// of 120 ticks, ages 5 to 80, in the 1,200 ticks after the back-off: 8,512
/// pages went down with a fixed horizon of 10 ticks, 640 with this one, all
/// of them the fill level's quiet probes).
pub const MIN_HORIZON_TICKS: u64 = 10;
/// Ticks between two judgements of the reads back.
pub const JUDGE_TICKS: u64 = 5;
/// Averaged pages written back below which there is nothing to judge
/// (half the least rate, where that is lower: one tick at the least rate is
/// a deliberate writeback, not noise).
const MIN_JUDGED_PAGES: f64 = 64.0;
/// Ticks between two reclaims of freed blocks below (and before the first).
pub const RECLAIM_TICKS: u64 = 20;
/// Pages tmem may hold below beyond twice zram's count before a reclaim.
pub const RECLAIM_SLACK_PAGES: u64 = 256;
/// Fill level (% of the budget) at which the front is about to refuse pages.
pub const EMERGENCY_PERCENT: u64 = 90;
/// Points of the budget one back-off adds to the fill level (one relax
/// takes them off).
pub const FILL_STEP: u64 = 10;
/// The highest fill level backing off may reach: below the emergency
/// level, so that what comes back has room before the front refuses pages.
pub const MAX_FILL_PERCENT: u64 = EMERGENCY_PERCENT - 5;

/// One look at the front: its pool now, and cumulative page counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sample {
    /// Memory of the front's pool, bytes.
    pub pool_bytes: u64,
    /// Uncompressed bytes it holds.
    pub stored_bytes: u64,
    /// Pages it wrote back to tmem's device, since it was set up.
    pub written: u64,
    /// Pages it read back from tmem's device, since it was set up.
    pub read_back: u64,
    /// Pages read from it, those read back included (`None`: the kernel
    /// does not count them).
    pub front_reads: Option<u64>,
    /// Pages it holds on the device below now (`None`: it does not say;
    /// nothing below is then reclaimed).
    pub below_pages: Option<u64>,
    /// Pages tmem holds on the device below now (`None`: unknown).
    pub below_stored: Option<u64>,
}

/// What a front does for the policy.
pub trait FrontOps: Send + Sync {
    /// Samples the front.
    fn sample(&self) -> Result<Sample, FrontError>;
    /// Writes back up to `max_pages` pages not accessed for `age`; returns
    /// how many times it marked pages idle to do so.
    fn write_back_idle(&self, age: Duration, max_pages: u64) -> Result<u64, FrontError>;
    /// Lets the front write back on its own, or stops it (zswap's
    /// shrinker); fronts that write back only when told ignore it.
    fn allow_writeback(&self, on: bool) -> Result<(), FrontError>;
    /// Has tmem drop the pages of blocks the front has freed below
    /// (reading, under a lock its writebacks take too, every block it still
    /// uses); returns the pages dropped, `None` where it cannot.
    fn reclaim_below(&self) -> Result<Option<u64>, FrontError> {
        Ok(None)
    }
}

/// The policy's settings.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PolicyConfig {
    /// How often it looks.
    pub tick: Duration,
    /// Idle age a page must reach to go down (the shortest it uses).
    pub idle_age: Duration,
    /// The longest age backing off may reach.
    pub max_idle_age: Duration,
    /// The front's budget, bytes.
    pub budget: u64,
    /// Fill level of the budget, %, below which nothing goes down.
    pub fill_percent: u64,
    /// Pages a second it may write back (the most).
    pub rate: u64,
    /// The least rate backing off may reach.
    pub min_rate: u64,
    /// Share of written-back pages read back, %, above which it backs off.
    pub backoff_percent: u64,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            tick: Duration::from_secs(1),
            idle_age: Duration::from_secs(30),
            max_idle_age: Duration::from_secs(30 * 32),
            budget: 256 << 20,
            fill_percent: 50,
            rate: 25_600,
            min_rate: 256,
            backoff_percent: 25,
        }
    }
}

/// What to do this tick.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    /// Write back up to this many pages idle for this long.
    pub write_back: Option<(Duration, u64)>,
    /// Whether the front may write back on its own.
    pub allow_writeback: bool,
    /// Reclaim the pages of blocks freed below first.
    pub reclaim_below: bool,
}

/// Why the policy does what it does now (for `tmem stat`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// Below the fill level: nothing goes down.
    BelowFill,
    /// Writing back idle pages.
    WritingBack,
    /// Paused until the given tick: written-back pages came back.
    Paused(u64),
    /// At the emergency fill level.
    Emergency,
}

/// The policy: plain arithmetic over samples.
#[derive(Clone, Debug)]
pub struct Policy {
    cfg: PolicyConfig,
    age: Duration,
    rate: u64,
    /// Fill level now, % of the budget: `fill_percent` backed off.
    fill: u64,
    tick: u64,
    /// The tick of the last page read back (or of the last quiet relax).
    last_read_tick: u64,
    /// Whether pages were written back since the last judgement: averages
    /// that only decayed since say nothing new.
    written_since_judged: bool,
    prev: Option<Sample>,
    /// The tick of the last reclaim below.
    reclaimed_at: u64,
    /// Decayed averages of pages written back and read back per tick.
    avg_written: f64,
    avg_read: f64,
    state: State,
    last_ratio_percent: u64,
    stats: FrontStats,
}

impl Policy {
    /// A policy at its configured age and least rate (a slow start).
    #[must_use]
    pub fn new(cfg: PolicyConfig) -> Self {
        let stats = FrontStats { budget_bytes: cfg.budget, ..FrontStats::default() };
        Self {
            age: cfg.idle_age,
            rate: cfg.min_rate.min(cfg.rate),
            fill: cfg.fill_percent,
            tick: 0,
            last_read_tick: 0,
            written_since_judged: false,
            prev: None,
            reclaimed_at: 0,
            avg_written: 0.0,
            avg_read: 0.0,
            state: State::BelowFill,
            last_ratio_percent: 0,
            stats,
            cfg,
        }
    }

    /// The current idle age.
    #[must_use]
    pub fn age(&self) -> Duration {
        self.age
    }

    /// The current rate, pages a second.
    #[must_use]
    pub fn rate(&self) -> u64 {
        self.rate
    }

    /// The current fill level, % of the budget.
    #[must_use]
    pub fn fill_percent(&self) -> u64 {
        self.fill
    }

    /// What it does now.
    #[must_use]
    pub fn state(&self) -> State {
        self.state
    }

    /// Counts idle marks the front made for a decision.
    pub fn count_marks(&mut self, marks: u64) {
        self.stats.idle_marks += marks;
    }

    /// Its counters, with `base`'s descriptive fields.
    #[must_use]
    pub fn stats(&self, base: &FrontStats) -> FrontStats {
        FrontStats {
            front: base.front.clone(),
            node: base.node.clone(),
            reason: base.reason.clone(),
            state: self.state_line(),
            idle_age_us: u64::try_from(self.age.as_micros()).unwrap_or(u64::MAX),
            rate_pages: self.rate,
            fill_bytes: self.cfg.budget / 100 * self.fill,
            ..self.stats.clone()
        }
    }

    fn state_line(&self) -> String {
        match self.state {
            State::BelowFill => format!("below {}% of the budget: nothing goes down", self.fill),
            State::WritingBack => format!(
                "writing back pages idle for {} s, at most {} pages/s ({}% of recent ones came back)",
                self.age.as_secs(),
                self.rate,
                self.last_ratio_percent
            ),
            State::Paused(until) => format!(
                "paused for {} s: {}% of the pages written back came back",
                until.saturating_sub(self.tick) * self.cfg.tick.as_secs().max(1),
                self.last_ratio_percent
            ),
            State::Emergency => format!("at {EMERGENCY_PERCENT}% of the budget: writing back at the shortest age"),
        }
    }

    /// One tick: takes the sample, learns, decides.
    pub fn step(&mut self, s: &Sample) -> Decision {
        self.tick += 1;
        let (dw, dr) = match self.prev {
            Some(p) => (s.written.saturating_sub(p.written), s.read_back.saturating_sub(p.read_back)),
            None => (0, 0),
        };
        // Reads the front answered from its own pool (zram counts a read
        // back among its reads too).
        if let (Some(a), Some(b)) = (self.prev.and_then(|p| p.front_reads), s.front_reads) {
            self.stats.front_reads += b.saturating_sub(a).saturating_sub(dr);
        }
        let reclaim_below = self.reclaim_due(s);
        self.prev = Some(*s);
        self.stats.written_back += dw;
        self.stats.read_back += dr;
        self.stats.pool_bytes = s.pool_bytes;
        self.stats.stored_bytes = s.stored_bytes;
        let decay = 1.0 - 1.0 / (2 * self.age_ticks()).max(MIN_HORIZON_TICKS) as f64;
        self.avg_written = self.avg_written * decay + dw as f64;
        self.avg_read = self.avg_read * decay + dr as f64;
        if dr > 0 {
            self.last_read_tick = self.tick;
        }
        self.written_since_judged |= dw > 0;
        let judged = MIN_JUDGED_PAGES.min(self.cfg.min_rate as f64 / 2.0);
        if self.tick.is_multiple_of(JUDGE_TICKS) && self.avg_written >= judged && self.written_since_judged {
            self.written_since_judged = false;
            self.judge();
        } else if self.fill > self.cfg.fill_percent && self.tick - self.last_read_tick >= self.age_ticks() {
            // Quiet for one age, with too little going down to judge: try
            // a lower fill level. Age and rate keep what they learned.
            self.last_read_tick = self.tick;
            self.stats.relaxes += 1;
            self.lower_fill();
        }
        let budget = self.cfg.budget.max(1);
        let fill = s.pool_bytes.saturating_mul(100) / budget;
        let paused = matches!(self.state, State::Paused(until) if until > self.tick);
        let ticks_per_sec = 1.0 / self.cfg.tick.as_secs_f64().max(1e-3);
        let per_tick = |rate: u64| whole(rate as f64 / ticks_per_sec).max(1);
        let (state, write_back) = if fill >= EMERGENCY_PERCENT {
            (State::Emergency, Some((self.cfg.idle_age.min(self.age), per_tick(self.cfg.rate))))
        } else if paused {
            (self.state, None)
        } else if fill >= self.fill {
            (State::WritingBack, Some((self.age, per_tick(self.rate))))
        } else {
            (State::BelowFill, None)
        };
        self.state = state;
        if write_back.is_some() {
            self.stats.writeback_runs += 1;
        }
        Decision { write_back, allow_writeback: !matches!(state, State::Paused(_)), reclaim_below }
    }

    /// Counts a reclaim below that dropped `pages` pages.
    pub fn count_reclaim(&mut self, pages: u64) {
        self.stats.below_reclaims += 1;
        self.stats.below_reclaimed += pages;
    }

    /// Whether tmem holds enough pages of blocks freed below to reclaim
    /// them now.
    fn reclaim_due(&mut self, s: &Sample) -> bool {
        let (Some(live), Some(stored)) = (s.below_pages, s.below_stored) else { return false };
        if self.tick < self.reclaimed_at + RECLAIM_TICKS || stored <= live * 2 + RECLAIM_SLACK_PAGES {
            return false;
        }
        self.reclaimed_at = self.tick;
        true
    }

    /// Backs off or relaxes by the share of written-back pages read back.
    fn judge(&mut self) {
        let ratio = whole(self.avg_read * 100.0 / self.avg_written);
        self.last_ratio_percent = ratio;
        if ratio > self.cfg.backoff_percent {
            self.stats.backoffs += 1;
            if self.age >= self.cfg.max_idle_age && self.rate <= self.cfg.min_rate {
                self.state = State::Paused(self.tick + self.age_ticks());
            }
            self.age = (self.age * 2).min(self.cfg.max_idle_age);
            self.rate = (self.rate / 2).max(self.cfg.min_rate);
            self.fill = (self.fill + FILL_STEP).min(MAX_FILL_PERCENT).max(self.cfg.fill_percent);
        } else if ratio * 4 <= self.cfg.backoff_percent && self.backed_off() {
            self.relax();
        }
    }

    /// Whether age, rate or fill level is off its configured value.
    fn backed_off(&self) -> bool {
        self.age > self.cfg.idle_age || self.rate < self.cfg.rate || self.fill > self.cfg.fill_percent
    }

    /// One step back towards the configured age, rate and fill level.
    fn relax(&mut self) {
        self.stats.relaxes += 1;
        self.age = (self.age / 2).max(self.cfg.idle_age);
        self.rate = (self.rate * 2).min(self.cfg.rate);
        self.lower_fill();
    }

    /// One step of the fill level back towards its configured value.
    fn lower_fill(&mut self) {
        self.fill = self.fill.saturating_sub(FILL_STEP).max(self.cfg.fill_percent);
    }

    /// The current age in ticks (at least one).
    fn age_ticks(&self) -> u64 {
        whole(self.age.as_secs_f64() / self.cfg.tick.as_secs_f64().max(1e-3)).max(1)
    }
}

/// `x` rounded up to a whole number (`as` saturates: negative or NaN is 0).
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn whole(x: f64) -> u64 {
    x.ceil() as u64
}

/// Stop flag of a [`PolicyThread`].
type Stop = Arc<(Mutex<bool>, Condvar)>;

/// A [`Policy`] running on a thread of its own against a front.
pub struct PolicyThread {
    stop: Stop,
    stats: Arc<Mutex<FrontStats>>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl PolicyThread {
    /// Starts the policy against `ops`; `base` carries the front's name,
    /// node and reason into its counters.
    pub fn spawn(ops: Arc<dyn FrontOps>, cfg: PolicyConfig, base: FrontStats) -> Result<Self, FrontError> {
        let stop: Stop = Arc::new((Mutex::new(Rank::FrontStop, false), Condvar::new()));
        let mut policy = Policy::new(cfg.clone());
        let stats = Arc::new(Mutex::new(Rank::FrontStats, policy.stats(&base)));
        let (stop2, stats2) = (Arc::clone(&stop), Arc::clone(&stats));
        let handle = std::thread::Builder::new()
            .name("tmem-front".into())
            .spawn(move || {
                let mut allowed = true;
                let mut last_error = String::new();
                loop {
                    {
                        let mut stopped = stop2.0.lock();
                        if !*stopped {
                            stop2.1.wait_for(&mut stopped, cfg.tick);
                        }
                        if *stopped {
                            return;
                        }
                    }
                    let result = ops.sample().and_then(|s| {
                        let d = policy.step(&s);
                        if d.reclaim_below {
                            if let Some(pages) = ops.reclaim_below()? {
                                policy.count_reclaim(pages);
                            }
                        }
                        if d.allow_writeback != allowed {
                            ops.allow_writeback(d.allow_writeback)?;
                            allowed = d.allow_writeback;
                        }
                        if let Some((age, pages)) = d.write_back {
                            let marks = ops.write_back_idle(age, pages)?;
                            policy.count_marks(marks);
                        }
                        Ok(())
                    });
                    match result {
                        Ok(()) => last_error.clear(),
                        Err(e) => {
                            let e = e.to_string();
                            if e != last_error {
                                tracing::warn!("front policy: {e}");
                                last_error = e;
                            }
                        }
                    }
                    *stats2.lock() = policy.stats(&base);
                }
            })
            .map_err(FrontError::Spawn)?;
        Ok(Self { stop, stats, handle: Some(handle) })
    }

    /// Its latest counters.
    #[must_use]
    pub fn stats(&self) -> FrontStats {
        self.stats.lock().clone()
    }

    /// Stops the thread and waits for it.
    pub fn stop(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        *self.stop.0.lock() = true;
        self.stop.1.notify_all();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

impl Drop for PolicyThread {
    fn drop(&mut self) {
        self.stop_now();
    }
}

#[cfg(test)]
mod tests;
