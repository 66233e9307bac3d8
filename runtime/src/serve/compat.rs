//! The other APIs local apps speak: Ollama's (`/api/generate`, `/api/chat`, streamed as
//! newline-delimited JSON unless `"stream": false`; `/api/tags`, `/api/show`, `/api/version`)
//! and llama.cpp's server (`/completion`, streamed as server-sent events; `/tokenize`,
//! `/detokenize`). Their requests become the same [`CompletionRequest`] as OpenAI's, and their
//! replies are shaped here.

use serde_json::{json, Map, Value};

use super::error::ApiError;
use super::reply::{Choice, Usage};
use super::request::{CompletionRequest, Endpoint, Prompt, ResponseFormat};
use crate::tokenizer::chat_template::Message;

fn body_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice(body) {
        Ok(Value::Object(obj)) => Ok(obj),
        Ok(_) => Err(ApiError::new(
            400,
            "invalid_json",
            "the body must be a JSON object",
        )),
        Err(e) => Err(ApiError::new(
            400,
            "invalid_json",
            format!("the body is not valid JSON: {e}"),
        )),
    }
}

/// Ollama names a model `name` or `name:tag`; this server has one model, under any tag.
fn check_model(obj: &Map<String, Value>, model: &str, required: bool) -> Result<(), ApiError> {
    match obj.get("model").or(obj.get("name")) {
        None if !required => Ok(()),
        None => Err(ApiError::field("model", "model is required")),
        Some(Value::String(name)) if name.split(':').next() == Some(model) => Ok(()),
        Some(other) => Err(ApiError {
            status: 404,
            message: format!("model {other} not found: this server has `{model}`"),
            param: Some("model"),
            code: Some("model_not_found"),
        }),
    }
}

/// An Ollama `/api/generate` or `/api/chat` body as a request. `/api/generate` renders its
/// `prompt` (and `system`) through the chat template unless `raw` is set.
pub fn parse_ollama(
    endpoint: Endpoint,
    body: &[u8],
    model: &str,
) -> Result<CompletionRequest, ApiError> {
    let obj = body_object(body)?;
    check_model(&obj, model, true)?;
    // Ollama's sampling fields live in `options`; they are checked as OpenAI's are.
    let options = match obj.get("options") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(o)) => o.clone(),
        Some(_) => return Err(ApiError::field("options", "options must be an object")),
    };
    let mut openai = Map::new();
    let chat = endpoint == Endpoint::OllamaChat;
    if chat {
        openai.insert(
            "messages".into(),
            obj.get("messages").cloned().unwrap_or(Value::Null),
        );
        if let Some(t) = obj.get("tools") {
            openai.insert("tools".into(), t.clone());
        }
    } else {
        let prompt = obj
            .get("prompt")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::field("prompt", "prompt must be a string"))?;
        openai.insert("prompt".into(), prompt.into());
    }
    for (from, to) in [
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("min_p", "min_p"),
        ("seed", "seed"),
        ("stop", "stop"),
        ("num_predict", "max_tokens"),
    ] {
        if let Some(v) = options.get(from) {
            openai.insert(to.into(), v.clone());
        }
    }
    // num_predict -1 (or -2): no limit but the context.
    if openai
        .get("max_tokens")
        .and_then(Value::as_i64)
        .is_some_and(|n| n < 0)
    {
        openai.remove("max_tokens");
    }
    let kind = if chat {
        Endpoint::Chat
    } else {
        Endpoint::Completions
    };
    let mut r = super::request::parse(kind, Value::Object(openai).to_string().as_bytes(), model)
        .map_err(|mut e| {
            e.param = e.param.map(|p| match p {
                "max_tokens" => "options.num_predict",
                "temperature" => "options.temperature",
                "top_p" => "options.top_p",
                "top_k" => "options.top_k",
                "min_p" => "options.min_p",
                "seed" => "options.seed",
                "stop" => "options.stop",
                other => other,
            });
            e
        })?;
    r.stream = match obj.get("stream") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::field("stream", "stream must be true or false")),
    };
    r.response_format = match obj.get("format") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s == "json" => Some(ResponseFormat::JsonObject),
        Some(Value::String(s)) if s.is_empty() => None,
        Some(schema @ Value::Object(_)) => Some(ResponseFormat::JsonSchema(schema.clone())),
        Some(_) => {
            return Err(ApiError::field(
                "format",
                "format must be \"json\" or a JSON schema",
            ))
        }
    };
    if let Some(f) = &r.response_format {
        f.grammar().map_err(|mut e| {
            e.param = Some("format");
            e
        })?;
    }
    if !chat {
        let Prompt::Text(prompt) = &r.prompt else {
            unreachable!("a completion has a text prompt")
        };
        let raw = obj.get("raw").and_then(Value::as_bool).unwrap_or(false);
        if !raw {
            let mut messages = Vec::new();
            if let Some(system) = obj.get("system").and_then(Value::as_str) {
                messages.push(Message::new("system", system));
            }
            messages.push(Message::new("user", prompt));
            r.prompt = Prompt::Generate {
                messages,
                text: prompt.clone(),
            };
        }
    }
    Ok(r)
}

