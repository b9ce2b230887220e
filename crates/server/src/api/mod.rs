//! The HTTP API (JSON under `/v1`), health endpoints and `/metrics`, and the one place where
//! errors become HTTP statuses.
//!
//! Every error answer is `{"error": {"code": "<stable code>", "message": "..."}}`. Bad input is
//! validated before anything is queued for a store, so a 4xx answer never wrote anything.
//!
//! Every route is declared with `#[utoipa::path]` and mounted through `routes!` on an
//! `OpenApiRouter`, so the router and the OpenAPI document (`GET /openapi.json`, see
//! `openapi.rs`) come from the same declarations: a route cannot exist undocumented.

pub(crate) mod flows;
pub(crate) mod inbox;
pub mod openapi;
pub(crate) mod queues;
pub(crate) mod registry;
pub(crate) mod runs;
pub(crate) mod schedules;
pub(crate) mod subscriptions;

use axum::body::Bytes;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, FromRequest, FromRequestParts, MatchedPath, Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Value};
use tidemark_core::error::codes;
use tidemark_core::workflow::workflow_codes;
use tidemark_core::Error;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::AppState;

/// An error answer.
#[derive(Debug)]
pub struct ApiError(pub Error);

/// The body of every error answer.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ErrorBody {
    /// What went wrong: its stable code and a message.
    pub error: ErrorDetail,
}

/// The `error` object of an error answer.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ErrorDetail {
    /// A stable machine code (`invalid_id`, `not_found`, `forbidden`, ...; see docs/api.md).
    #[schema(example = "not_found")]
    pub code: String,
    /// For a person; may change between releases.
    pub message: String,
}

/// The answer of `/healthz` and `/readyz`.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Health {
    /// `ok` (healthz) or `ready` (readyz).
    #[schema(example = "ok")]
    pub status: String,
}

impl From<Error> for ApiError {
    fn from(error: Error) -> Self {
        ApiError(error)
    }
}

/// The HTTP status of an error code.
pub fn status_of(error: &Error) -> StatusCode {
    if error.code() == codes::STORAGE_FULL {
        return StatusCode::INSUFFICIENT_STORAGE;
    }
    if error.code() == codes::STORE_UNAVAILABLE {
        return StatusCode::SERVICE_UNAVAILABLE;
    }
    if !error.is_invalid_input() {
        return StatusCode::INTERNAL_SERVER_ERROR;
    }
    match error.code() {
        codes::NOT_FOUND => StatusCode::NOT_FOUND,
        codes::UNAUTHENTICATED => StatusCode::UNAUTHORIZED,
        codes::FORBIDDEN => StatusCode::FORBIDDEN,
        codes::RATE_LIMITED | codes::RUN_EVENTS_FULL => StatusCode::TOO_MANY_REQUESTS,
        codes::PAYLOAD_TOO_LARGE => StatusCode::PAYLOAD_TOO_LARGE,
        codes::UNAVAILABLE => StatusCode::SERVICE_UNAVAILABLE,
        codes::ALREADY_EXISTS
        | codes::INVALID_STATE_CHANGE
        | codes::STALE
        | codes::INVALID_TRANSITION
        | workflow_codes::RUN_CONFLICT => StatusCode::CONFLICT,
        _ => StatusCode::BAD_REQUEST,
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = status_of(&self.0);
        if status.is_server_error() {
            tracing::error!(code = self.0.code(), error = %self.0, "internal error");
        }
        let body = json!({"error": {"code": self.0.code(), "message": self.0.to_string()}});
        (status, axum::Json(body)).into_response()
    }
}

impl From<QueryRejection> for ApiError {
    fn from(rejection: QueryRejection) -> Self {
        ApiError(Error::invalid(codes::INVALID_ARGUMENT, format!("bad query string: {}", rejection.body_text())))
    }
}

/// A JSON request body, decoded by [`decode_body`]: its rejections are JSON errors with stable
/// codes (`invalid_argument`, `payload_too_large`, `inexact_number`).
pub struct Json<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for Json<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        if !is_json(request.headers()) {
            return Err(ApiError(Error::invalid(
                codes::INVALID_ARGUMENT,
                "bad JSON body: expected a request with `Content-Type: application/json`",
            )));
        }
        let bytes = Bytes::from_request(request, state).await.map_err(|rejection| {
            let code = if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                codes::PAYLOAD_TOO_LARGE
            } else {
                codes::INVALID_ARGUMENT
            };
            ApiError(Error::invalid(code, format!("bad JSON body: {}", rejection.body_text())))
        })?;
        Ok(Json(decode_body(&bytes)?))
    }
}

