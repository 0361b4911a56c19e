//! Sharing across threads: every public type is `Send + Sync`, and one encoding (inside one
//! attention block) used by 4 threads at once, each with its own shapes and positions, gives
//! the same results as the same calls made one after another. The workloads are chosen to hit
//! the caches behind locks at the same time: tables that grow past their initial length
//! (sinusoidal, RoPE), RoPE tables rebuilt for another regime (dynamic NTK, LongRoPE short/long
//! factors), and the relative encodings' bucket caches.

use crate::common;

use std::sync::{Arc, Barrier};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;
use candle_posenc::{
    AttentionConfig, AttentionOptions, Checkpoint, EncodingConfig, KvCache, LongRopeScaling,
    MultiHeadAttention, PositionIds, PositionalEncoding, Positions, RopeConfig, RopeScaling,
    SinusoidalConfig,
};
use common::{max_abs_diff, zoo};

fn assert_send_sync<T: Send + Sync + ?Sized>() {}

#[test]
fn public_types_are_send_and_sync() {
    // The modules themselves are checked in tests/it/attention/traits.rs; these are the values passed around
    // with them.
    assert_send_sync::<dyn PositionalEncoding>();
    assert_send_sync::<Arc<dyn PositionalEncoding>>();
    assert_send_sync::<Checkpoint>();
    assert_send_sync::<EncodingConfig>();
    assert_send_sync::<AttentionConfig>();
    assert_send_sync::<Positions>();
    assert_send_sync::<PositionIds>();
    assert_send_sync::<candle_posenc::Error>();
}

/// One thread's calls: batch, chunk lengths fed through a KV cache, the first position, and
/// whether positions are given as explicit ids.
struct Workload {
    batch: usize,
    chunks: Vec<usize>,
    start: usize,
    ids: bool,
}

fn workloads() -> Vec<Workload> {
    vec![
        Workload {
            batch: 1,
            chunks: vec![7],
            start: 0,
            ids: false,
        },
        Workload {
            batch: 2,
            chunks: vec![3, 1, 1],
            start: 90,
            ids: false,
        },
        // Past the 64 positions the RoPE configurations below start with, and past LongRoPE's
        // original length (its long factors) and dynamic NTK's (a new base).
        Workload {
            batch: 3,
            chunks: vec![5, 2],
            start: 1000,
            ids: true,
        },
        Workload {
            batch: 1,
            chunks: vec![1, 1, 1, 1],
            start: 40,
            ids: false,
        },
    ]
}

fn run(mha: &MultiHeadAttention, w: &Workload, d_model: usize) -> anyhow::Result<Tensor> {
    let dev = Device::Cpu;
    let len: usize = w.chunks.iter().sum();
    // Deterministic input per workload, so threads and the sequential run see the same x.
    let n = w.batch * len * d_model;
    let x = Tensor::arange(0u32, n as u32, &dev)?
        .to_dtype(DType::F32)?
        .affine(0.37, 0.0)?
        .sin()?
        .reshape((w.batch, len, d_model))?;
    let mut cache = KvCache::new();
    let mut outs = Vec::new();
    let mut done = 0;
    for &c in &w.chunks {
        let first = (w.start + done) as u32;
        let positions = if w.ids {
            let row: Vec<u32> = (first..first + c as u32).collect();
            Positions::Ids(PositionIds::from_rows(&vec![row; w.batch], &dev)?)
        } else {
            Positions::Offset(first as usize)
        };
        let o = AttentionOptions {
            positions: Some(&positions),
            ..Default::default()
        };
        outs.push(
            mha.forward_with(&x.narrow(1, done, c)?, &o, Some(&mut cache))?
                .output,
        );
        done += c;
    }
    Ok(Tensor::cat(&outs, 1)?)
}

/// The zoo plus the RoPE variants whose tables depend on the sequence end.
fn thread_configs(d_model: usize, heads: usize, head_dim: usize) -> Vec<EncodingConfig> {
    let mut configs = zoo::configs(d_model, heads, head_dim);
    let rope = RopeConfig::new(head_dim).with_max_position(64);
    configs.push(EncodingConfig::Rotary(rope.clone().with_scaling(
        RopeScaling::Dynamic {
            factor: 2.0,
            original_max_position_embeddings: 64,
        },
    )));
    configs.push(EncodingConfig::Rotary(rope.with_scaling(
        RopeScaling::LongRope(LongRopeScaling {
            short_factor: vec![1.0; head_dim / 2],
            long_factor: (0..head_dim / 2).map(|i| 1.0 + i as f64).collect(),
            original_max_position_embeddings: 64,
            factor: 16.0,
            attention_factor: None,
        }),
    )));
    // A sinusoidal table that must grow while the threads run.
    configs.push(EncodingConfig::Sinusoidal(
        SinusoidalConfig::new(d_model)
            .with_max_len(8)
            .with_dropout(0.0),
    ));
    configs
}

