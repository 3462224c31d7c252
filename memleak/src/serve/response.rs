//! The responses every endpoint answers with: a body with its content
//! type, and the headers each one carries. Its own module, below the
//! router (`http`) and the handlers (`reports`...), which both build them.

use http_body_util::Full;
use hyper::{body::Bytes, header, Response, StatusCode};

/// A text answer: a message or an error's reason.
pub fn plain(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    with_type(status, "text/plain; charset=utf-8", body)
}

/// An answer of any type; browsers are told not to guess another.
pub fn with_type(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, header::HeaderValue::from_static(content_type));
    // Text is text, whatever a browser would guess from it.
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, header::HeaderValue::from_static("nosniff"));
    response
}
