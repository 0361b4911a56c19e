//! RoPE frequency scaling: the family of HF transformers' `modeling_rope_utils`.
//!
//! Every variant maps `(rotary_dim, base, seq_len)` to the inverse frequencies `inv_freq[i]`,
//! `i < rotary_dim / 2`, and an attention factor that multiplies cos and sin:
//!
//! ```text
//! default      inv_freq[i] = base^(-2i/d)                                   d = rotary_dim
//! Linear       inv_freq[i] = base^(-2i/d) / factor                          (Chen et al. 2023)
//! NtkAware     base' = base · α^(d/(d-2))                                   (bloc97, 2023)
//! Dynamic      base' = base · (factor·s/L − (factor − 1))^(d/(d-2)),  s = max(seq_len, L)
//! Yarn         inv_freq = interp·(1 − γ) + extrap·γ, γ a ramp over the correction range
//!              of beta_fast..beta_slow rotations; attention factor 0.1·ln(factor) + 1
//!              (or the mscale / mscale_all_dim ratio)                       (Peng et al. 2023)
//! Llama3       low frequencies ÷ factor, high kept, a smooth ramp between    (Meta, Llama 3.1)
//! LongRope     inv_freq[i] = 1 / (ext[i] · base^(2i/d)), ext = long_factor past L,
//!              short_factor otherwise; attention factor √(1 + ln(factor)/ln(L))  (Ding et al. 2024)
//! Proportional inv_freq[i] = base^(-2i/d) / factor for i < ⌊p·d⌋/2, else 0: only the
//!              highest-frequency fraction p rotates, the exponent still runs over all of d
//!              (Gemma 4's full-attention layers; unlike partial rotary, d is the whole head)
//! ```
//!
//! Everything is computed in `f64`. One function per variant, as in HF: [`default_inv_freq`],
//! [`linear_inv_freq`], [`ntk_aware_inv_freq`], [`dynamic_ntk_inv_freq`], [`yarn_inv_freq`],
//! [`llama3_inv_freq`], [`longrope_inv_freq`], [`proportional_inv_freq`].

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The largest inverse frequency a table takes: `f64::MAX / 2^53`, about 2.0e292, so that
/// `n · ω` is finite in f64 for every position `n` up to 2^53.
pub const MAX_INV_FREQ: f64 = f64::MAX / 9_007_199_254_740_992.0;

/// Inverse frequencies and the factor that multiplies cos and sin.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeFrequencies {
    /// `rotary_dim / 2` inverse frequencies, highest first.
    pub inv_freq: Vec<f64>,
    /// Multiplies cos and sin (1 except for YaRN and LongRoPE).
    pub attention_factor: f64,
}

impl RopeFrequencies {
    /// Checks that these frequencies give finite f32 tables: every inverse frequency ≥ 0 and at
    /// most [`MAX_INV_FREQ`] (so that the angle `n · ω` is finite at every position up to
    /// 2^53, past which f64 no longer holds positions exactly), the attention factor finite,
    /// positive and within f32's normal range. A scaling whose settings pass one by one can
    /// still fail here (a LongRoPE original length of 1 makes `ln 1 = 0` a divisor; a YaRN
    /// attention factor of 1e300 overflows f32; a linear factor of 1e-300 puts `ω` at 1e300).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the scaling (`scaling`) and the value out of range.
    pub fn check_finite(&self, scaling: &str) -> Result<()> {
        if let Some(bad) = self
            .inv_freq
            .iter()
            .find(|f| !(**f >= 0.0 && **f <= MAX_INV_FREQ))
        {
            return Err(Error::config(
                "rope inverse frequency",
                bad,
                format!(
                    "finite, >= 0 and at most {MAX_INV_FREQ:e}, so that position · frequency is finite up to position 2^53; the {scaling} scaling settings give none"
                ),
            ));
        }
        let a = self.attention_factor;
        if !(a.is_finite() && a >= f32::MIN_POSITIVE as f64 && a <= f32::MAX as f64) {
            return Err(Error::config(
                "rope attention factor",
                a,
                format!("a finite number > 0 within f32's range; the {scaling} scaling settings give none"),
            ));
        }
        Ok(())
    }
}

