//! [`RotaryEmbedding`]: the module, its configuration and its cached cos/sin tables.

use std::sync::{Arc, RwLock};

use candle_core::{DType, Device, Module, Tensor};
use serde::{Deserialize, Serialize};

use super::inplace::RotateInPlace;
use super::kernels::{rotate_fused, rotate_ops};
use super::mrope::{AxialRope, MropeSection};
use super::scaling::{Regime, RopeFrequencies, RopeScaling};
use crate::absolute::gather_rows;
use crate::error::{Error, Result};
use crate::plug::{shares_storage, AttentionContext, PositionalEncoding};
use crate::positions::{PositionIds, Positions};

/// Largest number of cos (or sin) table entries ever built (`positions × rotary_dim / 2`): half
/// of the crate's one budget, so that cos and sin together stay within it.
fn max_table_elements() -> usize {
    crate::limits::max_elements() / 2
}

/// Which features form the rotated pairs.
///
/// The two layouts are the same rotation of a permuted head, so a checkpoint's q and k
/// projections decide which one a model needs. llama.cpp rotates [`Self::Interleaved`] pairs,
/// and its converter reorders each head's rows of HF's `q_proj` and `k_proj` to match (HF's
/// row `i` becomes row `2i`, row `i + d/2` row `2i + 1`): a Llama read from GGUF is rotated
/// with [`Self::Half`] once those rows are put back (the default of
/// [`GgufFile::tensors`](crate::hf::gguf::GgufFile::tensors)), or with [`Self::Interleaved`]
/// on the rows as stored ([`QkRows`](crate::hf::gguf::QkRows)). The other pairing runs
/// without error and gives fluent-looking text that is not the model's.
///
/// Serialised in snake case: `"half"`, `"interleaved"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RopeLayout {
    /// Feature `i` pairs with `i + d/2` ("rotate half"): GPT-NeoX, HF Llama, the seeds.
    #[default]
    Half,
    /// Feature `2i` pairs with `2i + 1`: GPT-J, RoFormer, the paper.
    Interleaved,
}

/// The axis order of the queries and keys handed to the rotation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QkLayout {
    /// `(batch, heads, seq_len, head_dim)`, the attention block's order.
    #[default]
    Bhtd,
    /// `(batch, seq_len, heads, head_dim)`, straight out of a projection.
    Bthd,
}

/// How the rotation is computed.
///
/// Serialised in snake case: `"fused"`, `"ops"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RopeKernel {
    /// candle-nn's fused kernels, with a backward pass added by this crate.
    #[default]
    Fused,
    /// Plain tensor ops (`x·cos + rotate_half(x)·sin`), differentiable by candle's autograd.
    Ops,
}

/// Configuration of [`RotaryEmbedding`].
///
/// Serialised (serde) with its field names, e.g. as JSON
/// `{"head_dim": 64, "rotary_dim": 64, "base": 10000.0, "layout": "half",
/// "scaling": {"rope_type": "default"}, "max_position": 2048, "kernel": "fused"}`
/// (`xpos_scale_base` only when set). Only `head_dim` is required; the other fields default as
/// in [`RopeConfig::new`] (`rotary_dim` to `head_dim`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "RopeConfigFields")]
pub struct RopeConfig {
    /// Size of each attention head; must be even.
    pub head_dim: usize,
    /// Leading features of each head that rotate (partial rotary); the rest pass through.
    /// Even, at most `head_dim`; defaults to `head_dim`.
    pub rotary_dim: usize,
    /// Frequency base θ (default 10000).
    pub base: f64,
    /// Pair layout (default [`RopeLayout::Half`]).
    pub layout: RopeLayout,
    /// Frequency scaling (default none).
    pub scaling: RopeScaling,
    /// Positions precomputed at construction (default 2048); tables grow on demand past it.
    pub max_position: usize,
    /// xPos scale base γ (Sun et al. 2022), or `None` for plain RoPE.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub xpos_scale_base: Option<f64>,
    /// Fused kernels or tensor ops (default fused).
    pub kernel: RopeKernel,
    /// Multimodal RoPE: which frequency bands rotate by the temporal, height and width
    /// positions of [`PositionIds::multimodal`](crate::positions::PositionIds::multimodal)
    /// (Qwen2-VL, Qwen3-VL; default none). One position per token (an offset, or ids
    /// without axes) is that position on all three axes, as HF's Qwen-VL text models read
    /// `(B, T)` ids: it rotates as plain RoPE (text).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mrope: Option<MropeSection>,
    /// Axial 2-D RoPE over a patch grid (Pixtral, Qwen2-VL's vision encoder; default none):
    /// rows and columns from the height and width axes of multimodal positions, the only
    /// positions it takes (one position per token is refused with [`Error::Positions`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub axial: Option<AxialRope>,
}

/// The serialised form of [`RopeConfig`]: a field left out keeps its value from
/// [`RopeConfig::new`], which depends on `head_dim`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RopeConfigFields {
    head_dim: usize,
    #[serde(default, deserialize_with = "crate::checkpoint::non_null")]
    rotary_dim: Option<usize>,
    #[serde(default, deserialize_with = "crate::checkpoint::non_null")]
    base: Option<f64>,
    #[serde(default, deserialize_with = "crate::checkpoint::non_null")]
    layout: Option<RopeLayout>,
    #[serde(default, deserialize_with = "crate::checkpoint::non_null")]
    scaling: Option<RopeScaling>,
    #[serde(default, deserialize_with = "crate::checkpoint::non_null")]
    max_position: Option<usize>,
    #[serde(default, deserialize_with = "crate::checkpoint::non_null")]
    xpos_scale_base: Option<f64>,
    #[serde(default, deserialize_with = "crate::checkpoint::non_null")]
    kernel: Option<RopeKernel>,
    #[serde(default)]
    mrope: Option<MropeSection>,
    #[serde(default)]
    axial: Option<AxialRope>,
}

