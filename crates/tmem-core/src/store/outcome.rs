//! What a put or get answers, and the store's errors.

use super::*;

/// Why a put was refused. The page is not in the store afterwards, so the
/// caller must keep it elsewhere; an older copy under the same key is flushed
/// unless the pool was created with `reject_keeps_old`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reject {
    /// The store is at its limit (or refilling below the accept threshold).
    PoolLimit,
    /// Compressed size above `max_compressed_size` and policy says reject.
    CompressPoor,
    /// The compressor failed.
    CompressFail,
    /// No memory for the object.
    AllocFail,
    /// Puts are frozen.
    Frozen,
}

/// Result of a put.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum PutOutcome {
    /// The page is stored.
    Stored,
    /// The page was refused.
    Rejected(Reject),
}

/// Result of a get.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum GetOutcome {
    /// The page was copied into the output buffer.
    Hit,
    /// No page under this key.
    Miss,
}

/// Store errors: misuse or corruption, never normal outcomes.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No pool with this id.
    #[error("no pool {0}")]
    NoSuchPool(PoolId),
    /// The pool was destroyed.
    #[error("pool {0} was destroyed")]
    PoolDestroyed(PoolId),
    /// Stored data failed its checksum or did not decode. The page is still
    /// held (for inspection); its contents are lost.
    #[error("pool {pool} key {key:?}: stored page is corrupt: {reason}")]
    Corrupt {
        /// Pool.
        pool: PoolId,
        /// Key.
        key: Key,
        /// What failed.
        reason: String,
    },
    /// A lower tier could not return the page (node down, file error). The
    /// page is still recorded; a later get may succeed.
    #[error("pool {pool} key {key:?}: tier failed: {source}")]
    Tier {
        /// Pool.
        pool: PoolId,
        /// Key.
        key: Key,
        /// What the tier said.
        source: tmem_tier::TierError,
    },
    /// A tier chain was misconfigured.
    #[error("tier chain: {0}")]
    TierChain(String),
    /// Codec construction failed.
    #[error(transparent)]
    Codec(#[from] CodecError),
    /// Policy change refused.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// All codec ids are in use.
    #[error("at most {MAX_CODECS} codecs can be registered")]
    TooManyCodecs,
    /// No codec with this id.
    #[error("no codec {0}")]
    NoSuchCodec(u8),
    /// A hand-over export or import failed (what, and why).
    #[error("store hand-over: {0}")]
    Handover(String),
    /// Too few compressible pages in the pool to train a dictionary on.
    #[error("the pool holds {pages} compressible pages to train a dictionary on; it needs {need}")]
    TooFewPagesToTrain {
        /// Pages the sample found.
        pages: usize,
        /// Pages needed.
        need: usize,
    },
    /// Grouping of cold pages is misconfigured or not configured.
    #[error("grouping: {0}")]
    Group(String),
}
