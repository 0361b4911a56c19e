//! The whole model's speed (SmolLM2-135M-Instruct from its GGUF file, `examples/llama`):
//! a 512-token prefill and 128 greedy decoding steps, with f32 and bf16 weights, and beside
//! each decoding speed its memory floor.
//!
//! ```sh
//! bash scripts/fetch_smollm2.sh
//! cargo bench --bench generate                 # f32 and bf16
//! cargo bench --bench generate -- f32          # one of them
//! ```
//!
//! The floor: a decoding step reads every weight once (the head's whole matrix, one row of the
//! embeddings), so no step is faster than those bytes over the machine's memory bandwidth. The
//! bandwidth is measured here, before the model is loaded, as the best of several copies of a
//! 256 MiB buffer split over all threads (bytes copied per second: each byte read once and
//! written once), and the floor printed is `bandwidth / bytes of weights per step`.

#[allow(dead_code)]
#[path = "../examples/llama/mod.rs"]
mod llama;

use std::path::Path;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use candle_posenc::hf::gguf::{GgufFile, QkRows};
use llama::model::Llama;
use llama::sample::argmax;
use llama::tokenizer::Tokenizer;
use rayon::prelude::*;

const MODEL: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
);
const PREFILL: usize = 512;
const DECODE: usize = 128;
const REPEATS: usize = 3;

/// Text enough for 512 tokens.
const TEXT: &str = "The history of the printing press begins long before Gutenberg, with carved \
wooden blocks pressed onto cloth and paper across East Asia. Movable type made of baked clay and \
later of metal followed, yet the sheer number of characters kept the method slow. In Europe a \
goldsmith combined an alloy that cast cleanly, an oil-based ink and a screw press borrowed from \
wine makers, and the result spread from one city to the next within a few decades. ";

fn main() -> anyhow::Result<()> {
    if !Path::new(MODEL).exists() {
        println!("generate bench: no model at {MODEL}; run `bash scripts/fetch_smollm2.sh` first");
        return Ok(());
    }
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let bandwidth = copy_bandwidth();
    println!(
        "copy bandwidth: {:.1} GB/s (best of 5 copies of 256 MiB on {} threads)",
        bandwidth / 1e9,
        rayon::current_num_threads()
    );
    let file = GgufFile::open(MODEL)?;
    let tokenizer = Tokenizer::from_gguf(file.metadata())?;
    let ids: Vec<u32> = tokenizer
        .encode(&TEXT.repeat(8))
        .into_iter()
        .take(PREFILL)
        .collect();
    anyhow::ensure!(
        ids.len() == PREFILL,
        "the text gives only {} tokens",
        ids.len()
    );
    for (name, dtype) in [("f32", DType::F32), ("bf16", DType::BF16)] {
        if !filter.is_empty() && !filter.iter().any(|f| f == name) {
            continue;
        }
        let model = Llama::from_gguf(&file, dtype, &Device::Cpu, QkRows::Hf)?;
        let bytes = model.weight_bytes_per_token() as f64;
        let (mut prefill, mut decode) = (Vec::new(), Vec::new());
        for _ in 0..REPEATS {
            let (p, d) = run(&model, &ids)?;
            prefill.push(p);
            decode.push(d);
        }
        let floor = bandwidth / bytes;
        let best = DECODE as f64 / min(&decode);
        println!(
            "{name}: prefill {PREFILL} tokens {:.3} s best, {:.3} s median; decode {best:.1} tokens/s best, {:.1} median; \
             floor {floor:.1} tokens/s ({:.0} MB per step), best at {:.0}% of the floor",
            min(&prefill),
            median(&prefill),
            DECODE as f64 / median(&decode),
            bytes / 1e6,
            100.0 * best / floor,
        );
    }
    Ok(())
}

/// One prefill of `ids` and `DECODE` greedy steps after it: (prefill s, decode s).
fn run(model: &Llama, ids: &[u32]) -> anyhow::Result<(f64, f64)> {
    let dev = Device::Cpu;
    let mut caches = model.caches();
    let start = Instant::now();
    let mut logits = model.forward_last(&Tensor::new(ids, &dev)?.unsqueeze(0)?, &mut caches)?;
    let prefill = start.elapsed().as_secs_f64();
    let start = Instant::now();
    for _ in 0..DECODE {
        let id = argmax(&logits.squeeze(0)?.to_vec1::<f32>()?);
        logits = model.forward_last(&Tensor::new(&[[id]], &dev)?, &mut caches)?;
    }
    Ok((prefill, start.elapsed().as_secs_f64()))
}

/// Bytes copied per second, the best of 5 copies of 256 MiB split over the threads.
fn copy_bandwidth() -> f64 {
    let n = 256 << 20;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    let chunk = n / rayon::current_num_threads().max(1);
    let mut best = f64::MAX;
    for _ in 0..5 {
        let start = Instant::now();
        dst.par_chunks_mut(chunk)
            .zip(src.par_chunks(chunk))
            .for_each(|(d, s)| d.copy_from_slice(s));
        best = best.min(start.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst);
    n as f64 / best
}

fn min(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
