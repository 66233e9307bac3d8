//! Request validation: a completion or chat request's JSON body checked field by field, each
//! problem reported as a 4xx naming the field, before the request takes a place in the queue.

use serde_json::{Map, Value};

use super::error::ApiError;
use super::json_grammar::Grammar;
use crate::tokenizer::chat_template::Message;

/// Which endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/completions`: plain text continued.
    Completions,
    /// `POST /v1/chat/completions`: messages through the model's chat template.
    Chat,
    /// Ollama's `POST /api/generate`.
    OllamaGenerate,
    /// Ollama's `POST /api/chat`.
    OllamaChat,
    /// llama.cpp's `POST /completion`.
    Llama,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Messages(Vec<Message>),
    /// Ollama's `/api/generate`: `messages` through the chat template, or `text` as it is for a
    /// model without one.
    Generate {
        messages: Vec<Message>,
        text: String,
    },
}

/// A validated request; `None` fields take the server's defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    pub stream: bool,
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<u64>,
    /// Text that ends the reply where it first appears (not included in the reply).
    pub stop: Vec<String>,
    /// Choices to generate (one after another).
    pub n: usize,
    /// Log-probabilities wanted: `Some(k)` gives the chosen token's and the `k` most likely.
    pub logprobs: Option<usize>,
    pub min_p: Option<f32>,
    pub top_k: Option<usize>,
    /// OpenAI's `tools` list, for the chat template; `None` with `tool_choice: "none"`.
    pub tools: Option<Value>,
    /// The names of `tools`' functions: the calls taken from the reply.
    pub tool_names: Vec<String>,
    pub response_format: Option<ResponseFormat>,
}

/// A reply constrained to JSON.
#[derive(Debug, Clone, PartialEq)]
pub enum ResponseFormat {
    JsonObject,
    /// The schema (`json_schema.schema`).
    JsonSchema(Value),
}

impl ResponseFormat {
    pub fn grammar(&self) -> Result<Grammar, ApiError> {
        match self {
            ResponseFormat::JsonObject => Ok(Grammar::json_object()),
            ResponseFormat::JsonSchema(schema) => Grammar::from_schema(schema).map_err(|e| {
                ApiError::field(
                    "response_format",
                    format!("response_format.json_schema: {e}"),
                )
            }),
        }
    }
}

/// At most this many stop strings, as OpenAI allows.
const MAX_STOPS: usize = 4;
/// At most this many choices per request.
const MAX_N: u64 = 16;
/// At most this many alternatives per token in `top_logprobs`, as OpenAI allows.
const MAX_TOP_LOGPROBS: u64 = 20;

