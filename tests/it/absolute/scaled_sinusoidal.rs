//! Scaled sinusoidal encoding: parity with x-transformers' `ScaledSinusoidalEmbedding` (at an
//! offset, 1-D ids and per-sequence ids) and with its `TransformerWrapper`'s input to the
//! attention layers, the learned `scale` (initial value, checkpoints, gradients), its
//! `EncodingConfig` form, half precision, bad input.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, IndexOp, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_posenc::absolute::embeddings::{Embeddings, EmbeddingsConfig};
use candle_posenc::checkpoint::save_varmap;
use candle_posenc::{
    Checkpoint, EncodingConfig, Error, Positions, ScaledSinusoidalConfig,
    ScaledSinusoidalPositionalEncoding,
};
use common::{assert_close, fixture, get, prefixed};
use serde_json::json;

/// The fixture's cases: width, base, tag.
const CASES: [(usize, f64, &str); 3] = [
    (8, 10000.0, "d8_theta10000"),
    (16, 10000.0, "d16_theta10000"),
    (10, 500.0, "d10_theta500"),
];

/// x-transformers' module runs in f32 and stays within 8e-7 of the exact values at the
/// fixture's positions (below 64); ours is the f64 table rounded once to f32.
const TOL: f64 = 2e-6;

/// The encoding of one fixture case, its `scale` read from the fixture under its own name.
fn from_fixture(
    fx: &HashMap<String, Tensor>,
    (d, base, tag): (usize, f64, &str),
    dev: &Device,
) -> anyhow::Result<ScaledSinusoidalPositionalEncoding> {
    let vb = VarBuilder::from_tensors(prefixed(fx, &format!("{tag}.")), DType::F32, dev);
    let cfg = ScaledSinusoidalConfig::new(d).with_base(base);
    Ok(ScaledSinusoidalPositionalEncoding::new(&cfg, vb)?)
}

fn parity_with_x_transformers(dev: &Device) -> anyhow::Result<()> {
    let fx = fixture("scaled_sinusoidal.safetensors", dev)?;
    for case in CASES {
        let tag = case.2;
        let pe = from_fixture(&fx, case, dev)?;
        let x = get(&fx, &format!("{tag}.x"));
        let at = |positions: &Positions| pe.forward_with_positions(x, positions, false);
        let want = |name: &str| get(&fx, &format!("{tag}.{name}"));
        assert_close(&at(&Positions::Offset(7))?, want("out_offset7"), TOL, tag)?;
        // x-transformers' 1-D positions are ids shared by the batch.
        let pos = Positions::ids(&want("pos").unsqueeze(0)?)?;
        assert_close(&at(&pos)?, want("out_pos"), TOL, tag)?;
        let ids = Positions::ids(want("ids"))?;
        assert_close(&at(&ids)?, want("out_ids"), TOL, tag)?;
    }
    Ok(())
}

/// A `VarMap` creates `scale` with x-transformers' initial value, `d_model^−0.5` rounded to f32.
fn initial_scale(dev: &Device) -> anyhow::Result<()> {
    let fx = fixture("scaled_sinusoidal.safetensors", dev)?;
    for (d, base, tag) in CASES {
        let varmap = VarMap::new();
        let vb = common::seeded_vb(&varmap, DType::F32, dev);
        let cfg = ScaledSinusoidalConfig::new(d).with_base(base);
        let pe = ScaledSinusoidalPositionalEncoding::new(&cfg, vb.pp("pos_emb"))?;
        let want = get(&fx, &format!("{tag}.scale_init"));
        assert_close(pe.scale(), want, 0.0, tag)?;
        let vars = varmap.data().lock().expect("lock");
        assert_eq!(vars.keys().collect::<Vec<_>>(), ["pos_emb.scale"]);
    }
    Ok(())
}

/// `TransformerWrapper(scaled_sinu_pos_emb=True)` adds the embedding to its token embeddings
/// unscaled: the crate's input layer with the wrapper's own tensors, under its names, gives the
/// input its attention layers received.
fn transformer_wrapper_input(dev: &Device) -> anyhow::Result<()> {
    let fx = fixture("scaled_sinusoidal.safetensors", dev)?;
    let vb = VarBuilder::from_tensors(prefixed(&fx, "wrapper."), DType::F32, dev);
    let pe =
        ScaledSinusoidalPositionalEncoding::new(&ScaledSinusoidalConfig::new(8), vb.pp("pos_emb"))?;
    let embed = Embeddings::new(
        &EmbeddingsConfig::new(20, 8),
        Some(Arc::new(pe)),
        vb.pp("token_emb.emb"),
    )?;
    let h = embed.forward_with(get(&fx, "wrapper.tokens"), &Positions::Offset(4), false)?;
    assert_close(&h, get(&fx, "wrapper.h_at_4"), TOL, "wrapper")?;
    Ok(())
}

