//! The Python programs of `tmem bench cache`: the database builder and the
//! read-heavy query job (crates/tmem-bench/workload/cache_*.py, embedded).

use anyhow::anyhow;
use std::fs::File;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

/// Builds the SQLite database.
pub const BUILD_SCRIPT: &str = include_str!("../../workload/cache_build.py");
/// Runs the lookups.
pub const QUERY_SCRIPT: &str = include_str!("../../workload/cache_query.py");

/// What the builder printed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Built {
    /// Rows in the table (rowids 1..=rows).
    pub rows: u64,
    /// Size of the database file.
    pub bytes: u64,
    /// SQLite page size.
    pub page_size: u64,
}

/// What the query job printed.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct QueryOut {
    /// Lookups made.
    pub queries: u64,
    /// Lookups that found their row.
    pub found: u64,
    /// CRC of what was read (the same in every row of the bench).
    pub checksum: u64,
    /// Seconds the lookups took, inside Python (start-up excluded).
    pub secs: f64,
}

/// The last line of `out` that parses as `T`.
pub fn parse_last_json<T: serde::de::DeserializeOwned>(out: &str) -> Option<T> {
    out.lines().rev().find_map(|l| serde_json::from_str(l.trim()).ok())
}

/// The scripts, written to a directory.
pub struct Scripts {
    /// The interpreter (resolved: not a pyenv shim).
    pub python: PathBuf,
    build: PathBuf,
    query: PathBuf,
}

impl Scripts {
    /// Writes both scripts into `dir`; `python` is run once to learn its real path.
    pub fn install(dir: &Path, python: &str) -> anyhow::Result<Self> {
        let exe = crate::pressure::cmd(python, &["-c", "import sys, sqlite3; print(sys.executable)"])
            .map_err(|e| anyhow!("python3 with its sqlite3 module is needed ({python}): {e}"))?;
        let build = dir.join("cache_build.py");
        let query = dir.join("cache_query.py");
        std::fs::write(&build, BUILD_SCRIPT).map_err(|e| anyhow!("{}: {e}", build.display()))?;
        std::fs::write(&query, QUERY_SCRIPT).map_err(|e| anyhow!("{}: {e}", query.display()))?;
        let python = if exe.trim().is_empty() { PathBuf::from(python) } else { PathBuf::from(exe.trim()) };
        Ok(Self { python, build, query })
    }

    /// Builds a database of about `mib` MiB at `db`.
    pub fn build(&self, db: &Path, mib: u64) -> anyhow::Result<Built> {
        let out = crate::pressure::cmd(
            &self.python.to_string_lossy(),
            &[&self.build.to_string_lossy(), "--db", &db.to_string_lossy(), "--mib", &mib.to_string()],
        )?;
        parse_last_json(&out).ok_or_else(|| anyhow!("the database builder printed {out:?}"))
    }

    /// Starts the query job; it joins each `cgroup.procs` in `procs` before it execs.
    pub fn spawn_query(&self, q: &QueryJob<'_>, procs: &[PathBuf], out_dir: &Path) -> anyhow::Result<Running> {
        let out_path = out_dir.join("query.out");
        let err_path = out_dir.join("query.err");
        let out = File::create(&out_path).map_err(|e| anyhow!("{}: {e}", out_path.display()))?;
        let err = File::create(&err_path).map_err(|e| anyhow!("{}: {e}", err_path.display()))?;
        let (db, rows, queries) = (q.db.to_string_lossy(), q.rows.to_string(), q.queries.to_string());
        let (seed, skew, share) = (q.seed.to_string(), q.skew.to_string(), q.index_share.to_string());
        let query = self.query.to_string_lossy();
        let args = [&*query, "--db", &db, "--rows", &rows, "--queries", &queries, "--seed", &seed];
        let args = [&args[..], &["--skew", &skew, "--index-share", &share]].concat();
        let procs: Vec<&Path> = procs.iter().map(PathBuf::as_path).collect();
        let child =
            crate::pressure::workload::spawn_in_cgroups(&procs, &self.python.to_string_lossy(), &args, out, err)
                .map_err(|e| anyhow!("cannot start the query job (sh, {}): {e}", self.python.display()))?;
        Ok(Running { child, out_path, err_path, start: Instant::now(), done: None })
    }
}

