//! Attention block cost of each positional encoding, against the same block with no encoding
//! measured in the same run (ratio of the medians, and median of the per-pair ratios), and
//! alone in a fresh process as a user's process runs it (on the CPU; the figure to publish),
//! and the
//! block with no encoding against the same attention written as plain candle ops (matmul,
//! softmax_last_dim, matmul); the block in bf16 and f16 against f32; query block sizes; one decoding step
//! against caches of growing length; peak memory of Shaw attention against the direct formula;
//! long-context (T = 16384) forwards per encoding, with their peak memory; and training steps
//! (forward + backward) on the fused training core against candle's ops, with the peak memory
//! of a step at T = 8192.
//!
//! ```text
//! cargo bench --bench attention              # table of medians and ratios
//! cargo bench --bench attention -- --json    # one JSON object per line as well
//! cargo bench --bench attention -- --quick   # fewer, smaller runs (a smoke test)
//! cargo bench --bench attention -- --only decode   # one section: encodings, half, blocks,
//!                                                  # decode, memory, training, long, lengths,
//!                                                  # small (a small model's layer) or streaming
//! cargo bench --bench attention -- --only lengths --pytorch pytorch.jsonl --plot docs/img/lengths.png
//!     # forwards from T = 1k to 32k, drawn beside `pytorch_baseline.py --lengths --json`'s
//! cargo bench --features cuda --bench attention -- --only cuda [--max-t 4096]
//!     # on GPU 0: the fused CUDA kernels against candle's ops (bf16), inference and
//!     # training steps, beside `pytorch_baseline.py --device cuda`; then a training step
//!     # at T = 16384 and 65536 (B1) with the device memory it took
//! ```
//!
//! Run it on a quiet machine: a build or test beside it skews the figures by 2x or more.
//! Peak memory is read from `VmHWM` in `/proc/self/status` of a child process per case (Linux).
// Products of tensors this file lays out itself (clippy.toml sends the library's through
// src/matmul.rs).
#![allow(clippy::disallowed_methods)]

mod common;
#[path = "../examples/common/plot.rs"]
#[allow(dead_code)] // the benchmark draws one kind of chart
mod plot;
#[path = "sections/small_layer.rs"]
mod small_layer;

use anyhow::{Context, Result};
use candle_core::{Device, Module, Tensor};
use candle_nn::{linear_no_bias, Linear, VarBuilder};
use candle_posenc::plug::{AttentionContext, Columns, LogitsBias, RelativeValues};
use candle_posenc::{
    Alibi, AlibiConfig, AlibiMode, AttentionConfig, AttentionOptions, ClippedBiasConfig,
    ClippedRelativeBias, ForgettingGates, FoxConfig, InklingConfig, InklingRelativeLogits, KvCache,
    LearnedConfig, LearnedPositionalEncoding, MultiHeadAttention, PositionalEncoding, Positions,
    RopeConfig, RotaryEmbedding, ShawConfig, ShawRelativePosition, SinusoidalConfig,
    SinusoidalPositionalEncoding, T5Config, T5RelativeBias,
};
use std::sync::Arc;

/// Shaw et al.'s keys computed as the formula is written: the (T, T, d) tensor a^K[r(i, j)] is
/// built, then contracted per query position; the values term reaches the block as a table with
/// an explicit (T, T) column map. The memory baseline.
#[derive(Debug)]
struct DirectShaw {
    keys: Tensor,
    values: Tensor,
    k: i64,
}

impl DirectShaw {
    fn expanded(&self, table: &Tensor, tq: usize, tk: usize) -> candle_posenc::Result<Tensor> {
        let idx: Vec<u32> = (0..tq)
            .flat_map(|i| {
                (0..tk).map(move |j| ((j as i64 - i as i64).clamp(-self.k, self.k) + self.k) as u32)
            })
            .collect();
        let idx = Tensor::from_vec(idx, tq * tk, table.device())?;
        Ok(table
            .index_select(&idx, 0)?
            .reshape((tq, tk, table.dim(1)?))?)
    }
}

impl PositionalEncoding for DirectShaw {
    /// `q_i · a^K[r(i, j)]` through the `(Tq, Tk, d)` tensor, as the formula is written.
    fn logits_bias(
        &self,
        q: &Tensor,
        ctx: &AttentionContext,
    ) -> candle_posenc::Result<Option<LogitsBias>> {
        let (b, h, tq, d) = q.dims4()?;
        let tk = ctx.k_len;
        let ak = self.expanded(&self.keys, tq, tk)?; // (Tq, Tk, d)
        let qt = q
            .permute((2, 0, 1, 3))?
            .reshape((tq, b * h, d))?
            .contiguous()?;
        let bias = qt.matmul(&ak.transpose(1, 2)?.contiguous()?)?; // (Tq, B·H, Tk)
        let bias = bias.reshape((tq, b, h, tk))?.permute((1, 2, 0, 3))?;
        Ok(Some(LogitsBias::Dense(bias)))
    }

    /// `a^V` read at an explicit `(1, Tq, Tk)` map of `r(i, j)` (the plug carries a value term
    /// as a table and a column rule; the block sums the weights per column).
    fn value_term(&self, ctx: &AttentionContext) -> candle_posenc::Result<Option<RelativeValues>> {
        let (tq, tk) = (ctx.q_len, ctx.k_len);
        let idx: Vec<u32> = (0..tq)
            .flat_map(|i| {
                (0..tk).map(move |j| ((j as i64 - i as i64).clamp(-self.k, self.k) + self.k) as u32)
            })
            .collect();
        let idx = Tensor::from_vec(idx, (1, tq, tk), self.values.device())?;
        Ok(Some(RelativeValues::new(
            self.values.clone(),
            Columns::Index(idx),
        )?))
    }
}

struct Case {
    name: &'static str,
    encoding: Option<Arc<dyn PositionalEncoding>>,
}

