//! The fused attention core on CUDA devices (the `cuda` feature): `flash_forward.cu`, a
//! FlashAttention-2 forward on tensor cores for bf16 and f16 blocks (and f32 blocks at
//! [`F32_HEAD_DIMS`], each product as three TF32 ones), reading the plug's terms as
//! data (dense terms through broadcast strides, relative rows through a shift), causal limits,
//! windows, chunks, padding, soft caps, sinks and grouped KV heads. For training, its backward
//! (`posenc_flash_backward`, through `training.rs`) gives q, k, v, the sinks, every term
//! (dense or relative rows) and a value term's table their gradients.
//!
//! **Off by default.** The kernels are compiled (NVRTC, every specialisation,
//! `.ci/cuda-kernels`) and run against f64 on a CPU emulator (`tests/cuda_emulator`,
//! `.ci/cuda-emulate`). On an H100 (docs/gpu.md) they matched the f64 block for every encoding,
//! forward and backward, with no memcheck error and no racecheck hazard, and ran 3–30× faster
//! than candle's ops; one case still failed there (decoding with ALiBi after 600 cached keys),
//! so they stay off until it is explained. [`set_fused_kernel`] (or
//! `CANDLE_POSENC_CUDA_KERNEL=1` in the environment) turns them on; otherwise a CUDA block runs
//! on candle's ops.
//!
//! Compiled with NVRTC at first use, one module per head dimension and dtype, cached per
//! process (the PTX) and per device (the module, by candle's `get_or_load_custom_func`).
//! NVRTC rather than nvcc in `build.rs`: the crate's build stays free of a CUDA toolchain
//! beyond what candle's kernels already need, and the PTX targets the GPU at hand.
//!
//! ```text
//! out[b, first_row + i, h, :] = softmax_j(cap·tanh(q_i·k_j / cap) + Σ terms, hidden → −max) v
//! grid (⌈Tq / 64⌉, H, B), 128 threads; see flash_forward.cu for the schedule
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use candle_core::cuda_backend::CudaStorage;
use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Storage, Tensor};
use half::{bf16, f16};

pub(crate) mod training;

use super::fused_softmax::RowRule;
use crate::error::{Error, Result};
use crate::plug::{Columns, RelativeBias};

/// The virtual architecture the kernels are compiled for: `mma.m16n8k16` with bf16 operands,
/// `ldmatrix` and `cvt.rn.bf16x2` need sm_80 (A100, H100, H200 and later).
pub(crate) const ARCH: &str = "compute_80";

/// Head dimensions with a specialisation (multiples of 16; 128 keeps the accumulators in
/// registers).
pub(crate) const HEAD_DIMS: [usize; 4] = [32, 64, 96, 128];

/// Head dimensions of the f32 kernels. The forward's query tile of 64 rows and value tile of
/// 32 take (64 + 32) · (D + 8) · 4 bytes of the 48 KB of static shared memory, which 128 passes,
/// and at 96 ptxas spills registers (f32 fragments hold twice the bf16 ones'); the backward
/// takes 46,724 bytes at 64. Other f32 heads take candle's ops.
pub(crate) const F32_HEAD_DIMS: [usize; 2] = [32, 64];

/// The head dimensions the kernels have for operands of `dtype` (none for other dtypes).
fn head_dims(dtype: DType) -> &'static [usize] {
    match dtype {
        DType::BF16 | DType::F16 => &HEAD_DIMS,
        DType::F32 => &F32_HEAD_DIMS,
        _ => &[],
    }
}

/// Additive terms one launch reads.
const MAX_TERMS: usize = 4;

const FORWARD: &str = include_str!("flash_forward.cu");
const FORWARD_ENTRY: &str = "posenc_flash_forward";
const COMBINE_ENTRY: &str = "posenc_flash_combine";
const DELTA_ENTRY: &str = "posenc_flash_delta";
const BACKWARD_ENTRY: &str = "posenc_flash_backward";

/// Queries per thread block of the forward kernel (`BM`), and keys per block of the backward
/// (`BN`; the forward's key tiles are as many, or 32 with f32 operands, and key splits are
/// multiples of this).
const TILE: usize = 64;

