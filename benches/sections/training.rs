//! The training sections (`training`): a step (the forward in training mode, then the backward
//! of Σ probe · out to the input, every weight and the encoding's parameters) on the fused
//! training core against the same step on candle's ops, and a long step's peak memory.

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use candle_nn::VarBuilder;
use candle_posenc::{AttentionOptions, MultiHeadAttention};

use crate::cases::{block, cases, TRAINED};
use crate::children::{run_child_as, train_steps_in_child};
use crate::{common, json_line, Bench};

/// `--only training`: each trained case's step on the fused core against the same step on
/// candle's ops (the path that returns the weights), paired in this process (for causes), and
/// the fused step alone in a fresh process (the figure to publish).
pub(crate) fn steps(bench: &Bench) -> Result<()> {
    let (b, heads, head_dim, t, quick, json) = (
        bench.b,
        bench.heads,
        bench.head_dim,
        bench.t,
        bench.quick,
        bench.json,
    );
    let (dev, x) = (&bench.dev, &bench.x);
    println!(
        "\ntraining step (forward + backward), B{b} H{heads} T{t} D{head_dim}: fused core vs candle ops, paired in this process (for causes);\nown proc: the fused step alone in a fresh process, as a user's runs (the figure to publish)"
    );
    println!(
        "{:<18} {:>8} {:>12} {:>12} {:>10} {:>12}",
        "encoding", "causal", "ops ms", "fused ms", "fused/ops", "own proc ms"
    );
    let train_runs = if quick { 3 } else { 7 };
    for causal in [false, true] {
        for name in TRAINED {
            let f32_dev = (candle_core::DType::F32, dev);
            let (_varmap, mha) = trained_block(name, causal, (heads, head_dim, t), f32_dev)?;
            let xv = candle_core::Var::from_tensor(x)?;
            let probe = Tensor::randn(0f32, 1.0, x.shape(), dev)?;
            let step = |return_weights: bool| -> Result<()> {
                let opts = AttentionOptions {
                    train: true,
                    return_weights,
                    ..Default::default()
                };
                train_step(&mha, &xv, &probe, &opts, dev)
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
    Ok(())
}

/// Training memory: one causal step at T = 8192 (B1), in a child process each.
pub(crate) fn memory(bench: &Bench) -> Result<()> {
    let t_train = if bench.quick { 2048 } else { 8192 };
    println!(
        "\ntraining step memory, B1 H8 T{t_train} D64, causal (child process each; target < 2048 MiB):"
    );
    println!(
        "{:<18} {:>14} {:>14} {:>12}",
        "encoding", "before MiB", "peak MiB", "seconds"
    );
    for name in ["none", "rope", "alibi", "t5", "shaw_k64", "fox", "inkling"] {
        let (before, peak, ms) = run_child_as("--peak-child-train", name, t_train, true)?;
        println!("{name:<18} {before:>14.0} {peak:>14.0} {:>12.2}", ms / 1e3);
        json_line(bench.json, &format!("\"bench\":\"training_memory\",\"encoding\":\"{name}\",\"t\":{t_train},\"peak_mib\":{peak:.1},\"seconds\":{:.3}", ms / 1e3));
    }
    Ok(())
}

/// The block of the case `name` on `dev` in `dtype` with its weights (the encoding's too) in
/// a fresh `VarMap`, for training steps: `heads` of `head_dim`, tables for `t` positions.
pub(crate) fn trained_block(
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

/// One training step: the forward with `opts`, then the backward of Σ probe · out (in f32) to
/// every variable, the device synchronised before it returns.
pub(crate) fn train_step(
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
