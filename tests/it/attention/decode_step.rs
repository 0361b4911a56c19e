//! What one decoding step allocates, counted by a global allocator: nothing that grows with
//! the cache, in f32, bf16 and f16, for every encoding (the relative biases' rows over the
//! distances excepted, which are their answer, `H × (L + 1)` values, widened to f32 for the
//! core in half precision).
//!
//! The test binary's allocator counts every thread (`common::peak`), so the test runs itself
//! alone in a child process of the test binary (`common::run_alone`).

use crate::common;

use candle_core::{DType, Device};
use candle_posenc::{AttentionConfig, AttentionOptions, EncodingConfig, KvCache};

/// Bytes allocated by one decoding step after `len` cached tokens (after three warm-up steps,
/// which size the threads' reusable buffers; the fewest of five steps).
fn step_bytes(
    config: &EncodingConfig,
    dtype: DType,
    len: usize,
    (d_model, heads): (usize, usize),
) -> anyhow::Result<usize> {
    let dev = Device::Cpu;
    let attn = AttentionConfig::new(d_model, heads).with_causal(true);
    let (mha, _) = common::zoo::attention(config, &attn, dtype, &dev)?;
    let prefix = common::randn(0f32, 1.0, (1, len, d_model), &dev)?.to_dtype(dtype)?;
    let token = common::randn(0f32, 1.0, (1, 1, d_model), &dev)?.to_dtype(dtype)?;
    let opts = AttentionOptions::default();
    let mut cache = KvCache::with_capacity(len + 1);
    mha.forward_with(&prefix, &opts, Some(&mut cache))?;
    for _ in 0..3 {
        mha.forward_with(&token, &opts, Some(&mut cache))?;
        cache.truncate(len)?;
    }
    // The fewest bytes of five steps: a pool thread that takes a task for the first time sizes
    // its reusable buffers then (which thread does is up to the scheduler, and a busy machine
    // changes it), once, not per step.
    let mut fewest = usize::MAX;
    for _ in 0..5 {
        let before = common::peak::asked();
        let y = mha.forward_with(&token, &opts, Some(&mut cache))?;
        fewest = fewest.min(common::peak::asked() - before);
        assert_eq!(y.output.dims(), [1, 1, d_model]);
        drop(y);
        cache.truncate(len)?;
    }
    Ok(fewest)
}

/// A step after 1024 cached tokens allocates what a step after 64 does, for every encoding
/// and dtype; the relative biases (T5, the clipped bias) add their rows over the new
/// distances and nothing else (their distance → bucket lookup is read from a span built
/// O(log L) times, where every step used to build one of its own). Before the half-precision cache was read a tile at a time, a
/// bf16 step allocated the widened cache (about 2 MB more at 1024 tokens here), and before
/// the projections of a few tokens ran here, the widened weights (1 MB per step).
#[test]
fn a_step_allocates_nothing_that_grows_with_the_cache() -> anyhow::Result<()> {
    if !common::alone() {
        return common::run_alone(concat!(
            module_path!(),
            "::a_step_allocates_nothing_that_grows_with_the_cache"
        ));
    }
    let (d_model, heads) = (256, 4);
    let (short, long) = (64, 1024);
    let mut failures = Vec::new();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for (i, config) in common::zoo::configs(d_model, heads, 64).iter().enumerate() {
            let small = step_bytes(config, dtype, short, (d_model, heads))?;
            let large = step_bytes(config, dtype, long, (d_model, heads))?;
            // T5 and the clipped bias answer with a row per head over every distance, in the
            // block's dtype, which the core reads widened to f32.
            let widened = if dtype == DType::F32 { 0 } else { 4 };
            let rows = match config {
                EncodingConfig::T5(_) | EncodingConfig::ClippedBias(_) => {
                    heads * (dtype.size_in_bytes() + widened)
                }
                // FoX's answer is a sum per key and gate (G up to 2H, f32), which reaches the
                // core negated and packed: 80 bytes per key at H = 4 (the cache's states are
                // written in place; concatenated they added 16 more).
                EncodingConfig::Fox(_) => 3 * (2 * heads) * 4,
                _ => 0,
            };
            let allowed = rows * (long - short);
            let label = format!("{dtype:?} {}", common::zoo::label(i, config));
            println!("{label}: {small} bytes at L = {short}, {large} at L = {long}");
            // Per step the bytes stay near the chunk's own tensors (a few KiB at d_model 256),
            // not the weights (256 KiB each) or the cache.
            if large > small + allowed || small > 64 << 10 {
                failures.push(format!(
                    "{label}: {small} bytes at L = {short}, {large} at L = {long} (growth allowed: {allowed})"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}
