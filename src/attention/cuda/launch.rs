//! The launch of the fused attention kernels: a [`LaunchOp`] as an in-place op on the merged
//! output (the forward, then the combine of split keys) or, with backward buffers, on dQ (the
//! δ launch, then the backward).
//!
//! ```text
//! lock every operand → Params (addresses, strides, sizes) → forward [+ combine] | δ + backward
//! ```
//!
//! Every operand is read-locked for the whole launch and checked against the dtype the kernel
//! reads it in before its address is taken; the output (or dQ) is borrowed mutably, so its
//! guard records the launch as a write.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
    SyncOnDrop,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::{bail, CpuStorage, DType, InplaceOp1, Layout, Storage, StorageRef, Tensor};
use half::{bf16, f16};

use super::kernel::{
    label, ptx, BackwardBuffers, LaunchOp, BACKWARD_ENTRY, COMBINE_ENTRY, DELTA_ENTRY,
    FORWARD_ENTRY, TILE,
};
use crate::error::Error;

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
    terms: [Term; super::kernel::MAX_TERMS],
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

type CResult<T> = candle_core::Result<T>;

/// A read lock on one operand's storage and its layout, held until the launch is queued.
type Lock<'t> = (StorageRef<'t>, &'t Layout);

/// The guards that order a launch after the work already queued on its operands.
type Syncs<'g> = Vec<SyncOnDrop<'g>>;

/// The locks of a launch's operands, field for field [`LaunchOp`]'s tensors.
struct Locks<'t> {
    q: Lock<'t>,
    k: Lock<'t>,
    v: Lock<'t>,
    terms: Vec<Lock<'t>>,
    padding: Option<Lock<'t>>,
    sinks: Option<Lock<'t>>,
    partial: Option<Lock<'t>>,
    values: Option<Lock<'t>>,
    stats: Option<Lock<'t>>,
    value_weights: Option<Lock<'t>>,
    backward: Option<BackwardLocks<'t>>,
}

/// The locks of the backward's buffers, field for field [`BackwardBuffers`].
struct BackwardLocks<'t> {
    out: Lock<'t>,
    d_out: Lock<'t>,
    delta: Lock<'t>,
    dk: Lock<'t>,
    dv: Lock<'t>,
    dsinks: Option<Lock<'t>>,
    term_grads: Vec<Option<Lock<'t>>>,
    value_dp: Option<Lock<'t>>,
}

/// A tensor's storage read-locked, with its layout.
fn lock(t: &Tensor) -> Lock<'_> {
    t.storage_and_layout()
}

/// The device address of `lock`'s first element, read as `dtype`; the guard that orders the
/// launch after the storage's earlier work goes to `syncs`.
///
/// # Errors
/// An operand off the CUDA device, or of another dtype than the kernel reads.
fn address<'g>(
    lock: &'g Lock<'_>,
    dtype: DType,
    stream: &'g CudaStream,
    syncs: &mut Syncs<'g>,
) -> CResult<u64> {
    let Storage::Cuda(s) = &*lock.0 else {
        bail!("an operand of the CUDA attention kernel is not on a CUDA device")
    };
    if s.dtype() != dtype {
        bail!(
            "an operand of the CUDA attention kernel is {:?}, not the {dtype:?} it reads",
            s.dtype()
        );
    }
    macro_rules! at {
        ($ty:ty) => {{
            let (ptr, guard) = s.as_cuda_slice::<$ty>()?.device_ptr(stream);
            syncs.push(guard);
            ptr + (lock.1.start_offset() * std::mem::size_of::<$ty>()) as u64
        }};
    }
    Ok(match dtype {
        DType::BF16 => at!(bf16),
        DType::F16 => at!(f16),
        DType::F32 => at!(f32),
        DType::U8 => at!(u8),
        other => bail!("the CUDA attention kernel reads no {other:?} operand"),
    })
}

