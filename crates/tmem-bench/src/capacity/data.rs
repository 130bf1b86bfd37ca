//! The data sets `tmem bench capacity` fills memory with, each built once
//! per bench into a file the job reads round and round:
//!
//! * `text`: the Python standard library's `.py` sources (Debian's
//!   `libpython3.X-stdlib`), in path order: compressible text.
//! * `compressed`: the gzip files under `/usr/share/man` and
//!   `/usr/share/doc` (every Debian package ships some), up to 64 MiB: data
//!   that does not compress again, as ccache's JPEG did.
//! * `mix`: the built-in corpus of real program heaps (python, java, cc,
//!   redis), interleaved.

use anyhow::anyhow;
use std::path::{Path, PathBuf};

/// Which data set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DataKind {
    /// Python standard library sources.
    Text,
    /// gzip files from /usr/share/man and /usr/share/doc.
    Compressed,
    /// The built-in corpus of real program heaps.
    Mix,
}

impl DataKind {
    /// Lower-case name.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Text => "text",
            Self::Compressed => "compressed",
            Self::Mix => "mix",
        }
    }
}

/// A data set written to a file.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DataSet {
    /// Which.
    pub kind: DataKind,
    /// The file the job reads.
    #[serde(skip)]
    pub path: PathBuf,
    /// Its size, bytes.
    pub bytes: u64,
    /// Where it came from.
    pub source: String,
    /// Files it was made of.
    pub files: usize,
}

/// Most bytes of gzip files taken for `compressed`.
const COMPRESSED_MAX: u64 = 64 << 20;
/// Fewest bytes a data set must have: less would repeat within a few MiB.
const MIN_BYTES: u64 = 4 << 20;

/// Builds `kind` into a file in `dir`.
pub fn prepare(kind: DataKind, dir: &Path, python: &str) -> anyhow::Result<DataSet> {
    let path = dir.join(format!("{}.data", kind.name()));
    let (bytes, files, source) = match kind {
        DataKind::Text => {
            let stdlib = super::super::pressure::cmd(
                python,
                &["-c", "import sysconfig; print(sysconfig.get_paths()['stdlib'])"],
            )
            .map_err(|e| anyhow!("text data: cannot find Python's standard library: {e}"))?;
            let stdlib = PathBuf::from(stdlib);
            let files = files_under(std::slice::from_ref(&stdlib), |p| p.extension().is_some_and(|e| e == "py"));
            let (bytes, n) = concatenate(&files, &path, u64::MAX)?;
            (bytes, n, format!("Python standard library sources ({}/**/*.py)", stdlib.display()))
        }
        DataKind::Compressed => {
            let roots = [PathBuf::from("/usr/share/man"), PathBuf::from("/usr/share/doc")];
            let files = files_under(&roots, |p| p.extension().is_some_and(|e| e == "gz"));
            let (bytes, n) = concatenate(&files, &path, COMPRESSED_MAX)?;
            (bytes, n, "gzip files under /usr/share/man and /usr/share/doc".to_owned())
        }
        DataKind::Mix => {
            let mix = tmem_corpus::Corpus::mix(&tmem_corpus::Corpus::builtin());
            std::fs::write(&path, mix.data()).map_err(|e| anyhow!("{}: {e}", path.display()))?;
            let names = tmem_corpus::BUILTIN_NAMES.join(", ");
            (mix.data().len() as u64, tmem_corpus::BUILTIN_NAMES.len(), format!("built-in corpus heaps ({names})"))
        }
    };
    if bytes < MIN_BYTES {
        return Err(anyhow!(
            "{} data: only {} from {source}; at least {} are needed",
            kind.name(),
            tmem_daemon::human(bytes),
            tmem_daemon::human(MIN_BYTES)
        ));
    }
    Ok(DataSet { kind, path, bytes, source, files })
}

/// Regular files under `roots` (symbolic links not followed) that `want`, in path order.
fn files_under(roots: &[PathBuf], want: impl Fn(&Path) -> bool) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack: Vec<PathBuf> = roots.to_vec();
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for e in entries.filter_map(Result::ok) {
            let Ok(t) = e.file_type() else { continue };
            let p = e.path();
            if t.is_dir() {
                stack.push(p);
            } else if t.is_file() && want(&p) {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// Writes `files` one after another into `to`, up to `max` bytes; returns
/// the bytes written and the files used.
fn concatenate(files: &[PathBuf], to: &Path, max: u64) -> anyhow::Result<(u64, usize)> {
    let mut out = std::fs::File::create(to).map_err(|e| anyhow!("{}: {e}", to.display()))?;
    let (mut bytes, mut used) = (0u64, 0);
    for f in files {
        let Ok(data) = std::fs::read(f) else { continue };
        if bytes + data.len() as u64 > max {
            break;
        }
        std::io::Write::write_all(&mut out, &data).map_err(|e| anyhow!("{}: {e}", to.display()))?;
        bytes += data.len() as u64;
        used += 1;
    }
    Ok((bytes, used))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mix_is_built_from_the_corpus_and_a_short_set_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mix = prepare(DataKind::Mix, dir.path(), "python3").unwrap();
        assert_eq!(std::fs::metadata(&mix.path).unwrap().len(), mix.bytes);
        assert!(mix.bytes >= MIN_BYTES);

        std::fs::write(dir.path().join("a.gz"), b"12345").unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("sub/b.gz"), b"678").unwrap();
        std::fs::write(dir.path().join("c.txt"), b"no").unwrap();
        let files = files_under(&[dir.path().to_owned()], |p| p.extension().is_some_and(|e| e == "gz"));
        assert_eq!(files.len(), 2);
        let out = dir.path().join("out");
        assert_eq!(concatenate(&files, &out, 6).unwrap(), (5, 1), "stops before going past max");
        assert_eq!(std::fs::read(&out).unwrap(), b"12345");
        assert_eq!(concatenate(&files, &out, 100).unwrap(), (8, 2));
        assert_eq!(std::fs::read(&out).unwrap(), b"12345678");
    }
}
