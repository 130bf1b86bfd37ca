//! tmem's ublk transport: a tmem block device served to the kernel's ublk
//! driver (`ublk_drv`, Linux 6.0+) as `/dev/ublkbN`, through the maintained
//! `libublk` crate. No loop device, no filesystem and no socket lie between
//! the block layer and the store: the kernel hands each request to a queue
//! thread of this process through io_uring, and takes the answer back with
//! the next fetch.
//!
//! - **Queues.** One per online CPU by default ([`Config`]), each on a
//!   thread of its own with `PR_SET_IO_FLUSHER` (libublk sets it), serving
//!   its requests in place ([`queue`]): no allocation per request.
//! - **Copies.** The kernel copies a request's pages into (or out of) the
//!   tag's buffer, and the codec reads (or writes) that buffer: one copy,
//!   the one the codec needs anyway. ublk's zero-copy modes
//!   (`UBLK_F_SUPPORT_ZERO_COPY`, `UBLK_F_AUTO_BUF_REG`) register the
//!   request's pages as an io_uring buffer for the server's own io_uring
//!   reads and writes; a server that compresses in userspace cannot read
//!   them that way, so they are not asked for. [`UblkDevice::features`]
//!   names what the driver offers and what this device uses.
//! - **Discard** reaches [`BlockDevice::trim`] (`swapon --discard`), write
//!   zeroes [`BlockDevice::write_zeroes`], flush [`BlockDevice::flush`].
//! - **Restart** (`tmem swap restart`): devices are made with
//!   `UBLK_F_USER_RECOVERY` and `UBLK_F_USER_RECOVERY_REISSUE`. The running
//!   server closes its [`gate`] ([`UblkDevice::pause`]): each queue stops
//!   before its next request. It hands the stores over, gives the device up
//!   ([`UblkDevice::handed_over`]) and ends; the kernel then quiesces the
//!   device, keeps new requests, and requeues those the old server held.
//!   The successor takes the device with `START_USER_RECOVERY` and its own
//!   queues ([`UblkDevice::recover`]), and the kernel reissues them all to
//!   it: none fails.
//! - **A server's end seen at once.** Linux 6.12's driver learns that its
//!   server ended from the server's pending fetch commands, which io_uring
//!   cancels at exit. A queue whose every tag was handed to the server (a
//!   paused queue under swap load) has none, so the driver only learns it
//!   from the request timeout, 30 s by default: a successor's
//!   `START_USER_RECOVERY` met EBUSY for 30.1 and 31.8 s (Debian 13 guest,
//!   TCG), in 2 runs of 2. Each device's `io_timeout` is set to
//!   [`REQUEST_TIMEOUT_MS`]: while the server lives, a request past it only
//!   has its timer reset (`ublk_timeout`).
//! - **Crash.** A server that dies without handing over leaves its device
//!   quiesced, with every request waiting. The device must not be stopped
//!   while a swap area is on it: the block device goes, and a swap area on
//!   a dead disk can never be swapped off (swapoff cannot open it). So
//!   recovery ([`owned_by`], [`UblkDevice::fail_requests`]) takes the
//!   device over with a server that fails every request, swaps off (the
//!   dead daemon's pages are lost; their reads fail at once), and only then
//!   stops and deletes it. This is also why every device has user
//!   recovery: without it the driver stops the device when its server
//!   dies.

mod gate;
mod queue;

use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use libublk::ctrl::{UblkCtrl, UblkCtrlBuilder};
use libublk::io::UblkDev;
use libublk::{sys, UblkFlags};
use tmem_block::BlockDevice;

use crate::gate::Gate;