/// 0: not yet read from the environment; 1: off; 2: on.
static ENABLED: AtomicU8 = AtomicU8::new(0);

thread_local! {
    /// Launches of the crate's CUDA kernels by this thread's calls.
    static LAUNCHES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many times the crate's CUDA kernels (the fused attention's query blocks, rotations in
/// place) have run for calls made on this thread: a test or a user can tell that a block took
/// them, whatever other threads do (kernels are launched on the calling thread).
pub fn kernel_launches() -> u64 {
    LAUNCHES.with(std::cell::Cell::get)
}

/// Counts one launch ([`kernel_launches`]).
pub(crate) fn count_launch() {
    LAUNCHES.with(|n| n.set(n.get() + 1));
}

/// Turns the fused CUDA kernel on or off for every block in this process (default: off, or
/// on when `CANDLE_POSENC_CUDA_KERNEL=1` is set). It is experimental: see the module docs for
/// what an H100 run showed.
pub fn set_fused_kernel(on: bool) {
    ENABLED.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

thread_local! {
    /// This thread's [`FusedKernelScope`], if any.
    static SCOPED: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// The fused CUDA kernel on or off for the calls this thread makes while the value lives, in
/// place of [`set_fused_kernel`]'s process-wide setting (scopes nest; dropping one restores
/// what was in force when it was taken). The block chooses its path on the calling thread.
#[derive(Debug)]
#[must_use = "the setting holds only while the scope lives"]
pub struct FusedKernelScope {
    previous: Option<bool>,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl FusedKernelScope {
    /// The kernel `on` (or off) on this thread until the scope is dropped.
    pub fn new(on: bool) -> Self {
        let previous = SCOPED.with(|s| s.replace(Some(on)));
        Self {
            previous,
            _not_send: std::marker::PhantomData,
        }
    }
}

impl Drop for FusedKernelScope {
    fn drop(&mut self) {
        SCOPED.with(|s| s.set(self.previous));
    }
}

/// Whether the fused CUDA kernel is on: this thread's [`FusedKernelScope`] if it has one, else
/// [`set_fused_kernel`]'s setting.
pub fn fused_kernel() -> bool {
    if let Some(on) = SCOPED.with(std::cell::Cell::get) {
        return on;
    }
    match ENABLED.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var("CANDLE_POSENC_CUDA_KERNEL").is_ok_and(|v| v == "1");
            set_fused_kernel(on);
            on
        }
        state => state == 2,
    }
}

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

/// One additive term as the kernel reads it; field for field `Term` in flash_forward.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Term {
    values: u64,
    strides: [i64; 4],
    shift: i64,
    width: i64,
    /// The backward's: the term's f32 gradient (0: none) and its strides, 0 along an axis the
    /// term broadcasts.
    grad: u64,
    grad_strides: [i64; 4],
}

/// Everything a launch reads; field for field `Params` in flash_forward.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Params {
    q: u64,
    k: u64,
    v: u64,
    out: u64,
    stats: u64,
    padding: u64,
    sinks: u64,
    partial: u64,
    value_table: u64,
    value_shift: i64,
    value_width: i64,
    q_strides: [i64; 3],
    k_strides: [i64; 3],
    v_strides: [i64; 3],
    out_rows: i64,
    first_row: i64,
    padding_stride: i64,
    first: i64,
    window: i64,
    chunk: i64,
    batch: i32,
    heads: i32,
    kv_group: i32,
    tq: i32,
    tk: i32,
    causal: i32,
    skip: i32,
    n_terms: i32,
    softcap: f32,
    key_split: i32,
    terms: [Term; MAX_TERMS],
    // The backward kernel's (flash_forward.cu's posenc_flash_delta and posenc_flash_backward);
    // a training forward writes value_weights' end columns.
    d_out: u64,
    delta: u64,
    dq: u64,
    dk: u64,
    dv: u64,
    dsinks: u64,
    value_dp: u64,
    value_weights: u64,
    term_grads: i32,
}

