//! The switch that turns the crate's CUDA kernels on (process-wide, or per thread by a scope),
//! and the count of launches the tests read.

use std::sync::atomic::{AtomicU8, Ordering};

/// 0: not yet read from the environment; 1: off; 2: on.
static ENABLED: AtomicU8 = AtomicU8::new(0);

thread_local! {
    /// Launches of the crate's CUDA kernels by this thread's calls.
    static LAUNCHES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many times the crate's CUDA kernels (the fused attention's query blocks, rotations in
/// place) have run for calls made on this thread: a test can tell that a block took them,
/// whatever other threads do (kernels are launched on the calling thread).
#[cfg(feature = "testing")]
pub fn kernel_launches() -> u64 {
    LAUNCHES.with(std::cell::Cell::get)
}

/// Counts one launch (read by the tests through `kernel_launches`).
pub(crate) fn count_launch() {
    LAUNCHES.with(|n| n.set(n.get() + 1));
}

/// Turns the fused CUDA kernel on or off for every block in this process (default: off, or
/// on when `CANDLE_POSENC_CUDA_KERNEL=1` is set). It is experimental: see [`crate::cuda`] for
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
