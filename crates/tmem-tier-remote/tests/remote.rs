//! RemoteTier against real redis-server processes on 127.0.0.1.
//!
//! Every test starts its own servers on free loopback ports and kills
//! exactly those processes (by pid) when its guards drop, also on failure.

use rand_xoshiro::rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tmem_bench::redis::{redis_server_binary, RedisOptions, RedisServer, TlsFiles};
use tmem_testkit::{skip, Feature};
use tmem_tier::conformance::{check, check_hand_over, Expect};
use tmem_tier::seal::{MasterKey, SealError, Sealer};
use tmem_tier::{Health, Tier, TierError, TierGet, TierHandover, TierKey, TierPut};
use tmem_tier_remote::{RemoteTier, RemoteTierConfig};

fn servers(n: usize, opts: &RedisOptions) -> Option<Vec<RedisServer>> {
    if redis_server_binary().is_none() {
        skip(Feature::Tools, "redis-server not installed");
        return None;
    }
    Some((0..n).map(|_| RedisServer::start(opts).expect("start redis-server")).collect())
}

fn config(urls: Vec<String>, host: &str, replicas: usize) -> RemoteTierConfig {
    let mut c = RemoteTierConfig::new(urls, "test", host);
    c.replicas = replicas;
    // The machine is shared with compilers: be generous.
    c.op_timeout = Duration::from_secs(3);
    c.connect_timeout = Duration::from_secs(3);
    c
}

fn urls(s: &[RedisServer]) -> Vec<String> {
    s.iter().map(RedisServer::url).collect()
}

fn key(i: u64) -> TierKey {
    TierKey { pool: 1 + u32::try_from(i % 2).unwrap(), object: i / 64, index: i }
}

