//! `--codec auto`: the codec a swap store gets from the front before it.
//!
//! With no front, every swap-in is a fault served by the daemon, so the
//! store compresses with lz4, the fastest. Behind a front (zram or zswap)
//! the kernel keeps the hot pages and answers their faults itself; what
//! reaches tmem is what the front wrote back, pages idle for an age, and a
//! put is the policy's writeback, off every fault path. There the store
//! takes zstd at level 3 with a trained dictionary: on the bench's job with
//! a cold part it held 0.78x zram lz4's peak pool where tmem lz4 held
//! 1.20x, and behind the zram front it was no slower than lz4 (docs/PRESSURE.md,
//! "tmem's codec behind a front"). The daemon resolves `auto` once the
//! front is chosen, before any store is built; the resolved codec is what
//! the state, the status and a successor see.

use tmem_core::codec::{CodecChoice, CodecError};
use tmem_front::Front;

/// The codec name that asks for the front's choice.
pub const AUTO: &str = "auto";
/// What `auto` is with no front: the fault path's codec.
pub const ALONE: &str = "lz4";
/// What `auto` is behind a front: the cold tier's codec.
pub const BEHIND_FRONT: &str = "zstd:3+dict";

/// The codec `codec` names with `front` before the store (`codec` itself
/// unless it is [`AUTO`]).
#[must_use]
pub fn resolve(codec: &str, front: Front) -> &str {
    match (codec, front) {
        (AUTO, Front::None) => ALONE,
        (AUTO, Front::Zram | Front::Zswap) => BEHIND_FRONT,
        (named, _) => named,
    }
}

/// Parses `codec` before the front is chosen (a flag, the config file, a
/// spec not yet resolved): `auto` parses as it would with no front; both
/// of its choices are codecs the store takes.
pub fn parse(codec: &str) -> Result<CodecChoice, CodecError> {
    CodecChoice::parse(resolve(codec, Front::None))
}

/// Why [`resolve`] picked what it did, for the setup's steps; `None` when
/// the codec was named.
#[must_use]
pub fn reason(codec: &str, front: Front) -> Option<String> {
    (codec == AUTO).then(|| match front {
        Front::None => format!("codec auto: {ALONE}, as no front is in front of tmem (the daemon serves every fault)"),
        f => format!(
            "codec auto: {BEHIND_FRONT}, as {} keeps the hot pages and tmem's pages are the ones it wrote back",
            f.as_str()
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_is_lz4_alone_and_dense_behind_either_front_and_a_named_codec_stays() {
        assert_eq!(resolve(AUTO, Front::None), "lz4");
        assert_eq!(resolve(AUTO, Front::Zram), "zstd:3+dict");
        assert_eq!(resolve(AUTO, Front::Zswap), "zstd:3+dict");
        for named in ["lz4", "zstd:9+dict", "raw"] {
            for f in [Front::None, Front::Zram, Front::Zswap] {
                assert_eq!(resolve(named, f), named);
                assert_eq!(reason(named, f), None);
            }
        }
        assert!(reason(AUTO, Front::Zswap).unwrap().contains("zswap keeps the hot pages"));
    }

    #[test]
    fn both_choices_are_codecs_the_store_takes() {
        for c in [ALONE, BEHIND_FRONT, AUTO] {
            parse(c).unwrap();
        }
        assert!(parse("gzip").is_err());
    }
}