impl From<RopeConfigFields> for RopeConfig {
    fn from(f: RopeConfigFields) -> Self {
        let mut c = RopeConfig::new(f.head_dim);
        c.rotary_dim = f.rotary_dim.unwrap_or(c.rotary_dim);
        c.base = f.base.unwrap_or(c.base);
        c.layout = f.layout.unwrap_or(c.layout);
        c.scaling = f.scaling.unwrap_or(c.scaling);
        c.max_position = f.max_position.unwrap_or(c.max_position);
        c.xpos_scale_base = f.xpos_scale_base.or(c.xpos_scale_base);
        c.kernel = f.kernel.unwrap_or(c.kernel);
        c.mrope = f.mrope;
        c.axial = f.axial;
        c
    }
}

impl RopeConfig {
    /// Full rotation of `head_dim` features, base 10000, rotate-half pairs, no scaling.
    pub fn new(head_dim: usize) -> Self {
        Self {
            head_dim,
            rotary_dim: head_dim,
            base: 10_000.0,
            layout: RopeLayout::Half,
            scaling: RopeScaling::None,
            max_position: 2048,
            xpos_scale_base: None,
            kernel: RopeKernel::Fused,
            mrope: None,
            axial: None,
        }
    }

    /// Sets axial 2-D RoPE over a patch grid (`None`: plain RoPE).
    pub fn with_axial(mut self, axial: Option<AxialRope>) -> Self {
        self.axial = axial;
        self
    }

    /// Sets multimodal RoPE's frequency bands (`None`: plain RoPE).
    pub fn with_mrope(mut self, mrope: Option<MropeSection>) -> Self {
        self.mrope = mrope;
        self
    }

    /// Rotates only the first `rotary_dim` features of each head.
    pub fn with_rotary_dim(mut self, rotary_dim: usize) -> Self {
        self.rotary_dim = rotary_dim;
        self
    }

    /// HF's `partial_rotary_factor`: `rotary_dim = int(head_dim × factor)`.
    pub fn with_partial_rotary_factor(mut self, factor: f64) -> Self {
        self.rotary_dim = (self.head_dim as f64 * factor) as usize;
        self
    }

    /// Sets the base θ.
    pub fn with_base(mut self, base: f64) -> Self {
        self.base = base;
        self
    }

    /// Sets the pair layout.
    pub fn with_layout(mut self, layout: RopeLayout) -> Self {
        self.layout = layout;
        self
    }

    /// Sets the frequency scaling.
    pub fn with_scaling(mut self, scaling: RopeScaling) -> Self {
        self.scaling = scaling;
        self
    }

    /// Sets how many positions the tables hold at construction.
    pub fn with_max_position(mut self, max_position: usize) -> Self {
        self.max_position = max_position;
        self
    }

    /// Turns on xPos with scale base γ (512 in the paper): queries at position `n` are scaled by
    /// `ζ_i^(n/γ)`, keys by `ζ_i^(−n/γ)`, with `ζ_i = (2i/d + 0.4) / 1.4`.
    pub fn with_xpos(mut self, scale_base: f64) -> Self {
        self.xpos_scale_base = Some(scale_base);
        self
    }

    /// Chooses fused kernels or tensor ops.
    pub fn with_kernel(mut self, kernel: RopeKernel) -> Self {
        self.kernel = kernel;
        self
    }

    /// Checks every field.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an odd, zero or absurd (past [`crate::limits::max_elements`])
    /// `head_dim`, an odd, zero or too large
    /// `rotary_dim`, a non-positive or non-finite base or xPos scale base, or bad scaling
    /// parameters (see [`RopeScaling::validate`]).
    pub fn validate(&self) -> Result<()> {
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return Err(Error::config(
                "head_dim",
                self.head_dim,
                "an even number > 0",
            ));
        }
        if self.rotary_dim == 0 || !self.rotary_dim.is_multiple_of(2) {
            return Err(Error::config(
                "rotary_dim",
                self.rotary_dim,
                "an even number > 0",
            ));
        }
        crate::limits::check_elements("head_dim", self.head_dim, "a head width", &[self.head_dim])?;
        if self.rotary_dim > self.head_dim {
            return Err(Error::config(
                "rotary_dim",
                self.rotary_dim,
                format!("at most head_dim = {}", self.head_dim),
            ));
        }
        if !(self.base.is_finite() && self.base > 1.0) {
            return Err(Error::config("base", self.base, "a finite number > 1"));
        }
        if let Some(g) = self.xpos_scale_base {
            if !(g.is_finite() && g > 0.0) {
                return Err(Error::config("xpos_scale_base", g, "a finite number > 0"));
            }
        }
        if let Some(a) = &self.axial {
            if !self.rotary_dim.is_multiple_of(4) || self.mrope.is_some() {
                return Err(Error::config(
                    "axial",
                    format!("{a:?}"),
                    format!(
                        "a rotary_dim divisible by 4 (it is {}) and no mrope bands",
                        self.rotary_dim
                    ),
                ));
            }
            if self.scaling != RopeScaling::None || self.xpos_scale_base.is_some() {
                return Err(Error::config(
                    "axial",
                    format!("{a:?}"),
                    "plain frequencies: no scaling and no xPos",
                ));
            }
            if *a == AxialRope::SplitHalves && self.layout != RopeLayout::Half {
                return Err(Error::config(
                    "layout",
                    format!("{:?}", self.layout),
                    "Half with SplitHalves (each half of the head rotates as rotate-half)",
                ));
            }
        }
        if let Some(m) = &self.mrope {
            m.validate(self.rotary_dim / 2)?;
            if self.xpos_scale_base.is_some() {
                return Err(Error::config(
                    "mrope",
                    format!("{:?}", m.sections),
                    "None with xPos (its scale follows one position per token)",
                ));
            }
        }
        // The cos and sin tables built at construction, with the f64 frequencies behind them
        // (one more row of each, two f32 elements per f64).
        let rows = self.max_position.clamp(1, INITIAL_ROWS_CAP);
        check_table_stage(self, rows)?;
        self.scaling.validate(self.rotary_dim)?;
        // Every regime the tables can take must be finite (LongRoPE's long factors and
        // attention factor apply past the original length only).
        for seq_len in [0, usize::MAX] {
            self.scaling
                .frequencies(self.rotary_dim, self.base, seq_len)?;
        }
        Ok(())
    }
}

