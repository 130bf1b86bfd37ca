use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU32;

use tmem_tier::conformance::{self, Expect};
use tmem_tier::seal::{MasterKey, SealError, Sealer};

use super::*;

/// A temporary path, removed on drop (declare it before the tier so the tier drops first).
struct TempPath(PathBuf);

impl TempPath {
    fn new(dir: impl AsRef<Path>, name: &str) -> Self {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        Self(dir.as_ref().join(format!("tmem-tier-disk-test-{}-{n}-{name}", std::process::id())))
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A real disk filesystem (O_DIRECT works); falls back to the temp dir.
fn disk_dir() -> PathBuf {
    let p = PathBuf::from("/var/tmp");
    if p.is_dir() {
        p
    } else {
        std::env::temp_dir()
    }
}

fn tmpfs_dir() -> PathBuf {
    let p = PathBuf::from("/dev/shm");
    if p.is_dir() {
        p
    } else {
        std::env::temp_dir()
    }
}

fn config(path: &TempPath, segment_bytes: u32, segments: u64) -> DiskTierConfig {
    DiskTierConfig {
        capacity_bytes: u64::from(segment_bytes) * segments,
        segment_bytes,
        ..DiskTierConfig::new(&path.0)
    }
}

/// splitmix64: deterministic randomness without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn size(&mut self, n: usize) -> usize {
        usize::try_from(self.below(u64::try_from(n).unwrap())).unwrap()
    }

    /// Mostly 300–3000 bytes (compressed pages), sometimes anything up to MAX_VALUE.
    fn value(&mut self, tag: u64) -> Vec<u8> {
        let len = if self.below(8) == 0 { self.size(MAX_VALUE + 1) } else { 300 + self.size(2701) };
        let seed = self.next() ^ tag;
        (0..len).map(|i| (seed.wrapping_mul(u64::try_from(i).unwrap() + 1) >> 13).to_le_bytes()[0]).collect()
    }
}

/// Internal consistency: byte counts, segment states, index.
fn check_invariants(tier: &DiskTier) {
    let st = tier.lock();
    let mut live = vec![0u32; st.segs.len()];
    let mut values = 0u64;
    for (k, l) in &st.index {
        let m = st.segs[us(l.seg)];
        assert!(
            matches!(m.state, SegState::Open | SegState::Writing | SegState::Sealed),
            "{k:?} in a {:?} segment",
            m.state
        );
        assert!(l.off + l.rec() <= m.used, "{k:?} at {l:?} beyond used {}", m.used);
        live[us(l.seg)] += l.rec();
        values += u64::from(l.len);
    }
    let mut free = 0;
    for (i, m) in st.segs.iter().enumerate() {
        assert_eq!(m.live, live[i], "segment {i} live bytes: {m:?}");
        assert!(m.live <= m.used && m.used <= st.seg_bytes);
        match m.state {
            SegState::Free | SegState::Discarding => {
                assert_eq!(m.used, 0);
                free += 1;
            }
            SegState::Sealed => assert!(m.live > 0, "sealed segment {i} with nothing live not freed"),
            SegState::Open | SegState::Writing => {}
        }
    }
    assert_eq!(free, st.free.len() + st.discarding);
    assert_eq!(st.live_bytes, live.iter().map(|&x| u64::from(x)).sum::<u64>());
    assert_eq!(st.value_bytes, values);
    let waste: u64 = st
        .segs
        .iter()
        .filter(|m| matches!(m.state, SegState::Writing | SegState::Sealed))
        .map(|m| u64::from(st.seg_bytes - m.used))
        .sum();
    assert_eq!(st.waste_bytes, waste);
}

fn allocated_bytes(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().blocks() * 512
}

#[test]
fn conformance_with_o_direct_on_a_disk_filesystem() {
    let p = TempPath::new(disk_dir(), "conf-direct");
    let tier = DiskTierConfig { capacity_bytes: 16 << 20, ..DiskTierConfig::new(&p.0) }.build().unwrap();
    assert!(tier.direct_io(), "O_DIRECT on {}", p.0.display());
    assert_eq!(tier.health(), Health::Healthy);
    conformance::check(&tier, Expect::Stores);
    check_invariants(&tier);
    let ds = tier.disk_stats();
    assert!(ds.direct_io && !ds.block_device);
    assert!(ds.tier.wire_bytes_out > 0, "batch end flushed: {ds:?}");
    let st = tier.stats();
    assert!(st.put_p50_us > 0 && st.put_p99_us >= st.put_p50_us && st.get_p99_us >= st.get_p50_us, "{st:?}");
}

#[test]
fn o_direct_is_used_on_var_tmp() {
    let p = TempPath::new("/var/tmp", "direct");
    let tier = DiskTierConfig { capacity_bytes: 8 << 20, ..DiskTierConfig::new(&p.0) }.build().unwrap();
    assert!(tier.direct_io(), "fd flags lack O_DIRECT");
    assert!(sys::is_direct(&tier.file).unwrap());
    assert_eq!(tier.health(), Health::Healthy);
    assert!(tier.disk_stats().direct_io);
    // And it works: a value read back from disk, not from the segment buffer.
    let mut rng = Rng(1);
    let vals: Vec<_> = (0..1000u64).map(|i| (TierKey { pool: 1, object: 0, index: i }, rng.value(i))).collect();
    for (k, v) in &vals {
        assert_eq!(tier.put(*k, v).unwrap(), TierPut::Stored);
    }
    tier.flush().unwrap();
    let mut out = Vec::new();
    assert_eq!(tier.get(vals[0].0, &mut out).unwrap(), TierGet::Hit);
    assert_eq!(out, vals[0].1);
    let ds = tier.disk_stats();
    assert!(ds.segment_writes > 0 && ds.tier.wire_bytes_in >= 4096, "{ds:?}");
    assert_eq!(ds.tier.wire_bytes_in % 4096, 0, "direct reads are whole pages");
}

