//! No silent fallbacks (issue 42, class 5): positions that lack the axes a rotation reads are
//! refused alike by every entry point that takes them (the rotate functions, `cos_sin`, the
//! plug's `rotate` hook, `Module::forward`, the block, a loaded HF layer), with
//! [`Error::Positions`] naming what was given and what was expected; where HF gives one
//! position per token a meaning (M-RoPE's text, all three axes alike) it is kept, exactly.
//! And the HF readers agree: every `model_type` of the registry loads through
//! `HfAttentionConfig`, and `RopeConfig::from_hf_json` reads its rotation, or both refuse the
//! file with one error, or (latent attention, and attention without RoPE) the RoPE reader
//! refuses it pointing at `HfAttentionConfig`, which loads it; rotations take their config
//! classes' defaults, never a generic model's.

use crate::common;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarMap;
use candle_posenc::{
    AttentionConfig, AttentionContext, AttentionOptions, AxialRope, Checkpoint, EncodingConfig,
    Error, HfAttentionConfig, KvCache, MultiHeadAttention, PositionIds, PositionalEncoding,
    Positions, QkLayout, RopeConfig, RopeKernel, RopeMixed, RopeMixedConfig, RotaryEmbedding,
};
use common::{assert_close, get};

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::BF16, DType::F16];
const KERNELS: [RopeKernel; 2] = [RopeKernel::Fused, RopeKernel::Ops];

/// Positions with one position per token for a batch of `b` sequences of `t` tokens: offsets,
/// and ids of the batch's size or shared, each with the words the error names it by.
fn one_per_token(b: usize, t: usize, dev: &Device) -> anyhow::Result<Vec<(Positions, String)>> {
    let ids = |rows: usize| -> anyhow::Result<Positions> {
        let start = Tensor::arange(0u32, rows as u32, dev)?.reshape((rows, 1))?;
        let ids = Tensor::arange(0u32, t as u32, dev)?
            .reshape((1, t))?
            .broadcast_add(&(start * 3.0)?)?;
        Ok(Positions::Ids(PositionIds::new(&ids)?))
    };
    Ok(vec![
        (Positions::Offset(0), "an offset (tokens at 0, 1, …)".into()),
        (Positions::Offset(7), "an offset (tokens at 7, 8, …)".into()),
        (ids(b)?, format!("ids of shape [{b}, {t}]")),
        (ids(1)?, format!("ids of shape [1, {t}]")),
    ])
}

/// Multimodal positions `(3, 2, 6)`: two images of six patches, a 2 × 3 grid and a 3 × 2 one
/// (temporal 0, the patch's row, its column).
fn two_grids(dev: &Device) -> anyhow::Result<Positions> {
    let rows: [[u32; 6]; 2] = [[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 2, 2]];
    let cols: [[u32; 6]; 2] = [[0, 1, 2, 0, 1, 2], [0, 1, 0, 1, 0, 1]];
    let axes = Tensor::stack(
        &[
            Tensor::zeros((2, 6), DType::U32, dev)?,
            Tensor::new(&rows, dev)?,
            Tensor::new(&cols, dev)?,
        ],
        0,
    )?;
    Ok(Positions::Ids(PositionIds::multimodal(&axes)?))
}

/// Asserts that `Module::forward`'s error (candle's wrapper keeps only the crate error's text)
/// is the refusal of an offset `0..T` by the encoding whose positions are `what`.
#[track_caller]
fn refused_by_module<T: std::fmt::Debug>(result: candle_core::Result<T>, what: &str, case: &str) {
    match result {
        Err(candle_core::Error::Wrapped(e)) => {
            let text = e.to_string();
            let want = format!(
                "{what} are an offset (tokens at 0, 1, …), one position per token, expected multimodal ids (3, B, T)"
            );
            assert!(text.starts_with(&want), "{case}: {text}");
        }
        other => panic!("{case}: expected the crate's refusal, got {other:?}"),
    }
}

/// Asserts `result` is the refusal of `given` by the encoding whose positions are `what`.
#[track_caller]
fn refused<T: std::fmt::Debug>(result: Result<T, Error>, what: &str, given: &str, case: &str) {
    match result {
        Err(Error::Positions {
            what: w,
            got,
            expected,
        }) => {
            assert_eq!(w, what, "{case}");
            assert!(
                got.starts_with(given),
                "{case}: got {got:?}, given {given:?}"
            );
            assert!(got.contains("one position per token"), "{case}: {got}");
            assert!(
                expected.contains("multimodal ids (3, B, T)")
                    && expected.contains("row")
                    && expected.contains("column"),
                "{case}: {expected}"
            );
        }
        other => panic!("{case}: expected Error::Positions, got {other:?}"),
    }
}

