//! Injected faults, for tests only: this module exists only with the
//! `fault-injection` feature, which the release binary never has.
//!
//! - `TMEM_FAULT_STALL_SETUP_MS=N`: setup stalls N ms before swapon (a
//!   signal ends the stall early), as a huge swap area would.
//! - `TMEM_FAULT_HANDOVER_PROTOCOL=N`: a successor claims hand-over
//!   protocol N, as an incompatible binary would.
//! - `TMEM_FAULT_HANDOVER_NO_PRECOPY=1`: a successor asks for no pre-copy,
//!   as one from before it would.
//! - `TMEM_FAULT_HANDOVER_STREAMED=1`: a successor asks for the stores'
//!   pages through the socket, as one from before zero-copy would.
//! - `TMEM_FAULT_HANDOVER_NO_URING=1`: a successor cannot take FUSE over
//!   io_uring over, as one from before it.
//! - `TMEM_FAULT_HANDOVER_FAIL_TAKE=1`: a successor fails once it has
//!   taken the stores and devices.
//! - `TMEM_FAULT_HANDOVER_NOT_GONE=1`: the running daemon answers its
//!   first successor's `TAKEN` as one that gave up waiting would.
//! - `TMEM_FAULT_PANIC_TEARDOWN=1`: the first teardown panics after its
//!   first swapoff, as one did on a counter's underflow.
//! - `TMEM_FAULT_UBLK_WAITING=N`: a daemon that set up believes
//!   `/dev/ublkbN` was handed to it for its first export and user recovery
//!   did not take it (no such device exists, so every try fails).

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::{Duration, Instant};

/// Stalls setup as `TMEM_FAULT_STALL_SETUP_MS` says, until a signal arrives.
pub fn stall_setup(signalled: &AtomicI32) {
    let Some(ms) = std::env::var("TMEM_FAULT_STALL_SETUP_MS").ok().and_then(|v| v.parse().ok()) else { return };
    crate::daemon::log(&format!("fault injection: setup stalls for {ms} ms"));
    let end = Instant::now() + Duration::from_millis(ms);
    while Instant::now() < end && signalled.load(Ordering::Acquire) == 0 {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The hand-over protocol a successor claims, if `TMEM_FAULT_HANDOVER_PROTOCOL` says.
pub fn handover_protocol() -> Option<u32> {
    std::env::var("TMEM_FAULT_HANDOVER_PROTOCOL").ok().and_then(|v| v.parse().ok())
}

/// Whether a successor asks for a streamed hand-over (as one from before
/// zero-copy hand-over would), if `TMEM_FAULT_HANDOVER_STREAMED` is set.
pub fn handover_streamed() -> bool {
    std::env::var_os("TMEM_FAULT_HANDOVER_STREAMED").is_some()
}

/// Whether a successor asks for no pre-copy (its stores' index all in the
/// pause, as before pre-copy), if `TMEM_FAULT_HANDOVER_NO_PRECOPY` is set.
pub fn handover_no_precopy() -> bool {
    std::env::var_os("TMEM_FAULT_HANDOVER_NO_PRECOPY").is_some()
}

/// Whether a successor says it cannot take FUSE over io_uring over (as
/// one from before it), if `TMEM_FAULT_HANDOVER_NO_URING` is set.
pub fn handover_no_uring() -> bool {
    std::env::var_os("TMEM_FAULT_HANDOVER_NO_URING").is_some()
}

/// Whether a successor fails once it has taken the stores and devices,
/// if `TMEM_FAULT_HANDOVER_FAIL_TAKE` is set.
pub fn handover_fail_take() -> bool {
    std::env::var_os("TMEM_FAULT_HANDOVER_FAIL_TAKE").is_some()
}

/// Whether the running daemon answers its first successor's `TAKEN` as
/// one that gave up waiting would (it resumes and serves on; the successor
/// then exits), if `TMEM_FAULT_HANDOVER_NOT_GONE` is set.
pub fn handover_not_gone() -> bool {
    static USED: AtomicBool = AtomicBool::new(false);
    std::env::var_os("TMEM_FAULT_HANDOVER_NOT_GONE").is_some() && !USED.swap(true, Ordering::AcqRel)
}

/// Panics the first time it is called, if `TMEM_FAULT_PANIC_TEARDOWN` is set.
pub fn panic_in_teardown() {
    static PANICKED: AtomicBool = AtomicBool::new(false);
    if std::env::var_os("TMEM_FAULT_PANIC_TEARDOWN").is_some() && !PANICKED.swap(true, Ordering::AcqRel) {
        panic!("fault injection: teardown panics");
    }
}

/// Hands `daemon` a ublk device that no try can take, if
/// `TMEM_FAULT_UBLK_WAITING` names one.
pub fn ublk_waiting(daemon: &std::sync::Arc<crate::daemon::Daemon>) {
    let Some(id) = std::env::var("TMEM_FAULT_UBLK_WAITING").ok().and_then(|v| v.parse().ok()) else { return };
    crate::daemon::log(&format!("fault injection: /dev/ublkb{id} was handed over and waits"));
    daemon.recover_ublk(vec![crate::handover::HandedUblk { export: 0, id }]);
}
