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
//! error, and ran 3–30× faster than candle's ops. What has not yet passed there (the table
//! above `proven_bias`) takes candle's ops, or keeps its keys unsplit, unless the switch
//! ([`crate::cuda`]'s) is on for every call.
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
    /// (the backward draws none), never returning the weights.
    pub(crate) fn choose(
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        grads: bool,
        weights: bool,
        dropout: bool,
    ) -> Option<Mode> {
        if weights || !crate::cuda::kernels_on(q.device()) || !kernel::takes(q, k, v) {
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
    /// map takes candle's ops either way, and by default so do rows not yet proven on a GPU
    /// ([`proven_bias`]).
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
        (keeps && values_shifted && proven_bias(bias)).then_some(self)
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

// What the kernels take but have not yet passed against the f64 block on a GPU (docs/gpu.md,
// the H200 run of 2026-11-28), and what the default reach (`crate::cuda::Reach::Proven`) does
// with it; switched on explicitly (`Reach::All`) the kernels take all of it:
//
// | call | by default | why not yet |
// |---|---|---|
// | rows mixed from a bank (Inkling's) | candle's ops | built in bf16 they missed the f64 block by 1.4%; built from f32 factors since, not rerun |
// | keys split across thread blocks (a few queries against many keys: decoding) with sinks, a window, chunks, padding, a mask or a soft cap | the kernel, keys unsplit | split so, run on the CPU emulator only; split with every encoding's terms, and unsplit with each of these, passed |

/// Whether the encoding's `bias` has passed on a GPU, or the kernels are on for every call
/// (the table above).
#[cfg(feature = "cuda")]
fn proven_bias(bias: Option<&LogitsBias>) -> bool {
    let mixed = matches!(bias, Some(LogitsBias::Relative(r)) if r.mixed_rows().is_some());
    !mixed || crate::cuda::switch_reach() == crate::cuda::Reach::All
}

/// Whether keys may be split across thread blocks for a call with `rules` (sinks, a window,
/// chunks, padding, a mask or a soft cap): none, or the kernels on for every call (the table
/// above).
#[cfg(feature = "cuda")]
fn proven_split(rules: bool) -> bool {
    !rules || crate::cuda::switch_reach() == crate::cuda::Reach::All
}

/// Without the `cuda` feature no value of [`Mode`] exists: these are never called.
#[cfg(not(feature = "cuda"))]
impl Mode {
    pub(crate) fn choose(
        _: (&Tensor, &Tensor, &Tensor),
        _grads: bool,
        _weights: bool,
        _dropout: bool,
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

    use super::{proven_bias, proven_split, Mode};
    use crate::attention::blocks::{LogitTerms, Path};
    use crate::cuda::FusedKernelScope;
    use crate::plug::{Columns, LogitsBias, RelativeBias};

    /// The default reach's table: mixed rows go to candle's ops and calls with rules keep their
    /// keys whole, unless the kernels are on for every call; plain rows and calls without
    /// rules are proven.
    #[test]
    fn the_default_reach_leaves_out_the_listed_calls() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let rows = Tensor::zeros((1, 2, 1, 9), DType::F32, &dev)?;
        let plain = LogitsBias::Relative(RelativeBias::new(rows, Columns::Shift(4))?);
        let mix = Tensor::zeros((1, 2, 5, 3), DType::F32, &dev)?;
        let bank = Tensor::zeros((3, 9), DType::F32, &dev)?;
        let mixed = LogitsBias::Relative(RelativeBias::mixed(mix, bank, Columns::Shift(4))?);
        // The process-wide default (no scope, nothing set, CANDLE_POSENC_CUDA_KERNEL unset).
        if std::env::var_os("CANDLE_POSENC_CUDA_KERNEL").is_none() {
            assert!(proven_bias(None) && proven_bias(Some(&plain)));
            assert!(!proven_bias(Some(&mixed)), "mixed rows");
            assert!(
                proven_split(false) && !proven_split(true),
                "split keys with rules"
            );
        }
        let _all = FusedKernelScope::new(true);
        assert!(
            proven_bias(Some(&mixed)) && proven_split(true),
            "on for every call"
        );
        Ok(())
    }

    /// The kernels take a bf16 block's dense terms and masks in f32, unrounded, as every path
    /// does (`blocks::terms`): decoding with ALiBi after 600 cached keys failed on an H100 when
    /// its causal row, down to −149.75, reached the kernel rounded to bf16.
    #[test]
    fn dense_terms_reach_the_kernel_unrounded() -> anyhow::Result<()> {
        let (row, terms) =
            crate::attention::blocks::terms::long_row_terms(Path::Cuda(Mode::Infer))?;
        for t in &terms.dense {
            assert_eq!(t.flatten_all()?.to_vec1::<f32>()?, row);
        }
        Ok(())
    }

    /// Mixed rows (Inkling's: each query's mix of a bank) reach the kernel built from f32
    /// factors: the product of bf16 factors rounded to bf16 and cast after was 1.4% of the
    /// largest output off the f64 block on an H200.
    #[test]
    fn mixed_rows_reach_the_kernel_built_in_f32() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let (mix, bank): (Vec<f32>, Vec<f32>) = (
            (0..2 * 5 * 3).map(|i| 1.0 + i as f32 / 64.0).collect(),
            (0..3 * 7).map(|i| 1.0 + i as f32 / 128.0).collect(),
        );
        let mix = Tensor::from_vec(mix, (1, 2, 5, 3), &dev)?.to_dtype(DType::BF16)?;
        let bank = Tensor::from_vec(bank, (3, 7), &dev)?.to_dtype(DType::BF16)?;
        let want = crate::matmul::broadcast_matmul(
            &mix.to_dtype(DType::F32)?,
            &bank.to_dtype(DType::F32)?,
        )?;
        let rows = RelativeBias::mixed(mix, bank, Columns::Shift(4))?;
        let q = Tensor::zeros((1, 2, 5, 64), DType::BF16, &dev)?;
        let terms = LogitTerms::new(
            Some(LogitsBias::Relative(rows)),
            None,
            (1, 2, 5, 3),
            Path::Cuda(Mode::Infer),
            &q,
        )?;
        let got = terms.rows[0].values()?;
        assert_eq!(got.dtype(), DType::F32);
        let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-6, "rows off the f32 product by {diff}");
        Ok(())
    }
}
