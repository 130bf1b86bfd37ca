//! The state a tier hands to its successor (`tmem swap restart`): its
//! encoding and its checks. The values stay on the servers; what travels is
//! what the tier knows of them.
//!
//! Format 1, little endian: magic `TMEMRAMS`, version u32; `cluster_id` and
//! `host_id` (u16 length and bytes each), replicas u32; the configured nodes
//! (URLs without credentials; for a cluster, its seeds), u32 count and
//! strings; the tier's nodes in order (index node sets are masks of their
//! positions), u32 count, each with its id (URL without credentials; a
//! cluster shard: its master's address at build), key prefix (a shard's
//! carries its hash tag), slot (u8 flag, u16), master id (u8 flag, string),
//! up (u8) and its 4 counters (u64); the tier's 15 counters (u64); the
//! index, u64 count, each entry pool u32, object u64, index u64, value
//! length u16 and node mask in ⌈nodes / 8⌉ bytes (22–30 bytes a key); then
//! a 64-bit checksum of everything before it. Lost pages are entries with
//! an empty mask.

use std::sync::atomic::Ordering;

use tmem_tier::{TierError, TierHandover, TierKey, MAX_VALUE};

use crate::engine::{config_error, Inner, TIER};
use crate::index::Entry;
use crate::node::{identity, Placement};
use crate::placement::mix64;
use crate::{RemoteTierConfig, MAX_NODES};

const MAGIC: &[u8; 8] = b"TMEMRAMS";
const VERSION: u32 = 1;
const NODE_COUNTERS: usize = 4;
const COUNTERS: usize = 15;
const _: () = assert!(MAX_VALUE <= u16::MAX as usize, "a value's length fits the entry's u16");

/// 64-bit checksum: each 8-byte word mixed into the state by a bijection,
/// so any change of one word is always caught.
fn checksum(b: &[u8]) -> u64 {
    b.chunks(8).fold(mix64(u64::try_from(b.len()).unwrap_or(u64::MAX)), |h, c| {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        mix64(h ^ u64::from_le_bytes(w))
    })
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    let len = u16::try_from(s.len()).unwrap_or(u16::MAX);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&s.as_bytes()[..usize::from(len)]);
}

fn put_opt<T>(out: &mut Vec<u8>, v: Option<T>, put: impl FnOnce(&mut Vec<u8>, T)) {
    out.push(u8::from(v.is_some()));
    if let Some(v) = v {
        put(out, v);
    }
}

fn mask_bytes(nodes: usize) -> usize {
    nodes.div_ceil(8)
}

fn bad(why: impl std::fmt::Display) -> TierError {
    config_error(format!("hand-over state: {why}"))
}

