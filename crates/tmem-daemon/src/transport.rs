//! How the kernel reaches the devices (`tmem swap up --transport`), and
//! which one `auto` picks.
//!
//! - `nbd`: the kernel's NBD client (`nbd.ko`) on sessions of the daemon,
//!   set up over netlink ([`tmem_nbd::kernel`]): no loop device and no
//!   filesystem between the block layer and the store.
//! - `fuse`: a loop device (direct I/O) on the device's file in the
//!   daemon's FUSE mount; every kernel has it.
//!
//! `auto` is FUSE + loop: in a Debian 13 guest (the only kernels with
//! `nbd.ko` at hand, under TCG) the NBD transport cost more machine CPU per
//! swapped page and more wall time than FUSE + loop (docs/PRESSURE.md, "The
//! NBD transport"), so it is taken only by name until a measurement at
//! native speed says otherwise. ublk is not offered yet.

use std::fmt;
use std::str::FromStr;

/// The transport asked for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// The default: FUSE + loop (see the module docs).
    #[default]
    Auto,
    /// A loop device on a FUSE file.
    Fuse,
    /// The kernel's NBD client.
    Nbd,
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Transport::Auto => "auto",
            Transport::Fuse => "fuse",
            Transport::Nbd => "nbd",
        })
    }
}

impl FromStr for Transport {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Transport::Auto),
            "fuse" => Ok(Transport::Fuse),
            "nbd" => Ok(Transport::Nbd),
            other => Err(format!("unknown transport {other:?} (auto, fuse or nbd)")),
        }
    }
}

/// The transport to use for `asked` and why, or why `nbd` (asked by name)
/// cannot be had. `nbd_here` says whether the kernel's NBD client answers
/// (loading the module if it can), or why not.
pub fn choose(asked: Transport, nbd_here: impl FnOnce() -> Result<(), String>) -> Result<(Transport, String), String> {
    match asked {
        Transport::Fuse => Ok((Transport::Fuse, "asked for (--transport fuse)".into())),
        Transport::Nbd => match nbd_here() {
            Ok(()) => Ok((Transport::Nbd, "asked for (--transport nbd)".into())),
            Err(why) => Err(format!("--transport nbd: {why}")),
        },
        Transport::Auto => Ok((
            Transport::Fuse,
            "auto: FUSE + loop (the NBD transport, slower where measured, only by name: --transport nbd)".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_print_back() {
        for t in [Transport::Auto, Transport::Fuse, Transport::Nbd] {
            assert_eq!(t.to_string().parse::<Transport>(), Ok(t));
        }
        let e = "ublk".parse::<Transport>().unwrap_err();
        assert!(e.contains("\"ublk\"") && e.contains("auto, fuse or nbd"), "{e}");
    }

    #[test]
    fn nbd_by_name_is_taken_where_it_answers_and_fails_with_the_reason_elsewhere() {
        let (t, why) = choose(Transport::Nbd, || Ok(())).unwrap();
        assert_eq!((t, why.as_str()), (Transport::Nbd, "asked for (--transport nbd)"));
        let e = choose(Transport::Nbd, || Err("no nbd netlink family".into())).unwrap_err();
        assert!(e.contains("--transport nbd") && e.contains("no nbd netlink family"), "{e}");
    }

    #[test]
    fn auto_and_fuse_take_fuse_without_asking_the_kernel_and_say_why() {
        for asked in [Transport::Auto, Transport::Fuse] {
            let (t, why) = choose(asked, || panic!("asked")).unwrap();
            assert_eq!(t, Transport::Fuse);
            assert!(why.starts_with(&asked.to_string()) || why.contains("--transport fuse"), "{why}");
        }
    }
}
