//! Protocol tests with a raw-socket client: the handshake fallbacks real
//! clients cannot be told to use (no structured replies like the kernel,
//! NBD_OPT_EXPORT_NAME, LIST, INFO, unknown options, ABORT), error replies,
//! malformed input, and the listener's lifecycle.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{
    be16, be32, be64, disk, eventually, go, info_data, meta_data, pool_device, start_unix, strict_pool_device, Client,
    Rng, TempDir,
};
use tmem_block::{BlockDevice, ZeroDevice};
use tmem_nbd::proto::*;
use tmem_nbd::{serve_connection, Export, Exports, Listen, NbdConfig, NbdError, NbdServer, ServerHandle, SessionEnd};

const MIB: u64 = 1 << 20;
const BOTH: u32 = FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES;

fn two_exports() -> Vec<Export> {
    vec![
        Export::new("disk", pool_device("disk", 16 * MIB) as Arc<dyn BlockDevice>).with_description("test disk"),
        Export::new("zero", Arc::new(ZeroDevice::new(MIB)) as Arc<dyn BlockDevice>),
    ]
}

/// A kernel-like client: fixed newstyle, NBD_OPT_GO without structured
/// replies, then only simple replies — including for errors, which must
/// not end the session.
#[test]
fn simple_replies_without_structured_reply() {
    let dir = TempDir::new("simple");
    let dev = pool_device("disk", 16 * MIB);
    let server = start_unix(&dir, disk(Arc::clone(&dev)));
    let mut c = Client::unix(&dir.join("nbd.sock"));
    c.start(BOTH);
    let (size, flags) = go(&mut c, "");
    assert_eq!(size, 16 * MIB);
    let want = FLAG_HAS_FLAGS
        | FLAG_SEND_FLUSH
        | FLAG_SEND_FUA
        | FLAG_SEND_TRIM
        | FLAG_SEND_WRITE_ZEROES
        | FLAG_CAN_MULTI_CONN;
    assert_eq!(flags, want, "no SEND_DF without structured replies");

    let data: Vec<u8> = (0..10_000u32).map(|i| u8::try_from(i % 251).unwrap()).collect();
    c.request(CMD_WRITE, CMD_FLAG_FUA, 1, 4097, 10_000, &data);
    assert_eq!(c.simple(0), (0, 1, vec![]));
    c.request(CMD_READ, 0, 2, 4097, 10_000, &[]);
    assert_eq!(c.simple(10_000), (0, 2, data.clone()));

    // Errors: simple replies with NBD errnos, and the session goes on.
    c.request(CMD_READ, 0, 3, 16 * MIB - 10, 11, &[]);
    assert_eq!(c.simple(11).0, NBD_EINVAL, "read past the end");
    c.request(CMD_READ, 0, 4, u64::MAX - 1, 4096, &[]);
    assert_eq!(c.simple(4096).0, NBD_EINVAL, "offset overflow");
    c.request(CMD_WRITE, 0, 5, 16 * MIB - 1, 2, &[1, 2]);
    assert_eq!(c.simple(0).0, NBD_ENOSPC, "write past the end");
    c.request(CMD_TRIM, 0, 6, 16 * MIB, 1, &[]);
    assert_eq!(c.simple(0).0, NBD_EINVAL, "trim past the end");
    c.request(CMD_WRITE_ZEROES, 0, 7, 16 * MIB, 4096, &[]);
    assert_eq!(c.simple(0).0, NBD_ENOSPC, "write zeroes past the end");
    c.request(CMD_READ, 0, 8, 0, MAX_PAYLOAD + 1, &[]);
    assert_eq!(c.simple(0).0, NBD_EINVAL, "oversized read is an error, not a disconnect");
    c.request(CMD_BLOCK_STATUS, 0, 9, 0, 4096, &[]);
    assert_eq!(c.simple(0).0, NBD_EINVAL, "block status needs structured replies");
    c.request(CMD_CACHE, 0, 10, 0, 4096, &[]);
    assert_eq!(c.simple(0).0, NBD_EINVAL, "NBD_CMD_CACHE is not supported");
    c.request(77, 0, 11, 0, 0, &[]);
    assert_eq!(c.simple(0).0, NBD_EINVAL, "unknown command");
    c.request(CMD_READ, CMD_FLAG_DF, 12, 0, 512, &[]);
    assert_eq!(c.simple(512).0, NBD_EINVAL, "DF is not valid without structured replies");
    c.request(CMD_WRITE, CMD_FLAG_REQ_ONE, 13, 0, 3, &[9, 9, 9]);
    assert_eq!(c.simple(0).0, NBD_EINVAL, "invalid flag on write (payload skipped)");
    c.request(CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO, 14, 0, 4096, &[]);
    assert_eq!(c.simple(0).0, NBD_EINVAL, "FAST_ZERO was not advertised");

    // Flush, trim, write zeroes (with and without NO_HOLE), zero-length ops.
    c.request(CMD_FLUSH, 0, 20, 0, 0, &[]);
    assert_eq!(c.simple(0), (0, 20, vec![]));
    c.request(CMD_TRIM, CMD_FLAG_FUA, 21, 4096, 4096, &[]);
    assert_eq!(c.simple(0).0, 0);
    c.request(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 22, 8192, 100, &[]);
    assert_eq!(c.simple(0).0, 0);
    c.request(CMD_WRITE_ZEROES, 0, 23, 12000, 2000, &[]);
    assert_eq!(c.simple(0).0, 0);
    c.request(CMD_READ, 0, 24, 0, 0, &[]);
    assert_eq!(c.simple(0), (0, 24, vec![]));
    c.request(CMD_WRITE, 0, 25, 0, 0, &[]);
    assert_eq!(c.simple(0).0, 0);

    let mut expect = data.clone();
    expect[..4096 - 1].fill(0); // trimmed [4096, 8192)
    expect[8192 - 4097..8192 - 4097 + 100].fill(0);
    expect[12000 - 4097..14000 - 4097].fill(0);
    c.request(CMD_READ, 0, 26, 4097, 10_000, &[]);
    assert_eq!(c.simple(10_000), (0, 26, expect.clone()));
    let mut buf = vec![0u8; 10_000];
    dev.read_at(&mut buf, 4097).unwrap();
    assert_eq!(buf, expect);

    // NBD_CMD_DISC: no reply, the server closes.
    c.request(CMD_DISC, 0, 27, 0, 0, &[]);
    c.expect_eof();

    let st = server.stats();
    let e = &st.exports[0];
    assert_eq!(e.disconnects, 1);
    assert_eq!(e.unsupported, 2);
    assert_eq!(e.errors, 12);
    assert_eq!(e.bytes_read, 20_000);
    assert_eq!(e.bytes_written, 10_000);
    assert_eq!(st.session_errors, 0);
}

