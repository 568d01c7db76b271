//! How a process reaches Redis: the URL (`redis://` or, with TLS,
//! `rediss://`), the credentials, and the certificate authority a TLS
//! server is checked against ([`client`]).
//!
//! The password is looked for, in order, in the URL (`redis://user:pw@...`,
//! kept for compatibility), in `password_file` (refused if anyone but its
//! owner may read it), then in the environment variable [`PASSWORD_VAR`].
//! It never reaches a child's command line or a log: the supervisor hands
//! its children the URL without it ([`without_password`]) and the password
//! in their environment (which only the same user can read), and every log
//! line shows [`redacted`] URLs. `username` (Redis 6 ACL users) may be in
//! the URL or in `[store.redis] username`.
//!
//! With `rediss://`, the server's certificate is checked against the
//! system's roots, or against `ca_file` (PEM) for a private CA: a managed
//! Redis or Valkey (ElastiCache, Memorystore, Azure Cache) needs
//! `rediss://` and, for most, a password or an ACL user and password.

use std::path::Path;

use redis::{ConnectionInfo, IntoConnectionInfo, RedisConnectionInfo};

use super::error::StoreError;
use super::url::url_password;
pub use super::url::{redacted, without_password};
use crate::config::RedisConfig;

/// The environment variable a password may come in (and that the
/// supervisor hands its children the password in).
pub const PASSWORD_VAR: &str = "SEMLB_REDIS_PASSWORD";

/// The password to use: the URL's, else `password_file`'s (first line),
/// else [`PASSWORD_VAR`]'s.
pub fn password(config: &RedisConfig) -> Result<Option<String>, StoreError> {
    if let Some(p) = url_password(&config.url).filter(|p| !p.is_empty()) {
        return Ok(Some(p));
    }
    if let Some(path) = &config.password_file {
        return read_secret(path).map(Some);
    }
    Ok(std::env::var(PASSWORD_VAR).ok().filter(|p| !p.is_empty()))
}

/// The first line of the private file `path`.
fn read_secret(path: &Path) -> Result<String, StoreError> {
    use std::os::unix::fs::PermissionsExt;
    let setup = |detail: String| StoreError::Setup { detail };
    let meta =
        std::fs::metadata(path).map_err(|e| setup(format!("store.redis.password_file {}: {e}", path.display())))?;
    if meta.permissions().mode() & 0o077 != 0 {
        return Err(setup(format!(
            "store.redis.password_file {} may be read by others (mode {:o}); chmod 600 it",
            path.display(),
            meta.permissions().mode() & 0o777
        )));
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| setup(format!("store.redis.password_file {}: {e}", path.display())))?;
    let line = text.lines().next().unwrap_or("").trim_end_matches('\r').to_owned();
    if line.is_empty() {
        return Err(setup(format!("store.redis.password_file {} is empty", path.display())));
    }
    Ok(line)
}

/// A client for `config`: its URL with the credentials above and, for
/// `rediss://` with `ca_file`, that certificate authority.
pub fn client(config: &RedisConfig) -> Result<redis::Client, StoreError> {
    let url_error = |source| StoreError::Url {
        url: redacted(&config.url),
        source,
    };
    let info: ConnectionInfo = config.url.as_str().into_connection_info().map_err(url_error)?;
    let redis = RedisConnectionInfo {
        password: password(config)?,
        username: info.redis.username.clone().or_else(|| config.username.clone()),
        ..info.redis.clone()
    };
    let info = ConnectionInfo { redis, ..info };
    match &config.ca_file {
        Some(path) => {
            let root_cert = std::fs::read(path).map_err(|e| StoreError::Setup {
                detail: format!("store.redis.ca_file {}: {e}", path.display()),
            })?;
            let certificates = redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(root_cert),
            };
            redis::Client::build_with_tls(info, certificates).map_err(url_error)
        }
        None => redis::Client::open(info).map_err(url_error),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_password_file_must_be_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("semlb-redis-pw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("password");
        std::fs::write(&path, "hunter2\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let config = RedisConfig {
            password_file: Some(path.clone()),
            ..RedisConfig::default()
        };
        let err = password(&config).unwrap_err().to_string();
        assert!(err.contains("chmod 600") && !err.contains("hunter2"), "{err}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(password(&config).unwrap().as_deref(), Some("hunter2"));
        // The URL's password wins.
        let config = RedisConfig {
            url: "redis://:inline@127.0.0.1/".into(),
            ..config
        };
        assert_eq!(password(&config).unwrap().as_deref(), Some("inline"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
