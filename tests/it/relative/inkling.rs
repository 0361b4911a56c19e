//! Inkling's relative logits alone: the bias equals HF transformers 5.24's
//! `InklingRelativeLogits` (queries at offset 2 against keys from 0, inside and outside the
//! bank), through offsets and explicit ids alike; the configuration through serde and
//! checkpoint metadata. (The whole layer is checked in `hf::inkling`.)

use crate::common;

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_posenc::{EncodingConfig, InklingConfig, InklingRelativeLogits, LogScaling, Positions};
use common::{assert_close, fixture, get};

/// HF's module: 3 heads, d_rel 2, a bank of 4 distances; 7 queries from position 2, 9 keys.
fn bias_equals_hf(dev: &Device) -> anyhow::Result<()> {
    let tensors = fixture("inkling.safetensors", dev)?;
    let states = get(&tensors, "rel.states");
    let want = get(&tensors, "rel.bias");
    let config = InklingConfig::new(5, 3).with_d_rel(2).with_rel_extent(4);
    let held = HashMap::from([
        (
            "r_proj.weight".to_string(),
            Tensor::zeros((6, 5), DType::F32, dev)?,
        ),
        (
            "rel_logits_proj.proj".to_string(),
            get(&tensors, "rel.proj").clone(),
        ),
    ]);
    let rel = InklingRelativeLogits::new(&config, VarBuilder::from_tensors(held, DType::F32, dev))?;
    let got = rel.bias(states, &Positions::Offset(2), &Positions::Offset(0), 9)?;
    assert_close(&got, want, 1e-6, "offsets")?;
    // The same positions as explicit ids (one row per sequence).
    let ids = |start: u32, n: u32| -> anyhow::Result<Positions> {
        let row: Vec<u32> = (start..start + n).collect();
        Ok(Positions::ids(&Tensor::new(row, dev)?.unsqueeze(0)?)?)
    };
    let got = rel.bias(states, &ids(2, 7)?, &ids(0, 9)?, 9)?;
    assert_close(&got, want, 1e-6, "ids")?;
    Ok(())
}

/// The configuration: required fields only in JSON, the rest defaulted as HF's class; the
/// checkpoint metadata round trip; refusals.
fn config_round_trips(_dev: &Device) -> anyhow::Result<()> {
    let json = r#"{"kind": "inkling", "d_model": 64, "num_heads": 4}"#;
    let config: EncodingConfig = serde_json::from_str(json)?;
    assert_eq!(config, EncodingConfig::Inkling(InklingConfig::new(64, 4)));
    let scaled =
        EncodingConfig::Inkling(InklingConfig::new(64, 4).with_log_scaling(Some(LogScaling {
            n_floor: 8192,
            alpha: 0.1,
        })));
    for c in [&config, &scaled] {
        assert_eq!(&EncodingConfig::from_metadata(&c.to_metadata(), "test")?, c);
    }
    let zero = EncodingConfig::Inkling(InklingConfig::new(64, 4).with_rel_extent(0));
    assert!(zero.validate().is_err());
    let floor = LogScaling {
        n_floor: 0,
        alpha: 0.1,
    };
    assert!(floor.validate().is_err());
    assert!(
        (LogScaling {
            n_floor: 4,
            alpha: 0.5
        }
        .factor(7)
            - (1.0 + 0.5 * 2f64.ln()))
        .abs()
            < 1e-12
    );
    assert_eq!(
        LogScaling {
            n_floor: 4,
            alpha: 0.5
        }
        .factor(2),
        1.0
    );
    Ok(())
}

device_tests!(bias_equals_hf, config_round_trips);

/// A training step on the fused CPU core never builds the `(B, H, T, rel_extent + 2)` rows:
/// the mix and the bank are read as they are (and the block keeps every query in one block).
/// Counted by the test binary's allocator in a child process: T = 1024 queries, 4 heads and a
/// bank of 4096 distances would be 67 MB of rows, and as much again for their gradient; the
/// step holds under a quarter of that beyond what was live before it (8 MB here, the block's
/// own intermediates and the states of `r_proj`, O(T)).
#[test]
fn a_fused_step_holds_no_rows() -> anyhow::Result<()> {
    if !common::alone() {
        return common::run_alone(concat!(module_path!(), "::a_fused_step_holds_no_rows"));
    }
    let dev = Device::Cpu;
    let varmap = candle_nn::VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, &dev);
    let (d_model, heads, t, extent) = (64, 4, 1024, 4096);
    let config = InklingConfig::new(d_model, heads).with_rel_extent(extent);
    let rel = InklingRelativeLogits::new(&config, vb.pp("rel"))?;
    let cfg = candle_posenc::AttentionConfig::new(d_model, heads).with_causal(true);
    let mha =
        candle_posenc::MultiHeadAttention::new(&cfg, Some(std::sync::Arc::new(rel)), vb.pp("a"))?;
    let train = candle_posenc::AttentionOptions {
        train: true,
        ..Default::default()
    };
    let step = |x: &candle_core::Var| -> anyhow::Result<()> {
        let y = mha.forward_with(x.as_tensor(), &train, None)?;
        y.output.sqr()?.sum_all()?.backward()?;
        Ok(())
    };
    // A small step first: the thread pool and its arenas are not the step's.
    step(&common::var_randn(0f32, 1.0, (1, 16, d_model), &dev)?)?;
    let x = common::var_randn(0f32, 1.0, (1, t, d_model), &dev)?;
    let peak = common::peak::peak_of(|| step(&x))?;
    let rows = heads * t * (extent + 2) * 4;
    println!("peak {peak} bytes; the rows would be {rows}");
    assert!(peak < rows / 4, "peak {peak} bytes (the rows: {rows})");
    Ok(())
}
