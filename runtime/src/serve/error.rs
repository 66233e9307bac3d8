//! Errors as OpenAI's API returns them (`{"error": {"message", "type", "param", "code"}}` with an
//! HTTP status), so client libraries raise their usual exceptions and show the message.

use serde_json::{json, Value};

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    /// The request field at fault, if one is.
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 about field `param`.
    pub fn field(param: &'static str, message: impl Into<String>) -> Self {
        Self {
            status: 400,
            message: message.into(),
            param: Some(param),
            code: None,
        }
    }

    pub fn new(status: u16, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
            code: Some(code),
        }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn to_json(&self) -> Value {
        let kind = if self.status >= 500 {
            "server_error"
        } else {
            "invalid_request_error"
        };
        json!({
            "error": {
                "message": self.message,
                "type": kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}
