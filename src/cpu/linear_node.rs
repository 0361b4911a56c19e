//! A linear projection as one node of candle's graph, on the CPU in f32.
//!
//! ```text
//! forward:   y = x Wᵀ + b          x: rows × in (as stored)   W: (out, in)   b: (out)
//! backward:  ∂x = ∂y W    ∂W = ∂yᵀ x    ∂b = Σ_rows ∂y
//! ```
//!
//! candle's `Linear` is four nodes of its graph (a reshape of x, `Wᵀ`, the product, a reshape
//! back), and the block splits the result into heads in a fifth. candle's backward starts
//! every node's gradient as a zero-filled tensor and adds into it, so each projection cost
//! half a dozen fresh tensors the size of its input or output (and their page faults) besides
//! its products. Here one node writes `y` in the layout the block wants, rows `(…, out)` or
//! heads first `(B, H, T, D)` with `out = H·D` ([`Arrange`]), and its backward computes ∂x, ∂W
//! and ∂b with `gemm` directly, each only for an input that tracks gradients. Where nothing
//! tracks (inference) the same forward writes the heads without a copy of the rows.
//!
//! Elsewhere (another device or dtype) [`linear`] answers `None` and the block keeps
//! candle's `Linear`. Shaw's products `q · a^Kᵀ` go through the same node, the table's rows
//! as the weights. The heads-first arrangement goes through scratch rows kept across calls
//! (`cpu::workspace`).

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};
use candle_nn::Linear;
use rayon::prelude::*;

use super::gemm::{few_rows, linear as linear_product, product_parallel, Place, Product, FEW_ROWS};
use super::{workspace, zeroed};
use crate::error::Result;

/// How a projection's output is laid out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Arrange {
    /// `(lead…, out)`: the rows in the input's order.
    Rows(Vec<usize>),
    /// `(B, H, T, D)` from `B·T` rows of `H·D` features: the heads split out and moved first.
    Heads {
        batch: usize,
        len: usize,
        heads: usize,
        head_dim: usize,
    },
    /// `(B, out, T)` from `B·T` rows: each feature's values over the tokens (per-token states
    /// as the plug's content hook answers them), the heads-first layout with one feature per
    /// head.
    Channels { batch: usize, len: usize },
}

/// `linear(x)` as one node ([`Arrange`] says how the output is laid out), or `None` where the
/// node does not apply: another device or dtype than f32 on the CPU, or sizes that do not fit
/// (the caller then takes candle's `Linear`). `x` holds its rows of `in` features in order.
///
/// # Errors
/// The output or its scratch rows cannot be allocated; candle's errors.
pub(crate) fn linear(linear: &Linear, x: &Tensor, arrange: Arrange) -> Result<Option<Tensor>> {
    scaled(linear, x, arrange, 1.0)
}

/// [`linear`] times `scale`, `scale · (x Wᵀ + b)`, in the same node (the queries' softmax scale
/// taken into their projection instead of a pass of its own, forward and backward).
///
/// # Errors
/// As [`linear`].
pub(crate) fn scaled(
    linear: &Linear,
    x: &Tensor,
    arrange: Arrange,
    scale: f32,
) -> Result<Option<Tensor>> {
    let w = linear.weight();
    let f32_cpu = |t: &Tensor| t.device().is_cpu() && t.dtype() == DType::F32;
    let Ok((out, inner)) = w.dims2() else {
        return Ok(None);
    };
    if !f32_cpu(x) || !f32_cpu(w) || inner == 0 || out == 0 {
        return Ok(None);
    }
    if linear
        .bias()
        .is_some_and(|b| !f32_cpu(b) || b.dims() != [out])
    {
        return Ok(None);
    }
    // x: the arrangement's leading axes, then axes holding one row of `in` features.
    let (lead, heads_fit) = match &arrange {
        Arrange::Rows(lead) => (lead.as_slice(), true),
        Arrange::Heads {
            batch,
            len,
            heads,
            head_dim,
        } => (
            &[*batch, *len][..],
            heads.checked_mul(*head_dim) == Some(out),
        ),
        Arrange::Channels { batch, len } => (&[*batch, *len][..], true),
    };
    let row = x
        .dims()
        .get(lead.len()..)
        .map(|r| r.iter().product::<usize>());
    if !heads_fit || !x.dims().starts_with(lead) || row != Some(inner) || x.elem_count() == 0 {
        return Ok(None);
    }
    let node = Node {
        arrange,
        out,
        inner,
        scale,
    };
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    Ok(Some(match linear.bias() {
        Some(b) => x.apply_op3(&w, &b.contiguous()?, node)?,
        None => x.apply_op2(&w, node)?,
    }))
}

