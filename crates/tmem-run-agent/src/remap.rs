//! `mremap(2)` for a program whose mappings the helper's registration split.
//!
//! The helper registers what `/proc/PID/maps` showed, and a mapping that
//! grew meanwhile is split at the old end. Pages that arrive in both parts
//! before the helper registers the second can give them different anon_vmas,
//! and then the kernel never merges them again: an `mremap` that grows or
//! moves the whole fails with EFAULT, since it moves one mapping at a time.
//! So on EFAULT over a range that is mapped without a hole, [`mremap`] moves
//! each mapping to its place in the result with `MREMAP_FIXED` (the helper
//! follows each move through its remap events), and the new tail is fresh
//! zeroed memory, as `mremap` would give. glibc's `realloc` calls its own
//! `mremap`, which this cannot see; on that EFAULT it allocates, copies and
//! frees, which is also correct.
//!
//! A pure move (`MREMAP_FIXED`, same size) over several mappings is moved by
//! the kernel itself a mapping at a time since 6.17 (`remap_move`,
//! mm/mremap.c), up to the first uffd-armed one after the first, and then it
//! fails with EFAULT; a part that [`move_parts`] moves can meet the same. What
//! moved is read from the **destination**, never the source: the head that
//! left the source is free address space, where another thread's new mapping
//! can land at once, and a fallback that read the source would move that
//! mapping over the pages the kernel moved. So before it moves anything, the
//! fallback fills the result's range with a [`Reserve`]: an inaccessible
//! shared mapping of an empty memfd, which the helper never registers (it
//! takes private anonymous memory only) and which nothing merges with. Each
//! move replaces the reservation where it lands; the first of its remnants
//! is where the moved pages end.
//!
//! C declares `mremap` variadic (`new_address` only with `MREMAP_FIXED`); on
//! the x86_64 and aarch64 Linux ABIs the fifth integer argument is passed in
//! the same register either way, and it is only read when the flag says so.

use std::ffi::c_void;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::Ordering;

use tmem_uffd::sys::PAGE;

use crate::SOCK;

const P: u64 = PAGE as u64;

/// One line of this process's maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Mapping {
    start: u64,
    end: u64,
    /// The backing file's device (`major:minor` in the maps) and inode; 0
    /// for anonymous memory.
    dev: (u32, u32),
    inode: u64,
}

/// The mappings of this process's maps that reach into `[start, end)`, in
/// order; `None` if the maps cannot be read.
fn mapped_in(start: u64, end: u64) -> Option<Vec<Mapping>> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let mut found = Vec::new();
    for line in maps.lines() {
        let m = parse_line(line)?;
        if m.end > start && m.start < end {
            found.push(m);
        }
    }
    Some(found)
}

/// `start-end perms offset major:minor inode [name]`. (tmem-sys parses the
/// same lines for the helper; this library keeps its dependencies to the few
/// it runs inside the program with.)
fn parse_line(line: &str) -> Option<Mapping> {
    let mut fields = line.split_whitespace();
    let (s, e) = fields.next()?.split_once('-')?;
    let (major, minor) = fields.nth(2)?.split_once(':')?;
    let inode = fields.next()?.parse().ok()?;
    Some(Mapping {
        start: u64::from_str_radix(s, 16).ok()?,
        end: u64::from_str_radix(e, 16).ok()?,
        dev: (u32::from_str_radix(major, 16).ok()?, u32::from_str_radix(minor, 16).ok()?),
        inode,
    })
}

/// The mappings that cover `[start, end)` without a hole, clipped to it;
/// `None` if any byte of it is unmapped or the maps cannot be read.
fn covering(start: u64, end: u64) -> Option<Vec<(u64, u64)>> {
    let mut parts = Vec::new();
    let mut at = start;
    for m in mapped_in(start, end)? {
        if m.start > at {
            return None;
        }
        parts.push((at, m.end.min(end)));
        at = m.end.min(end);
    }
    (at == end).then_some(parts)
}

