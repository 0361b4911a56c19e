//! [`EncodingConfig`]: every encoding's configuration under one enum, for building an encoding
//! by name and for self-describing checkpoints.
//!
//! Adding an encoding to the crate means one new file plus one arm here.

use std::collections::HashMap;
use std::sync::Arc;

use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use crate::absolute::learned::{Interpolation, LearnedConfig, LearnedPositionalEncoding};
use crate::absolute::sinusoidal::{SinusoidalConfig, SinusoidalPositionalEncoding};
use crate::attention::PositionalEncoding;
use crate::checkpoint::MetadataReader;
use crate::relative::alibi::{Alibi, AlibiConfig, AlibiMode};
use crate::relative::clipped_bias::{ClippedBiasConfig, ClippedRelativeBias};
use crate::relative::shaw::{ShawConfig, ShawRelativePosition};
use crate::relative::t5::{T5Config, T5RelativeBias};
use crate::rotary::{
    LongRopeScaling, RopeConfig, RopeKernel, RopeLayout, RopeScaling, RotaryEmbedding, YarnScaling,
};
use crate::Result;

/// Metadata key naming the encoding kind.
pub const KIND_KEY: &str = "posenc.kind";

/// The configuration of any encoding in the crate.
///
/// Serialised (serde) as one object tagged by `kind` ([`EncodingConfig::kind`]), with the
/// encoding's configuration beside it, e.g. as JSON `{"kind": "none"}` or
/// `{"kind": "t5", "num_heads": 8, "num_buckets": 32, "max_distance": 128, "bidirectional": true}`.
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
}

impl EncodingConfig {
    /// A short name for the kind: `none`, `sinusoidal`, `learned`, `alibi`, `t5`,
    /// `clipped_bias`, `shaw`, `rotary`.
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
            EncodingConfig::Rotary(c) => rope_metadata(c, &mut put),
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
            "rotary" => {
                let c = rope_from_metadata(&r)?;
                c.validate()?;
                EncodingConfig::Rotary(c)
            }
            other => {
                return Err(r.error(
                    KIND_KEY,
                    format!(
                        "unknown encoding `{other}`, expected none, sinusoidal, learned, alibi, t5, clipped_bias, shaw or rotary"
                    ),
                ))
            }
        };
        Ok(config)
    }
}

/// Writes a rotary configuration as `posenc.*` entries (lists comma-separated).
fn rope_metadata(c: &RopeConfig, put: &mut impl FnMut(&str, String)) {
    put("head_dim", c.head_dim.to_string());
    put("rotary_dim", c.rotary_dim.to_string());
    put("base", c.base.to_string());
    let layout = match c.layout {
        RopeLayout::Half => "half",
        RopeLayout::Interleaved => "interleaved",
    };
    put("layout", layout.to_string());
    put("max_position", c.max_position.to_string());
    if let Some(g) = c.xpos_scale_base {
        put("xpos_scale_base", g.to_string());
    }
    let kernel = match c.kernel {
        RopeKernel::Fused => "fused",
        RopeKernel::Ops => "ops",
    };
    put("kernel", kernel.to_string());
    put("scaling", c.scaling.name().to_string());
    let list = |v: &[f64]| v.iter().map(f64::to_string).collect::<Vec<_>>().join(",");
    match &c.scaling {
        RopeScaling::None => {}
        RopeScaling::Linear { factor } => put("scaling.factor", factor.to_string()),
        RopeScaling::NtkAware { alpha } => put("scaling.alpha", alpha.to_string()),
        RopeScaling::Dynamic {
            factor,
            original_max_position_embeddings,
        } => {
            put("scaling.factor", factor.to_string());
            put(
                "scaling.original_max_position_embeddings",
                original_max_position_embeddings.to_string(),
            );
        }
        RopeScaling::Yarn(y) => {
            put("scaling.factor", y.factor.to_string());
            put(
                "scaling.original_max_position_embeddings",
                y.original_max_position_embeddings.to_string(),
            );
            put("scaling.beta_fast", y.beta_fast.to_string());
            put("scaling.beta_slow", y.beta_slow.to_string());
            put("scaling.truncate", y.truncate.to_string());
            for (k, v) in [
                ("mscale", y.mscale),
                ("mscale_all_dim", y.mscale_all_dim),
                ("attention_factor", y.attention_factor),
            ] {
                if let Some(v) = v {
                    put(&format!("scaling.{k}"), v.to_string());
                }
            }
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            put("scaling.factor", factor.to_string());
            put("scaling.low_freq_factor", low_freq_factor.to_string());
            put("scaling.high_freq_factor", high_freq_factor.to_string());
            put(
                "scaling.original_max_position_embeddings",
                original_max_position_embeddings.to_string(),
            );
        }
        RopeScaling::LongRope(l) => {
            put("scaling.factor", l.factor.to_string());
            put(
                "scaling.original_max_position_embeddings",
                l.original_max_position_embeddings.to_string(),
            );
            put("scaling.short_factor", list(&l.short_factor));
            put("scaling.long_factor", list(&l.long_factor));
            if let Some(a) = l.attention_factor {
                put("scaling.attention_factor", a.to_string());
            }
        }
    }
}

