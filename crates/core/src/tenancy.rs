//! Tenants, access scopes and bearer-token text: the pure part of `tidemark serve`'s security.
//!
//! A tenant owns flows, consumers and runs; the server keeps each tenant's data in its own files,
//! so that no query can ever mix two tenants. A token is bound to one tenant and one scope.
//! Token text is `tmk_<token id>_<secret>`: the id finds the stored record, the secret is
//! compared (as a SHA-256 hash, in constant time) with the stored hash. Secrets are 256 random
//! bits, so a fast hash is enough: nobody can guess a preimage (unlike a password).

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{codes, Error, Result};

/// Tenant ids name folders, so they are stricter than other ids.
pub const TENANT_ID_BYTES_MAX: usize = 64;
/// Token ids: 16 lowercase hex characters.
pub const TOKEN_ID_LEN: usize = 16;
/// Token secrets: 64 lowercase hex characters (256 bits).
pub const TOKEN_SECRET_LEN: usize = 64;
/// A token's free-text label.
pub const TOKEN_LABEL_BYTES_MAX: usize = 200;
/// Prefix of every token text.
pub const TOKEN_PREFIX: &str = "tmk_";

/// What a token may do. Each scope includes the ones before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scope {
    /// Read anything of the tenant.
    Read,
    /// Read, and change runs, flows and inboxes: advance, enqueue, receive, start, cancel, retry,
    /// fork, skip, requeue, resolve.
    Operate,
    /// Operate, and manage the tenant's consumers and subscriptions, purge and prune.
    Admin,
}

impl Scope {
    /// The scope's word (`read`, `operate`, `admin`), as tokens store it and commands take it.
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Read => "read",
            Scope::Operate => "operate",
            Scope::Admin => "admin",
        }
    }

    /// The scope named by `value`; any other word is `invalid_argument`.
    pub fn parse(value: &str) -> Result<Scope> {
        [Scope::Read, Scope::Operate, Scope::Admin].into_iter().find(|s| s.as_str() == value).ok_or_else(|| {
            Error::invalid(codes::INVALID_ARGUMENT, format!("unknown scope {value:?}; scopes are read, operate, admin"))
        })
    }

    /// Whether a token of this scope may do what needs `needed`.
    pub fn allows(self, needed: Scope) -> bool {
        self >= needed
    }
}

/// 1..=64 characters of `[a-z0-9_-]`, starting with a letter or digit.
pub fn validate_tenant_id(value: &str) -> Result<()> {
    let ok_len = !value.is_empty() && value.len() <= TENANT_ID_BYTES_MAX;
    let ok_chars = value.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
    let ok_first = value.bytes().next().is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if ok_len && ok_chars && ok_first {
        return Ok(());
    }
    Err(Error::invalid(
        codes::INVALID_ID,
        format!(
            "tenant id must be 1..={TENANT_ID_BYTES_MAX} characters of a-z, 0-9, '_' and '-', starting with a \
             letter or digit; got {value:?}"
        ),
    ))
}

/// A token's label: free text, 0..=200 bytes, no control characters.
pub fn validate_label(value: &str) -> Result<()> {
    if value.len() > TOKEN_LABEL_BYTES_MAX || value.chars().any(char::is_control) {
        return Err(Error::invalid(
            codes::INVALID_ARGUMENT,
            format!("label must be 0..={TOKEN_LABEL_BYTES_MAX} bytes without control characters"),
        ));
    }
    Ok(())
}

/// A token as presented: its id and its secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenText {
    /// The token's id (16 lowercase hex characters): not secret, it finds the stored record.
    pub token_id: String,
    /// The token's secret (64 lowercase hex characters, 256 bits): only its SHA-256 is stored.
    pub secret: String,
}

impl TokenText {
    /// Split `tmk_<id>_<secret>`. Anything else is `unauthenticated` (the caller answers 401).
    pub fn parse(text: &str) -> Result<TokenText> {
        let malformed = || Error::invalid(codes::UNAUTHENTICATED, "malformed bearer token");
        let rest = text.strip_prefix(TOKEN_PREFIX).ok_or_else(malformed)?;
        let (id, secret) = rest.split_once('_').ok_or_else(malformed)?;
        let hex =
            |s: &str, len: usize| s.len() == len && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if !hex(id, TOKEN_ID_LEN) || !hex(secret, TOKEN_SECRET_LEN) {
            return Err(malformed());
        }
        Ok(TokenText { token_id: id.to_string(), secret: secret.to_string() })
    }

    /// A new token from 8 + 32 random bytes (the caller supplies the randomness; core does no I/O).
    pub fn from_random(id_bytes: [u8; 8], secret_bytes: [u8; 32]) -> TokenText {
        TokenText { token_id: hex::encode(id_bytes), secret: hex::encode(secret_bytes) }
    }

    /// The whole token text, `tmk_<token id>_<secret>`, as a client sends it after `Bearer `.
    pub fn text(&self) -> String {
        format!("{TOKEN_PREFIX}{}_{}", self.token_id, self.secret)
    }

    /// What is stored: the SHA-256 of the secret, hex.
    pub fn secret_hash(&self) -> String {
        hex::encode(Sha256::digest(self.secret.as_bytes()))
    }
}

