//! [`EncodingConfig`]: every encoding's configuration under one enum, for building an encoding
//! by name and for self-describing checkpoints.
//!
//! Adding an encoding to the crate means one new file plus one arm here.

use std::collections::HashMap;
use std::sync::Arc;

use candle_nn::VarBuilder;

use crate::absolute::learned::{Interpolation, LearnedConfig, LearnedPositionalEncoding};
use crate::absolute::sinusoidal::{SinusoidalConfig, SinusoidalPositionalEncoding};
use crate::attention::PositionalEncoding;
use crate::checkpoint::MetadataReader;
use crate::relative::alibi::{Alibi, AlibiConfig, AlibiMode};
use crate::relative::clipped_bias::{ClippedBiasConfig, ClippedRelativeBias};
use crate::relative::shaw::{ShawConfig, ShawRelativePosition};
use crate::relative::t5::{T5Config, T5RelativeBias};
use crate::Result;

/// Metadata key naming the encoding kind.
pub const KIND_KEY: &str = "posenc.kind";

/// The configuration of any encoding in the crate.
#[derive(Debug, Clone, PartialEq)]
pub enum EncodingConfig {
    /// No positional information at all.
    None,
    /// [`SinusoidalPositionalEncoding`].
    Sinusoidal(SinusoidalConfig),
    /// [`LearnedPositionalEncoding`].
    Learned(LearnedConfig),
    /// [`Alibi`].
    Alibi(AlibiConfig),
    /// [`T5RelativeBias`].
    T5(T5Config),
    /// [`ClippedRelativeBias`].
    ClippedBias(ClippedBiasConfig),
    /// [`ShawRelativePosition`].
    Shaw(ShawConfig),
}

