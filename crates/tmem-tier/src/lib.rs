//! Tiers below the compressed pool: where pages go when the pool cannot keep
//! them (zswap writeback, compcache's backing device, RAMster's remote RAM).
//!
//! * [`Tier`] — the boundary every tier implements: put/get/remove of opaque
//!   values under a [`TierKey`], batch forms, capacity, health and counters.
//! * [`NoopTier`] — stores nothing; every put is `Full`.
//! * [`seal::Sealer`] — AEAD sealing of pages before they leave the process.
//!   Tiers only ever see sealed bytes.
//! * [`LatencyHistogram`] — p50/p99 of operation latencies for tier counters.
//! * [`conformance`] — the one test suite every tier passes.

pub mod conformance;
mod mem;
pub mod seal;

pub use mem::MemTier;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tmem_counters::counters;

/// Largest value a tier must accept: a raw page plus sealing overhead.
pub const MAX_VALUE: usize = 4096 + 64;

/// Address of a page in a tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct TierKey {
    /// Pool id (unique per store; tiers shared by several stores get one namespace each).
    pub pool: u32,
    /// tmem object.
    pub object: u64,
    /// Page index.
    pub index: u64,
}

/// Outcome of a put.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum TierPut {
    /// Stored; an older value under the key is replaced.
    Stored,
    /// The tier has no room (capacity, or a node that reports OOM): try the next tier.
    Full,
}

/// Outcome of a get.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum TierGet {
    /// The value was copied out.
    Hit,
    /// Nothing under this key.
    Miss,
}

/// Tier failures: the tier could not do what was asked. Distinct from
/// `Full`/`Miss`, which are normal outcomes.
#[derive(Debug, thiserror::Error)]
pub enum TierError {
    /// The backing store is unreachable (all replicas of a key down, file gone).
    #[error("{tier}: unavailable: {reason}")]
    Unavailable {
        /// Tier name.
        tier: String,
        /// Why.
        reason: String,
    },
    /// An I/O error.
    #[error("{tier}: I/O error: {source}")]
    Io {
        /// Tier name.
        tier: String,
        /// Cause.
        source: std::io::Error,
    },
    /// A value larger than [`MAX_VALUE`].
    #[error("value of {len} bytes exceeds the {MAX_VALUE}-byte maximum")]
    TooLarge {
        /// Length given.
        len: usize,
    },
    /// Bad configuration (refused at connect/open time).
    #[error("{tier}: {reason}")]
    Config {
        /// Tier name.
        tier: String,
        /// Why.
        reason: String,
    },
    /// Stored data failed authentication or is malformed.
    #[error("{tier}: corrupt value for {key:?}: {reason}")]
    Corrupt {
        /// Tier name.
        tier: String,
        /// Key.
        key: TierKey,
        /// What failed.
        reason: String,
    },
}

/// How full a tier is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Capacity {
    /// Values held.
    pub stored_pages: u64,
    /// Bytes those values use in the tier (including its own overhead where known).
    pub used_bytes: u64,
    /// Limit, when the tier has one.
    pub limit_bytes: Option<u64>,
}

/// Whether a tier can serve.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case", tag = "state", content = "reason")]
pub enum Health {
    /// Everything works.
    Healthy,
    /// Serving, but with reduced redundancy or capacity.
    Degraded(String),
    /// Not serving.
    Down(String),
}

impl fmt::Display for Health {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Healthy => f.write_str("healthy"),
            Self::Degraded(why) => write!(f, "degraded: {why}"),
            Self::Down(why) => write!(f, "down: {why}"),
        }
    }
}

counters! {
    /// Counters every tier keeps.
    #[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
    pub struct TierStats {
        extra {
            /// Tier name.
            pub name: String,
            /// `healthy`, `degraded: why` or `down: why` (filled in by the store's chain).
            #[serde(default, skip_serializing_if = "String::is_empty")]
            pub health: String,
        }
        /// Values held.
        stored_pages: Gauge(Pages),
        /// Bytes of values held.
        stored_bytes: Gauge(Bytes),
        /// Puts that stored.
        writes: Counter(Events),
        /// Puts answered `Full`.
        full: Counter(Events),
        /// Gets (hits and misses).
        reads: Counter(Events),
        /// Gets that missed.
        misses: Counter(Events),
        /// Removes.
        removes: Counter(Events),
        /// Operations that failed with an error.
        failures: Counter(Events),
        /// Value bytes written.
        bytes_written: Counter(Bytes),
        /// Value bytes read.
        bytes_read: Counter(Bytes),
        /// Bytes sent to the backing store, protocol overhead included (0 when not known).
        wire_bytes_out: Counter(Bytes),
        /// Bytes received from the backing store, protocol overhead included.
        wire_bytes_in: Counter(Bytes),
        /// Read requests made to the backing store (a `pread`, an `MGET` to
        /// one server); a batched get whose values lie together makes one.
        /// 0 when not known.
        backing_reads: Counter(Events),
        /// Get latency, microseconds.
        get_p50_us: Max(Micros),
        /// Get latency, microseconds.
        get_p99_us: Max(Micros),
        /// Put latency, microseconds.
        put_p50_us: Max(Micros),
        /// Put latency, microseconds.
        put_p99_us: Max(Micros),
    }
}

