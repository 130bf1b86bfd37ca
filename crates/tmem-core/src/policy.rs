//! Run-time knobs of a store. Every field is an atomic, so a knob changes
//! while puts and gets go on; defaults follow zswap.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use crate::PAGE_SIZE;

/// What to do with a page whose compressed size exceeds `max_compressed_size`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Incompressible {
    /// Refuse it (`reject_compress_poor`), so the caller writes it elsewhere (zswap).
    Reject,
    /// Keep it uncompressed in a full page (zram's huge pages).
    StoreRaw,
}

/// Plain-value view of the policy, for configuration and JSON.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct PolicyConfig {
    /// Hard limit on pool bytes; 0 means "use `max_pool_percent`".
    pub max_pool_bytes: u64,
    /// Limit as a percentage of `total_ram_bytes` (zswap `max_pool_percent`, default 20).
    pub max_pool_percent: u32,
    /// RAM the percentage refers to; the binary fills it from /proc/meminfo.
    pub total_ram_bytes: u64,
    /// After hitting the limit, refuse puts until usage is below this
    /// percentage of the limit (zswap `accept_threshold_percent`, default 90).
    pub accept_threshold_percent: u32,
    /// Largest compressed size kept compressed; larger is incompressible.
    pub max_compressed_size: u32,
    /// Policy for incompressible pages.
    pub incompressible: Incompressible,
    /// Refuse every put; gets and flushes go on (zcache_freeze).
    pub frozen: bool,
    /// Compact automatically once this percentage of span memory is free slots.
    pub compact_threshold_percent: u32,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            max_pool_bytes: 0,
            max_pool_percent: 20,
            total_ram_bytes: 0,
            accept_threshold_percent: 90,
            // zswap keeps anything that is smaller than a page at all.
            max_compressed_size: u32::try_from(PAGE_SIZE - 1).expect("page size fits u32"),
            incompressible: Incompressible::Reject,
            frozen: false,
            compact_threshold_percent: 25,
        }
    }
}

/// Errors from policy changes.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PolicyError {
    /// The knob does not exist.
    #[error("unknown policy key {0:?} (known: max_pool_bytes, max_pool_percent, accept_threshold_percent, max_compressed_size, incompressible, frozen, compact_threshold_percent)")]
    UnknownKey(String),
    /// The value does not parse or is out of range.
    #[error("bad value {value:?} for {key}: {reason}")]
    BadValue {
        /// Knob.
        key: String,
        /// Value given.
        value: String,
        /// Why.
        reason: String,
    },
}

/// The live policy of a store.
#[derive(Debug)]
pub struct Policy {
    max_pool_bytes: AtomicU64,
    max_pool_percent: AtomicU32,
    total_ram_bytes: AtomicU64,
    accept_threshold_percent: AtomicU32,
    max_compressed_size: AtomicU32,
    store_raw: AtomicBool,
    frozen: AtomicBool,
    compact_threshold_percent: AtomicU32,
}

impl Policy {
    /// Builds a live policy from a checked config.
    pub fn new(c: &PolicyConfig) -> Result<Self, PolicyError> {
        let p = Self {
            max_pool_bytes: AtomicU64::new(0),
            max_pool_percent: AtomicU32::new(0),
            total_ram_bytes: AtomicU64::new(0),
            accept_threshold_percent: AtomicU32::new(0),
            max_compressed_size: AtomicU32::new(0),
            store_raw: AtomicBool::new(false),
            frozen: AtomicBool::new(false),
            compact_threshold_percent: AtomicU32::new(0),
        };
        p.apply(c)?;
        Ok(p)
    }

    /// Replaces every knob after checking the whole config.
    pub fn apply(&self, c: &PolicyConfig) -> Result<(), PolicyError> {
        let bad = |key: &str, value: String, reason: &str| PolicyError::BadValue {
            key: key.into(),
            value,
            reason: reason.into(),
        };
        if c.max_pool_percent > 100 {
            return Err(bad("max_pool_percent", c.max_pool_percent.to_string(), "must be 0..=100"));
        }
        if c.accept_threshold_percent > 100 {
            return Err(bad("accept_threshold_percent", c.accept_threshold_percent.to_string(), "must be 0..=100"));
        }
        if c.max_compressed_size == 0 || c.max_compressed_size as usize > PAGE_SIZE {
            return Err(bad("max_compressed_size", c.max_compressed_size.to_string(), "must be 1..=4096"));
        }
        if c.compact_threshold_percent > 100 {
            return Err(bad(
                "compact_threshold_percent",
                c.compact_threshold_percent.to_string(),
                "must be 0..=100 (100 disables)",
            ));
        }
        let r = Ordering::Relaxed;
        self.max_pool_bytes.store(c.max_pool_bytes, r);
        self.max_pool_percent.store(c.max_pool_percent, r);
        self.total_ram_bytes.store(c.total_ram_bytes, r);
        self.accept_threshold_percent.store(c.accept_threshold_percent, r);
        self.max_compressed_size.store(c.max_compressed_size, r);
        self.store_raw.store(c.incompressible == Incompressible::StoreRaw, r);
        self.frozen.store(c.frozen, r);
        self.compact_threshold_percent.store(c.compact_threshold_percent, r);
        Ok(())
    }

