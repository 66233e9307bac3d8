//! LeanStream runtime: generates text from LLMs whose FFN weights stream from flash under a hard
//! memory budget. This crate holds the engine (model, kernels, KV cache, sampler) and the
//! `leanstream` command-line tool.

pub mod bench;
pub mod certify;
#[cfg(target_os = "linux")]
pub mod cgroup;
pub mod chat;
pub mod chat_template;
pub mod closed_pipe;
pub mod config;
pub mod conversion_cache;
pub mod demo;
pub mod elastic;
pub mod generate;
pub mod gguf;
pub mod gguf_tokenizer;
pub mod kernels;
pub mod kv_cache;
pub mod lsb_dense;
pub mod memory;
pub mod memory_size;
pub mod model;
pub mod model_arg;
pub mod neuron_cache;
pub mod perplexity;
pub mod probe;
pub mod rope;
pub mod safetensors_dir;
pub mod sampler;
pub mod sampling_args;
pub mod serve;
pub mod session;
pub mod skip_rule;
pub mod slot_heap;
pub mod source;
pub mod storage;
pub mod streaming;
pub mod tokenizer;
pub mod transfer;
