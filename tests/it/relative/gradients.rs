//! Gradients of the relative encodings' learned parameters through a whole block against torch
//! autograd in float64 (`generate.py relative_grads`): T5's table (bidirectional, and causal
//! buckets in a causal block), learnable ALiBi slopes (causal, symmetric), the clipped table
//! past ±k, with and without sinks, keys left-padded, in f64 and f32, on the training path, the
//! inference path with tracked variables and the returned-weights path.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use candle_posenc::plug::PositionalEncoding;
use candle_posenc::{
    Alibi, AlibiConfig, AttentionConfig, AttentionOptions, ClippedBiasConfig, ClippedRelativeBias,
    MultiHeadAttention, T5Config, T5RelativeBias,
};
use common::{assert_close, fixture, get};

/// The case's encoding on `vb`, and whether its block is causal and has sinks.
fn case_block(
    case: &str,
    vb: candle_nn::VarBuilder,
) -> anyhow::Result<(Arc<dyn PositionalEncoding>, bool, bool)> {
    let (causal, sinks) = match case {
        "t5bi" | "alibi_sym" => (false, true),
        "t5causal" | "alibi_causal" => (true, false),
        "t5causal_sinks" | "alibi_causal_sinks" | "clipped" => (true, true),
        _ => (false, false),
    };
    let enc: Arc<dyn PositionalEncoding> = match &case[..2] {
        "t5" => {
            let t5 = T5Config::new(4).with_num_buckets(8).with_max_distance(12);
            Arc::new(T5RelativeBias::new(&t5.with_bidirectional(!causal), vb)?)
        }
        "al" => Arc::new(Alibi::new_learnable(&AlibiConfig::new(4), vb)?),
        _ => Arc::new(ClippedRelativeBias::new(&ClippedBiasConfig::new(4, 2), vb)?),
    };
    Ok((enc, causal, sinks))
}

/// The block's output (on the probed queries) and the gradients of `Σ probe · y` reaching the
/// encoding's parameters, the sinks, the query projection and the input equal torch's: in f64
/// within 1e-12 of the largest (ALiBi's slopes are an f32 variable in every block, so 1e-6
/// there), in f32 within 4e-6 of the largest (measured at most 1.1e-6, the sinks' gradient).
fn relative_gradients_match_torch(case: &str, dev: &Device) -> anyhow::Result<()> {
    let fx = fixture("relative_grads.safetensors", dev)?;
    let prefix = format!("{case}.param.");
    let mut params: Vec<&str> = fx.keys().filter_map(|k| k.strip_prefix(&prefix)).collect();
    params.sort_unstable();
    for dtype in [DType::F64, DType::F32] {
        let rel = match (dtype, case.starts_with("alibi")) {
            (DType::F64, false) => 1e-12,
            (DType::F64, true) => 1e-6,
            _ => 4e-6,
        };
        for (train, return_weights) in [(true, false), (false, false), (false, true)] {
            let what = format!("{case} {dtype:?} train {train} weights {return_weights}");
            let varmap = VarMap::new();
            let vb = common::seeded_vb(&varmap, dtype, dev);
            let (enc, causal, sinks) = case_block(case, vb.clone())?;
            let cfg = AttentionConfig::new(16, 4)
                .with_causal(causal)
                .with_sinks(sinks);
            let mha = MultiHeadAttention::new(&cfg, Some(enc), vb)?;
            set_vars(&varmap, &fx, &prefix, &params)?;
            let x = Var::from_tensor(&get(&fx, "x").to_dtype(dtype)?)?;
            let opts = AttentionOptions {
                padding_mask: Some(get(&fx, "padding")),
                train,
                return_weights,
                ..Default::default()
            };
            let y = mha.forward_with(x.as_tensor(), &opts, None)?.output;
            let probe = get(&fx, &format!("{case}.probe"));
            let probed = probe.ne(0.0)?.to_dtype(DType::F64)?;
            let want_y = (get(&fx, &format!("{case}.y")) * &probed)?;
            let got_y = (y.to_dtype(DType::F64)? * &probed)?;
            close(&got_y, &want_y, rel, &format!("{what} output"))?;
            let grads = (&y * probe.to_dtype(dtype)?)?.sum_all()?.backward()?;
            let vars = varmap.data().lock().map_err(|e| anyhow::anyhow!("{e}"))?;
            for name in params.iter().copied().chain(["q_proj.weight", "x"]) {
                let var = if name == "x" { &x } else { &vars[name] };
                let got = grads.get(var.as_tensor()).expect("a gradient");
                let want = get(&fx, &format!("{case}.grad.{name}"));
                close(got, want, rel, &format!("{what} gradient of {name}"))?;
            }
        }
    }
    Ok(())
}

/// The fixture's weights and the case's parameters into the block's variables.
fn set_vars(
    varmap: &VarMap,
    fx: &HashMap<String, Tensor>,
    prefix: &str,
    params: &[&str],
) -> anyhow::Result<()> {
    let vars = varmap.data().lock().map_err(|e| anyhow::anyhow!("{e}"))?;
    let weights = ["q_proj", "k_proj", "v_proj", "o_proj"].map(|n| format!("{n}.weight"));
    for name in &weights {
        vars[name.as_str()].set(&get(fx, name).to_dtype(vars[name.as_str()].dtype())?)?;
    }
    for name in params {
        let var = &vars[*name];
        var.set(&get(fx, &format!("{prefix}{name}")).to_dtype(var.dtype())?)?;
    }
    Ok(())
}

/// `|got − want| ≤ rel · max |want|`, with a loss that must reach `want`.
fn close(got: &Tensor, want: &Tensor, rel: f64, what: &str) -> anyhow::Result<()> {
    let scale = want.abs()?.max_all()?.to_scalar::<f64>()?;
    assert!(scale > 1e-3, "{what}: the loss must reach it");
    assert_close(got, want, rel * scale, what)
}

case_tests!(relative_gradients_match_torch:
    t5bi = "t5bi",
    t5causal = "t5causal",
    t5causal_sinks = "t5causal_sinks",
    alibi_causal_sinks = "alibi_causal_sinks",
    alibi_causal = "alibi_causal",
    alibi_sym = "alibi_sym",
    clipped = "clipped",
    clipped_bi = "clipped_bi",
);
