//! The network path of the tmem+remote rows (RAMster's "other machines"):
//! with a profile other than `loopback`, each Redis node runs in a network
//! namespace of its own, reached only through a veth pair whose two ends
//! carry the profile's rate and one-way delay (`tc netem delay D rate R`;
//! a round trip crosses two delays). Where the kernel lacks `sch_netem`,
//! the rate is set with `tbf` and no delay can be added: the report and the
//! JSON say so (`delay_applied`).
//!
//! A namespace, its veth pair and its qdiscs go with `ip netns del` (the
//! peer end lives in the namespace, and takes the host end with it), on
//! drop too.

use anyhow::anyhow;
use std::net::Ipv4Addr;

use super::cmd;

/// A link profile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NetProfile {
    /// Redis on this machine's loopback, no limits.
    Loopback,
    /// 25 Gbit/s, 20 µs each way.
    #[value(name = "25g")]
    #[serde(rename = "25g")]
    G25,
    /// 10 Gbit/s, 50 µs each way.
    #[value(name = "10g")]
    #[serde(rename = "10g")]
    G10,
}

impl NetProfile {
    /// (rate in Mbit/s, one-way delay in µs); `None` for loopback.
    #[must_use]
    pub fn link(self) -> Option<(u64, u64)> {
        match self {
            Self::Loopback => None,
            Self::G25 => Some((25_000, 20)),
            Self::G10 => Some((10_000, 50)),
        }
    }

    /// For reports.
    #[must_use]
    pub fn describe(self) -> String {
        match self.link() {
            None => "loopback".into(),
            Some((mbit, us)) => format!("{} Gbit/s, {us} us each way", mbit / 1000),
        }
    }
}

/// A network namespace with one veth pair to the host.
pub struct Namespace {
    name: String,
    host_if: String,
    /// The namespace side's address: what its server binds.
    pub addr: Ipv4Addr,
    /// Whether the delay is in place (the kernel has `sch_netem`).
    pub delay_applied: bool,
    deleted: bool,
}

impl Namespace {
    /// Creates namespace `tmem-bench-<pid>-r<index>` linked at `profile`.
    pub fn create(index: u8, profile: NetProfile) -> anyhow::Result<Self> {
        let (mbit, delay_us) = profile.link().ok_or_else(|| anyhow!("loopback has no namespace"))?;
        let pid = std::process::id();
        let name = format!("tmem-bench-{pid}-r{index}");
        // Interface names have at most 15 bytes: "tb" + pid (<= 7 digits) + side + index.
        let (host_if, ns_if) = (format!("tb{pid}h{index}"), format!("tb{pid}n{index}"));
        let (host_addr, addr) = (Ipv4Addr::new(10, 253, index, 1), Ipv4Addr::new(10, 253, index, 2));
        cmd("ip", &["netns", "add", &name])?;
        let mut ns = Self { name, host_if: host_if.clone(), addr, delay_applied: false, deleted: false };
        cmd("ip", &["link", "add", &host_if, "type", "veth", "peer", "name", &ns_if])?;
        let moved = cmd("ip", &["link", "set", &ns_if, "netns", &ns.name]);
        if let Err(e) = moved {
            let _ = cmd("ip", &["link", "del", &host_if]);
            return Err(e);
        }
        cmd("ip", &["addr", "add", &format!("{host_addr}/30"), "dev", &host_if])?;
        cmd("ip", &["link", "set", &host_if, "up"])?;
        ns.exec(&["ip", "addr", "add", &format!("{addr}/30"), "dev", &ns_if])?;
        ns.exec(&["ip", "link", "set", &ns_if, "up"])?;
        ns.exec(&["ip", "link", "set", "lo", "up"])?;
        let rate = format!("{mbit}mbit");
        let delay = format!("{delay_us}us");
        let netem = |ns: &Self, dev: &str, inside: bool| {
            let args = ["tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", &delay, "rate", &rate];
            if inside {
                ns.exec(&args)
            } else {
                cmd(args[0], &args[1..])
            }
        };
        if netem(&ns, &host_if, false).is_ok() {
            netem(&ns, &ns_if, true)?;
            ns.delay_applied = true;
        } else {
            // No sch_netem in this kernel: the rate alone, with a 4 ms burst.
            let burst = format!("{}", mbit * 1_000_000 / 8 / 250);
            let tbf =
                ["tc", "qdisc", "add", "dev", "", "root", "tbf", "rate", &rate, "burst", &burst, "latency", "10ms"];
            let mut host = tbf;
            host[4] = &host_if;
            cmd(host[0], &host[1..])?;
            let mut inside = tbf;
            inside[4] = &ns_if;
            ns.exec(&inside)?;
        }
        Ok(ns)
    }

    /// Runs `args` inside the namespace.
    fn exec(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut all = vec!["netns", "exec", &self.name];
        all.extend_from_slice(args);
        cmd("ip", &all)
    }

    /// Its name (for `ip netns exec`).
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Deletes the namespace (its link goes with it): to a client, the
    /// machine is gone. The kernel dismantles a namespace in the
    /// background: this waits (up to 10 s) until the host's end of the link
    /// is gone too, so the next namespace can take the same names.
    pub fn delete(&mut self) -> anyhow::Result<()> {
        if !self.deleted {
            cmd("ip", &["netns", "del", &self.name])?;
            self.deleted = true;
            let link = std::path::Path::new("/sys/class/net").join(&self.host_if);
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while link.exists() {
                if std::time::Instant::now() > deadline {
                    return Err(anyhow!("{} still exists 10 s after ip netns del {}", self.host_if, self.name));
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
        Ok(())
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        if let Err(e) = self.delete() {
            tracing::warn!("network namespace {}: {e}; run ip netns del {} by hand", self.name, self.name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles() {
        assert_eq!(NetProfile::Loopback.link(), None);
        assert_eq!(NetProfile::G25.link(), Some((25_000, 20)));
        assert_eq!(NetProfile::G10.describe(), "10 Gbit/s, 50 us each way");
    }
}
