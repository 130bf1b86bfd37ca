//! `tmem swap up|down`, `tmem cache up|down`, `tmem stat`, `tmem set`, `tmem serve nbd`: parse,
//! call the daemon crate, print.

use std::path::PathBuf;
use std::time::Duration;

use tmem_block::DeviceStats;
use tmem_counters::Counters;
use tmem_ctl::{self as ctl, Request};
use tmem_daemon::config::Config;
use tmem_daemon::limits::{self, LimitError, Machine};
use tmem_daemon::spec::default_fuse_threads;
use tmem_daemon::spec::{cache_specs, device_specs, CacheArgs};
use tmem_daemon::{human, launch, recover, DaemonError, DaemonSpec, PoolLimit};

/// Arguments of `tmem swap up`.
#[derive(clap::Args, Clone, Debug)]
pub struct UpArgs {
    /// Size of each swap device (it is sparse: only stored pages use memory).
    #[arg(long, default_value = "8G", value_parser = tmem_corpus::parse_size)]
    size: u64,
    /// Pool memory limit per device: a size (2G, at least 1M) or a percentage of RAM (1%..100%).
    #[arg(long, default_value = "25%")]
    pool_limit: PoolLimit,
    /// Codec: lz4, zstd, zstd:LEVEL; "+dict" trains a dictionary once the pool holds 8 MiB, and newer ones as it grows;
    /// auto: lz4 with no front, zstd:3+dict behind one (tmem then holds the front's cold pages, off the fault path).
    #[arg(long, default_value = "auto")]
    codec: String,
    /// Swap priority (higher is used first; disk swap is usually negative).
    #[arg(long, default_value_t = 100)]
    priority: i32,
    /// Number of devices (swap0, swap1, ...); the kernel spreads pages over equal priorities.
    #[arg(long, default_value_t = 1)]
    devices: usize,
    /// FUSE worker threads (default: one per online CPU, at least 4).
    #[arg(long, default_value_t = default_fuse_threads())]
    fuse_threads: usize,
    /// FUSE over io_uring workers per CPU; 0 serves requests on /dev/fuse only.
    /// Falls back to /dev/fuse (and says so) where the kernel lacks it.
    #[arg(long, default_value_t = 0)]
    fuse_uring: usize,
    /// How freed swap slots reach the pool (swapon --discard): once or pages.
    #[arg(long, default_value = "once")]
    discard: tmem_sys::swap::SwapDiscard,
    /// How the kernel reaches the devices: ublk (the kernel's ublk driver;
    /// `modprobe ublk_drv` if need be), nbd (the kernel's NBD client, set
    /// up over netlink; `modprobe nbd` if need be), fuse (a loop device on
    /// a FUSE file), or auto (ublk where the kernel has it, else FUSE +
    /// loop: NBD was slower than both where it was measured).
    #[arg(long, default_value = "auto")]
    transport: tmem_daemon::transport::Transport,
    /// Empty an idle swap area that holds a few KiB in use and many freed slots' pages by swapoff, mkswap and swapon.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    recycle_idle_swap: bool,
    /// Runtime directory (control socket, FUSE mount, log).
    #[arg(long, default_value = ctl::RUNTIME_DIR)]
    runtime_dir: PathBuf,
    /// Seconds to wait for the daemon to come up; then it is stopped and undoes its setup.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    wait: u64,
    /// Serve Prometheus metrics (OpenMetrics text at /metrics) on this address, e.g. 127.0.0.1:9848.
    #[arg(long)]
    metrics: Option<std::net::SocketAddr>,
    /// Allow a non-loopback --metrics address (/metrics has no authentication: trusted networks only).
    #[arg(long, requires = "metrics")]
    allow_remote_metrics: bool,
    /// Configuration file (TOML); flags given here override it. Default: /etc/tmem/tmem.toml if it exists.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Run the daemon in this process instead of in the background (for systemd's
    /// Type=notify: it reports READY once swap is on, and pings the watchdog).
    #[arg(long)]
    foreground: bool,
    /// If a daemon already serves the runtime directory, take it over in
    /// this process (as `tmem swap restart` does) instead of starting
    /// another; its configuration stays in force. The systemd unit's start
    /// uses it, so that `systemctl restart` keeps every page.
    #[arg(long, requires = "foreground")]
    take_over_running: bool,
    /// Also serve this file or block device through a compressed cache
    /// (cache0, cache1, ...: /dev/loopN devices) whose pool shares swap0's
    /// budget: swap pages evict cached ones, never the reverse. Repeatable.
    #[arg(long = "cache-backing", value_name = "PATH")]
    cache_backing: Vec<PathBuf>,
    #[command(flatten)]
    recompress: tmem_daemon::spec::RecompressArgs,
    #[command(flatten)]
    group: tmem_daemon::spec::GroupArgs,
    #[command(flatten)]
    tiers: tmem_daemon::tiers::TierArgs,
    #[command(flatten)]
    front: tmem_daemon::front::FrontArgs,
}

