//! Property tests (proptest) over random batch, heads, head widths, lengths, offsets and dtypes,
//! for every encoding of the crate (see `common::zoo`):
//!
//! - KV-cache decoding, in random chunks, equals one forward pass over the whole sequence;
//! - explicit position ids equal to an offset range give the same output as the offset;
//! - rotary embeddings preserve norms (up to the attention factor) and `q·k` depends only on
//!   `m − n`;
//! - the bias encodings depend only on `j − i` (translation invariance).
//!
//! Case counts are bounded (24–64 per property) so the file runs in seconds in a debug build.
//!
//! Tolerances: f32 paths agree to 1e-5 absolute on O(1) values (the two sides differ only in
//! matmul blocking and summation order, a few ulps of f32 each); f64 runs use 1e-9 (their cos/sin
//! tables are still f32, shared by both sides, so only the f64 arithmetic differs).

use crate::common;

use candle_core::{DType, Device, Tensor};
use candle_posenc::{
    Alibi, AlibiConfig, AlibiMode, AttentionConfig, AttentionContext, AttentionOptions,
    ClippedBiasConfig, ClippedRelativeBias, KvCache, PositionIds, PositionalEncoding, Positions,
    QkLayout, RopeConfig, RopeLayout, RopeScaling, RotaryEmbedding, ShawConfig,
    ShawRelativePosition, T5Config, T5RelativeBias, YarnScaling,
};
use common::{max_abs_diff, zoo};
use proptest::prelude::*;

/// Attention shapes: batch, heads, KV heads (a divisor), head width, d_model.
#[derive(Debug, Clone)]
struct Shapes {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    d_model: usize,
}

fn shapes() -> impl Strategy<Value = Shapes> {
    (
        1..=2usize,
        prop::sample::select(vec![1usize, 2, 4]),
        0..3usize,
        2..=4usize,
        2..=5usize,
    )
        .prop_map(|(batch, heads, kv_pick, hd_half, dm_half)| {
            let divisors: Vec<usize> = (1..=heads).filter(|d| heads % d == 0).collect();
            Shapes {
                batch,
                heads,
                kv_heads: divisors[kv_pick % divisors.len()],
                head_dim: 2 * hd_half,
                d_model: 2 * dm_half,
            }
        })
}

/// A dtype and its tolerance relative to the largest output (at least that much absolute).
/// The random weights make outputs of 10–25; chunked and whole passes sum in different orders
/// (the matrix kernels are chosen per shape), which in f32 moved outputs by up to 7e-7 of the
/// largest.
fn dtype_and_tol() -> impl Strategy<Value = (DType, f64)> {
    prop::sample::select(vec![(DType::F32, 2e-6), (DType::F64, 1e-12)])
}

/// `tol` times the largest output, at least `tol`.
fn scaled(tol: f64, t: &Tensor) -> anyhow::Result<f64> {
    Ok(tol
        * t.abs()?
            .max_all()?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()?
            .max(1.0))
}

fn attn_config(s: &Shapes) -> AttentionConfig {
    AttentionConfig::new(s.d_model, s.heads)
        .with_kv_heads(s.kv_heads)
        .with_head_dim(s.head_dim)
        .with_causal(true)
}

fn input(s: &Shapes, len: usize, dtype: DType) -> anyhow::Result<Tensor> {
    Ok(common::randn(0f32, 1.0, (s.batch, len, s.d_model), &Device::Cpu)?.to_dtype(dtype)?)
}

/// Chunk lengths: a random split of `len` into 1 to 4 pieces (single tokens included).
fn split(len: usize, cuts: &[usize]) -> Vec<usize> {
    let mut points: Vec<usize> = cuts.iter().map(|c| c % len).filter(|&c| c > 0).collect();
    points.sort_unstable();
    points.dedup();
    let mut out = Vec::new();
    let mut prev = 0;
    for p in points.into_iter().chain([len]) {
        out.push(p - prev);
        prev = p;
    }
    out
}

