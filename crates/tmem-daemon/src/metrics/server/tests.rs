//! The endpoint's limits, each against the attack it answers: real
//! sockets on loopback, bounded in time.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::metrics::tests::{device, LOOPBACK};

fn source() -> Source {
    Arc::new(|| vec![device("swap0")])
}

/// This process's resident set, from /proc/self/status.
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").unwrap().count()
}

/// A whole scrape on a fresh connection, timed.
fn scrape(server: &MetricsServer) -> (String, Duration) {
    let t = Instant::now();
    let mut s = TcpStream::connect(server.addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(s, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut r = String::new();
    s.read_to_string(&mut r).unwrap();
    (r, t.elapsed())
}

/// Polls `f` until it holds or `within` passes.
fn eventually(within: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + within;
    while Instant::now() < end {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    f()
}

/// Whether the server has closed `s` (EOF or a reset), reading what it sent.
fn closed(s: &mut TcpStream, within: Duration) -> bool {
    s.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0u8; 65536];
    let end = Instant::now() + within;
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) if Instant::now() < end => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return true,
            _ => return false,
        }
    }
}

#[test]
fn a_never_ending_request_head_is_cut_at_its_cap() {
    let server = MetricsServer::start(LOOPBACK, false, source()).unwrap();
    // One scrape first: the thread's stack and the runtime are warm.
    assert!(scrape(&server).0.starts_with("HTTP/1.1 200"));
    let chunk = vec![b'a'; 64 << 10];
    let before = rss_bytes();
    let mut s = TcpStream::connect(server.addr()).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nX-Long: ").unwrap();
    let mut sent = 0_usize;
    while sent < 256 << 20 {
        match s.write(&chunk) {
            Ok(n) => sent += n,
            Err(_) => break,
        }
    }
    assert!(sent < 64 << 20, "the server took {sent} bytes of one request head");
    assert!(closed(&mut s, Duration::from_secs(2)), "the connection stayed open");
    let grew = rss_bytes().saturating_sub(before);
    eprintln!("a never-ending head: cut after {sent} bytes sent, RSS grew by {grew} bytes");
    assert!(grew <= 1 << 20, "RSS grew by {grew} bytes");
    assert!(eventually(Duration::from_secs(2), || server.stats().head_too_large == 1), "{:?}", server.stats());
    // Still serving.
    assert!(scrape(&server).0.starts_with("HTTP/1.1 200"));
}

#[test]
fn an_unread_pipeline_delays_neither_a_scrape_nor_shutdown() {
    let limits = Limits { write_timeout: Duration::from_secs(1), ..Limits::default() };
    let server = MetricsServer::start_with(LOOPBACK, false, source(), limits).unwrap();
    let mut s = TcpStream::connect(server.addr()).unwrap();
    s.set_nonblocking(true).unwrap();
    let get = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n".repeat(2000);
    let mut off = 0;
    let end = Instant::now() + Duration::from_secs(2);
    while off < get.len() && Instant::now() < end {
        match s.write(&get[off..]) {
            Ok(n) => off += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => panic!("{e}"),
        }
    }
    assert!(eventually(Duration::from_secs(2), || server.stats().requests >= 2), "{:?}", server.stats());
    let (answer, took) = scrape(&server);
    assert!(answer.starts_with("HTTP/1.1 200") && took < Duration::from_secs(1), "{took:?}: {answer:.80}");
    // The stalled reply closes its connection at the write deadline.
    assert!(eventually(Duration::from_secs(3), || server.stats().write_timeouts == 1), "{:?}", server.stats());
    // A second one, then stop while it is stalled.
    let mut s2 = TcpStream::connect(server.addr()).unwrap();
    s2.set_nonblocking(true).unwrap();
    let _ = s2.write(&get);
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    server.stop();
    assert!(t.elapsed() < Duration::from_secs(1), "stop took {:?}", t.elapsed());
    drop(s);
}

