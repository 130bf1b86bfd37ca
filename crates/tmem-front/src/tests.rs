use super::*;

fn kernel(zram: bool, zswap: bool) -> KernelFronts {
    KernelFronts {
        zram_writeback: if zram { Ok(()) } else { Err("no backing_dev".into()) },
        zswap: if zswap { Ok(()) } else { Err("no zswap".into()) },
    }
}

#[test]
fn auto_takes_zram_with_writeback_and_none_without() {
    let c = choose(FrontKind::Auto, &kernel(true, true)).unwrap();
    assert_eq!(c.front, Front::Zram);
    assert!(c.reason.contains("writeback"), "{}", c.reason);
    let c = choose(FrontKind::Auto, &kernel(false, true)).unwrap();
    assert_eq!(c.front, Front::None);
    assert!(c.reason.contains("no backing_dev"), "the reason names what is missing: {}", c.reason);
}

#[test]
fn a_front_asked_for_by_name_that_the_kernel_lacks_is_an_error_that_says_why() {
    let e = choose(FrontKind::Zram, &kernel(false, true)).unwrap_err().to_string();
    assert!(e.contains("--front zram") && e.contains("no backing_dev"), "{e}");
    let e = choose(FrontKind::Zswap, &kernel(true, false)).unwrap_err().to_string();
    assert!(e.contains("--front zswap") && e.contains("no zswap"), "{e}");
    assert_eq!(choose(FrontKind::Zswap, &kernel(false, true)).unwrap().front, Front::Zswap);
    assert_eq!(choose(FrontKind::None, &kernel(true, true)).unwrap().front, Front::None);
}

#[test]
fn kinds_parse_and_name_a_wrong_one() {
    for k in [FrontKind::Auto, FrontKind::Zram, FrontKind::Zswap, FrontKind::None] {
        assert_eq!(k.as_str().parse::<FrontKind>().unwrap(), k);
    }
    let e = "zcache".parse::<FrontKind>().unwrap_err().to_string();
    assert!(e.contains("\"zcache\"") && e.contains("auto, zram, zswap or none"), "{e}");
}
