//! The kernel's NBD client (`nbd.ko`) on this process's own server, set up
//! over the `nbd` generic netlink family: what `nbd-client` does, with no
//! listener, no handshake on the wire and no program of its own.
//!
//! [`KernelDevice::connect`] makes one socketpair per connection, serves one
//! end of each on a thread of its own and hands the other ends to the
//! kernel with `NBD_CMD_CONNECT`, which picks a free `/dev/nbdN`. The kernel
//! starts in the transmission phase with the flags given there: those the
//! server advertises for simple replies (the kernel's kind), trim, flush
//! and write-zeroes included, and `CAN_MULTI_CONN`, since every connection
//! reaches the one store behind the export. So each session starts where a
//! negotiated one would (`session::resume`).
//!
//! Timeouts. A request is given a week ([`REQUEST_TIMEOUT`]): past the
//! timeout the kernel declares a connection dead, and a swap page must not
//! fail because the daemon was slow under load. A server that dies closes
//! its sockets: the kernel fails new requests at once (no dead-connection
//! timeout), but those in flight only at their timeout or at a disconnect,
//! so recovery disconnects before it swaps off.
//!
//! Restart (`tmem swap restart`): [`KernelDevice::pause`] stops every
//! session between two requests (the kernel's next ones wait in the
//! sockets) and returns copies of the sockets with the sessions' states; a
//! successor serves them on with [`KernelDevice::adopt`], and the device
//! never notices. No request fails.
//!
//! Teardown is [`KernelDevice::disconnect`] (`NBD_CMD_DISCONNECT`: the
//! kernel sends `NBD_CMD_DISC` on each connection and closes them), after
//! swapoff. After a crash, [`disconnect`] by index, and [`owned_by`] finds a
//! dead server's devices from `/sys/block/nbdN/pid`, which the kernel sets
//! to the pid that connected the device.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use neli::consts::nl::NlmF;
use neli::consts::socket::NlFamily;
use neli::err::RouterError;
use neli::genl::{AttrTypeBuilder, Genlmsghdr, GenlmsghdrBuilder, Nlattr, NlattrBuilder};
use neli::nl::NlPayload;
use neli::router::synchronous::NlRouter;
use neli::types::{Buffer, GenlBuffer};
use neli::utils::Groups;
use neli::{neli_enum, Size, ToBytes};

use crate::park::{Park, Parking, SessionState};
use crate::session::{self, Limits};
use crate::{Export, ExportStats, Exports, NbdError};

/// The generic netlink family of `drivers/block/nbd.c`.
const FAMILY: &str = "nbd";
/// Its version (`NBD_GENL_VERSION`).
const VERSION: u8 = 1;
/// Per request: past it the kernel declares the connection dead. A week, as
/// a request that long means a hung server; a slow one must never lose a
/// swap page (the kernel keeps the timeout in jiffies, an `unsigned int`:
/// a week fits at HZ 1000).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(7 * 24 * 3600);
/// The block size the device is set up with.
const BLOCK_SIZE: u64 = 4096;
/// Most connections of one device.
pub const MAX_CONNECTIONS: usize = 64;

/// Commands (`enum nbd_genl_cmd`, `include/uapi/linux/nbd-netlink.h`).
#[neli_enum(serialized_type = "u8")]
enum Cmd {
    Unspec = 0,
    Connect = 1,
    Disconnect = 2,
}
impl neli::consts::genl::Cmd for Cmd {}

/// Attributes of a command (`NBD_ATTR_*`).
#[neli_enum(serialized_type = "u16")]
enum Attr {
    Unspec = 0,
    Index = 1,
    SizeBytes = 2,
    BlockSizeBytes = 3,
    Timeout = 4,
    ServerFlags = 5,
    ClientFlags = 6,
    Sockets = 7,
}
impl neli::consts::genl::NlAttrType for Attr {}

/// The one attribute of `NBD_ATTR_SOCKETS` (`NBD_SOCK_ITEM`).
#[neli_enum(serialized_type = "u16")]
enum SockItem {
    Unspec = 0,
    Item = 1,
}
impl neli::consts::genl::NlAttrType for SockItem {}

