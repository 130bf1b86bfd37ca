//! `/proc/vmstat` counters: how many pages went to swap and came back; and
//! CPU time: the machine's (`/proc/stat`), a process's (`/proc/PID/stat`,
//! `getrusage`), and what a timed section used ([`CpuMark`]).

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

/// Clock ticks per second of `/proc/stat` and `/proc/PID/stat` (`USER_HZ`,
/// `sysconf(_SC_CLK_TCK)`; 100 where that fails).
#[must_use]
pub fn clock_ticks_per_sec() -> u64 {
    Some(rustix::param::clock_ticks_per_second()).filter(|&h| h > 0).unwrap_or(100)
}

fn ticks_to_secs(ticks: u64) -> f64 {
    ticks as f64 / clock_ticks_per_sec() as f64
}

/// All-CPU time from the first line of `/proc/stat`, in clock ticks: how
/// much of it the hypervisor gave to other guests (steal) tells whether a
/// timed run on a VM was measured on a quiet host, and how much of it was
/// busy tells what a run cost the whole machine, kernel work included.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuTimes {
    /// user + nice + system + idle + iowait + irq + softirq + steal.
    pub total: u64,
    /// idle + iowait: time no task wanted the CPU.
    pub idle: u64,
    /// Time a runnable vCPU waited for the host.
    pub steal: u64,
}

impl CpuTimes {
    /// Parses the `cpu` line of `/proc/stat` text.
    pub fn parse(stat: &str) -> Option<Self> {
        let line = stat.lines().find(|l| l.starts_with("cpu "))?;
        let v: Vec<u64> = line.split_whitespace().skip(1).take(8).map(|f| f.parse().ok()).collect::<Option<_>>()?;
        (v.len() == 8).then(|| Self { total: v.iter().sum(), idle: v[3] + v[4], steal: v[7] })
    }

    /// Reads `/proc/stat` now; `None` where it is missing or unreadable.
    pub fn now() -> Option<Self> {
        Self::parse(&std::fs::read_to_string("/proc/stat").ok()?)
    }

    /// Busy ticks, all CPUs: total − idle − iowait − steal (user, nice,
    /// system, irq, softirq). Steal is left out: it is time the host did not
    /// give us, reported on its own by [`Self::steal_percent_since`].
    #[must_use]
    pub fn busy(&self) -> u64 {
        self.total.saturating_sub(self.idle).saturating_sub(self.steal)
    }

    /// Busy CPU seconds of all CPUs since `earlier` (see [`Self::busy`]).
    #[must_use]
    pub fn busy_secs_since(&self, earlier: &Self) -> f64 {
        ticks_to_secs(self.busy().saturating_sub(earlier.busy()))
    }

    /// Busy CPU seconds of all CPUs from `start` until now; `None` where
    /// `/proc/stat` could not be read at either end.
    pub fn busy_secs_from(start: Option<Self>) -> Option<f64> {
        start.zip(Self::now()).map(|(b, a)| a.busy_secs_since(&b))
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

/// CPU time one process has used (all its threads, living and exited), seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct ProcessCpu {
    /// Time in user mode.
    pub user_secs: f64,
    /// Time in the kernel on the process's behalf (system calls, page faults,
    /// the block I/O it submits synchronously: zram compresses there).
    pub system_secs: f64,
}

impl ProcessCpu {
    /// Parses `/proc/PID/stat` text: `utime` and `stime` (fields 14 and 15,
    /// clock ticks). The command name (field 2) may hold spaces and
    /// parentheses, so fields are counted after its last `)`.
    pub fn parse_stat(stat: &str, ticks_per_sec: u64) -> Option<Self> {
        let rest = &stat[stat.rfind(')')? + 1..];
        // After ")": field 3 (state) is the first; utime is field 14.
        let mut f = rest.split_whitespace().skip(11);
        let user: u64 = f.next()?.parse().ok()?;
        let system: u64 = f.next()?.parse().ok()?;
        let hz = ticks_per_sec.max(1) as f64;
        Some(Self { user_secs: user as f64 / hz, system_secs: system as f64 / hz })
    }

    /// CPU time of process `pid` from `/proc/PID/stat` (clock-tick
    /// resolution, 10 ms at the usual 100 Hz); `None` once it is gone.
    pub fn of_pid(pid: i32) -> Option<Self> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        Self::parse_stat(&text, clock_ticks_per_sec())
    }

    /// CPU time of this process, from `getrusage(RUSAGE_SELF)`
    /// (microsecond resolution); `None` where that fails.
    pub fn of_self() -> Option<Self> {
        // SAFETY: an all-zero `rusage` is a valid value of this plain C struct.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `ru` is a live, writable `rusage` for the whole call;
        // getrusage only writes into it.
        if unsafe { libc::getrusage(libc::RUSAGE_SELF, &raw mut ru) } != 0 {
            return None;
        }
        let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
        Some(Self { user_secs: secs(ru.ru_utime), system_secs: secs(ru.ru_stime) })
    }

    /// User + system seconds.
    #[must_use]
    pub fn total_secs(&self) -> f64 {
        self.user_secs + self.system_secs
    }

