//! Page corpora for tmem: sets of real 4 KiB memory pages captured from live
//! programs, used to benchmark page compression (against kernel zram).
//!
//! * [`Corpus`] holds the pages plus [`CorpusMeta`] and reads/writes the
//!   `.tcorp` file format (documented in `docs/CORPUS.md`).
//! * [`capture_pid`] captures the resident private anonymous pages of a
//!   running process; [`spawn_and_capture`] starts a representative program
//!   (python, java, gcc's `cc1`, redis), lets it build a heap and captures it.
//! * [`Corpus::builtin`] returns the small corpora shipped with the crate.
//! * [`CaptureArgs`] / [`run_capture`] implement `tmem corpus capture`.

use std::fs;
use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

mod capture;
mod cli;
mod error;
mod spawn;

pub use capture::capture_pid;
pub use cli::{parse_size, run_capture, CaptureArgs};
pub use error::CorpusError;
pub use spawn::{generated_c_source, spawn_and_capture, which, SpawnKind};

/// Size of one page, in bytes. Corpora only ever hold 4 KiB pages.
pub const PAGE_SIZE: usize = 4096;

/// `PAGE_SIZE` as the `u32` stored in the file header.
const PAGE_SIZE_U32: u32 = 4096;

/// The 8 magic bytes every (decompressed) corpus file starts with.
pub const MAGIC: [u8; 8] = *b"TMEMCORP";

/// The only file format version this crate reads and writes.
pub const FORMAT_VERSION: u32 = 1;

/// The zstd frame magic number (`0xFD2FB528` little-endian on disk).
pub const ZSTD_MAGIC: [u8; 4] = [0x28, 0xB5, 0x2F, 0xFD];

/// Most bytes one byte of zstd stream can decode to: an RLE block (a 3-byte
/// header and the byte) repeats one byte up to 128 KiB.
pub const ZSTD_MAX_RATIO: u64 = (128 << 10) / 4;

/// Bytes after the page data that a reader looks at to report trailing data.
const TRAILING_LOOK: u64 = 1 << 20;

/// zstd level used by [`Corpus::to_bytes`] / [`Corpus::write`] when
/// compressing: a good ratio at tens of MB/s (level 19 takes ~1 s per MB).
pub const DEFAULT_ZSTD_LEVEL: i32 = 9;

/// zstd level of the built-in corpus files.
pub const BUILTIN_ZSTD_LEVEL: i32 = 19;

/// Largest metadata JSON accepted on read (1 MiB); real metadata is < 1 KiB.
pub const MAX_META_LEN: u32 = 1 << 20;

/// Fixed header length: magic, version, page size, page count, meta length.
const HEADER_LEN: usize = 8 + 4 + 4 + 8 + 4;

/// Names of the built-in corpora, in the order [`Corpus::builtin`] returns them.
pub const BUILTIN_NAMES: [&str; 4] = ["python", "java", "cc", "redis"];

static BUILTIN_FILES: [&[u8]; 4] = [
    include_bytes!("../builtin/python.tcorp"),
    include_bytes!("../builtin/java.tcorp"),
    include_bytes!("../builtin/cc.tcorp"),
    include_bytes!("../builtin/redis.tcorp"),
];

/// Describes where a corpus came from. Stored as JSON in the file header.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CorpusMeta {
    /// `"python"`, `"java"`, `"cc"`, `"redis"`, `"pid"` (arbitrary process) or `"mix"`.
    pub program: String,
    /// Human readable origin, e.g. `"pid 1234 (python3 heap.py)"`.
    pub source: String,
    /// Capture time, seconds since the Unix epoch.
    pub captured_unix: u64,
    /// Kernel release of the capturing machine (`uname -r`).
    pub kernel: String,
    /// Number of pages; always equal to [`Corpus::page_count`].
    pub pages: u64,
}

impl CorpusMeta {
    /// Metadata for a capture made now on this machine (`pages` is filled in
    /// by [`Corpus::new`]).
    pub fn now(program: impl Into<String>, source: impl Into<String>) -> Self {
        CorpusMeta {
            program: program.into(),
            source: source.into(),
            captured_unix: unix_now(),
            kernel: kernel_release(),
            pages: 0,
        }
    }
}

