//! RAMster for tmem: a [`Tier`] that keeps sealed pages in OTHER machines'
//! RAM, on ordinary Redis or Valkey servers.
//!
//! * Keys are namespaced `tmem:{cluster_id}:{host_id}:{pool}:{object:x}:{index:x}`,
//!   so many machines share the same servers.
//! * Each page goes to R distinct servers chosen by rendezvous hashing; a read
//!   goes to the first live replica and falls back to the others.
//! * The servers may be the masters of a Redis/Valkey Cluster, found from
//!   seed addresses (`redis+cluster://host:port`): each master is a node, and
//!   R copies go to R masters (see `cluster.rs`).
//! * A server that fails is marked down and skipped; a background task copies
//!   every page that had a replica on it from a survivor to the next server in
//!   the page's rendezvous order, and reconnects with backoff.
//! * The tier keeps a local index of what it stored where. A page whose every
//!   copy is gone (R = 1 and its server died) answers `Unavailable`: a clear
//!   error, never wrong data and never a silent miss.
//! * A server that answers OOM is full for that write; when no other server
//!   can take the copy the put answers [`TierPut::Full`] and the caller moves
//!   on to the next tier.
//! * The tier hands over to a successor process (`tmem swap restart`):
//!   [`Tier::hand_over`] waits for the writes in flight and describes the
//!   index, the nodes in order, the namespace and the counters (the values
//!   stay on the servers); [`RemoteTierConfig::adopt`] checks them against
//!   its own configuration and serves the same pages. An adopted tier
//!   deletes none of its keys until it owns them ([`Tier::set_owner`]).
//!
//! The tier runs the `redis` crate's async client on a small tokio runtime
//! of its own and exposes the blocking [`Tier`] trait on top of it, so callers
//! need no runtime. See README.md for the full design.

pub mod cluster;
mod engine;
mod handover;
mod index;
mod node;
mod placement;

use std::fmt;
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use tmem_tier::{Capacity, Health, Tier, TierError, TierGet, TierHandover, TierKey, TierPut, TierStats};

use engine::{config_error, unavailable, BringUp, Inner, Settings, TIER};
use handover::State;
use node::{ConnectError, Node, Placement};
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};

/// Largest number of servers (node sets are 64-bit masks).
pub const MAX_NODES: usize = 64;

/// Configuration of a [`RemoteTier`].
#[derive(Clone)]
pub struct RemoteTierConfig {
    /// Servers: `redis://[user:pass@]host:port[/db]` or `rediss://…` (TLS).
    /// AUTH (password or ACL user) comes from the URL. Or seed addresses of
    /// one Redis/Valkey Cluster, `redis+cluster://[user:pass@]host:port` or
    /// `rediss+cluster://…`: its masters become the nodes.
    pub nodes: Vec<String>,
    /// Names the group of machines sharing the servers (`[A-Za-z0-9._-]`, 1–64 chars).
    pub cluster_id: String,
    /// Names this machine within the cluster (`[A-Za-z0-9._-]`, 1–64 chars).
    /// Two daemons must never share a `(cluster_id, host_id)`: each deletes
    /// the keys of its namespace when it starts.
    pub host_id: String,
    /// Copies of each page (R), 1 ≤ R ≤ number of nodes (of masters, for a cluster).
    pub replicas: usize,
    /// Refuse servers whose `maxmemory-policy` may evict keys (anything but
    /// `noeviction`): required for persistent pools, whose pages must not vanish.
    pub require_noeviction: bool,
    /// Deadline of one round trip to one server (plus the payload's transfer
    /// time at 50 MB/s for large batches); a server that misses it is marked down.
    pub op_timeout: Duration,
    /// Deadline for connecting (TCP, TLS, AUTH).
    pub connect_timeout: Duration,
    /// PEM file of the CA that signed the servers' certificates, for
    /// `rediss://` nodes whose CA is not in the system trust store.
    pub ca_cert: Option<PathBuf>,
}

impl fmt::Debug for RemoteTierConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteTierConfig")
            .field("nodes", &self.nodes.iter().map(|u| node::redact(u)).collect::<Vec<_>>())
            .field("cluster_id", &self.cluster_id)
            .field("host_id", &self.host_id)
            .field("replicas", &self.replicas)
            .field("require_noeviction", &self.require_noeviction)
            .field("op_timeout", &self.op_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("ca_cert", &self.ca_cert)
            .finish()
    }
}

