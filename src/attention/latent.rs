//! Multi-head latent attention's projections (DeepSeek V2/V3): queries and keys from low-rank
//! latents, RoPE on a decoupled slice of each head.
//!
//! ```text
//! q = W_qb · rms(W_qa x)                 (or W_q x without a query rank)     per head [q_nope ‖ q_rope]
//! [c ‖ k_rope] = W_kva x                 c the kv_lora_rank latent, k_rope one head of rope_dim
//! [k_nope ‖ v] = W_kvb · rms(c)          per head: nope_dim + v_head_dim
//! q_h = [q_rope ‖ q_nope],  k_h = [k_rope ‖ k_nope],  v_h = [v ‖ 0]       head_dim = rope + nope
//! ```
//!
//! The block rotates the first `rope_dim` features of each head (partial RoPE, interleaved
//! pairs for DeepSeek), so each head is laid out rope part first: `q·k` is a sum over features,
//! the same in either order. Every head shares the one rotated key slice. The values are padded
//! with zeros to the head width, so the attention core runs unchanged, and the padding is cut
//! from its output before `o_proj` (`num_heads · v_head_dim` inputs). The two RMS norms run in
//! f32 with ε = 1e-6 by default (HF's DeepSeek code does not pass `rms_norm_eps` to them).
//!
//! # Shapes
//! - `q_a_proj`: `(q_lora_rank, d_model)`, `q_a_layernorm`: `(q_lora_rank)`, `q_b_proj`:
//!   `(H · head_dim, q_lora_rank)`; or `q_proj`: `(H · head_dim, d_model)`;
//! - `kv_a_proj_with_mqa`: `(kv_lora_rank + rope_dim, d_model)`, `kv_a_layernorm`:
//!   `(kv_lora_rank)`, `kv_b_proj`: `(H · (nope_dim + v_head_dim), kv_lora_rank)`;
//! - `o_proj`: `(d_model, H · v_head_dim)`.
//!
//! Reference: DeepSeek-AI 2024, "DeepSeek-V2: A Strong, Economical, and Efficient
//! Mixture-of-Experts Language Model" (multi-head latent attention, decoupled RoPE).

use candle_core::{DType, Tensor};
use candle_nn::{linear_b, linear_no_bias, Init, Linear, VarBuilder};
use serde::{Deserialize, Serialize};

use super::projection::{linear, parts};
use super::qk_norm::rms_normalized;
use crate::error::{check_normal_f32, learned, Error, Result};
use crate::limits::check_elements;

/// Settings of [`AttentionConfig::latent`](super::AttentionConfig::latent): the ranks and head
/// widths of multi-head latent attention. The block's `head_dim` is `rope_dim + nope_dim` (the
/// query/key width), its KV heads equal its heads.
///
/// Serialised (serde) as `{"q_lora_rank": 1536, "kv_lora_rank": 512, "rope_dim": 64,
/// "v_head_dim": 128, "norm_eps": 1e-6}` (`q_lora_rank` null for a direct query projection;
/// `norm_eps` may be left out).
///
/// # Example
/// A DeepSeek-shaped block, 4 heads of 8 query/key features (2 rotate) and 6 value features:
/// ```
/// use candle_core::{DType, Device, Module, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use candle_posenc::attention::{AttentionConfig, LatentConfig, MultiHeadAttention};
///
/// let dev = Device::Cpu;
/// let varmap = VarMap::new();
/// let cfg = AttentionConfig::new(32, 4)
///     .with_head_dim(8)
///     .with_causal(true)
///     .with_latent(Some(LatentConfig::new(Some(12), 10, 2, 6)));
/// let attn = MultiHeadAttention::new(&cfg, None, VarBuilder::from_varmap(&varmap, DType::F32, &dev))?;
/// assert!(varmap.data().lock().unwrap().contains_key("kv_b_proj.weight"));
/// let x = Tensor::randn(0f32, 1.0, (1, 5, 32), &dev)?;
/// assert_eq!(attn.forward(&x)?.dims(), &[1, 5, 32]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LatentConfig {
    /// Rank of the query latent (`None`: one projection `q_proj`, as DeepSeek-V2-Lite).
    pub q_lora_rank: Option<usize>,
    /// Rank of the key/value latent `c`.
    pub kv_lora_rank: usize,
    /// Features per head that rotate (`qk_rope_head_dim`), the first of each head.
    pub rope_dim: usize,
    /// Features per value head (`v_head_dim`), at most the query/key head width.
    pub v_head_dim: usize,
    /// ε of the two RMS norms (default 1e-6).
    #[serde(default = "LatentConfig::default_eps")]
    pub norm_eps: f64,
}