/// 300..4160 bytes that depend on `i`, so a value of another key is never mistaken for this one.
fn value(i: u64) -> Vec<u8> {
    let len = 300 + usize::try_from(i.wrapping_mul(2654435761) % 3861).unwrap();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(i.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let mut x = rng.next_u64();
    (0..len)
        .map(|_| {
            x = rng.next_u64();
            x.to_le_bytes()[0]
        })
        .collect()
}

fn direct(url: &str) -> redis::Connection {
    redis::Client::open(url).unwrap().get_connection().unwrap()
}

fn timed(name: &str, f: impl FnOnce()) {
    let t = Instant::now();
    f();
    eprintln!("{name}: {:?}", t.elapsed());
}

#[test]
fn conformance_three_nodes_r2() {
    let Some(s) = servers(3, &RedisOptions::default()) else { return };
    let tier = config(urls(&s), "conf3", 2).build().unwrap();
    assert_eq!(tier.health(), Health::Healthy);
    timed("conformance 3 nodes R=2", || check(&tier, Expect::Stores));
    let st = tier.stats();
    assert!(st.wire_bytes_out > st.bytes_written && st.wire_bytes_in > st.bytes_read, "{st:?}");
    assert!(st.get_p50_us > 0 && st.put_p99_us >= st.put_p50_us, "{st:?}");
}

#[test]
fn conformance_one_node_r1() {
    let Some(s) = servers(1, &RedisOptions::default()) else { return };
    let tier = config(urls(&s), "conf1", 1).build().unwrap();
    timed("conformance 1 node R=1", || check(&tier, Expect::Stores));
}

#[test]
fn copies_land_on_r_distinct_nodes_and_namespaces_do_not_collide() {
    let Some(s) = servers(3, &RedisOptions::default()) else { return };
    // Leftovers of an earlier run of this host, a key of another host, an unrelated key.
    let mut c0 = direct(&s[0].url());
    redis::cmd("SET").arg("tmem:test:h1:9:1:1").arg("stale").exec(&mut c0).unwrap();
    redis::cmd("SET").arg("tmem:test:h2:1:0:0").arg("theirs").exec(&mut c0).unwrap();
    redis::cmd("SET").arg("unrelated").arg("x").exec(&mut c0).unwrap();
    let a = config(urls(&s), "h1", 2).build().unwrap();
    let exists = |c: &mut redis::Connection, k: &str| redis::cmd("EXISTS").arg(k).query::<i64>(c).unwrap();
    assert_eq!(exists(&mut c0, "tmem:test:h1:9:1:1"), 0, "leftover of an earlier run deleted at build");
    assert_eq!(exists(&mut c0, "tmem:test:h2:1:0:0"), 1, "another host's key untouched");
    assert_eq!(exists(&mut c0, "unrelated"), 1);

    let b = config(urls(&s), "h2b", 2).build().unwrap();
    for i in 0..200 {
        assert_eq!(a.put(key(i), &value(i)).unwrap(), TierPut::Stored);
        assert_eq!(b.put(key(i), &value(i + 1)).unwrap(), TierPut::Stored);
    }
    let mut per_node = [0u64; 3];
    let mut conns: Vec<redis::Connection> = s.iter().map(|x| direct(&x.url())).collect();
    let mut out = Vec::new();
    for i in 0..200 {
        let nodes = a.replica_nodes(key(i)).unwrap();
        assert_eq!(nodes.len(), 2);
        assert_ne!(nodes[0], nodes[1]);
        for n in nodes {
            per_node[n] += 1;
            let v: Vec<u8> = redis::cmd("GET").arg(a.key_name(key(i))).query(&mut conns[n]).unwrap();
            assert_eq!(v, value(i));
        }
        assert_eq!(a.get(key(i), &mut out).unwrap(), TierGet::Hit);
        assert_eq!(out, value(i));
        assert_eq!(b.get(key(i), &mut out).unwrap(), TierGet::Hit);
        assert_eq!(out, value(i + 1));
    }
    assert!(per_node.iter().all(|&n| n > 80), "placement spreads over nodes: {per_node:?}");
    let ns = a.node_stats();
    assert_eq!(ns.nodes.iter().map(|n| n.stored_pages).collect::<Vec<_>>(), per_node.to_vec());
    assert!(a.key_name(key(5)).starts_with("tmem:test:h1:"));
    // Dropping a tier deletes its keys, and only its keys.
    drop(a);
    for c in &mut conns {
        let keys: Vec<String> = redis::cmd("KEYS").arg("tmem:test:h1:*").query(c).unwrap();
        assert!(keys.is_empty(), "{keys:?}");
    }
    assert_eq!(b.get(key(7), &mut out).unwrap(), TierGet::Hit);
}

#[test]
fn kill_one_of_three_mid_workload_r2() {
    let Some(mut s) = servers(3, &RedisOptions::default()) else { return };
    let all_urls = urls(&s);
    let tier = Arc::new(config(all_urls.clone(), "kill", 2).build().unwrap());
    const N: u64 = 5000;
    let done = Arc::new(AtomicUsize::new(0));
    let t0 = Instant::now();
    let writer = {
        let (tier, done) = (Arc::clone(&tier), Arc::clone(&done));
        std::thread::spawn(move || {
            for chunk in (0..N).collect::<Vec<_>>().chunks(50) {
                let vals: Vec<(TierKey, Vec<u8>)> = chunk.iter().map(|&i| (key(i), value(i))).collect();
                let items: Vec<(TierKey, &[u8])> = vals.iter().map(|(k, v)| (*k, v.as_slice())).collect();
                for (r, i) in tier.put_batch(&items).into_iter().zip(chunk) {
                    assert_eq!(r.unwrap_or_else(|e| panic!("put {i}: {e}")), TierPut::Stored, "put {i}");
                }
                done.fetch_add(chunk.len(), Ordering::SeqCst);
            }
        })
    };
    while done.load(Ordering::SeqCst) < 2000 {
        assert!(!writer.is_finished(), "writer stopped early");
        std::thread::sleep(Duration::from_millis(1));
    }
    let killed_pid = s[1].pid();
    s[1].kill();
    eprintln!("killed server 1 (pid {killed_pid}) after {} puts", done.load(Ordering::SeqCst));
    writer.join().expect("every put stored despite the kill");
    eprintln!("5000 puts with a kill: {:?}", t0.elapsed());

    // Reads work before re-replication is done, too.
    let keys: Vec<TierKey> = (0..N).map(key).collect();
    let t = Instant::now();
    assert!(tier.wait_repaired(Duration::from_secs(20)), "re-replication did not finish: {:?}", tier.node_stats());
    eprintln!("re-replication finished {:?} after the writer", t.elapsed());
    let mgets = tier.stats().backing_reads;
    for (i, g) in tier.get_batch(&keys).into_iter().enumerate() {
        let v = g.unwrap_or_else(|e| panic!("get {i}: {e}")).unwrap_or_else(|| panic!("get {i}: miss"));
        assert_eq!(v, value(u64::try_from(i).unwrap()), "value of {i}");
    }
    // One MGET to each of the two surviving servers, at most.
    let sent = tier.stats().backing_reads - mgets;
    assert!((1..=2).contains(&sent), "{sent} MGETs for one batched get");
    let ns = tier.node_stats();
    assert!(!ns.nodes[1].up && ns.nodes_up == 2, "{ns:?}");
    assert!(ns.rereplicated_pages > 0, "{ns:?}");
    assert_eq!(ns.under_replicated_pages, 0);
    assert_eq!(ns.nodes[1].stored_pages, 0, "no copy is counted on the dead node");
    assert!(matches!(tier.health(), Health::Degraded(_)), "{:?}", tier.health());
    eprintln!("{}", serde_json_lite(&ns));

    // Two copies of every page on the surviving servers, read directly.
    assert_two_copies(&tier, &[&all_urls[0], &all_urls[2]], N);
    assert_eq!(tier.stats().failures, 0);
}

/// Every page `key(0..n)` has two copies, of `value(i)`, on `servers`
/// (read directly), and two in the tier's index.
fn assert_two_copies(tier: &RemoteTier, servers: &[&str], n: u64) {
    let keys: Vec<TierKey> = (0..n).map(key).collect();
    let mut copies = vec![0u32; keys.len()];
    for url in servers {
        let mut pipe = redis::pipe();
        for k in &keys {
            pipe.cmd("GET").arg(tier.key_name(*k));
        }
        let vals: Vec<Option<Vec<u8>>> = pipe.query(&mut direct(url)).unwrap();
        for (i, v) in vals.into_iter().enumerate() {
            if let Some(v) = v {
                assert_eq!(v, value(u64::try_from(i).unwrap()), "copy of {i}");
                copies[i] += 1;
            }
        }
    }
    assert!(
        copies.iter().all(|&c| c == 2),
        "pages with fewer than 2 copies: {}",
        copies.iter().filter(|&&c| c < 2).count()
    );
    for k in &keys {
        assert_eq!(tier.replica_nodes(*k).unwrap().len(), 2);
    }
}

/// Stores `value(i)` under `key(i)` for `0..n`, in batches.
fn put_all(tier: &RemoteTier, n: u64) {
    for chunk in (0..n).collect::<Vec<_>>().chunks(64) {
        let vals: Vec<(TierKey, Vec<u8>)> = chunk.iter().map(|&i| (key(i), value(i))).collect();
        let items: Vec<(TierKey, &[u8])> = vals.iter().map(|(k, v)| (*k, v.as_slice())).collect();
        assert!(tier.put_batch(&items).into_iter().all(|r| r.unwrap() == TierPut::Stored));
    }
}

/// Every page `key(0..n)` reads back as `value(i)`.
fn assert_all_read(tier: &RemoteTier, n: u64) {
    let keys: Vec<TierKey> = (0..n).map(key).collect();
    for (i, g) in (0..n).zip(tier.get_batch(&keys)) {
        let v = g.unwrap_or_else(|e| panic!("get {i}: {e}")).unwrap_or_else(|| panic!("get {i}: miss"));
        assert_eq!(v, value(i), "value of {i}");
    }
}

/// This tier's keys on one server.
fn keys_on(url: &str, host: &str) -> usize {
    let keys: Vec<String> = redis::cmd("KEYS").arg(format!("tmem:test:{host}:*")).query(&mut direct(url)).unwrap();
    keys.len()
}

#[test]
fn hand_over_conformance_three_nodes_r2() {
    let Some(s) = servers(3, &RedisOptions::default()) else { return };
    let cfg = config(urls(&s), "handover", 2);
    let tier = cfg.clone().build().unwrap();
    timed("hand-over conformance 3 nodes R=2", || {
        check_hand_over(&tier, &|h| {
            // The old process would exit now: its drop must leave the keys.
            tier.set_owner(false);
            Box::new(cfg.clone().adopt(&h).unwrap())
        });
    });
}

#[test]
fn adopt_with_a_server_killed_after_the_hand_over() {
    let Some(mut s) = servers(3, &RedisOptions::default()) else { return };
    let all = urls(&s);
    let cfg = config(all.clone(), "handkill", 2);
    let tier = cfg.clone().build().unwrap();
    const N: u64 = 1500;
    put_all(&tier, N);
    let on_killed = (0..N).filter(|&i| tier.replica_nodes(key(i)).unwrap().contains(&1)).count();
    assert!(on_killed > 500, "{on_killed}");
    let t = Instant::now();
    let h = tier.hand_over().unwrap();
    eprintln!("hand_over of {N} pages: {:?}, {} bytes", t.elapsed(), h.state.len());
    tier.set_owner(false);
    drop(tier);
    s[1].kill();

    let t = Instant::now();
    let next = cfg.adopt(&h).unwrap();
    eprintln!("adopt with a server down: {:?}", t.elapsed());
    assert!(matches!(next.health(), Health::Degraded(_)), "{:?}", next.health());
    assert_eq!(next.stats().stored_pages, N);
    assert_all_read(&next, N);
    let t = Instant::now();
    assert!(next.wait_repaired(Duration::from_secs(20)), "{:?}", next.node_stats());
    eprintln!("re-replication after adopt: {:?}", t.elapsed());
    assert!((0..N).all(|i| !next.replica_nodes(key(i)).unwrap().contains(&1)));
    assert_two_copies(&next, &[&all[0], &all[2]], N);
    assert!(next.node_stats().rereplicated_pages >= u64::try_from(on_killed).unwrap());

    // The server returns, but comes back (wiped) only once the tier owns its keys.
    s[1].restart().unwrap();
    std::thread::sleep(Duration::from_secs(1));
    assert!(!next.node_stats().nodes[1].up, "a tier that does not own its keys wiped a server");
    next.set_owner(true);
    let t = Instant::now();
    while !next.node_stats().nodes[1].up {
        assert!(t.elapsed() < Duration::from_secs(15), "did not come back: {:?}", next.node_stats());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(next.health(), Health::Healthy);
    assert_all_read(&next, N);
}

/// Handed over while re-replication runs: the state lists only copies the
/// servers hold; the predecessor's re-replication waits for its next write.
#[test]
fn hand_over_during_re_replication() {
    let Some(mut s) = servers(3, &RedisOptions::default()) else { return };
    let all = urls(&s);
    let cfg = config(all.clone(), "handrepair", 2);
    let tier = cfg.clone().build().unwrap();
    const N: u64 = 6000;
    put_all(&tier, N);
    s[1].kill();
    // A read of the dead server marks it down and starts re-replication.
    let _ = tier.get_batch(&(0..N).map(key).collect::<Vec<_>>());
    std::thread::sleep(Duration::from_millis(5));
    let h = tier.hand_over().unwrap();
    let (short, done) = (tier.under_replicated(), tier.node_stats().rereplicated_pages);
    eprintln!("handed over with {done} pages re-replicated, {short} short");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(tier.node_stats().rereplicated_pages, done, "re-replication went on after the hand-over");

    let next = cfg.adopt(&h).unwrap();
    assert_all_read(&next, N);
    // Every copy the successor's index lists is on its server.
    for (n, url) in all.iter().enumerate().filter(|(n, _)| *n != 1) {
        let keys: Vec<u64> = (0..N).filter(|&i| next.replica_nodes(key(i)).unwrap().contains(&n)).collect();
        let mut pipe = redis::pipe();
        for &i in &keys {
            pipe.cmd("GET").arg(next.key_name(key(i)));
        }
        let vals: Vec<Option<Vec<u8>>> = pipe.query(&mut direct(url)).unwrap();
        for (i, v) in keys.into_iter().zip(vals) {
            assert_eq!(v, Some(value(i)), "copy of {i} the index lists on node {n}");
        }
    }
    drop(next);

    // The hand-over failed: the predecessor's next write lets re-replication go on.
    put_all(&tier, 10);
    assert!(tier.wait_repaired(Duration::from_secs(20)), "{:?}", tier.node_stats());
    assert_two_copies(&tier, &[&all[0], &all[2]], N);
}

#[test]
fn an_adopted_tier_deletes_nothing_until_it_owns_the_keys() {
    let Some(s) = servers(2, &RedisOptions::default()) else { return };
    let cfg = config(urls(&s), "handown", 2);
    let tier = cfg.clone().build().unwrap();
    const N: u64 = 200;
    put_all(&tier, N);
    let h = tier.hand_over().unwrap();
    tier.set_owner(false);
    drop(tier);
    let held = |what: &str| {
        for srv in &s {
            assert_eq!(keys_on(&srv.url(), "handown"), usize::try_from(N).unwrap(), "{what}");
        }
    };
    held("the predecessor, not owner, deleted keys at drop");
    let a = cfg.clone().adopt(&h).unwrap();
    assert_all_read(&a, N);
    drop(a);
    held("an adopted tier deleted keys at drop");
    let b = cfg.adopt(&h).unwrap();
    assert_all_read(&b, N);
    b.set_owner(true);
    drop(b);
    for srv in &s {
        assert_eq!(keys_on(&srv.url(), "handown"), 0, "the owner's drop deletes its keys");
    }
}

#[test]
fn mismatched_or_corrupt_states_are_refused() {
    let Some(s) = servers(3, &RedisOptions::default()) else { return };
    let all = urls(&s);
    let tier = config(all.clone(), "handbad", 2).build().unwrap();
    put_all(&tier, 50);
    let h = tier.hand_over().unwrap();
    let refused = |cfg: RemoteTierConfig, h: &TierHandover, what: &str| {
        let err = cfg.adopt(h).map(|_| ()).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, TierError::Config { .. }) && msg.contains(what), "{what}: {msg}");
        eprintln!("{what}: {msg}");
    };
    let with = |state: Vec<u8>| TierHandover { kind: h.kind.clone(), state, fds: Vec::new() };
    refused(config(all.clone(), "other", 2), &h, "host_id");
    let mut c = config(all.clone(), "handbad", 2);
    c.cluster_id = "elsewhere".into();
    refused(c, &h, "cluster_id");
    refused(config(all.clone(), "handbad", 3), &h, "replicas");
    refused(config(vec![all[1].clone(), all[0].clone(), all[2].clone()], "handbad", 2), &h, "nodes");
    refused(config(all[..2].to_vec(), "handbad", 2), &h, "nodes");
    for len in [0, 7, 20, h.state.len() / 2, h.state.len() - 1] {
        refused(config(all.clone(), "handbad", 2), &with(h.state[..len].to_vec()), "truncated");
    }
    let mut flipped = h.state.clone();
    flipped[h.state.len() / 2] ^= 4;
    refused(config(all.clone(), "handbad", 2), &with(flipped), "corrupt");
    let disk = TierHandover { kind: "disk".into(), state: h.state.clone(), fds: Vec::new() };
    refused(config(all.clone(), "handbad", 2), &disk, "\"disk\"");
    // Nothing was deleted by the refused successors: the predecessor goes on.
    assert_all_read(&tier, 50);
    put_all(&tier, 60);
    assert_all_read(&tier, 60);
}

