//! The generation slots: each serves queued requests one at a time with a KV cache of its own
//! while it serves, the model shared with the other slots through the [`Batcher`] (`--parallel`
//! slots decode their tokens together). A cache keeps its tokens between requests, and the slot
//! that takes a request serves it with the idle cache holding the longest prefix of its prompt,
//! so a request that begins like an earlier one (the same system prompt, the earlier turns of a
//! chat) computes only the tokens after the common prefix, whichever slot served that one. A stop
//! string or a client gone mid-stream ends the generation at that token.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use super::batch::Batcher;
use super::decode::{generate, DecodeOptions, Scratch, TokenLogprob};
use super::error::ApiError;
use super::json_grammar::TokenTexts;
use super::metrics::ServerMetrics;
use super::queue::{Job, Jobs, Next, Work};
use super::reply::{Choice, Reply, Usage};
use super::request::Endpoint;
use super::sse::{EventStream, Framing};
use super::stop::StopMatcher;
use super::tools::ToolGate;
use crate::model::kv_cache::KvCache;
use crate::platform::memory::peak_rss_bytes;
use crate::text::generate::StopReason;
use crate::text::sampler::SamplerConfig;
use crate::tokenizer::Tokenizer;

/// How often an idle worker looks for a new budget.
const IDLE_POLL: Duration = Duration::from_millis(50);

/// A shorter common prefix does not count when choosing a cache (every prompt may begin with the
/// same start-of-text token): the cache that loses the fewest tokens is taken instead.
const MIN_PREFIX: usize = 4;

/// A KV cache not serving a request, and the tokens it holds.
struct IdleCache {
    cache: KvCache,
    tokens: Vec<u32>,
}

/// What every slot shares.
pub struct Shared {
    pub batcher: Batcher,
    pub tokenizer: Tokenizer,
    pub model_id: String,
    pub metrics: Arc<ServerMetrics>,
    pub ctx: usize,
    pub vocab: usize,
    /// Requests taken so far (each one's number in the log).
    served: AtomicU64,
    /// The tokens each slot's cache holds.
    cached_tokens: Vec<AtomicUsize>,
    /// Every token's text, made on the first request that needs it (a grammar or logprobs).
    token_texts: OnceLock<TokenTexts>,
    /// Bytes of the budget set aside for the slots' KV caches beyond the first.
    pub reserved_kv_bytes: u64,
    /// The caches of the slots not serving a request, the longest idle first.
    idle: Mutex<Vec<IdleCache>>,
}

impl Shared {
    pub fn new(
        batcher: Batcher,
        tokenizer: Tokenizer,
        model_id: String,
        metrics: Arc<ServerMetrics>,
        reserved_kv_bytes: u64,
    ) -> Self {
        let (ctx, vocab) = {
            let mut s = batcher.session();
            (s.ctx, s.model().config().vocab_size)
        };
        let slots = batcher.slots();
        Self {
            batcher,
            tokenizer,
            model_id,
            metrics,
            ctx,
            vocab,
            served: AtomicU64::new(0),
            cached_tokens: (0..slots).map(|_| AtomicUsize::new(0)).collect(),
            token_texts: OnceLock::new(),
            reserved_kv_bytes,
            idle: Mutex::new(Vec::with_capacity(slots)),
        }
    }
}

/// Runs `slots` slots on their own threads (the first on this one) until the queue closes.
pub fn run(shared: Arc<Shared>, jobs: Jobs) {
    let jobs = Arc::new(Mutex::new(jobs));
    let slots = shared.batcher.slots();
    let others: Vec<_> = (1..slots)
        .map(|i| {
            let (shared, jobs) = (shared.clone(), jobs.clone());
            std::thread::Builder::new()
                .name(format!("slot-{i}"))
                .spawn(move || Slot::new(shared, i).run(&jobs))
                .expect("a slot thread starts")
        })
        .collect();
    Slot::new(shared, 0).run(&jobs);
    for t in others {
        let _ = t.join();
    }
}

/// One slot: a KV cache and the requests it serves.
pub struct Slot {
    shared: Arc<Shared>,
    index: usize,
    cache: KvCache,
    /// An empty cache lent to the batcher while `cache` is in a step.
    spare: Option<KvCache>,
    /// An empty cache held while `cache` waits idle in [`Shared::idle`].
    parked: Option<KvCache>,
    /// The tokens `cache` holds, in order.
    cached: Vec<u32>,
    /// The number of the request being served.
    served: u64,
    scratch: Scratch,
}

