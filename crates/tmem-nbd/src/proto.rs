//! NBD wire format: constants, pure parsers for what the client sends
//! (client flags, option headers and option payloads, request headers) and
//! encoders for what the server sends.
//!
//! Every parser works on a byte slice and returns a [`Result`]; none of them
//! panics or allocates in proportion to a length field, so they can be fed
//! arbitrary input (see the `nbd_request` fuzz target). The numbers follow
//! the protocol document `doc/proto.md` of the NetworkBlockDevice project.

/// `NBDMAGIC`, the first 8 bytes the server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: newstyle negotiation magic, also prefixes every option.
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// Magic of every option reply.
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of a transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Handshake flag: fixed newstyle negotiation.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flag: the client may ask us to skip the 124 zero bytes.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flag: the client speaks fixed newstyle.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag: no 124 zero bytes after `NBD_OPT_EXPORT_NAME`.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Transmission flag: always set.
pub const FLAG_HAS_FLAGS: u16 = 1 << 0;
/// Transmission flag: the export is read-only.
pub const FLAG_READ_ONLY: u16 = 1 << 1;
/// Transmission flag: `NBD_CMD_FLUSH` is supported.
pub const FLAG_SEND_FLUSH: u16 = 1 << 2;
/// Transmission flag: `NBD_CMD_FLAG_FUA` is supported.
pub const FLAG_SEND_FUA: u16 = 1 << 3;
/// Transmission flag: rotational medium.
pub const FLAG_ROTATIONAL: u16 = 1 << 4;
/// Transmission flag: `NBD_CMD_TRIM` is supported.
pub const FLAG_SEND_TRIM: u16 = 1 << 5;
/// Transmission flag: `NBD_CMD_WRITE_ZEROES` (and `NO_HOLE`) is supported.
pub const FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// Transmission flag: `NBD_CMD_FLAG_DF` is supported (structured replies only).
pub const FLAG_SEND_DF: u16 = 1 << 7;
/// Transmission flag: several connections may share the export.
pub const FLAG_CAN_MULTI_CONN: u16 = 1 << 8;
/// Transmission flag: `NBD_CMD_CACHE` is supported.
pub const FLAG_SEND_CACHE: u16 = 1 << 10;
/// Transmission flag: `NBD_CMD_FLAG_FAST_ZERO` is supported.
pub const FLAG_SEND_FAST_ZERO: u16 = 1 << 11;

/// Option: choose an export and enter transmission (no error reply possible).
pub const OPT_EXPORT_NAME: u32 = 1;
/// Option: abort the negotiation.
pub const OPT_ABORT: u32 = 2;
/// Option: list the exports.
pub const OPT_LIST: u32 = 3;
/// Option: start TLS (not supported here).
pub const OPT_STARTTLS: u32 = 5;
/// Option: describe an export.
pub const OPT_INFO: u32 = 6;
/// Option: describe an export and enter transmission.
pub const OPT_GO: u32 = 7;
/// Option: use structured replies.
pub const OPT_STRUCTURED_REPLY: u32 = 8;
/// Option: list metadata contexts.
pub const OPT_LIST_META_CONTEXT: u32 = 9;
/// Option: select metadata contexts.
pub const OPT_SET_META_CONTEXT: u32 = 10;
/// Option: extended headers (experimental; not supported here).
pub const OPT_EXTENDED_HEADERS: u32 = 11;

/// Option reply: success / end of a list.
pub const REP_ACK: u32 = 1;
/// Option reply: one export of `NBD_OPT_LIST`.
pub const REP_SERVER: u32 = 2;
/// Option reply: one piece of export information.
pub const REP_INFO: u32 = 3;
/// Option reply: one metadata context.
pub const REP_META_CONTEXT: u32 = 4;
/// Option error: unknown option.
pub const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
/// Option error: refused by policy.
pub const REP_ERR_POLICY: u32 = (1 << 31) + 2;
/// Option error: syntactically or semantically invalid.
pub const REP_ERR_INVALID: u32 = (1 << 31) + 3;
/// Option error: not supported on this platform.
pub const REP_ERR_PLATFORM: u32 = (1 << 31) + 4;
/// Option error: TLS required.
pub const REP_ERR_TLS_REQD: u32 = (1 << 31) + 5;
/// Option error: no such export.
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
/// Option error: the server is shutting down.
pub const REP_ERR_SHUTDOWN: u32 = (1 << 31) + 7;
/// Option error: block size information must be requested.
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = (1 << 31) + 8;
/// Option error: request or reply too large.
pub const REP_ERR_TOO_BIG: u32 = (1 << 31) + 9;

