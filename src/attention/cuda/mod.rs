//! The block's CUDA path: the fused attention kernels behind one door. Without the `cuda`
//! feature [`Mode`] has no values, so the path cannot be chosen and every method here is
//! unreachable by type; with it, `kernel.rs` prepares a launch, `launch.rs` runs it and
//! `training.rs` grafts the backward onto candle's graph.
//!
//! The kernels (the `cuda` feature): `flash_forward.cu`, a
//! FlashAttention-2 forward on tensor cores for bf16 and f16 blocks (and f32 blocks at
//! `F32_HEAD_DIMS` in `kernel.rs`, each product as three TF32 ones), reading the plug's terms as
//! data (dense terms through broadcast strides, relative rows through a shift), causal limits,
//! windows, chunks, padding, soft caps, sinks and grouped KV heads. For training, its backward
//! (`posenc_flash_backward`, through `training.rs`) gives q, k, v, the sinks, every term
//! (dense or relative rows) and a value term's table their gradients.
//!
//! **On by default for what has passed on a GPU.** The kernels are compiled (NVRTC, every
//! specialisation, `.ci/cuda-kernels`) and run against f64 on a CPU emulator
//! (`tests/cuda_emulator`, `.ci/cuda-emulate`). On an H100 and an H200 (docs/gpu.md) they
//! matched the f64 block for every encoding but Inkling, forward and backward, with no memcheck
//! error, and ran 3–30× faster than candle's ops. The calls not yet run there ([`untried`])
//! take candle's ops unless the switch ([`crate::cuda`]'s) is on for every call.
//!
//! Compiled with NVRTC at first use (the crate's one cache, `crate::cuda::nvrtc`), one module
//! per head dimension and dtype, cached per process (the PTX) and per device (the module, by
//! candle's `get_or_load_custom_func`).
//! NVRTC rather than nvcc in `build.rs`: the crate's build stays free of a CUDA toolchain
//! beyond what candle's kernels already need, and the PTX targets the GPU at hand.
//!
//! ```text
//! out[b, first_row + i, h, :] = softmax_j(cap·tanh(q_i·k_j / cap) + Σ terms, hidden → −max) v
//! grid (⌈Tq / 64⌉, H, B), 128 threads; see flash_forward.cu for the schedule
//! ```

use candle_core::Tensor;

use super::fused_softmax::RowRule;
use crate::error::Result;
use crate::plug::{LogitsBias, RelativeBias, RelativeValues};

#[cfg(feature = "cuda")]
mod kernel;
#[cfg(feature = "cuda")]
mod launch;
#[cfg(feature = "cuda")]
mod training;

/// One query block of the fused CUDA core, written into rows `first_row..first_row + Tq` of the
/// merged `(B, T, H, D)` output. (Read only by the kernels, which the `cuda` feature builds.)
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
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
    pub values: Option<&'a RelativeValues>,
}

/// What the CUDA path runs a call's query blocks as.
#[cfg(feature = "cuda")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// The forward kernel, writing the merged output: inference.
    Infer,
    /// The forward with each row's statistics, and its backward grafted onto candle's graph.
    Train,
}

/// What the CUDA path runs a call's query blocks as: nothing, without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {}

#[cfg(feature = "cuda")]
impl Mode {
    /// The mode for scaled, rotated `q`, `k` and `v`, when the kernels are on for their device
    /// and take them ([`kernel::takes`]): inference, or training (`grads`) without `dropout`
    /// (the backward draws none), never returning the weights. `rules`: the call has sinks, a
    /// sliding window or chunks. By default the kernels take only what has passed on a GPU
    /// ([`untried`]).
    pub(crate) fn choose(
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        grads: bool,
        weights: bool,
        dropout: bool,
        rules: bool,
    ) -> Option<Mode> {
        use crate::cuda::{kernel_reach, Reach};
        let reach = kernel_reach(q.device());
        let untried = || untried(q.dim(2).unwrap_or(0), k.dim(2).unwrap_or(0), rules, None);
        let declined = match reach {
            Reach::Off => true,
            Reach::Proven => untried(),
            Reach::All => false,
        };
        if weights || declined || !kernel::takes(q, k, v) {
            return None;
        }
        match (grads, dropout) {
            (false, _) => Some(Mode::Infer),
            (true, false) => Some(Mode::Train),
            (true, true) => None,
        }
    }

    /// The mode once the first block's answers are known (`None`: candle's ops). Answers that
    /// track gradients leave inference; the backward gives dense terms, relative rows and a
    /// value table read through a shift their gradients (a separable bias, which this path
    /// reads summed, takes candle's ops). A value term read through an index
    /// map takes candle's ops either way.
    pub(crate) fn rechoose(
        self,
        tracked: bool,
        (bias, values): (Option<&LogitsBias>, Option<&RelativeValues>),
    ) -> Option<Mode> {
        let shifted = |c: &crate::plug::Columns| matches!(c, crate::plug::Columns::Shift(_));
        let keeps = match (self, tracked) {
            (Mode::Infer, true) => false,
            (Mode::Train, true) => match bias {
                Some(LogitsBias::Relative(r)) => shifted(r.columns()),
                // Summed to a dense (B, H, Tq, Tk) bias on this path: candle's ops instead.
                Some(LogitsBias::Separable(_)) => false,
                _ => true,
            },
            (_, false) => true,
        };
        let values_shifted = values.is_none_or(|v| shifted(v.columns()));
        let proven =
            crate::cuda::switch_reach() == crate::cuda::Reach::All || !untried(0, 0, false, bias);
        (keeps && values_shifted && proven).then_some(self)
    }

