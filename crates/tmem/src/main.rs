//! `tmem`: userspace transcendent memory — command-line interface.

mod bench;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Userspace transcendent memory: a compressed, tiered page store.
#[derive(Parser, Debug)]
#[command(name = "tmem", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
    /// Page corpora captured from real programs.
    Corpus {
        #[command(subcommand)]
        what: CorpusCommand,
    },
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Puts every page of a corpus into the store, gets it back, checks it,
    /// and compares ratio and throughput with kernel zram on the same pages.
    Store(bench::StoreBenchArgs),
}

#[derive(Subcommand, Debug)]
enum CorpusCommand {
    /// Captures the private anonymous memory of a process into a corpus file.
    Capture(tmem_corpus::CaptureArgs),
    /// Prints what a corpus file holds.
    Info {
        /// Corpus files.
        #[arg(required = true)]
        files: Vec<std::path::PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result: Result<(), String> = match cli.command {
        Command::Bench { what: BenchCommand::Store(args) } => bench::run_store(&args),
        Command::Corpus { what: CorpusCommand::Capture(args) } => {
            tmem_corpus::run_capture(&args).map_err(|e| e.to_string())
        }
        Command::Corpus { what: CorpusCommand::Info { files } } => corpus_info(&files),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tmem: {e}");
            ExitCode::FAILURE
        }
    }
}

fn corpus_info(files: &[std::path::PathBuf]) -> Result<(), String> {
    for f in files {
        let c = tmem_corpus::Corpus::read(f).map_err(|e| e.to_string())?;
        let meta = serde_json::to_string(&c.meta).map_err(|e| e.to_string())?;
        println!("{}: {} pages ({:.1} MiB) {meta}", f.display(), c.page_count(), c.data().len() as f64 / 1048576.0);
    }
    Ok(())
}
