//! Freed swap slots: giving back the memory of a finished job's pages.
//!
//! A loop device is not told when the kernel frees a swap slot, so a page
//! stays in the pool until its slot is written again or discarded; after a
//! job exits its pages would stay until swapoff. zram frees a slot's memory
//! the moment the kernel frees the slot.
//!
//! What a stock kernel does say is how many slots of each swap area are in
//! use (`/proc/swaps`, Used: the kernel's `inuse_pages`, which counts a slot
//! from its allocation, before its write is sent, until it is freed, swap
//! cache included). When it reads 0, every page the device holds belongs to
//! a freed slot. Once a tick the daemon reads each swap device's write
//! count, then /proc/swaps; if the area is empty and something was written
//! since the last sweep, [`PoolDevice::drop_stale`] drops every page unless a
//! write comes in meanwhile. This gives the memory back once nothing is in
//! swap, not while other pages still are: for that the kernel would have to
//! say which slots it freed (a BPF probe on the slot-free path, refused by
//! this test machine's locked-down kernel). After a job exits, the slots of
//! swap-cache pages that no process maps any more stay in use until memory
//! reclaim frees those pages (the kernel frees them at once only when swap
//! is over half full), so Used may stay at a few KiB for a long time on an
//! idle machine, and nothing is dropped meanwhile.

use std::path::Path;

use tmem_block::{PoolDevice, StaleSweep};
use tmem_sys::swap::SwapArea;

/// Per swap device: its write count at the end of the last full sweep.
#[derive(Debug, Default)]
pub struct StaleSlots {
    swept_at: Vec<Option<u64>>,
}

impl StaleSlots {
    /// Sweeps each device in `devices` (with its loop device, when it is a
    /// swap area now) whose swap area has no slot in use; returns a log
    /// line per sweep that dropped pages or was interrupted.
    pub fn check(&mut self, devices: &[(&PoolDevice, Option<&Path>)]) -> Vec<String> {
        self.check_with(devices, tmem_sys::swap::swaps)
    }

    /// [`check`](Self::check), reading the swap areas with `areas`.
    fn check_with<E>(
        &mut self,
        devices: &[(&PoolDevice, Option<&Path>)],
        areas: impl Fn() -> Result<Vec<SwapArea>, E>,
    ) -> Vec<String> {
        self.swept_at.resize(devices.len(), None);
        let mut lines = Vec::new();
        for (i, (dev, loop_dev)) in devices.iter().enumerate() {
            let Some(loop_dev) = loop_dev else { continue };
            let writes = dev.writes();
            if self.swept_at[i] == Some(writes) {
                continue;
            }
            // The write count is read before /proc/swaps: see drop_stale.
            let Ok(areas) = areas() else { continue };
            let Some(area) = areas.iter().find(|a| a.path == *loop_dev) else { continue };
            if area.used != 0 {
                continue;
            }
            let started = std::time::Instant::now();
            match dev.drop_stale(writes) {
                StaleSweep::Done(n) => {
                    self.swept_at[i] = Some(writes);
                    if n > 0 {
                        lines.push(format!(
                            "{}: no swap slot in use: dropped {n} pages of freed slots in {} ms",
                            dev.name(),
                            started.elapsed().as_millis()
                        ));
                    }
                }
                StaleSweep::Interrupted(n) => lines.push(format!(
                    "{}: no swap slot was in use, but a write came in: dropped {n} pages, the rest at a later tick",
                    dev.name()
                )),
            }
        }
        lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::path::PathBuf;
    use tmem_block::{BlockDevice, DeviceConfig};

    fn device() -> PoolDevice {
        DeviceConfig { name: "s0".into(), size: 1 << 20, store: Default::default(), tiers: None, recompress: None }
            .build()
            .unwrap()
    }

    fn area(used: u64) -> Vec<SwapArea> {
        vec![SwapArea { path: PathBuf::from("/dev/loop9"), size: 1 << 20, used, priority: 100 }]
    }

    #[test]
    fn sweeps_only_an_empty_swap_area_and_only_after_new_writes() {
        let dev = device();
        dev.write_at(&[7u8; 8192], 0).unwrap();
        let lo = PathBuf::from("/dev/loop9");
        let mut s = StaleSlots::default();
        let reads = Cell::new(0);
        let read = |used| {
            let reads = &reads;
            move || {
                reads.set(reads.get() + 1);
                Ok::<_, ()>(area(used))
            }
        };
        // Not a swap area now, or slots in use: nothing is dropped.
        assert!(s.check_with(&[(&dev, None)], read(0)).is_empty());
        assert!(s.check_with(&[(&dev, Some(lo.as_path()))], read(4096)).is_empty());
        assert!(s.check_with(&[(&dev, Some(Path::new("/dev/loop1")))], read(0)).is_empty());
        assert_eq!(dev.store().stats().total.stored_pages, 2);
        // An empty area: every page goes, once.
        let lines = s.check_with(&[(&dev, Some(lo.as_path()))], read(0));
        assert_eq!(lines.len(), 1);
        assert!(lines[0].starts_with("s0: no swap slot in use: dropped 2 pages of freed slots in "), "{lines:?}");
        assert_eq!(dev.store().stats().total.stored_pages, 0);
        let before = reads.get();
        assert!(s.check_with(&[(&dev, Some(lo.as_path()))], read(0)).is_empty());
        assert_eq!(reads.get(), before, "no write since the sweep: /proc/swaps is not read again");
        // A new write while the area shows a slot in use stays.
        dev.write_at(&[9u8; 4096], 4096).unwrap();
        assert!(s.check_with(&[(&dev, Some(lo.as_path()))], read(4096)).is_empty());
        assert_eq!(dev.store().stats().total.stored_pages, 1);
    }
}
