//! The generation worker: owns the model and one KV cache, serves queued requests one at a time,
//! and keeps the cache between requests so a request that begins like the previous conversation
//! (the same system prompt, the earlier turns of a chat) computes only the tokens after the
//! common prefix. A stop string or a client gone mid-stream ends the generation at that token.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::error::ApiError;
use super::metrics::ServerMetrics;
use super::queue::{Job, Jobs, Next};
use super::reply::{Reply, Usage};
use super::sse::EventStream;
use super::stop::StopMatcher;
use crate::model::kv_cache::KvCache;
use crate::platform::memory::peak_rss_bytes;
use crate::text::generate::{generate_after, GenerateOptions, StopReason};
use crate::text::session::Session;
use crate::tokenizer::Tokenizer;

/// How often an idle worker looks for a new budget.
const IDLE_POLL: Duration = Duration::from_millis(50);

pub struct Worker {
    session: Session,
    tokenizer: Tokenizer,
    cache: KvCache,
    /// The tokens `cache` holds, in order.
    cached: Vec<u32>,
    model_id: String,
    metrics: Arc<ServerMetrics>,
    served: u64,
}

/// How a request ended, for the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// `stop` or `length`: `finish_reason`.
    Finished(&'static str),
    ClientGone,
}

impl Worker {
    pub fn new(mut session: Session, model_id: String, metrics: Arc<ServerMetrics>) -> Self {
        let ctx = session.ctx;
        let cache = session.model().new_cache(ctx);
        let tokenizer = session.tokenizer.clone();
        let worker = Self {
            session,
            tokenizer,
            cache,
            cached: Vec::new(),
            model_id,
            metrics,
            served: 0,
        };
        worker.refresh_metrics();
        worker
    }

    /// Serves requests until the queue closes; between them, takes a budget `POST /v1/budget`
    /// (or a followed file or cgroup) set, so an idle server gives memory back at once.
    pub fn run(mut self, mut jobs: Jobs) {
        loop {
            match jobs.next_within(IDLE_POLL) {
                Next::Job(job) => self.serve(*job),
                Next::Idle => {
                    if self.session.take_followed_budget() {
                        self.refresh_metrics();
                    }
                }
                Next::Closed => break,
            }
        }
    }

    /// Keeps the longest prefix of `prompt` the cache holds, less one token (the last prompt
    /// token is always computed: its logits give the first reply token); returns its length.
    fn reuse_prefix(&mut self, prompt: &[u32]) -> usize {
        let common = prompt
            .iter()
            .zip(&self.cached)
            .take_while(|(a, b)| a == b)
            .count();
        let reused = common.min(prompt.len() - 1);
        self.cache.truncate(reused);
        self.cached.truncate(reused);
        reused
    }

