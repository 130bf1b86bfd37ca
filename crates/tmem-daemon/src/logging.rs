//! The daemon's log: `tracing`, filtered by `RUST_LOG` (default `info`),
//! one plain line per event on stderr, no colours. Started by `tmem swap
//! up`, stderr is `RUNTIME_DIR/daemon.log` and each line has a timestamp;
//! under systemd (`JOURNAL_STREAM` set) journald adds its own, so the lines
//! carry none.

use tracing_subscriber::EnvFilter;

/// The command line's log (benchmarks' notes, warnings of cleanup guards):
/// level and message only, on stderr, filtered by `RUST_LOG` (default `info`).
pub fn init_cli() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .without_time()
        .with_target(false)
        .try_init();
}

/// Installs the daemon's subscriber (once; later calls do nothing).
pub fn init() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(false);
    let _ = if std::env::var_os("JOURNAL_STREAM").is_some() {
        builder.without_time().with_target(false).try_init()
    } else {
        builder.with_target(false).try_init()
    };
}