/// Page statistics, see [`Corpus::stats`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PageStats {
    /// Number of pages.
    pub pages: usize,
    /// Pages whose 512 machine words (`u64`) are all equal — what zram stores
    /// as "same-filled" without compressing. Includes the zero pages.
    pub same_filled: usize,
    /// Pages that are entirely zero (a subset of `same_filled`).
    pub zero: usize,
}

/// A set of 4 KiB pages plus metadata.
#[derive(Clone, PartialEq, Eq)]
pub struct Corpus {
    /// Origin of the pages. `meta.pages == self.page_count()` always holds
    /// for corpora built by this crate.
    pub meta: CorpusMeta,
    /// All pages concatenated; `data.len() % PAGE_SIZE == 0`.
    data: Vec<u8>,
}

impl std::fmt::Debug for Corpus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Corpus").field("meta", &self.meta).field("data_len", &self.data.len()).finish()
    }
}

impl Corpus {
    /// Builds a corpus from page data. `data.len()` must be a multiple of
    /// [`PAGE_SIZE`]; `meta.pages` is set to the resulting page count.
    pub fn new(mut meta: CorpusMeta, data: Vec<u8>) -> Result<Self, CorpusError> {
        if !data.len().is_multiple_of(PAGE_SIZE) {
            return Err(CorpusError::NotPageAligned { len: data.len() });
        }
        meta.pages = u64::try_from(data.len() / PAGE_SIZE).expect("usize fits in u64");
        Ok(Corpus { meta, data })
    }

    /// Number of pages.
    pub fn page_count(&self) -> usize {
        self.data.len() / PAGE_SIZE
    }

    /// All pages concatenated (`page_count() * PAGE_SIZE` bytes).
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// Page `i`.
    ///
    /// # Panics
    /// If `i >= self.page_count()`, like slice indexing.
    pub fn page(&self, i: usize) -> &[u8; PAGE_SIZE] {
        assert!(i < self.page_count(), "page index {i} out of range for corpus of {} pages", self.page_count());
        let start = i * PAGE_SIZE;
        to_page(&self.data[start..start + PAGE_SIZE])
    }

