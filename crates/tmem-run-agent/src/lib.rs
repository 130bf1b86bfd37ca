//! The agent that `tmem run` preloads (`LD_PRELOAD`) into a program.
//!
//! A userfaultfd acts on the memory of the process that made it, so it must
//! be made inside the program. Before the program's `main`, this library:
//! 1. makes the program's userfaultfd in full mode (never
//!    `UFFD_USER_MODE_ONLY`: there a page touched inside a system call fails
//!    with EFAULT);
//! 2. maps the staging area that evicted pages are moved into, and a stack
//!    for its own thread, which the helper never registers;
//! 3. starts that thread, which sends the userfaultfd to the helper with a
//!    [`Hello`] (its thread id in it) and holds the program in this
//!    constructor until the helper has registered the program's memory;
//! 4. the thread then moves victim pages into the staging area when asked
//!    (`UFFDIO_MOVE` works only from the memory's own process) and empties
//!    it (`MADV_DONTNEED`). It allocates nothing and touches no registered
//!    memory, so it never waits on a fault. If the helper goes away without
//!    releasing the program, the thread kills the program: its evicted
//!    pages are gone with the helper, and reading zeros in their place must
//!    never happen silently;
//! 5. registers `pthread_atfork` handlers: before a `fork`, every evicted
//!    page is brought back, since the child's copy of the memory is not
//!    managed. `vfork` and `posix_spawn` run no handlers and stay cheap;
//! 6. interposes `mremap`, for mappings the helper's registration split
//!    (see [`mremap`]).
//!
//! The constructor is a hand-written `.init_array` entry: one static, where
//! a crate (`ctor`) would add a proc-macro build for it.

use std::ffi::c_void;
use std::os::fd::{BorrowedFd, IntoRawFd, RawFd};
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};

use tmem_uffd::proto::{self, Hello};
use tmem_uffd::sys::{Uffd, PAGE};

/// Staging slots: pages the helper moves out per batch.
const SLOTS: u32 = 64;
/// The agent thread's stack.
const STACK: usize = 128 * 1024;

static SOCK: AtomicI32 = AtomicI32::new(-1);
static FORK: AtomicI32 = AtomicI32::new(-1);
static UFFD: AtomicI32 = AtomicI32::new(-1);
static STAGING: AtomicU64 = AtomicU64::new(0);
static STACK_AT: AtomicU64 = AtomicU64::new(0);
/// The helper's end of the fork channel, until the hello has sent it.
static FORK_THEIRS: AtomicI32 = AtomicI32::new(-1);
/// Write end of the pipe on which the agent thread reports its hello.
static DONE: AtomicI32 = AtomicI32::new(-1);

#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = init;

extern "C" fn init() {
    let Some(path) = std::env::var_os(proto::ENV_SOCKET) else { return };
    if let Err(why) = start(std::path::Path::new(&path)) {
        die(&format!("tmem run: {why}\n"));
    }
}

fn die(msg: &str) -> ! {
    // SAFETY: write(2) of a valid buffer to stderr, then _exit, which runs nothing of the program.
    unsafe {
        libc::write(2, msg.as_ptr().cast(), msg.len());
        libc::_exit(125)
    }
}

fn map(len: usize, flags: libc::c_int) -> Result<u64, String> {
    // SAFETY: a fresh private anonymous mapping; nothing else refers to it.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | flags,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(format!("mmap of {len} bytes: {}", std::io::Error::last_os_error()));
    }
    Ok(p as u64)
}

