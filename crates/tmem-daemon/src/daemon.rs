//! The daemon's life: setup, serving, orderly teardown.
//!
//! Started by `tmem swap up` as `tmem daemon --spec JSON` (or in the
//! foreground by `tmem serve nbd`). Before it serves anything it holds the
//! runtime directory's lock for good, makes itself the OOM killer's last
//! choice (`oom_score_adj` -1000), locks its memory (`mlockall`, on fault),
//! marks itself an I/O flusher (`PR_SET_IO_FLUSHER`) and leaves the memory
//! cgroup it may have been started in, so that a workload's memory limit
//! never throttles the process that makes room for it.
//!
//! Teardown (control `down`, SIGTERM, SIGINT or SIGHUP) is orderly: swapoff
//! first, so the kernel reads every page back; if swapoff fails (not enough
//! RAM), the daemon keeps serving and says why, since exiting would lose
//! pages. A signal during setup stops it between two steps and undoes what
//! was done, so a command line that gives up waiting leaves nothing behind.
//!
//! Threads: the main thread (setup, then waits for an [`Event`]), a signal
//! thread, the control server (a thread per client) and the frontends'
//! workers. Lock order: docs/ARCHITECTURE.md, "Lock order" (`Rank::DaemonTeardown`
//! → `DaemonState` → `DaemonEvents`).

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use tmem_lock::{Mutex, MutexGuard, Rank};

use sd_notify::NotifyState;
use tmem_block::{BlockDevice, CacheDevice, DeviceConfig, DeviceStats, PoolDevice, StaleSweep, TransportStats};
use tmem_ctl::{DeviceStatus, Request, Response, Status};
use tmem_fuse::{Export, FuseConfig, FuseMount};
use tmem_sys::swap;

use crate::runtime::{RuntimeDir, STATE_FILE};
use crate::spec::{store_config, DaemonSpec};
use crate::transport::Transport;
use crate::{control, human, knobs, DaemonError};

/// Name of the FUSE mount point in the runtime directory.
pub const MOUNT_DIR: &str = "dev";
/// How often the state file is refreshed (with the count of stored pages).
const STATE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

/// What wakes the main thread once the daemon is up.
#[derive(Debug)]
pub(crate) enum Event {
    /// SIGTERM, SIGINT or SIGHUP.
    Signal(i32),
    /// A control `down` finished its teardown and was answered.
    Down,
}

pub(crate) struct State {
    pub(crate) status: Status,
    pub(crate) fuse: Option<FuseMount>,
    pub(crate) nbd: Option<tmem_nbd::ServerHandle>,
    /// The kernel's NBD devices on this daemon (the NBD transport).
    pub(crate) kernel_nbd: Vec<tmem_nbd::kernel::KernelDevice>,
    /// The ublk devices this daemon serves (the ublk transport).
    pub(crate) ublk: Vec<tmem_ublk::UblkDevice>,
    /// ublk devices handed to this daemon that user recovery has not taken
    /// yet: their requests wait. Tried again in the background, offered to
    /// a successor, and tried once more before a teardown's swapoff.
    pub(crate) ublk_waiting: Vec<crate::handover::HandedUblk>,
    pub(crate) metrics: Option<crate::metrics::MetricsServer>,
}

/// A running daemon, shared by the main, signal and control threads.
pub struct Daemon {
    pub(crate) spec: DaemonSpec,
    pub(crate) dir: RuntimeDir,
    /// The runtime directory's lock, held for the process's life (and
    /// handed to a successor).
    pub(crate) lock_file: crate::runtime::DaemonLock,
    pub(crate) devices: Vec<Arc<PoolDevice>>,
    /// Cache devices, exported after the devices.
    pub(crate) caches: Vec<Arc<CacheDevice>>,
    pub(crate) state: Mutex<State>,
    /// Serialises teardowns and hand-overs (a `down`, a signal and a successor may race).
    pub(crate) teardown_gate: Mutex<()>,
    pub(crate) events: Mutex<mpsc::Sender<Event>>,
    /// The signal that arrived during setup, if any (0: none).
    pub(crate) signalled: Arc<AtomicI32>,
    pub(crate) exited: AtomicBool,
    /// The daemon this one took over from, if it did (`tmem swap restart`).
    pub(crate) predecessor: Option<u32>,
    /// Set while a successor takes over: the state file is the successor's to write.
    pub(crate) handing_over: AtomicBool,
    /// The fronts (`--front`) and their policies; shared with the metrics thread.
    pub(crate) fronts: Arc<Mutex<crate::front::Fronts>>,
    /// The service manager (systemd), if one supervises this process.
    pub(crate) supervisor: crate::supervisor::Supervisor,
    /// How the kernel reaches each export.
    pub(crate) transports: Transports,
}

/// Counters of `devices` (with their fronts'), then of `caches`.
fn stats_of(
    devices: &[Arc<PoolDevice>],
    caches: &[Arc<CacheDevice>],
    fronts: &Mutex<crate::front::Fronts>,
    transports: &Transports,
) -> Vec<DeviceStats> {
    let mut stats: Vec<DeviceStats> = devices.iter().map(|d| d.stats()).collect();
    {
        let fronts = fronts.lock();
        for (i, s) in stats.iter_mut().enumerate() {
            s.front = fronts.stats(i);
        }
    }
    stats.extend(caches.iter().map(|c| c.stats()));
    for (s, t) in stats.iter_mut().zip(transports.get().into_iter().flatten()) {
        s.transport.clone_from(t);
    }
    stats
}

/// Per export (devices, then caches): how the kernel reaches it, set once
/// the transport is up.
pub(crate) type Transports = Arc<std::sync::OnceLock<Vec<Option<TransportStats>>>>;

/// Logs one line (a step, a start or stop, a recovered error) at info level.
pub fn log(msg: &str) {
    tracing::info!("{msg}");
}

/// Logs one line at warn level.
pub(crate) fn warn(msg: &str) {
    tracing::warn!("{msg}");
}

