//! Classes of bad input found by an outside probe, each tested as a class: empty batches, ids
//! past `u32`, masks of the wrong kind (including on empty chunks), dtypes outside the four the
//! crate computes in, distances at the ends of `i64`, and inputs in any memory layout.

use crate::common;

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_posenc::{
    Alibi, AlibiConfig, AttentionConfig, AttentionOptions, ClippedBiasConfig, ClippedRelativeBias,
    EncodingConfig, Error, KvCache, LatentConfig, LearnedConfig, LearnedPositionalEncoding,
    LongRopeScaling, MultiHeadAttention, Positions, QkLayout, QkNormConfig, RopeConfig,
    RopeScaling, RotaryEmbedding, ShawConfig, ShawRelativePosition, SinusoidalConfig,
    SinusoidalPositionalEncoding, T5Config, T5RelativeBias, YarnScaling,
};
use common::zoo;

/// An empty batch (B = 0, T > 0) gives empty outputs and weights on every path, with and
/// without a cache, for every encoding; the cache is left as it was.
fn empty_batch_gives_empty_outputs(dev: &Device) -> anyhow::Result<()> {
    let (d_model, heads) = (16, 4);
    let x = Tensor::zeros((0, 5, d_model), DType::F32, dev)?;
    for (i, config) in zoo::configs(d_model, heads, d_model / heads)
        .iter()
        .enumerate()
    {
        let attn = AttentionConfig::new(d_model, heads).with_causal(true);
        let (mha, _vars) = zoo::attention(config, &attn, DType::F32, dev)?;
        for (train, return_weights) in [(false, false), (false, true), (true, false)] {
            let opts = AttentionOptions {
                train,
                return_weights,
                ..Default::default()
            };
            let what = format!("{} train {train}", zoo::label(i, config));
            let out = mha.forward_with(&x, &opts, None)?;
            assert_eq!(out.output.dims(), &[0, 5, d_model], "{what}");
            if let Some(w) = out.weights {
                assert_eq!(w.dims(), &[0, heads, 5, 5], "{what}");
            }
            let mut cache = KvCache::new();
            let out = mha.forward_with(&x, &opts, Some(&mut cache))?;
            assert_eq!(out.output.dims(), &[0, 5, d_model], "{what}");
            assert!(cache.is_empty(), "{what}");
        }
    }
    Ok(())
}

/// Ids for more positions than `u32` holds, or than the budget allows, are refused before
/// anything is allocated (they used to be truncated to none).
fn position_ids_past_u32(dev: &Device) -> anyhow::Result<()> {
    for (start, len) in [
        (0usize, 1usize << 32),
        (1, (1 << 32) - 1),
        (0, (1 << 32) + 1),
    ] {
        let err = Positions::Offset(start).to_ids(len, dev).unwrap_err();
        assert!(
            matches!(err, Error::InvalidConfig { .. }),
            "{start} + {len}: {err}"
        );
    }
    let ids = Positions::Offset(0).to_ids(3, dev)?;
    let err = Positions::ids(&ids)?.to_ids(4, dev).unwrap_err();
    assert!(matches!(err, Error::Shape { .. }), "{err}");
    Ok(())
}

/// An additive mask must be a float tensor (a 0/1 u8 mask added as +1 was a silent wrong
/// answer); masks are checked on empty chunks too.
fn masks_of_the_wrong_kind(dev: &Device) -> anyhow::Result<()> {
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let mha = MultiHeadAttention::new(&AttentionConfig::new(16, 4), None, vb)?;
    // T = 0 where the device holds empty tensors (common::holds_empty).
    for t in [3usize, 0]
        .into_iter()
        .filter(|&t| t > 0 || common::holds_empty(dev))
    {
        let x = Tensor::zeros((2, t, 16), DType::F32, dev)?;
        for dtype in [DType::U8, DType::U32, DType::I64] {
            let mask = Tensor::ones((2, 1, t, t), dtype, dev)?;
            let opts = AttentionOptions {
                attn_mask: Some(&mask),
                ..Default::default()
            };
            let err = mha.forward_with(&x, &opts, None).unwrap_err();
            assert!(
                matches!(err, Error::DType { .. }),
                "T = {t}, {dtype:?}: {err}"
            );
            assert!(err.to_string().contains("padding_mask"), "{err}");
        }
        let misshapen = Tensor::zeros((3, 1, t + 1, t + 1), DType::F32, dev)?;
        let opts = AttentionOptions {
            attn_mask: Some(&misshapen),
            ..Default::default()
        };
        let err = mha.forward_with(&x, &opts, None).unwrap_err();
        assert!(matches!(err, Error::Shape { .. }), "T = {t}: {err}");
        let padding = Tensor::ones((2, t + 2), DType::U8, dev)?;
        let opts = AttentionOptions {
            padding_mask: Some(&padding),
            ..Default::default()
        };
        let err = mha.forward_with(&x, &opts, None).unwrap_err();
        assert!(matches!(err, Error::Shape { .. }), "T = {t}: {err}");
    }
    Ok(())
}

