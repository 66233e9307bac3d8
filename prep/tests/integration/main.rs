//! leanstream-prep's integration tests, in one test binary (one link instead of one per file):
//! each file beside this one is a module.

mod convert;
mod synth;
mod train_moe;
mod transfer;
