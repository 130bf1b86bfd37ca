//! One client session: handshake, then transmission, over any byte stream.
//!
//! The handler is generic over `Read + Write` so that the server runs it on
//! unix and TCP sockets and the fuzzer on an in-memory stream. Requests are
//! handled in order, one at a time; replies are written before the next
//! request is read, so a client that does not read its replies stops its
//! own requests from being read. Nothing a client sends can make it panic:
//! every length is checked before it is used, and allocations are bounded
//! by the device range check and the maximum block size. Under the server,
//! payload buffers are also taken from the shared [`Budget`], one
//! [`CHUNK`] at most per request (reads are sent and writes stored piece by
//! piece), and the connection's [`Watch`] bounds the handshake, the idle
//! wait, the arrival of each request and the sending of each reply.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::time::Duration;

use tmem_block::{BlockError, Extent};

use crate::limits::{Budget, Held, Timer, Watch};
use crate::proto::{self, *};
use crate::stats::bump;
use crate::{ExportEntry, Exports, NbdError};

/// Options accepted in one handshake before the server hangs up.
const MAX_OPTIONS: u32 = 4096;
/// Largest option payload the server reads; larger ones are skipped and
/// answered with `NBD_REP_ERR_TOO_BIG`.
const MAX_OPTION_DATA: u32 = 64 << 10;
/// Largest range one `NBD_CMD_BLOCK_STATUS` reply describes (the client asks
/// again for the rest); keeps a reply under 2^20 descriptors of 4 KiB pages.
const BLOCK_STATUS_MAX: u64 = 1 << 30;
/// Most descriptors in one block status chunk (the protocol's SHOULD).
const MAX_EXTENTS: usize = 1 << 20;
/// Read buffer of the session.
const READ_BUFFER: usize = 64 << 10;
/// The payload buffer is freed after a request if it grew above this (the
/// budget only counts a request's own bytes).
const KEEP_BUFFER: usize = 256 << 10;
/// Reply header in front of read data: the larger of simple and structured.
const READ_REPLY_HEAD: usize = STRUCTURED_HEADER_SIZE + 8;
/// Payload bytes one request holds at once: a read is read from the device
/// and sent, and a write received and stored, in pieces of this size, and
/// a block status reply is kept within it. So a connection holds at most
/// one chunk of the budget however large its requests, and 64 connections
/// at most 64 MiB of the default 256 MiB: no client can take what others
/// need, and a stalled client holds one chunk, not a whole request.
pub(crate) const CHUNK: u32 = 1 << 20;
/// Most bytes of payload buffer one request takes: the reply header in
/// front of a chunk of read data.
pub(crate) const REQUEST_OVERHEAD: usize = READ_REPLY_HEAD;
/// Time a transfer gets per MiB on top of `transfer_timeout`: 2 s, a floor
/// rate of 512 KiB/s (a 32 MiB write has 74 s by default).
const TRANSFER_MS_PER_MIB: u64 = 2000;
/// Options a refused client may send before the server hangs up.
const REFUSAL_OPTIONS: u32 = 16;

/// Zeros for `NBD_CMD_WRITE_ZEROES` with `NBD_CMD_FLAG_NO_HOLE`.
static ZEROS: [u8; 1 << 20] = [0; 1 << 20];

/// How a session ended without error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SessionEnd {
    /// The client sent `NBD_OPT_ABORT` during the handshake.
    Aborted,
    /// The client sent `NBD_CMD_DISC`.
    Disconnected,
    /// The client closed the stream between two messages.
    Closed,
    /// A successor process serves the connection now (`tmem swap restart`).
    HandedOver,
}

enum Phase {
    End(SessionEnd),
    Transmit(usize),
}

/// What the server imposes on one session beyond the protocol.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits<'a> {
    /// Largest READ / WRITE payload: the advertised maximum block size.
    pub(crate) max_block: u32,
    /// Payload buffers are taken from it; none: not accounted.
    pub(crate) budget: Option<&'a Budget>,
    /// Longest a request waits for budget; then it is answered `ENOMEM`
    /// and the connection closed.
    pub(crate) budget_wait: Duration,
    /// The connection's deadline, enforced by the accept loop. Without one
    /// a socket read timeout is an error even between messages, and
    /// transfers have no deadline.
    pub(crate) watch: Option<&'a Watch>,
    /// A request must arrive in full, and a reply with a payload go out,
    /// within this plus 2 s per MiB of payload (needs a watch).
    pub(crate) transfer: Duration,
    /// The server's pause switch for hand-overs; none: never paused.
    pub(crate) park: Option<crate::park::Park<'a>>,
}

impl Limits<'_> {
    /// The protocol's limits only (in-memory sessions, the fuzzer).
    pub(crate) const NONE: Limits<'static> = Limits {
        max_block: MAX_PAYLOAD,
        budget: None,
        budget_wait: Duration::MAX,
        watch: None,
        transfer: Duration::MAX,
        park: None,
    };
}

