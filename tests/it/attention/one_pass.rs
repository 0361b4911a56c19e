//! An inference call of a block with nothing between its projections and its core runs as one
//! pass over buffers kept from call to call: its output equals the block's pipeline under
//! every rule the core takes, with RoPE's forms and a third party's rotation, whatever shapes
//! and blocks came before it and from whichever threads; a rotation that keeps what it is
//! handed finds it unchanged by later calls.

use std::sync::{Arc, Mutex};

use crate::common;

use anyhow::Context;
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use candle_posenc::plug::{AttentionContext, PositionalEncoding};
use candle_posenc::{
    AttentionConfig, AttentionOptions, MultiHeadAttention, PositionIds, Positions, RopeConfig,
    RotaryEmbedding,
};
use common::{max_abs_diff, zoo};
use rayon::prelude::*;

/// The block of `cfg` (d_model 32) with `encoding`, on plain tensors drawn as a `VarMap` draws
/// them (a checkpoint loaded for inference), and its pipeline clone.
fn plain_block(
    cfg: &AttentionConfig,
    encoding: Option<Arc<dyn PositionalEncoding>>,
) -> anyhow::Result<(MultiHeadAttention, MultiHeadAttention)> {
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    MultiHeadAttention::new(cfg, None, common::seeded_vb(&varmap, DType::F32, &dev))?;
    let weights = zoo::named_tensors(&varmap)?
        .into_iter()
        .map(|(n, t)| {
            Ok((
                n,
                (common::randn(0f32, 0.5, t.shape(), t.device())?.to_dtype(t.dtype())?),
            ))
        })
        .collect::<anyhow::Result<_>>()?;
    let vb = VarBuilder::from_tensors(weights, DType::F32, &dev);
    let pass = MultiHeadAttention::new(cfg, encoding, vb)?;
    let pipeline = pass.clone().without_one_node();
    Ok((pass, pipeline))
}

/// Asserts the pass's output equals the pipeline's to 1e-5 of its largest value (at least
/// 1): a rotation that does not declare `scaled_queries` gets queries scaled before it in the
/// pass, after it in the pipeline.
fn assert_same(
    what: &str,
    (pass, pipeline): (&MultiHeadAttention, &MultiHeadAttention),
    x: &Tensor,
    options: &AttentionOptions,
) -> anyhow::Result<()> {
    let got = pass.forward_with(x, options, None)?.output;
    let want = pipeline.forward_with(x, options, None)?.output;
    let scale = want
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()?
        .max(1.0);
    let diff = max_abs_diff(&got, &want)? / f64::from(scale);
    assert!(diff < 1e-5, "{what}: output differs by {diff} (relative)");
    Ok(())
}

#[test]
fn one_pass_equals_the_pipeline() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let (b, t) = (2, 11);
    let padding = super::one_node::padded_tail(b, t)?;
    let x = common::randn(0f32, 1.0, (b, t, 32), &dev)?;
    // (Dropout's is a training call's: inference runs without it.)
    for (name, config) in super::one_node::configs() {
        let rules = if name == "chunk" {
            &[true][..]
        } else {
            &[false, true]
        };
        for &causal in rules {
            let blocks = plain_block(&config.clone().with_causal(causal), None)?;
            for padded in [false, true] {
                let options = AttentionOptions {
                    padding_mask: padded.then_some(&padding),
                    ..Default::default()
                };
                let what = format!("{name} causal {causal} padded {padded}");
                assert_same(&what, (&blocks.0, &blocks.1), &x, &options)?;
            }
        }
    }
    Ok(())
}

/// Every encoding of the zoo that declares itself a rotation only rotates q and k in the pass
/// as in the pipeline.
#[test]
fn one_pass_with_a_rotation_equals_the_pipeline() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let x = common::randn(0f32, 1.0, (2, 13, 32), &dev)?;
    let cases = super::one_node::rotating_cases(&zoo::configs(32, 4, 8))?;
    for (what, cfg, encoding, _) in &cases {
        let blocks = plain_block(cfg, Some(encoding.clone()))?;
        assert_same(what, (&blocks.0, &blocks.1), &x, &Default::default())?;
    }
    assert_eq!(cases.len(), 8, "four RoPE forms, causal and not");
    Ok(())
}