/// The one attribute of an item (`NBD_SOCK_FD`).
#[neli_enum(serialized_type = "u16")]
enum Sock {
    Unspec = 0,
    Fd = 1,
}
impl neli::consts::genl::NlAttrType for Sock {}

/// A `/dev/nbdN` served by this process.
pub struct KernelDevice {
    index: u32,
    shared: Arc<Shared>,
    /// Each session's thread, and a copy of its socket (for a successor).
    sessions: Vec<(JoinHandle<()>, UnixStream)>,
}

/// What the sessions of one device share.
struct Shared {
    exports: Exports,
    parking: Parking,
    /// Sessions still serving (a pause waits for this many to park).
    active: AtomicUsize,
}

/// The state of every session the kernel's client starts: simple replies.
const KERNEL_SESSION: SessionState = SessionState { export: 0, structured: false, no_zeroes: false, meta: None };

impl std::fmt::Debug for KernelDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelDevice").field("index", &self.index).field("sessions", &self.sessions.len()).finish()
    }
}

/// Whether the kernel's NBD client can be set up here: `Ok` when the `nbd`
/// family answers (after `modprobe nbd` where it was not loaded), else why
/// not.
pub fn available() -> Result<(), String> {
    let resolve = || router().map(drop).map_err(|e| e.to_string());
    resolve().or_else(|e| match modprobe() {
        Ok(()) => resolve(),
        Err(m) => Err(format!("{e}; {m}")),
    })
}

/// `modprobe nbd`. The module's own devices (`nbds_max`, 16) stay; a
/// connect takes a free one.
fn modprobe() -> Result<(), String> {
    let out = std::process::Command::new("modprobe")
        .arg(FAMILY)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("cannot run modprobe: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("modprobe nbd failed: {}", String::from_utf8_lossy(&out.stderr).trim()))
    }
}

fn router() -> Result<(NlRouter, u16), NbdError> {
    let (router, _) =
        NlRouter::connect(NlFamily::Generic, None, Groups::empty()).map_err(|e| kernel_err("netlink socket", e))?;
    let family = router.resolve_genl_family(FAMILY).map_err(|e| match errno(&e) {
        Some(libc::ENOENT) => {
            NbdError::Kernel(format!("no \"{FAMILY}\" generic netlink family (nbd.ko is not loaded)"))
        }
        _ => kernel_err("the nbd netlink family", e),
    })?;
    Ok((router, family))
}

/// The errno of an error the kernel answered with, if it was one.
fn errno<T, P>(e: &RouterError<T, P>) -> Option<i32> {
    match e {
        RouterError::Nlmsgerr(m) => Some(-*m.error()),
        _ => None,
    }
}

/// The error of a netlink request: the kernel's errno as such, anything
/// else as neli says it.
fn router_err<T, P>(what: &str, e: RouterError<T, P>) -> NbdError
where
    RouterError<T, P>: std::fmt::Display,
{
    match errno(&e) {
        Some(n) => NbdError::Kernel(format!("{what}: {}", std::io::Error::from_raw_os_error(n))),
        None => kernel_err(what, e),
    }
}

fn kernel_err(what: &str, e: impl std::fmt::Display) -> NbdError {
    NbdError::Kernel(format!("{what}: {e}"))
}

fn attr<T: neli::consts::genl::NlAttrType>(t: T, payload: impl Size + ToBytes) -> Result<Nlattr<T, Buffer>, NbdError> {
    let ty = AttrTypeBuilder::default().nla_type(t).build().map_err(|e| kernel_err("attribute", e))?;
    NlattrBuilder::default().nla_type(ty).nla_payload(payload).build().map_err(|e| kernel_err("attribute", e))
}

