//! Learned absolute encoding and its interpolation: parity with PyTorch (indexing,
//! `F.interpolate(mode="linear", align_corners=False)` and its autograd), a fixed stretch that
//! decodes as one forward, bad input.

use crate::common;

use std::sync::Arc;

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use candle_posenc::{
    AttentionConfig, AttentionOptions, Error, Interpolation, KvCache, LearnedConfig,
    LearnedPositionalEncoding, MultiHeadAttention, Positions,
};
use common::{assert_close, fixture, get};

fn from_fixture(
    dev: &Device,
    interpolation: Interpolation,
) -> anyhow::Result<(
    LearnedPositionalEncoding,
    std::collections::HashMap<String, Tensor>,
)> {
    let fx = fixture("learned.safetensors", dev)?;
    let cfg = LearnedConfig::new(6)
        .with_max_len(8)
        .with_interpolation(interpolation);
    let pe = LearnedPositionalEncoding::from_table(&cfg, get(&fx, "table").clone())?;
    Ok((pe, fx))
}

fn forward_parity(dev: &Device) -> anyhow::Result<()> {
    let (pe, fx) = from_fixture(dev, Interpolation::Off)?;
    let x = get(&fx, "x");
    // Exact: the same additions PyTorch made.
    assert_close(&pe.forward(x)?, get(&fx, "out"), 0.0, "offset 0")?;
    assert_close(
        &pe.forward_with_positions(x, &Positions::Offset(3), false)?,
        get(&fx, "out_offset3"),
        0.0,
        "offset 3",
    )?;
    let ids = Positions::ids(get(&fx, "ids"))?;
    assert_close(
        &pe.forward_with_positions(x, &ids, false)?,
        get(&fx, "out_ids"),
        0.0,
        "ids",
    )?;
    Ok(())
}

fn interpolation_parity(dev: &Device) -> anyhow::Result<()> {
    let (pe, fx) = from_fixture(dev, Interpolation::ToSequenceLength)?;
    for n in [5usize, 13, 16, 37] {
        // Each value is one lerp of two f32 table entries (|v| < 0.1): 1e-7 covers the
        // difference between our f64 and PyTorch's f32 source coordinate.
        assert_close(
            &pe.interpolated(n)?,
            get(&fx, &format!("interp_{n}")),
            1e-7,
            &format!("interp {n}"),
        )?;
    }
    // The seeds' module at twice the trained length.
    assert_close(
        &pe.forward(get(&fx, "x16"))?,
        get(&fx, "out16"),
        1e-6,
        "forward at 2L",
    )?;
    Ok(())
}

fn interpolation_gradients(dev: &Device) -> anyhow::Result<()> {
    let fx = fixture("learned.safetensors", dev)?;
    for n in [5usize, 13, 16, 37] {
        let table = Var::from_tensor(get(&fx, "table"))?;
        let cfg = LearnedConfig::new(6).with_max_len(8);
        let pe = LearnedPositionalEncoding::from_table(&cfg, table.as_tensor().clone())?;
        let loss = (pe.interpolated(n)? * get(&fx, &format!("interp_{n}_upstream")))?.sum_all()?;
        let grads = loss.backward()?;
        let grad = grads
            .get(table.as_tensor())
            .expect("the table gets a gradient");
        assert_close(
            grad,
            get(&fx, &format!("interp_{n}_grad")),
            1e-5,
            &format!("grad {n}"),
        )?;
    }
    Ok(())
}

fn fixed_interpolation_length(dev: &Device) -> anyhow::Result<()> {
    let (pe, _) = from_fixture(dev, Interpolation::ToLength(16))?;
    let stretched = pe.interpolated(16)?;
    // Every decoding step reads the same stretched table, before max_len (8) and past it, and
    // so does a whole chunk: a position means the same in each (steps below max_len used to
    // read the unstretched table, so a cached decoder saw them move; an outside probe found
    // it).
    let x = Tensor::zeros((1, 1, 6), DType::F32, dev)?;
    for p in [0usize, 3, 7, 8, 12, 15] {
        let y = pe.forward_with_positions(&x, &Positions::Offset(p), false)?;
        assert_close(&y.squeeze(0)?, &stretched.narrow(0, p, 1)?, 0.0, "step")?;
    }
    for (start, len) in [(0, 5), (2, 6), (0, 16)] {
        let chunk = Tensor::zeros((1, len, 6), DType::F32, dev)?;
        let y = pe.forward_with_positions(&chunk, &Positions::Offset(start), false)?;
        let want = stretched.narrow(0, start, len)?;
        assert_close(&y.squeeze(0)?, &want, 0.0, "chunk")?;
    }
    assert!(
        (stretched.narrow(0, 0, 8)? - pe.weight())?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?
            > 1e-3,
        "the stretched rows below max_len differ from the table's"
    );
    let err = pe
        .forward_with_positions(&x, &Positions::Offset(16), false)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::PositionOutOfRange {
                position: 16,
                len: 16,
                ..
            }
        ),
        "{err}"
    );
    Ok(())
}

fn varbuilder_init_and_names(dev: &Device) -> anyhow::Result<()> {
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let pe =
        LearnedPositionalEncoding::new(&LearnedConfig::new(32).with_max_len(256), vb.pp("wpe"))?;
    let data = varmap.data().lock().expect("lock");
    let w = data.get("wpe.weight").expect("variable named wpe.weight");
    assert_eq!(w.dims(), &[256, 32]);
    // N(0, 0.02): the sample std of 8192 draws is within 10% of 0.02.
    let std = w
        .as_tensor()
        .sqr()?
        .mean_all()?
        .sqrt()?
        .to_scalar::<f32>()?;
    assert!((std - 0.02).abs() < 0.002, "std {std}");
    assert_eq!(pe.weight().dims(), &[256, 32]);
    Ok(())
}