/// Every encoding of the zoo added to the input runs the pass after its positions are added,
/// as in the pipeline.
#[test]
fn one_pass_with_positions_added_to_the_input() -> anyhow::Result<()> {
    let x = common::randn(0f32, 1.0, (2, 13, 32), &Device::Cpu)?;
    let cases = super::one_node::cases_declaring(&zoo::configs(32, 4, 8), |e| e.input_only())?;
    for (what, cfg, encoding, _) in &cases {
        let blocks = plain_block(cfg, Some(encoding.clone()))?;
        assert_same(what, (&blocks.0, &blocks.1), &x, &Default::default())?;
    }
    assert_eq!(
        cases.len(),
        6,
        "sinusoidal, scaled sinusoidal, learned, causal and not"
    );
    Ok(())
}

/// Calls of other shapes and blocks in between (each leaving larger or smaller buffers for
/// the next), from several threads at once, a strided input, one token, a sequence padded
/// whole: each as the pipeline.
#[test]
fn kept_buffers_never_leak_into_a_call() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let cfg = |heads, kv, causal| {
        AttentionConfig::new(32, heads)
            .with_kv_heads(kv)
            .with_causal(causal)
    };
    let blocks = [
        plain_block(&cfg(4, 2, true), None)?,
        plain_block(&cfg(4, 4, false), None)?,
        plain_block(&cfg(2, 1, true), None)?,
    ];
    let lengths = [17, 3, 40, 1, 9, 40, 2];
    for (i, &t) in lengths.iter().enumerate() {
        let (pass, pipeline) = &blocks[i % blocks.len()];
        let x = common::randn(0f32, 1.0, (1 + i % 2, t, 32), &dev)?;
        assert_same(
            &format!("call {i}, T {t}"),
            (pass, pipeline),
            &x,
            &Default::default(),
        )?;
    }
    // Strided: (T, B, d) stored, read as (B, T, d).
    let x = common::randn(0f32, 1.0, (7, 2, 32), &dev)?.transpose(0, 1)?;
    assert_same(
        "strided",
        (&blocks[0].0, &blocks[0].1),
        &x,
        &Default::default(),
    )?;
    // The second sequence padded whole.
    let padding = Tensor::from_vec(vec![1u8, 1, 1, 1, 1, 0, 0, 0, 0, 0], (2, 5), &dev)?;
    let options = AttentionOptions {
        padding_mask: Some(&padding),
        ..Default::default()
    };
    let x = common::randn(0f32, 1.0, (2, 5, 32), &dev)?;
    assert_same("padded whole", (&blocks[1].0, &blocks[1].1), &x, &options)?;
    // Four threads, each its own shapes, at once.
    // Each thread's inputs drawn here, on the test's thread (threads it starts may not draw).
    let inputs = (0..4)
        .map(|i| {
            (0..5)
                .map(|round| common::randn(0f32, 1.0, (2, 5 + 7 * i + round, 32), &dev))
                .collect::<candle_core::Result<Vec<_>>>()
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|i| {
                let (pass, pipeline) = &blocks[i % blocks.len()];
                let inputs = &inputs[i];
                s.spawn(move || -> anyhow::Result<()> {
                    for (round, x) in inputs.iter().enumerate() {
                        let x = x.clone();
                        let want = pipeline.forward(&x)?;
                        let got = pass.forward(&x)?;
                        let diff = max_abs_diff(&got, &want)?;
                        anyhow::ensure!(diff < 1e-5, "thread {i} round {round}: {diff}");
                    }
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().expect("a thread panicked"))
    })
}

/// A rotation that keeps clones of the q and k it is handed (and returns them as they are).
#[derive(Debug, Default)]
struct Keeper(Mutex<Vec<Tensor>>);

impl PositionalEncoding for Keeper {
    fn rotate(
        &self,
        q: Tensor,
        k: Tensor,
        _ctx: &AttentionContext,
    ) -> candle_posenc::Result<(Tensor, Tensor)> {
        let mut kept = self.0.lock().expect("lock");
        kept.push(q.clone());
        kept.push(k.clone());
        Ok((q, k))
    }

    fn rotation_only(&self) -> bool {
        true
    }
}

/// What a rotation is handed is its own: later calls (of the same shapes, whose buffers the
/// pass keeps) leave it as it was.
#[test]
fn a_rotation_keeps_what_it_is_handed() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let keeper = Arc::new(Keeper::default());
    let cfg = AttentionConfig::new(32, 4).with_kv_heads(2);
    let (pass, pipeline) = plain_block(&cfg, Some(keeper.clone()))?;
    let x = common::randn(0f32, 1.0, (2, 9, 32), &dev)?;
    assert_same("keeper", (&pass, &pipeline), &x, &Default::default())?;
    let first: Vec<Tensor> = keeper.0.lock().expect("lock")[..2].to_vec();
    let copies = first
        .iter()
        .map(|t| t.copy())
        .collect::<candle_core::Result<Vec<_>>>()?;
    for _ in 0..3 {
        pass.forward(&common::randn(0f32, 1.0, (2, 9, 32), &dev)?)?;
    }
    for (kept, copy) in first.iter().zip(&copies) {
        assert_eq!(max_abs_diff(kept, copy)?, 0.0, "a kept tensor changed");
    }
    Ok(())
}