/// The control device every ublk command goes through.
pub const CONTROL: &str = "/dev/ublk-control";
/// Most queues of one device (the driver's `UBLK_MAX_NR_QUEUES` is 4096;
/// more than one per CPU only costs threads).
pub const MAX_QUEUES: u16 = 64;
/// The block size the device is set up with: one page.
const BLOCK_SHIFT: u8 = 12;
/// Largest discard or write-zeroes request, in 512-byte sectors (1 GiB).
const MAX_DISCARD_SECTORS: u32 = 1 << 21;
/// The flags every device of this crate is made with.
const CTRL_FLAGS: u64 = (sys::UBLK_F_USER_RECOVERY | sys::UBLK_F_USER_RECOVERY_REISSUE) as u64;
/// The request timeout each device gets (`queue/io_timeout`, ms): how long
/// after its server's end the driver may take to quiesce the device for a
/// successor, when every tag of a queue was in the server's hands.
pub const REQUEST_TIMEOUT_MS: u32 = 1000;
/// The target name the driver's json records.
const TARGET: &str = "tmem";

/// Errors of the ublk transport.
#[derive(Debug, thiserror::Error)]
pub enum UblkError {
    /// A control command failed.
    #[error("ublk {what}: {source}")]
    Control {
        /// The command or step.
        what: String,
        /// libublk's error.
        source: libublk::UblkError,
    },
    /// The driver answered a command with an errno.
    #[error("ublk {what}: {}", std::io::Error::from_raw_os_error(*.errno))]
    Driver {
        /// The command or step.
        what: String,
        /// The errno.
        errno: i32,
    },
    /// A thread could not be started or ended badly.
    #[error("ublk {what}: {detail}")]
    Thread {
        /// Which.
        what: String,
        /// Why.
        detail: String,
    },
}

/// Gives this thread libublk's control ring, which its control commands go
/// through: one per thread, and a command from a thread without one panics.
/// A [`UblkCtrl`] made here has one; a thread that only drives a control
/// made elsewhere (the device's runner, a teardown) must call this first.
fn control_ring() -> Result<(), libublk::UblkError> {
    libublk::ctrl::ublk_init_ctrl_task_ring(|ring| {
        if ring.is_none() {
            *ring = Some(
                io_uring::IoUring::<io_uring::squeue::Entry128>::builder()
                    .build(16)
                    .map_err(libublk::UblkError::IOError)?,
            );
        }
        Ok(())
    })
}

fn control(what: impl Into<String>) -> impl FnOnce(libublk::UblkError) -> UblkError {
    let what = what.into();
    move |source| UblkError::Control { what, source }
}

/// A driver answer of `r`: negative is an errno.
fn answered(what: &str, r: i32) -> Result<(), UblkError> {
    if r < 0 {
        Err(UblkError::Driver { what: what.into(), errno: -r })
    } else {
        Ok(())
    }
}

/// How a device is served: `Config::default()` has one queue per online
/// CPU (at most [`MAX_QUEUES`]), 32 requests per queue, 128 KiB each.
///
/// The depth and the request size bound the swap writeback in flight: 4 MiB
/// a queue. A queue's thread serves one request at a time, so a deeper
/// queue only holds more pages under writeback, and reclaim cannot free a
/// page until its write ends. At 128 requests of 512 KiB (64 MiB a queue),
/// a job under a 64 MiB `memory.max` put its whole group under writeback at
/// once, reclaim found nothing to free, and the group OOM-killed it (2 runs
/// of 3, Debian 13 guest). FUSE + loop bounds the same thing with FUSE's
/// background limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Hardware queues, each with a thread of its own.
    pub queues: u16,
    /// Requests in flight per queue.
    pub depth: u16,
    /// Largest request, in bytes; each tag has a buffer this size.
    pub io_buf_bytes: u32,
}

impl Default for Config {
    fn default() -> Self {
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        Config { queues: u16::try_from(cpus).unwrap_or(MAX_QUEUES).min(MAX_QUEUES), depth: 32, io_buf_bytes: 128 << 10 }
    }
}

