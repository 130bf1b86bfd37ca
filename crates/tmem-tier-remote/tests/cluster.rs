//! RemoteTier on a real Redis Cluster (`redis-server --cluster-enabled yes`,
//! made by `redis-cli --cluster create`) on 127.0.0.1: conformance, copies
//! on distinct masters, and a workload that goes on right through a master's
//! SIGKILL (and the failover to its replica) and the migration of a slot.
//! Every server is killed by its own pid when the cluster guard drops.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand_xoshiro::rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use tmem_bench::redis::cluster::RedisCluster;
use tmem_bench::redis::redis_server_binary;
use tmem_testkit::{skip, Feature};
use tmem_tier::conformance::{check, check_hand_over, Expect};
use tmem_tier::{Health, Tier, TierKey, TierPut};
use tmem_tier_remote::{RemoteTier, RemoteTierConfig};

fn cluster(masters: usize, replicas: usize) -> Option<RedisCluster> {
    if redis_server_binary().is_none() || !tmem_testkit::have_tool("redis-cli") {
        skip(Feature::Tools, "redis-server or redis-cli not installed");
        return None;
    }
    Some(RedisCluster::start(masters, replicas).expect("start a redis cluster"))
}

fn config(c: &RedisCluster, host: &str) -> RemoteTierConfig {
    let mut cfg = RemoteTierConfig::new(c.seeds(), "test", host);
    // The machine is shared with compilers: be generous.
    cfg.op_timeout = Duration::from_secs(3);
    cfg.connect_timeout = Duration::from_secs(3);
    cfg
}

fn tier(c: &RedisCluster, host: &str) -> RemoteTier {
    config(c, host).build().expect("tier on the cluster")
}

fn key(i: u64) -> TierKey {
    TierKey { pool: 1, object: i / 64, index: i }
}

/// 300..4160 bytes that depend on `i` and `version`.
fn value(i: u64, version: u64) -> Vec<u8> {
    let seed = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ version.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let len = 300 + usize::try_from(rng.next_u64() % 3861).unwrap();
    (0..len).map(|_| rng.next_u64().to_le_bytes()[0]).collect()
}

#[test]
fn cluster_conformance_three_masters() {
    let Some(c) = cluster(3, 0) else { return };
    let t = tier(&c, "conf");
    assert_eq!(t.node_names().len(), 3, "{:?}", t.node_names());
    assert_eq!(t.health(), Health::Healthy);
    check(&t, Expect::Stores);
    // Handed over, the successor keeps the masters and tags found at build.
    let cfg = config(&c, "handover");
    let t = cfg.clone().build().unwrap();
    check_hand_over(&t, &|h| {
        t.set_owner(false);
        let next = cfg.clone().adopt(&h).unwrap();
        assert_eq!((next.node_names(), next.node_slots()), (t.node_names(), t.node_slots()));
        Box::new(next)
    });
}

#[test]
fn a_cluster_seed_list_is_checked() {
    let mixed =
        RemoteTierConfig::new(vec!["redis+cluster://127.0.0.1:1".into(), "redis://127.0.0.1:2".into()], "t", "h");
    assert!(mixed.build().unwrap_err().to_string().contains("redis+cluster"));
    let Some(c) = cluster(3, 0) else { return };
    let mut cfg = RemoteTierConfig::new(c.seeds(), "test", "r4");
    cfg.replicas = 4;
    let err = cfg.build().unwrap_err().to_string();
    assert!(err.contains("3 masters") && err.contains("R = 4"), "{err}");
}

