//! A third-party encoding written against the plug alone (KERPLE's logarithmic bias, from
//! `examples/kerple.rs`): its rows take the fused CPU core and give the same attention as the
//! differentiable path, as its dense form, and as explicit ids; gradients reach its parameters.

use crate::common;

#[allow(dead_code)] // the example's `main` is not called here
#[path = "../../../examples/kerple.rs"]
mod kerple;

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_posenc::{AttentionConfig, AttentionOptions, KvCache, MultiHeadAttention, Positions};
use common::assert_close;
use kerple::Kerple;

fn kerple_through_every_path(dev: &Device) -> anyhow::Result<()> {
    let (t, d_model, heads) = (37, 32, 4);
    let x = common::randn(0f32, 1.0, (2, t, d_model), dev)?;
    let ids = Positions::ids(&Tensor::arange(5u32, 5 + t as u32, dev)?.unsqueeze(0)?)?;
    for causal in [false, true] {
        let cfg = AttentionConfig::new(d_model, heads)
            .with_causal(causal)
            .with_query_block(Some(8));
        let build = |vb: &VarBuilder| -> anyhow::Result<(MultiHeadAttention, MultiHeadAttention)> {
            let enc = Kerple::new(heads, vb.pp("kerple"))?;
            let rows = MultiHeadAttention::new(&cfg, Some(Arc::new(enc.clone())), vb.pp("attn"))?;
            let dense = rows.clone().with_encoding(Some(Arc::new(enc.dense())));
            Ok((rows, dense))
        };
        // Training through a VarMap's variables; inference on the same values as plain
        // tensors (a block whose weights track gradients takes the differentiable path).
        let varmap = VarMap::new();
        let (trained, _) = build(&common::seeded_vb(&varmap, DType::F32, dev))?;
        let plain: HashMap<String, Tensor> = varmap
            .data()
            .lock()
            .map_err(|_| anyhow::anyhow!("varmap lock"))?
            .iter()
            .map(|(k, v)| (k.clone(), v.as_tensor().detach()))
            .collect();
        let (rows, dense) = build(&VarBuilder::from_tensors(plain, DType::F32, dev))?;
        let at5 = Positions::Offset(5);
        let opts = |train, positions| AttentionOptions {
            train,
            positions,
            ..Default::default()
        };
        let fused = rows
            .forward_with(&x, &opts(false, Some(&at5)), None)?
            .output;
        let what = format!("causal {causal}");
        for (name, other) in [
            (
                "training path",
                trained
                    .forward_with(&x, &opts(true, Some(&at5)), None)?
                    .output,
            ),
            (
                "dense form",
                dense
                    .forward_with(&x, &opts(false, Some(&at5)), None)?
                    .output,
            ),
            (
                "ids",
                rows.forward_with(&x, &opts(false, Some(&ids)), None)?
                    .output,
            ),
        ] {
            assert_close(&fused, &other, 2e-5, &format!("{what}: {name}"))?;
        }
        if causal {
            // Decoding through a cache equals the full forward.
            let mut cache = KvCache::new();
            let steps = (0..t)
                .map(|i| {
                    let o = AttentionOptions::default();
                    Ok(rows
                        .forward_with(&x.narrow(1, i, 1)?, &o, Some(&mut cache))?
                        .output)
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            assert_close(&Tensor::cat(&steps, 1)?, &rows.forward(&x)?, 2e-5, "decode")?;
        }
        let out = trained.forward(&x)?;
        let grads = out.sqr()?.sum_all()?.backward()?;
        let data = varmap.data().lock().expect("varmap lock");
        for name in ["kerple.r1", "kerple.r2"] {
            let g = grads.get(data[name].as_tensor()).expect("a gradient");
            let size = g.abs()?.sum_all()?.to_scalar::<f32>()?;
            assert!(size > 0.0, "{what}: {name} gets no gradient");
        }
    }
    Ok(())
}

device_tests!(kerple_through_every_path);
