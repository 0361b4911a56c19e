//! What HF transformers' configuration classes (5.24) assume for the keys a `config.json`
//! leaves out, one row per `model_type` the loader reads.
//!
//! A hand-written or trimmed `config.json` is read by HF through its model's config class,
//! whose field defaults (and `__post_init__`, and `convert_rope_params_to_dict` /
//! `standardize_rope_params` for the rotary settings) fill every absent key. The loader takes
//! the same values from this table (each row's `defaults` in `hf::registry`), so a minimal file
//! gives the layer HF builds from it.
//!
//! <!-- family_types -->
//! | `model_type` | `rope_theta` | `num_key_value_heads` | `head_dim` | `max_position_embeddings` | other |
//! |---|---|---|---|---|---|
//! | `llama` | 10000 | heads | width / heads | 2048 | |
//! | `mistral` | 10000 | 8 | width / heads | 131072 | `sliding_window` 4096 |
//! | `ministral` | 10000 | 8 | required (the class leaves it null, and HF's attention fails on that) | 131072 | `sliding_window` 4096 (a null one is refused: the model always builds the sliding mask); every layer sliding unless `layer_types` |
//! | `starcoder2` | 10000 | 2 | width / heads | 4096 | `use_bias` true; no window |
//! | `qwen2` | 10000 | 32 | width / heads | 32768 | `sliding_window` 4096 and `max_window_layers` 28 when `use_sliding_window` |
//! | `qwen3` | 10000 | 32 | 128 | 32768 | as Qwen2 |
//! | `gemma` | 10000 | 16 | 256 | 8192 | |
//! | `gemma2` | 10000 | 4 | 256 | 8192 | `sliding_window` 4096 |
//! | `gemma3_text` | 1e6 (full layers), 10000 (`rope_local_base_freq`, sliding layers) | 4 | 256 | 131072 | `sliding_window` 4096 |
//! | `olmo2` | 10000 | heads | width / heads | 2048 | |
//! | `gpt_oss` | 150000 | 8 | 64 | 131072 | YaRN (factor 32, `beta_fast` 32, `beta_slow` 1, `truncate` false, original length 4096) when the file has no rotary parameters; `sliding_window` 128 |
//! | `smollm3` | 2e6 | 4 | width / heads | 32768 | |
//! | `cohere2` | 10000 | heads | width / heads (the class sets it, then a file's `head_dim` replaces it) | 8192 | `sliding_window` 4096 |
//! | `llama4_text` | 500000 | 8 | 128 | 131072 | |
//! | `gemma4_text` | per layer type (`rope_parameters`, read in `hf::gemma4`): 10000 on sliding layers, proportional RoPE over a quarter of the frequencies at 1e6 on full ones; a top-level `rope_theta` is not read | 4; full layers `num_global_key_value_heads` under `attention_k_eq_v` | 256; full layers `global_head_dim` 512 | 131072 | `sliding_window` 512; every sixth layer and the last one full; `per_layer_config` replaces the full layers' widths |
//! | `inkling_text` | — (no RoPE) | 8; sliding layers `swa_num_key_value_heads` 16 | 128; sliding layers `swa_head_dim` 128 | — | `sliding_window_size` 512, every sixth layer full (`local_layer_ids`, `layer_types`); sliding layers `swa_num_attention_heads` 64; `d_rel` 16, `rel_extent` 1024, `conv_kernel_size` 4, `log_scaling_n_floor` none, `log_scaling_alpha` 0.1 |
//! | `phi3` | 10000 | heads | width / heads | 4096 | `original_max_position_embeddings` 4096 |
//! | `qwen2_vl_text`, `qwen2_5_vl_text` | 1e6 | 8 | width / heads | 32768 | `mrope_section` [16, 24, 24]; `max_window_layers` 80 |
//! | `qwen3_vl_text` | 500000 | 32 | 128 | 128000 | `mrope_section` [24, 20, 20], always interleaved; no sliding window |
//! | `qwen3_vl_moe_text` | 500000 | 16 | width / heads | 128000 | as Qwen3-VL |
//! | `gpt_neox` | 10000 (`rotary_emb_base`) | heads | width / heads | 2048 | `rotary_pct` 0.25 |
//! | `falcon` | 10000 | 1 (`multi_query`) | always width / heads (a `head_dim` key is refused: the class property has no setter) | 2048 | |
//! | `modernbert` | 160000 (`global_rope_theta`), 10000 (`local_rope_theta`) | heads | width / heads | 8192 | `local_attention` 128 |
//! | `deepseek_v2` | 10000 | heads | (latent) | 2048 | |
//! | `deepseek_v3`, `kimi_k2` | 10000 | 128 (HF's attention needs it equal to the heads) | (latent) | 4096 | |
//! | `qwen2_vl_vision`, `qwen2_5_vl_vision`, `qwen3_vl_vision`, `qwen3_vl_moe_vision` | 10000 | heads | width / heads (a `head_dim` that differs is refused) | — | axial 2-D RoPE when the file names no type; the width under `embed_dim` for Qwen2-VL's (its `hidden_size` is the merger's); Qwen2.5-VL's `fullatt_block_indexes` 7, 15, 23, 31 |
//! | `gptj`, `codegen` | 10000, fixed (no θ or scaling key is read) | heads | width / heads | 2048 (`n_positions`) | `rotary_dim` 64 |
//! | `cohere` | 500000 | heads | width / heads | 8192 | `use_qk_norm` false, `layer_norm_eps` 1e-5 |
//! | `glm`, `glm4` | 10000 | 2 | 128 | 131072 | `attention_bias` true; `partial_rotary_factor` 0.5 |
//! | `helium` | 100000 | 20 | 128 (the heads must fill the width) | 4096 | |
//! | `ernie4_5` | 500000 | 2 | 128 | 131072 | |
//! | `phi4_multimodal` | 10000 | 8 | width / heads | 131072 | as Phi-3 |
//! | `t5` | — | heads | 64 (`d_kv`) | — | 32 buckets, largest distance 128 |
//! | `gemma4_vision` | 100 | 12 | 64 | 131072 | axial 2-D RoPE when the file names no type |
//! | others (`bloom`, `gpt2`, `mpt`, `pixtral`, none) | 10000 | heads | width / heads | — | |
//! <!-- /family_types -->
//!
//! Sizes (`hidden_size`, `num_attention_heads`, T5's `d_model` and `num_heads`, ...) are
//! required: their class defaults describe a full-size model, and a file that leaves them out
//! is refused under the key rather than read as one.