fn setup_err(e: impl std::fmt::Display) -> DaemonError {
    DaemonError::Setup(e.to_string())
}

/// Runs the daemon until an orderly teardown; returns an error only when
/// setup fails (after undoing what was set up) or is stopped by a signal.
pub fn run(mut spec: DaemonSpec) -> Result<(), DaemonError> {
    crate::logging::init();
    let dir = RuntimeDir::create(&spec.runtime_dir)?;
    let lock_file = match spec.lock_fd {
        Some(fd) => dir.adopt_lock(fd)?,
        None => dir.lock()?,
    };
    log_panics();
    let (tx, rx) = mpsc::channel();
    let signalled = Arc::new(AtomicI32::new(0));
    watch_signals(tx.clone(), Arc::clone(&signalled))?;

    let mut steps = Vec::new();
    protect(&mut steps)?;

    let total_ram = swap::total_ram_bytes().map_err(setup_err)?;
    // The front first: `--codec auto` depends on it.
    let fronts = match spec.swap {
        true => crate::front::Fronts::choose(&spec.front)?,
        false => crate::front::Fronts::default(),
    };
    if spec.swap {
        steps.push(format!("front: {} ({})", fronts.front().as_str(), fronts.choice.reason));
    }
    steps.extend(spec.resolve_codecs(fronts.front()));
    let mut devices = Vec::new();
    for d in &spec.devices {
        let store = store_config(d, total_ram)?;
        let group = store.group.clone();
        let chain = spec.tiers.build(&d.name, d.size)?;
        let tier_names = chain
            .as_ref()
            .map(|c| c.tiers().iter().map(|t| t.name().to_owned()).collect::<Vec<_>>().join(" -> "))
            .unwrap_or_default();
        let dev = DeviceConfig {
            name: d.name.clone(),
            size: d.size,
            store,
            tiers: chain,
            recompress: d.recompress.config()?,
        }
        .build()
        .map_err(setup_err)?;
        if let Some(g) = &group {
            steps.push(format!(
                "{}: cold pages grouped by 64 KiB of adjacent slots, zstd-{}{}, after {} s unread",
                d.name,
                g.level,
                if g.dictionary { " with the store's dictionary" } else { "" },
                g.after.as_secs_f64()
            ));
        }
        if !tier_names.is_empty() {
            steps.push(format!(
                "{}: pool -> {tier_names} (pages sealed with {} under a subkey of this device and run)",
                d.name,
                tmem_tier::seal::SealAlgorithm::preferred().name()
            ));
        }
        let limit = dev.store().policy().limit_bytes();
        steps.push(format!(
            "{}: {} device, codec {}, pool limit {}",
            d.name,
            human(d.size),
            dev.store().codec_name(),
            if limit == u64::MAX { "none".to_owned() } else { human(limit) }
        ));
        devices.push(Arc::new(dev));
    }
    let mut caches = Vec::new();
    for c in &spec.caches {
        // With swap devices, the cache's pool shares the first one's store and budget.
        let dev = match devices.first() {
            Some(swap) => c.device_config(tmem_core::StoreConfig::default()).build_on(swap.shared_store()),
            None => c.device_config(c.store_config(total_ram)?).build(),
        }
        .map_err(setup_err)?;
        let limit = dev.store().policy().limit_bytes();
        steps.push(format!(
            "{}: cache of {} ({}, {} backing I/O{}), codec {}, pool limit {}{}, eviction {}",
            c.name,
            c.backing.display(),
            human(dev.size()),
            if dev.direct() { "O_DIRECT" } else { "buffered" },
            match c.backing_latency_us {
                0 => String::new(),
                us => format!(", {us} us emulated latency per read"),
            },
            dev.store().codec_name(),
            if limit == u64::MAX { "none".to_owned() } else { human(limit) },
            match devices.first() {
                Some(d) => format!(" shared with {} (its pages evict cached ones)", d.name()),
                None => String::new(),
            },
            c.eviction.name(),
        ));
        caches.push(Arc::new(dev));
    }
    let status = Status {
        state: "starting".into(),
        pid: std::process::id(),
        steps,
        front: fronts.front().as_str().into(),
        front_reason: fronts.choice.reason.clone(),
        ..Status::default()
    };
    let daemon = Arc::new(Daemon::new(spec, dir, lock_file, (devices, caches), status, tx, signalled));
    *daemon.fronts.lock() = fronts;
    bind_control(&daemon)?;

    if let Err(e) = daemon.setup() {
        tracing::error!("setup failed: {e}");
        if let Err(t) = daemon.teardown() {
            tracing::error!("teardown after failed setup: {t}");
        }
        let _ = daemon.dir.remove(tmem_ctl::SOCKET);
        let _ = daemon.dir.remove(STATE_FILE);
        return Err(e);
    }
    crate::handover::listen(&daemon)?;
    #[cfg(feature = "fault-injection")]
    crate::fault::ublk_waiting(&daemon);
    serve(&daemon, &rx);
    Ok(())
}

/// Binds the control socket (we hold the lock, so a socket left here
/// belongs to a dead daemon, or to the one we took over from) and serves it.
pub(crate) fn bind_control(daemon: &Arc<Daemon>) -> Result<(), DaemonError> {
    daemon.dir.remove(tmem_ctl::SOCKET)?;
    let sock = daemon.dir.join(tmem_ctl::SOCKET);
    let listener = UnixListener::bind(&sock).map_err(|e| setup_err(format!("{}: {e}", sock.display())))?;
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o600)).map_err(setup_err)?;
    control::spawn(listener, Arc::clone(daemon) as Arc<dyn control::Handler>).map_err(setup_err)
}

