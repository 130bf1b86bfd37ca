//! The asynchronous core: placement, replication, reads with fallback,
//! failure handling and re-replication. Runs on the tier's own runtime.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use redis::Value;
use tmem_tier::{check_len, LatencyHistogram, TierError, TierKey, TierPut, MAX_VALUE};

use crate::cluster::parse_slots;
use crate::index::{Entry, Index};
use crate::node::{delete_matching, memory_config, server_id, Conn, ConnectError, MemoryConfig, Node};
use crate::placement::{bit, count, key_hash, key_name, rendezvous, resp_cmd_len, resp_value_len};

mod nodes;
mod repair;

pub(crate) use nodes::BringUp;

pub(crate) const TIER: &str = "remote";

/// Stripes of the per-key write locks (puts, removes and repairs of one key are serialized).
const STRIPES: usize = 4096;
const STRIPES_U64: u64 = 4096;
/// Keys per repair step (one pipeline per node each way).
const REPAIR_CHUNK: usize = 256;
/// SETs per pipeline; a node gets several pipelines of a batch at once.
const PIPELINE_CHUNK: usize = 32;
/// Keys per UNLINK command.
const UNLINK_KEYS: usize = 512;
/// Background tick: reconnect attempts are checked this often.
const TICK: Duration = Duration::from_millis(50);
/// Liveness PING of up nodes.
const PING_EVERY: Duration = Duration::from_secs(1);

pub(crate) fn unavailable(reason: impl Into<String>) -> TierError {
    TierError::Unavailable { tier: TIER.into(), reason: reason.into() }
}

pub(crate) fn config_error(reason: impl Into<String>) -> TierError {
    TierError::Config { tier: TIER.into(), reason: reason.into() }
}

/// Settings the engine needs from the configuration.
pub(crate) struct Settings {
    pub replicas: usize,
    pub cluster_id: String,
    /// The configured nodes without credentials (a cluster's seeds), in order.
    pub configured: Vec<String>,
    /// This machine's id: the base of its cluster hash tags.
    pub host_id: String,
    pub require_noeviction: bool,
    pub op_timeout: Duration,
    pub connect_timeout: Duration,
}

/// Operation counters.
#[derive(Default)]
pub(crate) struct Counters {
    pub writes: AtomicU64,
    pub full: AtomicU64,
    pub reads: AtomicU64,
    pub misses: AtomicU64,
    pub removes: AtomicU64,
    pub failures: AtomicU64,
    pub bytes_written: AtomicU64,
    pub bytes_read: AtomicU64,
    pub wire_out: AtomicU64,
    pub wire_in: AtomicU64,
    /// `MGET`s sent (one per server a get or batched get reads from).
    pub mgets: AtomicU64,
    pub get_lat: LatencyHistogram,
    pub put_lat: LatencyHistogram,
    /// Pages given a new copy by re-replication.
    pub rereplicated: AtomicU64,
    /// Pages indexed but found on none of their nodes (deleted or evicted behind the tier's back).
    pub vanished: AtomicU64,
    /// Puts stored with fewer than R copies (too few live nodes).
    pub degraded_puts: AtomicU64,
    /// Cluster shards whose slot moved to another master (failover or resharding).
    pub master_changes: AtomicU64,
    /// Cluster shards moved to another master's slot (theirs was shared).
    pub retags: AtomicU64,
}

