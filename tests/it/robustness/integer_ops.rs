//! Every operation on integer tensors that runs on the block's device (position ids, distances,
//! bucket and column maps, padding masks, token ids, KV-cache ids), written once and run on
//! each device (`cpu::`, and `cuda::` / `metal::` with the feature): candle's CUDA kernels have
//! no integer `abs`, `neg` or i64 ↔ half casts, so a path that used one would fail only on a
//! GPU. The crate's audit of these paths is in `docs/gpu.md`.

use crate::common;

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_posenc::absolute::embeddings::{Embeddings, EmbeddingsConfig};
use candle_posenc::plug::{Columns, RelativeBias, RelativeValues};
use candle_posenc::{AttentionConfig, AttentionOptions, Error, KvCache, Positions};

/// The ids of two sequences of five tokens, in `dtype`, on `dev`.
fn ids(dtype: DType, dev: &Device) -> anyhow::Result<Tensor> {
    let ids = Tensor::new(&[[3u32, 4, 6, 7, 9], [0, 2, 3, 5, 8]], &Device::Cpu)?;
    Ok(ids.to_dtype(dtype)?.to_device(dev)?)
}

/// Every zoo encoding with positions as u8, u32 and i64 ids and padding masks of every
/// accepted dtype (under a causal mask, a sliding window and chunked attention), on `dev`,
/// gives the CPU's output: the device's go through the distances, buckets, column maps and
/// masks built from integer tensors there. The device's call asks for the weights, so that
/// on the CPU too it takes another path (the row pass) than the reference (the fused core).
fn ids_and_padding_of_every_dtype(dev: &Device) -> anyhow::Result<()> {
    let cpu = Device::Cpu;
    let (d_model, heads) = (32, 4);
    let x = common::randn(0f32, 1.0, (2, 5, d_model), &cpu)?;
    let shapes = [
        AttentionConfig::new(d_model, heads)
            .with_kv_heads(2)
            .with_causal(true),
        AttentionConfig::new(d_model, heads)
            .with_causal(true)
            .with_sliding_window(Some(2)),
        AttentionConfig::new(d_model, heads)
            .with_causal(true)
            .with_attention_chunk(Some(2)),
        AttentionConfig::new(d_model, heads),
    ];
    for (s, attn) in shapes.iter().enumerate() {
        for (i, config) in common::zoo::configs(d_model, heads, 8).iter().enumerate() {
            // The window and chunk shapes with a few encodings only: the masks are the point.
            if s > 0 && i % 5 != 0 {
                continue;
            }
            let (on_cpu, varmap) = common::zoo::attention(config, attn, DType::F32, &cpu)?;
            let on_dev = common::zoo::attention_from(config, attn, &varmap, DType::F32, dev)?;
            for id_dtype in [DType::U8, DType::U32, DType::I64] {
                let p_cpu = Positions::ids(&ids(id_dtype, &cpu)?)?;
                let p_dev = Positions::ids(&ids(id_dtype, dev)?)?;
                for pad_dtype in [DType::U8, DType::U32, DType::I64, DType::F32] {
                    let pad = Tensor::new(&[[1u32, 1, 1, 1, 1], [0, 1, 1, 1, 1]], &cpu)?
                        .to_dtype(pad_dtype)?;
                    let pad_dev = pad.to_device(dev)?;
                    let want = on_cpu.forward_with(
                        &x,
                        &AttentionOptions {
                            positions: Some(&p_cpu),
                            padding_mask: Some(&pad),
                            ..Default::default()
                        },
                        None,
                    )?;
                    let got = on_dev.forward_with(
                        &x.to_device(dev)?,
                        &AttentionOptions {
                            positions: Some(&p_dev),
                            padding_mask: Some(&pad_dev),
                            return_weights: true,
                            ..Default::default()
                        },
                        None,
                    )?;
                    let what = format!(
                        "shape {s}, {}, ids {id_dtype:?}, padding {pad_dtype:?}",
                        common::zoo::label(i, config)
                    );
                    let got = got.output.to_device(&cpu)?;
                    common::assert_close_scaled(&got, &want.output, 1e-5, 1e-5, &what)?;
                }
            }
        }
    }
    Ok(())
}

