//! The conformance suite every [`Tier`] passes. Call [`check`] from a test
//! of the implementation with a fresh, empty tier.

use std::collections::HashMap;

use crate::{Tier, TierGet, TierKey, TierPut, MAX_VALUE};

/// What the tier under test is expected to do with puts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// A real tier with room for the suite's few hundred values.
    Stores,
    /// A tier that answers `Full` to every put (the no-op tier).
    StoresNothing,
}

fn key(pool: u32, i: u64) -> TierKey {
    TierKey { pool, object: i % 3, index: i }
}

#[allow(clippy::cast_possible_truncation)] // byte patterns
fn value(i: u64, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i as usize * 31 + j * 7) as u8).collect()
}

/// Runs the whole suite; panics with a message on the first violation.
pub fn check(tier: &dyn Tier, expect: Expect) {
    let stores = expect == Expect::Stores;
    let mut out = Vec::new();
    let name = tier.name().to_owned();
    assert!(!name.is_empty());

    // Miss on an empty tier.
    assert_eq!(tier.get(key(1, 1), &mut out).unwrap(), TierGet::Miss, "{name}: empty tier hits");
    assert!(!tier.remove(key(1, 1)).unwrap(), "{name}: remove on empty tier");

    // Put/get round trip for every size class of value, including empty and maximal.
    let mut oracle: HashMap<TierKey, Vec<u8>> = HashMap::new();
    for (i, len) in [0usize, 1, 17, 100, 1000, 2049, 4096, MAX_VALUE].into_iter().enumerate() {
        let (k, v) = (key(1, i as u64), value(i as u64, len));
        let r = tier.put(k, &v).unwrap();
        assert_eq!(r, if stores { TierPut::Stored } else { TierPut::Full }, "{name}: put of {len} bytes");
        if stores {
            oracle.insert(k, v);
        }
    }
    for (k, v) in &oracle {
        out.push(0xEE);
        assert_eq!(tier.get(*k, &mut out).unwrap(), TierGet::Hit, "{name}: get {k:?}");
        assert_eq!(&out, v, "{name}: value of {k:?}");
    }
    assert!(tier.put(key(1, 99), &vec![0; MAX_VALUE + 1]).is_err(), "{name}: oversized value accepted");

    // Replace.
    if stores {
        let k = key(1, 3);
        let v = value(77, 333);
        assert_eq!(tier.put(k, &v).unwrap(), TierPut::Stored);
        assert_eq!(tier.get(k, &mut out).unwrap(), TierGet::Hit);
        assert_eq!(out, v, "{name}: replace");
        oracle.insert(k, v);
    }

    // Keys differing only in pool, object or index are distinct.
    let a = TierKey { pool: 2, object: 5, index: 6 };
    let others = [TierKey { pool: 3, ..a }, TierKey { object: 4, ..a }, TierKey { index: 7, ..a }];
    let _ = tier.put(a, b"only a").unwrap();
    for o in others {
        assert_eq!(tier.get(o, &mut out).unwrap(), TierGet::Miss, "{name}: {o:?} sees {a:?}");
    }
    if stores {
        oracle.insert(a, b"only a".to_vec());
    }

    // Batches agree with single operations.
    let batch: Vec<(TierKey, Vec<u8>)> =
        (100..164).map(|i| (key(4, i), value(i, 50 + usize::try_from(i * 13 % 3000).unwrap_or(0)))).collect();
    let items: Vec<(TierKey, &[u8])> = batch.iter().map(|(k, v)| (*k, v.as_slice())).collect();
    let results = tier.put_batch(&items);
    assert_eq!(results.len(), items.len());
    for r in results {
        assert_eq!(r.unwrap(), if stores { TierPut::Stored } else { TierPut::Full }, "{name}: batch put");
    }
    let keys: Vec<TierKey> = batch.iter().map(|(k, _)| *k).chain([key(4, 999)]).collect();
    let got = tier.get_batch(&keys);
    assert_eq!(got.len(), keys.len());
    for (i, g) in got.into_iter().enumerate() {
        let g = g.unwrap();
        if stores && i < batch.len() {
            assert_eq!(g.as_deref(), Some(batch[i].1.as_slice()), "{name}: batch get {i}");
        } else {
            assert!(g.is_none(), "{name}: batch get {i} should miss");
        }
    }
    let removed = tier.remove_batch(&keys[..32]);
    for r in removed {
        assert_eq!(r.unwrap(), stores, "{name}: batch remove");
    }
    for k in &keys[..32] {
        assert_eq!(tier.get(*k, &mut out).unwrap(), TierGet::Miss, "{name}: removed key still hits");
    }
    if stores {
        for (k, v) in &batch[32..] {
            oracle.insert(*k, v.clone());
        }
    }

    // Counters move.
    let st = tier.stats();
    assert_eq!(st.name, name);
    if stores {
        assert!(st.reads > 0 && st.misses > 0, "{name}: reads not counted: {st:?}");
        assert!(st.writes > 0 && st.bytes_written > 0, "{name}: writes not counted: {st:?}");
        assert_eq!(st.stored_pages, oracle.len() as u64, "{name}: stored_pages");
        assert_eq!(tier.capacity().stored_pages, oracle.len() as u64, "{name}: capacity");
    }

    // Concurrent puts/gets on disjoint keys.
    std::thread::scope(|s| {
        for t in 0..4u64 {
            s.spawn(move || {
                let mut out = Vec::new();
                for i in 0..50 {
                    let k = key(5, t * 1000 + i);
                    let v = value(t * 1000 + i, 200 + usize::try_from(i).unwrap() * 20);
                    if tier.put(k, &v).unwrap() == TierPut::Stored {
                        assert_eq!(tier.get(k, &mut out).unwrap(), TierGet::Hit);
                        assert_eq!(out, v);
                    }
                }
            });
        }
    });

    // Clearing a pool removes exactly that pool.
    tier.clear_pool(5).unwrap();
    assert_eq!(tier.get(key(5, 3), &mut out).unwrap(), TierGet::Miss, "{name}: clear_pool");
    for (k, v) in &oracle {
        assert_eq!(tier.get(*k, &mut out).unwrap(), TierGet::Hit, "{name}: clear_pool(5) removed {k:?}");
        assert_eq!(&out, v);
    }
    for p in [1, 2, 4] {
        tier.clear_pool(p).unwrap();
    }
    assert_eq!(tier.capacity().stored_pages, 0, "{name}: everything cleared");
}

