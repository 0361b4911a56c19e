//! Multi-head attention with grouped KV heads, masks, a KV cache and the positional plug.
//!
//! ```text
//! x' = enc.add_to_input(x)
//! q = x' W_qᵀ, k = x' W_kᵀ, v = x' W_vᵀ              split into H (q) and Hkv (k, v) heads
//! q, k = enc.rotate_queries_keys(q, k)
//! k, v = cache.append(k, v)                          keys rotated once, at their own position
//! s = (scale · q) kᵀ + enc.logits_bias(scale · q) + attn_mask,   masked where causal/padding
//! α = softmax(s),  out = α v + enc.value_term(α),    heads merged, then W_o
//! ```
//!
//! # Shapes
//! - `x`: `(B, T, d_model)`; output `(B, T, d_model)`; weights `(B, H, T, T_keys)`.
//!
//! # Paths
//! - CPU, f32 inference without returned weights: the whole core runs per head and tile of
//!   queries (`fused_attention`): both products, the compact or dense bias, masks, softmax and
//!   a compact relative value term, with grouped KV heads read in place.
//! - CPU, f32 inference returning the weights: products as candle ops, bias, masks and softmax
//!   in one in-place pass (`fused_softmax`).
//! - Training, other dtypes and devices: candle ops throughout (differentiable).
//!
//! All three attend over blocks of queries sized by [`AttentionConfig::logits_budget`].
//!
//! Weights are named like HF Llama (`q_proj`, `k_proj`, `v_proj`, `o_proj`, each with `weight`
//! and optional `bias`), so such checkpoints load through a `VarBuilder` prefix.
//! Reference: Vaswani et al. 2017; grouped-query attention: Ainslie et al. 2023.

use std::sync::Arc;

use candle_core::{DType, Module, Tensor, D};
use candle_nn::{linear_b, Linear, VarBuilder};

use super::config::{AttentionConfig, AttentionOptions, AttentionOutput};
use super::mask::{apply_keep_mask, check_padding, keep_mask};
use super::{fused_attention, fused_softmax, RelativeBias};
use super::{KvCache, PositionalEncoding};
use crate::limits::check_elements;
use crate::{Error, Positions, Result};

/// Multi-head self-attention that consumes any [`PositionalEncoding`].
///
/// # Example
/// ```
/// use std::sync::Arc;
/// use candle_core::{Device, DType, Module, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use candle_posenc::{AttentionConfig, MultiHeadAttention, SinusoidalConfig, SinusoidalPositionalEncoding};
///
/// let dev = Device::Cpu;
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
/// let pe = SinusoidalPositionalEncoding::new(&SinusoidalConfig::new(32), &dev)?;
/// let cfg = AttentionConfig::new(32, 4).with_kv_heads(2).with_causal(true);
/// let mha = MultiHeadAttention::new(&cfg, Some(Arc::new(pe)), vb.pp("self_attn"))?;
/// let x = Tensor::randn(0f32, 1.0, (2, 7, 32), &dev)?;
/// assert_eq!(mha.forward(&x)?.dims(), &[2, 7, 32]);
/// # Ok::<(), candle_posenc::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct MultiHeadAttention {
    config: AttentionConfig,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    encoding: Option<Arc<dyn PositionalEncoding>>,
}

