//! Progress of a benchmark on stderr.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Progress on stderr: an `indicatif` bar on a terminal; elsewhere (a log
/// file, CI) one line per step, and notes on lines of their own either way.
pub struct Progress {
    bar: ProgressBar,
    quiet: bool,
}

impl Progress {
    /// A bar that draws nothing and prints nothing (for `--json` runs).
    pub fn hidden() -> Self {
        Self { bar: ProgressBar::hidden(), quiet: true }
    }

    /// A bar of `total` steps.
    pub fn new(total: usize) -> Self {
        let bar = ProgressBar::with_draw_target(
            Some(u64::try_from(total).unwrap_or(u64::MAX)),
            ProgressDrawTarget::stderr_with_hz(1),
        );
        bar.set_style(
            ProgressStyle::with_template("[{bar:20}] {pos}/{len} {wide_msg} {elapsed}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("#>-"),
        );
        Self { bar, quiet: false }
    }

    /// Shows the step in progress; `step` also prints it where no bar is drawn.
    pub fn show(&self, what: &str, step: bool) {
        self.bar.set_message(what.to_owned());
        if step && self.bar.is_hidden() && !self.quiet {
            eprintln!("[{}/{}] {what}", self.bar.position(), self.bar.length().unwrap_or(0));
        }
    }

    /// Counts `n` steps done (skipped steps too).
    pub fn steps_done(&self, n: usize) {
        self.bar.inc(u64::try_from(n).unwrap_or(u64::MAX));
    }

    /// Prints a message on its own line.
    pub fn note(&self, msg: &str) {
        if !self.quiet {
            self.bar.suspend(|| eprintln!("{msg}"));
        }
    }

    /// Runs `f` (which prints) with the bar cleared.
    pub fn suspend<R>(&self, f: impl FnOnce() -> R) -> R {
        self.bar.suspend(f)
    }

    /// Ends the bar.
    pub fn finish(&self) {
        self.bar.finish_with_message("done");
    }
}
