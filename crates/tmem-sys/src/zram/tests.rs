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
        assert!(matches!(mm_stat(bad), Err(ZramError::InvalidDevice(_))), "{bad:?}");
    }
}

// ---- tests below create real devices when they can (root, zram module) ----
// Every device is hot-added by the test or the harness and removed by a drop
// guard, so a failing assertion (a panic) removes it too. A user's zram0 is
// never touched.

/// Why the real-device tests cannot run here, if they cannot.
fn skip_reason() -> Option<(tmem_testkit::Feature, String)> {
    if !crate::is_root() {
        return Some((tmem_testkit::Feature::Root, "needs root".into()));
    }
    ensure_module().err().map(|e| (tmem_testkit::Feature::Zram, e.to_string()))
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
    removed_ids()[since..].contains(&id)
}

fn removals() -> usize {
    removed_ids().len()
}

#[test]
fn hot_add_gives_a_fresh_device_and_remove_takes_it_away() {
    if skip() {
        return;
    }
    let since = removals();
    let dev = ZramDevice::hot_add().unwrap();
    let (name, id) = (dev.name().to_owned(), dev.id());
    assert_eq!(name, format!("zram{id}"));
    assert!(dev.node().exists() && sysfs_dir(&name).is_dir());
    assert_eq!(disksize(&name).unwrap(), 0, "a fresh device is not initialised");
    let (algs, _) = dev.algorithms().unwrap();
    assert!(algs.iter().any(|a| a == "lz4"), "{algs:?}");
    assert!(matches!(dev.configure("no-such-algo", 1 << 20), Err(ZramError::UnknownAlgorithm { .. })));
    dev.configure("lz4", 4 << 20).unwrap();
    assert_eq!(disksize(&name).unwrap(), 4 << 20);
    assert_eq!(current_algorithm(&name).unwrap(), "lz4");
    dev.remove().unwrap();
    assert!(removed_since(since, id));
    assert!(probe().unwrap().iter().any(|a| a == "lz4"));
}

#[test]
fn dropping_the_device_removes_it_even_in_a_panic() {
    if skip() {
        return;
    }
    let since = removals();
    let id = std::sync::Mutex::new(None);
    let r = std::panic::catch_unwind(|| {
        let dev = ZramDevice::hot_add().unwrap();
        *id.lock().unwrap() = Some(dev.id());
        dev.configure("lz4", 1 << 20).unwrap();
        panic!("injected panic while the device is configured");
    });
    assert!(r.is_err());
    let id = id.lock().unwrap().expect("the device was created");
    assert!(removed_since(since, id), "zram{id} was not removed");
}

#[test]
fn bd_stat_parses_three_fields_and_refuses_fewer() {
    assert_eq!(BdStat::parse("       12        3       40\n").unwrap(), BdStat { count: 12, reads: 3, writes: 40 });
    assert!(matches!(BdStat::parse("1 2"), Err(ZramError::Parse { what: "bd_stat", .. })));
    assert!(matches!(BdStat::parse("1 x 3"), Err(ZramError::Parse { what: "bd_stat", .. })));
}

#[test]
fn no_zram_device_is_backed_by_a_path_that_is_no_device() {
    assert!(backed_by(std::path::Path::new("/nonexistent/tmem-test")).is_empty());
}

#[test]
fn block_state_gives_the_written_back_slots() {
    let text = "           0       91.275000 s.....\n           7     5512.012345 .w.i..\n        1024     5512.012345 .wh..n\n";
    assert_eq!(parse_written_back_slots(text).unwrap(), vec![7, 1024]);
    assert_eq!(parse_written_back_slots("").unwrap(), Vec::<u64>::new());
    for bad in ["7 1.0\n", "x 1.0 .w....\n", "7 1.0 .w.... extra\n"] {
        let e = parse_written_back_slots(bad).unwrap_err().to_string();
        assert!(e.contains("block_state"), "{bad:?}: {e}");
    }
}
