//! The `leanstream` command line's own commands: `demo`, `chat` and the sampling flags that `run`
//! and `chat` share.

pub mod chat;
pub mod demo;
pub mod sampling_args;