/// cos/sin tables for one regime, `(rows, rotary_dim / 2)` f32 on the module's device.
#[derive(Debug, Clone)]
struct Tables {
    regime: Regime,
    /// Queries' cos, sin (with the attention factor and the xPos scale `ζ^(n/γ)`).
    q: (Tensor, Tensor),
    /// Keys' cos, sin: the same tensors as `q` unless xPos is on (then scaled by `ζ^(−n/γ)`).
    k: (Tensor, Tensor),
    /// The attention factor every entry carries.
    factor: f64,
}

impl Tables {
    fn rows(&self) -> Result<usize> {
        Ok(self.q.0.dim(0)?)
    }
}

/// Rotary position embedding (Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary
/// Position Embedding"); with the HF scaling family and xPos.
///
/// Each pair `(x_a, x_b)` of the first `rotary_dim` features of a head at position `m` is
/// rotated by the angle `m·inv_freq[i]`:
///
/// ```text
/// x_a' = x_a cos(m θ_i) − x_b sin(m θ_i)
/// x_b' = x_a sin(m θ_i) + x_b cos(m θ_i)
/// ```
///
/// so `q_m · k_n` depends on `m − n` only. The pairs are `(i, i + d/2)` ([`RopeLayout::Half`])
/// or `(2i, 2i + 1)` ([`RopeLayout::Interleaved`]).
///
/// Angles are computed in `f64` from `f64` frequencies, cos/sin stored as `f32` tables, cached
/// and grown (doubling) on demand; bf16 and f16 inputs are rotated in f32 and rounded once.
///
/// # Shapes
/// - [`Module::forward`]: `x` `(B, H, T, D)` rotated at positions `0..T` (as a query).
/// - [`Self::rotate_queries_keys`]: `(B, H, T, D)` or `(B, T, H, D)` per [`QkLayout`].
///
/// # Example
/// ```
/// use candle_core::{Device, DType, Module, Tensor};
/// use candle_posenc::{RopeConfig, RotaryEmbedding};
///
/// let dev = Device::Cpu;
/// let rope = RotaryEmbedding::new(&RopeConfig::new(4), &dev)?;
/// // One head, positions 0 and 1, unit vector along feature 0.
/// let x = Tensor::new(&[[[[1f32, 0., 0., 0.], [1., 0., 0., 0.]]]], &dev)?;
/// let y = rope.forward(&x)?;
/// let row1: Vec<f32> = y.get(0)?.get(0)?.get(1)?.to_vec1()?;
/// // Position 1 rotates pair (0, 2) by 1 radian.
/// assert!((row1[0] - 1f32.cos()).abs() < 1e-6 && (row1[2] - 1f32.sin()).abs() < 1e-6);
/// # Ok::<(), candle_posenc::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct RotaryEmbedding {
    config: RopeConfig,
    device: Device,
    /// Shared by clones, rebuilt when the regime changes and grown when positions pass it.
    tables: Arc<RwLock<Tables>>,
    /// Number of table builds (construction, growth, regime changes), shared by clones.
    builds: Arc<std::sync::atomic::AtomicUsize>,
}