/// The op: its output's arrangement, the weight's `(out, in)` and the factor on its output.
struct Node {
    arrange: Arrange,
    out: usize,
    inner: usize,
    scale: f32,
}

/// `f` with `n` values of kept scratch (their contents unspecified; `cpu::workspace`).
///
/// # Errors
/// The scratch cannot be allocated.
pub(crate) fn with_scratch<R>(n: usize, f: impl FnOnce(&mut [f32]) -> R) -> candle_core::Result<R> {
    let mut buf = workspace::take(n, "projection rows")?;
    let r = f(&mut buf);
    workspace::keep(buf);
    Ok(r)
}

/// The `n` values of a contiguous f32 CPU storage, or candle's error.
fn values<'a>(s: &'a CpuStorage, l: &Layout, n: usize) -> candle_core::Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(d), Some((start, end))) if end - start == n && end <= d.len() => {
            Ok(&d[start..end])
        }
        _ => candle_core::bail!("projection node: expected {n} contiguous f32 values"),
    }
}

/// `scale · (x Wᵀ + b)` written into `y` heads first, `(B, H, T, D)` for `heads` `(T, H, D)`:
/// a few rows directly (`gemm::few_rows`), more through kept scratch rows; every value of `y`
/// is written.
///
/// # Errors
/// A buffer cannot be allocated.
pub(crate) fn heads_into(
    y: &mut [f32],
    (x, w, bias): (&[f32], &[f32], Option<&[f32]>),
    (rows, out, inner): (usize, usize, usize),
    heads: (usize, usize, usize),
    scale: f32,
) -> candle_core::Result<()> {
    if (1..=FEW_ROWS).contains(&rows) && inner > 0 {
        let (len, heads, d) = heads;
        let place = Place::Heads { len, heads, d };
        let product = Product {
            y,
            w,
            bias,
            out,
            scale,
            place,
        };
        return few_rows(x, (rows, inner), &mut [product]);
    }
    with_scratch(rows * out, |scratch| {
        linear_product(scratch, (x, w, bias), (rows, out, inner), scale)?;
        rows_to_heads(scratch, y, heads);
        Ok(())
    })?
}

/// `(B, H, T, D)` from rows `(B·T, H·D)`.
fn rows_to_heads(rows: &[f32], heads_first: &mut [f32], (len, heads, d): (usize, usize, usize)) {
    let out = heads * d;
    heads_first
        .par_chunks_mut(len * d)
        .enumerate()
        .for_each(|(bh, dst)| {
            let (b, h) = (bh / heads, bh % heads);
            for (t, dst) in dst.chunks_exact_mut(d).enumerate() {
                let src = (b * len + t) * out + h * d;
                dst.copy_from_slice(&rows[src..src + d]);
            }
        });
}

/// Rows `(B·T, H·D)` from `(B, H, T, D)`.
pub(crate) fn heads_to_rows(
    heads_first: &[f32],
    rows: &mut [f32],
    (len, heads, d): (usize, usize, usize),
) {
    rows.par_chunks_mut(heads * d)
        .enumerate()
        .with_min_len(64)
        .for_each(|(r, dst)| {
            let (b, t) = (r / len, r % len);
            for (h, dst) in dst.chunks_exact_mut(d).enumerate() {
                let src = ((b * heads + h) * len + t) * d;
                dst.copy_from_slice(&heads_first[src..src + d]);
            }
        });
}

impl Node {
    fn shape(&self) -> Shape {
        match &self.arrange {
            Arrange::Rows(lead) => {
                let mut dims = lead.clone();
                dims.push(self.out);
                Shape::from(dims)
            }
            &Arrange::Heads {
                batch,
                len,
                heads,
                head_dim,
            } => Shape::from((batch, heads, len, head_dim)),
            &Arrange::Channels { batch, len } => Shape::from((batch, self.out, len)),
        }
    }

