//! `PUT /v1/stock/{sku}`: the order saga's stock of one SKU (admin: it is reference data, not a
//! run). A route of the built-ins served beside the API with its authentication, as a user's own
//! routes are ([`tidemark::ServiceBuilder::routes`]).

use serde::{Deserialize, Serialize};
use tidemark::axum;
use tidemark::codes;
use tidemark::id::validate_id;
use tidemark::service::api::{typed, ApiResult, Json, Path};
use tidemark::service::{AppState, Caller};
use tidemark::utoipa::{self, ToSchema};
use tidemark::utoipa_axum::router::OpenApiRouter;
use tidemark::utoipa_axum::routes;
use tidemark::Error;

use crate::order::tables;

/// Largest stock a SKU may be given.
const STOCK_MAX: i64 = 1_000_000_000_000;

/// The route, documented (a service on SQLite files).
pub fn stock() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(set_stock))
}

/// The route on a service on PostgreSQL.
pub fn stock_postgres() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(set_stock_postgres))
}

/// The new stock.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"quantity": 10}))]
pub struct StockBody {
    /// 0..=10^12.
    #[schema(minimum = 0, maximum = 1_000_000_000_000_i64)]
    #[serde(deserialize_with = "tidemark::json::integer")]
    pub quantity: i64,
}

/// A SKU's stock.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Stock {
    /// The SKU.
    pub sku: String,
    /// Its stock (null: never stocked).
    pub stock: Option<i64>,
}

/// The answer of `PUT /v1/stock/{sku}`.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Stocked {
    /// `stocked`.
    #[schema(example = "stocked")]
    pub outcome: String,
    /// The stock now.
    pub stock: Stock,
}

/// Set the order saga's stock of one SKU (admin: it is reference data, not a run).
#[utoipa::path(
    put,
    path = "/v1/stock/{sku}",
    tag = "runs",
    params(("sku" = String, Path, description = "The SKU")),
    request_body = StockBody,
    responses((status = 200, description = "`stocked`", body = Stocked)),
    security(("bearer" = ["admin"]))
)]
async fn set_stock(caller: Caller, Path(sku): Path<String>, Json(body): Json<StockBody>) -> ApiResult {
    caller.require(tidemark::service::Scope::Admin)?;
    check(&sku, &body)?;
    let stock = caller
        .tenant
        .writer
        .call(move |store, _| {
            let conn = store.connection();
            tables::set_stock(conn, &sku, body.quantity)?;
            let stock = tables::stock(conn, &sku)?;
            Ok(Stock { sku, stock })
        })
        .await?;
    Ok(stocked(stock))
}

/// [`set_stock`] on PostgreSQL: the same request and answer, the workflow schema's tables.
#[utoipa::path(
    put,
    path = "/v1/stock/{sku}",
    tag = "runs",
    params(("sku" = String, Path, description = "The SKU")),
    request_body = StockBody,
    responses((status = 200, description = "`stocked`", body = Stocked)),
    security(("bearer" = ["admin"]))
)]
async fn set_stock_postgres(
    caller: tidemark::postgres::Caller,
    Path(sku): Path<String>,
    Json(body): Json<StockBody>,
) -> ApiResult {
    caller.require(tidemark::service::Scope::Admin)?;
    check(&sku, &body)?;
    let stock = caller
        .tenant
        .writer
        .call(move |store, _| {
            let schema = store.schema().to_string();
            crate::order::postgres::set_stock(store.client(), &schema, &sku, body.quantity)?;
            let stock = crate::order::postgres::stock(store.client(), &schema, &sku)?;
            Ok(Stock { sku, stock })
        })
        .await?;
    Ok(stocked(stock))
}

fn check(sku: &str, body: &StockBody) -> tidemark::Result<()> {
    validate_id("sku", sku)?;
    if !(0..=STOCK_MAX).contains(&body.quantity) {
        return Err(Error::invalid(codes::INVALID_ARGUMENT, format!("quantity must be 0..={STOCK_MAX}")));
    }
    Ok(())
}

fn stocked(stock: Stock) -> axum::response::Response {
    typed(tidemark::axum::http::StatusCode::OK, Stocked { outcome: "stocked".into(), stock })
}