/// NBD_OPT_EXPORT_NAME: 134-byte reply, or 10 bytes with NO_ZEROES; works
/// after other options; an unknown name closes the connection.
#[test]
fn export_name_with_and_without_no_zeroes() {
    let dir = TempDir::new("exportname");
    let server = start_unix(&dir, two_exports());
    let sock = dir.join("nbd.sock");

    for (client_flags, reply_len) in [(FLAG_C_FIXED_NEWSTYLE, 134usize), (BOTH, 10), (0, 134)] {
        let mut c = Client::unix(&sock);
        c.start(client_flags);
        c.opt(OPT_EXPORT_NAME, b"zero");
        let r = c.read_n(reply_len);
        assert_eq!(be64(&r), MIB);
        let flags = be16(&r[8..]);
        assert_eq!(flags & FLAG_HAS_FLAGS, FLAG_HAS_FLAGS);
        assert!(r[10..].iter().all(|&b| b == 0));
        c.request(CMD_READ, 0, 5, 100, 50, &[]);
        assert_eq!(c.simple(50), (0, 5, vec![0; 50]));
        c.request(CMD_DISC, 0, 6, 0, 0, &[]);
        c.expect_eof();
    }

    // Default export by empty name, after a structured-reply negotiation:
    // structured replies then apply to the transmission phase.
    let mut c = Client::unix(&sock);
    c.start(BOTH);
    c.opt(OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(c.opt_reply().kind, REP_ACK);
    c.opt(OPT_EXPORT_NAME, b"");
    let r = c.read_n(10);
    assert_eq!(be64(&r), 16 * MIB);
    assert_ne!(be16(&r[8..]) & FLAG_SEND_DF, 0);
    c.request(CMD_READ, 0, 1, 0, 8, &[]);
    let ch = c.chunk();
    assert_eq!((ch.kind, ch.flags, ch.cookie), (REPLY_TYPE_OFFSET_DATA, REPLY_FLAG_DONE, 1));
    assert_eq!(ch.payload, [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);

    // Unknown export: no error reply is possible, the server hangs up.
    let mut c = Client::unix(&sock);
    c.start(BOTH);
    c.opt(OPT_EXPORT_NAME, b"nope");
    c.expect_eof();
    eventually("the failed session to be counted", || server.stats().session_errors == 1);
}

/// NBD_OPT_LIST, NBD_OPT_INFO (with NAME, DESCRIPTION, BLOCK_SIZE),
/// unknown exports and options, bad lengths, STARTTLS, and NBD_OPT_ABORT,
/// all in one handshake.
#[test]
fn list_info_errors_and_abort() {
    let dir = TempDir::new("options");
    let _server = start_unix(&dir, two_exports());
    let mut c = Client::unix(&dir.join("nbd.sock"));
    c.start(BOTH);

    c.opt(OPT_LIST, &[]);
    let r = c.opt_replies();
    assert_eq!(r.len(), 3);
    assert!(r.iter().all(|x| x.option == OPT_LIST));
    assert_eq!((r[0].kind, be32(&r[0].data)), (REP_SERVER, 4));
    assert_eq!(&r[0].data[4..], b"disktest disk");
    assert_eq!(&r[1].data[4..], b"zero");
    assert_eq!(r[2].kind, REP_ACK);

    c.opt(OPT_LIST, b"x");
    assert_eq!(c.opt_reply().kind, REP_ERR_INVALID, "LIST with data");

    c.opt(OPT_INFO, &info_data("disk", &[INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE]));
    let r = c.opt_replies();
    assert_eq!(r.last().unwrap().kind, REP_ACK);
    let info = |t: u16| r.iter().find(|x| x.kind == REP_INFO && be16(&x.data) == t).map(|x| x.data[2..].to_vec());
    assert_eq!(be64(&info(INFO_EXPORT).unwrap()), 16 * MIB);
    assert_eq!(info(INFO_NAME).unwrap(), b"disk");
    assert_eq!(info(INFO_DESCRIPTION).unwrap(), b"test disk");
    let bs = info(INFO_BLOCK_SIZE).unwrap();
    assert_eq!((be32(&bs), be32(&bs[4..]), be32(&bs[8..])), (1, 4096, 32 << 20));

    c.opt(OPT_INFO, &info_data("", &[INFO_NAME]));
    let r = c.opt_replies();
    let name = r.iter().find(|x| x.kind == REP_INFO && be16(&x.data) == INFO_NAME).unwrap();
    assert_eq!(&name.data[2..], b"disk", "the default export's canonical name");

    c.opt(OPT_INFO, &info_data("missing", &[]));
    let r = c.opt_reply();
    assert_eq!(r.kind, REP_ERR_UNKNOWN);
    assert!(String::from_utf8_lossy(&r.data).contains("missing"));
    c.opt(OPT_GO, &info_data("missing", &[]));
    assert_eq!(c.opt_reply().kind, REP_ERR_UNKNOWN, "GO on an unknown export is an error, not a hang-up");

    // Bad lengths: name longer than the data, trailing bytes, too short.
    let mut bad = info_data("disk", &[]);
    bad[3] = 99;
    c.opt(OPT_INFO, &bad);
    assert_eq!(c.opt_reply().kind, REP_ERR_INVALID);
    let mut trailing = info_data("disk", &[INFO_NAME]);
    trailing.push(0);
    c.opt(OPT_GO, &trailing);
    assert_eq!(c.opt_reply().kind, REP_ERR_INVALID);
    c.opt(OPT_INFO, &[0, 0]);
    assert_eq!(c.opt_reply().kind, REP_ERR_INVALID);
    c.opt(OPT_STRUCTURED_REPLY, &[1]);
    assert_eq!(c.opt_reply().kind, REP_ERR_INVALID);
    c.opt(OPT_SET_META_CONTEXT, &meta_data("", &["base:allocation"]));
    assert_eq!(c.opt_reply().kind, REP_ERR_INVALID, "SET_META_CONTEXT needs structured replies");
    c.opt(OPT_LIST_META_CONTEXT, &[0, 0, 0, 9]);
    assert_eq!(c.opt_reply().kind, REP_ERR_INVALID);

    // Unknown and unsupported options, with data the server must skip.
    for (opt, data) in
        [(0x1234u32, vec![1u8; 100]), (OPT_STARTTLS, vec![]), (OPT_EXTENDED_HEADERS, vec![]), (4, vec![])]
    {
        c.opt(opt, &data);
        let r = c.opt_reply();
        assert_eq!((r.option, r.kind), (opt, REP_ERR_UNSUP));
    }
    // Oversized option data is skipped, the stream stays in sync.
    c.opt(OPT_INFO, &vec![0u8; 100_000]);
    assert_eq!(c.opt_reply().kind, REP_ERR_TOO_BIG);

    // LIST_META_CONTEXT works before structured replies; "base:" is a wildcard.
    c.opt(OPT_LIST_META_CONTEXT, &meta_data("disk", &["base:"]));
    let r = c.opt_replies();
    assert_eq!(r.len(), 2);
    assert_eq!(r[0].kind, REP_META_CONTEXT);
    assert_eq!(&r[0].data[4..], b"base:allocation");
    c.opt(OPT_LIST_META_CONTEXT, &meta_data("disk", &["qemu:dirty-bitmap:x"]));
    assert_eq!(c.opt_replies().len(), 1, "unknown namespaces are ignored");

    c.opt(OPT_ABORT, &[]);
    let r = c.opt_reply();
    assert_eq!((r.option, r.kind), (OPT_ABORT, REP_ACK));
    c.expect_eof();
}

/// Structured replies: OFFSET_DATA reads, error chunks with messages,
/// NONE for writes, BLOCK_STATUS with and without REQ_ONE.
#[test]
fn structured_replies_and_block_status() {
    let dir = TempDir::new("structured");
    let dev = pool_device("disk", 16 * MIB);
    let _server = start_unix(&dir, disk(Arc::clone(&dev)));
    let mut c = Client::unix(&dir.join("nbd.sock"));
    c.start(BOTH);
    c.opt(OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(c.opt_reply().kind, REP_ACK);
    c.opt(OPT_SET_META_CONTEXT, &meta_data("disk", &["base:allocation", "base:", "x-other:thing"]));
    let r = c.opt_replies();
    assert_eq!(r.len(), 2, "{r:?}");
    assert_eq!(r[0].kind, REP_META_CONTEXT);
    let ctx = be32(&r[0].data);
    assert_eq!(&r[0].data[4..], b"base:allocation");
    let (_, flags) = go(&mut c, "disk");
    assert_ne!(flags & FLAG_SEND_DF, 0);

    c.request(CMD_WRITE, 0, 1, 8192, 8192, &[7u8; 8192]);
    let ch = c.chunk();
    assert_eq!((ch.flags, ch.kind, ch.cookie, ch.payload.len()), (REPLY_FLAG_DONE, REPLY_TYPE_NONE, 1, 0));

    c.request(CMD_READ, CMD_FLAG_DF, 2, 8000, 400, &[]);
    let ch = c.chunk();
    assert_eq!((ch.flags, ch.kind, ch.cookie), (REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, 2));
    assert_eq!(be64(&ch.payload), 8000);
    assert_eq!(&ch.payload[8..200], &[0u8; 192][..]);
    assert_eq!(&ch.payload[200..], &[7u8; 208][..]);

    c.request(CMD_READ, 0, 3, 16 * MIB, 1, &[]);
    let ch = c.chunk();
    assert_eq!((ch.flags, ch.kind, ch.cookie), (REPLY_FLAG_DONE, REPLY_TYPE_ERROR, 3));
    assert_eq!(be32(&ch.payload), NBD_EINVAL);
    let msg_len = usize::from(be16(&ch.payload[4..]));
    assert_eq!(ch.payload.len(), 6 + msg_len);
    assert!(String::from_utf8_lossy(&ch.payload[6..]).contains("beyond the export size"));

    // Block status: hole [0, 8K), data [8K, 16K), hole after.
    c.request(CMD_BLOCK_STATUS, 0, 4, 0, 64 * 1024, &[]);
    let ch = c.chunk();
    assert_eq!((ch.flags, ch.kind, ch.cookie), (REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, 4));
    assert_eq!(be32(&ch.payload), ctx);
    let ext: Vec<(u32, u32)> = ch.payload[4..].chunks(8).map(|d| (be32(d), be32(&d[4..]))).collect();
    assert_eq!(ext, vec![(8192, STATE_HOLE | STATE_ZERO), (8192, 0), (65536 - 16384, STATE_HOLE | STATE_ZERO)]);

    c.request(CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE, 5, 4096, 64 * 1024, &[]);
    let ch = c.chunk();
    assert_eq!(ch.payload.len(), 12, "REQ_ONE: exactly one descriptor");
    assert_eq!((be32(&ch.payload[4..]), be32(&ch.payload[8..])), (4096, STATE_HOLE | STATE_ZERO));

    // Unaligned start inside the data page.
    c.request(CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE, 6, 9000, 100, &[]);
    let ch = c.chunk();
    assert_eq!((be32(&ch.payload[4..]), be32(&ch.payload[8..])), (100, 0));

    c.request(CMD_BLOCK_STATUS, 0, 7, 16 * MIB - 4096, 8192, &[]);
    let ch = c.chunk();
    assert_eq!((ch.kind, be32(&ch.payload)), (REPLY_TYPE_ERROR, NBD_EINVAL));
    c.request(CMD_BLOCK_STATUS, 0, 8, 0, 0, &[]);
    assert_eq!(c.chunk().kind, REPLY_TYPE_ERROR, "empty block status");

    // The largest length a request can carry, far beyond the end.
    c.request(CMD_BLOCK_STATUS, 0, 9, 0, u32::MAX, &[]);
    let ch = c.chunk();
    assert_eq!((ch.kind, be32(&ch.payload)), (REPLY_TYPE_ERROR, NBD_EINVAL), "beyond 16 MiB");

    c.request(CMD_FLUSH, CMD_FLAG_FUA, 10, 0, 0, &[]);
    assert_eq!(c.chunk().kind, REPLY_TYPE_NONE);
    c.request(CMD_DISC, 0, 11, 0, 0, &[]);
    c.expect_eof();
}

/// Metadata contexts apply only to the export they were set for.
#[test]
fn block_status_needs_meta_context_for_the_same_export() {
    let dir = TempDir::new("meta");
    let _server = start_unix(&dir, two_exports());
    let mut c = Client::unix(&dir.join("nbd.sock"));
    c.start(BOTH);
    c.opt(OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(c.opt_reply().kind, REP_ACK);
    c.opt(OPT_SET_META_CONTEXT, &meta_data("zero", &["base:allocation"]));
    assert_eq!(c.opt_replies().len(), 2);
    c.opt(OPT_SET_META_CONTEXT, &meta_data("nope", &["base:allocation"]));
    assert_eq!(c.opt_reply().kind, REP_ERR_UNKNOWN);
    go(&mut c, "zero");
    c.request(CMD_BLOCK_STATUS, 0, 1, 0, 4096, &[]);
    let ch = c.chunk();
    assert_eq!(ch.kind, REPLY_TYPE_ERROR, "the failed SET cleared the selection");

    let mut c = Client::unix(&dir.join("nbd.sock"));
    c.start(BOTH);
    c.opt(OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(c.opt_reply().kind, REP_ACK);
    c.opt(OPT_SET_META_CONTEXT, &meta_data("zero", &["base:allocation"]));
    assert_eq!(c.opt_replies().len(), 2);
    go(&mut c, "zero");
    c.request(CMD_BLOCK_STATUS, 0, 1, 0, 4096, &[]);
    let ch = c.chunk();
    assert_eq!(ch.kind, REPLY_TYPE_BLOCK_STATUS);
    assert_eq!(&ch.payload[4..], &[0, 0, 16, 0, 0, 0, 0, 3]);

    let mut c = Client::unix(&dir.join("nbd.sock"));
    c.start(BOTH);
    c.opt(OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(c.opt_reply().kind, REP_ACK);
    c.opt(OPT_SET_META_CONTEXT, &meta_data("zero", &["base:allocation"]));
    assert_eq!(c.opt_replies().len(), 2);
    go(&mut c, "disk");
    c.request(CMD_BLOCK_STATUS, 0, 1, 0, 4096, &[]);
    assert_eq!(c.chunk().kind, REPLY_TYPE_ERROR, "context was set for another export");
}

/// Malformed input ends the session cleanly (no reply, connection closed),
/// and the server keeps serving others.
#[test]
fn malformed_input_disconnects() {
    let dir = TempDir::new("malformed");
    let server = start_unix(&dir, disk(pool_device("disk", 16 * MIB)));
    let sock = dir.join("nbd.sock");

    // Unknown client flags.
    let mut c = Client::unix(&sock);
    c.start(0x8000_0000);
    c.expect_eof();

    // Bad option magic.
    let mut c = Client::unix(&sock);
    c.start(BOTH);
    c.send(&[0u8; 16]);
    c.expect_eof();

    // Export name beyond the string limit.
    let mut c = Client::unix(&sock);
    c.start(BOTH);
    c.opt(OPT_EXPORT_NAME, &[b'a'; 5000]);
    c.expect_eof();

    // Bad request magic.
    let mut c = Client::unix(&sock);
    c.start(BOTH);
    go(&mut c, "");
    let mut req = encode_request(&Request { flags: 0, command: CMD_READ, cookie: 1, offset: 0, len: 512 });
    req[0] = 0x99;
    c.send(&req);
    c.expect_eof();

    // A write payload over the 32 MiB maximum.
    let mut c = Client::unix(&sock);
    c.start(BOTH);
    go(&mut c, "");
    c.request(CMD_WRITE, 0, 1, 0, MAX_PAYLOAD + 1, &[]);
    c.expect_eof();

    // Truncated request header, then the client closes.
    let mut c = Client::unix(&sock);
    c.start(BOTH);
    go(&mut c, "");
    c.send(&req[..10]);
    drop(c);

    eventually("all sessions to end", || server.stats().connections_active == 0);
    assert_eq!(server.stats().session_errors, 6);
    // Still serving.
    let mut c = Client::unix(&sock);
    c.start(BOTH);
    go(&mut c, "");
    c.request(CMD_READ, 0, 1, 0, 16, &[]);
    assert_eq!(c.simple(16), (0, 1, vec![0; 16]));
}

/// The unix socket has mode 0600 and is removed on stop; a stale socket is
/// replaced, a live one or a regular file is refused.
#[test]
fn unix_socket_lifecycle() {
    let dir = TempDir::new("socket");
    let sock = dir.join("nbd.sock");
    let server = start_unix(&dir, disk(pool_device("disk", MIB)));
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    assert_eq!(server.local_addr(), &Listen::Unix(sock.clone()));
    // Nothing left behind by the bind-then-rename dance.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);

    let again = NbdServer::bind(NbdConfig::new(disk(pool_device("d", MIB)), Listen::Unix(sock.clone())));
    assert!(matches!(again, Err(NbdError::SocketInUse(_))), "{again:?}");
    server.stop().unwrap();
    assert!(!sock.exists());

    // A stale socket (nobody listening) is replaced.
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    assert!(sock.exists());
    let server = start_unix(&dir, disk(pool_device("disk", MIB)));
    let mut c = Client::unix(&sock);
    c.start(BOTH);
    go(&mut c, "");
    drop(c);
    drop(server); // drop stops too
    assert!(!sock.exists());

    // A regular file is not touched.
    std::fs::write(&sock, b"precious").unwrap();
    let r = NbdServer::bind(NbdConfig::new(disk(pool_device("d", MIB)), Listen::Unix(sock.clone())));
    assert!(matches!(r, Err(NbdError::Config(_))), "{r:?}");
    assert_eq!(std::fs::read(&sock).unwrap(), b"precious");
}

#[test]
fn config_is_validated() {
    let dir = TempDir::new("config");
    let listen = Listen::Unix(dir.join("nbd.sock"));
    let r = NbdServer::bind(NbdConfig::new(vec![], listen.clone()));
    assert!(matches!(r, Err(NbdError::Config(_))));
    let dup = vec![
        Export::new("a", Arc::new(ZeroDevice::new(MIB)) as Arc<dyn BlockDevice>),
        Export::new("a", Arc::new(ZeroDevice::new(MIB)) as Arc<dyn BlockDevice>),
    ];
    assert!(matches!(NbdServer::bind(NbdConfig::new(dup, listen.clone())), Err(NbdError::Config(_))));
    let mut cfg = NbdConfig::new(disk(pool_device("d", MIB)), listen);
    cfg.max_connections = 0;
    assert!(matches!(NbdServer::bind(cfg), Err(NbdError::Config(_))));
    assert!(!dir.join("nbd.sock").exists(), "nothing bound on bad configs");

    // Non-loopback TCP is refused unless allow_remote (never bound here).
    for addr in ["0.0.0.0:0", "[::]:0", "192.0.2.1:10809"] {
        let cfg = NbdConfig::new(disk(pool_device("d", MIB)), Listen::Tcp(addr.parse().unwrap()));
        let r = NbdServer::bind(cfg);
        assert!(matches!(r, Err(NbdError::RemoteNotAllowed(_))), "{addr}: {r:?}");
    }
}

/// A raw client over loopback TCP.
#[test]
fn tcp_raw_client() {
    let cfg = NbdConfig::new(disk(pool_device("d", MIB)), Listen::Tcp("127.0.0.1:0".parse().unwrap()));
    let server = ServerHandle::start(cfg).unwrap();
    let Listen::Tcp(addr) = server.local_addr().clone() else { panic!() };
    let mut c = Client::tcp(addr);
    c.start(BOTH);
    assert_eq!(go(&mut c, "disk").0, MIB);
    c.request(CMD_WRITE, 0, 1, 10, 3, b"abc");
    assert_eq!(c.simple(0).0, 0);
    c.request(CMD_READ, 0, 2, 9, 5, &[]);
    assert_eq!(c.simple(5), (0, 2, b"\0abc\0".to_vec()));
    c.request(CMD_DISC, 0, 3, 0, 0, &[]);
    c.expect_eof();
}

/// Connections beyond `max_connections` are refused (see `tests/limits.rs`
/// for the refusal itself).
#[test]
fn max_connections_is_enforced() {
    let dir = TempDir::new("maxconn");
    let mut cfg = NbdConfig::new(disk(pool_device("d", MIB)), Listen::Unix(dir.join("nbd.sock")));
    cfg.max_connections = 2;
    let server = ServerHandle::start(cfg).unwrap();
    let sock = dir.join("nbd.sock");
    let mut a = Client::unix(&sock);
    a.greeting();
    let mut b = Client::unix(&sock);
    b.greeting();
    let mut c = Client::unix(&sock);
    c.start(BOTH);
    c.opt(OPT_GO, &info_data("", &[]));
    assert_eq!(c.opt_reply().kind, REP_ERR_SHUTDOWN);
    assert_eq!(server.stats().refused_connection_limit, 1);
    drop(a);
    eventually("a slot to free up", || server.stats().connections_active == 1);
    let mut d = Client::unix(&sock);
    d.greeting();
    b.send(&BOTH.to_be_bytes());
    go(&mut b, "");
}

/// Stopping the server ends sessions that are idle in transmission.
#[test]
fn stop_ends_active_sessions() {
    let dir = TempDir::new("stop");
    let server = start_unix(&dir, disk(pool_device("d", MIB)));
    let mut c = Client::unix(&dir.join("nbd.sock"));
    c.start(BOTH);
    go(&mut c, "");
    let mut h = Client::unix(&dir.join("nbd.sock"));
    h.greeting(); // idle in the handshake
    let t = Instant::now();
    server.stop().unwrap();
    assert!(t.elapsed() < Duration::from_secs(3), "stop took {:?}", t.elapsed());
    c.expect_eof();
    h.expect_eof();
    assert!(!dir.join("nbd.sock").exists());
}

/// `run_until` on the caller's thread, stopped by the flag.
#[test]
fn run_until_returns_when_stopped() {
    let dir = TempDir::new("rununtil");
    let server =
        NbdServer::bind(NbdConfig::new(disk(pool_device("d", MIB)), Listen::Unix(dir.join("nbd.sock")))).unwrap();
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let t = s.spawn(|| server.run_until(&stop));
        let mut c = Client::unix(&dir.join("nbd.sock"));
        c.start(BOTH);
        go(&mut c, "");
        stop.store(true, std::sync::atomic::Ordering::Release);
        t.join().unwrap().unwrap();
        c.expect_eof();
    });
    assert_eq!(server.stats().exports[0].connections, 1);
    drop(server);
    assert!(!dir.join("nbd.sock").exists());
}

/// `serve_connection` on an in-memory stream (as the fuzzer drives it).
#[test]
fn serve_connection_in_memory() {
    struct Duplex {
        input: std::io::Cursor<Vec<u8>>,
        output: Vec<u8>,
    }
    impl std::io::Read for Duplex {
        fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
            self.input.read(b)
        }
    }
    impl std::io::Write for Duplex {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.output.write(b)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let exports = Exports::new(disk(pool_device("d", MIB))).unwrap();
    let mut input = BOTH.to_be_bytes().to_vec();
    let mut opt = IHAVEOPT.to_be_bytes().to_vec();
    let go_data = info_data("", &[]);
    opt.extend_from_slice(&OPT_GO.to_be_bytes());
    opt.extend_from_slice(&u32::try_from(go_data.len()).unwrap().to_be_bytes());
    opt.extend_from_slice(&go_data);
    input.extend_from_slice(&opt);
    input.extend_from_slice(&encode_request(&Request { flags: 0, command: CMD_WRITE, cookie: 1, offset: 0, len: 2 }));
    input.extend_from_slice(b"hi");
    input.extend_from_slice(&encode_request(&Request { flags: 0, command: CMD_DISC, cookie: 2, offset: 0, len: 0 }));
    let mut d = Duplex { input: std::io::Cursor::new(input), output: Vec::new() };
    assert_eq!(serve_connection(&mut d, &exports).unwrap(), SessionEnd::Disconnected);
    // Greeting, INFO_EXPORT + BLOCK_SIZE + ACK, one simple reply.
    assert_eq!(d.output.len(), 18 + (20 + 12) + (20 + 14) + 20 + 16);
    assert_eq!(exports.stats()[0].bytes_written, 2);

    // EOF at a message boundary is a clean close, mid-message an error.
    let mut d = Duplex { input: std::io::Cursor::new(BOTH.to_be_bytes().to_vec()), output: Vec::new() };
    assert_eq!(serve_connection(&mut d, &exports).unwrap(), SessionEnd::Closed);
    let mut d = Duplex { input: std::io::Cursor::new(vec![0, 0, 0, 3, 0x49]), output: Vec::new() };
    assert!(serve_connection(&mut d, &exports).is_err());
}

/// A page the store refuses (incompressible, default policy) is ENOSPC for
/// the client, with the reason in the structured error message, and the old
/// contents stay.
#[test]
fn store_refusal_is_enospc() {
    let dir = TempDir::new("enospc");
    let _server = start_unix(&dir, disk(strict_pool_device("d", MIB)));
    let mut noise = vec![0u8; 8192];
    Rng::new(3).fill(&mut noise);

    let mut c = Client::unix(&dir.join("nbd.sock"));
    c.start(BOTH);
    go(&mut c, "");
    c.request(CMD_WRITE, 0, 1, 0, 4096, &[b'a'; 4096]);
    assert_eq!(c.simple(0).0, 0);
    c.request(CMD_WRITE, 0, 2, 0, 8192, &noise);
    assert_eq!(c.simple(0).0, NBD_ENOSPC);
    c.request(CMD_READ, 0, 3, 0, 4096, &[]);
    assert_eq!(c.simple(4096), (0, 3, vec![b'a'; 4096]), "old contents kept");

    let mut c = Client::unix(&dir.join("nbd.sock"));
    c.start(BOTH);
    c.opt(OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(c.opt_reply().kind, REP_ACK);
    go(&mut c, "");
    c.request(CMD_WRITE, CMD_FLAG_FUA, 4, 4096, 4096, &noise[..4096]);
    let ch = c.chunk();
    assert_eq!((ch.kind, ch.flags, be32(&ch.payload)), (REPLY_TYPE_ERROR, REPLY_FLAG_DONE, NBD_ENOSPC));
    assert!(
        String::from_utf8_lossy(&ch.payload[6..]).contains("refused"),
        "{:?}",
        String::from_utf8_lossy(&ch.payload)
    );
}
