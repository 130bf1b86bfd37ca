//! `tmem run`: a program with at most `--memory` of its anonymous memory
//! resident, the rest compressed in a tmem store, through userfaultfd.

use std::ffi::OsString;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context};
use tmem_uffd::manager::{self, RunConfig, RunReport};

mod control;

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Most anonymous memory PROGRAM keeps resident: 512M, 2G, ... The rest
    /// is kept compressed and comes back on the first touch.
    #[arg(long, value_parser = tmem_corpus::parse_size)]
    memory: u64,
    /// Codec of the pool: lz4, zstd, zstd:LEVEL or raw; "+dict" trains a
    /// dictionary once the pool holds 8 MiB, and newer ones as it grows.
    #[arg(long, default_value = "lz4")]
    codec: String,
    /// Most memory the pool may use (a size, or a percentage of RAM); with
    /// --tier, the oldest pages then move down to the tier.
    #[arg(long, default_value = "100%")]
    pool_limit: tmem_daemon::PoolLimit,
    #[command(flatten)]
    tiers: tmem_daemon::tiers::TierArgs,
    #[command(flatten)]
    recompress: tmem_daemon::spec::RecompressArgs,
    /// Largest read-ahead window, in pages: a fault that continues one of
    /// the program's sequential streams also maps up to this many pages
    /// after it, from the pool, or zeros where the program never had a
    /// page (0: none).
    #[arg(long, default_value_t = tmem_uffd::readahead::MAX_WINDOW, value_parser = clap::value_parser!(u64).range(0..=tmem_uffd::readahead::MAX_WINDOW))]
    read_ahead: u64,
    /// Serve Prometheus metrics (OpenMetrics text at /metrics) on this address, e.g. 127.0.0.1:9849.
    #[arg(long)]
    metrics: Option<std::net::SocketAddr>,
    /// Allow a non-loopback --metrics address (/metrics has no authentication: trusted networks only).
    #[arg(long, requires = "metrics")]
    allow_remote_metrics: bool,
    /// PROGRAM and its arguments (after `--`).
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true, value_name = "PROGRAM")]
    command: Vec<OsString>,
}

/// Finds `name` as `execvp` would.
fn resolve(name: &OsString) -> Option<PathBuf> {
    let p = Path::new(name);
    if p.components().count() > 1 {
        return Some(p.to_path_buf());
    }
    tmem_corpus::which(p.to_str()?)
}

/// Why the dynamic loader would not preload the agent into `path`, if it would not.
fn unenterable(path: &Path) -> anyhow::Result<Option<String>> {
    let meta = std::fs::metadata(path).with_context(|| format!("{}", path.display()))?;
    if meta.permissions().mode() & 0o6000 != 0 {
        return Ok(Some("is set-user-ID or set-group-ID: the dynamic loader ignores LD_PRELOAD for it".into()));
    }
    let mut head = [0u8; 4096];
    let n = std::fs::File::open(path)?.read(&mut head)?;
    let head = &head[..n];
    if let Some(rest) = head.strip_prefix(b"#!") {
        // A script: its interpreter is what runs.
        let line = rest.split(|&b| b == b'\n').next().unwrap_or_default();
        let interp = String::from_utf8_lossy(line).split_whitespace().next().unwrap_or_default().to_string();
        return unenterable(Path::new(&interp)).map(|why| why.map(|w| format!("runs {interp}, which {w}")));
    }
    match elf_has_interpreter(head) {
        Some(true) => Ok(None),
        Some(false) => Ok(Some("is statically linked: there is no dynamic loader to preload the tmem agent".into())),
        None => Ok(Some("is not a 64-bit ELF executable or script".into())),
    }
}

/// Whether a 64-bit little-endian ELF image has a `PT_INTERP` header.
/// Hand-written: two fields and a loop, where an ELF crate would be a large
/// dependency for one question.
fn elf_has_interpreter(head: &[u8]) -> Option<bool> {
    if head.len() < 64 || &head[..4] != b"\x7fELF" || head[4] != 2 || head[5] != 1 {
        return None;
    }
    let u16_at = |i: usize| u16::from_le_bytes([head[i], head[i + 1]]);
    let phoff = usize::try_from(u64::from_le_bytes(head[32..40].try_into().ok()?)).ok()?;
    let (phentsize, phnum) = (usize::from(u16_at(54)), usize::from(u16_at(56)));
    for i in 0..phnum {
        let at = phoff + i * phentsize;
        let p_type = head.get(at..at + 4)?;
        if u32::from_le_bytes(p_type.try_into().ok()?) == 3 {
            return Some(true);
        }
    }
    Some(false)
}

/// The agent library: `TMEM_RUN_AGENT`, beside this binary, or where the package puts it.
fn agent() -> anyhow::Result<PathBuf> {
    const NAME: &str = "libtmem_run_agent.so";
    if let Some(p) = std::env::var_os("TMEM_RUN_AGENT") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe()?;
    let dir = exe.parent().unwrap_or(Path::new("/"));
    // In a cargo target directory the library is in `deps/` and, when built
    // on its own, beside the binary too: the newer one is this build's.
    let built = [dir.join(NAME), dir.join("deps").join(NAME)]
        .into_iter()
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .max()
        .map(|(_, p)| p);
    let installed = [dir.join("../lib/tmem").join(NAME), PathBuf::from("/usr/lib/tmem").join(NAME)];
    built.into_iter().chain(installed).find(|c| c.is_file()).with_context(|| {
        format!(
            "the tmem agent library {NAME} is not installed (looked in {}); set TMEM_RUN_AGENT to its path",
            dir.display()
        )
    })
}