fn kv_cache_case(
    s: &Shapes,
    (dtype, tol): (DType, f64),
    len: usize,
    start: usize,
    cuts: &[usize],
) -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let x = input(s, len, dtype)?;
    for (i, config) in zoo::configs(s.d_model, s.heads, s.head_dim)
        .iter()
        .enumerate()
    {
        let (mha, _) = zoo::attention(config, &attn_config(s), dtype, &dev)?;
        let at = Positions::Offset(start);
        let full = mha.forward_with(
            &x,
            &AttentionOptions {
                positions: Some(&at),
                ..Default::default()
            },
            None,
        )?;
        let mut cache = KvCache::with_capacity(2);
        let mut pieces = Vec::new();
        let mut done = 0;
        for n in split(len, cuts) {
            let p = Positions::Offset(start + done);
            let o = AttentionOptions {
                positions: Some(&p),
                ..Default::default()
            };
            pieces.push(
                mha.forward_with(&x.narrow(1, done, n)?, &o, Some(&mut cache))?
                    .output,
            );
            done += n;
        }
        let stepped = Tensor::cat(&pieces, 1)?;
        let d = max_abs_diff(&full.output, &stepped)?;
        anyhow::ensure!(
            d <= scaled(tol, &full.output)?,
            "{}: cached vs full differ by {d:e} ({s:?}, {dtype:?})",
            zoo::label(i, config)
        );
    }
    Ok(())
}

fn ids_case(
    s: &Shapes,
    (dtype, tol): (DType, f64),
    len: usize,
    start: usize,
    shared: bool,
) -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let x = input(s, len, dtype)?;
    let row: Vec<u32> = (start as u32..(start + len) as u32).collect();
    let rows = vec![row; if shared { 1 } else { s.batch }];
    let ids = Positions::Ids(PositionIds::from_rows(&rows, &dev)?);
    let off = Positions::Offset(start);
    for (i, config) in zoo::configs(s.d_model, s.heads, s.head_dim)
        .iter()
        .enumerate()
    {
        let (mha, _) = zoo::attention(config, &attn_config(s), dtype, &dev)?;
        let run = |p: &Positions| {
            mha.forward_with(
                &x,
                &AttentionOptions {
                    positions: Some(p),
                    ..Default::default()
                },
                None,
            )
        };
        let by_offset = run(&off)?.output;
        let d = max_abs_diff(&by_offset, &run(&ids)?.output)?;
        anyhow::ensure!(
            d <= scaled(tol, &by_offset)?,
            "{}: ids vs offset differ by {d:e} ({s:?})",
            zoo::label(i, config)
        );
    }
    Ok(())
}

fn rope_config() -> impl Strategy<Value = RopeConfig> {
    let scaling = prop_oneof![
        Just(RopeScaling::None),
        (1.0..8.0f64).prop_map(|factor| RopeScaling::Linear { factor }),
        (1.0..8.0f64).prop_map(|alpha| RopeScaling::NtkAware { alpha }),
        (1.5..8.0f64).prop_map(|f| RopeScaling::Yarn(YarnScaling::new(f, 256))),
        Just(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 256,
        }),
    ];
    (
        2..=8usize,
        0..3usize,
        any::<bool>(),
        prop::sample::select(vec![100.0, 10_000.0, 500_000.0]),
        scaling,
    )
        .prop_map(|(half, cut, interleaved, base, scaling)| {
            let head_dim = 2 * half;
            let rotary_dim = (head_dim - 2 * cut).max(4); // NTK needs rotary_dim > 2
            let layout = if interleaved {
                RopeLayout::Interleaved
            } else {
                RopeLayout::Half
            };
            RopeConfig::new(head_dim)
                .with_rotary_dim(rotary_dim)
                .with_layout(layout)
                .with_base(base)
                .with_scaling(scaling)
        })
}

fn norms(x: &Tensor) -> anyhow::Result<Vec<f32>> {
    Ok(x.sqr()?.sum(3)?.sqrt()?.flatten_all()?.to_vec1::<f32>()?)
}

