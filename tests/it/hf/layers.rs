//! One attention layer per HF family, read from its `config.json` and its tensors under HF's
//! names, against HF transformers' own module (fixtures from `generate.py hf_layers`: eager
//! attention, f32, a tiny random model with random biases and norm scales).
// Products of tensors this file lays out itself (clippy.toml sends the library's through
// src/matmul.rs).
#![allow(clippy::disallowed_methods)]

use crate::common;

use candle_core::{DType, Device, Tensor};
use candle_posenc::attention::{
    AttentionConfig, AttentionOptions, AttentionTemperature, KvCache, LatentConfig,
    MultiHeadAttention, QkNormConfig, QkNormScope,
};
use candle_posenc::checkpoint::Checkpoint;
use candle_posenc::encoding::EncodingConfig;
use candle_posenc::hf::{HfAttentionConfig, HfFamily};
use candle_posenc::positions::{PositionIds, Positions};
use candle_posenc::relative::alibi::{AlibiConfig, AlibiSlopes};
use candle_posenc::rotary::{RopeConfig, RopeLayout};
use candle_posenc::Error;
use common::{assert_close, get};

/// The families whose layer is checked whole against HF's (fixture tags in
/// `hf_layers.safetensors`): the list, and one test per family and path below.
macro_rules! families {
    ($($case:ident = $tag:literal),* $(,)?) => {
        /// Every family with a case below.
        const FAMILIES: &[&str] = &[$($tag),*];
        case_tests!(every_family_matches_hf: $($case = $tag),*);
        case_tests!(every_family_trains_as_hf: $($case = $tag),*);
    };
}

families! {
    llama = "llama",
    mistral = "mistral",
    qwen2 = "qwen2",
    qwen3 = "qwen3",
    olmo2 = "olmo2",
    gemma = "gemma",
    phi3 = "phi3",
    gpt_neox = "gpt_neox",
    llama_partial = "llama_partial",
    neox_pct = "neox_pct",
    bloom = "bloom",
    gpt2 = "gpt2",
    gpt2_inverse_1 = "gpt2_inverse.1",
    gptj = "gptj",
    falcon_mqa = "falcon_mqa",
    falcon_gqa = "falcon_gqa",
    falcon_mha = "falcon_mha",
    t5 = "t5",
    t5_decoder = "t5_decoder",
    mpt = "mpt",
    mpt_bias_max16 = "mpt_bias_max16",
    mpt_no_alibi = "mpt_no_alibi",
    mistral_window = "mistral_window",
    gemma2_0 = "gemma2.0",
    gemma2_1 = "gemma2.1",
    gemma3_0 = "gemma3.0",
    gemma3_1 = "gemma3.1",
    gemma3_softcap_1 = "gemma3_softcap.1",
    gpt_oss_0 = "gpt_oss.0",
    gpt_oss_1 = "gpt_oss.1",
    mistral_window_padded = "mistral_window.padded",
    gpt_oss_0_padded = "gpt_oss.0.padded",
    smollm3_0 = "smollm3.0",
    smollm3_1 = "smollm3.1",
    cohere2_0 = "cohere2.0",
    cohere2_1 = "cohere2.1",
    ministral_0 = "ministral.0",
    ministral_1 = "ministral.1",
    ministral_0_padded = "ministral.0.padded",
    starcoder2 = "starcoder2",
    starcoder2_padded = "starcoder2.padded",
    qwen2_vl = "qwen2_vl",
    qwen3_vl = "qwen3_vl",
    modernbert_0 = "modernbert.0",
    modernbert_1 = "modernbert.1",
    modernbert_1_padded = "modernbert.1.padded",
    llama4_0 = "llama4.0",
    llama4_1 = "llama4.1",
    llama4_0_padded = "llama4.0.padded",
    deepseek_v3 = "deepseek_v3",
    deepseek_v3_padded = "deepseek_v3.padded",
    deepseek_v2 = "deepseek_v2",
    gemma4_0 = "gemma4.0",
    gemma4_1 = "gemma4.1",
    gemma4_1_padded = "gemma4.1.padded",
    pixtral = "pixtral",
    pixtral_default = "pixtral_default",
    falcon_alibi = "falcon_alibi",
    falcon_alibi12 = "falcon_alibi12",
    // Minimal config.json files (sizes, heads, model_type): the rest from HF's class defaults.
    min_llama4_text = "min.llama4_text",
    min_smollm3 = "min.smollm3",
    min_gpt_oss = "min.gpt_oss",
    min_gemma3_text_5 = "min.gemma3_text.5",
    min_gemma3_text_0 = "min.gemma3_text.0",
    min_gemma4_text_0 = "min.gemma4_text.0",
    min_gemma4_text_1 = "min.gemma4_text.1",
    min_gemma2 = "min.gemma2",
    min_mistral = "min.mistral",
    min_ministral = "min.ministral",
    ministral_unlisted_1 = "ministral_unlisted.1",
    min_starcoder2 = "min.starcoder2",
    min_qwen3 = "min.qwen3",
    min_olmo2 = "min.olmo2",
    min_cohere2 = "min.cohere2",
    min_phi3 = "min.phi3",
    min_falcon = "min.falcon",
    min_gpt_neox = "min.gpt_neox",
    neox_theta_params = "neox_theta.params",
    neox_theta_base = "neox_theta.base",
    neox_theta_top = "neox_theta.top",
    gptj_theta = "gptj_theta",
    llama4_yarn = "llama4_yarn",
    llama4_longrope = "llama4_longrope",
    gemma3_types_0 = "gemma3_types.0",
    gemma3_types_1 = "gemma3_types.1",
    modernbert_types_0 = "modernbert_types.0",
    modernbert_types_1 = "modernbert_types.1",
    smollm3_window_0 = "smollm3_window.0",
    min_modernbert_0 = "min.modernbert.0",
    min_modernbert_1 = "min.modernbert.1",
    min_deepseek_v3 = "min.deepseek_v3",
    min_mpt = "min.mpt",
    min_t5 = "min.t5",
    min_qwen2_vl = "min.qwen2_vl",
    min_qwen3_vl = "min.qwen3_vl",
    // The Qwen-VL vision encoders: two images, a sequence each, at their patches' rows and
    // columns.
    qwen2_vl_vision = "qwen2_vl_vision",
    min_qwen2_vl_vision = "min.qwen2_vl_vision",
    qwen2_5_vl_vision_1 = "qwen2_5_vl_vision.1",
    min_qwen3_vl_vision = "min.qwen3_vl_vision",
    qwen3_vl_moe_vision = "qwen3_vl_moe_vision",
    gemma4_vision = "gemma4_vision",
    min_gemma4_vision = "min.gemma4_vision",
    // The families whose rotation alone used to be read: CodeGen's sharded qkv_proj, Cohere's
    // per-head layer norms, GLM's and Helium's q/k/v-only biases, Phi-4-multimodal's Phi-3
    // attention, each also from a minimal config.json.
    codegen = "codegen",
    min_codegen = "min.codegen",
    cohere = "cohere",
    cohere_padded = "cohere.padded",
    min_cohere = "min.cohere",
    glm = "glm",
    min_glm = "min.glm",
    glm4 = "glm4",
    min_glm4 = "min.glm4",
    helium = "helium",
    min_helium = "min.helium",
    ernie4_5 = "ernie4_5",
    min_ernie4_5 = "min.ernie4_5",
    phi4_multimodal = "phi4_multimodal",
    min_phi4_multimodal = "min.phi4_multimodal",
}

fn fixtures(dev: &Device) -> anyhow::Result<Checkpoint> {
    let path = format!(
        "{}/tests/fixtures/hf_layers.safetensors",
        env!("CARGO_MANIFEST_DIR")
    );
    Ok(Checkpoint::load(path, dev)?)
}

/// The family's parsed `config.json`, and its block loaded from the fixture's tensors.
fn layer(ckpt: &Checkpoint, tag: &str) -> anyhow::Result<(HfAttentionConfig, MultiHeadAttention)> {
    let meta = ckpt.metadata();
    let config_tag = if tag == "t5_decoder" { "t5" } else { tag };
    let index: usize = meta[&format!("{tag}.layer")].parse()?;
    let mut config = HfAttentionConfig::from_json_layer(&meta[config_tag], index)?;
    if tag == "t5_decoder" {
        config = config.with_causal(true);
    }
    let prefix = &meta[&format!("{tag}.prefix")];
    let vb = ckpt.var_builder(DType::F32, ckpt_device(ckpt));
    let block = config.load(vb.pp(format!("{tag}/{prefix}")))?;
    Ok((config, block))
}

fn ckpt_device(ckpt: &Checkpoint) -> &Device {
    ckpt.tensors().values().next().expect("tensors").device()
}

/// How far the block built from `config` with the tensors of fixture `tag` is from HF's
/// output for that layer (positions 0..T, no padding).
fn distance_from_hf(
    ckpt: &Checkpoint,
    tag: &str,
    config: &HfAttentionConfig,
) -> anyhow::Result<f64> {
    let prefix = &ckpt.metadata()[&format!("{tag}.prefix")];
    let vb = ckpt.var_builder(DType::F32, ckpt_device(ckpt));
    let block = config.load(vb.pp(format!("{tag}/{prefix}")))?;
    let x = get(ckpt.tensors(), &format!("{tag}.x"));
    let got = block
        .forward_with(x, &AttentionOptions::default(), None)?
        .output;
    common::max_abs_diff(&got, get(ckpt.tensors(), &format!("{tag}.out")))
}

/// The family's layer equals HF's on every path: the fused core, the row pass (weights
/// returned), plain ops (training mode), and decoding with a KV cache, token by token and in
/// uneven steps after a prefill past the layer's window or chunk.
fn every_family_matches_hf(tag: &str, dev: &Device) -> anyhow::Result<()> {
    let ckpt = fixtures(dev)?;
    let (_, block) = layer(&ckpt, tag)?;
    let x = get(ckpt.tensors(), &format!("{tag}.x"));
    let want = get(ckpt.tensors(), &format!("{tag}.out"));
    // Vision-language models' tokens sit at multimodal positions (3, B, T).
    let axes = ckpt.tensors().get(&format!("{tag}.positions"));
    // Falcon's ALiBi counts positions from each sequence's first unpadded token.
    let ids = ckpt.tensors().get(&format!("{tag}.position_ids"));
    let at = |start: usize, len: usize| -> anyhow::Result<Positions> {
        Ok(match (axes, ids) {
            (Some(a), _) => Positions::Ids(PositionIds::multimodal(&a.narrow(2, start, len)?)?),
            (None, Some(i)) => Positions::Ids(PositionIds::new(&i.narrow(1, start, len)?)?),
            (None, None) => Positions::Offset(start),
        })
    };
    let all = at(0, x.dim(1)?)?;
    // Left-padded batches: the padding mask as HF's attention_mask.
    let padding = ckpt.tensors().get(&format!("{tag}.padding"));
    let run = |return_weights: bool, train: bool| {
        block.forward_with(
            x,
            &AttentionOptions {
                positions: Some(&all),
                padding_mask: padding,
                return_weights,
                train,
                ..Default::default()
            },
            None,
        )
    };
    assert_close(
        &run(false, false)?.output,
        want,
        1e-5,
        &format!("{tag} fused"),
    )?;
    assert_close(
        &run(true, false)?.output,
        want,
        1e-5,
        &format!("{tag} row pass"),
    )?;
    assert_close(
        &run(false, true)?.output,
        want,
        1e-5,
        &format!("{tag} plain ops"),
    )?;
    if block.config().causal {
        // Token by token, and in uneven steps whose first (4 keys) is past every fixture's
        // window and chunk (3) and whose later ones cross their edges.
        let t = x.dim(1)?;
        for sizes in [vec![1; t], vec![4, 1, t - 5], vec![2, 3, t - 5]] {
            let decoded = decode_in_steps(&block, x, &at, padding, &sizes)?;
            // A padded query sees no real key: its output depends on how many keys the call
            // holds (uniform over them), in HF as here, so decoding compares the real rows.
            let (decoded, want) = match padding {
                Some(p) => {
                    let keep = p.to_dtype(DType::F32)?.unsqueeze(2)?;
                    (decoded.broadcast_mul(&keep)?, want.broadcast_mul(&keep)?)
                }
                None => (decoded, want.clone()),
            };
            assert_close(
                &decoded,
                &want,
                1e-5,
                &format!("{tag} decoded in {sizes:?}"),
            )?;
        }
    }
    Ok(())
}

/// `block` over `x` through one KV cache, in steps of `sizes` tokens, each at its positions
/// (`at(start, len)`) with the padding mask of the keys seen so far.
fn decode_in_steps(
    block: &MultiHeadAttention,
    x: &Tensor,
    at: &dyn Fn(usize, usize) -> anyhow::Result<Positions>,
    padding: Option<&Tensor>,
    sizes: &[usize],
) -> anyhow::Result<Tensor> {
    let mut cache = KvCache::new();
    let mut steps = Vec::with_capacity(sizes.len());
    let mut start = 0;
    for &n in sizes {
        let here = at(start, n)?;
        let seen = padding.map(|p| p.narrow(1, 0, start + n)).transpose()?;
        let step = block.forward_with(
            &x.narrow(1, start, n)?,
            &AttentionOptions {
                positions: Some(&here),
                padding_mask: seen.as_ref(),
                ..Default::default()
            },
            Some(&mut cache),
        )?;
        steps.push(step.output);
        start += n;
    }
    assert_eq!(start, x.dim(1)?, "the steps cover the input");
    Ok(Tensor::cat(&steps, 1)?)
}

