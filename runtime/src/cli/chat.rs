//! `leanstream chat` and `run --chat`: conversations with an instruction-tuned model. Each turn
//! is rendered through the model's chat template; the conversation stays in the KV cache, so a
//! turn computes only the tokens that are new since the previous one. Ctrl-C stops a reply; at the
//! prompt it ends the session.

use std::io::{BufRead, IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use serde::Serialize;

use crate::cli::sampling_args::SamplingArgs;
use crate::model::kv_cache::KvCache;
pub use crate::text::chat::{single_turn, ChatFormat};
use crate::text::generate::{generate_after, GenerateOptions, StopReason};
use crate::text::session::Session;
use crate::tokenizer::chat_template::Message;
use crate::tokenizer::Tokenizer;

#[derive(Args, Debug, Clone)]
pub struct ChatArgs {
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Maximum number of tokens per reply.
    #[arg(short = 'n', long = "n-tokens", default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..))]
    pub n_tokens: u64,
    /// A system message that opens the conversation (templates may add their own default).
    #[arg(long)]
    pub system: Option<String>,
}

/// The conversation so far and what the KV cache holds of it.
struct Conversation {
    system: Option<Message>,
    messages: Vec<Message>,
    cache: KvCache,
    /// The tokens in `cache`, in order.
    tokens: Vec<u32>,
}

/// A turn's tokens: what the cache already holds and what must be computed.
struct Turn {
    reused: usize,
    new_tokens: Vec<u32>,
}

impl Conversation {
    fn new(system: Option<Message>, cache: KvCache) -> Self {
        Self {
            messages: system.iter().cloned().collect(),
            system,
            cache,
            tokens: Vec::new(),
        }
    }

    /// Adds the user's message and finds the tokens to compute: the rendered conversation's
    /// tokens after the longest prefix the cache already holds. A conversation that no longer
    /// fits the context starts over from this message; `None` if even that does not fit.
    fn add_user(
        &mut self,
        text: &str,
        format: &ChatFormat,
        tokenizer: &Tokenizer,
    ) -> Result<Option<Turn>> {
        let ctx = self.cache.capacity();
        self.messages.push(Message::new("user", text));
        let mut ids = format.template.encode(tokenizer, &self.messages)?;
        if ids.len() >= ctx {
            let fresh: Vec<Message> = self
                .system
                .iter()
                .cloned()
                .chain([Message::new("user", text)])
                .collect();
            let alone = format.template.encode(tokenizer, &fresh)?;
            if alone.len() >= ctx {
                self.messages.pop();
                eprintln!(
                    "note: this message needs {} tokens with the template but the context holds \
                     {ctx}: shorten it or raise --ctx",
                    alone.len()
                );
                return Ok(None);
            }
            eprintln!(
                "note: the conversation fills the context ({ctx} tokens): starting a new one \
                 with this message (raise --ctx to keep more)"
            );
            self.messages = fresh;
            ids = alone;
        }
        let mut reused = ids
            .iter()
            .zip(&self.tokens)
            .take_while(|(a, b)| a == b)
            .count();
        // At least one token is computed: its logits give the reply's first token.
        reused = reused.min(ids.len() - 1);
        self.cache.truncate(reused);
        self.tokens.truncate(reused);
        Ok(Some(Turn {
            reused,
            new_tokens: ids[reused..].to_vec(),
        }))
    }

    /// Records the reply: its text as the assistant's message, and the tokens the cache now holds.
    fn add_reply(&mut self, turn: &Turn, reply_text: &str, reply_tokens: &[u32]) {
        self.tokens.extend_from_slice(&turn.new_tokens);
        self.tokens.extend_from_slice(reply_tokens);
        self.tokens.truncate(self.cache.len());
        self.messages.push(Message::new("assistant", reply_text));
    }
}

/// One line per turn in `--json`.
#[derive(Serialize)]
struct TurnReport<'a> {
    turn: usize,
    reply: &'a str,
    /// Tokens computed for the user's turn (the template's markup included).
    prompt_tokens: usize,
    /// Tokens of the conversation reused from the KV cache.
    reused_tokens: usize,
    generated_tokens: usize,
    /// Tokens in the KV cache after the reply.
    context_tokens: usize,
    tokens_per_s: f64,
    ttft_ms: f64,
    stop_reason: StopReason,
}

