//! Memory follows what a KV cache holds: storage grows with the tokens held (doubling), whatever
//! capacity a streaming window or a hint names, and never past the budget.

use crate::common;

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_posenc::limits::BudgetScope;
use candle_posenc::{
    AttentionConfig, AttentionOptions, KvCache, MultiHeadAttention, RopeConfig, RotaryEmbedding,
};

/// A causal RoPE block with 8 KV heads of 16 features.
fn block(dev: &Device) -> anyhow::Result<MultiHeadAttention> {
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let rope = RotaryEmbedding::new(&RopeConfig::new(16), dev)?;
    Ok(MultiHeadAttention::new(
        &AttentionConfig::new(128, 8).with_causal(true),
        Some(std::sync::Arc::new(rope)),
        vb,
    )?)
}

/// Streaming caches with windows of 2^20 and `usize::MAX` (and as many sinks) hold ten tokens
/// in storage for at most 512 positions, as a plain cache does; fed past its window, a small
/// streaming cache's storage stays within twice what it holds at once.
fn streaming_storage_follows_the_tokens_held(dev: &Device) -> anyhow::Result<()> {
    let mha = block(dev)?;
    let opts = AttentionOptions::default();
    let token = common::randn(0f32, 1.0, (1, 1, 128), dev)?;
    for (sinks, window) in [(4, 1 << 20), (usize::MAX, 4), (4, usize::MAX), (0, 1 << 30)] {
        let mut cache = KvCache::streaming(sinks, window);
        assert_eq!(
            cache.capacity(),
            0,
            "nothing allocated before the first token"
        );
        for _ in 0..10 {
            mha.forward_with(&token, &opts, Some(&mut cache))?;
        }
        assert_eq!(cache.len(), 10);
        assert!(
            (10..=512).contains(&cache.capacity()),
            "sinks {sinks} window {window}: storage for {} positions",
            cache.capacity()
        );
    }
    // 2 sinks and a window of 600: a chunk of 700 tokens, then single tokens past the window.
    let mut cache = KvCache::streaming(2, 600);
    let chunk = common::randn(0f32, 1.0, (1, 700, 128), dev)?;
    mha.forward_with(&chunk, &opts, Some(&mut cache))?;
    for _ in 0..5 {
        mha.forward_with(&token, &opts, Some(&mut cache))?;
    }
    assert_eq!(cache.len(), 602);
    assert!(
        (700..=1400).contains(&cache.capacity()),
        "{} positions",
        cache.capacity()
    );
    Ok(())
}

/// A capacity hint past the budget reserves what the budget holds, not the hint: 10^12
/// positions under a budget of 2^16 elements give 2^16 / (8 heads × 16) = 512 positions, and
/// the cache grows no further than the budget allows.
fn capacity_hints_stay_within_the_budget(dev: &Device) -> anyhow::Result<()> {
    let mha = block(dev)?;
    let opts = AttentionOptions::default();
    let _budget = BudgetScope::new(1 << 16);
    let mut cache = KvCache::with_capacity(1_000_000_000_000);
    let token = common::randn(0f32, 1.0, (1, 1, 128), dev)?;
    mha.forward_with(&token, &opts, Some(&mut cache))?;
    assert_eq!(cache.capacity(), 512);
    Ok(())
}

device_tests!(
    streaming_storage_follows_the_tokens_held,
    capacity_hints_stay_within_the_budget
);

/// The buffers kept between calls stay under their bound, are freed on request (the bytes
/// reported), and the next call is the same without them. Alone in its process: the kept
/// buffers are process-wide.
#[test]
fn kept_buffers_stay_bounded_and_release() -> anyhow::Result<()> {
    use candle_core::Module;
    use candle_posenc::limits::{kept_bytes, release_kept, KEPT_BYTES_MAX};
    if !crate::common::alone() {
        return crate::common::run_alone(concat!(
            module_path!(),
            "::kept_buffers_stay_bounded_and_release"
        ));
    }
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let cfg = AttentionConfig::new(128, 8).with_causal(true);
    MultiHeadAttention::new(&cfg, None, common::seeded_vb(&varmap, DType::F32, &dev))?;
    let plain: std::collections::HashMap<String, Tensor> = varmap
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("lock"))?
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().detach()))
        .collect();
    let mha = MultiHeadAttention::new(
        &cfg,
        None,
        VarBuilder::from_tensors(plain, DType::F32, &dev),
    )?;
    release_kept();
    assert_eq!(kept_bytes(), 0);
    let x = common::randn(0f32, 1.0, (2, 300, 128), &dev)?;
    let first = mha.forward(&x)?;
    // q, k, v and the attention output at least (2 × 300 × 128 f32 each).
    let held = kept_bytes();
    assert!(held >= 4 * 2 * 300 * 128 * 4, "{held} bytes kept");
    // Calls of other sizes leave the total under the bound (`cpu::workspace`'s unit test
    // covers the cap itself).
    for t in [1000, 7, 2000] {
        mha.forward(&common::randn(0f32, 1.0, (2, t, 128), &dev)?)?;
        assert!(
            kept_bytes() <= KEPT_BYTES_MAX,
            "{} bytes kept",
            kept_bytes()
        );
    }
    let before = kept_bytes();
    assert_eq!(release_kept(), before);
    assert_eq!(kept_bytes(), 0);
    let again = mha.forward(&x)?;
    assert_eq!(crate::common::max_abs_diff(&first, &again)?, 0.0);
    Ok(())
}