/// The mutable address of the launch's target (the output, or dQ) and the guard that records
/// the launch as a write when dropped after it.
fn target<'g>(
    out: &'g mut CudaStorage,
    layout: &Layout,
    stream: &'g CudaStream,
) -> CResult<(u64, SyncOnDrop<'g>)> {
    let dtype = out.dtype();
    let (base, guard) = match dtype {
        DType::BF16 => out.as_cuda_slice_mut::<bf16>()?.device_ptr_mut(stream),
        DType::F16 => out.as_cuda_slice_mut::<f16>()?.device_ptr_mut(stream),
        DType::F32 => out.as_cuda_slice_mut::<f32>()?.device_ptr_mut(stream),
        other => bail!("the CUDA attention kernel writes no {other:?} output"),
    };
    Ok((
        base + (layout.start_offset() * dtype.size_in_bytes()) as u64,
        guard,
    ))
}

/// The `(B, H, Tq, D)` and `(Hkv, Tk)` of a launch.
type Sizes = ((usize, usize, usize, usize), (usize, usize));

/// The [`Sizes`] of `op`.
fn sizes(op: &LaunchOp) -> CResult<Sizes> {
    let (_, hkv, tk, _) = op.k.dims4()?;
    Ok((op.q.dims4()?, (hkv, tk)))
}

/// The module of one specialisation on one device, and how errors name it.
struct Kernels {
    dev: CudaDevice,
    module: String,
    ptx: Arc<str>,
    label: String,
}

impl Kernels {
    /// The specialisation `op` runs (its head dimension, dtype and whether it reads a value
    /// term), compiled at first use.
    fn of(op: &LaunchOp, dev: &CudaDevice) -> CResult<Self> {
        let (d, dtype, values) = (op.q.dim(3)?, op.q.dtype(), op.values.is_some());
        Ok(Self {
            dev: dev.clone(),
            module: format!(
                "posenc_flash_forward_d{d}_{}_v{}",
                dtype.as_str(),
                u8::from(values)
            ),
            ptx: ptx(d, dtype, values).map_err(candle_core::Error::wrap)?,
            label: label(d, dtype, values),
        })
    }

    /// The kernel `entry` of the module, loaded on the device at first use.
    fn load(&self, entry: &str) -> CResult<CudaFunction> {
        let func = self
            .dev
            .get_or_load_custom_func(entry, &self.module, &self.ptx)
            .map_err(|e| {
                candle_core::Error::wrap(Error::Kernel {
                    kernel: self.label.clone(),
                    reason: format!("loading {entry}: {e}"),
                })
            })?;
        Ok(func.into_cuda_function())
    }

    /// Queues `func` on `stream` over `grid` thread blocks of `threads` with `args`.
    ///
    /// # Safety
    /// Every address in `args` points into a live storage of the shape and dtype `args` gives
    /// it, locked (or borrowed mutably, for the target) until the guards taken for the launch
    /// drop after it, and the kernel reads and writes only within those shapes.
    unsafe fn launch(
        &self,
        stream: &CudaStream,
        (func, entry): (&CudaFunction, &str),
        grid: (u32, u32, u32),
        threads: u32,
        args: (&Params, Option<&i32>),
    ) -> CResult<()> {
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = stream.launch_builder(func);
        launch.arg(args.0);
        if let Some(extra) = args.1 {
            launch.arg(extra);
        }
        // SAFETY: the caller's contract.
        unsafe { launch.launch(cfg) }.map_err(|e| {
            candle_core::Error::wrap(Error::Kernel {
                kernel: format!("{} ({entry})", self.label),
                reason: format!("launch: {e}"),
            })
        })?;
        Ok(())
    }
}

