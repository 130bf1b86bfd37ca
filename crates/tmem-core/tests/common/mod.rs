//! Pages shared by the store's integration tests.

use rand_xoshiro::rand_core::{RngCore, SeedableRng};
use rand_xoshiro::Xoshiro256PlusPlus;
use tmem_core::PAGE_SIZE;

/// One page of a test.
pub type Page = [u8; PAGE_SIZE];

/// Log-like text: every page different, neighbours alike; lz4 gets about
/// 2x, zstd noticeably more.
pub fn text_page(seed: u64) -> Page {
    const WORDS: [&str; 10] = [
        "GET /api/v1/items ",
        "200 ",
        "user=",
        "session=",
        "latency_ms=",
        "INFO ",
        "WARN ",
        "\n",
        "cache miss ",
        "ok ",
    ];
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut p = [0u8; PAGE_SIZE];
    let mut i = 0;
    while i < PAGE_SIZE {
        let x = rng.next_u64();
        let w = WORDS[usize::try_from(x % 10).unwrap()];
        let num = format!("{} ", x >> 44);
        for b in w.bytes().chain(num.bytes()) {
            if i == PAGE_SIZE {
                break;
            }
            p[i] = b;
            i += 1;
        }
    }
    p
}
