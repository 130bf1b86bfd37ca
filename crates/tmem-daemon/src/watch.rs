//! What the daemon logs while it serves: one line when an error counter
//! rises (a failed tier write or read, a failed or panicked request, a page
//! that failed its checksum), and one line when a tier's health changes,
//! including its recovery.
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
}

impl Watch {
    /// Compares `devs` with the last call and returns what to log. The first
    /// call only records (and reports tiers that are not healthy).
    pub fn check(&mut self, devs: &[DeviceStats]) -> Vec<Line> {
        let mut out = Vec::new();
        for d in devs {
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
}
