//! Random use of the public API (proptest): every encoding of the zoo in a random block (heads,
//! KV heads, head width, causality, biases, a query/key norm, a sliding window, chunks, a soft
//! cap, sinks, a temperature, latent projections, a value norm, values from keys), fed random
//! inputs — batch and length including 0, every float dtype and an integer one, offsets and
//! per-token ids up to the edge of `u32`, padding, additive masks of random shapes, a KV cache
//! (plain or streaming) over several chunks that is cloned and truncated.
//!
//! Every call must answer `Ok` with finite output of the right shape, or a typed error of the
//! crate (never `Error::Candle`, never a panic); the fused, row-pass and plain-ops paths must
//! agree; a call that fails must leave the cache as it was. The budget is lowered so absurd
//! sizes fail fast. Case count: 128 (debug build, a few seconds); the `api` fuzz target in
//! `fuzz/` drives the same API for millions of executions.

use crate::common;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;
use candle_posenc::attention::{
    AttentionConfig, AttentionOptions, AttentionTemperature, KvCache, LatentConfig,
    MultiHeadAttention, QkNormConfig, QkNormScope,
};
use candle_posenc::positions::{PositionIds, Positions};
use candle_posenc::{limits, Error};
use common::{max_abs_diff, zoo};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Case {
    encoding: usize,
    heads: usize,
    kv_pick: usize,
    head_dim: usize,
    causal: bool,
    bias: bool,
    norm: Option<bool>,
    /// Bits: a sliding window of 2, a soft cap of 3, sink logits, chunks of 3 (causal blocks),
    /// an attention temperature, latent projections (MLA; when the heads allow), a value norm,
    /// values from the keys.
    extras: u8,
    batch: usize,
    chunks: Vec<usize>,
    dtype: usize,
    start: u32,
    ids: bool,
    padding: bool,
    mask_shape: usize,
    truncate: usize,
    /// A streaming cache `(sinks, window)`: positions are the cache's own, none are given.
    streaming: Option<(usize, usize)>,
}

fn cases() -> impl Strategy<Value = Case> {
    (
        (
            0..16usize,
            prop::sample::select(vec![1usize, 2, 4]),
            0..3usize,
            2..=4usize,
        ),
        (
            any::<bool>(),
            any::<bool>(),
            prop::option::of(any::<bool>()),
            any::<u8>(),
        ),
        (
            0..3usize,
            prop::collection::vec(0..5usize, 1..4),
            0..5usize,
            prop::option::of((0..3usize, 0..4usize)),
        ),
        (
            prop::sample::select(vec![0u32, 3, 1_000, u32::MAX - 8, u32::MAX]),
            any::<bool>(),
            any::<bool>(),
            0..5usize,
            0..4usize,
        ),
    )
        .prop_map(
            |(
                (encoding, heads, kv_pick, hd),
                (causal, bias, norm, extras),
                (batch, chunks, dtype, streaming),
                (start, ids, padding, mask_shape, truncate),
            )| Case {
                encoding,
                heads,
                kv_pick,
                head_dim: 2 * hd,
                causal,
                bias,
                norm,
                extras,
                batch,
                chunks,
                dtype,
                start,
                ids,
                padding,
                mask_shape,
                truncate,
                streaming,
            },
        )
}

/// `Ok` with finite output, or a typed error: anything else fails the case.
fn typed<T>(what: &str, r: candle_posenc::Result<T>) -> Result<Option<T>, TestCaseError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(Error::Candle(e)) => Err(TestCaseError::fail(format!("{what}: untyped error {e}"))),
        Err(_) => Ok(None),
    }
}

