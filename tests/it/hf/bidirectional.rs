//! Gemma 3 with `use_bidirectional_attention` (EmbeddingGemma's setting) read from its
//! `config.json`, against HF's own model (`generate.py hf_bidirectional`): the full layer sees
//! every token, the sliding layer every token within `sliding_window / 2` on either side.

use crate::common;

use candle_core::{DType, Device};
use candle_posenc::attention::AttentionOptions;
use candle_posenc::checkpoint::Checkpoint;
use candle_posenc::hf::HfAttentionConfig;
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

device_tests!(gemma3_bidirectional_layers_match_hf);
