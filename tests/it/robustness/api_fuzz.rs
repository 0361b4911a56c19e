//! Classes of bug found by the `api` fuzz target (`fuzz/fuzz_targets/api.rs`), each tested as a
//! class rather than as the one input that found it.

use crate::common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_posenc::{
    Alibi, AlibiConfig, AttentionConfig, AttentionContext, AttentionOptions, ClippedBiasConfig,
    ClippedRelativeBias, Columns, Error, KvCache, LogitsBias, MultiHeadAttention,
    PositionalEncoding, Positions, RelativeBias, RelativeValues, ShawConfig, ShawRelativePosition,
    T5Config, T5RelativeBias,
};

/// A size past the budget is refused even when another size is 0: `0 × 2^40` elements is 0,
/// but the work around it (a row of the column map per query, a bucket per distance) followed
/// the 2^40 (`to_dense(usize::MAX / 2, 0)` ran forever; `T5RelativeBias::bias` with 2^40
/// queries and no key allocated a lookup of 2^40 buckets). Empty results stay cheap.
fn sizes_hidden_by_an_empty_axis(dev: &Device) -> anyhow::Result<()> {
    let start = Instant::now();
    let values = Tensor::zeros((1, 1, 1, 5), DType::F32, dev)?;
    let rows = RelativeBias::new(values, Columns::Shift(0))?;
    let huge = [1usize << 40, usize::MAX / 2, usize::MAX];
    for &n in &huge {
        for (tq, tk) in [(n, 0), (0, n)] {
            let what = format!("to_dense({tq}, {tk})");
            let err = rows.to_dense(tq, tk).unwrap_err();
            assert!(matches!(err, Error::InvalidConfig { .. }), "{what}: {err}");
            let err = LogitsBias::Relative(rows.clone())
                .to_dense(tq, tk)
                .unwrap_err();
            assert!(matches!(err, Error::InvalidConfig { .. }), "{what}: {err}");
            let at0 = Positions::Offset(0);
            let err = Positions::relative_distances(&at0, tq, &at0, tk, dev).unwrap_err();
            assert!(matches!(err, Error::InvalidConfig { .. }), "{what}: {err}");
        }
    }
    let vb = VarBuilder::zeros(DType::F32, dev);
    let t5 = T5RelativeBias::new(&T5Config::new(2), vb.pp("t5"))?;
    let clipped = ClippedRelativeBias::new(&ClippedBiasConfig::new(2, 3), vb.pp("c"))?;
    for &n in &huge {
        for (q, k) in [(n, 0), (0, n)] {
            let at = |s| Positions::Offset(s);
            let err = t5.bias(&at(0), q, &at(0), k).unwrap_err();
            assert!(
                matches!(err, Error::InvalidConfig { .. }),
                "T5 {q} × {k}: {err}"
            );
            let err = clipped.bias(&at(0), q, &at(0), k).unwrap_err();
            assert!(
                matches!(err, Error::InvalidConfig { .. }),
                "clipped {q} × {k}: {err}"
            );
        }
    }
    // The rest builds and answers empty tensors, which a CUDA device cannot hold
    // (common::holds_empty).
    if !common::holds_empty(dev) {
        return Ok(());
    }
    // Weights with no key, but batch × queries past the budget: the per-column sums would hold
    // a row of the table's width per query (a capacity overflow aborted the process).
    let table = Tensor::zeros((9, 4), DType::F32, dev)?;
    for columns in [Columns::Shift(0), Columns::Shift(-3)] {
        let values = RelativeValues::new(table.clone(), columns)?;
        // (candle's own element count overflows on dims whose product before the 0 does.)
        for (b, tq) in [(1usize << 20, 1usize << 20), (1, 1 << 40), (1 << 40, 1)] {
            let probs = Tensor::zeros((b, 2, tq, 0), DType::F32, dev)?;
            let err = values.weighted_sum(&probs).unwrap_err();
            assert!(
                matches!(err, Error::InvalidConfig { .. }),
                "weighted_sum over ({b}, 2, {tq}, 0): {err}"
            );
        }
        let probs = Tensor::zeros((1, 2, 1 << 10, 0), DType::F32, dev)?;
        assert_eq!(values.weighted_sum(&probs)?.dims(), &[1, 2, 1 << 10, 4]);
    }
    // Empty results within the budget are answered, empty.
    assert_eq!(rows.to_dense(1 << 20, 0)?.dims(), &[1, 1, 1 << 20, 0]);
    assert_eq!(rows.to_dense(0, 1 << 20)?.dims(), &[1, 1, 0, 1 << 20]);
    let at7 = Positions::Offset(7);
    assert_eq!(t5.bias(&at7, 1 << 20, &at7, 0)?.dims(), &[1, 2, 1 << 20, 0]);
    assert_eq!(t5.bias(&at7, 0, &at7, 1 << 20)?.dims(), &[1, 2, 0, 1 << 20]);
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "took {:?}",
        start.elapsed()
    );
    Ok(())
}