/// `redis+cluster://` or `rediss+cluster://`: a seed of a cluster.
fn is_cluster_url(url: &str) -> bool {
    url.starts_with("redis+cluster://") || url.starts_with("rediss+cluster://")
}

fn valid_id(s: &str) -> bool {
    (1..=64).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

impl RemoteTierConfig {
    /// A configuration with defaults: R = 2 (1 with a single standalone
    /// node), `require_noeviction`, 1 s operation and 2 s connect timeouts.
    pub fn new(nodes: Vec<String>, cluster_id: impl Into<String>, host_id: impl Into<String>) -> Self {
        let replicas = if nodes.iter().any(|u| is_cluster_url(u)) { 2 } else { nodes.len().clamp(1, 2) };
        Self {
            nodes,
            cluster_id: cluster_id.into(),
            host_id: host_id.into(),
            replicas,
            require_noeviction: true,
            op_timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(2),
            ca_cert: None,
        }
    }

    fn validate(&self) -> Result<(), TierError> {
        if self.nodes.is_empty() || self.nodes.len() > MAX_NODES {
            return Err(config_error(format!("need 1 to {MAX_NODES} nodes, got {}", self.nodes.len())));
        }
        let cluster = self.nodes.iter().filter(|u| is_cluster_url(u)).count();
        if cluster != 0 && cluster != self.nodes.len() {
            return Err(config_error(
                "either every node is a redis+cluster:// seed of one cluster, or none is".to_owned(),
            ));
        }
        if cluster != 0 && !(1..=MAX_NODES).contains(&self.replicas) {
            return Err(config_error(format!("replicas must be between 1 and {MAX_NODES}, got {}", self.replicas)));
        }
        if cluster == 0 && !(1..=self.nodes.len()).contains(&self.replicas) {
            return Err(config_error(format!(
                "replicas must be between 1 and the number of nodes ({}), got {}",
                self.nodes.len(),
                self.replicas
            )));
        }
        for (what, id) in [("cluster_id", &self.cluster_id), ("host_id", &self.host_id)] {
            if !valid_id(id) {
                return Err(config_error(format!("{what} {id:?} must be 1-64 characters of [A-Za-z0-9._-]")));
            }
        }
        if self.op_timeout.is_zero() || self.connect_timeout.is_zero() {
            return Err(config_error("timeouts must be positive"));
        }
        let mut ids: Vec<String> = self.nodes.iter().map(|u| node::identity(u)).collect();
        ids.sort();
        if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
            return Err(config_error(format!("node {} is listed twice", w[0])));
        }
        Ok(())
    }

    fn client(&self, url: &str, ca: Option<&[u8]>) -> Result<redis::Client, TierError> {
        let bad = |e: redis::RedisError| config_error(format!("node {}: {e}", node::redact(url)));
        match ca {
            Some(pem) if url.starts_with("rediss://") => redis::Client::build_with_tls(
                url,
                redis::TlsCertificates { client_tls: None, root_cert: Some(pem.to_vec()) },
            )
            .map_err(bad),
            _ => redis::Client::open(url).map_err(bad),
        }
    }

    /// The seeds, credentials redacted, for messages.
    fn seed_names(&self) -> String {
        self.nodes.iter().map(|u| node::redact(u)).collect::<Vec<_>>().join(", ")
    }

    /// A client of the cluster the seeds name.
    fn cluster_client(&self, ca: Option<&[u8]>) -> Result<redis::cluster::ClusterClient, TierError> {
        let seeds: Vec<String> = self.nodes.iter().map(|u| u.replacen("+cluster://", "://", 1)).collect();
        let mut builder = redis::cluster::ClusterClient::builder(seeds).connection_timeout(self.connect_timeout);
        if let Some(pem) = ca {
            builder = builder.certs(redis::TlsCertificates { client_tls: None, root_cert: Some(pem.to_vec()) });
        }
        builder.build().map_err(|e| config_error(format!("cluster {}: {e}", self.seed_names())))
    }

    /// The nodes of a cluster: reads its slot map from a seed and makes one
    /// node per master, each with a hash tag of a slot that master serves.
    fn shards(&self, rt: &tokio::runtime::Runtime, ca: Option<&[u8]>, namespace: &str) -> Result<Vec<Node>, TierError> {
        let names = || self.seed_names();
        let client = self.cluster_client(ca)?;
        let discover = {
            let client = client.clone();
            let limit = self.connect_timeout + self.op_timeout;
            async move {
                let slots = async {
                    let mut conn = client.get_async_connection().await?;
                    let mut cmd = redis::cmd("CLUSTER");
                    cmd.arg("SLOTS");
                    conn.route_command(cmd, RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random)).await
                };
                tokio::time::timeout(limit, slots).await
            }
        };
        let slots = match run_on(rt, discover) {
            None => return Err(unavailable("runtime stopped")),
            Some(Err(_)) => return Err(unavailable(format!("cluster {}: no answer to CLUSTER SLOTS", names()))),
            Some(Ok(Err(e))) => {
                return Err(match node::classify_connect(&names(), &e) {
                    ConnectError::Config(m) => config_error(m),
                    ConnectError::Unreachable(m) => unavailable(format!("cluster {m}")),
                })
            }
            Some(Ok(Ok(v))) => v,
        };
        let masters = cluster::parse_slots(&slots).map_err(|e| unavailable(format!("cluster {}: {e}", names())))?;
        if !(self.replicas..=MAX_NODES).contains(&masters.len()) {
            return Err(config_error(format!(
                "cluster {}: {} masters serve slots; need between R = {} and {MAX_NODES}",
                names(),
                masters.len(),
                self.replicas
            )));
        }
        masters
            .iter()
            .map(|m| {
                let (tag, slot) = m
                    .tag(&self.host_id)
                    .ok_or_else(|| unavailable(format!("cluster master {} serves no slot", m.addr)))?;
                Ok(Node::shard(&m.addr, Placement::shard(namespace, &tag, slot), client.clone()))
            })
            .collect()
    }

    /// Connects to the servers, checks their eviction policy, deletes keys
    /// left in this machine's namespace by an earlier run, and starts the
    /// background tasks (reconnects, liveness pings, re-replication). Unreachable servers start out down (and are
    /// retried) as long as one server answers; wrong credentials or a refused
    /// eviction policy fail the build with [`TierError::Config`] naming the server.
    pub fn build(self) -> Result<RemoteTier, TierError> {
        self.validate()?;
        self.start(None)
    }

    /// The successor of a tier that was handed over ([`Tier::hand_over`]),
    /// built like [`build`](Self::build) but keeping the namespace's keys:
    /// its index, counters and nodes (for a cluster, the masters and tags
    /// found at build) come from `h`. The configuration must name the same
    /// nodes in the same order, the same `cluster_id`, `host_id` and
    /// replicas; a mismatch, or a truncated or corrupt state, is a
    /// [`TierError::Config`] saying what is wrong. A node that was down,
    /// or is at adopt, is treated as one that went down: skipped, its pages
    /// copied again from their other replicas; it comes back (wiped) once
    /// the tier owns its keys. A cluster shard whose slot changed master
    /// since is treated the same way. The tier does not own its keys until
    /// [`Tier::set_owner`]`(true)`: until then neither its drop nor a
    /// returning server deletes any of them.
    pub fn adopt(self, h: &TierHandover) -> Result<RemoteTier, TierError> {
        self.validate()?;
        let state = State::decode(h, &self)?;
        self.start(Some(state))
    }

    /// Builds the tier afresh, or from a predecessor's `state`.
    fn start(self, state: Option<State<'_>>) -> Result<RemoteTier, TierError> {
        // Only the ring provider is compiled in; installing it explicitly keeps
        // rustls working if another crate enables a second provider.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let ca = match &self.ca_cert {
            Some(p) => {
                Some(std::fs::read(p).map_err(|e| config_error(format!("CA certificate {}: {e}", p.display())))?)
            }
            None => None,
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("tmem-remote")
            .enable_all()
            .build()
            .map_err(|source| TierError::Io { tier: TIER.into(), source })?;
        let namespace = placement::prefix(&self.cluster_id, &self.host_id);
        let cluster = self.nodes.iter().any(|u| is_cluster_url(u));
        let nodes = if let (true, Some(st)) = (cluster, &state) {
            let client = self.cluster_client(ca.as_deref())?;
            st.nodes.iter().map(|n| Node::shard(&n.id, n.place.clone(), client.clone())).collect()
        } else if cluster {
            self.shards(&rt, ca.as_deref(), &namespace)?
        } else {
            self.nodes
                .iter()
                .map(|url| Ok(Node::server(url, self.client(url, ca.as_deref())?, &namespace)))
                .collect::<Result<Vec<_>, TierError>>()?
        };
        let settings = Settings {
            replicas: self.replicas,
            cluster_id: self.cluster_id.clone(),
            configured: self.nodes.iter().map(|u| node::identity(u)).collect(),
            host_id: self.host_id.clone(),
            require_noeviction: self.require_noeviction,
            op_timeout: self.op_timeout,
            connect_timeout: self.connect_timeout,
        };
        // An adopted tier owns no key until told so; dropped on a failure
        // below, it deletes none.
        let inner = Arc::new(Inner::new(settings, namespace, nodes, state.is_none()));
        let tier = RemoteTier { inner: Arc::clone(&inner), rt: RtGuard(Some(rt)) };
        // Nodes down when handed over come back (wiped) once the tier owns its keys.
        let how: Vec<Option<BringUp>> = match &state {
            None => inner.nodes.iter().map(|_| Some(BringUp::Build)).collect(),
            Some(st) => {
                st.restore(&inner)?;
                st.nodes.iter().map(|n| n.up.then(|| BringUp::Adopt(n.master_id.clone()))).collect()
            }
        };

        let init = Arc::clone(&inner);
        let results = tier
            .run(async move {
                join_all(how.into_iter().enumerate().map(|(n, how)| {
                    let init = &init;
                    async move {
                        match how {
                            Some(how) => init.bring_up(n, how).await,
                            None => {
                                Err(ConnectError::Unreachable(format!("{}: down when handed over", init.nodes[n].name)))
                            }
                        }
                    }
                }))
                .await
            })
            .ok_or_else(|| unavailable("runtime stopped"))?;
        let mut config_errors = Vec::new();
        let mut unreachable = Vec::new();
        for (n, r) in results.into_iter().enumerate() {
            match r {
                Ok(()) => {}
                Err(ConnectError::Config(m)) => config_errors.push(m),
                Err(ConnectError::Unreachable(m)) => {
                    inner.nodes[n].attempt_failed(m.clone());
                    unreachable.push(m);
                }
            }
        }
        if !config_errors.is_empty() {
            return Err(config_error(config_errors.join("; ")));
        }
        if inner.up_mask() == 0 {
            return Err(unavailable(format!("no node reachable: {}", unreachable.join("; "))));
        }
        tier.rt().spawn(Arc::clone(&inner).watch_nodes());
        tier.rt().spawn(Arc::clone(&inner).repair_loop());
        // Pages with a copy on a down node (or left short by the predecessor) get theirs.
        inner.request_repair();
        Ok(tier)
    }
}