/// Reads what [`rope_metadata`] wrote.
fn rope_from_metadata(r: &MetadataReader) -> Result<RopeConfig> {
    let num = |k: &str| r.parse::<f64>(&format!("posenc.{k}"), "a number");
    let opt_num = |k: &str| -> Result<Option<f64>> {
        let key = format!("posenc.{k}");
        match r.metadata.contains_key(&key) {
            true => r.parse::<f64>(&key, "a number").map(Some),
            false => Ok(None),
        }
    };
    let uint = |k: &str| r.parse::<usize>(&format!("posenc.{k}"), "a non-negative integer");
    let list = |k: &str| -> Result<Vec<f64>> {
        let key = format!("posenc.{k}");
        let raw = r.str(&key)?;
        raw.split(',')
            .map(|x| x.trim().parse::<f64>())
            .collect::<std::result::Result<_, _>>()
            .map_err(|_| {
                r.error(
                    &key,
                    format!("`{raw}` is not a comma-separated list of numbers"),
                )
            })
    };
    let layout = match r.str("posenc.layout")? {
        "half" => RopeLayout::Half,
        "interleaved" => RopeLayout::Interleaved,
        other => {
            return Err(r.error(
                "posenc.layout",
                format!("`{other}` is not half or interleaved"),
            ))
        }
    };
    let kernel = match r.str("posenc.kernel")? {
        "fused" => RopeKernel::Fused,
        "ops" => RopeKernel::Ops,
        other => return Err(r.error("posenc.kernel", format!("`{other}` is not fused or ops"))),
    };
    let orig = "scaling.original_max_position_embeddings";
    let scaling = match r.str("posenc.scaling")? {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: num("scaling.factor")?,
        },
        "ntk_aware" => RopeScaling::NtkAware {
            alpha: num("scaling.alpha")?,
        },
        "dynamic" => RopeScaling::Dynamic {
            factor: num("scaling.factor")?,
            original_max_position_embeddings: uint(orig)?,
        },
        "yarn" => RopeScaling::Yarn(YarnScaling {
            factor: num("scaling.factor")?,
            original_max_position_embeddings: uint(orig)?,
            beta_fast: num("scaling.beta_fast")?,
            beta_slow: num("scaling.beta_slow")?,
            mscale: opt_num("scaling.mscale")?,
            mscale_all_dim: opt_num("scaling.mscale_all_dim")?,
            attention_factor: opt_num("scaling.attention_factor")?,
            truncate: r.parse("posenc.scaling.truncate", "true or false")?,
        }),
        "llama3" => RopeScaling::Llama3 {
            factor: num("scaling.factor")?,
            low_freq_factor: num("scaling.low_freq_factor")?,
            high_freq_factor: num("scaling.high_freq_factor")?,
            original_max_position_embeddings: uint(orig)?,
        },
        "longrope" => RopeScaling::LongRope(LongRopeScaling {
            short_factor: list("scaling.short_factor")?,
            long_factor: list("scaling.long_factor")?,
            original_max_position_embeddings: uint(orig)?,
            factor: num("scaling.factor")?,
            attention_factor: opt_num("scaling.attention_factor")?,
        }),
        other => {
            return Err(r.error(
                "posenc.scaling",
                format!(
                "`{other}` is not default, linear, ntk_aware, dynamic, yarn, llama3 or longrope"
            ),
            ))
        }
    };
    Ok(RopeConfig {
        head_dim: uint("head_dim")?,
        rotary_dim: uint("rotary_dim")?,
        base: num("base")?,
        layout,
        scaling,
        max_position: uint("max_position")?,
        xpos_scale_base: opt_num("xpos_scale_base")?,
        kernel,
    })
}
