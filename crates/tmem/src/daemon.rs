//! The tmem daemon: block devices on compressed stores, exported as FUSE
//! files and turned into kernel swap (loop + mkswap + swapon), with a
//! control socket for stat/set/down.
//!
//! Started by `tmem swap up` as `tmem daemon --spec JSON`. Before it serves
//! anything it locks its memory (`mlockall`, on fault), marks itself an I/O
//! flusher (`PR_SET_IO_FLUSHER`) and leaves the memory cgroup it may have
//! been started in, so that a workload's memory limit never throttles the
//! process that makes room for it.
//!
//! Teardown (control `down`, SIGTERM or SIGINT) is orderly: swapoff first,
//! so the kernel reads every page back; if swapoff fails (not enough RAM),
//! the daemon keeps serving and says why, since exiting would lose pages.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tmem_block::{BlockDevice, DeviceConfig, PoolDevice};
use tmem_core::codec::CodecChoice;
use tmem_core::{DictTraining, Incompressible, PolicyConfig, StoreConfig};
use tmem_fuse::{Export, FuseConfig, FuseMount};
use tmem_sys::swap;

use crate::ctl::{self, Request, Response};

/// One device to create.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct DeviceSpec {
    /// Name, e.g. `swap0`.
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// Codec: lz4, zstd, zstd:LEVEL; "+dict" trains a dictionary on the first 8 MiB of compressed pages and switches to it.
    pub codec: String,
    /// Pool limit in bytes (0: use `pool_limit_percent`).
    pub pool_limit_bytes: u64,
    /// Pool limit as a percentage of RAM.
    pub pool_limit_percent: u32,
}

/// What the daemon runs.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct DaemonSpec {
    /// Runtime directory (control socket, FUSE mount, log).
    pub runtime_dir: PathBuf,
    /// Devices.
    pub devices: Vec<DeviceSpec>,
    /// Export the devices as FUSE files.
    #[serde(default = "yes")]
    pub fuse: bool,
    /// Turn each device into kernel swap (needs `fuse`).
    pub swap: bool,
    /// Serve the devices over NBD: a unix socket path, or `tcp:ADDR`.
    #[serde(default)]
    pub nbd: Option<String>,
    /// Allow a non-loopback NBD TCP address.
    #[serde(default)]
    pub nbd_allow_remote: bool,
    /// Swap priority.
    pub priority: i32,
    /// FUSE worker threads.
    pub fuse_threads: usize,
    /// FUSE over io_uring workers per CPU (0: `/dev/fuse` only).
    #[serde(default)]
    pub fuse_uring: usize,
    /// `swapon --discard` policy.
    #[serde(default)]
    pub discard: tmem_sys::swap::SwapDiscard,
    /// Tiers below each device's pool.
    #[serde(default)]
    pub tiers: crate::tiers::TierArgs,
}

fn yes() -> bool {
    true
}

/// What the daemon set up, reported by `status`.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Status {
    /// `starting`, `up`, `stopping`.
    pub state: String,
    /// Daemon pid.
    pub pid: u32,
    /// Steps done, in order, for the CLI to print.
    pub steps: Vec<String>,
    /// Per device: name, FUSE file, loop device.
    pub devices: Vec<DeviceStatus>,
    /// NBD URIs of the devices, when served over NBD.
    #[serde(default)]
    pub nbd_uris: Vec<String>,
    /// How FUSE requests reach the daemon (`/dev/fuse` or io_uring), when mounted.
    #[serde(default)]
    pub fuse_transport: Option<String>,
    /// FUSE requests served over io_uring so far.
    #[serde(default)]
    pub fuse_uring_requests: u64,
}

/// One device's plumbing.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct DeviceStatus {
    /// Device name.
    pub name: String,
    /// FUSE file.
    pub file: PathBuf,
    /// Loop device, when attached.
    pub loop_dev: Option<PathBuf>,
    /// Whether swap is on.
    pub swap: bool,
}

struct State {
    status: Status,
    fuse: Option<FuseMount>,
    nbd: Option<tmem_nbd::ServerHandle>,
}

struct Daemon {
    spec: DaemonSpec,
    devices: Vec<Arc<PoolDevice>>,
    state: Mutex<State>,
    exit: AtomicBool,
}

fn log(msg: &str) {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    eprintln!("[{}.{:03}] {msg}", now.as_secs(), now.subsec_millis());
}

