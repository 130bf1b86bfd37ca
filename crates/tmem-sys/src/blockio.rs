//! Block and file I/O calls std does not wrap (the disk tier, the cache
//! device): hole punching, block device
//! ioctls, `flock` and toggling `O_DIRECT`. Through `rustix` where it has a
//! safe wrapper; the block ioctls stay on `libc` (rustix has none for
//! `BLKGETSIZE64` and `BLKDISCARD`).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// `BLKGETSIZE64`: size of a block device in bytes (`_IOR(0x12, 114, size_t)`).
const BLKGETSIZE64: libc::Ioctl = libc::_IOR::<libc::size_t>(0x12, 114);
/// `BLKDISCARD`: discard a byte range `[start, len]` of a block device (`_IO(0x12, 119)`).
const BLKDISCARD: libc::Ioctl = libc::_IO(0x12, 119);

fn check(r: libc::c_int) -> io::Result<()> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Deallocates `[off, off + len)` of a regular file, keeping its size.
pub fn punch_hole(file: &File, off: u64, len: u64) -> io::Result<()> {
    use rustix::fs::{fallocate, FallocateFlags};
    Ok(fallocate(file, FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE, off, len)?)
}

/// Size of a block device in bytes.
pub fn block_device_size(file: &File) -> io::Result<u64> {
    let mut size: u64 = 0;
    // SAFETY: the fd is open for the lifetime of `file`; BLKGETSIZE64 writes
    // one u64 (size_t on 64-bit Linux) through the pointer, which points to a
    // live, writable, properly aligned u64 on our stack.
    check(unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &raw mut size) })?;
    Ok(size)
}

/// Logical block size of a block device (the unit `O_DIRECT` needs).
pub fn logical_block_size(file: &File) -> io::Result<u32> {
    let mut size: libc::c_int = 0;
    // SAFETY: the fd is open for the lifetime of `file`; BLKSSZGET writes one
    // int through the pointer, which points to a live, aligned c_int on our stack.
    check(unsafe { libc::ioctl(file.as_raw_fd(), libc::BLKSSZGET, &raw mut size) })?;
    u32::try_from(size).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// Discards `[off, off + len)` of a block device.
pub fn block_discard(file: &File, off: u64, len: u64) -> io::Result<()> {
    let range: [u64; 2] = [off, len];
    // SAFETY: the fd is open for the lifetime of `file`; BLKDISCARD reads two
    // u64s through the pointer, which points to a live `[u64; 2]` on our stack.
    check(unsafe { libc::ioctl(file.as_raw_fd(), BLKDISCARD, &raw const range) })
}

/// Takes an exclusive `flock` without waiting (held until the file is closed).
pub fn lock_exclusive(file: &File) -> io::Result<()> {
    Ok(rustix::fs::flock(file, rustix::fs::FlockOperation::NonBlockingLockExclusive)?)
}

/// Takes an exclusive `flock`, waiting for it (held until the file is closed).
pub fn lock_exclusive_wait(file: &File) -> io::Result<()> {
    Ok(rustix::fs::flock(file, rustix::fs::FlockOperation::LockExclusive)?)
}

/// Whether the file's open flags include `O_DIRECT`.
pub fn is_direct(file: &File) -> io::Result<bool> {
    Ok(rustix::fs::fcntl_getfl(file)?.contains(rustix::fs::OFlags::DIRECT))
}

/// Turns `O_DIRECT` off on an open file (Linux lets `F_SETFL` change it).
pub fn clear_direct(file: &File) -> io::Result<()> {
    let flags = rustix::fs::fcntl_getfl(file)?;
    Ok(rustix::fs::fcntl_setfl(file, flags - rustix::fs::OFlags::DIRECT)?)
}

/// Zeroes `[off, off + len)` of a file or block device, keeping its size:
/// `zero` asks that the range stay allocated (`FALLOC_FL_ZERO_RANGE`, falling
/// back to a hole), otherwise it is deallocated (`FALLOC_FL_PUNCH_HOLE`). A
/// block device always gets `ZERO_RANGE`, the mode that cannot fail for want
/// of discard support. `EOPNOTSUPP` or `EINVAL` (an unaligned range on a
/// block device) mean the caller must write zeros itself.
pub fn zero_range(file: &File, block: bool, off: u64, len: u64, zero: bool) -> io::Result<()> {
    use rustix::fs::{fallocate, FallocateFlags as F};
    if block || zero {
        match fallocate(file, F::ZERO_RANGE | F::KEEP_SIZE, off, len) {
            Err(e) if !block && e == rustix::io::Errno::OPNOTSUPP => {}
            r => return Ok(r?),
        }
    }
    punch_hole(file, off, len)
}

/// The first byte at or after `off` that holds data (`SEEK_DATA`); `None` past the last.
pub fn next_data(file: &File, off: u64) -> io::Result<Option<u64>> {
    match rustix::fs::seek(file, rustix::fs::SeekFrom::Data(off)) {
        Ok(at) => Ok(Some(at)),
        Err(rustix::io::Errno::NXIO) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// The first byte at or after `off` in a hole (`SEEK_HOLE`; the end of the file counts as one).
pub fn next_hole(file: &File, off: u64) -> io::Result<u64> {
    Ok(rustix::fs::seek(file, rustix::fs::SeekFrom::Hole(off))?)
}