#[test]
fn neighbours_written_together_come_back_with_one_read() {
    let p = TempPath::new("/var/tmp", "one-read");
    let tier = DiskTierConfig { capacity_bytes: 8 << 20, ..DiskTierConfig::new(&p.0) }.build().unwrap();
    let mut rng = Rng(7);
    // 8 neighbours side by side, then 1,000 values that seal their segment.
    let vals: Vec<_> = (0..1008u64).map(|i| (TierKey { pool: 1, object: 0, index: i }, rng.value(i))).collect();
    let items: Vec<(TierKey, &[u8])> = vals.iter().map(|(k, v)| (*k, v.as_slice())).collect();
    assert!(tier.put_batch(&items).into_iter().all(|r| matches!(r, Ok(TierPut::Stored))));
    tier.flush().unwrap();
    assert!(tier.disk_stats().segment_writes > 0);
    let reads = || tier.stats().backing_reads;
    assert_eq!(reads(), 0, "nothing read yet");
    let keys: Vec<TierKey> = vals[..8].iter().map(|(k, _)| *k).collect();
    for (got, (_, want)) in tier.get_batch(&keys).into_iter().zip(&vals) {
        assert_eq!(got.unwrap().as_deref(), Some(want.as_slice()));
    }
    assert_eq!(reads(), 1, "a merged read counts once");
    // Two values of the sealed first segment, far apart: a read each.
    let apart = [vals[0].0, vals[300].0];
    assert!(tier.get_batch(&apart).into_iter().all(|r| r.unwrap().is_some()));
    assert_eq!(reads(), 3);
    let mut out = Vec::new();
    assert_eq!(tier.get(vals[3].0, &mut out).unwrap(), TierGet::Hit);
    assert_eq!((out.as_slice(), reads()), (vals[3].1.as_slice(), 4));
    // A single get read 16 KiB around its value: the next neighbours come
    // from that span, with no read, until one lies past it.
    let mut around = 0;
    for (k, v) in &vals[4..40] {
        let before = reads();
        out.clear();
        assert_eq!(tier.get(*k, &mut out).unwrap(), TierGet::Hit);
        assert_eq!(&out, v, "{k:?}");
        if reads() == before {
            around += 1;
        }
    }
    let ds = tier.disk_stats();
    assert_eq!(ds.around_hits, around);
    assert!(around >= 20, "{around} of 36 neighbours came from a span");
    // A batched get is answered from the spans too.
    let keys: Vec<TierKey> = vals[38..40].iter().map(|(k, _)| *k).collect();
    let before = reads();
    assert!(tier.get_batch(&keys).into_iter().all(|r| r.unwrap().is_some()));
    assert_eq!(reads(), before);
}

#[test]
fn conformance_buffered_on_tmpfs() {
    let p = TempPath::new(tmpfs_dir(), "conf-buffered");
    let tier =
        DiskTierConfig { capacity_bytes: 8 << 20, direct_io: false, ..DiskTierConfig::new(&p.0) }.build().unwrap();
    assert!(!tier.direct_io());
    assert_eq!(tier.health(), Health::Healthy, "buffered by choice is healthy");
    conformance::check(&tier, Expect::Stores);
    check_invariants(&tier);
}

#[test]
fn falls_back_to_buffered_io_where_o_direct_fails() {
    // tmpfs accepts O_DIRECT on recent kernels, so simulate a filesystem that refuses it.
    let p = TempPath::new(disk_dir(), "fallback");
    FAIL_DIRECT_PROBE.with(|f| f.set(true));
    let tier = DiskTierConfig { capacity_bytes: 8 << 20, ..DiskTierConfig::new(&p.0) }.build();
    FAIL_DIRECT_PROBE.with(|f| f.set(false));
    let tier = tier.unwrap();
    assert!(!tier.direct_io(), "O_DIRECT cleared on the fd");
    assert_eq!(tier.health(), Health::Degraded("buffered I/O: O_DIRECT unsupported".into()));
    assert!(!tier.disk_stats().direct_io);
    conformance::check(&tier, Expect::Stores);
}