fn gradients_reach_the_table(dev: &Device) -> anyhow::Result<()> {
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let cfg = LearnedConfig::new(4).with_max_len(8).with_dropout(0.0);
    let pe = LearnedPositionalEncoding::new(&cfg, vb)?;
    let x = Tensor::zeros((2, 3, 4), DType::F32, dev)?;
    let loss = pe
        .forward_with_positions(&x, &Positions::Offset(2), true)?
        .sum_all()?;
    let grads = loss.backward()?;
    let g = grads.get(pe.weight()).expect("gradient");
    // Rows 2..5 are used once per batch item (2), the others never.
    let expected: Vec<f32> = (0..8)
        .flat_map(|r| [if (2..5).contains(&r) { 2.0 } else { 0.0 }; 4])
        .collect();
    assert_close(g, &Tensor::from_vec(expected, (8, 4), dev)?, 0.0, "grad")?;
    Ok(())
}

fn bad_input(dev: &Device) -> anyhow::Result<()> {
    let vb = VarBuilder::zeros(DType::F32, dev);
    for cfg in [
        LearnedConfig::new(0),
        LearnedConfig::new(4).with_max_len(0),
        LearnedConfig::new(4).with_max_len(1 << 40),
        LearnedConfig::new(4).with_dropout(-0.1),
        LearnedConfig::new(4)
            .with_max_len(8)
            .with_interpolation(Interpolation::ToLength(4)),
    ] {
        let err = LearnedPositionalEncoding::new(&cfg, vb.clone()).unwrap_err();
        assert!(matches!(err, Error::InvalidConfig { .. }), "{err}");
    }
    let pe = LearnedPositionalEncoding::new(&LearnedConfig::new(4).with_max_len(8), vb.clone())?;
    // Sequence longer than the table.
    let err = pe
        .forward(&Tensor::zeros((1, 9, 4), DType::F32, dev)?)
        .unwrap_err();
    assert!(
        err.to_string().contains("position 8 is past the end"),
        "{err}"
    );
    let x = Tensor::zeros((1, 3, 4), DType::F32, dev)?;
    // Offset past the table.
    let err = pe
        .forward_with_positions(&x, &Positions::Offset(6), false)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::PositionOutOfRange {
                position: 8,
                len: 8,
                ..
            }
        ),
        "{err}"
    );
    // Ids past the table.
    let ids = Positions::ids(&Tensor::new(&[[0u32, 1, 8]], dev)?)?;
    let err = pe.forward_with_positions(&x, &ids, false).unwrap_err();
    assert!(
        matches!(err, Error::PositionOutOfRange { position: 8, .. }),
        "{err}"
    );
    // Wrong width and rank.
    let err = pe
        .forward_with_positions(
            &Tensor::zeros((1, 3, 5), DType::F32, dev)?,
            &Positions::Offset(0),
            false,
        )
        .unwrap_err();
    assert!(matches!(err, Error::Shape { .. }), "{err}");
    let err = pe
        .forward_with_positions(
            &Tensor::zeros((1, 1, 3, 4), DType::F32, dev)?,
            &Positions::Offset(0),
            false,
        )
        .unwrap_err();
    assert!(matches!(err, Error::Rank { got: 4, .. }), "{err}");
    // A table whose shape disagrees with the config.
    let err = LearnedPositionalEncoding::from_table(
        &LearnedConfig::new(4).with_max_len(8),
        Tensor::zeros((8, 5), DType::F32, dev)?,
    )
    .unwrap_err();
    assert!(matches!(err, Error::Shape { .. }), "{err}");
    // Bad ids: float dtype, negative values, wrong rank.
    assert!(matches!(
        Positions::ids(&Tensor::zeros((1, 3), DType::F32, dev)?),
        Err(Error::DType { .. })
    ));
    assert!(matches!(
        Positions::ids(&Tensor::new(&[[0i64, -1, 2]], dev)?),
        Err(Error::InvalidConfig { .. })
    ));
    assert!(matches!(
        Positions::ids(&Tensor::zeros(3, DType::U32, dev)?),
        Err(Error::Rank { .. })
    ));
    let err = pe.interpolated(0).unwrap_err();
    assert!(matches!(err, Error::InvalidConfig { .. }), "{err}");
    Ok(())
}

/// A causal block whose encoding is the table stretched to a fixed length decodes token by
/// token, through a KV cache and past `max_len`, to what one forward over the sequence gives.
fn fixed_length_decodes_as_one_forward(dev: &Device) -> anyhow::Result<()> {
    let (pe, _) = from_fixture(dev, Interpolation::ToLength(16))?;
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let attn = MultiHeadAttention::new(
        &AttentionConfig::new(6, 2).with_causal(true),
        Some(Arc::new(pe)),
        vb,
    )?;
    let x = common::randn(0f32, 1.0, (2, 12, 6), dev)?;
    let full = attn.forward(&x)?;
    let mut cache = KvCache::new();
    let opts = AttentionOptions::default();
    let mut steps = Vec::new();
    for t in 0..12 {
        let step = attn.forward_with(&x.narrow(1, t, 1)?, &opts, Some(&mut cache))?;
        steps.push(step.output);
    }
    assert_close(&Tensor::cat(&steps, 1)?, &full, 1e-5, "decoded")?;
    Ok(())
}

device_tests!(
    forward_parity,
    interpolation_parity,
    interpolation_gradients,
    fixed_interpolation_length,
    fixed_length_decodes_as_one_forward,
    varbuilder_init_and_names,
    gradients_reach_the_table,
    bad_input,
);
