//! Aligned text columns, the one layout every table of the report uses.
//!
//! Owns only the alignment; which columns a table has, and their cells, are
//! the table's own (`table.rs`, `sweep.rs`, `trace.rs`).

use std::fmt::Write;

/// Writes `headers` and `rows` as aligned columns: the first left-aligned,
/// the others right-aligned, two spaces apart, no trailing blanks. Shared by
/// the per-scenario tables, the sweep table and the trace figures, so all
/// line up alike.
pub(crate) fn write_aligned(out: &mut String, headers: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.len());
        }
    }
    let line = |cells: &[String]| -> String {
        let mut s = String::new();
        for (i, (c, w)) in cells.iter().zip(&widths).enumerate() {
            if i == 0 {
                let _ = write!(s, "{c:<w$}");
            } else {
                let _ = write!(s, "  {c:>w$}");
            }
        }
        s.trim_end().to_string()
    };
    let head: Vec<String> = headers.iter().map(|h| h.to_string()).collect();
    let _ = writeln!(out, "{}", line(&head));
    for row in rows {
        let _ = writeln!(out, "{}", line(row));
    }
}