/// q `(B, H, T, D)` and k rotated at `positions` through every entry point that rotates them:
/// both at once, both in place (owned), the plug's hook, and one at a time (the keys in the
/// `(B, T, H, D)` layout); each with its name.
fn every_entry_point(
    rope: &RotaryEmbedding,
    q: &Tensor,
    k: &Tensor,
    positions: &Positions,
) -> anyhow::Result<Vec<(&'static str, Tensor, Tensor)>> {
    let (p, t) = (positions, q.dim(2)?);
    let both = rope.rotate_queries_keys(q, k, p, p, QkLayout::Bhtd)?;
    let owned = rope.rotate_queries_keys_owned(q.copy()?, k.copy()?, p, p, QkLayout::Bhtd)?;
    let hook = rope.rotate(q.copy()?, k.copy()?, &AttentionContext::new(p, t, p, t))?;
    let keys = rope.rotate_keys(&k.transpose(1, 2)?.contiguous()?, p, QkLayout::Bthd)?;
    let one = (
        rope.rotate_queries(q, p, QkLayout::Bhtd)?,
        keys.transpose(1, 2)?,
    );
    Ok(vec![
        ("rotate_queries_keys", both.0, both.1),
        ("rotate_queries_keys_owned", owned.0, owned.1),
        ("PositionalEncoding::rotate", hook.0, hook.1),
        ("rotate_queries, rotate_keys", one.0, one.1),
    ])
}

/// Every entry point refuses `bad` (described as `given`) where the queries, the keys or both
/// sit there (the others at `good`), before anything is rotated: the owned entry point leaves
/// its queries and keys as they were. Also `cos_sin` and, where the device runs empty
/// tensors, an empty batch.
fn refused_everywhere(
    rope: &RotaryEmbedding,
    (q, k): (&Tensor, &Tensor),
    (bad, good): (&Positions, &Positions),
    given: &str,
    case: &str,
) -> anyhow::Result<()> {
    let what = "axial RoPE positions";
    let t = q.dim(2)?;
    let q_bthd = q.transpose(1, 2)?.contiguous()?;
    refused(
        rope.rotate_queries(q, bad, QkLayout::Bhtd),
        what,
        given,
        case,
    );
    refused(
        rope.rotate_keys(&q_bthd, bad, QkLayout::Bthd),
        what,
        given,
        case,
    );
    refused(rope.cos_sin(bad, t), what, given, case);
    for (qp, kp) in [(bad, good), (good, bad), (bad, bad)] {
        refused(
            rope.rotate_queries_keys(q, k, qp, kp, QkLayout::Bhtd),
            what,
            given,
            case,
        );
        let (q_owned, k_owned) = (q.copy()?, k.copy()?);
        let (q_seen, k_seen) = (q_owned.clone(), k_owned.clone());
        let owned = rope.rotate_queries_keys_owned(q_owned, k_owned, qp, kp, QkLayout::Bhtd);
        refused(owned, what, given, case);
        assert_close(&q_seen, q, 0.0, case)?;
        assert_close(&k_seen, k, 0.0, case)?;
        let ctx = AttentionContext::new(qp, t, kp, t);
        refused(rope.rotate(q.clone(), k.clone(), &ctx), what, given, case);
    }
    let shared = !matches!(bad, Positions::Ids(ids) if ids.batch() > 1);
    if shared && common::holds_empty(q.device()) {
        let (_, h, _, d) = q.dims4()?;
        let empty = Tensor::zeros((0, h, t, d), q.dtype(), q.device())?;
        refused(
            rope.rotate_queries(&empty, bad, QkLayout::Bhtd),
            what,
            given,
            case,
        );
    }
    Ok(())
}

/// Axial 2-D RoPE (every layout, both kernels, every float dtype) refuses an offset and ids
/// without axes at every entry point (`Module::forward` included), the empty batch too,
/// before anything is rotated; at multimodal positions the entry points agree. It used to
/// rotate such positions as one-dimensional ones, silently.
fn axial_rope_refuses_one_position_per_token(dev: &Device) -> anyhow::Result<()> {
    let grid = two_grids(dev)?;
    for layout in [
        AxialRope::EvenOdd,
        AxialRope::Repeated,
        AxialRope::SplitHalves,
    ] {
        for kernel in KERNELS {
            let config = RopeConfig::new(16)
                .with_axial(Some(layout))
                .with_kernel(kernel);
            let rope = RotaryEmbedding::new(&config, dev)?;
            for dtype in FLOATS {
                let case = format!("{layout:?} {kernel:?} {dtype:?}");
                let q = common::randn(0f32, 1.0, (2, 2, 6, 16), dev)?.to_dtype(dtype)?;
                let k = common::randn(0f32, 1.0, (2, 1, 6, 16), dev)?.to_dtype(dtype)?;
                for (bad, given) in one_per_token(2, 6, dev)? {
                    let case = format!("{case} at {given}");
                    refused_everywhere(&rope, (&q, &k), (&bad, &grid), &given, &case)?;
                }
                let module = format!("{case} Module::forward");
                refused_by_module(rope.forward(&q), "axial RoPE positions", &module);
                let rotations = every_entry_point(&rope, &q, &k, &grid)?;
                let (_, qr, kr) = &rotations[0];
                for (entry, qe, ke) in &rotations {
                    assert_close(qe, qr, 0.0, &format!("{case} {entry}"))?;
                    assert_close(ke, kr, 0.0, &format!("{case} {entry}"))?;
                }
                assert_eq!(rope.cos_sin(&grid, 6)?.0.dims(), &[2, 6, 8], "{case}");
            }
        }
    }
    Ok(())
}

