//! A training call of a block with nothing between its projections and its core runs as one
//! node of candle's graph: its output and the gradients of the input, every weight and bias
//! and the sinks equal the block's pipeline of nodes (projections, fused core, output
//! projection), under every rule the core takes, with dropout drawn from the same seed, and
//! whichever of the input and the weights track gradients; with a rotation (RoPE's forms, or a
//! third party's through the plug) rotated outside the graph and its gradients by its adjoint.

use crate::common;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_posenc::plug::{AttentionContext, PositionalEncoding};
use candle_posenc::{
    AttentionConfig, AttentionOptions, EncodingConfig, MultiHeadAttention, RopeConfig, RopeScaling,
};
use common::{max_abs_diff, zoo};

/// The configurations: grouped heads, biases, sinks, windows, chunks, a soft cap, dropout.
pub(super) fn configs() -> Vec<(&'static str, AttentionConfig)> {
    let base = || AttentionConfig::new(32, 4).with_kv_heads(2);
    vec![
        ("plain", base()),
        ("biases", base().with_bias(true).with_out_bias(true)),
        ("multi-head", AttentionConfig::new(32, 4)),
        ("sinks", base().with_sinks(true)),
        ("window", base().with_sliding_window(Some(5))),
        ("chunk", base().with_attention_chunk(Some(4))),
        ("soft cap", base().with_logit_softcap(Some(2.0))),
        ("dropout", base().with_dropout(0.25)),
    ]
}

/// Each gradient by name, `None` where there is none.
type Grads = Vec<(String, Option<Tensor>)>;

/// The largest absolute value of `t`.
fn max_abs(t: &Tensor) -> anyhow::Result<f64> {
    Ok(t.abs()?
        .flatten_all()?
        .max(0)?
        .to_dtype(DType::F64)?
        .to_scalar::<f64>()?)
}

/// Output and gradients (input first, then every variable by name) of one training call.
fn step(
    mha: &MultiHeadAttention,
    x: &Tensor,
    probe: &Tensor,
    options: &AttentionOptions,
    vars: &[(String, Tensor)],
) -> anyhow::Result<(Tensor, Grads)> {
    let out = mha.forward_with(x, options, None)?.output;
    let grads = (&out * probe)?.sum_all()?.backward()?;
    let mut all = vec![("x".to_string(), grads.get(x).cloned())];
    all.extend(
        vars.iter()
            .map(|(name, v)| (name.clone(), grads.get(v).cloned())),
    );
    Ok((out, all))
}

/// Asserts that the node's output and gradients equal the pipeline's, each to 1e-5 of its
/// largest value (at least 1): ∂x is summed over three projections in another order, and a
/// rotation that does not declare `scaled_queries` gets queries scaled before it in the node,
/// after it in the pipeline. The keys' bias has a gradient of exactly 0 without a rotation
/// (it moves each query's logits by one constant), so what both sides hold is the rounding of
/// sums of ∂k, compared to the scale of the keys' weight gradient instead. A parameter of one
/// value (scaled sinusoidal's learned scale) is one f32 sum over every element of ∂x times
/// its table, summed in another order on each side: 1e-4 of its value (measured: up to
/// 1.04e-5, 1e-3 on a value near 500).
fn assert_same(
    what: &str,
    (out, grads): (Tensor, Grads),
    (want, wanted): (Tensor, Grads),
) -> anyhow::Result<()> {
    let diff = max_abs_diff(&out, &want)? / max_abs(&want)?.max(1.0);
    assert!(diff < 1e-5, "{what}: output differs by {diff} (relative)");
    let scale_of = |name: &str| -> anyhow::Result<f64> {
        let grad = wanted
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, g)| g.as_ref());
        grad.map_or(Ok(0.0), max_abs)
    };
    for ((n, got), (_, want)) in grads.iter().zip(&wanted) {
        let (Some(got), Some(want)) = (got, want) else {
            panic!("{what}: {n} has a gradient on one side only");
        };
        let mut scale = max_abs(want)?.max(1.0);
        if let Some(prefix) = n.strip_suffix("k_proj.bias") {
            scale = scale.max(scale_of(&format!("{prefix}k_proj.weight"))?);
        }
        let tolerance = match want.elem_count() {
            1 => 1e-4,
            _ => 1e-5,
        };
        let diff = max_abs_diff(got, want)? / scale;
        assert!(
            diff < tolerance,
            "{what}: ∂{n} differs by {diff} (relative)"
        );
    }
    Ok(())
}

