//! Request validation: a completion or chat request's JSON body checked field by field, each
//! problem reported as a 4xx naming the field, before the request takes a place in the queue.

use serde_json::{Map, Value};

use super::error::ApiError;
use crate::tokenizer::chat_template::Message;

/// Which endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/completions`: plain text continued.
    Completions,
    /// `POST /v1/chat/completions`: messages through the model's chat template.
    Chat,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Messages(Vec<Message>),
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
}

/// At most this many stop strings, as OpenAI allows.
const MAX_STOPS: usize = 4;

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
        Endpoint::Completions => Prompt::Text(prompt_text(&obj)?),
    };
    if let Some(n) = obj.get("n") {
        if n.as_u64() != Some(1) {
            return Err(ApiError::field("n", "n must be 1: one choice per request"));
        }
    }
    let max_tokens = match endpoint {
        Endpoint::Chat => {
            integer(&obj, "max_completion_tokens", 1)?.or(integer(&obj, "max_tokens", 1)?)
        }
        Endpoint::Completions => integer(&obj, "max_tokens", 1)?,
    };
    Ok(CompletionRequest {
        prompt,
        stream: boolean(&obj, "stream")?.unwrap_or(false),
        max_tokens: max_tokens.map(|n| n as usize),
        temperature: number(&obj, "temperature", 0.0, 2.0)?,
        top_p: number(&obj, "top_p", f32::MIN_POSITIVE, 1.0)?,
        seed: seed(&obj)?,
        stop: stop(&obj)?,
    })
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
            if !matches!(role, "system" | "user" | "assistant") {
                return Err(ApiError::field(
                    "messages",
                    format!("messages[{i}].role is `{role}`: expected system, user or assistant"),
                ));
            }
            let content = message_content(m.get("content")).ok_or_else(|| {
                ApiError::field(
                    "messages",
                    format!(
                        "messages[{i}].content must be a string or a list of text parts \
                         ({{\"type\": \"text\", \"text\": ...}})"
                    ),
                )
            })?;
            Ok(Message::new(role, &content))
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
                "stop": ["a", "b"], "n": 1, "user": "ignored"}"#,
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
            }
        );
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
                r#"{"messages": [{"role": "user", "content": "x"}], "n": 2}"#,
                "n",
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
