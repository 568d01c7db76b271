//! The `semlb serve` configuration of a replay run: the gateway's
//! time-based parameters scaled by the speedup.
//!
//! The engines run X times faster than simulated time, so everything the
//! gateway measures or waits for in real time is X times shorter too:
//!
//! | key | value | why |
//! | --- | --- | --- |
//! | `health.scrape_interval_ms` | max(10, 1000 / X) | the engines' load is read once per trace second, as with the default at X = 1 (10 ms is the smallest the gateway accepts) |
//! | `health.stale_after_ms` | max(scrape interval, 5000 / X) | the default 5 trace seconds |
//! | `policy.dual_map.prefill_tokens_per_sec` | 10 000 × X | the engines' prefill rate in real time |
//! | `policy.dual_map.ttft_slo_ms` | SLO × 1000 / X | the workload's TTFT objective in real time |
//! | `policy.queue.max_wait_ms` | max(60 000, 600 000 / X) | a queued request waits at most 10 trace minutes, and never less than a real minute |

use crate::workload::engine_prefill_tokens_per_s;

/// The configuration file's text for a run at `speedup` X with a TTFT
/// objective of `ttft_slo_s` trace seconds.
pub(super) fn gateway_config(speedup: f64, ttft_slo_s: f64) -> String {
    let real_ms = |trace_ms: f64| (trace_ms / speedup).round() as u64;
    let scrape = real_ms(1000.0).max(10);
    let stale = real_ms(5000.0).max(scrape);
    format!(
        "[health]\nscrape_interval_ms = {scrape}\nstale_after_ms = {stale}\n\n\
         [policy.dual_map]\nprefill_tokens_per_sec = {}\nttft_slo_ms = {}\n\n\
         [policy.queue]\nmax_wait_ms = {}\n",
        (engine_prefill_tokens_per_s() * speedup).round() as u64,
        real_ms(ttft_slo_s * 1000.0).max(1),
        real_ms(600_000.0).max(60_000),
    )
}

/// `base` with `extra`'s keys put in, table by table (a key of both:
/// `extra`'s value; a table of both: merged the same way), as TOML text.
/// A row's own settings (a variant's file, a mode) may so name a table
/// the run already writes, such as `[policy.dual_map]`.
pub(super) fn merged(base: &str, extra: &str) -> Result<String, toml::de::Error> {
    fn merge(into: &mut toml::Table, from: toml::Table) {
        for (key, value) in from {
            match (into.get_mut(&key), value) {
                (Some(toml::Value::Table(old)), toml::Value::Table(new)) => merge(old, new),
                (_, value) => {
                    into.insert(key, value);
                }
            }
        }
    }
    let mut table: toml::Table = base.parse()?;
    merge(&mut table, extra.parse()?);
    Ok(table.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rows_settings_are_merged_into_the_runs_tables() {
        let base = gateway_config(1.0, 1.0);
        let text = merged(
            &format!("learn_at_dispatch = false\n{base}"),
            "\n[policy.dual_map]\nmax_pending = 4\n[policy.cost]\ntune = false\n",
        )
        .unwrap();
        let config = semlb::config::ServeConfig::from_toml(
            &format!("{text}\n[[backend]]\nurl = \"http://127.0.0.1:1\"\n"),
            std::path::Path::new("replay.toml"),
        )
        .unwrap();
        config.validate().unwrap();
        let p = &config.policy;
        // The row's key, the run's scaled ones beside it, a new table, a top-level key.
        assert_eq!(
            (
                p.dual_map.max_pending,
                p.dual_map.ttft_slo_ms,
                p.dual_map.prefill_tokens_per_sec
            ),
            (4, 1000, 10_000.0)
        );
        assert!(!p.cost.tune);
        assert!(!config.learn_at_dispatch);
        assert_eq!(config.health.scrape_interval_ms, 1000);
        // What is not TOML is an error, not a silently dropped row.
        assert!(merged(&base, "[policy.dual_map\n").is_err());
    }

    #[test]
    fn time_parameters_scale_with_the_speedup() {
        assert_eq!(
            gateway_config(20.0, 10.0),
            "[health]\nscrape_interval_ms = 50\nstale_after_ms = 250\n\n\
             [policy.dual_map]\nprefill_tokens_per_sec = 200000\nttft_slo_ms = 500\n\n\
             [policy.queue]\nmax_wait_ms = 60000\n"
        );
        assert!(gateway_config(1.0, 1.0).starts_with("[health]\nscrape_interval_ms = 1000\nstale_after_ms = 5000\n"));
        // The gateway's floors.
        assert!(gateway_config(1000.0, 1.0).contains("scrape_interval_ms = 10\nstale_after_ms = 10\n"));
        assert!(gateway_config(0.5, 2.0).contains("max_wait_ms = 1200000\n"));
    }

    #[test]
    fn the_written_health_table_is_one_the_gateway_accepts() {
        let text = format!(
            "{}\n[[backend]]\nurl = \"http://127.0.0.1:1\"\n",
            gateway_config(20.0, 10.0)
        );
        let config = semlb::config::ServeConfig::from_toml(&text, std::path::Path::new("replay.toml")).unwrap();
        config.validate().unwrap();
        assert_eq!(
            (config.health.scrape_interval_ms, config.health.stale_after_ms),
            (50, 250)
        );
    }
}
