//! `tmem`: userspace transcendent memory — command-line interface.

mod corpuscmd;
mod restartcmd;
mod runcmd;
mod swapcmd;

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

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
    /// Kernel swap on tmem: a daemon serving compressed swap devices.
    Swap {
        #[command(subcommand)]
        what: SwapCommand,
    },
    /// A compressed cache in front of a slow file or block device (cleancache at block level).
    Cache {
        #[command(subcommand)]
        what: CacheCommand,
    },
    /// Counters of the running daemon's devices (zramctl-like), or of this user's `tmem run` instances.
    Stat {
        #[command(flatten)]
        daemon: swapcmd::DaemonArgs,
        /// Every counter, as JSON.
        #[arg(long, conflicts_with = "counters")]
        json: bool,
        /// Every counter of every device, one per line, with its unit and meaning.
        #[arg(long)]
        counters: bool,
        /// This user's `tmem run` instances rather than the daemon (also shown when no daemon runs).
        #[arg(long)]
        runs: bool,
    },
    /// Changes knobs of a device at run time (of a `tmem run` instance, run-PID: memory=SIZE): pool-limit=2G|25%, frozen=1, codec=zstd:3 (or lz4+dict: train a dictionary on the stored pages now),
    /// incompressible=reject|store_raw, max_compressed_size=N, accept_threshold_percent=N, compact=now.
    Set {
        #[command(flatten)]
        daemon: swapcmd::DaemonArgs,
        /// Device name, e.g. swap0.
        device: String,
        /// KEY=VALUE pairs.
        #[arg(required = true)]
        assignments: Vec<String>,
    },
    /// Runs a program with at most --memory of its anonymous memory resident and the rest
    /// compressed, through userfaultfd: no root, no swap (see the README for the one-time setup).
    Run(runcmd::RunArgs),
    /// Serves devices without touching local swap.
    Serve {
        #[command(subcommand)]
        what: ServeCommand,
    },
    /// Runs the daemon (started by `tmem swap up`).
    #[command(hide = true)]
    Daemon {
        /// Daemon specification, JSON.
        #[arg(long, required_unless_present = "takeover")]
        spec: Option<String>,
        /// Take over from the daemon running in this runtime directory (`tmem swap restart`).
        #[arg(long, conflicts_with = "spec")]
        takeover: Option<std::path::PathBuf>,
        /// The successor serves outside the service that is stopping (`systemctl restart`).
        #[arg(long, requires = "takeover")]
        outside_service: bool,
    },
}

#[derive(Subcommand, Debug)]
enum ServeCommand {
    /// Exports compressed block devices over NBD (unix socket, or TCP on loopback) until SIGINT/SIGTERM.
    Nbd(Box<swapcmd::ServeNbdArgs>),
}

#[derive(Subcommand, Debug)]
enum SwapCommand {
    /// Starts the daemon, exports devices over FUSE, attaches loop devices, runs mkswap and swapon.
    Up(Box<swapcmd::UpArgs>),
    /// swapoff (the kernel takes its pages back), detach, unmount, stop the daemon.
    Down(swapcmd::SwapDownArgs),
    /// Replaces the running daemon with a new process of this binary, which
    /// takes its pages, devices and mount over while swap stays on.
    Restart(restartcmd::RestartArgs),
}

