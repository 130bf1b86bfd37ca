//! Every codec round-trips any page exactly, and decompressing arbitrary
//! bytes (raw fuzz input, or a valid stream with fuzz bytes mixed in) returns
//! an error or a page, never panics.

#![no_main]

mod common;

use std::sync::{Arc, OnceLock};

use common::{tile, Cursor, Page};
use libfuzzer_sys::fuzz_target;
use tmem_core::codec::{fill_page, same_filled, Codec, CodecConfig, COMPRESS_BUF_SIZE};
use tmem_core::PAGE_SIZE;

fn codecs() -> &'static [Arc<dyn Codec>] {
    static CODECS: OnceLock<Vec<Arc<dyn Codec>>> = OnceLock::new();
    CODECS.get_or_init(|| {
        let dict = common::text_dictionary();
        [
            CodecConfig::Raw,
            CodecConfig::LZ4,
            CodecConfig::Zstd { level: 1, dictionary: None },
            CodecConfig::Zstd { level: -3, dictionary: None },
            CodecConfig::LZ4.with_dictionary(Arc::clone(&dict)),
            CodecConfig::Zstd { level: 3, dictionary: Some(dict) },
        ]
        .iter()
        .map(|c| c.build().expect("codec"))
        .collect()
    })
}

fn page_of(data: &[u8]) -> Page {
    let mut c = Cursor::new(data);
    let mut p = [0u8; PAGE_SIZE];
    match c.below(4) {
        // The input, zero-padded.
        0 => {
            let b = c.bytes(PAGE_SIZE);
            p[..b.len()].copy_from_slice(b);
        }
        // The input, repeated.
        1 => tile(&mut p, c.bytes(PAGE_SIZE)),
        // Runs: (length, byte) pairs.
        2 => {
            let mut at = 0;
            while at < PAGE_SIZE && !c.is_empty() {
                let n = (usize::from(c.u8()) + 1).min(PAGE_SIZE - at);
                p[at..at + n].fill(c.u8());
                at += n;
            }
        }
        // Same-filled, maybe with a few bytes changed.
        _ => {
            fill_page(&mut p, c.u64());
            while !c.is_empty() {
                let at = usize::from(c.u16()) % PAGE_SIZE;
                p[at] = c.u8();
            }
        }
    }
    p
}

fn naive_same_filled(p: &Page) -> Option<u64> {
    let first: [u8; 8] = p[..8].try_into().expect("8 bytes");
    p.chunks_exact(8).all(|w| w == first).then(|| u64::from_ne_bytes(first))
}

fuzz_target!(|data: &[u8]| {
    let page = page_of(data);
    assert_eq!(same_filled(&page), naive_same_filled(&page));
    let mut buf = [0u8; COMPRESS_BUF_SIZE];
    let mut out = [0u8; PAGE_SIZE];
    for codec in codecs() {
        let n = codec.compress(&page, &mut buf).unwrap_or_else(|e| panic!("{}: compress failed: {e}", codec.name()));
        assert!(n > 0 && n <= COMPRESS_BUF_SIZE);
        out.fill(0xa5);
        codec.decompress(&buf[..n], &mut out).unwrap_or_else(|e| panic!("{}: own output rejected: {e}", codec.name()));
        assert!(out == page, "{}: round trip changed the page", codec.name());

        // Arbitrary input as compressed data.
        let _ = codec.decompress(data, &mut out);
        // A valid stream damaged by the input (reaches deeper decoder states).
        if !data.is_empty() {
            let mut bad = buf[..n].to_vec();
            for (i, &b) in data.iter().enumerate().take(64) {
                let at = (usize::from(b) * 31 + i * 7) % n;
                bad[at] ^= data[(i + 1) % data.len()] | 1;
            }
            let _ = codec.decompress(&bad, &mut out);
            // Truncated and extended versions of the valid stream must fail.
            let cut = usize::from(data[0]) % n;
            assert!(codec.decompress(&buf[..cut], &mut out).is_err(), "{}: accepted {cut} of {n} bytes", codec.name());
            let mut long = buf[..n].to_vec();
            long.extend_from_slice(&buf[..n]);
            assert!(codec.decompress(&long, &mut out).is_err(), "{}: accepted two pages", codec.name());
        }
    }
});
