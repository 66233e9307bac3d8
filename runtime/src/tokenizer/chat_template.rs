//! A model's chat template: the Jinja program (Hugging Face `chat_template`, GGUF
//! `tokenizer.chat_template`) that turns a list of messages into the prompt text the model was
//! tuned on, rendered with `minijinja` the way `transformers` renders it (`trim_blocks`,
//! `lstrip_blocks`, Python string methods, `raise_exception`).

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use leanstream_format::meta::ChatTemplate as TemplateSource;
use minijinja::syntax::SyntaxConfig;
use minijinja::{Environment, Error, ErrorKind, Value};

use crate::tokenizer::Tokenizer;

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    pub content: String,
    /// An assistant's calls: OpenAI's `tool_calls` list, each `function.arguments` an object
    /// (as templates expect; a JSON text is parsed into one).
    pub tool_calls: Option<serde_json::Value>,
    /// A tool result's call id.
    pub tool_call_id: Option<String>,
    /// A tool result's tool name.
    pub name: Option<String>,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }

    fn to_value(&self) -> Value {
        let mut m = serde_json::json!({ "role": self.role, "content": self.content });
        if let Some(calls) = &self.tool_calls {
            let mut calls = calls.clone();
            for call in calls.as_array_mut().into_iter().flatten() {
                // Templates read `tool_call.function.name` or `tool_call.name` (a flattened
                // call), and `arguments` as an object.
                if let Some(f) = call.get("function").cloned() {
                    if let Some(obj) = call.as_object_mut() {
                        for (k, v) in f.as_object().into_iter().flatten() {
                            obj.entry(k.clone()).or_insert_with(|| v.clone());
                        }
                    }
                }
                for path in ["/arguments", "/function/arguments"] {
                    if let Some(args) = call.pointer_mut(path) {
                        if let Some(parsed) = args
                            .as_str()
                            .and_then(|s| serde_json::from_str::<serde_json::Value>(s).ok())
                        {
                            *args = parsed;
                        }
                    }
                }
            }
            m["tool_calls"] = calls;
        }
        if let Some(id) = &self.tool_call_id {
            m["tool_call_id"] = id.as_str().into();
        }
        if let Some(name) = &self.name {
            m["name"] = name.as_str().into();
        }
        to_jinja(&m)
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

const NAME: &str = "chat_template";

impl ChatTemplate {
    /// Compiles `source`; `model` names the model in errors.
    pub fn new(source: &TemplateSource, model: &Path) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .expect("the default delimiters are valid");
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<Value, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.template.clone())
            .with_context(|| format!("{}: the chat template does not parse", model.display()))?;
        Ok(Self {
            env,
            bos_token: source.bos_token.clone().unwrap_or_default(),
            eos_token: source.eos_token.clone().unwrap_or_default(),
        })
    }

    /// The model's template, or a clear error when it has none.
    pub fn for_model(source: Option<&TemplateSource>, model: &Path) -> Result<Self> {
        let source = source.with_context(|| {
            format!(
                "{} has no chat template (GGUF tokenizer.chat_template, chat_template in \
                 tokenizer_config.json or chat_template.jinja): chat needs an instruction-tuned \
                 model; use `leanstream run` without --chat to continue plain text",
                model.display()
            )
        })?;
        Self::new(source, model)
    }

    /// The prompt text for `messages`; `add_generation_prompt` appends the opening of the
    /// assistant's reply.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// [`render`](Self::render) with `tools` (OpenAI's list of `{"type": "function",
    /// "function": {...}}`), given to the template as `tools` the way `transformers` does.
    pub fn render_with_tools(
        &self,
        messages: &[Message],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let messages: Vec<Value> = messages.iter().map(Message::to_value).collect();
        let mut ctx = BTreeMap::from([
            ("messages", Value::from(messages)),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
            ("bos_token", Value::from(self.bos_token.as_str())),
            ("eos_token", Value::from(self.eos_token.as_str())),
        ]);
        if let Some(tools) = tools {
            ctx.insert("tools", to_jinja(tools));
        }
        let ctx = Value::from(ctx);
        let template = self.env.get_template(NAME).expect("added in new");
        template
            .render(ctx)
            .map_err(|e| anyhow::anyhow!("cannot render the chat template: {e:#}"))
    }

    /// Token ids of `messages` rendered with the generation prompt. The template writes the
    /// special tokens it wants (BOS included), so the tokenizer adds none, as `transformers` does.
    pub fn encode(&self, tokenizer: &Tokenizer, messages: &[Message]) -> Result<Vec<u32>> {
        self.encode_with_tools(tokenizer, messages, None)
    }

    /// [`encode`](Self::encode) with `tools` (see [`render_with_tools`](Self::render_with_tools)).
    pub fn encode_with_tools(
        &self,
        tokenizer: &Tokenizer,
        messages: &[Message],
        tools: Option<&serde_json::Value>,
    ) -> Result<Vec<u32>> {
        tokenizer.encode(&self.render_with_tools(messages, tools, true)?, false)
    }

    /// The special token the template closes an assistant turn with (`<|im_end|>`, `</s>`,
    /// `<|eot_id|>`...), found by rendering a reply and tokenizing what follows it.
    pub fn end_of_turn(&self, tokenizer: &Tokenizer) -> Result<Option<u32>> {
        const REPLY: &str = "LEANSTREAM-REPLY-MARK";
        let text = self.render(
            &[Message::new("user", "Hi"), Message::new("assistant", REPLY)],
            false,
        )?;
        let Some(at) = text.find(REPLY) else {
            return Ok(None);
        };
        let ids = tokenizer.encode(text[at + REPLY.len()..].trim_start(), false)?;
        // A special token decodes to nothing (the tokenizer skips special tokens).
        Ok(match ids.first() {
            Some(&id) if tokenizer.decode(&[id])?.is_empty() => Some(id),
            _ => None,
        })
    }
}