fn rope_case(
    config: &RopeConfig,
    m: usize,
    n: usize,
    shift: usize,
    heads: usize,
) -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let rope = RotaryEmbedding::new(config, &dev)?;
    let q = common::randn(0f32, 1.0, (1, heads, 1, config.head_dim), &dev)?;
    let k = common::randn(0f32, 1.0, (1, heads, 1, config.head_dim), &dev)?;
    let dot = |m: usize, n: usize| -> anyhow::Result<Vec<f32>> {
        let (rq, rk) = rope.rotate_queries_keys(
            &q,
            &k,
            &Positions::Offset(m),
            &Positions::Offset(n),
            QkLayout::Bhtd,
        )?;
        Ok((rq * rk)?.sum(3)?.flatten_all()?.to_vec1::<f32>()?)
    };
    // Norms: rotation is orthogonal; cos and sin carry the attention factor (YaRN), which only
    // scales the rotated features.
    let af = rope.frequencies(m + 1)?.attention_factor as f32;
    let rq = rope.rotate_queries(&q, &Positions::Offset(m), QkLayout::Bhtd)?;
    let (rot, pass) = (config.rotary_dim, config.head_dim - config.rotary_dim);
    let want: Vec<f32> = norms(&q.narrow(3, 0, rot)?)?
        .iter()
        .map(|v| v * af)
        .collect();
    for (a, b) in norms(&rq.narrow(3, 0, rot)?)?.iter().zip(&want) {
        anyhow::ensure!(
            (a - b).abs() <= 1e-5 * b.max(1.0),
            "norm {a} vs {b} ({config:?}, m = {m})"
        );
    }
    if pass > 0 {
        let (a, b) = (rq.narrow(3, rot, pass)?, q.narrow(3, rot, pass)?);
        anyhow::ensure!(
            max_abs_diff(&a, &b)? == 0.0,
            "pass-through features changed"
        );
    }
    // q·k at (m, n) and at (m + s, n + s). Angles up to ~10^5 rad stored as f32 cos/sin
    // (relative error ~6e-8 each); a dot product over ≤ 16 features of O(1) values stays
    // within 2e-5 of the shifted one, the tolerance used here.
    let (a, b) = (dot(m, n)?, dot(m + shift, n + shift)?);
    for (x, y) in a.iter().zip(&b) {
        anyhow::ensure!(
            (x - y).abs() <= 2e-5 * (1.0 + x.abs()),
            "q·k {x} vs {y} ({config:?}, m = {m}, n = {n}, shift = {shift})"
        );
    }
    Ok(())
}

/// Every bias encoding of the crate, with random tables.
fn bias_encodings(
    heads: usize,
    head_dim: usize,
) -> anyhow::Result<Vec<(String, Box<dyn PositionalEncoding>)>> {
    let dev = Device::Cpu;
    let varmap = candle_nn::VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, &dev);
    let mut out: Vec<(String, Box<dyn PositionalEncoding>)> = Vec::new();
    for mode in [
        AlibiMode::Causal,
        AlibiMode::CausalPairwise,
        AlibiMode::Symmetric,
    ] {
        out.push((
            format!("alibi {mode:?}"),
            Box::new(Alibi::new(&AlibiConfig::new(heads).with_mode(mode), &dev)?),
        ));
    }
    for bidi in [false, true] {
        let c = T5Config::new(heads).with_bidirectional(bidi);
        out.push((
            format!("t5 bidirectional={bidi}"),
            Box::new(T5RelativeBias::new(&c, vb.pp(format!("t5{bidi}")))?),
        ));
    }
    out.push((
        "clipped".into(),
        Box::new(ClippedRelativeBias::new(
            &ClippedBiasConfig::new(heads, 5),
            vb.pp("clip"),
        )?),
    ));
    out.push((
        "shaw".into(),
        Box::new(ShawRelativePosition::new(
            &ShawConfig::new(head_dim, 5),
            vb.pp("shaw"),
        )?),
    ));
    for var in common::sorted_vars(&varmap) {
        var.set(&common::randn(0f32, 1.0, var.shape(), &dev)?)?;
    }
    Ok(out)
}

