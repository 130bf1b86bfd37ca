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
//! since the last sweep, [`PoolDevice::drop_stale`] drops every page but
//! those the kernel writes during the sweep (none at all when a write came
//! in before it began). This gives the memory back once nothing is in
//! swap, not while other pages still are: for that the kernel would have to
//! say which slots it freed (a BPF probe on the slot-free path, refused by
//! this test machine's locked-down kernel). After a job exits, the slots of
//! swap-cache pages that no process maps any more stay in use until memory
//! reclaim frees those pages (the kernel frees them at once only when swap
//! is over half full), so Used may stay at a few KiB for a long time on an
//! idle machine.
//!
//! For that residue the daemon empties the area itself, once it is idle
//! ([`Recycle`]): swapoff (the kernel reads the few slots still in use back
//! into memory), mkswap, swapon without the whole-area discard, then drop
//! every page but the new header and (as a sweep does) those the kernel
//! writes meanwhile. It does so only when the area holds little (at most [`Recycle::max_used`]), the pool holds much
//! more than that, nothing was written to the device and no task waited for
//! memory (PSI `some total`) for [`Recycle::quiet_ticks`] ticks, memory is
//! available for what comes back, and not within [`Recycle::interval`] of
//! the last time. While the area is off the kernel cannot swap to it: the
//! quiet gates keep that window (33–53 ms measured) to moments when
//! nothing swaps. `--recycle-idle-swap false` turns it off.

use std::path::Path;
use std::time::{Duration, Instant};

use tmem_block::{PoolDevice, StaleSweep};
use tmem_sys::swap::SwapArea;

/// When an idle swap area with a few slots in use is emptied by swapoff
/// and swapon (see the module docs).
#[derive(Clone, Copy, Debug)]
pub struct Recycle {
    /// Bytes in use in the area (/proc/swaps Used) at most.
    pub max_used: u64,
    /// The pool must hold at least `stale_factor` times what is in use
    /// plus `min_stale` bytes of pages.
    pub min_stale: u64,
    /// See `min_stale`.
    pub stale_factor: u64,
    /// Ticks in a row with no write to the device and no memory stall.
    pub quiet_ticks: u32,
    /// Memory stall (PSI `some total`) allowed per tick, microseconds.
    pub max_stall_us: u64,
    /// MemAvailable at least this many bytes more than twice what is in use.
    pub min_available: u64,
    /// At most once per device in this time.
    pub interval: Duration,
}

impl Default for Recycle {
    fn default() -> Self {
        Self {
            max_used: 4 << 20,
            min_stale: 8 << 20,
            stale_factor: 4,
            quiet_ticks: 2,
            max_stall_us: 1000,
            min_available: 64 << 20,
            interval: Duration::from_secs(60),
        }
    }
}

/// What the machine said at one tick, beside /proc/swaps.
#[derive(Clone, Copy, Debug, Default)]
pub struct Machine {
    /// PSI memory `some total`, microseconds (None: no PSI).
    pub stall_us: Option<u64>,
    /// MemAvailable, bytes (None: unreadable).
    pub available: Option<u64>,
}

impl Machine {
    /// Reads it from /proc.
    pub fn read() -> Self {
        Self {
            stall_us: tmem_sys::swap::memory_stall_us(),
            available: tmem_sys::swap::meminfo_field("MemAvailable").ok(),
        }
    }
}

/// What [`StaleSlots::check`] found to do.
#[derive(Debug, Default)]
pub struct Checked {
    /// A log line per sweep that dropped pages or was interrupted.
    pub lines: Vec<String>,
    /// Devices whose swap area should be emptied now: index, bytes in use.
    pub recycle: Vec<(usize, u64)>,
}

/// Per swap device.
#[derive(Debug, Default)]
struct DeviceState {
    /// Write count at the end of the last full sweep.
    swept_at: Option<u64>,
    /// Write count at the last tick, and ticks in a row it stayed so with
    /// no memory stall.
    last_writes: Option<u64>,
    quiet: u32,
    last_recycle: Option<Instant>,
}

/// Per swap device: what the sweeps and recycling remember.
#[derive(Debug, Default)]
pub struct StaleSlots {
    devices: Vec<DeviceState>,
    last_stall_us: Option<u64>,
}