/// Where a reply goes: a stream, or one body at the end.
enum Out {
    Stream(EventStream),
    Whole(Option<tiny_http::Request>),
}

/// A generated choice, and how its generation went.
struct ChoiceOutcome {
    choice: Choice,
    tokens: usize,
    tokens_per_s: f64,
    prompt_ns: u64,
    decode_ns: u64,
    ending: Ending,
}

/// How a request ended, for the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// `stop` or `length`: `finish_reason`.
    Finished(&'static str),
    ClientGone,
}

impl Slot {
    fn new(shared: Arc<Shared>, index: usize) -> Self {
        let (cache, spare, empty) = {
            let mut session = shared.batcher.session();
            let model = session.model();
            (
                model.new_cache(shared.ctx),
                model.new_cache(0),
                model.new_cache(0),
            )
        };
        let mut slot = Self {
            shared,
            index,
            cache,
            spare: Some(spare),
            parked: None,
            cached: Vec::new(),
            served: 0,
            scratch: Scratch::default(),
        };
        slot.park(empty);
        slot
    }

    /// Leaves this slot's cache with the idle ones, holding `empty` instead.
    fn park(&mut self, empty: KvCache) {
        let cache = std::mem::replace(&mut self.cache, empty);
        let tokens = std::mem::take(&mut self.cached);
        let mut idle = self.shared.idle.lock().unwrap_or_else(|e| e.into_inner());
        idle.push(IdleCache { cache, tokens });
    }

    /// Takes the idle cache that holds the longest prefix of `prompt` (of at least
    /// [`MIN_PREFIX`] tokens); without one, the cache that holds the fewest tokens, the longest
    /// idle among equals.
    fn take_cache(&mut self, prompt: &[u32]) {
        let mut idle = self.shared.idle.lock().unwrap_or_else(|e| e.into_inner());
        let best = (0..idle.len()).min_by_key(|&i| {
            let c = &idle[i];
            let common = prompt
                .iter()
                .zip(&c.tokens)
                .take_while(|(a, b)| a == b)
                .count();
            let common = if common < MIN_PREFIX { 0 } else { common };
            (std::cmp::Reverse(common), c.tokens.len() - common, i)
        });
        let Some(best) = best else {
            // Never: as many caches as slots, and this slot's is idle.
            return;
        };
        let IdleCache { cache, tokens } = idle.remove(best);
        drop(idle);
        self.parked = Some(std::mem::replace(&mut self.cache, cache));
        self.cached = tokens;
    }