impl UpArgs {
    /// These arguments with the configuration file's values wherever the
    /// command line did not give the flag.
    fn with_config(&self, c: &Config, m: &clap::ArgMatches) -> Self {
        let given = |id: &str| m.value_source(id) == Some(clap::parser::ValueSource::CommandLine);
        fn pick<T: Clone>(given: bool, flag: &T, file: &Option<T>) -> T {
            match file {
                Some(v) if !given => v.clone(),
                _ => flag.clone(),
            }
        }
        let t = &self.tiers;
        let f = &self.front;
        Self {
            size: pick(given("size"), &self.size, &c.size),
            pool_limit: pick(given("pool_limit"), &self.pool_limit, &c.pool_limit),
            codec: pick(given("codec"), &self.codec, &c.codec),
            priority: pick(given("priority"), &self.priority, &c.priority),
            devices: pick(given("devices"), &self.devices, &c.devices),
            fuse_threads: pick(given("fuse_threads"), &self.fuse_threads, &c.fuse_threads),
            fuse_uring: pick(given("fuse_uring"), &self.fuse_uring, &c.fuse_uring),
            discard: pick(given("discard"), &self.discard, &c.discard),
            transport: pick(given("transport"), &self.transport, &c.transport),
            recycle_idle_swap: pick(given("recycle_idle_swap"), &self.recycle_idle_swap, &c.recycle_idle_swap),
            runtime_dir: pick(given("runtime_dir"), &self.runtime_dir, &c.runtime_dir),
            wait: pick(given("wait"), &self.wait, &c.wait),
            metrics: pick(given("metrics"), &self.metrics, &c.metrics.map(Some)),
            allow_remote_metrics: pick(
                given("allow_remote_metrics"),
                &self.allow_remote_metrics,
                &c.allow_remote_metrics,
            ),
            config: self.config.clone(),
            foreground: self.foreground,
            take_over_running: self.take_over_running,
            cache_backing: self.cache_backing.clone(),
            recompress: tmem_daemon::spec::RecompressArgs {
                recompress: pick(given("recompress"), &self.recompress.recompress, &c.recompress.clone().map(Some)),
                recompress_after: pick(
                    given("recompress_after"),
                    &self.recompress.recompress_after,
                    &c.recompress_after,
                ),
            },
            group: tmem_daemon::spec::GroupArgs {
                group: pick(given("group"), &self.group.group, &c.group.clone().map(Some)),
                group_after: pick(given("group_after"), &self.group.group_after, &c.group_after),
            },
            tiers: tmem_daemon::tiers::TierArgs {
                tiers: pick(given("tiers"), &t.tiers, &c.tiers),
                replicas: pick(given("replicas"), &t.replicas, &c.replicas),
                key_file: pick(given("key_file"), &t.key_file, &c.key_file.clone().map(Some)),
                cluster_id: pick(given("cluster_id"), &t.cluster_id, &c.cluster_id),
                host_id: pick(given("host_id"), &t.host_id, &c.host_id.clone().map(Some)),
                disk_capacity: pick(given("disk_capacity"), &t.disk_capacity, &c.disk_capacity.map(Some)),
            },
            front: tmem_daemon::front::FrontArgs {
                front: pick(given("front"), &f.front, &c.front),
                front_limit: pick(given("front_limit"), &f.front_limit, &c.front_limit),
                front_algorithm: pick(given("front_algorithm"), &f.front_algorithm, &c.front_algorithm),
                front_idle_age: pick(given("front_idle_age"), &f.front_idle_age, &c.front_idle_age),
                front_fill: pick(given("front_fill"), &f.front_fill, &c.front_fill),
                front_rate: pick(given("front_rate"), &f.front_rate, &c.front_rate),
                front_cgroups: pick(given("front_cgroups"), &f.front_cgroups, &c.front_cgroups),
            },
        }
    }
}

/// Arguments shared by commands that talk to a running daemon.
#[derive(clap::Args, Debug)]
pub struct DaemonArgs {
    /// Runtime directory of the daemon.
    #[arg(long, default_value = ctl::RUNTIME_DIR)]
    pub runtime_dir: PathBuf,
}

