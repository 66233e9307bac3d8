//! A model's chat format: its template and the tokens that end a reply, shared by `leanstream
//! chat`, `run --chat`, `serve` and the C API.

use anyhow::Result;

use crate::text::session::Session;
use crate::tokenizer::chat_template::{ChatTemplate, Message};

/// The model's template and every token that ends a reply: the model's end-of-sequence tokens and
/// the template's end-of-turn token.
pub struct ChatFormat {
    pub template: ChatTemplate,
    pub eos_token_ids: Vec<u32>,
}

impl ChatFormat {
    pub fn new(session: &Session) -> Result<Self> {
        let template =
            ChatTemplate::for_model(session.chat_template.as_ref(), &session.model_path)?;
        let mut eos_token_ids = session.eos_token_ids.clone();
        eos_token_ids.extend(template.end_of_turn(&session.tokenizer)?);
        eos_token_ids.sort_unstable();
        eos_token_ids.dedup();
        Ok(Self {
            template,
            eos_token_ids,
        })
    }
}

/// For `run --chat`: `text` as one user message through the template, and the tokens that end
/// the reply.
pub fn single_turn(session: &Session, text: &str) -> Result<(Vec<u32>, Vec<u32>)> {
    let format = ChatFormat::new(session)?;
    let prompt = format
        .template
        .encode(&session.tokenizer, &[Message::new("user", text)])?;
    Ok((prompt, format.eos_token_ids))
}
