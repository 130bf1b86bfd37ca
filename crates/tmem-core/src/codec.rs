//! Page codecs: lz4, zstd (levels, dictionaries), raw copy, and same-filled detection.
//!
//! A codec compresses one 4 KiB page into a caller-provided buffer and
//! decompresses it back. Codecs are registered with the store under a small
//! id; every stored page records the id it was compressed with, so switching
//! the current codec at run time leaves older pages decodable.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::PAGE_SIZE;

/// Size of the scratch buffer a compressor writes into: room for lz4's and
/// zstd's worst-case expansion of a 4 KiB page.
pub const COMPRESS_BUF_SIZE: usize = 4608;

/// Scratch buffer for one compressed page.
pub type CompressBuf = [u8; COMPRESS_BUF_SIZE];

/// Codec failures.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// The compressor itself failed (not "did not shrink": that is a size check).
    #[error("{codec}: compression failed: {reason}")]
    Compress {
        /// Codec name.
        codec: String,
        /// What the library said.
        reason: String,
    },
    /// Stored data did not decode to exactly one page.
    #[error("{codec}: corrupt compressed page: {reason}")]
    Decompress {
        /// Codec name.
        codec: String,
        /// What went wrong.
        reason: String,
    },
    /// A codec could not be built (bad level, dictionary rejected, ...).
    #[error("cannot build codec {codec}: {reason}")]
    Config {
        /// Codec description.
        codec: String,
        /// Why.
        reason: String,
    },
}

/// A page compressor.
pub trait Codec: Send + Sync + 'static {
    /// Short name, e.g. `lz4`, `zstd-3`, `zstd-3+dict`.
    fn name(&self) -> &str;

    /// Compresses `page` into `dst` and returns the compressed length. The
    /// result may be larger than a page; the store decides what to keep.
    fn compress(&self, page: &[u8; PAGE_SIZE], dst: &mut CompressBuf) -> Result<usize, CodecError>;

    /// Decompresses `src` into `page`; anything but exactly one page is an error.
    fn decompress(&self, src: &[u8], page: &mut [u8; PAGE_SIZE]) -> Result<(), CodecError>;

    /// Memory the codec holds (dictionaries), counted as pool metadata.
    fn meta_bytes(&self) -> usize {
        0
    }

    /// Whether the codec compresses blocks of several pages (a group's
    /// block, `crate::group`): [`Codec::compress_block`] and
    /// [`Codec::decompress_block`] work.
    fn supports_blocks(&self) -> bool {
        false
    }

    /// Compresses `src` (any length) into `dst`; returns the compressed
    /// length. Codecs without a block mode refuse.
    fn compress_block(&self, src: &[u8], dst: &mut [u8]) -> Result<usize, CodecError> {
        let _ = (src, dst);
        Err(CodecError::Compress { codec: self.name().into(), reason: "no block mode".into() })
    }

    /// Decompresses a block made by [`Codec::compress_block`] into `dst`;
    /// returns its length (it must fit `dst`).
    fn decompress_block(&self, src: &[u8], dst: &mut [u8]) -> Result<usize, CodecError> {
        let _ = (src, dst);
        Err(CodecError::Decompress { codec: self.name().into(), reason: "no block mode".into() })
    }
}

/// Which codec to build, with its parameters.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase", tag = "codec")]
pub enum CodecConfig {
    /// Stores pages as they are: the no-op codec.
    Raw,
    /// lz4 block format (C liblz4, as the kernel's), optionally with a
    /// dictionary (its last 64 KiB count).
    Lz4 {
        /// Raw dictionary bytes, for example from [`train_dictionary`].
        #[serde(skip)]
        dictionary: Option<Arc<[u8]>>,
    },
    /// zstd at `level`, optionally with a dictionary trained on sample pages.
    Zstd {
        /// Compression level, 1..=22 (negative levels are zstd's fast modes).
        level: i32,
        /// Raw dictionary bytes from [`train_dictionary`].
        #[serde(skip)]
        dictionary: Option<Arc<[u8]>>,
    },
}