fn run(case: &Case) -> Result<(), TestCaseError> {
    let Some(built) = build(case)? else {
        return Ok(());
    };
    let block = &built.block;
    let mut cache = match case.streaming {
        Some((sinks, window)) => KvCache::streaming(sinks, window),
        None => KvCache::new(),
    };
    let mut position = case.start;
    for (n, &t) in case.chunks.iter().enumerate() {
        let Some(chunk) = chunk_inputs(case, &built, t, position, cache.len())? else {
            continue;
        };
        let x = &chunk.x;
        let opts = AttentionOptions {
            positions: case.streaming.is_none().then_some(&chunk.positions),
            padding_mask: chunk.padding.as_ref(),
            attn_mask: chunk.mask.as_ref(),
            ..Default::default()
        };
        let before = (cache.len(), cache.next_position());
        let mut trial = cache.clone();
        let fused = typed("forward", block.forward_with(x, &opts, Some(&mut trial)))?;
        let Some(fused) = fused else {
            // A failed call leaves the cache as it was.
            prop_assert_eq!((trial.len(), trial.next_position()), before);
            continue;
        };
        let out = &fused.output;
        prop_assert_eq!(out.dims(), &[case.batch, t, built.d_model][..]);
        let finite = out
            .to_dtype(DType::F64)
            .and_then(|o| o.abs()?.sum_all()?.to_scalar::<f64>())
            .map_err(|e| fail(e.into()))?;
        prop_assert!(finite.is_finite(), "chunk {}: non-finite output", n);
        // The other paths, from the same cache, agree.
        if out.elem_count() == 0 {
            cache = trial;
            continue;
        }
        other_paths_agree(&built, x, &opts, &cache, out, finite)?;
        cache = trial;
        position = position.saturating_add(t as u32);
        if n == case.truncate {
            typed("truncate", cache.truncate(cache.len() / 2))?;
            position = cache.next_position().min(u32::MAX as usize) as u32;
        }
    }
    Ok(())
}

/// An error of the test's own machinery (not of the call under test) as a failed case.
fn fail(e: anyhow::Error) -> TestCaseError {
    TestCaseError::fail(format!("{e:#}"))
}

/// A case's block, with what its inputs are built from.
struct Built {
    block: MultiHeadAttention,
    _varmap: VarMap,
    kind: &'static str,
    heads: usize,
    d_model: usize,
    /// The input's dtype, and the weights' (f32 for an integer input).
    dtype: DType,
    weights: DType,
}

/// The case's encoding in a block with the case's settings, or `None` where the block
/// refuses them with a typed error.
fn build(case: &Case) -> Result<Option<Built>, TestCaseError> {
    let dev = Device::Cpu;
    let divisors: Vec<usize> = (1..=case.heads)
        .filter(|d| case.heads.is_multiple_of(*d))
        .collect();
    let kv = divisors[case.kv_pick % divisors.len()];
    let (h, hd) = (case.heads, case.head_dim);
    let d_model = h * hd;
    let configs = zoo::configs(d_model, h, hd.max(4));
    let encoding = &configs[case.encoding % configs.len()];
    let norm = case.norm.map(|all| {
        QkNormConfig::new().with_scope(if all {
            QkNormScope::AllHeads
        } else {
            QkNormScope::PerHead
        })
    });
    let attn = AttentionConfig::new(d_model, h)
        .with_kv_heads(kv)
        .with_causal(case.causal)
        .with_bias(case.bias)
        .with_qk_norm(norm)
        .with_sliding_window((case.extras & 1 != 0).then_some(2))
        .with_attention_chunk((case.causal && case.extras & 8 != 0).then_some(3))
        .with_attention_temperature(
            (case.extras & 16 != 0).then_some(AttentionTemperature::new(0.1, 2)),
        )
        .with_logit_softcap((case.extras & 2 != 0).then_some(3.0))
        .with_sinks(case.extras & 4 != 0)
        .with_value_norm((case.extras & 64 != 0).then_some(1e-6))
        .with_k_eq_v(case.extras & 128 != 0 && case.extras & 32 == 0)
        .with_latent(
            (case.extras & 32 != 0 && kv == h && case.norm.is_none() && hd > 2)
                .then(|| LatentConfig::new(Some(3), 5, 2, hd - 1)),
        );
    let dtype = [DType::F32, DType::F64, DType::BF16, DType::F16, DType::U32][case.dtype];
    let weights = if dtype == DType::U32 {
        DType::F32
    } else {
        dtype
    };
    // A zoo entry sized for a head width of at least 4 may not fit this block: a typed error.
    Ok(match zoo::attention(encoding, &attn, weights, &dev) {
        Ok((block, _varmap)) => Some(Built {
            block,
            _varmap,
            kind: encoding.kind(),
            heads: h,
            d_model,
            dtype,
            weights,
        }),
        Err(e) => match e.downcast::<Error>() {
            Ok(Error::Candle(e)) => return Err(TestCaseError::fail(format!("build: {e}"))),
            Ok(_) => None,
            Err(e) => return Err(fail(e)),
        },
    })
}

