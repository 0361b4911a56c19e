//! Which layers of a model differ, and how: a layer's kind (full attention, a sliding window,
//! chunks) from `layer_types` or the model's default pattern, whether it rotates q and k, and
//! the key that makes a file's layers differ. The row's `window`, `layers` and `rope_layers`
//! (`hf::registry`) say which rule a model follows.

use serde_json::Value;

use super::inkling;
use super::json::{first, problem, Obj};
use super::llama4;
use super::registry::{Layers, ModelSpec, RopeLayers, Scale, Window};
use crate::error::Result;

/// Whether a layer attends to every key, through a sliding window of `w` keys, or within
/// chunks of `c` keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LayerKind {
    /// Every key.
    Full,
    /// A sliding window of this many keys.
    Sliding(usize),
    /// Chunks of this many keys.
    Chunked(usize),
}

/// The window a sliding layer of this model uses, `None` when it has none: `sliding_window`,
/// with the config class's default when the key is absent, and Qwen's `use_sliding_window`
/// switch; ModernBERT's half of `local_attention` (128 by default) on either side.
fn window_size(top: &Obj, spec: &ModelSpec) -> Result<Option<usize>> {
    if spec.window == Window::LocalAttention {
        return Ok(Some(top.usize("local_attention")?.unwrap_or(128) / 2));
    }
    // Qwen3-VL's text model has no sliding window, whatever the file says.
    if spec.defaults.mrope.is_some_and(|m| m.interleaved) {
        return Ok(None);
    }
    let window = match top.map.get("sliding_window") {
        None => spec.defaults.sliding_window,
        Some(_) => top.usize("sliding_window")?,
    };
    Ok(match spec.window {
        // Qwen2's and Qwen3's classes null the window unless use_sliding_window; SmolLM3's
        // keeps it, and its model masks the listed sliding layers with it whatever the switch
        // says (modeling_smollm3.py), the switch only shaping its default layer types.
        Window::QwenSwitch if top.bool("use_sliding_window")? != Some(true) => None,
        Window::None => None,
        Window::SlidingOrBidirectional if bidirectional(top, spec)? => window.map(|w| w / 2),
        _ => window,
    })
}

/// Whether the model attends both ways: Gemma 3's `use_bidirectional_attention` (null or
/// absent is false, as in its class and model).
pub(super) fn bidirectional(top: &Obj, spec: &ModelSpec) -> Result<bool> {
    Ok(spec.window == Window::SlidingOrBidirectional
        && top.bool("use_bidirectional_attention")? == Some(true))
}

/// The kind of layer `layer`: from `layer_types` where the model reads it, else from the
/// model's default pattern.
pub(super) fn layer_kind(top: &Obj, spec: &ModelSpec, layer: usize) -> Result<LayerKind> {
    if spec.layers == Layers::Chunked {
        return llama4::layer_kind(top, spec, layer);
    }
    if spec.layers == Layers::Hybrid {
        return inkling::layer_kind(top, layer);
    }
    let window = window_size(top, spec)?;
    // (Qwen2.5-VL's vision layers outside its list are refused before: `refuse_windowed`.)
    if matches!(spec.layers, Layers::Uniform | Layers::FullListed { .. }) {
        return Ok(window.map_or(LayerKind::Full, LayerKind::Sliding));
    }
    if let Some(entry) = layer_entry(top, "layer_types", layer, "a list of layer types")? {
        return listed_kind(top, spec, layer, entry, window);
    }
    // (Gemma 2's and 3's, gpt-oss's and Cohere2's null window is refused with the file.)
    Ok(match (pattern_slides(top, spec, layer)?, window) {
        (true, Some(w)) => LayerKind::Sliding(w),
        _ => LayerKind::Full,
    })
}

/// The kind `layer_types` gives layer `layer` (its entry `entry`).
fn listed_kind(
    top: &Obj,
    spec: &ModelSpec,
    layer: usize,
    entry: &Value,
    window: Option<usize>,
) -> Result<LayerKind> {
    let types = top.get("layer_types").and_then(Value::as_array);
    // Gemma 4's class makes the last listed layer a full one, whatever its entry says.
    let last_full = matches!(
        spec.layers,
        Layers::EveryNth {
            last_full: true,
            ..
        }
    );
    if last_full && types.map(Vec::len).and_then(|n| n.checked_sub(1)) == Some(layer) {
        return Ok(LayerKind::Full);
    }
    match entry.as_str() {
        Some("full_attention" | "sliding_attention") if window.is_none() => {
            // HF's sliding-window mask fails without a window, and the model builds it for
            // every layer as soon as any layer slides: a full layer of such a file is refused
            // too.
            let slides = |v: &Value| v.as_str() == Some("sliding_attention");
            match types.and_then(|types| types.iter().position(slides)) {
                None => Ok(LayerKind::Full),
                Some(first) => Err(problem(
                    "layer_types",
                    format!(
                        "gives layer {first} sliding attention, but the model has no window (sliding_window is null or absent{}; HF's sliding-window mask fails without one)",
                        match spec.window {
                            Window::QwenSwitch => ", or use_sliding_window is not true",
                            _ => "",
                        }
                    ),
                )),
            }
        }
        Some("full_attention") => Ok(LayerKind::Full),
        Some("sliding_attention") => Ok(window.map_or(LayerKind::Full, LayerKind::Sliding)),
        _ => Err(problem(
            "layer_types",
            format!(
                "gives layer {layer} the type {entry}, expected full_attention or sliding_attention (the block has no chunked or linear attention yet)"
            ),
        )),
    }
}