impl StaleSlots {
    /// Sweeps each device in `devices` (with its loop device, when it is a
    /// swap area now) whose swap area has no slot in use, and says which
    /// ones to empty by swapoff and swapon (`recycle`, None: never).
    pub fn check(&mut self, devices: &[(&PoolDevice, Option<&Path>)], recycle: Option<&Recycle>) -> Checked {
        let machine = recycle.map_or_else(Machine::default, |_| Machine::read());
        self.check_with(devices, recycle, tmem_sys::swap::swaps, machine, Instant::now())
    }

    /// Called after a device's area was emptied at `now`.
    pub fn recycled(&mut self, i: usize, now: Instant) {
        if let Some(d) = self.devices.get_mut(i) {
            d.last_recycle = Some(now);
            d.quiet = 0;
        }
    }

    /// [`check`](Self::check), reading the swap areas with `areas`.
    fn check_with<E>(
        &mut self,
        devices: &[(&PoolDevice, Option<&Path>)],
        recycle: Option<&Recycle>,
        areas: impl Fn() -> Result<Vec<SwapArea>, E>,
        machine: Machine,
        now: Instant,
    ) -> Checked {
        self.devices.resize_with(devices.len(), DeviceState::default);
        let stalled = match (self.last_stall_us, machine.stall_us) {
            (Some(a), Some(b)) => b.saturating_sub(a),
            _ => 0,
        };
        self.last_stall_us = machine.stall_us;
        let mut out = Checked::default();
        for (i, (dev, loop_dev)) in devices.iter().enumerate() {
            let st = &mut self.devices[i];
            let Some(loop_dev) = loop_dev else { continue };
            let writes = dev.writes();
            let quiet_now = st.last_writes == Some(writes) && recycle.is_some_and(|r| stalled <= r.max_stall_us);
            st.quiet = if quiet_now { st.quiet + 1 } else { 0 };
            st.last_writes = Some(writes);
            if st.swept_at == Some(writes) {
                continue;
            }
            // The write count is read before /proc/swaps: see drop_stale.
            let Ok(areas) = areas() else { continue };
            let Some(area) = areas.iter().find(|a| a.path == *loop_dev) else { continue };
            if area.used != 0 {
                if let Some(r) = recycle {
                    if st.wants_recycle(r, dev, area.used, machine, now) {
                        out.recycle.push((i, area.used));
                    }
                }
                continue;
            }
            let started = Instant::now();
            match dev.drop_stale(writes) {
                StaleSweep::Done { dropped, kept } => {
                    st.swept_at = Some(writes);
                    if dropped > 0 {
                        out.lines.push(format!(
                            "{}: no swap slot in use: dropped {dropped} pages of freed slots in {} ms{}",
                            dev.name(),
                            started.elapsed().as_millis(),
                            kept_note(kept)
                        ));
                    }
                }
                StaleSweep::Interrupted => out.lines.push(format!(
                    "{}: no swap slot was in use, but a write came in before the sweep began: it drops the freed \
                     slots' pages at a later tick",
                    dev.name()
                )),
            }
        }
        out
    }
}

/// What a sweep's log line adds for the pages it kept.
pub(crate) fn kept_note(kept: u64) -> String {
    match kept {
        0 => String::new(),
        n => format!(" (kept {n} pages the kernel wrote meanwhile)"),
    }
}