#[test]
fn a_thousand_slow_clients_get_no_thread_each_and_a_scrape_gets_in() {
    // 1,000 client sockets and the server's: raise the soft descriptor limit.
    let lim = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    rustix::process::setrlimit(
        rustix::process::Resource::Nofile,
        rustix::process::Rlimit { current: lim.maximum, maximum: lim.maximum },
    )
    .unwrap();
    let server = MetricsServer::start(LOOPBACK, false, source()).unwrap();
    let base = threads();
    let mut clients = Vec::new();
    for _ in 0..1000 {
        let mut s = TcpStream::connect(server.addr()).unwrap();
        s.write_all(b"GET /metr").unwrap();
        clients.push(s);
    }
    assert!(eventually(Duration::from_secs(5), || server.stats().connections == 1000), "{:?}", server.stats());
    let (answer, took) = scrape(&server);
    assert!(answer.starts_with("HTTP/1.1 200") && took < Duration::from_secs(1), "{took:?}: {answer:.80}");
    assert!(threads() <= base, "{} threads, {base} before", threads());
    let st = server.stats();
    assert!(st.connections_open <= 16 && st.connections_evicted >= 1000 - 16, "{st:?}");
    server.stop();
}

#[test]
fn a_dripped_request_head_is_cut_at_its_deadline() {
    let limits = Limits { head_timeout: Duration::from_millis(800), ..Limits::default() };
    let server = MetricsServer::start_with(LOOPBACK, false, source(), limits).unwrap();
    let mut s = TcpStream::connect(server.addr()).unwrap();
    let t = Instant::now();
    let mut cut = false;
    for b in b"GET /metrics HTTP/1.1\r\nHost: a-very-slow-client\r\n\r\n" {
        if s.write_all(&[*b]).is_err() {
            cut = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
        if server.stats().head_timeouts == 1 {
            cut = true;
            break;
        }
    }
    assert!(cut || server.stats().head_timeouts == 1, "a dripped head was served: {:?}", server.stats());
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert!(closed(&mut s, Duration::from_secs(2)));
    server.stop();
}

#[test]
fn an_idle_connection_is_closed_before_and_after_a_request() {
    let limits = Limits { idle_timeout: Duration::from_millis(500), ..Limits::default() };
    let server = MetricsServer::start_with(LOOPBACK, false, source(), limits).unwrap();
    // Silent from the start.
    let mut quiet = TcpStream::connect(server.addr()).unwrap();
    // One request with keep-alive, then silence.
    let mut kept = TcpStream::connect(server.addr()).unwrap();
    write!(kept, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let t = Instant::now();
    assert!(closed(&mut quiet, Duration::from_secs(3)) && closed(&mut kept, Duration::from_secs(3)));
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    let st = server.stats();
    assert_eq!((st.idle_timeouts, st.requests), (2, 1), "{st:?}");
    server.stop();
}

#[test]
fn a_non_loopback_address_needs_allow_remote() {
    let any: SocketAddr = "0.0.0.0:9848".parse().unwrap();
    let e = check_address(any, false).unwrap_err().to_string();
    assert!(e.contains("0.0.0.0:9848") && e.contains("--allow-remote-metrics"), "{e}");
    check_address(any, true).unwrap();
    check_address("[::1]:9848".parse().unwrap(), false).unwrap();
    assert!(MetricsServer::start(any, false, source()).is_err());
}

#[test]
fn the_limits_are_in_the_exposition() {
    let server = MetricsServer::start(LOOPBACK, false, source()).unwrap();
    let (answer, _) = scrape(&server);
    for line in [
        "tmem_metrics_connections_max 16",
        "tmem_metrics_head_max_bytes 8192",
        "tmem_metrics_requests_total 1",
        "tmem_metrics_head_too_large_total 0",
    ] {
        assert!(answer.contains(line), "no {line} in {answer}");
    }
    server.stop();
}

#[test]
fn openmetrics_is_chosen_by_any_accept_value() {
    assert!(wants_openmetrics(["text/plain", "application/openmetrics-text;version=1.0.0"].into_iter()));
    assert!(!wants_openmetrics(["text/plain"].into_iter()));
    assert!(!wants_openmetrics(std::iter::empty()));
}
