//! The memory planner: splits one `--memory` budget (a cap on the process's peak RSS) into the
//! runtime's fixed needs — process overhead, dense weights, KV cache, the resident per-layer state
//! (sketch, predictors, statistics), I/O buffers, scratch — and the neuron cache, which gets the
//! rest. When the fixed needs with every dense weight resident exceed the budget, dense weights
//! stream too: the attention projections first (the least used per byte: each is read once per
//! token, as the output head is, but the head is computed as it lands), then an untied embedding
//! (one row per token), then the output head; norms always stay. An untied embedding also streams
//! wherever the neuron cache cannot hold the whole FFN: a row a token costs less than the reads its
//! bytes save as cache. Two floors follow, named as `inspect
//! --json` names them: the *minimum* (`min_memory_bytes`), the fixed needs with every dense weight
//! the planner may stream streaming — the least budget a run accepts; a budget below it is refused,
//! stating it — and the *dense-resident minimum* (`min_memory_dense_resident_bytes`), the fixed
//! needs with every dense weight resident, below which dense weights start to stream (an untied
//! embedding from the budget that holds every cluster down).

use anyhow::{bail, Result};
use serde::Serialize;

use crate::model::kv_cache::KvType;
use crate::platform::memory_size::format_size;
use crate::source::config::ModelConfig;

#[derive(Clone)]
pub struct PlanInput {
    pub budget: Option<u64>,
    pub overhead: u64,
    pub dense: DenseSizes,
    pub kv_cache: u64,
    pub resident_state: u64,
    pub io_buffers: u64,
    pub scratch: u64,
    /// Bytes of every FFN cluster extent.
    pub ffn: u64,
    /// The policy keeps every cluster resident.
    pub needs_all_ffn: bool,
    pub ctx: usize,
    /// The prompt tokens `scratch` holds activations for.
    pub prompt_chunk: usize,
}

/// The dense weights' bytes by what may stream, and the buffers each needs while streaming (read
/// buffers and the page hashes partial reads are checked with).
#[derive(Debug, Clone, Default)]
pub struct DenseSizes {
    /// Every dense tensor's encoded bytes.
    pub total: u64,
    /// Every block's attention projections (q, k, v, o).
    pub attention: u64,
    pub attention_buffers: u64,
    /// The untied output head (0 when tied to the embedding).
    pub head: u64,
    /// Its row blocks in flight; for a tied head, the embedding's blocks.
    pub head_buffers: u64,
    pub embedding: u64,
    pub embedding_buffers: u64,
    /// The head is the embedding: they stream together.
    pub tied: bool,
}

impl DenseSizes {
    /// The same weights without the attention projections (held elsewhere: on the GPU).
    pub fn without_attention(&self) -> Self {
        Self {
            total: self.total - self.attention,
            attention: 0,
            attention_buffers: 0,
            ..self.clone()
        }
    }
}

/// Which dense weights stream from flash instead of staying resident.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct DenseStreamed {
    /// Layer `l + 1`'s projections are read while layer `l` computes.
    pub attention: bool,
    /// The output head is read in row blocks every token, each computed as it lands.
    pub head: bool,
    /// Each token's embedding row is read when the token is known.
    pub embedding: bool,
}

impl DenseStreamed {
    /// The choices in the order the planner tries them: the first that fits the budget wins.
    fn choices(tied: bool) -> Vec<Self> {
        let attention = Self {
            attention: true,
            ..Self::default()
        };
        let all = Self {
            attention: true,
            head: true,
            embedding: true,
        };
        if tied {
            vec![Self::default(), attention, all]
        } else {
            let embedding = Self {
                embedding: true,
                ..attention
            };
            vec![Self::default(), attention, embedding, all]
        }
    }

    fn any(&self) -> bool {
        self.attention || self.head || self.embedding
    }

    /// What streams, for people.
    pub(crate) fn describe(&self) -> String {
        [
            (self.attention, "attention"),
            (self.head, "output head"),
            (self.embedding, "embedding"),
        ]
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, name)| *name)
        .collect::<Vec<_>>()
        .join(", ")
    }
}