fn errno() -> i32 {
    // SAFETY: reads this thread's errno.
    unsafe { *libc::__errno_location() }
}

fn set_errno(n: i32) {
    // SAFETY: writes this thread's errno.
    unsafe { *libc::__errno_location() = n };
}

/// Address space held for pages that are to be moved there: `PROT_NONE`,
/// shared, of an empty memfd, so that the helper never registers it, nothing
/// merges with it, and the maps tell it from anything else by its inode.
struct Reserve {
    fd: OwnedFd,
    dev: (u32, u32),
    inode: u64,
}

impl Reserve {
    fn new() -> std::io::Result<Self> {
        use rustix::fs::{fstat, major, memfd_create, minor, MemfdFlags};
        let fd = memfd_create("tmem-run-mremap", MemfdFlags::CLOEXEC)?;
        let st = fstat(&fd)?;
        Ok(Self { dev: (major(st.st_dev), minor(st.st_dev)), inode: st.st_ino, fd })
    }

    /// Reserves `len` bytes at `at` (anywhere for 0) with the `mmap` flags
    /// `how` (0, `MAP_FIXED` or `MAP_FIXED_NOREPLACE`); where it was placed.
    fn place(&self, at: u64, len: u64, how: libc::c_int) -> std::io::Result<u64> {
        let len = usize::try_from(len).map_err(|_| std::io::Error::from_raw_os_error(libc::EOVERFLOW))?;
        let raw = self.fd.as_raw_fd();
        // SAFETY: an inaccessible shared mapping of this reservation's own
        // memfd; with MAP_FIXED it replaces what the caller said is its to
        // replace (the target of the caller's mremap).
        let got = unsafe { libc::mmap(at as *mut c_void, len, libc::PROT_NONE, libc::MAP_SHARED | how, raw, 0) };
        if got == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        if at != 0 && got as u64 != at {
            // A kernel that ignores MAP_FIXED_NOREPLACE (before 4.17) takes it as a hint.
            // SAFETY: the mapping just made, at the address it got.
            unsafe { libc::munmap(got, len) };
            return Err(std::io::Error::from_raw_os_error(libc::EEXIST));
        }
        Ok(got as u64)
    }

    /// The first address of `[from, to)` the reservation still holds; `None`
    /// if it holds none of it or the maps cannot be read.
    fn reached(&self, from: u64, to: u64) -> Option<u64> {
        let ours = |m: &Mapping| m.inode == self.inode && m.dev == self.dev;
        mapped_in(from, to)?.iter().find(|m| ours(m)).map(|m| m.start.max(from))
    }

    /// Unmaps what is left of the reservation in `[from, to)`.
    fn clear(&self, from: u64, to: u64) {
        let ours = |m: &Mapping| m.inode == self.inode && m.dev == self.dev;
        for m in mapped_in(from, to).unwrap_or_default().iter().filter(|m| ours(m)) {
            let (s, e) = (m.start.max(from), m.end.min(to));
            // SAFETY: a remnant of this reservation, which holds nothing.
            unsafe { libc::munmap(s as *mut c_void, usize::try_from(e - s).unwrap_or(0)) };
        }
    }
}

