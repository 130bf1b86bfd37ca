//! Hostile clients against the server's limits, over real sockets: silent
//! and slow handshakes, the connection limits (in all and per client), idle
//! and stalled sessions, trickled payloads and replies, and clients that
//! never read their replies. Every client read has a timeout, so a missing
//! limit fails a test instead of hanging it.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use common::{be32, be64, disk, eventually, go, info_data, pool_device, Client, TempDir};
use tmem_nbd::proto::*;
use tmem_nbd::{Listen, NbdConfig, NbdError, NbdServer, ServerHandle};

const MIB: u64 = 1 << 20;
const BOTH: u32 = FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES;
/// Longest a client waits for the server in these tests.
const CLIENT_WAIT: Duration = Duration::from_secs(5);

/// A server on `dir/nbd.sock` with a 16 MiB disk, configured by `f`.
fn server(dir: &TempDir, f: impl FnOnce(&mut NbdConfig)) -> ServerHandle {
    let mut cfg = NbdConfig::new(disk(pool_device("disk", 16 * MIB)), Listen::Unix(dir.join("nbd.sock")));
    f(&mut cfg);
    ServerHandle::start(cfg).expect("start server")
}

/// A raw client whose reads give up after [`CLIENT_WAIT`].
fn client(sock: &Path) -> Client<UnixStream> {
    let c = Client::unix(sock);
    c.s.set_read_timeout(Some(CLIENT_WAIT)).unwrap();
    c
}

/// A client in transmission on the default export (simple replies).
fn transmitting(sock: &Path) -> Client<UnixStream> {
    let mut c = client(sock);
    c.start(BOTH);
    go(&mut c, "");
    c
}

/// Reads 512 bytes at 0 and checks the reply.
fn read_ok<S: Read + Write>(c: &mut Client<S>, cookie: u64) {
    c.request(CMD_READ, 0, cookie, 0, 512, &[]);
    assert_eq!(c.simple(512), (0, cookie, vec![0; 512]));
}

/// A TCP client from the loopback address `from` (any of 127.0.0.0/8) to
/// `to`, its reads bounded by [`CLIENT_WAIT`].
fn tcp_from(from: &str, to: SocketAddr) -> Client<TcpStream> {
    use rustix::net::{bind, connect, socket, AddressFamily, SocketType};
    let fd = socket(AddressFamily::INET, SocketType::STREAM, None).expect("socket");
    bind(&fd, &SocketAddr::new(from.parse().unwrap(), 0)).expect("bind the client's address");
    connect(&fd, &to).expect("connect");
    let s = TcpStream::from(fd);
    s.set_read_timeout(Some(CLIENT_WAIT)).unwrap();
    Client { s }
}

/// Waits for the server to close `c`; returns how long that took.
fn eof_within<S: Read + Write>(c: &mut Client<S>, what: &str) -> Duration {
    let t = Instant::now();
    c.expect_eof();
    let waited = t.elapsed();
    assert!(waited < CLIENT_WAIT, "{what}: closed only after {waited:?}");
    waited
}

/// (a) A client that connects and sends nothing, and one that sends its
/// handshake a byte at a time, are cut at the handshake timeout; one that
/// reaches transmission in time is not.
#[test]
fn handshake_timeout_cuts_silent_and_slow_clients() {
    let dir = TempDir::new("hstimeout");
    let server = server(&dir, |c| c.handshake_timeout = Duration::from_millis(300));
    let sock = dir.join("nbd.sock");

    let t = Instant::now();
    let mut silent = client(&sock);
    silent.greeting();
    eof_within(&mut silent, "silent client");
    assert!(t.elapsed() >= Duration::from_millis(250), "cut early: {:?}", t.elapsed());

    // Bytes keep coming, but the deadline covers the whole handshake.
    let t = Instant::now();
    let mut slow = client(&sock);
    slow.start(BOTH);
    let mut opt = IHAVEOPT.to_be_bytes().to_vec();
    opt.extend_from_slice(&OPT_INFO.to_be_bytes());
    opt.extend_from_slice(&60_000u32.to_be_bytes());
    slow.send(&opt);
    while t.elapsed() < CLIENT_WAIT && slow.s.write_all(&[0]).is_ok() {
        std::thread::sleep(Duration::from_millis(40));
    }
    assert!(t.elapsed() < Duration::from_secs(2), "slow client still connected after {:?}", t.elapsed());
    eof_within(&mut slow, "slow client");

    let mut ok = transmitting(&sock);
    std::thread::sleep(Duration::from_millis(600));
    read_ok(&mut ok, 1);

    eventually("the timeouts to be counted", || server.stats().handshake_timeouts == 2);
    let st = server.stats();
    assert_eq!((st.idle_timeouts, st.io_timeouts, st.session_errors, st.refused_connection_limit), (0, 0, 0, 0));
}

