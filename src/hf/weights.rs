//! HF's attention weight names and layouts, mapped once at load onto the block's own
//! (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `q_norm`, `k_norm`, `sinks`,
//! `relative_attention_bias`).
//!
//! Fused projections are split and Conv1D weights transposed here, never per forward:
//!
//! | layout | rows of the fused weight (each row `d_model` wide) |
//! |---|---|
//! | stacked (Phi-3 `qkv_proj`, Falcon multi-query) | `[q (H·D); k (Hkv·D); v (Hkv·D)]` |
//! | per head (GPT-NeoX, BLOOM, Falcon without multi-query) | `(H, 3, D)`: each head's q, k, v |
//! | grouped (Falcon's new decoder architecture) | `(Hkv, H/Hkv + 2, D)`: a group's queries, then its k and v |
//! | Conv1D (GPT-2 `c_attn`) | stored transposed, `(d_model, 3·H·D)`, columns `[q | k | v]` |

use std::collections::HashMap;

use candle_core::Tensor;
use candle_nn::VarBuilder;

use crate::attention::AttentionConfig;
use crate::error::{Error, Result};

/// `a × b` (or `a + b`) of the layer's sizes, or [`Error::InvalidConfig`] naming `what`: the
/// sizes are public fields, so they are checked even after [`AttentionConfig::validate`].
fn size(what: &'static str, n: Option<usize>) -> Result<usize> {
    n.ok_or_else(|| {
        Error::config(
            what,
            "overflow",
            "layer sizes whose weight shapes fit usize",
        )
    })
}

