//! Relative encodings: ALiBi against HF BLOOM, T5 buckets and bias against HF T5, the clipped
//! bias and Shaw attention against direct PyTorch implementations of the seed formulas, and all
//! of them through the attention block (KV cache, masks, ids).

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, IndexOp, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_posenc::plug::{AttentionContext, Columns, LogitsBias, PositionalEncoding};
use candle_posenc::{
    alibi_slopes, Alibi, AlibiConfig, AlibiMode, AlibiSlopes, AttentionConfig, AttentionOptions,
    ClippedBiasConfig, ClippedRelativeBias, EncodingConfig, Error, KvCache, MultiHeadAttention,
    PositionIds, Positions, ShawConfig, ShawRelativePosition, T5Config, T5RelativeBias,
};
use common::{assert_close, assert_close_scaled, fixture, get, max_abs_diff, prefixed};

fn alibi_slopes_match_bloom(dev: &Device) -> anyhow::Result<()> {
    let fx = fixture("alibi.safetensors", dev)?;
    for n in 1..=64usize {
        let ours = Tensor::new(alibi_slopes(n)?.as_slice(), dev)?.to_dtype(DType::F32)?;
        // BLOOM raises an f32 base to integer powers; ours is f64: they agree to f32 rounding.
        assert_close(
            &ours,
            get(&fx, &format!("slopes_{n}")),
            1e-7,
            &format!("{n} heads"),
        )?;
    }
    Ok(())
}

/// ALiBi's dense bias for `tq` queries against `tk` keys in causal attention or not.
fn alibi_bias(
    alibi: &Alibi,
    q: &Positions,
    tq: usize,
    k: &Positions,
    tk: usize,
    causal: bool,
) -> candle_posenc::Result<Tensor> {
    alibi.bias(&AttentionContext::new(q, tq, k, tk).with_causal(causal))
}

fn alibi_bias_matches_bloom(dev: &Device) -> anyhow::Result<()> {
    let fx = fixture("alibi.safetensors", dev)?;
    for n in [1usize, 5, 8, 12, 33, 64] {
        let alibi = Alibi::new(&AlibiConfig::new(n), dev)?;
        let bias = alibi_bias(
            &alibi,
            &Positions::Offset(0),
            7,
            &Positions::Offset(0),
            7,
            true,
        )?; // (1, n, 1, 7)
            // Ours is m·(j − i_last); BLOOM's is m·j. They differ by m·i_last, a per-row constant.
        let shift = alibi.slopes().affine(6.0, 0.0)?.reshape((1, n, 1, 1))?;
        let bloom = get(&fx, &format!("alibi_{n}")).reshape((1, n, 1, 7))?;
        // Values up to 6 · 0.5: f32 rounding of 3 is 2.4e-7.
        assert_close(
            &bias.broadcast_add(&shift)?,
            &bloom,
            1e-6,
            &format!("alibi {n}"),
        )?;
    }
    // Left padding: BLOOM numbers positions from the first real token; so do position ids.
    let alibi = Alibi::new(&AlibiConfig::new(12), dev)?;
    let ids = Positions::from(PositionIds::from_rows(
        &[vec![0, 0, 0, 1, 2, 3, 4], vec![0, 1, 2, 3, 4, 5, 6]],
        dev,
    )?);
    let bias = alibi_bias(&alibi, &ids, 7, &ids, 7, true)?; // (2, 12, 1, 7)
    let last = Tensor::new(&[4f32, 6.0], dev)?.reshape((2, 1, 1, 1))?;
    let shift = last.broadcast_mul(&alibi.slopes().reshape((1, 12, 1, 1))?)?;
    let bloom = get(&fx, "padded_alibi_12").reshape((2, 12, 1, 7))?;
    assert_close(&bias.broadcast_add(&shift)?, &bloom, 1e-6, "padded")?;
    Ok(())
}

