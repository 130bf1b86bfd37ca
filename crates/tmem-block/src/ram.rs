//! [`RamDevice`]: pages kept as they are, in plain RAM.

use std::sync::atomic::{AtomicU64, Ordering};
use tmem_lock::{Mutex, Rank};

use tmem_core::PAGE_SIZE;

use crate::{check_range, BlockDevice, BlockError, Extent, PAGE};

/// One page slot: `None` is a hole (reads as zeros, holds no memory).
type Slot = Mutex<Option<Box<[u8; PAGE_SIZE]>>>;

/// Plain RAM: no compression, no store, no tiers. Each written page is kept
/// as is; trims and zeroed whole pages free it. A baseline that shows what a
/// frontend (FUSE + loop, NBD) costs on its own: `tmem bench pressure
/// --backends fuse-ram` swaps to it over the same path as tmem.
pub struct RamDevice {
    size: u64,
    pages: Box<[Slot]>,
    /// Pages holding memory.
    held: AtomicU64,
}

impl std::fmt::Debug for RamDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RamDevice").field("size", &self.size).field("held_pages", &self.held_pages()).finish()
    }
}

impl RamDevice {
    /// An empty device of `size` bytes (rounded down to whole pages). Memory
    /// is taken as pages are written: 16 bytes per page up front.
    pub fn new(size: u64) -> Self {
        let n = usize::try_from(size / PAGE).unwrap_or(usize::MAX);
        Self {
            size: size / PAGE * PAGE,
            pages: (0..n).map(|_| Mutex::new(Rank::RamSlot, None)).collect(),
            held: AtomicU64::new(0),
        }
    }

    /// Pages that hold data.
    pub fn held_pages(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    /// Bytes of page data held (the index of 16 bytes per page not included).
    pub fn held_bytes(&self) -> u64 {
        self.held_pages() * PAGE
    }

    /// Calls `f(slot, start, end)` for each page that `[offset, offset+len)`
    /// touches, with the byte range inside that page.
    fn for_pages(&self, offset: u64, len: u64, mut f: impl FnMut(&Slot, usize, usize)) {
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            let page = pos / PAGE;
            let in_page = usize::try_from(pos % PAGE).unwrap_or(0);
            let n = usize::try_from((PAGE - pos % PAGE).min(end - pos)).unwrap_or(0);
            if let Some(slot) = usize::try_from(page).ok().and_then(|p| self.pages.get(p)) {
                f(slot, in_page, in_page + n);
            }
            pos += n as u64;
        }
    }

    /// Zeroes a range; whole pages become holes.
    fn clear(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        check_range(offset, len, self.size)?;
        self.for_pages(offset, len, |slot, a, b| {
            let mut p = slot.lock();
            if a == 0 && b == PAGE_SIZE {
                if p.take().is_some() {
                    self.held.fetch_sub(1, Ordering::Relaxed);
                }
            } else if let Some(page) = p.as_mut() {
                page[a..b].fill(0);
            }
        });
        Ok(())
    }
}

impl BlockDevice for RamDevice {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        check_range(offset, buf.len() as u64, self.size)?;
        let mut at = 0;
        self.for_pages(offset, buf.len() as u64, |slot, a, b| {
            let dst = &mut buf[at..at + (b - a)];
            match slot.lock().as_ref() {
                Some(page) => dst.copy_from_slice(&page[a..b]),
                None => dst.fill(0),
            }
            at += b - a;
        });
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        check_range(offset, buf.len() as u64, self.size)?;
        let mut at = 0;
        self.for_pages(offset, buf.len() as u64, |slot, a, b| {
            let mut p = slot.lock();
            let page = p.get_or_insert_with(|| {
                self.held.fetch_add(1, Ordering::Relaxed);
                Box::new([0; PAGE_SIZE])
            });
            page[a..b].copy_from_slice(&buf[at..at + (b - a)]);
            at += b - a;
        });
        Ok(())
    }

    fn flush(&self) -> Result<(), BlockError> {
        Ok(())
    }

    fn trim(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        self.clear(offset, len)
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        self.clear(offset, len)
    }

    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>, BlockError> {
        check_range(offset, len, self.size)?;
        let mut out: Vec<Extent> = Vec::new();
        self.for_pages(offset, len, |slot, a, b| {
            let hole = slot.lock().is_none();
            let n = (b - a) as u64;
            match out.last_mut() {
                Some(e) if e.hole == hole => e.len += n,
                _ => out.push(Extent { len: n, hole }),
            }
        });
        Ok(out)
    }
}
