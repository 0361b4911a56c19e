//! The inference sections: the block per encoding against the block without one (`encodings`),
//! with the absolute encodings' input hooks alone and the same attention as plain candle ops;
//! the block in half precision against f32 (`half`); query block sizes (`blocks`).

use anyhow::Result;
use candle_core::{Module, Tensor};
use candle_nn::{linear_no_bias, Linear, VarBuilder};
use candle_posenc::plug::AttentionContext;
use candle_posenc::{AttentionConfig, AttentionOptions, MultiHeadAttention, Positions};

use crate::cases::{block, block_with, forward_once, Case};
use crate::children::infer_steps_in_child;
use crate::{common, json_line, Bench};

/// `--only encodings`: each encoding's block timed in alternation with the block without one
/// (both see the same machine state; the ratio is of the two medians), and alone in a fresh
/// process as a user's runs it (the figure to publish; on the CPU at B2, the child's shape).
pub(crate) fn encodings(bench: &Bench) -> Result<()> {
    let (b, heads, head_dim, t, runs) = (bench.b, bench.heads, bench.head_dim, bench.t, bench.runs);
    let dev = &bench.dev;
    println!(
        "attention block B{b} H{heads} T{t} D{head_dim} f32 on {dev:?}: median of {runs} runs, paired with the block without an encoding in this process (for causes);\nown proc: the block alone in a fresh process, as a user's runs it (the figure to publish)"
    );
    println!(
        "{:<18} {:>8} {:>12} {:>10} {:>10} {:>12}",
        "encoding", "causal", "median ms", "vs none", "per pair", "own proc ms"
    );
    for causal in [false, true] {
        let none = block(&bench.all[0], causal, bench.d_model, heads, &bench.vb)?;
        for case in &bench.all {
            encoding_row(bench, case, causal, &none)?;
        }
        input_hooks(bench, causal, &none)?;
        plain_candle(bench, causal, &none)?;
    }
    Ok(())
}

/// One encoding's row: its block paired with `none`, and its block in a child process.
fn encoding_row(bench: &Bench, case: &Case, causal: bool, none: &MultiHeadAttention) -> Result<()> {
    let (b, heads, d_model, t, runs, json) = bench.settings();
    let (dev, x) = (&bench.dev, &bench.x);
    let mha = block(case, causal, d_model, heads, &bench.vb)?;
    let opts = AttentionOptions::default();
    let common::Paired {
        a_ms: base,
        b_ms: ms,
        ratio,
    } = common::paired(
        runs,
        || forward_once(none, x, &opts, None),
        || forward_once(&mha, x, &opts, None),
    )?;
    let own = match dev.is_cpu() && b == 2 {
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
    Ok(())
}

/// The absolute encodings differ from the block without one only by their input hook; timed
/// alone (many runs, so a small figure is steady), its share of the block bounds their cost
/// more tightly than the ratio of two noisy block medians.
fn input_hooks(bench: &Bench, causal: bool, none: &MultiHeadAttention) -> Result<()> {
    let (t, runs, json) = (bench.t, bench.runs, bench.json);
    let (dev, x) = (&bench.dev, &bench.x);
    let positions = Positions::Offset(0);
    for case in bench
        .all
        .iter()
        .filter(|c| matches!(c.name, "sinusoidal" | "learned"))
    {
        let Some(enc) = &case.encoding else { continue };
        let (block_ms, hook_ms) = common::paired_median_ms(
            runs,
            || forward_once(none, x, &AttentionOptions::default(), None),
            || {
                for _ in 0..10 {
                    let y = enc.add_to_input(x, &AttentionContext::chunk(&positions, t))?;
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
    Ok(())
}

/// The same computation as plain candle ops on the same weights and input.
fn plain_candle(bench: &Bench, causal: bool, none: &MultiHeadAttention) -> Result<()> {
    let (heads, d_model, t, runs, json) =
        (bench.heads, bench.d_model, bench.t, bench.runs, bench.json);
    let (dev, x) = (&bench.dev, &bench.x);
    let plain = PlainAttention::new(d_model, heads, t, causal, &bench.vb)?;
    let (base, ms) = common::paired_median_ms(
        runs,
        || {
            let y = none.forward(x)?;
            drop(y);
            Ok(())
        },
        || {
            let y = plain.forward(x)?;
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
    Ok(())
}

/// `--only half`: the block in bf16 and f16 against the same block in f32, paired.
pub(crate) fn half(bench: &Bench) -> Result<()> {
    let (b, heads, head_dim, d_model, t, runs, json) = (
        bench.b,
        bench.heads,
        bench.head_dim,
        bench.d_model,
        bench.t,
        bench.runs,
        bench.json,
    );
    let (dev, x) = (&bench.dev, &bench.x);
    println!("\nhalf precision, B{b} H{heads} T{t} D{head_dim}: against f32 (target <= 1.30x)");
    println!(
        "{:<18} {:>8} {:>6} {:>12} {:>10}",
        "encoding", "causal", "dtype", "median ms", "vs f32"
    );
    for causal in [false, true] {
        for case in bench
            .all
            .iter()
            .filter(|c| matches!(c.name, "none" | "rope" | "alibi"))
        {
            let f32_block = block(case, causal, d_model, heads, &bench.vb)?;
            for dtype in [candle_core::DType::BF16, candle_core::DType::F16] {
                let half_vb = common::inference_vb_of(dev, dtype);
                let half = block(case, causal, d_model, heads, &half_vb)?;
                let xh = x.to_dtype(dtype)?;
                let opts = AttentionOptions::default();
                let p = common::paired(
                    runs,
                    || forward_once(&f32_block, x, &opts, None),
                    || forward_once(&half, &xh, &opts, None),
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
    Ok(())
}

/// `--only blocks`: the automatic query block size against fixed ones, causal, no encoding
/// and ALiBi.
pub(crate) fn query_blocks(bench: &Bench) -> Result<()> {
    let (b, heads, d_model, t, runs, json) = bench.settings();
    let (dev, x) = (&bench.dev, &bench.x);
    println!(
        "\nquery blocks, B{b} H{heads} T{t}, causal (auto = {} queries):",
        AttentionConfig::new(d_model, heads).query_block_for(b, t, t, 4)
    );
    println!(
        "{:<18} {:>10} {:>12} {:>10}",
        "encoding", "block", "median ms", "vs auto"
    );
    for case in bench
        .all
        .iter()
        .filter(|c| matches!(c.name, "none" | "alibi"))
    {
        let mut auto = None;
        for block in [None, Some(64), Some(128), Some(256), Some(512), Some(t)] {
            let cfg = AttentionConfig::new(d_model, heads)
                .with_causal(true)
                .with_query_block(block);
            let mha = block_with(case, cfg, &bench.vb)?;
            let ms = common::median_ms(runs, || {
                let y = mha.forward(x)?;
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
    Ok(())
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