/// `application/json`, or an `application/...+json` type, as axum's own `Json` accepts.
fn is_json(headers: &axum::http::HeaderMap) -> bool {
    let Some(value) = headers.get(axum::http::header::CONTENT_TYPE).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let essence = value.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
    essence == "application/json" || (essence.starts_with("application/") && essence.ends_with("+json"))
}

/// Decode a request body as every JSON route does: `T` from the bytes (`invalid_argument` for
/// malformed JSON, a missing or unknown field, a value of the wrong type, a JSON array where `T`
/// or a struct nested in it is an object: serde's derived structs would read `[null, null]` as
/// their fields in order), then every number of the body checked by
/// [`tidemark_core::json::check_numbers`] (`inexact_number` for one the canonical encoding would
/// change, such as 2^64). The routes' own checks come after it. A body type that is itself a
/// sequence (`Vec<T>`) still reads a JSON array.
pub fn decode_body<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, Error> {
    let body = tidemark_core::json::from_slice(bytes)
        .map_err(|e| Error::invalid(codes::INVALID_ARGUMENT, format!("bad JSON body: {e}")))?;
    tidemark_core::json::check_numbers(bytes)?;
    Ok(body)
}

impl<T: serde::Serialize> IntoResponse for Json<T> {
    fn into_response(self) -> Response {
        axum::Json(self.0).into_response()
    }
}

impl From<PathRejection> for ApiError {
    fn from(rejection: PathRejection) -> Self {
        ApiError(Error::invalid(codes::INVALID_ARGUMENT, format!("bad path: {}", rejection.body_text())))
    }
}

/// `axum::extract::Path` whose rejections are JSON errors with stable codes.
#[derive(FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(ApiError))]
pub struct Path<T>(pub T);

/// `deserialize_with` for an optional integer query parameter: `344`, or `344.0` (a number with
/// a zero fraction is an integer to JSON Schema, which the document speaks), nothing else.
pub(crate) fn query_integer<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: std::str::FromStr,
    T::Err: std::fmt::Display,
{
    use serde::de::Error as _;
    let Some(text) = <Option<String> as serde::Deserialize>::deserialize(deserializer)? else { return Ok(None) };
    let digits = match text.split_once('.') {
        Some((whole, zeros)) if !zeros.is_empty() && zeros.bytes().all(|b| b == b'0') => whole,
        Some(_) => return Err(D::Error::custom(format!("{text:?} is not an integer"))),
        None => text.as_str(),
    };
    digits.parse().map(Some).map_err(|e| D::Error::custom(format!("{text:?} is not an integer: {e}")))
}

/// `axum::extract::Query` whose rejections are JSON errors with stable codes.
#[derive(FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(ApiError))]
pub struct Query<T>(pub T);

/// What a route handler returns: its answer, or an [`ApiError`] mapped to its status.
pub type ApiResult<T = Response> = Result<T, ApiError>;

/// A JSON answer with a status.
pub fn answer(status: StatusCode, body: Value) -> Response {
    (status, axum::Json(body)).into_response()
}

/// A typed JSON answer with a status (the type is the one the OpenAPI document names).
pub fn typed<T: Serialize>(status: StatusCode, body: T) -> Response {
    (status, axum::Json(body)).into_response()
}

/// Check a page size against the configured maximum.
pub fn page_size(state: &AppState, limit: Option<usize>) -> Result<usize, ApiError> {
    let limit = limit.unwrap_or(100.min(state.config.limits.page_size_max));
    tidemark_core::id::validate_limit("limit", limit, state.config.limits.page_size_max)?;
    Ok(limit)
}

/// The length of `item`'s JSON, counted without building it. An item that cannot be serialized
/// counts what was written before the failure; it fails the whole answer later, with its own
/// error.
pub fn json_len<T: Serialize + ?Sized>(item: &T) -> usize {
    let mut counter = tidemark_core::envelope::ByteCount(0);
    let _ = serde_json::to_writer(&mut counter, item);
    counter.0
}

