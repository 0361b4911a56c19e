//! RoPE: frequencies for every HF `rope_type` against `modeling_rope_utils`, cos/sin against
//! HF's rotary module, rotations against HF's `apply_rotary_pos_emb` (Llama, GPT-NeoX partial,
//! GPT-J interleaved), xPos against rotary-embedding-torch, gradients against torch autograd and
//! finite differences, properties, the attention block with a KV cache, config parsing, and bad
//! input.
// Products of tensors this file lays out itself (clippy.toml sends the library's through
// src/matmul.rs).
#![allow(clippy::disallowed_methods)]

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Module, Tensor, Var, D};
use candle_nn::{VarBuilder, VarMap};
use candle_posenc::positions::PositionIds;
use candle_posenc::rotary::mixed::{RopeMixed, RopeMixedConfig};
use candle_posenc::{
    AttentionConfig, AttentionOptions, EncodingConfig, Error, KvCache, LongRopeScaling,
    MultiHeadAttention, Positions, QkLayout, RopeConfig, RopeKernel, RopeLayout, RopeScaling,
    RotaryEmbedding, YarnScaling,
};
use common::{assert_close, assert_close_scaled, fixture, get};

const KERNELS: [RopeKernel; 2] = [RopeKernel::Fused, RopeKernel::Ops];

fn f64s(t: &Tensor) -> anyhow::Result<Vec<f64>> {
    Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?)
}

/// One fixture case: name, rotary_dim, base, scaling, seq_len.
type Case = (&'static str, usize, f64, RopeScaling, usize);

/// The scaling of each fixture case, as this crate spells it.
fn fixture_cases(fx: &HashMap<String, Tensor>) -> anyhow::Result<Vec<Case>> {
    let short = f64s(get(fx, "longrope.short_factor"))?;
    let long = f64s(get(fx, "longrope.long_factor"))?;
    let longrope = LongRopeScaling {
        short_factor: short,
        long_factor: long,
        original_max_position_embeddings: 256,
        factor: 1024.0 / 256.0,
        attention_factor: None,
    };
    Ok(vec![
        ("default", 64, 1e4, RopeScaling::None, 0),
        ("default_theta5e5_hd128", 128, 5e5, RopeScaling::None, 0),
        ("linear", 32, 1e4, RopeScaling::Linear { factor: 4.0 }, 0),
        (
            "dynamic_short",
            64,
            1e4,
            RopeScaling::Dynamic {
                factor: 2.0,
                original_max_position_embeddings: 256,
            },
            100,
        ),
        (
            "dynamic_long",
            64,
            1e4,
            RopeScaling::Dynamic {
                factor: 2.0,
                original_max_position_embeddings: 256,
            },
            768,
        ),
        (
            "ntk_alpha5",
            64,
            1e4,
            RopeScaling::NtkAware { alpha: 5.0 },
            0,
        ),
        (
            "yarn",
            64,
            1e4,
            RopeScaling::Yarn(YarnScaling::new(8.0, 512)),
            0,
        ),
        (
            "yarn_custom",
            64,
            5e4,
            RopeScaling::Yarn(
                YarnScaling::new(16.0, 256)
                    .with_betas(24.0, 2.0)
                    .with_mscale(0.9, 0.7)
                    .with_truncate(false),
            ),
            0,
        ),
        (
            "yarn_attention_factor",
            64,
            1e4,
            RopeScaling::Yarn(YarnScaling::new(4.0, 1024).with_attention_factor(1.3)),
            0,
        ),
        (
            "llama3",
            128,
            5e5,
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            },
            0,
        ),
        (
            "llama3_step",
            128,
            5e5,
            RopeScaling::Llama3 {
                factor: 16.0,
                low_freq_factor: 1.0,
                high_freq_factor: 1.0,
                original_max_position_embeddings: 8192,
            },
            0,
        ),
        (
            "llama3_custom",
            64,
            1e4,
            RopeScaling::Llama3 {
                factor: 4.0,
                low_freq_factor: 2.0,
                high_freq_factor: 8.0,
                original_max_position_embeddings: 1024,
            },
            0,
        ),
        (
            "longrope_short",
            32,
            1e4,
            RopeScaling::LongRope(longrope.clone()),
            100,
        ),
        (
            "longrope_long",
            32,
            1e4,
            RopeScaling::LongRope(longrope),
            1000,
        ),
    ])
}

/// inv_freq and the attention factor for every rope type, against HF's functions (which work
/// in f32: agreement is to f32 rounding, ≤ 1e-6 relative).
fn frequencies_match_hf(dev: &Device) -> anyhow::Result<()> {
    let fx = fixture("rotary.safetensors", dev)?;
    for (name, rotary_dim, base, scaling, seq_len) in fixture_cases(&fx)? {
        let ours = scaling.frequencies(rotary_dim, base, seq_len)?;
        let hf = f64s(get(&fx, &format!("freq.{name}.inv_freq")))?;
        assert_eq!(ours.inv_freq.len(), hf.len(), "{name}");
        for (i, (a, b)) in ours.inv_freq.iter().zip(&hf).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs(),
                "{name} inv_freq[{i}]: ours {a} vs HF {b}"
            );
        }
        let factor = ["freq.", name, ".attention_factor"].concat();
        if let Some(hf_factor) = fx.get(&factor) {
            let hf_factor = f64s(hf_factor)?[0];
            assert!(
                (ours.attention_factor - hf_factor).abs() < 1e-12,
                "{name}: {} vs {hf_factor}",
                ours.attention_factor
            );
        }
    }
    Ok(())
}

/// cos/sin tables against HF's `LlamaRotaryEmbedding` output (positions 0..63). HF rounds its
/// angles to f32 (≤ 4e-6 rad at position 63) and then multiplies by the attention factor; ours
/// are f64 angles, so the tolerance is 1e-5.
fn cos_sin_match_hf(dev: &Device) -> anyhow::Result<()> {
    let fx = fixture("rotary.safetensors", dev)?;
    for (name, rotary_dim, base, scaling, _) in fixture_cases(&fx)? {
        if !["default", "yarn", "yarn_custom", "longrope_short"].contains(&name) {
            continue;
        }
        let cfg = RopeConfig::new(64)
            .with_rotary_dim(rotary_dim)
            .with_base(base)
            .with_scaling(scaling);
        let rope = RotaryEmbedding::new(&cfg, dev)?;
        let (cos, sin) = rope.cos_sin(&Positions::Offset(0), 64)?;
        let half = rotary_dim / 2;
        for (ours, key) in [(cos, "cos"), (sin, "sin")] {
            let hf = get(&fx, &format!("cos_sin.{name}.{key}")).narrow(1, 0, half)?;
            assert_close(&ours, &hf, 1e-5, &format!("{name} {key}"))?;
        }
    }
    Ok(())
}

/// Rotations against HF's apply functions (evaluated in f64): Llama rotate-half with an offset
/// and with per-sequence ids, GPT-NeoX partial rotary, GPT-J interleaved (full and partial) on
/// `(B, T, H, D)`, and queries and keys at different positions. f32 parity ≤ 1e-5.
fn rotations_match_hf(dev: &Device) -> anyhow::Result<()> {
    let fx = fixture("rotary.safetensors", dev)?;
    let q = get(&fx, "apply.q");
    let k = get(&fx, "apply.k");
    let ids = Positions::ids(get(&fx, "apply.ids"))?;
    let offset = Positions::Offset(5);
    let bthd = |t: &Tensor| -> anyhow::Result<Tensor> { Ok(t.transpose(1, 2)?.contiguous()?) };
    for kernel in KERNELS {
        for (tag, pos) in [("offset5", &offset), ("ids", &ids)] {
            let cases = [
                ("half", RopeConfig::new(16), QkLayout::Bhtd),
                (
                    "partial8",
                    RopeConfig::new(16).with_rotary_dim(8),
                    QkLayout::Bhtd,
                ),
                (
                    "interleaved16",
                    RopeConfig::new(16).with_layout(RopeLayout::Interleaved),
                    QkLayout::Bthd,
                ),
                (
                    "interleaved8",
                    RopeConfig::new(16)
                        .with_rotary_dim(8)
                        .with_layout(RopeLayout::Interleaved),
                    QkLayout::Bthd,
                ),
            ];
            for (name, cfg, layout) in cases {
                let rope = RotaryEmbedding::new(&cfg.with_kernel(kernel), dev)?;
                let what = format!("{name} {tag} {kernel:?}");
                let (q_in, k_in, suffix) = match layout {
                    QkLayout::Bhtd => (q.clone(), k.clone(), ""),
                    QkLayout::Bthd => (bthd(q)?, bthd(k)?, "_bthd"),
                };
                let (qr, kr) = rope.rotate_queries_keys(&q_in, &k_in, pos, pos, layout)?;
                assert_close(
                    &qr,
                    get(&fx, &format!("apply.{name}.{tag}.q{suffix}")),
                    1e-5,
                    &what,
                )?;
                assert_close(
                    &kr,
                    get(&fx, &format!("apply.{name}.{tag}.k{suffix}")),
                    1e-5,
                    &what,
                )?;
                // The other axis order gives the same rotation.
                let other = match layout {
                    QkLayout::Bhtd => QkLayout::Bthd,
                    QkLayout::Bthd => QkLayout::Bhtd,
                };
                let q_other = q_in.transpose(1, 2)?.contiguous()?;
                let qo = rope.rotate_queries(&q_other, pos, other)?;
                assert_close(
                    &qo.transpose(1, 2)?,
                    &qr,
                    1e-6,
                    &format!("{what} other order"),
                )?;
            }
        }
        // Queries at 9..15, keys at 0..6.
        let rope = RotaryEmbedding::new(&RopeConfig::new(16).with_kernel(kernel), dev)?;
        let (qr, kr) = rope.rotate_queries_keys(
            q,
            k,
            &Positions::Offset(9),
            &Positions::Offset(0),
            QkLayout::Bhtd,
        )?;
        assert_close(&qr, get(&fx, "apply.half.q9k0.q"), 1e-5, "q at 9")?;
        assert_close(&kr, get(&fx, "apply.half.q9k0.k"), 1e-5, "k at 0")?;
        // Interleaved at 0..T against rotary-embedding-torch.
        let rope = RotaryEmbedding::new(
            &RopeConfig::new(16)
                .with_layout(RopeLayout::Interleaved)
                .with_kernel(kernel),
            dev,
        )?;
        assert_close(
            &rope.forward(q)?,
            get(&fx, "lucid.q"),
            1e-5,
            "rotary-embedding-torch",
        )?;
    }
    Ok(())
}

