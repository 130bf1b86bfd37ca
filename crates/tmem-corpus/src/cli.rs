//! `tmem corpus capture` arguments and driver.

use std::path::PathBuf;

use clap::ArgGroup;

use crate::{capture_pid, spawn_and_capture, CorpusError, SpawnKind};

/// Arguments of `tmem corpus capture`: capture a running process (`--pid`)
/// or spawn a representative program (`--spawn`) and write a corpus file.
#[derive(Debug, Clone, clap::Args)]
#[command(group(ArgGroup::new("capture_source").required(true).args(["pid", "spawn"])))]
pub struct CaptureArgs {
    /// Capture the private anonymous memory of this running process
    /// (root needed for other users' processes).
    #[arg(long, value_name = "PID")]
    pub pid: Option<i32>,

    /// Spawn this program, let it build a heap, and capture it.
    #[arg(long, value_enum, value_name = "PROGRAM")]
    pub spawn: Option<SpawnKind>,

    /// Capture at most this many bytes (suffixes K, M, G, T; powers of 1024).
    #[arg(long, value_name = "N", default_value = "64M", value_parser = parse_size)]
    pub max_bytes: u64,

    /// Corpus file to write.
    #[arg(short, long, value_name = "FILE")]
    pub output: PathBuf,

    /// Write the plain format instead of a zstd-compressed file.
    #[arg(long)]
    pub no_compress: bool,
}

/// Parses a byte size: a number with an optional binary suffix
/// (`K`/`KiB`/`KB`, `M`, `G`, `T`, case-insensitive; `B` alone is allowed),
/// e.g. `4096`, `64M`, `1G`, `512KiB`.
///
/// By hand, not `bytesize`: it reads `K`, `M`, `G` as powers of 1000, where
/// the swap tools users know (zramctl, losetup, mkswap) read powers of 1024.
/// A clap value parser, hence the `String` error.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, suffix) = t.split_at(split);
    if num.is_empty() {
        return Err(format!("invalid size {s:?}: expected a number like 4096, 64M or 1G"));
    }
    let n: u64 = num.parse().map_err(|_| format!("invalid size {s:?}: number too large"))?;
    let shift = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        other => return Err(format!("invalid size {s:?}: unknown suffix {other:?} (use K, M, G or T)")),
    };
    n.checked_mul(1u64 << shift).ok_or_else(|| format!("invalid size {s:?}: too large"))
}

/// Captures according to `args`, writes the corpus file, and prints a
/// one-line summary to stdout.
pub fn run_capture(args: &CaptureArgs) -> Result<(), CorpusError> {
    check_max_bytes(args.max_bytes, args.spawn.is_some(), mem_total()?)?;
    let corpus = match (args.pid, args.spawn) {
        (Some(pid), None) => capture_pid(pid, args.max_bytes)?,
        (None, Some(kind)) => spawn_and_capture(kind, args.max_bytes)?,
        _ => return Err(CorpusError::InvalidArgument("exactly one of --pid and --spawn must be given".to_string())),
    };
    let bytes = corpus.to_bytes(!args.no_compress);
    std::fs::write(&args.output, &bytes).map_err(|source| CorpusError::Io { path: args.output.clone(), source })?;
    let stats = corpus.stats();
    println!(
        "captured {} pages ({} bytes) from {}: {} same-filled pages ({} zero); wrote {} ({} bytes{})",
        stats.pages,
        corpus.data().len(),
        corpus.meta.source,
        stats.same_filled,
        stats.zero,
        args.output.display(),
        bytes.len(),
        if args.no_compress { "" } else { ", zstd" },
    );
    Ok(())
}

/// `--max-bytes` against this machine's RAM: the capture is held in memory
/// (half of RAM at most), and a spawned program first builds 1.25 times as
/// much (a quarter of RAM at most then).
fn check_max_bytes(max_bytes: u64, spawn: bool, total_ram: u64) -> Result<(), CorpusError> {
    let (limit, why) = match spawn {
        true => (total_ram / 4, "a quarter of RAM: the spawned program builds 1.25 times as much first"),
        false => (total_ram / 2, "half of RAM: the capture is held in memory"),
    };
    if max_bytes > limit {
        return Err(CorpusError::InvalidArgument(format!(
            "--max-bytes {max_bytes} is above the limit of {limit}: {why}"
        )));
    }
    Ok(())
}

/// `MemTotal` of /proc/meminfo, bytes.
fn mem_total() -> Result<u64, CorpusError> {
    let path = PathBuf::from("/proc/meminfo");
    let text = std::fs::read_to_string(&path).map_err(|source| CorpusError::Io { path: path.clone(), source })?;
    text.lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|kb| kb.trim().parse::<u64>().ok())
        .map(|kb| kb.saturating_mul(1024))
        .ok_or_else(|| CorpusError::Io { path, source: std::io::Error::other("no MemTotal line in kB") })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn max_bytes_is_bounded_by_ram() {
        let ram = 8 << 30;
        check_max_bytes(4 << 30, false, ram).unwrap();
        check_max_bytes(2 << 30, true, ram).unwrap();
        let e = check_max_bytes(99999 << 40, false, ram).unwrap_err().to_string();
        assert!(e.contains("--max-bytes 109950063265972224") && e.contains("limit of 4294967296"), "{e}");
        assert!(check_max_bytes(3 << 30, true, ram).unwrap_err().to_string().contains("spawned"));
        assert!(mem_total().unwrap() > 1 << 20);
    }

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        capture: CaptureArgs,
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("64m"), Ok(64 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("512KiB"), Ok(512 << 10));
        assert_eq!(parse_size("2 MB"), Ok(2 << 20));
        assert!(parse_size("").is_err());
        assert!(parse_size("M").is_err());
        assert!(parse_size("12X").is_err());
        assert!(parse_size("-5").is_err());
        assert!(parse_size("99999999999999999999").is_err());
        assert!(parse_size("17000000T").is_err());
    }

    #[test]
    fn args() {
        let c = Cli::try_parse_from(["t", "--spawn", "redis", "-o", "x.tcorp"]).unwrap();
        assert_eq!(c.capture.spawn, Some(SpawnKind::Redis));
        assert_eq!(c.capture.max_bytes, 64 << 20);
        assert!(!c.capture.no_compress);
        let c =
            Cli::try_parse_from(["t", "--pid", "42", "--max-bytes", "1G", "--output", "y", "--no-compress"]).unwrap();
        assert_eq!(c.capture.pid, Some(42));
        assert_eq!(c.capture.max_bytes, 1 << 30);
        assert!(c.capture.no_compress);
        // Exactly one of --pid / --spawn.
        assert!(Cli::try_parse_from(["t", "-o", "x"]).is_err());
        assert!(Cli::try_parse_from(["t", "--pid", "1", "--spawn", "cc", "-o", "x"]).is_err());
        assert!(Cli::try_parse_from(["t", "--spawn", "perl", "-o", "x"]).is_err());
        assert!(Cli::try_parse_from(["t", "--pid", "1"]).is_err());
        assert!(Cli::try_parse_from(["t", "--pid", "1", "-o", "x", "--max-bytes", "1Q"]).is_err());
    }
}
