//! `--only cuda` (with `--features cuda`, on GPU 0): the fused CUDA kernels against candle's
//! ops, inference and training steps, then long training steps with the device memory they
//! took. `--max-t N` keeps lengths up to N; `--kernel-only` times the kernels alone (candle's
//! ops take most of the section's time, Shaw's training step seconds per run), to fit a short
//! GPU session.

use anyhow::Result;
use candle_core::{Device, Tensor};
use candle_posenc::AttentionOptions;

use crate::cases::{block, cases};
use crate::training::{train_step, trained_block};
use crate::{common, json_line, Bench};

/// The section: [`cuda_kernel`] up to `--max-t`, on a CUDA device only.
pub(crate) fn section(bench: &Bench) -> Result<()> {
    if !bench.dev.is_cuda() {
        return Ok(());
    }
    let max_t = bench
        .arg_after("--max-t")
        .map_or(Ok(usize::MAX), |v| v.parse())?;
    let ops = !bench.args.iter().any(|a| a == "--kernel-only");
    cuda_kernel(&bench.dev, (bench.quick, ops), max_t, bench.json)
}

/// Times `kernel` and, with `ops`, candle's ops in alternation ([`common::paired`]); without,
/// the kernel alone (the ops' time and the ratio are then NaN).
fn timed(
    runs: usize,
    ops: bool,
    on_ops: impl FnMut() -> Result<()>,
    mut kernel: impl FnMut() -> Result<()>,
) -> Result<common::Paired> {
    if ops {
        return common::paired(runs, on_ops, kernel);
    }
    let kernel_ms = common::median_ms(runs, &mut kernel)?;
    Ok(common::Paired {
        a_ms: f64::NAN,
        b_ms: kernel_ms,
        ratio: f64::NAN,
    })
}

/// The fused CUDA kernel against candle's ops on the same GPU: bf16, B4 d_model 1024 H16 D64
/// (B1 at T = 16384), one block forward per encoding with the kernel on and off, timed in
/// alternation (medians and the median per-pair ratio), and the attention's rate with the
/// kernel: 4·B·H·T²·D FLOP (half of it causal) over the whole block's time, a lower bound.
/// Then f32 (each product as three TF32 ones) for three encodings, and training steps.
fn cuda_kernel(dev: &Device, (quick, ops): (bool, bool), max_t: usize, json: bool) -> Result<()> {
    use candle_core::DType;
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
    kernel_against_ops(
        dev,
        DType::BF16,
        &upto(lengths, max_t),
        &names,
        (quick, ops),
        json,
    )?;
    let lengths: &[usize] = if quick { &[1024] } else { &[1024, 4096] };
    kernel_against_ops(
        dev,
        DType::F32,
        &upto(lengths, max_t),
        &["none", "alibi", "t5"],
        (quick, ops),
        json,
    )?;
    cuda_training(dev, (quick, ops), max_t, json)?;
    cuda_long_training(dev, quick, max_t.saturating_mul(4), json)
}

/// The lengths of `lengths` up to `max_t` (`--max-t`, to fit a short GPU session).
fn upto(lengths: &[usize], max_t: usize) -> Vec<usize> {
    lengths.iter().copied().filter(|&t| t <= max_t).collect()
}

/// [`cuda_kernel`]'s inference rows in `dtype` for the encodings `names` at `lengths`.
fn kernel_against_ops(
    dev: &Device,
    dtype: candle_core::DType,
    lengths: &[usize],
    names: &[&str],
    (quick, ops): (bool, bool),
    json: bool,
) -> Result<()> {
    use candle_posenc::cuda::FusedKernelScope;
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
                        let _kernels = FusedKernelScope::new(on);
                        let y = mha.forward_with(x, opts, None)?.output;
                        dev.synchronize()?;
                        drop(y);
                        Ok(())
                    }
                };
                let p = timed(runs, ops, run(false), run(true))?;
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
fn cuda_training(dev: &Device, (quick, ops): (bool, bool), max_t: usize, json: bool) -> Result<()> {
    use candle_core::DType;
    use candle_posenc::cuda::FusedKernelScope;
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
                        let _kernels = FusedKernelScope::new(on);
                        train_step(mha, xv, probe, opts, dev)
                    }
                };
                let p = timed(runs, ops, step(false), step(true))?;
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
fn cuda_long_training(dev: &Device, quick: bool, max_t: usize, json: bool) -> Result<()> {
    use candle_core::cuda_backend::cudarc;
    use candle_core::DType;
    use candle_posenc::cuda::FusedKernelScope;
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
    let _kernels = FusedKernelScope::new(true);
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

/// One row of the CUDA tables: candle's ops (`a`) against the kernels (`b`), and the rate of
/// `flop` in the kernels' median time.
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