/// Set by the Ctrl-C handler.
#[derive(Default)]
struct Signals {
    replying: AtomicBool,
    interrupt: AtomicBool,
}

/// Reads one user message per line from stdin until EOF and streams each reply to stdout.
pub fn run(mut session: Session, args: &ChatArgs, json: bool) -> Result<()> {
    let format = ChatFormat::new(&session)?;
    let signals = Arc::new(Signals::default());
    let handler = signals.clone();
    ctrlc::set_handler(move || {
        if handler.replying.load(Ordering::SeqCst) {
            handler.interrupt.store(true, Ordering::SeqCst);
        } else {
            eprintln!();
            std::process::exit(130);
        }
    })
    .context("cannot install the Ctrl-C handler")?;
    let stdin = std::io::stdin();
    let interactive = stdin.is_terminal();
    if interactive {
        eprintln!(
            "chat with {}: Ctrl-C stops a reply; Ctrl-C or Ctrl-D at the prompt ends the chat",
            session.model_path.display()
        );
    }
    let ctx = session.ctx;
    let opts = GenerateOptions {
        max_tokens: args.n_tokens as usize,
        ctx,
        sampler: args.sampling.config(),
        eos_token_ids: format.eos_token_ids.clone(),
    };
    let system = args.system.as_deref().map(|s| Message::new("system", s));
    let mut conversation = Conversation::new(system, session.model().new_cache(ctx));
    let tokenizer = session.tokenizer.clone();
    let mut stdout = std::io::stdout().lock();
    let mut line = String::new();
    let mut turn = 0;
    loop {
        if interactive {
            let _ = write!(stdout, "> ");
            let _ = stdout.flush();
        }
        line.clear();
        if stdin
            .lock()
            .read_line(&mut line)
            .context("cannot read stdin")?
            == 0
        {
            break;
        }
        let text = line.trim_end_matches(['\n', '\r']);
        if text.trim().is_empty() {
            continue;
        }
        let Some(next) = conversation.add_user(text, &format, &tokenizer)? else {
            continue;
        };
        turn += 1;
        signals.interrupt.store(false, Ordering::SeqCst);
        signals.replying.store(true, Ordering::SeqCst);
        let generation = generate_after(
            session.model(),
            &tokenizer,
            &mut conversation.cache,
            &conversation.tokens,
            &next.new_tokens,
            &opts,
            &signals.interrupt,
            |piece| {
                if !json {
                    // A closed stdout (e.g. `| head`) should not abort the reply with a panic.
                    let _ = stdout.write_all(piece.as_bytes());
                    let _ = stdout.flush();
                }
            },
        );
        signals.replying.store(false, Ordering::SeqCst);
        let generation = generation?;
        conversation.add_reply(&next, &generation.text, &generation.tokens);
        let stats = &generation.stats;
        match stats.stop_reason {
            StopReason::Interrupted => eprintln!("\n[stopped]"),
            StopReason::ContextFull => eprintln!(
                "\nnote: the context is full ({ctx} tokens): the reply was cut; the next message \
                 starts a new conversation (raise --ctx to keep more)"
            ),
            StopReason::Eos | StopReason::MaxTokens => {}
        }
        if json {
            let report = TurnReport {
                turn,
                reply: &generation.text,
                prompt_tokens: stats.prompt_tokens,
                reused_tokens: next.reused,
                generated_tokens: stats.generated_tokens,
                context_tokens: conversation.cache.len(),
                tokens_per_s: stats.tokens_per_s,
                ttft_ms: stats.ttft_ms,
                stop_reason: stats.stop_reason,
            };
            let _ = writeln!(stdout, "{}", serde_json::to_string(&report)?);
        } else {
            let _ = writeln!(stdout);
            eprintln!(
                "[{} new prompt tokens ({} reused from the conversation), {} generated at {:.1} tok/s]",
                stats.prompt_tokens, next.reused, stats.generated_tokens, stats.tokens_per_s
            );
        }
    }
    Ok(())
}
