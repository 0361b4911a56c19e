//! A tiny decoder-only language model built from the crate's attention block.
//!
//! ```text
//! h = embed(tokens)                 (+ p[pos] once here for the absolute encodings)
//! per layer:  h = h + attn(rms(h))  (causal MultiHeadAttention; rotary/bias encodings plugged in)
//!             h = h + W2 gelu(W1 rms(h))
//! logits = head(rms(h))
//! ```
//!
//! Relative and rotary encodings are one module shared by every layer (as T5 shares its bias);
//! absolute ones are added once to the token embeddings, as GPT-2 does.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear_no_bias, Embedding, Init, Linear, VarBuilder, VarMap};
use candle_posenc::{
    AttentionConfig, AttentionContext, AttentionOptions, EncodingConfig, MultiHeadAttention,
    PositionalEncoding, Positions, Result,
};

use super::data::Rng;
use super::gelu::gelu;
use super::rms_norm::rms_norm;

/// The model's size.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Width.
    pub d_model: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// Transformer layers.
    pub num_layers: usize,
    /// Hidden width of the MLP.
    pub mlp: usize,
    /// Whether every attention layer has learned per-head sink logits (gpt-oss's sinks).
    pub sinks: bool,
}

impl ModelConfig {
    /// The attention block's configuration (causal, no dropout).
    pub fn attention(&self) -> AttentionConfig {
        AttentionConfig::new(self.d_model, self.num_heads)
            .with_causal(true)
            .with_sinks(self.sinks)
    }

    /// As `lm.*` checkpoint metadata.
    pub fn to_metadata(&self) -> HashMap<String, String> {
        [
            ("lm.vocab", self.vocab),
            ("lm.d_model", self.d_model),
            ("lm.num_heads", self.num_heads),
            ("lm.num_layers", self.num_layers),
            ("lm.mlp", self.mlp),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .chain([("lm.sinks".to_string(), self.sinks.to_string())])
        .collect()
    }

    /// Reads what [`Self::to_metadata`] wrote.
    pub fn from_metadata(m: &HashMap<String, String>) -> anyhow::Result<Self> {
        let get = |k: &str| -> anyhow::Result<usize> {
            let raw = m
                .get(k)
                .ok_or_else(|| anyhow::anyhow!("metadata `{k}` missing"))?;
            Ok(raw.parse()?)
        };
        Ok(Self {
            vocab: get("lm.vocab")?,
            d_model: get("lm.d_model")?,
            num_heads: get("lm.num_heads")?,
            num_layers: get("lm.num_layers")?,
            mlp: get("lm.mlp")?,
            // Checkpoints from before sinks joined the model have none.
            sinks: m.get("lm.sinks").map_or(Ok(false), |v| v.parse())?,
        })
    }
}

/// Root-mean-square normalisation with a learned gain ([`rms_norm`]).
#[derive(Debug, Clone)]
struct RmsNorm {
    weight: Tensor,
}

impl RmsNorm {
    fn new(d: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            weight: vb.get_with_hints(d, "weight", Init::Const(1.0))?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(rms_norm(x, &self.weight)?)
    }
}

#[derive(Debug, Clone)]
struct Layer {
    norm1: RmsNorm,
    attn: MultiHeadAttention,
    norm2: RmsNorm,
    up: Linear,
    down: Linear,
}

/// The language model.
#[derive(Debug, Clone)]
pub struct Lm {
    config: ModelConfig,
    embed: Embedding,
    /// Absolute encodings, added once to the embeddings.
    input_encoding: Option<Arc<dyn PositionalEncoding>>,
    layers: Vec<Layer>,
    norm: RmsNorm,
    head: Linear,
    /// Attention on candle's ops (the path that returns the weights) instead of the fused
    /// training core: the reference for the fused path's loss curve.
    unfused: bool,
}

/// Whether the encoding is added to the input (absolute) rather than plugged into attention.
pub fn is_absolute(encoding: &EncodingConfig) -> bool {
    matches!(
        encoding,
        EncodingConfig::Sinusoidal(_) | EncodingConfig::Learned(_)
    )
}

impl Lm {
    /// Builds the model from `vb` (a `VarMap` for training, a checkpoint for evaluation). The
    /// encoding's own tensors live under `pos.`.
    pub fn new(config: &ModelConfig, encoding: &EncodingConfig, vb: VarBuilder) -> Result<Self> {
        let d = config.d_model;
        let embed_w =
            vb.pp("embed")
                .get_with_hints((config.vocab, d), "weight", Init::Const(0.0))?;
        let embed = Embedding::new(embed_w, d);
        let built = encoding.build(vb.pp("pos"))?;
        let (input_encoding, attn_encoding) = if is_absolute(encoding) {
            (built, None)
        } else {
            (None, built)
        };
        let attn_cfg = config.attention();
        let mut layers = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            let vb = vb.pp(format!("layers.{i}"));
            layers.push(Layer {
                norm1: RmsNorm::new(d, vb.pp("norm1"))?,
                attn: MultiHeadAttention::new(&attn_cfg, attn_encoding.clone(), vb.pp("attn"))?,
                norm2: RmsNorm::new(d, vb.pp("norm2"))?,
                up: linear_no_bias(d, config.mlp, vb.pp("mlp.up"))?,
                down: linear_no_bias(config.mlp, d, vb.pp("mlp.down"))?,
            });
        }
        Ok(Self {
            config: config.clone(),
            embed,
            input_encoding,
            layers,
            norm: RmsNorm::new(d, vb.pp("norm"))?,
            head: linear_no_bias(d, config.vocab, vb.pp("head"))?,
            unfused: false,
        })
    }

