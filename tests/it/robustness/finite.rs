//! Classes 3 and 4 of the third reliability wave. Finite input gives finite output in every
//! dtype a block accepts: each factor that multiplies activations is checked against the
//! dtype's range when the block is built (a rotary attention factor where it first rotates),
//! and a cast to a narrower format (a checkpoint read as f16, a bias added to f16 logits) is
//! refused where a finite value would become ±∞. And one rule for every consumer: every
//! constructor that takes a `VarBuilder` refuses a non-float one, and every caller of the
//! input hook checks its answer the same way.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_nn::{Init, VarBuilder, VarMap};
use candle_posenc::absolute::embeddings::{Embeddings, EmbeddingsConfig};
use candle_posenc::{
    Alibi, AlibiConfig, AttentionConfig, AttentionContext, AttentionOptions, AttentionTemperature,
    Checkpoint, ClippedBiasConfig, ClippedRelativeBias, Columns, EncodingConfig, Error,
    HfAttentionConfig, LatentConfig, LearnedConfig, LearnedPositionalEncoding, LogitsBias,
    MultiHeadAttention, PositionIds, PositionalEncoding, Positions, QkNormConfig, RelativeBias,
    RopeConfig, RopeMixed, RopeMixedConfig, RopeScaling, ScaledSinusoidalConfig,
    ScaledSinusoidalPositionalEncoding, ShawConfig, ShawRelativePosition, T5Config, T5RelativeBias,
    YarnScaling,
};
use common::zoo;

/// The four float dtypes the crate computes in.
const DTYPES: [DType; 4] = [DType::F32, DType::F64, DType::BF16, DType::F16];

/// Whether every entry of `t` is finite.
fn all_finite(t: &Tensor) -> anyhow::Result<bool> {
    Ok(t.to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()?
        .iter()
        .all(|x| x.is_finite()))
}

/// `t` as f64 values.
fn values(t: &Tensor) -> anyhow::Result<Vec<f64>> {
    Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?)
}

/// Asserts that `result` is [`Error::InvalidConfig`] naming `name`, whose message holds every
/// one of `says`.
fn refused<T: std::fmt::Debug>(
    what: &str,
    result: candle_posenc::Result<T>,
    name: &str,
    says: &[&str],
) {
    match result {
        Err(err @ Error::InvalidConfig { name: got, .. }) if got == name => {
            let text = err.to_string();
            for s in says {
                assert!(text.contains(s), "{what}: `{s}` not in `{text}`");
            }
        }
        other => panic!("{what}: expected InvalidConfig naming {name}, got {other:?}"),
    }
}

/// Runs `mha` over `x` on every path a call can take (inference, returned weights, training,
/// decoding token by token through a cache) and returns the outputs and weights.
fn every_path(mha: &MultiHeadAttention, x: &Tensor) -> candle_posenc::Result<Vec<Tensor>> {
    let mut outs = Vec::new();
    for (train, return_weights) in [(false, false), (false, true), (true, false)] {
        let opts = AttentionOptions {
            train,
            return_weights,
            dropout_seed: Some(7),
            ..Default::default()
        };
        let out = mha.forward_with(x, &opts, None)?;
        outs.push(out.output);
        outs.extend(out.weights);
    }
    let mut cache = candle_posenc::KvCache::new();
    for t in 0..x.dim(1)? {
        let step = mha.forward_with(
            &x.narrow(1, t, 1)?,
            &AttentionOptions::default(),
            Some(&mut cache),
        )?;
        outs.push(step.output);
    }
    Ok(outs)
}

