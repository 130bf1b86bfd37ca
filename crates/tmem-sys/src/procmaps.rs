//! `/proc/PID/maps`: its lines, and which mappings are private anonymous
//! memory. Shared by `tmem corpus` (what it captures) and `tmem run` (what
//! it registers).

/// Splits a `/proc/PID/maps` line into (start, end, perms, pathname).
pub fn parse_line(line: &str) -> Option<(u64, u64, &str, &str)> {
    // "start-end perms offset dev inode          pathname"
    let mut fields = line.splitn(6, ' ');
    let range = fields.next()?;
    let perms = fields.next()?;
    let _offset = fields.next()?;
    let _dev = fields.next()?;
    let _inode = fields.next()?;
    let name = fields.next().unwrap_or("").trim_start();
    let (start, end) = range.split_once('-')?;
    let start = u64::from_str_radix(start, 16).ok()?;
    let end = u64::from_str_radix(end, 16).ok()?;
    if perms.len() != 4 || end < start {
        return None;
    }
    Some((start, end, perms, name))
}

/// Private + readable + writable, and anonymous (no file behind it): the
/// memory that the kernel swaps, tmem captures (`tmem corpus`) and `tmem run` manages.
pub fn is_private_anonymous(perms: &str, name: &str) -> bool {
    let p = perms.as_bytes();
    let private_rw = p.len() == 4 && p[0] == b'r' && p[1] == b'w' && p[3] == b'p';
    let anonymous = name.is_empty()
        || name == "[heap]"
        || name == "[stack]"
        || name.starts_with("[stack:")
        || name.starts_with("[anon:");
    private_rw && anonymous
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines_parse_and_anonymous_ones_are_told_apart() {
        let l = "7f1c2a000000-7f1c2a021000 rw-p 00000000 00:00 0 ";
        assert_eq!(parse_line(l), Some((0x7f1c_2a00_0000, 0x7f1c_2a02_1000, "rw-p", "")));
        let l = "55d0c3a8a000-55d0c3aab000 rw-p 00000000 00:00 0                          [heap]";
        let (_, _, p, n) = parse_line(l).unwrap();
        assert!(is_private_anonymous(p, n));
        let l = "7f00-8f00 r--p 00000000 08:01 1234                 /usr/lib/libc.so.6";
        let (_, _, p, n) = parse_line(l).unwrap();
        assert!(!is_private_anonymous(p, n));
        let l = "7f00-8f00 rw-p 00001000 08:01 1234   /usr/lib/with space.so (deleted)";
        let (_, _, p, n) = parse_line(l).unwrap();
        assert_eq!(n, "/usr/lib/with space.so (deleted)");
        assert!(!is_private_anonymous(p, n));
        assert!(is_private_anonymous("rw-p", "[stack]"));
        assert!(is_private_anonymous("rwxp", "[anon:jit]"));
        assert!(!is_private_anonymous("rw-s", ""));
        assert!(!is_private_anonymous("r--p", ""));
        assert!(!is_private_anonymous("---p", ""));
        assert!(!is_private_anonymous("rw-p", "[vvar]"));
        assert!(parse_line("garbage").is_none());
        assert!(parse_line("zz-10 rw-p 0 0:0 0").is_none());
    }
}
