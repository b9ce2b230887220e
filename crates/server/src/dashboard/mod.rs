//! The dashboard: server-rendered HTML pages under `/ui` (maud templates, which escape every
//! spliced value), with htmx vendored for the overview's live refresh. No front-end build step.
//!
//! Every page and action goes through the same [`Caller`] as the JSON API (a token from the
//! `Authorization` header, or from the `tidemark_token` cookie that `/ui/login` sets) and through
//! the same shared functions of `api/` (`list_runs`, `control`, `fork_run`, `skip_step`,
//! `flow_view`, `deliveries`, `resolve_delivery`, `inbox_records`, `skip_record`), so scopes,
//! validation and limits are the API's: pages need `read`, actions need `operate`.
//!
//! **CSRF:** the cookie is `SameSite=Strict` (a browser does not send it with a request started by
//! another site) and `Path=/ui` (the JSON API under `/v1` never receives it from a browser).
//! Because `auth.mode = "none"` has no cookie at all, every non-GET request under `/ui` must also
//! carry an `Origin` (or, without one, a `Referer`) naming this server's own `Host`; anything
//! else is refused with 403 before any extractor runs (see [`same_origin`]).

mod assets;
mod flows;
mod layout;
mod overview;
mod runs;
mod sampler;
mod time;

use axum::extract::rejection::{FormRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::Router;
use maud::html;
use serde::Deserialize;
use tidemark_core::error::codes;
use tidemark_core::tenancy::Scope;
use tidemark_core::Error;

use crate::api::{status_of, ApiError};
use crate::auth::{AnyCaller, TOKEN_COOKIE};
use crate::AppState;

pub use sampler::{start as start_sampler, Samples};

/// How long the login cookie lives in the browser (the token's revocation still applies at
/// every request).
const COOKIE_MAX_AGE_S: u64 = 12 * 60 * 60;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/ui", get(overview::page))
        .route("/ui/live", get(overview::live))
        .route("/ui/login", get(login_page).post(login))
        .route("/ui/logout", post(logout))
        .route("/ui/runs", get(runs::list))
        .route("/ui/runs/{run_id}", get(runs::show))
        .route("/ui/runs/{run_id}/cancel", post(runs::cancel))
        .route("/ui/runs/{run_id}/retry", post(runs::retry))
        .route("/ui/runs/{run_id}/abandon", post(runs::abandon))
        .route("/ui/runs/{run_id}/fork", post(runs::fork))
        .route("/ui/runs/{run_id}/skip", post(runs::skip))
        .route("/ui/flows", get(flows::lookup))
        .route("/ui/flows/{flow_id}", get(flows::show))
        .route("/ui/quarantine", get(flows::quarantine))
        .route("/ui/subscriptions", get(flows::subscriptions))
        .route("/ui/outbox/{event_id}/{consumer_id}/resolve", post(flows::resolve))
        .route("/ui/dead-letters", get(runs::dead_letters))
        .route("/ui/schedules", get(runs::schedules))
        .route("/ui/queues", get(runs::queues))
        .route("/ui/schedules/{schedule_id}/pause", post(runs::pause_schedule))
        .route("/ui/schedules/{schedule_id}/resume", post(runs::resume_schedule))
        .route("/ui/consumers/{consumer_id}/inbox/{event_id}/skip", post(flows::skip_record))
        .route("/ui/assets/{file}", get(assets::serve))
        .layer(axum::middleware::from_fn(same_origin))
}

/// An error shown as an HTML page with the API's status and stable code; `unauthenticated`
/// sends the browser to the login form instead.
#[derive(Debug)]
pub struct UiError(pub Error);

impl From<Error> for UiError {
    fn from(error: Error) -> Self {
        UiError(error)
    }
}

impl From<ApiError> for UiError {
    fn from(error: ApiError) -> Self {
        UiError(error.0)
    }
}

impl From<FormRejection> for UiError {
    fn from(rejection: FormRejection) -> Self {
        let code = if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            codes::PAYLOAD_TOO_LARGE
        } else {
            codes::INVALID_ARGUMENT
        };
        UiError(Error::invalid(code, format!("bad form: {}", rejection.body_text())))
    }
}