/// Random put/replace/remove/get/flush/clear_pool against a HashMap, with
/// 8 small segments so the GC runs and puts are refused.
fn model(dir: &Path, direct_io: bool, seed: u64) {
    let p = TempPath::new(dir, "model");
    let seg = 64 << 10;
    let tier = DiskTierConfig { direct_io, ..config(&p, seg, 8) }.build().unwrap();
    let mut oracle: HashMap<TierKey, Vec<u8>> = HashMap::new();
    let mut rng = Rng(seed);
    let mut out = Vec::new();
    let (mut fulls, mut stored_after_full) = (0, 0);
    for step in 0..30_000u64 {
        // A key space whose values need more than the tier holds, so it fills up.
        let key = TierKey { pool: u32::try_from(rng.below(2)).unwrap(), object: rng.below(3), index: rng.below(130) };
        match rng.below(100) {
            0..=44 => {
                let v = rng.value(step);
                match tier.put(key, &v).unwrap() {
                    TierPut::Stored => {
                        if fulls > 0 {
                            stored_after_full += 1;
                        }
                        oracle.insert(key, v);
                    }
                    TierPut::Full => {
                        fulls += 1;
                        oracle.remove(&key); // a refused put drops the older value
                    }
                }
            }
            45..=64 => assert_eq!(tier.remove(key).unwrap(), oracle.remove(&key).is_some(), "remove {key:?}"),
            88..=97 => {
                // A batched get of a run of indices, as swap readahead does.
                let n = rng.below(16) + 1;
                let mut keys: Vec<TierKey> = (0..n).map(|j| TierKey { index: key.index + j, ..key }).collect();
                if step % 7 == 0 {
                    // An empty value among them.
                    let empty = TierKey { index: 1_000_000 + step, ..key };
                    if tier.put(empty, &[]).unwrap() == TierPut::Stored {
                        tier.flush().unwrap();
                        oracle.insert(empty, Vec::new());
                    } else {
                        fulls += 1;
                        oracle.remove(&empty);
                    }
                    keys.push(empty);
                }
                for (k, got) in keys.iter().zip(tier.get_batch(&keys)) {
                    assert_eq!(got.unwrap().as_ref(), oracle.get(k), "step {step}: batched {k:?}");
                }
            }
            65..=87 => match oracle.get(&key) {
                Some(v) => {
                    assert_eq!(tier.get(key, &mut out).unwrap(), TierGet::Hit, "step {step}: {key:?}");
                    assert_eq!(&out, v, "step {step}: value of {key:?}");
                }
                None => assert_eq!(tier.get(key, &mut out).unwrap(), TierGet::Miss, "step {step}: {key:?}"),
            },
            98 => tier.flush().unwrap(),
            _ => {
                if rng.below(20) == 0 {
                    let pool = u32::try_from(rng.below(2)).unwrap();
                    tier.clear_pool(pool).unwrap();
                    oracle.retain(|k, _| k.pool != pool);
                }
            }
        }
        if step % 1000 == 0 {
            check_invariants(&tier);
        }
    }
    check_invariants(&tier);
    for (k, v) in &oracle {
        assert_eq!(tier.get(*k, &mut out).unwrap(), TierGet::Hit, "{k:?}");
        assert_eq!(&out, v);
    }
    let ds = tier.disk_stats();
    eprintln!("{}", serde_json::to_string_pretty(&ds).unwrap());
    assert_eq!(ds.tier.stored_pages, oracle.len() as u64);
    assert_eq!(ds.tier.stored_bytes, oracle.values().map(|v| v.len() as u64).sum::<u64>());
    assert_eq!(tier.capacity().stored_pages, oracle.len() as u64);
    assert!(fulls > 0 && ds.tier.full == fulls, "never full: {ds:?}");
    assert!(stored_after_full > 0, "nothing stored after the first Full");
    assert!(ds.gc_runs > 0 && ds.gc_moved_values > 0, "GC never ran: {ds:?}");
    assert!(ds.discards > 0 && ds.discard_supported, "{ds:?}");
    assert_eq!(ds.tier.failures, 0);
    assert!(tier.capacity().used_bytes <= tier.capacity().limit_bytes.unwrap());
    // Everything removed: every segment comes back.
    for p in [0, 1] {
        tier.clear_pool(p).unwrap();
    }
    tier.flush().unwrap();
    check_invariants(&tier);
    let ds = tier.disk_stats();
    assert_eq!((ds.live_bytes, ds.tier.stored_pages), (0, 0));
    assert!(ds.free_segments >= 7, "{ds:?}");
}

#[test]
fn model_direct_io() {
    model(&disk_dir(), true, 0x5eed);
}

#[test]
fn model_buffered_io() {
    model(&tmpfs_dir(), false, 0xfeed);
}

#[test]
fn concurrent_threads_with_gc() {
    let p = TempPath::new(disk_dir(), "threads");
    let tier = config(&p, 64 << 10, 10).build().unwrap();
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let tier = &tier;
            s.spawn(move || {
                let mut rng = Rng(t * 7919 + 1);
                let mut oracle: HashMap<TierKey, Vec<u8>> = HashMap::new();
                let mut out = Vec::new();
                for step in 0..5000u64 {
                    let key = TierKey { pool: 9, object: t, index: rng.below(60) };
                    match rng.below(10) {
                        0..=4 => {
                            let v = rng.value(step);
                            if tier.put(key, &v).unwrap() == TierPut::Stored {
                                oracle.insert(key, v);
                            } else {
                                oracle.remove(&key);
                            }
                        }
                        5..=6 => assert_eq!(tier.remove(key).unwrap(), oracle.remove(&key).is_some()),
                        7 if step % 50 == 7 => tier.flush().unwrap(),
                        _ => match oracle.get(&key) {
                            Some(v) => {
                                assert_eq!(tier.get(key, &mut out).unwrap(), TierGet::Hit, "{key:?}");
                                assert_eq!(&out, v, "thread {t} step {step} {key:?}");
                            }
                            None => assert_eq!(tier.get(key, &mut out).unwrap(), TierGet::Miss),
                        },
                    }
                }
                for (k, v) in &oracle {
                    assert_eq!(tier.get(*k, &mut out).unwrap(), TierGet::Hit);
                    assert_eq!(&out, v);
                }
            });
        }
    });
    check_invariants(&tier);
    let ds = tier.disk_stats();
    eprintln!("{}", serde_json::to_string_pretty(&ds).unwrap());
    assert!(ds.gc_runs > 0, "{ds:?}");
    assert_eq!(ds.tier.failures, 0);
    assert_eq!(tier.health(), Health::Healthy);
}