/// (b) Past `max_connections`, a client is answered at once: the greeting,
/// then `NBD_REP_ERR_SHUTDOWN` with the reason for its options. Once the
/// idle connections are gone, new clients are served again.
#[test]
fn connection_limit_refuses_politely() {
    let dir = TempDir::new("refuse");
    let server = server(&dir, |c| c.max_connections = 2);
    let sock = dir.join("nbd.sock");
    let idle = [UnixStream::connect(&sock).unwrap(), UnixStream::connect(&sock).unwrap()];
    eventually("both idle connections to be accepted", || server.stats().connections_active == 2);

    let t = Instant::now();
    let mut c = client(&sock);
    c.start(BOTH);
    c.opt(OPT_STRUCTURED_REPLY, &[]);
    let r = c.opt_reply();
    assert_eq!((r.option, r.kind), (OPT_STRUCTURED_REPLY, REP_ERR_SHUTDOWN));
    assert_eq!(String::from_utf8_lossy(&r.data), "tmem: connection limit (2) reached");
    c.opt(OPT_GO, &info_data("", &[]));
    let r = c.opt_reply();
    assert_eq!((r.option, r.kind), (OPT_GO, REP_ERR_SHUTDOWN));
    c.opt(OPT_ABORT, &[]);
    assert_eq!(c.opt_reply().kind, REP_ACK);
    c.expect_eof();
    assert!(t.elapsed() < Duration::from_secs(2), "refusal took {:?}", t.elapsed());

    // NBD_OPT_EXPORT_NAME has no error reply: closed.
    let mut c = client(&sock);
    c.start(BOTH);
    c.opt(OPT_EXPORT_NAME, b"");
    eof_within(&mut c, "EXPORT_NAME past the limit");
    // A refused client that says nothing is cut by the refusal deadline.
    let mut c = client(&sock);
    c.greeting();
    eof_within(&mut c, "silent refused client");

    let st = server.stats();
    assert_eq!((st.refused_connection_limit, st.connections_accepted, st.connections_active), (3, 2, 2));
    drop(idle);
    eventually("the idle connections to end", || server.stats().connections_active == 0);
    let mut c = transmitting(&sock);
    read_ok(&mut c, 1);
    assert_eq!(server.stats().refused_connection_limit, 3);
}

/// (c) With an idle timeout, a connection in transmission is closed after
/// that long without a request; requests in time keep it open.
#[test]
fn idle_timeout_closes_quiet_transmission() {
    let dir = TempDir::new("idle");
    let server = server(&dir, |c| c.idle_timeout = Some(Duration::from_millis(300)));
    let sock = dir.join("nbd.sock");
    let mut c = transmitting(&sock);
    for cookie in 0..5 {
        std::thread::sleep(Duration::from_millis(120));
        read_ok(&mut c, cookie);
    }
    let waited = eof_within(&mut c, "idle connection");
    assert!(waited >= Duration::from_millis(250), "cut early: {waited:?}");
    eventually("the timeout to be counted", || server.stats().idle_timeouts == 1);
    let st = server.stats();
    assert_eq!((st.handshake_timeouts, st.io_timeouts, st.session_errors), (0, 0, 0));
}