fn start(path: &std::path::Path) -> Result<(), String> {
    use rustix::net::{socket_with, socketpair, AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let sock = socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)
        .map_err(|e| format!("socket: {e}"))?;
    let addr = SocketAddrUnix::new(path).map_err(|e| format!("socket path {}: {e}", path.display()))?;
    if let Err(e) = rustix::net::connect(&sock, &addr) {
        // A descendant that starts after `tmem run` let its processes go
        // (the program ended first): nothing manages memory any more, so it
        // runs as it would without tmem, and so do its own children.
        let msg = format!("tmem run: the helper at {} is gone ({e}); this process runs unmanaged\n", path.display());
        // SAFETY: write(2) of a valid buffer to stderr.
        unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
        // The constructor runs before the program has threads of its own.
        std::env::remove_var("LD_PRELOAD");
        std::env::remove_var(proto::ENV_SOCKET);
        return Ok(());
    }
    let uffd = match Uffd::create() {
        Ok(u) => u,
        Err(e) => {
            let mut msg = vec![proto::REFUSED];
            msg.extend_from_slice(e.to_string().as_bytes());
            let _ = proto::send_with_fds(&sock, &msg, &[]);
            // The helper prints the reason; it also ends this process.
            die("");
        }
    };
    let (fork_ours, fork_theirs) = socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None)
        .map_err(|e| format!("socketpair: {e}"))?;
    let staging = map(SLOTS as usize * PAGE, 0)?;
    const _: () = assert!(SLOTS as usize == proto::MAX_EVICT);
    let stack = map(STACK, libc::MAP_NORESERVE | libc::MAP_STACK)?;
    let (done_read, done_write) =
        rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).map_err(|e| format!("pipe: {e}"))?;
    SOCK.store(sock.into_raw_fd(), Ordering::SeqCst);
    FORK.store(fork_ours.into_raw_fd(), Ordering::SeqCst);
    FORK_THEIRS.store(fork_theirs.into_raw_fd(), Ordering::SeqCst);
    UFFD.store(uffd.into_fd().into_raw_fd(), Ordering::SeqCst);
    STAGING.store(staging, Ordering::SeqCst);
    STACK_AT.store(stack, Ordering::SeqCst);
    DONE.store(done_write.into_raw_fd(), Ordering::SeqCst);
    spawn_agent_thread(stack)?;
    // The thread says hello (its id is in it) and writes why it failed, or
    // nothing, before it closes its end.
    let mut why = Vec::new();
    let mut buf = [0u8; 256];
    loop {
        match rustix::io::read(&done_read, &mut buf) {
            Ok(0) => break,
            Ok(n) => why.extend_from_slice(&buf[..n]),
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(format!("agent thread: {e}")),
        }
    }
    if !why.is_empty() {
        return Err(String::from_utf8_lossy(&why).into_owned());
    }
    // SAFETY: the handlers are plain extern "C" functions with no arguments.
    let rc = unsafe { libc::pthread_atfork(Some(before_fork), Some(after_fork_parent), Some(after_fork_child)) };
    if rc != 0 {
        return Err(format!("pthread_atfork: error {rc}"));
    }
    Ok(())
}

/// Runs on the agent thread: the hello and its answer.
fn hello() -> Result<(), String> {
    let staging = STAGING.load(Ordering::SeqCst);
    let stack = STACK_AT.load(Ordering::SeqCst);
    // SAFETY: gettid(2) has no preconditions.
    let tid = unsafe { libc::gettid() };
    let hello = Hello {
        version: proto::VERSION,
        pid: std::process::id(),
        staging,
        slots: SLOTS,
        stack: (stack, stack + STACK as u64),
        tid: tid.cast_unsigned(),
    };
    let sock = fd(&SOCK);
    proto::send_with_fds(sock, &hello.encode(), &[fd(&UFFD), fd(&FORK_THEIRS)]).map_err(|e| format!("hello: {e}"))?;
    close(&FORK_THEIRS);
    let mut reply = [0u8; 1024];
    let (n, _) = proto::recv_with_fds(sock, &mut reply).map_err(|e| format!("waiting for the helper: {e}"))?;
    match reply[..n].first() {
        Some(&proto::READY) => Ok(()),
        Some(&proto::REFUSED) => Err(String::from_utf8_lossy(&reply[1..n]).into_owned()),
        _ => Err("the helper closed the connection before the program started".into()),
    }
}

