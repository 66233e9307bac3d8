//! The end-to-end tests, in one test binary: each file beside this one is a module, and the
//! shared helpers (tiny model generator, f64 reference, converted files, the workspace's binaries)
//! are the crate's library (`leanstream_tests`). One binary links the runtime once instead of once
//! per file, and files converted once per process ([`leanstream_tests::converted::embedded`]) are
//! shared by every test that reads them.
//!
//! Tests that need the process to themselves stay separate binaries: `decode_allocations` installs
//! a counting global allocator and asserts that no read buffer is mapped process-wide while it
//! decodes. `elastic_budget` posts budgets near the floor, which counts the process's
//! start-up memory: inside this binary that start-up includes the tests running beside it, and a
//! budget meant to be below the floor was taken.

mod arch_fixtures;
mod atomic_output;
mod bad_input;
mod bench;
mod breakage;
mod chat_templates;
mod cluster_layout;
mod context_fit;
mod convert_memory;
mod dense_stream;
mod docs;
mod elastic_refill;
mod engine_vs_reference;
mod faults;
mod fuzz_corpus;
mod gguf_export;
mod gguf_moe;
mod layout_first;
mod memory_cgroup;
mod model_argument;
mod moe_cli;
mod moe_convert;
mod moe_stream;
mod moe_synth;
mod moe_trained;
mod page_cache;
mod policies;
mod prefill;
mod quality;
mod quant_fixtures;
mod real_model;
mod reference_vs_candle;
mod refine;
mod streaming;
mod threads;
mod tiny_generator;
mod tokenizers;
