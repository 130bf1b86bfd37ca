//! Prometheus metrics: `--metrics ADDR` serves `GET /metrics` in the
//! OpenMetrics text format.
//!
//! Nothing here names a counter: every metric comes from the counters'
//! definitions (`tmem_counters::counters!`), so a counter added there shows
//! up here. Each scrape takes the same snapshot `tmem stat` takes and
//! `prometheus-client` encodes it; one family per counter, one sample per
//! device (label `device`), per tier (labels `device`, `tier`). Names are
//! `tmem_<group>_<counter>` with the conventional suffixes: counters end in
//! `_total`, byte counts in `_bytes`, latencies are in `_seconds`. The
//! current codec of each device is `tmem_device_info{device, codec,
//! transport} 1`.
//! A test has a real Prometheus server scrape it.
//!
//! The endpoint's own limits and counters (`tmem_metrics_*`) are in
//! [`server`].

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit as PromUnit};
use tmem_block::DeviceStats;
use tmem_counters::{Counters, Def, Kind, Unit};

pub mod server;
pub use server::{MetricsServer, MetricsServerStats};

/// The content type of the OpenMetrics text format.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The content type of the classic Prometheus text format (0.0.4), served
/// to clients that do not ask for OpenMetrics (curl, `promtool check metrics`).
pub const CLASSIC_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Where the snapshot of every device comes from (the daemon's devices).
pub type Source = Arc<dyn Fn() -> Vec<DeviceStats> + Send + Sync>;

/// The OpenMetrics text of `devs`.
pub fn encode(devs: &[DeviceStats]) -> Result<String, std::fmt::Error> {
    encode_with_server(devs, None)
}

/// The OpenMetrics text of `devs` and of the endpoint's own counters.
pub fn encode_with_server(devs: &[DeviceStats], server: Option<MetricsServerStats>) -> Result<String, std::fmt::Error> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Snapshot(devs.to_vec(), server)));
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry)?;
    Ok(out)
}

