//! [`EncodingConfig`]: every encoding's configuration under one enum, for building an encoding
//! by name and for self-describing checkpoints.
//!
//! The enum and every configuration in it derive serde's `Serialize` and `Deserialize`, so a
//! configuration can be written by hand in JSON (or any serde format) with only its required
//! fields, e.g. `{"kind": "rotary", "head_dim": 128, "base": 500000.0}`, and the rest take the
//! defaults of the configuration's `new`. In a checkpoint the configuration is one metadata
//! entry, [`ENCODING_KEY`] (`posenc.encoding`) → its JSON ([`EncodingConfig::to_metadata`],
//! [`EncodingConfig::from_metadata`]), e.g.
//!
//! ```text
//! posenc.encoding = {"kind":"t5","num_heads":4,"num_buckets":32,"max_distance":128,"bidirectional":false}
//! ```
//!
//! Adding an encoding to the crate means one new file plus one arm here.

use std::collections::HashMap;
use std::sync::Arc;

use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use crate::absolute::learned::{LearnedConfig, LearnedPositionalEncoding};
use crate::absolute::sinusoidal::{SinusoidalConfig, SinusoidalPositionalEncoding};
use crate::checkpoint::{json_entry, read_json_entry, ENCODING_KEY};
use crate::error::Result;
use crate::plug::PositionalEncoding;
use crate::relative::alibi::{Alibi, AlibiConfig};
use crate::relative::clipped_bias::{ClippedBiasConfig, ClippedRelativeBias};
use crate::relative::shaw::{ShawConfig, ShawRelativePosition};
use crate::relative::t5::{T5Config, T5RelativeBias};
use crate::rotary::mixed::{RopeMixed, RopeMixedConfig};
use crate::rotary::{RopeConfig, RotaryEmbedding};

/// The configuration of any encoding in the crate.
///
/// Serialised (serde) as one object tagged by `kind` ([`EncodingConfig::kind`]), with the
/// encoding's configuration beside it, e.g. as JSON `{"kind": "none"}` or
/// `{"kind": "t5", "num_heads": 8, "num_buckets": 32, "max_distance": 128, "bidirectional": true}`.
///
/// # Example
/// An encoding chosen in a JSON file, built with its learned tables:
/// ```
/// use candle_core::{DType, Device};
/// use candle_nn::{VarBuilder, VarMap};
/// use candle_posenc::EncodingConfig;
///
/// let config: EncodingConfig = serde_json::from_str(r#"{"kind": "t5", "num_heads": 8}"#)?;
/// assert_eq!(config.kind(), "t5");
/// let varmap = VarMap::new();
/// let encoding = config.build(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
/// assert!(encoding.is_some());
/// assert_eq!(varmap.all_vars().len(), 1); // the (32 buckets × 8 heads) table
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
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
    /// [`RotaryEmbedding`].
    Rotary(RopeConfig),
    /// [`RopeMixed`]: learned per-head 2-D rotary frequencies.
    RopeMixed(RopeMixedConfig),
}

impl EncodingConfig {
    /// A short name for the kind: `none`, `sinusoidal`, `learned`, `alibi`, `t5`,
    /// `clipped_bias`, `shaw`, `rotary`, `rope_mixed`.
    pub fn kind(&self) -> &'static str {
        match self {
            EncodingConfig::None => "none",
            EncodingConfig::Sinusoidal(_) => "sinusoidal",
            EncodingConfig::Learned(_) => "learned",
            EncodingConfig::Alibi(_) => "alibi",
            EncodingConfig::T5(_) => "t5",
            EncodingConfig::ClippedBias(_) => "clipped_bias",
            EncodingConfig::Shaw(_) => "shaw",
            EncodingConfig::Rotary(_) => "rotary",
            EncodingConfig::RopeMixed(_) => "rope_mixed",
        }
    }

    /// Checks the encoding's configuration (a no-op for [`EncodingConfig::None`]).
    ///
    /// # Errors
    /// [`crate::Error::InvalidConfig`] from the configuration's own `validate`.
    pub fn validate(&self) -> Result<()> {
        match self {
            EncodingConfig::None => Ok(()),
            EncodingConfig::Sinusoidal(c) => c.validate(),
            EncodingConfig::Learned(c) => c.validate(),
            EncodingConfig::Alibi(c) => c.validate(),
            EncodingConfig::T5(c) => c.validate(),
            EncodingConfig::ClippedBias(c) => c.validate(),
            EncodingConfig::Shaw(c) => c.validate(),
            EncodingConfig::Rotary(c) => c.validate(),
            EncodingConfig::RopeMixed(c) => c.validate(),
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
            EncodingConfig::Sinusoidal(c) => {
                Some(Arc::new(SinusoidalPositionalEncoding::new(c, vb.device())?))
            }
            EncodingConfig::Learned(c) => Some(Arc::new(LearnedPositionalEncoding::new(c, vb)?)),
            EncodingConfig::Alibi(c) if c.learnable => Some(Arc::new(Alibi::new_learnable(c, vb)?)),
            EncodingConfig::Alibi(c) => Some(Arc::new(Alibi::new(c, vb.device())?)),
            EncodingConfig::T5(c) => Some(Arc::new(T5RelativeBias::new(c, vb)?)),
            EncodingConfig::ClippedBias(c) => Some(Arc::new(ClippedRelativeBias::new(c, vb)?)),
            EncodingConfig::Shaw(c) => Some(Arc::new(ShawRelativePosition::new(c, vb)?)),
            EncodingConfig::Rotary(c) => Some(Arc::new(RotaryEmbedding::new(c, vb.device())?)),
            EncodingConfig::RopeMixed(c) => Some(Arc::new(RopeMixed::new(c, vb)?)),
        })
    }

    /// The configuration as checkpoint metadata: one entry, [`ENCODING_KEY`] → this
    /// configuration as JSON.
    pub fn to_metadata(&self) -> HashMap<String, String> {
        json_entry(ENCODING_KEY, self)
    }

    /// Reads the configuration that [`Self::to_metadata`] wrote and validates it.
    ///
    /// # Errors
    /// [`crate::Error::Checkpoint`] naming [`ENCODING_KEY`] when it is missing or its value is
    /// not the JSON of a configuration (malformed, an unknown `kind` — the message lists the
    /// kinds —, a missing or unknown field, a value of the wrong type);
    /// [`crate::Error::InvalidConfig`] if the values are out of range.
    pub fn from_metadata(metadata: &HashMap<String, String>, source: &str) -> Result<Self> {
        let config: Self = read_json_entry(metadata, source, ENCODING_KEY)?;
        config.validate()?;
        Ok(config)
    }
}
