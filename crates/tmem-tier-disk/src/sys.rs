//! The few Linux calls std does not wrap: hole punching, block device
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

/// Whether the file's open flags include `O_DIRECT`.
pub fn is_direct(file: &File) -> io::Result<bool> {
    Ok(rustix::fs::fcntl_getfl(file)?.contains(rustix::fs::OFlags::DIRECT))
}

/// Turns `O_DIRECT` off on an open file (Linux lets `F_SETFL` change it).
pub fn clear_direct(file: &File) -> io::Result<()> {
    let flags = rustix::fs::fcntl_getfl(file)?;
    Ok(rustix::fs::fcntl_setfl(file, flags - rustix::fs::OFlags::DIRECT)?)
}
