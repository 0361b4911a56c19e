//! The bench's child modes: one case measured in a fresh process, as a user's process runs it
//! (the figures to publish), and the parent's side that starts them and reads what they print.

use anyhow::{Context, Result};
use candle_core::{Device, Module, Tensor};
use candle_nn::VarBuilder;
use candle_posenc::AttentionOptions;

use crate::cases::{block, cases};
use crate::common;
use crate::training::{train_step, trained_block};

/// The child modes: `--<mode> NAME T CAUSAL` on the command line.
const MODES: [&str; 4] = [
    "--peak-child",
    "--peak-child-train",
    "--train-steps-child",
    "--infer-steps-child",
];

/// The child mode `args` name, run; `None` when they name none (the parent's run).
pub(crate) fn run_mode(args: &[String]) -> Option<Result<()>> {
    let (i, mode) = args
        .iter()
        .enumerate()
        .find_map(|(i, a)| MODES.iter().find(|m| **m == a.as_str()).map(|m| (i, *m)))?;
    Some(run_case(mode, args.get(i + 1..i + 4)))
}

/// One child mode for the case `NAME T CAUSAL`.
fn run_case(mode: &str, case: Option<&[String]>) -> Result<()> {
    let [name, t, causal] = case.context("a child mode takes NAME T CAUSAL")? else {
        anyhow::bail!("a child mode takes NAME T CAUSAL")
    };
    let (t, causal) = (t.parse()?, causal.parse()?);
    match mode {
        "--peak-child" => peak_child(name, t, causal, false),
        "--peak-child-train" => peak_child(name, t, causal, true),
        "--train-steps-child" => train_steps_child(name, t, causal),
        _ => infer_steps_child(name, t, causal),
    }
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
pub(crate) fn run_child(name: &str, t: usize, causal: bool) -> Result<(f64, f64, f64)> {
    run_child_as("--peak-child", name, t, causal)
}

pub(crate) fn run_child_as(
    mode: &str,
    name: &str,
    t: usize,
    causal: bool,
) -> Result<(f64, f64, f64)> {
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
pub(crate) fn train_steps_in_child(name: &str, t: usize, causal: bool) -> Result<f64> {
    steps_in_child("--train-steps-child", name, t, causal)
}

/// Runs [`infer_steps_child`] in a fresh process: the median forward in ms.
pub(crate) fn infer_steps_in_child(name: &str, t: usize, causal: bool) -> Result<f64> {
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
