use super::*;

#[test]
fn budget_stops_at_enough_bytes_or_time() {
    let b = Budget::new();
    b.begin();
    assert!(!b.add(1 << 20));
    assert!(b.add(MIN_TIMED_BYTES), "enough bytes");
    let b = Budget::new();
    b.begin();
    std::thread::sleep(MIN_TIMED);
    assert!(b.add(4096), "enough time");
    assert!(!Budget::enough(1 << 20, 0.001));
    assert!(Budget::enough(MIN_TIMED_BYTES, 0.001));
    assert!(Budget::enough(4096, 0.2));
    assert!(!Budget::enough(0, 1.0));
    assert_eq!(Budget::copies_for(2 << 20), 32);
    assert_eq!(Budget::copies_for(3 << 20), 22);
    assert_eq!(Budget::copies_for(1 << 30), 1);
    let p = TimedPhase { pages: 512, secs: 0.000_4, cpu: CpuSpent::default() };
    assert_eq!((p.mb_per_sec(), p.cpu_us_per_page(), p.machine_busy_us_per_page()), (None, None, None));
    let mut cpu = CpuSpent::default();
    cpu.process.system_secs = 0.032;
    cpu.machine_busy_secs = Some(0.064);
    let p = TimedPhase { pages: 16384, secs: 0.05, cpu };
    assert!((p.mb_per_sec().unwrap() - 16384.0 * 4096.0 / 0.05 / 1e6).abs() < 1e-6);
    assert!((p.cpu_us_per_page().unwrap() - 32_000.0 / 16384.0).abs() < 1e-9);
    assert!((p.machine_busy_us_per_page().unwrap() - 64_000.0 / 16384.0).abs() < 1e-9);
}

#[test]
fn split_pages_covers_everything_contiguously() {
    for pages in [1, 2, 3, 7, 16, 2048, 2049] {
        for threads in 1..=9 {
            let r = split_pages(pages, threads);
            assert!(r.len() <= threads && !r.is_empty());
            let mut next = 0;
            for &(first, n) in &r {
                assert_eq!(first, next);
                assert!(n > 0);
                next += n;
            }
            assert_eq!(next, pages);
            let (min, max) = r.iter().fold((usize::MAX, 0), |(a, b), &(_, n)| (a.min(n), b.max(n)));
            assert!(max - min <= 1);
        }
    }
}

#[test]
fn aligned_buf_is_page_aligned() {
    for len in [PAGE_SIZE, 3 * PAGE_SIZE, CHUNK_BYTES * 5] {
        let mut b = AlignedBuf::new(len);
        assert_eq!(b.as_slice().len(), len);
        assert_eq!(b.as_slice().as_ptr().addr() % PAGE_SIZE, 0);
        assert_eq!(b.as_mut_slice().as_ptr().addr() % PAGE_SIZE, 0);
    }
}

#[test]
fn poison_makes_every_page_differ_and_verify_finds_offset() {
    let mut data = vec![0_u8; 4 * PAGE_SIZE];
    data[PAGE_SIZE..2 * PAGE_SIZE].fill(0xff);
    data[3 * PAGE_SIZE] = 7;
    let mut buf = data.clone();
    verify(&data, &buf).unwrap();
    poison(&mut buf, &data);
    for (p, q) in buf.chunks(PAGE_SIZE).zip(data.chunks(PAGE_SIZE)) {
        assert_ne!(p[0], q[0]);
    }
    let mut buf = data.clone();
    buf[CHUNK_BYTES.min(data.len()) - 1 - 5] ^= 1;
    let off = u64_from(data.len() - 6);
    assert!(matches!(verify(&data, &buf), Err(ZramError::Mismatch { offset }) if offset == off));
    let mut big = vec![1_u8; 3 * CHUNK_BYTES];
    let want = big.clone();
    big[CHUNK_BYTES + 123] = 0;
    let off = u64_from(CHUNK_BYTES + 123);
    assert!(matches!(verify(&want, &big), Err(ZramError::Mismatch { offset }) if offset == off));
}

#[test]
fn bench_rejects_bad_input_before_creating_a_device() {
    let data = vec![0_u8; PAGE_SIZE];
    assert!(matches!(bench(&data[..100], "lz4", 1), Err(ZramError::InvalidInput(_))));
    assert!(matches!(bench(&[], "lz4", 1), Err(ZramError::InvalidInput(_))));
    assert!(matches!(bench(&data, "lz4", 0), Err(ZramError::InvalidInput(_))));
}

#[test]
fn run_parallel_reports_worker_errors_and_panics() {
    let r = run_parallel("t", vec![1, 2, 3], |i| if i == 2 { Err(ZramError::Mismatch { offset: 2 }) } else { Ok(()) });
    assert!(matches!(r, Err(ZramError::Mismatch { offset: 2 })));
    let r = run_parallel("t", vec![1, 2], |i| {
        assert!(i != 2, "injected worker panic");
        Ok(())
    });
    assert!(matches!(r, Err(ZramError::WorkerPanicked { phase: "t" })));
    let (_, out) = run_parallel("t", vec![1, 2, 3, 4], |i| Ok(i * 10)).unwrap();
    assert_eq!(out, [10, 20, 30, 40]);
}

