//! Logging of the gateway's processes: a `tracing` subscriber writing to
//! stderr, set up once at the start of `serve`, `__child` and `__sim`.
//!
//! Two formats (`--log-format`):
//!
//! - `text` (default), one line per event for people and journald:
//!   `2025-01-01T12:00:00.000000Z  INFO dispatcher 0: message key=value ...`
//! - `json`, one JSON object per line for log pipelines:
//!   `{"role":"dispatcher 0","pid":123,"timestamp":"...","level":"INFO","message":"...","key":"value",...,"target":"semlb::dispatcher::proxy"}`
//!   (the event's fields sit beside `message`).
//!
//! Every line names the process's role (`supervisor`, `dispatcher N`,
//! `responder N`, `sim`), so the interleaved output of the processes of one
//! gateway stays readable. The filter is `--log-level` (default `info`;
//! a bare level is semlb's, other crates log at `info` at most: see
//! [`directive`]), unless the environment variable [`LOG_ENV`] holds an `EnvFilter`
//! directive (`debug`, `semlb::dispatcher=debug,info`, ...), which wins.
//! The children get the same flags (see [`crate::cli::ServeArgs::to_args`])
//! and inherit the environment, so every process of a gateway logs alike.
//!
//! The per-request routing event of the dispatchers is at `debug` level:
//! with the default filter its call site is disabled once and for all, so it
//! costs a branch per request.

use std::fmt;
use std::io::IsTerminal;

use tracing::{Event, Subscriber};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::format::{self, FormatEvent, FormatFields, Json, JsonFields, Writer};
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, MakeWriter};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;

use crate::cli::{LogArgs, LogFormat};

/// The environment variable whose `EnvFilter` directive overrides `--log-level`.
pub const LOG_ENV: &str = "SEMLB_LOG";

/// Installs the process's subscriber (stderr) for a process in `role`
/// (`supervisor`, `dispatcher 0`, ...). An unusable [`LOG_ENV`] is reported
/// (as a warning) and `--log-level` used instead.
pub fn init(args: &LogArgs, role: &str) {
    let env = std::env::var(LOG_ENV).ok().filter(|v| !v.trim().is_empty());
    let (filter, rejected) = match env.as_deref().map(EnvFilter::try_new) {
        Some(Ok(filter)) => (filter, None),
        Some(Err(e)) => (EnvFilter::new(directive(&args.log_level)), Some(e)),
        None => (EnvFilter::new(directive(&args.log_level)), None),
    };
    let ansi = args.log_format == LogFormat::Text && std::io::stderr().is_terminal();
    let subscriber = subscriber(args.log_format, role, filter, std::io::stderr, ansi);
    // Only fails if one is installed already (never, at the binary's edge).
    let _ = tracing::subscriber::set_global_default(subscriber);
    if let Some(e) = rejected {
        tracing::warn!(
            variable = LOG_ENV,
            error = %e,
            "{LOG_ENV}={:?} is not a valid filter ({e}); using --log-level {}",
            env.unwrap_or_default(),
            args.log_level
        );
    }
}

/// The filter directive of a `--log-level`: a bare level is for semlb's own
/// events, other crates' (hyper's connection pool, ...) stay at `info` or
/// less, so `debug` shows the routing decisions and not every pooled
/// connection; anything else is a directive, taken as it is.
pub fn directive(level: &str) -> String {
    let level = level.trim();
    match level.parse::<tracing::level_filters::LevelFilter>() {
        Ok(l) if !level.contains('=') => {
            let others = l.min(tracing::level_filters::LevelFilter::INFO);
            format!("{others},semlb={l}")
        }
        _ => level.to_owned(),
    }
}

/// The subscriber [`init`] installs, writing to `writer` (a parameter for tests).
pub fn subscriber<W>(
    format: LogFormat,
    role: &str,
    filter: EnvFilter,
    writer: W,
    ansi: bool,
) -> Box<dyn Subscriber + Send + Sync>
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    let registry = tracing_subscriber::registry().with(filter);
    match format {
        LogFormat::Text => {
            let layer = tracing_subscriber::fmt::layer()
                .with_writer(writer)
                .with_ansi(ansi)
                .event_format(TextFormat { role: role.to_owned() });
            Box::new(registry.with(layer))
        }
        LogFormat::Json => {
            let inner = format::format()
                .json()
                .flatten_event(true)
                .with_current_span(false)
                .with_span_list(false);
            let role_json = serde_json::to_string(role).expect("a string serializes");
            let layer = tracing_subscriber::fmt::layer()
                .with_writer(writer)
                .with_ansi(false)
                .fmt_fields(JsonFields::new())
                .event_format(JsonFormat {
                    inner,
                    prefix: format!("{{\"role\":{role_json},\"pid\":{},", std::process::id()),
                });
            Box::new(registry.with(layer))
        }
    }
}