/// The multimodal fixture (`generate.py rotary_mrope`): HF's rotations and their configs.
fn mrope_fixture(dev: &Device) -> anyhow::Result<Checkpoint> {
    let path = format!(
        "{}/tests/fixtures/rotary_mrope.safetensors",
        env!("CARGO_MANIFEST_DIR")
    );
    Ok(Checkpoint::load(path, dev)?)
}

/// The vision encoders' axial RoPE as their `config.json` reads it (Pixtral, the Qwen2-VL and
/// Qwen2.5-VL vision towers, Gemma 4's), against HF's rotation at the patch grid
/// (`rotary_mrope.safetensors`), through every entry point; each refuses an offset and ids
/// without axes.
fn vision_rope_entry_points_match_hf_or_refuse(dev: &Device) -> anyhow::Result<()> {
    let file = mrope_fixture(dev)?;
    let fx = file.tensors();
    // The 4 × 6 grid the fixture rotates at, one image: rows, then columns in a row.
    let segment = candle_posenc::MropeSegment::Grid {
        t: 1,
        h: 4,
        w: 6,
        time_interval: 1.0,
    };
    let (axes, _) = candle_posenc::rotary::mrope::mrope_positions(&[segment])?;
    let axes = Tensor::from_vec(axes, (3, 1, 24), dev)?;
    let grid = Positions::Ids(PositionIds::multimodal(&axes)?);
    let (q, k) = (get(fx, "pixtral.q"), get(fx, "pixtral.k"));
    for name in [
        "pixtral",
        "qwen2_vl_vision",
        "qwen2_5_vl_vision",
        "gemma4_vision",
    ] {
        let want = |x: &str| get(fx, &format!("{name}.{x}"));
        let config = RopeConfig::from_hf_json(&file.metadata()[name])?;
        assert!(config.axial.is_some(), "{name}");
        for kernel in KERNELS {
            let case = format!("{name} {kernel:?}");
            let rope = RotaryEmbedding::new(&config.clone().with_kernel(kernel), dev)?;
            for (entry, qe, ke) in every_entry_point(&rope, q, k, &grid)? {
                assert_close(&qe, want("q_rot"), 1e-5, &format!("{case} {entry}"))?;
                assert_close(&ke, want("k_rot"), 1e-5, &format!("{case} {entry}"))?;
            }
            for (bad, given) in one_per_token(1, 24, dev)? {
                let case = format!("{case} at {given}");
                refused_everywhere(&rope, (q, k), (&bad, &grid), &given, &case)?;
            }
            let module = format!("{case} Module::forward");
            refused_by_module(rope.forward(q), "axial RoPE positions", &module);
        }
    }
    Ok(())
}

