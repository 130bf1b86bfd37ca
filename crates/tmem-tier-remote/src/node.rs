//! One node of the tier: a Redis/Valkey server, or one shard (master) of a
//! Redis/Valkey Cluster; its connection, up/down state and counters.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tmem_lock::{Mutex, Rank};

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{AsyncConnectionConfig, Client, Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, Value};

/// First reconnect delay after a node goes down; doubles per failed attempt.
pub(crate) const MIN_BACKOFF: Duration = Duration::from_millis(100);
/// Longest reconnect delay.
pub(crate) const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// `scheme://host:port/db` with any user name and password replaced by `***`.
pub(crate) fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let host_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    match rest[..host_end].rfind('@') {
        Some(at) => format!("{scheme}://***@{}", &rest[at + 1..]),
        None => url.to_owned(),
    }
}

/// The URL without credentials, for rendezvous hashing (credentials may change
/// between runs without moving keys).
pub(crate) fn identity(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let host_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    match rest[..host_end].rfind('@') {
        Some(at) => format!("{scheme}://{}", &rest[at + 1..]),
        None => url.to_owned(),
    }
}

/// Why connecting to a node failed.
#[derive(Debug)]
pub(crate) enum ConnectError {
    /// Wrong or missing credentials, or a refused eviction policy: a configuration error, not an outage.
    Config(String),
    /// The node refused the connection, timed out, or the TLS handshake failed.
    Unreachable(String),
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Config(m) | Self::Unreachable(m) => f.write_str(m),
        }
    }
}

/// How a node is reached.
pub(crate) enum Connector {
    /// A standalone server.
    Server(Box<Client>),
    /// The master serving a slot of a cluster (the node's [`Placement`]).
    Shard(Box<ClusterClient>),
}

/// A connection to a node.
#[derive(Clone)]
pub(crate) enum Conn {
    Server(MultiplexedConnection),
    /// A cluster connection that sends every command and pipeline to the
    /// master of one slot; the `redis` crate follows MOVED and ASK (and
    /// retries TRYAGAIN) during resharding and failover.
    Shard {
        conn: ClusterConnection,
        route: Route,
    },
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Server(c) => c.req_packed_command(cmd),
            Self::Shard { conn, route } => {
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(*route));
                // The cluster client queues an owned command (one copy per call).
                Box::pin(conn.route_command(cmd.clone(), routing))
            }
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Server(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Shard { conn, route } => Box::pin(conn.route_pipeline(
                pipeline.clone(),
                offset,
                count,
                SingleNodeRoutingInfo::SpecificNode(*route),
            )),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Server(c) => c.get_db(),
            Self::Shard { .. } => 0,
        }
    }
}

/// Eviction policy and memory limit of a node.
#[derive(Clone, Debug, Default)]
pub(crate) struct MemoryConfig {
    pub policy: Option<String>,
    pub maxmemory: Option<u64>,
    /// How they were read: `CONFIG GET` or `INFO memory`.
    pub source: &'static str,
}

/// Where a node keeps this tier's keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Placement {
    /// Prefix of the key names: the namespace, and for a cluster shard the
    /// hash tag of its slot (`tmem:c:h:{tag}:`).
    pub prefix: Arc<str>,
    /// The slot of the tag, for a cluster shard.
    pub slot: Option<u16>,
}

impl Placement {
    /// A cluster shard's: keys `{namespace}{tag}:…`, whose hash tag puts
    /// them all in `slot`, the tag's.
    pub fn shard(namespace: &str, tag: &str, slot: u16) -> Self {
        Self { prefix: format!("{namespace}{{{tag}}}:").into(), slot: Some(slot) }
    }
}

pub(crate) struct NodeState {
    pub conn: Option<Conn>,
    /// Changes only while the node is down (see `Inner::bring_up`).
    pub place: Placement,
    pub next_attempt: Instant,
    pub backoff: Duration,
    pub last_error: Option<String>,
    pub memory: MemoryConfig,
    /// For a cluster shard, the id (`CLUSTER MYID`) of the master that served
    /// the node's slot when it came up.
    pub master_id: Option<String>,
}

