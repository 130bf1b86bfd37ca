//! What the daemon logs while it serves: one line when an error counter
//! rises (a failed tier write or read, a failed or panicked request, a page
//! that failed its checksum), one line when a tier's health changes,
//! including its recovery, and one line when a pool starts refusing pages
//! at its limit, naming the fix, and one when it stops.
//!
//! A pool at its limit with no tier below refuses every swap write, and
//! the kernel keeps those pages in RAM and tries again: a job in a memory
//! cgroup then thrashes (seen in a v1 cgroup: 20-80 thousand refused
//! writes a second, and no OOM kill). Only the owner can choose a bigger
//! limit or a tier, so the line says both.
//!
//! The main thread calls [`Watch::check`] once a tick (at most a second),
//! so a burst of failures is one line per tick with the count, not a line
//! per page. Counters are read from the same snapshots as `tmem stat`, by
//! name, through the counters' definitions.

use std::collections::HashMap;

use tmem_block::DeviceStats;
use tmem_counters::Counters;

/// The counters whose rise is an error worth a line, by group.
const DEVICE_ERRORS: [&str; 4] = ["failed_reads", "failed_writes", "panics", "invalid_io"];
const POOL_ERRORS: [&str; 5] =
    ["decompress_fail", "tier_get_fail", "tier_put_fail", "reject_alloc_fail", "reject_compress_fail"];
const TIER_ERRORS: [&str; 1] = ["failures"];

/// A line to log, and whether it is bad news.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Line {
    /// `true`: warn; `false`: info (a recovery).
    pub warn: bool,
    /// The text.
    pub text: String,
}

/// The last values seen.
#[derive(Debug, Default)]
pub struct Watch {
    counters: HashMap<String, u64>,
    health: HashMap<String, String>,
    /// Each device's `pool_limit_hit` at the last look.
    limit_hits: HashMap<String, u64>,
    /// Devices refusing at their limit now: the count when it began.
    refusing_since: HashMap<String, u64>,
}

impl Watch {
    /// Compares `devs` with the last call and returns what to log. The first
    /// call only records (and reports tiers that are not healthy).
    pub fn check(&mut self, devs: &[DeviceStats]) -> Vec<Line> {
        let mut out = Vec::new();
        for d in devs {
            self.at_limit(&mut out, d);
            self.rose(&mut out, &d.name, "", d, &DEVICE_ERRORS);
            self.rose(&mut out, &d.name, "", &d.store.total, &POOL_ERRORS);
            for t in &d.store.tiers {
                let tier = format!("tier {}: ", t.name);
                self.rose(&mut out, &d.name, &tier, t, &TIER_ERRORS);
                let key = format!("{}/{}", d.name, t.name);
                let before = self.health.insert(key, t.health.clone());
                let healthy = t.health == "healthy" || t.health.is_empty();
                match before {
                    Some(b) if b == t.health => {}
                    None if healthy => {}
                    _ if healthy => {
                        out.push(Line { warn: false, text: format!("{}: tier {} recovered: healthy", d.name, t.name) })
                    }
                    _ => out.push(Line { warn: true, text: format!("{}: tier {} is {}", d.name, t.name, t.health) }),
                }
            }
        }
        out
    }

    /// A line when `d`'s pool begins refusing pages at its limit (with
    /// what to do) and one when a look finds it refused none since the last.
    fn at_limit(&mut self, out: &mut Vec<Line>, d: &DeviceStats) {
        let hits = d.store.total.pool_limit_hit;
        let Some(before) = self.limit_hits.insert(d.name.clone(), hits) else { return };
        let since = self.refusing_since.get(&d.name).copied();
        match since {
            None if hits > before => {
                self.refusing_since.insert(d.name.clone(), before);
                let fix = if d.store.tiers.is_empty() {
                    "add a tier below it (`--tier disk=DIR` or `--tier remote=URL` at `tmem swap up`)"
                } else {
                    "its tiers do not take pages as fast as they come"
                };
                let limit = d.store.pool_limit_bytes;
                let limit = if limit == u64::MAX { "no limit of its own".into() } else { crate::human(limit) };
                out.push(Line {
                    warn: true,
                    text: format!(
                        "{}: the pool is full ({limit}) and refuses pages: the kernel keeps them in RAM and tries \
                         again, so a job at its memory limit thrashes; raise the limit (`tmem set {} \
                         pool-limit=SIZE|N%`) or {fix}",
                        d.name, d.name
                    ),
                });
            }
            Some(start) if hits == before => {
                self.refusing_since.remove(&d.name);
                out.push(Line {
                    warn: false,
                    text: format!("{}: the pool takes pages again ({} refused at its limit)", d.name, hits - start),
                });
            }
            _ => {}
        }
    }