/// YaRN parameters (Peng et al. 2023, "YaRN: Efficient Context Window Extension").
///
/// Serialised (serde) with its field names (HF's); `factor` and
/// `original_max_position_embeddings` are required, the other fields default as in
/// [`YarnScaling::new`], and the optional ones are written only when set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct YarnScaling {
    /// Context extension factor (HF `factor`).
    pub factor: f64,
    /// Pretraining context length `L` (HF `original_max_position_embeddings`).
    pub original_max_position_embeddings: usize,
    /// Rotations at which the ramp starts extrapolating (default 32).
    #[serde(default = "yarn_defaults::beta_fast")]
    pub beta_fast: f64,
    /// Rotations at which the ramp ends (default 1).
    #[serde(default = "yarn_defaults::beta_slow")]
    pub beta_slow: f64,
    /// DeepSeek-style `mscale` (used with `mscale_all_dim`).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::checkpoint::non_null"
    )]
    pub mscale: Option<f64>,
    /// DeepSeek-style `mscale_all_dim`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::checkpoint::non_null"
    )]
    pub mscale_all_dim: Option<f64>,
    /// Explicit attention factor; overrides the one derived from `factor`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::checkpoint::non_null"
    )]
    pub attention_factor: Option<f64>,
    /// Round the correction range to whole dimensions (default true, as HF).
    #[serde(default = "yarn_defaults::truncate")]
    pub truncate: bool,
}

/// Values of the fields a serialised [`YarnScaling`] leaves out: those of [`YarnScaling::new`].
mod yarn_defaults {
    use super::YarnScaling;

    pub(super) fn beta_fast() -> f64 {
        YarnScaling::new(1.0, 1).beta_fast
    }

    pub(super) fn beta_slow() -> f64 {
        YarnScaling::new(1.0, 1).beta_slow
    }

    pub(super) fn truncate() -> bool {
        YarnScaling::new(1.0, 1).truncate
    }
}

impl YarnScaling {
    /// YaRN with HF's defaults: beta_fast 32, beta_slow 1, no mscale, truncation on.
    pub fn new(factor: f64, original_max_position_embeddings: usize) -> Self {
        Self {
            factor,
            original_max_position_embeddings,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: None,
            mscale_all_dim: None,
            attention_factor: None,
            truncate: true,
        }
    }

    /// Sets `beta_fast` and `beta_slow`.
    pub fn with_betas(mut self, beta_fast: f64, beta_slow: f64) -> Self {
        self.beta_fast = beta_fast;
        self.beta_slow = beta_slow;
        self
    }

    /// Sets DeepSeek's `mscale` and `mscale_all_dim`.
    pub fn with_mscale(mut self, mscale: f64, mscale_all_dim: f64) -> Self {
        self.mscale = Some(mscale);
        self.mscale_all_dim = Some(mscale_all_dim);
        self
    }

    /// Sets the attention factor explicitly.
    pub fn with_attention_factor(mut self, attention_factor: f64) -> Self {
        self.attention_factor = Some(attention_factor);
        self
    }

    /// Turns rounding of the correction range on or off.
    pub fn with_truncate(mut self, truncate: bool) -> Self {
        self.truncate = truncate;
        self
    }
}

/// LongRoPE parameters (Ding et al. 2024; Phi-3's `su` scaling).
///
/// Serialised (serde) with its field names (HF's); every field is required but
/// `attention_factor`, which is written only when set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LongRopeScaling {
    /// Per-frequency rescale factors used up to `original_max_position_embeddings`.
    pub short_factor: Vec<f64>,
    /// Per-frequency rescale factors used past it.
    pub long_factor: Vec<f64>,
    /// Pretraining context length `L`.
    pub original_max_position_embeddings: usize,
    /// Context extension factor, used only for the default attention factor (HF derives it as
    /// `max_position_embeddings / original_max_position_embeddings` when absent).
    pub factor: f64,
    /// Explicit attention factor; overrides the one derived from `factor`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::checkpoint::non_null"
    )]
    pub attention_factor: Option<f64>,
}