// ---- tests below create real devices when they can (root, zram module) ----
// Every device is hot-added by the harness and removed by a drop guard, so a
// failing assertion (a panic) removes it too. A user's zram0 is never touched.

/// Why the real-device tests cannot run here, if they cannot.
fn skip_reason() -> Option<(tmem_testkit::Feature, String)> {
    if !tmem_sys::is_root() {
        return Some((tmem_testkit::Feature::Root, "needs root".into()));
    }
    tmem_sys::zram::probe().err().map(|e| (tmem_testkit::Feature::Zram, e.to_string()))
}

fn skip() -> bool {
    match skip_reason() {
        Some((feature, reason)) => {
            tmem_testkit::skip(feature, &reason);
            true
        }
        None => false,
    }
}

/// Whether this process removed device `id` after the `since`-th removal.
/// (Device numbers are reused, but only once the device is gone, so another
/// device with the same number can only have been removed after ours.)
fn removed_since(since: usize, id: u32) -> bool {
    tmem_sys::zram::removed_ids()[since..].contains(&id)
}

fn removals() -> usize {
    tmem_sys::zram::removed_ids().len()
}

/// `disksize` and `comp_algorithm` of the user's zram0 unless it is `ours`
/// (to see that it stays untouched; other tests add and remove devices of
/// their own meanwhile, so only zram0 is looked at).
fn zram0_state(ours: &str) -> Option<(String, String)> {
    let attr = |a: &str| std::fs::read_to_string(std::path::Path::new("/sys/block/zram0").join(a)).ok();
    (ours != "zram0").then(|| attr("disksize").zip(attr("comp_algorithm"))).flatten()
}

fn small_data() -> Vec<u8> {
    (0..64 * PAGE_SIZE).map(|i| u8::try_from(i % 251).unwrap()).collect()
}

#[test]
fn bench_runs_on_its_own_device_and_removes_it() {
    if skip() {
        return;
    }
    let since = removals();
    let used = std::sync::Mutex::new(String::new());
    let before = zram0_state("");
    let data = small_data();
    let run = bench_with_hook(&data, "lz4", 2, &|phase, dev| {
        if phase == "configured" {
            *used.lock().unwrap() = dev.to_owned();
        }
    })
    .unwrap();
    let used = used.into_inner().unwrap();
    assert_eq!(run.device, used);
    let id: u32 = used.trim_start_matches("zram").parse().unwrap();
    assert!(removed_since(since, id), "{used} was not removed");
    if used != "zram0" {
        assert_eq!(zram0_state(&used), before, "zram0 was touched");
    }
    assert_eq!((run.pages, run.threads), (64, 2));
    assert_eq!(run.mm_stat.orig_data_size, 64 * 4096, "memory figures are for the data once");
    for p in [run.put_1t, run.get_1t, run.put_mt, run.get_mt] {
        assert!(p.pages >= 64 && p.pages % 32 == 0, "{p:?}");
        assert!(p.mb_per_sec().is_some() && p.cpu_us_per_page().is_some(), "timed over enough work: {p:?}");
        assert!(p.cpu.process.total_secs() > 0.0, "{p:?}");
    }
}

#[test]
fn device_removed_after_panic_in_main_thread() {
    if skip() {
        return;
    }
    let since = removals();
    let used = std::sync::Mutex::new(String::new());
    let data = small_data();
    let r = std::panic::catch_unwind(|| {
        bench_with_hook(&data, "lz4", 2, &|phase, dev| {
            *used.lock().unwrap() = dev.to_owned();
            assert!(phase != "written", "injected panic after write");
        })
    });
    assert!(r.is_err(), "panic should propagate");
    let used = used.into_inner().unwrap();
    let id: u32 = used.trim_start_matches("zram").parse().unwrap();
    assert!(removed_since(since, id), "{used} was not removed");
}

#[test]
fn device_removed_after_panic_in_worker_thread() {
    if skip() {
        return;
    }
    let since = removals();
    let used = std::sync::Mutex::new(String::new());
    let data = small_data();
    let r = bench_with_hook(&data, "lz4", 2, &|phase, dev| {
        *used.lock().unwrap() = dev.to_owned();
        assert!(phase != "mt-read", "injected worker panic");
    });
    assert!(matches!(r, Err(ZramError::WorkerPanicked { phase: "multi-thread read" })), "{r:?}");
    let used = used.into_inner().unwrap();
    let id: u32 = used.trim_start_matches("zram").parse().unwrap();
    assert!(removed_since(since, id), "{used} was not removed");
}

#[test]
fn unknown_algorithm_is_refused_and_the_device_removed() {
    if skip() {
        return;
    }
    let since = removals();
    match bench(&small_data(), "no-such-algo", 1) {
        Err(ZramError::UnknownAlgorithm { dev, available, .. }) => {
            assert!(available.iter().any(|a| a == "lz4"));
            let id: u32 = dev.trim_start_matches("zram").parse().unwrap();
            assert!(removed_since(since, id), "{dev} was not removed");
        }
        other => panic!("expected UnknownAlgorithm, got {other:?}"),
    }
}