    /// Serves requests until the queue closes; between them, takes a budget `POST /v1/budget`
    /// (or a followed file or cgroup) set, so an idle server gives memory back at once.
    fn run(mut self, jobs: &Mutex<Jobs>) {
        loop {
            let next = jobs
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .next_within(IDLE_POLL);
            match next {
                Next::Job(job) => {
                    self.take_cache(&job.work.prompt);
                    self.shared.batcher.serving(true);
                    self.serve(*job);
                    self.shared.batcher.serving(false);
                    self.shared.cached_tokens[self.index]
                        .store(self.cache.len(), Ordering::Relaxed);
                    if let Some(empty) = self.parked.take() {
                        self.park(empty);
                    }
                    self.refresh_metrics();
                }
                Next::Idle => {
                    if self.shared.batcher.session().take_followed_budget() {
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
        self.served = self.shared.served.fetch_add(1, Ordering::Relaxed) + 1;
        let reply = Reply::new(job.endpoint, self.served, &self.shared.model_id);
        let mut out = if job.stream {
            let framing = match job.endpoint {
                Endpoint::OllamaGenerate | Endpoint::OllamaChat => Framing::Ndjson,
                Endpoint::Llama => Framing::SseWithoutDone,
                Endpoint::Chat | Endpoint::Completions => Framing::Sse,
            };
            Out::Stream(EventStream::start(request, framing))
        } else {
            Out::Whole(Some(request))
        };
        if (job.grammar.is_some() || job.logprobs.is_some())
            && self.shared.token_texts.get().is_none()
        {
            match TokenTexts::new(&self.shared.tokenizer, self.shared.vocab) {
                Ok(t) => {
                    let _ = self.shared.token_texts.set(t);
                }
                Err(e) => return self.fail(out, &e),
            }
        }
        let mut usage = Usage {
            prompt: job.prompt.len(),
            cached: 0,
            completion: 0,
            prompt_ns: 0,
            eval_ns: 0,
            total_ns: 0,
        };
        let mut choices = Vec::with_capacity(job.n);
        let mut ending = Ending::Finished("stop");
        let mut rate = 0.0;
        for index in 0..job.n {
            let reused = self.reuse_prefix(&job.prompt);
            if index == 0 {
                usage.cached = reused;
            }
            let mut sampler = job.sampler.clone();
            sampler.seed = sampler.seed.wrapping_add(index as u64);
            let choice = match self.choice(&job, &reply, index, reused, sampler, &mut out) {
                Ok(c) => c,
                Err(e) => return self.fail(out, &e),
            };
            usage.completion += choice.tokens;
            usage.prompt_ns += choice.prompt_ns;
            usage.eval_ns += choice.decode_ns;
            usage.total_ns = job.received.elapsed().as_nanos() as u64;
            rate = choice.tokens_per_s;
            ending = choice.ending;
            if let Out::Stream(s) = &mut out {
                if ending != Ending::ClientGone {
                    let last = (index + 1 == job.n).then_some(usage);
                    let reason = choice.choice.finish_reason;
                    s.send(&reply.closing(index, reason, last));
                }
            }
            choices.push(choice.choice);
            if ending == Ending::ClientGone {
                break;
            }
        }
        let m = &self.shared.metrics;
        ServerMetrics::add(&m.prompt_tokens, usage.prompt as u64);
        ServerMetrics::add(&m.reused_prompt_tokens, usage.cached as u64);
        ServerMetrics::add(&m.completion_tokens, usage.completion as u64);
        match (ending, out) {
            (Ending::ClientGone, _) => ServerMetrics::add(&m.client_disconnects, 1),
            (_, Out::Stream(s)) => s.done(),
            (_, Out::Whole(r)) => {
                let body = reply.whole(&choices, usage);
                super::routes::respond_json(r.expect("answered once"), 200, &body);
            }
        }
        eprintln!(
            "request {}: {} prompt tokens ({} reused), {} generated{} at {:.1} tok/s, {}, {:.0} ms in all",
            self.served,
            usage.prompt,
            usage.cached,
            usage.completion,
            if job.n > 1 {
                format!(" in {} choices", choices.len())
            } else {
                String::new()
            },
            rate,
            match ending {
                Ending::Finished(reason) => reason,
                Ending::ClientGone => "client disconnected",
            },
            job.received.elapsed().as_secs_f64() * 1e3
        );
    }

    /// Answers a request whose generation failed with a 500; the cache may hold part of it, so
    /// the next request starts afresh.
    fn fail(&mut self, out: Out, e: &anyhow::Error) {
        self.cache.clear();
        self.cached.clear();
        let error = ApiError::new(500, "generation_failed", format!("{e:#}"));
        eprintln!("request {}: error: {e:#}", self.served);
        match out {
            Out::Stream(mut s) => {
                s.send(&error.to_json());
                s.done();
            }
            Out::Whole(r) => super::routes::respond_json(
                r.expect("answered once"),
                error.status,
                &error.to_json(),
            ),
        }
    }

    /// Generates choice `index` after the `reused` prompt tokens the cache holds, streaming it
    /// to `out` if that is a stream.
    fn choice(
        &mut self,
        job: &Work,
        reply: &Reply,
        index: usize,
        reused: usize,
        sampler: SamplerConfig,
        out: &mut Out,
    ) -> anyhow::Result<ChoiceOutcome> {
        let shared = self.shared.clone();
        let texts = shared.token_texts.get();
        let opts = DecodeOptions {
            max_tokens: job.max_tokens,
            ctx: shared.ctx,
            sampler,
            eos: &job.eos_token_ids,
            top_logprobs: job.logprobs,
            grammar: job.grammar.as_deref().zip(texts),
        };
        if let (Out::Stream(s), Some(opening)) = (&mut *out, reply.opening(index)) {
            s.send(&opening);
        }
        let interrupt = AtomicBool::new(false);
        let mut stops = StopMatcher::new(job.stop.clone());
        let mut gate = (!job.tool_names.is_empty()).then(ToolGate::default);
        let mut stopped = false;
        let mut text = String::new();
        let mut all_logprobs: Vec<TokenLogprob> = Vec::new();
        // Tokens whose log-probabilities the stream has not sent yet.
        let mut unsent = 0;
        let mut send =
            |piece: &str, text: &mut String, all: &[TokenLogprob], unsent: &mut usize| {
                let piece = match gate.as_mut() {
                    Some(g) => g.push(piece),
                    None => piece.to_string(),
                };
                let offset = text.len();
                text.push_str(&piece);
                if let Out::Stream(s) = out {
                    let fresh = &all[all.len() - *unsent..];
                    if piece.is_empty() && fresh.is_empty() {
                        return;
                    }
                    let logprobs = texts
                        .filter(|_| job.logprobs.is_some())
                        .map(|t| reply.logprobs(fresh, t, offset));
                    *unsent = 0;
                    if !s.send(&reply.piece(index, &piece, logprobs)) {
                        interrupt.store(true, Ordering::Relaxed);
                    }
                }
            };
        let outcome = generate(
            &mut shared.batcher.model(self.index, &mut self.spare),
            &shared.tokenizer,
            &mut self.cache,
            &self.cached,
            &job.prompt[reused..],
            &opts,
            &interrupt,
            &mut self.scratch,
            |logprob, piece| {
                if stopped {
                    return;
                }
                if let Some(lp) = logprob {
                    all_logprobs.push(lp);
                    unsent += 1;
                }
                let Some(piece) = piece else { return };
                let released = stops.push(piece);
                if released.stopped {
                    stopped = true;
                    interrupt.store(true, Ordering::Relaxed);
                }
                if !released.text.is_empty() || (released.stopped && unsent > 0) {
                    send(&released.text, &mut text, &all_logprobs, &mut unsent);
                }
            },
        )?;
        if !stopped {
            let rest = stops.finish();
            if !rest.is_empty() || unsent > 0 {
                send(&rest, &mut text, &all_logprobs, &mut unsent);
            }
        }
        let client_gone = matches!(out, Out::Stream(s) if !s.is_open());
        let mut finish_reason = match outcome.stop_reason {
            _ if stopped => "stop",
            StopReason::Eos => "stop",
            StopReason::MaxTokens | StopReason::ContextFull => "length",
            StopReason::Interrupted => "stop",
        };
        let mut tool_calls = None;
        if let Some(g) = gate {
            let held = g.finish();
            let whole = format!("{text}{held}");
            let serial = format!("{:x}{index}", self.served);
            match super::tools::parse(&whole, &job.tool_names) {
                Some((content, calls)) => {
                    if let Out::Stream(s) = out {
                        s.send(
                            &reply.tool_calls(index, super::tools::to_json(&calls, &serial, true)),
                        );
                    }
                    tool_calls = Some(super::tools::to_json(&calls, &serial, false));
                    finish_reason = "tool_calls";
                    text = content;
                }
                None => {
                    if let Out::Stream(s) = out {
                        if !held.is_empty() {
                            s.send(&reply.piece(index, &held, None));
                        }
                    }
                    text = whole;
                }
            }
        }
        self.cached.extend_from_slice(&job.prompt[reused..]);
        self.cached.extend_from_slice(&outcome.tokens);
        self.cached.truncate(self.cache.len());
        let logprobs = texts
            .filter(|_| job.logprobs.is_some() && matches!(out, Out::Whole(_)))
            .map(|t| reply.logprobs(&all_logprobs, t, 0));
        Ok(ChoiceOutcome {
            choice: Choice {
                text,
                finish_reason,
                logprobs,
                tool_calls,
            },
            tokens: outcome.tokens.len(),
            tokens_per_s: outcome.tokens_per_s,
            prompt_ns: outcome.prompt_ns,
            decode_ns: outcome.decode_ns,
            ending: if client_gone {
                Ending::ClientGone
            } else {
                Ending::Finished(finish_reason)
            },
        })
    }

    /// Copies the runtime's figures for `GET /metrics`.
    fn refresh_metrics(&self) {
        publish_metrics(&self.shared);
    }
}

/// Copies the runtime's figures for `GET /metrics`.
pub fn publish_metrics(shared: &Shared) {
    let mut report = shared.batcher.session().report();
    report["peak_rss_bytes"] = peak_rss_bytes().into();
    report["rss_bytes"] = crate::platform::memory::current_rss_bytes().into();
    report["ctx"] = shared.ctx.into();
    report["kv_cache_tokens"] = shared
        .cached_tokens
        .iter()
        .map(|t| t.load(Ordering::Relaxed))
        .sum::<usize>()
        .into();
    report["requests_served"] = shared.served.load(Ordering::Relaxed).into();
    report["parallel_slots"] = shared.batcher.slots().into();
    report["kv_slots_reserved_bytes"] = shared.reserved_kv_bytes.into();
    let figures = shared.batcher.figures();
    report["batch_steps"] = figures.steps.into();
    report["batched_tokens"] = figures.tokens.into();
    report["budget_changes_total"] = report["budget_changes"]
        .as_array()
        .map_or(0, Vec::len)
        .into();
    *shared
        .metrics
        .runtime
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = report;
}