fn cases(
    d_model: usize,
    heads: usize,
    head_dim: usize,
    max_len: usize,
    dev: &Device,
    vb: &VarBuilder,
) -> Result<Vec<Case>> {
    let case = |name, e: Arc<dyn PositionalEncoding>| Case {
        name,
        encoding: Some(e),
    };
    let shaw = ShawRelativePosition::new(&ShawConfig::new(head_dim, 64), vb.pp("shaw"))?;
    let direct = DirectShaw {
        keys: shaw.relative_keys().clone(),
        values: shaw.relative_values().context("values")?.clone(),
        k: 64,
    };
    Ok(vec![
        Case {
            name: "none",
            encoding: None,
        },
        case(
            "sinusoidal",
            Arc::new(SinusoidalPositionalEncoding::new(
                &SinusoidalConfig::new(d_model),
                dev,
            )?),
        ),
        case(
            "learned",
            Arc::new(LearnedPositionalEncoding::new(
                &LearnedConfig::new(d_model).with_max_len(max_len),
                vb.pp("wpe"),
            )?),
        ),
        case(
            "rope",
            Arc::new(RotaryEmbedding::new(&RopeConfig::new(head_dim), dev)?),
        ),
        case(
            "alibi",
            Arc::new(Alibi::new(&AlibiConfig::new(heads), dev)?),
        ),
        case(
            "alibi_symmetric",
            Arc::new(Alibi::new(
                &AlibiConfig::new(heads).with_mode(AlibiMode::Symmetric),
                dev,
            )?),
        ),
        case(
            "t5",
            Arc::new(T5RelativeBias::new(&T5Config::new(heads), vb.pp("t5"))?),
        ),
        case(
            "clipped_bias",
            Arc::new(ClippedRelativeBias::new(
                &ClippedBiasConfig::new(heads, 64),
                vb.pp("clipped"),
            )?),
        ),
        case("shaw_k64", Arc::new(shaw)),
        case("shaw_direct_k64", Arc::new(direct)),
        // Both halves of gates, so that one case serves causal and bidirectional blocks (a
        // causal block masks the reverse half's keys).
        case(
            "fox",
            Arc::new(ForgettingGates::new(
                &FoxConfig::new(d_model, heads).with_bidirectional(true),
                vb.pp("fox"),
            )?),
        ),
        // Inkling's full layers: d_rel 16, a bank of 1024 distances (HF's defaults), log-n
        // scaling from position 256 (alpha 0.1), so that a T = 1024 step scales and a T = 8192
        // one reaches past the bank.
        case(
            "inkling",
            Arc::new(InklingRelativeLogits::new(
                &InklingConfig::new(d_model, heads).with_log_scaling(Some(
                    candle_posenc::LogScaling {
                        n_floor: 256,
                        alpha: 0.1,
                    },
                )),
                vb.pp("inkling"),
            )?),
        ),
    ])
}

/// The cases of the CPU training steps.
const TRAINED: [&str; 8] = [
    "none",
    "rope",
    "alibi",
    "t5",
    "clipped_bias",
    "shaw_k64",
    "fox",
    "inkling",
];

fn block(
    case: &Case,
    causal: bool,
    d_model: usize,
    heads: usize,
    vb: &VarBuilder,
) -> Result<MultiHeadAttention> {
    block_with(
        case,
        AttentionConfig::new(d_model, heads).with_causal(causal),
        vb,
    )
}

fn block_with(case: &Case, cfg: AttentionConfig, vb: &VarBuilder) -> Result<MultiHeadAttention> {
    Ok(MultiHeadAttention::new(
        &cfg,
        case.encoding.clone(),
        vb.pp("attn"),
    )?)
}

/// The fused CUDA kernel against candle's ops on the same GPU: bf16, B4 d_model 1024 H16 D64
/// (B1 at T = 16384), one block forward per encoding with the kernel on and off, timed in
/// alternation (medians and the median per-pair ratio), and the attention's rate with the
/// kernel: 4·B·H·T²·D FLOP (half of it causal) over the whole block's time, a lower bound.
/// Then f32 (each product as three TF32 ones) for three encodings, and training steps.
#[cfg(feature = "cuda")]
fn cuda_kernel(dev: &Device, quick: bool, max_t: usize, json: bool) -> Result<()> {
    use candle_core::DType;
    use candle_posenc::cuda::set_fused_kernel;
    let names = [
        "none",
        "rope",
        "alibi",
        "alibi_symmetric",
        "t5",
        "clipped_bias",
        "shaw_k64",
    ];
    let lengths: &[usize] = if quick { &[1024] } else { &[1024, 4096, 16384] };
    kernel_against_ops(dev, DType::BF16, &upto(lengths, max_t), &names, quick, json)?;
    let lengths: &[usize] = if quick { &[1024] } else { &[1024, 4096] };
    kernel_against_ops(
        dev,
        DType::F32,
        &upto(lengths, max_t),
        &["none", "alibi", "t5"],
        quick,
        json,
    )?;
    cuda_training(dev, quick, max_t, json)?;
    cuda_long_training(dev, quick, max_t.saturating_mul(4), json)?;
    set_fused_kernel(false);
    Ok(())
}

/// The lengths of `lengths` up to `max_t` (`--max-t`, to fit a short GPU session).
#[cfg(feature = "cuda")]
fn upto(lengths: &[usize], max_t: usize) -> Vec<usize> {
    lengths.iter().copied().filter(|&t| t <= max_t).collect()
}

/// One decoding step of a causal RoPE block (B1, f32) with a streaming cache of 4 sinks and a
/// window of W, full (each step appends a token and evicts one), against a plain cache holding
/// the same 4 + W keys (each step appends a token, then is undone): paired medians, W = 4096
/// and 65536 (512 and 4096 with `--quick`). Both caches are filled by one causal forward.
fn streaming_steps(
    case: &Case,
    (d_model, heads): (usize, usize),
    vb: &VarBuilder,
    dev: &Device,
    quick: bool,
    json: bool,
) -> Result<()> {
    let windows: &[usize] = if quick { &[512, 4096] } else { &[4096, 65536] };
    let sinks = 4;
    let runs = if quick { 5 } else { 21 };
    let mha = block(case, true, d_model, heads, vb)?;
    let opts = AttentionOptions::default();
    println!(
        "
one decoding step, streaming cache (4 sinks + W) against a plain cache of as many keys, B1 H{heads} d_model {d_model}:"
    );
    println!(
        "{:<10} {:>12} {:>14} {:>10}",
        "W", "plain ms", "streaming ms", "per pair"
    );
    for &window in windows {
        let held = sinks + window;
        let prefix = Tensor::randn(0f32, 1.0, (1, held, d_model), dev)?;
        let token = Tensor::randn(0f32, 1.0, (1, 1, d_model), dev)?;
        let mut plain = KvCache::with_capacity(held + 1);
        mha.forward_with(&prefix, &opts, Some(&mut plain))?;
        let mut streaming = KvCache::streaming(sinks, window);
        mha.forward_with(&prefix, &opts, Some(&mut streaming))?;
        let p = common::paired(
            runs,
            || {
                let y = mha.forward_with(&token, &opts, Some(&mut plain))?;
                dev.synchronize()?;
                drop(y);
                plain.truncate(held)?;
                Ok(())
            },
            || {
                let y = mha.forward_with(&token, &opts, Some(&mut streaming))?;
                dev.synchronize()?;
                drop(y);
                Ok(())
            },
        )?;
        println!(
            "{window:<10} {:>12.3} {:>14.3} {:>9.2}x",
            p.a_ms, p.b_ms, p.ratio
        );
        json_line(
            json,
            &format!(
                "\"bench\":\"streaming_step\",\"window\":{window},\"plain_ms\":{:.4},\"streaming_ms\":{:.4},\"ratio\":{:.4}",
                p.a_ms, p.b_ms, p.ratio
            ),
        );
    }
    Ok(())
}

