//! The control socket's server.
//!
//! Each client gets a thread of its own, and at most [`MAX_CLIENTS`] are
//! served at once. A client must send its whole request within
//! [`CLIENT_TIMEOUT`], and read its whole answer within as long again: a
//! total, not a timeout per read, so a client that sends a byte every few
//! seconds is cut off too (finding: 16 such clients kept `stat`, `set` and
//! `swap down` answering "busy" indefinitely). When every slot is taken, a
//! new client takes the slot of the oldest one that is not being handled
//! (still sending its request, or reading its answer), which is cut off;
//! only when all [`MAX_CLIENTS`] requests are being handled is it answered
//! "busy" at once. So slow or silent clients never keep the daemon's owner
//! out: a client that sends its request at once is read long before
//! [`MAX_CLIENTS`] newer ones could make it the oldest. Only the daemon's
//! own user may talk to it: the socket is 0600 in a 0700 directory, and the
//! peer's uid is checked.

use std::net::Shutdown;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tmem_ctl::{Request, Response};
use tmem_lock::{Mutex, Rank};

/// Clients served at once.
pub const MAX_CLIENTS: usize = 16;
/// How long a client may take to send its whole request, and to read its whole answer.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(5);

/// The answer to a request whose handler panicked.
pub const PANICKED: &str =
    "internal error: the daemon panicked while handling this request (its log has the backtrace); it serves on";

/// What answers requests.
pub trait Handler: Send + Sync {
    /// Answers one request.
    fn handle(&self, req: Request) -> Response;
    /// Called once the answer to `req` was written (or could not be).
    fn answered(&self, req: &Request);
}

/// Serves `listener` on a thread of its own, for the life of the process.
pub fn spawn(listener: UnixListener, handler: Arc<dyn Handler>) -> std::io::Result<()> {
    spawn_with(listener, handler, CLIENT_TIMEOUT)
}

/// [`spawn`] with another time per request (tests).
fn spawn_with(listener: UnixListener, handler: Arc<dyn Handler>, timeout: Duration) -> std::io::Result<()> {
    let clients = Arc::new(Clients { timeout, slots: Mutex::new(Rank::ControlClients, Slots::default()) });
    std::thread::Builder::new().name("tmem-ctl".into()).spawn(move || serve(&listener, &handler, &clients)).map(drop)
}

/// One client being served.
#[derive(Debug)]
struct Slot {
    id: u64,
    /// When it connected, or its answer started: the oldest is cut off first.
    since: Instant,
    /// Another handle on its socket, to cut it off.
    stream: UnixStream,
    /// Its request is being handled: it is not cut off then.
    handling: bool,
}

#[derive(Debug, Default)]
struct Slots {
    next_id: u64,
    taken: Vec<Slot>,
}

/// The clients being served, and the time each has per request and per answer.
#[derive(Debug)]
struct Clients {
    timeout: Duration,
    slots: Mutex<Slots>,
}

impl Clients {
    /// A slot for `stream`, taken from the oldest client not being handled
    /// when all are taken; `None` when all are being handled.
    fn admit(&self, stream: UnixStream) -> Option<u64> {
        let mut g = self.slots.lock();
        if g.taken.len() >= MAX_CLIENTS {
            let oldest =
                g.taken.iter().enumerate().filter(|(_, s)| !s.handling).min_by_key(|(_, s)| s.since).map(|(i, _)| i)?;
            let cut = g.taken.swap_remove(oldest);
            // Its thread's read or write fails at once, and it ends.
            let _ = cut.stream.shutdown(Shutdown::Both);
        }
        g.next_id += 1;
        let id = g.next_id;
        g.taken.push(Slot { id, since: Instant::now(), stream, handling: false });
        Some(id)
    }

    /// Marks client `id` as being handled or not; false if it was cut off.
    fn set_handling(&self, id: u64, handling: bool) -> bool {
        let mut g = self.slots.lock();
        let Some(slot) = g.taken.iter_mut().find(|s| s.id == id) else { return false };
        slot.handling = handling;
        slot.since = Instant::now();
        true
    }

