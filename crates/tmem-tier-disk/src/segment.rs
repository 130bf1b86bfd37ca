//! The segment log in memory: where each value lives (its index), the
//! state of every segment, the open segment being filled, and the
//! bookkeeping of live, dead and wasted bytes that garbage collection reads.

use super::*;

impl State {
    pub(crate) fn room_left(&self) -> u32 {
        self.open.as_ref().map_or(0, |o| self.seg_bytes - self.segs[us(o.seg)].used)
    }

    /// Makes the open segment able to take `rec` bytes, sealing a full one
    /// and opening a free one. Only the GC (`use_reserve`) may take the last
    /// [`RESERVE_SEGMENTS`] free segments.
    pub(crate) fn make_room(&mut self, rec: u32, use_reserve: bool, gens: &[AtomicU64]) -> Room {
        if self.open.is_some() && self.room_left() >= rec {
            return Room::Ready;
        }
        if let Some(o) = self.open.take() {
            self.seal(o, gens);
        }
        if self.free.len() <= if use_reserve { 0 } else { RESERVE_SEGMENTS } {
            return Room::NoSegment;
        }
        let Some(buf) = self.spares.pop() else { return Room::NoBuffer };
        let seg = self.free.pop().expect("free list checked");
        self.segs[us(seg)] = Seg { state: SegState::Open, used: 0, live: 0 };
        self.epoch += 1;
        self.open = Some(Open { seg, buf, flushed: 0, epoch: self.epoch });
        Room::Ready
    }

    /// Queues the open segment for writing (or frees it if nothing in it is live).
    pub(crate) fn seal(&mut self, mut o: Open, gens: &[AtomicU64]) {
        let m = &mut self.segs[us(o.seg)];
        m.state = SegState::Writing;
        let (used, live) = (m.used, m.live);
        self.waste_bytes += u64::from(self.seg_bytes - used);
        if live == 0 {
            self.spares.push(o.buf);
            self.free_seg(o.seg, gens);
            return;
        }
        let end = align_up(used);
        o.buf[us(used)..us(end)].fill(0);
        let buf = Arc::new(o.buf);
        self.inflight.push((o.seg, Arc::clone(&buf)));
        self.queue.push_back(WriteItem { seg: o.seg, buf, start: align_down(o.flushed), end });
    }

    /// A `Writing` or `Sealed` segment with nothing live goes to the discard
    /// list; its generation changes so in-flight lock-free reads retry.
    pub(crate) fn free_seg(&mut self, seg: u32, gens: &[AtomicU64]) {
        gens[us(seg)].fetch_add(1, Ordering::SeqCst);
        let m = &mut self.segs[us(seg)];
        debug_assert!(matches!(m.state, SegState::Writing | SegState::Sealed) && m.live == 0, "{m:?}");
        self.waste_bytes -= u64::from(self.seg_bytes - m.used);
        *m = Seg { state: SegState::Discarding, used: 0, live: 0 };
        self.discards.push(seg);
        self.discarding += 1;
    }

    /// Appends a record to the open segment (room made) and points the index at it.
    pub(crate) fn append(&mut self, key: TierKey, value: &[u8], gens: &[AtomicU64]) {
        let o = self.open.as_mut().expect("make_room opened a segment");
        let len = u32::try_from(value.len()).expect("checked against MAX_VALUE");
        let rec = RECORD_HEADER + len;
        let m = &mut self.segs[us(o.seg)];
        let off = m.used;
        let at = us(off);
        let hdr = us(RECORD_HEADER);
        o.buf[at..at + hdr].copy_from_slice(&encode_header(key, len));
        o.buf[at + hdr..at + hdr + value.len()].copy_from_slice(value);
        m.used += rec;
        m.live += rec;
        self.live_bytes += u64::from(rec);
        self.value_bytes += u64::from(len);
        if let Some(old) = self.index.insert(key, Loc { seg: o.seg, off, len }) {
            self.kill(old, gens);
        }
    }

    /// Marks a record dead (its key already unindexed or re-pointed).
    pub(crate) fn kill(&mut self, loc: Loc, gens: &[AtomicU64]) {
        let rec = loc.rec();
        self.live_bytes -= u64::from(rec);
        self.value_bytes -= u64::from(loc.len);
        let m = &mut self.segs[us(loc.seg)];
        m.live -= rec;
        if m.live > 0 {
            return;
        }
        match m.state {
            SegState::Sealed => self.free_seg(loc.seg, gens),
            SegState::Open => {
                // Nothing live in the open segment: start it over.
                m.used = 0;
                self.epoch += 1;
                let o = self.open.as_mut().expect("the Open segment is the open one");
                o.flushed = 0;
                o.epoch = self.epoch;
            }
            SegState::Writing => {} // freed when its write completes
            SegState::Free | SegState::Discarding => unreachable!("dead record in a free segment"),
        }
    }

    /// The in-memory bytes of an open or being-written segment.
    pub(crate) fn mem(&self, seg: u32) -> Option<&[u8]> {
        if let Some(o) = self.open.as_ref().filter(|o| o.seg == seg) {
            return Some(&o.buf);
        }
        self.inflight.iter().find(|(s, _)| *s == seg).map(|(_, b)| &b[..])
    }

    /// A segment write completed (or was skipped because nothing in it is live).
    pub(crate) fn finish_write(&mut self, item: WriteItem, gens: &[AtomicU64]) {
        self.inflight.retain(|(s, _)| *s != item.seg);
        let m = &mut self.segs[us(item.seg)];
        m.state = SegState::Sealed;
        if m.live == 0 {
            self.free_seg(item.seg, gens);
        }
        match Arc::try_unwrap(item.buf) {
            Ok(buf) => self.spares.push(buf),
            Err(_) => debug_assert!(false, "segment buffer still shared"),
        }
    }

    /// The sealed segment with the fewest live bytes that gives back at
    /// least `min_gain` bytes and whose live records fit where the GC can put them.
    pub(crate) fn victim(&self, min_gain: u32) -> Option<u32> {
        let room = self.room_left();
        let can_open = !self.free.is_empty();
        self.segs
            .iter()
            .zip(0u32..)
            .filter(|(m, _)| m.state == SegState::Sealed && self.seg_bytes - m.live >= min_gain)
            .filter(|(m, _)| can_open || m.live <= room)
            .min_by_key(|(m, _)| m.live)
            .map(|(_, i)| i)
    }

    pub(crate) fn has_work(&self) -> bool {
        !self.queue.is_empty() || !self.discards.is_empty()
    }
}
