//! zram in front: a zram device of tmem's own whose backing device is
//! tmem's device; the kernel swaps on the zram device alone.
//!
//! zram keeps every page compressed and answers its faults in the kernel;
//! `writeback` moves idle pages to the backing device, one page a bio, and
//! a fault on such a page reads it back from there (`bd_stat` counts
//! both). zram frees a page's memory the moment the kernel frees its swap
//! slot; a written-back page's block on the backing device is only marked
//! free in zram's bitmap, and the lowest free block is taken first, so
//! tmem keeps at most the high-water mark of written-back blocks, and
//! stale ones are overwritten first.
//!
//! zram never tells the device below that a block is free, so tmem's pool
//! would keep the pages of an ended job's blocks. With tmem's store behind
//! it ([`Below`], [`ZramFront::with_below`]), the policy has the front
//! reclaim them ([`FrontOps::reclaim_below`]): under a `flock` on the
//! device below, which every writeback takes too (a hand-over runs two
//! policies), it reads through zram every slot debugfs `block_state`
//! flags written back, and tmem drops every page that was not read. No
//! block can become used meanwhile: only a writeback uses one.
//!
//! Idle marking: where the kernel tracks access times
//! (`CONFIG_ZRAM_TRACK_ENTRY_ACTIME`, Debian 13's 6.12), `echo SECS > idle`
//! marks the pages not accessed for that long, and writeback follows at
//! once. Elsewhere (Debian 12's 6.1) `echo all > idle` marks every page,
//! an access clears the mark, and the next writeback one age later takes
//! the pages still marked: the same age, in two steps.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tmem_sys::zram::ZramDevice;

use crate::policy::{FrontOps, Sample};
use crate::FrontError;

/// The zram device's settings.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ZramFrontConfig {
    /// Compression algorithm (`comp_algorithm`).
    pub algorithm: String,
    /// `disksize`: the swap area the kernel sees (tmem's device size).
    pub disksize: u64,
    /// `mem_limit`, bytes (0: none).
    pub mem_limit: u64,
}

/// Whether the kernel takes an age in `idle`.
const AGES_UNKNOWN: u8 = 0;
const AGES_YES: u8 = 1;
const AGES_NO: u8 = 2;
/// No `echo all > idle` made yet.
const NEVER: u64 = u64::MAX;

/// tmem's store on the device below the front.
pub trait Below: Send + Sync + std::fmt::Debug {
    /// Pages it holds.
    fn stored_pages(&self) -> u64;
    /// Drops every page but those read or written while `mark` runs;
    /// `mark` returns how many pages at least must be marked by then
    /// (`None`: it failed). Returns the pages dropped, `None` when it
    /// dropped nothing (`mark` failed, fewer pages were marked, or another
    /// sweep was running).
    fn keep_only_marked(&self, mark: &mut dyn FnMut() -> Option<u64>) -> Option<u64>;
}

/// tmem's zram device in front of its own device.
#[derive(Debug)]
pub struct ZramFront {
    dev: ZramDevice,
    backing: PathBuf,
    below: Option<Arc<dyn Below>>,
    /// Set once `block_state` turned out missing: reclaims are off (said once).
    no_block_state: AtomicBool,
    ages: AtomicU8,
    /// Milliseconds after `born` of the last `echo all > idle`.
    last_mark_ms: AtomicU64,
    born: Instant,
}

impl ZramFront {
    /// Hot-adds a zram device, makes `backing` (a block device: tmem's
    /// loop device) its backing device, and initialises it. The device is
    /// removed again if a step fails.
    pub fn create(cfg: &ZramFrontConfig, backing: &Path) -> Result<Self, FrontError> {
        let dev = ZramDevice::hot_add()?;
        if !dev.has_writeback() {
            return Err(FrontError::Unavailable {
                front: "zram",
                why: "this kernel's zram has no writeback (no backing_dev attribute)".into(),
            });
        }
        dev.set_backing_dev(backing)?;
        dev.initialise(&cfg.algorithm, cfg.disksize)?;
        if cfg.mem_limit > 0 {
            dev.set_mem_limit(cfg.mem_limit)?;
        }
        dev.set_writeback_limit(0)?;
        Ok(Self::of(dev, backing))
    }

    /// Takes over `zramN`, set up by a predecessor over `backing`.
    pub fn adopt(id: u32, backing: &Path) -> Result<Self, FrontError> {
        Ok(Self::of(ZramDevice::adopt(id)?, backing))
    }

    fn of(dev: ZramDevice, backing: &Path) -> Self {
        Self {
            dev,
            backing: backing.to_owned(),
            below: None,
            no_block_state: AtomicBool::new(false),
            ages: AtomicU8::new(AGES_UNKNOWN),
            last_mark_ms: AtomicU64::new(NEVER),
            born: Instant::now(),
        }
    }

