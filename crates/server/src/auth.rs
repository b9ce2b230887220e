//! Who is calling: bearer tokens (hashed at rest, compared in constant time), their tenant and
//! scope, and a per-token rate limit. A token comes in the `Authorization: Bearer` header, or
//! (for the dashboard in a browser) in the `tidemark_token` cookie. With `auth.mode = "none"`
//! every request is an admin of the configured development tenant.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use subtle::ConstantTimeEq;
use tidemark_core::error::codes;
use tidemark_core::tenancy::{ConsumerRecord, ControlStore, TokenRecord};
use tidemark_core::tenancy::{Scope, TokenText};
use tidemark_core::{Error, Result};

use crate::api::ApiError;
use crate::backend::{AnyTenant, Backend, Sqlite};
use crate::tenant::Tenant;
use crate::AppState;

/// The control store and what is read from it on every request or delivery round (tokens,
/// declared consumers), reloaded whenever it changed: another process (for example `tidemark
/// token revoke`) committed to it, or this server wrote through [`Self::control`]. A revocation
/// takes effect at the next request: a request is answered from a check of the control store
/// that **began after the request arrived**, so it sees every change committed before it arrived.
/// Checking costs one `PRAGMA data_version` on SQLite, one read of the change counter on
/// PostgreSQL (a network round trip); requests that arrived before a check began share it, so
/// under load a check serves every request waiting for it instead of one round trip each.
pub struct ControlCache {
    control: Box<dyn ControlStore>,
    data_version: i64,
    /// When the last completed check began (`None`: the next request checks).
    checked_at: Option<Instant>,
    by_id: HashMap<String, TokenRecord>,
    consumers: Vec<ConsumerRecord>,
}

impl ControlCache {
    pub fn new(control: Box<dyn ControlStore>) -> Result<ControlCache> {
        let mut cache = ControlCache {
            control,
            data_version: i64::MIN,
            checked_at: None,
            by_id: HashMap::new(),
            consumers: Vec::new(),
        };
        cache.refresh(Instant::now())?;
        Ok(cache)
    }

    /// The consumers declared for `tenant_id`, by consumer id, as of a check that began at or
    /// after `arrived`.
    pub fn consumers(&mut self, tenant_id: &str, arrived: Instant) -> Result<Vec<ConsumerRecord>> {
        self.refresh(arrived)?;
        Ok(self.consumers.iter().filter(|c| c.tenant_id == tenant_id).cloned().collect())
    }

    pub fn control(&mut self) -> &mut dyn ControlStore {
        // Anything written through here changes `data_version` only for other connections, so
        // force a reload at the next check.
        self.data_version = i64::MIN;
        self.checked_at = None;
        self.control.as_mut()
    }

    /// Make the cache current as of a check that began at or after `arrived` (the moment the
    /// caller's request arrived, taken before it waited for the cache): reuse the last check when
    /// it began after that, else check now.
    fn refresh(&mut self, arrived: Instant) -> Result<()> {
        if self.checked_at.is_some_and(|began| began >= arrived) {
            return Ok(());
        }
        let began = Instant::now();
        let version = self.control.data_version()?;
        if version != self.data_version {
            self.by_id = self.control.tokens()?.into_iter().map(|t| (t.token_id.clone(), t)).collect();
            self.consumers = self.control.consumers(None)?;
            self.data_version = version;
        }
        self.checked_at = Some(began);
        Ok(())
    }

    /// The live token this text proves, or `unauthenticated`, as of a check that began at or
    /// after `arrived` (when the request arrived).
    pub fn verify(&mut self, text: &str, arrived: Instant) -> Result<TokenRecord> {
        let presented = TokenText::parse(text)?;
        self.refresh(arrived)?;
        let unknown = || Error::invalid(codes::UNAUTHENTICATED, "unknown or revoked token");
        let record = self.by_id.get(&presented.token_id).ok_or_else(unknown)?;
        let matches: bool = record.secret_hash.as_bytes().ct_eq(presented.secret_hash().as_bytes()).into();
        if !matches || record.revoked_at_ms.is_some() {
            return Err(unknown());
        }
        Ok(record.clone())
    }
}

