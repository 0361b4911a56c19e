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
}

impl EncodingConfig {
    /// A short name for the kind: `none`, `sinusoidal`, `learned`.
    pub fn kind(&self) -> &'static str {
        match self {
            EncodingConfig::None => "none",
            EncodingConfig::Sinusoidal(_) => "sinusoidal",
            EncodingConfig::Learned(_) => "learned",
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
            other => {
                return Err(r.error(
                    KIND_KEY,
                    format!("unknown encoding `{other}`, expected none, sinusoidal or learned"),
                ))
            }
        };
        Ok(config)
    }
}
