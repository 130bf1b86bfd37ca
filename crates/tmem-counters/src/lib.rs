//! Counters defined once.
//!
//! A snapshot struct of counters is written with [`counters!`]: each counter
//! is one line, a field with its doc comment (the help text), its kind and
//! its unit. The macro makes the struct (plain `u64` fields, so `serde`
//! derives its JSON from the same field names), the list of definitions
//! ([`Counters::DEFS`]), the values in the same order, and the sum of two
//! snapshots. Tables (`tmem stat --counters`), `--json` and the Prometheus
//! exposition all read those, so a new counter is one line. Every counter
//! field is `#[serde(default)]`: the struct must derive a serde trait, and a
//! snapshot from a program that predates a counter still deserializes.
//!
//! ```
//! tmem_counters::counters! {
//!     /// Counters of a cache.
//!     #[derive(Clone, Debug, Default, serde::Serialize)]
//!     pub struct CacheStats {
//!         extra {
//!             /// Cache name.
//!             pub name: String,
//!         }
//!         /// Lookups that found their page.
//!         hits: Counter(Events),
//!         /// Bytes held now.
//!         held_bytes: Gauge(Bytes),
//!     }
//! }
//! use tmem_counters::Counters;
//! let s = CacheStats { name: "c".into(), hits: 3, held_bytes: 4096 };
//! let names: Vec<_> = s.values().map(|(d, v)| (d.name, v)).collect();
//! assert_eq!(names, [("hits", 3), ("held_bytes", 4096)]);
//! ```

/// How a counter behaves over time, and how two snapshots combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Only grows (events, bytes moved); snapshots add up.
    Counter,
    /// Goes up and down (pages held, bytes used); snapshots add up.
    Gauge,
    /// A level such as a latency quantile or a limit; two snapshots combine
    /// as the larger.
    Max,
}

/// What a counter counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    /// Events: requests, puts, rejects, runs.
    Events,
    /// 4 KiB pages.
    Pages,
    /// Bytes.
    Bytes,
    /// Microseconds.
    Micros,
    /// Objects other than pages (allocator objects, values).
    Objects,
}

impl Unit {
    /// Short name for tables.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::Events => "events",
            Self::Pages => "pages",
            Self::Bytes => "bytes",
            Self::Micros => "us",
            Self::Objects => "objects",
        }
    }
}

/// One counter's definition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Def {
    /// Field name, also its JSON key (zswap's, zram's or frontswap's name where the meaning is the same).
    pub name: &'static str,
    /// Counter, gauge or level.
    pub kind: Kind,
    /// What it counts.
    pub unit: Unit,
    /// One line of help: the field's doc comment.
    pub help: &'static str,
}

impl Def {
    /// The help text without the doc comment's leading space.
    #[must_use]
    pub fn help(&self) -> &'static str {
        self.help.trim()
    }
}

/// A snapshot struct made by [`counters!`].
pub trait Counters {
    /// Every counter of the struct, in field order.
    const DEFS: &'static [Def];

    /// Every counter's value, in the order of [`Self::DEFS`], with its definition.
    fn values(&self) -> impl Iterator<Item = (&'static Def, u64)> + '_;

    /// Adds (or, for [`Kind::Max`], takes the larger of) `other`'s counters into `self`'s.
    fn add_counters(&mut self, other: &Self);
}

/// Defines a snapshot struct of `u64` counters; see the crate documentation.
///
/// Fields that are not counters (names, ids, nested snapshots) go first in an
/// `extra { ... }` block, written as ordinary fields. Each counter is
/// `/// help` then `name: Kind(Unit),` with [`Kind`] and [`Unit`] variants.
#[macro_export]
macro_rules! counters {
    (
        $(#[$smeta:meta])*
        $svis:vis struct $name:ident {
            $(extra {
                $( $(#[$emeta:meta])* $evis:vis $efield:ident : $ety:ty ),* $(,)?
            })?
            $( $(#[doc = $doc:literal])+ $field:ident : $kind:ident ( $unit:ident ) ),* $(,)?
        }
    ) => {
        $(#[$smeta])*
        $svis struct $name {
            $($( $(#[$emeta])* $evis $efield : $ety, )*)?
            // A counter absent from the JSON reads as 0, so a newer client
            // reads an older daemon's snapshot, which lacks the counters
            // added since.
            $( $(#[doc = $doc])+ #[serde(default)] pub $field : u64, )*
        }

        impl $crate::Counters for $name {
            const DEFS: &'static [$crate::Def] = &[
                $( $crate::Def {
                    name: stringify!($field),
                    kind: $crate::Kind::$kind,
                    unit: $crate::Unit::$unit,
                    help: concat!($($doc),+),
                } ),*
            ];

            fn values(&self) -> impl Iterator<Item = (&'static $crate::Def, u64)> + '_ {
                Self::DEFS.iter().zip([$( self.$field ),*])
            }

            fn add_counters(&mut self, other: &Self) {
                $( $crate::combine(&mut self.$field, other.$field, $crate::Kind::$kind); )*
            }
        }
    };
}

/// Combines one counter of two snapshots (used by [`counters!`]).
pub fn combine(into: &mut u64, other: u64, kind: Kind) {
    *into = match kind {
        Kind::Counter | Kind::Gauge => into.saturating_add(other),
        Kind::Max => (*into).max(other),
    };
}

#[cfg(test)]
mod tests {
    use super::{Counters, Kind, Unit};

    crate::counters! {
        /// Test counters.
        #[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
        pub struct T {
            extra {
                /// Name.
                #[serde(skip_serializing_if = "String::is_empty")]
                pub name: String,
            }
            /// Puts.
            /// Two lines of help.
            puts: Counter(Events),
            /// Bytes held.
            held: Gauge(Bytes),
            /// p99 latency.
            p99_us: Max(Micros),
        }
    }

    #[test]
    fn definitions_follow_the_fields() {
        let names: Vec<_> = T::DEFS.iter().map(|d| (d.name, d.kind, d.unit)).collect();
        assert_eq!(
            names,
            [
                ("puts", Kind::Counter, Unit::Events),
                ("held", Kind::Gauge, Unit::Bytes),
                ("p99_us", Kind::Max, Unit::Micros)
            ]
        );
        assert_eq!(T::DEFS[0].help(), "Puts. Two lines of help.");
    }

    #[test]
    fn values_sum_and_json_come_from_the_same_fields() {
        let mut a = T { name: "a".into(), puts: 1, held: 10, p99_us: 7 };
        a.add_counters(&T { name: "b".into(), puts: 2, held: 5, p99_us: 3 });
        assert_eq!(a.values().map(|(_, v)| v).collect::<Vec<_>>(), [3, 15, 7]);
        assert_eq!(a.name, "a", "extra fields are left alone");
        let json = serde_json::to_value(&a).unwrap();
        for (d, v) in a.values() {
            assert_eq!(json[d.name], v, "{}", d.name);
        }
    }

    #[test]
    fn a_snapshot_without_newer_counters_reads_them_as_zero() {
        let old: T = serde_json::from_str(r#"{"name":"old","puts":5}"#).unwrap();
        assert_eq!(old, T { name: "old".into(), puts: 5, held: 0, p99_us: 0 });
        let err = serde_json::from_str::<T>(r#"{"puts":5}"#).unwrap_err();
        assert!(err.to_string().contains("name"), "extra fields stay required: {err}");
    }
}