impl LaunchOp {
    /// Every operand's storage read-locked.
    fn locks(&self) -> Locks<'_> {
        Locks {
            q: lock(&self.q),
            k: lock(&self.k),
            v: lock(&self.v),
            terms: self.terms.iter().map(|(t, _)| lock(t)).collect(),
            padding: self.padding.as_ref().map(lock),
            sinks: self.sinks.as_ref().map(lock),
            partial: self.partial.as_ref().map(lock),
            values: self.values.as_ref().map(|(t, _)| lock(t)),
            stats: self.stats.as_ref().map(lock),
            value_weights: self.value_weights.as_ref().map(lock),
            backward: self.backward.as_ref().map(|bw| BackwardLocks {
                out: lock(&bw.out),
                d_out: lock(&bw.d_out),
                delta: lock(&bw.delta),
                dk: lock(&bw.dk),
                dv: lock(&bw.dv),
                dsinks: bw.dsinks.as_ref().map(lock),
                term_grads: bw.term_grads.iter().map(|g| g.as_ref().map(lock)).collect(),
                value_dp: bw.value_dp.as_ref().map(lock),
            }),
        }
    }

    /// The forward's parameters: every operand's address and strides, the sizes and the rule,
    /// for an output of `out_rows` rows.
    fn forward_params<'g>(
        &self,
        locks: &'g Locks<'_>,
        stream: &'g CudaStream,
        syncs: &mut Syncs<'g>,
        out_rows: usize,
    ) -> CResult<Params> {
        let ((b, h, tq, _), (hkv, tk)) = sizes(self)?;
        let dtype = self.q.dtype();
        let strides3 = |l: &Layout| {
            let s = l.stride();
            [s[0] as i64, s[1] as i64, s[2] as i64]
        };
        let mut p = Params {
            q: address(&locks.q, dtype, stream, syncs)?,
            k: address(&locks.k, dtype, stream, syncs)?,
            v: address(&locks.v, dtype, stream, syncs)?,
            q_strides: strides3(locks.q.1),
            k_strides: strides3(locks.k.1),
            v_strides: strides3(locks.v.1),
            n_terms: self.terms.len() as i32,
            out_rows: out_rows as i64,
            first_row: self.first_row as i64,
            batch: b as i32,
            heads: h as i32,
            kv_group: (h / hkv) as i32,
            tq: tq as i32,
            tk: tk as i32,
            skip: i32::from(self.skip),
            ..Params::default()
        };
        self.bind_rule(&mut p);
        for (n, ((_, relative), lock)) in self.terms.iter().zip(&locks.terms).enumerate() {
            let st = lock.1.stride();
            p.terms[n] = Term {
                values: address(lock, DType::F32, stream, syncs)?,
                strides: [st[0] as i64, st[1] as i64, st[2] as i64, st[3] as i64],
                shift: relative.map_or(0, |r| r.0),
                width: relative.map_or(0, |r| r.1 as i64),
                ..Term::default()
            };
        }
        if let (Some(lock), Some(pad)) = (&locks.padding, &self.padding) {
            p.padding = address(lock, DType::U8, stream, syncs)?;
            p.padding_stride = if pad.dim(0)? == 1 { 0 } else { tk as i64 };
        }
        if let Some(lock) = &locks.sinks {
            p.sinks = address(lock, DType::F32, stream, syncs)?;
        }
        if let (Some(lock), Some((table, shift))) = (&locks.values, &self.values) {
            p.value_table = address(lock, DType::F32, stream, syncs)?;
            p.value_shift = *shift;
            p.value_width = table.dim(0)? as i64;
        }
        if let Some(lock) = &locks.partial {
            p.partial = address(lock, DType::F32, stream, syncs)?;
            p.key_split = self.key_split as i32;
        }
        if let Some(lock) = &locks.stats {
            p.stats = address(lock, DType::F32, stream, syncs)?;
        }
        if let (Some(lock), Some(weights)) = (&locks.value_weights, &self.value_weights) {
            if self.values.is_none() || self.splits != 1 {
                bail!(
                    "the CUDA attention kernel gathers a value term's weights only with a value \
                     term and unsplit keys"
                );
            }
            self.check_columns(weights, "a value term's gathered weights")?;
            p.value_weights = address(lock, DType::F32, stream, syncs)?;
        }
        Ok(p)
    }

    /// The causal limit, window, chunk and soft cap.
    fn bind_rule(&self, p: &mut Params) {
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
        p.causal = i32::from(self.rule.causal);
        p.softcap = self.rule.softcap.unwrap_or(0.0);
    }

    /// A value term's rows of columns (its gathered weights, or dO · a): contiguous f32
    /// `(B, H, Tq, W)`.
    fn check_columns(&self, t: &Tensor, what: &str) -> CResult<()> {
        let (b, h, tq, _) = self.q.dims4()?;
        let width = self.values.as_ref().map_or(0, |(table, _)| table.dims()[0]);
        if !t.is_contiguous() || t.dims() != [b, h, tq, width] || t.dtype() != DType::F32 {
            bail!(
                "the CUDA attention kernel: {what} must be contiguous f32 ({b}, {h}, {tq}, \
                 {width}), not {:?} {:?}",
                t.dtype(),
                t.dims()
            );
        }
        Ok(())
    }

    /// The backward's parameters on top of the forward's: the forward's output and its
    /// gradient, δ, dK, dV, the sinks', each learning term's and the value term's buffers.
    fn backward_params<'g>(
        &self,
        bw: &BackwardBuffers,
        locks: &'g BackwardLocks<'_>,
        stream: &'g CudaStream,
        syncs: &mut Syncs<'g>,
        p: &mut Params,
    ) -> CResult<()> {
        if self.stats.is_none() {
            bail!("the CUDA attention backward needs the forward's statistics");
        }
        match (&locks.value_dp, &bw.value_dp) {
            (Some(lock), Some(value_dp)) if self.values.is_some() => {
                self.check_columns(value_dp, "dO · a for a value term")?;
                p.value_dp = address(lock, DType::F32, stream, syncs)?;
            }
            (None, None) if self.values.is_none() => {}
            _ => bail!("the CUDA attention backward takes dO · a exactly when it has a value term"),
        }
        let dtype = self.q.dtype();
        p.out = address(&locks.out, dtype, stream, syncs)?;
        p.d_out = address(&locks.d_out, dtype, stream, syncs)?;
        p.delta = address(&locks.delta, DType::F32, stream, syncs)?;
        p.dk = address(&locks.dk, DType::F32, stream, syncs)?;
        p.dv = address(&locks.dv, DType::F32, stream, syncs)?;
        p.dsinks = match &locks.dsinks {
            Some(lock) => address(lock, DType::F32, stream, syncs)?,
            None => 0,
        };
        if locks.term_grads.len() != self.terms.len() {
            bail!("the CUDA attention backward: one gradient slot per term");
        }
        for (n, lock) in locks.term_grads.iter().enumerate() {
            let Some(lock) = lock else { continue };
            p.terms[n].grad_strides = self.term_grad_strides(n, lock.1)?;
            p.terms[n].grad = address(lock, DType::F32, stream, syncs)?;
            p.term_grads = 1;
        }
        p.out_rows = self.q.dim(2)? as i64;
        p.first_row = 0;
        Ok(())
    }

    /// The strides of term `n`'s gradient (0 along an axis it broadcasts), which must be
    /// contiguous with axes of 1 or the term's own `(B, H, Tq, Tk | W)`.
    fn term_grad_strides(&self, n: usize, l: &Layout) -> CResult<[i64; 4]> {
        let ((b, h, tq, _), (_, tk)) = sizes(self)?;
        let want = match self.terms[n].1 {
            None => [b, h, tq, tk],
            Some((_, width)) => [b, h, tq, width],
        };
        let ok = l.is_contiguous()
            && l.dims().len() == 4
            && l.dims().iter().zip(want).all(|(&n, w)| n == 1 || n == w);
        if !ok {
            bail!(
                "the CUDA attention backward: a term's gradient must be contiguous with axes of \
                 1 or {want:?}, not {:?}",
                l.dims()
            );
        }
        let mut strides = [0i64; 4];
        for (a, st) in strides.iter_mut().enumerate() {
            if l.dims()[a] > 1 {
                *st = l.stride()[a] as i64;
            }
        }
        Ok(strides)
    }

    /// The forward over every query tile (or key split), then, with split keys, the combine
    /// of the splits into the output rows.
    fn launch_forward(
        &self,
        kernels: &Kernels,
        p: &mut Params,
        (out, layout): (&mut CudaStorage, &Layout),
        stream: &Arc<CudaStream>,
    ) -> CResult<()> {
        let ((b, h, tq, d), _) = sizes(self)?;
        let tiles = match self.splits {
            1 => tq.div_ceil(TILE),
            splits => splits,
        };
        let forward = kernels.load(FORWARD_ENTRY)?;
        let combine = match self.splits {
            1 => None,
            _ => Some(kernels.load(COMBINE_ENTRY)?),
        };
        let (base, out_guard) = target(out, layout, stream)?;
        p.out = base;
        let grid = (tiles as u32, h as u32, b as u32);
        // SAFETY: every address in `p` points into a live storage of the checked shape and
        // dtype (read-locked by the caller, the output borrowed mutably; a value term's
        // gathered weights checked as (B, H, Tq, W)), and the kernel reads and writes only
        // within the shapes in `p`.
        unsafe { kernels.launch(stream, (&forward, FORWARD_ENTRY), grid, 128, (p, None))? };
        if let Some(combine) = combine {
            let splits = self.splits as i32;
            let grid = (tq as u32, h as u32, b as u32);
            // SAFETY: as above; the combining kernel reads `partial`, which the forward wrote
            // on the same stream before it, and writes the output rows the forward did not.
            unsafe {
                kernels.launch(
                    stream,
                    (&combine, COMBINE_ENTRY),
                    grid,
                    d as u32,
                    (p, Some(&splits)),
                )?
            };
        }
        drop(out_guard);
        Ok(())
    }

    /// δ (each row's `dO · O`), then the backward over every key tile, writing dQ (the op's
    /// target), dK, dV and the learning terms' gradients.
    fn launch_backward(
        &self,
        kernels: &Kernels,
        p: &mut Params,
        (dq, layout): (&mut CudaStorage, &Layout),
        stream: &Arc<CudaStream>,
    ) -> CResult<()> {
        let ((b, h, tq, _), (hkv, tk)) = sizes(self)?;
        if dq.dtype() != DType::F32 {
            bail!(
                "the CUDA attention backward writes an f32 dQ, not {:?}",
                dq.dtype()
            );
        }
        let (delta, backward) = (kernels.load(DELTA_ENTRY)?, kernels.load(BACKWARD_ENTRY)?);
        let (base, dq_guard) = target(dq, layout, stream)?;
        p.dq = base;
        let launches = [
            (
                &delta,
                DELTA_ENTRY,
                ((b * h * tq).div_ceil(128) as u32, 1, 1),
            ),
            (
                &backward,
                BACKWARD_ENTRY,
                (tk.div_ceil(TILE) as u32, hkv as u32, b as u32),
            ),
        ];
        for (func, entry, grid) in launches {
            // SAFETY: every address in `p` points into a live storage of the checked shape and
            // dtype (read-locked by the caller, dQ borrowed mutably); the kernels read and
            // write only within the shapes in `p` (δ, dK, dV and the sinks' gradient are fresh
            // tensors of those shapes, written only by these launches; a value term's dO · a
            // and gathered weights were checked as (B, H, Tq, W)).
            unsafe { kernels.launch(stream, (func, entry), grid, 128, (p, None))? };
        }
        drop(dq_guard);
        Ok(())
    }
}

impl InplaceOp1 for LaunchOp {
    fn name(&self) -> &'static str {
        "posenc-flash-forward"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> CResult<()> {
        bail!("the CUDA attention kernel runs on CUDA devices only")
    }

    fn cuda_fwd(&self, out: &mut CudaStorage, layout: &Layout) -> CResult<()> {
        let dev = out.device().clone();
        let stream = dev.cuda_stream();
        let kernels = Kernels::of(self, &dev)?;
        let locks = self.locks();
        let mut syncs = Vec::new();
        let mut p = self.forward_params(&locks, &stream, &mut syncs, layout.dims()[1])?;
        match (&self.backward, &locks.backward) {
            (Some(bw), Some(bw_locks)) => {
                self.backward_params(bw, bw_locks, &stream, &mut syncs, &mut p)?;
                self.launch_backward(&kernels, &mut p, (out, layout), &stream)?;
            }
            _ => self.launch_forward(&kernels, &mut p, (out, layout), &stream)?,
        }
        drop(syncs);
        crate::cuda::count_launch();
        Ok(())
    }
}
