//! The decoding sections: one step against caches of growing length (`decode`), in half
//! precision against f32, and a streaming cache's step against a plain cache's (`streaming`).

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use candle_nn::VarBuilder;
use candle_posenc::{AttentionOptions, KvCache, MultiHeadAttention};

use crate::cases::{block, forward_once, Case};
use crate::{common, json_line, Bench};

/// The cache lengths of the decoding rows.
fn lens(bench: &Bench) -> &'static [usize] {
    match bench.quick {
        true => &[256, 512],
        false => &[1024, 2048, 4096, 16384],
    }
}

/// `--only decode`: one decoding step (one query) against a cache of L keys; time should grow
/// as O(L).
pub(crate) fn steps(bench: &Bench) -> Result<()> {
    let (heads, head_dim, d_model, runs, json) = (
        bench.heads,
        bench.head_dim,
        bench.d_model,
        bench.runs,
        bench.json,
    );
    let dev = &bench.dev;
    println!(
        "\none decoding step, B1 H{heads} D{head_dim}, cache of L keys (ratio: vs the previous L):"
    );
    println!(
        "{:<18} {:>8} {:>12} {:>10}",
        "encoding", "L", "median ms", "vs L/2"
    );
    for case in bench.all.iter().filter(|c| c.name != "shaw_direct_k64") {
        let mha = block(case, true, d_model, heads, &bench.vb)?;
        let mut prev: Option<f64> = None;
        for &len in lens(bench) {
            let prefix = Tensor::randn(0f32, 1.0, (1, len, d_model), dev)?;
            let token = Tensor::randn(0f32, 1.0, (1, 1, d_model), dev)?;
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
    Ok(())
}

/// A decoding step in half precision against the same step in f32, paired: the cache is read
/// in its dtype (half the bytes) and widened a key tile at a time.
pub(crate) fn half_steps(bench: &Bench) -> Result<()> {
    let (heads, head_dim, d_model) = (bench.heads, bench.head_dim, bench.d_model);
    println!("\none decoding step in half precision, B1 H{heads} D{head_dim}, against f32:");
    println!(
        "{:<18} {:>8} {:>6} {:>12} {:>12} {:>10}",
        "encoding", "L", "dtype", "f32 ms", "half ms", "vs f32"
    );
    for case in bench
        .all
        .iter()
        .filter(|c| matches!(c.name, "rope" | "alibi"))
    {
        let f32_block = block(case, true, d_model, heads, &bench.vb)?;
        for dtype in [candle_core::DType::BF16, candle_core::DType::F16] {
            let half_vb = common::inference_vb_of(&bench.dev, dtype);
            let half = block(case, true, d_model, heads, &half_vb)?;
            for &len in lens(bench) {
                half_step_row(bench, case.name, (&f32_block, &half), dtype, len)?;
            }
        }
    }
    Ok(())
}

/// One row of [`half_steps`]: the f32 and the half block's step against `len` cached keys.
fn half_step_row(
    bench: &Bench,
    name: &str,
    (f32_block, half): (&MultiHeadAttention, &MultiHeadAttention),
    dtype: candle_core::DType,
    len: usize,
) -> Result<()> {
    let (d_model, runs, json) = (bench.d_model, bench.runs, bench.json);
    let dev = &bench.dev;
    let prefix = Tensor::randn(0f32, 1.0, (1, len, d_model), dev)?;
    let token = Tensor::randn(0f32, 1.0, (1, 1, d_model), dev)?;
    let (prefix_h, token_h) = (prefix.to_dtype(dtype)?, token.to_dtype(dtype)?);
    let opts = AttentionOptions::default();
    let mut cache = KvCache::with_capacity(len + 1);
    let mut cache_h = KvCache::with_capacity(len + 1);
    f32_block.forward_with(&prefix, &opts, Some(&mut cache))?;
    half.forward_with(&prefix_h, &opts, Some(&mut cache_h))?;
    let p = common::paired(
        runs * 3,
        || {
            forward_once(f32_block, &token, &opts, Some(&mut cache))?;
            cache.truncate(len)?;
            Ok(())
        },
        || {
            forward_once(half, &token_h, &opts, Some(&mut cache_h))?;
            cache_h.truncate(len)?;
            Ok(())
        },
    )?;
    let dtype_name = format!("{dtype:?}").to_lowercase();
    println!(
        "{name:<18} {len:>8} {dtype_name:>6} {:>12.3} {:>12.3} {:>9.2}x",
        p.a_ms, p.b_ms, p.ratio
    );
    json_line(json, &format!(
        "\"bench\":\"decode_step_half\",\"encoding\":\"{name}\",\"cache\":{len},\"dtype\":\"{dtype:?}\",\"median_ms\":{:.4},\"f32_ms\":{:.4},\"ratio\":{:.4}",
        p.b_ms, p.a_ms, p.ratio
    ));
    Ok(())
}

/// `--only streaming`: [`streaming_rows`] for the RoPE block.
pub(crate) fn streaming_steps(bench: &Bench) -> Result<()> {
    let rope = bench
        .all
        .iter()
        .find(|c| c.name == "rope")
        .context("the rope case")?;
    let dims = (bench.d_model, bench.heads);
    streaming_rows(rope, dims, &bench.vb, &bench.dev, bench.quick, bench.json)
}

/// One decoding step of a causal RoPE block (B1, f32) with a streaming cache of 4 sinks and a
/// window of W, full (each step appends a token and evicts one), against a plain cache holding
/// the same 4 + W keys (each step appends a token, then is undone): paired medians, W = 4096
/// and 65536 (512 and 4096 with `--quick`). Both caches are filled by one causal forward.
fn streaming_rows(
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
            || forward_once(&mha, &token, &opts, Some(&mut streaming)),
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
