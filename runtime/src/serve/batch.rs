//! Continuous batching: the slots serving requests at once share one model, and each step decodes
//! every waiting slot's next token together ([`LanguageModel::forward_batch`]: attention per
//! sequence, the FFNs as one chunk, so a streaming model reads each layer's clusters once for the
//! union of the slots' needs). A slot joins a step by asking for its next token's logits; the step
//! runs once every slot serving a request has asked (or after a short wait for one that is busy
//! sampling or sending), so slots join and leave between steps. A prompt is computed by its slot
//! alone, one chunk at a time, between steps. Every slot's logits are bitwise those of decoding
//! its tokens alone, so a reply does not depend on what else is being served.
//!
//! [`LanguageModel::forward_batch`]: crate::model::LanguageModel::forward_batch

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};

use super::decode::Forward;
use crate::model::kv_cache::KvCache;
use crate::model::recycle;
use crate::text::session::Session;

/// The longest a step waits for a serving slot that has not asked for its token yet.
const GATHER: Duration = Duration::from_millis(20);

pub struct Batcher {
    session: Mutex<Session>,
    state: Mutex<State>,
    changed: Condvar,
    slots: usize,
    prompt_chunk: usize,
}

/// A slot's token waiting for the next step, with the cache it continues.
struct Step {
    slot: usize,
    token: u32,
    cache: KvCache,
    logits: Vec<f32>,
}

/// A step's answer to one slot.
struct Done {
    cache: KvCache,
    logits: Vec<f32>,
    result: Result<(), String>,
}

#[derive(Default)]
struct State {
    /// Slots serving a request.
    serving: usize,
    /// Slots computing a prompt chunk (they join the step after).
    prompting: usize,
    waiting: Vec<Step>,
    done: Vec<Option<Done>>,
    /// A step is being computed.
    running: bool,
    /// The logits of the step being computed, one row per slot.
    rows: Vec<f32>,
    /// Kept empty between steps, for the next step's list (their allocations reused: a step
    /// allocates nothing).
    spare: Vec<Step>,
    tokens: Vec<u32>,
    caches: Vec<&'static mut KvCache>,
    steps: u64,
    batched_tokens: u64,
}

