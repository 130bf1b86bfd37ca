//! The write path: puts append records to the open segment in memory;
//! whoever holds the writer lock writes sealed segments out, retries failed
//! writes, and discards freed segments.

use super::*;

impl DiskTier {
    /// Runs queued disk work. Without `block`, returns at once if another
    /// thread is the writer: it re-checks for work after unlocking.
    pub(crate) fn pump(&self, block: bool) {
        let mut block = block;
        loop {
            let mut w = if block {
                self.writer.lock()
            } else {
                match self.writer.try_lock() {
                    Some(w) => w,
                    None => return,
                }
            };
            self.pump_locked(&mut w, block);
            drop(w);
            if !self.work_hint.load(Ordering::SeqCst) {
                return;
            }
            block = false;
        }
    }

    /// With the writer lock held: discards, then segment writes, in queue
    /// order, until none is left. `retry_failed` requeues failed writes first.
    pub(crate) fn pump_locked(&self, _writer: &mut Writer, retry_failed: bool) {
        let mut st = self.lock();
        if retry_failed && !st.failed.is_empty() {
            let failed = std::mem::take(&mut st.failed);
            for item in failed.into_iter().rev() {
                st.queue.push_front(item);
            }
            self.failed_writes.store(0, Ordering::SeqCst);
        }
        loop {
            if !st.discards.is_empty() {
                let segs = std::mem::take(&mut st.discards);
                drop(st);
                for &seg in &segs {
                    self.discard(seg);
                }
                st = self.lock();
                for seg in segs {
                    st.segs[us(seg)].state = SegState::Free;
                    st.free.push(seg);
                    st.discarding -= 1;
                }
                continue;
            }
            let Some(item) = st.queue.pop_front() else {
                self.work_hint.store(false, Ordering::SeqCst);
                return;
            };
            if st.segs[us(item.seg)].live == 0 {
                st.finish_write(item, &self.gens); // nothing live: no need to write it
                continue;
            }
            drop(st);
            let at = self.seg_off(item.seg) + u64::from(item.start);
            let res = self.write_at(&item.buf[us(item.start)..us(item.end)], at);
            st = self.lock();
            match res {
                Ok(()) => {
                    add(&self.counters.wire_out, u64::from(item.end - item.start));
                    add(&self.counters.segment_writes, 1);
                    st.finish_write(item, &self.gens);
                    if st.failed.is_empty() {
                        self.io_ok();
                    }
                }
                Err(e) => {
                    add(&self.counters.failures, 1);
                    self.io_failed("segment write", &e);
                    st.failed.push(item);
                    self.failed_writes.store(st.failed.len(), Ordering::SeqCst);
                }
            }
        }
    }

    /// Writes segment data (aligned buffer, offset and length).
    pub(crate) fn write_at(&self, buf: &[u8], at: u64) -> io::Result<()> {
        #[cfg(test)]
        if self.fail_writes.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        self.file.write_all_at(buf, at)
    }

    pub(crate) fn discard(&self, seg: u32) {
        if !self.discard_ok.load(Ordering::Relaxed) {
            return;
        }
        let (off, len) = (self.seg_off(seg), u64::from(self.seg_bytes));
        let r =
            if self.block { sys::block_discard(&self.file, off, len) } else { sys::punch_hole(&self.file, off, len) };
        match r {
            Ok(()) => add(&self.counters.discards, 1),
            // Unsupported here: stop trying. Other errors: best effort, the space is reused anyway.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP | libc::ENOTTY | libc::EINVAL)) => {
                self.discard_ok.store(false, Ordering::Relaxed);
            }
            Err(_) => {}
        }
    }

    pub(crate) fn put_inner(&self, key: TierKey, value: &[u8]) -> Result<TierPut, TierError> {
        check_len(value)?;
        let rec = RECORD_HEADER + u32::try_from(value.len()).expect("checked against MAX_VALUE");
        let (mut gc_rounds, mut buffer_waits) = (0, 0);
        let mut waited_discards = false;
        loop {
            let mut st = self.lock();
            match st.make_room(rec, false, &self.gens) {
                Room::Ready => {
                    st.append(key, value, &self.gens);
                    self.settle(st);
                    return Ok(TierPut::Stored);
                }
                Room::NoBuffer => {
                    // Every buffer waits for its write: do (or wait for) the writes.
                    let failing = !st.failed.is_empty();
                    self.release(st);
                    if buffer_waits >= MAX_BUFFER_WAITS || (failing && buffer_waits > 0) {
                        return Err(TierError::Unavailable {
                            tier: NAME.into(),
                            reason: format!("segment writes failing: {}", self.io_error_text()),
                        });
                    }
                    buffer_waits += 1;
                    self.pump(true);
                }
                Room::NoSegment if st.discarding > 0 && !waited_discards => {
                    // Freed segments are on their way to the free list.
                    waited_discards = true;
                    self.release(st);
                    self.pump(true);
                }
                Room::NoSegment => {
                    self.release(st);
                    waited_discards = false;
                    if gc_rounds >= MAX_GC_ROUNDS || !self.gc_once()? {
                        // Full. An older value under the key is superseded either way: drop it.
                        let mut st = self.lock();
                        if let Some(old) = st.index.remove(&key) {
                            st.kill(old, &self.gens);
                        }
                        self.settle(st);
                        return Ok(TierPut::Full);
                    }
                    gc_rounds += 1;
                }
            }
        }
    }
}