/// How RoPE frequencies are scaled for longer contexts.
///
/// Serialised (serde) as an object tagged by `rope_type`, named as [`RopeScaling::name`] says,
/// with the variant's parameters beside it, e.g. as JSON `{"rope_type": "default"}` or
/// `{"rope_type": "linear", "factor": 4.0}`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "snake_case", deny_unknown_fields)]
pub enum RopeScaling {
    /// Plain RoPE, `inv_freq[i] = base^(-2i/d)`.
    #[default]
    #[serde(rename = "default")]
    None,
    /// Position interpolation: every frequency divided by `factor`.
    Linear {
        /// Interpolation factor (> 0).
        factor: f64,
    },
    /// Static NTK-aware scaling: `base · α^(d/(d−2))`.
    NtkAware {
        /// The NTK `α` (> 0).
        alpha: f64,
    },
    /// Dynamic NTK: the base is recomputed from the current sequence length `s` once it passes
    /// `original_max_position_embeddings`, and is the original below it.
    Dynamic {
        /// Scaling factor (> 0).
        factor: f64,
        /// The length the model was trained at (HF `max_position_embeddings`).
        original_max_position_embeddings: usize,
    },
    /// YaRN.
    Yarn(YarnScaling),
    /// Llama 3.1's frequency-dependent scaling.
    Llama3 {
        /// Division applied to low frequencies (8 in Llama 3.1).
        factor: f64,
        /// Wavelengths longer than `L / low_freq_factor` are fully scaled (1 in Llama 3.1).
        low_freq_factor: f64,
        /// Wavelengths shorter than `L / high_freq_factor` are kept (4 in Llama 3.1). At least
        /// `low_freq_factor`; equal to it (1 and 1 in Llama 4), there is no ramp between.
        high_freq_factor: f64,
        /// Pretraining context length `L` (8192 in Llama 3.1).
        original_max_position_embeddings: usize,
    },
    /// LongRoPE.
    #[serde(rename = "longrope")]
    LongRope(LongRopeScaling),
    /// Proportional RoPE (Gemma 4's full-attention layers): the highest-frequency
    /// `partial_rotary_factor` of the pairs rotate at `base^(-2i/d) / factor` over the whole
    /// rotary dimension `d`, the other pairs have frequency 0 and pass through unrotated.
    Proportional {
        /// Division applied to the rotating frequencies (HF default 1).
        factor: f64,
        /// The fraction of the pairs that rotate, in `[0, 1]` (HF default 1: plain RoPE).
        partial_rotary_factor: f64,
    },
}

