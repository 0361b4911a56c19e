//! The checks of a `config.json` that hold for every layer, which both readers run first
//! (`HfAttentionConfig` and `RopeConfig::from_hf_json`), so a file one of them refuses the
//! other refuses with the same error: settings the block does not have, nulls the model's
//! class refuses, and the head-width rules of its class.
//!
//! | rule | rows | HF |
//! |---|---|---|
//! | `head_dim` refused | `falcon` | `FalconConfig.head_dim` is a property without a setter |
//! | `head_dim` required | `HeadDim::Required` (`ministral`) | the class leaves it null, the attention fails |
//! | a null `head_dim` refused | Llama-style, Phi-3, Gemma 4 vision rows without `null_head_dim` | the attention computes with None |
//! | the heads divide the width | `even_split` rows, and rows whose head width is the width over the heads | the class's `validate_architecture`, or the attention's split |
//! | `head_dim` × heads = width | `HeadDim::MustSplit` (a given `head_dim`), `HeadDim::FillsWidth` (given or the class's) | the attention splits the width, or its output takes it |
//! | CodeGen's shards | `codegen` | `hf::codegen` |
//! | `layer_types` has `num_hidden_layers` entries | every row, where the file gives both | `PreTrainedConfig.validate_layer_type` |
//! | settings whose answer depends on HF's attention backend refused | [`BACKEND_DEPENDENT`]: `gemma`, `gemma2` with `use_bidirectional_attention: true` | the attention's `is_causal` against the model's causal mask |

use serde_json::Value;

use super::codegen;
use super::json::{first, problem, Obj};
use super::layer::HfFamily;
use super::registry::{HeadDim, ModelSpec, Quirks, HEADS};
use crate::error::{Error, Result};

/// The file-wide checks of a row's `config.json` (the [module docs](self)'s table).
///
/// # Errors
/// [`Error::HfConfig`] naming the key.
pub(super) fn check_file(top: &Obj, spec: &ModelSpec) -> Result<()> {
    refuse_unsupported(top, spec)?;
    refuse_typed_nulls(top, spec)?;
    check_layer_count(top)?;
    check_head_width(top, spec)
}

/// Refuses a `layer_types` list whose length is not `num_hidden_layers`, as every HF class
/// does (`validate_layer_type`): which entry belongs to which layer is then unknown.
fn check_layer_count(top: &Obj) -> Result<()> {
    let (Some(Value::Array(types)), Some(layers)) =
        (top.get("layer_types"), top.usize("num_hidden_layers")?)
    else {
        return Ok(());
    };
    if types.len() == layers {
        return Ok(());
    }
    Err(problem(
        "layer_types",
        format!(
            "has {} entries for num_hidden_layers = {layers}, expected one per layer (HF's configuration refuses the file)",
            types.len()
        ),
    ))
}

/// The head-width rules of the row's class.
fn check_head_width(top: &Obj, spec: &ModelSpec) -> Result<()> {
    let family = spec.family;
    if family == Some(HfFamily::Falcon) && top.map.contains_key("head_dim") {
        return Err(problem(
            "head_dim",
            "is set, but HF's FalconConfig derives it as hidden_size / num_attention_heads and fails to load a file that gives it; leave the key out",
        ));
    }
    if spec.head_dim == HeadDim::Required && top.get("head_dim").is_none() {
        return Err(problem(
            "head_dim",
            format!(
                "is absent or null, which HF's {} attention takes as its head width and fails on (the class does not derive it from hidden_size / num_attention_heads); give the width",
                spec.model_type
            ),
        ));
    }
    let typed = matches!(
        family,
        Some(HfFamily::Llama | HfFamily::Phi3 | HfFamily::Gemma4Vision)
    );
    if typed && top.map.get("head_dim").is_some_and(Value::is_null) && !spec.null_head_dim {
        return Err(null_refused("head_dim"));
    }
    if family.is_none() {
        return Ok(());
    }
    let (hidden, hidden_key) = first(top, spec.widths)?;
    let (heads, heads_key) = first(top, HEADS)?;
    check_even_split(spec, (hidden, hidden_key), (heads, heads_key))?;
    // Latent attention's heads are not the width over the heads.
    if family == Some(HfFamily::DeepSeek) {
        return Ok(());
    }
    if family == Some(HfFamily::CodeGen) {
        codegen::check_width(hidden, hidden_key)?;
    }
    let given = top.usize("head_dim")?;
    let derived = given.or(spec.defaults.head_dim).is_none() || spec.head_dim == HeadDim::FromWidth;
    if derived && (heads == 0 || !hidden.is_multiple_of(heads)) {
        return Err(problem(
            heads_key,
            format!("is {heads}, expected a non-zero divisor of {hidden_key} ({hidden})"),
        ));
    }
    let width = match spec.head_dim {
        HeadDim::MustSplit => given,
        HeadDim::FillsWidth => given.or(spec.defaults.head_dim),
        _ => None,
    };
    match width {
        Some(d) if heads.checked_mul(d) != Some(hidden) => Err(problem(
            "head_dim",
            format!(
                "is {d}, but this model's attention splits {hidden_key} ({hidden}) evenly over \
                 its {heads_key} ({heads}) (its rotation, or its output projection, reads \
                 head_dim): HF fails unless they agree"
            ),
        )),
        _ => Ok(()),
    }
}