/// The driver's feature bits that matter to tmem, as (bit, name).
const FEATURE_NAMES: &[(u32, &str)] = &[
    (sys::UBLK_F_SUPPORT_ZERO_COPY, "zero_copy"),
    (sys::UBLK_F_USER_RECOVERY, "user_recovery"),
    (sys::UBLK_F_USER_RECOVERY_REISSUE, "recovery_reissue"),
    (sys::UBLK_F_USER_COPY, "user_copy"),
    (sys::UBLK_F_AUTO_BUF_REG, "auto_buf_reg"),
    (sys::UBLK_F_QUIESCE, "quiesce"),
    (sys::UBLK_F_PER_IO_DAEMON, "per_io_daemon"),
];

fn feature_names(bits: u64) -> Vec<&'static str> {
    FEATURE_NAMES.iter().filter(|(b, _)| bits & u64::from(*b) != 0).map(|(_, n)| *n).collect()
}

/// What the driver offers and what a device uses, by name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Features {
    /// The driver's features (`UBLK_U_CMD_GET_FEATURES`).
    pub driver: u64,
    /// The device's flags.
    pub used: u64,
}

impl fmt::Display for Features {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "uses {}; the driver offers {}",
            feature_names(self.used).join(","),
            feature_names(self.driver).join(",")
        )
    }
}

/// A `/dev/ublkbN` served by this process until [`UblkDevice::stop`], or
/// until it is handed over.
pub struct UblkDevice {
    ctrl: Arc<UblkCtrl>,
    id: u32,
    queues: u16,
    gate: Arc<Gate>,
    runner: Option<JoinHandle<Result<i32, libublk::UblkError>>>,
    features: Features,
    handed_over: AtomicBool,
}

impl fmt::Debug for UblkDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UblkDevice").field("id", &self.id).field("queues", &self.queues).finish_non_exhaustive()
    }
}

impl UblkDevice {
    /// Adds a ublk device serving `device` (the driver picks its number)
    /// and starts it; `/dev/ublkbN` exists when this returns.
    pub fn start(device: Arc<dyn BlockDevice>, config: &Config) -> Result<Self, UblkError> {
        let ctrl = UblkCtrlBuilder::default()
            .name(TARGET)
            .nr_queues(config.queues.max(1))
            .depth(config.depth)
            .io_buf_bytes(config.io_buf_bytes)
            .ctrl_flags(CTRL_FLAGS)
            .dev_flags(UblkFlags::UBLK_DEV_F_ADD_DEV)
            .build()
            .map_err(control("add device"))?;
        Self::serve(ctrl, device)
    }

    /// Takes device `id` over from a server that handed it over (or died)
    /// with `START_USER_RECOVERY`, and serves it from `device`; the
    /// requests the kernel kept meanwhile are served first. Waits up to 30 s
    /// for the old server to end.
    pub fn recover(id: u32, device: Arc<dyn BlockDevice>) -> Result<Self, UblkError> {
        let id =
            i32::try_from(id).map_err(|_| UblkError::Driver { what: format!("device {id}"), errno: libc::EINVAL })?;
        // libublk sizes its per-queue tables from what it is given, then
        // reads the device's own settings over them: give it those.
        let old = UblkCtrl::new_simple(id).map_err(control(format!("device {id}")))?.dev_info();
        let ctrl = UblkCtrlBuilder::default()
            .name(TARGET)
            .id(id)
            .nr_queues(old.nr_hw_queues)
            .depth(old.queue_depth)
            .io_buf_bytes(old.max_io_buf_bytes)
            .ctrl_flags(old.flags)
            .dev_flags(UblkFlags::UBLK_DEV_F_RECOVER_DEV)
            .build()
            .map_err(control(format!("device {id}")))?;
        let r = ctrl.start_user_recover().map_err(control(format!("device {id}: START_USER_RECOVERY")))?;
        answered(&format!("device {id}: START_USER_RECOVERY"), r)?;
        Self::serve(ctrl, device)
    }