impl EncodingConfig {
    /// A short name for the kind: `none`, `sinusoidal`, `learned`, `alibi`, `t5`,
    /// `clipped_bias`, `shaw`.
    pub fn kind(&self) -> &'static str {
        match self {
            EncodingConfig::None => "none",
            EncodingConfig::Sinusoidal(_) => "sinusoidal",
            EncodingConfig::Learned(_) => "learned",
            EncodingConfig::Alibi(_) => "alibi",
            EncodingConfig::T5(_) => "t5",
            EncodingConfig::ClippedBias(_) => "clipped_bias",
            EncodingConfig::Shaw(_) => "shaw",
        }
    }

    /// Builds the encoding. Learned tables are loaded from (or created in) `vb`, so pass the
    /// prefix the encoding's tensors live under.
    ///
    /// # Errors
    /// The encoding's configuration and loading errors.
    pub fn build(&self, vb: VarBuilder) -> Result<Option<Arc<dyn PositionalEncoding>>> {
        Ok(match self {
            EncodingConfig::None => None,
            EncodingConfig::Sinusoidal(c) => Some(Arc::new(SinusoidalPositionalEncoding::new(
                c,
                vb.dtype(),
                vb.device(),
            )?)),
            EncodingConfig::Learned(c) => Some(Arc::new(LearnedPositionalEncoding::new(c, vb)?)),
            EncodingConfig::Alibi(c) if c.learnable => Some(Arc::new(Alibi::new_learnable(c, vb)?)),
            EncodingConfig::Alibi(c) => Some(Arc::new(Alibi::new(c, vb.device())?)),
            EncodingConfig::T5(c) => Some(Arc::new(T5RelativeBias::new(c, vb)?)),
            EncodingConfig::ClippedBias(c) => Some(Arc::new(ClippedRelativeBias::new(c, vb)?)),
            EncodingConfig::Shaw(c) => Some(Arc::new(ShawRelativePosition::new(c, vb)?)),
        })
    }

    /// The configuration as `posenc.*` string metadata.
    pub fn to_metadata(&self) -> HashMap<String, String> {
        let mut m = HashMap::new();
        m.insert(KIND_KEY.to_string(), self.kind().to_string());
        let mut put = |k: &str, v: String| {
            m.insert(format!("posenc.{k}"), v);
        };
        match self {
            EncodingConfig::None => {}
            EncodingConfig::Sinusoidal(c) => {
                put("d_model", c.d_model.to_string());
                put("max_len", c.max_len.to_string());
                put("base", c.base.to_string());
                put("dropout", c.dropout.to_string());
            }
            EncodingConfig::Learned(c) => {
                put("d_model", c.d_model.to_string());
                put("max_len", c.max_len.to_string());
                put("dropout", c.dropout.to_string());
                let interp = match c.interpolation {
                    Interpolation::Off => "off".to_string(),
                    Interpolation::ToSequenceLength => "to_sequence_length".to_string(),
                    Interpolation::ToLength(n) => format!("to_length:{n}"),
                };
                put("interpolation", interp);
            }
            EncodingConfig::Alibi(c) => {
                put("num_heads", c.num_heads.to_string());
                put("first_head", c.first_head.to_string());
                put("head_count", c.head_count.to_string());
                let mode = match c.mode {
                    AlibiMode::Causal => "causal",
                    AlibiMode::CausalPairwise => "causal_pairwise",
                    AlibiMode::Symmetric => "symmetric",
                };
                put("mode", mode.to_string());
                put("learnable", c.learnable.to_string());
            }
            EncodingConfig::T5(c) => {
                put("num_heads", c.num_heads.to_string());
                put("num_buckets", c.num_buckets.to_string());
                put("max_distance", c.max_distance.to_string());
                put("bidirectional", c.bidirectional.to_string());
            }
            EncodingConfig::ClippedBias(c) => {
                put("num_heads", c.num_heads.to_string());
                put("max_distance", c.max_distance.to_string());
            }
            EncodingConfig::Shaw(c) => {
                put("head_dim", c.head_dim.to_string());
                put("max_distance", c.max_distance.to_string());
                put("values", c.values.to_string());
            }
        }
        m
    }

    /// Reads a configuration written by [`Self::to_metadata`] and validates it.
    ///
    /// # Errors
    /// [`crate::Error::Checkpoint`] naming a missing or unparsable key or an unknown kind;
    /// [`crate::Error::InvalidConfig`] if the values are out of range.
    pub fn from_metadata(metadata: &HashMap<String, String>, source: &str) -> Result<Self> {
        let r = MetadataReader { source, metadata };
        let usize_of = |k: &str| r.parse::<usize>(&format!("posenc.{k}"), "a non-negative integer");
        let f32_of = |k: &str| r.parse::<f32>(&format!("posenc.{k}"), "a number");
        let bool_of = |k: &str| r.parse::<bool>(&format!("posenc.{k}"), "true or false");
        let config = match r.str(KIND_KEY)? {
            "none" => EncodingConfig::None,
            "sinusoidal" => {
                let c = SinusoidalConfig {
                    d_model: usize_of("d_model")?,
                    max_len: usize_of("max_len")?,
                    base: r.parse("posenc.base", "a number")?,
                    dropout: f32_of("dropout")?,
                };
                c.validate()?;
                EncodingConfig::Sinusoidal(c)
            }
            "learned" => {
                let raw = r.str("posenc.interpolation")?;
                let interpolation = match raw {
                    "off" => Interpolation::Off,
                    "to_sequence_length" => Interpolation::ToSequenceLength,
                    other => match other
                        .strip_prefix("to_length:")
                        .and_then(|n| n.parse().ok())
                    {
                        Some(n) => Interpolation::ToLength(n),
                        None => {
                            return Err(r.error(
                                "posenc.interpolation",
                                format!("`{raw}` is not off, to_sequence_length or to_length:N"),
                            ))
                        }
                    },
                };
                let c = LearnedConfig {
                    d_model: usize_of("d_model")?,
                    max_len: usize_of("max_len")?,
                    dropout: f32_of("dropout")?,
                    interpolation,
                };
                c.validate()?;
                EncodingConfig::Learned(c)
            }
            "alibi" => {
                let raw = r.str("posenc.mode")?;
                let mode = match raw {
                    "causal" => AlibiMode::Causal,
                    "causal_pairwise" => AlibiMode::CausalPairwise,
                    "symmetric" => AlibiMode::Symmetric,
                    _ => {
                        return Err(r.error(
                            "posenc.mode",
                            format!("`{raw}` is not causal, causal_pairwise or symmetric"),
                        ))
                    }
                };
                let c = AlibiConfig {
                    num_heads: usize_of("num_heads")?,
                    first_head: usize_of("first_head")?,
                    head_count: usize_of("head_count")?,
                    mode,
                    learnable: bool_of("learnable")?,
                };
                c.validate()?;
                EncodingConfig::Alibi(c)
            }
            "t5" => {
                let c = T5Config {
                    num_heads: usize_of("num_heads")?,
                    num_buckets: usize_of("num_buckets")?,
                    max_distance: usize_of("max_distance")?,
                    bidirectional: bool_of("bidirectional")?,
                };
                c.validate()?;
                EncodingConfig::T5(c)
            }
            "clipped_bias" => {
                let c = ClippedBiasConfig {
                    num_heads: usize_of("num_heads")?,
                    max_distance: usize_of("max_distance")?,
                };
                c.validate()?;
                EncodingConfig::ClippedBias(c)
            }
            "shaw" => {
                let c = ShawConfig {
                    head_dim: usize_of("head_dim")?,
                    max_distance: usize_of("max_distance")?,
                    values: bool_of("values")?,
                };
                c.validate()?;
                EncodingConfig::Shaw(c)
            }
            other => {
                return Err(r.error(
                    KIND_KEY,
                    format!(
                        "unknown encoding `{other}`, expected none, sinusoidal, learned, alibi, t5, clipped_bias or shaw"
                    ),
                ))
            }
        };
        Ok(config)
    }
}
