//! The gate a queue passes before it serves a request: open, requests go
//! through; closed (`tmem swap restart`), each queue stops before its next
//! request and waits, with the request still taken from the kernel, until
//! the gate opens again or the process hands the device over and ends (the
//! kernel then gives the request to the successor: `UBLK_F_USER_RECOVERY_REISSUE`).
//!
//! The open path is one atomic increment and one load: no lock per request.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// Open or closed, with the number of requests being served.
#[derive(Debug, Default)]
pub struct Gate {
    closed: AtomicBool,
    /// Requests past the gate and not yet done.
    inside: AtomicUsize,
    /// Held only to wait on `opened`.
    waiting: Mutex<()>,
    opened: Condvar,
}

/// A request past the gate; leaving drops it.
pub struct Pass<'a>(&'a Gate);

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        self.0.inside.fetch_sub(1, Ordering::Release);
    }
}

impl Gate {
    /// Waits while the gate is closed, then lets one request in.
    pub fn enter(&self) -> Pass<'_> {
        loop {
            // SeqCst on both sides: `close` stores `closed` then reads
            // `inside`, this adds to `inside` then reads `closed`; one of
            // the two sees the other.
            self.inside.fetch_add(1, Ordering::SeqCst);
            if !self.closed.load(Ordering::SeqCst) {
                return Pass(self);
            }
            self.inside.fetch_sub(1, Ordering::SeqCst);
            let mut g = self.waiting.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            while self.closed.load(Ordering::SeqCst) {
                g = self.opened.wait(g).unwrap_or_else(std::sync::PoisonError::into_inner);
            }
        }
    }

    /// Closes the gate and waits up to `within` for the requests inside to
    /// finish; `false` (the gate open again) if they did not.
    pub fn close(&self, within: Duration) -> bool {
        self.closed.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + within;
        while self.inside.load(Ordering::SeqCst) != 0 {
            if Instant::now() >= deadline {
                self.open();
                return false;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        true
    }

    /// Opens the gate; the queues waiting at it go on.
    pub fn open(&self) {
        let _g = self.waiting.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        self.closed.store(false, Ordering::SeqCst);
        self.opened.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_closed_gate_holds_new_requests_until_it_opens() {
        let gate = Arc::new(Gate::default());
        assert!(gate.close(Duration::from_secs(1)));
        let served = Arc::new(AtomicBool::new(false));
        let t = {
            let (gate, served) = (gate.clone(), served.clone());
            std::thread::spawn(move || {
                let _p = gate.enter();
                served.store(true, Ordering::SeqCst);
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!served.load(Ordering::SeqCst), "a request went through a closed gate");
        gate.open();
        t.join().unwrap();
        assert!(served.load(Ordering::SeqCst));
    }

    #[test]
    fn close_waits_for_the_request_inside_and_gives_up_past_its_time() {
        let gate = Gate::default();
        let pass = gate.enter();
        assert!(!gate.close(Duration::from_millis(20)), "closed with a request inside");
        // Given up: open again, so the request inside and new ones go on.
        drop(gate.enter());
        drop(pass);
        assert!(gate.close(Duration::from_millis(20)));
    }
}