/// A server, or a cluster's shard, of the tier.
pub(crate) struct Node {
    /// URL with credentials redacted: for messages and stats.
    pub name: String,
    /// URL without credentials (a cluster shard: its master's address at
    /// build): the rendezvous seed's source, and the node's name in a hand-over.
    pub id: String,
    /// Rendezvous seed.
    pub seed: u64,
    connector: Connector,
    /// Serving: has a connection that last worked.
    pub up: AtomicBool,
    /// Incremented on every transition to down; an operation that started
    /// under an older epoch does not record copies on this node.
    pub epoch: AtomicU64,
    pub state: Mutex<NodeState>,
    /// Commands answered with an error, transport failures and timeouts.
    pub errors: AtomicU64,
    /// Writes refused with OOM.
    pub oom: AtomicU64,
    /// Transitions to down.
    pub down_events: AtomicU64,
    /// Successful reconnects after being down.
    pub reconnects: AtomicU64,
    /// A reconnect attempt is in flight.
    pub connecting: AtomicBool,
    /// A liveness PING is in flight.
    pub pinging: AtomicBool,
}

impl Node {
    /// A standalone server at `url`.
    pub fn server(url: &str, client: Client, namespace: &str) -> Self {
        let place = Placement { prefix: namespace.into(), slot: None };
        Self::new(redact(url), identity(url), place, Connector::Server(Box::new(client)))
    }

    /// The shard of a cluster whose master was at `master` (`host:port`) at
    /// build, keeping its keys at `place`.
    pub fn shard(master: &str, place: Placement, client: ClusterClient) -> Self {
        Self::new(format!("redis+cluster://{master}"), master.to_owned(), place, Connector::Shard(Box::new(client)))
    }

    fn new(name: String, id: String, place: Placement, connector: Connector) -> Self {
        Self {
            name,
            seed: crate::placement::node_seed(&id),
            id,
            connector,
            up: AtomicBool::new(false),
            epoch: AtomicU64::new(0),
            state: Mutex::new(
                Rank::RemoteNode,
                NodeState {
                    conn: None,
                    place,
                    next_attempt: Instant::now(),
                    backoff: MIN_BACKOFF,
                    last_error: None,
                    memory: MemoryConfig::default(),
                    master_id: None,
                },
            ),
            errors: AtomicU64::new(0),
            oom: AtomicU64::new(0),
            down_events: AtomicU64::new(0),
            reconnects: AtomicU64::new(0),
            connecting: AtomicBool::new(false),
            pinging: AtomicBool::new(false),
        }
    }

    /// Its counters, in the order a hand-over carries them.
    pub fn counters(&self) -> [&AtomicU64; 4] {
        [&self.errors, &self.oom, &self.down_events, &self.reconnects]
    }

    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    /// Where the node keeps this tier's keys.
    pub fn place(&self) -> Placement {
        self.state.lock().place.clone()
    }

    /// The connection, the epoch it belongs to and the key prefix, when up.
    pub fn conn(&self) -> Option<(Conn, u64, Arc<str>)> {
        let st = self.state.lock();
        if !self.is_up() {
            return None;
        }
        st.conn.clone().map(|c| (c, self.epoch.load(Ordering::Acquire), Arc::clone(&st.place.prefix)))
    }

    /// Moves a down node's keys to another slot (the slot of `tag`).
    pub fn retag(&self, namespace: &str, tag: &str, slot: u16) {
        let mut st = self.state.lock();
        debug_assert!(!self.is_up(), "a node is retagged only while down");
        st.place = Placement::shard(namespace, tag, slot);
    }

