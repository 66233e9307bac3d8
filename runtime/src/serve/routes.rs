//! The HTTP thread: answers `/health`, `/v1/models` and `/metrics` itself (at once, even while a
//! generation runs), and turns a completion request into a queued job: body size checked, fields
//! validated, prompt rendered and tokenized, its length checked against the context. Every
//! problem is answered here with an OpenAI-shaped 4xx, before the request waits for the model.

use std::io::Read;
use std::sync::Arc;
use std::time::Instant;

use serde_json::{json, Value};
use tiny_http::{Header, Method, Request, Response};

use super::compat;
use super::error::ApiError;
use super::metrics::ServerMetrics;
use super::queue::{Job, Queue, Work};
use super::request::{self, CompletionRequest, Endpoint, Prompt};
use crate::platform::elastic::BudgetHandle;
use crate::platform::memory_size::{format_size, parse_budget};
use crate::text::chat::ChatFormat;
use crate::text::sampler::SamplerConfig;
use crate::tokenizer::Tokenizer;

/// What the HTTP thread needs to validate and queue requests.
pub struct Frontend {
    pub model_id: String,
    pub tokenizer: Tokenizer,
    /// The chat template and end-of-turn tokens, or why the model has none.
    pub chat: Result<ChatFormat, String>,
    /// The model's end-of-sequence tokens (plain completions).
    pub eos_token_ids: Vec<u32>,
    pub ctx: usize,
    /// Sampling for fields a request leaves out.
    pub sampler: SamplerConfig,
    pub max_tokens: usize,
    pub max_body_bytes: u64,
    pub metrics: Arc<ServerMetrics>,
    pub queue: Queue,
    /// How `POST /v1/budget` sets the model's memory budget, or why it cannot.
    pub budget: Result<Budget, String>,
}

/// The running model's budget, as `POST /v1/budget` sees it.
pub struct Budget {
    pub handle: BudgetHandle,
    /// The least the model accepts (its fixed needs with the dense weights as opened, and the
    /// KV caches of the slots beyond the first).
    pub floor: u64,
    /// The bytes the slots beyond the first hold for their KV caches: the model gets the rest.
    pub reserved: u64,
}

const COMPLETIONS: &str = "/v1/completions";
const CHAT: &str = "/v1/chat/completions";
const BUDGET: &str = "/v1/budget";
const PATHS: [&str; 14] = [
    "/health",
    "/metrics",
    "/v1/models",
    COMPLETIONS,
    CHAT,
    BUDGET,
    "/api/generate",
    "/api/chat",
    "/api/tags",
    "/api/show",
    "/api/version",
    "/completion",
    "/tokenize",
    "/detokenize",
];

impl Frontend {
    /// Answers or queues every request the server receives.
    pub fn serve(&self, server: &tiny_http::Server) {
        for request in server.incoming_requests() {
            self.handle(request);
        }
    }

