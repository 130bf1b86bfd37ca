//! Node lifecycle: bringing a node into service (checked, wiped of stale
//! keys), taking a failed one out, pings, and reconnection with backoff.

use super::*;

impl Inner {
    /// Connects node `n`, checks its eviction policy, deletes this tier's
    /// keys left on it (from an earlier run, or from before it went down),
    /// forgets the copies the index had on it, and puts it in service.
    pub async fn bring_up(&self, n: usize) -> Result<(), ConnectError> {
        let node = &self.nodes[n];
        let mut conn = node.connect(self.s.connect_timeout, self.s.op_timeout).await?;
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
        let pattern = format!("{}*", self.prefix);
        delete_matching(&mut conn, &pattern, self.s.op_timeout.max(Duration::from_secs(5)))
            .await
            .map_err(|e| ConnectError::Unreachable(format!("{}: deleting leftover keys: {e}", node.name)))?;
        self.strip_node(n);
        node.bring_up(conn, memory);
        Ok(())
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
        join_all(self.nodes.iter().filter_map(|n| n.conn()).map(|(mut c, _)| {
            let pattern = pattern.clone();
            async move { delete_matching(&mut c, &pattern, t).await }
        }))
        .await;
    }

    pub(super) async fn ping(&self, n: usize) {
        let mut pipe = redis::pipe();
        pipe.ignore_errors().cmd("PING");
        let _ = self.pipeline(n, pipe, resp_cmd_len(&[4]), 7).await;
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
                    if due && !node.connecting.swap(true, Ordering::AcqRel) {
                        let me = Arc::clone(&self);
                        tokio::spawn(async move {
                            let node = &me.nodes[n];
                            match me.bring_up(n).await {
                                Ok(()) => {
                                    add(&node.reconnects, 1);
                                    me.request_repair();
                                }
                                Err(e) => node.attempt_failed(e.to_string()),
                            }
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