#[test]
fn restart_starts_empty() {
    let p = TempPath::new(disk_dir(), "restart");
    let key = TierKey { pool: 1, object: 2, index: 3 };
    {
        let tier = config(&p, 64 << 10, 8).build().unwrap();
        for i in 0..200 {
            assert_eq!(tier.put(TierKey { index: i, ..key }, &[7; 2000]).unwrap(), TierPut::Stored);
        }
        tier.flush().unwrap();
        assert!(allocated_bytes(&p.0) >= 200 * 2000);
        // A second tier on the same file is refused while the first lives.
        let e = config(&p, 64 << 10, 8).build().unwrap_err();
        assert!(e.to_string().contains("in use"), "{e}");
    }
    assert_eq!(allocated_bytes(&p.0), 0, "dropping the tier frees the file's blocks");
    // Size from the existing file.
    let tier = DiskTierConfig { segment_bytes: 64 << 10, ..DiskTierConfig::new(&p.0) }.build().unwrap();
    assert_eq!(tier.capacity(), Capacity { stored_pages: 0, used_bytes: 0, limit_bytes: Some(8 * (64 << 10)) });
    let mut out = Vec::new();
    for i in 0..200 {
        assert_eq!(tier.get(TierKey { index: i, ..key }, &mut out).unwrap(), TierGet::Miss);
    }
    assert_eq!(tier.stats().stored_pages, 0);
}

#[test]
fn tampered_bytes_fail_authentication() {
    let p = TempPath::new(disk_dir(), "tamper");
    let tier = config(&p, 64 << 10, 8).build().unwrap();
    let sealer = Sealer::new(&MasterKey::from_bytes([3; 32])).unwrap();
    let mut rng = Rng(99);
    let sealed: Vec<(TierKey, u64, Vec<u8>)> = (0..120u64)
        .map(|i| {
            let key = TierKey { pool: 4, object: 1, index: i };
            let (mut plain, mut v) = (rng.value(i), Vec::new());
            plain.resize(1500, 0x55);
            sealer.seal(key, i + 1000, &plain, &mut v);
            (key, i + 1000, v)
        })
        .collect();
    let items: Vec<(TierKey, &[u8])> = sealed.iter().map(|(k, _, v)| (*k, v.as_slice())).collect();
    assert!(tier.put_batch(&items).into_iter().all(|r| r.unwrap() == TierPut::Stored));
    // The first value's segment is full and on disk (the batch spans ~3 segments).
    let (key, version, value) = &sealed[0];
    assert_eq!(tier.lock().segs[0].state, SegState::Sealed);
    let off = tier.value_file_offset(*key).unwrap();
    let file = std::fs::read(&p.0).unwrap();
    let found = file.windows(value.len()).position(|w| w == value.as_slice()).unwrap();
    assert_eq!(u64::try_from(found).unwrap(), off, "the accessor and a search of the file agree");
    // Untouched: opens.
    let mut out = Vec::new();
    assert_eq!(tier.get(*key, &mut out).unwrap(), TierGet::Hit);
    sealer.open(*key, *version, &mut out).unwrap();
    // Flip one byte on disk, behind the tier's back.
    let raw = OpenOptions::new().write(true).open(&p.0).unwrap();
    let at = off + 100;
    let i = usize::try_from(at).unwrap();
    raw.write_all_at(&[file[i] ^ 0x20], at).unwrap();
    drop(raw);
    // The get above read its span before the change.
    tier.lock().around.clear();
    // The tier returns what it has; authentication is the caller's job.
    assert_eq!(tier.get(*key, &mut out).unwrap(), TierGet::Hit);
    assert_eq!(out.len(), value.len());
    assert_ne!(&out, value);
    assert!(matches!(sealer.open(*key, *version, &mut out), Err(SealError::Auth)));
    // Neighbours are intact.
    for (k, ver, v) in &sealed[1..] {
        assert_eq!(tier.get(*k, &mut out).unwrap(), TierGet::Hit);
        assert_eq!(&out, v);
        sealer.open(*k, *ver, &mut out).unwrap();
    }
}

#[test]
fn freed_segments_are_punched_out_of_the_file() {
    let p = TempPath::new(disk_dir(), "punch");
    let seg = 64 << 10;
    let tier = config(&p, seg, 32).build().unwrap();
    let vals: Vec<(TierKey, Vec<u8>)> = (0..800u64)
        .map(|i| (TierKey { pool: 1, object: i, index: 0 }, vec![u8::try_from(i % 251).unwrap(); 1800]))
        .collect();
    let items: Vec<(TierKey, &[u8])> = vals.iter().map(|(k, v)| (*k, v.as_slice())).collect();
    assert!(tier.put_batch(&items).into_iter().all(|r| r.unwrap() == TierPut::Stored));
    let full = allocated_bytes(&p.0);
    assert!(full >= 800 * 1800, "{full}");
    // Packed: ~22 segments for 800 values of 1800 bytes, not 800 slots of 4 KiB.
    let ds = tier.disk_stats();
    assert!(ds.free_segments >= 32 - 23, "{ds:?}");
    for (k, _) in &vals {
        assert!(tier.remove(*k).unwrap());
    }
    tier.flush().unwrap();
    let after = allocated_bytes(&p.0);
    assert!(after <= 2 * u64::from(seg), "{after} bytes still allocated after removing everything");
    assert!(tier.disk_stats().discards >= 20);
    check_invariants(&tier);
}