/// Positions given with the call (an offset, or ids per token) rotate q and k as in the
/// pipeline, under a window and under chunks (whose rule counts the chunk's own tokens).
#[test]
fn one_pass_with_positions_given() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let (b, t) = (2, 9);
    let x = common::randn(0f32, 1.0, (b, t, 32), &dev)?;
    let ids: Vec<u32> = (0..b * t).map(|i| ((i * 7) % 23) as u32).collect();
    let ids = Positions::Ids(PositionIds::new(&Tensor::from_vec(ids, (b, t), &dev)?)?);
    let base = AttentionConfig::new(32, 4)
        .with_kv_heads(2)
        .with_causal(true);
    for (name, cfg) in [
        ("window", base.clone().with_sliding_window(Some(4))),
        ("chunk", base.with_attention_chunk(Some(4))),
    ] {
        let blocks = plain_block(&cfg, Some(rope(8)?))?;
        for (what, positions) in [("offset 37", Positions::Offset(37)), ("ids", ids.clone())] {
            let options = AttentionOptions {
                positions: Some(&positions),
                ..Default::default()
            };
            let what = format!("{name}, {what}");
            assert_same(&what, (&blocks.0, &blocks.1), &x, &options)?;
        }
    }
    Ok(())
}

/// Sinks with rows masked whole (leading padding under a causal rule, a sequence padded
/// whole), and a long call (several query and key tiles, window, soft cap, padding) followed
/// by a shorter one on the buffers it leaves.
#[test]
fn one_pass_with_sinks_and_long_calls() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    for causal in [false, true] {
        let cfg = AttentionConfig::new(32, 4)
            .with_kv_heads(2)
            .with_sinks(true)
            .with_bias(true)
            .with_causal(causal);
        let blocks = plain_block(&cfg, None)?;
        let keep = vec![0u8, 0, 1, 1, 1, 0, 0, 0, 0, 0];
        let padding = Tensor::from_vec(keep, (2, 5), &dev)?;
        let options = AttentionOptions {
            padding_mask: Some(&padding),
            ..Default::default()
        };
        let x = common::randn(0f32, 1.0, (2, 5, 32), &dev)?;
        let what = format!("sinks, rows masked whole, causal {causal}");
        assert_same(&what, (&blocks.0, &blocks.1), &x, &options)?;
        let cfg = cfg
            .with_sliding_window(Some(300))
            .with_logit_softcap(Some(5.0));
        let blocks = plain_block(&cfg, Some(rope(8)?))?;
        let t = 1100;
        let keep: Vec<u8> = (0..2 * t).map(|i| u8::from(i % 97 != 3)).collect();
        let padding = Tensor::from_vec(keep, (2, t), &dev)?;
        let options = AttentionOptions {
            padding_mask: Some(&padding),
            ..Default::default()
        };
        let x = common::randn(0f32, 1.0, (2, t, 32), &dev)?;
        let what = format!("T {t}, causal {causal}");
        assert_same(&what, (&blocks.0, &blocks.1), &x, &options)?;
        let x = common::randn(0f32, 1.0, (1, 300, 32), &dev)?;
        let what = format!("T 300 after T {t}, causal {causal}");
        assert_same(&what, (&blocks.0, &blocks.1), &x, &Default::default())?;
    }
    Ok(())
}

/// RoPE at head width `head_dim`.
fn rope(head_dim: usize) -> anyhow::Result<Arc<dyn PositionalEncoding>> {
    Ok(Arc::new(RotaryEmbedding::new(
        &RopeConfig::new(head_dim),
        &Device::Cpu,
    )?))
}