/// The node block against its pipeline clone, on the same fresh random weights (every
/// variable of `varmap`), input and probe.
fn compare(
    what: &str,
    node: &MultiHeadAttention,
    varmap: &VarMap,
    (b, t): (usize, usize),
    options: &AttentionOptions,
) -> anyhow::Result<()> {
    let dev = Device::Cpu;
    for var in common::sorted_vars(varmap) {
        var.set(&common::randn(0f32, 0.5, var.shape(), &dev)?)?;
    }
    let pipeline = node.clone().without_one_node();
    let vars = zoo::named_tensors(varmap)?;
    let x = common::var_randn(0f32, 1.0, (b, t, 32), &dev)?;
    let probe = common::randn(0f32, 1.0, (b, t, 32), &dev)?;
    assert_same(
        what,
        step(node, x.as_tensor(), &probe, options, &vars)?,
        step(&pipeline, x.as_tensor(), &probe, options, &vars)?,
    )
}

/// A padding mask `(B, T)` whose last sequence has its last three keys padded.
pub(super) fn padded_tail(b: usize, t: usize) -> candle_core::Result<Tensor> {
    let keep: Vec<u8> = (0..b * t).map(|i| u8::from(i < b * t - 3)).collect();
    Tensor::from_vec(keep, (b, t), &Device::Cpu)
}

#[test]
fn one_node_equals_the_pipeline() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let (b, t) = (2, 11);
    let padding = padded_tail(b, t)?;
    for (name, config) in configs() {
        // (Chunks are causal.)
        let rules = if name == "chunk" {
            &[true][..]
        } else {
            &[false, true]
        };
        for &causal in rules {
            for padded in [false, true] {
                let varmap = VarMap::new();
                let vb = common::seeded_vb(&varmap, DType::F32, &dev);
                let cfg = config.clone().with_causal(causal);
                let node = MultiHeadAttention::new(&cfg, None, vb.pp("attn"))?;
                let options = AttentionOptions {
                    train: true,
                    padding_mask: padded.then_some(&padding),
                    dropout_seed: Some(7),
                    ..Default::default()
                };
                let what = format!("{name} causal {causal} padded {padded}");
                compare(&what, &node, &varmap, (b, t), &options)?;
            }
        }
    }
    Ok(())
}

/// Every encoding of the zoo that declares itself a rotation only (every RoPE variant there,
/// and dynamic NTK past its original length, whose frequencies follow the call's) runs as the
/// node, rotating q and k outside the graph and their gradients back by its adjoint: the same
/// output and gradients as the pipeline, which keeps the rotation in candle's graph.
#[test]
fn one_node_with_a_rotation_equals_the_pipeline() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let (b, t) = (2, 13);
    let mut configs = zoo::configs(32, 4, 8);
    configs.push(EncodingConfig::Rotary(RopeConfig::new(8).with_scaling(
        RopeScaling::Dynamic {
            factor: 2.0,
            original_max_position_embeddings: 8,
        },
    )));
    let cases = rotating_cases(&configs)?;
    for (what, cfg, encoding, varmap) in &cases {
        let vb = common::seeded_vb(varmap, DType::F32, &dev);
        let node = MultiHeadAttention::new(cfg, Some(encoding.clone()), vb.pp("attn"))?;
        let options = AttentionOptions {
            train: true,
            ..Default::default()
        };
        compare(what, &node, varmap, (b, t), &options)?;
    }
    // Four RoPE forms in the zoo and dynamic NTK, causal and not.
    assert_eq!(cases.len(), 10);
    Ok(())
}

/// A zoo case: its label, the block's config, the encoding and the `VarMap` it was built on.
pub(super) type ZooCase = (String, AttentionConfig, Arc<dyn PositionalEncoding>, VarMap);

