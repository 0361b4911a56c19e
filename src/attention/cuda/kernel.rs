//! The fused attention kernels' host side: which blocks they take, their operands checked and
//! prepared ([`CudaCore::launch_op`]), and the compiled specialisations. The launch itself is
//! `launch.rs`; the kernels are `flash_forward.cu`.

use std::sync::Arc;

use candle_core::{DType, Tensor};

use super::CudaCore;
use crate::attention::fused_softmax::RowRule;
use crate::error::{Error, Result};
use crate::plug::Columns;

/// Head dimensions with a specialisation (multiples of 16; 128 keeps the accumulators in
/// registers).
pub(crate) const HEAD_DIMS: [usize; 4] = [32, 64, 96, 128];

/// Head dimensions of the f32 kernels. The forward's query tile of 64 rows and value tile of
/// 32 take (64 + 32) · (D + 8) · 4 bytes of the 48 KB of static shared memory, which 128 passes,
/// and at 96 ptxas spills registers (f32 fragments hold twice the bf16 ones'); the backward
/// takes 46,724 bytes at 64. Other f32 heads take candle's ops.
pub(crate) const F32_HEAD_DIMS: [usize; 2] = [32, 64];

/// The head dimensions the kernels have for operands of `dtype` (none for other dtypes).
pub(super) fn head_dims(dtype: DType) -> &'static [usize] {
    match dtype {
        DType::BF16 | DType::F16 => &HEAD_DIMS,
        DType::F32 => &F32_HEAD_DIMS,
        _ => &[],
    }
}

/// Additive terms one launch reads.
pub(super) const MAX_TERMS: usize = 4;

const FORWARD: &str = include_str!("flash_forward.cu");
pub(super) const FORWARD_ENTRY: &str = "posenc_flash_forward";
pub(super) const COMBINE_ENTRY: &str = "posenc_flash_combine";
pub(super) const DELTA_ENTRY: &str = "posenc_flash_delta";
pub(super) const BACKWARD_ENTRY: &str = "posenc_flash_backward";

/// Queries per thread block of the forward kernel (`BM`), and keys per block of the backward
/// (`BN`; the forward's key tiles are as many, or 32 with f32 operands, and key splits are
/// multiples of this).
pub(super) const TILE: usize = 64;

/// Whether the kernels can take a block of `q` (`(B, H, Tq, D)`), `k` and `v` as the block is
/// given: a bf16 or f16 block at a specialised head dimension, or an f32 block at one of
/// [`F32_HEAD_DIMS`], on a CUDA device of compute capability 8.0 or more, the head dimension
/// shared by q, k and v (not MLA's wider queries and keys), KV heads that divide the heads, at
/// least one key, at most 65,535 sequences and heads.
pub(crate) fn takes(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    let same = [k, v]
        .iter()
        .all(|t| t.dtype() == q.dtype() && t.device().same_device(q.device()));
    let (Ok((b, h, _, d)), Ok((kb, hkv, tk, kd))) = (q.dims4(), k.dims4()) else {
        return false;
    };
    let specialised = head_dims(q.dtype()).contains(&d);
    let shapes = kb == b && kd == d && v.dims() == k.dims() && hkv > 0 && h % hkv == 0 && tk > 0;
    specialised && same && shapes && b <= 65_535 && h <= 65_535 && capable(q)
}

/// Compute capability 8.0 or more.
fn capable(q: &Tensor) -> bool {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
    attribute(
        q,
        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
    )
    .is_some_and(|m| m >= 8)
}

/// An attribute of the CUDA device `t` is on.
fn attribute(
    t: &Tensor,
    which: candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute,
) -> Option<i32> {
    let candle_core::Device::Cuda(dev) = t.device() else {
        return None;
    };
    dev.cuda_stream().context().attribute(which).ok()
}

/// The multiprocessors of the CUDA device `q` is on (1 when the driver does not say).
fn multiprocessors(q: &Tensor) -> usize {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
    attribute(
        q,
        CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    )
    .map_or(1, |n| n.max(1) as usize)
}

