//! Garbage collection: picks the segment with the most dead bytes and
//! moves its live records to the open segment, which frees it.

use super::*;

impl DiskTier {
    /// Collects one victim segment: moves its live records to the open
    /// segment, which frees it. Returns whether room was made (or already there).
    pub(crate) fn gc_once(&self) -> Result<bool, TierError> {
        let mut gc = self.gc.lock();
        let (victim, used, gen) = {
            let st = self.lock();
            if st.free.len() > RESERVE_SEGMENTS || st.discarding > 0 {
                return Ok(true); // another put's GC or a remove made room meanwhile
            }
            let Some(v) = st.victim(self.min_gain) else { return Ok(false) };
            (v, st.segs[us(v)].used, self.gens[us(v)].load(Ordering::SeqCst))
        };
        let buf = gc.buf.get_or_insert_with(|| AlignedBuf::zeroed(us(self.seg_bytes)));
        let end = align_up(used);
        if let Err(e) = self.file.read_exact_at(&mut buf[..us(end)], self.seg_off(victim)) {
            add(&self.counters.failures, 1);
            self.io_failed("gc read", &e);
            return Err(io_err(e));
        }
        add(&self.counters.wire_in, u64::from(end));
        add(&self.counters.gc_runs, 1);

        // The records, from their headers; a header that makes no sense
        // (the file was altered) ends the walk and the index is searched instead.
        let mut candidates = Vec::new();
        let mut off = 0;
        let mut intact = true;
        while off + RECORD_HEADER <= used {
            let (key, len) = decode_header(&buf[us(off)..us(off + RECORD_HEADER)]);
            if len > MAX_VALUE_U32 || off + RECORD_HEADER + len > used {
                intact = false;
                break;
            }
            candidates.push((key, Loc { seg: victim, off, len }));
            off += RECORD_HEADER + len;
        }
        intact &= off == used;

        let mut st = self.lock();
        if !intact && self.gens[us(victim)].load(Ordering::SeqCst) == gen {
            candidates.extend(st.index.iter().filter(|(_, l)| l.seg == victim).map(|(k, l)| (*k, *l)));
        }
        let (mut moved, mut moved_bytes, mut buffer_waits) = (0, 0, 0);
        let mut i = 0;
        while i < candidates.len() {
            if self.gens[us(victim)].load(Ordering::SeqCst) != gen {
                break; // freed: by us when its last live record moved, or by removes
            }
            let (key, loc) = candidates[i];
            if st.index.get(&key) != Some(&loc) {
                i += 1;
                continue; // dead
            }
            match st.make_room(loc.rec(), true, &self.gens) {
                Room::Ready => {
                    let at = us(loc.off + RECORD_HEADER);
                    st.append(key, &buf[at..at + us(loc.len)], &self.gens);
                    moved += 1;
                    moved_bytes += u64::from(loc.len);
                    i += 1;
                }
                Room::NoBuffer if buffer_waits < MAX_BUFFER_WAITS => {
                    buffer_waits += 1;
                    self.release(st);
                    self.pump(true);
                    st = self.lock();
                }
                Room::NoBuffer | Room::NoSegment => break,
            }
        }
        let freed = self.gens[us(victim)].load(Ordering::SeqCst) != gen;
        self.settle(st);
        add(&self.counters.gc_moved_values, moved);
        add(&self.counters.gc_moved_bytes, moved_bytes);
        Ok(freed)
    }
}