/// `mremap(2)` for the program: the kernel's, and on an EFAULT that the
/// helper's split of the range caused, the fallback of the module's doc.
///
/// # Safety
/// The caller's contract is `mremap(2)`'s.
#[no_mangle]
pub unsafe extern "C" fn mremap(
    old: *mut c_void,
    old_size: libc::size_t,
    new_size: libc::size_t,
    flags: libc::c_int,
    new_address: *mut c_void,
) -> *mut c_void {
    let fixed = flags & libc::MREMAP_FIXED != 0;
    let target = if fixed { new_address } else { std::ptr::null_mut() };
    let syscall = || {
        // SAFETY: the arguments are the caller's, passed through to the syscall.
        unsafe { libc::syscall(libc::SYS_mremap, old, old_size, new_size, flags, target) }
    };
    let page_up = |n: libc::size_t| (n as u64).div_ceil(P) * P;
    let (start, old_len, new_len) = (old as u64, page_up(old_size), page_up(new_size));
    let end = start + old_len;
    let managed = SOCK.load(Ordering::SeqCst) >= 0;
    let movable = flags & libc::MREMAP_MAYMOVE != 0 && flags & libc::MREMAP_DONTUNMAP == 0;
    let aligned = start.is_multiple_of(P) && (target as u64).is_multiple_of(P) && old_size > 0;
    let apart = !fixed || target as u64 >= end || target as u64 + new_len <= start;
    if !(managed && movable && aligned && apart && new_len >= old_len) {
        return syscall() as *mut c_void;
    }
    // A pure move (fixed, same size) of several mappings is done by the
    // kernel a mapping at a time since 6.17, and stops with EFAULT at a
    // uffd-armed one after the first: what moved before it stays at the
    // target. A reservation there tells how far it got.
    let pure_move = fixed && old_len == new_len;
    let early = if pure_move {
        match Reserve::new().and_then(|r| r.place(target as u64, new_len, libc::MAP_FIXED).map(|_| r)) {
            Ok(r) => Some(r),
            Err(e) => {
                let r = syscall();
                return no_fallback(r, errno(), (start, end), &e);
            }
        }
    } else {
        None
    };
    let r = syscall();
    if r != -1 {
        return r as *mut c_void;
    }
    let failed_with = errno();
    if failed_with != libc::EFAULT {
        if let Some(res) = &early {
            res.clear(target as u64, target as u64 + new_len);
        }
        set_errno(failed_with);
        return libc::MAP_FAILED;
    }
    #[cfg(test)]
    tests::hook(tests::Hook::KernelMoved);
    let (res, base, head) = match early {
        Some(res) => {
            let base = target as u64;
            let Some(reached) = res.reached(base, base + new_len) else {
                // The kernel moved the whole range and yet failed, or the
                // maps cannot be read: nothing can tell where the pages are.
                let msg = format!(
                    "tmem run: mremap of {start:#x}-{end:#x} to {base:#x} failed with EFAULT and its target's reservation is gone; the pages of the range are at {base:#x} or still at {start:#x}\n"
                );
                // SAFETY: write(2) of a valid buffer to stderr.
                unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
                set_errno(libc::EFAULT);
                return libc::MAP_FAILED;
            };
            (res, base, start + (reached - base))
        }
        None => {
            // Growing, or moving to another size: the kernel checks that
            // one mapping holds the range before it moves anything.
            if covering(start, end).is_none() {
                set_errno(libc::EFAULT);
                return libc::MAP_FAILED;
            }
            let how = if fixed { libc::MAP_FIXED } else { 0 };
            let placed = Reserve::new().and_then(|r| r.place(target as u64, new_len, how).map(|at| (r, at)));
            let (res, base) = match placed {
                Ok(placed) => placed,
                Err(e) => return no_fallback(-1, libc::EFAULT, (start, end), &e),
            };
            // The tail past the old size is fresh zeroed memory, as mremap gives.
            if new_len > old_len {
                let tail = (base + old_len) as *mut c_void;
                // SAFETY: a fresh private anonymous mapping over part of the reservation.
                let at = unsafe {
                    libc::mmap(
                        tail,
                        usize::try_from(new_len - old_len).unwrap_or(0),
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                        -1,
                        0,
                    )
                };
                if at == libc::MAP_FAILED {
                    let failed_with = errno();
                    res.clear(base, base + new_len);
                    set_errno(failed_with);
                    return libc::MAP_FAILED;
                }
            }
            (res, base, start)
        }
    };
    if head == start && covering(start, end).is_none() {
        res.clear(base, base + new_len);
        set_errno(libc::EFAULT);
        return libc::MAP_FAILED;
    }
    match move_parts(head, end, base + (head - start), &res) {
        Ok(()) => base as *mut c_void,
        Err(failed) => put_back(&res, (start, end), base, new_len, &failed),
    }
}

