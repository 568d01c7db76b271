//! The gateway's listener over TLS (`[tls]`): its certificate chain and
//! key, and for mutual TLS the CA whose certificates clients must present
//! (`client_ca_file`; peer gateways present theirs with `peer.cert_file`).

use std::sync::Arc;

use super::{TlsError, certificates, private_key, provider, roots};
use crate::config::ListenerTls;

/// The rustls server configuration of `tls` (the files read now).
pub fn server_config(tls: &ListenerTls) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Rustls(e.to_string()))?;
    let builder = match &tls.client_ca_file {
        Some(path) => {
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots("tls.client_ca_file", path)?),
                provider(),
            )
            .build()
            .map_err(|e| TlsError::Rustls(format!("tls.client_ca_file: {e}")))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(
            certificates("tls.cert_file", &tls.cert_file)?,
            private_key("tls.key_file", &tls.key_file)?,
        )
        .map_err(|e| TlsError::Rustls(format!("tls.cert_file and tls.key_file: {e}")))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The acceptor `tls`'s configuration makes.
pub fn acceptor(tls: &ListenerTls) -> Result<tokio_rustls::TlsAcceptor, TlsError> {
    Ok(tokio_rustls::TlsAcceptor::from(server_config(tls)?))
}
