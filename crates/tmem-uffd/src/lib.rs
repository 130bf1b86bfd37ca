//! tmem's userfaultfd frontend: `tmem run --memory SIZE -- PROGRAM` keeps at
//! most SIZE of PROGRAM's anonymous memory resident and the rest compressed
//! in a tmem store, with no root, no swap and no cgroup.
//!
//! - [`sys`]: the userfaultfd (made in full mode only) and its ioctls.
//! - [`proto`]: what the agent preloaded into the program and the helper say.
//! - [`engine`]: where each page of one process is; the fault and eviction
//!   steps, tested against a model of memory.
//! - [`readahead`]: how many stored pages to map ahead of a fault.
//! - [`maps`]: the process's private anonymous ranges and present pages.
//! - [`stats`]: the counters of a run, defined once.
//! - `manager` (feature `manager`): the helper's threads over a store.
//!
//! The agent itself is the `tmem-run-agent` cdylib.

pub mod engine;
pub mod maps;
pub mod proto;
pub mod readahead;
pub mod stats;
pub mod sys;

#[cfg(feature = "manager")]
pub mod manager;
