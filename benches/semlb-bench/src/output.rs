//! What a report produces: an aligned text table on stdout, a JSON file,
//! and a progress bar on stderr while it runs.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};

/// A text table: a header row and data rows, printed with aligned columns
/// (the first column left-aligned, the others right-aligned).
#[derive(Debug, Clone, Default)]
pub struct Table {
    /// Column titles.
    pub header: Vec<String>,
    /// Rows of cells (as many as the header).
    pub rows: Vec<Vec<String>>,
}

impl Table {
    /// An empty table with these column titles.
    pub fn new<S: Into<String>>(header: impl IntoIterator<Item = S>) -> Self {
        Self {
            header: header.into_iter().map(Into::into).collect(),
            rows: Vec::new(),
        }
    }

    /// Appends a row.
    pub fn row<S: Into<String>>(&mut self, cells: impl IntoIterator<Item = S>) {
        self.rows.push(cells.into_iter().map(Into::into).collect());
    }

    /// The table as text, one line per row, columns separated by two spaces.
    pub fn render(&self) -> String {
        let columns = self.header.len().max(self.rows.iter().map(Vec::len).max().unwrap_or(0));
        let mut width = vec![0; columns];
        for row in std::iter::once(&self.header).chain(&self.rows) {
            for (i, cell) in row.iter().enumerate() {
                width[i] = width[i].max(cell.chars().count());
            }
        }
        let mut out = String::new();
        let mut line = |row: &[String]| {
            let mut text = String::new();
            for (i, w) in width.iter().enumerate() {
                let cell = row.get(i).map_or("", String::as_str);
                let pad = w - cell.chars().count();
                if i > 0 {
                    text.push_str("  ");
                }
                if i == 0 {
                    text.push_str(cell);
                    text.extend(std::iter::repeat_n(' ', pad));
                } else {
                    text.extend(std::iter::repeat_n(' ', pad));
                    text.push_str(cell);
                }
            }
            out.push_str(text.trim_end());
            out.push('\n');
        };
        line(&self.header);
        line(&width.iter().map(|w| "-".repeat(*w)).collect::<Vec<_>>());
        for row in &self.rows {
            line(row);
        }
        out
    }
}

/// Prints `title` and `table` on stdout.
pub fn print_table(title: &str, table: &Table) {
    println!("\n{title}\n\n{}", table.render());
}

/// Writes `value` as pretty JSON to `<dir>/<name>.json` (creating `dir`) and
/// returns the path.
pub fn write_json(dir: &Path, name: &str, value: &serde_json::Value) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let path = dir.join(format!("{name}.json"));
    let text = serde_json::to_string_pretty(value)?;
    std::fs::write(&path, text + "\n").with_context(|| format!("cannot write {}", path.display()))?;
    Ok(path)
}

/// A progress bar on stderr of `len` steps (hidden when stderr is not a
/// terminal, so logs stay clean).
pub fn progress(len: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{msg:>24} [{bar:40}] {pos}/{len} ({elapsed}, eta {eta})")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    bar.set_message(what.to_owned());
    bar.enable_steady_tick(Duration::from_millis(250));
    bar
}

/// Value at quantile `q` (0..=1) of `sorted` (nearest rank), or 0 when empty.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Sorts `values` ascending (NaN last) for [`quantile`].
pub fn sort(values: &mut [f64]) {
    values.sort_by(f64::total_cmp);
}

/// Human duration of `ns` nanoseconds: `812 ns`, `4.21 µs`, `1.30 ms`, `2.05 s`.
pub fn human_ns(ns: f64) -> String {
    if ns < 1e3 {
        format!("{ns:.0} ns")
    } else if ns < 1e6 {
        format!("{:.2} µs", ns / 1e3)
    } else if ns < 1e9 {
        format!("{:.2} ms", ns / 1e6)
    } else {
        format!("{:.2} s", ns / 1e9)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_columns() {
        let mut t = Table::new(["store", "p50"]);
        t.row(["shm", "1.8 µs"]);
        t.row(["redis", "119 µs"]);
        assert_eq!(
            t.render(),
            "store     p50\n-----  ------\nshm    1.8 µs\nredis  119 µs\n"
        );
    }

    #[test]
    fn quantiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 50.0);
        assert_eq!(quantile(&v, 0.99), 99.0);
        assert_eq!(quantile(&v, 1.0), 100.0);
        assert_eq!(quantile(&v, 0.0), 1.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
    }

    #[test]
    fn durations_read_well() {
        assert_eq!(human_ns(812.0), "812 ns");
        assert_eq!(human_ns(4_210.0), "4.21 µs");
        assert_eq!(human_ns(1_300_000.0), "1.30 ms");
        assert_eq!(human_ns(2.05e9), "2.05 s");
    }
}
