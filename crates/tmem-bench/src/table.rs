//! Plain text tables for the benchmarks' reports (`comfy-table`).

use comfy_table::{presets, CellAlignment, ContentArrangement, Table};

/// A table without borders: the first column left-aligned, the others right.
#[must_use]
pub fn plain<S: ToString>(header: impl IntoIterator<Item = S>) -> Table {
    let mut t = Table::new();
    t.load_preset(presets::NOTHING).set_content_arrangement(ContentArrangement::Disabled).set_header(header);
    for c in t.column_iter_mut().skip(1) {
        c.set_cell_alignment(CellAlignment::Right);
    }
    t
}

#[cfg(test)]
mod tests {
    #[test]
    fn columns_line_up_and_numbers_are_right_aligned() {
        let mut t = super::plain(["name", "MB/s"]);
        t.add_row(["zram lz4", "438"]);
        t.add_row(["tmem", "1580"]);
        let s = t.to_string();
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines.len(), 3, "{s}");
        assert!(lines.iter().all(|l| l.trim_end().len() == lines[0].trim_end().len()), "{s}");
        assert!(lines[1].trim_end().ends_with(" 438") && lines[1].trim_start().starts_with("zram lz4"), "{s}");
    }
}
