//! The store hand-over parsers (`Store::import` and the zero-copy
//! `Store::import_image`, `tmem swap restart`): any bytes give a store or one
//! error, never a panic. With the first byte odd, the input overwrites part
//! of a real export, so that mutations reach past the header into codecs,
//! pools, pages and groups; its second bit picks an importing store that
//! groups or one that expands groups into pages; its third bit parses an
//! image instead, against the memfd of the real store it came from; its
//! fourth a pre-copy hand-over: an index snapshot (`Snapshot::read`, the
//! input overwriting it with the fifth bit set) and the image of its
//! changes (`Store::import_image_after`, overwritten otherwise).

#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use tmem_core::{GroupConfig, Key, PoolConfig, Snapshot, Store, StoreConfig, PAGE_SIZE};

/// With the input's second bit set, the importing store groups cold pages
/// (groups are imported as they are; otherwise they are expanded).
fn config(group: bool) -> StoreConfig {
    let group = group.then(|| GroupConfig { dictionary: false, level: 1, ..GroupConfig::default() });
    StoreConfig { shards: 1, group, shared_memory: true, ..StoreConfig::default() }
}

/// A small store and what it wrote of itself.
struct Valid {
    store: Store,
    export: Vec<u8>,
    image: Vec<u8>,
    /// Its index snapshot, and the image of the changes since (none).
    snapshot: Vec<u8>,
    changes: Vec<u8>,
}

/// A small store (a persistent and an ephemeral pool with compressible,
/// same-filled and random pages, two groups of the persistent pool's pages,
/// one with a tombstone), sealed, with its export, its image, its index
/// snapshot and the image of the changes since.
fn valid() -> &'static Valid {
    static EXPORT: OnceLock<Valid> = OnceLock::new();
    EXPORT.get_or_init(|| {
        let store = config(true).build().expect("store");
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
        for i in 32..40u64 {
            let mut page = [0u8; PAGE_SIZE];
            page.iter_mut().enumerate().for_each(|(j, b)| *b = (j % (5 + i as usize)) as u8);
            let _ = pools[0].put(Key::new(1, i), &page);
        }
        store.grouping().expect("grouping").group_now();
        let _ = pools[0].flush_page(Key::new(1, 6));
        let mut out = Vec::new();
        store.export(&mut out).expect("export");
        store.seal(true);
        let mut image = Vec::new();
        store.export_image(&mut image).expect("image");
        store.track_changes(true);
        let mut snapshot = Vec::new();
        store.export_snapshot(&mut snapshot).expect("snapshot");
        let mut changes = Vec::new();
        store.export_image(&mut changes).expect("changes");
        store.track_changes(false);
        Valid { store, export: out, image, snapshot, changes }
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let v = valid();
    let as_image = mode & 4 != 0;
    let precopy = mode & 8 != 0;
    let snapshot_patched = mode & 16 != 0;
    let input = if mode & 1 == 0 {
        rest.to_vec()
    } else {
        let mut base = match (precopy, snapshot_patched, as_image) {
            (true, true, _) => v.snapshot.clone(),
            (true, false, _) => v.changes.clone(),
            (false, _, true) => v.image.clone(),
            (false, _, false) => v.export.clone(),
        };
        let at = rest.first().map_or(0, |&b| usize::from(b) * base.len() / 256);
        let patch = rest.get(1..).unwrap_or_default();
        let end = (at + patch.len()).min(base.len());
        base[at..end].copy_from_slice(&patch[..end - at]);
        base
    };
    let fd = || v.store.memfd().expect("a shared store").try_clone_to_owned().expect("dup");
    let imported = if precopy {
        let (snapshot, changes) =
            if snapshot_patched { (&input, &v.changes) } else { (&v.snapshot, &input) };
        match Snapshot::read(&mut snapshot.as_slice()) {
            Ok(snap) => {
                let no_tiers = &mut |id: u32, _: usize| Err(tmem_core::StoreError::Handover(format!("pool {id}")));
                Store::import_image_after(config(true), &mut changes.as_slice(), fd(), no_tiers, snap)
            }
            Err(e) => Err(e),
        }
    } else if as_image {
        Store::import_image(config(true), &mut input.as_slice(), fd())
    } else {
        Store::import(config(mode & 2 != 0), &mut input.as_slice())
    };
    match imported {
        Ok((store, _)) => drop(store.stats()),
        Err(e) => drop(e.to_string()),
    }
});
