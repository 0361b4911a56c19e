//! The switch that turns the crate's CUDA kernels on (process-wide, or per thread by a scope),
//! and the count of launches the tests read.

use std::sync::atomic::{AtomicU8, Ordering};

/// 0: not yet read from the environment; 1: off; 2: on for every call the kernels take; 3: the
/// default, on for the calls that have run on a GPU ([`Reach::Proven`]).
static ENABLED: AtomicU8 = AtomicU8::new(0);

/// What the switch lets the crate's CUDA kernels take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reach {
    /// Candle's ops for every call.
    Off,
    /// The default: the kernels for the calls that passed against the f64 block on a GPU, and
    /// candle's ops (or unsplit keys) for those that have not yet run there (docs/gpu.md; the
    /// table above `proven_bias` in `attention/cuda/mod.rs` holds the list).
    Proven,
    /// Switched on explicitly: every call the kernels take.
    All,
}

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

/// Turns the fused CUDA kernels on for every call they take, or off, for every block in this
/// process. Without it they are on for the calls that passed against the f64 block on a GPU
/// (docs/gpu.md), or as `CANDLE_POSENC_CUDA_KERNEL` says: `1` (`true`, `on`) on for every
/// call, any other non-empty value (`0`, `false`, `off`) off.
pub fn set_fused_kernel(on: bool) {
    ENABLED.store(if on { 2 } else { 1 }, Ordering::Relaxed);
}

thread_local! {
    /// This thread's [`FusedKernelScope`], if any.
    static SCOPED: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// The fused CUDA kernels on for every call they take, or off, for the calls this thread makes
/// while the value lives, in place of [`set_fused_kernel`]'s process-wide setting or the
/// default (scopes nest; dropping one restores what was in force when it was taken). The block
/// chooses its path on the calling thread.
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

/// Whether the fused CUDA kernels are on (for every call they take, or by default for those
/// proven on a GPU): this thread's [`FusedKernelScope`] if it has one, else
/// [`set_fused_kernel`]'s setting, else the environment's, else on.
pub fn fused_kernel() -> bool {
    reach() != Reach::Off
}

/// What the kernels take for this thread's calls (see [`fused_kernel`]).
pub(crate) fn reach() -> Reach {
    if let Some(on) = SCOPED.with(std::cell::Cell::get) {
        return if on { Reach::All } else { Reach::Off };
    }
    let state = match ENABLED.load(Ordering::Relaxed) {
        0 => {
            // Unset (or empty): the default; `1`, `true` or `on`: every call; any other value
            // (`0`, `false`, `off`, a typo): off, as before the default changed.
            let var = std::env::var("CANDLE_POSENC_CUDA_KERNEL").unwrap_or_default();
            let state = match var.trim().to_ascii_lowercase().as_str() {
                "" => 3,
                "1" | "true" | "on" => 2,
                _ => 1,
            };
            // A `set_fused_kernel` on another thread meanwhile wins.
            match ENABLED.compare_exchange(0, state, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => state,
                Err(set) => set,
            }
        }
        state => state,
    };
    match state {
        1 => Reach::Off,
        2 => Reach::All,
        _ => Reach::Proven,
    }
}