fn spawn_agent_thread(stack: u64) -> Result<(), String> {
    let mut attr = std::mem::MaybeUninit::<libc::pthread_attr_t>::uninit();
    let mut thread: libc::pthread_t = 0;
    // SAFETY: attr is initialised by pthread_attr_init before use and destroyed after;
    // the stack is a mapping of STACK bytes that this library owns for the process's life.
    let rc = unsafe {
        libc::pthread_attr_init(attr.as_mut_ptr());
        libc::pthread_attr_setstack(attr.as_mut_ptr(), stack as *mut c_void, STACK);
        libc::pthread_attr_setdetachstate(attr.as_mut_ptr(), libc::PTHREAD_CREATE_DETACHED);
        let rc = libc::pthread_create(&raw mut thread, attr.as_ptr(), agent_thread, std::ptr::null_mut());
        libc::pthread_attr_destroy(attr.as_mut_ptr());
        rc
    };
    if rc != 0 {
        return Err(format!("pthread_create: error {rc}"));
    }
    Ok(())
}

fn fd(slot: &AtomicI32) -> BorrowedFd<'static> {
    // SAFETY: the descriptors in these statics stay open until the agent
    // closes them itself (release, or in a fork child, which no longer uses them).
    unsafe { BorrowedFd::borrow_raw(slot.load(Ordering::SeqCst)) }
}

fn close(slot: &AtomicI32) {
    let raw: RawFd = slot.swap(-1, Ordering::SeqCst);
    if raw >= 0 {
        // SAFETY: this agent owns the descriptor and nothing uses it after the swap.
        unsafe { libc::close(raw) };
    }
}

/// Moves the pages an evict message names into the staging slots.
fn evict(sock: BorrowedFd<'_>, uffd: BorrowedFd<'_>, staging: u64, msg: &[u8]) {
    let n = usize::from(msg.get(1).copied().unwrap_or(0)).min(proto::MAX_EVICT);
    let mut reply = [0u8; 2 + proto::MAX_EVICT];
    reply[0] = proto::EVICTED;
    reply[1] = msg[1];
    for i in 0..n {
        let at = 2 + 8 * i;
        let Some(addr) = msg.get(at..at + 8) else { break };
        let addr = u64::from_le_bytes(addr.try_into().expect("8 bytes"));
        let dst = staging + (i * PAGE) as u64;
        let outcome = Uffd::move_page(uffd, dst, addr);
        reply[2 + i] = proto::outcome_code(outcome);
    }
    if rustix::net::send(sock, &reply[..2 + n], rustix::net::SendFlags::NOSIGNAL).is_err() {
        helper_gone();
    }
}

/// The agent thread: moves pages out and empties the staging area when
/// asked. Allocation-free, on a stack the helper never registers.
///
/// What it needs for that is read from the statics once, onto that stack:
/// this library's `.bss` can be an anonymous mapping the helper registers
/// and evicts, and the evictor waits on a move with the program's events
/// held (`manager::Real::move_out`), so a fault here would never be read.
extern "C" fn agent_thread(_: *mut c_void) -> *mut c_void {
    let outcome = hello();
    if let Err(why) = &outcome {
        let _ = rustix::io::write(fd(&DONE), why.as_bytes());
    }
    close(&DONE);
    if outcome.is_err() {
        return std::ptr::null_mut();
    }
    let sock = fd(&SOCK);
    let uffd = fd(&UFFD);
    let staging = STAGING.load(Ordering::SeqCst);
    let mut msg = [0u8; 2 + 8 * proto::MAX_EVICT];
    loop {
        let got = rustix::net::recv(sock, &mut msg, rustix::net::RecvFlags::empty()).map(|(n, _)| n);
        let first = match got {
            Ok(0) => None,
            Ok(_) => Some(msg[0]),
            Err(e) if e == rustix::io::Errno::INTR => continue,
            Err(_) => None,
        };
        match first {
            Some(proto::EVICT) => {
                let n = got.unwrap_or(0);
                evict(sock, uffd, staging, &msg[..n]);
            }
            Some(proto::DROP_STAGING) => {
                // SAFETY: the staging area is this library's own mapping; its
                // pages hold only copies the helper has already stored.
                unsafe { libc::madvise(staging as *mut c_void, SLOTS as usize * PAGE, libc::MADV_DONTNEED) };
                if proto::send_byte(sock, proto::DROPPED).is_err() {
                    helper_gone();
                }
            }
            Some(proto::RELEASE) => {
                // Every page is back: closing the userfaultfd unregisters the
                // memory, which the kernel then serves as it would without tmem.
                close(&UFFD);
                let _ = proto::send_byte(sock, proto::RELEASED);
                close(&FORK);
                return std::ptr::null_mut();
            }
            Some(_) => {}
            None => helper_gone(),
        }
    }
}

