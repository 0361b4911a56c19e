//! [`HfAttentionConfig`]: one attention layer of an HF model, read from its `config.json`, and
//! the block built from the layer's tensors under HF's names.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::Tensor;
use candle_nn::VarBuilder;
use serde_json::Value;

use super::checks::{check_file, null_refused};
use super::codegen;
use super::deepseek;
use super::defaults::LOCAL_ROPE_THETA;
use super::gemma4;
use super::inkling;
use super::json::{first, parse_root, problem, Obj};
use super::llama4;
use super::pattern::{
    bidirectional, check_layer, layer_kind, layers_differ, refuse_windowed, uses_rope, LayerKind,
};
use super::registry::{
    self, Bias, HeadDim, LayerRope, ModelSpec, PerTypeRope, QkNorm, Quirks, Scale, TextConfig,
    Window,
};
use super::rope::rope_of_file;
use super::shared::SharedEncodings;
use super::weights::{remap, QkvLayout, Shared, WeightLayout};
use crate::attention::{AttentionConfig, MultiHeadAttention, QkNormConfig, QkNormScope};
use crate::encoding::EncodingConfig;
use crate::error::{Error, Result};
use crate::plug::PositionalEncoding;
use crate::relative::alibi::{AlibiConfig, AlibiSlopes};
use crate::relative::t5::T5Config;
use crate::rotary::RopeConfig;

/// The model families whose attention layers load from HF names, chosen by `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum HfFamily {
    /// `llama`, `mistral`, `ministral`, `starcoder2`, `qwen2`, `qwen3`, `gemma`, `gemma2`,
    /// `gemma3_text`, `olmo2`, `gpt_oss`, `smollm3`, `cohere`, `cohere2`, `llama4_text`,
    /// `gemma4_text`, `glm`, `glm4`, `helium`, `ernie4_5`, `inkling_text`, `pixtral` and the Qwen-VL text
    /// models (`qwen2_vl_text`, `qwen2_5_vl_text`, `qwen3_vl_text`, `qwen3_vl_moe_text`):
    /// `q_proj`, `k_proj`, `v_proj`, `o_proj` (and `q_norm`, `k_norm` for Qwen3, Gemma 3,
    /// OLMo 2, Cohere and Inkling; `sinks` for gpt-oss; Inkling's short convolutions
    /// `k_sconv`, `v_sconv`); RoPE (none on the NoPE layers of SmolLM3 and Llama 4 and on
    /// Cohere2's full-attention layers; Inkling's relative logits, `r_proj` and
    /// `rel_logits_proj.proj`, instead).
    Llama,
    /// `phi3`, `phi4_multimodal`: fused `qkv_proj` (rows `[q; k; v]`), `o_proj`; RoPE
    /// (LongRoPE), partial with `partial_rotary_factor`.
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
    /// `codegen`: fused `qkv_proj` in CodeGen's 4 model-parallel shards, each rows `[q; v;
    /// k]` (see `hf::codegen`), `out_proj`, no biases; RoPE as GPT-J's.
    CodeGen,
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
    /// `qwen2_vl_vision`, `qwen2_5_vl_vision`, `qwen3_vl_vision`, `qwen3_vl_moe_vision`: the
    /// vision encoders' attention, one fused `qkv` (rows `[q; k; v]`) and `proj`, both with
    /// biases; bidirectional; axial 2-D RoPE over the patches' rows and columns
    /// ([`PositionIds::from_patch_grids`](crate::positions::PositionIds::from_patch_grids) in
    /// merge blocks, or [`PositionIds::patches`](crate::positions::PositionIds::patches) from
    /// HF's ids). Packed images attend within their spans of HF's `cu_seqlens`: one sequence
    /// with [`crate::vision::block_diagonal_mask`], or a sequence per span. Qwen2.5-VL's layers that `fullatt_block_indexes` does not list
    /// attend within windows of HF's reordered patches and are refused.
    QwenVision,
    /// `gemma4_vision`: Gemma 4's vision encoder, `q_proj`, `k_proj`, `v_proj`, `o_proj`, each
    /// under `.linear` (HF's clippable linears; clipping, `use_clipped_linears`, is refused),
    /// `q_norm`, `k_norm`; values normalised without a scale, no softmax scale; bidirectional;
    /// axial 2-D RoPE rotating each half of the head by rows and by columns.
    Gemma4Vision,
    /// `deepseek_v2`, `deepseek_v3` (and `kimi_k2`, read as `deepseek_v3`): multi-head latent attention (`q_a_proj`, `q_a_layernorm`,
    /// `q_b_proj` or `q_proj`; `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`; `o_proj`),
    /// RoPE on `qk_rope_head_dim` features of each head (interleaved pairs), YaRN's
    /// `mscale_all_dim` in the softmax scale.
    DeepSeek,
}

