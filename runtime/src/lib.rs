//! LeanStream runtime: generates text from LLMs whose FFN weights stream from flash under a hard
//! memory budget. This crate holds the engine (model, kernels, KV cache, sampler) and the
//! `leanstream` command-line tool.
//!
//! Cargo features (both default): `cli`, the command line's own modules ([`cli`], [`bench`](mod@bench),
//! [`transfer`], the flash probe) with clap, progress bars and Ctrl-C handling; `serve`, the
//! OpenAI-compatible HTTP server ([`serve`]). An embedder (the C API) turns them off and gets the
//! engine alone.

// Public items' docs link to the private constants and helpers they depend on: the links resolve
// in the docs for the people working on the code (`--document-private-items`, as CI builds them).
#![allow(rustdoc::private_intra_doc_links)]

#[cfg(feature = "cli")]
pub mod bench;
#[cfg(feature = "cli")]
pub mod cli;
#[cfg(feature = "gpu")]
pub mod gpu;
pub mod kernels;
pub mod model;
pub mod platform;
#[cfg(feature = "serve")]
pub mod serve;
pub mod source;
pub mod storage;
pub mod streaming;
pub mod text;
pub mod tokenizer;
#[cfg(feature = "cli")]
pub mod transfer;
