//! Why order matters: self-attention with and without positional encodings.
//!
//! Run with no arguments (CPU, a few seconds):
//!
//! ```text
//! cargo run --release --example attention_demo
//! cargo run --release --example attention_demo -- --device cuda   # built with --features cuda
//! ```
//!
//! It loads a tiny attention layer and token embeddings from `weights/attention_demo.safetensors`
//! (the file says which encodings it holds), feeds it "the dog bites the man" and "the man bites
//! the dog", and shows that without positional information each word gets the same output in
//! both sentences (attention is permutation-equivariant), while every positional encoding tells
//! them apart. It prints one attention map and checks that a checkpoint saved to `weights/` loads
//! back bit for bit. `--write-weights` regenerates the weights file deterministically.
//!
//! Then it loads the pretrained character-level language models of the extrapolation experiment
//! (`weights/extrapolation_*.safetensors`, written by `examples/extrapolation.rs`; each file
//! says which encoding, model and alphabet it holds) and prints their held-out loss at the
//! training length L and at 4L and 16L: scored live on a held-out sample of the plays when the
//! corpus has been fetched (`scripts/fetch_shakespeare.sh`), else as each checkpoint recorded
//! it (on the CPU, whatever `--device` says).

#[allow(dead_code)]
mod lm;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, IndexOp, Tensor};
use candle_nn::{Embedding, Module};
use candle_posenc::checkpoint::save;
use candle_posenc::{
    AlibiConfig, AlibiMode, AttentionConfig, AttentionOptions, Checkpoint, ClippedBiasConfig,
    EncodingConfig, LearnedConfig, MultiHeadAttention, PositionalEncoding, RopeConfig, ShawConfig,
    SinusoidalConfig, T5Config,
};

const VOCAB: [&str; 4] = ["the", "dog", "bites", "man"];
const D_MODEL: usize = 16;
const HEADS: usize = 2;
const WEIGHTS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/weights/attention_demo.safetensors"
);

fn device_from_args(args: &[String]) -> Result<Device> {
    let name = match args.iter().position(|a| a == "--device") {
        Some(i) => args
            .get(i + 1)
            .map(String::as_str)
            .context("--device needs a value: cpu, cuda or metal")?,
        None => "cpu",
    };
    match name {
        "cpu" => Ok(Device::Cpu),
        "cuda" if candle_core::utils::cuda_is_available() => Ok(Device::new_cuda(0)?),
        "cuda" => bail!("this build has no CUDA support: rebuild with `--features cuda`"),
        "metal" if candle_core::utils::metal_is_available() => Ok(Device::new_metal(0)?),
        "metal" => bail!("this build has no Metal support: rebuild with `--features metal`"),
        other => bail!("unknown device `{other}`: expected cpu, cuda or metal"),
    }
}

