//! The fused attention core (CPU inference without returned weights: both products, biases,
//! masks and softmax per head and tile of queries) and the fused training core against the
//! unfused path (candle's ops, training with the weights returned), for
//! every encoding configuration, with grouped KV heads, more queries than one tile, query
//! blocks, padding (with fully masked rows), an additive mask, ids and a KV cache.

use crate::common;

use candle_core::{DType, Device, Tensor};
use candle_posenc::{AttentionConfig, AttentionOptions, KvCache, Positions};
use common::{assert_close, zoo};

/// Queries (tiles of several rows are tested in the crate's own unit tests).
const T: usize = 70;

/// 3e-6 of the largest output, at least 3e-6. The random weights make outputs of 30–50, where
/// one f32 ulp is 4e-6, and the output projection amplifies the core's rounding; the paths
/// differ in summation order and in `exp` (the fused pass's polynomial is within 3e-7 relative
/// of the library's). Over repeated runs the difference reached 1.4e-6 of the largest output.
fn tolerance(want: &Tensor) -> anyhow::Result<f64> {
    Ok(3e-6 * f64::from(want.abs()?.max_all()?.to_scalar::<f32>()?).max(1.0))
}

fn fused_core_equals_unfused(dev: &Device) -> anyhow::Result<()> {
    let (d_model, heads, head_dim) = (32, 4, 8);
    let x = common::randn(0f32, 1.0, (2, T, d_model), dev)?;
    // Sequence 0: its first 3 keys padded, so its first causal rows are fully masked.
    let mut keep = vec![1u8; 2 * T];
    keep[..3].fill(0);
    keep[T + 40] = 0;
    let pad = Tensor::from_vec(keep, (2, T), dev)?;
    let extra = common::randn(0f32, 1.0, (1, heads, T, T), dev)?;
    let ids: Vec<u32> = (0..T as u32).map(|i| (i * 7) % 50).collect();
    let ids = Positions::ids(&Tensor::new(ids.as_slice(), dev)?.unsqueeze(0)?)?;
    for (i, config) in zoo::configs(d_model, heads, head_dim).iter().enumerate() {
        for causal in [false, true] {
            for block in [None, Some(5)] {
                let attn = AttentionConfig::new(d_model, heads)
                    .with_kv_heads(2)
                    .with_causal(causal)
                    .with_query_block(block);
                let (mha, _vars) = zoo::attention(config, &attn, DType::F32, dev)?;
                let cases: [(Option<&Tensor>, Option<&Tensor>, Option<&Positions>); 4] = [
                    (None, None, None),
                    (Some(&pad), None, None),
                    (Some(&pad), Some(&extra), None),
                    (None, None, Some(&ids)),
                ];
                for (padding_mask, attn_mask, positions) in cases {
                    let opts = |train, return_weights| AttentionOptions {
                        padding_mask,
                        attn_mask,
                        positions,
                        train,
                        return_weights,
                        ..Default::default()
                    };
                    let fused = mha.forward_with(&x, &opts(false, false), None)?.output;
                    // Training with the weights returned runs on candle's ops; without them,
                    // on the fused training core.
                    let plain = mha.forward_with(&x, &opts(true, true), None)?.output;
                    let training = mha.forward_with(&x, &opts(true, false), None)?.output;
                    let what = format!(
                        "{} causal={causal} block={block:?} padded={} mask={} ids={}",
                        zoo::label(i, config),
                        padding_mask.is_some(),
                        attn_mask.is_some(),
                        positions.is_some()
                    );
                    assert_close(&fused, &plain, tolerance(&plain)?, &what)?;
                    let what = format!("{what} (training core)");
                    assert_close(&training, &plain, tolerance(&plain)?, &what)?;
                }
                if causal {
                    // Decoding from the cache (strided views of its buffer) after a prefill,
                    // fused against unfused with the same chunks.
                    let decode = |train, return_weights| -> anyhow::Result<Tensor> {
                        let opts = AttentionOptions {
                            train,
                            return_weights,
                            ..Default::default()
                        };
                        let mut cache = KvCache::new();
                        let mut outs = Vec::new();
                        for (start, len) in [(0, 66), (66, 1), (67, 1), (68, 2)] {
                            let x = x.narrow(1, start, len)?;
                            outs.push(mha.forward_with(&x, &opts, Some(&mut cache))?.output);
                        }
                        Ok(Tensor::cat(&outs, 1)?)
                    };
                    let (fused, plain) = (decode(false, false)?, decode(true, true)?);
                    let training = decode(true, false)?;
                    let what = format!("{} block={block:?} cache", zoo::label(i, config));
                    assert_close(&fused, &plain, tolerance(&plain)?, &what)?;
                    let what = format!("{what} (training core)");
                    assert_close(&training, &plain, tolerance(&plain)?, &what)?;
                }
            }
        }
    }
    Ok(())
}

/// A user's mask may hold −∞: on a row whose every key is masked (here by padding, the causal
/// limit, a window or a chunk), every path weighs the keys that hold the lowest value
/// uniformly and gives the −∞ ones none: the fused core, the row pass (weights returned; it
/// had spread the row over every key, found by the api fuzz target), candle's ops and the
/// fused training core.
fn minus_infinity_in_a_mask_on_every_path(dev: &Device) -> anyhow::Result<()> {
    let t = 6;
    let x = common::randn(0f32, 1.0, (2, t, 8), dev)?;
    let pad = Tensor::new(&[[0f32, 0., 1., 1., 1., 1.], [1., 1., 1., 1., 1., 1.]], dev)?;
    let mut m = vec![0f32; t * t];
    m[2 * t + 2] = f32::NEG_INFINITY; // row 2 of sequence 0 sees only key 2, masked by −∞
    m[3 * t + 3] = f32::NEG_INFINITY;
    let mask = Tensor::from_vec(m, (1, 1, t, t), dev)?;
    for (window, chunk) in [
        (None, None),
        (Some(1), None),
        (None, Some(1)),
        (Some(1), Some(1)),
    ] {
        let attn = AttentionConfig::new(8, 1)
            .with_causal(true)
            .with_sliding_window(window)
            .with_attention_chunk(chunk);
        let (mha, _vars) =
            zoo::attention(&candle_posenc::EncodingConfig::None, &attn, DType::F32, dev)?;
        let run = |train, return_weights| -> anyhow::Result<Tensor> {
            let opts = AttentionOptions {
                padding_mask: Some(&pad),
                attn_mask: Some(&mask),
                train,
                return_weights,
                ..Default::default()
            };
            Ok(mha.forward_with(&x, &opts, None)?.output)
        };
        let ops = run(true, true)?;
        for (label, (train, weights)) in [
            ("fused core", (false, false)),
            ("row pass", (false, true)),
            ("training core", (true, false)),
        ] {
            let what = format!("{label}, window {window:?} chunk {chunk:?}");
            assert_close(&run(train, weights)?, &ops, tolerance(&ops)?, &what)?;
        }
    }
    Ok(())
}

device_tests!(
    fused_core_equals_unfused,
    minus_infinity_in_a_mask_on_every_path
);
