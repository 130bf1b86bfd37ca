//! Smoke test of `tmem bench capacity` (root only), at a small budget:
//! every row over every data set must end by its cgroup's OOM killer, never
//! the machine's; every swap row must hold more than no swap; the report,
//! JSON and figure must carry capacity, ratio and CPU per swapped page; and
//! nothing the bench set up may remain.

mod common;

#[test]
fn capacity_smoke() {
    if let Some((feature, reason)) = common::missing_feature() {
        return tmem_testkit::skip(feature, reason);
    }
    let before = common::Before::now();
    // Other tests may start swap of their own meanwhile.
    let run = common::run_bench(
        &["capacity", "--budget-mib", "48", "--swap-budgets", "4", "--timeout", "60", "--allow-other-swap"],
        true,
    );
    let (v, stdout) = (&run.json, &run.stdout);
    before.assert_nothing_left(v["machine"]["zram_device"].as_str());

    assert!(run.ok, "tmem bench capacity failed");
    assert_eq!(v["machine"]["budget_bytes"], 48 << 20);
    for title in ["MiB at OOM", "x zram", "pool ratio", "daemon us/page", "machine us/page", "steal %"] {
        assert!(stdout.contains(title), "no {title:?} in the report");
    }
    assert!(run.svg.starts_with("<svg") && run.svg.contains("MiB allocated at OOM"), "no figure written");
    let rows = v["rows"].as_array().unwrap();
    let names = ["none", "zram", "zswap", "tmem", "tmem-max", "tmem+disk"];
    assert_eq!(rows.len(), names.len() * 3, "{rows:?}");
    let held = |row: &str, data: &str| {
        let r = rows.iter().find(|r| r["row"] == row && r["data"] == data).unwrap();
        r["allocated_bytes"].as_u64().unwrap()
    };
    for r in rows {
        let what = format!("{} over {}", r["row"], r["data"]);
        assert_eq!(r["outcome"], "oom", "{what}: {r}");
        assert!(r["cgroup_oom_kills"].as_u64().unwrap() >= 1, "{what}");
        assert!(r["machine_busy_cpu_secs"].as_f64().unwrap() > 0.0, "{what}: {r}");
        let tmem = r["row"].as_str().unwrap().starts_with("tmem");
        assert_eq!(r["daemon_cpu_user_secs"].is_f64(), tmem, "{what}: {r}");
        assert_eq!(r["refused_writes"].is_u64(), tmem, "{what}: {r}");
        if r["row"] == "none" {
            assert_eq!(r["swapped_pages"], 0, "{what}");
            assert_eq!(r["limited_by"], "RAM (no swap)");
            continue;
        }
        assert!(r["swapped_pages"].as_u64().unwrap() > 0, "{what} did not swap");
        assert!(r["pool_peak_bytes"].as_u64().unwrap() > 0, "{what}: no pool seen");
        let swapped = r["swapped_pages"].as_u64().unwrap();
        assert_eq!(r["machine_cpu_us_per_swapped_page_above_reference"].is_f64(), swapped >= 10_000, "{what}: {r}");
        // Every swap row holds more than RAM alone, whatever the data.
        let data = r["data"].as_str().unwrap();
        assert!(held(r["row"].as_str().unwrap(), data) > held("none", data), "{what} held no more than no swap");
    }
    // Compressible data: the pools hold it at a ratio above 1.5.
    for row in ["zram", "tmem", "tmem-max"] {
        let r = rows.iter().find(|r| r["row"] == row && r["data"] == "text").unwrap();
        let ratio = r["pool_stored_bytes_at_peak"].as_f64().unwrap() / r["pool_peak_bytes"].as_f64().unwrap();
        assert!(ratio > 1.5, "{row} over text: ratio {ratio:.2}");
    }
}