/// The cookie the dashboard keeps a token in (set by `POST /ui/login`, `Path=/ui`, HttpOnly,
/// SameSite=Strict; see docs/dashboard.md).
pub const TOKEN_COOKIE: &str = "tidemark_token";

/// The token a request presents: the `Authorization: Bearer` header, else the dashboard's cookie.
fn presented_token(headers: &axum::http::HeaderMap) -> Result<&str> {
    if let Some(header) = headers.get(axum::http::header::AUTHORIZATION) {
        return header.to_str().ok().and_then(|h| h.strip_prefix("Bearer ")).map(str::trim).ok_or_else(|| {
            Error::invalid(codes::UNAUTHENTICATED, "the Authorization header must be `Bearer <token>`")
        });
    }
    cookie(headers, TOKEN_COOKIE)
        .ok_or_else(|| Error::invalid(codes::UNAUTHENTICATED, "missing Authorization: Bearer <token>"))
}

/// The value of a cookie in the request's `Cookie` headers.
pub fn cookie<'h>(headers: &'h axum::http::HeaderMap, name: &str) -> Option<&'h str> {
    headers
        .get_all(axum::http::header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(key, _)| *key == name)
        .map(|(_, value)| value.trim())
        .filter(|value| !value.is_empty())
}

pub fn rate_limiter(per_second: u32, burst: u32) -> DefaultKeyedRateLimiter<String> {
    let per_second = NonZeroU32::new(per_second.max(1)).expect("at least 1");
    let burst = NonZeroU32::new(burst.max(1)).expect("at least 1");
    RateLimiter::keyed(Quota::per_second(per_second).allow_burst(burst))
}

/// The caller of a request on a service of backend `B`: its tenant (opened) and scope. What a
/// route of your own takes (`caller.tenant.transaction(...)`).
pub struct Caller<B: Backend = Sqlite> {
    /// The tenant the token belongs to: the request is served only from this tenant's stores.
    pub tenant: Arc<Tenant<B>>,
    /// What the token may do.
    pub scope: Scope,
}

/// The caller of a request, its tenant on whichever backend the service runs on: what the
/// service's own routes take.
pub struct AnyCaller {
    /// The tenant the token belongs to: the request is served only from this tenant's stores.
    pub tenant: AnyTenant,
    /// What the token may do.
    pub scope: Scope,
}

/// Check that `scope` includes `needed`; 403 `forbidden` otherwise.
fn require(scope: Scope, needed: Scope) -> Result<(), ApiError> {
    if scope.allows(needed) {
        return Ok(());
    }
    Err(Error::invalid(
        codes::FORBIDDEN,
        format!("this token's scope is {}; the request needs {}", scope.as_str(), needed.as_str()),
    )
    .into())
}

impl<B: Backend> Caller<B> {
    /// Check that the caller's scope includes `needed`; 403 `forbidden` otherwise.
    pub fn require(&self, needed: Scope) -> Result<(), ApiError> {
        require(self.scope, needed)
    }
}

impl AnyCaller {
    /// Check that the caller's scope includes `needed`; 403 `forbidden` otherwise.
    pub fn require(&self, needed: Scope) -> Result<(), ApiError> {
        require(self.scope, needed)
    }
}

impl FromRequestParts<AppState> for AnyCaller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<AnyCaller, ApiError> {
        if state.config.auth_disabled() {
            let tenant = state.tenant(&state.config.auth.dev_tenant).await?;
            return Ok(AnyCaller { tenant, scope: Scope::Admin });
        }
        let text = presented_token(&parts.headers)?.to_string();
        let arrived = Instant::now();
        let check = {
            let state = state.clone();
            move || state.control_cache.lock().unwrap_or_else(|p| p.into_inner()).verify(&text, arrived)
        };
        // A check on a database server is a round trip: made on a blocking thread, so that the
        // runtime's workers go on serving while it (and the requests sharing it) wait.
        let record = if state.control_remote {
            tokio::task::spawn_blocking(check)
                .await
                .map_err(|e| Error::Invariant(format!("the token check panicked: {e}")))??
        } else {
            check()?
        };
        if state.limiter.check_key(&record.token_id).is_err() {
            state.metrics.rate_limited.inc();
            return Err(Error::invalid(codes::RATE_LIMITED, "too many requests for this token; slow down").into());
        }
        let tenant = state.tenant(&record.tenant_id).await?;
        Ok(AnyCaller { tenant, scope: record.scope })
    }
}

