//! Every entry point of the block trains: whatever a user calls (`Module::forward`,
//! `forward_with` in inference or training mode, with or without the weights), every variable
//! of the block and of its encoding — T5 and clipped tables, Shaw's tables, learned absolute
//! tables, learnable ALiBi slopes — gets the same non-zero gradient.

use crate::common;

use std::collections::HashMap;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_posenc::{
    AlibiConfig, AttentionConfig, AttentionOptions, EncodingConfig, MultiHeadAttention,
};
use common::{max_abs_diff, zoo};

fn every_entry_point_trains(dev: &Device) -> anyhow::Result<()> {
    let mut configs = zoo::configs(16, 4, 4);
    configs.push(EncodingConfig::Alibi(
        AlibiConfig::new(4).with_learnable(true),
    ));
    let x = common::randn(0f32, 1.0, (2, 6, 16), dev)?;
    let probe = common::randn(0f32, 1.0, (2, 6, 16), dev)?;
    for (i, config) in configs.iter().enumerate() {
        for causal in [false, true] {
            let varmap = VarMap::new();
            let vb = common::seeded_vb(&varmap, DType::F32, dev);
            let attn = AttentionConfig::new(16, 4)
                .with_kv_heads(2)
                .with_causal(causal);
            let mha = MultiHeadAttention::new(&attn, config.build(vb.pp("enc"))?, vb.pp("attn"))?;
            for var in common::sorted_vars(&varmap) {
                let noise = common::randn(0f32, 0.5, var.shape(), dev)?;
                var.set(&(var.as_tensor() + noise)?)?;
            }
            let vars = zoo::named_tensors(&varmap)?;
            let grads = |out: Tensor| -> anyhow::Result<HashMap<String, Tensor>> {
                let g = (out * &probe)?.sum_all()?.backward()?;
                vars.iter()
                    .map(|(name, v)| {
                        let grad = g
                            .get(v)
                            .ok_or_else(|| anyhow::anyhow!("{name} gets no gradient"))?;
                        Ok((name.clone(), grad.clone()))
                    })
                    .collect()
            };
            let what = format!("{} causal {causal}", zoo::label(i, config));
            let reference = grads(
                mha.forward_with(
                    &x,
                    &AttentionOptions {
                        train: true,
                        ..Default::default()
                    },
                    None,
                )?
                .output,
            )
            .map_err(|e| e.context(what.clone()))?;
            let entry_points = [
                ("Module::forward", mha.forward(&x)?),
                (
                    "forward_with, inference",
                    mha.forward_with(&x, &AttentionOptions::default(), None)?
                        .output,
                ),
                (
                    "forward_with, weights",
                    mha.forward_with(
                        &x,
                        &AttentionOptions {
                            return_weights: true,
                            ..Default::default()
                        },
                        None,
                    )?
                    .output,
                ),
            ];
            for (entry, out) in entry_points {
                let got = grads(out).map_err(|e| e.context(format!("{what}: {entry}")))?;
                for (name, want) in &reference {
                    let scale = want.abs()?.max_all()?.to_scalar::<f32>()? as f64;
                    assert!(scale > 0.0, "{what}: {name} has a zero gradient");
                    let diff = max_abs_diff(&got[name], want)?;
                    // Each entry of a gradient sums products over the output's 2 × 6 × 16
                    // elements it reaches; paths that differ by f32 rounding in each product
                    // differ by about √(products summed) roundings in the sum, which a
                    // variable shared by every element (the scaled sinusoid's one `scale`)
                    // makes visible when the terms cancel.
                    let summed = (x.elem_count() / want.elem_count()).max(1) as f64;
                    assert!(
                        diff <= 1e-5 * scale.max(1.0) * summed.sqrt(),
                        "{what}: {entry}: {name} differs by {diff:e}"
                    );
                }
            }
        }
    }
    Ok(())
}

