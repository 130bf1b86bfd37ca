use std::io::{Read, Write};
use std::process::{Command, Stdio};

use tmem_block::{BlockDevice, DeviceConfig};
use tmem_core::{PoolStats, StoreConfig};

use super::*;

/// Any free port on loopback.
pub(super) const LOOPBACK: std::net::SocketAddr =
    std::net::SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 0);

/// A real device with some pages written, and its snapshot.
pub(super) fn device(name: &str) -> DeviceStats {
    let dev =
        DeviceConfig { name: name.into(), size: 8 << 20, store: StoreConfig::default(), tiers: None, recompress: None }
            .build()
            .unwrap();
    let page: Vec<u8> = (0..4096u32).map(|i| u8::try_from(i % 7).unwrap()).collect();
    for i in 0..16 {
        dev.write_at(&page, i * 4096).unwrap();
    }
    dev.stats()
}

#[test]
fn every_counter_is_a_family_with_each_device_as_a_sample() {
    let text = encode(&[device("swap0"), device("swap1")]).unwrap();
    assert!(text.ends_with("# EOF\n"), "{text}");
    for def in PoolStats::DEFS {
        let (name, _) = metric_name("pool", def);
        let name = match (def.kind, def.unit) {
            (Kind::Counter, Unit::Bytes) => format!("{name}_bytes_total"),
            (Kind::Counter, _) => format!("{name}_total"),
            (_, Unit::Bytes) => format!("{name}_bytes"),
            _ => name,
        };
        for dev in ["swap0", "swap1"] {
            let sample = format!("{name}{{device=\"{dev}\"}} ");
            assert!(text.contains(&sample), "no {sample} in\n{text}");
        }
    }
    assert!(text.contains("tmem_pool_succ_puts_total{device=\"swap0\"} 16"), "{text}");
    assert!(text.contains("tmem_device_info{device=\"swap1\",codec=\"lz4\",transport=\"none\"} 1"), "{text}");
}

/// A plain HTTP GET on loopback; the body.
fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut r = String::new();
    s.read_to_string(&mut r).unwrap();
    r
}

/// A real Prometheus server scrapes the endpoint: the target is up with no
/// error, and a query returns what the device counted.
#[test]
fn a_real_prometheus_scrapes_it() {
    if !tmem_testkit::have_tool("prometheus") {
        tmem_testkit::skip(tmem_testkit::Feature::Tools, "prometheus not installed");
        return;
    }
    let server = MetricsServer::start(LOOPBACK, false, Arc::new(|| vec![device("swap0")])).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: tmem\n    static_configs:\n      - targets: ['{}']\n",
            server.addr()
        ),
    )
    .unwrap();
    let web = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let mut prom = Command::new("prometheus")
        .arg(format!("--config.file={}", config.display()))
        .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
        .arg(format!("--web.listen-address={web}"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let result = loop {
        std::thread::sleep(std::time::Duration::from_millis(500));
        let answer = std::net::TcpStream::connect(web)
            .ok()
            .map(|_| http_get(web, "/api/v1/query?query=tmem_pool_succ_puts_total"));
        if let Some(a) = answer.filter(|a| a.contains("\"device\":\"swap0\"")) {
            break Ok((a, http_get(web, "/api/v1/targets")));
        }
        if std::time::Instant::now() > deadline {
            break Err("Prometheus did not scrape the endpoint in 60 s");
        }
    };
    // Prometheus is our child: stopped by its pid.
    let _ = prom.kill();
    let out = prom.wait_with_output().unwrap();
    server.stop();
    let (query, targets) = result.unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    assert!(query.contains("\"16\""), "{query}");
    assert!(targets.contains("\"health\":\"up\"") && targets.contains("\"lastError\":\"\""), "{targets}");
}

#[test]
fn promtool_accepts_the_classic_format() {
    if !tmem_testkit::have_tool("promtool") {
        tmem_testkit::skip(tmem_testkit::Feature::Tools, "promtool not installed");
        return;
    }
    let server = Some(MetricsServerStats { connections_max: 16, ..MetricsServerStats::default() });
    let text = to_classic(&encode_with_server(&[device("swap0"), device("swap1")], server).unwrap());
    assert!(text.contains("# TYPE tmem_pool_succ_puts_total counter\n"), "{text}");
    assert!(text.contains("\ntmem_metrics_connections_max 16\n"), "{text}");
    assert!(!text.contains("# EOF") && !text.contains("# UNIT"), "{text}");
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && said.trim().is_empty(), "promtool: {said}\n{text}");
}

#[test]
fn serves_metrics_over_http_and_nothing_else() {
    let source: Source = Arc::new(|| vec![device("swap0")]);
    let server = MetricsServer::start(LOOPBACK, false, source).unwrap();
    let get = |path: &str| http_get(server.addr(), path);
    let ok = get("/metrics");
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
    assert!(ok.contains(CLASSIC_CONTENT_TYPE) && ok.contains("tmem_pool_stored_pages{device=\"swap0\"} 16"), "{ok}");
    let mut s = std::net::TcpStream::connect(server.addr()).unwrap();
    write!(s, "GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: application/openmetrics-text;version=1.0.0\r\nConnection: close\r\n\r\n").unwrap();
    let mut om = String::new();
    s.read_to_string(&mut om).unwrap();
    assert!(om.contains(CONTENT_TYPE) && om.ends_with("# EOF\n"), "{om}");
    assert!(get("/").starts_with("HTTP/1.1 404"));
    server.stop();
}
