//! Error paths through the public API: the pool limit, destroyed and unknown
//! pools, refused policy and codec changes, and corrupt compressed input for
//! every codec (an error, never a panic).

use rand_xoshiro::rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::sync::Arc;

use tmem_core::alloc::{AllocError, ZsAlloc};
use tmem_core::codec::{fill_page, train_dictionary, Codec, CodecConfig, COMPRESS_BUF_SIZE};
use tmem_core::{
    CodecError, GetOutcome, Key, PolicyConfig, PolicyError, PoolConfig, PutOutcome, Reject, Store, StoreConfig,
    StoreError, PAGE_SIZE,
};

type Page = [u8; PAGE_SIZE];

/// The next number of `rng` (a seeded generator, so every run sees the same pages).
fn next(rng: &mut Xoshiro256PlusPlus) -> u64 {
    rng.next_u64()
}

/// Compressible, distinct per seed (about 2:1 with lz4).
#[allow(clippy::cast_possible_truncation)] // truncation to bytes is intended
fn text_page(seed: u64) -> Page {
    let words: [&[u8]; 8] = [b"alpha ", b"beta ", b"gamma ", b"delta ", b"{\"id\": ", b"}, ", b"null", b"\n  "];
    let mut p = [0u8; PAGE_SIZE];
    let mut x = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut i = 0;
    while i < PAGE_SIZE {
        let r = next(&mut x);
        let w = words[(r % 8) as usize];
        let n = w.len().min(PAGE_SIZE - i);
        p[i..i + n].copy_from_slice(&w[..n]);
        i += n;
        if i < PAGE_SIZE {
            p[i] = (r >> 32) as u8;
            i += 1;
        }
    }
    p
}

#[allow(clippy::cast_possible_truncation)] // truncation to bytes is intended
fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = Xoshiro256PlusPlus::seed_from_u64(seed);
    (0..len).map(|_| next(&mut x) as u8).collect()
}

fn random_page(seed: u64) -> Page {
    random_bytes(seed, PAGE_SIZE).try_into().expect("one page")
}

fn store(policy: PolicyConfig) -> Store {
    StoreConfig { policy, ..StoreConfig::default() }.build().expect("store builds")
}

fn key(i: u64) -> Key {
    Key::new(1, i)
}

fn is_hit(p: &tmem_core::Pool, k: Key) -> bool {
    let mut out = [0u8; PAGE_SIZE];
    p.get(k, &mut out).expect("get") == GetOutcome::Hit
}

// ---------------------------------------------------------------- pool limit

