//! Settings that differ between two rows of the registry of one family.

use candle_posenc::{EncodingConfig, HfAttentionConfig, RopeLayout};

/// The pair layout of a DeepSeek file with `rope_interleave` as given.
fn deepseek_layout(model_type: &str, interleave: bool) -> anyhow::Result<RopeLayout> {
    let json = format!(
        r#"{{"model_type": "{model_type}", "hidden_size": 32, "num_attention_heads": 4,
            "num_key_value_heads": 4, "q_lora_rank": null, "kv_lora_rank": 8,
            "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
            "rope_interleave": {interleave}}}"#
    );
    match HfAttentionConfig::from_json(&json)?.encoding {
        EncodingConfig::Rotary(rope) => Ok(rope.layout),
        other => anyhow::bail!("{model_type}: {other:?}"),
    }
}

#[test]
fn deepseek_v2_always_interleaves_and_v3_as_the_file_says() -> anyhow::Result<()> {
    // DeepseekV2's rotation always takes adjacent pairs; V3's reads rope_interleave.
    assert_eq!(
        deepseek_layout("deepseek_v2", false)?,
        RopeLayout::Interleaved
    );
    assert_eq!(
        deepseek_layout("deepseek_v2", true)?,
        RopeLayout::Interleaved
    );
    assert_eq!(
        deepseek_layout("deepseek_v3", true)?,
        RopeLayout::Interleaved
    );
    assert_eq!(deepseek_layout("deepseek_v3", false)?, RopeLayout::Half);
    Ok(())
}