/// One chunk's input, positions, padding and mask.
struct Chunk {
    x: Tensor,
    positions: Positions,
    padding: Option<Tensor>,
    mask: Option<Tensor>,
}

/// The inputs of a chunk of `t` tokens from `position` on, after `cached` keys; `None` where
/// its ids are refused with a typed error.
fn chunk_inputs(
    case: &Case,
    built: &Built,
    t: usize,
    position: u32,
    cached: usize,
) -> Result<Option<Chunk>, TestCaseError> {
    let dev = Device::Cpu;
    let (h, d_model) = (built.heads, built.d_model);
    let x = common::randn(0f32, 1.0, (case.batch, t, d_model), &dev)
        .and_then(|x| x.to_dtype(built.dtype))
        .map_err(|e| fail(e.into()))?;
    let positions = if case.ids {
        let ids: Vec<u32> = (0..case.batch * t)
            .map(|i| position.saturating_add((i % t.max(1)) as u32))
            .collect();
        let ids = Tensor::from_vec(ids, (case.batch, t), &dev).map_err(|e| fail(e.into()))?;
        match typed("ids", PositionIds::new(&ids))? {
            Some(ids) => Positions::Ids(ids),
            None => return Ok(None),
        }
    } else {
        Positions::Offset(position as usize)
    };
    let keys = cached + t;
    let padding = case.padding.then(|| {
        let keep: Vec<f32> = (0..case.batch * keys)
            .map(|i| (i % 3 != 0) as u8 as f32)
            .collect();
        Tensor::from_vec(keep, (case.batch, keys), &dev).unwrap()
    });
    let mask_shape: Vec<usize> = match case.mask_shape {
        0 => vec![],
        1 => vec![t, keys],
        2 => vec![1, h, 1, keys],
        3 => vec![t + 1, keys],
        _ => vec![case.batch, 1, t, keys],
    };
    let mask = (!mask_shape.is_empty())
        .then(|| Tensor::zeros(mask_shape.as_slice(), built.weights, &dev).unwrap());
    Ok(Some(Chunk {
        x,
        positions,
        padding,
        mask,
    }))
}

/// The row pass and plain ops, from the same `cache`, give the fused path's output `out`
/// (whose absolute values sum to `finite`).
fn other_paths_agree(
    built: &Built,
    x: &Tensor,
    opts: &AttentionOptions,
    cache: &KvCache,
    out: &Tensor,
    finite: f64,
) -> Result<(), TestCaseError> {
    for (what, opts) in [
        (
            "row pass",
            AttentionOptions {
                return_weights: true,
                ..opts.clone()
            },
        ),
        (
            "plain ops",
            AttentionOptions {
                train: true,
                ..opts.clone()
            },
        ),
    ] {
        let mut other = cache.clone();
        let other = built
            .block
            .forward_with(x, &opts, Some(&mut other))
            .map_err(|e| {
                TestCaseError::fail(format!("{what} failed where the fused path did not: {e}"))
            })?;
        let tol = match built.dtype {
            DType::F32 | DType::U32 => 1e-4,
            DType::F64 => 1e-9,
            _ => 0.1,
        };
        let scale = 1.0 + finite / out.elem_count().max(1) as f64;
        let diff = max_abs_diff(&other.output, out).map_err(fail)?;
        prop_assert!(
            diff <= tol * scale * 10.0,
            "{}: {} differs by {}",
            built.kind,
            what,
            diff
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(common::proptest_config(128))]

    #[test]
    fn random_api_use_is_ok_or_a_typed_error(case in cases()) {
        let _budget = limits::BudgetScope::new(1 << 22);
        run(&case)?;
    }
}
