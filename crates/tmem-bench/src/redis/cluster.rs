//! A throwaway Redis Cluster on loopback: `redis-server --cluster-enabled
//! yes` processes joined by `redis-cli --cluster create`, each killed by its
//! own pid when dropped. It can kill a master (the cluster fails over to its
//! replica) and move one slot to another master key by key, as `redis-cli
//! --cluster reshard` does, so that clients meet ASK and then MOVED.

use std::io;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use redis::{Connection, Value};
use tmem_tier_remote::cluster::{parse_slots, Master};

use super::{RedisOptions, RedisServer};

/// A cluster of `masters × (1 + replicas)` servers on 127.0.0.1.
pub struct RedisCluster {
    servers: Vec<RedisServer>,
}

fn other(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

impl RedisCluster {
    /// Starts the servers, creates the cluster with `replicas` replicas per
    /// master, and waits until every server sees every slot served.
    pub fn start(masters: usize, replicas: usize) -> io::Result<Self> {
        let opts = RedisOptions { cluster: true, ..RedisOptions::default() };
        let servers =
            (0..masters * (1 + replicas)).map(|_| RedisServer::start(&opts)).collect::<io::Result<Vec<_>>>()?;
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(servers.iter().map(RedisServer::addr))
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdin(Stdio::null())
            .output()?;
        if !out.status.success() {
            return Err(other(format!(
                "redis-cli --cluster create failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        let cluster = Self { servers };
        cluster.wait_ok(Duration::from_secs(30))?;
        Ok(cluster)
    }

    /// `redis+cluster://127.0.0.1:PORT` of every server, the tier's seeds.
    pub fn seeds(&self) -> Vec<String> {
        self.servers.iter().map(|s| format!("redis+cluster://{}", s.addr())).collect()
    }

    /// The servers, in start order.
    pub fn servers(&mut self) -> &mut [RedisServer] {
        &mut self.servers
    }

    fn conn(&self, i: usize) -> io::Result<Connection> {
        let c = redis::Client::open(self.servers[i].url()).map_err(other)?;
        c.get_connection_with_timeout(Duration::from_secs(2)).map_err(other)
    }

    fn live(&mut self) -> Vec<usize> {
        (0..self.servers.len()).filter(|i| self.servers[*i].is_running()).collect()
    }

    /// The masters and their slots, as a live server sees them.
    fn slot_map(&mut self) -> io::Result<Vec<Master>> {
        let live = self.live();
        let first = *live.first().ok_or_else(|| other("no server running"))?;
        let slots: Value = redis::cmd("CLUSTER").arg("SLOTS").query(&mut self.conn(first)?).map_err(other)?;
        parse_slots(&slots).map_err(other)
    }

    /// `host:port` of the master serving `slot`, as a live server sees it.
    pub fn master_addr(&mut self, slot: u16) -> io::Result<String> {
        let map = self.slot_map()?;
        map.into_iter()
            .find(|m| m.serves(slot))
            .map(|m| m.addr)
            .ok_or_else(|| other(format!("slot {slot} is not served")))
    }

    /// Index of the server at `addr`.
    pub fn index_of(&self, addr: &str) -> io::Result<usize> {
        self.servers.iter().position(|s| s.addr() == addr).ok_or_else(|| other(format!("no server at {addr}")))
    }

    /// Indexes of the servers that are masters serving slots now.
    pub fn masters(&mut self) -> io::Result<Vec<usize>> {
        self.slot_map()?.iter().map(|m| self.index_of(&m.addr)).collect()
    }

    /// Waits until every live server reports `cluster_state:ok` and the
    /// same master for every slot.
    pub fn wait_ok(&self, limit: Duration) -> io::Result<()> {
        let deadline = Instant::now() + limit;
        loop {
            let mut views = Vec::new();
            let mut ok = true;
            for i in 0..self.servers.len() {
                let Ok(mut c) = self.conn(i) else { continue };
                let info: String = redis::cmd("CLUSTER").arg("INFO").query(&mut c).unwrap_or_default();
                ok &= info.contains("cluster_state:ok");
                let nodes: String = redis::cmd("CLUSTER").arg("NODES").query(&mut c).unwrap_or_default();
                let mut masters: Vec<String> = nodes
                    .lines()
                    .filter(|l| l.contains("master") && !l.contains("fail"))
                    .filter_map(|l| {
                        let f: Vec<&str> = l.split_whitespace().collect();
                        // id addr flags master ping pong epoch link slot...
                        (f.len() > 8).then(|| format!("{} {}", f[1], f[8..].join(" ")))
                    })
                    .collect();
                masters.sort();
                views.push(masters);
            }
            if ok && !views.is_empty() && views.windows(2).all(|w| w[0] == w[1]) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(other(format!("cluster not consistent after {limit:?}: {views:?}")));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// SIGKILLs the master serving `slot` and waits (up to `limit`) until its
    /// replica serves the slot and every live server agrees; returns the old
    /// and the new master's `host:port`.
    pub fn kill_master(&mut self, slot: u16, limit: Duration) -> io::Result<(String, String)> {
        let old = self.master_addr(slot)?;
        let victim = self.index_of(&old)?;
        self.servers[victim].kill();
        let deadline = Instant::now() + limit;
        loop {
            match self.master_addr(slot) {
                Ok(new) if new != old => {
                    self.wait_ok(deadline.saturating_duration_since(Instant::now()))?;
                    return Ok((old, new));
                }
                _ if Instant::now() > deadline => {
                    return Err(other(format!("slot {slot} not failed over from {old} within {limit:?}")))
                }
                _ => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    fn node_id(&self, i: usize) -> io::Result<String> {
        redis::cmd("CLUSTER").arg("MYID").query(&mut self.conn(i)?).map_err(other)
    }

    /// Moves `slot` to server `to` (a master), `batch` keys per MIGRATE with
    /// `pause` between batches, then tells every master the new owner.
    /// Meanwhile clients get ASK for keys already moved, and MOVED after.
    pub fn migrate_slot(&mut self, slot: u16, to: usize, batch: usize, pause: Duration) -> io::Result<usize> {
        let addr = self.master_addr(slot)?;
        let from = self.index_of(&addr)?;
        if from == to {
            return Ok(0);
        }
        let (from_id, to_id) = (self.node_id(from)?, self.node_id(to)?);
        let (mut src, mut dst) = (self.conn(from)?, self.conn(to)?);
        let setslot = |c: &mut Connection, what: &[&str]| -> io::Result<()> {
            redis::cmd("CLUSTER").arg("SETSLOT").arg(slot).arg(what).query::<()>(c).map_err(other)
        };
        setslot(&mut dst, &["IMPORTING", &from_id])?;
        setslot(&mut src, &["MIGRATING", &to_id])?;
        let to_port = self.servers[to].port();
        let mut moved = 0;
        loop {
            let keys: Vec<Vec<u8>> =
                redis::cmd("CLUSTER").arg("GETKEYSINSLOT").arg(slot).arg(batch).query(&mut src).map_err(other)?;
            if keys.is_empty() {
                break;
            }
            let mut m = redis::cmd("MIGRATE");
            m.arg("127.0.0.1").arg(to_port).arg("").arg(0).arg(10_000).arg("REPLACE").arg("KEYS");
            for k in &keys {
                m.arg(k.as_slice());
            }
            m.query::<()>(&mut src).map_err(other)?;
            moved += keys.len();
            std::thread::sleep(pause);
        }
        setslot(&mut dst, &["NODE", &to_id])?;
        setslot(&mut src, &["NODE", &to_id])?;
        for i in self.masters()? {
            if i != from && i != to {
                setslot(&mut self.conn(i)?, &["NODE", &to_id])?;
            }
        }
        Ok(moved)
    }
}