fn serde_json_lite(s: &tmem_tier_remote::RemoteStats) -> String {
    format!(
        "rereplicated={} under={} lost={} nodes={:?}",
        s.rereplicated_pages,
        s.under_replicated_pages,
        s.lost_pages,
        s.nodes.iter().map(|n| (n.up, n.stored_pages, n.errors, n.down_events)).collect::<Vec<_>>()
    )
}

#[test]
fn r1_node_loss_is_an_error_never_wrong_data() {
    let Some(mut s) = servers(3, &RedisOptions::default()) else { return };
    let tier = config(urls(&s), "r1", 1).build().unwrap();
    const N: u64 = 600;
    let vals: Vec<(TierKey, Vec<u8>)> = (0..N).map(|i| (key(i), value(i))).collect();
    let items: Vec<(TierKey, &[u8])> = vals.iter().map(|(k, v)| (*k, v.as_slice())).collect();
    assert!(tier.put_batch(&items).into_iter().all(|r| r.unwrap() == TierPut::Stored));
    let on_dead: Vec<u64> = (0..N).filter(|&i| tier.replica_nodes(key(i)).unwrap() == vec![1]).collect();
    assert!(on_dead.len() > 100, "{}", on_dead.len());
    s[1].kill();

    let check_all = |tier: &RemoteTier| {
        let mut out = Vec::new();
        for i in 0..N {
            match tier.get(key(i), &mut out) {
                Ok(TierGet::Hit) => {
                    assert!(!on_dead.contains(&i), "{i} was on the dead node, yet hit");
                    assert_eq!(out, value(i), "wrong data for {i}");
                }
                Ok(TierGet::Miss) => panic!("{i}: a lost page must not read as a miss"),
                Err(TierError::Unavailable { reason, .. }) => {
                    assert!(on_dead.contains(&i), "{i}: {reason}");
                    assert!(out.is_empty());
                }
                Err(e) => panic!("{i}: {e}"),
            }
        }
        let batch = tier.get_batch(&(0..N).map(key).collect::<Vec<_>>());
        for (i, g) in (0..N).zip(batch) {
            match g {
                Ok(Some(v)) => assert_eq!(v, value(i)),
                Ok(None) => panic!("{i}: miss"),
                Err(e) => assert!(on_dead.contains(&i) && matches!(e, TierError::Unavailable { .. }), "{i}: {e}"),
            }
        }
    };
    check_all(&tier);
    match tier.health() {
        Health::Degraded(why) => assert!(why.contains(&s[1].url()), "{why}"),
        h => panic!("{h:?}"),
    }
    // New puts go to the live nodes.
    assert_eq!(tier.put(key(N + 1), &value(N + 1)).unwrap(), TierPut::Stored);
    assert!(!tier.replica_nodes(key(N + 1)).unwrap().contains(&1));

    // The server comes back empty on the same port: its pages stay errors (lost), never misses.
    s[1].restart().expect("restart");
    let t = Instant::now();
    while !tier.node_stats().nodes[1].up {
        assert!(t.elapsed() < Duration::from_secs(15), "node did not come back: {:?}", tier.node_stats());
        std::thread::sleep(Duration::from_millis(20));
    }
    check_all(&tier);
    let ns = tier.node_stats();
    assert_eq!(ns.lost_pages, u64::try_from(on_dead.len()).unwrap());
    assert_eq!(ns.nodes[1].reconnects, 1);
    assert!(matches!(tier.health(), Health::Degraded(ref w) if w.contains("lost")), "{:?}", tier.health());
    // A lost page can be overwritten or removed.
    let (a, b) = (on_dead[0], on_dead[1]);
    assert_eq!(tier.put(key(a), &value(a)).unwrap(), TierPut::Stored);
    let mut out = Vec::new();
    assert_eq!(tier.get(key(a), &mut out).unwrap(), TierGet::Hit);
    assert_eq!(out, value(a));
    assert!(tier.remove(key(b)).unwrap());
    assert_eq!(tier.get(key(b), &mut out).unwrap(), TierGet::Miss);
    assert_eq!(tier.node_stats().lost_pages, u64::try_from(on_dead.len() - 2).unwrap());
}