    /// Takes device `id` over from a server that died, with one that fails
    /// every request (EIO): the requests the dead one left, reissued, and
    /// those a swapoff makes. [`UblkDevice::stop`] it once nothing is on it;
    /// [`UblkDevice::handed_over`] leaves it quiesced again for a later try.
    pub fn fail_requests(id: u32) -> Result<Self, UblkError> {
        Self::recover(id, Arc::new(Lost))
    }

    /// Starts the queues of `ctrl` and the device.
    fn serve(ctrl: UblkCtrl, device: Arc<dyn BlockDevice>) -> Result<Self, UblkError> {
        let ctrl = Arc::new(ctrl);
        let info = ctrl.dev_info();
        let (id, queues) = (info.dev_id, info.nr_hw_queues);
        let features = Features { driver: ctrl.get_driver_features().unwrap_or(0), used: info.flags };
        let gate = Arc::new(Gate::default());
        let size = device.size();
        let (started, is_started) = mpsc::sync_channel::<()>(1);
        let runner = {
            let (ctrl, gate) = (Arc::clone(&ctrl), Arc::clone(&gate));
            std::thread::Builder::new()
                .name(format!("ublk{id}"))
                .spawn(move || {
                    control_ring()?;
                    ctrl.run_target(
                        |dev| {
                            set_params(dev, size);
                            Ok(())
                        },
                        move |qid, dev| queue::serve_queue(qid, dev, &device, &gate),
                        move |_| started.send(()).ok().unwrap_or_default(),
                    )
                })
                .map_err(|e| UblkError::Thread { what: format!("device {id}"), detail: e.to_string() })?
        };
        if is_started.recv().is_err() {
            // run_target returned before the device started: its error.
            let detail = match runner.join() {
                Ok(Err(e)) => return Err(control(format!("device {id}: start"))(e)),
                Ok(Ok(r)) => format!("ended ({r}) before the device started"),
                Err(_) => "panicked before the device started".into(),
            };
            return Err(UblkError::Thread { what: format!("device {id}"), detail });
        }
        // A recovered device keeps its disk, and with it the timeout; set
        // it again for one that an older server made.
        let timeout = format!("/sys/block/ublkb{id}/queue/io_timeout");
        if let Err(e) = std::fs::write(&timeout, REQUEST_TIMEOUT_MS.to_string()) {
            tracing::warn!("{timeout}: {e}: a successor may wait up to the default 30 s to take this device");
        }
        Ok(UblkDevice { ctrl, id, queues, gate, runner: Some(runner), features, handed_over: AtomicBool::new(false) })
    }

    /// The device's number: `/dev/ublkbN`, `/dev/ublkcN`.
    pub fn id(&self) -> u32 {
        self.id
    }

    /// The block device's node.
    pub fn node(&self) -> PathBuf {
        node(self.id)
    }

    /// Its queues (one thread each).
    pub fn queues(&self) -> u16 {
        self.queues
    }

    /// What the driver offers and what the device uses.
    pub fn features(&self) -> &Features {
        &self.features
    }

    /// Stops every queue before its next request (those inside finish);
    /// the kernel's requests wait. Fails, with the queues going on, if a
    /// request does not finish `within`.
    pub fn pause(&self, within: Duration) -> Result<(), String> {
        if self.gate.close(within) {
            Ok(())
        } else {
            Err(format!("ublk device {}: a request did not finish within {} ms", self.id, within.as_millis()))
        }
    }

    /// Lets paused queues go on.
    pub fn resume(&self) {
        self.gate.open();
    }

    /// Gives the device up to a successor: this process's end leaves it in
    /// place, its requests kept for [`UblkDevice::recover`]. The queues stay
    /// paused.
    pub fn handed_over(&self) {
        self.handed_over.store(true, Ordering::SeqCst);
        self.ctrl.disown();
    }

    /// Stops the device, joins its queues and deletes it. The swap area on
    /// it must be off.
    pub fn stop(mut self) -> Result<(), UblkError> {
        self.stop_inner()
    }