/// Gradients reach `scale` through a `VarMap`, as torch autograd's of `Σ w·(x + emb)`.
fn gradient_reaches_scale(dev: &Device) -> anyhow::Result<()> {
    let fx = fixture("scaled_sinusoidal.safetensors", dev)?;
    for (d, base, tag) in CASES {
        let mut varmap = VarMap::new();
        let vb = common::seeded_vb(&varmap, DType::F32, dev);
        let cfg = ScaledSinusoidalConfig::new(d).with_base(base);
        let pe = ScaledSinusoidalPositionalEncoding::new(&cfg, vb)?;
        varmap.set_one("scale", get(&fx, &format!("{tag}.scale")))?;
        let x = get(&fx, &format!("{tag}.x"));
        let y = pe.forward_with_positions(x, &Positions::Offset(7), true)?;
        let loss = (y * get(&fx, &format!("{tag}.upstream")))?.sum_all()?;
        let grads = loss.backward()?;
        let grad = grads.get(pe.scale()).expect("scale gets a gradient");
        // A sum of 80 products, in another order than torch's.
        assert_close(grad, get(&fx, &format!("{tag}.scale_grad")), 1e-5, tag)?;
    }
    Ok(())
}

/// The sines come first, then the cosines, at `base^(−i / half)`; growth past `max_len`, ids
/// and offsets read the same rows.
fn layout_growth_and_positions(dev: &Device) -> anyhow::Result<()> {
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let cfg = ScaledSinusoidalConfig::new(4).with_max_len(4);
    let pe = ScaledSinusoidalPositionalEncoding::new(&cfg, vb)?;
    // d 4: frequencies 1 and 1/100, scale 4^−0.5 = 0.5.
    let table = pe.encodings(20)?;
    for pos in [0usize, 3, 17] {
        let p = pos as f64;
        let want = [p.sin(), (p / 100.0).sin(), p.cos(), (p / 100.0).cos()].map(|v| 0.5 * v);
        let want = Tensor::new(&want.map(|v| v as f32), dev)?;
        assert_close(&table.i(pos)?, &want, 1e-7, &format!("row {pos}"))?;
    }
    let x = common::randn(0f32, 1.0, (2, 3, 4), dev)?;
    assert_close(
        &pe.forward(&x)?,
        &x.broadcast_add(&table.i(..3)?.unsqueeze(0)?)?,
        0.0,
        "forward",
    )?;
    // Offset 10 reads rows 10..13, past the initial max_len of 4.
    let y = pe.forward_with_positions(&x, &Positions::Offset(10), false)?;
    let want = x.broadcast_add(&table.i(10..13)?.unsqueeze(0)?)?;
    assert_close(&y, &want, 0.0, "offset")?;
    let ids = Positions::ids(&Tensor::new(&[[5u32, 0, 19], [1, 1, 2]], dev)?)?;
    let y = pe.forward_with_positions(&x, &ids, false)?;
    for (b, row) in [[5u32, 0, 19], [1, 1, 2]].iter().enumerate() {
        let rows = table.index_select(&Tensor::new(row, dev)?, 0)?;
        assert_close(&y.i(b)?, &(x.i(b)? + rows)?, 0.0, "ids")?;
    }
    Ok(())
}