/// A count as `u64` for [`limits`] (a `usize` always fits).
fn count(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

impl UpArgs {
    /// Checks every count and size against this machine before anything is
    /// built from them; a value from the configuration file passed the same
    /// checks there, so a refusal here names the flag.
    fn check_limits(&self, m: &Machine) -> Result<(), LimitError> {
        limits::devices("--devices", count(self.devices), true)?;
        limits::caches("--cache-backing", count(self.cache_backing.len()), count(self.devices))?;
        limits::pool_limit("--pool-limit", self.pool_limit, m.total_ram)?;
        limits::fuse_threads("--fuse-threads", count(self.fuse_threads), m)?;
        limits::fuse_uring("--fuse-uring", count(self.fuse_uring), m)?;
        limits::wait("--wait", self.wait)?;
        limits::replicas("--replicas", count(self.tiers.replicas))?;
        Ok(())
    }
}

/// `tmem swap up`: starts the daemon and waits until swap is on.
pub fn up(a: &UpArgs, m: &clap::ArgMatches) -> anyhow::Result<()> {
    let a = &a.with_config(&Config::load_default_or(a.config.as_deref())?, m);
    if a.take_over_running {
        if let Ok(v) = ctl::call_ok(&a.runtime_dir, &Request::Status, Duration::from_secs(10)) {
            let old: tmem_ctl::Status = serde_json::from_value(v)?;
            println!(
                "daemon pid {} already serves {}: this process takes it over, with the configuration it runs",
                old.pid,
                a.runtime_dir.display()
            );
            let role = tmem_daemon::handover::Successor::InService;
            return Ok(tmem_daemon::handover::run_successor(a.runtime_dir.clone(), role)?);
        }
    }
    a.check_limits(&Machine::this()?)?;
    if !tmem_sys::is_root() {
        anyhow::bail!("tmem swap up needs root (it mounts FUSE, attaches loop devices and runs swapon)");
    }
    let spec = DaemonSpec {
        runtime_dir: a.runtime_dir.clone(),
        devices: device_specs("swap", a.devices, a.size, &a.codec, a.pool_limit, &a.recompress, &a.group),
        caches: cache_specs(&a.cache_backing, &a.codec, a.pool_limit, &CacheArgs::default()),
        fuse: true,
        transport: a.transport,
        swap: true,
        nbd: None,
        nbd_allow_remote: false,
        nbd_idle_reclaim: None,
        nbd_idle_timeout: None,
        priority: a.priority,
        fuse_threads: a.fuse_threads,
        fuse_uring: a.fuse_uring,
        discard: a.discard,
        recycle_idle_swap: a.recycle_idle_swap,
        tiers: a.tiers.clone(),
        metrics: a.metrics,
        metrics_allow_remote: a.allow_remote_metrics,
        front: a.front.clone(),
        lock_fd: None,
    };
    // Check everything here, where the user sees the error.
    spec.validate(tmem_sys::swap::total_ram_bytes()?)?;
    start(spec, a.foreground, a.wait, "swap")
}

/// Starts a daemon on `spec` (checked), in this process or in the
/// background, cleaning what a dead one left first; `what` names it.
pub fn start(spec: DaemonSpec, foreground: bool, wait: u64, what: &str) -> anyhow::Result<()> {
    let dir = spec.runtime_dir.clone();
    if let Some(left) = recover::inspect(&dir)? {
        println!(
            "a tmem daemon{} died here and left {}; cleaning up first:",
            left.pid.map(|p| format!(" (pid {p})")).unwrap_or_default(),
            left.summary()
        );
        print_recovery(&recover::clean(&dir)?);
    }
    if foreground {
        return Ok(tmem_daemon::run(spec)?);
    }
    let st = launch::start(spec, &std::env::current_exe()?, Duration::from_secs(wait))?;
    for s in &st.steps {
        println!("{s}");
    }
    println!("tmem {what} is up (daemon pid {}, log {})", st.pid, dir.join(tmem_daemon::runtime::LOG_FILE).display());
    Ok(())
}

/// Arguments of `tmem swap down`.
#[derive(clap::Args, Debug)]
pub struct SwapDownArgs {
    #[command(flatten)]
    pub daemon: DaemonArgs,
    /// Under systemd, while the unit restarts (`systemctl restart`): hand
    /// the daemon over to a process outside the unit, which the unit's
    /// start takes over (`swap up --take-over-running`), instead of
    /// swapoff. Otherwise a plain `swap down`.
    #[arg(long)]
    pub unless_restarting: bool,
    /// With --unless-restarting: seconds to wait for the hand-over.
    #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..))]
    pub wait: u64,
}

/// `tmem swap down [--unless-restarting]`.
pub fn swap_down(a: &SwapDownArgs) -> anyhow::Result<()> {
    if a.unless_restarting && crate::restartcmd::hand_over_for_restart(&a.daemon.runtime_dir, a.wait)? {
        return Ok(());
    }
    down(&a.daemon, "swap")
}

/// `tmem swap down`: orderly teardown, then waits for the daemon to exit.
///
/// With no daemon running, it removes whatever a dead one left (swap areas,
/// loop devices, its mount, its files) and says what was lost; it exits 0
/// once nothing of tmem is left in the directory.
pub fn down(a: &DaemonArgs, what: &str) -> anyhow::Result<()> {
    match launch::stop(&a.runtime_dir) {
        Ok((steps, pid)) => {
            for s in steps {
                println!("{s}");
            }
            println!("tmem {what} is down (daemon pid {pid} exited)");
            Ok(())
        }
        Err(DaemonError::Ctl(tmem_ctl::CtlError::NoDaemon { .. })) => match recover::inspect(&a.runtime_dir)? {
            Some(left) => {
                println!(
                    "the tmem daemon{} is dead; it left {}",
                    left.pid.map(|p| format!(" (pid {p})")).unwrap_or_default(),
                    left.summary()
                );
                let r = recover::clean(&a.runtime_dir)?;
                print_recovery(&r);
                // The swap areas' use when the daemon died: slots that only the
                // swap cache held (of processes that have exited) count too.
                println!("tmem {what} is down (at most {} pages were lost with the dead daemon)", r.lost_pages);
                Ok(())
            }
            None => {
                println!("tmem {what} is down (no daemon runs in {}, and none left anything)", a.runtime_dir.display());
                Ok(())
            }
        },
        Err(e) => Err(e.into()),
    }
}

fn print_recovery(r: &recover::Recovery) {
    for s in &r.steps {
        println!("{s}");
    }
}

/// `tmem stat`: a zramctl-like table, or every counter as JSON.
pub fn stat(a: &DaemonArgs, json: bool, counters: bool, runs: bool) -> anyhow::Result<()> {
    if runs {
        return stat_runs(json, counters);
    }
    let data = match ctl::call_ok(&a.runtime_dir, &Request::Stat, Duration::from_secs(10)) {
        Ok(d) => d,
        // No daemon where none was asked for by name: this user's runs, if any.
        Err(ctl::CtlError::NoDaemon { .. })
            if a.runtime_dir == std::path::Path::new(ctl::RUNTIME_DIR) && !run_devices()?.is_empty() =>
        {
            return stat_runs(json, counters);
        }
        Err(e @ ctl::CtlError::NoDaemon { .. }) => match recover::inspect(&a.runtime_dir)? {
            Some(left) => anyhow::bail!(
                "the tmem daemon{} is dead and its swap is orphaned: {} ({} pages lost); `tmem swap down --runtime-dir {}` cleans up",
                left.pid.map(|p| format!(" (pid {p})")).unwrap_or_default(),
                left.summary(),
                left.lost_pages(),
                a.runtime_dir.display()
            ),
            None => return Err(e.into()),
        },
        Err(e) => return Err(e.into()),
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&data)?);
        return Ok(());
    }
    let devs: Vec<DeviceStats> = serde_json::from_value(data)?;
    print_stat(&devs, json, counters)
}

