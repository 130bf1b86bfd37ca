use std::io;
use std::path::PathBuf;

/// Everything that can go wrong reading, writing or capturing a corpus.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CorpusError {
    // ----- files ---------------------------------------------------------
    /// Reading or writing a corpus file failed.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// A corpus file was read but its contents are invalid.
    #[error("{}: invalid corpus file: {source}", path.display())]
    InFile {
        path: PathBuf,
        #[source]
        source: Box<CorpusError>,
    },

    // ----- format --------------------------------------------------------
    /// Page data handed to `Corpus::new` is not a whole number of pages.
    #[error("page data is {len} bytes, not a multiple of the 4096-byte page size")]
    NotPageAligned { len: usize },
    /// The input ends before the named part is complete.
    #[error("truncated corpus: {what} needs {expected} bytes but only {got} are present")]
    Truncated { what: &'static str, expected: usize, got: usize },
    /// The first 8 bytes are not `TMEMCORP` (and not a zstd frame).
    #[error("not a tmem corpus: bad magic {found:02x?} (expected \"TMEMCORP\" or a zstd frame)")]
    BadMagic { found: [u8; 8] },
    /// The format version is not 1.
    #[error("unsupported corpus format version {version} (this build reads version 1)")]
    UnsupportedVersion { version: u32 },
    /// The header's page size is not 4096.
    #[error("unsupported page size {page_size} (only 4096-byte pages are supported)")]
    BadPageSize { page_size: u32 },
    /// The metadata JSON length exceeds `MAX_META_LEN`.
    #[error("metadata JSON length {len} exceeds the 1 MiB limit")]
    MetaTooLarge { len: u32 },
    /// `page_count * 4096` (plus the header) overflows.
    #[error("page count {page_count} is too large (byte size overflows)")]
    PageCountOverflow { page_count: u64 },
    /// The (uncompressed) input length does not match the header.
    #[error(
        "corpus length mismatch: header says {page_count} pages, i.e. {expected} bytes in total, \
         but the input is {actual} bytes"
    )]
    LengthMismatch { page_count: u64, expected: u64, actual: u64 },
    /// A zstd stream that records no size claims more than a stream of its size can hold.
    #[error(
        "header says {page_count} pages, i.e. {claimed} bytes in total, more than the {bound} bytes \
         that a zstd stream of this file's size can hold"
    )]
    ClaimExceedsStream { page_count: u64, claimed: u64, bound: u64 },
    /// Bytes follow the page data inside a zstd frame.
    #[error("{extra} unexpected bytes after the page data")]
    TrailingData { extra: usize },
    /// The metadata is not valid JSON for `CorpusMeta`.
    #[error("invalid corpus metadata JSON: {0}")]
    BadMeta(#[source] serde_json::Error),
    /// `meta.pages` disagrees with the header's page count.
    #[error("metadata says {meta} pages but the header says {header}")]
    MetaPagesMismatch { header: u64, meta: u64 },
    /// zstd decompression failed (corrupt or truncated frame).
    #[error("zstd decompression failed: {0}")]
    Zstd(#[source] io::Error),

    // ----- capture -------------------------------------------------------
    /// An argument is out of range (pid <= 0, max_bytes < one page, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The process does not exist (or exited during capture).
    #[error("process {pid} not found (no {})", path.display())]
    ProcessNotFound { pid: i32, path: PathBuf },
    /// Not allowed to read the process's memory or to signal it.
    #[error(
        "permission denied accessing {} of pid {pid}: capturing another user's process needs \
         root (or CAP_SYS_PTRACE), and ptrace restrictions (yama) may apply; try running as root",
        path.display()
    )]
    PermissionDenied {
        pid: i32,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Reading a /proc file of the process failed.
    #[error("pid {pid}: reading {} failed: {source}", path.display())]
    Proc {
        pid: i32,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// A line of /proc/PID/maps could not be parsed.
    #[error("pid {pid}: cannot parse /proc/{pid}/maps line {line:?}")]
    BadMapsLine { pid: i32, line: String },
    /// Sending SIGSTOP/SIGCONT failed.
    #[error("pid {pid}: sending {signal} failed: {source}")]
    Signal {
        pid: i32,
        signal: &'static str,
        #[source]
        source: io::Error,
    },

    // ----- spawned programs ----------------------------------------------
    /// A program needed for `--spawn` is not installed.
    #[error("{program} not found in PATH: {hint}")]
    ProgramNotFound { program: String, hint: String },
    /// Starting a program, or talking to it, failed.
    #[error("{program}: {action} failed: {source}")]
    Child {
        program: String,
        action: String,
        #[source]
        source: io::Error,
    },
    /// A spawned program exited (or failed) before it was captured.
    #[error("{program} failed before capture ({status}); output:\n{output}")]
    ChildFailed { program: String, status: String, output: String },
    /// A spawned program did not become ready in time.
    #[error("timed out after {secs} s waiting for {what}")]
    Timeout { what: String, secs: u64 },
    /// The redis server replied with an error or spoke unexpected RESP.
    #[error("redis: {0}")]
    Redis(String),
    /// Creating or cleaning up a temporary directory failed.
    #[error("temporary directory {}: {source}", path.display())]
    TempDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}
