//! Inkling (`inkling_text`): what `InklingTextConfig` (transformers 5.24) fills in for a
//! layer, and what `InklingAttention` reads from it.
//!
//! - Layer kinds: `layer_types` (`"hybrid"` full, `"hybrid_sliding"` sliding); without it,
//!   the layers `local_layer_ids` lists slide, and without that every layer but each sixth
//!   (counting from 1) slides. The window is `sliding_window_size` (or `sliding_window`, its
//!   alias), 512 by default.
//! - Sliding layers have their own heads: `swa_num_attention_heads` (64),
//!   `swa_num_key_value_heads` (16), `swa_head_dim` (128).
//! - q and k are RMS-normalised per head (`rms_norm_eps`), so the scale is `1 / head_dim`.
//! - Short convolutions of `conv_kernel_size` taps (4; `sconv_kernel_size` is its alias) on
//!   the keys and values.
//! - No RoPE: the relative logits ([`InklingConfig`]) with `d_rel` (16) mixing weights, a bank
//!   of `rel_extent` distances (1024) on full layers and of the window on sliding ones, and
//!   the log-n scaling (`log_scaling_n_floor`, none by default; `log_scaling_alpha` 0.1) on
//!   full layers only.

use serde_json::Value;

use super::json::{problem, Obj};
use super::layer::Keys;
use super::pattern::{layer_entry, LayerKind};
use crate::attention::AttentionConfig;
use crate::error::Result;
use crate::relative::inkling::{InklingConfig, LogScaling};

/// `sliding_window_size` when absent.
const WINDOW: usize = 512;

/// The window of the sliding layers: `sliding_window_size`, else its alias `sliding_window`.
fn window(top: &Obj) -> Result<usize> {
    Ok(match top.usize("sliding_window_size")? {
        Some(w) => w,
        None => top.usize("sliding_window")?.unwrap_or(WINDOW),
    })
}

/// The kind of layer `layer` (see the module docs).
///
/// # Errors
/// [`Error::HfConfig`](crate::Error::HfConfig) naming `layer_types` for an entry other than
/// `hybrid` or `hybrid_sliding`, or `local_layer_ids` for a list that is not of indices.
pub(super) fn layer_kind(top: &Obj, layer: usize) -> Result<LayerKind> {
    let sliding = LayerKind::Sliding(window(top)?);
    if let Some(entry) = layer_entry(top, "layer_types", layer, "a list of layer types")? {
        return match entry.as_str() {
            Some("hybrid") => Ok(LayerKind::Full),
            Some("hybrid_sliding") => Ok(sliding),
            _ => Err(problem(
                "layer_types",
                format!("gives layer {layer} the type {entry}, expected hybrid or hybrid_sliding"),
            )),
        };
    }
    let listed = match top.get("local_layer_ids") {
        // Every sixth layer counting from 1 is full: (layer + 1) mod 6 = 0.
        None | Some(Value::Null) => layer % 6 != 5,
        Some(Value::Array(ids)) => {
            let ids: Option<Vec<u64>> = ids.iter().map(Value::as_u64).collect();
            let ids = ids.ok_or_else(|| problem("local_layer_ids", "expected layer indices"))?;
            ids.contains(&(layer as u64))
        }
        Some(other) => {
            return Err(problem(
                "local_layer_ids",
                format!("is {other}, expected a list of layer indices"),
            ))
        }
    };
    Ok(if listed { sliding } else { LayerKind::Full })
}

/// The layers a file has, for comparing their kinds: its `layer_types`, else
/// `num_hidden_layers`, else one (as every row counts a file that does not give them).
pub(super) fn layers(top: &Obj) -> Result<usize> {
    let listed = top
        .get("layer_types")
        .and_then(Value::as_array)
        .map(Vec::len);
    Ok(match listed {
        Some(n) => n,
        None => top.usize("num_hidden_layers")?.unwrap_or(1),
    })
}

/// A sliding layer's own heads, key/value heads and head width (`swa_*`).
pub(super) fn sizes(
    top: &Obj,
    kind: LayerKind,
    attention: AttentionConfig,
    keys: &mut Keys,
) -> Result<AttentionConfig> {
    if kind == LayerKind::Full {
        return Ok(attention);
    }
    let heads = top.usize("swa_num_attention_heads")?.unwrap_or(64);
    let kv_heads = top.usize("swa_num_key_value_heads")?.unwrap_or(16);
    let head_dim = top.usize("swa_head_dim")?.unwrap_or(128);
    keys.set("num_heads", "swa_num_attention_heads");
    keys.set("num_kv_heads", "swa_num_key_value_heads");
    keys.set("head_dim", "swa_head_dim");
    let mut attention = attention.with_kv_heads(kv_heads).with_head_dim(head_dim);
    attention.num_heads = heads;
    Ok(attention)
}

/// The block's Inkling settings: the scale `1 / head_dim` and the short convolutions.
pub(super) fn attention(
    top: &Obj,
    attention: AttentionConfig,
    keys: &mut Keys,
) -> Result<AttentionConfig> {
    let taps = match top.usize("conv_kernel_size")? {
        Some(k) => k,
        None => top.usize("sconv_kernel_size")?.unwrap_or(4),
    };
    keys.set("short_conv", "conv_kernel_size");
    let scale = 1.0 / attention.head_dim as f64;
    Ok(attention
        .with_softmax_scale(scale)
        .with_short_conv(Some(taps)))
}

/// The layer's relative logits: the bank of `rel_extent` distances (the window's on sliding
/// layers) and the log-n scaling on full layers when the file has a floor.
pub(super) fn encoding(
    top: &Obj,
    kind: LayerKind,
    attention: &AttentionConfig,
    keys: &mut Keys,
) -> Result<InklingConfig> {
    let d_rel = top.usize("d_rel")?.unwrap_or(16);
    keys.set("d_rel", "d_rel");
    let config = InklingConfig::new(attention.d_model, attention.num_heads).with_d_rel(d_rel);
    Ok(match kind {
        LayerKind::Sliding(w) => {
            keys.set("rel_extent", "sliding_window_size");
            config.with_rel_extent(w)
        }
        _ => {
            keys.set("rel_extent", "rel_extent");
            keys.set("log_scaling.n_floor", "log_scaling_n_floor");
            keys.set("log_scaling.alpha", "log_scaling_alpha");
            let scaling = top
                .usize("log_scaling_n_floor")?
                .map(|n_floor| -> Result<_> {
                    let alpha = top.f64("log_scaling_alpha")?.unwrap_or(0.1);
                    Ok(LogScaling { n_floor, alpha })
                });
            config
                .with_rel_extent(top.usize("rel_extent")?.unwrap_or(1024))
                .with_log_scaling(scaling.transpose()?)
        }
    })
}