/// Parses and checks `body`; `model` is the served model's id (a request naming another gets 404).
pub fn parse(endpoint: Endpoint, body: &[u8], model: &str) -> Result<CompletionRequest, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| ApiError {
        status: 400,
        message: format!("the body is not valid JSON: {e}"),
        param: None,
        code: Some("invalid_json"),
    })?;
    let Value::Object(obj) = value else {
        return Err(ApiError::new(
            400,
            "invalid_json",
            "the body must be a JSON object",
        ));
    };
    if let Some(m) = obj.get("model") {
        let name = m
            .as_str()
            .ok_or_else(|| ApiError::field("model", "model must be a string"))?;
        if name != model {
            return Err(ApiError {
                status: 404,
                message: format!("the model `{name}` does not exist: this server has `{model}`"),
                param: Some("model"),
                code: Some("model_not_found"),
            });
        }
    }
    let prompt = match endpoint {
        Endpoint::Chat => Prompt::Messages(messages(&obj)?),
        _ => Prompt::Text(prompt_text(&obj)?),
    };
    let n = match obj.get("n") {
        None | Some(Value::Null) => 1,
        Some(v) => match v.as_u64() {
            Some(n @ 1..=MAX_N) => n as usize,
            _ => {
                return Err(ApiError::field(
                    "n",
                    format!("n must be an integer from 1 to {MAX_N}, not {v}"),
                ))
            }
        },
    };
    let logprobs = match endpoint {
        Endpoint::Chat => {
            let wanted = boolean(&obj, "logprobs")?.unwrap_or(false);
            let top = integer(&obj, "top_logprobs", 0)?;
            match (wanted, top) {
                (_, Some(k)) if k > MAX_TOP_LOGPROBS => {
                    return Err(ApiError::field(
                        "top_logprobs",
                        format!("top_logprobs must be from 0 to {MAX_TOP_LOGPROBS}, not {k}"),
                    ))
                }
                (false, Some(_)) => {
                    return Err(ApiError::field(
                        "top_logprobs",
                        "top_logprobs needs \"logprobs\": true",
                    ))
                }
                (true, k) => Some(k.unwrap_or(0) as usize),
                (false, None) => None,
            }
        }
        _ => match integer(&obj, "logprobs", 0)? {
            Some(k) if k > MAX_TOP_LOGPROBS => {
                return Err(ApiError::field(
                    "logprobs",
                    format!("logprobs must be from 0 to {MAX_TOP_LOGPROBS}, not {k}"),
                ))
            }
            k => k.map(|k| k as usize),
        },
    };
    let (tools, tool_names) = tools(&obj, endpoint)?;
    let response_format = response_format(&obj)?;
    if let Some(format) = &response_format {
        format.grammar()?;
    }
    let max_tokens = match endpoint {
        Endpoint::Chat => {
            integer(&obj, "max_completion_tokens", 1)?.or(integer(&obj, "max_tokens", 1)?)
        }
        _ => integer(&obj, "max_tokens", 1)?,
    };
    Ok(CompletionRequest {
        prompt,
        stream: boolean(&obj, "stream")?.unwrap_or(false),
        max_tokens: max_tokens.map(|n| n as usize),
        temperature: number(&obj, "temperature", 0.0, 2.0)?,
        top_p: number(&obj, "top_p", f32::MIN_POSITIVE, 1.0)?,
        seed: seed(&obj)?,
        stop: stop(&obj)?,
        n,
        logprobs,
        min_p: number(&obj, "min_p", 0.0, 1.0)?,
        top_k: integer(&obj, "top_k", 0)?.map(|k| k as usize),
        tools,
        tool_names,
        response_format,
    })
}

/// `tools` and `tool_choice`: the tools to render (none with `tool_choice: "none"`) and their
/// names. Forcing a call (`"required"` or a named function) is refused: the reply is not
/// constrained to a call.
fn tools(
    obj: &Map<String, Value>,
    endpoint: Endpoint,
) -> Result<(Option<Value>, Vec<String>), ApiError> {
    let list = match obj.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(list)) if endpoint == Endpoint::Chat => Some(list),
        Some(Value::Array(_)) => {
            return Err(ApiError::field(
                "tools",
                "tools are for /v1/chat/completions: a completion has no chat template",
            ))
        }
        Some(_) => return Err(ApiError::field("tools", "tools must be an array")),
    };
    let choice = match obj.get("tool_choice") {
        None | Some(Value::Null) => "auto",
        Some(Value::String(s)) if s == "auto" || s == "none" => s.as_str(),
        Some(v) => {
            return Err(ApiError::field(
                "tool_choice",
                format!(
                    "tool_choice {v} is not supported: give \"auto\" or \"none\" (a reply is \
                     not forced to call a tool)"
                ),
            ))
        }
    };
    let Some(list) = list.filter(|l| !l.is_empty() && choice == "auto") else {
        return Ok((None, Vec::new()));
    };
    let names = list
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let function = t
                .get("function")
                .filter(|_| t.get("type").and_then(Value::as_str) == Some("function"));
            function
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .map(str::to_string)
                .ok_or_else(|| {
                    ApiError::field(
                        "tools",
                        format!(
                            "tools[{i}] must be {{\"type\": \"function\", \"function\": \
                             {{\"name\": ..., \"parameters\": {{...}}}}}}"
                        ),
                    )
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((Some(Value::Array(list.clone())), names))
}

fn response_format(obj: &Map<String, Value>) -> Result<Option<ResponseFormat>, ApiError> {
    let Some(format) = obj.get("response_format").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let wrong = |why: &str| ApiError::field("response_format", format!("response_format: {why}"));
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(ResponseFormat::JsonObject)),
        Some("json_schema") => {
            let schema = format
                .get("json_schema")
                .and_then(|s| s.get("schema"))
                .ok_or_else(|| {
                    wrong("json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}")
                })?;
            Ok(Some(ResponseFormat::JsonSchema(schema.clone())))
        }
        _ => Err(wrong(
            "type must be \"text\", \"json_object\" or \"json_schema\"",
        )),
    }
}

