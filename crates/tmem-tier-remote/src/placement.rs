//! Rendezvous (highest-random-weight) placement, key names and RESP size
//! estimates.

use std::fmt::Write as _;

use redis::Value;
use tmem_tier::TierKey;

/// The splitmix64 finalizer: a bijective 64-bit mixer.
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Hash of a tier key, stable across runs and machines.
pub(crate) fn key_hash(k: TierKey) -> u64 {
    let h = mix64(u64::from(k.pool) ^ 0x7465_6d2d_7265_6d6f);
    let h = mix64(h ^ k.object);
    mix64(h.rotate_left(17) ^ k.index)
}

/// Seed of a node for rendezvous hashing, from its identity (URL without credentials).
pub(crate) fn node_seed(identity: &str) -> u64 {
    // FNV-1a, then mixed.
    let h = identity.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    mix64(h)
}

/// Weight of `node_seed` for a key hash: the highest weight wins.
fn weight(node_seed: u64, kh: u64) -> u64 {
    mix64(mix64(kh ^ node_seed) ^ node_seed.rotate_left(32))
}

/// Node indices in rendezvous order for a key (highest weight first); ties,
/// which need a 64-bit collision, go to the lower index.
pub(crate) fn rendezvous(seeds: &[u64], kh: u64) -> Vec<usize> {
    let mut w: Vec<(u64, usize)> = seeds.iter().enumerate().map(|(i, s)| (weight(*s, kh), i)).collect();
    w.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    w.into_iter().map(|(_, i)| i).collect()
}

/// Bit of node `n` in a node mask.
pub(crate) fn bit(n: usize) -> u64 {
    1u64 << n
}

/// Nodes in a mask.
pub(crate) fn count(mask: u64) -> usize {
    mask.count_ones() as usize
}

/// `tmem:{cluster}:{host}:` — the namespace of one tier instance.
pub(crate) fn prefix(cluster_id: &str, host_id: &str) -> String {
    format!("tmem:{cluster_id}:{host_id}:")
}

/// `{prefix}{pool}:{object:x}:{index:x}`.
pub(crate) fn key_name(prefix: &str, k: TierKey) -> String {
    let mut s = String::with_capacity(prefix.len() + 40);
    s.push_str(prefix);
    let _ = write!(s, "{}:{:x}:{:x}", k.pool, k.object, k.index);
    s
}

fn decimal_len(mut n: usize) -> u64 {
    let mut d = 1;
    while n >= 10 {
        n /= 10;
        d += 1;
    }
    d
}

fn usize_u64(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// Bytes of one RESP-encoded command with arguments of the given lengths
/// (`*n\r\n` then `$len\r\n<arg>\r\n` per argument).
pub(crate) fn resp_cmd_len(arg_lens: &[usize]) -> u64 {
    let head = 3 + decimal_len(arg_lens.len());
    arg_lens.iter().fold(head, |acc, &l| acc + 1 + decimal_len(l) + 2 + usize_u64(l) + 2)
}

/// Bytes of a RESP reply as the server sent it (RESP2 framing; an estimate for RESP3 types).
pub(crate) fn resp_value_len(v: &Value) -> u64 {
    match v {
        Value::Nil => 5,
        Value::Int(i) => 3 + usize_u64(i.to_string().len()),
        Value::BulkString(b) => 1 + decimal_len(b.len()) + 2 + usize_u64(b.len()) + 2,
        Value::Array(items) | Value::Set(items) => {
            3 + decimal_len(items.len()) + items.iter().map(resp_value_len).sum::<u64>()
        }
        Value::Map(pairs) => {
            3 + decimal_len(pairs.len()) + pairs.iter().map(|(k, v)| resp_value_len(k) + resp_value_len(v)).sum::<u64>()
        }
        Value::SimpleString(s) => 3 + usize_u64(s.len()),
        Value::Okay => 5,
        Value::ServerError(e) => 3 + usize_u64(e.code().len() + e.details().map_or(0, |d| d.len() + 1)),
        _ => 16,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resp_sizes_match_the_encoding() {
        let mut c = redis::cmd("SET");
        c.arg("tmem:c:h:1:2:3").arg(vec![7u8; 4096]);
        assert_eq!(resp_cmd_len(&[3, 14, 4096]), u64::try_from(c.get_packed_command().len()).unwrap());
        let mut c = redis::cmd("GET");
        c.arg("k");
        assert_eq!(resp_cmd_len(&[3, 1]), u64::try_from(c.get_packed_command().len()).unwrap());
        assert_eq!(resp_value_len(&Value::BulkString(vec![0; 12])), "$12\r\n".len() as u64 + 14);
        assert_eq!(resp_value_len(&Value::Int(1)), 4);
    }

    #[test]
    fn rendezvous_is_stable_and_balanced() {
        let seeds: Vec<u64> = (0..5).map(|i| node_seed(&format!("redis://10.0.0.{i}:6379"))).collect();
        let mut first = [0usize; 5];
        for i in 0..10_000u64 {
            let k = TierKey { pool: 1, object: i / 100, index: i };
            let o = rendezvous(&seeds, key_hash(k));
            assert_eq!(o, rendezvous(&seeds, key_hash(k)));
            let mut s = o.clone();
            s.sort_unstable();
            assert_eq!(s, vec![0, 1, 2, 3, 4]);
            first[o[0]] += 1;
            // Removing a node keeps the relative order of the others (minimal movement).
            let without: Vec<usize> = rendezvous(&seeds[..4], key_hash(k));
            let filtered: Vec<usize> = o.iter().copied().filter(|&n| n < 4).collect();
            assert_eq!(without, filtered);
        }
        for f in first {
            assert!((1700..2300).contains(&f), "unbalanced: {first:?}");
        }
    }

    #[test]
    fn key_names() {
        let p = prefix("c1", "h1");
        assert_eq!(key_name(&p, TierKey { pool: 7, object: 255, index: 16 }), "tmem:c1:h1:7:ff:10");
    }
}