/// A user's mask or attention sinks that learn get their gradient from every entry point, also
/// when nothing else in the block does (weights loaded as constants, an input that tracks
/// nothing) and the call is in inference mode, where the fused core would read them as
/// constants: equal to the same block's in f64 (candle's ops) within 1e-5 of the largest
/// entry, with T5's rows and with no encoding, causal and not.
fn learned_terms_beside_a_frozen_block(dev: &Device) -> anyhow::Result<()> {
    let (d_model, heads, len) = (16, 4, 7);
    let x = common::randn(0f32, 1.0, (2, len, d_model), dev)?;
    let probe = common::randn(0f32, 1.0, (2, len, d_model), dev)?;
    let mask = common::randn(0f32, 1.0, (1, heads, len, len), dev)?;
    let sinks = common::randn(0f32, 1.0, heads, dev)?;
    let configs = [
        EncodingConfig::None,
        EncodingConfig::T5(candle_posenc::T5Config::new(heads)),
    ];
    for config in &configs {
        for (causal, learned_sinks) in [(false, false), (true, false), (false, true), (true, true)]
        {
            let attn = AttentionConfig::new(d_model, heads)
                .with_causal(causal)
                .with_sinks(learned_sinks);
            let (_, varmap) = zoo::attention(config, &attn, DType::F32, dev)?;
            let grad = |dtype: DType, opts: &AttentionOptions| -> anyhow::Result<Tensor> {
                // Every weight a constant, but the sinks (when the block has them) or the mask.
                let mut tensors: HashMap<String, Tensor> = zoo::named_tensors(&varmap)?
                    .into_iter()
                    .map(|(k, t)| Ok((k, t.detach().to_dtype(dtype)?)))
                    .collect::<anyhow::Result<_>>()?;
                let learned = match learned_sinks {
                    true => candle_core::Var::from_tensor(&sinks.to_dtype(dtype)?)?,
                    false => candle_core::Var::from_tensor(&mask.to_dtype(dtype)?)?,
                };
                if learned_sinks {
                    tensors.insert("attn.sinks".into(), learned.as_tensor().clone());
                }
                let vb = VarBuilder::from_tensors(tensors, dtype, dev);
                let mha =
                    MultiHeadAttention::new(&attn, config.build(vb.pp("enc"))?, vb.pp("attn"))?;
                let opts = AttentionOptions {
                    attn_mask: (!learned_sinks).then_some(learned.as_tensor()),
                    ..opts.clone()
                };
                let out = mha.forward_with(&x.to_dtype(dtype)?, &opts, None)?.output;
                let g = (out * probe.to_dtype(dtype)?)?.sum_all()?.backward()?;
                let g = g
                    .get(learned.as_tensor())
                    .ok_or_else(|| anyhow::anyhow!("no gradient"))?;
                Ok(g.to_dtype(DType::F64)?)
            };
            let want = grad(DType::F64, &AttentionOptions::default())?;
            let scale = want.abs()?.max_all()?.to_scalar::<f64>()?;
            assert!(scale > 0.0, "a zero gradient");
            for (entry, opts) in [
                ("inference", AttentionOptions::default()),
                (
                    "training",
                    AttentionOptions {
                        train: true,
                        ..Default::default()
                    },
                ),
                (
                    "weights",
                    AttentionOptions {
                        return_weights: true,
                        ..Default::default()
                    },
                ),
            ] {
                let learned = if learned_sinks { "sinks" } else { "mask" };
                let what = format!(
                    "{} causal {causal}, learned {learned}: {entry}",
                    config.kind()
                );
                let got = grad(DType::F32, &opts).map_err(|e| e.context(what.clone()))?;
                let diff = max_abs_diff(&got, &want)?;
                assert!(diff <= 1e-5 * scale.max(1.0), "{what}: differs by {diff:e}");
            }
        }
    }
    Ok(())
}

device_tests!(
    every_entry_point_trains,
    learned_terms_beside_a_frozen_block
);

/// Attention dropout on the fused training core: the same `dropout_seed` gives the same
/// output and gradients, bit for bit, another seed another output; the mean over 300 seeds is
/// the output without dropout (inverted dropout keeps the expectation), every element within
/// six standard errors; and the gradients reach every weight.
#[test]
fn fused_dropout_is_seeded_and_unbiased() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, &dev);
    let attn = AttentionConfig::new(16, 4)
        .with_kv_heads(2)
        .with_causal(true)
        .with_dropout(0.4);
    let mha = MultiHeadAttention::new(
        &attn,
        EncodingConfig::Alibi(AlibiConfig::new(4).with_learnable(true)).build(vb.pp("enc"))?,
        vb.pp("attn"),
    )?;
    let x = common::randn(0f32, 1.0, (2, 9, 16), &dev)?;
    let run = |seed: u64| {
        mha.forward_with(
            &x,
            &AttentionOptions {
                train: true,
                dropout_seed: Some(seed),
                ..Default::default()
            },
            None,
        )
        .map(|o| o.output)
    };
    let (a, b, c) = (run(1)?, run(1)?, run(2)?);
    assert_eq!(max_abs_diff(&a, &b)?, 0.0, "same seed, same output");
    assert!(max_abs_diff(&a, &c)? > 1e-3, "another seed, another mask");
    let grads = |out: &Tensor| -> anyhow::Result<Vec<Tensor>> {
        let g = out.sum_all()?.backward()?;
        varmap
            .all_vars()
            .iter()
            .map(|v| {
                g.get(v)
                    .cloned()
                    .ok_or_else(|| anyhow::anyhow!("no gradient"))
            })
            .collect()
    };
    for (ga, gb) in grads(&a)?.iter().zip(grads(&b)?) {
        assert_eq!(max_abs_diff(ga, &gb)?, 0.0, "same seed, same gradients");
        assert!(ga.abs()?.max_all()?.to_scalar::<f32>()? > 0.0);
    }
    let want = mha.forward(&x)?.flatten_all()?.to_vec1::<f32>()?;
    let n = 300;
    let (mut sum, mut sq) = (vec![0f64; want.len()], vec![0f64; want.len()]);
    for seed in 0..n {
        for ((s, q), y) in sum
            .iter_mut()
            .zip(&mut sq)
            .zip(run(100 + seed)?.flatten_all()?.to_vec1::<f32>()?)
        {
            *s += f64::from(y);
            *q += f64::from(y) * f64::from(y);
        }
    }
    for ((s, q), w) in sum.iter().zip(&sq).zip(&want) {
        let mean = s / n as f64;
        let se = ((q / n as f64 - mean * mean).max(1e-12) / n as f64).sqrt();
        assert!(
            (mean - f64::from(*w)).abs() < 6.0 * se + 1e-6,
            "mean {mean} vs {w} (se {se})"
        );
    }
    Ok(())
}
