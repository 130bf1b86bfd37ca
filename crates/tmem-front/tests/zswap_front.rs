//! zswap in front, on the real kernel: every value set is put back, by
//! `restore` and from what was saved (crash recovery).

use std::sync::Arc;

use parking_lot::Mutex;
use tmem_front::policy::FrontOps;
use tmem_front::zswap::{restore_saved, Saved, ZswapFront, ZswapFrontConfig};
use tmem_sys::zswap;

fn params() -> std::collections::BTreeMap<String, String> {
    zswap::read_params(std::path::Path::new(zswap::PARAMS_DIR)).unwrap()
}

fn cfg() -> ZswapFrontConfig {
    ZswapFrontConfig { compressor: None, max_pool_percent: 7, cgroups: Vec::new(), cgroup_max: None }
}

/// Whether the test can run: root and zswap (part of the kernel's swap
/// support here); prints SKIP or fails under TMEM_REQUIRE otherwise.
fn runs() -> bool {
    if !tmem_testkit::is_root() {
        tmem_testkit::skip(tmem_testkit::Feature::Root, "setting zswap's parameters needs root");
        return false;
    }
    if !zswap::available() {
        tmem_testkit::skip(tmem_testkit::Feature::Swap, "this kernel has no zswap");
        return false;
    }
    true
}

/// Sets zswap up with [`cfg`]; also returns what it saved before.
fn apply() -> (ZswapFront, Arc<Mutex<Option<Saved>>>) {
    let saved = Arc::new(Mutex::new(None));
    let s2 = Arc::clone(&saved);
    let front = ZswapFront::apply(
        &cfg(),
        &move |s: &Saved| {
            *s2.lock() = Some(s.clone());
            Ok(())
        },
        Box::new(|| 0),
    )
    .unwrap();
    (front, saved)
}

/// zswap's parameters are machine-wide: the tests here take turns.
static SERIAL: Mutex<()> = Mutex::new(());

#[test]
fn zswap_front_sets_and_restores_its_parameters() {
    if !runs() {
        return;
    }
    let _serial = SERIAL.lock();
    let before = params();
    let (front, saved) = apply();
    assert_eq!(params()["max_pool_percent"], "7");
    assert!(zswap::is_on(&params()["enabled"]));
    let s = front.sample().unwrap();
    assert_eq!(s.written, 0, "counted from set-up: {s:?}");
    front.allow_writeback(false).unwrap();
    if before.contains_key("shrinker_enabled") {
        assert!(!zswap::is_on(&params()["shrinker_enabled"]));
    }
    assert!(saved.lock().as_ref().unwrap().changed.iter().any(|c| c == "max_pool_percent"));
    front.restore().unwrap();
    assert_eq!(params(), before, "every parameter is back");
}

#[test]
fn what_a_dead_daemon_saved_is_put_back() {
    if !runs() {
        return;
    }
    let _serial = SERIAL.lock();
    let before = params();
    let (front, saved) = apply();
    front.allow_writeback(false).unwrap();
    // The daemon dies: nothing is restored by it.
    let _ = front.release();
    assert_eq!(params()["max_pool_percent"], "7");
    let on_disk = serde_json::to_string(saved.lock().as_ref().unwrap()).unwrap();
    restore_saved(serde_json::from_str(&on_disk).unwrap()).unwrap();
    assert_eq!(params(), before, "recovery put every parameter back");
}