#[test]
fn tampered_value_fails_to_open() {
    let Some(s) = servers(2, &RedisOptions::default()) else { return };
    let tier = config(urls(&s), "tamper", 2).build().unwrap();
    let sealer = Sealer::new(&MasterKey::from_bytes([0x42; 32])).unwrap();
    let k = TierKey { pool: 3, object: 11, index: 5 };
    let page: Vec<u8> = (0..4096u32).map(|i| u8::try_from(i % 251).unwrap()).collect();
    let mut sealed = Vec::new();
    sealer.seal(k, 1, &page, &mut sealed);
    assert_eq!(tier.put(k, &sealed).unwrap(), TierPut::Stored);
    let mut out = Vec::new();
    assert_eq!(tier.get(k, &mut out).unwrap(), TierGet::Hit);
    sealer.open(k, 1, &mut out).unwrap();
    assert_eq!(out, page);

    // Flip one byte of every copy, directly in Redis.
    let name = tier.key_name(k);
    for srv in &s {
        let mut c = direct(&srv.url());
        let b: Vec<u8> = redis::cmd("GETRANGE").arg(&name).arg(100).arg(100).query(&mut c).unwrap();
        let _: i64 = redis::cmd("SETRANGE").arg(&name).arg(100).arg(vec![b[0] ^ 0x01]).query(&mut c).unwrap();
    }
    assert_eq!(tier.get(k, &mut out).unwrap(), TierGet::Hit);
    assert_eq!(out.len(), sealed.len());
    assert_ne!(out, sealed);
    assert!(matches!(sealer.open(k, 1, &mut out), Err(SealError::Auth)));
    assert!(out.is_empty());
}

