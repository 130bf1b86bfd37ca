//! Hand-over to a successor process: [`Tier::hand_over`] finishes every
//! write and describes the tier; [`DiskTier::adopt`] checks the description
//! against itself and the file and serves from it.
//!
//! The state, little endian, then a CRC-32 of everything before it:
//! magic `tmemdisk`, version (u32); segment size, segment count (u32),
//! flags (u8: block device, `O_DIRECT`, fallback, discard works), path
//! (u32 length, bytes); per segment: state (u8: 0 free, 1 open, 2 sealed),
//! used and live bytes (u32), generation (u64); the open segment and its
//! write offset (u32 each, `u32::MAX` for none); the free list (u32 count,
//! u32 each); the index (u64 count; pool u32, object u64, index u64,
//! segment, offset, length u32 each); the counters (u32 count, u64 each).

use std::ffi::OsStr;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

use rustix::fs::OFlags;
use tmem_tier::TierHandover;

use super::*;
use stats::COUNTERS;

const MAGIC: [u8; 8] = *b"tmemdisk";
const VERSION: u32 = 1;
/// No open segment.
const NONE: u32 = u32::MAX;
/// State bytes per segment and per index entry.
const SEG_ENTRY: usize = 17;
const INDEX_ENTRY: usize = 32;
const BLOCK: u8 = 1;
const DIRECT: u8 = 2;
const FALLBACK: u8 = 4;
const DISCARD: u8 = 8;

fn bad(why: impl std::fmt::Display) -> TierError {
    config_err(format!("hand-over state: {why}"))
}

struct Enc(Vec<u8>);

impl Enc {
    fn u8(&mut self, x: u8) {
        self.0.push(x);
    }
    fn u32(&mut self, x: u32) {
        self.0.extend_from_slice(&x.to_le_bytes());
    }
    fn u64(&mut self, x: u64) {
        self.0.extend_from_slice(&x.to_le_bytes());
    }
}

struct Dec<'a>(&'a [u8]);

impl<'a> Dec<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], TierError> {
        if self.0.len() < n {
            return Err(bad(format!("truncated in {what}")));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u8(&mut self, what: &str) -> Result<u8, TierError> {
        Ok(self.take(1, what)?[0])
    }
    fn u32(&mut self, what: &str) -> Result<u32, TierError> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self, what: &str) -> Result<u64, TierError> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().expect("8 bytes")))
    }
    /// `n` items of `each` bytes, if what is left holds them (checked before allocating).
    fn fits(&self, n: u64, each: usize, what: &str) -> Result<usize, TierError> {
        usize::try_from(n)
            .ok()
            .filter(|&n| n.checked_mul(each).is_some_and(|b| b <= self.0.len()))
            .ok_or_else(|| bad(format!("{n} {what} overrun the state")))
    }
}

/// A decoded state, consistent in itself; not yet checked against the file.
struct Handed {
    path: PathBuf,
    flags: u8,
    state: State,
    open: Option<u32>,
    gens: Vec<u64>,
    counters: Vec<u64>,
}

impl DiskTier {
    pub(crate) fn hand_over_inner(&self) -> Result<TierHandover, TierError> {
        let _gc = self.gc.lock();
        let mut w = self.writer.lock();
        self.flush_locked(&mut w)?;
        let st = self.lock();
        if !st.failed.is_empty() {
            return Err(TierError::Unavailable {
                tier: NAME.into(),
                reason: format!("{} segment writes failing: {}", st.failed.len(), self.io_error_text()),
            });
        }
        let state = self.encode(&st)?;
        drop(st);
        drop(w);
        let fd = self.file.as_fd().try_clone_to_owned().map_err(io_err)?;
        Ok(TierHandover { kind: NAME.into(), state, fds: vec![fd] })
    }

