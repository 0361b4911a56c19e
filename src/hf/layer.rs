//! [`HfAttentionConfig`]: one attention layer of an HF model, read from its `config.json`, and
//! the block built from the layer's tensors under HF's names.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::Tensor;
use candle_nn::VarBuilder;
use serde_json::Value;

use super::defaults::{class_defaults, ClassDefaults, LOCAL_ROPE_THETA};
use super::gemma4;
use super::json::{first, parse_root, problem, Obj};
use super::weights::{remap, QkvLayout, WeightLayout};
use crate::attention::{
    AttentionConfig, AttentionTemperature, LatentConfig, MultiHeadAttention, QkNormConfig,
    QkNormScope,
};
use crate::encoding::EncodingConfig;
use crate::error::{Error, Result};
use crate::plug::PositionalEncoding;
use crate::relative::alibi::{AlibiConfig, AlibiSlopes};
use crate::relative::t5::T5Config;
use crate::rotary::scaling::RopeScaling;
use crate::rotary::RopeConfig;

/// The model families whose attention layers load from HF names, chosen by `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum HfFamily {
    /// `llama`, `mistral`, `qwen2`, `qwen3`, `gemma`, `gemma2`, `gemma3_text`, `olmo2`,
    /// `gpt_oss`, `smollm3`, `cohere2`, `llama4_text`: `q_proj`, `k_proj`, `v_proj`, `o_proj`
    /// (and `q_norm`, `k_norm` for Qwen3, Gemma 3 and OLMo 2; `sinks` for gpt-oss); RoPE (none
    /// on the NoPE layers of SmolLM3 and Llama 4 and on Cohere2's full-attention layers).
    Llama,
    /// `phi3`: fused `qkv_proj` (rows `[q; k; v]`), `o_proj`; RoPE (LongRoPE).
    Phi3,
    /// `gpt_neox`: fused `query_key_value` (rows per head), `dense`; partial RoPE.
    GptNeoX,
    /// `bloom`: fused `query_key_value` (rows per head), `dense`; ALiBi.
    Bloom,
    /// `gpt2`: Conv1D `c_attn` and `c_proj`, stored transposed; absolute positions at the
    /// embeddings (`wpe`), none in the block.
    Gpt2,
    /// `gptj`: `q_proj`, `k_proj`, `v_proj`, `out_proj`; RoPE on adjacent pairs of the first
    /// `rotary_dim` features.
    GptJ,
    /// `falcon`: fused `query_key_value` (multi-query, grouped or per head), `dense`; RoPE.
    Falcon,
    /// `t5`: `q`, `k`, `v`, `o` and the first layer's `relative_attention_bias`; T5 buckets,
    /// no softmax scaling.
    T5,
    /// `mpt`: fused `Wqkv` (rows `[q; k; v]`), `out_proj`, no biases; ALiBi with MPT's slopes
    /// and the largest exponent 8, as HF's `MptModel` builds it: HF reads neither
    /// `attn_config.alibi` nor `attn_config.alibi_bias_max`, and neither does the loader
    /// (MosaicML's original code honours both; for another exponent, build the
    /// [`AlibiConfig`] with [`AlibiSlopes::Mpt`] yourself).
    Mpt,
    /// `modernbert`: fused `Wqkv` (rows `[q; k; v]`), `Wo`; bidirectional; RoPE with a global
    /// θ on full-attention layers and a local θ on sliding ones, which see `local_attention / 2`
    /// keys on either side.
    ModernBert,
    /// `deepseek_v2`, `deepseek_v3`: multi-head latent attention (`q_a_proj`, `q_a_layernorm`,
    /// `q_b_proj` or `q_proj`; `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`; `o_proj`),
    /// RoPE on `qk_rope_head_dim` features of each head (interleaved pairs), YaRN's
    /// `mscale_all_dim` in the softmax scale.
    DeepSeek,
}

impl HfFamily {
    /// The family of an HF `model_type`, if the crate loads it.
    pub fn from_model_type(model_type: &str) -> Option<Self> {
        Some(match model_type {
            "llama" | "mistral" | "qwen2" | "qwen3" | "gemma" | "gemma2" | "gemma3_text"
            | "olmo2" | "gpt_oss" | "smollm3" | "cohere2" | "llama4_text" | "gemma4_text"
            | "pixtral" => HfFamily::Llama,
            "phi3" => HfFamily::Phi3,
            "gpt_neox" => HfFamily::GptNeoX,
            "bloom" => HfFamily::Bloom,
            "gpt2" => HfFamily::Gpt2,
            "gptj" => HfFamily::GptJ,
            "falcon" => HfFamily::Falcon,
            "t5" => HfFamily::T5,
            "mpt" => HfFamily::Mpt,
            "modernbert" => HfFamily::ModernBert,
            "deepseek_v2" | "deepseek_v3" => HfFamily::DeepSeek,
            _ => return None,
        })
    }
}

