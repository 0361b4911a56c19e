//! safetensors checkpoints: round trips, self-describing metadata, HF names, and every way a
//! file can be wrong.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_posenc::checkpoint::{save, save_varmap};
use candle_posenc::{
    AlibiConfig, AlibiMode, AttentionConfig, AttentionOptions, Checkpoint, ClippedBiasConfig,
    EncodingConfig, Error, FoxConfig, InklingConfig, Interpolation, LearnedConfig,
    LearnedPositionalEncoding, LogScaling, LongRopeScaling, MultiHeadAttention, PositionIds,
    Positions, QkNormConfig, RopeConfig, RopeKernel, RopeLayout, RopeMixedConfig, RopeScaling,
    ScaledSinusoidalConfig, ShawConfig, SinusoidalConfig, T5Config, YarnScaling,
    DEFAULT_LOGITS_BUDGET,
};
use common::{assert_close, fixture, get};
use serde_json::{json, Value};

fn tmp(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("candle-posenc-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join(name)
}

fn self_describing_round_trip(dev: &Device) -> anyhow::Result<()> {
    for enc in [
        EncodingConfig::None,
        EncodingConfig::Sinusoidal(SinusoidalConfig::new(16).with_base(500.0).with_dropout(0.0)),
        EncodingConfig::Learned(
            LearnedConfig::new(16)
                .with_max_len(12)
                .with_interpolation(Interpolation::ToLength(48)),
        ),
    ] {
        let attn = AttentionConfig::new(16, 4)
            .with_kv_heads(2)
            .with_causal(true)
            .with_bias(true);
        let varmap = VarMap::new();
        let vb = common::seeded_vb(&varmap, DType::F32, dev);
        let mha = MultiHeadAttention::new(&attn, enc.build(vb.pp("pos"))?, vb.pp("attn"))?;
        let mut meta = enc.to_metadata();
        meta.extend(attn.to_metadata());
        let path = tmp(&format!("round_trip_{}.safetensors", enc.kind()));
        save_varmap(&path, &varmap, &meta)?;

        // Rebuild from the file alone.
        let ckpt = Checkpoint::load(&path, dev)?;
        let enc2 = EncodingConfig::from_metadata(ckpt.metadata(), ckpt.source())?;
        let attn2 = AttentionConfig::from_metadata(ckpt.metadata(), ckpt.source())?;
        assert_eq!(enc2, enc);
        assert_eq!(attn2, attn);
        let vb2 = ckpt.var_builder(DType::F32, dev);
        let mha2 = MultiHeadAttention::new(&attn2, enc2.build(vb2.pp("pos"))?, vb2.pp("attn"))?;
        let x = common::randn(0f32, 1.0, (2, 5, 16), dev)?;
        // The VarMap's block tracks gradients (so it takes the differentiable path); compare
        // the loaded block with the same weights as plain tensors, on the same path.
        let plain: HashMap<String, Tensor> = varmap
            .data()
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?
            .iter()
            .map(|(k, v)| (k.clone(), v.as_tensor().detach()))
            .collect();
        let vb3 = VarBuilder::from_tensors(plain, DType::F32, dev);
        let mha3 = MultiHeadAttention::new(&attn, enc.build(vb3.pp("pos"))?, vb3.pp("attn"))?;
        assert_close(&mha3.forward(&x)?, &mha2.forward(&x)?, 0.0, enc.kind())?;
        // The tracked block takes the differentiable ops and the loaded one the fused core: the
        // same sums in another order, so this is the crate's f32 tolerance, not bit equality
        // (1e-6 failed on a CI machine for one random input).
        assert_close(&mha.forward(&x)?, &mha2.forward(&x)?, 1e-5, enc.kind())?;
        // The sinusoidal table is a buffer: it is not in the file.
        assert!(ckpt
            .tensors()
            .keys()
            .all(|k| !k.starts_with("pos.") || enc.kind() == "learned"));
    }
    Ok(())
}

fn load_into_restores_a_varmap(dev: &Device) -> anyhow::Result<()> {
    let make = || -> anyhow::Result<(VarMap, LearnedPositionalEncoding)> {
        let varmap = VarMap::new();
        let vb = common::seeded_vb(&varmap, DType::F32, dev);
        let pe =
            LearnedPositionalEncoding::new(&LearnedConfig::new(4).with_max_len(6), vb.pp("wpe"))?;
        Ok((varmap, pe))
    };
    let (a, pe_a) = make()?;
    let path = tmp("load_into.safetensors");
    save_varmap(&path, &a, &HashMap::new())?;
    let (b, pe_b) = make()?;
    assert!(common::max_abs_diff(pe_a.weight(), pe_b.weight())? > 0.0);
    Checkpoint::load(&path, dev)?.load_into(&b)?;
    assert_close(pe_a.weight(), pe_b.weight(), 0.0, "restored")?;
    Ok(())
}

fn load_into_is_all_or_nothing(dev: &Device) -> anyhow::Result<()> {
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let a = vb.get((2, 2), "a")?;
    let _b = vb.get((3,), "b")?;
    let before = a.copy()?;
    let mut tensors = HashMap::new();
    tensors.insert("a".to_string(), Tensor::ones((2, 2), DType::F32, dev)?);
    tensors.insert("b".to_string(), Tensor::ones((4,), DType::F32, dev)?);
    let path = tmp("partial.safetensors");
    save(&path, &tensors, &HashMap::new())?;
    let err = Checkpoint::load(&path, dev)?
        .load_into(&varmap)
        .unwrap_err();
    assert!(
        matches!(&err, Error::TensorShape { name, expected, got } if name == "b" && expected == &[3] && got == &[4]),
        "{err}"
    );
    assert_close(&a, &before, 0.0, "a untouched")?;
    Ok(())
}

fn hf_named_tensors(dev: &Device) -> anyhow::Result<()> {
    let path = format!(
        "{}/tests/fixtures/hf_names.safetensors",
        env!("CARGO_MANIFEST_DIR")
    );
    let ckpt = Checkpoint::load(&path, dev)?;
    let vb = ckpt.var_builder(DType::F32, dev);
    // HF Llama attention weights (GQA: 4 heads, 2 KV heads of width 4) load by prefix.
    let cfg = AttentionConfig::new(16, 4)
        .with_kv_heads(2)
        .with_head_dim(4);
    MultiHeadAttention::new(&cfg, None, vb.pp("model.layers.0.self_attn"))?;
    // GPT-2's `wpe` is a learned table: our forward equals HF's x + wpe(position_ids).
    let pe = LearnedPositionalEncoding::new(
        &LearnedConfig::new(8).with_max_len(12),
        vb.pp("transformer.wpe"),
    )?;
    let fx = fixture("hf_names.safetensors", dev)?;
    assert_close(
        &pe.forward(get(&fx, "gpt2_x"))?,
        get(&fx, "gpt2_out"),
        1e-6,
        "gpt2 wpe",
    )?;
    // A naming scheme of another model can be mapped onto ours.
    let renamed = Checkpoint::load(&path, dev)?
        .renamed(|n| n.strip_prefix("transformer.").map(|s| format!("gpt.{s}")))?;
    assert!(renamed.tensors().contains_key("gpt.wpe.weight"));
    Ok(())
}

fn missing_and_misshapen_tensors(dev: &Device) -> anyhow::Result<()> {
    let path = format!(
        "{}/tests/fixtures/hf_names.safetensors",
        env!("CARGO_MANIFEST_DIR")
    );
    let vb = Checkpoint::load(&path, dev)?.var_builder(DType::F32, dev);
    let err = LearnedPositionalEncoding::new(
        &LearnedConfig::new(8).with_max_len(12),
        vb.pp("bert.position_embeddings"),
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::MissingTensor { name } if name == "bert.position_embeddings.weight"),
        "{err}"
    );
    let err = LearnedPositionalEncoding::new(
        &LearnedConfig::new(8).with_max_len(1024),
        vb.pp("transformer.wpe"),
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::TensorShape { name, expected, got } if name == "transformer.wpe.weight" && expected == &[1024, 8] && got == &[12, 8]),
        "{err}"
    );
    // Llama attention read with the wrong number of KV heads.
    let err = MultiHeadAttention::new(
        &AttentionConfig::new(16, 4),
        None,
        vb.pp("model.layers.0.self_attn"),
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::TensorShape { name, .. } if name == "model.layers.0.self_attn.k_proj.weight"),
        "{err}"
    );
    let ckpt = Checkpoint::load(&path, dev)?;
    assert!(matches!(
        ckpt.get("nope", &[1]),
        Err(Error::MissingTensor { .. })
    ));
    assert!(matches!(
        ckpt.get("transformer.wpe.weight", &[1]),
        Err(Error::TensorShape { .. })
    ));
    Ok(())
}

