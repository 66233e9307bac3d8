//! The sampling flags shared by `leanstream run` and `leanstream chat`.

use clap::Args;

use crate::text::sampler::SamplerConfig;

#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.8)]
    pub temp: f32,
    /// Sample only among the K most likely tokens (0 = off).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Sample only among the most likely tokens whose probability reaches P (1 = off).
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Sample only among tokens at least P times as likely as the most likely one (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Penalty on recently generated tokens (1 = off).
    #[arg(long, default_value_t = 1.1)]
    pub repeat_penalty: f32,
    /// Random seed for sampling.
    #[arg(long, default_value_t = 299792458)]
    pub seed: u64,
}

impl SamplingArgs {
    pub fn config(&self) -> SamplerConfig {
        SamplerConfig {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            seed: self.seed,
            ..Default::default()
        }
    }
}
