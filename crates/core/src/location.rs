//! Where a store lives, as a command line or a configuration names it (`--store`):
//!
//! ```text
//! /path/to/wf.db  or  sqlite:/path/to/wf.db                          a SQLite file on this machine
//! postgres://user[:password]@host[:port]/database[?schema=name&...]  a schema on a PostgreSQL server
//! ```
//!
//! `postgresql://` is the same as `postgres://`. The `schema` parameter names the PostgreSQL
//! schema the store's tables live in (a strict lower-case identifier, default
//! [`POSTGRES_SCHEMA_DEFAULT`]); every other parameter is the driver's (`connect_timeout`,
//! `application_name`, `sslmode`, ...). A password in the URL is used to connect and never
//! printed: [`StoreLocation::masked`] is what outputs and logs show. At most
//! [`STORE_LOCATION_BYTES_MAX`] bytes; anything else is `invalid_store` and nothing is opened.

use std::path::PathBuf;

use crate::error::codes;
use crate::{Error, Result};

/// The longest `--store` accepted, in bytes.
pub const STORE_LOCATION_BYTES_MAX: usize = 4_096;
/// The PostgreSQL schema of a `postgres://` location without `?schema=`.
pub const POSTGRES_SCHEMA_DEFAULT: &str = "tidemark";

/// A parsed `--store`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreLocation {
    /// A SQLite file.
    Sqlite(PathBuf),
    /// A schema on a PostgreSQL server.
    Postgres(PostgresLocation),
}

/// A schema on a PostgreSQL server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PostgresLocation {
    /// The driver's connection string: the URL without its `schema` parameter.
    pub conn: String,
    /// The schema the store's tables live in (checked by the store when it opens it).
    pub schema: String,
    /// The URL with its password replaced by `***`: what outputs show.
    pub masked: String,
}

/// Longest schema name accepted, in bytes (PostgreSQL truncates identifiers at 63 bytes; we refuse
/// instead of truncating, so two names never meet in one schema).
pub const SCHEMA_NAME_BYTES_MAX: usize = 63;

/// Check a PostgreSQL schema name: 1..=63 bytes of `a-z`, `0-9` and `_`, starting with a letter
/// or `_`, and not `pg_*` (PostgreSQL's reserved prefix). Lower case only, so the name needs no
/// case folding rules and means the same quoted or not. `invalid_argument` otherwise.
pub fn validate_schema_name(schema: &str) -> Result<()> {
    let bytes = schema.as_bytes();
    let well_formed = !bytes.is_empty()
        && bytes.len() <= SCHEMA_NAME_BYTES_MAX
        && (bytes[0].is_ascii_lowercase() || bytes[0] == b'_')
        && bytes.iter().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'_')
        && !schema.starts_with("pg_");
    if !well_formed {
        return Err(Error::invalid(
            codes::INVALID_ARGUMENT,
            format!(
                "schema name {schema:?} must be 1..={SCHEMA_NAME_BYTES_MAX} bytes of a-z, 0-9 and _, start with a \
                 letter or _, and not start with pg_"
            ),
        ));
    }
    Ok(())
}

fn invalid(message: impl Into<String>) -> Error {
    Error::invalid(codes::INVALID_STORE, message)
}

