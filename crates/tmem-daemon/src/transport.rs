//! How the kernel reaches the devices (`tmem swap up --transport`), and
//! which one `auto` picks.
//!
//! - `ublk`: the kernel's ublk driver (`ublk_drv`, Linux 6.0+) hands block
//!   requests to queue threads of the daemon through io_uring
//!   ([`tmem_ublk`]): no loop device, no filesystem, no socket.
//! - `nbd`: the kernel's NBD client (`nbd.ko`) on sessions of the daemon,
//!   set up over netlink ([`tmem_nbd::kernel`]): no loop device and no
//!   filesystem between the block layer and the store.
//! - `fuse`: a loop device (direct I/O) on the device's file in the
//!   daemon's FUSE mount; every kernel has it.
//!
//! `auto` takes ublk where `/dev/ublk-control` opens (after `modprobe
//! ublk_drv`), else FUSE + loop. NBD is taken only by name: in a Debian 13
//! guest (the only kernels with `nbd.ko` at hand, under TCG) it cost more
//! machine CPU per swapped page and more wall time than FUSE + loop, and
//! ublk less than both (docs/PRESSURE.md, "Transports").

use std::fmt;
use std::str::FromStr;

/// The transport asked for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// The default: ublk where the kernel has it, else FUSE + loop.
    #[default]
    Auto,
    /// A loop device on a FUSE file.
    Fuse,
    /// The kernel's NBD client.
    Nbd,
    /// The kernel's ublk driver.
    Ublk,
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Transport::Auto => "auto",
            Transport::Fuse => "fuse",
            Transport::Nbd => "nbd",
            Transport::Ublk => "ublk",
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
            "ublk" => Ok(Transport::Ublk),
            other => Err(format!("unknown transport {other:?} (auto, ublk, nbd or fuse)")),
        }
    }
}

/// What the kernel offers: each says whether its driver answers (loading
/// the module if it can), or why not. Asked only when needed.
pub struct Kernel<U, N> {
    /// ublk (`/dev/ublk-control`).
    pub ublk: U,
    /// The NBD client's netlink family.
    pub nbd: N,
}

/// The transport to use for `asked` and why, or why the one asked by name
/// cannot be had.
pub fn choose<U, N>(asked: Transport, kernel: Kernel<U, N>) -> Result<(Transport, String), String>
where
    U: FnOnce() -> Result<(), String>,
    N: FnOnce() -> Result<(), String>,
{
    let by_name = |t: Transport, here: Result<(), String>| match here {
        Ok(()) => Ok((t, format!("asked for (--transport {t})"))),
        Err(why) => Err(format!("--transport {t}: {why}")),
    };
    match asked {
        Transport::Fuse => Ok((Transport::Fuse, "asked for (--transport fuse)".into())),
        Transport::Nbd => by_name(Transport::Nbd, (kernel.nbd)()),
        Transport::Ublk => by_name(Transport::Ublk, (kernel.ublk)()),
        Transport::Auto => match (kernel.ublk)() {
            Ok(()) => Ok((Transport::Ublk, "auto: the kernel has ublk".into())),
            Err(why) => Ok((
                Transport::Fuse,
                format!(
                    "auto: FUSE + loop, as there is no ublk here ({why}); NBD, slower where measured, only by name"
                ),
            )),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel(
        ublk: Result<(), &'static str>,
        nbd: Result<(), &'static str>,
    ) -> Kernel<impl FnOnce() -> Result<(), String>, impl FnOnce() -> Result<(), String>> {
        Kernel { ublk: move || ublk.map_err(String::from), nbd: move || nbd.map_err(String::from) }
    }

    fn never() -> Kernel<impl FnOnce() -> Result<(), String>, impl FnOnce() -> Result<(), String>> {
        Kernel { ublk: || panic!("asked for ublk"), nbd: || panic!("asked for nbd") }
    }

    #[test]
    fn names_parse_and_print_back() {
        for t in [Transport::Auto, Transport::Fuse, Transport::Nbd, Transport::Ublk] {
            assert_eq!(t.to_string().parse::<Transport>(), Ok(t));
        }
        let e = "loop".parse::<Transport>().unwrap_err();
        assert!(e.contains("\"loop\"") && e.contains("auto, ublk, nbd or fuse"), "{e}");
    }

    #[test]
    fn a_transport_by_name_is_taken_where_it_answers_and_fails_with_the_reason_elsewhere() {
        let (t, why) = choose(Transport::Nbd, kernel(Err("x"), Ok(()))).unwrap();
        assert_eq!((t, why.as_str()), (Transport::Nbd, "asked for (--transport nbd)"));
        let e = choose(Transport::Nbd, kernel(Ok(()), Err("no nbd netlink family"))).unwrap_err();
        assert!(e.contains("--transport nbd") && e.contains("no nbd netlink family"), "{e}");
        let (t, why) = choose(Transport::Ublk, kernel(Ok(()), Err("x"))).unwrap();
        assert_eq!((t, why.as_str()), (Transport::Ublk, "asked for (--transport ublk)"));
        let e = choose(Transport::Ublk, kernel(Err("/dev/ublk-control: No such file"), Ok(()))).unwrap_err();
        assert!(e.contains("--transport ublk") && e.contains("/dev/ublk-control"), "{e}");
    }

    #[test]
    fn auto_takes_ublk_where_it_answers_else_fuse_with_the_reason_and_never_nbd() {
        let (t, why) = choose(Transport::Auto, Kernel { ublk: || Ok(()), nbd: || panic!("asked for nbd") }).unwrap();
        assert_eq!((t, why.as_str()), (Transport::Ublk, "auto: the kernel has ublk"));
        let (t, why) =
            choose(Transport::Auto, Kernel { ublk: || Err("/dev/ublk-control: gone".into()), nbd: || panic!("nbd") })
                .unwrap();
        assert_eq!(t, Transport::Fuse);
        assert!(why.starts_with("auto: FUSE + loop") && why.contains("/dev/ublk-control: gone"), "{why}");
    }

    #[test]
    fn fuse_takes_fuse_without_asking_the_kernel() {
        let (t, why) = choose(Transport::Fuse, never()).unwrap();
        assert_eq!((t, why.as_str()), (Transport::Fuse, "asked for (--transport fuse)"));
    }
}