/// The kernel's answer (`r`, and `errno` if it failed) where no reservation
/// could be made: without one, nothing can tell what the kernel moved, so
/// there is no fallback.
fn no_fallback(r: libc::c_long, errno: i32, (start, end): (u64, u64), why: &std::io::Error) -> *mut c_void {
    if r == -1 && errno == libc::EFAULT {
        let msg = format!(
            "tmem run: mremap of {start:#x}-{end:#x} failed with EFAULT, and the fallback for a range the helper split could not reserve its target: {why}\n"
        );
        // SAFETY: write(2) of a valid buffer to stderr.
        unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
    }
    set_errno(errno);
    r as *mut c_void
}

/// A failed mremap leaves the caller's range as it was: what moved of
/// `[start, end)` goes back to the place it left, unless something else was
/// mapped there meanwhile (`MREMAP_FIXED` would replace it); the result's
/// range `[base, base + len)` is emptied of all else. Says what happened on
/// stderr and fails as mremap would.
fn put_back(res: &Reserve, (start, end): (u64, u64), base: u64, len: u64, failed: &MoveFailed) -> *mut c_void {
    let moved = failed.at;
    let moved_to = base + (moved - start);
    // `[kept, moved_to)` of the result's range still holds the caller's pages.
    let (kept, back) = if moved == start {
        (base, Ok(()))
    } else if res.place(start, moved - start, libc::MAP_FIXED_NOREPLACE).is_err() {
        (base, Err(format!("{start:#x}-{moved:#x} was mapped again meanwhile")))
    } else {
        match move_parts(base, moved_to, start, res) {
            Ok(()) => (moved_to, Ok(())),
            Err(f) => {
                res.clear(start + (f.at - base), moved);
                (f.at, Err(f.to_string()))
            }
        }
    };
    // The parts of the result's range that hold nothing of the caller's:
    // below `kept` (moved back) and from `moved_to` on.
    for (from, to) in [(base, kept), (moved_to, base + len)] {
        if let Ok(n @ 1..) = libc::size_t::try_from(to - from) {
            // SAFETY: a part of the result's range, empty of the caller's pages.
            unsafe { libc::munmap(from as *mut c_void, n) };
        }
    }
    let back = match back {
        Ok(()) => "the range is as it was".to_owned(),
        Err(why) => format!(
            "it could not be put back ({why}): the pages of {:#x}-{moved:#x} are at {kept:#x}-{moved_to:#x}",
            start + (kept - base)
        ),
    };
    let msg = format!(
        "tmem run: mremap of {start:#x}-{end:#x} to {len} bytes, moved in parts as the helper's registration split it: {failed}; {back}\n"
    );
    // SAFETY: write(2) of a valid buffer to stderr.
    unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
    // A hole is EFAULT, as mremap itself says for one; the rest ENOMEM.
    set_errno(if failed.why == Why::Hole { libc::EFAULT } else { libc::ENOMEM });
    libc::MAP_FAILED
}

/// Why [`move_parts`] stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Why {
    /// The range has a hole, or its maps could not be read.
    Hole,
    /// A move failed with this errno.
    Errno(i32),
    /// A move failed with EFAULT and the reservation holds none of its
    /// destination: what the kernel moved cannot be told.
    Lost,
}

/// Where and why [`move_parts`] stopped.
#[derive(Debug)]
struct MoveFailed {
    /// `[start, at)` has moved.
    at: u64,
    /// The part it could not move (or, for a hole, the range that has one).
    part: (u64, u64),
    why: Why,
    /// How often it read the maps.
    reads: u32,
}

impl std::fmt::Display for MoveFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (s, e) = self.part;
        match self.why {
            Why::Hole => write!(f, "{s:#x}-{e:#x} has a hole or its maps could not be read")?,
            Why::Errno(n) => write!(f, "moving {s:#x}-{e:#x} failed: {}", std::io::Error::from_raw_os_error(n))?,
            Why::Lost => write!(f, "moving {s:#x}-{e:#x} failed with EFAULT and left no trace of how far it got")?,
        }
        write!(f, " ({} read(s) of the maps)", self.reads)
    }
}

