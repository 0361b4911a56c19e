//! Every module can be shared across threads, cloned and printed.

use candle_posenc::{
    Alibi, ClippedRelativeBias, KvCache, LearnedPositionalEncoding, MultiHeadAttention, RopeConfig,
    RotaryEmbedding, ShawRelativePosition, SinusoidalPositionalEncoding, T5RelativeBias,
};

fn assert_module<T: std::fmt::Debug + Clone + Send + Sync + 'static>() {}

#[test]
fn modules_are_debug_clone_send_sync() {
    assert_module::<SinusoidalPositionalEncoding>();
    assert_module::<LearnedPositionalEncoding>();
    assert_module::<Alibi>();
    assert_module::<T5RelativeBias>();
    assert_module::<ClippedRelativeBias>();
    assert_module::<ShawRelativePosition>();
    assert_module::<MultiHeadAttention>();
    assert_module::<KvCache>();
    assert_module::<RotaryEmbedding>();
    assert_module::<RopeConfig>();
}
