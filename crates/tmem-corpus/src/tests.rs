use super::*;

fn meta(program: &str) -> CorpusMeta {
    CorpusMeta {
        program: program.to_string(),
        source: "unit test".to_string(),
        captured_unix: 1_700_000_000,
        kernel: "6.1.0-test".to_string(),
        pages: 0,
    }
}

/// `n` pages: page i is filled with a pattern derived from i.
fn corpus(n: usize) -> Corpus {
    let mut data = vec![0u8; n * PAGE_SIZE];
    for (i, page) in data.chunks_exact_mut(PAGE_SIZE).enumerate() {
        for (j, b) in page.iter_mut().enumerate() {
            *b = u8::try_from((i * 31 + j / 7) % 251).unwrap();
        }
    }
    Corpus::new(meta("python"), data).unwrap()
}

/// A plain file image with the given header fields, metadata and data.
fn image(version: u32, page_size: u32, page_count: u64, meta_json: &[u8], data: &[u8]) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(b"TMEMCORP");
    v.extend_from_slice(&version.to_le_bytes());
    v.extend_from_slice(&page_size.to_le_bytes());
    v.extend_from_slice(&page_count.to_le_bytes());
    v.extend_from_slice(&u32::try_from(meta_json.len()).unwrap().to_le_bytes());
    v.extend_from_slice(meta_json);
    v.extend_from_slice(data);
    v
}

fn meta_json(pages: u64) -> Vec<u8> {
    serde_json::to_vec(&CorpusMeta { pages, ..meta("cc") }).unwrap()
}

fn zstd(bytes: &[u8]) -> Vec<u8> {
    zstd::bulk::compress(bytes, 3).unwrap()
}

#[test]
fn round_trip_plain_and_compressed() {
    let c = corpus(5);
    assert_eq!(c.page_count(), 5);
    assert_eq!(c.meta.pages, 5);
    assert_eq!(c.data().len(), 5 * PAGE_SIZE);
    for compress in [false, true] {
        let bytes = c.to_bytes(compress);
        assert_eq!(bytes.starts_with(&ZSTD_MAGIC), compress);
        assert_eq!(bytes.starts_with(b"TMEMCORP"), !compress);
        let back = Corpus::from_bytes(&bytes).unwrap();
        assert_eq!(back, c);
    }
    let plain = c.to_bytes(false);
    assert_eq!(plain.len(), 28 + serde_json::to_vec(&c.meta).unwrap().len() + 5 * PAGE_SIZE);
    // Compressed by a foreign zstd level is also accepted.
    assert_eq!(Corpus::from_bytes(&zstd(&plain)).unwrap(), c);
    assert_eq!(Corpus::from_bytes(&c.to_bytes_with_level(1)).unwrap(), c);
}

#[test]
fn round_trip_empty() {
    let c = Corpus::new(meta("mix"), Vec::new()).unwrap();
    for compress in [false, true] {
        let back = Corpus::from_bytes(&c.to_bytes(compress)).unwrap();
        assert_eq!(back.page_count(), 0);
        assert_eq!(back.meta, c.meta);
    }
}

#[test]
fn header_layout_is_little_endian() {
    let c = corpus(2);
    let b = c.to_bytes(false);
    assert_eq!(&b[0..8], b"TMEMCORP");
    assert_eq!(&b[8..12], &[1, 0, 0, 0]);
    assert_eq!(&b[12..16], &[0, 0x10, 0, 0]);
    assert_eq!(&b[16..24], &[2, 0, 0, 0, 0, 0, 0, 0]);
    let meta_len = usize::try_from(u32::from_le_bytes(b[24..28].try_into().unwrap())).unwrap();
    let m: serde_json::Value = serde_json::from_slice(&b[28..28 + meta_len]).unwrap();
    assert_eq!(m["pages"], 2);
    assert_eq!(m["program"], "python");
    assert_eq!(&b[28 + meta_len..], c.data());
}