/// [`cuda_kernel`]'s inference rows in `dtype` for the encodings `names` at `lengths`.
#[cfg(feature = "cuda")]
fn kernel_against_ops(
    dev: &Device,
    dtype: candle_core::DType,
    lengths: &[usize],
    names: &[&str],
    quick: bool,
    json: bool,
) -> Result<()> {
    use candle_posenc::cuda::set_fused_kernel;
    let (heads, head_dim) = (16, 64);
    let d_model = heads * head_dim;
    let vb = common::inference_vb_of(dev, dtype);
    let longest = lengths.iter().max().copied().unwrap_or(1);
    let all = cases(d_model, heads, head_dim, longest + 1, dev, &vb)?;
    let kind = dtype.as_str();
    println!("\nfused CUDA kernel against candle's ops, {kind}, H{heads} D{head_dim}");
    println!(
        "{:<18} {:>6} {:>8} {:>10} {:>10} {:>9} {:>9}",
        "encoding", "T", "causal", "ops ms", "kernel ms", "per pair", "TFLOP/s"
    );
    for &t in lengths {
        let b = if t >= 16384 { 1 } else { 4 };
        let runs = if quick || t >= 16384 { 5 } else { 15 };
        let x = Tensor::randn(0f32, 1.0, (b, t, d_model), dev)?.to_dtype(dtype)?;
        for causal in [true, false] {
            for case in all.iter().filter(|c| names.contains(&c.name)) {
                let mha = block(case, causal, d_model, heads, &vb)?;
                let opts = AttentionOptions::default();
                let run = |on: bool| {
                    let (mha, x, opts) = (&mha, &x, &opts);
                    move || -> Result<()> {
                        set_fused_kernel(on);
                        let y = mha.forward_with(x, opts, None)?.output;
                        dev.synchronize()?;
                        drop(y);
                        Ok(())
                    }
                };
                let p = common::paired(runs, run(false), run(true))?;
                let flop =
                    4.0 * (b * heads * t * t * head_dim) as f64 / if causal { 2.0 } else { 1.0 };
                let bench = format!("cuda_kernel_{kind}");
                cuda_row(&bench, case.name, (t, causal), &p, flop, json);
            }
        }
    }
    Ok(())
}

/// One training step on CUDA (the forward in training mode, then the backward of Σ probe · out
/// to the input, every weight and the encoding's parameters), bf16, H16 D64, B4, T = 1024 and
/// 4096: candle's ops against the fused kernels (forward and backward), paired, and the
/// attention's rate with the kernels, counting the backward as 2.5 forwards (its five products
/// against the forward's two): 3.5 · 4·B·H·T²·D FLOP, half of it causal.
#[cfg(feature = "cuda")]
fn cuda_training(dev: &Device, quick: bool, max_t: usize, json: bool) -> Result<()> {
    use candle_core::DType;
    use candle_posenc::cuda::set_fused_kernel;
    let (heads, head_dim, b) = (16, 64, 4);
    let d_model = heads * head_dim;
    let lengths: &[usize] = if quick { &[1024] } else { &[1024, 4096] };
    let lengths = upto(lengths, max_t);
    println!(
        "\nCUDA training step, fused kernels against candle's ops, bf16, B{b} H{heads} D{head_dim}"
    );
    println!(
        "{:<18} {:>6} {:>8} {:>10} {:>10} {:>9} {:>9}",
        "encoding", "T", "causal", "ops ms", "kernel ms", "per pair", "TFLOP/s"
    );
    for &t in &lengths {
        let runs = if quick { 3 } else { 9 };
        let x = Tensor::randn(0f32, 1.0, (b, t, d_model), dev)?.to_dtype(DType::BF16)?;
        let probe = Tensor::randn(0f32, 1.0, (b, t, d_model), dev)?.to_dtype(DType::BF16)?;
        for causal in [true, false] {
            for name in ["none", "rope", "alibi", "t5", "clipped_bias", "shaw_k64"] {
                let (_varmap, mha) = trained_block(
                    name,
                    causal,
                    (heads, head_dim, t),
                    (candle_core::DType::BF16, dev),
                )?;
                let xv = candle_core::Var::from_tensor(&x)?;
                let opts = AttentionOptions {
                    train: true,
                    ..Default::default()
                };
                let step = |on: bool| {
                    let (mha, xv, probe, opts) = (&mha, &xv, &probe, &opts);
                    move || -> Result<()> {
                        set_fused_kernel(on);
                        train_step(mha, xv, probe, opts, dev)
                    }
                };
                let p = common::paired(runs, step(false), step(true))?;
                let flop = 3.5 * 4.0 * (b * heads * t * t * head_dim) as f64
                    / if causal { 2.0 } else { 1.0 };
                cuda_row("cuda_training", name, (t, causal), &p, flop, json);
            }
        }
    }
    Ok(())
}

/// Forward and backward at long context through the fused kernels: one training step, B1 H16
/// D64 bf16, causal, at T = 16384 and 65536, with the device memory the step took beyond what
/// was in use before it (the driver's free memory, sampled every millisecond on a second
/// thread, so a spike shorter than that can be missed; candle's stream-ordered pool returns
/// freed memory at each synchronisation, so the figure is the step's own). Beyond the weights it is O(T): four times the length takes about four times the
/// memory, where `(B, H, T, T)` f32 logits would take sixteen (275 GB at 65536, past any GPU).
#[cfg(feature = "cuda")]
fn cuda_long_training(dev: &Device, quick: bool, max_t: usize, json: bool) -> Result<()> {
    use candle_core::cuda_backend::cudarc;
    use candle_core::DType;
    use candle_posenc::cuda::set_fused_kernel;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let (heads, head_dim) = (16, 64);
    let d_model = heads * head_dim;
    let lengths: &[usize] = if quick { &[4096] } else { &[16384, 65536] };
    let lengths = upto(lengths, max_t);
    let ctx = dev.as_cuda_device()?.cuda_stream().context().clone();
    println!(
        "\nCUDA training step at long context, fused kernels, bf16, B1 H{heads} D{head_dim}, causal"
    );
    println!(
        "{:<18} {:>6} {:>10} {:>14} {:>9}",
        "encoding", "T", "seconds", "device MiB", "TFLOP/s"
    );
    set_fused_kernel(true);
    for name in ["none", "alibi", "t5", "shaw_k64"] {
        for &t in &lengths {
            let (_varmap, mha) = trained_block(
                name,
                true,
                (heads, head_dim, t),
                (candle_core::DType::BF16, dev),
            )?;
            let opts = AttentionOptions {
                train: true,
                ..Default::default()
            };
            let input = |t: usize| -> Result<Tensor> {
                Ok(Tensor::randn(0f32, 1.0, (1, t, d_model), dev)?.to_dtype(DType::BF16)?)
            };
            // The kernels compiled on a short step first.
            let short = input(256)?;
            train_step(
                &mha,
                &candle_core::Var::from_tensor(&short)?,
                &short,
                &opts,
                dev,
            )?;
            let (xv, probe) = (candle_core::Var::from_tensor(&input(t)?)?, input(t)?);
            dev.synchronize()?;
            let (free_before, _) = ctx.mem_get_info()?;
            let least_free = AtomicUsize::new(free_before);
            let done = AtomicBool::new(false);
            let start = std::time::Instant::now();
            let sampled = std::thread::scope(|s| -> Result<()> {
                // Sets `done` however the step ends (an error or a panic too).
                struct Done<'a>(&'a AtomicBool);
                impl Drop for Done<'_> {
                    fn drop(&mut self) {
                        self.0.store(true, Ordering::Relaxed);
                    }
                }
                // The context made current once; then the driver's query alone, whose error
                // is returned (`CudaContext::mem_get_info` would clear the context's recorded
                // error, which the step's thread reads).
                let sampler = s.spawn(|| -> Result<()> {
                    ctx.bind_to_thread()?;
                    while !done.load(Ordering::Relaxed) {
                        let (free, _) = cudarc::driver::result::mem_get_info()?;
                        least_free.fetch_min(free, Ordering::Relaxed);
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                    Ok(())
                });
                let step = {
                    let _done = Done(&done);
                    train_step(&mha, &xv, &probe, &opts, dev)
                };
                let sampled = sampler
                    .join()
                    .map_err(|_| anyhow::anyhow!("the memory sampler panicked"))?;
                step.and(sampled)
            });
            sampled?;
            let seconds = start.elapsed().as_secs_f64();
            let mib = (free_before - least_free.into_inner()) as f64 / (1u64 << 20) as f64;
            let flop = 3.5 * 4.0 * (heads * t * t * head_dim) as f64 / 2.0;
            let rate = flop / seconds / 1e12;
            println!("{name:<18} {t:>6} {seconds:>10.3} {mib:>14.0} {rate:>9.1}");
            json_line(json, &format!(
                "\"bench\":\"cuda_long_training\",\"encoding\":\"{name}\",\"t\":{t},\"seconds\":{seconds:.4},\"device_mib\":{mib:.1},\"tflops\":{rate:.2}"
            ));
        }
    }
    Ok(())
}

