//! Who is calling: bearer tokens (hashed at rest, compared in constant time), their tenant and
//! scope, and a per-token rate limit. A token comes in the `Authorization: Bearer` header, or
//! (for the dashboard in a browser) in the `tidemark_token` cookie. With `auth.mode = "none"`
//! every request is an admin of the configured development tenant.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Arc;

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
/// takes effect at the next request. Checking costs one `PRAGMA data_version` on SQLite, one
/// read of the change counter on PostgreSQL.
pub struct ControlCache {
    control: Box<dyn ControlStore>,
    data_version: i64,
    by_id: HashMap<String, TokenRecord>,
    consumers: Vec<ConsumerRecord>,
}

impl ControlCache {
    pub fn new(control: Box<dyn ControlStore>) -> Result<ControlCache> {
        let mut cache = ControlCache { control, data_version: i64::MIN, by_id: HashMap::new(), consumers: Vec::new() };
        cache.refresh()?;
        Ok(cache)
    }

    /// The consumers declared for `tenant_id`, by consumer id.
    pub fn consumers(&mut self, tenant_id: &str) -> Result<Vec<ConsumerRecord>> {
        self.refresh()?;
        Ok(self.consumers.iter().filter(|c| c.tenant_id == tenant_id).cloned().collect())
    }

    pub fn control(&mut self) -> &mut dyn ControlStore {
        // Anything written through here changes `data_version` only for other connections, so
        // force a reload at the next check.
        self.data_version = i64::MIN;
        self.control.as_mut()
    }

    fn refresh(&mut self) -> Result<()> {
        let version = self.control.data_version()?;
        if version != self.data_version {
            self.by_id = self.control.tokens()?.into_iter().map(|t| (t.token_id.clone(), t)).collect();
            self.consumers = self.control.consumers(None)?;
            self.data_version = version;
        }
        Ok(())
    }

    /// The live token this text proves, or `unauthenticated`.
    pub fn verify(&mut self, text: &str) -> Result<TokenRecord> {
        let presented = TokenText::parse(text)?;
        self.refresh()?;
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
        let text = presented_token(&parts.headers)?;
        let record = state.control_cache.lock().unwrap_or_else(|p| p.into_inner()).verify(text)?;
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
