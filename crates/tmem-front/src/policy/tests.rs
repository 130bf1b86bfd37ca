//! The policy against a simulated front: pages with a last-access tick,
//! some of them down in tmem; a page accessed while down is read back.
//! Every page is in the front (the job's resident pages are not modelled),
//! so every access is a read of the front.

use super::*;

/// Bytes one page costs in the simulated front.
const PAGE_COST: u64 = 1000;

struct SimFront {
    /// (last access tick, down in tmem).
    pages: Vec<(u64, bool)>,
    now: u64,
    written: u64,
    read_back: u64,
    /// Reads of the front, reads back included (as zram counts them).
    reads: u64,
    /// Pages tmem keeps below for blocks zram freed (read back).
    stale_below: u64,
}

impl SimFront {
    fn new(pages: usize) -> Self {
        Self { pages: vec![(0, false); pages], now: 0, written: 0, read_back: 0, reads: 0, stale_below: 0 }
    }

    fn access(&mut self, i: usize) {
        let p = &mut self.pages[i];
        self.reads += 1;
        if p.1 {
            p.1 = false;
            self.read_back += 1;
            self.stale_below += 1;
        }
        p.0 = self.now;
    }

    fn sample(&self) -> Sample {
        let up = self.pages.iter().filter(|p| !p.1).count() as u64;
        Sample {
            pool_bytes: up * PAGE_COST,
            stored_bytes: up * 4096,
            written: self.written,
            read_back: self.read_back,
            front_reads: Some(self.reads),
            below_pages: Some(self.pages.iter().filter(|p| p.1).count() as u64),
            below_stored: Some(self.pages.iter().filter(|p| p.1).count() as u64 + self.stale_below),
        }
    }

    /// Applies a decision (one tick is one second here).
    fn apply(&mut self, d: Decision) {
        let Some((age, mut max)) = d.write_back else { return };
        for p in &mut self.pages {
            if max == 0 {
                break;
            }
            if !p.1 && self.now.saturating_sub(p.0) >= age.as_secs() {
                p.1 = true;
                self.written += 1;
                max -= 1;
            }
        }
    }
}

fn cfg(pages: u64) -> PolicyConfig {
    PolicyConfig {
        idle_age: Duration::from_secs(5),
        max_idle_age: Duration::from_secs(80),
        budget: pages * PAGE_COST * 2,
        fill_percent: 20,
        rate: 2000,
        min_rate: 64,
        ..PolicyConfig::default()
    }
}

/// Runs `ticks` more ticks; `touch(front, tick)` is the job.
fn run(policy: &mut Policy, f: &mut SimFront, ticks: u64, mut touch: impl FnMut(&mut SimFront, u64)) {
    for t in f.now + 1..=f.now + ticks {
        f.now = t;
        touch(f, t);
        let d = policy.step(&f.sample());
        f.apply(d);
        if d.reclaim_below {
            policy.count_reclaim(std::mem::take(&mut f.stale_below));
        }
    }
}

#[test]
fn a_job_that_touches_every_page_within_the_age_sends_nothing_down() {
    let mut f = SimFront::new(4000);
    let mut p = Policy::new(cfg(4000));
    // Every page every 4 ticks (age 5).
    run(&mut p, &mut f, 200, |f, t| (0..4000).filter(|i| i % 4 == (t % 4) as usize).for_each(|i| f.access(i)));
    assert_eq!(f.written, 0);
    assert_eq!(p.state(), State::WritingBack, "above the fill level, but nothing is idle");
}

#[test]
fn a_uniformly_hot_job_slower_than_the_age_stops_being_tiered() {
    let mut f = SimFront::new(4000);
    let mut p = Policy::new(cfg(4000));
    // Every page every 10 ticks: idle past the first age, read back soon after.
    run(&mut p, &mut f, 400, |f, t| (0..4000).filter(|i| i % 10 == (t % 10) as usize).for_each(|i| f.access(i)));
    let first = f.written;
    assert!(first > 0, "the first age is shorter than the job's period");
    assert!(p.age() >= Duration::from_secs(10), "backed off to the period: {:?}", p.age());
    // Once backed off, nothing more goes down.
    run(&mut p, &mut f, 200, |f, t| (0..4000).filter(|i| i % 10 == (t % 10) as usize).for_each(|i| f.access(i)));
    assert_eq!(f.written, first, "pages still went down after the back-off");
    assert!(p.stats(&FrontStats::default()).backoffs > 0);
}