fn messages(obj: &Map<String, Value>) -> Result<Vec<Message>, ApiError> {
    let list = obj
        .get("messages")
        .ok_or_else(|| ApiError::field("messages", "messages is required"))?
        .as_array()
        .ok_or_else(|| ApiError::field("messages", "messages must be an array"))?;
    if list.is_empty() {
        return Err(ApiError::field("messages", "messages must not be empty"));
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let role = m.get("role").and_then(Value::as_str).ok_or_else(|| {
                ApiError::field("messages", format!("messages[{i}].role must be a string"))
            })?;
            if !matches!(role, "system" | "user" | "assistant" | "tool") {
                return Err(ApiError::field(
                    "messages",
                    format!(
                        "messages[{i}].role is `{role}`: expected system, user, assistant or tool"
                    ),
                ));
            }
            let tool_calls = match m.get("tool_calls") {
                None | Some(Value::Null) => None,
                Some(calls @ Value::Array(list))
                    if role == "assistant"
                        && list.iter().all(|c| {
                            c.pointer("/function/name").is_some_and(Value::is_string)
                        }) =>
                {
                    Some(calls.clone())
                }
                Some(_) => {
                    return Err(ApiError::field(
                        "messages",
                        format!(
                            "messages[{i}].tool_calls must be an assistant's list of \
                             {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}"
                        ),
                    ))
                }
            };
            let content = match m.get("content") {
                None | Some(Value::Null) if tool_calls.is_some() => Some(String::new()),
                c => message_content(c),
            };
            let content = content.ok_or_else(|| {
                ApiError::field(
                    "messages",
                    format!(
                        "messages[{i}].content must be a string or a list of text parts \
                         ({{\"type\": \"text\", \"text\": ...}})"
                    ),
                )
            })?;
            let text = |key: &str| m.get(key).and_then(Value::as_str).map(str::to_string);
            let mut message = Message::new(role, &content);
            message.tool_calls = tool_calls;
            if role == "tool" {
                message.tool_call_id = text("tool_call_id");
                message.name = text("name");
            }
            Ok(message)
        })
        .collect()
}

/// A message's text: a string, or text parts joined.
fn message_content(content: Option<&Value>) -> Option<String> {
    match content? {
        Value::String(s) => Some(s.clone()),
        Value::Array(parts) => parts
            .iter()
            .map(
                |p| match (p.get("type")?.as_str()?, p.get("text")?.as_str()) {
                    ("text", Some(t)) => Some(t),
                    _ => None,
                },
            )
            .collect(),
        _ => None,
    }
}

/// A completion's prompt: a string, or a list holding one string.
fn prompt_text(obj: &Map<String, Value>) -> Result<String, ApiError> {
    let wrong = || {
        ApiError::field(
            "prompt",
            "prompt must be a string (or a list of one string: one prompt per request)",
        )
    };
    match obj
        .get("prompt")
        .ok_or_else(|| ApiError::field("prompt", "prompt is required"))?
    {
        Value::String(s) => Ok(s.clone()),
        Value::Array(list) if list.len() == 1 => {
            list[0].as_str().map(str::to_string).ok_or_else(wrong)
        }
        _ => Err(wrong()),
    }
}

