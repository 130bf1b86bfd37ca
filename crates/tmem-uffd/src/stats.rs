//! The counters of `tmem run`, defined once: `tmem stat --runs`, its JSON
//! and the Prometheus families `tmem_run_*` all come from these.

tmem_counters::counters! {
    /// What the engines of a run's processes did, summed over them.
    #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
    pub struct EngineStats {
        /// Faults served with a page of zeros (first touches).
        zero_fills: Counter(Pages),
        /// Faults served from the store.
        store_fills: Counter(Pages),
        /// Faults that moved an in-flight page straight back from its staging slot.
        slot_returns: Counter(Pages),
        /// Pages stored by eviction.
        evicted: Counter(Pages),
        /// Stored pages mapped ahead of a fault, next to the page it asked for.
        read_ahead: Counter(Pages),
        /// Pages never touched, filled with zeros ahead of a fault in a stream of first touches or of stored pages.
        zeros_ahead: Counter(Pages),
        /// Moves refused because the page was busy (shared after fork, pinned).
        move_busy: Counter(Pages),
        /// Pages the store refused; they went back to the program.
        put_refused: Counter(Pages),
        /// Stored pages dropped by the program's munmap or madvise.
        dropped_away: Counter(Pages),
        /// Present pages found by a scan of the maps that the engine had not mapped.
        adopted: Counter(Pages),
        /// Faults on pages the engine held as mapped, dropped by the program before the engine heard of it (zeros were served, as the kernel would).
        dropped_unseen: Counter(Pages),
        /// Present pages a scan found where the program had just dropped its memory, its zap still to come: not adopted.
        adopt_doomed: Counter(Pages),
        /// Present pages a scan found in a range the program unmapped or moved after the scan began (a new mapping there may not be registered yet): not adopted.
        adopt_unmapped: Counter(Pages),
        /// Unmaps of an mremap's source, which the kernel sends after the move: they kept the pages that later moves took to that place, and dropped the rest.
        unmap_after_move: Counter(Events),
    }
}

tmem_counters::counters! {
    /// One `tmem run` instance: its budget and where its pages are.
    #[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
    pub struct RunStats {
        extra {
            /// The pid of the `tmem run` process.
            pub pid: u32,
            /// The program it runs.
            pub program: String,
            /// What the engines did, over every process that joined.
            pub engine: EngineStats,
        }
        /// The most anonymous memory the program may keep resident (`--memory`).
        memory_limit_bytes: Max(Bytes),
        /// Pages a fault may take the program past the limit before it waits for eviction.
        slack_pages: Max(Pages),
        /// Pages of the program's anonymous memory resident now, over all its processes.
        resident_pages: Gauge(Pages),
        /// The most pages resident at once.
        resident_peak_pages: Max(Pages),
        /// Pages in the store now.
        stored_pages: Gauge(Pages),
        /// The most bytes the store's pool held.
        pool_peak_bytes: Max(Bytes),
        /// Processes managed now.
        processes: Gauge(Events),
        /// Threads serving the live processes' faults (they follow each process's thread count, up to the CPUs).
        fault_threads: Gauge(Events),
        /// Processes that joined and ended.
        processes_ended: Counter(Events),
        /// Pages a fault asked for that the store did not have (must stay 0).
        lost_pages: Counter(Pages),
        /// Times a process's faults had to wait for eviction to make room under the budget plus slack.
        room_waits: Counter(Events),
        /// Time faults spent waiting for room, summed over the processes' fault queues.
        room_wait_us: Counter(Micros),
        /// Time the evictor spent moving, reading and storing batches of victims.
        evict_us: Counter(Micros),
        /// Reads of a process's maps by the evictor's scans: every 20 ms while they change, backing off to every 320 ms while they do not.
        map_scans: Counter(Events),
    }
}