    /// Iterates over all pages in order.
    pub fn pages(&self) -> impl ExactSizeIterator<Item = &[u8; PAGE_SIZE]> + '_ {
        self.data.chunks_exact(PAGE_SIZE).map(to_page)
    }

    /// Counts same-filled and zero pages.
    pub fn stats(&self) -> PageStats {
        let mut stats = PageStats { pages: self.page_count(), ..PageStats::default() };
        for page in self.pages() {
            if let Some(word) = same_filled_word(page) {
                stats.same_filled += 1;
                if word == 0 {
                    stats.zero += 1;
                }
            }
        }
        stats
    }

    /// Parses a corpus file image: either the plain format or the plain
    /// format wrapped in a zstd frame. Every header field is validated; bad
    /// input yields an error, never a panic.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, CorpusError> {
        let decoder = || zstd::stream::read::Decoder::new(bytes).map_err(CorpusError::Zstd);
        let file_len = u64::try_from(bytes.len()).expect("usize fits in u64");
        if !bytes.starts_with(&ZSTD_MAGIC) {
            return parse(bytes, file_len);
        }
        // A frame that records its content size bounds the header's claims
        // before anything is read. A stream that does not is measured
        // first, keeping nothing, up to a bound set by the header's claim
        // and the file's size; pages are read only if it holds exactly
        // what the header claims (finding: an 11 KB stream was refused
        // only after 320 MiB, at 335 MB of RSS).
        let size = match zstd::zstd_safe::get_frame_content_size(bytes).ok().flatten() {
            Some(size) => size,
            None => measure(decoder()?, file_len.saturating_mul(ZSTD_MAX_RATIO))?,
        };
        parse(decoder()?, size)
    }

    /// Serializes the corpus; when `compress` is set the image is wrapped in a
    /// zstd frame at [`DEFAULT_ZSTD_LEVEL`].
    pub fn to_bytes(&self, compress: bool) -> Vec<u8> {
        if compress {
            self.to_bytes_with_level(DEFAULT_ZSTD_LEVEL)
        } else {
            self.to_plain_bytes()
        }
    }

    /// Serializes and zstd-compresses the corpus at the given zstd level.
    pub fn to_bytes_with_level(&self, level: i32) -> Vec<u8> {
        let plain = self.to_plain_bytes();
        zstd::bulk::compress(&plain, level).expect("in-memory zstd compression cannot fail")
    }

    fn to_plain_bytes(&self) -> Vec<u8> {
        let meta =
            CorpusMeta { pages: u64::try_from(self.page_count()).expect("usize fits in u64"), ..self.meta.clone() };
        let meta_json = serde_json::to_vec(&meta).expect("CorpusMeta serializes to JSON");
        let meta_len = u32::try_from(meta_json.len()).expect("corpus metadata larger than 4 GiB");
        let mut out = Vec::with_capacity(HEADER_LEN + meta_json.len() + self.data.len());
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        out.extend_from_slice(&PAGE_SIZE_U32.to_le_bytes());
        out.extend_from_slice(&meta.pages.to_le_bytes());
        out.extend_from_slice(&meta_len.to_le_bytes());
        out.extend_from_slice(&meta_json);
        out.extend_from_slice(&self.data);
        out
    }

    /// Reads a corpus file (plain or zstd-compressed): a regular file,
    /// opened `O_NONBLOCK` so that a FIFO is refused instead of blocking,
    /// and read up to its size.
    pub fn read(path: &Path) -> Result<Self, CorpusError> {
        let io_err = |source| CorpusError::Io { path: path.to_path_buf(), source };
        let file = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)
            .map_err(io_err)?;
        let meta = file.metadata().map_err(io_err)?;
        if !meta.is_file() {
            return Err(io_err(io::Error::other("not a regular file")));
        }
        let len = usize::try_from(meta.len()).map_err(|_| io_err(io::Error::other("larger than memory")))?;
        let mut bytes = Vec::new();
        bytes.try_reserve_exact(len).map_err(|e| io_err(io::Error::other(e)))?;
        file.take(meta.len()).read_to_end(&mut bytes).map_err(io_err)?;
        Corpus::from_bytes(&bytes).map_err(|e| CorpusError::InFile { path: path.to_path_buf(), source: Box::new(e) })
    }

    /// Writes a corpus file, zstd-compressed (level [`DEFAULT_ZSTD_LEVEL`]) if
    /// `compress` is set.
    pub fn write(&self, path: &Path, compress: bool) -> Result<(), CorpusError> {
        write_file(path, &self.to_bytes(compress))
    }

    /// Writes a zstd-compressed corpus file at the given zstd level.
    pub fn write_with_level(&self, path: &Path, level: i32) -> Result<(), CorpusError> {
        write_file(path, &self.to_bytes_with_level(level))
    }

    /// The corpora shipped with this crate (`builtin/*.tcorp`, 512 pages each),
    /// in the order of [`BUILTIN_NAMES`]: python, java, cc, redis.
    pub fn builtin() -> Vec<Corpus> {
        BUILTIN_NAMES
            .iter()
            .zip(BUILTIN_FILES)
            .map(|(name, bytes)| {
                Corpus::from_bytes(bytes).unwrap_or_else(|e| panic!("built-in corpus {name}.tcorp is corrupt: {e}"))
            })
            .collect()
    }

    /// The built-in corpus with the given name (`"python"`, `"java"`, `"cc"`
    /// or `"redis"`).
    pub fn builtin_named(name: &str) -> Option<Corpus> {
        let i = BUILTIN_NAMES.iter().position(|n| *n == name)?;
        Some(Corpus::from_bytes(BUILTIN_FILES[i]).expect("built-in corpus is valid"))
    }

    /// Concatenates corpora (in order) into one with program `"mix"`.
    pub fn mix(parts: &[Corpus]) -> Corpus {
        let total: usize = parts.iter().map(|c| c.data.len()).sum();
        let mut data = Vec::with_capacity(total);
        for part in parts {
            data.extend_from_slice(&part.data);
        }
        let source =
            parts.iter().map(|c| format!("{}:{}", c.meta.program, c.page_count())).collect::<Vec<_>>().join(" + ");
        let mut kernels: Vec<&str> = Vec::new();
        for part in parts {
            if !kernels.contains(&part.meta.kernel.as_str()) {
                kernels.push(&part.meta.kernel);
            }
        }
        let meta = CorpusMeta {
            program: "mix".to_string(),
            source: format!("mix of {source}"),
            captured_unix: parts.iter().map(|c| c.meta.captured_unix).max().unwrap_or(0),
            kernel: kernels.join(","),
            pages: 0,
        };
        Corpus::new(meta, data).expect("concatenation of whole pages is page aligned")
    }

    /// A deterministic, order-preserving subset of at most `max_pages` pages.
    ///
    /// Every page is equally likely to be chosen (selection sampling, Knuth's
    /// Algorithm S, driven by SplitMix64 seeded with `seed`); the same
    /// corpus, `max_pages` and `seed` always give the same result. If the
    /// corpus has at most `max_pages` pages it is returned unchanged.
    pub fn sample(&self, max_pages: usize, seed: u64) -> Corpus {
        let n = self.page_count();
        if n <= max_pages {
            return self.clone();
        }
        let mut rng = SplitMix64::new(seed);
        let mut data = Vec::with_capacity(max_pages * PAGE_SIZE);
        let mut needed = max_pages;
        for (i, page) in self.pages().enumerate() {
            if needed == 0 {
                break;
            }
            let remaining = n - i;
            let needed64 = u64::try_from(needed).expect("usize fits in u64");
            let remaining64 = u64::try_from(remaining).expect("usize fits in u64");
            if rng.below(remaining64) < needed64 {
                data.extend_from_slice(page);
                needed -= 1;
            }
        }
        let meta = CorpusMeta {
            source: format!("{} [sample of {max_pages}/{n} pages, seed {seed}]", self.meta.source),
            ..self.meta.clone()
        };
        Corpus::new(meta, data).expect("whole pages are page aligned")
    }
}

