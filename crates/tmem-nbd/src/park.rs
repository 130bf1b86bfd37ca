//! Pausing sessions between two requests, so that a successor process can
//! take their connections over (`tmem swap restart`).
//!
//! A session in transmission calls [`Parking::before_request`] before it
//! reads each request, when nothing of the next one is buffered: it waits
//! there (in `poll`, on its socket and on a wake pipe) until a request comes,
//! or, while the server is paused, parks, recording what a successor needs
//! to go on ([`SessionState`]). [`Parking::pause`] returns once every session
//! has parked; the requests clients send meanwhile wait in the sockets.
//! Then the successor resumes each session from its state
//! (`NbdServer::adopt`), or this server resumes.

use std::collections::BTreeMap;
use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use tmem_lock::{Condvar, Mutex, Rank};

/// What a session negotiated: all a successor needs to serve its
/// connection from the next request on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SessionState {
    /// Index of the export in the server's list.
    pub export: usize,
    /// `NBD_OPT_STRUCTURED_REPLY` was acknowledged.
    pub structured: bool,
    /// The client negotiated `NBD_FLAG_C_NO_ZEROES`.
    pub no_zeroes: bool,
    /// `base:allocation` was selected (the export index it was selected for).
    pub meta: Option<usize>,
}

#[derive(Debug, Default)]
struct State {
    paused: bool,
    handed_over: bool,
    /// Parked sessions by connection id.
    parked: BTreeMap<u64, SessionState>,
}

/// The pause switch of one server, shared by its sessions.
#[derive(Debug)]
pub(crate) struct Parking {
    state: Mutex<State>,
    changed: Condvar,
    /// Readable while paused: wakes sessions out of `poll`.
    wake_rx: OwnedFd,
    wake_tx: OwnedFd,
}

/// A session's handle on its server's [`Parking`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Park<'a> {
    pub(crate) parking: &'a Parking,
    /// The connection's id in the server.
    pub(crate) id: u64,
    /// Its socket.
    pub(crate) fd: BorrowedFd<'a>,
}

impl Parking {
    pub(crate) fn new() -> io::Result<Self> {
        use rustix::pipe::PipeFlags;
        let (wake_rx, wake_tx) = rustix::pipe::pipe_with(PipeFlags::NONBLOCK | PipeFlags::CLOEXEC)?;
        Ok(Self { state: Mutex::new(Rank::NbdPark, State::default()), changed: Condvar::new(), wake_rx, wake_tx })
    }

    pub(crate) fn paused(&self) -> bool {
        self.state.lock().paused
    }

    /// Before a session reads its next request: returns `true` when one may
    /// be read, `false` once the session was handed over (it then ends
    /// without touching its socket).
    pub(crate) fn before_request(&self, park: Park<'_>, state: SessionState) -> bool {
        use rustix::event::{poll, PollFd, PollFlags};
        loop {
            {
                let mut s = self.state.lock();
                if s.paused {
                    s.parked.insert(park.id, state);
                    self.changed.notify_all();
                    while s.paused && !s.handed_over {
                        self.changed.wait(&mut s);
                    }
                    if s.handed_over {
                        return false;
                    }
                    s.parked.remove(&park.id);
                }
            }
            let mut fds = [PollFd::new(&park.fd, PollFlags::IN), PollFd::new(&self.wake_rx, PollFlags::IN)];
            match poll(&mut fds, None) {
                Ok(_) if !fds[0].revents().is_empty() => return true,
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                // The socket cannot be polled: let the read report it.
                Err(_) => return true,
            }
        }
    }

    /// Pauses: returns the parked sessions once `sessions()` of them have
    /// parked, or resumes and says why after `timeout`.
    pub(crate) fn pause(
        &self,
        sessions: impl Fn() -> usize,
        timeout: Duration,
    ) -> Result<BTreeMap<u64, SessionState>, String> {
        let deadline = Instant::now() + timeout;
        let mut s = self.state.lock();
        s.paused = true;
        let _ = rustix::io::write(&self.wake_tx, &[1]);
        loop {
            let want = sessions();
            if s.parked.len() >= want {
                return Ok(s.parked.clone());
            }
            if Instant::now() >= deadline {
                let parked = s.parked.len();
                drop(s);
                self.resume();
                return Err(format!(
                    "{parked} of {want} NBD sessions paused within {} ms (a client in its handshake, or with \
                     requests queued)",
                    timeout.as_millis()
                ));
            }
            self.changed.wait_for(&mut s, Duration::from_millis(10));
        }
    }

    /// Lets parked sessions go on.
    pub(crate) fn resume(&self) {
        let mut s = self.state.lock();
        s.paused = false;
        s.parked.clear();
        let mut b = [0u8; 64];
        while matches!(rustix::io::read(&self.wake_rx, &mut b), Ok(n) if n > 0) {}
        self.changed.notify_all();
    }

    /// Ends the parked sessions: a successor serves their connections now.
    pub(crate) fn handed_over(&self) {
        let mut s = self.state.lock();
        s.handed_over = true;
        self.changed.notify_all();
    }
}
