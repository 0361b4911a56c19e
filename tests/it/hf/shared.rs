//! A model's layers loaded through one `SharedEncodings`: one `Arc` encoding per distinct
//! configuration, and the same outputs as layers that each built their own.

use crate::common;

use std::sync::Arc;

use candle_core::{DType, Device, Module};
use candle_nn::VarMap;
use candle_posenc::hf::{HfAttentionConfig, SharedEncodings};
use candle_posenc::MultiHeadAttention;

/// Layers `0..n` of `json`, each read for its own layer, loaded through `shared` from random
/// weights in `varmap`.
fn load_layers(
    json: &str,
    n: usize,
    shared: &mut SharedEncodings,
    varmap: &VarMap,
    dev: &Device,
) -> anyhow::Result<Vec<MultiHeadAttention>> {
    let vb = common::seeded_vb(varmap, DType::F32, dev);
    (0..n)
        .map(|i| {
            let config = HfAttentionConfig::from_json_layer(json, i)?;
            Ok(config.load_shared(shared, vb.pp(format!("model.layers.{i}.self_attn")))?)
        })
        .collect()
}

fn same_arc(a: &MultiHeadAttention, b: &MultiHeadAttention) -> bool {
    match (a.encoding(), b.encoding()) {
        (Some(a), Some(b)) => Arc::ptr_eq(a, b),
        _ => false,
    }
}

#[test]
fn a_llama_stack_shares_one_rope_and_answers_as_unshared_layers() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let json = r#"{"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 3, "rope_theta": 100000.0}"#;
    let varmap = VarMap::new();
    let mut shared = SharedEncodings::new();
    let layers = load_layers(json, 3, &mut shared, &varmap, &dev)?;
    assert_eq!(shared.len(), 1);
    assert!(same_arc(&layers[0], &layers[1]) && same_arc(&layers[1], &layers[2]));
    // The same tensors through `load`, each layer with its own table, answer the same.
    let vb = common::seeded_vb(&varmap, DType::F32, &dev);
    let x = common::randn(0f32, 1.0, (1, 7, 32), &dev)?;
    for (i, layer) in layers.iter().enumerate() {
        let own = HfAttentionConfig::from_json(json)?
            .load(vb.pp(format!("model.layers.{i}.self_attn")))?;
        assert!(!same_arc(&own, layer));
        let diff = (own.forward(&x)? - layer.forward(&x)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert_eq!(diff, 0.0, "layer {i}");
    }
    Ok(())
}

#[test]
fn layers_with_different_rotations_get_one_encoding_each() -> anyhow::Result<()> {
    // Gemma 3: every sixth layer full (θ 1e6), the others sliding (θ 10000).
    let dev = Device::Cpu;
    let json = r#"{"model_type": "gemma3_text", "hidden_size": 32, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "num_hidden_layers": 7,
        "sliding_window": 8}"#;
    let varmap = VarMap::new();
    let mut shared = SharedEncodings::new();
    let layers = load_layers(json, 7, &mut shared, &varmap, &dev)?;
    assert_eq!(shared.len(), 2);
    assert!(same_arc(&layers[0], &layers[4]));
    assert!(!same_arc(&layers[0], &layers[5]));
    assert!(same_arc(&layers[0], &layers[6]));
    Ok(())
}

#[test]
fn t5_layers_share_the_first_layers_table() -> anyhow::Result<()> {
    // Only layer 0 holds `relative_attention_bias`; the others reuse it.
    let dev = Device::Cpu;
    let json = r#"{"model_type": "t5", "d_model": 16, "num_heads": 2, "d_kv": 8}"#;
    let config = HfAttentionConfig::from_json(json)?;
    let varmap = VarMap::new();
    let vb = common::seeded_vb(&varmap, DType::F32, &dev);
    let mut shared = SharedEncodings::new();
    let prefix = |i: usize| format!("encoder.block.{i}.layer.0.SelfAttention");
    let first = config.load_shared(&mut shared, vb.pp(prefix(0)))?;
    let names = |v: &VarMap| -> Vec<String> {
        let data = v.data().lock().expect("the varmap's lock");
        data.keys().cloned().collect()
    };
    let before = names(&varmap).len();
    let second = config.load_shared(&mut shared, vb.pp(prefix(1)))?;
    assert!(same_arc(&first, &second));
    // Layer 1's tensors were read (q, k, v, o) but no table of its own.
    let after = names(&varmap);
    assert_eq!(after.len(), before + 4, "{after:?}");
    assert!(!after
        .iter()
        .any(|n| n.starts_with(&prefix(1)) && n.contains("relative")));
    Ok(())
}