impl CodecConfig {
    /// lz4 without a dictionary.
    pub const LZ4: Self = Self::Lz4 { dictionary: None };

    /// This codec with `dictionary` (raw copies have none).
    pub fn with_dictionary(&self, dictionary: Arc<[u8]>) -> Self {
        match self {
            Self::Raw => Self::Raw,
            Self::Lz4 { .. } => Self::Lz4 { dictionary: Some(dictionary) },
            Self::Zstd { level, .. } => Self::Zstd { level: *level, dictionary: Some(dictionary) },
        }
    }

    /// Builds the codec.
    pub fn build(&self) -> Result<Arc<dyn Codec>, CodecError> {
        Ok(match self {
            CodecConfig::Raw => Arc::new(RawCodec),
            CodecConfig::Lz4 { dictionary } => Arc::new(Lz4Codec::new(dictionary.clone())),
            CodecConfig::Zstd { level, dictionary } => Arc::new(ZstdCodec::new(*level, dictionary.clone())?),
        })
    }

    /// Parses `raw`, `lz4`, `zstd` or `zstd:LEVEL`.
    pub fn parse(s: &str) -> Result<Self, CodecError> {
        let bad = |reason: &str| CodecError::Config { codec: s.to_owned(), reason: reason.to_owned() };
        match s.split_once(':') {
            None if s == "raw" => Ok(Self::Raw),
            None if s == "lz4" => Ok(Self::LZ4),
            None if s == "zstd" => Ok(Self::Zstd { level: 3, dictionary: None }),
            Some(("zstd", level)) => {
                let level: i32 = level.parse().map_err(|_| bad("level is not an integer"))?;
                Ok(Self::Zstd { level, dictionary: None })
            }
            _ => Err(bad("expected raw, lz4, zstd or zstd:LEVEL")),
        }
    }
}

/// A codec as users name it: [`CodecConfig::parse`]'s names, each optionally
/// followed by `+dict`: train a dictionary on the pool's own pages (see
/// `DictTraining`) and switch to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CodecChoice {
    /// The codec (without a dictionary).
    pub codec: CodecConfig,
    /// Whether to train a dictionary for it.
    pub dictionary: bool,
}

impl CodecChoice {
    /// Parses `lz4`, `lz4+dict`, `zstd:3+dict`, ...
    pub fn parse(s: &str) -> Result<Self, CodecError> {
        let (base, dictionary) = s.strip_suffix("+dict").map_or((s, false), |b| (b, true));
        let codec = CodecConfig::parse(base)?;
        if dictionary && codec == CodecConfig::Raw {
            return Err(CodecError::Config { codec: s.to_owned(), reason: "raw copies take no dictionary".into() });
        }
        Ok(Self { codec, dictionary })
    }
}

/// Identity codec: a compressed page is the page.
#[derive(Debug, Default)]
pub struct RawCodec;

impl Codec for RawCodec {
    fn name(&self) -> &str {
        "raw"
    }

    fn compress(&self, page: &[u8; PAGE_SIZE], dst: &mut CompressBuf) -> Result<usize, CodecError> {
        dst[..PAGE_SIZE].copy_from_slice(page);
        Ok(PAGE_SIZE)
    }

    fn decompress(&self, src: &[u8], page: &mut [u8; PAGE_SIZE]) -> Result<(), CodecError> {
        if src.len() != PAGE_SIZE {
            return Err(CodecError::Decompress {
                codec: "raw".into(),
                reason: format!("length {} != {PAGE_SIZE}", src.len()),
            });
        }
        page.copy_from_slice(src);
        Ok(())
    }
}

/// lz4 block compression, optionally against a dictionary.
#[derive(Debug)]
pub struct Lz4Codec {
    dictionary: Option<crate::lz4::Dictionary>,
    name: &'static str,
}

const _: () = assert!(COMPRESS_BUF_SIZE >= PAGE_SIZE * 110 / 100 + 20, "lz4 worst case must fit");

