//! Node lifecycle: bringing a node into service (checked, wiped of stale
//! keys), taking a failed one out, pings, and reconnection with backoff.

use super::*;

/// When a node is brought into service.
pub(crate) enum BringUp {
    /// At build: this machine's whole namespace on the server is deleted
    /// (for a cluster shard, on its master: keys of earlier runs may carry
    /// other tags).
    Build,
    /// Back from down: the node's own keys are deleted (a cluster master may
    /// serve other nodes' slots too) and the index forgets its copies.
    Return,
    /// At adopt, a node that served the predecessor: its keys and copies
    /// are kept, if (for a cluster shard) its slot's master is still this one.
    Adopt(Option<String>),
}

impl Inner {
    /// Connects node `n`, checks its eviction policy, and puts it in
    /// service; deletes this tier's keys left on it (from an earlier run, or
    /// from before it went down) and forgets the copies the index had on it,
    /// except when adopted. A cluster shard coming back whose master also
    /// serves another node's slot (resharding moved it there) moves to a
    /// slot of a master that serves none, if there is one, so that a page's
    /// copies stay on distinct masters.
    pub async fn bring_up(&self, n: usize, how: BringUp) -> Result<(), ConnectError> {
        let node = &self.nodes[n];
        let unreachable = |e: String| ConnectError::Unreachable(format!("{}: {e}", node.name));
        let long = self.s.op_timeout.max(Duration::from_secs(5));
        let mut conn = node.connect(self.s.connect_timeout, self.s.op_timeout).await?;
        if matches!(how, BringUp::Return) && node.place().slot.is_some() {
            if let Some((tag, slot)) = self.free_master_tag(n, &mut conn).await.map_err(unreachable)? {
                // The keys under the old tag go first, through the old route.
                let old = format!("{}*", node.place().prefix);
                delete_matching(&mut conn, &old, long).await.map_err(unreachable)?;
                node.retag(&self.prefix, &tag, slot);
                add(&self.c.retags, 1);
                conn = node.connect(self.s.connect_timeout, self.s.op_timeout).await?;
            }
        }
        let memory = match memory_config(&node.name, &mut conn, self.s.op_timeout).await {
            Ok(m) => m,
            Err(e) if self.s.require_noeviction => return Err(ConnectError::Config(e)),
            Err(_) => MemoryConfig::default(),
        };
        if self.s.require_noeviction {
            if let Some(p) = memory.policy.as_deref().filter(|p| *p != "noeviction") {
                return Err(ConnectError::Config(format!(
                    "{}: maxmemory-policy is {p} (from {}): it may evict pages of persistent pools; \
                     set `maxmemory-policy noeviction` on that server or use require_noeviction = false \
                     for ephemeral pools only",
                    node.name, memory.source
                )));
            }
        }
        let place = node.place();
        let master_id = match place.slot {
            Some(_) => Some(server_id(&mut conn, self.s.op_timeout).await.map_err(unreachable)?),
            None => None,
        };
        let stale = match &how {
            BringUp::Build => Some(&*self.prefix),
            BringUp::Return => Some(&*place.prefix),
            BringUp::Adopt(was) if *was == master_id => None,
            BringUp::Adopt(was) => {
                return Err(unreachable(format!(
                    "slot {} is served by master {}, not {} as when handed over; it comes back empty",
                    place.slot.unwrap_or_default(),
                    master_id.unwrap_or_default(),
                    was.as_deref().unwrap_or("?")
                )))
            }
        };
        if let Some(stale) = stale {
            delete_matching(&mut conn, &format!("{stale}*"), long)
                .await
                .map_err(|e| unreachable(format!("deleting leftover keys: {e}")))?;
            self.strip_node(n);
        }
        node.bring_up(conn, memory, master_id);
        Ok(())
    }

    /// For cluster shard `n` whose slot's master also serves another node's
    /// slot (or no master serves it), a hash tag and slot on a master that
    /// serves no other node's slot; `None` when its master is its own, or
    /// every master is taken.
    async fn free_master_tag(&self, n: usize, conn: &mut Conn) -> Result<Option<(String, u16)>, String> {
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("SLOTS");
        let v = tokio::time::timeout(self.s.op_timeout, cmd.query_async::<Value>(conn))
            .await
            .map_err(|_| "CLUSTER SLOTS timed out".to_owned())?
            .map_err(|e| format!("CLUSTER SLOTS: {e}"))?;
        let masters = parse_slots(&v)?;
        let owner = |slot: u16| masters.iter().position(|m| m.serves(slot));
        let others: Vec<usize> = (0..self.nodes.len())
            .filter(|m| *m != n)
            .filter_map(|m| self.nodes[m].place().slot.and_then(owner))
            .collect();
        if self.nodes[n].place().slot.and_then(owner).is_some_and(|m| !others.contains(&m)) {
            return Ok(None);
        }
        Ok((0..masters.len()).filter(|m| !others.contains(m)).find_map(|m| masters[m].tag(&self.s.host_id)))
    }

