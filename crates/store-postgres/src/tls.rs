//! TLS to the PostgreSQL server, asked for in a `postgres://` URL (docs/postgres.md,
//! "Connecting"): `sslmode=require` (or `verify-full`) encrypts and verifies the server's
//! certificate chain and its name against `sslrootcert` (a PEM file of the trusted certificates;
//! absent or `system`: the Mozilla roots of `webpki-roots`); `sslmode=prefer` does the same when
//! the server offers TLS and goes on in plain text when it does not; `sslmode=disable` (and no
//! `sslmode`, the default) connects in plain text. Unlike libpq's `require`, tidemark never
//! encrypts without verifying; `verify-ca` (a chain check without the name) is refused.
//! `sslcert` and `sslkey` (PEM files, both or neither) present a client certificate for the
//! server's `cert` authentication (pg_hba.conf): the certificate chain, and its private key
//! (PKCS#8, PKCS#1 or SEC1).

use std::sync::Arc;

use postgres::config::SslMode;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore};
use tidemark_core::error::codes;
use tidemark_core::{Error, Result};

/// The largest `sslrootcert`, `sslcert` or `sslkey` file read, in bytes.
pub const SSL_ROOT_CERT_BYTES_MAX: u64 = 1024 * 1024;

fn invalid(message: impl Into<String>) -> Error {
    Error::invalid(codes::INVALID_ARGUMENT, message)
}

/// `conn_str` without its `sslmode`, `sslrootcert`, `sslcert` and `sslkey` (what the driver parses), and the TLS it
/// asked for: `None` for plain text. A key=value connection string is left whole to the driver
/// (which then knows `sslmode=disable` and `prefer`, without TLS).
pub(crate) fn split(conn_str: &str) -> Result<(String, Option<(SslMode, ClientConfig)>)> {
    let lower = conn_str.get(..13).unwrap_or(conn_str).to_ascii_lowercase();
    if !(lower.starts_with("postgres://") || lower.starts_with("postgresql://")) {
        return Ok((conn_str.to_string(), None));
    }
    let mut url = url::Url::parse(conn_str).map_err(|e| invalid(format!("not a PostgreSQL URL: {e}")))?;
    let (mut mode, mut root, mut cert, mut key) = (None, None, None, None);
    let mut rest = Vec::new();
    for (name, value) in url.query_pairs() {
        match name.as_ref() {
            "sslmode" => mode = Some(value.into_owned()),
            "sslrootcert" => root = Some(value.into_owned()),
            "sslcert" => cert = Some(value.into_owned()),
            "sslkey" => key = Some(value.into_owned()),
            _ => rest.push((name.into_owned(), value.into_owned())),
        }
    }
    set_query(&mut url, &rest);
    let client = match (cert, key) {
        (Some(cert), Some(key)) => Some((cert, key)),
        (None, None) => None,
        _ => return Err(invalid("sslcert and sslkey go together: a client certificate and its private key")),
    };
    let mode = match mode.as_deref() {
        None | Some("disable") => {
            if root.is_some() || client.is_some() {
                return Err(invalid(
                    "sslrootcert, sslcert and sslkey without sslmode=require (or verify-full, prefer) are never used",
                ));
            }
            return Ok((url.to_string(), None));
        }
        Some("prefer") => SslMode::Prefer,
        Some("require") | Some("verify-full") => SslMode::Require,
        Some(other) => {
            return Err(invalid(format!(
                "sslmode must be disable, prefer, require or verify-full (tidemark always verifies the server's \
                 certificate and name when it uses TLS), got {other:?}"
            )))
        }
    };
    Ok((url.to_string(), Some((mode, client_config(root.as_deref(), client)?))))
}

/// The certificates of the PEM file `path` (the parameter `what`), at least one.
fn certificates(what: &str, path: &str) -> Result<Vec<CertificateDer<'static>>> {
    checked_size(what, path)?;
    let certificates: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect())
        .map_err(|e| invalid(format!("{what} {path}: not PEM certificates: {e}")))?;
    if certificates.is_empty() {
        return Err(invalid(format!("{what} {path} holds no certificate")));
    }
    Ok(certificates)
}

/// `path` exists and holds at most [`SSL_ROOT_CERT_BYTES_MAX`] bytes.
fn checked_size(what: &str, path: &str) -> Result<()> {
    let size = std::fs::metadata(path).map_err(|e| invalid(format!("{what} {path}: {e}")))?.len();
    if size > SSL_ROOT_CERT_BYTES_MAX {
        return Err(invalid(format!("{what} {path} is {size} bytes, more than {SSL_ROOT_CERT_BYTES_MAX}")));
    }
    Ok(())
}

