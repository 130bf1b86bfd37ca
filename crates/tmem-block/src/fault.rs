//! Injected panics, for tests only: this module exists only with the
//! `fault-injection` feature, which the release binary never has.
//!
//! - `TMEM_FAULT_PANIC_READ_PAGE=N`: reading page N panics.
//! - `TMEM_FAULT_PANIC_WRITE_PAGE=N`: writing page N panics.
//! - `TMEM_FAULT_PANIC_WRITE_EVERY=K`: every K-th page written panics.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

struct Faults {
    read_page: Option<u64>,
    write_page: Option<u64>,
    write_every: Option<u64>,
    writes: AtomicU64,
}

fn faults() -> &'static Faults {
    static F: OnceLock<Faults> = OnceLock::new();
    F.get_or_init(|| {
        let var = |name: &str| std::env::var(name).ok().and_then(|v| v.parse().ok());
        Faults {
            read_page: var("TMEM_FAULT_PANIC_READ_PAGE"),
            write_page: var("TMEM_FAULT_PANIC_WRITE_PAGE"),
            write_every: var("TMEM_FAULT_PANIC_WRITE_EVERY").filter(|&k| k > 0),
            writes: AtomicU64::new(0),
        }
    })
}

pub(crate) fn on_read(page: u64) {
    if faults().read_page == Some(page) {
        panic!("fault injection: read of page {page}");
    }
}

pub(crate) fn on_write(page: u64) {
    let f = faults();
    if f.write_page == Some(page) {
        panic!("fault injection: write of page {page}");
    }
    if let Some(k) = f.write_every {
        let n = f.writes.fetch_add(1, Ordering::Relaxed) + 1;
        if n.is_multiple_of(k) {
            panic!("fault injection: page write {n} (every {k})");
        }
    }
}
