//! The buffers of FUSE-over-io_uring ring entries, in a memfd mapped shared.
//!
//! The kernel keeps an entry's two buffer addresses from its `REGISTER` and
//! copies a request in, and an answer out, in the address space of whoever
//! issued the entry's latest command. So a successor process that maps the
//! same memfd at the same address can answer (commit) a request that an
//! entry of its predecessor holds, and the entry is the successor's from
//! then on: its next request comes to the successor's ring (see
//! `uring`'s hand-over).

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::mm::{MapFlags, ProtFlags};

/// Page size of the slots' layout.
pub(crate) const PAGE: usize = 4096;

/// Bytes one entry takes: its header on a page of its own, then its payload.
pub(crate) fn slot_bytes(payload_bytes: usize) -> usize {
    PAGE + payload_bytes.next_multiple_of(PAGE)
}

/// Some entries' buffers, `slot_bytes` apart.
pub(crate) struct Region {
    fd: OwnedFd,
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping is shared memory that lives as long as the Region;
// each slot in it has one worker, which alone makes references into it.
unsafe impl Send for Region {}
// SAFETY: as for Send: `&Region` only hands out addresses.
unsafe impl Sync for Region {}

impl Region {
    /// A new region of `len` bytes, anywhere.
    pub(crate) fn new(len: usize) -> io::Result<Self> {
        let fd = rustix::fs::memfd_create("tmem-fuse-ring", rustix::fs::MemfdFlags::CLOEXEC)?;
        rustix::fs::ftruncate(&fd, len as u64)?;
        // SAFETY: a fresh shared mapping of our own memfd, at an address the
        // kernel picks: it overlaps nothing.
        let base = unsafe {
            rustix::mm::mmap(std::ptr::null_mut(), len, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, &fd, 0)
        }?;
        Ok(Self { fd, base: base.cast(), len })
    }

    /// A predecessor's region (its memfd), mapped at the address where the
    /// predecessor had it. Fails if anything of this process is there.
    pub(crate) fn adopt(fd: OwnedFd, base: u64, len: usize) -> io::Result<Self> {
        let size = rustix::fs::fstat(&fd)?.st_size;
        if u64::try_from(size).unwrap_or(0) < len as u64 || !base.is_multiple_of(PAGE as u64) {
            return Err(io::Error::other(format!(
                "a ring buffer region of {len} bytes at {base:#x} whose memfd holds {size} bytes"
            )));
        }
        let want = usize::try_from(base).map_err(io::Error::other)? as *mut std::ffi::c_void;
        // SAFETY: MAP_FIXED_NOREPLACE maps only where nothing is mapped, so
        // no mapping of this process is replaced; the memfd is at least
        // `len` bytes long (checked above).
        let got = unsafe {
            rustix::mm::mmap(
                want,
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED | MapFlags::FIXED_NOREPLACE,
                &fd,
                0,
            )
        }
        .map_err(|e| {
            io::Error::other(format!(
                "cannot map the FUSE ring buffers at {base:#x}, where the predecessor had them: {e}"
            ))
        })?;
        if got != want {
            // A kernel before 4.17 takes the flag as a hint.
            // SAFETY: `got` is the mapping of `len` bytes made just above.
            let _ = unsafe { rustix::mm::munmap(got, len) };
            return Err(io::Error::other(format!("the FUSE ring buffers could not be mapped at {base:#x}")));
        }
        Ok(Self { fd, base: got.cast(), len })
    }

    /// Where the region is mapped.
    pub(crate) fn base(&self) -> u64 {
        self.base as usize as u64
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The address `offset` bytes into the region, where `offset + bytes`
    /// must lie inside it.
    pub(crate) fn at(&self, offset: usize, bytes: usize) -> io::Result<*mut u8> {
        if offset.checked_add(bytes).is_none_or(|end| end > self.len) || !offset.is_multiple_of(PAGE) {
            return Err(io::Error::other(format!("a slot of {bytes} bytes at {offset} in a region of {}", self.len)));
        }
        // SAFETY: offset + bytes <= len (checked above): inside the mapping.
        Ok(unsafe { self.base.add(offset) })
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: the mapping made in new/adopt, unmapped once; no worker
        // uses it any more (each holds an Arc of the region).
        let _ = unsafe { rustix::mm::munmap(self.base.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_region_maps_again_at_its_address_only_where_nothing_is() {
        let a = Region::new(4 * PAGE).unwrap();
        // SAFETY: inside the mapping just made.
        unsafe { a.at(PAGE, PAGE).unwrap().write(7) };
        let fd = a.fd().try_clone_to_owned().unwrap();
        // The same address is taken in this process: refused, nothing replaced.
        let taken = Region::adopt(fd.try_clone().unwrap(), a.base(), a.len()).err().unwrap();
        assert!(taken.to_string().contains("where the predecessor had them"), "{taken}");
        let (base, len) = (a.base(), a.len());
        drop(a);
        let b = Region::adopt(fd, base, len).unwrap();
        assert_eq!(b.base(), base);
        // SAFETY: inside the mapping.
        assert_eq!(unsafe { b.at(PAGE, PAGE).unwrap().read() }, 7, "the same memory");
        assert!(b.at(3 * PAGE, 2 * PAGE).is_err() && b.at(1, 1).is_err());
    }
}
