//! FoX's forget gates: parity with x-transformers 2.26.4's `Attention(data_dependent_alibi=
//! True)` (causal, bidirectional, a scaled log) in the output and torch autograd's gradients of
//! the input and every weight, on every path; decoding through the KV cache equal to one
//! forward; the configuration through serde and checkpoint metadata.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use candle_posenc::{
    AttentionConfig, AttentionContext, AttentionOptions, EncodingConfig, Error, ForgettingGates,
    FoxConfig, KvCache, MultiHeadAttention, PositionalEncoding, Positions,
};
use common::{assert_close, fixture};

const D_MODEL: usize = 16;
const HEADS: usize = 4;

/// x-transformers' names for the block's: its attention's projections and the gates under
/// `data_dependent_alibi`, which the encoding is built from.
fn our_name(theirs: &str) -> String {
    let name = theirs
        .replace("to_q.", "attn.q_proj.")
        .replace("to_k.", "attn.k_proj.")
        .replace("to_v.", "attn.v_proj.")
        .replace("to_out.", "attn.o_proj.");
    name.replace("data_dependent_alibi.", "enc.")
}

/// The gates of a fixture case: bidirectional or causal, the log scaled by 0.5 or not.
fn mha_fox_config(case: &str) -> FoxConfig {
    let scale = if case.ends_with("scaled") { 0.5 } else { 1.0 };
    FoxConfig::new(D_MODEL, HEADS)
        .with_bidirectional(case.starts_with("bidirectional"))
        .with_post_log_scale(scale)
}

/// The case's block with its weights as variables of a `VarMap`, and the map.
fn block(
    tensors: &HashMap<String, Tensor>,
    case: &str,
    dev: &Device,
) -> anyhow::Result<(MultiHeadAttention, VarMap)> {
    let causal = !case.starts_with("bidirectional");
    let config = mha_fox_config(case);
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let fox = ForgettingGates::new(&config, vb.pp("enc"))?;
    let attn = AttentionConfig::new(D_MODEL, HEADS).with_causal(causal);
    let mha = MultiHeadAttention::new(&attn, Some(Arc::new(fox)), vb.pp("attn"))?;
    let prefix = format!("{case}/");
    let mut set = 0;
    for (theirs, t) in tensors {
        let Some(theirs) = theirs.strip_prefix(&prefix) else {
            continue;
        };
        let ours = our_name(theirs);
        let data = varmap.data().lock().unwrap();
        let var = data
            .get(&ours)
            .ok_or_else(|| anyhow::anyhow!("{case}: no variable {ours}"))?;
        var.set(&t.to_device(dev)?)?;
        set += 1;
    }
    assert_eq!(set, varmap.all_vars().len(), "{case}: every weight set");
    Ok((mha, varmap))
}

