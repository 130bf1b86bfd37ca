//! Smoke test of `tmem bench pressure` (root only): a tiny ladder on zram,
//! tmem and the fuse-ram baseline; every run must be correct, all must swap
//! at 65 %, every run must carry its CPU figures, and nothing the bench set
//! up may remain afterwards: its hot-added zram device is gone, and a zram0
//! that was there before is untouched.

mod common;

#[test]
fn pressure_ladder_smoke() {
    if let Some((feature, reason)) = common::missing_feature() {
        return tmem_testkit::skip(feature, reason);
    }
    let before = common::Before::now();
    // 65 %, not 50: under a v1 memory cgroup a 50 % limit OOM-killed a
    // job now and then (zram and tmem alike) while other tests loaded the CPU.
    // Other tests may start swap of their own meanwhile: do not wait for it.
    let run = common::run_bench(
        &[
            "pressure",
            "--workload-mib",
            "192",
            "--levels",
            "100,65",
            "--runs",
            "1",
            "--passes",
            "1",
            "--backends",
            "zram,tmem,fuse-ram",
            "--allow-other-swap",
            "--after-exit-secs",
            "1",
        ],
        true,
    );
    let (v, stdout, svg_text) = (&run.json, &run.stdout, &run.svg);

    // Nothing remains, whatever happened.
    let zram_dev = v["zram_device"].as_str().map(str::to_owned);
    before.assert_nothing_left(zram_dev.as_deref());

    assert!(run.ok, "tmem bench pressure failed");
    assert!(zram_dev.is_some(), "no zram_device in the JSON");
    assert_eq!(v["reference"]["outcome"], "OK");
    assert!(v["reference"]["machine_busy_cpu_secs"].as_f64().unwrap() > 0.0, "{}", v["reference"]);
    assert!(v["reference"]["daemon_cpu_user_secs"].is_null());
    let min_pages = v["min_swapped_pages_for_cpu_per_page"].as_u64().unwrap();
    for title in
        ["CPU per run", "daemon CPU per swapped page, us", "machine CPU per swapped page above the reference run"]
    {
        assert!(stdout.contains(title), "no {title:?} in the report");
    }
    assert!(v["peak_bytes"].as_u64().unwrap() > 100 << 20, "peak {}", v["peak_bytes"]);
    assert!(
        ["v1", "v2", "hybrid"].contains(&v["cgroup_layout"].as_str().unwrap_or_default()),
        "{}",
        v["cgroup_layout"]
    );
    assert!(svg_text.starts_with("<svg"), "no figures written");
    for b in ["zram", "tmem", "fuse-ram", "wall time", "machine CPU per swapped page"] {
        assert!(svg_text.contains(b), "no {b:?} in the figures");
    }
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 6, "{runs:?}");
    for r in runs {
        let what = format!("{}@{}", r["backend"], r["level"]);
        assert_eq!(r["outcome"], "OK", "{what}: {r}");
        let jobs = r["jobs"].as_array().unwrap();
        assert_eq!(jobs.len(), 2);
        for (j, want) in jobs.iter().zip(v["reference"]["jobs"].as_array().unwrap()) {
            assert_eq!(j["output"], want["output"], "{what}");
            assert!(j["output"].as_str().unwrap().starts_with("checksum "));
        }
        // CPU figures.
        let vm = &r["vmstat"];
        let swapped = ["pswpin", "pswpout", "zswpin", "zswpout"].iter().map(|k| vm[k].as_u64().unwrap()).sum::<u64>();
        assert_eq!(r["swapped_pages"].as_u64(), Some(swapped), "{what}");
        assert!(r["machine_busy_cpu_secs"].as_f64().unwrap() > 0.0, "{what}: {r}");
        let has_daemon = r["backend"] != "zram";
        assert_eq!(r["daemon_cpu_user_secs"].as_f64().is_some(), has_daemon, "{what}: {r}");
        assert_eq!(r["daemon_cpu_system_secs"].as_f64().is_some(), has_daemon, "{what}: {r}");
        let per_page = swapped >= min_pages;
        assert_eq!(r["machine_cpu_us_per_swapped_page_above_reference"].is_f64(), per_page, "{what}: {r}");
        assert_eq!(r["daemon_cpu_us_per_swapped_page"].is_f64(), per_page && has_daemon, "{what}: {r}");
        if per_page && has_daemon {
            assert!(r["daemon_cpu_us_per_swapped_page"].as_f64().unwrap() > 0.0, "{what}: {r}");
        }
        // After the jobs exit: the pool against the swap still in use, and
        // (tmem) the writes refused, all measured.
        assert!(r["pool_after_exit_bytes"].is_u64() && r["swap_used_after_exit_bytes"].is_u64(), "{what}: {r}");
        assert_eq!(r["refused_writes"].is_u64(), r["backend"] == "tmem", "{what}: {r}");
        if r["level"] == 65 {
            assert!(r["vmstat"]["pswpout"].as_u64().unwrap() > 0, "{what} did not swap: {r}");
            assert!(r["pool_peak_bytes"].as_u64().unwrap() > 0, "{what}: no pool memory seen: {r}");
            assert!(r["limit_bytes"].as_u64().is_some());
        } else {
            assert!(r["limit_bytes"].is_null());
        }
    }
}

/// The tmem-run row: each job under `tmem run` with its share of the limit,
/// no swap; its checksums match and its pools are seen through their
/// control sockets.
#[test]
fn pressure_tmem_run_row_smoke() {
    if let Some((feature, reason)) = common::missing_feature() {
        return tmem_testkit::skip(feature, reason);
    }
    if let Err(e) = tmem_uffd::sys::Uffd::create().and_then(|u| u.handshake()) {
        return tmem_testkit::skip(tmem_testkit::Feature::Userfaultfd, &format!("tmem run needs userfaultfd: {e}"));
    }
    let run = common::run_bench(
        &[
            "pressure",
            "--workload-mib",
            "192",
            "--levels",
            "65",
            "--runs",
            "1",
            "--passes",
            "1",
            "--backends",
            "zram,tmem-run",
            "--allow-other-swap",
            "--after-exit-secs",
            "1",
        ],
        true,
    );
    let (v, stdout) = (&run.json, &run.stdout);
    assert!(run.ok, "tmem bench pressure failed");
    assert!(stdout.contains("tmem-run = each job under tmem run"), "{stdout}");
    assert!(stdout.contains("memory of the whole stack"), "{stdout}");
    let runs = v["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2, "{runs:?}");
    let r = runs.iter().find(|r| r["backend"] == "tmem-run").unwrap();
    assert_eq!(r["outcome"], "OK", "{r}");
    for (j, want) in r["jobs"].as_array().unwrap().iter().zip(v["reference"]["jobs"].as_array().unwrap()) {
        assert_eq!(j["output"], want["output"]);
    }
    // The pages went to the helpers' pools (pswpout is system-wide: other tests may swap).
    assert!(r["limit_bytes"].as_u64().is_some(), "{r}");
    assert!(r["pool_peak_bytes"].as_u64().unwrap() > 1 << 20, "no pool seen: {r}");
    assert!(r["pool_stored_bytes_at_peak"].as_u64().unwrap() > r["pool_peak_bytes"].as_u64().unwrap(), "{r}");
}