/// Written with its configuration and read back from the file alone: the same kind, the same
/// `scale`, the same output; the table is a buffer and is not in the file.
fn checkpoint_round_trip(dev: &Device) -> anyhow::Result<()> {
    let enc = EncodingConfig::ScaledSinusoidal(
        ScaledSinusoidalConfig::new(6)
            .with_base(500.0)
            .with_max_len(16),
    );
    let mut varmap = VarMap::new();
    let built = enc
        .build(common::seeded_vb(&varmap, DType::F32, dev).pp("pos"))?
        .expect("an encoding");
    varmap.set_one("pos.scale", Tensor::new(&[0.9f32], dev)?)?;
    let dir = std::env::temp_dir().join(format!("candle-posenc-ssin-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("scaled_sinusoidal.safetensors");
    save_varmap(&path, &varmap, &enc.to_metadata())?;

    let ckpt = Checkpoint::load(&path, dev)?;
    assert_eq!(ckpt.tensors().keys().collect::<Vec<_>>(), ["pos.scale"]);
    let enc2 = EncodingConfig::from_metadata(ckpt.metadata(), ckpt.source())?;
    assert_eq!(enc2, enc);
    let loaded = enc2
        .build(ckpt.var_builder(DType::F32, dev).pp("pos"))?
        .expect("an encoding");
    let x = common::randn(0f32, 1.0, (2, 5, 6), dev)?;
    let positions = Positions::Offset(3);
    let ctx = candle_posenc::AttentionContext::chunk(&positions, 5);
    let want = built.add_to_input(&x, &ctx)?;
    assert_close(&loaded.add_to_input(&x, &ctx)?, &want, 0.0, "loaded")?;
    // 0.9 reached the output (the initial 6^−0.5 would not give it).
    let ours = ScaledSinusoidalPositionalEncoding::new(
        &ScaledSinusoidalConfig::new(6).with_base(500.0),
        VarBuilder::from_tensors(
            HashMap::from([("scale".to_string(), Tensor::new(&[0.9f32], dev)?)]),
            DType::F32,
            dev,
        ),
    )?;
    let direct = ours.forward_with_positions(&x, &positions, false)?;
    assert_close(&want, &direct, 0.0, "scale 0.9")?;
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// The configuration by hand in JSON, through `EncodingConfig`, and back.
#[test]
fn serde_through_encoding_config() -> anyhow::Result<()> {
    let minimal: EncodingConfig =
        serde_json::from_value(json!({"kind": "scaled_sinusoidal", "d_model": 64}))?;
    assert_eq!(
        minimal,
        EncodingConfig::ScaledSinusoidal(ScaledSinusoidalConfig::new(64))
    );
    assert_eq!(minimal.kind(), "scaled_sinusoidal");
    let full = EncodingConfig::ScaledSinusoidal(
        ScaledSinusoidalConfig::new(32)
            .with_max_len(128)
            .with_base(500.0)
            .with_dropout(0.1),
    );
    let value = serde_json::to_value(&full)?;
    assert_eq!(
        value,
        json!({"kind": "scaled_sinusoidal", "d_model": 32, "max_len": 128, "base": 500.0,
               "dropout": 0.1f32})
    );
    assert_eq!(serde_json::from_value::<EncodingConfig>(value)?, full);
    // Unknown fields (x-transformers' `theta` is `base` here) and a missing width are refused.
    for bad in [
        json!({"kind": "scaled_sinusoidal", "d_model": 8, "theta": 500.0}),
        json!({"kind": "scaled_sinusoidal"}),
    ] {
        assert!(serde_json::from_value::<EncodingConfig>(bad).is_err());
    }
    // Values out of range parse, and are refused by validate.
    let odd: EncodingConfig =
        serde_json::from_value(json!({"kind": "scaled_sinusoidal", "d_model": 7}))?;
    assert!(matches!(
        odd.validate(),
        Err(Error::InvalidConfig {
            name: "d_model",
            ..
        })
    ));
    Ok(())
}

fn dropout_only_in_training(dev: &Device) -> anyhow::Result<()> {
    let cfg = ScaledSinusoidalConfig::new(8).with_dropout(0.5);
    let pe = ScaledSinusoidalPositionalEncoding::new(&cfg, VarBuilder::zeros(DType::F32, dev))?;
    let x = Tensor::ones((4, 16, 8), DType::F32, dev)?;
    assert_close(&pe.forward_t(&x, false)?, &x, 0.0, "eval, scale 0")?;
    let zeros = pe
        .forward_t(&x, true)?
        .eq(0f32)?
        .to_dtype(DType::F32)?
        .mean_all()?
        .to_scalar::<f32>()?;
    assert!(zeros > 0.3 && zeros < 0.7, "dropout 0.5 zeroed {zeros}");
    Ok(())
}

/// Half-precision inputs and a half-precision `scale`: the table stays f32 until the addition.
fn half_precision(dev: &Device) -> anyhow::Result<()> {
    for dtype in [DType::F16, DType::BF16] {
        let varmap = VarMap::new();
        let vb = common::seeded_vb(&varmap, dtype, dev);
        let pe = ScaledSinusoidalPositionalEncoding::new(&ScaledSinusoidalConfig::new(16), vb)?;
        assert_eq!(pe.scale().dtype(), dtype);
        let x = Tensor::zeros((1, 4, 16), dtype, dev)?;
        let y = pe.forward_with_positions(&x, &Positions::Offset(100_000), false)?;
        assert_eq!(y.dtype(), dtype);
        let exact = pe.encodings(100_004)?.i(100_000..)?;
        // One rounding of a value in [-0.25, 0.25] to 8 (bf16) or 11 (f16) mantissa bits.
        assert_close(&y.squeeze(0)?, &exact, 1e-3, "half")?;
    }
    Ok(())
}

fn bad_input(dev: &Device) -> anyhow::Result<()> {
    let vb = VarBuilder::zeros(DType::F32, dev);
    for (cfg, name) in [
        (ScaledSinusoidalConfig::new(0), "d_model"),
        (ScaledSinusoidalConfig::new(7), "d_model"),
        (ScaledSinusoidalConfig::new(8).with_max_len(0), "max_len"),
        (
            ScaledSinusoidalConfig::new(8).with_max_len(1 << 40),
            "max_len",
        ),
        (ScaledSinusoidalConfig::new(8).with_base(f64::NAN), "base"),
        (ScaledSinusoidalConfig::new(8).with_base(1.0), "base"),
        (ScaledSinusoidalConfig::new(8).with_dropout(1.0), "dropout"),
    ] {
        let err = ScaledSinusoidalPositionalEncoding::new(&cfg, vb.clone()).unwrap_err();
        assert!(
            matches!(err, Error::InvalidConfig { name: n, .. } if n == name),
            "{err}"
        );
    }
    let cfg = ScaledSinusoidalConfig::new(8);
    // A checkpoint without `scale`, with another shape, or an integer VarBuilder.
    let empty = VarBuilder::from_tensors(HashMap::new(), DType::F32, dev);
    let err = ScaledSinusoidalPositionalEncoding::new(&cfg, empty.pp("pos")).unwrap_err();
    assert!(
        matches!(&err, Error::MissingTensor { name } if name == "pos.scale"),
        "{err}"
    );
    let two = HashMap::from([("scale".to_string(), Tensor::ones(2, DType::F32, dev)?)]);
    let err = ScaledSinusoidalPositionalEncoding::new(
        &cfg,
        VarBuilder::from_tensors(two, DType::F32, dev),
    )
    .unwrap_err();
    assert!(matches!(err, Error::TensorShape { .. }), "{err}");
    let err = ScaledSinusoidalPositionalEncoding::new(&cfg, VarBuilder::zeros(DType::U32, dev))
        .unwrap_err();
    assert!(matches!(err, Error::DType { .. }), "{err}");

    let pe = ScaledSinusoidalPositionalEncoding::new(&cfg, vb)?;
    let at = |x: &Tensor, p: &Positions| pe.forward_with_positions(x, p, false);
    let offset = Positions::Offset(0);
    let err = at(&Tensor::zeros((4, 8), DType::F32, dev)?, &offset).unwrap_err();
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
    let err = at(&Tensor::zeros((1, 4, 6), DType::F32, dev)?, &offset).unwrap_err();
    assert!(matches!(err, Error::Shape { .. }), "{err}");
    let err = at(&Tensor::zeros((1, 4, 8), DType::U32, dev)?, &offset).unwrap_err();
    assert!(matches!(err, Error::DType { .. }), "{err}");
    let x = Tensor::zeros((2, 4, 8), DType::F32, dev)?;
    let ids = Positions::ids(&Tensor::zeros((3, 4), DType::U32, dev)?)?;
    let err = at(&x, &ids).unwrap_err();
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
    // Absurd positions are refused, not allocated.
    let err = at(&x, &Positions::Offset(1 << 30)).unwrap_err();
    assert!(matches!(err, Error::InvalidConfig { .. }), "{err}");
    // The `Module` impl reports the same errors through candle's error type.
    assert!(pe.forward(&Tensor::zeros(8, DType::F32, dev)?).is_err());
    Ok(())
}

device_tests!(
    parity_with_x_transformers,
    initial_scale,
    transformer_wrapper_input,
    gradient_reaches_scale,
    layout_growth_and_positions,
    checkpoint_round_trip,
    dropout_only_in_training,
    half_precision,
    bad_input,
);