impl StoreLocation {
    /// Parse a `--store` (see the module's documentation).
    pub fn parse(text: &str) -> Result<StoreLocation> {
        if text.is_empty() || text.len() > STORE_LOCATION_BYTES_MAX {
            return Err(invalid(format!("a store must be 1..={STORE_LOCATION_BYTES_MAX} bytes, got {}", text.len())));
        }
        if text.chars().any(char::is_control) {
            return Err(invalid("the store contains a control character"));
        }
        let lower = text.to_ascii_lowercase();
        if let Some(path) = lower.strip_prefix("sqlite:").map(|_| &text["sqlite:".len()..]) {
            let path = path.strip_prefix("//").unwrap_or(path);
            if path.is_empty() {
                return Err(invalid("sqlite: names no file"));
            }
            return Ok(StoreLocation::Sqlite(PathBuf::from(path)));
        }
        if !(lower.starts_with("postgres://") || lower.starts_with("postgresql://")) {
            if lower.contains("://") {
                let scheme = &text[..text.find("://").unwrap_or(0)];
                return Err(invalid(format!(
                    "unknown store scheme {scheme:?}; a store is a SQLite path, sqlite:<path> or postgres://..."
                )));
            }
            return Ok(StoreLocation::Sqlite(PathBuf::from(text)));
        }
        let mut url = url::Url::parse(text).map_err(|e| invalid(format!("not a PostgreSQL URL: {e}")))?;
        if url.host_str().is_none_or(str::is_empty) {
            return Err(invalid("the PostgreSQL URL names no host"));
        }
        if url.fragment().is_some() {
            return Err(invalid("the PostgreSQL URL has a fragment"));
        }
        let mut schema = None;
        let mut rest = Vec::new();
        for (key, value) in url.query_pairs() {
            if key == "schema" {
                if schema.replace(value.to_string()).is_some() {
                    return Err(invalid("the PostgreSQL URL names schema twice"));
                }
            } else {
                rest.push((key.to_string(), value.to_string()));
            }
        }
        let schema = schema.unwrap_or_else(|| POSTGRES_SCHEMA_DEFAULT.to_string());
        if rest.is_empty() {
            url.set_query(None);
        } else {
            url.query_pairs_mut().clear().extend_pairs(rest);
        }
        let conn = url.to_string();
        let mut shown = url.clone();
        if shown.password().is_some() {
            // Cannot fail: the URL has a host (checked above).
            let _ = shown.set_password(Some("***"));
        }
        shown.query_pairs_mut().append_pair("schema", &schema);
        Ok(StoreLocation::Postgres(PostgresLocation { conn, schema, masked: shown.to_string() }))
    }

    /// What outputs show: the path, or the URL with its password masked.
    pub fn masked(&self) -> String {
        match self {
            StoreLocation::Sqlite(path) => path.display().to_string(),
            StoreLocation::Postgres(pg) => pg.masked.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pg(text: &str) -> PostgresLocation {
        match StoreLocation::parse(text).unwrap() {
            StoreLocation::Postgres(pg) => pg,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn paths_and_sqlite_urls_are_files() {
        assert_eq!(StoreLocation::parse("wf.db").unwrap(), StoreLocation::Sqlite("wf.db".into()));
        assert_eq!(StoreLocation::parse("./a:b.db").unwrap(), StoreLocation::Sqlite("./a:b.db".into()));
        assert_eq!(StoreLocation::parse("sqlite:/x/wf.db").unwrap(), StoreLocation::Sqlite("/x/wf.db".into()));
        assert_eq!(StoreLocation::parse("sqlite:///x/wf.db").unwrap(), StoreLocation::Sqlite("/x/wf.db".into()));
    }

    #[test]
    fn a_postgres_url_loses_its_schema_parameter_and_masks_its_password() {
        let p = pg("postgres://postgres:secret@127.0.0.1:5432/test?schema=shop&connect_timeout=5");
        assert_eq!(p.schema, "shop");
        assert_eq!(p.conn, "postgres://postgres:secret@127.0.0.1:5432/test?connect_timeout=5");
        assert!(!p.masked.contains("secret"), "{}", p.masked);
        assert!(p.masked.contains("schema=shop"), "{}", p.masked);
        let p = pg("postgresql://postgres@localhost/test");
        assert_eq!(
            (p.schema.as_str(), p.conn.as_str()),
            (POSTGRES_SCHEMA_DEFAULT, "postgresql://postgres@localhost/test")
        );
    }

    #[test]
    fn anything_else_is_invalid_store() {
        for bad in [
            "",
            "mysql://h/db",
            "postgres://",
            "postgres:///test",
            "postgres://h/db?schema=a&schema=b",
            "postgres://h/db#x",
            "sqlite:",
            "a\nb",
        ] {
            let error = StoreLocation::parse(bad).unwrap_err();
            assert_eq!(error.code(), codes::INVALID_STORE, "{bad:?}: {error}");
        }
        let long = "x".repeat(STORE_LOCATION_BYTES_MAX + 1);
        assert_eq!(StoreLocation::parse(&long).unwrap_err().code(), codes::INVALID_STORE);
    }
}