    /// Marks the node down if it is still in `epoch`; returns whether this call did it.
    /// The first reconnect attempt waits `first_retry` (the operation timeout), so
    /// that writes still in flight on the old connection are over before the
    /// node's keys are wiped on its return.
    pub fn mark_down(&self, epoch: u64, reason: &str, first_retry: Duration) -> bool {
        let mut st = self.state.lock();
        if !self.is_up() || self.epoch.load(Ordering::Acquire) != epoch {
            return false;
        }
        self.epoch.fetch_add(1, Ordering::AcqRel);
        self.up.store(false, Ordering::Release);
        st.conn = None;
        st.backoff = MIN_BACKOFF;
        st.next_attempt = Instant::now() + first_retry.max(MIN_BACKOFF);
        st.last_error = Some(reason.to_owned());
        self.down_events.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Records a failed connection attempt and schedules the next.
    pub fn attempt_failed(&self, reason: String) {
        let mut st = self.state.lock();
        st.next_attempt = Instant::now() + st.backoff;
        st.backoff = (st.backoff * 2).min(MAX_BACKOFF);
        st.last_error = Some(reason);
    }

    /// Puts a checked connection in service.
    pub fn bring_up(&self, conn: Conn, memory: MemoryConfig, master_id: Option<String>) {
        let mut st = self.state.lock();
        st.master_id = master_id;
        st.conn = Some(conn);
        st.backoff = MIN_BACKOFF;
        st.memory = memory;
        self.up.store(true, Ordering::Release);
    }

    /// Opens a connection (authenticating as the URL says) and checks it with PING.
    pub async fn connect(&self, connect_timeout: Duration, op_timeout: Duration) -> Result<Conn, ConnectError> {
        let slot = self.place().slot;
        let opened = match &self.connector {
            Connector::Server(client) => {
                let cfg = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(connect_timeout))
                    // Deadlines are the tier's own (scaled with the payload), not the crate's.
                    .set_response_timeout(None);
                let fut = client.get_multiplexed_async_connection_with_config(&cfg);
                tokio::time::timeout(connect_timeout + op_timeout, async { fut.await.map(Conn::Server) }).await
            }
            Connector::Shard(client) => {
                let fut = client.get_async_connection();
                let route = Route::new(slot.unwrap_or_default(), SlotAddr::Master);
                tokio::time::timeout(connect_timeout + op_timeout, async {
                    fut.await.map(|conn| Conn::Shard { conn, route })
                })
                .await
            }
        };
        let mut conn = match opened {
            Err(_) => return Err(ConnectError::Unreachable(format!("{}: connect timed out", self.name))),
            Ok(Err(e)) => return Err(classify_connect(&self.name, &e)),
            Ok(Ok(c)) => c,
        };
        let ping = tokio::time::timeout(op_timeout, redis::cmd("PING").query_async::<Value>(&mut conn)).await;
        match ping {
            Err(_) => Err(ConnectError::Unreachable(format!("{}: PING timed out", self.name))),
            Ok(Err(e)) => Err(classify_connect(&self.name, &e)),
            Ok(Ok(Value::ServerError(e))) => {
                let msg = format!("{}: PING refused: {} {}", self.name, e.code(), e.details().unwrap_or(""));
                if matches!(e.code(), "NOAUTH" | "WRONGPASS" | "NOPERM") {
                    Err(ConnectError::Config(format!("{msg} (set user:password in the node URL)")))
                } else {
                    Err(ConnectError::Unreachable(msg))
                }
            }
            Ok(Ok(_)) => Ok(conn),
        }
    }
}

pub(crate) fn classify_connect(name: &str, e: &RedisError) -> ConnectError {
    let code = e.code().unwrap_or("");
    if e.kind() == ErrorKind::AuthenticationFailed || matches!(code, "NOAUTH" | "WRONGPASS") {
        ConnectError::Config(format!(
            "{name}: authentication failed ({e}); check the user and password in the node URL"
        ))
    } else {
        ConnectError::Unreachable(format!("{name}: {e}"))
    }
}

/// The id of the server a connection reaches (for a cluster shard, of the
/// master serving its slot now).
pub(crate) async fn server_id(conn: &mut Conn, op_timeout: Duration) -> Result<String, String> {
    let mut cmd = redis::cmd("CLUSTER");
    cmd.arg("MYID");
    match tokio::time::timeout(op_timeout, cmd.query_async::<String>(conn)).await {
        Err(_) => Err("CLUSTER MYID timed out".to_owned()),
        Ok(Err(e)) => Err(format!("CLUSTER MYID: {e}")),
        Ok(Ok(id)) => Ok(id),
    }
}

/// Flattens a `CONFIG GET` answer (RESP2 array or RESP3 map) into pairs.
fn config_pairs(v: Value) -> Vec<(String, String)> {
    let s = |v: Value| match v {
        Value::BulkString(b) => String::from_utf8_lossy(&b).into_owned(),
        Value::SimpleString(s) => s,
        Value::Int(i) => i.to_string(),
        _ => String::new(),
    };
    match v {
        Value::Array(items) => {
            let mut it = items.into_iter();
            let mut out = Vec::new();
            while let (Some(k), Some(v)) = (it.next(), it.next()) {
                out.push((s(k), s(v)));
            }
            out
        }
        Value::Map(pairs) => pairs.into_iter().map(|(k, v)| (s(k), s(v))).collect(),
        _ => Vec::new(),
    }
}

