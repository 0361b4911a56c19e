//! DeepSeek V2/V3 (`deepseek_v2`, `deepseek_v3`): multi-head latent attention with decoupled
//! RoPE, as `DeepseekV2Attention` / `DeepseekV3Attention` (transformers 5.24) build it.
//!
//! Keys: `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`, `q_lora_rank` (null: one query
//! projection), `kv_lora_rank`, `attention_bias`; the rotary settings (`rope_parameters` or
//! `rope_scaling`, `rope_theta`, `max_position_embeddings`) over `qk_rope_head_dim`
//! features, interleaved pairs (V2 always, V3 by `rope_interleave`, default true); a softmax
//! scale of `(nope + rope)^-1/2`, times `mscale²` with `mscale = 0.1·mscale_all_dim·ln(factor)
//! + 1` when the scaling is not the default and names `mscale_all_dim`.

use serde_json::Value;

use super::checks::check_even_split;
use super::json::{first, parse_root, problem, Obj};
use super::layer::{blame, HfAttentionConfig, HfFamily, Keys};
use super::registry::ModelSpec;
use super::rope::rope_of_file;
use crate::attention::{AttentionConfig, LatentConfig};
use crate::encoding::EncodingConfig;
use crate::error::{Error, Result};
use crate::rotary::scaling::RopeScaling;
use crate::rotary::RopeConfig;

/// A DeepSeek layer (see the [module docs](self)).
pub(super) fn read(text: &str, top: &Obj, spec: &ModelSpec) -> Result<HfAttentionConfig> {
    let mut keys = Keys::default();
    let (hidden, hidden_key) = first(top, &["hidden_size"])?;
    let (heads, heads_key) = first(top, &["num_attention_heads"])?;
    check_even_split(spec, (hidden, hidden_key), (heads, heads_key))?;
    keys.set("d_model", hidden_key);
    keys.set("num_heads", heads_key);
    let (latent, head_dim) = latent(top, &mut keys)?;
    check_kv_heads(top, spec, heads)?;
    let bias = top.bool("attention_bias")?.unwrap_or(false);
    let rope = rope(text, top, spec, latent.rope_dim, head_dim)?;
    keys.set("softmax_scale", "rope_parameters.mscale_all_dim");
    let attention = AttentionConfig::new(hidden, heads)
        .with_head_dim(head_dim)
        .with_causal(true)
        .with_bias(bias)
        .with_softmax_scale(softmax_scale(&rope, head_dim))
        .with_latent(Some(latent));
    attention.validate().map_err(|e| blame(e, &keys))?;
    Ok(HfAttentionConfig {
        family: HfFamily::DeepSeek,
        attention,
        encoding: EncodingConfig::Rotary(rope),
    })
}

/// The latent ranks and head widths (with the class defaults), and the query/key head width
/// `qk_nope_head_dim + qk_rope_head_dim`.
fn latent(top: &Obj, keys: &mut Keys) -> Result<(LatentConfig, usize)> {
    let size =
        |key: &str, default: usize| -> Result<usize> { Ok(top.usize(key)?.unwrap_or(default)) };
    let nope = size("qk_nope_head_dim", 128)?;
    let rope_dim = size("qk_rope_head_dim", 64)?;
    let v_head_dim = size("v_head_dim", 128)?;
    let kv_lora_rank = size("kv_lora_rank", 512)?;
    let q_lora_rank = match top.map.get("q_lora_rank") {
        None => Some(1536),
        Some(_) => top.usize("q_lora_rank")?,
    };
    for (field, key) in [
        ("latent", "kv_lora_rank"),
        ("latent.q_lora_rank", "q_lora_rank"),
        ("latent.kv_lora_rank", "kv_lora_rank"),
        ("latent.rope_dim", "qk_rope_head_dim"),
        ("latent.v_head_dim", "v_head_dim"),
    ] {
        keys.set(field, key);
    }
    keys.set("head_dim", "qk_nope_head_dim + qk_rope_head_dim");
    let head_dim = nope.checked_add(rope_dim).ok_or_else(|| {
        problem(
            "qk_nope_head_dim",
            "plus qk_rope_head_dim overflows a machine word",
        )
    })?;
    let latent = LatentConfig::new(q_lora_rank, kv_lora_rank, rope_dim, v_head_dim);
    Ok((latent, head_dim))
}

/// HF's latent attention repeats its keys num_attention_heads / num_key_value_heads times
/// over keys that already have a head each: any other count than the heads fails there. (A
/// null is the heads, as the classes' __post_init__ makes it.)
fn check_kv_heads(top: &Obj, spec: &ModelSpec, heads: usize) -> Result<()> {
    let kv_heads = match top.map.get("num_key_value_heads") {
        Some(Value::Null) => heads,
        _ => top
            .usize("num_key_value_heads")?
            .or(spec.defaults.num_key_value_heads)
            .unwrap_or(heads),
    };
    if kv_heads == heads {
        return Ok(());
    }
    let default = match top.get("num_key_value_heads") {
        None => " (the class default)",
        Some(_) => "",
    };
    Err(problem(
        "num_key_value_heads",
        format!(
            "is {kv_heads}{default}, but HF's latent attention needs it equal to num_attention_heads ({heads})"
        ),
    ))
}

/// The rotary settings over the rotating features only, read as a Llama file's (a
/// `partial_rotary_factor` is read as HF's DeepSeek reads it: not at all with the default
/// RoPE, refused where it would shorten a scaled RoPE's table), then given the whole head
/// width. V2 always rotates adjacent pairs; V3 as `rope_interleave` says (true by default).
fn rope(
    text: &str,
    top: &Obj,
    spec: &ModelSpec,
    rope_dim: usize,
    head_dim: usize,
) -> Result<RopeConfig> {
    let interleaved = match spec.rope.interleaved {
        true => true,
        false => top.bool("rope_interleave")?.unwrap_or(true),
    };
    let mut map = parse_root(text)?;
    map.insert("model_type".into(), Value::from("llama"));
    map.insert("head_dim".into(), Value::from(rope_dim));
    map.insert("rope_interleave".into(), Value::from(interleaved));
    let mut rope = rope_of_file(&Value::Object(map).to_string()).map_err(|e| match e {
        // The head width given to the rotary settings is qk_rope_head_dim.
        Error::HfConfig { key, problem } if key == "head_dim" => Error::HfConfig {
            key: "qk_rope_head_dim".into(),
            problem,
        },
        other => other,
    })?;
    rope.head_dim = head_dim;
    Ok(rope)
}

/// `head_dim^-1/2`, sharpened by YaRN's `mscale_all_dim`.
fn softmax_scale(rope: &RopeConfig, head_dim: usize) -> f64 {
    let mut scale = 1.0 / (head_dim as f64).sqrt();
    if let RopeScaling::Yarn(y) = &rope.scaling {
        if let Some(all) = y.mscale_all_dim {
            if y.factor > 1.0 {
                let m = 0.1 * all * y.factor.ln() + 1.0;
                scale *= m * m;
            }
        }
    }
    scale
}