/// The classic text format (0.0.4) of an OpenMetrics exposition made by
/// [`encode`]: the samples are the same; a counter family's `# HELP` and
/// `# TYPE` lines name its `_total` sample, and `# UNIT` and `# EOF` go.
/// By hand because `prometheus-client` writes OpenMetrics only, and the
/// classic format is what `promtool check metrics` and older scrapers read.
#[must_use]
pub fn to_classic(openmetrics: &str) -> String {
    let mut counters = std::collections::HashSet::new();
    for line in openmetrics.lines() {
        if let Some(name) = line.strip_prefix("# TYPE ").and_then(|l| l.strip_suffix(" counter")) {
            counters.insert(name.to_owned());
        }
    }
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        let header = ["# HELP ", "# TYPE "].into_iter().find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        match header {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                let suffix = if counters.contains(name) { "_total" } else { "" };
                out.push_str(&format!("{prefix}{name}{suffix} {tail}"));
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// One scrape's snapshot: the devices, and the endpoint's own counters.
#[derive(Debug)]
struct Snapshot(Vec<DeviceStats>, Option<MetricsServerStats>);

/// Labels of one sample.
type Labels = Vec<(&'static str, String)>;

impl Collector for Snapshot {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let devs = &self.0;
        let dev = |d: &DeviceStats| vec![("device", d.name.clone())];
        family(&mut encoder, "device", devs.iter().map(|d| (dev(d), d)))?;
        family(&mut encoder, "store", devs.iter().map(|d| (dev(d), &d.store)))?;
        family(&mut encoder, "pool", devs.iter().map(|d| (dev(d), &d.store.total)))?;
        family(&mut encoder, "alloc", devs.iter().map(|d| (dev(d), &d.store.alloc)))?;
        family(&mut encoder, "backing", devs.iter().filter_map(|d| d.backing.as_ref().map(|b| (dev(d), b))))?;
        family(&mut encoder, "front", devs.iter().filter_map(|d| d.front.as_ref().map(|f| (dev(d), f))))?;
        // A `tmem run` instance: its budget, and what its engines did (one
        // group, `tmem_run_*`: the two structs' names do not overlap).
        family(&mut encoder, "run", devs.iter().filter_map(|d| d.run.as_ref().map(|r| (dev(d), r))))?;
        family(&mut encoder, "run", devs.iter().filter_map(|d| d.run.as_ref().map(|r| (dev(d), &r.engine))))?;
        let tiers = devs.iter().flat_map(|d| d.store.tiers.iter().map(|t| (tier_labels(d, t), t)));
        family(&mut encoder, "tier", tiers)?;
        if let Some(server) = &self.1 {
            unlabeled(&mut encoder, "metrics", server)?;
        }
        // An info metric as node_exporter writes them (a gauge of 1): the
        // Prometheus text format that promtool and older servers read has no
        // `info` type.
        let mut info = encoder.encode_descriptor(
            "tmem_device_info",
            "A device, its current codec, and how the kernel reaches it (fuse, nbd, ublk; none: not given to the kernel).",
            None,
            MetricType::Gauge,
        )?;
        for d in devs {
            let transport = d.transport.as_ref().map_or_else(|| "none".into(), |t| t.kind.clone());
            let labels = vec![("device", d.name.clone()), ("codec", d.store.codec.clone()), ("transport", transport)];
            ConstGauge::new(1_i64).encode(info.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

fn tier_labels(d: &DeviceStats, t: &tmem_tier::TierStats) -> Labels {
    vec![("device", d.name.clone()), ("tier", t.name.clone())]
}

/// Encodes every counter of `C` as one family, one sample per item.
fn family<'a, C: Counters + 'a>(
    encoder: &mut DescriptorEncoder,
    group: &str,
    items: impl Iterator<Item = (Labels, &'a C)> + Clone,
) -> Result<(), std::fmt::Error> {
    for (i, def) in C::DEFS.iter().enumerate() {
        if items.clone().next().is_none() {
            return Ok(());
        }
        let (name, unit) = metric_name(group, def);
        let mut fam = encoder.encode_descriptor(&name, def.help(), unit.as_ref(), metric_type(def))?;
        for (labels, c) in items.clone() {
            let v = c.values().nth(i).map_or(0, |(_, v)| v);
            sample(def, v, fam.encode_family(&labels)?)?;
        }
    }
    Ok(())
}

/// Encodes every counter of `c` as a family of one sample without labels
/// (the daemon's own counters, not a device's).
fn unlabeled<C: Counters>(encoder: &mut DescriptorEncoder, group: &str, c: &C) -> Result<(), std::fmt::Error> {
    for (def, v) in c.values() {
        let (name, unit) = metric_name(group, def);
        sample(def, v, encoder.encode_descriptor(&name, def.help(), unit.as_ref(), metric_type(def))?)?;
    }
    Ok(())
}

/// One sample of counter `def`, value `v`.
fn sample(def: &Def, v: u64, enc: MetricEncoder) -> Result<(), std::fmt::Error> {
    match (def.kind, def.unit) {
        (_, Unit::Micros) => ConstGauge::new(v as f64 / 1e6).encode(enc),
        (Kind::Counter, _) => ConstCounter::new(v).encode(enc),
        (Kind::Gauge | Kind::Max, _) => ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX)).encode(enc),
    }
}

fn metric_type(def: &Def) -> MetricType {
    match (def.kind, def.unit) {
        (Kind::Counter, Unit::Micros) | (Kind::Gauge | Kind::Max, _) => MetricType::Gauge,
        (Kind::Counter, _) => MetricType::Counter,
    }
}

/// `tmem_<group>_<name>` without a unit suffix the encoder adds, and the unit.
fn metric_name(group: &str, def: &Def) -> (String, Option<PromUnit>) {
    let base = format!("tmem_{group}_{}", def.name);
    match def.unit {
        Unit::Bytes => (base.strip_suffix("_bytes").unwrap_or(&base).to_owned(), Some(PromUnit::Bytes)),
        Unit::Micros => (base.strip_suffix("_us").unwrap_or(&base).to_owned(), Some(PromUnit::Seconds)),
        Unit::Pages | Unit::Events | Unit::Objects => (base, None),
    }
}

#[cfg(test)]
mod tests;
