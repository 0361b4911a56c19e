//! The crate's CUDA kernels behind one door: the switch that turns them on, one NVRTC cache
//! every kernel compiles through, and the rotation in place. The fused attention kernels are
//! the block's CUDA path (`attention/cuda/`), reached only through the block's plan.
//!
//! **Off by default** (docs/gpu.md says what an H100 run showed). With the `cuda` feature,
//! `set_fused_kernel` (or `CANDLE_POSENC_CUDA_KERNEL=1` in the environment) turns them on for
//! the process, `FusedKernelScope` for one thread's calls; otherwise a CUDA block runs on
//! candle's ops. Without the feature this module is empty but for the crate's check
//! `kernels_on`, which then answers `false`.

#[cfg(feature = "cuda")]
pub(crate) mod nvrtc;
#[cfg(feature = "cuda")]
pub(crate) mod rope;
#[cfg(feature = "cuda")]
mod switch;

#[cfg(feature = "cuda")]
pub(crate) use switch::count_launch;
#[cfg(all(feature = "cuda", feature = "testing"))]
#[doc(hidden)]
pub use switch::kernel_launches;
#[cfg(feature = "cuda")]
pub use switch::{fused_kernel, set_fused_kernel, FusedKernelScope};

/// Whether the crate's CUDA kernels run for tensors on `device`: a CUDA device, the `cuda`
/// feature, and the kernels switched on for this thread's calls.
pub(crate) fn kernels_on(device: &candle_core::Device) -> bool {
    #[cfg(feature = "cuda")]
    {
        device.is_cuda() && fused_kernel()
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        false
    }
}
