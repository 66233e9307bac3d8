//! The chat templates of Llama 3.1 and 3.2, Phi-3.5, Gemma 2 and 3, and Mistral (7B v0.1 and
//! Nemo), rendered as `transformers` renders them: jinja2 gave the reference text, or the error a
//! template raises (Gemma 2 has no system role; Gemma 3 folds the system prompt into the first
//! user turn). scripts/make-tokenizer-fixtures.py wrote both.

use std::path::Path;

use anyhow::Result;
use leanstream::tokenizer::chat_template::{ChatTemplate, Message};
use leanstream_format::meta::ChatTemplate as TemplateSource;
use serde_json::Value;

#[test]
fn real_templates_render_as_transformers_renders_them() -> Result<()> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tokenizers");
    let chat: Value = serde_json::from_slice(&std::fs::read(dir.join("chat.json"))?)?;
    let templates = chat["templates"].as_object().expect("templates");
    assert_eq!(templates.len(), 7);
    let (mut texts, mut errors) = (0, 0);
    for (name, t) in templates {
        let source = TemplateSource {
            template: std::fs::read_to_string(dir.join(format!("templates/{name}.jinja")))?,
            bos_token: t["bos_token"].as_str().map(str::to_string),
            eos_token: t["eos_token"].as_str().map(str::to_string),
        };
        let template = ChatTemplate::new(&source, Path::new(name))?;
        for (conversation, expected) in t["renders"].as_object().expect("renders") {
            let messages: Vec<Message> = chat["conversations"][conversation]
                .as_array()
                .expect("a conversation")
                .iter()
                .map(|m| Message::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
                .collect();
            let rendered = template.render(&messages, true);
            match (expected["text"].as_str(), expected["error"].as_str()) {
                (Some(text), _) => {
                    assert_eq!(rendered?, text, "{name}, {conversation}");
                    texts += 1;
                }
                (None, Some(error)) => {
                    let err = format!("{:#}", rendered.expect_err(name));
                    assert!(err.contains(error), "{name}, {conversation}: {err}");
                    errors += 1;
                }
                _ => panic!("{name}, {conversation}: no reference"),
            }
        }
    }
    assert_eq!((texts, errors), (12, 2));
    Ok(())
}

#[test]
fn gemma_3_folds_the_system_prompt_into_the_first_user_turn() -> Result<()> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tokenizers/templates");
    let source = TemplateSource {
        template: std::fs::read_to_string(dir.join("gemma-3.jinja"))?,
        bos_token: Some("<bos>".into()),
        eos_token: Some("<eos>".into()),
    };
    let template = ChatTemplate::new(&source, Path::new("gemma-3"))?;
    let text = template.render(
        &[
            Message::new("system", "Be brief."),
            Message::new("user", "Why?"),
        ],
        true,
    )?;
    assert_eq!(
        text,
        "<bos><start_of_turn>user\nBe brief.\n\nWhy?<end_of_turn>\n<start_of_turn>model\n"
    );
    Ok(())
}
