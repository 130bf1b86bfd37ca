//! The few Linux calls std does not wrap: hole punching, block device
//! ioctls, `flock` and toggling `O_DIRECT`.

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

fn off_t(x: u64) -> io::Result<libc::off_t> {
    libc::off_t::try_from(x).map_err(|_| io::Error::from_raw_os_error(libc::EOVERFLOW))
}

/// Deallocates `[off, off + len)` of a regular file, keeping its size.
pub fn punch_hole(file: &File, off: u64, len: u64) -> io::Result<()> {
    let (off, len) = (off_t(off)?, off_t(len)?);
    // SAFETY: the fd is open for the lifetime of `file`; fallocate takes no
    // pointers, only integers, so it cannot touch our memory.
    check(unsafe {
        libc::fallocate(file.as_raw_fd(), libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, off, len)
    })
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
    // SAFETY: the fd is open for the lifetime of `file`; flock takes no pointers.
    check(unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) })
}

/// Whether the file's open flags include `O_DIRECT`.
pub fn is_direct(file: &File) -> io::Result<bool> {
    // SAFETY: the fd is open for the lifetime of `file`; F_GETFL takes no pointers.
    let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
    check(flags)?;
    Ok(flags & libc::O_DIRECT != 0)
}

/// Turns `O_DIRECT` off on an open file (Linux lets `F_SETFL` change it).
pub fn clear_direct(file: &File) -> io::Result<()> {
    // SAFETY: the fd is open for the lifetime of `file`; F_GETFL takes no pointers.
    let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
    check(flags)?;
    // SAFETY: as above; F_SETFL takes an int of flags, no pointers.
    check(unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETFL, flags & !libc::O_DIRECT) })
}