fn alibi_forms_and_modes(dev: &Device) -> anyhow::Result<()> {
    let slopes = alibi_slopes(6)?;
    let sym = Alibi::new(&AlibiConfig::new(6).with_mode(AlibiMode::Symmetric), dev)?;
    let pair = Alibi::new(
        &AlibiConfig::new(6).with_mode(AlibiMode::CausalPairwise),
        dev,
    )?;
    // Explicit modes hold whatever the attention's causality.
    let (q3, k0) = (Positions::Offset(3), Positions::Offset(0));
    let rows = |a: &Alibi, causal| -> anyhow::Result<Vec<Vec<Vec<f32>>>> {
        Ok(alibi_bias(a, &q3, 4, &k0, 7, causal)?
            .i(0)?
            .to_vec3::<f32>()?)
    };
    let (s, p) = (rows(&sym, true)?, rows(&pair, false)?);
    for (h, m) in slopes.iter().enumerate() {
        for i in 0..4 {
            for j in 0..7 {
                let d = j as f64 - (i + 3) as f64;
                assert!((s[h][i][j] as f64 + m * d.abs()).abs() < 1e-6);
                assert!((p[h][i][j] as f64 - m * d).abs() < 1e-6);
            }
        }
    }
    // The per-key and pairwise causal forms give the same attention, in full and when decoding.
    let x = common::randn(0f32, 1.0, (2, 9, 16), dev)?;
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let cfg = AttentionConfig::new(16, 4).with_causal(true);
    let per_key = MultiHeadAttention::new(
        &cfg,
        Some(Arc::new(Alibi::new(&AlibiConfig::new(4), dev)?)),
        vb.clone(),
    )?;
    let pairwise = per_key.clone().with_encoding(Some(Arc::new(Alibi::new(
        &AlibiConfig::new(4).with_mode(AlibiMode::CausalPairwise),
        dev,
    )?)));
    let a = per_key.forward(&x)?;
    assert_close(&a, &pairwise.forward(&x)?, 1e-5, "per-key vs pairwise")?;
    let mut cache = KvCache::new();
    let steps = (0..9)
        .map(|t| {
            Ok(per_key
                .forward_with(
                    &x.narrow(1, t, 1)?,
                    &AttentionOptions::default(),
                    Some(&mut cache),
                )?
                .output)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    assert_close_scaled(&Tensor::cat(&steps, 1)?, &a, 1e-5, 2e-6, "per-key decode")?;
    // Far from the origin the per-key bias stays small (exact in f32).
    let far = alibi_bias(
        &Alibi::new(&AlibiConfig::new(4), dev)?,
        &Positions::Offset(1_000_000),
        1,
        &Positions::Offset(0),
        1_000_001,
        true,
    )?;
    let last: f32 = far.i((0, 0, 0, 1_000_000))?.to_scalar()?;
    assert_eq!(last, 0.0);
    Ok(())
}

/// One default ALiBi serves both kinds of block: in a bidirectional block it is the symmetric
/// `−m·|i − j|` (checked against the same block without an encoding and that bias as an
/// additive mask, and against the explicit symmetric mode), in a causal block the causal form;
/// the explicit causal mode still gives its per-key row on purpose.
fn alibi_follows_the_block(dev: &Device) -> anyhow::Result<()> {
    let (t, heads) = (9, 4);
    let x = common::randn(0f32, 1.0, (2, t, 16), dev)?;
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let weights = AttentionOptions {
        return_weights: true,
        ..Default::default()
    };
    let slopes = Tensor::new(alibi_slopes(heads)?.as_slice(), dev)?
        .to_dtype(DType::F32)?
        .reshape((1, heads, 1, 1))?;
    let pos = Tensor::arange(0f32, t as f32, dev)?;
    let dist = pos.unsqueeze(0)?.broadcast_sub(&pos.unsqueeze(1)?)?.abs()?;
    let symmetric_bias = dist
        .unsqueeze(0)?
        .unsqueeze(0)?
        .broadcast_mul(&slopes)?
        .neg()?;
    let with_mode = |mode| -> anyhow::Result<Option<Arc<dyn PositionalEncoding>>> {
        Ok(Some(Arc::new(Alibi::new(
            &AlibiConfig::new(heads).with_mode(mode),
            dev,
        )?)))
    };
    for causal in [false, true] {
        let cfg = AttentionConfig::new(16, heads).with_causal(causal);
        let auto = MultiHeadAttention::new(&cfg, with_mode(AlibiMode::Auto)?, vb.clone())?;
        let explicit = auto.clone().with_encoding(with_mode(match causal {
            true => AlibiMode::Causal,
            false => AlibiMode::Symmetric,
        })?);
        for train in [false, true] {
            let opts = AttentionOptions {
                train,
                ..weights.clone()
            };
            let a = auto.forward_with(&x, &opts, None)?;
            let e = explicit.forward_with(&x, &opts, None)?;
            let what = format!("causal {causal} train {train}");
            assert_close(&a.output, &e.output, 0.0, &what)?;
            let (aw, ew) = (a.weights.expect("weights"), e.weights.expect("weights"));
            assert_close(&aw, &ew, 0.0, &what)?;
            if !causal {
                let none = auto.clone().with_encoding(None);
                let masked = AttentionOptions {
                    attn_mask: Some(&symmetric_bias),
                    ..opts.clone()
                };
                let m = none.forward_with(&x, &masked, None)?;
                assert_close(&a.output, &m.output, 1e-5, &what)?;
                assert_close(&aw, &m.weights.expect("weights"), 1e-6, &what)?;
                // The per-key causal row in a bidirectional block is another attention.
                let forced = auto.clone().with_encoding(with_mode(AlibiMode::Causal)?);
                let f = forced.forward_with(&x, &opts, None)?;
                assert!(max_abs_diff(&f.output, &a.output)? > 1e-3, "{what}");
            }
        }
    }
    Ok(())
}

/// ALiBi, T5 and the clipped bias are candle `Module`s on logits `(B, H, Tq, Tk)`, queries at
/// the last `Tq` key positions: each adds exactly its own bias; ALiBi's default form there is
/// the symmetric one, which under a causal mask gives the causal attention; more queries than
/// keys is a typed error.
fn bias_modules_add_to_logits(dev: &Device) -> anyhow::Result<()> {
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let logits = common::randn(0f32, 1.0, (2, 4, 3, 7), dev)?;
    let (q, k) = (Positions::Offset(4), Positions::Offset(0));
    let alibi = Alibi::new(&AlibiConfig::new(4), dev)?;
    let t5 = T5RelativeBias::new(&T5Config::new(4), vb.pp("t5"))?;
    let clipped = ClippedRelativeBias::new(&ClippedBiasConfig::new(4, 3), vb.pp("c"))?;
    let sym = alibi_bias(&alibi, &q, 3, &k, 7, false)?;
    for (name, got, bias) in [
        ("alibi", alibi.forward(&logits)?, sym.clone()),
        ("t5", t5.forward(&logits)?, t5.bias(&q, 3, &k, 7)?),
        (
            "clipped",
            clipped.forward(&logits)?,
            clipped.bias(&q, 3, &k, 7)?,
        ),
    ] {
        assert_close(&got, &logits.broadcast_add(&bias)?, 0.0, name)?;
    }
    // Under a causal mask the symmetric form is the causal attention.
    let causal = alibi_bias(&alibi, &q, 3, &k, 7, true)?;
    let keep: Vec<f32> = (0..3)
        .flat_map(|i| (0..7).map(move |j| if j <= i + 4 { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    let mask = Tensor::from_vec(keep, (1, 1, 3, 7), dev)?;
    let soft = |b: &Tensor| {
        candle_nn::ops::softmax_last_dim(&logits.broadcast_add(b)?.broadcast_add(&mask)?)
    };
    assert_close(&soft(&sym)?, &soft(&causal)?, 1e-6, "alibi causal")?;
    let wide = Tensor::zeros((1, 4, 8, 7), DType::F32, dev)?;
    for err in [
        alibi.forward(&wide),
        t5.forward(&wide),
        clipped.forward(&wide),
    ] {
        assert!(err.is_err());
    }
    Ok(())
}

fn alibi_head_range_learnable_and_cache(dev: &Device) -> anyhow::Result<()> {
    let all = alibi_slopes(12)?;
    let shard = Alibi::new(&AlibiConfig::new(12).with_head_range(8, 4), dev)?;
    let got = shard.slopes().to_vec1::<f32>()?;
    for (g, e) in got.iter().zip(&all[8..12]) {
        assert!((*g as f64 - e).abs() < 1e-7);
    }
    // Learnable slopes start at the paper's values and receive gradients.
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let learn = Alibi::new_learnable(&AlibiConfig::new(4).with_learnable(true), vb.pp("alibi"))?;
    let data = varmap
        .data()
        .lock()
        .expect("lock")
        .get("alibi.slopes")
        .expect("slopes var")
        .as_tensor()
        .clone();
    assert_close(
        &data,
        &Tensor::new(&[0.25f32, 0.0625, 0.015625, 0.00390625], dev)?,
        0.0,
        "init",
    )?;
    let bias = alibi_bias(
        &learn,
        &Positions::Offset(0),
        3,
        &Positions::Offset(0),
        3,
        false,
    )?;
    let grads = bias.sum_all()?.backward()?;
    assert!(grads.get(&data).is_some(), "slopes get a gradient");
    // A VarMap that already holds the slopes in another dtype (a bf16 or f64 model's copy):
    // the bias is f32, equal to the f32 slopes' in every mode, and the variable still learns.
    for dtype in [DType::BF16, DType::F64] {
        let held = VarMap::new();
        let var = candle_core::Var::from_tensor(&data.to_dtype(dtype)?)?;
        held.data()
            .lock()
            .expect("lock")
            .insert("alibi.slopes".into(), var.clone());
        let vb = common::seeded_vb(&held, dtype, dev);
        let cfg = AlibiConfig::new(4).with_learnable(true);
        let learn_held = Alibi::new_learnable(&cfg, vb.pp("alibi"))?;
        for causal in [false, true] {
            let (at, n) = (Positions::Offset(0), 3);
            let got = alibi_bias(&learn_held, &at, n, &at, n, causal)?;
            let want = alibi_bias(&learn, &at, n, &at, n, causal)?;
            assert_eq!(got.dtype(), DType::F32, "{dtype:?}");
            assert_close(&got, &want, 0.0, &format!("{dtype:?} causal {causal}"))?;
            let grads = got.sum_all()?.backward()?;
            let g = grads
                .get(var.as_tensor())
                .expect("the held variable's gradient");
            assert_eq!(g.dtype(), dtype);
        }
    }
    // Fixed slopes: one bias build per shape.
    let alibi = Alibi::new(&AlibiConfig::new(4).with_mode(AlibiMode::Symmetric), dev)?;
    for _ in 0..3 {
        alibi_bias(
            &alibi,
            &Positions::Offset(0),
            5,
            &Positions::Offset(0),
            5,
            false,
        )?;
    }
    assert_eq!(alibi.bias_builds(), 1);
    alibi_bias(
        &alibi,
        &Positions::Offset(0),
        6,
        &Positions::Offset(0),
        6,
        false,
    )?;
    assert_eq!(alibi.bias_builds(), 2);
    Ok(())
}

fn t5_buckets_match_hf(dev: &Device) -> anyhow::Result<()> {
    let fx = fixture("t5.safetensors", dev)?;
    let rel = get(&fx, "relative_position").to_vec1::<i64>()?;
    for (nb, md, bi) in [
        (32, 128, true),
        (32, 128, false),
        (16, 64, true),
        (8, 20, false),
        (64, 256, true),
        (4, 5, true),
        (2, 3, false),
        (10, 11, true),
    ] {
        let cfg = T5Config::new(1)
            .with_num_buckets(nb)
            .with_max_distance(md)
            .with_bidirectional(bi);
        let expected = get(&fx, &format!("buckets_{nb}_{md}_{}", bi as u8)).to_vec1::<i64>()?;
        for (d, e) in rel.iter().zip(&expected) {
            assert_eq!(
                cfg.bucket(*d) as i64,
                *e,
                "buckets {nb} max {md} bidirectional {bi}: distance {d}"
            );
        }
    }
    Ok(())
}

fn t5_compute_bias_matches_hf(dev: &Device) -> anyhow::Result<()> {
    let fx = fixture("t5.safetensors", dev)?;
    for (name, bidirectional) in [("encoder", true), ("decoder", false)] {
        let vb = VarBuilder::from_tensors(prefixed(&fx, &format!("{name}.")), DType::F32, dev);
        let t5 = T5RelativeBias::new(&T5Config::new(4).with_bidirectional(bidirectional), vb)?;
        let a = t5.bias(&Positions::Offset(0), 16, &Positions::Offset(0), 200)?;
        assert_close(&a, get(&fx, &format!("{name}.bias_q0")), 0.0, name)?;
        let b = t5.bias(&Positions::Offset(184), 16, &Positions::Offset(0), 200)?;
        assert_close(&b, get(&fx, &format!("{name}.bias_q184")), 0.0, name)?;
        // The same through explicit ids.
        let q = Positions::ids(&Tensor::arange(184u32, 200, dev)?.unsqueeze(0)?)?;
        let k = Positions::ids(&Tensor::arange(0u32, 200, dev)?.unsqueeze(0)?)?;
        assert_close(
            &t5.bias(&q, 16, &k, 200)?,
            get(&fx, &format!("{name}.bias_q184")),
            0.0,
            "ids",
        )?;
        // Buckets are built once per shape.
        let builds = t5.bucket_builds();
        t5.bias(&Positions::Offset(0), 16, &Positions::Offset(0), 200)?;
        assert_eq!(t5.bucket_builds(), builds);
    }
    Ok(())
}

fn clipped_bias_matches_seed(dev: &Device) -> anyhow::Result<()> {
    let fx = fixture("relative.safetensors", dev)?;
    let vb = VarBuilder::from_tensors(prefixed(&fx, "clipped."), DType::F32, dev);
    let rb = ClippedRelativeBias::new(&ClippedBiasConfig::new(4, 3), vb)?;
    let bias = rb.bias(&Positions::Offset(0), 9, &Positions::Offset(0), 9)?;
    assert_close(&bias, get(&fx, "clipped.bias"), 0.0, "clipped")?;
    // Translation invariance: shifting queries and keys together changes nothing.
    let shifted = rb.bias(&Positions::Offset(1000), 9, &Positions::Offset(1000), 9)?;
    assert_close(&shifted, &bias, 0.0, "shift")?;
    Ok(())
}

fn shaw_matches_direct_formula(dev: &Device) -> anyhow::Result<()> {
    let fx = fixture("relative.safetensors", dev)?;
    let vb = VarBuilder::from_tensors(prefixed(&fx, "shaw."), DType::F32, dev);
    for causal in [false, true] {
        for values in [false, true] {
            let shaw =
                ShawRelativePosition::new(&ShawConfig::new(4, 2).with_values(values), vb.clone())?;
            let cfg = AttentionConfig::new(16, 4).with_causal(causal);
            let mha = MultiHeadAttention::new(&cfg, Some(Arc::new(shaw)), vb.clone())?;
            let y = mha.forward(get(&fx, "shaw.x"))?;
            let name = format!("shaw.out_causal{}_values{}", causal as u8, values as u8);
            assert_close(&y, get(&fx, &name), 1e-5, &name)?;
        }
    }
    Ok(())
}

/// Training through Shaw's memory-light keys and values: the gradients of `Σ y²` reaching
/// a^K, a^V and the query projection equal PyTorch autograd through the direct formula (the
/// `(T, T, d)` tensors). The gradients reach ~100, so the tolerance is relative: 1e-6 of the
/// largest (f32 rounding through a long chain is a few 1e-7 of it).
fn shaw_gradients_match_torch(dev: &Device) -> anyhow::Result<()> {
    let fx = fixture("relative.safetensors", dev)?;
    for causal in [false, true] {
        let mut varmap = VarMap::new();
        let vb = common::seeded_vb(&varmap, DType::F32, dev);
        let shaw = ShawRelativePosition::new(&ShawConfig::new(4, 2), vb.clone())?;
        let cfg = AttentionConfig::new(16, 4).with_causal(causal);
        let mha = MultiHeadAttention::new(&cfg, Some(Arc::new(shaw)), vb.clone())?;
        for name in [
            "q_proj.weight",
            "k_proj.weight",
            "v_proj.weight",
            "o_proj.weight",
            "relative_keys.weight",
            "relative_values.weight",
        ] {
            varmap.set_one(name, get(&fx, &format!("shaw.{name}")))?;
        }
        let train = AttentionOptions {
            train: true,
            ..Default::default()
        };
        let y = mha.forward_with(get(&fx, "shaw.x"), &train, None)?.output;
        let grads = y.sqr()?.sum_all()?.backward()?;
        let vars = varmap.data().lock().map_err(|e| anyhow::anyhow!("{e}"))?;
        for name in ["relative_keys", "relative_values", "q_proj"] {
            let var = &vars[&format!("{name}.weight")];
            let got = grads.get(var.as_tensor()).expect("a gradient");
            let want = format!("shaw.grad_causal{}.{name}", causal as u8);
            let want_t = get(&fx, &want);
            let scale = want_t.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(scale > 1.0, "{want}: the loss must reach this gradient");
            assert_close(got, want_t, 1e-6 * scale as f64, &want)?;
        }
    }
    Ok(())
}

/// The dense bias a hook's answer stands for.
fn dense_of(bias: Option<LogitsBias>, tq: usize, tk: usize) -> anyhow::Result<Tensor> {
    Ok(bias.expect("a bias").to_dense(tq, tk)?)
}

/// Positions `start..start + len` as explicit ids.
fn ids_from(start: u32, len: usize, dev: &Device) -> anyhow::Result<Positions> {
    Ok(Positions::ids(
        &Tensor::arange(start, start + len as u32, dev)?.unsqueeze(0)?,
    )?)
}

/// Every relative encoding answers offsets with rows on shifted columns (but the per-key
/// causal ALiBi row, which is dense) and explicit ids with a dense bias or a column map; for
/// the same positions both stand for exactly the same bias, for queries before, at and after
/// their keys, causal or not, and Shaw's value term likewise; T5 and ALiBi equal their own
/// dense `bias`.
fn relative_forms_agree(dev: &Device) -> anyhow::Result<()> {
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let mut encs = relative_encodings(dev, &vb)?;
    encs.push((
        "alibi_pairwise",
        Arc::new(Alibi::new(
            &AlibiConfig::new(4).with_mode(AlibiMode::CausalPairwise),
            dev,
        )?),
    ));
    let t5 = T5RelativeBias::new(
        &T5Config::new(4).with_num_buckets(8).with_max_distance(12),
        vb.pp("t5b"),
    )?;
    encs.push(("t5_bidirectional", Arc::new(t5.clone())));
    let q = common::randn(0f32, 1.0, (2, 4, 5, 4), dev)?;
    let mut shifted = 0;
    for (name, enc) in &encs {
        for (qs, ks, tk) in [(0, 0, 5), (0, 0, 30), (20, 0, 25), (3, 9, 7), (40, 0, 1)] {
            for causal in [false, true] {
                let (qp, kp) = (Positions::Offset(qs), Positions::Offset(ks));
                let (qi, ki) = (ids_from(qs as u32, 5, dev)?, ids_from(ks as u32, tk, dev)?);
                let by_offset = AttentionContext::new(&qp, 5, &kp, tk).with_causal(causal);
                let by_ids = AttentionContext::new(&qi, 5, &ki, tk).with_causal(causal);
                let what = format!("{name} q at {qs}, {tk} keys at {ks}, causal {causal}");
                let answer = enc.logits_bias(&q, &by_offset)?;
                match &answer {
                    Some(LogitsBias::Relative(r)) => {
                        assert!(matches!(r.columns(), Columns::Shift(_)), "{what}");
                        shifted += 1;
                    }
                    _ => assert!(
                        *name == "alibi" && causal,
                        "{what}: only causal ALiBi is dense"
                    ),
                }
                let a = dense_of(answer, 5, tk)?;
                let b = dense_of(enc.logits_bias(&q, &by_ids)?, 5, tk)?;
                let shape = (2, 4, 5, tk);
                // Exact, except Shaw's products: offsets read exactly the rows their pairs
                // reach, ids a bound on them, so the matmul widths (and rounding) differ.
                let tol = if *name == "shaw" { 1e-6 } else { 0.0 };
                assert_close(&a.broadcast_as(shape)?, &b.broadcast_as(shape)?, tol, &what)?;
                if *name == "t5_bidirectional" {
                    let own = t5.bias(&qp, 5, &kp, tk)?;
                    assert_close(
                        &a.broadcast_as(shape)?,
                        &own.broadcast_as(shape)?,
                        0.0,
                        &what,
                    )?;
                }
                if let Some(values) = enc.value_term(&by_offset)? {
                    let probs = common::rand(0f32, 1.0, shape, dev)?;
                    let want = enc
                        .value_term(&by_ids)?
                        .expect("ids too")
                        .weighted_sum(&probs)?;
                    assert_close(&values.weighted_sum(&probs)?, &want, 1e-6, &what)?;
                }
            }
        }
    }
    assert_eq!(shifted, encs.len() * 5 * 2 - 5);
    Ok(())
}

/// Attention over query blocks (fixed sizes 1, 3, 4 and automatic from a tiny budget) equals
/// one block, in inference and training, causal or not, with masks, ids and a KV cache, for
/// every encoding that enters attention.
fn query_blocks_equal_one_block(dev: &Device) -> anyhow::Result<()> {
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let x = common::randn(0f32, 1.0, (2, 10, 16), dev)?;
    let pad = Tensor::new(&[[0u8, 0, 1, 1, 1, 1, 1, 1, 1, 1], [1; 10]], dev)?;
    let extra = common::randn(0f32, 1.0, (1, 4, 10, 10), dev)?;
    let ids = Positions::ids(&Tensor::new(&[[3u32, 1, 4, 1, 5, 9, 2, 6, 5, 3]], dev)?)?;
    let encs = relative_and_rotary_encodings(dev, &vb)?;
    for causal in [false, true] {
        for (name, enc) in &encs {
            let cfg = AttentionConfig::new(16, 4)
                .with_kv_heads(2)
                .with_causal(causal);
            let one = MultiHeadAttention::new(&cfg, Some(enc.clone()), vb.pp("attn"))?;
            // A budget of 2 rows of 4 heads × 10 keys × 4 bytes: blocks of 2 queries.
            let auto = cfg.clone().with_logits_budget(2 * 2 * 4 * 10 * 4);
            assert_eq!(auto.query_block_for(2, 10, 10, 4), 2);
            let mut blocked = vec![MultiHeadAttention::new(
                &auto,
                Some(enc.clone()),
                vb.pp("attn"),
            )?];
            for n in [1, 3, 4] {
                blocked.push(MultiHeadAttention::new(
                    &cfg.clone().with_query_block(Some(n)),
                    Some(enc.clone()),
                    vb.pp("attn"),
                )?);
            }
            for (mask, extra, positions, train) in [
                (None, None, None, false),
                (None, None, None, true),
                (Some(&pad), Some(&extra), None, false),
                (Some(&pad), None, None, true),
                (None, None, Some(&ids), false),
            ] {
                let opts = AttentionOptions {
                    padding_mask: mask,
                    attn_mask: extra,
                    positions,
                    return_weights: true,
                    train,
                    ..Default::default()
                };
                let want = one.forward_with(&x, &opts, None)?;
                for mha in &blocked {
                    let got = mha.forward_with(&x, &opts, None)?;
                    let what = format!(
                        "{name} causal={causal} block={:?} masked={} ids={} train={train}",
                        mha.config().query_block,
                        mask.is_some(),
                        positions.is_some()
                    );
                    assert_close(&got.output, &want.output, 1e-5, &what)?;
                    assert_close(
                        got.weights.as_ref().expect("weights"),
                        want.weights.as_ref().expect("weights"),
                        1e-6,
                        &what,
                    )?;
                }
            }
            // Gradients through the blocks equal those through one block.
            let train = AttentionOptions {
                train: true,
                ..Default::default()
            };
            let want = one
                .forward_with(&x, &train, None)?
                .output
                .sqr()?
                .sum_all()?
                .backward()?;
            let got = blocked[2]
                .forward_with(&x, &train, None)?
                .output
                .sqr()?
                .sum_all()?
                .backward()?;
            for var in varmap.all_vars() {
                if let (Some(a), Some(b)) = (got.get(var.as_tensor()), want.get(var.as_tensor())) {
                    assert_close_scaled(
                        a,
                        b,
                        1e-4,
                        1e-6,
                        &format!("{name} causal={causal} gradient"),
                    )?;
                }
            }
            // Decoding after a blocked prefill equals the whole sequence at once.
            if causal {
                let mut cache = KvCache::new();
                let mha = &blocked[2];
                let mut outs = vec![
                    mha.forward_with(&x.narrow(1, 0, 7)?, &Default::default(), Some(&mut cache))?
                        .output,
                ];
                for t in 7..10 {
                    outs.push(
                        mha.forward_with(
                            &x.narrow(1, t, 1)?,
                            &Default::default(),
                            Some(&mut cache),
                        )?
                        .output,
                    );
                }
                let want = one.forward(&x)?;
                assert_close_scaled(&Tensor::cat(&outs, 1)?, &want, 1e-5, 2e-6, name)?;
            }
        }
    }
    Ok(())
}

/// Bias tables are built once per shape, not per call: through the attention block the T5
/// lookup (and, for fixed slopes, the symmetric ALiBi rows) is built once per query block
/// shape, and repeated forwards build nothing.
fn bias_tables_built_once_per_shape(dev: &Device) -> anyhow::Result<()> {
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let t5 = Arc::new(T5RelativeBias::new(&T5Config::new(4), vb.pp("t5"))?);
    let alibi = Arc::new(Alibi::new(
        &AlibiConfig::new(4).with_mode(AlibiMode::Symmetric),
        dev,
    )?);
    let x = common::randn(0f32, 1.0, (2, 12, 16), dev)?;
    for block in [None, Some(4)] {
        let cfg = AttentionConfig::new(16, 4).with_query_block(block);
        let t5_attn = MultiHeadAttention::new(&cfg, Some(t5.clone()), vb.pp("a"))?;
        let alibi_attn = MultiHeadAttention::new(&cfg, Some(alibi.clone()), vb.pp("a"))?;
        t5_attn.forward(&x)?;
        alibi_attn.forward(&x)?;
        let (t5_builds, alibi_builds) = (t5.bucket_builds(), alibi.bias_builds());
        for _ in 0..3 {
            t5_attn.forward(&x)?;
            alibi_attn.forward(&x)?;
        }
        assert_eq!(t5.bucket_builds(), t5_builds, "t5, blocks {block:?}");
        assert_eq!(alibi.bias_builds(), alibi_builds, "alibi, blocks {block:?}");
    }
    Ok(())
}

fn relative_encodings(
    dev: &Device,
    vb: &VarBuilder,
) -> anyhow::Result<Vec<(&'static str, Arc<dyn PositionalEncoding>)>> {
    Ok(vec![
        ("alibi", Arc::new(Alibi::new(&AlibiConfig::new(4), dev)?)),
        (
            "alibi_symmetric",
            Arc::new(Alibi::new(
                &AlibiConfig::new(4).with_mode(AlibiMode::Symmetric),
                dev,
            )?),
        ),
        (
            "t5",
            Arc::new(T5RelativeBias::new(
                &T5Config::new(4)
                    .with_num_buckets(8)
                    .with_max_distance(12)
                    .with_bidirectional(false),
                vb.pp("t5"),
            )?),
        ),
        (
            "clipped",
            Arc::new(ClippedRelativeBias::new(
                &ClippedBiasConfig::new(4, 3),
                vb.pp("clipped"),
            )?),
        ),
        (
            "shaw",
            Arc::new(ShawRelativePosition::new(
                &ShawConfig::new(4, 3),
                vb.pp("shaw"),
            )?),
        ),
    ])
}

/// [`relative_encodings`] and RoPE: every encoding that acts inside attention.
fn relative_and_rotary_encodings(
    dev: &Device,
    vb: &VarBuilder,
) -> anyhow::Result<Vec<(&'static str, Arc<dyn PositionalEncoding>)>> {
    let mut encs = relative_encodings(dev, vb)?;
    encs.push((
        "rope",
        Arc::new(candle_posenc::RotaryEmbedding::new(
            &candle_posenc::RopeConfig::new(4),
            dev,
        )?),
    ));
    Ok(encs)
}

fn decode_with_cache_equals_full_forward(dev: &Device) -> anyhow::Result<()> {
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let x = common::randn(0f32, 1.0, (2, 10, 16), dev)?;
    let cfg = AttentionConfig::new(16, 4)
        .with_kv_heads(2)
        .with_causal(true);
    for (name, enc) in relative_encodings(dev, &vb)? {
        let mha = MultiHeadAttention::new(&cfg, Some(enc), vb.pp("attn"))?;
        let full = mha.forward(&x)?;
        let mut cache = KvCache::new();
        let mut outs = Vec::new();
        for (start, len) in [(0, 3), (3, 1), (4, 1), (5, 5)] {
            outs.push(
                mha.forward_with(
                    &x.narrow(1, start, len)?,
                    &AttentionOptions::default(),
                    Some(&mut cache),
                )?
                .output,
            );
        }
        assert_close_scaled(&Tensor::cat(&outs, 1)?, &full, 1e-5, 2e-6, name)?;
        // Explicit ids equal to the offset range give the same result, up to rounding: Shaw's
        // products with ids span every distance the ids bound, with offsets only those a
        // causal query reaches, so their matmul widths differ (within 1e-6 of the largest
        // output, a few ulps).
        let ids = Positions::ids(&Tensor::arange(0u32, 10, dev)?.unsqueeze(0)?)?;
        let with_ids = mha
            .forward_with(
                &x,
                &AttentionOptions {
                    positions: Some(&ids),
                    ..Default::default()
                },
                None,
            )?
            .output;
        assert_close_scaled(&with_ids, &full, 1e-6, 1e-6, name)?;
    }
    Ok(())
}

/// Inference (bias, masks and softmax fused in place on the CPU) equals the training path
/// without dropout (separate ops, differentiable softmax), for every bias encoding and RoPE,
/// with causality, padding (one sequence fully padded), an additive mask and a KV cache.
fn fused_inference_equals_unfused(dev: &Device) -> anyhow::Result<()> {
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let x = common::randn(0f32, 1.0, (2, 6, 16), dev)?;
    let pad = Tensor::new(&[[0u8, 0, 0, 0, 0, 0], [0, 1, 1, 1, 1, 1]], dev)?;
    let extra = common::randn(0f32, 1.0, (1, 4, 6, 6), dev)?;
    let encs = relative_and_rotary_encodings(dev, &vb)?;
    for causal in [false, true] {
        for (name, enc) in &encs {
            let mha = MultiHeadAttention::new(
                &AttentionConfig::new(16, 4)
                    .with_kv_heads(2)
                    .with_causal(causal),
                Some(enc.clone()),
                vb.pp("attn"),
            )?;
            for (mask, extra) in [(None, None), (Some(&pad), Some(&extra))] {
                let opts = |train| AttentionOptions {
                    padding_mask: mask,
                    attn_mask: extra,
                    return_weights: true,
                    train,
                    ..Default::default()
                };
                let fused = mha.forward_with(&x, &opts(false), None)?;
                let plain = mha.forward_with(&x, &opts(true), None)?;
                let what = format!("{name} causal={causal} masked={}", mask.is_some());
                assert_close(&fused.output, &plain.output, 1e-5, &what)?;
                assert_close(
                    fused.weights.as_ref().expect("weights"),
                    plain.weights.as_ref().expect("weights"),
                    1e-6,
                    &what,
                )?;
            }
        }
    }
    Ok(())
}

fn masks_are_respected(dev: &Device) -> anyhow::Result<()> {
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let x = common::randn(0f32, 1.0, (2, 6, 16), dev)?;
    let pad = Tensor::new(&[[1u8, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dev)?;
    for causal in [false, true] {
        for (name, enc) in relative_encodings(dev, &vb)? {
            let mha = MultiHeadAttention::new(
                &AttentionConfig::new(16, 4).with_causal(causal),
                Some(enc),
                vb.pp("attn"),
            )?;
            let opts = AttentionOptions {
                padding_mask: Some(&pad),
                return_weights: true,
                ..Default::default()
            };
            let w = mha.forward_with(&x, &opts, None)?.weights.expect("weights");
            let on_pad = w
                .i((0, .., .., 4..))?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            assert_eq!(on_pad, 0.0, "{name}: weight on padding");
            if causal {
                let w = w.i(1)?.to_vec3::<f32>()?;
                for head in &w {
                    for (i, row) in head.iter().enumerate() {
                        assert!(
                            row[i + 1..].iter().all(|p| *p == 0.0),
                            "{name}: future key seen"
                        );
                    }
                }
            }
        }
    }
    Ok(())
}

fn relative_order_matters(dev: &Device) -> anyhow::Result<()> {
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let x = common::randn(0f32, 1.0, (1, 6, 16), dev)?;
    let rev = Tensor::new(&[5u32, 4, 3, 2, 1, 0], dev)?;
    for (name, enc) in relative_encodings(dev, &vb)? {
        if name == "alibi" {
            continue; // the per-key form assumes a causal mask
        }
        let mha = MultiHeadAttention::new(&AttentionConfig::new(16, 4), Some(enc), vb.pp("attn"))?;
        let y = mha.forward(&x)?;
        let y_rev = mha
            .forward(&x.index_select(&rev, 1)?)?
            .index_select(&rev, 1)?;
        // Symmetric ALiBi is reversal-invariant (|i − j| is); the others are not.
        let diff = max_abs_diff(&y, &y_rev)?;
        if name == "alibi_symmetric" {
            assert!(diff < 1e-5, "{name}: {diff}");
        } else {
            assert!(diff > 1e-4, "{name}: order should matter ({diff})");
        }
    }
    Ok(())
}

fn configs_round_trip_metadata(dev: &Device) -> anyhow::Result<()> {
    for cfg in [
        EncodingConfig::Alibi(
            AlibiConfig::new(12)
                .with_head_range(4, 4)
                .with_mode(AlibiMode::Symmetric),
        ),
        EncodingConfig::Alibi(AlibiConfig::new(4).with_learnable(true)),
        EncodingConfig::T5(
            T5Config::new(8)
                .with_num_buckets(16)
                .with_max_distance(64)
                .with_bidirectional(false),
        ),
        EncodingConfig::ClippedBias(ClippedBiasConfig::new(4, 16)),
        EncodingConfig::Shaw(ShawConfig::new(8, 4).with_values(false)),
    ] {
        let back = EncodingConfig::from_metadata(&cfg.to_metadata(), "mem")?;
        assert_eq!(back, cfg);
        let varmap = VarMap::new();
        assert!(back
            .build(common::seeded_vb(&varmap, DType::F32, dev))?
            .is_some());
    }
    Ok(())
}

fn bad_input(dev: &Device) -> anyhow::Result<()> {
    let vb = VarBuilder::zeros(DType::F32, dev);
    let config_errors: Vec<(Result<(), Error>, &str)> = vec![
        (Alibi::new(&AlibiConfig::new(0), dev).map(drop), "num_heads"),
        (
            Alibi::new(&AlibiConfig::new(8).with_head_range(6, 4), dev).map(drop),
            "head range",
        ),
        (
            Alibi::new(&AlibiConfig::new(8).with_learnable(true), dev).map(drop),
            "learnable",
        ),
        (
            T5RelativeBias::new(&T5Config::new(0), vb.clone()).map(drop),
            "num_heads",
        ),
        (
            T5RelativeBias::new(&T5Config::new(4).with_num_buckets(3), vb.clone()).map(drop),
            "num_buckets",
        ),
        (
            T5RelativeBias::new(
                &T5Config::new(4)
                    .with_num_buckets(1)
                    .with_bidirectional(false),
                vb.clone(),
            )
            .map(drop),
            "num_buckets",
        ),
        (
            T5RelativeBias::new(&T5Config::new(4).with_max_distance(8), vb.clone()).map(drop),
            "max_distance",
        ),
        (
            ClippedRelativeBias::new(&ClippedBiasConfig::new(0, 4), vb.clone()).map(drop),
            "num_heads",
        ),
        (
            ClippedRelativeBias::new(&ClippedBiasConfig::new(4, 0), vb.clone()).map(drop),
            "max_distance",
        ),
        (
            ShawRelativePosition::new(&ShawConfig::new(0, 4), vb.clone()).map(drop),
            "head_dim",
        ),
        (
            ShawRelativePosition::new(&ShawConfig::new(8, 0), vb.clone()).map(drop),
            "max_distance",
        ),
        (alibi_slopes(0).map(drop), "num_heads"),
    ];
    for (result, field) in config_errors {
        match result {
            Err(Error::InvalidConfig { name, .. }) => assert_eq!(name, field),
            other => panic!("{field}: expected InvalidConfig, got {other:?}"),
        }
    }
    // Encodings whose heads or width disagree with the attention block.
    let x = Tensor::zeros((1, 3, 16), DType::F32, dev)?;
    let cfg = AttentionConfig::new(16, 4);
    let mismatched: Vec<Arc<dyn PositionalEncoding>> = vec![
        Arc::new(Alibi::new(&AlibiConfig::new(8), dev)?),
        Arc::new(T5RelativeBias::new(&T5Config::new(2), vb.clone())?),
        Arc::new(ClippedRelativeBias::new(
            &ClippedBiasConfig::new(3, 2),
            vb.clone(),
        )?),
        Arc::new(ShawRelativePosition::new(
            &ShawConfig::new(8, 2),
            vb.clone(),
        )?),
    ];
    for enc in mismatched {
        let mha = MultiHeadAttention::new(&cfg, Some(enc), vb.clone())?;
        let err = mha
            .forward_with(&x, &AttentionOptions::default(), None)
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::Shape {
                    what: "queries",
                    ..
                }
            ),
            "{err}"
        );
    }
    // A learned T5 table of the wrong shape names the tensor.
    let mut t = HashMap::new();
    t.insert(
        "relative_attention_bias.weight".to_string(),
        Tensor::zeros((16, 4), DType::F32, dev)?,
    );
    let err = T5RelativeBias::new(
        &T5Config::new(4),
        VarBuilder::from_tensors(t, DType::F32, dev),
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::TensorShape { name, .. } if name == "relative_attention_bias.weight"),
        "{err}"
    );
    Ok(())
}

/// Falcon's ALiBi at long positions, where its bfloat16 rounding shows: the per-key bias is
/// `bf16(bf16(m) · p) / √head_dim` at each key's absolute position `p`, computed here with the
/// `half` crate's bfloat16, in every mode; it serialises and checks its head width.
fn alibi_falcon_rounds_as_bfloat16(dev: &Device) -> anyhow::Result<()> {
    let (heads, head_dim) = (12, 4);
    let config = AlibiConfig::new(heads).with_slopes(AlibiSlopes::Falcon { head_dim });
    let json = serde_json::to_string(&EncodingConfig::Alibi(config.clone()))?;
    assert!(
        json.contains(r#""formula":"falcon","head_dim":4"#),
        "{json}"
    );
    let alibi = Alibi::new(&config, dev)?;
    let slopes = alibi_slopes(heads)?;
    let (start, tk) = (1000usize, 40);
    let keys = Positions::Offset(start);
    for (causal, q_len) in [(true, 1), (false, 3)] {
        let queries = Positions::Offset(start + tk - q_len);
        let ctx = AttentionContext::new(&queries, q_len, &keys, tk).with_causal(causal);
        let bias = alibi.bias(&ctx)?;
        assert_eq!(
            bias.dims(),
            &[1, heads, 1, tk],
            "one row per key in every mode"
        );
        let got = bias.flatten_all()?.to_vec1::<f32>()?;
        for (h, m) in slopes.iter().enumerate() {
            let m = half::bf16::from_f32(*m as f32);
            for j in 0..tk {
                // The position stays exact (PyTorch multiplies the int64 positions in f32).
                let product = half::bf16::from_f32(m.to_f32() * (start + j) as f32);
                let want = product.to_f32() / (head_dim as f32).sqrt();
                assert_eq!(got[h * tk + j], want, "head {h}, key {}", start + j);
            }
        }
    }
    let bad = AlibiConfig::new(heads).with_slopes(AlibiSlopes::Falcon { head_dim: 0 });
    assert!(matches!(
        bad.validate(),
        Err(Error::InvalidConfig {
            name: "head_dim",
            ..
        })
    ));
    Ok(())
}

/// Causal Shaw with values in a block: positions as offsets (whose answers stop at distance 0
/// when no row can be masked whole) give what the same positions as explicit ids (every pair
/// answered) give, on the fused core, the row pass and the training path; with a padded start
/// (its rows are masked whole, hence uniform over every key, the unseen ones included) and
/// without.
fn shaw_offsets_equal_ids_in_causal_blocks(dev: &Device) -> anyhow::Result<()> {
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let shaw = ShawRelativePosition::new(&ShawConfig::new(4, 3).with_values(true), vb.pp("shaw"))?;
    let cfg = AttentionConfig::new(16, 4).with_causal(true);
    let mha = MultiHeadAttention::new(&cfg, Some(Arc::new(shaw)), vb.pp("attn"))?;
    for var in common::sorted_vars(&varmap) {
        let noise = common::randn(0f32, 0.5, var.shape(), dev)?;
        var.set(&(var.as_tensor() + noise)?)?;
    }
    let x = common::randn(0f32, 1.0, (2, 6, 16), dev)?;
    let ids = Positions::ids(&Tensor::arange(0u32, 6, dev)?.unsqueeze(0)?)?;
    let padded = Tensor::new(&[[0u8, 0, 1, 1, 1, 1], [1; 6]], dev)?;
    for padding in [None, Some(&padded)] {
        for (weights, train) in [(false, false), (true, false), (false, true)] {
            let run = |positions: Option<&Positions>| -> anyhow::Result<Tensor> {
                let opts = AttentionOptions {
                    positions,
                    padding_mask: padding,
                    return_weights: weights,
                    train,
                    ..Default::default()
                };
                Ok(mha.forward_with(&x, &opts, None)?.output)
            };
            let what = format!(
                "padding {} weights {weights} train {train}",
                padding.is_some()
            );
            assert_close_scaled(&run(None)?, &run(Some(&ids))?, 1e-5, 1e-5, &what)?;
        }
    }
    Ok(())
}

device_tests!(
    alibi_falcon_rounds_as_bfloat16,
    alibi_slopes_match_bloom,
    alibi_bias_matches_bloom,
    alibi_forms_and_modes,
    alibi_follows_the_block,
    bias_modules_add_to_logits,
    alibi_head_range_learnable_and_cache,
    t5_buckets_match_hf,
    t5_compute_bias_matches_hf,
    clipped_bias_matches_seed,
    shaw_matches_direct_formula,
    shaw_gradients_match_torch,
    decode_with_cache_equals_full_forward,
    masks_are_respected,
    relative_order_matters,
    configs_round_trip_metadata,
    fused_inference_equals_unfused,
    relative_forms_agree,
    query_blocks_equal_one_block,
    bias_tables_built_once_per_shape,
    bad_input,
    shaw_offsets_equal_ids_in_causal_blocks,
);
