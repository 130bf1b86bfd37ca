//! The read path: single and batched gets, lock-free `pread`s of sealed
//! segments retried when a segment is freed under them, and reads of
//! values still in memory.

use std::cell::RefCell;

use super::*;

thread_local! {
    /// Each reading thread's aligned buffer for `O_DIRECT` reads, grown to
    /// the largest read it has made (a merged read at most): a get reads
    /// into it and allocates nothing.
    static READ_BUF: RefCell<Option<AlignedBuf>> = const { RefCell::new(None) };
}

impl DiskTier {
    /// Fills `buf` from the file at `at`, counting the read and its bytes.
    fn read_file(&self, buf: &mut [u8], at: u64) -> io::Result<()> {
        self.file.read_exact_at(buf, at)?;
        add(&self.counters.file_reads, 1);
        add(&self.counters.wire_in, buf.len() as u64);
        Ok(())
    }

    /// Reads a value of a sealed segment from disk into `out`.
    pub(crate) fn pread_value(&self, loc: Loc, out: &mut Vec<u8>) -> io::Result<()> {
        if loc.len == 0 {
            return Ok(());
        }
        let (at, start, end) = self.value_span(loc);
        let len = us(loc.len);
        if !self.direct {
            out.resize(len, 0);
            return self.read_file(out, at);
        }
        let skip = usize::try_from(at - start).expect("within a page");
        self.pread_span(start, end, |buf| out.extend_from_slice(&buf[skip..skip + len]))
    }

    /// File offset of the value at `loc`, and the page-aligned range that covers it.
    pub(crate) fn value_span(&self, loc: Loc) -> (u64, u64, u64) {
        let page = u64::from(PAGE);
        let at = self.seg_off(loc.seg) + u64::from(loc.off + RECORD_HEADER);
        (at, at - at % page, (at + u64::from(loc.len)).div_ceil(page) * page)
    }

    /// Reads the page-aligned range `[start, end)` of the file into this
    /// thread's read buffer and hands it to `f`.
    pub(crate) fn pread_span<T>(&self, start: u64, end: u64, f: impl FnOnce(&[u8]) -> T) -> io::Result<T> {
        let len = usize::try_from(end - start).expect("a merged read is small");
        let read = |buf: &mut [u8]| {
            let buf = &mut buf[..len];
            self.read_file(buf, start)?;
            Ok(f(buf))
        };
        READ_BUF.with(|cell| match cell.try_borrow_mut() {
            Ok(mut slot) => {
                if slot.as_ref().is_none_or(|b| b.len() < len) {
                    *slot = Some(AlignedBuf::zeroed(len));
                }
                read(slot.as_mut().expect("set above"))
            }
            // Only a read made from inside another's `f`: a buffer of its own.
            Err(_) => read(&mut AlignedBuf::zeroed(len)),
        })
    }

    /// Batched gets: values of sealed segments that lie close together on
    /// disk (written back together, as swap readahead reads them back) are
    /// read with one `pread`. A value whose segment was freed while we read
    /// is fetched again on its own, like a single get.
    pub(crate) fn get_batch_inner(&self, keys: &[TierKey]) -> Vec<Result<Option<Vec<u8>>, TierError>> {
        let mut out: Vec<Option<Result<Option<Vec<u8>>, TierError>>> = keys.iter().map(|_| None).collect();
        let mut on_disk: Vec<(usize, Loc, u64)> = Vec::new();
        {
            let st = self.lock();
            for (i, k) in keys.iter().enumerate() {
                let Some(loc) = st.index.get(k).copied() else {
                    out[i] = Some(Ok(None));
                    continue;
                };
                if loc.len == 0 {
                    out[i] = Some(Ok(Some(Vec::new())));
                } else if let Some(mem) = st.mem(loc.seg) {
                    let at = us(loc.off + RECORD_HEADER);
                    out[i] = Some(Ok(Some(mem[at..at + us(loc.len)].to_vec())));
                } else {
                    let gen = self.gens[us(loc.seg)].load(Ordering::SeqCst);
                    let mut v = Vec::new();
                    if st.around.copy(loc.seg, self.value_span(loc).0, us(loc.len), gen, &mut v) {
                        add(&self.counters.around_hits, 1);
                        out[i] = Some(Ok(Some(v)));
                    } else {
                        on_disk.push((i, loc, gen));
                    }
                }
            }
        }
        on_disk.sort_unstable_by_key(|&(_, loc, _)| (loc.seg, loc.off));
        let page = u64::from(PAGE);
        let mut retry = Vec::new();
        let mut g = 0;
        while g < on_disk.len() {
            // A run: same segment, each value starting within a page of the
            // last one's end, at most MERGED_READ bytes in all.
            let (_, first, _) = on_disk[g];
            let (_, start, mut end) = self.value_span(first);
            let mut h = g + 1;
            while h < on_disk.len() {
                let (_, loc, _) = on_disk[h];
                let (_, s, e) = self.value_span(loc);
                if loc.seg != first.seg || s > end + page || e - start > MERGED_READ {
                    break;
                }
                end = end.max(e);
                h += 1;
            }
            let read = self.pread_span(start, end, |buf| {
                for &(i, loc, gen) in &on_disk[g..h] {
                    if self.gens[us(loc.seg)].load(Ordering::SeqCst) != gen {
                        add(&self.counters.read_retries, 1);
                        retry.push(i);
                        continue;
                    }
                    let (at, _, _) = self.value_span(loc);
                    let skip = usize::try_from(at - start).expect("within the read");
                    out[i] = Some(Ok(Some(buf[skip..skip + us(loc.len)].to_vec())));
                }
            });
            match read {
                Ok(()) => self.io_ok(),
                Err(e) => {
                    self.io_failed("read", &e);
                    for &(i, _, _) in &on_disk[g..h] {
                        out[i] = Some(Err(io_err(io::Error::new(e.kind(), e.to_string()))));
                    }
                }
            }
            g = h;
        }
        for i in retry {
            let mut v = Vec::new();
            out[i] = Some(match self.get_inner(keys[i], &mut v) {
                Ok(TierGet::Hit) => Ok(Some(v)),
                Ok(TierGet::Miss) => Ok(None),
                Err(e) => Err(e),
            });
        }
        out.into_iter().map(|r| r.unwrap_or(Ok(None))).collect()
    }