impl DenseSizes {
    /// Bytes of dense weights resident, and of the buffers streaming needs, under `s`.
    fn cost(&self, s: DenseStreamed) -> (u64, u64) {
        let mut resident = self.total;
        let mut buffers = 0;
        let parts = [
            (s.attention, self.attention, self.attention_buffers),
            (s.head, self.head, self.head_buffers),
            (s.embedding, self.embedding, self.embedding_buffers),
        ];
        for (on, bytes, bufs) in parts {
            if on {
                resident -= bytes;
                buffers += bufs;
            }
        }
        (resident, buffers)
    }
}

/// Where the budget goes, in bytes.
#[derive(Debug, Clone, Serialize)]
pub struct MemorySplit {
    pub overhead: u64,
    /// Dense weights resident.
    pub dense: u64,
    /// Dense weights read from flash as they are used.
    pub dense_streamed: DenseStreamed,
    /// Read buffers and page hashes of the streamed dense weights.
    pub dense_buffers: u64,
    pub kv_cache: u64,
    pub resident_state: u64,
    pub io_buffers: u64,
    pub scratch: u64,
    /// The prompt tokens a forward call takes at most (what `scratch` is sized for).
    pub prompt_chunk: usize,
    pub neuron_cache: u64,
    /// Bytes of all FFN bundles (for "how much of the FFN fits").
    pub ffn_total: u64,
    /// Layers whose certificate stays resident ([`keep_certificates`]); the others treat every
    /// uncached cluster as a candidate.
    pub certified_layers: Vec<usize>,
}

impl MemorySplit {
    /// The budget that leaves `share` (0–1) of the FFN bundles to the neuron cache.
    pub fn budget_for_ffn_share(&self, share: f64) -> u64 {
        self.fixed() + (self.ffn_total as f64 * share) as u64
    }

    pub fn fixed(&self) -> u64 {
        self.overhead
            + self.dense
            + self.dense_buffers
            + self.kv_cache
            + self.resident_state
            + self.io_buffers
            + self.scratch
    }

    /// One line for people.
    pub fn describe(&self) -> String {
        format!(
            "memory: {}, neuron cache {} ({:.0} % of the FFN)",
            self.describe_fixed(),
            format_size(self.neuron_cache),
            100.0 * self.neuron_cache as f64 / self.ffn_total.max(1) as f64
        )
    }

    fn describe_fixed(&self) -> String {
        let streamed = if self.dense_streamed.any() {
            format!(
                " (streaming {} through {} of buffers)",
                self.dense_streamed.describe(),
                format_size(self.dense_buffers)
            )
        } else {
            String::new()
        };
        format!(
            "overhead {}, dense {}{streamed}, KV cache {}, sketch+predictors {}, I/O buffers {}, scratch {} ({}-token prompt chunks)",
            format_size(self.overhead),
            format_size(self.dense),
            format_size(self.kv_cache),
            format_size(self.resident_state),
            format_size(self.io_buffers),
            format_size(self.scratch),
            self.prompt_chunk
        )
    }
}

/// The split when `streamed` dense weights stream and the neuron cache is empty.
fn fixed_split(p: &PlanInput, streamed: DenseStreamed) -> MemorySplit {
    let (dense, dense_buffers) = p.dense.cost(streamed);
    MemorySplit {
        overhead: p.overhead,
        dense,
        dense_streamed: streamed,
        dense_buffers,
        kv_cache: p.kv_cache,
        resident_state: p.resident_state,
        io_buffers: p.io_buffers,
        scratch: p.scratch,
        prompt_chunk: p.prompt_chunk,
        neuron_cache: 0,
        ffn_total: p.ffn,
        certified_layers: Vec::new(),
    }
}

/// The candidate splits (neuron cache empty), fewest dense weights streaming first. A policy that
/// keeps every cluster resident keeps the dense weights resident too: it does no I/O at all.
fn candidates(p: &PlanInput) -> Vec<MemorySplit> {
    let choices = if p.needs_all_ffn {
        vec![DenseStreamed::default()]
    } else {
        DenseStreamed::choices(p.dense.tied)
    };
    choices.into_iter().map(|s| fixed_split(p, s)).collect()
}

