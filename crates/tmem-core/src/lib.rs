//! tmem-core: the transcendent-memory page store.
//!
//! Pages of [`PAGE_SIZE`] bytes are stored under keys `(pool, object, index)`
//! as in Xen/Linux tmem. Pools are persistent (frontswap: a put is stored or
//! refused with a reason; a stored page stays until flushed) or ephemeral
//! (cleancache: pages may be dropped, oldest first). Pages are compressed by a
//! run-time switchable [`codec::Codec`], kept in a zsmalloc-style allocator
//! ([`alloc::ZsAlloc`]) and governed by zswap-style policies
//! ([`policy::Policy`]) with one counter per outcome ([`stats`]).
//!
//! The crate does no I/O; the only system calls are `mmap`/`madvise` for
//! pool memory.

pub mod alloc;
pub mod codec;
mod dirty;
pub mod group;
pub mod lz4;
pub mod mem;
pub mod policy;
mod shard;
pub mod stats;
mod store;

pub use codec::{CodecConfig, CodecError};
pub use policy::{Incompressible, PolicyConfig, PolicyError};
pub use stats::{CodecUsage, PoolStats, Stats};
pub use store::{
    default_shards, DictTraining, DictionaryCodec, Eviction, GetOutcome, GroupConfig, Grouper, Grouping,
    HandoverSummary, ImportTiers, Pool, PoolConfig, PoolKind, PutOutcome, RecompressConfig, Recompression,
    Recompressor, Reject, Retraining, Snapshot, Store, StoreConfig, StoreError, TierChain, TierHold, TrainedDictionary,
    WritebackReport, WritebackWorker, HANDOVER_VERSION, MAX_DICTIONARIES, MAX_STRIDE, MIN_TRAINING_PAGES, RAW_CODEC,
    RETRAIN_GROWTH, TRAINING_TRIES,
};

/// Size of a page, the unit of every put and get.
pub const PAGE_SIZE: usize = 4096;

/// Pool identifier, unique for the life of a store.
pub type PoolId = u32;

/// Address of a page within a pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct Key {
    /// Object (a swap area, a file...).
    pub object: u64,
    /// Page index within the object.
    pub index: u64,
}

impl Key {
    /// Builds a key.
    pub fn new(object: u64, index: u64) -> Self {
        Self { object, index }
    }
}