    /// With tmem's store below, whose pages of freed blocks the policy
    /// reclaims.
    #[must_use]
    pub fn with_below(self, below: Arc<dyn Below>) -> Self {
        Self { below: Some(below), ..self }
    }

    /// `/dev/zramN`.
    #[must_use]
    pub fn node(&self) -> PathBuf {
        self.dev.node()
    }

    /// N of `zramN`.
    #[must_use]
    pub fn id(&self) -> u32 {
        self.dev.id()
    }

    /// Its backing device.
    #[must_use]
    pub fn backing(&self) -> &Path {
        &self.backing
    }

    /// Gives the device up without removing it (a hand-over); returns its id.
    #[must_use]
    pub fn release(self) -> u32 {
        self.dev.release()
    }

    /// Removes the device (it must no longer be swap): its pages, and the
    /// hold on the backing device, go.
    pub fn remove(self) -> Result<(), FrontError> {
        Ok(self.dev.remove()?)
    }

    /// Opens the device below (zram holds it exclusively, which a plain
    /// open does not need) and takes an exclusive `flock` on it, which
    /// every writeback and reclaim of any process's policy over this
    /// device holds: a hand-over has two.
    fn lock_below(&self) -> Result<std::fs::File, FrontError> {
        let err = |source| FrontError::Below { dev: self.backing.clone(), source };
        let f = std::fs::File::open(&self.backing).map_err(err)?;
        tmem_sys::blockio::lock_exclusive_wait(&f).map_err(err)?;
        Ok(f)
    }

    fn since_born_ms(&self) -> u64 {
        u64::try_from(self.born.elapsed().as_millis()).unwrap_or(u64::MAX - 1)
    }
}

impl FrontOps for ZramFront {
    fn sample(&self) -> Result<Sample, FrontError> {
        let mm = self.dev.mm_stat()?;
        let bd = self.dev.bd_stat()?;
        Ok(Sample {
            pool_bytes: mm.mem_used_total,
            stored_bytes: mm.orig_data_size,
            written: bd.writes,
            read_back: bd.reads,
            front_reads: self.dev.reads().map(|r| r.pages()),
            below_pages: Some(bd.count),
            below_stored: self.below.as_ref().map(|b| b.stored_pages()),
        })
    }

    fn write_back_idle(&self, age: Duration, max_pages: u64) -> Result<u64, FrontError> {
        let _below = self.lock_below()?;
        if self.ages.load(Ordering::Relaxed) != AGES_NO {
            match self.dev.mark_idle(Some(age.as_secs().max(1)))? {
                true => {
                    self.ages.store(AGES_YES, Ordering::Relaxed);
                    self.dev.set_writeback_limit(max_pages)?;
                    self.dev.writeback("idle")?;
                    return Ok(1);
                }
                false => self.ages.store(AGES_NO, Ordering::Relaxed),
            }
        }
        let now = self.since_born_ms();
        let last = self.last_mark_ms.load(Ordering::Relaxed);
        let age_ms = u64::try_from(age.as_millis()).unwrap_or(u64::MAX);
        if last != NEVER && now.saturating_sub(last) < age_ms {
            return Ok(0);
        }
        if last != NEVER {
            // Marked one age ago: what is still marked was not accessed since.
            self.dev.set_writeback_limit(max_pages)?;
            self.dev.writeback("idle")?;
        }
        self.dev.mark_idle(None)?;
        self.last_mark_ms.store(now, Ordering::Relaxed);
        Ok(1)
    }

    fn allow_writeback(&self, _on: bool) -> Result<(), FrontError> {
        // zram writes back only when told.
        Ok(())
    }

    fn reclaim_below(&self) -> Result<Option<u64>, FrontError> {
        let Some(below) = &self.below else { return Ok(None) };
        if self.no_block_state.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let _below = self.lock_below()?;
        let slots = match self.dev.written_back_slots() {
            Err(e @ tmem_sys::zram::ZramError::Unavailable(_)) => {
                self.no_block_state.store(true, Ordering::Relaxed);
                return Err(e.into());
            }
            other => other?,
        };
        // No block can be taken under the lock, only freed: a listing that
        // names fewer slots than zram counts below now is cut short, and
        // the sweep would drop live pages.
        let live = self.dev.bd_stat()?.count;
        if (slots.len() as u64) < live {
            return Err(FrontError::Reclaim { listed: slots.len() as u64, live });
        }
        let mut failed = None;
        // Every block still live after the reads was live throughout, so
        // listed and read: fewer marks than zram counts below then would
        // mean reads that missed the store.
        let mut mark = || match self.dev.read_slots(&slots).and_then(|()| self.dev.bd_stat()) {
            Ok(bd) => Some(bd.count),
            Err(e) => {
                failed = Some(e);
                None
            }
        };
        let dropped = below.keep_only_marked(&mut mark);
        match failed {
            Some(e) => Err(e.into()),
            None => Ok(dropped),
        }
    }
}
