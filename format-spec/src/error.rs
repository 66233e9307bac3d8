//! Errors of reading, validating and writing a LeanStream file.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file is not a LeanStream file, is from an incompatible version, or is damaged.
    #[error("{0}")]
    Invalid(String),
    /// A stored checksum does not match the bytes.
    #[error("checksum mismatch in {what}: the file is corrupted; convert or copy it again")]
    Checksum { what: String },
    #[error("invalid model config: {0}")]
    Config(String),
    #[error(transparent)]
    Quant(#[from] crate::quant::QuantError),
}

impl FormatError {
    pub fn config(msg: impl Into<String>) -> Self {
        FormatError::Config(msg.into())
    }

    pub fn invalid(msg: impl Into<String>) -> Self {
        FormatError::Invalid(msg.into())
    }

    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        FormatError::Io {
            path: path.into(),
            source,
        }
    }
}