/// A llama.cpp `/completion` body as a request (`prompt`, `n_predict`, `stream` and the
/// sampling fields of the same names).
pub fn parse_llama(body: &[u8]) -> Result<CompletionRequest, ApiError> {
    let obj = body_object(body)?;
    let mut openai = Map::new();
    for (from, to) in [
        ("prompt", "prompt"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("min_p", "min_p"),
        ("seed", "seed"),
        ("stop", "stop"),
        ("stream", "stream"),
        ("n_predict", "max_tokens"),
        ("n_probs", "logprobs"),
    ] {
        if let Some(v) = obj.get(from) {
            openai.insert(to.into(), v.clone());
        }
    }
    if openai
        .get("max_tokens")
        .and_then(Value::as_i64)
        .is_some_and(|n| n < 0)
    {
        openai.remove("max_tokens");
    }
    if openai.get("logprobs").and_then(Value::as_u64) == Some(0) {
        openai.remove("logprobs");
    }
    // llama.cpp's seed -1 means a random one.
    if openai.get("seed").and_then(Value::as_i64) == Some(-1) {
        openai.remove("seed");
    }
    let mut r = super::request::parse(
        Endpoint::Completions,
        Value::Object(openai).to_string().as_bytes(),
        "",
    )
    .map_err(|mut e| {
        e.param = e.param.map(|p| match p {
            "max_tokens" => "n_predict",
            "logprobs" => "n_probs",
            other => other,
        });
        e
    })?;
    if let Some(schema) = obj.get("json_schema").filter(|v| !v.is_null()) {
        let f = ResponseFormat::JsonSchema(schema.clone());
        f.grammar().map_err(|mut e| {
            e.param = Some("json_schema");
            e
        })?;
        r.response_format = Some(f);
    }
    Ok(r)
}

/// An RFC 3339 UTC time, as Ollama's `created_at`.
pub fn rfc3339(unix_s: u64) -> String {
    let (days, secs) = (unix_s / 86_400, unix_s % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

/// Ollama's `done_reason` for an OpenAI `finish_reason`.
fn done_reason(finish_reason: &str) -> &'static str {
    match finish_reason {
        "length" => "length",
        _ => "stop",
    }
}

/// Ollama's counts and durations (nanoseconds) of a finished reply.
fn ollama_stats(v: &mut Value, usage: Usage) {
    v["total_duration"] = usage.total_ns.into();
    v["load_duration"] = 0.into();
    v["prompt_eval_count"] = (usage.prompt - usage.cached).into();
    v["prompt_eval_duration"] = usage.prompt_ns.into();
    v["eval_count"] = usage.completion.into();
    v["eval_duration"] = usage.eval_ns.into();
}

/// Ollama's tool calls: `arguments` an object.
fn ollama_tool_calls(openai: &Value) -> Value {
    openai
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            let args = c["function"]["arguments"]
                .as_str()
                .and_then(|s| serde_json::from_str::<Value>(s).ok())
                .unwrap_or(json!({}));
            json!({ "function": { "name": c["function"]["name"], "arguments": args } })
        })
        .collect()
}