/// A request cut off midway stalls the session only for the I/O timeout.
#[test]
fn io_timeout_drops_a_stalled_request() {
    let dir = TempDir::new("stall");
    let server = server(&dir, |c| c.io_timeout = Duration::from_millis(300));
    let sock = dir.join("nbd.sock");
    let mut c = transmitting(&sock);
    let req = encode_request(&Request { flags: 0, command: CMD_WRITE, cookie: 1, offset: 0, len: 4096 });
    c.send(&req);
    c.send(&[7; 100]); // 3996 bytes of payload never come
    eof_within(&mut c, "stalled write");
    eventually("the timeout to be counted", || server.stats().io_timeouts == 1);
    // Idle between requests is not an I/O timeout.
    let mut c = transmitting(&sock);
    std::thread::sleep(Duration::from_millis(700));
    read_ok(&mut c, 2);
    assert_eq!(server.stats().session_errors, 0);
}

/// (d) Clients that pipeline large reads and never read the replies hold
/// at most `max_buffered_bytes` of reply buffers between them; they are
/// dropped after the I/O timeout, and other clients are still served.
#[test]
fn unread_replies_stay_within_the_buffer_budget() {
    const BLOCK: u32 = 1 << 20;
    const HOSTILE: usize = 6;
    const CAP: usize = 3 * (1 << 20) + 1024; // three 1 MiB replies with headers
    let dir = TempDir::new("budget");
    let server = server(&dir, |c| {
        c.max_block_size = BLOCK;
        c.max_buffered_bytes = CAP;
        // A stuck write fails after one or two of these. Long enough that a
        // flush blocked behind the budget (it waits for this timeout) is
        // told apart from one served at once on a loaded machine.
        c.io_timeout = Duration::from_secs(4);
    });
    let sock = dir.join("nbd.sock");
    let cap = u64::try_from(CAP).unwrap();

    let mut hostile: Vec<_> = (0..HOSTILE).map(|_| transmitting(&sock)).collect();
    for c in &mut hostile {
        for cookie in 0..32 {
            c.request(CMD_READ, 0, cookie, 0, BLOCK, &[]);
        }
    }
    eventually("the budget to run out", || server.stats().buffer_waits > 0);
    let st = server.stats();
    assert!(st.buffered_bytes <= cap, "{} bytes buffered, cap {cap}", st.buffered_bytes);
    // Reads are served from the device only once their buffer is granted.
    let read = st.exports[0].bytes_read;
    assert!(read <= cap, "{read} bytes read for clients that do not read, cap {cap}");

    // Requests without a payload buffer go through at once.
    let mut good = transmitting(&sock);
    let t = Instant::now();
    good.request(CMD_FLUSH, 0, 1, 0, 0, &[]);
    assert_eq!(good.simple(0), (0, 1, vec![]));
    assert!(t.elapsed() < Duration::from_secs(2), "flush took {:?}: it waited for the budget", t.elapsed());
    // A read waits for the budget, which the I/O timeout frees.
    good.s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    good.request(CMD_READ, 0, 2, 0, 4096, &[]);
    assert_eq!(good.simple(4096), (0, 2, vec![0; 4096]));

    eventually("the hostile sessions to be dropped", || server.stats().io_timeouts == HOSTILE as u64);
    drop(hostile);
    read_ok(&mut good, 3);
    // The server gives a reply's buffer back after its last byte is sent,
    // which may be just after the client has read it.
    eventually("every buffer to be given back", || server.stats().buffered_bytes == 0);
    let st = server.stats();
    assert!(
        st.buffered_bytes_peak <= cap,
        "peak {} bytes buffered, cap {cap} (one request is {})",
        st.buffered_bytes_peak,
        BLOCK + 16
    );
    assert!(st.buffered_bytes_peak > cap - u64::from(BLOCK), "the budget was used: {st:?}");
    assert_eq!((st.handshake_timeouts, st.idle_timeouts, st.session_errors), (0, 0, 0));
}