/// The minimum (`min_memory_bytes`): the smallest budget `p` runs in, with every dense weight the
/// planner may stream streaming.
pub fn minimum(p: &PlanInput) -> u64 {
    let ffn = if p.needs_all_ffn { p.ffn } else { 0 };
    candidates(p)
        .iter()
        .map(|s| s.fixed() + ffn)
        .min()
        .expect("there is always a candidate")
}

/// Splits the budget: the fewest dense weights streaming that fit, the rest to the neuron cache.
/// Without a budget, everything is resident.
pub fn plan(p: PlanInput) -> Result<MemorySplit> {
    let ffn = if p.needs_all_ffn { p.ffn } else { 0 };
    let all = candidates(&p);
    let budget = p.budget.unwrap_or(all[0].fixed() + p.ffn);
    let Some(mut split) = all.iter().find(|s| s.fixed() + ffn <= budget).cloned() else {
        let least = all
            .iter()
            .min_by_key(|s| s.fixed())
            .expect("there is always a candidate");
        bail!(
            "--memory {} is below the minimum of {} for this model at ctx {} ({}); raise --memory",
            format_size(budget),
            format_size(least.fixed() + ffn),
            p.ctx,
            least.describe_fixed(),
        );
    };
    split.neuron_cache = (budget - split.fixed()).min(p.ffn);
    // Streamed, an untied embedding costs one row a token; its bytes in the cache save as many
    // bytes of reads a token as the cache lacks of the FFN. So where the cache cannot hold the
    // FFN, the embedding streams (with its few rows of buffers).
    if !p.dense.tied && !split.dense_streamed.embedding && split.neuron_cache < p.ffn {
        let mut leaner = fixed_split(
            &p,
            DenseStreamed {
                embedding: true,
                ..split.dense_streamed
            },
        );
        if leaner.fixed() < split.fixed() {
            leaner.neuron_cache = (budget - leaner.fixed()).min(p.ffn);
            split = leaner;
        }
    }
    Ok(split)
}

/// A new budget for a running model, planned as at start-up for the run's context and prompt
/// chunk: the fewest dense weights streaming that fit, the rest to the neuron cache. So a budget
/// that shrinks empties the cache first and then streams dense weights in the usual order, and one
/// that grows makes them resident again before the cache grows. The certificates stay as opened
/// (their bytes are in the fixed part). Refused below [`minimum`], which the error states.
pub fn replan(p: PlanInput, current: &MemorySplit) -> Result<MemorySplit> {
    let mut split = plan(p)?;
    split.certified_layers = current.certified_layers.clone();
    Ok(split)
}

/// Prompt chunk lengths a plan may use, longest first. A shorter chunk needs less scratch (the
/// activations and attention scores of each of its tokens) and costs only prefill speed: each
/// cluster a chunk needs is read and its weights decoded once per chunk.
pub const PROMPT_CHUNKS: [usize; 5] = [crate::text::generate::PROMPT_CHUNK, 128, 64, 32, 16];
/// The shortest prompt chunk a plan uses.
pub const MIN_PROMPT_CHUNK: usize = PROMPT_CHUNKS[PROMPT_CHUNKS.len() - 1];

/// The longest prompt chunk whose plan fits the budget, and that plan; refused with the
/// shortest chunk's minimum. `input(chunk)` is the plan input with scratch for `chunk` tokens.
pub fn fit_chunk(input: impl Fn(usize) -> PlanInput) -> Result<(usize, MemorySplit)> {
    let mut refused = None;
    for chunk in PROMPT_CHUNKS {
        match plan(input(chunk)) {
            Ok(split) => return Ok((chunk, split)),
            Err(e) => refused = Some(e),
        }
    }
    Err(refused.expect("at least one chunk length"))
}

/// A shrunk context is a multiple of this many tokens (or the floor itself).
const CONTEXT_STEP: usize = 64;

