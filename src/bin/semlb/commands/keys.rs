//! `semlb keys`: the clients' API keys file ([`semlb::tenancy::auth`]).
//!
//! * `semlb keys add --tenant T [--model M]...` makes a key, adds its
//!   SHA-256 digest to the file and prints the key once (it is nowhere
//!   else); `--json` prints `{"key", "id", "tenant", "models"}`.
//! * `semlb keys list` prints every key's id, tenant, models and date,
//!   never a key.
//! * `semlb keys revoke ID` removes a key.
//! * `semlb keys limit --tenant T [--requests-per-minute N]
//!   [--tokens-per-minute N] [--priority interactive|batch] [--weight N]
//!   [--isolate-prefixes]`
//!   sets a tenant's rate limits ([`semlb::tenancy::rate_limit`]) and its class and
//!   weight in the gateway queue ([`semlb::tenancy::fair_share`]) (`--tenant '*'`:
//!   every tenant without settings of its own; none given: removes its
//!   settings); `list` shows them after the keys.
//!
//! The file is `--file`, else the configuration's `auth.keys_file`
//! (`--config`, `$SEMLB_CONFIG`). It is written whole and renamed into
//! place, mode 0600. A running gateway applies changes on reload
//! (`systemctl reload semlb`).

use std::io::Write;

use crate::cli::{KeysAction, KeysArgs};
use anyhow::{Context, Result, bail};
use semlb::config::ServeConfig;
use semlb::tenancy::auth::{KeysFile, TenantEntry};
use serde_json::json;

/// Runs `semlb keys`.
pub fn run(args: &KeysArgs, out: &mut impl Write) -> Result<()> {
    let path = match (&args.file, &args.config) {
        (Some(file), _) => file.clone(),
        (None, Some(config)) => ServeConfig::load(Some(config))?
            .auth
            .keys_file
            .with_context(|| format!("{} sets no auth.keys_file; give --file", config.display()))?,
        (None, None) => bail!("give --file, or --config with an auth.keys_file"),
    };
    // Two `semlb keys` at once (two operators, a script in a loop) each
    // read, change and write the whole file: one change would be lost.
    // Changes hold an exclusive lock on `<file>.lock` for their read-modify-
    // write; reads take none (every write is a rename, never a torn file).
    let _lock = match &args.action {
        KeysAction::List => None,
        _ => Some(lock_for_change(&path)?),
    };
    match &args.action {
        KeysAction::Add { tenant, models } => {
            let mut file = KeysFile::read(&path, true)?;
            let (key, entry) = file.add(tenant, models.clone(), Some(now_rfc3339()))?;
            file.write(&path)?;
            if args.json {
                let v = json!({"key": key, "id": entry.id, "tenant": entry.tenant, "models": entry.models});
                writeln!(out, "{v}")?;
            } else {
                writeln!(out, "{key}")?;
                writeln!(
                    out,
                    "added {} for tenant {:?} to {}; shown only now. Apply with a reload (systemctl reload semlb).",
                    entry.id,
                    entry.tenant,
                    path.display()
                )?;
            }
        }
        KeysAction::List => {
            let file = KeysFile::read(&path, false)?;
            if args.json {
                writeln!(out, "{}", serde_json::to_string_pretty(&file.keys)?)?;
            } else {
                writeln!(out, "{:<18} {:<24} {:<22} models", "id", "tenant", "created")?;
                for k in &file.keys {
                    let models = if k.models.is_empty() {
                        "(every model)".to_owned()
                    } else {
                        k.models.join(", ")
                    };
                    let created = k.created.as_deref().unwrap_or("-");
                    writeln!(out, "{:<18} {:<24} {:<22} {models}", k.id, k.tenant, created)?;
                }
                if !file.tenants.is_empty() {
                    writeln!(
                        out,
                        "\n{:<24} {:>16} {:>16} {:>10} {:<12} {:<7} prefixes",
                        "tenant", "requests/minute", "tokens/minute", "concurrent", "class", "weight"
                    )?;
                    let figure = |v: Option<u64>| v.map_or_else(|| "-".to_owned(), |n| n.to_string());
                    for t in &file.tenants {
                        let prefixes = if t.isolate_prefixes == Some(true) {
                            "isolated"
                        } else {
                            "shared"
                        };
                        writeln!(
                            out,
                            "{:<24} {:>16} {:>16} {:>10} {:<12} {:<7} {prefixes}",
                            t.name,
                            figure(t.requests_per_minute),
                            figure(t.tokens_per_minute),
                            figure(t.max_concurrent_requests),
                            t.priority.unwrap_or_default().name(),
                            t.weight.unwrap_or(1)
                        )?;
                    }
                }
            }
        }
        KeysAction::Limit {
            tenant,
            requests_per_minute,
            tokens_per_minute,
            priority,
            weight,
            isolate_prefixes,
            max_concurrent_requests,
        } => {
            let mut file = KeysFile::read(&path, true)?;
            let entry = TenantEntry {
                requests_per_minute: *requests_per_minute,
                tokens_per_minute: *tokens_per_minute,
                priority: *priority,
                weight: *weight,
                isolate_prefixes: isolate_prefixes.then_some(true),
                max_concurrent_requests: *max_concurrent_requests,
                ..TenantEntry::named(tenant)
            };
            let what = if entry.is_empty() {
                "no settings".to_owned()
            } else {
                serde_json::to_string(&entry)?
            };
            file.set_tenant(entry)?;
            file.write(&path)?;
            writeln!(
                out,
                "tenant {tenant:?}: {what}. Apply with a reload (systemctl reload semlb)."
            )?;
        }
        KeysAction::Revoke { id } => {
            let mut file = KeysFile::read(&path, false)?;
            if !file.revoke(id) {
                bail!("{} has no key {id:?} (semlb keys list shows the ids)", path.display());
            }
            file.write(&path)?;
            writeln!(out, "revoked {id}. Apply with a reload (systemctl reload semlb).")?;
        }
    }
    Ok(())
}

/// An exclusive `flock` on `<path>.lock` (created, mode 0600), held until
/// the returned file is dropped.
fn lock_for_change(path: &std::path::Path) -> Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let mut name = path.as_os_str().to_owned();
    name.push(".lock");
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(&name)
        .with_context(|| format!("opening the lock file {}", std::path::Path::new(&name).display()))?;
    // SAFETY: flock on a descriptor this function owns; it blocks until the
    // lock is granted and touches no memory.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(std::io::Error::last_os_error()).context("locking the keys file");
    }
    Ok(lock)
}

/// The time now as RFC 3339 UTC, to the second.
fn now_rfc3339() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    crate::commands::report::rfc3339_from_unix_secs(secs)
}

#[cfg(test)]
mod tests {
    #[test]
    fn dates_are_rfc3339() {
        let d = super::now_rfc3339();
        assert_eq!(d.len(), 20, "{d}");
        assert!(
            d.starts_with("20") && d.ends_with('Z') && d.as_bytes()[10] == b'T',
            "{d}"
        );
    }
}