    /// The model with its attention on candle's ops (`true`) or on the fused cores (`false`,
    /// the default).
    pub fn with_unfused_attention(mut self, unfused: bool) -> Self {
        self.unfused = unfused;
        self
    }

    /// The model's size.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Logits `(B, T, vocab)` for tokens `(B, T)` at positions `0..T`.
    ///
    /// # Errors
    /// The encoding's errors, e.g. `PositionOutOfRange` for a learned table shorter than `T`.
    pub fn forward(&self, tokens: &Tensor, train: bool) -> Result<Tensor> {
        let positions = Positions::Offset(0);
        let mut h = self.embed.forward(tokens)?;
        if let Some(enc) = &self.input_encoding {
            let ctx = AttentionContext::chunk(&positions, tokens.dim(1)?).with_train(train);
            h = enc.add_to_input(&h, &ctx)?;
        }
        let options = AttentionOptions {
            positions: Some(&positions),
            train,
            return_weights: self.unfused,
            ..Default::default()
        };
        for layer in &self.layers {
            let a = layer
                .attn
                .forward_with(&layer.norm1.forward(&h)?, &options, None)?
                .output;
            h = (h + a)?;
            let m = layer.norm2.forward(&h)?;
            let m = layer.down.forward(&gelu(&layer.up.forward(&m)?)?)?;
            h = (h + m)?;
        }
        Ok(self.head.forward(&self.norm.forward(&h)?)?)
    }
}

/// The encodings' linear projections of the block's input: FoX's gates and Inkling's mixing
/// weights.
const INPUT_PROJECTIONS: [&str; 2] = ["pos.to_forget_gates.0.weight", "pos.r_proj.weight"];

/// Overwrites every variable of `varmap` with seeded values, so training starts from the same
/// point on every run (candle's own initialisers draw from an unseeded generator). Variables are
/// visited in name order; each gets its own stream of `seed`.
///
/// Norm gains stay at one, sink logits at zero and biases at their constructor's value (FoX's
/// gate bias 5: little is forgotten at first); linear weights, the encodings' projections of
/// the block's input (FoX's gates, Inkling's `r_proj`) included, are N(0, 1/fan_in); token
/// embeddings N(0, 1); the encodings' tables use the crate's documented initial scales (learned
/// table, Shaw and Inkling's bank N(0, 0.02), T5 and clipped bias tables N(0, 1)).
pub fn seeded_init(varmap: &VarMap, seed: u64) -> anyhow::Result<()> {
    let data = varmap
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("VarMap lock poisoned"))?;
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    for (i, name) in names.into_iter().enumerate() {
        let var = &data[name];
        let dims = var.dims().to_vec();
        let std = if name.contains("norm") || name.ends_with(".sinks") || name.ends_with(".bias") {
            continue; // norm gains at one, sink logits at zero, biases as built
        } else if name.starts_with("embed.")
            || name.starts_with("pos.relative_attention_bias")
            || name.starts_with("pos.bias_table")
        {
            1.0
        } else if name.starts_with("pos.") && !INPUT_PROJECTIONS.contains(&name.as_str()) {
            0.02
        } else {
            1.0 / (dims[dims.len() - 1] as f64).sqrt()
        };
        let mut rng = Rng::new(seed ^ (i as u64 + 1).wrapping_mul(0xD6E8_FEB8_6659_FD93));
        let n: usize = dims.iter().product();
        let values: Vec<f32> = (0..n).map(|_| (rng.normal() * std) as f32).collect();
        var.set(&Tensor::from_vec(values, dims.as_slice(), &Device::Cpu)?.to_dtype(DType::F32)?)?;
    }
    Ok(())
}