/// How a launch shares out the keys: `(splits, keys per split)`. A few queries (one tile)
/// against many keys on fewer thread blocks than the GPU has multiprocessors split the keys
/// (flash-decoding), about two blocks per multiprocessor in all, each at least one tile of
/// keys; otherwise `(1, 0)`, one block per query tile with every key.
fn key_splits(blocks: usize, tq: usize, tk: usize, multiprocessors: usize) -> (usize, usize) {
    if tq > TILE || blocks >= multiprocessors || tk < 2 * TILE {
        return (1, 0);
    }
    let want = (2 * multiprocessors).div_ceil(blocks.max(1));
    let per = tk.div_ceil(want).next_multiple_of(TILE).max(TILE);
    match tk.div_ceil(per) {
        1 => (1, 0),
        splits => (splits, per),
    }
}

/// A tensor's last axis contiguous and its other strides and offset multiples of 8 elements
/// (the kernel reads rows in 16-byte pieces); otherwise a contiguous copy.
pub(super) fn rows_aligned(t: &Tensor) -> Result<Tensor> {
    let l = t.layout();
    let s = l.stride();
    let ok = s[3] == 1
        && s[..3].iter().all(|x| x.is_multiple_of(8))
        && l.start_offset().is_multiple_of(8);
    // force_contiguous: `contiguous` keeps a contiguous view whose offset is not aligned.
    Ok(if ok { t.clone() } else { t.force_contiguous()? })
}

