//! Rotation in place on CUDA devices: `rope_in_place.cu`, one thread per pair, reading and
//! writing each rotated feature once, for f32, bf16, f16 and f64, forwards and by −θ (the
//! backward). Behind the same switch as the fused attention kernels ([`super::kernels_on`]);
//! on an H100 it matched the CPU's rotation, forwards and backwards. The rotary module checks
//! the operands and reads their shape ([`Rotation`]); this file only launches.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::CudaStorage;
use candle_core::{DType, Layout};
use half::{bf16, f16};

use crate::error::Error;

const SOURCE: &str = include_str!("rope_in_place.cu");
const ENTRY: &str = "posenc_rope_inplace";

/// Everything a launch reads; field for field `RopeParams` in rope_in_place.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RopeParams {
    x: u64,
    cos: u64,
    sin: u64,
    pairs: i64,
    rows: i64,
    heads: i64,
    len: i64,
    dim: i64,
    half: i64,
    batched: i32,
    interleaved: i32,
    heads_first: i32,
    sin_sign: f32,
}

// SAFETY: plain data (integers, floats and device addresses), laid out as the kernel's struct.
unsafe impl DeviceRepr for RopeParams {}

/// One rotation as the kernel reads it, its shape checked by the caller against the storages.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rotation {
    /// Rows of pairs per sequence (`H · T`), heads, positions, features per head, and the
    /// rotated pairs per row.
    pub rows: usize,
    pub heads: usize,
    pub len: usize,
    pub dim: usize,
    pub half: usize,
    /// Tables of one row per sequence (`(B, T, half)`) rather than shared (`(T, half)`).
    pub batched: bool,
    /// Pairs `(2i, 2i + 1)` rather than `(i, i + half)`.
    pub interleaved: bool,
    /// `(B, H, T, D)` rather than `(B, T, H, D)`.
    pub heads_first: bool,
    /// By −θ (the backward).
    pub inverse: bool,
}

/// The kernel's dtype code (`POSENC_ROPE_DTYPE`).
fn dtype_code(dtype: DType) -> Option<u8> {
    match dtype {
        DType::F32 => Some(0),
        DType::BF16 => Some(1),
        DType::F16 => Some(2),
        DType::F64 => Some(3),
        _ => None,
    }
}

/// Rotates `x` in place by the f32 tables `cos` and `sin` (checked as the CPU path checks them;
/// tables of another dtype are an error, as there).
pub(crate) fn rotate(
    op: &Rotation,
    x: &mut CudaStorage,
    lx: &Layout,
    (cos, lc): (&CudaStorage, &Layout),
    (sin, ls): (&CudaStorage, &Layout),
) -> candle_core::Result<()> {
    let (Some((c0, _)), Some((s0, _)), Some((x0, _))) = (
        lc.contiguous_offsets(),
        ls.contiguous_offsets(),
        lx.contiguous_offsets(),
    ) else {
        candle_core::bail!("rope in place: x, cos and sin must be contiguous");
    };
    let dtype = x.dtype();
    let Some(code) = dtype_code(dtype) else {
        candle_core::bail!("rope in place: unsupported dtype {dtype:?}");
    };
    let batch = lx.shape().dims()[0];
    let pairs = batch * op.rows * op.half;
    if pairs == 0 {
        return Ok(());
    }
    let label = format!("{ENTRY} {}", dtype.as_str());
    let ptx = super::nvrtc::ptx(
        "rope_in_place.cu",
        SOURCE,
        vec![format!("-DPOSENC_ROPE_DTYPE={code}")],
        &label,
    )
    .map_err(candle_core::Error::wrap)?;
    let dev = x.device().clone();
    let stream = dev.cuda_stream();
    let func = dev
        .get_or_load_custom_func(
            ENTRY,
            &format!("posenc_rope_inplace_{}", dtype.as_str()),
            &ptx,
        )
        .map_err(|e| {
            candle_core::Error::wrap(Error::Kernel {
                kernel: label.clone(),
                reason: format!("loading the module: {e}"),
            })
        })?;
    let (cos, sin) = (cos.as_cuda_slice::<f32>()?, sin.as_cuda_slice::<f32>()?);
    let (cos_ptr, cos_guard) = cos.device_ptr(&stream);
    let (sin_ptr, sin_guard) = sin.device_ptr(&stream);
    let (x_ptr, x_guard) = match dtype {
        DType::F32 => x.as_cuda_slice_mut::<f32>()?.device_ptr_mut(&stream),
        DType::BF16 => x.as_cuda_slice_mut::<bf16>()?.device_ptr_mut(&stream),
        DType::F16 => x.as_cuda_slice_mut::<f16>()?.device_ptr_mut(&stream),
        _ => x.as_cuda_slice_mut::<f64>()?.device_ptr_mut(&stream),
    };
    let p = RopeParams {
        x: x_ptr + (x0 * dtype.size_in_bytes()) as u64,
        cos: cos_ptr + (c0 * 4) as u64,
        sin: sin_ptr + (s0 * 4) as u64,
        pairs: pairs as i64,
        rows: op.rows as i64,
        heads: op.heads as i64,
        len: op.len as i64,
        dim: op.dim as i64,
        half: op.half as i64,
        batched: i32::from(op.batched),
        interleaved: i32::from(op.interleaved),
        heads_first: i32::from(op.heads_first),
        sin_sign: if op.inverse { -1.0 } else { 1.0 },
    };
    let threads = 256;
    let cfg = LaunchConfig {
        grid_dim: (pairs.div_ceil(threads).min(65_535 * 8) as u32, 1, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = func.builder();
    launch.arg(&p);
    // SAFETY: `x`, `cos` and `sin` are live contiguous storages of the shapes `dims` was read
    // from (checked above); the kernel touches `pairs` pairs of `x` within them and reads the
    // table rows those pairs name.
    unsafe { launch.launch(cfg) }.map_err(|e| {
        candle_core::Error::wrap(Error::Kernel {
            kernel: label,
            reason: format!("launch: {e}"),
        })
    })?;
    drop((x_guard, cos_guard, sin_guard));
    super::count_launch();
    Ok(())
}
