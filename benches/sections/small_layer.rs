//! `--only small`: a small pretrained model's attention layer, SmolLM2-135M's shape (d_model
//! 576, 9 heads, 3 KV heads of 64, RoPE θ 1e5, causal, no biases), built from plain tensors as
//! a loaded checkpoint gives: a 30-token and a 512-token prefill, and one decoding step against
//! 100 and 2048 cached tokens. Beside it, the same layer as candle 0.11 offers it: candle-nn
//! `Linear`s, `candle_nn::rotary_emb::rope` and `candle_nn::attention::flash_attn`, its cache
//! grown by `Tensor::cat` as candle-transformers' models do. The PyTorch side is
//! `pytorch_baseline.py --small`.

use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::attention::{flash_attn, AttnMask};
use candle_nn::{Linear, VarBuilder};
use candle_posenc::{
    AttentionConfig, AttentionOptions, KvCache, MultiHeadAttention, RopeConfig, RotaryEmbedding,
};
use std::collections::HashMap;
use std::sync::Arc;

const D_MODEL: usize = 576;
const HEADS: usize = 9;
const KV_HEADS: usize = 3;
const HEAD_DIM: usize = 64;
const THETA: f64 = 1e5;

/// The layer's four weights, as a checkpoint holds them.
fn weights(dev: &Device) -> Result<HashMap<String, Tensor>> {
    let mut w = HashMap::new();
    for (name, out, inner) in [
        ("q_proj", HEADS * HEAD_DIM, D_MODEL),
        ("k_proj", KV_HEADS * HEAD_DIM, D_MODEL),
        ("v_proj", KV_HEADS * HEAD_DIM, D_MODEL),
        ("o_proj", D_MODEL, HEADS * HEAD_DIM),
    ] {
        let t = Tensor::randn(0f32, 0.04, (out, inner), dev)?;
        w.insert(format!("{name}.weight"), t);
    }
    Ok(w)
}

/// The layer as candle 0.11 offers it.
struct CandleLayer {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    cos: Tensor,
    sin: Tensor,
}

impl CandleLayer {
    fn new(w: &HashMap<String, Tensor>, max_len: usize, dev: &Device) -> Result<Self> {
        let linear = |name: &str| Linear::new(w[&format!("{name}.weight")].clone(), None);
        let inv: Vec<f32> = (0..HEAD_DIM / 2)
            .map(|i| 1.0 / THETA.powf(2.0 * i as f64 / HEAD_DIM as f64) as f32)
            .collect();
        let inv = Tensor::from_vec(inv, (1, HEAD_DIM / 2), dev)?;
        let t = Tensor::arange(0u32, max_len as u32, dev)?
            .to_dtype(DType::F32)?
            .reshape((max_len, 1))?;
        let angles = t.matmul(&inv)?;
        Ok(Self {
            q: linear("q_proj"),
            k: linear("k_proj"),
            v: linear("v_proj"),
            o: linear("o_proj"),
            cos: angles.cos()?,
            sin: angles.sin()?,
        })
    }

    /// One call of `x` `(1, T, d_model)` after `cache` (keys and values `(1, Hkv, L, D)`),
    /// returning the output and the cache with the call's keys and values.
    fn forward(
        &self,
        x: &Tensor,
        cache: Option<&(Tensor, Tensor)>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (b, t, _) = x.dims3()?;
        let offset = cache.map_or(Ok(0), |(k, _)| k.dim(2))?;
        let heads = |l: &Linear, h: usize| -> Result<Tensor> {
            Ok(l.forward(x)?
                .reshape((b, t, h, HEAD_DIM))?
                .transpose(1, 2)?
                .contiguous()?)
        };
        let (cos, sin) = (
            self.cos.narrow(0, offset, t)?,
            self.sin.narrow(0, offset, t)?,
        );
        let q = candle_nn::rotary_emb::rope(&heads(&self.q, HEADS)?, &cos, &sin)?;
        let k = candle_nn::rotary_emb::rope(&heads(&self.k, KV_HEADS)?, &cos, &sin)?;
        let v = heads(&self.v, KV_HEADS)?;
        let (k, v) = match cache {
            Some((ck, cv)) => (Tensor::cat(&[ck, &k], 2)?, Tensor::cat(&[cv, &v], 2)?),
            None => (k, v),
        };
        // flash_attn takes (B, S, H, D).
        let out = flash_attn::<f32>(
            &q.transpose(1, 2)?.contiguous()?,
            &k.transpose(1, 2)?.contiguous()?,
            &v.transpose(1, 2)?.contiguous()?,
            1.0 / (HEAD_DIM as f32).sqrt(),
            AttnMask::causal_with_offset(offset),
            None,
            None,
        )?;
        let out = out.transpose(1, 2)?.reshape((b, t, HEADS * HEAD_DIM))?;
        Ok((self.o.forward(&out)?, k, v))
    }
}