/// Runs `f` on `rt` and waits for it (works from any thread, including one
/// inside another async runtime); `None` if it panicked.
fn run_on<T: Send + 'static>(rt: &tokio::runtime::Runtime, f: impl Future<Output = T> + Send + 'static) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    rt.spawn(async move {
        let _ = tx.send(f.await);
    });
    rx.recv().ok()
}

/// Shuts the runtime down without blocking (also from inside another runtime).
struct RtGuard(Option<tokio::runtime::Runtime>);

impl Drop for RtGuard {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// The RAMster tier. See the crate documentation.
pub struct RemoteTier {
    inner: Arc<Inner>,
    rt: RtGuard,
}

impl fmt::Debug for RemoteTier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteTier")
            .field("nodes", &self.inner.nodes.iter().map(|n| n.name.as_str()).collect::<Vec<_>>())
            .field("prefix", &self.inner.prefix)
            .field("replicas", &self.inner.s.replicas)
            .finish_non_exhaustive()
    }
}

/// Per-server counters of a [`RemoteTier`].
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NodeStats {
    /// Server URL, credentials redacted (for a cluster's node, the address
    /// of the master it started on).
    pub node: String,
    /// For a cluster's node, the slot its keys are in now.
    pub slot: Option<u16>,
    /// Serving.
    pub up: bool,
    /// Copies of this tier's pages on the server (per the local index).
    pub stored_pages: u64,
    /// Value bytes of those copies.
    pub stored_bytes: u64,
    /// Error answers, transport failures and timeouts.
    pub errors: u64,
    /// Writes refused with OOM (server full).
    pub oom_refusals: u64,
    /// Times the server was marked down.
    pub down_events: u64,
    /// Times it came back.
    pub reconnects: u64,
    /// Its `maxmemory-policy`, when it could be read.
    pub maxmemory_policy: Option<String>,
    /// Its `maxmemory` in bytes (0: no limit), when it could be read.
    pub maxmemory: Option<u64>,
    /// Why it last failed.
    pub last_error: Option<String>,
}