/// One attention layer of an HF model: the block's settings, its encoding and where its
/// weights live, read from the model's `config.json`.
///
/// Keys read (as HF transformers reads them for each `model_type`):
/// - the family from `model_type` ([`HfFamily::from_model_type`]); for Qwen2-VL, Qwen2.5-VL,
///   Qwen3-VL and Llama 4 the language model under `text_config` (the first two read as Qwen2
///   and Qwen3, with multimodal RoPE);
/// - sizes: `hidden_size` (`n_embd`, `d_model`), `num_attention_heads` (`n_head`,
///   `num_heads`), `num_key_value_heads` (Falcon: `multi_query`, `new_decoder_architecture`,
///   `num_kv_heads`), `head_dim` (T5: `d_kv`), else `hidden_size / heads`;
/// - biases: `attention_bias` (Llama, Qwen3, Gemma, OLMo 2, GPT-NeoX, ModernBERT), `bias` (Falcon); Qwen2
///   has biases on q, k and v but not on the output, BLOOM and GPT-2 on all four, Mistral,
///   Phi-3, GPT-J and T5 on none;
/// - the softmax scale: `1/√head_dim`, except GPT-2 with `scale_attn_weights: false` and T5
///   (1), and Gemma 2 and 3 (`query_pre_attn_scalar^-1/2`); GPT-2's layer `i` divides it by
///   `i + 1` with `scale_attn_by_inverse_layer_idx`;
/// - query/key RMS norms: Qwen3 (per head), Gemma 3 (per head, scale `1 + w`), OLMo 2
///   (over all heads) and Llama 4 (`use_qk_norm`: per head, no scale, RoPE layers only,
///   after the rotation, so a RoPE attention factor s cancels: the block's norm takes ε/s² and
///   its rotation factor 1), ε from `rms_norm_eps`;
/// - Gemma 4 (`gemma4_text`, as its class fills a file: see `hf::gemma4`): full layers
///   `global_head_dim` wide (512) with `num_global_key_value_heads` under `attention_k_eq_v`,
///   or a file's `per_layer_config`; the last layer full; the class's per-type RoPE (θ 10000
///   on sliding layers, proportional over a quarter at 1e6 on full ones) unless the file
///   nests its own; q/k norms, the values' scale-free norm, `attention_k_eq_v` on full layers,
///   a scale of 1; KV-sharing layers and bidirectional attention are refused;
/// - Llama 4's chunked attention on its RoPE layers (`attention_chunk_size`, or `layer_types`)
///   and its attention temperature on its NoPE layers (`attn_temperature_tuning`,
///   `attn_scale`, `floor_scale`);
/// - sliding windows (`sliding_window` with its class default: Mistral, Phi-3, and per layer
///   Qwen2/3, Gemma 2/3 and gpt-oss, see [`Self::from_json_layer`]; ModernBERT's
///   bidirectional `local_attention / 2` on either side), Gemma 2's logit soft cap
///   (`attn_logit_softcapping`, 50 by default; Gemma 3's attention ignores the key, as HF's
///   `Gemma3Attention` does), gpt-oss's sink logits;
/// - the encoding: RoPE through [`RopeConfig::from_hf_json`] (every scaling, partial and
///   interleaved rotary; partial only where the model's HF code reads it: Phi-3, GPT-NeoX,
///   GPT-J, while the Llama-style families rotate the whole head whatever
///   `partial_rotary_factor` says and refuse one that would shorten a scaled RoPE's table), ALiBi (BLOOM; MPT always, with its own slopes and the largest
///   exponent 8, since HF's `MptModel` ignores `attn_config.alibi` and
///   `attn_config.alibi_bias_max`; Falcon's `alibi` with its bfloat16 rounding,
///   [`AlibiSlopes::Falcon`]), T5's `relative_attention_num_buckets` and
///   `relative_attention_max_distance`, none for GPT-2;
/// - MPT's `attn_config.softmax_scale`;
/// - DeepSeek V2/V3's multi-head latent attention (see [`HfFamily::DeepSeek`]: ranks and head
///   widths, RoPE over `qk_rope_head_dim`, YaRN's `mscale_all_dim` in the scale);
///
/// Settings the block does not have yet are refused rather than ignored: linear layer types
/// (and chunked ones outside Llama 4), MPT's `attn_config.clip_qkv` and `qk_ln`. (A top-level
/// `clip_qkv` is read by none of these models' HF code, OLMo 2's included, and is ignored.) A
/// file whose layers differ (sliding and full, or GPT-2's scale per layer) is read one layer at
/// a time.
///
/// Decoders are causal; ModernBERT and Pixtral's vision encoder (`pixtral`, axial 2-D RoPE
/// over multimodal positions) are not; T5 reads as its encoder's self-attention
/// (bidirectional buckets, not causal), [`Self::with_causal`] gives its decoder's.
///
/// # Example
/// ```
/// use candle_core::{DType, Device, Module, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use candle_posenc::hf::{HfAttentionConfig, HfFamily};
///
/// let json = r#"{"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4,
///     "num_key_value_heads": 2, "rope_theta": 1000000.0, "max_position_embeddings": 4096}"#;
/// let config = HfAttentionConfig::from_json(json)?;
/// assert_eq!(config.family, HfFamily::Llama);
/// assert!(config.attention.bias && !config.attention.out_bias);
/// // A real model: `VarBuilder::from_mmaped_safetensors` over its files, and the layer's prefix.
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
/// let block = config.load(vb.pp("model.layers.0.self_attn"))?;
/// let x = Tensor::zeros((1, 5, 64), DType::F32, &Device::Cpu)?;
/// assert_eq!(block.forward(&x)?.dims(), &[1, 5, 64]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct HfAttentionConfig {
    /// The family (weight names and layout).
    pub family: HfFamily,
    /// The block's settings.
    pub attention: AttentionConfig,
    /// The positional encoding.
    pub encoding: EncodingConfig,
}