fn print_stat(devs: &[DeviceStats], json: bool, counters: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(devs)?);
    } else if counters {
        print_counters(devs);
    } else {
        print_stat_table(devs);
    }
    Ok(())
}

/// Every `tmem run` instance of this user, as devices. The directory of a
/// run that died without removing it (SIGKILL) is removed.
fn run_devices() -> anyhow::Result<Vec<DeviceStats>> {
    let mut devs = Vec::new();
    for (pid, dir) in ctl::runs() {
        match ctl::call_ok(&dir, &Request::Stat, Duration::from_secs(10)) {
            Ok(v) => devs.extend(serde_json::from_value::<Vec<DeviceStats>>(v)?),
            Err(ctl::CtlError::NoDaemon { .. }) if !std::path::Path::new(&format!("/proc/{pid}")).exists() => {
                let _ = std::fs::remove_dir_all(&dir);
            }
            Err(e) => anyhow::bail!("tmem run (pid {pid}): {e}"),
        }
    }
    Ok(devs)
}

fn stat_runs(json: bool, counters: bool) -> anyhow::Result<()> {
    let devs = run_devices()?;
    if devs.is_empty() && !json {
        anyhow::bail!("no tmem run instance of this user is running (none listens in {})", ctl::runs_dir().display());
    }
    if json || counters {
        return print_stat(&devs, json, counters);
    }
    print_run_table(&devs);
    Ok(())
}