/// xPos against rotary-embedding-torch: it centres the scale's positions, which cancels in
/// q·k, so the logits are compared.
fn xpos_matches_rotary_embedding_torch(dev: &Device) -> anyhow::Result<()> {
    let fx = fixture("rotary.safetensors", dev)?;
    for kernel in KERNELS {
        let cfg = RopeConfig::new(16)
            .with_layout(RopeLayout::Interleaved)
            .with_xpos(32.0)
            .with_kernel(kernel);
        let rope = RotaryEmbedding::new(&cfg, dev)?;
        let p = Positions::Offset(0);
        let (q, k) = rope.rotate_queries_keys(
            get(&fx, "apply.q"),
            get(&fx, "apply.k"),
            &p,
            &p,
            QkLayout::Bhtd,
        )?;
        let logits = q.matmul(&k.t()?)?;
        assert_close(
            &logits,
            get(&fx, "xpos.logits"),
            1e-5,
            &format!("xpos {kernel:?}"),
        )?;
    }
    Ok(())
}

/// The fused path's gradient equals torch autograd through HF's formula, the ops path's
/// gradient, and central finite differences.
fn fused_gradients(dev: &Device) -> anyhow::Result<()> {
    let fx = fixture("rotary.safetensors", dev)?;
    let w = get(&fx, "grad.w");
    let q = Var::from_tensor(get(&fx, "apply.q"))?;
    let rope = RotaryEmbedding::new(&RopeConfig::new(16), dev)?;
    let y = rope.rotate_queries(q.as_tensor(), &Positions::Offset(5), QkLayout::Bhtd)?;
    let grads = (y * w)?.sum_all()?.backward()?;
    let g = grads
        .get(q.as_tensor())
        .expect("fused rope must pass gradients to q");
    assert_close(
        g,
        get(&fx, "grad.q"),
        1e-5,
        "fused gradient vs torch autograd",
    )?;

    // Every layout, partial rotary and xPos: fused vs ops gradients, both inputs.
    let configs = [
        RopeConfig::new(16),
        RopeConfig::new(16).with_layout(RopeLayout::Interleaved),
        RopeConfig::new(16).with_rotary_dim(8),
        RopeConfig::new(16).with_xpos(512.0),
        RopeConfig::new(16).with_scaling(RopeScaling::Yarn(YarnScaling::new(4.0, 4))),
    ];
    let ids = Positions::ids(get(&fx, "apply.ids"))?;
    for cfg in configs {
        for layout in [QkLayout::Bhtd, QkLayout::Bthd] {
            let order = |t: &Tensor| -> anyhow::Result<Tensor> {
                Ok(match layout {
                    QkLayout::Bhtd => t.clone(),
                    QkLayout::Bthd => t.transpose(1, 2)?.contiguous()?,
                })
            };
            let w = order(w)?;
            let mut per_kernel = Vec::new();
            for kernel in KERNELS {
                let rope = RotaryEmbedding::new(&cfg.clone().with_kernel(kernel), dev)?;
                let q = Var::from_tensor(&order(get(&fx, "apply.q"))?)?;
                let k = Var::from_tensor(&order(get(&fx, "apply.k"))?)?;
                let (qr, kr) = rope.rotate_queries_keys(
                    q.as_tensor(),
                    k.as_tensor(),
                    &ids,
                    &Positions::Offset(3),
                    layout,
                )?;
                let loss = ((qr * &w)?.sum_all()? + (kr.sqr()? * &w)?.sum_all()?)?;
                let grads = loss.backward()?;
                per_kernel.push((
                    grads.get(q.as_tensor()).expect("q grad").clone(),
                    grads.get(k.as_tensor()).expect("k grad").clone(),
                ));
            }
            let what = format!("{cfg:?} {layout:?}");
            assert_close(
                &per_kernel[0].0,
                &per_kernel[1].0,
                1e-5,
                &format!("q grad {what}"),
            )?;
            assert_close(
                &per_kernel[0].1,
                &per_kernel[1].1,
                1e-5,
                &format!("k grad {what}"),
            )?;
        }
    }

    // Central finite differences in f64 on a small input, loss = sum(w · rope(x)²) (non-linear).
    let rope = RotaryEmbedding::new(&RopeConfig::new(8).with_xpos(8.0), dev)?;
    let x0 = common::randn(0f64, 1.0, (1, 2, 3, 8), dev)?;
    let wx = common::randn(0f64, 1.0, (1, 2, 3, 8), dev)?;
    let loss = |x: &Tensor| -> anyhow::Result<Tensor> {
        let y = rope.rotate_queries(x, &Positions::Offset(7), QkLayout::Bhtd)?;
        Ok((y.sqr()? * &wx)?.sum_all()?)
    };
    let xv = Var::from_tensor(&x0)?;
    let analytic = loss(xv.as_tensor())?.backward()?;
    let analytic = f64s(analytic.get(xv.as_tensor()).expect("grad"))?;
    let base = f64s(&x0)?;
    let eps = 1e-5;
    for i in 0..base.len() {
        let bump = |delta: f64| -> anyhow::Result<f64> {
            let mut v = base.clone();
            v[i] += delta;
            let x = Tensor::from_vec(v, (1, 2, 3, 8), dev)?;
            Ok(loss(&x)?.to_scalar::<f64>()?)
        };
        let numeric = (bump(eps)? - bump(-eps)?) / (2.0 * eps);
        // The tables are f32, so the loss is exact to ~1e-7 relative; the difference quotient
        // then agrees to ~1e-4 absolute.
        assert!(
            (numeric - analytic[i]).abs() < 1e-4,
            "d/dx[{i}]: numeric {numeric} vs analytic {}",
            analytic[i]
        );
    }
    Ok(())
}

/// bf16 and f16 rotations at positions ~10^6 against an f64 rotation of the same (rounded)
/// input: ≤ 1e-3 relative (norm of the error over the norm of the reference) for f16, and for
/// bf16, whose own rounding of the exact result is 1.5e-3, no worse than that rounding. (An f32
/// angle at 10^6 would be off by up to 0.03 rad, a 3e-2 error.)
fn half_precision_far_positions(dev: &Device) -> anyhow::Result<()> {
    let fx = fixture("rotary.safetensors", dev)?;
    let pos = Positions::ids(get(&fx, "big.positions"))?;
    let rope = RotaryEmbedding::new(&RopeConfig::new(64).with_max_position(16), dev)?;
    for (tag, tol) in [("f32", 1e-6f64), ("bf16", 1e-3), ("f16", 1e-3)] {
        let x = get(&fx, &format!("big.x_{tag}"));
        let y = rope.rotate_queries(x, &pos, QkLayout::Bhtd)?;
        assert_eq!(y.dtype(), x.dtype());
        let reference = get(&fx, &format!("big.rotated_{tag}")).to_dtype(DType::F64)?;
        let err = (y.to_dtype(DType::F64)? - &reference)?
            .sqr()?
            .sum_all()?
            .sqrt()?
            .to_scalar::<f64>()?;
        let norm = reference.sqr()?.sum_all()?.sqrt()?.to_scalar::<f64>()?;
        let rounded = reference.to_dtype(x.dtype())?.to_dtype(DType::F64)?;
        let floor = (rounded - &reference)?
            .sqr()?
            .sum_all()?
            .sqrt()?
            .to_scalar::<f64>()?;
        let (err, floor) = (err / norm, floor / norm);
        // bf16 cannot hold the exact result to 1e-3: rounding it alone costs 1.5e-3 here. The
        // rotation itself must add nothing measurable to that floor, so the angles are exact.
        assert!(
            err <= tol.max(floor * 1.01 + 1e-6),
            "{tag}: relative error {err:e} (rounding the exact result alone: {floor:e})"
        );
    }
    Ok(())
}

/// Rotations preserve norms, and q_m · k_n depends only on m − n (every pair in 0..48).
fn properties(dev: &Device) -> anyhow::Result<()> {
    for layout in [RopeLayout::Half, RopeLayout::Interleaved] {
        let rope = RotaryEmbedding::new(
            &RopeConfig::new(32).with_layout(layout).with_rotary_dim(24),
            dev,
        )?;
        let x = common::randn(0f32, 1.0, (2, 3, 48, 32), dev)?;
        let y = rope.forward(&x)?;
        let norms = |t: &Tensor| -> anyhow::Result<Tensor> { Ok(t.sqr()?.sum(D::Minus1)?.sqrt()?) };
        assert_close(&norms(&y)?, &norms(&x)?, 1e-5, &format!("{layout:?} norms"))?;

        // The same q and k vector at every position.
        let q = common::randn(0f32, 1.0, (1, 1, 1, 32), dev)?.repeat((1, 1, 48, 1))?;
        let k = common::randn(0f32, 1.0, (1, 1, 1, 32), dev)?.repeat((1, 1, 48, 1))?;
        let p = Positions::Offset(0);
        let (qr, kr) = rope.rotate_queries_keys(&q, &k, &p, &p, QkLayout::Bhtd)?;
        let dots: Vec<Vec<f32>> = qr.matmul(&kr.t()?)?.squeeze(0)?.squeeze(0)?.to_vec2()?;
        let mut worst = 0f32;
        for m in 0..48 {
            for n in 0..48 {
                let (m0, n0) = if m >= n { (m - n, 0) } else { (0, n - m) };
                worst = worst.max((dots[m][n] - dots[m0][n0]).abs());
            }
        }
        assert!(
            worst < 1e-4,
            "{layout:?}: q_m·k_n differs from q_(m-n)·k_0 by {worst}"
        );
    }
    Ok(())
}

