//! The runtime's integration tests, in one test binary (one link of the runtime instead of one per
//! file): each file beside this one is a module; `support` (SmolLM2 and the fixtures) is shared.
//!
//! `compact_tokenizer_size` stays a binary of its own: it counts the bytes the whole process holds
//! through a global allocator.

#[path = "../support/mod.rs"]
mod support;

mod chat;
mod cli;
mod compact_tokenizer;
mod demo;
mod gguf_model;
mod gguf_quant_types;
mod kv_cache;
mod perplexity_positions;
mod quantized;
mod serve;
mod serve_parallel;
mod smollm2;
mod storage;
