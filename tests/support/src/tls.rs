//! TLS for tests: certificate authorities and certificates made with
//! `openssl` (as an operator makes them), and HTTPS requests over rustls
//! with a CA to trust and an optional client certificate.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::http::{Response, connect, exchange_over, request_bytes};

/// Runs `openssl` with `args` in `dir`.
pub fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl (the test makes its certificates with it)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A certificate and its key, as files.
#[derive(Debug, Clone)]
pub struct CertFiles {
    /// The certificate (PEM).
    pub cert: PathBuf,
    /// Its key (PEM, mode 0600).
    pub key: PathBuf,
}

/// A self-signed CA `name` in `dir` (`name.crt`, `name.key`).
pub fn ca(dir: &Path, name: &str) -> CertFiles {
    let (crt, key) = (format!("{name}.crt"), format!("{name}.key"));
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &crt,
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}"),
        ],
    );
    private(dir.join(&key));
    CertFiles {
        cert: dir.join(crt),
        key: dir.join(key),
    }
}

/// A certificate `name` signed by `ca`, for `127.0.0.1` and `localhost`
/// (server and client use), in `dir`.
pub fn signed(dir: &Path, ca: &CertFiles, name: &str) -> CertFiles {
    let (crt, key, csr, ext) = (
        format!("{name}.crt"),
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.ext"),
    );
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            &format!("/CN={name}"),
        ],
    );
    std::fs::write(
        dir.join(&ext),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n",
    )
    .unwrap();
    let (ca_crt, ca_key) = (ca.cert.display().to_string(), ca.key.display().to_string());
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &ca_crt,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-out",
            &crt,
            "-days",
            "2",
            "-extfile",
            &ext,
        ],
    );
    private(dir.join(&key));
    CertFiles {
        cert: dir.join(crt),
        key: dir.join(key),
    }
}

fn private(path: PathBuf) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

/// How a test client reaches an HTTPS server: the CA it trusts and the
/// certificate it presents, if any.
#[derive(Debug, Clone)]
pub struct TlsClient {
    /// The CA the server's certificate must chain to.
    pub ca: PathBuf,
    /// The client certificate presented (mutual TLS).
    pub identity: Option<CertFiles>,
}

impl TlsClient {
    fn config(&self) -> Result<rustls::ClientConfig, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_file_iter(&self.ca).map_err(|e| e.to_string())? {
            roots.add(cert.map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
        }
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots);
        match &self.identity {
            Some(id) => {
                let certs = CertificateDer::pem_file_iter(&id.cert)
                    .map_err(|e| e.to_string())?
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| e.to_string())?;
                let key = PrivateKeyDer::from_pem_file(&id.key).map_err(|e| e.to_string())?;
                builder.with_client_auth_cert(certs, key).map_err(|e| e.to_string())
            }
            None => Ok(builder.with_no_client_auth()),
        }
    }

    /// One HTTPS request to `addr` (`host:port`), as [`crate::http::http`].
    pub fn request(
        &self,
        addr: &str,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
        headers: &[(&str, &str)],
    ) -> Result<Response, String> {
        let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h).to_owned();
        let name = ServerName::try_from(host).map_err(|e| e.to_string())?;
        let conn = rustls::ClientConnection::new(Arc::new(self.config()?), name).map_err(|e| e.to_string())?;
        let stream = rustls::StreamOwned::new(conn, connect(addr)?);
        let payload = body.map(|b| b.to_string());
        exchange_over(
            stream,
            &request_bytes(addr, method, path, payload.as_deref().map(str::as_bytes), headers),
        )
    }
}
