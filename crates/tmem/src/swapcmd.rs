//! `tmem swap up|down`, `tmem stat`, `tmem set`: the CLI side of the daemon.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tmem_block::DeviceStats;

use crate::ctl::{self, Request};
use crate::daemon::{self, human, DaemonSpec, DeviceSpec, Status};

/// `/dev/fuse` worker threads of `tmem swap up` (and of the bench's fuse-ram baseline).
pub const DEFAULT_FUSE_THREADS: usize = 4;

/// Arguments of `tmem swap up`.
#[derive(clap::Args, Debug)]
pub struct UpArgs {
    /// Size of each swap device (it is sparse: only stored pages use memory).
    #[arg(long, default_value = "8G", value_parser = tmem_corpus::parse_size)]
    size: u64,
    /// Pool memory limit per device: a size (2G) or a percentage of RAM (25%).
    #[arg(long, default_value = "25%")]
    pool_limit: String,
    /// Codec: lz4, zstd, zstd:LEVEL; "+dict" trains a dictionary on the first 8 MiB of compressed pages and switches to it.
    #[arg(long, default_value = "lz4")]
    codec: String,
    /// Swap priority (higher is used first; disk swap is usually negative).
    #[arg(long, default_value_t = 100)]
    priority: i32,
    /// Number of devices (swap0, swap1, ...); the kernel spreads pages over equal priorities.
    #[arg(long, default_value_t = 1)]
    devices: usize,
    /// FUSE worker threads.
    #[arg(long, default_value_t = DEFAULT_FUSE_THREADS)]
    fuse_threads: usize,
    /// FUSE over io_uring workers per CPU; 0 serves requests on /dev/fuse only.
    /// Falls back to /dev/fuse (and says so) where the kernel lacks it.
    #[arg(long, default_value_t = 0)]
    fuse_uring: usize,
    /// How freed swap slots reach the pool (swapon --discard): once or pages.
    #[arg(long, default_value = "once")]
    discard: tmem_sys::swap::SwapDiscard,
    /// Runtime directory (control socket, FUSE mount, log).
    #[arg(long, default_value = ctl::RUNTIME_DIR)]
    runtime_dir: PathBuf,
    #[command(flatten)]
    tiers: crate::tiers::TierArgs,
}

/// Arguments shared by commands that talk to a running daemon.
#[derive(clap::Args, Debug)]
pub struct DaemonArgs {
    /// Runtime directory of the daemon.
    #[arg(long, default_value = ctl::RUNTIME_DIR)]
    pub runtime_dir: PathBuf,
}

fn parse_limit(s: &str) -> Result<(u64, u32), String> {
    match s.strip_suffix('%') {
        Some(p) => {
            let p: u32 = p.trim().parse().map_err(|_| format!("bad pool limit {s:?}"))?;
            if p == 0 || p > 100 {
                return Err(format!("pool limit {s:?} must be 1%..100%"));
            }
            Ok((0, p))
        }
        None => Ok((tmem_corpus::parse_size(s)?, 0)),
    }
}

/// Device specs `PREFIX0..PREFIXn-1`, all alike.
fn device_specs(prefix: &str, n: usize, size: u64, codec: &str, pool_limit: &str) -> Result<Vec<DeviceSpec>, String> {
    let (pool_limit_bytes, pool_limit_percent) = parse_limit(pool_limit)?;
    Ok((0..n)
        .map(|i| DeviceSpec {
            name: format!("{prefix}{i}"),
            size,
            codec: codec.to_owned(),
            pool_limit_bytes,
            pool_limit_percent,
        })
        .collect())
}