#[test]
fn cold_pages_go_down_and_hot_ones_stay() {
    let mut f = SimFront::new(4000);
    // A fill level of 0: every idle page may go down.
    let mut p = Policy::new(PolicyConfig { fill_percent: 0, ..cfg(4000) });
    // The first 3000 pages are never touched again; the last 1000 every 2 ticks.
    run(&mut p, &mut f, 120, |f, t| (3000..4000).filter(|i| i % 2 == (t % 2) as usize).for_each(|i| f.access(i)));
    assert_eq!(f.pages[..3000].iter().filter(|p| p.1).count(), 3000, "every cold page went down");
    assert!(p.rate() > 64, "the slow start ramped up while pages stayed down: {}", p.rate());
    assert_eq!(f.pages[3000..].iter().filter(|p| p.1).count(), 0, "no hot page went down");
    assert_eq!(f.read_back, 0);
    assert_eq!(p.stats(&FrontStats::default()).backoffs, 0);
}

#[test]
fn below_the_fill_level_nothing_goes_down() {
    let mut f = SimFront::new(4000);
    let mut c = cfg(4000);
    c.budget = 100 * 4000 * PAGE_COST;
    let mut p = Policy::new(c);
    run(&mut p, &mut f, 100, |_, _| {});
    assert_eq!(f.written, 0);
    assert_eq!(p.state(), State::BelowFill);
}

#[test]
fn the_rate_bounds_each_tick() {
    let mut f = SimFront::new(4000);
    let mut p = Policy::new(cfg(4000));
    run(&mut p, &mut f, 5, |_, _| {});
    assert!(f.written <= 2000, "at most the rate in the one tick past the age: {}", f.written);
    run(&mut p, &mut f, 1, |_, _| {});
    assert!(f.written <= 4000);
}

#[test]
fn the_emergency_level_writes_back_even_when_paused() {
    let mut f = SimFront::new(4000);
    let mut c = cfg(4000);
    c.max_idle_age = c.idle_age;
    c.min_rate = c.rate;
    let mut p = Policy::new(c.clone());
    // Force a pause: everything written comes back at once.
    run(&mut p, &mut f, 60, |f, t| {
        if t > 6 {
            (0..4000).for_each(|i| {
                if f.pages[i].1 {
                    f.access(i)
                }
            });
        }
    });
    assert!(matches!(p.state(), State::Paused(_) | State::Emergency), "{:?}", p.state());
    // A budget the pool fills: emergency.
    let mut full = Policy::new(PolicyConfig { budget: 4000 * PAGE_COST, ..c });
    let mut g = SimFront::new(4000);
    g.now = 10;
    let d = full.step(&g.sample());
    assert_eq!(full.state(), State::Emergency);
    assert!(d.write_back.is_some());
}

#[test]
fn relaxes_back_to_the_configured_age_when_reads_stop() {
    let mut f = SimFront::new(4000);
    let mut p = Policy::new(cfg(4000));
    run(&mut p, &mut f, 200, |f, t| (0..4000).filter(|i| i % 10 == (t % 10) as usize).for_each(|i| f.access(i)));
    assert!(p.age() > Duration::from_secs(5));
    // The job stops touching anything: what goes down stays down.
    run(&mut p, &mut f, 600, |_, _| {});
    assert_eq!(p.age(), Duration::from_secs(5), "relaxed back");
    assert!(p.stats(&FrontStats::default()).relaxes > 0);
}

/// A job touching every page every 120 ticks, past the longest age (80),
/// in a front whose pages all fit at 60% of its budget; run for 600 ticks,
/// by which the policy has backed off.
fn slow_hot_job() -> (Policy, SimFront, impl Fn(&mut SimFront, u64)) {
    let mut f = SimFront::new(4000);
    let mut c = cfg(4000);
    c.budget = 4000 * PAGE_COST * 100 / 60;
    let mut p = Policy::new(c);
    let touch =
        |f: &mut SimFront, t: u64| (0..4000).filter(|i| i % 120 == (t % 120) as usize).for_each(|i| f.access(i));
    run(&mut p, &mut f, 600, touch);
    (p, f, touch)
}

#[test]
fn a_hot_job_slower_than_the_longest_age_keeps_what_fits_in_the_front() {
    // The age cannot keep these pages up: the fill level must.
    let (mut p, mut f, touch) = slow_hot_job();
    assert!(p.fill_percent() > 60, "the fill level backed off past what the job needs: {}", p.fill_percent());
    let before = (f.written, f.read_back);
    run(&mut p, &mut f, 1200, touch);
    let (written, read) = (f.written - before.0, f.read_back - before.1);
    // A probe of the least rate per age or two (the fill level steps down
    // after a quiet age); 8,512 pages with a horizon of 10 ticks.
    assert!(written <= 1000 && read <= written, "the probes send few pages down: {written}");
}

