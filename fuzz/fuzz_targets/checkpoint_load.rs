//! Fuzzes the checkpoint loader: arbitrary bytes parsed as a safetensors checkpoint must give
//! `Ok` or an `Err`, never a panic or an abort. What loads is then read the way a caller would:
//! its metadata parsed as encoding and attention configurations, modules built from its tensors
//! (and run through attention once), and its tensors copied into a `VarMap` (which must be untouched when that fails).
//!
//! Run: `cargo +nightly fuzz run checkpoint_load fuzz/corpus/checkpoint_load -- -runs=1000000`
#![no_main]

use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;
use candle_posenc::{AttentionConfig, Checkpoint, EncodingConfig, MultiHeadAttention};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dev = Device::Cpu;
    let Ok(ck) = Checkpoint::from_bytes(data, &dev) else {
        return;
    };
    let attention = AttentionConfig::from_metadata(ck.metadata(), "fuzz");
    if let Ok(config) = EncodingConfig::from_metadata(ck.metadata(), "fuzz") {
        // Tables that are computed rather than loaded (sinusoidal, RoPE, ALiBi) may be up to
        // limits::MAX_ELEMENTS large by design; only modules whose tensors come from the file
        // are built here, so every allocation stays bounded by the input.
        if matches!(
            config,
            EncodingConfig::None
                | EncodingConfig::Learned(_)
                | EncodingConfig::T5(_)
                | EncodingConfig::ClippedBias(_)
                | EncodingConfig::Shaw(_)
                | EncodingConfig::RopeMixed(_)
        ) {
            let vb = ck.var_builder(DType::F32, &dev);
            if let (Ok(enc), Ok(att)) = (config.build(vb.clone()), attention) {
                // Projections come from the file too (bounded by it); run one short chunk.
                if let Ok(mha) = MultiHeadAttention::new(&att, enc, vb) {
                    if let Ok(x) = Tensor::ones((1, 2, att.d_model), DType::F32, &dev) {
                        let _ = mha.forward_with(&x, &Default::default(), None);
                    }
                }
            }
        }
    }
    for (name, t) in ck.tensors() {
        let _ = ck.get(name, t.dims());
    }
    // load_into either copies every variable or changes none.
    let varmap = VarMap::new();
    let _ = varmap.get(
        (2, 3),
        "weight",
        candle_nn::Init::Const(7.0),
        DType::F32,
        &dev,
    );
    if ck.load_into(&varmap).is_err() {
        let data = varmap.data().lock().unwrap();
        let w = data["weight"].as_tensor().flatten_all().unwrap();
        assert!(w.to_vec1::<f32>().unwrap().iter().all(|&v| v == 7.0));
    }
});
