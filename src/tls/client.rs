//! The client side of an `https://` peer gateway: its certificate checked
//! against `peer.ca_file` (a private CA), else the system's roots, and a
//! client certificate (`peer.cert_file`, `peer.key_file`) for a peer that
//! asks for one (mutual TLS).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use super::{TlsError, certificates, private_key, provider, roots};
use crate::config::PeerTls;

/// An HTTPS client of one peer.
pub type PeerClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

/// The rustls client configuration `tls` makes (the files read now).
pub fn client_config(tls: &PeerTls) -> Result<rustls::ClientConfig, TlsError> {
    let roots = match &tls.ca_file {
        Some(path) => roots("peer.ca_file", path)?,
        None => {
            let mut store = rustls::RootCertStore::empty();
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = store.add_parsable_certificates(found.certs);
            if added == 0 {
                return Err(TlsError::Rustls(
                    "no system root certificate found: set peer.ca_file".into(),
                ));
            }
            store
        }
    };
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Rustls(e.to_string()))?
        .with_root_certificates(roots);
    match (&tls.cert_file, &tls.key_file) {
        (Some(cert), Some(key)) => builder
            .with_client_auth_cert(
                certificates("peer.cert_file", cert)?,
                private_key("peer.key_file", key)?,
            )
            .map_err(|e| TlsError::Rustls(format!("peer.cert_file and peer.key_file: {e}"))),
        (None, None) => Ok(builder.with_no_client_auth()),
        _ => Err(TlsError::Rustls("peer.cert_file and peer.key_file go together".into())),
    }
}

/// An HTTPS-only client with `tls`'s settings, connecting within
/// `connect_timeout`.
pub fn peer_client(tls: &PeerTls, connect_timeout: Duration) -> Result<PeerClient, TlsError> {
    let config = client_config(tls)?;
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(connect_timeout));
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_only()
        .enable_http1()
        .wrap_connector(http);
    Ok(Client::builder(TokioExecutor::new()).build(connector))
}

/// A shared client, for the peer book (cloning a client shares its pool).
pub type SharedPeerClient = Arc<PeerClient>;
