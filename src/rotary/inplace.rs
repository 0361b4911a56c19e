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
/// `(B, T, H, D)` tensor by f32 cos/sin tables of shape `(T, half)` or `(B, T, half)`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RotateInPlace {
    pub(crate) pairs: RopeLayout,
    pub(crate) axes: QkLayout,
}

/// A value that is rotated in f32 (f64 data has its own row function).
trait Lane: Copy + Send + Sync {
    fn load(self) -> f32;
    fn store(v: f32) -> Self;
}

impl Lane for f32 {
    #[inline(always)]
    fn load(self) -> f32 {
        self
    }
    #[inline(always)]
    fn store(v: f32) -> Self {
        v
    }
}

impl Lane for bf16 {
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn store(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

impl Lane for f16 {
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn store(v: f32) -> Self {
        f16::from_f32(v)
    }
}

/// Rotates one head row `x` (`D` features) by `cos`/`sin` rows of `half` entries.
#[inline(always)]
fn rotate_row<T: Lane>(x: &mut [T], cos: &[f32], sin: &[f32], pairs: RopeLayout) {
    let half = cos.len();
    match pairs {
        RopeLayout::Half => {
            let (a, rest) = x.split_at_mut(half);
            let b = &mut rest[..half];
            for i in 0..half {
                let (xa, xb) = (a[i].load(), b[i].load());
                a[i] = T::store(xa * cos[i] - xb * sin[i]);
                b[i] = T::store(xa * sin[i] + xb * cos[i]);
            }
        }
        RopeLayout::Interleaved => {
            for (i, pair) in x[..2 * half].chunks_exact_mut(2).enumerate() {
                let (xa, xb) = (pair[0].load(), pair[1].load());
                pair[0] = T::store(xa * cos[i] - xb * sin[i]);
                pair[1] = T::store(xa * sin[i] + xb * cos[i]);
            }
        }
    }
}

fn rotate_row_f64(x: &mut [f64], cos: &[f32], sin: &[f32], pairs: RopeLayout) {
    let half = cos.len();
    let (c, s) = (|i: usize| cos[i] as f64, |i: usize| sin[i] as f64);
    match pairs {
        RopeLayout::Half => {
            for i in 0..half {
                let (xa, xb) = (x[i], x[i + half]);
                x[i] = xa * c(i) - xb * s(i);
                x[i + half] = xa * s(i) + xb * c(i);
            }
        }
        RopeLayout::Interleaved => {
            for i in 0..half {
                let (xa, xb) = (x[2 * i], x[2 * i + 1]);
                x[2 * i] = xa * c(i) - xb * s(i);
                x[2 * i + 1] = xa * s(i) + xb * c(i);
            }
        }
    }
}

/// Head rows handed to one parallel task.
const ROWS_PER_TASK: usize = 64;

/// Shapes of one call, read from the layouts.
struct Dims {
    /// Rows per batch item: `H·T` (heads first) or `T·H`.
    rows: usize,
    h: usize,
    t: usize,
    d: usize,
    half: usize,
    /// Whether the tables hold a separate `(T, half)` block per batch item.
    batched: bool,
}

impl RotateInPlace {
    fn dims(&self, l: &Layout, lc: &Layout) -> candle_core::Result<Dims> {
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
        let dims = self.dims(lx, lc)?;
        if ls.shape() != lc.shape() {
            candle_core::bail!(
                "rope in place: cos {:?} and sin {:?} differ",
                lc.shape(),
                ls.shape()
            );
        }
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
            CpuStorage::F64(v) => self.run(&mut v[start..end], &dims, |x, i| {
                let (c, s) = row(i);
                rotate_row_f64(x, c, s, pairs)
            }),
            other => candle_core::bail!("rope in place: unsupported dtype {:?}", other.dtype()),
        }
        Ok(())
    }
}
