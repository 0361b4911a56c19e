//! Non-finite inputs propagate as NaN/Inf and are never silently replaced (see the crate docs,
//! "Non-finite values"). A NaN or infinity in the input of attention reaches exactly the
//! outputs that depend on it, for every encoding, on the fused inference path and on the
//! unfused (training) path; masked keys are the one place where a value is dropped, because a
//! masked logit is not used at all.

use crate::common;

use candle_core::{DType, Device, IndexOp, Tensor};
use candle_posenc::{
    AttentionConfig, AttentionContext, AttentionOptions, PositionalEncoding, Positions, QkLayout,
    RopeConfig, RotaryEmbedding, SinusoidalConfig, SinusoidalPositionalEncoding,
};
use common::zoo;

/// How many entries of `t` are not finite.
fn non_finite(t: &Tensor) -> anyhow::Result<usize> {
    let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    Ok(v.iter().filter(|x| !x.is_finite()).count())
}

fn poisoned_input(value: f32) -> anyhow::Result<Tensor> {
    // Batch 2, 5 tokens, d_model 8; token 2 of sequence 0 holds `value` in feature 3.
    let x = common::randn(0f32, 1.0, (2, 5, 8), &Device::Cpu)?;
    let mut v = x.flatten_all()?.to_vec1::<f32>()?;
    v[2 * 8 + 3] = value;
    Ok(Tensor::from_vec(v, (2, 5, 8), &Device::Cpu)?)
}