/// `max_block_size` is advertised in `NBD_INFO_BLOCK_SIZE` and enforced:
/// larger reads and writes get `EINVAL`, and the session goes on.
#[test]
fn max_block_size_is_advertised_and_enforced() {
    const BLOCK: u32 = 64 << 10;
    let dir = TempDir::new("maxblock");
    let server = server(&dir, |c| c.max_block_size = BLOCK);
    let mut c = client(&dir.join("nbd.sock"));
    c.start(BOTH);
    c.opt(OPT_GO, &info_data("", &[INFO_BLOCK_SIZE]));
    let replies = c.opt_replies();
    let bs = replies.iter().find(|r| r.kind == REP_INFO && r.data[..2] == INFO_BLOCK_SIZE.to_be_bytes()).unwrap();
    assert_eq!((be32(&bs.data[2..]), be32(&bs.data[6..]), be32(&bs.data[10..])), (1, 4096, BLOCK));

    let data = vec![9u8; usize::try_from(BLOCK).unwrap() + 1];
    c.request(CMD_WRITE, 0, 1, 0, BLOCK + 1, &data);
    assert_eq!(c.simple(0).0, NBD_EINVAL, "write over the maximum block size");
    c.request(CMD_READ, 0, 2, 0, BLOCK + 1, &[]);
    assert_eq!(c.simple(0).0, NBD_EINVAL, "read over the maximum block size");
    c.request(CMD_WRITE, 0, 3, 0, BLOCK, &data[..data.len() - 1]);
    assert_eq!(c.simple(0).0, 0);
    c.request(CMD_READ, 0, 4, 0, BLOCK, &[]);
    assert_eq!(c.simple(data.len() - 1), (0, 4, data[..data.len() - 1].to_vec()));
    assert_eq!(server.stats().session_errors, 0);
}

/// (e) 64 clients that finish `NBD_OPT_GO` and then say nothing hold every
/// slot. A fresh client is held (before its greeting) until one of them has
/// been idle for `idle_reclaim`, then served in its slot. While slots are
/// free, an idle connection is never closed: swap clients (the kernel's,
/// QEMU's) send nothing between requests.
#[test]
fn idle_clients_give_way_to_a_fresh_client() {
    const IDLE: Duration = Duration::from_secs(1);
    let dir = TempDir::new("reclaim");
    let server = server(&dir, |c| {
        c.idle_reclaim = Some(IDLE);
        c.max_connections_per_peer = 64; // all from this test's user
    });
    let sock = dir.join("nbd.sock");
    let mut first = transmitting(&sock);
    std::thread::sleep(IDLE + Duration::from_millis(500));
    read_ok(&mut first, 1);
    let idle: Vec<_> = (1..64).map(|_| transmitting(&sock)).collect();
    // The first connection was busy last: it becomes reclaimable last.
    read_ok(&mut first, 2);
    assert_eq!(server.stats().connections_active, 64);

    let t = Instant::now();
    let mut fresh = client(&sock);
    fresh.start(BOTH);
    go(&mut fresh, "");
    read_ok(&mut fresh, 3);
    let waited = t.elapsed();
    assert!(waited < IDLE + Duration::from_millis(1500), "served after {waited:?}");
    read_ok(&mut first, 4);
    eventually("the reclaimed session to end", || server.stats().connections_active == 64);
    let st = server.stats();
    assert_eq!((st.idle_reclaims, st.slot_waits, st.refused_connection_limit), (1, 1, 0), "{st:?}");
    assert_eq!((st.idle_timeouts, st.session_errors, st.connections_max), (0, 0, 64));
    drop(idle);
}