/// RAMster-specific counters (see [`RemoteTier::node_stats`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RemoteStats {
    /// Copies per page (R).
    pub replicas: usize,
    /// Servers serving.
    pub nodes_up: usize,
    /// Pages that got a new copy from re-replication after a server failed.
    pub rereplicated_pages: u64,
    /// Pages with fewer live copies than R (or than the number of live servers).
    pub under_replicated_pages: u64,
    /// Pages whose every copy was lost (gets answer `Unavailable`).
    pub lost_pages: u64,
    /// Pages indexed but found on none of their servers (deleted or evicted
    /// behind the tier's back). With `require_noeviction` (persistent pools)
    /// their gets answer `Unavailable` and they count as lost; without it
    /// (eviction allowed) a miss.
    pub vanished_pages: u64,
    /// Puts stored with fewer than R copies because too few servers were live.
    pub degraded_puts: u64,
    /// Cluster nodes whose slot came to be served by another master (a
    /// failover, or resharding); each time the node's copies were made again.
    pub master_changes: u64,
    /// Cluster nodes moved to a slot of another master because theirs served
    /// another node's slot too (so that copies stay on distinct masters).
    pub retags: u64,
    /// Per server.
    pub nodes: Vec<NodeStats>,
}

impl RemoteTier {
    fn rt(&self) -> &tokio::runtime::Runtime {
        self.rt.0.as_ref().expect("runtime lives as long as the tier")
    }