    /// Forgets every copy the index records on node `n`; pages left with no
    /// copy are lost (their gets answer `Unavailable`).
    pub(super) fn strip_node(&self, n: usize) {
        for mut shard in self.index.shards() {
            let keys: Vec<TierKey> = shard.iter().filter(|(_, e)| e.nodes & bit(n) != 0).map(|(k, _)| *k).collect();
            for k in keys {
                let nodes = shard.get(&k).map_or(0, |e| e.nodes & !bit(n));
                self.index.set_nodes_locked(&mut shard, k, nodes);
            }
        }
    }

    /// Deletes every key of this tier's namespace on every live node (SCAN +
    /// UNLINK), orphans included; forgets the index.
    pub async fn wipe_all(&self) {
        for mut shard in self.index.shards() {
            let keys: Vec<TierKey> = shard.keys().copied().collect();
            for k in keys {
                self.index.remove_locked(&mut shard, k);
            }
        }
        let pattern = format!("{}*", self.prefix);
        let t = self.s.op_timeout;
        join_all(self.nodes.iter().filter_map(|n| n.conn()).map(|(mut c, _, _)| {
            let pattern = pattern.clone();
            async move { delete_matching(&mut c, &pattern, t).await }
        }))
        .await;
    }

    /// Checks that node `n` answers. For a cluster shard, also that the
    /// master serving its slot is still the one it came up on: after a
    /// failover the promoted replica may lack writes the old master
    /// acknowledged (replication is asynchronous), so the node is taken out
    /// and comes back as a new server (its keys wiped, its pages copied again
    /// from their other replicas). A move of the slot to another master by
    /// resharding is treated the same way.
    pub(super) async fn ping(&self, n: usize) {
        let node = &self.nodes[n];
        let expected = node.state.lock().master_id.clone();
        let build = |_: &str| {
            let mut pipe = redis::pipe();
            let bytes = match &expected {
                None => {
                    pipe.ignore_errors().cmd("PING");
                    resp_cmd_len(&[4])
                }
                Some(_) => {
                    pipe.ignore_errors().cmd("CLUSTER").arg("MYID");
                    resp_cmd_len(&[7, 4])
                }
            };
            (pipe, bytes, 48)
        };
        let Ok((epoch, vals)) = self.pipeline(n, build).await else { return };
        let Some(expected) = expected else { return };
        let now = match vals.first() {
            Some(Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
            Some(Value::SimpleString(s)) => s.clone(),
            // An error answer (e.g. CLUSTERDOWN while a failover is under
            // way): the next check asks again.
            _ => {
                add(&node.errors, 1);
                return;
            }
        };
        if now != expected {
            let reason = format!(
                "{}: slot {} is now served by master {now}, not {expected} (failover or resharding); \
                 its copies are made again",
                node.name,
                node.place().slot.unwrap_or_default()
            );
            if node.mark_down(epoch, &reason, self.s.op_timeout) {
                add(&self.c.master_changes, 1);
                self.request_repair();
            }
        }
    }

    /// Background task: reconnects down nodes with backoff and pings live
    /// ones (each attempt in a task of its own, so a hung server delays nothing).
    pub async fn watch_nodes(self: Arc<Self>) {
        let mut last_ping = Instant::now();
        loop {
            tokio::time::sleep(TICK).await;
            if self.stop.load(Ordering::Relaxed) {
                return;
            }
            let now = Instant::now();
            let ping = last_ping.elapsed() >= PING_EVERY;
            if ping {
                last_ping = now;
            }
            for (n, node) in self.nodes.iter().enumerate() {
                if !node.is_up() {
                    let due = node.state.lock().next_attempt <= now;
                    if due && self.may_return() && !node.connecting.swap(true, Ordering::AcqRel) {
                        let me = Arc::clone(&self);
                        tokio::spawn(async move {
                            let node = &me.nodes[n];
                            let gate = me.gate.read().await;
                            if me.may_return() {
                                match me.bring_up(n, BringUp::Return).await {
                                    Ok(()) => {
                                        add(&node.reconnects, 1);
                                        me.request_repair();
                                    }
                                    Err(e) => node.attempt_failed(e.to_string()),
                                }
                            }
                            drop(gate);
                            node.connecting.store(false, Ordering::Release);
                        });
                    }
                } else if ping && !node.pinging.swap(true, Ordering::AcqRel) {
                    let me = Arc::clone(&self);
                    tokio::spawn(async move {
                        me.ping(n).await;
                        me.nodes[n].pinging.store(false, Ordering::Release);
                    });
                }
            }
        }
    }
}