/// Whether the model's default pattern makes layer `layer` a sliding one.
fn pattern_slides(top: &Obj, spec: &ModelSpec, layer: usize) -> Result<bool> {
    Ok(match spec.layers {
        Layers::SlidingFrom => {
            let first = spec.defaults.max_window_layers;
            layer >= top.usize("max_window_layers")?.unwrap_or(first)
        }
        // SmolLM3's class makes its NoPE layers sliding only under use_sliding_window.
        Layers::NoRopeSlides => {
            top.bool("use_sliding_window")? == Some(true) && !uses_rope(top, spec, layer)?
        }
        Layers::FromZero { key, every } => {
            let every = top.usize(key)?.unwrap_or(every).max(1);
            !layer.is_multiple_of(every)
        }
        Layers::EveryNth {
            key,
            every,
            last_full,
        } => {
            // A class that reads the key takes a layer's number modulo it, so 0 fails there.
            let pattern = match key {
                Some(key) => top.usize(key)?.unwrap_or(every),
                None => every,
            };
            if pattern == 0 {
                return Err(problem(
                    key.unwrap_or("sliding_window_pattern"),
                    "is 0, expected at least 1 (every n-th layer is a full-attention one)",
                ));
            }
            // Gemma 4's last layer is always a full one.
            let last = last_full
                && top
                    .usize("num_hidden_layers")?
                    .is_some_and(|n| n.checked_sub(1) == Some(layer));
            !every_nth(layer, pattern) && !last
        }
        // Ministral's class lists every layer as sliding when the model has a window.
        Layers::Listed => true,
        Layers::Uniform | Layers::Chunked | Layers::FullListed { .. } | Layers::Hybrid => false,
    })
}

/// Whether `layer` (from 0) is every `n`-th layer counting from 1, i.e. `(layer + 1) mod n =
/// 0`, without the sum (`layer` is the caller's number). `n` is at least 1.
fn every_nth(layer: usize, n: usize) -> bool {
    layer % n == n - 1
}

/// Refuses a layer index past the model's layers when the file gives their number
/// (`num_hidden_layers`, or GPT-2's, BLOOM's and GPT-J's `n_layer`, MPT's `n_layers`, the
/// Qwen-VL vision encoders' `depth`).
///
/// # Errors
/// [`Error::HfConfig`] naming the count's key for `layer ≥` the count.
pub(super) fn check_layer(top: &Obj, layer: usize) -> Result<()> {
    for key in ["num_hidden_layers", "n_layer", "n_layers", "depth"] {
        if let Some(layers) = top.usize(key)? {
            if layer >= layers {
                return Err(problem(
                    key,
                    format!("is {layers}, so there is no layer {layer} (layers count from 0)"),
                ));
            }
            return Ok(());
        }
    }
    Ok(())
}

/// Refuses a layer that attends within windows of reordered patches, which the block does not
/// build: Qwen2.5-VL's vision layers that `fullatt_block_indexes` (7, 15, 23 and 31 by default)
/// does not list, where HF's vision model reorders the patches into windows of `window_size`
/// pixels and attends within each.
///
/// # Errors
/// [`Error::HfConfig`](crate::error::Error::HfConfig) naming the list's key for a layer it
/// does not list, or for a list that is not one of layer indices.
pub(super) fn refuse_windowed(top: &Obj, spec: &ModelSpec, layer: usize) -> Result<()> {
    let Layers::FullListed { key, default } = spec.layers else {
        return Ok(());
    };
    let listed = match top.get(key) {
        None => default.contains(&layer),
        Some(value) => {
            let indices = value.as_array().and_then(|list| {
                list.iter()
                    .map(|v| v.as_u64().and_then(|i| usize::try_from(i).ok()))
                    .collect::<Option<Vec<usize>>>()
            });
            match indices {
                Some(indices) => indices.contains(&layer),
                None => {
                    return Err(problem(
                        key,
                        format!("is {value}, expected a list of layer indices"),
                    ))
                }
            }
        }
    };
    if listed {
        return Ok(());
    }
    Err(problem(
        key,
        format!(
            "does not list layer {layer}: HF's vision model runs it within windows of the patches it reorders (window_size), which the attention block does not build; its attention module is a listed layer's, so read a listed layer and give each window as a sequence of its own"
        ),
    ))
}