impl Lz4Codec {
    /// An lz4 codec; with a dictionary, only its last 64 KiB are used.
    pub fn new(dictionary: Option<Arc<[u8]>>) -> Self {
        let name = if dictionary.is_some() { "lz4+dict" } else { "lz4" };
        Self { dictionary: dictionary.map(crate::lz4::Dictionary::new), name }
    }
}

impl Codec for Lz4Codec {
    fn name(&self) -> &str {
        self.name
    }

    fn compress(&self, page: &[u8; PAGE_SIZE], dst: &mut CompressBuf) -> Result<usize, CodecError> {
        // The buffer holds LZ4_compressBound(PAGE_SIZE) (asserted above).
        crate::lz4::compress(page, dst, self.dictionary.as_ref())
            .ok_or_else(|| CodecError::Compress { codec: self.name.into(), reason: "output buffer too small".into() })
    }

    fn decompress(&self, src: &[u8], page: &mut [u8; PAGE_SIZE]) -> Result<(), CodecError> {
        let bad = |reason: String| CodecError::Decompress { codec: self.name.into(), reason };
        let n = crate::lz4::decompress(src, page, self.dictionary.as_ref())
            .ok_or_else(|| bad("malformed block, or longer than a page".into()))?;
        if n != PAGE_SIZE {
            return Err(bad(format!("decoded {n} bytes, expected {PAGE_SIZE}")));
        }
        Ok(())
    }

    fn meta_bytes(&self) -> usize {
        // The dictionary bytes plus its digested 16 KiB stream.
        self.dictionary.as_ref().map_or(0, |d| d.bytes().len() + (16 << 10))
    }
}

/// zstd with a level and an optional dictionary. Compression contexts are
/// per thread and created on first use, so the hot path allocates nothing.
pub struct ZstdCodec {
    uid: u64,
    level: i32,
    dictionary: Option<Arc<[u8]>>,
    name: String,
}

static NEXT_CODEC_UID: AtomicU64 = AtomicU64::new(1);

struct ZstdContexts {
    uid: u64,
    cctx: zstd::bulk::Compressor<'static>,
    dctx: zstd::bulk::Decompressor<'static>,
}

/// Per-thread contexts kept for at most this many zstd codecs.
const MAX_THREAD_CONTEXTS: usize = 8;

thread_local! {
    static ZSTD_CONTEXTS: RefCell<Vec<ZstdContexts>> = const { RefCell::new(Vec::new()) };
}

impl ZstdCodec {
    /// Builds a zstd codec; checks the level and dictionary by creating contexts once.
    pub fn new(level: i32, dictionary: Option<Arc<[u8]>>) -> Result<Self, CodecError> {
        let name = match &dictionary {
            Some(_) => format!("zstd-{level}+dict"),
            None => format!("zstd-{level}"),
        };
        if !zstd::compression_level_range().contains(&level) {
            return Err(CodecError::Config {
                codec: name,
                reason: format!("level must be in {:?}", zstd::compression_level_range()),
            });
        }
        let codec = Self { uid: NEXT_CODEC_UID.fetch_add(1, Ordering::Relaxed), level, dictionary, name };
        codec.make_contexts()?;
        Ok(codec)
    }

    fn make_contexts(&self) -> Result<ZstdContexts, CodecError> {
        use zstd::zstd_safe::CParameter;
        let cfg = |e: std::io::Error| CodecError::Config { codec: self.name.clone(), reason: e.to_string() };
        let dict: &[u8] = self.dictionary.as_deref().unwrap_or(&[]);
        let mut cctx = zstd::bulk::Compressor::with_dictionary(self.level, dict).map_err(cfg)?;
        // Every byte counts on a 4 KiB page: no checksum, no content size, no dictionary id.
        for p in [CParameter::ChecksumFlag(false), CParameter::ContentSizeFlag(false), CParameter::DictIdFlag(false)] {
            cctx.set_parameter(p).map_err(cfg)?;
        }
        let dctx = zstd::bulk::Decompressor::with_dictionary(dict).map_err(cfg)?;
        Ok(ZstdContexts { uid: self.uid, cctx, dctx })
    }

