//! Tool calls in a model's reply, in the formats chat templates teach: Qwen and Hermes
//! (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number), Llama 3.x (the reply
//! is `{"name": ..., "parameters": {...}}`, several separated by `;` or newlines) and Mistral
//! (`[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`; the marker is a special token the
//! detokenizer drops, so a reply that is such a list counts too). Only calls of the tools the
//! request offered are taken; anything else stays text.

use serde_json::{json, Value};

/// One call, as OpenAI returns it (`arguments` a JSON text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

/// Markers that begin a tool call inside a reply.
const MARKERS: [&str; 2] = ["<tool_call>", "[TOOL_CALLS]"];

/// The reply's text outside tool calls, and the calls; `None` when it has no call of `tools`.
pub fn parse(text: &str, tools: &[String]) -> Option<(String, Vec<ToolCall>)> {
    let known = |c: &ToolCall| tools.contains(&c.name);
    if text.contains("<tool_call>") {
        let mut content = String::new();
        let mut calls = Vec::new();
        let mut rest = text;
        while let Some(at) = rest.find("<tool_call>") {
            content.push_str(&rest[..at]);
            let body = &rest[at + "<tool_call>".len()..];
            let (inner, after) = match body.find("</tool_call>") {
                Some(end) => (&body[..end], &body[end + "</tool_call>".len()..]),
                None => (body, ""),
            };
            calls.extend(calls_in(inner.trim()));
            rest = after;
        }
        content.push_str(rest);
        return (!calls.is_empty() && calls.iter().all(known))
            .then(|| (content.trim().to_string(), calls));
    }
    let body = text.trim_start();
    let body = body.strip_prefix("[TOOL_CALLS]").unwrap_or(body).trim();
    let calls = calls_in(body);
    (!calls.is_empty() && calls.iter().all(known)).then(|| (String::new(), calls))
}

/// The calls of a text that is only calls: one object, a list of them, or objects separated by
/// `;` or whitespace. Empty if it is anything else.
fn calls_in(text: &str) -> Vec<ToolCall> {
    let mut calls = Vec::new();
    let mut rest = text;
    loop {
        rest = rest.trim_start_matches(|c: char| c.is_whitespace() || c == ';');
        if rest.is_empty() {
            return calls;
        }
        let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let parsed = match values.next() {
            Some(Ok(Value::Array(list))) => list.iter().map(call).collect::<Option<Vec<_>>>(),
            Some(Ok(v)) => call(&v).map(|c| vec![c]),
            _ => None,
        };
        match parsed {
            Some(c) => calls.extend(c),
            None => return Vec::new(),
        }
        rest = &rest[values.byte_offset()..];
    }
}

/// `{"name": ..., "arguments" | "parameters": {...}}` as a call.
fn call(v: &Value) -> Option<ToolCall> {
    let name = v.get("name")?.as_str()?.to_string();
    let args = v.get("arguments").or_else(|| v.get("parameters"));
    let arguments = match args {
        None => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(a) => a.to_string(),
    };
    Some(ToolCall { name, arguments })
}

/// OpenAI's `tool_calls` list; `serial` makes the ids unique on this server.
pub fn to_json(calls: &[ToolCall], serial: &str, with_index: bool) -> Value {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut v = json!({
                "id": format!("call_{serial}_{i}"),
                "type": "function",
                "function": { "name": c.name, "arguments": c.arguments },
            });
            if with_index {
                v["index"] = i.into();
            }
            v
        })
        .collect()
}

/// Streamed text of a reply that may call tools: released as it comes until what follows may be
/// a call (a marker, or a reply that opens with `{` or `[`); from there it is held, to be parsed
/// when the reply ends.
#[derive(Default)]
pub struct ToolGate {
    held: String,
    holding: bool,
    /// Some text other than whitespace was released.
    begun: bool,
}