impl RopeScaling {
    /// The HF `rope_type` name of this variant (`ntk_aware` has none in HF).
    pub fn name(&self) -> &'static str {
        match self {
            RopeScaling::None => "default",
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::NtkAware { .. } => "ntk_aware",
            RopeScaling::Dynamic { .. } => "dynamic",
            RopeScaling::Yarn(_) => "yarn",
            RopeScaling::Llama3 { .. } => "llama3",
            RopeScaling::LongRope(_) => "longrope",
            RopeScaling::Proportional { .. } => "proportional",
        }
    }

    /// Checks the parameters against a rotary dimension.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a non-positive or non-finite factor, a zero original length,
    /// `low_freq_factor >= high_freq_factor`, LongRoPE lists whose length is not
    /// `rotary_dim / 2`, NTK scaling with `rotary_dim <= 2` (its exponent `d/(d−2)` diverges), or
    /// a proportional fraction outside `[0, 1]`.
    pub fn validate(&self, rotary_dim: usize) -> Result<()> {
        match self {
            RopeScaling::None => Ok(()),
            RopeScaling::Linear { factor } => positive("linear factor", *factor),
            RopeScaling::NtkAware { alpha } => {
                positive("ntk alpha", *alpha)?;
                ntk_dim(rotary_dim)
            }
            RopeScaling::Dynamic {
                factor,
                original_max_position_embeddings,
            } => {
                positive("dynamic factor", *factor)?;
                length(
                    "original_max_position_embeddings",
                    *original_max_position_embeddings,
                )?;
                ntk_dim(rotary_dim)
            }
            RopeScaling::Yarn(y) => validate_yarn(y),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                positive("llama3 factor", *factor)?;
                positive("low_freq_factor", *low_freq_factor)?;
                positive("high_freq_factor", *high_freq_factor)?;
                length(
                    "original_max_position_embeddings",
                    *original_max_position_embeddings,
                )?;
                // Equal factors (Llama 4's published configs) are a step at `L / factor` with
                // no ramp between; HF only warns about them.
                if low_freq_factor > high_freq_factor {
                    return Err(Error::config(
                        "low_freq_factor",
                        low_freq_factor,
                        format!("at most high_freq_factor ({high_freq_factor})"),
                    ));
                }
                Ok(())
            }
            RopeScaling::LongRope(l) => validate_longrope(l, rotary_dim),
            RopeScaling::Proportional {
                factor,
                partial_rotary_factor,
            } => {
                positive("proportional factor", *factor)?;
                if !(0.0..=1.0).contains(partial_rotary_factor) {
                    return Err(Error::config(
                        "partial_rotary_factor",
                        partial_rotary_factor,
                        "a fraction of the pairs in [0, 1]",
                    ));
                }
                Ok(())
            }
        }
    }

    /// The frequencies for a sequence whose positions end at `seq_len` (only `Dynamic` and
    /// `LongRope` look at it).
    ///
    /// # Errors
    /// As [`Self::validate`]; [`Error::InvalidConfig`] for a `rotary_dim` whose frequencies
    /// would pass [`crate::limits::max_elements`] (each f64 counted as two f32 elements).
    pub fn frequencies(
        &self,
        rotary_dim: usize,
        base: f64,
        seq_len: usize,
    ) -> Result<RopeFrequencies> {
        self.validate(rotary_dim)?;
        // The list of rotary_dim / 2 frequencies, in f64: two f32 elements each.
        crate::limits::check_elements(
            "rotary_dim",
            rotary_dim,
            "rotary_dim / 2 f64 frequencies (two f32 elements each)",
            &[rotary_dim / 2, 2],
        )?;
        let plain = |inv_freq| RopeFrequencies {
            inv_freq,
            attention_factor: 1.0,
        };
        let freqs = match self {
            RopeScaling::None => plain(default_inv_freq(rotary_dim, base)),
            RopeScaling::Linear { factor } => plain(linear_inv_freq(rotary_dim, base, *factor)),
            RopeScaling::NtkAware { alpha } => plain(ntk_aware_inv_freq(rotary_dim, base, *alpha)),
            RopeScaling::Dynamic {
                factor,
                original_max_position_embeddings,
            } => plain(dynamic_ntk_inv_freq(
                rotary_dim,
                base,
                *factor,
                *original_max_position_embeddings,
                seq_len,
            )),
            RopeScaling::Yarn(y) => yarn_inv_freq(rotary_dim, base, y),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => plain(llama3_inv_freq(
                rotary_dim,
                base,
                *factor,
                *low_freq_factor,
                *high_freq_factor,
                *original_max_position_embeddings,
            )),
            RopeScaling::LongRope(l) => longrope_inv_freq(rotary_dim, base, l, seq_len),
            RopeScaling::Proportional {
                factor,
                partial_rotary_factor,
            } => plain(proportional_inv_freq(
                rotary_dim,
                base,
                *factor,
                *partial_rotary_factor,
            )),
        };
        freqs.check_finite(self.name())?;
        Ok(freqs)
    }

    /// Whether the frequencies change with the sequence's length (dynamic NTK, LongRoPE).
    pub(crate) fn follows_length(&self) -> bool {
        matches!(self, RopeScaling::Dynamic { .. } | RopeScaling::LongRope(_))
    }

    /// Which table a sequence ending at `seq_len` needs: tables only change with the length for
    /// `Dynamic` (past its original length) and `LongRope` (short or long factors).
    pub(crate) fn regime(&self, seq_len: usize) -> Regime {
        match self {
            RopeScaling::Dynamic {
                original_max_position_embeddings: l,
                ..
            } if seq_len > *l => Regime::Dynamic(seq_len),
            RopeScaling::LongRope(s) if seq_len > s.original_max_position_embeddings => {
                Regime::Long
            }
            _ => Regime::Fixed,
        }
    }
}

/// The length-dependent choice of frequencies a cached table was built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Regime {
    /// The frequencies do not depend on the length (or the length is within the original).
    Fixed,
    /// Dynamic NTK for sequences ending at this length.
    Dynamic(usize),
    /// LongRoPE's long factors.
    Long,
}

impl Regime {
    /// A sequence length that selects this regime.
    pub(crate) fn seq_len(self) -> usize {
        match self {
            Regime::Fixed => 0,
            Regime::Dynamic(s) => s,
            Regime::Long => usize::MAX,
        }
    }
}