/// (f) One client (here: one loopback address) gets at most
/// `max_connections_per_peer` slots; past it it is refused politely, while
/// a client from another address gets a slot at once.
#[test]
fn one_client_cannot_take_every_slot() {
    let mut cfg = NbdConfig::new(disk(pool_device("disk", 16 * MIB)), Listen::Tcp("127.0.0.1:0".parse().unwrap()));
    cfg.max_connections = 8;
    cfg.max_connections_per_peer = 4;
    let server = ServerHandle::start(cfg).expect("start server");
    let Listen::Tcp(addr) = *server.local_addr() else { unreachable!("a TCP server") };
    // Silent connections, in their handshake: nothing to reclaim.
    let hog: Vec<_> = (0..4).map(|_| tcp_from("127.0.0.1", addr)).collect();
    eventually("the hog's connections to be accepted", || server.stats().connections_active == 4);

    let t = Instant::now();
    let mut c = tcp_from("127.0.0.1", addr);
    c.start(BOTH);
    c.opt(OPT_GO, &info_data("", &[]));
    let r = c.opt_reply();
    assert_eq!((r.option, r.kind), (OPT_GO, REP_ERR_SHUTDOWN));
    assert_eq!(String::from_utf8_lossy(&r.data), "tmem: connection limit per client (4) reached");
    let mut other = tcp_from("127.0.0.2", addr);
    other.start(BOTH);
    go(&mut other, "");
    read_ok(&mut other, 1);
    assert!(t.elapsed() < Duration::from_secs(2), "took {:?}", t.elapsed());
    let st = server.stats();
    assert_eq!((st.refused_peer_limit, st.refused_connection_limit, st.connections_per_peer_max), (1, 0, 4));
    drop(hog);
}

/// (g) Eight clients send the header of a 32 MiB WRITE and then stall.
/// Each holds one chunk of the budget, not its whole request: another
/// client's 4 KiB read is answered at once.
#[test]
fn stalled_writes_leave_budget_for_others() {
    let dir = TempDir::new("stallwrite");
    let server =
        ServerHandle::start(NbdConfig::new(disk(pool_device("disk", 64 * MIB)), Listen::Unix(dir.join("nbd.sock"))))
            .expect("start server");
    let sock = dir.join("nbd.sock");
    let mut stalled: Vec<_> = (0..8).map(|_| transmitting(&sock)).collect();
    for (cookie, c) in (0..).zip(&mut stalled) {
        c.request(CMD_WRITE, 0, cookie, 0, 32 << 20, &[]);
    }
    eventually("the writes to be read", || server.stats().exports[0].writes == 8);
    eventually("the stalled writes to hold their buffers", || server.stats().buffered_bytes >= 8 * MIB);
    std::thread::sleep(Duration::from_millis(100));
    let mut good = transmitting(&sock);
    let t = Instant::now();
    good.request(CMD_READ, 0, 9, 0, 4096, &[]);
    assert_eq!(good.simple(4096), (0, 9, vec![0; 4096]));
    assert!(t.elapsed() < Duration::from_secs(1), "read took {:?}", t.elapsed());
    // The read gives its buffer back just after its reply went out.
    eventually("one chunk held per stalled write", || server.stats().buffered_bytes == 8 * MIB);
    let st = server.stats();
    assert_eq!((st.buffer_waits, st.session_errors), (0, 0));
    drop(stalled);
}

/// (h) A request that finds no room in the budget within `buffer_wait` is
/// answered with `ENOMEM`, and its connection is closed.
#[test]
fn buffer_wait_gives_up_with_an_error_reply() {
    const BLOCK: u32 = 1 << 20;
    let dir = TempDir::new("bufwait");
    let server = server(&dir, |c| {
        c.max_block_size = BLOCK;
        c.max_buffered_bytes = usize::try_from(BLOCK).unwrap() + 1024;
        c.buffer_wait = Duration::from_millis(300);
    });
    let sock = dir.join("nbd.sock");
    // A client that does not read its replies holds the whole budget.
    let mut hog = transmitting(&sock);
    for cookie in 0..4 {
        hog.request(CMD_READ, 0, cookie, 0, BLOCK, &[]);
    }
    eventually("the budget to be held", || server.stats().buffered_bytes > u64::from(BLOCK));
    let mut c = transmitting(&sock);
    let t = Instant::now();
    c.request(CMD_READ, 0, 7, 0, 4096, &[]);
    assert_eq!(c.simple(0), (NBD_ENOMEM, 7, vec![]));
    let waited = t.elapsed();
    eof_within(&mut c, "a connection after its buffer wait ran out");
    assert!(waited >= Duration::from_millis(250) && waited < Duration::from_secs(3), "answered after {waited:?}");
    let st = server.stats();
    assert_eq!((st.buffer_wait_timeouts, st.session_errors, st.io_timeouts), (1, 0, 0), "{st:?}");
    drop(hog);
}

