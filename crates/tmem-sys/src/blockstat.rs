//! `/sys/block/NAME/stat`: the reads a block device served, for timing the
//! reads back from the device below a front and for counting the pages a
//! front served itself.

use std::path::Path;

/// Reads of a block device since it appeared.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockReads {
    /// Read requests completed.
    pub ios: u64,
    /// 512-byte sectors read.
    pub sectors: u64,
    /// Milliseconds the requests spent, summed over them.
    pub ticks_ms: u64,
}

impl BlockReads {
    /// Now, for `/dev/NAME` (`None`: no such device, or an unreadable line).
    #[must_use]
    pub fn of(dev: &Path) -> Option<Self> {
        let name = dev.file_name()?.to_string_lossy().into_owned();
        Self::parse(&std::fs::read_to_string(format!("/sys/block/{name}/stat")).ok()?)
    }

    /// Parses a `stat` line: read I/Os first, read sectors third, read
    /// ticks (ms) fourth.
    #[must_use]
    pub fn parse(text: &str) -> Option<Self> {
        let f: Vec<u64> = text.split_whitespace().map(str::parse).collect::<Result<_, _>>().ok()?;
        Some(Self { ios: *f.first()?, sectors: *f.get(2)?, ticks_ms: *f.get(3)? })
    }

    /// 4 KiB pages read.
    #[must_use]
    pub fn pages(&self) -> u64 {
        self.sectors / 8
    }

    /// The mean time of a read since `before`, µs, and how many there were;
    /// `None` without reads.
    #[must_use]
    pub fn mean_since(&self, before: &Self) -> Option<(f64, u64)> {
        let ios = self.ios.checked_sub(before.ios).filter(|n| *n > 0)?;
        let ms = self.ticks_ms.saturating_sub(before.ticks_ms);
        Some((ms as f64 * 1000.0 / ios as f64, ios))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_give_pages_and_the_mean_read_time() {
        let before = BlockReads::parse("100 0 800 50 7 0 56 3 0 10 53 0 0 0 0 0 0").unwrap();
        assert_eq!(before, BlockReads { ios: 100, sectors: 800, ticks_ms: 50 });
        assert_eq!(before.pages(), 100);
        let after = BlockReads { ios: 1100, sectors: 8800, ticks_ms: 250 };
        assert_eq!(after.mean_since(&before), Some((200.0, 1000)));
        assert_eq!(before.mean_since(&before), None);
        assert_eq!(BlockReads::parse("1 2"), None);
        assert_eq!(BlockReads::parse("1 x 3 4"), None);
    }
}
