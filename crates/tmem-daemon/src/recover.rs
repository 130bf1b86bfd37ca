//! Cleaning up after a daemon that died (SIGKILL, OOM, a crash).
//!
//! A dead daemon leaves its swap areas active on loop devices whose FUSE
//! files no longer answer, its FUSE mount, and files in its runtime
//! directory. What it held is gone: swap content deliberately does not
//! outlive its daemon, and the kernel gives a process that touches such a
//! page SIGBUS (swapoff marks the pages it cannot read back as poisoned).
//! This module finds those pieces — from the state file, and from the
//! kernel itself (`/sys/block/loop*/loop/backing_file`, `/proc/swaps`, the
//! mount), so it also works when the state file is missing — and removes
//! every one: swapoff, loop detach, lazy unmount, files. On the NBD
//! transport it leaves `/dev/nbdN` devices connected to dead sockets; they
//! are found from the state file and `/sys/block/nbdN/pid`, and
//! disconnected over netlink. On the ublk transport it leaves `/dev/ublkbN`
//! devices quiesced, their requests waiting for a server; they are found
//! from the state file and the driver (the server's pid), taken over by a
//! server that fails every request while their swap areas go off, then
//! deleted (`tmem_ublk`, "Crash").

use std::path::{Path, PathBuf};

use tmem_ctl::Status;
use tmem_sys::swap;

use crate::daemon::MOUNT_DIR;
use crate::runtime::{RuntimeDir, STATE_FILE};
use crate::{human, DaemonError};

/// What a dead daemon left behind in one runtime directory.
#[derive(Clone, Debug)]
pub struct Leftovers {
    /// The dead daemon's pid, from its state or lock file.
    pub pid: Option<u32>,
    /// Loop devices on its FUSE files: (device, backing file).
    pub loops: Vec<(PathBuf, PathBuf)>,
    /// Those of them that are active swap areas, with their use.
    pub swap_areas: Vec<swap::SwapArea>,
    /// Whether its FUSE mount is still there.
    pub mounted: bool,
    /// Its state file, when it left one.
    pub state: Option<Status>,
    /// Its NBD devices (N of `/dev/nbdN`), still connected to its dead
    /// sessions: from its state file and from the kernel
    /// (`/sys/block/nbdN/pid`).
    pub nbds: Vec<u32>,
    /// Its ublk devices (N of `/dev/ublkbN`), quiesced since it died: from
    /// its state file and from the driver (`ublksrv_pid`).
    pub ublks: Vec<u32>,
    /// Its zram fronts: (N of `zramN`, the loop or NBD device behind it).
    pub zram_fronts: Vec<(u32, PathBuf)>,
    /// zswap's values from before it changed them, when it left them.
    pub zswap_saved: Option<tmem_front::zswap::Saved>,
}

impl Leftovers {
    /// Pages the kernel had in its swap areas (lost with the daemon): at
    /// most, as slots that only the swap cache holds count too.
    pub fn lost_pages(&self) -> u64 {
        self.swap_areas.iter().map(|a| a.used / 4096).sum()
    }

    /// One line saying what is left.
    pub fn summary(&self) -> String {
        let mut parts: Vec<String> = self
            .swap_areas
            .iter()
            .map(|a| format!("swap on {} ({} in use)", a.path.display(), human(a.used)))
            .collect();
        let swapping: Vec<&PathBuf> = self.swap_areas.iter().map(|a| &a.path).collect();
        parts
            .extend(self.loops.iter().filter(|(d, _)| !swapping.contains(&d)).map(|(d, _)| format!("{}", d.display())));
        parts.extend(
            self.nbds
                .iter()
                .map(|i| tmem_nbd::kernel::node(*i))
                .chain(self.ublks.iter().map(|i| tmem_ublk::node(*i)))
                .filter(|d| !swapping.contains(&d))
                .map(|d| format!("{}", d.display())),
        );
        parts.extend(self.zram_fronts.iter().map(|(id, _)| format!("its zram front /dev/zram{id}")));
        if self.zswap_saved.is_some() {
            parts.push("zswap's changed settings".into());
        }
        if self.mounted {
            parts.push("its FUSE mount".into());
        }
        if parts.is_empty() {
            parts.push("its state file".into());
        }
        let mut line = parts.join(", ");
        if let Some(st) = &self.state {
            let age = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs()
                .saturating_sub(st.taken_unix);
            line.push_str(&format!("; it held {} pages when it last recorded its state, {age} s ago", st.stored_pages));
        }
        line
    }
}

/// What [`clean`] did.
#[derive(Clone, Debug, Default)]
pub struct Recovery {
    /// Steps, in order, for the command line to print.
    pub steps: Vec<String>,
    /// Pages lost with the daemon.
    pub lost_pages: u64,
    /// The dead daemon's pid, when known.
    pub pid: Option<u32>,
}

