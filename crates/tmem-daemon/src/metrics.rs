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
//! current codec of each device is `tmem_device_info{device, codec} 1`.
//! A test has a real Prometheus server scrape it.
//!
//! The server is `tiny_http` on one thread: scrapes are rare and small, and
//! a slow client holds only that thread, never the page path.

use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit as PromUnit};
use tmem_block::DeviceStats;
use tmem_counters::{Counters, Def, Kind, Unit};

use crate::DaemonError;

/// The content type of the OpenMetrics text format.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The content type of the classic Prometheus text format (0.0.4), served
/// to clients that do not ask for OpenMetrics (curl, `promtool check metrics`).
pub const CLASSIC_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Where the snapshot of every device comes from (the daemon's devices).
pub type Source = Arc<dyn Fn() -> Vec<DeviceStats> + Send + Sync>;

/// The running metrics endpoint; [`MetricsServer::stop`] ends it.
pub struct MetricsServer {
    server: Arc<tiny_http::Server>,
    addr: SocketAddr,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Listens on `addr` (e.g. `127.0.0.1:9848`) and serves `/metrics` from `source`.
    pub fn start(addr: &str, source: Source) -> Result<Self, DaemonError> {
        let server = tiny_http::Server::http(addr)
            .map_err(|e| DaemonError::Setup(format!("metrics: cannot listen on {addr}: {e}")))?;
        let addr = server
            .server_addr()
            .to_ip()
            .ok_or_else(|| DaemonError::Setup(format!("metrics: {addr} is not an IP address")))?;
        let server = Arc::new(server);
        let s = Arc::clone(&server);
        let thread = std::thread::Builder::new()
            .name("tmem-metrics".into())
            .spawn(move || serve(&s, &source))
            .map_err(|e| DaemonError::Setup(format!("metrics: cannot start its thread: {e}")))?;
        Ok(Self { server, addr, thread: Some(thread) })
    }

    /// The address it listens on (the port chosen, for `:0`).
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops serving and joins the thread.
    pub fn stop(mut self) {
        self.server.unblock();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(server: &tiny_http::Server, source: &Source) {
    for req in server.incoming_requests() {
        let path = req.url().split('?').next().unwrap_or_default();
        let resp = if *req.method() != tiny_http::Method::Get {
            tiny_http::Response::from_string("only GET\n").with_status_code(405)
        } else if path == "/metrics" {
            let openmetrics = req
                .headers()
                .iter()
                .any(|h| h.field.equiv("Accept") && h.value.as_str().contains("application/openmetrics-text"));
            match encode(&source()) {
                Ok(text) if openmetrics => {
                    tiny_http::Response::from_string(text).with_header(content_type(CONTENT_TYPE))
                }
                Ok(text) => {
                    tiny_http::Response::from_string(to_classic(&text)).with_header(content_type(CLASSIC_CONTENT_TYPE))
                }
                Err(e) => tiny_http::Response::from_string(format!("encoding failed: {e}\n")).with_status_code(500),
            }
        } else {
            tiny_http::Response::from_string("tmem: metrics are at /metrics\n").with_status_code(404)
        };
        let _ = req.respond(resp);
    }
}

/// A `Content-Type` header; `value` is one of this module's constants, which are valid.
fn content_type(value: &'static str) -> tiny_http::Header {
    tiny_http::Header::from_bytes(&b"Content-Type"[..], value.as_bytes()).expect("a valid constant header")
}

/// The OpenMetrics text of `devs`.
pub fn encode(devs: &[DeviceStats]) -> Result<String, std::fmt::Error> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Snapshot(devs.to_vec())));
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

/// One scrape's snapshot.
#[derive(Debug)]
struct Snapshot(Vec<DeviceStats>);

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
        let tiers = devs.iter().flat_map(|d| d.store.tiers.iter().map(|t| (tier_labels(d, t), t)));
        family(&mut encoder, "tier", tiers)?;
        // An info metric as node_exporter writes them (a gauge of 1): the
        // Prometheus text format that promtool and older servers read has no
        // `info` type.
        let mut info = encoder.encode_descriptor(
            "tmem_device_info",
            "A device and its current codec.",
            None,
            MetricType::Gauge,
        )?;
        for d in devs {
            let labels = vec![("device", d.name.clone()), ("codec", d.store.codec.clone())];
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
            let sample = fam.encode_family(&labels)?;
            match (def.kind, def.unit) {
                (_, Unit::Micros) => ConstGauge::new(v as f64 / 1e6).encode(sample)?,
                (Kind::Counter, _) => ConstCounter::new(v).encode(sample)?,
                (Kind::Gauge | Kind::Max, _) => ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX)).encode(sample)?,
            }
        }
    }
    Ok(())
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
