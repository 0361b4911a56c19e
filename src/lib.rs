//! # candle-posenc
//!
//! Transformer positional encodings for [candle](https://github.com/huggingface/candle), plus a
//! multi-head attention block that consumes any of them through one plug.
//!
//! | encoding | type | enters attention as |
//! |---|---|---|
//! | sinusoidal (Vaswani et al. 2017) | [`SinusoidalPositionalEncoding`] | added to the input |
//! | learned absolute, optional linear interpolation | [`LearnedPositionalEncoding`] | added to the input |
//! | RoPE (Su et al. 2021): both pair layouts, partial rotary, Linear / NTK / Dynamic / YaRN / Llama 3 / LongRoPE / proportional scaling, xPos, multimodal M-RoPE, axial 2-D | [`RotaryEmbedding`] | rotation of q and k |
//! | ALiBi (Press et al. 2022) | [`Alibi`] | bias on the logits |
//! | T5 bucketed bias (Raffel et al. 2020) | [`T5RelativeBias`] | bias on the logits |
//! | clipped relative bias | [`ClippedRelativeBias`] | bias on the logits |
//! | Shaw relative keys and values (Shaw et al. 2018) | [`ShawRelativePosition`] | bias on the logits and term on the values |
//!
//! The plug ([`plug`]) is [`PositionalEncoding`]: four hooks (input, rotation, logits bias,
//! value term), each a no-op by default, each given an [`AttentionContext`] (positions of the
//! queries and keys, the key count, causality, training). Encodings answer with data: a bias
//! is a dense tensor or rows per clamped distance ([`LogitsBias`], [`RelativeBias`]), a value
//! term a table row per clamped distance ([`RelativeValues`]). [`MultiHeadAttention`] decides how
//! each form is consumed on each of its execution paths, with causal and padding masks,
//! grouped KV heads, sliding windows, logit soft caps, sink logits, query/key RMS norms and a
//! [`KvCache`]. Positions are a value of their own, [`Positions`]: an offset or explicit
//! per-token ids.
//!
//! [`hf::HfAttentionConfig`] reads a model's attention layer from its HF `config.json` (per
//! layer where layers differ) and loads it from safetensors under HF's own names, each family
//! checked against HF transformers' own module. The `model_type`s it reads
//! ([`hf::model_types`]): <!-- model_types -->`llama`, `mistral`, `ministral`, `starcoder2`,
//! `qwen2`, `qwen3`, `gemma`, `gemma2`, `gemma3_text`, `olmo2`, `gpt_oss`, `smollm3`, `cohere2`,
//! `llama4_text`, `gemma4_text`, `pixtral`, `qwen2_vl_text`, `qwen2_5_vl_text`, `qwen3_vl_text`,
//! `qwen3_vl_moe_text`, `phi3`, `gpt_neox`, `bloom`, `gpt2`, `gptj`, `falcon`, `t5`, `mpt`,
//! `modernbert`, `deepseek_v2`, `deepseek_v3`, `kimi_k2`, `codegen`, `cohere`, `glm`, `glm4`,
//! `helium`, `ernie4_5`, `inkling_text`, `phi4_multimodal`, the vision encoders `qwen2_vl_vision`,
//! `qwen2_5_vl_vision`, `qwen3_vl_vision`, `qwen3_vl_moe_vision`, `gemma4_vision`, and the
//! vision-language models
//! `qwen2_vl`, `qwen2_5_vl`, `qwen3_vl`, `qwen3_vl_moe`, `llama4`, `gemma4` (their language
//! model).
//! <!-- /model_types -->
//!
//! The block attends over blocks of queries (each with an exact softmax over the keys it can
//! see), sized automatically from [`AttentionConfig::logits_budget`] or fixed with
//! [`AttentionConfig::query_block`], so long sequences run in bounded memory. On the CPU in f32
//! inference, each head's tile of queries runs both products, bias, masks and softmax while
//! its logits stay in cache, reading relative biases and values as their rows rather than as
//! `(B, H, T, T)` tensors.
//!
//! ```
//! use std::sync::Arc;
//! use candle_core::{Device, DType, Tensor};
//! use candle_nn::{VarBuilder, VarMap};
//! use candle_posenc::{AttentionConfig, AttentionOptions, KvCache, MultiHeadAttention,
//!     SinusoidalConfig, SinusoidalPositionalEncoding};
//!
//! let dev = Device::Cpu;
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
//! let pe = SinusoidalPositionalEncoding::new(&SinusoidalConfig::new(64), &dev)?;
//! let attn = MultiHeadAttention::new(
//!     &AttentionConfig::new(64, 8).with_kv_heads(2).with_causal(true),
//!     Some(Arc::new(pe)),
//!     vb.pp("self_attn"),
//! )?;
//! // Decode token by token: positions continue from the cache.
//! let x = Tensor::randn(0f32, 1.0, (1, 4, 64), &dev)?;
//! let mut cache = KvCache::new();
//! for t in 0..4 {
//!     let step = attn.forward_with(&x.narrow(1, t, 1)?, &AttentionOptions::default(), Some(&mut cache))?;
//!     assert_eq!(step.output.dims(), &[1, 1, 64]);
//! }
//! assert_eq!(cache.len(), 4);
//! # Ok::<(), candle_posenc::Error>(())
//! ```
//!
//! # Bad input, sizes and non-finite values
//!
//! Every input that depends on the caller (shapes, dtypes, positions, configurations,
//! checkpoints, `config.json`) is validated and answered with a typed [`Error`] that names the
//! value and what was expected; library code does not panic on it. Sizes that follow from a
//! configuration are checked against [`limits::max_elements`] with checked arithmetic before
//! anything is allocated. Empty sequences give empty outputs.
//!
//! Non-finite values are never silently replaced: a NaN or ±∞ in an input, a table or an
//! additive mask propagates as NaN/±∞ to every output that depends on it, on every path
//! (including the fused CPU softmax, whose flush of weights below e^-40 of the row's largest
//! applies to finite logits only). A −∞ logit is a valid mask entry with weight 0. Masked keys are not read for
//! their logits, but their values still enter the weighted sum with weight 0, and `0 · NaN` is
//! NaN, as IEEE arithmetic (and PyTorch) has it. Nor do finite values become ±∞ on the crate's
//! side: a factor that multiplies activations past their dtype's range is refused when the block
//! is built, and a cast to a narrower format (a checkpoint read as f16, a bias added to f16
//! logits) is refused, naming the value, where a finite value would not survive it.

