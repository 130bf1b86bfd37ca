//! Serves one compressed in-memory device until Ctrl-C / stdin closes.
//!
//! `cargo run -p tmem-nbd --example serve -- /tmp/tmem.sock 1073741824`
//! then e.g. `nbdinfo 'nbd+unix:///?socket=/tmp/tmem.sock'`.

use std::io::Read;
use std::sync::Arc;

use tmem_nbd::{Export, Listen, NbdConfig, ServerHandle};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let listen = match args.next() {
        Some(a) if a.contains(':') && !a.contains('/') => Listen::Tcp(a.parse()?),
        Some(a) => Listen::Unix(a.into()),
        None => Listen::Unix("/tmp/tmem-nbd.sock".into()),
    };
    let size: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(1 << 30);
    let mut store = tmem_core::StoreConfig::default();
    // A block device must take every page: keep incompressible ones raw.
    store.policy.incompressible = tmem_core::Incompressible::StoreRaw;
    let device =
        tmem_block::DeviceConfig { name: "disk".into(), size, store, tiers: None, recompress: None }.build()?;
    let export = Export::new("disk", Arc::new(device)).with_description("tmem compressed memory");
    let handle = ServerHandle::start(NbdConfig::new(vec![export], listen))?;
    eprintln!("serving {} (close stdin to stop)", handle.uri(""));
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    eprintln!("{}", serde_json::to_string_pretty(&handle.stats())?);
    handle.stop()?;
    Ok(())
}