use crate::rotary::mrope::MropeSection;

/// The defaults of one configuration class (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct ClassDefaults {
    /// `rope_theta` (the default θ of `default_theta` or of the class's default parameters).
    pub(crate) rope_theta: f64,
    /// `num_key_value_heads`; `None`: the number of attention heads.
    pub(crate) num_key_value_heads: Option<usize>,
    /// `head_dim`; `None`: the width over the heads.
    pub(crate) head_dim: Option<usize>,
    /// `max_position_embeddings`; `None` where the class has none that the rotary code reads.
    pub(crate) max_position_embeddings: Option<usize>,
    /// `sliding_window` when the key is absent (Qwen's only where `use_sliding_window`).
    pub(crate) sliding_window: Option<usize>,
    /// `max_window_layers` (Qwen's first layer with a window).
    pub(crate) max_window_layers: usize,
    /// `rope_parameters.mrope_section` when absent (the Qwen-VL text models).
    pub(crate) mrope: Option<MropeSection>,
    /// Whether the class's default rotary parameters are gpt-oss's YaRN.
    pub(crate) yarn: bool,
    /// `partial_rotary_factor` when the file gives none (GLM's 0.5); `None`: the whole head.
    pub(crate) partial_rotary_factor: Option<f64>,
}

/// The defaults of a class without its own (and the base of every row's).
pub(crate) const GENERIC: ClassDefaults = ClassDefaults {
    rope_theta: 10_000.0,
    num_key_value_heads: None,
    head_dim: None,
    max_position_embeddings: None,
    sliding_window: None,
    max_window_layers: 28,
    mrope: None,
    yarn: false,
    partial_rotary_factor: None,
};

/// The sliding layers' θ of the models with two (Gemma 3's `rope_local_base_freq`,
/// ModernBERT's `local_rope_theta`).
pub(crate) const LOCAL_ROPE_THETA: f64 = 10_000.0;

/// gpt-oss's rotary parameters when its file has none (`GptOssConfig.__post_init__`).
pub(crate) fn gpt_oss_rope() -> serde_json::Map<String, serde_json::Value> {
    let mut m = serde_json::Map::new();
    m.insert("rope_type".into(), "yarn".into());
    m.insert("factor".into(), 32.0.into());
    m.insert("beta_fast".into(), 32.0.into());
    m.insert("beta_slow".into(), 1.0.into());
    m.insert("truncate".into(), false.into());
    m.insert("original_max_position_embeddings".into(), 4096.into());
    m
}

/// GPT-J's `rotary_dim` when absent.
pub(crate) const GPTJ_ROTARY_DIM: usize = 64;

/// GPT-J's θ, fixed in its HF code (`create_sinusoidal_positions` in modeling_gptj.py reads
/// no θ or scaling from the config).
pub(crate) const GPTJ_ROPE_THETA: f64 = 10000.0;