/// One row per `tmem run` instance.
fn print_run_table(devs: &[DeviceStats]) {
    let mut t = tmem_bench::table::plain([
        "NAME", "PROGRAM", "MEMORY", "RESIDENT", "PEAK", "STORED", "TOTAL", "RATIO", "FAULTS", "EVICTED", "BUSY",
        "LOST", "PROCS", "CODEC",
    ]);
    let pages = |n: u64| human(n * 4096);
    for d in devs {
        let Some(r) = &d.run else { continue };
        t.add_row([
            d.name.clone(),
            r.program.clone(),
            human(r.memory_limit_bytes),
            pages(r.resident_pages),
            pages(r.resident_peak_pages),
            pages(r.stored_pages),
            human(d.store.mem_used_total),
            format!("{:.2}", d.store.ratio),
            (r.engine.store_fills + r.engine.slot_returns).to_string(),
            r.engine.evicted.to_string(),
            r.engine.move_busy.to_string(),
            r.lost_pages.to_string(),
            r.processes.to_string(),
            d.store.codec.clone(),
        ]);
    }
    println!("{t}");
}

/// Prints every counter of every device, from the counters' definitions.
fn print_counters(devs: &[DeviceStats]) {
    fn rows<C: Counters>(t: &mut comfy_table::Table, device: &str, group: &str, c: &C) {
        for (d, v) in c.values() {
            t.add_row([device, group, d.name, &v.to_string(), d.unit.name(), d.help()]);
        }
    }
    let mut t = tmem_bench::table::plain(["DEVICE", "OF", "COUNTER", "VALUE", "UNIT", "MEANING"]);
    for d in devs {
        rows(&mut t, &d.name, "device", d);
        rows(&mut t, &d.name, "store", &d.store);
        rows(&mut t, &d.name, "pools", &d.store.total);
        rows(&mut t, &d.name, "allocator", &d.store.alloc);
        if let Some(b) = &d.backing {
            rows(&mut t, &d.name, "backing", b);
        }
        if let Some(f) = &d.front {
            rows(&mut t, &d.name, "front", f);
        }
        if let Some(r) = &d.run {
            rows(&mut t, &d.name, "run", r);
            rows(&mut t, &d.name, "run", &r.engine);
        }
        for tier in &d.store.tiers {
            rows(&mut t, &d.name, &format!("tier {}", tier.name), tier);
        }
    }
    for i in [1, 2, 4, 5] {
        if let Some(c) = t.column_mut(i) {
            c.set_cell_alignment(comfy_table::CellAlignment::Left);
        }
    }
    println!("{t}");
}

/// Prints a zramctl-like table.
pub fn print_stat_table(devs: &[DeviceStats]) {
    let mut t = tmem_bench::table::plain([
        "NAME",
        "DISKSIZE",
        "DATA",
        "COMPR",
        "TOTAL",
        "RATIO",
        "PAGES",
        "SAME",
        "HUGE",
        "TIERED",
        "LIMIT",
        "REJECTS",
        "FAILED",
        "CODEC",
        "TRANSPORT",
    ]);
    for d in devs {
        let t_ = &d.store.total;
        let rejects = t_.pool_limit_hit
            + t_.reject_compress_poor
            + t_.reject_compress_fail
            + t_.reject_alloc_fail
            + t_.reject_frozen;
        let limit = if d.store.pool_limit_bytes == u64::MAX { "-".into() } else { human(d.store.pool_limit_bytes) };
        t.add_row([
            d.name.clone(),
            human(d.disksize),
            human(t_.orig_data_size),
            human(t_.compr_data_size),
            human(d.store.mem_used_total),
            format!("{:.2}", d.store.ratio),
            t_.stored_pages.to_string(),
            t_.same_filled_pages.to_string(),
            t_.stored_incompressible_pages.to_string(),
            t_.tier_pages.to_string(),
            limit,
            rejects.to_string(),
            (d.failed_reads + d.failed_writes).to_string(),
            d.store.codec.clone(),
            d.transport.as_ref().map_or_else(|| "-".into(), |t| format!("{} {}", t.kind, t.node.display())),
        ]);
    }
    println!("{t}");
    print_codec_table(devs);
    print_cache_table(devs);
    print_front_table(devs);
}

/// The front in front of each device, and what its policy did.
fn print_front_table(devs: &[DeviceStats]) {
    let fronts: Vec<(&DeviceStats, &tmem_front::FrontStats)> =
        devs.iter().filter_map(|d| d.front.as_ref().map(|f| (d, f))).collect();
    if fronts.is_empty() {
        return;
    }
    let mut t = tmem_bench::table::plain([
        "NAME", "FRONT", "DEVICE", "POOL", "DATA", "BUDGET", "FILL AT", "SERVED", "WRITTEN", "READ", "AGE", "RATE",
    ]);
    for (d, f) in &fronts {
        t.add_row([
            d.name.clone(),
            f.front.clone(),
            f.node.clone(),
            human(f.pool_bytes),
            human(f.stored_bytes),
            human(f.budget_bytes),
            human(f.fill_bytes),
            f.front_reads.to_string(),
            f.written_back.to_string(),
            f.read_back.to_string(),
            format!("{} s", f.idle_age_us / 1_000_000),
            format!("{}/s", f.rate_pages),
        ]);
    }
    println!("{t}");
    for (d, f) in fronts {
        println!("{}: {} ({}); policy: {}", d.name, f.front, f.reason, f.state);
    }
}

