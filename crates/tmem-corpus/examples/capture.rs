//! Capture corpora without the `tmem` CLI.
//!
//! ```text
//! cargo run --release -p tmem-corpus --example capture -- --spawn python -o python.tcorp
//! cargo run --release -p tmem-corpus --example capture -- --pid 1234 --max-bytes 256M -o app.tcorp
//! # regenerate the built-in corpora (512-page samples, zstd -19) and, with
//! # --large DIR, also keep the full captures (plain) in DIR:
//! cargo run --release -p tmem-corpus --example capture -- builtin [--large /var/tmp/tmem-corpus]
//! # ... or sample existing captures DIR/{python,java,cc,redis}.tcorp:
//! cargo run --release -p tmem-corpus --example capture -- builtin --from /var/tmp/tmem-corpus
//! # print statistics of corpus files
//! cargo run --release -p tmem-corpus --example capture -- stats FILE...
//! # dump the generated C source used for `--spawn cc`
//! cargo run --release -p tmem-corpus --example capture -- cgen BYTES > big.c
//! ```

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tmem_corpus::{
    run_capture, spawn_and_capture, CaptureArgs, Corpus, CorpusError, SpawnKind, BUILTIN_NAMES, BUILTIN_ZSTD_LEVEL,
};

/// Pages per built-in corpus (2 MiB).
const BUILTIN_PAGES: usize = 512;
/// Seed of the built-in samples.
const BUILTIN_SEED: u64 = 0x7E3E_C0DE;

#[derive(Parser)]
#[command(args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Cmd>,
    #[command(flatten)]
    capture: Option<CaptureArgs>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Regenerate crates/tmem-corpus/builtin/*.tcorp.
    Builtin {
        /// Bytes to capture per program before sampling.
        #[arg(long, default_value = "64M", value_parser = tmem_corpus::parse_size)]
        max_bytes: u64,
        /// Also write the full captures (uncompressed) into this directory.
        #[arg(long)]
        large: Option<PathBuf>,
        /// Only these programs (default: all).
        #[arg(long, value_enum)]
        only: Vec<SpawnKind>,
        /// Sample existing captures DIR/{python,java,cc,redis}.tcorp instead
        /// of spawning the programs.
        #[arg(long, value_name = "DIR", conflicts_with = "large")]
        from: Option<PathBuf>,
    },
    /// Print page statistics of corpus files.
    Stats { files: Vec<PathBuf> },
    /// Print the C source `--spawn cc` compiles for the given cc1 memory target.
    Cgen {
        #[arg(value_parser = tmem_corpus::parse_size)]
        bytes: u64,
    },
}

fn builtin_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("builtin")
}

fn regenerate(
    max_bytes: u64,
    large: Option<&Path>,
    only: &[SpawnKind],
    from: Option<&Path>,
) -> Result<(), CorpusError> {
    if let Some(dir) = large {
        std::fs::create_dir_all(dir).map_err(|source| CorpusError::Io { path: dir.to_path_buf(), source })?;
    }
    for (kind, name) in SpawnKind::ALL.into_iter().zip(BUILTIN_NAMES) {
        if !only.is_empty() && !only.contains(&kind) {
            continue;
        }
        let t = std::time::Instant::now();
        let full = match from {
            Some(dir) => Corpus::read(&dir.join(format!("{name}.tcorp")))?,
            None => spawn_and_capture(kind, max_bytes)?,
        };
        let s = full.stats();
        println!(
            "{name}: {} pages in {:.1?} ({} same-filled, {} zero) from {}",
            s.pages,
            t.elapsed(),
            s.same_filled,
            s.zero,
            full.meta.source
        );
        if let Some(dir) = large {
            let path = dir.join(format!("{name}.tcorp"));
            full.write(&path, false)?;
            println!("  wrote {}", path.display());
        }
        let sample = full.sample(BUILTIN_PAGES, BUILTIN_SEED);
        let path = builtin_dir().join(format!("{name}.tcorp"));
        sample.write_with_level(&path, BUILTIN_ZSTD_LEVEL)?;
        let s = sample.stats();
        let size = std::fs::metadata(&path).map_or(0, |m| m.len());
        println!(
            "  wrote {} ({} pages, {size} bytes, {} same-filled, {} zero)",
            path.display(),
            s.pages,
            s.same_filled,
            s.zero
        );
    }
    Ok(())
}

fn stats(files: &[PathBuf]) -> Result<(), CorpusError> {
    for f in files {
        let c = Corpus::read(f)?;
        let s = c.stats();
        let packed = zstd::bulk::compress(c.data(), 3).map_or(0, |v| v.len());
        println!(
            "{}: {} pages, {} same-filled ({} zero), zstd-3 ratio {:.2}, program {}, source {}",
            f.display(),
            s.pages,
            s.same_filled,
            s.zero,
            c.data().len() as f64 / packed.max(1) as f64,
            c.meta.program,
            c.meta.source
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match (cli.command, cli.capture) {
        (Some(Cmd::Builtin { max_bytes, large, only, from }), _) => {
            regenerate(max_bytes, large.as_deref(), &only, from.as_deref())
        }
        (Some(Cmd::Stats { files }), _) => stats(&files),
        (Some(Cmd::Cgen { bytes }), _) => {
            print!("{}", tmem_corpus::generated_c_source(bytes));
            Ok(())
        }
        (None, Some(args)) => run_capture(&args),
        (None, None) => {
            eprintln!("give --pid/--spawn, or a subcommand (see --help)");
            return ExitCode::FAILURE;
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
