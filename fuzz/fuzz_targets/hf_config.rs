//! Fuzzes the HF `config.json` parsers: any bytes, as text, must give `Ok` or an `Err`, never a
//! panic, from the RoPE reader and from the attention layer reader (whole model and layers at
//! the ends of the index range). Small configurations that parse are then built and used once,
//! so the scaling functions see the parsed values too.
//!
//! Run: `cargo +nightly fuzz run hf_config fuzz/corpus/hf_config -- -runs=1000000`
#![no_main]

use candle_core::{Device, Tensor};
use candle_posenc::hf::HfAttentionConfig;
use candle_posenc::{Positions, QkLayout, RopeConfig, RotaryEmbedding};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = HfAttentionConfig::from_json(text);
    for layer in [0, 1, 3, usize::MAX] {
        if let Ok(layer) = HfAttentionConfig::from_json_layer(text, layer) {
            // What parses is a configuration the block accepts or refuses with a typed error.
            let _ = layer.attention.validate();
            let _ = layer.encoding.validate();
        }
    }
    let Ok(config) = RopeConfig::from_hf_json(text) else {
        return;
    };
    // Bounded work: a narrow head, a short initial table.
    if config.head_dim > 256 {
        return;
    }
    let max_position = config.max_position.min(64);
    let config = config.with_max_position(max_position);
    let dev = Device::Cpu;
    let Ok(rope) = RotaryEmbedding::new(&config, &dev) else {
        return;
    };
    let end = data.len() * 7;
    let _ = rope.frequencies(end);
    let q = Tensor::ones((1, 1, 2, config.head_dim), candle_core::DType::F32, &dev).unwrap();
    let _ = rope.rotate_queries(&q, &Positions::Offset(end), QkLayout::Bhtd);
});