    fn with_contexts<R>(&self, f: impl FnOnce(&mut ZstdContexts) -> R) -> Result<R, CodecError> {
        ZSTD_CONTEXTS.with(|cell| {
            let mut v = cell.borrow_mut();
            let pos = match v.iter().position(|c| c.uid == self.uid) {
                Some(p) => p,
                None => {
                    if v.len() >= MAX_THREAD_CONTEXTS {
                        v.remove(0);
                    }
                    v.push(self.make_contexts()?);
                    v.len() - 1
                }
            };
            Ok(f(&mut v[pos]))
        })
    }
}

impl Codec for ZstdCodec {
    fn name(&self) -> &str {
        &self.name
    }

    fn compress(&self, page: &[u8; PAGE_SIZE], dst: &mut CompressBuf) -> Result<usize, CodecError> {
        self.with_contexts(|c| c.cctx.compress_to_buffer(&page[..], &mut dst[..]))?
            .map_err(|e| CodecError::Compress { codec: self.name.clone(), reason: e.to_string() })
    }

    fn decompress(&self, src: &[u8], page: &mut [u8; PAGE_SIZE]) -> Result<(), CodecError> {
        let bad = |reason: String| CodecError::Decompress { codec: self.name.clone(), reason };
        let n =
            self.with_contexts(|c| c.dctx.decompress_to_buffer(src, &mut page[..]))?.map_err(|e| bad(e.to_string()))?;
        if n != PAGE_SIZE {
            return Err(bad(format!("decoded {n} bytes, expected {PAGE_SIZE}")));
        }
        Ok(())
    }

    fn meta_bytes(&self) -> usize {
        // The dictionary is held once by the codec; each thread's contexts
        // hold a digested copy, counted once as an estimate.
        self.dictionary.as_ref().map_or(0, |d| 2 * d.len())
    }

    fn supports_blocks(&self) -> bool {
        true
    }

    fn compress_block(&self, src: &[u8], dst: &mut [u8]) -> Result<usize, CodecError> {
        self.with_contexts(|c| c.cctx.compress_to_buffer(src, dst))?
            .map_err(|e| CodecError::Compress { codec: self.name.clone(), reason: e.to_string() })
    }

    fn decompress_block(&self, src: &[u8], dst: &mut [u8]) -> Result<usize, CodecError> {
        self.with_contexts(|c| c.dctx.decompress_to_buffer(src, dst))?
            .map_err(|e| CodecError::Decompress { codec: self.name.clone(), reason: e.to_string() })
    }
}

/// Trains a zstd dictionary of at most `max_size` bytes from sample pages.
pub fn train_dictionary<'a>(
    pages: impl IntoIterator<Item = &'a [u8; PAGE_SIZE]>,
    max_size: usize,
) -> Result<Arc<[u8]>, CodecError> {
    let mut data = Vec::new();
    let mut sizes = Vec::new();
    for p in pages {
        if same_filled(p).is_none() {
            data.extend_from_slice(p);
            sizes.push(PAGE_SIZE);
        }
    }
    zstd::dict::from_continuous(&data, &sizes, max_size).map(Arc::from).map_err(|e| CodecError::Config {
        codec: "zstd dictionary".into(),
        reason: format!("training on {} pages: {e}", sizes.len()),
    })
}

/// If every 8-byte word of `page` is the same, returns that word (as zram does).
pub fn same_filled(page: &[u8; PAGE_SIZE]) -> Option<u64> {
    let (words, rest) = page.as_chunks::<8>();
    debug_assert!(rest.is_empty());
    let first = words[0];
    // Compare the cheapest probe (the last word) first, then all of them.
    if words[words.len() - 1] != first || !words.iter().all(|w| *w == first) {
        return None;
    }
    Some(u64::from_ne_bytes(first))
}

