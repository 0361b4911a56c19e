//! Root-mean-square normalisation with a learned gain (Zhang & Sennrich 2019), one CPU pass
//! forward and one backward for f32.
//!
//! ```text
//! y = x / s · w,        s = √(mean(x²) + ε)                     (per row of the last axis)
//! n = x / s,  dn = dy · w:   dx = (dn − n · mean(dn · n)) / s,   dw = Σ_rows dy · n
//! ```
//!
//! From candle's ops it is six tensors per call (square, mean, add, square root, divide,
//! multiply), each with its own gradient zero-filled and added in the backward; here it is one
//! node. Other dtypes and devices use the ops.
//!
//! # Shapes
//! `x`: `(…, d)`, `w`: `(d)` → `(…, d)`.

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor, D};

use super::gelu::values;

/// The ε under the square root.
pub const EPS: f32 = 1e-5;

/// `x / √(mean(x²) + ε) · w` over the last axis.
pub fn rms_norm(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let fast = x.device().is_cpu() && x.dtype() == DType::F32 && w.dtype() == DType::F32;
    if fast && w.dims() == [x.dim(D::Minus1)?] {
        return x.contiguous()?.apply_op2(&w.contiguous()?, RmsNorm);
    }
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + f64::from(EPS))?.sqrt()?)?
        .broadcast_mul(w)
}

/// The forward op.
struct RmsNorm;

/// `(dx, dw)` from `(x, w, dy)`, packed as `rows + 1` rows of `d` (the last one `dw`).
struct RmsNormGrad;

/// `1 / s` of a row.
#[inline(always)]
fn inverse_scale(x: &[f32]) -> f32 {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    1.0 / (ms + EPS).sqrt()
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "lm-rms-norm"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, w) = (values(xs, xl)?, values(ws, wl)?);
        let d = w.len();
        if d == 0 || x.len() % d != 0 {
            candle_core::bail!("rms_norm: rows of {d} values were expected");
        }
        let mut y = vec![0f32; x.len()];
        for (yr, xr) in y.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
            let inv = inverse_scale(xr);
            for ((y, x), w) in yr.iter_mut().zip(xr).zip(w) {
                *y = x * inv * w;
            }
        }
        Ok((CpuStorage::F32(y), xl.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let d = w.elem_count();
        let rows = x.elem_count() / d.max(1);
        let packed = x
            .detach()
            .apply_op3(&w.detach(), &dy.contiguous()?, RmsNormGrad)?;
        let dx = packed.narrow(0, 0, rows)?.reshape(x.shape())?;
        let dw = packed.narrow(0, rows, 1)?.reshape(w.shape())?;
        Ok((Some(dx), Some(dw)))
    }
}

impl CustomOp3 for RmsNormGrad {
    fn name(&self) -> &'static str {
        "lm-rms-norm-grad"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, w, g) = (values(xs, xl)?, values(ws, wl)?, values(gs, gl)?);
        let d = w.len();
        if d == 0 || x.len() % d != 0 || g.len() != x.len() {
            candle_core::bail!("rms_norm backward: rows of {d} values were expected");
        }
        let rows = x.len() / d;
        let mut out = vec![0f32; (rows + 1) * d];
        let (dx, dw) = out.split_at_mut(rows * d);
        for ((dxr, xr), gr) in dx
            .chunks_exact_mut(d)
            .zip(x.chunks_exact(d))
            .zip(g.chunks_exact(d))
        {
            let inv = inverse_scale(xr);
            let mut dot = 0f32;
            for ((x, g), w) in xr.iter().zip(gr).zip(w) {
                dot += g * w * x * inv;
            }
            let mean = dot / d as f32;
            for (((dx, x), g), (w, dw)) in dxr
                .iter_mut()
                .zip(xr)
                .zip(gr)
                .zip(w.iter().zip(dw.iter_mut()))
            {
                let n = x * inv;
                *dx = (g * w - n * mean) * inv;
                *dw += g * n;
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((rows + 1, d))))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;

    /// Values and the gradients of x and w against the same norm from candle's ops.
    #[test]
    fn equals_candle_ops() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        // Inputs fixed, not drawn: the same values on every run.
        let wave = |n: usize, f: f64, phase: f64| -> candle_core::Result<Tensor> {
            (Tensor::arange(0f32, n as f32, &dev)?.affine(f, phase)?).sin()
        };
        let x = Var::from_tensor(&(wave(3 * 5 * 64, 0.37, 0.0)?.reshape((3, 5, 64))? * 3.0)?)?;
        let w = Var::from_tensor(&(wave(64, 1.3, 0.5)?.affine(0.5, 1.0))?)?;
        let probe = wave(3 * 5 * 64, 0.71, 1.0)?.reshape((3, 5, 64))?;
        let ours = rms_norm(x.as_tensor(), w.as_tensor())?;
        let ms = x.as_tensor().sqr()?.mean_keepdim(D::Minus1)?;
        let theirs = x
            .as_tensor()
            .broadcast_div(&(ms + f64::from(EPS))?.sqrt()?)?
            .broadcast_mul(w.as_tensor())?;
        let close = |a: &Tensor, b: &Tensor, what: &str| -> candle_core::Result<()> {
            let diff = (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            let top = b.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            assert!(diff <= 1e-6 * top.max(1.0), "{what}: {diff:e}");
            Ok(())
        };
        close(&ours, &theirs, "values")?;
        let g_ours = (ours * &probe)?.sum_all()?.backward()?;
        let g_theirs = (theirs * &probe)?.sum_all()?.backward()?;
        for (v, what) in [(&x, "dx"), (&w, "dw")] {
            let (a, b) = (
                g_ours.get(v.as_tensor()).expect("a gradient"),
                g_theirs.get(v.as_tensor()).expect("a gradient"),
            );
            close(a, b, what)?;
        }
        Ok(())
    }
}