fn helper_gone() -> ! {
    const MSG: &[u8] = b"tmem run: the tmem helper is gone with this program's evicted pages; stopping the program so that it never reads zeros in their place\n";
    // SAFETY: write(2) of a static buffer, then SIGKILL to this process.
    unsafe {
        libc::write(2, MSG.as_ptr().cast(), MSG.len());
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
    unreachable!("SIGKILL does not return")
}

extern "C" fn before_fork() {
    let chan = FORK.load(Ordering::SeqCst);
    if chan < 0 {
        return;
    }
    let chan = fd(&FORK);
    if proto::send_byte(chan, proto::FORKING).is_err() {
        helper_gone();
    }
    loop {
        match proto::recv_byte(chan) {
            Ok(Some(proto::FILLED)) => return,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            _ => helper_gone(),
        }
    }
}

extern "C" fn after_fork_parent() {
    if FORK.load(Ordering::SeqCst) >= 0 && proto::send_byte(fd(&FORK), proto::FORKED).is_err() {
        helper_gone();
    }
}

extern "C" fn after_fork_child() {
    // The child's memory is not managed (its copy of the mappings is not
    // registered); it must not hold the parent's userfaultfd open either, or
    // a release would leave the parent's memory registered with no reader.
    close(&SOCK);
    close(&FORK);
    close(&UFFD);
}

/// The mappings that cover `[start, end)` without a hole, from this
/// process's maps; `None` if any byte of it is unmapped.
fn covering(start: u64, end: u64) -> Option<Vec<(u64, u64)>> {
    let mut parts = Vec::new();
    let mut at = start;
    for (s, e) in mapped_in(start, end)? {
        if s > at {
            return None;
        }
        parts.push((at, e.min(end)));
        at = e.min(end);
    }
    (at == end).then_some(parts)
}

/// The first address of `[start, end)` that is mapped (`end` if none is);
/// `None` if the maps cannot be read.
fn first_mapped(start: u64, end: u64) -> Option<u64> {
    mapped_in(start, end).map(|m| m.first().map_or(end, |&(s, _)| s.max(start)))
}

/// Whether nothing is mapped in `[start, end)` (false if the maps cannot
/// be read).
fn nothing_mapped(start: u64, end: u64) -> bool {
    mapped_in(start, end).is_some_and(|m| m.is_empty())
}

/// The mappings of this process's maps that reach into `[start, end)`, in
/// order; `None` if the maps cannot be read.
fn mapped_in(start: u64, end: u64) -> Option<Vec<(u64, u64)>> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let mut found = Vec::new();
    for line in maps.lines() {
        let (s, e) = line.split_whitespace().next()?.split_once('-')?;
        let (s, e) = (u64::from_str_radix(s, 16).ok()?, u64::from_str_radix(e, 16).ok()?);
        if e > start && s < end {
            found.push((s, e));
        }
    }
    Some(found)
}

