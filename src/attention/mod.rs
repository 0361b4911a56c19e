//! The multi-head attention block: configuration, the pipeline, its execution paths, masks and
//! the KV cache.
//!
//! The block consumes every positional encoding through the plug ([`crate::plug`]) and never
//! looks at the concrete encoding type. Its forward is a pipeline (`mha.rs`): project → input
//! hook → rotation → cache → query blocks (`blocks.rs`) → merge heads → output projection.
//! Each call runs one execution path, chosen once:
//! - the fused CPU core (`fused_attention.rs`): f32 inference without returned weights, per
//!   head and tile of queries, reading relative biases and values as rows; bf16 and f16
//!   blocks run it too, in f32: the queries widened, the keys and values widened once per
//!   call, or, for a few queries (decoding), read from the cache in their dtype and widened a
//!   key tile at a time (`widen.rs`); the heads return to the block's dtype before the output
//!   projection, and an additive mask saturates to the block's range first, so its lowest
//!   value hides a key as it does in that format;
//! - the row pass (`fused_softmax.rs`): f32 CPU inference returning the weights, bias, masks and
//!   softmax in one in-place pass over the logits;
//! - the fused training core (`fused_training.rs`): f32 CPU with gradients, without returned
//!   weights; the core's forward keeps one maximum and inverse sum per row, and a
//!   FlashAttention-2 backward recomputes each tile's weights, giving q, k, v and every
//!   tracked term, table and sink their gradients without a `(B, H, T, T)` tensor; attention
//!   dropout is drawn from a seed (`dropout.rs`), again in the backward;
//! - the fused CUDA kernels (`cuda/`, the `cuda` feature): inference and training without
//!   returned weights on a CUDA device, by default for the calls that have passed on a GPU
//!   ([`crate::cuda`]);
//! - plain candle ops (`unfused.rs`): training with returned weights, other devices and
//!   dtypes; differentiable.

mod blocks;
mod config;
mod cuda;
mod dropout;
mod fused_attention;
mod fused_softmax;
mod fused_training;
mod kv_cache;
mod latent;
mod mask;
mod mha;
mod one_pass;
mod projection;
mod qk_norm;
mod short_conv;
mod streaming;
mod temperature;
mod train_node;
mod unfused;
mod widen;

pub use config::{AttentionConfig, AttentionOptions, AttentionOutput, DEFAULT_LOGITS_BUDGET};
pub use kv_cache::KvCache;
pub use latent::LatentConfig;
pub use mha::MultiHeadAttention;
pub use projection::linear;
pub use qk_norm::{QkNormConfig, QkNormScope};
pub use temperature::AttentionTemperature;