impl Counters {
    /// The counters (latencies aside), in the order a hand-over carries them.
    pub fn fields(&self) -> [&AtomicU64; 15] {
        [
            &self.writes,
            &self.full,
            &self.reads,
            &self.misses,
            &self.removes,
            &self.failures,
            &self.bytes_written,
            &self.bytes_read,
            &self.wire_out,
            &self.wire_in,
            &self.rereplicated,
            &self.vanished,
            &self.degraded_puts,
            &self.master_changes,
            &self.retags,
        ]
    }
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

fn len_u64(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// One write of a value to up to `need` more nodes, in preference order.
struct Place<'a> {
    key: TierKey,
    value: &'a [u8],
    order: Vec<usize>,
    /// Nodes not to try: already tried, or already holding a copy.
    skip: u64,
    need: usize,
    stored: u64,
    epochs: Vec<(usize, u64)>,
    oom: bool,
    err: Option<String>,
}

/// One read from the first replica that answers, in preference order.
struct Fetch {
    key: TierKey,
    order: Vec<usize>,
    tried: u64,
    value: Option<Vec<u8>>,
    /// A replica was down or failed (so a miss cannot be concluded).
    failed: Option<String>,
}

/// Result of one repair pass.
#[derive(Debug, Default)]
pub(crate) struct RepairOutcome {
    pub repaired: usize,
    pub remaining: usize,
    /// Stopped by a hand-over.
    pub held: bool,
}

/// The shared state of a tier.
pub(crate) struct Inner {
    pub s: Settings,
    /// `tmem:{cluster_id}:{host_id}:`, the namespace of this tier on every node.
    pub prefix: String,
    pub nodes: Vec<Node>,
    seeds: Vec<u64>,
    pub index: Index,
    stripes: Box<[tokio::sync::Mutex<()>]>,
    pub c: Counters,
    pub wake: tokio::sync::Notify,
    pub repair_needed: AtomicBool,
    pub stop: AtomicBool,
    /// Held shared by every write (put, remove, clear, a repair step, a
    /// node's return), exclusively by a hand-over: it waits for them.
    pub gate: tokio::sync::RwLock<()>,
    /// Set by a hand-over: re-replication and reconnects wait for the next write.
    pub paused: AtomicBool,
    /// The tier deletes keys of its namespace on servers that come back and
    /// at drop only while set ([`tmem_tier::Tier::set_owner`]).
    pub owner: AtomicBool,
}

impl Inner {
    pub fn new(s: Settings, prefix: String, nodes: Vec<Node>, owner: bool) -> Self {
        let seeds = nodes.iter().map(|n| n.seed).collect();
        Self {
            s,
            prefix,
            index: Index::new(nodes.len()),
            nodes,
            seeds,
            stripes: (0..STRIPES).map(|_| tokio::sync::Mutex::new(())).collect(),
            c: Counters::default(),
            wake: tokio::sync::Notify::new(),
            repair_needed: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            gate: tokio::sync::RwLock::new(()),
            paused: AtomicBool::new(false),
            owner: AtomicBool::new(owner),
        }
    }

    pub fn up_mask(&self) -> u64 {
        self.nodes.iter().enumerate().filter(|(_, n)| n.is_up()).fold(0, |m, (i, _)| m | bit(i))
    }

    /// Rendezvous order of all nodes for `k`.
    pub fn order(&self, k: TierKey) -> Vec<usize> {
        rendezvous(&self.seeds, key_hash(k))
    }

    /// The name of `k` on node `n` now.
    pub fn name(&self, n: usize, k: TierKey) -> String {
        key_name(&self.nodes[n].place().prefix, k)
    }

    /// Enters the gate for a write of the caller's (waiting out a hand-over);
    /// background work a hand-over held off goes on.
    async fn write_gate(&self) -> tokio::sync::RwLockReadGuard<'_, ()> {
        let g = self.gate.read().await;
        self.paused.store(false, Ordering::Release);
        g
    }

    /// Whether down servers may come back (wiped of this tier's keys): the
    /// tier owns its keys and no hand-over holds background work off.
    pub fn may_return(&self) -> bool {
        self.owner.load(Ordering::Acquire) && !self.paused.load(Ordering::Acquire)
    }

    pub fn request_repair(&self) {
        self.repair_needed.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    fn node_failed(&self, n: usize, epoch: u64, reason: &str) {
        let node = &self.nodes[n];
        add(&node.errors, 1);
        if node.mark_down(epoch, reason, self.s.op_timeout) {
            self.request_repair();
        }
    }

    /// Sends one pipeline to node `n`, made by `build` from the node's key
    /// prefix (taken with the connection, so names and epoch agree); a
    /// transport failure or timeout marks the node down. `build` also
    /// returns the bytes sent and about the bytes expected back: the deadline
    /// is the operation timeout plus their transfer time at 50 MB/s, so a
    /// large batch is not mistaken for a dead node.
    async fn pipeline(
        &self,
        n: usize,
        build: impl FnOnce(&str) -> (redis::Pipeline, u64, u64),
    ) -> Result<(u64, Vec<Value>), String> {
        let node = &self.nodes[n];
        let Some((mut conn, epoch, prefix)) = node.conn() else {
            return Err(format!("{} is down", node.name));
        };
        let (pipe, out_bytes, reply_bytes) = build(&prefix);
        add(&self.c.wire_out, out_bytes);
        let deadline = self.s.op_timeout + Duration::from_micros((out_bytes + reply_bytes) / 50);
        match tokio::time::timeout(deadline, pipe.query_async::<Vec<Value>>(&mut conn)).await {
            Ok(Ok(vals)) => {
                add(&self.c.wire_in, vals.iter().map(resp_value_len).sum());
                Ok((epoch, vals))
            }
            Ok(Err(e)) => {
                let r = format!("{}: {e}", node.name);
                self.node_failed(n, epoch, &r);
                Err(r)
            }
            Err(_) => {
                let r = format!("{}: no answer within {deadline:?}", node.name);
                self.node_failed(n, epoch, &r);
                Err(r)
            }
        }
    }

    /// Locks the write stripes of `keys` (sorted, so lockers never deadlock).
    async fn lock_keys(&self, keys: impl Iterator<Item = TierKey>) -> Vec<tokio::sync::MutexGuard<'_, ()>> {
        let mut ids: Vec<usize> = keys.map(|k| usize::try_from(key_hash(k) % STRIPES_U64).unwrap_or(0)).collect();
        ids.sort_unstable();
        ids.dedup();
        let mut guards = Vec::with_capacity(ids.len());
        for i in ids {
            guards.push(self.stripes[i].lock().await);
        }
        guards
    }

