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
//! Adding an encoding to the crate means one new file (its configuration implementing
//! `SchemeConfig`) plus one row in `schemes!` here.

use std::collections::HashMap;
use std::sync::Arc;

use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use crate::absolute::learned::LearnedConfig;
use crate::absolute::scaled_sinusoidal::ScaledSinusoidalConfig;
use crate::absolute::sinusoidal::SinusoidalConfig;
use crate::checkpoint::{json_entry, read_json_entry, ENCODING_KEY};
use crate::error::{check_var_builder, Result};
use crate::plug::{PositionalEncoding, SchemeConfig};
use crate::relative::alibi::AlibiConfig;
use crate::relative::clipped_bias::ClippedBiasConfig;
use crate::relative::fox::FoxConfig;
use crate::relative::inkling::InklingConfig;
use crate::relative::shaw::ShawConfig;
use crate::relative::t5::T5Config;
use crate::rotary::mixed::RopeMixedConfig;
use crate::rotary::RopeConfig;

/// The enum of every scheme from its rows `Variant(Config) = "kind"`: serde tags it by `kind`,
/// [`EncodingConfig::kind`] names it, and the row's configuration validates and builds it.
macro_rules! schemes {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $( $(#[$row:meta])* $variant:ident($config:ty) = $kind:literal, )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(tag = "kind")]
        pub enum $name {
            /// No positional information at all.
            #[serde(rename = "none")]
            None,
            $( $(#[$row])* #[serde(rename = $kind)] $variant($config), )*
        }

        impl $name {
            #[doc = concat!("A short name for the kind, as serialised: `none`", $(", `", $kind, "`",)* ".")]
            pub fn kind(&self) -> &'static str {
                match self {
                    Self::None => "none",
                    $( Self::$variant(_) => $kind, )*
                }
            }

            /// The scheme's configuration (none for [`Self::None`]).
            fn scheme(&self) -> Option<&dyn SchemeConfig> {
                match self {
                    Self::None => None,
                    $( Self::$variant(c) => Some(c), )*
                }
            }
        }
    };
}

schemes! {
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
pub enum EncodingConfig {
        /// [`SinusoidalPositionalEncoding`](crate::absolute::sinusoidal::SinusoidalPositionalEncoding).
        Sinusoidal(SinusoidalConfig) = "sinusoidal",
        /// [`LearnedPositionalEncoding`](crate::absolute::learned::LearnedPositionalEncoding).
        Learned(LearnedConfig) = "learned",
        /// [`Alibi`](crate::relative::alibi::Alibi).
        Alibi(AlibiConfig) = "alibi",
        /// [`T5RelativeBias`](crate::relative::t5::T5RelativeBias).
        T5(T5Config) = "t5",
        /// [`ClippedRelativeBias`](crate::relative::clipped_bias::ClippedRelativeBias).
        ClippedBias(ClippedBiasConfig) = "clipped_bias",
        /// [`ShawRelativePosition`](crate::relative::shaw::ShawRelativePosition).
        Shaw(ShawConfig) = "shaw",
        /// [`RotaryEmbedding`](crate::rotary::RotaryEmbedding).
        Rotary(RopeConfig) = "rotary",
        /// [`RopeMixed`](crate::rotary::mixed::RopeMixed): learned per-head 2-D rotary frequencies.
        RopeMixed(RopeMixedConfig) = "rope_mixed",
        /// [`ScaledSinusoidalPositionalEncoding`](crate::absolute::scaled_sinusoidal::ScaledSinusoidalPositionalEncoding).
        ScaledSinusoidal(ScaledSinusoidalConfig) = "scaled_sinusoidal",
        /// [`ForgettingGates`](crate::relative::fox::ForgettingGates): FoX's forget gates, read
        /// from the block's input.
        Fox(FoxConfig) = "fox",
        /// [`InklingRelativeLogits`](crate::relative::inkling::InklingRelativeLogits): Inkling's
        /// bias per backward distance, mixed per query from the block's input.
        Inkling(InklingConfig) = "inkling",
    }
}

impl EncodingConfig {
    /// Checks the encoding's configuration (a no-op for [`EncodingConfig::None`]).
    ///
    /// # Errors
    /// [`crate::Error::InvalidConfig`] from the configuration's own `validate`.
    pub fn validate(&self) -> Result<()> {
        self.scheme().map_or(Ok(()), SchemeConfig::validate)
    }

    /// Builds the encoding. Learned tables are loaded from (or created in) `vb`, so pass the
    /// prefix the encoding's tensors live under.
    ///
    /// # Errors
    /// [`crate::Error::DType`] for a `VarBuilder` whose dtype is not f32, f64, bf16 or f16,
    /// whatever the scheme (every constructor that takes a `VarBuilder` has this one rule);
    /// the encoding's configuration and loading errors.
    pub fn build(&self, vb: VarBuilder) -> Result<Option<Arc<dyn PositionalEncoding>>> {
        check_var_builder("encoding tables (the VarBuilder's dtype)", &vb)?;
        self.scheme().map(|s| s.build(vb)).transpose()
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
