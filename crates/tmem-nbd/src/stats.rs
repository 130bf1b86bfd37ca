//! Per-export and per-server counters.

use std::sync::atomic::{AtomicU64, Ordering};
use tmem_counters::counters;

use crate::Export;

/// Live counters of one export (relaxed atomics, shared by its connections).
#[derive(Debug, Default)]
pub(crate) struct ExportCounters {
    pub(crate) connections: AtomicU64,
    pub(crate) active: AtomicU64,
    pub(crate) reads: AtomicU64,
    pub(crate) writes: AtomicU64,
    pub(crate) flushes: AtomicU64,
    pub(crate) trims: AtomicU64,
    pub(crate) write_zeroes: AtomicU64,
    pub(crate) block_status: AtomicU64,
    pub(crate) disconnects: AtomicU64,
    pub(crate) unsupported: AtomicU64,
    pub(crate) bytes_read: AtomicU64,
    pub(crate) bytes_written: AtomicU64,
    pub(crate) bytes_trimmed: AtomicU64,
    pub(crate) bytes_zeroed: AtomicU64,
    pub(crate) errors: AtomicU64,
}

pub(crate) fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

impl ExportCounters {
    pub(crate) fn snapshot(&self, export: &Export) -> ExportStats {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        ExportStats {
            name: export.name.clone(),
            size: export.device.size(),
            connections: l(&self.connections),
            active_connections: l(&self.active),
            reads: l(&self.reads),
            writes: l(&self.writes),
            flushes: l(&self.flushes),
            trims: l(&self.trims),
            write_zeroes: l(&self.write_zeroes),
            block_status: l(&self.block_status),
            disconnects: l(&self.disconnects),
            unsupported: l(&self.unsupported),
            bytes_read: l(&self.bytes_read),
            bytes_written: l(&self.bytes_written),
            bytes_trimmed: l(&self.bytes_trimmed),
            bytes_zeroed: l(&self.bytes_zeroed),
            errors: l(&self.errors),
        }
    }
}

counters! {
    /// Snapshot of one export's counters.
    #[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
    pub struct ExportStats {
        extra {
            /// Export name.
            pub name: String,
        }
        /// Device size in bytes.
        size: Gauge(Bytes),
        /// Sessions that entered transmission on this export.
        connections: Counter(Events),
        /// Sessions in transmission now.
        active_connections: Gauge(Events),
        /// `NBD_CMD_READ` requests.
        reads: Counter(Events),
        /// `NBD_CMD_WRITE` requests.
        writes: Counter(Events),
        /// `NBD_CMD_FLUSH` requests.
        flushes: Counter(Events),
        /// `NBD_CMD_TRIM` requests.
        trims: Counter(Events),
        /// `NBD_CMD_WRITE_ZEROES` requests.
        write_zeroes: Counter(Events),
        /// `NBD_CMD_BLOCK_STATUS` requests.
        block_status: Counter(Events),
        /// `NBD_CMD_DISC` requests.
        disconnects: Counter(Events),
        /// Unknown or unsupported commands (`NBD_CMD_CACHE`, ...).
        unsupported: Counter(Events),
        /// Bytes returned by successful reads.
        bytes_read: Counter(Bytes),
        /// Bytes stored by successful writes.
        bytes_written: Counter(Bytes),
        /// Bytes covered by successful trims.
        bytes_trimmed: Counter(Bytes),
        /// Bytes covered by successful write-zeroes.
        bytes_zeroed: Counter(Bytes),
        /// Requests answered with an error.
        errors: Counter(Events),
    }
}

counters! {
    /// Snapshot of a server's counters: its limits, how often each was
    /// reached, and the buffers held.
    #[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
    pub struct ServerStats {
        extra {
            /// Per-export counters, in export order.
            pub exports: Vec<ExportStats>,
        }
        /// Connections accepted and handed to a session thread.
        connections_accepted: Counter(Events),
        /// Sessions running now (handshake or transmission).
        connections_active: Gauge(Objects),
        /// The most sessions served at once (`max_connections`).
        connections_max: Max(Objects),
        /// The most sessions one client may hold: one user on a unix socket, one IPv4 address or IPv6 /64 on TCP
        /// (`max_connections_per_peer`).
        connections_per_peer_max: Max(Objects),
        /// Connections turned away because `max_connections` sessions were open and none was idle long enough to make
        /// room (answered with `NBD_REP_ERR_SHUTDOWN`, or closed at once when 8 refusals were already under way).
        refused_connection_limit: Counter(Events),
        /// Connections turned away because their client held `max_connections_per_peer` sessions, none idle long enough
        /// to make room.
        refused_peer_limit: Counter(Events),
        /// New clients held before their greeting until an idle connection's slot could be reclaimed.
        slot_waits: Counter(Events),
        /// Connections closed after `idle_reclaim` without a request because a new client needed the slot.
        idle_reclaims: Counter(Events),
        /// Sessions cut because the handshake took longer than `handshake_timeout`.
        handshake_timeouts: Counter(Events),
        /// Sessions closed after `idle_timeout` without a request (off by default).
        idle_timeouts: Counter(Events),
        /// Sessions closed because a request (header and write payload) did not arrive in full within
        /// `transfer_timeout` plus 2 s per MiB.
        request_timeouts: Counter(Events),
        /// Sessions cut because a reply with a payload was not read within `transfer_timeout` plus 2 s per MiB.
        reply_timeouts: Counter(Events),
        /// Sessions dropped because a read inside a message or a reply write made no progress for `io_timeout` (a
        /// client not reading replies).
        io_timeouts: Counter(Events),
        /// Sessions that ended with a protocol or I/O error (timeouts are counted above instead).
        session_errors: Counter(Events),
        /// Bytes of request / reply payload buffers held now (bounded by `max_buffered_bytes`).
        buffered_bytes: Gauge(Bytes),
        /// Most payload buffer bytes held at once since the server started.
        buffered_bytes_peak: Max(Bytes),
        /// The budget of payload buffers across connections (`max_buffered_bytes`).
        buffered_bytes_max: Max(Bytes),
        /// Requests that waited for others to free buffer budget.
        buffer_waits: Counter(Events),
        /// Requests that gave up waiting for buffer budget after `buffer_wait` (answered with `ENOMEM`; the connection
        /// is closed).
        buffer_wait_timeouts: Counter(Events),
    }
}