    fn handle(&self, mut request: Request) {
        let path = request.url().split('?').next().unwrap_or("").to_string();
        match (request.method(), path.as_str()) {
            (Method::Get, "/health") => respond_json(
                request,
                200,
                &json!({ "status": "ok", "queue_waiting": self.queue.waiting() }),
            ),
            (Method::Get, "/v1/models") => respond_json(
                request,
                200,
                &json!({
                    "object": "list",
                    "data": [{ "id": self.model_id, "object": "model", "created": 0, "owned_by": "leanstream" }],
                }),
            ),
            (Method::Get, "/metrics") => {
                let text = self.metrics.render(self.queue.waiting());
                let _ = request.respond(
                    Response::from_string(text)
                        .with_header(header("Content-Type", "text/plain; version=0.0.4")),
                );
            }
            (Method::Get | Method::Head, "/api/version") => respond_json(
                request,
                200,
                &json!({ "version": env!("CARGO_PKG_VERSION") }),
            ),
            (Method::Get | Method::Head, "/api/tags") => {
                let model = self.ollama_model();
                respond_json(request, 200, &json!({ "models": [model] }))
            }
            (Method::Post, "/api/show") => match self.show(&mut request) {
                Ok(v) => respond_json(request, 200, &v),
                Err(e) => self.refuse_ollama(request, e),
            },
            (Method::Post, "/api/generate") => self.enqueue(request, Endpoint::OllamaGenerate),
            (Method::Post, "/api/chat") => self.enqueue(request, Endpoint::OllamaChat),
            (Method::Post, "/completion") => self.enqueue(request, Endpoint::Llama),
            (Method::Post, "/tokenize" | "/detokenize") => {
                match self.tokenize(&mut request, path == "/tokenize") {
                    Ok(v) => respond_json(request, 200, &v),
                    Err(e) => self.refuse(request, e),
                }
            }
            (Method::Post, COMPLETIONS) => self.enqueue(request, Endpoint::Completions),
            (Method::Post, CHAT) => self.enqueue(request, Endpoint::Chat),
            (Method::Post, BUDGET) => match self.set_budget(&mut request) {
                Ok(bytes) => respond_json(
                    request,
                    200,
                    &json!({ "memory_budget_bytes": bytes, "taken": "before the next token" }),
                ),
                Err(e) => self.refuse(request, e),
            },
            (method, p) if PATHS.contains(&p) => {
                let e = ApiError::new(
                    405,
                    "method_not_allowed",
                    format!("{p} does not take {method}"),
                );
                self.refuse(request, e);
            }
            (_, p) => {
                let e = ApiError::new(
                    404,
                    "not_found",
                    format!("no such path {p}: the API is at {CHAT} and {COMPLETIONS}"),
                );
                self.refuse(request, e);
            }
        }
    }

    /// `{"memory": "300MiB"}` or `{"memory": 314572800}`: the model takes it before its next
    /// token (an idle server at once). Below the model's floor it is refused here, with the floor.
    fn set_budget(&self, request: &mut Request) -> Result<u64, ApiError> {
        let budget = self
            .budget
            .as_ref()
            .map_err(|why| ApiError::new(409, "budget_fixed", why.clone()))?;
        let body = self.body(request)?;
        let v: Value = serde_json::from_slice(&body).map_err(|e| {
            ApiError::new(400, "invalid_json", format!("the body is not JSON: {e}"))
        })?;
        let bytes = match &v["memory"] {
            Value::Number(n) => n.as_u64().filter(|&b| b > 0).ok_or_else(|| {
                ApiError::field(
                    "memory",
                    "a positive whole number of bytes, or a size such as \"300MiB\"",
                )
            })?,
            Value::String(s) => parse_budget(s).map_err(|e| ApiError::field("memory", e))?,
            _ => {
                return Err(ApiError::field(
                    "memory",
                    "give the budget as {\"memory\": \"300MiB\"} or a number of bytes",
                ))
            }
        };
        if bytes < budget.floor {
            return Err(ApiError::field(
                "memory",
                format!(
                    "{} is below the {} this model needs with its dense weights as opened",
                    format_size(bytes),
                    format_size(budget.floor)
                ),
            ));
        }
        budget.handle.set(bytes - budget.reserved);
        Ok(bytes)
    }

    /// The model as Ollama's `/api/tags` lists it.
    fn ollama_model(&self) -> Value {
        json!({
            "name": format!("{}:latest", self.model_id),
            "model": format!("{}:latest", self.model_id),
            "modified_at": compat::rfc3339(0),
            "size": 0,
            "digest": "",
            "details": { "format": "leanstream", "family": "", "parameter_size": "",
                "quantization_level": "" },
        })
    }