impl From<QueryRejection> for UiError {
    fn from(rejection: QueryRejection) -> Self {
        UiError(Error::invalid(codes::INVALID_ARGUMENT, format!("bad query string: {}", rejection.body_text())))
    }
}

impl From<PathRejection> for UiError {
    fn from(rejection: PathRejection) -> Self {
        UiError(Error::invalid(codes::INVALID_ARGUMENT, format!("bad path: {}", rejection.body_text())))
    }
}

impl IntoResponse for UiError {
    fn into_response(self) -> Response {
        let status = status_of(&self.0);
        if status == StatusCode::UNAUTHORIZED {
            // A missing, unknown or revoked token: log in (again); forget a stale cookie.
            let mut response = Redirect::to("/ui/login").into_response();
            response.headers_mut().insert(header::SET_COOKIE, clear_cookie());
            return response;
        }
        if status.is_server_error() {
            tracing::error!(code = self.0.code(), error = %self.0, "internal error (dashboard)");
        }
        let body = html! {
            section.card.error-page {
                h1 { (status.as_u16()) " " (status.canonical_reason().unwrap_or("")) }
                p { "Code " code { (self.0.code()) } }
                p.message { (self.0.to_string()) }
                p { a href="javascript:history.back()" { "Back" } " · " a href="/ui" { "Overview" } }
            }
        };
        (status, layout::page("Error", None, body)).into_response()
    }
}

pub type UiResult<T = Response> = Result<T, UiError>;

/// The caller of a dashboard request (the API's [`Caller`]); its rejections are [`UiError`]s.
pub struct Ui(pub AnyCaller);

impl FromRequestParts<AppState> for Ui {
    type Rejection = UiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Ui, UiError> {
        Ok(Ui(AnyCaller::from_request_parts(parts, state).await?))
    }
}

/// `axum::Form` whose rejections are [`UiError`]s.
#[derive(FromRequest)]
#[from_request(via(axum::Form), rejection(UiError))]
pub struct Form<T>(pub T);

/// `axum::extract::Query` whose rejections are [`UiError`]s.
#[derive(FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(UiError))]
pub struct Query<T>(pub T);

/// `axum::extract::Path` whose rejections are [`UiError`]s.
#[derive(FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(UiError))]
pub struct Path<T>(pub T);

/// Refuse a state-changing request that did not come from one of this server's own pages: its
/// `Origin` (or, when a browser sent none, its `Referer`) must name the `Host` it was sent to.
/// A request with neither is refused too (browsers send `Origin` with every form POST).
async fn same_origin(request: Request, next: Next) -> Response {
    if matches!(*request.method(), Method::GET | Method::HEAD) {
        return next.run(request).await;
    }
    match check_same_origin(request.headers()) {
        Ok(()) => next.run(request).await,
        Err(error) => UiError(error).into_response(),
    }
}

fn check_same_origin(headers: &HeaderMap) -> Result<(), Error> {
    let refuse = |why: String| Error::invalid(codes::FORBIDDEN, format!("cross-site request refused: {why}"));
    let host = headers.get(header::HOST).and_then(|h| h.to_str().ok()).ok_or_else(|| refuse("no Host".into()))?;
    let text = |name: header::HeaderName| headers.get(name).and_then(|v: &HeaderValue| v.to_str().ok());
    let (what, value) = match (text(header::ORIGIN), text(header::REFERER)) {
        (Some(origin), _) => ("Origin", origin),
        (None, Some(referer)) => ("Referer", referer),
        (None, None) => return Err(refuse("the request has neither an Origin nor a Referer header".into())),
    };
    let rest = value.strip_prefix("http://").or_else(|| value.strip_prefix("https://"));
    let authority = rest.map(|r| r.split(['/', '?', '#']).next().unwrap_or(""));
    if authority != Some(host) {
        return Err(refuse(format!("{what} {value:?} is not this server ({host})")));
    }
    Ok(())
}

fn token_cookie(text: &str, secure: bool) -> HeaderValue {
    let secure = if secure { "; Secure" } else { "" };
    HeaderValue::from_str(&format!(
        "{TOKEN_COOKIE}={text}; Path=/ui; HttpOnly; SameSite=Strict; Max-Age={COOKIE_MAX_AGE_S}{secure}"
    ))
    .expect("a verified token is cookie-safe")
}

