//! Training through the fused CUDA kernels: the forward with each row's statistics, attached
//! to candle's graph by gradient grafts whose backward launches `posenc_flash_delta` and
//! `posenc_flash_backward` (flash_forward.cu).
//!
//! ```text
//! out = attention(q, k, v)            forward kernel, stats = (m_i, 1 / l_i) per row
//! dq, dk, dv, d sink = backward(dO)   one δ launch and one backward launch, f32, cast back
//! d term = Σ dS over its entries       in the same backward launch, for each term that learns
//! d a = Σ_{b, h, i} W_i· ⊗ dO_i          a value term's table (Shaw's aⱽ): one product of the
//!                                      weights W its columns gather (the launches write them)
//! ```
//!
//! A value term also adds `dO_i · a[c(i, j)]` to each `dP_ij`: one product on the host,
//! `(B·H·Tq, D) × (D, W)`, read by the backward launch.
//!
//! The output is grafted onto q, k, v (and the sinks, each term, dense or relative rows, and
//! the value table, when they take a gradient) one link each;
//! the outermost link, the first the backward pass reaches, runs the kernels and the others
//! take their share. Like the forward, on by default where it has passed on a GPU (checked on
//! the CPU emulator, `tests/cuda_emulator`, and on an H100 and an H200: see docs/gpu.md).

use std::sync::{Arc, Mutex};

use candle_core::{DType, Tensor};

use super::kernel::{rows_aligned, BackwardBuffers, LaunchOp};
use super::CudaCore;
use crate::attention::fused_training::padded_dims;
use crate::error::Result;
use crate::graft::{graft_through, GraftBackward};
use crate::matmul::matmul;

/// What the links share: the forward's launch (with its statistics), its output, and the
/// gradients of the last backward pass until each link takes its own.
struct Shared {
    forward: LaunchOp,
    out: Tensor,
    /// The dtypes of q, k, v and the sinks, which the gradients take.
    dtypes: [DType; 4],
    sinks: bool,
    /// Per term of the launch (dense, then relative), when it takes a gradient.
    terms: Vec<Option<LearnedTerm>>,
    /// The value table's dtype, when it takes a gradient (the launch gathers its weights).
    table_dtype: Option<DType>,
    /// dq, dk, dv, the sinks' gradient, one per term, then the value table's.
    cache: Mutex<Option<Vec<Option<Tensor>>>>,
}

/// A term that takes a gradient: its dims left-padded to four axes, its own dims and dtype.
type LearnedTerm = ([usize; 4], Vec<usize>, DType);

impl Shared {
    /// dq, dk, dv, the sinks' gradient, each term's (those that take one) and the value
    /// table's (when it takes one) from the output's gradient.
    fn grads(&self, d_out: &Tensor) -> candle_core::Result<Vec<Option<Tensor>>> {
        let op = &self.forward;
        let (b, h, tq, d) = op.q.dims4()?;
        let (_, hkv, tk, _) = op.k.dims4()?;
        let dev = d_out.device();
        let zeros = |dims: &[usize]| Tensor::zeros(dims, DType::F32, dev);
        let dq = zeros(&[b, h, tq, d])?;
        // Rows read 16 bytes at a time, as the forward's operands are.
        let d_out =
            rows_aligned(&d_out.to_dtype(op.q.dtype())?).map_err(candle_core::Error::wrap)?;
        // A value term: dO as rows (B·H·Tq, D) in f32, the values the kernels read, and
        // dO_i · a[c] for every column.
        let value_rows = match &op.values {
            Some((table, _)) => {
                let rows = d_out
                    .to_dtype(DType::F32)?
                    .transpose(1, 2)?
                    .contiguous()?
                    .reshape((b * h * tq, d))?;
                let dp = matmul(&rows, &table.detach().t()?)?;
                Some((rows, dp.reshape((b, h, tq, table.dim(0)?))?))
            }
            None => None,
        };
        let buffers = BackwardBuffers {
            out: self.out.clone(),
            d_out,
            delta: zeros(&[b, h, tq])?,
            dk: zeros(&[b, hkv, tk, d])?,
            dv: zeros(&[b, hkv, tk, d])?,
            dsinks: self.sinks.then(|| zeros(&[h])).transpose()?,
            term_grads: self
                .terms
                .iter()
                .map(|t| t.as_ref().map(|(dims, _, _)| zeros(dims)).transpose())
                .collect::<candle_core::Result<_>>()?,
            value_dp: value_rows.as_ref().map(|(_, dp)| dp.clone()),
        };
        let mut backward = op.clone();
        backward.backward = Some(buffers.clone());
        dq.inplace_op1(&backward)?;
        let [qt, kt, vt, st] = self.dtypes;
        let mut grads = vec![
            Some(dq.to_dtype(qt)?),
            Some(buffers.dk.to_dtype(kt)?),
            Some(buffers.dv.to_dtype(vt)?),
            buffers.dsinks.map(|g| g.to_dtype(st)).transpose()?,
        ];
        for (grad, term) in buffers.term_grads.into_iter().zip(&self.terms) {
            grads.push(match (grad, term) {
                (Some(g), Some((_, dims, dtype))) => {
                    Some(g.reshape(dims.as_slice())?.to_dtype(*dtype)?)
                }
                _ => None,
            });
        }
        // The table's gradient: Σ over (b, h, i) of each column's gathered weight times dO_i.
        if let (Some(dtype), Some(weights), Some((rows, _))) =
            (self.table_dtype, &op.value_weights, &value_rows)
        {
            let width = weights.dim(3)?;
            let da = matmul(&weights.reshape((b * h * tq, width))?.t()?, rows)?;
            grads.push(Some(da.to_dtype(dtype)?));
        }
        Ok(grads)
    }
}