/// What a dead daemon left in `dir`; `None` when a live daemon holds the
/// directory, or nothing is left (or the directory does not exist).
pub fn inspect(dir: &Path) -> Result<Option<Leftovers>, DaemonError> {
    if !dir.exists() {
        return Ok(None);
    }
    let rt = RuntimeDir::open(dir)?;
    if rt.is_locked()? {
        return Ok(None);
    }
    leftovers(&rt, rt.lock_pid())
}

/// Removes everything a dead daemon left in `dir`. Fails, changing
/// nothing, if a live daemon holds the directory.
pub fn clean(dir: &Path) -> Result<Recovery, DaemonError> {
    let rt = RuntimeDir::open(dir)?;
    let dead_pid = rt.lock_pid();
    // Hold the lock while cleaning, so no daemon starts here meanwhile.
    let _lock = rt.lock()?;
    let Some(left) = leftovers(&rt, dead_pid)? else { return Ok(Recovery::default()) };
    let mut r = Recovery { pid: left.pid, lost_pages: left.lost_pages(), ..Recovery::default() };
    // NBD devices go first: the kernel fails a dead server's requests in
    // flight only at their timeout (a week, `tmem_nbd::kernel`) or at a
    // disconnect, and swapoff would wait on them. Disconnected, every read
    // fails at once and swapoff can go through.
    for index in &left.nbds {
        tmem_nbd::kernel::disconnect(*index).map_err(|e| DaemonError::Lifecycle(format!("/dev/nbd{index}: {e}")))?;
        r.steps.push(format!("disconnected the NBD device /dev/nbd{index} (its requests in flight fail now)"));
    }
    // ublk devices too: a dead server's device keeps every request waiting
    // for a successor (user recovery). A server of this process's that
    // fails every request takes each over, so that swapoff goes through;
    // stopping the device instead would leave its swap area on a dead disk
    // for good. They are deleted last, once nothing holds them.
    let mut failing = Vec::with_capacity(left.ublks.len());
    for id in &left.ublks {
        match tmem_ublk::UblkDevice::fail_requests(*id) {
            Ok(u) => failing.push(u),
            Err(e) => {
                failing.iter().for_each(tmem_ublk::UblkDevice::handed_over);
                return Err(DaemonError::Lifecycle(format!("taking the ublk device /dev/ublkb{id} over: {e}")));
            }
        }
        r.steps.push(format!(
            "took the ublk device /dev/ublkb{id} over with a server that fails its requests (the pages were lost \
             with the daemon)"
        ));
    }
    // On an error below, the devices are left as they were, quiesced, for
    // the next try: never stopped with a swap area on them.
    let leave = |e: DaemonError| {
        failing.iter().for_each(tmem_ublk::UblkDevice::handed_over);
        e
    };
    for area in &left.swap_areas {
        swap::swapoff(&area.path).map_err(|e| -> DaemonError {
            // swapoff charges each page it brings back to the memory cgroup
            // that swapped it out; a group at its limit, which cannot swap
            // now, refuses (ENOMEM), though the pages are lost anyway.
            let why = e.to_string();
            let hint = if why.contains("Cannot allocate memory") {
                "; a memory cgroup at its limit (memory.max) holds pages in this area, and swapoff cannot charge \
                 them back: those processes have lost the pages anyway; stop them or raise their memory.max, then \
                 run `tmem swap down` again"
            } else {
                ""
            };
            leave(DaemonError::Lifecycle(format!("swapoff {}: {why}{hint}", area.path.display())))
        })?;
        r.steps.push(format!(
            "swapoff {}: {} pages ({}) that the dead daemon held are lost; processes that had them get SIGBUS when they touch them",
            area.path.display(),
            area.used / 4096,
            human(area.used)
        ));
    }
    for (id, backing) in &left.zram_fronts {
        // Its swap area went with the others above; the device goes now,
        // before the loop device it holds.
        tmem_sys::zram::ZramDevice::adopt(*id)
            .and_then(tmem_sys::zram::ZramDevice::remove)
            .map_err(|e| leave(DaemonError::Lifecycle(format!("removing its zram front zram{id}: {e}"))))?;
        r.steps.push(format!("removed its zram front /dev/zram{id} (backing device {})", backing.display()));
    }
    if let Some(saved) = left.zswap_saved.clone() {
        tmem_front::zswap::restore_saved(saved).map_err(|e| DaemonError::Lifecycle(e.to_string()))?;
        rt.remove(crate::front::FRONT_FILE)?;
        r.steps.push("put zswap's settings back as they were before it".into());
    }
    // Swap is off them and their zram fronts are gone: the driver's
    // delete, which waits until nothing holds a device, goes through.
    for u in failing {
        let node = u.node();
        u.stop().map_err(|e| DaemonError::Lifecycle(e.to_string()))?;
        r.steps.push(format!("deleted the ublk device {}", node.display()));
    }
    for (dev, file) in &left.loops {
        swap::loop_detach(dev).map_err(|e| DaemonError::Lifecycle(e.to_string()))?;
        r.steps.push(format!("losetup --detach {} (was {})", dev.display(), file.display()));
    }
    if left.mounted {
        let mount = rt.join(MOUNT_DIR);
        swap::unmount_lazy(&mount).map_err(|e| DaemonError::Lifecycle(e.to_string()))?;
        r.steps.push(format!("umount --lazy {}", mount.display()));
    }
    for name in [STATE_FILE, tmem_ctl::SOCKET, crate::handover::SOCKET, "nbd.sock"] {
        rt.remove(name)?;
    }
    let _ = std::fs::remove_dir(rt.join(MOUNT_DIR));
    r.steps.push(format!("removed the state file and sockets from {}", rt.path().display()));
    Ok(r)
}