    /// The state (writer and state locks held, every write done).
    fn encode(&self, st: &State) -> Result<Vec<u8>, TierError> {
        let busy = || config_err("cannot hand over: writes in flight (puts or removes during the hand-over)");
        let open = st.open.as_ref().map(|o| (o.seg, o.flushed));
        if st.has_work() || !st.inflight.is_empty() || open.is_some_and(|(s, f)| f < st.segs[us(s)].used) {
            return Err(busy());
        }
        let path = self.path.as_os_str().as_bytes();
        let size = 40 + path.len() + st.segs.len() * SEG_ENTRY + st.free.len() * 4 + st.index.len() * INDEX_ENTRY;
        let mut e = Enc(Vec::with_capacity(size + COUNTERS * 8));
        e.0.extend_from_slice(&MAGIC);
        e.u32(VERSION);
        e.u32(self.seg_bytes);
        e.u32(self.nsegs);
        let flag = |on: bool, f: u8| if on { f } else { 0 };
        e.u8(flag(self.block, BLOCK)
            | flag(self.direct, DIRECT)
            | flag(self.fallback, FALLBACK)
            | flag(self.discard_ok.load(Ordering::Relaxed), DISCARD));
        e.u32(u32::try_from(path.len()).expect("a path is short"));
        e.0.extend_from_slice(path);
        for (m, gen) in st.segs.iter().zip(self.gens.iter()) {
            e.u8(match m.state {
                SegState::Free => 0,
                SegState::Open => 1,
                SegState::Sealed => 2,
                SegState::Writing | SegState::Discarding => return Err(busy()),
            });
            e.u32(m.used);
            e.u32(m.live);
            e.u64(gen.load(Ordering::SeqCst));
        }
        let (open, used) = open.map_or((NONE, 0), |(s, _)| (s, st.segs[us(s)].used));
        e.u32(open);
        e.u32(used);
        e.u32(u32::try_from(st.free.len()).expect("at most one per segment"));
        for &f in &st.free {
            e.u32(f);
        }
        e.u64(st.index.len() as u64);
        for (k, l) in &st.index {
            e.u32(k.pool);
            e.u64(k.object);
            e.u64(k.index);
            e.u32(l.seg);
            e.u32(l.off);
            e.u32(l.len);
        }
        e.u32(u32::try_from(COUNTERS).expect("a few counters"));
        for c in self.counters.all() {
            e.u64(get(c));
        }
        let crc = crc32fast::hash(&e.0);
        e.u32(crc);
        Ok(e.0)
    }