/// Entry `layer` of the per-layer list at `key` (`None` when the key is absent).
///
/// # Errors
/// [`Error::HfConfig`] naming `key` when it is not a list (`expected` says of what) or has no
/// entry for `layer`.
pub(super) fn layer_entry<'a>(
    top: &Obj<'a>,
    key: &str,
    layer: usize,
    expected: &str,
) -> Result<Option<&'a Value>> {
    let Some(list) = top.get(key) else {
        return Ok(None);
    };
    let items = list
        .as_array()
        .ok_or_else(|| problem(key, format!("is {list}, expected {expected}")))?;
    items.get(layer).map(Some).ok_or_else(|| {
        problem(
            key,
            format!("has {} entries, so there is no layer {layer}", items.len()),
        )
    })
}

/// Whether layer `layer` rotates its queries and keys: SmolLM3's and Llama 4's
/// `no_rope_layers` (1 = RoPE, 0 = no positional encoding; by default every
/// `no_rope_layer_interval`-th layer, 4, is NoPE); Cohere2's sliding-window layers (its
/// full-attention layers have no positional encoding).
pub(super) fn uses_rope(top: &Obj, spec: &ModelSpec, layer: usize) -> Result<bool> {
    let empty_is_default = match spec.rope_layers {
        RopeLayers::All => return Ok(true),
        RopeLayers::SlidingOnly => {
            return Ok(matches!(
                layer_kind(top, spec, layer)?,
                LayerKind::Sliding(_)
            ))
        }
        RopeLayers::NoRopeList { empty_is_default } => empty_is_default,
    };
    // (A null list is the default pattern in both classes, as an absent one; Llama 4's takes
    // an empty one as the default too: Llama 4 Scout's file has `"no_rope_layers": []`.)
    let entry = match top.get("no_rope_layers") {
        Some(Value::Array(a)) if a.is_empty() && empty_is_default => None,
        _ => layer_entry(top, "no_rope_layers", layer, "a list of 0 and 1")?,
    };
    match entry {
        Some(entry) => match entry.as_u64() {
            Some(0) => Ok(false),
            Some(1) => Ok(true),
            _ => Err(problem(
                "no_rope_layers",
                format!("gives layer {layer} {entry}, expected 0 or 1"),
            )),
        },
        None => {
            let interval = top.usize("no_rope_layer_interval")?.unwrap_or(4).max(1);
            Ok(!every_nth(layer, interval))
        }
    }
}

/// The key that makes layers differ (`layer_types`, or the one their default pattern comes
/// from), if they do.
pub(super) fn layers_differ(top: &Obj, spec: &ModelSpec) -> Result<Option<&'static str>> {
    // GPT-2's layers scaled by their number differ unless there is one.
    if spec.scale == Scale::Gpt2
        && top.bool("scale_attn_by_inverse_layer_idx")? == Some(true)
        && first(top, &["n_layer", "num_hidden_layers"]).map_or(true, |(n, _)| n > 1)
    {
        return Ok(Some("scale_attn_by_inverse_layer_idx"));
    }
    if spec.layers == Layers::Hybrid {
        let first_kind = layer_kind(top, spec, 0)?;
        for layer in 1..inkling::layers(top)?.min(1 << 16) {
            if layer_kind(top, spec, layer)? != first_kind {
                return Ok(Some("layer_types"));
            }
        }
        return Ok(None);
    }
    let windows = window_size(top, spec)?.is_some();
    let no_rope = matches!(spec.rope_layers, RopeLayers::NoRopeList { .. });
    if spec.layers == Layers::Uniform || !(windows || no_rope) {
        // (Cohere2 without a window has no RoPE on any layer: uniform.)
        return Ok(None);
    }
    let listed = |key| top.get(key).and_then(Value::as_array).map_or(0, Vec::len);
    let layers = listed("layer_types")
        .max(listed("no_rope_layers"))
        .max(first(top, &["num_hidden_layers"]).map_or(1, |(n, _)| n));
    let of = |layer| -> Result<(LayerKind, bool)> {
        Ok((layer_kind(top, spec, layer)?, uses_rope(top, spec, layer)?))
    };
    let first_kind = of(0)?;
    for layer in 1..layers.min(1 << 16) {
        if of(layer)? != first_kind {
            if uses_rope(top, spec, layer)? != first_kind.1 {
                return Ok(Some("no_rope_layers"));
            }
            return Ok(Some(match top.get("layer_types") {
                Some(_) => "layer_types",
                None => "num_hidden_layers",
            }));
        }
    }
    Ok(None)
}