/// One rule for every weight and table: f32, f64, bf16 or f16. Integer and 8-bit float
/// `VarBuilder`s are refused when the module is built (T5, clipped and Shaw tables used to
/// load through an integer one, −7.0 becoming 0; an F8 block failed at its first matmul).
fn one_dtype_rule_for_every_table(dev: &Device) -> anyhow::Result<()> {
    for dtype in [DType::U8, DType::U32, DType::I64, DType::F8E4M3] {
        let varmap = VarMap::new();
        let vb = common::seeded_vb(&varmap, dtype, dev);
        let results = [
            (
                "attention",
                MultiHeadAttention::new(&AttentionConfig::new(16, 4), None, vb.pp("a")).map(drop),
            ),
            (
                "t5",
                T5RelativeBias::new(&T5Config::new(4), vb.pp("t5")).map(drop),
            ),
            (
                "clipped",
                ClippedRelativeBias::new(&ClippedBiasConfig::new(4, 3), vb.pp("c")).map(drop),
            ),
            (
                "shaw",
                ShawRelativePosition::new(&ShawConfig::new(4, 3), vb.pp("s")).map(drop),
            ),
            (
                "learned",
                LearnedPositionalEncoding::new(&LearnedConfig::new(16), vb.pp("l")).map(drop),
            ),
        ];
        for (name, result) in results {
            match result {
                Err(Error::DType { got, .. }) => assert_eq!(got, dtype, "{name}"),
                other => panic!("{name} through a {dtype:?} VarBuilder: {other:?}"),
            }
        }
        assert!(
            varmap.all_vars().is_empty(),
            "{dtype:?}: nothing is created"
        );
    }
    Ok(())
}

/// T5's buckets at the ends of `i64` (|i64::MIN| has no i64 negation): the farthest buckets,
/// never a wrap to bucket 0.
fn t5_buckets_at_the_ends_of_i64(_dev: &Device) -> anyhow::Result<()> {
    for bidirectional in [false, true] {
        let cfg = T5Config::new(4).with_bidirectional(bidirectional);
        let far_before = cfg.bucket(-1_000_000);
        assert_eq!(
            cfg.bucket(i64::MIN),
            far_before,
            "bidirectional {bidirectional}"
        );
        assert_eq!(cfg.bucket(i64::MIN + 1), far_before);
        assert_eq!(cfg.bucket(i64::MAX), cfg.bucket(1_000_000));
    }
    Ok(())
}

/// The public bucket methods never panic, and their checked forms check the configuration (it
/// may never have been validated): a typed error where the bucket has no answer (no buckets, a log over ln 1 = 0, a clip
/// range whose ends cross), never a panic or a wrapped bucket; valid configurations keep
/// their buckets, at the ends of `i64` too.
fn bucket_methods_check_their_configuration(_dev: &Device) -> anyhow::Result<()> {
    let refused = |what: &str, r: candle_posenc::Result<u32>, name: &str| match r {
        Err(Error::InvalidConfig { name: got, .. }) if got == name => {}
        other => panic!("{what}: {other:?}"),
    };
    for d in [i64::MIN, -100, -1, 0, 1, 5, 100, i64::MAX] {
        // The plain methods are total: no panic on any of these (their values mean nothing).
        let _ = ClippedBiasConfig::new(1, usize::MAX).bucket(d);
        let _ = ClippedBiasConfig::new(1, 0).bucket(d);
        let _ = T5Config::new(4).with_num_buckets(0).bucket(d);
        let _ = T5Config::new(4).with_max_distance(8).bucket(d);
        refused(
            "clipped, k = usize::MAX",
            ClippedBiasConfig::new(1, usize::MAX).try_bucket(d),
            "max_distance",
        );
        refused(
            "clipped, k = 0",
            ClippedBiasConfig::new(1, 0).try_bucket(d),
            "max_distance",
        );
        refused(
            "T5 without buckets",
            T5Config::new(4).with_num_buckets(0).try_bucket(d),
            "num_buckets",
        );
        refused(
            "T5 with max_distance = the exact range",
            T5Config::new(4).with_max_distance(8).try_bucket(d),
            "max_distance",
        );
    }
    // Valid configurations at their edges: a clip of 2^29 (the table within the default
    // budget), T5 with buckets so many that its log quotient passes usize (the sum saturates
    // into the last bucket; it overflowed).
    let clipped = ClippedBiasConfig::new(1, 1 << 29);
    assert_eq!(clipped.try_bucket(i64::MIN)?, 0);
    assert_eq!(clipped.try_bucket(0)?, 1 << 29);
    assert_eq!(clipped.try_bucket(i64::MAX)?, 1 << 30);
    let wide = T5Config::new(1)
        .with_num_buckets(1 << 31)
        .with_max_distance((1 << 30) + 1)
        .with_bidirectional(false);
    assert_eq!(wide.try_bucket(i64::MIN)?, (1 << 31) - 1);
    assert_eq!(wide.try_bucket(-5)?, 5);
    Ok(())
}

/// Configurations that would turn finite input into NaN or ∞ are refused: the examples the
/// probe found, then every scaling over a sweep of extreme values, each either refused with a
/// typed error or giving finite rotations at positions up to 50 000.
fn configurations_that_cannot_give_finite_output(dev: &Device) -> anyhow::Result<()> {
    probed_scalings_are_refused(dev)?;
    attention_factors_past_2_to_32_are_refused(dev)?;
    softmax_scales_that_overflow_are_refused(dev)?;
    accepted_scalings_rotate_to_finite_output(dev)?;
    rope_mixed_frequencies_are_checked(dev)
}