    /// The successor's tier, from a predecessor's [`Tier::hand_over`]: the
    /// state, checked in itself and against the file, and the file's
    /// descriptor (`h.fds[0]`). Nothing in the file is changed (the open
    /// segment is read back). The tier does not own the file (its drop
    /// leaves it) until [`Tier::set_owner`]`(true)`.
    pub fn adopt(h: TierHandover) -> Result<Self, TierError> {
        if h.kind != NAME {
            return Err(bad(format!("the state of a {:?} tier", h.kind)));
        }
        let n = h.fds.len();
        let [fd] = <[OwnedFd; 1]>::try_from(h.fds).map_err(|_| bad(format!("{n} descriptors, not 1")))?;
        let Handed { path, flags, mut state, open, gens, counters } = decode(&h.state)?;
        let file = File::from(fd);
        let wrong = |why: String| config_err(format!("{}: handed-over descriptor: {why}", path.display()));
        let (block, direct) = (flags & BLOCK != 0, flags & DIRECT != 0);
        let meta = file.metadata().map_err(io_err)?;
        let size = match (block, meta.file_type().is_block_device()) {
            (true, true) => sys::block_device_size(&file).map_err(io_err)?,
            (false, false) if meta.is_file() => meta.len(),
            _ => return Err(wrong(format!("not a {}", if block { "block device" } else { "regular file" }))),
        };
        let s = state.seg_bytes;
        let need = state.segs.len() as u64 * u64::from(s);
        if size < need {
            return Err(wrong(format!("{size} bytes; the state's segments need {need}")));
        }
        let fl = rustix::fs::fcntl_getfl(&file).map_err(|e| io_err(e.into()))?;
        if fl & OFlags::ACCMODE != OFlags::RDWR {
            return Err(wrong("not open for reading and writing".into()));
        }
        if fl.contains(OFlags::DIRECT) != direct {
            return Err(wrong(format!("O_DIRECT {}, the state says {direct}", fl.contains(OFlags::DIRECT))));
        }
        sys::lock_exclusive(&file).map_err(|e| match e.raw_os_error() {
            Some(libc::EWOULDBLOCK) => wrong("the file is in use by another disk tier".into()),
            _ => io_err(e),
        })?;
        if let Some(seg) = open {
            // Flushed by the hand-over: read it back, and check its records' headers.
            let used = state.segs[us(seg)].used;
            let mut buf = state.spares.pop().expect("spare buffers");
            file.read_exact_at(&mut buf[..us(align_up(used))], u64::from(seg) * u64::from(s)).map_err(io_err)?;
            for (k, l) in state.index.iter().filter(|(_, l)| l.seg == seg) {
                if decode_header(&buf[us(l.off)..us(l.off + RECORD_HEADER)]) != (*k, l.len) {
                    return Err(wrong(format!("the open segment {seg} does not hold {k:?} at {}", l.off)));
                }
            }
            state.epoch = 1;
            state.open = Some(Open { seg, buf, flushed: used, epoch: 1 });
        }
        let tier = Self::assemble(file, path, block, (direct, flags & FALLBACK != 0), state, flags & DISCARD != 0);
        tier.owner.store(false, Ordering::SeqCst);
        for (g, v) in tier.gens.iter().zip(gens) {
            g.store(v, Ordering::SeqCst);
        }
        for (c, v) in tier.counters.all().into_iter().zip(counters) {
            c.store(v, Ordering::Relaxed);
        }
        Ok(tier)
    }
}