    /// Copies whose node has not gone down since the write (call with the key's shard locked).
    fn valid_copies(&self, epochs: &[(usize, u64)]) -> u64 {
        epochs
            .iter()
            .filter(|(n, e)| self.nodes[*n].epoch.load(Ordering::Acquire) == *e)
            .fold(0, |m, (n, _)| m | bit(*n))
    }

    /// Writes each item to nodes in its order until it has `need` copies or
    /// runs out of candidates; OOM answers and failed nodes move on to the next.
    async fn place(&self, items: &mut [Place<'_>]) {
        for _round in 0..=self.nodes.len() {
            let up = self.up_mask();
            let mut per_node: Vec<Vec<usize>> = vec![Vec::new(); self.nodes.len()];
            let mut any = false;
            for (i, it) in items.iter_mut().enumerate() {
                let mut want = it.need.saturating_sub(count(it.stored));
                for &n in &it.order {
                    if want == 0 {
                        break;
                    }
                    if it.skip & bit(n) != 0 || up & bit(n) == 0 {
                        continue;
                    }
                    it.skip |= bit(n);
                    per_node[n].push(i);
                    want -= 1;
                    any = true;
                }
            }
            if !any {
                return;
            }
            let items_ref = &*items;
            // One MSET per chunk (one command and one reply for many keys), several
            // chunks per node in flight together on its multiplexed connection:
            // the server works on one while we encode the next and decode the last.
            let futs: Vec<_> = per_node
                .iter()
                .enumerate()
                .flat_map(|(n, v)| v.chunks(PIPELINE_CHUNK).map(move |c| (n, c)))
                .map(|(n, idxs)| {
                    let build = move |prefix: &str| {
                        let mut pipe = redis::pipe();
                        pipe.ignore_errors();
                        let cmd = pipe.cmd("MSET");
                        let mut lens = Vec::with_capacity(1 + 2 * idxs.len());
                        lens.push(4);
                        for &i in idxs {
                            let it = &items_ref[i];
                            let name = key_name(prefix, it.key);
                            lens.extend([name.len(), it.value.len()]);
                            cmd.arg(name).arg(it.value);
                        }
                        (pipe, resp_cmd_len(&lens), 5)
                    };
                    async move { (n, idxs, self.pipeline(n, build).await) }
                })
                .collect();
            for (n, idxs, r) in join_all(futs).await {
                let node = &self.nodes[n];
                // MSET stores all of its keys or none.
                let outcome = match r {
                    Ok((epoch, vals)) => match vals.first() {
                        Some(Value::Okay) => Ok(epoch),
                        Some(Value::SimpleString(s)) if s == "OK" => Ok(epoch),
                        Some(Value::ServerError(e)) if e.code() == "OOM" => {
                            add(&node.oom, 1);
                            Err(None)
                        }
                        Some(Value::ServerError(e)) => {
                            add(&node.errors, 1);
                            Err(Some(format!("{}: {} {}", node.name, e.code(), e.details().unwrap_or(""))))
                        }
                        other => {
                            add(&node.errors, 1);
                            Err(Some(format!("{}: unexpected answer to MSET: {other:?}", node.name)))
                        }
                    },
                    Err(reason) => Err(Some(reason)),
                };
                for &i in idxs {
                    let it = &mut items[i];
                    match &outcome {
                        Ok(epoch) => {
                            it.stored |= bit(n);
                            it.epochs.push((n, *epoch));
                        }
                        Err(None) => it.oom = true,
                        Err(Some(reason)) => it.err = Some(reason.clone()),
                    }
                }
            }
        }
    }

    /// Reads each item from the first replica in its order that has it.
    async fn fetch(&self, items: &mut [Fetch]) {
        for _round in 0..=self.nodes.len() {
            let up = self.up_mask();
            let mut per_node: Vec<Vec<usize>> = vec![Vec::new(); self.nodes.len()];
            let mut any = false;
            for (i, it) in items.iter_mut().enumerate() {
                if it.value.is_some() {
                    continue;
                }
                for &n in &it.order {
                    if it.tried & bit(n) != 0 {
                        continue;
                    }
                    it.tried |= bit(n);
                    if up & bit(n) == 0 {
                        it.failed = Some(format!("{} is down", self.nodes[n].name));
                        continue;
                    }
                    per_node[n].push(i);
                    any = true;
                    break;
                }
            }
            if !any {
                return;
            }
            let items_ref = &*items;
            let futs: Vec<_> = per_node
                .iter()
                .enumerate()
                .filter(|(_, v)| !v.is_empty())
                .map(|(n, idxs)| {
                    let build = move |prefix: &str| {
                        let mut pipe = redis::pipe();
                        pipe.ignore_errors();
                        let cmd = pipe.cmd("MGET");
                        let mut lens = Vec::with_capacity(1 + idxs.len());
                        lens.push(4);
                        for &i in idxs {
                            let name = key_name(prefix, items_ref[i].key);
                            lens.push(name.len());
                            cmd.arg(name);
                        }
                        (pipe, resp_cmd_len(&lens), len_u64(idxs.len() * (MAX_VALUE + 8)))
                    };
                    add(&self.c.mgets, 1);
                    async move { (n, self.pipeline(n, build).await) }
                })
                .collect();
            for (n, r) in join_all(futs).await {
                let node = &self.nodes[n];
                let vals = match r {
                    Ok((_, mut vals)) => match vals.pop() {
                        Some(Value::Array(vals)) if vals.len() == per_node[n].len() => Ok(vals),
                        Some(Value::ServerError(e)) => {
                            add(&node.errors, 1);
                            Err(format!("{}: {} {}", node.name, e.code(), e.details().unwrap_or("")))
                        }
                        other => {
                            add(&node.errors, 1);
                            Err(format!("{}: unexpected answer to MGET: {other:?}", node.name))
                        }
                    },
                    Err(reason) => Err(reason),
                };
                match vals {
                    Ok(vals) => {
                        for (&i, v) in per_node[n].iter().zip(vals) {
                            let it = &mut items[i];
                            match v {
                                Value::BulkString(b) => it.value = Some(b),
                                Value::Nil => {}
                                other => {
                                    add(&node.errors, 1);
                                    it.failed = Some(format!("{}: unexpected value in MGET: {other:?}", node.name));
                                }
                            }
                        }
                    }
                    Err(reason) => {
                        for &i in &per_node[n] {
                            items[i].failed = Some(reason.clone());
                        }
                    }
                }
            }
        }
    }

    /// Deletes `keys` on their nodes (one pipeline per node, concurrently).
    /// Failures are counted, not returned: a node that fails is marked down,
    /// and a node coming back has this tier's keys wiped before serving.
    async fn delete(&self, per_node: Vec<Vec<TierKey>>) {
        let futs: Vec<_> = per_node
            .into_iter()
            .enumerate()
            .filter(|(n, v)| !v.is_empty() && self.nodes[*n].is_up())
            .map(|(n, keys)| {
                let build = move |prefix: &str| {
                    let mut pipe = redis::pipe();
                    pipe.ignore_errors();
                    let mut bytes = 0;
                    for chunk in keys.chunks(UNLINK_KEYS) {
                        let cmd = pipe.cmd("UNLINK");
                        let mut lens = vec![6];
                        for k in chunk {
                            let name = key_name(prefix, *k);
                            lens.push(name.len());
                            cmd.arg(name);
                        }
                        bytes += resp_cmd_len(&lens);
                    }
                    (pipe, bytes, 0)
                };
                async move { (n, self.pipeline(n, build).await) }
            })
            .collect();
        for (n, r) in join_all(futs).await {
            if let Ok((_, vals)) = r {
                let errors = vals.iter().filter(|v| matches!(v, Value::ServerError(_))).count();
                add(&self.nodes[n].errors, len_u64(errors));
            }
        }
    }

    pub async fn put_batch(&self, items: Vec<(TierKey, Vec<u8>)>) -> Vec<Result<TierPut, TierError>> {
        let started = Instant::now();
        let mut results: Vec<Option<Result<TierPut, TierError>>> = (0..items.len()).map(|_| None).collect();
        // The last occurrence of a key in the batch wins; earlier ones were stored, then replaced.
        let mut last: HashMap<TierKey, usize> = HashMap::with_capacity(items.len());
        for (i, (k, v)) in items.iter().enumerate() {
            if let Err(e) = check_len(v) {
                results[i] = Some(Err(e));
            } else if let Some(prev) = last.insert(*k, i) {
                results[prev] = Some(Ok(TierPut::Stored));
            }
        }
        let mut active: Vec<usize> = last.into_values().collect();
        active.sort_unstable();
        let gate = self.write_gate().await;
        let guards = self.lock_keys(active.iter().map(|&i| items[i].0)).await;

        let r = self.s.replicas;
        let mut places: Vec<Place<'_>> = active
            .iter()
            .map(|&i| Place {
                key: items[i].0,
                value: &items[i].1,
                order: self.order(items[i].0),
                skip: 0,
                need: r,
                stored: 0,
                epochs: Vec::new(),
                oom: false,
                err: None,
            })
            .collect();
        self.place(&mut places).await;

        let mut dels: Vec<Vec<TierKey>> = vec![Vec::new(); self.nodes.len()];
        let mut degraded = false;
        for (p, &i) in places.iter().zip(&active) {
            let (k, v) = (&items[i].0, &items[i].1);
            let mut shard = self.index.shard(*k);
            let valid = self.valid_copies(&p.epochs);
            let outcome = if count(valid) >= r || (count(valid) >= 1 && !p.oom) {
                degraded |= count(valid) < r;
                Ok(TierPut::Stored)
            } else if p.oom {
                Ok(TierPut::Full)
            } else {
                Err(unavailable(format!("no node could store {k:?}: {}", p.err.as_deref().unwrap_or("no live node"))))
            };
            // Copies to delete: the old value where the new one did not go, or
            // everything of this key when the put did not store (a stale value must
            // never be served after a put, even a failed one).
            let stale = if let Ok(TierPut::Stored) = outcome {
                let e =
                    Entry { nodes: valid, len: u32::try_from(v.len()).unwrap_or(u32::MAX), gen: self.index.next_gen() };
                let old = self.index.put_locked(&mut shard, *k, e);
                old.map_or(0, |o| o.nodes) & !p.stored
            } else {
                let old = self.index.remove_locked(&mut shard, *k);
                old.map_or(0, |o| o.nodes) | p.stored
            };
            drop(shard);
            for (n, d) in dels.iter_mut().enumerate() {
                if stale & bit(n) != 0 {
                    d.push(p.key);
                }
            }
            results[i] = Some(outcome);
        }
        self.delete(dels).await;
        drop(guards);
        drop(gate);
        if degraded {
            add(&self.c.degraded_puts, 1);
            self.request_repair();
        }

        let results: Vec<Result<TierPut, TierError>> =
            results.into_iter().map(|r| r.unwrap_or_else(|| Err(unavailable("internal: put not done")))).collect();
        for (r, (_, v)) in results.iter().zip(&items) {
            match r {
                Ok(TierPut::Stored) => {
                    add(&self.c.writes, 1);
                    add(&self.c.bytes_written, len_u64(v.len()));
                }
                Ok(TierPut::Full) => add(&self.c.full, 1),
                Err(_) => add(&self.c.failures, 1),
            }
        }
        self.c.put_lat.record(started.elapsed());
        results
    }

    pub async fn get_batch(&self, keys: Vec<TierKey>) -> Vec<Result<Option<Vec<u8>>, TierError>> {
        let started = Instant::now();
        let mut results: Vec<Option<Result<Option<Vec<u8>>, TierError>>> = (0..keys.len()).map(|_| None).collect();
        let mut pending: Vec<usize> = (0..keys.len()).collect();
        // A value replaced while it was being read may have left the nodes read;
        // such keys are read again from their new nodes.
        for attempt in 0..3 {
            let mut fetches = Vec::new();
            let mut which = Vec::new();
            for &i in &pending {
                let k = keys[i];
                match self.index.get(k) {
                    None => results[i] = Some(Ok(None)),
                    Some(e) if e.nodes == 0 => {
                        results[i] = Some(Err(unavailable(format!(
                            "{k:?} was lost: every node holding it failed (replicas = {})",
                            self.s.replicas
                        ))));
                    }
                    Some(e) => {
                        let order = self.order(k).into_iter().filter(|n| e.nodes & bit(*n) != 0).collect();
                        fetches.push(Fetch { key: k, order, tried: 0, value: None, failed: None });
                        which.push((i, e));
                    }
                }
            }
            self.fetch(&mut fetches).await;
            let mut again = Vec::new();
            for (f, (i, snap)) in fetches.into_iter().zip(which) {
                let k = keys[i];
                if let Some(v) = f.value {
                    results[i] = Some(Ok(Some(v)));
                    continue;
                }
                let mut shard = self.index.shard(k);
                match shard.get(&k).copied() {
                    None => results[i] = Some(Ok(None)),
                    // Replaced, or its nodes changed (a node came back and was
                    // wiped) while it was read: read it again.
                    Some(cur) if cur != snap && attempt < 2 => again.push(i),
                    Some(cur) if cur == snap && f.failed.is_none() => {
                        // Indexed, but on none of its nodes: deleted or evicted behind our back.
                        add(&self.c.vanished, 1);
                        if self.s.require_noeviction {
                            // Persistent pools: a page must not silently become a miss.
                            self.index.set_nodes_locked(&mut shard, k, 0);
                            results[i] = Some(Err(unavailable(format!(
                                "{k:?} vanished from its servers (deleted behind the tier's back)"
                            ))));
                        } else {
                            self.index.remove_locked(&mut shard, k);
                            results[i] = Some(Ok(None));
                        }
                    }
                    Some(_) => {
                        results[i] = Some(Err(unavailable(format!(
                            "{k:?}: no replica reachable ({})",
                            f.failed.as_deref().unwrap_or("value changed while reading")
                        ))));
                    }
                }
            }
            pending = again;
            if pending.is_empty() {
                break;
            }
        }
        let results: Vec<Result<Option<Vec<u8>>, TierError>> =
            results.into_iter().map(|r| r.unwrap_or_else(|| Err(unavailable("internal: get not done")))).collect();
        add(&self.c.reads, len_u64(results.len()));
        for r in &results {
            match r {
                Ok(Some(v)) => add(&self.c.bytes_read, len_u64(v.len())),
                Ok(None) => add(&self.c.misses, 1),
                Err(_) => add(&self.c.failures, 1),
            }
        }
        self.c.get_lat.record(started.elapsed());
        results
    }

    pub async fn remove_batch(&self, keys: Vec<TierKey>) -> Vec<Result<bool, TierError>> {
        let _gate = self.write_gate().await;
        let guards = self.lock_keys(keys.iter().copied()).await;
        let mut dels: Vec<Vec<TierKey>> = vec![Vec::new(); self.nodes.len()];
        let mut results = Vec::with_capacity(keys.len());
        for &k in &keys {
            let old = {
                let mut shard = self.index.shard(k);
                self.index.remove_locked(&mut shard, k)
            };
            if let Some(o) = old {
                for (n, d) in dels.iter_mut().enumerate() {
                    if o.nodes & bit(n) != 0 {
                        d.push(k);
                    }
                }
            }
            results.push(Ok(old.is_some()));
        }
        self.delete(dels).await;
        drop(guards);
        add(&self.c.removes, len_u64(keys.len()));
        results
    }

    pub async fn clear_pool(&self, pool: u32) {
        let _gate = self.write_gate().await;
        let mut dels: Vec<Vec<TierKey>> = vec![Vec::new(); self.nodes.len()];
        for mut shard in self.index.shards() {
            let keys: Vec<TierKey> = shard.keys().filter(|k| k.pool == pool).copied().collect();
            for k in keys {
                if let Some(o) = self.index.remove_locked(&mut shard, k) {
                    for (n, d) in dels.iter_mut().enumerate() {
                        if o.nodes & bit(n) != 0 {
                            d.push(k);
                        }
                    }
                }
            }
        }
        self.delete(dels).await;
    }
}
