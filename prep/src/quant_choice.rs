//! `convert --quant`: how the converted file encodes its tensors. `auto` (the default) keeps a
//! GGUF file's encodings tensor by tensor — its author chose them, and converting a 4-bit file to
//! q8 would double the bytes every token streams and raise the memory floor: the FFN gate and up
//! rows and the dense tensors are copied as stored, the down columns (which bundles store across
//! the GGUF's rows) are encoded afresh at no lower precision ([`column_type`]). Float weights (a
//! Hugging Face folder) become q8. `--quant X` encodes every tensor as X.

use std::path::Path;
use std::str::FromStr;

use anyhow::Result;
use candle_core::quantized::GgmlDType;
use leanstream::source::gguf::GgufFile;
use leanstream_format::ffn::PartTypes;
use leanstream_format::quant::{row_bytes, QuantType};

/// What `--quant` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantArg {
    Auto,
    Fixed(QuantType),
}

impl FromStr for QuantArg {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s == "auto" {
            return Ok(Self::Auto);
        }
        s.parse().map(Self::Fixed).map_err(|_| {
            format!(
                "expected auto, f32, f16, bf16, q8, q4, q4_1, q5_0, q5_1, q4_k, q5_k or q6_k, \
                 not {s:?}"
            )
        })
    }
}

/// How `convert` encodes a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    /// Every tensor's encoding under `--quant X`; with `keep`, that of the tensors whose stored
    /// encoding the file format lacks, and the FFN's width for sizing clusters and predictors.
    pub quant: QuantType,
    /// Each tensor keeps the source's encoding (a GGUF file under `--quant auto`).
    pub keep: bool,
    /// Why, for the user.
    pub why: String,
}

/// The encoding `quant` gives the source `model` (a model folder or a GGUF file), and why.
pub fn resolve(quant: QuantArg, model: &Path) -> Result<Choice> {
    let choice = |quant, keep, why: &str| Choice {
        quant,
        keep,
        why: why.into(),
    };
    if let QuantArg::Fixed(q) = quant {
        return Ok(choice(q, false, "--quant"));
    }
    if model.is_dir() || !model.is_file() || leanstream::source::is_converted(model)? {
        // Not a GGUF file: float weights, or an error `convert` reports with the file's name.
        return Ok(choice(QuantType::Q8_0, false, "float weights"));
    }
    let Some(stored) = GgufFile::open(model)?.ffn_gate_type() else {
        return Ok(choice(
            QuantType::Q8_0,
            false,
            "no FFN gate in the GGUF file",
        ));
    };
    Ok(choice(
        for_ggml(stored),
        true,
        &format!(
            "each tensor as the GGUF file stores it (its first FFN gate is {stored:?}); down \
             columns and types the file format lacks as {}",
            for_ggml(stored)
        ),
    ))
}

/// The file format's encoding closest to GGML type `t` that is not wider, for tensors encoded
/// afresh: 4-bit and narrower types become `q4_1` (`q4_0` stays itself; the k-quants keep a
/// per-block offset, which `q4_1` has and `q4_0` lacks), 5- to 8-bit types `q8_0`, floats `q8_0`
/// as for a Hugging Face folder.
fn for_ggml(t: GgmlDType) -> QuantType {
    use GgmlDType::*;
    match t {
        Q4_0 => QuantType::Q4_0,
        Q4_1 | Q2K | Q3K | Q4K => QuantType::Q4_1,
        _ => QuantType::Q8_0,
    }
}

/// The encoding of a down column of `h` values encoded afresh from a GGUF down matrix stored as
/// `source` (`None`: a type the file format lacks). A column crosses the matrix's rows, so it
/// cannot be copied; it gets no lower precision than the source: floats stay as they are (a
/// column of f16 values is exactly f16), 8- and 6-bit types become `q8_0`, 4- and 5-bit types
/// `q6_k` (6 bits and a scale per 16 values: finer than their 4 or 5 bits per 32), `q8_0` where
/// `h` is no multiple of 256, `f16` where it is no multiple of 32.
pub fn column_type(source: Option<QuantType>, h: usize) -> QuantType {
    use QuantType::*;
    let want = match source {
        Some(q @ (F32 | F16 | BF16)) => q,
        Some(Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q4_K | Q5_K) => Q6_K,
        Some(Q8_0 | Q6_K) | None => Q8_0,
    };
    [want, Q8_0, F16]
        .into_iter()
        .find(|&q| row_bytes(q, h).is_ok())
        .unwrap_or(F32)
}

