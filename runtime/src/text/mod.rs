//! Text from tokens: a model opened as the command line asks ([`session`]), prompt processing and
//! decode ([`generate`]), next-token choice ([`sampler`]), perplexity ([`perplexity`]) and a
//! model's chat format ([`chat`]).

pub mod chat;
pub mod generate;
pub mod perplexity;
pub mod sampler;
pub mod session;