/// Builds the store configuration of a device.
pub fn store_config(d: &DeviceSpec, total_ram: u64) -> Result<StoreConfig, String> {
    let choice = CodecChoice::parse(&d.codec).map_err(|e| e.to_string())?;
    let policy = PolicyConfig {
        max_pool_bytes: d.pool_limit_bytes,
        max_pool_percent: d.pool_limit_percent,
        total_ram_bytes: total_ram,
        // A swap device has no lower tier yet: keep poorly compressible
        // pages raw rather than failing the kernel's write (zram's huge pages).
        incompressible: Incompressible::StoreRaw,
        ..Default::default()
    };
    Ok(StoreConfig {
        policy,
        codec: Some(choice.codec),
        dictionary: choice.dictionary.then(DictTraining::default),
        ..Default::default()
    })
}

/// Runs the daemon until an orderly teardown; returns an error only when
/// setup fails (after undoing what was set up).
pub fn run(spec: DaemonSpec) -> Result<(), String> {
    // Signals are taken synchronously by the main thread; block them before
    // any thread exists so every thread inherits the mask.
    let sigs = block_signals()?;
    let dir = spec.runtime_dir.clone();
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).map_err(|e| e.to_string())?;

    let mut steps = Vec::new();
    match swap::leave_memory_cgroup() {
        Ok(where_) => {
            steps.push(format!("daemon pid {} moved to the root memory cgroup ({where_})", std::process::id()))
        }
        Err(e) => log(&format!("warning: could not leave the memory cgroup: {e}")),
    }
    swap::mlockall_onfault().map_err(|e| e.to_string())?;
    steps.push("mlockall(MCL_CURRENT|MCL_FUTURE|MCL_ONFAULT) set".into());
    match swap::set_io_flusher() {
        Ok(()) => steps.push("PR_SET_IO_FLUSHER set".into()),
        // It needs CAP_SYS_RESOURCE, which some containers and VMs withhold.
        Err(e) => steps.push(format!("warning: {e}; continuing with mlockall and direct I/O only")),
    }

    let total_ram = swap::total_ram_bytes().map_err(|e| e.to_string())?;
    let mut devices = Vec::new();
    for d in &spec.devices {
        let store = store_config(d, total_ram)?;
        let chain = spec.tiers.build(&d.name, d.size)?;
        let tier_names = chain
            .as_ref()
            .map(|c| c.tiers().iter().map(|t| t.name().to_owned()).collect::<Vec<_>>().join(" -> "))
            .unwrap_or_default();
        let dev = DeviceConfig { name: d.name.clone(), size: d.size, store, tiers: chain }
            .build()
            .map_err(|e| e.to_string())?;
        if !tier_names.is_empty() {
            steps.push(format!("{}: pool -> {tier_names} (pages sealed with ChaCha20-Poly1305)", d.name));
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
    let daemon = Arc::new(Daemon {
        spec,
        devices,
        state: Mutex::new(State {
            status: Status { state: "starting".into(), pid: std::process::id(), steps, ..Status::default() },
            fuse: None,
            nbd: None,
        }),
        exit: AtomicBool::new(false),
    });

    let sock = ctl::socket_path(&dir);
    let _ = std::fs::remove_file(&sock);
    let listener = UnixListener::bind(&sock).map_err(|e| format!("{}: {e}", sock.display()))?;
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o600)).map_err(|e| e.to_string())?;
    {
        let d = Arc::clone(&daemon);
        std::thread::Builder::new()
            .name("tmem-ctl".into())
            .spawn(move || serve_control(&d, &listener))
            .map_err(|e| e.to_string())?;
    }

    if let Err(e) = daemon.setup() {
        log(&format!("setup failed: {e}"));
        if let Err(t) = daemon.teardown() {
            log(&format!("teardown after failed setup: {t}"));
        }
        let _ = std::fs::remove_file(&sock);
        return Err(e);
    }
    log("up");

    // Main loop: wait for a signal or a control `down`.
    loop {
        if daemon.exit.load(Ordering::Acquire) {
            break;
        }
        if let Some(sig) = wait_signal(&sigs, Duration::from_millis(200)) {
            log(&format!("signal {sig}: tearing down"));
            match daemon.teardown() {
                Ok(()) => break,
                Err(e) => log(&format!("refusing to exit: {e}")),
            }
        }
    }
    let _ = std::fs::remove_file(&sock);
    log("stopped");
    Ok(())
}

impl Daemon {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn step(&self, s: String) {
        log(&s);
        self.lock().status.steps.push(s);
    }

    fn setup(&self) -> Result<(), String> {
        if self.spec.fuse {
            self.setup_fuse()?;
        }
        if let Some(listen) = &self.spec.nbd {
            self.setup_nbd(listen)?;
        }
        self.lock().status.state = "up".into();
        Ok(())
    }