// SAFETY: plain data (integers, floats and device addresses), laid out as the kernel's struct.
unsafe impl DeviceRepr for Params {}

/// One query block of the fused CUDA core, written into rows `first_row..first_row + Tq` of the
/// merged `(B, T, H, D)` output.
pub(crate) struct CudaCore<'a> {
    /// `(B, H, Tq, D)`, rotated and scaled, bf16, f16 or f32.
    pub q: &'a Tensor,
    /// `(B, Hkv, Tk, D)`, same dtype.
    pub k: &'a Tensor,
    /// `(B, Hkv, Tk, D)`, same dtype.
    pub v: &'a Tensor,
    /// Additive terms broadcastable to `(B, H, Tq, Tk)`.
    pub dense: &'a [Tensor],
    /// Whether a dense term may hide keys (a user's mask): then every key is visited.
    pub dense_masks: bool,
    /// Relative rows with shifted columns.
    pub relative: &'a [RelativeBias],
    /// `(B|1, Tk)`, non-zero = keep.
    pub padding: Option<&'a Tensor>,
    /// Causal limit, window and soft cap (no chunks: the caller takes another path).
    pub rule: &'a RowRule,
    /// `(H)` sink logits.
    pub sinks: Option<&'a Tensor>,
    /// A value term with shifted columns (Shaw's aⱽ).
    pub values: Option<&'a crate::plug::RelativeValues>,
}