#[test]
fn pool_at_limit_rejects_with_pool_limit_and_counts_it() {
    const LIMIT: u64 = 1 << 20;
    let s = store(PolicyConfig { max_pool_bytes: LIMIT, ..PolicyConfig::default() });
    let p = s.create_pool(PoolConfig::persistent());
    assert_eq!(s.stats().pool_limit_bytes, LIMIT);
    let mut stored = Vec::new();
    let mut first_reject = None;
    for i in 0..2000 {
        match p.put(key(i), &text_page(i)).unwrap() {
            PutOutcome::Stored => stored.push(i),
            PutOutcome::Rejected(Reject::PoolLimit) => {
                first_reject = Some(i);
                break;
            }
            other => panic!("put {i}: {other:?}"),
        }
    }
    let first_reject = first_reject.expect("a 1 MiB store fills up within 2000 text pages");
    assert!(stored.len() > 100, "only {} pages fit", stored.len());
    let used = s.mem_used_total();
    assert!(used >= LIMIT && used <= LIMIT + 64 * PAGE_SIZE as u64, "usage {used} around the limit {LIMIT}");

    // Once full, puts stay refused until usage is below the accept threshold
    // (90%), whatever the page: same-filled pages too.
    let mut zero = [0u8; PAGE_SIZE];
    assert_eq!(p.put(key(5000), &zero).unwrap(), PutOutcome::Rejected(Reject::PoolLimit));
    fill_page(&mut zero, 42);
    assert_eq!(p.put(key(5001), &zero).unwrap(), PutOutcome::Rejected(Reject::PoolLimit));
    // A refused put flushes the older copy of its key.
    let victim = stored[3];
    assert!(is_hit(&p, key(victim)));
    assert_eq!(p.put(key(victim), &text_page(victim + 1)).unwrap(), PutOutcome::Rejected(Reject::PoolLimit));
    assert!(!is_hit(&p, key(victim)), "stale copy survived a PoolLimit refusal");
    stored.retain(|&i| i != victim);

    let st = p.stats();
    assert_eq!(st.pool_limit_hit, 4);
    assert_eq!(
        (st.reject_compress_poor, st.reject_frozen, st.reject_alloc_fail, st.reject_compress_fail),
        (0, 0, 0, 0)
    );
    assert_eq!(st.puts, first_reject + 1 + 3);
    assert_eq!(st.succ_puts, first_reject);
    assert_eq!(st.stored_pages, stored.len() as u64);
    assert_eq!(s.stats().total.pool_limit_hit, 4);

    // Frozen is checked first and counted as such.
    s.set_policy("frozen", "1").unwrap();
    assert_eq!(p.put(key(6000), &text_page(6000)).unwrap(), PutOutcome::Rejected(Reject::Frozen));
    s.set_policy("frozen", "0").unwrap();
    assert_eq!((p.stats().pool_limit_hit, p.stats().reject_frozen), (4, 1));

    // Flushing a few pages is not enough (hysteresis) ...
    for &i in &stored[..4] {
        assert!(p.flush_page(key(i)).unwrap());
    }
    s.compact();
    if s.mem_used_total() >= LIMIT / 100 * 90 {
        assert_eq!(p.put(key(7000), &text_page(7000)).unwrap(), PutOutcome::Rejected(Reject::PoolLimit));
    }
    // ... flushing half of them is.
    let half = stored.len() / 2;
    for &i in &stored[4..half] {
        assert!(p.flush_page(key(i)).unwrap());
    }
    s.compact();
    assert!(s.mem_used_total() < LIMIT / 100 * 90, "usage {} after flushing half", s.mem_used_total());
    assert_eq!(p.put(key(7001), &text_page(7001)).unwrap(), PutOutcome::Stored);
    // Every page that was stored and not flushed is intact.
    let mut out = [0u8; PAGE_SIZE];
    for &i in &stored[half..] {
        assert_eq!(p.get(key(i), &mut out).unwrap(), GetOutcome::Hit);
        assert_eq!(out, text_page(i));
    }

    // Raising the limit lets puts in at once.
    s.set_policy("max_pool_bytes", "0").unwrap();
    assert_eq!(s.stats().pool_limit_bytes, u64::MAX);
    for i in 8000..8100 {
        assert_eq!(p.put(key(i), &text_page(i)).unwrap(), PutOutcome::Stored);
    }
}

#[test]
fn limit_below_metadata_rejects_everything() {
    let s = store(PolicyConfig { max_pool_bytes: 1, ..PolicyConfig::default() });
    let p = s.create_pool(PoolConfig::persistent());
    // An empty store uses no memory, so the first put is admitted.
    assert_eq!(p.put(key(0), &text_page(0)).unwrap(), PutOutcome::Stored);
    for i in 1..20 {
        assert_eq!(p.put(key(i), &text_page(i)).unwrap(), PutOutcome::Rejected(Reject::PoolLimit), "put {i}");
    }
    assert_eq!(p.stats().pool_limit_hit, 19);
    assert_eq!(p.stats().stored_pages, 1);
}

#[test]
fn limit_as_percent_of_ram() {
    let s = store(PolicyConfig { total_ram_bytes: 10 << 20, max_pool_percent: 10, ..PolicyConfig::default() });
    assert_eq!(s.policy().limit_bytes(), (10 << 20) / 100 * 10);
    let p = s.create_pool(PoolConfig::persistent());
    let rejected = (0..2000).filter(|&i| p.put(key(i), &text_page(i)).unwrap() != PutOutcome::Stored).count();
    assert!(rejected > 0);
    assert_eq!(p.stats().pool_limit_hit, rejected as u64);
}