/// What each family's `config.json` sets, as read.
fn configs_read_as_hf_does(dev: &Device) -> anyhow::Result<()> {
    let ckpt = fixtures(dev)?;
    let read = |tag: &str| HfAttentionConfig::from_json(&ckpt.metadata()[tag]);
    let families = [
        ("llama", HfFamily::Llama),
        ("phi3", HfFamily::Phi3),
        ("gpt_neox", HfFamily::GptNeoX),
        ("bloom", HfFamily::Bloom),
        ("gpt2", HfFamily::Gpt2),
        ("gptj", HfFamily::GptJ),
        ("falcon_mqa", HfFamily::Falcon),
        ("t5", HfFamily::T5),
        ("mpt", HfFamily::Mpt),
    ];
    for (tag, family) in families {
        assert_eq!(read(tag)?.family, family, "{tag}");
    }
    let qwen2 = read("qwen2")?.attention;
    assert!(qwen2.bias && !qwen2.out_bias, "Qwen2: q, k, v biases only");
    let llama = read("llama")?.attention;
    assert!(llama.bias && llama.out_bias && llama.causal);
    assert_eq!(
        (llama.num_heads, llama.num_kv_heads, llama.head_dim),
        (4, 2, 8)
    );
    let qwen3 = read("qwen3")?.attention;
    assert_eq!(
        qwen3.head_dim, 16,
        "head_dim apart from hidden_size / heads"
    );
    assert_eq!(qwen3.softmax_scale, 0.25);
    assert_eq!(
        qwen3.qk_norm,
        Some(QkNormConfig::new().with_eps(1e-6)),
        "Qwen3 normalises per head"
    );
    let olmo2 = read("olmo2")?.attention;
    assert_eq!(olmo2.qk_norm.map(|n| n.scope), Some(QkNormScope::AllHeads));
    for (tag, kv) in [("falcon_mqa", 1), ("falcon_gqa", 2), ("falcon_mha", 4)] {
        let falcon = read(tag)?.attention;
        assert_eq!(falcon.num_kv_heads, kv, "{tag}");
    }
    let t5 = read("t5")?;
    assert!(!t5.attention.causal && t5.attention.softmax_scale == 1.0);
    match &t5.encoding {
        EncodingConfig::T5(c) => {
            assert_eq!(
                (c.num_buckets, c.max_distance, c.bidirectional),
                (8, 16, true)
            );
        }
        other => panic!("T5 read as {other:?}"),
    }
    match t5.with_causal(true).encoding {
        EncodingConfig::T5(c) => assert!(!c.bidirectional, "the decoder's buckets are causal"),
        other => panic!("T5 read as {other:?}"),
    }
    assert_eq!(read("gpt2")?.encoding, EncodingConfig::None);
    // GPT-2's layers scaled by their number: one layer at a time, layer 1 at half the scale.
    let inverse = &ckpt.metadata()["gpt2_inverse.1"];
    let err = HfAttentionConfig::from_json(inverse).unwrap_err();
    assert!(
        matches!(&err, Error::HfConfig { key, .. } if key == "scale_attn_by_inverse_layer_idx"),
        "{err}"
    );
    let (l0, l1) = (
        HfAttentionConfig::from_json_layer(inverse, 0)?
            .attention
            .softmax_scale,
        HfAttentionConfig::from_json_layer(inverse, 1)?
            .attention
            .softmax_scale,
    );
    assert_eq!((l0, l1), (1.0 / 8f64.sqrt(), 0.5 / 8f64.sqrt()));
    assert_eq!(read("bloom")?.encoding.kind(), "alibi");
    match read("gpt_neox")?.encoding {
        EncodingConfig::Rotary(r) => assert_eq!(r.rotary_dim, 4, "rotary_pct 0.5 of 8"),
        other => panic!("GPT-NeoX read as {other:?}"),
    }
    Ok(())
}

/// Windows, soft caps and sinks on every path agree with padding (batch item 0's first two
/// keys padded), query blocks of 2 rows and grouped heads.
fn extras_agree_on_every_path_with_padding_and_blocks(dev: &Device) -> anyhow::Result<()> {
    let ckpt = fixtures(dev)?;
    for tag in ["gemma2.0", "gemma3.0", "gpt_oss.0", "mistral_window"] {
        let meta = ckpt.metadata();
        let index: usize = meta[&format!("{tag}.layer")].parse()?;
        let mut config = HfAttentionConfig::from_json_layer(&meta[tag], index)?;
        config.attention = config.attention.with_query_block(Some(2));
        let vb = ckpt.var_builder(DType::F32, dev);
        let block = config.load(vb.pp(format!("{tag}/{}", meta[&format!("{tag}.prefix")])))?;
        let x = get(ckpt.tensors(), &format!("{tag}.x"));
        let (b, t) = (x.dim(0)?, x.dim(1)?);
        let keep: Vec<u8> = (0..b * t).map(|i| u8::from(i >= 2)).collect();
        let padding = Tensor::from_vec(keep, (b, t), dev)?;
        let run = |return_weights: bool, train: bool| {
            block.forward_with(
                x,
                &AttentionOptions {
                    padding_mask: Some(&padding),
                    return_weights,
                    train,
                    ..Default::default()
                },
                None,
            )
        };
        let fused = run(false, false)?.output;
        let rows = run(true, false)?;
        let ops = run(false, true)?.output;
        assert_close(
            &rows.output,
            &fused,
            1e-5,
            &format!("{tag} row pass vs fused"),
        )?;
        assert_close(&ops, &fused, 1e-5, &format!("{tag} plain ops vs fused"))?;
        // Outside the window and on padded keys the weights are 0.
        let weights = rows.weights.expect("weights");
        let w = config.attention.sliding_window.expect("a window");
        let last = t - 1;
        let hidden = weights.narrow(2, last, 1)?.narrow(3, 0, last + 1 - w)?;
        assert_eq!(hidden.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0, "{tag}");
    }
    Ok(())
}

/// What each layer of Gemma 2, Gemma 3, SmolLM3, Cohere2 and gpt-oss reads as.
fn per_layer_settings(dev: &Device) -> anyhow::Result<()> {
    let ckpt = fixtures(dev)?;
    gemma_smollm3_and_gpt_oss_layers(&ckpt)?;
    vision_language_models_read_their_text_config(&ckpt)?;
    modernbert_layers_as_written_and_published(&ckpt)?;
    llama4_rope_and_nope_layers(&ckpt)?;
    llama4_published_layer_patterns(&ckpt)?;
    cohere2_takes_the_files_head_dim()?;
    zero_sliding_window_pattern_is_refused_where_read()?;
    deepseek_latent_layers(&ckpt)?;
    gemma4_layers(&ckpt)?;
    llama4_chunk_and_temperature_settings_are_checked(&ckpt)
}

/// Layer `layer` of the fixture's config.json under `tag`.
fn fixture_layer(
    ckpt: &Checkpoint,
    tag: &str,
    layer: usize,
) -> candle_posenc::Result<HfAttentionConfig> {
    HfAttentionConfig::from_json_layer(&ckpt.metadata()[tag], layer)
}

/// Gemma 2's sliding and soft-capped layers, Gemma 3's local and global θ and q/k norms,
/// SmolLM3's NoPE layer, gpt-oss's sinks and biases.
fn gemma_smollm3_and_gpt_oss_layers(ckpt: &Checkpoint) -> anyhow::Result<()> {
    let read = |tag: &str, layer| fixture_layer(ckpt, tag, layer);
    let (g0, g1) = (
        read("gemma2.0", 0)?.attention,
        read("gemma2.0", 1)?.attention,
    );
    assert_eq!((g0.sliding_window, g1.sliding_window), (Some(3), None));
    assert_eq!(
        (g0.logit_softcap, g0.softmax_scale),
        (Some(5.0), 1.0 / 24f64.sqrt())
    );
    let (r0, r1) = (read("gemma3.0", 0)?, read("gemma3.0", 1)?);
    match (&r0.encoding, &r1.encoding) {
        (EncodingConfig::Rotary(local), EncodingConfig::Rotary(global)) => {
            assert_eq!(
                (local.base, global.base),
                (10_000.0, 1e6),
                "local and global θ"
            );
        }
        other => panic!("Gemma 3 read as {other:?}"),
    }
    let norm = r0.attention.qk_norm.expect("Gemma 3 normalises q and k");
    assert!(norm.unit_offset && norm.scope == QkNormScope::PerHead);
    assert_eq!(read("smollm3.0", 0)?.encoding.kind(), "rotary");
    assert_eq!(
        read("smollm3.0", 1)?.encoding,
        EncodingConfig::None,
        "a NoPE layer"
    );
    let err = HfAttentionConfig::from_json(&ckpt.metadata()["smollm3.0"]).unwrap_err();
    assert!(
        matches!(&err, Error::HfConfig { key, .. } if key == "no_rope_layers"),
        "{err}"
    );
    let oss = read("gpt_oss.0", 1)?.attention;
    assert!(oss.sinks && oss.bias && oss.out_bias && oss.sliding_window.is_none());
    Ok(())
}

/// Vision-language models: the language model under text_config, with multimodal RoPE.
fn vision_language_models_read_their_text_config(ckpt: &Checkpoint) -> anyhow::Result<()> {
    let read = |tag: &str, layer| fixture_layer(ckpt, tag, layer);
    for (tag, interleaved) in [("qwen2_vl", false), ("qwen3_vl", true)] {
        let vl = read(tag, 0)?;
        match &vl.encoding {
            EncodingConfig::Rotary(r) => {
                assert_eq!(r.mrope.map(|m| m.interleaved), Some(interleaved), "{tag}");
            }
            other => panic!("{tag} read as {other:?}"),
        }
        assert_eq!(
            vl.attention.qk_norm.is_some(),
            interleaved,
            "{tag}: Qwen3-VL's q/k norms"
        );
        assert_eq!(
            vl.attention.bias, !interleaved,
            "{tag}: Qwen2-VL's q/k/v biases"
        );
    }
    // Qwen2.5-VL's config.json is Qwen2-VL's under other model types.
    let qwen25 = ckpt.metadata()["qwen2_vl"]
        .replace("\"qwen2_vl_text\"", "\"qwen2_5_vl_text\"")
        .replace("\"qwen2_vl\"", "\"qwen2_5_vl\"");
    assert!(qwen25.contains("qwen2_5_vl_text"));
    assert_eq!(
        HfAttentionConfig::from_json(&qwen25)?,
        read("qwen2_vl", 0)?,
        "Qwen2.5-VL reads as Qwen2-VL"
    );
    Ok(())
}

