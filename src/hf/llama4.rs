//! Llama 4 (`llama4_text`): what `Llama4TextAttention` (transformers 5.24) does beyond a
//! Llama layer.
//!
//! - Chunked attention on its RoPE layers (`attention_chunk_size`, or `layer_types`), full
//!   attention on its NoPE layers (`no_rope_layers`).
//! - `use_qk_norm`: an L2 norm of q and k without a scale, on the RoPE layers only, after the
//!   rotation.
//! - Attention temperature on the NoPE layers (`attn_temperature_tuning`, `attn_scale`,
//!   `floor_scale`).

use serde_json::Value;

use super::json::{problem, Obj};
use super::layer::Keys;
use super::pattern::{layer_entry, uses_rope, LayerKind};
use super::registry::ModelSpec;
use crate::attention::{AttentionConfig, AttentionTemperature, QkNormConfig};
use crate::error::Result;
use crate::rotary::scaling::RopeScaling;
use crate::rotary::RopeConfig;

/// A Llama 4 layer: chunked attention (`attention_chunk_size`, 8192 by default) on its RoPE
/// layers, full attention on its NoPE layers, or as `layer_types` says.
pub(super) fn layer_kind(top: &Obj, spec: &ModelSpec, layer: usize) -> Result<LayerKind> {
    let chunked = match layer_entry(top, "layer_types", layer, "a list of layer types")? {
        Some(entry) => match entry.as_str() {
            Some("full_attention") => false,
            Some("chunked_attention") => true,
            _ => {
                return Err(problem(
                    "layer_types",
                    format!("gives layer {layer} the type {entry}, expected full_attention or chunked_attention"),
                ))
            }
        },
        None => uses_rope(top, spec, layer)?,
    };
    if !chunked {
        return Ok(LayerKind::Full);
    }
    // An explicit null is not the default: without `layer_types` HF's class then makes every
    // layer a full-attention one; with them, its chunked mask has no size.
    let size = match top.map.get("attention_chunk_size") {
        None => 8192,
        Some(Value::Null) if top.get("layer_types").is_none() => return Ok(LayerKind::Full),
        Some(_) => top.usize("attention_chunk_size")?.ok_or_else(|| {
            problem(
                "attention_chunk_size",
                format!("is null, but layer {layer} has chunked attention"),
            )
        })?,
    };
    Ok(LayerKind::Chunked(size))
}

/// The L2 norm of q and k (no scale) on a RoPE layer under `use_qk_norm` (default true).
pub(super) fn qk_norm(top: &Obj, spec: &ModelSpec, layer: usize) -> Result<Option<QkNormConfig>> {
    if !(top.bool("use_qk_norm")?.unwrap_or(true) && uses_rope(top, spec, layer)?) {
        return Ok(None);
    }
    Ok(Some(
        QkNormConfig::new()
            .with_learned_scale(false)
            .with_eps(top.f64("rms_norm_eps")?.unwrap_or(1e-5)),
    ))
}

/// The temperature tuning of a NoPE layer under `attn_temperature_tuning` (default true).
pub(super) fn temperature(
    top: &Obj,
    spec: &ModelSpec,
    layer: usize,
    attention: AttentionConfig,
    keys: &mut Keys,
) -> Result<AttentionConfig> {
    if !top.bool("attn_temperature_tuning")?.unwrap_or(true) || uses_rope(top, spec, layer)? {
        return Ok(attention);
    }
    keys.set("attention_temperature.attn_scale", "attn_scale");
    keys.set("attention_temperature.floor_scale", "floor_scale");
    Ok(
        attention.with_attention_temperature(Some(AttentionTemperature::new(
            top.f64("attn_scale")?.unwrap_or(0.1),
            top.usize("floor_scale")?.unwrap_or(8192),
        ))),
    )
}

/// Takes the RoPE type's attention factor back out where the q/k norm follows the rotation.
///
/// Llama 4 scales its rotation by the factor s and then L2-normalises q and k
/// (modeling_llama4.py), which takes s back out: norm(s·R q) = R q / sqrt(mean(q²) + ε/s²), a
/// rotation is norm-preserving. The block normalises before rotating, so the same is a norm
/// with ε/s² and a rotation with factor 1.
pub(super) fn cancel_attention_factor(
    rope: &mut RopeConfig,
    attention: &mut AttentionConfig,
) -> Result<()> {
    let Some(norm) = attention.qk_norm.as_mut() else {
        return Ok(());
    };
    let s = rope
        .scaling
        .frequencies(rope.rotary_dim, rope.base, 0)?
        .attention_factor;
    if s == 1.0 {
        return Ok(());
    }
    norm.eps /= s * s;
    match &mut rope.scaling {
        RopeScaling::Yarn(y) => y.attention_factor = Some(1.0),
        RopeScaling::LongRope(l) => l.attention_factor = Some(1.0),
        other => {
            return Err(problem(
                "rope_parameters",
                format!(
                    "gives the attention factor {s} with {other:?}, which this loader cannot cancel against Llama 4's q/k norm"
                ),
            ))
        }
    }
    Ok(())
}
