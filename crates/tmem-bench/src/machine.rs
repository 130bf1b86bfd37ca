//! The machine a bench ran on, as every report and JSON file states it.

use tmem_sys::cgroup::Layout;

/// Kernel, cgroup layout, CPUs and RAM.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Machine {
    /// `uname -r`.
    pub kernel: String,
    /// `v1`, `v2` or `hybrid`.
    pub cgroup_layout: &'static str,
    /// Online CPUs.
    pub cpus: usize,
    /// RAM.
    pub mem_total_bytes: u64,
}

impl Machine {
    /// This machine, whose cgroups are laid out as `layout`.
    #[must_use]
    pub fn of(layout: &Layout) -> Self {
        Self::with_layout(layout.name())
    }

    /// This machine, its cgroup layout detected (`unknown` where none is mounted).
    #[must_use]
    pub fn here() -> Self {
        Self::with_layout(Layout::detect().map_or("unknown", |l| l.name()))
    }

    fn with_layout(cgroup_layout: &'static str) -> Self {
        Self {
            kernel: crate::pressure::cmd("uname", &["-r"]).unwrap_or_default(),
            cgroup_layout,
            cpus: std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
            mem_total_bytes: tmem_sys::swap::total_ram_bytes().unwrap_or(0),
        }
    }
}