/// M-RoPE at one position per token keeps HF's meaning: Qwen2-VL's and Qwen3-VL's text models
/// expand `(B, T)` ids (and the cache's positions) to the same id on all three axes
/// (`position_ids[None].expand(3, …)`), which is plain RoPE. So at every entry point and in
/// every float dtype an offset or ids rotate exactly as three equal axes and as the same
/// configuration without bands (`Module::forward` too), and the fixture's text tokens (HF's
/// `get_rope_index` positions, HF's rotation) rotate at their offset as HF rotates them.
fn mrope_keeps_hf_meaning_of_one_position_per_token(dev: &Device) -> anyhow::Result<()> {
    let file = mrope_fixture(dev)?;
    let fx = file.tensors();
    let hf_positions = get(fx, "positions").to_dtype(DType::I64)?; // (3, 1, T)
    let t = hf_positions.dim(2)?;
    let axes: Vec<Vec<i64>> = (0..3)
        .map(|a| Ok(hf_positions.get(a)?.flatten_all()?.to_vec1::<i64>()?))
        .collect::<anyhow::Result<_>>()?;
    for name in ["qwen2_vl", "qwen3_vl"] {
        let config = RopeConfig::from_hf_json(&file.metadata()[name])?;
        assert!(config.mrope.is_some(), "{name}");
        let want = |x: &str, start: usize| get(fx, &format!("{name}.{x}")).narrow(2, start, 3);
        for kernel in KERNELS {
            let config = config.clone().with_kernel(kernel);
            let rope = RotaryEmbedding::new(&config, dev)?;
            let plain = RotaryEmbedding::new(&config.clone().with_mrope(None), dev)?;
            // HF's text tokens, the first three and the last three, each at one position on
            // all axes: at that position as an offset they rotate as HF rotated them.
            for start in [0, t - 3] {
                let p = axes[0][start];
                for (i, at) in (start..start + 3).zip(p..) {
                    let token: Vec<i64> = axes.iter().map(|a| a[i]).collect();
                    assert_eq!(token, [at, at, at], "{name}: text token {i}");
                }
                let part = |x: &str| -> anyhow::Result<Tensor> {
                    Ok(get(fx, &format!("{name}.{x}"))
                        .narrow(2, start, 3)?
                        .contiguous()?)
                };
                let (q, k) = (part("q")?, part("k")?);
                let at = Positions::Offset(p as usize);
                for (entry, qe, ke) in every_entry_point(&rope, &q, &k, &at)? {
                    let case = format!("{name} {kernel:?} {entry} at {p}");
                    assert_close(&qe, &want("q_rot", start)?, 1e-5, &case)?;
                    assert_close(&ke, &want("k_rot", start)?, 1e-5, &case)?;
                }
            }
            for dtype in FLOATS {
                let case = format!("{name} {kernel:?} {dtype:?}");
                let q = common::randn(0f32, 1.0, (2, 2, 6, 32), dev)?.to_dtype(dtype)?;
                let k = common::randn(0f32, 1.0, (2, 1, 6, 32), dev)?.to_dtype(dtype)?;
                for (one, given) in one_per_token(2, 6, dev)? {
                    let case = format!("{case} at {given}");
                    let ids = one.to_ids(6, dev)?;
                    let b = ids.dim(0)?;
                    let three = ids.unsqueeze(0)?.broadcast_as((3, b, 6))?.contiguous()?;
                    let equal = Positions::Ids(PositionIds::multimodal(&three)?);
                    let (_, qe, ke) = &every_entry_point(&rope, &q, &k, &equal)?[0];
                    let (_, qp, kp) = &every_entry_point(&plain, &q, &k, &one)?[0];
                    assert_close(qe, qp, 0.0, &format!("{case}: equal axes are plain RoPE"))?;
                    assert_close(ke, kp, 0.0, &format!("{case}: equal axes are plain RoPE"))?;
                    for (entry, qr, kr) in every_entry_point(&rope, &q, &k, &one)? {
                        assert_close(&qr, qe, 0.0, &format!("{case} {entry}"))?;
                        assert_close(&kr, ke, 0.0, &format!("{case} {entry}"))?;
                    }
                    let (cos, _) = rope.cos_sin(&one, 6)?;
                    assert_close(&cos, &rope.cos_sin(&equal, 6)?.0, 0.0, &case)?;
                }
                let zero = Positions::Offset(0);
                let want = plain.rotate_queries(&q, &zero, QkLayout::Bhtd)?;
                assert_close(&rope.forward(&q)?, &want, 0.0, &format!("{case} forward"))?;
            }
        }
    }
    Ok(())
}

/// RoPE-Mixed reads rows and columns through the same check: its entry point, the plug's hook
/// and the block refuse one position per token with the same error.
fn rope_mixed_refuses_one_position_per_token(dev: &Device) -> anyhow::Result<()> {
    let what = "RoPE-Mixed positions";
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let mixed = RopeMixed::new(&RopeMixedConfig::new(2, 8), vb.pp("rope"))?;
    let block = MultiHeadAttention::new(
        &AttentionConfig::new(16, 2),
        Some(std::sync::Arc::new(mixed.clone())),
        vb.pp("attn"),
    )?;
    let grid = two_grids(dev)?;
    for dtype in FLOATS {
        let q = common::randn(0f32, 1.0, (2, 2, 6, 8), dev)?.to_dtype(dtype)?;
        for (bad, given) in one_per_token(2, 6, dev)? {
            let case = format!("{dtype:?} at {given}");
            refused(mixed.rotate_one(&q, &bad), what, &given, &case);
            let ctx = AttentionContext::new(&bad, 6, &grid, 6);
            refused(
                mixed.rotate(q.clone(), q.clone(), &ctx),
                what,
                &given,
                &case,
            );
            let ctx = AttentionContext::new(&grid, 6, &bad, 6);
            refused(
                mixed.rotate(q.clone(), q.clone(), &ctx),
                what,
                &given,
                &case,
            );
        }
        assert_eq!(mixed.rotate_one(&q, &grid)?.dims(), q.dims(), "{dtype:?}");
    }
    let x = common::randn(0f32, 1.0, (2, 6, 16), dev)?;
    for (bad, given) in one_per_token(2, 6, dev)? {
        let opts = AttentionOptions {
            positions: Some(&bad),
            ..Default::default()
        };
        refused(block.forward_with(&x, &opts, None), what, &given, "block");
    }
    refused_by_module(block.forward(&x), what, "block Module::forward");
    Ok(())
}