/// Serves until an orderly teardown (a `down`, or a signal), then removes
/// the control socket and the state file.
pub(crate) fn serve(daemon: &Arc<Daemon>, rx: &mpsc::Receiver<Event>) {
    log("up");
    // Under systemd (Type=notify): ready once swap is on. Without a
    // supervisor these are no-ops.
    let devices = daemon.devices.len() + daemon.caches.len();
    let _ =
        daemon.supervisor.notify(&[NotifyState::Ready, NotifyState::Status(&format!("serving {devices} device(s)"))]);
    let tick = daemon.supervisor.watchdog().map_or(STATE_INTERVAL, |w| STATE_INTERVAL.min(w / 2));

    let mut watch = crate::watch::Watch::default();
    let mut stale = crate::stale::StaleSlots::default();
    // Devices whose swap area recycle_swap emptied but could not turn on again.
    let mut swap_off = Vec::new();
    loop {
        match rx.recv_timeout(tick) {
            Err(mpsc::RecvTimeoutError::Timeout) => {
                // Taking the status reads every store's counters under its
                // locks: a store that deadlocked stops the watchdog pings.
                let status = daemon.status();
                daemon.save_state(&status);
                let stats = daemon.all_stats();
                for line in watch.check(&stats) {
                    if line.warn {
                        warn(&line.text);
                    } else {
                        log(&line.text);
                    }
                }
                let swaps: Vec<_> = daemon
                    .devices
                    .iter()
                    .zip(&status.devices)
                    .map(|(d, s)| (d.as_ref(), s.loop_dev.as_deref().filter(|_| s.swap && s.front_node.is_none())))
                    .collect();
                let recycle = daemon.spec.recycle_idle_swap.then(crate::stale::Recycle::default);
                let checked = stale.check(&swaps, recycle.as_ref());
                checked.lines.iter().for_each(|l| log(l));
                for (i, used) in checked.recycle {
                    match daemon.recycle_swap(i, used) {
                        // Interrupted before it began: the next quiet window tries again.
                        Ok(Some((line, StaleSweep::Interrupted))) => {
                            log(&line);
                            continue;
                        }
                        Ok(Some((line, StaleSweep::Done { .. }))) => log(&line),
                        Ok(None) => {}
                        Err(e) => {
                            warn(&e.to_string());
                            if !daemon.lock().status.devices[i].swap {
                                swap_off.push(i);
                            }
                        }
                    }
                    stale.recycled(i, std::time::Instant::now());
                }
                if !swap_off.is_empty() {
                    daemon.swap_on_again(&mut swap_off).iter().for_each(|l| log(l));
                }
                let _ = daemon.supervisor.notify(&[NotifyState::Watchdog]);
            }
            Err(mpsc::RecvTimeoutError::Disconnected) | Ok(Event::Down) => break,
            Ok(Event::Signal(sig)) => {
                log(&format!("signal {sig}: tearing down"));
                match daemon.teardown() {
                    Ok(()) => break,
                    Err(e) => warn(&format!("refusing to exit: {e}")),
                }
            }
        }
    }
    // What a later `swap up` does not need goes; the lock, the log and the
    // mount point stay (README, "What stays in the runtime directory").
    let _ = daemon.dir.remove(tmem_ctl::SOCKET);
    let _ = daemon.dir.remove(crate::handover::SOCKET);
    let _ = daemon.dir.remove(STATE_FILE);
    log("stopped");
}

/// Makes this process fit to hold other processes' pages: the OOM killer's
/// last choice, outside the workload's memory cgroup, memory locked, an I/O
/// flusher. Records each step (or why it could not be taken) in `steps`.
pub(crate) fn protect(steps: &mut Vec<String>) -> Result<(), DaemonError> {
    match swap::protect_from_oom() {
        Ok(v) => steps.push(format!("oom_score_adj {v}: the OOM killer takes every other process first")),
        Err(e) => {
            let msg = format!(
                "WARNING: could not set oom_score_adj -1000 ({e}; it needs CAP_SYS_RESOURCE, or a parent such as \
                 systemd with OOMScoreAdjust=-1000): under memory pressure the OOM killer may pick this daemon, \
                 and every process with a page in it would die"
            );
            warn(&msg);
            steps.push(msg);
        }
    }
    let placed = tmem_sys::cgroup::Layout::detect().and_then(|l| tmem_sys::cgroup::leave_workload_cgroup(&l));
    match placed {
        Ok(tmem_sys::cgroup::Placement::Root(procs)) => steps.push(format!(
            "daemon pid {} moved to the root memory cgroup ({})",
            std::process::id(),
            procs.display()
        )),
        Ok(tmem_sys::cgroup::Placement::OwnUnit(unit)) => {
            steps.push(format!("daemon stays in its own service's cgroup {unit}"))
        }
        Err(e) => warn(&format!("could not leave the memory cgroup: {e}")),
    }
    swap::mlockall_onfault().map_err(setup_err)?;
    steps.push("mlockall(MCL_CURRENT|MCL_FUTURE|MCL_ONFAULT) set".into());
    match swap::set_io_flusher() {
        Ok(()) => steps.push("PR_SET_IO_FLUSHER set".into()),
        // It needs CAP_SYS_RESOURCE, which some containers and VMs withhold.
        Err(e) => steps.push(format!("warning: {e}; continuing with mlockall and direct I/O only")),
    }

    Ok(())
}

/// Logs every panic with its backtrace. A panic while serving a request
/// fails that request alone (`tmem_block`), so the log is where it shows.
pub(crate) fn log_panics() {
    std::panic::set_hook(Box::new(|info| {
        let thread = std::thread::current().name().unwrap_or("unnamed").to_owned();
        tracing::error!("panic in thread {thread}: {info}\n{}", std::backtrace::Backtrace::force_capture());
    }));
}

/// A thread that turns SIGTERM, SIGINT and SIGHUP into events. During setup
/// the main thread looks at `signalled` between steps.
pub(crate) fn watch_signals(tx: mpsc::Sender<Event>, signalled: Arc<AtomicI32>) -> Result<(), DaemonError> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT, SIGHUP]).map_err(setup_err)?;
    std::thread::Builder::new()
        .name("tmem-signals".into())
        .spawn(move || {
            for sig in signals.forever() {
                signalled.store(sig, Ordering::Release);
                if tx.send(Event::Signal(sig)).is_err() {
                    break;
                }
            }
        })
        .map(drop)
        .map_err(setup_err)
}

