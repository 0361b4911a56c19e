//! Half precision: every encoding in f16 and bf16 against the same block in f32, and RoPE's
//! angles at position 10^6 against an f64 reference.
//!
//! Tolerances come from the formats' unit roundoff u (half the machine epsilon): bf16 keeps
//! 8 significant bits, u = 2^-8 ≈ 3.9e-3; f16 keeps 11, u = 2^-11 ≈ 4.9e-4. One attention block
//! rounds its values about ten times on the way (input, three projections, the encoding's term
//! or rotation, logits, probabilities, the value product, the output projection), and the
//! projections sum d_model products whose rounding errors add up like a random walk. The bound
//! used is 16·u relative to the output's scale (max(1, max |y|)): 6.3e-2 for bf16, 7.8e-3 for
//! f16. The measured errors (printed with --nocapture) sit at 10-30% of that: about 2-5 u.

use crate::common;

use candle_core::{DType, Device, IndexOp, Tensor};
use candle_posenc::{
    AttentionConfig, AttentionOptions, KvCache, Positions, QkLayout, RopeConfig, RotaryEmbedding,
};
use common::{max_abs_diff, zoo};

/// Unit roundoff of a half format.
fn unit_roundoff(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 2f64.powi(-8),
        DType::F16 => 2f64.powi(-11),
        _ => unreachable!("half formats only"),
    }
}