/// (i) A WRITE whose payload comes a byte at a time (each byte well within
/// `io_timeout`) is cut once its transfer deadline passed: an `EIO` reply,
/// then the connection is closed. A request header sent the same way is
/// cut without a reply.
#[test]
fn trickled_payload_is_cut_at_its_deadline() {
    let dir = TempDir::new("trickle");
    let server = server(&dir, |c| c.transfer_timeout = Duration::from_millis(500));
    let sock = dir.join("nbd.sock");
    let trickle = |c: &Client<UnixStream>| {
        let mut w = c.s.try_clone().unwrap();
        std::thread::spawn(move || {
            let t = Instant::now();
            // Stops once the server shut its side (EPIPE) or after 4 s.
            while t.elapsed() < Duration::from_secs(4) && w.write_all(&[7]).is_ok() {
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };

    let mut c = transmitting(&sock);
    let t = Instant::now();
    c.request(CMD_WRITE, 0, 9, 0, 4096, &[]);
    let writer = trickle(&c);
    assert_eq!(c.simple(0), (NBD_EIO, 9, vec![]));
    eof_within(&mut c, "a trickled write");
    let waited = t.elapsed();
    assert!(waited >= Duration::from_millis(450) && waited < Duration::from_secs(3), "cut after {waited:?}");
    writer.join().unwrap();

    let mut c = transmitting(&sock);
    let t = Instant::now();
    c.send(&encode_request(&Request { flags: 0, command: CMD_READ, cookie: 1, offset: 0, len: 512 })[..1]);
    let writer = trickle(&c);
    eof_within(&mut c, "a trickled request header");
    assert!(t.elapsed() >= Duration::from_millis(450), "cut after {:?}", t.elapsed());
    writer.join().unwrap();

    // A write that arrives in time is untouched.
    let mut c = transmitting(&sock);
    c.request(CMD_WRITE, 0, 2, 0, 4096, &[5; 4096]);
    assert_eq!(c.simple(0), (0, 2, vec![]));
    eventually("the timeouts to be counted", || server.stats().request_timeouts == 2);
    let st = server.stats();
    assert_eq!((st.io_timeouts, st.session_errors, st.reply_timeouts), (0, 0, 0), "{st:?}");
}

/// (j) A client that reads a reply a byte at a time is cut at the reply's
/// deadline, freeing its buffer.
#[test]
fn slowly_read_reply_is_cut_at_its_deadline() {
    let dir = TempDir::new("slowread");
    let server = server(&dir, |c| c.transfer_timeout = Duration::from_millis(500));
    let mut c = transmitting(&dir.join("nbd.sock"));
    let t = Instant::now();
    // 1 MiB: far more than the socket buffers; its deadline is 2.5 s.
    c.request(CMD_READ, 0, 1, 0, 1 << 20, &[]);
    let mut r = c.s.try_clone().unwrap();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop = std::sync::Arc::clone(&done);
    let reader = std::thread::spawn(move || {
        let mut b = [0u8; 1];
        // What was queued before the cut still comes: stop when told.
        while !stop.load(std::sync::atomic::Ordering::Relaxed) && matches!(r.read(&mut b), Ok(1)) {
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    eventually("the reply to be cut", || server.stats().reply_timeouts == 1);
    let waited = t.elapsed();
    assert!(waited >= Duration::from_secs(2), "cut after {waited:?}");
    eventually("the buffer to be given back", || server.stats().buffered_bytes == 0);
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    reader.join().unwrap();
    let st = server.stats();
    assert_eq!((st.io_timeouts, st.session_errors, st.request_timeouts), (0, 0, 0), "{st:?}");
}

/// Requests larger than a chunk are received, stored, read and sent a
/// chunk at a time: the data round-trips (simple and structured replies,
/// one `OFFSET_DATA` chunk), and the connection holds one chunk of the
/// budget at most.
#[test]
fn large_requests_go_in_chunks() {
    const LEN: usize = (5 << 20) + 123;
    let dir = TempDir::new("chunks");
    let server =
        ServerHandle::start(NbdConfig::new(disk(pool_device("disk", 16 * MIB)), Listen::Unix(dir.join("nbd.sock"))))
            .expect("start server");
    let data: Vec<u8> = (0..LEN).map(|i| u8::try_from(i % 251).unwrap()).collect();
    let len = u32::try_from(LEN).unwrap();
    let mut c = client(&dir.join("nbd.sock"));
    c.start(BOTH);
    c.opt(OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(c.opt_reply().kind, REP_ACK);
    go(&mut c, "");
    c.request(CMD_WRITE, CMD_FLAG_FUA, 1, 4097, len, &data);
    let ch = c.chunk();
    assert_eq!((ch.flags, ch.kind, ch.cookie), (REPLY_FLAG_DONE, REPLY_TYPE_NONE, 1));
    c.request(CMD_READ, CMD_FLAG_DF, 2, 4097, len, &[]);
    let ch = c.chunk();
    assert_eq!((ch.flags, ch.kind, ch.cookie, ch.payload.len()), (REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, 2, LEN + 8));
    assert_eq!(be64(&ch.payload), 4097);
    assert!(ch.payload[8..] == data[..], "structured read differs");
    let mut s = transmitting(&dir.join("nbd.sock"));
    s.request(CMD_READ, 0, 3, 4097, len, &[]);
    let (err, cookie, got) = s.simple(LEN);
    assert_eq!((err, cookie), (0, 3));
    assert!(got == data, "simple read differs");
    let st = server.stats();
    assert!(st.buffered_bytes_peak <= MIB + 28, "peak {} bytes buffered", st.buffered_bytes_peak);
    let e = &st.exports[0];
    assert_eq!((e.bytes_written, e.bytes_read, st.session_errors), (u64::from(len), 2 * u64::from(len), 0));
}

#[test]
fn limits_are_validated() {
    let dir = TempDir::new("limitcfg");
    type Change = fn(&mut NbdConfig);
    let cases: [(&str, Change); 11] = [
        ("zero handshake timeout", |c| c.handshake_timeout = Duration::ZERO),
        ("zero io timeout", |c| c.io_timeout = Duration::ZERO),
        ("zero idle timeout", |c| c.idle_timeout = Some(Duration::ZERO)),
        ("zero idle reclaim", |c| c.idle_reclaim = Some(Duration::ZERO)),
        ("zero transfer timeout", |c| c.transfer_timeout = Duration::ZERO),
        ("zero buffer wait", |c| c.buffer_wait = Duration::ZERO),
        ("no connections", |c| c.max_connections = 0),
        ("no connections per client", |c| c.max_connections_per_peer = 0),
        ("block size below 4096", |c| c.max_block_size = 2048),
        ("block size over 32 MiB", |c| c.max_block_size = MAX_PAYLOAD + 4096),
        ("budget below one chunk", |c| c.max_buffered_bytes = 1 << 20),
    ];
    for (what, f) in cases {
        let mut cfg = NbdConfig::new(disk(pool_device("d", MIB)), Listen::Unix(dir.join("nbd.sock")));
        f(&mut cfg);
        let r = NbdServer::bind(cfg);
        assert!(matches!(r, Err(NbdError::Config(_))), "{what}: {r:?}");
    }
    let cfg = NbdConfig::new(disk(pool_device("d", MIB)), Listen::Unix(dir.join("nbd.sock")));
    assert_eq!(
        (cfg.max_connections, cfg.handshake_timeout, cfg.idle_timeout, cfg.io_timeout),
        (64, Duration::from_secs(10), None, Duration::from_secs(30))
    );
    assert_eq!((cfg.max_block_size, cfg.max_buffered_bytes), (32 << 20, 256 << 20));
    assert_eq!((cfg.max_connections_per_peer, cfg.idle_reclaim), (32, Some(Duration::from_secs(30))));
    assert_eq!((cfg.transfer_timeout, cfg.buffer_wait), (Duration::from_secs(10), Duration::from_secs(30)));
}
