//! The attention block and its plug: parity with PyTorch's `scaled_dot_product_attention`,
//! every hook exercised by small test encodings, masks, grouped heads, the KV cache.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, IndexOp, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_posenc::attention::{AttentionTemperature, LatentConfig, QkNormConfig};
use candle_posenc::plug::{
    AttentionContext, Columns, LogitsBias, PositionalEncoding, RelativeValues,
};
use candle_posenc::relative::alibi::{Alibi, AlibiConfig, AlibiMode};
use candle_posenc::rotary::{
    LongRopeScaling, RopeConfig, RopeLayout, RopeScaling, RotaryEmbedding, YarnScaling,
};
use candle_posenc::{
    AttentionConfig, AttentionOptions, Error, KvCache, LearnedConfig, LearnedPositionalEncoding,
    MultiHeadAttention, PositionIds, Positions, Result, SinusoidalConfig,
    SinusoidalPositionalEncoding,
};
use common::{assert_close, assert_close_scaled, fixture, get, prefixed};

/// Test encoding for the three hooks the foundation encodings do not use, with the formulas the
/// fixture script gives PyTorch:
/// - rotation: rotate-half by `pos · 10000^(−2i/D)` (the seeds' RoPE);
/// - bias: `−2^−(h+1) · |j − i|`;
/// - value term: `Σ_j α_ij a[clamp(j − i, −2, 2) + 2]`, `a = arange(5·D).view(5, D) / 10`.
#[derive(Debug)]
struct HookProbe {
    num_heads: usize,
    head_dim: usize,
    device: Device,
}

impl HookProbe {
    fn rotate(&self, x: &Tensor, positions: &Positions) -> Result<Tensor> {
        let (_, _, t, d) = x.dims4()?;
        let half = d / 2;
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| 1.0 / 10000f32.powf(i as f32 / half as f32))
            .collect();
        let inv_freq = Tensor::new(inv_freq.as_slice(), x.device())?;
        let pos = positions.to_ids(t, x.device())?.to_dtype(DType::F32)?; // (B|1, T)
        let ang = pos
            .unsqueeze(2)?
            .broadcast_mul(&inv_freq.reshape((1, 1, half))?)?
            .unsqueeze(1)?;
        let (cos, sin) = (ang.cos()?, ang.sin()?);
        let x1 = x.narrow(3, 0, half)?;
        let x2 = x.narrow(3, half, half)?;
        let r1 = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
        let r2 = (x1.broadcast_mul(&sin)? + x2.broadcast_mul(&cos)?)?;
        Ok(Tensor::cat(&[r1, r2], 3)?)
    }
}

impl PositionalEncoding for HookProbe {
    fn rotate(&self, q: Tensor, k: Tensor, ctx: &AttentionContext) -> Result<(Tensor, Tensor)> {
        Ok((self.rotate(&q, ctx.queries)?, self.rotate(&k, ctx.keys)?))
    }

    /// A dense bias (the distances in f32: candle's CUDA kernels have no integer `abs`).
    fn logits_bias(&self, q: &Tensor, ctx: &AttentionContext) -> Result<Option<LogitsBias>> {
        let dist =
            Positions::relative_distances(ctx.queries, ctx.q_len, ctx.keys, ctx.k_len, q.device())?;
        let slopes: Vec<f32> = (0..self.num_heads)
            .map(|h| -(2f32.powi(-(h as i32 + 1))))
            .collect();
        let slopes =
            Tensor::new(slopes.as_slice(), q.device())?.reshape((1, self.num_heads, 1, 1))?;
        let dist = dist.to_dtype(DType::F32)?.abs()?.unsqueeze(1)?;
        Ok(Some(LogitsBias::Dense(dist.broadcast_mul(&slopes)?)))
    }

    /// The table's rows at `clamp(j − i, −2, 2) + 2`, as a column map for every position form.
    fn value_term(&self, ctx: &AttentionContext) -> Result<Option<RelativeValues>> {
        let device = &self.device;
        let dist =
            Positions::relative_distances(ctx.queries, ctx.q_len, ctx.keys, ctx.k_len, device)?;
        let idx = (dist.to_dtype(DType::F32)?.clamp(-2f32, 2f32)? + 2.0)?.to_dtype(DType::U32)?;
        let a = (Tensor::arange(0f32, (5 * self.head_dim) as f32, device)?
            .reshape((5, self.head_dim))?
            / 10.0)?;
        Ok(Some(RelativeValues::new(a, Columns::Index(idx))?))
    }
}

const D_MODEL: usize = 16;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 4;

fn block(
    fx: &HashMap<String, Tensor>,
    case: &str,
    cfg: &AttentionConfig,
    enc: Option<Arc<dyn PositionalEncoding>>,
    dev: &Device,
) -> anyhow::Result<MultiHeadAttention> {
    let vb = VarBuilder::from_tensors(prefixed(fx, &format!("{case}.")), DType::F32, dev);
    Ok(MultiHeadAttention::new(cfg, enc, vb)?)
}

fn base_cfg() -> AttentionConfig {
    AttentionConfig::new(D_MODEL, HEADS).with_kv_heads(KV_HEADS)
}

fn with_weights() -> AttentionOptions<'static> {
    AttentionOptions {
        return_weights: true,
        ..Default::default()
    }
}

/// f32 parity after two projections, a softmax and two more products: 1e-5.
const TOL: f64 = 1e-5;

fn parity_plain(dev: &Device) -> anyhow::Result<()> {
    let fx = fixture("attention.safetensors", dev)?;
    let mha = block(&fx, "plain", &base_cfg(), None, dev)?;
    let out = mha.forward_with(get(&fx, "x"), &with_weights(), None)?;
    assert_close(&out.output, get(&fx, "plain.out"), TOL, "plain out")?;
    assert_close(
        out.weights.as_ref().expect("weights"),
        get(&fx, "plain.probs"),
        TOL,
        "plain probs",
    )?;
    Ok(())
}

fn parity_sinusoidal_causal_bias(dev: &Device) -> anyhow::Result<()> {
    let fx = fixture("attention.safetensors", dev)?;
    let pe = SinusoidalPositionalEncoding::new(&SinusoidalConfig::new(D_MODEL), dev)?;
    let cfg = base_cfg().with_bias(true).with_causal(true);
    let mha = block(&fx, "sinusoidal", &cfg, Some(Arc::new(pe)), dev)?;
    let out = mha.forward_with(get(&fx, "x"), &with_weights(), None)?;
    assert_close(
        &out.output,
        get(&fx, "sinusoidal.out"),
        TOL,
        "sinusoidal out",
    )?;
    assert_close(
        out.weights.as_ref().expect("weights"),
        get(&fx, "sinusoidal.probs"),
        TOL,
        "probs",
    )?;
    Ok(())
}

fn parity_learned_padding(dev: &Device) -> anyhow::Result<()> {
    let fx = fixture("attention.safetensors", dev)?;
    let pe = LearnedPositionalEncoding::from_table(
        &LearnedConfig::new(D_MODEL).with_max_len(10),
        get(&fx, "learned.table").clone(),
    )?;
    let mha = block(&fx, "learned", &base_cfg(), Some(Arc::new(pe)), dev)?;
    let pad = get(&fx, "learned.padding");
    let opts = AttentionOptions {
        padding_mask: Some(pad),
        return_weights: true,
        ..Default::default()
    };
    let out = mha.forward_with(get(&fx, "x"), &opts, None)?;
    assert_close(&out.output, get(&fx, "learned.out"), TOL, "learned out")?;
    assert_close(
        out.weights.as_ref().expect("weights"),
        get(&fx, "learned.probs"),
        TOL,
        "probs",
    )?;
    Ok(())
}

fn parity_rotation_bias_value_hooks(dev: &Device) -> anyhow::Result<()> {
    let fx = fixture("attention.safetensors", dev)?;
    let probe = HookProbe {
        num_heads: HEADS,
        head_dim: HEAD_DIM,
        device: dev.clone(),
    };
    let mha = block(
        &fx,
        "hooks",
        &base_cfg().with_causal(true),
        Some(Arc::new(probe)),
        dev,
    )?;
    let out = mha.forward_with(get(&fx, "x"), &with_weights(), None)?;
    assert_close(&out.output, get(&fx, "hooks.out"), TOL, "hooks out")?;
    assert_close(
        out.weights.as_ref().expect("weights"),
        get(&fx, "hooks.probs"),
        TOL,
        "probs",
    )?;
    Ok(())
}