/// The body of a streamed piece, a final chunk or a whole reply, for the Ollama and llama.cpp
/// endpoints. `choice` is the finished choice (a final chunk or whole reply); `text` a piece.
pub fn body(
    endpoint: Endpoint,
    model: &str,
    created: u64,
    text: &str,
    tool_calls: Option<&Value>,
    end: Option<(&str, Usage)>,
) -> Value {
    match endpoint {
        Endpoint::OllamaGenerate | Endpoint::OllamaChat => {
            let mut v = json!({ "model": model, "created_at": rfc3339(created) });
            if endpoint == Endpoint::OllamaChat {
                let mut message = json!({ "role": "assistant", "content": text });
                if let Some(calls) = tool_calls {
                    message["tool_calls"] = ollama_tool_calls(calls);
                }
                v["message"] = message;
            } else {
                v["response"] = text.into();
            }
            v["done"] = end.is_some().into();
            if let Some((reason, usage)) = end {
                v["done_reason"] = done_reason(reason).into();
                ollama_stats(&mut v, usage);
            }
            v
        }
        Endpoint::Llama => {
            let mut v = json!({ "content": text, "stop": end.is_some() });
            if let Some((reason, usage)) = end {
                v["model"] = model.into();
                v["tokens_predicted"] = usage.completion.into();
                v["tokens_evaluated"] = usage.prompt.into();
                v["tokens_cached"] = usage.cached.into();
                v["stop_type"] = match reason {
                    "length" => "limit",
                    _ => "eos",
                }
                .into();
                v["timings"] = json!({
                    "prompt_n": usage.prompt - usage.cached,
                    "prompt_ms": usage.prompt_ns as f64 / 1e6,
                    "predicted_n": usage.completion,
                    "predicted_ms": usage.eval_ns as f64 / 1e6,
                });
            }
            v
        }
        Endpoint::Chat | Endpoint::Completions => unreachable!("OpenAI replies are built in reply"),
    }
}

/// A whole reply (`"stream": false`).
pub fn whole(endpoint: Endpoint, model: &str, created: u64, c: &Choice, usage: Usage) -> Value {
    body(
        endpoint,
        model,
        created,
        &c.text,
        c.tool_calls.as_ref(),
        Some((c.finish_reason, usage)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ollama_requests_map_their_options_and_name_bad_ones() {
        let r = parse_ollama(
            Endpoint::OllamaGenerate,
            br#"{"model": "m:latest", "prompt": "Hi", "system": "Be brief.",
                "options": {"temperature": 0, "num_predict": 5, "top_k": 3, "seed": 7,
                "stop": ["x"]}, "format": "json"}"#,
            "m",
        )
        .unwrap();
        assert!(r.stream, "Ollama streams by default");
        assert_eq!(
            (r.temperature, r.max_tokens, r.top_k, r.seed),
            (Some(0.0), Some(5), Some(3), Some(7))
        );
        assert_eq!(r.stop, ["x"]);
        assert_eq!(r.response_format, Some(ResponseFormat::JsonObject));
        let Prompt::Generate { messages, text } = &r.prompt else {
            panic!("{:?}", r.prompt)
        };
        assert_eq!((messages.len(), text.as_str()), (2, "Hi"));
        let r = parse_ollama(
            Endpoint::OllamaGenerate,
            br#"{"model": "m", "prompt": "Hi", "raw": true, "stream": false,
                "options": {"num_predict": -1}}"#,
            "m",
        )
        .unwrap();
        assert_eq!(
            (r.prompt, r.stream, r.max_tokens),
            (Prompt::Text("Hi".into()), false, None)
        );
        for (body, param) in [
            (r#"{"prompt": "x"}"#, "model"),
            (
                r#"{"model": "m", "prompt": "x", "options": {"temperature": "hot"}}"#,
                "options.temperature",
            ),
            (
                r#"{"model": "m", "prompt": "x", "options": {"num_predict": 0}}"#,
                "options.num_predict",
            ),
            (r#"{"model": "m", "prompt": "x", "format": 3}"#, "format"),
            (r#"{"model": "m", "prompt": 3}"#, "prompt"),
        ] {
            let e = parse_ollama(Endpoint::OllamaGenerate, body.as_bytes(), "m").unwrap_err();
            assert_eq!(e.param, Some(param), "{body}: {e:?}");
        }
        let e = parse_ollama(
            Endpoint::OllamaChat,
            br#"{"model": "other", "messages": []}"#,
            "m",
        )
        .unwrap_err();
        assert_eq!(e.status, 404);
    }

    #[test]
    fn llama_requests_map_n_predict() {
        let r = parse_llama(br#"{"prompt": "Hi", "n_predict": 4, "stream": true, "seed": -1}"#)
            .unwrap();
        assert_eq!((r.max_tokens, r.stream, r.seed), (Some(4), true, None));
        let e = parse_llama(br#"{"prompt": "Hi", "n_predict": 0}"#).unwrap_err();
        assert_eq!(e.param, Some("n_predict"));
    }

    #[test]
    fn created_at_is_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_709_251_199), "2024-02-29T23:59:59Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
    }
}