/// Every factor that multiplies a block's activations, against each dtype's range: refused when
/// the block is built where the dtype cannot hold it (naming the setting, with the dtype's
/// largest finite value), otherwise finite output for finite input on every path. Before, an
/// f16 block took a temperature (Llama 4's `attn_scale`) valid in f32 and turned its queries
/// to ∞, and a bf16 block a scale or cap past bf16's range.
fn factors_fit_the_dtype_or_are_refused(dev: &Device) -> anyhow::Result<()> {
    let base = AttentionConfig::new(64, 4).with_causal(true); // head_dim 16, scale 1/4
    let temperature = |s: f64, f: usize| {
        base.clone()
            .with_attention_temperature(Some(AttentionTemperature::new(s, f)))
    };
    // (label, config, the setting refused per dtype and a part of its message, whether finite
    // output is claimed when built: a scale of 3.4e38 is a valid f32 factor, but no moderate
    // logit survives it). A factor past the dtype's range is refused with the dtype's largest
    // finite value; in f16, scale × temperature × head_dim past the reach of its logits, 2^8.
    type Refused = fn(DType) -> Option<(&'static str, &'static str)>;
    let nowhere: Refused = |_| None;
    let temperature_reach: Refused =
        |d| (d == DType::F16).then_some(("attention_temperature.attn_scale", "2^8"));
    let temperature_range: Refused =
        |d| (d == DType::F16).then_some(("attention_temperature.attn_scale", "65504"));
    let cases: Vec<(&str, AttentionConfig, Refused, bool)> = vec![
        (
            "Llama 4's temperature (0.1, 8192)",
            temperature(0.1, 8192),
            nowhere,
            true,
        ),
        // Largest factor 1 + 1.4·ln(1 + 2^64) = 63.1: scale × factor × head_dim = 252 ≤ 2^8.
        (
            "temperature at f16's logit reach",
            temperature(1.4, 1),
            nowhere,
            true,
        ),
        // 1 + 2·44.4 = 89.7: 359 past the reach of f16's logits.
        (
            "temperature past f16's logit reach",
            temperature(2.0, 1),
            temperature_reach,
            true,
        ),
        // 1 + 1e5·44.4 = 4.4e6, past 65504 itself: the probe's case (f16 queries became ∞).
        (
            "temperature past f16's range",
            temperature(1e5, 1),
            temperature_range,
            true,
        ),
        (
            "softmax_scale 1e5",
            base.clone().with_softmax_scale(1e5),
            |d| (d == DType::F16).then_some(("softmax_scale", "65504")),
            true,
        ),
        (
            "softmax_scale 3.4e38 (past bf16's largest, 3.39e38)",
            base.clone().with_softmax_scale(3.4e38),
            |d| half_limit(d).map(|l| ("softmax_scale", l)),
            false,
        ),
        (
            "soft cap 30",
            base.clone().with_logit_softcap(Some(30.0)),
            nowhere,
            true,
        ),
        (
            "soft cap 6e4",
            base.clone().with_logit_softcap(Some(6e4)),
            nowhere,
            true,
        ),
        // Capped in f32 on every path, and a capped logit is never larger than the logit:
        // any cap f32 holds keeps finite logits finite, past a half format's range too.
        (
            "soft cap 1e5",
            base.clone().with_logit_softcap(Some(1e5)),
            nowhere,
            true,
        ),
        (
            "soft cap 3.4e38",
            base.clone().with_logit_softcap(Some(3.4e38)),
            nowhere,
            true,
        ),
    ];
    for (label, config, refusal, finite) in cases {
        config.validate()?; // every case is a valid f32 configuration
        for dtype in DTYPES {
            let what = format!("{label}, {dtype:?}");
            let varmap = VarMap::new();
            let vb = common::seeded_vb(&varmap, dtype, dev);
            let built = MultiHeadAttention::new(&config, None, vb);
            match refusal(dtype) {
                Some((name, says)) => {
                    refused(&what, built, name, &[says, dtype.as_str()]);
                    assert!(varmap.all_vars().is_empty(), "{what}: nothing is created");
                }
                None => {
                    // The VarMap's block tracks its weights (candle's ops); a copy with plain
                    // weights takes the inference paths.
                    let tracked = built.map_err(|e| anyhow::anyhow!("{what}: {e}"))?;
                    if !finite {
                        continue;
                    }
                    let (plain, _) = zoo::attention(&EncodingConfig::None, &config, dtype, dev)?;
                    let x = common::randn(0f32, 1.0, (2, 5, 64), dev)?.to_dtype(dtype)?;
                    for mha in [&tracked, &plain] {
                        for (i, out) in every_path(mha, &x)?.iter().enumerate() {
                            assert!(all_finite(out)?, "{what}: output {i} is not finite");
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// The largest finite value of a half format as the messages print it (`None` for the wider).
fn half_limit(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::F16 => Some("65504"),
        DType::BF16 => Some("3.3895313892515355e38"),
        _ => None,
    }
}

/// The probe's case end to end: Llama 4's NoPE layer read from its `config.json` with a
/// temperature valid in f32 (`attn_scale` 1e5), loaded in f16, is refused; in f32 it loads.
fn llama4_temperature_in_f16(dev: &Device) -> anyhow::Result<()> {
    let path = format!(
        "{}/tests/fixtures/hf_layers.safetensors",
        env!("CARGO_MANIFEST_DIR")
    );
    let ckpt = Checkpoint::load(path, dev)?;
    let meta = ckpt.metadata();
    let mut json: serde_json::Value = serde_json::from_str(&meta["llama4.0"])?;
    json["attn_scale"] = serde_json::json!(1e5);
    let mut tried = 0;
    for tag in ["llama4.0", "llama4.1"] {
        let index: usize = meta[&format!("{tag}.layer")].parse()?;
        let config = HfAttentionConfig::from_json_layer(&json.to_string(), index)?;
        if config.attention.attention_temperature.is_none() {
            continue;
        }
        tried += 1;
        let prefix = format!("{tag}/{}", meta[&format!("{tag}.prefix")]);
        let err = config.load(ckpt.var_builder(DType::F16, dev).pp(&prefix));
        refused(
            tag,
            err,
            "attention_temperature.attn_scale",
            &["65504", "f16"],
        );
        config.load(ckpt.var_builder(DType::F32, dev).pp(&prefix))?;
    }
    assert_eq!(
        tried, 1,
        "one of the fixture's Llama 4 layers is a NoPE layer"
    );
    Ok(())
}

/// A rotary attention factor multiplies queries and keys: in f16 it is refused where it first
/// rotates past 2^8 (naming it), and in every other dtype, and below that in f16, the block's
/// outputs stay finite.
fn rotary_attention_factor_in_every_dtype(dev: &Device) -> anyhow::Result<()> {
    let attn = AttentionConfig::new(64, 4).with_causal(true);
    for a in [0.5, 2f64.powi(7), 2f64.powi(9), 2f64.powi(20)] {
        let scaling = RopeScaling::Yarn(YarnScaling::new(4.0, 64).with_attention_factor(a));
        let config = EncodingConfig::Rotary(RopeConfig::new(16).with_scaling(scaling));
        for dtype in DTYPES {
            let what = format!("attention factor {a}, {dtype:?}");
            let (mha, _) = zoo::attention(&config, &attn, dtype, dev)?;
            let x = (common::randn(0f32, 1.0, (1, 4, 64), dev)? * 1e-3)?.to_dtype(dtype)?;
            let outs = every_path(&mha, &x);
            if dtype == DType::F16 && a > 2f64.powi(8) {
                refused(&what, outs, "rope attention factor", &["f16"]);
                continue;
            }
            for out in outs? {
                assert!(all_finite(&out)?, "{what}");
            }
        }
    }
    Ok(())
}

/// An encoding with a fixed answer to the bias hook, in any dtype.
#[derive(Debug)]
struct FixedBias {
    /// `Some(value)`: one value per distance column (relative rows); `None`: a dense bias
    /// `(1, 1, Tq, Tk)` of `dense`.
    dense: f64,
    rows: bool,
    dtype: DType,
}

impl PositionalEncoding for FixedBias {
    fn logits_bias(
        &self,
        q: &Tensor,
        ctx: &AttentionContext,
    ) -> candle_posenc::Result<Option<LogitsBias>> {
        let (tq, tk) = (ctx.q_len, ctx.k_len);
        Ok(Some(match self.rows {
            true => {
                let width = tq + tk - 1;
                let v = (Tensor::ones((1, 1, 1, width), DType::F64, q.device())? * self.dense)?
                    .to_dtype(self.dtype)?;
                LogitsBias::Relative(RelativeBias::new(v, Columns::Shift(tq as i64 - 1))?)
            }
            false => LogitsBias::Dense(
                (Tensor::ones((1, 1, tq, tk), DType::F64, q.device())? * self.dense)?
                    .to_dtype(self.dtype)?,
            ),
        }))
    }
}

/// Every path adds a bias to the logits in f32 (f64 for an f64 block), so a half block takes
/// values past its own range (1e5 into f16: before, refused there); a finite value past f32's
/// range (from f64) would become ±∞ and is refused (naming the bias, its magnitude and f32's
/// limit), on every path and in both forms. NaN and ±∞ the encoding answers pass as they are.
fn bias_values_past_the_logits_dtype(dev: &Device) -> anyhow::Result<()> {
    let attn = AttentionConfig::new(32, 2).with_causal(true);
    let weights = AttentionOptions {
        return_weights: true,
        ..Default::default()
    };
    for rows in [false, true] {
        let name = match rows {
            true => "relative logits bias from the encoding",
            false => "dense logits bias from the encoding",
        };
        // f32 values past f16's range into an f16 block, f64 ones past f32's into f32, bf16
        // and f16 blocks; and the same values where the block's logits hold them.
        for (value, from, block, fits) in [
            (1e5, DType::F32, DType::F16, false),
            (-1e5, DType::F32, DType::F16, false),
            (1e5, DType::F32, DType::BF16, true),
            (1e300, DType::F64, DType::F32, false),
            (-1e300, DType::F64, DType::BF16, false),
            (1e300, DType::F64, DType::F64, true),
            (6e4, DType::F32, DType::F16, true),
        ] {
            let what = format!("{name} {value:e} in {from:?} to a {block:?} block");
            let enc = FixedBias {
                dense: value,
                rows,
                dtype: from,
            };
            // Plain (zero) weights: inference takes the fused paths.
            let vb = VarBuilder::zeros(block, dev);
            let mha = MultiHeadAttention::new(&attn, Some(Arc::new(enc)), vb)?;
            let x = common::randn(0f32, 1.0, (1, 4, 32), dev)?.to_dtype(block)?;
            for opts in [AttentionOptions::default(), weights.clone()] {
                let what = format!("{what}, weights returned {}", opts.return_weights);
                let out = mha.forward_with(&x, &opts, None);
                // The terms are added in f32, in f64 for an f64 block, on every path.
                let logits = match block {
                    DType::F64 => DType::F64,
                    _ => DType::F32,
                };
                let holds = fits || value.abs() <= largest(logits);
                match out {
                    Ok(out) if holds => {
                        assert!(all_finite(&out.output)?, "{what}");
                        // A constant bias leaves the weights as they were: causal row 0
                        // attends to key 0 only, in both heads.
                        if let Some(w) = out.weights {
                            let first = values(&w.narrow(2, 0, 1)?.narrow(3, 0, 1)?)?;
                            assert_eq!(first, vec![1.0, 1.0], "{what}");
                        }
                    }
                    out => {
                        let magnitude = format!("{:e}", value.abs());
                        refused(&what, out, name, &[&magnitude, &limit_of(logits)]);
                    }
                }
            }
        }
    }
    // NaN passes through (the crate never replaces a non-finite value): the outputs that read
    // it are NaN, and no error.
    let enc = FixedBias {
        dense: f64::NAN,
        rows: false,
        dtype: DType::F32,
    };
    let vb = common::seeded_vb(&VarMap::new(), DType::F16, dev);
    let mha = MultiHeadAttention::new(&attn, Some(Arc::new(enc)), vb)?;
    let x = common::randn(0f32, 1.0, (1, 4, 32), dev)?.to_dtype(DType::F16)?;
    let out = mha.forward_with(&x, &weights, None)?;
    assert!(values(&out.output)?.iter().all(|v| v.is_nan()));
    Ok(())
}

/// The largest finite value of a float `dtype`.
fn largest(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => 65504.0,
        DType::BF16 => 3.389_531_389_251_535_5e38,
        DType::F32 => f32::MAX as f64,
        _ => f64::MAX,
    }
}

/// The largest finite value of `dtype` as the messages print it.
fn limit_of(dtype: DType) -> String {
    match dtype {
        DType::F16 => "65504".into(),
        DType::BF16 => "3.3895313892515355e38".into(),
        DType::F32 => "3.4028234663852886e38".into(),
        _ => "1.7976931348623157e308".into(),
    }
}

/// A causal ALiBi row far from its keys: in the per-key form, query 0 at position 0 of a chunk
/// whose last token sits at 200 000 has the bias −m·200 000 on its one key. f16 logits held it
/// as −∞ and the row's only finite logit was the masked future key (found weight 1: attention
/// to the future). Then refused where the logits were f16; now right in every dtype, since
/// every path adds the terms in f32 (f64).
fn alibi_far_from_its_keys(dev: &Device) -> anyhow::Result<()> {
    let attn = AttentionConfig::new(64, 8).with_causal(true);
    let config = EncodingConfig::Alibi(AlibiConfig::new(8));
    let ids = Positions::Ids(PositionIds::new(&Tensor::new(&[[0u32, 200_000]], dev)?)?);
    let opts = AttentionOptions {
        positions: Some(&ids),
        return_weights: true,
        ..Default::default()
    };
    for dtype in DTYPES {
        let (mha, _) = zoo::attention(&config, &attn, dtype, dev)?;
        let x = common::randn(0f32, 1.0, (1, 2, 64), dev)?.to_dtype(dtype)?;
        let out = mha.forward_with(&x, &opts, None)?;
        assert!(all_finite(&out.output)?, "{dtype:?}");
        let w = out.weights.expect("weights");
        // Query 0 attends to key 0 only, in every head.
        let first = values(&w.narrow(2, 0, 1)?.narrow(3, 0, 1)?)?;
        assert!(first.iter().all(|&v| v == 1.0), "{dtype:?}: {first:?}");
    }
    Ok(())
}

/// Writes `tensors` to a file of their own and reads them back as a checkpoint.
fn checkpoint_of(
    name: &str,
    tensors: HashMap<String, Tensor>,
    dev: &Device,
) -> anyhow::Result<Checkpoint> {
    let dir = std::env::temp_dir().join(format!("candle-posenc-finite-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(format!("{name}.safetensors"));
    candle_posenc::checkpoint::save(&path, &tensors, &HashMap::new())?;
    let ckpt = Checkpoint::load(&path, dev)?;
    std::fs::remove_file(&path).ok();
    Ok(ckpt)
}

/// A checkpoint read into a narrower float format: a finite value past its range is refused,
/// naming the tensor, its largest such magnitude and the format's limit, through every way of
/// reading it (a module's constructor, the builder's own getters, `load_into`). Values the
/// format holds (65519 rounds to f16's 65504), widening, and NaN and ±∞ in the file load as
/// they are.
fn narrowing_a_checkpoint(dev: &Device) -> anyhow::Result<()> {
    let table = |v: &[f64], dtype: DType| -> anyhow::Result<Tensor> {
        let mut all = vec![0.25f64; 8];
        all[..v.len()].copy_from_slice(v);
        Ok(Tensor::from_vec(all, (2, 4), dev)?.to_dtype(dtype)?)
    };
    let cfg = LearnedConfig::new(4).with_max_len(2);
    // (file values and dtype, read as, whether refused)
    let cases: Vec<(Vec<f64>, DType, DType, bool)> = vec![
        (vec![7e4, -1.0], DType::F32, DType::F16, true),
        (vec![-7e4, 9e4], DType::F32, DType::F16, true),
        (vec![65520.0], DType::F32, DType::F16, true), // the tie rounds to even: ∞
        (vec![f32::MAX as f64], DType::F32, DType::BF16, true),
        (vec![1e300], DType::F64, DType::F32, true),
        (vec![-1e300, 0.5], DType::F64, DType::BF16, true),
        (vec![1e38], DType::BF16, DType::F16, true),
        (vec![f64::INFINITY, 7e4], DType::F32, DType::F16, true),
        (vec![7e4], DType::F32, DType::BF16, false),
        (vec![7e4], DType::F32, DType::F64, false),
        (vec![65519.0], DType::F32, DType::F16, false),
        (vec![65504.0], DType::F16, DType::F32, false),
        (vec![1e38], DType::BF16, DType::F32, false),
        (
            vec![f64::INFINITY, f64::NAN, -1.0],
            DType::F32,
            DType::F16,
            false,
        ),
        (
            vec![f64::NEG_INFINITY, 1e300],
            DType::F64,
            DType::F64,
            false,
        ),
    ];
    for (i, (v, from, to, refuse)) in cases.into_iter().enumerate() {
        let what = format!("{v:?} in {from:?} read as {to:?}");
        let t = table(&v, from)?;
        // The largest finite magnitude the file holds, as the message prints it.
        let magnitude = values(&t)?
            .into_iter()
            .filter(|x| x.is_finite())
            .fold(0f64, |m, x| m.max(x.abs()));
        let magnitude = format!("{magnitude:e}");
        let ckpt = checkpoint_of(
            &format!("narrow-{i}"),
            HashMap::from([("wpe.weight".to_string(), t.clone())]),
            dev,
        )?;
        let vb = ckpt.var_builder(to, dev);
        let varmap = VarMap::new();
        let var = varmap.get((2, 4), "wpe.weight", Init::Const(3.0), to, dev)?; // shares the storage
        let reads: Vec<(&str, candle_posenc::Result<Tensor>)> = vec![
            (
                "LearnedPositionalEncoding::new",
                LearnedPositionalEncoding::new(&cfg, vb.pp("wpe")).map(|l| l.weight().clone()),
            ),
            (
                "VarBuilder::get",
                vb.get((2, 4), "wpe.weight").map_err(Error::from),
            ),
            (
                "VarBuilder::get_unchecked",
                vb.get_unchecked("wpe.weight").map_err(Error::from),
            ),
            (
                "Checkpoint::load_into",
                ckpt.load_into(&varmap).map(|()| var.clone()),
            ),
        ];
        for (how, read) in reads {
            let what = format!("{what}, {how}");
            match refuse {
                true => match read {
                    Err(Error::Checkpoint { reason, .. }) => {
                        for s in ["`wpe.weight`", &magnitude, &limit_of(to), to.as_str()] {
                            assert!(reason.contains(s), "{what}: `{s}` not in `{reason}`");
                        }
                    }
                    other => panic!("{what}: {other:?}"),
                },
                false => {
                    let got = values(&read.map_err(|e| anyhow::anyhow!("{what}: {e}"))?)?;
                    let want = values(&t.to_dtype(to)?)?;
                    assert_eq!(got.len(), want.len(), "{what}");
                    for (g, w) in got.iter().zip(&want) {
                        assert!(g == w || (g.is_nan() && w.is_nan()), "{what}: {got:?}");
                    }
                }
            }
        }
        if refuse {
            // load_into changed nothing.
            assert_eq!(values(&var)?, vec![3.0; 8], "{what}");
        }
    }
    // A block's projection read through an f16 builder: the same refusal, naming its tensor.
    let attn = AttentionConfig::new(8, 2);
    let mut tensors = HashMap::new();
    for p in ["q_proj", "k_proj", "v_proj", "o_proj"] {
        let w = Tensor::ones((8, 8), DType::F32, dev)?;
        tensors.insert(
            format!("{p}.weight"),
            if p == "v_proj" { (w * 1e6)? } else { w },
        );
    }
    let ckpt = checkpoint_of("narrow-block", tensors, dev)?;
    match MultiHeadAttention::new(&attn, None, ckpt.var_builder(DType::F16, dev)) {
        Err(Error::Checkpoint { reason, .. }) => {
            assert!(
                reason.contains("`v_proj.weight`") && reason.contains("1e6"),
                "{reason}"
            )
        }
        other => panic!("f16 block from a 1e6 weight: {other:?}"),
    }
    MultiHeadAttention::new(&attn, None, ckpt.var_builder(DType::BF16, dev))?;
    Ok(())
}

/// Every constructor that takes a `VarBuilder`, built through `vb`, as `(name, result)`.
fn every_constructor(vb: &VarBuilder) -> Vec<(String, candle_posenc::Result<()>)> {
    let attn = AttentionConfig::new(16, 4);
    let mut out: Vec<(String, candle_posenc::Result<()>)> = vec![
        (
            "attention".into(),
            MultiHeadAttention::new(&attn, None, vb.pp("a")).map(drop),
        ),
        (
            "attention with norms and sinks".into(),
            MultiHeadAttention::new(
                &attn
                    .clone()
                    .with_qk_norm(Some(QkNormConfig::new()))
                    .with_sinks(true),
                None,
                vb.pp("n"),
            )
            .map(drop),
        ),
        (
            "latent attention".into(),
            MultiHeadAttention::new(
                &attn
                    .clone()
                    .with_latent(Some(LatentConfig::new(Some(3), 5, 2, 3))),
                None,
                vb.pp("m"),
            )
            .map(drop),
        ),
        (
            "embeddings".into(),
            Embeddings::new(&EmbeddingsConfig::new(10, 16), None, vb.pp("wte")).map(drop),
        ),
        (
            "learned".into(),
            LearnedPositionalEncoding::new(&LearnedConfig::new(16), vb.pp("l")).map(drop),
        ),
        (
            "scaled sinusoidal".into(),
            ScaledSinusoidalPositionalEncoding::new(&ScaledSinusoidalConfig::new(16), vb.pp("s"))
                .map(drop),
        ),
        (
            "shaw".into(),
            ShawRelativePosition::new(&ShawConfig::new(4, 3).with_values(true), vb.pp("sh"))
                .map(drop),
        ),
        (
            "t5".into(),
            T5RelativeBias::new(&T5Config::new(4), vb.pp("t5")).map(drop),
        ),
        (
            "clipped".into(),
            ClippedRelativeBias::new(&ClippedBiasConfig::new(4, 3), vb.pp("c")).map(drop),
        ),
        (
            "learnable alibi".into(),
            Alibi::new_learnable(&AlibiConfig::new(4).with_learnable(true), vb.pp("al")).map(drop),
        ),
        (
            "rope-mixed".into(),
            RopeMixed::new(&RopeMixedConfig::new(4, 8), vb.pp("rm")).map(drop),
        ),
    ];
    let mut schemes = zoo::configs(16, 4, 4);
    schemes.push(EncodingConfig::RopeMixed(RopeMixedConfig::new(4, 4)));
    schemes.push(EncodingConfig::Alibi(
        AlibiConfig::new(4).with_learnable(true),
    ));
    for (i, config) in schemes.iter().enumerate() {
        out.push((
            format!("EncodingConfig::build {}", zoo::label(i, config)),
            config.build(vb.pp(format!("e{i}"))).map(drop),
        ));
    }
    let json = r#"{"model_type": "qwen2", "hidden_size": 16, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rope_theta": 10000.0, "max_position_embeddings": 64}"#;
    let hf = HfAttentionConfig::from_json(json).expect("a valid config.json");
    out.push((
        "HfAttentionConfig::load".into(),
        hf.load(vb.pp("hf")).map(drop),
    ));
    out.push((
        "HfAttentionConfig::load_with_encoding".into(),
        hf.load_with_encoding(None, vb.pp("hf2")).map(drop),
    ));
    out
}

/// One dtype rule for every constructor that takes a `VarBuilder`: a builder whose dtype is not
/// f32, f64, bf16 or f16 is refused first, naming it, and nothing is created in its `VarMap`
/// (RoPE-Mixed created integer frequencies, `[1, 0, 0, 0]`, and the encodings without tables
/// took any builder). A float builder over a `VarMap` that already holds a tensor in an
/// integer dtype gets that tensor back: refused too, naming it.
fn one_dtype_rule_for_every_var_builder(dev: &Device) -> anyhow::Result<()> {
    for dtype in [DType::U8, DType::U32, DType::I64, DType::F8E4M3] {
        let varmap = VarMap::new();
        let vb = common::seeded_vb(&varmap, dtype, dev);
        for (name, result) in every_constructor(&vb) {
            match result {
                Err(Error::DType { what, got, .. }) => {
                    assert_eq!(got, dtype, "{name}");
                    assert!(what.contains("VarBuilder"), "{name}: {what}");
                }
                other => panic!("{name} through a {dtype:?} VarBuilder: {other:?}"),
            }
        }
        assert!(
            varmap.all_vars().is_empty(),
            "{dtype:?}: nothing is created"
        );
    }
    // Every float builder builds them all.
    for dtype in DTYPES {
        let varmap = VarMap::new();
        for (name, result) in every_constructor(&common::seeded_vb(&varmap, dtype, dev)) {
            result.map_err(|e| anyhow::anyhow!("{name} in {dtype:?}: {e}"))?;
        }
    }
    // Each tensor of them all, held by a VarMap as integers and reached through an f32
    // builder: refused by the constructor that reads it, naming the tensor (not the builder);
    // every other constructor builds.
    let varmap = VarMap::new();
    for (name, result) in every_constructor(&common::seeded_vb(&varmap, DType::F32, dev)) {
        result.map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
    }
    let shapes: Vec<(String, Vec<usize>)> = zoo::named_tensors(&varmap)?
        .into_iter()
        .map(|(name, t)| (name, t.dims().to_vec()))
        .collect();
    assert!(shapes.len() > 40, "{} tensors", shapes.len());
    for (path, shape) in shapes {
        let varmap = VarMap::new();
        varmap.get(shape.as_slice(), &path, Init::Const(1.0), DType::U32, dev)?;
        let vb = common::seeded_vb(&varmap, DType::F32, dev);
        let mut refusals = 0;
        for (name, result) in every_constructor(&vb) {
            match result {
                Ok(()) => {}
                Err(Error::DType { what, got, .. }) if !what.contains("VarBuilder's dtype") => {
                    assert_eq!(got, DType::U32, "{path} via {name}");
                    refusals += 1;
                }
                Err(other) => panic!("{path} via {name}: {other:?}"),
            }
        }
        assert_eq!(
            refusals, 1,
            "{path}: one constructor reads it and refuses it"
        );
    }
    // RoPE-Mixed's frequencies keep their values in every float dtype (not [1, 0, 0, 0]).
    let cfg = RopeMixedConfig::new(2, 8);
    let want = cfg.initial_freqs();
    for dtype in DTYPES {
        let varmap = VarMap::new();
        let rope = RopeMixed::new(&cfg, common::seeded_vb(&varmap, dtype, dev))?;
        let got = values(rope.freqs())?;
        let tol = match dtype {
            DType::BF16 => 1e-2,
            DType::F16 => 1e-3,
            _ => 1e-7,
        };
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (g - f64::from(*w)).abs() <= tol * w.abs().max(1e-3) as f64,
                "{dtype:?}: {got:?}"
            );
        }
        assert!(got.iter().any(|g| g.fract() != 0.0), "{dtype:?}: {got:?}");
    }
    Ok(())
}

/// An encoding whose input hook answers with what `answer` makes of the input.
#[derive(Debug)]
struct InputAnswer(fn(&Tensor) -> candle_core::Result<Tensor>);

impl PositionalEncoding for InputAnswer {
    fn add_to_input(&self, x: &Tensor, _ctx: &AttentionContext) -> candle_posenc::Result<Tensor> {
        Ok((self.0)(x)?)
    }
}

/// One check of the input hook's answer for both of its consumers (the block and the input
/// layer): an answer with a token more or a feature more, or in another dtype, is the same
/// typed error from each, in every model dtype (`Embeddings` returned it as its output); an
/// answer that fits is what both use.
fn one_check_for_the_input_hook(dev: &Device) -> anyhow::Result<()> {
    let d = 16;
    let answers: [(&str, InputAnswer); 6] = [
        (
            "a token more",
            InputAnswer(|x| Tensor::cat(&[x, &x.narrow(1, 0, 1)?], 1)),
        ),
        (
            "a feature more",
            InputAnswer(|x| Tensor::cat(&[x, &x.narrow(2, 0, 1)?], 2)),
        ),
        ("a sequence more", InputAnswer(|x| Tensor::cat(&[x, x], 0))),
        ("in f64", InputAnswer(|x| x.to_dtype(DType::F64))),
        ("in f16", InputAnswer(|x| x.to_dtype(DType::F16))),
        ("in u32", InputAnswer(|x| x.to_dtype(DType::U32))),
    ];
    let tokens = Tensor::new(&[[1u32, 4, 2]], dev)?;
    for dtype in DTYPES {
        for (label, answer) in &answers {
            let changes_dtype = matches!(*label, "in f64" | "in f16" | "in u32");
            if changes_dtype && label[3..] == *dtype.as_str() {
                continue; // the answer is in the model's own dtype
            }
            let what = format!("{label}, {dtype:?} model");
            let enc: Arc<dyn PositionalEncoding> = Arc::new(InputAnswer(answer.0));
            let varmap = VarMap::new();
            let vb = common::seeded_vb(&varmap, dtype, dev);
            let embed = Embeddings::new(
                &EmbeddingsConfig::new(8, d),
                Some(enc.clone()),
                vb.pp("wte"),
            )?;
            let mha = MultiHeadAttention::new(&AttentionConfig::new(d, 2), Some(enc), vb.pp("a"))?;
            let x = common::randn(0f32, 1.0, (1, 3, d), dev)?.to_dtype(dtype)?;
            let from_embeddings = embed
                .forward_with(&tokens, &Positions::Offset(0), false)
                .unwrap_err();
            let from_block = mha
                .forward_with(&x, &AttentionOptions::default(), None)
                .unwrap_err();
            let expected_variant = match changes_dtype {
                true => matches!(from_embeddings, Error::DType { .. }),
                false => matches!(from_embeddings, Error::Shape { .. }),
            };
            assert!(expected_variant, "{what}: {from_embeddings:?}");
            assert!(
                from_embeddings.to_string().contains("input hook"),
                "{what}: {from_embeddings}"
            );
            // The same check: the same message, but for the input's own shape.
            let strip = |e: &Error| e.to_string().replace("[1, 3, 16]", "<input>");
            assert_eq!(strip(&from_embeddings), strip(&from_block), "{what}");
        }
        // An answer that fits (the input plus one) is the output of the input layer.
        let plus_one: Arc<dyn PositionalEncoding> = Arc::new(InputAnswer(|x| x + 1.0));
        let varmap = VarMap::new();
        let vb = common::seeded_vb(&varmap, dtype, dev);
        let embed = Embeddings::new(&EmbeddingsConfig::new(8, d), Some(plus_one), vb.pp("wte"))?;
        let got = embed.forward_with(&tokens, &Positions::Offset(0), false)?;
        let want = (embed.weight().index_select(&tokens.flatten_all()?, 0)? + 1.0)?.unsqueeze(0)?;
        assert_eq!(values(&got)?, values(&want)?, "{dtype:?}");
    }
    Ok(())
}

device_tests!(
    factors_fit_the_dtype_or_are_refused,
    llama4_temperature_in_f16,
    rotary_attention_factor_in_every_dtype,
    bias_values_past_the_logits_dtype,
    alibi_far_from_its_keys,
    narrowing_a_checkpoint,
    one_dtype_rule_for_every_var_builder,
    one_check_for_the_input_hook,
);