/// `mremap(2)` for the program.
///
/// The helper registers what `/proc/PID/maps` showed, and a mapping that
/// grew meanwhile is split at the old end. Pages that arrive in both parts
/// before the helper registers the second can give them different anon_vmas,
/// and then the kernel never merges them again: an `mremap` that grows or
/// moves the whole fails with EFAULT, since it moves one mapping at a time.
/// So on EFAULT over a range that is mapped without a hole, this moves each
/// mapping to its place in a new range with `MREMAP_FIXED` (the helper
/// follows each move through its remap events), and the new tail is fresh
/// zeroed memory, as `mremap` would give. glibc's `realloc` calls its own
/// `mremap`, which this cannot see; on that EFAULT it allocates, copies and
/// frees, which is also correct.
///
/// A pure move (`MREMAP_FIXED`, same size) over several mappings is moved by
/// the kernel itself a mapping at a time since 6.17, up to the first
/// uffd-armed one after the first; the fallback goes on from there. For it,
/// this reads the maps once before the call, to tell a head the kernel moved
/// from a range that began with a hole.
///
/// C declares it variadic (`new_address` only with `MREMAP_FIXED`); on the
/// x86_64 and aarch64 Linux ABIs the fifth integer argument is passed in the
/// same register either way, and it is only read when the flag says so.
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
    let (start, end) = (old as u64, old as u64 + old_size as u64);
    // A pure move (fixed, same size) of several mappings is done a mapping
    // at a time since 6.17 (`remap_move`, mm/mremap.c), and stops with
    // EFAULT at a uffd-armed one after the first: what moved before it stays
    // at the target. Whether the range began with a mapping tells that head
    // from a range that never had one.
    let pure_move = fixed && old_size == new_size && SOCK.load(Ordering::SeqCst) >= 0;
    let head_was_mapped = pure_move && first_mapped(start, end) == Some(start);
    // SAFETY: the arguments are the caller's, passed through to the syscall.
    let r = unsafe { libc::syscall(libc::SYS_mremap, old, old_size, new_size, flags, target) };
    if r != -1 {
        return r as *mut c_void;
    }
    // SAFETY: reads this thread's errno.
    let errno = unsafe { *libc::__errno_location() };
    let movable = flags & libc::MREMAP_MAYMOVE != 0 && flags & libc::MREMAP_DONTUNMAP == 0;
    if errno != libc::EFAULT || !movable || SOCK.load(Ordering::SeqCst) < 0 || new_size < old_size {
        return libc::MAP_FAILED;
    }
    // `[start, head)` is what the kernel itself moved to the target.
    let head = if head_was_mapped { first_mapped(start, end).unwrap_or(start) } else { start };
    if head == start && covering(start, end).is_none() {
        return libc::MAP_FAILED;
    }
    let map_flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | if fixed { libc::MAP_FIXED } else { 0 };
    // The result's range: the caller's target (which mremap too would have
    // replaced) past the head the kernel moved there, or a new place.
    let (map_at, map_len) = if fixed {
        (target as u64 + (head - start), new_size - usize::try_from(head - start).unwrap_or(new_size))
    } else {
        (0, new_size)
    };
    let mapped = if map_len == 0 {
        target
    } else {
        // SAFETY: a new private anonymous range for (the rest of) the result.
        let at =
            unsafe { libc::mmap(map_at as *mut c_void, map_len, libc::PROT_READ | libc::PROT_WRITE, map_flags, -1, 0) };
        if at == libc::MAP_FAILED && head == start {
            return libc::MAP_FAILED;
        }
        at
    };
    let base = if fixed { target as u64 } else { mapped as u64 };
    let result = if mapped == libc::MAP_FAILED {
        // SAFETY: reads this thread's errno.
        let errno = unsafe { *libc::__errno_location() };
        Err(MoveFailed { at: head, part: (head, end), errno, reads: 0 })
    } else {
        move_parts(head, end, base + (head - start))
    };
    if let Err(failed) = result {
        let moved = failed.at;
        // A failed mremap leaves the caller's range as it was: what moved
        // goes back to the hole it left, unless something else was mapped
        // there meanwhile (MREMAP_FIXED would replace it). `[kept, moved_to)`
        // of the new range is what still holds the caller's pages.
        let moved_to = base + (moved - start);
        let (kept, back) = if moved == start {
            (base, Ok(()))
        } else if !nothing_mapped(start, moved) {
            (base, Err(format!("{start:#x}-{moved:#x} was mapped again meanwhile")))
        } else {
            match move_parts(base, moved_to, start) {
                Ok(()) => (moved_to, Ok(())),
                Err(f) => (f.at, Err(f.to_string())),
            }
        };
        // The parts of the result's range that hold nothing of the caller's:
        // below `kept` (moved back) and from `moved_to` on.
        for (from, to) in [(base, kept), (moved_to, base + new_size as u64)] {
            if let Ok(len @ 1..) = libc::size_t::try_from(to - from) {
                // SAFETY: a part of the result's range, empty of the caller's pages.
                unsafe { libc::munmap(from as *mut c_void, len) };
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
            "tmem run: mremap of {start:#x}-{end:#x} to {new_size} bytes, moved in parts as the helper's registration split it: {failed}; {back}\n"
        );
        // SAFETY: write(2) of a valid buffer to stderr.
        unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
        // A hole is EFAULT, as mremap itself says for one; the rest ENOMEM.
        let errno = if failed.errno == 0 { libc::EFAULT } else { libc::ENOMEM };
        // SAFETY: errno is this thread's; the failure is reported as mremap's own.
        unsafe { *libc::__errno_location() = errno };
        return libc::MAP_FAILED;
    }
    base as *mut c_void
}