/// Decoding token by token (and in uneven chunks) through the attention block with a KV cache
/// equals the full forward, with grouped KV heads, for plain, partial, interleaved, scaled and
/// xPos rotary embeddings; explicit ids equal to the offsets give the same result.
fn decode_with_cache_equals_full_forward(dev: &Device) -> anyhow::Result<()> {
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let x = common::randn(0f32, 1.0, (2, 10, 32), dev)?;
    let cfg = AttentionConfig::new(32, 4)
        .with_kv_heads(2)
        .with_causal(true);
    let ropes = [
        RopeConfig::new(8),
        RopeConfig::new(8)
            .with_rotary_dim(4)
            .with_layout(RopeLayout::Interleaved),
        RopeConfig::new(8).with_scaling(RopeScaling::Yarn(YarnScaling::new(4.0, 4))),
        RopeConfig::new(8).with_scaling(RopeScaling::Dynamic {
            factor: 2.0,
            original_max_position_embeddings: 16,
        }),
        RopeConfig::new(8).with_xpos(16.0),
        RopeConfig::new(8)
            .with_kernel(RopeKernel::Ops)
            .with_max_position(2),
    ];
    for rope in ropes {
        let what = format!("{rope:?}");
        let enc = Arc::new(RotaryEmbedding::new(&rope, dev)?);
        let mha = MultiHeadAttention::new(&cfg, Some(enc), vb.pp("attn"))?;
        let full = mha.forward(&x)?;
        for chunks in [
            vec![(0, 3), (3, 1), (4, 1), (5, 5)],
            (0..10).map(|t| (t, 1)).collect(),
        ] {
            let mut cache = KvCache::new();
            let mut outs = Vec::new();
            for (start, len) in chunks {
                let step = mha.forward_with(
                    &x.narrow(1, start, len)?,
                    &AttentionOptions::default(),
                    Some(&mut cache),
                )?;
                outs.push(step.output);
            }
            assert_close_scaled(&Tensor::cat(&outs, 1)?, &full, 1e-5, 2e-6, &what)?;
        }
        let ids = Positions::ids(
            &Tensor::arange(0u32, 10, dev)?
                .unsqueeze(0)?
                .repeat((2, 1))?,
        )?;
        let opts = AttentionOptions {
            positions: Some(&ids),
            ..Default::default()
        };
        assert_close(
            &mha.forward_with(&x, &opts, None)?.output,
            &full,
            1e-6,
            &what,
        )?;
    }
    Ok(())
}

/// Past its original length, dynamic NTK builds only the rows from the lowest offset asked
/// for (a decoding step: one row), and they are the rows of the whole table: offsets give
/// bit for bit what the same positions give as ids (which read the table from position 0), for
/// queries, keys, both, in place and not, and xPos.
fn dynamic_rows_from_the_first_position(dev: &Device) -> anyhow::Result<()> {
    let dynamic = RopeScaling::Dynamic {
        factor: 2.0,
        original_max_position_embeddings: 8,
    };
    for config in [
        RopeConfig::new(8).with_scaling(dynamic.clone()),
        RopeConfig::new(8)
            .with_scaling(dynamic.clone())
            .with_rotary_dim(4)
            .with_layout(RopeLayout::Interleaved),
        RopeConfig::new(8)
            .with_scaling(dynamic.clone())
            .with_xpos(64.0),
    ] {
        let rope = RotaryEmbedding::new(&config, dev)?;
        let as_ids = |start: usize, len: usize| -> anyhow::Result<Positions> {
            let ids: Vec<u32> = (start..start + len).map(|p| p as u32).collect();
            Ok(Positions::ids(&Tensor::from_vec(ids, (1, len), dev)?)?)
        };
        for (start, len, k_start, k_len) in [
            (20, 1, 20, 1),
            (20, 3, 5, 18),
            (9, 2, 0, 11),
            (40, 1, 12, 29),
        ] {
            let q = common::randn(0f32, 1.0, (1, 2, len, 8), dev)?;
            let k = common::randn(0f32, 1.0, (1, 2, k_len, 8), dev)?;
            let (qo, ko) = (Positions::Offset(start), Positions::Offset(k_start));
            let (qi, ki) = (as_ids(start, len)?, as_ids(k_start, k_len)?);
            let what = format!("{config:?} at {start}+{len}, keys {k_start}+{k_len}");
            let (a, b) = rope.rotate_queries_keys(&q, &k, &qo, &ko, QkLayout::Bhtd)?;
            let (c, d) = rope.rotate_queries_keys(&q, &k, &qi, &ki, QkLayout::Bhtd)?;
            assert_close(&a, &c, 0.0, &format!("queries {what}"))?;
            assert_close(&b, &d, 0.0, &format!("keys {what}"))?;
            let (e, f) =
                rope.rotate_queries_keys_owned(q.copy()?, k.copy()?, &qo, &ko, QkLayout::Bhtd)?;
            assert_close(&e, &c, 0.0, &format!("in place {what}"))?;
            assert_close(&f, &d, 0.0, &format!("in place {what}"))?;
            let one = rope.rotate_queries(&q, &qo, QkLayout::Bhtd)?;
            assert_close(
                &one,
                &rope.rotate_queries(&q, &qi, QkLayout::Bhtd)?,
                0.0,
                &what,
            )?;
            let (cos, _) = rope.cos_sin(&qo, len)?;
            let (cos_ids, _) = rope.cos_sin(&qi, len)?;
            assert_close(&cos, &cos_ids, 0.0, &format!("cos {what}"))?;
        }
    }
    Ok(())
}

/// Tables are built once, grown (not rebuilt per call) past max_position, and rebuilt only when
/// Dynamic NTK's length or LongRoPE's factor set changes.
fn table_cache(dev: &Device) -> anyhow::Result<()> {
    let rope = RotaryEmbedding::new(&RopeConfig::new(8).with_max_position(4), dev)?;
    assert_eq!(rope.table_builds(), 1);
    let x = common::randn(0f32, 1.0, (1, 1, 3, 8), dev)?;
    for _ in 0..3 {
        rope.forward(&x)?;
    }
    assert_eq!(
        rope.table_builds(),
        1,
        "calls inside the table build nothing"
    );
    let far = rope.rotate_queries(&x, &Positions::Offset(100), QkLayout::Bhtd)?;
    assert_eq!(rope.table_builds(), 2, "one growth for position 102");
    rope.rotate_queries(&x, &Positions::Offset(50), QkLayout::Bhtd)?;
    assert_eq!(rope.table_builds(), 2);
    // The grown table agrees with a table built that large from the start.
    let big = RotaryEmbedding::new(&RopeConfig::new(8).with_max_position(200), dev)?;
    assert_close(
        &far,
        &big.rotate_queries(&x, &Positions::Offset(100), QkLayout::Bhtd)?,
        0.0,
        "grown table",
    )?;

    let dynamic = RotaryEmbedding::new(
        &RopeConfig::new(8).with_scaling(RopeScaling::Dynamic {
            factor: 2.0,
            original_max_position_embeddings: 8,
        }),
        dev,
    )?;
    let within = dynamic.rotate_queries(&x, &Positions::Offset(2), QkLayout::Bhtd)?;
    assert_eq!(
        dynamic.table_builds(),
        1,
        "within the original length: original table"
    );
    let past = dynamic.rotate_queries(&x, &Positions::Offset(20), QkLayout::Bhtd)?;
    assert_eq!(dynamic.table_builds(), 2);
    // Past the original length the frequencies are NTK-scaled for seq_len 23.
    let expect = RotaryEmbedding::new(
        &RopeConfig::new(8).with_scaling(RopeScaling::NtkAware {
            alpha: 2.0 * 23.0 / 8.0 - 1.0,
        }),
        dev,
    )?
    .rotate_queries(&x, &Positions::Offset(20), QkLayout::Bhtd)?;
    assert_close(&past, &expect, 1e-6, "dynamic = ntk at the current length")?;
    let back = dynamic.rotate_queries(&x, &Positions::Offset(2), QkLayout::Bhtd)?;
    assert_close(
        &back,
        &within,
        0.0,
        "back to the original below the original length",
    )?;
    Ok(())
}

fn expect_config_error<T: std::fmt::Debug>(r: candle_posenc::Result<T>, name: &str) {
    match r {
        Err(Error::InvalidConfig { name: n, .. }) if n == name => {}
        other => panic!("expected InvalidConfig for {name}, got {other:?}"),
    }
}

fn bad_input(dev: &Device) -> anyhow::Result<()> {
    configs_are_checked(dev);
    lazy_tables_and_xpos_refuse_far_positions(dev)?;
    empty_sequences_rotate_to_themselves(dev)?;
    inputs_are_checked(dev)
}