type NamedEncoding = (&'static str, Option<Arc<dyn PositionalEncoding>>);

/// Every encoding kind, in a fresh random block.
fn encodings(dev: &Device) -> anyhow::Result<Vec<NamedEncoding>> {
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let learned = LearnedPositionalEncoding::new(
        &LearnedConfig::new(D_MODEL).with_max_len(32),
        vb.pp("wpe"),
    )?;
    // Make the learned table large enough to matter.
    let learned =
        LearnedPositionalEncoding::from_table(learned.config(), (learned.weight() * 50.0)?)?;
    Ok(vec![
        ("none", None),
        (
            "sinusoidal",
            Some(Arc::new(SinusoidalPositionalEncoding::new(
                &SinusoidalConfig::new(D_MODEL),
                dev,
            )?)),
        ),
        ("learned", Some(Arc::new(learned))),
        (
            "hooks",
            Some(Arc::new(HookProbe {
                num_heads: HEADS,
                head_dim: HEAD_DIM,
                device: dev.clone(),
            })),
        ),
    ])
}

fn random_block(
    enc: Option<Arc<dyn PositionalEncoding>>,
    causal: bool,
    dev: &Device,
) -> anyhow::Result<MultiHeadAttention> {
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    Ok(MultiHeadAttention::new(
        &base_cfg().with_causal(causal).with_bias(true),
        enc,
        vb,
    )?)
}

/// Clones of a cache are independent: after a shared prompt, each branch continues with its
/// own tokens (in chunks that make both grow their storage), and every branch's outputs equal
/// those of a cache that only ever saw that branch; the original is untouched by its clones.
fn kv_cache_clones_are_independent(dev: &Device) -> anyhow::Result<()> {
    for (name, enc) in encodings(dev)? {
        let mha = random_block(enc, true, dev)?;
        branch_and_compare(&mha, dev).map_err(|e| e.context(name))?;
    }
    Ok(())
}

fn branch_and_compare(mha: &MultiHeadAttention, dev: &Device) -> anyhow::Result<()> {
    let opts = AttentionOptions::default();
    let prompt = common::randn(0f32, 1.0, (2, 3, D_MODEL), dev)?;
    let branches: Vec<Tensor> = (0..3)
        .map(|_| common::randn(0f32, 1.0, (2, 6, D_MODEL), dev))
        .collect::<candle_core::Result<_>>()?;
    let mut root = KvCache::with_capacity(4);
    mha.forward_with(&prompt, &opts, Some(&mut root))?;
    let mut clones: Vec<KvCache> = branches.iter().map(|_| root.clone()).collect();
    // Interleaved appends: each clone writes after the others have.
    let mut outs = vec![Vec::new(); branches.len()];
    for (start, len) in [(0, 1), (1, 2), (3, 3)] {
        for ((cache, tokens), out) in clones.iter_mut().zip(&branches).zip(&mut outs) {
            let chunk = tokens.narrow(1, start, len)?;
            out.push(mha.forward_with(&chunk, &opts, Some(cache))?.output);
        }
    }
    for (i, (tokens, out)) in branches.iter().zip(&outs).enumerate() {
        let mut alone = KvCache::with_capacity(4);
        mha.forward_with(&prompt, &opts, Some(&mut alone))?;
        let want = mha.forward_with(tokens, &opts, Some(&mut alone))?.output;
        assert_close(&Tensor::cat(out, 1)?, &want, 1e-5, &format!("branch {i}"))?;
    }
    assert_eq!(root.len(), 3);
    let next = common::randn(0f32, 1.0, (2, 1, D_MODEL), dev)?;
    let mut fresh = KvCache::new();
    mha.forward_with(&prompt, &opts, Some(&mut fresh))?;
    let want = mha.forward_with(&next, &opts, Some(&mut fresh))?.output;
    let got = mha.forward_with(&next, &opts, Some(&mut root))?.output;
    assert_close(&got, &want, 1e-5, "the original after its clones wrote")?;
    Ok(())
}

/// Truncating a cache undoes appends: decoding after a truncation equals decoding from a cache
/// that never saw the dropped tokens, with offsets and with explicit ids, for every encoding;
/// keeping more than the cache holds is a typed error.
fn kv_cache_truncates(dev: &Device) -> anyhow::Result<()> {
    let x = common::randn(0f32, 1.0, (1, 6, D_MODEL), dev)?;
    let ids = |v: &[u32]| -> anyhow::Result<Positions> {
        Ok(Positions::ids(&Tensor::new(v, dev)?.unsqueeze(0)?)?)
    };
    let (first, kept, next) = (ids(&[0, 1, 2, 3])?, ids(&[0, 1])?, ids(&[5, 6])?);
    for (name, enc) in encodings(dev)? {
        let mha = random_block(enc, true, dev)?;
        for explicit in [false, true] {
            let run =
                |cache: &mut KvCache, start: usize, len: usize, p| -> anyhow::Result<Tensor> {
                    let o = AttentionOptions {
                        positions: if explicit { Some(p) } else { None },
                        ..Default::default()
                    };
                    Ok(mha
                        .forward_with(&x.narrow(1, start, len)?, &o, Some(cache))?
                        .output)
                };
            let mut cache = KvCache::new();
            run(&mut cache, 0, 4, &first)?;
            cache.truncate(2)?;
            assert_eq!(cache.len(), 2);
            let got = run(&mut cache, 4, 2, &next)?;
            let mut fresh = KvCache::new();
            run(&mut fresh, 0, 2, &kept)?;
            let want = run(&mut fresh, 4, 2, &next)?;
            assert_close(&got, &want, 1e-5, &format!("{name} ids {explicit}"))?;
            assert!(matches!(
                cache.truncate(5),
                Err(Error::InvalidConfig { .. })
            ));
        }
    }
    Ok(())
}

/// A cache filled by an f32 block refuses the chunks of an f64 block with a typed error, and
/// takes them once emptied.
fn kv_cache_refuses_another_dtype(dev: &Device) -> anyhow::Result<()> {
    let cfg = base_cfg().with_causal(true);
    let vb = |dtype| {
        let varmap = VarMap::new();
        MultiHeadAttention::new(&cfg, None, common::seeded_vb(&varmap, dtype, dev))
    };
    let (f32_block, f64_block) = (vb(DType::F32)?, vb(DType::F64)?);
    let opts = AttentionOptions::default();
    let mut cache = KvCache::new();
    let x = common::randn(0f32, 1.0, (1, 2, D_MODEL), dev)?;
    f32_block.forward_with(&x, &opts, Some(&mut cache))?;
    let err = f64_block
        .forward_with(&x.to_dtype(DType::F64)?, &opts, Some(&mut cache))
        .unwrap_err();
    assert!(matches!(err, Error::InvalidConfig { .. }), "{err}");
    assert_eq!(cache.len(), 2);
    // An empty cache takes any chunk, whatever its storage held before: truncated to nothing
    // (found by the api fuzz target: it still asked for the old batch) or reset.
    cache.truncate(0)?;
    let x64 = common::randn(0f64, 1.0, (3, 2, D_MODEL), dev)?;
    let fresh = f64_block.forward_with(&x64, &opts, Some(&mut KvCache::new()))?;
    let reused = f64_block.forward_with(&x64, &opts, Some(&mut cache))?;
    assert_close(
        &reused.output,
        &fresh.output,
        0.0,
        "an emptied cache is a new one",
    )?;
    assert_eq!((cache.len(), cache.next_position()), (2, 2));
    cache.reset();
    f32_block.forward_with(&x, &opts, Some(&mut cache))?;
    assert_eq!(cache.len(), 2);
    Ok(())
}

/// A cache belongs to the block that filled it: another block of the same shapes (the next
/// layer, or the same weights under another encoding) is refused with a typed error and leaves
/// the cache as it was, a clone of the block continues it, and an emptied cache takes any
/// block. (One cache handed to two layers appended the second layer's keys after the first's
/// and attended to both: another answer, silently.)
fn kv_cache_belongs_to_its_block(dev: &Device) -> anyhow::Result<()> {
    let (first, second) = (
        random_block(None, true, dev)?,
        random_block(None, true, dev)?,
    );
    let rotated = first
        .clone()
        .with_encoding(encodings(dev)?.pop().and_then(|(_, e)| e));
    let x = common::randn(0f32, 1.0, (1, 3, D_MODEL), dev)?;
    let opts = AttentionOptions::default();
    let mut cache = KvCache::new();
    first.forward_with(&x, &opts, Some(&mut cache))?;
    for other in [&second, &rotated] {
        let err = other.forward_with(&x, &opts, Some(&mut cache)).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidConfig { name, .. } if *name == "KV cache"),
            "{err}"
        );
        assert_eq!(cache.len(), 3);
    }
    let mut whole = KvCache::new();
    let want = first.forward_with(&Tensor::cat(&[&x, &x], 1)?, &opts, Some(&mut whole))?;
    let got = first.clone().forward_with(&x, &opts, Some(&mut cache))?;
    assert_close(&got.output, &want.output.narrow(1, 3, 3)?, 1e-5, "a clone")?;
    for emptied in [true, false] {
        match emptied {
            true => cache.truncate(0)?,
            false => cache.reset(),
        }
        second.forward_with(&x, &opts, Some(&mut cache))?;
        assert_eq!(cache.len(), 3);
    }
    Ok(())
}