#[test]
fn file_round_trip_and_io_errors() {
    let dir = std::env::temp_dir().join(format!("tmem-corpus-test-{}", std::process::id()));
    fs::create_dir_all(&dir).unwrap();
    let c = corpus(3);
    for compress in [false, true] {
        let p = dir.join(format!("c{compress}.tcorp"));
        c.write(&p, compress).unwrap();
        assert_eq!(Corpus::read(&p).unwrap(), c);
    }
    let missing = dir.join("missing.tcorp");
    let e = Corpus::read(&missing).unwrap_err();
    assert!(matches!(e, CorpusError::Io { .. }), "{e}");
    assert!(e.to_string().contains("missing.tcorp"), "{e}");
    let bad = dir.join("bad.tcorp");
    fs::write(&bad, b"not a corpus at all, definitely").unwrap();
    let e = Corpus::read(&bad).unwrap_err();
    assert!(e.to_string().contains("bad.tcorp"), "{e}");
    assert!(matches!(e, CorpusError::InFile { ref source, .. } if matches!(**source, CorpusError::BadMagic { .. })));
    let e = c.write(&dir.join("no/such/dir/x.tcorp"), false).unwrap_err();
    assert!(e.to_string().contains("no/such/dir"), "{e}");
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn new_rejects_partial_pages() {
    let e = Corpus::new(meta("pid"), vec![0; 4097]).unwrap_err();
    assert!(matches!(e, CorpusError::NotPageAligned { len: 4097 }), "{e}");
    // meta.pages is corrected to the real count.
    let c = Corpus::new(CorpusMeta { pages: 99, ..meta("pid") }, vec![0; 8192]).unwrap();
    assert_eq!(c.meta.pages, 2);
}

#[test]
fn rejects_truncated() {
    let good = corpus(2).to_bytes(false);
    // Every strict prefix is rejected, as plain and as zstd.
    for len in [0, 1, 7, 8, 20, 27, 28, 40, good.len() - 4096, good.len() - 1] {
        let e = Corpus::from_bytes(&good[..len]).unwrap_err();
        assert!(matches!(e, CorpusError::Truncated { .. } | CorpusError::LengthMismatch { .. }), "len {len}: {e}");
        let e = Corpus::from_bytes(&zstd(&good[..len])).unwrap_err();
        assert!(matches!(e, CorpusError::Truncated { .. } | CorpusError::LengthMismatch { .. }), "zstd len {len}: {e}");
    }
    // A truncated zstd frame.
    let z = corpus(2).to_bytes(true);
    let e = Corpus::from_bytes(&z[..z.len() - 3]).unwrap_err();
    assert!(matches!(e, CorpusError::Zstd(_) | CorpusError::Truncated { .. }), "{e}");
}

#[test]
fn rejects_bad_magic() {
    let mut b = corpus(1).to_bytes(false);
    b[0] = b'X';
    let e = Corpus::from_bytes(&b).unwrap_err();
    assert!(matches!(e, CorpusError::BadMagic { .. }), "{e}");
    assert!(e.to_string().contains("magic"));
    let e = Corpus::from_bytes(&zstd(&b)).unwrap_err();
    assert!(matches!(e, CorpusError::BadMagic { .. }), "{e}");
}

#[test]
fn rejects_bad_version() {
    let b = image(2, 4096, 0, &meta_json(0), &[]);
    let e = Corpus::from_bytes(&b).unwrap_err();
    assert!(matches!(e, CorpusError::UnsupportedVersion { version: 2 }), "{e}");
    assert!(e.to_string().contains("version 2"));
}

#[test]
fn rejects_bad_page_size() {
    for ps in [0, 512, 8192, 65536] {
        let b = image(1, ps, 1, &meta_json(1), &vec![0; 4096]);
        let e = Corpus::from_bytes(&b).unwrap_err();
        assert!(matches!(e, CorpusError::BadPageSize { page_size } if page_size == ps), "{e}");
    }
}

#[test]
fn rejects_overflowing_counts() {
    for count in [u64::MAX, u64::MAX / 4096 + 1, 1 << 62] {
        let b = image(1, 4096, count, &meta_json(count), &[]);
        let e = Corpus::from_bytes(&b).unwrap_err();
        assert!(
            matches!(e, CorpusError::PageCountOverflow { .. } | CorpusError::LengthMismatch { .. }),
            "count {count}: {e}"
        );
        // In a zstd stream the count cannot be checked up front; it must
        // still fail cleanly without allocating the claimed size.
        let e = Corpus::from_bytes(&zstd(&b)).unwrap_err();
        assert!(
            matches!(e, CorpusError::PageCountOverflow { .. } | CorpusError::Truncated { .. }),
            "zstd count {count}: {e}"
        );
    }
}

#[test]
fn rejects_count_length_mismatch() {
    // Header claims 3 pages, 2 present.
    let b = image(1, 4096, 3, &meta_json(3), &vec![0; 2 * 4096]);
    let e = Corpus::from_bytes(&b).unwrap_err();
    assert!(matches!(e, CorpusError::LengthMismatch { page_count: 3, .. }), "{e}");
    // Header claims 1 page, 2 present (trailing data).
    let b = image(1, 4096, 1, &meta_json(1), &vec![0; 2 * 4096]);
    let e = Corpus::from_bytes(&b).unwrap_err();
    assert!(matches!(e, CorpusError::LengthMismatch { page_count: 1, .. }), "{e}");
    // As zstd, the frame's recorded content size catches it before reading;
    // a streamed frame (no content size) finds the trailing data.
    let e = Corpus::from_bytes(&zstd(&b)).unwrap_err();
    assert!(matches!(e, CorpusError::LengthMismatch { page_count: 1, .. }), "{e}");
    let mut streamed = zstd::stream::write::Encoder::new(Vec::new(), 1).unwrap();
    std::io::Write::write_all(&mut streamed, &b).unwrap();
    let e = Corpus::from_bytes(&streamed.finish().unwrap()).unwrap_err();
    assert!(matches!(e, CorpusError::TrailingData { extra: 4096 }), "{e}");
    // Partial trailing page.
    let b = image(1, 4096, 1, &meta_json(1), &vec![0; 4096 + 10]);
    assert!(Corpus::from_bytes(&b).is_err());
    assert!(Corpus::from_bytes(&zstd(&b)).is_err());
}

/// A zstd stream that records no size: the header of `claim` pages, its
/// metadata, then `pages` zero pages.
fn streamed(claim: u64, pages: u64) -> Vec<u8> {
    let mut z = zstd::stream::write::Encoder::new(Vec::new(), 1).unwrap();
    std::io::Write::write_all(&mut z, &image(1, 4096, claim, &meta_json(claim), &[])).unwrap();
    std::io::copy(&mut std::io::repeat(0).take(pages * 4096), &mut z).unwrap();
    let bytes = z.finish().unwrap();
    assert!(matches!(zstd::zstd_safe::get_frame_content_size(&bytes), Ok(None)), "no recorded size");
    bytes
}

/// Finding: a stream with no recorded size was refused only after 320 MiB,
/// at 335 MB of RSS, from an 11 KB file.
#[test]
fn streams_without_a_size_stop_at_the_file_and_the_claim() {
    let zeros = 16_384; // 64 MiB of zero pages: a few KiB of RLE blocks.
    let ok = streamed(zeros, zeros);
    assert!(ok.len() < 16 << 10, "{} bytes", ok.len());
    assert_eq!(Corpus::from_bytes(&ok).unwrap().page_count(), 16_384);
    // A claim beyond what a stream of this size can hold: refused before
    // decoding. The stream's last block is damaged, so a reader that decoded
    // it all would fail on that instead.
    let mut claim = streamed(1 << 40, zeros);
    let n = claim.len();
    claim[n - 6..].fill(0xff);
    let mut damaged = streamed(zeros, zeros);
    let n = damaged.len();
    damaged[n - 6..].fill(0xff);
    assert!(matches!(Corpus::from_bytes(&damaged), Err(CorpusError::Zstd(_))), "the damage is seen when decoding");
    let e = Corpus::from_bytes(&claim).unwrap_err();
    assert!(matches!(e, CorpusError::ClaimExceedsStream { page_count, .. } if page_count == 1 << 40), "{e}");
    // A claim the file could hold, but the stream is one page short, or one page long.
    let e = Corpus::from_bytes(&streamed(zeros + 1, zeros)).unwrap_err();
    assert!(matches!(e, CorpusError::LengthMismatch { page_count, .. } if page_count == zeros + 1), "{e}");
    let e = Corpus::from_bytes(&streamed(zeros - 1, zeros)).unwrap_err();
    assert!(matches!(e, CorpusError::TrailingData { extra: 4096 }), "{e}");
}

#[test]
fn read_refuses_what_is_not_a_regular_file() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo.tcorp");
    let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let t = std::time::Instant::now();
    let e = Corpus::read(&fifo).unwrap_err().to_string();
    assert!(e.contains("not a regular file") && t.elapsed() < std::time::Duration::from_secs(1), "{e}");
    assert!(Corpus::read(dir.path()).unwrap_err().to_string().contains("not a regular file"));
}