#[test]
fn non_finite_inputs_reach_the_outputs_that_depend_on_them() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let mut failures = Vec::new();
    for (i, config) in zoo::configs(8, 2, 4).iter().enumerate() {
        for causal in [true, false] {
            let attn = AttentionConfig::new(8, 2)
                .with_head_dim(4)
                .with_causal(causal);
            let (mha, _) = zoo::attention(config, &attn, DType::F32, &dev)?;
            for value in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let x = poisoned_input(value)?;
                for train in [false, true] {
                    let o = AttentionOptions {
                        train,
                        return_weights: true,
                        ..Default::default()
                    };
                    let out = mha.forward_with(&x, &o, None)?;
                    let (y, w) = (out.output, out.weights.expect("weights"));
                    let tag = format!(
                        "{} causal={causal} {value} train={train}",
                        zoo::label(i, config)
                    );
                    // Sequence 1 never sees the bad value.
                    if non_finite(&y.i(1)?)? + non_finite(&w.i(1)?)? != 0 {
                        failures.push(format!("{tag}: leaked into another sequence"));
                    }
                    // Every output of sequence 0 is non-finite: tokens from 2 on attend to
                    // token 2's key and value; tokens before it give key 2 probability 0 under
                    // the causal mask, but 0 · NaN (or 0 · ∞) in the value product is NaN, as
                    // in IEEE arithmetic (and PyTorch): nothing is zeroed out.
                    let seq0 = y.i(0)?;
                    if non_finite(&seq0)? != seq0.elem_count() {
                        failures.push(format!(
                            "{tag}: {} of {} outputs stayed finite",
                            seq0.elem_count() - non_finite(&seq0)?,
                            seq0.elem_count()
                        ));
                    }
                    // The weights: rows that see key 2 are non-finite, and under the causal
                    // mask the rows before it are finite (the masked logit is not used).
                    // (An infinite input gives ±∞ logits, and −∞ is a legitimate logit with
                    // weight 0, so this part is checked for NaN only.)
                    let first_hit = if causal { 2 } else { 0 };
                    let hit = w.i((0, .., first_hit..))?;
                    if value.is_nan() && non_finite(&hit)? != hit.elem_count() {
                        failures.push(format!(
                            "{tag}: weights of rows that see the bad token are finite"
                        ));
                    }
                    if causal && non_finite(&w.i((0, .., ..2))?)? != 0 {
                        failures.push(format!(
                            "{tag}: weights before the bad token are not finite"
                        ));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}

#[test]
fn non_finite_values_in_masks_and_encodings_propagate() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let (mha, _) = zoo::attention(
        &zoo::configs(8, 2, 4)[0],
        &AttentionConfig::new(8, 2),
        DType::F32,
        &dev,
    )?;
    let x = common::randn(0f32, 1.0, (1, 4, 8), &dev)?;
    // A NaN in the additive mask at (query 1, key 3) makes query 1's row NaN, on both paths.
    let mut m = vec![0f32; 16];
    m[4 + 3] = f32::NAN;
    let mask = Tensor::from_vec(m, (1, 1, 4, 4), &dev)?;
    for train in [false, true] {
        let o = AttentionOptions {
            attn_mask: Some(&mask),
            train,
            return_weights: true,
            ..Default::default()
        };
        let out = mha.forward_with(&x, &o, None)?;
        let w = out.weights.expect("weights");
        assert_eq!(
            non_finite(&w.i((0, .., 1))?)?,
            8,
            "train={train}: row 1 of both heads is NaN"
        );
        assert_eq!(
            non_finite(&w)?,
            8,
            "train={train}: the other rows are finite"
        );
        assert_eq!(non_finite(&out.output.i((0, 1))?)?, 8);
    }
    // A −∞ mask entry is a legitimate mask: weight 0, everything finite.
    let mut m = vec![0f32; 16];
    m[4 + 3] = f32::NEG_INFINITY;
    let mask = Tensor::from_vec(m, (1, 1, 4, 4), &dev)?;
    let o = AttentionOptions {
        attn_mask: Some(&mask),
        return_weights: true,
        ..Default::default()
    };
    let w = mha.forward_with(&x, &o, None)?.weights.expect("weights");
    assert_eq!(non_finite(&w)?, 0);
    assert_eq!(w.i((0, 0, 1, 3))?.to_scalar::<f32>()?, 0.0);

    // The encodings on their own: a NaN stays where it was (and in its RoPE pair), nowhere else.
    let pe = SinusoidalPositionalEncoding::new(&SinusoidalConfig::new(8).with_dropout(0.0), &dev)?;
    let x = poisoned_input(f32::NAN)?;
    let y = pe.add_to_input(&x, &AttentionContext::chunk(&Positions::Offset(0), 5))?;
    assert_eq!(non_finite(&y)?, 1);
    assert!(y.i((0, 2, 3))?.to_scalar::<f32>()?.is_nan());
    let rope = RotaryEmbedding::new(&RopeConfig::new(8), &dev)?;
    let q = x.reshape((2, 5, 1, 8))?;
    for owned in [false, true] {
        let r = if owned {
            rope.rotate_queries_keys_owned(
                q.copy()?,
                q.copy()?,
                &Positions::Offset(7),
                &Positions::Offset(7),
                QkLayout::Bthd,
            )?
            .0
        } else {
            rope.rotate_queries(&q, &Positions::Offset(7), QkLayout::Bthd)?
        };
        // Feature 3 pairs with feature 7 (rotate-half): both become NaN, nothing else.
        let row = r.i((0, 2, 0))?.to_vec1::<f32>()?;
        assert!(row[3].is_nan() && row[7].is_nan(), "owned={owned}: {row:?}");
        assert_eq!(non_finite(&r)?, 2, "owned={owned}");
    }
    Ok(())
}

/// A finite mask stays finite when the block casts it to its own dtype: an f64 mask of
/// `f64::MIN` on an f32 block (found by the api fuzz target: the cast made it −∞, and a row
/// masked whole became NaN) saturates to the dtype's lowest value, as a mask of `f32::MIN`
/// would be; NaN and −∞ in a wider mask still pass through.
#[test]
fn wide_masks_saturate_when_cast() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let (mha, _) = zoo::attention(
            &zoo::configs(8, 2, 4)[0],
            &AttentionConfig::new(8, 2),
            dtype,
            &dev,
        )?;
        let x = common::randn(0f32, 1.0, (1, 4, 8), &dev)?.to_dtype(dtype)?;
        let run = |mask: &Tensor| -> anyhow::Result<Tensor> {
            let o = AttentionOptions {
                attn_mask: Some(mask),
                ..Default::default()
            };
            Ok(mha.forward_with(&x, &o, None)?.output)
        };
        // Row 1 masked whole by a finite f64 value past every dtype's range.
        let mut m = vec![0f64; 16];
        m[4..8].iter_mut().for_each(|v| *v = f64::MIN);
        let wide = run(&Tensor::from_vec(m.clone(), (1, 1, 4, 4), &dev)?)?;
        assert_eq!(
            non_finite(&wide)?,
            0,
            "{dtype:?}: finite mask, finite output"
        );
        let mut own = m.clone();
        let lowest = match dtype {
            DType::F16 => -65504.0,
            DType::BF16 => -3.389_531_389_251_535_5e38,
            _ => f32::MIN as f64,
        };
        own[4..8].iter_mut().for_each(|v| *v = lowest);
        let own = Tensor::from_vec(own, (1, 1, 4, 4), &dev)?.to_dtype(dtype)?;
        let same = run(&own)?;
        let diff = (wide.to_dtype(DType::F32)? - same.to_dtype(DType::F32)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert_eq!(diff, 0.0, "{dtype:?}: as the dtype's own lowest value");
        // An f32 mask of f32::MIN, past bf16's and f16's range, too.
        let narrow: Vec<f32> = m.iter().map(|&v| v.max(f32::MIN as f64) as f32).collect();
        let narrow = run(&Tensor::from_vec(narrow, (1, 1, 4, 4), &dev)?)?;
        assert_eq!(
            non_finite(&narrow)?,
            0,
            "{dtype:?}: an f32 mask of f32::MIN"
        );
        // NaN still propagates.
        m[1] = f64::NAN;
        let nan = run(&Tensor::from_vec(m, (1, 1, 4, 4), &dev)?)?;
        assert_eq!(non_finite(&nan.i((0, 0))?)?, 8, "{dtype:?}: NaN row");
    }
    Ok(())
}