/// How often [`move_parts`] reads the maps again when a move finds the
/// mappings cut differently than it read them: the helper registers and
/// splits ranges while it runs.
const MOVE_TRIES: u32 = 8;

/// Moves each mapping over `[start, end)` to the same offset from `to`
/// with `MREMAP_FIXED`, onto `res`, which holds `to` on; on failure, what
/// has moved and why it stopped.
fn move_parts(start: u64, end: u64, to: u64, res: &Reserve) -> Result<(), MoveFailed> {
    let mut at = start;
    // The last part that met EFAULT, for the failure after MOVE_TRIES reads.
    let mut last = (start, end);
    for reads in 1..=MOVE_TRIES {
        let Some(parts) = covering(at, end) else {
            return Err(MoveFailed { at, part: (at, end), why: Why::Hole, reads });
        };
        #[cfg(test)]
        tests::hook(tests::Hook::MapsRead);
        for (s, e) in parts {
            let Ok(len) = libc::size_t::try_from(e - s) else {
                return Err(MoveFailed { at, part: (s, e), why: Why::Errno(libc::EOVERFLOW), reads });
            };
            let dst = to + (s - start);
            let fixed_move = libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED;
            // SAFETY: moves one whole part of the caller's range onto its
            // place in the reservation.
            let r = unsafe { libc::syscall(libc::SYS_mremap, s, len, len, fixed_move, dst) };
            if r == -1 {
                let errno = errno();
                if errno != libc::EFAULT {
                    return Err(MoveFailed { at, part: (s, e), why: Why::Errno(errno), reads });
                }
                // The part spans mappings now (the helper registered some
                // of it meanwhile): the kernel moved those before the first
                // uffd-armed one after another (6.17+) or nothing, and the
                // reservation's first remnant says which. Then the maps are
                // read again.
                let Some(reached) = res.reached(dst, dst + (e - s)) else {
                    return Err(MoveFailed { at, part: (s, e), why: Why::Lost, reads });
                };
                at = s + (reached - dst);
                last = (s, e);
                break;
            }
            at = e;
        }
        if at == end {
            return Ok(());
        }
    }
    Err(MoveFailed { at, part: last, why: Why::Errno(libc::EFAULT), reads: MOVE_TRIES })
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::cell::RefCell;
    use std::os::fd::RawFd;
    use std::rc::Rc;

    use tmem_testkit::{skip, Feature};
    use tmem_uffd::sys::Uffd;

    use crate::map;

    /// The tests make holes in their ranges and move ranges over others'
    /// places: a mapping another test made meanwhile could land in such a
    /// hole and be moved with the range. So they take turns.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
        ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Where the code under test lets a test act, as the helper or the
    /// program's other threads would meanwhile.
    #[derive(Clone, Copy, PartialEq, Eq, Debug)]
    pub(super) enum Hook {
        /// `move_parts` has read the maps, and moves next.
        MapsRead,
        /// `mremap`'s own syscall has failed with EFAULT, and the fallback
        /// reads what it moved next.
        KernelMoved,
    }

    type Action = Box<dyn FnOnce()>;

    thread_local! {
        /// Run once at the next time the code reaches its hook point.
        static HOOK: RefCell<Option<(Hook, Action)>> = RefCell::new(None);
    }

    fn at_next(point: Hook, f: impl FnOnce() + 'static) {
        HOOK.with(|h| *h.borrow_mut() = Some((point, Box::new(f))));
    }

    pub(super) fn hook(point: Hook) {
        let due = HOOK.with(|h| {
            let mut h = h.borrow_mut();
            if h.as_ref().is_some_and(|(p, _)| *p == point) {
                h.take().map(|(_, f)| f)
            } else {
                None
            }
        });
        if let Some(f) = due {
            f();
        }
    }

    /// A userfaultfd that asked for no events, so that a test reads none:
    /// registering a range with it arms its mapping as the helper's does.
    /// `None` (after [`skip`]) where there is no userfaultfd.
    fn uffd() -> Option<Uffd> {
        let uffd = match Uffd::create() {
            Ok(uffd) => uffd,
            Err(e) => {
                skip(Feature::Userfaultfd, &format!("no userfaultfd: {e}"));
                return None;
            }
        };
        let mut api =
            linux_raw_sys::general::uffdio_api { api: linux_raw_sys::general::UFFD_API.into(), features: 0, ioctls: 0 };
        // SAFETY: UFFDIO_API reads and writes the uffdio_api passed.
        let rc = unsafe { libc::ioctl(uffd.raw(), linux_raw_sys::ioctl::UFFDIO_API.into(), &raw mut api) };
        assert_eq!(rc, 0, "UFFDIO_API: {}", std::io::Error::last_os_error());
        Some(uffd)
    }

    /// The interposed `mremap` as the program calls it, with the agent
    /// serving a helper (its fallback runs only then: `SOCK` says so).
    fn program_mremap(src: u64, pages: (u64, u64), flags: libc::c_int, to: u64, sock: RawFd) -> Result<u64, i32> {
        SOCK.store(sock, Ordering::SeqCst);
        let len = |n: u64| usize::try_from(n * P).unwrap();
        // SAFETY: the test's own ranges; the contract is mremap(2)'s.
        let r = unsafe { mremap(src as *mut c_void, len(pages.0), len(pages.1), flags, to as *mut c_void) };
        let errno = errno();
        SOCK.store(-1, Ordering::SeqCst);
        if r == libc::MAP_FAILED {
            Err(errno)
        } else {
            Ok(r as u64)
        }
    }

    /// `mremap`'s flags for a pure move.
    const FIXED_MOVE: libc::c_int = libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED;

    /// Eight filled pages whose last four `uffd` arms (so they are two
    /// mappings, the second armed), and a target for them, mapped first.
    fn split_range_and_target(uffd: &Uffd) -> (u64, u64) {
        let src = filled(8);
        uffd.register(src + 4 * P, 4 * P).unwrap();
        (src, map(8 * PAGE, 0).unwrap())
    }

    /// A reservation of `pages` pages, placed anywhere, and its address.
    fn reserved(pages: u64) -> (Reserve, u64) {
        let res = Reserve::new().unwrap();
        let at = res.place(0, pages * P, 0).unwrap();
        (res, at)
    }

    fn nothing_mapped(start: u64, end: u64) -> bool {
        mapped_in(start, end).is_some_and(|m| m.is_empty())
    }

    /// `pages` filled pages went from `src` to `dst`, whole; then unmaps them.
    fn assert_moved_whole(src: u64, dst: u64, pages: u64) {
        assert!(nothing_mapped(src, src + pages * P), "the source is left empty");
        assert_filled(dst, pages);
        unmap(dst, pages);
    }

    fn assert_filled(at: u64, pages: u64) {
        assert!(covering(at, at + pages * P).is_some(), "{at:#x} and {pages} pages on are mapped");
        for i in 0..pages {
            assert_eq!(byte(at + i * P), u8::try_from(i + 1).unwrap(), "page {i}");
        }
    }

    /// A private anonymous range of `pages` pages, page `i` filled with `i + 1`.
    fn filled(pages: u64) -> u64 {
        let at = map(usize::try_from(pages * P).unwrap(), 0).unwrap();
        for i in 0..pages {
            // SAFETY: page `i` of the range just mapped, readable and writable.
            unsafe { std::ptr::write_bytes((at + i * P) as *mut u8, u8::try_from(i + 1).unwrap(), PAGE) };
        }
        at
    }

    fn byte(addr: u64) -> u8 {
        // SAFETY: the tests read only addresses they mapped.
        unsafe { *(addr as *const u8) }
    }

    fn unmap(at: u64, pages: u64) {
        // SAFETY: a range a test mapped.
        unsafe { libc::munmap(at as *mut c_void, usize::try_from(pages * P).unwrap()) };
    }

    /// Whether this kernel moves a pure move's head itself (6.17+).
    fn kernel_moves_heads() -> bool {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
        let mut v = release.trim().split(['.', '-']).map(|n| n.parse::<u32>().unwrap_or(0));
        (v.next().unwrap_or(0), v.next().unwrap_or(0)) >= (6, 17)
    }

    #[test]
    fn a_maps_line_gives_its_range_device_and_inode() {
        let line = "7f2a1000-7f2a3000 ---s 00000000 00:01 4187                       /memfd:tmem-run-mremap (deleted)";
        let m = parse_line(line).unwrap();
        assert_eq!((m.start, m.end, m.dev, m.inode), (0x7f2a_1000, 0x7f2a_3000, (0, 1), 4187));
        let m = parse_line("1000-2000 rw-p 00001000 fd:1a 77   /usr/lib/libc.so.6").unwrap();
        assert_eq!((m.dev, m.inode), ((0xfd, 0x1a), 77));
        assert_eq!(parse_line("1000-2000 rw-p 00000000"), None);
    }

    #[test]
    fn a_reservation_is_found_in_the_maps_and_cleared() {
        let _turn = one_at_a_time();
        let (res, at) = reserved(4);
        assert_eq!(res.reached(at, at + 4 * P), Some(at));
        assert_eq!(res.reached(at + P, at + 4 * P), Some(at + P), "clamped to the range asked about");
        // A mapping that lands on it hides that much of it.
        let over = filled(1);
        // SAFETY: moves the test's own page onto the reservation's first page.
        let r = unsafe { libc::syscall(libc::SYS_mremap, over, PAGE, PAGE, FIXED_MOVE, at) };
        assert_eq!(r.cast_unsigned(), at);
        assert_eq!(res.reached(at, at + 4 * P), Some(at + P));
        res.clear(at, at + 4 * P);
        assert_eq!(res.reached(at, at + 4 * P), None);
        assert_eq!(byte(at), 1, "clearing leaves what is not the reservation's");
        unmap(at, 1);
    }

    #[test]
    fn a_range_of_several_mappings_grows_part_by_part_with_its_pages() {
        let _turn = one_at_a_time();
        let src = filled(8);
        // A read-only page in the middle: three mappings, which one
        // `mremap` that grows the whole refuses with EFAULT.
        // SAFETY: page 3 of the test's range.
        assert_eq!(unsafe { libc::mprotect((src + 3 * P) as *mut c_void, PAGE, libc::PROT_READ) }, 0);
        assert_eq!(covering(src, src + 8 * P).map(|parts| parts.len()), Some(3));
        // The fallback runs only with a helper's socket; no helper reads it here.
        let dst = program_mremap(src, (8, 12), libc::MREMAP_MAYMOVE, 0, libc::STDERR_FILENO).unwrap();
        assert!(nothing_mapped(src, src + 8 * P), "the source is left empty");
        assert_filled(dst, 8);
        assert_eq!(byte(dst + 10 * P), 0, "the new tail is fresh memory");
        assert!(covering(dst, dst + 12 * P).is_some(), "no reservation is left in the result");
        unmap(dst, 12);
    }

    #[test]
    fn a_range_with_a_hole_is_not_moved_and_says_so() {
        let _turn = one_at_a_time();
        let src = filled(4);
        let (res, dst) = reserved(4);
        unmap(src + P, 1);
        let failed = move_parts(src, src + 4 * P, dst, &res).unwrap_err();
        assert_eq!((failed.at, failed.why), (src, Why::Hole));
        assert!(failed.to_string().contains("has a hole"), "{failed}");
        assert_eq!(byte(src), 1, "nothing moved");
        unmap(src, 4);
        unmap(dst, 4);
    }

    #[test]
    fn a_part_split_while_it_moves_goes_on_from_what_the_kernel_moved() {
        let _turn = one_at_a_time();
        let Some(uffd) = uffd() else { return };
        let uffd = Rc::new(uffd);
        let src = filled(8);
        let (res, dst) = reserved(8);
        // After `move_parts` read one mapping, its tail is armed: the
        // kernel (6.17+) moves the head and stops at the tail with EFAULT;
        // older kernels move nothing.
        let arm = Rc::clone(&uffd);
        at_next(Hook::MapsRead, move || arm.register(src + 4 * P, 4 * P).unwrap());
        move_parts(src, src + 8 * P, dst, &res).unwrap();
        assert_moved_whole(src, dst, 8);
    }

    #[test]
    fn the_programs_own_move_of_a_split_range_goes_on_from_what_the_kernel_moved() {
        let _turn = one_at_a_time();
        let Some(uffd) = uffd() else { return };
        let (src, dst) = split_range_and_target(&uffd);
        assert_eq!(program_mremap(src, (8, 8), FIXED_MOVE, dst, uffd.raw()), Ok(dst));
        assert_moved_whole(src, dst, 8);
    }

    #[test]
    fn a_mapping_made_where_the_kernel_moved_from_is_left_where_it_is() {
        let _turn = one_at_a_time();
        let Some(uffd) = uffd() else { return };
        let (src, dst) = split_range_and_target(&uffd);
        // Another thread maps where the kernel's move freed the head, before
        // the fallback looks (on a kernel that moves nothing itself, the
        // head is still there and this mapping fails).
        let made = Rc::new(std::cell::Cell::new(false));
        let made_in_hook = Rc::clone(&made);
        at_next(Hook::KernelMoved, move || {
            // SAFETY: a new mapping only where nothing is mapped (NOREPLACE).
            let at = unsafe {
                libc::mmap(
                    src as *mut c_void,
                    4 * PAGE,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                    -1,
                    0,
                )
            };
            if at as u64 == src {
                // SAFETY: the four pages just mapped.
                unsafe { std::ptr::write_bytes(src as *mut u8, 0xAA, 4 * PAGE) };
                made_in_hook.set(true);
            }
        });
        assert_eq!(program_mremap(src, (8, 8), FIXED_MOVE, dst, uffd.raw()), Ok(dst));
        assert_filled(dst, 8);
        assert_eq!(made.get(), kernel_moves_heads(), "the kernel moved the head and freed its place");
        if made.get() {
            for i in 0..4 {
                assert_eq!(byte(src + i * P), 0xAA, "the other mapping's page {i} stayed");
            }
            assert!(nothing_mapped(src + 4 * P, src + 8 * P), "the tail moved");
            unmap(src, 4);
        }
        unmap(dst, 8);
    }

    #[test]
    fn a_move_that_meets_a_hole_after_the_kernels_head_puts_the_head_back() {
        let _turn = one_at_a_time();
        let Some(uffd) = uffd() else { return };
        let (src, dst) = split_range_and_target(&uffd);
        unmap(src + 6 * P, 1);
        assert_eq!(program_mremap(src, (8, 8), FIXED_MOVE, dst, uffd.raw()), Err(libc::EFAULT));
        assert_filled(src, 6);
        assert_eq!(byte(src + 7 * P), 8);
        assert!(nothing_mapped(dst, dst + 8 * P), "nothing is left at the target");
        unmap(src, 8);
    }

    #[test]
    fn a_move_of_a_range_that_begins_with_a_hole_fails_and_moves_nothing() {
        let _turn = one_at_a_time();
        let Some(uffd) = uffd() else { return };
        // The range is pages 1-4 of 5, so that its hole (page 1) lies
        // between mappings, where a new mapping of this process's other
        // threads does not land; and the target is mapped before it.
        let below = filled(5);
        let src = below + P;
        let dst = map(4 * PAGE, 0).unwrap();
        unmap(src, 1);
        assert_eq!(program_mremap(src, (4, 4), FIXED_MOVE, dst, uffd.raw()), Err(libc::EFAULT));
        for i in 2..5 {
            assert_eq!(byte(below + i * P), u8::try_from(i + 1).unwrap(), "page {i} stayed");
        }
        assert!(nothing_mapped(dst, dst + 4 * P), "nothing is left at the target");
        unmap(below, 5);
    }
}