#[test]
fn rejects_bad_meta() {
    for json in [&b"{not json"[..], b"[]", b"{\"program\":\"x\"}", b"\xff\xfe", b""] {
        let b = image(1, 4096, 0, json, &[]);
        let e = Corpus::from_bytes(&b).unwrap_err();
        assert!(matches!(e, CorpusError::BadMeta(_)), "{e}");
        let e = Corpus::from_bytes(&zstd(&b)).unwrap_err();
        assert!(matches!(e, CorpusError::BadMeta(_)), "{e}");
    }
    // meta.pages disagrees with the header.
    let b = image(1, 4096, 1, &meta_json(2), &vec![0; 4096]);
    let e = Corpus::from_bytes(&b).unwrap_err();
    assert!(matches!(e, CorpusError::MetaPagesMismatch { header: 1, meta: 2 }), "{e}");
    // Absurd metadata length.
    let mut b = image(1, 4096, 0, &meta_json(0), &[]);
    b[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
    let e = Corpus::from_bytes(&b).unwrap_err();
    assert!(matches!(e, CorpusError::MetaTooLarge { .. }), "{e}");
}

#[test]
fn rejects_garbage_zstd() {
    let mut b = ZSTD_MAGIC.to_vec();
    b.extend_from_slice(&[0xff; 64]);
    let e = Corpus::from_bytes(&b).unwrap_err();
    assert!(matches!(e, CorpusError::Zstd(_) | CorpusError::Truncated { .. }), "{e}");
    // Trailing garbage after a valid frame.
    let mut z = corpus(1).to_bytes(true);
    z.extend_from_slice(b"garbage!");
    assert!(Corpus::from_bytes(&z).is_err());
}

#[test]
fn never_panics_on_corruption() {
    // Flip bytes all over small plain and compressed images.
    let plain = corpus(2).to_bytes(false);
    let packed = corpus(2).to_bytes(true);
    let mut rng = SplitMix64::new(7);
    for _ in 0..2000 {
        for src in [&plain, &packed] {
            let mut b = src.clone();
            let n = 1 + rng.below(4);
            for _ in 0..n {
                let len = u64::try_from(b.len()).unwrap();
                let i = usize::try_from(rng.below(len.min(200))).unwrap();
                b[i] ^= u8::try_from(1 + rng.below(255)).unwrap();
            }
            let _ = Corpus::from_bytes(&b);
        }
    }
}

#[test]
fn pages_and_page() {
    let c = corpus(4);
    assert_eq!(c.pages().len(), 4);
    for (i, p) in c.pages().enumerate() {
        assert_eq!(p, c.page(i));
        assert_eq!(&p[..], &c.data()[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]);
    }
}

#[test]
#[should_panic(expected = "out of range")]
fn page_out_of_range_panics() {
    let _ = corpus(2).page(2);
}

#[test]
fn stats_count_same_filled() {
    let mut data = vec![0u8; 4 * PAGE_SIZE];
    // page 0: zero; page 1: 0xAB repeated; page 2: a repeated u64; page 3: varied.
    data[PAGE_SIZE..2 * PAGE_SIZE].fill(0xAB);
    for w in data[2 * PAGE_SIZE..3 * PAGE_SIZE].chunks_exact_mut(8) {
        w.copy_from_slice(&0x0102_0304_0506_0708u64.to_ne_bytes());
    }
    data[3 * PAGE_SIZE + 100] = 1;
    let c = Corpus::new(meta("pid"), data).unwrap();
    let s = c.stats();
    assert_eq!(s, PageStats { pages: 4, same_filled: 3, zero: 1 });
    assert_eq!(same_filled_word(c.page(2)), Some(0x0102_0304_0506_0708));
    assert_eq!(same_filled_word(c.page(3)), None);
}

#[test]
fn sample_is_deterministic_and_order_preserving() {
    let c = corpus(100);
    let s1 = c.sample(10, 42);
    let s2 = c.sample(10, 42);
    assert_eq!(s1, s2);
    assert_eq!(s1.page_count(), 10);
    assert_eq!(s1.meta.pages, 10);
    assert_eq!(s1.meta.program, "python");
    // Each sampled page is a distinct original page, in increasing order.
    let idx: Vec<usize> = s1.pages().map(|p| c.pages().position(|q| q == p).unwrap()).collect();
    assert!(idx.windows(2).all(|w| w[0] < w[1]), "{idx:?}");
    assert_ne!(c.sample(10, 43), s1);
    // Asking for more pages than present returns everything.
    assert_eq!(c.sample(1000, 1), c);
    assert_eq!(c.sample(0, 1).page_count(), 0);
    // Roughly uniform: over many seeds the first and second half are both hit.
    let mut first_half = 0;
    for seed in 0..200 {
        let s = c.sample(1, seed);
        if c.pages().position(|q| q == s.page(0)).unwrap() < 50 {
            first_half += 1;
        }
    }
    assert!((60..140).contains(&first_half), "{first_half}");
}

#[test]
fn mix_concatenates() {
    let a = corpus(2);
    let mut b = corpus(3);
    b.meta.program = "redis".to_string();
    b.meta.captured_unix = 1_800_000_000;
    let m = Corpus::mix(&[a.clone(), b.clone()]);
    assert_eq!(m.meta.program, "mix");
    assert_eq!(m.page_count(), 5);
    assert_eq!(m.meta.pages, 5);
    assert_eq!(&m.data()[..2 * PAGE_SIZE], a.data());
    assert_eq!(&m.data()[2 * PAGE_SIZE..], b.data());
    assert_eq!(m.meta.captured_unix, 1_800_000_000);
    assert!(m.meta.source.contains("python:2") && m.meta.source.contains("redis:3"));
    assert_eq!(Corpus::mix(&[]).page_count(), 0);
    assert_eq!(Corpus::from_bytes(&m.to_bytes(true)).unwrap(), m);
}

#[test]
fn builtin_corpora_are_plausible() {
    let all = Corpus::builtin();
    assert_eq!(all.len(), 4);
    for (c, name) in all.iter().zip(BUILTIN_NAMES) {
        assert_eq!(c.meta.program, name);
        assert_eq!(c.page_count(), 512, "{name}");
        assert_eq!(c.meta.pages, 512, "{name}");
        let stats = c.stats();
        assert!(stats.zero < 512 / 2, "{name}: {stats:?}");
        // Real memory: many distinct pages, lots of non-zero bytes.
        let mut distinct: Vec<&[u8; PAGE_SIZE]> = c.pages().collect();
        distinct.sort_unstable();
        distinct.dedup();
        assert!(distinct.len() > 256, "{name}: only {} distinct pages", distinct.len());
        let nonzero = c.data().iter().filter(|&&b| b != 0).count();
        assert!(nonzero > c.data().len() / 8, "{name}: {nonzero} non-zero bytes");
        assert_eq!(Corpus::builtin_named(name).as_ref(), Some(c));
    }
    assert!(Corpus::builtin_named("perl").is_none());
    assert_eq!(Corpus::mix(&all).page_count(), 2048);
}

#[test]
fn builtin_files_are_small_and_compressed() {
    let total: usize = BUILTIN_FILES.iter().map(|f| f.len()).sum();
    assert!(total <= 3 << 20, "built-in corpora take {total} bytes");
    for f in BUILTIN_FILES {
        assert!(f.starts_with(&ZSTD_MAGIC));
    }
}

#[test]
fn splitmix_below_is_in_range() {
    let mut r = SplitMix64::new(1);
    for n in [1, 2, 3, 7, 1000, u64::MAX] {
        for _ in 0..100 {
            assert!(r.below(n) < n);
        }
    }
}