/// Deterministic normal draws (xorshift + Box-Muller), so the weights file is reproducible.
fn normal(n: usize, std: f32, seed: &mut u64) -> Vec<f32> {
    let mut uniform = || {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        ((*seed >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    (0..n)
        .map(|_| {
            let (u1, u2) = (uniform(), uniform());
            ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32 * std
        })
        .collect()
}

fn encodings() -> Vec<(&'static str, EncodingConfig)> {
    vec![
        ("none", EncodingConfig::None),
        (
            "sinusoidal",
            EncodingConfig::Sinusoidal(SinusoidalConfig::new(D_MODEL).with_max_len(64)),
        ),
        (
            "learned",
            EncodingConfig::Learned(LearnedConfig::new(D_MODEL).with_max_len(8)),
        ),
        (
            "rope",
            EncodingConfig::Rotary(RopeConfig::new(D_MODEL / HEADS)),
        ),
        (
            "alibi",
            EncodingConfig::Alibi(AlibiConfig::new(HEADS).with_mode(AlibiMode::Symmetric)),
        ),
        ("t5", EncodingConfig::T5(T5Config::new(HEADS))),
        (
            "clipped_bias",
            EncodingConfig::ClippedBias(ClippedBiasConfig::new(HEADS, 3)),
        ),
        (
            "shaw",
            EncodingConfig::Shaw(ShawConfig::new(D_MODEL / HEADS, 2)),
        ),
    ]
}

fn write_weights(device: &Device) -> Result<()> {
    let mut seed = 0x5eed_u64;
    let mut t = HashMap::new();
    let mut put = |name: &str, shape: &[usize], std: f32| -> Result<()> {
        let n = shape.iter().product();
        t.insert(
            name.to_string(),
            Tensor::from_vec(normal(n, std, &mut seed), shape, device)?,
        );
        Ok(())
    };
    put("embed.weight", &[VOCAB.len(), D_MODEL], 1.0)?;
    for p in ["q_proj", "k_proj", "v_proj", "o_proj"] {
        put(&format!("attn.{p}.weight"), &[D_MODEL, D_MODEL], 0.35)?;
    }
    put("learned.weight", &[8, D_MODEL], 0.5)?;
    put("t5.relative_attention_bias.weight", &[32, HEADS], 1.0)?;
    put("clipped_bias.bias_table.weight", &[7, HEADS], 1.0)?;
    put("shaw.relative_keys.weight", &[5, D_MODEL / HEADS], 0.5)?;
    put("shaw.relative_values.weight", &[5, D_MODEL / HEADS], 0.5)?;
    let mut meta = AttentionConfig::new(D_MODEL, HEADS).to_metadata();
    meta.insert("demo.vocab".into(), VOCAB.join(" "));
    for (name, enc) in encodings() {
        for (k, v) in enc.to_metadata() {
            meta.insert(format!("{name}.{k}"), v);
        }
    }
    save(WEIGHTS, &t, &meta)?;
    println!("wrote {WEIGHTS}");
    Ok(())
}

/// The encoding stored under `name.posenc.encoding` in the checkpoint's metadata.
fn encoding_of(ckpt: &Checkpoint, name: &str) -> Result<EncodingConfig> {
    let prefix = format!("{name}.");
    let meta: HashMap<String, String> = ckpt
        .metadata()
        .iter()
        .filter_map(|(k, v)| k.strip_prefix(&prefix).map(|k| (k.to_string(), v.clone())))
        .collect();
    Ok(EncodingConfig::from_metadata(&meta, ckpt.source())?)
}

fn tokens(sentence: &str, device: &Device) -> Result<Tensor> {
    let ids = sentence
        .split(' ')
        .map(|w| {
            VOCAB
                .iter()
                .position(|v| *v == w)
                .map(|i| i as u32)
                .context("unknown word")
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Tensor::new(ids.as_slice(), device)?.unsqueeze(0)?)
}

fn print_weights(words: &[&str], weights: &Tensor) -> Result<()> {
    // Average over heads: (T, T).
    let w = weights.i(0)?.mean(0)?.to_vec2::<f32>()?;
    print!("{:>8}", "");
    for k in words {
        print!("{k:>7}");
    }
    println!();
    for (q, row) in words.iter().zip(&w) {
        print!("{q:>8}");
        for p in row {
            print!("{p:>7.3}");
        }
        println!();
    }
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let device = device_from_args(&args)?;
    if args.iter().any(|a| a == "--write-weights") {
        return write_weights(&device);
    }
    let ckpt = Checkpoint::load(WEIGHTS, &device).with_context(|| format!("loading {WEIGHTS}"))?;
    let vb = ckpt.var_builder(DType::F32, &device);
    let attn_cfg = AttentionConfig::from_metadata(ckpt.metadata(), ckpt.source())?;
    let embed = Embedding::new(
        ckpt.get("embed.weight", &[VOCAB.len(), D_MODEL])?.clone(),
        D_MODEL,
    );

    let (a, b) = ("the dog bites the man", "the man bites the dog");
    // B is A with positions 1 and 4 swapped.
    let swap = Tensor::new(&[0u32, 4, 2, 3, 1], &device)?;
    let xa = embed.forward(&tokens(a, &device)?)?;
    let xb = embed.forward(&tokens(b, &device)?)?;

    println!("A = \"{a}\"\nB = \"{b}\"\n");
    println!("Self-attention output of each word in A vs the same word in B (max |difference|):\n");
    println!(
        "{:<12} {:>10} {:>10} {:>10}   verdict",
        "encoding", "'dog'", "'man'", "'bites'"
    );
    let mut blocks = Vec::new();
    for (name, _) in encodings() {
        let enc_cfg = encoding_of(&ckpt, name)?;
        let enc: Option<Arc<dyn PositionalEncoding>> = enc_cfg.build(vb.pp(name))?;
        let mha = MultiHeadAttention::new(&attn_cfg, enc, vb.pp("attn"))?;
        let ya = mha.forward(&xa)?;
        // Put B's outputs back in A's word order and compare word by word.
        let yb = mha.forward(&xb)?.index_select(&swap, 1)?;
        let diff = (ya - yb)?.abs()?.max(2)?.i(0)?.to_vec1::<f32>()?;
        let verdict = if diff.iter().all(|d| *d < 1e-5) {
            "same: order is invisible"
        } else {
            "different: order is seen"
        };
        println!(
            "{name:<13} {:>10.2e} {:>10.2e} {:>10.2e}   {verdict}",
            diff[1], diff[4], diff[2]
        );
        blocks.push((name, mha));
    }

    let words: Vec<&str> = a.split(' ').collect();
    for (name, mha) in &blocks {
        if *name == "t5" || *name == "none" {
            let out = mha.forward_with(
                &xa,
                &AttentionOptions {
                    return_weights: true,
                    ..Default::default()
                },
                None,
            )?;
            println!("\nAttention weights for A with encoding `{name}` (mean over heads; rows: queries):");
            print_weights(&words, out.weights.as_ref().context("weights")?)?;
        }
    }
    println!("\n(Without an encoding both 'the' rows are identical: the two 'the's cannot be told apart.)");

    // Checkpoint round trip through weights/.
    let copy = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/weights/attention_demo.roundtrip.safetensors"
    );
    save(copy, ckpt.tensors(), ckpt.metadata())?;
    let back = Checkpoint::load(copy, &device)?;
    let mut worst = 0f32;
    for (name, t) in ckpt.tensors() {
        let u = back.get(name, t.dims())?;
        worst = worst.max((t - u)?.abs()?.max_all()?.to_scalar::<f32>()?);
    }
    println!(
        "\nCheckpoint round trip: saved {} tensors and {} metadata entries to {copy}, reloaded, max |diff| = {worst}",
        ckpt.tensors().len(),
        ckpt.metadata().len()
    );
    pretrained_table()
}

/// Held-out characters the demo scores per length (a sample after the experiment's own).
const DEMO_CHARACTERS: usize = 4096;
/// Where the demo's sample starts in the held-out text.
const DEMO_OFFSET: usize = 1 << 16;

/// The extrapolation experiment's pretrained character-level models: each scored live on a
/// held-out sample of the plays when the corpus has been fetched, and otherwise the scores
/// each checkpoint recorded on the held-out plays when it was trained.
fn pretrained_table() -> Result<()> {
    use lm::text::Corpus;
    use lm::text_eval::{evaluate_text, TextEval};
    use lm::text_report::load_text;
    use lm::train::{checkpoint_name, text_variants, Settings};
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let corpus_dir = root.join("data/shakespeare");
    let corpus = if corpus_dir.is_dir() {
        Some(Corpus::load(&corpus_dir)?)
    } else {
        None
    };
    let started = std::time::Instant::now();
    let mut table = String::new();
    for variant in text_variants(&Settings::standard()) {
        if variant.train != variant.eval {
            continue; // evaluated from another row's weights; no checkpoint of its own
        }
        let path = root.join("weights").join(checkpoint_name(variant.label));
        if !path.exists() {
            println!(
                "(no {}: `cargo run --release --example extrapolation` writes it)",
                path.display()
            );
            continue;
        }
        let loaded = load_text(&path).with_context(|| format!("loading {}", path.display()))?;
        let l = loaded.train_len;
        let multiples = [1, 4, 16];
        let scores: Vec<Option<f64>> = match &corpus {
            Some(c) if c.alphabet == loaded.alphabet => {
                let e = TextEval {
                    train_len: l,
                    multiples: multiples.to_vec(),
                    tokens: DEMO_CHARACTERS,
                    slide_tokens: (l / 2).max(1),
                    batch_tokens: 8192,
                };
                let sample = c.held_out.get(DEMO_OFFSET..).unwrap_or(&c.held_out);
                evaluate_text(&loaded.lm, sample, &e, &indicatif::ProgressBar::hidden())?.windows
            }
            _ => multiples
                .iter()
                .map(|m| loaded.recorded("windows", m * l))
                .collect::<Result<_>>()?,
        };
        if table.is_empty() {
            table = format!(
                "| encoding | {l} (L) | {} (4L) | {} (16L) |\n|---|---|---|---|\n",
                4 * l,
                16 * l
            );
        }
        let cells: Vec<String> = scores
            .iter()
            .map(|s| s.map_or_else(|| "n/a".to_string(), |v| format!("{v:.3}")))
            .collect();
        table.push_str(&format!("| {} | {} |\n", loaded.label, cells.join(" | ")));
    }
    if table.is_empty() {
        return Ok(());
    }
    match corpus {
        Some(_) => println!(
            "\nPretrained character-level models (weights/extrapolation_*.safetensors), trained on\n\
             Shakespeare at length L, scored now on {DEMO_CHARACTERS} held-out characters per length\n\
             (non-overlapping windows; loss in nats per character):\n"
        ),
        None => println!(
            "\nPretrained character-level models (weights/extrapolation_*.safetensors), trained on\n\
             Shakespeare at length L: the held-out loss (nats per character, non-overlapping windows)\n\
             each recorded when it was trained. `bash scripts/fetch_shakespeare.sh` fetches the\n\
             corpus, and the demo then scores a held-out sample itself:\n"
        ),
    }
    print!("{table}");
    println!("({:.1} s)", started.elapsed().as_secs_f64());
    Ok(())
}