fn boolean(obj: &Map<String, Value>, key: &'static str) -> Result<Option<bool>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| ApiError::field(key, format!("{key} must be true or false"))),
    }
}

fn integer(obj: &Map<String, Value>, key: &'static str, min: u64) -> Result<Option<u64>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n >= min => Ok(Some(n)),
            _ => Err(ApiError::field(
                key,
                format!("{key} must be an integer of at least {min}, not {v}"),
            )),
        },
    }
}

fn number(
    obj: &Map<String, Value>,
    key: &'static str,
    min: f32,
    max: f32,
) -> Result<Option<f32>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if (min as f64..=max as f64).contains(&x) => Ok(Some(x as f32)),
            _ => Err(ApiError::field(
                key,
                format!(
                    "{key} must be a number from {} to {max}, not {v}",
                    if min > 0.0 { "above 0" } else { "0" }
                ),
            )),
        },
    }
}

/// OpenAI's seed is any integer; a negative one is taken as its two's-complement bits.
fn seed(obj: &Map<String, Value>) -> Result<Option<u64>, ApiError> {
    match obj.get("seed") {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .or_else(|| v.as_i64().map(|s| s as u64))
            .map(Some)
            .ok_or_else(|| ApiError::field("seed", format!("seed must be an integer, not {v}"))),
    }
}