#[test]
fn configuration_errors() {
    let p = TempPath::new(disk_dir(), "cfg");
    let e = DiskTierConfig::new(&p.0).build().unwrap_err();
    assert!(e.to_string().contains("capacity_bytes is 0"), "{e}");
    assert!(!p.0.exists(), "not created on error");
    let e = config(&p, 64 << 10, 3).build().unwrap_err();
    assert!(e.to_string().contains("at least 4"), "{e}");
    let e = config(&p, 5000, 100).build().unwrap_err();
    assert!(e.to_string().contains("multiple of 4096"), "{e}");
    let e = DiskTierConfig { capacity_bytes: 1 << 20, ..DiskTierConfig::new(disk_dir()) }.build().unwrap_err();
    assert!(e.to_string().contains("not a regular file"), "{e}");
    let c: DiskTierConfig = serde_json::from_str(r#"{"path": "/var/tmp/x"}"#).unwrap();
    assert_eq!(c, DiskTierConfig::new("/var/tmp/x"));
}

#[test]
fn values_straddling_pages_and_segments_ends() {
    // Every length and alignment of the last record of a segment.
    let p = TempPath::new(disk_dir(), "edges");
    let tier = config(&p, 64 << 10, 6).build().unwrap();
    let mut rng = Rng(5);
    let mut all = Vec::new();
    for i in 0..120u64 {
        let key = TierKey { pool: 1, object: 0, index: i };
        let v = rng.value(i);
        assert_eq!(tier.put(key, &v).unwrap(), TierPut::Stored);
        all.push((key, v));
        if i % 17 == 0 {
            tier.flush().unwrap();
        }
    }
    tier.flush().unwrap();
    let mut out = Vec::new();
    for (k, v) in &all {
        assert_eq!(tier.get(*k, &mut out).unwrap(), TierGet::Hit);
        assert_eq!(&out, v);
    }
    check_invariants(&tier);
}

/// Needs root, a loop device and losetup; skips (see `tmem_testkit::skip`) without them.
#[test]
fn conformance_on_a_loop_block_device() {
    use tmem_testkit::{skip, Feature};
    if !tmem_testkit::is_root() {
        skip(Feature::Root, "attaching a loop device needs root");
        return;
    }
    if !Path::new("/dev/loop-control").exists() {
        skip(Feature::Loop, "/dev/loop-control is missing");
        return;
    }
    if !tmem_testkit::have_tool("losetup") {
        skip(Feature::Tools, "losetup is not installed (util-linux)");
        return;
    }
    let backing = TempPath::new(disk_dir(), "loop-backing");
    std::fs::File::create(&backing.0).unwrap().set_len(16 << 20).unwrap();
    let out = std::process::Command::new("losetup").args(["--find", "--show"]).arg(&backing.0).output().unwrap();
    assert!(out.status.success(), "losetup: {}", String::from_utf8_lossy(&out.stderr));
    let dev = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    let result = std::panic::catch_unwind(|| {
        let tier = DiskTierConfig::new(&dev).build().unwrap();
        let ds = tier.disk_stats();
        assert!(ds.block_device, "{ds:?}");
        assert_eq!(ds.segments, 16);
        assert!(tier.direct_io());
        conformance::check(&tier, Expect::Stores);
        let e = DiskTierConfig::new(&dev).build().unwrap_err();
        assert!(e.to_string().contains("busy") || e.to_string().contains("in use"), "{e}");
    });
    let detach = std::process::Command::new("losetup").args(["-d", &dev]).status().unwrap();
    assert!(detach.success());
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
}

#[test]
fn gc_survives_a_corrupted_record_header() {
    let p = TempPath::new(disk_dir(), "gc-header");
    let tier = config(&p, 64 << 10, 6).build().unwrap();
    let value = |i: u64| vec![u8::try_from(i % 241).unwrap(); 2000];
    let key = |i: u64| TierKey { pool: 1, object: 0, index: i };
    // Four full segments (32 records of 2024 bytes each).
    for i in 0..128 {
        assert_eq!(tier.put(key(i), &value(i)).unwrap(), TierPut::Stored);
    }
    let seg_of = |i: u64| tier.lock().index[&key(i)].seg;
    let in_first: Vec<u64> = (0..128).filter(|&i| seg_of(i) == 0).collect();
    assert!(in_first.len() > 20 && tier.lock().segs[0].state == SegState::Sealed);
    // Segment 0 keeps three values: the GC's victim.
    let keep = [in_first[0], in_first[10], in_first[in_first.len() - 1]];
    for i in &in_first {
        if !keep.contains(i) {
            assert!(tier.remove(key(*i)).unwrap());
        }
    }
    // Corrupt the first record's length on disk: the header walk stops there.
    let raw = OpenOptions::new().write(true).open(&p.0).unwrap();
    raw.write_all_at(&0xFFFF_u32.to_le_bytes(), 20).unwrap();
    drop(raw);
    let mut i = 1000;
    while tier.disk_stats().gc_runs == 0 {
        assert_eq!(tier.put(key(i), &value(i)).unwrap(), TierPut::Stored, "put {i}");
        i += 1;
    }
    let mut out = Vec::new();
    for k in keep {
        assert_ne!(seg_of(k), 0, "moved out of the victim");
        assert_eq!(tier.get(key(k), &mut out).unwrap(), TierGet::Hit);
        assert_eq!(out, value(k), "value {k} intact after the GC");
    }
    check_invariants(&tier);
}

#[test]
fn failed_segment_writes_keep_values_and_are_retried() {
    let p = TempPath::new(disk_dir(), "eio");
    let tier = config(&p, 64 << 10, 8).build().unwrap();
    let key = |i: u64| TierKey { pool: 1, object: 0, index: i };
    let value = |i: u64| vec![u8::try_from(i % 199).unwrap(); 1500];
    tier.fail_writes.store(1, Ordering::SeqCst);
    // ~42 records per segment: the first segment's write fails.
    for i in 0..60 {
        assert_eq!(tier.put(key(i), &value(i)).unwrap(), TierPut::Stored);
    }
    assert!(matches!(tier.health(), Health::Down(r) if r.contains("segment write")), "{:?}", tier.health());
    let ds = tier.disk_stats();
    assert_eq!((ds.failed_writes, ds.tier.failures), (1, 1), "{ds:?}");
    let mut out = Vec::new();
    for i in 0..60 {
        assert_eq!(tier.get(key(i), &mut out).unwrap(), TierGet::Hit, "served from memory");
        assert_eq!(out, value(i));
    }
    // While the device fails, flush reports it; once it works, the retry succeeds.
    tier.fail_writes.store(1, Ordering::SeqCst);
    assert!(tier.flush().is_err());
    tier.flush().unwrap();
    assert_eq!(tier.health(), Health::Healthy);
    assert_eq!(tier.disk_stats().failed_writes, 0);
    assert_eq!(tier.lock().segs[0].state, SegState::Sealed);
    for i in 0..60 {
        assert_eq!(tier.get(key(i), &mut out).unwrap(), TierGet::Hit, "from disk");
        assert_eq!(out, value(i));
    }
    check_invariants(&tier);
}

/// A tier the test still sees after the conformance suite drops its box.
struct Shared(Arc<DiskTier>);

impl Tier for Shared {
    fn name(&self) -> &str {
        self.0.name()
    }
    fn put(&self, key: TierKey, value: &[u8]) -> Result<TierPut, TierError> {
        self.0.put(key, value)
    }
    fn get(&self, key: TierKey, out: &mut Vec<u8>) -> Result<TierGet, TierError> {
        self.0.get(key, out)
    }
    fn remove(&self, key: TierKey) -> Result<bool, TierError> {
        self.0.remove(key)
    }
    fn put_batch(&self, items: &[(TierKey, &[u8])]) -> Vec<Result<TierPut, TierError>> {
        self.0.put_batch(items)
    }
    fn get_batch(&self, keys: &[TierKey]) -> Vec<Result<Option<Vec<u8>>, TierError>> {
        self.0.get_batch(keys)
    }
    fn clear_pool(&self, pool: u32) -> Result<(), TierError> {
        self.0.clear_pool(pool)
    }
    fn capacity(&self) -> Capacity {
        self.0.capacity()
    }
    fn health(&self) -> Health {
        self.0.health()
    }
    fn stats(&self) -> TierStats {
        self.0.stats()
    }
}

#[test]
fn conformance_hand_over_across_segments_and_gc() {
    let p = TempPath::new(disk_dir(), "handover-conf");
    // 12 segments of 64 KiB: the suite's values fill ten, and the successor's puts need the GC.
    let tier = config(&p, 64 << 10, 12).build().unwrap();
    let next = std::sync::OnceLock::new();
    conformance::check_hand_over(&tier, &|h| {
        let t = Arc::new(DiskTier::adopt(h).unwrap());
        next.set(Arc::clone(&t)).unwrap();
        Box::new(Shared(t))
    });
    check_invariants(&tier);
    assert!(tier.disk_stats().segment_writes >= 8, "{:?}", tier.disk_stats());
    let next = next.get().unwrap();
    check_invariants(next);
    assert!(next.disk_stats().gc_runs > 0, "{:?}", next.disk_stats());
}

/// Random puts and removes of values of 300 keys (~360 KB live for 448 KB of
/// usable segments: the GC runs); `oracle` follows.
fn churn(tier: &DiskTier, oracle: &mut HashMap<TierKey, Vec<u8>>, rng: &mut Rng, steps: u64) {
    for step in 0..steps {
        let key = TierKey { pool: u32::from(rng.below(4) == 0), object: 0, index: rng.below(300) };
        if rng.below(10) < 7 {
            let v = rng.value(step);
            match tier.put(key, &v).unwrap() {
                TierPut::Stored => oracle.insert(key, v),
                TierPut::Full => oracle.remove(&key),
            };
        } else {
            assert_eq!(tier.remove(key).unwrap(), oracle.remove(&key).is_some());
        }
    }
}

fn check_values(tier: &DiskTier, oracle: &HashMap<TierKey, Vec<u8>>) {
    let mut out = Vec::new();
    for (k, v) in oracle {
        assert_eq!(tier.get(*k, &mut out).unwrap(), TierGet::Hit, "{k:?}");
        assert_eq!(&out, v, "{k:?}");
    }
    let keys: Vec<TierKey> = oracle.keys().copied().collect();
    for (k, g) in keys.iter().zip(tier.get_batch(&keys)) {
        assert_eq!(g.unwrap().as_deref(), Some(oracle[k].as_slice()), "batch {k:?}");
    }
}

/// A restart after the GC has run: the successor holds and counts the same,
/// and goes on putting and collecting.
fn hand_over_after_gc(dir: &Path, direct_io: bool, seed: u64) {
    let p = TempPath::new(dir, "handover-gc");
    let old = DiskTierConfig { direct_io, ..config(&p, 64 << 10, 8) }.build().unwrap();
    let (mut oracle, mut rng) = (HashMap::new(), Rng(seed));
    while old.disk_stats().gc_runs < 3 {
        churn(&old, &mut oracle, &mut rng, 500);
    }
    churn(&old, &mut oracle, &mut rng, 77); // the open segment has unwritten pages
    let st = old.lock();
    assert!(st.open.as_ref().is_some_and(|o| o.flushed < st.segs[us(o.seg)].used), "unwritten pages");
    drop(st);
    let capacity = old.capacity();
    let h = old.hand_over().unwrap();
    assert_eq!((h.kind.as_str(), h.fds.len()), ("disk", 1));
    let next = DiskTier::adopt(h).unwrap();
    check_invariants(&next);
    assert_eq!(next.capacity(), capacity);
    assert_eq!(next.direct_io(), direct_io);
    // Counters carry on; latencies are the new process's own.
    let (mut want, got) = (old.disk_stats(), next.disk_stats());
    (want.tier.get_p50_us, want.tier.get_p99_us, want.tier.put_p50_us, want.tier.put_p99_us) =
        (got.tier.get_p50_us, got.tier.get_p99_us, got.tier.put_p50_us, got.tier.put_p99_us);
    assert_eq!(got, want);
    // The predecessor steps down; its drop leaves the file.
    next.set_owner(true);
    old.set_owner(false);
    drop(old);
    check_values(&next, &oracle);
    let gc_runs = got.gc_runs;
    while next.disk_stats().gc_runs < gc_runs + 3 {
        churn(&next, &mut oracle, &mut rng, 500);
    }
    check_invariants(&next);
    check_values(&next, &oracle);
    next.flush().unwrap();
    assert_eq!(next.disk_stats().tier.failures, 0);
    assert_eq!(next.health(), Health::Healthy);
}

#[test]
fn hand_over_after_gc_direct_io() {
    hand_over_after_gc(&disk_dir(), true, 0xabc);
}

#[test]
fn hand_over_after_gc_buffered_io() {
    hand_over_after_gc(&tmpfs_dir(), false, 0xdef);
}

#[test]
fn an_adopted_tier_owns_the_file_only_when_told() {
    let p = TempPath::new(disk_dir(), "handover-owner");
    let old = config(&p, 64 << 10, 8).build().unwrap();
    let oracle: HashMap<TierKey, Vec<u8>> =
        (0..100u64).map(|i| (TierKey { pool: 1, object: 0, index: i }, vec![u8::try_from(i).unwrap(); 2000])).collect();
    for (k, v) in &oracle {
        assert_eq!(old.put(*k, v).unwrap(), TierPut::Stored);
    }
    let adopt = || DiskTier::adopt(old.hand_over().unwrap()).unwrap();
    // A successor that fails (dropped before it serves) leaves the predecessor's file alone.
    let failed = adopt();
    let allocated = allocated_bytes(&p.0);
    assert!(allocated >= 100 * 2000, "{allocated}");
    drop(failed);
    assert_eq!(allocated_bytes(&p.0), allocated);
    check_values(&old, &oracle);
    // One that took over owns it.
    let next = adopt();
    next.set_owner(true);
    old.set_owner(false);
    drop(old);
    assert_eq!(allocated_bytes(&p.0), allocated);
    check_values(&next, &oracle);
    drop(next);
    assert_eq!(allocated_bytes(&p.0), 0, "the owner's drop empties the file");
}

#[test]
fn a_failed_hand_over_leaves_the_tier_serving() {
    let p = TempPath::new(disk_dir(), "handover-eio");
    let tier = config(&p, 64 << 10, 8).build().unwrap();
    // Nothing put yet: no open segment.
    let empty = DiskTier::adopt(tier.hand_over().unwrap()).unwrap();
    assert_eq!(empty.capacity(), tier.capacity());
    drop(empty);
    let key = |i: u64| TierKey { pool: 1, object: 0, index: i };
    let value = |i: u64| vec![u8::try_from(i % 199).unwrap(); 1500];
    tier.fail_writes.store(u32::MAX, Ordering::SeqCst);
    for i in 0..60 {
        assert_eq!(tier.put(key(i), &value(i)).unwrap(), TierPut::Stored);
    }
    assert!(tier.hand_over().is_err(), "writes fail");
    tier.fail_writes.store(0, Ordering::SeqCst);
    let oracle: HashMap<_, _> = (0..60).map(|i| (key(i), value(i))).collect();
    check_values(&tier, &oracle);
    let next = DiskTier::adopt(tier.hand_over().unwrap()).unwrap();
    check_values(&next, &oracle);
    check_invariants(&next);
}

/// Offsets in a hand-over state: the segment table, the free list and the index.
fn layout(state: &[u8]) -> (usize, usize, usize) {
    let u32_at = |i: usize| us(u32::from_le_bytes(state[i..i + 4].try_into().unwrap()));
    let segs_at = 25 + u32_at(21);
    let free_at = segs_at + 17 * u32_at(16) + 8;
    (segs_at, free_at, free_at + 4 + 4 * u32_at(free_at) + 8)
}

#[test]
fn corrupt_hand_over_states_are_refused() {
    let p = TempPath::new(disk_dir(), "handover-corrupt");
    let tier = config(&p, 64 << 10, 6).build().unwrap();
    let key = |i: u64| TierKey { pool: 1, object: 0, index: i };
    for i in 0..70 {
        assert_eq!(tier.put(key(i), &vec![u8::try_from(i).unwrap(); 2000]).unwrap(), TierPut::Stored);
    }
    for i in (0..70).step_by(4) {
        assert!(tier.remove(key(i)).unwrap());
    }
    let good = tier.hand_over().unwrap().state;
    let fd = || vec![OwnedFd::from(tier.file.try_clone().unwrap())];
    let adopt = |state: Vec<u8>| DiskTier::adopt(TierHandover { kind: "disk".into(), state, fds: fd() });
    let refused = |state: Vec<u8>, what: &str| match adopt(state) {
        Err(e @ TierError::Config { .. }) => assert!(e.to_string().contains(what), "{what}: {e}"),
        r => panic!("{what}: {r:?}"),
    };
    check_invariants(&adopt(good.clone()).unwrap());

    // The checksum: every flipped byte, every truncation.
    for i in 0..good.len() {
        for mask in [0x01, 0x80, 0xff] {
            let mut s = good.clone();
            s[i] ^= mask;
            refused(s, "checksum");
        }
    }
    for n in 0..good.len() {
        assert!(matches!(adopt(good[..n].to_vec()), Err(TierError::Config { .. })), "truncated to {n}");
    }

    // With a valid checksum, each number is checked: no change is a panic or an inconsistent tier.
    let body = &good[..good.len() - 4];
    let seal = |mut s: Vec<u8>| {
        let crc = crc32fast::hash(&s);
        s.extend_from_slice(&crc.to_le_bytes());
        s
    };
    for i in 0..body.len() {
        for mask in [0x01, 0x80, 0xff] {
            let mut s = body.to_vec();
            s[i] ^= mask;
            if let Ok(t) = adopt(seal(s)) {
                check_invariants(&t);
            }
        }
    }
    let (segs_at, free_at, index_at) = layout(body);
    let edit = |at: usize, bytes: &[u8]| {
        let mut s = body.to_vec();
        s[at..at + bytes.len()].copy_from_slice(bytes);
        seal(s)
    };
    let counters_at = body.len() - 4 - stats::COUNTERS * 8;
    let last = counters_at - 32; // the last index entry
    refused(edit(0, b"tmemdist"), "not a disk tier");
    refused(edit(8, &2u32.to_le_bytes()), "version 2");
    refused(edit(12, &5000u32.to_le_bytes()), "segment size 5000");
    refused(edit(16, &u32::MAX.to_le_bytes()), "overrun");
    refused(edit(segs_at, &[9]), "segment 0: state 9");
    refused(edit(segs_at + 5, &u32::MAX.to_le_bytes()), "segment 0: Sealed");
    refused(edit(free_at + 8, &body[free_at + 4..free_at + 8]), "listed twice");
    refused(edit(index_at - 8, &u64::MAX.to_le_bytes()), "overrun");
    refused(edit(last + 20, &99u32.to_le_bytes()), "outside its segment");
    refused(edit(last + 28, &u32::MAX.to_le_bytes()), "outside its segment");
    refused(edit(last, &body[last - 32..last - 12]), "listed twice");
    let more = u32::try_from(stats::COUNTERS + 1).unwrap();
    refused(edit(counters_at, &more.to_le_bytes()), "counters; this build knows");
    // A predecessor that knew one counter fewer: the newest starts at 0.
    let mut older = body[..counters_at].to_vec();
    older.extend_from_slice(&u32::try_from(stats::COUNTERS - 1).unwrap().to_le_bytes());
    older.extend_from_slice(&body[counters_at + 4..body.len() - 8]);
    let t = adopt(seal(older)).unwrap();
    check_invariants(&t);
    assert_eq!(t.disk_stats().tier.writes, tier.disk_stats().tier.writes);
    refused(seal([body, &[0]].concat()), "trailing");
    // An index entry of the open segment naming another key: its header disagrees.
    let open = u32::from_le_bytes(body[free_at - 8..free_at - 4].try_into().unwrap());
    let entries = (index_at..last + 1).step_by(32);
    let in_open = entries.clone().find(|&e| body[e + 20..e + 24] == open.to_le_bytes()).unwrap();
    refused(edit(in_open + 4, &u64::MAX.to_le_bytes()), "does not hold");
    // Two records of one segment at one offset.
    let seg_of = |e: usize| &body[e + 20..e + 24];
    let (a, b) = entries
        .clone()
        .flat_map(|a| entries.clone().map(move |b| (a, b)))
        .find(|&(a, b)| a < b && seg_of(a) == seg_of(b))
        .unwrap();
    refused(edit(b + 24, &body[a + 24..a + 28]), "overlap");

    // The descriptor and the kind.
    let h = |kind: &str, fds| TierHandover { kind: kind.into(), state: good.clone(), fds };
    let e = DiskTier::adopt(h("mem", fd())).unwrap_err();
    assert!(e.to_string().contains("\"mem\" tier"), "{e}");
    let e = DiskTier::adopt(h("disk", Vec::new())).unwrap_err();
    assert!(e.to_string().contains("0 descriptors"), "{e}");
    let small = TempPath::new(disk_dir(), "handover-small");
    let f = OpenOptions::new().read(true).write(true).create(true).custom_flags(libc::O_DIRECT).open(&small.0);
    let e = DiskTier::adopt(h("disk", vec![f.unwrap().into()])).unwrap_err();
    assert!(e.to_string().contains("segments need"), "{e}");
    let ro = File::open(&p.0).unwrap();
    let e = DiskTier::adopt(h("disk", vec![ro.into()])).unwrap_err();
    assert!(e.to_string().contains("reading and writing"), "{e}");
    let buffered = OpenOptions::new().read(true).write(true).open(&p.0).unwrap();
    let e = DiskTier::adopt(h("disk", vec![buffered.into()])).unwrap_err();
    assert!(e.to_string().contains("O_DIRECT"), "{e}");
    let other = OpenOptions::new().read(true).write(true).custom_flags(libc::O_DIRECT).open(&p.0).unwrap();
    let e = DiskTier::adopt(h("disk", vec![other.into()])).unwrap_err();
    assert!(e.to_string().contains("in use by another disk tier"), "{e}");
    // All of that left the tier as it was.
    check_invariants(&tier);
    let mut out = Vec::new();
    for i in 0..70 {
        let hit = if i % 4 == 0 { TierGet::Miss } else { TierGet::Hit };
        assert_eq!(tier.get(key(i), &mut out).unwrap(), hit);
    }
}
