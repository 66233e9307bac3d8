//! The LeanStream neuron-bundle file format: types, reader, writer and validation. `FORMAT.md` is
//! the normative description; this crate is the only code that reads or writes the file.

pub mod archive;
pub mod atomic;
pub mod bpe_vocab;
mod codec;
pub mod container;
pub mod dense;
pub mod error;
pub mod expert;
pub mod ffn;
pub mod file;
pub mod input_basis;
pub mod meta;
pub mod model_config;
pub mod predictor;
pub mod quant;
pub mod quant_k;
pub mod quant_scale;
pub mod refine;
pub mod relayout;
pub mod sketch;

pub use error::FormatError;
pub use file::{verify, verify_reader, LsbFile};