#[test]
fn ephemeral_pool_at_limit_evicts_instead_of_rejecting() {
    const LIMIT: u64 = 1 << 20;
    let s = store(PolicyConfig { max_pool_bytes: LIMIT, ..PolicyConfig::default() });
    let persistent = s.create_pool(PoolConfig::persistent());
    let eph = s.create_pool(PoolConfig::ephemeral());
    for i in 0..3000 {
        assert_eq!(eph.put(key(i), &text_page(i)).unwrap(), PutOutcome::Stored, "ephemeral put {i}");
    }
    let st = eph.stats();
    assert!(st.evicted_pages > 0);
    assert_eq!(st.pool_limit_hit, 0);
    assert_eq!(st.stored_pages + st.evicted_pages, 3000);
    // A persistent put at the limit makes room by dropping ephemeral pages.
    let before = eph.stats().evicted_pages;
    for i in 0..200 {
        assert_eq!(persistent.put(key(i), &text_page(i)).unwrap(), PutOutcome::Stored, "persistent put {i}");
    }
    assert!(eph.stats().evicted_pages > before);
    assert_eq!(persistent.stats().pool_limit_hit, 0);
    assert!(s.mem_used_total() <= LIMIT + 64 * PAGE_SIZE as u64);
}

// ---------------------------------------------------------------- pools

#[test]
fn destroyed_pool_is_an_error_everywhere() {
    let s = store(PolicyConfig::default());
    let keep = s.create_pool(PoolConfig::persistent());
    let p = s.create_pool(PoolConfig::ephemeral().exclusive_gets(true));
    let id = p.id();
    for i in 0..50 {
        assert_eq!(p.put(key(i), &text_page(i)).unwrap(), PutOutcome::Stored);
        assert_eq!(keep.put(key(i), &text_page(i)).unwrap(), PutOutcome::Stored);
    }
    s.destroy_pool(id).unwrap();
    let mut out = [0u8; PAGE_SIZE];
    let destroyed = |r: Result<(), StoreError>| matches!(r, Err(StoreError::PoolDestroyed(x)) if x == id);
    assert!(destroyed(p.put(key(1), &text_page(1)).map(drop)));
    assert!(destroyed(p.get(key(1), &mut out).map(drop)));
    assert!(destroyed(p.flush_page(key(1)).map(drop)));
    assert!(destroyed(p.flush_object(1).map(drop)));
    assert!(destroyed(s.put(id, key(1), &text_page(1)).map(drop)));
    assert!(destroyed(s.get(id, key(1), &mut out).map(drop)));
    assert!(destroyed(s.flush_page(id, key(1)).map(drop)));
    assert!(destroyed(s.flush_object(id, 1).map(drop)));
    assert!(destroyed(s.pool(id).map(drop)));
    assert!(destroyed(s.destroy_pool(id)));
    assert_eq!(s.pool_ids(), vec![keep.id()]);
    // Unknown ids.
    let unknown = |r: Result<(), StoreError>| matches!(r, Err(StoreError::NoSuchPool(99)));
    assert!(unknown(s.pool(99).map(drop)));
    assert!(unknown(s.put(99, key(1), &text_page(1)).map(drop)));
    assert!(unknown(s.get(99, key(1), &mut out).map(drop)));
    assert!(unknown(s.flush_page(99, key(1)).map(drop)));
    assert!(unknown(s.flush_object(99, 1).map(drop)));
    assert!(unknown(s.destroy_pool(99)));
    // The destroyed pool's memory is gone, the other pool is untouched.
    let st = s.stats();
    assert_eq!(st.pools.len(), 1);
    assert_eq!(st.total.stored_pages, 50);
    assert_eq!(st.alloc.objects, 50);
    for i in 0..50 {
        assert_eq!(keep.get(key(i), &mut out).unwrap(), GetOutcome::Hit);
        assert_eq!(out, text_page(i));
    }
    // Ids are not reused.
    assert!(s.create_pool(PoolConfig::persistent()).id() > id);
    let msg = StoreError::PoolDestroyed(id).to_string();
    assert!(msg.contains("destroyed"), "{msg}");
}

