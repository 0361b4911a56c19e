//! A model's attention layer from its `config.json` and safetensors under HF's names, then
//! decoding with a KV cache and branching the cache for beam search.
//!
//! ```sh
//! # A tiny Qwen3 layer (q/k norms, GQA) from the repository's test fixtures:
//! cargo run --release --example hf_layer
//! # Any supported model: its config.json, one safetensors file, and the layer's prefix.
//! cargo run --release --example hf_layer -- config.json model.safetensors model.layers.0.self_attn
//! ```
//!
//! Each branch of the cache continues on its own: decoding two different tokens after the same
//! prompt gives, for each, what one forward pass over its whole sequence gives.

use anyhow::{bail, Context};
use candle_core::{DType, Device, Module, Tensor};
use candle_posenc::attention::{AttentionOptions, KvCache};
use candle_posenc::checkpoint::Checkpoint;
use candle_posenc::hf::HfAttentionConfig;

fn main() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (config, file, prefix) = match args.as_slice() {
        [] => {
            let path = concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tests/fixtures/hf_layers.safetensors"
            );
            let file = Checkpoint::load(path, &dev)
                .context("the default layer comes from the repository's test fixtures")?;
            let config = HfAttentionConfig::from_json(&file.metadata()["qwen3"])?;
            let prefix = format!("qwen3/{}", file.metadata()["qwen3.prefix"]);
            (config, file, prefix)
        }
        [config, weights, prefix] => (
            HfAttentionConfig::from_file(config)?,
            Checkpoint::load(weights, &dev)?,
            prefix.clone(),
        ),
        _ => bail!("usage: hf_layer [CONFIG.json WEIGHTS.safetensors PREFIX]"),
    };
    let layer = config.load(file.var_builder(DType::F32, &dev).pp(&prefix))?;
    let a = layer.config();
    println!(
        "{:?} layer `{prefix}`: d_model {}, {} heads, {} KV heads of {}, biases q/k/v {} o {}, q/k norm {:?}, encoding {}",
        config.family,
        a.d_model,
        a.num_heads,
        a.num_kv_heads,
        a.head_dim,
        a.bias,
        a.out_bias,
        a.qk_norm.map(|n| n.scope),
        config.encoding.kind(),
    );

    // A prompt of 5 tokens, then two branches of 3 tokens each.
    let hidden = |t: usize, seed: f32| -> candle_core::Result<Tensor> {
        let n = t * a.d_model;
        Tensor::arange(0u32, n as u32, &dev)?
            .to_dtype(DType::F32)?
            .affine(0.731, seed as f64)?
            .sin()?
            .reshape((1, t, a.d_model))
    };
    let prompt = hidden(5, 0.0)?;
    let branches = [hidden(3, 1.0)?, hidden(3, 2.0)?];
    let opts = AttentionOptions::default();
    let mut cache = KvCache::new();
    layer.forward_with(&prompt, &opts, Some(&mut cache))?;
    for (i, branch) in branches.iter().enumerate() {
        // A clone is the branch's own cache: appending to it leaves `cache` as it was.
        let mut beam = cache.clone();
        let mut steps = Vec::new();
        for t in 0..3 {
            let token = branch.narrow(1, t, 1)?;
            steps.push(layer.forward_with(&token, &opts, Some(&mut beam))?.output);
        }
        let decoded = Tensor::cat(&steps, 1)?;
        let whole = layer
            .forward(&Tensor::cat(&[&prompt, branch], 1)?)?
            .narrow(1, 5, 3)?;
        let diff = (decoded - whole)?.abs()?.max_all()?.to_scalar::<f32>()?;
        println!(
            "branch {i}: cache of {} tokens, decoded vs one pass: max |diff| = {diff:.1e}",
            beam.len()
        );
        if diff > 1e-4 {
            bail!("branch {i} decoded differently from one pass ({diff:e})");
        }
    }
    println!(
        "the prompt's cache still holds {} tokens after both branches",
        cache.len()
    );
    Ok(())
}
