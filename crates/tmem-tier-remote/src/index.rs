//! The local index: which nodes hold a copy of each key this tier stored.
//!
//! The index is the authority for what the tier holds: a key that is not in
//! it is a miss without a round trip; a key whose every replica is gone stays
//! in it with an empty node set, so that its get is a clear error
//! (`Unavailable`) rather than a miss or somebody else's data.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use tmem_lock::{Mutex, MutexGuard, Rank};

use tmem_tier::TierKey;

use crate::placement::{bit, key_hash, mix64};

const SHARD_BITS: u32 = 6;

/// One key's record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    /// Nodes holding a copy (bit n = node n). Empty: every copy was lost.
    pub nodes: u64,
    /// Value length.
    pub len: u32,
    /// Unique per write: changes whenever the entry is replaced or removed.
    pub gen: u64,
}

/// Hasher for the shard maps: the key fields are mixed once more on finish.
#[derive(Default)]
pub(crate) struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        mix64(self.0)
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(*b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u32(&mut self, i: u32) {
        self.write_u64(u64::from(i));
    }
    fn write_u64(&mut self, i: u64) {
        self.0 = (self.0.rotate_left(23) ^ i).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

pub(crate) type Shard = HashMap<TierKey, Entry, BuildHasherDefault<KeyHasher>>;

/// Counters kept in step with the index, per node and in total.
#[derive(Debug, Default)]
pub(crate) struct Usage {
    pub pages: AtomicU64,
    pub bytes: AtomicU64,
}

impl Usage {
    fn add(&self, len: u32) {
        self.pages.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(u64::from(len), Ordering::Relaxed);
    }
    fn sub(&self, len: u32) {
        self.pages.fetch_sub(1, Ordering::Relaxed);
        self.bytes.fetch_sub(u64::from(len), Ordering::Relaxed);
    }
}

/// Sharded map from key to [`Entry`], with usage counters.
pub(crate) struct Index {
    shards: Box<[Mutex<Shard>]>,
    /// Keys with at least one copy.
    pub total: Usage,
    /// Keys whose every copy was lost.
    pub lost: AtomicU64,
    /// Per node usage (copies).
    pub per_node: Box<[Usage]>,
    next_gen: AtomicU64,
}

impl Index {
    pub fn new(nodes: usize) -> Self {
        Self {
            shards: (0..1 << SHARD_BITS).map(|_| Mutex::new(Rank::RemoteIndex, Shard::default())).collect(),
            total: Usage::default(),
            lost: AtomicU64::new(0),
            per_node: (0..nodes).map(|_| Usage::default()).collect(),
            next_gen: AtomicU64::new(1),
        }
    }

    /// A fresh generation number.
    pub fn next_gen(&self) -> u64 {
        self.next_gen.fetch_add(1, Ordering::Relaxed)
    }

    fn shard_of(k: TierKey) -> usize {
        usize::try_from(key_hash(k) >> (64 - SHARD_BITS)).unwrap_or(0)
    }

    /// Locks the shard holding `k`.
    pub fn shard(&self, k: TierKey) -> MutexGuard<'_, Shard> {
        self.shards[Self::shard_of(k)].lock()
    }

    /// All shards, one at a time.
    pub fn shards(&self) -> impl Iterator<Item = MutexGuard<'_, Shard>> {
        self.shards.iter().map(Mutex::lock)
    }

    /// The entry of `k`.
    pub fn get(&self, k: TierKey) -> Option<Entry> {
        self.shard(k).get(&k).copied()
    }

    /// Keeps the counters in step with replacing `old` by `new` (call with the shard locked).
    pub fn account(&self, old: Option<&Entry>, new: Option<&Entry>) {
        if let Some(o) = old {
            self.each_node(o, Usage::sub);
            if o.nodes == 0 {
                self.lost.fetch_sub(1, Ordering::Relaxed);
            } else {
                self.total.sub(o.len);
            }
        }
        if let Some(n) = new {
            self.each_node(n, Usage::add);
            if n.nodes == 0 {
                self.lost.fetch_add(1, Ordering::Relaxed);
            } else {
                self.total.add(n.len);
            }
        }
    }

    fn each_node(&self, e: &Entry, f: fn(&Usage, u32)) {
        for (n, u) in self.per_node.iter().enumerate() {
            if e.nodes & bit(n) != 0 {
                f(u, e.len);
            }
        }
    }

    /// Replaces the entry of `k` in a locked shard, keeping counters; returns the old one.
    pub fn put_locked(&self, shard: &mut Shard, k: TierKey, e: Entry) -> Option<Entry> {
        let old = shard.insert(k, e);
        self.account(old.as_ref(), Some(&e));
        old
    }

    /// Removes the entry of `k` from a locked shard, keeping counters.
    pub fn remove_locked(&self, shard: &mut Shard, k: TierKey) -> Option<Entry> {
        let old = shard.remove(&k);
        self.account(old.as_ref(), None);
        old
    }

    /// Changes the node set of `k`'s entry in a locked shard, keeping counters.
    pub fn set_nodes_locked(&self, shard: &mut Shard, k: TierKey, nodes: u64) {
        if let Some(e) = shard.get_mut(&k) {
            let old = *e;
            e.nodes = nodes;
            let new = *e;
            self.account(Some(&old), Some(&new));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_follow_the_entries() {
        let ix = Index::new(3);
        let k = TierKey { pool: 1, object: 2, index: 3 };
        {
            let mut s = ix.shard(k);
            ix.put_locked(&mut s, k, Entry { nodes: 0b011, len: 100, gen: ix.next_gen() });
        }
        assert_eq!(ix.total.pages.load(Ordering::Relaxed), 1);
        assert_eq!(ix.per_node[1].bytes.load(Ordering::Relaxed), 100);
        {
            let mut s = ix.shard(k);
            ix.set_nodes_locked(&mut s, k, 0);
        }
        assert_eq!(ix.total.pages.load(Ordering::Relaxed), 0);
        assert_eq!(ix.lost.load(Ordering::Relaxed), 1);
        assert_eq!(ix.per_node[0].pages.load(Ordering::Relaxed), 0);
        {
            let mut s = ix.shard(k);
            assert!(ix.remove_locked(&mut s, k).is_some());
        }
        assert_eq!(ix.lost.load(Ordering::Relaxed), 0);
    }
}