/// Information type: size and transmission flags.
pub const INFO_EXPORT: u16 = 0;
/// Information type: canonical export name.
pub const INFO_NAME: u16 = 1;
/// Information type: export description.
pub const INFO_DESCRIPTION: u16 = 2;
/// Information type: block size constraints.
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Command flag: force unit access.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
/// Command flag (`WRITE_ZEROES`): do not punch a hole.
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
/// Command flag (`READ`): at most one content chunk.
pub const CMD_FLAG_DF: u16 = 1 << 2;
/// Command flag (`BLOCK_STATUS`): one extent per context.
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
/// Command flag (`WRITE_ZEROES`): fail unless faster than a write.
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

/// Command: read.
pub const CMD_READ: u16 = 0;
/// Command: write (payload follows the header).
pub const CMD_WRITE: u16 = 1;
/// Command: disconnect (no reply).
pub const CMD_DISC: u16 = 2;
/// Command: flush.
pub const CMD_FLUSH: u16 = 3;
/// Command: trim (discard).
pub const CMD_TRIM: u16 = 4;
/// Command: cache (prefetch; not supported here).
pub const CMD_CACHE: u16 = 5;
/// Command: write zeroes.
pub const CMD_WRITE_ZEROES: u16 = 6;
/// Command: block status.
pub const CMD_BLOCK_STATUS: u16 = 7;

/// Structured reply flag: last chunk of the reply.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
/// Chunk type: nothing (final chunk).
pub const REPLY_TYPE_NONE: u16 = 0;
/// Chunk type: data at an offset.
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
/// Chunk type: hole at an offset.
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
/// Chunk type: block status descriptors of one context.
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
/// Chunk type: error with message.
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;
/// Chunk type: error at an offset.
pub const REPLY_TYPE_ERROR_OFFSET: u16 = (1 << 15) + 2;

/// NBD error: operation not permitted.
pub const NBD_EPERM: u32 = 1;
/// NBD error: I/O error.
pub const NBD_EIO: u32 = 5;
/// NBD error: out of memory.
pub const NBD_ENOMEM: u32 = 12;
/// NBD error: invalid argument.
pub const NBD_EINVAL: u32 = 22;
/// NBD error: no space left.
pub const NBD_ENOSPC: u32 = 28;
/// NBD error: value too large.
pub const NBD_EOVERFLOW: u32 = 75;
/// NBD error: operation not supported.
pub const NBD_ENOTSUP: u32 = 95;
/// NBD error: server shutting down.
pub const NBD_ESHUTDOWN: u32 = 108;

/// `base:allocation` flag: the extent is not allocated.
pub const STATE_HOLE: u32 = 1 << 0;
/// `base:allocation` flag: the extent reads as zeros.
pub const STATE_ZERO: u32 = 1 << 1;

/// The one metadata context this server knows.
pub const META_BASE_ALLOCATION: &str = "base:allocation";
/// Context id of `base:allocation` after `NBD_OPT_SET_META_CONTEXT`.
pub const META_ID_BASE_ALLOCATION: u32 = 1;

/// Advertised minimum block size.
pub const MIN_BLOCK_SIZE: u32 = 1;
/// Advertised preferred block size.
pub const PREFERRED_BLOCK_SIZE: u32 = 4096;
/// The protocol's maximum payload of a read or write, 32 MiB: the default
/// maximum block size and the largest one the server accepts.
pub const MAX_PAYLOAD: u32 = 32 << 20;
/// Longest string (export name, query, message) the protocol allows.
pub const MAX_STRING: usize = 4096;

/// Size of a request header on the wire.
pub const REQUEST_SIZE: usize = 28;
/// Size of an option header on the wire.
pub const OPTION_HEADER_SIZE: usize = 16;
/// Size of a simple reply header.
pub const SIMPLE_REPLY_SIZE: usize = 16;
/// Size of a structured reply chunk header.
pub const STRUCTURED_HEADER_SIZE: usize = 20;