/// The output and the gradients of `Σ w·out` on every path equal x-transformers'.
fn matches_x_transformers(case: &str, dev: &Device) -> anyhow::Result<()> {
    let tensors = fixture("fox.safetensors", dev)?;
    let get = |name: &str| -> anyhow::Result<Tensor> { Ok(tensors[name].clone()) };
    let (mha, varmap) = block(&tensors, case, dev)?;
    let x = Var::from_tensor(&get(&format!("{case}.x"))?)?;
    let probe = get(&format!("{case}.probe"))?;
    let want = get(&format!("{case}.out"))?;
    // Nothing tracked: the inference paths (the fused core, the row pass).
    let plain = plain_tensors(&varmap);
    let vb = VarBuilder::from_tensors(plain, DType::F32, dev);
    let fox = EncodingConfig::Fox(mha_fox_config(case)).build(vb.pp("enc"))?;
    let frozen = MultiHeadAttention::new(mha.config(), fox, vb.pp("attn"))?;
    for weights in [false, true] {
        let opts = AttentionOptions {
            return_weights: weights,
            ..Default::default()
        };
        let out = frozen.forward_with(&x.as_tensor().detach(), &opts, None)?;
        assert_close(
            &out.output,
            &want,
            1e-5,
            &format!("{case} frozen {weights}"),
        )?;
    }
    // Tracked weights: the fused training core, and candle's ops when the weights are
    // returned.
    for (train, weights) in [(false, false), (false, true), (true, false), (true, true)] {
        let what = format!("{case} train {train} weights {weights}");
        let opts = AttentionOptions {
            train,
            return_weights: weights,
            ..Default::default()
        };
        let out = mha.forward_with(x.as_tensor(), &opts, None)?.output;
        assert_close(&out, &want, 1e-5, &what)?;
        let grads = (out * &probe)?.sum_all()?.backward()?;
        let dx = grads.get(x.as_tensor()).expect("the input's gradient");
        assert_close(dx, &get(&format!("{case}.grad.x"))?, 1e-5, &what)?;
        let prefix = format!("{case}.grad/");
        for (theirs, _) in tensors.iter().filter(|(k, _)| k.starts_with(&prefix)) {
            let ours = our_name(&theirs[prefix.len()..]);
            let var = varmap.data().lock().unwrap()[&ours].clone();
            let got = grads.get(var.as_tensor()).expect("every weight's gradient");
            assert_close(got, &get(theirs)?, 1e-5, &format!("{what}: d{ours}"))?;
        }
    }
    Ok(())
}

/// A block with strong forgetting (bias 1: gates near 0.73) and random weights: on a
/// `VarMap` (its states track gradients), or from plain tensors as a loaded checkpoint gives
/// (the cache writes their states in place).
fn random_block(causal: bool, dev: &Device) -> anyhow::Result<MultiHeadAttention> {
    blocks(causal, dev).map(|(tracked, _)| tracked)
}

fn blocks(causal: bool, dev: &Device) -> anyhow::Result<(MultiHeadAttention, MultiHeadAttention)> {
    let config = FoxConfig::new(D_MODEL, HEADS)
        .with_bidirectional(!causal)
        .with_bias_init(1.0);
    let attn = AttentionConfig::new(D_MODEL, HEADS)
        .with_kv_heads(2)
        .with_causal(causal);
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let fox = EncodingConfig::Fox(config.clone()).build(vb.pp("enc"))?;
    let tracked = MultiHeadAttention::new(&attn, fox, vb.pp("attn"))?;
    let plain = plain_tensors(&varmap);
    let vb = VarBuilder::from_tensors(plain, DType::F32, dev);
    let fox = EncodingConfig::Fox(config).build(vb.pp("enc"))?;
    Ok((tracked, MultiHeadAttention::new(&attn, fox, vb.pp("attn"))?))
}

/// Token by token, and in uneven chunks, through a KV cache: the outputs of one forward (the
/// cache keeps the cumulative sums; x-transformers' own cache would forget nothing).
fn decoding_equals_one_forward(dev: &Device) -> anyhow::Result<()> {
    let (tracked, plain) = blocks(true, dev)?;
    for mha in [&tracked, &plain] {
        decodes_as_one_forward(mha, dev)?;
    }
    Ok(())
}