fn kv_cache_decoding_matches_full_forward(dev: &Device) -> anyhow::Result<()> {
    let x = common::randn(0f32, 1.0, (2, 9, D_MODEL), dev)?;
    for (name, enc) in encodings(dev)? {
        let mha = random_block(enc, true, dev)?;
        let full = mha.forward(&x)?;
        // Token by token, then in uneven chunks.
        for chunks in [vec![1; 9], vec![2, 1, 4, 2]] {
            let mut cache = KvCache::with_capacity(4); // forces the storage to grow
            let mut outs = Vec::new();
            let mut start = 0;
            for len in chunks {
                let step = mha.forward_with(
                    &x.narrow(1, start, len)?,
                    &AttentionOptions::default(),
                    Some(&mut cache),
                )?;
                outs.push(step.output);
                start += len;
            }
            assert_eq!(cache.len(), 9);
            assert_close_scaled(
                &Tensor::cat(&outs, 1)?,
                &full,
                1e-5,
                2e-6,
                &format!("{name} decode"),
            )?;
        }
    }
    Ok(())
}

fn kv_cache_with_position_ids(dev: &Device) -> anyhow::Result<()> {
    // Left padding: sequence 0 has two pad tokens, so its real tokens sit at positions 0..5.
    let x = common::randn(0f32, 1.0, (2, 7, D_MODEL), dev)?;
    let rows = [vec![0u32, 0, 0, 1, 2, 3, 4], vec![0, 1, 2, 3, 4, 5, 6]];
    let pad = Tensor::new(&[[0u8, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]], dev)?;
    for (name, enc) in encodings(dev)? {
        let mha = random_block(enc, true, dev)?;
        let ids = Positions::from(PositionIds::from_rows(&rows, dev)?);
        let full = mha.forward_with(
            &x,
            &AttentionOptions {
                positions: Some(&ids),
                padding_mask: Some(&pad),
                ..Default::default()
            },
            None,
        )?;
        let mut cache = KvCache::new();
        let mut outs = Vec::new();
        for (t, (&p0, &p1)) in rows[0].iter().zip(&rows[1]).enumerate() {
            let step_ids = Positions::from(PositionIds::from_rows(&[vec![p0], vec![p1]], dev)?);
            let step_pad = pad.narrow(1, 0, t + 1)?;
            let opts = AttentionOptions {
                positions: Some(&step_ids),
                padding_mask: Some(&step_pad),
                ..Default::default()
            };
            outs.push(
                mha.forward_with(&x.narrow(1, t, 1)?, &opts, Some(&mut cache))?
                    .output,
            );
        }
        let decoded = Tensor::cat(&outs, 1)?;
        // Rows of real tokens match; the two fully masked pad queries are not compared.
        assert_close(
            &decoded.i((0, 2..))?,
            &full.output.i((0, 2..))?,
            1e-5,
            &format!("{name} seq 0"),
        )?;
        assert_close(
            &decoded.i(1)?,
            &full.output.i(1)?,
            1e-5,
            &format!("{name} seq 1"),
        )?;
    }
    Ok(())
}

/// Options with these positions and padding mask.
fn opts<'a>(p: Option<&'a Positions>, m: Option<&'a Tensor>) -> AttentionOptions<'a> {
    AttentionOptions {
        positions: p,
        padding_mask: m,
        ..Default::default()
    }
}

/// A chunk given an offset that is not the cache's length (a gap, or back over cached
/// positions) sits where it says: decoding equals the whole forward with those positions as
/// ids, and the chunk after it continues from them.
fn kv_cache_offsets_of_their_own(dev: &Device) -> anyhow::Result<()> {
    let x = common::randn(0f32, 1.0, (2, 7, D_MODEL), dev)?;
    for (name, enc) in encodings(dev)? {
        let mha = random_block(enc, true, dev)?;
        for (at, row) in [(9, [0u32, 1, 2, 9, 10, 11, 12]), (1, [0, 1, 2, 1, 2, 3, 4])] {
            let ids = Positions::from(PositionIds::from_rows(&[row.to_vec()], dev)?);
            let full = mha.forward_with(&x, &opts(Some(&ids), None), None)?;
            let mut cache = KvCache::new();
            let offset = Positions::Offset(at);
            let mut outs = Vec::new();
            for (start, len, positions) in [(0, 3, None), (3, 2, Some(&offset)), (5, 2, None)] {
                let part = x.narrow(1, start, len)?;
                outs.push(
                    mha.forward_with(&part, &opts(positions, None), Some(&mut cache))?
                        .output,
                );
            }
            let what = format!("{name} at {at}");
            assert_close(&Tensor::cat(&outs, 1)?, &full.output, 1e-5, &what)?;
        }
    }
    Ok(())
}

/// A call given no positions continues each sequence one past its own largest cached id: a
/// left-padded prompt (rows ending at ids 2 and 4) decoded in chunks without ids equals the
/// whole forward with every row's ids. (Every row continued at one past the largest id of the
/// batch, so the shorter rows skipped positions: silently another answer.)
fn kv_cache_continues_each_row(dev: &Device) -> anyhow::Result<()> {
    let x = common::randn(0f32, 1.0, (2, 8, D_MODEL), dev)?;
    let rows = [
        vec![0u32, 0, 0, 1, 2, 3, 4, 5],
        vec![0, 1, 2, 3, 4, 5, 6, 7],
    ];
    let pad = Tensor::new(&[[0u8, 0, 1, 1, 1, 1, 1, 1], [1; 8]], dev)?;
    let ids =
        |n: usize| PositionIds::from_rows(&[rows[0][..n].to_vec(), rows[1][..n].to_vec()], dev);
    for (name, enc) in encodings(dev)? {
        let mha = random_block(enc, true, dev)?;
        let all = Positions::from(ids(8)?);
        let full = mha.forward_with(&x, &opts(Some(&all), Some(&pad)), None)?;
        let mut cache = KvCache::new();
        let prompt = Positions::from(ids(5)?);
        let first = pad.narrow(1, 0, 5)?;
        let mut outs = vec![
            mha.forward_with(
                &x.narrow(1, 0, 5)?,
                &opts(Some(&prompt), Some(&first)),
                Some(&mut cache),
            )?
            .output,
        ];
        for (start, len) in [(5, 1), (6, 2)] {
            let seen = pad.narrow(1, 0, start + len)?;
            let part = x.narrow(1, start, len)?;
            outs.push(
                mha.forward_with(&part, &opts(None, Some(&seen)), Some(&mut cache))?
                    .output,
            );
        }
        let decoded = Tensor::cat(&outs, 1)?;
        for (row, from) in [(0, 2), (1, 0)] {
            let (got, want) = (decoded.i((row, from..))?, full.output.i((row, from..))?);
            assert_close(&got, &want, 1e-5, &format!("{name} seq {row}"))?;
        }
    }
    // Rows that end alike continue at one offset.
    let mut cache = KvCache::new();
    let mha = random_block(None, true, dev)?;
    let same = Positions::from(PositionIds::from_rows(&[vec![3, 4], vec![0, 4]], dev)?);
    let o = AttentionOptions {
        positions: Some(&same),
        ..Default::default()
    };
    mha.forward_with(&x.narrow(1, 0, 2)?, &o, Some(&mut cache))?;
    assert!(matches!(cache.continuation(3)?, Positions::Offset(5)));
    Ok(())
}

fn causal_weights_and_rows(dev: &Device) -> anyhow::Result<()> {
    let x = common::randn(0f32, 1.0, (1, 5, D_MODEL), dev)?;
    let mha = random_block(None, true, dev)?;
    let w = mha
        .forward_with(&x, &with_weights(), None)?
        .weights
        .expect("weights");
    assert_eq!(w.dims(), &[1, HEADS, 5, 5]);
    let sums = w.sum(3)?;
    assert_close(&sums, &sums.ones_like()?, 1e-6, "rows sum to 1")?;
    let w = w.i(0)?.to_vec3::<f32>()?;
    for head in &w {
        for (i, row) in head.iter().enumerate() {
            for (j, &p) in row.iter().enumerate() {
                if j > i {
                    assert_eq!(p, 0.0, "future key {j} seen by query {i}");
                } else {
                    assert!(p > 0.0);
                }
            }
        }
    }
    Ok(())
}

fn padding_hides_keys(dev: &Device) -> anyhow::Result<()> {
    let x = common::randn(0f32, 1.0, (2, 6, D_MODEL), dev)?;
    let pad = Tensor::new(&[[1f32, 1., 1., 1., 0., 0.], [1., 1., 1., 1., 1., 1.]], dev)?;
    // Changing what sits in the padded slots changes nothing for the real tokens.
    let noise = common::randn(0f32, 5.0, (1, 2, D_MODEL), dev)?;
    let x2 = Tensor::cat(&[&x.i((0..1, ..4))?, &noise], 1)?;
    let x2 = Tensor::cat(&[&x2, &x.i(1..2)?], 0)?;
    for (name, enc) in encodings(dev)? {
        let mha = random_block(enc, false, dev)?;
        let opts = AttentionOptions {
            padding_mask: Some(&pad),
            return_weights: true,
            ..Default::default()
        };
        let a = mha.forward_with(&x, &opts, None)?;
        let b = mha.forward_with(&x2, &opts, None)?;
        assert_close(&a.output.i((0, ..4))?, &b.output.i((0, ..4))?, 1e-6, name)?;
        let masked = a
            .weights
            .expect("weights")
            .i((0, .., .., 4..))?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert_eq!(masked, 0.0, "{name}: weight on a padded key");
        // An additive mask with -inf on the same keys gives the same result.
        let additive = ((pad.ones_like()? - &pad)? * -1e30)?.reshape((2, 1, 1, 6))?;
        let c = mha.forward_with(
            &x,
            &AttentionOptions {
                attn_mask: Some(&additive),
                ..Default::default()
            },
            None,
        )?;
        // (The two calls take different paths, ops and the fused core: they differ by
        // rounding.)
        assert_close(&a.output, &c.output, 1e-5, "additive mask")?;
    }
    Ok(())
}