impl LatentConfig {
    /// Latent attention with these ranks and widths, ε = 1e-6.
    pub fn new(
        q_lora_rank: Option<usize>,
        kv_lora_rank: usize,
        rope_dim: usize,
        v_head_dim: usize,
    ) -> Self {
        Self {
            q_lora_rank,
            kv_lora_rank,
            rope_dim,
            v_head_dim,
            norm_eps: Self::default_eps(),
        }
    }

    fn default_eps() -> f64 {
        1e-6
    }

    /// Sets ε of the two RMS norms.
    pub fn with_norm_eps(mut self, eps: f64) -> Self {
        self.norm_eps = eps;
        self
    }

    /// Checks the settings against a block of `heads` heads `head_dim` wide over `d_model`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a rank or width of 0, a `rope_dim` that is odd or not below
    /// `head_dim`, a `v_head_dim` past `head_dim`, an ε that is not a normal f32, or weights past
    /// [`crate::limits::max_elements`].
    pub fn validate(&self, d_model: usize, heads: usize, head_dim: usize) -> Result<()> {
        for (name, n) in [
            ("latent.kv_lora_rank", self.kv_lora_rank),
            ("latent.v_head_dim", self.v_head_dim),
            ("latent.rope_dim", self.rope_dim),
        ] {
            if n == 0 {
                return Err(Error::config(name, 0, "at least 1"));
            }
        }
        if self.q_lora_rank == Some(0) {
            return Err(Error::config(
                "latent.q_lora_rank",
                0,
                "at least 1, or None (a direct query projection)",
            ));
        }
        if !self.rope_dim.is_multiple_of(2) || self.rope_dim >= head_dim {
            return Err(Error::config(
                "latent.rope_dim",
                self.rope_dim,
                format!("an even number below head_dim ({head_dim}), which is rope_dim + nope_dim"),
            ));
        }
        if self.v_head_dim > head_dim {
            return Err(Error::config(
                "latent.v_head_dim",
                self.v_head_dim,
                format!("at most head_dim ({head_dim}), the query/key width"),
            ));
        }
        check_normal_f32("latent.norm_eps", self.norm_eps)?;
        let nope = head_dim - self.rope_dim;
        let rank = self.q_lora_rank.unwrap_or(d_model);
        for (what, dims) in [
            (
                "the query projections",
                [heads, head_dim, rank.max(d_model)],
            ),
            (
                "kv_b_proj",
                [heads, nope + self.v_head_dim, self.kv_lora_rank],
            ),
            (
                "kv_a_proj_with_mqa",
                [1, self.kv_lora_rank.saturating_add(self.rope_dim), d_model],
            ),
        ] {
            check_elements("latent", format_args!("{self:?}"), what, &dims)?;
        }
        Ok(())
    }
}

/// The query side: one projection or a low-rank pair around an RMS norm.
#[derive(Debug, Clone)]
enum Query {
    Direct(Linear),
    LowRank { a: Linear, norm: Tensor, b: Linear },
}

/// The loaded projections of latent attention (see the module's formula).
#[derive(Debug, Clone)]
pub(super) struct LatentProjections {
    config: LatentConfig,
    heads: usize,
    head_dim: usize,
    query: Query,
    kv_a: Linear,
    kv_norm: Tensor,
    kv_b: Linear,
}

impl LatentProjections {
    /// Loads the projections under HF DeepSeek's names from `vb`; `bias` gives `q_a_proj` and
    /// `kv_a_proj_with_mqa` biases (HF's `attention_bias`), the others have none.
    pub(super) fn new(
        config: &LatentConfig,
        (d_model, heads, head_dim): (usize, usize, usize),
        bias: bool,
        vb: &VarBuilder,
    ) -> Result<Self> {
        config.validate(d_model, heads, head_dim)?;
        let norm = |name: &str, n: usize| -> Result<Tensor> {
            learned(
                &vb.pp(name),
                "latent norm scale",
                n,
                "weight",
                Init::Const(1.0),
            )
        };
        let query = match config.q_lora_rank {
            None => Query::Direct(linear_no_bias(d_model, heads * head_dim, vb.pp("q_proj"))?),
            Some(rank) => Query::LowRank {
                a: linear_b(d_model, rank, bias, vb.pp("q_a_proj"))?,
                norm: norm("q_a_layernorm", rank)?,
                b: linear_no_bias(rank, heads * head_dim, vb.pp("q_b_proj"))?,
            },
        };
        let nope = head_dim - config.rope_dim;
        Ok(Self {
            config: *config,
            heads,
            head_dim,
            query,
            kv_a: linear_b(
                d_model,
                config.kv_lora_rank + config.rope_dim,
                bias,
                vb.pp("kv_a_proj_with_mqa"),
            )?,
            kv_norm: norm("kv_a_layernorm", config.kv_lora_rank)?,
            kv_b: linear_no_bias(
                config.kv_lora_rank,
                heads * (nope + config.v_head_dim),
                vb.pp("kv_b_proj"),
            )?,
        })
    }