fn decodes_as_one_forward(mha: &MultiHeadAttention, dev: &Device) -> anyhow::Result<()> {
    let x = common::randn(0f32, 1.0, (2, 11, D_MODEL), dev)?;
    let opts = AttentionOptions::default();
    let want = mha.forward_with(&x, &opts, None)?.output;
    for chunks in [vec![1; 11], vec![4, 1, 6], vec![3, 8]] {
        let mut cache = KvCache::new();
        let (mut start, mut outs) = (0, Vec::new());
        for n in &chunks {
            let part = x.narrow(1, start, *n)?;
            outs.push(mha.forward_with(&part, &opts, Some(&mut cache))?.output);
            start += n;
        }
        let got = Tensor::cat(&outs, 1)?;
        assert_close(&got, &want, 1e-5, &format!("chunks {chunks:?}"))?;
    }
    // A cache truncated back and continued equals one forward too.
    let mut cache = KvCache::new();
    mha.forward_with(&x.narrow(1, 0, 7)?, &opts, Some(&mut cache))?;
    cache.truncate(5)?;
    let tail = mha.forward_with(&x.narrow(1, 5, 6)?, &opts, Some(&mut cache))?;
    assert_close(&tail.output, &want.narrow(1, 5, 6)?, 1e-5, "after truncate")?;
    // A cache cloned after a prefix: each clone continues with its own tokens as one forward
    // over the prefix and those tokens does (the states are written in place, never into
    // storage the other clone reads).
    let y = common::randn(0f32, 1.0, (2, 4, D_MODEL), dev)?;
    let want_y = mha
        .forward_with(&Tensor::cat(&[&x.narrow(1, 0, 7)?, &y], 1)?, &opts, None)?
        .output
        .narrow(1, 7, 4)?;
    let mut a = KvCache::new();
    mha.forward_with(&x.narrow(1, 0, 7)?, &opts, Some(&mut a))?;
    let mut b = a.clone();
    let (mut outs_a, mut outs_b) = (Vec::new(), Vec::new());
    for i in 0..4 {
        outs_a.push(
            mha.forward_with(&x.narrow(1, 7 + i, 1)?, &opts, Some(&mut a))?
                .output,
        );
        outs_b.push(
            mha.forward_with(&y.narrow(1, i, 1)?, &opts, Some(&mut b))?
                .output,
        );
    }
    assert_close(
        &Tensor::cat(&outs_a, 1)?,
        &want.narrow(1, 7, 4)?,
        1e-5,
        "clone a",
    )?;
    assert_close(&Tensor::cat(&outs_b, 1)?, &want_y, 1e-5, "clone b")?;
    Ok(())
}

/// A streaming cache takes the gates of the tokens it forgets out of the sums of those it
/// keeps: each chunk's output equals one forward over the held tokens and the chunk in a row
/// (as every encoding's does at its slots), causal and bidirectional, token by token and in
/// uneven chunks, alike whether the cache moves the states in its own storage or, shared by a
/// clone, into fresh tensors. (The sums kept the forgotten gates, so the sinks' bias fell
/// without bound as the stream grew: another answer, silently.)
fn streaming_cache_holds_the_kept_tokens_in_a_row(dev: &Device) -> anyhow::Result<()> {
    let (sinks, window) = (1, 3);
    let x = common::randn(0f32, 1.0, (2, 16, D_MODEL), dev)?;
    let opts = AttentionOptions::default();
    for (causal, chunks) in [
        (true, vec![1; 16]),
        (true, vec![2, 3, 1, 4, 1, 5]),
        (false, vec![2, 3, 1, 4, 1, 5]),
    ] {
        let (_, mha) = blocks(causal, dev)?;
        let (mut cache, mut shared) = (
            KvCache::streaming(sinks, window),
            KvCache::streaming(sinks, window),
        );
        let (mut held, mut at): (Vec<usize>, usize) = (Vec::new(), 0);
        for n in chunks {
            let part = x.narrow(1, at, n)?;
            let got = mha.forward_with(&part, &opts, Some(&mut cache))?.output;
            let _clone = shared.clone();
            let other = mha.forward_with(&part, &opts, Some(&mut shared))?.output;
            held.extend(at..at + n);
            let rows = held
                .iter()
                .map(|&j| x.narrow(1, j, 1))
                .collect::<candle_core::Result<Vec<_>>>()?;
            let want = mha
                .forward(&Tensor::cat(&rows, 1)?)?
                .narrow(1, held.len() - n, n)?;
            let what = format!("causal {causal}, tokens {at}..{}", at + n);
            assert_close(&got, &want, 1e-5, &what)?;
            assert_close(&other, &got, 1e-6, &format!("{what}, storage shared"))?;
            if held.len() > sinks + window {
                held.drain(sinks..held.len() - window);
            }
            assert_eq!(cache.len(), held.len(), "{what}");
            at += n;
        }
    }
    Ok(())
}