    /// Runs `f` on the tier's runtime and waits for it (see [`run_on`]).
    fn run<T: Send + 'static>(&self, f: impl Future<Output = T> + Send + 'static) -> Option<T> {
        run_on(self.rt(), f)
    }

    /// Redis key of a page on standalone servers (the same on each):
    /// `tmem:{cluster_id}:{host_id}:{pool}:{object:x}:{index:x}`.
    pub fn key_name(&self, key: TierKey) -> String {
        placement::key_name(&self.inner.prefix, key)
    }

    /// Redis key of a page on node `node` (for a cluster's shard, the
    /// namespace is followed by the node's hash tag: `...:{tag}:{pool}:...`).
    pub fn key_name_on(&self, node: usize, key: TierKey) -> String {
        self.inner.name(node, key)
    }

    /// For a cluster, the slot each node's keys are in now, in node order.
    pub fn node_slots(&self) -> Vec<Option<u16>> {
        self.inner.nodes.iter().map(|n| n.place().slot).collect()
    }

    /// Server URLs (credentials redacted), in configuration order.
    pub fn node_names(&self) -> Vec<String> {
        self.inner.nodes.iter().map(|n| n.name.clone()).collect()
    }

    /// Servers (indexes into [`node_names`](Self::node_names)) that hold a copy of
    /// `key` per the local index, in read order; `None` if the tier does not hold it.
    pub fn replica_nodes(&self, key: TierKey) -> Option<Vec<usize>> {
        let e = self.inner.index.get(key)?;
        Some(self.inner.order(key).into_iter().filter(|n| e.nodes & placement::bit(*n) != 0).collect())
    }

    /// Pages with fewer live copies than they should have (O(pages)).
    pub fn under_replicated(&self) -> u64 {
        self.inner.under_replicated()
    }

    /// Waits until re-replication has nothing left to do it can do; returns
    /// whether that happened within `timeout`.
    pub fn wait_repaired(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.under_replicated() == 0 && !self.inner.repair_needed.load(Ordering::Acquire) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Per-server and replication counters.
    pub fn node_stats(&self) -> RemoteStats {
        let i = &self.inner;
        let nodes: Vec<NodeStats> = i
            .nodes
            .iter()
            .zip(i.index.per_node.iter())
            .map(|(n, u)| {
                let st = n.state.lock();
                NodeStats {
                    node: n.name.clone(),
                    slot: st.place.slot,
                    up: n.is_up(),
                    stored_pages: u.pages.load(Ordering::Relaxed),
                    stored_bytes: u.bytes.load(Ordering::Relaxed),
                    errors: n.errors.load(Ordering::Relaxed),
                    oom_refusals: n.oom.load(Ordering::Relaxed),
                    down_events: n.down_events.load(Ordering::Relaxed),
                    reconnects: n.reconnects.load(Ordering::Relaxed),
                    maxmemory_policy: st.memory.policy.clone(),
                    maxmemory: st.memory.maxmemory,
                    last_error: st.last_error.clone(),
                }
            })
            .collect();
        RemoteStats {
            replicas: i.s.replicas,
            nodes_up: nodes.iter().filter(|n| n.up).count(),
            rereplicated_pages: i.c.rereplicated.load(Ordering::Relaxed),
            under_replicated_pages: i.under_replicated(),
            lost_pages: i.index.lost.load(Ordering::Relaxed),
            vanished_pages: i.c.vanished.load(Ordering::Relaxed),
            degraded_puts: i.c.degraded_puts.load(Ordering::Relaxed),
            master_changes: i.c.master_changes.load(Ordering::Relaxed),
            retags: i.c.retags.load(Ordering::Relaxed),
            nodes,
        }
    }
}