impl HfFamily {
    /// The family of an HF `model_type`, if the crate loads it.
    pub fn from_model_type(model_type: &str) -> Option<Self> {
        registry::find(model_type).and_then(|spec| spec.family)
    }
}

/// One attention layer of an HF model: the block's settings, its encoding and where its
/// weights live, read from the model's `config.json`.
///
/// Keys read (as HF transformers reads them for each `model_type`):
/// - the family from `model_type` ([`HfFamily::from_model_type`]); for Qwen2-VL, Qwen2.5-VL,
///   Qwen3-VL and Llama 4 the language model under `text_config` (the first two read as Qwen2
///   and Qwen3, with multimodal RoPE);
/// - sizes: `hidden_size` (`n_embd`, `d_model`, `n_embed`; Qwen2-VL's vision encoder:
///   `embed_dim`), `num_attention_heads` (`n_head`, `num_heads`, `n_heads`), `num_key_value_heads` (Falcon: `multi_query`, `new_decoder_architecture`,
///   `num_kv_heads`), `head_dim` (T5: `d_kv`), else `hidden_size / heads`;
/// - biases: `attention_bias` (Llama, Qwen3, Gemma, OLMo 2, GPT-NeoX, ModernBERT), `bias` (Falcon),
///   `use_bias` (StarCoder2); Qwen2 has biases on q, k and v but not on the output, BLOOM and
///   GPT-2 on all four, Mistral, Ministral, Phi-3, GPT-J and T5 on none;
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
/// - Inkling (`inkling_text`, see `hf::inkling`): `layer_types` (`hybrid`, `hybrid_sliding`)
///   or `local_layer_ids`, the sliding layers' `swa_num_attention_heads`,
///   `swa_num_key_value_heads`, `swa_head_dim` and `sliding_window_size`, the scale
///   `1/head_dim`, the short convolutions' `conv_kernel_size`, and its relative logits (`d_rel`,
///   `rel_extent`, the window on sliding layers; `log_scaling_n_floor`, `log_scaling_alpha` on
///   full layers);
/// - Llama 4's chunked attention on its RoPE layers (`attention_chunk_size`, or `layer_types`)
///   and its attention temperature on its NoPE layers (`attn_temperature_tuning`,
///   `attn_scale`, `floor_scale`);
/// - sliding windows (`sliding_window` with its class default: Mistral, StarCoder2, Phi-3, and
///   per layer Ministral, Qwen2/3, Gemma 2/3 and gpt-oss, see [`Self::from_json_layer`]; ModernBERT's
///   bidirectional `local_attention / 2` on either side; Gemma 3's under
///   `use_bidirectional_attention`, EmbeddingGemma's: bidirectional, `sliding_window / 2` on
///   either side, its full layers too), Gemma 2's logit soft cap
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
/// Decoders are causal; ModernBERT and the vision encoders (`pixtral` and the Qwen-VL ones,
/// [`HfFamily::QwenVision`]: axial 2-D RoPE over multimodal positions, refusing one position
/// per token) are not; T5 reads as its encoder's self-attention
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
pub(super) struct Keys(HashMap<&'static str, String>);

impl Keys {
    pub(super) fn set(&mut self, field: &'static str, key: impl Into<String>) {
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
        if let Some(model_type) = top.str("model_type")? {
            if let Some(key) = layers_differ(&top, registry::spec(Some(model_type)))? {
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
        let (spec, family) = loaded_spec(&top)?;
        check_file(&top, spec)?;
        check_layer(&top, layer)?;
        refuse_windowed(&top, spec, layer)?;
        if spec.quirks == Quirks::Gemma4 {
            gemma4::check_layer(&top, layer)?;
        }
        if family == HfFamily::DeepSeek {
            return deepseek::read(text, &top, spec);
        }
        let file = LayerFile {
            top: &top,
            spec,
            family,
            layer,
            kind: layer_kind(&top, spec, layer)?,
        };
        let mut keys = Keys::default();
        let attention = file.sizes(&mut keys)?;
        let attention = file.bias(attention)?;
        let attention = file.scale(attention, &mut keys)?;
        let attention = file.masks(attention, &mut keys);
        let mut attention = file.norms(attention, &mut keys)?;
        attention.validate().map_err(|e| blame(e, &keys))?;
        let encoding = file.encoding(text, &mut attention, &mut keys)?;
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
    /// Each call builds the layer its own encoding (a RoPE layer its own cos/sin tables); to
    /// load a model's layers, use [`Self::load_shared`], which gives every layer with the same
    /// encoding configuration one shared `Arc`.
    ///
    /// # Errors
    /// [`Error::MissingTensor`] / [`Error::TensorShape`] naming the HF tensor that is absent or
    /// misshapen; [`Error::DType`] for an integer `VarBuilder`, or a tensor it hands back as
    /// integers (a `VarMap` holds its variables in their own dtype); [`Error::InvalidConfig`] as
    /// [`AttentionConfig::validate`] and [`EncodingConfig::validate`] when the public fields
    /// were changed after parsing (checked before any size is computed from them).
    pub fn load(&self, vb: VarBuilder) -> Result<MultiHeadAttention> {
        self.load_shared(&mut SharedEncodings::new(), vb)
    }

    /// Builds the block from one layer's tensors as [`Self::load`] does, taking its encoding
    /// from `shared` when an earlier layer built one for the same configuration (and dtype and
    /// device), else building it and keeping it there for the layers that follow. Loading
    /// every layer of a model through one [`SharedEncodings`] gives one `Arc` encoding per
    /// distinct configuration: one RoPE table for a Llama, two for Gemma 3's local and global
    /// θ, T5's first-layer table for every layer.
    ///
    /// ```text
    /// let mut shared = SharedEncodings::new();
    /// for i in 0..layers { blocks.push(config.load_shared(&mut shared, vb.pp(format!("model.layers.{i}.self_attn")))?) }
    /// ```
    ///
    /// # Errors
    /// As [`Self::load`].
    pub fn load_shared(
        &self,
        shared: &mut SharedEncodings,
        vb: VarBuilder,
    ) -> Result<MultiHeadAttention> {
        if let Some(encoding) = shared.find(&self.encoding, &vb) {
            return self.load_with_encoding(encoding, vb);
        }
        let map = self.tensors(&vb, true)?;
        let ours = VarBuilder::from_tensors(map, vb.dtype(), vb.device());
        let encoding = shared.build(&self.encoding, ours.clone())?;
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
        crate::error::check_var_builder("attention weights (the VarBuilder's dtype)", vb)?;
        // The fields are public: check them again before their sizes shape any read (a T5
        // table's shape comes from the encoding).
        self.attention.validate()?;
        self.encoding.validate()?;
        let mut shared: Vec<Shared> = Vec::new();
        match (&self.encoding, with_table) {
            (EncodingConfig::T5(t5), true) => shared.push((
                "relative_attention_bias.weight",
                vec![t5.num_buckets, t5.num_heads],
            )),
            (EncodingConfig::Inkling(rel), true) => {
                shared.push((
                    "r_proj.weight",
                    vec![rel.num_heads * rel.d_rel, rel.d_model],
                ));
                shared.push(("rel_logits_proj.proj", vec![rel.d_rel, rel.rel_extent]));
            }
            _ => {}
        }
        if let Some(taps) = self.attention.short_conv {
            let channels = self.attention.num_kv_heads * self.attention.head_dim;
            for name in ["k_sconv.conv1d.weight", "v_sconv.conv1d.weight"] {
                shared.push((name, vec![channels, 1, taps]));
            }
        }
        remap(&self.layout(), &self.attention, &shared, vb)
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
            HfFamily::CodeGen => fused(
                QkvLayout::Sharded("qkv_proj", codegen::shard_rows(self.attention.d_model)),
                "out_proj",
            ),
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
            HfFamily::QwenVision => fused(QkvLayout::Stacked("qkv"), "proj"),
            HfFamily::Gemma4Vision => WeightLayout {
                qkv: QkvLayout::Separate(["q_proj.linear", "k_proj.linear", "v_proj.linear"]),
                out: "o_proj.linear",
                out_conv1d: false,
            },
        }
    }
}

/// The row of the file's `model_type` and its family, if the crate loads it.
///
/// # Errors
/// [`Error::HfConfig`] naming `model_type` when it is missing or has no family here.
fn loaded_spec(top: &Obj) -> Result<(&'static ModelSpec, HfFamily)> {
    let model_type = top.required("model_type", top.str("model_type")?)?;
    let spec = registry::find(model_type);
    match spec.and_then(|s| s.family.map(|f| (s, f))) {
        Some(found) => Ok(found),
        None => {
            let known: Vec<&str> = registry::MODELS
                .iter()
                .filter(|m| m.family.is_some())
                .map(|m| m.model_type)
                .collect();
            Err(problem(
                "model_type",
                format!("is `{model_type}`, expected one of {}", known.join(", ")),
            ))
        }
    }
}

/// One layer of a `config.json` being read, with its model's row: the steps of
/// [`HfAttentionConfig::from_json_layer`].
struct LayerFile<'a> {
    top: &'a Obj<'a>,
    spec: &'static ModelSpec,
    family: HfFamily,
    layer: usize,
    kind: LayerKind,
}

impl LayerFile<'_> {
    /// Width, heads, key/value heads and head width (Gemma 4's per-layer ones included).
    fn sizes(&self, keys: &mut Keys) -> Result<AttentionConfig> {
        let top = self.top;
        let (hidden, hidden_key) = first(top, self.spec.widths)?;
        let (heads, heads_key) = first(top, registry::HEADS)?;
        keys.set("d_model", hidden_key);
        keys.set("num_heads", heads_key);
        let kv_heads = self.kv_heads(heads, keys)?;
        let attention = AttentionConfig::new(hidden, heads)
            .with_causal(true)
            .with_kv_heads(kv_heads);
        let mut attention = self.head_dim(attention, (hidden_key, heads_key), keys)?;
        if self.spec.quirks == Quirks::Gemma4 {
            let o = gemma4::overrides(top, self.spec, self.layer, self.kind)?;
            if let Some((d, key)) = o.head_dim {
                attention = attention.with_head_dim(d);
                keys.set("head_dim", key);
            }
            if let Some((kv, key)) = o.kv_heads {
                attention = attention.with_kv_heads(kv);
                keys.set("num_kv_heads", key);
            }
        }
        if self.spec.quirks == Quirks::Inkling {
            attention = inkling::sizes(top, self.kind, attention, keys)?;
        }
        Ok(attention)
    }

    /// The key/value heads: Falcon's `multi_query` / `new_decoder_architecture`, the
    /// Llama-style and Phi-3 classes' `num_key_value_heads` (a null is the heads where the
    /// class types it `int | None`, refused elsewhere), else the heads.
    fn kv_heads(&self, heads: usize, keys: &mut Keys) -> Result<usize> {
        let top = self.top;
        match self.family {
            HfFamily::Falcon => {
                if top.bool("new_decoder_architecture")?.unwrap_or(false) {
                    keys.set("num_kv_heads", "num_kv_heads");
                    Ok(top.usize("num_kv_heads")?.unwrap_or(heads))
                } else if top.bool("multi_query")?.unwrap_or(true) {
                    keys.set("num_kv_heads", "multi_query");
                    Ok(1)
                } else {
                    Ok(heads)
                }
            }
            HfFamily::Llama | HfFamily::Phi3 | HfFamily::Gemma4Vision => {
                keys.set("num_kv_heads", "num_key_value_heads");
                match top.map.get("num_key_value_heads") {
                    Some(Value::Null) if self.spec.null_kv_heads => Ok(heads),
                    Some(Value::Null) => Err(null_refused("num_key_value_heads")),
                    _ => Ok(top
                        .usize("num_key_value_heads")?
                        .unwrap_or(self.spec.defaults.num_key_value_heads.unwrap_or(heads))),
                }
            }
            _ => Ok(heads),
        }
    }

    /// The head width: `head_dim` (T5: `d_kv`), else the class's, else the width over the
    /// heads; refusals where HF's class refuses the key.
    fn head_dim(
        &self,
        attention: AttentionConfig,
        (hidden_key, heads_key): (&str, &str),
        keys: &mut Keys,
    ) -> Result<AttentionConfig> {
        let (top, spec) = (self.top, self.spec);
        let head_key = match self.family {
            HfFamily::T5 => "d_kv",
            _ => "head_dim",
        };
        let given = top.usize(head_key)?;
        let derived = format!("{hidden_key} / {heads_key}");
        let attention = match (given, spec.defaults.head_dim) {
            // Pixtral's attention splits hidden_size evenly, whatever head_dim says (its
            // rotary embedding reads head_dim; a mismatch is refused with the encoding).
            (Some(_), _) if spec.head_dim == HeadDim::FromWidth => {
                keys.set("head_dim", derived);
                attention
            }
            // The file's, or the class's (T5's d_kv 64, Gemma's 256, Qwen3's 128, ...).
            (Some(d), _) | (None, Some(d)) => {
                keys.set("head_dim", head_key);
                attention.with_head_dim(d)
            }
            (None, None) => {
                keys.set("head_dim", derived);
                attention
            }
        };
        Ok(attention)
    }

    /// The biases the row gives.
    fn bias(&self, attention: AttentionConfig) -> Result<AttentionConfig> {
        let (bias, out_bias) = match self.spec.bias {
            Bias::None => (false, false),
            Bias::Qkv => (true, false),
            Bias::All => (true, true),
            Bias::Flag(key, default) => {
                let b = self.top.bool(key)?.unwrap_or(default);
                (b, b)
            }
            Bias::QkvFlag(key, default) => (self.top.bool(key)?.unwrap_or(default), false),
        };
        Ok(attention.with_bias(bias).with_out_bias(out_bias))
    }

    /// The softmax scale, causality, soft cap, sinks and Gemma 4's value settings.
    fn scale(&self, mut attention: AttentionConfig, keys: &mut Keys) -> Result<AttentionConfig> {
        let top = self.top;
        match self.spec.scale {
            Scale::Default => {}
            Scale::One => attention = attention.with_softmax_scale(1.0),
            Scale::Gpt2 => attention = gpt2_scale(top, attention, self.layer, keys)?,
            Scale::QueryPreAttnScalar => {
                let scalar = top.f64("query_pre_attn_scalar")?.unwrap_or(256.0);
                attention = attention.with_softmax_scale(1.0 / scalar.sqrt());
                keys.set("softmax_scale", "query_pre_attn_scalar");
            }
            // MPT keeps its attention settings under attn_config.
            Scale::AttnConfig => {
                if let Some(Value::Object(map)) = top.get("attn_config") {
                    let attn_config = Obj {
                        map,
                        prefix: "attn_config.",
                    };
                    if let Some(scale) = attn_config.f64("softmax_scale")? {
                        attention = attention.with_softmax_scale(scale);
                        keys.set("softmax_scale", "attn_config.softmax_scale");
                    }
                }
            }
        }
        attention = attention.with_causal(self.spec.causal && !bidirectional(top, self.spec)?);
        // Gemma 2's attention caps its logits; Gemma 3's (and Gemma 4's) never passes
        // `attn_logit_softcapping` to its attention function, so a cap in the file is not read.
        if self.spec.logit_softcap {
            let cap = match top.map.get("attn_logit_softcapping") {
                None => Some(50.0),
                Some(_) => top.f64("attn_logit_softcapping")?,
            };
            attention = attention.with_logit_softcap(cap);
            keys.set("logit_softcap", "attn_logit_softcapping");
        }
        attention = attention.with_sinks(self.spec.sinks);
        if self.spec.quirks == Quirks::Gemma4 {
            attention = gemma4::attention(top, self.kind, attention)?;
            keys.set("value_norm", "rms_norm_eps");
        }
        if self.spec.quirks == Quirks::Gemma4Vision {
            attention = gemma4::vision(top, attention)?;
            keys.set("value_norm", "rms_norm_eps");
        }
        if self.spec.quirks == Quirks::Inkling {
            attention = inkling::attention(top, attention, keys)?;
        }
        Ok(attention)
    }

    /// The layer's chunks or sliding window.
    fn masks(&self, mut attention: AttentionConfig, keys: &mut Keys) -> AttentionConfig {
        if let LayerKind::Chunked(c) = self.kind {
            attention = attention.with_attention_chunk(Some(c));
            keys.set("attention_chunk", "attention_chunk_size");
        }
        if let LayerKind::Sliding(w) = self.kind {
            attention = attention.with_sliding_window(Some(w));
            let key = match self.spec.window {
                Window::LocalAttention => "local_attention",
                _ => "sliding_window",
            };
            keys.set("sliding_window", key);
        }
        attention
    }

    /// The query/key norms, and Llama 4's temperature tuning on its NoPE layers.
    fn norms(&self, attention: AttentionConfig, keys: &mut Keys) -> Result<AttentionConfig> {
        let top = self.top;
        let eps = |default: f64| -> Result<f64> { Ok(top.f64("rms_norm_eps")?.unwrap_or(default)) };
        let norm = match self.spec.qk_norm {
            QkNorm::None => None,
            QkNorm::PerHead => Some(QkNormConfig::new().with_eps(eps(1e-6)?)),
            QkNorm::UnitOffset => Some(
                QkNormConfig::new()
                    .with_unit_offset(true)
                    .with_eps(eps(1e-6)?),
            ),
            QkNorm::AllHeads => Some(
                QkNormConfig::new()
                    .with_scope(QkNormScope::AllHeads)
                    .with_eps(eps(1e-5)?),
            ),
            QkNorm::Llama4 => llama4::qk_norm(top, self.spec, self.layer)?,
            QkNorm::LayerNormEachHead => match top.bool("use_qk_norm")?.unwrap_or(false) {
                true => Some(
                    QkNormConfig::new()
                        .with_scope(QkNormScope::EachHead)
                        .with_centered(true)
                        .with_eps(top.f64("layer_norm_eps")?.unwrap_or(1e-5)),
                ),
                false => None,
            },
        };
        if norm.is_some() {
            let key = match self.spec.qk_norm {
                QkNorm::LayerNormEachHead => "layer_norm_eps",
                _ => "rms_norm_eps",
            };
            keys.set("qk_norm.eps", key);
        }
        let attention = attention.with_qk_norm(norm);
        if self.spec.quirks != Quirks::Llama4 {
            return Ok(attention);
        }
        llama4::temperature(top, self.spec, self.layer, attention, keys)
    }

    /// The layer's positional encoding.
    fn encoding(
        &self,
        text: &str,
        attention: &mut AttentionConfig,
        keys: &mut Keys,
    ) -> Result<EncodingConfig> {
        let top = self.top;
        let heads = attention.num_heads;
        Ok(match self.family {
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
            HfFamily::T5 => EncodingConfig::T5(t5_buckets(top, heads, keys)?),
            _ if self.spec.quirks == Quirks::Inkling => {
                let rel = inkling::encoding(top, self.kind, attention, keys)?;
                rel.validate().map_err(|e| blame(e, keys))?;
                EncodingConfig::Inkling(rel)
            }
            _ if !uses_rope(top, self.spec, self.layer)? => EncodingConfig::None,
            _ => EncodingConfig::Rotary(self.rope(text, attention)?),
        })
    }

    /// The layer's RoPE, over the attention's head width.
    fn rope(&self, text: &str, attention: &mut AttentionConfig) -> Result<RopeConfig> {
        // Gemma 4's layers rotate over their own head width.
        let width = match self.spec.quirks {
            Quirks::Gemma4 => attention.head_dim,
            _ => 0,
        };
        let mut rope = rope_of_layer(text, self.top, self.spec, self.kind, width)?;
        if rope.head_dim != attention.head_dim {
            return Err(problem(
                "head_dim",
                format!(
                    "gives the rotary head width {} but the attention head width {}",
                    rope.head_dim, attention.head_dim
                ),
            ));
        }
        if self.spec.quirks == Quirks::Llama4 {
            llama4::cancel_attention_factor(&mut rope, attention)?;
        }
        Ok(rope)
    }
}

/// GPT-2's scale: 1 without `scale_attn_weights`, and layer i's divided by i + 1 with
/// `scale_attn_by_inverse_layer_idx`.
fn gpt2_scale(
    top: &Obj,
    mut attention: AttentionConfig,
    layer: usize,
    keys: &mut Keys,
) -> Result<AttentionConfig> {
    if !top.bool("scale_attn_weights")?.unwrap_or(true) {
        attention = attention.with_softmax_scale(1.0);
    }
    if top
        .bool("scale_attn_by_inverse_layer_idx")?
        .unwrap_or(false)
    {
        let scale = attention.softmax_scale / (layer as f64 + 1.0);
        attention = attention.with_softmax_scale(scale);
        keys.set("softmax_scale", "scale_attn_by_inverse_layer_idx");
    }
    Ok(attention)
}

/// T5's buckets: `relative_attention_num_buckets` and `relative_attention_max_distance`.
fn t5_buckets(top: &Obj, heads: usize, keys: &mut Keys) -> Result<T5Config> {
    let mut t5 = T5Config::new(heads);
    if let Some(n) = top.usize("relative_attention_num_buckets")? {
        t5 = t5.with_num_buckets(n);
        keys.set("num_buckets", "relative_attention_num_buckets");
    }
    if let Some(n) = top.usize("relative_attention_max_distance")? {
        t5 = t5.with_max_distance(n);
        keys.set("max_distance", "relative_attention_max_distance");
    }
    t5.validate().map_err(|e| blame(e, keys))?;
    Ok(t5)
}

/// The `text_config` of a vision-language model's `config.json`, as text, if this is one
/// (a row with [`ModelSpec::text_config`]); both readers read the language model from it.
pub(super) fn text_model(text: &str) -> Result<Option<String>> {
    let map = parse_root(text)?;
    let top = Obj {
        map: &map,
        prefix: "",
    };
    let Some((t, nesting)) = top
        .str("model_type")?
        .and_then(|t| Some((t, registry::find(t)?.text_config?)))
    else {
        return Ok(None);
    };
    match top.get("text_config") {
        // A text_config without its model_type is the class's text config.
        Some(Value::Object(inner)) => {
            let mut inner = inner.clone();
            if !inner.contains_key("model_type") {
                inner.insert("model_type".into(), Value::from(format!("{t}_text")));
            }
            Ok(Some(Value::Object(inner).to_string()))
        }
        // Qwen2-VL's and Qwen2.5-VL's classes read a flat file's keys as the text model's.
        None if nesting == TextConfig::NestedOrFlat => {
            let mut flat = map.clone();
            flat.insert("model_type".into(), Value::from(format!("{t}_text")));
            Ok(Some(Value::Object(flat).to_string()))
        }
        _ => Err(problem(
            "text_config",
            format!("is missing, expected the language model's configuration of `{t}`"),
        )),
    }
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
    spec: &ModelSpec,
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
    let entry = match spec.rope.per_layer {
        // Gemma 4's class fills its own per-type parameters and never reads the flat keys.
        LayerRope::Gemma4 => Some(gemma4::rope_entry(top, kind)?),
        LayerRope::PerType(per_type) => Some(per_type_entry(top, spec, per_type, kind, type_name)?),
        LayerRope::Shared => top
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
        None if head_dim == 0 => return rope_of_file(text),
        None => {}
    }
    rope_of_file(&Value::Object(map).to_string())
}

/// Gemma 3's or ModernBERT's parameters for the layer type `type_name`, as their classes'
/// `convert_rope_params_to_dict` fill them (see [`rope_of_layer`]).
///
/// # Errors
/// [`Error::HfConfig`] naming `rope_parameters` when a `rope_scaling` is to be merged into an
/// entry the file lacks (HF's class fails on it), and naming a θ key that is null.
fn per_type_entry(
    top: &Obj,
    spec: &ModelSpec,
    per_type: PerTypeRope,
    kind: LayerKind,
    type_name: &str,
) -> Result<Value> {
    let sliding = matches!(kind, LayerKind::Sliding(_));
    let params = top.get("rope_parameters");
    let scaling = top.get("rope_scaling");
    // The entries the class merges an old rope_scaling into.
    let merged = per_type.merged;
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
        let (key, default) = match sliding {
            false => (per_type.full_theta, spec.defaults.rope_theta),
            true => (per_type.sliding_theta, LOCAL_ROPE_THETA),
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
pub(super) fn blame(err: Error, keys: &Keys) -> Error {
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