/// What is left in `rt`, whose daemon is not running; `lock_pid` is the pid
/// its lock file names.
fn leftovers(rt: &RuntimeDir, lock_pid: Option<u32>) -> Result<Option<Leftovers>, DaemonError> {
    let state: Option<Status> = rt.read_file(STATE_FILE, 1 << 20)?.and_then(|text| serde_json::from_str(&text).ok());
    let lifecycle = |e: swap::SwapError| DaemonError::Lifecycle(e.to_string());
    let loops = swap::loops_under(&rt.join(MOUNT_DIR)).map_err(lifecycle)?;
    let pid = state.as_ref().map(|s| s.pid).or(lock_pid);
    let mut nbds = pid.map(tmem_nbd::kernel::owned_by).unwrap_or_default();
    let recorded = state.iter().flat_map(|s| s.devices.iter().filter_map(|d| d.nbd_index));
    // Recorded, and connected by a process that is gone (a daemon taken
    // over from connected it), or disconnected by a recovery that stopped
    // short (swapoff refused) with swap still on it. One that a live
    // process connected since is not this daemon's.
    let ours = |i: &u32| match tmem_nbd::kernel::owner(*i) {
        Some(p) => !tmem_sys::process_runs(p),
        None => swap::is_swap(&tmem_nbd::kernel::node(*i)).unwrap_or(false),
    };
    nbds.extend(recorded.filter(|i| ours(i) && !nbds.contains(i)).collect::<Vec<_>>());
    // ublk: those it started, and those recorded whose server is gone (one
    // it took over from a predecessor started them). A deleted one is no
    // device any more, though a swap area may still be on its node.
    let recorded_ublk: Vec<u32> = state.iter().flat_map(|s| s.devices.iter().filter_map(|d| d.ublk_id)).collect();
    let present = tmem_ublk::devices();
    let mut ublks = pid.map(tmem_ublk::owned_by).unwrap_or_default();
    let gone = |i: &u32| present.contains(i) && tmem_ublk::owner(*i).is_none_or(|p| !tmem_sys::process_runs(p));
    ublks.extend(recorded_ublk.iter().copied().filter(|i| gone(i) && !ublks.contains(i)).collect::<Vec<_>>());
    let blocks: Vec<PathBuf> = loops
        .iter()
        .map(|(d, _)| d.clone())
        .chain(nbds.iter().map(|i| tmem_nbd::kernel::node(*i)))
        .chain(ublks.iter().chain(recorded_ublk.iter().filter(|i| !ublks.contains(i))).map(|i| tmem_ublk::node(*i)))
        .collect();
    // Found from the kernel (zram's backing_dev), so also without a state file.
    let zram_fronts: Vec<(u32, PathBuf)> =
        blocks.iter().flat_map(|d| tmem_sys::zram::backed_by(d).into_iter().map(move |id| (id, d.clone()))).collect();
    let fronted = |p: &Path| zram_fronts.iter().any(|(id, _)| p == Path::new(&format!("/dev/zram{id}")));
    let swap_areas = swap::swaps()
        .map_err(lifecycle)?
        .into_iter()
        .filter(|a| blocks.contains(&a.path) || fronted(&a.path))
        .collect();
    let left = Leftovers {
        pid,
        nbds,
        ublks,
        loops,
        swap_areas,
        mounted: rt.is_mounted(MOUNT_DIR)?,
        state,
        zram_fronts,
        zswap_saved: crate::front::read_saved(rt)?,
    };
    let any = !left.loops.is_empty()
        || !left.nbds.is_empty()
        || !left.ublks.is_empty()
        || left.mounted
        || left.state.is_some()
        || left.zswap_saved.is_some();
    Ok(any.then_some(left))
}
