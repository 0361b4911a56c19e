//! Classes of bug found by the `api` fuzz target (`fuzz/fuzz_targets/api.rs`), each tested as a
//! class rather than as the one input that found it.

mod common;

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_posenc::{
    Alibi, AlibiConfig, AttentionContext, ClippedBiasConfig, ClippedRelativeBias, Columns, Error,
    LogitsBias, PositionalEncoding, Positions, RelativeBias, RelativeValues, ShawConfig,
    ShawRelativePosition, T5Config, T5RelativeBias,
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

device_tests!(sizes_hidden_by_an_empty_axis, integer_tensors_at_the_plug);
