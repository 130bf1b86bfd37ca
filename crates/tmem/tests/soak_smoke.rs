//! Smoke test of `tmem bench soak` (root, Redis): three minutes of restarts,
//! Redis node kills, `tmem set` changes, recompression and daemon kills
//! under checksum jobs. Every kind of event happens and recovers, no job
//! reads back a wrong page, no page is lost outside a daemon kill, and
//! nothing the soak set up remains.

mod common;

#[test]
fn soak_smoke() {
    if let Some((feature, reason)) = common::missing_feature() {
        return tmem_testkit::skip(feature, reason);
    }
    if tmem_bench::redis::redis_server_binary().is_none() || !tmem_testkit::have_tool("python3") {
        return tmem_testkit::skip(tmem_testkit::Feature::Tools, "redis-server or python3 not installed");
    }
    let before = common::Before::now();
    let run =
        common::run_bench(&["soak", "--minutes", "3", "--seed", "7", "--every", "4..8", "--job-life", "10..25"], false);
    before.assert_nothing_left(None);
    let v = &run.json;
    assert!(run.ok, "tmem bench soak failed");
    for kind in ["restart", "node-kill", "node-back", "set", "recompress", "daemon-kill"] {
        let of: Vec<&serde_json::Value> =
            v["events"].as_array().unwrap().iter().filter(|e| e["kind"] == kind).collect();
        assert!(!of.is_empty(), "no {kind} event: {}", v["events"]);
        assert!(of.iter().all(|e| e["recovered"] == true), "{kind}: {of:?}");
    }
    assert_eq!(v["lost_pages"], 0);
    assert_eq!(v["corrupt_jobs"], 0);
    assert_eq!(v["died_jobs"], 0);
    let ok = v["jobs"].as_array().unwrap().iter().filter(|j| j["outcome"] == "ok").count();
    assert!(ok >= 2, "jobs that ran to their end: {}", v["jobs"]);
    assert!(v["written_back_pages"].as_u64().unwrap() > 1000, "the tiers took pages: {v}");
    assert!(run.stdout.contains("PASS"), "{}", run.stdout);
    assert!(run.svg.is_empty(), "the soak draws no figure");
}