// ---------------------------------------------------------------- policy

#[test]
fn bad_policy_values_are_refused_and_change_nothing() {
    let s = store(PolicyConfig { max_pool_bytes: 123_456, ..PolicyConfig::default() });
    s.set_policy("incompressible", "store_raw").unwrap();
    let before = s.policy().config();
    let bad_values = [
        ("max_pool_bytes", "-1"),
        ("max_pool_bytes", "abc"),
        ("max_pool_bytes", ""),
        ("max_pool_bytes", "1e6"),
        ("max_pool_bytes", " 5"),
        ("max_pool_bytes", "18446744073709551616"),
        ("max_pool_percent", "101"),
        ("max_pool_percent", "4294967296"),
        ("total_ram_bytes", "lots"),
        ("accept_threshold_percent", "101"),
        ("accept_threshold_percent", "-5"),
        ("max_compressed_size", "0"),
        ("max_compressed_size", "4097"),
        ("max_compressed_size", "1.5"),
        ("compact_threshold_percent", "101"),
        ("frozen", "maybe"),
        ("frozen", "2"),
        ("frozen", ""),
        ("incompressible", "compress"),
        ("incompressible", ""),
        ("incompressible", "REJECT"),
    ];
    for (k, v) in bad_values {
        match s.set_policy(k, v) {
            Err(StoreError::Policy(PolicyError::BadValue { key, value, reason })) => {
                assert_eq!((key.as_str(), value.as_str()), (k, v));
                assert!(!reason.is_empty());
            }
            other => panic!("set_policy({k:?}, {v:?}) gave {other:?}"),
        }
        assert_eq!(s.policy().config(), before, "policy changed by refused {k}={v}");
    }
    for k in ["", "max_pool", "MAX_POOL_BYTES", "frozen ", "codec"] {
        assert!(
            matches!(s.set_policy(k, "1"), Err(StoreError::Policy(PolicyError::UnknownKey(ref x))) if x == k),
            "key {k:?}"
        );
        assert_eq!(s.policy().config(), before);
    }
    assert_eq!(s.stats().policy, before);
    assert_eq!(s.policy().limit_bytes(), 123_456);
    // Valid values at the edges are accepted.
    for (k, v) in [("max_compressed_size", "4096"), ("max_compressed_size", "1"), ("accept_threshold_percent", "0")] {
        s.set_policy(k, v).unwrap_or_else(|e| panic!("{k}={v}: {e}"));
    }
}

#[test]
fn bad_store_config_is_refused() {
    for policy in [
        PolicyConfig { max_pool_percent: 101, ..PolicyConfig::default() },
        PolicyConfig { accept_threshold_percent: 200, ..PolicyConfig::default() },
        PolicyConfig { max_compressed_size: 0, ..PolicyConfig::default() },
        PolicyConfig { max_compressed_size: 4097, ..PolicyConfig::default() },
        PolicyConfig { compact_threshold_percent: 101, ..PolicyConfig::default() },
    ] {
        let r = StoreConfig { policy: policy.clone(), ..StoreConfig::default() }.build();
        assert!(matches!(r, Err(StoreError::Policy(PolicyError::BadValue { .. }))), "{policy:?}");
    }
    for level in [-1_000_000, 23, 1000] {
        let codec = Some(CodecConfig::Zstd { level, dictionary: None });
        let r = StoreConfig { codec, ..StoreConfig::default() }.build();
        assert!(matches!(r, Err(StoreError::Codec(CodecError::Config { .. }))), "level {level}");
    }
}

// ---------------------------------------------------------------- codecs in the store

