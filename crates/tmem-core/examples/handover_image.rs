//! What a zero-copy hand-over costs per page (issue 26): a store of shared
//! memory filled with N text pages, sealed, its image written and adopted
//! by a second store in the same process, and every page mapped again.
//!
//! ```sh
//! cargo run --release -p tmem-core --example handover_image -- 357000 [REPEAT]
//! ```
//!
//! With REPEAT, the export and the import run that many times on the same
//! sealed store, and the fastest of each is printed. With a third argument
//! `precopy`, the index goes ahead in a snapshot, 1 % of the pages are put
//! again, and the pause's part (the image of the changes written, then
//! completed) is timed instead:
//!
//! ```sh
//! cargo run --release -p tmem-core --example handover_image -- 2000000 1 precopy
//! ```
use std::time::Instant;
use tmem_core::{Key, PoolConfig, Store, StoreConfig, PAGE_SIZE};

fn main() {
    let pages: u64 = std::env::args().nth(1).map_or(357_000, |a| a.parse().expect("a page count"));
    let repeat: u32 = std::env::args().nth(2).map_or(1, |a| a.parse().expect("a repeat count"));
    let cfg = || StoreConfig { shared_memory: true, shards: 16, ..Default::default() };
    let a = cfg().build().unwrap();
    let pool = a.create_pool(PoolConfig::persistent());
    let words: [&[u8]; 8] = [b"alpha ", b"beta ", b"gamma ", b"delta ", b"lorem ", b"ipsum ", b"tmem ", b"page "];
    let mut page = [0u8; PAGE_SIZE];
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for i in 0..pages {
        let mut at = 0;
        while at < PAGE_SIZE {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let w = words[(x % 8) as usize];
            let n = w.len().min(PAGE_SIZE - at);
            page[at..at + n].copy_from_slice(&w[..n]);
            at += n;
        }
        assert_eq!(pool.put(Key::new(1, i), &page).unwrap(), tmem_core::PutOutcome::Stored);
    }
    if std::env::args().nth(3).as_deref() == Some("precopy") {
        return precopy(&a, &pool, pages, &page, cfg);
    }
    let span = a.stats().alloc.span_bytes;
    a.seal(true);
    let (mut export, mut import) = (std::time::Duration::MAX, std::time::Duration::MAX);
    let mut last = None;
    for _ in 0..repeat.max(1) {
        let t = Instant::now();
        let mut image = Vec::new();
        a.export_image(&mut image).unwrap();
        export = export.min(t.elapsed());
        let fd = a.memfd().unwrap().try_clone_to_owned().unwrap();
        drop(last.take());
        let t = Instant::now();
        let imported = Store::import_image(cfg(), &mut image.as_slice(), fd).unwrap();
        import = import.min(t.elapsed());
        last = Some((imported, image.len()));
    }
    let ((b, sum), image_len) = last.expect("one run");
    let per = |d: std::time::Duration| d.as_secs_f64() * 1e9 / sum.pages as f64;
    println!(
        "{} pages, {} MiB of pool, image {} bytes ({:.1} per page)",
        sum.pages,
        span >> 20,
        image_len,
        image_len as f64 / sum.pages as f64
    );
    println!("export {:>7.1} ms  {:>6.0} ns/page", export.as_secs_f64() * 1e3, per(export));
    println!(
        "import {:>7.1} ms  {:>6.0} ns/page (the index and the tables rebuilt)",
        import.as_secs_f64() * 1e3,
        per(import)
    );
    // Both processes hold an index during the pause: the extra memory of a
    // restart is the successor's metadata, not a second pool.
    let meta = b.stats().metadata_bytes;
    println!(
        "index  {:>7.1} MiB ({:.1} % of the pool): what a restart holds twice",
        meta as f64 / f64::from(1 << 20),
        meta as f64 * 100.0 / span as f64
    );
    let t = Instant::now();
    let mapped = b.populate().unwrap();
    let map = t.elapsed();
    println!(
        "map    {:>7.1} ms  {:>6.0} ns/page ({} MiB of pool faulted in; the daemon does this once it serves)",
        map.as_secs_f64() * 1e3,
        per(map),
        (mapped * PAGE_SIZE as u64) >> 20
    );
}

/// Pre-copy: the snapshot's cost (off the pause) and the pause's part.
fn precopy(a: &Store, pool: &tmem_core::Pool, pages: u64, page: &[u8; PAGE_SIZE], cfg: impl Fn() -> StoreConfig) {
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    let t = Instant::now();
    a.track_changes(true);
    let mut snap = Vec::new();
    let sent = a.export_snapshot(&mut snap).unwrap();
    let written = t.elapsed();
    let t = Instant::now();
    let snapshot = tmem_core::Snapshot::read(&mut snap.as_slice()).unwrap();
    let built = t.elapsed();
    println!(
        "snapshot of {} pages ({} bytes): written {:.1} ms, built {:.1} ms, while serving",
        sent.pages,
        snap.len(),
        ms(written),
        ms(built)
    );
    let changed = pages / 100;
    for i in 0..changed {
        assert_eq!(pool.put(Key::new(1, i * 97 % pages), page).unwrap(), tmem_core::PutOutcome::Stored);
    }
    let t = Instant::now();
    a.seal(true);
    let mut image = Vec::new();
    a.export_image(&mut image).unwrap();
    let exported = t.elapsed();
    let fd = a.memfd().unwrap().try_clone_to_owned().unwrap();
    let t = Instant::now();
    let no_tiers = &mut |_: u32, _: usize| unreachable!("no tiers");
    let (b, got) = Store::import_image_after(cfg(), &mut image.as_slice(), fd, no_tiers, snapshot).unwrap();
    let imported = t.elapsed();
    assert_eq!(got.pages, pages);
    println!(
        "pause: {changed} pages put again, changes image {} bytes: written {:.1} ms, completed {:.1} ms",
        image.len(),
        ms(exported),
        ms(imported)
    );
    drop(b);
}