/// ModernBERT, as HF writes it (nested rope_parameters, layer_types) and as the published
/// files have it (flat θs, global_attn_every_n_layers; defaults 3, 128, 160000, 10000).
fn modernbert_layers_as_written_and_published(ckpt: &Checkpoint) -> anyhow::Result<()> {
    let base = r#""model_type": "modernbert", "hidden_size": 32, "num_attention_heads": 4,
        "num_hidden_layers": 6, "max_position_embeddings": 64"#;
    let published = format!(r#"{{{base}, "local_rope_theta": 500.0}}"#);
    let fixture = ckpt.metadata()["modernbert.0"].clone();
    for (text, layers, every, window, global, local) in [
        (fixture.as_str(), 2, 2, 2, 160_000.0, 10_000.0),
        (published.as_str(), 6, 3, 64, 160_000.0, 500.0),
    ] {
        for layer in 0..layers {
            let config = HfAttentionConfig::from_json_layer(text, layer)?;
            assert_eq!(config.family, HfFamily::ModernBert);
            let a = &config.attention;
            let full = layer % every == 0;
            assert!(!a.causal && a.attention_chunk.is_none());
            assert_eq!(a.sliding_window, (!full).then_some(window), "layer {layer}");
            match &config.encoding {
                EncodingConfig::Rotary(r) => {
                    assert_eq!(r.base, if full { global } else { local }, "layer {layer}")
                }
                other => panic!("ModernBERT read as {other:?}"),
            }
        }
    }
    Ok(())
}

/// Llama 4: RoPE layers rotate adjacent pairs, normalise q and k without a scale and attend
/// within chunks; NoPE layers attend to every earlier key and tune the queries' temperature.
/// Its multimodal config.json nests the same under text_config.
fn llama4_rope_and_nope_layers(ckpt: &Checkpoint) -> anyhow::Result<()> {
    let text = ckpt.metadata()["llama4.0"].clone();
    let nested = format!(r#"{{"model_type": "llama4", "text_config": {text}}}"#);
    for json in [&text, &nested] {
        let (rope, nope) = (
            HfAttentionConfig::from_json_layer(json, 0)?,
            HfAttentionConfig::from_json_layer(json, 1)?,
        );
        let a = &rope.attention;
        assert_eq!(
            (a.attention_chunk, a.attention_temperature, a.causal),
            (Some(3), None, true)
        );
        let norm = a.qk_norm.expect("Llama 4's L2 norm");
        assert!(!norm.learned_scale && norm.scope == QkNormScope::PerHead && norm.eps == 1e-5);
        match &rope.encoding {
            EncodingConfig::Rotary(r) => {
                assert_eq!(r.layout, RopeLayout::Interleaved);
                assert_eq!(r.scaling.name(), "llama3");
            }
            other => panic!("Llama 4 read as {other:?}"),
        }
        let a = &nope.attention;
        assert_eq!(nope.encoding, EncodingConfig::None);
        assert_eq!(
            (a.attention_chunk, a.qk_norm, a.attention_temperature),
            (None, None, Some(AttentionTemperature::new(0.5, 2)))
        );
        let err = HfAttentionConfig::from_json(json).unwrap_err();
        assert!(
            matches!(&err, Error::HfConfig { key, .. } if key == "no_rope_layers"),
            "{err}"
        );
    }
    Ok(())
}

/// Llama 4 as its class reads what a published file may hold: an empty `no_rope_layers`
/// (Llama 4 Scout's) is the default pattern, every fourth layer NoPE; a null chunk size
/// without `layer_types` makes every layer a full-attention one.
fn llama4_published_layer_patterns(ckpt: &Checkpoint) -> anyhow::Result<()> {
    let text = &ckpt.metadata()["llama4.0"];
    let mut scout: serde_json::Map<String, serde_json::Value> = serde_json::from_str(text)?;
    scout.insert("no_rope_layers".into(), serde_json::json!([]));
    scout.insert("num_hidden_layers".into(), serde_json::json!(8));
    scout.remove("layer_types");
    scout.remove("no_rope_layer_interval");
    let scout_text = serde_json::Value::Object(scout.clone()).to_string();
    for layer in 0..8 {
        let config = HfAttentionConfig::from_json_layer(&scout_text, layer)?;
        let rope = layer % 4 != 3;
        assert_eq!(config.encoding.kind() == "rotary", rope, "layer {layer}");
        let chunk = config.attention.attention_chunk;
        assert_eq!(chunk.is_some(), rope, "layer {layer}");
    }
    scout.insert("attention_chunk_size".into(), serde_json::Value::Null);
    let unchunked = serde_json::Value::Object(scout.clone()).to_string();
    for layer in 0..8 {
        let config = HfAttentionConfig::from_json_layer(&unchunked, layer)?;
        assert_eq!(config.attention.attention_chunk, None, "layer {layer}");
    }
    scout.insert(
        "layer_types".into(),
        serde_json::json!(vec!["chunked_attention"; 8]),
    );
    let err = HfAttentionConfig::from_json_layer(&serde_json::Value::Object(scout).to_string(), 0)
        .unwrap_err();
    assert!(
        matches!(&err, Error::HfConfig { key, .. } if key == "attention_chunk_size"),
        "{err}"
    );
    Ok(())
}

/// Cohere2's class sets head_dim to the width over the heads and then takes a file's own
/// (its attention and rotary embedding read it).
fn cohere2_takes_the_files_head_dim() -> anyhow::Result<()> {
    let cohere = r#"{"model_type": "cohere2", "hidden_size": 32, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 4}"#;
    let config = HfAttentionConfig::from_json_layer(cohere, 0)?;
    assert_eq!(config.attention.head_dim, 16);
    match &config.encoding {
        EncodingConfig::Rotary(r) => assert_eq!(r.head_dim, 16),
        other => panic!("Cohere2's sliding layer read as {other:?}"),
    }
    Ok(())
}

/// A sliding-window pattern of 0 fails in Gemma 3's and Cohere2's classes (a layer's number
/// modulo it): refused under its key. Gemma 4's class does not read the key.
fn zero_sliding_window_pattern_is_refused_where_read() -> anyhow::Result<()> {
    for model_type in ["gemma3_text", "cohere2", "gemma4_text"] {
        let text = format!(
            r#"{{"model_type": "{model_type}", "hidden_size": 32, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 12,
            "sliding_window": 16, "sliding_window_pattern": 0}}"#
        );
        let got = HfAttentionConfig::from_json_layer(&text, 0);
        match model_type {
            "gemma4_text" => {
                let other = text.replace(
                    "\"sliding_window_pattern\": 0",
                    "\"sliding_window_pattern\": 2",
                );
                for layer in [0, 1, 5] {
                    let a = HfAttentionConfig::from_json_layer(&text, layer)?.attention;
                    let b = HfAttentionConfig::from_json_layer(&other, layer)?.attention;
                    assert_eq!(a.sliding_window, b.sliding_window, "layer {layer}");
                    assert_eq!(a.sliding_window.is_none(), layer == 5, "layer {layer}");
                }
            }
            _ => assert!(
                matches!(&got, Err(Error::HfConfig { key, .. }) if key == "sliding_window_pattern"),
                "{model_type}: {got:?}"
            ),
        }
    }
    Ok(())
}