fn half_vs_f32(dev: &Device) -> anyhow::Result<()> {
    let attn = AttentionConfig::new(16, 4)
        .with_kv_heads(2)
        .with_head_dim(4)
        .with_causal(true);
    let x = common::randn(0f32, 1.0, (2, 6, 16), dev)?;
    let at = Positions::Offset(100);
    let opts = AttentionOptions {
        positions: Some(&at),
        ..Default::default()
    };
    let mut failures = Vec::new();
    for (i, config) in zoo::configs(16, 4, 4).iter().enumerate() {
        let (reference, varmap) = zoo::attention(config, &attn, DType::F32, dev)?;
        let want = reference.forward_with(&x, &opts, None)?.output;
        let scale = want.abs()?.max_all()?.to_scalar::<f32>()?.max(1.0) as f64;
        // Both paths: the fused core on widened q, k and v (on the CPU), and candle ops in
        // the half format (asked for the weights).
        let with_weights = AttentionOptions {
            return_weights: true,
            ..opts.clone()
        };
        for dtype in [DType::BF16, DType::F16] {
            let half = zoo::attention_from(config, &attn, &varmap, dtype, dev)?;
            for (path, o) in [("fused", &opts), ("ops", &with_weights)] {
                let got = half.forward_with(&x.to_dtype(dtype)?, o, None)?.output;
                assert_eq!(got.dtype(), dtype);
                let err = max_abs_diff(&got, &want)?;
                let tol = 16.0 * unit_roundoff(dtype) * scale;
                println!(
                    "{} {dtype:?} {path}: max |half − f32| = {err:.2e} (tolerance {tol:.2e})",
                    zoo::label(i, config)
                );
                if err > tol {
                    failures.push(format!(
                        "{} {dtype:?} {path}: {err:e} > {tol:e}",
                        zoo::label(i, config)
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}

/// Angles `m·θ_i` for m near 10^6 in f64, wrapped to (−π, π].
fn reference_angles(rope: &RotaryEmbedding, positions: &[u32]) -> anyhow::Result<Vec<Vec<f64>>> {
    let inv_freq = rope
        .frequencies(*positions.last().unwrap_or(&0) as usize + 1)?
        .inv_freq;
    Ok(positions
        .iter()
        .map(|&m| inv_freq.iter().map(|w| wrap(m as f64 * w)).collect())
        .collect())
}

fn wrap(a: f64) -> f64 {
    let t = a.rem_euclid(std::f64::consts::TAU);
    if t > std::f64::consts::PI {
        t - std::f64::consts::TAU
    } else {
        t
    }
}

/// RoPE at positions 10^6 .. 10^6 + 3: the cos/sin tables (f32 for every model dtype) give the
/// f64 angle within 1e-3 (in fact ~1e-7: the angle is reduced in f64 before rounding), and
/// rotating a unit vector in f32, f16 and bf16 turns it by that angle within 1e-3 (f32, f16)
/// and within the bf16 rounding of the rotated pair, atan(u) ≈ 3.9e-3 (bf16 cannot hold cos
/// and sin more finely; the existing rotary test shows the rotation adds nothing to that).
fn rope_angles_at_a_million(dev: &Device) -> anyhow::Result<()> {
    let head_dim = 16;
    let rope = RotaryEmbedding::new(&RopeConfig::new(head_dim).with_max_position(16), dev)?;
    let positions: Vec<u32> = (1_000_000..1_000_004).collect();
    let want = reference_angles(&rope, &positions)?;
    let ids = Positions::Ids(candle_posenc::PositionIds::from_rows(
        std::slice::from_ref(&positions),
        dev,
    )?);
    let (cos, sin) = rope.cos_sin(&ids, positions.len())?;
    let (cos, sin) = (cos.to_vec2::<f32>()?, sin.to_vec2::<f32>()?);
    let mut worst_table = 0f64;
    for (t, row) in want.iter().enumerate() {
        for (i, &a) in row.iter().enumerate() {
            let got = (sin[t][i] as f64).atan2(cos[t][i] as f64);
            worst_table = worst_table.max(wrap(got - a).abs());
        }
    }
    println!("cos/sin tables at 10^6: worst angle error {worst_table:.2e}");
    assert!(worst_table <= 1e-3, "table angles off by {worst_table:e}");

    // Unit vectors: feature i = 1, its pair partner i + d/2 = 0 (rotate-half pairs), so the
    // rotated pair is (cos, sin) of the angle.
    let half = head_dim / 2;
    for (dtype, tol) in [
        (DType::F32, 1e-3),
        (DType::F16, 1e-3),
        (DType::BF16, 2f64.powi(-8).atan()),
    ] {
        let mut worst = 0f64;
        for i in 0..half {
            let mut e = vec![0f32; head_dim];
            e[i] = 1.0;
            let x = Tensor::new(e.as_slice(), dev)?
                .reshape((1, 1, 1, head_dim))?
                .repeat((1, 1, positions.len(), 1))?
                .to_dtype(dtype)?;
            let y = rope.rotate_queries(&x, &ids, QkLayout::Bhtd)?;
            assert_eq!(y.dtype(), dtype);
            let y = y
                .to_dtype(DType::F64)?
                .reshape((positions.len(), head_dim))?
                .to_vec2::<f64>()?;
            for (t, row) in y.iter().enumerate() {
                let got = row[i + half].atan2(row[i]);
                worst = worst.max(wrap(got - want[t][i]).abs());
            }
        }
        println!("{dtype:?} rotation at 10^6: worst angle error {worst:.2e} (tolerance {tol:.2e})");
        assert!(worst <= tol, "{dtype:?}: angle off by {worst:e} > {tol:e}");
    }
    Ok(())
}

/// Rows masked by the half format's lowest value, against the f32 block masked by f32's.
///
/// Every path widens the mask to f32 (the half format's lowest value becomes f32's) and adds
/// it there, where `s + lowest` rounds back to `lowest` for any logit that is not huge: a row
/// masked whole is uniform over its keys and a row masked in part has zeros where it is
/// masked, the f32 block's answers within the half format's rounding, on every row. (Candle's
/// ops once added it in the half format: in f16 the lowest value, −65504, sits one step (32)
/// from the end of the range, so a logit below −16 rounded `s + lowest` to −∞ and one above 16
/// to −65472, as PyTorch's eager attention does in f16, and the row masked whole was no longer
/// uniform.)
fn rows_masked_by_the_lowest_value(dev: &Device) -> anyhow::Result<()> {
    let attn = AttentionConfig::new(16, 4).with_head_dim(4);
    let x = common::randn(0f32, 1.0, (1, 5, 16), dev)?;
    let config = &zoo::configs(16, 4, 4)[0];
    let (reference, varmap) = zoo::attention(config, &attn, DType::F32, dev)?;
    // Row 2 hidden from every key; row 3 from the first two.
    let mask = |lowest: f32, dtype: DType| -> anyhow::Result<Tensor> {
        let mut m = vec![0f32; 25];
        m[10..15].fill(lowest);
        m[15..17].fill(lowest);
        Ok(Tensor::from_vec(m, (1, 1, 5, 5), dev)?.to_dtype(dtype)?)
    };
    let run =
        |block: &candle_posenc::MultiHeadAttention, x: &Tensor, mask: &Tensor, weights: bool| {
            let o = AttentionOptions {
                attn_mask: Some(mask),
                return_weights: weights,
                ..Default::default()
            };
            block.forward_with(x, &o, None)
        };
    let want = run(&reference, &x, &mask(f32::MIN, DType::F32)?, false)?.output;
    let scale = want.abs()?.max_all()?.to_scalar::<f32>()?.max(1.0) as f64;
    let rows = |t: &Tensor, rows: &[usize]| -> anyhow::Result<Tensor> {
        let picked: Vec<Tensor> = rows
            .iter()
            .map(|&r| t.i((.., r)))
            .collect::<Result<_, _>>()?;
        Ok(Tensor::stack(&picked, 1)?.to_dtype(DType::F32)?)
    };
    for (dtype, lowest) in [(DType::F16, -65504f32), (DType::BF16, -3.389_531_4e38)] {
        let half = zoo::attention_from(config, &attn, &varmap, dtype, dev)?;
        let (x, mask) = (x.to_dtype(dtype)?, mask(lowest, dtype)?);
        let (fused, ops) = (run(&half, &x, &mask, false)?, run(&half, &x, &mask, true)?);
        let tol = 16.0 * unit_roundoff(dtype) * scale;
        let all = [0usize, 1, 2, 3, 4];
        let err = max_abs_diff(&rows(&fused.output, &all)?, &rows(&want, &all)?)?;
        assert!(err <= tol, "{dtype:?} fused: {err:e} > {tol:e}");
        let w = ops.weights.expect("asked for").to_dtype(DType::F32)?;
        let row2 = w.i((0, .., 2))?.to_vec2::<f32>()?;
        let row3 = w.i((0, .., 3))?.to_vec2::<f32>()?;
        for (r2, r3) in row2.iter().zip(&row3) {
            assert!(r3[..2].iter().all(|&p| p == 0.0), "{dtype:?}: {r3:?}");
            let sum: f32 = r2.iter().sum();
            assert!(
                r2.iter().all(|&p| p >= 0.0) && (sum - 1.0).abs() < 1e-2,
                "{dtype:?}: {r2:?}"
            );
            assert!(
                r2.iter().all(|&p| (p - 0.2).abs() < 1e-2),
                "{dtype:?}: {r2:?}"
            );
        }
        let err = max_abs_diff(&rows(&ops.output, &all)?, &rows(&want, &all)?)?;
        assert!(err <= tol, "{dtype:?} ops: {err:e} > {tol:e}");
    }
    Ok(())
}

/// Returned weights of a half block sum to one within the format's rounding of each weight, over
/// rows of several hundred keys, on the training path and in inference: the softmax runs in f32
/// (a row summed in bf16 drifted by 5% over 168 keys, found by the api fuzz target).
fn weights_sum_to_one(dev: &Device) -> anyhow::Result<()> {
    for dtype in [DType::BF16, DType::F16] {
        let (mha, _vars) = zoo::attention(
            &candle_posenc::EncodingConfig::Alibi(candle_posenc::AlibiConfig::new(4)),
            &AttentionConfig::new(32, 4).with_causal(true),
            dtype,
            dev,
        )?;
        let x = common::randn(0f32, 1.0, (2, 400, 32), dev)?.to_dtype(dtype)?;
        for train in [false, true] {
            let w = mha
                .forward_with(
                    &x,
                    &AttentionOptions {
                        return_weights: true,
                        train,
                        ..Default::default()
                    },
                    None,
                )?
                .weights
                .ok_or_else(|| anyhow::anyhow!("weights"))?;
            let sums = w
                .to_dtype(DType::F32)?
                .sum(3)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            // Each weight is rounded once to the format: at most 2u relative over the row.
            let tol = 2.0 * unit_roundoff(dtype) as f32;
            let worst = sums.iter().fold(0f32, |m, s| m.max((s - 1.0).abs()));
            assert!(
                worst <= tol,
                "{dtype:?} train {train}: a row sums to 1 ± {worst}"
            );
        }
    }
    Ok(())
}

/// Decoding in bf16 and f16 equals the same block's forward over the whole sequence, for
/// every encoding: the steps read the cache in its dtype a key tile at a time and project
/// their token by matrix–vector products, the full forward widens the cache once and projects
/// by candle's matmul. Both round the same values to the format, their sums may run in
/// different orders: the bound is 8·u relative to the output's scale (at this size the two
/// agree bit for bit).
fn half_decoding_equals_the_full_forward(dev: &Device) -> anyhow::Result<()> {
    let attn = AttentionConfig::new(16, 4)
        .with_kv_heads(2)
        .with_head_dim(4)
        .with_causal(true);
    let (t, steps) = (24, 4);
    let x = common::randn(0f32, 1.0, (1, t, 16), dev)?;
    let opts = AttentionOptions::default();
    let mut failures = Vec::new();
    for (i, config) in zoo::configs(16, 4, 4).iter().enumerate() {
        let (_, varmap) = zoo::attention(config, &attn, DType::F32, dev)?;
        for dtype in [DType::BF16, DType::F16] {
            let half = zoo::attention_from(config, &attn, &varmap, dtype, dev)?;
            let xh = x.to_dtype(dtype)?;
            let want = half.forward_with(&xh, &opts, None)?.output;
            let mut cache = KvCache::new();
            half.forward_with(&xh.narrow(1, 0, t - steps)?, &opts, Some(&mut cache))?;
            let mut got = Vec::new();
            for s in t - steps..t {
                let step = half.forward_with(&xh.narrow(1, s, 1)?, &opts, Some(&mut cache))?;
                got.push(step.output);
            }
            let got = Tensor::cat(&got, 1)?;
            let want = want.narrow(1, t - steps, steps)?;
            let scale = want
                .to_dtype(DType::F32)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?
                .max(1.0) as f64;
            let err = max_abs_diff(&got, &want)?;
            let tol = 8.0 * unit_roundoff(dtype) * scale;
            println!(
                "{} {dtype:?}: max |steps − full| = {err:.2e} (tolerance {tol:.2e})",
                zoo::label(i, config)
            );
            if err > tol {
                failures.push(format!(
                    "{} {dtype:?}: {err:e} > {tol:e}",
                    zoo::label(i, config)
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}

/// ALiBi's causal row over a 600-token prefill, `m·(j − 599)` for every key, reaches −150 for the
/// steepest head, where bf16 steps by whole units: every path adds it in f32, so a half block
/// stays within its format's rounding of the f64 block (with returned weights, candle's ops,
/// it was 21% of the largest output off in bf16 when they added it in bf16), in inference and
/// in training.
fn long_causal_alibi_rows(dev: &Device) -> anyhow::Result<()> {
    use candle_posenc::{AlibiConfig, EncodingConfig};
    let config = EncodingConfig::Alibi(AlibiConfig::new(4));
    let attn = AttentionConfig::new(256, 4).with_causal(true);
    let (_, varmap) = zoo::attention(&config, &attn, DType::F32, dev)?;
    // Logits of order one, as a trained model's (the zoo's noise gives ±60).
    for (name, var) in varmap.data().lock().expect("varmap").iter() {
        if name.contains("q_proj") || name.contains("k_proj") {
            let t = (var.as_tensor() * 0.1)?.to_dtype(DType::BF16)?;
            var.set(&t.to_dtype(var.dtype())?)?;
        }
    }
    let x = common::randn(0f32, 1.0, (1, 600, 256), dev)?.to_dtype(DType::BF16)?;
    let exact = zoo::attention_from(&config, &attn, &varmap, DType::F64, dev)?;
    let want = exact
        .forward_with(&x.to_dtype(DType::F64)?, &AttentionOptions::default(), None)?
        .output;
    let scale = want.abs()?.max_all()?.to_scalar::<f64>()?;
    for dtype in [DType::BF16, DType::F16] {
        let half = zoo::attention_from(&config, &attn, &varmap, dtype, dev)?;
        for (train, return_weights) in [(false, false), (false, true), (true, false)] {
            let opts = AttentionOptions {
                train,
                return_weights,
                ..Default::default()
            };
            let got = half.forward_with(&x.to_dtype(dtype)?, &opts, None)?.output;
            let err = max_abs_diff(&got.to_dtype(DType::F64)?, &want)?;
            let tol = 4.0 * unit_roundoff(dtype) * scale;
            assert!(
                err <= tol,
                "{dtype:?} train {train} weights {return_weights}: {err:e} > {tol:e}"
            );
        }
    }
    Ok(())
}

device_tests!(
    long_causal_alibi_rows,
    half_decoding_equals_the_full_forward,
    half_vs_f32,
    weights_sum_to_one,
    rope_angles_at_a_million,
    rows_masked_by_the_lowest_value
);
