//! tmem's benchmarks, each measured against the kernel on the same machine in
//! the same run: the store against zram on the same real pages ([`store`]),
//! the tiers on loopback ([`tier`]), the zcache/RAMster memory-pressure
//! ladder against disk swap, zram and zswap ([`pressure`]), and the swap-in
//! round trip alone ([`fault`]). The `tmem bench` subcommands call them;
//! [`zram`] is the kernel-side harness of the store benchmark and [`redis`]
//! starts the throwaway servers of the remote tier.

pub mod cache;
pub mod capacity;
pub mod fault;
pub mod machine;
pub mod plot;
pub mod pressure;
pub mod progress;
pub mod ramp;
pub mod redis;
pub mod soak;
pub mod store;
pub mod table;
pub mod tier;
pub mod zram;

/// Draws a bench's figure into `plot` and writes its JSON file to `json`,
/// where asked, saying where each went.
pub fn write_outputs(
    plot: Option<&std::path::Path>,
    json: Option<&std::path::Path>,
    draw: impl FnOnce(&std::path::Path) -> anyhow::Result<()>,
    write: impl FnOnce(&std::path::Path) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    if let Some(path) = plot {
        draw(path)?;
        println!("figure: {}", path.display());
    }
    if let Some(path) = json {
        write(path)?;
        println!("JSON: {}", path.display());
    }
    Ok(())
}

/// Median (mean of the two middle values for an even count).
#[must_use]
pub fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 })
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn medians() {
        assert_eq!(median(vec![]), None);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0]), Some(2.5));
    }
}