/// What a parser rejected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    /// The input is shorter than the structure.
    #[error("truncated: need {need} bytes, have {have}")]
    Truncated {
        /// Bytes needed.
        need: usize,
        /// Bytes available.
        have: usize,
    },
    /// A magic number is wrong.
    #[error("bad magic {0:#x}")]
    BadMagic(u64),
    /// The client set flags the server does not know.
    #[error("unknown client flags {0:#x}")]
    UnknownClientFlags(u32),
    /// An embedded length does not fit the enclosing data.
    #[error("inconsistent length: {0}")]
    BadLength(&'static str),
    /// A string is longer than the protocol allows.
    #[error("string of {0} bytes exceeds the 4096-byte limit")]
    StringTooLong(usize),
}

/// The fixed-size headers as they are on the wire (big-endian, unaligned),
/// read and written with `zerocopy`; the variable-length option data is
/// parsed field by field with [`Reader`].
mod wire {
    use zerocopy::byteorder::network_endian::{U16, U32, U64};
    use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

    /// Option header: `IHAVEOPT`, option, data length (16 bytes).
    #[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
    #[repr(C)]
    pub struct OptionHeader {
        pub magic: U64,
        pub option: U32,
        pub len: U32,
    }

    /// Transmission request (28 bytes).
    #[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
    #[repr(C)]
    pub struct Request {
        pub magic: U32,
        pub flags: U16,
        pub command: U16,
        pub cookie: U64,
        pub offset: U64,
        pub len: U32,
    }

    /// Simple reply header (16 bytes).
    #[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
    #[repr(C)]
    pub struct SimpleReply {
        pub magic: U32,
        pub error: U32,
        pub cookie: U64,
    }

    /// Structured reply chunk header (20 bytes).
    #[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
    #[repr(C)]
    pub struct StructuredHeader {
        pub magic: U32,
        pub flags: U16,
        pub kind: U16,
        pub cookie: U64,
        pub len: U32,
    }

    /// Server greeting (18 bytes).
    #[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
    #[repr(C)]
    pub struct Greeting {
        pub nbdmagic: U64,
        pub ihaveopt: U64,
        pub flags: U16,
    }

    /// `NBD_INFO_EXPORT` payload (12 bytes).
    #[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
    #[repr(C)]
    pub struct InfoExport {
        pub kind: U16,
        pub size: U64,
        pub flags: U16,
    }

    /// `NBD_INFO_BLOCK_SIZE` payload (14 bytes).
    #[derive(FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
    #[repr(C)]
    pub struct InfoBlockSize {
        pub kind: U16,
        pub min: U32,
        pub preferred: U32,
        pub max: U32,
    }

    /// `T` read from the front of `data`, or how many bytes it needed.
    pub fn read<T: FromBytes + KnownLayout + Immutable>(data: &[u8]) -> Result<&T, usize> {
        T::ref_from_prefix(data).map(|(t, _)| t).map_err(|_| size_of::<T>())
    }
}

fn truncated(need: usize, data: &[u8]) -> ProtoError {
    ProtoError::Truncated { need, have: data.len() }
}

fn take<const N: usize>(data: &[u8], at: usize) -> Result<[u8; N], ProtoError> {
    let need = at.checked_add(N).ok_or(ProtoError::Truncated { need: usize::MAX, have: data.len() })?;
    data.get(at..need).and_then(|s| <[u8; N]>::try_from(s).ok()).ok_or(ProtoError::Truncated { need, have: data.len() })
}

fn be16(data: &[u8], at: usize) -> Result<u16, ProtoError> {
    take::<2>(data, at).map(u16::from_be_bytes)
}

fn be32(data: &[u8], at: usize) -> Result<u32, ProtoError> {
    take::<4>(data, at).map(u32::from_be_bytes)
}

/// A cursor over option data that checks every embedded length.
struct Cursor<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn new(data: &'a [u8]) -> Self {
        Self { data, pos: 0 }
    }
    fn remaining(&self) -> usize {
        self.data.len() - self.pos
    }
    fn u16(&mut self) -> Result<u16, ProtoError> {
        let v = be16(self.data, self.pos)?;
        self.pos += 2;
        Ok(v)
    }
    fn u32(&mut self) -> Result<u32, ProtoError> {
        let v = be32(self.data, self.pos)?;
        self.pos += 4;
        Ok(v)
    }
    /// A string preceded by its 32-bit length.
    fn string(&mut self, what: &'static str) -> Result<&'a [u8], ProtoError> {
        let len = usize::try_from(self.u32()?).map_err(|_| ProtoError::BadLength(what))?;
        if len > self.remaining() {
            return Err(ProtoError::BadLength(what));
        }
        if len > MAX_STRING {
            return Err(ProtoError::StringTooLong(len));
        }
        let s = &self.data[self.pos..self.pos + len];
        self.pos += len;
        Ok(s)
    }
    fn finish(&self, what: &'static str) -> Result<(), ProtoError> {
        if self.remaining() == 0 {
            Ok(())
        } else {
            Err(ProtoError::BadLength(what))
        }
    }
}