/// The longest context in `floor..=ctx` whose plan fits the budget, and that plan: `ctx` itself
/// when it fits, else the longest multiple of [`CONTEXT_STEP`] that does (the plan's fixed needs
/// grow with the context, so the answer is found by bisection). Below the floor, the error states
/// the floor's minimum.
pub fn fit_context(
    ctx: usize,
    floor: usize,
    input: impl Fn(usize) -> PlanInput,
) -> Result<(usize, MemorySplit)> {
    if let Ok(split) = plan(input(ctx)) {
        return Ok((ctx, split));
    }
    let floor = floor.min(ctx);
    let mut fits = (floor, plan(input(floor))?);
    // Candidates floor < c < ctx, multiples of the step: bisect on the step count.
    let (mut lo, mut hi) = (floor / CONTEXT_STEP + 1, ctx.div_ceil(CONTEXT_STEP));
    while lo < hi {
        let mid = (lo + hi) / 2;
        match plan(input(mid * CONTEXT_STEP)) {
            Ok(split) => {
                fits = (mid * CONTEXT_STEP, split);
                lo = mid + 1;
            }
            Err(_) => hi = mid,
        }
    }
    Ok(fits)
}

/// The flags that make a refused budget fit, for the refusal to name: a leaner KV cache at the
/// same context (`--kv q8_0`), else the longest shorter context — a multiple of
/// [`CONTEXT_STEP`] — with whichever KV storage gives the longest (`--ctx 320`,
/// `--ctx 192 --kv q8_0`). `None` when not even [`CONTEXT_STEP`] tokens fit with the leanest.
/// `input(ctx, kv)` is the plan input for the budget that was refused.
pub fn what_fits(
    ctx: usize,
    kv: KvType,
    input: impl Fn(usize, KvType) -> PlanInput,
) -> Option<String> {
    let leaner = KvType::ALL.into_iter().skip_while(|&t| t != kv).skip(1);
    if let Some(t) = leaner.clone().find(|&t| plan(input(ctx, t)).is_ok()) {
        return Some(format!("--kv {}", t.name()));
    }
    let shorter = ctx.saturating_sub(1) / CONTEXT_STEP * CONTEXT_STEP;
    if shorter < CONTEXT_STEP {
        return None;
    }
    let longest = std::iter::once(kv)
        .chain(leaner)
        .filter_map(|t| {
            let (c, _) = fit_context(shorter, CONTEXT_STEP, |c| input(c, t)).ok()?;
            Some((c, t))
        })
        .max_by_key(|&(c, t)| (c, t == kv))?;
    Some(match longest {
        (c, t) if t == kv => format!("--ctx {c}"),
        (c, t) => format!("--ctx {c} --kv {}", t.name()),
    })
}

/// The process before any model is loaded (code, libraries, allocator, thread stacks: measured at
/// start-up), plus the tokenizer as it sits in memory (`tokenizer::resident_bytes`: the compact
/// tokenizer's tables, or about 11 times the JSON for a parsed Hugging Face tokenizer), plus slack
/// for the allocator and the file's indexes while they are decoded. A parsed tokenizer's parse
/// peaks at up to 26 times the JSON, but the runtime parses it first and returns the garbage before
/// anything else is loaded, so that peak stays below the rest. Each compute thread beyond the
/// first that the machine runs by default (one per core: a rayon worker and a parked FFN helper,
/// started after that measure) adds [`THREAD_BYTES`]. The machine's core count, not this
/// process's `--threads`, so that every process on a machine states the same minimum (`bench`
/// and tests plan budgets for runs with other thread counts); a lower `--threads` leaves the
/// difference as slack.
pub fn baseline_overhead(tokenizer_bytes: u64) -> u64 {
    // The measured start-up RSS (about 5 MiB on x86-64 Linux) varies by ~100 KiB from run to run;
    // a floor above it, and rounding up to whole MiB, keep the stated minimum — and so the cache
    // two policies get from one budget — from moving with that noise.
    const MIB: u64 = 1 << 20;
    const STARTUP_FLOOR: u64 = 6 * MIB;
    // The allocator, the indexes while they are decoded, and code first run after start-up (the
    // kernels, the engine): SmolLM2 q8 at its floor peaked up to 0.22 MB over a 4 MiB slack once
    // the runtime carried the server's and the new encodings' code as well.
    const SLACK: u64 = 5 * MIB;
    let startup = crate::platform::memory::startup_rss_bytes().max(STARTUP_FLOOR);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = THREAD_BYTES * (cores as u64).saturating_sub(1);
    (startup + tokenizer_bytes + threads + SLACK).div_ceil(MIB) * MIB
}