/// LongRoPE with four short factors 1 and long factors 2, factor 4.
fn longrope(orig: usize, attention_factor: Option<f64>) -> RopeScaling {
    RopeScaling::LongRope(LongRopeScaling {
        short_factor: vec![1.0; 4],
        long_factor: vec![2.0; 4],
        original_max_position_embeddings: orig,
        factor: 4.0,
        attention_factor,
    })
}

/// The examples the probe found: each scaling is refused where it is built and validated.
fn probed_scalings_are_refused(dev: &Device) -> anyhow::Result<()> {
    let refused = [
        (
            "subnormal linear factor",
            RopeScaling::Linear { factor: 1e-310 },
        ),
        // ω = 1/factor = 4.5e307: position 4's angle overflowed f64 and the table refused
        // position 4 at the forward (the fuzz target, run 25). Inverse frequencies past
        // f64::MAX / 2^53 are refused where the scaling is built, whatever the positions.
        (
            "linear factor f64::MIN_POSITIVE",
            RopeScaling::Linear {
                factor: f64::MIN_POSITIVE,
            },
        ),
        ("NTK alpha 1e-300", RopeScaling::NtkAware { alpha: 1e-300 }),
        ("LongRoPE original length 1", longrope(1, None)),
        (
            "YaRN attention factor 1e300",
            RopeScaling::Yarn(YarnScaling::new(4.0, 64).with_attention_factor(1e300)),
        ),
        (
            "LongRoPE attention factor 1e-320",
            longrope(64, Some(1e-320)),
        ),
    ];
    for (what, scaling) in refused {
        let cfg = RopeConfig::new(8).with_scaling(scaling);
        let err = RotaryEmbedding::new(&cfg, dev).unwrap_err();
        assert!(matches!(err, Error::InvalidConfig { .. }), "{what}: {err}");
        assert!(cfg.validate().is_err(), "{what}: validate accepts it");
    }
    Ok(())
}

/// The attention factor scales queries and keys alike, so the logits by its square: past
/// 2^±32 it is refused where the tables are built, with or without xPos (the fuzz target
/// found f32::MAX accepted: every table entry was finite, the logits were not). Within it,
/// xPos's key scale (at most e^60, the position limit) keeps the tables finite in f32.
fn attention_factors_past_2_to_32_are_refused(dev: &Device) -> anyhow::Result<()> {
    let yarn = |a| RopeScaling::Yarn(YarnScaling::new(4.0, 64).with_attention_factor(a));
    for a in [1e14, f32::MAX as f64, 1e-14] {
        for cfg in [
            RopeConfig::new(8).with_scaling(yarn(a)),
            RopeConfig::new(8).with_xpos(1.0).with_scaling(yarn(a)),
        ] {
            let err = RotaryEmbedding::new(&cfg, dev).unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::InvalidConfig {
                        name: "rope attention factor",
                        ..
                    }
                ),
                "{a}: {err}"
            );
        }
    }
    let cfg = RopeConfig::new(8)
        .with_xpos(8.0)
        .with_max_position(16)
        .with_scaling(yarn(2f64.powi(31)));
    let rope = RotaryEmbedding::new(&cfg, dev)?;
    let q = Tensor::ones((1, 1, 1, 8), DType::F32, dev)?;
    let at = Positions::Offset(380);
    let (rq, rk) = rope.rotate_queries_keys(&q, &q, &at, &at, QkLayout::Bhtd)?;
    for t in [rq, rk] {
        assert!(t
            .flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .all(|x| x.is_finite()));
    }
    Ok(())
}

/// Softmax scales that would take finite logits to NaN or ∞ are refused.
fn softmax_scales_that_overflow_are_refused(dev: &Device) -> anyhow::Result<()> {
    for scale in [1e300, 1e-300, f64::MIN_POSITIVE / 2.0] {
        let err = AttentionConfig::new(16, 4)
            .with_softmax_scale(scale)
            .validate()
            .unwrap_err();
        assert!(
            matches!(err, Error::InvalidConfig { .. }),
            "scale {scale}: {err}"
        );
    }
    // In f16 the scale times head_dim may reach 2^8: 1.69 over 65,536 features (found by the
    // fuzz target: moderate input overflowed f16's logits) is refused, the default scale of
    // the same width and the same scale over 64 features are not.
    let varmap = VarMap::new();
    let half = common::seeded_vb(&varmap, DType::F16, dev);
    let wide = AttentionConfig::new(13, 1).with_head_dim(65536);
    assert!(matches!(
        MultiHeadAttention::new(&wide.clone().with_softmax_scale(1.69), None, half.pp("a")),
        Err(Error::InvalidConfig {
            name: "softmax_scale",
            ..
        })
    ));
    MultiHeadAttention::new(&wide, None, half.pp("b"))?;
    MultiHeadAttention::new(
        &AttentionConfig::new(64, 1).with_softmax_scale(1.69),
        None,
        half.pp("c"),
    )?;
    let big = AttentionConfig::new(16, 4).with_softmax_scale(1e6);
    assert!(matches!(
        MultiHeadAttention::new(&big, None, half),
        Err(Error::InvalidConfig { .. })
    ));
    Ok(())
}

