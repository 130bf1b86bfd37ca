//! `tmem set DEVICE KEY=VALUE`: run-time changes to one device, checked
//! exactly as `tmem swap up` checks its flags.

use tmem_core::codec::CodecChoice;
use tmem_core::Store;
use tmem_core::{DictTraining, DictionaryCodec, MIN_TRAINING_PAGES};

use crate::spec::PoolLimit;
use crate::{human, DaemonError};

/// Knobs `tmem set` takes, as listed in errors.
pub const KNOBS: &str = "codec=lz4|zstd[:LEVEL][+dict], pool-limit=SIZE|N%, compact=now, frozen=0|1, \
incompressible=reject|store_raw, max_compressed_size=BYTES, accept_threshold_percent=N, compact_threshold_percent=N";

/// Store policy keys passed through as they are (the store checks their values).
const POLICY_KEYS: [&str; 5] =
    ["frozen", "incompressible", "max_compressed_size", "accept_threshold_percent", "compact_threshold_percent"];

/// Applies one `KEY=VALUE` to a device's store; returns what changed, in words.
pub fn set(store: &Store, key: &str, value: &str) -> Result<String, DaemonError> {
    let invalid = |e: &dyn std::fmt::Display| DaemonError::Invalid(format!("{key}={value}: {e}"));
    match key {
        "codec" => {
            let choice = CodecChoice::parse(value).map_err(|e| invalid(&e))?;
            let trained = if choice.dictionary {
                match store.use_dictionary_codec(&choice.codec, &DictTraining::default()).map_err(|e| invalid(&e))? {
                    DictionaryCodec::Trained(t) => {
                        format!(", with a {}-byte dictionary trained on {} stored pages", t.bytes, t.sample_pages)
                    }
                    DictionaryCodec::Deferred { pages, after_bytes } => format!(
                        " without a dictionary for now: {pages} stored pages are too few to train one on \
                         ({MIN_TRAINING_PAGES} at least); one is trained once the pool holds {}",
                        human(after_bytes)
                    ),
                }
            } else {
                store.use_codec_by_hand(&choice.codec).map_err(|e| invalid(&e))?;
                String::new()
            };
            Ok(format!("codec is now {}{trained} (stored pages keep their own codec)", store.codec_name()))
        }
        "pool-limit" | "pool_limit" => {
            let limit = value.parse::<PoolLimit>()?;
            crate::limits::pool_limit("pool-limit", limit, store.policy().config().total_ram_bytes)?;
            match limit {
                PoolLimit::Percent(p) => {
                    store.set_policy("max_pool_percent", &p.to_string()).map_err(|e| invalid(&e))?;
                    store.set_policy("max_pool_bytes", "0").map_err(|e| invalid(&e))?;
                }
                PoolLimit::Bytes(b) => store.set_policy("max_pool_bytes", &b.to_string()).map_err(|e| invalid(&e))?,
            }
            Ok(format!("pool limit is now {}", human(store.policy().limit_bytes())))
        }
        "compact" if value == "now" => Ok(format!("compacted: {} pages released", store.compact())),
        "compact" => Err(invalid(&"expected compact=now")),
        k if POLICY_KEYS.contains(&k) => {
            store.set_policy(key, value).map_err(|e| invalid(&e))?;
            Ok(format!("{key} = {value}"))
        }
        _ => Err(DaemonError::Invalid(format!("unknown knob {key:?}; knobs: {KNOBS}"))),
    }
}

#[cfg(test)]
mod tests {
    use tmem_block::{DeviceConfig, PoolDevice};

    use super::*;
    use crate::spec::{store_config, DeviceSpec};

    fn device() -> PoolDevice {
        let spec = DeviceSpec {
            name: "swap0".into(),
            size: 64 << 20,
            codec: "lz4".into(),
            pool_limit: PoolLimit::Percent(25),
            recompress: Default::default(),
            group: Default::default(),
        };
        let store = store_config(&spec, 8 << 30).unwrap();
        DeviceConfig { name: spec.name, size: spec.size, store, tiers: None, recompress: None }.build().unwrap()
    }

    /// Finding: `pool-limit=0%`, `pool-limit=1` and `compact=garbage` were accepted.
    #[test]
    fn set_checks_like_swap_up() {
        let d = device();
        let before = d.store().policy().limit_bytes();
        for (k, v) in [
            ("pool-limit", "0%"),
            ("pool-limit", "1"),
            ("pool-limit", "150%"),
            ("pool-limit", "9G"),
            ("compact", "garbage"),
            ("codec", "gzip"),
            ("frozen", "maybe"),
            ("max_pool_percent", "0"),
            ("total_ram_bytes", "0"),
            ("nonsense", "1"),
        ] {
            let e = set(d.store(), k, v).unwrap_err().to_string();
            assert!(e.contains(k) || e.contains(v), "{k}={v}: {e}");
        }
        assert_eq!(d.store().policy().limit_bytes(), before, "refused values change nothing");
        assert!(set(d.store(), "pool-limit", "2G").unwrap().contains("2.0 GiB"));
        assert!(set(d.store(), "pool-limit", "50%").unwrap().contains("4.0 GiB"));
        assert!(set(d.store(), "compact", "now").is_ok());
        assert!(set(d.store(), "frozen", "1").is_ok());
        assert!(set(d.store(), "codec", "zstd:3").unwrap().contains("zstd"));
    }

    /// Finding: `codec=zstd:3+dict` on a pool of 4 pages failed with zstd's
    /// "Src size is incorrect" (the soak smoke, CI stop 41).
    #[test]
    fn a_dictionary_codec_on_an_empty_pool_waits_for_pages() {
        let d = device();
        let said = set(d.store(), "codec", "zstd:3+dict").unwrap();
        assert_eq!(
            said,
            "codec is now zstd-3 without a dictionary for now: 0 stored pages are too few to train one on \
             (64 at least); one is trained once the pool holds 8.0 MiB (stored pages keep their own codec)"
        );
        assert_eq!(d.store().stats().dictionary.as_deref(), Some("waiting"));
    }
}