/// `tojson` as `transformers` defines it for templates: Python's `json.dumps` (`", "` and
/// `": "` between items, or `indent`, non-ASCII kept).
fn tojson(value: Value, kwargs: minijinja::value::Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let json = from_jinja(&value)?;
    let mut out = Vec::new();
    let written = match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let f = serde_json::ser::PrettyFormatter::with_indent(&pad);
            serde::Serialize::serialize(
                &json,
                &mut serde_json::Serializer::with_formatter(&mut out, f),
            )
        }
        None => serde::Serialize::serialize(
            &json,
            &mut serde_json::Serializer::with_formatter(&mut out, PythonFormatter),
        ),
    };
    written.map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(Value::from_safe_string(
        String::from_utf8(out).expect("serde_json writes UTF-8"),
    ))
}

/// A JSON value as a template value.
fn to_jinja(v: &serde_json::Value) -> Value {
    use serde_json::Value as J;
    match v {
        J::Null => Value::from(()),
        J::Bool(b) => Value::from(*b),
        J::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => Value::from(i),
            (None, Some(u)) => Value::from(u),
            _ => Value::from(n.as_f64().unwrap_or(f64::NAN)),
        },
        J::String(s) => Value::from(s.as_str()),
        J::Array(list) => Value::from(list.iter().map(to_jinja).collect::<Vec<_>>()),
        J::Object(map) => Value::from(
            map.iter()
                .map(|(k, v)| (k.clone(), to_jinja(v)))
                .collect::<BTreeMap<_, _>>(),
        ),
    }
}