/// The sweep: whatever is accepted rotates finite input to finite output.
fn accepted_scalings_rotate_to_finite_output(dev: &Device) -> anyhow::Result<()> {
    let q = Tensor::ones((1, 1, 3, 8), DType::F32, dev)?;
    let mut accepted = 0;
    for v in [1e-300, 1e-30, 1e-5, 0.5, 1.0, 3.0, 1e5, 1e30, 1e300] {
        let scalings = [
            RopeScaling::Linear { factor: v },
            RopeScaling::NtkAware { alpha: v },
            RopeScaling::Dynamic {
                factor: v,
                original_max_position_embeddings: 64,
            },
            RopeScaling::Yarn(YarnScaling::new(v, 64)),
            RopeScaling::Yarn(YarnScaling::new(4.0, 64).with_mscale(v, 1.0)),
            RopeScaling::Llama3 {
                factor: v,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 64,
            },
            longrope(64, Some(v)),
        ];
        for scaling in scalings {
            let what = format!("{scaling:?}");
            let Ok(rope) = RotaryEmbedding::new(&RopeConfig::new(8).with_scaling(scaling), dev)
            else {
                continue;
            };
            accepted += 1;
            for start in [0usize, 1000, 50_000] {
                let p = Positions::Offset(start);
                let (rq, rk) = rope.rotate_queries_keys(&q, &q, &p, &p, QkLayout::Bhtd)?;
                for t in [rq, rk] {
                    let finite = t
                        .flatten_all()?
                        .to_vec1::<f32>()?
                        .iter()
                        .all(|x| x.is_finite());
                    assert!(finite, "{what} at {start}");
                }
            }
        }
    }
    assert!(accepted > 30, "only {accepted} configurations accepted");
    Ok(())
}

/// RoPE-Mixed's loaded frequencies: non-finite ones, or ones whose angle at a u32 position
/// passes f32, are refused; 2^64 (the largest allowed) rotates finitely at 2^32 − 1.
fn rope_mixed_frequencies_are_checked(dev: &Device) -> anyhow::Result<()> {
    use candle_posenc::rotary::mixed::{RopeMixed, RopeMixedConfig, MAX_FREQUENCY};
    let cfg = RopeMixedConfig::new(1, 4);
    let load = |f: f32| {
        let freqs = Tensor::new(&[[[0.5f32, f]], [[0.25, 1.0]]], dev)?;
        let tensors = std::collections::HashMap::from([("freqs".to_string(), freqs)]);
        anyhow::Ok(RopeMixed::new(
            &cfg,
            VarBuilder::from_tensors(tensors, DType::F32, dev),
        ))
    };
    for f in [f32::NAN, f32::INFINITY, -1e30] {
        let err = load(f)?.unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidConfig {
                    name: "RoPE-Mixed frequency",
                    ..
                }
            ),
            "{f}: {err}"
        );
    }
    let rope = load(-(MAX_FREQUENCY as f32))??;
    let far = Tensor::new(&[u32::MAX], dev)?.reshape((1, 1))?;
    let ids = candle_posenc::PositionIds::multimodal(&Tensor::stack(&[&far, &far, &far], 0)?)?;
    let out = rope.rotate_one(
        &Tensor::ones((1, 1, 1, 4), DType::F32, dev)?,
        &Positions::Ids(ids),
    )?;
    assert!(out
        .flatten_all()?
        .to_vec1::<f32>()?
        .iter()
        .all(|x| x.is_finite()));
    Ok(())
}

/// A rotation hook that answers with views strided on the feature axis (the same values):
/// every path reads them (found by the api fuzz target: candle's matmul refused them with its
/// own error).
#[derive(Debug)]
struct StridedAnswers;

impl candle_posenc::PositionalEncoding for StridedAnswers {
    fn rotate(
        &self,
        q: Tensor,
        k: Tensor,
        _: &candle_posenc::AttentionContext,
    ) -> candle_posenc::Result<(Tensor, Tensor)> {
        // Every axis reversed in memory: (B, H, T, D) with strides (1, B, B·H, B·H·T).
        let strided = |t: &Tensor| t.permute((3, 2, 1, 0))?.contiguous()?.permute((3, 2, 1, 0));
        Ok((strided(&q)?, strided(&k)?))
    }
}

fn hooks_may_answer_strided_views(dev: &Device) -> anyhow::Result<()> {
    // No grouped heads: the keys reach the products as the hook gave them.
    let cfg = AttentionConfig::new(16, 4).with_causal(true);
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let plain = MultiHeadAttention::new(&cfg, None, vb.clone())?;
    let strided = MultiHeadAttention::new(&cfg, Some(std::sync::Arc::new(StridedAnswers)), vb)?;
    let x = common::randn(0f32, 1.0, (2, 5, 16), dev)?;
    for (weights, train) in [(false, false), (true, false), (false, true)] {
        let o = AttentionOptions {
            return_weights: weights,
            train,
            ..Default::default()
        };
        let want = plain.forward_with(&x, &o, None)?.output;
        let got = strided.forward_with(&x, &o, None)?.output;
        let diff = common::max_abs_diff(&got, &want)?;
        assert!(diff < 1e-6, "weights {weights} train {train}: {diff:e}");
    }
    Ok(())
}

