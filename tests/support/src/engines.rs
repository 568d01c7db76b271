//! Simulated engines (`semlb __sim`, real processes): at a time scale, on
//! an address, with extra flags ([`sim`], [`sim_at`], [`sim_on`],
//! [`sim_with`]), publishing KV cache events ([`sim_with_events`]), and
//! what their first line says (events endpoints, bootstrap port).

use crate::process::Proc;

/// A simulated engine at 100x real speed.
pub fn sim() -> Proc {
    sim_at("0.01")
}

/// A simulated engine whose simulated second lasts `time_scale` real seconds.
pub fn sim_at(time_scale: &str) -> Proc {
    sim_on("127.0.0.1:0", time_scale)
}

/// [`sim_at`] listening on `listen` (`host:port`).
pub fn sim_on(listen: &str, time_scale: &str) -> Proc {
    sim_with(time_scale, &["--listen", listen])
}

/// [`sim_at`] with `extra` arguments of `semlb __sim` (a `--listen` among
/// them replaces the free port).
pub fn sim_with(time_scale: &str, extra: &[&str]) -> Proc {
    let mut args = vec!["__sim", "--time-scale", time_scale];
    if !extra.contains(&"--listen") {
        args.extend(["--listen", "127.0.0.1:0"]);
    }
    args.extend_from_slice(extra);
    Proc::start(&args)
}

/// The ZeroMQ endpoints a simulator publishes its KV cache events on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEndpoints {
    /// The PUB socket (`tcp://127.0.0.1:PORT`).
    pub events: String,
    /// The replay (ROUTER) socket.
    pub replay: String,
}

/// [`sim_with`] publishing its KV cache events (on free loopback ports,
/// with a replay socket of `buffer_steps` batches; [`kv_endpoints`] of its
/// `line` names them).
pub fn sim_with_events(time_scale: &str, buffer_steps: usize, extra: &[&str]) -> Proc {
    let config = format!(
        r#"{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0", "buffer_steps": {buffer_steps}}}"#
    );
    let mut args = vec!["--kv-events-config", &config];
    args.extend_from_slice(extra);
    let proc = sim_with(time_scale, &args);
    assert!(
        kv_endpoints(&proc.line).is_some(),
        "no KV event endpoints in {:?}",
        proc.line
    );
    proc
}

/// A `[[backend]]` table for the simulator `engine`, its KV events
/// followed (`None`: `engine` publishes none).
pub fn kv_backend_table(engine: &Proc) -> Option<String> {
    let at = kv_endpoints(&engine.line)?;
    Some(format!(
        "\n[[backend]]\nurl = \"http://{}\"\nkv_events = \"{}\"\nkv_events_replay = \"{}\"\n",
        engine.addr, at.events, at.replay
    ))
}

/// The endpoints a simulator's first line names (`kv events on tcp://A
/// replay tcp://B; listening on ...`).
pub fn kv_endpoints(line: &str) -> Option<KvEndpoints> {
    let rest = line.split_once("kv events on ")?.1;
    let (events, rest) = rest.split_once(" replay ")?;
    let (replay, _) = rest.split_once(';')?;
    Some(KvEndpoints {
        events: events.to_owned(),
        replay: replay.to_owned(),
    })
}

/// The port of the SGLang bootstrap server a simulator's first line names
/// (`bootstrap on HOST:PORT; listening on ...`, after the KV event
/// endpoints if any): an SGLang prefill engine's (`--role prefill
/// --pd-protocol sglang`); `None` for any other.
pub fn bootstrap_port(line: &str) -> Option<u16> {
    let rest = line.split_once("bootstrap on ")?.1;
    let (addr, _) = rest.split_once(';')?;
    addr.rsplit_once(':')?.1.parse().ok()
}
