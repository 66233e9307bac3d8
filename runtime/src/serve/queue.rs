//! The bounded queue between the HTTP thread and the one generation worker: requests are served
//! one at a time in arrival order, and one that finds the queue full is refused (503) at once
//! instead of waiting without bound.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::json_grammar::Grammar;
use super::request::Endpoint;
use crate::text::sampler::SamplerConfig;

/// A request waiting for the model: its connection and what it asks.
pub struct Job {
    pub request: tiny_http::Request,
    pub work: Work,
}

/// A validated request, tokenized.
pub struct Work {
    pub endpoint: Endpoint,
    pub prompt: Vec<u32>,
    pub eos_token_ids: Vec<u32>,
    pub sampler: SamplerConfig,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub stream: bool,
    pub received: Instant,
    /// Choices to generate, one after another (choice `i` samples with seed + `i`).
    pub n: usize,
    /// `Some(k)`: each token's log-probability and the `k` most likely tokens.
    pub logprobs: Option<usize>,
    /// The JSON grammar the reply must follow.
    pub grammar: Option<Arc<Grammar>>,
    /// Tools the reply may call (their names); empty: no tool calls are parsed.
    pub tool_names: Vec<String>,
}

/// The sending side, held by the HTTP thread.
pub struct Queue {
    tx: SyncSender<Job>,
    waiting: Arc<AtomicUsize>,
}

/// The receiving side, held by the worker.
pub struct Jobs {
    rx: Receiver<Job>,
    waiting: Arc<AtomicUsize>,
}

/// A queue holding at most `capacity` requests besides the one being served.
pub fn bounded(capacity: usize) -> (Queue, Jobs) {
    let (tx, rx) = sync_channel(capacity);
    let waiting = Arc::new(AtomicUsize::new(0));
    (
        Queue {
            tx,
            waiting: waiting.clone(),
        },
        Jobs { rx, waiting },
    )
}

impl Queue {
    /// Queues `job`, or gives it back if the queue is full.
    pub fn push(&self, job: Job) -> Result<(), Box<Job>> {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        self.tx.try_send(job).map_err(|e| {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            match e {
                TrySendError::Full(job) | TrySendError::Disconnected(job) => Box::new(job),
            }
        })
    }

    /// Requests waiting (not counting the one being served).
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }
}

/// What waiting for the next request gave.
pub enum Next {
    Job(Box<Job>),
    /// Nothing arrived in the time given.
    Idle,
    /// The HTTP thread is gone.
    Closed,
}

impl Jobs {
    /// The next request in arrival order, waiting at most `wait` for one.
    pub fn next_within(&mut self, wait: Duration) -> Next {
        match self.rx.recv_timeout(wait) {
            Ok(job) => {
                self.waiting.fetch_sub(1, Ordering::SeqCst);
                Next::Job(Box::new(job))
            }
            Err(RecvTimeoutError::Timeout) => Next::Idle,
            Err(RecvTimeoutError::Disconnected) => Next::Closed,
        }
    }
}
