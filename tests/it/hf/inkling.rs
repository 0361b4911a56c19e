//! Inkling's attention layer (`inkling_text`) read from its `config.json` and HF's tensor
//! names, against transformers 5.24's `InklingAttention` (`generate.py inkling`): a full layer
//! with log-n scaling and a sliding one with its own heads, each also left-padded. Every path
//! (the fused core, the row pass, the fused training core, candle's ops), token-by-token
//! decoding through a KV cache, and torch autograd's gradients of the input and every weight.
// Products of tensors this file lays out itself (clippy.toml sends the library's through
// src/matmul.rs).
#![allow(clippy::disallowed_methods)]

use crate::common;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use candle_posenc::attention::{AttentionOptions, KvCache, MultiHeadAttention};
use candle_posenc::checkpoint::Checkpoint;
use candle_posenc::encoding::EncodingConfig;
use candle_posenc::hf::HfAttentionConfig;
use candle_posenc::{InklingConfig, LogScaling};
use common::{assert_close, get};

fn fixtures(dev: &Device) -> anyhow::Result<Checkpoint> {
    let path = format!(
        "{}/tests/fixtures/inkling.safetensors",
        env!("CARGO_MANIFEST_DIR")
    );
    Ok(Checkpoint::load(path, dev)?)
}

/// The case's layer as read from the file, and its tensors' prefix.
fn config(ckpt: &Checkpoint, tag: &str) -> anyhow::Result<(HfAttentionConfig, String)> {
    let meta = ckpt.metadata();
    let layer: usize = meta[&format!("{tag}.layer")].parse()?;
    let config = HfAttentionConfig::from_json_layer(&meta["config"], layer)?;
    Ok((config, format!("{tag}/{}", meta[&format!("{tag}.prefix")])))
}

/// Every path and decoding equal HF's module's output (nothing tracked: the inference paths;
/// training mode: candle's ops).
fn layer_matches_hf(tag: &str, dev: &Device) -> anyhow::Result<()> {
    let ckpt = fixtures(dev)?;
    let (config, prefix) = config(&ckpt, tag)?;
    let block = config.load(ckpt.var_builder(DType::F32, dev).pp(prefix))?;
    let x = get(ckpt.tensors(), &format!("{tag}.x"));
    let want = get(ckpt.tensors(), &format!("{tag}.out"));
    let padding = ckpt.tensors().get(&format!("{tag}.padding"));
    for (weights, train) in [(false, false), (true, false), (false, true), (true, true)] {
        let opts = AttentionOptions {
            padding_mask: padding,
            return_weights: weights,
            train,
            ..Default::default()
        };
        let got = block.forward_with(x, &opts, None)?.output;
        assert_close(
            &got,
            want,
            1e-5,
            &format!("{tag} weights {weights} train {train}"),
        )?;
    }
    // Token by token, and in uneven chunks: the cache keeps the convolutions' inputs and the
    // positions count from its start (pads included, as HF counts them).
    let t = x.dim(1)?;
    for chunks in [vec![1; t], vec![4, 1, 4], vec![2, 7]] {
        let mut cache = KvCache::new();
        let (mut start, mut outs) = (0, Vec::new());
        for n in &chunks {
            let seen = padding.map(|p| p.narrow(1, 0, start + n)).transpose()?;
            let opts = AttentionOptions {
                padding_mask: seen.as_ref(),
                ..Default::default()
            };
            outs.push(
                block
                    .forward_with(&x.narrow(1, start, *n)?, &opts, Some(&mut cache))?
                    .output,
            );
            start += n;
        }
        let got = Tensor::cat(&outs, 1)?;
        // A padded query sees no real key: its output is a convention (uniform over the keys
        // the call holds), so decoding compares the real rows.
        let keep = match padding {
            Some(p) => p.to_dtype(DType::F32)?.unsqueeze(2)?,
            None => Tensor::ones((1, t, 1), DType::F32, dev)?,
        };
        assert_close(
            &got.broadcast_mul(&keep)?,
            &want.broadcast_mul(&keep)?,
            1e-5,
            &format!("{tag} decoded in {chunks:?}"),
        )?;
    }
    Ok(())
}

/// The block loaded with its tensors as variables of a `VarMap` (under HF's names), and the map.
fn tracked(
    ckpt: &Checkpoint,
    tag: &str,
    dev: &Device,
) -> anyhow::Result<(MultiHeadAttention, VarMap)> {
    let (config, prefix) = config(ckpt, tag)?;
    let varmap = VarMap::new();
    let block = config.load(common::seeded_vb(&varmap, DType::F32, dev).pp(&prefix))?;
    let mut set = 0;
    for (name, var) in varmap.data().lock().unwrap().iter() {
        var.set(get(ckpt.tensors(), name))?;
        set += 1;
    }
    assert_eq!(
        set, 10,
        "{tag}: q, k, v, o, r, the bank, two convolutions, two norms"
    );
    Ok((block, varmap))
}

