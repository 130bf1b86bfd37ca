//! `tmem bench pressure --cold-share` at a small size on the zram row and
//! the zram+disk front row (tmem's own rows need the tmem binary:
//! `crates/tmem/tests/pressure_smoke.rs` runs the bench through it): every
//! run gives the reference run's checksum, which the cold share changes;
//! the share is in the JSON; zram+disk runs where zram has writeback and
//! is skipped, with the reason, where it has not; nothing the bench set up
//! remains. Needs root, zram, a memory cgroup controller and python3;
//! otherwise prints "SKIP: <reason>" (fails where `TMEM_REQUIRE` requires
//! the feature: see `tmem_testkit::skip`).

use std::path::Path;

use clap::Parser;
use tmem_bench::pressure::PressureArgs;
use tmem_testkit::{skip, Feature};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: PressureArgs,
}

/// Why the bench cannot run here, if it cannot.
fn missing() -> Option<(Feature, String)> {
    if !tmem_sys::is_root() {
        return Some((Feature::Root, "needs root".into()));
    }
    if let Err(e) = tmem_sys::cgroup::Layout::detect().and_then(|l| l.ensure_memory_controller()) {
        return Some((Feature::Memcg, e.to_string()));
    }
    if let Err(e) = tmem_bench::zram::probe() {
        return Some((Feature::Zram, e.to_string()));
    }
    if !tmem_testkit::have_tool("python3") {
        return Some((Feature::Tools, "no python3".into()));
    }
    None
}

use tmem_testkit::bench_entries;

#[test]
fn a_cold_share_runs_on_zram_and_front_rows_without_writeback_are_skipped() {
    if let Some((feature, why)) = missing() {
        return skip(feature, &why);
    }
    let var_tmp = bench_entries("/var/tmp");
    let out = tempfile::tempdir().unwrap();
    let json = out.path().join("pressure.json");
    // Other tests may have swap areas of their own meanwhile: do not wait for them.
    let a = Cli::parse_from([
        "pressure",
        "--workload-mib",
        "96",
        "--levels",
        "100,60",
        "--runs",
        "1",
        "--passes",
        "1",
        "--cold-share",
        "50",
        "--backends",
        "zram,zram+disk",
        "--after-exit-secs",
        "1",
        "--allow-other-swap",
        "--json",
        &json.to_string_lossy(),
    ])
    .args;
    let result = tmem_bench::pressure::run(&a);
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap_or_default()).unwrap();

    // Nothing remains, whatever happened.
    let swaps = std::fs::read_to_string("/proc/swaps").unwrap();
    if let Some(d) = v["zram_device"].as_str() {
        assert!(!swaps.contains(&format!("/dev/{d} ")), "{d} is still swap");
        assert!(!Path::new("/sys/block").join(d).exists(), "{d} not removed");
    }
    assert_eq!(bench_entries("/var/tmp"), var_tmp, "the zram+disk backing file is left in /var/tmp");
    let loops = std::process::Command::new("losetup").args(["--list", "--noheadings"]).output().unwrap();
    assert!(!String::from_utf8_lossy(&loops.stdout).contains("tmem-bench-zram-backing"), "backing loop device left");
    result.unwrap();

    assert_eq!(v["cold_share_percent"], 50);
    assert_eq!(v["args"]["cold_share"], 50);
    let reference = v["reference"]["jobs"].as_array().unwrap();
    assert_eq!(reference.len(), 2);
    for j in reference {
        let out = j["output"].as_str().unwrap();
        assert!(out.starts_with("checksum ") && out.contains(" cold_records "), "{out}");
    }
    let skipped = v["skipped"].as_array().unwrap();
    let runs = v["runs"].as_array().unwrap();
    let writeback = skipped.is_empty();
    if writeback {
        assert_eq!(runs.len(), 4, "{runs:?}");
        assert!(v["front"]["limit"].as_u64().unwrap() >= 16 << 20, "{}", v["front"]);
    } else {
        assert_eq!(skipped.len(), 1, "{skipped:?}");
        assert_eq!(skipped[0]["backend"], "zram+disk");
        let why = skipped[0]["reason"].as_str().unwrap();
        assert!(why.contains("zram writeback"), "{why}");
        println!("SKIP: zram+disk: {why} (the zram row ran)");
        assert_eq!(runs.len(), 2, "{runs:?}");
    }
    for r in runs {
        let what = format!("{}@{}", r["backend"], r["level"]);
        assert_eq!(r["outcome"], "OK", "{what}: {r}");
        for (j, want) in r["jobs"].as_array().unwrap().iter().zip(reference) {
            assert_eq!(j["output"], want["output"], "{what}");
        }
        assert_eq!(r["front"].is_object(), r["backend"] == "zram+disk", "{what}: {r}");
        if r["level"] == 60 {
            assert!(r["vmstat"]["pswpout"].as_u64().unwrap() > 0, "{what} did not swap: {r}");
            assert!(r["pool_peak_bytes"].as_u64().unwrap() > 0, "{what}: no pool memory seen: {r}");
        }
        if r["backend"] == "zram+disk" {
            let f = &r["front"];
            assert!(f["written_back_pages"].is_u64() && f["read_back_pages"].is_u64(), "{f}");
        }
    }
}
