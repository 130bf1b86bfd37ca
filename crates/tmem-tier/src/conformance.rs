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
