//! A model's attention layer from its Hugging Face `config.json` and safetensors.
//!
//! [`HfAttentionConfig::from_json`] reads the block's settings (heads, key/value heads, head
//! width, biases, scale, query/key norms) and its positional encoding from `config.json`;
//! [`HfAttentionConfig::load`] builds the block from one layer's tensors under HF's own names,
//! splitting fused projections and transposing Conv1D weights once, at load.
//!
//! | `model_type` | q, k, v | output | encoding |
//! |---|---|---|---|
//! | `llama`, `mistral`, `qwen2`, `qwen3`, `gemma`, `gemma2`, `gemma3_text`, `olmo2`, `gpt_oss`, `smollm3`, `cohere2` | `q_proj`, `k_proj`, `v_proj` (+ `q_norm`, `k_norm`, `sinks`) | `o_proj` | RoPE (none on NoPE layers) |
//! | `phi3` | `qkv_proj`, rows `[q; k; v]` | `o_proj` | RoPE (LongRoPE) |
//! | `gpt_neox` | `query_key_value`, rows `(H, 3, D)` | `dense` | partial RoPE |
//! | `bloom` | `query_key_value`, rows `(H, 3, D)` | `dense` | ALiBi |
//! | `gpt2` | `c_attn` (Conv1D, transposed) | `c_proj` (Conv1D) | none in the block (`wpe` at the embeddings) |
//! | `gptj` | `q_proj`, `k_proj`, `v_proj` | `out_proj` | RoPE on adjacent pairs |
//! | `falcon` | `query_key_value`: `[q; k; v]` (multi-query), `(Hkv, H/Hkv + 2, D)` (new decoder architecture) or `(H, 3, D)` | `dense` | RoPE |
//! | `t5` | `q`, `k`, `v` | `o` | T5 buckets (`relative_attention_bias`) |
//! | `mpt` | `Wqkv`, rows `[q; k; v]` | `out_proj` | ALiBi with MPT's slopes, largest exponent 8 (HF reads neither `attn_config.alibi` nor `attn_config.alibi_bias_max`) |
//! | `qwen2_vl`, `qwen2_5_vl`, `qwen3_vl` (their `text_config`) | `q_proj`, `k_proj`, `v_proj` (+ `q_norm`, `k_norm`) | `o_proj` | multimodal RoPE |
//!
//! Each family is checked against a layer of HF transformers' own module (`tests/it/hf/layers.rs`).

pub(crate) mod defaults;
mod gemma4;
pub(crate) mod json;
pub mod layer;
mod llama4;
mod registry;
pub mod rope;
mod weights;

pub use layer::{HfAttentionConfig, HfFamily};
pub use registry::model_types;
