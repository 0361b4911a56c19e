//! A third-party positional encoding in one file: KERPLE's logarithmic bias (Chi, Fan, Ramadge
//! and Rudnicky 2022, "KERPLE: Kernelized Relative Positional Embedding for Length
//! Extrapolation"), plugged into the crate's attention block with no change to the block.
//!
//! ```text
//! bias[h, i, j] = −r1_h · log(1 + r2_h · |i − j|)      r1, r2 > 0, learned per head
//! ```
//!
//! For offset positions the encoding answers with one row per distance (`(1, H, 1, Tq + Tk − 1)`
//! read at shifted columns), which the block's fused CPU core reads directly: no `(B, H, T, T)`
//! tensor is built. For explicit ids it answers with a dense bias. Gradients reach `r1` and `r2`
//! on the training path.
//!
//! Run: `cargo run --release --example kerple` (prints the agreement of the fused and the
//! training path, and the time of the rows against the same bias handed over dense).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Init, VarBuilder, VarMap};
use candle_posenc::plug::{
    AttentionContext, Columns, LogitsBias, PositionalEncoding, RelativeBias,
};
use candle_posenc::{AttentionConfig, AttentionOptions, MultiHeadAttention, Positions, Result};

/// KERPLE's logarithmic bias with learned `r1`, `r2` per head (variables `r1` and `r2`,
/// `(num_heads,)`, created at 1).
#[derive(Debug, Clone)]
pub struct Kerple {
    r1: Tensor,
    r2: Tensor,
    /// Answer with a dense bias even for offsets (to compare the two forms).
    dense: bool,
}

impl Kerple {
    /// Loads (or creates) `r1` and `r2` from `vb`.
    ///
    /// # Errors
    /// Candle's loading errors.
    pub fn new(num_heads: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            r1: vb.get_with_hints(num_heads, "r1", Init::Const(1.0))?,
            r2: vb.get_with_hints(num_heads, "r2", Init::Const(1.0))?,
            dense: false,
        })
    }

    /// The same encoding answering with dense biases only.
    pub fn dense(mut self) -> Self {
        self.dense = true;
        self
    }

    /// `−r1 · log(1 + r2 · |d|)` for f32 distances `d` of shape `(B, 1, Q, K)`: `(B, H, Q, K)`.
    fn of_distances(&self, d: &Tensor) -> Result<Tensor> {
        let h = self.r1.dim(0)?;
        let r1 = self.r1.reshape((1, h, 1, 1))?;
        let r2 = self.r2.reshape((1, h, 1, 1))?;
        let log = (d.abs()?.broadcast_mul(&r2)? + 1.0)?.log()?;
        Ok(log.broadcast_mul(&r1)?.neg()?)
    }
}

impl PositionalEncoding for Kerple {
    fn logits_bias(&self, q: &Tensor, ctx: &AttentionContext) -> Result<Option<LogitsBias>> {
        let (tq, tk) = (ctx.q_len, ctx.k_len);
        match (ctx.queries, ctx.keys) {
            (Positions::Offset(qs), Positions::Offset(ks)) if !self.dense && tq > 0 && tk > 0 => {
                // Column c holds the distance j − i = c − (Tq − 1) + ks − qs, so the pair (i, j)
                // reads column j − i + (Tq − 1): a shift of Tq − 1.
                let width = tq + tk - 1;
                let first = *ks as i64 - *qs as i64 - (tq as i64 - 1);
                let d: Vec<f32> = (0..width as i64).map(|c| (first + c) as f32).collect();
                let d = Tensor::from_vec(d, (1, 1, 1, width), q.device())?;
                let rows =
                    RelativeBias::new(self.of_distances(&d)?, Columns::Shift(tq as i64 - 1))?;
                Ok(Some(LogitsBias::Relative(rows)))
            }
            (queries, keys) => {
                let d = Positions::relative_distances(queries, tq, keys, tk, q.device())?;
                let d = d.to_dtype(DType::F32)?.unsqueeze(1)?;
                Ok(Some(LogitsBias::Dense(self.of_distances(&d)?)))
            }
        }
    }
}

/// Builds KERPLE and a causal block over `vb`: the rows form and the same bias handed over dense.
fn blocks(
    vb: &VarBuilder,
    heads: usize,
    d_model: usize,
) -> Result<(MultiHeadAttention, MultiHeadAttention)> {
    let kerple = Kerple::new(heads, vb.pp("kerple"))?;
    let cfg = AttentionConfig::new(d_model, heads).with_causal(true);
    let rows = MultiHeadAttention::new(&cfg, Some(Arc::new(kerple.clone())), vb.pp("attn"))?;
    let dense = rows.clone().with_encoding(Some(Arc::new(kerple.dense())));
    Ok((rows, dense))
}

fn main() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let (b, t, d_model, heads) = (2, 1024, 512, 8);
    // Training: the variables of a VarMap (the block keeps gradients for them).
    let varmap = VarMap::new();
    let (rows_train, _) = blocks(
        &VarBuilder::from_varmap(&varmap, DType::F32, &dev),
        heads,
        d_model,
    )?;
    // Inference: the same values as plain tensors, as a model loaded from a checkpoint.
    let plain: HashMap<String, Tensor> = varmap
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("varmap lock"))?
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().detach()))
        .collect();
    let (rows, dense) = blocks(
        &VarBuilder::from_tensors(plain, DType::F32, &dev),
        heads,
        d_model,
    )?;
    let x = Tensor::randn(0f32, 1.0, (b, t, d_model), &dev)?;

    // Inference takes the fused core; training the differentiable ops. Same attention.
    let fused = rows.forward(&x)?;
    let train = AttentionOptions {
        train: true,
        ..Default::default()
    };
    let plain = rows_train.forward_with(&x, &train, None)?.output;
    let diff = (&fused - &plain)?.abs()?.max_all()?.to_scalar::<f32>()?;
    println!("KERPLE-log, B{b} T{t} d_model {d_model} H{heads}, causal");
    println!("fused inference vs training path: max |difference| {diff:.2e}");

    // Gradients reach r1 and r2.
    let grads = plain.sqr()?.sum_all()?.backward()?;
    for name in ["kerple.r1", "kerple.r2"] {
        let var = varmap.data().lock().expect("varmap lock")[name]
            .as_tensor()
            .clone();
        let g = grads
            .get(&var)
            .map(|g| g.abs()?.sum_all()?.to_scalar::<f32>());
        println!(
            "gradient of {name}: |sum| {:.3e}",
            g.transpose()?.unwrap_or(0.0)
        );
    }

    // The rows against the same bias handed over as a (1, H, T, T) tensor.
    let time = |m: &MultiHeadAttention| -> anyhow::Result<f64> {
        m.forward(&x)?;
        let mut ms = Vec::new();
        for _ in 0..7 {
            let start = Instant::now();
            m.forward(&x)?;
            ms.push(start.elapsed().as_secs_f64() * 1e3);
        }
        ms.sort_by(f64::total_cmp);
        Ok(ms[3])
    };
    let (r, d) = (time(&rows)?, time(&dense)?);
    println!(
        "forward, rows per distance: {r:.1} ms; dense bias: {d:.1} ms ({:.2}x)",
        d / r
    );
    Ok(())
}
