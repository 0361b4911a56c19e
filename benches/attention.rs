//! Attention block cost of each positional encoding, against the same block with no encoding
//! measured in the same run; and the peak memory of Shaw attention against the direct formula.
//!
//! ```text
//! cargo bench --bench attention              # table of medians and ratios
//! cargo bench --bench attention -- --json    # one JSON object per line as well
//! cargo bench --bench attention -- --quick   # fewer, smaller runs (a smoke test)
//! ```
//!
//! Run it on a quiet machine: a build or test beside it skews the figures by 2x or more.
//! Peak memory is read from `VmHWM` in `/proc/self/status` of a child process per case (Linux).

mod common;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_posenc::{
    Alibi, AlibiConfig, AlibiMode, AttentionConfig, AttentionOptions, ClippedBiasConfig,
    ClippedRelativeBias, LearnedConfig, LearnedPositionalEncoding, MultiHeadAttention,
    PositionalEncoding, Positions, RopeConfig, RotaryEmbedding, ShawConfig, ShawRelativePosition,
    SinusoidalConfig, SinusoidalPositionalEncoding, T5Config, T5RelativeBias,
};
use std::sync::Arc;

/// Shaw et al. computed as the formula is written: the (T, T, d) tensors a^K[r(i, j)] and
/// a^V[r(i, j)] are built, then contracted per query position. The memory baseline.
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
    fn logits_bias(
        &self,
        q: &Tensor,
        _: &Positions,
        _: &Positions,
        tk: usize,
    ) -> candle_posenc::Result<Option<Tensor>> {
        let (b, h, tq, d) = q.dims4()?;
        let ak = self.expanded(&self.keys, tq, tk)?; // (Tq, Tk, d)
        let qt = q
            .permute((2, 0, 1, 3))?
            .reshape((tq, b * h, d))?
            .contiguous()?;
        let bias = qt.matmul(&ak.transpose(1, 2)?.contiguous()?)?; // (Tq, B·H, Tk)
        Ok(Some(bias.reshape((tq, b, h, tk))?.permute((1, 2, 0, 3))?))
    }

    fn value_term(
        &self,
        probs: &Tensor,
        _: &Positions,
        _: &Positions,
    ) -> candle_posenc::Result<Option<Tensor>> {
        let (b, h, tq, tk) = probs.dims4()?;
        let av = self.expanded(&self.values, tq, tk)?; // (Tq, Tk, d)
        let pt = probs
            .permute((2, 0, 1, 3))?
            .reshape((tq, b * h, tk))?
            .contiguous()?;
        let out = pt.matmul(&av)?; // (Tq, B·H, d)
        let d = out.dim(2)?;
        Ok(Some(out.reshape((tq, b, h, d))?.permute((1, 2, 0, 3))?))
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
                DType::F32,
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
    ])
}

fn block(
    case: &Case,
    causal: bool,
    d_model: usize,
    heads: usize,
    vb: &VarBuilder,
) -> Result<MultiHeadAttention> {
    let cfg = AttentionConfig::new(d_model, heads).with_causal(causal);
    Ok(MultiHeadAttention::new(
        &cfg,
        case.encoding.clone(),
        vb.pp("attn"),
    )?)
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

/// Child mode: one forward of `name` at T = 2048, then print the peak resident memory.
fn peak_child(name: &str, t: usize) -> Result<()> {
    let dev = Device::Cpu;
    let (d_model, heads, head_dim) = (512, 8, 64);
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
    let all = cases(d_model, heads, head_dim, t, &dev, &vb)?;
    let case = all
        .iter()
        .find(|c| c.name == name)
        .context("unknown case")?;
    let mha = block(case, true, d_model, heads, &vb)?;
    let x = Tensor::randn(0f32, 1.0, (1, t, d_model), &dev)?;
    let before = peak_rss_mib()?;
    mha.forward(&x)?;
    println!("{before} {}", peak_rss_mib()?);
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--peak-child") {
        let t = args[i + 2].parse()?;
        return peak_child(&args[i + 1], t);
    }
    let json = args.iter().any(|a| a == "--json");
    let quick = args.iter().any(|a| a == "--quick");
    let dev = common::device()?;
    let (b, heads, head_dim) = (2, 8, 64);
    let t = if quick { 256 } else { 1024 };
    let runs = if quick { 3 } else { 9 };
    let d_model = heads * head_dim;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
    let x = Tensor::randn(0f32, 1.0, (b, t, d_model), &dev)?;

    println!(
        "attention block B{b} H{heads} T{t} D{head_dim} f32 on {dev:?}: median of {runs} runs"
    );
    println!(
        "{:<18} {:>8} {:>12} {:>10}",
        "encoding", "causal", "median ms", "vs none"
    );
    for causal in [false, true] {
        let mut baseline = None;
        for case in cases(d_model, heads, head_dim, t, &dev, &vb)? {
            let mha = block(&case, causal, d_model, heads, &vb)?;
            let opts = AttentionOptions::default();
            let ms = common::median_ms(runs, || {
                let y = mha.forward_with(&x, &opts, None)?.output;
                dev.synchronize()?;
                drop(y);
                Ok(())
            })?;
            let base = *baseline.get_or_insert(ms);
            println!(
                "{:<18} {:>8} {:>12.2} {:>9.2}x",
                case.name,
                causal,
                ms,
                ms / base
            );
            if json {
                println!(
                    "{{\"bench\":\"attention\",\"encoding\":\"{}\",\"causal\":{causal},\"t\":{t},\"median_ms\":{ms:.3},\"ratio\":{:.4}}}",
                    case.name,
                    ms / base
                );
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
    let exe = std::env::current_exe()?;
    let mut base = None;
    for name in ["none", "shaw_k64", "shaw_direct_k64"] {
        let out = std::process::Command::new(&exe)
            .args(["--peak-child", name, &t_mem.to_string()])
            .output()?;
        let text = String::from_utf8(out.stdout)?;
        let mut parts = text.split_whitespace().map(str::parse::<f64>);
        let (before, peak) = match (parts.next(), parts.next()) {
            (Some(Ok(a)), Some(Ok(b))) => (a, b),
            _ => anyhow::bail!(
                "child {name} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ),
        };
        let b0 = *base.get_or_insert(peak);
        println!("{name:<18} {before:>14.0} {peak:>14.0} {:>9.2}x", peak / b0);
        if json {
            println!("{{\"bench\":\"peak_memory\",\"encoding\":\"{name}\",\"t\":{t_mem},\"peak_mib\":{peak:.1},\"ratio\":{:.4}}}", peak / b0);
        }
    }
    Ok(())
}
