//! The bench's cases: every encoding as one named block (and Shaw's direct formula, the memory
//! baseline), the trained ones, and the blocks built from them.

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use candle_nn::VarBuilder;
use candle_posenc::plug::{AttentionContext, Columns, LogitsBias, RelativeValues};
use candle_posenc::{
    Alibi, AlibiConfig, AlibiMode, AttentionConfig, AttentionOptions, ClippedBiasConfig,
    ClippedRelativeBias, ForgettingGates, FoxConfig, InklingConfig, InklingRelativeLogits, KvCache,
    LearnedConfig, LearnedPositionalEncoding, MultiHeadAttention, PositionalEncoding, RopeConfig,
    RotaryEmbedding, ShawConfig, ShawRelativePosition, SinusoidalConfig,
    SinusoidalPositionalEncoding, T5Config, T5RelativeBias,
};
use std::sync::Arc;

/// Shaw et al.'s keys computed as the formula is written: the (T, T, d) tensor a^K[r(i, j)] is
/// built, then contracted per query position; the values term reaches the block as a table with
/// an explicit (T, T) column map. The memory baseline.
#[derive(Debug)]
struct DirectShaw {
    keys: Tensor,
    values: Tensor,
    k: i64,
}

impl DirectShaw {
    fn expanded(&self, table: &Tensor, tq: usize, tk: usize) -> candle_posenc::Result<Tensor> {
        let idx: Vec<u32> = (0..tq)
            .flat_map(|i| {
                (0..tk).map(move |j| ((j as i64 - i as i64).clamp(-self.k, self.k) + self.k) as u32)
            })
            .collect();
        let idx = Tensor::from_vec(idx, tq * tk, table.device())?;
        Ok(table
            .index_select(&idx, 0)?
            .reshape((tq, tk, table.dim(1)?))?)
    }
}

impl PositionalEncoding for DirectShaw {
    /// `q_i · a^K[r(i, j)]` through the `(Tq, Tk, d)` tensor, as the formula is written.
    fn logits_bias(
        &self,
        q: &Tensor,
        ctx: &AttentionContext,
    ) -> candle_posenc::Result<Option<LogitsBias>> {
        let (b, h, tq, d) = q.dims4()?;
        let tk = ctx.k_len;
        let ak = self.expanded(&self.keys, tq, tk)?; // (Tq, Tk, d)
        let qt = q
            .permute((2, 0, 1, 3))?
            .reshape((tq, b * h, d))?
            .contiguous()?;
        let bias = qt.matmul(&ak.transpose(1, 2)?.contiguous()?)?; // (Tq, B·H, Tk)
        let bias = bias.reshape((tq, b, h, tk))?.permute((1, 2, 0, 3))?;
        Ok(Some(LogitsBias::Dense(bias)))
    }

    /// `a^V` read at an explicit `(1, Tq, Tk)` map of `r(i, j)` (the plug carries a value term
    /// as a table and a column rule; the block sums the weights per column).
    fn value_term(&self, ctx: &AttentionContext) -> candle_posenc::Result<Option<RelativeValues>> {
        let (tq, tk) = (ctx.q_len, ctx.k_len);
        let idx: Vec<u32> = (0..tq)
            .flat_map(|i| {
                (0..tk).map(move |j| ((j as i64 - i as i64).clamp(-self.k, self.k) + self.k) as u32)
            })
            .collect();
        let idx = Tensor::from_vec(idx, (1, tq, tk), self.values.device())?;
        Ok(Some(RelativeValues::new(
            self.values.clone(),
            Columns::Index(idx),
        )?))
    }
}

pub(crate) struct Case {
    pub(crate) name: &'static str,
    pub(crate) encoding: Option<Arc<dyn PositionalEncoding>>,
}