/// Resident bytes of one more compute thread: its stack as the kernels touch it and its
/// allocator arena. Measured: SmolLM2 q8 at its floor peaked 0.52 MB higher with `--threads 2`
/// than with 1 (one parked FFN helper more), which the floor's rounding slack no longer hid.
pub const THREAD_BYTES: u64 = 1 << 20;

/// Activations of a prompt chunk of `chunk` tokens, their attention scores, and the logits.
pub fn scratch_bytes(c: &ModelConfig, chunk: usize) -> u64 {
    let t = chunk as u64;
    let per_token = (c.hidden_size * 4
        + c.num_heads * c.head_dim * 2
        + c.num_kv_heads * c.head_dim * 2
        + c.intermediate_size * 2) as u64;
    4 * (t * per_token + 2 * c.vocab_size as u64)
        + 4 * t * c.max_position_embeddings.min(2048) as u64
}

/// One layer's certificate (\[K\]): its resident bytes, the layer's FFN bytes, and the fraction of
/// the layer's cluster reads it saves with nothing cached (META `certificate_saves`; unknown in
/// files before 1.3).
pub struct CertificateTerm {
    pub bytes: u64,
    pub ffn: u64,
    pub saves: Option<f64>,
}

/// Which certificates earn their bytes with a neuron cache holding `cache_share` of the FFN.
/// Without one, exact mode reads every uncached cluster of the layer, so its bytes given to the
/// cache save as many bytes of reads per token; with it, the layer reads `saves` less of its
/// uncached part, about `saves · ffn · (1 − cache_share)`. Kept where that is more; a file that
/// does not say what its certificate saves keeps it.
pub fn keep_certificates(terms: &[CertificateTerm], cache_share: f64) -> Vec<bool> {
    let uncached = (1.0 - cache_share).max(0.0);
    terms
        .iter()
        .map(|t| {
            t.saves
                .is_none_or(|s| s * t.ffn as f64 * uncached > t.bytes as f64)
        })
        .collect()
}