    /// The widest per-token tensor a call builds: the query's low-rank activations, the
    /// compressed keys and values, their expansion to every head, or the heads' queries.
    pub(super) fn widest_per_token(&self) -> usize {
        let c = &self.config;
        let nope = self.head_dim - c.rope_dim;
        [
            c.q_lora_rank.unwrap_or(0),
            c.kv_lora_rank.saturating_add(c.rope_dim),
            self.heads.saturating_mul(nope.saturating_add(c.v_head_dim)),
            self.heads.saturating_mul(self.head_dim),
        ]
        .into_iter()
        .max()
        .unwrap_or(0)
    }

    /// Every tensor the projections hold: weights, biases and norm scales.
    pub(super) fn held(&self) -> Vec<&Tensor> {
        let mut held: Vec<&Tensor> = match &self.query {
            Query::Direct(q) => parts(q).collect(),
            Query::LowRank { a, norm, b } => parts(a).chain([norm]).chain(parts(b)).collect(),
        };
        held.extend(
            parts(&self.kv_a)
                .chain([&self.kv_norm])
                .chain(parts(&self.kv_b)),
        );
        held
    }

    /// `x` RMS-normalised over its last axis in f32 and scaled by `weight`, in `x`'s dtype.
    fn rms(&self, x: &Tensor, weight: &Tensor) -> Result<Tensor> {
        Ok(
            rms_normalized(&x.to_dtype(DType::F32)?, self.config.norm_eps)?
                .to_dtype(x.dtype())?
                .broadcast_mul(weight)?,
        )
    }

    /// q and k `(B, H, T, head_dim)`, rope features first, and v `(B, H, T, head_dim)`, its
    /// last `head_dim − v_head_dim` features 0.
    pub(super) fn project(&self, x: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, t, _) = x.dims3()?;
        let (h, d, rope) = (self.heads, self.head_dim, self.config.rope_dim);
        let (nope, dv) = (d - rope, self.config.v_head_dim);
        let q = match &self.query {
            Query::Direct(q) => linear(q, x)?,
            Query::LowRank { a, norm, b } => linear(b, &self.rms(&linear(a, x)?, norm)?)?,
        };
        // HF's head layout is [nope ‖ rope]; the block's is [rope ‖ nope].
        let q = q.reshape((b, t, h, d))?;
        let q = Tensor::cat(&[q.narrow(3, nope, rope)?, q.narrow(3, 0, nope)?], 3)?;
        let kv = linear(&self.kv_a, x)?;
        let latent = kv.narrow(2, 0, self.config.kv_lora_rank)?;
        let k_rope = kv
            .narrow(2, self.config.kv_lora_rank, rope)?
            .reshape((b, t, 1, rope))?
            .broadcast_as((b, t, h, rope))?;
        let kv = linear(&self.kv_b, &self.rms(&latent, &self.kv_norm)?)?.reshape((
            b,
            t,
            h,
            nope + dv,
        ))?;
        let k = Tensor::cat(&[&k_rope, &kv.narrow(3, 0, nope)?], 3)?;
        let v = kv.narrow(3, nope, dv)?;
        let v = match d - dv {
            0 => v,
            pad => Tensor::cat(
                &[&v, &Tensor::zeros((b, t, h, pad), v.dtype(), v.device())?],
                3,
            )?,
        };
        let heads = |y: Tensor| -> Result<Tensor> { Ok(y.transpose(1, 2)?.contiguous()?) };
        Ok((heads(q)?, heads(k)?, heads(v)?))
    }

    /// The value features of the attention output `(B, T, H, head_dim)`: `(B, T, H · v_head_dim)`.
    pub(super) fn values_of(&self, out: &Tensor) -> Result<Tensor> {
        let (b, t, h, _) = out.dims4()?;
        Ok(out
            .narrow(3, 0, self.config.v_head_dim)?
            .reshape((b, t, h * self.config.v_head_dim))?)
    }
}
