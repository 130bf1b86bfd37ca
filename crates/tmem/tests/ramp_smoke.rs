//! Smoke test of `tmem bench ramp` (root only), small and short: the Java
//! job's heap grows past its limit over zram and tmem, and under `tmem run`
//! with the limit as `--memory`; every row must end with every order
//! verified (zram's may end in an OOM kill, reported as such), swap (or, for
//! `tmem run`, evict) past the limit, carry per-step throughput, swap rate
//! and CPU, and leave nothing behind.
//!
//! The v1 memory cgroup of this machine OOM-kills a JVM under swap now and
//! then, over zram and tmem alike (see the limit below). zram's row may end
//! that way. tmem's row may too, once: it is then run again on its own, and
//! that run must end with every order verified.

mod common;

#[test]
fn ramp_smoke() {
    if let Some((feature, reason)) = common::missing_feature() {
        return tmem_testkit::skip(feature, reason);
    }
    if !tmem_testkit::have_tool("java") {
        return tmem_testkit::skip(tmem_testkit::Feature::Tools, "no java (default-jdk-headless)");
    }
    let before = common::Before::now();
    let ramp = |backends: &str| {
        let args = vec![
            "ramp",
            "--limit-mib",
            "768",
            // The JVM's fixed part (young generation, metaspace, the source
            // launcher's compiler) is a smaller share of a larger limit, and at
            // 75 % the footprint (the old generation keeps 40-70 % free) is well
            // past it. At 512 MiB the v1 memory cgroup OOM-killed the JVM at
            // 75 % in 3 of 6 runs on 2026-11-26 (70 %: 1 of 5); at
            // 768 MiB, 0 of 7. At 256 MiB it was killed at 50 % in 3 of 4.
            "--steps",
            "25,75",
            "--step-secs",
            "2",
            "--backends",
            backends,
            "--timeout",
            "300",
            "--allow-other-swap",
        ];
        let run = common::run_bench(&args, true);
        before.assert_nothing_left(run.json["machine"]["zram_device"].as_str());
        assert!(run.ok, "tmem bench ramp failed");
        run
    };
    // `tmem-run` among the backends is the `--tmem-run` row: no limit, no swap.
    let mut run = ramp("zram,tmem,tmem-run");
    let oom_killed = |r: &serde_json::Value| r["backend"] == "tmem" && r["outcome"] == "oom";
    if let Some(row) = run.json["rows"].as_array().unwrap().iter().position(oom_killed) {
        eprintln!("tmem's row was OOM-killed by its memory cgroup: it runs again on its own");
        let again = ramp("tmem");
        run.json["rows"][row] = again.json["rows"][0].clone();
    }
    let (v, stdout) = (&run.json, &run.stdout);
    for title in ["thousand operations per second", "swapped pages per second", "machine busy CPU", "daemon us/page"] {
        assert!(stdout.contains(title), "no {title:?} in the report");
    }
    assert!(run.svg.starts_with("<svg") && run.svg.contains("throughput against live heap"), "no figure");
    let reference = &v["reference"];
    assert_eq!(reference["outcome"], "ok", "{reference}");
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 3);
    for r in std::iter::once(reference).chain(rows) {
        let what = r["backend"].to_string();
        // The kernel's own row may end in its memory cgroup's OOM kill (once
        // in CI on 2026-11-27, zram at 75 % of 768 MiB under v1): the bench
        // reports that as it is. The reference and tmem must run to the end.
        if r["backend"] == "zram" && r["outcome"] == "oom" {
            eprintln!("zram's row was OOM-killed: {r}");
            continue;
        }
        assert_eq!(r["outcome"], "ok", "{what}: {r}");
        assert!(r["verified_orders"].as_u64().unwrap() > 100_000, "{what}");
        let steps = r["steps"].as_array().unwrap();
        assert_eq!(steps.len(), 2, "{what}");
        for s in steps {
            assert!(s["ops_per_sec"].as_f64().unwrap() > 0.0, "{what}: {s}");
            assert!(s["machine_busy_percent"].as_f64().unwrap() > 0.0, "{what}: {s}");
        }
        if r["backend"] == "tmem-run" {
            // No swap: its own summary says what it evicted.
            let summary = stdout.lines().find(|l| l.starts_with("tmem run: ")).expect("the tmem-run row's summary");
            let evicted: u64 =
                summary.split(" pages evicted").next().unwrap().rsplit(' ').next().unwrap().parse().unwrap();
            assert!(evicted > 0, "tmem run evicted nothing: {summary}");
            assert!(summary.contains(" 0 lost"), "{summary}");
        } else if r != reference {
            // Past the limit the heap is in swap.
            assert!(steps[1]["swapped_pages_per_sec"].as_f64().unwrap() > 0.0, "{what} did not swap: {r}");
            assert!(r["daemon_cpu_user_secs"].is_f64() == (r["backend"] == "tmem"), "{what}: {r}");
        }
    }
}