/// `base^(-2i/d)` for `i < d/2`.
pub fn default_inv_freq(rotary_dim: usize, base: f64) -> Vec<f64> {
    let d = rotary_dim as f64;
    (0..rotary_dim / 2)
        .map(|i| 1.0 / base.powf((2 * i) as f64 / d))
        .collect()
}

/// Position interpolation: the default frequencies divided by `factor`.
pub fn linear_inv_freq(rotary_dim: usize, base: f64, factor: f64) -> Vec<f64> {
    default_inv_freq(rotary_dim, base)
        .into_iter()
        .map(|w| w / factor)
        .collect()
}

/// Proportional RoPE: the first `⌊p·d⌋ / 2` default frequencies divided by `factor`, the rest
/// 0 (HF computes the count as `int(p · d // 2)`).
pub fn proportional_inv_freq(rotary_dim: usize, base: f64, factor: f64, p: f64) -> Vec<f64> {
    let rotating = ((p * rotary_dim as f64) / 2.0).floor() as usize;
    default_inv_freq(rotary_dim, base)
        .into_iter()
        .enumerate()
        .map(|(i, w)| if i < rotating { w / factor } else { 0.0 })
        .collect()
}

/// Static NTK-aware scaling: the default frequencies for base `base · α^(d/(d−2))`.
pub fn ntk_aware_inv_freq(rotary_dim: usize, base: f64, alpha: f64) -> Vec<f64> {
    let d = rotary_dim as f64;
    default_inv_freq(rotary_dim, base * alpha.powf(d / (d - 2.0)))
}

/// Dynamic NTK: NTK-aware scaling with `α = factor · s / L − (factor − 1)`, `s = max(seq_len, L)`.
pub fn dynamic_ntk_inv_freq(
    rotary_dim: usize,
    base: f64,
    factor: f64,
    original_max_position_embeddings: usize,
    seq_len: usize,
) -> Vec<f64> {
    let l = original_max_position_embeddings as f64;
    let s = seq_len.max(original_max_position_embeddings) as f64;
    ntk_aware_inv_freq(rotary_dim, base, factor * s / l - (factor - 1.0))
}