fn decode(bytes: &[u8]) -> Result<Handed, TierError> {
    let Some((body, crc)) = bytes.split_last_chunk::<4>() else { return Err(bad("truncated")) };
    if crc32fast::hash(body) != u32::from_le_bytes(*crc) {
        return Err(bad("checksum mismatch (corrupt or truncated)"));
    }
    let mut d = Dec(body);
    if d.take(MAGIC.len(), "magic")? != MAGIC {
        return Err(bad("not a disk tier's state"));
    }
    match d.u32("version")? {
        VERSION => {}
        v => return Err(bad(format!("version {v}; this build reads {VERSION}"))),
    }
    let s = d.u32("segment size")?;
    if !valid_segment_bytes(s) {
        return Err(bad(format!("segment size {s}")));
    }
    let nsegs = d.u32("segment count")?;
    if u64::from(nsegs) < MIN_SEGMENTS {
        return Err(bad(format!("{nsegs} segments")));
    }
    let flags = d.u8("flags")?;
    if flags & !(BLOCK | DIRECT | FALLBACK | DISCARD) != 0 {
        return Err(bad(format!("flags {flags:#x}")));
    }
    let len = d.u32("path")?;
    let path = PathBuf::from(OsStr::from_bytes(d.take(us(len), "path")?));

    let n = d.fits(u64::from(nsegs), SEG_ENTRY, "segments")?;
    let (mut segs, mut gens) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let mut open = None;
    for i in 0..nsegs {
        let state = match d.u8("segments")? {
            0 => SegState::Free,
            1 => SegState::Open,
            2 => SegState::Sealed,
            c => return Err(bad(format!("segment {i}: state {c}"))),
        };
        let (used, live) = (d.u32("segments")?, d.u32("segments")?);
        let ok = match state {
            SegState::Free => used == 0 && live == 0,
            SegState::Open => live <= used && used <= s,
            _ => 0 < live && live <= used && used <= s,
        };
        if !ok {
            return Err(bad(format!("segment {i}: {state:?} with {used} bytes used, {live} live")));
        }
        if state == SegState::Open && open.replace(i).is_some() {
            return Err(bad("two open segments"));
        }
        segs.push(Seg { state, used, live });
        gens.push(d.u64("segments")?);
    }
    let (at, used) = (d.u32("open segment")?, d.u32("open segment")?);
    if open.map_or((NONE, 0), |o| (o, segs[us(o)].used)) != (at, used) {
        return Err(bad(format!("open segment {at} at {used} disagrees with the segment table")));
    }

    let n = d.u32("free list")?;
    let mut free = Vec::with_capacity(d.fits(n.into(), 4, "free segments")?);
    let mut listed = vec![false; us(nsegs)];
    for _ in 0..n {
        let f = d.u32("free list")?;
        if segs.get(us(f)).is_none_or(|m| m.state != SegState::Free) || std::mem::replace(&mut listed[us(f)], true) {
            return Err(bad(format!("free list: segment {f} is not free or listed twice")));
        }
        free.push(f);
    }
    if free.len() != segs.iter().filter(|m| m.state == SegState::Free).count() {
        return Err(bad("free segments missing from the free list"));
    }

    let n = d.u64("index")?;
    let n = d.fits(n, INDEX_ENTRY, "index entries")?;
    let mut index = HashMap::with_capacity(n);
    let mut recs = Vec::with_capacity(n);
    let (mut live, mut value_bytes) = (vec![0u64; segs.len()], 0);
    for _ in 0..n {
        let key = TierKey { pool: d.u32("index")?, object: d.u64("index")?, index: d.u64("index")? };
        let loc = Loc { seg: d.u32("index")?, off: d.u32("index")?, len: d.u32("index")? };
        let m = segs.get(us(loc.seg)).filter(|m| m.state != SegState::Free);
        if m.is_none_or(|m| loc.len > MAX_VALUE_U32 || u64::from(loc.off) + u64::from(loc.rec()) > u64::from(m.used)) {
            return Err(bad(format!("{key:?} at {loc:?}: outside its segment's records")));
        }
        if index.insert(key, loc).is_some() {
            return Err(bad(format!("{key:?} listed twice")));
        }
        live[us(loc.seg)] += u64::from(loc.rec());
        value_bytes += u64::from(loc.len);
        recs.push((loc.seg, loc.off, loc.rec()));
    }
    if let Some(i) = (0..segs.len()).find(|&i| live[i] != u64::from(segs[i].live)) {
        return Err(bad(format!("segment {i}: {} live bytes, its records {}", segs[i].live, live[i])));
    }
    recs.sort_unstable();
    if let Some(w) = recs.windows(2).find(|w| w[0].0 == w[1].0 && w[0].1 + w[0].2 > w[1].1) {
        return Err(bad(format!("records overlap in segment {} at {}", w[1].0, w[1].1)));
    }

    // A predecessor built before the newest counters hands over fewer: those
    // start at zero.
    let n = us(d.u32("counters")?);
    if n > COUNTERS {
        return Err(bad(format!("{n} counters; this build knows {COUNTERS}")));
    }
    let mut counters = (0..n).map(|_| d.u64("counters")).collect::<Result<Vec<_>, _>>()?;
    counters.resize(COUNTERS, 0);
    if !d.0.is_empty() {
        return Err(bad(format!("{} trailing bytes", d.0.len())));
    }

    let mut state = State::new(s, nsegs);
    state.live_bytes = live.iter().sum();
    state.value_bytes = value_bytes;
    state.waste_bytes = segs.iter().filter(|m| m.state == SegState::Sealed).map(|m| u64::from(s - m.used)).sum();
    (state.segs, state.free, state.index) = (segs, free, index);
    Ok(Handed { path, flags, state, open, gens, counters })
}