/// Sends `cmd` with `attrs` and waits for the kernel's acknowledgement;
/// returns the index the kernel's reply names, if it names one.
fn request(cmd: Cmd, what: &str, attrs: GenlBuffer<Attr, Buffer>) -> Result<Option<u32>, NbdError> {
    let (router, family) = router()?;
    let msg =
        GenlmsghdrBuilder::default().cmd(cmd).version(VERSION).attrs(attrs).build().map_err(|e| kernel_err(what, e))?;
    let replies = router
        .send::<_, _, u16, Genlmsghdr<Cmd, Attr>>(family, NlmF::ACK, NlPayload::Payload(msg))
        .map_err(|e| router_err(what, e))?;
    let mut index = None;
    for reply in replies {
        let reply = reply.map_err(|e| router_err(what, e))?;
        if let NlPayload::Payload(p) = reply.nl_payload() {
            index = p.attrs().get_attr_handle().get_attr_payload_as::<u32>(Attr::Index).ok().or(index);
        }
    }
    Ok(index)
}

impl KernelDevice {
    /// Connects a free `/dev/nbdN` to `export` with `connections` sessions
    /// (1 to [`MAX_CONNECTIONS`]); the device is usable on return.
    pub fn connect(export: Export, connections: usize) -> Result<KernelDevice, NbdError> {
        if !(1..=MAX_CONNECTIONS).contains(&connections) {
            return Err(NbdError::Config(format!("{connections} NBD connections (1 to {MAX_CONNECTIONS})")));
        }
        let size = export.device.size();
        let shared = Shared::new(export)?;
        let mut theirs: Vec<OwnedFd> = Vec::with_capacity(connections);
        let mut ours: Vec<(OwnedFd, SessionState)> = Vec::with_capacity(connections);
        for _ in 0..connections {
            let (a, b) = UnixStream::pair()?;
            theirs.push(b.into());
            ours.push((a.into(), KERNEL_SESSION));
        }
        let mut sockets = attr(Attr::Sockets, Vec::<u8>::new())?;
        for fd in &theirs {
            let item = attr(SockItem::Item, Vec::<u8>::new())?
                .nest(&attr(Sock::Fd, u32::try_from(fd.as_raw_fd()).unwrap_or(u32::MAX))?)
                .map_err(|e| kernel_err("socket attribute", e))?;
            sockets = sockets.nest(&item).map_err(|e| kernel_err("socket attribute", e))?;
        }
        let attrs = [
            attr(Attr::SizeBytes, size)?,
            attr(Attr::BlockSizeBytes, BLOCK_SIZE)?,
            attr(Attr::Timeout, REQUEST_TIMEOUT.as_secs())?,
            attr(Attr::ServerFlags, u64::from(session::transmission_flags(false)))?,
            attr(Attr::ClientFlags, 0u64)?,
            sockets,
        ]
        .into_iter()
        .collect::<GenlBuffer<_, _>>();
        // The sessions run before the kernel has the sockets: it may send
        // its first request as soon as the connect is done.
        let sessions = start_sessions(&shared, ours)?;
        let index = request(Cmd::Connect, "NBD_CMD_CONNECT", attrs);
        // The kernel holds its own references now; ours go, so that the
        // sessions see the end of a socket the kernel drops.
        drop(theirs);
        match index {
            Ok(Some(index)) => Ok(KernelDevice { index, shared, sessions }),
            Ok(None) => Err(NbdError::Kernel("NBD_CMD_CONNECT answered without a device index".into())),
            Err(e) => Err(e),
        }
    }

    /// Serves `/dev/nbd<index>`, which a predecessor process connected, on
    /// the sockets it handed over (from [`KernelDevice::pause`]), each from
    /// its next request on.
    pub fn adopt(export: Export, index: u32, sessions: Vec<(OwnedFd, SessionState)>) -> Result<KernelDevice, NbdError> {
        if let Some((_, s)) = sessions.iter().find(|(_, s)| s.export != 0) {
            return Err(NbdError::Config(format!("a handed-over NBD session names export {}", s.export)));
        }
        let shared = Shared::new(export)?;
        let sessions = start_sessions(&shared, sessions)?;
        Ok(KernelDevice { index, shared, sessions })
    }

