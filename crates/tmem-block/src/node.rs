//! [`NodeDevice`]: a kernel block device node (`/dev/ublkbN`, `/dev/nbdN`,
//! `/dev/loopN`) as a [`BlockDevice`]: `O_DIRECT` reads and writes, and the
//! discard and zero-out ioctls. It checks a transport end to end, from
//! userspace through the kernel to the daemon, with the conformance suite
//! ([`crate::conformance::check_data`]). Test tooling: it allocates per
//! request and serves nothing.

use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use crate::{check_range, BlockDevice, BlockError, Extent};

/// `O_DIRECT` alignment: every transport's logical block is at most a page.
const ALIGN: u64 = 4096;
/// `BLKDISCARD`, `_IO(0x12, 119)` (`include/uapi/linux/fs.h`).
const BLKDISCARD: u64 = 0x1277;
/// `BLKZEROOUT`, `_IO(0x12, 127)`.
const BLKZEROOUT: u64 = 0x127f;

/// A block device node, opened for `O_DIRECT` I/O.
#[derive(Debug)]
pub struct NodeDevice {
    file: File,
    size: u64,
}

/// A buffer whose bytes start on an [`ALIGN`] boundary.
struct Aligned {
    raw: Vec<u8>,
    at: usize,
    len: usize,
}

impl Aligned {
    fn zeroed(len: usize) -> Self {
        let raw = vec![0u8; len + at(ALIGN)];
        let start = raw.as_ptr().align_offset(at(ALIGN));
        Aligned { raw, at: start, len }
    }
    fn bytes(&self) -> &[u8] {
        &self.raw[self.at..self.at + self.len]
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.raw[self.at..self.at + self.len]
    }
}

fn at(n: u64) -> usize {
    usize::try_from(n).expect("device offsets fit in usize on the targets tmem runs on")
}

fn down(n: u64) -> u64 {
    n / ALIGN * ALIGN
}

fn up(n: u64) -> u64 {
    n.div_ceil(ALIGN) * ALIGN
}

impl NodeDevice {
    /// Opens `path` read-write with `O_DIRECT`.
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let mut file = OpenOptions::new().read(true).write(true).custom_flags(libc::O_DIRECT).open(path)?;
        let size = file.seek(SeekFrom::End(0))?;
        Ok(NodeDevice { file, size })
    }

    fn failed(op: &'static str, offset: u64) -> impl FnOnce(std::io::Error) -> BlockError {
        move |source| BlockError::Backing { op, offset, source }
    }

    /// The aligned blocks covering `offset..offset + len`, read, with the
    /// first block's offset.
    fn read_cover(&self, offset: u64, len: u64) -> Result<(u64, Aligned), BlockError> {
        let (start, end) = (down(offset), up(offset + len));
        let mut buf = Aligned::zeroed(at(end - start));
        self.file.read_exact_at(buf.bytes_mut(), start).map_err(Self::failed("pread", start))?;
        Ok((start, buf))
    }

    /// `BLKDISCARD` or `BLKZEROOUT` on the aligned middle of the range, and
    /// zeros written over its unaligned edges.
    fn clear(&self, request: u64, op: &'static str, offset: u64, len: u64) -> Result<(), BlockError> {
        check_range(offset, len, self.size)?;
        let end = offset + len;
        let (inner_start, inner_end) = (up(offset), down(end));
        if inner_start >= inner_end {
            return self.write_at(&vec![0; at(len)], offset);
        }
        let range: [u64; 2] = [inner_start, inner_end - inner_start];
        // SAFETY: `range` is a live `[u64; 2]` that the ioctl reads (start,
        // length) and does not keep, and the descriptor is open.
        let r = unsafe { libc::ioctl(self.file.as_raw_fd(), request as _, range.as_ptr()) };
        if r < 0 {
            return Err(Self::failed(op, inner_start)(std::io::Error::last_os_error()));
        }
        self.write_at(&vec![0; at(inner_start - offset)], offset)?;
        self.write_at(&vec![0; at(end - inner_end)], inner_end)
    }
}

impl BlockDevice for NodeDevice {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
        check_range(offset, buf.len() as u64, self.size)?;
        if buf.is_empty() {
            return Ok(());
        }
        let (start, cover) = self.read_cover(offset, buf.len() as u64)?;
        let from = at(offset - start);
        buf.copy_from_slice(&cover.bytes()[from..from + buf.len()]);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
        check_range(offset, buf.len() as u64, self.size)?;
        if buf.is_empty() {
            return Ok(());
        }
        let (start, mut cover) = self.read_cover(offset, buf.len() as u64)?;
        let from = at(offset - start);
        cover.bytes_mut()[from..from + buf.len()].copy_from_slice(buf);
        self.file.write_all_at(cover.bytes(), start).map_err(Self::failed("pwrite", start))
    }

    fn flush(&self) -> Result<(), BlockError> {
        self.file.sync_all().map_err(Self::failed("fsync", 0))
    }

    fn trim(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        self.clear(BLKDISCARD, "BLKDISCARD", offset, len)
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), BlockError> {
        self.clear(BLKZEROOUT, "BLKZEROOUT", offset, len)
    }

    /// A node cannot tell holes from zeros.
    fn extents(&self, offset: u64, _: u64) -> Result<Vec<Extent>, BlockError> {
        Err(Self::failed("extents", offset)(std::io::ErrorKind::Unsupported.into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_behaves_as_a_byte_array_through_the_aligned_paths() {
        // A regular file takes O_DIRECT and pread/pwrite like a node, but
        // not the block ioctls: the suite's reads and writes only.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dev");
        std::fs::File::create(&path).unwrap().set_len(1 << 20).unwrap();
        let Ok(dev) = NodeDevice::open(&path) else { return }; // a filesystem without O_DIRECT (tmpfs)
        assert_eq!(dev.size(), 1 << 20);
        let data = crate::conformance::pattern(10_000, 3);
        dev.write_at(&data, 4095).unwrap();
        let mut back = vec![0u8; 10_002];
        dev.read_at(&mut back, 4094).unwrap();
        assert_eq!(back[0], 0);
        assert_eq!(&back[1..10_001], &data[..]);
        assert_eq!(back[10_001], 0);
        assert_eq!(dev.write_at(&[1], 1 << 20).unwrap_err().errno(), libc::EINVAL);
        // The unaligned edges of a zeroing are written, not discarded.
        dev.write_zeroes(4096 + 10, 100).unwrap();
        dev.read_at(&mut back, 4094).unwrap();
        assert!(back[12..112].iter().all(|b| *b == 0) && back[11] != 0);
    }
}