    fn rose<C: Counters>(&mut self, out: &mut Vec<Line>, device: &str, what: &str, c: &C, names: &[&str]) {
        for (def, v) in c.values().filter(|(d, _)| names.contains(&d.name)) {
            let key = format!("{device}/{what}{}", def.name);
            let before = self.counters.insert(key, v);
            if let Some(b) = before.filter(|b| v > *b) {
                out.push(Line {
                    warn: true,
                    text: format!("{device}: {what}{} rose by {} to {v} ({})", def.name, v - b, def.help()),
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tmem_block::{BlockDevice, DeviceConfig};
    use tmem_core::StoreConfig;

    use super::*;

    fn device() -> DeviceStats {
        let dev = DeviceConfig {
            name: "swap0".into(),
            size: 1 << 20,
            store: StoreConfig::default(),
            tiers: None,
            recompress: None,
        }
        .build()
        .unwrap();
        dev.write_at(&[7; 4096], 0).unwrap();
        dev.stats()
    }

    #[test]
    fn a_rising_error_counter_is_one_line_with_the_count() {
        let mut w = Watch::default();
        let mut s = device();
        assert!(w.check(&[s.clone()]).is_empty(), "the first look only records");
        s.failed_writes += 3;
        s.store.total.tier_put_fail += 5;
        // Counters that are not errors rise too: no line for them.
        s.store.total.succ_puts += 10;
        s.write_ios += 10;
        let lines = w.check(&[s.clone()]);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(lines.iter().all(|l| l.warn));
        assert!(lines[0].text.starts_with("swap0: failed_writes rose by 3 to 3 (Failed writes.)"), "{lines:?}");
        assert!(lines[1].text.contains("tier_put_fail rose by 5"), "{lines:?}");
        assert!(w.check(&[s]).is_empty(), "no change, no line");
    }

    #[test]
    fn tier_health_changes_and_recoveries_are_logged() {
        let mut w = Watch::default();
        let mut s = device();
        let tier =
            |health: &str| tmem_tier::TierStats { name: "remote".into(), health: health.into(), ..Default::default() };
        s.store.tiers = vec![tier("healthy")];
        assert!(w.check(&[s.clone()]).is_empty());
        s.store.tiers = vec![tier("degraded: 1 of 3 nodes down")];
        let lines = w.check(&[s.clone()]);
        assert_eq!(lines, [Line { warn: true, text: "swap0: tier remote is degraded: 1 of 3 nodes down".into() }]);
        s.store.tiers[0].failures = 2;
        assert_eq!(w.check(&[s.clone()]).len(), 1, "failures rose");
        s.store.tiers = vec![tier("healthy")];
        s.store.tiers[0].failures = 2;
        let lines = w.check(&[s]);
        assert_eq!(lines, [Line { warn: false, text: "swap0: tier remote recovered: healthy".into() }]);
    }

    #[test]
    fn a_pool_refusing_at_its_limit_is_one_line_with_the_fix_then_one_when_it_stops() {
        let mut w = Watch::default();
        let mut s = device();
        s.store.pool_limit_bytes = 16 << 20;
        assert!(w.check(&[s.clone()]).is_empty(), "the first look only records");
        s.store.total.pool_limit_hit += 40_000;
        let lines = w.check(&[s.clone()]);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].warn);
        assert!(lines[0].text.starts_with("swap0: the pool is full (16.0 MiB) and refuses pages"), "{lines:?}");
        assert!(lines[0].text.contains("`tmem set swap0 pool-limit=SIZE|N%`"), "{lines:?}");
        assert!(lines[0].text.contains("--tier disk=DIR"), "no tier: it says how to add one: {lines:?}");
        s.store.total.pool_limit_hit += 50_000;
        assert!(w.check(&[s.clone()]).is_empty(), "still refusing: no second line");
        let lines = w.check(&[s.clone()]);
        assert_eq!(
            lines,
            [Line { warn: false, text: "swap0: the pool takes pages again (90000 refused at its limit)".into() }]
        );
        assert!(w.check(&[s.clone()]).is_empty());
        // With a tier, the fix named is another.
        s.store.tiers = vec![tmem_tier::TierStats { name: "disk".into(), ..Default::default() }];
        s.store.total.pool_limit_hit += 1;
        let lines = w.check(&[s]);
        assert!(lines[0].text.ends_with("its tiers do not take pages as fast as they come"), "{lines:?}");
    }
}