impl DeviceState {
    /// The gates of [`Recycle`], for an area with `used` bytes in use.
    /// The pool's stats (every shard's lock) are read last, only once the
    /// cheap gates pass: this runs at every tick while swap is in use.
    fn wants_recycle(&self, r: &Recycle, dev: &PoolDevice, used: u64, machine: Machine, now: Instant) -> bool {
        let stored = || dev.store().stats().total.stored_pages * tmem_core::PAGE_SIZE as u64;
        used <= r.max_used
            && self.quiet >= r.quiet_ticks
            && machine.available.is_some_and(|a| a >= used.saturating_mul(2).saturating_add(r.min_available))
            && self.last_recycle.is_none_or(|t| now.duration_since(t) >= r.interval)
            && stored() >= used.saturating_mul(r.stale_factor).saturating_add(r.min_stale)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::path::PathBuf;
    use std::time::{Duration, Instant};
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
        assert!(s.check_with(&[(&dev, None)], None, read(0), Machine::default(), Instant::now()).lines.is_empty());
        assert!(s
            .check_with(&[(&dev, Some(lo.as_path()))], None, read(4096), Machine::default(), Instant::now())
            .lines
            .is_empty());
        assert!(s
            .check_with(&[(&dev, Some(Path::new("/dev/loop1")))], None, read(0), Machine::default(), Instant::now())
            .lines
            .is_empty());
        assert_eq!(dev.store().stats().total.stored_pages, 2);
        // An empty area: every page goes, once.
        let lines =
            s.check_with(&[(&dev, Some(lo.as_path()))], None, read(0), Machine::default(), Instant::now()).lines;
        assert_eq!(lines.len(), 1);
        assert!(lines[0].starts_with("s0: no swap slot in use: dropped 1 pages of freed slots in "), "{lines:?}");
        assert_eq!(dev.store().stats().total.stored_pages, 1, "page 0, the swap header, stays");
        let before = reads.get();
        assert!(s
            .check_with(&[(&dev, Some(lo.as_path()))], None, read(0), Machine::default(), Instant::now())
            .lines
            .is_empty());
        assert_eq!(reads.get(), before, "no write since the sweep: /proc/swaps is not read again");
        // A new write while the area shows a slot in use stays.
        dev.write_at(&[9u8; 4096], 4096).unwrap();
        assert!(s
            .check_with(&[(&dev, Some(lo.as_path()))], None, read(4096), Machine::default(), Instant::now())
            .lines
            .is_empty());
        assert_eq!(dev.store().stats().total.stored_pages, 2, "the header and the new page");
    }

    #[test]
    fn recycles_only_a_quiet_area_with_little_in_use_and_much_stale() {
        let dev = device();
        dev.write_at(&[7u8; 65536], 0).unwrap(); // 16 pages
        let lo = PathBuf::from("/dev/loop9");
        let devs = [(&dev, Some(lo.as_path()))];
        let r = Recycle { min_stale: 0, stale_factor: 4, quiet_ticks: 2, ..Recycle::default() };
        let calm = |stall| Machine { stall_us: Some(stall), available: Some(1 << 30) };
        let mut s = StaleSlots::default();
        let t0 = Instant::now();
        let tick = |s: &mut StaleSlots, used: u64, m: Machine, secs: u64| {
            s.check_with(&devs, Some(&r), || Ok::<_, ()>(area(used)), m, t0 + Duration::from_secs(secs)).recycle
        };
        // Two quiet ticks are needed after the first reading.
        assert!(tick(&mut s, 4096, calm(0), 0).is_empty());
        assert!(tick(&mut s, 4096, calm(0), 1).is_empty());
        assert_eq!(tick(&mut s, 4096, calm(0), 2), vec![(0, 4096)]);
        // Too much in use for what the pool holds (16 pages < 4 x 5 pages).
        assert!(tick(&mut s, 5 * 4096, calm(0), 3).is_empty());
        // A memory stall, or a write, starts the count again.
        assert!(tick(&mut s, 4096, calm(5000), 4).is_empty());
        assert!(tick(&mut s, 4096, calm(5000), 5).is_empty());
        dev.write_at(&[8u8; 4096], 0).unwrap();
        assert!(tick(&mut s, 4096, calm(5000), 6).is_empty());
        assert!(tick(&mut s, 4096, calm(5000), 7).is_empty());
        assert_eq!(tick(&mut s, 4096, calm(5000), 8), vec![(0, 4096)]);
        // Not without memory for what comes back.
        assert!(tick(&mut s, 4096, Machine { stall_us: Some(5000), available: Some(1 << 20) }, 9).is_empty());
        // Once done, not again within the interval, nor without recycling on.
        s.recycled(0, t0 + Duration::from_secs(9));
        for secs in 10..20 {
            assert!(tick(&mut s, 4096, calm(5000), secs).is_empty(), "{secs}");
        }
        assert_eq!(tick(&mut s, 4096, calm(5000), 70), vec![(0, 4096)]);
        assert!(s.check_with(&devs, None, || Ok::<_, ()>(area(4096)), calm(5000), t0).recycle.is_empty());
        assert_eq!(dev.store().stats().total.stored_pages, 16, "checks alone drop nothing while slots are in use");
    }
}
