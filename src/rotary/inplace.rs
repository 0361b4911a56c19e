//! In-place rotation on the CPU: one pass that reads and writes each rotated feature once,
//! without allocating an output, and skipping the features partial rotary leaves alone.
//!
//! candle's fused `rope` allocates a fresh output per call, and on the CPU most of its time goes
//! to faulting in those pages; rotating freshly projected q and k where they lie avoids that.
//! bf16/f16 values are rotated in f32 and rounded once. Other devices use the out-of-place
//! kernels (see [`RotaryEmbedding::rotate_queries_keys_owned`](super::RotaryEmbedding)).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, InplaceOp3, Layout};
use half::{bf16, f16};
use rayon::prelude::*;

use super::{QkLayout, RopeLayout};

/// Rotates the first `2 · half` features of every head of a contiguous `(B, H, T, D)` or
/// `(B, T, H, D)` tensor by f32 cos/sin tables of shape `(T, half)` or `(B, T, half)`; on a
/// CUDA device (the `cuda` feature) by `rope_in_place.cu`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RotateInPlace {
    pub(crate) pairs: RopeLayout,
    pub(crate) axes: QkLayout,
    /// Rotate by −θ (the backward of a rotation): the CUDA kernel's `sin_sign` of −1. The CPU
    /// path rotates forwards only.
    pub(crate) inverse: bool,
}

/// A stored value and the type it is rotated in: f32 for f32/bf16/f16, f64 for f64.
trait Lane: Copy + Send + Sync {
    type Acc: Copy
        + From<f32>
        + std::ops::Add<Output = Self::Acc>
        + std::ops::Sub<Output = Self::Acc>
        + std::ops::Mul<Output = Self::Acc>;
    fn load(self) -> Self::Acc;
    fn store(v: Self::Acc) -> Self;
}

macro_rules! lane {
    ($t:ty, $acc:ty, $load:expr, $store:expr) => {
        impl Lane for $t {
            type Acc = $acc;
            #[inline(always)]
            fn load(self) -> $acc {
                $load(self)
            }
            #[inline(always)]
            fn store(v: $acc) -> Self {
                $store(v)
            }
        }
    };
}

lane!(f32, f32, |x| x, |v| v);
lane!(f64, f64, |x| x, |v| v);
lane!(bf16, f32, bf16::to_f32, bf16::from_f32);
lane!(f16, f32, f16::to_f32, f16::from_f32);

/// Rotates one head row `x` (`D` features) by `cos`/`sin` rows of `half` entries.
#[inline(always)]
fn rotate_row<T: Lane>(x: &mut [T], cos: &[f32], sin: &[f32], pairs: RopeLayout) {
    let half = cos.len();
    let rotate = |xa: T, xb: T, i: usize| {
        let (xa, xb) = (xa.load(), xb.load());
        let (c, s) = (T::Acc::from(cos[i]), T::Acc::from(sin[i]));
        (T::store(xa * c - xb * s), T::store(xa * s + xb * c))
    };
    match pairs {
        RopeLayout::Half => {
            let (a, rest) = x.split_at_mut(half);
            for (i, (xa, xb)) in a.iter_mut().zip(&mut rest[..half]).enumerate() {
                (*xa, *xb) = rotate(*xa, *xb, i);
            }
        }
        RopeLayout::Interleaved => {
            for (i, pair) in x[..2 * half].chunks_exact_mut(2).enumerate() {
                (pair[0], pair[1]) = rotate(pair[0], pair[1], i);
            }
        }
    }
}

/// Head rows handed to one parallel task.
const ROWS_PER_TASK: usize = 64;

/// Shapes of one call, read from the layouts.
pub(crate) struct Dims {
    /// Rows per batch item: `H·T` (heads first) or `T·H`.
    pub(crate) rows: usize,
    pub(crate) h: usize,
    pub(crate) t: usize,
    pub(crate) d: usize,
    pub(crate) half: usize,
    /// Whether the tables hold a separate `(T, half)` block per batch item.
    pub(crate) batched: bool,
}

