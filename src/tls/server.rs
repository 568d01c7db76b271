//! The gateway's listener over TLS (`[tls]`): its certificate chain and
//! key, and for mutual TLS the CA whose certificates clients must present
//! (`client_ca_file`; peer gateways present theirs with `peer.cert_file`).

use std::path::PathBuf;
use std::sync::Arc;

use serde::Deserialize;

use super::{TlsError, certificates, private_key, provider, roots};

/// `[tls]`: the listener serves HTTPS (HTTP/1.1 over TLS 1.2 or 1.3).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerTls {
    /// The certificate chain it presents (PEM, leaf first).
    pub cert_file: PathBuf,
    /// Its private key (PEM; mode 0600).
    pub key_file: PathBuf,
    /// Clients must present a certificate of this CA (PEM): mutual TLS.
    /// Default: none asked for.
    #[serde(default)]
    pub client_ca_file: Option<PathBuf>,
}

impl ListenerTls {
    /// The rustls server configuration (the files read now).
    pub fn server_config(&self) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Rustls(e.to_string()))?;
        let builder = match &self.client_ca_file {
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
                certificates("tls.cert_file", &self.cert_file)?,
                private_key("tls.key_file", &self.key_file)?,
            )
            .map_err(|e| TlsError::Rustls(format!("tls.cert_file and tls.key_file: {e}")))?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }

    /// The acceptor its configuration makes.
    pub fn acceptor(&self) -> Result<tokio_rustls::TlsAcceptor, TlsError> {
        Ok(tokio_rustls::TlsAcceptor::from(self.server_config()?))
    }
}