    fn leave(&self, id: u64) {
        self.slots.lock().taken.retain(|s| s.id != id);
    }
}

fn serve(listener: &UnixListener, handler: &Arc<dyn Handler>, clients: &Arc<Clients>) {
    for conn in listener.incoming() {
        let Ok(stream) = conn else { continue };
        if !peer_is_owner(&stream) {
            reply(&stream, &Response::err("permission denied: not the daemon's owner"), clients.timeout);
            continue;
        }
        let Ok(handle) = stream.try_clone() else { continue };
        let Some(id) = clients.admit(handle) else {
            let busy = format!("busy: {MAX_CLIENTS} control requests are being handled; try again");
            reply(&stream, &Response::err(busy), clients.timeout);
            continue;
        };
        let (h, c) = (Arc::clone(handler), Arc::clone(clients));
        let spawned = std::thread::Builder::new().name("tmem-ctl-client".into()).spawn(move || {
            // The slot holds a handle on the socket, and the client sees the
            // end of its answer only once every handle is closed: leave on
            // every way out.
            let _leave = scopeguard::guard((), |()| c.leave(id));
            serve_client(&stream, h.as_ref(), &c, id);
        });
        if spawned.is_err() {
            clients.leave(id);
        }
    }
}

fn serve_client(stream: &UnixStream, handler: &dyn Handler, clients: &Clients, id: u64) {
    match tmem_ctl::read_request(stream, clients.timeout) {
        Ok(req) => {
            if !clients.set_handling(id, true) {
                return;
            }
            // A panic fails this request alone; the daemon serves on.
            let resp = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler.handle(req.clone())))
                .unwrap_or_else(|_| Response::err(PANICKED));
            clients.set_handling(id, false);
            reply(stream, &resp, clients.timeout);
            handler.answered(&req);
        }
        Err(e) => reply(stream, &Response::err(e), clients.timeout),
    }
}

