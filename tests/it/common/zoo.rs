//! Every encoding of the crate in a few configurations, for tests that must cover them all.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_posenc::{
    AlibiConfig, AlibiMode, AttentionConfig, ClippedBiasConfig, EncodingConfig, FoxConfig,
    InklingConfig, LearnedConfig, LogScaling, MultiHeadAttention, RopeConfig, RopeKernel,
    RopeLayout, RopeScaling, ScaledSinusoidalConfig, ShawConfig, SinusoidalConfig, T5Config,
    YarnScaling,
};

/// Positions the learned table covers (tests keep their positions below it).
pub const LEARNED_LEN: usize = 1100;

/// The configurations: none, sinusoidal and learned, RoPE plain / interleaved + partial + YaRN /
/// Llama 3 + ops kernel / xPos, ALiBi in its three modes, T5 causal and bidirectional, the
/// clipped bias, Shaw keys + values, and the scaled sinusoid (last: tests pick others by index).
/// `head_dim` must be even and at least 4.
pub fn configs(d_model: usize, num_heads: usize, head_dim: usize) -> Vec<EncodingConfig> {
    let rope = RopeConfig::new(head_dim);
    vec![
        EncodingConfig::None,
        EncodingConfig::Sinusoidal(SinusoidalConfig::new(d_model).with_dropout(0.0)),
        EncodingConfig::Learned(
            LearnedConfig::new(d_model)
                .with_max_len(LEARNED_LEN)
                .with_dropout(0.0),
        ),
        EncodingConfig::Rotary(rope.clone()),
        EncodingConfig::Rotary(
            rope.clone()
                .with_layout(RopeLayout::Interleaved)
                .with_rotary_dim(head_dim - 2)
                .with_scaling(RopeScaling::Yarn(YarnScaling::new(4.0, 64))),
        ),
        EncodingConfig::Rotary(rope.clone().with_kernel(RopeKernel::Ops).with_scaling(
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 64,
            },
        )),
        EncodingConfig::Rotary(rope.with_xpos(512.0)),
        EncodingConfig::Alibi(AlibiConfig::new(num_heads)),
        EncodingConfig::Alibi(AlibiConfig::new(num_heads).with_mode(AlibiMode::CausalPairwise)),
        EncodingConfig::Alibi(AlibiConfig::new(num_heads).with_mode(AlibiMode::Symmetric)),
        EncodingConfig::T5(T5Config::new(num_heads).with_bidirectional(false)),
        EncodingConfig::T5(T5Config::new(num_heads)),
        EncodingConfig::ClippedBias(ClippedBiasConfig::new(num_heads, 4)),
        EncodingConfig::Shaw(ShawConfig::new(head_dim, 3).with_values(true)),
        EncodingConfig::ScaledSinusoidal(ScaledSinusoidalConfig::new(d_model)),
        // Both halves of the gates: causal and bidirectional blocks alike.
        EncodingConfig::Fox(FoxConfig::new(d_model, num_heads).with_bidirectional(true)),
        // Inkling's mixed rows: a bank narrower than the tests' sequences (keys past it get
        // no bias), log-n scaling from position 4.
        EncodingConfig::Inkling(
            InklingConfig::new(d_model, num_heads)
                .with_d_rel(3)
                .with_rel_extent(6)
                .with_log_scaling(Some(LogScaling {
                    n_floor: 4,
                    alpha: 0.1,
                })),
        ),
    ]
}

/// RoPE at head dimension 16 in the forms a rotation kernel must handle: both pair layouts,
/// partial rotary with each, and xPos.
pub fn rope_variants() -> [RopeConfig; 5] {
    [
        RopeConfig::new(16),
        RopeConfig::new(16).with_layout(RopeLayout::Interleaved),
        RopeConfig::new(16).with_rotary_dim(6),
        RopeConfig::new(16)
            .with_rotary_dim(10)
            .with_layout(RopeLayout::Interleaved),
        RopeConfig::new(16).with_xpos(32.0),
    ]
}

/// A short label for a configuration (its kind and index in [`configs`]).
pub fn label(i: usize, c: &EncodingConfig) -> String {
    format!("#{i} {}", c.kind())
}

/// Attention with the encoding built from `config`; weights (and learned tables) are drawn at
/// random into a fresh `VarMap`, in `dtype`, which is returned with the block. The block holds
/// plain copies of the variables (as a model loaded from a checkpoint does), so its inference
/// takes the fast paths; train through the `VarMap` with [`attention_from`]'s block.
pub fn attention(
    config: &EncodingConfig,
    attn: &AttentionConfig,
    dtype: DType,
    device: &Device,
) -> anyhow::Result<(MultiHeadAttention, VarMap)> {
    let varmap = VarMap::new();
    let vb = super::seeded_vb(&varmap, dtype, device);
    let enc = config.build(vb.pp("enc"))?;
    MultiHeadAttention::new(attn, enc, vb.pp("attn"))?;
    // Randomise the learned tables that a VarMap creates as zeros or constants.
    for var in super::sorted_vars(&varmap) {
        let noise = super::randn(0f32, 0.5, var.shape(), device)?.to_dtype(var.dtype())?;
        var.set(&(var.as_tensor() + noise)?)?;
    }
    let mha = attention_from(config, attn, &varmap, dtype, device)?;
    Ok((mha, varmap))
}

/// The variables of `varmap` by name, as the tensors they hold (still tracked).
pub fn named_tensors(varmap: &VarMap) -> anyhow::Result<Vec<(String, Tensor)>> {
    let mut named: Vec<(String, Tensor)> = varmap
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("a VarMap's lock was poisoned"))?
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
        .collect();
    // In name order: draws made per tensor go to the same one on every run.
    named.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(named)
}

/// The same block with plain (untracked) copies of the weights of `varmap`, converted to
/// `dtype`.
pub fn attention_from(
    config: &EncodingConfig,
    attn: &AttentionConfig,
    varmap: &VarMap,
    dtype: DType,
    device: &Device,
) -> anyhow::Result<MultiHeadAttention> {
    let tensors: HashMap<String, Tensor> = named_tensors(varmap)?
        .into_iter()
        .map(|(k, t)| (k, t.detach()))
        .collect();
    let vb = VarBuilder::from_tensors(tensors, dtype, device);
    let enc = config.build(vb.pp("enc"))?;
    Ok(MultiHeadAttention::new(attn, enc, vb.pp("attn"))?)
}