/// The client's flags after the server greeting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientFlags {
    /// `NBD_FLAG_C_FIXED_NEWSTYLE`.
    pub fixed_newstyle: bool,
    /// `NBD_FLAG_C_NO_ZEROES`.
    pub no_zeroes: bool,
}

/// Parses the 4-byte client flags; unknown bits are an error (the server
/// must then drop the connection).
pub fn parse_client_flags(data: &[u8]) -> Result<ClientFlags, ProtoError> {
    let flags = be32(data, 0)?;
    let unknown = flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
    if unknown != 0 {
        return Err(ProtoError::UnknownClientFlags(flags));
    }
    Ok(ClientFlags { fixed_newstyle: flags & FLAG_C_FIXED_NEWSTYLE != 0, no_zeroes: flags & FLAG_C_NO_ZEROES != 0 })
}

/// An option header: `IHAVEOPT`, option, length of the data that follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OptionHeader {
    /// Option number (`OPT_*`).
    pub option: u32,
    /// Length of the option data.
    pub len: u32,
}

/// Parses a 16-byte option header.
pub fn parse_option_header(data: &[u8]) -> Result<OptionHeader, ProtoError> {
    let h = wire::read::<wire::OptionHeader>(data).map_err(|need| truncated(need, data))?;
    if h.magic.get() != IHAVEOPT {
        return Err(ProtoError::BadMagic(h.magic.get()));
    }
    Ok(OptionHeader { option: h.option.get(), len: h.len.get() })
}

/// Data of `NBD_OPT_INFO` / `NBD_OPT_GO`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InfoRequest<'a> {
    /// Export name; empty means the default export.
    pub name: &'a [u8],
    /// Requested information types (`INFO_*`), as sent.
    pub requests: Vec<u16>,
}

/// Parses the data of `NBD_OPT_INFO` / `NBD_OPT_GO`; it must be consumed
/// exactly.
pub fn parse_info_request(data: &[u8]) -> Result<InfoRequest<'_>, ProtoError> {
    let mut c = Cursor::new(data);
    let name = c.string("export name")?;
    let n = c.u16()?;
    if usize::from(n) * 2 != c.remaining() {
        return Err(ProtoError::BadLength("information request count"));
    }
    let mut requests = Vec::with_capacity(usize::from(n));
    for _ in 0..n {
        requests.push(c.u16()?);
    }
    c.finish("information requests")?;
    Ok(InfoRequest { name, requests })
}

/// Data of `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetaRequest<'a> {
    /// Export name; empty means the default export.
    pub export: &'a [u8],
    /// Queries, e.g. `base:allocation` or `base:`.
    pub queries: Vec<&'a [u8]>,
}

/// Parses the data of the meta context options; it must be consumed exactly
/// and every query must carry a namespace (contain a colon).
pub fn parse_meta_request(data: &[u8]) -> Result<MetaRequest<'_>, ProtoError> {
    let mut c = Cursor::new(data);
    let export = c.string("export name")?;
    let n = c.u32()?;
    // Each query takes at least its 4-byte length: bound the count by the data.
    let n = usize::try_from(n).map_err(|_| ProtoError::BadLength("query count"))?;
    if n > c.remaining() / 4 {
        return Err(ProtoError::BadLength("query count"));
    }
    let mut queries = Vec::with_capacity(n);
    for _ in 0..n {
        let q = c.string("query")?;
        if !q.contains(&b':') {
            return Err(ProtoError::BadLength("query without a namespace"));
        }
        queries.push(q);
    }
    c.finish("queries")?;
    Ok(MetaRequest { export, queries })
}

/// Does `query` select `base:allocation`? With `list` set (for
/// `NBD_OPT_LIST_META_CONTEXT`) the wildcard `base:` matches too.
pub fn meta_query_selects_allocation(query: &[u8], list: bool) -> bool {
    query == META_BASE_ALLOCATION.as_bytes() || (list && query == b"base:")
}