/// Writes `resp`, all of it within `within` (a total, as for requests).
fn reply(stream: &UnixStream, resp: &Response, within: Duration) {
    let deadline = Instant::now() + within;
    let line = resp.to_line();
    let mut rest = line.as_bytes();
    while !rest.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || stream.set_write_timeout(Some(left)).is_err() {
            return;
        }
        match std::io::Write::write(&mut &*stream, rest) {
            Ok(0) => return,
            Ok(n) => rest = &rest[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

/// Only the daemon's own user (root) may control it.
pub(crate) fn peer_is_owner(s: &UnixStream) -> bool {
    rustix::net::sockopt::socket_peercred(s).is_ok_and(|c| c.uid == rustix::process::geteuid())
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::time::Instant;

    use super::*;

    /// Counts requests; while `hold` is set, each request waits until it is cleared.
    struct Counter {
        entered: AtomicU64,
        served: AtomicU64,
        hold: AtomicBool,
    }

    impl Handler for Counter {
        fn handle(&self, req: Request) -> Response {
            assert!(!matches!(req, Request::Down), "down panics in these tests");
            self.entered.fetch_add(1, Ordering::AcqRel);
            while self.hold.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(5));
            }
            self.served.fetch_add(1, Ordering::Relaxed);
            Response::ok(serde_json::json!(format!("{req:?}")))
        }
        fn answered(&self, _: &Request) {}
    }

    fn server_with(timeout: Duration) -> (tempfile::TempDir, Arc<Counter>) {
        let dir = tempfile::tempdir().unwrap();
        let listener = UnixListener::bind(dir.path().join(tmem_ctl::SOCKET)).unwrap();
        let h =
            Arc::new(Counter { entered: AtomicU64::new(0), served: AtomicU64::new(0), hold: AtomicBool::new(false) });
        spawn_with(listener, Arc::clone(&h) as Arc<dyn Handler>, timeout).unwrap();
        (dir, h)
    }

    fn server() -> (tempfile::TempDir, Arc<Counter>) {
        server_with(CLIENT_TIMEOUT)
    }

    /// A client that sends one byte of a request every `every` until dropped.
    fn drip(dir: &std::path::Path, every: Duration) -> (Arc<AtomicBool>, std::thread::JoinHandle<()>) {
        let stop = Arc::new(AtomicBool::new(false));
        let mut s = UnixStream::connect(dir.join(tmem_ctl::SOCKET)).unwrap();
        let st = Arc::clone(&stop);
        let t = std::thread::spawn(move || {
            for byte in b"{\"cmd\":\"stat\"".iter().cycle() {
                if st.load(Ordering::Acquire) || s.write_all(&[*byte]).is_err() {
                    return;
                }
                std::thread::sleep(every);
            }
        });
        (stop, t)
    }

    /// Finding: one silent client blocked every control command.
    #[test]
    fn silent_clients_delay_nobody() {
        let (dir, h) = server();
        let silent: Vec<UnixStream> =
            (0..3).map(|_| UnixStream::connect(dir.path().join(tmem_ctl::SOCKET)).unwrap()).collect();
        let t = Instant::now();
        for _ in 0..5 {
            tmem_ctl::call_ok(dir.path(), &Request::Stat, Duration::from_secs(2)).unwrap();
        }
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        assert_eq!(h.served.load(Ordering::Relaxed), 5);
        drop(silent);
    }

    /// Finding: a request whose handler panicked (a counter underflow in
    /// `swap down`) was never answered, and its slot held a handle on the
    /// socket, so `tmem swap down` waited its whole hour. Now the client
    /// gets an error at once, and more panics than slots take none.
    #[test]
    fn a_panicking_request_is_answered_and_frees_its_slot() {
        let (dir, h) = server();
        for _ in 0..=MAX_CLIENTS {
            let t = Instant::now();
            let e = tmem_ctl::call_ok(dir.path(), &Request::Down, Duration::from_secs(10)).unwrap_err();
            assert!(e.to_string().contains(PANICKED), "{e}");
            assert!(t.elapsed() < Duration::from_secs(2), "answered after {:?}", t.elapsed());
        }
        tmem_ctl::call_ok(dir.path(), &Request::Stat, Duration::from_secs(2)).unwrap();
        assert_eq!(h.served.load(Ordering::Relaxed), 1);
    }

    /// Finding: 16 clients that each sent a byte every 4 s (under the 5 s
    /// timeout per read) kept every request "busy" indefinitely.
    #[test]
    fn dripping_clients_cannot_keep_the_owner_out() {
        let (dir, h) = server_with(Duration::from_millis(500));
        let drips: Vec<_> = (0..MAX_CLIENTS).map(|_| drip(dir.path(), Duration::from_millis(100))).collect();
        std::thread::sleep(Duration::from_millis(200));
        // A fresh client takes the oldest dripping client's slot at once.
        let t = Instant::now();
        for _ in 0..3 {
            tmem_ctl::call_ok(dir.path(), &Request::Stat, Duration::from_secs(2)).unwrap();
        }
        assert!(t.elapsed() < Duration::from_millis(500), "{:?}", t.elapsed());
        assert_eq!(h.served.load(Ordering::Relaxed), 3);
        // Past the deadline every dripping client has been cut off, whatever it sends.
        std::thread::sleep(Duration::from_millis(800));
        for (stop, t) in drips {
            assert!(t.is_finished(), "a dripping client still holds its slot after the deadline");
            stop.store(true, Ordering::Release);
            t.join().unwrap();
        }
    }

    /// Clients that connect again whenever they find they were cut off
    /// take slots from each other, not from a fresh client.
    #[test]
    fn reconnecting_clients_do_not_keep_the_owner_out() {
        let (dir, h) = server_with(Duration::from_millis(500));
        let stop = Arc::new(AtomicBool::new(false));
        let drips: Vec<_> = (0..MAX_CLIENTS)
            .map(|_| {
                let (sock, stop) = (dir.path().join(tmem_ctl::SOCKET), Arc::clone(&stop));
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Acquire) {
                        let Ok(mut s) = UnixStream::connect(&sock) else { return };
                        while !stop.load(Ordering::Acquire) && s.write_all(b"{").is_ok() {
                            std::thread::sleep(Duration::from_millis(50));
                        }
                    }
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        for i in 0..10 {
            let t = Instant::now();
            let r = tmem_ctl::call_ok(dir.path(), &Request::Stat, Duration::from_secs(2));
            assert!(r.is_ok() && t.elapsed() < Duration::from_millis(500), "call {i}: {r:?} after {:?}", t.elapsed());
            std::thread::sleep(Duration::from_millis(70));
        }
        assert_eq!(h.served.load(Ordering::Relaxed), 10);
        stop.store(true, Ordering::Release);
        for t in drips {
            t.join().unwrap();
        }
    }

    /// A client cut off for slowness is told why when it is still listening.
    #[test]
    fn a_slow_request_is_refused_at_the_deadline() {
        let (dir, h) = server_with(Duration::from_millis(300));
        let mut s = UnixStream::connect(dir.path().join(tmem_ctl::SOCKET)).unwrap();
        s.write_all(b"{\"cmd\":").unwrap();
        let t = Instant::now();
        let mut answer = String::new();
        std::io::Read::read_to_string(&mut s, &mut answer).unwrap();
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        assert!(answer.contains("did not arrive whole within 0.3 s"), "{answer}");
        assert_eq!(h.served.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn too_many_requests_being_handled_are_told_busy_at_once() {
        let (dir, h) = server();
        h.hold.store(true, Ordering::Release);
        let held: Vec<_> = (0..MAX_CLIENTS)
            .map(|_| {
                let dir = dir.path().to_owned();
                std::thread::spawn(move || tmem_ctl::call_ok(&dir, &Request::Stat, Duration::from_secs(10)))
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(5);
        while h.entered.load(Ordering::Acquire) < MAX_CLIENTS as u64 {
            assert!(Instant::now() < deadline, "the requests were not all taken");
            std::thread::sleep(Duration::from_millis(10));
        }
        let t = Instant::now();
        let e = tmem_ctl::call_ok(dir.path(), &Request::Stat, Duration::from_secs(2)).unwrap_err();
        assert!(e.to_string().contains("busy"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        h.hold.store(false, Ordering::Release);
        for t in held {
            t.join().unwrap().unwrap();
        }
        // Once they are answered, requests are served again.
        tmem_ctl::call_ok(dir.path(), &Request::Stat, Duration::from_secs(2)).unwrap();
    }

    #[test]
    fn bad_and_oversized_requests_get_one_clear_error() {
        let (dir, h) = server();
        let mut s = UnixStream::connect(dir.path().join(tmem_ctl::SOCKET)).unwrap();
        s.write_all(b"{\"cmd\":\"reboot\"}\n").unwrap();
        let mut answer = String::new();
        std::io::Read::read_to_string(&mut s, &mut answer).unwrap();
        let r: Response = serde_json::from_str(&answer).unwrap();
        assert!(!r.ok && r.error.unwrap().contains("bad request"));
        let mut s = UnixStream::connect(dir.path().join(tmem_ctl::SOCKET)).unwrap();
        let _ = s.write_all(&vec![b'{'; tmem_ctl::MAX_REQUEST + 1]);
        // The server closes with our excess unread, which resets the socket
        // after its answer: read what arrived before the reset.
        let mut answer = vec![0u8; 4096];
        let n = std::io::Read::read(&mut s, &mut answer).unwrap();
        let answer = String::from_utf8_lossy(&answer[..n]);
        assert!(answer.contains("longer than"), "{answer}");
        assert_eq!(h.served.load(Ordering::Relaxed), 0);
    }
}