pub mod absolute;
pub mod attention;
pub mod checkpoint;
mod cpu;
pub mod cuda;
pub mod encoding;
mod error;
mod graft;
pub mod hf;
pub mod limits;
mod matmul;
pub mod plug;
pub mod positions;
pub mod relative;
pub mod rotary;
// The unit tests draw their random data as the integration tests do: seeded, the same on
// every run.
#[cfg(test)]
#[allow(dead_code)] // the unit tests need only its tensors
#[path = "../tests/it/common/seeded.rs"]
mod seeded;
pub mod vision;

pub use absolute::learned::{Interpolation, LearnedConfig, LearnedPositionalEncoding};
pub use absolute::scaled_sinusoidal::{ScaledSinusoidalConfig, ScaledSinusoidalPositionalEncoding};
pub use absolute::sinusoidal::{SinusoidalConfig, SinusoidalPositionalEncoding};
pub use attention::{
    AttentionConfig, AttentionOptions, AttentionOutput, AttentionTemperature, KvCache,
    LatentConfig, MultiHeadAttention, QkNormConfig, QkNormScope, DEFAULT_LOGITS_BUDGET,
};
pub use checkpoint::Checkpoint;
pub use encoding::EncodingConfig;
pub use error::{Error, Result};
pub use hf::{HfAttentionConfig, HfFamily};
pub use plug::{
    AttentionContext, Columns, Content, Footprint, LogitsBias, PositionalEncoding, RelativeBias,
    RelativeValues, SeparableBias, TokenStates,
};
pub use positions::{PositionIds, Positions};
pub use relative::alibi::{alibi_slopes, Alibi, AlibiConfig, AlibiMode, AlibiSlopes};
pub use relative::clipped_bias::{ClippedBiasConfig, ClippedRelativeBias};
pub use relative::fox::{ForgettingGates, FoxConfig};
pub use relative::inkling::{InklingConfig, InklingRelativeLogits, LogScaling};
pub use relative::shaw::{ShawConfig, ShawRelativePosition};
pub use relative::t5::{T5Config, T5RelativeBias};
pub use relative::{BucketedRelativeBias, RelativeBucketing};
pub use rotary::{
    AxialRope, LongRopeScaling, MropeSection, MropeSegment, QkLayout, RopeConfig, RopeFrequencies,
    RopeKernel, RopeLayout, RopeMixed, RopeMixedConfig, RopeScaling, RotaryEmbedding, YarnScaling,
};

/// The README's Rust snippets, run as doctests so the quickstart cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