impl CudaCore<'_> {
    /// Writes the block's attention into `out` (`(B, T, H, D)`, contiguous, the block's dtype)
    /// at rows `first_row..`.
    ///
    /// # Errors
    /// [`Error::Shape`], [`Error::DType`] or [`Error::Device`] for operands the kernel does not
    /// take (each names the operand and what was expected); [`Error::Kernel`] when the kernel
    /// fails to compile, load or launch.
    pub(crate) fn write_into(&self, out: &Tensor, first_row: usize) -> Result<()> {
        let op = self.launch_op(out, first_row)?;
        out.inplace_op1(&op)?;
        Ok(())
    }

    /// The launch that [`Self::write_into`] runs, its operands checked and prepared.
    pub(crate) fn launch_op(&self, out: &Tensor, first_row: usize) -> Result<LaunchOp> {
        self.check_qkv()?;
        self.check_output(out, first_row)?;
        let (b, h, tq, d) = self.q.dims4()?;
        let tk = self.k.dim(2)?;
        let rules = self.sinks.is_some()
            || self.rule.window.is_some()
            || self.rule.chunk.is_some()
            || self.rule.softcap.is_some()
            || self.padding.is_some()
            || self.dense_masks;
        let (splits, key_split) = match super::proven_split(rules) {
            true => key_splits(b * h, tq, tk, multiprocessors(self.q)),
            false => (1, 0),
        };
        let partial = match splits {
            1 => None,
            _ => Some(Tensor::zeros(
                (b, h, splits, tq, d + 2),
                DType::F32,
                self.q.device(),
            )?),
        };
        Ok(LaunchOp {
            values: self.value_operand((b, tq, tk, d))?,
            splits,
            key_split,
            partial,
            q: rows_aligned(self.q)?,
            k: rows_aligned(self.k)?,
            v: rows_aligned(self.v)?,
            terms: self.terms((b, h, tq, tk))?,
            padding: self.padding_operand(b, tk)?,
            sinks: self.sinks_operand(h)?,
            skip: self.padding.is_none() && !self.dense_masks,
            rule: self.rule.clone(),
            first_row,
            stats: None,
            value_weights: None,
            backward: None,
        })
    }

    /// Queries, keys and values as the kernels take them: one dtype of bf16, f16 or f32, a
    /// specialised head dimension, grouped KV heads, at least one key, one device.
    fn check_qkv(&self) -> Result<()> {
        let (b, h, tq, d) = self.q.dims4()?;
        let (kb, hkv, tk, kd) = self.k.dims4()?;
        if kb != b || kd != d || hkv == 0 || h % hkv != 0 || self.v.dims() != self.k.dims() {
            return Err(Error::shape(
                "keys and values of the CUDA attention kernel",
                format!("({b}, a divisor of {h}, keys, {d}) for both"),
                self.k.shape(),
            ));
        }
        // Other dtypes are refused by name below.
        let dims = match head_dims(self.q.dtype()) {
            [] => &HEAD_DIMS[..],
            dims => dims,
        };
        if !dims.contains(&d) || b > 65_535 || h > 65_535 {
            return Err(Error::shape(
                "queries of the CUDA attention kernel",
                format!("(≤ 65535, ≤ 65535, queries, one of {dims:?})"),
                self.q.shape(),
            ));
        }
        for (what, t) in [
            ("keys of the CUDA attention kernel", self.k),
            ("values of the CUDA attention kernel", self.v),
        ] {
            if t.dtype() != self.q.dtype() {
                return Err(Error::DType {
                    what,
                    expected: "the queries' dtype",
                    got: t.dtype(),
                });
            }
            crate::error::check_device(what, t, self.q.device())?;
        }
        if !matches!(self.q.dtype(), DType::BF16 | DType::F16 | DType::F32) {
            return Err(Error::DType {
                what: "queries of the CUDA attention kernel",
                expected: "bf16, f16 or f32",
                got: self.q.dtype(),
            });
        }
        let fits = |n: usize| i32::try_from(n).is_ok();
        if !fits(tq) || !fits(tk) || !fits(h / hkv) {
            return Err(Error::shape(
                "queries and keys of the CUDA attention kernel",
                "fewer than 2^31 of each",
                self.k.shape(),
            ));
        }
        if tk == 0 {
            return Err(Error::shape(
                "keys of the CUDA attention kernel",
                "at least one key",
                self.k.shape(),
            ));
        }
        Ok(())
    }

    /// The merged output: contiguous `(B, ≥ first_row + Tq, H, D)` in the queries' dtype, on
    /// their device.
    fn check_output(&self, out: &Tensor, first_row: usize) -> Result<()> {
        let what = "output of the CUDA attention kernel";
        let (b, h, tq, d) = self.q.dims4()?;
        let (ob, rows, oh, od) = out.dims4()?;
        if (ob, oh, od) != (b, h, d) || rows < first_row + tq || !out.is_contiguous() {
            return Err(Error::shape(
                what,
                format!("contiguous ({b}, ≥ {}, {h}, {d})", first_row + tq),
                out.shape(),
            ));
        }
        if out.dtype() != self.q.dtype() {
            return Err(Error::DType {
                what,
                expected: "the queries' dtype",
                got: out.dtype(),
            });
        }
        crate::error::check_device(what, out, self.q.device())
    }

    /// The padding mask as the kernel reads it: contiguous `(1 or B, Tk)` u8.
    fn padding_operand(&self, b: usize, tk: usize) -> Result<Option<Tensor>> {
        let Some(p) = self.padding else {
            return Ok(None);
        };
        let what = "padding mask of the CUDA attention kernel";
        crate::error::check_device(what, p, self.q.device())?;
        if p.dtype() != DType::U8 {
            return Err(Error::DType {
                what,
                expected: "u8 (non-zero = keep)",
                got: p.dtype(),
            });
        }
        let p = p.contiguous()?;
        let (pb, ptk) = p.dims2()?;
        if (pb != 1 && pb != b) || ptk != tk {
            return Err(Error::shape(what, format!("(1 or {b}, {tk})"), p.shape()));
        }
        Ok(Some(p))
    }

    /// The sinks as the kernel reads them: contiguous `(H)` f32.
    fn sinks_operand(&self, h: usize) -> Result<Option<Tensor>> {
        let Some(s) = self.sinks else {
            return Ok(None);
        };
        let what = "sinks of the CUDA attention kernel";
        crate::error::check_device(what, s, self.q.device())?;
        let s = s.to_dtype(DType::F32)?.contiguous()?;
        if s.dims() != [h] {
            return Err(Error::shape(what, format!("({h})"), s.shape()));
        }
        Ok(Some(s))
    }

    /// A value term's `(W, D)` f32 table and its clamped shift.
    fn value_operand(
        &self,
        (b, tq, tk, d): (usize, usize, usize, usize),
    ) -> Result<Option<(Tensor, i64)>> {
        let Some(v) = self.values else {
            return Ok(None);
        };
        let what = "value term of the CUDA attention kernel";
        let shift = shift_of(v.columns(), what, v.table())?;
        crate::error::check_device(what, v.table(), self.q.device())?;
        v.check_block(b, tq, tk, d)?;
        let table = v.table().to_dtype(DType::F32)?.contiguous()?;
        let width = table.dim(0)?;
        Ok(Some((table, clamped_shift(shift, tq, tk, width))))
    }

    /// The terms as f32 tensors on the block's device, with their broadcast strides.
    fn terms(&self, (b, h, tq, tk): (usize, usize, usize, usize)) -> Result<Vec<KernelTerm>> {
        let mut terms = Vec::new();
        for t in self.dense {
            crate::error::check_device(
                "dense term of the CUDA attention kernel",
                t,
                self.q.device(),
            )?;
            let t = unbroadcast(t)?.to_dtype(DType::F32)?;
            let t = t.broadcast_as((b, h, tq, tk)).map_err(|_| {
                Error::shape(
                    "dense term of the CUDA attention kernel",
                    format!("a shape broadcastable to ({b}, {h}, {tq}, {tk})"),
                    t.shape(),
                )
            })?;
            terms.push((t, None));
        }
        for r in self.relative {
            let what = "relative term of the CUDA attention kernel";
            let rows = r.values()?;
            let shift = shift_of(r.columns(), what, &rows)?;
            crate::error::check_device(what, &rows, self.q.device())?;
            r.check_block((b, h, tq, tk))?;
            let width = r.width();
            let values = rows.to_dtype(DType::F32)?.contiguous()?;
            let values = values.broadcast_as((b, h, tq, width))?;
            terms.push((values, Some((clamped_shift(shift, tq, tk, width), width))));
        }
        if terms.len() > MAX_TERMS {
            return Err(Error::config(
                "additive terms",
                terms.len(),
                format!("at most {MAX_TERMS} for the CUDA attention kernel"),
            ));
        }
        Ok(terms)
    }
}