/// `tmem swap up`: starts the daemon and waits until swap is on.
pub fn up(a: &UpArgs) -> Result<(), String> {
    if !tmem_sys::is_root() {
        return Err("tmem swap up needs root (it mounts FUSE, attaches loop devices and runs swapon)".into());
    }
    if ctl::call(&a.runtime_dir, &Request::Status, Duration::from_secs(2)).is_ok() {
        return Err(format!("a tmem daemon is already running ({}); see `tmem stat`", a.runtime_dir.display()));
    }
    if a.devices == 0 || a.size < 1 << 20 {
        return Err("need at least one device of at least 1 MiB".into());
    }
    let devices = device_specs("swap", a.devices, a.size, &a.codec, &a.pool_limit)?;
    // Check the configuration here, where the user sees the error.
    for d in &devices {
        daemon::store_config(d, 1)?.build().map_err(|e| e.to_string())?;
    }
    a.tiers.validate(devices.len())?;
    let spec = DaemonSpec {
        runtime_dir: a.runtime_dir.clone(),
        devices,
        fuse: true,
        swap: true,
        nbd: None,
        nbd_allow_remote: false,
        priority: a.priority,
        fuse_threads: a.fuse_threads,
        fuse_uring: a.fuse_uring,
        discard: a.discard,
        tiers: a.tiers.clone(),
    };
    std::fs::create_dir_all(&a.runtime_dir).map_err(|e| format!("{}: {e}", a.runtime_dir.display()))?;
    let log = daemon::log_path(&a.runtime_dir);
    let log_file = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = Command::new(exe)
        .arg("daemon")
        .arg("--spec")
        .arg(serde_json::to_string(&spec).map_err(|e| e.to_string())?)
        .stdin(Stdio::null())
        .stdout(log_file.try_clone().map_err(|e| e.to_string())?)
        .stderr(log_file)
        .process_group(0)
        .spawn()
        .map_err(|e| format!("cannot start the daemon: {e}"))?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            return Err(format!("the daemon exited during setup ({status}); its log:\n{}", tail(&log)));
        }
        if let Ok(r) = ctl::call(&a.runtime_dir, &Request::Status, Duration::from_secs(5)) {
            let st: Status = serde_json::from_value(r.data).map_err(|e| e.to_string())?;
            if st.state == "up" {
                for s in &st.steps {
                    println!("{s}");
                }
                println!("tmem swap is up (daemon pid {}, log {})", st.pid, log.display());
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            return Err(format!("the daemon did not come up within 60 s; its log:\n{}", tail(&log)));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// `tmem swap down`: orderly teardown, then waits for the daemon to exit.
pub fn down(a: &DaemonArgs) -> Result<(), String> {
    let before: Status =
        serde_json::from_value(ctl::call_ok(&a.runtime_dir, &Request::Status, Duration::from_secs(5))?)
            .map_err(|e| e.to_string())?;
    let n = before.steps.len();
    // swapoff reads every page back: allow it time.
    let after: Status =
        serde_json::from_value(ctl::call_ok(&a.runtime_dir, &Request::Down, Duration::from_secs(3600))?)
            .map_err(|e| e.to_string())?;
    for s in after.steps.iter().skip(n) {
        println!("{s}");
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    // SAFETY: kill with signal 0 only checks that the pid exists.
    while unsafe { libc::kill(libc::pid_t::try_from(after.pid).unwrap_or(0), 0) } == 0 {
        if Instant::now() > deadline {
            return Err(format!("daemon pid {} did not exit", after.pid));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    println!("tmem swap is down (daemon pid {} exited)", after.pid);
    Ok(())
}

/// `tmem stat`: a zramctl-like table, or every counter as JSON.
pub fn stat(a: &DaemonArgs, json: bool) -> Result<(), String> {
    let data = ctl::call_ok(&a.runtime_dir, &Request::Stat, Duration::from_secs(10))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&data).map_err(|e| e.to_string())?);
        return Ok(());
    }
    let devs: Vec<DeviceStats> = serde_json::from_value(data).map_err(|e| e.to_string())?;
    print_stat_table(&devs);
    Ok(())
}

/// Prints a zramctl-like table.
pub fn print_stat_table(devs: &[DeviceStats]) {
    println!(
        "{:<8} {:>9} {:>9} {:>9} {:>9} {:>6} {:>8} {:>7} {:>7} {:>8} {:>9} {:>8} {:>8} {:<8}",
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
        "CODEC"
    );
    for d in devs {
        let t = &d.store.total;
        let rejects =
            t.pool_limit_hit + t.reject_compress_poor + t.reject_compress_fail + t.reject_alloc_fail + t.reject_frozen;
        let limit = if d.store.pool_limit_bytes == u64::MAX { "-".into() } else { human(d.store.pool_limit_bytes) };
        println!(
            "{:<8} {:>9} {:>9} {:>9} {:>9} {:>6.2} {:>8} {:>7} {:>7} {:>8} {:>9} {:>8} {:>8} {:<8}",
            d.name,
            human(d.disksize),
            human(t.orig_data_size),
            human(t.compr_data_size),
            human(d.store.mem_used_total),
            d.store.ratio,
            t.stored_pages,
            t.same_filled_pages,
            t.stored_incompressible_pages,
            t.tier_pages,
            limit,
            rejects,
            d.failed_reads + d.failed_writes,
            d.store.codec
        );
    }
}

/// `tmem set DEVICE KEY=VALUE...`.
pub fn set(a: &DaemonArgs, device: &str, assignments: &[String]) -> Result<(), String> {
    for kv in assignments {
        let (key, value) = kv.split_once('=').ok_or_else(|| format!("expected KEY=VALUE, got {kv:?}"))?;
        let req =
            Request::Set { device: device.to_owned(), key: key.trim().to_owned(), value: value.trim().to_owned() };
        let msg = ctl::call_ok(&a.runtime_dir, &req, Duration::from_secs(60))?;
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
    /// Number of devices (exports disk0, disk1, ...).
    #[arg(long, default_value_t = 1)]
    devices: usize,
    /// Pool memory limit per device: a size or a percentage of RAM.
    #[arg(long, default_value = "25%")]
    pool_limit: String,
    /// Codec: lz4, zstd, zstd:LEVEL; "+dict" trains a dictionary on the first 8 MiB of compressed pages and switches to it.
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
    /// Runtime directory (control socket for `tmem stat`/`tmem set`).
    #[arg(long, default_value = ctl::RUNTIME_DIR)]
    runtime_dir: PathBuf,
    #[command(flatten)]
    tiers: crate::tiers::TierArgs,
}

/// `tmem serve nbd`: exports devices over NBD in the foreground until SIGINT/SIGTERM.
pub fn serve_nbd(a: &ServeNbdArgs) -> Result<(), String> {
    if ctl::call(&a.runtime_dir, &Request::Status, Duration::from_secs(2)).is_ok() {
        return Err(format!("a tmem daemon already uses {}; pass another --runtime-dir", a.runtime_dir.display()));
    }
    a.tiers.validate(a.devices.max(1))?;
    let devices = device_specs("disk", a.devices.max(1), a.size, &a.codec, &a.pool_limit)?;
    let listen = match (&a.tcp, &a.socket) {
        (Some(addr), _) => format!("tcp:{addr}"),
        (None, Some(p)) => p.display().to_string(),
        (None, None) => a.runtime_dir.join("nbd.sock").display().to_string(),
    };
    daemon::run(DaemonSpec {
        runtime_dir: a.runtime_dir.clone(),
        devices,
        fuse: false,
        swap: false,
        nbd: Some(listen),
        nbd_allow_remote: a.allow_remote,
        priority: 0,
        fuse_threads: 0,
        fuse_uring: 0,
        discard: tmem_sys::swap::SwapDiscard::default(),
        tiers: a.tiers.clone(),
    })
}

/// `tmem daemon --spec JSON` (internal).
pub fn run_daemon(spec_json: &str) -> Result<(), String> {
    let spec: DaemonSpec = serde_json::from_str(spec_json).map_err(|e| format!("bad daemon spec: {e}"))?;
    daemon::run(spec)
}