/// The block of the case `name` on `dev` in `dtype` with its weights (the encoding's too) in
/// a fresh `VarMap`, for training steps: `heads` of `head_dim`, tables for `t` positions.
fn trained_block(
    name: &str,
    causal: bool,
    (heads, head_dim, t): (usize, usize, usize),
    (dtype, dev): (candle_core::DType, &Device),
) -> Result<(candle_nn::VarMap, MultiHeadAttention)> {
    let varmap = candle_nn::VarMap::new();
    let tvb = VarBuilder::from_varmap(&varmap, dtype, dev);
    let d_model = heads * head_dim;
    let trained = cases(d_model, heads, head_dim, t, dev, &tvb)?;
    let case = trained
        .iter()
        .find(|c| c.name == name)
        .with_context(|| format!("training case {name}"))?;
    let mha = block(case, causal, d_model, heads, &tvb)?;
    Ok((varmap, mha))
}

/// One row of the CUDA tables: candle's ops (`a`) against the kernels (`b`), and the rate of
/// `flop` in the kernels' median time.
#[cfg(feature = "cuda")]
fn cuda_row(
    bench: &str,
    name: &str,
    (t, causal): (usize, bool),
    p: &common::Paired,
    flop: f64,
    json: bool,
) {
    let rate = flop / (p.b_ms * 1e-3) / 1e12;
    println!(
        "{name:<18} {t:>6} {causal:>8} {:>10.3} {:>10.3} {:>8.2}x {rate:>9.1}",
        p.a_ms, p.b_ms, p.ratio
    );
    json_line(json, &format!(
        "\"bench\":\"{bench}\",\"encoding\":\"{name}\",\"t\":{t},\"causal\":{causal},\"ops_ms\":{:.4},\"kernel_ms\":{:.4},\"pair_ratio\":{:.4},\"tflops\":{rate:.2}",
        p.a_ms, p.b_ms, p.ratio
    ));
}

/// One training step: the forward with `opts`, then the backward of Σ probe · out (in f32) to
/// every variable, the device synchronised before it returns.
fn train_step(
    mha: &MultiHeadAttention,
    x: &candle_core::Var,
    probe: &Tensor,
    opts: &AttentionOptions,
    dev: &Device,
) -> Result<()> {
    let out = mha.forward_with(x.as_tensor(), opts, None)?.output;
    let loss = (out * probe)?
        .to_dtype(candle_core::DType::F32)?
        .sum_all()?;
    let grads = loss.backward()?;
    dev.synchronize()?;
    drop(grads);
    Ok(())
}

/// Child mode: the training step of `name` as a user's process runs it (B2, the block on a
/// `VarMap`, nothing else run before), the median of 9 steps after 2, printed in ms.
fn train_steps_child(name: &str, t: usize, causal: bool) -> Result<()> {
    let dev = Device::Cpu;
    let d_model = 512;
    let (_varmap, mha) = trained_block(name, causal, (8, 64, t), (candle_core::DType::F32, &dev))?;
    let xv = candle_core::Var::randn(0f32, 1.0, (2, t, d_model), &dev)?;
    let probe = Tensor::randn(0f32, 1.0, (2, t, d_model), &dev)?;
    let opts = AttentionOptions {
        train: true,
        ..Default::default()
    };
    train_step(&mha, &xv, &probe, &opts, &dev)?;
    let ms = common::median_ms(9, || train_step(&mha, &xv, &probe, &opts, &dev))?;
    println!("{ms}");
    Ok(())
}

/// Child mode: the inference forward of `name` as a user's process runs it (B2, the block from
/// plain tensors as a loaded checkpoint gives them, nothing else run before), the median of 9
/// forwards after 2, printed in ms.
fn infer_steps_child(name: &str, t: usize, causal: bool) -> Result<()> {
    let dev = Device::Cpu;
    let (d_model, heads, head_dim) = (512, 8, 64);
    let vb = common::inference_vb(&dev);
    let all = cases(d_model, heads, head_dim, t, &dev, &vb)?;
    let case = all
        .iter()
        .find(|c| c.name == name)
        .with_context(|| format!("inference case {name}"))?;
    let mha = block(case, causal, d_model, heads, &vb)?;
    let x = Tensor::randn(0f32, 1.0, (2, t, d_model), &dev)?;
    let forward = || -> Result<()> {
        mha.forward(&x)?;
        Ok(())
    };
    forward()?;
    let ms = common::median_ms(9, forward)?;
    println!("{ms}");
    Ok(())
}

fn peak_rss_mib() -> Result<f64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let line = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .context("no VmHWM")?;
    let kib: f64 = line
        .split_whitespace()
        .nth(1)
        .context("VmHWM value")?
        .parse()?;
    Ok(kib / 1024.0)
}

/// The block's computation written as plain candle ops on the block's own weights: the four
/// projections, `softmax_last_dim(q kᵀ / √d + mask) v` with a fresh tensor per step.
struct PlainAttention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    heads: usize,
    causal: Option<Tensor>,
}

