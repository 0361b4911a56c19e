//! Gemma 4 (`gemma4_text`): what `Gemma4TextConfig.__post_init__` (transformers 5.24) fills
//! in for a layer, and what `Gemma4TextAttention` and `Gemma4TextRotaryEmbedding` read from it.
//!
//! - Full-attention layers are wider: without a `per_layer_config` key the class gives each of
//!   them `head_dim = global_head_dim` (512 by default) and, only when `attention_k_eq_v`,
//!   `num_key_value_heads = num_global_key_value_heads` (when the file has one). A
//!   `per_layer_config` in the file (layer indices as text, zero-padded as `to_dict` writes
//!   them) replaces that; a `null` one means no overrides at all.
//! - RoPE comes from `rope_parameters`, nested by layer type; without it, the class's own:
//!   plain RoPE with θ 10000 on sliding layers, proportional RoPE (a quarter of the
//!   frequencies, θ 1e6) on full ones. The class never standardises them, so a top-level
//!   `rope_theta` is read only where HF's scaled RoPE functions standardise the parameters
//!   (an entry of a scaled type without its own θ, or the sliding entry when the full one is
//!   scaled); each layer type's table is built over that type's head width.
//! - `num_key_value_heads`, `head_dim`, `sliding_window`, `global_head_dim` and
//!   `attention_k_eq_v` are typed fields that refuse `null`; a `rope_scaling` key replaces the
//!   nested parameters and the rotary embedding then fails.
//!
//! Its vision encoder (`gemma4_vision`) shares the attention's norms and scale ([`vision`]) and
//! nothing of the layer types.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use super::json::{problem, Obj};
use super::pattern::{layer_kind, LayerKind};
use super::registry::ModelSpec;
use crate::attention::AttentionConfig;
use crate::error::Result;

/// `global_head_dim` when absent.
const GLOBAL_HEAD_DIM: usize = 512;

/// `num_hidden_layers` when absent.
const NUM_HIDDEN_LAYERS: usize = 30;

/// A layer's head width and key/value heads where they differ from the file's global ones,
/// each with the key it came from.
#[derive(Debug, Default)]
pub(super) struct Overrides {
    pub(super) head_dim: Option<(usize, String)>,
    pub(super) kv_heads: Option<(usize, String)>,
}

/// The typed fields whose `null` the class refuses (see `layer::refuse_typed_nulls`).
pub(super) const TYPED_FIELDS: [&str; 6] = [
    "attention_bias",
    "num_key_value_heads",
    "head_dim",
    "sliding_window",
    "global_head_dim",
    "attention_k_eq_v",
];

/// Refuses `rope_scaling`, which replaces the nested parameters, and a layer that shares an
/// earlier layer's keys and values (the last `num_kv_shared_layers`), which the block does not
/// support yet.
pub(super) fn check_layer(top: &Obj, layer: usize) -> Result<()> {
    if top.map.contains_key("rope_scaling") {
        return Err(problem(
            "rope_scaling",
            "replaces Gemma 4's per-layer-type rope_parameters, and HF's rotary embedding then fails; give rope_parameters nested by layer type instead",
        ));
    }
    let layers = top.usize("num_hidden_layers")?.unwrap_or(0);
    let shared = top.usize("num_kv_shared_layers")?.unwrap_or(0);
    // The last `shared` layers reuse earlier keys: layer + shared ≥ layers, without the sum
    // (both are the file's numbers).
    if shared > 0 && layer >= layers.saturating_sub(shared) {
        return Err(problem(
            "num_kv_shared_layers",
            format!(
                "makes layer {layer} reuse the keys and values of an earlier layer, which the attention block does not support yet"
            ),
        ));
    }
    Ok(())
}

/// The block settings of a Gemma 4 layer: q and k normalised (by the row's norm), the values
/// too (a norm without a scale, ε from `rms_norm_eps`), no further scale, and the values
/// taken from the key projection on full layers under `attention_k_eq_v`.
pub(super) fn attention(
    top: &Obj,
    kind: LayerKind,
    attention: AttentionConfig,
) -> Result<AttentionConfig> {
    Ok(attention
        .with_softmax_scale(1.0)
        .with_value_norm(Some(top.f64("rms_norm_eps")?.unwrap_or(1e-6)))
        .with_k_eq_v(kind == LayerKind::Full && top.bool("attention_k_eq_v")?.unwrap_or(false)))
}