impl ToolGate {
    /// The text of `piece` that can be sent now.
    pub fn push(&mut self, piece: &str) -> String {
        self.held.push_str(piece);
        if self.holding {
            return String::new();
        }
        if !self.begun {
            let trimmed = self.held.trim_start();
            match trimmed.chars().next() {
                None => return String::new(),
                Some('{' | '[') => {
                    self.holding = true;
                    return String::new();
                }
                Some(_) => self.begun = true,
            }
        }
        if let Some(at) = MARKERS.iter().filter_map(|m| self.held.find(m)).min() {
            self.holding = true;
            let text = self.held[..at].to_string();
            self.held.drain(..at);
            return text;
        }
        let h = &self.held;
        let keep = (1..=h.len())
            .rev()
            .filter(|&n| h.is_char_boundary(h.len() - n))
            .find(|&n| MARKERS.iter().any(|m| m.starts_with(&h[h.len() - n..])))
            .unwrap_or(0);
        let text = h[..h.len() - keep].to_string();
        self.held.drain(..h.len() - keep);
        text
    }

    /// The text held at the end of the reply.
    pub fn finish(self) -> String {
        self.held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<String> {
        vec!["get_weather".into(), "add".into()]
    }

    #[test]
    fn hermes_and_qwen_calls_are_parsed_with_the_text_around_them() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>";
        let (content, calls) = parse(text, &tools()).unwrap();
        assert_eq!(content, "Let me check.");
        assert_eq!(
            calls,
            [
                ToolCall {
                    name: "get_weather".into(),
                    arguments: r#"{"city":"Paris"}"#.into()
                },
                ToolCall {
                    name: "add".into(),
                    arguments: r#"{"a":1,"b":2}"#.into()
                }
            ]
        );
        // Cut off before the closing tag.
        let (_, calls) = parse(
            "<tool_call>{\"name\": \"add\", \"arguments\": {}}",
            &tools(),
        )
        .unwrap();
        assert_eq!(calls[0].name, "add");
        // An unknown tool is text.
        assert!(parse(
            "<tool_call>{\"name\": \"rm\", \"arguments\": {}}</tool_call>",
            &tools()
        )
        .is_none());
    }

    #[test]
    fn llama_and_mistral_calls_are_parsed() {
        let (content, calls) = parse(
            " {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}",
            &tools(),
        )
        .unwrap();
        assert_eq!(content, "");
        assert_eq!(calls[0].arguments, r#"{"city":"Rome"}"#);
        let (_, calls) = parse(
            "{\"name\": \"add\", \"parameters\": {\"a\": 1}}; {\"name\": \"add\", \"parameters\": {\"a\": 2}}",
            &tools(),
        )
        .unwrap();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[1].arguments, r#"{"a":2}"#);
        for text in [
            "[TOOL_CALLS] [{\"name\": \"add\", \"arguments\": {\"a\": 1}}, {\"name\": \"get_weather\", \"arguments\": {}}]",
            " [{\"name\": \"add\", \"arguments\": {\"a\": 1}}, {\"name\": \"get_weather\", \"arguments\": {}}]",
        ] {
            let (_, calls) = parse(text, &tools()).unwrap();
            assert_eq!(calls.len(), 2, "{text}");
            assert_eq!(calls[0].name, "add");
        }
        // Prose, or JSON that is not a call, is no call.
        for text in [
            "The weather is fine.",
            "{\"city\": \"Paris\"}",
            "{\"name\": \"add\"} and more",
        ] {
            assert!(parse(text, &tools()).is_none(), "{text}");
        }
    }

    #[test]
    fn the_gate_streams_prose_and_holds_calls() {
        let mut g = ToolGate::default();
        let mut out = String::new();
        for p in [
            "Sure",
            ", let me",
            " look. <tool",
            "_call>{\"name\"",
            ": \"add\"}",
        ] {
            out.push_str(&g.push(p));
        }
        assert_eq!(out, "Sure, let me look. ");
        assert_eq!(g.finish(), "<tool_call>{\"name\": \"add\"}");
        let mut g = ToolGate::default();
        assert_eq!(g.push(" "), "");
        assert_eq!(g.push("{\"name\""), "");
        assert_eq!(g.finish(), " {\"name\"");
        let mut g = ToolGate::default();
        assert_eq!(g.push("a <"), "a ");
        assert_eq!(g.push("b"), "<b");
        assert_eq!(g.finish(), "");
    }
}