    /// Stops every session between two requests (within `timeout`, or this
    /// resumes and says why) and returns copies of their sockets with
    /// their states, for a successor; then [`KernelDevice::resume`] or
    /// [`KernelDevice::handed_over`].
    pub fn pause(&self, timeout: Duration) -> Result<Vec<(OwnedFd, SessionState)>, String> {
        let shared = &self.shared;
        let parked = shared.parking.pause(|| shared.active.load(Ordering::Acquire), timeout)?;
        let copies = parked
            .iter()
            .map(|(id, state)| {
                let (_, stream) = usize::try_from(*id)
                    .ok()
                    .and_then(|i| self.sessions.get(i))
                    .ok_or_else(|| std::io::Error::other(format!("session {id} is gone")))?;
                Ok((stream.as_fd().try_clone_to_owned()?, *state))
            })
            .collect::<std::io::Result<Vec<_>>>();
        copies.map_err(|e| {
            shared.parking.resume();
            format!("/dev/nbd{}: cannot copy the NBD sockets: {e}", self.index)
        })
    }

    /// Goes on after [`KernelDevice::pause`].
    pub fn resume(&self) {
        self.shared.parking.resume();
    }

    /// Ends the paused sessions once a successor serves their sockets
    /// (closing this process's copies leaves the connections open).
    pub fn handed_over(&self) {
        self.shared.parking.handed_over();
    }

    /// N of `/dev/nbdN`.
    #[must_use]
    pub fn index(&self) -> u32 {
        self.index
    }

    /// `/dev/nbdN`.
    #[must_use]
    pub fn node(&self) -> PathBuf {
        node(self.index)
    }

    /// The export's counters (requests, bytes, errors).
    #[must_use]
    pub fn stats(&self) -> ExportStats {
        self.shared.exports.stats().pop().unwrap_or_default()
    }

    /// Disconnects the device (the kernel closes every connection) and
    /// waits for the sessions to end. Only once nothing uses the device:
    /// the kernel fails what comes after.
    pub fn disconnect(self) -> Result<(), NbdError> {
        disconnect(self.index)?;
        for (thread, _) in self.sessions {
            thread.join().map_err(|_| NbdError::Panicked)?;
        }
        Ok(())
    }
}

impl Shared {
    fn new(export: Export) -> Result<Arc<Self>, NbdError> {
        Ok(Arc::new(Shared {
            exports: Exports::new(vec![export])?,
            parking: Parking::new()?,
            active: AtomicUsize::new(0),
        }))
    }
}

/// Starts a thread per socket, serving it from its next request on; a
/// session's id is its place in the list.
fn start_sessions(
    shared: &Arc<Shared>,
    sockets: Vec<(OwnedFd, SessionState)>,
) -> Result<Vec<(JoinHandle<()>, UnixStream)>, NbdError> {
    let mut started = Vec::with_capacity(sockets.len());
    for (id, (fd, state)) in sockets.into_iter().enumerate() {
        let stream = UnixStream::from(fd);
        let copy = stream.try_clone()?;
        let shared_ = Arc::clone(shared);
        shared.active.fetch_add(1, Ordering::AcqRel);
        let thread = std::thread::Builder::new().name(format!("nbd-kernel-{id}")).spawn(move || {
            let s = &shared_;
            let park = Park { parking: &s.parking, id: id as u64, fd: stream.as_fd() };
            // How it ended is the kernel's business (a disconnect, sockets it
            // closed) or a successor's (handed over).
            let _ = session::resume(&stream, &s.exports, Limits { park: Some(park), ..Limits::NONE }, state);
            s.active.fetch_sub(1, Ordering::AcqRel);
        });
        match thread {
            Ok(t) => started.push((t, copy)),
            Err(e) => {
                shared.active.fetch_sub(1, Ordering::AcqRel);
                return Err(e.into());
            }
        }
    }
    Ok(started)
}

/// `/dev/nbdN` for `index`.
#[must_use]
pub fn node(index: u32) -> PathBuf {
    PathBuf::from(format!("/dev/nbd{index}"))
}

/// Disconnects `/dev/nbd<index>` (`NBD_CMD_DISCONNECT`), whoever serves it.
pub fn disconnect(index: u32) -> Result<(), NbdError> {
    request(Cmd::Disconnect, "NBD_CMD_DISCONNECT", std::iter::once(attr(Attr::Index, index)?).collect()).map(|_| ())
}