#[test]
fn bad_codec_changes_are_refused() {
    let s = store(PolicyConfig::default());
    let p = s.create_pool(PoolConfig::persistent());
    assert_eq!(p.put(key(1), &text_page(1)).unwrap(), PutOutcome::Stored);
    assert!(matches!(s.use_codec(&CodecConfig::Zstd { level: 99, dictionary: None }), Err(StoreError::Codec(_))));
    assert_eq!(s.codec_name(), "lz4");
    assert!(matches!(s.set_codec(31), Err(StoreError::NoSuchCodec(31))));
    assert!(matches!(s.set_codec(200), Err(StoreError::NoSuchCodec(200))));
    assert_eq!(s.codec_name(), "lz4");
    for bad in ["", "lzma", "zstd:", "zstd:x", "zstd:1:2", "LZ4", "lz4:1", "raw:0"] {
        assert!(matches!(CodecConfig::parse(bad), Err(CodecError::Config { .. })), "{bad:?}");
    }
    // Registering more codecs than an entry can name fails cleanly; the
    // store keeps working with what it has.
    let mut last = 0;
    let err = loop {
        match s.register_codec(&CodecConfig::LZ4) {
            Ok(id) => last = id,
            Err(e) => break e,
        }
    };
    assert!(matches!(err, StoreError::TooManyCodecs), "{err:?}");
    assert_eq!(last, 31);
    assert!(matches!(s.use_codec(&CodecConfig::Zstd { level: 1, dictionary: None }), Err(StoreError::TooManyCodecs)));
    s.set_codec(last).unwrap();
    assert_eq!(p.put(key(2), &text_page(2)).unwrap(), PutOutcome::Stored);
    let mut out = [0u8; PAGE_SIZE];
    for i in [1, 2] {
        assert_eq!(p.get(key(i), &mut out).unwrap(), GetOutcome::Hit);
        assert_eq!(out, text_page(i));
    }
}

#[test]
fn dictionary_training_errors_are_errors() {
    let none: [&Page; 0] = [];
    assert!(matches!(train_dictionary(none, 8192), Err(CodecError::Config { .. })));
    // Same-filled pages are skipped, leaving nothing to train on.
    let zero = [0u8; PAGE_SIZE];
    assert!(matches!(train_dictionary([&zero, &zero, &zero], 8192), Err(CodecError::Config { .. })));
    // Incompressible samples give zstd nothing to learn; either way no panic.
    let random: Vec<Page> = (0..8).map(random_page).collect();
    let _ = train_dictionary(random.iter(), 4096);
}

// ---------------------------------------------------------------- corrupt codec input

fn dict() -> Arc<[u8]> {
    let pages: Vec<Page> = (0..64).map(text_page).collect();
    train_dictionary(pages.iter(), 8192).expect("dictionary trains")
}

fn codecs(dict: &Arc<[u8]>) -> Vec<Arc<dyn Codec>> {
    [
        CodecConfig::Raw,
        CodecConfig::LZ4,
        CodecConfig::Zstd { level: 1, dictionary: None },
        CodecConfig::Zstd { level: -5, dictionary: None },
        CodecConfig::Zstd { level: 3, dictionary: Some(Arc::clone(dict)) },
        CodecConfig::LZ4.with_dictionary(Arc::clone(dict)),
    ]
    .iter()
    .map(|c| c.build().expect("codec builds"))
    .collect()
}

/// Decompression of `src` must return (Ok or Err) without panicking.
fn no_panic(c: &dyn Codec, src: &[u8]) -> Result<(), CodecError> {
    let mut out = [0u8; PAGE_SIZE];
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.decompress(src, &mut out)))
        .unwrap_or_else(|_| panic!("{} panicked on {} bytes of input", c.name(), src.len()))
}

fn assert_decompress_error(c: &dyn Codec, src: &[u8], what: &str) {
    match no_panic(c, src) {
        Err(CodecError::Decompress { codec, reason }) => {
            assert_eq!(codec, c.name());
            assert!(!reason.is_empty());
        }
        other => panic!("{}: {what} ({} bytes) gave {other:?}", c.name(), src.len()),
    }
}

