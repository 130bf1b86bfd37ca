//! The block conformance suite through the kernel, on a fresh transport
//! device of at least 1 MiB that reads as zeros (a cache over a sparse
//! file, say): `node_conformance /dev/ublkb0`. The Debian VM test runs it
//! on each transport (scripts/vm/transports.sh).

use std::path::PathBuf;

fn main() -> std::process::ExitCode {
    let Some(node) = std::env::args_os().nth(1).map(PathBuf::from) else {
        eprintln!("usage: node_conformance NODE (a block device that reads as zeros, at least 1 MiB)");
        return std::process::ExitCode::from(2);
    };
    let dev = match tmem_block::NodeDevice::open(&node) {
        Ok(dev) => dev,
        Err(e) => {
            eprintln!("{}: {e}", node.display());
            return std::process::ExitCode::FAILURE;
        }
    };
    // The suite panics, naming the operation, on the first difference.
    tmem_block::conformance::check_data(&dev);
    println!("{}: the block conformance suite passed through the kernel", node.display());
    std::process::ExitCode::SUCCESS
}