/// A transmission request header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// Command flags (`CMD_FLAG_*`).
    pub flags: u16,
    /// Command (`CMD_*`), possibly unknown.
    pub command: u16,
    /// Opaque cookie, echoed in the reply.
    pub cookie: u64,
    /// Byte offset.
    pub offset: u64,
    /// Length in bytes.
    pub len: u32,
}

/// Parses a 28-byte request header.
pub fn parse_request(data: &[u8]) -> Result<Request, ProtoError> {
    let w = wire::read::<wire::Request>(data).map_err(|need| truncated(need, data))?;
    if w.magic.get() != REQUEST_MAGIC {
        return Err(ProtoError::BadMagic(u64::from(w.magic.get())));
    }
    Ok(Request {
        flags: w.flags.get(),
        command: w.command.get(),
        cookie: w.cookie.get(),
        offset: w.offset.get(),
        len: w.len.get(),
    })
}

/// Encodes a request header (for clients and tests).
pub fn encode_request(r: &Request) -> [u8; REQUEST_SIZE] {
    let w = wire::Request {
        magic: REQUEST_MAGIC.into(),
        flags: r.flags.into(),
        command: r.command.into(),
        cookie: r.cookie.into(),
        offset: r.offset.into(),
        len: r.len.into(),
    };
    zerocopy::transmute!(w)
}

/// Human name of a command, for messages.
pub fn command_name(command: u16) -> &'static str {
    match command {
        CMD_READ => "READ",
        CMD_WRITE => "WRITE",
        CMD_DISC => "DISC",
        CMD_FLUSH => "FLUSH",
        CMD_TRIM => "TRIM",
        CMD_CACHE => "CACHE",
        CMD_WRITE_ZEROES => "WRITE_ZEROES",
        CMD_BLOCK_STATUS => "BLOCK_STATUS",
        _ => "unknown",
    }
}

/// The server greeting: `NBDMAGIC`, `IHAVEOPT`, handshake flags.
pub fn greeting() -> [u8; 18] {
    let g = wire::Greeting {
        nbdmagic: NBDMAGIC.into(),
        ihaveopt: IHAVEOPT.into(),
        flags: (FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).into(),
    };
    zerocopy::transmute!(g)
}

/// Appends an option reply (header and data) to `out`.
///
/// `data` must be shorter than 4 GiB; the callers build replies from
/// protocol-bounded strings.
pub fn option_reply(out: &mut Vec<u8>, option: u32, reply: u32, data: &[u8]) {
    let len = u32::try_from(data.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply.to_be_bytes());
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(data);
}

/// Length-prefixed string, as in `NBD_REP_SERVER`.
pub fn prefixed(name: &[u8], rest: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(4 + name.len() + rest.len());
    v.extend_from_slice(&u32::try_from(name.len()).unwrap_or(u32::MAX).to_be_bytes());
    v.extend_from_slice(name);
    v.extend_from_slice(rest);
    v
}

/// Payload of `NBD_INFO_EXPORT`.
pub fn info_export(size: u64, flags: u16) -> [u8; 12] {
    zerocopy::transmute!(wire::InfoExport { kind: INFO_EXPORT.into(), size: size.into(), flags: flags.into() })
}

/// Payload of `NBD_INFO_BLOCK_SIZE` with this server's constraints and the
/// maximum block size `max_block` (at most [`MAX_PAYLOAD`]).
pub fn info_block_size(max_block: u32) -> [u8; 14] {
    zerocopy::transmute!(wire::InfoBlockSize {
        kind: INFO_BLOCK_SIZE.into(),
        min: MIN_BLOCK_SIZE.into(),
        preferred: PREFERRED_BLOCK_SIZE.into(),
        max: max_block.into(),
    })
}

/// Payload of `NBD_INFO_NAME` / `NBD_INFO_DESCRIPTION`.
pub fn info_string(kind: u16, s: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(2 + s.len());
    v.extend_from_slice(&kind.to_be_bytes());
    v.extend_from_slice(s);
    v
}

/// Payload of `NBD_REP_META_CONTEXT`.
pub fn meta_context(id: u32, name: &str) -> Vec<u8> {
    let mut v = Vec::with_capacity(4 + name.len());
    v.extend_from_slice(&id.to_be_bytes());
    v.extend_from_slice(name.as_bytes());
    v
}