/// Each encoding of `configs` that declares itself a rotation only, built on a fresh
/// `VarMap`, for a block of 4 heads over 2 KV heads with biases, causal and not.
pub(super) fn rotating_cases(configs: &[EncodingConfig]) -> anyhow::Result<Vec<ZooCase>> {
    cases_declaring(configs, |e| e.rotation_only())
}

/// Each encoding of `configs` for which `declares` holds, as [`rotating_cases`].
pub(super) fn cases_declaring(
    configs: &[EncodingConfig],
    declares: fn(&dyn PositionalEncoding) -> bool,
) -> anyhow::Result<Vec<ZooCase>> {
    let mut cases = Vec::new();
    for (i, config) in configs.iter().enumerate() {
        for causal in [false, true] {
            let varmap = VarMap::new();
            let vb = common::seeded_vb(&varmap, DType::F32, &Device::Cpu);
            let Some(encoding) = config.build(vb.pp("enc"))? else {
                continue;
            };
            if !declares(encoding.as_ref()) {
                continue;
            }
            let cfg = AttentionConfig::new(32, 4)
                .with_kv_heads(2)
                .with_bias(true)
                .with_causal(causal);
            let what = format!("{} causal {causal}", zoo::label(i, config));
            cases.push((what, cfg, encoding, varmap));
        }
    }
    Ok(cases)
}

/// Every encoding of the zoo added to the input (sinusoidal, scaled sinusoidal, learned)
/// trains as the block without an encoding does, one node after the positions are added: the
/// same output and gradients as the pipeline, a learned table's included.
#[test]
fn one_node_with_positions_added_to_the_input() -> anyhow::Result<()> {
    let cases = cases_declaring(&zoo::configs(32, 4, 8), |e| e.input_only())?;
    for (what, cfg, encoding, varmap) in &cases {
        let vb = common::seeded_vb(varmap, DType::F32, &Device::Cpu);
        let node = MultiHeadAttention::new(cfg, Some(encoding.clone()), vb.pp("attn"))?;
        let options = AttentionOptions {
            train: true,
            ..Default::default()
        };
        compare(what, &node, varmap, (2, 13), &options)?;
    }
    assert_eq!(
        cases.len(),
        6,
        "sinusoidal, scaled sinusoidal, learned, causal and not"
    );
    Ok(())
}

/// Only the weights track (a frozen input), or only the input (plain weights, as a checkpoint
/// loads them): each gets the pipeline's gradient, and nothing else gets one.
#[test]
fn one_node_with_some_inputs_tracking() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, &dev);
    let cfg = AttentionConfig::new(32, 4)
        .with_kv_heads(2)
        .with_bias(true)
        .with_causal(true);
    let node = MultiHeadAttention::new(&cfg, None, vb.pp("attn"))?;
    let pipeline = node.clone().without_one_node();
    let vars = zoo::named_tensors(&varmap)?;
    let probe = common::randn(0f32, 1.0, (2, 9, 32), &dev)?;
    let options = AttentionOptions {
        train: true,
        ..Default::default()
    };
    // The weights alone.
    let x = common::randn(0f32, 1.0, (2, 9, 32), &dev)?;
    let (out, grads) = step(&node, &x, &probe, &options, &vars)?;
    let (want, want_grads) = step(&pipeline, &x, &probe, &options, &vars)?;
    assert!(max_abs_diff(&out, &want)? < 1e-5);
    assert!(
        grads[0].1.is_none(),
        "an input that does not track gets no gradient"
    );
    for ((n, got), (_, want)) in grads.iter().zip(&want_grads).skip(1) {
        let (Some(got), Some(want)) = (got, want) else {
            panic!("{n} has a gradient on one side only");
        };
        assert!(max_abs_diff(got, want)? < 1e-4, "∂{n}");
    }
    // The input alone: the same block on plain copies of its weights.
    let plain = VarBuilder::from_tensors(
        vars.iter().map(|(n, t)| (n.clone(), t.detach())).collect(),
        DType::F32,
        &dev,
    );
    let frozen = MultiHeadAttention::new(&cfg, None, plain.pp("attn"))?;
    let x = common::var_randn(0f32, 1.0, (2, 9, 32), &dev)?;
    let (_, grads) = step(&frozen, x.as_tensor(), &probe, &options, &[])?;
    let (_, want_grads) = step(
        &frozen.without_one_node(),
        x.as_tensor(),
        &probe,
        &options,
        &[],
    )?;
    let (Some(got), Some(want)) = (&grads[0].1, &want_grads[0].1) else {
        panic!("the input gets no gradient");
    };
    assert!(max_abs_diff(got, want)? < 1e-5);
    Ok(())
}