#[test]
fn full_node_answers_full_not_an_error() {
    let small = RedisOptions { maxmemory: Some("2mb".into()), ..Default::default() };
    let Some(s) = servers(1, &small) else { return };
    let tier = config(urls(&s), "full", 1).build().unwrap();
    let mut stored = Vec::new();
    let mut fulls = 0;
    for i in 0..2000u64 {
        let v = vec![u8::try_from(i % 256).unwrap(); 4096];
        match tier.put(key(i), &v).unwrap() {
            TierPut::Stored => stored.push(i),
            TierPut::Full => {
                fulls += 1;
                if fulls >= 20 {
                    break;
                }
            }
        }
    }
    assert!(fulls >= 20 && !stored.is_empty(), "stored {} full {fulls}", stored.len());
    let st = tier.stats();
    assert!(st.full >= 20 && st.failures == 0, "{st:?}");
    assert_eq!(st.stored_pages, u64::try_from(stored.len()).unwrap());
    assert!(tier.node_stats().nodes[0].oom_refusals >= 20);
    let mut out = Vec::new();
    for &i in stored.iter().step_by(17) {
        assert_eq!(tier.get(key(i), &mut out).unwrap(), TierGet::Hit);
        assert_eq!(out, vec![u8::try_from(i % 256).unwrap(); 4096]);
    }
    // Freeing room lets puts store again.
    for &i in &stored[..100] {
        assert!(tier.remove(key(i)).unwrap());
    }
    assert_eq!(tier.put(key(5000), &[1; 4096]).unwrap(), TierPut::Stored);
    eprintln!("2mb server took {} pages of 4 KiB before Full", stored.len());
}