#[test]
fn empty_and_truncated_input_is_an_error() {
    let d = dict();
    let mut buf = [0u8; COMPRESS_BUF_SIZE];
    for c in codecs(&d) {
        assert_decompress_error(&*c, &[], "empty input");
        for page in [text_page(7), random_page(7)] {
            let n = c.compress(&page, &mut buf).unwrap();
            let mut out = [0u8; PAGE_SIZE];
            c.decompress(&buf[..n], &mut out).unwrap();
            assert_eq!(out, page);
            for cut in 0..n {
                assert_decompress_error(&*c, &buf[..cut], "truncated input");
            }
        }
    }
}

#[test]
fn garbled_input_never_panics() {
    let d = dict();
    let mut buf = [0u8; COMPRESS_BUF_SIZE];
    let mut seed = Xoshiro256PlusPlus::seed_from_u64(1);
    for c in codecs(&d) {
        let mut errors = 0;
        let mut tries = 0;
        for page in [text_page(3), random_page(3), [0u8; PAGE_SIZE]] {
            let n = c.compress(&page, &mut buf).unwrap();
            // Every single-byte flip, then random multi-byte damage.
            for i in 0..n {
                for mask in [0x01, 0x80, 0xff] {
                    let mut bad = buf[..n].to_vec();
                    bad[i] ^= mask;
                    tries += 1;
                    errors += usize::from(no_panic(&*c, &bad).is_err());
                }
            }
            for _ in 0..200 {
                let mut bad = buf[..n].to_vec();
                for _ in 0..1 + next(&mut seed) % 8 {
                    let at = usize::try_from(next(&mut seed)).unwrap() % n;
                    bad[at] = random_bytes(next(&mut seed), 1)[0];
                }
                tries += 1;
                errors += usize::from(no_panic(&*c, &bad).is_err());
            }
        }
        // Pure noise of many lengths.
        for len in [1, 2, 3, 4, 5, 8, 16, 100, 1000, 4095, 4096, 4097, COMPRESS_BUF_SIZE] {
            for s in 0..20 {
                tries += 1;
                errors += usize::from(no_panic(&*c, &random_bytes(s * 7919 + len as u64, len)).is_err());
            }
        }
        if c.name() != "raw" {
            assert!(errors > 0, "{}: no corruption detected in {tries} tries", c.name());
        }
    }
}

#[test]
fn oversized_input_is_an_error() {
    let d = dict();
    let mut buf = [0u8; COMPRESS_BUF_SIZE];
    for c in codecs(&d) {
        let name = c.name().to_owned();
        // Longer than any compressed page.
        for len in [PAGE_SIZE + 1, COMPRESS_BUF_SIZE + 1, 1 << 16, 1 << 20] {
            let _ = no_panic(&*c, &random_bytes(len as u64, len));
        }
        assert_decompress_error(&*c, &random_bytes(5, PAGE_SIZE + 1), "a page and a byte");
        // A valid page followed by trailing garbage.
        let page = text_page(11);
        let n = c.compress(&page, &mut buf).unwrap();
        let mut long = buf[..n].to_vec();
        long.extend_from_slice(&random_bytes(3, 100));
        let _ = no_panic(&*c, &long);
        // Two compressed pages back to back decode to two pages: too many.
        let mut two = buf[..n].to_vec();
        two.extend_from_slice(&buf[..n]);
        assert_decompress_error(&*c, &two, &format!("{name}: two compressed pages"));
    }
}