    /// `self - earlier` (0 where a figure went backwards).
    #[must_use]
    pub fn since(&self, earlier: &Self) -> Self {
        Self {
            user_secs: (self.user_secs - earlier.user_secs).max(0.0),
            system_secs: (self.system_secs - earlier.system_secs).max(0.0),
        }
    }
}

/// CPU time of each thread of one process that is alive at the moment of
/// reading (`/proc/PID/task/TID/stat`), keyed by thread id. Threads that
/// already exited are only in the process's total ([`ProcessCpu`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ThreadsCpu(BTreeMap<i32, (String, ProcessCpu)>);

/// CPU time of the threads of one role: those whose names differ only in a
/// trailing number (`tmem-fuse-0`, `tmem-fuse-1`, ...) are one role,
/// named with `*` for the number.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct RoleCpu {
    /// Thread name, its trailing number as `*`.
    pub role: String,
    /// Threads of the role that ran in the interval.
    pub threads: u32,
    /// Their CPU time in the interval.
    #[serde(flatten)]
    pub cpu: ProcessCpu,
}

impl ThreadsCpu {
    /// Parses one `/proc/PID/task/TID/stat`: the thread's name (field 2,
    /// between the first `(` and the last `)`) and its CPU time.
    #[must_use]
    pub fn parse_thread_stat(stat: &str, ticks_per_sec: u64) -> Option<(String, ProcessCpu)> {
        let name = stat.get(stat.find('(')? + 1..stat.rfind(')')?)?;
        Some((name.to_owned(), ProcessCpu::parse_stat(stat, ticks_per_sec)?))
    }

    /// The living threads of process `pid`; `None` once it is gone. A
    /// thread that exits while the directory is read is left out.
    #[must_use]
    pub fn of_pid(pid: i32) -> Option<Self> {
        let hz = clock_ticks_per_sec();
        let mut threads = BTreeMap::new();
        for entry in std::fs::read_dir(format!("/proc/{pid}/task")).ok()?.flatten() {
            let Some(tid) = entry.file_name().to_str().and_then(|t| t.parse::<i32>().ok()) else { continue };
            let Ok(text) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
            if let Some(t) = Self::parse_thread_stat(&text, hz) {
                threads.insert(tid, t);
            }
        }
        Some(Self(threads))
    }

    /// Adds one thread: the unit tests build readings with it.
    #[cfg(test)]
    fn insert(&mut self, tid: i32, name: &str, cpu: ProcessCpu) {
        self.0.insert(tid, (name.to_owned(), cpu));
    }

    /// CPU time since `earlier` of the threads alive now, grouped by role,
    /// the busiest first; a thread started since counts from zero, and a
    /// role that used no time is left out.
    #[must_use]
    pub fn by_role_since(&self, earlier: &Self) -> Vec<RoleCpu> {
        let mut roles: BTreeMap<String, RoleCpu> = BTreeMap::new();
        for (tid, (name, now)) in &self.0 {
            let used = earlier.0.get(tid).filter(|(n, _)| n == name).map_or(*now, |(_, then)| now.since(then));
            if used.total_secs() <= 0.0 {
                continue;
            }
            let role = match name.trim_end_matches(|c: char| c.is_ascii_digit()) {
                stem if stem.len() < name.len() && !stem.is_empty() => format!("{stem}*"),
                _ => name.clone(),
            };
            let r = roles.entry(role.clone()).or_insert(RoleCpu { role, threads: 0, cpu: ProcessCpu::default() });
            r.threads += 1;
            r.cpu.user_secs += used.user_secs;
            r.cpu.system_secs += used.system_secs;
        }
        let mut out: Vec<RoleCpu> = roles.into_values().collect();
        out.sort_by(|a, b| b.cpu.total_secs().total_cmp(&a.cpu.total_secs()).then_with(|| a.role.cmp(&b.role)));
        out
    }
}

/// CPU used over a timed section of this process: its own time and the
/// whole machine's busy time.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct CpuSpent {
    /// This process, all threads.
    pub process: ProcessCpu,
    /// Busy CPU seconds of the whole machine, all CPUs (other load
    /// included); `None` where `/proc/stat` could not be read.
    pub machine_busy_secs: Option<f64>,
}

/// The start of a timed section: [`CpuMark::spent`] gives what it used.
#[derive(Clone, Copy, Debug)]
pub struct CpuMark {
    process: Option<ProcessCpu>,
    machine: Option<CpuTimes>,
}

impl CpuMark {
    /// Marks the start of a section.
    #[must_use]
    pub fn now() -> Self {
        Self { process: ProcessCpu::of_self(), machine: CpuTimes::now() }
    }

    /// CPU used since the mark.
    #[must_use]
    pub fn spent(&self) -> CpuSpent {
        let process = self.process.zip(ProcessCpu::of_self()).map(|(b, a)| a.since(&b)).unwrap_or_default();
        CpuSpent { process, machine_busy_secs: CpuTimes::busy_secs_from(self.machine) }
    }
}

#[cfg(test)]
mod cpu_tests {
    use super::{CpuMark, CpuTimes, ProcessCpu, RoleCpu, ThreadsCpu};