impl MultiHeadAttention {
    /// Loads (or creates) the four projections from `vb` and plugs in `encoding`.
    ///
    /// # Errors
    /// As [`AttentionConfig::validate`]; [`Error::MissingTensor`] / [`Error::TensorShape`] for
    /// checkpoint tensors that are absent or misshapen; [`Error::DType`] for an integer
    /// `VarBuilder`.
    pub fn new(
        config: &AttentionConfig,
        encoding: Option<Arc<dyn PositionalEncoding>>,
        vb: VarBuilder,
    ) -> Result<Self> {
        config.validate()?;
        if !vb.dtype().is_float() {
            return Err(Error::DType {
                what: "attention weights (the VarBuilder's dtype)",
                expected: "a float dtype (f32, f64, bf16 or f16)",
                got: vb.dtype(),
            });
        }
        let (d, hd) = (config.d_model, config.head_dim);
        let q_proj = linear_b(d, config.num_heads * hd, config.bias, vb.pp("q_proj"))?;
        let k_proj = linear_b(d, config.num_kv_heads * hd, config.bias, vb.pp("k_proj"))?;
        let v_proj = linear_b(d, config.num_kv_heads * hd, config.bias, vb.pp("v_proj"))?;
        let o_proj = linear_b(config.num_heads * hd, d, config.bias, vb.pp("o_proj"))?;
        Ok(Self {
            config: config.clone(),
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            encoding,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &AttentionConfig {
        &self.config
    }

    /// The plugged-in encoding.
    pub fn encoding(&self) -> Option<&Arc<dyn PositionalEncoding>> {
        self.encoding.as_ref()
    }

    /// Replaces the encoding (the projections are kept).
    pub fn with_encoding(mut self, encoding: Option<Arc<dyn PositionalEncoding>>) -> Self {
        self.encoding = encoding;
        self
    }

    /// `(B, T, heads·hd)` → `(B, heads, T, hd)`.
    fn split_heads(&self, t: &Tensor, heads: usize) -> Result<Tensor> {
        let (b, len, _) = t.dims3()?;
        Ok(t.reshape((b, len, heads, self.config.head_dim))?
            .transpose(1, 2)?
            .contiguous()?)
    }

    /// Repeats each KV head `num_heads / num_kv_heads` times: `(B, Hkv, T, D)` → `(B, H, T, D)`.
    fn repeat_kv(&self, t: Tensor) -> Result<Tensor> {
        let n_rep = self.config.num_heads / self.config.num_kv_heads;
        if n_rep == 1 {
            return Ok(t);
        }
        let (b, hkv, len, d) = t.dims4()?;
        Ok(t.unsqueeze(2)?
            .broadcast_as((b, hkv, n_rep, len, d))?
            .reshape((b, hkv * n_rep, len, d))?)
    }

    /// Attention over `x` with positions, masks, an optional cache, and optional weights.
    ///
    /// With a cache, the chunk's keys and values are appended first and the queries attend to
    /// every cached key; feeding a sequence token by token gives the same outputs as one call on
    /// the whole sequence.
    ///
    /// # Shapes
    /// `x`: `(B, T, d_model)` → output `(B, T, d_model)`, weights `(B, H, T, T_keys)`.
    ///
    /// # Errors
    /// [`Error::Rank`] / [`Error::Shape`] for a malformed input, positions, mask or cache
    /// chunk; [`Error::DType`] for an input whose dtype is not the weights';
    /// [`Error::InvalidConfig`] if the logits (batch × heads × queries × keys) would pass
    /// [`crate::limits::MAX_ELEMENTS`]; the encoding's own errors (e.g.
    /// [`Error::PositionOutOfRange`]).
    pub fn forward_with(
        &self,
        x: &Tensor,
        options: &AttentionOptions,
        cache: Option<&mut KvCache>,
    ) -> Result<AttentionOutput> {
        let cfg = &self.config;
        let default_positions;
        let positions = match options.positions {
            Some(p) => p,
            None => {
                default_positions =
                    Positions::Offset(cache.as_ref().map_or(0, |c| c.next_position()));
                &default_positions
            }
        };
        let (b, t) = positions.check_input(x, cfg.d_model, "attention input x")?;
        let weights = self.q_proj.weight().dtype();
        if x.dtype() != weights {
            return Err(Error::DType {
                what: "attention input x",
                expected: match weights {
                    DType::F32 => "f32, the dtype of the attention weights",
                    DType::F64 => "f64, the dtype of the attention weights",
                    DType::BF16 => "bf16, the dtype of the attention weights",
                    DType::F16 => "f16, the dtype of the attention weights",
                    _ => "the dtype of the attention weights",
                },
                got: x.dtype(),
            });
        }
        // The logits of one query block (of all queries when the weights are returned) must
        // be allocatable.
        let tk = t.saturating_add(cache.as_ref().map_or(0, |c| c.len()));
        let block = cfg.query_block_for(b, t, tk, x.dtype().size_in_bytes());
        let rows = if options.return_weights { t } else { block };
        check_elements(
            "sequence length",
            t,
            format!(
                "batch ({b}) × heads ({}) × queries per block ({rows}) × keys ({tk}) of the attention logits",
                cfg.num_heads
            )
            .as_str(),
            &[b, cfg.num_heads, rows, tk],
        )?;
        if t == 0 {
            // No query: candle's linear layers cannot reshape an empty chunk, and there is
            // nothing to append to the cache. The output (and weights) are empty.
            let tk = cache.as_ref().map_or(0, |c| c.len());
            let empty = |shape: &[usize]| Tensor::zeros(shape, x.dtype(), x.device());
            return Ok(AttentionOutput {
                output: empty(&[b, 0, cfg.d_model])?,
                weights: match options.return_weights {
                    true => Some(empty(&[b, cfg.num_heads, 0, tk])?),
                    false => None,
                },
            });
        }
        let enc = self.encoding.as_deref();

        let x = match enc {
            Some(e) => e.add_to_input(x, positions, options.train)?,
            None => x.clone(),
        };
        let q = self.split_heads(&self.q_proj.forward(&x)?, cfg.num_heads)?;
        let k = self.split_heads(&self.k_proj.forward(&x)?, cfg.num_kv_heads)?;
        let v = self.split_heads(&self.v_proj.forward(&x)?, cfg.num_kv_heads)?;
        // Inference: candle's fused softmax has no backward, so nothing reaches q and k anyway;
        // detached, they (and the logits) can be rotated and normalised in place, and no query
        // block's weights are kept alive by a graph through v.
        let (q, k, v) = if options.train {
            (q, k, v)
        } else {
            (q.detach(), k.detach(), v.detach())
        };
        let (q, k) = match enc {
            Some(e) => e.rotate_queries_keys_owned(q, k, positions, positions)?,
            None => (q, k),
        };
        let (k, v, k_positions) = match cache {
            Some(cache) => cache.append(&k, &v, positions)?,
            None => (k, v, positions.clone()),
        };
        let tk = k.dim(2)?;
        let q = (q * cfg.softmax_scale)?;
        // Inference on the CPU without weights to return or a value term to feed: the whole
        // core (products, bias, masks, softmax) runs per head and tile of queries, writing the
        // merged heads; grouped KV heads are read in place.
        let fused = !options.train
            && !options.return_weights
            && fused_attention::applies(&q, &k, &v)
            && match enc {
                Some(e) if e.has_value_term() => e
                    .relative_value_term(positions, &k_positions)?
                    .is_some_and(|r| fused_attention::values_apply(&r, cfg.head_dim)),
                _ => true,
            };
        let (k, v) = if fused {
            (k, v)
        } else {
            (self.repeat_kv(k)?, self.repeat_kv(v)?)
        };
        let merged = match fused {
            true => Some(Tensor::zeros(
                (b, t, cfg.num_heads, cfg.head_dim),
                q.dtype(),
                q.device(),
            )?),
            false => None,
        };
        let full = (b, cfg.num_heads, t, tk);
        let attn_mask = match options.attn_mask {
            Some(mask) => Some(mask.broadcast_as(full).map_err(|_| {
                Error::shape(
                    "additive attention mask",
                    format!("a shape broadcastable to {full:?} = (batch, heads, queries, keys)"),
                    mask.shape(),
                )
            })?),
            None => None,
        };
        let padding = match options.padding_mask {
            Some(p) => Some(check_padding(p, b, tk)?),
            None => None,
        };
        // Query blocks, each against the keys it can see: with a plain causal mask, block
        // [s, s + n) sees keys 0..s + n + tk − t only (no row is fully masked, so dropping the
        // hidden keys changes nothing); with padding or an additive mask, every key.
        let trim_keys = cfg.causal && padding.is_none() && attn_mask.is_none();
        let mut outs = Vec::new();
        let mut weights = Vec::new();
        let mut start = 0;
        loop {
            let n = block.min(t - start);
            let kv = if trim_keys {
                (start + n + tk - t).min(tk)
            } else {
                tk
            };
            let part = Block {
                q: narrowed(&q, 2, start, n, t)?,
                k: narrowed(&k, 2, 0, kv, tk)?,
                v: narrowed(&v, 2, 0, kv, tk)?,
                q_positions: if n == t {
                    positions.clone()
                } else {
                    positions.narrow(start, n)?
                },
                k_positions: if kv == tk {
                    k_positions.clone()
                } else {
                    k_positions.narrow(0, kv)?
                },
                attn_mask: attn_mask
                    .as_ref()
                    .map(|m| narrowed(m, 2, start, n, t))
                    .transpose()?,
                padding: padding.as_ref(),
                causal: cfg.causal.then_some(start + tk - t),
            };
            if let Some(merged) = &merged {
                self.attend_fused(&part, merged, start)?;
            } else {
                let (probs, out) = self.attend(&part, options.train)?;
                outs.push(out);
                if options.return_weights {
                    weights.push(if kv == tk {
                        probs
                    } else {
                        let hidden = Tensor::zeros(
                            (b, cfg.num_heads, n, tk - kv),
                            probs.dtype(),
                            probs.device(),
                        )?;
                        Tensor::cat(&[&probs, &hidden], 3)?
                    });
                }
            }
            start += n;
            if start >= t {
                break;
            }
        }
        let out = match merged {
            Some(merged) => merged,
            None if outs.len() == 1 => outs.swap_remove(0).transpose(1, 2)?,
            None => Tensor::cat(&outs, 2)?.transpose(1, 2)?,
        }
        .reshape((b, t, cfg.num_heads * cfg.head_dim))?;
        let weights = match weights.len() {
            0 => None,
            1 => Some(weights.swap_remove(0)),
            _ => Some(Tensor::cat(&weights, 2)?),
        };
        Ok(AttentionOutput {
            output: self.o_proj.forward(&out)?,
            weights,
        })
    }

    /// The additive terms of one query block's logits: dense tensors broadcastable to
    /// `(B, H, n, kv)` (the encoding's bias unless given compact, the additive mask), and the
    /// encoding's compact relative bias when `compact` and the fused row pass can read it.
    fn logit_terms(
        &self,
        part: &Block,
        compact: bool,
    ) -> Result<(Vec<Tensor>, Option<RelativeBias>)> {
        let enc = self.encoding.as_deref();
        let (qp, kp) = (&part.q_positions, &part.k_positions);
        let kv = part.k.dim(2)?;
        let relative = match enc {
            Some(e) if compact => e
                .relative_logits_bias(&part.q, qp, kp, kv)?
                .filter(fused_softmax::relative_applies),
            _ => None,
        };
        let bias = match enc {
            Some(e) if relative.is_none() => e.logits_bias(&part.q, qp, kp, kv)?,
            _ => None,
        };
        let dense = [&bias, &part.attn_mask]
            .into_iter()
            .flatten()
            .map(|t| t.to_dtype(part.q.dtype()))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok((dense, relative))
    }

    /// The fused core for one query block, written into rows `start..start + n` of `merged`
    /// `(B, T, H, D)`.
    fn attend_fused(&self, part: &Block, merged: &Tensor, start: usize) -> Result<()> {
        let (dense, relative) = self.logit_terms(part, true)?;
        let values = match self.encoding.as_deref() {
            Some(e) if e.has_value_term() => Some(
                e.relative_value_term(&part.q_positions, &part.k_positions)?
                    .ok_or_else(|| {
                        Error::config(
                            "encoding",
                            "a relative value term for the whole chunk but not for a query block",
                            "the same answer for every block of offset positions",
                        )
                    })?,
            ),
            _ => None,
        };
        fused_attention::Core {
            q: &part.q,
            k: &part.k,
            v: &part.v,
            dense: dense.iter().collect(),
            relative: relative.iter().collect(),
            padding: part.padding,
            causal: part.causal,
            values: values.as_ref(),
            tile: fused_attention::tile_rows(part.k.dim(2)?),
        }
        .write_into(merged, start)
    }

    /// Attention of one query block: `(softmax(q kᵀ + bias + masks), α v + value term)`, both
    /// `(B, H, n, ·)`. `q` is already scaled.
    fn attend(&self, part: &Block, train: bool) -> Result<(Tensor, Tensor)> {
        let enc = self.encoding.as_deref();
        let mut scores = part.q.matmul(&part.k.t()?)?;
        let (b, _, n, kv) = scores.dims4()?;
        let (qp, kp) = (&part.q_positions, &part.k_positions);
        let inference_cpu = !train && fused_softmax::applies(&scores);
        // The fused pass reads relative biases as short rows; everything else gets them dense.
        let (terms, relative) = self.logit_terms(part, inference_cpu)?;
        let probs = if inference_cpu && terms.iter().all(|t| t.device().is_cpu()) {
            // Inference on the CPU: bias, masks and softmax in one in-place pass.
            let dense: Vec<&Tensor> = terms.iter().collect();
            fused_softmax::bias_mask_softmax_in_place(
                &scores,
                &dense,
                &relative.iter().collect::<Vec<_>>(),
                part.padding,
                part.causal,
            )?;
            scores
        } else {
            for term in &terms {
                scores = scores.broadcast_add(term)?;
            }
            if let Some(r) = &relative {
                scores = scores.broadcast_add(&r.to_dense(n, kv)?.to_dtype(scores.dtype())?)?;
            }
            let keep = keep_mask(part.causal, part.padding, b, n, kv, scores.device())?;
            if let Some(keep) = keep {
                scores = apply_keep_mask(&scores, &keep)?;
            }
            if train {
                candle_nn::ops::softmax(&scores, D::Minus1)?
            } else {
                candle_nn::ops::softmax_last_dim(&scores.contiguous()?)?
            }
        };
        let dropped = if train && self.config.dropout > 0.0 {
            candle_nn::ops::dropout(&probs, self.config.dropout)?
        } else {
            probs.clone()
        };
        let mut out = dropped.matmul(&part.v)?;
        if let Some(e) = enc {
            if let Some(term) = e.value_term(&dropped, qp, kp)? {
                out = out.broadcast_add(&term.to_dtype(out.dtype())?)?;
            }
        }
        Ok((probs, out))
    }
}

/// One query block's inputs, narrowed from the whole chunk.
struct Block<'a> {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_positions: Positions,
    k_positions: Positions,
    attn_mask: Option<Tensor>,
    padding: Option<&'a Tensor>,
    /// `Some(first)`: query row `i` sees keys `j ≤ first + i`.
    causal: Option<usize>,
}

/// `t.narrow(dim, start, len)`, or `t` itself when that is all of `total`.
fn narrowed(t: &Tensor, dim: usize, start: usize, len: usize, total: usize) -> Result<Tensor> {
    Ok(if start == 0 && len == total {
        t.clone()
    } else {
        t.narrow(dim, start, len)?
    })
}

impl Module for MultiHeadAttention {
    /// Attention at positions `0..T`, no mask beyond the configured causality, inference mode.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(self
            .forward_with(x, &AttentionOptions::default(), None)?
            .output)
    }
}