/// Cut `items` to the longest prefix whose JSON fits in `limits.page_bytes_max` (the first item
/// always stays, however large); true when it cut some. Each item is measured by serializing it
/// into a counter, not a buffer.
pub fn fit_page<T: Serialize>(state: &AppState, items: &mut Vec<T>) -> bool {
    let budget = state.config.limits.page_bytes_max;
    let mut used = 0;
    let fits = items
        .iter()
        .position(|item| {
            used += json_len(item) + 1; // the comma between items
            used > budget
        })
        .map_or(items.len(), |cut| cut.max(1));
    let cut = fits < items.len();
    items.truncate(fits);
    cut
}

/// Every route with its OpenAPI description, in one router.
pub fn documented_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(openapi::base())
        .routes(routes!(healthz))
        .routes(routes!(readyz))
        .routes(routes!(metrics))
        .routes(routes!(openapi::document))
        .merge(flows::routes())
        .merge(inbox::routes())
        .merge(subscriptions::routes())
        .merge(runs::routes())
        .merge(schedules::routes())
        .merge(queues::routes())
        .merge(registry::routes())
}

/// The API, the dashboard and the `extra` routes of the service's registrations, in one router.
pub fn router(state: AppState, extra: Vec<OpenApiRouter<AppState>>) -> Router {
    let body_max = state.config.limits.body_bytes_max;
    let routes = extra.into_iter().fold(documented_routes(), |all, more| all.merge(more));
    let (routes, document) = routes.split_for_parts();
    let document = openapi::finish(document, &state.config, &state.registry);
    // The dashboard's pages are HTML for people, outside the JSON API and its document.
    routes
        .route("/", axum::routing::get(|| async { axum::response::Redirect::to("/ui") }))
        .merge(crate::dashboard::routes())
        .layer(axum::Extension(document))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(body_max))
        .layer(axum::middleware::from_fn_with_state(state.clone(), hold_refusals))
        .layer(axum::middleware::from_fn_with_state(state.clone(), count_requests))
        .with_state(state)
}

/// Hold a 401 or 429 answer `auth.refusal_delay_ms` before it is sent: a client that guesses
/// tokens or exceeds its rate on a connection is refused about ten times a second there, not as
/// fast as the server can refuse (which took its time from every other connection).
async fn hold_refusals(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    let delay = state.config.auth.refusal_delay_ms;
    if delay > 0 && matches!(response.status(), StatusCode::UNAUTHORIZED | StatusCode::TOO_MANY_REQUESTS) {
        tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
    }
    response
}

async fn count_requests(State(state): State<AppState>, request: Request, next: Next) -> Response {
    use tracing::Instrument;
    let method = request.method().clone();
    let route = request.extensions().get::<MatchedPath>().map_or("unmatched", |p| p.as_str()).to_string();
    // Every log line of the request carries its path (and so its flow, run or consumer id).
    let span = tracing::info_span!("request", method = %method, route = %route, path = %request.uri().path());
    // With the `otel` feature the span joins the caller's trace, when it sent one.
    let traceparent = request.headers().get("traceparent").and_then(|v| v.to_str().ok());
    crate::trace::join(&span, traceparent);
    let response = next.run(request).instrument(span).await;
    let labels = crate::metrics::RequestLabels {
        method: method.as_str().to_string(),
        route,
        status: response.status().as_u16(),
    };
    state.metrics.requests.get_or_create(&labels).inc();
    response
}

/// Liveness: the process answers.
#[utoipa::path(get, path = "/healthz", tag = "service", responses((status = 200, body = Health)))]
async fn healthz() -> Response {
    typed(StatusCode::OK, Health { status: "ok".into() })
}

/// Readiness: listening, not starting or shutting down.
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "service",
    responses(
        (status = 200, body = Health),
        (status = 503, description = "`unavailable`: starting or shutting down", body = ErrorBody),
    )
)]
async fn readyz(State(state): State<AppState>) -> Response {
    if state.is_ready() {
        typed(StatusCode::OK, Health { status: "ready".into() })
    } else {
        let error = Error::invalid(codes::UNAVAILABLE, "starting or shutting down");
        ApiError(error).into_response()
    }
}