/// The reply to `NBD_OPT_EXPORT_NAME`: size, flags, and 124 zero bytes
/// unless the client negotiated `NBD_FLAG_C_NO_ZEROES`.
pub fn export_name_reply(size: u64, flags: u16, no_zeroes: bool) -> Vec<u8> {
    let mut v = Vec::with_capacity(134);
    v.extend_from_slice(&size.to_be_bytes());
    v.extend_from_slice(&flags.to_be_bytes());
    if !no_zeroes {
        v.resize(v.len() + 124, 0);
    }
    v
}

/// A simple reply header.
pub fn simple_reply(error: u32, cookie: u64) -> [u8; SIMPLE_REPLY_SIZE] {
    zerocopy::transmute!(wire::SimpleReply {
        magic: SIMPLE_REPLY_MAGIC.into(),
        error: error.into(),
        cookie: cookie.into()
    })
}

/// A structured reply chunk header.
pub fn structured_header(flags: u16, kind: u16, cookie: u64, len: u32) -> [u8; STRUCTURED_HEADER_SIZE] {
    zerocopy::transmute!(wire::StructuredHeader {
        magic: STRUCTURED_REPLY_MAGIC.into(),
        flags: flags.into(),
        kind: kind.into(),
        cookie: cookie.into(),
        len: len.into(),
    })
}

/// Cuts `msg` to at most `max` bytes on a character boundary.
pub fn truncate_str(msg: &str, max: usize) -> &str {
    if msg.len() <= max {
        return msg;
    }
    let mut end = max;
    while !msg.is_char_boundary(end) {
        end -= 1;
    }
    &msg[..end]
}

/// A complete `NBD_REPLY_TYPE_ERROR` chunk with the DONE flag.
pub fn error_chunk(cookie: u64, error: u32, message: &str) -> Vec<u8> {
    let msg = truncate_str(message, MAX_STRING).as_bytes();
    let msg_len = u16::try_from(msg.len()).unwrap_or(0);
    let msg = &msg[..usize::from(msg_len)];
    let len = u32::from(msg_len) + 6;
    let mut v = Vec::with_capacity(STRUCTURED_HEADER_SIZE + 6 + msg.len());
    v.extend_from_slice(&structured_header(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, cookie, len));
    v.extend_from_slice(&error.to_be_bytes());
    v.extend_from_slice(&msg_len.to_be_bytes());
    v.extend_from_slice(msg);
    v
}

