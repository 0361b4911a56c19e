//! The crate's CUDA kernels behind one door: the switch that turns them on, one NVRTC cache
//! every kernel compiles through, and the rotation in place. The fused attention kernels are
//! the block's CUDA path (`attention/cuda/`), reached only through the block's plan.
//!
//! **On by default for what has passed on a GPU** (docs/gpu.md says what an H200 run showed;
//! `Reach::Proven`): the calls not yet run there take candle's ops. With the `cuda` feature,
//! `set_fused_kernel(true)` (or `CANDLE_POSENC_CUDA_KERNEL=1` in the environment) turns them on
//! for every call they take, `set_fused_kernel(false)` (or `=0`) off, and `FusedKernelScope`
//! either for one thread's calls. Without the feature this module is empty but for the crate's
//! check `kernels_on`, which then answers `false`.

#[cfg(feature = "cuda")]
pub(crate) mod nvrtc;
#[cfg(feature = "cuda")]
pub(crate) mod rope;
#[cfg(feature = "cuda")]
mod switch;

#[cfg(all(feature = "cuda", feature = "testing"))]
#[doc(hidden)]
pub use switch::kernel_launches;
#[cfg(feature = "cuda")]
pub(crate) use switch::{count_launch, Reach};
#[cfg(feature = "cuda")]
pub use switch::{fused_kernel, set_fused_kernel, FusedKernelScope};

/// The switch's reach for this thread's calls, whatever the device.
#[cfg(feature = "cuda")]
pub(crate) fn switch_reach() -> Reach {
    switch::reach()
}

/// Whether the crate's CUDA kernels run for tensors on `device`: a CUDA device, the `cuda`
/// feature, and the kernels on for this thread's calls (by default or explicitly).
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
