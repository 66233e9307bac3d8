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
    /// `system`, `user` or `assistant`.
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
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
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| {
                Value::from(BTreeMap::from([
                    ("role", Value::from(m.role.as_str())),
                    ("content", Value::from(m.content.as_str())),
                ]))
            })
            .collect();
        let ctx = Value::from(BTreeMap::from([
            ("messages", Value::from(messages)),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
            ("bos_token", Value::from(self.bos_token.as_str())),
            ("eos_token", Value::from(self.eos_token.as_str())),
        ]));
        let template = self.env.get_template(NAME).expect("added in new");
        template
            .render(ctx)
            .map_err(|e| anyhow::anyhow!("cannot render the chat template: {e:#}"))
    }

    /// Token ids of `messages` rendered with the generation prompt. The template writes the
    /// special tokens it wants (BOS included), so the tokenizer adds none, as `transformers` does.
    pub fn encode(&self, tokenizer: &Tokenizer, messages: &[Message]) -> Result<Vec<u32>> {
        tokenizer.encode(&self.render(messages, true)?, false)
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
