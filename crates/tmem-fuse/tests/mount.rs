//! Mounts real FUSE exports (root only) and drives them through the kernel.

use rand_xoshiro::rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use std::fs::OpenOptions;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::Duration;

use tmem_block::{BlockDevice, DeviceConfig};
use tmem_fuse::{Export, FuseConfig, FuseMount, Transport};
use tmem_testkit::{skip, Feature};

/// Whether FUSE can be mounted here; reports the skip when not.
fn can_mount() -> bool {
    if !tmem_testkit::is_root() {
        skip(Feature::Root, "needs root to mount FUSE");
        return false;
    }
    if !std::path::Path::new("/dev/fuse").exists() {
        skip(Feature::Fuse, "/dev/fuse is missing");
        return false;
    }
    true
}

/// Whether FUSE can be mounted over io_uring here; reports the skip when not.
fn can_mount_over_uring() -> bool {
    if !can_mount() {
        return false;
    }
    if !std::path::Path::new("/sys/module/fuse/parameters/enable_uring").exists() {
        skip(Feature::FuseUring, "this kernel has no FUSE over io_uring (Linux 6.14+)");
        return false;
    }
    true
}

/// A mount point, removed with `remove_dir` (never recursively, unlike
/// `tempfile::TempDir`: should a test fail with the FUSE file system still
/// mounted there, a recursive removal would delete through the mount).
struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