/// `--log-format text`: `TIMESTAMP LEVEL ROLE: message fields`.
struct TextFormat {
    role: String,
}

impl<S, N> FormatEvent<S, N> for TextFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'w> FormatFields<'w> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut writer: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        SystemTime.format_time(&mut writer)?;
        let level = *event.metadata().level();
        if writer.has_ansi_escapes() {
            let colour = match level {
                tracing::Level::ERROR => "31",
                tracing::Level::WARN => "33",
                tracing::Level::INFO => "32",
                tracing::Level::DEBUG => "34",
                tracing::Level::TRACE => "35",
            };
            write!(writer, " \x1b[{colour}m{level:>5}\x1b[0m {}: ", self.role)?;
        } else {
            write!(writer, " {level:>5} {}: ", self.role)?;
        }
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

/// `--log-format json`: tracing-subscriber's JSON line (timestamp, level,
/// message and fields, target) with the process's `role` and `pid` in front.
struct JsonFormat {
    inner: format::Format<Json>,
    /// `{"role":"...","pid":N,`: replaces the inner object's `{`.
    prefix: String,
}

impl<S, N> FormatEvent<S, N> for JsonFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'w> FormatFields<'w> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut writer: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        let mut line = String::with_capacity(256);
        self.inner.format_event(ctx, Writer::new(&mut line), event)?;
        match line.strip_prefix('{') {
            Some(rest) => {
                writer.write_str(&self.prefix)?;
                writer.write_str(rest)
            }
            None => writer.write_str(&line),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    use serde_json::Value;

    use super::*;

    /// A `MakeWriter` collecting everything in memory.
    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl Write for Buffer {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'w> MakeWriter<'w> for Buffer {
        type Writer = Self;

        fn make_writer(&'w self) -> Self {
            self.clone()
        }
    }

    impl Buffer {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
        }
    }

    fn emit(format: LogFormat, level: &str) -> String {
        let buffer = Buffer::default();
        let subscriber = subscriber(format, "dispatcher 3", EnvFilter::new(level), buffer.clone(), false);
        tracing::subscriber::with_default(subscriber, || {
            tracing::info!(
                backend = "http://a:1",
                failures = 3_u32,
                "backend {} is down",
                "http://a:1"
            );
            tracing::debug!(server = "http://b:2", "routed");
            tracing::warn!("quote \" and\nnewline");
        });
        buffer.text()
    }

    #[test]
    fn json_lines_carry_role_level_target_message_and_fields() {
        let out = emit(LogFormat::Json, "info");
        let lines: Vec<Value> = out
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect();
        assert_eq!(lines.len(), 2, "debug is filtered out at info:\n{out}");
        let first = &lines[0];
        assert_eq!(first["role"], "dispatcher 3");
        assert_eq!(first["pid"], std::process::id());
        assert_eq!(first["level"], "INFO");
        assert_eq!(first["target"], module_path!());
        assert_eq!(first["message"], "backend http://a:1 is down");
        assert_eq!(first["backend"], "http://a:1");
        assert_eq!(first["failures"], 3);
        assert!(first["timestamp"].as_str().is_some_and(|t| t.ends_with('Z')), "{first}");
        assert_eq!(lines[1]["message"], "quote \" and\nnewline");
        assert_eq!(lines[1]["level"], "WARN");
    }

    #[test]
    fn the_filter_lets_debug_through_when_asked() {
        let out = emit(LogFormat::Json, "debug");
        let servers: Vec<Value> = out
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .filter_map(|v| v.get("server").cloned())
            .collect();
        assert_eq!(servers, [Value::from("http://b:2")], "{out}");
    }

    #[test]
    fn a_bare_level_is_for_semlb_only_beyond_info() {
        assert_eq!(directive("debug"), "info,semlb=debug");
        assert_eq!(directive("TRACE"), "info,semlb=trace");
        assert_eq!(directive("warn"), "warn,semlb=warn");
        assert_eq!(directive("off"), "off,semlb=off");
        assert_eq!(directive("hyper_util=debug,info"), "hyper_util=debug,info");
    }

    #[test]
    fn text_lines_name_the_role_and_keep_the_message() {
        let out = emit(LogFormat::Text, "info");
        let first = out.lines().next().unwrap();
        assert!(
            first.contains(" INFO dispatcher 3: backend http://a:1 is down backend=\"http://a:1\" failures=3"),
            "{first}"
        );
        assert!(!out.contains("routed"), "{out}");
    }
}