impl Drop for RemoteTier {
    /// Deletes this tier's keys from the servers (SCAN + UNLINK of its
    /// namespace, best effort, bounded by twice the operation timeout, at
    /// least 2 s) when it owns them ([`Tier::set_owner`]): swap content does
    /// not outlive its daemon. Keys a crashed daemon leaves behind are
    /// deleted by the next `build` with the same `cluster_id`/`host_id`.
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::Relaxed);
        self.inner.wake.notify_one();
        if !self.inner.owner.load(Ordering::Acquire) {
            return;
        }
        let inner = Arc::clone(&self.inner);
        let limit = (inner.s.op_timeout * 2).max(Duration::from_secs(2));
        let _ = self.run(async move { tokio::time::timeout(limit, inner.wipe_all()).await });
    }
}

impl Tier for RemoteTier {
    fn name(&self) -> &str {
        TIER
    }

    fn put(&self, key: TierKey, value: &[u8]) -> Result<TierPut, TierError> {
        self.put_batch(&[(key, value)]).pop().unwrap_or_else(|| Err(unavailable("internal: no result")))
    }

    fn get(&self, key: TierKey, out: &mut Vec<u8>) -> Result<TierGet, TierError> {
        out.clear();
        match self.get_batch(&[key]).pop().unwrap_or_else(|| Err(unavailable("internal: no result")))? {
            Some(v) => {
                out.extend_from_slice(&v);
                Ok(TierGet::Hit)
            }
            None => Ok(TierGet::Miss),
        }
    }

    fn remove(&self, key: TierKey) -> Result<bool, TierError> {
        self.remove_batch(&[key]).pop().unwrap_or_else(|| Err(unavailable("internal: no result")))
    }

    fn put_batch(&self, items: &[(TierKey, &[u8])]) -> Vec<Result<TierPut, TierError>> {
        let owned: Vec<(TierKey, Vec<u8>)> = items.iter().map(|(k, v)| (*k, v.to_vec())).collect();
        let inner = Arc::clone(&self.inner);
        self.run(async move { inner.put_batch(owned).await })
            .unwrap_or_else(|| items.iter().map(|_| Err(unavailable("runtime stopped"))).collect())
    }

    fn get_batch(&self, keys: &[TierKey]) -> Vec<Result<Option<Vec<u8>>, TierError>> {
        let owned = keys.to_vec();
        let inner = Arc::clone(&self.inner);
        self.run(async move { inner.get_batch(owned).await })
            .unwrap_or_else(|| keys.iter().map(|_| Err(unavailable("runtime stopped"))).collect())
    }

    fn remove_batch(&self, keys: &[TierKey]) -> Vec<Result<bool, TierError>> {
        let owned = keys.to_vec();
        let inner = Arc::clone(&self.inner);
        self.run(async move { inner.remove_batch(owned).await })
            .unwrap_or_else(|| keys.iter().map(|_| Err(unavailable("runtime stopped"))).collect())
    }