/// Integer tensors handed to the plug by a caller are refused with `Error::DType` before any
/// kernel sees them: the weights of `RelativeValues::weighted_sum` (a matmul error before) and
/// the queries of every bias hook (Shaw multiplies them: a matmul error before; the others read
/// only their shape and answered as if they were float).
fn integer_tensors_at_the_plug(dev: &Device) -> anyhow::Result<()> {
    let table = Tensor::ones((3, 4), DType::F32, dev)?;
    for columns in [
        Columns::Shift(1),
        Columns::Index(Tensor::zeros((1, 2, 5), DType::U32, dev)?),
    ] {
        let values = RelativeValues::new(table.clone(), columns)?;
        for dtype in [DType::U8, DType::U32, DType::I64] {
            let probs = Tensor::ones((1, 2, 2, 5), dtype, dev)?;
            let err = values.weighted_sum(&probs).unwrap_err();
            assert!(matches!(err, Error::DType { .. }), "{dtype:?}: {err}");
        }
        assert_eq!(
            values
                .weighted_sum(&Tensor::ones((1, 2, 2, 5), DType::F32, dev)?)?
                .dims(),
            &[1, 2, 2, 4]
        );
    }
    let vb = VarBuilder::zeros(DType::F32, dev);
    let (heads, head_dim) = (2, 4);
    let encodings: Vec<(&str, Box<dyn PositionalEncoding>)> = vec![
        (
            "shaw",
            Box::new(ShawRelativePosition::new(
                &ShawConfig::new(head_dim, 3),
                vb.pp("s"),
            )?),
        ),
        (
            "t5",
            Box::new(T5RelativeBias::new(&T5Config::new(heads), vb.pp("t"))?),
        ),
        (
            "clipped",
            Box::new(ClippedRelativeBias::new(
                &ClippedBiasConfig::new(heads, 3),
                vb.pp("c"),
            )?),
        ),
        (
            "alibi",
            Box::new(Alibi::new(&AlibiConfig::new(heads), dev)?),
        ),
    ];
    let at0 = Positions::Offset(0);
    let ctx = AttentionContext::new(&at0, 3, &at0, 3);
    for (name, enc) in &encodings {
        for dtype in [DType::U8, DType::U32, DType::I64] {
            let q = Tensor::ones((1, heads, 3, head_dim), dtype, dev)?;
            let err = enc.logits_bias(&q, &ctx).unwrap_err();
            assert!(
                matches!(err, Error::DType { .. }),
                "{name} {dtype:?}: {err}"
            );
        }
        let q = Tensor::ones((1, heads, 3, head_dim), DType::F32, dev)?;
        assert!(enc.logits_bias(&q, &ctx)?.is_some(), "{name}");
    }
    Ok(())
}