/// Refuses a width that the heads do not divide where the model's HF config class refuses
/// it (its `validate_architecture`), whatever `head_dim` says.
pub(super) fn check_even_split(
    spec: &ModelSpec,
    (hidden, hidden_key): (usize, &str),
    (heads, heads_key): (usize, &str),
) -> Result<()> {
    if spec.even_split && (heads == 0 || !hidden.is_multiple_of(heads)) {
        return Err(problem(
            heads_key,
            format!(
                "is {heads}, which does not divide {hidden_key} ({hidden}); HF's configuration \
                 of {} refuses the file",
                spec.model_type
            ),
        ));
    }
    Ok(())
}

/// Refuses an explicit null at a key that HF's config class for `model_type` types without
/// one (transformers 5.24's strict fields refuse such a file) or computes with (Gemma 3's and
/// Cohere2's `sliding_window_pattern`), rather than reading it as absent and taking the
/// default. (Keys whose null the classes replace, or that they do not have, are read as
/// absent; `num_key_value_heads` and `head_dim` are handled where they are read.)
fn refuse_typed_nulls(top: &Obj, spec: &ModelSpec) -> Result<()> {
    let keys = spec.typed_nulls;
    // (The pattern is read only to build layer_types the file does not give.)
    let listed = top.get("layer_types").is_some();
    for &key in keys {
        if key == "sliding_window_pattern" && listed {
            continue;
        }
        if top.map.get(key).is_some_and(Value::is_null) {
            return Err(problem(
                key,
                format!(
                    "is null, which HF's configuration of {} refuses or cannot compute \
                     with; leave the key out for its default",
                    spec.model_type
                ),
            ));
        }
    }
    Ok(())
}

/// Settings under which HF's model gives different answers on different attention backends,
/// so no reading of the file is HF's: `(model_type, key set to true, why)`.
const BACKEND_DEPENDENT: &[(&str, &str, &str)] = &[
    ("gemma", "use_bidirectional_attention", GEMMA_BIDIRECTIONAL),
    ("gemma2", "use_bidirectional_attention", GEMMA_BIDIRECTIONAL),
];

/// Why Gemma's and Gemma 2's `use_bidirectional_attention` is refused (transformers 5.24).
const GEMMA_BIDIRECTIONAL: &str = "is true, which HF's model answers differently per attention \
    backend: its attention sets is_causal = False, but the model still builds a causal mask, \
    so eager attention is causal, sdpa attends both ways unless a padding mask is given, and \
    flash attention attends both ways; set it false (causal) or read the file as Gemma 3, \
    whose model builds bidirectional masks";

/// Refuses the settings that would change HF's answer and that the block does not have, and
/// those of [`BACKEND_DEPENDENT`].
fn refuse_unsupported(top: &Obj, spec: &ModelSpec) -> Result<()> {
    for &(model_type, key, why) in BACKEND_DEPENDENT {
        if spec.model_type == model_type && top.bool(key)? == Some(true) {
            return Err(problem(key, why));
        }
    }
    let unsupported = |key: &str, what: &str| -> Error {
        problem(
            key,
            format!("asks for {what}, which the attention block does not support yet"),
        )
    };
    if spec.family == Some(HfFamily::Mpt) {
        if let Some(Value::Object(a)) = top.get("attn_config") {
            if a.get("clip_qkv").is_some_and(|v| !v.is_null()) {
                return Err(unsupported(
                    "attn_config.clip_qkv",
                    "a clamp of the projections",
                ));
            }
            if a.get("qk_ln").and_then(Value::as_bool) == Some(true) {
                return Err(unsupported("attn_config.qk_ln", "layer norms of q and k"));
            }
        }
    }
    if spec.quirks == Quirks::Gemma4Vision && top.bool("use_clipped_linears")? == Some(true) {
        return Err(unsupported(
            "use_clipped_linears",
            "clamps of the projections' inputs and outputs",
        ));
    }
    if spec.quirks == Quirks::Gemma4 && top.str("use_bidirectional_attention")?.is_some() {
        return Err(unsupported(
            "use_bidirectional_attention",
            "bidirectional attention over some or all tokens",
        ));
    }
    Ok(())
}

/// A `null` that the model's HF class refuses.
pub(super) fn null_refused(key: &str) -> Error {
    problem(
        key,
        "is null, which this model's HF configuration class refuses (or fails on); leave the key out for the class default",
    )
}
