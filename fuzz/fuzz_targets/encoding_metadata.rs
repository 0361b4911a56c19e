//! Fuzzes the checkpoint metadata parsers directly (faster than through safetensors): the input
//! is read as `key=value` lines (the seeds: `posenc.encoding=` and `posenc.attention=` with a
//! configuration's JSON, as checkpoints hold them), and `EncodingConfig::from_metadata` and
//! `AttentionConfig::from_metadata` must give `Ok` or an `Err`, never a panic. A configuration
//! that parses must survive a round trip through `to_metadata`, and, when its tables are small,
//! build and run through attention at a position taken from the input: validated parameter
//! combinations (odd YaRN betas, T5 bucket edges, LongRoPE factors, ...) must not panic either.
//!
//! Run: `cargo +nightly fuzz run encoding_metadata fuzz/corpus/encoding_metadata -- -runs=1000000`
#![no_main]

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_posenc::{
    AttentionConfig, AttentionOptions, EncodingConfig, KvCache, MultiHeadAttention, Positions,
};
use libfuzzer_sys::fuzz_target;

/// Whether building `c` allocates little (the fuzzer's memory limit is 2 GB; the crate's own
/// limits allow tables up to 2^31 elements).
fn small(c: &EncodingConfig) -> Option<(usize, usize)> {
    // (num_heads, head_dim) the attention block must use with it.
    match c {
        EncodingConfig::None => Some((2, 4)),
        EncodingConfig::Sinusoidal(s) => (s.d_model <= 64 && s.max_len <= 4096).then_some((2, 4)),
        EncodingConfig::Learned(l) => {
            let n = match l.interpolation {
                candle_posenc::Interpolation::ToLength(n) => n.max(l.max_len),
                _ => l.max_len,
            };
            (l.d_model <= 64 && n <= 4096).then_some((2, 4))
        }
        EncodingConfig::Alibi(a) => (a.num_heads <= 64).then_some((a.head_count, 4)),
        EncodingConfig::T5(t) => {
            (t.num_heads <= 16 && t.num_buckets <= 4096).then_some((t.num_heads, 4))
        }
        EncodingConfig::ClippedBias(b) => {
            (b.num_heads <= 16 && b.max_distance <= 4096).then_some((b.num_heads, 4))
        }
        EncodingConfig::Shaw(s) => {
            (s.head_dim <= 64 && s.max_distance <= 4096).then_some((2, s.head_dim))
        }
        EncodingConfig::Rotary(r) => {
            (r.head_dim <= 64 && r.max_position <= 4096).then_some((2, r.head_dim))
        }
        EncodingConfig::RopeMixed(m) => {
            (m.num_heads <= 16 && m.head_dim <= 64).then_some((m.num_heads, m.head_dim))
        }
        EncodingConfig::ScaledSinusoidal(s) => {
            (s.d_model <= 64 && s.max_len <= 4096).then_some((2, 4))
        }
        EncodingConfig::Fox(f) => {
            (f.d_model <= 64 && f.num_heads <= 16).then_some((f.num_heads, 4))
        }
    }
}

fn run(c: &EncodingConfig, data: &[u8]) {
    let Some((heads, head_dim)) = small(c) else {
        return;
    };
    let d_model = match c {
        EncodingConfig::Sinusoidal(s) => s.d_model,
        EncodingConfig::Learned(l) => l.d_model,
        EncodingConfig::ScaledSinusoidal(s) => s.d_model,
        EncodingConfig::Fox(f) => f.d_model,
        _ => 8,
    };
    let dev = Device::Cpu;
    let vb = VarBuilder::zeros(DType::F32, &dev);
    let Ok(enc) = c.build(vb.pp("enc")) else {
        return;
    };
    let attn = AttentionConfig::new(d_model, heads)
        .with_head_dim(head_dim)
        .with_causal(true);
    let Ok(mha) = MultiHeadAttention::new(&attn, enc, vb.pp("attn")) else {
        return;
    };
    // A start position from the input's last bytes: tables that grow with it (sinusoidal,
    // RoPE) stay under 2^13 rows so an execution stays fast; relative biases go to 2^20.
    let tail = data
        .iter()
        .rev()
        .take(3)
        .fold(0usize, |a, &b| (a << 8) | b as usize);
    let start = match c {
        EncodingConfig::Sinusoidal(_)
        | EncodingConfig::Learned(_)
        | EncodingConfig::ScaledSinusoidal(_) => tail % 5000,
        EncodingConfig::Rotary(_) => tail % (1 << 13),
        _ => tail % (1 << 20),
    };
    two_chunks(&mha, d_model, start);
}

/// Two chunks of ones (two tokens at `start`, then one) through a KV cache, until one fails.
fn two_chunks(mha: &MultiHeadAttention, d_model: usize, start: usize) {
    let Ok(x) = Tensor::ones((1, 3, d_model), DType::F32, &Device::Cpu) else {
        return;
    };
    let mut cache = KvCache::new();
    for (at, len) in [(start, 2), (start + 2, 1)] {
        let p = Positions::Offset(at);
        let o = AttentionOptions {
            positions: Some(&p),
            ..Default::default()
        };
        let Ok(chunk) = x.narrow(1, 0, len) else {
            return;
        };
        if mha.forward_with(&chunk, &o, Some(&mut cache)).is_err() {
            return;
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let metadata: HashMap<String, String> = text
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let encoding = EncodingConfig::from_metadata(&metadata, "fuzz").ok();
    if let Some(c) = &encoding {
        let again = EncodingConfig::from_metadata(&c.to_metadata(), "fuzz")
            .expect("a parsed configuration round-trips");
        assert_eq!(format!("{again:?}"), format!("{c:?}"));
        run(c, data);
    }
    if let Ok(c) = AttentionConfig::from_metadata(&metadata, "fuzz") {
        let again = AttentionConfig::from_metadata(&c.to_metadata(), "fuzz")
            .expect("a parsed configuration round-trips");
        assert_eq!(again, c);
        run_block(&c, encoding.as_ref(), data);
    }
});

/// The block a checkpoint's two configurations describe (the attention one as parsed, with the
/// encoding when its tables are small), zero weights, over two chunks through a cache: any
/// pairing the parsers accept is built or refused with an error, and runs or fails with one.
fn run_block(attn: &AttentionConfig, encoding: Option<&EncodingConfig>, data: &[u8]) {
    // Bounded work: narrow projections, few heads, a short input.
    let latent_small = attn.latent.as_ref().is_none_or(|l| {
        l.q_lora_rank.unwrap_or(0) <= 256
            && l.kv_lora_rank <= 256
            && l.rope_dim <= 64
            && l.v_head_dim <= 64
    });
    if attn.d_model > 256
        || attn.num_heads > 16
        || attn.head_dim > 64
        || attn.num_heads.saturating_mul(attn.head_dim) > 512
        || !latent_small
    {
        return;
    }
    let dev = Device::Cpu;
    let vb = VarBuilder::zeros(DType::F32, &dev);
    let enc = match encoding {
        Some(c) if small(c).is_some() => match c.build(vb.pp("enc")) {
            Ok(enc) => enc,
            Err(_) => return,
        },
        Some(_) => return,
        None => None,
    };
    let Ok(mha) = MultiHeadAttention::new(attn, enc, vb.pp("attn")) else {
        return;
    };
    two_chunks(&mha, attn.d_model, data.first().map_or(0, |&b| b as usize));
}