fn bias_case(
    heads: usize,
    tq: usize,
    tk: usize,
    q0: usize,
    k0: usize,
    shift: usize,
) -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let head_dim = 4;
    // The same query vector at every row, so Shaw's q-dependent bias is comparable across rows.
    let q = common::randn(0f32, 1.0, (1, heads, 1, head_dim), &dev)?.repeat((1, 1, tq, 1))?;
    let ids = |s: usize, n: usize| -> anyhow::Result<Positions> {
        Ok(Positions::Ids(PositionIds::from_rows(
            &[(s as u32..(s + n) as u32).collect()],
            &dev,
        )?))
    };
    for (name, enc) in bias_encodings(heads, head_dim)? {
        let bias = |qp: &Positions, kp: &Positions| -> anyhow::Result<Tensor> {
            let ctx = AttentionContext::new(qp, tq, kp, tk);
            let b = enc.logits_bias(&q, &ctx)?.expect("a bias encoding");
            Ok(b.to_dense(tq, tk)?
                .broadcast_as((1, heads, tq, tk))?
                .to_dtype(DType::F32)?)
        };
        let base = bias(&Positions::Offset(q0), &Positions::Offset(k0))?;
        let shifted = bias(
            &Positions::Offset(q0 + shift),
            &Positions::Offset(k0 + shift),
        )?;
        let by_ids = bias(&ids(q0 + shift, tq)?, &ids(k0 + shift, tk)?)?;
        // ALiBi's causal form adds a per-row constant (softmax-invariant), so compare rows
        // after removing each row's first entry; the others compare as they are.
        let norm = |b: &Tensor| -> anyhow::Result<Tensor> {
            if name == "alibi Causal" {
                Ok(b.broadcast_sub(&b.narrow(3, 0, 1)?)?)
            } else {
                Ok(b.clone())
            }
        };
        let (base, shifted, by_ids) = (norm(&base)?, norm(&shifted)?, norm(&by_ids)?);
        // Integer distances index the same table rows (T5, clipped, Shaw) or give exactly
        // representable products (ALiBi): 1e-5 covers f32 rounding of slope · distance.
        anyhow::ensure!(
            max_abs_diff(&base, &shifted)? <= 1e-5,
            "{name}: shifted offsets differ"
        );
        anyhow::ensure!(
            max_abs_diff(&base, &by_ids)? <= 1e-5,
            "{name}: shifted ids differ"
        );
        // Within one bias, entry (i, j) depends on j − i only: (i, j) equals (i + 1, j + 1).
        if tq > 1 && tk > 1 {
            let a = base.narrow(2, 0, tq - 1)?.narrow(3, 0, tk - 1)?;
            let b = base.narrow(2, 1, tq - 1)?.narrow(3, 1, tk - 1)?;
            if name != "alibi Causal" {
                anyhow::ensure!(
                    max_abs_diff(&a, &b)? <= 1e-5,
                    "{name}: not a function of j − i"
                );
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(common::proptest_config(24))]

    /// KV-cache decoding in random chunks equals the full forward pass, for every encoding.
    #[test]
    fn kv_cache_decoding_equals_full_forward(
        s in shapes(), dt in dtype_and_tol(), len in 1..10usize, start in 0..1000usize,
        cuts in prop::collection::vec(0..100usize, 0..4),
    ) {
        kv_cache_case(&s, dt, len, start, &cuts).map_err(|e| TestCaseError::fail(e.to_string()))?;
    }

    /// Position ids `s..s + T` (per sequence or shared) equal the offset `s`, for every encoding.
    #[test]
    fn ids_of_an_offset_range_equal_the_offset(
        s in shapes(), dt in dtype_and_tol(), len in 1..10usize, start in 0..1000usize, shared in any::<bool>(),
    ) {
        ids_case(&s, dt, len, start, shared).map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
}

proptest! {
    #![proptest_config(common::proptest_config(64))]

    /// Rotations preserve norms and make `q·k` a function of `m − n`.
    #[test]
    fn rotary_preserves_norms_and_relative_dot_products(
        config in rope_config(), m in 0..100_000usize, n in 0..100_000usize, shift in 0..100_000usize, heads in 1..3usize,
    ) {
        rope_case(&config, m, n, shift, heads).map_err(|e| TestCaseError::fail(e.to_string()))?;
    }

    /// Bias encodings are translation invariant and depend on `j − i` only.
    #[test]
    fn biases_depend_only_on_relative_distance(
        heads in 1..4usize, tq in 1..8usize, tk in 1..8usize, q0 in 0..500usize, k0 in 0..500usize, shift in 0..100_000usize,
    ) {
        bias_case(heads, tq, tk, q0, k0, shift).map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
}