/// The tier's state (call in the write gate, held exclusively).
pub(crate) fn encode(i: &Inner) -> Vec<u8> {
    let mut out =
        Vec::with_capacity(1024 + usize::try_from(i.index.total.pages.load(Ordering::Relaxed)).unwrap_or(0) * 30);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    put_str(&mut out, &i.s.cluster_id);
    put_str(&mut out, &i.s.host_id);
    out.extend_from_slice(&u32::try_from(i.s.replicas).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(&u32::try_from(i.s.configured.len()).unwrap_or(u32::MAX).to_le_bytes());
    for u in &i.s.configured {
        put_str(&mut out, u);
    }
    out.extend_from_slice(&u32::try_from(i.nodes.len()).unwrap_or(u32::MAX).to_le_bytes());
    for n in &i.nodes {
        let st = n.state.lock();
        put_str(&mut out, &n.id);
        put_str(&mut out, &st.place.prefix);
        put_opt(&mut out, st.place.slot, |o, s| o.extend_from_slice(&s.to_le_bytes()));
        put_opt(&mut out, st.master_id.as_deref(), put_str);
        out.push(u8::from(n.is_up()));
        for c in n.counters() {
            out.extend_from_slice(&c.load(Ordering::Relaxed).to_le_bytes());
        }
    }
    for c in i.c.fields() {
        out.extend_from_slice(&c.load(Ordering::Relaxed).to_le_bytes());
    }
    let count_at = out.len();
    out.extend_from_slice(&0u64.to_le_bytes());
    let mb = mask_bytes(i.nodes.len());
    let mut count = 0u64;
    for shard in i.index.shards() {
        for (k, e) in shard.iter() {
            out.extend_from_slice(&k.pool.to_le_bytes());
            out.extend_from_slice(&k.object.to_le_bytes());
            out.extend_from_slice(&k.index.to_le_bytes());
            out.extend_from_slice(&u16::try_from(e.len).unwrap_or(u16::MAX).to_le_bytes());
            out.extend_from_slice(&e.nodes.to_le_bytes()[..mb]);
            count += 1;
        }
    }
    out[count_at..count_at + 8].copy_from_slice(&count.to_le_bytes());
    let sum = checksum(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

/// Reads a state front to back; running short is an error.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], TierError> {
        if self.0.len() < n {
            return Err(bad("truncated"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], TierError> {
        let mut a = [0; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, TierError> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, TierError> {
        self.array().map(u16::from_le_bytes)
    }
    fn u32(&mut self) -> Result<u32, TierError> {
        self.array().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Result<u64, TierError> {
        self.array().map(u64::from_le_bytes)
    }
    fn flag(&mut self) -> Result<bool, TierError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(bad(format!("flag byte {b}"))),
        }
    }
    fn str(&mut self) -> Result<String, TierError> {
        let len = self.u16()?;
        let b = self.take(usize::from(len))?;
        String::from_utf8(b.to_vec()).map_err(|_| bad("a string that is not UTF-8"))
    }
    fn count(&mut self, most: usize) -> Result<usize, TierError> {
        let n = usize::try_from(self.u32()?).unwrap_or(usize::MAX);
        if n > most {
            return Err(bad(format!("{n} items where at most {most} fit")));
        }
        Ok(n)
    }
}

/// A node as handed over.
pub(crate) struct HandedNode {
    pub id: String,
    pub place: Placement,
    pub master_id: Option<String>,
    pub up: bool,
    counters: [u64; NODE_COUNTERS],
}

/// A decoded state whose header matches the successor's configuration.
pub(crate) struct State<'a> {
    pub nodes: Vec<HandedNode>,
    counters: [u64; COUNTERS],
    entries: u64,
    /// The index's entries, read by [`State::restore`].
    rest: &'a [u8],
}

impl<'a> State<'a> {
    /// Checks the kind, checksum and format of `h`, and that it is the state
    /// of a tier with `cfg`'s namespace, replicas and nodes, in order.
    pub fn decode(h: &'a TierHandover, cfg: &RemoteTierConfig) -> Result<Self, TierError> {
        if h.kind != TIER {
            return Err(bad(format!("a {:?} tier's, not a {TIER} tier's", h.kind)));
        }
        if !h.fds.is_empty() {
            return Err(bad(format!("{} descriptors where none belong", h.fds.len())));
        }
        let Some(body_len) = h.state.len().checked_sub(8).filter(|n| *n >= MAGIC.len() + 4) else {
            return Err(bad("truncated"));
        };
        let (body, sum) = h.state.split_at(body_len);
        let mut r = Reader(body);
        if r.take(MAGIC.len())? != MAGIC {
            return Err(bad("not a remote tier's state (bad magic)"));
        }
        let version = r.u32()?;
        if version != VERSION {
            return Err(bad(format!("format {version}; this build reads format {VERSION}")));
        }
        if checksum(body).to_le_bytes() != sum {
            return Err(bad("checksum mismatch (truncated or corrupt)"));
        }
        let mismatch = |what: &str, ours: &dyn std::fmt::Debug, theirs: &dyn std::fmt::Debug| {
            config_error(format!("hand-over: the configuration has {what} {ours:?}, the handed-over tier {theirs:?}"))
        };
        let (cluster_id, host_id) = (r.str()?, r.str()?);
        if cluster_id != cfg.cluster_id {
            return Err(mismatch("cluster_id", &cfg.cluster_id, &cluster_id));
        }
        if host_id != cfg.host_id {
            return Err(mismatch("host_id", &cfg.host_id, &host_id));
        }
        let replicas = usize::try_from(r.u32()?).unwrap_or(usize::MAX);
        if replicas != cfg.replicas {
            return Err(mismatch("replicas", &cfg.replicas, &replicas));
        }
        let ours: Vec<String> = cfg.nodes.iter().map(|u| identity(u)).collect();
        let theirs = (0..r.count(MAX_NODES)?).map(|_| r.str()).collect::<Result<Vec<_>, _>>()?;
        if ours != theirs {
            return Err(mismatch("nodes (same ones, same order needed)", &ours, &theirs));
        }
        let namespace = crate::placement::prefix(&cluster_id, &host_id);
        let cluster = cfg.nodes.iter().any(|u| crate::is_cluster_url(u));
        let mut nodes = Vec::new();
        for n in 0..r.count(MAX_NODES)? {
            let (id, prefix) = (r.str()?, r.str()?);
            let slot = if r.flag()? { Some(r.u16()?) } else { None };
            let master_id = if r.flag()? { Some(r.str()?) } else { None };
            let up = r.flag()?;
            let mut counters = [0; NODE_COUNTERS];
            for c in &mut counters {
                *c = r.u64()?;
            }
            // A server is the configured one, keyed by the namespace; a
            // cluster shard, a master with a tag in the namespace.
            let fits = if cluster {
                slot.is_some_and(|s| s < crate::cluster::SLOTS) && prefix.starts_with(&namespace)
            } else {
                theirs.get(n) == Some(&id) && prefix == namespace && slot.is_none()
            };
            if !fits {
                return Err(bad(format!("node {n} ({id}) does not fit the nodes and namespace")));
            }
            nodes.push(HandedNode { id, place: Placement { prefix: prefix.into(), slot }, master_id, up, counters });
        }
        if !(replicas.max(1)..=MAX_NODES).contains(&nodes.len()) || (!cluster && nodes.len() != ours.len()) {
            return Err(bad(format!("{} nodes for {} configured and R = {replicas}", nodes.len(), ours.len())));
        }
        let mut counters = [0; COUNTERS];
        for c in &mut counters {
            *c = r.u64()?;
        }
        let entries = r.u64()?;
        let per_entry = 22 + mask_bytes(nodes.len());
        if u64::try_from(r.0.len() / per_entry).unwrap_or(u64::MAX) != entries || r.0.len() % per_entry != 0 {
            return Err(bad(format!("{} bytes for {entries} index entries of {per_entry}", r.0.len())));
        }
        Ok(Self { nodes, counters, entries, rest: r.0 })
    }

    /// Fills the (empty) index and counters of `i`, whose nodes are these.
    pub fn restore(&self, i: &Inner) -> Result<(), TierError> {
        for (c, v) in i.c.fields().into_iter().zip(self.counters) {
            c.store(v, Ordering::Relaxed);
        }
        for (node, handed) in i.nodes.iter().zip(&self.nodes) {
            for (c, v) in node.counters().into_iter().zip(handed.counters) {
                c.store(v, Ordering::Relaxed);
            }
        }
        let mb = mask_bytes(self.nodes.len());
        let mut r = Reader(self.rest);
        for _ in 0..self.entries {
            let k = TierKey { pool: r.u32()?, object: r.u64()?, index: r.u64()? };
            let len = r.u16()?;
            let mut mask = [0u8; 8];
            mask[..mb].copy_from_slice(r.take(mb)?);
            let nodes = u64::from_le_bytes(mask);
            // At least one node (checked in decode), at most 64.
            if usize::from(len) > MAX_VALUE || nodes & !(u64::MAX >> (64 - self.nodes.len())) != 0 {
                return Err(bad(format!("{k:?}: length {len} or node set {nodes:#x} out of range")));
            }
            let mut shard = i.index.shard(k);
            let e = Entry { nodes, len: u32::from(len), gen: i.index.next_gen() };
            if i.index.put_locked(&mut shard, k, e).is_some() {
                return Err(bad(format!("{k:?} listed twice")));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Settings;
    use crate::node::Node;
    use std::time::Duration;

    const URLS: [&str; 3] = ["redis://127.0.0.1:1", "redis://u:pw@127.0.0.1:2/1", "redis://127.0.0.1:3"];

    /// A tier's state, not connected (nothing connects until a node is brought up).
    fn inner() -> Inner {
        let ns = crate::placement::prefix("c", "h");
        let nodes = URLS.iter().map(|u| Node::server(u, redis::Client::open(*u).unwrap(), &ns)).collect();
        let s = Settings {
            replicas: 2,
            cluster_id: "c".into(),
            configured: URLS.iter().map(|u| identity(u)).collect(),
            host_id: "h".into(),
            require_noeviction: true,
            op_timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(1),
        };
        Inner::new(s, ns, nodes, true)
    }

    fn handover(state: Vec<u8>) -> TierHandover {
        TierHandover { kind: TIER.into(), state, fds: Vec::new() }
    }

    fn adopt(h: &TierHandover) -> Result<Inner, TierError> {
        let cfg = RemoteTierConfig::new(URLS.iter().map(|u| (*u).to_owned()).collect(), "c", "h");
        let i = inner();
        State::decode(h, &cfg)?.restore(&i)?;
        Ok(i)
    }

    #[test]
    fn the_state_round_trips_and_damage_is_refused() {
        let a = inner();
        for n in 0..40u64 {
            let k = TierKey { pool: u32::try_from(n % 3).unwrap(), object: n << 40, index: n };
            let mut shard = a.index.shard(k);
            let e = Entry { nodes: n % 8, len: u32::try_from(n * 100).unwrap(), gen: a.index.next_gen() };
            a.index.put_locked(&mut shard, k, e);
        }
        a.c.retags.store(7, Ordering::Relaxed);
        a.nodes[2].oom.store(3, Ordering::Relaxed);
        let state = encode(&a);
        let b = adopt(&handover(state.clone())).unwrap();
        let entries = |i: &Inner| {
            let mut v: Vec<(TierKey, u64, u32)> = i
                .index
                .shards()
                .flat_map(|s| s.iter().map(|(k, e)| (*k, e.nodes, e.len)).collect::<Vec<_>>())
                .collect();
            v.sort_unstable();
            v
        };
        assert_eq!(entries(&a), entries(&b));
        assert_eq!(b.index.lost.load(Ordering::Relaxed), 5, "lost pages travel");
        assert_eq!(b.index.total.pages.load(Ordering::Relaxed), 35);
        assert_eq!(
            b.index.per_node[1].bytes.load(Ordering::Relaxed),
            a.index.per_node[1].bytes.load(Ordering::Relaxed)
        );
        assert_eq!((b.c.retags.load(Ordering::Relaxed), b.nodes[2].oom.load(Ordering::Relaxed)), (7, 3));

        // Every truncation is refused; so is every changed byte, also when the
        // checksum is made to fit (the parser's own checks), without a panic.
        let body = state.len() - 8;
        for len in 0..state.len() {
            assert!(adopt(&handover(state[..len].to_vec())).is_err(), "truncated to {len}");
        }
        for i in 0..body {
            for flip in [0x01, 0x80, 0xff] {
                let mut s = state.clone();
                s[i] ^= flip;
                assert!(adopt(&handover(s.clone())).is_err(), "byte {i} ^ {flip:#x}");
                let sum = checksum(&s[..body]);
                s[body..].copy_from_slice(&sum.to_le_bytes());
                let _ = adopt(&handover(s));
            }
        }
    }

    #[test]
    fn one_changed_word_changes_the_checksum() {
        let a: Vec<u8> = (0..100u8).collect();
        let base = checksum(&a);
        for i in 0..a.len() {
            let mut b = a.clone();
            b[i] ^= 0x40;
            assert_ne!(checksum(&b), base, "byte {i}");
        }
        assert_ne!(checksum(&a[..99]), base);
    }
}