/// One operand's link: hands its gradient from the backward launch to candle.
struct Link {
    shared: Arc<Shared>,
    which: usize,
    outermost: bool,
}

impl GraftBackward for Link {
    const NAME: &'static str = "posenc-cuda-attention-grad";

    fn grad(&self, grad_y: &Tensor) -> candle_core::Result<Tensor> {
        let s = &self.shared;
        let mut cache = s.cache.lock().map_err(|_| {
            candle_core::Error::Msg("CUDA attention training: a lock was poisoned".into())
        })?;
        if self.outermost {
            *cache = Some(s.grads(grad_y)?);
        }
        cache
            .as_mut()
            .and_then(|g| g.get_mut(self.which).and_then(Option::take))
            .ok_or_else(|| {
                candle_core::Error::Msg(
                    "CUDA attention training: a gradient was not computed".into(),
                )
            })
    }
}

/// The attention output `(B, Tq, H, D)` in the block's dtype, in the graph of `core`'s q, k, v
/// and, when they track gradients, its sinks, its terms (dense terms, a user's mask included,
/// and relative rows) and its value table. The caller checks `kernel::takes` (the backward
/// has every head dimension and dtype the forward has), and that there is no dropout (which
/// takes candle's ops).
///
/// # Errors
/// What [`CudaCore::write_into`] returns, for operands the kernels do not take or a launch that
/// fails; [`crate::error::Error::Shape`] for a term that learns with more than four axes, and
/// a budget error when a term's gradient, or a value term's `(B, H, Tq, W)` rows, would pass
/// the element budget.
pub(crate) fn attend(core: &CudaCore<'_>) -> Result<Tensor> {
    let (b, h, tq, d) = core.q.dims4()?;
    // The kernels read the operands' values; the graph is attached below.
    let (q, k, v) = (core.q.detach(), core.k.detach(), core.v.detach());
    let values = CudaCore {
        q: &q,
        k: &k,
        v: &v,
        dense: core.dense,
        dense_masks: core.dense_masks,
        relative: core.relative,
        padding: core.padding,
        rule: core.rule,
        sinks: core.sinks,
        values: core.values,
    };
    // The terms in the launch's order (`CudaCore::terms`): dense, then relative rows; those
    // that learn are checked before anything is launched.
    let mut terms: Vec<Tensor> = core.dense.iter().map(|t| (*t).clone()).collect();
    for r in core.relative {
        terms.push(r.values()?);
    }
    let mut learned = Vec::new();
    for t in &terms {
        learned.push(match t.track_op() {
            true => {
                let dims = padded_dims(t)?;
                crate::limits::check_elements(
                    "additive logits term with gradients on CUDA",
                    format_args!("{:?}", t.dims()),
                    "its f32 gradient",
                    &dims,
                )?;
                Some((dims, t.dims().to_vec(), t.dtype()))
            }
            false => None,
        });
    }
    // A value term: its backward reads dO · a, and gathers its weights when the table learns,
    // one (B, H, Tq, W) f32 tensor each.
    let table = core.values.map(|v| v.table());
    if let Some(table) = table {
        crate::limits::check_elements(
            "relative value table in training on CUDA",
            format_args!("{:?}", table.dims()),
            "batch × heads × queries × its columns, the f32 rows its backward reads,",
            &[b, h, tq, table.dim(0)?],
        )?;
    }
    let table = table.filter(|t| t.track_op());
    let out = Tensor::zeros((b, tq, h, d), q.dtype(), q.device())?;
    let mut forward = values.launch_op(&out, 0)?;
    forward.stats = Some(Tensor::zeros((b, h, tq, 2), DType::F32, q.device())?);
    if let Some(table) = table {
        // The end columns' weights are written by the forward of whole rows: keys unsplit.
        (forward.splits, forward.key_split, forward.partial) = (1, 0, None);
        forward.value_weights = Some(Tensor::zeros(
            (b, h, tq, table.dim(0)?),
            DType::F32,
            q.device(),
        )?);
    }
    out.inplace_op1(&forward)?;
    let sinks = core.sinks.filter(|s| s.track_op());
    let shared = Arc::new(Shared {
        forward,
        out: out.clone(),
        dtypes: [
            core.q.dtype(),
            core.k.dtype(),
            core.v.dtype(),
            sinks.map_or(DType::F32, Tensor::dtype),
        ],
        sinks: sinks.is_some(),
        terms: learned,
        table_dtype: table.map(Tensor::dtype),
        cache: Mutex::new(None),
    });
    // Each link's tensor and its place among the gradients (q, k, v, the sinks, the terms,
    // the value table).
    let n_terms = terms.len();
    let wanted: Vec<(usize, &Tensor)> = [core.q, core.k, core.v]
        .into_iter()
        .enumerate()
        .chain(sinks.map(|s| (3, s)))
        .chain(
            terms
                .iter()
                .enumerate()
                .filter(|(_, t)| t.track_op())
                .map(|(n, t)| (4 + n, t)),
        )
        .chain(table.map(|t| (4 + n_terms, t)))
        .collect();
    let last = wanted.len() - 1;
    let mut linked = out;
    for (nth, (which, tensor)) in wanted.into_iter().enumerate() {
        linked = graft_through(
            tensor,
            &linked,
            Link {
                shared: shared.clone(),
                which,
                outermost: nth == last,
            },
        )?;
    }
    Ok(linked)
}