/// Drops the pages of a device whose swap area is off: swapoff read every
/// slot in use back, so all but the header belong to freed slots. Done
/// before mkswap, it makes room for the header where the pool is full of
/// them (finding: at the pool's limit, mkswap's write failed, and the
/// area stayed off, retried each second). Returns the pages dropped.
fn drop_while_off(device: &PoolDevice) -> u64 {
    match device.drop_stale(device.writes()) {
        StaleSweep::Done { dropped, .. } => dropped,
        StaleSweep::Interrupted => 0,
    }
}

impl Daemon {
    /// A daemon serving `served` (devices, caches), nothing set up yet.
    pub(crate) fn new(
        spec: DaemonSpec,
        dir: RuntimeDir,
        lock_file: crate::runtime::DaemonLock,
        served: (Vec<Arc<PoolDevice>>, Vec<Arc<CacheDevice>>),
        status: Status,
        events: mpsc::Sender<Event>,
        signalled: Arc<AtomicI32>,
    ) -> Self {
        Daemon {
            spec,
            dir,
            lock_file,
            devices: served.0,
            caches: served.1,
            state: Mutex::new(
                Rank::DaemonState,
                State {
                    status,
                    fuse: None,
                    nbd: None,
                    kernel_nbd: Vec::new(),
                    ublk: Vec::new(),
                    ublk_waiting: Vec::new(),
                    metrics: None,
                },
            ),
            teardown_gate: Mutex::new(Rank::DaemonTeardown, ()),
            events: Mutex::new(Rank::DaemonEvents, events),
            signalled,
            exited: AtomicBool::new(false),
            predecessor: None,
            handing_over: AtomicBool::new(false),
            fronts: Arc::new(Mutex::new(Rank::DaemonFronts, crate::front::Fronts::default())),
            transports: Transports::default(),
            supervisor: crate::supervisor::Supervisor::from_env(),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }

    /// After taking over: waits (up to 10 s) for the predecessor to exit,
    /// then starts what it held that only one process can (the metrics
    /// address), and records the state.
    pub(crate) fn after_take_over(&self) {
        if let Some(pid) = self.predecessor {
            if !crate::handover::wait_for_exit(pid, Duration::from_secs(10)) {
                warn(&format!("the daemon taken over from (pid {pid}) still runs after 10 s"));
            }
        }
        if let Some(addr) = self.spec.metrics {
            match self.start_metrics(addr) {
                Ok(()) => {}
                Err(e) => warn(&format!("metrics: {e}")),
            }
        }
        self.record_transports();
        let status = self.status();
        self.save_state(&status);
    }

    /// Serves Prometheus metrics on `addr`.
    fn start_metrics(&self, addr: std::net::SocketAddr) -> Result<(), DaemonError> {
        let (devices, caches, fronts) = (self.devices.clone(), self.caches.clone(), Arc::clone(&self.fronts));
        let transports = Arc::clone(&self.transports);
        let source: crate::metrics::Source = Arc::new(move || stats_of(&devices, &caches, &fronts, &transports));
        let server = crate::metrics::MetricsServer::start(addr, self.spec.metrics_allow_remote, source)?;
        self.step(format!("Prometheus metrics at http://{}/metrics", server.addr()));
        self.lock().metrics = Some(server);
        Ok(())
    }

    /// Records a step: in the log, in the status, and in the state file.
    pub(crate) fn step(&self, s: String) {
        log(&s);
        self.lock().status.steps.push(s);
        let status = self.status();
        self.save_state(&status);
    }

    /// Counters of every device, caches last.
    fn all_stats(&self) -> Vec<DeviceStats> {
        stats_of(&self.devices, &self.caches, &self.fronts, &self.transports)
    }

    /// Every exported device by name: devices, then caches.
    pub(crate) fn exports(&self) -> Vec<(String, Arc<dyn BlockDevice>)> {
        let devices = self.devices.iter().map(|d| (d.name().to_owned(), Arc::clone(d) as Arc<dyn BlockDevice>));
        let caches = self.caches.iter().map(|c| (c.name().to_owned(), Arc::clone(c) as Arc<dyn BlockDevice>));
        devices.chain(caches).collect()
    }

    /// The status now, with the transport and the count of stored pages
    /// that only this process holds (persistent ones: cached pages are
    /// also in their backing store).
    pub(crate) fn status(&self) -> Status {
        let stored = self
            .devices
            .iter()
            .flat_map(|d| d.store().stats().pools)
            .filter(|p| p.kind == Some(tmem_core::PoolKind::Persistent))
            .map(|p| p.stored_pages)
            .sum();
        let g = self.lock();
        let mut status = g.status.clone();
        if let Some(f) = &g.fuse {
            status.fuse_transport = Some(f.transport().to_string());
            status.fuse_uring_requests = f.uring_requests();
            (status.fuse_polls, status.fuse_poll_hits) = f.polls();
        }
        status.stored_pages = stored;
        status.taken_unix =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs();
        status
    }

    /// Writes what is set up now into the state file, so that `tmem swap
    /// down` can remove it should this process die.
    pub(crate) fn save_state(&self, status: &Status) {
        if self.handing_over.load(Ordering::Acquire) {
            return;
        }
        let saved = serde_json::to_vec_pretty(status)
            .map_err(|e| e.to_string())
            .and_then(|json| self.dir.write_atomic(STATE_FILE, &json).map_err(|e| e.to_string()));
        if let Err(e) = saved {
            warn(&format!("cannot write the state file: {e}"));
        }
    }

    /// Fails when a signal asked the daemon to stop during setup.
    fn check_signal(&self) -> Result<(), DaemonError> {
        match self.signalled.load(Ordering::Acquire) {
            0 => Ok(()),
            sig => Err(DaemonError::Setup(format!("stopped by signal {sig} during setup; undoing what was set up"))),
        }
    }

    fn setup(&self) -> Result<(), DaemonError> {
        if self.spec.fuse {
            self.setup_block()?;
        }
        if let Some(listen) = &self.spec.nbd {
            self.setup_nbd(listen)?;
        }
        if let Some(addr) = self.spec.metrics {
            self.start_metrics(addr)?;
        }
        self.check_signal()?;
        self.lock().status.state = "up".into();
        Ok(())
    }

    /// The NBD server's configuration: every device and cache, on `listen`.
    pub(crate) fn nbd_config(&self, listen: &str) -> Result<tmem_nbd::NbdConfig, DaemonError> {
        let listen = match listen.strip_prefix("tcp:") {
            Some(addr) => tmem_nbd::Listen::Tcp(
                addr.parse().map_err(|e| DaemonError::Invalid(format!("bad NBD address {addr:?}: {e}")))?,
            ),
            None => tmem_nbd::Listen::Unix(PathBuf::from(listen)),
        };
        let exports = self.exports().into_iter().map(|(name, dev)| tmem_nbd::Export::new(&name, dev)).collect();
        let mut cfg = tmem_nbd::NbdConfig::new(exports, listen);
        cfg.allow_remote = self.spec.nbd_allow_remote;
        let secs = |s: u64| (s > 0).then(|| std::time::Duration::from_secs(s));
        if let Some(s) = self.spec.nbd_idle_reclaim {
            cfg.idle_reclaim = secs(s);
        }
        cfg.idle_timeout = self.spec.nbd_idle_timeout.and_then(secs);
        Ok(cfg)
    }

    fn setup_nbd(&self, listen: &str) -> Result<(), DaemonError> {
        let names: Vec<String> = self.exports().into_iter().map(|(name, _)| name).collect();
        let cfg = self.nbd_config(listen)?;
        let server = tmem_nbd::ServerHandle::start(cfg).map_err(setup_err)?;
        let uris: Vec<String> = names.iter().map(|n| server.uri(n)).collect();
        {
            let mut g = self.lock();
            g.nbd = Some(server);
            g.status.nbd_uris = uris.clone();
        }
        for u in uris {
            self.step(format!("NBD export {u}"));
        }
        Ok(())
    }

    /// Gives every device and cache to the kernel as a block device over
    /// the transport chosen, then makes each device swap (`spec.swap`).
    fn setup_block(&self) -> Result<(), DaemonError> {
        let kernel = crate::transport::Kernel { ublk: tmem_ublk::available, nbd: tmem_nbd::kernel::available };
        let (transport, reason) =
            crate::transport::choose(self.spec.transport, kernel).map_err(DaemonError::Invalid)?;
        {
            let mut g = self.lock();
            g.status.transport = Some(transport.to_string());
            g.status.transport_reason = Some(reason.clone());
        }
        self.step(format!("transport: {transport} ({reason})"));
        match transport {
            Transport::Nbd => self.attach_nbd()?,
            Transport::Ublk => self.attach_ublk()?,
            Transport::Fuse | Transport::Auto => self.attach_fuse()?,
        }
        self.record_transports();
        if self.spec.swap {
            self.swap_up()?;
        }
        Ok(())
    }

    /// Records, for the counters, how the kernel reaches each export (from
    /// the status: set up here, or by the daemon taken over from).
    pub(crate) fn record_transports(&self) {
        let g = self.lock();
        // A daemon from before the NBD transport used FUSE + loop.
        let kind = g.status.transport.clone().unwrap_or_else(|| Transport::Fuse.to_string());
        let reason = g.status.transport_reason.clone();
        let nodes = g.status.devices.iter().map(|d| {
            let reason = reason.clone().unwrap_or_default();
            d.loop_dev.clone().map(|node| TransportStats { kind: kind.clone(), node, reason })
        });
        let _ = self.transports.set(nodes.collect());
    }

    /// Whether export `i` (devices, then caches) gets a block device.
    fn attached(&self, i: usize) -> bool {
        i >= self.devices.len() || self.spec.swap
    }

    /// Mounts FUSE and attaches a loop device to each export's file.
    fn attach_fuse(&self) -> Result<(), DaemonError> {
        let mnt = self.dir.mount_point(MOUNT_DIR)?;
        let exports = self.exports().into_iter().map(|(name, device)| Export { name, device }).collect();
        let fuse = FuseMount::mount(FuseConfig {
            mountpoint: mnt.clone(),
            exports,
            threads: self.spec.fuse_threads,
            uring_per_queue: self.spec.fuse_uring,
        })
        .map_err(setup_err)?;
        let transport = fuse.transport();
        let files: Vec<(String, PathBuf)> =
            self.exports().into_iter().map(|(name, _)| (name.clone(), fuse.path_of(&name))).collect();
        {
            let mut g = self.lock();
            g.fuse = Some(fuse);
            g.status.devices = files
                .iter()
                .map(|(name, file)| DeviceStatus { name: name.clone(), file: file.clone(), ..Default::default() })
                .collect();
        }
        self.step(format!(
            "FUSE mounted at {} (direct I/O; {} /dev/fuse worker threads; requests via {transport})",
            mnt.display(),
            self.spec.fuse_threads
        ));
        for (i, (name, file)) in files.iter().enumerate() {
            if !self.attached(i) {
                continue;
            }
            self.check_signal()?;
            let dev = swap::loop_attach(file).map_err(setup_err)?;
            self.lock().status.devices[i].loop_dev = Some(dev.clone());
            self.step(format!("{name}: losetup --direct-io=on {} -> {}", file.display(), dev.display()));
        }
        Ok(())
    }

    /// Gives each export that gets one a block device of the kernel's own
    /// (NBD, ublk): `make` makes it, and `record`, under the state's lock,
    /// keeps it and fills in export `i`'s status; its line follows the
    /// export's name in the steps.
    fn attach_each<T>(
        &self,
        make: impl Fn(&str, Arc<dyn BlockDevice>) -> Result<T, DaemonError>,
        record: impl Fn(&mut State, usize, T) -> String,
    ) -> Result<(), DaemonError> {
        let exports = self.exports();
        self.lock().status.devices =
            exports.iter().map(|(name, _)| DeviceStatus { name: name.clone(), ..Default::default() }).collect();
        for (i, (name, device)) in exports.into_iter().enumerate() {
            if !self.attached(i) {
                continue;
            }
            self.check_signal()?;
            let made = make(&name, device)?;
            let line = record(&mut self.lock(), i, made);
            self.step(format!("{name}: {line}"));
        }
        Ok(())
    }

    /// Connects a `/dev/nbdN` of the kernel's NBD client to each export,
    /// one connection per online CPU (the kernel's queues).
    fn attach_nbd(&self) -> Result<(), DaemonError> {
        let connections =
            std::thread::available_parallelism().map_or(1, usize::from).min(tmem_nbd::kernel::MAX_CONNECTIONS);
        self.attach_each(
            |name, device| {
                tmem_nbd::kernel::KernelDevice::connect(tmem_nbd::Export::new(name, device), connections)
                    .map_err(setup_err)
            },
            |g, i, kernel| {
                let node = kernel.node();
                let d = &mut g.status.devices[i];
                (d.file, d.loop_dev, d.nbd_index) = (node.clone(), Some(node.clone()), Some(kernel.index()));
                g.kernel_nbd.push(kernel);
                format!(
                    "the kernel's NBD client on {} ({connections} connections to this daemon, over netlink)",
                    node.display()
                )
            },
        )
    }

    /// Adds a `/dev/ublkbN` serving each export, one queue per online CPU.
    fn attach_ublk(&self) -> Result<(), DaemonError> {
        let config = tmem_ublk::Config::default();
        self.attach_each(
            |_, device| tmem_ublk::UblkDevice::start(device, &config).map_err(setup_err),
            |g, i, ublk| {
                let node = ublk.node();
                let line = format!(
                    "ublk device {} ({} queues of {} requests, a thread each; {}; io_timeout {} ms)",
                    node.display(),
                    ublk.queues(),
                    config.depth,
                    ublk.features(),
                    tmem_ublk::REQUEST_TIMEOUT_MS
                );
                let d = &mut g.status.devices[i];
                (d.file, d.loop_dev, d.ublk_id) = (node.clone(), Some(node), Some(ublk.id()));
                g.ublk.push(ublk);
                line
            },
        )
    }

    /// Puts the front (if any) in place and turns every device into swap.
    fn swap_up(&self) -> Result<(), DaemonError> {
        let front = self.fronts.lock().front();
        if front == tmem_front::Front::Zswap {
            self.check_signal()?;
            let reads = crate::front::pages_read(self.devices.clone());
            let line = self.fronts.lock().zswap_up(&self.dir, &self.spec.front, self.total_ram()?, reads)?;
            self.step(line);
        }
        let devices = self.lock().status.devices.clone();
        for (i, d) in devices.iter().enumerate().take(self.devices.len()) {
            let Some(dev) = d.loop_dev.clone() else { continue };
            let name = &d.name;
            if let Some(set) = swap::loop_disable_wbt(&dev).map_err(setup_err)? {
                self.step(format!("{name}: {set} (no writeback throttling in front of swap)"));
            }
            self.check_signal()?;
            let swap_dev = match front {
                tmem_front::Front::Zram => self.zram_up(i, name, &dev)?,
                tmem_front::Front::Zswap | tmem_front::Front::None => dev,
            };
            self.step(self.make_swap(name, &swap_dev).map_err(setup_err)?);
            #[cfg(feature = "fault-injection")]
            crate::fault::stall_setup(&self.signalled);
            self.check_signal()?;
            self.step(self.swap_on(i, &swap_dev, true).map_err(setup_err)?);
        }
        Ok(())
    }

    fn total_ram(&self) -> Result<u64, DaemonError> {
        swap::total_ram_bytes().map_err(setup_err)
    }

    /// Puts a zram device of its own in front of device `i`'s loop device
    /// `backing`; returns the zram device's node, which becomes the swap area.
    fn zram_up(&self, i: usize, name: &str, backing: &Path) -> Result<PathBuf, DaemonError> {
        let size = self.devices[i].size();
        let total_ram = self.total_ram()?;
        let (node, id) = self.fronts.lock().zram_up(i, backing, &self.devices[i], size, &self.spec.front, total_ram)?;
        {
            let mut g = self.lock();
            g.status.devices[i].front_node = Some(node.clone());
            g.status.devices[i].front_zram = Some(id);
        }
        let f = &self.spec.front;
        self.step(format!(
            "{name}: {} in front (comp_algorithm {}, disksize {}, mem_limit {}), backing_dev {}; idle pages go down \
             after {} s past {}% of the limit, at most {} pages/s",
            node.display(),
            f.front_algorithm,
            human(size),
            human(f.budget(total_ram)),
            backing.display(),
            f.front_idle_age,
            f.front_fill,
            f.front_rate
        ));
        Ok(node)
    }

    /// mkswap on device `name`'s loop device; says what it did.
    fn make_swap(&self, name: &str, dev: &Path) -> Result<String, swap::SwapError> {
        swap::mkswap(dev, &format!("tmem-{name}"))?;
        Ok(format!("{name}: mkswap {}", dev.display()))
    }

    /// swapon of device `i`'s loop device with the spec's priority and
    /// discard policy (without the whole-area discard where `area_discard`
    /// is false); says what it did.
    fn swap_on(&self, i: usize, dev: &Path, area_discard: bool) -> Result<String, swap::SwapError> {
        let (prio, discard) = (self.spec.priority, self.spec.discard);
        let flag = match (area_discard, discard) {
            (true, _) | (false, swap::SwapDiscard::Pages) => format!("--discard={} ", discard.as_str()),
            (false, swap::SwapDiscard::Once) => String::new(),
        };
        match area_discard {
            true => swap::swapon(dev, prio, discard)?,
            false => swap::swapon_without_area_discard(dev, prio, discard)?,
        }
        self.lock().status.devices[i].swap = true;
        Ok(format!("{}: swapon {flag}--priority {prio} {}", self.devices[i].name(), dev.display()))
    }

    /// Empties device `i`'s idle swap area (crate::stale, "Recycle"):
    /// swapoff, which reads the slots still in use back into memory (every
    /// other page then belongs to a freed slot), mkswap, swapon without the
    /// whole-area discard, then drops every page but the new header and
    /// those the kernel writes meanwhile (see [`PoolDevice::drop_stale`]);
    /// the area is off only for the three commands. Returns the log line
    /// and the sweep; `Ok(None)` when there was nothing to do (the daemon
    /// is stopping, or the device is not a swap area now).
    /// A failed swapoff leaves the area on; a failed mkswap or swapon
    /// leaves it off, and [`Daemon::swap_on_again`] retries at each tick.
    pub(crate) fn recycle_swap(&self, i: usize, used: u64) -> Result<Option<(String, StaleSweep)>, DaemonError> {
        let _gate = self.teardown_gate.lock();
        if self.exited.load(Ordering::Acquire) {
            return Ok(None);
        }
        let d = self.lock().status.devices[i].clone();
        let Some(dev) = d.loop_dev.filter(|_| d.swap) else { return Ok(None) };
        let fail = |what: &str, e: swap::SwapError| DaemonError::Recycle(format!("{}: {what}: {e}", d.name));
        let t0 = std::time::Instant::now();
        swap::swapoff(&dev).map_err(|e| fail("swapoff to empty the idle swap area failed; it stays on", e))?;
        self.lock().status.devices[i].swap = false;
        let device = &self.devices[i];
        let dropped_off = drop_while_off(device);
        self.make_swap(&d.name, &dev).map_err(|e| fail("mkswap after emptying the swap area failed; retrying", e))?;
        // Read after mkswap's write of the header, before the kernel can write.
        let writes = device.writes();
        self.swap_on(i, &dev, false).map_err(|e| fail("swapon after emptying the swap area failed; retrying", e))?;
        let t1 = std::time::Instant::now();
        device.count_area_emptied();
        let sweep = device.drop_stale(writes);
        let ms = |a: std::time::Instant, b: std::time::Instant| b.duration_since(a).as_millis();
        let after = match sweep {
            StaleSweep::Done { dropped, kept } => format!(
                "dropped {} pages of freed slots in {} ms{}",
                dropped + dropped_off,
                ms(t1, std::time::Instant::now()),
                crate::stale::kept_note(kept)
            ),
            StaleSweep::Interrupted => {
                "a write came in before the sweep began: it is tried again when the area is next idle".to_owned()
            }
        };
        let line = format!(
            "{}: emptied the idle swap area ({} KiB in use): swapoff, mkswap and swapon in {} ms, then {after}",
            d.name,
            used / 1024,
            ms(t0, t1),
        );
        Ok(Some((line, sweep)))
    }

    /// Turns swap on again on the devices that [`Daemon::recycle_swap`]
    /// left off; returns a log line per device it turned on.
    pub(crate) fn swap_on_again(&self, pending: &mut Vec<usize>) -> Vec<String> {
        let _gate = self.teardown_gate.lock();
        if self.exited.load(Ordering::Acquire) {
            pending.clear();
            return Vec::new();
        }
        let mut lines = Vec::new();
        pending.retain(|&i| {
            let d = self.lock().status.devices[i].clone();
            let Some(dev) = d.loop_dev else { return false };
            if swap::is_swap(&dev).unwrap_or(false) {
                self.lock().status.devices[i].swap = true;
                return false;
            }
            drop_while_off(&self.devices[i]);
            match self.make_swap(&d.name, &dev).and_then(|_| self.swap_on(i, &dev, false)) {
                Ok(line) => {
                    lines.push(line);
                    false
                }
                Err(e) => {
                    lines.push(format!("{}: swap still off after emptying it: {e}", d.name));
                    true
                }
            }
        });
        lines
    }

    /// swapoff, detach, unmount. Stops at the first swapoff failure and
    /// leaves everything serving; so does a panic part-way, whichever
    /// thread tears down (a control client's, or the main one on SIGTERM).
    fn teardown(&self) -> Result<(), DaemonError> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.teardown_steps())).unwrap_or_else(|_| {
            self.lock().status.state = "up".into();
            Err(DaemonError::Teardown(
                "a panic stopped the teardown part-way (the log has it); the daemon keeps serving what is still \
                 set up, and `tmem swap down` tries again"
                    .into(),
            ))
        })
    }

    fn teardown_steps(&self) -> Result<(), DaemonError> {
        let _gate = self.teardown_gate.lock();
        if self.exited.load(Ordering::Acquire) {
            return Ok(());
        }
        // A swapoff reads every page back: a ublk device nobody serves
        // would make it wait for ever.
        if let Err(not_served) = self.take_waiting_ublk(0) {
            return Err(DaemonError::Teardown(format!(
                "{not_served} (user recovery failed), so a swapoff would wait for ever; end this daemon (kill {}) \
                 and run `tmem swap down`, which takes the device over, fails its requests and removes it",
                std::process::id()
            )));
        }
        let _ = self.supervisor.notify(&[NotifyState::Stopping]);
        self.lock().status.state = "stopping".into();
        let devs = self.lock().status.devices.clone();
        for (i, d) in devs.iter().enumerate() {
            let Some(dev) = &d.loop_dev else { continue };
            if let Some(node) = &d.front_node {
                if d.swap || swap::is_swap(node).unwrap_or(false) {
                    self.step(format!(
                        "{}: swapoff {} (the kernel reads its pages back, those in tmem through zram)",
                        d.name,
                        node.display()
                    ));
                    if let Err(e) = swap::swapoff(node) {
                        self.lock().status.state = "up".into();
                        return Err(DaemonError::Teardown(format!(
                            "swapoff {} failed, so the daemon keeps serving to lose no page: {e}",
                            node.display()
                        )));
                    }
                    self.lock().status.devices[i].swap = false;
                }
                // Bound first: the fronts' lock must be dropped before step() takes the state's.
                let removed = self.fronts.lock().zram_down(i)?;
                if let Some(line) = removed {
                    self.step(format!("{}: {line}", d.name));
                }
                {
                    let mut g = self.lock();
                    g.status.devices[i].front_node = None;
                    g.status.devices[i].front_zram = None;
                }
            } else if d.swap || swap::is_swap(dev).unwrap_or(false) {
                self.step(format!("{}: swapoff {} (the kernel reads its pages back)", d.name, dev.display()));
                if let Err(e) = swap::swapoff(dev) {
                    self.lock().status.state = "up".into();
                    return Err(DaemonError::Teardown(format!(
                        "swapoff {} failed, so the daemon keeps serving to lose no page: {e}",
                        dev.display()
                    )));
                }
                self.lock().status.devices[i].swap = false;
            }
            #[cfg(feature = "fault-injection")]
            crate::fault::panic_in_teardown();
            // The kernel's own block device (ublk, NBD) goes now; a loop
            // device is detached below.
            let removed = match (d.ublk_id, d.nbd_index) {
                (Some(id), _) => Some(self.delete_ublk(id).map(|()| ("ublk device", "deleted"))),
                (None, Some(index)) => Some(self.disconnect_nbd(index).map(|()| ("NBD device", "disconnected"))),
                (None, None) => None,
            };
            if let Some(removed) = removed {
                let (what, how) = removed?;
                {
                    let mut g = self.lock();
                    let s = &mut g.status.devices[i];
                    (s.loop_dev, s.ublk_id, s.nbd_index) = (None, None, None);
                }
                self.step(format!("{}: {what} {} {how}", d.name, dev.display()));
                continue;
            }
            if let Err(e) = swap::loop_detach(dev) {
                // Someone detached it already: fine, as long as it no longer serves our file.
                if swap::loops_of(&d.file).map_or(true, |l| l.contains(dev)) {
                    return Err(DaemonError::Teardown(e.to_string()));
                }
            }
            self.lock().status.devices[i].loop_dev = None;
            self.step(format!("{}: losetup --detach {}", d.name, dev.display()));
        }
        let restored = self.fronts.lock().zswap_down(&self.dir)?;
        if let Some(line) = restored {
            self.step(line);
        }
        let metrics = self.lock().metrics.take();
        if let Some(m) = metrics {
            m.stop();
        }
        let nbd = self.lock().nbd.take();
        if let Some(server) = nbd {
            server.stop().map_err(|e| DaemonError::Teardown(e.to_string()))?;
            self.step("NBD server stopped".into());
        }
        let fuse = self.lock().fuse.take();
        if let Some(f) = fuse {
            let at = f.mountpoint().to_owned();
            let over_uring = f.uring_requests();
            let (polls, hits) = f.polls();
            f.unmount().map_err(|e| DaemonError::Teardown(e.to_string()))?;
            let polled =
                format!("its workers polled the empty queue {polls} times, and {hits} of those polls found a request");
            match over_uring {
                0 => self.step(format!("FUSE unmounted from {} ({polled})", at.display())),
                n => self.step(format!(
                    "FUSE unmounted from {} ({n} requests were served over io_uring; {polled})",
                    at.display()
                )),
            }
            let _ = std::fs::remove_dir(&at);
        }
        self.exited.store(true, Ordering::Release);
        Ok(())
    }
}