    fn stop_inner(&mut self) -> Result<(), UblkError> {
        let Some(runner) = self.runner.take() else { return Ok(()) };
        // Paused queues must reach the driver's abort to end.
        self.gate.open();
        let killed =
            control_ring().and_then(|()| self.ctrl.kill_dev()).map_err(control(format!("device {}: stop", self.id)));
        let joined = runner.join();
        killed.and_then(|r| answered(&format!("device {}: stop", self.id), r))?;
        if joined.is_err() {
            return Err(UblkError::Thread { what: format!("device {}", self.id), detail: "a queue panicked".into() });
        }
        delete(self.id)
    }
}

impl Drop for UblkDevice {
    fn drop(&mut self) {
        if self.handed_over.load(Ordering::SeqCst) {
            // Its queues stay blocked until the process ends.
            drop(self.runner.take());
            return;
        }
        if let Err(e) = self.stop_inner() {
            tracing::warn!("{e}");
        }
    }
}

/// The store of a server that died: every request fails with EIO.
struct Lost;

impl BlockDevice for Lost {
    /// Unused: a recovered device keeps the parameters it was made with.
    fn size(&self) -> u64 {
        0
    }
    fn read_at(&self, _: &mut [u8], offset: u64) -> Result<(), tmem_block::BlockError> {
        Err(lost("read", offset))
    }
    fn write_at(&self, _: &[u8], offset: u64) -> Result<(), tmem_block::BlockError> {
        Err(lost("write", offset))
    }
    fn flush(&self) -> Result<(), tmem_block::BlockError> {
        Err(lost("flush", 0))
    }
    fn trim(&self, offset: u64, _: u64) -> Result<(), tmem_block::BlockError> {
        Err(lost("trim", offset))
    }
    fn write_zeroes(&self, offset: u64, _: u64) -> Result<(), tmem_block::BlockError> {
        Err(lost("write-zeroes", offset))
    }
    fn extents(&self, offset: u64, _: u64) -> Result<Vec<tmem_block::Extent>, tmem_block::BlockError> {
        Err(lost("extents", offset))
    }
}

fn lost(op: &'static str, offset: u64) -> tmem_block::BlockError {
    tmem_block::BlockError::Backing { op, offset, source: std::io::Error::from_raw_os_error(libc::EIO) }
}

/// Basic parameters with one-page blocks, and discard.
fn set_params(dev: &mut UblkDev, size: u64) {
    dev.set_default_params(size);
    let p = &mut dev.tgt.params;
    p.basic.logical_bs_shift = BLOCK_SHIFT;
    p.basic.physical_bs_shift = BLOCK_SHIFT;
    p.types |= sys::UBLK_PARAM_TYPE_DISCARD;
    p.discard = sys::ublk_param_discard {
        discard_granularity: 1 << BLOCK_SHIFT,
        max_discard_sectors: MAX_DISCARD_SECTORS,
        max_write_zeroes_sectors: MAX_DISCARD_SECTORS,
        max_discard_segments: 1,
        ..Default::default()
    };
}

/// `/dev/ublkbN`.
pub fn node(id: u32) -> PathBuf {
    PathBuf::from(format!("/dev/ublkb{id}"))
}

/// Whether ublk devices can be made here: `Ok` when [`CONTROL`] opens
/// (after `modprobe ublk_drv` where it was missing), else why not.
pub fn available() -> Result<(), String> {
    let open = || {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(CONTROL)
            .map(drop)
            .map_err(|e| format!("{CONTROL}: {e}"))
    };
    open().or_else(|e| {
        if std::path::Path::new(CONTROL).exists() {
            return Err(e);
        }
        match std::process::Command::new("modprobe").arg("ublk_drv").stdin(std::process::Stdio::null()).output() {
            Ok(out) if out.status.success() => open(),
            Ok(out) => Err(format!("{e}; modprobe ublk_drv failed: {}", String::from_utf8_lossy(&out.stderr).trim())),
            Err(m) => Err(format!("{e}; cannot run modprobe: {m}")),
        }
    })
}