    fn setup_nbd(&self, listen: &str) -> Result<(), String> {
        let listen = match listen.strip_prefix("tcp:") {
            Some(addr) => tmem_nbd::Listen::Tcp(addr.parse().map_err(|e| format!("bad NBD address {addr:?}: {e}"))?),
            None => tmem_nbd::Listen::Unix(PathBuf::from(listen)),
        };
        let exports = self
            .devices
            .iter()
            .map(|d| tmem_nbd::Export::new(d.name(), Arc::clone(d) as Arc<dyn BlockDevice>))
            .collect();
        let mut cfg = tmem_nbd::NbdConfig::new(exports, listen);
        cfg.allow_remote = self.spec.nbd_allow_remote;
        let server = tmem_nbd::ServerHandle::start(cfg).map_err(|e| e.to_string())?;
        let uris: Vec<String> = self.devices.iter().map(|d| server.uri(d.name())).collect();
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

    fn setup_fuse(&self) -> Result<(), String> {
        let mnt = self.spec.runtime_dir.join("dev");
        std::fs::create_dir_all(&mnt).map_err(|e| format!("{}: {e}", mnt.display()))?;
        let exports = self
            .devices
            .iter()
            .map(|d| Export { name: d.name().to_owned(), device: Arc::clone(d) as Arc<dyn BlockDevice> })
            .collect();
        let fuse = FuseMount::mount(FuseConfig {
            mountpoint: mnt.clone(),
            exports,
            threads: self.spec.fuse_threads,
            uring_per_queue: self.spec.fuse_uring,
        })
        .map_err(|e| e.to_string())?;
        let transport = fuse.transport();
        let files: Vec<(String, PathBuf)> =
            self.devices.iter().map(|d| (d.name().to_owned(), fuse.path_of(d.name()))).collect();
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
        if self.spec.swap {
            for (i, (name, file)) in files.iter().enumerate() {
                let dev = swap::loop_attach(file).map_err(|e| e.to_string())?;
                self.lock().status.devices[i].loop_dev = Some(dev.clone());
                self.step(format!("{name}: losetup --direct-io=on {} -> {}", file.display(), dev.display()));
                if let Some(set) = swap::loop_disable_wbt(&dev).map_err(|e| e.to_string())? {
                    self.step(format!("{name}: {set} (no writeback throttling in front of swap)"));
                }
                swap::mkswap(&dev, &format!("tmem-{name}")).map_err(|e| e.to_string())?;
                self.step(format!("{name}: mkswap {}", dev.display()));
                swap::swapon(&dev, self.spec.priority, self.spec.discard).map_err(|e| e.to_string())?;
                self.lock().status.devices[i].swap = true;
                self.step(format!(
                    "{name}: swapon --discard={} --priority {} {}",
                    self.spec.discard.as_str(),
                    self.spec.priority,
                    dev.display()
                ));
            }
        }
        Ok(())
    }

    /// swapoff, detach, unmount. Stops at the first swapoff failure and
    /// leaves everything serving.
    fn teardown(&self) -> Result<(), String> {
        self.lock().status.state = "stopping".into();
        let devs = self.lock().status.devices.clone();
        for (i, d) in devs.iter().enumerate() {
            let Some(dev) = &d.loop_dev else { continue };
            if d.swap || swap::is_swap(dev).unwrap_or(false) {
                self.step(format!("{}: swapoff {} (the kernel reads its pages back)", d.name, dev.display()));
                if let Err(e) = swap::swapoff(dev) {
                    self.lock().status.state = "up".into();
                    return Err(format!(
                        "swapoff {} failed, so the daemon keeps serving to lose no page: {e}",
                        dev.display()
                    ));
                }
                self.lock().status.devices[i].swap = false;
            }
            if let Err(e) = swap::loop_detach(dev) {
                // Someone detached it already: fine, as long as it no longer serves our file.
                if swap::loops_of(&d.file).map_or(true, |l| l.contains(dev)) {
                    return Err(e.to_string());
                }
            }
            self.lock().status.devices[i].loop_dev = None;
            self.step(format!("{}: losetup --detach {}", d.name, dev.display()));
        }
        let nbd = self.lock().nbd.take();
        if let Some(server) = nbd {
            server.stop().map_err(|e| e.to_string())?;
            self.step("NBD server stopped".into());
        }
        let fuse = self.lock().fuse.take();
        if let Some(f) = fuse {
            let at = f.mountpoint().to_owned();
            let over_uring = f.uring_requests();
            f.unmount().map_err(|e| e.to_string())?;
            match over_uring {
                0 => self.step(format!("FUSE unmounted from {}", at.display())),
                n => {
                    self.step(format!("FUSE unmounted from {} ({n} requests were served over io_uring)", at.display()))
                }
            }
            let _ = std::fs::remove_dir(&at);
        }
        self.exit.store(true, Ordering::Release);
        Ok(())
    }

    fn handle(&self, req: Request) -> Response {
        match req {
            Request::Status => {
                let g = self.lock();
                let mut status = g.status.clone();
                if let Some(f) = &g.fuse {
                    status.fuse_transport = Some(f.transport().to_string());
                    status.fuse_uring_requests = f.uring_requests();
                }
                json(&status)
            }
            Request::Stat => {
                let stats: Vec<_> = self.devices.iter().map(|d| d.stats()).collect();
                json(&stats)
            }
            Request::Set { device, key, value } => match self.devices.iter().find(|d| d.name() == device) {
                None => Response::err(format!("no device {device:?}")),
                Some(d) => match set_knob(d, &key, &value) {
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
}

fn json<T: serde::Serialize>(v: &T) -> Response {
    match serde_json::to_value(v) {
        Ok(v) => Response::ok(v),
        Err(e) => Response::err(e),
    }
}

/// Applies `tmem set DEVICE KEY=VALUE`.
pub fn set_knob(d: &PoolDevice, key: &str, value: &str) -> Result<String, String> {
    let store = d.store();
    match key {
        "codec" => {
            let choice = CodecChoice::parse(value).map_err(|e| e.to_string())?;
            let trained = if choice.dictionary {
                let t = store.train_dictionary(&choice.codec, &DictTraining::default()).map_err(|e| e.to_string())?;
                format!(", with a {}-byte dictionary trained on {} stored pages", t.bytes, t.sample_pages)
            } else {
                store.use_codec(&choice.codec).map_err(|e| e.to_string())?;
                String::new()
            };
            Ok(format!("codec is now {}{trained} (stored pages keep their own codec)", store.codec_name()))
        }
        "pool-limit" | "pool_limit" => {
            if let Some(p) = value.strip_suffix('%') {
                store.set_policy("max_pool_percent", p).map_err(|e| e.to_string())?;
                store.set_policy("max_pool_bytes", "0").map_err(|e| e.to_string())?;
            } else {
                let bytes = tmem_corpus::parse_size(value)?;
                store.set_policy("max_pool_bytes", &bytes.to_string()).map_err(|e| e.to_string())?;
            }
            Ok(format!("pool limit is now {}", human(store.policy().limit_bytes())))
        }
        "compact" => Ok(format!("compacted: {} pages released", store.compact())),
        _ => {
            store.set_policy(key, value).map_err(|e| e.to_string())?;
            Ok(format!("{key} = {value}"))
        }
    }
}

fn serve_control(d: &Daemon, listener: &UnixListener) {
    for conn in listener.incoming() {
        let Ok(stream) = conn else { continue };
        let resp = match peer_is_owner(&stream) {
            false => Response::err("permission denied: not the daemon's owner"),
            true => match ctl::read_request(&stream) {
                Ok(req) => d.handle(req),
                Err(e) => Response::err(e),
            },
        };
        let mut line = serde_json::to_string(&resp).unwrap_or_else(|e| format!("{{\"ok\":false,\"error\":\"{e}\"}}"));
        line.push('\n');
        let _ = std::io::Write::write_all(&mut &stream, line.as_bytes());
        if d.exit.load(Ordering::Acquire) {
            break;
        }
    }
}

/// Only the daemon's own user (root) may control it.
fn peer_is_owner(s: &UnixStream) -> bool {
    let mut cred = libc::ucred { pid: 0, uid: u32::MAX, gid: 0 };
    let mut len = libc::socklen_t::try_from(std::mem::size_of::<libc::ucred>()).unwrap_or(0);
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, a ucred.
    let rc = unsafe {
        libc::getsockopt(
            std::os::fd::AsRawFd::as_raw_fd(s),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            std::ptr::from_mut(&mut cred).cast(),
            &mut len,
        )
    };
    // SAFETY: geteuid has no preconditions.
    rc == 0 && cred.uid == unsafe { libc::geteuid() }
}

fn block_signals() -> Result<libc::sigset_t, String> {
    // SAFETY: sigset_t is plain data; sigemptyset/sigaddset initialise it,
    // pthread_sigmask only changes this thread's mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGHUP);
        if libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) != 0 {
            return Err("pthread_sigmask failed".into());
        }
        Ok(set)
    }
}

fn wait_signal(set: &libc::sigset_t, timeout: Duration) -> Option<i32> {
    let ts = libc::timespec {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(1),
        tv_nsec: libc::c_long::from(timeout.subsec_nanos()),
    };
    // SAFETY: `set` is an initialised sigset; a null siginfo pointer is allowed.
    let sig = unsafe { libc::sigtimedwait(set, std::ptr::null_mut(), &ts) };
    (sig > 0).then_some(sig)
}

/// Formats bytes as KiB/MiB/GiB.
pub fn human(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

/// Where the daemon's log goes.
pub fn log_path(dir: &Path) -> PathBuf {
    dir.join("daemon.log")
}
