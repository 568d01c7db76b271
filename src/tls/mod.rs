//! TLS, with rustls (ring): the gateway's own listener (`[tls]`: clients
//! and peer gateways reach it over `https://`) and the client side of
//! `https://` peer gateways ([`crate::peers`]).
//!
//! | file | what |
//! | --- | --- |
//! | `mod.rs` | PEM files read: certificate chains, private keys, certificate authorities |
//! | `client.rs` | the client configuration of a peer: its CA (or the system's roots) and an optional client certificate |
//! | `server.rs` | the listener's configuration: its certificate and, for mutual TLS, the CA clients must present a certificate of |
//!
//! Certificates and keys are PEM files; a key file must be private to its
//! owner (as every secret file the gateway reads).

use std::path::Path;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

pub mod client;
pub mod server;

pub use client::{PeerClient, client_config, peer_client};
pub use server::{acceptor, server_config};

/// Why a TLS setting cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file that cannot be read or holds no usable PEM item.
    #[error("{field} {path}: {reason}")]
    File {
        /// The setting naming it.
        field: &'static str,
        /// Its path.
        path: String,
        /// What is wrong.
        reason: String,
    },
    /// rustls refused the combination (a key that does not match its
    /// certificate, ...).
    #[error("{0}")]
    Rustls(String),
}

fn file_error(field: &'static str, path: &Path, reason: impl ToString) -> TlsError {
    TlsError::File {
        field,
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

/// The certificates of the PEM file at `path` (at least one).
pub fn certificates(field: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_error(field, path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_error(field, path, e))?;
    if certs.is_empty() {
        return Err(file_error(field, path, "no PEM certificate in it"));
    }
    Ok(certs)
}

/// The private key of the PEM file at `path`, which must be private to
/// its owner.
pub fn private_key(field: &'static str, path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    crate::config::read_private(path).map_err(|reason| file_error(field, path, reason))?;
    PrivateKeyDer::from_pem_file(path).map_err(|e| file_error(field, path, e))
}

/// A root store of the certificates in the PEM file at `path`.
pub fn roots(field: &'static str, path: &Path) -> Result<rustls::RootCertStore, TlsError> {
    let mut store = rustls::RootCertStore::empty();
    for cert in certificates(field, path)? {
        store.add(cert).map_err(|e| file_error(field, path, e))?;
    }
    Ok(store)
}

/// The crypto provider (ring, the one compiled in).
fn provider() -> std::sync::Arc<rustls::crypto::CryptoProvider> {
    std::sync::Arc::new(rustls::crypto::ring::default_provider())
}