/// How the batches went, for `GET /metrics`.
pub struct BatchFigures {
    pub steps: u64,
    pub tokens: u64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Batcher {
    pub fn new(mut session: Session, slots: usize) -> Self {
        let prompt_chunk = session.model().prompt_chunk();
        Self {
            session: Mutex::new(session),
            state: Mutex::new(State {
                done: (0..slots).map(|_| None).collect(),
                ..State::default()
            }),
            changed: Condvar::new(),
            slots,
            prompt_chunk,
        }
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    /// The model, between steps.
    pub fn session(&self) -> MutexGuard<'_, Session> {
        lock(&self.session)
    }

    /// A slot starts (`true`) or ends serving a request.
    pub fn serving(&self, starts: bool) {
        let mut st = lock(&self.state);
        if starts {
            st.serving += 1;
        } else {
            st.serving -= 1;
        }
        self.changed.notify_all();
    }

    pub fn figures(&self) -> BatchFigures {
        let st = lock(&self.state);
        BatchFigures {
            steps: st.steps,
            tokens: st.batched_tokens,
        }
    }

    /// The model as slot `slot` sees it: its prompt chunks computed alone, its decoded tokens in
    /// steps with the other slots. `spare` is an empty cache the slot lends while its own is in a
    /// step.
    pub fn model<'a>(&'a self, slot: usize, spare: &'a mut Option<KvCache>) -> SlotModel<'a> {
        SlotModel {
            batcher: self,
            slot,
            spare,
        }
    }

    /// Computes `tokens` after `cache` alone (a prompt chunk).
    fn alone(&self, tokens: &[u32], cache: &mut KvCache, logits: &mut Vec<f32>) -> Result<()> {
        lock(&self.state).prompting += 1;
        let result = self
            .session()
            .model()
            .forward_into(tokens, cache, false, logits);
        lock(&self.state).prompting -= 1;
        self.changed.notify_all();
        result
    }

    /// Slot `slot`'s next token in the next step.
    fn step(
        &self,
        slot: usize,
        token: u32,
        cache: &mut KvCache,
        logits: &mut Vec<f32>,
        spare: &mut Option<KvCache>,
    ) -> Result<()> {
        let lent = spare
            .take()
            .ok_or_else(|| anyhow!("slot {slot} has no spare cache"))?;
        let mut st = lock(&self.state);
        st.waiting.push(Step {
            slot,
            token,
            cache: std::mem::replace(cache, lent),
            logits: std::mem::take(logits),
        });
        self.changed.notify_all();
        let deadline = Instant::now() + GATHER;
        loop {
            if let Some(done) = st.done[slot].take() {
                *spare = Some(std::mem::replace(cache, done.cache));
                *logits = done.logits;
                return done.result.map_err(|e| anyhow!(e));
            }
            let everyone = st.waiting.len() + st.prompting >= st.serving;
            if !st.running && !st.waiting.is_empty() && (everyone || Instant::now() >= deadline) {
                st.running = true;
                let spare = std::mem::take(&mut st.spare);
                let mut batch = std::mem::replace(&mut st.waiting, spare);
                let mut rows = std::mem::take(&mut st.rows);
                let mut tokens = std::mem::take(&mut st.tokens);
                let caches = std::mem::take(&mut st.caches);
                drop(st);
                let (result, caches) = self.run(&mut batch, &mut tokens, caches, &mut rows);
                st = lock(&self.state);
                st.tokens = tokens;
                st.caches = caches;
                st.steps += 1;
                st.batched_tokens += batch.len() as u64;
                let vocab = rows.len() / batch.len().max(1);
                for (i, mut s) in batch.drain(..).enumerate() {
                    if result.is_ok() {
                        s.logits.clear();
                        s.logits
                            .extend_from_slice(&rows[i * vocab..(i + 1) * vocab]);
                    }
                    st.done[s.slot] = Some(Done {
                        cache: s.cache,
                        logits: s.logits,
                        result: result.clone(),
                    });
                }
                st.rows = rows;
                st.spare = batch;
                st.running = false;
                self.changed.notify_all();
                continue;
            }
            let wait = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1));
            st = self
                .changed
                .wait_timeout(st, wait)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// One step: every waiting slot's token through the model together. `tokens` and `caches`
    /// are the kept lists' allocations, the latter handed back empty.
    fn run(
        &self,
        batch: &mut [Step],
        tokens: &mut Vec<u32>,
        caches: Vec<&'static mut KvCache>,
        rows: &mut Vec<f32>,
    ) -> (Result<(), String>, Vec<&'static mut KvCache>) {
        tokens.clear();
        tokens.extend(batch.iter().map(|s| s.token));
        let mut caches: Vec<&mut KvCache> = recycle(caches);
        caches.extend(batch.iter_mut().map(|s| &mut s.cache));
        let result = self
            .session()
            .model()
            .forward_batch(tokens, &mut caches, rows)
            .map_err(|e| format!("{e:#}"));
        (result, recycle(caches))
    }
}

/// One slot's view of the shared model.
pub struct SlotModel<'a> {
    batcher: &'a Batcher,
    slot: usize,
    spare: &'a mut Option<KvCache>,
}

impl Forward for SlotModel<'_> {
    fn prompt_chunk(&self) -> usize {
        self.batcher.prompt_chunk
    }

    fn forward_into(
        &mut self,
        tokens: &[u32],
        cache: &mut KvCache,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        if self.batcher.slots == 1 || tokens.len() != 1 {
            return self.batcher.alone(tokens, cache, logits);
        }
        self.batcher
            .step(self.slot, tokens[0], cache, logits, self.spare)
    }
}