impl Daemon {
    /// Disconnects `/dev/nbd<index>` (the kernel closes its connections)
    /// and waits for its sessions; by index alone where this daemon no
    /// longer holds it (a successor's, or a teardown tried before).
    fn disconnect_nbd(&self, index: u32) -> Result<(), DaemonError> {
        let held = {
            let mut g = self.lock();
            let at = g.kernel_nbd.iter().position(|k| k.index() == index);
            at.map(|at| g.kernel_nbd.swap_remove(at))
        };
        match held {
            Some(kernel) => kernel.disconnect(),
            None => tmem_nbd::kernel::disconnect(index),
        }
        .map_err(|e| DaemonError::Teardown(format!("NBD device /dev/nbd{index}: {e}")))
    }

    /// Stops and deletes ublk device `id`, joining its queues; by number
    /// alone where this daemon no longer serves it.
    fn delete_ublk(&self, id: u32) -> Result<(), DaemonError> {
        let held = {
            let mut g = self.lock();
            let at = g.ublk.iter().position(|u| u.id() == id);
            at.map(|at| g.ublk.swap_remove(at))
        };
        match held {
            Some(ublk) => ublk.stop(),
            None => tmem_ublk::delete(id),
        }
        .map_err(|e| DaemonError::Teardown(e.to_string()))
    }