#[test]
fn wrong_size_streams_are_errors() {
    let d = dict();
    let cs = codecs(&d);
    let lz4 = &cs[1];
    let zstd1 = &cs[2];
    let zstd_dict = &cs[4];
    let text: Vec<u8> = text_page(5).iter().chain(text_page(6).iter()).copied().collect();
    // lz4 blocks that decode to more or less than a page.
    for len in [0, 1, 100, PAGE_SIZE - 1, PAGE_SIZE + 1, 2 * PAGE_SIZE] {
        let mut block = vec![0u8; 3 * PAGE_SIZE];
        let n = tmem_core::lz4::compress(&text[..len], &mut block, None).expect("room for the block");
        assert_decompress_error(&**lz4, &block[..n], &format!("lz4 block of {len} bytes"));
    }
    // zstd frames that decode to more or less than a page, with and without
    // a content size in the header.
    for len in [0, 1, 100, PAGE_SIZE - 1, PAGE_SIZE + 1, 2 * PAGE_SIZE, 1 << 16] {
        let data: Vec<u8> = text.iter().copied().cycle().take(len).collect();
        let frame = zstd::bulk::compress(&data, 3).unwrap();
        assert_decompress_error(&**zstd1, &frame, &format!("zstd frame of {len} bytes"));
        let mut c = zstd::bulk::Compressor::new(3).unwrap();
        c.set_parameter(zstd::zstd_safe::CParameter::ContentSizeFlag(false)).unwrap();
        let frame = c.compress(&data).unwrap();
        assert_decompress_error(&**zstd1, &frame, &format!("zstd frame of {len} bytes, no size"));
    }
    // lz4 data to zstd and the reverse.
    let page = text_page(9);
    let mut buf = [0u8; COMPRESS_BUF_SIZE];
    let n = lz4.compress(&page, &mut buf).unwrap();
    assert_decompress_error(&**zstd1, &buf[..n], "lz4 data to zstd");
    let n = zstd1.compress(&page, &mut buf).unwrap();
    let _ = no_panic(&**lz4, &buf[..n]);
    // A dictionary frame without the dictionary, and the reverse: an error
    // or (zstd cannot always tell) a wrong page, never a panic.
    let n = zstd_dict.compress(&page, &mut buf).unwrap();
    let mut out = [0u8; PAGE_SIZE];
    if zstd1.decompress(&buf[..n], &mut out).is_ok() {
        assert_ne!(out, page, "decoded a dictionary frame without the dictionary");
    }
    let n = zstd1.compress(&page, &mut buf).unwrap();
    let _ = no_panic(&**zstd_dict, &buf[..n]);
    // A frame declaring a huge content size.
    let big = zstd::bulk::compress(&vec![7u8; 1 << 20], 1).unwrap();
    assert_decompress_error(&**zstd1, &big, "a frame of 1 MiB");
}

#[test]
fn garbage_dictionary_does_not_panic() {
    // zstd takes bytes without the dictionary magic as raw content; lz4
    // takes any bytes as history.
    for dictionary in [random_bytes(1, 1000), vec![0u8; 16], b"\x37\xa4\x30\xec garbage".to_vec()] {
        let dictionary: Arc<[u8]> = Arc::from(dictionary);
        let lz4 = CodecConfig::LZ4.with_dictionary(Arc::clone(&dictionary));
        for cfg in [CodecConfig::Zstd { level: 3, dictionary: Some(dictionary) }, lz4] {
            let Ok(c) = cfg.build() else { continue };
            let page = text_page(1);
            let mut buf = [0u8; COMPRESS_BUF_SIZE];
            if let Ok(n) = c.compress(&page, &mut buf) {
                let mut out = [0u8; PAGE_SIZE];
                c.decompress(&buf[..n], &mut out).unwrap();
                assert_eq!(out, page);
            }
        }
    }
}

// ---------------------------------------------------------------- allocator

#[test]
fn allocator_rejects_bad_sizes() {
    let a = ZsAlloc::new();
    assert!(matches!(a.alloc_write(&[]), Err(AllocError::BadSize(0))));
    assert!(matches!(a.alloc_write(&vec![1u8; PAGE_SIZE + 1]), Err(AllocError::BadSize(n)) if n == PAGE_SIZE + 1));
    let loc = a.alloc_write(&vec![1u8; PAGE_SIZE]).unwrap();
    assert_eq!(a.stats().objects, 1);
    a.free(loc);
    assert_eq!(a.stats().span_bytes, 0);
}