pub(crate) fn cases(
    d_model: usize,
    heads: usize,
    head_dim: usize,
    max_len: usize,
    dev: &Device,
    vb: &VarBuilder,
) -> Result<Vec<Case>> {
    let case = |name, e: Arc<dyn PositionalEncoding>| Case {
        name,
        encoding: Some(e),
    };
    let shaw = ShawRelativePosition::new(&ShawConfig::new(head_dim, 64), vb.pp("shaw"))?;
    let direct = DirectShaw {
        keys: shaw.relative_keys().clone(),
        values: shaw.relative_values().context("values")?.clone(),
        k: 64,
    };
    Ok(vec![
        Case {
            name: "none",
            encoding: None,
        },
        case(
            "sinusoidal",
            Arc::new(SinusoidalPositionalEncoding::new(
                &SinusoidalConfig::new(d_model),
                dev,
            )?),
        ),
        case(
            "learned",
            Arc::new(LearnedPositionalEncoding::new(
                &LearnedConfig::new(d_model).with_max_len(max_len),
                vb.pp("wpe"),
            )?),
        ),
        case(
            "rope",
            Arc::new(RotaryEmbedding::new(&RopeConfig::new(head_dim), dev)?),
        ),
        case(
            "alibi",
            Arc::new(Alibi::new(&AlibiConfig::new(heads), dev)?),
        ),
        case(
            "alibi_symmetric",
            Arc::new(Alibi::new(
                &AlibiConfig::new(heads).with_mode(AlibiMode::Symmetric),
                dev,
            )?),
        ),
        case(
            "t5",
            Arc::new(T5RelativeBias::new(&T5Config::new(heads), vb.pp("t5"))?),
        ),
        case(
            "clipped_bias",
            Arc::new(ClippedRelativeBias::new(
                &ClippedBiasConfig::new(heads, 64),
                vb.pp("clipped"),
            )?),
        ),
        case("shaw_k64", Arc::new(shaw)),
        case("shaw_direct_k64", Arc::new(direct)),
        // Both halves of gates, so that one case serves causal and bidirectional blocks (a
        // causal block masks the reverse half's keys).
        case(
            "fox",
            Arc::new(ForgettingGates::new(
                &FoxConfig::new(d_model, heads).with_bidirectional(true),
                vb.pp("fox"),
            )?),
        ),
        // Inkling's full layers: d_rel 16, a bank of 1024 distances (HF's defaults), log-n
        // scaling from position 256 (alpha 0.1), so that a T = 1024 step scales and a T = 8192
        // one reaches past the bank.
        case(
            "inkling",
            Arc::new(InklingRelativeLogits::new(
                &InklingConfig::new(d_model, heads).with_log_scaling(Some(
                    candle_posenc::LogScaling {
                        n_floor: 256,
                        alpha: 0.1,
                    },
                )),
                vb.pp("inkling"),
            )?),
        ),
    ])
}

/// The cases of the CPU training steps.
pub(crate) const TRAINED: [&str; 8] = [
    "none",
    "rope",
    "alibi",
    "t5",
    "clipped_bias",
    "shaw_k64",
    "fox",
    "inkling",
];

pub(crate) fn block(
    case: &Case,
    causal: bool,
    d_model: usize,
    heads: usize,
    vb: &VarBuilder,
) -> Result<MultiHeadAttention> {
    block_with(
        case,
        AttentionConfig::new(d_model, heads).with_causal(causal),
        vb,
    )
}

pub(crate) fn block_with(
    case: &Case,
    cfg: AttentionConfig,
    vb: &VarBuilder,
) -> Result<MultiHeadAttention> {
    Ok(MultiHeadAttention::new(
        &cfg,
        case.encoding.clone(),
        vb.pp("attn"),
    )?)
}

/// One forward of `mha` on `x`, the device synchronised before its output is dropped.
pub(crate) fn forward_once(
    mha: &MultiHeadAttention,
    x: &Tensor,
    opts: &AttentionOptions,
    cache: Option<&mut KvCache>,
) -> Result<()> {
    let y = mha.forward_with(x, opts, cache)?.output;
    x.device().synchronize()?;
    drop(y);
    Ok(())
}