/// The cache's positions after an undo are exact: `truncate` used to keep the end of the
/// forgotten ids (an upper bound), so `next_position` and the next chunk continued after tokens
/// no longer cached; and a forward that fails after its chunk was appended (an encoding's
/// answer that does not fit, a mask) used to leave the chunk in the cache.
fn cache_positions_after_an_undo(dev: &Device) -> anyhow::Result<()> {
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let mha = MultiHeadAttention::new(&AttentionConfig::new(8, 2), None, vb.pp("a"))?;
    let x = Tensor::ones((1, 3, 8), DType::F32, dev)?;
    fn at(p: &Positions) -> AttentionOptions<'_> {
        AttentionOptions {
            positions: Some(p),
            ..Default::default()
        }
    }
    // Offsets that stop being contiguous, and explicit ids.
    let ids = |v: &[u32]| Positions::ids(&Tensor::new(v, dev)?.unsqueeze(0)?);
    for (first, second) in [
        (Positions::Offset(0), Positions::Offset(100)),
        (ids(&[0, 1, 2])?, ids(&[50, 60, 70])?),
        (ids(&[9, 4, 2])?, Positions::Offset(40)),
    ] {
        let mut cache = KvCache::new();
        mha.forward_with(&x, &at(&first), Some(&mut cache))?;
        let after_first = cache.next_position();
        mha.forward_with(&x, &at(&second), Some(&mut cache))?;
        assert!(cache.next_position() > after_first);
        cache.truncate(3)?;
        assert_eq!(
            cache.next_position(),
            after_first,
            "{first:?} then {second:?}"
        );
        let kept = cache.positions().expect("3 cached");
        assert_eq!(kept.end(3), after_first);
        // The next chunk continues from the kept tokens.
        let mut whole = KvCache::new();
        mha.forward_with(&x, &at(&first), Some(&mut whole))?;
        let a = mha.forward_with(&x, &Default::default(), Some(&mut cache))?;
        let b = mha.forward_with(&x, &Default::default(), Some(&mut whole))?;
        assert_eq!(cache.next_position(), whole.next_position());
        common::assert_close(&a.output, &b.output, 0.0, "after truncate")?;
    }
    // A failed chunk leaves the cache as it was, then the cache works on.
    let misfit = Arc::new(Misfit::default());
    let mha = mha.with_encoding(Some(misfit.clone()));
    let mut cache = KvCache::new();
    mha.forward_with(&x, &Default::default(), Some(&mut cache))?;
    let before = (cache.len(), cache.next_position());
    misfit.0.store(true, Ordering::Relaxed);
    let err = mha
        .forward_with(&x, &Default::default(), Some(&mut cache))
        .unwrap_err();
    misfit.0.store(false, Ordering::Relaxed);
    assert!(matches!(err, Error::Shape { .. }), "{err}");
    assert_eq!((cache.len(), cache.next_position()), before);
    let mask = Tensor::zeros((1, 2, 3, 6), DType::F32, dev)?;
    let padding = Tensor::ones((1, 5), DType::U8, dev)?; // 6 keys: refused before the append
    let opts = AttentionOptions {
        attn_mask: Some(&mask),
        padding_mask: Some(&padding),
        ..Default::default()
    };
    assert!(mha.forward_with(&x, &opts, Some(&mut cache)).is_err());
    assert_eq!((cache.len(), cache.next_position()), before);
    mha.forward_with(&x, &Default::default(), Some(&mut cache))?;
    assert_eq!((cache.len(), cache.next_position()), (6, 6));
    Ok(())
}

/// An encoding whose bias, while armed, has 3 heads (for a 2-head block): a chunk that fails
/// after it was appended.
#[derive(Debug, Default)]
struct Misfit(AtomicBool);

impl PositionalEncoding for Misfit {
    fn logits_bias(
        &self,
        q: &Tensor,
        ctx: &AttentionContext,
    ) -> candle_posenc::Result<Option<LogitsBias>> {
        if !self.0.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let bias = Tensor::zeros((1, 3, 1, ctx.k_len), DType::F32, q.device())?;
        Ok(Some(LogitsBias::Dense(bias)))
    }
}

/// A chunk longer than every index is a valid setting: it splits a padded sequence only at its
/// first unpadded key. Plain ops computed the mask's chunk indices in u32 and refused
/// `attention_chunk = usize::MAX` under padding; every path now agrees on every chunk size, up
/// to the largest.
fn chunks_of_any_size(dev: &Device) -> anyhow::Result<()> {
    let (b, t, d) = (2, 6, 8);
    let x = common::randn(0f32, 1.0, (b, t, d), dev)?;
    let padding = Tensor::from_vec(vec![0u8, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], (b, t), dev)?;
    let varmap = VarMap::new();
    let base = AttentionConfig::new(d, 2).with_causal(true);
    MultiHeadAttention::new(&base, None, common::seeded_vb(&varmap, DType::F32, dev))?;
    let weights: std::collections::HashMap<String, Tensor> = varmap
        .data()
        .lock()
        .expect("varmap")
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().detach()))
        .collect();
    let opts = AttentionOptions {
        padding_mask: Some(&padding),
        ..Default::default()
    };
    for chunk in [1, 2, 5, 6, 7, 1 << 40, usize::MAX] {
        let cfg = base.clone().with_attention_chunk(Some(chunk));
        let out = |dtype: DType| -> anyhow::Result<Tensor> {
            let vb = VarBuilder::from_tensors(weights.clone(), dtype, dev);
            let block = MultiHeadAttention::new(&cfg, None, vb)?;
            let y = block.forward_with(&x.to_dtype(dtype)?, &opts, None)?;
            Ok(y.output.to_dtype(DType::F32)?)
        };
        let (fused, ops) = (out(DType::F32)?, out(DType::F64)?);
        let diff = (fused - ops)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "chunk {chunk}: the paths differ by {diff:e}");
    }
    Ok(())
}

device_tests!(
    sizes_hidden_by_an_empty_axis,
    integer_tensors_at_the_plug,
    cache_positions_after_an_undo,
    chunks_of_any_size
);
