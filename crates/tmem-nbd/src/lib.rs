//! An NBD (Network Block Device) server for tmem block devices.
//!
//! The server speaks the fixed newstyle handshake and the transmission phase
//! with simple replies (what the Linux kernel client uses) and structured
//! replies with the `base:allocation` metadata context (what libnbd and QEMU
//! negotiate). See `README.md` for the protocol coverage.
//!
//! - [`proto`]: wire constants and pure parsers/encoders on byte slices.
//! - [`serve_connection`]: one client session over any `Read + Write`
//!   stream (sockets in the server, in-memory buffers in the fuzzer).
//! - [`kernel::KernelDevice`]: the kernel's NBD client on sessions of this
//!   process, set up over netlink (`tmem swap up --transport nbd`).
//! - [`NbdServer`] / [`ServerHandle`]: the listener (unix socket by default,
//!   loopback TCP on request), one thread per connection, with limits
//!   against clients that hold connections or memory: connection limits in
//!   all and per client, with idle connections reclaimed for new clients
//!   and a polite refusal, handshake / transfer / I/O timeouts, and a
//!   budget of payload buffers across connections, one chunk per request
//!   (see [`NbdConfig`]).
//!
//! ```no_run
//! use std::sync::Arc;
//! use tmem_nbd::{Export, Listen, NbdConfig, ServerHandle};
//! let device = Arc::new(tmem_block::ZeroDevice::new(1 << 30));
//! let export = Export::new("zero", device);
//! let handle = ServerHandle::start(NbdConfig::new(vec![export], Listen::Unix("/tmp/nbd.sock".into())))?;
//! println!("serving {}", handle.local_addr().uri(""));
//! handle.stop()?;
//! # Ok::<(), tmem_nbd::NbdError>(())
//! ```

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use tmem_block::BlockDevice;

pub mod kernel;
mod limits;
mod park;
pub mod proto;
mod server;
mod session;
mod stats;

pub use park::SessionState;
pub use server::{
    Listen, NbdConfig, NbdHandover, NbdServer, ServerHandle, DEFAULT_BUFFER_WAIT, DEFAULT_HANDSHAKE_TIMEOUT,
    DEFAULT_IDLE_RECLAIM, DEFAULT_IO_TIMEOUT, DEFAULT_MAX_BUFFERED_BYTES, DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_PEER, DEFAULT_TRANSFER_TIMEOUT,
};
pub use session::{serve_connection, SessionEnd};
pub use stats::{ExportStats, ServerStats};

/// Errors of the server and of one session.
#[derive(Debug, thiserror::Error)]
pub enum NbdError {
    /// Socket I/O failed (including the client going away mid-message).
    #[error("I/O: {0}")]
    Io(#[source] std::io::Error),
    /// A socket read inside a message or a write of a reply made no
    /// progress within the socket's timeout (`NbdConfig::io_timeout`).
    #[error("socket I/O timed out")]
    TimedOut,
    /// A request found no room in the buffer budget within
    /// `NbdConfig::buffer_wait`; it was answered with `ENOMEM`.
    #[error("no buffer space within the wait deadline")]
    BufferWait,
    /// The client broke the protocol; the session was dropped.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// The configuration is unusable.
    #[error("bad configuration: {0}")]
    Config(String),
    /// A TCP address that is not loopback, without `allow_remote`.
    #[error("refusing to listen on non-loopback address {0} (set allow_remote to permit it)")]
    RemoteNotAllowed(std::net::SocketAddr),
    /// A live server already listens on this unix socket.
    #[error("unix socket {0} is in use by a running server")]
    SocketInUse(PathBuf),
    /// The kernel's NBD client refused or failed a netlink request.
    #[error("the kernel's NBD client: {0}")]
    Kernel(String),
    /// A server or connection thread panicked.
    #[error("server thread panicked")]
    Panicked,
}

impl From<std::io::Error> for NbdError {
    fn from(e: std::io::Error) -> Self {
        // Socket timeouts read as EAGAIN.
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => NbdError::TimedOut,
            _ => NbdError::Io(e),
        }
    }
}

impl From<proto::ProtoError> for NbdError {
    fn from(e: proto::ProtoError) -> Self {
        NbdError::Protocol(e.to_string())
    }
}

/// One exported device.
#[derive(Clone)]
pub struct Export {
    /// Export name (NBD_OPT_GO / EXPORT_NAME); the first export is also the
    /// default one, chosen by the empty name.
    pub name: String,
    /// Free text shown by `nbdinfo --list`.
    pub description: String,
    /// The device.
    pub device: Arc<dyn BlockDevice>,
}

impl Export {
    /// An export with an empty description.
    pub fn new(name: impl Into<String>, device: Arc<dyn BlockDevice>) -> Self {
        Self { name: name.into(), description: String::new(), device }
    }

    /// Sets the description.
    pub fn with_description(mut self, description: impl Into<String>) -> Self {
        self.description = description.into();
        self
    }
}

impl fmt::Debug for Export {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Export")
            .field("name", &self.name)
            .field("description", &self.description)
            .field("size", &self.device.size())
            .finish_non_exhaustive()
    }
}

pub(crate) struct ExportEntry {
    pub(crate) export: Export,
    pub(crate) counters: stats::ExportCounters,
}

/// The validated, shared export table with per-export counters.
#[derive(Clone)]
pub struct Exports {
    entries: Arc<[ExportEntry]>,
}

impl fmt::Debug for Exports {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.entries.iter().map(|e| &e.export)).finish()
    }
}

impl Exports {
    /// Checks the exports: at least one, unique names, names and
    /// descriptions within the protocol's 4096-byte string limit.
    pub fn new(exports: Vec<Export>) -> Result<Self, NbdError> {
        if exports.is_empty() {
            return Err(NbdError::Config("no exports".into()));
        }
        for (i, e) in exports.iter().enumerate() {
            if e.name.len() > proto::MAX_STRING || e.description.len() > proto::MAX_STRING {
                return Err(NbdError::Config(format!("export {:?}: name or description over 4096 bytes", e.name)));
            }
            if e.name.contains('\0') || e.description.contains('\0') {
                return Err(NbdError::Config(format!("export {:?}: NUL in name or description", e.name)));
            }
            if exports[..i].iter().any(|o| o.name == e.name) {
                return Err(NbdError::Config(format!("duplicate export name {:?}", e.name)));
            }
        }
        let entries: Vec<ExportEntry> =
            exports.into_iter().map(|export| ExportEntry { export, counters: Default::default() }).collect();
        Ok(Self { entries: entries.into() })
    }

    /// Number of exports.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Always false: there is at least one export.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The exports, in order.
    pub fn iter(&self) -> impl Iterator<Item = &Export> {
        self.entries.iter().map(|e| &e.export)
    }

    /// Index of the export a client names; the empty name is the first.
    pub(crate) fn find(&self, name: &[u8]) -> Option<usize> {
        if name.is_empty() {
            return Some(0);
        }
        self.entries.iter().position(|e| e.export.name.as_bytes() == name)
    }

    pub(crate) fn entry(&self, i: usize) -> &ExportEntry {
        &self.entries[i]
    }

    /// Counters of every export.
    pub fn stats(&self) -> Vec<ExportStats> {
        self.entries.iter().map(|e| e.counters.snapshot(&e.export)).collect()
    }
}