/// Maps a host errno to the NBD error values (unknown ones become EIO).
pub fn nbd_errno(errno: i32) -> u32 {
    match errno {
        libc::EPERM | libc::EROFS | libc::EACCES => NBD_EPERM,
        libc::EIO => NBD_EIO,
        libc::ENOMEM => NBD_ENOMEM,
        libc::EINVAL => NBD_EINVAL,
        libc::ENOSPC | libc::EDQUOT | libc::EFBIG => NBD_ENOSPC,
        libc::EOVERFLOW => NBD_EOVERFLOW,
        libc::ENOTSUP => NBD_ENOTSUP,
        libc::ESHUTDOWN => NBD_ESHUTDOWN,
        _ => NBD_EIO,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info_data(name: &[u8], reqs: &[u16]) -> Vec<u8> {
        let mut v = prefixed(name, &[]);
        v.extend_from_slice(&u16::try_from(reqs.len()).unwrap().to_be_bytes());
        for r in reqs {
            v.extend_from_slice(&r.to_be_bytes());
        }
        v
    }

    fn meta_data(name: &[u8], queries: &[&[u8]]) -> Vec<u8> {
        let mut v = prefixed(name, &[]);
        v.extend_from_slice(&u32::try_from(queries.len()).unwrap().to_be_bytes());
        for q in queries {
            v.extend_from_slice(&prefixed(q, &[]));
        }
        v
    }

    #[test]
    fn request_round_trip() {
        let r = Request { flags: CMD_FLAG_FUA, command: CMD_WRITE, cookie: 0xdead_beef, offset: 1 << 40, len: 4096 };
        assert_eq!(parse_request(&encode_request(&r)), Ok(r));
    }

    #[test]
    fn request_rejects_bad_magic_and_short_input() {
        let mut b = encode_request(&Request { flags: 0, command: 0, cookie: 1, offset: 0, len: 1 });
        assert!(matches!(parse_request(&b[..27]), Err(ProtoError::Truncated { need: 28, have: 27 })));
        b[0] ^= 1;
        assert!(matches!(parse_request(&b), Err(ProtoError::BadMagic(_))));
        assert!(parse_request(&[]).is_err());
    }

    #[test]
    fn client_flags() {
        assert_eq!(parse_client_flags(&3u32.to_be_bytes()), Ok(ClientFlags { fixed_newstyle: true, no_zeroes: true }));
        assert_eq!(
            parse_client_flags(&0u32.to_be_bytes()),
            Ok(ClientFlags { fixed_newstyle: false, no_zeroes: false })
        );
        assert_eq!(parse_client_flags(&4u32.to_be_bytes()), Err(ProtoError::UnknownClientFlags(4)));
        assert!(parse_client_flags(&[0, 0]).is_err());
    }

    #[test]
    fn option_header() {
        let mut b = IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&OPT_GO.to_be_bytes());
        b.extend_from_slice(&7u32.to_be_bytes());
        assert_eq!(parse_option_header(&b), Ok(OptionHeader { option: OPT_GO, len: 7 }));
        b[3] = 0;
        assert!(matches!(parse_option_header(&b), Err(ProtoError::BadMagic(_))));
    }

    #[test]
    fn info_request() {
        let d = info_data(b"disk", &[INFO_NAME, INFO_BLOCK_SIZE]);
        let r = parse_info_request(&d).unwrap();
        assert_eq!(r.name, b"disk");
        assert_eq!(r.requests, vec![INFO_NAME, INFO_BLOCK_SIZE]);
        // Empty name, no requests.
        assert_eq!(parse_info_request(&info_data(b"", &[])).unwrap().name, b"");
        // Trailing byte, missing byte, name longer than the data.
        let mut long = d.clone();
        long.push(0);
        assert!(parse_info_request(&long).is_err());
        assert!(parse_info_request(&d[..d.len() - 1]).is_err());
        let mut bad = d.clone();
        bad[3] = 200;
        assert!(parse_info_request(&bad).is_err());
        assert!(parse_info_request(&[0xff; 4]).is_err());
        assert!(parse_info_request(&[]).is_err());
    }

    #[test]
    fn meta_request() {
        let d = meta_data(b"", &[b"base:allocation", b"qemu:dirty-bitmap:x"]);
        let r = parse_meta_request(&d).unwrap();
        assert_eq!(r.export, b"");
        assert_eq!(r.queries, vec![&b"base:allocation"[..], b"qemu:dirty-bitmap:x"]);
        assert!(parse_meta_request(&meta_data(b"x", &[b"nocolon"])).is_err());
        assert!(parse_meta_request(&d[..d.len() - 1]).is_err());
        // A huge query count with no data must not allocate or succeed.
        let mut huge = prefixed(b"", &[]);
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(parse_meta_request(&huge).is_err());
        assert!(meta_query_selects_allocation(b"base:allocation", false));
        assert!(!meta_query_selects_allocation(b"base:", false));
        assert!(meta_query_selects_allocation(b"base:", true));
        assert!(!meta_query_selects_allocation(b"base:other", true));
    }

    #[test]
    fn encoders() {
        let mut out = Vec::new();
        option_reply(&mut out, OPT_LIST, REP_ACK, &[]);
        assert_eq!(out.len(), 20);
        assert_eq!(&out[..8], &OPT_REPLY_MAGIC.to_be_bytes());
        assert_eq!(export_name_reply(1, 1, false).len(), 134);
        assert_eq!(export_name_reply(1, 1, true).len(), 10);
        let e = error_chunk(9, NBD_EINVAL, &"x".repeat(10_000));
        assert_eq!(e.len(), 20 + 6 + 4096);
        assert_eq!(u32::from_be_bytes(e[16..20].try_into().unwrap()), 4096 + 6);
        assert_eq!(truncate_str("aé", 2), "a");
        assert_eq!(nbd_errno(libc::ENOSPC), 28);
        assert_eq!(nbd_errno(libc::EINVAL), 22);
        assert_eq!(nbd_errno(libc::EIO), 5);
        assert_eq!(nbd_errno(libc::EPERM), 1);
        assert_eq!(nbd_errno(libc::ENOMEM), 12);
        assert_eq!(nbd_errno(9999), 5);
    }
}
