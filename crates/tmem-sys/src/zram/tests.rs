use super::*;

const REAL_MM_STAT: &str = "  8388608  3051520  3420160        0  3420160      412        0      410      410\n";

#[test]
fn mm_stat_parses_kernel_output_with_extra_field() {
    let s = ZramMmStat::parse(REAL_MM_STAT).unwrap();
    assert_eq!(
        s,
        ZramMmStat {
            orig_data_size: 8_388_608,
            compr_data_size: 3_051_520,
            mem_used_total: 3_420_160,
            mem_limit: 0,
            mem_used_max: 3_420_160,
            same_pages: 412,
            pages_compacted: 0,
            huge_pages: 410,
        }
    );
    assert_eq!(REAL_MM_STAT.parse::<ZramMmStat>().unwrap(), s);
}

#[test]
fn mm_stat_parses_exactly_eight_fields_and_many_extra() {
    let s = ZramMmStat::parse("1 2 3 4 5 6 7 8").unwrap();
    assert_eq!((s.orig_data_size, s.huge_pages), (1, 8));
    let s = ZramMmStat::parse("1 2 3 4 5 6 7 8 9 10 11 whatever").unwrap();
    assert_eq!((s.same_pages, s.pages_compacted), (6, 7));
    let s = ZramMmStat::parse("\t1\n2  3 4 5 6 7 18446744073709551615\n").unwrap();
    assert_eq!(s.huge_pages, u64::MAX);
}

#[test]
fn mm_stat_rejects_malformed_input() {
    for bad in [
        "",
        "   \n",
        "1 2 3 4 5 6 7",
        "1 2 3 4 5 6 7 x",
        "1 2 3 -4 5 6 7 8",
        "1 2 3 4.5 5 6 7 8",
        "1 2 3 4 5 6 7 18446744073709551616",
        "0x10 2 3 4 5 6 7 8",
    ] {
        match ZramMmStat::parse(bad) {
            Err(ZramError::Parse { what: "mm_stat", .. }) => {}
            other => panic!("{bad:?} should fail to parse, got {other:?}"),
        }
    }
    let msg = ZramMmStat::parse("1 2 3").unwrap_err().to_string();
    assert!(msg.contains("expected at least 8 fields, found 3"), "{msg}");
}

#[test]
fn comp_algorithm_parses() {
    let (all, cur) = parse_comp_algorithm("[lzo-rle] lzo lz4 \n").unwrap();
    assert_eq!(all, ["lzo-rle", "lzo", "lz4"]);
    assert_eq!(cur, "lzo-rle");
    let (all, cur) = parse_comp_algorithm("lzo lzo-rle [lz4] lz4hc zstd").unwrap();
    assert_eq!(all.len(), 5);
    assert_eq!(cur, "lz4");
    for bad in ["", "lzo lz4", "[lzo] [lz4]", "[] lzo", "[lzo lz4", "lzo] lz4"] {
        assert!(parse_comp_algorithm(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn device_names_are_validated() {
    for ok in ["zram0", "zram15"] {
        validate_dev(ok).unwrap();
    }
    for bad in ["", "zram", "zram0/../sda", "sda", "zramx", "/dev/zram0", "zram 0"] {
        assert!(matches!(validate_dev(bad), Err(ZramError::InvalidDevice(_))), "{bad:?}");
        assert!(check_available(bad).is_err());
    }
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
fn bench_rejects_bad_input_before_touching_the_device() {
    let data = vec![0_u8; PAGE_SIZE];
    assert!(matches!(bench("zram0", &data[..100], "lz4", 1), Err(ZramError::InvalidInput(_))));
    assert!(matches!(bench("zram0", &[], "lz4", 1), Err(ZramError::InvalidInput(_))));
    assert!(matches!(bench("zram0", &data, "lz4", 0), Err(ZramError::InvalidInput(_))));
    assert!(matches!(bench("nope", &data, "lz4", 1), Err(ZramError::InvalidDevice(_))));
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
    assert!(run_parallel("t", vec![(); 4], |()| Ok(())).is_ok());
}

// ---- tests below drive the real device when available (root, idle zram0) ----

const DEV: &str = "zram0";

fn available_or_skip() -> Option<(String, u64)> {
    match check_available(DEV) {
        Ok(()) => Some((current_algorithm(DEV).unwrap(), mm_stat(DEV).unwrap().mem_limit)),
        Err(reason) => {
            println!("SKIP: {reason}");
            None
        }
    }
}

fn assert_restored(algorithm: &str, mem_limit: u64) {
    assert_eq!(disksize(DEV).unwrap(), 0, "disksize not restored");
    assert_eq!(read_u64_attr(DEV, "initstate").unwrap(), 0, "device still initialised");
    assert_eq!(current_algorithm(DEV).unwrap(), algorithm, "comp_algorithm not restored");
    assert_eq!(mm_stat(DEV).unwrap().mem_limit, mem_limit, "mem_limit not restored");
}

fn small_data() -> Vec<u8> {
    (0..64 * PAGE_SIZE).map(|i| u8::try_from(i % 251).unwrap()).collect()
}

#[test]
fn device_restored_after_panic_in_main_thread() {
    let Some((alg, limit)) = available_or_skip() else {
        return;
    };
    let data = small_data();
    let r = std::panic::catch_unwind(|| {
        bench_with_hook(DEV, &data, "lz4", 2, &|phase| {
            assert!(phase != "written", "injected panic after write");
        })
    });
    assert!(r.is_err(), "panic should propagate");
    assert_restored(&alg, limit);
}

#[test]
fn device_restored_after_panic_in_worker_thread() {
    let Some((alg, limit)) = available_or_skip() else {
        return;
    };
    let data = small_data();
    let r = bench_with_hook(DEV, &data, "lz4", 2, &|phase| {
        assert!(phase != "mt-read", "injected worker panic");
    });
    assert!(matches!(r, Err(ZramError::WorkerPanicked { phase: "multi-thread read" })), "{r:?}");
    assert_restored(&alg, limit);
}

#[test]
fn mem_limit_is_restored() {
    let Some((alg, limit)) = available_or_skip() else {
        return;
    };
    assert_eq!(limit, 0);
    // Set a limit on the idle device (allowed while uninitialised) under our lock,
    // then check bench puts it back. Clear it again whatever happens.
    struct ClearLimit;
    impl Drop for ClearLimit {
        fn drop(&mut self) {
            let _ = write_attr(DEV, "mem_limit", "0");
        }
    }
    let _clear = ClearLimit;
    {
        let _lock = lock_device(DEV, LOCK_TIMEOUT).unwrap();
        check_idle(DEV).unwrap();
        write_attr(DEV, "mem_limit", "64M").unwrap();
    }
    let run = bench(DEV, &small_data(), "lzo", 1).unwrap();
    assert_eq!(run.mm_stat.mem_limit, 0, "limit is cleared during the run");
    assert_restored(&alg, 64 << 20);
}