struct Session<'a, S: Read + Write> {
    io: BufReader<S>,
    exports: &'a Exports,
    limits: Limits<'a>,
    /// `NBD_OPT_STRUCTURED_REPLY` was acknowledged.
    structured: bool,
    /// The client negotiated `NBD_FLAG_C_NO_ZEROES`.
    no_zeroes: bool,
    /// `base:allocation` was selected for this export index.
    meta: Option<usize>,
    /// Reply / payload buffer, reused across requests.
    buf: Vec<u8>,
}

/// Serves one client on `stream` until it disconnects: the fixed newstyle
/// handshake, then the transmission phase on the export it chose.
///
/// Returns how the session ended; an error means the stream failed or the
/// client broke the protocol (bad magic, unknown client flags, oversized
/// write, unknown export with `NBD_OPT_EXPORT_NAME`), in which case the
/// caller drops the stream (a hard disconnect).
pub fn serve_connection<S: Read + Write>(stream: S, exports: &Exports) -> Result<SessionEnd, NbdError> {
    serve(stream, exports, Limits::NONE)
}

/// [`serve_connection`] under the server's limits.
pub(crate) fn serve<S: Read + Write>(stream: S, exports: &Exports, limits: Limits<'_>) -> Result<SessionEnd, NbdError> {
    let mut s = Session::new(stream, exports, limits);
    match s.handshake()? {
        Phase::End(end) => Ok(end),
        Phase::Transmit(i) => s.transmit(i),
    }
}

/// The transmission flags of every export, for a client that negotiated
/// structured replies or not.
pub(crate) fn transmission_flags(structured: bool) -> u16 {
    let mut f = FLAG_HAS_FLAGS
        | FLAG_SEND_FLUSH
        | FLAG_SEND_FUA
        | FLAG_SEND_TRIM
        | FLAG_SEND_WRITE_ZEROES
        | FLAG_CAN_MULTI_CONN;
    if structured {
        // Reads always go out as one chunk, so "don't fragment" is free.
        f |= FLAG_SEND_DF;
    }
    f
}

/// Serves a connection a predecessor process negotiated (its `state`),
/// from the next request on.
pub(crate) fn resume<S: Read + Write>(
    stream: S,
    exports: &Exports,
    limits: Limits<'_>,
    state: crate::park::SessionState,
) -> Result<SessionEnd, NbdError> {
    if state.export >= exports.len() || state.meta.is_some_and(|m| m != state.export) {
        return Err(NbdError::Config(format!("a handed-over session names export {}", state.export)));
    }
    let mut s = Session::new(stream, exports, limits);
    (s.structured, s.no_zeroes, s.meta) = (state.structured, state.no_zeroes, state.meta);
    s.transmit(state.export)
}

