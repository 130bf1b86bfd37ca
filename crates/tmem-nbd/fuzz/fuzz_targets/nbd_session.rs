//! Arbitrary bytes as a whole client session, fed to the server's
//! connection handler over an in-memory duplex stream, against a small
//! PoolDevice, or a CacheDevice over a backing file (`tmem serve nbd
//! --backing`), and a ZeroDevice export. The handler must never panic and
//! must always terminate.
//!
//! The first byte picks a preamble so that the fuzzer also reaches the
//! transmission phase cheaply: 0 = raw (handshake fuzzed too), 1 = GO with
//! simple replies, 2 = structured replies + base:allocation + GO,
//! 3 = NBD_OPT_EXPORT_NAME of the default export. Bit 2 picks a strict
//! store (incompressible pages refused), bit 3 the cache device as the
//! default export.
#![no_main]

use std::io::{Read, Write};
use std::sync::{Arc, OnceLock};

use libfuzzer_sys::fuzz_target;
use tmem_block::{BlockDevice, CacheConfig, DeviceConfig, PoolDevice, ZeroDevice};
use tmem_nbd::proto::*;
use tmem_nbd::{serve_connection, Export, Exports};

/// Client input from a byte slice; server output counted and checked.
struct Duplex<'a> {
    input: &'a [u8],
    output: Vec<u8>,
}

impl Read for Duplex<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = buf.len().min(self.input.len());
        buf[..n].copy_from_slice(&self.input[..n]);
        self.input = &self.input[n..];
        Ok(n)
    }
}

impl Write for Duplex<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // Keep only the beginning: enough to check the greeting.
        if self.output.len() < 64 {
            self.output.extend_from_slice(&buf[..buf.len().min(64)]);
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn option(out: &mut Vec<u8>, opt: u32, data: &[u8]) {
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&opt.to_be_bytes());
    out.extend_from_slice(&u32::try_from(data.len()).unwrap().to_be_bytes());
    out.extend_from_slice(data);
}

fn preamble(mode: u8) -> Vec<u8> {
    let mut p = Vec::new();
    if mode == 0 {
        return p;
    }
    p.extend_from_slice(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes());
    let go = [0u8, 0, 0, 0, 0, 0]; // empty name, no info requests
    match mode {
        1 => option(&mut p, OPT_GO, &go),
        2 => {
            option(&mut p, OPT_STRUCTURED_REPLY, &[]);
            let mut meta = prefixed(b"", &[]);
            meta.extend_from_slice(&1u32.to_be_bytes());
            meta.extend_from_slice(&prefixed(META_BASE_ALLOCATION.as_bytes(), &[]));
            option(&mut p, OPT_SET_META_CONTEXT, &meta);
            option(&mut p, OPT_GO, &go);
        }
        _ => option(&mut p, OPT_EXPORT_NAME, &[]),
    }
    p
}

/// Size of the pool device.
const DISK: u64 = 256 << 10;

/// Two exports, the default one a pool device (`cache`: a cache device over
/// a backing file) per store policy, built once (a store is costly to build)
/// and emptied before every run so each run starts from the same contents.
fn exports(strict: bool, cache: bool) -> &'static (Arc<dyn BlockDevice>, Exports) {
    static CELLS: [OnceLock<(Arc<dyn BlockDevice>, Exports)>; 4] =
        [OnceLock::new(), OnceLock::new(), OnceLock::new(), OnceLock::new()];
    CELLS[usize::from(strict) + 2 * usize::from(cache)].get_or_init(|| {
        let mut store = tmem_core::StoreConfig::default();
        store.shards = 1;
        store.policy.incompressible =
            if strict { tmem_core::Incompressible::Reject } else { tmem_core::Incompressible::StoreRaw };
        let dev: Arc<dyn BlockDevice> = if cache {
            // A small pool, so that fills and writes also evict.
            store.policy.max_pool_bytes = 64 << 10;
            let backing = std::env::temp_dir().join(format!("tmem-nbd-fuzz-{}-{strict}.img", std::process::id()));
            std::fs::File::create(&backing).and_then(|f| f.set_len(DISK)).expect("backing file");
            let cfg = CacheConfig {
                name: "fuzz".into(),
                backing,
                store,
                eviction: tmem_core::Eviction::Sieve,
                backing_latency: std::time::Duration::ZERO,
            };
            Arc::new(cfg.build().expect("cache device"))
        } else {
            let cfg = DeviceConfig { name: "fuzz".into(), size: DISK, store, tiers: None, recompress: None };
            Arc::new(cfg.build().expect("device")) as Arc<PoolDevice>
        };
        let exports = Exports::new(vec![
            Export::new("disk", Arc::clone(&dev)),
            Export::new("zero", Arc::new(ZeroDevice::new(1 << 20)) as Arc<dyn BlockDevice>),
        ])
        .expect("exports");
        (dev, exports)
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let (dev, exports) = exports(mode & 4 != 0, mode & 8 != 0);
    dev.trim(0, DISK).expect("reset device");
    let mut input = preamble(mode % 4);
    input.extend_from_slice(rest);
    let mut d = Duplex { input: &input, output: Vec::new() };
    let _ = serve_connection(&mut d, exports);
    assert_eq!(&d.output[..18], &greeting()[..], "the server always greets first");
});