/// The boundary of a tier. Values are opaque (sealed pages); keys are tmem
/// keys. Implementations are thread-safe.
pub trait Tier: Send + Sync {
    /// Short name for counters and errors, e.g. `disk`, `remote`.
    fn name(&self) -> &str;

    /// Stores `value` under `key`, replacing an older value.
    fn put(&self, key: TierKey, value: &[u8]) -> Result<TierPut, TierError>;

    /// Copies the value under `key` into `out` (cleared first).
    fn get(&self, key: TierKey, out: &mut Vec<u8>) -> Result<TierGet, TierError>;

    /// Removes the value under `key`; returns whether there was one.
    fn remove(&self, key: TierKey) -> Result<bool, TierError>;

    /// Batch put; one result per item, in order.
    fn put_batch(&self, items: &[(TierKey, &[u8])]) -> Vec<Result<TierPut, TierError>> {
        items.iter().map(|(k, v)| self.put(*k, v)).collect()
    }

    /// Batch get; `None` for a miss.
    fn get_batch(&self, keys: &[TierKey]) -> Vec<Result<Option<Vec<u8>>, TierError>> {
        keys.iter()
            .map(|k| {
                let mut v = Vec::new();
                Ok(match self.get(*k, &mut v)? {
                    TierGet::Hit => Some(v),
                    TierGet::Miss => None,
                })
            })
            .collect()
    }

    /// Batch remove.
    fn remove_batch(&self, keys: &[TierKey]) -> Vec<Result<bool, TierError>> {
        keys.iter().map(|k| self.remove(*k)).collect()
    }

    /// Removes every value of `pool`.
    fn clear_pool(&self, pool: u32) -> Result<(), TierError>;

    /// How full the tier is.
    fn capacity(&self) -> Capacity;

    /// Whether it can serve.
    fn health(&self) -> Health;

    /// Counters.
    fn stats(&self) -> TierStats;

    /// Describes this tier for a successor process that takes it over
    /// (`tmem swap restart`): everything it needs to serve every value held
    /// now, and the descriptors that state refers to. Writes in flight are
    /// finished first, none is dropped. The caller keeps puts and removes
    /// out from the call until it exits, or, when the hand-over failed,
    /// goes on using this tier, which is unchanged. Tiers that cannot be
    /// handed over answer [`TierError::Config`] (the default).
    fn hand_over(&self) -> Result<TierHandover, TierError> {
        Err(TierError::Config { tier: self.name().into(), reason: "this tier cannot be handed over".into() })
    }

    /// Whether dropping this tier deletes what it holds (a disk tier's
    /// file, a remote tier's keys). True for a tier that was built; false
    /// for one adopted from a predecessor, until the successor serves: a
    /// successor that fails must leave the predecessor's values alone.
    fn set_owner(&self, _owner: bool) {}
}

/// A tier's part of a restart ([`Tier::hand_over`]): its state in the
/// tier's own format (read back by that tier's `adopt`), and the
/// descriptors the state refers to, in order.
#[derive(Debug, Default)]
pub struct TierHandover {
    /// The tier's kind ([`Tier::name`]), checked by the adopting side.
    pub kind: String,
    /// The state, with a checksum of the tier's choosing.
    pub state: Vec<u8>,
    /// Descriptors (a disk tier's file).
    pub fds: Vec<std::os::fd::OwnedFd>,
}

/// Stores nothing: every put is `Full`, every get a miss.
#[derive(Debug, Default)]
pub struct NoopTier;

impl Tier for NoopTier {
    fn name(&self) -> &str {
        "noop"
    }
    fn put(&self, _key: TierKey, value: &[u8]) -> Result<TierPut, TierError> {
        check_len(value)?;
        Ok(TierPut::Full)
    }
    fn get(&self, _key: TierKey, out: &mut Vec<u8>) -> Result<TierGet, TierError> {
        out.clear();
        Ok(TierGet::Miss)
    }
    fn remove(&self, _key: TierKey) -> Result<bool, TierError> {
        Ok(false)
    }
    fn clear_pool(&self, _pool: u32) -> Result<(), TierError> {
        Ok(())
    }
    fn capacity(&self) -> Capacity {
        Capacity { limit_bytes: Some(0), ..Default::default() }
    }
    fn health(&self) -> Health {
        Health::Healthy
    }
    fn stats(&self) -> TierStats {
        TierStats { name: "noop".into(), ..Default::default() }
    }
}

