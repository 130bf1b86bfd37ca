//! A store's background thread: runs one job every period until dropped.
//! Writeback and recompression are such jobs; the put path never waits for
//! either.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use tmem_lock::{Condvar, Mutex, Rank};

/// A background thread of the store, stopped (and joined) when dropped.
pub struct Worker {
    stop: Arc<(Mutex<bool>, Condvar)>,
    running: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// Handed to a job: whether the worker is being stopped, so a long pass can
/// end early.
#[derive(Clone)]
pub(super) struct StopFlag(Arc<(Mutex<bool>, Condvar)>);

impl StopFlag {
    pub(super) fn is_set(&self) -> bool {
        *self.0 .0.lock()
    }
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").field("running", &self.is_running()).finish_non_exhaustive()
    }
}

impl Worker {
    /// Starts thread `name`, which runs `job` every `period` (and at once)
    /// until the worker is dropped. `nice` lowers the thread's CPU priority
    /// (0 keeps it).
    pub(super) fn start(
        name: &str,
        period: Duration,
        nice: i32,
        mut job: impl FnMut(&StopFlag) + Send + 'static,
    ) -> Self {
        let stop = Arc::new((Mutex::new(Rank::WorkerStop, false), Condvar::new()));
        let running = Arc::new(AtomicBool::new(true));
        let (flag, r2) = (StopFlag(Arc::clone(&stop)), Arc::clone(&running));
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                if nice != 0 {
                    // On Linux a thread id names one thread for setpriority.
                    // Best effort: at worst it runs at the daemon's priority.
                    let _ = rustix::process::setpriority_process(Some(rustix::thread::gettid()), nice);
                }
                let (m, cv) = &*flag.0;
                loop {
                    let mut g = m.lock();
                    if !*g {
                        cv.wait_for(&mut g, period);
                    }
                    if *g {
                        break;
                    }
                    drop(g);
                    job(&flag);
                }
                r2.store(false, Ordering::Release);
            })
            .unwrap_or_else(|e| panic!("spawn the {name} thread: {e}"));
        Self { stop, running, thread: Some(thread) }
    }

    /// Whether the thread is alive.
    pub fn is_running(&self) -> bool {
        self.running.load(Ordering::Acquire)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let (m, cv) = &*self.stop;
        *m.lock() = true;
        cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