/// Pages are read back right, and nothing is lost, while one master is
/// SIGKILLed (its replica takes over) and, later, a node's slot moves to
/// another master key by key (ASK while it moves, MOVED after).
#[test]
fn pages_survive_a_master_kill_and_a_slot_migration() {
    let Some(mut c) = cluster(3, 1) else { return };
    let t = Arc::new(tier(&c, "chaos"));
    let slots: Vec<u16> = t.node_slots().into_iter().map(Option::unwrap).collect();
    assert_eq!(slots.len(), 3, "one node per master: {:?}", t.node_names());
    let masters: Vec<String> = slots.iter().map(|s| c.master_addr(*s).unwrap()).collect();
    let mut distinct = masters.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), 3, "each node's slot on its own master: {masters:?}");

    const N: u64 = 2000;
    let (stop, rounds) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
    let writer = {
        let (t, stop, rounds) = (Arc::clone(&t), Arc::clone(&stop), Arc::clone(&rounds));
        std::thread::spawn(move || {
            let mut round = 0;
            while !stop.load(Ordering::SeqCst) {
                round += 1;
                for chunk in (0..N).collect::<Vec<_>>().chunks(50) {
                    let vals: Vec<(TierKey, Vec<u8>)> = chunk.iter().map(|&i| (key(i), value(i, round))).collect();
                    let items: Vec<(TierKey, &[u8])> = vals.iter().map(|(k, v)| (*k, v.as_slice())).collect();
                    for (r, i) in t.put_batch(&items).into_iter().zip(chunk) {
                        assert_eq!(r.unwrap_or_else(|e| panic!("round {round} put {i}: {e}")), TierPut::Stored);
                    }
                    let keys: Vec<TierKey> = chunk.iter().map(|&i| key(i)).collect();
                    for (g, i) in t.get_batch(&keys).into_iter().zip(chunk) {
                        let v = g.unwrap_or_else(|e| panic!("round {round} get {i}: {e}"));
                        assert!(v == Some(value(*i, round)), "round {round}: wrong value of {i}");
                    }
                }
                rounds.store(round, Ordering::SeqCst);
            }
            round
        })
    };
    let wait_rounds = |n: u64, what: &str| {
        let target = rounds.load(Ordering::SeqCst) + n;
        let deadline = Instant::now() + Duration::from_secs(120);
        while rounds.load(Ordering::SeqCst) < target {
            assert!(!writer.is_finished(), "the writer failed {what}");
            assert!(Instant::now() < deadline, "no progress {what}");
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    wait_rounds(1, "before the kill");

    // SIGKILL node 0's master; its replica is promoted after the node timeout.
    let (_, promoted) = c.kill_master(slots[0], Duration::from_secs(60)).expect("failover");
    eprintln!("killed the master of slot {} ({}); {promoted} took over", slots[0], masters[0]);
    // The tier sees another master serve node 0's slot, takes the node out
    // and brings it back empty: the new master may lack acknowledged writes.
    let back = |n: usize| {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let st = t.node_stats();
            if st.nodes[n].up && st.nodes[n].reconnects >= 1 {
                return;
            }
            assert!(Instant::now() < deadline, "node {n} did not come back: {st:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    back(0);
    eprintln!("failed over to {promoted}; {:?}", t.node_stats());
    wait_rounds(1, "after the failover");

    // Move node 1's slot to node 2's master while the writer goes on.
    let to = c.index_of(&masters[2]).unwrap();
    let moved = c.migrate_slot(slots[1], to, 20, Duration::from_millis(5)).expect("migrate");
    c.wait_ok(Duration::from_secs(30)).expect("cluster consistent after the migration");
    assert_eq!(c.master_addr(slots[1]).unwrap(), masters[2]);
    assert!(moved > 0, "node 1's slot held no key");
    eprintln!("moved {moved} keys of slot {} to {}", slots[1], masters[2]);
    back(1);
    wait_rounds(1, "after the migration");

    stop.store(true, Ordering::SeqCst);
    let last = writer.join().expect("every put and get right through the kill and the migration");
    assert!(t.wait_repaired(Duration::from_secs(30)), "{:?}", t.node_stats());
    let keys: Vec<TierKey> = (0..N).map(key).collect();
    for (i, g) in (0..N).zip(t.get_batch(&keys)) {
        assert!(g.unwrap() == Some(value(i, last)), "final value of {i}");
        assert_eq!(t.replica_nodes(key(i)).unwrap().len(), 2, "copies of {i}");
    }
    // Node 1 moved to a slot of the master that serves no other node's slot.
    let now: Vec<String> = t.node_slots().into_iter().map(|s| c.master_addr(s.unwrap()).unwrap()).collect();
    let mut distinct = now.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), 3, "copies on distinct masters again: {now:?}");
    let ns = t.node_stats();
    eprintln!("{ns:?}");
    assert!(ns.retags >= 1, "{ns:?}");
    assert_eq!((ns.lost_pages, ns.vanished_pages, ns.under_replicated_pages), (0, 0, 0), "{ns:?}");
    assert!(ns.master_changes >= 2 && ns.rereplicated_pages > 0, "{ns:?}");
    assert_eq!(t.stats().failures, 0);
}