/// Turns a client away politely: the greeting, then `NBD_REP_ERR_SHUTDOWN`
/// with `message` for each option (clients such as qemu and libnbd print it
/// and exit), `NBD_REP_ACK` for `NBD_OPT_ABORT`. `NBD_OPT_EXPORT_NAME`,
/// which has no error reply, and anything malformed just close.
pub(crate) fn refuse<S: Read + Write>(stream: S, exports: &Exports, message: &str) -> Result<(), NbdError> {
    Session::new(stream, exports, Limits::NONE).refuse(message)
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

fn is_known_option(option: u32) -> bool {
    matches!(
        option,
        OPT_EXPORT_NAME
            | OPT_ABORT
            | OPT_LIST
            | OPT_INFO
            | OPT_GO
            | OPT_STRUCTURED_REPLY
            | OPT_LIST_META_CONTEXT
            | OPT_SET_META_CONTEXT
    )
}

fn len64(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

fn to_usize(n: u32) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// Does `[offset, offset+len)` lie within `size`?
fn in_range(offset: u64, len: u32, size: u64) -> bool {
    offset.checked_add(u64::from(len)).is_some_and(|end| end <= size)
}

/// Runs `f` (the server's own work: device I/O) with the deadline of
/// `timer` paused, so that only the client's time counts.
fn paused<T>(watch: Option<&Watch>, timer: Timer, f: impl FnOnce() -> T) -> T {
    let left = watch.and_then(Watch::pause);
    let r = f();
    if let (Some(w), Some(left)) = (watch, left) {
        w.arm(timer, left);
    }
    r
}

fn block_errno(e: &BlockError) -> u32 {
    proto::nbd_errno(e.errno())
}

impl<'a, S: Read + Write> Session<'a, S> {
    fn new(stream: S, exports: &'a Exports, limits: Limits<'a>) -> Self {
        Session {
            io: BufReader::with_capacity(READ_BUFFER, stream),
            exports,
            limits,
            structured: false,
            no_zeroes: false,
            meta: None,
            buf: Vec::new(),
        }
    }

    // ---- stream helpers ----

    /// Waits for the first byte of the next message; `Ok(false)` if the
    /// stream ended instead. Under a watch, the socket's read timeout is no
    /// error here: the client is only idle, and the watch bounds that.
    fn wait_message(&mut self) -> io::Result<bool> {
        loop {
            match self.io.fill_buf() {
                Ok(b) => return Ok(!b.is_empty()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if self.limits.watch.is_some() && is_timeout(&e) => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Fills `buf`; `Ok(false)` if the stream ended before its first byte.
    fn read_or_eof(&mut self, buf: &mut [u8]) -> io::Result<bool> {
        if !self.wait_message()? {
            return Ok(false);
        }
        self.io.read_exact(buf)?;
        Ok(true)
    }

    /// Runs `f` holding `n` bytes of the budget for the payload buffer,
    /// then frees the buffer if it grew and gives the bytes back. If the
    /// budget has no room within the wait deadline, `req` is answered with
    /// `ENOMEM` and the session ends ([`NbdError::BufferWait`]). Without a
    /// budget (the kernel's own connections, `kernel.rs`) the buffer stays,
    /// at most a chunk: the kernel's swap writes are often larger than
    /// [`KEEP_BUFFER`], and freeing it would allocate (and fault in) a
    /// buffer at each of them.
    fn with_buffer<T>(
        &mut self,
        entry: &ExportEntry,
        req: &Request,
        n: usize,
        f: impl FnOnce(&mut Self) -> Result<T, NbdError>,
    ) -> Result<T, NbdError> {
        let held: Option<Held<'a>> = match self.limits.budget {
            None => None,
            Some(b) => match b.take(n, self.limits.budget_wait) {
                Some(h) => Some(h),
                None => {
                    let ms = self.limits.budget_wait.as_millis();
                    self.reply_err(entry, req, NBD_ENOMEM, &format!("no buffer space within {ms} ms"))?;
                    return Err(NbdError::BufferWait);
                }
            },
        };
        let r = f(self);
        if held.is_some() && self.buf.capacity() > KEEP_BUFFER {
            self.buf = Vec::new();
        }
        drop(held);
        r
    }

    /// The deadline of a transfer of `len` payload bytes.
    fn transfer_time(&self, len: usize) -> Duration {
        let ms = len64(len).saturating_mul(TRANSFER_MS_PER_MIB) >> 20;
        self.limits.transfer.saturating_add(Duration::from_millis(ms))
    }

    /// Arms the connection's deadline, if it has one; `false` if it fired.
    fn arm(&self, timer: Timer, after: Duration) -> bool {
        self.limits.watch.is_none_or(|w| w.arm(timer, after))
    }

    /// Removes the connection's deadline.
    fn disarm(&self) {
        if let Some(w) = self.limits.watch {
            w.disarm();
        }
    }

    /// Did the connection's `timer` fire?
    fn fired(&self, timer: Timer) -> bool {
        self.limits.watch.and_then(Watch::fired) == Some(timer)
    }

    /// Reads exactly `len` bytes into `self.buf` (reserving as data comes).
    fn read_payload(&mut self, len: u32) -> io::Result<()> {
        self.buf.clear();
        self.buf.reserve(to_usize(len));
        let got = (&mut self.io).take(u64::from(len)).read_to_end(&mut self.buf)?;
        if got != to_usize(len) {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        Ok(())
    }

    /// Skips `len` bytes of input.
    fn discard(&mut self, len: u64) -> io::Result<()> {
        let got = io::copy(&mut (&mut self.io).take(len), &mut io::sink())?;
        if got != len {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        Ok(())
    }

    fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        let w = self.io.get_mut();
        w.write_all(bytes)?;
        w.flush()
    }

    /// Sends `self.buf`.
    fn send_buf(&mut self) -> io::Result<()> {
        let w = self.io.get_mut();
        w.write_all(&self.buf)?;
        w.flush()
    }

    fn transmission_flags(&self) -> u16 {
        transmission_flags(self.structured)
    }

    // ---- handshake ----

    fn opt_reply(&mut self, option: u32, reply: u32, data: &[u8]) -> io::Result<()> {
        let mut out = Vec::with_capacity(20 + data.len());
        proto::option_reply(&mut out, option, reply, data);
        self.send(&out)
    }

    fn opt_error(&mut self, option: u32, reply: u32, message: &str) -> io::Result<()> {
        self.opt_reply(option, reply, proto::truncate_str(message, MAX_STRING).as_bytes())
    }

    fn handshake(&mut self) -> Result<Phase, NbdError> {
        self.send(&proto::greeting())?;
        let mut flags = [0u8; 4];
        if !self.read_or_eof(&mut flags)? {
            return Ok(Phase::End(SessionEnd::Closed));
        }
        // Clients without NBD_FLAG_C_FIXED_NEWSTYLE still get fixed newstyle
        // replies: the only option they may send is EXPORT_NAME, which has none.
        self.no_zeroes = proto::parse_client_flags(&flags)?.no_zeroes;
        for _ in 0..MAX_OPTIONS {
            let mut header = [0u8; OPTION_HEADER_SIZE];
            if !self.read_or_eof(&mut header)? {
                return Ok(Phase::End(SessionEnd::Closed));
            }
            let h = proto::parse_option_header(&header)?;
            if h.option == OPT_ABORT {
                // The client may already have closed: the reply is best effort.
                self.discard(u64::from(h.len))?;
                let _ = self.opt_reply(OPT_ABORT, REP_ACK, &[]);
                return Ok(Phase::End(SessionEnd::Aborted));
            }
            if h.option == OPT_EXPORT_NAME {
                return self.export_name(h.len);
            }
            if h.len > MAX_OPTION_DATA {
                self.discard(u64::from(h.len))?;
                if is_known_option(h.option) {
                    self.opt_error(h.option, REP_ERR_TOO_BIG, "option data too large")?;
                } else {
                    self.opt_error(h.option, REP_ERR_UNSUP, "unsupported option")?;
                }
                continue;
            }
            self.read_payload(h.len)?;
            let data = std::mem::take(&mut self.buf);
            let phase = self.option(h.option, &data)?;
            self.buf = data;
            if let Some(phase) = phase {
                return Ok(phase);
            }
        }
        Err(NbdError::Protocol(format!("more than {MAX_OPTIONS} options")))
    }

    /// See [`refuse`].
    fn refuse(&mut self, message: &str) -> Result<(), NbdError> {
        self.send(&proto::greeting())?;
        let mut flags = [0u8; 4];
        if !self.read_or_eof(&mut flags)? {
            return Ok(());
        }
        proto::parse_client_flags(&flags)?;
        for _ in 0..REFUSAL_OPTIONS {
            let mut header = [0u8; OPTION_HEADER_SIZE];
            if !self.read_or_eof(&mut header)? {
                return Ok(());
            }
            let h = proto::parse_option_header(&header)?;
            if h.option == OPT_EXPORT_NAME || h.len > MAX_OPTION_DATA {
                return Ok(());
            }
            self.discard(u64::from(h.len))?;
            if h.option == OPT_ABORT {
                // Best effort, as in the handshake.
                let _ = self.opt_reply(OPT_ABORT, REP_ACK, &[]);
                return Ok(());
            }
            self.opt_error(h.option, REP_ERR_SHUTDOWN, message)?;
        }
        Ok(())
    }

    /// `NBD_OPT_EXPORT_NAME`: no error reply is possible, so failures drop
    /// the connection.
    fn export_name(&mut self, len: u32) -> Result<Phase, NbdError> {
        if to_usize(len) > MAX_STRING {
            return Err(NbdError::Protocol(format!("export name of {len} bytes")));
        }
        self.read_payload(len)?;
        let Some(i) = self.exports.find(&self.buf) else {
            return Err(NbdError::Protocol(format!("unknown export {:?}", String::from_utf8_lossy(&self.buf))));
        };
        let size = self.exports.entry(i).export.device.size();
        let reply = proto::export_name_reply(size, self.transmission_flags(), self.no_zeroes);
        self.send(&reply)?;
        Ok(Phase::Transmit(self.enter(i)))
    }

    /// Entering transmission on export `i`: the metadata context selection
    /// only holds for the export it was made for.
    fn enter(&mut self, i: usize) -> usize {
        if self.meta != Some(i) {
            self.meta = None;
        }
        i
    }

    /// Handles one option other than ABORT and EXPORT_NAME.
    fn option(&mut self, option: u32, data: &[u8]) -> Result<Option<Phase>, NbdError> {
        match option {
            OPT_LIST => {
                if !data.is_empty() {
                    self.opt_error(option, REP_ERR_INVALID, "NBD_OPT_LIST takes no data")?;
                    return Ok(None);
                }
                let mut out = Vec::new();
                for e in self.exports.iter() {
                    let d = proto::prefixed(e.name.as_bytes(), e.description.as_bytes());
                    proto::option_reply(&mut out, option, REP_SERVER, &d);
                }
                proto::option_reply(&mut out, option, REP_ACK, &[]);
                self.send(&out)?;
            }
            OPT_INFO | OPT_GO => return self.info(option, data),
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    self.opt_error(option, REP_ERR_INVALID, "NBD_OPT_STRUCTURED_REPLY takes no data")?;
                } else {
                    self.structured = true;
                    self.opt_reply(option, REP_ACK, &[])?;
                }
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => self.meta_context(option, data)?,
            OPT_STARTTLS => self.opt_error(option, REP_ERR_UNSUP, "TLS is not supported")?,
            _ => self.opt_error(option, REP_ERR_UNSUP, "unsupported option")?,
        }
        Ok(None)
    }

    /// `NBD_OPT_INFO` / `NBD_OPT_GO`.
    fn info(&mut self, option: u32, data: &[u8]) -> Result<Option<Phase>, NbdError> {
        let req = match proto::parse_info_request(data) {
            Ok(r) => r,
            Err(e) => {
                self.opt_error(option, REP_ERR_INVALID, &e.to_string())?;
                return Ok(None);
            }
        };
        let Some(i) = self.exports.find(req.name) else {
            let msg = format!("no export named {:?}", String::from_utf8_lossy(req.name));
            self.opt_error(option, REP_ERR_UNKNOWN, &msg)?;
            return Ok(None);
        };
        let export = &self.exports.entry(i).export;
        let mut out = Vec::new();
        proto::option_reply(
            &mut out,
            option,
            REP_INFO,
            &proto::info_export(export.device.size(), self.transmission_flags()),
        );
        if req.requests.contains(&INFO_NAME) {
            proto::option_reply(&mut out, option, REP_INFO, &proto::info_string(INFO_NAME, export.name.as_bytes()));
        }
        if req.requests.contains(&INFO_DESCRIPTION) && !export.description.is_empty() {
            let d = proto::info_string(INFO_DESCRIPTION, export.description.as_bytes());
            proto::option_reply(&mut out, option, REP_INFO, &d);
        }
        // Sent unrequested: with the default maximum these are the protocol
        // defaults, and clients that did not ask may still honour them.
        proto::option_reply(&mut out, option, REP_INFO, &proto::info_block_size(self.limits.max_block));
        proto::option_reply(&mut out, option, REP_ACK, &[]);
        self.send(&out)?;
        Ok((option == OPT_GO).then(|| Phase::Transmit(self.enter(i))))
    }

    /// `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT` with the one
    /// context `base:allocation`.
    fn meta_context(&mut self, option: u32, data: &[u8]) -> io::Result<()> {
        let set = option == OPT_SET_META_CONTEXT;
        if set {
            // SET replaces the selection even when it fails.
            self.meta = None;
            if !self.structured {
                return self.opt_error(option, REP_ERR_INVALID, "negotiate structured replies first");
            }
        }
        let req = match proto::parse_meta_request(data) {
            Ok(r) => r,
            Err(e) => return self.opt_error(option, REP_ERR_INVALID, &e.to_string()),
        };
        let Some(i) = self.exports.find(req.export) else {
            let msg = format!("no export named {:?}", String::from_utf8_lossy(req.export));
            return self.opt_error(option, REP_ERR_UNKNOWN, &msg);
        };
        let selected = if set {
            req.queries.iter().any(|q| proto::meta_query_selects_allocation(q, false))
        } else {
            req.queries.is_empty() || req.queries.iter().any(|q| proto::meta_query_selects_allocation(q, true))
        };
        let mut out = Vec::new();
        if selected {
            let id = if set { META_ID_BASE_ALLOCATION } else { 0 };
            proto::option_reply(&mut out, option, REP_META_CONTEXT, &proto::meta_context(id, META_BASE_ALLOCATION));
            if set {
                self.meta = Some(i);
            }
        }
        proto::option_reply(&mut out, option, REP_ACK, &[]);
        self.send(&out)
    }

    // ---- transmission ----

    fn transmit(&mut self, i: usize) -> Result<SessionEnd, NbdError> {
        let exports = self.exports;
        let entry = exports.entry(i);
        bump(&entry.counters.connections, 1);
        bump(&entry.counters.active, 1);
        struct Active<'e>(&'e ExportEntry);
        impl Drop for Active<'_> {
            fn drop(&mut self) {
                self.0.counters.active.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
        let _active = Active(entry);
        loop {
            // Waiting for a request: the idle timeout, if any, applies, and
            // the slot may be reclaimed for a new client.
            if let Some(w) = self.limits.watch {
                w.idle();
            }
            if let Some(p) = self.limits.park {
                let state = crate::park::SessionState {
                    export: i,
                    structured: self.structured,
                    no_zeroes: self.no_zeroes,
                    meta: self.meta,
                };
                if self.io.buffer().is_empty() && !p.parking.before_request(p, state) {
                    return Ok(SessionEnd::HandedOver);
                }
            }
            if !self.wait_message()? {
                return Ok(SessionEnd::Closed);
            }
            // Fails once the slot was reclaimed (the socket is being cut).
            if !self.arm(Timer::Request, self.limits.transfer) {
                return Ok(SessionEnd::Closed);
            }
            let mut header = [0u8; REQUEST_SIZE];
            self.io.read_exact(&mut header)?;
            // A write arms the deadline again for its payload.
            self.disarm();
            let req = proto::parse_request(&header)?;
            match req.command {
                CMD_DISC => {
                    bump(&entry.counters.disconnects, 1);
                    return Ok(SessionEnd::Disconnected);
                }
                CMD_READ => self.cmd_read(entry, &req)?,
                CMD_WRITE => self.cmd_write(entry, &req)?,
                CMD_FLUSH => self.cmd_flush(entry, &req)?,
                CMD_TRIM => self.cmd_trim(entry, &req)?,
                CMD_WRITE_ZEROES => self.cmd_write_zeroes(entry, &req)?,
                CMD_BLOCK_STATUS => self.cmd_block_status(i, entry, &req)?,
                other => {
                    bump(&entry.counters.unsupported, 1);
                    let msg = format!("command {} ({other}) is not supported", proto::command_name(other));
                    self.reply_err(entry, &req, NBD_EINVAL, &msg)?;
                }
            }
        }
    }

    /// Success without payload.
    fn reply_ok(&mut self, req: &Request) -> io::Result<()> {
        if self.structured {
            self.send(&proto::structured_header(REPLY_FLAG_DONE, REPLY_TYPE_NONE, req.cookie, 0))
        } else {
            self.send(&proto::simple_reply(0, req.cookie))
        }
    }

    /// An error: a simple reply, or an error chunk with `message` when
    /// structured replies were negotiated.
    fn reply_err(&mut self, entry: &ExportEntry, req: &Request, error: u32, message: &str) -> io::Result<()> {
        bump(&entry.counters.errors, 1);
        if self.structured {
            self.send(&proto::error_chunk(req.cookie, error, message))
        } else {
            self.send(&proto::simple_reply(error, req.cookie))
        }
    }

    fn bad_flags(&mut self, entry: &ExportEntry, req: &Request, allowed: u16) -> io::Result<bool> {
        if req.flags & !allowed == 0 {
            return Ok(false);
        }
        let msg = format!("flags {:#x} are not valid for {}", req.flags & !allowed, proto::command_name(req.command));
        self.reply_err(entry, req, NBD_EINVAL, &msg)?;
        Ok(true)
    }

    fn out_of_range(&mut self, entry: &ExportEntry, req: &Request, error: u32) -> io::Result<bool> {
        let size = entry.export.device.size();
        if in_range(req.offset, req.len, size) {
            return Ok(false);
        }
        let msg = format!("range {}+{} is beyond the export size {size}", req.offset, req.len);
        self.reply_err(entry, req, error, &msg)?;
        Ok(true)
    }

    /// Replies to a write-type command after the device call, flushing
    /// first when the client asked for FUA.
    fn finish_write(
        &mut self,
        entry: &ExportEntry,
        req: &Request,
        result: Result<(), BlockError>,
        bytes: &std::sync::atomic::AtomicU64,
    ) -> io::Result<()> {
        let result =
            result.and_then(|()| if req.flags & CMD_FLAG_FUA != 0 { entry.export.device.flush() } else { Ok(()) });
        match result {
            Ok(()) => {
                bump(bytes, u64::from(req.len));
                self.reply_ok(req)
            }
            Err(e) => self.reply_err(entry, req, block_errno(&e), &e.to_string()),
        }
    }

    fn cmd_read(&mut self, entry: &ExportEntry, req: &Request) -> Result<(), NbdError> {
        bump(&entry.counters.reads, 1);
        let allowed = if self.structured { CMD_FLAG_FUA | CMD_FLAG_DF } else { CMD_FLAG_FUA };
        if self.bad_flags(entry, req, allowed)? {
            return Ok(());
        }
        if req.len > self.limits.max_block {
            let msg = format!("read of {} bytes exceeds the maximum block size {}", req.len, self.limits.max_block);
            return Ok(self.reply_err(entry, req, NBD_EINVAL, &msg)?);
        }
        if self.out_of_range(entry, req, NBD_EINVAL)? {
            return Ok(());
        }
        if req.len == 0 {
            return Ok(self.reply_ok(req)?);
        }
        let head = if self.structured { READ_REPLY_HEAD } else { SIMPLE_REPLY_SIZE };
        let piece = to_usize(req.len.min(CHUNK));
        self.with_buffer(entry, req, head + piece, |s| s.read_reply(entry, req, head))
    }

    /// Reads the data a chunk at a time into `self.buf` (the first after
    /// `head` bytes of reply header) and sends it, within the reply's
    /// deadline. One reply, one structured chunk: an error on the first
    /// piece is an error reply, on a later one (the header is out) a hard
    /// disconnect, as the protocol asks.
    fn read_reply(&mut self, entry: &ExportEntry, req: &Request, head: usize) -> Result<(), NbdError> {
        let device = &entry.export.device;
        let len = to_usize(req.len);
        let first = len.min(to_usize(CHUNK));
        self.buf.clear();
        self.buf.resize(head + first, 0);
        if let Err(e) = device.read_at(&mut self.buf[head..], req.offset) {
            return Ok(self.reply_err(entry, req, block_errno(&e), &e.to_string())?);
        }
        if self.structured {
            let h = proto::structured_header(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, req.cookie, req.len + 8);
            self.buf[..STRUCTURED_HEADER_SIZE].copy_from_slice(&h);
            self.buf[STRUCTURED_HEADER_SIZE..head].copy_from_slice(&req.offset.to_be_bytes());
        } else {
            self.buf[..head].copy_from_slice(&proto::simple_reply(0, req.cookie));
        }
        bump(&entry.counters.bytes_read, len64(first));
        self.arm(Timer::Reply, self.transfer_time(len));
        self.send_buf()?;
        let mut done = first;
        while done < len {
            let n = (len - done).min(to_usize(CHUNK));
            let at = req.offset + len64(done);
            let piece = &mut self.buf[..n];
            if let Err(e) = paused(self.limits.watch, Timer::Reply, || device.read_at(piece, at)) {
                bump(&entry.counters.errors, 1);
                return Err(NbdError::Io(io::Error::other(format!("read at {at} after {done} bytes sent: {e}"))));
            }
            bump(&entry.counters.bytes_read, len64(n));
            let w = self.io.get_mut();
            w.write_all(&self.buf[..n])?;
            w.flush()?;
            done += n;
        }
        self.disarm();
        Ok(())
    }

    fn cmd_write(&mut self, entry: &ExportEntry, req: &Request) -> Result<(), NbdError> {
        bump(&entry.counters.writes, 1);
        if req.len > MAX_PAYLOAD {
            // Beyond the protocol's limit: a hard disconnect.
            return Err(NbdError::Protocol(format!("write of {} bytes exceeds the maximum payload", req.len)));
        }
        let too_big = req.len > self.limits.max_block;
        if too_big || req.flags & !CMD_FLAG_FUA != 0 || !in_range(req.offset, req.len, entry.export.device.size()) {
            // Skipped without buffering, so the stream stays in sync.
            self.arm(Timer::Request, self.transfer_time(to_usize(req.len)));
            self.discard(u64::from(req.len))?;
            self.disarm();
            if too_big {
                let max = self.limits.max_block;
                let msg = format!("write of {} bytes exceeds the maximum block size {max}", req.len);
                self.reply_err(entry, req, NBD_EINVAL, &msg)?;
            } else if !self.bad_flags(entry, req, CMD_FLAG_FUA)? {
                self.out_of_range(entry, req, NBD_ENOSPC)?;
            }
            return Ok(());
        }
        let piece = to_usize(req.len.min(CHUNK));
        let result = match self.with_buffer(entry, req, piece, |s| s.write_payload(entry, req)) {
            Err(e) if self.fired(Timer::Request) => {
                // The payload did not arrive in time: the accept loop shut
                // the socket for reading. Say so (best effort) and close.
                let ms = self.transfer_time(to_usize(req.len)).as_millis();
                let _ = self.reply_err(entry, req, NBD_EIO, &format!("write payload not received within {ms} ms"));
                return Err(e);
            }
            r => r?,
        };
        self.finish_write(entry, req, result, &entry.counters.bytes_written)?;
        Ok(())
    }

    /// Receives a write's payload a chunk at a time, within its deadline,
    /// and stores each chunk; after a device error the rest is received
    /// and dropped. Returns the device's result.
    fn write_payload(&mut self, entry: &ExportEntry, req: &Request) -> Result<Result<(), BlockError>, NbdError> {
        let len = to_usize(req.len);
        let mut result = Ok(());
        let mut done = 0;
        self.arm(Timer::Request, self.transfer_time(len));
        while done < len {
            let n = (len - done).min(to_usize(CHUNK));
            self.read_payload(u32::try_from(n).unwrap_or(CHUNK))?;
            if result.is_ok() {
                let at = req.offset + len64(done);
                let buf = &self.buf;
                result = paused(self.limits.watch, Timer::Request, || entry.export.device.write_at(buf, at));
            }
            done += n;
        }
        self.disarm();
        Ok(result)
    }

    fn cmd_flush(&mut self, entry: &ExportEntry, req: &Request) -> io::Result<()> {
        bump(&entry.counters.flushes, 1);
        if self.bad_flags(entry, req, CMD_FLAG_FUA)? {
            return Ok(());
        }
        match entry.export.device.flush() {
            Ok(()) => self.reply_ok(req),
            Err(e) => self.reply_err(entry, req, block_errno(&e), &e.to_string()),
        }
    }

    fn cmd_trim(&mut self, entry: &ExportEntry, req: &Request) -> io::Result<()> {
        bump(&entry.counters.trims, 1);
        if self.bad_flags(entry, req, CMD_FLAG_FUA)? || self.out_of_range(entry, req, NBD_EINVAL)? {
            return Ok(());
        }
        let result = entry.export.device.trim(req.offset, u64::from(req.len));
        self.finish_write(entry, req, result, &entry.counters.bytes_trimmed)
    }

    /// `NBD_CMD_WRITE_ZEROES`. Without `NO_HOLE` the range is freed (it reads
    /// as zeros). With `NO_HOLE` zeros are written as data, so the range
    /// stays allocated (`base:allocation` reports no hole); the store keeps
    /// such pages as same-filled entries that take no pool memory.
    fn cmd_write_zeroes(&mut self, entry: &ExportEntry, req: &Request) -> io::Result<()> {
        bump(&entry.counters.write_zeroes, 1);
        if self.bad_flags(entry, req, CMD_FLAG_FUA | CMD_FLAG_NO_HOLE)? || self.out_of_range(entry, req, NBD_ENOSPC)? {
            return Ok(());
        }
        let device = &entry.export.device;
        let result = if req.flags & CMD_FLAG_NO_HOLE != 0 {
            let end = req.offset + u64::from(req.len);
            let mut pos = req.offset;
            let mut r = Ok(());
            while pos < end && r.is_ok() {
                let n = usize::try_from(end - pos).map_or(ZEROS.len(), |left| left.min(ZEROS.len()));
                r = device.write_at(&ZEROS[..n], pos);
                pos += len64(n);
            }
            r
        } else {
            device.write_zeroes(req.offset, u64::from(req.len))
        };
        self.finish_write(entry, req, result, &entry.counters.bytes_zeroed)
    }

    /// `NBD_CMD_BLOCK_STATUS` on `base:allocation`: holes are reported as
    /// `HOLE|ZERO`, stored pages as 0.
    fn cmd_block_status(&mut self, i: usize, entry: &ExportEntry, req: &Request) -> Result<(), NbdError> {
        bump(&entry.counters.block_status, 1);
        if !self.structured || self.meta != Some(i) {
            return Ok(self.reply_err(entry, req, NBD_EINVAL, "base:allocation was not negotiated for this export")?);
        }
        if self.bad_flags(entry, req, CMD_FLAG_FUA | CMD_FLAG_REQ_ONE)? {
            return Ok(());
        }
        if req.len == 0 {
            return Ok(self.reply_err(entry, req, NBD_EINVAL, "block status of an empty range")?);
        }
        if self.out_of_range(entry, req, NBD_EINVAL)? {
            return Ok(());
        }
        let len = u64::from(req.len).min(BLOCK_STATUS_MAX);
        let extents = match entry.export.device.extents(req.offset, len) {
            Ok(x) => x,
            Err(e) => return Ok(self.reply_err(entry, req, block_errno(&e), &e.to_string())?),
        };
        // The chunk's payload stays within the maximum block size and a
        // buffer chunk.
        let fit = (to_usize(self.limits.max_block.min(CHUNK)).saturating_sub(4) / 8).max(1);
        let limit = if req.flags & CMD_FLAG_REQ_ONE != 0 { 1 } else { MAX_EXTENTS.min(fit) };
        let n = STRUCTURED_HEADER_SIZE + 4 + 8 * extents.len().clamp(1, limit);
        self.with_buffer(entry, req, n, |s| s.block_status_reply(req, len, extents, limit))
    }

    /// Builds the block status chunk of at most `limit` descriptors for
    /// `[req.offset, +len)` in `self.buf` and sends it.
    fn block_status_reply(
        &mut self,
        req: &Request,
        len: u64,
        extents: Vec<Extent>,
        limit: usize,
    ) -> Result<(), NbdError> {
        self.buf.clear();
        self.buf.resize(STRUCTURED_HEADER_SIZE, 0);
        self.buf.extend_from_slice(&META_ID_BASE_ALLOCATION.to_be_bytes());
        let mut count = 0usize;
        let mut covered = 0u64;
        for x in extents.iter().filter(|x| x.len > 0) {
            if count == limit || covered >= len {
                break;
            }
            // Clip to the queried range; extents are contiguous from `offset`.
            let Ok(n) = u32::try_from(x.len.min(len - covered)) else { break };
            let flags = if x.hole { STATE_HOLE | STATE_ZERO } else { 0 };
            self.buf.extend_from_slice(&n.to_be_bytes());
            self.buf.extend_from_slice(&flags.to_be_bytes());
            count += 1;
            covered += u64::from(n);
        }
        if count == 0 {
            // The device gave nothing usable: "allocated, contents unknown".
            let n = u32::try_from(len).unwrap_or(u32::MAX);
            self.buf.extend_from_slice(&n.to_be_bytes());
            self.buf.extend_from_slice(&0u32.to_be_bytes());
        }
        drop(extents);
        let payload = u32::try_from(self.buf.len() - STRUCTURED_HEADER_SIZE).unwrap_or(u32::MAX);
        let h = proto::structured_header(REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, req.cookie, payload);
        self.buf[..STRUCTURED_HEADER_SIZE].copy_from_slice(&h);
        self.arm(Timer::Reply, self.transfer_time(self.buf.len()));
        self.send_buf()?;
        self.disarm();
        Ok(())
    }
}