/// YaRN's `0.1 · m · ln(s) + 1` (1 for `s ≤ 1`).
fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// YaRN: a ramp between interpolated (`÷ factor`) and original frequencies over the dimensions
/// whose wavelengths make between `beta_slow` and `beta_fast` rotations within `L`.
pub fn yarn_inv_freq(rotary_dim: usize, base: f64, y: &YarnScaling) -> RopeFrequencies {
    let d = rotary_dim as f64;
    let l = y.original_max_position_embeddings as f64;
    let attention_factor = match (y.attention_factor, y.mscale, y.mscale_all_dim) {
        (Some(a), _, _) => a,
        (None, Some(m), Some(m_all)) if m != 0.0 && m_all != 0.0 => {
            yarn_mscale(y.factor, m) / yarn_mscale(y.factor, m_all)
        }
        _ => yarn_mscale(y.factor, 1.0),
    };
    // The dimension whose wavelength makes `rotations` turns over `L`.
    let correction_dim = |rotations: f64| {
        d * (l / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
    };
    let (mut low, mut high) = (correction_dim(y.beta_fast), correction_dim(y.beta_slow));
    if y.truncate {
        low = low.floor();
        high = high.ceil();
    }
    let low = low.max(0.0);
    let mut high = high.min(d - 1.0);
    if low == high {
        high += 0.001;
    }
    let inv_freq = default_inv_freq(rotary_dim, base)
        .into_iter()
        .enumerate()
        .map(|(i, extrapolated)| {
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let keep = 1.0 - ramp;
            extrapolated / y.factor * (1.0 - keep) + extrapolated * keep
        })
        .collect();
    RopeFrequencies {
        inv_freq,
        attention_factor,
    }
}

/// Llama 3.1: wavelengths above `L / low_freq_factor` divided by `factor`, below
/// `L / high_freq_factor` kept, and a linear blend (in `L / wavelength`) between.
pub fn llama3_inv_freq(
    rotary_dim: usize,
    base: f64,
    factor: f64,
    low_freq_factor: f64,
    high_freq_factor: f64,
    original_max_position_embeddings: usize,
) -> Vec<f64> {
    let l = original_max_position_embeddings as f64;
    let low_freq_wavelen = l / low_freq_factor;
    let high_freq_wavelen = l / high_freq_factor;
    default_inv_freq(rotary_dim, base)
        .into_iter()
        .map(|w| {
            let wavelen = 2.0 * std::f64::consts::PI / w;
            if wavelen < high_freq_wavelen {
                w
            } else if wavelen > low_freq_wavelen {
                w / factor
            } else if low_freq_factor == high_freq_factor {
                // Equal factors: the ramp is one wavelength wide, and HF's formula for it
                // divides 0 by 0 there; the step keeps the frequency, as for shorter waves.
                w
            } else {
                let smooth = (l / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                (1.0 - smooth) * w / factor + smooth * w
            }
        })
        .collect()
}

/// LongRoPE: `1 / (ext[i] · base^(2i/d))` with the long factors past `L`, short ones otherwise.
pub fn longrope_inv_freq(
    rotary_dim: usize,
    base: f64,
    s: &LongRopeScaling,
    seq_len: usize,
) -> RopeFrequencies {
    let l = s.original_max_position_embeddings as f64;
    let attention_factor = s.attention_factor.unwrap_or(if s.factor <= 1.0 {
        1.0
    } else {
        (1.0 + s.factor.ln() / l.ln()).sqrt()
    });
    let ext = if seq_len > s.original_max_position_embeddings {
        &s.long_factor
    } else {
        &s.short_factor
    };
    let inv_freq = default_inv_freq(rotary_dim, base)
        .into_iter()
        .zip(ext)
        .map(|(w, e)| w / e)
        .collect();
    RopeFrequencies {
        inv_freq,
        attention_factor,
    }
}

/// A factor: finite, normal and > 0 (subnormal factors are refused too: their reciprocals
/// overflow).
fn positive(name: &'static str, v: f64) -> Result<()> {
    if v.is_normal() && v > 0.0 {
        Ok(())
    } else {
        Err(Error::config(name, v, "a finite, normal number > 0"))
    }
}

/// A length > 0.
fn length(name: &'static str, v: usize) -> Result<()> {
    if v == 0 {
        Err(Error::config(name, v, "a length > 0"))
    } else {
        Ok(())
    }
}

/// NTK scaling's exponent d/(d−2) needs more than 2 rotated features.
fn ntk_dim(rotary_dim: usize) -> Result<()> {
    if rotary_dim <= 2 {
        Err(Error::config(
            "rotary_dim",
            rotary_dim,
            "more than 2 for NTK scaling (its exponent is d/(d-2))",
        ))
    } else {
        Ok(())
    }
}

/// YaRN's factors and original length.
fn validate_yarn(y: &YarnScaling) -> Result<()> {
    positive("yarn factor", y.factor)?;
    length(
        "original_max_position_embeddings",
        y.original_max_position_embeddings,
    )?;
    positive("beta_fast", y.beta_fast)?;
    positive("beta_slow", y.beta_slow)?;
    for (name, v) in [
        ("mscale", y.mscale),
        ("mscale_all_dim", y.mscale_all_dim),
        ("attention_factor", y.attention_factor),
    ] {
        if let Some(v) = v {
            positive(name, v)?;
        }
    }
    Ok(())
}

/// LongRoPE's length, factors, and its two lists of `rotary_dim / 2` positive factors.
fn validate_longrope(l: &LongRopeScaling, rotary_dim: usize) -> Result<()> {
    length(
        "original_max_position_embeddings",
        l.original_max_position_embeddings,
    )?;
    positive("longrope factor", l.factor)?;
    if let Some(a) = l.attention_factor {
        positive("attention_factor", a)?;
    }
    for (name, list) in [
        ("short_factor", &l.short_factor),
        ("long_factor", &l.long_factor),
    ] {
        if list.len() != rotary_dim / 2 {
            return Err(Error::config(
                name,
                format!("a list of {} numbers", list.len()),
                format!("rotary_dim / 2 = {} numbers", rotary_dim / 2),
            ));
        }
        if let Some(bad) = list.iter().find(|v| !(v.is_finite() && **v > 0.0)) {
            return Err(Error::config(name, bad, "entries that are finite and > 0"));
        }
    }
    Ok(())
}
