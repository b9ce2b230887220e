//! The dashboard's two static files, compiled into the binary: the stylesheet and the vendored
//! htmx (`crates/server/assets/`, see its README for version and license). Their URLs carry
//! a version or content hash, so they are served with a one-year immutable cache header.

use std::sync::LazyLock;

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};

use super::Path;

const HTMX: &str = include_str!("../../assets/htmx-2.0.11.min.js");
pub const HTMX_PATH: &str = "/ui/assets/htmx-2.0.11.min.js";

const CSS: &str = include_str!("../../assets/dashboard.css");
static CSS_PATH: LazyLock<String> = LazyLock::new(|| format!("/ui/assets/dashboard.{:016x}.css", fnv1a(CSS)));

const CACHE_FOREVER: &str = "public, max-age=31536000, immutable";

pub fn css_path() -> &'static str {
    &CSS_PATH
}

/// FNV-1a, 64 bits: a content hash for the stylesheet's URL (not for security).
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3))
}

pub async fn serve(Path(file): Path<String>) -> Response {
    let path = format!("/ui/assets/{file}");
    let (body, kind) = if path == HTMX_PATH {
        (HTMX, "text/javascript; charset=utf-8")
    } else if path == *CSS_PATH {
        (CSS, "text/css; charset=utf-8")
    } else {
        return (StatusCode::NOT_FOUND, "no such asset").into_response();
    };
    ([(header::CONTENT_TYPE, kind), (header::CACHE_CONTROL, CACHE_FOREVER)], body).into_response()
}