    /// `(T, H, D)` of the heads-first arrangement.
    fn heads(&self) -> Option<(usize, usize, usize)> {
        match self.arrange {
            Arrange::Rows(_) => None,
            Arrange::Heads {
                len,
                heads,
                head_dim,
                ..
            } => Some((len, heads, head_dim)),
            Arrange::Channels { len, .. } => Some((len, self.out, 1)),
        }
    }

    /// `x Wᵀ + b` in the node's arrangement.
    fn forward(
        &self,
        (x, lx): (&CpuStorage, &Layout),
        (w, lw): (&CpuStorage, &Layout),
        bias: Option<(&CpuStorage, &Layout)>,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (out, inner) = (self.out, self.inner);
        let rows = lx.shape().elem_count() / inner;
        let x = values(x, lx, rows * inner)?;
        let w = values(w, lw, out * inner)?;
        let bias = bias.map(|(b, lb)| values(b, lb, out)).transpose()?;
        let mut y = zeroed(rows * out, "projection output")?;
        let dims = (rows, out, inner);
        match self.heads() {
            None => linear_product(&mut y, (x, w, bias), dims, self.scale)?,
            Some(heads) => heads_into(&mut y, (x, w, bias), dims, heads, self.scale)?,
        }
        Ok((CpuStorage::F32(y), self.shape()))
    }

    /// ∂x, ∂W and ∂b from ∂y, each for an input that tracks gradients.
    fn backward(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        grad: &Tensor,
    ) -> candle_core::Result<[Option<Tensor>; 3]> {
        let (out, inner) = (self.out, self.inner);
        let rows = x.elem_count() / inner;
        let grad = grad.contiguous()?;
        let (gs, gl) = grad.storage_and_layout();
        let (xs, xl) = x.storage_and_layout();
        let (ws, wl) = w.storage_and_layout();
        let (
            candle_core::Storage::Cpu(gs),
            candle_core::Storage::Cpu(xs),
            candle_core::Storage::Cpu(ws),
        ) = (&*gs, &*xs, &*ws)
        else {
            candle_core::bail!("projection node: expected CPU tensors")
        };
        let g = values(gs, gl, rows * out)?;
        let xv = values(xs, xl, rows * inner)?;
        let wv = values(ws, wl, out * inner)?;
        let from_rows = |g: &[f32]| -> candle_core::Result<[Option<Tensor>; 3]> {
            let dims = (rows, out, inner);
            let mut dx = match x.track_op() {
                true => Some(zeroed(rows * inner, "projection gradient")?),
                false => None,
            };
            let want = (w.track_op(), bias.is_some_and(|b| b.track_op()));
            let dxs = dx.as_deref_mut().map(|d| (d, false));
            let (dw, db) = grads_of_rows(g, (xv, wv), dims, self.scale, dxs, want)?;
            let tensor = |v: Option<Vec<f32>>, like: &Tensor| {
                v.map(|v| Tensor::from_vec(v, like.shape(), like.device()))
                    .transpose()
            };
            let db = match bias {
                Some(b) => tensor(db, b)?,
                None => None,
            };
            Ok([tensor(dx, x)?, tensor(dw, w)?, db])
        };
        match self.heads() {
            None => from_rows(g),
            Some(dims) => with_scratch(rows * out, |scratch| {
                heads_to_rows(g, scratch, dims);
                from_rows(scratch)
            })?,
        }
    }
}

/// A projection's ∂W and ∂b, where asked for.
pub(crate) type WeightGrads = (Option<Vec<f32>>, Option<Vec<f32>>);