/// How q, k and v are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum QkvLayout {
    /// Three projections under these names.
    Separate([&'static str; 3]),
    /// One projection, rows `[q; k; v]`.
    Stacked(&'static str),
    /// One projection, rows `(H, 3, D)`.
    PerHead(&'static str),
    /// One projection, rows `(Hkv, H/Hkv + 2, D)`.
    Grouped(&'static str),
    /// One Conv1D (`y = x W + b`, `W` of shape `(d_model, 3·H·D)`), columns `[q | k | v]`.
    Conv1D(&'static str),
    /// Multi-head latent attention (DeepSeek): `q_a_proj`, `q_a_layernorm`, `q_b_proj` (or
    /// `q_proj`), `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, kept under these names.
    Latent,
}

/// Where a family keeps its attention weights, relative to the attention module's prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct WeightLayout {
    pub(super) qkv: QkvLayout,
    /// The output projection's name.
    pub(super) out: &'static str,
    /// Whether the output projection is a Conv1D (stored transposed).
    pub(super) out_conv1d: bool,
}

/// Reads the HF tensors of one attention layer from `vb` (shape-checked, so errors name the
/// HF tensor) and returns them under the block's names, split and transposed.
pub(super) fn remap(
    layout: &WeightLayout,
    cfg: &AttentionConfig,
    relative_bias: Option<(usize, usize)>,
    vb: &VarBuilder,
) -> Result<HashMap<String, Tensor>> {
    // The fields are public and may have changed since parsing: check them before any
    // arithmetic (the same checks as `MultiHeadAttention::new`).
    cfg.validate()?;
    let (d, hd) = (cfg.d_model, cfg.head_dim);
    let (h, hkv) = (cfg.num_heads, cfg.num_kv_heads);
    let mut out = HashMap::new();
    let mut put = |name: &str, w: Tensor, b: Option<Tensor>| -> Result<()> {
        out.insert(format!("{name}.weight"), w.contiguous()?);
        if let Some(b) = b {
            out.insert(format!("{name}.bias"), b.contiguous()?);
        }
        Ok(())
    };
    let bias = |name: &str, len: usize, on: bool| -> Result<Option<Tensor>> {
        Ok(match on {
            true => Some(vb.pp(name).get(len, "bias")?),
            false => None,
        })
    };
    let q_rows = size("num_heads × head_dim", h.checked_mul(hd))?;
    let kv_rows = size("num_kv_heads × head_dim", hkv.checked_mul(hd))?;
    let rows = [q_rows, kv_rows, kv_rows];
    let fused_rows = size(
        "(num_heads + 2·num_kv_heads) × head_dim",
        q_rows
            .checked_add(kv_rows)
            .and_then(|n| n.checked_add(kv_rows)),
    )?;
    match layout.qkv {
        QkvLayout::Latent => {
            let Some(latent) = &cfg.latent else {
                return Err(Error::config(
                    "latent",
                    "None",
                    "a latent attention configuration for DeepSeek's weights",
                ));
            };
            let nope = size(
                "head_dim − latent.rope_dim",
                hd.checked_sub(latent.rope_dim),
            )?;
            match latent.q_lora_rank {
                None => put("q_proj", vb.pp("q_proj").get((q_rows, d), "weight")?, None)?,
                Some(r) => {
                    let a = vb.pp("q_a_proj").get((r, d), "weight")?;
                    put("q_a_proj", a, bias("q_a_proj", r, cfg.bias)?)?;
                    put(
                        "q_a_layernorm",
                        vb.pp("q_a_layernorm").get(r, "weight")?,
                        None,
                    )?;
                    put(
                        "q_b_proj",
                        vb.pp("q_b_proj").get((q_rows, r), "weight")?,
                        None,
                    )?;
                }
            }
            let (r, rope) = (latent.kv_lora_rank, latent.rope_dim);
            let kv_a = size("latent.kv_lora_rank + latent.rope_dim", r.checked_add(rope))?;
            let a = vb.pp("kv_a_proj_with_mqa").get((kv_a, d), "weight")?;
            put(
                "kv_a_proj_with_mqa",
                a,
                bias("kv_a_proj_with_mqa", kv_a, cfg.bias)?,
            )?;
            put(
                "kv_a_layernorm",
                vb.pp("kv_a_layernorm").get(r, "weight")?,
                None,
            )?;
            let rows = size(
                "num_heads × (head_dim − rope_dim + v_head_dim)",
                nope.checked_add(latent.v_head_dim)
                    .and_then(|n| n.checked_mul(h)),
            )?;
            put(
                "kv_b_proj",
                vb.pp("kv_b_proj").get((rows, r), "weight")?,
                None,
            )?;
        }
        QkvLayout::Separate(names) => {
            for ((ours, theirs), n) in ["q_proj", "k_proj", "v_proj"].iter().zip(names).zip(rows) {
                if *ours == "v_proj" && cfg.k_eq_v {
                    continue; // the values are the key projection
                }
                let w = vb.pp(theirs).get((n, d), "weight")?;
                put(ours, w, bias(theirs, n, cfg.bias)?)?;
            }
        }
        QkvLayout::Stacked(name) | QkvLayout::Conv1D(name) => {
            let w = match layout.qkv {
                QkvLayout::Conv1D(_) => vb.pp(name).get((d, fused_rows), "weight")?.t()?,
                _ => vb.pp(name).get((fused_rows, d), "weight")?,
            };
            let b = bias(name, fused_rows, cfg.bias)?;
            let mut start = 0;
            for (ours, n) in ["q_proj", "k_proj", "v_proj"].iter().zip(rows) {
                let part = |t: &Tensor| t.narrow(0, start, n);
                put(ours, part(&w)?, b.as_ref().map(part).transpose()?)?;
                start += n;
            }
        }
        QkvLayout::PerHead(name) => {
            // Only multi-head attention is stored this way (H = Hkv).
            let w = vb
                .pp(name)
                .get((fused_rows, d), "weight")?
                .reshape((h, 3, hd, d))?;
            let b = bias(name, fused_rows, cfg.bias)?
                .map(|b| b.reshape((h, 3, hd)))
                .transpose()?;
            for (i, ours) in ["q_proj", "k_proj", "v_proj"].iter().enumerate() {
                let w = w.narrow(1, i, 1)?.reshape((q_rows, d))?;
                let b = b
                    .as_ref()
                    .map(|b| b.narrow(1, i, 1)?.reshape(q_rows))
                    .transpose()?;
                put(ours, w, b)?;
            }
        }
        QkvLayout::Grouped(name) => {
            // validate: hkv ≥ 1 divides h. A group's rows: its queries, then its k and v.
            let g = h / hkv;
            let group = size("num_heads / num_kv_heads + 2", g.checked_add(2))?;
            let w = vb
                .pp(name)
                .get((fused_rows, d), "weight")?
                .reshape((hkv, group, hd, d))?;
            let b = bias(name, fused_rows, cfg.bias)?
                .map(|b| b.reshape((hkv, group, hd)))
                .transpose()?;
            for (ours, start, count) in [("q_proj", 0, g), ("k_proj", g, 1), ("v_proj", g + 1, 1)] {
                let n = kv_rows * count;
                let w = w.narrow(1, start, count)?.reshape((n, d))?;
                let b = b
                    .as_ref()
                    .map(|b| b.narrow(1, start, count)?.reshape(n))
                    .transpose()?;
                put(ours, w, b)?;
            }
        }
    }
    let values = cfg.latent.map_or(hd, |l| l.v_head_dim);
    let o_cols = size("num_heads × value width", h.checked_mul(values))?;
    let o = match layout.out_conv1d {
        true => vb.pp(layout.out).get((o_cols, d), "weight")?.t()?,
        false => vb.pp(layout.out).get((d, o_cols), "weight")?,
    };
    put("o_proj", o, bias(layout.out, d, cfg.out_bias)?)?;
    if let Some(norm) = cfg.qk_norm.as_ref().filter(|n| n.learned_scale) {
        use crate::attention::QkNormScope;
        for (name, heads) in [("q_norm", h), ("k_norm", hkv)] {
            let width = match norm.scope {
                QkNormScope::PerHead => hd,
                QkNormScope::AllHeads => size("heads × head_dim", heads.checked_mul(hd))?,
            };
            out.insert(format!("{name}.weight"), vb.pp(name).get(width, "weight")?);
        }
    }
    if cfg.sinks {
        out.insert("sinks".to_string(), vb.get(h, "sinks")?);
    }
    if let Some(shape) = relative_bias {
        out.insert(
            "relative_attention_bias.weight".to_string(),
            vb.pp("relative_attention_bias").get(shape, "weight")?,
        );
    }
    Ok(out)
}