fn corrupt_files(dev: &Device) -> anyhow::Result<()> {
    let path = format!(
        "{}/tests/fixtures/hf_names.safetensors",
        env!("CARGO_MANIFEST_DIR")
    );
    let bytes = std::fs::read(&path)?;
    // Truncated anywhere: header length, header, data.
    for cut in [0, 4, 8, 20, bytes.len() / 2, bytes.len() - 1] {
        let err = Checkpoint::from_bytes(&bytes[..cut], dev).unwrap_err();
        assert!(
            matches!(err, Error::Checkpoint { .. }),
            "cut at {cut}: {err}"
        );
    }
    // A header length far past the file.
    let mut huge = bytes.clone();
    huge[..8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    assert!(matches!(
        Checkpoint::from_bytes(&huge, dev),
        Err(Error::Checkpoint { .. })
    ));
    // A header that is not JSON.
    let mut garbage = bytes.clone();
    for b in garbage.iter_mut().skip(8).take(16) {
        *b = b'#';
    }
    assert!(matches!(
        Checkpoint::from_bytes(&garbage, dev),
        Err(Error::Checkpoint { .. })
    ));
    // A file that is not there.
    let err = Checkpoint::load("/nonexistent/x.safetensors", dev).unwrap_err();
    assert!(
        matches!(err, Error::Io { .. }) && err.to_string().contains("/nonexistent/x.safetensors"),
        "{err}"
    );
    Ok(())
}

/// `meta` with the JSON under `key` changed by `edit`.
fn edit_json(
    meta: &HashMap<String, String>,
    key: &str,
    edit: impl FnOnce(&mut serde_json::Map<String, Value>),
) -> HashMap<String, String> {
    let mut value: Value = serde_json::from_str(&meta[key]).expect("JSON written by the crate");
    edit(value.as_object_mut().expect("a configuration is an object"));
    let mut meta = meta.clone();
    meta.insert(key.to_string(), value.to_string());
    meta
}

fn lying_metadata(_dev: &Device) -> anyhow::Result<()> {
    let base = EncodingConfig::Learned(LearnedConfig::new(8)).to_metadata();
    assert_eq!(base.keys().collect::<Vec<_>>(), [KEY]);
    edited_fields_are_named(&base);
    entries_that_are_not_json_or_missing();
    non_finite_values_fail_to_load();
    left_out_defaults_and_invalid_values(&base)?;
    attention_metadata_that_lies();
    Ok(())
}

/// The metadata key an encoding's configuration is stored under.
const KEY: &str = candle_posenc::checkpoint::ENCODING_KEY;

/// Each edit of `base`'s JSON (a learned encoding's) fails to load with a checkpoint error
/// naming the file, the key and what is wrong.
fn edited_fields_are_named(base: &HashMap<String, String>) {
    type Edit = Box<dyn FnOnce(&mut serde_json::Map<String, Value>)>;
    let cases: Vec<(Edit, Vec<&str>)> = vec![
        (
            Box::new(|m| {
                m.insert("kind".into(), json!("wavelet"));
            }),
            vec![
                "unknown variant `wavelet`",
                "`none`, `sinusoidal`, `learned`, `alibi`, `t5`, `clipped_bias`, `shaw`, `rotary`",
            ],
        ),
        (
            Box::new(|m| {
                m.remove("kind");
            }),
            vec!["missing field `kind`"],
        ),
        (
            Box::new(|m| {
                m.insert("d_model".into(), json!("eight"));
            }),
            vec![r#"invalid type: string "eight", expected usize"#],
        ),
        (
            Box::new(|m| {
                m.insert("d_model".into(), json!(-8));
            }),
            vec!["invalid value: integer `-8`, expected usize"],
        ),
        (
            Box::new(|m| {
                m.remove("d_model");
            }),
            vec!["missing field `d_model`"],
        ),
        (
            Box::new(|m| {
                m.insert("interpolation".into(), json!("cubic"));
            }),
            vec!["unknown variant `cubic`", "`to_sequence_length`"],
        ),
        (
            Box::new(|m| {
                m.insert("interpolation".into(), json!({"to_length": "far"}));
            }),
            vec![r#"invalid type: string "far""#],
        ),
        (
            Box::new(|m| {
                m.insert("max_lenn".into(), json!(9));
            }),
            vec!["unknown field `max_lenn`"],
        ),
    ];
    for (edit, needles) in cases {
        let m = edit_json(base, KEY, edit);
        let err = EncodingConfig::from_metadata(&m, "f.safetensors").unwrap_err();
        assert!(matches!(err, Error::Checkpoint { .. }), "{err}");
        let text = err.to_string();
        for needle in needles
            .iter()
            .chain(&["f.safetensors", "`posenc.encoding`"])
        {
            assert!(text.contains(needle), "`{needle}` not in: {text}");
        }
    }
}

/// Not JSON at all, and no entry at all.
fn entries_that_are_not_json_or_missing() {
    for (m, needle) in [
        (
            HashMap::from([(KEY.to_string(), "kind=learned".to_string())]),
            "expected value",
        ),
        (HashMap::new(), "missing"),
    ] {
        let err = EncodingConfig::from_metadata(&m, "f").unwrap_err();
        assert!(
            matches!(err, Error::Checkpoint { .. })
                && err.to_string().contains(needle)
                && err.to_string().contains(KEY),
            "{err}"
        );
    }
}

/// JSON has no NaN or infinity (serde_json writes `null`): such a configuration fails to
/// load, optional fields included (`null` is not read as "not set").
fn non_finite_values_fail_to_load() {
    let rope = RopeConfig::new(8);
    let yarn = YarnScaling::new(4.0, 64);
    for (enc, needle) in [
        (
            EncodingConfig::Sinusoidal(SinusoidalConfig::new(8).with_base(f64::NAN)),
            "invalid type: null, expected f64",
        ),
        (
            EncodingConfig::Rotary(rope.clone().with_xpos(f64::NAN)),
            "invalid type: null, expected f64",
        ),
        (
            EncodingConfig::Rotary(rope.clone().with_scaling(RopeScaling::Yarn(
                yarn.clone().with_attention_factor(f64::INFINITY),
            ))),
            "invalid type: null, expected f64",
        ),
        (
            EncodingConfig::Rotary(
                rope.clone()
                    .with_scaling(RopeScaling::Yarn(yarn.with_mscale(f64::NAN, 1.0))),
            ),
            "invalid type: null, expected f64",
        ),
        (
            EncodingConfig::Learned(LearnedConfig::new(8).with_dropout(f32::NAN)),
            "invalid type: null, expected f32",
        ),
    ] {
        let m = enc.to_metadata();
        assert!(m[KEY].contains("null"), "{m:?}");
        let err = EncodingConfig::from_metadata(&m, "f").unwrap_err();
        assert!(
            matches!(err, Error::Checkpoint { .. }) && err.to_string().contains(needle),
            "{enc:?}: {err}"
        );
    }
}

/// A field with a default may be left out: it reads back as the default. Parsable but
/// invalid (an odd sinusoidal width) is an invalid configuration.
fn left_out_defaults_and_invalid_values(base: &HashMap<String, String>) -> anyhow::Result<()> {
    let m = edit_json(base, KEY, |m| {
        m.remove("max_len");
    });
    assert_eq!(
        EncodingConfig::from_metadata(&m, "f")?,
        EncodingConfig::Learned(LearnedConfig::new(8))
    );
    let m = edit_json(
        &EncodingConfig::Sinusoidal(SinusoidalConfig::new(8)).to_metadata(),
        KEY,
        |m| {
            m.insert("d_model".into(), json!(7));
        },
    );
    assert!(matches!(
        EncodingConfig::from_metadata(&m, "f"),
        Err(Error::InvalidConfig {
            name: "d_model",
            ..
        })
    ));
    Ok(())
}

/// The block's metadata: a mistyped field fails to load naming it, a parsable but invalid
/// one is an invalid configuration.
fn attention_metadata_that_lies() {
    let key = candle_posenc::checkpoint::ATTENTION_KEY;
    let m = edit_json(&AttentionConfig::new(16, 4).to_metadata(), key, |m| {
        m.insert("causal".into(), json!("maybe"));
    });
    let err = AttentionConfig::from_metadata(&m, "f").unwrap_err();
    assert!(
        matches!(err, Error::Checkpoint { .. })
            && err.to_string().contains("posenc.attention")
            && err
                .to_string()
                .contains(r#"invalid type: string "maybe", expected a boolean"#),
        "{err}"
    );
    let m = edit_json(&AttentionConfig::new(16, 4).to_metadata(), key, |m| {
        m.insert("num_kv_heads".into(), json!(3));
    });
    assert!(matches!(
        AttentionConfig::from_metadata(&m, "f"),
        Err(Error::InvalidConfig {
            name: "num_kv_heads",
            ..
        })
    ));
}

/// Every encoding (every scaling too) and an attention configuration survive a saved file,
/// next to metadata of the caller's own, which is kept as it is.
fn every_config_round_trips_through_a_checkpoint(dev: &Device) -> anyhow::Result<()> {
    let attn = AttentionConfig::new(16, 4)
        .with_kv_heads(2)
        .with_causal(true);
    let tensors = HashMap::from([("w".to_string(), Tensor::ones((2, 3), DType::F32, dev)?)]);
    for (i, enc) in all_encodings().into_iter().enumerate() {
        let mut meta = enc.to_metadata();
        meta.extend(attn.to_metadata());
        meta.insert("model.name".into(), format!("case {i}"));
        let path = tmp(&format!("every_config_{i}.safetensors"));
        save(&path, &tensors, &meta)?;
        let ckpt = Checkpoint::load(&path, dev)?;
        std::fs::remove_file(&path)?;
        assert_eq!(ckpt.metadata(), &meta);
        assert_eq!(
            EncodingConfig::from_metadata(ckpt.metadata(), ckpt.source())?,
            enc
        );
        assert_eq!(
            AttentionConfig::from_metadata(ckpt.metadata(), ckpt.source())?,
            attn
        );
    }
    Ok(())
}

/// Every scaling variant, the optional YaRN and LongRoPE fields both set and left out.
fn all_scalings() -> Vec<RopeScaling> {
    // Numbers whose shortest decimal form serde_json's default (not exactly rounding) float
    // parser reads back one ulp off.
    let longrope = LongRopeScaling {
        short_factor: vec![
            2.1330548074688482,
            1.9123759403810574,
            1.6501232966577781,
            2.0,
        ],
        long_factor: vec![1.1305562829743285, 3.0, 0.1 + 0.2, 8.0],
        original_max_position_embeddings: 64,
        factor: 8.0,
        attention_factor: None,
    };
    vec![
        RopeScaling::None,
        RopeScaling::Linear { factor: 2.5 },
        RopeScaling::NtkAware { alpha: 4.0 },
        RopeScaling::Dynamic {
            factor: 2.0,
            original_max_position_embeddings: 128,
        },
        RopeScaling::Yarn(YarnScaling::new(4.0, 64)),
        RopeScaling::Yarn(
            YarnScaling::new(16.0, 4096)
                .with_betas(24.0, 0.5)
                .with_mscale(0.707, 1.1)
                .with_attention_factor(1.3)
                .with_truncate(false),
        ),
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        },
        RopeScaling::LongRope(longrope.clone()),
        RopeScaling::LongRope(LongRopeScaling {
            attention_factor: Some(1.19),
            ..longrope
        }),
    ]
}

/// Every encoding kind, every enum value inside them (interpolations, ALiBi modes, pair layouts,
/// kernels, scalings), and non-default values in every field.
fn all_encodings() -> Vec<EncodingConfig> {
    let mut v = vec![
        EncodingConfig::None,
        EncodingConfig::Sinusoidal(SinusoidalConfig::new(16)),
        EncodingConfig::Sinusoidal(
            SinusoidalConfig::new(32)
                .with_max_len(77)
                .with_base(123.456)
                .with_dropout(0.3),
        ),
        EncodingConfig::Learned(LearnedConfig::new(8).with_dropout(0.0)),
        EncodingConfig::Learned(
            LearnedConfig::new(8)
                .with_max_len(12)
                .with_interpolation(Interpolation::ToSequenceLength),
        ),
        EncodingConfig::Learned(
            LearnedConfig::new(8)
                .with_max_len(12)
                .with_interpolation(Interpolation::ToLength(48)),
        ),
        EncodingConfig::Alibi(AlibiConfig::new(8)),
        EncodingConfig::Alibi(
            AlibiConfig::new(12)
                .with_head_range(4, 4)
                .with_mode(AlibiMode::CausalPairwise),
        ),
        EncodingConfig::Alibi(
            AlibiConfig::new(4)
                .with_mode(AlibiMode::Symmetric)
                .with_learnable(true),
        ),
        EncodingConfig::T5(T5Config::new(4)),
        EncodingConfig::T5(
            T5Config::new(2)
                .with_num_buckets(8)
                .with_max_distance(16)
                .with_bidirectional(false),
        ),
        EncodingConfig::ClippedBias(ClippedBiasConfig::new(4, 16)),
        EncodingConfig::Shaw(ShawConfig::new(8, 4)),
        EncodingConfig::Shaw(ShawConfig::new(8, 4).with_values(false)),
        EncodingConfig::Rotary(
            RopeConfig::new(16)
                .with_rotary_dim(10)
                .with_base(500_000.0)
                .with_layout(RopeLayout::Interleaved)
                .with_max_position(33)
                .with_xpos(512.0)
                .with_kernel(RopeKernel::Ops),
        ),
        EncodingConfig::RopeMixed(RopeMixedConfig::new(4, 8)),
        EncodingConfig::RopeMixed(RopeMixedConfig::new(2, 12).with_theta(100.5).with_seed(7)),
        EncodingConfig::ScaledSinusoidal(ScaledSinusoidalConfig::new(16)),
        EncodingConfig::ScaledSinusoidal(
            ScaledSinusoidalConfig::new(8)
                .with_max_len(33)
                .with_base(321.5)
                .with_dropout(0.2),
        ),
        EncodingConfig::Fox(FoxConfig::new(16, 4)),
        EncodingConfig::Fox(
            FoxConfig::new(8, 2)
                .with_bidirectional(true)
                .with_bias_init(-1.5)
                .with_post_log_scale(0.25),
        ),
        EncodingConfig::Inkling(InklingConfig::new(16, 4)),
        EncodingConfig::Inkling(
            InklingConfig::new(8, 2)
                .with_d_rel(3)
                .with_rel_extent(5)
                .with_log_scaling(Some(LogScaling {
                    n_floor: 4,
                    alpha: 0.1 + 0.2,
                })),
        ),
    ];
    for scaling in all_scalings() {
        v.push(EncodingConfig::Rotary(
            RopeConfig::new(8).with_scaling(scaling),
        ));
    }
    v
}

#[test]
fn every_config_round_trips_through_json() -> anyhow::Result<()> {
    for c in all_encodings() {
        let text = serde_json::to_string(&c)?;
        let back: EncodingConfig = serde_json::from_str(&text)?;
        assert_eq!(back, c, "{text}");
        back.validate()?;
        // The tag is the kind's name, and a rotary scaling's tag its name.
        let value: Value = serde_json::from_str(&text)?;
        assert_eq!(value["kind"], c.kind(), "{text}");
        if let EncodingConfig::Rotary(r) = &c {
            assert_eq!(value["scaling"]["rope_type"], r.scaling.name(), "{text}");
        }
    }
    // The kinds and scalings above are all there are.
    let kinds: std::collections::BTreeSet<_> = all_encodings().iter().map(|c| c.kind()).collect();
    assert_eq!(kinds.len(), 12, "{kinds:?}");
    let names: std::collections::BTreeSet<_> = all_scalings().iter().map(|s| s.name()).collect();
    assert_eq!(names.len(), 7, "{names:?}");

    let attn = AttentionConfig::new(24, 6)
        .with_kv_heads(2)
        .with_head_dim(8)
        .with_bias(true)
        .with_dropout(0.25)
        .with_causal(true)
        .with_softmax_scale(0.3);
    let text = serde_json::to_string(&attn)?;
    assert_eq!(
        serde_json::from_str::<AttentionConfig>(&text)?,
        attn,
        "{text}"
    );
    // Runtime settings are not written, and read back as their defaults.
    let runtime = attn
        .clone()
        .with_query_block(Some(3))
        .with_logits_budget(1000);
    let text = serde_json::to_string(&runtime)?;
    assert!(
        !text.contains("query_block") && !text.contains("logits_budget"),
        "{text}"
    );
    let back: AttentionConfig = serde_json::from_str(&text)?;
    assert_eq!(back, attn);
    assert_eq!(
        (back.query_block, back.logits_budget),
        (None, DEFAULT_LOGITS_BUDGET)
    );
    Ok(())
}

#[test]
fn json_with_required_fields_only_gives_the_documented_defaults() -> anyhow::Result<()> {
    let enc = |v: Value| serde_json::from_value::<EncodingConfig>(v);
    let cases = [
        (json!({"kind": "none"}), EncodingConfig::None),
        (
            json!({"kind": "sinusoidal", "d_model": 64}),
            EncodingConfig::Sinusoidal(SinusoidalConfig::new(64)),
        ),
        (
            json!({"kind": "learned", "d_model": 32}),
            EncodingConfig::Learned(LearnedConfig::new(32)),
        ),
        (
            json!({"kind": "alibi", "num_heads": 12}),
            EncodingConfig::Alibi(AlibiConfig::new(12)),
        ),
        (
            json!({"kind": "alibi", "num_heads": 12, "first_head": 4}),
            EncodingConfig::Alibi(AlibiConfig::new(12).with_head_range(4, 12)),
        ),
        (
            json!({"kind": "t5", "num_heads": 4}),
            EncodingConfig::T5(T5Config::new(4)),
        ),
        (
            json!({"kind": "clipped_bias", "num_heads": 4, "max_distance": 16}),
            EncodingConfig::ClippedBias(ClippedBiasConfig::new(4, 16)),
        ),
        (
            json!({"kind": "shaw", "head_dim": 16, "max_distance": 8}),
            EncodingConfig::Shaw(ShawConfig::new(16, 8)),
        ),
        (
            json!({"kind": "rotary", "head_dim": 64}),
            EncodingConfig::Rotary(RopeConfig::new(64)),
        ),
        (
            json!({"kind": "rotary", "head_dim": 64, "scaling": {"rope_type": "yarn",
                "factor": 4.0, "original_max_position_embeddings": 4096}}),
            EncodingConfig::Rotary(
                RopeConfig::new(64).with_scaling(RopeScaling::Yarn(YarnScaling::new(4.0, 4096))),
            ),
        ),
        (
            json!({"kind": "rotary", "head_dim": 64, "scaling": {"rope_type": "default"}}),
            EncodingConfig::Rotary(RopeConfig::new(64)),
        ),
    ];
    for (value, want) in cases {
        assert_eq!(enc(value.clone())?, want, "{value}");
    }
    let attn = |v: Value| serde_json::from_value::<AttentionConfig>(v);
    assert_eq!(
        attn(json!({"d_model": 512, "num_heads": 8}))?,
        AttentionConfig::new(512, 8)
    );
    // A head width without a scale gets the scale 1/√head_dim, as `with_head_dim` does.
    assert_eq!(
        attn(json!({"d_model": 512, "num_heads": 8, "head_dim": 16, "num_kv_heads": 2}))?,
        AttentionConfig::new(512, 8)
            .with_head_dim(16)
            .with_kv_heads(2)
    );
    assert_eq!(
        attn(json!({"d_model": 512, "num_heads": 8, "head_dim": 16, "softmax_scale": 1.0}))?,
        AttentionConfig::new(512, 8)
            .with_head_dim(16)
            .with_softmax_scale(1.0)
    );

    // Required fields are required, and a misspelt field is an error, not a silent default.
    for (value, needle) in [
        (json!({"kind": "sinusoidal"}), "missing field `d_model`"),
        (json!({"kind": "rotary"}), "missing field `head_dim`"),
        (
            json!({"kind": "clipped_bias", "num_heads": 2}),
            "missing field `max_distance`",
        ),
        (
            json!({"kind": "rotary", "head_dim": 8, "scaling": {"rope_type": "linear"}}),
            "missing field `factor`",
        ),
        (
            json!({"kind": "sinusoidal", "d_model": 8, "max_lenght": 9}),
            "unknown field `max_lenght`",
        ),
        (
            json!({"kind": "alibi", "num_heads": 8, "slope": [1]}),
            "unknown field `slope`",
        ),
        (
            json!({"kind": "rotary", "head_dim": 8, "scaling": {"rope_type": "yarn",
                "factor": 2.0, "original_max_position_embeddings": 8, "beta": 3}}),
            "unknown field `beta`",
        ),
        (json!({"d_model": 8}), "missing field `kind`"),
    ] {
        let err = enc(value.clone()).expect_err("must fail");
        assert!(err.to_string().contains(needle), "{value}: {err}");
    }
    for (value, needle) in [
        (json!({"d_model": 8}), "missing field `num_heads`"),
        (
            json!({"d_model": 8, "num_heads": 2, "query_block": 4}),
            "unknown field `query_block`",
        ),
    ] {
        let err = attn(value.clone()).expect_err("must fail");
        assert!(err.to_string().contains(needle), "{value}: {err}");
    }
    Ok(())
}

fn shared_encoding_is_arc(dev: &Device) -> anyhow::Result<()> {
    // One encoding object can be plugged into several layers.
    let enc = EncodingConfig::Sinusoidal(SinusoidalConfig::new(16))
        .build(VarBuilder::zeros(DType::F32, dev))?;
    let vb = VarBuilder::zeros(DType::F32, dev);
    let a = MultiHeadAttention::new(&AttentionConfig::new(16, 4), enc.clone(), vb.pp("a"))?;
    let b = MultiHeadAttention::new(&AttentionConfig::new(16, 4), enc.clone(), vb.pp("b"))?;
    assert!(Arc::ptr_eq(
        a.encoding().expect("enc"),
        b.encoding().expect("enc")
    ));
    Ok(())
}

device_tests!(
    self_describing_round_trip,
    load_into_restores_a_varmap,
    load_into_is_all_or_nothing,
    hf_named_tensors,
    missing_and_misshapen_tensors,
    corrupt_files,
    lying_metadata,
    every_config_round_trips_through_a_checkpoint,
    shared_encoding_is_arc,
    learned_parameters_survive_a_checkpoint,
);

/// Eight threads saving different checkpoints into one folder at once: every file holds its
/// own tensors (the temporary names are per call: paths that differ only in their extension
/// used to share one), and no temporary file is left behind.
#[test]
fn concurrent_saves_do_not_mix() -> anyhow::Result<()> {
    let dir = tmp("concurrent");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    std::thread::scope(|s| -> anyhow::Result<()> {
        let handles: Vec<_> = (0..8)
            .map(|i| {
                let dir = dir.clone();
                s.spawn(move || -> anyhow::Result<()> {
                    for round in 0..5 {
                        let t =
                            Tensor::full(i as f32 + round as f32 / 10.0, (64, 64), &Device::Cpu)?;
                        let tensors = HashMap::from([("t".to_string(), t)]);
                        let meta = HashMap::from([("who".to_string(), format!("{i}"))]);
                        save(dir.join(format!("ckpt.{i}")), &tensors, &meta)?;
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join()
                .map_err(|_| anyhow::anyhow!("a saving thread panicked"))??;
        }
        Ok(())
    })?;
    for i in 0..8 {
        let ck = Checkpoint::load(dir.join(format!("ckpt.{i}")), &Device::Cpu)?;
        assert_eq!(ck.metadata()["who"], format!("{i}"));
        let v = ck.get("t", &[64, 64])?.flatten_all()?.to_vec1::<f32>()?;
        assert!(
            v.iter().all(|x| (*x - (i as f32 + 0.4)).abs() < 1e-6),
            "file {i}"
        );
    }
    let left: Vec<_> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// Names a file cannot hold are refused when saving (a tensor named `__metadata__` used to
/// write an unloadable file); a renaming that maps two tensors to one name is an error (one
/// used to be dropped); floats do not fill integer variables (they were truncated).
#[test]
fn names_and_dtypes_that_lose_data_are_refused() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let t = Tensor::ones((2, 2), DType::F32, &dev)?;
    for name in ["__metadata__", ""] {
        let err = save(
            tmp("reserved.safetensors"),
            &HashMap::from([(name.to_string(), t.clone())]),
            &HashMap::new(),
        )
        .unwrap_err();
        assert!(matches!(err, Error::Checkpoint { .. }), "`{name}`: {err}");
    }
    let path = tmp("two_names.safetensors");
    save(
        &path,
        &HashMap::from([
            ("a.w".to_string(), t.clone()),
            ("b.w".to_string(), t.clone()),
        ]),
        &HashMap::new(),
    )?;
    let ck = Checkpoint::load(&path, &dev)?;
    let err = ck.clone().renamed(|_| Some("w".into())).unwrap_err();
    assert!(
        err.to_string().contains("`a.w`") && err.to_string().contains("`b.w`"),
        "{err}"
    );
    let ck = ck.renamed(|n| n.strip_prefix("a.").map(String::from))?;
    assert!(ck.get("w", &[2, 2]).is_ok() && ck.get("b.w", &[2, 2]).is_ok());
    // A float tensor into an integer variable.
    let varmap = VarMap::new();
    varmap.get((2, 2), "w", candle_nn::Init::Const(0.0), DType::U8, &dev)?;
    let err = ck.load_into(&varmap).unwrap_err();
    assert!(matches!(err, Error::Checkpoint { .. }), "{err}");
    let kept = varmap.data().lock().expect("lock")["w"]
        .as_tensor()
        .sum_all()?;
    assert_eq!(kept.to_dtype(DType::F32)?.to_scalar::<f32>()?, 0.0);
    std::fs::remove_file(&path)?;
    Ok(())
}

/// Every option of the block (window, chunks, temperature, soft cap, sinks, q/k norm, Gemma
/// 4's keys as values with a value norm; short convolutions; latent attention) is written to
/// the metadata and read back as it was.
#[test]
fn every_attention_option_round_trips_through_metadata() -> anyhow::Result<()> {
    use candle_posenc::attention::{AttentionTemperature, LatentConfig, QkNormConfig};
    let options = AttentionConfig::new(32, 4)
        .with_kv_heads(1)
        .with_head_dim(8)
        .with_causal(true)
        .with_sliding_window(Some(5))
        .with_attention_chunk(Some(3))
        .with_attention_temperature(Some(AttentionTemperature::new(0.25, 7)))
        .with_logit_softcap(Some(30.0))
        .with_sinks(true)
        .with_qk_norm(Some(
            QkNormConfig::new().with_unit_offset(true).with_eps(1e-5),
        ))
        .with_k_eq_v(true)
        .with_value_norm(Some(1e-4));
    let conv = AttentionConfig::new(32, 4)
        .with_short_conv(Some(3))
        .with_bias(true)
        .with_out_bias(false)
        .with_dropout(0.5);
    let latent = AttentionConfig::new(32, 4)
        .with_latent(Some(LatentConfig::new(Some(12), 10, 4, 6)))
        .with_softmax_scale(0.125);
    for attn in [options, conv, latent] {
        let back = AttentionConfig::from_metadata(&attn.to_metadata(), "m")?;
        assert_eq!(back, attn);
    }
    Ok(())
}

/// Every encoding with learned parameters, in a block with its own learned parts (sinks, q/k
/// norm scales, a short convolution, biases), all set away from their initial values: saved,
/// then rebuilt from the file alone (`from_metadata` and `var_builder`) and restored into a
/// fresh `VarMap` (`load_into`), both give the saved block's outputs bit for bit.
fn learned_parameters_survive_a_checkpoint(dev: &Device) -> anyhow::Result<()> {
    let attn = AttentionConfig::new(16, 4)
        .with_causal(true)
        .with_bias(true)
        .with_sinks(true)
        .with_short_conv(Some(3))
        .with_qk_norm(Some(QkNormConfig::new()));
    let mut configs = common::zoo::configs(16, 4, 4);
    configs.extend([
        EncodingConfig::Learned(
            LearnedConfig::new(16)
                .with_max_len(6)
                .with_dropout(0.0)
                .with_interpolation(Interpolation::ToSequenceLength),
        ),
        EncodingConfig::Learned(
            LearnedConfig::new(16)
                .with_max_len(6)
                .with_dropout(0.0)
                .with_interpolation(Interpolation::ToLength(24)),
        ),
        EncodingConfig::Alibi(AlibiConfig::new(4).with_learnable(true)),
        EncodingConfig::Alibi(
            AlibiConfig::new(4)
                .with_learnable(true)
                .with_mode(AlibiMode::Symmetric),
        ),
        EncodingConfig::Fox(FoxConfig::new(16, 4)),
        EncodingConfig::RopeMixed(RopeMixedConfig::new(4, 4).with_seed(3)),
    ]);
    // Multimodal positions for RoPE-Mixed (time, row, column: 7 patches of a grid 5 wide).
    let axes = Tensor::new(
        &[
            [[0u32; 7]],
            [[0, 0, 0, 0, 0, 1, 1]],
            [[0, 1, 2, 3, 4, 0, 1]],
        ],
        dev,
    )?;
    let grid = Positions::Ids(PositionIds::multimodal(&axes)?);
    let x = common::randn(0f32, 1.0, (1, 7, 16), dev)?;
    for (i, enc) in configs.iter().enumerate() {
        let what = common::zoo::label(i, enc);
        let mixed = matches!(enc, EncodingConfig::RopeMixed(_));
        // RoPE-Mixed rotates each head by its own frequencies: no grouped keys.
        let attn = attn.clone().with_kv_heads(if mixed { 4 } else { 2 });
        let opts = AttentionOptions {
            positions: mixed.then_some(&grid),
            ..Default::default()
        };
        let run = |mha: &MultiHeadAttention| mha.forward_with(&x, &opts, None);
        let (saved, varmap) = common::zoo::attention(enc, &attn, DType::F32, dev)?;
        let mut meta = enc.to_metadata();
        meta.extend(attn.to_metadata());
        let path = tmp(&format!("learned_{i}.safetensors"));
        save_varmap(&path, &varmap, &meta)?;
        let ckpt = Checkpoint::load(&path, dev)?;
        std::fs::remove_file(&path)?;
        let enc2 = EncodingConfig::from_metadata(ckpt.metadata(), ckpt.source())?;
        let attn2 = AttentionConfig::from_metadata(ckpt.metadata(), ckpt.source())?;
        let vb = ckpt.var_builder(DType::F32, dev);
        let rebuilt = MultiHeadAttention::new(&attn2, enc2.build(vb.pp("enc"))?, vb.pp("attn"))?;
        let want = run(&saved)?.output;
        assert_close(&run(&rebuilt)?.output, &want, 0.0, &what)?;
        // A fresh VarMap (other random values) restored from the file.
        let (_, fresh) = common::zoo::attention(enc, &attn, DType::F32, dev)?;
        ckpt.load_into(&fresh)?;
        let restored = common::zoo::attention_from(enc, &attn, &fresh, DType::F32, dev)?;
        assert_close(&run(&restored)?.output, &want, 0.0, &what)?;
        // Every variable is in the file: none kept a default the file would not restore.
        assert_eq!(ckpt.tensors().len(), varmap.all_vars().len(), "{what}");
    }
    Ok(())
}