/// Bytes a token reads from flash, estimated: the dense weights that stream, and each layer's
/// uncached part of the FFN, less what its certificate saves where `certified[l]` (a file that does
/// not say what a certificate saves counts it as saving nothing).
pub fn reads_per_token(
    dense_streamed: u64,
    cache_share: f64,
    terms: &[CertificateTerm],
    certified: &[bool],
) -> f64 {
    let uncached = (1.0 - cache_share).clamp(0.0, 1.0);
    dense_streamed as f64
        + terms
            .iter()
            .zip(certified)
            .map(|(t, &c)| {
                let saves = if c { t.saves.unwrap_or(0.0) } else { 0.0 };
                t.ffn as f64 * uncached * (1.0 - saves)
            })
            .sum::<f64>()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn input(budget: Option<u64>, tied: bool) -> PlanInput {
        PlanInput {
            budget,
            overhead: 10 * MIB,
            dense: DenseSizes {
                total: 100 * MIB,
                attention: 40 * MIB,
                attention_buffers: 4 * MIB,
                head: if tied { 0 } else { 30 * MIB },
                head_buffers: 4 * MIB,
                embedding: if tied { 60 * MIB } else { 30 * MIB },
                embedding_buffers: MIB,
                tied,
            },
            kv_cache: 2 * MIB,
            resident_state: 3 * MIB,
            io_buffers: 4 * MIB,
            scratch: MIB,
            ffn: 200 * MIB,
            needs_all_ffn: false,
            ctx: 256,
            prompt_chunk: 256,
        }
    }

    /// Everything but the dense weights and the cache: 20 MiB.
    const OTHERS: u64 = 20 * MIB;

    fn streamed(attention: bool, head: bool, embedding: bool) -> DenseStreamed {
        DenseStreamed {
            attention,
            head,
            embedding,
        }
    }

    #[test]
    fn dense_weights_stream_only_below_them_attention_first() {
        // Tied (head and embedding one table).
        let choose = |budget: u64| plan(input(Some(budget), true)).unwrap();
        // Everything resident fits: nothing streams, the rest is cache.
        let s = choose(OTHERS + 100 * MIB + 5 * MIB);
        assert_eq!(s.dense_streamed, DenseStreamed::default());
        assert_eq!(
            (s.dense, s.dense_buffers, s.neuron_cache),
            (100 * MIB, 0, 5 * MIB)
        );
        // Attention streams (64 MiB with its buffers).
        let s = choose(OTHERS + 99 * MIB);
        assert_eq!(s.dense_streamed, streamed(true, false, false));
        assert_eq!((s.dense, s.dense_buffers), (60 * MIB, 4 * MIB));
        assert_eq!(s.neuron_cache, 35 * MIB);
        assert_eq!(s.fixed() + s.neuron_cache, OTHERS + 99 * MIB);
        // Head and embedding stream together.
        let s = choose(OTHERS + 63 * MIB);
        assert_eq!(s.dense_streamed, streamed(true, true, true));
        assert_eq!((s.dense, s.dense_buffers), (0, 9 * MIB));

        // Untied: the embedding (30 MiB; 1 MiB of buffers streamed) streams wherever the cache
        // cannot hold the 200 MiB of FFN, its bytes going to the cache.
        let choose = |budget: u64| plan(input(Some(budget), false)).unwrap();
        let s = choose(OTHERS + 100 * MIB + 200 * MIB);
        assert_eq!(s.dense_streamed, DenseStreamed::default());
        assert_eq!((s.dense, s.neuron_cache), (100 * MIB, 200 * MIB));
        let s = choose(OTHERS + 100 * MIB + 199 * MIB);
        assert_eq!(s.dense_streamed, streamed(false, false, true));
        assert_eq!((s.dense, s.neuron_cache), (70 * MIB, 200 * MIB));
        let s = choose(OTHERS + 100 * MIB + 5 * MIB);
        assert_eq!(s.dense_streamed, streamed(false, false, true));
        assert_eq!(
            (s.dense, s.dense_buffers, s.neuron_cache),
            (70 * MIB, MIB, 34 * MIB)
        );
        // Below every dense weight: attention streams, then the head too.
        let s = choose(OTHERS + 99 * MIB);
        assert_eq!(s.dense_streamed, streamed(true, false, true));
        assert_eq!(
            (s.dense, s.dense_buffers, s.neuron_cache),
            (30 * MIB, 5 * MIB, 64 * MIB)
        );
        let s = choose(OTHERS + 38 * MIB);
        assert_eq!(s.dense_streamed, streamed(true, false, true));
        assert_eq!(
            (s.dense, s.dense_buffers, s.neuron_cache),
            (30 * MIB, 5 * MIB, 3 * MIB)
        );
        let s = choose(OTHERS + 34 * MIB);
        assert_eq!(s.dense_streamed, streamed(true, true, true));
        assert_eq!(
            (s.dense, s.dense_buffers, s.neuron_cache),
            (0, 9 * MIB, 25 * MIB)
        );
        // A policy that keeps every cluster keeps the embedding.
        let mut p = input(Some(OTHERS + 100 * MIB + 200 * MIB), false);
        p.needs_all_ffn = true;
        assert_eq!(plan(p).unwrap().dense_streamed, DenseStreamed::default());
    }

    #[test]
    fn below_the_streaming_minimum_is_an_error_that_states_it() {
        let p = input(Some(OTHERS + 9 * MIB - 1), false);
        assert_eq!(minimum(&p), OTHERS + 9 * MIB);
        let err = plan(p).unwrap_err().to_string();
        assert!(err.contains("below the minimum of 29.00 MiB"), "{err}");
        assert!(
            err.contains("streaming attention, output head, embedding"),
            "{err}"
        );
        assert!(plan(input(Some(OTHERS + 9 * MIB), false)).is_ok());
    }

    #[test]
    fn a_policy_without_io_keeps_the_dense_weights() {
        let mut p = input(Some(OTHERS + 99 * MIB + 200 * MIB), false);
        p.needs_all_ffn = true;
        assert_eq!(minimum(&p), OTHERS + 100 * MIB + 200 * MIB);
        assert!(plan(p).is_err());
    }

    #[test]
    fn a_context_too_long_for_the_budget_shrinks_to_the_longest_that_fits() {
        // 16 KiB of KV cache per position; everything else streams in 27 MiB.
        let at = |budget: u64| {
            move |ctx: usize| PlanInput {
                kv_cache: ctx as u64 * (16 << 10),
                ctx,
                ..input(Some(budget), false)
            }
        };
        let (ctx, s) = fit_context(2048, 256, at(59 * MIB)).unwrap();
        assert_eq!((ctx, s.kv_cache, s.neuron_cache), (2048, 32 * MIB, 0));
        // 13 MiB left for the cache: 832 positions, a multiple of 64.
        let (ctx, s) = fit_context(2048, 256, at(40 * MIB)).unwrap();
        assert_eq!((ctx, s.kv_cache), (832, 13 * MIB));
        assert_eq!(s.fixed() + s.neuron_cache, 40 * MIB);
        let (ctx, _) = fit_context(2048, 256, at(40 * MIB - 1)).unwrap();
        assert_eq!(ctx, 768);
        // The floor itself, not a multiple of the step.
        let (ctx, _) = fit_context(2048, 300, at(27 * MIB + 300 * (16 << 10))).unwrap();
        assert_eq!(ctx, 300);
        let err = fit_context(2048, 256, at(31 * MIB - 1))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("minimum of 31.00 MiB for this model at ctx 256"),
            "{err}"
        );
    }

    #[test]
    fn a_refusal_names_the_kv_storage_or_context_that_fits() {
        // 16 KiB of f32 KV cache per position (8 KiB f16, 4.25 KiB q8_0); the rest 27 MiB.
        let at = |budget: u64| {
            move |ctx: usize, kv: KvType| PlanInput {
                kv_cache: ctx as u64
                    * match kv {
                        KvType::F32 => 16 << 10,
                        KvType::F16 => 8 << 10,
                        KvType::Q8_0 => 17 << 8,
                    },
                ctx,
                ..input(Some(budget), false)
            }
        };
        // 512 positions: f16 needs 4 MiB, q8_0 2.125 MiB.
        let fix = |budget, kv| what_fits(512, kv, at(budget));
        assert_eq!(
            fix(27 * MIB + 4 * MIB, KvType::F32).as_deref(),
            Some("--kv f16")
        );
        assert_eq!(
            fix(27 * MIB + 3 * MIB, KvType::F16).as_deref(),
            Some("--kv q8_0")
        );
        // 1 MiB: 128 positions of f16; 240 of q8_0, so 192 (a multiple of 64) with q8_0.
        assert_eq!(
            fix(28 * MIB, KvType::F16).as_deref(),
            Some("--ctx 192 --kv q8_0")
        );
        // Already the leanest KV storage: only the context shortens.
        assert_eq!(
            what_fits(512, KvType::Q8_0, at(28 * MIB)).as_deref(),
            Some("--ctx 192")
        );
        // Not even 64 positions of q8_0 (272 KiB).
        assert_eq!(fix(27 * MIB + (200 << 10), KvType::F16), None);
        // Each suggestion does fit.
        assert!(plan(at(28 * MIB)(192, KvType::Q8_0)).is_ok());
        assert!(plan(at(28 * MIB)(256, KvType::Q8_0)).is_err());
    }

    #[test]
    fn a_running_model_streams_dense_weights_below_them_and_takes_them_back() {
        // Tied: an untied embedding streams at any budget short of the FFN.
        let mut opened = plan(input(Some(OTHERS + 100 * MIB + 50 * MIB), true)).unwrap();
        opened.certified_layers = vec![1, 3];
        assert_eq!(opened.dense_streamed, DenseStreamed::default());
        let to = |budget, current: &MemorySplit| replan(input(Some(budget), true), current);
        // Shrinking empties the cache first…
        let s = to(OTHERS + 100 * MIB + 10 * MIB, &opened).unwrap();
        assert_eq!(
            (s.dense_streamed, s.neuron_cache),
            (DenseStreamed::default(), 10 * MIB)
        );
        // …then streams attention, then the head and the embedding, as at start-up.
        let s = to(OTHERS + 99 * MIB, &s).unwrap();
        assert_eq!(s.dense_streamed, streamed(true, false, false));
        assert_eq!(s.neuron_cache, 35 * MIB);
        let s = to(OTHERS + 9 * MIB, &s).unwrap();
        assert_eq!(s.dense_streamed, streamed(true, true, true));
        assert_eq!((s.dense, s.neuron_cache), (0, 0));
        // Growing makes them resident again before the cache grows, capped at the FFN.
        let s = to(OTHERS + 100 * MIB, &s).unwrap();
        assert_eq!(
            (s.dense_streamed, s.neuron_cache),
            (DenseStreamed::default(), 0)
        );
        let s = to(OTHERS + 400 * MIB, &s).unwrap();
        assert_eq!((s.dense, s.neuron_cache), (100 * MIB, 200 * MIB));
        assert_eq!(s.certified_layers, [1, 3]);
        // Below the minimum: refused, stating it.
        let err = to(OTHERS + 9 * MIB - 1, &s).unwrap_err().to_string();
        assert!(err.contains("below the minimum of 29.00 MiB"), "{err}");
        assert_eq!(minimum(&input(None, true)), OTHERS + 9 * MIB);
    }

    #[test]
    fn a_certificate_is_kept_where_it_saves_more_reads_than_its_bytes_as_cache() {
        let t = |bytes, saves| CertificateTerm {
            bytes,
            ffn: 1000,
            saves,
        };
        // Saving 30 % of a 1000-byte layer beats 100 bytes of cache while little is cached…
        let terms = [t(100, Some(0.3)), t(100, Some(0.05)), t(100, None)];
        assert_eq!(keep_certificates(&terms, 0.0), [true, false, true]);
        // …but not once 70 % of the FFN is cached (it saves 0.3 · 300 = 90 < 100).
        assert_eq!(keep_certificates(&terms, 0.7), [false, false, true]);
        assert_eq!(keep_certificates(&terms, 1.5), [false, false, true]);
    }

    #[test]
    fn reads_per_token_counts_streamed_dense_and_the_uncached_ffn_less_what_certificates_save() {
        let t = |saves| CertificateTerm {
            bytes: 100,
            ffn: 1000,
            saves,
        };
        let terms = [t(Some(0.25)), t(Some(0.5)), t(None)];
        // Nothing cached, nothing certified: every FFN byte and the streamed dense weights.
        assert_eq!(reads_per_token(500, 0.0, &terms, &[false; 3]), 3500.0);
        // Certified layers read 75 % and 50 % of their uncached part; an unknown saving counts 0.
        assert_eq!(
            reads_per_token(0, 0.0, &terms, &[true; 3]),
            750.0 + 500.0 + 1000.0
        );
        // With 40 % of the FFN cached, 60 % of each layer is left to read.
        assert_eq!(
            reads_per_token(0, 0.4, &terms, &[true, false, false]),
            450.0 + 600.0 + 600.0
        );
    }

    #[test]
    fn a_tight_budget_takes_a_shorter_prompt_chunk_before_it_is_refused() {
        // Scratch of 16 KiB per chunk token; everything else streams in 28 MiB.
        let at = |budget: u64| {
            move |chunk: usize| PlanInput {
                scratch: chunk as u64 * (16 << 10),
                prompt_chunk: chunk,
                ..input(Some(budget), false)
            }
        };
        let (chunk, s) = fit_chunk(at(28 * MIB + 4 * MIB)).unwrap();
        assert_eq!((chunk, s.prompt_chunk, s.scratch), (256, 256, 4 * MIB));
        assert_eq!(fit_chunk(at(28 * MIB + 4 * MIB - 1)).unwrap().0, 128);
        assert_eq!(fit_chunk(at(28 * MIB + MIB / 4)).unwrap().0, 16);
        let err = fit_chunk(at(28 * MIB + MIB / 4 - 1))
            .unwrap_err()
            .to_string();
        assert!(err.contains("below the minimum of 28.25 MiB"), "{err}");
    }

    #[test]
    fn without_a_budget_everything_is_resident() {
        let s = plan(input(None, true)).unwrap();
        assert_eq!(s.dense_streamed, DenseStreamed::default());
        assert_eq!(s.neuron_cache, 200 * MIB);
    }
}