/// One run of the query job.
#[derive(Clone, Debug)]
pub struct QueryJob<'a> {
    /// The database (on the mounted filesystem).
    pub db: &'a Path,
    /// Rows in it.
    pub rows: u64,
    /// Lookups.
    pub queries: u64,
    /// Seed (the same in every row).
    pub seed: u64,
    /// Power-law skew of the rows looked up.
    pub skew: f64,
    /// Share of lookups through the secondary index.
    pub index_share: f64,
}

/// The running job; killed (its process group) on drop.
pub struct Running {
    child: Child,
    out_path: PathBuf,
    err_path: PathBuf,
    start: Instant,
    done: Option<(std::process::ExitStatus, Duration)>,
}

/// How the job ended.
#[derive(Clone, Debug, Default)]
pub struct Ended {
    /// Exit code.
    pub code: Option<i32>,
    /// Signal that killed it.
    pub signal: Option<i32>,
    /// Wall time from spawn to exit.
    pub wall: Duration,
    /// What it printed.
    pub out: Option<QueryOut>,
    /// The end of its stderr.
    pub stderr_tail: String,
}

impl Running {
    /// `Some` once it has exited.
    pub fn poll(&mut self) -> anyhow::Result<bool> {
        if self.done.is_none() {
            if let Some(s) = self.child.try_wait().map_err(|e| anyhow!("waiting for the query job: {e}"))? {
                self.done = Some((s, self.start.elapsed()));
            }
        }
        Ok(self.done.is_some())
    }

    /// SIGKILLs its process group and reaps it.
    pub fn kill(&mut self) {
        if self.done.is_none() {
            if let Some(pid) = i32::try_from(self.child.id()).ok().and_then(rustix::process::Pid::from_raw) {
                let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::KILL);
            }
            if let Ok(s) = self.child.wait() {
                self.done = Some((s, self.start.elapsed()));
            }
        }
    }

    /// Its result (after [`Self::poll`] returned true or [`Self::kill`]).
    pub fn ended(&self) -> Ended {
        let (status, wall) = self.done.unwrap_or((std::process::ExitStatus::from_raw(0), self.start.elapsed()));
        let out = std::fs::read_to_string(&self.out_path).unwrap_or_default();
        let err = std::fs::read_to_string(&self.err_path).unwrap_or_default();
        let lines: Vec<&str> = err.lines().collect();
        Ended {
            code: status.code(),
            signal: status.signal(),
            wall,
            out: parse_last_json(&out),
            stderr_tail: lines[lines.len().saturating_sub(5)..].join("\n"),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scripts_are_embedded_and_outputs_parse() {
        assert!(BUILD_SCRIPT.starts_with("#!/usr/bin/env python3") && BUILD_SCRIPT.contains("CREATE INDEX"));
        assert!(QUERY_SCRIPT.contains("immutable=1") && QUERY_SCRIPT.contains("def main"));
        let b: Built =
            parse_last_json("noise\n{\"rows\": 130000, \"bytes\": 48504832, \"page_size\": 4096}\n").unwrap();
        assert_eq!(b, Built { rows: 130_000, bytes: 48_504_832, page_size: 4096 });
        let q: QueryOut =
            parse_last_json("{\"queries\": 10, \"found\": 10, \"checksum\": 42, \"secs\": 0.5}\n").unwrap();
        assert_eq!((q.queries, q.found, q.checksum), (10, 10, 42));
        assert!(parse_last_json::<QueryOut>("not json").is_none());
    }
}
