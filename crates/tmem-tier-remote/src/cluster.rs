//! A Redis/Valkey Cluster as the remote tier: its masters are the tier's
//! nodes.
//!
//! The cluster places a key by its slot (CRC16 of the key's hash tag, mod
//! 16384) and replicates each master asynchronously to its replicas, which
//! can lose acknowledged writes on failover. So the tier does not rely on
//! that replication: at build it reads the slot map (`CLUSTER SLOTS`), makes
//! one node per master, and gives each node a hash tag whose slot that
//! master serves. A page's R copies go to R nodes, so to R masters, exactly
//! as with standalone servers. Every command of a node goes to its slot's
//! master through the `redis` crate's cluster client, which follows MOVED and
//! ASK when the slot is resharded and finds the new master after a failover.

use redis::Value;

/// Slots of a cluster.
pub(crate) const SLOTS: u16 = 16384;

/// The slot of a hash tag (the part of a key between `{` and `}`).
pub(crate) fn tag_slot(tag: &str) -> u16 {
    crc16::State::<crc16::XMODEM>::calculate(tag.as_bytes()) % SLOTS
}

/// A master and the slot ranges it serves (inclusive).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Master {
    /// `host:port`.
    pub addr: String,
    /// Slot ranges, inclusive.
    pub ranges: Vec<(u16, u16)>,
}

impl Master {
    /// Whether this master serves `slot`.
    pub fn serves(&self, slot: u16) -> bool {
        self.ranges.iter().any(|(a, b)| (*a..=*b).contains(&slot))
    }

    /// The first hash tag `{base}.{i}` whose slot this master serves, and the
    /// slot. `base` names the machine, so machines sharing a cluster use
    /// different slots of each master.
    pub(crate) fn tag(&self, base: &str) -> Option<(String, u16)> {
        // A master serving s of 16384 slots is hit with probability s/16384
        // per try; 1 << 20 tries miss only for a master with no slot at all.
        (0..1u32 << 20)
            .map(|i| format!("{base}.{i}"))
            .map(|t| (tag_slot(&t), t))
            .find_map(|(slot, t)| self.serves(slot).then_some((t, slot)))
    }
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        _ => None,
    }
}

