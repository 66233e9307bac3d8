//! Text from tokens: a model opened as the command line asks ([`session`]), prompt processing and
//! decode ([`generate`]), next-token choice ([`sampler`]) and perplexity ([`perplexity`]).

pub mod generate;
pub mod perplexity;
pub mod sampler;
pub mod session;
