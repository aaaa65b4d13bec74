//! Errors as OpenAI-compatible clients expect them: `{"error": {"message", "type", "param",
//! "code"}}` with the HTTP status that says who is at fault.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use turbo_engine::{RequestError, SubmitError};

/// An error response.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
}

#[derive(Serialize)]
pub struct ErrorBody<'a> {
    pub error: ErrorDetail<'a>,
}

#[derive(Serialize)]
pub struct ErrorDetail<'a> {
    pub message: &'a str,
    #[serde(rename = "type")]
    pub kind: &'a str,
    pub param: Option<&'a str>,
    pub code: Option<&'a str>,
}

impl ApiError {
    /// 400: the request is malformed or asks for something invalid.
    pub fn invalid(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    pub fn param(mut self, param: &'static str) -> Self {
        self.param = Some(param);
        self
    }

    pub fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::invalid(message)
            .status(StatusCode::NOT_FOUND)
            .code("not_found")
    }

    /// 503: the server shut down before the request finished (its shutdown timeout passed and
    /// the engine cancelled what was still running).
    pub fn cut_off_by_shutdown() -> Self {
        Self::internal("the server shut down before the request finished")
            .status(StatusCode::SERVICE_UNAVAILABLE)
            .code("unavailable")
    }

    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    pub fn body(&self) -> ErrorBody<'_> {
        ErrorBody {
            error: ErrorDetail {
                message: &self.message,
                kind: self.kind,
                param: self.param,
                code: self.code,
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let json = serde_json::to_string(&self.body()).unwrap_or_default();
        (
            self.status,
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            json,
        )
            .into_response()
    }
}

impl From<RequestError> for ApiError {
    fn from(e: RequestError) -> Self {
        match e {
            RequestError::PromptTooLong { .. } | RequestError::TooLargeForCache { .. } => {
                ApiError::invalid(e.to_string()).code("context_length_exceeded")
            }
            RequestError::EmptyPrompt | RequestError::BadToken { .. } => {
                ApiError::invalid(e.to_string()).param("prompt")
            }
            RequestError::Sampling(_) | RequestError::Eviction(_) => {
                ApiError::invalid(e.to_string())
            }
            RequestError::TooManyLogprobs(_) => ApiError::invalid(e.to_string()).param("logprobs"),
            RequestError::SessionName(_) => ApiError::invalid(e.to_string()).param("session"),
            RequestError::QueueTimeout { .. } => ApiError::internal(e.to_string())
                .status(StatusCode::SERVICE_UNAVAILABLE)
                .code("overloaded"),
            RequestError::Model(_)
            | RequestError::NoFiniteLogits { .. }
            | RequestError::Detokenize(_)
            | RequestError::Disconnected => ApiError::internal(e.to_string()),
        }
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::Invalid(e) => e.into(),
            SubmitError::QueueFull(_) => ApiError {
                status: StatusCode::TOO_MANY_REQUESTS,
                message: e.to_string(),
                kind: "rate_limit_error",
                param: None,
                code: Some("queue_full"),
            },
            SubmitError::ShuttingDown | SubmitError::Stopped => ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                message: e.to_string(),
                kind: "server_error",
                param: None,
                code: Some("unavailable"),
            },
        }
    }
}