/// The HF vision layers whose rotation is axial (fixture tags in `hf_layers.safetensors`).
const VISION_LAYERS: [&str; 9] = [
    "pixtral",
    "pixtral_default",
    "qwen2_vl_vision",
    "min.qwen2_vl_vision",
    "qwen2_5_vl_vision.1",
    "min.qwen3_vl_vision",
    "qwen3_vl_moe_vision",
    "gemma4_vision",
    "min.gemma4_vision",
];

/// The HF layers fixture (`generate.py hf_layers`): HF's modules, their tensors and
/// `config.json` texts.
fn hf_layers(dev: &Device) -> anyhow::Result<Checkpoint> {
    let path = format!(
        "{}/tests/fixtures/hf_layers.safetensors",
        env!("CARGO_MANIFEST_DIR")
    );
    Ok(Checkpoint::load(path, dev)?)
}

/// The `config.json` of fixture `tag`, read for its layer.
fn hf_config(ckpt: &Checkpoint, tag: &str) -> anyhow::Result<HfAttentionConfig> {
    let meta = ckpt.metadata();
    let layer = meta[&format!("{tag}.layer")].parse()?;
    Ok(HfAttentionConfig::from_json_layer(&meta[tag], layer)?)
}

/// A vision encoder's attention layer loaded from its `config.json` and HF's tensors refuses
/// to run at one position per token, through `Module::forward`, `forward_with` and a KV cache
/// (left as it was), in every float dtype; at the patches' rows and columns it equals HF's
/// module. (A Pixtral layer at `Positions::Offset(0)` used to be 0.81 off HF's, silently.)
fn vision_layers_refuse_one_position_per_token(dev: &Device) -> anyhow::Result<()> {
    let what = "axial RoPE positions";
    let ckpt = hf_layers(dev)?;
    let meta = ckpt.metadata();
    for tag in VISION_LAYERS {
        let config = hf_config(&ckpt, tag)?;
        let prefix = format!("{tag}/{}", meta[&format!("{tag}.prefix")]);
        let x = get(ckpt.tensors(), &format!("{tag}.x"));
        let want = get(ckpt.tensors(), &format!("{tag}.out"));
        let grid = Positions::Ids(PositionIds::multimodal(get(
            ckpt.tensors(),
            &format!("{tag}.positions"),
        ))?);
        let (b, t, _) = x.dims3()?;
        for dtype in FLOATS {
            let block = config.load(ckpt.var_builder(dtype, dev).pp(&prefix))?;
            let x = x.to_dtype(dtype)?;
            for (bad, given) in one_per_token(b, t, dev)? {
                let case = format!("{tag} {dtype:?} at {given}");
                let opts = AttentionOptions {
                    positions: Some(&bad),
                    ..Default::default()
                };
                refused(block.forward_with(&x, &opts, None), what, &given, &case);
                let mut cache = KvCache::new();
                refused(
                    block.forward_with(&x, &opts, Some(&mut cache)),
                    what,
                    &given,
                    &case,
                );
                assert!(cache.is_empty(), "{case}: the cache is left as it was");
            }
            refused_by_module(
                block.forward(&x),
                what,
                &format!("{tag} {dtype:?} Module::forward"),
            );
            let opts = AttentionOptions {
                positions: Some(&grid),
                ..Default::default()
            };
            let got = block.forward_with(&x, &opts, None)?.output;
            if dtype == DType::F32 {
                assert_close(&got, want, 1e-5, tag)?;
            } else {
                assert_eq!(got.dims(), want.dims(), "{tag} {dtype:?}");
            }
        }
    }
    Ok(())
}

/// One `config.json` text of a vision encoder of `model_type`, 32 wide with 4 heads of 8 (each
/// class's width and head keys given), with `extra` keys.
fn vision_file(model_type: &str, extra: &str) -> String {
    format!(
        r#"{{"model_type": "{model_type}", "hidden_size": 32, "embed_dim": 32,
            "num_attention_heads": 4, "num_heads": 4, "num_key_value_heads": 4,
            "head_dim": 8{extra}}}"#
    )
}

/// The `config.json` error of `result`: its key and problem.
#[track_caller]
fn hf_refusal<T: std::fmt::Debug>(result: Result<T, Error>) -> (String, String) {
    match result {
        Err(Error::HfConfig { key, problem }) => (key, problem),
        other => panic!("expected Error::HfConfig, got {other:?}"),
    }
}