    /// Waits for the writes in flight (puts, removes, a re-replication step,
    /// a server's return) and describes the index, nodes and counters (see
    /// `handover.rs` for the format). Re-replication and reconnects stay
    /// held off until the next put, remove or clear, so that this tier
    /// changes nothing on the servers while a successor takes over; reads
    /// go on.
    fn hand_over(&self) -> Result<TierHandover, TierError> {
        let inner = Arc::clone(&self.inner);
        let state = self
            .run(async move {
                inner.paused.store(true, Ordering::Release);
                let _gate = inner.gate.write().await;
                handover::encode(&inner)
            })
            .ok_or_else(|| unavailable("runtime stopped"))?;
        Ok(TierHandover { kind: TIER.into(), state, fds: Vec::new() })
    }

    /// While not the owner, the tier deletes none of its keys: not at drop,
    /// and not on a server that comes back (down servers stay down).
    fn set_owner(&self, owner: bool) {
        self.inner.owner.store(owner, Ordering::Release);
    }

    fn clear_pool(&self, pool: u32) -> Result<(), TierError> {
        let inner = Arc::clone(&self.inner);
        self.run(async move { inner.clear_pool(pool).await }).ok_or_else(|| unavailable("runtime stopped"))
    }

    /// `used_bytes` counts every copy (value bytes); `limit_bytes` is the sum
    /// of the servers' `maxmemory` when every server has one (the servers may
    /// be shared with other machines).
    fn capacity(&self) -> Capacity {
        let i = &self.inner;
        let used = i.index.per_node.iter().map(|u| u.bytes.load(Ordering::Relaxed)).sum();
        let limits: Vec<Option<u64>> =
            i.nodes.iter().map(|n| n.state.lock().memory.maxmemory.filter(|m| *m > 0)).collect();
        let limit_bytes = limits.iter().all(Option::is_some).then(|| limits.iter().flatten().sum());
        Capacity { stored_pages: i.index.total.pages.load(Ordering::Relaxed), used_bytes: used, limit_bytes }
    }

    /// `Down` when no server is reachable; `Degraded` when some server is down
    /// (with R = 1 its pages are unavailable until it returns, and then lost),
    /// when fewer servers are live than R, when pages were lost, or while
    /// pages have fewer copies than they should (a scan of the index).
    fn health(&self) -> Health {
        let i = &self.inner;
        let down: Vec<&str> = i.nodes.iter().filter(|n| !n.is_up()).map(|n| n.name.as_str()).collect();
        let up = i.nodes.len() - down.len();
        let lost = i.index.lost.load(Ordering::Relaxed);
        if up == 0 {
            return Health::Down(format!("no server reachable ({})", down.join(", ")));
        }
        let mut why = Vec::new();
        if !down.is_empty() {
            why.push(format!("down: {}", down.join(", ")));
        }
        if up < i.s.replicas {
            why.push(format!("{up} live servers for {} replicas", i.s.replicas));
        }
        if lost > 0 {
            why.push(format!("{lost} pages lost with their only servers"));
        }
        // One more failure would lose these: say so until re-replication ends.
        let under = i.under_replicated();
        if under > 0 {
            why.push(format!("{under} pages with fewer copies than they should have"));
        }
        if why.is_empty() {
            Health::Healthy
        } else {
            Health::Degraded(why.join("; "))
        }
    }

    /// `wire_bytes_out`/`wire_bytes_in` are computed from the RESP encoding of
    /// the commands sent and the replies received (the `redis` crate does not
    /// count socket bytes); TLS record overhead, connection setup and the
    /// namespace scans at start and drop are not included. Latencies are per
    /// call (a batch counts once). `backing_reads` counts the `MGET`s sent:
    /// one per server a get reads from.
    fn stats(&self) -> TierStats {
        let c = &self.inner.c;
        let l = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        TierStats {
            name: TIER.into(),
            health: String::new(),
            stored_pages: l(&self.inner.index.total.pages),
            stored_bytes: l(&self.inner.index.total.bytes),
            writes: l(&c.writes),
            full: l(&c.full),
            reads: l(&c.reads),
            misses: l(&c.misses),
            removes: l(&c.removes),
            failures: l(&c.failures),
            bytes_written: l(&c.bytes_written),
            bytes_read: l(&c.bytes_read),
            wire_bytes_out: l(&c.wire_out),
            wire_bytes_in: l(&c.wire_in),
            backing_reads: l(&c.mgets),
            get_p50_us: c.get_lat.quantile_us(0.5),
            get_p99_us: c.get_lat.quantile_us(0.99),
            put_p50_us: c.put_lat.quantile_us(0.5),
            put_p99_us: c.put_lat.quantile_us(0.99),
        }
    }
}