/// Masters from a `CLUSTER SLOTS` answer (`[start, end, [host, port, id,
/// ...], replicas...]` per range), sorted by address.
pub fn parse_slots(v: &Value) -> Result<Vec<Master>, String> {
    let Value::Array(ranges) = v else {
        return Err(format!("CLUSTER SLOTS: expected an array, got {v:?}"));
    };
    let mut masters: Vec<Master> = Vec::new();
    for r in ranges {
        let bad = || format!("CLUSTER SLOTS: malformed range {r:?}");
        let Value::Array(f) = r else { return Err(bad()) };
        let (Some(start), Some(end), Some(Value::Array(node))) = (f.first(), f.get(1), f.get(2)) else {
            return Err(bad());
        };
        let span = |v: &Value| int(v).and_then(|i| u16::try_from(i).ok()).filter(|s| *s < SLOTS);
        let (Some(start), Some(end)) = (span(start), span(end)) else { return Err(bad()) };
        let (Some(host), Some(port)) = (node.first().and_then(text), node.get(1).and_then(int)) else {
            return Err(bad());
        };
        if start > end || host.is_empty() || !(1..=65535).contains(&port) {
            return Err(bad());
        }
        let addr = format!("{host}:{port}");
        match masters.iter_mut().find(|m| m.addr == addr) {
            Some(m) => m.ranges.push((start, end)),
            None => masters.push(Master { addr, ranges: vec![(start, end)] }),
        }
    }
    masters.sort_by(|a, b| a.addr.cmp(&b.addr));
    Ok(masters)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Any RESP value a server (or a man in the middle) could send.
    fn any_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            any::<i64>().prop_map(Value::Int),
            (0i64..20000).prop_map(Value::Int),
            proptest::collection::vec(any::<u8>(), 0..12).prop_map(Value::BulkString),
            Just(Value::Nil),
            Just(Value::BulkString(b"127.0.0.1".to_vec())),
        ];
        leaf.prop_recursive(4, 64, 6, |inner| proptest::collection::vec(inner, 0..6).prop_map(Value::Array))
    }

    proptest! {
        /// The parser answers every input with masters or one error, never a
        /// panic; what it accepts is a list of well-formed ranges.
        #[test]
        fn any_answer_parses_or_is_refused(v in any_value()) {
            if let Ok(masters) = parse_slots(&v) {
                for m in masters {
                    prop_assert!(m.ranges.iter().all(|(a, b)| a <= b && *b < SLOTS));
                    prop_assert!(!m.ranges.is_empty() && m.addr.contains(':'));
                }
            }
        }

        /// A slot map split among 1-8 masters: each master's tag lands on a
        /// slot it serves.
        #[test]
        fn tags_land_on_their_masters(cuts in proptest::collection::btree_set(1u16..SLOTS, 0..7)) {
            let mut bounds: Vec<u16> = cuts.into_iter().collect();
            bounds.insert(0, 0);
            let ranges: Vec<Value> = bounds
                .iter()
                .enumerate()
                .map(|(i, &a)| {
                    let b = bounds.get(i + 1).map_or(SLOTS - 1, |n| n - 1);
                    let node = Value::Array(vec![bulk("10.0.0.1"), Value::Int(7000 + i64::try_from(i).unwrap())]);
                    Value::Array(vec![Value::Int(a.into()), Value::Int(b.into()), node])
                })
                .collect();
            let masters = parse_slots(&Value::Array(ranges)).unwrap();
            prop_assert_eq!(masters.len(), bounds.len());
            for m in &masters {
                let (tag, slot) = m.tag("host").unwrap();
                prop_assert!(m.serves(slot) && tag_slot(&tag) == slot);
            }
        }
    }

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn slots_match_the_cluster_spec() {
        // The spec's test vector: CRC16/XMODEM("123456789") = 0x31C3.
        assert_eq!(crc16::State::<crc16::XMODEM>::calculate(b"123456789"), 0x31C3);
        // `CLUSTER KEYSLOT foo` and `CLUSTER KEYSLOT bar` on Redis 7.
        assert_eq!(tag_slot("foo"), 12182);
        assert_eq!(tag_slot("bar"), 5061);
    }

    #[test]
    fn parses_cluster_slots_and_picks_tags_each_master_serves() {
        let node = |port: i64| Value::Array(vec![bulk("127.0.0.1"), Value::Int(port), bulk("id")]);
        let range =
            |a: i64, b: i64, port: i64| Value::Array(vec![Value::Int(a), Value::Int(b), node(port), node(port + 100)]);
        let v = Value::Array(vec![range(10923, 16383, 7002), range(0, 5460, 7000), range(5461, 10922, 7001)]);
        let m = parse_slots(&v).unwrap();
        assert_eq!(
            m.iter().map(|m| m.addr.as_str()).collect::<Vec<_>>(),
            ["127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002"]
        );
        assert_eq!(m[0].ranges, [(0, 5460)]);
        for master in &m {
            let (tag, slot) = master.tag("host-1").unwrap();
            assert!(master.serves(slot) && tag_slot(&tag) == slot && tag.starts_with("host-1."), "{tag} {slot}");
        }
        let none = Master { addr: "x:1".into(), ranges: vec![] };
        assert!(none.tag("h").is_none());
        for bad in [
            Value::Int(1),
            Value::Array(vec![Value::Array(vec![Value::Int(5), Value::Int(1), node(7000)])]),
            Value::Array(vec![Value::Array(vec![Value::Int(0), Value::Int(16384), node(7000)])]),
            Value::Array(vec![Value::Array(vec![Value::Int(0), Value::Int(1)])]),
            Value::Array(vec![Value::Array(vec![Value::Int(0), Value::Int(1), node(0)])]),
        ] {
            assert!(parse_slots(&bad).is_err(), "{bad:?}");
        }
    }
}