/// Fills `page` with the repeated word `value` (inverse of [`same_filled`]).
pub fn fill_page(page: &mut [u8; PAGE_SIZE], value: u64) {
    let bytes = value.to_ne_bytes();
    let (words, _) = page.as_chunks_mut::<8>();
    words.fill(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text_page(seed: u8) -> [u8; PAGE_SIZE] {
        let words: [&[u8]; 6] = [b"alpha ", b"beta ", b"gamma ", b"delta ", b"{\"id\": ", b"}, "];
        let mut p = [0u8; PAGE_SIZE];
        let mut i = 0;
        let mut k = usize::from(seed);
        while i < PAGE_SIZE {
            let w = words[k % words.len()];
            let n = w.len().min(PAGE_SIZE - i);
            p[i..i + n].copy_from_slice(&w[..n]);
            i += n;
            k = k.wrapping_mul(31).wrapping_add(7);
        }
        p
    }

    fn all_codecs() -> Vec<Arc<dyn Codec>> {
        let pages: Vec<[u8; PAGE_SIZE]> = (0..64).map(text_page).collect();
        let dict = train_dictionary(pages.iter(), 8192).unwrap();
        vec![
            CodecConfig::Raw.build().unwrap(),
            CodecConfig::LZ4.build().unwrap(),
            CodecConfig::Zstd { level: 1, dictionary: None }.build().unwrap(),
            CodecConfig::Zstd { level: 9, dictionary: Some(dict) }.build().unwrap(),
        ]
    }

    #[test]
    fn round_trip_every_codec() {
        let mut buf = [0u8; COMPRESS_BUF_SIZE];
        let mut out = [0u8; PAGE_SIZE];
        for c in all_codecs() {
            for seed in 0..8u8 {
                let p = text_page(seed);
                let n = c.compress(&p, &mut buf).unwrap();
                c.decompress(&buf[..n], &mut out).unwrap();
                assert_eq!(out, p, "{}", c.name());
            }
        }
    }

    #[test]
    fn corrupt_input_is_an_error_not_a_panic() {
        let mut buf = [0u8; COMPRESS_BUF_SIZE];
        let mut out = [0u8; PAGE_SIZE];
        for c in all_codecs() {
            let p = text_page(3);
            let n = c.compress(&p, &mut buf).unwrap();
            // Truncation must fail for every codec.
            assert!(c.decompress(&buf[..n - 1], &mut out).is_err(), "{} accepted truncated data", c.name());
            // Flipped bytes must never panic; lz4 and raw have no integrity
            // check of their own (the store checksums every object), zstd's
            // frame structure catches most flips.
            for i in 0..n.min(64) {
                let mut bad = buf[..n].to_vec();
                bad[i] ^= 0xff;
                let _ = c.decompress(&bad, &mut out);
            }
        }
    }

    #[test]
    fn same_filled_detection() {
        let mut p = [0u8; PAGE_SIZE];
        assert_eq!(same_filled(&p), Some(0));
        fill_page(&mut p, 0xdead_beef_0000_0001);
        assert_eq!(same_filled(&p), Some(0xdead_beef_0000_0001));
        p[4095] ^= 1;
        assert_eq!(same_filled(&p), None);
        p[4095] ^= 1;
        p[8] ^= 1;
        assert_eq!(same_filled(&p), None);
    }

    #[test]
    fn parse_and_bad_levels() {
        assert_eq!(CodecConfig::parse("lz4").unwrap(), CodecConfig::LZ4);
        assert_eq!(CodecChoice::parse("lz4+dict").unwrap(), CodecChoice { codec: CodecConfig::LZ4, dictionary: true });
        assert_eq!(
            CodecChoice::parse("zstd:5+dict").unwrap(),
            CodecChoice { codec: CodecConfig::Zstd { level: 5, dictionary: None }, dictionary: true }
        );
        assert!(!CodecChoice::parse("zstd").unwrap().dictionary);
        assert!(CodecChoice::parse("raw+dict").is_err());
        assert!(CodecChoice::parse("lz4+dictionary").is_err());
        assert_eq!(CodecConfig::parse("zstd:7").unwrap(), CodecConfig::Zstd { level: 7, dictionary: None });
        assert!(CodecConfig::parse("zstd:x").is_err());
        assert!(CodecConfig::parse("lzma").is_err());
        assert!(CodecConfig::Zstd { level: 99, dictionary: None }.build().is_err());
    }
}
