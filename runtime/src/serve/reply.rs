//! The bodies of OpenAI's replies: a whole completion or chat completion, and the chunks of a
//! streamed one, with `usage` (prompt, completion and total tokens; the prompt tokens reused from
//! the KV cache as `prompt_tokens_details.cached_tokens`) and `finish_reason`.

use serde_json::{json, Value};

use super::request::Endpoint;

/// Token counts of one request.
#[derive(Debug, Clone, Copy)]
pub struct Usage {
    pub prompt: usize,
    /// Of `prompt`, the tokens the KV cache already held from the previous request.
    pub cached: usize,
    pub completion: usize,
}

impl Usage {
    fn to_json(self) -> Value {
        json!({
            "prompt_tokens": self.prompt,
            "completion_tokens": self.completion,
            "total_tokens": self.prompt + self.completion,
            "prompt_tokens_details": { "cached_tokens": self.cached },
        })
    }
}

/// What every body of one reply shares.
pub struct Reply {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl Reply {
    pub fn new(endpoint: Endpoint, serial: u64, model: &str) -> Self {
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let prefix = match endpoint {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completions => "cmpl",
        };
        Self {
            endpoint,
            id: format!("{prefix}-{created:x}{serial:04x}"),
            created,
            model: model.to_string(),
        }
    }

    /// The whole reply of a request without `stream`.
    pub fn whole(&self, text: &str, finish_reason: &str, usage: Usage) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => json!({
                "index": 0,
                "message": { "role": "assistant", "content": text },
                "finish_reason": finish_reason,
            }),
            Endpoint::Completions => json!({
                "index": 0,
                "text": text,
                "logprobs": null,
                "finish_reason": finish_reason,
            }),
        };
        let mut v = self.head(false);
        v["choices"] = json!([choice]);
        v["usage"] = usage.to_json();
        v
    }

    /// The chunk that opens a chat stream (the assistant's role), if the endpoint has one.
    pub fn opening(&self) -> Option<Value> {
        (self.endpoint == Endpoint::Chat)
            .then(|| self.chunk_with(json!({"role": "assistant", "content": ""}), None))
    }

    /// A streamed piece of text.
    pub fn piece(&self, text: &str) -> Value {
        match self.endpoint {
            Endpoint::Chat => self.chunk_with(json!({ "content": text }), None),
            Endpoint::Completions => self.chunk_with(json!(text), None),
        }
    }

    /// The stream's last chunk: why it ended, and the usage.
    pub fn closing(&self, finish_reason: &str, usage: Usage) -> Value {
        let empty = match self.endpoint {
            Endpoint::Chat => json!({}),
            Endpoint::Completions => json!(""),
        };
        let mut v = self.chunk_with(empty, Some(finish_reason));
        v["usage"] = usage.to_json();
        v
    }

    fn head(&self, chunk: bool) -> Value {
        let object = match (self.endpoint, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completions, _) => "text_completion",
        };
        json!({ "id": self.id, "object": object, "created": self.created, "model": self.model })
    }

    /// A chunk carrying `content`: a chat `delta`, or a completion's `text`.
    fn chunk_with(&self, content: Value, finish_reason: Option<&str>) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => {
                json!({ "index": 0, "delta": content, "finish_reason": finish_reason })
            }
            Endpoint::Completions => {
                json!({ "index": 0, "text": content, "logprobs": null, "finish_reason": finish_reason })
            }
        };
        let mut v = self.head(true);
        v["choices"] = json!([choice]);
        v
    }
}