#[test]
fn a_front_left_full_of_pages_that_turned_cold_tiers_them_again() {
    let (mut p, mut f, _) = slow_hot_job();
    assert!(p.fill_percent() > 60);
    // The job stops: every page is cold now.
    run(&mut p, &mut f, 1000, |_, _| {});
    assert_eq!(p.fill_percent(), 20, "back to the configured fill level");
    let up = f.pages.iter().filter(|p| !p.1).count();
    let at_fill = 4000 * 20 / 60 + 1;
    assert!(up <= at_fill, "the front went down to its fill level: {up} pages up, {at_fill} at the fill level");
}

#[test]
fn the_pages_the_front_serves_itself_are_counted_apart_from_reads_back() {
    let mut f = SimFront::new(4000);
    let mut p = Policy::new(cfg(4000));
    // Nothing touched for 20 ticks: pages go down to the fill level.
    run(&mut p, &mut f, 20, |_, _| {});
    let down: Vec<usize> = (0..4000).filter(|&i| f.pages[i].1).collect();
    assert!(!down.is_empty());
    // One tick reads every page: those down come back, the rest are served.
    run(&mut p, &mut f, 1, |f, _| (0..4000).for_each(|i| f.access(i)));
    let st = p.stats(&FrontStats::default());
    assert_eq!(st.read_back, down.len() as u64);
    assert_eq!(st.front_reads, 4000 - down.len() as u64);
    // A front whose reads are not counted adds nothing.
    p.step(&Sample { front_reads: None, ..f.sample() });
    run(&mut p, &mut f, 1, |f, _| f.access(0));
    assert_eq!(p.stats(&FrontStats::default()).front_reads, 4000 - down.len() as u64);
}

#[test]
fn a_slow_start_sends_few_pages_of_a_hot_job_down_before_they_come_back() {
    // Every page every 10 ticks: each looks idle for 5 ticks of each pass.
    let mut f = SimFront::new(4000);
    let mut p = Policy::new(cfg(4000));
    assert_eq!(p.rate(), 64, "it starts at the least rate");
    run(&mut p, &mut f, 10, |f, t| (0..4000).filter(|i| i % 10 == (t % 10) as usize).for_each(|i| f.access(i)));
    // Ticks 5-10 at 64 pages a tick; the full rate (2000) could have sent
    // every idle page down at tick 5.
    assert!(f.written <= 6 * 64, "{} pages went down in the first pass", f.written);
}

#[test]
fn pages_of_blocks_freed_below_are_reclaimed_once_they_outweigh_the_live_ones() {
    let mut f = SimFront::new(4000);
    let mut p = Policy::new(PolicyConfig { fill_percent: 0, ..cfg(4000) });
    // Everything goes down, then the job reads every page back: zram frees
    // the blocks, tmem keeps their pages.
    run(&mut p, &mut f, 60, |_, _| {});
    assert_eq!(f.pages.iter().filter(|p| p.1).count(), 4000);
    // The same tick sees 4,000 pages below with none in use, and reclaims
    // them (the last reclaim is long past).
    run(&mut p, &mut f, 1, |f, _| (0..4000).for_each(|i| f.access(i)));
    let st = p.stats(&FrontStats::default());
    assert_eq!((st.below_reclaims, st.below_reclaimed, f.stale_below), (1, 4000, 0));
    // A few freed blocks among many live ones: under twice the live pages
    // plus the slack, nothing to reclaim.
    run(&mut p, &mut f, 60, |_, _| {});
    run(&mut p, &mut f, 1, |f, _| (0..300).for_each(|i| f.access(i)));
    run(&mut p, &mut f, 30, |_, _| {});
    assert_eq!(p.stats(&FrontStats::default()).below_reclaims, 1, "300 stale pages against 3,700 live ones");
}

#[test]
fn reclaims_below_are_spaced_and_need_both_counts() {
    let mut p = Policy::new(cfg(4000));
    let sample = |stored| Sample { below_pages: Some(10), below_stored: stored, ..Sample::default() };
    let due: Vec<u64> = (1..=60).filter(|_| p.step(&sample(Some(10_000))).reclaim_below).collect();
    assert_eq!(due, vec![20, 40, 60], "at most once every {RECLAIM_TICKS} ticks");
    assert!((0..40).all(|_| !p.step(&sample(None)).reclaim_below), "no count of tmem's pages: nothing to weigh");
    assert!(!p.step(&sample(Some(2 * 10 + RECLAIM_SLACK_PAGES))).reclaim_below);
    assert!(p.step(&sample(Some(2 * 10 + RECLAIM_SLACK_PAGES + 1))).reclaim_below);
}