/// The hand-over part of the suite ([`Tier::hand_over`]): `tier` (fresh and
/// empty, able to hold a few hundred values) is filled, partly overwritten
/// and removed, handed over and given to `adopt`, which builds the
/// successor's tier from the [`TierHandover`](crate::TierHandover) as a new
/// process would. The successor must hold exactly the values the
/// predecessor held, count them alike, and serve puts, removes and clears.
/// Handing over must leave the predecessor as it was.
pub fn check_hand_over(tier: &dyn Tier, adopt: &dyn Fn(crate::TierHandover) -> Box<dyn Tier>) {
    let name = tier.name().to_owned();
    let mut oracle: HashMap<TierKey, Vec<u8>> = HashMap::new();
    let items: Vec<(TierKey, Vec<u8>)> = (0..300)
        .map(|i| (key(1 + u32::from(i % 7 == 0), i), value(i, 1 + usize::try_from(i * 37).expect("small") % MAX_VALUE)))
        .collect();
    for (k, v) in &items {
        assert_eq!(tier.put(*k, v).unwrap(), TierPut::Stored, "{name}: put {k:?}");
        oracle.insert(*k, v.clone());
    }
    for i in (0..300).step_by(5) {
        let (k, v) = (key(1 + u32::from(i % 7 == 0), i), value(i + 1000, 200));
        assert_eq!(tier.put(k, &v).unwrap(), TierPut::Stored, "{name}: overwrite {k:?}");
        oracle.insert(k, v);
    }
    for i in (0..300).step_by(3) {
        let k = key(1 + u32::from(i % 7 == 0), i);
        assert!(tier.remove(k).unwrap(), "{name}: remove {k:?}");
        oracle.remove(&k);
    }
    let before = tier.capacity();
    let handed = tier.hand_over().unwrap_or_else(|e| panic!("{name}: hand_over: {e}"));
    assert_eq!(handed.kind, name, "{name}: the handed kind");
    // The predecessor is unchanged by handing over (a failed hand-over goes on with it).
    let mut out = Vec::new();
    for (k, v) in &oracle {
        assert_eq!(tier.get(*k, &mut out).unwrap(), TierGet::Hit, "{name}: {k:?} gone after hand_over");
        assert_eq!(&out, v, "{name}: {k:?} changed by hand_over");
    }
    let next = adopt(handed);
    assert_eq!(next.name(), name);
    let after = next.capacity();
    assert_eq!(after.stored_pages, before.stored_pages, "{name}: stored pages across the hand-over");
    assert_eq!(after.used_bytes, before.used_bytes, "{name}: used bytes across the hand-over");
    assert_eq!(after.limit_bytes, before.limit_bytes, "{name}: limit across the hand-over");
    for i in 0..300 {
        let k = key(1 + u32::from(i % 7 == 0), i);
        match oracle.get(&k) {
            Some(v) => {
                assert_eq!(next.get(k, &mut out).unwrap(), TierGet::Hit, "{name}: successor lost {k:?}");
                assert_eq!(&out, v, "{name}: successor's value of {k:?}");
            }
            None => assert_eq!(next.get(k, &mut out).unwrap(), TierGet::Miss, "{name}: successor has removed {k:?}"),
        }
    }
    let keys: Vec<TierKey> = oracle.keys().copied().collect();
    for (k, g) in keys.iter().zip(next.get_batch(&keys)) {
        assert_eq!(g.unwrap().as_deref(), Some(oracle[k].as_slice()), "{name}: successor's batch get of {k:?}");
    }
    // The successor writes, replaces and removes like any tier.
    for i in 300..400 {
        let (k, v) = (key(1, i), value(i, 1500));
        assert_eq!(next.put(k, &v).unwrap(), TierPut::Stored, "{name}: successor's put");
        oracle.insert(k, v);
    }
    let k = keys[0];
    assert_eq!(next.put(k, b"replaced").unwrap(), TierPut::Stored);
    oracle.insert(k, b"replaced".to_vec());
    assert!(next.remove(keys[1]).unwrap(), "{name}: successor's remove of a handed value");
    oracle.remove(&keys[1]);
    for (k, v) in &oracle {
        assert_eq!(next.get(*k, &mut out).unwrap(), TierGet::Hit, "{name}: successor lost {k:?}");
        assert_eq!(&out, v, "{name}: successor's value of {k:?}");
    }
    assert_eq!(next.capacity().stored_pages, oracle.len() as u64, "{name}: successor's count");
    next.clear_pool(2).unwrap();
    next.clear_pool(1).unwrap();
    assert_eq!(next.capacity().stored_pages, 0, "{name}: successor cleared");
}
