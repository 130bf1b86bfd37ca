//! Re-replication: after a node fails, returns, or a put stored fewer than
//! R copies, pages with too few live copies are copied from a surviving
//! replica to the next live nodes of their rendezvous order.

use super::*;

impl Inner {
    /// Copies each page that lost a replica from a surviving replica to the
    /// next live nodes in its rendezvous order, until it has R copies again
    /// (or as many as there are live nodes).
    pub async fn repair_pass(&self) -> RepairOutcome {
        let mut out = RepairOutcome::default();
        let up = self.up_mask();
        let target = self.s.replicas.min(count(up));
        if target == 0 {
            return out;
        }
        let mut candidates = Vec::new();
        for shard in self.index.shards() {
            candidates.extend(
                shard.iter().filter(|(_, e)| e.nodes & up != 0 && count(e.nodes & up) < target).map(|(k, _)| *k),
            );
        }
        for chunk in candidates.chunks(REPAIR_CHUNK) {
            if self.stop.load(Ordering::Relaxed) {
                break;
            }
            let _gate = self.gate.read().await;
            if self.paused.load(Ordering::Acquire) {
                out.held = true;
                break;
            }
            let guards = self.lock_keys(chunk.iter().copied()).await;
            let up = self.up_mask();
            let target = self.s.replicas.min(count(up));
            let mut snaps = Vec::new();
            let mut fetches = Vec::new();
            for &k in chunk {
                let Some(e) = self.index.get(k) else { continue };
                let live = e.nodes & up;
                if live == 0 || count(live) >= target {
                    continue;
                }
                let order = self.order(k).into_iter().filter(|n| live & bit(*n) != 0).collect();
                fetches.push(Fetch { key: k, order, tried: 0, value: None, failed: None });
                snaps.push((k, e, live));
            }
            self.fetch(&mut fetches).await;
            let mut places = Vec::new();
            let mut placed = Vec::new();
            for (f, (k, e, live)) in fetches.iter().zip(&snaps) {
                let Some(v) = &f.value else {
                    out.remaining += 1;
                    continue;
                };
                places.push(Place {
                    key: *k,
                    value: v,
                    order: self.order(*k),
                    skip: e.nodes,
                    need: target - count(*live),
                    stored: 0,
                    epochs: Vec::new(),
                    oom: false,
                    err: None,
                });
                placed.push((*k, *e, *live));
            }
            self.place(&mut places).await;
            let mut dels: Vec<Vec<TierKey>> = vec![Vec::new(); self.nodes.len()];
            for (p, (k, e, live)) in places.iter().zip(placed) {
                let mut shard = self.index.shard(k);
                let valid = self.valid_copies(&p.epochs);
                let cur = shard.get(&k).copied();
                match cur {
                    Some(c) if c.gen == e.gen => {
                        if valid != 0 {
                            // Copies on nodes that were down are dropped: a node that
                            // comes back has this tier's keys wiped before serving.
                            let dead = e.nodes & !live;
                            self.index.set_nodes_locked(&mut shard, k, (c.nodes & !dead) | valid);
                            add(&self.c.rereplicated, 1);
                            out.repaired += 1;
                        }
                        if count(valid) < p.need {
                            out.remaining += 1;
                        }
                    }
                    _ => {
                        // Removed (clear_pool) while copying: delete the new copies.
                        let keep = cur.map_or(0, |c| c.nodes);
                        for (n, d) in dels.iter_mut().enumerate() {
                            if p.stored & !keep & bit(n) != 0 {
                                d.push(p.key);
                            }
                        }
                    }
                }
            }
            self.delete(dels).await;
            drop(guards);
        }
        out
    }

    /// Pages with fewer live copies than they should have (R, or the number of live nodes).
    pub fn under_replicated(&self) -> u64 {
        let up = self.up_mask();
        let target = self.s.replicas.min(count(up));
        let mut n = 0u64;
        for shard in self.index.shards() {
            n += len_u64(shard.values().filter(|e| e.nodes != 0 && count(e.nodes & up) < target).count());
        }
        n
    }

    /// Background task: re-replicates after a node failure, a node's return,
    /// or a put that could store fewer than R copies.
    pub async fn repair_loop(self: Arc<Self>) {
        loop {
            let _ = tokio::time::timeout(TICK * 4, self.wake.notified()).await;
            if self.stop.load(Ordering::Relaxed) {
                return;
            }
            if !self.paused.load(Ordering::Acquire) && self.repair_needed.swap(false, Ordering::AcqRel) {
                let o = self.repair_pass().await;
                if o.held || (o.repaired > 0 && o.remaining > 0) {
                    self.repair_needed.store(true, Ordering::Release);
                }
            }
        }
    }
}