/// Hits, misses and backing I/O of cache devices.
fn print_cache_table(devs: &[DeviceStats]) {
    let caches: Vec<(&DeviceStats, &tmem_block::BackingStats)> =
        devs.iter().filter_map(|d| d.backing.as_ref().map(|b| (d, b))).collect();
    if caches.is_empty() {
        return;
    }
    let mut t = tmem_bench::table::plain([
        "NAME",
        "BACKING",
        "HITS",
        "MISSES",
        "HIT%",
        "FROM BACKING",
        "TO BACKING",
        "EVICTED",
        "REFUSED",
        "ERRORS",
    ]);
    for (d, b) in caches {
        // The cache's own pool: the store may also hold swap0's and other caches'.
        let pool = d.store.pools.iter().find(|p| p.pool_id == Some(b.pool));
        let (hits, misses, evicted) = pool.map_or((0, 0, 0), |p| (p.succ_gets, p.failed_gets, p.evicted_pages));
        let ratio = if hits + misses == 0 {
            "-".into()
        } else {
            format!("{:.1}", 100.0 * hits as f64 / (hits + misses) as f64)
        };
        t.add_row([
            d.name.clone(),
            b.path.display().to_string(),
            hits.to_string(),
            misses.to_string(),
            ratio,
            human(b.backing_read_bytes),
            human(b.backing_write_bytes),
            evicted.to_string(),
            b.fills_refused.to_string(),
            b.backing_errors.to_string(),
        ]);
    }
    println!("\n{t}");
}

/// What each codec holds, and what recompression and grouping did, where
/// a device holds pages of more than one codec, recompresses or groups.
fn print_codec_table(devs: &[DeviceStats]) {
    let shown: Vec<&DeviceStats> = devs
        .iter()
        .filter(|d| d.store.codecs.len() > 1 || d.store.recompression.is_some() || d.store.grouping.is_some())
        .collect();
    if shown.is_empty() {
        return;
    }
    let mut t = tmem_bench::table::plain(["NAME", "CODEC", "PAGES", "COMPR", "RATIO"]);
    for d in &shown {
        for c in &d.store.codecs {
            let ratio = if c.bytes == 0 { 0.0 } else { (c.pages * 4096) as f64 / c.bytes as f64 };
            t.add_row([d.name.clone(), c.codec.clone(), c.pages.to_string(), human(c.bytes), format!("{ratio:.2}")]);
        }
    }
    println!("\n{t}");
    for d in shown {
        if let Some(r) = &d.store.recompression {
            let p = &d.store.total;
            println!(
                "{}: recompression {r}: {} pages recompressed, {} saved, {} kept as they were, {} raced",
                d.name,
                p.recompressed_pages,
                human(p.recompress_saved_bytes),
                p.recompress_kept,
                p.recompress_raced
            );
        }
        if let Some(g) = &d.store.grouping {
            let p = &d.store.total;
            let ratio = if p.group_bytes == 0 { 0.0 } else { (p.group_pages * 4096) as f64 / p.group_bytes as f64 };
            println!(
                "{}: grouping {g}: {} pages in {} groups ({} of blocks, {ratio:.2}x), {} dead slots; {} pages \
                 grouped, {} rewrites, {} kept single, {} raced; block cache {} hits, {} misses",
                d.name,
                p.group_pages,
                p.groups,
                human(p.group_bytes),
                p.group_dead_pages,
                p.pages_grouped,
                p.group_rewrites,
                p.group_kept,
                p.group_raced,
                p.group_cache_hits,
                p.group_cache_misses
            );
        }
    }
}

/// `tmem set DEVICE KEY=VALUE...`.
pub fn set(a: &DaemonArgs, device: &str, assignments: &[String]) -> anyhow::Result<()> {
    // A `tmem run` instance (`tmem stat --runs` names them) has its own socket.
    let dir = match device.strip_prefix("run-").and_then(|pid| pid.parse::<u32>().ok()) {
        Some(pid) => ctl::runs_dir().join(pid.to_string()),
        None => a.runtime_dir.clone(),
    };
    for kv in assignments {
        let (key, value) = kv.split_once('=').ok_or_else(|| anyhow::anyhow!("expected KEY=VALUE, got {kv:?}"))?;
        let req =
            Request::Set { device: device.to_owned(), key: key.trim().to_owned(), value: value.trim().to_owned() };
        let msg = ctl::call_ok(&dir, &req, Duration::from_secs(60))?;
        println!("{device}: {}", msg.as_str().unwrap_or_default());
    }
    Ok(())
}

