//! How pools and stores are configured.

use super::*;

/// Kind of pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PoolKind {
    /// frontswap semantics: a stored page stays until flushed or taken.
    Persistent,
    /// cleancache semantics: the store may drop pages at any time, by the
    /// pool's [`Eviction`] policy, and does so before it refuses a
    /// persistent page.
    Ephemeral,
}

/// Which ephemeral page goes first when the store needs room.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Eviction {
    /// SIEVE: a hit sets a flag and moves nothing (no list update under
    /// the shard lock on a get); a hand sweeps from old to young.
    #[default]
    Sieve,
    /// Strict LRU: a hit moves the page to the young end. Kept to compare
    /// hit ratios with SIEVE (`tmem bench cache`).
    Lru,
}

impl std::str::FromStr for Eviction {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "sieve" => Ok(Self::Sieve),
            "lru" => Ok(Self::Lru),
            _ => Err(format!("eviction policy {s:?}: expected sieve or lru")),
        }
    }
}

impl Eviction {
    /// The policy's name, as `FromStr` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sieve => "sieve",
            Self::Lru => "lru",
        }
    }
}

/// How to create a pool.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PoolConfig {
    /// Persistent or ephemeral.
    pub kind: PoolKind,
    /// A successful get removes the page (frontswap's exclusive loads).
    pub exclusive_gets: bool,
    /// A refused put leaves an older copy of the key in place. Off for
    /// frontswap/cleancache, where the caller then stores the page elsewhere
    /// and a stale copy here would shadow it; on for a block device, which
    /// is the page's only home and must not lose the rest of a page on a
    /// failed partial write.
    #[serde(default)]
    pub reject_keeps_old: bool,
    /// Eviction policy of an ephemeral pool (persistent pools ignore it).
    #[serde(default)]
    pub eviction: Eviction,
}

impl PoolConfig {
    /// A persistent pool with shared (non-exclusive) gets.
    pub fn persistent() -> Self {
        Self { kind: PoolKind::Persistent, exclusive_gets: false, reject_keeps_old: false, eviction: Eviction::Sieve }
    }

    /// An ephemeral pool with shared gets.
    pub fn ephemeral() -> Self {
        Self { kind: PoolKind::Ephemeral, exclusive_gets: false, reject_keeps_old: false, eviction: Eviction::Sieve }
    }

    /// Sets exclusive gets.
    pub fn exclusive_gets(mut self, on: bool) -> Self {
        self.exclusive_gets = on;
        self
    }

    /// Sets the eviction policy (ephemeral pools).
    pub fn eviction(mut self, e: Eviction) -> Self {
        self.eviction = e;
        self
    }

    /// Sets whether a refused put keeps an older copy.
    pub fn reject_keeps_old(mut self, on: bool) -> Self {
        self.reject_keeps_old = on;
        self
    }
}

/// How to build a store.
#[derive(Clone, Debug, Default)]
pub struct StoreConfig {
    /// Policy knobs.
    pub policy: PolicyConfig,
    /// Codec for new puts; `None` means lz4.
    pub codec: Option<CodecConfig>,
    /// Shards per pool, rounded up to a power of two; 0 means [`default_shards`].
    pub shards: usize,
    /// Allocator tuning.
    pub alloc: AllocConfig,
    /// Train a dictionary for the codec from the pool's own pages once the
    /// pool is big enough (see [`DictTraining`]).
    pub dictionary: Option<DictTraining>,
    /// Group cold pages of adjacent indexes into blocks compressed together
    /// ([`Store::grouping`] runs it; `store/grouping.rs`). Fixed at build:
    /// it decides in which shard each key lives.
    pub group: Option<GroupConfig>,
    /// Keep each window of 16 indexes of an object in one shard (grouping
    /// always does), so that pages put together leave together: writeback
    /// takes a shard's oldest pages, and a tier below then holds
    /// neighbours side by side and returns a readahead's pages with one
    /// read. Fixed at build; a store adopted from an image keeps the
    /// image's layout.
    pub shard_windows: bool,
    /// Keep the pages in a memfd that a successor process can adopt without
    /// a copy ([`Store::export_image`]); private memory otherwise.
    pub shared_memory: bool,
}

impl StoreConfig {
    /// Builds the store.
    pub fn build(self) -> Result<Store, StoreError> {
        let alloc = if self.shared_memory {
            ZsAlloc::shared(self.alloc).map_err(|e| StoreError::Handover(format!("shared pool memory: {e}")))?
        } else {
            ZsAlloc::with_config(self.alloc)
        };
        self.build_with(alloc)
    }

    /// How many low bits of an index its shard ignores.
    pub(super) fn window_shift(&self) -> u32 {
        if self.group.is_some() || self.shard_windows {
            crate::group::WINDOW_SHIFT
        } else {
            0
        }
    }

    /// Builds the store around `alloc` (a new one, or one adopted from a
    /// predecessor).
    pub(super) fn build_with(self, alloc: ZsAlloc) -> Result<Store, StoreError> {
        let policy = Policy::new(&self.policy)?;
        if let Some(g) = &self.group {
            g.build()?;
        }
        let window_shift = self.window_shift();
        let shared = Arc::new(Shared {
            alloc,
            policy,
            codecs: std::array::from_fn(|_| OnceLock::new()),
            codec_configs: std::array::from_fn(|_| OnceLock::new()),
            codec_count: Mutex::new(Rank::CodecCount, 0),
            current_codec: AtomicU8::new(RAW_CODEC),
            reached_full: AtomicBool::new(false),
            index_meta: AtomicU64::new(0),
            codec_meta: AtomicU64::new(0),
            pools: RwLock::new(Rank::StorePools, Vec::new()),
            compaction: Mutex::new(Rank::StoreCompaction, ()),
            evict_cursor: AtomicUsize::new(0),
            next_version: AtomicU64::new(1),
            clock: std::time::Instant::now(),
            room_failed_at: AtomicU64::new(0),
            writeback_waits: AtomicU64::new(0),
            auto_dictionary: self
                .dictionary
                .map(|t| dictionary::AutoDictionary::new(self.codec.clone().unwrap_or(CodecConfig::LZ4), t))
                .map_or_else(std::sync::OnceLock::new, std::sync::OnceLock::from),
            recompress_status: Mutex::new(Rank::RecompressStatus, None),
            recompress_target: AtomicU8::new(shared::NO_RECOMPRESSION),
            recompress_stride: std::sync::atomic::AtomicU32::new(1),
            group: self.group,
            window_shift,
            group_codec: AtomicU8::new(grouping::NO_GROUP_CODEC),
            group_state: AtomicU8::new(grouping::GROUP_OFF),
        });
        let shards = if self.shards == 0 { default_shards() } else { self.shards.next_power_of_two() };
        let store = Store { shared, shards };
        store.register_codec(&CodecConfig::Raw)?;
        let id = store.register_codec(&self.codec.unwrap_or(CodecConfig::LZ4))?;
        store.set_codec(id)?;
        Ok(store)
    }
}