    /// Ollama's `/api/show`: the model's details and chat template.
    fn show(&self, request: &mut Request) -> Result<Value, ApiError> {
        let body = self.body(request)?;
        let obj: serde_json::Map<String, Value> = serde_json::from_slice(&body).map_err(|e| {
            ApiError::new(
                400,
                "invalid_json",
                format!("the body is not a JSON object: {e}"),
            )
        })?;
        let name = obj
            .get("model")
            .or(obj.get("name"))
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::field("model", "model is required"))?;
        if name.split(':').next() != Some(self.model_id.as_str()) {
            return Err(ApiError {
                status: 404,
                message: format!(
                    "model `{name}` not found: this server has `{}`",
                    self.model_id
                ),
                param: Some("model"),
                code: Some("model_not_found"),
            });
        }
        let model = self.ollama_model();
        Ok(json!({
            "modelfile": "",
            "parameters": "",
            "template": "",
            "details": model["details"],
            "model_info": { "general.context_length": self.ctx },
            "capabilities": if self.chat.is_ok() { json!(["completion", "tools"]) } else { json!(["completion"]) },
        }))
    }

    /// llama.cpp's `/tokenize` (`content`, optional `add_special`) and `/detokenize` (`tokens`).
    fn tokenize(&self, request: &mut Request, encode: bool) -> Result<Value, ApiError> {
        let body = self.body(request)?;
        let v: Value = serde_json::from_slice(&body).map_err(|e| {
            ApiError::new(400, "invalid_json", format!("the body is not JSON: {e}"))
        })?;
        if encode {
            let text = v["content"]
                .as_str()
                .ok_or_else(|| ApiError::field("content", "content must be a string"))?;
            let special = v["add_special"].as_bool().unwrap_or(false);
            let ids = self
                .tokenizer
                .encode(text, special)
                .map_err(|e| ApiError::field("content", format!("{e:#}")))?;
            Ok(json!({ "tokens": ids }))
        } else {
            let ids = v["tokens"]
                .as_array()
                .and_then(|list| {
                    list.iter()
                        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                        .collect::<Option<Vec<u32>>>()
                })
                .ok_or_else(|| ApiError::field("tokens", "tokens must be a list of token ids"))?;
            let text = self
                .tokenizer
                .decode(&ids)
                .map_err(|e| ApiError::field("tokens", format!("{e:#}")))?;
            Ok(json!({ "content": text }))
        }
    }

    fn enqueue(&self, mut request: Request, endpoint: Endpoint) {
        let work = match self.validate(&mut request, endpoint) {
            Ok(work) => work,
            Err(e) if matches!(endpoint, Endpoint::OllamaGenerate | Endpoint::OllamaChat) => {
                return self.refuse_ollama(request, e)
            }
            Err(e) => return self.refuse(request, e),
        };
        let job = Job { request, work };
        ServerMetrics::add(&self.metrics.requests, 1);
        if let Err(job) = self.queue.push(job) {
            ServerMetrics::add(&self.metrics.rejected_queue_full, 1);
            let e = ApiError::new(
                503,
                "queue_full",
                format!(
                    "the server is busy: {} requests are waiting, the most its --queue allows; retry later",
                    self.queue.waiting()
                ),
            );
            respond_json(job.request, e.status, &e.to_json());
        }
    }

    fn validate(&self, request: &mut Request, endpoint: Endpoint) -> Result<Work, ApiError> {
        let received = Instant::now();
        let body = self.body(request)?;
        let r: CompletionRequest = match endpoint {
            Endpoint::Chat | Endpoint::Completions => {
                request::parse(endpoint, &body, &self.model_id)?
            }
            Endpoint::OllamaGenerate | Endpoint::OllamaChat => {
                compat::parse_ollama(endpoint, &body, &self.model_id)?
            }
            Endpoint::Llama => compat::parse_llama(&body)?,
        };
        let text_prompt = |text: &str| {
            self.tokenizer
                .encode(text, true)
                .map_err(|e| ApiError::field("prompt", format!("{e:#}")))
        };
        let (prompt, eos_token_ids, field) = match &r.prompt {
            Prompt::Text(text) => (text_prompt(text)?, self.eos_token_ids.clone(), "prompt"),
            Prompt::Generate { messages, text } => match &self.chat {
                Ok(format) => {
                    let ids = format
                        .template
                        .encode(&self.tokenizer, messages)
                        .map_err(|e| ApiError::field("prompt", format!("{e:#}")))?;
                    (ids, format.eos_token_ids.clone(), "prompt")
                }
                Err(_) => (text_prompt(text)?, self.eos_token_ids.clone(), "prompt"),
            },
            Prompt::Messages(messages) => {
                let format = self
                    .chat
                    .as_ref()
                    .map_err(|why| ApiError::field("messages", why.clone()))?;
                let ids = format
                    .template
                    .encode_with_tools(&self.tokenizer, messages, r.tools.as_ref())
                    .map_err(|e| ApiError::field("messages", format!("{e:#}")))?;
                (ids, format.eos_token_ids.clone(), "messages")
            }
        };
        if prompt.is_empty() {
            return Err(ApiError::field(
                field,
                "the prompt is empty: give at least one token of text",
            ));
        }
        if prompt.len() >= self.ctx {
            return Err(ApiError::field(
                field,
                format!(
                    "the prompt has {} tokens but the context holds {}, the reply included: \
                     shorten it (or start the server with a larger --ctx)",
                    prompt.len(),
                    self.ctx
                ),
            )
            .with_code("context_length_exceeded"));
        }
        let mut sampler = self.sampler.clone();
        if let Some(t) = r.temperature {
            sampler.temperature = t;
        }
        if let Some(p) = r.top_p {
            sampler.top_p = p;
        }
        if let Some(s) = r.seed {
            sampler.seed = s;
        }
        if let Some(p) = r.min_p {
            sampler.min_p = p;
        }
        if let Some(k) = r.top_k {
            sampler.top_k = k;
        }
        let grammar = match &r.response_format {
            Some(format) => Some(Arc::new(format.grammar()?)),
            None => None,
        };
        Ok(Work {
            endpoint,
            prompt,
            eos_token_ids,
            sampler,
            max_tokens: r.max_tokens.unwrap_or(self.max_tokens),
            stop: r.stop,
            stream: r.stream,
            received,
            n: r.n,
            logprobs: r.logprobs,
            grammar,
            tool_names: r.tool_names,
        })
    }

    /// The request's body, refused (413) past the limit.
    fn body(&self, request: &mut Request) -> Result<Vec<u8>, ApiError> {
        let limit = self.max_body_bytes;
        let too_large = || {
            ApiError::new(
                413,
                "request_too_large",
                format!("the body is over the server's limit of {limit} bytes (--max-body)"),
            )
        };
        if request.body_length().is_some_and(|n| n as u64 > limit) {
            return Err(too_large());
        }
        let mut body = Vec::new();
        request
            .as_reader()
            .take(limit + 1)
            .read_to_end(&mut body)
            .map_err(|e| {
                ApiError::new(400, "unreadable_body", format!("cannot read the body: {e}"))
            })?;
        if body.len() as u64 > limit {
            return Err(too_large());
        }
        Ok(body)
    }

    /// An error as Ollama returns it: `{"error": "..."}`.
    fn refuse_ollama(&self, request: Request, e: ApiError) {
        ServerMetrics::add(&self.metrics.bad_requests, 1);
        let message = match e.param {
            Some(p) if !e.message.contains(p) => format!("{p}: {}", e.message),
            _ => e.message,
        };
        respond_json(request, e.status, &json!({ "error": message }));
    }

    fn refuse(&self, request: Request, e: ApiError) {
        ServerMetrics::add(&self.metrics.bad_requests, 1);
        respond_json(request, e.status, &e.to_json());
    }
}

fn header(name: &str, value: &str) -> Header {
    Header::from_bytes(name.as_bytes(), value.as_bytes()).expect("a valid header")
}

/// Answers `request` with `body` as JSON. A client that has gone away is not an error here.
pub fn respond_json(request: Request, status: u16, body: &Value) {
    let _ = request.respond(
        Response::from_string(body.to_string())
            .with_status_code(status)
            .with_header(header("Content-Type", "application/json")),
    );
}