    fn serve(&mut self, job: Job) {
        let Job { request, work: job } = job;
        self.served += 1;
        let reply = Reply::new(job.endpoint, self.served, &self.model_id);
        let reused = self.reuse_prefix(&job.prompt);
        let opts = GenerateOptions {
            max_tokens: job.max_tokens,
            ctx: self.session.ctx,
            sampler: job.sampler.clone(),
            eos_token_ids: job.eos_token_ids.clone(),
        };
        let (mut stream, request) = if job.stream {
            (Some(EventStream::start(request)), None)
        } else {
            (None, Some(request))
        };
        if let (Some(s), Some(opening)) = (stream.as_mut(), reply.opening()) {
            s.send(&opening);
        }
        let interrupt = AtomicBool::new(false);
        let mut stops = StopMatcher::new(job.stop.clone());
        let mut stopped = false;
        let mut text = String::new();
        let emit = |piece: &str, text: &mut String, stream: &mut Option<EventStream>| {
            text.push_str(piece);
            if let Some(s) = stream.as_mut() {
                if !piece.is_empty() && !s.send(&reply.piece(piece)) {
                    interrupt.store(true, Ordering::Relaxed);
                }
            }
        };
        let generation = generate_after(
            self.session.model(),
            &self.tokenizer,
            &mut self.cache,
            &self.cached,
            &job.prompt[reused..],
            &opts,
            &interrupt,
            |piece| {
                let released = stops.push(piece);
                emit(&released.text, &mut text, &mut stream);
                if released.stopped {
                    stopped = true;
                    interrupt.store(true, Ordering::Relaxed);
                }
            },
        );
        let generation = match generation {
            Ok(g) => g,
            Err(e) => {
                // The cache may hold part of this request: start the next one afresh.
                self.cache.clear();
                self.cached.clear();
                let error = ApiError::new(500, "generation_failed", format!("{e:#}"));
                eprintln!("request {}: error: {e:#}", self.served);
                match (stream, request) {
                    (Some(mut s), _) => {
                        s.send(&error.to_json());
                        s.done();
                    }
                    (None, Some(r)) => {
                        super::routes::respond_json(r, error.status, &error.to_json())
                    }
                    (None, None) => unreachable!("a request is either streamed or whole"),
                }
                return;
            }
        };
        if !stopped {
            emit(&stops.finish(), &mut text, &mut stream);
        }
        let client_gone = stream.as_ref().is_some_and(|s| !s.is_open());
        let ending = match generation.stats.stop_reason {
            _ if client_gone => Ending::ClientGone,
            _ if stopped => Ending::Finished("stop"),
            StopReason::Eos => Ending::Finished("stop"),
            StopReason::MaxTokens | StopReason::ContextFull => Ending::Finished("length"),
            StopReason::Interrupted => {
                unreachable!("only a stop string or a lost client interrupt")
            }
        };
        self.cached.extend_from_slice(&job.prompt[reused..]);
        self.cached.extend_from_slice(&generation.tokens);
        self.cached.truncate(self.cache.len());
        let usage = Usage {
            prompt: job.prompt.len(),
            cached: reused,
            completion: generation.tokens.len(),
        };
        let m = &self.metrics;
        ServerMetrics::add(&m.prompt_tokens, usage.prompt as u64);
        ServerMetrics::add(&m.reused_prompt_tokens, usage.cached as u64);
        ServerMetrics::add(&m.completion_tokens, usage.completion as u64);
        match ending {
            Ending::ClientGone => ServerMetrics::add(&m.client_disconnects, 1),
            Ending::Finished(finish_reason) => match (stream, request) {
                (Some(mut s), _) => {
                    s.send(&reply.closing(finish_reason, usage));
                    s.done();
                }
                (None, Some(r)) => {
                    let body = reply.whole(&text, finish_reason, usage);
                    super::routes::respond_json(r, 200, &body);
                }
                (None, None) => unreachable!("a request is either streamed or whole"),
            },
        }
        self.refresh_metrics();
        eprintln!(
            "request {}: {} prompt tokens ({} reused), {} generated at {:.1} tok/s, {}, {:.0} ms in all",
            self.served,
            usage.prompt,
            usage.cached,
            usage.completion,
            generation.stats.tokens_per_s,
            match ending {
                Ending::Finished(reason) => reason,
                Ending::ClientGone => "client disconnected",
            },
            job.received.elapsed().as_secs_f64() * 1e3
        );
    }

    /// Copies the runtime's figures for `GET /metrics`.
    fn refresh_metrics(&self) {
        let mut report = self.session.report();
        report["peak_rss_bytes"] = peak_rss_bytes().into();
        report["rss_bytes"] = crate::platform::memory::current_rss_bytes().into();
        report["ctx"] = self.session.ctx.into();
        report["kv_cache_tokens"] = self.cache.len().into();
        report["requests_served"] = self.served.into();
        report["budget_changes_total"] = report["budget_changes"]
            .as_array()
            .map_or(0, Vec::len)
            .into();
        *self
            .metrics
            .runtime
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = report;
    }
}