fn order_matters_only_with_an_encoding(dev: &Device) -> anyhow::Result<()> {
    // Reversing the tokens permutes the outputs exactly when there is no positional information.
    let x = common::randn(0f32, 1.0, (1, 6, D_MODEL), dev)?;
    let rev = Tensor::new(&[5u32, 4, 3, 2, 1, 0], dev)?;
    let x_rev = x.index_select(&rev, 1)?;
    for (name, enc) in encodings(dev)? {
        let mha = random_block(enc, false, dev)?;
        let y = mha.forward(&x)?;
        let y_rev = mha.forward(&x_rev)?.index_select(&rev, 1)?;
        let diff = common::max_abs_diff(&y, &y_rev)?;
        if name == "none" {
            assert!(
                diff < 1e-5,
                "no encoding: outputs should be a permutation ({diff})"
            );
        } else {
            assert!(diff > 1e-3, "{name}: order should matter ({diff})");
        }
    }
    Ok(())
}

fn training_path_is_differentiable(dev: &Device) -> anyhow::Result<()> {
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let probe: Arc<dyn PositionalEncoding> = Arc::new(HookProbe {
        num_heads: HEADS,
        head_dim: HEAD_DIM,
        device: dev.clone(),
    });
    let mha = MultiHeadAttention::new(&base_cfg().with_causal(true), Some(probe), vb.pp("attn"))?;
    let x = common::randn(0f32, 1.0, (2, 5, D_MODEL), dev)?;
    let train = mha
        .forward_with(
            &x,
            &AttentionOptions {
                train: true,
                ..Default::default()
            },
            None,
        )?
        .output;
    // Without dropout the training path computes the same values as the fused inference path.
    assert_close(&train, &mha.forward(&x)?, 1e-6, "train vs eval")?;
    let grads = train.sqr()?.sum_all()?.backward()?;
    let data = varmap.data().lock().expect("lock");
    for name in [
        "attn.q_proj.weight",
        "attn.k_proj.weight",
        "attn.v_proj.weight",
        "attn.o_proj.weight",
    ] {
        let g = grads
            .get(data[name].as_tensor())
            .unwrap_or_else(|| panic!("no gradient for {name}"));
        let norm = g.sqr()?.sum_all()?.to_scalar::<f32>()?;
        assert!(norm > 0.0, "{name}: zero gradient");
    }
    Ok(())
}

fn attention_dropout_only_in_training(dev: &Device) -> anyhow::Result<()> {
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let mha = MultiHeadAttention::new(&base_cfg().with_dropout(0.5), None, vb)?;
    let x = common::randn(0f32, 1.0, (1, 8, D_MODEL), dev)?;
    let eval = mha
        .forward_with(&x, &AttentionOptions::default(), None)?
        .output;
    assert_close(&eval, &mha.forward(&x)?, 0.0, "eval deterministic")?;
    let train = mha
        .forward_with(
            &x,
            &AttentionOptions {
                train: true,
                ..Default::default()
            },
            None,
        )?
        .output;
    assert!(
        common::max_abs_diff(&eval, &train)? > 1e-4,
        "dropout changed nothing"
    );
    Ok(())
}

fn half_precision_block(dev: &Device) -> anyhow::Result<()> {
    let fx = fixture("attention.safetensors", dev)?;
    let pe = SinusoidalPositionalEncoding::new(&SinusoidalConfig::new(D_MODEL), dev)?;
    let cfg = base_cfg().with_bias(true).with_causal(true);
    for dtype in [DType::BF16, DType::F16] {
        let vb = VarBuilder::from_tensors(prefixed(&fx, "sinusoidal."), dtype, dev);
        let mha = MultiHeadAttention::new(&cfg, Some(Arc::new(pe.clone())), vb)?;
        let y = mha.forward(&get(&fx, "x").to_dtype(dtype)?)?;
        assert_eq!(y.dtype(), dtype);
        // bf16 keeps 8 mantissa bits: outputs of size ~1 after 4 roundings land within 5e-2.
        assert_close(&y, get(&fx, "sinusoidal.out"), 5e-2, "half")?;
    }
    Ok(())
}

fn bad_input(dev: &Device) -> anyhow::Result<()> {
    invalid_configs_name_their_field(dev);
    let mha = MultiHeadAttention::new(&base_cfg(), None, VarBuilder::zeros(DType::F32, dev))?;
    inputs_of_the_wrong_rank_or_width(&mha, dev)?;
    masks_and_ids_of_the_wrong_shape(&mha, dev)?;
    caches_refuse_what_they_cannot_hold(&mha, dev)?;
    missing_weights_name_the_tensor(dev);
    Ok(())
}

/// Each invalid setting is an `InvalidConfig` naming its field.
fn invalid_configs_name_their_field(dev: &Device) {
    let vb = VarBuilder::zeros(DType::F32, dev);
    let cases = [
        (AttentionConfig::new(16, 0), "num_heads"),
        (AttentionConfig::new(0, 4), "d_model"),
        (AttentionConfig::new(16, 3), "head_dim"),
        (AttentionConfig::new(16, 4).with_kv_heads(3), "num_kv_heads"),
        (AttentionConfig::new(16, 4).with_kv_heads(0), "num_kv_heads"),
        (AttentionConfig::new(16, 4).with_dropout(1.5), "dropout"),
        (
            AttentionConfig::new(16, 4).with_softmax_scale(f64::INFINITY),
            "softmax_scale",
        ),
    ];
    for (cfg, field) in cases {
        match MultiHeadAttention::new(&cfg, None, vb.clone()) {
            Err(Error::InvalidConfig { name, .. }) => assert_eq!(name, field),
            other => panic!("{field}: expected InvalidConfig, got {other:?}"),
        }
    }
}

/// Input that is not (batch, seq_len, d_model) is refused: a rank error, a shape error.
fn inputs_of_the_wrong_rank_or_width(mha: &MultiHeadAttention, dev: &Device) -> anyhow::Result<()> {
    let opts = AttentionOptions::default();
    let err = mha
        .forward_with(&Tensor::zeros((2, 16), DType::F32, dev)?, &opts, None)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Rank {
                expected: 3,
                got: 2,
                ..
            }
        ),
        "{err}"
    );
    let err = mha
        .forward_with(&Tensor::zeros((2, 3, 15), DType::F32, dev)?, &opts, None)
        .unwrap_err();
    assert!(
        matches!(err, Error::Shape { .. }) && err.to_string().contains("16"),
        "{err}"
    );
    Ok(())
}

/// A padding mask, an additive mask or position ids that do not fit the input are shape
/// errors naming what was wrong.
fn masks_and_ids_of_the_wrong_shape(mha: &MultiHeadAttention, dev: &Device) -> anyhow::Result<()> {
    let x = Tensor::zeros((2, 3, 16), DType::F32, dev)?;
    let pad = Tensor::ones((2, 4), DType::U8, dev)?;
    let err = mha
        .forward_with(
            &x,
            &AttentionOptions {
                padding_mask: Some(&pad),
                ..Default::default()
            },
            None,
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Shape {
                what: "padding mask",
                ..
            }
        ),
        "{err}"
    );
    let mask = Tensor::zeros((3, 3, 3), DType::F32, dev)?;
    let err = mha
        .forward_with(
            &x,
            &AttentionOptions {
                attn_mask: Some(&mask),
                ..Default::default()
            },
            None,
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Shape {
                what: "additive attention mask",
                ..
            }
        ),
        "{err}"
    );
    let ids = Positions::from(PositionIds::from_rows(&[vec![0, 1]], dev)?);
    let err = mha
        .forward_with(
            &x,
            &AttentionOptions {
                positions: Some(&ids),
                ..Default::default()
            },
            None,
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Shape {
                what: "position ids",
                ..
            }
        ),
        "{err}"
    );
    Ok(())
}

/// A cache filled with batch 2 refuses a chunk of batch 1 and is left as it was; decoding
/// past a learned table is a typed error from the encoding.
fn caches_refuse_what_they_cannot_hold(
    mha: &MultiHeadAttention,
    dev: &Device,
) -> anyhow::Result<()> {
    let opts = AttentionOptions::default();
    let x = Tensor::zeros((2, 3, 16), DType::F32, dev)?;
    let mut cache = KvCache::new();
    mha.forward_with(&x, &opts, Some(&mut cache))?;
    let err = mha
        .forward_with(
            &Tensor::zeros((1, 1, 16), DType::F32, dev)?,
            &opts,
            Some(&mut cache),
        )
        .unwrap_err();
    assert!(matches!(err, Error::Shape { .. }), "{err}");
    assert_eq!(cache.len(), 3, "a refused chunk leaves the cache as it was");
    let vb = VarBuilder::zeros(DType::F32, dev);
    let pe = LearnedPositionalEncoding::new(&LearnedConfig::new(16).with_max_len(4), vb.pp("wpe"))?;
    let mha = MultiHeadAttention::new(&base_cfg(), Some(Arc::new(pe)), vb.clone())?;
    let mut cache = KvCache::new();
    mha.forward_with(
        &Tensor::zeros((1, 4, 16), DType::F32, dev)?,
        &opts,
        Some(&mut cache),
    )?;
    let err = mha
        .forward_with(
            &Tensor::zeros((1, 1, 16), DType::F32, dev)?,
            &opts,
            Some(&mut cache),
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::PositionOutOfRange {
                position: 4,
                len: 4,
                ..
            }
        ),
        "{err}"
    );
    Ok(())
}

