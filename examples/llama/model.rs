//! A Llama decoder: token embeddings, layers of RMSNorm → the crate's attention → RMSNorm →
//! SwiGLU MLP, each with a residual, a last RMSNorm and the head (tied to the embeddings when
//! the file has no `lm_head`).
//!
//! ```text
//! h = embed(ids)
//! per layer:  h = h + attn(rms₁(h))                    (MultiHeadAttention with RoPE, a KV cache each)
//!             h = h + W_down (silu(W_gate x) ⊙ W_up x),  x = rms₂(h)
//! logits = W_head rms(h)
//! ```
//!
//! The attention of every layer comes from the model's `config.json` through
//! `HfAttentionConfig::from_json_layer` and `load_shared`, so the layers share one RoPE table.
//!
//! # Shapes
//! `ids`: `(B, T)` u32 → hidden `(B, T, d_model)` → logits `(B, T, vocab)`.

use std::collections::HashMap;

use anyhow::Context;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Embedding, Linear, RmsNorm, VarBuilder};
// The MLP's and head's products are the block's own (`attention::linear`): candle-nn's
// `Linear` asks for the thread count on every call and widens a whole bf16 weight to f32 for
// each product, the head's 28 M values on every decoding step.
use candle_posenc::attention::linear;
use candle_posenc::hf::gguf::{GgufFile, QkRows};
use candle_posenc::hf::{HfAttentionConfig, SharedEncodings};
use candle_posenc::{AttentionOptions, EncodingConfig, KvCache, MultiHeadAttention};
use serde::Deserialize;

/// What the model reads of its `config.json` besides the attention.
#[derive(Debug, Clone, Deserialize)]
pub struct LlamaConfig {
    /// Width.
    pub hidden_size: usize,
    /// The MLP's hidden width.
    pub intermediate_size: usize,
    /// Layers.
    pub num_hidden_layers: usize,
    /// The RMSNorms' ε.
    pub rms_norm_eps: f64,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Whether the head is the token embeddings.
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

/// One decoder layer.
#[derive(Debug, Clone)]
struct Layer {
    input_norm: RmsNorm,
    attention: MultiHeadAttention,
    post_norm: RmsNorm,
    /// `[W_gate; W_up]`, one product for both.
    gate_up: Linear,
    down: Linear,
}

/// The model.
#[derive(Debug, Clone)]
pub struct Llama {
    config: LlamaConfig,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    head: Linear,
    dtype: DType,
}

impl Llama {
    /// The model of a GGUF file, its weights dequantized to `dtype` on `device`, the rows of q
    /// and k in the order `rows` asks and rotated to match.
    pub fn from_gguf(
        file: &GgufFile,
        dtype: DType,
        device: &Device,
        rows: QkRows,
    ) -> anyhow::Result<Self> {
        let json = file.config_json()?;
        let tensors = file.tensors(dtype, device, rows)?;
        Self::from_tensors(&json, tensors, dtype, device, rows)
    }