    /// Whether blocks come back token-major, `(B, n, H, D)` (training); inference writes the
    /// merged output.
    pub(crate) fn trains(self) -> bool {
        self == Mode::Train
    }

    /// The merged `(B, T, H, D)` output the forward writes, in the queries' dtype (inference
    /// only).
    pub(crate) fn output(self, q: &Tensor) -> Result<Option<Tensor>> {
        let (b, h, t, d) = q.dims4()?;
        Ok(match self {
            Mode::Infer => Some(Tensor::zeros((b, t, h, d), q.dtype(), q.device())?),
            Mode::Train => None,
        })
    }

    /// Columns per query the backward keeps beside a value term of `width` rows: two
    /// `(B, H, Tq, W)` f32 tensors (dO · a, and the weights its columns gather).
    pub(crate) fn kept_columns(self, width: usize) -> usize {
        match self {
            Mode::Train => width.saturating_mul(2),
            Mode::Infer => 0,
        }
    }

    /// Runs one query block: written into `merged` at `start` in inference, returned
    /// (`(B, n, H, D)`) in training.
    pub(crate) fn run(
        self,
        core: &CudaCore,
        merged: Option<&Tensor>,
        start: usize,
    ) -> Result<Option<Tensor>> {
        match (self, merged) {
            (Mode::Infer, Some(merged)) => {
                core.write_into(merged, start)?;
                Ok(None)
            }
            _ => Ok(Some(training::attend(core)?)),
        }
    }
}

/// Whether a call is one the kernels take but that has not yet passed against the f64 block on
/// a GPU, which the default reach ([`crate::cuda::Reach::Proven`]) leaves to candle's ops
/// (docs/gpu.md, the H200 run of 2026-11-28): `tq` queries against `tk` keys with `rules`
/// (sinks, a window or chunks), or the encoding's `bias`.
///
/// | call | why not yet |
/// |---|---|
/// | one tile of queries against more keys (decoding: keys split across blocks) with sinks, a window or chunks | run on the CPU emulator only |
/// | rows mixed from a bank (Inkling's) | built in bf16 they missed the f64 block by 1.4%; built from f32 factors since, not rerun |
#[cfg(feature = "cuda")]
fn untried(tq: usize, tk: usize, rules: bool, bias: Option<&LogitsBias>) -> bool {
    let split_keys = tq > 0 && tq <= kernel::TILE && tk > kernel::TILE;
    let mixed = matches!(bias, Some(LogitsBias::Relative(r)) if r.mixed_rows().is_some());
    (split_keys && rules) || mixed
}

/// Without the `cuda` feature no value of [`Mode`] exists: these are never called.
#[cfg(not(feature = "cuda"))]
impl Mode {
    pub(crate) fn choose(
        _: (&Tensor, &Tensor, &Tensor),
        _grads: bool,
        _weights: bool,
        _dropout: bool,
        _rules: bool,
    ) -> Option<Mode> {
        None
    }

    pub(crate) fn rechoose(
        self,
        _: bool,
        _: (Option<&LogitsBias>, Option<&RelativeValues>),
    ) -> Option<Mode> {
        match self {}
    }

    pub(crate) fn trains(self) -> bool {
        match self {}
    }

    pub(crate) fn output(self, _: &Tensor) -> Result<Option<Tensor>> {
        match self {}
    }

    pub(crate) fn kept_columns(self, _: usize) -> usize {
        match self {}
    }

    pub(crate) fn run(self, _: &CudaCore, _: Option<&Tensor>, _: usize) -> Result<Option<Tensor>> {
        match self {}
    }
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::untried;
    use crate::plug::{Columns, LogitsBias, RelativeBias};

    /// The default reach's list: decoding with sinks, a window or chunks, and mixed rows, are
    /// left to candle's ops; a prefill with them, decoding without them and plain rows are not.
    #[test]
    fn untried_calls_are_the_listed_ones() -> anyhow::Result<()> {
        assert!(untried(1, 600, true, None), "decoding with rules");
        assert!(untried(64, 65, true, None), "one tile against two");
        assert!(!untried(65, 600, true, None), "a prefill with rules");
        assert!(!untried(1, 600, false, None), "decoding without rules");
        assert!(!untried(1, 64, true, None), "one tile of keys: no split");
        let dev = Device::Cpu;
        let rows = Tensor::zeros((1, 2, 1, 9), DType::F32, &dev)?;
        let plain = LogitsBias::Relative(RelativeBias::new(rows, Columns::Shift(4))?);
        assert!(!untried(100, 100, false, Some(&plain)), "plain rows");
        let mix = Tensor::zeros((1, 2, 5, 3), DType::F32, &dev)?;
        let bank = Tensor::zeros((3, 9), DType::F32, &dev)?;
        let mixed = LogitsBias::Relative(RelativeBias::mixed(mix, bank, Columns::Shift(4))?);
        assert!(untried(100, 100, false, Some(&mixed)), "mixed rows");
        Ok(())
    }
}