/// Why [`move_parts`] stopped.
#[derive(Debug)]
struct MoveFailed {
    /// `[start, at)` has moved.
    at: u64,
    /// The part it could not move (or, for a hole, the range that has one).
    part: (u64, u64),
    /// The move's errno; 0 where the maps showed a hole or could not be read.
    errno: i32,
    /// How often it read the maps.
    reads: u32,
}

impl std::fmt::Display for MoveFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (s, e) = self.part;
        match self.errno {
            0 => write!(f, "{s:#x}-{e:#x} has a hole or its maps could not be read")?,
            n => write!(f, "moving {s:#x}-{e:#x} failed: {}", std::io::Error::from_raw_os_error(n))?,
        }
        write!(f, " ({} read(s) of the maps)", self.reads)
    }
}

/// How often [`move_parts`] reads the maps again when a move finds the
/// mappings cut differently than it read them: the helper registers and
/// splits ranges while it runs.
const MOVE_TRIES: u32 = 8;

/// Moves each mapping over `[start, end)` to the same offset from `to`
/// with `MREMAP_FIXED`; on failure, what has moved and why it stopped.
fn move_parts(start: u64, end: u64, to: u64) -> Result<(), MoveFailed> {
    let mut at = start;
    // The last part that met EFAULT, for the failure after MOVE_TRIES reads.
    let mut last = (start, end);
    for reads in 1..=MOVE_TRIES {
        let Some(parts) = covering(at, end) else {
            return Err(MoveFailed { at, part: (at, end), errno: 0, reads });
        };
        #[cfg(test)]
        tests::after_maps_read();
        for (s, e) in parts {
            let Ok(len) = libc::size_t::try_from(e - s) else {
                return Err(MoveFailed { at, part: (s, e), errno: libc::EOVERFLOW, reads });
            };
            let fixed_move = libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED;
            // SAFETY: moves one whole part of the caller's range into the new range.
            let r = unsafe { libc::syscall(libc::SYS_mremap, s, len, len, fixed_move, to + (s - start)) };
            if r == -1 {
                // SAFETY: reads this thread's errno.
                let errno = unsafe { *libc::__errno_location() };
                if errno != libc::EFAULT {
                    return Err(MoveFailed { at, part: (s, e), errno, reads });
                }
                // The part spans mappings now (the helper registered some
                // of it meanwhile): read them again. The kernel moves such
                // a range a mapping at a time and stops with EFAULT at the
                // first uffd-armed one after another (`remap_move`,
                // mm/mremap.c since 6.17), so the mappings before it have
                // moved: what of the part is no longer mapped went. (This
                // reads it from the source's maps, where another thread's
                // new mapping could already have taken the freed head: then
                // a foreign mapping is moved too. Open; see the README.)
                at = first_mapped(s, e).unwrap_or(s);
                last = (s, e);
                break;
            }
            at = e;
        }
        if at == end {
            return Ok(());
        }
    }
    Err(MoveFailed { at, part: last, errno: libc::EFAULT, reads: MOVE_TRIES })
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::cell::RefCell;
    use std::rc::Rc;

    use tmem_testkit::{skip, Feature};

    const P: u64 = PAGE as u64;

    /// The tests make holes in their ranges and move ranges over others'
    /// places: a mapping another test made meanwhile could land in such a
    /// hole and be moved with the range. So they take turns.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
        ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    thread_local! {
        /// Run once by `move_parts` after its next read of the maps: a
        /// test's way to split a mapping between that read and the moves,
        /// as the helper's registration does.
        static AFTER_MAPS_READ: RefCell<Option<Box<dyn FnOnce()>>> = RefCell::new(None);
    }

    pub(super) fn after_maps_read() {
        if let Some(hook) = AFTER_MAPS_READ.with(|h| h.borrow_mut().take()) {
            hook();
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
    fn program_mremap(src: u64, pages: u64, flags: libc::c_int, to: u64, sock: RawFd) -> Result<u64, i32> {
        SOCK.store(sock, Ordering::SeqCst);
        let len = usize::try_from(pages * P).unwrap();
        // SAFETY: the test's own ranges; the contract is mremap(2)'s.
        let r = unsafe { mremap(src as *mut c_void, len, len, flags, to as *mut c_void) };
        // SAFETY: reads this thread's errno.
        let errno = unsafe { *libc::__errno_location() };
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

    #[test]
    fn a_range_of_several_mappings_moves_part_by_part_with_its_pages() {
        let _turn = one_at_a_time();
        let src = filled(8);
        // A read-only page in the middle: three mappings, which one
        // `mremap` that grows the whole refuses with EFAULT.
        // SAFETY: page 3 of the test's range.
        assert_eq!(unsafe { libc::mprotect((src + 3 * P) as *mut c_void, PAGE, libc::PROT_READ) }, 0);
        assert_eq!(covering(src, src + 8 * P).map(|parts| parts.len()), Some(3));
        let dst = map(12 * PAGE, 0).unwrap();
        move_parts(src, src + 8 * P, dst).unwrap();
        assert!(nothing_mapped(src, src + 8 * P), "the source is left empty");
        for i in 0..8 {
            assert_eq!(byte(dst + i * P), u8::try_from(i + 1).unwrap(), "page {i}");
        }
        assert_eq!(byte(dst + 10 * P), 0, "the new tail is fresh memory");
        unmap(dst, 12);
    }

    #[test]
    fn a_range_with_a_hole_is_not_moved_and_says_so() {
        let _turn = one_at_a_time();
        let src = filled(4);
        let dst = map(4 * PAGE, 0).unwrap();
        unmap(src + P, 1);
        let failed = move_parts(src, src + 4 * P, dst).unwrap_err();
        assert_eq!((failed.at, failed.errno), (src, 0));
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
        let dst = map(8 * PAGE, 0).unwrap();
        // After `move_parts` read one mapping, its tail is armed: the
        // kernel (6.17+) moves the head and stops at the tail with EFAULT;
        // older kernels move nothing.
        let arm = Rc::clone(&uffd);
        AFTER_MAPS_READ.with(|h| *h.borrow_mut() = Some(Box::new(move || arm.register(src + 4 * P, 4 * P).unwrap())));
        move_parts(src, src + 8 * P, dst).unwrap();
        assert_moved_whole(src, dst, 8);
    }

    #[test]
    fn the_programs_own_move_of_a_split_range_goes_on_from_what_the_kernel_moved() {
        let _turn = one_at_a_time();
        let Some(uffd) = uffd() else { return };
        let (src, dst) = split_range_and_target(&uffd);
        assert_eq!(program_mremap(src, 8, FIXED_MOVE, dst, uffd.raw()), Ok(dst));
        assert_moved_whole(src, dst, 8);
    }

    #[test]
    fn a_move_that_meets_a_hole_after_the_kernels_head_puts_the_head_back() {
        let _turn = one_at_a_time();
        let Some(uffd) = uffd() else { return };
        let (src, dst) = split_range_and_target(&uffd);
        unmap(src + 6 * P, 1);
        assert_eq!(program_mremap(src, 8, FIXED_MOVE, dst, uffd.raw()), Err(libc::EFAULT));
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
        assert_eq!(program_mremap(src, 4, FIXED_MOVE, dst, uffd.raw()), Err(libc::EFAULT));
        for i in 2..5 {
            assert_eq!(byte(below + i * P), u8::try_from(i + 1).unwrap(), "page {i} stayed");
        }
        unmap(below, 5);
        unmap(dst, 4);
    }
}