impl PlainAttention {
    fn new(d_model: usize, heads: usize, t: usize, causal: bool, vb: &VarBuilder) -> Result<Self> {
        let vb = vb.pp("attn");
        let mask = if causal {
            let m: Vec<f32> = (0..t)
                .flat_map(|i| (0..t).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
                .collect();
            Some(Tensor::from_vec(m, (t, t), vb.device())?)
        } else {
            None
        };
        Ok(Self {
            q: linear_no_bias(d_model, d_model, vb.pp("q_proj"))?,
            k: linear_no_bias(d_model, d_model, vb.pp("k_proj"))?,
            v: linear_no_bias(d_model, d_model, vb.pp("v_proj"))?,
            o: linear_no_bias(d_model, d_model, vb.pp("o_proj"))?,
            heads,
            causal: mask,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let hd = d / self.heads;
        let split = |l: &Linear| -> Result<Tensor> {
            Ok(l.forward(x)?
                .reshape((b, t, self.heads, hd))?
                .transpose(1, 2)?
                .contiguous()?)
        };
        let (q, k, v) = (split(&self.q)?, split(&self.k)?, split(&self.v)?);
        let mut s = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?;
        if let Some(m) = &self.causal {
            s = s.broadcast_add(m)?;
        }
        let p = candle_nn::ops::softmax_last_dim(&s)?;
        let out = p.matmul(&v)?.transpose(1, 2)?.reshape((b, t, d))?;
        Ok(self.o.forward(&out)?)
    }
}

/// Child mode: one forward of `name` at length `t` (or, with `train`, one training step: the
/// forward in training mode and the backward to the input, every weight and the encoding's
/// parameters), then print the peak resident memory and the step's time.
fn peak_child(name: &str, t: usize, causal: bool, train: bool) -> Result<()> {
    let dev = Device::Cpu;
    let (d_model, heads, head_dim) = (512, 8, 64);
    let varmap = candle_nn::VarMap::new();
    let vb = match train {
        true => VarBuilder::from_varmap(&varmap, candle_core::DType::F32, &dev),
        false => common::inference_vb(&dev),
    };
    // One learned table long enough for the decoding section too.
    let all = cases(d_model, heads, head_dim, t, &dev, &vb)?;
    let case = all
        .iter()
        .find(|c| c.name == name)
        .context("unknown case")?;
    let mha = block(case, causal, d_model, heads, &vb)?;
    let x = candle_core::Var::randn(0f32, 1.0, (1, t, d_model), &dev)?;
    let before = peak_rss_mib()?;
    let start = std::time::Instant::now();
    if train {
        let opts = AttentionOptions {
            train: true,
            ..Default::default()
        };
        let out = mha.forward_with(x.as_tensor(), &opts, None)?.output;
        out.sum_all()?.backward()?;
    } else {
        mha.forward(x.as_tensor())?;
    }
    let ms = start.elapsed().as_secs_f64() * 1e3;
    println!("{before} {} {ms}", peak_rss_mib()?);
    Ok(())
}

/// Runs [`peak_child`] in a fresh process: (MiB before the step, peak MiB, step ms).
fn run_child(name: &str, t: usize, causal: bool) -> Result<(f64, f64, f64)> {
    run_child_as("--peak-child", name, t, causal)
}

fn run_child_as(mode: &str, name: &str, t: usize, causal: bool) -> Result<(f64, f64, f64)> {
    let out = std::process::Command::new(std::env::current_exe()?)
        .args([mode, name, &t.to_string(), &causal.to_string()])
        .output()?;
    let text = String::from_utf8(out.stdout)?;
    let v: Vec<f64> = text
        .split_whitespace()
        .map(str::parse::<f64>)
        .collect::<Result<_, _>>()
        .unwrap_or_default();
    match v[..] {
        [before, peak, ms] => Ok((before, peak, ms)),
        _ => anyhow::bail!(
            "child {name} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

/// Runs [`train_steps_child`] in a fresh process: the median step in ms.
fn train_steps_in_child(name: &str, t: usize, causal: bool) -> Result<f64> {
    steps_in_child("--train-steps-child", name, t, causal)
}

/// Runs [`infer_steps_child`] in a fresh process: the median forward in ms.
fn infer_steps_in_child(name: &str, t: usize, causal: bool) -> Result<f64> {
    steps_in_child("--infer-steps-child", name, t, causal)
}

/// Runs this bench in child `mode` for one case: the median it prints, in ms.
fn steps_in_child(mode: &str, name: &str, t: usize, causal: bool) -> Result<f64> {
    let out = std::process::Command::new(std::env::current_exe()?)
        .args([mode, name, &t.to_string(), &causal.to_string()])
        .output()?;
    let text = String::from_utf8(out.stdout)?;
    text.trim().parse().map_err(|_| {
        anyhow::anyhow!(
            "child {name} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

fn json_line(json: bool, fields: &str) {
    if json {
        println!("{{{fields}}}");
    }
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--peak-child") {
        let t = args[i + 2].parse()?;
        let causal = args[i + 3].parse()?;
        return peak_child(&args[i + 1], t, causal, false);
    }
    if let Some(i) = args.iter().position(|a| a == "--train-steps-child") {
        let t = args[i + 2].parse()?;
        let causal = args[i + 3].parse()?;
        return train_steps_child(&args[i + 1], t, causal);
    }
    if let Some(i) = args.iter().position(|a| a == "--infer-steps-child") {
        let t = args[i + 2].parse()?;
        let causal = args[i + 3].parse()?;
        return infer_steps_child(&args[i + 1], t, causal);
    }
    if let Some(i) = args.iter().position(|a| a == "--peak-child-train") {
        let t = args[i + 2].parse()?;
        let causal = args[i + 3].parse()?;
        return peak_child(&args[i + 1], t, causal, true);
    }
    let json = args.iter().any(|a| a == "--json");
    let quick = args.iter().any(|a| a == "--quick");
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1));
    let section = |name: &str| only.is_none_or(|o| o == name);
    let dev = common::device()?;
    let (b, heads, head_dim) = (2, 8, 64);
    let t = if quick { 256 } else { 1024 };
    let runs = if quick { 3 } else { 25 };
    let d_model = heads * head_dim;
    let vb = common::inference_vb(&dev);
    let x = Tensor::randn(0f32, 1.0, (b, t, d_model), &dev)?;
    // One learned table long enough for the decoding section too.
    let all = cases(d_model, heads, head_dim, 16385, &dev, &vb)?;

    // The block alone in a fresh process, as a user's runs it (the figure to publish; the
    // paired columns are for finding causes): on the CPU at B2 only, the child's shape.
    let own_proc = dev.is_cpu() && b == 2;
    println!(
        "attention block B{b} H{heads} T{t} D{head_dim} f32 on {dev:?}: median of {runs} runs, paired with the block without an encoding in this process (for causes);\nown proc: the block alone in a fresh process, as a user's runs it (the figure to publish)"
    );
    println!(
        "{:<18} {:>8} {:>12} {:>10} {:>10} {:>12}",
        "encoding", "causal", "median ms", "vs none", "per pair", "own proc ms"
    );
    for causal in [false, true].into_iter().filter(|_| section("encodings")) {
        // Each encoding is timed in alternation with the block without one, so both see the
        // same machine state; the ratio is of the two medians.
        let none = block(&all[0], causal, d_model, heads, &vb)?;
        let mut baseline = None;
        for case in &all {
            let mha = block(case, causal, d_model, heads, &vb)?;
            let opts = AttentionOptions::default();
            let common::Paired {
                a_ms: base,
                b_ms: ms,
                ratio,
            } = common::paired(
                runs,
                || {
                    let y = none.forward_with(&x, &opts, None)?.output;
                    dev.synchronize()?;
                    drop(y);
                    Ok(())
                },
                || {
                    let y = mha.forward_with(&x, &opts, None)?.output;
                    dev.synchronize()?;
                    drop(y);
                    Ok(())
                },
            )?;
            baseline.get_or_insert(base);
            let own = match own_proc {
                true => Some(infer_steps_in_child(case.name, t, causal)?),
                false => None,
            };
            println!(
                "{:<18} {:>8} {:>12.2} {:>9.2}x {:>9.2}x {:>12}",
                case.name,
                causal,
                ms,
                ms / base,
                ratio,
                own.map_or("-".into(), |ms| format!("{ms:.2}"))
            );
            json_line(json, &format!(
                "\"bench\":\"attention\",\"encoding\":\"{}\",\"causal\":{causal},\"t\":{t},\"median_ms\":{ms:.3},\"ratio\":{:.4},\"pair_ratio\":{ratio:.4},\"own_proc_ms\":{}",
                case.name,
                ms / base,
                own.map_or("null".into(), |ms| format!("{ms:.3}"))
            ));
        }
        // The absolute encodings differ from the block without one only by their input hook;
        // timed alone (many runs, so a small figure is steady), its share of the block bounds
        // their cost more tightly than the ratio of two noisy block medians.
        let positions = Positions::Offset(0);
        for case in all
            .iter()
            .filter(|c| matches!(c.name, "sinusoidal" | "learned"))
        {
            let Some(enc) = &case.encoding else { continue };
            let (block_ms, hook_ms) = common::paired_median_ms(
                runs,
                || {
                    let y = none.forward_with(&x, &AttentionOptions::default(), None)?;
                    dev.synchronize()?;
                    drop(y);
                    Ok(())
                },
                || {
                    for _ in 0..10 {
                        let y = enc.add_to_input(&x, &AttentionContext::chunk(&positions, t))?;
                        dev.synchronize()?;
                        drop(y);
                    }
                    Ok(())
                },
            )?;
            let hook_ms = hook_ms / 10.0;
            println!(
                "{:<18} {:>8} {:>12.3} {:>9.3}x   (input hook alone, vs the block with none)",
                case.name,
                causal,
                hook_ms,
                1.0 + hook_ms / block_ms
            );
            json_line(json, &format!(
                "\"bench\":\"attention_input_hook\",\"encoding\":\"{}\",\"causal\":{causal},\"t\":{t},\"median_ms\":{hook_ms:.4},\"ratio\":{:.4}",
                case.name,
                1.0 + hook_ms / block_ms
            ));
        }
        // The same computation as plain candle ops on the same weights and input.
        let plain = PlainAttention::new(d_model, heads, t, causal, &vb)?;
        let (base, ms) = common::paired_median_ms(
            runs,
            || {
                let y = none.forward(&x)?;
                drop(y);
                Ok(())
            },
            || {
                let y = plain.forward(&x)?;
                dev.synchronize()?;
                drop(y);
                Ok(())
            },
        )?;
        println!(
            "{:<18} {:>8} {:>12.2} {:>9.2}x   (block none / plain = {:.2})",
            "plain candle",
            causal,
            ms,
            ms / base,
            base / ms
        );
        json_line(json, &format!(
            "\"bench\":\"attention\",\"encoding\":\"plain_candle\",\"causal\":{causal},\"t\":{t},\"median_ms\":{ms:.3},\"ratio\":{:.4}",
            ms / base
        ));
    }

    // Half precision: the block in bf16 and f16 against the same block in f32, paired (the
    // fused core runs on widened q, k and v in both half formats).
    if section("half") {
        println!("\nhalf precision, B{b} H{heads} T{t} D{head_dim}: against f32 (target <= 1.30x)");
        println!(
            "{:<18} {:>8} {:>6} {:>12} {:>10}",
            "encoding", "causal", "dtype", "median ms", "vs f32"
        );
    }
    for causal in [false, true].into_iter().filter(|_| section("half")) {
        for case in all
            .iter()
            .filter(|c| matches!(c.name, "none" | "rope" | "alibi"))
        {
            let f32_block = block(case, causal, d_model, heads, &vb)?;
            for dtype in [candle_core::DType::BF16, candle_core::DType::F16] {
                let half_vb = common::inference_vb_of(&dev, dtype);
                let half = block(case, causal, d_model, heads, &half_vb)?;
                let xh = x.to_dtype(dtype)?;
                let opts = AttentionOptions::default();
                let p = common::paired(
                    runs,
                    || {
                        let y = f32_block.forward_with(&x, &opts, None)?.output;
                        dev.synchronize()?;
                        drop(y);
                        Ok(())
                    },
                    || {
                        let y = half.forward_with(&xh, &opts, None)?.output;
                        dev.synchronize()?;
                        drop(y);
                        Ok(())
                    },
                )?;
                println!(
                    "{:<18} {:>8} {:>6} {:>12.2} {:>9.2}x",
                    case.name,
                    causal,
                    format!("{dtype:?}").to_lowercase(),
                    p.b_ms,
                    p.ratio
                );
                json_line(json, &format!(
                    "\"bench\":\"attention_half\",\"encoding\":\"{}\",\"causal\":{causal},\"dtype\":\"{dtype:?}\",\"t\":{t},\"median_ms\":{:.3},\"f32_ms\":{:.3},\"ratio\":{:.4}",
                    case.name, p.b_ms, p.a_ms, p.ratio
                ));
            }
        }
    }

    // Query block sizes: the automatic choice against fixed ones, no encoding and ALiBi.
    println!(
        "\nquery blocks, B{b} H{heads} T{t}, causal (auto = {} queries):",
        AttentionConfig::new(d_model, heads).query_block_for(b, t, t, 4)
    );
    println!(
        "{:<18} {:>10} {:>12} {:>10}",
        "encoding", "block", "median ms", "vs auto"
    );
    for case in all
        .iter()
        .filter(|c| section("blocks") && matches!(c.name, "none" | "alibi"))
    {
        let mut auto = None;
        for block in [None, Some(64), Some(128), Some(256), Some(512), Some(t)] {
            let cfg = AttentionConfig::new(d_model, heads)
                .with_causal(true)
                .with_query_block(block);
            let mha = block_with(case, cfg, &vb)?;
            let ms = common::median_ms(runs, || {
                let y = mha.forward(&x)?;
                dev.synchronize()?;
                drop(y);
                Ok(())
            })?;
            let base = *auto.get_or_insert(ms);
            let label = block.map_or("auto".to_string(), |n| n.to_string());
            println!(
                "{:<18} {label:>10} {ms:>12.2} {:>9.2}x",
                case.name,
                ms / base
            );
            json_line(json, &format!(
                "\"bench\":\"query_block\",\"encoding\":\"{}\",\"block\":\"{label}\",\"median_ms\":{ms:.3},\"ratio\":{:.4}",
                case.name, ms / base
            ));
        }
    }

    // One decoding step (one query) against a cache of L keys: time should grow as O(L).
    let lens: &[usize] = if quick {
        &[256, 512]
    } else {
        &[1024, 2048, 4096, 16384]
    };
    println!(
        "\none decoding step, B1 H{heads} D{head_dim}, cache of L keys (ratio: vs the previous L):"
    );
    println!(
        "{:<18} {:>8} {:>12} {:>10}",
        "encoding", "L", "median ms", "vs L/2"
    );
    for case in all
        .iter()
        .filter(|c| section("decode") && c.name != "shaw_direct_k64")
    {
        let mha = block(case, true, d_model, heads, &vb)?;
        let mut prev: Option<f64> = None;
        for &len in lens {
            let prefix = Tensor::randn(0f32, 1.0, (1, len, d_model), &dev)?;
            let token = Tensor::randn(0f32, 1.0, (1, 1, d_model), &dev)?;
            let mut cache = KvCache::with_capacity(len + 1);
            mha.forward_with(&prefix, &AttentionOptions::default(), Some(&mut cache))?;
            let ms = common::median_ms(runs * 3, || {
                // Each step appends at the same slot, then is undone (no copy of the cache).
                let y = mha.forward_with(&token, &AttentionOptions::default(), Some(&mut cache))?;
                dev.synchronize()?;
                drop(y);
                cache.truncate(len)?;
                Ok(())
            })?;
            let ratio = prev.map_or(1.0, |p| ms / p);
            prev = Some(ms);
            println!("{:<18} {len:>8} {ms:>12.3} {ratio:>9.2}x", case.name);
            json_line(json, &format!(
                "\"bench\":\"decode_step\",\"encoding\":\"{}\",\"cache\":{len},\"median_ms\":{ms:.4},\"ratio_vs_half\":{ratio:.4}",
                case.name
            ));
        }
    }

    // A decoding step in half precision against the same step in f32, paired: the cache is
    // read in its dtype (half the bytes) and widened a key tile at a time.
    if section("decode") {
        println!("\none decoding step in half precision, B1 H{heads} D{head_dim}, against f32:");
        println!(
            "{:<18} {:>8} {:>6} {:>12} {:>12} {:>10}",
            "encoding", "L", "dtype", "f32 ms", "half ms", "vs f32"
        );
    }
    for case in all
        .iter()
        .filter(|c| section("decode") && matches!(c.name, "rope" | "alibi"))
    {
        let f32_block = block(case, true, d_model, heads, &vb)?;
        for dtype in [candle_core::DType::BF16, candle_core::DType::F16] {
            let half_vb = common::inference_vb_of(&dev, dtype);
            let half = block(case, true, d_model, heads, &half_vb)?;
            for &len in lens {
                let prefix = Tensor::randn(0f32, 1.0, (1, len, d_model), &dev)?;
                let token = Tensor::randn(0f32, 1.0, (1, 1, d_model), &dev)?;
                let (prefix_h, token_h) = (prefix.to_dtype(dtype)?, token.to_dtype(dtype)?);
                let opts = AttentionOptions::default();
                let mut cache = KvCache::with_capacity(len + 1);
                let mut cache_h = KvCache::with_capacity(len + 1);
                f32_block.forward_with(&prefix, &opts, Some(&mut cache))?;
                half.forward_with(&prefix_h, &opts, Some(&mut cache_h))?;
                let p = common::paired(
                    runs * 3,
                    || {
                        let y = f32_block.forward_with(&token, &opts, Some(&mut cache))?;
                        dev.synchronize()?;
                        drop(y);
                        cache.truncate(len)?;
                        Ok(())
                    },
                    || {
                        let y = half.forward_with(&token_h, &opts, Some(&mut cache_h))?;
                        dev.synchronize()?;
                        drop(y);
                        cache_h.truncate(len)?;
                        Ok(())
                    },
                )?;
                let name = format!("{dtype:?}").to_lowercase();
                println!(
                    "{:<18} {len:>8} {name:>6} {:>12.3} {:>12.3} {:>9.2}x",
                    case.name, p.a_ms, p.b_ms, p.ratio
                );
                json_line(json, &format!(
                    "\"bench\":\"decode_step_half\",\"encoding\":\"{}\",\"cache\":{len},\"dtype\":\"{dtype:?}\",\"median_ms\":{:.4},\"f32_ms\":{:.4},\"ratio\":{:.4}",
                    case.name, p.b_ms, p.a_ms, p.ratio
                ));
            }
        }
    }

    // Peak memory at T = 2048, B1 H8 D64, k = 64: one child process per case.
    let t_mem = if quick { 512 } else { 2048 };
    println!(
        "\npeak resident memory, one causal forward, B1 H8 T{t_mem} D64 (child process each):"
    );
    println!(
        "{:<18} {:>14} {:>14} {:>10}",
        "encoding", "before MiB", "peak MiB", "vs none"
    );
    let mut base = None;
    for name in ["none", "shaw_k64", "shaw_direct_k64"]
        .into_iter()
        .filter(|_| section("memory"))
    {
        let (before, peak, _) = run_child(name, t_mem, true)?;
        let b0 = *base.get_or_insert(peak);
        println!("{name:<18} {before:>14.0} {peak:>14.0} {:>9.2}x", peak / b0);
        json_line(json, &format!("\"bench\":\"peak_memory\",\"encoding\":\"{name}\",\"t\":{t_mem},\"peak_mib\":{peak:.1},\"ratio\":{:.4}", peak / b0));
    }

    // Training: one step (the forward in training mode, then the backward of Σ probe · out to
    // the input, every weight and the encoding's parameters) on the fused training core,
    // against the same step on candle's ops (the path that returns the weights), paired.
    if section("training") {
        println!(
            "\ntraining step (forward + backward), B{b} H{heads} T{t} D{head_dim}: fused core vs candle ops, paired in this process (for causes);\nown proc: the fused step alone in a fresh process, as a user's runs (the figure to publish)"
        );
        println!(
            "{:<18} {:>8} {:>12} {:>12} {:>10} {:>12}",
            "encoding", "causal", "ops ms", "fused ms", "fused/ops", "own proc ms"
        );
    }
    let train_runs = if quick { 3 } else { 7 };
    for causal in [false, true].into_iter().filter(|_| section("training")) {
        for name in TRAINED {
            let f32_dev = (candle_core::DType::F32, &dev);
            let (_varmap, mha) = trained_block(name, causal, (heads, head_dim, t), f32_dev)?;
            let xv = candle_core::Var::from_tensor(&x)?;
            let probe = Tensor::randn(0f32, 1.0, x.shape(), &dev)?;
            let step = |return_weights: bool| -> Result<()> {
                let opts = AttentionOptions {
                    train: true,
                    return_weights,
                    ..Default::default()
                };
                train_step(&mha, &xv, &probe, &opts, &dev)
            };
            let p = common::paired(train_runs, || step(true), || step(false))?;
            let own = train_steps_in_child(name, t, causal)?;
            println!(
                "{name:<18} {causal:>8} {:>12.1} {:>12.1} {:>9.2}x {own:>12.1}",
                p.a_ms, p.b_ms, p.ratio
            );
            json_line(json, &format!(
                "\"bench\":\"training\",\"encoding\":\"{name}\",\"causal\":{causal},\"t\":{t},\"ops_ms\":{:.3},\"fused_ms\":{:.3},\"pair_ratio\":{:.4},\"own_process_ms\":{own:.3}",
                p.a_ms, p.b_ms, p.ratio
            ));
        }
    }
    // Training memory: one step at T = 8192 (B1), in a child process each.
    let t_train = if quick { 2048 } else { 8192 };
    if section("training") {
        println!(
            "\ntraining step memory, B1 H8 T{t_train} D64, causal (child process each; target < 2048 MiB):"
        );
        println!(
            "{:<18} {:>14} {:>14} {:>12}",
            "encoding", "before MiB", "peak MiB", "seconds"
        );
    }
    for name in ["none", "rope", "alibi", "t5", "shaw_k64", "fox", "inkling"]
        .into_iter()
        .filter(|_| section("training"))
    {
        let (before, peak, ms) = run_child_as("--peak-child-train", name, t_train, true)?;
        println!("{name:<18} {before:>14.0} {peak:>14.0} {:>12.2}", ms / 1e3);
        json_line(json, &format!("\"bench\":\"training_memory\",\"encoding\":\"{name}\",\"t\":{t_train},\"peak_mib\":{peak:.1},\"seconds\":{:.3}", ms / 1e3));
    }

    #[cfg(feature = "cuda")]
    if section("cuda") && only.is_some() && dev.is_cuda() {
        let max_t = args
            .iter()
            .position(|a| a == "--max-t")
            .and_then(|i| args.get(i + 1))
            .map_or(Ok(usize::MAX), |v| v.parse())?;
        cuda_kernel(&dev, quick, max_t, json)?;
    }

    // A streaming cache's decoding step against a plain cache's holding as many keys.
    if section("small") {
        small_layer::run(json, runs)?;
    }
    if section("streaming") && only.is_some() {
        let rope = all
            .iter()
            .find(|c| c.name == "rope")
            .context("the rope case")?;
        streaming_steps(rope, (d_model, heads), &vb, &dev, quick, json)?;
    }

    // Time against length: one block forward without an encoding, B1, T = 1k .. 32k (medians
    // of 3 in this process up to 8k, then one run in a child process each), optionally drawn
    // beside PyTorch's figures.
    if section("lengths") && only.is_some() {
        let none = &all[0];
        let lengths: &[usize] = if quick {
            &[1024, 2048]
        } else {
            &[1024, 2048, 4096, 8192, 16384, 32768]
        };
        println!("\nblock forward without an encoding, B1 H8 D64, by length:");
        println!("{:<10} {:>8} {:>12}", "T", "causal", "seconds");
        let mut ours: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
        for causal in [true, false] {
            let mut points = Vec::new();
            for &t in lengths {
                let secs = if t <= 8192 {
                    let mha = block(none, causal, d_model, heads, &vb)?;
                    let x = Tensor::randn(0f32, 1.0, (1, t, d_model), &dev)?;
                    common::median_ms(3, || {
                        let y = mha.forward(&x)?;
                        dev.synchronize()?;
                        drop(y);
                        Ok(())
                    })? / 1e3
                } else {
                    run_child("none", t, causal)?.2 / 1e3
                };
                println!("{t:<10} {causal:>8} {secs:>12.3}");
                json_line(
                    json,
                    &format!(
                        "\"bench\":\"length\",\"t\":{t},\"causal\":{causal},\"seconds\":{secs:.4}"
                    ),
                );
                points.push((t as f64, secs));
            }
            let mode = if causal { "causal" } else { "bidirectional" };
            ours.push((format!("ours, {mode}"), points));
        }
        let pytorch = args
            .iter()
            .position(|a| a == "--pytorch")
            .and_then(|i| args.get(i + 1));
        let plot_path = args
            .iter()
            .position(|a| a == "--plot")
            .and_then(|i| args.get(i + 1));
        if let (Some(file), Some(path)) = (pytorch, plot_path) {
            let mut series = ours;
            for causal in [true, false] {
                let mut points = Vec::new();
                for line in std::fs::read_to_string(file)?.lines() {
                    let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                        continue;
                    };
                    let case = v["case"].as_str().unwrap_or_default();
                    for &t in lengths {
                        if case
                            == format!(
                                "length T{t} causal={}",
                                if causal { "True" } else { "False" }
                            )
                        {
                            let ms = v["median_ms"].as_f64().context("median_ms")?;
                            points.push((t as f64, ms / 1e3));
                        }
                    }
                }
                let mode = if causal { "causal" } else { "bidirectional" };
                series.push((format!("PyTorch SDPA, {mode}"), points));
            }
            let ticks: Vec<f64> = lengths.iter().map(|&t| t as f64).collect();
            plot::line_chart(
                std::path::Path::new(path),
                (760, 420),
                &plot::Labels {
                    title: "one block forward, no bias, B1 H8 D64 (2-core EPYC, f32)",
                    x: "sequence length T",
                    y: "seconds",
                },
                &series,
                &ticks,
                true,
            )?;
            println!("wrote {path}");
        }
    }

    // Long context: one forward at T = 16384 per encoding, in a child process each.
    let t_long = if quick { 2048 } else { 16384 };
    println!(
        "\nlong context, one forward, B1 H8 T{t_long} D64 (child process each; limit 4096 MiB):"
    );
    println!(
        "{:<18} {:>8} {:>14} {:>12}",
        "encoding", "causal", "peak MiB", "seconds"
    );
    for causal in [true, false].into_iter().filter(|_| section("long")) {
        for case in all.iter().filter(|c| c.name != "shaw_direct_k64") {
            let (_, peak, ms) = run_child(case.name, t_long, causal)?;
            println!(
                "{:<18} {causal:>8} {peak:>14.0} {:>12.2}",
                case.name,
                ms / 1e3
            );
            json_line(json, &format!("\"bench\":\"long_context\",\"encoding\":\"{}\",\"causal\":{causal},\"t\":{t_long},\"peak_mib\":{peak:.1},\"seconds\":{:.3}", case.name, ms / 1e3));
        }
    }
    Ok(())
}