/// Multimodal positions: the work follows the tokens (a grid of no tokens but 2^64 frames
/// returns at once), and positions that would pass `u32` are refused with a typed error,
/// however the segments add up (`pos + max(h, w)` overflowed u64).
fn mrope_positions_bound_their_work(_dev: &Device) -> anyhow::Result<()> {
    use candle_posenc::rotary::mrope::{mrope_positions, MropeSection, MropeSegment};
    let grid = |t, h, w| MropeSegment::Grid {
        t,
        h,
        w,
        time_interval: 1.0,
    };
    let started = std::time::Instant::now();
    let (axes, delta) = mrope_positions(&[grid(usize::MAX, 0, 1), MropeSegment::Text(2)])?;
    assert!(started.elapsed().as_secs() < 5, "{:?}", started.elapsed());
    // The empty grid still moves the text on by max(h, w) = 1, as HF does.
    assert_eq!(axes, vec![1, 2, 1, 2, 1, 2]);
    assert_eq!(delta, 1);
    for segments in [
        vec![grid(0, usize::MAX, 0), grid(0, 1, 0), MropeSegment::Text(1)],
        vec![MropeSegment::Text(1), grid(0, usize::MAX, 0)],
        vec![grid(0, 1 << 32, 0), MropeSegment::Text(1)],
        vec![
            MropeSegment::Text(3),
            grid(0, u32::MAX as usize, 0),
            MropeSegment::Text(1),
        ],
    ] {
        match mrope_positions(&segments) {
            Err(Error::InvalidConfig { name, expected, .. }) => {
                assert_eq!(name, "segments");
                assert!(expected.contains("fit u32"), "{expected}");
            }
            other => panic!("{segments:?}: {other:?}"),
        }
    }
    // The last position that fits is given.
    let (axes, _) = mrope_positions(&[grid(0, u32::MAX as usize, 0), MropeSegment::Text(1)])?;
    assert_eq!(axes, vec![u32::MAX; 3]);
    // Band layouts with sections near usize::MAX: no 3·h or t + h overflow.
    let big = MropeSection::new([usize::MAX, usize::MAX, usize::MAX]);
    assert_eq!(big.axis_of(usize::MAX), 1); // not below t = usize::MAX, below t + h
    let big = big.with_interleaved(true);
    assert_eq!((big.axis_of(4), big.axis_of(5)), (1, 2));
    assert_eq!(MropeSection::new([1, usize::MAX, 1]).axis_of(usize::MAX), 1);
    Ok(())
}

/// An empty batch of more tokens than the element budget is refused as a full one is: its
/// shapes (`(0, T, H, D)`, `(0, H, T, T)`) would need strides past `usize` (found by the api
/// fuzz target built with debug assertions, where candle's stride arithmetic overflowed), and
/// an empty batch asking for weights is budgeted as one sequence.
fn empty_batches_of_huge_chunks(dev: &Device) -> anyhow::Result<()> {
    use candle_posenc::PositionIds;
    let typed = |r: Result<(), Error>, what: &str| match r {
        Err(Error::InvalidConfig { .. }) => {}
        other => panic!("{what}: {other:?}"),
    };
    let huge = candle_posenc::limits::max_elements() + 1;
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let mha = MultiHeadAttention::new(&AttentionConfig::new(16, 4).with_causal(true), None, vb)?;
    let weights = AttentionOptions {
        return_weights: true,
        ..Default::default()
    };
    for (t, opts) in [
        (huge, AttentionOptions::default()),
        (huge, weights.clone()),
        // One sequence's weights, 4 · 2^16 · 2^16 = 2^34, pass the budget.
        (1 << 16, weights),
    ] {
        let x = Tensor::zeros((0, t, 16), DType::F32, dev)?;
        typed(
            mha.forward_with(&x, &opts, None).map(|_| ()),
            &format!("T {t}"),
        );
    }
    let ids = Tensor::zeros((0, huge), DType::U32, dev)?;
    typed(PositionIds::new(&ids).map(|_| ()), "ids");
    let axes = Tensor::zeros((3, huge, 0), DType::U32, dev)?;
    typed(PositionIds::multimodal(&axes).map(|_| ()), "multimodal ids");
    let rope = RotaryEmbedding::new(&RopeConfig::new(8), dev)?;
    typed(
        rope.cos_sin(&Positions::Offset(0), huge).map(|_| ()),
        "cos_sin",
    );
    Ok(())
}