/// Each setting out of its range is an `InvalidConfig` naming it; a LongRoPE list of the
/// right length is fine.
fn configs_are_checked(dev: &Device) {
    let new = |c: RopeConfig| RotaryEmbedding::new(&c, dev);
    expect_config_error(new(RopeConfig::new(7)), "head_dim");
    expect_config_error(new(RopeConfig::new(0)), "head_dim");
    expect_config_error(new(RopeConfig::new(8).with_rotary_dim(5)), "rotary_dim");
    expect_config_error(new(RopeConfig::new(8).with_rotary_dim(10)), "rotary_dim");
    expect_config_error(new(RopeConfig::new(8).with_base(0.0)), "base");
    expect_config_error(new(RopeConfig::new(8).with_base(-5.0)), "base");
    expect_config_error(new(RopeConfig::new(8).with_base(f64::NAN)), "base");
    expect_config_error(
        new(RopeConfig::new(8).with_scaling(RopeScaling::Linear { factor: 0.0 })),
        "linear factor",
    );
    expect_config_error(
        new(RopeConfig::new(8).with_scaling(RopeScaling::Linear { factor: -2.0 })),
        "linear factor",
    );
    expect_config_error(
        new(RopeConfig::new(8).with_scaling(RopeScaling::Yarn(YarnScaling::new(f64::INFINITY, 8)))),
        "yarn factor",
    );
    expect_config_error(
        new(RopeConfig::new(8).with_scaling(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 4.0,
            high_freq_factor: 1.0,
            original_max_position_embeddings: 16,
        })),
        "low_freq_factor",
    );
    let longrope = |short: usize| {
        RopeScaling::LongRope(LongRopeScaling {
            short_factor: vec![1.0; short],
            long_factor: vec![2.0; 4],
            original_max_position_embeddings: 16,
            factor: 4.0,
            attention_factor: None,
        })
    };
    expect_config_error(
        new(RopeConfig::new(8).with_scaling(longrope(3))),
        "short_factor",
    );
    assert!(new(RopeConfig::new(8).with_scaling(longrope(4))).is_ok());
    expect_config_error(new(RopeConfig::new(8).with_xpos(0.0)), "xpos_scale_base");
}

/// A huge max_position is built lazily; a position past the table cap is an error. xPos
/// refuses positions whose key scale would overflow.
fn lazy_tables_and_xpos_refuse_far_positions(dev: &Device) -> anyhow::Result<()> {
    let new = |c: RopeConfig| RotaryEmbedding::new(&c, dev);
    let lazy = new(RopeConfig::new(8).with_max_position(1 << 40))?;
    let one = Tensor::zeros((1, 1, 1, 8), DType::F32, dev)?;
    match lazy.rotate_queries(&one, &Positions::Offset(1 << 29), QkLayout::Bhtd) {
        Err(Error::InvalidConfig {
            name: "sequence end",
            ..
        }) => {}
        other => panic!("table cap: {other:?}"),
    }
    let xpos = new(RopeConfig::new(8).with_xpos(512.0))?;
    match xpos.rotate_queries(&one, &Positions::Offset(50_000), QkLayout::Bhtd) {
        Err(Error::InvalidConfig {
            name: "sequence end",
            expected,
            ..
        }) => {
            assert!(expected.contains("xPos"), "{expected}")
        }
        other => panic!("xpos range: {other:?}"),
    }
    assert!(xpos
        .rotate_queries(&one, &Positions::Offset(20_000), QkLayout::Bhtd)?
        .to_dtype(DType::F32)?
        .sum_all()?
        .to_scalar::<f32>()?
        .is_finite());
    Ok(())
}

/// Empty sequences rotate to themselves.
fn empty_sequences_rotate_to_themselves(dev: &Device) -> anyhow::Result<()> {
    let new = |c: RopeConfig| RotaryEmbedding::new(&c, dev);
    for layout in [QkLayout::Bhtd, QkLayout::Bthd] {
        let empty = match layout {
            QkLayout::Bhtd => Tensor::zeros((2, 3, 0, 8), DType::F32, dev)?,
            QkLayout::Bthd => Tensor::zeros((2, 0, 3, 8), DType::F32, dev)?,
        };
        for cfg in [
            RopeConfig::new(8),
            RopeConfig::new(8).with_layout(RopeLayout::Interleaved),
        ] {
            let rope = new(cfg)?;
            let (a, b) = rope.rotate_queries_keys(
                &empty,
                &empty,
                &Positions::Offset(3),
                &Positions::Offset(3),
                layout,
            )?;
            assert_eq!(a.dims(), empty.dims());
            assert_eq!(b.dims(), empty.dims());
            let (a, _) = rope.rotate_queries_keys_owned(
                empty.clone(),
                empty.clone(),
                &Positions::Offset(0),
                &Positions::Offset(0),
                layout,
            )?;
            assert_eq!(a.dims(), empty.dims());
        }
    }
    Ok(())
}

/// Queries and keys of the wrong rank, width, batch or dtype, and positions of the wrong
/// length or past u32, are refused with the matching error.
fn inputs_are_checked(dev: &Device) -> anyhow::Result<()> {
    let new = |c: RopeConfig| RotaryEmbedding::new(&c, dev);
    let rope = new(RopeConfig::new(8))?;
    let q = Tensor::zeros((1, 2, 3, 8), DType::F32, dev)?;
    let p = Positions::Offset(0);
    match rope.rotate_queries_keys(&q.squeeze(0)?, &q, &p, &p, QkLayout::Bhtd) {
        Err(Error::Rank {
            what: "queries",
            expected: 4,
            got: 3,
            ..
        }) => {}
        other => panic!("rank: {other:?}"),
    }
    let wide = Tensor::zeros((1, 2, 3, 10), DType::F32, dev)?;
    match rope.rotate_queries_keys(&q, &wide, &p, &p, QkLayout::Bhtd) {
        Err(Error::Shape { what: "keys", .. }) => {}
        other => panic!("head dim: {other:?}"),
    }
    let other_batch = Tensor::zeros((2, 2, 3, 8), DType::F32, dev)?;
    match rope.rotate_queries_keys(&q, &other_batch, &p, &p, QkLayout::Bhtd) {
        Err(Error::Shape { what: "keys", .. }) => {}
        other => panic!("batch: {other:?}"),
    }
    let ids = Positions::ids(&Tensor::new(&[[0u32, 1]], dev)?)?;
    match rope.rotate_queries(&q, &ids, QkLayout::Bhtd) {
        Err(Error::Shape {
            what: "position ids",
            ..
        }) => {}
        other => panic!("ids: {other:?}"),
    }
    match rope.rotate_queries(&q.to_dtype(DType::U32)?, &p, QkLayout::Bhtd) {
        Err(Error::DType { .. }) => {}
        other => panic!("dtype: {other:?}"),
    }
    match rope.rotate_queries(&q, &Positions::Offset(usize::MAX - 1), QkLayout::Bhtd) {
        Err(Error::InvalidConfig { .. }) => {}
        other => panic!("offset: {other:?}"),
    }
    Ok(())
}

/// The rotary config survives checkpoint metadata, every scaling variant included.
fn metadata_round_trip(dev: &Device) -> anyhow::Result<()> {
    let fx = fixture("rotary.safetensors", dev)?;
    for (name, rotary_dim, base, scaling, _) in fixture_cases(&fx)? {
        let c = RopeConfig::new(128)
            .with_rotary_dim(rotary_dim)
            .with_base(base)
            .with_scaling(scaling)
            .with_layout(RopeLayout::Interleaved)
            .with_xpos(300.0)
            .with_kernel(RopeKernel::Ops);
        let e = EncodingConfig::Rotary(c);
        let back = EncodingConfig::from_metadata(&e.to_metadata(), "test")?;
        assert_eq!(back, e, "{name}");
        assert!(e.build(VarBuilder::zeros(DType::F32, dev))?.is_some());
    }
    Ok(())
}

fn hf_error(json: &str) -> (String, String) {
    match RopeConfig::from_hf_json(json) {
        Err(Error::HfConfig { key, problem }) => (key, problem),
        other => panic!("expected an HfConfig error for {json}, got {other:?}"),
    }
}

/// `config.json` files in the shapes real models ship, parsed to the fixture's cases and
/// checked against HF's frequencies; malformed ones give errors naming the key.
fn hf_config_json(dev: &Device) -> anyhow::Result<()> {
    let fx = fixture("rotary.safetensors", dev)?;
    llama3_scaling_as_published(&fx)?;
    transformers5_rope_parameters(&fx)?;
    longrope_linear_and_dynamic(&fx)?;
    neox_and_gptj_naming()?;
    config_class_rules(&fx)?;
    errors_name_the_files_key();
    Ok(())
}

/// Checks that `c`'s inverse frequencies at `seq_len` are HF's for the fixture's case `name`.
fn inv_freq_is_hf(
    fx: &HashMap<String, Tensor>,
    c: &RopeConfig,
    name: &str,
    seq_len: usize,
) -> anyhow::Result<()> {
    let ours = c
        .scaling
        .frequencies(c.rotary_dim, c.base, seq_len)?
        .inv_freq;
    let theirs = f64s(get(fx, &format!("freq.{name}.inv_freq")))?;
    assert_eq!(ours.len(), theirs.len(), "{name}");
    for (a, b) in ours.iter().zip(&theirs) {
        assert!((a - b).abs() <= 1e-6 * b.abs(), "{name}: {a} vs {b}");
    }
    Ok(())
}

/// Llama 3.1 (rope_scaling, transformers 4 style) and Llama 4 Scout's published scaling:
/// equal low and high factors.
fn llama3_scaling_as_published(fx: &HashMap<String, Tensor>) -> anyhow::Result<()> {
    let llama = RopeConfig::from_hf_json(
        r#"{"model_type": "llama", "hidden_size": 512, "num_attention_heads": 4,
            "rope_theta": 500000.0, "max_position_embeddings": 131072,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#,
    )?;
    assert_eq!(
        (llama.head_dim, llama.rotary_dim, llama.max_position),
        (128, 128, 131072)
    );
    inv_freq_is_hf(fx, &llama, "llama3", 0)?;
    let scout = RopeConfig::from_hf_json(
        r#"{"model_type": "llama4_text", "hidden_size": 5120, "num_attention_heads": 40,
            "head_dim": 128, "rope_theta": 500000.0, "max_position_embeddings": 10485760,
            "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}}"#,
    )?;
    inv_freq_is_hf(fx, &scout, "llama3_step", 0)?;
    Ok(())
}

