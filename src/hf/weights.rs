//! HF's attention weight names and layouts, mapped once at load onto the block's own
//! (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `q_norm`, `k_norm`, `sinks`,
//! `relative_attention_bias`).
//!
//! Fused projections are split and Conv1D weights transposed here, never per forward:
//!
//! | layout | rows of the fused weight (each row `d_model` wide) |
//! |---|---|
//! | stacked (Phi-3 `qkv_proj`, Falcon multi-query, the Qwen-VL vision encoders' `qkv`) | `[q (H·D); k (Hkv·D); v (Hkv·D)]` |
//! | per head (GPT-NeoX, BLOOM, Falcon without multi-query) | `(H, 3, D)`: each head's q, k, v |
//! | grouped (Falcon's new decoder architecture) | `(Hkv, H/Hkv + 2, D)`: a group's queries, then its k and v |
//! | sharded (CodeGen `qkv_proj`) | `(S, 3, w)`: shard `s` holds rows `s·w ..` of q, then of v, then of k |
//! | Conv1D (GPT-2 `c_attn`) | stored transposed, `(d_model, 3·H·D)`, columns `[q | k | v]` |

use std::collections::HashMap;

use candle_core::Tensor;
use candle_nn::VarBuilder;

use crate::attention::AttentionConfig;
use crate::error::{check_float, Error, Result};

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
    /// One projection in shards of this many rows each of q, v and k: rows `(S, 3, w)`, in
    /// that order (CodeGen, `hf::codegen`).
    Sharded(&'static str, usize),
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

/// A tensor HF and the crate name alike (T5's table, Inkling's relative logits and short
/// convolutions), read as it is: its name under the layer's prefix and its shape.
pub(super) type Shared = (&'static str, Vec<usize>);

/// Reads the HF tensors of one attention layer from `vb` (shape-checked, so errors name the
/// HF tensor) and returns them under the block's names, split and transposed, with the
/// `shared` tensors as they are.
pub(super) fn remap(
    layout: &WeightLayout,
    cfg: &AttentionConfig,
    shared: &[Shared],
    vb: &VarBuilder,
) -> Result<HashMap<String, Tensor>> {
    // The fields are public and may have changed since parsing: check them before any
    // arithmetic (the same checks as `MultiHeadAttention::new`).
    cfg.validate()?;
    let mut layer = Layer::new(cfg, vb)?;
    match layout.qkv {
        QkvLayout::Latent => layer.latent()?,
        QkvLayout::Separate(names) => layer.separate(names)?,
        QkvLayout::Stacked(name) => layer.stacked(name, false)?,
        QkvLayout::Conv1D(name) => layer.stacked(name, true)?,
        QkvLayout::PerHead(name) => layer.per_head(name)?,
        QkvLayout::Grouped(name) => layer.grouped(name)?,
        QkvLayout::Sharded(name, rows) => layer.sharded(name, rows)?,
    }
    layer.output(layout)?;
    layer.norms_and_sinks()?;
    for (name, shape) in shared {
        let (prefix, last) = name.rsplit_once('.').unwrap_or(("", name));
        let held = match prefix {
            "" => vb.get(shape.as_slice(), last)?,
            _ => vb.pp(prefix).get(shape.as_slice(), last)?,
        };
        layer.out.insert(name.to_string(), held);
    }
    // The one dtype rule of what a builder hands back (a `VarMap` hands back a variable in its
    // own dtype, which the block's builder over these tensors would convert silently).
    for t in layer.out.values() {
        check_float("HF layer tensor held by the VarBuilder", t.dtype())?;
    }
    Ok(layer.out)
}

/// One layer's tensors being read: the sizes, the source and what is read so far.
struct Layer<'a> {
    cfg: &'a AttentionConfig,
    vb: &'a VarBuilder<'a>,
    /// Rows of q, and of k and of v.
    q_rows: usize,
    kv_rows: usize,
    /// Rows of a fused q, k, v projection.
    fused_rows: usize,
    out: HashMap<String, Tensor>,
}

impl<'a> Layer<'a> {
    fn new(cfg: &'a AttentionConfig, vb: &'a VarBuilder<'a>) -> Result<Self> {
        let hd = cfg.head_dim;
        let q_rows = size("num_heads × head_dim", cfg.num_heads.checked_mul(hd))?;
        let kv_rows = size("num_kv_heads × head_dim", cfg.num_kv_heads.checked_mul(hd))?;
        let fused_rows = size(
            "(num_heads + 2·num_kv_heads) × head_dim",
            q_rows
                .checked_add(kv_rows)
                .and_then(|n| n.checked_add(kv_rows)),
        )?;
        Ok(Self {
            cfg,
            vb,
            q_rows,
            kv_rows,
            fused_rows,
            out: HashMap::new(),
        })
    }

    /// Keeps `w` (and `b`) under the block's name `name`.
    fn put(&mut self, name: &str, w: Tensor, b: Option<Tensor>) -> Result<()> {
        self.out.insert(format!("{name}.weight"), w.contiguous()?);
        if let Some(b) = b {
            self.out.insert(format!("{name}.bias"), b.contiguous()?);
        }
        Ok(())
    }

    /// HF's `name.weight` of `shape`.
    fn weight<S: Into<candle_core::Shape>>(&self, name: &str, shape: S) -> Result<Tensor> {
        Ok(self.vb.pp(name).get(shape, "weight")?)
    }

    /// HF's `name.bias` of `len`, where the layer has biases (`on`).
    fn bias(&self, name: &str, len: usize, on: bool) -> Result<Option<Tensor>> {
        Ok(match on {
            true => Some(self.vb.pp(name).get(len, "bias")?),
            false => None,
        })
    }

    /// Multi-head latent attention's projections and norms, kept under their names.
    fn latent(&mut self) -> Result<()> {
        let Some(latent) = self.cfg.latent else {
            return Err(Error::config(
                "latent",
                "None",
                "a latent attention configuration for DeepSeek's weights",
            ));
        };
        let (d, h, bias) = (self.cfg.d_model, self.cfg.num_heads, self.cfg.bias);
        let nope = size(
            "head_dim − latent.rope_dim",
            self.cfg.head_dim.checked_sub(latent.rope_dim),
        )?;
        match latent.q_lora_rank {
            None => self.put("q_proj", self.weight("q_proj", (self.q_rows, d))?, None)?,
            Some(r) => {
                let a = self.weight("q_a_proj", (r, d))?;
                self.put("q_a_proj", a, self.bias("q_a_proj", r, bias)?)?;
                self.put("q_a_layernorm", self.weight("q_a_layernorm", r)?, None)?;
                let b = self.weight("q_b_proj", (self.q_rows, r))?;
                self.put("q_b_proj", b, None)?;
            }
        }
        let (r, rope) = (latent.kv_lora_rank, latent.rope_dim);
        let kv_a = size("latent.kv_lora_rank + latent.rope_dim", r.checked_add(rope))?;
        let a = self.weight("kv_a_proj_with_mqa", (kv_a, d))?;
        let a_bias = self.bias("kv_a_proj_with_mqa", kv_a, bias)?;
        self.put("kv_a_proj_with_mqa", a, a_bias)?;
        self.put("kv_a_layernorm", self.weight("kv_a_layernorm", r)?, None)?;
        let rows = size(
            "num_heads × (head_dim − rope_dim + v_head_dim)",
            nope.checked_add(latent.v_head_dim)
                .and_then(|n| n.checked_mul(h)),
        )?;
        self.put("kv_b_proj", self.weight("kv_b_proj", (rows, r))?, None)
    }

    /// Three projections under HF's `names`.
    fn separate(&mut self, names: [&str; 3]) -> Result<()> {
        let rows = [self.q_rows, self.kv_rows, self.kv_rows];
        for ((ours, theirs), n) in ["q_proj", "k_proj", "v_proj"].iter().zip(names).zip(rows) {
            if *ours == "v_proj" && self.cfg.k_eq_v {
                continue; // the values are the key projection
            }
            let w = self.weight(theirs, (n, self.cfg.d_model))?;
            let b = self.bias(theirs, n, self.cfg.bias)?;
            self.put(ours, w, b)?;
        }
        Ok(())
    }

    /// One projection, rows `[q; k; v]` (a Conv1D's stored transposed).
    fn stacked(&mut self, name: &str, conv1d: bool) -> Result<()> {
        let (d, n) = (self.cfg.d_model, self.fused_rows);
        let w = match conv1d {
            true => self.weight(name, (d, n))?.t()?,
            false => self.weight(name, (n, d))?,
        };
        let b = self.bias(name, n, self.cfg.bias)?;
        let mut start = 0;
        let rows = [self.q_rows, self.kv_rows, self.kv_rows];
        for (ours, n) in ["q_proj", "k_proj", "v_proj"].iter().zip(rows) {
            let part = |t: &Tensor| t.narrow(0, start, n);
            self.put(ours, part(&w)?, b.as_ref().map(part).transpose()?)?;
            start += n;
        }
        Ok(())
    }

    /// One projection, rows `(H, 3, D)`: only multi-head attention is stored this way
    /// (H = Hkv).
    fn per_head(&mut self, name: &str) -> Result<()> {
        let (d, h, hd) = (self.cfg.d_model, self.cfg.num_heads, self.cfg.head_dim);
        let w = self
            .weight(name, (self.fused_rows, d))?
            .reshape((h, 3, hd, d))?;
        let b = self
            .bias(name, self.fused_rows, self.cfg.bias)?
            .map(|b| b.reshape((h, 3, hd)))
            .transpose()?;
        for (i, ours) in ["q_proj", "k_proj", "v_proj"].iter().enumerate() {
            let w = w.narrow(1, i, 1)?.reshape((self.q_rows, d))?;
            let b = b
                .as_ref()
                .map(|b| b.narrow(1, i, 1)?.reshape(self.q_rows))
                .transpose()?;
            self.put(ours, w, b)?;
        }
        Ok(())
    }

    /// One projection, rows `(Hkv, H/Hkv + 2, D)`: a group's queries, then its k and v.
    fn grouped(&mut self, name: &str) -> Result<()> {
        let (d, hd) = (self.cfg.d_model, self.cfg.head_dim);
        // validate: hkv ≥ 1 divides h.
        let hkv = self.cfg.num_kv_heads;
        let g = self.cfg.num_heads / hkv;
        let group = size("num_heads / num_kv_heads + 2", g.checked_add(2))?;
        let w = self
            .weight(name, (self.fused_rows, d))?
            .reshape((hkv, group, hd, d))?;
        let b = self
            .bias(name, self.fused_rows, self.cfg.bias)?
            .map(|b| b.reshape((hkv, group, hd)))
            .transpose()?;
        for (ours, start, count) in [("q_proj", 0, g), ("k_proj", g, 1), ("v_proj", g + 1, 1)] {
            let n = self.kv_rows * count;
            let w = w.narrow(1, start, count)?.reshape((n, d))?;
            let b = b
                .as_ref()
                .map(|b| b.narrow(1, start, count)?.reshape(n))
                .transpose()?;
            self.put(ours, w, b)?;
        }
        Ok(())
    }

    /// One projection in shards of `w` rows each of q, v and k (only multi-head attention is
    /// stored this way).
    fn sharded(&mut self, name: &str, w: usize) -> Result<()> {
        let (d, n) = (self.cfg.d_model, self.q_rows);
        if self.kv_rows != n || w == 0 || !n.is_multiple_of(w) {
            return Err(Error::config(
                "num_kv_heads",
                self.cfg.num_kv_heads,
                "as many key/value heads as heads, whose rows shards of the fused weight divide",
            ));
        }
        let shards = n / w;
        let weight = self
            .weight(name, (self.fused_rows, d))?
            .reshape((shards, 3, w, d))?;
        let bias = self
            .bias(name, self.fused_rows, self.cfg.bias)?
            .map(|b| b.reshape((shards, 3, w)))
            .transpose()?;
        for (ours, i) in [("q_proj", 0), ("v_proj", 1), ("k_proj", 2)] {
            let w = weight.narrow(1, i, 1)?.reshape((n, d))?;
            let b = bias
                .as_ref()
                .map(|b| b.narrow(1, i, 1)?.reshape(n))
                .transpose()?;
            self.put(ours, w, b)?;
        }
        Ok(())
    }

    /// The output projection (a Conv1D's stored transposed).
    fn output(&mut self, layout: &WeightLayout) -> Result<()> {
        let cfg = self.cfg;
        let values = cfg.latent.map_or(cfg.head_dim, |l| l.v_head_dim);
        let o_cols = size("num_heads × value width", cfg.num_heads.checked_mul(values))?;
        let o = match layout.out_conv1d {
            true => self.weight(layout.out, (o_cols, cfg.d_model))?.t()?,
            false => self.weight(layout.out, (cfg.d_model, o_cols))?,
        };
        let b = self.bias(layout.out, cfg.d_model, cfg.out_bias)?;
        self.put("o_proj", o, b)
    }

    /// The learned q/k norm scales and the sink logits, where the layer has them.
    fn norms_and_sinks(&mut self) -> Result<()> {
        let cfg = self.cfg;
        let (h, hkv, hd) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        if let Some(norm) = cfg.qk_norm.as_ref().filter(|n| n.learned_scale) {
            for (name, heads) in [("q_norm", h), ("k_norm", hkv)] {
                size("heads × head_dim", heads.checked_mul(hd))?;
                let w = self.weight(name, norm.scope.scale_shape(heads, hd))?;
                self.out.insert(format!("{name}.weight"), w);
            }
        }
        if cfg.sinks {
            self.out
                .insert("sinks".to_string(), self.vb.get(h, "sinks")?);
        }
        Ok(())
    }
}
