//! Gradient grafts: a result computed outside candle's autograd (a fused kernel, or an op whose
//! backward candle gets wrong), attached to its input's graph with a backward we supply.
//!
//! ```text
//! forward:  graft(x, y) = y                    (a copy of the already computed result)
//! backward: ∂L/∂x = B(∂L/∂y)                   (B: the op's adjoint, e.g. a rotation by −θ)
//! ```

use std::collections::HashMap;
use std::sync::Mutex;
use std::thread::ThreadId;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};

use crate::error::Result;

/// The backward of a grafted op: the gradient with respect to its input, from the gradient
/// with respect to its output.
pub(crate) trait GraftBackward: Send + Sync + 'static {
    /// The custom op's name (shown in candle's errors).
    const NAME: &'static str;
    /// `∂L/∂x` from `∂L/∂y`.
    fn grad(&self, grad_y: &Tensor) -> candle_core::Result<Tensor>;
}

/// `y`, with gradients flowing to `x` through `backward`. `y` must be a fresh contiguous tensor
/// computed from `x` outside the graph.
pub(crate) fn graft<B: GraftBackward>(x: &Tensor, y: &Tensor, backward: B) -> Result<Tensor> {
    Ok(x.apply_op2(y, Graft(backward, false))?)
}

/// `y`, with gradients flowing to `x` through `backward` and to `y` as they are (`y` may be in
/// a graph of its own: the links of one op's several inputs, [`crate::attention`]'s fused
/// training core).
pub(crate) fn graft_through<B: GraftBackward>(
    x: &Tensor,
    y: &Tensor,
    backward: B,
) -> Result<Tensor> {
    Ok(x.apply_op2(y, Graft(backward, true))?)
}

/// The backward, and whether `y`'s gradient passes through.
struct Graft<B>(B, bool);

/// The grafted result as a fresh storage.
fn copy_output<S: BackendStorage>(y: &S, layout: &Layout) -> candle_core::Result<(S, Shape)> {
    if layout.start_offset() != 0 || !layout.is_contiguous() {
        candle_core::bail!("gradient graft: the grafted tensor must be fresh and contiguous")
    }
    Ok((y.try_clone(layout)?, layout.shape().clone()))
}

impl<B: GraftBackward> CustomOp2 for Graft<B> {
    fn name(&self) -> &'static str {
        B::NAME
    }

    fn cpu_fwd(
        &self,
        _x: &CpuStorage,
        _lx: &Layout,
        y: &CpuStorage,
        ly: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        copy_output(y, ly)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _x: &candle_core::CudaStorage,
        _lx: &Layout,
        y: &candle_core::CudaStorage,
        ly: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        copy_output(y, ly)
    }

    #[cfg(feature = "metal")]
    fn metal_fwd(
        &self,
        _x: &candle_core::MetalStorage,
        _lx: &Layout,
        y: &candle_core::MetalStorage,
        ly: &Layout,
    ) -> candle_core::Result<(candle_core::MetalStorage, Shape)> {
        copy_output(y, ly)
    }

    fn bwd(
        &self,
        _x: &Tensor,
        _y: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let through = self.1.then(|| grad_res.clone());
        Ok((Some(self.0.grad(grad_res)?), through))
    }
}

/// Gradients one node's backward computes for others of the same graph to hand to candle (a
/// node's links), kept apart per thread: candle differentiates a graph on the thread that
/// calls `backward`, and two threads may differentiate one graph at once (two losses of one
/// output). With one slot for all, one thread's links could take the other's gradients.
pub(crate) struct Handoff<T>(Mutex<HashMap<ThreadId, T>>);

impl<T> Default for Handoff<T> {
    fn default() -> Self {
        Self(Mutex::new(HashMap::new()))
    }
}

impl<T> Handoff<T> {
    fn lock(&self) -> candle_core::Result<std::sync::MutexGuard<'_, HashMap<ThreadId, T>>> {
        self.0
            .lock()
            .map_err(|_| candle_core::Error::Msg("gradient handoff: a lock was poisoned".into()))
    }

    /// Leaves `value` for the backward running on `thread` (replacing what an earlier one,
    /// stopped by an error, left behind).
    pub(crate) fn put(&self, thread: ThreadId, value: T) -> candle_core::Result<()> {
        self.lock()?.insert(thread, value);
        Ok(())
    }

    /// `f` with what was left for the calling thread's backward, if anything; `done` says
    /// whether it is used up (then it is dropped).
    pub(crate) fn take_mine<R>(
        &self,
        f: impl FnOnce(&mut T) -> Option<R>,
        done: impl FnOnce(&T) -> bool,
    ) -> candle_core::Result<Option<R>> {
        let mut map = self.lock()?;
        let me = std::thread::current().id();
        let Some(value) = map.get_mut(&me) else {
            return Ok(None);
        };
        let got = f(value);
        if done(value) {
            map.remove(&me);
        }
        Ok(got)
    }

    /// What was left for the calling thread's backward, removed.
    pub(crate) fn remove_mine(&self) -> candle_core::Result<Option<T>> {
        Ok(self.lock()?.remove(&std::thread::current().id()))
    }
}