/// f16 rotations whose scales do not fit f16 are refused instead of giving ∞ (found by the api
/// fuzz target: an f16 block with xPos γ = 16 decoding past position 142, where the key scale
/// 3.5^(n/16) passes 65504 while the f32 tables are finite). For every γ and attention factor
/// a rotation either gives finite output or is refused with a typed error, and the refusal
/// comes only where a·ζ^(±n/γ) leaves 2^±8; f32 and bf16 rotate the same positions.
fn half_precision_rotations_stay_in_range(dev: &Device) -> anyhow::Result<()> {
    let finite = |t: &Tensor| -> anyhow::Result<bool> {
        Ok(t.to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .all(|x| x.is_finite()))
    };
    let ln_zeta0 = (1.4f64 / 0.4).ln();
    for gamma in [16.0, 64.0, 512.0] {
        let cfg = RopeConfig::new(8).with_xpos(gamma);
        let rope = RotaryEmbedding::new(&cfg, dev)?;
        // One past the last position whose scales stay within 2^±8.
        let limit = (8.0 * std::f64::consts::LN_2 * gamma / ln_zeta0) as usize + 1;
        let x = (Tensor::ones((1, 2, 4, 8), DType::F32, dev)? * 4.0)?;
        for end in [4, limit - 1, limit, limit + 1, 2 * limit, 4 * limit] {
            let at = Positions::Offset(end - 4);
            for dtype in [DType::F16, DType::BF16, DType::F32] {
                let x = x.to_dtype(dtype)?;
                let r = rope.rotate_queries_keys(&x, &x, &at, &at, QkLayout::Bhtd);
                let what = format!("γ {gamma} end {end} {dtype:?}");
                match r {
                    Ok((q, k)) => {
                        assert!(dtype != DType::F16 || end <= limit, "{what}: accepted");
                        assert!(finite(&q)? && finite(&k)?, "{what}: not finite");
                    }
                    Err(e @ Error::InvalidConfig { name, .. }) => {
                        assert_eq!(dtype, DType::F16, "{what}: {e}");
                        assert!(end > limit, "{what}: refused early: {e}");
                        assert_eq!(name, "sequence end", "{what}");
                        assert!(e.to_string().contains("f16"), "{what}: {e}");
                    }
                    Err(e) => panic!("{what}: {e}"),
                }
                // Each tensor alone, as queries and as keys, follows the same rule.
                let k = rope.rotate_keys(&x, &at, QkLayout::Bhtd);
                assert_eq!(k.is_ok(), dtype != DType::F16 || end <= limit, "{what}");
            }
        }
    }
    // Without xPos the attention factor scales queries and keys alike: 300 is refused in f16
    // only, 200 accepted everywhere.
    for (a, f16_ok) in [(200.0, true), (300.0, false), (1.0 / 300.0, false)] {
        let scaling = RopeScaling::Yarn(YarnScaling::new(4.0, 64).with_attention_factor(a));
        let rope = RotaryEmbedding::new(&RopeConfig::new(8).with_scaling(scaling), dev)?;
        for dtype in [DType::F16, DType::F32] {
            let x = Tensor::ones((1, 1, 2, 8), dtype, dev)?;
            let r = rope.rotate_queries(&x, &Positions::Offset(0), QkLayout::Bhtd);
            let ok = dtype != DType::F16 || f16_ok;
            assert_eq!(r.is_ok(), ok, "factor {a} {dtype:?}: {r:?}");
            if let Err(e) = r {
                assert!(
                    matches!(
                        e,
                        Error::InvalidConfig {
                            name: "rope attention factor",
                            ..
                        }
                    ),
                    "{e}"
                );
            }
        }
    }
    // The fuzz target's case as a block: f16, xPos γ = 16, decoding 35 tokens at a time through
    // a cache. Every chunk either gives finite output or is refused, with the cache unchanged.
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F16, dev);
    let rope = std::sync::Arc::new(RotaryEmbedding::new(
        &RopeConfig::new(4).with_xpos(16.0),
        dev,
    )?);
    let mha = MultiHeadAttention::new(
        &AttentionConfig::new(28, 7).with_causal(true),
        Some(rope),
        vb,
    )?;
    let mut cache = KvCache::new();
    let x = (Tensor::ones((3, 35, 28), DType::F32, dev)? * 4.0)?.to_dtype(DType::F16)?;
    let mut refused = false;
    for chunk in 0..3 {
        let before = cache.len();
        match mha.forward_with(&x, &AttentionOptions::default(), Some(&mut cache)) {
            Ok(out) => {
                assert!(!refused, "chunk {chunk} accepted after a refusal");
                assert!(finite(&out.output)?, "chunk {chunk}: not finite");
            }
            Err(Error::InvalidConfig {
                name: "sequence end",
                ..
            }) => {
                // The limit for γ = 16 is position 71 (the key scale 2^8): chunks end at 35,
                // 70 and 105.
                assert_eq!(chunk, 2, "chunk {chunk} refused");
                assert_eq!(cache.len(), before, "chunk {chunk} changed the cache");
                refused = true;
            }
            Err(e) => panic!("chunk {chunk}: {e}"),
        }
    }
    assert!(refused, "positions past the f16 limit were accepted");
    Ok(())
}

/// The layouts a caller's `(B, T, D)` input may come in, each with the same values as `x`:
/// features and tokens swapped in memory (a `(B, D, T)` tensor transposed), batch and tokens
/// swapped, every axis reversed, features narrowed from a wider tensor, one sequence broadcast
/// over the batch.
fn layouts_of(x: &Tensor) -> anyhow::Result<Vec<(&'static str, Tensor)>> {
    let (b, t, d) = x.dims3()?;
    let swapped = |a: usize, c: usize| -> anyhow::Result<Tensor> {
        Ok(x.transpose(a, c)?.contiguous()?.transpose(a, c)?)
    };
    Ok(vec![
        ("tokens-features", swapped(1, 2)?),
        ("batch-tokens", swapped(0, 1)?),
        (
            "reversed",
            x.permute((2, 1, 0))?.contiguous()?.permute((2, 1, 0))?,
        ),
        ("narrowed", Tensor::cat(&[x, x], 2)?.narrow(2, d, d)?),
        (
            "broadcast",
            x.narrow(0, 0, 1)?.contiguous()?.broadcast_as((b, t, d))?,
        ),
    ])
}