/// If all 512 `u64` words of the page are equal, returns that word.
pub fn same_filled_word(page: &[u8; PAGE_SIZE]) -> Option<u64> {
    let mut words = page.chunks_exact(8).map(|w| u64::from_ne_bytes(w.try_into().expect("8-byte chunk")));
    let first = words.next()?;
    words.all(|w| w == first).then_some(first)
}

fn to_page(chunk: &[u8]) -> &[u8; PAGE_SIZE] {
    chunk.try_into().expect("chunk is exactly one page")
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), CorpusError> {
    fs::write(path, bytes).map_err(|source| CorpusError::Io { path: path.to_path_buf(), source })
}

/// Reads exactly `buf.len()` bytes, reporting a truncation as `Truncated`.
fn read_exact_or_truncated<R: Read>(r: &mut R, buf: &mut [u8], what: &'static str) -> Result<(), CorpusError> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => return Err(CorpusError::Truncated { what, expected: buf.len(), got }),
            Ok(k) => got += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(CorpusError::Zstd(e)),
        }
    }
    Ok(())
}

fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes(b.try_into().expect("4 bytes"))
}

fn le_u64(b: &[u8]) -> u64 {
    u64::from_le_bytes(b.try_into().expect("8 bytes"))
}

/// Page data is read (and memory reserved for it) this much at a time.
pub const READ_CHUNK: usize = 16 << 20;

/// The fixed header's checked fields.
struct Header {
    page_count: u64,
    meta_len: u32,
}

impl Header {
    /// Bytes of the whole image: header, metadata and pages.
    fn total_len(&self) -> Result<u64, CorpusError> {
        u64::try_from(HEADER_LEN)
            .ok()
            .and_then(|h| h.checked_add(u64::from(self.meta_len)))
            .and_then(|h| h.checked_add(self.page_count.checked_mul(4096)?))
            .ok_or(CorpusError::PageCountOverflow { page_count: self.page_count })
    }
}

/// Measures a stream that records no size, keeping none of it: checks the
/// header's claim against `bound` (what the compressed file can hold),
/// then counts the stream up to the claim and [`TRAILING_LOOK`] bytes more.
/// Returns the image's length, which is the claim.
fn measure<R: Read>(mut r: R, bound: u64) -> Result<u64, CorpusError> {
    let header = read_header(&mut r)?;
    let claimed = header.total_len()?;
    if claimed > bound {
        return Err(CorpusError::ClaimExceedsStream { page_count: header.page_count, claimed, bound });
    }
    let rest = claimed - u64::try_from(HEADER_LEN).expect("28 fits");
    let counted =
        io::copy(&mut r.take(rest.saturating_add(TRAILING_LOOK)), &mut io::sink()).map_err(CorpusError::Zstd)?;
    let total = counted + u64::try_from(HEADER_LEN).expect("28 fits");
    if counted > rest {
        let extra = usize::try_from(counted - rest).expect("at most TRAILING_LOOK");
        return Err(CorpusError::TrailingData { extra });
    }
    if total != claimed {
        return Err(CorpusError::LengthMismatch { page_count: header.page_count, expected: claimed, actual: total });
    }
    Ok(total)
}

