//! Error type shared by everything under `model/`.

use std::path::PathBuf;

/// Errors raised while building, loading, saving or running the policy model
/// and its tokenizer. File-related variants always name the file (and the
/// tensor, where one is involved) so a bad checkpoint can be diagnosed from
/// the message alone.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// Any error coming out of candle (shape mismatch inside an op, dtype, ...).
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),

    /// Reading or writing a file failed.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A `config.json` could not be parsed or is inconsistent.
    #[error("config {}: {msg}", path.display())]
    Config { path: PathBuf, msg: String },

    /// A config built in memory is inconsistent (see [`crate::model::ModelConfig::validate`]).
    #[error("invalid model config: {0}")]
    InvalidConfig(String),

    /// A weight the architecture needs is not in the checkpoint.
    #[error("{file}: missing tensor `{name}`")]
    MissingTensor { file: String, name: String },

    /// A checkpoint holds a tensor this architecture does not use (e.g.
    /// attention biases of a Qwen2 model loaded with a Llama config):
    /// loading it would silently give a different model.
    #[error("{file}: unexpected tensor `{name}` (not used by the configured architecture)")]
    UnexpectedTensor { file: String, name: String },

    /// A weight is stored in a non-float dtype (e.g. a quantized
    /// checkpoint), which cannot be converted to f32 meaningfully.
    #[error("{file}: tensor `{name}` has dtype {dtype}, expected f32, f16 or bf16")]
    Dtype {
        file: String,
        name: String,
        dtype: String,
    },

    /// A config's `model_type` or `architectures` names a model family this
    /// crate does not implement (or the two disagree).
    #[error("{file}: unsupported {field} `{value}` (supported: {supported})")]
    UnknownArchitecture {
        file: String,
        field: String,
        value: String,
        supported: String,
    },

    /// A file a HF model folder needs (`config.json`, the weights, a shard
    /// named in the index) does not exist.
    #[error("{}: {what} not found", path.display())]
    MissingFile { path: PathBuf, what: String },

    /// A checkpoint file exists but is malformed (unreadable safetensors,
    /// an index without `weight_map`, ...).
    #[error("{}: {msg}", path.display())]
    Checkpoint { path: PathBuf, msg: String },

    /// A weight has the wrong shape for the config.
    #[error("{file}: tensor `{name}` has shape {got:?}, expected {expected:?}")]
    Shape {
        file: String,
        name: String,
        expected: Vec<usize>,
        got: Vec<usize>,
    },

    /// Loading, saving or running a tokenizer failed.
    #[error("tokenizer {}: {msg}", path.display())]
    Tokenizer { path: PathBuf, msg: String },

    /// A file that should be GGUF is not one, or its header (magic,
    /// version, metadata, tensor table) is malformed or truncated.
    #[error("{}: not a valid GGUF file: {msg}", path.display())]
    NotGguf { path: PathBuf, msg: String },

    /// A metadata key a GGUF model or tokenizer needs is absent.
    #[error("{file}: missing GGUF metadata key `{key}`")]
    MissingMetadata { file: String, key: String },

    /// A GGUF metadata value has the wrong type or an unusable value.
    #[error("{file}: GGUF metadata `{key}`: {msg}")]
    BadMetadata {
        file: String,
        key: String,
        msg: String,
    },

    /// A GGUF tensor's data cannot be read or dequantised (truncated file,
    /// unsupported ggml type, size not a multiple of the block size).
    #[error("{file}: GGUF tensor `{name}`: {msg}")]
    TensorData {
        file: String,
        name: String,
        msg: String,
    },

    /// A caller passed arguments the model cannot honour (empty prompt,
    /// target position out of range, token id outside the vocabulary, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// A `rope_scaling` value that cannot be used. The message is the part
/// after `rope_scaling: `; the caller adds the file ([`ModelError::Config`])
/// or the in-memory context ([`ModelError::InvalidConfig`]).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RopeScalingError {
    /// The value is neither an object nor null.
    #[error("expected an object or null, got {0}")]
    NotAnObject(String),
    /// Neither `rope_type` nor the older `type` names the kind.
    #[error("missing rope_type")]
    MissingType,
    /// A kind this crate does not implement.
    #[error("rope_type `{0}` is not supported (supported: default, linear, llama3)")]
    UnsupportedType(String),
    /// A numeric parameter of the kind is absent or not a number.
    #[error("{kind} scaling needs a number `{key}`")]
    MissingNumber { kind: String, key: String },
    /// llama3's `original_max_position_embeddings` is absent or not an
    /// integer.
    #[error("llama3 scaling needs an integer `original_max_position_embeddings`")]
    MissingOriginalMax,
    /// A factor is not a positive finite number.
    #[error("{key} must be > 0, got {value}")]
    NotPositive { key: String, value: f64 },
    /// llama3's `original_max_position_embeddings` is 0.
    #[error("original_max_position_embeddings must be > 0")]
    ZeroOriginalMax,
    /// llama3's interpolation divides by `high - low`.
    #[error("high_freq_factor ({high}) must exceed low_freq_factor ({low})")]
    FreqFactorOrder { low: f64, high: f64 },
}

/// A config that cannot be written as HF JSON; the caller adds the file
/// ([`ModelError::Config`]).
#[derive(Debug, thiserror::Error)]
pub enum ConfigJsonError {
    #[error("{0}")]
    Json(#[from] serde_json::Error),
    #[error("config did not serialise to an object")]
    NotAnObject,
}

/// Shorthand used throughout the module.
pub type Result<T> = std::result::Result<T, ModelError>;