/// The shift of a relative term's columns, or [`Error::Shape`] naming `what` for an index map
/// (the fused paths expand bias maps first; value maps take candle's ops).
fn shift_of(columns: &Columns, what: &'static str, table: &Tensor) -> Result<i64> {
    match columns {
        Columns::Shift(shift) => Ok(*shift),
        Columns::Index(_) => Err(Error::shape(
            what,
            "columns read through a shift, not an index map",
            table.shape(),
        )),
    }
}

/// `shift` clamped to ±(Tq + Tk + W): any shift past that reads the same clamped columns of
/// `W`, and the kernel's `j − i + shift` then cannot overflow.
fn clamped_shift(shift: i64, tq: usize, tk: usize, width: usize) -> i64 {
    let reach = (tq + tk + width) as i64;
    shift.clamp(-reach, reach)
}

/// `t` without its broadcast axes (stride 0, size above 1) narrowed to one, so that a cast
/// copies only the values it holds: a user's `(1, 1, T, Tk)` mask seen as `(B, H, T, Tk)`
/// stays `T × Tk` values, not the logits' size.
fn unbroadcast(t: &Tensor) -> Result<Tensor> {
    let mut t = t.clone();
    for axis in 0..t.rank() {
        if t.layout().stride()[axis] == 0 && t.dim(axis)? > 1 {
            t = t.narrow(axis, 0, 1)?;
        }
    }
    Ok(t)
}

/// An additive term on the device in f32, broadcast to the block, with `(shift, width)` when
/// it is relative.
type KernelTerm = (Tensor, Option<(i64, usize)>);

/// The launch, as an in-place op on the merged output (or, with `backward`, on dQ).
#[derive(Clone)]
pub(crate) struct LaunchOp {
    /// A value term's `(W, D)` f32 table and its shift.
    pub(crate) values: Option<(Tensor, i64)>,
    /// Key splits (1: none) and keys per split.
    pub(crate) splits: usize,
    pub(crate) key_split: usize,
    /// `(B, H, splits, Tq, D + 2)` f32: each split's unnormalised output, maximum and sum.
    pub(crate) partial: Option<Tensor>,
    pub(crate) q: Tensor,
    pub(crate) k: Tensor,
    pub(crate) v: Tensor,
    pub(crate) terms: Vec<KernelTerm>,
    pub(crate) padding: Option<Tensor>,
    pub(crate) sinks: Option<Tensor>,
    pub(crate) skip: bool,
    pub(crate) rule: RowRule,
    pub(crate) first_row: usize,
    /// `(B, H, out_rows, 2)` f32: each row's maximum and inverse sum, for the backward.
    pub(crate) stats: Option<Tensor>,
    /// `(B, H, Tq, W)` f32, zeroed: the weights each column of the value term gathers, for
    /// its table's gradient (the forward writes the end columns, the backward the others);
    /// training only, with one split.
    pub(crate) value_weights: Option<Tensor>,
    /// Set: the op launches the backward (on dQ) instead of the forward.
    pub(crate) backward: Option<BackwardBuffers>,
}