/// A tensor's last axis contiguous and its other strides and offset multiples of 8 elements
/// (the kernel reads rows in 16-byte pieces); otherwise a contiguous copy.
fn rows_aligned(t: &Tensor) -> Result<Tensor> {
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
        for (what, t) in [("keys", self.k), ("values", self.v)] {
            if t.dtype() != self.q.dtype() {
                return Err(Error::DType {
                    what: if what == "keys" {
                        "keys of the CUDA attention kernel"
                    } else {
                        "values of the CUDA attention kernel"
                    },
                    expected: "the queries' dtype",
                    got: t.dtype(),
                });
            }
        }
        if !matches!(self.q.dtype(), DType::BF16 | DType::F16 | DType::F32) {
            return Err(Error::DType {
                what: "queries of the CUDA attention kernel",
                expected: "bf16, f16 or f32",
                got: self.q.dtype(),
            });
        }
        let (ob, rows, oh, od) = out.dims4()?;
        if (ob, oh, od) != (b, h, d) || rows < first_row + tq || !out.is_contiguous() {
            return Err(Error::shape(
                "output of the CUDA attention kernel",
                format!("contiguous ({b}, ≥ {}, {h}, {d})", first_row + tq),
                out.shape(),
            ));
        }
        if out.dtype() != self.q.dtype() {
            return Err(Error::DType {
                what: "output of the CUDA attention kernel",
                expected: "the queries' dtype",
                got: out.dtype(),
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
        let terms = self.terms((b, h, tq, tk))?;
        let padding = match self.padding {
            None => None,
            Some(p) => {
                crate::error::check_device(
                    "padding mask of the CUDA attention kernel",
                    p,
                    self.q.device(),
                )?;
                if p.dtype() != DType::U8 {
                    return Err(Error::DType {
                        what: "padding mask of the CUDA attention kernel",
                        expected: "u8 (non-zero = keep)",
                        got: p.dtype(),
                    });
                }
                let p = p.contiguous()?;
                let (pb, ptk) = p.dims2()?;
                if (pb != 1 && pb != b) || ptk != tk {
                    return Err(Error::shape(
                        "padding mask of the CUDA attention kernel",
                        format!("(1 or {b}, {tk})"),
                        p.shape(),
                    ));
                }
                Some(p)
            }
        };
        let sinks = match self.sinks {
            None => None,
            Some(s) => {
                crate::error::check_device(
                    "sinks of the CUDA attention kernel",
                    s,
                    self.q.device(),
                )?;
                let s = s.to_dtype(DType::F32)?.contiguous()?;
                if s.dims() != [h] {
                    return Err(Error::shape(
                        "sinks of the CUDA attention kernel",
                        format!("({h})"),
                        s.shape(),
                    ));
                }
                Some(s)
            }
        };
        for (what, t) in [
            ("keys of the CUDA attention kernel", self.k),
            ("values of the CUDA attention kernel", self.v),
            ("output of the CUDA attention kernel", out),
        ] {
            crate::error::check_device(what, t, self.q.device())?;
        }
        use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
        let multiprocessors = attribute(
            self.q,
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )
        .map_or(1, |n| n.max(1) as usize);
        let (splits, key_split) = key_splits(b * h, tq, tk, multiprocessors);
        let partial = match splits {
            1 => None,
            _ => Some(Tensor::zeros(
                (b, h, splits, tq, d + 2),
                DType::F32,
                self.q.device(),
            )?),
        };
        let values = match self.values {
            None => None,
            Some(v) => {
                let what = "value term of the CUDA attention kernel";
                let shift = shift_of(v.columns(), what, v.table())?;
                crate::error::check_device(what, v.table(), self.q.device())?;
                v.check_block(b, tq, tk, d)?;
                let table = v.table().to_dtype(DType::F32)?.contiguous()?;
                let width = table.dim(0)?;
                Some((table, clamped_shift(shift, tq, tk, width)))
            }
        };
        let op = LaunchOp {
            values,
            splits,
            key_split,
            partial,
            q: rows_aligned(self.q)?,
            k: rows_aligned(self.k)?,
            v: rows_aligned(self.v)?,
            terms,
            padding,
            sinks,
            skip: self.padding.is_none() && !self.dense_masks,
            rule: self.rule.clone(),
            first_row,
            stats: None,
            value_weights: None,
            backward: None,
        };
        Ok(op)
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
            let shift = shift_of(r.columns(), what, r.values())?;
            crate::error::check_device(what, r.values(), self.q.device())?;
            r.check_block((b, h, tq, tk))?;
            let width = r.width();
            let values = r.values().to_dtype(DType::F32)?.contiguous()?;
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

/// The PTX of each program by its name and NVRTC options.
type PtxCache = HashMap<(&'static str, Vec<String>), Arc<str>>;

/// The launch, as an in-place op on the merged output (or, with `backward`, on dQ).
#[derive(Clone)]
pub(crate) struct LaunchOp {
    /// A value term's `(W, D)` f32 table and its shift.
    values: Option<(Tensor, i64)>,
    /// Key splits (1: none) and keys per split.
    splits: usize,
    key_split: usize,
    /// `(B, H, splits, Tq, D + 2)` f32: each split's unnormalised output, maximum and sum.
    partial: Option<Tensor>,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    terms: Vec<KernelTerm>,
    padding: Option<Tensor>,
    sinks: Option<Tensor>,
    skip: bool,
    rule: RowRule,
    first_row: usize,
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

/// The PTX of each specialisation, compiled once per process.
static PTX: Mutex<Option<PtxCache>> = Mutex::new(None);

/// A specialisation's name, as errors give it.
fn label(d: usize, dtype: DType, values: bool) -> String {
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
fn ptx(d: usize, dtype: DType, values: bool) -> Result<Arc<str>> {
    let defines = forward_defines(d, dtype, values);
    nvrtc_ptx(
        "flash_forward.cu",
        FORWARD,
        defines,
        &label(d, dtype, values),
    )
}

/// The PTX of one of the crate's CUDA programs (`name`, its `source`) with the -D `defines`,
/// compiled by NVRTC for [`ARCH`] at first use and cached for the process.
///
/// # Errors
/// [`Error::Kernel`] naming `label` with NVRTC's log.
pub(crate) fn nvrtc_ptx(
    name: &'static str,
    source: &str,
    defines: Vec<String>,
    label: &str,
) -> Result<Arc<str>> {
    let mut cache = PTX.lock().unwrap_or_else(|e| e.into_inner());
    let cache = cache.get_or_insert_with(HashMap::new);
    let key = (name, defines);
    if let Some(ptx) = cache.get(&key) {
        return Ok(ptx.clone());
    }
    let options = CompileOptions {
        arch: Some(ARCH),
        options: key.1.clone(),
        ..Default::default()
    };
    let ptx = compile_ptx_with_opts(source, options).map_err(|e| Error::Kernel {
        kernel: label.to_string(),
        reason: format!("NVRTC: {e}"),
    })?;
    let ptx: Arc<str> = ptx.to_src().into();
    cache.insert(key, ptx.clone());
    Ok(ptx)
}

/// The device address of a tensor's first element.
macro_rules! address {
    ($storage:expr, $layout:expr, $ty:ty, $stream:expr, $guards:expr) => {{
        let slice = $storage.as_cuda_slice::<$ty>()?;
        let (ptr, guard) = slice.device_ptr($stream);
        $guards.push(guard);
        ptr + ($layout.start_offset() * std::mem::size_of::<$ty>()) as u64
    }};
}

impl InplaceOp1 for LaunchOp {
    fn name(&self) -> &'static str {
        "posenc-flash-forward"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("the CUDA attention kernel runs on CUDA devices only")
    }

    fn cuda_fwd(&self, out: &mut CudaStorage, out_layout: &Layout) -> candle_core::Result<()> {
        let dev = out.device().clone();
        let stream = dev.cuda_stream();
        let (b, h, tq, d) = self.q.dims4()?;
        let (_, hkv, tk, _) = self.k.dims4()?;
        let dtype = self.q.dtype();
        let wrap = |e: Error| candle_core::Error::wrap(e);
        let has_values = self.values.is_some();
        let ptx = ptx(d, dtype, has_values).map_err(wrap)?;
        let module = format!(
            "posenc_flash_forward_d{d}_{}_v{}",
            dtype.as_str(),
            u8::from(has_values)
        );
        let func = dev
            .get_or_load_custom_func(FORWARD_ENTRY, &module, &ptx)
            .map_err(|e| {
                wrap(Error::Kernel {
                    kernel: label(d, dtype, has_values),
                    reason: format!("loading the module: {e}"),
                })
            })?;

        let guards_q = self.q.storage_and_layout();
        let guards_k = self.k.storage_and_layout();
        let guards_v = self.v.storage_and_layout();
        let term_guards: Vec<_> = self
            .terms
            .iter()
            .map(|(t, _)| t.storage_and_layout())
            .collect();
        let pad_guard = self.padding.as_ref().map(|p| p.storage_and_layout());
        let sink_guard = self.sinks.as_ref().map(|s| s.storage_and_layout());
        let partial_guard = self.partial.as_ref().map(|s| s.storage_and_layout());
        let values_guard = self.values.as_ref().map(|(t, _)| t.storage_and_layout());
        let stats_guard = self.stats.as_ref().map(|s| s.storage_and_layout());
        let weights_guard = self.value_weights.as_ref().map(|s| s.storage_and_layout());
        let value_dp_guard = self
            .backward
            .as_ref()
            .and_then(|bw| bw.value_dp.as_ref())
            .map(|s| s.storage_and_layout());
        // The backward's: the forward's output and its gradient; δ, dK, dV and the sinks'.
        let half_guards = self
            .backward
            .as_ref()
            .map(|bw| (bw.out.storage_and_layout(), bw.d_out.storage_and_layout()));
        let f32_guards: Option<Vec<_>> = self.backward.as_ref().map(|bw| {
            [&bw.delta, &bw.dk, &bw.dv]
                .into_iter()
                .chain(bw.dsinks.as_ref())
                .map(|t| t.storage_and_layout())
                .collect()
        });
        let grad_guards: Vec<_> = self.backward.as_ref().map_or(Vec::new(), |bw| {
            bw.term_grads
                .iter()
                .map(|g| g.as_ref().map(Tensor::storage_and_layout))
                .collect()
        });
        let mut guards = Vec::new();
        let mut p = Params::default();
        macro_rules! cuda_of {
            ($s:expr) => {
                match &*$s {
                    Storage::Cuda(c) => c,
                    _ => candle_core::bail!(
                        "an operand of the CUDA attention kernel is not on a CUDA device"
                    ),
                }
            };
        }
        let (qs, ql) = (cuda_of!(guards_q.0), guards_q.1);
        let (ks, kl) = (cuda_of!(guards_k.0), guards_k.1);
        let (vs, vl) = (cuda_of!(guards_v.0), guards_v.1);
        let strides3 = |l: &Layout| {
            let s = l.stride();
            [s[0] as i64, s[1] as i64, s[2] as i64]
        };
        match dtype {
            DType::BF16 => {
                p.q = address!(qs, ql, bf16, &stream, guards);
                p.k = address!(ks, kl, bf16, &stream, guards);
                p.v = address!(vs, vl, bf16, &stream, guards);
            }
            DType::F32 => {
                p.q = address!(qs, ql, f32, &stream, guards);
                p.k = address!(ks, kl, f32, &stream, guards);
                p.v = address!(vs, vl, f32, &stream, guards);
            }
            _ => {
                p.q = address!(qs, ql, f16, &stream, guards);
                p.k = address!(ks, kl, f16, &stream, guards);
                p.v = address!(vs, vl, f16, &stream, guards);
            }
        }
        (p.q_strides, p.k_strides, p.v_strides) = (strides3(ql), strides3(kl), strides3(vl));
        for (n, ((_, relative), guard)) in self.terms.iter().zip(&term_guards).enumerate() {
            let (s, l) = (cuda_of!(guard.0), guard.1);
            let st = l.stride();
            p.terms[n] = Term {
                values: address!(s, l, f32, &stream, guards),
                strides: [st[0] as i64, st[1] as i64, st[2] as i64, st[3] as i64],
                shift: relative.map_or(0, |r| r.0),
                width: relative.map_or(0, |r| r.1 as i64),
                ..Term::default()
            };
        }
        p.n_terms = self.terms.len() as i32;
        if let (Some(guard), Some(pad)) = (&pad_guard, &self.padding) {
            let (s, l) = (cuda_of!(guard.0), guard.1);
            p.padding = address!(s, l, u8, &stream, guards);
            p.padding_stride = if pad.dim(0)? == 1 { 0 } else { tk as i64 };
        }
        if let Some(guard) = &sink_guard {
            let (s, l) = (cuda_of!(guard.0), guard.1);
            p.sinks = address!(s, l, f32, &stream, guards);
        }
        if let (Some(guard), Some((table, shift))) = (&values_guard, &self.values) {
            let (s, l) = (cuda_of!(guard.0), guard.1);
            p.value_table = address!(s, l, f32, &stream, guards);
            p.value_shift = *shift;
            p.value_width = table.dim(0)? as i64;
        }
        if let Some(guard) = &partial_guard {
            let (s, l) = (cuda_of!(guard.0), guard.1);
            p.partial = address!(s, l, f32, &stream, guards);
            p.key_split = self.key_split as i32;
        }
        p.out_rows = out_layout.dims()[1] as i64;
        p.first_row = self.first_row as i64;
        p.first = self.rule.first as i64;
        p.window = self
            .rule
            .window
            .map_or(-1, |w| w.min(i64::MAX as usize / 4) as i64);
        p.chunk = self
            .rule
            .chunk
            .filter(|&c| c > 0)
            .map_or(0, |c| c.min(i64::MAX as usize / 4) as i64);
        p.batch = b as i32;
        p.heads = h as i32;
        p.kv_group = (h / hkv) as i32;
        p.tq = tq as i32;
        p.tk = tk as i32;
        p.causal = i32::from(self.rule.causal);
        p.skip = i32::from(self.skip);
        p.softcap = self.rule.softcap.unwrap_or(0.0);
        if let Some(guard) = &stats_guard {
            let (s, l) = (cuda_of!(guard.0), guard.1);
            p.stats = address!(s, l, f32, &stream, guards);
        }
        // A value term's gathered weights: one row of W columns per query, whole.
        let rows_of_columns = |t: &Tensor, what: &str| -> candle_core::Result<()> {
            let width = self.values.as_ref().map_or(0, |(table, _)| table.dims()[0]);
            if !t.is_contiguous() || t.dims() != [b, h, tq, width] || t.dtype() != DType::F32 {
                candle_core::bail!(
                    "the CUDA attention kernel: {what} must be contiguous f32 ({b}, {h}, {tq}, \
                     {width}), not {:?} {:?}",
                    t.dtype(),
                    t.dims()
                );
            }
            Ok(())
        };
        if let (Some(guard), Some(weights)) = (&weights_guard, &self.value_weights) {
            if !has_values || self.splits != 1 {
                candle_core::bail!(
                    "the CUDA attention kernel gathers a value term's weights only with a value \
                     term and unsplit keys"
                );
            }
            rows_of_columns(weights, "a value term's gathered weights")?;
            let (s, l) = (cuda_of!(guard.0), guard.1);
            p.value_weights = address!(s, l, f32, &stream, guards);
        }
        if self.backward.is_some() {
            if self.stats.is_none() {
                candle_core::bail!("the CUDA attention backward needs the forward's statistics");
            }
            match (
                &value_dp_guard,
                self.backward.as_ref().and_then(|bw| bw.value_dp.as_ref()),
            ) {
                (Some(guard), Some(value_dp)) if has_values => {
                    rows_of_columns(value_dp, "dO · a for a value term")?;
                    let (s, l) = (cuda_of!(guard.0), guard.1);
                    p.value_dp = address!(s, l, f32, &stream, guards);
                }
                (None, None) if !has_values => {}
                _ => candle_core::bail!(
                    "the CUDA attention backward takes dO · a exactly when it has a value term"
                ),
            }
            let (Some((out_guard, do_guard)), Some(f32_guards)) = (&half_guards, &f32_guards)
            else {
                candle_core::bail!("the CUDA attention backward lost its buffers");
            };
            let (os, ol) = (cuda_of!(out_guard.0), out_guard.1);
            let (ds, dl) = (cuda_of!(do_guard.0), do_guard.1);
            match dtype {
                DType::BF16 => {
                    p.out = address!(os, ol, bf16, &stream, guards);
                    p.d_out = address!(ds, dl, bf16, &stream, guards);
                }
                DType::F32 => {
                    p.out = address!(os, ol, f32, &stream, guards);
                    p.d_out = address!(ds, dl, f32, &stream, guards);
                }
                _ => {
                    p.out = address!(os, ol, f16, &stream, guards);
                    p.d_out = address!(ds, dl, f16, &stream, guards);
                }
            }
            let mut f32s = Vec::new();
            for guard in f32_guards {
                let (s, l) = (cuda_of!(guard.0), guard.1);
                f32s.push(address!(s, l, f32, &stream, guards));
            }
            p.delta = f32s[0];
            p.dk = f32s[1];
            p.dv = f32s[2];
            p.dsinks = f32s.get(3).copied().unwrap_or(0);
            if grad_guards.len() != self.terms.len() {
                candle_core::bail!("the CUDA attention backward: one gradient slot per term");
            }
            for (n, guard) in grad_guards.iter().enumerate() {
                let Some(guard) = guard else { continue };
                let (s, l) = (cuda_of!(guard.0), guard.1);
                let want = match self.terms[n].1 {
                    None => [b, h, tq, tk],
                    Some((_, width)) => [b, h, tq, width],
                };
                let ok = l.is_contiguous()
                    && l.dims().len() == 4
                    && l.dims().iter().zip(want).all(|(&n, w)| n == 1 || n == w);
                if !ok {
                    candle_core::bail!(
                        "the CUDA attention backward: a term's gradient must be contiguous with \
                         axes of 1 or {want:?}, not {:?}",
                        l.dims()
                    );
                }
                let mut strides = [0i64; 4];
                for (a, st) in strides.iter_mut().enumerate() {
                    if l.dims()[a] > 1 {
                        *st = l.stride()[a] as i64;
                    }
                }
                p.terms[n].grad = address!(s, l, f32, &stream, guards);
                p.terms[n].grad_strides = strides;
                p.term_grads = 1;
            }
            p.out_rows = tq as i64;
            p.first_row = 0;
            let (base, dq_guard) = out.as_cuda_slice_mut::<f32>()?.device_ptr_mut(&stream);
            p.dq = base + (out_layout.start_offset() * 4) as u64;
            let label = format!(
                "{BACKWARD_ENTRY} d{d} {}{}",
                dtype.as_str(),
                if has_values { " values" } else { "" }
            );
            let load = |entry: &str| {
                dev.get_or_load_custom_func(entry, &module, &ptx)
                    .map_err(|e| {
                        wrap(Error::Kernel {
                            kernel: label.clone(),
                            reason: format!("loading {entry}: {e}"),
                        })
                    })
            };
            let (delta_fn, backward_fn) = (load(DELTA_ENTRY)?, load(BACKWARD_ENTRY)?);
            let launches = [
                (delta_fn, ((b * h * tq).div_ceil(128) as u32, 1, 1)),
                (
                    backward_fn,
                    (tk.div_ceil(TILE) as u32, hkv as u32, b as u32),
                ),
            ];
            for (func, grid_dim) in launches {
                let cfg = LaunchConfig {
                    grid_dim,
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut launch = func.builder();
                launch.arg(&p);
                // SAFETY: every address in `p` points into a live storage of the checked shape
                // and dtype (read-locked above, dQ borrowed mutably); the kernels read and
                // write only within the shapes in `p` (δ, dK, dV and the sinks' gradient are
                // fresh tensors of those shapes, written only by these launches; a value
                // term's dO · a and gathered weights were checked as (B, H, Tq, W) above).
                unsafe { launch.launch(cfg) }.map_err(|e| {
                    wrap(Error::Kernel {
                        kernel: label.clone(),
                        reason: format!("launch: {e}"),
                    })
                })?;
            }
            drop(dq_guard);
            drop(guards);
            count_launch();
            return Ok(());
        }
        let tiles = match self.splits {
            1 => tq.div_ceil(TILE),
            splits => splits,
        };
        let cfg = LaunchConfig {
            grid_dim: (tiles as u32, h as u32, b as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // The output's guard records the launch as a write when dropped after it.
        let (base, out_guard) = match dtype {
            DType::BF16 => out.as_cuda_slice_mut::<bf16>()?.device_ptr_mut(&stream),
            DType::F32 => out.as_cuda_slice_mut::<f32>()?.device_ptr_mut(&stream),
            _ => out.as_cuda_slice_mut::<f16>()?.device_ptr_mut(&stream),
        };
        p.out = base + (out_layout.start_offset() * dtype.size_in_bytes()) as u64;
        let mut launch = func.builder();
        launch.arg(&p);
        // SAFETY: every address in `p` points into a live storage of the checked shape and
        // dtype (read-locked above, the output borrowed mutably; a value term's gathered
        // weights checked as (B, H, Tq, W) above), and the kernel reads and writes only within
        // the shapes in `p`.
        unsafe { launch.launch(cfg) }.map_err(|e| {
            wrap(Error::Kernel {
                kernel: label(d, dtype, has_values),
                reason: format!("launch: {e}"),
            })
        })?;
        if self.splits > 1 {
            let combine = dev
                .get_or_load_custom_func(COMBINE_ENTRY, &module, &ptx)
                .map_err(|e| {
                    wrap(Error::Kernel {
                        kernel: label(d, dtype, has_values),
                        reason: format!("loading {COMBINE_ENTRY}: {e}"),
                    })
                })?;
            let splits = self.splits as i32;
            let cfg = LaunchConfig {
                grid_dim: (tq as u32, h as u32, b as u32),
                block_dim: (d as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut launch = combine.builder();
            launch.arg(&p);
            launch.arg(&splits);
            // SAFETY: as above; the combining kernel reads `partial`, which the forward wrote
            // on the same stream before it, and writes the output rows the forward did not.
            unsafe { launch.launch(cfg) }.map_err(|e| {
                wrap(Error::Kernel {
                    kernel: format!("{COMBINE_ENTRY} d{d} {}", dtype.as_str()),
                    reason: format!("launch: {e}"),
                })
            })?;
        }
        drop(out_guard);
        drop(guards);
        count_launch();
        Ok(())
    }
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
