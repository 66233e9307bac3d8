//! A model opened the way the command line asks: a policy, a memory budget, a flash device and a
//! context length; the same for `run`, `perplexity` and `bench`.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::model::{LanguageModel, Model};
use crate::neuron_cache::Retention;
use crate::source;
use crate::storage::FlashProfile;
use crate::streaming::{Policy, Sparsity, StreamOptions, StreamingModel};
use crate::tokenizer::Tokenizer;

/// Which engine computes the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyChoice {
    /// Every weight in DRAM, every neuron computed: the quality reference.
    Dense,
    /// Every bundle in DRAM, the file's sparsity applied, no I/O.
    Resident,
    /// Speculate-and-refine streaming under the budget.
    Leanstream,
}

#[derive(Debug, Clone)]
pub struct SessionOptions {
    pub model: PathBuf,
    /// `None`: `leanstream` for converted files, `dense` for anything else.
    pub policy: Option<PolicyChoice>,
    pub memory: Option<u64>,
    pub flash: Option<FlashProfile>,
    pub sparsity: Sparsity,
    pub ctx: Option<usize>,
    pub default_ctx: usize,
    pub lookahead: bool,
    pub retention: Retention,
}

enum Engine {
    Dense(Box<Model>),
    Streaming(Box<StreamingModel>),
}

pub struct Session {
    engine: Engine,
    pub tokenizer: Tokenizer,
    pub eos_token_ids: Vec<u32>,
    pub ctx: usize,
    pub policy: PolicyChoice,
}

impl Session {
    pub fn open(o: &SessionOptions) -> Result<Self> {
        let converted = o.model.is_file() && source::is_converted(&o.model)?;
        let policy = o.policy.unwrap_or(if converted {
            PolicyChoice::Leanstream
        } else {
            PolicyChoice::Dense
        });
        if policy != PolicyChoice::Dense && !converted {
            bail!(
                "--policy {} needs a converted file; convert {} with `leanstream-prep convert` or use --policy dense",
                policy_name(policy),
                o.model.display()
            );
        }
        if policy == PolicyChoice::Dense && (o.memory.is_some() || o.flash.is_some()) {
            bail!("--memory and --flash apply to the streaming policies (leanstream, resident), not dense");
        }
        if policy == PolicyChoice::Dense {
            let loaded = source::open(&o.model)?;
            let ctx = cap_ctx(o, loaded.model.config().max_position_embeddings)?;
            return Ok(Self {
                engine: Engine::Dense(Box::new(loaded.model)),
                tokenizer: loaded.tokenizer,
                eos_token_ids: loaded.eos_token_ids,
                ctx,
                policy,
            });
        }
        let file = leanstream_format::LsbFile::open(&o.model)?;
        let tokenizer = Tokenizer::from_bytes(&file.tokenizer_json)
            .with_context(|| format!("{}: the embedded tokenizer is invalid", o.model.display()))?;
        let ctx = cap_ctx(o, file.meta.model.max_position_embeddings)?;
        let stream = StreamOptions {
            policy: if policy == PolicyChoice::Resident {
                Policy::Resident
            } else {
                Policy::Leanstream
            },
            sparsity: o.sparsity,
            memory: o.memory,
            flash: o.flash.clone(),
            ctx,
            lookahead: o.lookahead,
            retention: o.retention,
        };
        let eos_token_ids = file.meta.model.eos_token_ids.clone();
        let mut model = StreamingModel::open(&o.model, file, &stream)?;
        model.reset_clock();
        Ok(Self {
            engine: Engine::Streaming(Box::new(model)),
            tokenizer,
            eos_token_ids,
            ctx,
            policy,
        })
    }

    pub fn model(&mut self) -> &mut dyn LanguageModel {
        match &mut self.engine {
            Engine::Dense(m) => m.as_mut(),
            Engine::Streaming(s) => s.as_mut(),
        }
    }

    /// Memory plan and streaming figures for `--json` (empty for dense).
    pub fn report(&self) -> Value {
        match &self.engine {
            Engine::Dense(_) => json!({ "policy": policy_name(self.policy) }),
            Engine::Streaming(s) => {
                let mut v = serde_json::to_value(s.summary()).expect("serialisable");
                v["policy"] = policy_name(self.policy).into();
                v["memory_budget_bytes"] = s.budget.into();
                v["memory_split"] = serde_json::to_value(&s.split).expect("serialisable");
                v
            }
        }
    }

    /// The memory split, one line, for stderr.
    pub fn describe_memory(&self) -> Option<String> {
        match &self.engine {
            Engine::Dense(_) => None,
            Engine::Streaming(s) => Some(s.split.describe()),
        }
    }
}

pub fn policy_name(p: PolicyChoice) -> &'static str {
    match p {
        PolicyChoice::Dense => "dense",
        PolicyChoice::Resident => "resident",
        PolicyChoice::Leanstream => "leanstream",
    }
}

fn cap_ctx(o: &SessionOptions, max: usize) -> Result<usize> {
    let ctx = o.ctx.unwrap_or(o.default_ctx);
    if ctx < 2 {
        bail!("--ctx must be at least 2 tokens");
    }
    if ctx > max {
        if o.ctx.is_some() {
            bail!(
                "--ctx {ctx} exceeds the maximum context of {} ({max} tokens): use --ctx {max} or less",
                o.model.display()
            );
        }
        return Ok(max);
    }
    Ok(ctx)
}
