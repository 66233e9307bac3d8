//! LeanStream runtime: generates text from LLMs whose FFN weights stream from flash under a hard
//! memory budget. This crate holds the engine (model, kernels, KV cache, sampler) and the
//! `leanstream` command-line tool.

pub mod bench;
pub mod cli;
pub mod kernels;
pub mod model;
pub mod platform;
pub mod serve;
pub mod source;
pub mod storage;
pub mod streaming;
pub mod text;
pub mod tokenizer;
pub mod transfer;