    /// The store of the device or cache named `name`.
    fn store_of(&self, name: &str) -> Option<&tmem_core::Store> {
        let device = self.devices.iter().find(|d| d.name() == name).map(|d| d.store());
        device.or_else(|| self.caches.iter().find(|c| c.name() == name).map(|c| c.store()))
    }
}

impl control::Handler for Daemon {
    fn handle(&self, req: Request) -> Response {
        match req {
            Request::Status => json(&self.status()),
            Request::Stat => json(&self.all_stats()),
            Request::Set { device, key, value } => match self.store_of(&device) {
                None => Response::err(format!("no device {device:?}")),
                Some(store) => match knobs::set(store, &key, &value) {
                    Ok(msg) => {
                        log(&format!("{device}: {msg}"));
                        Response::ok(serde_json::Value::String(msg))
                    }
                    Err(e) => Response::err(e),
                },
            },
            Request::Down => match self.teardown() {
                Ok(()) => json(&self.lock().status),
                Err(e) => Response::err(e),
            },
        }
    }

    fn answered(&self, req: &Request) {
        if matches!(req, Request::Down) && self.exited.load(Ordering::Acquire) {
            let _ = self.events.lock().send(Event::Down);
        }
    }
}

fn json<T: serde::Serialize>(v: &T) -> Response {
    match serde_json::to_value(v) {
        Ok(v) => Response::ok(v),
        Err(e) => Response::err(e),
    }
}
