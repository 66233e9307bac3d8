//! `leanstream serve`: the model behind an OpenAI-compatible HTTP API (`/v1/chat/completions`,
//! `/v1/completions`, streamed as server-sent events or whole; `/v1/models`, `/health`,
//! `/metrics`), the way local runtimes are used by apps and tools written for OpenAI's API; also
//! Ollama's `/api/*` and llama.cpp's `/completion`, `/tokenize` and `/detokenize` (compat.rs).
//!
//! One HTTP thread validates requests and answers the cheap routes; `--parallel` slots (one by
//! default, on this thread) take queued requests in arrival order, each with its own KV cache
//! reused for the previous conversation's common prefix, and decode their tokens together
//! (batch.rs: continuous batching, every reply bit for bit what it would be alone). The server is
//! `tiny_http`: synchronous, four small dependencies, no async runtime (docs/serve.md: its size
//! and build-time cost).

mod batch;
mod compat;
mod decode;
mod error;
mod json_grammar;
mod metrics;
mod queue;
mod reply;
mod request;
mod routes;
mod sse;
mod stop;
mod tools;
mod worker;

use std::sync::Arc;

use anyhow::{anyhow, Result};
use clap::Args;

use crate::cli::sampling_args::SamplingArgs;
use crate::platform::elastic::BudgetWatch;
use crate::text::chat::ChatFormat;
use crate::text::session::Session;

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// Address to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port, printed at start).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Requests served at once, each with its own KV cache (counted in --memory: fewer are
    /// served when that many caches do not fit); their tokens are decoded together, each
    /// layer's FFN read once for all of them.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub parallel: u64,
    /// Requests that may wait while others are served; more are refused with 503.
    #[arg(long, default_value_t = 16)]
    pub queue: usize,
    /// Largest request body accepted (413 beyond): 1MiB, 64KiB or bytes.
    #[arg(long, default_value = "1MiB", value_parser = crate::platform::memory_size::parse_budget)]
    pub max_body: u64,
    /// The model's name in the API (default: the model file's name without its extension).
    #[arg(long)]
    pub model_name: Option<String>,
    /// Maximum tokens of a reply whose request sets no max_tokens.
    #[arg(short = 'n', long = "n-tokens", default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..))]
    pub n_tokens: u64,
    /// Sampling for the fields a request leaves out (temperature, top_p, seed); top-k and the
    /// repetition penalty apply to every request.
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

/// Serves `session` until the process is stopped.
pub fn run(mut session: Session, args: &ServeArgs) -> Result<()> {
    let server = tiny_http::Server::http((args.host.as_str(), args.port)).map_err(|e| {
        anyhow!(
            "cannot listen on {}:{}: {e} (another server on that port? choose one with --port)",
            args.host,
            args.port
        )
    })?;
    let model_id = args.model_name.clone().unwrap_or_else(|| {
        session
            .model_path
            .file_stem()
            .map_or("model".into(), |s| s.to_string_lossy().into_owned())
    });
    let metrics = Arc::new(metrics::ServerMetrics::default());
    let (queue, jobs) = queue::bounded(args.queue);
    let asked = args.parallel as usize;
    let (slots, reserved) = session.reserve_kv_slots(asked)?;
    if slots < asked {
        eprintln!(
            "note: --memory holds the KV caches of {slots} requests at --ctx {}, not {asked}: serving {slots} at once (raise --memory or lower --ctx to serve more)",
            session.ctx
        );
    }
    let budget = budget(&mut session, reserved)?;
    let frontend = routes::Frontend {
        model_id: model_id.clone(),
        tokenizer: session.tokenizer.clone(),
        chat: ChatFormat::new(&session).map_err(|e| format!("{e:#}")),
        eos_token_ids: session.eos_token_ids.clone(),
        ctx: session.ctx,
        sampler: args.sampling.config(),
        max_tokens: args.n_tokens as usize,
        max_body_bytes: args.max_body,
        metrics: metrics.clone(),
        queue,
        budget,
    };
    let tokenizer = session.tokenizer.clone();
    let shared = Arc::new(worker::Shared::new(
        batch::Batcher::new(session, slots),
        tokenizer,
        model_id.clone(),
        metrics,
        reserved,
    ));
    worker::publish_metrics(&shared);
    let address = server
        .server_addr()
        .to_ip()
        .map_or_else(|| format!("{}:{}", args.host, args.port), |a| a.to_string());
    eprintln!("serving {model_id} at http://{address}/v1 (also /health, /metrics); Ctrl-C stops");
    if slots > 1 {
        eprintln!("{slots} requests at once, their tokens decoded together");
    }
    std::thread::Builder::new()
        .name("http".into())
        .spawn(move || frontend.serve(&server))
        .map_err(|e| anyhow!("cannot start the HTTP thread: {e}"))?;
    worker::run(shared, jobs);
    Ok(())
}

/// What `POST /v1/budget` works with: a handle the running model follows, when it was started
/// with a fixed `--memory`; otherwise why the budget cannot be set over HTTP. `reserved`: the bytes
/// of the budget the slots' extra KV caches hold, beside what the model plans.
fn budget(session: &mut Session, reserved: u64) -> Result<Result<routes::Budget, String>> {
    if session.follows_budget() {
        return Ok(Err(
            "the budget follows --memory-file or --memory auto: change it there".into(),
        ));
    }
    let (Some(floor), Some(bytes)) = (
        session.budget_floor(),
        session.report()["memory_budget_bytes"].as_u64(),
    ) else {
        return Ok(Err(
            "the server was started without --memory (or with --policy dense): there is no budget to change".into(),
        ));
    };
    let (watch, handle) = BudgetWatch::manual(bytes);
    session.follow_budget(watch)?;
    Ok(Ok(routes::Budget {
        handle,
        floor: floor + reserved,
        reserved,
    }))
}
