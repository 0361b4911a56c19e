//! Vision inputs as HF gives them (`candle_posenc::vision`): patch rows and columns in each
//! tower's order, `cu_seqlens` and the block-diagonal mask of packed images, against HF's own
//! code (`generate.py vision_inputs`: Pixtral's `PixtralVisionModel`, Qwen2-VL's
//! `get_vision_position_ids` and `get_vision_cu_seqlens`), and a whole vision layer over
//! packed images through the helpers equal to HF's.

use crate::common;

use candle_core::{DType, Device, Tensor};
use candle_posenc::attention::AttentionOptions;
use candle_posenc::checkpoint::Checkpoint;
use candle_posenc::hf::HfAttentionConfig;
use candle_posenc::limits::BudgetScope;
use candle_posenc::positions::{PositionIds, Positions};
use candle_posenc::vision::{
    block_diagonal_mask, cu_seqlens, patch_rows_cols, PatchGrid, PatchOrder,
};
use candle_posenc::Error;
use common::{assert_close, get};

fn fixture(dev: &Device) -> anyhow::Result<Checkpoint> {
    let path = format!(
        "{}/tests/fixtures/vision_inputs.safetensors",
        env!("CARGO_MANIFEST_DIR")
    );
    Ok(Checkpoint::load(path, dev)?)
}

/// The fixture's grids of `tag` (`[h, w]` or `[t, h, w]` rows).
fn grids(ckpt: &Checkpoint, tag: &str) -> anyhow::Result<Vec<PatchGrid>> {
    let rows: Vec<Vec<usize>> = serde_json::from_str(&ckpt.metadata()[&format!("{tag}.grids")])?;
    Ok(rows
        .iter()
        .map(|r| match r[..] {
            [h, w] => PatchGrid::image(h, w),
            [t, h, w] => PatchGrid { t, h, w },
            _ => panic!("a grid of 2 or 3 sizes: {r:?}"),
        })
        .collect())
}

/// Each tower's order of its tag.
fn order(tag: &str) -> PatchOrder {
    match tag {
        "pixtral" => PatchOrder::RowMajor,
        _ => PatchOrder::MergeBlocks(2),
    }
}

/// Pixtral's rows and columns restart per image; Qwen2-VL's follow merge blocks and repeat
/// per frame; its `cu_seqlens` has a span per frame: each as HF gives them.
fn patch_positions_are_hf(dev: &Device) -> anyhow::Result<()> {
    let ckpt = fixture(dev)?;
    for tag in ["pixtral", "qwen2_vl"] {
        let got = patch_rows_cols(&grids(&ckpt, tag)?, order(tag))?;
        let want: Vec<Vec<i64>> = get(ckpt.tensors(), &format!("{tag}.position_ids")).to_vec2()?;
        let got: Vec<Vec<i64>> = got
            .iter()
            .map(|p| p.iter().map(|&v| i64::from(v)).collect())
            .collect();
        assert_eq!(got, want, "{tag}");
    }
    let spans = cu_seqlens(&grids(&ckpt, "qwen2_vl")?)?;
    // HF's i32, widened on the CPU: candle's CUDA kernels cast nothing from i32.
    let want: Vec<i64> = get(ckpt.tensors(), "qwen2_vl.cu_seqlens")
        .to_device(&Device::Cpu)?
        .to_dtype(DType::I64)?
        .to_vec1()?;
    assert_eq!(spans.iter().map(|&v| v as i64).collect::<Vec<_>>(), want);
    Ok(())
}

/// The mask of Pixtral's two packed images is HF's, value for value.
fn block_mask_is_hf(dev: &Device) -> anyhow::Result<()> {
    let ckpt = fixture(dev)?;
    let spans = cu_seqlens(&grids(&ckpt, "pixtral")?)?;
    let mask = block_diagonal_mask(&spans, DType::F32, dev)?;
    assert_close(
        &mask,
        get(ckpt.tensors(), "pixtral.attention_mask"),
        0.0,
        "mask",
    )?;
    Ok(())
}