#[test]
fn a_full_node_sends_copies_to_the_next_node() {
    let Some(bin) = redis_server_binary() else {
        skip(Feature::Tools, "redis-server not installed");
        return;
    };
    let _ = bin;
    let small = RedisServer::start(&RedisOptions { maxmemory: Some("2mb".into()), ..Default::default() }).unwrap();
    let big = RedisServer::start(&RedisOptions::default()).unwrap();
    let tier = config(vec![small.url(), big.url()], "overflow", 1).build().unwrap();
    for chunk in (0..1200u64).collect::<Vec<_>>().chunks(64) {
        let vals: Vec<(TierKey, Vec<u8>)> = chunk.iter().map(|&i| (key(i), value(i))).collect();
        let items: Vec<(TierKey, &[u8])> = vals.iter().map(|(k, v)| (*k, v.as_slice())).collect();
        assert!(tier.put_batch(&items).into_iter().all(|r| r.unwrap() == TierPut::Stored));
    }
    let ns = tier.node_stats();
    assert!(ns.nodes[0].oom_refusals > 0 && ns.nodes[1].stored_pages > ns.nodes[0].stored_pages, "{ns:?}");
    assert_eq!(tier.stats().full, 0);
    let got = tier.get_batch(&(0..1200).map(key).collect::<Vec<_>>());
    for (i, g) in (0..1200u64).zip(got) {
        assert_eq!(g.unwrap().unwrap(), value(i));
    }
}

#[test]
fn evicting_server_is_refused_for_persistent_pools() {
    let Some(s) = servers(1, &RedisOptions { policy: "allkeys-lru".into(), ..Default::default() }) else { return };
    let err = config(urls(&s), "evict", 1).build().unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, TierError::Config { .. }), "{msg}");
    assert!(msg.contains("allkeys-lru") && msg.contains(&s[0].url()) && msg.contains("noeviction"), "{msg}");
    eprintln!("refused: {msg}");
    // Ephemeral pools may use it.
    let mut c = config(urls(&s), "evict", 1);
    c.require_noeviction = false;
    let tier = c.build().unwrap();
    assert_eq!(tier.node_stats().nodes[0].maxmemory_policy.as_deref(), Some("allkeys-lru"));
}

#[test]
fn auth_password_and_acl_users() {
    let opts = RedisOptions {
        requirepass: Some("s3cret-pw".into()),
        acl_users: vec![
            // CONFIG is in @dangerous: the policy is read from INFO memory instead.
            "tmemuser on >tmem-pw ~tmem:* +@all -@dangerous +info".into(),
            "noinfo on >noinfo-pw ~tmem:* +@all -@dangerous".into(),
        ],
        ..Default::default()
    };
    let Some(s) = servers(1, &opts) else { return };
    let srv = &s[0];

    let tier = config(vec![srv.url_with_auth("", "s3cret-pw")], "auth", 1).build().unwrap();
    let mut out = Vec::new();
    assert_eq!(tier.put(key(1), b"hello").unwrap(), TierPut::Stored);
    assert_eq!(tier.get(key(1), &mut out).unwrap(), TierGet::Hit);
    assert_eq!(tier.node_stats().nodes[0].node, format!("redis://***@127.0.0.1:{}", srv.port()));

    for (url, what) in [
        (srv.url_with_auth("", "badpass-123"), "wrong password"),
        (srv.url_with_auth("tmemuser", "badpass-123"), "wrong ACL password"),
        (srv.url(), "no password"),
    ] {
        let err = config(vec![url], "auth2", 1).build().unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, TierError::Config { .. }), "{what}: {msg}");
        assert!(msg.to_lowercase().contains("auth"), "{what}: {msg}");
        assert!(msg.contains(&format!("127.0.0.1:{}", srv.port())), "{what}: {msg}");
        assert!(!msg.contains("badpass"), "password leaked: {msg}");
        eprintln!("{what}: {msg}");
    }

    let acl = config(vec![srv.url_with_auth("tmemuser", "tmem-pw")], "acl", 1).build().unwrap();
    assert_eq!(acl.node_stats().nodes[0].maxmemory_policy.as_deref(), Some("noeviction"));
    check(&acl, Expect::Stores);

    let err = config(vec![srv.url_with_auth("noinfo", "noinfo-pw")], "acl2", 1).build().unwrap_err();
    assert!(err.to_string().contains("+info"), "{err}");
}

