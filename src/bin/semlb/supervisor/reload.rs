//! What a reload (SIGHUP) may change: the configuration resolved again
//! exactly as at start (the same `--config` file, the same flags over it),
//! with the settings that need a restart kept at their running values
//! ([`reloaded_config`]), and the flags children are started with, which
//! pin those settings ([`pinned_args`]).
//!
//! * **Needs a restart** (logged, running values kept): `listen`,
//!   `dispatchers`, `responders`, `shm_name`, `shm_size`, `tokenizer`,
//!   `chat_template`, `block_size`, `[store]`, `[admin]`, `[epp]`. Children
//!   are started with these pinned as flags, so a child restarted after
//!   the file changed still matches the running segment and processes (a
//!   file that gained `[epp] listen` leaves a restarted dispatcher without
//!   a picker: the supervisor has no listener to hand it).
//! * **Read when a dispatcher starts** (logged): `[limits]`,
//!   `[response_cache]`, `drain_timeout_secs`; the supervisor itself uses
//!   the new drain timeout for backends removed from then on.
//! * **Applied at once** by the supervisor ([`super`]): the backends
//!   ([`super::backends`]), the health checks, and the routing policy, the
//!   model pools, the keys file (`[auth]`) and the peer gateways
//!   (`[peering]`, `[[peer]]`, their token files read again), which the
//!   dispatchers take when the supervisor forwards them SIGHUP. A keys
//!   file that does not read rejects the reload; a peer token file that
//!   does not read keeps the running peers (each dispatcher logs it).

use semlb::config::{ModelChanges, ServeConfig};

use crate::cli::ServeArgs;

/// The configuration file and the command line `args` again, with the
/// settings that need a restart kept at their `running` values (each
/// change of one is logged), and the admin API's pool `changes` merged
/// (`None`: those in `admin.models_file`). The error is one line, naming
/// the key.
pub(super) fn reloaded_config(
    args: &ServeArgs,
    running: &ServeConfig,
    changes: Option<&ModelChanges>,
) -> Result<ServeConfig, String> {
    let one_line = |e: &dyn std::fmt::Display| {
        e.to_string()
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut new =
        ServeConfig::resolve_with(args.config.as_deref(), args.overrides(), changes).map_err(|e| one_line(&e))?;
    let old = running;
    let mut kept = Vec::new();
    macro_rules! keep {
        ($($field:ident).+) => {
            if new.$($field).+ != old.$($field).+ {
                kept.push(stringify!($($field).+).replace(' ', ""));
                new.$($field).+ = old.$($field).+.clone();
            }
        };
    }
    keep!(listen);
    keep!(dispatchers);
    keep!(responders);
    keep!(shm_name);
    keep!(shm_size);
    keep!(tokenizer);
    keep!(chat_template);
    keep!(block_size);
    keep!(store);
    keep!(admin);
    keep!(epp);
    if !kept.is_empty() {
        tracing::warn!(
            "reload: {} changed; that needs a restart (systemctl restart semlb): keeping the running values",
            kept.join(", ")
        );
    }
    let mut at_start = Vec::new();
    if new.limits != old.limits {
        at_start.push("limits");
    }
    if new.response_cache != old.response_cache {
        at_start.push("response_cache");
    }
    if new.drain_timeout_secs != old.drain_timeout_secs {
        at_start.push("drain_timeout_secs");
    }
    if new.auth.debug_headers != old.auth.debug_headers {
        at_start.push("auth.debug_headers");
    }
    if !at_start.is_empty() {
        tracing::warn!(
            "reload: {} changed; dispatchers read that when they start: restart the service to apply it to all",
            at_start.join(", ")
        );
    }
    new.validate().map_err(|e| one_line(&e))?;
    if let Some(path) = &new.auth.keys_file {
        semlb::tenancy::auth::Keys::load(path).map_err(|e| one_line(&e))?;
    }
    Ok(new)
}

/// `args` with the settings that need a restart set to `config`'s values,
/// so that a child (re)started after the file changed uses the running
/// segment, process counts, tokenizer and store.
pub(super) fn pinned_args(args: &ServeArgs, config: &ServeConfig) -> ServeArgs {
    let mut pinned = args.clone();
    pinned.listen = Some(config.listen);
    pinned.dispatchers = Some(config.dispatchers);
    pinned.responders = Some(config.responders);
    pinned.shm_name = Some(config.shm_name.clone());
    pinned.shm_size = Some(config.shm_size);
    pinned.block_size = Some(config.block_size);
    if config.tokenizer.is_some() {
        pinned.tokenizer.clone_from(&config.tokenizer);
    }
    if config.chat_template.is_some() {
        pinned.chat_template.clone_from(&config.chat_template);
    }
    pinned.store = Some(config.store.kind);
    // Never a password on a command line: children get it in their
    // environment (`Children`, `credentials::PASSWORD_VAR`).
    pinned.redis_url = Some(semlb::store::redis::credentials::without_password(
        &config.store.redis.url,
    ));
    pinned.redis_namespace = Some(config.store.redis.namespace.clone());
    pinned.redis_lookup = Some(config.store.redis.lookup);
    // The picker's listener is the supervisor's: a file that drops it
    // leaves it to the dispatchers until a restart.
    if config.epp.listen.is_some() {
        pinned.epp_listen = config.epp.listen;
    }
    pinned
}