/// Causal gates refuse bidirectional attention; a cache filled without states is refused;
/// the content hook refuses carried sums of another batch × gates, even of the same count
/// (they were continued row for row: sequence 1's gates after sequence 0's sums).
fn refusals(dev: &Device) -> anyhow::Result<()> {
    let causal_gates = random_block(true, dev)?;
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, dev);
    let fox = EncodingConfig::Fox(FoxConfig::new(D_MODEL, HEADS)).build(vb.pp("enc"))?;
    let attn = AttentionConfig::new(D_MODEL, HEADS).with_causal(false);
    let bidirectional = MultiHeadAttention::new(&attn, fox, vb.pp("attn"))?;
    let x = common::randn(0f32, 1.0, (1, 3, D_MODEL), dev)?;
    let opts = AttentionOptions::default();
    let err = bidirectional.forward_with(&x, &opts, None).unwrap_err();
    assert!(
        matches!(err, Error::InvalidConfig { name, .. } if name == "bidirectional"),
        "{err}"
    );
    let plain = causal_gates.clone().with_encoding(None);
    let mut cache = KvCache::new();
    plain.forward_with(&x, &opts, Some(&mut cache))?;
    let err = causal_gates
        .forward_with(&x, &opts, Some(&mut cache))
        .unwrap_err();
    assert!(matches!(err, Error::InvalidConfig { .. }), "{err}");
    assert_eq!(cache.len(), 3, "the refused chunk left nothing");
    let gates = ForgettingGates::new(&FoxConfig::new(D_MODEL, HEADS), vb.pp("gates"))?;
    let two = common::randn(0f32, 1.0, (2, 3, D_MODEL), dev)?;
    let at = Positions::Offset(5);
    let ctx = AttentionContext::chunk(&at, 3);
    for carried in [(1, 2 * HEADS, 5), (2, HEADS + 1, 5)] {
        let carried = Tensor::zeros(carried, DType::F32, dev)?;
        let err = gates.token_states(&two, Some(&carried), &ctx).unwrap_err();
        assert!(matches!(err, Error::Shape { .. }), "{err}");
    }
    let fits = Tensor::zeros((2, HEADS, 5), DType::F32, dev)?;
    assert!(gates.token_states(&two, Some(&fits), &ctx)?.is_some());
    Ok(())
}

/// The configuration: required fields only in JSON, the rest defaulted; checkpoint metadata
/// round trip; x-transformers' initial bias.
fn config_round_trips(dev: &Device) -> anyhow::Result<()> {
    let json = r#"{"kind": "fox", "d_model": 16, "num_heads": 4}"#;
    let config: EncodingConfig = serde_json::from_str(json)?;
    assert_eq!(config, EncodingConfig::Fox(FoxConfig::new(16, 4)));
    let back = EncodingConfig::from_metadata(&config.to_metadata(), "test")?;
    assert_eq!(back, config);
    let bad = r#"{"kind": "fox", "d_model": 16, "num_heads": 0}"#;
    let bad: EncodingConfig = serde_json::from_str(bad)?;
    assert!(bad.validate().is_err());
    let varmap = VarMap::new();
    config.build(common::seeded_vb(&varmap, DType::F32, dev))?;
    let bias = varmap.data().lock().unwrap()["to_forget_gates.0.bias"].clone();
    let want = fixture("fox.safetensors", dev)?["bias_init"].clone();
    assert_close(bias.as_tensor(), &want, 0.0, "initial bias")?;
    Ok(())
}

case_tests!(matches_x_transformers:
    causal = "causal",
    bidirectional = "bidirectional",
    causal_scaled = "causal_scaled",
);

device_tests!(
    decoding_equals_one_forward,
    streaming_cache_holds_the_kept_tokens_in_a_row,
    refusals,
    config_round_trips
);

/// A `VarMap`'s values as plain tensors, as a loaded checkpoint gives them.
fn plain_tensors(varmap: &VarMap) -> HashMap<String, Tensor> {
    varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().detach()))
        .collect()
}
