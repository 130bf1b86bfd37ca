//! One ublk queue: a thread of its own (libublk's, with
//! `PR_SET_IO_FLUSHER`), its io_uring, and one buffer per tag, allocated
//! when the queue starts. A request is served where it arrives: read into,
//! or written from, its tag's buffer, then committed at once, the commit
//! and the tag's next fetch in one command and one `io_uring_enter`.
//! Nothing is allocated per request.

use std::rc::Rc;
use std::sync::Arc;

use libublk::io::{BufDescList, UblkDev, UblkIOCtx, UblkQueue};
use libublk::sys::{self, ublksrv_io_desc};
use libublk::{BufDesc, UblkIORes};
use tmem_block::BlockDevice;

use crate::gate::Gate;

/// Serves queue `qid` of `dev` from `device` until the device stops (or its
/// server is handed over and this process ends).
pub(crate) fn serve_queue(qid: u16, dev: &UblkDev, device: &Arc<dyn BlockDevice>, gate: &Gate) {
    let bufs = Rc::new(dev.alloc_queue_io_bufs());
    let queue = match UblkQueue::new(qid, dev)
        .and_then(|q| q.submit_fetch_commands_unified(BufDescList::Slices(Some(&bufs))))
    {
        Ok(q) => q,
        Err(e) => {
            tracing::error!("ublk queue {qid}: cannot start: {e}");
            return;
        }
    };
    let handler = {
        let bufs = Rc::clone(&bufs);
        move |q: &UblkQueue, tag: u16, _: &UblkIOCtx| {
            let buf = &bufs[usize::from(tag)];
            // SAFETY: the buffer is this tag's alone and lives as long as
            // `bufs`; between the fetch that handed this request over and
            // its commit below, neither the kernel nor another request
            // touches it, so this is the only reference to its bytes.
            let bytes = unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr(), buf.len()) };
            let res = {
                let _pass = gate.enter();
                serve(&**device, q.get_iod(tag), bytes)
            };
            if let Err(e) = q.complete_io_cmd_unified(tag, BufDesc::Slice(buf.as_slice()), Ok(UblkIORes::Result(res))) {
                tracing::warn!("ublk queue {qid} tag {tag}: commit failed: {e}");
            }
            // Commit now, not after the whole batch this wake-up reaped:
            // a burst of swap writes (64 MiB at once, the queue's depth)
            // would otherwise end its writeback only when the last of them
            // is stored, and a memory cgroup waiting on that writeback
            // runs out of retries and OOM-kills (seen in a Debian 13 guest).
            if let Err(e) = libublk::io::with_task_io_ring_mut(|ring| ring.submit()) {
                tracing::warn!("ublk queue {qid}: submitting a commit failed: {e}");
            }
        }
    };
    queue.wait_and_handle_io(handler);
}

/// Serves one request from `device` with `buf` as its data; returns the
/// bytes done, or a negative errno.
pub(crate) fn serve(device: &dyn BlockDevice, iod: &ublksrv_io_desc, buf: &mut [u8]) -> i32 {
    let offset = iod.start_sector << 9;
    let len = (iod.nr_sectors as usize) << 9;
    let Ok(done) = i32::try_from(len) else { return -libc::EINVAL };
    let result = match iod.op_flags & 0xff {
        sys::UBLK_IO_OP_READ | sys::UBLK_IO_OP_WRITE if len > buf.len() => return -libc::EINVAL,
        sys::UBLK_IO_OP_READ => device.read_at(&mut buf[..len], offset),
        sys::UBLK_IO_OP_WRITE => device.write_at(&buf[..len], offset),
        sys::UBLK_IO_OP_FLUSH => device.flush(),
        sys::UBLK_IO_OP_DISCARD => device.trim(offset, len as u64),
        sys::UBLK_IO_OP_WRITE_ZEROES => device.write_zeroes(offset, len as u64),
        _ => return -libc::EOPNOTSUPP,
    };
    match result {
        Ok(()) => done,
        Err(e) => -e.errno(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tmem_block::{BlockError, Extent};

    /// A device that records what it was asked, over 1 MiB of RAM.
    #[derive(Default)]
    struct Recorder {
        bytes: std::sync::Mutex<Vec<u8>>,
        asked: std::sync::Mutex<Vec<String>>,
    }

    impl BlockDevice for Recorder {
        fn size(&self) -> u64 {
            1 << 20
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), BlockError> {
            let b = self.bytes.lock().unwrap();
            let at = usize::try_from(offset).unwrap();
            buf.copy_from_slice(&b[at..at + buf.len()]);
            Ok(())
        }
        fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), BlockError> {
            let mut b = self.bytes.lock().unwrap();
            if b.is_empty() {
                b.resize(1 << 20, 0);
            }
            let at = usize::try_from(offset).unwrap();
            b[at..at + buf.len()].copy_from_slice(buf);
            Ok(())
        }
        fn flush(&self) -> Result<(), BlockError> {
            self.asked.lock().unwrap().push("flush".into());
            Ok(())
        }
        fn trim(&self, offset: u64, len: u64) -> Result<(), BlockError> {
            self.asked.lock().unwrap().push(format!("trim {offset}+{len}"));
            Ok(())
        }
        fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), BlockError> {
            Err(BlockError::OutOfRange { offset, len, size: 0 })
        }
        fn extents(&self, _: u64, _: u64) -> Result<Vec<Extent>, BlockError> {
            Ok(Vec::new())
        }
    }

    fn iod(op: u32, sector: u64, sectors: u32) -> ublksrv_io_desc {
        ublksrv_io_desc { op_flags: op, nr_sectors: sectors, start_sector: sector, ..Default::default() }
    }

    #[test]
    fn each_operation_reaches_the_device_and_answers_its_length_or_errno() {
        let dev = Recorder::default();
        let mut buf = vec![0u8; 64 << 10];
        buf[..8192].fill(0xa5);
        assert_eq!(serve(&dev, &iod(sys::UBLK_IO_OP_WRITE, 8, 16), &mut buf), 8192);
        buf.fill(0);
        assert_eq!(serve(&dev, &iod(sys::UBLK_IO_OP_READ, 8, 16), &mut buf), 8192);
        assert!(buf[..8192].iter().all(|b| *b == 0xa5) && buf[8192] == 0);
        assert_eq!(serve(&dev, &iod(sys::UBLK_IO_OP_FLUSH, 0, 0), &mut buf), 0);
        assert_eq!(serve(&dev, &iod(sys::UBLK_IO_OP_DISCARD, 16, 8), &mut buf), 4096);
        assert_eq!(*dev.asked.lock().unwrap(), ["flush", "trim 8192+4096"]);
        // The device's error becomes its errno.
        assert_eq!(serve(&dev, &iod(sys::UBLK_IO_OP_WRITE_ZEROES, 0, 8), &mut buf), -libc::EINVAL);
        assert_eq!(serve(&dev, &iod(sys::UBLK_IO_OP_ZONE_OPEN, 0, 8), &mut buf), -libc::EOPNOTSUPP);
    }

    #[test]
    fn a_request_longer_than_its_buffer_is_refused() {
        let dev = Recorder::default();
        let mut buf = vec![0u8; 4096];
        assert_eq!(serve(&dev, &iod(sys::UBLK_IO_OP_WRITE, 0, 16), &mut buf), -libc::EINVAL);
        assert_eq!(serve(&dev, &iod(sys::UBLK_IO_OP_READ, 0, 16), &mut buf), -libc::EINVAL);
    }
}
