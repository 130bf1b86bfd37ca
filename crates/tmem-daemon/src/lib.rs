//! The tmem daemon: devices on compressed stores, exported as FUSE files and
//! turned into kernel swap (loop + mkswap + swapon), or served over NBD,
//! with a control socket for `tmem stat`, `tmem set` and `tmem swap down`.
//!
//! - [`spec`]: what a daemon runs, and the checks it passes first;
//! - [`config`]: the configuration file (`/etc/tmem/tmem.toml`);
//! - [`runtime`]: the runtime directory, its lifetime lock and safe file access;
//! - [`daemon`]: the daemon's life: setup, serving, orderly teardown;
//! - [`control`]: the control socket's server (the protocol is `tmem_ctl`);
//! - [`launch`]: starting a daemon from the command line and waiting for it;
//! - [`limits`]: what a command may ask of this machine (counts and sizes);
//! - [`recover`]: cleaning up after a daemon that died;
//! - [`knobs`]: run-time changes (`tmem set`);
//! - [`tiers`]: the `--tier` options;
//! - [`front`]: the kernel's zram or zswap in front of the devices (`--front`);
//! - [`supervisor`]: systemd's notify protocol, and a successor's `MAINPID=`;
//! - `fault` (feature `fault-injection`, test builds only): injected faults.

pub mod auto_codec;
pub mod config;
pub mod control;
pub mod daemon;
#[cfg(feature = "fault-injection")]
pub mod fault;
pub mod front;
pub mod handover;
pub mod knobs;
pub mod launch;
pub mod limits;
pub mod logging;
pub mod metrics;
pub mod recover;
pub mod runtime;
pub mod spec;
pub mod stale;
pub mod supervisor;
pub mod tiers;
pub mod transport;
pub mod watch;

pub use daemon::run;
pub use spec::{DaemonSpec, DeviceSpec, PoolLimit};

/// Daemon errors.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// A value given by the user is invalid.
    #[error("{0}")]
    Invalid(String),
    /// A count or size is more than this machine can hold.
    #[error(transparent)]
    Limit(#[from] limits::LimitError),
    /// The runtime directory cannot be used.
    #[error(transparent)]
    Runtime(#[from] runtime::RuntimeError),
    /// The control protocol failed.
    #[error(transparent)]
    Ctl(#[from] tmem_ctl::CtlError),
    /// A tier cannot be built.
    #[error("tier: {0}")]
    Tier(String),
    /// A setup step failed (after what was set up was undone).
    #[error("{0}")]
    Setup(String),
    /// Teardown cannot finish; the daemon keeps serving.
    #[error("{0}")]
    Teardown(String),
    /// The daemon did not start or stop as expected.
    #[error("{0}")]
    Lifecycle(String),
    /// Emptying an idle swap area failed (it names the step and the device).
    #[error("{0}")]
    Recycle(String),
}

/// Formats bytes as B/KiB/MiB/GiB/TiB.
pub fn human(b: u64) -> String {
    bytesize::ByteSize::b(b).display().iec().to_string()
}