/// A graph with the node may be differentiated more than once (two losses of one output),
/// each time as the pipeline's; a strided input gets its gradient in its own shape.
#[test]
fn one_node_twice_and_strided() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let (node, varmap) = gqa_block(true, None)?;
    let pipeline = node.clone().without_one_node();
    let vars = zoo::named_tensors(&varmap)?;
    // (T, B, d) stored, read as (B, T, d).
    let xv = common::var_randn(0f32, 1.0, (7, 2, 32), &dev)?;
    let x = xv.as_tensor().transpose(0, 1)?;
    let options = AttentionOptions {
        train: true,
        ..Default::default()
    };
    let outs = [&node, &pipeline].map(|m| m.forward_with(&x, &options, None).map(|o| o.output));
    let [Ok(out), Ok(want)] = outs else {
        panic!("a forward failed");
    };
    for seed in 0..2 {
        let probe = common::randn(0f32, 1.0 + seed as f32, (2, 7, 32), &dev)?;
        let grads = |y: &Tensor| -> anyhow::Result<Grads> {
            let g = (y * &probe)?.sum_all()?.backward()?;
            let mut all = vec![("x".to_string(), g.get(xv.as_tensor()).cloned())];
            all.extend(vars.iter().map(|(n, v)| (n.clone(), g.get(v).cloned())));
            Ok(all)
        };
        let what = format!("backward {seed}");
        assert_same(
            &what,
            (out.clone(), grads(&out)?),
            (want.clone(), grads(&want)?),
        )?;
    }
    Ok(())
}

/// A block of 4 heads over 2 KV heads (d_model 32) on a fresh `VarMap`.
fn gqa_block(
    causal: bool,
    encoding: Option<std::sync::Arc<dyn PositionalEncoding>>,
) -> anyhow::Result<(MultiHeadAttention, VarMap)> {
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, &Device::Cpu);
    let cfg = AttentionConfig::new(32, 4)
        .with_kv_heads(2)
        .with_causal(causal);
    Ok((
        MultiHeadAttention::new(&cfg, encoding, vb.pp("attn"))?,
        varmap,
    ))
}

/// Edge cases through the node as through the pipeline: one token, and a sequence padded
/// whole (its rows uniform over every key).
#[test]
fn one_node_edge_cases() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    for (t, padded) in [(1, false), (1, true), (5, true)] {
        for causal in [false, true] {
            let (node, varmap) = gqa_block(causal, None)?;
            // The second sequence padded whole.
            let keep: Vec<u8> = (0..2 * t).map(|i| u8::from(i < t)).collect();
            let padding = Tensor::from_vec(keep, (2, t), &dev)?;
            let options = AttentionOptions {
                train: true,
                padding_mask: padded.then_some(&padding),
                ..Default::default()
            };
            let what = format!("T {t} padded {padded} causal {causal}");
            compare(&what, &node, &varmap, (2, t), &options)?;
        }
    }
    Ok(())
}

/// A third-party rotation through the plug: each query and key scaled by `1 + 0.1·p` at its
/// position p (linear, its own adjoint). Declared, it trains inside the node as in the
/// pipeline; declared without an adjoint, the backward fails with the default's error.
#[derive(Debug)]
struct Stretch {
    adjoint: bool,
}

