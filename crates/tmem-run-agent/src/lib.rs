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
//!    (see [`remap`]).
//!
//! The constructor is a hand-written `.init_array` entry: one static, where
//! a crate (`ctor`) would add a proc-macro build for it.

use std::ffi::c_void;
use std::os::fd::{BorrowedFd, IntoRawFd, RawFd};
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};

mod remap;

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