    pub(crate) fn get_inner(&self, key: TierKey, out: &mut Vec<u8>) -> Result<TierGet, TierError> {
        let mut attempt = 0;
        loop {
            let mut st = self.lock();
            let Some(loc) = st.index.get(&key).copied() else { return Ok(TierGet::Miss) };
            if loc.len == 0 {
                return Ok(TierGet::Hit);
            }
            if let Some(mem) = st.mem(loc.seg) {
                let at = us(loc.off + RECORD_HEADER);
                out.extend_from_slice(&mem[at..at + us(loc.len)]);
                return Ok(TierGet::Hit);
            }
            debug_assert_eq!(st.segs[us(loc.seg)].state, SegState::Sealed);
            let gen = self.gens[us(loc.seg)].load(Ordering::SeqCst);
            if st.around.copy(loc.seg, self.value_span(loc).0, us(loc.len), gen, out) {
                add(&self.counters.around_hits, 1);
                return Ok(TierGet::Hit);
            }
            if attempt >= OPTIMISTIC_READS {
                // Under the lock the segment cannot be freed.
                let r = self.pread_value(loc, out);
                drop(st);
                return self.read_done(r).map(|()| TierGet::Hit);
            }
            let span = st.around.take();
            drop(st);
            let r = match span {
                Some(mut span) => {
                    let r = self.read_around(loc, gen, &mut span, out);
                    self.lock().around.put(span);
                    r
                }
                None => self.pread_value(loc, out),
            };
            if self.gens[us(loc.seg)].load(Ordering::SeqCst) == gen {
                return self.read_done(r).map(|()| TierGet::Hit);
            }
            // Freed (and maybe reused) while we read: the value moved or is gone.
            out.clear();
            add(&self.counters.read_retries, 1);
            attempt += 1;
        }
    }

    /// Reads the [`around::AROUND_BYTES`] from the page of the value at
    /// `loc` (the value's own pages at least, the segment's end at most)
    /// into `span`, and copies the value into `out`. The span holds the
    /// read for generation `gen`, which the caller checks after it.
    fn read_around(&self, loc: Loc, gen: u64, span: &mut around::Span, out: &mut Vec<u8>) -> io::Result<()> {
        let (at, start, end) = self.value_span(loc);
        let seg_end = self.seg_off(loc.seg) + u64::from(self.seg_bytes);
        let stop = end.max((start + around::AROUND_BYTES as u64).min(seg_end));
        let len = usize::try_from(stop - start).expect("a span is small");
        span.set(loc.seg, start, 0, gen);
        let buf = span.buf(len);
        self.read_file(buf, start)?;
        let skip = usize::try_from(at - start).expect("within a page");
        out.extend_from_slice(&buf[skip..skip + us(loc.len)]);
        span.set(loc.seg, start, len, gen);
        Ok(())
    }

    pub(crate) fn read_done(&self, r: io::Result<()>) -> Result<(), TierError> {
        match r {
            Ok(()) => {
                self.io_ok();
                Ok(())
            }
            Err(e) => {
                self.io_failed("read", &e);
                Err(io_err(e))
            }
        }
    }
}