/// Missing projection weights name the tensor.
fn missing_weights_name_the_tensor(dev: &Device) {
    let empty = VarBuilder::from_tensors(HashMap::new(), DType::F32, dev);
    let err = MultiHeadAttention::new(&base_cfg(), None, empty.pp("layer")).unwrap_err();
    assert!(
        matches!(&err, Error::MissingTensor { name } if name == "layer.q_proj.weight"),
        "{err}"
    );
}

/// The weights of a block built for `cfg` under the prefix `a`, drawn from N(0, std²), as
/// plain tensors to load at any dtype.
fn random_weights(
    cfg: &AttentionConfig,
    std: f32,
    dev: &Device,
) -> anyhow::Result<HashMap<String, Tensor>> {
    let varmap = VarMap::new();
    MultiHeadAttention::new(
        cfg,
        None,
        common::seeded_vb(&varmap, DType::F32, dev).pp("a"),
    )?;
    for var in common::sorted_vars(&varmap) {
        var.set(&common::randn(0f32, std, var.shape(), dev)?)?;
    }
    let data = varmap.data().lock().unwrap();
    Ok(data
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().detach()))
        .collect())
}

/// Sliding windows, soft caps and sinks: checked settings, serialised with the block, sinks
/// created in a `VarMap` as zeros and trained (gradients reach them), and the weights of a
/// windowed causal row against the formula.
fn window_softcap_sinks(dev: &Device) -> anyhow::Result<()> {
    let base = AttentionConfig::new(16, 4).with_causal(true);
    for (bad, name) in [
        (base.clone().with_sliding_window(Some(0)), "sliding_window"),
        (
            base.clone()
                .with_causal(false)
                .with_attention_chunk(Some(4)),
            "attention_chunk",
        ),
        (
            base.clone().with_attention_chunk(Some(0)),
            "attention_chunk",
        ),
        (base.clone().with_logit_softcap(Some(0.0)), "logit_softcap"),
        (
            base.clone().with_logit_softcap(Some(f64::NAN)),
            "logit_softcap",
        ),
        (
            base.clone().with_logit_softcap(Some(1e300)),
            "logit_softcap",
        ),
    ] {
        let err = bad.validate().unwrap_err();
        assert!(
            matches!(&err, Error::InvalidConfig { name: n, .. } if *n == name),
            "{err}"
        );
    }
    // Half-precision blocks cap their logits in f32: a cap outside f16's range (131008, found
    // by the api fuzz target) or below its normal range gives finite output, as in f32.
    for cap in [131_008.0, 1e-6] {
        let cfg = base.clone().with_logit_softcap(Some(cap)).with_sinks(true);
        let x = common::randn(0f32, 1.0, (1, 5, 16), dev)?;
        let weights = random_weights(&cfg, 0.3, dev)?;
        let outs = [DType::F32, DType::F16, DType::BF16]
            .iter()
            .map(|&dtype| {
                let vb = VarBuilder::from_tensors(weights.clone(), dtype, dev);
                let block = MultiHeadAttention::new(&cfg, None, vb.pp("a"))?;
                let y = block.forward(&x.to_dtype(dtype)?)?.to_dtype(DType::F32)?;
                anyhow::Ok(y)
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        // 16 unit roundoffs of the format (f16 2^-11, bf16 2^-8) of the output's scale, as in
        // tests/it/attention/half_precision.rs (a fixed 0.05 reached 0.55 of itself over repeated runs).
        for (y, u) in outs[1..].iter().zip([2f64.powi(-11), 2f64.powi(-8)]) {
            let finite = y.abs()?.sum_all()?.to_scalar::<f32>()?;
            assert!(finite.is_finite(), "cap {cap}: non-finite output");
            let what = format!("cap {cap}: half vs f32");
            assert_close_scaled(y, &outs[0], 16.0 * u, 16.0 * u, &what)?;
        }
    }
    let cfg = base
        .with_sliding_window(Some(3))
        .with_logit_softcap(Some(2.0))
        .with_sinks(true);
    let json = serde_json::to_string(&cfg)?;
    assert_eq!(serde_json::from_str::<AttentionConfig>(&json)?, cfg);

    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let block = MultiHeadAttention::new(&cfg, None, vb.pp("attn"))?;
    let sinks = varmap.data().lock().unwrap()["attn.sinks"].clone();
    assert_eq!(sinks.as_tensor().to_vec1::<f32>()?, vec![0.0; 4]);
    let x = common::randn(0f32, 1.0, (2, 6, 16), dev)?;
    let out = block.forward(&x)?;
    let grads = out.sqr()?.sum_all()?.backward()?;
    let g = grads
        .get(sinks.as_tensor())
        .expect("the sinks get a gradient");
    assert!(g.abs()?.sum_all()?.to_scalar::<f32>()? > 0.0);

    // The weights of the last row: a softmax over its last 3 keys of the capped logits,
    // joined by the head's sink (0 here).
    let weights = block
        .forward_with(
            &x,
            &AttentionOptions {
                return_weights: true,
                ..Default::default()
            },
            None,
        )?
        .weights
        .expect("weights");
    let row = weights.i((0, 1, 5))?.to_vec1::<f32>()?;
    assert_eq!(&row[..3], &[0.0, 0.0, 0.0], "outside the window");
    let total: f32 = row.iter().sum();
    assert!(total < 1.0 && total > 0.0, "the sink takes {}", 1.0 - total);
    Ok(())
}

/// Which keys a query sees under a window or chunks, by the formulas HF's masks use: a causal
/// window keeps `p − w < j ≤ p`, a bidirectional one `|p − j| ≤ w`, chunks of `c` keep `j ≤ p`
/// with `⌊(j − l)/c⌋ = ⌊(p − l)/c⌋` (`l` the sequence's leading padded keys). The block with the
/// setting equals the block without it given that keep-mask as an additive mask, on every path
/// (fused core, row pass, plain ops in f64), left-padded, and decoding through a cache.
fn windows_and_chunks_match_their_masks(dev: &Device) -> anyhow::Result<()> {
    let s = MaskSetup::new(dev)?;
    let base = AttentionConfig::new(s.d_model, s.heads).with_kv_heads(2);
    let configs = [
        base.clone().with_sliding_window(Some(2)),
        base.clone().with_sliding_window(Some(0)),
        base.clone().with_causal(true).with_sliding_window(Some(3)),
        base.clone().with_causal(true).with_attention_chunk(Some(3)),
        base.clone()
            .with_causal(true)
            .with_attention_chunk(Some(4))
            .with_sliding_window(Some(3)),
    ];
    for cfg in &configs {
        setting_matches_its_mask(&s, cfg, dev)?;
    }
    Ok(())
}

/// The input of `windows_and_chunks_match_their_masks`: 2 sequences of 11 tokens over 16
/// features (4 heads), the second with 3 leading padded keys.
struct MaskSetup {
    b: usize,
    t: usize,
    d_model: usize,
    heads: usize,
    /// Each sequence's leading padded keys.
    left: [usize; 2],
    padding: Tensor,
    x: Tensor,
}

impl MaskSetup {
    fn new(dev: &Device) -> anyhow::Result<Self> {
        let (b, t, d_model, heads) = (2, 11, 16, 4);
        let left = [0usize, 3];
        let padding: Vec<u8> = (0..b * t).map(|n| (n % t >= left[n / t]) as u8).collect();
        let padding = Tensor::from_vec(padding, (b, t), dev)?;
        let x = common::randn(0f32, 1.0, (b, t, d_model), dev)?;
        Ok(Self {
            b,
            t,
            d_model,
            heads,
            left,
            padding,
            x,
        })
    }

    /// Whether query `p` of sequence `bi` sees key `j` under `cfg`, by HF's formulas.
    fn keep(&self, cfg: &AttentionConfig, bi: usize, p: usize, j: usize) -> bool {
        let l = self.left[bi] as i64;
        let (p, j) = (p as i64, j as i64);
        let causal = !cfg.causal || j <= p;
        let window = match cfg.sliding_window.map(|w| w as i64) {
            None => true,
            Some(w) if cfg.causal => j > p - w,
            Some(w) => (p - j).abs() <= w,
        };
        let chunk = cfg
            .attention_chunk
            .map(|c| c as i64)
            .is_none_or(|c| (j - l).div_euclid(c) == (p - l).div_euclid(c));
        causal && window && chunk && j >= l
    }

    /// Only the real tokens' rows: a padded row sees nothing and is uniform by convention.
    fn real(&self, y: &Tensor) -> anyhow::Result<Tensor> {
        Ok(Tensor::cat(
            &[y.i((0..1, 0..self.t))?, y.i((1..2, self.left[1]..self.t))?],
            1,
        )?)
    }
}

/// The block with `cfg`'s window or chunks equals the block without them given the
/// keep-mask as an additive mask, on the fused core, the row pass and plain ops in f64; the
/// hidden keys get no weight; causal, decoding through a cache gives the same.
fn setting_matches_its_mask(
    s: &MaskSetup,
    cfg: &AttentionConfig,
    dev: &Device,
) -> anyhow::Result<()> {
    let (b, t, x) = (s.b, s.t, &s.x);
    let weights = random_weights(cfg, 0.4, dev)?;
    let block = |cfg: &AttentionConfig, dtype: DType| {
        let vb = VarBuilder::from_tensors(weights.clone(), dtype, dev);
        MultiHeadAttention::new(cfg, None, vb.pp("a"))
    };
    // The reference: no window or chunk, the keep-mask added (−1e9 where hidden).
    let plain = cfg
        .clone()
        .with_causal(false)
        .with_sliding_window(None)
        .with_attention_chunk(None);
    let mask: Vec<f32> = (0..b * t * t)
        .map(|n| {
            let (bi, p, j) = (n / (t * t), n / t % t, n % t);
            if s.keep(cfg, bi, p, j) {
                0.0
            } else {
                -1e9
            }
        })
        .collect();
    let mask = Tensor::from_vec(mask, (b, 1, t, t), dev)?;
    let want = block(&plain, DType::F32)?.forward_with(
        x,
        &AttentionOptions {
            attn_mask: Some(&mask),
            ..Default::default()
        },
        None,
    )?;
    let real = |y: &Tensor| s.real(y);
    let opts = AttentionOptions {
        padding_mask: Some(&s.padding),
        ..Default::default()
    };
    let fused = block(cfg, DType::F32)?.forward_with(x, &opts, None)?;
    let what = format!("{cfg:?}");
    let rows = block(cfg, DType::F32)?.forward_with(
        x,
        &AttentionOptions {
            return_weights: true,
            ..opts.clone()
        },
        None,
    )?;
    for (path, got) in [("fused", &fused.output), ("rows", &rows.output)] {
        assert_close(
            &real(got)?,
            &real(&want.output)?,
            1e-5,
            &format!("{path} {what}"),
        )?;
    }
    let ops = block(cfg, DType::F64)?.forward_with(&x.to_dtype(DType::F64)?, &opts, None)?;
    assert_close_scaled(
        &real(&ops.output.to_dtype(DType::F32)?)?,
        &real(&want.output)?,
        1e-5,
        2e-6,
        &format!("ops {what}"),
    )?;
    hidden_keys_get_no_weight(s, cfg, &rows.weights.expect("weights"), &what)?;
    if cfg.causal {
        decoding_matches_the_forward(s, &block(cfg, DType::F32)?, &fused.output, &what)?;
    }
    Ok(())
}

/// The weights are exactly zero wherever the formula hides a key of a real row.
fn hidden_keys_get_no_weight(
    s: &MaskSetup,
    cfg: &AttentionConfig,
    weights: &Tensor,
    what: &str,
) -> anyhow::Result<()> {
    let (b, t, heads, left) = (s.b, s.t, s.heads, s.left);
    let w = weights.flatten_all()?.to_vec1::<f32>()?;
    for bi in 0..b {
        for p in left[bi]..t {
            for j in (0..t).filter(|&j| !s.keep(cfg, bi, p, j)) {
                for h in 0..heads {
                    assert_eq!(w[((bi * heads + h) * t + p) * t + j], 0.0, "{what}");
                }
            }
        }
    }
    Ok(())
}

/// Decoding: a prefix, then one token at a time, equals the whole forward `fused`.
fn decoding_matches_the_forward(
    s: &MaskSetup,
    mha: &MultiHeadAttention,
    fused: &Tensor,
    what: &str,
) -> anyhow::Result<()> {
    let (x, padding) = (&s.x, &s.padding);
    let mut cache = KvCache::new();
    let mut outs = Vec::new();
    let mut start = 0;
    for n in [5, 1, 1, 2, 1, 1] {
        let y = mha.forward_with(
            &x.i((.., start..start + n))?,
            &AttentionOptions {
                padding_mask: Some(&padding.i((.., 0..start + n))?),
                ..Default::default()
            },
            Some(&mut cache),
        )?;
        outs.push(y.output);
        start += n;
    }
    let decoded = Tensor::cat(&outs, 1)?;
    assert_close_scaled(
        &s.real(&decoded)?,
        &s.real(fused)?,
        1e-5,
        2e-6,
        &format!("decode {what}"),
    )?;
    Ok(())
}

/// Attention temperature tuning: the factor `1 + s·ln(1 + ⌊(p + 1)/f⌋)` by its formula, checked
/// settings, and a block whose queries at cache slot `p` act as the same block with its softmax
/// scale times the factor, decoding token by token after a prefix (so `p` counts the cache).
fn attention_temperature_scales_queries_by_cache_slot(dev: &Device) -> anyhow::Result<()> {
    let t = AttentionTemperature::new(0.5, 3);
    for p in 0..20usize {
        let want = 1.0 + 0.5 * (1.0 + ((p + 1) / 3) as f64).ln();
        assert!((t.factor(p) - want).abs() < 1e-12, "p = {p}");
    }
    let base = AttentionConfig::new(16, 4).with_causal(true);
    for bad in [
        AttentionTemperature::new(-0.1, 8),
        AttentionTemperature::new(f64::NAN, 8),
        AttentionTemperature::new(0.1, 0),
        // Its factor is ∞ in f32 from key index 1: NaN output, silently, before.
        AttentionTemperature::new(f32::MAX as f64, 1),
        AttentionTemperature::new(AttentionTemperature::MAX_ATTN_SCALE * 1.01, 1),
    ] {
        let err = base
            .clone()
            .with_attention_temperature(Some(bad))
            .validate()
            .unwrap_err();
        assert!(matches!(&err, Error::InvalidConfig { .. }), "{err}");
    }
    // The largest scale accepted keeps the factor finite in f32 at every key index.
    let edge = AttentionTemperature::new(AttentionTemperature::MAX_ATTN_SCALE, 1);
    edge.validate()?;
    for p in [0, 1, 1 << 32, usize::MAX - 1, usize::MAX] {
        assert!((edge.factor(p) as f32).is_finite(), "p = {p}");
    }
    let cfg = base.with_kv_heads(2).with_attention_temperature(Some(t));
    let json = serde_json::to_string(&cfg)?;
    assert_eq!(serde_json::from_str::<AttentionConfig>(&json)?, cfg);
    let weights = random_weights(&cfg, 0.4, dev)?;
    let vb = VarBuilder::from_tensors(weights, DType::F32, dev);
    let tuned = MultiHeadAttention::new(&cfg, None, vb.pp("a"))?;
    let x = common::randn(0f32, 1.0, (2, 9, 16), dev)?;
    // The prefix (slots 0..4) and then single tokens (slots 4..9).
    let mut cache = KvCache::new();
    let prefix = tuned.forward_with(
        &x.i((.., 0..4))?,
        &AttentionOptions::default(),
        Some(&mut cache),
    )?;
    for p in 4..9 {
        let step = tuned.forward_with(
            &x.i((.., p..p + 1))?,
            &AttentionOptions::default(),
            Some(&mut cache),
        )?;
        // The same step from a block whose scale carries the factor of slot p.
        let plain_cfg = cfg
            .clone()
            .with_attention_temperature(None)
            .with_softmax_scale(cfg.softmax_scale * t.factor(p));
        let plain = MultiHeadAttention::new(&plain_cfg, None, vb.pp("a"))?;
        let mut plain_cache = KvCache::new();
        plain.forward_with(
            &x.i((.., 0..p))?,
            &AttentionOptions::default(),
            Some(&mut plain_cache),
        )?;
        let want = plain.forward_with(
            &x.i((.., p..p + 1))?,
            &AttentionOptions::default(),
            Some(&mut plain_cache),
        )?;
        assert_close(&step.output, &want.output, 1e-5, &format!("slot {p}"))?;
    }
    // The whole sequence at once gives the prefix's rows.
    let whole = tuned.forward(&x)?;
    assert_close_scaled(&whole.i((.., 0..4))?, &prefix.output, 1e-5, 2e-6, "prefix")?;
    Ok(())
}

/// Latent attention (MLA) as a block setting: checked against heads and norms, serialised,
/// created in a `VarMap` under DeepSeek's names and trained through (every latent weight gets
/// a gradient), and the three paths and decoding agree.
fn latent_attention_block(dev: &Device) -> anyhow::Result<()> {
    let latent = LatentConfig::new(Some(6), 5, 2, 3);
    let cfg = AttentionConfig::new(16, 4)
        .with_head_dim(4)
        .with_causal(true)
        .with_bias(true)
        .with_latent(Some(latent));
    for (bad, name) in [
        (cfg.clone().with_kv_heads(2), "num_kv_heads"),
        (
            cfg.clone().with_qk_norm(Some(QkNormConfig::new())),
            "qk_norm",
        ),
        (
            cfg.clone()
                .with_latent(Some(LatentConfig::new(None, 5, 4, 3))),
            "latent.rope_dim",
        ),
        (
            cfg.clone()
                .with_latent(Some(LatentConfig::new(None, 5, 2, 5))),
            "latent.v_head_dim",
        ),
        (
            cfg.clone()
                .with_latent(Some(LatentConfig::new(Some(0), 5, 2, 3))),
            "latent.q_lora_rank",
        ),
        // Ranks past every budget are refused before any size is computed from them.
        (
            cfg.clone()
                .with_latent(Some(LatentConfig::new(Some(6), usize::MAX, 2, 3))),
            "latent",
        ),
        (
            cfg.clone()
                .with_latent(Some(LatentConfig::new(Some(usize::MAX), 5, 2, 3))),
            "latent",
        ),
    ] {
        let err = bad.validate().unwrap_err();
        assert!(
            matches!(&err, Error::InvalidConfig { name: n, .. } if *n == name),
            "{name}: {err}"
        );
    }
    let json = serde_json::to_string(&cfg)?;
    assert_eq!(serde_json::from_str::<AttentionConfig>(&json)?, cfg);
    let varmap = VarMap::new();
    let block = MultiHeadAttention::new(
        &cfg,
        None,
        common::seeded_vb(&varmap, DType::F32, dev).pp("a"),
    )?;
    let mut names: Vec<String> = varmap.data().lock().unwrap().keys().cloned().collect();
    names.sort();
    assert_eq!(
        names,
        [
            "a.kv_a_layernorm.weight",
            "a.kv_a_proj_with_mqa.bias",
            "a.kv_a_proj_with_mqa.weight",
            "a.kv_b_proj.weight",
            "a.o_proj.bias",
            "a.o_proj.weight",
            "a.q_a_layernorm.weight",
            "a.q_a_proj.bias",
            "a.q_a_proj.weight",
            "a.q_b_proj.weight",
        ]
    );
    let x = common::randn(0f32, 1.0, (2, 5, 16), dev)?;
    let grads = block.forward(&x)?.sqr()?.sum_all()?.backward()?;
    for var in varmap.all_vars() {
        let g = grads.get(var.as_tensor()).expect("a gradient");
        assert!(g.abs()?.sum_all()?.to_scalar::<f32>()? > 0.0);
    }
    // Loaded as plain tensors: the fused core, the row pass, plain ops in f64 and decoding agree.
    let weights = random_weights(&cfg, 0.4, dev)?;
    let load = |dtype| {
        MultiHeadAttention::new(
            &cfg,
            None,
            VarBuilder::from_tensors(weights.clone(), dtype, dev).pp("a"),
        )
    };
    let fused = load(DType::F32)?.forward(&x)?;
    let rows = load(DType::F32)?.forward_with(
        &x,
        &AttentionOptions {
            return_weights: true,
            ..Default::default()
        },
        None,
    )?;
    assert_close(&rows.output, &fused, 1e-5, "row pass")?;
    let ops = load(DType::F64)?.forward(&x.to_dtype(DType::F64)?)?;
    assert_close(&ops.to_dtype(DType::F32)?, &fused, 1e-5, "plain ops")?;
    let block = load(DType::F32)?;
    let mut cache = KvCache::new();
    let steps = (0..5)
        .map(|t| {
            let y = block.forward_with(
                &x.i((.., t..t + 1))?,
                &AttentionOptions::default(),
                Some(&mut cache),
            )?;
            Ok(y.output)
        })
        .collect::<Result<Vec<_>>>()?;
    assert_close(&Tensor::cat(&steps, 1)?, &fused, 1e-5, "decoding")?;
    Ok(())
}

/// A streaming KV cache (StreamingLLM): fed token by token, each token attends to the sinks,
/// the last `window` tokens before it and itself, all at their cache slots; until the stream
/// passes `sinks + window` tokens it equals the full forward. Checked with RoPE (keys kept
/// rotated in the cache's frame, or rotated at their slots every step where the frequencies
/// follow the length) and ALiBi against a plain forward over exactly those tokens, in a row. Positions given with a streaming cache are refused; a failed call leaves it as it was.
fn streaming_cache_keeps_sinks_and_a_window(dev: &Device) -> anyhow::Result<()> {
    let (sinks, window, n) = (2, 4, 13);
    // Two sequences over two KV heads, and one over one (the cache's slots are then one
    // contiguous run, moved within itself).
    for (batch, kv_heads) in [(2, 2), (1, 1)] {
        streaming_case(dev, (sinks, window, n), batch, kv_heads)?;
    }
    // A longer stream: the sinks move forward over each evicted token, and the slots go back
    // to the front of the storage several times.
    streaming_case(dev, (sinks, window, 60), 2, 2)?;
    Ok(())
}

fn streaming_case(
    dev: &Device,
    (sinks, window, n): (usize, usize, usize),
    batch: usize,
    kv_heads: usize,
) -> anyhow::Result<()> {
    let cfg = AttentionConfig::new(16, 4)
        .with_kv_heads(kv_heads)
        .with_causal(true);
    let weights = random_weights(&cfg, 0.4, dev)?;
    let vb = VarBuilder::from_tensors(weights, DType::F32, dev);
    // RoPE whose rotation depends only on position differences (plain; interleaved, partial,
    // YaRN) keeps its keys rotated in the cache's frame; LongRoPE, whose frequencies follow
    // the length, and ALiBi are computed at the slots every step.
    let yarn = RopeConfig::new(4)
        .with_layout(RopeLayout::Interleaved)
        .with_rotary_dim(2)
        .with_scaling(RopeScaling::Yarn(YarnScaling::new(4.0, 8)));
    let longrope = RopeConfig::new(4).with_scaling(RopeScaling::LongRope(LongRopeScaling {
        short_factor: vec![1.0, 1.5],
        long_factor: vec![2.0, 4.0],
        original_max_position_embeddings: 5,
        factor: 4.0,
        attention_factor: None,
    }));
    let encodings: [(Arc<dyn PositionalEncoding>, bool); 4] = [
        (
            Arc::new(RotaryEmbedding::new(&RopeConfig::new(4), dev)?),
            true,
        ),
        (Arc::new(RotaryEmbedding::new(&yarn, dev)?), true),
        (Arc::new(RotaryEmbedding::new(&longrope, dev)?), false),
        (Arc::new(Alibi::new(&AlibiConfig::new(4), dev)?), false),
    ];
    let x = common::randn(0f32, 1.0, (batch, n, 16), dev)?;
    for (enc, kept) in encodings {
        assert_eq!(enc.relative_rotation(), kept, "{enc:?}");
        let block = MultiHeadAttention::new(&cfg, Some(enc), vb.pp("a"))?;
        let mut cache = KvCache::streaming(sinks, window);
        assert_eq!(cache.streaming_window(), Some((sinks, window)));
        for i in 0..n {
            let step = block.forward_with(
                &x.i((.., i..i + 1))?,
                &AttentionOptions::default(),
                Some(&mut cache),
            )?;
            assert_eq!(cache.len(), (i + 1).min(sinks + window));
            let want = if i < sinks + window {
                // The prefix's forward (LongRoPE's frequencies follow the length).
                block.forward(&x.i((.., 0..i + 1))?)?.i((.., i..i + 1))?
            } else {
                // The sinks, the window before token i, and token i, in a row from slot 0.
                let kept = Tensor::cat(&[x.i((.., 0..sinks))?, x.i((.., i - window..i + 1))?], 1)?;
                block
                    .forward(&kept)?
                    .i((.., sinks + window..sinks + window + 1))?
            };
            assert_close_scaled(&step.output, &want, 1e-5, 2e-6, &format!("token {i}"))?;
        }
        // Positions are the cache's own; a failed call (here also a padding mask of the wrong
        // shape) leaves the cache as it was.
        let at = Positions::Offset(0);
        let bad = Tensor::ones((batch, 3), DType::U8, dev)?;
        let before = cache.clone();
        for (opts, name) in [
            (
                AttentionOptions {
                    positions: Some(&at),
                    ..Default::default()
                },
                Some("positions"),
            ),
            (
                AttentionOptions {
                    padding_mask: Some(&bad),
                    ..Default::default()
                },
                None,
            ),
        ] {
            let err = block
                .forward_with(&x.i((.., 0..1))?, &opts, Some(&mut cache))
                .unwrap_err();
            if let Some(name) = name {
                assert!(
                    matches!(&err, Error::InvalidConfig { name: n, .. } if *n == name),
                    "{err}"
                );
            }
        }
        assert_eq!(cache.len(), before.len());
        let next = x.i((.., 3..4))?;
        let (a, b) = (
            block.forward_with(&next, &AttentionOptions::default(), Some(&mut cache))?,
            block.forward_with(
                &next,
                &AttentionOptions::default(),
                Some(&mut before.clone()),
            )?,
        );
        assert_close(&a.output, &b.output, 0.0, "after a failed call")?;
    }
    Ok(())
}

/// A streaming cache forgets keys, not the inputs its block's short convolutions read next:
/// fed token by token, each token's keys and values are convolved over the tokens just before
/// it, and it attends to the held ones: the whole forward with the forgotten keys masked out.
/// Checked for every split of sinks and window, `streaming(0, 0)` (which holds no token
/// between calls) included. (That one dropped the state with its tokens: each step convolved
/// over zeros, silently.)
fn streaming_cache_keeps_the_convolution_state(dev: &Device) -> anyhow::Result<()> {
    let cfg = AttentionConfig::new(16, 4)
        .with_causal(true)
        .with_short_conv(Some(3));
    let vb = VarBuilder::from_tensors(random_weights(&cfg, 0.4, dev)?, DType::F32, dev);
    let block = MultiHeadAttention::new(&cfg, None, vb.pp("a"))?;
    let x = common::randn(0f32, 1.0, (2, 8, 16), dev)?;
    for (sinks, window) in [(0, 0), (0, 2), (1, 0), (1, 2)] {
        let mut cache = KvCache::streaming(sinks, window);
        let mut held: Vec<usize> = Vec::new();
        for t in 0..8 {
            let opts = AttentionOptions::default();
            let got = block.forward_with(&x.i((.., t..t + 1))?, &opts, Some(&mut cache))?;
            held.push(t);
            let keep: Vec<f32> = (0..=t)
                .map(|j| if held.contains(&j) { 0.0 } else { f32::MIN })
                .collect();
            let mask = Tensor::from_vec(keep, (1, 1, 1, t + 1), dev)?;
            let opts = AttentionOptions {
                attn_mask: Some(&mask),
                ..Default::default()
            };
            let want = block.forward_with(&x.i((.., ..=t))?, &opts, None)?.output;
            let what = format!("streaming({sinks}, {window}), token {t}");
            assert_close(&got.output, &want.i((.., t..t + 1))?, 1e-5, &what)?;
            if held.len() > sinks + window {
                held.drain(sinks..held.len() - window);
            }
        }
    }
    Ok(())
}

/// With sinks the softmax no longer ignores a constant along a row, so ALiBi gives its
/// formula `−m·(i − j)` exactly rather than its per-key form (which shifted each row by its
/// query's position: query blocks of different sizes gave different answers).
fn alibi_with_sinks_is_exact(dev: &Device) -> anyhow::Result<()> {
    let cfg = AttentionConfig::new(16, 2)
        .with_causal(true)
        .with_sinks(true);
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    MultiHeadAttention::new(&cfg, None, vb.pp("attn"))?;
    for var in common::sorted_vars(&varmap) {
        let noise = common::randn(0f32, 0.5, var.shape(), dev)?;
        var.set(&(var.as_tensor() + noise)?)?;
    }
    let x = common::randn(0f32, 1.0, (2, 9, 16), dev)?;
    let weights = |mode: AlibiMode, block: Option<usize>| -> anyhow::Result<Tensor> {
        let alibi = Alibi::new(&AlibiConfig::new(2).with_mode(mode), dev)?;
        let mha = MultiHeadAttention::new(
            &cfg.clone().with_query_block(block),
            Some(Arc::new(alibi)),
            vb.pp("attn"),
        )?;
        let opts = AttentionOptions {
            return_weights: true,
            ..Default::default()
        };
        Ok(mha.forward_with(&x, &opts, None)?.weights.expect("weights"))
    };
    let exact = weights(AlibiMode::CausalPairwise, None)?;
    for (mode, block) in [
        (AlibiMode::Auto, None),
        (AlibiMode::Auto, Some(1)),
        (AlibiMode::Causal, Some(4)),
    ] {
        assert_close(
            &weights(mode, block)?,
            &exact,
            1e-6,
            &format!("{mode:?}, query block {block:?}"),
        )?;
    }
    Ok(())
}

/// Rows longer than a key tile (1024 keys): the fused core's online softmax equals the row pass
/// (which takes the softmax of whole rows) within 3e-6 of the largest output, for every
/// encoding, and, without one, for windows both ways, chunks, sinks and a soft cap, left-padded
/// so that the padded causal rows are masked whole.
fn long_rows_span_key_tiles(dev: &Device) -> anyhow::Result<()> {
    use candle_posenc::EncodingConfig;
    use common::zoo;
    let (d_model, heads, head_dim, t) = (16, 2, 8, zoo::LEARNED_LEN);
    let x = common::randn(0f32, 1.0, (2, t, d_model), dev)?;
    let left = 5;
    let keep: Vec<u8> = (0..2 * t)
        .map(|n| (n / t == 0 || n % t >= left) as u8)
        .collect();
    let padding = Tensor::from_vec(keep, (2, t), dev)?;
    let base = AttentionConfig::new(d_model, heads);
    let causal = base.clone().with_causal(true);
    let rules = [
        causal.clone(),
        base.clone(),
        causal
            .clone()
            .with_sliding_window(Some(300))
            .with_sinks(true)
            .with_logit_softcap(Some(5.0)),
        base.clone().with_sliding_window(Some(200)),
        causal.clone().with_attention_chunk(Some(400)),
    ];
    let compare = |mha: &MultiHeadAttention, pad: Option<&Tensor>, what: &str| {
        let opts = AttentionOptions {
            padding_mask: pad,
            ..Default::default()
        };
        let fused = mha.forward_with(&x, &opts, None)?.output;
        let weights = AttentionOptions {
            return_weights: true,
            ..opts
        };
        let rows = mha.forward_with(&x, &weights, None)?.output;
        let top = rows.abs()?.max_all()?.to_scalar::<f32>()? as f64;
        assert_close(&fused, &rows, 3e-6 * top, what)
    };
    for (i, enc) in zoo::configs(d_model, heads, head_dim).iter().enumerate() {
        let attn = if matches!(enc, EncodingConfig::Shaw(_) | EncodingConfig::Rotary(_)) {
            causal.clone()
        } else {
            base.clone()
        };
        let (mha, _) = zoo::attention(enc, &attn, DType::F32, dev)?;
        compare(&mha, None, &zoo::label(i, enc))?;
    }
    for cfg in &rules {
        let (mha, _) = zoo::attention(&EncodingConfig::None, cfg, DType::F32, dev)?;
        for pad in [None, Some(&padding)] {
            compare(&mha, pad, &format!("{cfg:?} padded {}", pad.is_some()))?;
        }
    }
    Ok(())
}

/// Every encoding in a causal block with a window of 3 keys, and with chunks of 4 under that
/// window, decoded through a KV cache after a prefill of 5 tokens (past both) in uneven steps,
/// equals the block's whole forward.
fn windows_and_chunks_decode_with_every_encoding(dev: &Device) -> anyhow::Result<()> {
    let base = AttentionConfig::new(16, 4)
        .with_kv_heads(2)
        .with_causal(true);
    let settings = [
        base.clone().with_sliding_window(Some(3)),
        base.with_sliding_window(Some(3))
            .with_attention_chunk(Some(4)),
    ];
    let x = common::randn(0f32, 1.0, (2, 11, 16), dev)?;
    for cfg in &settings {
        for (i, enc) in common::zoo::configs(16, 4, 4).iter().enumerate() {
            let what = format!("{} {cfg:?}", common::zoo::label(i, enc));
            let (block, _) = common::zoo::attention(enc, cfg, DType::F32, dev)?;
            let whole = block.forward(&x)?;
            let mut cache = KvCache::new();
            let mut steps = Vec::new();
            let mut start = 0;
            for n in [5, 1, 2, 1, 2] {
                let step = block.forward_with(
                    &x.i((.., start..start + n))?,
                    &AttentionOptions::default(),
                    Some(&mut cache),
                )?;
                steps.push(step.output);
                start += n;
            }
            let decoded = Tensor::cat(&steps, 1)?;
            assert_close_scaled(&decoded, &whole, 1e-5, 2e-6, &what)?;
        }
    }
    Ok(())
}

device_tests!(
    windows_and_chunks_decode_with_every_encoding,
    long_rows_span_key_tiles,
    window_softcap_sinks,
    windows_and_chunks_match_their_masks,
    attention_temperature_scales_queries_by_cache_slot,
    latent_attention_block,
    streaming_cache_keeps_sinks_and_a_window,
    streaming_cache_keeps_the_convolution_state,
    alibi_with_sinks_is_exact,
    parity_plain,
    parity_sinusoidal_causal_bias,
    parity_learned_padding,
    parity_rotation_bias_value_hooks,
    kv_cache_decoding_matches_full_forward,
    kv_cache_clones_are_independent,
    kv_cache_truncates,
    kv_cache_refuses_another_dtype,
    kv_cache_belongs_to_its_block,
    kv_cache_with_position_ids,
    kv_cache_continues_each_row,
    kv_cache_offsets_of_their_own,
    causal_weights_and_rows,
    padding_hides_keys,
    order_matters_only_with_an_encoding,
    training_path_is_differentiable,
    attention_dropout_only_in_training,
    half_precision_block,
    bad_input,
);
