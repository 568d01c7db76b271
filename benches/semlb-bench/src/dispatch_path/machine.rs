//! The metadata of a run that `dispatch` and `scaling` write into their
//! JSON: the date, the cores, the CPU model and the OS it ran on.

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

/// `YYYY-MM-DDThh:mm:ssZ` of `secs` seconds since the Unix epoch.
pub fn iso_utc(secs: u64) -> String {
    let at = i64::try_from(secs)
        .ok()
        .and_then(|s| chrono::DateTime::from_timestamp(s, 0));
    at.unwrap_or_default().format("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// The machine a report ran on: date, cores, CPU model, OS.
pub fn machine() -> Value {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let cpu = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|s| {
        s.lines().find_map(|l| {
            l.strip_prefix("model name")
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_owned())
        })
    });
    json!({
        "date": iso_utc(secs),
        "cores": cores(),
        "cpu": cpu,
        "os": std::env::consts::OS,
        "arch": std::env::consts::ARCH,
    })
}

/// Cores this process may use.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_iso_utc() {
        assert_eq!(iso_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(iso_utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(iso_utc(1_795_000_000), "2026-11-18T11:06:40Z");
    }
}