/// The block settings of Gemma 4's vision encoder (`Gemma4VisionAttention`): q and k
/// normalised (the row's norm), the values too (without a scale, ε from `rms_norm_eps`), and
/// no further scale.
pub(super) fn vision(top: &Obj, attention: AttentionConfig) -> Result<AttentionConfig> {
    Ok(attention
        .with_softmax_scale(1.0)
        .with_value_norm(Some(top.f64("rms_norm_eps")?.unwrap_or(1e-6))))
}

/// The head width and key/value heads of layer `layer` (of kind `kind`) where they differ
/// from the global ones.
///
/// # Errors
/// [`Error::HfConfig`] naming `per_layer_config` (or an entry's key) for a key that is not a
/// layer index below `num_hidden_layers`, an entry that is not an object or has a null width
/// or head count, or layers of one type with different widths or head counts (HF builds one
/// rotary table per layer type and fails on them).
pub(super) fn overrides(
    top: &Obj,
    spec: &ModelSpec,
    layer: usize,
    kind: LayerKind,
) -> Result<Overrides> {
    let list = match top.map.get("per_layer_config") {
        None if kind == LayerKind::Full => return class_overrides(top),
        None | Some(Value::Null) => return Ok(Overrides::default()),
        Some(Value::Object(m)) => m,
        Some(other) => {
            return Err(problem(
                "per_layer_config",
                format!("is {other}, expected an object from layer indices to overrides"),
            ))
        }
    };
    let layers = top.usize("num_hidden_layers")?.unwrap_or(NUM_HIDDEN_LAYERS);
    let entries = entries(list, layers)?;
    let own = entry_overrides(&entries, layer)?;
    let values = |o: &Overrides| {
        (
            o.head_dim.as_ref().map(|v| v.0),
            o.kv_heads.as_ref().map(|v| v.0),
        )
    };
    for other in 0..layers {
        if other != layer
            && layer_kind(top, spec, other)? == kind
            && values(&entry_overrides(&entries, other)?) != values(&own)
        {
            return Err(problem(
                "per_layer_config",
                format!(
                    "gives layers {layer} and {other}, of the same type, different head widths or key/value heads; HF builds one rotary table per layer type and refuses that"
                ),
            ));
        }
    }
    Ok(own)
}

/// A full layer's overrides without `per_layer_config`: `global_head_dim`, and
/// `num_global_key_value_heads` under `attention_k_eq_v`.
fn class_overrides(top: &Obj) -> Result<Overrides> {
    let head_dim = top.usize("global_head_dim")?.unwrap_or(GLOBAL_HEAD_DIM);
    let kv_heads = match top.bool("attention_k_eq_v")?.unwrap_or(false) {
        true => top
            .usize("num_global_key_value_heads")?
            .map(|n| (n, "num_global_key_value_heads".to_string())),
        false => None,
    };
    Ok(Overrides {
        head_dim: Some((head_dim, "global_head_dim".into())),
        kv_heads,
    })
}

/// A `per_layer_config` entry: its key as written, and its overrides.
type Entry<'a> = (&'a str, &'a Map<String, Value>);

/// The entries of `per_layer_config` by layer index, checked.
fn entries(list: &Map<String, Value>, layers: usize) -> Result<BTreeMap<usize, Entry<'_>>> {
    let mut entries = BTreeMap::new();
    for (key, value) in list {
        let index = key
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|&i| i < layers)
            .ok_or_else(|| {
                problem(
                    "per_layer_config",
                    format!(
                        "has the key {key:?}, expected a layer index below num_hidden_layers ({layers})"
                    ),
                )
            })?;
        let entry = value.as_object().ok_or_else(|| {
            problem(
                format!("per_layer_config.{key}"),
                format!("is {value}, expected an object of overrides"),
            )
        })?;
        for field in ["head_dim", "num_key_value_heads"] {
            if entry.get(field).is_some_and(Value::is_null) {
                return Err(problem(
                    format!("per_layer_config.{key}.{field}"),
                    "is null, which Gemma4TextConfig refuses (the field is typed)",
                ));
            }
        }
        entries.insert(index, (key.as_str(), entry));
    }
    Ok(entries)
}