/// transformers 5 style: rope_parameters holding the theta; old `type` key; explicit head_dim.
fn transformers5_rope_parameters(fx: &HashMap<String, Tensor>) -> anyhow::Result<()> {
    let yarn = RopeConfig::from_hf_json(
        r#"{"hidden_size": 4096, "num_attention_heads": 32, "head_dim": 64,
            "max_position_embeddings": 4096,
            "rope_parameters": {"type": "yarn", "rope_theta": 50000.0, "factor": 16.0,
                "original_max_position_embeddings": 256, "beta_fast": 24, "beta_slow": 2,
                "mscale": 0.9, "mscale_all_dim": 0.7, "truncate": false}}"#,
    )?;
    inv_freq_is_hf(fx, &yarn, "yarn_custom", 0)?;
    // An empty or null `rope_scaling` gives way to `rope_parameters`, as HF's
    // `rope_scaling or rope_parameters` does.
    for empty in ["{}", "null"] {
        let cfg = RopeConfig::from_hf_json(&format!(
            r#"{{"hidden_size": 4096, "num_attention_heads": 32, "head_dim": 64,
                "max_position_embeddings": 4096, "rope_scaling": {empty},
                "rope_parameters": {{"rope_type": "yarn", "rope_theta": 50000.0, "factor": 16.0,
                    "original_max_position_embeddings": 256, "beta_fast": 24, "beta_slow": 2,
                    "mscale": 0.9, "mscale_all_dim": 0.7, "truncate": false}}}}"#
        ))?;
        assert_eq!(cfg, yarn, "rope_scaling {empty}");
    }
    // The old `type` key names proportional RoPE as `rope_type` does.
    let proportional = |key: &str| {
        RopeConfig::from_hf_json(&format!(
            r#"{{"hidden_size": 512, "num_attention_heads": 4,
                "rope_parameters": {{"{key}": "proportional", "rope_theta": 1e6,
                    "partial_rotary_factor": 0.25, "factor": 8.0}}}}"#
        ))
    };
    let (by_type, by_rope_type) = (proportional("type")?, proportional("rope_type")?);
    assert_eq!(by_type, by_rope_type);
    assert_eq!(
        by_type.rotary_dim, 128,
        "the whole head is the rotary dimension"
    );
    let f = yarn.scaling.frequencies(64, yarn.base, 0)?;
    assert!(
        (f.attention_factor - f64s(get(fx, "freq.yarn_custom.attention_factor"))?[0]).abs() < 1e-12
    );
    Ok(())
}

/// Phi-3 style LongRoPE under its old name, original length at the top level, partial
/// rotary; linear and dynamic scaling.
fn longrope_linear_and_dynamic(fx: &HashMap<String, Tensor>) -> anyhow::Result<()> {
    let short = f64s(get(fx, "longrope.short_factor"))?;
    let long = f64s(get(fx, "longrope.long_factor"))?;
    let phi3 = format!(
        r#"{{"hidden_size": 256, "num_attention_heads": 4, "partial_rotary_factor": 0.5,
            "max_position_embeddings": 1024, "original_max_position_embeddings": 256,
            "rope_scaling": {{"type": "su", "short_factor": {short:?}, "long_factor": {long:?}}}}}"#
    );
    let phi3 = RopeConfig::from_hf_json(&phi3)?;
    assert_eq!(phi3.rotary_dim, 32);
    inv_freq_is_hf(fx, &phi3, "longrope_short", 100)?;
    inv_freq_is_hf(fx, &phi3, "longrope_long", 1000)?;

    // Linear and dynamic.
    let linear = RopeConfig::from_hf_json(
        r#"{"hidden_size": 256, "num_attention_heads": 4, "partial_rotary_factor": 0.5,
            "rope_scaling": {"rope_type": "linear", "factor": 4.0}}"#,
    )?;
    inv_freq_is_hf(fx, &linear, "linear", 0)?;
    let dynamic = RopeConfig::from_hf_json(
        r#"{"hidden_size": 256, "num_attention_heads": 4, "max_position_embeddings": 256,
            "rope_scaling": {"type": "dynamic", "factor": 2.0}}"#,
    )?;
    inv_freq_is_hf(fx, &dynamic, "dynamic_long", 768)?;
    inv_freq_is_hf(fx, &dynamic, "dynamic_short", 100)?;
    Ok(())
}

/// GPT-NeoX and GPT-J naming; no scaling at all.
fn neox_and_gptj_naming() -> anyhow::Result<()> {
    let neox = RopeConfig::from_hf_json(
        r#"{"model_type": "gpt_neox", "hidden_size": 512, "num_attention_heads": 8,
            "rotary_pct": 0.25, "rotary_emb_base": 10000, "rope_scaling": null}"#,
    )?;
    assert_eq!(
        (neox.head_dim, neox.rotary_dim, neox.layout),
        (64, 16, RopeLayout::Half)
    );
    let gptj = RopeConfig::from_hf_json(
        r#"{"model_type": "gptj", "n_embd": 256, "n_head": 4, "rotary_dim": 16, "n_positions": 2048}"#,
    )?;
    assert_eq!(
        (gptj.head_dim, gptj.rotary_dim, gptj.layout),
        (64, 16, RopeLayout::Interleaved)
    );
    assert_eq!(gptj.scaling, RopeScaling::None);
    Ok(())
}

/// HF config-class rules: a zero mscale is unset; GPT-NeoX defaults rotary_pct to 0.25 and
/// prefers rotary_emb_base; Phi-3's top-level original length (default 4096) wins; integers
/// written as floats; rope_scaling wins over rope_parameters; interleaved model types.
fn config_class_rules(fx: &HashMap<String, Tensor>) -> anyhow::Result<()> {
    let zero_mscale = RopeConfig::from_hf_json(
        r#"{"hidden_size": 256, "num_attention_heads": 4, "max_position_embeddings": 4096,
            "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "mscale": 0, "mscale_all_dim": 0,
                "original_max_position_embeddings": 512.0}}"#,
    )?;
    let f = zero_mscale.scaling.frequencies(64, 1e4, 0)?;
    assert!((f.attention_factor - f64s(get(fx, "freq.yarn.attention_factor"))?[0]).abs() < 1e-12);
    inv_freq_is_hf(fx, &zero_mscale, "yarn", 0)?;
    let neox = RopeConfig::from_hf_json(
        r#"{"model_type": "gpt_neox", "hidden_size": 512, "num_attention_heads": 8,
            "rotary_emb_base": 20000, "rope_theta": 10000}"#,
    )?;
    assert_eq!((neox.rotary_dim, neox.base), (16, 20000.0));
    let phi3 = RopeConfig::from_hf_json(
        r#"{"model_type": "phi3", "hidden_size": 256, "num_attention_heads": 4,
            "max_position_embeddings": 16384,
            "rope_scaling": {"type": "longrope", "short_factor": [1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1],
                "long_factor": [2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2,2],
                "original_max_position_embeddings": 2048}}"#,
    )?;
    match &phi3.scaling {
        RopeScaling::LongRope(l) => {
            assert_eq!((l.original_max_position_embeddings, l.factor), (4096, 4.0))
        }
        other => panic!("phi3: {other:?}"),
    }
    let both = RopeConfig::from_hf_json(
        r#"{"hidden_size": 256, "num_attention_heads": 4, "model_type": "cohere",
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            "rope_parameters": {"rope_type": "linear", "factor": 3.0}}"#,
    )?;
    assert_eq!(both.scaling, RopeScaling::Linear { factor: 2.0 });
    assert_eq!(both.layout, RopeLayout::Interleaved);
    let (key, _) =
        hf_error(r#"{"model_type": "deepseek_v3", "hidden_size": 256, "num_attention_heads": 4}"#);
    assert_eq!(key, "model_type");
    Ok(())
}