/// The two HF readers agree on every type whose rotation the RoPE reader takes as a vision
/// encoder's or as latent attention's: each loads through `HfAttentionConfig` (with the RoPE
/// reader's rotation), or both refuse the file with the same error. The Qwen2/2.5/3-VL and
/// Gemma 4 vision encoders used to be refused by `HfAttentionConfig` (their fused `qkv` had no
/// loader), and their files without rotary parameters were read as plain RoPE (HF's classes
/// make them axial); `kimi_k2` was refused by both, each pointing at the other.
fn hf_readers_agree_on_every_type(dev: &Device) -> anyhow::Result<()> {
    let ckpt = hf_layers(dev)?;
    let meta = ckpt.metadata();
    // Each vision layer rotates as the RoPE reader reads its file, axial even where the file
    // names no rotary type ("min." files).
    for tag in VISION_LAYERS {
        let config = hf_config(&ckpt, tag)?;
        let rope = RopeConfig::from_hf_json(&meta[tag])?;
        assert!(rope.axial.is_some(), "{tag}");
        assert_eq!(config.encoding, EncodingConfig::Rotary(rope), "{tag}");
    }
    // Kimi K2's files are DeepSeek V3's under another name (HF maps the type): the same
    // layer, equal to HF's DeepSeek V3 module; the RoPE reader refuses its latent rotation
    // and points at HfAttentionConfig, which loads it.
    for tag in ["deepseek_v3", "min.deepseek_v3"] {
        let mut file: serde_json::Value = serde_json::from_str(&meta[tag])?;
        file["model_type"] = "kimi_k2".into();
        let kimi = file.to_string();
        let config = HfAttentionConfig::from_json(&kimi)?;
        assert_eq!(config, HfAttentionConfig::from_json(&meta[tag])?, "{tag}");
        let prefix = format!("{tag}/{}", meta[&format!("{tag}.prefix")]);
        let block = config.load(ckpt.var_builder(DType::F32, dev).pp(prefix))?;
        let x = get(ckpt.tensors(), &format!("{tag}.x"));
        let got = block.forward_with(x, &AttentionOptions::default(), None)?;
        assert_close(
            &got.output,
            get(ckpt.tensors(), &format!("{tag}.out")),
            1e-5,
            tag,
        )?;
        let (key, problem) = hf_refusal(RopeConfig::from_hf_json(&kimi));
        assert_eq!(key, "model_type", "{tag}");
        assert!(problem.contains("HfAttentionConfig"), "{tag}: {problem}");
    }
    // A vision encoder's file: without rotary parameters both readers take HF's axial RoPE;
    // with another type both refuse it with one error (HF's rotary embeddings fail on it).
    let visions = [
        ("pixtral", ""),
        ("qwen2_vl_vision", ""),
        ("qwen2_5_vl_vision", r#", "fullatt_block_indexes": [0]"#),
        ("qwen3_vl_vision", ""),
        ("qwen3_vl_moe_vision", ""),
        ("gemma4_vision", ""),
    ];
    for (model_type, extra) in visions {
        let plain = vision_file(model_type, extra);
        let rope = RopeConfig::from_hf_json(&plain)?;
        assert!(rope.axial.is_some(), "{model_type}");
        let layer = HfAttentionConfig::from_json(&plain)?;
        assert_eq!(layer.encoding, EncodingConfig::Rotary(rope), "{model_type}");
        let linear = vision_file(
            model_type,
            &format!(r#"{extra}, "rope_parameters": {{"rope_type": "linear", "factor": 2.0}}"#),
        );
        let from_rope = hf_refusal(RopeConfig::from_hf_json(&linear));
        assert_eq!(from_rope.0, "rope_parameters.rope_type", "{model_type}");
        assert!(
            from_rope.1.contains("only axial 2-D RoPE"),
            "{}",
            from_rope.1
        );
        assert_eq!(
            hf_refusal(HfAttentionConfig::from_json(&linear)),
            from_rope,
            "{model_type}"
        );
    }
    // A type without a row: the layer reader refuses it as unknown.
    let file = r#"{"model_type": "unknown_type", "hidden_size": 32, "num_attention_heads": 4}"#;
    let (key, problem) = hf_refusal(HfAttentionConfig::from_json(file));
    assert_eq!(key, "model_type");
    assert!(problem.contains("expected one of llama"), "{problem}");
    // A vision type without a row: its layout is not guessed (it used to read as Qwen's).
    let unknown = vision_file(
        "paddleocr_vl_vision",
        r#", "rope_parameters": {"rope_type": "axial"}"#,
    );
    let (key, problem) = hf_refusal(RopeConfig::from_hf_json(&unknown));
    assert_eq!(key, "rope_parameters.rope_type");
    assert!(problem.contains("not known"), "{problem}");
    Ok(())
}

/// What the vision encoders' layers have that the block does not build is refused under its
/// key: Qwen2.5-VL's windowed layers (those `fullatt_block_indexes` does not list, 7, 15, 23
/// and 31 by default), Gemma 4's clipped linears; and a `head_dim` that the Qwen-VL
/// attention does not split by (HF fails on it).
fn vision_layers_refuse_what_the_block_lacks(_dev: &Device) -> anyhow::Result<()> {
    let qwen25 = |extra: &str| vision_file("qwen2_5_vl_vision", extra);
    for (file, layer, listed) in [
        (qwen25(""), 0, false),
        (qwen25(""), 6, false),
        (qwen25(""), 7, true),
        (qwen25(""), 31, true),
        (qwen25(r#", "fullatt_block_indexes": [1]"#), 0, false),
        (qwen25(r#", "fullatt_block_indexes": [1]"#), 1, true),
    ] {
        match HfAttentionConfig::from_json_layer(&file, layer) {
            Ok(config) if listed => assert!(!config.attention.causal, "layer {layer}"),
            Err(Error::HfConfig { key, problem }) if !listed => {
                assert_eq!(key, "fullatt_block_indexes", "layer {layer}");
                assert!(
                    problem.contains(&format!("does not list layer {layer}"))
                        && problem.contains("windows"),
                    "{problem}"
                );
            }
            other => panic!("layer {layer} (listed {listed}): {other:?}"),
        }
    }
    // from_json reads layer 0, a windowed one by default.
    let (key, _) = hf_refusal(HfAttentionConfig::from_json(&qwen25("")));
    assert_eq!(key, "fullatt_block_indexes");
    let (key, problem) = hf_refusal(HfAttentionConfig::from_json(&qwen25(
        r#", "fullatt_block_indexes": "all""#,
    )));
    assert_eq!(key, "fullatt_block_indexes");
    assert!(problem.contains("list of layer indices"), "{problem}");
    let (key, problem) = hf_refusal(HfAttentionConfig::from_json(&vision_file(
        "gemma4_vision",
        r#", "use_clipped_linears": true"#,
    )));
    assert_eq!(key, "use_clipped_linears");
    assert!(problem.contains("does not support"), "{problem}");
    for model_type in ["qwen2_vl_vision", "qwen3_vl_vision", "qwen3_vl_moe_vision"] {
        let file = vision_file(model_type, "").replace(r#""head_dim": 8"#, r#""head_dim": 16"#);
        let (key, problem) = hf_refusal(HfAttentionConfig::from_json(&file));
        assert_eq!(key, "head_dim", "{model_type}");
        assert!(problem.contains("is 16"), "{problem}");
    }
    Ok(())
}

/// Rotations take their config classes' defaults for the keys a file leaves out, as HF does,
/// rather than a generic model's (θ 10000, the width over the heads, the whole head):
/// Cohere's θ 500000, GLM's and GLM-4's heads of 128 half of which rotate, ERNIE 4.5's θ
/// 500000 with heads of 128 (Helium's θ 100000 with its layer), CodeGen's first 64 features at θ 10000 whatever
/// `rope_theta` says. Against each model's own rotary embedding and apply function
/// (`generate.py rotary_class_defaults`), both kernels.
fn rotations_take_their_class_defaults(dev: &Device) -> anyhow::Result<()> {
    let file = Checkpoint::load(
        format!(
            "{}/tests/fixtures/rotary_class_defaults.safetensors",
            env!("CARGO_MANIFEST_DIR")
        ),
        dev,
    )?;
    let fx = file.tensors();
    let positions = Positions::Ids(PositionIds::new(get(fx, "positions"))?);
    // Helium's file (64 wide, 4 heads of the class's 128) is one whose model HF fails to
    // build (its output projection takes 64 features): both readers refuse it alike (its
    // rotation, from a file HF builds, is checked with its layer in `hf::layers`).
    let helium = &file.metadata()["helium"];
    let (key, problem) = hf_refusal(RopeConfig::from_hf_json(helium));
    assert_eq!(key, "head_dim");
    assert!(problem.contains("is 128"), "{problem}");
    assert_eq!(
        hf_refusal(HfAttentionConfig::from_json(helium)),
        (key, problem)
    );
    for name in ["cohere", "glm", "glm4", "ernie4_5", "codegen"] {
        let config = RopeConfig::from_hf_json(&file.metadata()[name])?;
        let (q, k) = (get(fx, &format!("{name}.q")), get(fx, &format!("{name}.k")));
        assert_eq!(config.head_dim, q.dim(3)?, "{name}");
        for kernel in KERNELS {
            let rope = RotaryEmbedding::new(&config.clone().with_kernel(kernel), dev)?;
            for (entry, qe, ke) in every_entry_point(&rope, q, k, &positions)? {
                let case = format!("{name} {kernel:?} {entry}");
                assert_close(&qe, get(fx, &format!("{name}.q_rot")), 1e-5, &case)?;
                assert_close(&ke, get(fx, &format!("{name}.k_rot")), 1e-5, &case)?;
            }
        }
    }
    Ok(())
}

device_tests!(
    axial_rope_refuses_one_position_per_token,
    vision_rope_entry_points_match_hf_or_refuse,
    mrope_keeps_hf_meaning_of_one_position_per_token,
    rope_mixed_refuses_one_position_per_token,
    vision_layers_refuse_one_position_per_token,
    hf_readers_agree_on_every_type,
    vision_layers_refuse_what_the_block_lacks,
    rotations_take_their_class_defaults,
);

/// Whether `e` is the RoPE reader's refusal of a layer whose rotation it does not read alone
/// (latent attention, or another encoding), pointing at `HfAttentionConfig`.
fn points_at_layer_reader(e: &Error) -> bool {
    matches!(e, Error::HfConfig { key, problem }
        if ["model_type", "alibi"].contains(&key.as_str())
            && problem.contains("read the layer with HfAttentionConfig"))
}

/// The rows whose rotary parameters are one entry per layer type.
const PER_LAYER_TYPE: [&str; 5] = [
    "gemma3_text",
    "gemma4_text",
    "modernbert",
    "gemma4",
    "llama4",
];

/// A minimal `config.json` of `model_type`: 256 wide, 2 heads of 128 and 2 key/value heads
/// under every key some class reads them from, nested under `text_config` too (a
/// vision-language wrapper's language model), and Qwen2.5-VL's vision layer 0 listed as a
/// full-attention one.
fn minimal_file(model_type: &str) -> String {
    // Ministral's class has no head width of its own (HF's attention fails without one).
    let head = match model_type {
        "ministral" => r#", "head_dim": 128"#,
        _ => "",
    };
    let sizes = format!(
        r#""hidden_size": 256, "n_embd": 256, "d_model": 256, "embed_dim": 256,
        "num_attention_heads": 2, "n_head": 2, "num_heads": 2, "n_heads": 2,
        "num_key_value_heads": 2, "fullatt_block_indexes": [0]{head}"#
    );
    format!(r#"{{"model_type": "{model_type}", {sizes}, "text_config": {{{sizes}}}}}"#)
}

/// The class (issue 42, class 5): for every `model_type` of the registry, a minimal file, and
/// the same file with a defect both readers see (an unknown `rope_type`, a width the heads do
/// not divide), is either read by both readers, or refused by both with the same error, or
/// refused by the RoPE reader alone under `model_type` (or Falcon's `alibi`) pointing at
/// `HfAttentionConfig`, which reads it: a layer whose rotation is part of latent attention,
/// or that has another encoding.
#[test]
fn hf_readers_agree_on_every_registered_type() -> anyhow::Result<()> {
    let mut refused_by_both = 0;
    for model_type in candle_posenc::hf::model_types() {
        let minimal = minimal_file(model_type);
        let files = [
            minimal.clone(),
            minimal.replace(
                r#""num_key_value_heads": 2"#,
                r#""num_key_value_heads": 2, "rope_parameters": {"rope_type": "sideways"}"#,
            ),
            minimal.replace("256", "255"),
        ];
        for (i, file) in files.iter().enumerate() {
            // The per-layer-type classes do not read flat rotary parameters (Gemma 3's and
            // Gemma 4's keep them beside their own entries, ModernBERT's refuses them).
            if i == 1 && PER_LAYER_TYPE.contains(&model_type) {
                continue;
            }
            let case = format!("{model_type} file {i}");
            let layer = HfAttentionConfig::from_json(file);
            let rope = RopeConfig::from_hf_json(file);
            if i == 0 {
                assert!(layer.is_ok(), "{case}: {layer:?}");
            }
            match (layer, rope) {
                (Ok(_), Ok(_)) => {}
                // (Latent attention's rotation is refused by the RoPE reader whatever else
                // the file has.)
                (Err(a), Err(b)) if !points_at_layer_reader(&b) => {
                    assert_eq!(a.to_string(), b.to_string(), "{case}");
                    refused_by_both += 1;
                }
                (Err(_), Err(_)) => {}
                (Ok(layer), Err(e)) => {
                    assert!(points_at_layer_reader(&e), "{case}: {e}");
                    let (_, problem) = hf_refusal(Err::<(), _>(e));
                    assert!(
                        !matches!(layer.encoding, EncodingConfig::Rotary(_))
                            || problem.contains("latent"),
                        "{case}: {problem}"
                    );
                }
                (Err(e), Ok(_)) => {
                    panic!("{case}: the RoPE reader reads a file whose layer is refused: {e}")
                }
            }
        }
    }
    assert!(refused_by_both > 0, "the defects are refused somewhere");
    Ok(())
}