/// A rustls client (ring) that trusts the certificates of `root` (a PEM file), or the Mozilla
/// roots for `None` and `system`, and presents the client certificate and key of `client`
/// (their PEM files) when given.
fn client_config(root: Option<&str>, client: Option<(String, String)>) -> Result<ClientConfig> {
    let mut roots = RootCertStore::empty();
    match root {
        None | Some("system") => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
        Some(path) => {
            for certificate in certificates("sslrootcert", path)? {
                roots.add(certificate).map_err(|e| invalid(format!("sslrootcert {path}: {e}")))?;
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Invariant(format!("rustls protocol versions: {e}")))?
        .with_root_certificates(roots);
    let Some((cert, key)) = client else { return Ok(builder.with_no_client_auth()) };
    let chain = certificates("sslcert", &cert)?;
    checked_size("sslkey", &key)?;
    // Never the key's bytes in a message: only its file's name.
    let private = PrivateKeyDer::from_pem_file(&key)
        .map_err(|e| invalid(format!("sslkey {key}: not a PEM private key (PKCS#8, PKCS#1 or SEC1): {e}")))?;
    builder
        .with_client_auth_cert(chain, private)
        .map_err(|e| invalid(format!("sslcert {cert} and sslkey {key} do not make a client certificate: {e}")))
}

/// Replace `url`'s query by `pairs`, spaces as `%20` (the driver decodes percent escapes only,
/// not form encoding's `+`); no query when there is none.
pub(crate) fn set_query(url: &mut url::Url, pairs: &[(String, String)]) {
    if pairs.is_empty() {
        url.set_query(None);
        return;
    }
    let encode =
        |text: &str| url::form_urlencoded::byte_serialize(text.as_bytes()).collect::<String>().replace('+', "%20");
    let query: Vec<String> = pairs.iter().map(|(k, v)| format!("{}={}", encode(k), encode(v))).collect();
    url.set_query(Some(&query.join("&")));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_parameters_are_taken_out_of_the_url_and_checked() {
        let (conn, tls) = split("postgres://u@h/db?connect_timeout=3").unwrap();
        assert_eq!((conn.as_str(), tls.is_none()), ("postgres://u@h/db?connect_timeout=3", true));
        let (conn, tls) = split("postgres://u@h/db?sslmode=disable").unwrap();
        assert_eq!((conn.as_str(), tls.is_none()), ("postgres://u@h/db", true));
        let (conn, tls) = split("postgres://u@h/db?sslmode=require&application_name=a%20b").unwrap();
        assert_eq!(conn, "postgres://u@h/db?application_name=a%20b");
        assert!(matches!(tls, Some((SslMode::Require, _))));
        assert!(matches!(split("postgres://u@h/db?sslmode=prefer").unwrap().1, Some((SslMode::Prefer, _))));
        assert!(matches!(split("postgres://u@h/db?sslmode=verify-full").unwrap().1, Some((SslMode::Require, _))));
        let refused = |url: &str| split(url).err().map(|e| e.code().to_string());
        assert_eq!(refused("postgres://u@h/db?sslmode=verify-ca").as_deref(), Some(codes::INVALID_ARGUMENT));
        assert_eq!(refused("postgres://u@h/db?sslmode=allow").as_deref(), Some(codes::INVALID_ARGUMENT));
        assert_eq!(refused("postgres://u@h/db?sslrootcert=/x.pem").as_deref(), Some(codes::INVALID_ARGUMENT));
        assert_eq!(
            refused("postgres://u@h/db?sslmode=require&sslrootcert=/no/such.pem").as_deref(),
            Some(codes::INVALID_ARGUMENT)
        );
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let url = format!("postgres://u@h/db?sslmode=require&sslrootcert={}", empty.display());
        assert_eq!(refused(&url).as_deref(), Some(codes::INVALID_ARGUMENT));
        // A client certificate: both files or neither, with TLS, each a PEM file of its kind.
        let pem = empty.display().to_string();
        for url in [
            format!("postgres://u@h/db?sslmode=require&sslcert={pem}"),
            format!("postgres://u@h/db?sslmode=require&sslkey={pem}"),
            format!("postgres://u@h/db?sslcert={pem}&sslkey={pem}"),
            format!("postgres://u@h/db?sslmode=require&sslcert={pem}&sslkey={pem}"),
            "postgres://u@h/db?sslmode=require&sslcert=/no/such.pem&sslkey=/no/such.key".to_string(),
        ] {
            assert_eq!(refused(&url).as_deref(), Some(codes::INVALID_ARGUMENT), "{url}");
        }
        // A key=value string is the driver's.
        let (conn, tls) = split("host=h user=u sslmode=disable").unwrap();
        assert_eq!((conn.as_str(), tls.is_none()), ("host=h user=u sslmode=disable", true));
    }
}