/// The gradients of `y = scale · (x Wᵀ + b)` from ∂y as rows `(rows, out)`, with x
/// `(rows, in)` and W `(out, in)` row-major (`dims` = `(rows, out, in)`): ∂x = scale · ∂y W
/// written into `dx` (added to what it holds with its flag), and ∂W = scale · ∂yᵀ x and
/// ∂b = scale · Σ_rows ∂y returned where `want` = (∂W, ∂b) asks for them.
///
/// # Errors
/// A gradient cannot be allocated; a slice shorter than `dims` says.
pub(crate) fn grads_of_rows(
    g: &[f32],
    (x, w): (&[f32], &[f32]),
    (rows, out, inner): (usize, usize, usize),
    scale: f32,
    dx: Option<(&mut [f32], bool)>,
    (want_w, want_b): (bool, bool),
) -> candle_core::Result<WeightGrads> {
    let dx_len = dx.as_ref().map_or(rows * inner, |(d, _)| d.len());
    if g.len() < rows * out
        || x.len() < rows * inner
        || w.len() < out * inner
        || dx_len < rows * inner
    {
        candle_core::bail!("projection gradients: operands shorter than ({rows}, {out}, {inner})")
    }
    if let Some((dx, accumulate)) = dx {
        // SAFETY: ∂y holds rows × out values, W out × in, ∂x rows × in (checked above).
        unsafe {
            product_parallel(
                (rows, inner, out),
                (dx.as_mut_ptr(), inner, accumulate),
                (g.as_ptr(), 1, out),
                (w.as_ptr(), 1, inner),
                scale,
            )
        };
    }
    let dw = match want_w {
        true => {
            let mut dw = zeroed(out * inner, "projection weight gradient")?;
            // SAFETY: ∂yᵀ is read from rows × out values with column stride `out`; x holds
            // rows × in; ∂W is out × in (checked above).
            unsafe {
                product_parallel(
                    (out, inner, rows),
                    (dw.as_mut_ptr(), inner, false),
                    (g.as_ptr(), out, 1),
                    (x.as_ptr(), 1, inner),
                    scale,
                )
            };
            Some(dw)
        }
        false => None,
    };
    let db = want_b.then(|| {
        let mut db = vec![0f32; out];
        for row in g[..rows * out].chunks_exact(out) {
            db.iter_mut().zip(row).for_each(|(s, g)| *s += g);
        }
        db.iter_mut().for_each(|s| *s *= scale);
        db
    });
    Ok((dw, db))
}

impl CustomOp2 for Node {
    fn name(&self) -> &'static str {
        "posenc-linear"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.forward((x, lx), (w, lw), None)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let [dx, dw, _] = self.backward(x, w, None, grad)?;
        Ok((dx, dw))
    }
}