#[test]
fn one_encoding_shared_by_four_threads_matches_sequential_runs() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let (d_model, heads, head_dim) = (8, 2, 4);
    let attn = AttentionConfig::new(d_model, heads)
        .with_head_dim(head_dim)
        .with_causal(true);
    for (i, config) in thread_configs(d_model, heads, head_dim).iter().enumerate() {
        // Two blocks with the same weights and independent caches: one for the sequential
        // reference, one shared by the threads (its caches start cold, so they fill under
        // contention).
        let varmap = VarMap::new();
        let vb = common::seeded_vb(&varmap, DType::F32, &dev);
        let build = || -> anyhow::Result<MultiHeadAttention> {
            Ok(MultiHeadAttention::new(
                &attn,
                config.build(vb.pp("enc"))?,
                vb.pp("attn"),
            )?)
        };
        let sequential = build()?;
        for var in common::sorted_vars(&varmap) {
            var.set(&common::randn(0f32, 0.5, var.shape(), &dev)?)?;
        }
        let shared = Arc::new(build()?);
        let work = workloads();
        let expected: Vec<Tensor> = work
            .iter()
            .map(|w| run(&sequential, w, d_model))
            .collect::<anyhow::Result<_>>()?;
        for round in 0..3 {
            let barrier = Barrier::new(work.len());
            let results: Vec<anyhow::Result<Tensor>> = std::thread::scope(|s| {
                let handles: Vec<_> = work
                    .iter()
                    .map(|w| {
                        let (mha, barrier) = (Arc::clone(&shared), &barrier);
                        s.spawn(move || {
                            barrier.wait();
                            run(&mha, w, d_model)
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("a worker panicked"))
                    .collect()
            });
            for (k, (got, want)) in results.into_iter().zip(&expected).enumerate() {
                let d = max_abs_diff(&got?, want)?;
                // Same weights, shapes and positions on both sides: identical arithmetic.
                anyhow::ensure!(
                    d == 0.0,
                    "{} round {round} workload {k}: differs by {d:e}",
                    zoo::label(i, config)
                );
            }
        }
    }
    Ok(())
}

/// The gradients of `vars` (the input first) from one backward of `loss`.
fn grads_of(loss: &Tensor, vars: &[Tensor]) -> anyhow::Result<Vec<Tensor>> {
    let grads = loss.backward()?;
    vars.iter()
        .map(|v| {
            grads
                .get(v)
                .cloned()
                .ok_or_else(|| anyhow::anyhow!("a variable got no gradient"))
        })
        .collect()
}

/// One training graph differentiated by two threads at once, two losses of one output (the
/// block as one node, and as its pipeline around the fused core): each thread gets its own
/// loss's gradients every time. Both keep what their backward computes for the links that
/// hand it to candle; kept in one slot, a thread's links took the other's gradients (measured
/// on the node: 107 wrong gradients and 123 errors in 600 backward calls), and before that
/// the fused core's backward held a lock through its parallel stages, where rayon ran the
/// other thread's backward of the same graph on the same thread: it waited forever.
#[test]
fn one_graph_differentiated_by_two_threads_at_once() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, &dev);
    let cfg = AttentionConfig::new(32, 4)
        .with_kv_heads(2)
        .with_causal(true)
        .with_sinks(true);
    let node = MultiHeadAttention::new(&cfg, None, vb.pp("attn"))?;
    let x = common::var_randn(0f32, 1.0, (2, 9, 32), &dev)?;
    let mut vars = vec![x.as_tensor().clone()];
    vars.extend(zoo::named_tensors(&varmap)?.into_iter().map(|(_, t)| t));
    let probes = [
        common::randn(0f32, 1.0, (2, 9, 32), &dev)?,
        common::randn(0f32, 1.0, (2, 9, 32), &dev)?,
    ];
    let options = AttentionOptions {
        train: true,
        ..Default::default()
    };
    let (done, finished) = std::sync::mpsc::channel();
    for block in [node.clone(), node.without_one_node()] {
        let y = block.forward_with(x.as_tensor(), &options, None)?.output;
        for probe in &probes {
            let loss = (&y * probe)?.sum_all()?;
            let want = grads_of(&loss, &vars)?;
            let (vars, done) = (vars.clone(), done.clone());
            std::thread::spawn(move || {
                let check = || -> anyhow::Result<f64> {
                    let mut worst: f64 = 0.0;
                    for _ in 0..100 {
                        for (got, want) in grads_of(&loss, &vars)?.iter().zip(&want) {
                            worst = worst.max(max_abs_diff(got, want)?);
                        }
                    }
                    Ok(worst)
                };
                let _ = done.send(check().map_err(|e| e.to_string()));
            });
        }
    }
    for _ in 0..4 {
        // A thread that waits forever fails the test instead of hanging it.
        let result = finished.recv_timeout(std::time::Duration::from_secs(120))?;
        let worst = result.map_err(anyhow::Error::msg)?;
        assert!(worst < 1e-6, "a gradient differs by {worst}");
    }
    Ok(())
}