impl Stretch {
    fn scale(x: Tensor, ctx: &AttentionContext) -> candle_posenc::Result<Tensor> {
        let t = x.dim(2)?;
        let start = match ctx.queries {
            candle_posenc::Positions::Offset(s) => *s,
            candle_posenc::Positions::Ids(_) => 0,
        };
        let s: Vec<f32> = (0..t).map(|i| 1.0 + 0.1 * (start + i) as f32).collect();
        let s = Tensor::from_vec(s, (1, 1, t, 1), x.device())?;
        Ok(x.broadcast_mul(&s)?)
    }
}

impl PositionalEncoding for Stretch {
    fn rotate(
        &self,
        q: Tensor,
        k: Tensor,
        ctx: &AttentionContext,
    ) -> candle_posenc::Result<(Tensor, Tensor)> {
        Ok((Self::scale(q, ctx)?, Self::scale(k, ctx)?))
    }

    fn rotation_only(&self) -> bool {
        true
    }

    fn rotate_adjoint(
        &self,
        dq: Tensor,
        dk: Tensor,
        ctx: &AttentionContext,
    ) -> candle_posenc::Result<(Tensor, Tensor)> {
        match self.adjoint {
            true => self.rotate(dq, dk, ctx),
            false => Err(candle_posenc::Error::InvalidConfig {
                name: "test",
                value: "no adjoint".into(),
                expected: "one".into(),
            }),
        }
    }
}

#[test]
fn a_third_party_rotation_trains_in_the_node() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    for causal in [false, true] {
        let (node, varmap) =
            gqa_block(causal, Some(std::sync::Arc::new(Stretch { adjoint: true })))?;
        let options = AttentionOptions {
            train: true,
            ..Default::default()
        };
        compare(
            &format!("stretch causal {causal}"),
            &node,
            &varmap,
            (2, 6),
            &options,
        )?;
    }
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, &dev);
    let cfg = AttentionConfig::new(32, 4);
    let broken = std::sync::Arc::new(Stretch { adjoint: false });
    let node = MultiHeadAttention::new(&cfg, Some(broken), vb.pp("attn"))?;
    let x = common::var_randn(0f32, 1.0, (2, 6, 32), &dev)?;
    let out = node.forward_with(
        x.as_tensor(),
        &AttentionOptions {
            train: true,
            ..Default::default()
        },
        None,
    )?;
    let err = out.output.sum_all()?.backward().expect_err("no adjoint");
    assert!(err.to_string().contains("no adjoint"), "{err}");
    Ok(())
}

/// A rotation with a parameter that trains (q and k times a learned factor), declared
/// rotation-only: its result tracks gradients of its own, so the block keeps it in the graph,
/// and the factor gets the pipeline's gradient.
#[derive(Debug)]
pub(super) struct LearnedFactor(pub(super) Tensor);

impl PositionalEncoding for LearnedFactor {
    fn rotate(
        &self,
        q: Tensor,
        k: Tensor,
        _ctx: &AttentionContext,
    ) -> candle_posenc::Result<(Tensor, Tensor)> {
        Ok((q.broadcast_mul(&self.0)?, k.broadcast_mul(&self.0)?))
    }

    fn rotation_only(&self) -> bool {
        true
    }

    fn rotate_adjoint(
        &self,
        dq: Tensor,
        dk: Tensor,
        _ctx: &AttentionContext,
    ) -> candle_posenc::Result<(Tensor, Tensor)> {
        let f = self.0.detach();
        Ok((dq.broadcast_mul(&f)?, dk.broadcast_mul(&f)?))
    }
}

#[test]
fn a_rotation_that_trains_stays_in_the_graph() -> anyhow::Result<()> {
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, &Device::Cpu);
    let factor = vb.get_with_hints(1, "enc.factor", candle_nn::Init::Const(1.3))?;
    let cfg = AttentionConfig::new(32, 4).with_kv_heads(2);
    let node = MultiHeadAttention::new(
        &cfg,
        Some(std::sync::Arc::new(LearnedFactor(factor))),
        vb.pp("attn"),
    )?;
    let options = AttentionOptions {
        train: true,
        ..Default::default()
    };
    // (compare checks every variable's gradient, the factor's included, on both sides.)
    compare("learned factor", &node, &varmap, (2, 6), &options)
}
