//! The input layer: token embeddings plus an absolute encoding, added once, with positions that
//! continue from a cache offset; bad token ids are typed errors.

use crate::common;

use std::sync::Arc;

use candle_core::{DType, Device, IndexOp, Module, Tensor};
use candle_nn::VarMap;
use candle_posenc::absolute::embeddings::{Embeddings, EmbeddingsConfig};
use candle_posenc::{
    Error, LearnedConfig, LearnedPositionalEncoding, Positions, SinusoidalConfig,
    SinusoidalPositionalEncoding,
};
use common::assert_close;

fn embeddings_add_positions_once(dev: &Device) -> anyhow::Result<()> {
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let wpe = LearnedPositionalEncoding::new(
        &LearnedConfig::new(8).with_max_len(16).with_dropout(0.5),
        vb.pp("wpe"),
    )?;
    let table = wpe.weight().clone();
    let embed = Embeddings::new(
        &EmbeddingsConfig::new(10, 8),
        Some(Arc::new(wpe)),
        vb.pp("wte"),
    )?;
    let tokens = Tensor::new(&[[1u32, 7, 7, 0], [9, 2, 3, 4]], dev)?;
    let want = embed
        .weight()
        .index_select(&tokens.flatten_all()?, 0)?
        .reshape((2, 4, 8))?
        .broadcast_add(&table.narrow(0, 0, 4)?.unsqueeze(0)?)?;
    assert_close(&embed.forward(&tokens)?, &want, 0.0, "positions 0..4")?;
    // Decoding: the chunk 2..4 at offset 2 equals the same rows of the whole forward.
    let tail = embed.forward_with(&tokens.i((.., 2..))?, &Positions::Offset(2), false)?;
    assert_close(&tail, &want.i((.., 2..))?, 0.0, "offset 2")?;
    // Dropout in training only (the encoding's 0.5): some entries zeroed, the rest scaled.
    let dropped = embed.forward_t(&tokens, true)?;
    let zeros = dropped
        .eq(0f32)?
        .to_dtype(DType::F32)?
        .sum_all()?
        .to_scalar::<f32>()?;
    assert!(zeros > 0.0, "dropout in training");
    // No encoding: the token rows alone; a sinusoidal one adds its table.
    let plain = Embeddings::new(&EmbeddingsConfig::new(10, 8), None, vb.pp("wte"))?;
    let rows = embed
        .weight()
        .index_select(&tokens.flatten_all()?, 0)?
        .reshape((2, 4, 8))?;
    assert_close(&plain.forward(&tokens)?, &rows, 0.0, "no encoding")?;
    let sin = SinusoidalPositionalEncoding::new(&SinusoidalConfig::new(8), dev)?;
    let pe = sin.encodings(4)?;
    let with_sin = Embeddings::new(
        &EmbeddingsConfig::new(10, 8),
        Some(Arc::new(sin)),
        vb.pp("wte"),
    )?;
    assert_close(
        &with_sin.forward(&tokens)?,
        &rows.broadcast_add(&pe.unsqueeze(0)?)?,
        1e-6,
        "sinusoidal",
    )?;
    Ok(())
}

fn bad_token_ids(dev: &Device) -> anyhow::Result<()> {
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let embed = Embeddings::new(&EmbeddingsConfig::new(10, 8), None, vb.pp("wte"))?;
    let at0 = Positions::Offset(0);
    let cases = [
        ("id 10 of 10", Tensor::new(&[[3u32, 10]], dev)?),
        ("negative id", Tensor::new(&[[-1i64, 2]], dev)?),
        ("float ids", Tensor::new(&[[1f32, 2.0]], dev)?),
        ("rank 1", Tensor::new(&[1u32, 2], dev)?),
    ];
    for (what, tokens) in cases {
        match embed.forward_with(&tokens, &at0, false) {
            Err(Error::InvalidConfig { .. } | Error::DType { .. } | Error::Rank { .. }) => {}
            other => panic!("{what}: {other:?}"),
        }
    }
    for bad in [EmbeddingsConfig::new(0, 8), EmbeddingsConfig::new(10, 0)] {
        assert!(matches!(bad.validate(), Err(Error::InvalidConfig { .. })));
    }
    let ints = common::seeded_vb(&varmap, DType::U32, dev);
    assert!(matches!(
        Embeddings::new(&EmbeddingsConfig::new(10, 8), None, ints),
        Err(Error::DType { .. })
    ));
    Ok(())
}

device_tests!(embeddings_add_positions_once, bad_token_ids);
