//! tmem's benchmarks, each measured against the kernel on the same machine in
//! the same run: the store against zram on the same real pages ([`store`]),
//! the tiers on loopback ([`tier`]), and the zcache/RAMster memory-pressure
//! ladder against disk swap, zram and zswap ([`pressure`]). The `tmem bench`
//! subcommands call them; [`zram`] is the kernel-side harness of the store
//! benchmark and [`redis`] starts the throwaway servers of the remote tier.

pub mod pressure;
pub mod redis;
pub mod store;
pub mod tier;
pub mod zram;