/// The process that connected `/dev/nbd<index>`, while it is connected
/// (its `pid` file; the process may have died since).
#[must_use]
pub fn owner(index: u32) -> Option<u32> {
    owner_in(Path::new("/sys/block"), index)
}

fn owner_in(sys_block: &Path, index: u32) -> Option<u32> {
    let text = std::fs::read_to_string(sys_block.join(format!("nbd{index}/pid"))).ok()?;
    text.trim().parse::<u32>().ok().filter(|p| *p > 0)
}

/// The NBD devices that process `pid` connected and that are still
/// connected (`/sys/block/nbdN/pid`), by index.
#[must_use]
pub fn owned_by(pid: u32) -> Vec<u32> {
    owned_by_in(Path::new("/sys/block"), pid)
}

fn owned_by_in(sys_block: &Path, pid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir(sys_block) else { return Vec::new() };
    let mut found: Vec<u32> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.strip_prefix("nbd")?.parse::<u32>().ok())
        .filter(|i| owner_in(sys_block, *i) == Some(pid))
        .collect();
    found.sort_unstable();
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_of_a_pid_are_read_from_sysfs() {
        let dir = tempfile::tempdir().unwrap();
        for (name, pid) in [("nbd0", Some("42\n")), ("nbd1", None), ("nbd12", Some("42\n")), ("nbd3", Some("7\n"))] {
            std::fs::create_dir(dir.path().join(name)).unwrap();
            if let Some(p) = pid {
                std::fs::write(dir.path().join(name).join("pid"), p).unwrap();
            }
        }
        std::fs::create_dir(dir.path().join("loop0")).unwrap();
        assert_eq!(owned_by_in(dir.path(), 42), vec![0, 12]);
        assert_eq!(owned_by_in(dir.path(), 7), vec![3]);
        assert!(owned_by_in(dir.path(), 9).is_empty());
        assert_eq!((owner_in(dir.path(), 3), owner_in(dir.path(), 1), owner_in(dir.path(), 5)), (Some(7), None, None));
    }

    #[test]
    fn connect_messages_serialize_with_nested_sockets() {
        let item = attr(SockItem::Item, Vec::<u8>::new()).unwrap().nest(&attr(Sock::Fd, 5u32).unwrap()).unwrap();
        let sockets = attr(Attr::Sockets, Vec::<u8>::new()).unwrap().nest(&item).unwrap();
        let mut out = std::io::Cursor::new(Vec::new());
        sockets.to_bytes(&mut out).unwrap();
        let bytes = out.into_inner();
        // NBD_ATTR_SOCKETS { NBD_SOCK_ITEM { NBD_SOCK_FD = 5 } }: 4-byte
        // headers (length, type), each nesting its child.
        let u16_at = |i: usize| u16::from_ne_bytes([bytes[i], bytes[i + 1]]);
        assert_eq!(bytes.len(), 16);
        assert_eq!((u16_at(0), u16_at(2) & 0x3fff), (16, 7));
        assert_eq!((u16_at(4), u16_at(6) & 0x3fff), (12, 1));
        assert_eq!((u16_at(8), u16_at(10) & 0x3fff), (8, 1));
        assert_eq!(u32::from_ne_bytes(bytes[12..16].try_into().unwrap()), 5);
    }

    /// The kernel's side of one connection: writes `page` at `offset`
    /// (cookie `cookie`), reads it back, and checks both replies.
    fn write_and_read(kernel: &mut UnixStream, cookie: u64, offset: u64, page: &[u8]) {
        use crate::proto::{encode_request, Request, CMD_READ, CMD_WRITE, SIMPLE_REPLY_MAGIC};
        use std::io::{Read, Write};
        let len = u32::try_from(page.len()).unwrap();
        let write = Request { flags: 0, command: CMD_WRITE, cookie, offset, len };
        kernel.write_all(&encode_request(&write)).unwrap();
        kernel.write_all(page).unwrap();
        let read = Request { command: CMD_READ, cookie: cookie + 1, ..write };
        kernel.write_all(&encode_request(&read)).unwrap();
        let reply = |kernel: &mut UnixStream, cookie: u64| {
            let mut head = [0u8; 16];
            kernel.read_exact(&mut head).unwrap();
            assert_eq!(u32::from_be_bytes(head[0..4].try_into().unwrap()), SIMPLE_REPLY_MAGIC);
            assert_eq!(u32::from_be_bytes(head[4..8].try_into().unwrap()), 0, "error in the reply");
            assert_eq!(u64::from_be_bytes(head[8..16].try_into().unwrap()), cookie);
        };
        reply(kernel, cookie);
        reply(kernel, cookie + 1);
        let mut back = vec![0u8; page.len()];
        kernel.read_exact(&mut back).unwrap();
        assert_eq!(back, page);
    }

    #[test]
    fn paused_sessions_go_on_in_a_successor_and_a_request_sent_meanwhile_is_answered_there() {
        use std::io::Write;
        let dev: Arc<dyn tmem_block::BlockDevice> = Arc::new(tmem_block::RamDevice::new(1 << 20));
        let export = || Export::new("swap0", Arc::clone(&dev));
        let (mut kernel, ours) = UnixStream::pair().unwrap();
        let shared = Shared::new(export()).unwrap();
        let sessions = start_sessions(&shared, vec![(ours.into(), KERNEL_SESSION)]).unwrap();
        let first = KernelDevice { index: 7, shared, sessions };
        write_and_read(&mut kernel, 1, 0, &[0xa5; 4096]);
        let handed = first.pause(Duration::from_secs(5)).unwrap();
        assert_eq!(handed.len(), 1);
        assert_eq!(handed[0].1, KERNEL_SESSION);
        // A request sent while paused waits in the socket for the successor.
        let page = [0x3c; 4096];
        let write =
            crate::proto::Request { flags: 0, command: crate::proto::CMD_WRITE, cookie: 3, offset: 8192, len: 4096 };
        kernel.write_all(&crate::proto::encode_request(&write)).unwrap();
        kernel.write_all(&page).unwrap();
        let second = KernelDevice::adopt(export(), 7, handed).unwrap();
        first.handed_over();
        for (t, _) in first.sessions {
            t.join().unwrap();
        }
        let mut head = [0u8; 16];
        std::io::Read::read_exact(&mut kernel, &mut head).unwrap();
        assert_eq!(u64::from_be_bytes(head[8..16].try_into().unwrap()), 3);
        write_and_read(&mut kernel, 4, 4096, &[0x5a; 4096]);
        let mut back = [0u8; 4096];
        dev.read_at(&mut back, 8192).unwrap();
        assert_eq!(back, page);
        assert_eq!(second.stats().name, "swap0");
        // The kernel closing its end ends the session.
        drop(kernel);
        for (t, _) in second.sessions {
            t.join().unwrap();
        }
    }

    #[test]
    fn a_pause_that_cannot_finish_resumes_and_says_why() {
        let dev: Arc<dyn tmem_block::BlockDevice> = Arc::new(tmem_block::RamDevice::new(1 << 20));
        let (mut kernel, ours) = UnixStream::pair().unwrap();
        let shared = Shared::new(Export::new("swap0", Arc::clone(&dev))).unwrap();
        // Counted as serving, but never parks: the pause gives up.
        shared.active.fetch_add(1, Ordering::AcqRel);
        let sessions = start_sessions(&shared, vec![(ours.into(), KERNEL_SESSION)]).unwrap();
        let kd = KernelDevice { index: 1, shared, sessions };
        let e = kd.pause(Duration::from_millis(100)).unwrap_err();
        assert!(e.contains("1 of 2 NBD sessions paused"), "{e}");
        write_and_read(&mut kernel, 1, 0, &[7; 4096]);
    }

    #[test]
    fn connections_out_of_range_are_refused_before_the_kernel_is_asked() {
        let dev = std::sync::Arc::new(tmem_block::ZeroDevice::new(1 << 20));
        for n in [0, MAX_CONNECTIONS + 1] {
            let e = KernelDevice::connect(Export::new("x", dev.clone()), n).unwrap_err();
            assert!(e.to_string().contains("NBD connections"), "{e}");
        }
    }
}