#[derive(Subcommand, Debug)]
enum CacheCommand {
    /// Starts the daemon: each backing store served through an ephemeral pool, as a /dev/loopN.
    Up(Box<swapcmd::CacheUpArgs>),
    /// Detaches the loop devices, unmounts, stops the daemon (the backing stores hold every write).
    Down(swapcmd::DaemonArgs),
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Puts every page of a corpus into the store, gets it back, checks it,
    /// and compares ratio and throughput with kernel zram on the same pages.
    Store(tmem_bench::store::StoreBenchArgs),
    /// Put/get pages per second, latency and bytes on the wire for each tier (mem, disk, remote) on loopback.
    Tier(tmem_bench::tier::TierBenchArgs),
    /// The zcache/RAMster memory-pressure ladder: a workload under shrinking
    /// memory limits, swapping to disk, zram, zswap and tmem.
    Pressure(Box<tmem_bench::pressure::PressureArgs>),
    /// A read-heavy SQLite job on ext4 over a slow backing file, in a memory
    /// cgroup below its working set: plain loop device against tmem's cache.
    Cache(Box<tmem_bench::cache::CacheBenchArgs>),
    /// ccache's capacity test: a job fills memory with text, compressed
    /// files or real heaps until its cgroup's OOM killer ends it; how much
    /// it held with no swap, zram, zswap and tmem on the same RAM budget.
    Capacity(Box<tmem_bench::capacity::CapacityArgs>),
    /// zswap's SPECjbb ramp: a Java job's live heap grows in steps past its
    /// memory limit; its throughput and swap rate per step over disk swap,
    /// zswap, zram and tmem.
    Ramp(Box<tmem_bench::ramp::RampArgs>),
    /// The swap-in round trip alone: pages pushed to swap with
    /// MADV_PAGEOUT, then touched one at a time (random and sequential);
    /// fault latency and swap readahead over zram, fuse-ram and tmem.
    Fault(Box<tmem_bench::fault::FaultArgs>),
    /// Checksum jobs swap against a pool with a remote and a disk tier while
    /// restarts, Redis node kills, `tmem set` changes, recompression and
    /// daemon kills arrive at seeded random times; every page must come back.
    Soak(Box<tmem_bench::soak::SoakArgs>),
    /// The touching process of `bench fault`'s tmem-run row (started by it, under `tmem run`).
    #[command(hide = true, name = "fault-toucher")]
    FaultToucher {
        #[arg(long)]
        pages: usize,
        #[arg(long)]
        seed: u64,
    },
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
    /// Writes corpus pages out raw (one after the other), for a zram device
    /// or another tool, and optionally a zstd dictionary trained on them.
    Export(corpuscmd::ExportArgs),
}

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if !matches!(cli.command, Command::Daemon { .. }) {
        tmem_daemon::logging::init_cli();
    }
    let up_matches =
        matches.subcommand_matches("swap").and_then(|m| m.subcommand_matches("up")).cloned().unwrap_or_default();
    if let Command::Run(a) = &cli.command {
        return runcmd::run(a).unwrap_or_else(|e| {
            eprintln!("tmem: {}", error_line(&e));
            ExitCode::FAILURE
        });
    }
    let result: anyhow::Result<()> = match cli.command {
        Command::Bench { what: BenchCommand::Store(args) } => tmem_bench::store::run_store(&args),
        Command::Bench { what: BenchCommand::Tier(args) } => tmem_bench::tier::run(&args),
        Command::Bench { what: BenchCommand::Pressure(args) } => tmem_bench::pressure::run(&args),
        Command::Bench { what: BenchCommand::Cache(args) } => tmem_bench::cache::run(&args),
        Command::Bench { what: BenchCommand::Capacity(args) } => tmem_bench::capacity::run(&args),
        Command::Bench { what: BenchCommand::Ramp(args) } => tmem_bench::ramp::run(&args),
        Command::Bench { what: BenchCommand::Fault(args) } => tmem_bench::fault::run(&args),
        Command::Bench { what: BenchCommand::FaultToucher { pages, seed } } => {
            std::process::exit(tmem_bench::fault::toucher_main(pages, seed))
        }
        Command::Bench { what: BenchCommand::Soak(args) } => tmem_bench::soak::run(&args),
        Command::Corpus { what: CorpusCommand::Capture(args) } => tmem_corpus::run_capture(&args).map_err(Into::into),
        Command::Corpus { what: CorpusCommand::Info { files } } => corpuscmd::info(&files),
        Command::Corpus { what: CorpusCommand::Export(a) } => corpuscmd::export(&a),
        Command::Swap { what: SwapCommand::Up(a) } => swapcmd::up(&a, &up_matches),
        Command::Swap { what: SwapCommand::Down(a) } => swapcmd::swap_down(&a),
        Command::Swap { what: SwapCommand::Restart(a) } => restartcmd::restart(&a),
        Command::Cache { what: CacheCommand::Up(a) } => swapcmd::cache_up(&a),
        Command::Cache { what: CacheCommand::Down(a) } => swapcmd::down(&a, "cache"),
        Command::Stat { daemon, json, counters, runs } => swapcmd::stat(&daemon, json, counters, runs),
        Command::Set { daemon, device, assignments } => swapcmd::set(&daemon, &device, &assignments),
        Command::Serve { what: ServeCommand::Nbd(a) } => swapcmd::serve_nbd(&a),
        Command::Daemon { spec: Some(spec), .. } => swapcmd::run_daemon(&spec),
        Command::Daemon { takeover: Some(dir), outside_service, .. } => {
            let role = match outside_service {
                true => tmem_daemon::handover::Successor::OutsideService,
                false => tmem_daemon::handover::Successor::InService,
            };
            tmem_daemon::handover::run_successor(dir, role).map_err(Into::into)
        }
        Command::Daemon { .. } => unreachable!("clap requires --spec or --takeover"),
        Command::Run(_) => unreachable!("handled above"),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tmem: {}", error_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// `e` and its causes in one line. The library errors already name their
/// cause in their own text, so a cause that the line holds already is left
/// out (`{e:#}` would repeat it), while a context's cause is kept.
fn error_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain().map(ToString::to_string) {
        if !line.contains(&cause) {
            if !line.is_empty() {
                line.push_str(": ");
            }
            line.push_str(&cause);
        }
    }
    line
}

#[cfg(test)]
mod tests {
    use super::error_line;

    #[test]
    fn an_error_line_keeps_a_contexts_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let e = anyhow::Error::new(io).context("swap down at the end");
        assert_eq!(error_line(&e), "swap down at the end: no such file");
        #[derive(Debug, thiserror::Error)]
        #[error("config: {0}")]
        struct Named(#[source] std::io::Error);
        let named = Named(std::io::Error::other("line 3: bad key"));
        assert_eq!(error_line(&anyhow::Error::new(named)), "config: line 3: bad key");
    }
}