/// A KV cache fed chunks positioned by ids of each integer dtype, truncated, and fed again,
/// equals the same tokens in one chunk, for every zoo encoding (the cache's ids are
/// concatenated, repeated and read back by `truncate` on the device).
fn cache_with_ids_of_every_dtype(dev: &Device) -> anyhow::Result<()> {
    let (d_model, heads) = (32, 4);
    let attn = AttentionConfig::new(d_model, heads).with_causal(true);
    let x = common::randn(0f32, 1.0, (2, 5, d_model), dev)?;
    for (i, config) in common::zoo::configs(d_model, heads, 8).iter().enumerate() {
        let (mha, _) = common::zoo::attention(config, &attn, DType::F32, dev)?;
        for id_dtype in [DType::U8, DType::U32, DType::I64] {
            let all = ids(id_dtype, dev)?;
            let at = |t: &Tensor| Positions::ids(t);
            let whole = mha.forward_with(
                &x,
                &AttentionOptions {
                    positions: Some(&at(&all)?),
                    ..Default::default()
                },
                None,
            )?;
            let mut cache = KvCache::new();
            let chunk = |cache: &mut KvCache, lo: usize, n: usize| -> anyhow::Result<Tensor> {
                let p = at(&all.narrow(1, lo, n)?)?;
                let opts = AttentionOptions {
                    positions: Some(&p),
                    ..Default::default()
                };
                Ok(mha
                    .forward_with(&x.narrow(1, lo, n)?, &opts, Some(cache))?
                    .output)
            };
            chunk(&mut cache, 0, 3)?;
            chunk(&mut cache, 3, 2)?; // then undone
            cache.truncate(3)?;
            assert_eq!(cache.len(), 3);
            let last = chunk(&mut cache, 3, 2)?;
            let what = format!("{} ids {id_dtype:?}", common::zoo::label(i, config));
            // Decoding and the whole chunk take different paths: within 1e-5 of the largest
            // output (random blocks reach ~15, where an f32 ulp is 1e-6).
            let want = whole.output.narrow(1, 3, 2)?;
            common::assert_close_scaled(&last, &want, 1e-5, 1e-5, &what)?;
        }
    }
    Ok(())
}

/// `j − i` between id positions of each integer dtype and offsets, computed on the device.
fn distances_of_every_id_dtype(dev: &Device) -> anyhow::Result<()> {
    for dtype in [DType::U8, DType::U32, DType::I64] {
        let q = Positions::ids(&ids(dtype, dev)?.narrow(1, 3, 2)?)?;
        let d = Positions::relative_distances(&q, 2, &Positions::Offset(0), 3, dev)?;
        let want: Vec<Vec<Vec<i64>>> = vec![
            vec![vec![-7, -6, -5], vec![-9, -8, -7]],
            vec![vec![-5, -4, -3], vec![-8, -7, -6]],
        ];
        assert_eq!(d.to_dtype(DType::I64)?.to_vec3::<i64>()?, want, "{dtype:?}");
    }
    Ok(())
}

/// A relative bias expanded on the device through a shift and through an index map, and a
/// value term summed through both, in bf16: the column maps are u32 tensors there.
fn relative_columns_on_the_device(dev: &Device) -> anyhow::Result<()> {
    let values = Tensor::new(&[[[[0f32, 10.0, 20.0, 30.0]]]], dev)?; // (1, 1, 1, 4)
    let shift = RelativeBias::new(values.clone(), Columns::Shift(1))?.to_dense(2, 3)?;
    // c(i, j) = clamp(j − i + 1, 0, 3)
    let want = vec![vec![10f32, 20.0, 30.0], vec![0.0, 10.0, 20.0]];
    assert_eq!(shift.squeeze(0)?.squeeze(0)?.to_vec2::<f32>()?, want);
    let index = Tensor::new(&[[[3u32, 0, 7], [1, 1, 2]]], dev)?; // 7 clamps to 3
    let mapped = RelativeBias::new(values, Columns::Index(index.clone()))?.to_dense(2, 3)?;
    let want = vec![vec![30f32, 0.0, 30.0], vec![10.0, 10.0, 20.0]];
    assert_eq!(mapped.squeeze(0)?.squeeze(0)?.to_vec2::<f32>()?, want);

    let table = Tensor::new(&[[1f32, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]], dev)?;
    let probs = Tensor::new(&[[[[0.5f32, 0.25, 0.25], [1.0, 0.0, 0.0]]]], dev)?; // (1, 1, 2, 3)
    for dtype in [DType::F32, DType::BF16] {
        let (t, p) = (table.to_dtype(dtype)?, probs.to_dtype(dtype)?);
        let by_shift = RelativeValues::new(t.clone(), Columns::Shift(1))?.weighted_sum(&p)?;
        // row 0 reads columns 1, 2, 3; row 1 reads 0, 1, 2.
        let want = vec![vec![4.5f32, 5.5], vec![1.0, 2.0]];
        let got = by_shift
            .to_dtype(DType::F32)?
            .squeeze(0)?
            .squeeze(0)?
            .to_vec2::<f32>()?;
        assert_eq!(got, want, "{dtype:?} shift");
        let by_index = RelativeValues::new(t, Columns::Index(index.clone()))?.weighted_sum(&p)?;
        // row 0 reads columns 3, 0, 3; row 1 reads 1, 1, 2.
        let want = vec![vec![5.5f32, 6.5], vec![3.0, 4.0]];
        let got = by_index
            .to_dtype(DType::F32)?
            .squeeze(0)?
            .squeeze(0)?
            .to_vec2::<f32>()?;
        assert_eq!(got, want, "{dtype:?} index");
    }
    Ok(())
}

