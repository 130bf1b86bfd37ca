//! `tmem corpus info` and `tmem corpus export`.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{anyhow, Context};
use tmem_core::PAGE_SIZE;

/// `tmem corpus export`.
#[derive(clap::Args, Debug)]
pub struct ExportArgs {
    /// Corpus files, written in this order.
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// The raw pages, one after the other.
    #[arg(long)]
    out: PathBuf,
    /// At most this many bytes of pages from each corpus (its first ones), e.g. 40M.
    #[arg(long, value_parser = tmem_corpus::parse_size)]
    each: Option<u64>,
    /// Also train a zstd dictionary on an even sample of the pages written
    /// (zstd's trainer, as `zstd --train`) and write it here: what zram's
    /// `algorithm_params dict=` reads.
    #[arg(long)]
    dictionary: Option<PathBuf>,
    /// Dictionary size.
    #[arg(long, default_value = "112K", value_parser = tmem_corpus::parse_size)]
    dict_size: u64,
    /// Pages sampled for the dictionary, at most.
    #[arg(long, default_value_t = 4096)]
    sample_pages: usize,
}

/// Prints what each corpus file holds.
pub fn info(files: &[PathBuf]) -> anyhow::Result<()> {
    for f in files {
        let c = tmem_corpus::Corpus::read(f)?;
        let meta = serde_json::to_string(&c.meta)?;
        println!("{}: {} pages ({:.1} MiB) {meta}", f.display(), c.page_count(), c.data().len() as f64 / 1048576.0);
    }
    Ok(())
}

/// Writes the pages (and the dictionary); says what it wrote.
pub fn export(a: &ExportArgs) -> anyhow::Result<()> {
    let corpora = a
        .files
        .iter()
        .map(|f| tmem_corpus::Corpus::read(f).with_context(|| f.display().to_string()))
        .collect::<Result<Vec<_>, _>>()?;
    let each = a.each.map_or(usize::MAX, |b| usize::try_from(b / PAGE_SIZE as u64).unwrap_or(usize::MAX));
    let pages: Vec<&[u8; PAGE_SIZE]> = corpora.iter().flat_map(|c| c.pages().take(each)).collect();
    if pages.is_empty() {
        return Err(anyhow!("no pages to export"));
    }
    let mut out = std::io::BufWriter::new(
        std::fs::File::create(&a.out).with_context(|| format!("{}: cannot create it", a.out.display()))?,
    );
    for p in &pages {
        out.write_all(*p)?;
    }
    out.flush().with_context(|| a.out.display().to_string())?;
    println!("{}: {} pages ({} MiB)", a.out.display(), pages.len(), (pages.len() * PAGE_SIZE) >> 20);
    if let Some(path) = &a.dictionary {
        let every = pages.len().div_ceil(a.sample_pages.max(1));
        let sample: Vec<&[u8; PAGE_SIZE]> = pages.iter().step_by(every).copied().collect();
        let size = usize::try_from(a.dict_size).map_err(|_| anyhow!("--dict-size {} is too large", a.dict_size))?;
        let dict = tmem_core::codec::train_dictionary(sample.iter().copied(), size)?;
        std::fs::write(path, &dict).with_context(|| path.display().to_string())?;
        println!("{}: a {} byte dictionary from {} pages", path.display(), dict.len(), sample.len());
    }
    Ok(())
}