/// Errors name the key.
fn errors_name_the_files_key() {
    let base = r#""hidden_size": 256, "num_attention_heads": 4"#;
    let (key, problem) = hf_error(&format!(
        r#"{{{base}, "rope_scaling": {{"rope_type": "foo"}}}}"#
    ));
    assert_eq!(key, "rope_scaling.rope_type");
    assert!(problem.contains("foo"), "{problem}");
    let (key, _) = hf_error(&format!(
        r#"{{{base}, "rope_scaling": {{"rope_type": "linear"}}}}"#
    ));
    assert_eq!(key, "rope_scaling.factor");
    let (key, _) = hf_error(&format!(
        r#"{{{base}, "rope_scaling": {{"rope_type": "llama3", "factor": 8, "high_freq_factor": 4, "original_max_position_embeddings": 64}}}}"#
    ));
    assert_eq!(key, "rope_scaling.low_freq_factor");
    let (key, _) = hf_error(&format!(
        r#"{{{base}, "rope_scaling": {{"type": "dynamic", "factor": 2}}}}"#
    ));
    assert_eq!(key, "max_position_embeddings");
    let (key, problem) = hf_error(&format!(r#"{{{base}, "rope_theta": "ten thousand"}}"#));
    assert_eq!(key, "rope_theta");
    assert!(problem.contains("expected a number"), "{problem}");
    let (key, _) = hf_error(r#"{"num_attention_heads": 4}"#);
    assert_eq!(key, "hidden_size");
    let (key, _) = hf_error(r#"{"hidden_size": 256, "num_attention_heads": 0}"#);
    assert_eq!(key, "num_attention_heads");
    let (key, _) = hf_error("[1, 2]");
    assert_eq!(key, "<root>");
    let (key, _) = hf_error("{not json");
    assert_eq!(key, "<root>");
    let (key, _) = hf_error(&format!(
        r#"{{{base}, "rope_parameters": {{"full_attention": {{"rope_type": "default"}}}}}}"#
    ));
    assert_eq!(key, "rope_parameters");
    let (key, _) = hf_error(&format!(r#"{{{base}, "partial_rotary_factor": 0.3}}"#));
    assert_eq!(key, "partial_rotary_factor");
    let (key, _) = hf_error(&format!(
        r#"{{{base}, "max_position_embeddings": 64, "rope_scaling": {{"type": "longrope", "short_factor": "x", "long_factor": []}}}}"#
    ));
    assert_eq!(key, "rope_scaling.short_factor");
    let (key, _) = hf_error(&format!(r#"{{{base}, "rope_scaling": "linear"}}"#));
    assert_eq!(key, "rope_scaling");
    // Values the checks refuse are reported under the file's own key, never a field of ours
    // that the file does not contain.
    for (json, want) in [
        (
            r#""rope_scaling": {"type": "linear", "factor": -1}"#,
            "rope_scaling.factor",
        ),
        (
            r#""max_position_embeddings": 64, "rope_scaling": {"type": "longrope", "short_factor": [1, 1], "long_factor": [1, 1]}"#,
            "rope_scaling.short_factor",
        ),
        (r#""rope_theta": 0.5"#, "rope_theta"),
        (
            r#""rope_parameters": {"rope_type": "default", "rope_theta": -1}"#,
            "rope_parameters.rope_theta",
        ),
        (r#""rotary_pct": 0.0"#, "rotary_pct"),
        (
            r#""rope_scaling": {"type": "yarn", "factor": 4, "attention_factor": 1e300}, "max_position_embeddings": 64"#,
            "rope_scaling.attention_factor",
        ),
    ] {
        let (key, problem) = hf_error(&format!("{{{base}, {json}}}"));
        assert_eq!(key, want, "{json}: {problem}");
    }
    let (key, _) = hf_error(r#"{"hidden_size": 12, "num_attention_heads": 4}"#);
    assert_eq!(key, "hidden_size / num_attention_heads");
}

/// The owned (in-place on the CPU) rotation equals the out-of-place one for every layout,
/// partial rotary, per-sequence ids, xPos and dtype; it leaves the pass-through features alone;
/// and it falls back (keeping gradients) for tensors in a graph or not contiguous.
fn owned_rotation_matches(dev: &Device) -> anyhow::Result<()> {
    let ids = Positions::ids(&Tensor::new(&[[3u32, 0, 9, 1, 4], [7, 7, 2, 100, 5]], dev)?)?;
    let configs = common::zoo::rope_variants();
    for cfg in configs {
        let rope = RotaryEmbedding::new(&cfg, dev)?;
        for layout in [QkLayout::Bhtd, QkLayout::Bthd] {
            let shape = match layout {
                QkLayout::Bhtd => (2, 3, 5, 16),
                QkLayout::Bthd => (2, 5, 3, 16),
            };
            for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
                for (pos_q, pos_k) in [(&Positions::Offset(4), &Positions::Offset(0)), (&ids, &ids)]
                {
                    let q = common::randn(0f32, 1.0, shape, dev)?.to_dtype(dtype)?;
                    let k = common::randn(0f32, 1.0, shape, dev)?.to_dtype(dtype)?;
                    let (qe, ke) = rope.rotate_queries_keys(&q, &k, pos_q, pos_k, layout)?;
                    let (qo, ko) =
                        rope.rotate_queries_keys_owned(q.copy()?, k.copy()?, pos_q, pos_k, layout)?;
                    let what = format!("{cfg:?} {layout:?} {dtype:?}");
                    assert_eq!(qo.dtype(), dtype, "{what}");
                    // Both paths rotate in f32 (f64 for f64) and round once: equal up to the
                    // order of two products.
                    let tol = match dtype {
                        DType::F32 => 1e-6,
                        DType::F64 => 1e-6,
                        _ => 1e-2,
                    };
                    assert_close(&qo, &qe, tol, &what)?;
                    assert_close(&ko, &ke, tol, &what)?;
                    let rd = cfg.rotary_dim;
                    if rd < 16 {
                        assert_close(
                            &qo.narrow(3, rd, 16 - rd)?,
                            &q.narrow(3, rd, 16 - rd)?,
                            0.0,
                            "pass-through",
                        )?;
                    }
                }
            }
        }
    }
    // q and k sharing one storage: each is rotated once.
    let rope16 = RotaryEmbedding::new(&RopeConfig::new(16), dev)?;
    let x = common::randn(0f32, 1.0, (1, 2, 3, 16), dev)?;
    let (expect, _) = rope16.rotate_queries_keys(
        &x,
        &x,
        &Positions::Offset(2),
        &Positions::Offset(2),
        QkLayout::Bhtd,
    )?;
    let shared = x.copy()?;
    let (qs, ks) = rope16.rotate_queries_keys_owned(
        shared.clone(),
        shared,
        &Positions::Offset(2),
        &Positions::Offset(2),
        QkLayout::Bhtd,
    )?;
    assert_close(&qs, &expect, 1e-6, "shared q")?;
    assert_close(&ks, &expect, 1e-6, "shared k")?;
    // In a graph: falls back to the differentiable fused path.
    let rope = RotaryEmbedding::new(&RopeConfig::new(8), dev)?;
    let q = Var::from_tensor(&common::randn(0f32, 1.0, (1, 2, 3, 8), dev)?)?;
    let (qr, _) = rope.rotate_queries_keys_owned(
        q.as_tensor().clone(),
        q.as_tensor().clone(),
        &Positions::Offset(1),
        &Positions::Offset(1),
        QkLayout::Bhtd,
    )?;
    let grads = qr.sum_all()?.backward()?;
    assert!(
        grads.get(q.as_tensor()).is_some(),
        "gradient through the owned path"
    );
    // Not contiguous: falls back, same values.
    let x = common::randn(0f32, 1.0, (1, 3, 2, 8), dev)?.transpose(1, 2)?;
    let (a, _) = rope.rotate_queries_keys(
        &x,
        &x,
        &Positions::Offset(0),
        &Positions::Offset(0),
        QkLayout::Bhtd,
    )?;
    let (b, _) = rope.rotate_queries_keys_owned(
        x.clone(),
        x.clone(),
        &Positions::Offset(0),
        &Positions::Offset(0),
        QkLayout::Bhtd,
    )?;
    assert_close(&a, &b, 0.0, "non-contiguous fallback")?;
    Ok(())
}

/// Proportional RoPE (Gemma 4) read from a config.json: HF's frequencies (computed in f32 by
/// HF, so 1e-6 relative as for the other scalings) and HF Llama's rotation with them (f32, 1e-5), for a quarter, a half
/// with a factor of 2, and none of the pairs rotating (then q and k pass through unchanged).
fn proportional_matches_hf(dev: &Device) -> anyhow::Result<()> {
    let path = format!(
        "{}/tests/fixtures/rotary_proportional.safetensors",
        env!("CARGO_MANIFEST_DIR")
    );
    let file = candle_posenc::Checkpoint::load(path, dev)?;
    let fx = file.tensors();
    for name in ["p25", "p50_f2", "p0"] {
        let cfg = RopeConfig::from_hf_json(&file.metadata()[name])?;
        assert_eq!(
            cfg.rotary_dim, 64,
            "{name}: the whole head is the rotary dimension"
        );
        assert!(
            matches!(cfg.scaling, RopeScaling::Proportional { .. }),
            "{name}"
        );
        let ours = cfg
            .scaling
            .frequencies(cfg.rotary_dim, cfg.base, 0)?
            .inv_freq;
        let hf = f64s(get(fx, &format!("{name}.inv_freq")))?;
        assert_eq!(ours.len(), hf.len());
        for (a, b) in ours.iter().zip(&hf) {
            assert!((a - b).abs() <= 1e-6 * b.abs(), "{name}: {a} vs {b}");
        }
        let rope = RotaryEmbedding::new(&cfg, dev)?;
        let (q, k) = (get(fx, &format!("{name}.q")), get(fx, &format!("{name}.k")));
        let positions = Positions::ids(
            &Tensor::arange(0u32, 8, dev)?
                .affine(7.0, 0.0)?
                .unsqueeze(0)?,
        )?;
        let (qr, kr) = rope.rotate_queries_keys(q, k, &positions, &positions, QkLayout::Bhtd)?;
        assert_close(&qr, get(fx, &format!("{name}.q_rot")), 1e-5, name)?;
        assert_close(&kr, get(fx, &format!("{name}.k_rot")), 1e-5, name)?;
        if name == "p0" {
            assert_close(&qr, q, 0.0, "nothing rotates")?;
        }
    }
    // A fraction outside [0, 1] is refused under its key.
    let (key, _) = hf_error(
        r#"{"hidden_size": 64, "num_attention_heads": 1,
            "rope_parameters": {"rope_type": "proportional", "rope_theta": 10000.0, "partial_rotary_factor": 1.5}}"#,
    );
    assert_eq!(key, "rope_parameters.partial_rotary_factor");
    Ok(())
}

/// The multimodal fixture (`generate.py rotary_mrope`), with its config.json texts.
fn mrope_fixture(dev: &Device) -> anyhow::Result<candle_posenc::Checkpoint> {
    let path = format!(
        "{}/tests/fixtures/rotary_mrope.safetensors",
        env!("CARGO_MANIFEST_DIR")
    );
    Ok(candle_posenc::Checkpoint::load(path, dev)?)
}

/// The `(3, 1, T)` multimodal positions of `segments` (and HF's delta).
/// Positions of a 4 × 6 patch grid (one image), as axial RoPE reads them.
fn patch_grid(dev: &Device) -> anyhow::Result<Positions> {
    let grid = candle_posenc::MropeSegment::Grid {
        t: 1,
        h: 4,
        w: 6,
        time_interval: 1.0,
    };
    Ok(multimodal(&[grid], dev)?.0)
}

fn multimodal(
    segments: &[candle_posenc::MropeSegment],
    dev: &Device,
) -> anyhow::Result<(Positions, i64)> {
    use candle_posenc::positions::PositionIds;
    let (axes, delta) = candle_posenc::rotary::mrope::mrope_positions(segments)?;
    let t = axes.len() / 3;
    let axes = Tensor::from_vec(axes, (3, 1, t), dev)?;
    Ok((Positions::Ids(PositionIds::multimodal(&axes)?), delta))
}

/// Multimodal RoPE: positions as transformers' Qwen2-VL `get_rope_index` builds them (text, an
/// image, a video), and q, k rotated as Qwen2-VL (contiguous bands) and Qwen3-VL (interleaved)
/// rotate them, read from their config.json (f32, 1e-5). In the block, decoding continues at
/// the position HF's delta gives, and text-only axes rotate as plain RoPE.
fn mrope_matches_hf(dev: &Device) -> anyhow::Result<()> {
    use candle_posenc::positions::PositionIds;
    use candle_posenc::rotary::mrope::MropeSegment;
    let file = mrope_fixture(dev)?;
    let fx = file.tensors();
    let grid = |t, h, w| MropeSegment::Grid {
        t,
        h,
        w,
        time_interval: 1.0,
    };
    let (positions, delta) = multimodal(
        &[
            MropeSegment::Text(3),
            grid(1, 2, 3),
            MropeSegment::Text(2),
            grid(2, 2, 2),
            MropeSegment::Text(3),
        ],
        dev,
    )?;
    let hf = get(fx, "positions");
    let t = hf.dim(2)?;
    let Positions::Ids(ids) = &positions else {
        panic!("multimodal positions are ids");
    };
    let ours = ids.axes().expect("three axes");
    assert_eq!(
        ours.to_dtype(DType::I64)?.flatten_all()?.to_vec1::<i64>()?,
        hf.flatten_all()?.to_vec1::<i64>()?
    );
    assert_eq!(delta, get(fx, "delta").flatten_all()?.to_vec1::<i64>()?[0]);
    for name in ["qwen2_vl", "qwen3_vl"] {
        let cfg = RopeConfig::from_hf_json(&file.metadata()[name])?;
        let m = cfg.mrope.expect("mrope_section read");
        assert_eq!(m.interleaved, name == "qwen3_vl");
        for kernel in KERNELS {
            let rope = RotaryEmbedding::new(&cfg.clone().with_kernel(kernel), dev)?;
            let (q, k) = (get(fx, &format!("{name}.q")), get(fx, &format!("{name}.k")));
            let (qr, kr) =
                rope.rotate_queries_keys(q, k, &positions, &positions, QkLayout::Bhtd)?;
            assert_close(&qr, get(fx, &format!("{name}.q_rot")), 1e-5, name)?;
            assert_close(&kr, get(fx, &format!("{name}.k_rot")), 1e-5, name)?;
            // The in-place path agrees.
            let (qo, _) = rope.rotate_queries_keys_owned(
                q.copy()?,
                k.copy()?,
                &positions,
                &positions,
                QkLayout::Bhtd,
            )?;
            assert_close(&qo, &qr, 1e-6, &format!("{name} in place"))?;
        }
        // Without the bands, the image and video tokens rotate by their temporal axis only.
        let plain = RotaryEmbedding::new(&cfg.clone().with_mrope(None), dev)?;
        let q = get(fx, &format!("{name}.q"));
        let off = plain.rotate_queries(q, &positions, QkLayout::Bhtd)?;
        assert!(common::max_abs_diff(&off, get(fx, &format!("{name}.q_rot")))? > 1e-2);
    }
    // Text only: three equal axes are plain RoPE.
    let cfg = RopeConfig::from_hf_json(&file.metadata()["qwen3_vl"])?;
    let rope = RotaryEmbedding::new(&cfg, dev)?;
    let text = Tensor::arange(4u32, 12, dev)?.reshape((1, 8))?;
    let equal = Positions::Ids(PositionIds::multimodal(
        &text.unsqueeze(0)?.repeat((3, 1, 1))?,
    )?);
    let q = common::randn(0f32, 1.0, (1, 2, 8, 32), dev)?;
    let a = rope.rotate_queries(&q, &equal, QkLayout::Bhtd)?;
    let b = rope.rotate_queries(&q, &Positions::offset(4), QkLayout::Bhtd)?;
    assert_close(&a, &b, 1e-6, "text axes")?;

    // In the block: a prompt at multimodal positions, then decoding continues at max + 1.
    let cfg = cfg.with_kernel(RopeKernel::Fused);
    let attn = AttentionConfig::new(128, 4).with_causal(true);
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let block =
        MultiHeadAttention::new(&attn, Some(Arc::new(RotaryEmbedding::new(&cfg, dev)?)), vb)?;
    let x = common::randn(0f32, 1.0, (1, t + 1, 128), dev)?;
    let mut cache = KvCache::new();
    let opts = AttentionOptions {
        positions: Some(&positions),
        ..Default::default()
    };
    block.forward_with(&x.narrow(1, 0, t)?, &opts, Some(&mut cache))?;
    assert_eq!(
        cache.next_position() as i64,
        t as i64 + delta,
        "HF's position delta"
    );
    let step = block.forward_with(
        &x.narrow(1, t, 1)?,
        &AttentionOptions::default(),
        Some(&mut cache),
    )?;
    // The same token with its position given explicitly.
    let mut again = KvCache::new();
    block.forward_with(&x.narrow(1, 0, t)?, &opts, Some(&mut again))?;
    let at = Positions::offset((t as i64 + delta) as usize);
    let explicit = block.forward_with(
        &x.narrow(1, t, 1)?,
        &AttentionOptions {
            positions: Some(&at),
            ..Default::default()
        },
        Some(&mut again),
    )?;
    assert_close(&step.output, &explicit.output, 1e-6, "decode position")?;
    Ok(())
}

/// The rotation hook's adjoint is the transpose of the rotation: for random q, k and
/// gradients g, `Σ R(q) · g_q = Σ q · Rᵀ(g_q)` (and for k), for every RoPE form (both pair
/// layouts, partial rotary, xPos, YaRN, Llama 3, dynamic NTK past its length, the fused and
/// the ops kernel) and for axial 2-D RoPE's three layouts over a patch grid. An adjoint that
/// rotated by +θ, dropped a scale or missed the unrotated features would break the equality.
fn adjoint_is_the_transpose(dev: &Device) -> anyhow::Result<()> {
    use candle_posenc::plug::{AttentionContext, PositionalEncoding};
    use candle_posenc::rotary::mrope::AxialRope;
    let dot = |a: &Tensor, b: &Tensor| -> anyhow::Result<f64> {
        Ok((a.to_dtype(DType::F64)? * b.to_dtype(DType::F64)?)?
            .sum_all()?
            .to_scalar::<f64>()?)
    };
    let check = |rope: &RotaryEmbedding, positions: &Positions, t: usize| -> anyhow::Result<()> {
        let d = rope.config().head_dim;
        let (q, k) = (
            common::randn(0f32, 1.0, (1, 4, t, d), dev)?,
            common::randn(0f32, 1.0, (1, 2, t, d), dev)?,
        );
        let (gq, gk) = (
            common::randn(0f32, 1.0, q.shape(), dev)?,
            common::randn(0f32, 1.0, k.shape(), dev)?,
        );
        let ctx = AttentionContext::chunk(positions, t);
        let (rq, rk) = rope.rotate(q.copy()?, k.copy()?, &ctx)?;
        let (aq, ak) = rope.rotate_adjoint(gq.copy()?, gk.copy()?, &ctx)?;
        for (x, rx, g, ag) in [(&q, &rq, &gq, &aq), (&k, &rk, &gk, &ak)] {
            let (lhs, rhs) = (dot(rx, g)?, dot(x, ag)?);
            let scale = dot(rx, rx)?.sqrt() * dot(g, g)?.sqrt();
            assert!(
                (lhs - rhs).abs() <= 1e-5 * scale,
                "{:?}: {lhs} vs {rhs}",
                rope.config()
            );
        }
        Ok(())
    };
    let mut configs: Vec<RopeConfig> = common::zoo::rope_variants().into();
    configs.extend([
        RopeConfig::new(16)
            .with_layout(RopeLayout::Interleaved)
            .with_scaling(RopeScaling::Yarn(YarnScaling::new(4.0, 8))),
        RopeConfig::new(16)
            .with_kernel(RopeKernel::Ops)
            .with_scaling(RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8,
            }),
        RopeConfig::new(16).with_scaling(RopeScaling::Dynamic {
            factor: 2.0,
            original_max_position_embeddings: 8,
        }),
    ]);
    for cfg in configs {
        let rope = RotaryEmbedding::new(&cfg, dev)?;
        check(&rope, &Positions::Offset(5), 20)?;
    }
    let grid = patch_grid(dev)?;
    for axial in [
        AxialRope::EvenOdd,
        AxialRope::Repeated,
        AxialRope::SplitHalves,
    ] {
        let rope = RotaryEmbedding::new(&RopeConfig::new(32).with_axial(Some(axial)), dev)?;
        check(&rope, &grid, 24)?;
    }
    Ok(())
}

/// Axial 2-D RoPE over a 4 × 6 patch grid, read from the vision configs: Pixtral's (even and
/// odd frequencies on rows and columns) and Qwen2-VL's vision encoder's (a half-width head's
/// frequencies on both), against HF's rotary embeddings and apply functions (f32, 1e-5).
fn axial_matches_hf(dev: &Device) -> anyhow::Result<()> {
    use candle_posenc::rotary::mrope::AxialRope;
    let file = mrope_fixture(dev)?;
    let fx = file.tensors();
    let grid = patch_grid(dev)?;
    let (q, k) = (get(fx, "pixtral.q"), get(fx, "pixtral.k"));
    for (name, layout) in [
        ("pixtral", AxialRope::EvenOdd),
        ("qwen2_vl_vision", AxialRope::Repeated),
        // Its width under `hidden_size`, where Qwen2-VL's is under `embed_dim`.
        ("qwen2_5_vl_vision", AxialRope::Repeated),
        // Each half of the head rotates on its own (a review found it read as Repeated).
        ("gemma4_vision", AxialRope::SplitHalves),
    ] {
        let cfg = RopeConfig::from_hf_json(&file.metadata()[name])?;
        assert_eq!(cfg.axial, Some(layout), "{name}");
        assert_eq!(cfg.head_dim, 32, "{name}");
        for kernel in KERNELS {
            let rope = RotaryEmbedding::new(&cfg.clone().with_kernel(kernel), dev)?;
            let (qr, kr) = rope.rotate_queries_keys(q, k, &grid, &grid, QkLayout::Bhtd)?;
            assert_close(&qr, get(fx, &format!("{name}.q_rot")), 1e-5, name)?;
            assert_close(&kr, get(fx, &format!("{name}.k_rot")), 1e-5, name)?;
            // The path that may rotate in place, and the one-at-a-time entry points.
            let (qo, ko) =
                rope.rotate_queries_keys_owned(q.copy()?, k.copy()?, &grid, &grid, QkLayout::Bhtd)?;
            assert_close(&qo, &qr, 0.0, name)?;
            assert_close(&ko, &kr, 0.0, name)?;
        }
    }
    // A layout HF does not pin down is refused under its key.
    let (key, _) = hf_error(
        r#"{"model_type": "siglip", "hidden_size": 64, "num_attention_heads": 2,
            "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0}}"#,
    );
    assert_eq!(key, "rope_parameters.rope_type");
    // Gemma 4's halves rotate as rotate-half only.
    let err = RotaryEmbedding::new(
        &RopeConfig::new(32)
            .with_axial(Some(AxialRope::SplitHalves))
            .with_layout(candle_posenc::RopeLayout::Interleaved),
        dev,
    )
    .unwrap_err();
    assert!(
        matches!(&err, candle_posenc::Error::InvalidConfig { name, .. } if *name == "layout"),
        "{err}"
    );
    Ok(())
}

/// RoPE-Mixed against timm's `RotaryEmbeddingMixed` (the paper's code): q and k rotated over a
/// 3×4 patch grid with its learned frequencies, and torch autograd's gradient with respect to
/// them; a fresh parameter takes the paper's initialisation; the configuration round-trips
/// through checkpoint metadata; misplaced positions and widths are typed errors.
fn rope_mixed_matches_timm(dev: &Device) -> anyhow::Result<()> {
    let f = fixture("rope_mixed.safetensors", dev)?;
    let (q, k) = (get(&f, "q"), get(&f, "k"));
    let cfg = RopeMixedConfig::new(2, 8);
    // Positions: temporal 0, height = the patch's row (t_y), width = its column (t_x).
    let n = q.dim(2)?;
    let axis = |name: &str| -> anyhow::Result<Tensor> {
        Ok(get(&f, name).to_dtype(DType::U32)?.reshape((1, n))?)
    };
    let axes = Tensor::stack(
        &[
            Tensor::zeros((1, n), DType::U32, dev)?,
            axis("t_y")?,
            axis("t_x")?,
        ],
        0,
    )?;
    let positions = Positions::Ids(PositionIds::multimodal(&axes)?);
    // Trained through a VarMap: set to timm's frequencies, then differentiated.
    let varmap = VarMap::new();
    let rope = RopeMixed::new(&cfg, common::seeded_vb(&varmap, DType::F32, dev))?;
    let initial = Tensor::from_vec(cfg.initial_freqs(), (2, 2, 4), dev)?;
    assert_close(
        rope.freqs(),
        &initial,
        0.0,
        "a new parameter starts at the paper's init",
    )?;
    let var = varmap.data().lock().unwrap()["freqs"].clone();
    var.set(get(&f, "freqs"))?;
    let (q_rot, k_rot) = (
        rope.rotate_one(q, &positions)?,
        rope.rotate_one(k, &positions)?,
    );
    assert_close(&q_rot, get(&f, "q_rot"), 1e-5, "q")?;
    assert_close(&k_rot, get(&f, "k_rot"), 1e-5, "k")?;
    let loss = ((&q_rot * get(&f, "w"))?.sum_all()? + (&k_rot * get(&f, "u"))?.sum_all()?)?;
    let grads = loss.backward()?;
    let grad = grads
        .get(var.as_tensor())
        .expect("a gradient for the frequencies");
    assert_close(grad, get(&f, "grad"), 1e-5, "gradient")?;
    // The initial frequencies: per head, (f_x, f_y) pairs of magnitude θ^(−4k/D), the second
    // half at a right angle to the first.
    let init = cfg.initial_freqs();
    for h in 0..2 {
        for kq in 0..2 {
            let m = 10f64.powf(-(4.0 * kq as f64) / 8.0);
            let at = |axis: usize, i: usize| init[(axis * 2 + h) * 4 + i] as f64;
            let (a, b) = ((at(0, kq), at(1, kq)), (at(0, kq + 2), at(1, kq + 2)));
            assert!(((a.0 * a.0 + a.1 * a.1).sqrt() - m).abs() < 1e-6);
            assert!((a.0 * b.0 + a.1 * b.1).abs() < 1e-6, "a right angle");
        }
    }
    // Through the block, with checkpoint metadata.
    let encoding = EncodingConfig::RopeMixed(cfg.with_seed(3));
    let meta = encoding.to_metadata();
    assert_eq!(EncodingConfig::from_metadata(&meta, "test")?, encoding);
    let attn_cfg = AttentionConfig::new(16, 2);
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let block = MultiHeadAttention::new(&attn_cfg, encoding.build(vb.pp("rope"))?, vb.pp("attn"))?;
    let x = common::randn(0f32, 1.0, (1, n, 16), dev)?;
    let opts = AttentionOptions {
        positions: Some(&positions),
        ..Default::default()
    };
    assert_eq!(
        block.forward_with(&x, &opts, None)?.output.dims(),
        &[1, n, 16]
    );
    // Plain offsets have no rows and columns; widths must match.
    let err = block.forward(&x).unwrap_err();
    assert!(err.to_string().contains("RoPE-Mixed positions"), "{err}");
    for bad in [
        RopeMixedConfig::new(2, 6),
        RopeMixedConfig::new(0, 8),
        RopeMixedConfig::new(2, 8).with_theta(1.0),
    ] {
        assert!(
            matches!(bad.validate(), Err(Error::InvalidConfig { .. })),
            "{bad:?}"
        );
    }
    Ok(())
}

/// A null θ where θ is read is refused under its key (HF's classes pass it to the rotary code,
/// which fails on it); GPT-NeoX reads `rotary_emb_base` and not `rope_theta`, and an absent
/// θ is the class's default.
fn null_rope_theta(_dev: &Device) -> anyhow::Result<()> {
    let sizes = r#""hidden_size": 64, "num_attention_heads": 4"#;
    for (json, key) in [
        (
            format!(r#"{{"model_type": "llama", {sizes}, "rope_theta": null}}"#),
            "rope_theta",
        ),
        (
            format!(
                r#"{{"model_type": "llama", {sizes}, "rope_theta": 500000.0,
                "rope_parameters": {{"rope_type": "default", "rope_theta": null}}}}"#
            ),
            "rope_parameters.rope_theta",
        ),
        (
            format!(
                r#"{{"model_type": "qwen2", {sizes}, "rope_theta": null,
                "rope_scaling": {{"rope_type": "linear", "factor": 2.0}}}}"#
            ),
            "rope_theta",
        ),
    ] {
        let (got, problem) = hf_error(&json);
        assert_eq!(got, key, "{json}");
        assert!(problem.contains("null"), "{problem}");
    }
    let neox = format!(
        r#"{{"model_type": "gpt_neox", {sizes}, "rope_theta": null, "rotary_emb_base": 500.0}}"#
    );
    assert_eq!(RopeConfig::from_hf_json(&neox)?.base, 500.0);
    let absent = format!(r#"{{"model_type": "smollm3", {sizes}}}"#);
    assert_eq!(RopeConfig::from_hf_json(&absent)?.base, 2e6);
    Ok(())
}

device_tests!(
    adjoint_is_the_transpose,
    rope_mixed_matches_timm,
    dynamic_rows_from_the_first_position,
    axial_matches_hf,
    mrope_matches_hf,
    proportional_matches_hf,
    owned_rotation_matches,
    hf_config_json,
    null_rope_theta,
    frequencies_match_hf,
    cos_sin_match_hf,
    rotations_match_hf,
    xpos_matches_rotary_embedding_torch,
    fused_gradients,
    half_precision_far_positions,
    properties,
    decode_with_cache_equals_full_forward,
    table_cache,
    bad_input,
    metadata_round_trip,
);