/// Prometheus metrics (OpenMetrics text format).
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "service",
    responses((
        status = 200,
        description = "OpenMetrics text, ending with `# EOF`",
        body = String,
        content_type = "application/openmetrics-text"
    ))
)]
async fn metrics(State(state): State<AppState>) -> Response {
    let body = crate::metrics::scrape(&state).await;
    ([(axum::http::header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], body)
        .into_response()
}

async fn not_found(method: Method, uri: axum::http::Uri) -> ApiError {
    ApiError(Error::not_found(format!("no route {method} {}", uri.path())))
}

async fn method_not_allowed(method: Method, uri: axum::http::Uri) -> Response {
    let body = json!({"error": {"code": "method_not_allowed", "message": format!("{method} is not allowed on {}", uri.path())}});
    (StatusCode::METHOD_NOT_ALLOWED, axum::Json(body)).into_response()
}

#[cfg(test)]
mod tests {
    use tidemark_core::error::codes;

    use super::{decode_body, flows, inbox, queues, runs, schedules, subscriptions};

    /// schemathesis found `PUT /v1/queues/{name}` accepting the body `[null, null]`: serde's
    /// derived structs read a JSON array as their fields in order, so it declared a queue
    /// without limits. A body (and a struct nested in one) is a JSON object or refused.
    #[test]
    fn put_queue_refuses_the_array_body_null_null() {
        let error = decode_body::<queues::QueueBody>(b"[null, null]").err().expect("an array is not a queue body");
        assert_eq!(error.code(), codes::INVALID_ARGUMENT, "{error}");
        assert!(error.to_string().contains("invalid type: sequence, expected struct QueueBody"), "{error}");
        // Nested: a rate is an object too.
        let error = decode_body::<queues::QueueBody>(br#"{"rate": [5, 60000]}"#).err().expect("a rate array");
        assert_eq!(error.code(), codes::INVALID_ARGUMENT, "{error}");
        // The object forms still read.
        let body =
            decode_body::<queues::QueueBody>(br#"{"concurrency_max": 2, "rate": {"limit": 5, "period_ms": 60000}}"#);
        assert!(body.is_ok());
        assert!(decode_body::<queues::QueueBody>(b"{}").is_ok());
    }

    /// Every body the routes decode refuses the array form of its fields (the first fields of
    /// each, which serde would otherwise read in order).
    #[test]
    fn no_route_body_is_read_from_a_json_array() {
        fn refused<T: serde::de::DeserializeOwned>(text: &str) {
            let error = decode_body::<T>(text.as_bytes()).err().unwrap_or_else(|| panic!("{text} was accepted"));
            assert_eq!(error.code(), codes::INVALID_ARGUMENT, "{text}: {error}");
        }
        refused::<flows::AdvanceBody>(r#"[0, "reserved", null, null, 1, 1]"#);
        refused::<flows::AppendBody>(r#"["note.added", {}, null]"#);
        refused::<flows::ResolveBody>(r#"["requeue", "fixed"]"#);
        refused::<flows::RedeliverBody>("[null, true]");
        refused::<inbox::DeclareBody>(r#"["record", true, true]"#);
        refused::<inbox::ReceiveBatchBody>("[[]]");
        refused::<inbox::SkipRecordBody>(r#"["fixed"]"#);
        refused::<runs::StartBody>(r#"["order_saga", "r1", {}, null, null, null, null]"#);
        refused::<runs::StartBody>(r#"{"workflow": "w", "run_id": "r1", "input": {}, "queue": ["q", 0, null]}"#);
        refused::<runs::ReasonBody>(r#"["stop"]"#);
        refused::<runs::ForkBody>(r#"[1, "r2"]"#);
        refused::<runs::SkipStepBody>(r#"[1, null, "by hand"]"#);
        refused::<runs::EventBody>(r#"["approval", "e1", {}]"#);
        refused::<schedules::ScheduleBody>(r#"["order_saga", {}, "@hourly", null, null, null]"#);
        refused::<subscriptions::SubscribeBody>(r#"["pull:", false]"#);
        refused::<subscriptions::CommitBody>("[null, 1]");
        // What a field holds as an array is still read (a batch's events, a payload).
        let batch = decode_body::<inbox::ReceiveBatchBody>(br#"{"events": []}"#);
        assert!(batch.is_ok());
        let append = decode_body::<flows::AppendBody>(br#"{"event_type": "a", "payload": {"list": [1, [2]]}}"#);
        assert!(append.is_ok());
    }
}