/// Runs the section: medians of `runs` × 5 calls per prefill and `runs` × 25 decoding steps,
/// the crate's layer timed alone, then candle's (alternating them in one loop lets each evict
/// the other's weights and cache from the CPU's caches, which neither user's process does).
pub fn run(json: bool, runs: usize) -> Result<()> {
    let dev = Device::Cpu;
    let w = weights(&dev)?;
    let vb = VarBuilder::from_tensors(w.clone(), DType::F32, &dev);
    let rope = RotaryEmbedding::new(&RopeConfig::new(HEAD_DIM).with_base(THETA), &dev)?;
    let cfg = AttentionConfig::new(D_MODEL, HEADS)
        .with_kv_heads(KV_HEADS)
        .with_causal(true);
    let ours = MultiHeadAttention::new(&cfg, Some(Arc::new(rope)), vb)?;
    let candle = CandleLayer::new(&w, 4096, &dev)?;
    println!(
        "\na small model's layer (SmolLM2-135M: d_model {D_MODEL}, {HEADS} heads, {KV_HEADS} KV heads, RoPE θ 1e5), causal, B1, plain weights:"
    );
    println!(
        "{:<26} {:>12} {:>12} {:>10}",
        "case", "crate ms", "candle ms", "candle/crate"
    );
    let opts = AttentionOptions::default();
    for t in [30, 512] {
        let x = Tensor::randn(0f32, 1.0, (1, t, D_MODEL), &dev)?;
        let a = crate::common::median_ms(runs * 5, || {
            ours.forward(&x)?;
            Ok(())
        })?;
        let b = crate::common::median_ms(runs * 5, || {
            candle.forward(&x, None)?;
            Ok(())
        })?;
        report(json, &format!("prefill {t}"), (a, b));
    }
    for len in [100, 2048] {
        let prefix = Tensor::randn(0f32, 1.0, (1, len, D_MODEL), &dev)?;
        let token = Tensor::randn(0f32, 1.0, (1, 1, D_MODEL), &dev)?;
        let mut cache = KvCache::with_capacity(len + 1);
        ours.forward_with(&prefix, &opts, Some(&mut cache))?;
        let (_, ck, cv) = candle.forward(&prefix, None)?;
        let held = (ck, cv);
        let a = crate::common::median_ms(runs * 25, || {
            let y = ours.forward_with(&token, &opts, Some(&mut cache))?;
            drop(y);
            Ok(cache.truncate(len)?)
        })?;
        let b = crate::common::median_ms(runs * 25, || {
            candle.forward(&token, Some(&held))?;
            Ok(())
        })?;
        report(json, &format!("decode at {len}"), (a, b));
    }
    Ok(())
}

fn report(json: bool, case: &str, (ours, candle): (f64, f64)) {
    let ratio = candle / ours;
    println!("{case:<26} {ours:>12.3} {candle:>12.3} {ratio:>9.2}x");
    if json {
        println!(
            "{{\"bench\":\"small_layer\",\"case\":\"{case}\",\"median_ms\":{ours:.4},\"candle_ms\":{candle:.4},\"candle_ratio\":{ratio:.4}}}"
        );
    }
}