/// A vision layer over packed images in one sequence, its positions and mask from the
/// helpers (from the grids, and from HF's `(N, 2)` ids), equals HF's module on the fused core
/// and the row pass.
fn packed_vision_layers_match_hf(dev: &Device) -> anyhow::Result<()> {
    let ckpt = fixture(dev)?;
    let meta = ckpt.metadata();
    for tag in ["pixtral", "qwen2_vl"] {
        let config = HfAttentionConfig::from_json(&meta[tag])?;
        let vb = ckpt.var_builder(DType::F32, dev);
        let block = config.load(vb.pp(format!("{tag}/{}", meta[&format!("{tag}.prefix")])))?;
        let grids = grids(&ckpt, tag)?;
        let mask = block_diagonal_mask(&cu_seqlens(&grids)?, DType::F32, dev)?;
        let hf_ids = get(ckpt.tensors(), &format!("{tag}.position_ids"));
        let all = [
            PositionIds::from_patch_grids(&grids, order(tag), dev)?,
            PositionIds::patches(hf_ids)?,
        ];
        let (x, want) = (
            get(ckpt.tensors(), &format!("{tag}.x")),
            get(ckpt.tensors(), &format!("{tag}.out")),
        );
        for (i, ids) in all.into_iter().enumerate() {
            let positions = Positions::Ids(ids);
            for return_weights in [false, true] {
                let opts = AttentionOptions {
                    positions: Some(&positions),
                    attn_mask: Some(&mask),
                    return_weights,
                    ..Default::default()
                };
                let got = block.forward_with(x, &opts, None)?.output;
                let case = format!("{tag} positions {i} weights {return_weights}");
                assert_close(&got, want, 1e-5, &case)?;
            }
        }
    }
    Ok(())
}

/// What HF fails on, or cannot mean, is refused with typed errors.
fn helpers_refuse_what_hf_cannot_mean(dev: &Device) -> anyhow::Result<()> {
    assert!(matches!(
        patch_rows_cols(&[PatchGrid::image(3, 4)], PatchOrder::MergeBlocks(2)),
        Err(Error::InvalidConfig { .. })
    ));
    assert!(matches!(
        block_diagonal_mask(&[0, 4, 2], DType::F32, dev),
        Err(Error::InvalidConfig { .. })
    ));
    assert!(matches!(
        block_diagonal_mask(&[1, 4], DType::F32, dev),
        Err(Error::InvalidConfig { .. })
    ));
    assert!(matches!(
        block_diagonal_mask(&[0, 4], DType::U32, dev),
        Err(Error::DType { .. })
    ));
    let three = Tensor::zeros((4, 3), DType::U32, dev)?;
    assert!(matches!(
        PositionIds::patches(&three),
        Err(Error::Shape { .. })
    ));
    let flat = Tensor::zeros(4, DType::U32, dev)?;
    assert!(matches!(
        PositionIds::patches(&flat),
        Err(Error::Rank { .. })
    ));
    // Empty spans (an image of no patch) keep the others apart.
    let mask = block_diagonal_mask(&[0, 2, 2, 3], DType::F32, dev)?;
    let row: Vec<f32> = mask.flatten_all()?.narrow(0, 6, 3)?.to_vec1()?;
    assert_eq!(row, [f32::MIN, f32::MIN, 0.0]);
    Ok(())
}

/// Grids whose frames, or whose patches in frames never repeated, pass the budget: the
/// helpers wrote one boundary per frame, and built a grid of no frames patch by patch, before
/// any count was checked (an allocation abort for `t` or `h × w` near 2^40).
#[test]
fn frames_are_budgeted_before_they_are_written() {
    let _scope = BudgetScope::new(1000);
    let many = [PatchGrid {
        t: 1 << 40,
        h: 0,
        w: 0,
    }];
    for got in [
        cu_seqlens(&many).map(drop),
        patch_rows_cols(&many, PatchOrder::RowMajor).map(drop),
    ] {
        let e = got.expect_err("2^40 frames");
        assert!(matches!(e, Error::InvalidConfig { .. }), "{e:?}");
        let text = e.to_string();
        assert!(text.contains("1099511627776 frames"), "{text}");
        assert!(
            text.contains("span boundaries (one per frame, and 0) at most 1000"),
            "{text}"
        );
    }
    // No frames: nothing to lay out, however large the frame.
    let none = [
        PatchGrid {
            t: 0,
            h: 1 << 20,
            w: 1 << 20,
        },
        PatchGrid::image(2, 2),
    ];
    assert_eq!(
        patch_rows_cols(&none, PatchOrder::RowMajor)
            .expect("4 patches")
            .len(),
        4
    );
    assert_eq!(cu_seqlens(&none).expect("one frame"), [0, 4]);
}

device_tests!(
    patch_positions_are_hf,
    block_mask_is_hf,
    packed_vision_layers_match_hf,
    helpers_refuse_what_hf_cannot_mean,
);