#[test]
fn tls_conformance() {
    if redis_server_binary().is_none() {
        skip(Feature::Tools, "redis-server not installed");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let files = make_test_certs(dir.path());
    let opts = RedisOptions { tls: Some(files.clone()), ..Default::default() };
    let mut s = Vec::new();
    for _ in 0..2 {
        match RedisServer::start(&opts) {
            Ok(x) => s.push(x),
            Err(e) if e.to_string().to_lowercase().contains("tls") => {
                skip(Feature::Tools, &format!("redis-server has no TLS support: {e}"));
                return;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(s[0].url().starts_with("rediss://"));
    // Untrusted CA: the handshake fails.
    let err = config(urls(&s), "tls0", 2).build().unwrap_err();
    eprintln!("without the CA: {err}");
    assert!(matches!(err, TierError::Unavailable { .. }), "{err}");

    let mut c = config(urls(&s), "tls", 2);
    c.ca_cert = Some(files.ca_cert.clone());
    let tier = c.build().unwrap();
    timed("conformance over TLS, 2 nodes R=2", || check(&tier, Expect::Stores));
}

#[test]
fn bad_configs_are_refused() {
    let u = vec!["redis://127.0.0.1:1".to_string()];
    let mut c = RemoteTierConfig::new(u.clone(), "c", "h");
    c.replicas = 2;
    assert!(matches!(c.build(), Err(TierError::Config { .. })));
    assert!(matches!(RemoteTierConfig::new(u.clone(), "c:x", "h").build(), Err(TierError::Config { .. })));
    assert!(matches!(RemoteTierConfig::new(u.clone(), "c", "*").build(), Err(TierError::Config { .. })));
    assert!(matches!(RemoteTierConfig::new(vec![], "c", "h").build(), Err(TierError::Config { .. })));
    let dup = vec!["redis://127.0.0.1:1".to_string(), "redis://u:p@127.0.0.1:1".to_string()];
    assert!(matches!(RemoteTierConfig::new(dup, "c", "h").build(), Err(TierError::Config { .. })));
    // Nothing listens on port 1 of loopback.
    let err = RemoteTierConfig::new(u, "c", "h").build().unwrap_err();
    assert!(matches!(err, TierError::Unavailable { .. }), "{err}");
}

#[test]
fn starts_degraded_when_one_node_is_down_and_picks_it_up_later() {
    let Some(mut s) = servers(2, &RedisOptions::default()) else { return };
    s[1].kill();
    let tier = config(urls(&s), "late", 2).build().unwrap();
    assert!(matches!(tier.health(), Health::Degraded(_)));
    for i in 0..100 {
        assert_eq!(tier.put(key(i), &value(i)).unwrap(), TierPut::Stored);
    }
    assert_eq!(tier.under_replicated(), 0, "one live node: one copy is all there can be");
    assert_eq!(tier.node_stats().degraded_puts, 100);
    s[1].restart().unwrap();
    let t = Instant::now();
    while !tier.node_stats().nodes[1].up {
        assert!(t.elapsed() < Duration::from_secs(15));
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(tier.wait_repaired(Duration::from_secs(10)), "{:?}", tier.node_stats());
    assert_eq!(tier.health(), Health::Healthy);
    for i in 0..100 {
        assert_eq!(tier.replica_nodes(key(i)).unwrap().len(), 2, "{i}");
    }
    assert!(tier.node_stats().rereplicated_pages >= 100);
}

/// Batched throughput on loopback (run with `--run-ignored all`; prints numbers).
#[test]
#[ignore = "benchmark"]
fn throughput_batched() {
    for (nodes, r) in [(1, 1), (3, 2)] {
        let Some(s) = servers(nodes, &RedisOptions::default()) else { return };
        let tier = config(urls(&s), "bench", r).build().unwrap();
        const N: u64 = 40_000;
        let vals: Vec<(TierKey, Vec<u8>)> =
            (0..N).map(|i| (key(i), vec![u8::try_from(i % 256).unwrap(); 4096])).collect();
        let t = Instant::now();
        for chunk in vals.chunks(64) {
            let items: Vec<(TierKey, &[u8])> = chunk.iter().map(|(k, v)| (*k, v.as_slice())).collect();
            assert!(tier.put_batch(&items).into_iter().all(|r| r.unwrap() == TierPut::Stored));
        }
        let put = t.elapsed();
        let keys: Vec<TierKey> = (0..N).map(key).collect();
        let t = Instant::now();
        for chunk in keys.chunks(64) {
            assert!(tier.get_batch(chunk).into_iter().all(|g| g.unwrap().is_some()));
        }
        let get = t.elapsed();
        let t = Instant::now();
        let mut out = Vec::new();
        for k in keys.iter().take(5000) {
            assert_eq!(tier.get(*k, &mut out).unwrap(), TierGet::Hit);
        }
        let single = t.elapsed();
        let rate = |d: Duration, n: u64| n as f64 / d.as_secs_f64();
        let st = tier.stats();
        eprintln!(
            "{nodes} nodes R={r}: put_batch(64) {:.0} pages/s ({:.0} MiB/s of pages), get_batch(64) {:.0} pages/s \
             ({:.0} MiB/s), single get {:.0}/s; put p50/p99 {}/{} us per batch, get p50/p99 {}/{} us",
            rate(put, N),
            rate(put, N) * 4096.0 / 1048576.0,
            rate(get, N),
            rate(get, N) * 4096.0 / 1048576.0,
            rate(single, 5000),
            st.put_p50_us,
            st.put_p99_us,
            st.get_p50_us,
            st.get_p99_us
        );
    }
}

#[test]
fn hung_server_times_out_is_skipped_and_rejoins_empty() {
    let Some(mut s) = servers(3, &RedisOptions::default()) else { return };
    let mut c = config(urls(&s), "hung", 2);
    c.op_timeout = Duration::from_millis(500);
    c.connect_timeout = Duration::from_millis(500);
    let tier = c.build().unwrap();
    const N: u64 = 600;
    let vals: Vec<(TierKey, Vec<u8>)> = (0..N).map(|i| (key(i), value(i))).collect();
    let items: Vec<(TierKey, &[u8])> = vals.iter().map(|(k, v)| (*k, v.as_slice())).collect();
    assert!(tier.put_batch(&items).into_iter().all(|r| r.unwrap() == TierPut::Stored));
    let on_hung = (0..N).filter(|&i| tier.replica_nodes(key(i)).unwrap().contains(&1)).count();
    assert!(on_hung > 200, "{on_hung}");

    s[1].pause().unwrap();
    let t = Instant::now();
    let keys: Vec<TierKey> = (0..N).map(key).collect();
    for (i, g) in (0..N).zip(tier.get_batch(&keys)) {
        assert_eq!(g.unwrap().unwrap(), value(i), "{i}");
    }
    let took = t.elapsed();
    eprintln!("reads with a hung server: {took:?}");
    assert!(took >= Duration::from_millis(450) && took < Duration::from_secs(5), "{took:?}");
    assert!(!tier.node_stats().nodes[1].up);
    assert!(tier.wait_repaired(Duration::from_secs(10)), "{:?}", tier.node_stats());
    assert!(keys.iter().all(|k| !tier.replica_nodes(*k).unwrap().contains(&1)));
    // Writes while it hangs go elsewhere, and wait for nothing.
    let t = Instant::now();
    assert_eq!(tier.put(key(N), &value(N)).unwrap(), TierPut::Stored);
    assert!(t.elapsed() < Duration::from_millis(400));

    s[1].resume().unwrap();
    let t = Instant::now();
    while !tier.node_stats().nodes[1].up {
        assert!(t.elapsed() < Duration::from_secs(15), "did not rejoin: {:?}", tier.node_stats());
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("rejoined {:?} after SIGCONT", t.elapsed());
    // It came back with this tier's old copies wiped: nothing stale can be read from it.
    let mut conn = direct(&s[1].url());
    let left: Vec<String> = redis::cmd("KEYS").arg("tmem:test:hung:*").query(&mut conn).unwrap();
    assert!(left.is_empty(), "{} stale keys", left.len());
    for (i, g) in (0..N).zip(tier.get_batch(&keys)) {
        assert_eq!(g.unwrap().unwrap(), value(i), "{i}");
    }
    assert_eq!(tier.health(), Health::Healthy);
    // Placement uses it again.
    for i in N + 1..N + 100 {
        assert_eq!(tier.put(key(i), &value(i)).unwrap(), TierPut::Stored);
    }
    assert!(tier.node_stats().nodes[1].stored_pages > 30);
}

#[test]
fn pages_deleted_behind_the_tiers_back() {
    let Some(s) = servers(2, &RedisOptions::default()) else { return };
    for (noeviction, host) in [(true, "vanish-p"), (false, "vanish-e")] {
        let mut c = config(urls(&s), host, 2);
        c.require_noeviction = noeviction;
        let tier = c.build().unwrap();
        assert_eq!(tier.put(key(1), &value(1)).unwrap(), TierPut::Stored);
        for srv in &s {
            let _: i64 = redis::cmd("DEL").arg(tier.key_name(key(1))).query(&mut direct(&srv.url())).unwrap();
        }
        let mut out = Vec::new();
        let r = tier.get(key(1), &mut out);
        if noeviction {
            // A persistent page never silently turns into a miss.
            assert!(matches!(r, Err(TierError::Unavailable { .. })), "{r:?}");
            assert_eq!(tier.node_stats().lost_pages, 1);
        } else {
            assert_eq!(r.unwrap(), TierGet::Miss);
            assert_eq!(tier.stats().stored_pages, 0);
        }
        assert_eq!(tier.node_stats().vanished_pages, 1);
    }
}

/// A throwaway CA and a server certificate for `127.0.0.1` and `localhost`
/// (P-256 keys, made with rcgen), written as PEM files into `dir`.
fn make_test_certs(dir: &std::path::Path) -> TlsFiles {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair, KeyUsagePurpose, SanType};
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.distinguished_name.push(rcgen::DnType::CommonName, "tmem test CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_key = KeyPair::generate().unwrap();
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let mut server = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
    server.subject_alt_names.push(SanType::IpAddress(std::net::Ipv4Addr::LOCALHOST.into()));
    server.distinguished_name.push(rcgen::DnType::CommonName, "localhost");
    server.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    server.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let server_key = KeyPair::generate().unwrap();
    let issuer = rcgen::Issuer::from_params(&ca, &ca_key);
    let server_cert = server.signed_by(&server_key, &issuer).unwrap();
    let files = TlsFiles { ca_cert: dir.join("ca.crt"), cert: dir.join("server.crt"), key: dir.join("server.key") };
    std::fs::write(&files.ca_cert, ca_cert.pem()).unwrap();
    std::fs::write(&files.cert, server_cert.pem()).unwrap();
    std::fs::write(&files.key, server_key.serialize_pem()).unwrap();
    files
}