fn tempdir(tag: &str) -> TempDir {
    let p = std::env::temp_dir().join(format!("tmem-fuse-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&p).unwrap();
    TempDir(p)
}

fn device(name: &str, size: u64) -> Arc<tmem_block::PoolDevice> {
    Arc::new(
        DeviceConfig { name: name.into(), size, store: Default::default(), tiers: None, recompress: None }
            .build()
            .unwrap(),
    )
}

#[test]
fn files_read_write_punch_and_list() {
    if !can_mount() {
        return;
    }
    let (m, _dir) = read_write_punch_and_list("rw", 0);
    assert_eq!(m.transport(), Transport::DevFuse);
    assert_eq!(m.uring_requests(), 0);
    m.unmount().unwrap();
}

#[test]
fn files_read_write_punch_and_list_over_io_uring() {
    if !can_mount_over_uring() {
        return;
    }
    let switch_before = std::fs::read_to_string("/sys/module/fuse/parameters/enable_uring").unwrap();
    let (m, _dir) = read_write_punch_and_list("uring", 2);
    let workers = 2 * std::thread::available_parallelism().map_or(1, usize::from);
    assert!(matches!(m.transport(), Transport::IoUring { workers: w } if w >= workers), "{}", m.transport());
    // Every request after the ring came up went over it: the file I/O alone
    // is a dozen requests.
    assert!(m.uring_requests() >= 10, "{} requests over io_uring", m.uring_requests());
    // The kernel switch is back as it was; the mount keeps its ring.
    let switch_after = std::fs::read_to_string("/sys/module/fuse/parameters/enable_uring").unwrap();
    assert_eq!(switch_after, switch_before);
    m.unmount().unwrap();
}

/// Two exports; reads, writes, a punched hole and the listing, through the
/// kernel. Returns the mount for transport checks, and its directory (to
/// remove after the unmount).
fn read_write_punch_and_list(tag: &str, uring_per_queue: usize) -> (FuseMount, TempDir) {
    let dir = tempdir(tag);
    let d0 = device("swap0", 64 << 20);
    let d1 = device("swap1", 8 << 20);
    let m = FuseMount::mount(FuseConfig {
        mountpoint: dir.0.clone(),
        exports: vec![
            Export { name: "swap0".into(), device: d0.clone() },
            Export { name: "swap1".into(), device: d1.clone() },
        ],
        threads: 2,
        uring_per_queue,
    })
    .unwrap();
    let mut names: Vec<String> =
        std::fs::read_dir(m.mountpoint()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    assert_eq!(names, ["swap0", "swap1"]);
    assert_eq!(std::fs::metadata(m.path_of("swap0")).unwrap().len(), 64 << 20);

    let mut f = OpenOptions::new().read(true).write(true).open(m.path_of("swap0")).unwrap();
    let data: Vec<u8> = (0..3 * 4096 + 100u32).map(|i| u8::try_from(i % 251).unwrap()).collect();
    f.write_all_at(&data, 10_000).unwrap();
    let mut back = vec![0u8; data.len()];
    f.read_exact_at(&mut back, 10_000).unwrap();
    assert_eq!(back, data);
    // The device saw it, and the other device did not.
    let mut direct = vec![0u8; data.len()];
    d0.read_at(&mut direct, 10_000).unwrap();
    assert_eq!(direct, data);
    assert_eq!(d1.stats().write_ios, 0);

    // Punching a hole frees pages and reads back zeros.
    let before = d0.stats().store.total.stored_pages;
    // SAFETY: valid fd; plain fallocate call.
    let rc = unsafe {
        libc::fallocate(
            std::os::fd::AsRawFd::as_raw_fd(&f),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            8192,
            16384,
        )
    };
    assert_eq!(rc, 0, "fallocate: {}", std::io::Error::last_os_error());
    assert!(d0.stats().store.total.stored_pages < before);
    f.read_exact_at(&mut back, 10_000).unwrap();
    assert!(back.iter().all(|&b| b == 0), "punched range reads as zeros");

    // Reads past the end are short; writes past the end fail.
    f.seek(SeekFrom::Start((64 << 20) - 10)).unwrap();
    let mut tail = Vec::new();
    f.read_to_end(&mut tail).unwrap();
    assert_eq!(tail.len(), 10);
    assert!(f.write_all_at(&[1; 4096], 64 << 20).is_err());
    // Flush and fsync reach the device and succeed.
    f.sync_all().unwrap();
    drop(f);
    let st = nix_statfs(m.mountpoint());
    assert_eq!(st, (64 << 20) / 4096 + (8 << 20) / 4096, "statfs counts the exports' blocks");
    (m, dir)
}

/// Total blocks `statfs` reports for `path`.
fn nix_statfs(path: &std::path::Path) -> u64 {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: `c` is NUL-terminated; `st` is plain data the call fills.
    unsafe {
        let mut st: libc::statfs = std::mem::zeroed();
        assert_eq!(libc::statfs(c.as_ptr(), &mut st), 0, "statfs: {}", std::io::Error::last_os_error());
        st.f_blocks
    }
}

#[test]
fn full_pool_gives_enospc_to_the_writer() {
    if !can_mount() {
        return;
    }
    full_pool_enospc("full", 0);
}

#[test]
fn full_pool_gives_enospc_to_the_writer_over_io_uring() {
    if !can_mount_over_uring() {
        return;
    }
    let served = full_pool_enospc("full-uring", 1);
    assert!(served > 0, "the error replies went over io_uring");
}

/// Writes 4 MiB of barely compressible pages into a 1 MiB pool; the writer
/// must get ENOSPC. Returns the requests served over io_uring.
fn full_pool_enospc(tag: &str, uring_per_queue: usize) -> u64 {
    let dir = tempdir(tag);
    let mut store = tmem_core::StoreConfig::default();
    store.policy.max_pool_bytes = 1 << 20;
    let dev = Arc::new(
        DeviceConfig { name: "small".into(), size: 64 << 20, store, tiers: None, recompress: None }.build().unwrap(),
    );
    let m = FuseMount::mount(FuseConfig {
        mountpoint: dir.0.clone(),
        exports: vec![Export { name: "small".into(), device: dev.clone() }],
        threads: 1,
        uring_per_queue,
    })
    .unwrap();
    let mut f = OpenOptions::new().write(true).open(m.path_of("small")).unwrap();
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(0x9e37_79b9_7f4a_7c15u64);
    let mut x = rng.next_u64();
    let mut err = None;
    for i in 0..1024u64 {
        let page: Vec<u8> = (0..4096)
            .map(|j| {
                x = rng.next_u64();
                if j % 4 == 0 {
                    x.to_le_bytes()[0]
                } else {
                    0
                }
            })
            .collect();
        if let Err(e) = f.seek(SeekFrom::Start(i * 4096)).and_then(|_| f.write_all(&page)) {
            err = Some(e);
            break;
        }
    }
    let err = err.expect("a 1 MiB pool must refuse 4 MiB of data");
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    assert!(dev.stats().failed_writes > 0);
    drop(f);
    let served = m.uring_requests();
    m.unmount().unwrap();
    served
}

#[test]
fn unmount_waits_for_a_busy_mount_to_be_let_go() {
    if !can_mount() {
        return;
    }
    let dir = tempdir("busy");
    let m = FuseMount::mount(FuseConfig {
        mountpoint: dir.0.clone(),
        exports: vec![Export { name: "swap0".into(), device: device("swap0", 8 << 20) }],
        threads: 2,
        uring_per_queue: 0,
    })
    .unwrap();
    // An open file keeps the mount busy, as a loop device that has not yet
    // let go of its file does; it closes 300 ms later.
    let f = std::fs::File::open(m.path_of("swap0")).unwrap();
    let closer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        drop(f);
    });
    let t = std::time::Instant::now();
    m.unmount().expect("unmounted once the file closed");
    assert!(t.elapsed() >= Duration::from_millis(250), "it waited for the file: {:?}", t.elapsed());
    closer.join().unwrap();
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    assert!(!mounts.contains(dir.0.to_str().unwrap()), "still mounted: {mounts}");
}
