//! The store hand-over parser (`Store::import`, `tmem swap restart`): any
//! bytes give a store or one error, never a panic. With the first byte odd,
//! the input overwrites part of a real export, so that mutations reach past
//! the header into codecs, pools and pages.

#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use tmem_core::{Key, PoolConfig, Store, StoreConfig, PAGE_SIZE};

fn config() -> StoreConfig {
    StoreConfig { shards: 1, ..StoreConfig::default() }
}

/// An export of a small store: a persistent and an ephemeral pool with
/// compressible, same-filled and random pages.
fn valid() -> &'static [u8] {
    static EXPORT: OnceLock<Vec<u8>> = OnceLock::new();
    EXPORT.get_or_init(|| {
        let store = config().build().expect("store");
        let pools = [store.create_pool(PoolConfig::persistent()), store.create_pool(PoolConfig::ephemeral())];
        for i in 0..24u64 {
            let mut page = [0u8; PAGE_SIZE];
            match i % 3 {
                0 => page.iter_mut().enumerate().for_each(|(j, b)| *b = (j % 7) as u8),
                1 => page.fill(9),
                _ => page.iter_mut().enumerate().for_each(|(j, b)| *b = (j as u64 * 2654435761 >> 13) as u8),
            }
            let _ = pools[(i % 2) as usize].put(Key::new(1, i), &page);
        }
        let mut out = Vec::new();
        store.export(&mut out).expect("export");
        out
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let input = if mode & 1 == 0 {
        rest.to_vec()
    } else {
        let mut base = valid().to_vec();
        let at = rest.first().map_or(0, |&b| usize::from(b) * base.len() / 256);
        let patch = rest.get(1..).unwrap_or_default();
        let end = (at + patch.len()).min(base.len());
        base[at..end].copy_from_slice(&patch[..end - at]);
        base
    };
    match Store::import(config(), &mut input.as_slice()) {
        Ok((store, _)) => drop(store.stats()),
        Err(e) => drop(e.to_string()),
    }
});
