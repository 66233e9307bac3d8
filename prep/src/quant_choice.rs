//! `convert --quant auto` (the default): the encoding of the converted file when the user names
//! none. A GGUF file keeps the width its author chose for the FFN — converting a 4-bit file to q8
//! would double the bytes every token streams and raise the memory floor — and float weights (a
//! Hugging Face folder, an f16 GGUF) become q8.

use std::path::Path;
use std::str::FromStr;

use anyhow::Result;
use candle_core::quantized::GgmlDType;
use leanstream::source::gguf::GgufFile;
use leanstream_format::quant::QuantType;

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
        let expected = || format!("expected auto, f32, f16, bf16, q8, q4 or q4_1, not {s:?}");
        let qtype: QuantType = s.parse().map_err(|_| expected())?;
        // The 5-bit and K-quant encodings (format 1.7) are read, not yet written, by the
        // converter.
        if qtype.since_minor() > 1 {
            return Err(format!(
                "{s:?}: the converter does not write {qtype} yet; {}",
                expected()
            ));
        }
        Ok(Self::Fixed(qtype))
    }
}

/// The encoding `quant` gives the source `model` (a model folder or a GGUF file), and why, for
/// the user.
pub fn resolve(quant: QuantArg, model: &Path) -> Result<(QuantType, String)> {
    if let QuantArg::Fixed(q) = quant {
        return Ok((q, "--quant".into()));
    }
    if model.is_dir() || !model.is_file() || leanstream::source::is_converted(model)? {
        // Not a GGUF file: float weights, or an error `convert` reports with the file's name.
        return Ok((QuantType::Q8_0, "float weights".into()));
    }
    let Some(stored) = GgufFile::open(model)?.ffn_gate_type() else {
        return Ok((QuantType::Q8_0, "no FFN gate in the GGUF file".into()));
    };
    Ok((
        for_ggml(stored),
        format!("the GGUF file's FFN is {stored:?}"),
    ))
}

/// The file format's encoding closest to GGML type `t` that is not wider: 4-bit and narrower types
/// become `q4_1` (`q4_0` stays itself; the k-quants keep a per-block offset, which `q4_1` has and
/// `q4_0` lacks), 5- to 8-bit types `q8_0`, floats `q8_0` as for a Hugging Face folder.
fn for_ggml(t: GgmlDType) -> QuantType {
    use GgmlDType::*;
    match t {
        Q4_0 => QuantType::Q4_0,
        Q4_1 | Q2K | Q3K | Q4K => QuantType::Q4_1,
        _ => QuantType::Q8_0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn k_quants_are_not_written_yet() {
        let err = "q4_k".parse::<QuantArg>().unwrap_err();
        assert!(
            err.contains("does not write q4_k") && err.contains("q4_1"),
            "{err}"
        );
        assert!("q5_0".parse::<QuantArg>().is_err());
        assert!(matches!(
            "q4_1".parse::<QuantArg>(),
            Ok(QuantArg::Fixed(QuantType::Q4_1))
        ));
    }

    #[test]
    fn a_gguf_keeps_its_width() {
        assert_eq!(for_ggml(GgmlDType::Q4_0), QuantType::Q4_0);
        assert_eq!(for_ggml(GgmlDType::Q4_1), QuantType::Q4_1);
        assert_eq!(for_ggml(GgmlDType::Q4K), QuantType::Q4_1);
        assert_eq!(for_ggml(GgmlDType::Q6K), QuantType::Q8_0);
        assert_eq!(for_ggml(GgmlDType::Q8_0), QuantType::Q8_0);
        assert_eq!(for_ggml(GgmlDType::F16), QuantType::Q8_0);
    }

    #[test]
    fn a_named_encoding_wins_and_a_wrong_one_is_named() {
        let dir = &Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/austen-relu");
        let q4: QuantArg = "q4".parse().unwrap();
        assert_eq!(resolve(q4, dir).unwrap().0, QuantType::Q4_0);
        assert_eq!(resolve(QuantArg::Auto, dir).unwrap().0, QuantType::Q8_0);
        let err = "q5".parse::<QuantArg>().unwrap_err();
        assert!(err.contains("q4_1") && err.contains("\"q5\""), "{err}");
    }
}