fn clear_cookie() -> HeaderValue {
    HeaderValue::from_str(&format!("{TOKEN_COOKIE}=; Path=/ui; HttpOnly; SameSite=Strict; Max-Age=0"))
        .expect("a constant")
}

/// A redirect after a successful action (303: the browser follows with a GET).
fn see_other(path: &str) -> Response {
    Redirect::to(path).into_response()
}

async fn login_page(State(state): State<AppState>) -> Response {
    login_form(&state, StatusCode::OK, None)
}

fn login_form(state: &AppState, status: StatusCode, error: Option<&str>) -> Response {
    let body = html! {
        section.card.login {
            h1 { "Log in" }
            @if state.config.auth_disabled() {
                p.notice { "Authentication is disabled on this server (auth.mode = \"none\"): no token is needed. "
                    a href="/ui" { "Open the dashboard" } }
            } @else {
                p { "Paste a token made with " code { "tidemark token create" } ". It is kept in an HttpOnly, "
                    "SameSite=Strict cookie sent only to /ui; pages need the read scope, actions need operate." }
                @if let Some(error) = error { p.flash.bad { (error) } }
                form method="post" action="/ui/login" {
                    label for="token" { "Token" }
                    input #token type="password" name="token" autocomplete="off" required autofocus;
                    button type="submit" { "Log in" }
                }
            }
        }
    };
    (status, layout::page("Log in", None, body)).into_response()
}

#[derive(Deserialize)]
struct LoginForm {
    token: String,
}

async fn login(State(state): State<AppState>, headers: HeaderMap, Form(form): Form<LoginForm>) -> Response {
    if state.config.auth_disabled() {
        return see_other("/ui");
    }
    let arrived = std::time::Instant::now();
    let verified = state.control_cache.lock().unwrap_or_else(|p| p.into_inner()).verify(form.token.trim(), arrived);
    match verified {
        Ok(record) => {
            tracing::info!(tenant = %record.tenant_id, token = %record.token_id, "dashboard login");
            let secure =
                headers.get(header::ORIGIN).and_then(|o| o.to_str().ok()).is_some_and(|o| o.starts_with("https://"));
            let mut response = see_other("/ui");
            response.headers_mut().insert(header::SET_COOKIE, token_cookie(form.token.trim(), secure));
            response
        }
        Err(error) => login_form(&state, StatusCode::UNAUTHORIZED, Some(&error.to_string())),
    }
}

async fn logout() -> Response {
    let mut response = see_other("/ui/login");
    response.headers_mut().insert(header::SET_COOKIE, clear_cookie());
    response
}

/// Who is looking, for the page header.
pub struct Viewer {
    pub tenant: String,
    pub scope: Scope,
}

impl From<&AnyCaller> for Viewer {
    fn from(caller: &AnyCaller) -> Self {
        Viewer { tenant: caller.tenant.id().to_string(), scope: caller.scope }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(header::HeaderName, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(name.clone(), HeaderValue::from_str(value).unwrap());
        }
        map
    }

    #[test]
    fn same_origin_accepts_only_this_host() {
        let host = (header::HOST, "127.0.0.1:8080");
        assert!(check_same_origin(&headers(&[host.clone(), (header::ORIGIN, "http://127.0.0.1:8080")])).is_ok());
        assert!(
            check_same_origin(&headers(&[host.clone(), (header::REFERER, "http://127.0.0.1:8080/ui/runs/x")])).is_ok()
        );
        for bad in [
            vec![host.clone()],
            vec![host.clone(), (header::ORIGIN, "http://evil.example")],
            vec![host.clone(), (header::ORIGIN, "http://127.0.0.1:8080.evil.example")],
            vec![host.clone(), (header::ORIGIN, "null")],
            vec![host.clone(), (header::REFERER, "http://evil.example/?http://127.0.0.1:8080/")],
            vec![(header::ORIGIN, "http://127.0.0.1:8080")],
        ] {
            let error = check_same_origin(&headers(&bad)).unwrap_err();
            assert_eq!(error.code(), codes::FORBIDDEN, "{bad:?}");
        }
    }
}