impl RotaryEmbedding {
    /// Builds the tables for `config.max_position` positions on `device`.
    ///
    /// # Errors
    /// As [`RopeConfig::validate`]; [`Error::InvalidConfig`] if the initial table would exceed
    /// 2^30 entries, for an attention factor outside `2^±32` (it scales the logits by its
    /// square), or naming the position where an entry of a table it builds is not finite
    /// in f32 (the attention factor times xPos's key scale past f32's range: such tables are
    /// refused here and wherever they grow, instead of giving ∞ and NaN logits).
    pub fn new(config: &RopeConfig, device: &Device) -> Result<Self> {
        config.validate()?;
        // Tables grow on demand, so a huge max_position (1M-token configs) is not built eagerly.
        let rows = config
            .max_position
            .clamp(1, INITIAL_ROWS_CAP)
            .min(xpos_limit(config).max(1));
        check_table_size(rows, config.rotary_dim)?;
        let tables = build_tables(config, Regime::Fixed, 0, rows, device)?;
        Ok(Self {
            config: config.clone(),
            device: device.clone(),
            tables: Arc::new(RwLock::new(tables)),
            builds: Arc::new(std::sync::atomic::AtomicUsize::new(1)),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RopeConfig {
        &self.config
    }

    /// How many times cos/sin tables have been computed (construction, growth past the cached
    /// positions, a change of dynamic length or of LongRoPE factors).
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn table_builds(&self) -> usize {
        self.builds.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The inverse frequencies and attention factor used for a sequence ending at `seq_len`.
    ///
    /// # Errors
    /// Never for a validated config; kept fallible for symmetry with [`RopeScaling::frequencies`].
    pub fn frequencies(&self, seq_len: usize) -> Result<RopeFrequencies> {
        let c = &self.config;
        let mut freqs = c.scaling.frequencies(c.rotary_dim, c.base, seq_len)?;
        if let Some(axial) = c.axial {
            freqs.inv_freq = axial.inv_freq(c.rotary_dim, c.base);
        }
        Ok(freqs)
    }

    /// The queries' `(cos, sin)` for `len` tokens at `positions`, f32, `(len, rotary_dim / 2)`
    /// for an offset (or ids of batch 1) and `(B, len, rotary_dim / 2)` for per-sequence ids.
    /// cos and sin include the attention factor (and xPos's query scale).
    ///
    /// # Errors
    /// As [`Self::rotate_queries_keys`].
    pub fn cos_sin(&self, positions: &Positions, len: usize) -> Result<(Tensor, Tensor)> {
        positions.check_len(len)?;
        self.bands(positions)?;
        let end = positions.end(len);
        let (tables, first) = self.tables_covering(&[positions], end)?;
        let positions = &from_row(positions, first);
        Ok((
            self.rows(&tables.q.0, positions, len)?,
            self.rows(&tables.q.1, positions, len)?,
        ))
    }

    /// Rotates queries and keys, each at its own positions (keys may be a cache's new chunk).
    ///
    /// Dynamic NTK and LongRoPE choose their frequencies from the larger end of the two
    /// position sets.
    ///
    /// # Shapes
    /// `q`: `(B, Hq, Tq, D)`, `k`: `(B, Hk, Tk, D)` for [`QkLayout::Bhtd`] (heads and sequence
    /// swapped for [`QkLayout::Bthd`]); `D = head_dim`. Returns the same shapes.
    ///
    /// # Errors
    /// [`Error::Rank`] unless both have rank 4; [`Error::Shape`] if a head dimension is not
    /// `head_dim`, the batches differ, or position ids do not match `(B, T)`;
    /// [`Error::InvalidConfig`] if a table past 2^30 entries would be needed, naming the
    /// first position whose table entry is not finite in f32 (see [`Self::new`]), or, for f16
    /// queries or keys, when the attention factor times xPos's scale `ζ^(±n/γ)` leaves `2^±8`
    /// at a rotated position (f16's range is `2^±16`; the keys and logits need the rest);
    /// [`Error::Positions`] for axial 2-D RoPE ([`RopeConfig::axial`]) at positions without
    /// multimodal axes (an offset or `(B, T)` ids), before anything is rotated.
    pub fn rotate_queries_keys(
        &self,
        q: &Tensor,
        k: &Tensor,
        q_positions: &Positions,
        k_positions: &Positions,
        layout: QkLayout,
    ) -> Result<(Tensor, Tensor)> {
        let (qt, kt, tables, first) = self.prepare(q, k, q_positions, k_positions, layout)?;
        let (q_positions, k_positions) =
            (&from_row(q_positions, first), &from_row(k_positions, first));
        let q = self.apply(q, &tables.q, q_positions, qt, layout)?;
        let k = self.apply(k, &tables.k, k_positions, kt, layout)?;
        Ok((q, k))
    }

    /// Checks queries, keys and their positions; returns `(Tq, Tk)`, the tables that cover
    /// both and the position of their first row ([`Self::tables_covering`]).
    fn prepare(
        &self,
        q: &Tensor,
        k: &Tensor,
        q_positions: &Positions,
        k_positions: &Positions,
        layout: QkLayout,
    ) -> Result<(usize, usize, Tables, usize)> {
        let (qb, qt) = self.check(q, "queries", layout)?;
        let (kb, kt) = self.check(k, "keys", layout)?;
        if qb != kb {
            return Err(Error::shape(
                "keys",
                format!("batch {qb} to match the queries"),
                k.shape(),
            ));
        }
        q_positions.check(qb, qt)?;
        k_positions.check(kb, kt)?;
        self.bands(q_positions)?;
        self.bands(k_positions)?;
        let end = q_positions.end(qt).max(k_positions.end(kt));
        let (tables, first) = self.tables_covering(&[q_positions, k_positions], end)?;
        check_dtype_range(&self.config, tables.factor, end, q.dtype())?;
        check_dtype_range(&self.config, tables.factor, end, k.dtype())?;
        Ok((qt, kt, tables, first))
    }

    /// The tables for positions up to `end` of the position sets `sets`, and the position of
    /// their first row (subtract it from the positions, [`from_row`]).
    ///
    /// Past its original length dynamic NTK's frequencies follow the sequence's end, so its
    /// table serves one length only. When every set is an offset, only rows from the lowest
    /// offset are built (a decoding step needs one row, not the whole sequence's); otherwise,
    /// and for every other regime, the shared tables from position 0.
    fn tables_covering(&self, sets: &[&Positions], end: usize) -> Result<(Tables, usize)> {
        let regime = self.config.scaling.regime(end);
        if let Regime::Dynamic(_) = regime {
            let first = sets
                .iter()
                .map(|p| match p {
                    Positions::Offset(start) => Some(*start),
                    Positions::Ids(_) => None,
                })
                .collect::<Option<Vec<_>>>()
                .and_then(|starts| starts.into_iter().min());
            if let Some(first) = first.filter(|&f| f > 0 && f < end) {
                check_table_size(end - first, self.config.rotary_dim)?;
                check_xpos_range(&self.config, end)?;
                let tables = build_tables(&self.config, regime, first, end - first, &self.device)?;
                self.builds
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                return Ok((tables, first));
            }
        }
        Ok((self.tables_for(regime, end)?, 0))
    }

    /// Rotates queries and keys the caller hands over, overwriting their storage where it can:
    /// on the CPU, for contiguous tensors that are not part of an autograd graph, each rotated
    /// feature is read and written once, with no output allocated (the features partial rotary
    /// leaves alone are not touched). Anywhere else this is [`Self::rotate_queries_keys`].
    ///
    /// `q` and `k` are taken by value because their storage may be reused: clones of them share
    /// that storage and see the rotation. (If `q` and `k` share one storage, only `q` is rotated
    /// in place.) Callers who need the input intact use
    /// [`Self::rotate_queries_keys`].
    ///
    /// # Shapes
    /// As [`Self::rotate_queries_keys`].
    ///
    /// # Errors
    /// As [`Self::rotate_queries_keys`].
    pub fn rotate_queries_keys_owned(
        &self,
        q: Tensor,
        k: Tensor,
        q_positions: &Positions,
        k_positions: &Positions,
        layout: QkLayout,
    ) -> Result<(Tensor, Tensor)> {
        self.rotate_owned([q, k], [q_positions, k_positions], layout, false)
    }

    /// [`Self::rotate_queries_keys_owned`], or with `inverse` its adjoint: each rotated by
    /// `−θ` (sin negated), with xPos's and the attention factor's scales as they are, which
    /// is the transpose of the rotation `ζ·R(θ)`.
    fn rotate_owned(
        &self,
        [q, k]: [Tensor; 2],
        [q_positions, k_positions]: [&Positions; 2],
        layout: QkLayout,
        inverse: bool,
    ) -> Result<(Tensor, Tensor)> {
        let (qt, kt, mut tables, first) = self.prepare(&q, &k, q_positions, k_positions, layout)?;
        if inverse {
            // sin negated over the rows the positions read (the tables may hold many more).
            let end = q_positions.end(qt).max(k_positions.end(kt)) - first;
            for (_, sin) in [&mut tables.q, &mut tables.k] {
                *sin = sin.narrow(0, 0, end.min(sin.dim(0)?))?.neg()?;
            }
        }
        let (q_positions, k_positions) =
            (&from_row(q_positions, first), &from_row(k_positions, first));
        if shares_storage(&q, &k) {
            // Rotating both in place would rotate the shared storage twice.
            let k = self.apply(&k, &tables.k, k_positions, kt, layout)?;
            let q = self.apply_owned(q, &tables.q, q_positions, qt, layout)?;
            return Ok((q, k));
        }
        let q = self.apply_owned(q, &tables.q, q_positions, qt, layout)?;
        let k = self.apply_owned(k, &tables.k, k_positions, kt, layout)?;
        Ok((q, k))
    }

    /// Rotates `x` in place when it is a contiguous CPU tensor outside any graph (or a CUDA
    /// one, with the crate's CUDA kernels on: by default), else out of place.
    fn apply_owned(
        &self,
        x: Tensor,
        table: &(Tensor, Tensor),
        positions: &Positions,
        len: usize,
        layout: QkLayout,
    ) -> Result<Tensor> {
        // Split halves rotate through a copy with the middle quarters exchanged.
        let in_place = (x.device().is_cpu() || crate::cuda::kernels_on(x.device()))
            && self.config.axial != Some(AxialRope::SplitHalves)
            && x.elem_count() > 0
            && x.is_contiguous()
            && !x.track_op()
            && matches!(
                x.dtype(),
                DType::F32 | DType::BF16 | DType::F16 | DType::F64
            );
        if !in_place {
            return self.apply(&x, table, positions, len, layout);
        }
        let cos = self.rows(&table.0, positions, len)?;
        let sin = self.rows(&table.1, positions, len)?;
        let op = RotateInPlace {
            pairs: self.config.layout,
            axes: layout,
            inverse: false,
        };
        x.inplace_op3(&cos, &sin, &op)?;
        Ok(x)
    }

    /// Rotates one tensor as queries (xPos: scaled by `ζ^(n/γ)`).
    ///
    /// # Shapes
    /// `x`: `(B, H, T, D)` or `(B, T, H, D)` per `layout`; returns the same shape.
    ///
    /// # Errors
    /// As [`Self::rotate_queries_keys`].
    pub fn rotate_queries(
        &self,
        x: &Tensor,
        positions: &Positions,
        layout: QkLayout,
    ) -> Result<Tensor> {
        self.rotate_one(x, positions, layout, true)
    }

    /// Rotates one tensor as keys (xPos: scaled by `ζ^(−n/γ)`; otherwise the same as queries).
    ///
    /// # Errors
    /// As [`Self::rotate_queries_keys`].
    pub fn rotate_keys(
        &self,
        x: &Tensor,
        positions: &Positions,
        layout: QkLayout,
    ) -> Result<Tensor> {
        self.rotate_one(x, positions, layout, false)
    }

    fn rotate_one(
        &self,
        x: &Tensor,
        positions: &Positions,
        layout: QkLayout,
        queries: bool,
    ) -> Result<Tensor> {
        let (b, t) = self.check(x, if queries { "queries" } else { "keys" }, layout)?;
        positions.check(b, t)?;
        self.bands(positions)?;
        let end = positions.end(t);
        let (tables, first) = self.tables_covering(&[positions], end)?;
        check_dtype_range(&self.config, tables.factor, end, x.dtype())?;
        let table = if queries { &tables.q } else { &tables.k };
        self.apply(x, table, &from_row(positions, first), t, layout)
    }

    /// Checks rank and head dimension; returns `(B, T)`.
    fn check(&self, x: &Tensor, what: &'static str, layout: QkLayout) -> Result<(usize, usize)> {
        let dims = x.dims();
        let [b, a1, a2, d] = dims else {
            return Err(Error::Rank {
                what,
                expected: 4,
                got: dims.len(),
                shape: dims.to_vec(),
            });
        };
        if *d != self.config.head_dim {
            let order = match layout {
                QkLayout::Bhtd => "(batch, heads, seq_len",
                QkLayout::Bthd => "(batch, seq_len, heads",
            };
            return Err(Error::shape(
                what,
                format!("{order}, head_dim = {})", self.config.head_dim),
                x.shape(),
            ));
        }
        let t = match layout {
            QkLayout::Bhtd => *a2,
            QkLayout::Bthd => *a1,
        };
        Ok((*b, t))
    }

    /// Rotates the first `rotary_dim` features of `x` with the given table.
    fn apply(
        &self,
        x: &Tensor,
        table: &(Tensor, Tensor),
        positions: &Positions,
        len: usize,
        layout: QkLayout,
    ) -> Result<Tensor> {
        let c = &self.config;
        let dtype = x.dtype();
        if x.elem_count() == 0 {
            // Nothing to rotate (candle's kernels cannot take empty tensors).
            return Ok(x.clone());
        }
        // Half-precision inputs are rotated in f32 and rounded once at the end.
        let work = match dtype {
            DType::BF16 | DType::F16 => x.to_dtype(DType::F32)?,
            DType::F32 | DType::F64 => x.clone(),
            other => {
                return Err(Error::DType {
                    what: "rotary input",
                    expected: "f32, f64, bf16 or f16",
                    got: other,
                })
            }
        };
        let table_dtype = work.dtype();
        let cos = self.rows(&table.0, positions, len)?.to_dtype(table_dtype)?;
        let sin = self.rows(&table.1, positions, len)?.to_dtype(table_dtype)?;
        let (rot, pass) = if c.rotary_dim < c.head_dim {
            (
                work.narrow(3, 0, c.rotary_dim)?,
                Some(work.narrow(3, c.rotary_dim, c.head_dim - c.rotary_dim)?),
            )
        } else {
            (work, None)
        };
        let split = c.axial == Some(AxialRope::SplitHalves);
        let rot = match split {
            true => swap_middle_quarters(&rot)?,
            false => rot,
        };
        let rotated = match c.kernel {
            RopeKernel::Fused => rotate_fused(&rot, &cos, &sin, c.layout, layout)?,
            RopeKernel::Ops => rotate_ops(&rot, &cos, &sin, c.layout, layout)?,
        };
        let rotated = match split {
            true => swap_middle_quarters(&rotated)?,
            false => rotated,
        };
        let out = match pass {
            Some(pass) => Tensor::cat(&[&rotated, &pass], 3)?,
            None => rotated,
        };
        Ok(out.to_dtype(dtype)?)
    }

    /// How this rotation reads `positions`: the one decision every entry point goes through
    /// (checked before any table is built, and again where the rows are gathered).
    ///
    /// - Axial 2-D RoPE reads each token's row and column, which only multimodal ids hold: an
    ///   offset or ids without axes are refused (HF's vision encoders take `(row, column)`
    ///   pairs and give one position per token no meaning).
    /// - M-RoPE reads each frequency band from its axis of multimodal ids. One position per
    ///   token (an offset, or `(B, T)` ids) is that position on all three axes, as HF's
    ///   Qwen2-VL, Qwen2.5-VL and Qwen3-VL text models expand them (`position_ids[None]
    ///   .expand(3, …)`, the cache's positions likewise): plain RoPE's rows.
    /// - Plain RoPE reads the temporal axis of multimodal ids ([`PositionIds::multimodal`]).
    ///
    /// Returns the bands and the multimodal ids they read, or `None` for plain rows.
    ///
    /// # Errors
    /// [`Error::Positions`] for axial RoPE at positions without axes.
    fn bands<'p>(
        &self,
        positions: &'p Positions,
    ) -> Result<Option<(MropeSection, &'p PositionIds)>> {
        if self.config.axial.is_some() {
            let (ids, _) = positions.grid_axes(
                "axial RoPE positions",
                "the row (height axis) and column (width axis) of each patch",
            )?;
            return Ok(Some((AxialRope::bands(self.config.rotary_dim), ids)));
        }
        Ok(match (self.config.mrope, positions) {
            (Some(m), Positions::Ids(ids)) if ids.axes().is_some() => Some((m, ids)),
            _ => None,
        })
    }

    /// The table rows of `len` tokens at `positions`, read as [`Self::bands`] decides: for
    /// multimodal positions with bands, each frequency from its own axis.
    fn rows(&self, table: &Tensor, positions: &Positions, len: usize) -> Result<Tensor> {
        let Some((bands, ids)) = self.bands(positions)? else {
            return rows(table, positions, len);
        };
        let picked = bands.rows(table, ids, len)?;
        Ok(if picked.dim(0)? == 1 {
            picked.squeeze(0)?
        } else {
            picked
        })
    }

    /// Tables for `regime` covering positions `0..end`, built or grown if needed.
    fn tables_for(&self, regime: Regime, end: usize) -> Result<Tables> {
        {
            let t = self.tables.read().map_err(|_| poisoned())?;
            if t.regime == regime && t.rows()? >= end {
                return Ok(t.clone());
            }
        }
        check_table_size(end, self.config.rotary_dim)?;
        check_xpos_range(&self.config, end)?;
        let mut t = self.tables.write().map_err(|_| poisoned())?;
        let have = if t.regime == regime { t.rows()? } else { 0 };
        if have < end {
            let max_rows = max_table_elements() / (self.config.rotary_dim / 2);
            let rows = match regime {
                // A dynamic table is only valid for its own length.
                Regime::Dynamic(_) => end,
                _ => end
                    .max(have.saturating_mul(2))
                    .max(self.config.max_position.min(INITIAL_ROWS_CAP))
                    .min(max_rows)
                    .min(xpos_limit(&self.config)),
            };
            *t = build_tables(&self.config, regime, 0, rows, &self.device)?;
            self.builds
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(t.clone())
    }
}

/// `x` with the second and third quarters of its last axis exchanged (its own inverse): two
/// rotate-half RoPEs side by side, pairing `c` with `c + d/4` in each half, are one rotate-half
/// RoPE pairing `c` with `c + d/2` on the exchanged features.
fn swap_middle_quarters(x: &Tensor) -> Result<Tensor> {
    let q = x.dim(3)? / 4;
    let part = |i: usize| x.narrow(3, i * q, q);
    Ok(Tensor::cat(
        &[&part(0)?, &part(2)?, &part(1)?, &part(3)?],
        3,
    )?)
}

/// `positions` as rows of a table whose first row is position `first` (`first` is 0 unless
/// every position set is an offset at or past it, see `tables_covering`).
fn from_row(positions: &Positions, first: usize) -> Positions {
    match positions {
        Positions::Offset(start) if first > 0 => Positions::Offset(start - first),
        other => other.clone(),
    }
}

/// Whether two tensors are views of one storage.
fn poisoned() -> Error {
    Error::Candle(candle_core::Error::Msg(
        "rotary table lock poisoned by a panicking thread".into(),
    ))
}

/// Largest table built at construction; longer ones are grown when positions reach them.
const INITIAL_ROWS_CAP: usize = 8192;

/// Largest natural log of an xPos scale (`e^60 ≈ 1e26`): past it f32 tables overflow soon after.
const XPOS_MAX_LOG_SCALE: f64 = 60.0;

/// One past the last position xPos can scale (`usize::MAX` without xPos): the key scale grows
/// like `ζ_0^(−n/γ)`, `ζ_0 = 0.4 / 1.4` being the smallest ζ.
fn xpos_limit(config: &RopeConfig) -> usize {
    match config.xpos_scale_base {
        Some(gamma) => (XPOS_MAX_LOG_SCALE * gamma / (1.4f64 / 0.4).ln()) as usize,
        None => usize::MAX,
    }
}

/// Refuses positions whose xPos scale would overflow.
fn check_xpos_range(config: &RopeConfig, end: usize) -> Result<()> {
    if let Some(gamma) = config.xpos_scale_base {
        let limit = xpos_limit(config);
        if end > limit {
            return Err(Error::config(
                "sequence end",
                end,
                format!(
                    "at most {limit} with xPos scale base {gamma}: its key scale ζ^(-n/γ) grows past 1e26 there"
                ),
            ));
        }
    }
    Ok(())
}

/// Largest natural log of the attention factor, either way (`2^±32`): the logits carry its
/// square, `2^±64`, which leaves f32 (`2^±126`) room for the queries' and keys' own values.
const MAX_LOG_ATTENTION_FACTOR: f64 = 32.0 * std::f64::consts::LN_2;

/// Largest natural log of a table entry's scale in f16 (`2^8`), either way: f16's range is
/// `2^±16` at best (65504; normal from `2^−14`), so keys scaled past `2^8` leave too little
/// room for their own values and their logits, and queries scaled below `2^−8` lose bits.
const F16_MAX_LOG_SCALE: f64 = 8.0 * std::f64::consts::LN_2;

/// Refuses rotating `dtype` queries or keys at positions below `end` when their scales (the
/// attention factor `a`, times xPos's `ζ^(±n/γ)`) do not fit its range. Only f16 needs this: f32
/// tables are checked entry by entry where they are built ([`finite_entry`], up to `e^60` for
/// xPos, [`check_xpos_range`]), and bf16 and f64 have at least f32's range.
fn check_dtype_range(config: &RopeConfig, factor: f64, end: usize, dtype: DType) -> Result<()> {
    if dtype != DType::F16 || end == 0 {
        return Ok(());
    }
    let log_a = factor.ln();
    match config.xpos_scale_base {
        None => {
            if log_a.abs() > F16_MAX_LOG_SCALE {
                return Err(Error::config(
                    "rope attention factor",
                    factor,
                    "within 2^±8 for f16 queries and keys: it scales both, and f16's range is 2^±16",
                ));
            }
        }
        Some(gamma) => {
            // The key scale a·ζ_0^(−n/γ) is the largest, the query scale a·ζ_0^(n/γ) the smallest.
            let per_position = (1.4f64 / 0.4).ln() / gamma;
            let spread = (end - 1) as f64 * per_position;
            if log_a.abs() + spread > F16_MAX_LOG_SCALE {
                let limit =
                    ((F16_MAX_LOG_SCALE - log_a.abs()).max(0.0) / per_position) as usize + 1;
                return Err(Error::config(
                    "sequence end",
                    end,
                    format!(
                        "at most {limit} for f16 queries and keys with xPos scale base {gamma} and attention factor {factor}: their scales a·ζ^(±n/γ) leave 2^±8 there, and f16's range is 2^±16"
                    ),
                ));
            }
        }
    }
    Ok(())
}

fn check_table_size(rows: usize, rotary_dim: usize) -> Result<()> {
    let max = max_table_elements();
    if rows.saturating_mul(rotary_dim / 2) > max {
        return Err(Error::config(
            "sequence end",
            rows,
            format!("positions × rotary_dim / 2 at most {max}"),
        ));
    }
    Ok(())
}

/// `len` rows of a `(N, D/2)` table at `positions`, in the form candle's kernels take: `(len,
/// D/2)` when the batch shares its positions, `(B, len, D/2)` for per-sequence ids. Exactly
/// `len` rows per sequence.
fn rows(table: &Tensor, positions: &Positions, len: usize) -> Result<Tensor> {
    let picked = gather_rows(table, positions, len)?;
    if picked.dim(0)? == 1 {
        Ok(picked.squeeze(0)?)
    } else {
        Ok(picked)
    }
}

/// A table entry computed in f64, as the f32 it is stored (and rotated) in.
///
/// # Errors
/// [`Error::InvalidConfig`] naming the position when the entry is not finite in f32: the
/// attention factor times xPos's scale (`ζ^(±n/γ)`) past f32's range, which would turn
/// finite queries and keys into ∞ and NaN logits. Every table built or grown passes here.
fn finite_entry(value: f64, pos: usize, factor: f64, xpos: Option<f64>) -> Result<f32> {
    let v = value as f32;
    if v.is_finite() {
        return Ok(v);
    }
    let cause = match xpos {
        Some(gamma) => format!(
            "rotary tables finite in f32; there the attention factor ({factor:e}) times xPos's scale ζ^(±n/γ) (γ = {gamma}) is {value:e}"
        ),
        None => format!(
            "rotary tables finite in f32; there cos·attention factor ({factor:e}) is {value:e}"
        ),
    };
    Err(Error::config("position", pos, cause))
}

/// What building `rows` rows of tables holds at once, within the budget: the cos and sin
/// tables (and xPos's key tables), and the f64 frequencies (and xPos's ζ) behind them, two f32
/// elements per f64: `sets × (rows + 1) × rotary_dim / 2`.
fn check_table_stage(config: &RopeConfig, rows: usize) -> Result<()> {
    let sets = if config.xpos_scale_base.is_some() {
        4
    } else {
        2
    };
    crate::limits::check_elements(
        "rotary_dim",
        config.rotary_dim,
        format_args!(
            "{sets} × ({rows} rows + the f64 frequencies) × rotary_dim / 2 of the tables a build holds at once"
        ),
        &[sets, rows.saturating_add(1), config.rotary_dim / 2],
    )?;
    Ok(())
}

/// cos/sin tables for positions `0..rows` in `regime`, computed in f64 and stored as f32.
/// Tables of `rows` positions from `first` (row `r` is position `first + r`).
fn build_tables(
    config: &RopeConfig,
    regime: Regime,
    first: usize,
    rows: usize,
    device: &Device,
) -> Result<Tables> {
    let mut freqs = config
        .scaling
        .frequencies(config.rotary_dim, config.base, regime.seq_len())?;
    if let Some(axial) = config.axial {
        freqs.inv_freq = axial.inv_freq(config.rotary_dim, config.base);
    }
    let half = freqs.inv_freq.len();
    check_table_size(rows, config.rotary_dim)?;
    check_table_stage(config, rows)?;
    let n = rows * half;
    let (mut cos, mut sin) = (Vec::with_capacity(n), Vec::with_capacity(n));
    // xPos: ζ_i = (2i/d + 0.4) / 1.4, scale ζ_i^(n/γ) for queries and its inverse for keys.
    let zeta: Vec<f64> = match config.xpos_scale_base {
        Some(_) => (0..half)
            .map(|i| ((2 * i) as f64 / config.rotary_dim as f64 + 0.4) / 1.4)
            .collect(),
        None => Vec::new(),
    };
    let (mut cos_k, mut sin_k) = match config.xpos_scale_base {
        Some(_) => (Vec::with_capacity(n), Vec::with_capacity(n)),
        None => (Vec::new(), Vec::new()),
    };
    let a = freqs.attention_factor;
    // The factor scales queries and keys alike, so the logits by its square: far past 1 (or
    // below it) it turns finite input into ∞ (or 0) logits even where every table entry is
    // finite in f32.
    if a.is_nan() || a.ln().abs() > MAX_LOG_ATTENTION_FACTOR {
        return Err(Error::config(
            "rope attention factor",
            a,
            "within 2^±32: it scales queries and keys alike, so the logits by its square, which must stay well inside f32's range",
        ));
    }
    for pos in first..first + rows {
        for (i, w) in freqs.inv_freq.iter().enumerate() {
            let angle = pos as f64 * w;
            let (s, c) = angle.sin_cos();
            match config.xpos_scale_base {
                None => {
                    cos.push(finite_entry(c * a, pos, a, None)?);
                    sin.push(finite_entry(s * a, pos, a, None)?);
                }
                Some(gamma) => {
                    let scale = zeta[i].powf(pos as f64 / gamma);
                    cos.push(finite_entry(c * a * scale, pos, a, Some(gamma))?);
                    sin.push(finite_entry(s * a * scale, pos, a, Some(gamma))?);
                    cos_k.push(finite_entry(c * a / scale, pos, a, Some(gamma))?);
                    sin_k.push(finite_entry(s * a / scale, pos, a, Some(gamma))?);
                }
            }
        }
    }
    let q = (
        Tensor::from_vec(cos, (rows, half), device)?,
        Tensor::from_vec(sin, (rows, half), device)?,
    );
    let k = if config.xpos_scale_base.is_some() {
        (
            Tensor::from_vec(cos_k, (rows, half), device)?,
            Tensor::from_vec(sin_k, (rows, half), device)?,
        )
    } else {
        q.clone()
    };
    Ok(Tables {
        regime,
        q,
        k,
        factor: a,
    })
}

impl Module for RotaryEmbedding {
    /// Rotates `x` `(B, H, T, D)` at positions `0..T`, as queries. Axial 2-D RoPE has no
    /// positions `0..T` (it reads rows and columns): it refuses with [`Error::Positions`],
    /// wrapped in candle's error; rotate it with [`Self::rotate_queries`] at multimodal ids.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(self.rotate_queries(x, &Positions::Offset(0), QkLayout::Bhtd)?)
    }
}

impl PositionalEncoding for RotaryEmbedding {
    /// Rotates the block's freshly projected q and k in place (they are owned).
    fn rotate(&self, q: Tensor, k: Tensor, ctx: &AttentionContext) -> Result<(Tensor, Tensor)> {
        self.rotate_queries_keys_owned(q, k, ctx.queries, ctx.keys, QkLayout::Bhtd)
    }

    /// Rotations at fixed frequencies (not dynamic NTK's or LongRoPE's, which follow the
    /// sequence's length), without xPos's position-dependent scale, over one position per
    /// token (not axial 2-D RoPE's rows and columns).
    fn relative_rotation(&self) -> bool {
        let c = &self.config;
        c.xpos_scale_base.is_none() && c.axial.is_none() && !c.scaling.follows_length()
    }

    /// Every RoPE variant rotates (and xPos scales) each query linearly.
    fn scaled_queries(&self) -> bool {
        true
    }

    /// RoPE has no other hook, and every variant is linear in q and k.
    fn rotation_only(&self) -> bool {
        true
    }

    /// q and k rotated by `−θ` with the same scales: the transpose of the rotation.
    fn rotate_adjoint(
        &self,
        dq: Tensor,
        dk: Tensor,
        ctx: &AttentionContext,
    ) -> Result<(Tensor, Tensor)> {
        self.rotate_owned([dq, dk], [ctx.queries, ctx.keys], QkLayout::Bhtd, true)
    }
}

impl crate::plug::SchemeConfig for RopeConfig {
    fn validate(&self) -> Result<()> {
        RopeConfig::validate(self)
    }

    fn build(&self, vb: candle_nn::VarBuilder) -> Result<std::sync::Arc<dyn PositionalEncoding>> {
        Ok(std::sync::Arc::new(RotaryEmbedding::new(
            self,
            vb.device(),
        )?))
    }
}