impl<B: Backend> FromRequestParts<AppState> for Caller<B> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Caller<B>, ApiError> {
        let AnyCaller { tenant, scope } = AnyCaller::from_request_parts(parts, state).await?;
        let tenant = B::unwrap(&tenant).cloned().ok_or_else(|| {
            Error::Invariant(format!("a route typed for another backend was mounted on tenant {:?}", tenant.id()))
        })?;
        Ok(Caller { tenant, scope })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use tidemark_store_sqlite::{Durability, SqliteControl};

    use super::*;

    /// The real SQLite control store, counting the checks made through it.
    struct Counted {
        store: SqliteControl,
        checks: Arc<AtomicU64>,
    }

    impl ControlStore for Counted {
        fn data_version(&self) -> Result<i64> {
            self.checks.fetch_add(1, Ordering::SeqCst);
            self.store.data_version()
        }
        fn ensure_tenant(&mut self, tenant_id: &str, now_ms: i64) -> Result<bool> {
            self.store.ensure_tenant(tenant_id, now_ms)
        }
        fn tenants(&self) -> Result<Vec<String>> {
            self.store.tenants()
        }
        fn create_token(
            &mut self,
            token: &TokenText,
            tenant_id: &str,
            scope: Scope,
            label: &str,
            now_ms: i64,
        ) -> Result<TokenRecord> {
            self.store.create_token(token, tenant_id, scope, label, now_ms)
        }
        fn tokens(&self) -> Result<Vec<TokenRecord>> {
            self.store.tokens()
        }
        fn revoke_token(&mut self, token_id: &str, now_ms: i64) -> Result<TokenRecord> {
            self.store.revoke_token(token_id, now_ms)
        }
        fn declare_consumer(
            &mut self,
            tenant_id: &str,
            consumer_id: &str,
            handler: &str,
            now_ms: i64,
        ) -> Result<(ConsumerRecord, bool)> {
            self.store.declare_consumer(tenant_id, consumer_id, handler, now_ms)
        }
        fn consumers(&self, tenant_id: Option<&str>) -> Result<Vec<ConsumerRecord>> {
            self.store.consumers(tenant_id)
        }
    }

    #[test]
    fn requests_share_a_check_that_began_after_they_arrived_and_a_revocation_before_a_request_is_seen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("control.db");
        let mut other_process = SqliteControl::open(&path, true, Durability::Full).unwrap();
        let token = TokenText::from_random([1; 8], [2; 32]);
        other_process.create_token(&token, "acme", Scope::Operate, "", 1).unwrap();
        let checks = Arc::new(AtomicU64::new(0));
        let store = SqliteControl::open(&path, false, Durability::Full).unwrap();
        let mut cache = ControlCache::new(Box::new(Counted { store, checks: checks.clone() })).unwrap();
        let after_open = checks.load(Ordering::SeqCst);

        // Requests that arrived before the last check began are answered from it.
        let early = Instant::now();
        cache.verify(&token.text(), early).unwrap();
        assert_eq!(checks.load(Ordering::SeqCst), after_open + 1);
        cache.verify(&token.text(), early).unwrap();
        cache.consumers("acme", early).unwrap();
        assert_eq!(checks.load(Ordering::SeqCst), after_open + 1, "one check served both");

        // A revocation committed elsewhere before a request arrived is seen by that request.
        other_process.revoke_token(&token.token_id, 2).unwrap();
        let late = Instant::now();
        let refused = cache.verify(&token.text(), late).unwrap_err();
        assert_eq!(refused.code(), codes::UNAUTHENTICATED);
        assert_eq!(checks.load(Ordering::SeqCst), after_open + 2);

        // A write through the cache forces the next request to check, whenever it arrived.
        cache.control().declare_consumer("acme", "shipping", "record", 3).unwrap();
        assert_eq!(cache.consumers("acme", early).unwrap().len(), 1);
        assert_eq!(checks.load(Ordering::SeqCst), after_open + 3);
    }
}