/// Reads `maxmemory-policy` and `maxmemory`: `CONFIG GET`, or `INFO memory`
/// when CONFIG is disabled, renamed or denied by an ACL.
pub(crate) async fn memory_config(name: &str, conn: &mut Conn, op_timeout: Duration) -> Result<MemoryConfig, String> {
    let mut cmd = redis::cmd("CONFIG");
    cmd.arg("GET").arg("maxmemory*");
    let config_err = match tokio::time::timeout(op_timeout, cmd.query_async::<Value>(conn)).await {
        Err(_) => return Err(format!("{name}: CONFIG GET timed out")),
        Ok(Ok(Value::ServerError(e))) => format!("{} {}", e.code(), e.details().unwrap_or("")),
        Ok(Err(e)) => e.to_string(),
        Ok(Ok(v)) => {
            let pairs = config_pairs(v);
            let get = |k: &str| pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
            if let Some(policy) = get("maxmemory-policy") {
                return Ok(MemoryConfig {
                    policy: Some(policy),
                    maxmemory: get("maxmemory").and_then(|m| m.parse().ok()),
                    source: "CONFIG GET",
                });
            }
            "CONFIG GET returned no maxmemory-policy".to_owned()
        }
    };
    let mut cmd = redis::cmd("INFO");
    cmd.arg("memory");
    let info = match tokio::time::timeout(op_timeout, cmd.query_async::<Value>(conn)).await {
        Err(_) => return Err(format!("{name}: INFO memory timed out")),
        Ok(Err(e)) => {
            return Err(format!(
                "{name}: CONFIG GET refused ({config_err}) and INFO memory refused ({e}); \
                 grant the tier's user +config|get or +info"
            ))
        }
        Ok(Ok(Value::BulkString(b))) => String::from_utf8_lossy(&b).into_owned(),
        Ok(Ok(Value::VerbatimString { text, .. })) => text,
        Ok(Ok(Value::ServerError(e))) => {
            return Err(format!(
                "{name}: CONFIG GET refused ({config_err}) and INFO memory refused ({} {}); \
                 grant the tier's user +config|get or +info",
                e.code(),
                e.details().unwrap_or("")
            ))
        }
        Ok(Ok(other)) => return Err(format!("{name}: unexpected INFO answer {other:?}")),
    };
    let field = |k: &str| {
        info.lines().find_map(|l| l.strip_prefix(k).and_then(|r| r.strip_prefix(':')).map(|v| v.trim().to_owned()))
    };
    match field("maxmemory_policy") {
        Some(policy) => Ok(MemoryConfig {
            policy: Some(policy),
            maxmemory: field("maxmemory").and_then(|m| m.parse().ok()),
            source: "INFO memory",
        }),
        None => Err(format!("{name}: no maxmemory_policy in INFO memory (CONFIG GET: {config_err})")),
    }
}

/// Deletes every key under `pattern` (`prefix*`) on one node with SCAN +
/// UNLINK; returns how many were deleted. One UNLINK per key, pipelined: on
/// a cluster master the keys found may lie in different slots.
pub(crate) async fn delete_matching(conn: &mut Conn, pattern: &str, op_timeout: Duration) -> Result<u64, String> {
    let mut cursor: u64 = 0;
    let mut deleted = 0u64;
    loop {
        let mut scan = redis::cmd("SCAN");
        scan.arg(cursor).arg("MATCH").arg(pattern).arg("COUNT").arg(1000);
        let (next, keys): (u64, Vec<Vec<u8>>) = tokio::time::timeout(op_timeout, scan.query_async(conn))
            .await
            .map_err(|_| "SCAN timed out".to_owned())?
            .map_err(|e| format!("SCAN: {e}"))?;
        if !keys.is_empty() {
            let mut unlink = redis::pipe();
            for k in &keys {
                unlink.cmd("UNLINK").arg(k.as_slice());
            }
            let n: Vec<u64> = tokio::time::timeout(op_timeout, unlink.query_async(conn))
                .await
                .map_err(|_| "UNLINK timed out".to_owned())?
                .map_err(|e| format!("UNLINK: {e}"))?;
            deleted += n.iter().sum::<u64>();
        }
        if next == 0 {
            return Ok(deleted);
        }
        cursor = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_never_show() {
        assert_eq!(redact("redis://u:secret@h:1/2"), "redis://***@h:1/2");
        assert_eq!(redact("rediss://:pw@h:1"), "rediss://***@h:1");
        assert_eq!(redact("redis://h:1/0"), "redis://h:1/0");
        assert_eq!(identity("redis://u:pw@h:1/3"), "redis://h:1/3");
    }
}