    /// The model from its `config.json` and its tensors under HF's names (`model.layers.{i}.…`),
    /// the rows of q and k in the order `rows` says.
    pub fn from_tensors(
        json: &str,
        mut tensors: HashMap<String, Tensor>,
        dtype: DType,
        device: &Device,
        rows: QkRows,
    ) -> anyhow::Result<Self> {
        let config: LlamaConfig =
            serde_json::from_str(json).context("config.json: the model's sizes")?;
        // Each layer's gate and up projections become one matrix; taking them out of the map
        // first frees each pair as it is joined, so the weights are never held twice.
        for i in 0..config.num_hidden_layers {
            let mut take = |name: &str| {
                let key = format!("model.layers.{i}.mlp.{name}.weight");
                tensors.remove(&key).context(key)
            };
            let gate_up = Tensor::cat(&[take("gate_proj")?, take("up_proj")?], 0)?;
            tensors.insert(format!("model.layers.{i}.mlp.gate_up.weight"), gate_up);
        }
        let vb = VarBuilder::from_tensors(tensors, dtype, device);
        let (d, vocab) = (config.hidden_size, config.vocab_size);
        let embed_weight = vb.get((vocab, d), "model.embed_tokens.weight")?;
        let head_weight = match config.tie_word_embeddings {
            true => embed_weight.clone(),
            false => vb.get((vocab, d), "lm_head.weight")?,
        };
        let mut shared = SharedEncodings::new();
        let layers = (0..config.num_hidden_layers)
            .map(|i| {
                Layer::load(
                    json,
                    i,
                    &config,
                    &mut shared,
                    rows,
                    vb.pp(format!("model.layers.{i}")),
                )
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(Self {
            embed: Embedding::new(embed_weight, d),
            layers,
            norm: rms_norm(&config, vb.pp("model.norm"))?,
            head: Linear::new(head_weight, None),
            config,
            dtype,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The layers' attention blocks.
    pub fn attention(&self) -> impl Iterator<Item = &MultiHeadAttention> {
        self.layers.iter().map(|l| &l.attention)
    }

    /// One empty KV cache per layer.
    pub fn caches(&self) -> Vec<KvCache> {
        self.layers.iter().map(|_| KvCache::new()).collect()
    }

    /// The last hidden states (after the final norm) of `ids`, continuing from `caches`.
    pub fn hidden(&self, ids: &Tensor, caches: &mut [KvCache]) -> anyhow::Result<Tensor> {
        anyhow::ensure!(
            caches.len() == self.layers.len(),
            "{} caches for {} layers",
            caches.len(),
            self.layers.len()
        );
        let mut h = self.embed.forward(ids)?;
        for (layer, cache) in self.layers.iter().zip(caches) {
            h = layer.forward(&h, cache)?;
        }
        Ok(self.norm.forward(&h)?)
    }

    /// The logits (f32) of hidden states.
    pub fn logits(&self, hidden: &Tensor) -> anyhow::Result<Tensor> {
        Ok(linear(&self.head, hidden)?.to_dtype(DType::F32)?)
    }

    /// The logits (f32) of every position of `ids`, continuing from `caches`.
    pub fn forward(&self, ids: &Tensor, caches: &mut [KvCache]) -> anyhow::Result<Tensor> {
        let hidden = self.hidden(ids, caches)?;
        self.logits(&hidden)
    }

    /// The logits (f32) of the last position of `ids` only, `(B, vocab)`: a prompt's
    /// prefill, which needs no head over the positions before.
    pub fn forward_last(&self, ids: &Tensor, caches: &mut [KvCache]) -> anyhow::Result<Tensor> {
        let hidden = self.hidden(ids, caches)?;
        let t = hidden.dim(1)?;
        self.logits(&hidden.narrow(1, t - 1, 1)?.squeeze(1)?)
    }

    /// The bytes of weights one decoding step reads: every matrix and norm, the head once
    /// (tied or not), and of the embeddings only one row.
    pub fn weight_bytes_per_token(&self) -> usize {
        let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let linear = |l: &Linear| bytes(l.weight()) + l.bias().map_or(0, bytes);
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                attention_bytes(&l.attention, self.dtype)
                    + bytes(l.input_norm.weight())
                    + bytes(l.post_norm.weight())
                    + linear(&l.gate_up)
                    + linear(&l.down)
            })
            .sum();
        let row = self.config.hidden_size * self.dtype.size_in_bytes();
        layers + bytes(self.norm.weight()) + linear(&self.head) + row
    }
}

impl Layer {
    fn load(
        json: &str,
        i: usize,
        config: &LlamaConfig,
        shared: &mut SharedEncodings,
        rows: QkRows,
        vb: VarBuilder,
    ) -> anyhow::Result<Self> {
        let mut attention = HfAttentionConfig::from_json_layer(json, i)?;
        if let EncodingConfig::Rotary(rope) = &mut attention.encoding {
            rope.layout = rows.rope_layout();
        }
        let (d, hidden) = (config.hidden_size, config.intermediate_size);
        Ok(Self {
            input_norm: rms_norm(config, vb.pp("input_layernorm"))?,
            attention: attention.load_shared(shared, vb.pp("self_attn"))?,
            post_norm: rms_norm(config, vb.pp("post_attention_layernorm"))?,
            gate_up: Linear::new(vb.get((2 * hidden, d), "mlp.gate_up.weight")?, None),
            down: Linear::new(vb.get((d, hidden), "mlp.down_proj.weight")?, None),
        })
    }

    fn forward(&self, h: &Tensor, cache: &mut KvCache) -> anyhow::Result<Tensor> {
        let x = self.input_norm.forward(h)?;
        let opts = AttentionOptions::default();
        let h = (h + self.attention.forward_with(&x, &opts, Some(cache))?.output)?;
        let x = self.post_norm.forward(&h)?;
        let mlp = linear(&self.down, &swiglu(&linear(&self.gate_up, &x)?)?)?;
        Ok((h + mlp)?)
    }
}

/// The bytes of one attention block's projections (and their biases) in `dtype`.
fn attention_bytes(attention: &MultiHeadAttention, dtype: DType) -> usize {
    let a = attention.config();
    let (q, kv) = (a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim);
    let weights = (q + 2 * kv) * a.d_model + a.d_model * q;
    let biases = usize::from(a.bias) * (q + 2 * kv) + usize::from(a.out_bias) * a.d_model;
    (weights + biases) * dtype.size_in_bytes()
}

fn rms_norm(config: &LlamaConfig, vb: VarBuilder) -> anyhow::Result<RmsNorm> {
    let weight = vb.get(config.hidden_size, "weight")?;
    Ok(RmsNorm::new(weight, config.rms_norm_eps))
}

/// `silu(a) ⊙ b` of `x = [a | b]` over the last axis: one pass over contiguous f32 or bf16
/// rows on the CPU (candle-nn's `swiglu` makes three, over strided halves), candle-nn's
/// elsewhere. In bf16 as PyTorch rounds it: `silu(a)` computed in f32 and rounded to bf16, its
/// product with `b` computed in f32 and rounded again.
fn swiglu(x: &Tensor) -> candle_core::Result<Tensor> {
    let dtypes = [DType::F32, DType::BF16];
    if x.device().is_cpu() && dtypes.contains(&x.dtype()) && !x.track_op() {
        return x.contiguous()?.apply_op1_no_bwd(&SwiGlu);
    }
    candle_nn::ops::swiglu(x)
}

struct SwiGlu;

/// `y = silu(a) ⊙ b` for every row `[a | b]` of `x`, in `T`: values read through `to_f32`,
/// `silu(a)` and the product each rounded to `T` by `from_f32`.
fn swiglu_rows<T: Copy + Default + Send + Sync>(
    x: &[T],
    width: usize,
    to_f32: impl Fn(T) -> f32 + Sync,
    from_f32: impl Fn(f32) -> T + Sync,
) -> Vec<T> {
    use rayon::prelude::*;
    let half = width / 2;
    let rows = x.len() / width.max(1);
    let mut out = vec![T::default(); rows * half];
    out.par_chunks_mut(half.max(1))
        .zip(x.par_chunks(width.max(1)))
        .for_each(|(y, x)| {
            let (a, b) = x.split_at(half);
            for ((y, &a), &b) in y.iter_mut().zip(a).zip(b) {
                let a = to_f32(a);
                let silu = to_f32(from_f32(a / (1.0 + (-a).exp())));
                *y = from_f32(silu * to_f32(b));
            }
        });
    out
}

impl candle_core::CustomOp1 for SwiGlu {
    fn name(&self) -> &'static str {
        "llama-swiglu"
    }

    fn cpu_fwd(
        &self,
        s: &candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use candle_core::CpuStorage;
        use half::bf16;
        let Some((start, end)) = l.contiguous_offsets() else {
            candle_core::bail!("swiglu: expected contiguous rows");
        };
        let width = l.dims().last().copied().unwrap_or(0);
        if width % 2 != 0 {
            candle_core::bail!("swiglu: the last axis ({width}) must hold [a | b], an even width");
        }
        let half = width / 2;
        let out = match s {
            CpuStorage::F32(d) => CpuStorage::F32(swiglu_rows(&d[start..end], width, |v| v, |v| v)),
            CpuStorage::BF16(d) => CpuStorage::BF16(swiglu_rows(
                &d[start..end],
                width,
                bf16::to_f32,
                bf16::from_f32,
            )),
            _ => candle_core::bail!("swiglu: expected f32 or bf16"),
        };
        let mut dims = l.dims().to_vec();
        *dims.last_mut().expect("a last axis") = half;
        Ok((out, candle_core::Shape::from(dims)))
    }
}