/// Deletes ublk device `id` (any server's), stopping it first if it runs.
/// The driver waits until nothing holds the device open: swap must be off
/// it, and a zram front gone (see the module docs, "Crash").
pub fn delete(id: u32) -> Result<(), UblkError> {
    let sid = i32::try_from(id).map_err(|_| UblkError::Driver { what: format!("device {id}"), errno: libc::EINVAL })?;
    let ctrl = UblkCtrl::new_simple(sid).map_err(control(format!("device {id}")))?;
    let r = ctrl.del_dev().map_err(control(format!("device {id}: delete")))?;
    answered(&format!("device {id}: delete"), r)
}

/// Every ublk device's number (`/sys/class/ublk-char/ublkcN`).
pub fn devices() -> Vec<u32> {
    let mut ids: Vec<u32> = std::fs::read_dir("/sys/class/ublk-char")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.strip_prefix("ublkc")?.parse().ok())
        .collect();
    ids.sort_unstable();
    ids
}

/// The pid of the server that last started device `id`
/// (`ublksrv_pid`), if the device exists and has had one.
pub fn owner(id: u32) -> Option<u32> {
    let ctrl = UblkCtrl::new_simple(i32::try_from(id).ok()?).ok()?;
    u32::try_from(ctrl.dev_info().ublksrv_pid).ok().filter(|p| *p > 0)
}

/// The ublk devices that process `pid` started, by number.
pub fn owned_by(pid: u32) -> Vec<u32> {
    devices().into_iter().filter(|id| owner(*id) == Some(pid)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dead_servers_store_fails_every_request_with_eio() {
        let mut page = [0u8; 4096];
        assert_eq!(queue_result(&Lost, sys::UBLK_IO_OP_READ, &mut page), -libc::EIO);
        assert_eq!(queue_result(&Lost, sys::UBLK_IO_OP_WRITE, &mut page), -libc::EIO);
        assert_eq!(queue_result(&Lost, sys::UBLK_IO_OP_DISCARD, &mut page), -libc::EIO);
    }

    fn queue_result(dev: &dyn BlockDevice, op: u32, buf: &mut [u8]) -> i32 {
        let iod = sys::ublksrv_io_desc { op_flags: op, nr_sectors: 8, start_sector: 0, ..Default::default() };
        queue::serve(dev, &iod, buf)
    }

    #[test]
    fn features_are_named() {
        let f = Features {
            driver: u64::from(sys::UBLK_F_USER_RECOVERY | sys::UBLK_F_AUTO_BUF_REG | sys::UBLK_F_USER_COPY),
            used: CTRL_FLAGS,
        };
        assert_eq!(
            f.to_string(),
            "uses user_recovery,recovery_reissue; the driver offers user_recovery,user_copy,auto_buf_reg"
        );
    }

    #[test]
    fn the_default_config_has_a_queue_per_cpu() {
        let c = Config::default();
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        assert_eq!(usize::from(c.queues), cpus.min(usize::from(MAX_QUEUES)));
        // At most 4 MiB of writeback in flight a queue (see Config).
        assert!(u64::from(c.depth) * u64::from(c.io_buf_bytes) <= 4 << 20, "{c:?}");
    }

    #[test]
    fn available_answers_where_the_control_device_opens_and_names_it_where_not() {
        let opens = std::fs::OpenOptions::new().read(true).write(true).open(CONTROL).is_ok();
        match available() {
            Ok(()) => assert!(opens || std::path::Path::new(CONTROL).exists(), "available without {CONTROL}"),
            Err(e) => {
                assert!(!opens, "{CONTROL} opens, yet: {e}");
                assert!(e.contains(CONTROL), "{e}");
            }
        }
    }
}