/// Where each derived setting came from, so a value the checks refuse is blamed on its key.
#[derive(Default)]
struct Keys(HashMap<&'static str, String>);

impl Keys {
    fn set(&mut self, field: &'static str, key: impl Into<String>) {
        self.0.insert(field, key.into());
    }
}

impl HfAttentionConfig {
    /// Reads the attention settings of an HF `config.json` (see the type's docs for the keys).
    ///
    /// # Errors
    /// [`Error::HfConfig`] naming the key: text that is not a JSON object; a `model_type` that
    /// is missing or not one of [`HfFamily`]'s; a missing size; a value of the wrong type or
    /// out of range (the checks of [`AttentionConfig::validate`] and of the encoding's
    /// configuration, reported under the key the value came from); a setting the block does
    /// not support.
    pub fn from_json(text: &str) -> Result<Self> {
        if let Some(inner) = text_model(text)? {
            return Self::from_json(&inner);
        }
        let map = parse_root(text)?;
        let top = Obj {
            map: &map,
            prefix: "",
        };
        if let Some(model_type) = top.str("model_type")?.map(canonical) {
            if let Some(key) = layers_differ(&top, model_type)? {
                return Err(problem(
                    key,
                    "gives the layers different attention (sliding-window, chunked and full layers, or layers with and without RoPE); read one layer with HfAttentionConfig::from_json_layer",
                ));
            }
        }
        Self::read(text, 0)
    }

    /// Reads the attention settings of layer `layer` (from 0) of an HF `config.json`: as
    /// [`Self::from_json`], with the layer's own kind where layers differ — a sliding window on
    /// sliding-attention layers (`layer_types`, or the model's default pattern: Qwen's
    /// `max_window_layers`, Gemma 2 and gpt-oss alternating, Gemma 3 every
    /// `sliding_window_pattern`-th layer full, Cohere2 every fourth, ModernBERT every
    /// `global_attn_every_n_layers`-th from layer 0), Gemma 3's and ModernBERT's local RoPE
    /// there, and no encoding on the NoPE layers of SmolLM3 and Llama 4 (`no_rope_layers`) and
    /// on Cohere2's full-attention layers; Llama 4's chunks on its RoPE layers and temperature
    /// tuning on its NoPE layers.
    ///
    /// # Errors
    /// As [`Self::from_json`]; [`Error::HfConfig`] naming `num_hidden_layers` (or `n_layer`,
    /// `n_layers`) for a layer past the model's layers, and `layer_types` for a layer past its
    /// entries or a layer type the block does not have (`chunked_attention`).
    pub fn from_json_layer(text: &str, layer: usize) -> Result<Self> {
        Self::read(text, layer)
    }

    fn read(text: &str, layer: usize) -> Result<Self> {
        if let Some(inner) = text_model(text)? {
            return Self::read(&inner, layer);
        }
        let map = parse_root(text)?;
        let top = Obj {
            map: &map,
            prefix: "",
        };
        let model_type = canonical(top.required("model_type", top.str("model_type")?)?);
        let family = HfFamily::from_model_type(model_type).ok_or_else(|| {
            problem(
                "model_type",
                format!(
                    "is `{model_type}`, expected one of llama, mistral, qwen2, qwen3, gemma, gemma2, gemma3_text, olmo2, gpt_oss, smollm3, cohere2, llama4_text, gemma4_text, pixtral, phi3, gpt_neox, bloom, gpt2, gptj, falcon, t5, mpt, modernbert, deepseek_v2, deepseek_v3"
                ),
            )
        })?;
        refuse_unsupported(&top, model_type)?;
        refuse_typed_nulls(&top, model_type)?;
        check_layer(&top, layer)?;
        if model_type == "gemma4_text" {
            gemma4::refuse_rope_scaling(&top)?;
            let layers = top.usize("num_hidden_layers")?.unwrap_or(0);
            let shared = top.usize("num_kv_shared_layers")?.unwrap_or(0);
            // The last `shared` layers reuse earlier keys: layer + shared ≥ layers, without
            // the sum (both are the file's numbers).
            if shared > 0 && layer >= layers.saturating_sub(shared) {
                return Err(problem(
                    "num_kv_shared_layers",
                    format!(
                        "makes layer {layer} reuse the keys and values of an earlier layer, which the attention block does not support yet"
                    ),
                ));
            }
        }
        if family == HfFamily::DeepSeek {
            return read_latent(text, &top, model_type);
        }
        let kind = layer_kind(&top, model_type, layer)?;
        // The class defaults of the file's own model_type (a Qwen-VL text model's, not Qwen's).
        let defaults = defaults_of(&top)?;
        let mut keys = Keys::default();
        let (hidden, hidden_key) = first(&top, &["hidden_size", "n_embd", "d_model", "n_embed"])?;
        let (heads, heads_key) = first(
            &top,
            &["num_attention_heads", "n_head", "num_heads", "n_heads"],
        )?;
        keys.set("d_model", hidden_key);
        keys.set("num_heads", heads_key);
        check_even_split(model_type, (hidden, hidden_key), (heads, heads_key))?;
        let mut attention = AttentionConfig::new(hidden, heads).with_causal(true);
        // Key/value heads.
        let kv_heads = match family {
            HfFamily::Falcon => {
                if top.bool("new_decoder_architecture")?.unwrap_or(false) {
                    keys.set("num_kv_heads", "num_kv_heads");
                    top.usize("num_kv_heads")?.unwrap_or(heads)
                } else if top.bool("multi_query")?.unwrap_or(true) {
                    keys.set("num_kv_heads", "multi_query");
                    1
                } else {
                    heads
                }
            }
            HfFamily::Llama | HfFamily::Phi3 => {
                keys.set("num_kv_heads", "num_key_value_heads");
                match top.map.get("num_key_value_heads") {
                    // The classes typed `int | None` replace a null with the heads; the others
                    // refuse it.
                    Some(Value::Null)
                        if null_is_derived(top.str("model_type")?, "num_key_value_heads") =>
                    {
                        heads
                    }
                    Some(Value::Null) => return Err(null_refused("num_key_value_heads")),
                    _ => top
                        .usize("num_key_value_heads")?
                        .unwrap_or(defaults.num_key_value_heads.unwrap_or(heads)),
                }
            }
            _ => heads,
        };
        attention = attention.with_kv_heads(kv_heads);
        // Head width.
        let head_key = if family == HfFamily::T5 {
            "d_kv"
        } else {
            "head_dim"
        };
        if family == HfFamily::Falcon && top.map.contains_key("head_dim") {
            // FalconConfig's head_dim is a read-only property (hidden_size / heads): HF fails
            // to load a file that sets it.
            return Err(problem(
                "head_dim",
                "is set, but HF's FalconConfig derives it as hidden_size / num_attention_heads and fails to load a file that gives it; leave the key out",
            ));
        }
        if matches!(family, HfFamily::Llama | HfFamily::Phi3)
            && top.map.get("head_dim").is_some_and(Value::is_null)
            && !null_is_derived(top.str("model_type")?, "head_dim")
        {
            return Err(null_refused("head_dim"));
        }
        // Qwen2-VL's and Qwen2.5-VL's attention splits hidden_size evenly while their rotary
        // embedding reads head_dim, so HF fails on a file where the two differ.
        if matches!(
            top.str("model_type")?,
            Some("qwen2_vl_text" | "qwen2_5_vl_text")
        ) {
            if let Some(d) = top.usize(head_key)? {
                if heads == 0 || d.checked_mul(heads) != Some(hidden) {
                    return Err(problem(
                        head_key,
                        format!(
                            "is {d}, but this model's attention splits {hidden_key} ({hidden}) \
                             evenly over {heads_key} ({heads}) and its rotation reads {head_key}: \
                             HF fails unless they agree"
                        ),
                    ));
                }
            }
        }
        match top.usize(head_key)? {
            // Pixtral's attention splits hidden_size evenly, whatever head_dim says (its rotary
            // embedding reads head_dim; a mismatch is refused below).
            Some(_) if model_type == "pixtral" => {
                keys.set("head_dim", format!("{} / {}", hidden_key, heads_key))
            }
            Some(d) => {
                attention = attention.with_head_dim(d);
                keys.set("head_dim", head_key);
            }
            // The class's default (T5's d_kv 64, Gemma's 256, Qwen3's 128, ...).
            None if defaults.head_dim.is_some() => {
                attention = attention.with_head_dim(defaults.head_dim.unwrap_or(0));
                keys.set("head_dim", head_key);
            }
            None => keys.set("head_dim", format!("{} / {}", hidden_key, heads_key)),
        }
        // Gemma 4's per-layer overrides (its full-attention layers' wider heads and fewer KV
        // heads).
        if model_type == "gemma4_text" {
            let o = gemma4::overrides(&top, layer, kind)?;
            if let Some((d, key)) = o.head_dim {
                attention = attention.with_head_dim(d);
                keys.set("head_dim", key);
            }
            if let Some((kv, key)) = o.kv_heads {
                attention = attention.with_kv_heads(kv);
                keys.set("num_kv_heads", key);
            }
        }
        // Biases.
        let flag =
            |key: &str, default: bool| -> Result<bool> { Ok(top.bool(key)?.unwrap_or(default)) };
        let (bias, out_bias) = match (family, model_type) {
            (HfFamily::Llama, "qwen2") => (true, false),
            (HfFamily::Llama, "mistral") => (false, false),
            (HfFamily::Llama, "gpt_oss") => {
                let b = flag("attention_bias", true)?;
                (b, b)
            }
            (HfFamily::Llama, _) => {
                let b = flag("attention_bias", false)?;
                (b, b)
            }
            (HfFamily::GptNeoX, _) => {
                let b = flag("attention_bias", true)?;
                (b, b)
            }
            (HfFamily::Falcon, _) => {
                let b = flag("bias", false)?;
                (b, b)
            }
            (HfFamily::Bloom | HfFamily::Gpt2, _) => (true, true),
            (HfFamily::ModernBert | HfFamily::DeepSeek, _) => {
                let b = flag("attention_bias", false)?;
                (b, b)
            }
            (HfFamily::Phi3 | HfFamily::GptJ | HfFamily::T5 | HfFamily::Mpt, _) => (false, false),
        };
        attention = attention.with_bias(bias).with_out_bias(out_bias);
        // Scale and causality.
        if family == HfFamily::T5
            || (family == HfFamily::Gpt2 && !flag("scale_attn_weights", true)?)
        {
            attention = attention.with_softmax_scale(1.0);
        }
        // GPT-2's scale_attn_by_inverse_layer_idx divides layer i's logits by i + 1 as well.
        if family == HfFamily::Gpt2 && flag("scale_attn_by_inverse_layer_idx", false)? {
            let scale = attention.softmax_scale / (layer as f64 + 1.0);
            attention = attention.with_softmax_scale(scale);
            keys.set("softmax_scale", "scale_attn_by_inverse_layer_idx");
        }
        if matches!(family, HfFamily::T5 | HfFamily::ModernBert) || model_type == "pixtral" {
            attention = attention.with_causal(false);
        }
        if matches!(model_type, "gemma2" | "gemma3_text") {
            let scalar = top.f64("query_pre_attn_scalar")?.unwrap_or(256.0);
            attention = attention.with_softmax_scale(1.0 / scalar.sqrt());
            keys.set("softmax_scale", "query_pre_attn_scalar");
        }
        // Gemma 2's attention caps its logits; Gemma 3's (and Gemma 4's) never passes
        // `attn_logit_softcapping` to its attention function, so a cap in the file is not read.
        if model_type == "gemma2" {
            let cap = match top.map.get("attn_logit_softcapping") {
                None => Some(50.0),
                Some(_) => top.f64("attn_logit_softcapping")?,
            };
            attention = attention.with_logit_softcap(cap);
            keys.set("logit_softcap", "attn_logit_softcapping");
        }
        if model_type == "gpt_oss" {
            attention = attention.with_sinks(true);
        }
        if model_type == "gemma4_text" {
            // q and k normalised (below), values too; no further scale.
            attention = attention
                .with_softmax_scale(1.0)
                .with_value_norm(Some(top.f64("rms_norm_eps")?.unwrap_or(1e-6)))
                .with_k_eq_v(
                    kind == LayerKind::Full && top.bool("attention_k_eq_v")?.unwrap_or(false),
                );
            keys.set("value_norm", "rms_norm_eps");
        }
        // MPT keeps its attention settings under attn_config.
        let empty = serde_json::Map::new();
        let attn_config = Obj {
            map: match top.get("attn_config") {
                Some(Value::Object(m)) => m,
                _ => &empty,
            },
            prefix: "attn_config.",
        };
        if family == HfFamily::Mpt {
            if let Some(scale) = attn_config.f64("softmax_scale")? {
                attention = attention.with_softmax_scale(scale);
                keys.set("softmax_scale", "attn_config.softmax_scale");
            }
        }
        if let LayerKind::Chunked(c) = kind {
            attention = attention.with_attention_chunk(Some(c));
            keys.set("attention_chunk", "attention_chunk_size");
        }
        if let LayerKind::Sliding(w) = kind {
            attention = attention.with_sliding_window(Some(w));
            keys.set(
                "sliding_window",
                match family {
                    HfFamily::ModernBert => "local_attention",
                    _ => "sliding_window",
                },
            );
        }
        // Query/key norms.
        let norm = match model_type {
            "qwen3" | "gemma4_text" => {
                Some(QkNormConfig::new().with_eps(top.f64("rms_norm_eps")?.unwrap_or(1e-6)))
            }
            "gemma3_text" => Some(
                QkNormConfig::new()
                    .with_unit_offset(true)
                    .with_eps(top.f64("rms_norm_eps")?.unwrap_or(1e-6)),
            ),
            "olmo2" => Some(
                QkNormConfig::new()
                    .with_scope(QkNormScope::AllHeads)
                    .with_eps(top.f64("rms_norm_eps")?.unwrap_or(1e-5)),
            ),
            // Llama 4's L2 norm (no scale) on its RoPE layers.
            "llama4_text"
                if top.bool("use_qk_norm")?.unwrap_or(true)
                    && uses_rope(&top, model_type, layer)? =>
            {
                Some(
                    QkNormConfig::new()
                        .with_learned_scale(false)
                        .with_eps(top.f64("rms_norm_eps")?.unwrap_or(1e-5)),
                )
            }
            _ => None,
        };
        if norm.is_some() {
            keys.set("qk_norm.eps", "rms_norm_eps");
        }
        attention = attention.with_qk_norm(norm);
        // Llama 4's temperature tuning on its NoPE layers.
        if model_type == "llama4_text"
            && top.bool("attn_temperature_tuning")?.unwrap_or(true)
            && !uses_rope(&top, model_type, layer)?
        {
            attention = attention.with_attention_temperature(Some(AttentionTemperature::new(
                top.f64("attn_scale")?.unwrap_or(0.1),
                top.usize("floor_scale")?.unwrap_or(8192),
            )));
            keys.set("attention_temperature.attn_scale", "attn_scale");
            keys.set("attention_temperature.floor_scale", "floor_scale");
        }
        attention.validate().map_err(|e| blame(e, &keys))?;
        let encoding = match family {
            HfFamily::Gpt2 => EncodingConfig::None,
            HfFamily::Bloom => EncodingConfig::Alibi(AlibiConfig::new(heads)),
            // Falcon-RW: BLOOM's slopes with Falcon's bfloat16 rounding, before the scale.
            HfFamily::Falcon if top.bool("alibi")?.unwrap_or(false) => {
                EncodingConfig::Alibi(AlibiConfig::new(heads).with_slopes(AlibiSlopes::Falcon {
                    head_dim: attention.head_dim,
                }))
            }
            // HF's MptModel builds its ALiBi with the default largest exponent, 8, whatever
            // `attn_config.alibi_bias_max` says, and applies it whatever `attn_config.alibi`
            // says (it has no learned position table); MosaicML's own code honours both.
            HfFamily::Mpt => EncodingConfig::Alibi(
                AlibiConfig::new(heads).with_slopes(AlibiSlopes::Mpt { max_bias: 8.0 }),
            ),
            HfFamily::T5 => {
                let mut t5 = T5Config::new(heads);
                if let Some(n) = top.usize("relative_attention_num_buckets")? {
                    t5 = t5.with_num_buckets(n);
                    keys.set("num_buckets", "relative_attention_num_buckets");
                }
                if let Some(n) = top.usize("relative_attention_max_distance")? {
                    t5 = t5.with_max_distance(n);
                    keys.set("max_distance", "relative_attention_max_distance");
                }
                t5.validate().map_err(|e| blame(e, &keys))?;
                EncodingConfig::T5(t5)
            }
            _ if !uses_rope(&top, model_type, layer)? => EncodingConfig::None,
            _ => {
                // Gemma 4's layers rotate over their own head width.
                let width = match model_type {
                    "gemma4_text" => attention.head_dim,
                    _ => 0,
                };
                let rope = rope_of_layer(text, &top, model_type, kind, width)?;
                if rope.head_dim != attention.head_dim {
                    return Err(problem(
                        "head_dim",
                        format!(
                            "gives the rotary head width {} but the attention head width {}",
                            rope.head_dim, attention.head_dim
                        ),
                    ));
                }
                let mut rope = rope;
                // Llama 4 scales its rotation by the RoPE type's attention factor s and then
                // L2-normalises q and k (modeling_llama4.py), which takes s back out:
                // norm(s·R q) = R q / sqrt(mean(q²) + ε/s²), a rotation is norm-preserving.
                // The block normalises before rotating, so the same is a norm with ε/s² and a
                // rotation with factor 1.
                if model_type == "llama4_text" {
                    if let Some(norm) = attention.qk_norm.as_mut() {
                        let s = rope
                            .scaling
                            .frequencies(rope.rotary_dim, rope.base, 0)?
                            .attention_factor;
                        if s != 1.0 {
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
                        }
                    }
                }
                EncodingConfig::Rotary(rope)
            }
        };
        Ok(Self {
            family,
            attention,
            encoding,
        })
    }

    /// Reads `config.json` from `path` as [`Self::from_json`] does.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be read; as [`Self::from_json`].
    pub fn from_file(path: impl AsRef<std::path::Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_json(&text)
    }

    /// The same layer, causal or not. For T5 this also switches the buckets: `true` gives its
    /// decoder's self-attention (causal buckets), `false` its encoder's.
    pub fn with_causal(mut self, causal: bool) -> Self {
        self.attention = self.attention.with_causal(causal);
        if let EncodingConfig::T5(t5) = &mut self.encoding {
            t5.bidirectional = !causal;
        }
        self
    }

    /// Builds the block from one layer's tensors under HF's names, `vb` being the attention
    /// module's prefix (e.g. `model.layers.0.self_attn`, `gpt_neox.layers.0.attention`,
    /// `h.0.self_attention`, `h.0.attn`, `encoder.block.0.layer.0.SelfAttention`). Fused
    /// projections are split and transposed weights turned once, here. Learned encoding tables
    /// (T5's) are read from the same prefix; a T5 layer past the first has none, so pass the
    /// first layer's encoding to [`Self::load_with_encoding`].
    ///
    /// # Errors
    /// [`Error::MissingTensor`] / [`Error::TensorShape`] naming the HF tensor that is absent or
    /// misshapen; [`Error::DType`] for an integer `VarBuilder`; [`Error::InvalidConfig`] as
    /// [`AttentionConfig::validate`] and [`EncodingConfig::validate`] when the public fields
    /// were changed after parsing (checked before any size is computed from them).
    pub fn load(&self, vb: VarBuilder) -> Result<MultiHeadAttention> {
        let mut map = self.tensors(&vb, true)?;
        let ours = VarBuilder::from_tensors(std::mem::take(&mut map), vb.dtype(), vb.device());
        let encoding = self.encoding.build(ours.clone())?;
        MultiHeadAttention::new(&self.attention, encoding, ours)
    }

    /// Builds the block from one layer's tensors as [`Self::load`] does, with `encoding`
    /// plugged in instead of one built from the layer (a T5 layer sharing the first layer's
    /// table: `first.encoding().cloned()`).
    ///
    /// # Errors
    /// As [`Self::load`].
    pub fn load_with_encoding(
        &self,
        encoding: Option<Arc<dyn PositionalEncoding>>,
        vb: VarBuilder,
    ) -> Result<MultiHeadAttention> {
        let map = self.tensors(&vb, false)?;
        let ours = VarBuilder::from_tensors(map, vb.dtype(), vb.device());
        MultiHeadAttention::new(&self.attention, encoding, ours)
    }

    /// The layer's tensors under the block's names.
    fn tensors(&self, vb: &VarBuilder, with_table: bool) -> Result<HashMap<String, Tensor>> {
        crate::error::check_float("attention weights (the VarBuilder's dtype)", vb.dtype())?;
        // The fields are public: check them again before their sizes shape any read (a T5
        // table's shape comes from the encoding).
        self.attention.validate()?;
        self.encoding.validate()?;
        let table = match (&self.encoding, with_table) {
            (EncodingConfig::T5(t5), true) => Some((t5.num_buckets, t5.num_heads)),
            _ => None,
        };
        remap(&self.layout(), &self.attention, table, vb)
    }

    /// Where this layer's family keeps its weights.
    fn layout(&self) -> WeightLayout {
        let separate = |o| WeightLayout {
            qkv: QkvLayout::Separate(["q_proj", "k_proj", "v_proj"]),
            out: o,
            out_conv1d: false,
        };
        let fused = |qkv, o| WeightLayout {
            qkv,
            out: o,
            out_conv1d: false,
        };
        match self.family {
            HfFamily::Llama => separate("o_proj"),
            HfFamily::GptJ => separate("out_proj"),
            HfFamily::Phi3 => fused(QkvLayout::Stacked("qkv_proj"), "o_proj"),
            HfFamily::GptNeoX | HfFamily::Bloom => {
                fused(QkvLayout::PerHead("query_key_value"), "dense")
            }
            HfFamily::Falcon => {
                let a = &self.attention;
                let qkv = if a.num_kv_heads == a.num_heads {
                    QkvLayout::PerHead("query_key_value")
                } else if a.num_kv_heads == 1 {
                    QkvLayout::Stacked("query_key_value")
                } else {
                    QkvLayout::Grouped("query_key_value")
                };
                fused(qkv, "dense")
            }
            HfFamily::Gpt2 => WeightLayout {
                qkv: QkvLayout::Conv1D("c_attn"),
                out: "c_proj",
                out_conv1d: true,
            },
            HfFamily::T5 => WeightLayout {
                qkv: QkvLayout::Separate(["q", "k", "v"]),
                out: "o",
                out_conv1d: false,
            },
            HfFamily::Mpt => fused(QkvLayout::Stacked("Wqkv"), "out_proj"),
            HfFamily::ModernBert => fused(QkvLayout::Stacked("Wqkv"), "Wo"),
            HfFamily::DeepSeek => fused(QkvLayout::Latent, "o_proj"),
        }
    }
}

/// A DeepSeek V2/V3 layer: multi-head latent attention with decoupled RoPE.
///
/// Keys: `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`, `q_lora_rank` (null: one query
/// projection), `kv_lora_rank`, `attention_bias`; the rotary settings (`rope_parameters` or
/// `rope_scaling`, `rope_theta`, `max_position_embeddings`) over `qk_rope_head_dim`
/// features, interleaved pairs (V2 always, V3 by `rope_interleave`, default true); a softmax
/// scale of `(nope + rope)^-1/2`, times `mscale²` with `mscale = 0.1·mscale_all_dim·ln(factor)
/// + 1` when the scaling is not the default and names `mscale_all_dim`.
fn read_latent(text: &str, top: &Obj, model_type: &str) -> Result<HfAttentionConfig> {
    let mut keys = Keys::default();
    let (hidden, hidden_key) = first(top, &["hidden_size"])?;
    let (heads, heads_key) = first(top, &["num_attention_heads"])?;
    check_even_split(model_type, (hidden, hidden_key), (heads, heads_key))?;
    keys.set("d_model", hidden_key);
    keys.set("num_heads", heads_key);
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
    // HF's latent attention repeats its keys num_attention_heads / num_key_value_heads times
    // over keys that already have a head each: any other count than the heads fails there.
    // (A null is the heads, as the classes' __post_init__ makes it.)
    let kv_heads = match top.map.get("num_key_value_heads") {
        Some(Value::Null) => heads,
        _ => top
            .usize("num_key_value_heads")?
            .or(class_defaults(Some(model_type)).num_key_value_heads)
            .unwrap_or(heads),
    };
    if kv_heads != heads {
        return Err(problem(
            "num_key_value_heads",
            format!(
                "is {kv_heads}{}, but HF's latent attention needs it equal to num_attention_heads ({heads})",
                if top.get("num_key_value_heads").is_none() { " (the class default)" } else { "" }
            ),
        ));
    }
    let bias = top.bool("attention_bias")?.unwrap_or(false);
    let interleaved = match model_type {
        "deepseek_v2" => true,
        _ => top.bool("rope_interleave")?.unwrap_or(true),
    };
    // The rotary settings over the rotating features only.
    let mut map = parse_root(text)?;
    map.insert("model_type".into(), Value::from("llama"));
    map.insert("head_dim".into(), Value::from(rope_dim));
    map.insert("rope_interleave".into(), Value::from(interleaved));
    // (A partial_rotary_factor is read as HF's DeepSeek reads it: not at all with the default
    // RoPE, refused where it would shorten a scaled RoPE's table.)
    let mut rope =
        RopeConfig::from_hf_json(&Value::Object(map).to_string()).map_err(|e| match e {
            // The head width given to the rotary settings is qk_rope_head_dim.
            Error::HfConfig { key, problem } if key == "head_dim" => Error::HfConfig {
                key: "qk_rope_head_dim".into(),
                problem,
            },
            other => other,
        })?;
    rope.head_dim = head_dim;
    // YaRN's mscale_all_dim sharpens the softmax.
    let mut scale = 1.0 / (head_dim as f64).sqrt();
    if let RopeScaling::Yarn(y) = &rope.scaling {
        if let Some(all) = y.mscale_all_dim {
            if y.factor > 1.0 {
                let m = 0.1 * all * y.factor.ln() + 1.0;
                scale *= m * m;
            }
        }
    }
    keys.set("softmax_scale", "rope_parameters.mscale_all_dim");
    let latent = LatentConfig::new(q_lora_rank, kv_lora_rank, rope_dim, v_head_dim);
    let attention = AttentionConfig::new(hidden, heads)
        .with_head_dim(head_dim)
        .with_causal(true)
        .with_bias(bias)
        .with_softmax_scale(scale)
        .with_latent(Some(latent));
    attention.validate().map_err(|e| blame(e, &keys))?;
    Ok(HfAttentionConfig {
        family: HfFamily::DeepSeek,
        attention,
        encoding: EncodingConfig::Rotary(rope),
    })
}

/// The vision-language models whose language model's attention loads: their `config.json`
/// nests it under `text_config`.
const VISION_LANGUAGE: [&str; 6] = [
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "llama4",
    "gemma4",
];

/// The `text_config` of a vision-language model's `config.json`, as text, if this is one.
fn text_model(text: &str) -> Result<Option<String>> {
    let map = parse_root(text)?;
    let top = Obj {
        map: &map,
        prefix: "",
    };
    match top.str("model_type")? {
        Some(t) if VISION_LANGUAGE.contains(&t) => match top.get("text_config") {
            // A text_config without its model_type is the class's text config.
            Some(Value::Object(inner)) => {
                let mut inner = inner.clone();
                if !inner.contains_key("model_type") {
                    inner.insert("model_type".into(), Value::from(format!("{t}_text")));
                }
                Ok(Some(Value::Object(inner).to_string()))
            }
            // Qwen2-VL's and Qwen2.5-VL's classes read a flat file's keys as the text model's.
            None if matches!(t, "qwen2_vl" | "qwen2_5_vl") => {
                let mut flat = map.clone();
                flat.insert("model_type".into(), Value::from(format!("{t}_text")));
                Ok(Some(Value::Object(flat).to_string()))
            }
            _ => Err(problem(
                "text_config",
                format!("is missing, expected the language model's configuration of `{t}`"),
            )),
        },
        _ => Ok(None),
    }
}

/// Language models of vision-language models read as the text model they are: Qwen2-VL's as
/// Qwen2 (biases on q, k, v), Qwen3-VL's as Qwen3 (per-head q/k norms); their multimodal RoPE
/// comes with `rope_parameters`.
fn canonical(model_type: &str) -> &str {
    match model_type {
        "qwen2_vl_text" | "qwen2_5_vl_text" => "qwen2",
        "qwen3_vl_text" | "qwen3_vl_moe_text" => "qwen3",
        other => other,
    }
}

/// Refuses a width that the heads do not divide where HF's config class for `model_type`
/// refuses it (its `validate_architecture`), whatever `head_dim` says.
fn check_even_split(
    model_type: &str,
    (hidden, hidden_key): (usize, &str),
    (heads, heads_key): (usize, &str),
) -> Result<()> {
    let checked = matches!(
        model_type,
        "llama" | "gemma2" | "gemma3_text" | "gpt_neox" | "deepseek_v2"
    );
    if checked && (heads == 0 || !hidden.is_multiple_of(heads)) {
        return Err(problem(
            heads_key,
            format!(
                "is {heads}, which does not divide {hidden_key} ({hidden}); HF's configuration \
                 of {model_type} refuses the file"
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
fn refuse_typed_nulls(top: &Obj, model_type: &str) -> Result<()> {
    let keys: &[&str] = match model_type {
        "llama" | "gemma" | "olmo2" | "llama4_text" | "qwen3_vl_text" | "qwen3_vl_moe_text" => {
            &["attention_bias"]
        }
        "gemma4_text" => &gemma4::TYPED_FIELDS,
        // (These four build a sliding-window mask for every model, which fails without a
        // window, whatever the layers are.)
        "gpt_oss" => &["attention_bias", "sliding_window"],
        "cohere2" => &["attention_bias", "sliding_window_pattern", "sliding_window"],
        "gemma2" => &["attention_bias", "query_pre_attn_scalar", "sliding_window"],
        "gemma3_text" => &[
            "attention_bias",
            "query_pre_attn_scalar",
            "sliding_window_pattern",
            "sliding_window",
        ],
        "qwen2" => &["use_sliding_window", "max_window_layers"],
        "qwen3" => &["attention_bias", "use_sliding_window", "max_window_layers"],
        "smollm3" => &["attention_bias", "use_sliding_window"],
        _ => &[],
    };
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
                    "is null, which HF's configuration of {model_type} refuses or cannot compute \
                     with; leave the key out for its default"
                ),
            ));
        }
    }
    Ok(())
}

/// Refuses the settings that would change HF's answer and that the block does not have.
fn refuse_unsupported(top: &Obj, model_type: &str) -> Result<()> {
    let unsupported = |key: &str, what: &str| -> Error {
        problem(
            key,
            format!("asks for {what}, which the attention block does not support yet"),
        )
    };
    if model_type == "mpt" {
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
    if model_type == "gemma4_text" && top.str("use_bidirectional_attention")?.is_some() {
        return Err(unsupported(
            "use_bidirectional_attention",
            "bidirectional attention over some or all tokens",
        ));
    }
    Ok(())
}

/// Whether a layer attends to every key, through a sliding window of `w` keys, or within
/// chunks of `c` keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LayerKind {
    Full,
    Sliding(usize),
    Chunked(usize),
}

/// The models whose layers differ by `layer_types`.
const LAYERED: [&str; 10] = [
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "gpt_oss",
    "smollm3",
    "cohere2",
    "modernbert",
    "llama4_text",
    "gemma4_text",
];

/// The window a sliding layer of this model uses, `None` when it has none: `sliding_window`,
/// with the config class's default when the key is absent, and Qwen's `use_sliding_window`
/// switch; ModernBERT's half of `local_attention` (128 by default) on either side.
fn window_size(top: &Obj, model_type: &str) -> Result<Option<usize>> {
    if model_type == "modernbert" {
        return Ok(Some(top.usize("local_attention")?.unwrap_or(128) / 2));
    }
    let defaults = defaults_of(top)?;
    // Qwen3-VL's text model has no sliding window, whatever the file says.
    if defaults.mrope.is_some_and(|m| m.interleaved) {
        return Ok(None);
    }
    let window = match top.map.get("sliding_window") {
        None => defaults.sliding_window,
        Some(_) => top.usize("sliding_window")?,
    };
    Ok(match model_type {
        // Qwen2's and Qwen3's classes null the window unless use_sliding_window; SmolLM3's
        // keeps it, and its model masks the listed sliding layers with it whatever the switch
        // says (modeling_smollm3.py), the switch only shaping its default layer types.
        "qwen2" | "qwen3" if top.bool("use_sliding_window")? != Some(true) => None,
        "mistral" | "phi3" => window,
        m if LAYERED.contains(&m) => window,
        _ => None,
    })
}

/// The kind of layer `layer`: from `layer_types` where the model reads it, else from the
/// model's default pattern.
pub(super) fn layer_kind(top: &Obj, model_type: &str, layer: usize) -> Result<LayerKind> {
    if model_type == "llama4_text" {
        return llama4_layer_kind(top, layer);
    }
    let window = window_size(top, model_type)?;
    if !LAYERED.contains(&model_type) {
        return Ok(window.map_or(LayerKind::Full, LayerKind::Sliding));
    }
    if let Some(entry) = layer_entry(top, "layer_types", layer, "a list of layer types")? {
        // Gemma 4's class makes the last listed layer a full one, whatever its entry says.
        let listed = top
            .get("layer_types")
            .and_then(Value::as_array)
            .map(Vec::len);
        if model_type == "gemma4_text" && listed.and_then(|n| n.checked_sub(1)) == Some(layer) {
            return Ok(LayerKind::Full);
        }
        return match entry.as_str() {
            Some("full_attention" | "sliding_attention") if window.is_none() => {
                // HF's sliding-window mask fails without a window, and the model builds it
                // for every layer as soon as any layer slides: a full layer of such a file
                // is refused too.
                let slides = |v: &Value| v.as_str() == Some("sliding_attention");
                match top
                    .get("layer_types")
                    .and_then(Value::as_array)
                    .and_then(|types| types.iter().position(slides))
                {
                    None => Ok(LayerKind::Full),
                    Some(first) => Err(problem(
                        "layer_types",
                        format!(
                            "gives layer {first} sliding attention, but the model has no window (sliding_window is null or absent{}; HF's sliding-window mask fails without one)",
                            match model_type {
                                "qwen2" | "qwen3" => ", or use_sliding_window is not true",
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
        };
    }
    let sliding = match model_type {
        "qwen2" | "qwen3" => {
            let first = defaults_of(top)?.max_window_layers;
            layer >= top.usize("max_window_layers")?.unwrap_or(first)
        }
        // SmolLM3's class makes its NoPE layers sliding only under use_sliding_window.
        "smollm3" => {
            top.bool("use_sliding_window")? == Some(true) && !uses_rope(top, model_type, layer)?
        }
        "modernbert" => {
            let every = top.usize("global_attn_every_n_layers")?.unwrap_or(3).max(1);
            !layer.is_multiple_of(every)
        }
        "gemma3_text" | "cohere2" | "gemma4_text" => {
            let default = if model_type == "cohere2" { 4 } else { 6 };
            // Gemma 4's class does not read the key (every sixth layer is full); the others
            // take a layer's number modulo it, so 0 fails there.
            let pattern = match model_type {
                "gemma4_text" => default,
                _ => top.usize("sliding_window_pattern")?.unwrap_or(default),
            };
            if pattern == 0 {
                return Err(problem(
                    "sliding_window_pattern",
                    "is 0, expected at least 1 (every n-th layer is a full-attention one)",
                ));
            }
            // Gemma 4's last layer is always a full one.
            let last = model_type == "gemma4_text"
                && top
                    .usize("num_hidden_layers")?
                    .is_some_and(|n| n.checked_sub(1) == Some(layer));
            !every_nth(layer, pattern) && !last
        }
        _ => !every_nth(layer, 2), // Gemma 2, gpt-oss
    };
    // (Gemma 2's and 3's, gpt-oss's and Cohere2's null window is refused with the file.)
    Ok(match (sliding, window) {
        (true, Some(w)) => LayerKind::Sliding(w),
        _ => LayerKind::Full,
    })
}

/// A Llama 4 layer: chunked attention (`attention_chunk_size`, 8192 by default) on its RoPE
/// layers, full attention on its NoPE layers, or as `layer_types` says.
fn llama4_layer_kind(top: &Obj, layer: usize) -> Result<LayerKind> {
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
        None => uses_rope(top, "llama4_text", layer)?,
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

/// Whether `layer` (from 0) is every `n`-th layer counting from 1, i.e. `(layer + 1) mod n =
/// 0`, without the sum (`layer` is the caller's number). `n` is at least 1.
fn every_nth(layer: usize, n: usize) -> bool {
    layer % n == n - 1
}

/// Refuses a layer index past the model's layers when the file gives their number
/// (`num_hidden_layers`, or GPT-2's, BLOOM's and GPT-J's `n_layer`, MPT's `n_layers`).
///
/// # Errors
/// [`Error::HfConfig`] naming the count's key for `layer ≥` the count.
fn check_layer(top: &Obj, layer: usize) -> Result<()> {
    for key in ["num_hidden_layers", "n_layer", "n_layers"] {
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

/// Entry `layer` of the per-layer list at `key` (`None` when the key is absent).
///
/// # Errors
/// [`Error::HfConfig`] naming `key` when it is not a list (`expected` says of what) or has no
/// entry for `layer`.
fn layer_entry<'a>(
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

/// Whether layer `layer` rotates its queries and keys: SmolLM3's and Llama 4's `no_rope_layers` (1 = RoPE,
/// 0 = no positional encoding; by default every `no_rope_layer_interval`-th layer, 4, is NoPE);
/// Cohere2's sliding-window layers (its full-attention layers have no positional encoding).
fn uses_rope(top: &Obj, model_type: &str, layer: usize) -> Result<bool> {
    // Cohere2 rotates on its sliding-window layers only.
    if model_type == "cohere2" {
        return Ok(matches!(
            layer_kind(top, model_type, layer)?,
            LayerKind::Sliding(_)
        ));
    }
    if !matches!(model_type, "smollm3" | "llama4_text") {
        return Ok(true);
    }
    // (A null list is the default pattern in both classes, as an absent one; Llama 4's takes
    // an empty one as the default too: Llama 4 Scout's file has `"no_rope_layers": []`.)
    let entry = match top.get("no_rope_layers") {
        Some(Value::Array(a)) if a.is_empty() && model_type == "llama4_text" => None,
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
fn layers_differ(top: &Obj, model_type: &str) -> Result<Option<&'static str>> {
    // GPT-2's layers scaled by their number differ unless there is one.
    if model_type == "gpt2"
        && top.bool("scale_attn_by_inverse_layer_idx")? == Some(true)
        && first(top, &["n_layer", "num_hidden_layers"]).map_or(true, |(n, _)| n > 1)
    {
        return Ok(Some("scale_attn_by_inverse_layer_idx"));
    }
    let windows = window_size(top, model_type)?.is_some();
    if !LAYERED.contains(&model_type)
        || !(windows || matches!(model_type, "smollm3" | "llama4_text"))
    {
        // (Cohere2 without a window has no RoPE on any layer: uniform.)
        return Ok(None);
    }
    let listed = |key| top.get(key).and_then(Value::as_array).map_or(0, Vec::len);
    let layers = listed("layer_types")
        .max(listed("no_rope_layers"))
        .max(first(top, &["num_hidden_layers"]).map_or(1, |(n, _)| n));
    let of = |layer| -> Result<(LayerKind, bool)> {
        Ok((
            layer_kind(top, model_type, layer)?,
            uses_rope(top, model_type, layer)?,
        ))
    };
    let first_kind = of(0)?;
    for layer in 1..layers.min(1 << 16) {
        if of(layer)? != first_kind {
            if uses_rope(top, model_type, layer)? != first_kind.1 {
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

/// The rotary configuration of a layer of `kind`.
///
/// Gemma 3 and ModernBERT keep one entry per layer type (`rope_parameters.full_attention`,
/// `.sliding_attention`), which their classes fill as `convert_rope_params_to_dict` does: a
/// missing or null entry is the default RoPE, flat keys beside the entries are not read, an
/// older `rope_scaling` is merged into the full entry (Gemma 3) or both (ModernBERT), and an
/// entry without `rope_theta` takes the type's θ: Gemma 3's `rope_theta` (1e6) on full
/// layers and `rope_local_base_freq` (10000) on sliding ones, ModernBERT's
/// `global_rope_theta` (160000) and `local_rope_theta` (10000). Other models' nested entries
/// take the top-level θ or the class's (the shared `convert_rope_params_to_dict`).
///
/// `head_dim` (when not 0) replaces the file's `head_dim` for this layer (Gemma 4's full layers
/// are wider).
fn rope_of_layer(
    text: &str,
    top: &Obj,
    model_type: &str,
    kind: LayerKind,
    head_dim: usize,
) -> Result<RopeConfig> {
    let type_name = match kind {
        LayerKind::Full => "full_attention",
        LayerKind::Sliding(_) => "sliding_attention",
        LayerKind::Chunked(_) => "chunked_attention",
    };
    let mut map = top.map.clone();
    if head_dim > 0 {
        map.insert("head_dim".into(), Value::from(head_dim));
    }
    let entry = match model_type {
        // Gemma 4's class fills its own per-type parameters and never reads the flat keys.
        "gemma4_text" => Some(gemma4::rope_entry(top, kind)?),
        "gemma3_text" | "modernbert" => Some(per_type_entry(top, model_type, kind, type_name)?),
        _ => top
            .get("rope_parameters")
            .and_then(Value::as_object)
            .and_then(|p| p.get(type_name))
            .cloned(),
    };
    match entry {
        Some(entry) => {
            map.insert("rope_parameters".into(), entry);
            map.remove("rope_scaling");
        }
        None if head_dim == 0 => return RopeConfig::from_hf_json(text),
        None => {}
    }
    RopeConfig::from_hf_json(&Value::Object(map).to_string())
}

/// Gemma 3's or ModernBERT's parameters for the layer type `type_name`, as their classes'
/// `convert_rope_params_to_dict` fill them (see [`rope_of_layer`]).
///
/// # Errors
/// [`Error::HfConfig`] naming `rope_parameters` when a `rope_scaling` is to be merged into an
/// entry the file lacks (HF's class fails on it), and naming a θ key that is null.
fn per_type_entry(top: &Obj, model_type: &str, kind: LayerKind, type_name: &str) -> Result<Value> {
    let sliding = matches!(kind, LayerKind::Sliding(_));
    let params = top.get("rope_parameters");
    let scaling = top.get("rope_scaling");
    // The entries the class merges an old rope_scaling into.
    let merged: &[&str] = match model_type {
        "gemma3_text" => &["full_attention"],
        _ => &["full_attention", "sliding_attention"],
    };
    if let (Some(scaling), Some(params)) = (scaling, params) {
        for name in merged {
            if !params.get(name).is_some_and(Value::is_object) {
                return Err(problem(
                    "rope_parameters",
                    format!(
                        "has no `{name}` entry to merge rope_scaling ({scaling}) into (HF's config class fails on the file); give the entry or leave rope_scaling out"
                    ),
                ));
            }
        }
    }
    let mut entry = match params.and_then(|p| p.get(type_name)) {
        Some(Value::Object(m)) => m.clone(),
        _ => serde_json::Map::from_iter([("rope_type".to_string(), Value::from("default"))]),
    };
    if let Some(Value::Object(extra)) = scaling.filter(|_| merged.contains(&type_name)) {
        for (k, v) in extra {
            entry.insert(k.clone(), v.clone());
        }
    }
    if !entry.contains_key("rope_theta") {
        let (key, default) = match (model_type, sliding) {
            ("gemma3_text", false) => ("rope_theta", defaults_of(top)?.rope_theta),
            ("gemma3_text", true) => ("rope_local_base_freq", LOCAL_ROPE_THETA),
            (_, false) => ("global_rope_theta", defaults_of(top)?.rope_theta),
            (_, true) => ("local_rope_theta", LOCAL_ROPE_THETA),
        };
        if top.map.get(key).is_some_and(Value::is_null) {
            return Err(problem(
                key,
                "is null, expected a positive θ (HF's rotary code fails on a null one; leave the key out for the class default)",
            ));
        }
        let theta = top.f64(key)?.unwrap_or(default);
        entry.insert("rope_theta".into(), Value::from(theta));
    }
    Ok(Value::Object(entry))
}

/// An out-of-range value reported under the `config.json` key it came from.
fn blame(err: Error, keys: &Keys) -> Error {
    match err {
        Error::InvalidConfig {
            name,
            value,
            expected,
        } => {
            let key = keys
                .0
                .get(name)
                .cloned()
                .unwrap_or_else(|| name.to_string());
            problem(key, format!("gives {name} = {value}, expected {expected}"))
        }
        other => other,
    }
}

/// Whether HF's class for `model_type` (the file's own) replaces a `null` at `key` with the
/// derived value (`num_key_value_heads`: the heads; `head_dim`: the width over the heads)
/// rather than failing on it (a typed field, or a model that then computes with `None`).
fn null_is_derived(model_type: Option<&str>, key: &str) -> bool {
    let model_type = model_type.unwrap_or("");
    match key {
        "num_key_value_heads" => matches!(
            model_type,
            "llama"
                | "qwen2"
                | "qwen3"
                | "olmo2"
                | "smollm3"
                | "cohere2"
                | "phi3"
                | "qwen2_vl_text"
                | "qwen2_5_vl_text"
                | "qwen3_vl_text"
                | "deepseek_v2"
                | "deepseek_v3"
                | "pixtral"
        ),
        "head_dim" => matches!(
            model_type,
            "llama" | "mistral" | "qwen3_vl_moe_text" | "pixtral"
        ),
        _ => false,
    }
}

/// A `null` that the model's HF class refuses.
fn null_refused(key: &str) -> Error {
    problem(
        key,
        "is null, which this model's HF configuration class refuses (or fails on); leave the key out for the class default",
    )
}

/// The configuration class's defaults for the file's own `model_type`.
fn defaults_of(top: &Obj) -> Result<ClassDefaults> {
    Ok(class_defaults(top.str("model_type")?))
}