/// DeepSeek: latent attention, RoPE on the rope slice of each head (interleaved), YaRN's
/// mscale_all_dim squared in the scale; V2 without a query latent.
fn deepseek_latent_layers(ckpt: &Checkpoint) -> anyhow::Result<()> {
    let v3 = fixture_layer(ckpt, "deepseek_v3", 0)?;
    assert_eq!(v3.family, HfFamily::DeepSeek);
    let a = &v3.attention;
    assert_eq!(
        a.latent,
        Some(LatentConfig::new(Some(12), 10, 4, 6)),
        "the latent settings"
    );
    assert_eq!((a.head_dim, a.num_kv_heads, a.bias), (8, 4, true));
    let m = 0.1 * 4f64.ln() + 1.0;
    assert!((a.softmax_scale - m * m / 8f64.sqrt()).abs() < 1e-12);
    match &v3.encoding {
        EncodingConfig::Rotary(r) => {
            assert_eq!(
                (r.head_dim, r.rotary_dim, r.layout),
                (8, 4, RopeLayout::Interleaved)
            );
            assert_eq!(r.scaling.name(), "yarn");
        }
        other => panic!("DeepSeek V3 read as {other:?}"),
    }
    let v2 = fixture_layer(ckpt, "deepseek_v2", 0)?.attention;
    assert_eq!(v2.latent.map(|l| l.q_lora_rank), Some(None));
    assert_eq!(v2.softmax_scale, 1.0 / 8f64.sqrt());
    for (edit, key) in [
        (r#""qk_rope_head_dim": 3"#, "qk_rope_head_dim"),
        (r#""v_head_dim": 9"#, "v_head_dim"),
        (r#""q_lora_rank": 0"#, "q_lora_rank"),
        (r#""kv_lora_rank": 0"#, "kv_lora_rank"),
    ] {
        let mut value: serde_json::Value = serde_json::from_str(&ckpt.metadata()["deepseek_v3"])?;
        let (name, v) = edit.split_once(": ").expect("an edit");
        value[name.trim_matches('"')] = serde_json::from_str(v)?;
        let err = HfAttentionConfig::from_json(&value.to_string()).unwrap_err();
        assert!(
            matches!(&err, Error::HfConfig { key: k, .. } if k == key),
            "{key}: {err}"
        );
    }
    Ok(())
}

/// Gemma 4: per-layer head widths and KV heads, values from the keys on full layers, q, k
/// and v normalised, no scale, proportional RoPE over the full layers' wider heads.
fn gemma4_layers(ckpt: &Checkpoint) -> anyhow::Result<()> {
    let (local, global) = (
        fixture_layer(ckpt, "gemma4.0", 0)?,
        fixture_layer(ckpt, "gemma4.0", 1)?,
    );
    let (l, g) = (&local.attention, &global.attention);
    assert_eq!(
        (l.head_dim, l.num_kv_heads, l.k_eq_v, l.sliding_window),
        (8, 2, false, Some(3))
    );
    assert_eq!(
        (g.head_dim, g.num_kv_heads, g.k_eq_v, g.sliding_window),
        (16, 1, true, None)
    );
    for a in [l, g] {
        assert_eq!((a.softmax_scale, a.value_norm), (1.0, Some(1e-6)));
        assert!(a.qk_norm.is_some_and(|n| !n.unit_offset && n.learned_scale));
    }
    match &global.encoding {
        EncodingConfig::Rotary(r) => {
            assert_eq!((r.head_dim, r.scaling.name()), (16, "proportional"))
        }
        other => panic!("Gemma 4 read as {other:?}"),
    }
    let gemma4: serde_json::Value = serde_json::from_str(&ckpt.metadata()["gemma4.0"])?;
    for (key, value, layer) in [
        (
            "use_bidirectional_attention",
            serde_json::json!("vision"),
            0,
        ),
        ("num_kv_shared_layers", serde_json::json!(1), 1),
    ] {
        let mut edited = gemma4.clone();
        edited[key] = value;
        let err = HfAttentionConfig::from_json_layer(&edited.to_string(), layer).unwrap_err();
        assert!(
            matches!(&err, Error::HfConfig { key: k, .. } if k == key),
            "{key}: {err}"
        );
    }
    Ok(())
}

/// Llama 4's chunked layers need a chunk size; the temperature's settings are checked.
fn llama4_chunk_and_temperature_settings_are_checked(ckpt: &Checkpoint) -> anyhow::Result<()> {
    let text = &ckpt.metadata()["llama4.0"];
    for (edit, key) in [
        (r#""attention_chunk_size": null"#, "attention_chunk_size"),
        (r#""floor_scale": 0"#, "floor_scale"),
        (r#""attn_scale": -1.0"#, "attn_scale"),
    ] {
        let (name, _) = edit.split_once(':').expect("an edit");
        let mut value: serde_json::Value = serde_json::from_str(text)?;
        let (_, v) = edit.split_once(": ").expect("an edit");
        value[name.trim_matches('"')] = serde_json::from_str(v)?;
        let layer = usize::from(key != "attention_chunk_size");
        let err = HfAttentionConfig::from_json_layer(&value.to_string(), layer).unwrap_err();
        assert!(
            matches!(&err, Error::HfConfig { key: k, .. } if k == key),
            "{key}: {err}"
        );
    }
    Ok(())
}

/// A T5 layer past the first has no table of its own: it shares the first layer's.
fn t5_later_layers_share_the_first_table(dev: &Device) -> anyhow::Result<()> {
    let ckpt = fixtures(dev)?;
    let (config, first) = layer(&ckpt, "t5")?;
    let vb = ckpt.var_builder(DType::F32, dev);
    // The same tensors without the table, under another prefix.
    let renamed = fixtures(dev)?.renamed(|n| {
        n.strip_prefix("t5/encoder.block.0.")
            .filter(|rest| !rest.contains("relative_attention_bias"))
            .map(|rest| format!("t5/encoder.block.1.{rest}"))
    })?;
    let later_vb = renamed.var_builder(DType::F32, dev);
    let prefix = "t5/encoder.block.1.layer.0.SelfAttention";
    let err = config.load(later_vb.pp(prefix)).unwrap_err();
    assert!(
        matches!(&err, Error::MissingTensor { name } if name == "t5/encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight"),
        "{err}"
    );
    let later = config.load_with_encoding(first.encoding().cloned(), later_vb.pp(prefix))?;
    let x = get(ckpt.tensors(), "t5.x");
    assert_close(
        &later
            .forward_with(x, &AttentionOptions::default(), None)?
            .output,
        get(ckpt.tensors(), "t5.out"),
        1e-5,
        "shared table",
    )?;
    drop(vb);
    Ok(())
}

/// Tensors that are missing or misshapen are named by their HF names.
fn errors_name_the_hf_tensor(dev: &Device) -> anyhow::Result<()> {
    let ckpt = fixtures(dev)?;
    let meta = ckpt.metadata();
    let vb = ckpt.var_builder(DType::F32, dev);
    // Phi-3's settings over Llama's tensors: no fused projection there.
    let phi3 = HfAttentionConfig::from_json(&meta["phi3"])?;
    let err = phi3
        .load(vb.pp("llama/model.layers.0.self_attn"))
        .unwrap_err();
    assert!(
        matches!(&err, Error::MissingTensor { name } if name == "llama/model.layers.0.self_attn.qkv_proj.weight"),
        "{err}"
    );
    // Falcon multi-query's settings over the grouped layer's fused weight (H + 2Hkv = 8 heads
    // of rows there, 6 expected).
    let mqa = HfAttentionConfig::from_json(&meta["falcon_mqa"])?;
    let err = mqa
        .load(vb.pp("falcon_gqa/transformer.h.0.self_attention"))
        .unwrap_err();
    assert!(
        matches!(&err, Error::TensorShape { name, expected, got }
            if name == "falcon_gqa/transformer.h.0.self_attention.query_key_value.weight"
                && expected == &[48, 32] && got == &[64, 32]),
        "{err}"
    );
    // Qwen3 without its norms.
    let qwen3 = HfAttentionConfig::from_json(&meta["qwen3"])?;
    let err = qwen3
        .load(vb.pp("qwen2/model.layers.0.self_attn"))
        .unwrap_err();
    assert!(
        matches!(&err, Error::TensorShape { name, .. } if name == "qwen2/model.layers.0.self_attn.q_proj.weight"),
        "{err}"
    );
    // Integer weights.
    let err = qwen3
        .load(
            ckpt.var_builder(DType::U8, dev)
                .pp("qwen3/model.layers.0.self_attn"),
        )
        .unwrap_err();
    assert!(matches!(err, Error::DType { .. }), "{err}");
    Ok(())
}

/// `config.json` problems are reported under the file's own keys.
fn config_errors_name_the_key(_dev: &Device) -> anyhow::Result<()> {
    bad_values_are_reported_under_their_key();
    windows_as_each_class_reads_them()?;
    layers_past_the_model_or_its_layer_types()
}

/// Each bad or missing value of a small file is refused under its own key.
fn bad_values_are_reported_under_their_key() {
    let key_of = |json: &str| match HfAttentionConfig::from_json(json) {
        Err(Error::HfConfig { key, problem }) => (key, problem),
        other => panic!("{json}: {other:?}"),
    };
    let llama = r#""model_type": "llama", "hidden_size": 32, "num_attention_heads": 4"#;
    let cases = [
        (r#"[1, 2]"#.to_string(), "<root>"),
        (r#"{"hidden_size": 32}"#.to_string(), "model_type"),
        (r#"{"model_type": "mamba"}"#.to_string(), "model_type"),
        (
            r#"{"model_type": "mpt", "d_model": 32, "n_heads": 4, "attn_config": {"qk_ln": true}}"#
                .to_string(),
            "attn_config.qk_ln",
        ),
        (r#"{"model_type": "llama", "num_attention_heads": 4}"#.to_string(), "hidden_size"),
        (format!("{{{llama}, \"num_key_value_heads\": 3}}"), "num_key_value_heads"),
        (format!("{{{llama}, \"num_key_value_heads\": \"2\"}}"), "num_key_value_heads"),
        (format!("{{{llama}, \"attention_bias\": 1}}"), "attention_bias"),
        (format!("{{{llama}, \"head_dim\": 0}}"), "head_dim"),
        (
            r#"{"model_type": "qwen2", "hidden_size": 32, "num_attention_heads": 4,
                "use_sliding_window": true, "sliding_window": 8, "layer_types": ["chunked_attention"]}"#
                .to_string(),
            "layer_types",
        ),
        (
            r#"{"model_type": "gemma2", "hidden_size": 32, "num_attention_heads": 4, "head_dim": 8,
                "num_hidden_layers": 1, "sliding_window": 0}"#
                .to_string(),
            "sliding_window",
        ),
        (
            r#"{"model_type": "gemma2", "hidden_size": 32, "num_attention_heads": 4, "head_dim": 8,
                "num_hidden_layers": 1, "attn_logit_softcapping": -5.0}"#
                .to_string(),
            "attn_logit_softcapping",
        ),
        // Gemma 2 alternates sliding and full layers: read one at a time.
        (
            r#"{"model_type": "gemma2", "hidden_size": 32, "num_attention_heads": 4, "head_dim": 8,
                "num_hidden_layers": 2}"#
                .to_string(),
            "num_hidden_layers",
        ),
        (
            r#"{"model_type": "qwen3", "hidden_size": 32, "num_attention_heads": 4,
                "num_key_value_heads": 4, "rms_norm_eps": 0.0}"#
                .to_string(),
            "rms_norm_eps",
        ),
        // Class defaults HF's module cannot run with: DeepSeek V3's 128 key/value heads for 4
        // heads, GPT-J's 64 rotary features in 8-wide heads, Qwen2-VL's sections [16, 24, 24]
        // for 8 frequencies.
        (
            r#"{"model_type": "deepseek_v3", "hidden_size": 32, "num_attention_heads": 4}"#
                .to_string(),
            "num_key_value_heads",
        ),
        (
            r#"{"model_type": "gptj", "n_embd": 32, "n_head": 4}"#.to_string(),
            "rotary_dim",
        ),
        (
            r#"{"model_type": "qwen2_vl", "text_config": {"hidden_size": 32,
                "num_attention_heads": 2, "num_key_value_heads": 2}}"#
                .to_string(),
            "rope_parameters.mrope_section",
        ),
        (
            r#"{"model_type": "t5", "d_model": 32, "num_heads": 4, "d_kv": 8, "relative_attention_num_buckets": 1}"#
                .to_string(),
            "relative_attention_num_buckets",
        ),
    ];
    for (json, key) in cases {
        let (got, problem) = key_of(&json);
        assert_eq!(got, key, "{json}: {problem}");
    }
}

/// Windows as HF's config classes read them.
fn windows_as_each_class_reads_them() -> anyhow::Result<()> {
    let window = |json: &str, layer: usize| -> anyhow::Result<Option<usize>> {
        Ok(HfAttentionConfig::from_json_layer(json, layer)?
            .attention
            .sliding_window)
    };
    let base = r#""hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4"#;
    // Qwen's switch decides; off, the window is not used.
    let qwen =
        format!(r#"{{"model_type": "qwen2", {base}, "sliding_window": 8, "max_window_layers": 1"#);
    assert_eq!(
        window(&format!("{qwen}, \"use_sliding_window\": false}}"), 3)?,
        None
    );
    assert_eq!(
        window(&format!("{qwen}, \"use_sliding_window\": true}}"), 0)?,
        None
    );
    assert_eq!(
        window(&format!("{qwen}, \"use_sliding_window\": true}}"), 1)?,
        Some(8)
    );
    // Switched on without a window or a first layer: the class defaults, 4096 from layer 28
    // (Qwen2-VL's text model from layer 80; Qwen3-VL's has no window at all).
    let qwen = format!(r#"{{"model_type": "qwen2", {base}, "use_sliding_window": true}}"#);
    assert_eq!(window(&qwen, 27)?, None);
    assert_eq!(window(&qwen, 28)?, Some(4096));
    let vl = |t: &str| {
        format!(
            r#"{{"model_type": "{t}", "text_config": {{"hidden_size": 512, "num_attention_heads": 4,
                "num_key_value_heads": 4, "use_sliding_window": true}}}}"#
        )
    };
    assert_eq!(window(&vl("qwen2_vl"), 79)?, None);
    assert_eq!(window(&vl("qwen2_vl"), 80)?, Some(4096));
    assert_eq!(window(&vl("qwen3_vl"), 80)?, None);
    // Mistral's class default is 4096; only an explicit null turns it off.
    assert_eq!(
        window(&format!(r#"{{"model_type": "mistral", {base}}}"#), 0)?,
        Some(4096)
    );
    assert_eq!(
        window(
            &format!(r#"{{"model_type": "mistral", {base}, "sliding_window": null}}"#),
            0
        )?,
        None
    );
    // Llama reads no window.
    assert_eq!(
        window(
            &format!(r#"{{"model_type": "llama", {base}, "sliding_window": 16}}"#),
            0
        )?,
        None
    );
    // Gemma 2 without layer_types: even layers slide; Gemma 3 every sixth layer is full.
    let gemma2 =
        format!(r#"{{"model_type": "gemma2", {base}, "head_dim": 8, "sliding_window": 5}}"#);
    assert_eq!(window(&gemma2, 0)?, Some(5));
    assert_eq!(window(&gemma2, 1)?, None);
    let gemma3 =
        format!(r#"{{"model_type": "gemma3_text", {base}, "head_dim": 8, "sliding_window": 5}}"#);
    assert_eq!(window(&gemma3, 4)?, Some(5));
    assert_eq!(window(&gemma3, 5)?, None);
    Ok(())
}

/// A layer past the model's layers, then one past layer_types (which lists fewer).
fn layers_past_the_model_or_its_layer_types() -> anyhow::Result<()> {
    let ckpt = fixtures(&Device::Cpu)?;
    let err = HfAttentionConfig::from_json_layer(&ckpt.metadata()["gemma2.0"], 2).unwrap_err();
    assert!(
        matches!(&err, Error::HfConfig { key, .. } if key == "num_hidden_layers"),
        "{err}"
    );
    // A list shorter or longer than the layers (HF's classes refuse both) is refused for
    // every layer, not read entry by entry.
    for (layers, layer) in [(3, 2), (3, 0), (1, 0)] {
        let text = ckpt.metadata()["gemma2.0"].replace(
            "\"num_hidden_layers\": 2",
            &format!("\"num_hidden_layers\": {layers}"),
        );
        let err = HfAttentionConfig::from_json_layer(&text, layer).unwrap_err();
        assert!(
            matches!(&err, Error::HfConfig { key, .. } if key == "layer_types"),
            "{layers} layers, layer {layer}: {err}"
        );
    }
    let err = HfAttentionConfig::from_json(&ckpt.metadata()["gpt_oss.0"]).unwrap_err();
    assert!(
        matches!(&err, Error::HfConfig { key, .. } if key == "layer_types"),
        "{err}"
    );
    Ok(())
}

/// The query/key norm is part of the block's configuration: serialised, validated, created
/// as the identity in a `VarMap`, and checked against its formula.
fn qk_norm_config_and_formula(dev: &Device) -> anyhow::Result<()> {
    let norm = QkNormConfig::new()
        .with_scope(QkNormScope::AllHeads)
        .with_eps(1e-5)
        .with_unit_offset(true);
    let cfg = AttentionConfig::new(16, 4)
        .with_kv_heads(2)
        .with_qk_norm(Some(norm));
    let json = serde_json::to_string(&cfg)?;
    assert_eq!(serde_json::from_str::<AttentionConfig>(&json)?, cfg);
    let partial: AttentionConfig =
        serde_json::from_str(r#"{"d_model": 16, "num_heads": 4, "qk_norm": {}}"#)?;
    assert_eq!(partial.qk_norm, Some(QkNormConfig::new()));
    assert!(serde_json::from_str::<AttentionConfig>(
        r#"{"d_model": 16, "num_heads": 4, "qk_norm": {"epsilon": 1e-6}}"#
    )
    .is_err());
    for eps in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e-300] {
        let bad = AttentionConfig::new(16, 4).with_qk_norm(Some(QkNormConfig::new().with_eps(eps)));
        assert!(
            matches!(
                bad.validate(),
                Err(Error::InvalidConfig {
                    name: "qk_norm.eps",
                    ..
                })
            ),
            "eps {eps}"
        );
    }
    // A VarMap block starts with the identity scale (stored as 0 with the unit offset).
    let varmap = candle_nn::VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    MultiHeadAttention::new(&cfg, None, vb.pp("attn"))?;
    let vars = varmap.data().lock().unwrap();
    assert_eq!(vars["attn.q_norm.weight"].dims(), &[16]);
    assert_eq!(vars["attn.k_norm.weight"].dims(), &[8]);
    assert_eq!(
        vars["attn.k_norm.weight"]
            .abs()?
            .sum_all()?
            .to_scalar::<f32>()?,
        0.0
    );
    drop(vars);

    // Per head, against the formula: q = n(x W_qᵀ) per head, with scale w.
    let (d, h, hd) = (8, 2, 4);
    let cfg = AttentionConfig::new(d, h)
        .with_qk_norm(Some(QkNormConfig::new().with_eps(1e-6)))
        .with_causal(true);
    let w = |rows, seed: f64| -> anyhow::Result<Tensor> {
        let n = rows * d;
        Ok(Tensor::arange(0u32, n as u32, dev)?
            .to_dtype(DType::F32)?
            .affine(0.37, seed)?
            .sin()?
            .reshape((rows, d))?)
    };
    let scale = Tensor::new(&[0.5f32, 1.5, -1.0, 2.0], dev)?;
    let tensors = std::collections::HashMap::from([
        ("q_proj.weight".to_string(), w(h * hd, 0.1)?),
        ("k_proj.weight".to_string(), w(h * hd, 0.7)?),
        ("v_proj.weight".to_string(), w(h * hd, 1.3)?),
        ("o_proj.weight".to_string(), w(d, 1.9)?),
        ("q_norm.weight".to_string(), scale.clone()),
        ("k_norm.weight".to_string(), (&scale * 0.5)?),
    ]);
    let vb = candle_nn::VarBuilder::from_tensors(tensors.clone(), DType::F32, dev);
    let block = MultiHeadAttention::new(&cfg, None, vb)?;
    // The same block without norms, fed pre-normalised projections through its weights:
    // n(x W) for one head = x W diag(w / rms) — check instead against plain ops.
    let x = common::randn(0f32, 1.0, (1, 3, d), dev)?;
    let rms_norm = |y: &Tensor, s: &Tensor| -> anyhow::Result<Tensor> {
        let y = y.reshape((1, 3, h, hd))?;
        let ms = y.sqr()?.mean_keepdim(3)?;
        Ok(y.broadcast_div(&(ms + 1e-6)?.sqrt()?)?.broadcast_mul(s)?)
    };
    let q = rms_norm(
        &x.matmul(&tensors["q_proj.weight"].t()?.unsqueeze(0)?)?,
        &scale,
    )?;
    let k = rms_norm(
        &x.matmul(&tensors["k_proj.weight"].t()?.unsqueeze(0)?)?,
        &(&scale * 0.5)?,
    )?;
    let v = x
        .matmul(&tensors["v_proj.weight"].t()?.unsqueeze(0)?)?
        .reshape((1, 3, h, hd))?;
    let (q, k, v) = (q.transpose(1, 2)?, k.transpose(1, 2)?, v.transpose(1, 2)?);
    let logits = (q.contiguous()?.matmul(&k.contiguous()?.t()?)? * 0.5)?;
    let causal = Tensor::new(
        &[
            [0f32, f32::NEG_INFINITY, f32::NEG_INFINITY],
            [0.0, 0.0, f32::NEG_INFINITY],
            [0.0, 0.0, 0.0],
        ],
        dev,
    )?;
    let probs = candle_nn::ops::softmax_last_dim(&logits.broadcast_add(&causal)?)?;
    let merged = probs
        .matmul(&v.contiguous()?)?
        .transpose(1, 2)?
        .reshape((1, 3, d))?;
    let want = merged.matmul(&tensors["o_proj.weight"].t()?.unsqueeze(0)?)?;
    let got = block
        .forward_with(&x, &AttentionOptions::default(), None)?
        .output;
    assert_close(&got, &want, 1e-5, "per-head q/k norm")?;
    Ok(())
}

/// Layer indices are checked against the model's layers before any arithmetic on them: the
/// last index, `usize::MAX` (whose `layer + 1` overflowed), and Gemma 4's KV-sharing refusal
/// with a shared count whose sum with the layer overflowed.
fn layer_indices_past_the_model(_dev: &Device) -> anyhow::Result<()> {
    let ckpt = fixtures(&Device::Cpu)?;
    let meta = ckpt.metadata();
    for tag in [
        "gemma2.0",
        "gemma3.0",
        "gemma4.0",
        "smollm3.0",
        "llama4.0",
        "gpt_oss.0",
    ] {
        for layer in [usize::MAX, usize::MAX - 1, 1 << 40] {
            let err = HfAttentionConfig::from_json_layer(&meta[tag], layer).unwrap_err();
            assert!(
                matches!(&err, Error::HfConfig { key, problem }
                    if key == "num_hidden_layers" && problem.contains(&format!("no layer {layer}"))),
                "{tag} layer {layer}: {err}"
            );
        }
    }
    // GPT-2 counts its layers as n_layer.
    let err = HfAttentionConfig::from_json_layer(&meta["gpt2"], usize::MAX).unwrap_err();
    assert!(
        matches!(&err, Error::HfConfig { key, .. } if key == "n_layer"),
        "{err}"
    );
    // Without a layer count the patterns are still total: every_nth, not (layer + 1).
    let gemma2 = r#"{"model_type": "gemma2", "hidden_size": 32, "num_attention_heads": 4,
        "head_dim": 8, "sliding_window": 5}"#;
    let last = HfAttentionConfig::from_json_layer(gemma2, usize::MAX)?;
    // usize::MAX + 1 = 2^64 is even: a full layer.
    assert_eq!(last.attention.sliding_window, None);
    // Gemma 4 with a shared-layer count so large that layer + shared overflowed (and so
    // skipped the refusal in release).
    let gemma4 = r#"{"model_type": "gemma4_text", "hidden_size": 32, "num_attention_heads": 4,
        "head_dim": 8, "num_hidden_layers": 4, "num_kv_shared_layers": 18446744073709551615}"#;
    let err = HfAttentionConfig::from_json_layer(gemma4, 3).unwrap_err();
    assert!(
        matches!(&err, Error::HfConfig { key, .. } if key == "num_kv_shared_layers"),
        "{err}"
    );
    Ok(())
}

/// The config's fields are public: values changed after parsing are checked again by
/// `load` before any size is computed from them (no division by zero heads, no overflow).
fn fields_changed_after_parsing_are_checked(dev: &Device) -> anyhow::Result<()> {
    let ckpt = fixtures(dev)?;
    let meta = ckpt.metadata();
    let vb = ckpt.var_builder(DType::F32, dev);
    let expect = |cfg: &HfAttentionConfig, tag: &str, name: &str| {
        let prefix = format!("{tag}/{}", meta[&format!("{tag}.prefix")]);
        match cfg.load(vb.pp(&prefix)) {
            Err(Error::InvalidConfig { name: got, .. }) => {
                assert!(got.contains(name), "{tag}: {got}, expected {name}")
            }
            other => panic!("{tag}: {other:?}"),
        }
    };
    // Falcon's grouped layout divided num_heads by num_kv_heads.
    let mut gqa = HfAttentionConfig::from_json(&meta["falcon_gqa"])?;
    gqa.attention.num_kv_heads = 0;
    expect(&gqa, "falcon_gqa", "num_kv_heads");
    let mut llama = HfAttentionConfig::from_json(&meta["llama"])?;
    llama.attention.num_heads = usize::MAX;
    expect(&llama, "llama", "num_kv_heads");
    llama.attention.num_heads = 1 << 40;
    llama.attention.num_kv_heads = 1 << 40;
    expect(&llama, "llama", "head_dim");
    // DeepSeek's head_dim − rope_dim.
    let mut deepseek = HfAttentionConfig::from_json(&meta["deepseek_v2"])?;
    let latent = deepseek.attention.latent.as_mut().expect("latent");
    latent.rope_dim = deepseek.attention.head_dim + 2;
    expect(&deepseek, "deepseek_v2", "rope_dim");
    // T5's table shape comes from the encoding.
    let mut t5 = HfAttentionConfig::from_json(&meta["t5"])?;
    if let EncodingConfig::T5(c) = &mut t5.encoding {
        c.num_buckets = usize::MAX;
    }
    expect(&t5, "t5", "num_buckets");
    Ok(())
}

/// The family's layer trains as HF's does: the gradient of `Σ probe · layer(x)` with
/// respect to x, from the fused backward (training mode) and from candle's ops (the weights
/// returned), equals torch autograd's through HF's module (`generate.py hf_layers`) within
/// 1e-5 of its largest entry. The probe is 0 on padded queries.
fn every_family_trains_as_hf(tag: &str, dev: &Device) -> anyhow::Result<()> {
    let ckpt = fixtures(dev)?;
    let (_, block) = layer(&ckpt, tag)?;
    let x = candle_core::Var::from_tensor(get(ckpt.tensors(), &format!("{tag}.x")))?;
    let probe = get(ckpt.tensors(), &format!("{tag}.grad.probe"));
    let want = get(ckpt.tensors(), &format!("{tag}.grad.x"));
    let axes = ckpt.tensors().get(&format!("{tag}.positions"));
    let ids = ckpt.tensors().get(&format!("{tag}.position_ids"));
    let all = match (axes, ids) {
        (Some(a), _) => Positions::Ids(PositionIds::multimodal(a)?),
        (None, Some(i)) => Positions::Ids(PositionIds::new(i)?),
        (None, None) => Positions::Offset(0),
    };
    let padding = ckpt.tensors().get(&format!("{tag}.padding"));
    let top = want.abs()?.max_all()?.to_scalar::<f32>()?;
    for (path, return_weights) in [("fused", false), ("ops", true)] {
        let out = block
            .forward_with(
                x.as_tensor(),
                &AttentionOptions {
                    positions: Some(&all),
                    padding_mask: padding,
                    return_weights,
                    train: true,
                    ..Default::default()
                },
                None,
            )?
            .output;
        let grads = (out * probe)?.sum_all()?.backward()?;
        let got = grads
            .get(x.as_tensor())
            .ok_or_else(|| anyhow::anyhow!("{tag}: x gets no gradient"))?;
        assert_close(
            got,
            want,
            1e-5 * f64::from(top.max(1.0)),
            &format!("{tag} {path} gradient"),
        )?;
    }
    Ok(())
}

/// MPT as HF's `MptModel` computes it: ALiBi with MPT's slopes and the largest exponent 8,
/// whatever `attn_config.alibi_bias_max` and `attn_config.alibi` say (HF reads neither).
fn mpt_alibi_as_hf_builds_it(dev: &Device) -> anyhow::Result<()> {
    let ckpt = fixtures(dev)?;
    let hf_slopes =
        EncodingConfig::Alibi(AlibiConfig::new(6).with_slopes(AlibiSlopes::Mpt { max_bias: 8.0 }));
    for tag in ["mpt", "mpt_bias_max16", "mpt_no_alibi"] {
        let config = HfAttentionConfig::from_json(&ckpt.metadata()[tag])?;
        assert_eq!(config.encoding, hf_slopes, "{tag}");
        let d = distance_from_hf(&ckpt, tag, &config)?;
        assert!(d < 1e-5, "{tag}: {d}");
    }
    // The files' own readings (MosaicML's) are not what HF computes: the fixtures tell them
    // apart.
    let mut honoured = HfAttentionConfig::from_json(&ckpt.metadata()["mpt_bias_max16"])?;
    honoured.encoding =
        EncodingConfig::Alibi(AlibiConfig::new(6).with_slopes(AlibiSlopes::Mpt { max_bias: 16.0 }));
    assert!(distance_from_hf(&ckpt, "mpt_bias_max16", &honoured)? > 1e-2);
    let mut none = HfAttentionConfig::from_json(&ckpt.metadata()["mpt_no_alibi"])?;
    none.encoding = EncodingConfig::None;
    assert!(distance_from_hf(&ckpt, "mpt_no_alibi", &none)? > 1e-2);
    // A value HF would not accept for its own slopes is not read either.
    let odd = r#"{"model_type": "mpt", "d_model": 32, "n_heads": 4,
        "attn_config": {"alibi": false, "alibi_bias_max": -1.0}}"#;
    assert_eq!(
        HfAttentionConfig::from_json(odd)?.encoding,
        EncodingConfig::Alibi(AlibiConfig::new(4).with_slopes(AlibiSlopes::Mpt { max_bias: 8.0 }))
    );
    Ok(())
}

/// Gemma 3 has no logit soft cap, whatever `attn_logit_softcapping` says (HF's
/// `Gemma3Attention` does not pass it on); Gemma 2 keeps its cap.
fn gemma3_has_no_soft_cap(dev: &Device) -> anyhow::Result<()> {
    let ckpt = fixtures(dev)?;
    let text = &ckpt.metadata()["gemma3_softcap.1"];
    assert!(text.contains("\"attn_logit_softcapping\": 2.0"), "{text}");
    let config = HfAttentionConfig::from_json_layer(text, 1)?;
    assert_eq!(config.attention.logit_softcap, None);
    assert!(distance_from_hf(&ckpt, "gemma3_softcap.1", &config)? < 1e-5);
    // The cap the file names would move the output far from HF's.
    let mut capped = config.clone();
    capped.attention = capped.attention.with_logit_softcap(Some(2.0));
    assert!(distance_from_hf(&ckpt, "gemma3_softcap.1", &capped)? > 1e-2);
    // Not read at all, so not refused either; Gemma 2's is read, checked, 50 by default.
    let base =
        r#""hidden_size": 32, "num_attention_heads": 4, "head_dim": 8, "num_hidden_layers": 1"#;
    let cap = |json: String| -> anyhow::Result<Option<f64>> {
        Ok(HfAttentionConfig::from_json(&json)?.attention.logit_softcap)
    };
    assert_eq!(
        cap(format!(
            r#"{{"model_type": "gemma3_text", {base}, "attn_logit_softcapping": -5.0}}"#
        ))?,
        None
    );
    assert_eq!(
        cap(format!(r#"{{"model_type": "gemma2", {base}}}"#))?,
        Some(50.0)
    );
    assert_eq!(
        HfAttentionConfig::from_json_layer(&ckpt.metadata()["gemma2.1"], 1)?
            .attention
            .logit_softcap,
        Some(5.0)
    );
    Ok(())
}

/// `partial_rotary_factor` as each model's HF code reads it: Llama-style models rotate the
/// whole head with the default RoPE and fail on a factor that shortens a scaled RoPE's table
/// (refused here); GPT-NeoX reads `rotary_pct`, not a top-level factor; Phi-3 honours it.
fn partial_rotary_as_each_model_reads_it(dev: &Device) -> anyhow::Result<()> {
    fixtures_rotate_as_much_as_hf_reads(&fixtures(dev)?)?;
    llama_style_models_rotate_the_whole_head()?;
    the_layer_reader_reads_the_factor_alike()?;
    neox_phi3_and_gptj_read_their_own_keys()
}

/// The head width and rotated features of a rotary `config`.
fn rotary_dims(config: &HfAttentionConfig) -> (usize, usize) {
    match &config.encoding {
        EncodingConfig::Rotary(r) => (r.head_dim, r.rotary_dim),
        other => panic!("read as {other:?}"),
    }
}

/// The fixtures: the whole of Llama's 8-wide heads, half of GPT-NeoX's 16-wide ones.
fn fixtures_rotate_as_much_as_hf_reads(ckpt: &Checkpoint) -> anyhow::Result<()> {
    for (tag, want, other) in [("llama_partial", (8, 8), 4), ("neox_pct", (16, 8), 16)] {
        let config = HfAttentionConfig::from_json(&ckpt.metadata()[tag])?;
        assert_eq!(rotary_dims(&config), want, "{tag}");
        assert!(distance_from_hf(ckpt, tag, &config)? < 1e-5, "{tag}");
        // The other reading is far from HF's output.
        let mut wrong = config.clone();
        if let EncodingConfig::Rotary(r) = &mut wrong.encoding {
            r.rotary_dim = other;
        }
        assert!(distance_from_hf(ckpt, tag, &wrong)? > 1e-2, "{tag}");
    }
    Ok(())
}

/// The Llama-style model types the loader reads.
const LLAMA_STYLE_MODEL_TYPES: [&str; 24] = [
    "llama",
    "mistral",
    "ministral",
    "starcoder2",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "olmo2",
    "gpt_oss",
    "smollm3",
    "cohere",
    "cohere2",
    "llama4_text",
    "gemma4_text",
    "helium",
    "ernie4_5",
    "falcon",
    "modernbert",
    "qwen2_vl_text",
    "qwen2_5_vl_text",
    "qwen3_vl_text",
    "qwen3_vl_moe_text",
];

/// Every Llama-style model type the loader reads: the default RoPE ignores the factor
/// (in rope_parameters or at the top level); a scaled one that it would shorten is
/// refused under the factor's key; a factor giving the whole head is fine.
fn llama_style_models_rotate_the_whole_head() -> anyhow::Result<()> {
    // Heads of 128 (Cohere's and Falcon's width over the heads, the others' head_dim, which
    // HF's FalconConfig refuses), which the Qwen-VL text models' default sections fit.
    let wide_of = |model_type: &str| match model_type {
        "falcon" => {
            r#""hidden_size": 512, "num_attention_heads": 4, "max_position_embeddings": 64"#
        }
        _ => {
            r#""hidden_size": 512, "num_attention_heads": 4, "head_dim": 128,
        "max_position_embeddings": 64"#
        }
    };
    for model_type in LLAMA_STYLE_MODEL_TYPES {
        let wide = wide_of(model_type);
        let rope = |extra: &str| {
            RopeConfig::from_hf_json(&format!(
                r#"{{"model_type": "{model_type}", {wide}, {extra}}}"#
            ))
        };
        for extra in [
            r#""rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}"#,
            r#""partial_rotary_factor": 0.25, "rotary_pct": 0.5, "rotary_dim": 4"#,
            r#""partial_rotary_factor": 1.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0}"#,
        ] {
            // gpt-oss's class default is YaRN, which a top-level factor would shorten (below).
            if model_type == "gpt_oss" && !extra.contains("rope_") {
                continue;
            }
            let r = rope(extra)?;
            assert_eq!(
                (r.head_dim, r.rotary_dim),
                (128, 128),
                "{model_type} {extra}"
            );
        }
        for (extra, key) in [
            (
                r#""rope_parameters": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}"#,
                "rope_parameters.partial_rotary_factor",
            ),
            (
                r#""partial_rotary_factor": 0.75, "rope_scaling": {"type": "dynamic", "factor": 2.0}"#,
                "partial_rotary_factor",
            ),
        ] {
            match rope(extra) {
                Err(Error::HfConfig { key: got, .. }) => {
                    assert_eq!(got, key, "{model_type} {extra}")
                }
                other => panic!("{model_type} {extra}: {other:?}"),
            }
        }
    }
    Ok(())
}

/// The same through the layer reader: a Llama layer, a Qwen2-VL text model, and DeepSeek
/// V3's rotary part (yarn, refused; default, the whole rotary part).
fn the_layer_reader_reads_the_factor_alike() -> anyhow::Result<()> {
    let llama = r#"{"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": 16}, "max_position_embeddings": 64}"#;
    assert!(matches!(
        HfAttentionConfig::from_json(llama),
        Err(Error::HfConfig { key, .. }) if key == "rope_parameters.partial_rotary_factor"
    ));
    let qwen2_vl = r#"{"model_type": "qwen2_vl", "text_config": {"model_type": "qwen2_vl_text",
        "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
        "partial_rotary_factor": 0.5,
        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]}}}"#;
    assert_eq!(
        rotary_dims(&HfAttentionConfig::from_json(qwen2_vl)?),
        (16, 16)
    );
    let deepseek = |rope: &str| {
        HfAttentionConfig::from_json(&format!(
            r#"{{"model_type": "deepseek_v3", "hidden_size": 32, "num_attention_heads": 4,
                "num_key_value_heads": 4, "q_lora_rank": 12, "kv_lora_rank": 10, "qk_nope_head_dim": 4,
                "qk_rope_head_dim": 8, "v_head_dim": 6, "max_position_embeddings": 64,
                "partial_rotary_factor": 0.5, "rope_parameters": {rope}}}"#
        ))
    };
    assert!(matches!(
        deepseek(r#"{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}"#),
        Err(Error::HfConfig { key, .. }) if key == "partial_rotary_factor"
    ));
    match deepseek(r#"{"rope_type": "default"}"#)?.encoding {
        EncodingConfig::Rotary(r) => assert_eq!((r.head_dim, r.rotary_dim), (12, 8)),
        other => panic!("DeepSeek read as {other:?}"),
    }
    Ok(())
}

/// Phi-3 honours the factor with any RoPE, from the parameters or the top level; GPT-NeoX
/// reads rope_parameters' factor, else rotary_pct, else 0.25; GPT-J reads rotary_dim.
fn neox_phi3_and_gptj_read_their_own_keys() -> anyhow::Result<()> {
    let base = r#""hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 64"#;
    let rope = |json: &str| -> anyhow::Result<(usize, usize)> {
        let r = RopeConfig::from_hf_json(json)?;
        Ok((r.head_dim, r.rotary_dim))
    };
    assert_eq!(
        rope(&format!(
            r#"{{"model_type": "phi3", {base}, "partial_rotary_factor": 0.5}}"#
        ))?,
        (16, 8)
    );
    assert_eq!(
        rope(&format!(
            r#"{{"model_type": "phi3", {base}, "rope_parameters": {{"rope_type": "default", "partial_rotary_factor": 0.25}}}}"#
        ))?,
        (16, 4)
    );
    let neox = |extra: &str| rope(&format!(r#"{{"model_type": "gpt_neox", {base}, {extra}}}"#));
    assert_eq!(neox(r#""partial_rotary_factor": 1.0"#)?, (16, 4));
    assert_eq!(
        neox(r#""partial_rotary_factor": 1.0, "rotary_pct": 0.5"#)?,
        (16, 8)
    );
    assert_eq!(
        neox(
            r#""rotary_pct": 0.5, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.75}"#
        )?,
        (16, 12)
    );
    let gptj = |extra: &str| {
        rope(&format!(
            r#"{{"model_type": "gptj", "n_embd": 64, "n_head": 4, {extra}}}"#
        ))
    };
    assert_eq!(
        gptj(r#""rotary_dim": 4, "partial_rotary_factor": 0.5"#)?,
        (16, 4)
    );
    Ok(())
}

/// Gemma 4 as `Gemma4TextConfig.__post_init__` fills a file: full layers `global_head_dim`
/// wide (512 by default), with `num_global_key_value_heads` only under `attention_k_eq_v`; a
/// `per_layer_config` (zero-padded keys) instead, none when null; the last layer full; the
/// class's per-type RoPE; nulls the class refuses refused under their keys.
fn gemma4_as_its_class_fills_it(_dev: &Device) -> anyhow::Result<()> {
    let base = r#""model_type": "gemma4_text", "hidden_size": 16, "num_attention_heads": 2,
        "num_key_value_heads": 2, "num_hidden_layers": 2"#;
    let read = |extra: &str, layer| {
        HfAttentionConfig::from_json_layer(&format!("{{{base}{extra}}}"), layer)
    };
    let rope = |c: &HfAttentionConfig| match &c.encoding {
        EncodingConfig::Rotary(r) => (r.head_dim, r.base, r.scaling.name()),
        other => panic!("read as {other:?}"),
    };
    let (local, full) = (read("", 0)?, read("", 1)?);
    assert_eq!(
        (local.attention.head_dim, local.attention.sliding_window),
        (256, Some(512))
    );
    assert_eq!(
        (full.attention.head_dim, full.attention.sliding_window),
        (512, None)
    );
    assert_eq!(rope(&local), (256, 10_000.0, "default"));
    assert_eq!(rope(&full), (512, 1e6, "proportional"));
    // A top-level θ is not read by the class.
    assert_eq!(
        rope(&read(r#", "rope_theta": 5.0"#, 1)?),
        (512, 1e6, "proportional")
    );
    for (extra, want) in [
        (r#", "global_head_dim": 32"#, (32, 2, false)),
        (r#", "num_global_key_value_heads": 1"#, (512, 2, false)),
        (
            r#", "num_global_key_value_heads": 1, "attention_k_eq_v": true"#,
            (512, 1, true),
        ),
        (r#", "attention_k_eq_v": true"#, (512, 2, true)),
        (r#", "per_layer_config": null"#, (256, 2, false)),
        (
            r#", "per_layer_config": {"01": {"head_dim": 64}}"#,
            (64, 2, false),
        ),
        // The last listed layer is full whatever its entry says.
        (
            r#", "layer_types": ["sliding_attention", "sliding_attention"]"#,
            (512, 2, false),
        ),
    ] {
        let a = read(extra, 1)?.attention;
        assert_eq!((a.head_dim, a.num_kv_heads, a.k_eq_v), want, "{extra}");
        assert_eq!(a.sliding_window, None, "{extra}");
    }
    // A file's own per-type parameters; a missing θ from the top level only where HF's scaled
    // RoPE functions fill it.
    let params = r#", "rope_parameters": {"full_attention": {"rope_type": "proportional",
        "rope_theta": 100.0, "partial_rotary_factor": 0.5}, "sliding_attention": {"rope_type": "default"}},
        "rope_theta": 50.0"#;
    assert_eq!(rope(&read(params, 0)?), (256, 50.0, "default"));
    assert_eq!(rope(&read(params, 1)?), (512, 100.0, "proportional"));
    for (extra, layer, key) in [
        (r#", "num_key_value_heads": null"#, 0, "num_key_value_heads"),
        (r#", "head_dim": null"#, 0, "head_dim"),
        (r#", "sliding_window": null"#, 0, "sliding_window"),
        (r#", "global_head_dim": null"#, 1, "global_head_dim"),
        (r#", "rope_scaling": null"#, 0, "rope_scaling"),
        (
            r#", "rope_parameters": {"rope_type": "default", "rope_theta": 1.0}"#,
            0,
            "rope_parameters",
        ),
        (
            r#", "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1.0},
            "sliding_attention": {"rope_type": "default"}}, "rope_theta": 50.0"#,
            0,
            "rope_parameters.sliding_attention.rope_theta",
        ),
        (
            r#", "per_layer_config": {"2": {"head_dim": 64}}"#,
            1,
            "per_layer_config",
        ),
        (r#", "per_layer_config": {"x": {}}"#, 1, "per_layer_config"),
        (
            r#", "per_layer_config": {"1": {"head_dim": null}}"#,
            1,
            "per_layer_config.1.head_dim",
        ),
    ] {
        let err = read(extra, layer).unwrap_err();
        assert!(
            matches!(&err, Error::HfConfig { key: k, .. } if k == key),
            "{extra}: {err}"
        );
    }
    // Full layers of different widths: HF builds one table per layer type and refuses it.
    let err = HfAttentionConfig::from_json_layer(
        r#"{"model_type": "gemma4_text", "hidden_size": 16, "num_attention_heads": 2,
        "num_key_value_heads": 2, "num_hidden_layers": 3,
        "layer_types": ["full_attention", "sliding_attention", "full_attention"],
        "per_layer_config": {"0": {"head_dim": 32}}}"#,
        0,
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::HfConfig { key, .. } if key == "per_layer_config"),
        "{err}"
    );
    Ok(())
}

/// An explicit null as each HF class reads it: `num_key_value_heads` the heads where the class
/// types it `int | None` (Qwen2's default would be 32), refused where the field is a plain int
/// (Mistral, Gemma); `head_dim` the width over the heads for Llama and Mistral, refused where
/// the class or its attention fails on it (Qwen3, Qwen2); Falcon's file may not set
/// `head_dim` at all (a read-only property of its class).
fn nulls_as_each_class_reads_them(_dev: &Device) -> anyhow::Result<()> {
    typed_keys_refuse_a_null();
    widths_the_heads_do_not_divide();
    olmo2_ignores_clip_qkv()?;
    phi3_takes_longrope_or_no_scaling();
    a_null_rotary_pct_is_refused_unless_the_parameters_give_it()?;
    null_heads_and_widths_as_the_classes_fill_them()
}

/// A one-layer config.json of `model_type`, 32 wide with 4 heads, and `extra` keys.
fn one_layer(model_type: &str, extra: &str) -> candle_posenc::Result<HfAttentionConfig> {
    HfAttentionConfig::from_json(&format!(
        r#"{{"model_type": "{model_type}", "hidden_size": 32, "num_attention_heads": 4,
        "num_hidden_layers": 1{extra}}}"#
    ))
}

/// Keys the classes type without a null (or compute with) are refused under their name when
/// null; where a class has no such field, or replaces the null, the key reads as absent.
fn typed_keys_refuse_a_null() {
    for (model_type, key, refused) in [
        ("llama", "attention_bias", true),
        ("qwen3", "attention_bias", true),
        ("gemma2", "query_pre_attn_scalar", true),
        ("gemma3_text", "sliding_window_pattern", true),
        ("cohere2", "sliding_window_pattern", true),
        ("qwen2", "use_sliding_window", true),
        ("qwen3", "max_window_layers", true),
        ("smollm3", "use_sliding_window", true),
        ("starcoder2", "use_bias", true),
        ("qwen2", "attention_bias", false),
        ("mistral", "attention_bias", false),
        ("gemma2", "sliding_window_pattern", false),
        ("phi3", "sliding_window", false),
    ] {
        let extra = format!(r#", "num_key_value_heads": 4, "{key}": null"#);
        match one_layer(model_type, &extra) {
            Err(Error::HfConfig { key: got, problem }) if refused => {
                assert_eq!(got, key, "{model_type}");
                assert!(problem.contains("null"), "{problem}");
            }
            Ok(_) if !refused => {}
            other => panic!("{model_type} with {key} null: {other:?}"),
        }
    }
}

/// A width the heads do not divide, where the class's validate_architecture refuses it
/// whatever head_dim says; Mistral's class has no such check.
fn widths_the_heads_do_not_divide() {
    for (model_type, refused) in [
        ("llama", true),
        ("gemma2", true),
        ("gpt_neox", true),
        ("deepseek_v2", true),
        ("mistral", false),
    ] {
        let text = format!(
            r#"{{"model_type": "{model_type}", "hidden_size": 30, "num_attention_heads": 4,
            "num_key_value_heads": 4, "head_dim": 8, "num_hidden_layers": 1,
            "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4, "kv_lora_rank": 8}}"#
        );
        match HfAttentionConfig::from_json(&text) {
            Err(Error::HfConfig { key, .. }) if refused => {
                assert_eq!(key, "num_attention_heads", "{model_type}")
            }
            Ok(_) if !refused => {}
            other => panic!("{model_type}: {other:?}"),
        }
    }
}

/// OLMo 2's HF code has no clip_qkv (its class drops OLMo's): the key changes nothing.
fn olmo2_ignores_clip_qkv() -> anyhow::Result<()> {
    let olmo2 = |extra: &str| {
        HfAttentionConfig::from_json(&format!(
            r#"{{"model_type": "olmo2", "hidden_size": 32, "num_attention_heads": 4,
            "num_hidden_layers": 1{extra}}}"#
        ))
    };
    assert_eq!(olmo2(r#", "clip_qkv": 0.5"#)?, olmo2("")?);
    Ok(())
}

/// Phi-3's configuration takes LongRoPE or no scaling.
fn phi3_takes_longrope_or_no_scaling() {
    let phi3 = |kind: &str| {
        RopeConfig::from_hf_json(&format!(
            r#"{{"model_type": "phi3", "hidden_size": 32, "num_attention_heads": 4,
            "rope_parameters": {{"rope_type": "{kind}", "factor": 2.0}}}}"#
        ))
    };
    assert!(matches!(
        phi3("linear"),
        Err(Error::HfConfig { key, .. }) if key == "rope_parameters.rope_type"
    ));
    assert!(phi3("default").is_ok());
}

/// GPT-NeoX refuses a null rotary_pct, unless rope_parameters give the factor.
fn a_null_rotary_pct_is_refused_unless_the_parameters_give_it() -> anyhow::Result<()> {
    let neox = |extra: &str| {
        RopeConfig::from_hf_json(&format!(
            r#"{{"model_type": "gpt_neox", "hidden_size": 64, "num_attention_heads": 4{extra}}}"#
        ))
    };
    assert!(matches!(
        neox(r#", "rotary_pct": null"#),
        Err(Error::HfConfig { key, .. }) if key == "rotary_pct"
    ));
    let nested = r#", "rotary_pct": null, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}"#;
    assert_eq!(neox(nested)?.rotary_dim, 8);
    Ok(())
}

/// Null head counts and widths as each class fills them (its default, or the width over
/// the heads), or refuses them under their key.
fn null_heads_and_widths_as_the_classes_fill_them() -> anyhow::Result<()> {
    for model_type in [
        "llama", "qwen2", "qwen3", "olmo2", "cohere2", "phi3", "smollm3",
    ] {
        let a = one_layer(
            model_type,
            r#", "num_key_value_heads": null, "head_dim": 8"#,
        )?
        .attention;
        assert_eq!(a.num_kv_heads, 4, "{model_type}");
    }
    let dsv3 = one_layer(
        "deepseek_v3",
        r#", "num_key_value_heads": null, "q_lora_rank": 8, "kv_lora_rank": 8"#,
    )?;
    assert_eq!(dsv3.attention.num_kv_heads, 4);
    for model_type in ["llama", "mistral", "starcoder2"] {
        let a = one_layer(
            model_type,
            r#", "head_dim": null, "num_key_value_heads": 2"#,
        )?
        .attention;
        assert_eq!(a.head_dim, 8, "{model_type}");
    }
    for (model_type, extra, key) in [
        (
            "mistral",
            r#", "num_key_value_heads": null"#,
            "num_key_value_heads",
        ),
        (
            "gemma",
            r#", "num_key_value_heads": null"#,
            "num_key_value_heads",
        ),
        (
            "starcoder2",
            r#", "num_key_value_heads": null"#,
            "num_key_value_heads",
        ),
        ("qwen3", r#", "head_dim": null"#, "head_dim"),
        ("qwen2", r#", "head_dim": null"#, "head_dim"),
        ("falcon", r#", "head_dim": 8"#, "head_dim"),
    ] {
        let err = one_layer(model_type, extra).unwrap_err();
        assert!(
            matches!(&err, Error::HfConfig { key: k, .. } if k == key),
            "{model_type} {extra}: {err}"
        );
    }
    Ok(())
}

/// RoPE settings as each HF config class fills them in when the file leaves them out or
/// gives them elsewhere.
fn rope_as_each_class_fills_it(_dev: &Device) -> anyhow::Result<()> {
    pixtral_types_are_axial_or_refused()?;
    neox_theta_precedence()?;
    gptj_ignores_the_files_rope()?;
    llama4_attention_factor_moves_into_the_norm()?;
    layer_types_fill_their_own_rope()?;
    sliding_layers_need_a_window()?;
    qwen2_vl_head_dim_must_split_hidden_size()?;
    always_sliding_models_refuse_a_null_window()?;
    null_pattern_refused_only_where_read()
}

/// Pixtral: a missing or "default" type is axial; any other type is refused.
fn pixtral_types_are_axial_or_refused() -> anyhow::Result<()> {
    use candle_posenc::rotary::mrope::AxialRope;
    let pixtral = |rope: &str| {
        RopeConfig::from_hf_json(&format!(
            r#"{{"model_type": "pixtral", "hidden_size": 32, "num_attention_heads": 4{rope}}}"#
        ))
    };
    for rope in [
        "",
        r#", "rope_parameters": {"rope_type": "default", "rope_theta": 100.0}"#,
        r#", "rope_scaling": {"type": "default"}"#,
    ] {
        assert_eq!(pixtral(rope)?.axial, Some(AxialRope::EvenOdd), "{rope}");
    }
    for (rope, key) in [
        (
            r#", "rope_parameters": {"rope_type": "linear", "factor": 2.0}"#,
            "rope_parameters.rope_type",
        ),
        (
            r#", "rope_scaling": {"type": "mrope"}"#,
            "rope_scaling.type",
        ),
    ] {
        let err = pixtral(rope).unwrap_err();
        assert!(
            matches!(&err, Error::HfConfig { key: k, .. } if k == key),
            "{rope}: {err}"
        );
    }
    Ok(())
}

/// GPT-NeoX: the parameters' θ, else rotary_emb_base, else 10000; never a top-level
/// rope_theta; a null rotary_emb_base (with no θ in the parameters) is refused.
fn neox_theta_precedence() -> anyhow::Result<()> {
    let neox = |extra: &str| {
        RopeConfig::from_hf_json(&format!(
            r#"{{"model_type": "gpt_neox", "hidden_size": 32, "num_attention_heads": 4{extra}}}"#
        ))
    };
    for (extra, base) in [
        (
            r#", "rotary_emb_base": 300.0, "rope_parameters": {"rope_theta": 50.0}"#,
            50.0,
        ),
        (r#", "rotary_emb_base": 300.0, "rope_theta": 100.0"#, 300.0),
        (r#", "rope_theta": 100.0"#, 10000.0),
        (
            r#", "rotary_emb_base": null, "rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 70.0}"#,
            70.0,
        ),
    ] {
        assert_eq!(neox(extra)?.base, base, "{extra}");
    }
    let err = neox(r#", "rotary_emb_base": null, "rope_theta": 100.0"#).unwrap_err();
    assert!(
        matches!(&err, Error::HfConfig { key, .. } if key == "rotary_emb_base"),
        "{err}"
    );
    Ok(())
}

/// GPT-J: θ 10000 and no scaling, whatever the file says.
fn gptj_ignores_the_files_rope() -> anyhow::Result<()> {
    for extra in [
        r#""rope_theta": 100.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0}"#,
        r#""rope_theta": null, "rope_parameters": {"rope_type": "yarn", "rope_theta": 5.0}"#,
    ] {
        let gptj = RopeConfig::from_hf_json(&format!(
            r#"{{"model_type": "gptj", "n_embd": 32, "n_head": 4, "rotary_dim": 4, {extra}}}"#
        ))?;
        assert_eq!(gptj.base, 10000.0, "{extra}");
        assert_eq!(gptj.scaling, candle_posenc::RopeScaling::None, "{extra}");
    }
    Ok(())
}

/// Llama 4 with q/k norms: the rotation's attention factor s is taken out and the norm's
/// ε divided by s² (the norm after a scaled rotation, as HF applies it).
fn llama4_attention_factor_moves_into_the_norm() -> anyhow::Result<()> {
    let llama4 = HfAttentionConfig::from_json(
        r#"{"model_type": "llama4_text", "hidden_size": 16, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 8, "num_hidden_layers": 1, "rms_norm_eps": 0.1,
        "max_position_embeddings": 64, "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 16, "attention_factor": 2.0}}"#,
    )?;
    let eps = llama4.attention.qk_norm.map(|n| n.eps);
    assert!((eps.unwrap_or(0.0) - 0.025).abs() < 1e-15, "{eps:?}");
    match &llama4.encoding {
        EncodingConfig::Rotary(r) => assert!(matches!(
            &r.scaling,
            candle_posenc::RopeScaling::Yarn(y) if y.attention_factor == Some(1.0)
        )),
        other => panic!("{other:?}"),
    }
    Ok(())
}

/// The rotation of layer `layer` of a small Gemma 3 or ModernBERT file (Gemma 3: layer 0
/// slides, layer 1 is full; ModernBERT: layer 0 global, layer 1 local).
fn typed_rope(model_type: &str, layer: usize, extra: &str) -> anyhow::Result<RopeConfig> {
    let c = HfAttentionConfig::from_json_layer(
        &format!(
            r#"{{"model_type": "{model_type}", "hidden_size": 16, "num_attention_heads": 2,
            "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 2,
            "sliding_window": 3, "sliding_window_pattern": 2,
            "global_attn_every_n_layers": 2{extra}}}"#
        ),
        layer,
    )?;
    match c.encoding {
        EncodingConfig::Rotary(r) => Ok(r),
        other => panic!("{other:?}"),
    }
}

/// Gemma 3 and ModernBERT fill each layer type's entry: θ per type, a missing entry is the
/// default RoPE, flat keys beside the entries are not read, rope_scaling is merged.
fn layer_types_fill_their_own_rope() -> anyhow::Result<()> {
    let gemma3 = r#", "rope_theta": 100.0, "rope_local_base_freq": 70.0,
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 9.0,
            "full_attention": {"rope_type": "default"}}"#;
    assert_eq!(typed_rope("gemma3_text", 0, gemma3)?.base, 70.0);
    let full = typed_rope("gemma3_text", 1, gemma3)?;
    assert_eq!(
        (full.base, &full.scaling),
        (100.0, &candle_posenc::RopeScaling::None)
    );
    let scaled = r#", "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 3.0},
            "sliding_attention": {"rope_type": "default"}}"#;
    let full = typed_rope("gemma3_text", 1, scaled)?;
    assert_eq!(full.base, 3.0);
    assert_eq!(
        full.scaling,
        candle_posenc::RopeScaling::Linear { factor: 4.0 }
    );
    let slide = typed_rope("gemma3_text", 0, scaled)?;
    assert_eq!(
        (slide.base, &slide.scaling),
        (10000.0, &candle_posenc::RopeScaling::None)
    );
    let local = typed_rope("modernbert", 1, scaled)?;
    assert_eq!(local.base, 10000.0);
    assert_eq!(
        local.scaling,
        candle_posenc::RopeScaling::Linear { factor: 4.0 }
    );
    assert_eq!(
        typed_rope(
            "modernbert",
            0,
            r#", "rope_theta": 5.0, "global_rope_theta": 40.0"#
        )?
        .base,
        40.0
    );
    for (model_type, extra, key) in [
        (
            "modernbert",
            r#", "rope_scaling": {"rope_type": "linear", "factor": 4.0},
            "rope_parameters": {"full_attention": {"rope_type": "default"}}"#,
            "rope_parameters",
        ),
        (
            "gemma3_text",
            r#", "rope_local_base_freq": null"#,
            "rope_local_base_freq",
        ),
        (
            "modernbert",
            r#", "global_rope_theta": null"#,
            "global_rope_theta",
        ),
    ] {
        let err = typed_rope(model_type, 0, extra).unwrap_err().to_string();
        assert!(err.contains(key), "{model_type} {extra}: {err}");
    }
    Ok(())
}

/// A `layer_types` entry that makes layer 0 of 2 slide and layer 1 full.
const SLIDING_THEN_FULL: &str = r#", "layer_types": ["sliding_attention", "full_attention"]"#;

/// The sliding window that layer 0 of a small two-layer file of `model_type` reads.
fn windowed(model_type: &str, extra: &str) -> candle_posenc::Result<Option<usize>> {
    HfAttentionConfig::from_json_layer(
        &format!(
            r#"{{"model_type": "{model_type}", "hidden_size": 16, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 8, "num_hidden_layers": 2{extra}}}"#
        ),
        0,
    )
    .map(|c| c.attention.sliding_window)
}

/// Sliding layers: SmolLM3 masks a listed one with sliding_window whatever
/// use_sliding_window says (its default pattern needs the switch); Qwen2/3 null the window
/// without the switch, and a listed sliding layer without a window is refused, as HF's mask
/// fails on it.
fn sliding_layers_need_a_window() -> anyhow::Result<()> {
    let listed = SLIDING_THEN_FULL;
    for (model_type, extra, want) in [
        (
            "smollm3",
            r#", "use_sliding_window": false, "sliding_window": 3"#,
            Some(3),
        ),
        ("smollm3", r#", "sliding_window": 3"#, Some(3)),
        (
            "qwen2",
            r#", "use_sliding_window": true, "sliding_window": 3"#,
            Some(3),
        ),
        (
            "qwen3",
            r#", "use_sliding_window": true, "sliding_window": 3"#,
            Some(3),
        ),
    ] {
        assert_eq!(
            windowed(model_type, &format!("{extra}{listed}"))?,
            want,
            "{model_type} {extra}"
        );
    }
    // SmolLM3's default pattern (layer 3 of 4 is NoPE) slides only under the switch.
    for (switch, want) in [("false", None), ("true", Some(3))] {
        let text = format!(
            r#"{{"model_type": "smollm3", "hidden_size": 16, "num_attention_heads": 2,
            "num_key_value_heads": 1, "num_hidden_layers": 4, "sliding_window": 3,
            "use_sliding_window": {switch}}}"#
        );
        let got = HfAttentionConfig::from_json_layer(&text, 3)?
            .attention
            .sliding_window;
        assert_eq!(got, want, "{switch}");
    }
    for (model_type, extra) in [
        ("smollm3", r#", "use_sliding_window": false"#),
        (
            "smollm3",
            r#", "use_sliding_window": true, "sliding_window": null"#,
        ),
        (
            "qwen2",
            r#", "use_sliding_window": false, "sliding_window": 3"#,
        ),
        ("qwen3", r#", "sliding_window": 3"#),
    ] {
        let err = windowed(model_type, &format!("{extra}{listed}")).unwrap_err();
        assert!(
            matches!(&err, Error::HfConfig { key, .. } if key == "layer_types"),
            "{model_type} {extra}: {err}"
        );
    }
    // HF builds the sliding mask for the whole model as soon as one layer slides, so the full
    // layer of such a file is refused too.
    for model_type in ["qwen3", "smollm3"] {
        let text = format!(
            r#"{{"model_type": "{model_type}", "hidden_size": 16, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 8, "num_hidden_layers": 2,
            "sliding_window": null{listed}}}"#
        );
        let err = HfAttentionConfig::from_json_layer(&text, 1).unwrap_err();
        assert!(
            matches!(&err, Error::HfConfig { key, .. } if key == "layer_types"),
            "{model_type}: {err}"
        );
    }
    // (Qwen2's default pattern needs a window: every layer is full without one.)
    let qwen2 = r#", "use_sliding_window": true, "sliding_window": null, "max_window_layers": 0"#;
    assert_eq!(windowed("qwen2", qwen2)?, None);
    Ok(())
}

/// Qwen2-VL's attention splits hidden_size evenly and its rotation reads head_dim: a file
/// where they differ fails in HF and is refused here, one where they agree reads.
fn qwen2_vl_head_dim_must_split_hidden_size() -> anyhow::Result<()> {
    for (head_dim, ok) in [(8, true), (12, false)] {
        let text = format!(
            r#"{{"model_type": "qwen2_vl", "text_config": {{"hidden_size": 32,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": {head_dim},
            "num_hidden_layers": 1, "rope_parameters": {{"rope_type": "default",
            "mrope_section": [1, 1, 2]}}}}}}"#
        );
        match HfAttentionConfig::from_json(&text) {
            Ok(c) if ok => assert_eq!(c.attention.head_dim, 8),
            Err(Error::HfConfig { key, .. }) if !ok => assert_eq!(key, "head_dim"),
            other => panic!("head_dim {head_dim}: {other:?}"),
        }
    }
    Ok(())
}

/// Gemma 2's and 3's, gpt-oss's and Cohere2's models build a sliding-window mask whatever
/// their layers are, which fails without a window: a null one is refused on every layer,
/// listed or by the default pattern, all full (a pattern of 1) included.
fn always_sliding_models_refuse_a_null_window() -> anyhow::Result<()> {
    for model_type in ["gemma2", "gemma3_text", "gpt_oss", "cohere2"] {
        for (extra, layer) in [
            (SLIDING_THEN_FULL, 0),
            (SLIDING_THEN_FULL, 1),
            ("", 0),
            (r#", "sliding_window_pattern": 1"#, 1),
            (
                r#", "layer_types": ["full_attention", "full_attention"]"#,
                1,
            ),
        ] {
            let text = format!(
                r#"{{"model_type": "{model_type}", "hidden_size": 16, "num_attention_heads": 2,
                "num_key_value_heads": 1, "head_dim": 8, "num_hidden_layers": 2,
                "sliding_window": null{extra}}}"#
            );
            let err = HfAttentionConfig::from_json_layer(&text, layer).unwrap_err();
            assert!(
                matches!(&err, Error::HfConfig { key, .. } if key == "sliding_window"),
                "{model_type} {extra} layer {layer}: {err}"
            );
        }
    }
    Ok(())
}

/// A null pattern is refused only where the class would compute layer types from it.
fn null_pattern_refused_only_where_read() -> anyhow::Result<()> {
    let pattern = |extra: &str| {
        HfAttentionConfig::from_json_layer(
            &format!(
                r#"{{"model_type": "gemma3_text", "hidden_size": 16, "num_attention_heads": 2,
                "num_key_value_heads": 1, "head_dim": 8, "num_hidden_layers": 2,
                "sliding_window_pattern": null{extra}}}"#
            ),
            0,
        )
    };
    assert!(matches!(
        pattern(""),
        Err(Error::HfConfig { key, .. }) if key == "sliding_window_pattern"
    ));
    assert!(pattern(SLIDING_THEN_FULL).is_ok());
    Ok(())
}

/// Every layer fixture in the file (a tag with HF's output) is a case of the tests above.
fn every_fixture_is_a_case(dev: &Device) -> anyhow::Result<()> {
    let ckpt = fixtures(dev)?;
    let mut tags: Vec<&str> = ckpt
        .tensors()
        .keys()
        .filter_map(|k| k.strip_suffix(".out"))
        .collect();
    let mut cases = FAMILIES.to_vec();
    tags.sort_unstable();
    cases.sort_unstable();
    assert_eq!(tags, cases);
    Ok(())
}

/// Ministral (transformers 5.24's `MinistralConfig` and model): the layers `layer_types` lists,
/// else every layer sliding; `head_dim` required and a null window refused, where HF fails;
/// no biases whatever `attention_bias` says; Mistral's reading differs.
fn ministral_as_its_class_reads_it(dev: &Device) -> anyhow::Result<()> {
    let ckpt = fixtures(dev)?;
    let meta = ckpt.metadata();
    let read = |tag: &str, layer| HfAttentionConfig::from_json_layer(&meta[tag], layer);
    let (l0, l1) = (read("ministral.0", 0)?, read("ministral.0", 1)?);
    assert_eq!(l0.family, HfFamily::Llama);
    let windows = (l0.attention.sliding_window, l1.attention.sliding_window);
    assert_eq!(windows, (Some(3), None), "layer_types: sliding, full");
    assert_eq!((l0.attention.head_dim, l0.attention.num_kv_heads), (16, 2));
    let err = HfAttentionConfig::from_json(&meta["ministral.0"]).unwrap_err();
    assert!(
        matches!(&err, Error::HfConfig { key, .. } if key == "layer_types"),
        "{err}"
    );
    // Without layer_types every layer slides; alike, so one reading serves them all.
    let unlisted = HfAttentionConfig::from_json(&meta["ministral_unlisted.1"])?;
    assert_eq!(unlisted.attention.sliding_window, Some(3));
    assert_eq!(
        read("min.ministral", 0)?.attention.sliding_window,
        Some(4096)
    );
    // Each window matters: without it the layer is far from HF's.
    for tag in ["ministral.0", "ministral_unlisted.1"] {
        let index: usize = meta[&format!("{tag}.layer")].parse()?;
        let config = read(tag, index)?;
        assert!(distance_from_hf(&ckpt, tag, &config)? < 1e-5, "{tag}");
        let mut full = config.clone();
        full.attention = full.attention.with_sliding_window(None);
        assert!(
            distance_from_hf(&ckpt, tag, &full)? > 1e-2,
            "{tag} without its window"
        );
    }
    // Mistral's model reads no layer_types: the same file as Mistral slides on every layer.
    let as_mistral = meta["ministral.0"].replace("\"ministral\"", "\"mistral\"");
    let mistral = HfAttentionConfig::from_json_layer(&as_mistral, 1)?;
    assert_eq!(mistral.attention.sliding_window, Some(3));
    // Where HF fails: no head_dim (the class leaves it null and the attention takes it), a
    // null one, a null window (the model builds the sliding mask for every layer), null
    // key/value heads (a plain int field).
    let file = |extra: &str| {
        HfAttentionConfig::from_json(&format!(
            r#"{{"model_type": "ministral", "hidden_size": 32, "num_attention_heads": 4,
            "num_hidden_layers": 1{extra}}}"#
        ))
    };
    for (extra, key) in [
        (r#", "num_key_value_heads": 2"#, "head_dim"),
        (
            r#", "num_key_value_heads": 2, "head_dim": null"#,
            "head_dim",
        ),
        (
            r#", "num_key_value_heads": 2, "head_dim": 8, "sliding_window": null"#,
            "sliding_window",
        ),
        (
            r#", "num_key_value_heads": 2, "head_dim": 8, "sliding_window": null,
            "layer_types": ["full_attention"]"#,
            "sliding_window",
        ),
        (
            r#", "num_key_value_heads": null, "head_dim": 8"#,
            "num_key_value_heads",
        ),
    ] {
        let err = file(extra).unwrap_err();
        assert!(
            matches!(&err, Error::HfConfig { key: k, .. } if k == key),
            "{extra}: {err}"
        );
    }
    // No biases whatever attention_bias says; a width the heads do not divide is read (the
    // class has no such check); 8 key/value heads by default.
    let a = file(r#", "num_key_value_heads": 2, "head_dim": 8, "attention_bias": true"#)?;
    assert!(!a.attention.bias && !a.attention.out_bias);
    let uneven = HfAttentionConfig::from_json(
        r#"{"model_type": "ministral", "hidden_size": 30, "num_attention_heads": 4,
        "num_key_value_heads": 4, "head_dim": 8, "num_hidden_layers": 1}"#,
    )?;
    assert_eq!(uneven.attention.head_dim, 8);
    let eight = HfAttentionConfig::from_json(
        r#"{"model_type": "ministral", "hidden_size": 64, "num_attention_heads": 16,
        "head_dim": 4, "num_hidden_layers": 1}"#,
    )?;
    assert_eq!(eight.attention.num_kv_heads, 8);
    Ok(())
}

/// StarCoder2 (transformers 5.24's `Starcoder2Config` and attention): biases on all four
/// projections as `use_bias` says (true by default, a null refused); one window for every
/// layer, `layer_types` unread; 2 key/value heads by default.
fn starcoder2_as_its_class_reads_it(dev: &Device) -> anyhow::Result<()> {
    let ckpt = fixtures(dev)?;
    let meta = ckpt.metadata();
    let config = HfAttentionConfig::from_json(&meta["starcoder2"])?;
    let a = &config.attention;
    assert_eq!(config.family, HfFamily::Llama);
    assert!(a.bias && a.out_bias && a.sliding_window == Some(3));
    // The window matters: without it the layer is far from HF's.
    assert!(distance_from_hf(&ckpt, "starcoder2", &config)? < 1e-5);
    let mut full = config.clone();
    full.attention = full.attention.with_sliding_window(None);
    assert!(distance_from_hf(&ckpt, "starcoder2", &full)? > 1e-2);
    let file = |extra: &str| {
        HfAttentionConfig::from_json_layer(
            &format!(
                r#"{{"model_type": "starcoder2", "hidden_size": 32, "num_attention_heads": 4,
                "num_hidden_layers": 2{extra}}}"#
            ),
            1,
        )
    };
    let plain = file("")?.attention;
    assert!(plain.bias && plain.out_bias && plain.sliding_window.is_none());
    assert_eq!(plain.num_kv_heads, 2);
    let unbiased = file(r#", "use_bias": false, "attention_bias": true"#)?.attention;
    assert!(!unbiased.bias && !unbiased.out_bias);
    let listed = r#", "sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"]"#;
    assert_eq!(file(listed)?.attention.sliding_window, Some(5));
    Ok(())
}

device_tests!(
    every_fixture_is_a_case,
    rope_as_each_class_fills_it,
    partial_rotary_as_each_model_reads_it,
    gemma3_has_no_soft_cap,
    mpt_alibi_as_hf_builds_it,
    layer_indices_past_the_model,
    fields_changed_after_parsing_are_checked,
    configs_read_as_hf_does,
    t5_later_layers_share_the_first_table,
    errors_name_the_hf_tensor,
    config_errors_name_the_key,
    qk_norm_config_and_formula,
    extras_agree_on_every_path_with_padding_and_blocks,
    per_layer_settings,
    gemma4_as_its_class_fills_it,
    nulls_as_each_class_reads_them,
    ministral_as_its_class_reads_it,
    starcoder2_as_its_class_reads_it,
);