    #[test]
    fn steal_is_the_eighth_field_of_the_cpu_line() {
        let a = CpuTimes::parse("cpu  100 0 50 800 10 0 5 35 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n").unwrap();
        assert_eq!(a, CpuTimes { total: 1000, idle: 810, steal: 35 });
        assert_eq!(a.busy(), 155);
        let b = CpuTimes::parse("cpu  200 0 100 1500 10 0 5 185 0 0\n").unwrap();
        assert!((b.steal_percent_since(&a) - 15.0).abs() < 1e-9);
        assert_eq!(a.steal_percent_since(&a), 0.0);
        assert_eq!(b.busy() - a.busy(), 150);
        let hz = super::clock_ticks_per_sec() as f64;
        assert!((b.busy_secs_since(&a) - 150.0 / hz).abs() < 1e-9);
        assert_eq!(a.busy_secs_since(&b), 0.0, "never negative");
        assert_eq!(CpuTimes::parse("cpu  1 2 3\n"), None);
        assert_eq!(CpuTimes::parse("intr 1 2 3\n"), None);
    }

    #[test]
    fn process_stat_fields_are_counted_after_the_command_name() {
        let t = "1234 (tmem (x) y) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 75 3 4 20 0 9 0 1 2 3\n";
        let p = ProcessCpu::parse_stat(t, 100).unwrap();
        assert!((p.user_secs - 2.5).abs() < 1e-9 && (p.system_secs - 0.75).abs() < 1e-9, "{p:?}");
        assert_eq!(ProcessCpu::parse_stat("1234 (x) S 1 2", 100), None);
        assert_eq!(ProcessCpu::parse_stat("no parenthesis", 100), None);
        let d = ProcessCpu { user_secs: 1.0, system_secs: 2.0 }.since(&p);
        assert_eq!(d, ProcessCpu { user_secs: 0.0, system_secs: 1.25 });
    }

    #[test]
    fn threads_group_by_name_less_its_number_and_count_from_the_earlier_reading() {
        let t = "77 (tmem-fuse-12) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 75 3 4 20 0 9 0 1 2 3\n";
        let (name, cpu) = ThreadsCpu::parse_thread_stat(t, 100).unwrap();
        assert_eq!((name.as_str(), cpu), ("tmem-fuse-12", ProcessCpu { user_secs: 2.5, system_secs: 0.75 }));
        let cpu = |u, s| ProcessCpu { user_secs: u, system_secs: s };
        let mut before = ThreadsCpu::default();
        before.insert(1, "tmem", cpu(5.0, 1.0));
        before.insert(2, "tmem-fuse-0", cpu(1.0, 1.0));
        before.insert(3, "tmem-fuse-1", cpu(2.0, 2.0));
        before.insert(9, "old-name", cpu(3.0, 0.0));
        let mut after = before.clone();
        after.insert(2, "tmem-fuse-0", cpu(1.5, 2.0));
        after.insert(3, "tmem-fuse-1", cpu(2.5, 2.5));
        after.insert(4, "tmem-front", cpu(0.25, 0.25));
        // A thread id reused by a thread of another name counts from zero.
        after.insert(9, "42", cpu(0.5, 0.0));
        let roles = after.by_role_since(&before);
        let role = |role: &str, threads, u, s| RoleCpu { role: role.into(), threads, cpu: cpu(u, s) };
        assert_eq!(
            roles,
            [role("tmem-fuse-*", 2, 1.0, 1.5), role("42", 1, 0.5, 0.0), role("tmem-front", 1, 0.25, 0.25)],
            "the main thread used nothing and is left out; a name of digits only stays whole"
        );
    }

    #[test]
    fn reads_the_threads_of_this_process() {
        let pid = i32::try_from(std::process::id()).unwrap();
        let spin = std::thread::Builder::new()
            .name("spin-7".into())
            .spawn(|| {
                let t = std::time::Instant::now();
                while t.elapsed() < std::time::Duration::from_millis(60) {
                    std::hint::black_box(t.elapsed());
                }
                std::thread::sleep(std::time::Duration::from_millis(200));
            })
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(100));
        let now = ThreadsCpu::of_pid(pid).unwrap();
        spin.join().unwrap();
        let roles = now.by_role_since(&ThreadsCpu::default());
        assert!(roles.iter().any(|r| r.role == "spin-*" && r.threads == 1 && r.cpu.total_secs() > 0.0), "{roles:?}");
        assert_eq!(ThreadsCpu::of_pid(-1), None);
    }

    #[test]
    fn reads_this_process_and_the_machine() {
        let own = ProcessCpu::of_pid(i32::try_from(std::process::id()).unwrap()).unwrap();
        assert!(own.total_secs() >= 0.0);
        let mark = CpuMark::now();
        let t = std::time::Instant::now();
        let mut x = 0_u64;
        while t.elapsed() < std::time::Duration::from_millis(50) {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        let spent = mark.spent();
        assert!(spent.process.user_secs + spent.process.system_secs > 0.01, "{spent:?}");
        assert!(spent.machine_busy_secs.unwrap() >= 0.0);
    }
}