pub fn run(a: &RunArgs) -> anyhow::Result<ExitCode> {
    let program = a.command[0].clone();
    let Some(path) = resolve(&program) else { bail!("{}: command not found", program.to_string_lossy()) };
    if let Some(why) = unenterable(&path)? {
        bail!("{} {why}; tmem run cannot manage it, so it does not start it", path.display());
    }
    // The program makes its userfaultfd as this user: check that it may, and
    // say which setting allows it, before anything runs.
    tmem_uffd::sys::Uffd::create().and_then(|u| u.handshake())?;
    let ram = tmem_sys::swap::total_ram_bytes()?;
    // The store a device of this codec and pool limit would have.
    let spec = tmem_daemon::spec::DeviceSpec {
        name: "run".into(),
        size: a.memory,
        codec: a.codec.clone(),
        pool_limit: a.pool_limit,
        recompress: a.recompress.clone(),
        group: tmem_daemon::spec::GroupArgs::default(),
    };
    let store = tmem_daemon::spec::store_config(&spec, ram)?;
    a.tiers.validate(1)?;
    // Sized as for a device of all of RAM: the disk tier's file is sparse.
    let tiers = a.tiers.build(&format!("run-{}", std::process::id()), ram)?;
    let cfg = RunConfig {
        memory_bytes: a.memory,
        store: tmem_core::StoreConfig { shared_memory: false, ..store },
        tiers,
        recompress: a.recompress.config()?,
        read_ahead: a.read_ahead,
        agent: agent()?,
        program,
        args: a.command[1..].to_vec(),
    };
    let mut exposed = None;
    let metrics = a.metrics.map(|m| (m, a.allow_remote_metrics));
    // The disk tier's file of this run, when tmem named it: its pages die with the run.
    let tier_file = a.tiers.tiers.iter().find_map(|t| match t {
        tmem_daemon::tiers::TierSpec::Disk(p) if p.is_dir() => Some(p.join(format!("run-{}.back", std::process::id()))),
        _ => None,
    });
    let _remove_tier_file = scopeguard::guard(tier_file, |f| {
        if let Some(f) = f {
            let _ = std::fs::remove_file(f);
        }
    });
    let report = manager::run(&cfg, |o| {
        match control::Exposed::start(&o, metrics) {
            Ok(e) => exposed = Some(e),
            // The control socket is for looking on: the program runs without it.
            Err(e) if metrics.is_none() => {
                eprintln!("tmem run: warning: no control socket ({e}): `tmem stat --runs` will not list this run");
            }
            Err(e) => return Err(e),
        }
        Ok(())
    })?;
    drop(exposed);
    eprintln!("{}", summary(&cfg, &report));
    let code = match report.status {
        Some(s) => s.code().unwrap_or_else(|| 128 + std::os::unix::process::ExitStatusExt::signal(&s).unwrap_or(0)),
        None => 1,
    };
    Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)))
}

fn mib(pages: u64) -> f64 {
    pages as f64 * 4096.0 / f64::from(1 << 20)
}

fn summary(cfg: &RunConfig, r: &RunReport) -> String {
    let s = &r.stats;
    let e = &s.engine;
    let limit = s.memory_limit_bytes / 4096;
    let ratio = if s.pool_peak_bytes > 0 { r.peak_pool_pages as f64 * 4096.0 / s.pool_peak_bytes as f64 } else { 0.0 };
    format!(
        "tmem run: {} {}; resident at most {:.1} MiB of --memory {:.1} MiB ({:.1} MiB over it at most; faults wait past {:.1} MiB over, \
         and pages the program touched before a scan registered them come on top); pool at most {:.1} MiB for {:.1} MiB of pages ({ratio:.2}x, {}); \
         faults: {} first touches, {} from the pool, {} caught in flight; {} stored pages read ahead of them and {} fresh ones filled with zeros ahead; {} pages evicted, {} adopted by scans ({} left out, dropped by the program before its zap, and {} in ranges unmapped or moved during the scan), {} busy, {} lost, {} refused by the pool; \
         {} faults on pages held as resident, filled with zeros (dropped by the program before its event came); \
         faults waited for room {} times, {:.1} s in all; the evictor worked {:.1} s; {} process(es)",
        cfg.program.to_string_lossy(),
        r.status.map_or_else(|| "did not start".into(), |s| s.to_string()),
        mib(s.resident_peak_pages),
        mib(limit),
        mib(s.resident_peak_pages.saturating_sub(limit)),
        mib(s.slack_pages),
        s.pool_peak_bytes as f64 / f64::from(1 << 20),
        mib(r.peak_pool_pages),
        r.codec,
        e.zero_fills,
        e.store_fills,
        e.slot_returns,
        e.read_ahead,
        e.zeros_ahead,
        e.evicted,
        e.adopted,
        e.adopt_doomed,
        e.adopt_unmapped,
        e.move_busy,
        s.lost_pages,
        e.put_refused,
        e.dropped_unseen,
        s.room_waits,
        s.room_wait_us as f64 / 1e6,
        s.evict_us as f64 / 1e6,
        s.processes_ended,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_and_dynamic_binaries_are_told_apart() {
        let head = |p: &str| {
            let mut b = vec![0u8; 4096];
            let n = std::fs::File::open(p).unwrap().read(&mut b).unwrap();
            b.truncate(n);
            b
        };
        assert_eq!(elf_has_interpreter(&head("/bin/sh")), Some(true));
        assert_eq!(elf_has_interpreter(b"#!/bin/sh\n"), None);
        assert!(unenterable(Path::new("/bin/sh")).unwrap().is_none());
    }
}
