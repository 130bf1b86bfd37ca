//! The control socket's server.
//!
//! Each client gets a thread of its own, with read and write timeouts, and
//! at most [`MAX_CLIENTS`] are served at once; one more is answered "busy"
//! at once. So a client that connects and says nothing costs one thread for
//! [`CLIENT_TIMEOUT`] and delays nobody (finding: one silent client used to
//! block every control command). Only the daemon's own user may talk to it:
//! the socket is 0600 in a 0700 directory, and the peer's uid is checked.

use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tmem_ctl::{Request, Response};

/// Clients served at once.
pub const MAX_CLIENTS: usize = 16;
/// How long a client may take to send its request or read its answer.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(5);

/// What answers requests.
pub trait Handler: Send + Sync {
    /// Answers one request.
    fn handle(&self, req: Request) -> Response;
    /// Called once the answer to `req` was written (or could not be).
    fn answered(&self, req: &Request);
}

/// Serves `listener` on a thread of its own, for the life of the process.
pub fn spawn(listener: UnixListener, handler: Arc<dyn Handler>) -> std::io::Result<()> {
    std::thread::Builder::new().name("tmem-ctl".into()).spawn(move || serve(&listener, &handler)).map(drop)
}

fn serve(listener: &UnixListener, handler: &Arc<dyn Handler>) {
    let active = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        let Ok(stream) = conn else { continue };
        if stream.set_read_timeout(Some(CLIENT_TIMEOUT)).and(stream.set_write_timeout(Some(CLIENT_TIMEOUT))).is_err() {
            continue;
        }
        if !peer_is_owner(&stream) {
            reply(&stream, &Response::err("permission denied: not the daemon's owner"));
            continue;
        }
        if active.fetch_add(1, Ordering::AcqRel) >= MAX_CLIENTS {
            active.fetch_sub(1, Ordering::AcqRel);
            reply(&stream, &Response::err(format!("busy: {MAX_CLIENTS} control clients are being served; try again")));
            continue;
        }
        let (h, a) = (Arc::clone(handler), Arc::clone(&active));
        let spawned = std::thread::Builder::new().name("tmem-ctl-client".into()).spawn(move || {
            serve_client(&stream, h.as_ref());
            a.fetch_sub(1, Ordering::AcqRel);
        });
        if spawned.is_err() {
            active.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

fn serve_client(stream: &UnixStream, handler: &dyn Handler) {
    match tmem_ctl::read_request(stream) {
        Ok(req) => {
            let resp = handler.handle(req.clone());
            reply(stream, &resp);
            handler.answered(&req);
        }
        Err(e) => reply(stream, &Response::err(e)),
    }
}

fn reply(stream: &UnixStream, resp: &Response) {
    let _ = std::io::Write::write_all(&mut &*stream, resp.to_line().as_bytes());
}

/// Only the daemon's own user (root) may control it.
pub(crate) fn peer_is_owner(s: &UnixStream) -> bool {
    rustix::net::sockopt::socket_peercred(s).is_ok_and(|c| c.uid == rustix::process::geteuid())
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::atomic::AtomicU64;
    use std::time::Instant;

    use super::*;

    struct Counter(AtomicU64);

    impl Handler for Counter {
        fn handle(&self, req: Request) -> Response {
            self.0.fetch_add(1, Ordering::Relaxed);
            Response::ok(serde_json::json!(format!("{req:?}")))
        }
        fn answered(&self, _: &Request) {}
    }

    fn server() -> (tempfile::TempDir, Arc<Counter>) {
        let dir = tempfile::tempdir().unwrap();
        let listener = UnixListener::bind(dir.path().join(tmem_ctl::SOCKET)).unwrap();
        let h = Arc::new(Counter(AtomicU64::new(0)));
        spawn(listener, Arc::clone(&h) as Arc<dyn Handler>).unwrap();
        (dir, h)
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
        assert_eq!(h.0.load(Ordering::Relaxed), 5);
        drop(silent);
    }

    #[test]
    fn too_many_clients_are_told_busy_at_once() {
        let (dir, _h) = server();
        let silent: Vec<UnixStream> =
            (0..MAX_CLIENTS).map(|_| UnixStream::connect(dir.path().join(tmem_ctl::SOCKET)).unwrap()).collect();
        std::thread::sleep(Duration::from_millis(200));
        let t = Instant::now();
        let e = tmem_ctl::call_ok(dir.path(), &Request::Stat, Duration::from_secs(2)).unwrap_err();
        assert!(e.to_string().contains("busy"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(1));
        drop(silent);
        // Once they are gone, requests are served again.
        let deadline = Instant::now() + Duration::from_secs(3);
        while tmem_ctl::call_ok(dir.path(), &Request::Stat, Duration::from_secs(2)).is_err() {
            assert!(Instant::now() < deadline, "still busy after the clients left");
            std::thread::sleep(Duration::from_millis(20));
        }
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
        assert_eq!(h.0.load(Ordering::Relaxed), 0);
    }
}
