//! Group blocks (`tmem_core::group`, issue 30): any stored bytes, with any
//! slot set, decode to one page per slot or one error, never a panic; and
//! pages the input shapes, encoded as a group, decode back exactly (each
//! page at its slot), also after fuzz bytes are mixed into the block.

#![no_main]

mod common;

use std::sync::{Arc, OnceLock};

use common::{page_from, Cursor};
use libfuzzer_sys::fuzz_target;
use tmem_core::codec::{Codec, CodecConfig};
use tmem_core::group::{decode_block, encode_block, page_in, BLOCK_BYTES, MAX_GROUP_PAGES, MAX_STORED_BLOCK};
use tmem_core::PAGE_SIZE;

/// Block codecs: zstd with and without a dictionary, and one without a
/// block mode (lz4), which must refuse.
fn codecs() -> &'static [Arc<dyn Codec>] {
    static CODECS: OnceLock<Vec<Arc<dyn Codec>>> = OnceLock::new();
    CODECS.get_or_init(|| {
        let dict = common::text_dictionary();
        [
            CodecConfig::Zstd { level: 3, dictionary: None },
            CodecConfig::Zstd { level: 9, dictionary: Some(dict) },
            CodecConfig::LZ4,
        ]
        .iter()
        .map(|c| c.build().expect("codec"))
        .collect()
    })
}

fuzz_target!(|data: &[u8]| {
    let mut c = Cursor::new(data);
    let codec = &codecs()[c.below(3)];
    let slots = c.u16();
    let mut out = vec![0u8; BLOCK_BYTES];
    if c.u8() & 1 == 0 {
        // Arbitrary stored bytes.
        let src = c.bytes(MAX_STORED_BLOCK + 16);
        if let Ok(n) = decode_block(&**codec, src, slots, &mut out) {
            assert_eq!(n, slots.count_ones() as usize * PAGE_SIZE);
        }
        return;
    }
    // Pages shaped by the input, one per slot, through a block and back.
    let slots = slots.max(1);
    let n = slots.count_ones() as usize;
    assert!(n <= MAX_GROUP_PAGES);
    let mut pages = vec![0u8; n * PAGE_SIZE];
    for p in pages.chunks_exact_mut(PAGE_SIZE) {
        p.copy_from_slice(&page_from(&mut c));
    }
    let mut block = vec![0u8; MAX_STORED_BLOCK];
    let Ok(len) = encode_block(&**codec, slots, &pages, &mut block) else {
        assert!(!codec.supports_blocks(), "{} refused a block", codec.name());
        return;
    };
    assert_eq!(decode_block(&**codec, &block[..len], slots, &mut out).unwrap(), n * PAGE_SIZE);
    for (k, slot) in (0..16u32).filter(|s| slots & (1 << s) != 0).enumerate() {
        assert_eq!(page_in(&out, slots, slot).unwrap()[..], pages[k * PAGE_SIZE..(k + 1) * PAGE_SIZE]);
    }
    // Damage: fuzz bytes over part of the block, or a cut.
    let at = usize::from(c.u16()) % len;
    let patch = c.bytes(64);
    let end = (at + patch.len()).min(len);
    block[at..end].copy_from_slice(&patch[..end - at]);
    let cut = if c.u8() & 1 == 0 { len } else { at.max(1) };
    let _ = decode_block(&**codec, &block[..cut], slots, &mut out);
});