/// The encodings of a layer's bundles when each tensor keeps its own: the gate and up rows as
/// stored (`gate`, `up`; `None` for a type the format lacks, which becomes `fallback`), the down
/// columns by [`column_type`] of the stored `down`.
pub fn kept_parts(
    [gate, up, down]: [Option<QuantType>; 3],
    fallback: QuantType,
    h: usize,
) -> PartTypes {
    let row = |q: Option<QuantType>| q.filter(|&q| row_bytes(q, h).is_ok()).unwrap_or(fallback);
    PartTypes {
        gate: row(gate),
        up: row(up),
        down: column_type(down, h),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_encoding_can_be_named() {
        assert!(matches!(
            "q4_k".parse::<QuantArg>(),
            Ok(QuantArg::Fixed(QuantType::Q4_K))
        ));
        assert!(matches!(
            "q5_0".parse::<QuantArg>(),
            Ok(QuantArg::Fixed(QuantType::Q5_0))
        ));
        assert!(matches!(
            "q4_1".parse::<QuantArg>(),
            Ok(QuantArg::Fixed(QuantType::Q4_1))
        ));
    }

    #[test]
    fn types_encoded_afresh_are_no_wider() {
        assert_eq!(for_ggml(GgmlDType::Q4_0), QuantType::Q4_0);
        assert_eq!(for_ggml(GgmlDType::Q4_1), QuantType::Q4_1);
        assert_eq!(for_ggml(GgmlDType::Q4K), QuantType::Q4_1);
        assert_eq!(for_ggml(GgmlDType::Q6K), QuantType::Q8_0);
        assert_eq!(for_ggml(GgmlDType::Q8_0), QuantType::Q8_0);
        assert_eq!(for_ggml(GgmlDType::F16), QuantType::Q8_0);
    }

    #[test]
    fn down_columns_lose_no_precision() {
        use QuantType::*;
        for (source, h, want) in [
            (Some(Q4_K), 256, Q6_K),
            (Some(Q5_0), 512, Q6_K),
            (Some(Q4_K), 576, Q8_0),
            (Some(Q6_K), 256, Q8_0),
            (Some(Q8_0), 64, Q8_0),
            (Some(F16), 64, F16),
            (Some(BF16), 64, BF16),
            (Some(F32), 64, F32),
            (None, 256, Q8_0),
            (Some(Q4_0), 48, F16),
        ] {
            assert_eq!(column_type(source, h), want, "{source:?} {h}");
        }
        let p = kept_parts([Some(Q4_K), None, Some(Q6_K)], Q4_1, 256);
        assert_eq!((p.gate, p.up, p.down), (Q4_K, Q4_1, Q8_0));
        // A stored type the row width does not fit (never so in a valid GGUF) is encoded afresh.
        assert_eq!(kept_parts([Some(Q4_K); 3], Q4_1, 64).gate, Q4_1);
    }

    #[test]
    fn a_named_encoding_wins_and_a_wrong_one_is_named() {
        let dir = &Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/austen-relu");
        let q4: QuantArg = "q4".parse().unwrap();
        let c = resolve(q4, dir).unwrap();
        assert_eq!((c.quant, c.keep), (QuantType::Q4_0, false));
        let c = resolve(QuantArg::Auto, dir).unwrap();
        assert_eq!((c.quant, c.keep), (QuantType::Q8_0, false));
        let err = "q5".parse::<QuantArg>().unwrap_err();
        assert!(err.contains("q6_k") && err.contains("\"q5\""), "{err}");
    }
}