/// Arguments of `tmem serve nbd`.
#[derive(clap::Args, Debug)]
pub struct ServeNbdArgs {
    /// Size of each device.
    #[arg(long, default_value = "8G", value_parser = tmem_corpus::parse_size)]
    size: u64,
    /// Number of devices (exports disk0, disk1, ...); default 1, or 0 with --backing.
    #[arg(long)]
    devices: Option<usize>,
    /// Also export this file or block device through a compressed cache
    /// (cache0, cache1, ...; sharing disk0's pool budget when there is one). Repeatable.
    #[arg(long, value_name = "PATH")]
    backing: Vec<PathBuf>,
    #[command(flatten)]
    cache: CacheArgs,
    /// Pool memory limit per device: a size (at least 1M) or a percentage of RAM (1%..100%).
    #[arg(long, default_value = "25%")]
    pool_limit: PoolLimit,
    /// Codec: lz4, zstd, zstd:LEVEL; "+dict" trains a dictionary once the pool holds 8 MiB, and newer ones as it grows.
    #[arg(long, default_value = "lz4")]
    codec: String,
    /// Unix socket to listen on (default: RUNTIME_DIR/nbd.sock).
    #[arg(long, conflicts_with = "tcp")]
    socket: Option<PathBuf>,
    /// TCP address instead, e.g. 127.0.0.1:10809 (loopback unless --allow-remote).
    #[arg(long)]
    tcp: Option<String>,
    /// Allow a non-loopback TCP address (NBD has no authentication: trusted networks only).
    #[arg(long)]
    allow_remote: bool,
    /// Seconds without a request after which an NBD connection is closed when a new client needs its
    /// slot (all taken, or the client's share); never while slots are free, so idle swap clients keep
    /// theirs. 0: never.
    #[arg(long, value_name = "SECS", default_value_t = tmem_nbd::DEFAULT_IDLE_RECLAIM.as_secs())]
    nbd_idle_reclaim: u64,
    /// Seconds without a request after which any NBD connection is closed, even with slots free.
    /// 0 (default): never. Not for swap clients: the kernel's NBD client sends nothing while idle.
    #[arg(long, value_name = "SECS", default_value_t = 0)]
    nbd_idle_timeout: u64,
    /// Runtime directory (control socket for `tmem stat`/`tmem set`).
    #[arg(long, default_value = ctl::RUNTIME_DIR)]
    runtime_dir: PathBuf,
    /// Serve Prometheus metrics (OpenMetrics text at /metrics) on this address, e.g. 127.0.0.1:9848.
    #[arg(long)]
    metrics: Option<std::net::SocketAddr>,
    /// Allow a non-loopback --metrics address (/metrics has no authentication: trusted networks only).
    #[arg(long, requires = "metrics")]
    allow_remote_metrics: bool,
    #[command(flatten)]
    recompress: tmem_daemon::spec::RecompressArgs,
    #[command(flatten)]
    group: tmem_daemon::spec::GroupArgs,
    #[command(flatten)]
    tiers: tmem_daemon::tiers::TierArgs,
}

/// `tmem serve nbd`: exports devices over NBD in the foreground until SIGINT/SIGTERM.
pub fn serve_nbd(a: &ServeNbdArgs) -> anyhow::Result<()> {
    let machine = Machine::this()?;
    let devices = a.devices.unwrap_or(usize::from(a.backing.is_empty()));
    limits::devices("--devices", count(devices), false)?;
    limits::caches("--backing", count(a.backing.len()), count(devices))?;
    limits::pool_limit("--pool-limit", a.pool_limit, machine.total_ram)?;
    limits::replicas("--replicas", count(a.tiers.replicas))?;
    let listen = match (&a.tcp, &a.socket) {
        (Some(addr), _) => format!("tcp:{addr}"),
        (None, Some(p)) => p.display().to_string(),
        (None, None) => a.runtime_dir.join("nbd.sock").display().to_string(),
    };
    let spec = DaemonSpec {
        runtime_dir: a.runtime_dir.clone(),
        devices: device_specs("disk", devices, a.size, &a.codec, a.pool_limit, &a.recompress, &a.group),
        caches: cache_specs(&a.backing, &a.codec, a.pool_limit, &a.cache),
        fuse: false,
        transport: tmem_daemon::transport::Transport::Fuse,
        swap: false,
        nbd: Some(listen),
        nbd_allow_remote: a.allow_remote,
        nbd_idle_reclaim: Some(a.nbd_idle_reclaim),
        nbd_idle_timeout: Some(a.nbd_idle_timeout),
        priority: 0,
        fuse_threads: 0,
        fuse_uring: 0,
        discard: tmem_sys::swap::SwapDiscard::default(),
        recycle_idle_swap: false,
        tiers: a.tiers.clone(),
        metrics: a.metrics,
        metrics_allow_remote: a.allow_remote_metrics,
        lock_fd: None,
        front: tmem_daemon::front::FrontArgs::default(),
    };
    spec.validate(tmem_sys::swap::total_ram_bytes()?)?;
    Ok(tmem_daemon::run(spec)?)
}