/// Padding masks of a dtype not every backend compares (i16, i32) are a typed error on every
/// device, where they used to work on the CPU and fail inside a CUDA kernel.
fn padding_of_other_integer_dtypes_is_refused(dev: &Device) -> anyhow::Result<()> {
    let vb = VarBuilder::zeros(DType::F32, dev);
    let mha = candle_posenc::MultiHeadAttention::new(&AttentionConfig::new(8, 2), None, vb)?;
    let x = Tensor::ones((1, 4, 8), DType::F32, dev)?;
    for dtype in [DType::I16, DType::I32] {
        let pad = Tensor::ones((1, 4), DType::U8, &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(dev)?;
        let opts = AttentionOptions {
            padding_mask: Some(&pad),
            ..Default::default()
        };
        let err = mha.forward_with(&x, &opts, None).unwrap_err();
        assert!(
            matches!(
                err,
                Error::DType {
                    what: "padding mask",
                    ..
                }
            ),
            "{dtype:?}: {err}"
        );
    }
    Ok(())
}

/// Token ids past the vocabulary (or negative) are refused on every device: a GPU's gather
/// does not check its ids, and read outside the table. Good ids of each dtype give the CPU's
/// rows.
fn token_ids_are_checked_on_every_device(dev: &Device) -> anyhow::Result<()> {
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::BF16, &Device::Cpu);
    let config = EmbeddingsConfig::new(10, 8);
    let on_cpu = Embeddings::new(&config, None, vb)?;
    let table = on_cpu.weight().clone();
    let vb = VarBuilder::from_tensors(
        [("weight".to_string(), table.clone())]
            .into_iter()
            .collect(),
        DType::BF16,
        dev,
    );
    let on_dev = Embeddings::new(&config, None, vb)?;
    for dtype in [DType::U8, DType::U32, DType::I64] {
        let good = ids(dtype, dev)?;
        let rows = on_dev.forward_t(&good, false)?.to_device(&Device::Cpu)?;
        let want = on_cpu.forward_t(&ids(dtype, &Device::Cpu)?, false)?;
        common::assert_close(&rows, &want, 0.0, &format!("{dtype:?}"))?;
        let past = Tensor::new(&[[1u32, 10]], &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(dev)?;
        let err = on_dev.forward_t(&past, false).unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidConfig {
                    name: "token id",
                    ..
                }
            ),
            "{dtype:?}: {err}"
        );
    }
    let negative = Tensor::new(&[[1i64, -1]], dev)?;
    let err = on_dev.forward_t(&negative, false).unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidConfig {
                name: "token id",
                ..
            }
        ),
        "{err}"
    );
    Ok(())
}

device_tests!(
    ids_and_padding_of_every_dtype,
    cache_with_ids_of_every_dtype,
    distances_of_every_id_dtype,
    relative_columns_on_the_device,
    padding_of_other_integer_dtypes_is_refused,
    token_ids_are_checked_on_every_device,
);
