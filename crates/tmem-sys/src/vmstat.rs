//! `/proc/vmstat` counters: how many pages went to swap and came back.

use std::collections::BTreeMap;

/// Errors reading `/proc/vmstat`.
#[derive(Debug, thiserror::Error)]
pub enum VmstatError {
    /// The file could not be read.
    #[error("cannot read /proc/vmstat: {0}")]
    Read(#[from] std::io::Error),
    /// A line is not `name value`.
    #[error("/proc/vmstat: bad line {0:?}")]
    Parse(String),
}

/// Parses `name value` lines (the format of `/proc/vmstat`).
pub fn parse(text: &str) -> Result<BTreeMap<String, u64>, VmstatError> {
    let mut m = BTreeMap::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let mut f = line.split_whitespace();
        let (Some(name), Some(value), None) = (f.next(), f.next(), f.next()) else {
            return Err(VmstatError::Parse(line.to_owned()));
        };
        let v = value.parse::<u64>().map_err(|_| VmstatError::Parse(line.to_owned()))?;
        m.insert(name.to_owned(), v);
    }
    Ok(m)
}

/// Every counter of `/proc/vmstat`.
pub fn read() -> Result<BTreeMap<String, u64>, VmstatError> {
    parse(&std::fs::read_to_string("/proc/vmstat")?)
}

/// The swap counters of `/proc/vmstat`, in pages. Counters the kernel does
/// not have (zswap ones on kernels without zswap) read as 0.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct SwapCounters {
    /// Pages read from swap devices.
    pub pswpin: u64,
    /// Pages written to swap devices.
    pub pswpout: u64,
    /// Pages loaded back from zswap.
    pub zswpin: u64,
    /// Pages stored in zswap (they never reach the swap device unless written back).
    pub zswpout: u64,
    /// Pages zswap wrote back to the swap device.
    pub zswpwb: u64,
    /// Major page faults (swap-ins and file reads).
    pub pgmajfault: u64,
}

impl SwapCounters {
    /// Picks the swap counters out of parsed vmstat.
    #[must_use]
    pub fn from_map(m: &BTreeMap<String, u64>) -> Self {
        let g = |k: &str| m.get(k).copied().unwrap_or(0);
        Self {
            pswpin: g("pswpin"),
            pswpout: g("pswpout"),
            zswpin: g("zswpin"),
            zswpout: g("zswpout"),
            zswpwb: g("zswpwb"),
            pgmajfault: g("pgmajfault"),
        }
    }

    /// Reads them now.
    pub fn now() -> Result<Self, VmstatError> {
        Ok(Self::from_map(&read()?))
    }

    /// `self - earlier`, counter by counter (0 if a counter went backwards).
    #[must_use]
    pub fn since(&self, earlier: &Self) -> Self {
        Self {
            pswpin: self.pswpin.saturating_sub(earlier.pswpin),
            pswpout: self.pswpout.saturating_sub(earlier.pswpout),
            zswpin: self.zswpin.saturating_sub(earlier.zswpin),
            zswpout: self.zswpout.saturating_sub(earlier.zswpout),
            zswpwb: self.zswpwb.saturating_sub(earlier.zswpwb),
            pgmajfault: self.pgmajfault.saturating_sub(earlier.pgmajfault),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_vmstat_and_takes_deltas() {
        let t = "nr_free_pages 123\npswpin 10\npswpout 20\nzswpout 5\n\npgmajfault 7\n";
        let m = parse(t).unwrap();
        assert_eq!(m["nr_free_pages"], 123);
        let a = SwapCounters::from_map(&m);
        assert_eq!(a, SwapCounters { pswpin: 10, pswpout: 20, zswpin: 0, zswpout: 5, zswpwb: 0, pgmajfault: 7 });
        let b = SwapCounters { pswpin: 15, pswpout: 120, zswpin: 1, zswpout: 6, zswpwb: 2, pgmajfault: 6 };
        let d = b.since(&a);
        assert_eq!(d, SwapCounters { pswpin: 5, pswpout: 100, zswpin: 1, zswpout: 1, zswpwb: 2, pgmajfault: 0 });
        assert!(parse("pswpin\n").is_err());
        assert!(parse("pswpin x\n").is_err());
        assert!(parse("pswpin 1 2\n").is_err());
    }

    #[test]
    fn reads_the_real_file() {
        let m = read().unwrap();
        assert!(m.contains_key("pswpin") && m.contains_key("pgfault"), "{m:?}");
    }
}

/// All-CPU time from the first line of `/proc/stat`, in clock ticks: how
/// much of it the hypervisor gave to other guests (steal) tells whether a
/// timed run on a VM was measured on a quiet host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuTimes {
    /// user + nice + system + idle + iowait + irq + softirq + steal.
    pub total: u64,
    /// Time a runnable vCPU waited for the host.
    pub steal: u64,
}

impl CpuTimes {
    /// Parses the `cpu` line of `/proc/stat` text.
    pub fn parse(stat: &str) -> Option<Self> {
        let line = stat.lines().find(|l| l.starts_with("cpu "))?;
        let v: Vec<u64> = line.split_whitespace().skip(1).take(8).map(|f| f.parse().ok()).collect::<Option<_>>()?;
        (v.len() == 8).then(|| Self { total: v.iter().sum(), steal: v[7] })
    }

    /// Reads `/proc/stat` now; `None` where it is missing or unreadable.
    pub fn now() -> Option<Self> {
        Self::parse(&std::fs::read_to_string("/proc/stat").ok()?)
    }

    /// Percent of all CPU time from `start` until now that was stolen; 0
    /// where `/proc/stat` could not be read at either end.
    pub fn steal_percent_from(start: Option<Self>) -> f64 {
        start.zip(Self::now()).map_or(0.0, |(b, a)| a.steal_percent_since(&b))
    }

    /// Percent of all CPU time since `earlier` that was stolen.
    pub fn steal_percent_since(&self, earlier: &Self) -> f64 {
        let total = self.total.saturating_sub(earlier.total);
        if total == 0 {
            return 0.0;
        }
        self.steal.saturating_sub(earlier.steal) as f64 * 100.0 / total as f64
    }
}

#[cfg(test)]
mod cpu_tests {
    use super::CpuTimes;

    #[test]
    fn steal_is_the_eighth_field_of_the_cpu_line() {
        let a = CpuTimes::parse("cpu  100 0 50 800 10 0 5 35 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n").unwrap();
        assert_eq!(a, CpuTimes { total: 1000, steal: 35 });
        let b = CpuTimes::parse("cpu  200 0 100 1500 10 0 5 185 0 0\n").unwrap();
        assert!((b.steal_percent_since(&a) - 15.0).abs() < 1e-9);
        assert_eq!(a.steal_percent_since(&a), 0.0);
        assert_eq!(CpuTimes::parse("cpu  1 2 3\n"), None);
        assert_eq!(CpuTimes::parse("intr 1 2 3\n"), None);
    }
}