/// The overrides `per_layer_config` gives layer `layer` (none without an entry).
fn entry_overrides(entries: &BTreeMap<usize, Entry<'_>>, layer: usize) -> Result<Overrides> {
    let Some(&(key, entry)) = entries.get(&layer) else {
        return Ok(Overrides::default());
    };
    let prefix = format!("per_layer_config.{key}.");
    let obj = Obj {
        map: entry,
        prefix: &prefix,
    };
    let at = |field: &str| -> Result<Option<(usize, String)>> {
        Ok(obj.usize(field)?.map(|v| (v, obj.name(field))))
    };
    Ok(Overrides {
        head_dim: at("head_dim")?,
        kv_heads: at("num_key_value_heads")?,
    })
}

/// The rotary parameters of a layer of kind `kind`: its type's entry of `rope_parameters` (or
/// the class's default), with `rope_theta` resolved as HF resolves it.
///
/// # Errors
/// [`Error::HfConfig`] naming `rope_parameters` when it is not an object of layer types or has
/// no entry for this layer's type, and the entry's `rope_theta` where HF has none for it.
pub(super) fn rope_entry(top: &Obj, kind: LayerKind) -> Result<Value> {
    let type_name = match kind {
        LayerKind::Full => "full_attention",
        LayerKind::Sliding(_) => "sliding_attention",
        LayerKind::Chunked(_) => {
            return Err(problem(
                "layer_types",
                "gives a Gemma 4 layer chunked attention, which it does not have",
            ))
        }
    };
    let params = match top.map.get("rope_parameters") {
        None | Some(Value::Null) => return Ok(default_entry(kind)),
        Some(Value::Object(m)) => m,
        Some(other) => {
            return Err(problem(
                "rope_parameters",
                format!("is {other}, expected an object with one entry per layer type"),
            ))
        }
    };
    let mut entry = match params.get(type_name) {
        Some(Value::Object(e)) => e.clone(),
        Some(Value::Null) | None => {
            return Err(problem(
                "rope_parameters",
                format!(
                    "has no entry for {type_name} (Gemma 4 reads its RoPE per layer type, as {{\"sliding_attention\": {{...}}, \"full_attention\": {{...}}}}; HF's rotary embedding fails without it)"
                ),
            ))
        }
        Some(other) => {
            return Err(problem(
                format!("rope_parameters.{type_name}"),
                format!("is {other}, expected an object"),
            ))
        }
    };
    let type_of = |e: &Map<String, Value>| -> String {
        e.get("rope_type")
            .or_else(|| e.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default")
            .to_string()
    };
    if !entry.contains_key("rope_theta") {
        let own = type_of(&entry);
        // Every scaled RoPE function standardises the shared parameters (filling each entry's
        // θ from the top level); the full layers' table is built first.
        let full_scaled = params
            .get("full_attention")
            .and_then(Value::as_object)
            .is_some_and(|f| type_of(f) != "default");
        let standardised = own != "default" || (kind != LayerKind::Full && full_scaled);
        let theta = top.f64("rope_theta")?;
        match theta {
            Some(t) if standardised && own != "proportional" => {
                entry.insert("rope_theta".into(), Value::from(t));
            }
            _ => {
                return Err(problem(
                    format!("rope_parameters.{type_name}.rope_theta"),
                    "is missing, and HF's Gemma 4 has no θ for the layer type without it",
                ))
            }
        }
    }
    if entry.get("rope_theta").is_some_and(Value::is_null) {
        return Err(problem(
            format!("rope_parameters.{type_name}.rope_theta"),
            "is null, expected a number",
        ));
    }
    Ok(Value::Object(entry))
}

/// The class's own rotary parameters of a layer type.
fn default_entry(kind: LayerKind) -> Value {
    match kind {
        LayerKind::Full => serde_json::json!({
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 1_000_000.0,
        }),
        _ => serde_json::json!({"rope_type": "default", "rope_theta": 10_000.0}),
    }
}