/// A template value as JSON (for `tojson`).
fn from_jinja(v: &Value) -> Result<serde_json::Value, Error> {
    use minijinja::value::ValueKind;
    use serde_json::Value as J;
    Ok(match v.kind() {
        ValueKind::Undefined | ValueKind::None => J::Null,
        ValueKind::Bool => J::Bool(v.is_true()),
        ValueKind::Number => match i64::try_from(v.clone()) {
            Ok(i) => J::from(i),
            Err(_) => J::from(f64::try_from(v.clone())?),
        },
        ValueKind::String => J::from(v.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => J::Array(
            v.try_iter()?
                .map(|x| from_jinja(&x))
                .collect::<Result<_, _>>()?,
        ),
        ValueKind::Map => {
            let mut map = serde_json::Map::new();
            for key in v.try_iter()? {
                let value = v.get_item(&key)?;
                map.insert(key.to_string(), from_jinja(&value)?);
            }
            J::Object(map)
        }
        _ => J::from(v.to_string()),
    })
}

/// `json.dumps`'s default separators.
struct PythonFormatter;

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

/// The template of a Hugging Face model directory: `chat_template.jinja`, else `chat_template` in
/// `tokenizer_config.json` (a string, or a list of named templates: `default`, else the first).
pub fn from_hf_dir(dir: &Path) -> Result<Option<TemplateSource>> {
    let config_path = dir.join("tokenizer_config.json");
    let config: serde_json::Value = if config_path.is_file() {
        let text = std::fs::read_to_string(&config_path)
            .with_context(|| format!("cannot read {}", config_path.display()))?;
        serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", config_path.display()))?
    } else {
        serde_json::Value::Null
    };
    let jinja_path = dir.join("chat_template.jinja");
    let template = if jinja_path.is_file() {
        Some(
            std::fs::read_to_string(&jinja_path)
                .with_context(|| format!("cannot read {}", jinja_path.display()))?,
        )
    } else {
        match config.get("chat_template") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Array(list)) => {
                let named = |want: Option<&str>| {
                    list.iter().find(|t| {
                        want.is_none_or(|w| t.get("name").and_then(|n| n.as_str()) == Some(w))
                    })
                };
                named(Some("default"))
                    .or_else(|| named(None))
                    .and_then(|t| t.get("template"))
                    .and_then(|t| t.as_str())
                    .map(str::to_string)
            }
            Some(other) => bail!(
                "{}: chat_template is {other}, expected a string or a list of {{name, template}}",
                config_path.display()
            ),
        }
    };
    // `bos_token` is a string, or an added-token object with its text in `content`.
    let token = |key: &str| {
        let v = config.get(key)?;
        v.as_str()
            .or_else(|| v.get("content").and_then(|c| c.as_str()))
            .map(str::to_string)
    };
    Ok(template.map(|template| TemplateSource {
        template,
        bos_token: token("bos_token"),
        eos_token: token("eos_token"),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(source: &str) -> ChatTemplate {
        let source = TemplateSource {
            template: source.into(),
            bos_token: Some("<s>".into()),
            eos_token: Some("</s>".into()),
        };
        ChatTemplate::new(&source, Path::new("test")).unwrap()
    }

    #[test]
    fn python_string_methods_and_raise_exception_work() {
        let t = template(
            "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}\
             {% for m in messages %}[{{ m['content'].strip() }}]{% endfor %}",
        );
        assert_eq!(
            t.render(&[Message::new("user", "  hi  ")], false).unwrap(),
            "[hi]"
        );
        let err = t
            .render(&[Message::new("assistant", "x")], false)
            .unwrap_err();
        assert!(format!("{err:#}").contains("user first"), "{err:#}");
    }

    /// The tool parts of Qwen2.5's template, as it ships.
    const QWEN_TOOLS: &str = r##"{%- if tools %}
{{- '<|im_start|>system\n' }}
{{- "# Tools\n\n<tools>" }}
{%- for tool in tools %}
{{- "\n" }}{{- tool | tojson }}
{%- endfor %}
{{- "\n</tools><|im_end|>\n" }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == "user" %}
{{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\n<tool_call>\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == "tool" %}
{{- '<|im_start|>user\n<tool_response>\n' }}{{- message.content }}{{- '\n</tool_response><|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"##;

    #[test]
    fn tools_tool_calls_and_tool_results_reach_the_template() {
        let t = template(QWEN_TOOLS);
        let tools = serde_json::json!([{"type": "function", "function": {"name": "add",
            "parameters": {"type": "object"}}}]);
        let mut call = Message::new("assistant", "");
        call.tool_calls = Some(serde_json::json!([{"id": "c1", "type": "function",
            "function": {"name": "add", "arguments": "{\"a\": 1}"}}]));
        let mut result = Message::new("tool", "2");
        result.tool_call_id = Some("c1".into());
        let text = t
            .render_with_tools(
                &[Message::new("user", "1+1?"), call, result],
                Some(&tools),
                true,
            )
            .unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\n# Tools\n\n<tools>\n{\"function\": {\"name\": \"add\", \
             \"parameters\": {\"type\": \"object\"}}, \"type\": \"function\"}\n</tools><|im_end|>\n\
             <|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n\
             {\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call><|im_end|>\n\
             <|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>\n\
             <|im_start|>assistant\n"
        );
    }

    #[test]
    fn blocks_are_trimmed_as_transformers_does() {
        let t = template("{% for m in messages %}\n  {% if true %}\n{{ m.content }}\n  {% endif %}\n{% endfor %}");
        assert_eq!(
            t.render(
                &[Message::new("user", "a"), Message::new("user", "b")],
                false
            )
            .unwrap(),
            "a\nb\n"
        );
    }
}
