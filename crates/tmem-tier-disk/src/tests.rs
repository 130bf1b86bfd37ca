use std::collections::HashMap;
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