/// An input in any memory layout gives what its contiguous copy gives, for every encoding,
/// with plain, grouped-with-bias, query/key-normed, keys-as-values and latent projections, in
/// every float dtype, frozen and tracked, one token or several. (candle 0.11's CPU product read
/// a `(B, D, T)` input transposed to `(B, T, D)` at the wrong places when its weight was
/// broadcast over the batch: f64 and half-precision blocks, latent attention in every dtype and
/// tracked blocks with query/key norms were off by up to 8, with no error; an outside probe
/// found it.)
fn inputs_in_any_layout(dev: &Device) -> anyhow::Result<()> {
    let (d_model, heads) = (32, 4);
    let blocks = [
        AttentionConfig::new(d_model, heads).with_causal(true),
        AttentionConfig::new(d_model, heads)
            .with_kv_heads(2)
            .with_bias(true),
        AttentionConfig::new(d_model, heads).with_qk_norm(Some(QkNormConfig::new())),
        AttentionConfig::new(d_model, heads).with_k_eq_v(true),
        AttentionConfig::new(d_model, heads)
            .with_causal(true)
            .with_latent(Some(LatentConfig::new(Some(12), 10, 4, 6))),
    ];
    let opts = AttentionOptions::default();
    for (i, config) in zoo::configs(d_model, heads, d_model / heads)
        .iter()
        .enumerate()
    {
        for block in &blocks {
            // (Latent attention rotates its own decoupled features: no encoding beside it.)
            if block.latent.is_some() && !matches!(config, EncodingConfig::None) {
                continue;
            }
            let (_, varmap) = zoo::attention(config, block, DType::F32, dev)?;
            let vb = common::seeded_vb(&varmap, DType::F32, dev);
            let tracked =
                MultiHeadAttention::new(block, config.build(vb.pp("enc"))?, vb.pp("attn"))?;
            for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
                let frozen = zoo::attention_from(config, block, &varmap, dtype, dev)?;
                let mut blocks = vec![("frozen", &frozen)];
                if dtype == DType::F32 {
                    blocks.push(("tracked", &tracked));
                }
                for (b, t) in [(2, 5), (3, 1)] {
                    let x = common::randn(0f32, 1.0, (b, t, d_model), dev)?.to_dtype(dtype)?;
                    for (layout, view) in layouts_of(&x)? {
                        let copy = view.contiguous()?;
                        for (kind, mha) in &blocks {
                            let want = mha.forward_with(&copy, &opts, None)?.output;
                            let got = mha.forward_with(&view, &opts, None)?.output;
                            let scale = want
                                .to_dtype(DType::F64)?
                                .abs()?
                                .max_all()?
                                .to_scalar::<f64>()?
                                .max(1.0);
                            let tol = match dtype {
                                DType::F64 => 1e-12,
                                DType::F32 => 1e-5,
                                _ => 1e-2,
                            } * scale;
                            let what = format!(
                                "{} {:?} {dtype:?} {kind} B{b} T{t} {layout}",
                                zoo::label(i, config),
                                block
                            );
                            common::assert_close(&got, &want, tol, &what)?;
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Every encoding's `Module::forward` refuses a non-float input with `Error::DType` (wrapped in
/// candle's error, as `Module` returns it), on its natural input's shape: RoPE, sinusoidal and
/// learned on `(B, T, D)`/`(B, H, T, D)`, ALiBi, T5 and the clipped bias on logits
/// `(B, H, Tq, Tk)`, the block on `(B, T, d_model)`. (The bias modules took integer logits and
/// rounded their bias away, ALiBi's slopes to 0; an outside probe found it.)
fn modules_refuse_integer_inputs(dev: &Device) -> anyhow::Result<()> {
    use candle_core::Module;
    let vb = VarBuilder::zeros(DType::F32, dev);
    let heads = 2;
    let modules: Vec<(&str, Box<dyn Module>, Vec<usize>)> = vec![
        (
            "rope",
            Box::new(RotaryEmbedding::new(&RopeConfig::new(8), dev)?),
            vec![1, heads, 3, 8],
        ),
        (
            "sinusoidal",
            Box::new(SinusoidalPositionalEncoding::new(
                &SinusoidalConfig::new(8),
                dev,
            )?),
            vec![1, 3, 8],
        ),
        (
            "learned",
            Box::new(LearnedPositionalEncoding::new(
                &LearnedConfig::new(8),
                vb.pp("l"),
            )?),
            vec![1, 3, 8],
        ),
        (
            "alibi",
            Box::new(Alibi::new(&AlibiConfig::new(heads), dev)?),
            vec![1, heads, 3, 3],
        ),
        (
            "t5",
            Box::new(T5RelativeBias::new(&T5Config::new(heads), vb.pp("t"))?),
            vec![1, heads, 3, 3],
        ),
        (
            "clipped",
            Box::new(ClippedRelativeBias::new(
                &ClippedBiasConfig::new(heads, 2),
                vb.pp("c"),
            )?),
            vec![1, heads, 2, 3],
        ),
        (
            "attention",
            Box::new(MultiHeadAttention::new(
                &AttentionConfig::new(8, heads),
                None,
                vb.pp("a"),
            )?),
            vec![1, 3, 8],
        ),
    ];
    for (name, module, dims) in &modules {
        for dtype in [DType::U8, DType::U32, DType::I64] {
            let x = Tensor::ones(dims.as_slice(), dtype, dev)?;
            // (candle's wrapper keeps only the error's text.)
            match module.forward(&x) {
                Err(candle_core::Error::Wrapped(e)) => {
                    let text = e.to_string();
                    let want = format!("has dtype {dtype:?}, expected ");
                    assert!(text.contains(&want), "{name} on {dtype:?}: {text}");
                }
                other => panic!("{name} on {dtype:?}: {other:?}"),
            }
        }
        // The same shape in f32 is accepted.
        let x = Tensor::ones(dims.as_slice(), DType::F32, dev)?;
        assert_eq!(module.forward(&x)?.dims(), dims.as_slice(), "{name}");
    }
    Ok(())
}

/// A streaming cache moves tokens to new slots as it evicts: a block whose encoding adds
/// positions to the input (sinusoidal, learned) refuses it, leaving the cache as it was, and
/// every other encoding runs with it. (The input encodings kept each token at the slot it
/// arrived at, and every token past the window arrived at the same one; an outside probe found
/// it.)
fn streaming_cache_refuses_input_encodings(dev: &Device) -> anyhow::Result<()> {
    let (d_model, heads) = (16, 4);
    let attn = AttentionConfig::new(d_model, heads).with_causal(true);
    for (i, config) in zoo::configs(d_model, heads, d_model / heads)
        .iter()
        .enumerate()
    {
        let (mha, _vars) = zoo::attention(config, &attn, DType::F32, dev)?;
        let mut cache = KvCache::streaming(1, 2);
        let x = common::randn(0f32, 1.0, (1, 1, d_model), dev)?;
        let what = zoo::label(i, config);
        let input = matches!(
            config,
            EncodingConfig::Sinusoidal(_)
                | EncodingConfig::Learned(_)
                | EncodingConfig::ScaledSinusoidal(_)
        );
        for _ in 0..5 {
            match mha.forward_with(&x, &AttentionOptions::default(), Some(&mut cache)) {
                Err(Error::InvalidConfig { name, .. }) if input => {
                    assert_eq!(name, "KV cache", "{what}");
                    assert!(cache.is_empty(), "{what}");
                }
                Ok(out) if !input => assert_eq!(out.output.dims(), &[1, 1, d_model], "{what}"),
                other => panic!("{what}: {other:?}"),
            }
        }
        if !input {
            assert_eq!(cache.len(), 3, "{what}");
        }
    }
    Ok(())
}

/// Latent attention pads its values to the head width with zeros and cuts the padding before
/// the output projection, so a value term (Shaw's, a custom encoding's) on a block whose
/// `v_head_dim` is narrower than its heads is refused on every path, leaving a cache as it
/// was; Shaw's keys alone run. (A table of the heads' width was accepted and its last columns
/// silently dropped; an outside probe found it.)
fn value_terms_need_full_width_values(dev: &Device) -> anyhow::Result<()> {
    let latent = AttentionConfig::new(32, 4)
        .with_causal(true)
        .with_latent(Some(LatentConfig::new(Some(12), 10, 4, 6)));
    let x = common::randn(0f32, 1.0, (2, 5, 32), dev)?;
    for values in [true, false] {
        let shaw = EncodingConfig::Shaw(ShawConfig::new(8, 2).with_values(values));
        let (frozen, varmap) = zoo::attention(&shaw, &latent, DType::F32, dev)?;
        let vb = common::seeded_vb(&varmap, DType::F32, dev);
        let tracked = MultiHeadAttention::new(&latent, shaw.build(vb.pp("enc"))?, vb.pp("attn"))?;
        for (train, return_weights) in [(false, false), (false, true), (true, false)] {
            let opts = AttentionOptions {
                train,
                return_weights,
                ..Default::default()
            };
            for mha in [&frozen, &tracked] {
                let mut cache = KvCache::new();
                let what = format!("values {values} train {train} weights {return_weights}");
                match mha.forward_with(&x, &opts, Some(&mut cache)) {
                    Err(Error::Shape { what: name, .. }) if values => {
                        assert_eq!(name, "relative value table", "{what}");
                        assert!(cache.is_empty(), "{what}");
                    }
                    Ok(out) if !values => assert_eq!(out.output.dims(), &[2, 5, 32], "{what}"),
                    other => panic!("{what}: {other:?}"),
                }
            }
        }
    }
    Ok(())
}

device_tests!(
    half_precision_rotations_stay_in_range,
    empty_batches_of_huge_chunks,
    mrope_positions_bound_their_work,
    hooks_may_answer_strided_views,
    empty_batch_gives_empty_outputs,
    position_ids_past_u32,
    masks_of_the_wrong_kind,
    one_dtype_rule_for_every_table,
    t5_buckets_at_the_ends_of_i64,
    bucket_methods_check_their_configuration,
    configurations_that_cannot_give_finite_output,
    inputs_in_any_layout,
    modules_refuse_integer_inputs,
    streaming_cache_refuses_input_encodings,
    value_terms_need_full_width_values
);
