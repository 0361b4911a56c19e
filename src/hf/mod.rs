//! A model's attention layer from its Hugging Face `config.json` and safetensors.
//!
//! [`HfAttentionConfig::from_json`] reads the block's settings (heads, key/value heads, head
//! width, biases, scale, query/key norms) and its positional encoding from `config.json`;
//! [`HfAttentionConfig::load`] builds the block from one layer's tensors under HF's own names,
//! splitting fused projections and transposing Conv1D weights once, at load;
//! [`HfAttentionConfig::load_shared`] loads a model's layers with one encoding per distinct
//! configuration ([`SharedEncodings`]: one RoPE table for all the layers of a Llama).
//!
//! Every `model_type` read ([`model_types`]; one row each in the registry, `hf::registry`):
//!
//! <!-- model_types -->
//! | `model_type` | q, k, v | output | encoding |
//! |---|---|---|---|
//! | `llama`, `mistral`, `ministral`, `starcoder2`, `qwen2`, `qwen3`, `gemma`, `gemma2`, `gemma3_text`, `olmo2`, `gpt_oss`, `smollm3`, `cohere2`, `llama4_text`, `gemma4_text` | `q_proj`, `k_proj`, `v_proj` (+ `q_norm`, `k_norm`, `sinks`) | `o_proj` | RoPE (none on NoPE layers) |
//! | `cohere`, `helium`, `ernie4_5` | `q_proj`, `k_proj`, `v_proj` (+ Cohere's `q_norm`, `k_norm`: per-head layer norms, a scale per head, under `use_qk_norm`) | `o_proj` (Helium's without bias) | RoPE on adjacent pairs |
//! | `glm`, `glm4` | `q_proj`, `k_proj`, `v_proj` (biases under `attention_bias`) | `o_proj` (no bias) | partial RoPE on adjacent pairs (`partial_rotary_factor`, half by default) |
//! | `qwen2_vl_text`, `qwen2_5_vl_text`, `qwen3_vl_text`, `qwen3_vl_moe_text` | `q_proj`, `k_proj`, `v_proj` (+ `q_norm`, `k_norm`) | `o_proj` | multimodal RoPE |
//! | `qwen2_vl`, `qwen2_5_vl`, `qwen3_vl`, `qwen3_vl_moe`, `llama4`, `gemma4` | their language model's, read from `text_config` (Qwen2-VL's and Qwen2.5-VL's also from a flat file) | | |
//! | `pixtral` | `q_proj`, `k_proj`, `v_proj` | `o_proj` | axial 2-D RoPE, bidirectional |
//! | `inkling_text` | `q_proj`, `k_proj`, `v_proj`, `q_norm`, `k_norm`, `k_sconv`, `v_sconv` (short convolutions) | `o_proj` | Inkling's relative logits (`r_proj`, `rel_logits_proj.proj`), log-n scaling on full layers |
//! | `phi3`, `phi4_multimodal` | `qkv_proj`, rows `[q; k; v]` | `o_proj` | RoPE (LongRoPE), partial with `partial_rotary_factor` |
//! | `gpt_neox` | `query_key_value`, rows `(H, 3, D)` | `dense` | partial RoPE |
//! | `bloom` | `query_key_value`, rows `(H, 3, D)` | `dense` | ALiBi |
//! | `gpt2` | `c_attn` (Conv1D, transposed) | `c_proj` (Conv1D) | none in the block (`wpe` at the embeddings) |
//! | `gptj` | `q_proj`, `k_proj`, `v_proj` | `out_proj` | RoPE on adjacent pairs |
//! | `codegen` | `qkv_proj` in 4 model-parallel shards, each rows `[q; v; k]` | `out_proj` | RoPE on adjacent pairs of `rotary_dim` features |
//! | `falcon` | `query_key_value`: `[q; k; v]` (multi-query), `(Hkv, H/Hkv + 2, D)` (new decoder architecture) or `(H, 3, D)` | `dense` | RoPE |
//! | `t5` | `q`, `k`, `v` | `o` | T5 buckets (`relative_attention_bias`) |
//! | `mpt` | `Wqkv`, rows `[q; k; v]` | `out_proj` | ALiBi with MPT's slopes, largest exponent 8 (HF reads neither `attn_config.alibi` nor `attn_config.alibi_bias_max`) |
//! | `modernbert` | `Wqkv`, rows `[q; k; v]` | `Wo` | RoPE, global and local θ; bidirectional |
//! | `qwen2_vl_vision`, `qwen2_5_vl_vision`, `qwen3_vl_vision`, `qwen3_vl_moe_vision` | `qkv`, rows `[q; k; v]` | `proj` | axial 2-D RoPE, bidirectional; one image per sequence (Qwen2.5-VL's windowed layers refused) |
//! | `gemma4_vision` | `q_proj.linear`, `k_proj.linear`, `v_proj.linear` (+ `q_norm`, `k_norm`) | `o_proj.linear` | axial 2-D RoPE over each half of the head, bidirectional |
//! | `deepseek_v2`, `deepseek_v3`, `kimi_k2` (read as `deepseek_v3`) | `q_a_proj`, `q_a_layernorm`, `q_b_proj` (or `q_proj`); `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj` | `o_proj` | RoPE over `qk_rope_head_dim` features |
//! <!-- /model_types -->
//!
//! Each family is checked against a layer of HF transformers' own module (`tests/it/hf/layers.rs`).

mod checks;
mod codegen;
mod deepseek;
pub(crate) mod defaults;
mod gemma4;
pub mod gguf;
mod inkling;
pub(crate) mod json;
pub mod layer;
mod llama4;
mod pattern;
mod registry;
pub mod rope;
mod shared;
mod weights;

pub use layer::{HfAttentionConfig, HfFamily};
pub use registry::model_types;
pub use shared::SharedEncodings;
