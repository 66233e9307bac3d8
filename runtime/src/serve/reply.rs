//! The bodies of OpenAI's replies: a whole completion or chat completion, and the chunks of a
//! streamed one, with `usage` (prompt, completion and total tokens; the prompt tokens reused from
//! the KV cache as `prompt_tokens_details.cached_tokens`) and `finish_reason`.

use serde_json::{json, Value};

use super::compat;
use super::decode::TokenLogprob;
use super::json_grammar::TokenTexts;
use super::request::Endpoint;

/// One finished choice of a whole reply.
pub struct Choice {
    /// The text (a chat's `content`: the text outside tool calls).
    pub text: String,
    pub finish_reason: &'static str,
    /// OpenAI's `logprobs` object, if asked for.
    pub logprobs: Option<Value>,
    /// OpenAI's `tool_calls`, if the reply called tools.
    pub tool_calls: Option<Value>,
}

/// Token counts of one request.
#[derive(Debug, Clone, Copy)]
pub struct Usage {
    pub prompt: usize,
    /// Of `prompt`, the tokens the KV cache already held from the previous request.
    pub cached: usize,
    pub completion: usize,
    /// Prompt processing, generation and the whole request, in nanoseconds (Ollama's fields).
    pub prompt_ns: u64,
    pub eval_ns: u64,
    pub total_ns: u64,
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
            Endpoint::Chat | Endpoint::OllamaChat => "chatcmpl",
            _ => "cmpl",
        };
        Self {
            endpoint,
            id: format!("{prefix}-{created:x}{serial:04x}"),
            created,
            model: model.to_string(),
        }
    }

    /// The whole reply of a request without `stream`.
    pub fn whole(&self, choices: &[Choice], usage: Usage) -> Value {
        if self.is_compat() {
            return compat::whole(self.endpoint, &self.model, self.created, &choices[0], usage);
        }
        let choices: Vec<Value> = choices
            .iter()
            .enumerate()
            .map(|(index, c)| match self.endpoint {
                Endpoint::Chat => {
                    let mut message = json!({ "role": "assistant", "content": c.text });
                    if let Some(calls) = &c.tool_calls {
                        message["tool_calls"] = calls.clone();
                        if c.text.is_empty() {
                            message["content"] = Value::Null;
                        }
                    }
                    json!({
                        "index": index,
                        "message": message,
                        "logprobs": c.logprobs,
                        "finish_reason": c.finish_reason,
                    })
                }
                _ => json!({
                    "index": index,
                    "text": c.text,
                    "logprobs": c.logprobs,
                    "finish_reason": c.finish_reason,
                }),
            })
            .collect();
        let mut v = self.head(false);
        v["choices"] = choices.into();
        v["usage"] = usage.to_json();
        v
    }

    /// The chunk that opens choice `index` of a chat stream (the assistant's role), if the
    /// endpoint has one.
    pub fn opening(&self, index: usize) -> Option<Value> {
        (self.endpoint == Endpoint::Chat).then(|| {
            self.chunk_with(
                index,
                json!({"role": "assistant", "content": ""}),
                None,
                None,
            )
        })
    }

    /// A streamed piece of text, with its tokens' log-probabilities if asked for.
    pub fn piece(&self, index: usize, text: &str, logprobs: Option<Value>) -> Value {
        match self.endpoint {
            Endpoint::Chat => self.chunk_with(index, json!({ "content": text }), logprobs, None),
            Endpoint::Completions => self.chunk_with(index, json!(text), logprobs, None),
            _ => compat::body(self.endpoint, &self.model, self.created, text, None, None),
        }
    }

    /// A chat chunk with a choice's tool calls.
    pub fn tool_calls(&self, index: usize, calls: Value) -> Value {
        if self.is_compat() {
            return compat::body(
                self.endpoint,
                &self.model,
                self.created,
                "",
                Some(&calls),
                None,
            );
        }
        self.chunk_with(index, json!({ "tool_calls": calls }), None, None)
    }

    /// Whether this is an Ollama or llama.cpp reply.
    pub fn is_compat(&self) -> bool {
        !matches!(self.endpoint, Endpoint::Chat | Endpoint::Completions)
    }

    /// A choice's last chunk: why it ended; the stream's last one carries the usage.
    pub fn closing(&self, index: usize, finish_reason: &str, usage: Option<Usage>) -> Value {
        if self.is_compat() {
            let usage = usage.expect("one choice: its closing chunk is the last");
            let end = Some((finish_reason, usage));
            return compat::body(self.endpoint, &self.model, self.created, "", None, end);
        }
        let empty = match self.endpoint {
            Endpoint::Chat => json!({}),
            _ => json!(""),
        };
        let mut v = self.chunk_with(index, empty, None, Some(finish_reason));
        if let Some(usage) = usage {
            v["usage"] = usage.to_json();
        }
        v
    }

    fn head(&self, chunk: bool) -> Value {
        let object = match (self.endpoint, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            _ => "text_completion",
        };
        json!({ "id": self.id, "object": object, "created": self.created, "model": self.model })
    }

    /// A chunk carrying `content`: a chat `delta`, or a completion's `text`.
    fn chunk_with(
        &self,
        index: usize,
        content: Value,
        logprobs: Option<Value>,
        finish_reason: Option<&str>,
    ) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => json!({
                "index": index,
                "delta": content,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }),
            _ => json!({
                "index": index,
                "text": content,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }),
        };
        let mut v = self.head(true);
        v["choices"] = json!([choice]);
        v
    }

    /// OpenAI's `logprobs` object for `tokens`: a chat's `{"content": [{token, logprob, bytes,
    /// top_logprobs}]}`, or a completion's `{tokens, token_logprobs, top_logprobs,
    /// text_offset}` (offsets from `offset`, counted in bytes of the completion's text).
    pub fn logprobs(&self, tokens: &[TokenLogprob], texts: &TokenTexts, offset: usize) -> Value {
        let text = |t: u32| String::from_utf8_lossy(texts.get(t)).into_owned();
        match self.endpoint {
            Endpoint::Chat => {
                let entry = |t: u32, lp: f32| json!({ "token": text(t), "logprob": lp, "bytes": texts.get(t) });
                let content: Vec<Value> = tokens
                    .iter()
                    .map(|t| {
                        let mut e = entry(t.token, t.logprob);
                        e["top_logprobs"] = t.top.iter().map(|&(id, lp)| entry(id, lp)).collect();
                        e
                    })
                    .collect();
                json!({ "content": content, "refusal": null })
            }
            _ => {
                let mut at = offset;
                let offsets: Vec<usize> = tokens
                    .iter()
                    .map(|t| {
                        let here = at;
                        at += texts.get(t.token).len();
                        here
                    })
                    .collect();
                json!({
                    "tokens": tokens.iter().map(|t| text(t.token)).collect::<Vec<_>>(),
                    "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
                    "top_logprobs": tokens.iter().map(|t| {
                        t.top.iter().map(|&(id, lp)| (text(id), json!(lp))).collect::<serde_json::Map<_, _>>()
                    }).collect::<Vec<_>>(),
                    "text_offset": offsets,
                })
            }
        }
    }
}