impl CustomOp3 for Node {
    fn name(&self) -> &'static str {
        "posenc-linear-bias"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.forward((x, lx), (w, lw), Some((b, lb)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let [dx, dw, db] = self.backward(x, w, Some(b), grad)?;
        Ok((dx, dw, db))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Module};

    use super::*;

    /// The largest absolute difference of two tensors of one shape.
    fn max_diff(a: &Tensor, b: &Tensor) -> anyhow::Result<f32> {
        assert_eq!(a.dims(), b.dims());
        Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
    }

    fn max_abs(a: &Tensor) -> anyhow::Result<f32> {
        Ok(a.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
    }

    /// The node's output and its gradients to x, W and b (whichever track) equal candle's
    /// `Linear` followed by the same reshapes under candle's autograd, for every arrangement,
    /// with and without a bias, with a strided input, and with only some inputs tracking.
    #[test]
    fn equals_candle_autograd() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let (b, heads, d, inner) = (2, 3, 4, 7);
        let out = heads * d;
        // 10 rows (the output's columns computed) and 80 (its rows); a factor on the output
        // (the queries' softmax scale) or none.
        let cases = [5, 40]
            .into_iter()
            .flat_map(|t| [(t, false, 1.0), (t, true, 1.0), (t, true, 0.37)]);
        for (t, bias, scale) in cases {
            for (track_x, track_w) in [(true, true), (true, false), (false, true)] {
                for strided in [false, true] {
                    for arranged in 0..3 {
                        let xv = match strided {
                            false => crate::seeded::var_randn(0f32, 1.0, (b, t, inner), &dev)?,
                            true => crate::seeded::var_randn(0f32, 1.0, (t, b, inner), &dev)?,
                        };
                        let x = match (strided, track_x) {
                            (false, true) => xv.as_tensor().clone(),
                            (true, true) => xv.as_tensor().transpose(0, 1)?,
                            (false, false) => xv.as_tensor().detach(),
                            (true, false) => xv.as_tensor().detach().transpose(0, 1)?,
                        };
                        let w = crate::seeded::var_randn(0f32, 1.0, (out, inner), &dev)?;
                        let bv = crate::seeded::var_randn(0f32, 1.0, out, &dev)?;
                        let weight = match track_w {
                            true => w.as_tensor().clone(),
                            false => w.as_tensor().detach(),
                        };
                        let linear = Linear::new(weight, bias.then(|| bv.as_tensor().clone()));
                        let arrange = match arranged {
                            0 => Arrange::Rows(vec![b, t]),
                            1 => Arrange::Heads {
                                batch: b,
                                len: t,
                                heads,
                                head_dim: d,
                            },
                            _ => Arrange::Channels { batch: b, len: t },
                        };
                        let got = super::scaled(&linear, &x, arrange, scale as f32)?
                            .expect("f32 on the CPU");
                        let want = (linear.forward(&x)? * scale)?;
                        let want = match arranged {
                            0 => want,
                            1 => want.reshape((b, t, heads, d))?.transpose(1, 2)?,
                            _ => want.transpose(1, 2)?,
                        };
                        assert!(max_diff(&got, &want)? < 1e-5, "t {t} forward");
                        // A probe that is not all ones, so that each gradient mixes rows.
                        let probe = crate::seeded::randn(0f32, 1.0, got.shape(), &dev)?;
                        let g_got = (&got * &probe)?.sum_all()?.backward()?;
                        let g_want = (&want * &probe)?.sum_all()?.backward()?;
                        for (var, tracked) in [(&xv, track_x), (&w, track_w), (&bv, bias)] {
                            let (a, e) = (g_got.get(var), g_want.get(var));
                            match tracked {
                                true => {
                                    let (a, e) = (a.expect("a gradient"), e.expect("candle's"));
                                    // f32 sums over up to 80 rows in another order: 1e-5 of
                                    // the gradient's largest entry (at least 1).
                                    let bound = 1e-5 * max_abs(e)?.max(1.0);
                                    assert!(max_diff(a, e)? < bound, "t {t} bias {bias} x {track_x} w {track_w} strided {strided} arrangement {arranged}");
                                }
                                false => assert!(a.is_none() && e.is_none()),
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Where the node does not apply (another dtype, sizes that do not fit the arrangement)
    /// it answers `None`, and the caller keeps candle's `Linear`.
    #[test]
    fn declines_what_it_does_not_fit() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let linear = Linear::new(crate::seeded::randn(0f32, 1.0, (6, 4), &dev)?, None);
        let x = crate::seeded::randn(0f32, 1.0, (2, 3, 4), &dev)?;
        let half = Linear::new(linear.weight().to_dtype(DType::BF16)?, None);
        assert!(
            super::linear(&half, &x.to_dtype(DType::BF16)?, Arrange::Rows(vec![2, 3]))?.is_none()
        );
        assert!(super::linear(&linear, &x, Arrange::Rows(vec![3, 3]))?.is_none());
        let heads = |heads, head_dim| Arrange::Heads {
            batch: 2,
            len: 3,
            heads,
            head_dim,
        };
        assert!(super::linear(&linear, &x, heads(4, 2))?.is_none());
        assert!(super::linear(&linear, &x, heads(3, 2))?.is_some());
        for other in [(2, 3, 5), (2, 2, 6)] {
            let other = crate::seeded::randn(0f32, 1.0, other, &dev)?;
            assert!(super::linear(&linear, &other, Arrange::Rows(vec![2, 3]))?.is_none());
            assert!(super::linear(&linear, &other, heads(3, 2))?.is_none());
        }
        // Rows of one row's features spread over two axes, as the heads `(B, T, H, D)`.
        let split = x.reshape((2, 3, 2, 2))?;
        let y = super::linear(&linear, &split, Arrange::Rows(vec![2, 3]))?.expect("fits");
        assert!(max_diff(&y, &linear.forward(&x)?)? < 1e-6);
        Ok(())
    }
}
