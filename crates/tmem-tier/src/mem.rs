//! An in-memory tier with a byte limit: for tests of the tier chain, and a
//! reference implementation of the trait.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;
use tmem_lock::{Mutex, MutexGuard, Rank};

use crate::{
    check_len, Capacity, Health, LatencyHistogram, Tier, TierError, TierGet, TierHandover, TierKey, TierPut, TierStats,
};

/// Values in a `HashMap`, at most `limit` bytes of them.
#[derive(Debug)]
pub struct MemTier {
    limit: u64,
    map: Mutex<HashMap<TierKey, Vec<u8>>>,
    bytes: AtomicU64,
    writes: AtomicU64,
    full: AtomicU64,
    reads: AtomicU64,
    misses: AtomicU64,
    removes: AtomicU64,
    bytes_written: AtomicU64,
    bytes_read: AtomicU64,
    get_lat: LatencyHistogram,
    put_lat: LatencyHistogram,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

impl MemTier {
    /// A tier holding at most `limit` bytes of values.
    pub fn new(limit: u64) -> Self {
        Self {
            limit,
            map: Mutex::new(Rank::MemTier, HashMap::new()),
            bytes: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            full: AtomicU64::new(0),
            reads: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            removes: AtomicU64::new(0),
            bytes_written: AtomicU64::new(0),
            bytes_read: AtomicU64::new(0),
            get_lat: LatencyHistogram::default(),
            put_lat: LatencyHistogram::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<TierKey, Vec<u8>>> {
        self.map.lock()
    }

    /// Applies `f` to the stored value of `key` (tamper and replay tests).
    pub fn with_value<R>(&self, key: TierKey, f: impl FnOnce(&mut Vec<u8>) -> R) -> Option<R> {
        self.lock().get_mut(&key).map(f)
    }

    /// Keys held.
    pub fn keys(&self) -> Vec<TierKey> {
        self.lock().keys().copied().collect()
    }

    /// The successor of a [`MemTier`] that was handed over: its limit and
    /// values (the state of [`Tier::hand_over`], the reference format:
    /// limit, then per value pool, object, index, length and bytes, little
    /// endian). A state that does not parse is an error.
    pub fn adopt(h: &TierHandover) -> Result<Self, TierError> {
        let bad = |why: &str| TierError::Config { tier: "mem".into(), reason: format!("hand-over state: {why}") };
        if h.kind != "mem" {
            return Err(bad(&format!("a {} tier's state", h.kind)));
        }
        let mut rest = h.state.as_slice();
        let mut take = |n: usize| -> Result<&[u8], TierError> {
            if rest.len() < n {
                return Err(bad("truncated"));
            }
            let (head, tail) = rest.split_at(n);
            rest = tail;
            Ok(head)
        };
        let u64_of = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
        let tier = Self::new(u64_of(take(8)?));
        let n = u64_of(take(8)?);
        let mut map = tier.lock();
        let mut bytes = 0u64;
        for _ in 0..n {
            let pool = u32::from_le_bytes(take(4)?.try_into().expect("4 bytes"));
            let (object, index) = (u64_of(take(8)?), u64_of(take(8)?));
            let len = u32::from_le_bytes(take(4)?.try_into().expect("4 bytes")) as usize;
            if len > crate::MAX_VALUE {
                return Err(bad("a value over the largest"));
            }
            map.insert(TierKey { pool, object, index }, take(len)?.to_vec());
            bytes += len as u64;
        }
        if !rest.is_empty() || map.len() as u64 != n {
            return Err(bad("trailing bytes or repeated keys"));
        }
        drop(map);
        tier.bytes.store(bytes, Ordering::Relaxed);
        Ok(tier)
    }
}

impl Tier for MemTier {
    fn name(&self) -> &str {
        "mem"
    }

    fn put(&self, key: TierKey, value: &[u8]) -> Result<TierPut, TierError> {
        check_len(value)?;
        let t = Instant::now();
        let mut m = self.lock();
        let old = m.get(&key).map_or(0, |v| v.len() as u64);
        let used = self.bytes.load(Ordering::Relaxed);
        if used - old + value.len() as u64 > self.limit {
            bump(&self.full, 1);
            return Ok(TierPut::Full);
        }
        m.insert(key, value.to_vec());
        self.bytes.store(used - old + value.len() as u64, Ordering::Relaxed);
        bump(&self.writes, 1);
        bump(&self.bytes_written, value.len() as u64);
        self.put_lat.record(t.elapsed());
        Ok(TierPut::Stored)
    }

    fn get(&self, key: TierKey, out: &mut Vec<u8>) -> Result<TierGet, TierError> {
        let t = Instant::now();
        out.clear();
        bump(&self.reads, 1);
        let m = self.lock();
        let r = match m.get(&key) {
            Some(v) => {
                out.extend_from_slice(v);
                bump(&self.bytes_read, v.len() as u64);
                TierGet::Hit
            }
            None => {
                bump(&self.misses, 1);
                TierGet::Miss
            }
        };
        self.get_lat.record(t.elapsed());
        Ok(r)
    }

    fn remove(&self, key: TierKey) -> Result<bool, TierError> {
        bump(&self.removes, 1);
        Ok(match self.lock().remove(&key) {
            Some(v) => {
                self.bytes.fetch_sub(v.len() as u64, Ordering::Relaxed);
                true
            }
            None => false,
        })
    }

    fn clear_pool(&self, pool: u32) -> Result<(), TierError> {
        let mut m = self.lock();
        let gone: u64 = m.iter().filter(|(k, _)| k.pool == pool).map(|(_, v)| v.len() as u64).sum();
        m.retain(|k, _| k.pool != pool);
        self.bytes.fetch_sub(gone, Ordering::Relaxed);
        Ok(())
    }

    fn capacity(&self) -> Capacity {
        Capacity {
            stored_pages: self.lock().len() as u64,
            used_bytes: self.bytes.load(Ordering::Relaxed),
            limit_bytes: Some(self.limit),
        }
    }

    fn health(&self) -> Health {
        Health::Healthy
    }

    fn hand_over(&self) -> Result<TierHandover, TierError> {
        let m = self.lock();
        let values: usize = m.values().map(Vec::len).sum();
        let mut state = Vec::with_capacity(16 + m.len() * 24 + values);
        state.extend_from_slice(&self.limit.to_le_bytes());
        state.extend_from_slice(&(m.len() as u64).to_le_bytes());
        for (k, v) in m.iter() {
            state.extend_from_slice(&k.pool.to_le_bytes());
            state.extend_from_slice(&k.object.to_le_bytes());
            state.extend_from_slice(&k.index.to_le_bytes());
            state.extend_from_slice(&u32::try_from(v.len()).expect("a value is under a page").to_le_bytes());
            state.extend_from_slice(v);
        }
        Ok(TierHandover { kind: "mem".into(), state, fds: Vec::new() })
    }

    fn stats(&self) -> TierStats {
        let r = Ordering::Relaxed;
        TierStats {
            name: "mem".into(),
            health: String::new(),
            stored_pages: self.lock().len() as u64,
            stored_bytes: self.bytes.load(r),
            writes: self.writes.load(r),
            full: self.full.load(r),
            reads: self.reads.load(r),
            misses: self.misses.load(r),
            removes: self.removes.load(r),
            failures: 0,
            bytes_written: self.bytes_written.load(r),
            bytes_read: self.bytes_read.load(r),
            wire_bytes_out: 0,
            wire_bytes_in: 0,
            backing_reads: 0,
            get_p50_us: self.get_lat.quantile_us(0.5),
            get_p99_us: self.get_lat.quantile_us(0.99),
            put_p50_us: self.put_lat.quantile_us(0.5),
            put_p99_us: self.put_lat.quantile_us(0.99),
        }
    }
}