fn stop(obj: &Map<String, Value>) -> Result<Vec<String>, ApiError> {
    let wrong = || {
        ApiError::field(
            "stop",
            format!("stop must be a non-empty string or a list of at most {MAX_STOPS} of them"),
        )
    };
    let stops: Vec<String> = match obj.get("stop") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(list)) if list.len() <= MAX_STOPS => list
            .iter()
            .map(|s| s.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .ok_or_else(wrong)?,
        Some(_) => return Err(wrong()),
    };
    if stops.iter().any(String::is_empty) {
        return Err(wrong());
    }
    Ok(stops)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<CompletionRequest, ApiError> {
        parse(Endpoint::Chat, body.as_bytes(), "m")
    }

    fn completion(body: &str) -> Result<CompletionRequest, ApiError> {
        parse(Endpoint::Completions, body.as_bytes(), "m")
    }

    #[test]
    fn a_full_request_is_read() {
        let r = chat(
            r#"{"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]}],
                "stream": true, "max_tokens": 7, "temperature": 0, "top_p": 0.5, "seed": -1,
                "stop": ["a", "b"], "n": 2, "user": "ignored", "logprobs": true, "top_logprobs": 3,
                "min_p": 0.05, "response_format": {"type": "json_object"}}"#,
        )
        .unwrap();
        assert_eq!(
            r,
            CompletionRequest {
                prompt: Prompt::Messages(vec![
                    Message::new("system", "Be brief."),
                    Message::new("user", "Hi!")
                ]),
                stream: true,
                max_tokens: Some(7),
                temperature: Some(0.0),
                top_p: Some(0.5),
                seed: Some(u64::MAX),
                stop: vec!["a".into(), "b".into()],
                n: 2,
                logprobs: Some(3),
                min_p: Some(0.05),
                top_k: None,
                tools: None,
                tool_names: vec![],
                response_format: Some(ResponseFormat::JsonObject),
            }
        );
        let r = completion(r#"{"prompt": "x", "logprobs": 2}"#).unwrap();
        assert_eq!(r.logprobs, Some(2));
        let r =
            chat(r#"{"messages": [{"role": "user", "content": "x"}], "logprobs": true}"#).unwrap();
        assert_eq!(r.logprobs, Some(0));
        let r = completion(r#"{"prompt": ["Once"], "stop": "\n"}"#).unwrap();
        assert_eq!(r.prompt, Prompt::Text("Once".into()));
        assert_eq!(r.stop, vec!["\n".to_string()]);
        assert_eq!((r.stream, r.max_tokens, r.temperature), (false, None, None));
    }

    #[test]
    fn each_bad_field_is_named() {
        let cases = [
            (r#"{"messages": "hi"}"#, "messages"),
            (r#"{"messages": []}"#, "messages"),
            (
                r#"{"messages": [{"role": "robot", "content": "x"}]}"#,
                "messages",
            ),
            (
                r#"{"messages": [{"role": "user", "content": 3}]}"#,
                "messages",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}"#,
                "temperature",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "temperature": 2.5}"#,
                "temperature",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "top_p": 0}"#,
                "top_p",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}"#,
                "max_tokens",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5}"#,
                "max_tokens",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}"#,
                "stream",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "stop": ["", "b"]}"#,
                "stop",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "stop": ["a","b","c","d","e"]}"#,
                "stop",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "seed": "x"}"#,
                "seed",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "n": 0}"#,
                "n",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "n": 17}"#,
                "n",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}"#,
                "top_logprobs",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}"#,
                "top_logprobs",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "logprobs": 3}"#,
                "logprobs",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "min_p": 1.5}"#,
                "min_p",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "tools": {}}"#,
                "tools",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}"#,
                "tools",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}"#,
                "tool_choice",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}}"#,
                "response_format",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema",
                    "json_schema": {"schema": {"type": "object", "properties": {"a": {"oneOf": []}}}}}}"#,
                "response_format",
            ),
            (
                r#"{"messages": [{"role": "user", "content": 3, "tool_calls": "x"}]}"#,
                "messages",
            ),
            (
                r#"{"messages": [{"role": "user", "content": "x"}], "model": 5}"#,
                "model",
            ),
        ];
        for (body, field) in cases {
            let e = chat(body).unwrap_err();
            assert_eq!((e.status, e.param), (400, Some(field)), "{body}: {e:?}");
        }
        let e = completion(r#"{"prompt": 5}"#).unwrap_err();
        assert_eq!(e.param, Some("prompt"));
        let e = completion(r#"{}"#).unwrap_err();
        assert_eq!(e.param, Some("prompt"));
    }

    #[test]
    fn tools_tool_messages_and_formats_are_read() {
        let r = chat(
            r#"{"messages": [{"role": "user", "content": "1+1?"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
                    "function": {"name": "add", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c", "content": "2"}],
                "tools": [{"type": "function", "function": {"name": "add", "parameters": {}}}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                    "schema": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}}}"#,
        )
        .unwrap();
        assert_eq!(r.tool_names, ["add"]);
        let Prompt::Messages(m) = &r.prompt else {
            panic!()
        };
        assert_eq!(m[1].content, "");
        assert!(m[1].tool_calls.is_some());
        assert_eq!(m[2].tool_call_id.as_deref(), Some("c"));
        assert!(matches!(
            r.response_format,
            Some(ResponseFormat::JsonSchema(_))
        ));
        let none = chat(
            r#"{"messages": [{"role": "user", "content": "x"}], "tool_choice": "none",
                "tools": [{"type": "function", "function": {"name": "add"}}]}"#,
        )
        .unwrap();
        assert_eq!((none.tools, none.tool_names.len()), (None, 0));
    }

    #[test]
    fn malformed_json_and_unknown_models_are_refused() {
        let e = completion("{\"prompt\": ").unwrap_err();
        assert_eq!((e.status, e.code), (400, Some("invalid_json")));
        let e = completion("[1]").unwrap_err();
        assert_eq!((e.status, e.code), (400, Some("invalid_json")));
        let e = completion(r#"{"model": "gpt-4", "prompt": "x"}"#).unwrap_err();
        assert_eq!((e.status, e.code), (404, Some("model_not_found")));
        assert!(e.message.contains("gpt-4"), "{}", e.message);
    }
}