mod hex {
    pub fn encode(bytes: impl AsRef<[u8]>) -> String {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let bytes = bytes.as_ref();
        let mut out = String::with_capacity(bytes.len() * 2);
        for b in bytes {
            out.push(DIGITS[(b >> 4) as usize] as char);
            out.push(DIGITS[(b & 15) as usize] as char);
        }
        out
    }
}

/// A declared consumer of a tenant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ConsumerRecord {
    /// The tenant the consumer belongs to.
    pub tenant_id: String,
    /// The logical consumer id, unique within its tenant.
    pub consumer_id: String,
    /// The name of the registered handler that applies the consumer's events (e.g. `reservation`,
    /// `record`, `workflows`).
    pub handler: String,
    /// When the consumer was declared, in ms since the Unix epoch.
    pub created_at_ms: i64,
}

/// A token as listed (never its secret).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TokenRecord {
    /// The token's id (16 hex characters), the part of the token text that is not secret.
    pub token_id: String,
    /// The tenant the token serves; its requests reach only that tenant's folder.
    pub tenant_id: String,
    /// What the token may do.
    pub scope: Scope,
    /// The operator's free-text label (0..=200 bytes).
    pub label: String,
    /// When the token was created, in ms since the Unix epoch.
    pub created_at_ms: i64,
    /// When the token was revoked, in ms since the Unix epoch; set once, never cleared. A revoked
    /// token is refused.
    pub revoked_at_ms: Option<i64>,
    /// The SHA-256 of the token's secret, hex (never serialised): what a presented secret is
    /// compared with, in constant time.
    #[serde(skip)]
    pub secret_hash: String,
}

/// The control store of `tidemark serve`: tenants, bearer tokens (hashed) and declared
/// consumers, shared by every process of a service. Tenants' own data is never here.
pub trait ControlStore: Send {
    /// Changes whenever anyone commits to the control store: a cache of tokens and consumers
    /// reloads when it moves.
    fn data_version(&self) -> Result<i64>;
    /// True when a call is a network round trip (a database server's), so that a caller on an
    /// async runtime makes it on a blocking thread instead of stalling a runtime worker. Default
    /// false (a local file).
    fn is_remote(&self) -> bool {
        false
    }
    /// Record `tenant_id` (1..=64 characters of `[a-z0-9_-]`, else `invalid_id`); true when it
    /// was new, false when it was already there.
    fn ensure_tenant(&mut self, tenant_id: &str, now_ms: i64) -> Result<bool>;
    /// Every tenant id, in order.
    fn tenants(&self) -> Result<Vec<String>>;
    /// Store a new token for `tenant_id` (created if new), in one transaction.
    fn create_token(
        &mut self,
        token: &TokenText,
        tenant_id: &str,
        scope: Scope,
        label: &str,
        now_ms: i64,
    ) -> Result<TokenRecord>;
    /// Every token, revoked ones included, oldest first.
    fn tokens(&self) -> Result<Vec<TokenRecord>>;
    /// Revoke a token (idempotent: revoking twice keeps the first time); `not_found` for an
    /// unknown token.
    fn revoke_token(&mut self, token_id: &str, now_ms: i64) -> Result<TokenRecord>;
    /// Declare a consumer (idempotent with the same handler; another handler is
    /// `already_exists`). Answers the record and whether it was new.
    fn declare_consumer(
        &mut self,
        tenant_id: &str,
        consumer_id: &str,
        handler: &str,
        now_ms: i64,
    ) -> Result<(ConsumerRecord, bool)>;
    /// Consumers of one tenant, or of all tenants, by (tenant, consumer id).
    fn consumers(&self, tenant_id: Option<&str>) -> Result<Vec<ConsumerRecord>>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_are_ordered() {
        assert!(Scope::Admin.allows(Scope::Operate));
        assert!(Scope::Operate.allows(Scope::Read));
        assert!(!Scope::Read.allows(Scope::Operate));
        assert!(!Scope::Operate.allows(Scope::Admin));
        assert_eq!(Scope::parse("operate").unwrap(), Scope::Operate);
        assert_eq!(Scope::parse("root").unwrap_err().code(), codes::INVALID_ARGUMENT);
    }

    #[test]
    fn tenant_ids_are_folder_safe() {
        for good in ["acme", "a", "team-1", "x_y", &"a".repeat(TENANT_ID_BYTES_MAX)] {
            validate_tenant_id(good).unwrap();
        }
        for bad in ["", ".", "..", "-a", "_a", "A", "a/b", "a.b", "a b", &"a".repeat(TENANT_ID_BYTES_MAX + 1)] {
            assert_eq!(validate_tenant_id(bad).unwrap_err().code(), codes::INVALID_ID, "{bad:?}");
        }
    }

    #[test]
    fn token_text_round_trips_and_rejects_garbage() {
        let token = TokenText::from_random([1; 8], [0xab; 32]);
        let text = token.text();
        assert_eq!(TokenText::parse(&text).unwrap(), token);
        assert_eq!(token.secret_hash().len(), 64);
        assert_ne!(token.secret_hash(), token.secret);
        for bad in ["", "tmk_", "Bearer x", &text.to_uppercase(), &text[..text.len() - 1], &format!("{text}0")] {
            assert_eq!(TokenText::parse(bad).unwrap_err().code(), codes::UNAUTHENTICATED, "{bad:?}");
        }
    }
}