/// Reads and checks the fixed header.
fn read_header<R: Read>(r: &mut R) -> Result<Header, CorpusError> {
    let mut header = [0u8; HEADER_LEN];
    read_exact_or_truncated(r, &mut header, "header")?;
    let magic: [u8; 8] = header[0..8].try_into().expect("8 bytes");
    if magic != MAGIC {
        return Err(CorpusError::BadMagic { found: magic });
    }
    let version = le_u32(&header[8..12]);
    if version != FORMAT_VERSION {
        return Err(CorpusError::UnsupportedVersion { version });
    }
    let page_size = le_u32(&header[12..16]);
    if page_size != PAGE_SIZE_U32 {
        return Err(CorpusError::BadPageSize { page_size });
    }
    let page_count = le_u64(&header[16..24]);
    let meta_len = le_u32(&header[24..28]);
    if meta_len > MAX_META_LEN {
        return Err(CorpusError::MetaTooLarge { len: meta_len });
    }
    Ok(Header { page_count, meta_len })
}

/// Parses the plain format from `r`, whose exact length is `total_len` (a
/// plain file's size, the size a zstd frame records, or what [`measure`]
/// counted), so a length mismatch is reported before any large allocation.
/// Page data is read in chunks of at most [`READ_CHUNK`] bytes, each
/// reserved exactly.
fn parse<R: Read>(mut r: R, total_len: u64) -> Result<Corpus, CorpusError> {
    let header = read_header(&mut r)?;
    let (page_count, meta_len) = (header.page_count, header.meta_len);
    let data_len = page_count
        .checked_mul(4096)
        .and_then(|d| usize::try_from(d).ok())
        .ok_or(CorpusError::PageCountOverflow { page_count })?;
    let expected = header.total_len()?;
    if total_len != expected {
        return Err(CorpusError::LengthMismatch { page_count, expected, actual: total_len });
    }

    let mut meta_json = vec![0u8; usize::try_from(meta_len).expect("u32 fits in usize")];
    read_exact_or_truncated(&mut r, &mut meta_json, "metadata JSON")?;
    let meta: CorpusMeta = serde_json::from_slice(&meta_json).map_err(CorpusError::BadMeta)?;
    if meta.pages != page_count {
        return Err(CorpusError::MetaPagesMismatch { header: page_count, meta: meta.pages });
    }

    let mut data = Vec::new();
    let mut got = 0usize;
    while got < data_len {
        let want = (data_len - got).min(READ_CHUNK);
        data.reserve_exact(want);
        let n = r.by_ref().take(want as u64).read_to_end(&mut data).map_err(CorpusError::Zstd)?;
        if n == 0 {
            break;
        }
        got += n;
    }
    if got != data_len {
        return Err(CorpusError::Truncated { what: "page data", expected: data_len, got });
    }
    let mut extra = Vec::new();
    let extra_len = r.take(TRAILING_LOOK).read_to_end(&mut extra).map_err(CorpusError::Zstd)?;
    if extra_len != 0 {
        return Err(CorpusError::TrailingData { extra: extra_len });
    }
    Corpus::new(meta, data)
}

/// SplitMix64: tiny, fast, deterministic PRNG (not cryptographic).
#[derive(Debug, Clone)]
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`), via Lemire's multiply-shift with rejection.
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "below(0)");
        let threshold = n.wrapping_neg() % n;
        loop {
            let m = u128::from(self.next_u64()) * u128::from(n);
            let lo = u64::try_from(m & u128::from(u64::MAX)).expect("masked to 64 bits");
            if lo >= threshold {
                return u64::try_from(m >> 64).expect("high half fits in u64");
            }
        }
    }
}

pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// `uname -r`, read from procfs.
pub(crate) fn kernel_release() -> String {
    fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".to_string())
}

/// Path helper used in error messages.
pub(crate) fn proc_path(pid: i32, file: &str) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/{file}"))
}

#[cfg(test)]
mod tests;