    /// Current values.
    pub fn config(&self) -> PolicyConfig {
        let r = Ordering::Relaxed;
        PolicyConfig {
            max_pool_bytes: self.max_pool_bytes.load(r),
            max_pool_percent: self.max_pool_percent.load(r),
            total_ram_bytes: self.total_ram_bytes.load(r),
            accept_threshold_percent: self.accept_threshold_percent.load(r),
            max_compressed_size: self.max_compressed_size.load(r),
            incompressible: if self.store_raw.load(r) { Incompressible::StoreRaw } else { Incompressible::Reject },
            frozen: self.frozen.load(r),
            compact_threshold_percent: self.compact_threshold_percent.load(r),
        }
    }

    /// Sets one knob from text, as `tmem set` does: `key=value`.
    pub fn set(&self, key: &str, value: &str) -> Result<(), PolicyError> {
        let mut c = self.config();
        let bad = |reason: &str| PolicyError::BadValue { key: key.into(), value: value.into(), reason: reason.into() };
        let num = || value.parse::<u64>().map_err(|_| bad("not a non-negative integer"));
        let num32 = || value.parse::<u32>().map_err(|_| bad("not a non-negative integer"));
        match key {
            "max_pool_bytes" => c.max_pool_bytes = num()?,
            "max_pool_percent" => c.max_pool_percent = num32()?,
            "total_ram_bytes" => c.total_ram_bytes = num()?,
            "accept_threshold_percent" => c.accept_threshold_percent = num32()?,
            "max_compressed_size" => c.max_compressed_size = num32()?,
            "compact_threshold_percent" => c.compact_threshold_percent = num32()?,
            "frozen" => c.frozen = parse_bool(value).ok_or_else(|| bad("expected true/false, 1/0, on/off"))?,
            "incompressible" => {
                c.incompressible = match value {
                    "reject" => Incompressible::Reject,
                    "store_raw" | "raw" => Incompressible::StoreRaw,
                    _ => return Err(bad("expected reject or store_raw")),
                }
            }
            _ => return Err(PolicyError::UnknownKey(key.into())),
        }
        self.apply(&c)
    }

    /// The pool limit in bytes now in force (`u64::MAX` when unlimited).
    pub fn limit_bytes(&self) -> u64 {
        let r = Ordering::Relaxed;
        let hard = self.max_pool_bytes.load(r);
        if hard != 0 {
            return hard;
        }
        let ram = self.total_ram_bytes.load(r);
        if ram == 0 {
            return u64::MAX;
        }
        ram / 100 * u64::from(self.max_pool_percent.load(r))
    }

    /// Usage below which a full store accepts puts again.
    pub fn accept_bytes(&self) -> u64 {
        let limit = self.limit_bytes();
        if limit == u64::MAX {
            return limit;
        }
        limit / 100 * u64::from(self.accept_threshold_percent.load(Ordering::Relaxed))
    }

    /// Largest compressed size that is stored compressed.
    pub fn max_compressed_size(&self) -> usize {
        self.max_compressed_size.load(Ordering::Relaxed) as usize
    }

    /// Whether incompressible pages are stored raw.
    pub fn store_raw(&self) -> bool {
        self.store_raw.load(Ordering::Relaxed)
    }

    /// Whether puts are refused.
    pub fn frozen(&self) -> bool {
        self.frozen.load(Ordering::Relaxed)
    }

    /// Fragmentation percentage that triggers compaction.
    pub fn compact_threshold_percent(&self) -> u64 {
        u64::from(self.compact_threshold_percent.load(Ordering::Relaxed))
    }
}

fn parse_bool(s: &str) -> Option<bool> {
    match s {
        "1" | "true" | "on" | "yes" | "Y" | "y" => Some(true),
        "0" | "false" | "off" | "no" | "N" | "n" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_zswap_and_limits_compute() {
        let p = Policy::new(&PolicyConfig { total_ram_bytes: 1000 * 100, ..Default::default() }).unwrap();
        assert_eq!(p.limit_bytes(), 20_000);
        assert_eq!(p.accept_bytes(), 18_000);
        p.set("max_pool_bytes", "5000").unwrap();
        assert_eq!(p.limit_bytes(), 5000);
        assert_eq!(p.accept_bytes(), 4500);
        p.set("frozen", "on").unwrap();
        assert!(p.frozen());
        p.set("incompressible", "store_raw").unwrap();
        assert!(p.store_raw());
    }

    #[test]
    fn bad_values_are_refused_and_leave_policy_unchanged() {
        let p = Policy::new(&PolicyConfig::default()).unwrap();
        assert!(matches!(p.set("max_pool_percent", "101"), Err(PolicyError::BadValue { .. })));
        assert!(matches!(p.set("max_compressed_size", "0"), Err(PolicyError::BadValue { .. })));
        assert!(matches!(p.set("frozen", "maybe"), Err(PolicyError::BadValue { .. })));
        assert!(matches!(p.set("nope", "1"), Err(PolicyError::UnknownKey(_))));
        assert_eq!(p.config(), PolicyConfig::default());
        assert_eq!(p.limit_bytes(), u64::MAX, "no RAM size and no byte limit: unlimited");
    }
}