/// Torch autograd's gradients of `Σ probe · out` for the input and every weight, from the
/// fused training core and from candle's ops, within 1e-5 of each gradient's largest entry
/// (as `hf::layers` compares them: these reach 90, where an f32 step is 8e-6).
fn layer_trains_as_hf(tag: &str, dev: &Device) -> anyhow::Result<()> {
    let ckpt = fixtures(dev)?;
    let (block, varmap) = tracked(&ckpt, tag, dev)?;
    let x = Var::from_tensor(get(ckpt.tensors(), &format!("{tag}.x")))?;
    let probe = get(ckpt.tensors(), &format!("{tag}.grad.probe"));
    let padding = ckpt.tensors().get(&format!("{tag}.padding"));
    for (path, weights) in [("fused", false), ("ops", true)] {
        let opts = AttentionOptions {
            padding_mask: padding,
            return_weights: weights,
            train: true,
            ..Default::default()
        };
        let out = block.forward_with(x.as_tensor(), &opts, None)?.output;
        let what = format!("{tag} {path}");
        assert_close(
            &out,
            get(ckpt.tensors(), &format!("{tag}.out")),
            1e-5,
            &what,
        )?;
        let grads = (out * probe)?.sum_all()?.backward()?;
        let dx = grads.get(x.as_tensor()).expect("the input's gradient");
        close_scaled(dx, get(ckpt.tensors(), &format!("{tag}.grad.x")), &what)?;
        for (name, var) in varmap.data().lock().unwrap().iter() {
            let got = grads
                .get(var.as_tensor())
                .ok_or_else(|| anyhow::anyhow!("{what}: {name} gets no gradient"))?;
            let hf_name = name.strip_prefix(&format!("{tag}/")).unwrap_or(name);
            let want = get(ckpt.tensors(), &format!("{tag}.grad/{hf_name}"));
            close_scaled(got, want, &format!("{what}: d{name}"))?;
        }
    }
    Ok(())
}

/// `got` within 1e-5 × max(1, the largest |entry| of `want`) of `want`.
fn close_scaled(got: &Tensor, want: &Tensor, what: &str) -> anyhow::Result<()> {
    let top = want.abs()?.max_all()?.to_scalar::<f32>()?;
    assert_close(got, want, 1e-5 * f64::from(top.max(1.0)), what)
}

/// What the file sets, as read: the full layer's heads, scale 1/d, convolutions, bank and
/// scaling; the sliding layer's own heads and a bank as wide as its window, unscaled.
fn config_read_as_hf_does(dev: &Device) -> anyhow::Result<()> {
    let ckpt = fixtures(dev)?;
    let text = &ckpt.metadata()["config"];
    let full = HfAttentionConfig::from_json_layer(text, 0)?;
    let a = &full.attention;
    assert_eq!((a.num_heads, a.num_kv_heads, a.head_dim), (4, 2, 8));
    assert_eq!(
        (a.softmax_scale, a.short_conv, a.sliding_window),
        (0.125, Some(3), None)
    );
    let scaled = InklingConfig::new(32, 4)
        .with_d_rel(3)
        .with_rel_extent(6)
        .with_log_scaling(Some(LogScaling {
            n_floor: 3,
            alpha: 0.5,
        }));
    assert_eq!(full.encoding, EncodingConfig::Inkling(scaled));
    let sliding = HfAttentionConfig::from_json_layer(text, 1)?;
    let a = &sliding.attention;
    assert_eq!((a.num_heads, a.num_kv_heads, a.head_dim), (2, 1, 16));
    assert_eq!((a.softmax_scale, a.sliding_window), (1.0 / 16.0, Some(4)));
    let window = InklingConfig::new(32, 2).with_d_rel(3).with_rel_extent(4);
    assert_eq!(sliding.encoding, EncodingConfig::Inkling(window));
    // The layers differ: one at a time.
    assert!(HfAttentionConfig::from_json(text).is_err());
    // A minimal file: the class's defaults (every sixth layer full, 512-key windows).
    let min = r#"{"model_type": "inkling_text", "hidden_size": 64, "num_attention_heads": 8,
        "num_hidden_layers": 6}"#;
    let last = HfAttentionConfig::from_json_layer(min, 5)?;
    assert_eq!(
        (last.attention.sliding_window, last.attention.head_dim),
        (None, 128)
    );
    let first = HfAttentionConfig::from_json_layer(min, 0)?;
    assert_eq!(first.attention.sliding_window, Some(512));
    assert_eq!(first.attention.num_heads, 64);
    Ok(())
}

case_tests!(layer_matches_hf:
    full = "full",
    sliding = "sliding",
    full_padded = "full.padded",
    sliding_padded = "sliding.padded",
);

case_tests!(layer_trains_as_hf:
    full = "full",
    sliding = "sliding",
    full_padded = "full.padded",
    sliding_padded = "sliding.padded",
);

device_tests!(config_read_as_hf_does);
