//! The agent ↔ helper protocol, over `SOCK_SEQPACKET` sockets (one message
//! per `send`, so no framing).
//!
//! - The agent connects to the socket named by [`ENV_SOCKET`] and sends a
//!   [`Hello`] with two descriptors: the program's userfaultfd and its end
//!   of a fork channel. Or, when it could not make a userfaultfd, an
//!   [`REFUSED`] byte and the reason.
//! - The helper answers [`READY`] once the program's memory is registered,
//!   or [`REFUSED`] and the reason, which the agent prints before it exits.
//! - On the main socket the helper then asks [`EVICT`] (the agent moves the
//!   pages into the staging area: only the memory's own process may
//!   `UFFDIO_MOVE`), [`DROP_STAGING`] (the agent answers [`DROPPED`]) and,
//!   before it goes, [`RELEASE`] (the agent closes its userfaultfd and
//!   answers [`RELEASED`]).
//! - On the fork channel the agent says [`FORKING`] before a `fork` and
//!   waits for [`FILLED`]; after it, the parent says [`FORKED`].

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage,
    SendFlags,
};

/// The helper's socket path, in the program's environment.
pub const ENV_SOCKET: &str = "TMEM_RUN_SOCKET";

pub const READY: u8 = b'R';
pub const REFUSED: u8 = b'X';
/// Evict: the byte, a count n (u8), then n page addresses (u64 LE); the
/// agent moves page i into staging slot i and answers [`EVICTED`], n, and
/// one [`crate::sys::Outcome`] code per page.
pub const EVICT: u8 = b'E';
pub const EVICTED: u8 = b'e';
/// Most pages one evict message carries (the staging area's slots).
pub const MAX_EVICT: usize = 64;
pub const DROP_STAGING: u8 = b'D';
pub const DROPPED: u8 = b'd';
pub const RELEASE: u8 = b'L';
pub const RELEASED: u8 = b'l';
pub const FORKING: u8 = b'F';
pub const FILLED: u8 = b'f';
pub const FORKED: u8 = b'P';

const MAGIC: u32 = u32::from_le_bytes(*b"TMRN");
pub const VERSION: u32 = 1;
const HELLO_LEN: usize = 48;

/// What the agent tells the helper about the program.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    pub version: u32,
    pub pid: u32,
    /// The staging area: `slots` pages at `staging`, private anonymous.
    pub staging: u64,
    pub slots: u32,
    /// The agent thread's own stack, which must never be registered.
    pub stack: (u64, u64),
    /// The agent thread's id: its faults are served at once, without the
    /// engine (it touches no registered memory while it moves pages).
    pub tid: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    #[error("the agent's hello is {0} bytes, not {HELLO_LEN}")]
    Length(usize),
    #[error("the agent's hello has the wrong magic number")]
    Magic,
    #[error(
        "the agent speaks protocol {0}, this helper {VERSION}: the agent library and tmem come from different builds"
    )]
    Version(u32),
    #[error("the agent sent {0} descriptors, not 2")]
    Fds(usize),
    #[error("the agent could not start: {0}")]
    Refused(String),
    #[error("agent socket: {0}")]
    Io(#[from] io::Error),
}

impl Hello {
    #[must_use]
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&self.version.to_le_bytes());
        b[8..12].copy_from_slice(&self.pid.to_le_bytes());
        b[12..16].copy_from_slice(&self.slots.to_le_bytes());
        b[16..24].copy_from_slice(&self.staging.to_le_bytes());
        b[24..32].copy_from_slice(&self.stack.0.to_le_bytes());
        b[32..40].copy_from_slice(&self.stack.1.to_le_bytes());
        b[40..44].copy_from_slice(&self.tid.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<Self, ProtoError> {
        if b.len() != HELLO_LEN {
            return Err(ProtoError::Length(b.len()));
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        if u32_at(0) != MAGIC {
            return Err(ProtoError::Magic);
        }
        if u32_at(4) != VERSION {
            return Err(ProtoError::Version(u32_at(4)));
        }
        Ok(Self {
            version: VERSION,
            pid: u32_at(8),
            slots: u32_at(12),
            staging: u64_at(16),
            stack: (u64_at(24), u64_at(32)),
            tid: u32_at(40),
        })
    }
}

/// Sends `bytes` with `fds` attached.
pub fn send_with_fds(sock: impl AsFd, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
    let mut cmsg = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !cmsg.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::other("no room for the descriptors"));
    }
    sendmsg(sock, &[IoSlice::new(bytes)], &mut cmsg, SendFlags::NOSIGNAL)?;
    Ok(())
}

/// Receives one message into `buf` and the descriptors with it; the length
/// is 0 at the end of the stream.
pub fn recv_with_fds(sock: impl AsFd, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(2))];
    let mut cmsg = RecvAncillaryBuffer::new(&mut space);
    let msg = recvmsg(sock, &mut [IoSliceMut::new(buf)], &mut cmsg, RecvFlags::CMSG_CLOEXEC)?;
    let mut fds = Vec::new();
    for m in cmsg.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = m {
            fds.extend(rights);
        }
    }
    Ok((msg.bytes, fds))
}

/// Sends one byte (no descriptors, no allocation: the agent's loop uses it).
pub fn send_byte(sock: impl AsFd, byte: u8) -> io::Result<()> {
    rustix::net::send(sock, &[byte], SendFlags::NOSIGNAL)?;
    Ok(())
}

/// Receives one message and returns its first byte; `None` at the end of the stream.
pub fn recv_byte(sock: impl AsFd) -> io::Result<Option<u8>> {
    let mut b = [0u8; 1];
    let (n, _) = rustix::net::recv(sock, &mut b, rustix::net::RecvFlags::empty())?;
    Ok((n > 0).then_some(b[0]))
}

/// An outcome as one byte on the wire.
#[must_use]
pub fn outcome_code(o: crate::sys::Outcome) -> u8 {
    use crate::sys::Outcome;
    match o {
        Outcome::Done => 0,
        Outcome::Retry => 1,
        Outcome::Gone => 2,
        Outcome::Busy => 3,
    }
}

/// The outcome a byte stands for; anything unknown is `Gone`.
#[must_use]
pub fn outcome_of(b: u8) -> crate::sys::Outcome {
    use crate::sys::Outcome;
    match b {
        0 => Outcome::Done,
        1 => Outcome::Retry,
        3 => Outcome::Busy,
        _ => Outcome::Gone,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hello_round_trips_and_bad_ones_are_named() {
        let h = Hello {
            version: VERSION,
            pid: 42,
            staging: 0x7f00_0000_0000,
            slots: 64,
            stack: (1 << 20, 2 << 20),
            tid: 7,
        };
        assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
        assert!(matches!(Hello::decode(&[0; 3]), Err(ProtoError::Length(3))));
        let mut bad = h.encode();
        bad[0] ^= 1;
        assert!(matches!(Hello::decode(&bad), Err(ProtoError::Magic)));
        let mut old = h.encode();
        old[4] = 9;
        assert!(matches!(Hello::decode(&old), Err(ProtoError::Version(9))));
    }
}