/// An inference call of a frozen block whose rotation has a parameter that trains: its
/// result tracks gradients, so the call stays in the pipeline's graph and the parameter gets
/// the pipeline's gradient.
#[test]
fn a_learned_rotation_keeps_its_gradient() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let factor = Var::from_tensor(&Tensor::new(&[1.3f32], &dev)?)?;
    let cfg = AttentionConfig::new(32, 4)
        .with_kv_heads(2)
        .with_causal(true);
    let learned = super::one_node::LearnedFactor(factor.as_tensor().clone());
    let (pass, pipeline) = plain_block(&cfg, Some(Arc::new(learned)))?;
    let x = common::randn(0f32, 1.0, (2, 7, 32), &dev)?;
    let probe = common::randn(0f32, 1.0, (2, 7, 32), &dev)?;
    let grad = |m: &MultiHeadAttention| -> anyhow::Result<f32> {
        let y = m.forward(&x)?;
        let g = (y * &probe)?.sum_all()?.backward()?;
        let g = g.get(factor.as_tensor()).context("no gradient")?;
        Ok(g.flatten_all()?.to_vec1::<f32>()?[0])
    };
    let (got, want) = (grad(&pass)?, grad(&pipeline)?);
    assert!(
        (got - want).abs() <= 1e-5 * want.abs().max(1.0),
        "{got} against {want}"
    );
    Ok(())
}

/// A rotation returning q and k of the wrong shape or dtype (or q as the keys) is an error,
/// as in the pipeline, and the next call is right.
#[derive(Debug)]
struct Bad(u8);

impl PositionalEncoding for Bad {
    fn rotate(
        &self,
        q: Tensor,
        k: Tensor,
        _ctx: &AttentionContext,
    ) -> candle_posenc::Result<(Tensor, Tensor)> {
        Ok(match self.0 {
            0 => (q.narrow(2, 0, 1)?, k),
            1 => (q.to_dtype(DType::F64)?, k),
            _ => (q.clone(), q),
        })
    }

    fn rotation_only(&self) -> bool {
        true
    }
}

#[test]
fn a_bad_rotation_is_an_error() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let x = common::randn(0f32, 1.0, (2, 8, 32), &dev)?;
    let cfg = AttentionConfig::new(32, 4)
        .with_kv_heads(2)
        .with_causal(true);
    for kind in 0..3u8 {
        let (pass, pipeline) = plain_block(&cfg, Some(Arc::new(Bad(kind))))?;
        let err = pass.forward(&x).expect_err("a bad rotation");
        assert!(err.to_string().contains("rotated"), "kind {kind}: {err}");
        assert!(pipeline.forward(&x).is_err(), "kind {kind}");
    }
    let good = plain_block(&cfg, Some(rope(8)?))?;
    assert_same(
        "after the errors",
        (&good.0, &good.1),
        &x,
        &Default::default(),
    )
}

/// Calls from inside rayon's pool, several at once, and training steps (whose backward takes
/// kept scratch rows) between calls: each as the pipeline.
#[test]
fn kept_buffers_under_rayon_and_training() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let cfg = AttentionConfig::new(32, 4)
        .with_kv_heads(2)
        .with_causal(true)
        .with_sinks(true);
    let (pass, pipeline) = plain_block(&cfg, Some(rope(8)?))?;
    // The inputs drawn on the test's thread, the calls made from the pool's.
    let inputs = (0..16usize)
        .map(|i| common::randn(0f32, 1.0, (2, 20 + 13 * i, 32), &dev))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let results: Vec<anyhow::Result<f64>> = inputs
        .into_par_iter()
        .map(|x| max_abs_diff(&pass.forward(&x)?, &pipeline.forward(&x)?))
        .collect();
    for (i, diff) in results.into_iter().enumerate() {
        let diff = diff?;
        assert!(diff < 1e-5, "call {i} in the pool: {diff}");
    }
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, &dev);
    let train = MultiHeadAttention::new(&cfg, Some(rope(8)?), vb)?;
    let options = AttentionOptions {
        train: true,
        ..Default::default()
    };
    for t in [50, 7, 130] {
        let x = common::randn(0f32, 1.0, (2, t, 32), &dev)?;
        train
            .forward_with(&x, &options, None)?
            .output
            .sum_all()?
            .backward()?;
        let x = common::randn(0f32, 1.0, (1, t + 3, 32), &dev)?;
        assert_same(
            &format!("after a step at T {t}"),
            (&pass, &pipeline),
            &x,
            &Default::default(),
        )?;
    }
    Ok(())
}