/// Refuses values over [`MAX_VALUE`].
pub fn check_len(value: &[u8]) -> Result<(), TierError> {
    if value.len() > MAX_VALUE {
        return Err(TierError::TooLarge { len: value.len() });
    }
    Ok(())
}

const BUCKETS: usize = 40;

/// Log-scale latency histogram (buckets of powers of √2 microseconds),
/// lock-free, for p50/p99 estimates.
#[derive(Debug)]
pub struct LatencyHistogram {
    buckets: [AtomicU64; BUCKETS],
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        Self { buckets: std::array::from_fn(|_| AtomicU64::new(0)) }
    }
}

fn bucket_of(us: u64) -> usize {
    // Half-powers of two: bucket b covers [2^(b/2), 2^((b+1)/2)) µs, roughly.
    let us = us.max(1);
    let log2x2 = 2 * (63 - us.leading_zeros()) + u32::from(us >= (3 << (63 - us.leading_zeros())) >> 1);
    (log2x2 as usize).min(BUCKETS - 1)
}

fn bucket_upper_us(b: usize) -> u64 {
    let whole = 1u64 << (b / 2);
    if b.is_multiple_of(2) {
        whole + whole / 2
    } else {
        2 * whole
    }
}

impl LatencyHistogram {
    /// Records one operation.
    pub fn record(&self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        self.buckets[bucket_of(us)].fetch_add(1, Ordering::Relaxed);
    }

    /// Upper bound of the bucket holding quantile `q` (0..=1), in µs; 0 when empty.
    pub fn quantile_us(&self, q: f64) -> u64 {
        let counts: Vec<u64> = self.buckets.iter().map(|b| b.load(Ordering::Relaxed)).collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return 0;
        }
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // 0 <= q*total <= total
        let rank = ((q.clamp(0.0, 1.0) * total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (b, c) in counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return bucket_upper_us(b);
            }
        }
        bucket_upper_us(BUCKETS - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_tier_is_handed_over() {
        let tier = MemTier::new(1 << 20);
        conformance::check_hand_over(&tier, &|h| Box::new(MemTier::adopt(&h).unwrap()));
        let bad = TierHandover { kind: "mem".into(), state: vec![1, 2, 3], fds: Vec::new() };
        assert!(MemTier::adopt(&bad).is_err());
    }

    #[test]
    fn mem_tier_passes_the_suite() {
        conformance::check(&MemTier::new(1 << 30), conformance::Expect::Stores);
    }

    #[test]
    fn mem_tier_fills_up() {
        let t = MemTier::new(6_000);
        let k = |i| TierKey { pool: 0, object: 0, index: i };
        assert_eq!(t.put(k(1), &[0; 4000]).unwrap(), TierPut::Stored);
        assert_eq!(t.put(k(2), &[0; 4000]).unwrap(), TierPut::Full);
        assert_eq!(t.put(k(1), &[0; 2000]).unwrap(), TierPut::Stored, "replacing frees the old value");
        assert_eq!(t.put(k(2), &[0; 4000]).unwrap(), TierPut::Stored);
    }

    #[test]
    fn noop_tier_passes_the_suite() {
        conformance::check(&NoopTier, conformance::Expect::StoresNothing);
    }

    #[test]
    fn histogram_quantiles() {
        let h = LatencyHistogram::default();
        assert_eq!(h.quantile_us(0.5), 0);
        for _ in 0..98 {
            h.record(Duration::from_micros(10));
        }
        h.record(Duration::from_micros(1000));
        h.record(Duration::from_millis(50));
        let p50 = h.quantile_us(0.5);
        assert!((10..=16).contains(&p50), "{p50}");
        let p99 = h.quantile_us(0.99);
        assert!((1000..=1536).contains(&p99), "{p99}");
        assert!(h.quantile_us(1.0) >= 50_000);
    }

    #[test]
    fn buckets_are_monotonic() {
        let mut prev = 0;
        for us in 1..100_000u64 {
            let b = bucket_of(us);
            assert!(b >= prev);
            assert!(bucket_upper_us(b) >= us, "{us} in bucket {b} with upper {}", bucket_upper_us(b));
            prev = b;
        }
    }
}
