//! Gemma 3 with `use_bidirectional_attention` (EmbeddingGemma's setting) read from its
//! `config.json`, against HF's own model (`generate.py hf_bidirectional`): the full layer sees
//! every token, the sliding layer every token within `sliding_window / 2` on either side; and
//! Gemma's and Gemma 2's setting of the same name, whose answer in HF depends on the backend,
//! refused.

use crate::common;

use candle_core::{DType, Device};
use candle_posenc::attention::AttentionOptions;
use candle_posenc::checkpoint::Checkpoint;
use candle_posenc::hf::HfAttentionConfig;
use candle_posenc::{Error, RopeConfig};
use common::{assert_close, get};

/// Both layers, on the fused core, the row pass and candle's ops, equal HF's; the file reads
/// as bidirectional, with the sliding layer's window halved.
fn gemma3_bidirectional_layers_match_hf(dev: &Device) -> anyhow::Result<()> {
    let path = format!(
        "{}/tests/fixtures/hf_bidirectional.safetensors",
        env!("CARGO_MANIFEST_DIR")
    );
    let ckpt = Checkpoint::load(path, dev)?;
    let text = &ckpt.metadata()["config"];
    for (layer, window) in [(0, Some(2)), (1, None)] {
        let config = HfAttentionConfig::from_json_layer(text, layer)?;
        assert!(!config.attention.causal, "layer {layer}");
        assert_eq!(config.attention.sliding_window, window, "layer {layer}");
        let block = config.load(
            ckpt.var_builder(DType::F32, dev)
                .pp(format!("layers.{layer}.self_attn")),
        )?;
        let x = get(ckpt.tensors(), &format!("{layer}.x"));
        let want = get(ckpt.tensors(), &format!("{layer}.out"));
        for (return_weights, train) in [(false, false), (true, false), (false, true)] {
            let opts = AttentionOptions {
                return_weights,
                train,
                ..Default::default()
            };
            let got = block.forward_with(x, &opts, None)?.output;
            assert_close(&got, want, 1e-5, &format!("layer {layer} {opts:?}"))?;
        }
    }
    // Without the switch (or with it false or null) the same file is causal, full window.
    for switch in ["false", "null"] {
        let causal = text.replace(
            "\"use_bidirectional_attention\": true",
            &format!("\"use_bidirectional_attention\": {switch}"),
        );
        assert_ne!(&causal, text);
        let config = HfAttentionConfig::from_json_layer(&causal, 0)?;
        assert!(config.attention.causal);
        assert_eq!(config.attention.sliding_window, Some(4));
    }
    Ok(())
}

/// Gemma and Gemma 2 with `use_bidirectional_attention: true`: their attention sets
/// `is_causal = False` but their models still build a causal mask, so HF's answer depends on
/// the backend (transformers 5.24, a tiny random Gemma: eager is causal, sdpa attends both ways
/// unless a padding mask is given, flash attention both ways; Gemma 2 eager is causal, flash
/// both ways). Both readers refuse such a file, naming the key; false or null reads causal.
#[test]
fn gemma_and_gemma2_bidirectional_is_refused() -> anyhow::Result<()> {
    for model_type in ["gemma", "gemma2"] {
        let file = |switch: &str| {
            format!(
                r#"{{"model_type": "{model_type}", "hidden_size": 16, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 4, "num_hidden_layers": 2,
                "use_bidirectional_attention": {switch}}}"#
            )
        };
        let on = file("true");
        let named = |err: &Error| matches!(err, Error::HfConfig { key, .. } if key == "use_bidirectional_attention");
        // Gemma 2's layers alternate sliding and full attention: each is read on its own.
        for layer in [0, 1] {
            let err = HfAttentionConfig::from_json_layer(&on, layer).unwrap_err();
            assert!(named(&err), "{model_type} layer {layer}: {err}");
            for switch in ["false", "null"] {
                let config = HfAttentionConfig::from_json_layer(&file(switch), layer)?;
                assert!(config.attention.causal, "{model_type} {switch}");
            }
        }
        let err = RopeConfig::from_hf_json(&on).unwrap_err();
        assert!(named(&err), "{model_type} rope: {err}");
        RopeConfig::from_hf_json(&file("false"))?;
    }
    Ok(())
}

device_tests!(gemma3_bidirectional_layers_match_hf);