/// What the backward reads and writes besides the forward's operands; dQ is the op's target.
#[derive(Clone)]
pub(crate) struct BackwardBuffers {
    /// The forward's output `(B, Tq, H, D)` and its gradient, in the block's dtype.
    pub out: Tensor,
    pub d_out: Tensor,
    /// `(B, H, Tq)` f32.
    pub delta: Tensor,
    /// `(B, Hkv, Tk, D)` f32, written whole.
    pub dk: Tensor,
    pub dv: Tensor,
    /// `(H)` f32, zeroed, when the sinks take a gradient.
    pub dsinks: Option<Tensor>,
    /// One per term of the launch, in its order (dense, then relative): f32, zeroed, the
    /// term's own dims left-padded to four axes, when the term takes a gradient.
    pub term_grads: Vec<Option<Tensor>>,
    /// `(B, H, Tq, W)` f32, contiguous: `dO_i · a[c]` for each column of the value term, when
    /// there is one.
    pub value_dp: Option<Tensor>,
}

/// A specialisation's name, as errors give it.
pub(super) fn label(d: usize, dtype: DType, values: bool) -> String {
    let values = if values { " values" } else { "" };
    format!("{FORWARD_ENTRY} d{d} {}{values}", dtype.as_str())
}

/// The -D options of a forward specialisation (`.ci/cuda-kernels.py` passes the same).
fn forward_defines(d: usize, dtype: DType, values: bool) -> Vec<String> {
    vec![
        format!("-DPOSENC_HEAD_DIM={d}"),
        format!("-DPOSENC_BF16={}", u8::from(dtype == DType::BF16)),
        format!("-DPOSENC_F32={}", u8::from(dtype == DType::F32)),
        format!("-DPOSENC_VALUES={}", u8::from(values)),
    ]
}

/// The PTX of the forward kernel for head dimension `d`, `dtype` and whether it reads a value
/// term.
pub(super) fn ptx(d: usize, dtype: DType, values: bool) -> Result<Arc<str>> {
    let defines = forward_defines(d, dtype, values);
    crate::cuda::nvrtc::ptx(
        "flash_forward.cu",
        FORWARD,
        defines,
        &label(d, dtype, values),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Decoding splits its keys into whole tiles, about two thread blocks per multiprocessor;
    /// many blocks, many queries or few keys do not split.
    #[test]
    fn cuda_key_splits() {
        // One query, 16 heads, 16384 keys on 132 multiprocessors: 16 splits of 1024 keys.
        let (splits, per) = key_splits(16, 1, 16384, 132);
        assert_eq!((splits, per), (16, 1024));
        assert!(per % TILE == 0 && splits * per >= 16384 && (splits - 1) * per < 16384);
        assert_eq!(key_splits(16 * 132, 1, 16384, 132), (1, 0));
        assert_eq!(key_splits(16, 65, 16384, 132), (1, 0));
        assert_eq!(key_splits(16, 1, 100, 132), (1, 0));
        // Every split holds at least one tile.
        let (splits, per) = key_splits(1, 1, 200, 132);
        assert_eq!(per, TILE);
        assert_eq!(splits, 4);
    }

    /// Every specialisation compiles with NVRTC (no GPU needed for this step, but NVRTC's
    /// library must be found: it runs with the `cuda::` tests on a GPU machine).
    #[test]
    fn cuda_specialisations_compile() -> Result<()> {
        let specs = [DType::BF16, DType::F16, DType::F32]
            .into_iter()
            .flat_map(|dtype| head_dims(dtype).iter().map(move |&d| (d, dtype)));
        for (d, dtype) in specs {
            for values in [false, true] {
                let ptx = ptx(d, dtype, values)?;
                assert!(ptx.contains(FORWARD_ENTRY), "{}", label(d, dtype, values));
            }
        }
        Ok(())
    }
}