/// `tmem daemon --spec JSON` (internal).
pub fn run_daemon(spec_json: &str) -> anyhow::Result<()> {
    let spec: DaemonSpec = serde_json::from_str(spec_json).map_err(|e| anyhow::anyhow!("bad daemon spec: {e}"))?;
    Ok(tmem_daemon::run(spec)?)
}

/// Arguments of `tmem cache up`.
#[derive(clap::Args, Clone, Debug)]
pub struct CacheUpArgs {
    /// The file or block device to cache (cache0, cache1, ... in order). Repeatable.
    #[arg(long, required = true, value_name = "PATH")]
    backing: Vec<PathBuf>,
    /// Pool memory limit of the cache: a size (at least 1M) or a percentage of RAM (1%..100%).
    #[arg(long, default_value = "25%")]
    pool_limit: PoolLimit,
    /// Codec: lz4, zstd, zstd:LEVEL; "+dict" trains a dictionary once the pool holds 8 MiB, and newer ones as it grows.
    #[arg(long, default_value = "lz4")]
    codec: String,
    #[command(flatten)]
    cache: CacheArgs,
    /// How the kernel reaches the caches: ublk (/dev/ublkbN), nbd
    /// (/dev/nbdN of the kernel's NBD client), fuse (/dev/loopN on a FUSE
    /// file), or auto (ublk where the kernel has it, else FUSE + loop).
    #[arg(long, default_value = "auto")]
    transport: tmem_daemon::transport::Transport,
    /// FUSE worker threads (default: one per online CPU, at least 4).
    #[arg(long, default_value_t = default_fuse_threads())]
    fuse_threads: usize,
    /// Runtime directory (control socket, FUSE mount, log).
    #[arg(long, default_value = ctl::RUNTIME_DIR)]
    runtime_dir: PathBuf,
    /// Seconds to wait for the daemon to come up; then it is stopped and undoes its setup.
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    wait: u64,
    /// Serve Prometheus metrics (OpenMetrics text at /metrics) on this address.
    #[arg(long)]
    metrics: Option<std::net::SocketAddr>,
    /// Allow a non-loopback --metrics address (/metrics has no authentication: trusted networks only).
    #[arg(long, requires = "metrics")]
    allow_remote_metrics: bool,
    /// Run the daemon in this process instead of in the background.
    #[arg(long)]
    foreground: bool,
}

/// `tmem cache up`: a daemon serving each backing store through a
/// compressed cache, as a /dev/loopN to mkfs or mount. To share one memory
/// budget with swap, use `tmem swap up --cache-backing` instead.
pub fn cache_up(a: &CacheUpArgs) -> anyhow::Result<()> {
    let machine = Machine::this()?;
    limits::caches("--backing", count(a.backing.len()), 0)?;
    limits::pool_limit("--pool-limit", a.pool_limit, machine.total_ram)?;
    limits::fuse_threads("--fuse-threads", count(a.fuse_threads), &machine)?;
    limits::wait("--wait", a.wait)?;
    if !tmem_sys::is_root() {
        anyhow::bail!("tmem cache up needs root (it mounts FUSE and attaches loop devices)");
    }
    let spec = DaemonSpec {
        runtime_dir: a.runtime_dir.clone(),
        devices: Vec::new(),
        caches: cache_specs(&a.backing, &a.codec, a.pool_limit, &a.cache),
        fuse: true,
        transport: a.transport,
        swap: false,
        nbd: None,
        nbd_allow_remote: false,
        nbd_idle_reclaim: None,
        nbd_idle_timeout: None,
        priority: 0,
        fuse_threads: a.fuse_threads,
        fuse_uring: 0,
        discard: tmem_sys::swap::SwapDiscard::default(),
        recycle_idle_swap: false,
        tiers: tmem_daemon::tiers::TierArgs::default(),
        metrics: a.metrics,
        metrics_allow_remote: a.allow_remote_metrics,
        lock_fd: None,
        front: tmem_daemon::front::FrontArgs::default(),
    };
    spec.validate(machine.total_ram)?;
    start(spec, a.foreground, a.wait, "cache")
}