impl RotateInPlace {
    /// The call's shapes from the layouts of `x`, cos and sin (which must agree).
    pub(crate) fn dims(&self, l: &Layout, lc: &Layout, ls: &Layout) -> candle_core::Result<Dims> {
        if ls.shape() != lc.shape() {
            candle_core::bail!(
                "rope in place: cos {:?} and sin {:?} differ",
                lc.shape(),
                ls.shape()
            );
        }
        let (b, a1, a2, d) = l.shape().dims4()?;
        let (h, t) = match self.axes {
            QkLayout::Bhtd => (a1, a2),
            QkLayout::Bthd => (a2, a1),
        };
        let (batched, tt, half) = match lc.shape().dims() {
            [tt, half] => (false, *tt, *half),
            [bb, tt, half] if *bb == b => (true, *tt, *half),
            other => candle_core::bail!(
                "rope in place: cos/sin {other:?} do not fit {:?}",
                l.shape()
            ),
        };
        if tt != t || 2 * half > d {
            candle_core::bail!(
                "rope in place: cos/sin {:?} do not fit {:?}",
                lc.shape(),
                l.shape()
            );
        }
        Ok(Dims {
            rows: h * t,
            h,
            t,
            d,
            half,
            batched,
        })
    }

    /// Applies `rotate(row, table_row)` to every head row, in parallel over batch items and rows.
    fn run<T: Send>(&self, data: &mut [T], dims: &Dims, rotate: impl Fn(&mut [T], usize) + Sync) {
        let Dims {
            rows,
            h,
            t,
            d,
            batched,
            ..
        } = *dims;
        let axes = self.axes;
        data.par_chunks_mut(d * ROWS_PER_TASK)
            .enumerate()
            .for_each(|(chunk_i, chunk)| {
                for (j, row) in chunk.chunks_exact_mut(d).enumerate() {
                    let r = chunk_i * ROWS_PER_TASK + j; // global row index
                    let (bi, within) = (r / rows, r % rows);
                    let ti = match axes {
                        QkLayout::Bhtd => within % t,
                        QkLayout::Bthd => within / h,
                    };
                    let table_row = if batched { bi * t + ti } else { ti };
                    rotate(row, table_row);
                }
            });
    }
}

fn contiguous<'a, T>(data: &'a [T], l: &Layout, what: &str) -> candle_core::Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("rope in place: {what} must be contiguous"),
    }
}

impl InplaceOp3 for RotateInPlace {
    fn name(&self) -> &'static str {
        "posenc-rope-inplace"
    }

    fn cpu_fwd(
        &self,
        x: &mut CpuStorage,
        lx: &Layout,
        cos: &CpuStorage,
        lc: &Layout,
        sin: &CpuStorage,
        ls: &Layout,
    ) -> candle_core::Result<()> {
        if self.inverse {
            candle_core::bail!("rope in place: the CPU path rotates forwards only");
        }
        let dims = self.dims(lx, lc, ls)?;
        let (CpuStorage::F32(cos), CpuStorage::F32(sin)) = (cos, sin) else {
            candle_core::bail!("rope in place: cos/sin must be f32 tables");
        };
        let cos = contiguous(cos, lc, "cos")?;
        let sin = contiguous(sin, ls, "sin")?;
        let Some((start, end)) = lx.contiguous_offsets() else {
            candle_core::bail!("rope in place: the rotated tensor must be contiguous");
        };
        let half = dims.half;
        let row = |i: usize| {
            (
                &cos[i * half..(i + 1) * half],
                &sin[i * half..(i + 1) * half],
            )
        };
        let pairs = self.pairs;
        macro_rules! lanes {
            ($v:expr) => {{
                self.run(&mut $v[start..end], &dims, |x, i| {
                    let (c, s) = row(i);
                    rotate_row(x, c, s, pairs)
                });
            }};
        }
        match x {
            CpuStorage::F32(v) => lanes!(v),
            CpuStorage::BF16(v) => lanes!(v),
            CpuStorage::F16(v) => lanes!(v),
            CpuStorage::F64(v) => lanes!(v),
            other => candle_core::bail!("rope in place: unsupported dtype {:?}", other.dtype()),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &mut candle_core::CudaStorage,
        lx: &Layout,
        cos: &candle_core::CudaStorage,
        lc: &Layout,
        sin: &candle_core::CudaStorage,
        ls: &Layout,
    ) -> candle_core::Result<()> {
        let dims = self.dims(lx, lc, ls)?;
        let rotation = crate::cuda::rope::Rotation {
            rows: dims.rows,
            heads: dims.h,
            len: dims.t,
            dim: dims.d,
            half: dims.half,
            batched: dims.batched,
            interleaved: self.pairs == RopeLayout::Interleaved,
            heads_first: self.axes == QkLayout::Bhtd,
            inverse: self.inverse,
        };
        crate::cuda::rope::rotate(&rotation, x, lx, (cos, lc), (sin, ls))
    }
}
