//! The whole-model example on a tiny random Llama written as GGUF the way llama.cpp's
//! converter writes one (`tests/fixtures/tiny_llama.gguf`: Q4_1 attention with q and k rows
//! permuted, Q8_0 embeddings and MLP), against HF transformers' own GGUF loading of that file
//! (`tiny_llama.safetensors`): logits, greedy ids, decoding with the caches, both orders of
//! the q/k rows (and the wrong rotation, which must not pass), and the tokenizer.

#[allow(dead_code)]
#[path = "../../../examples/llama/mod.rs"]
mod llama;

use std::sync::Arc;

use candle_core::{DType, Device, IndexOp, Tensor};
use candle_posenc::checkpoint::Checkpoint;
use candle_posenc::hf::gguf::{unpermute_qk, GgufFile, QkRows};
use candle_posenc::hf::HfAttentionConfig;
use candle_posenc::{EncodingConfig, RopeLayout};
use llama::model::Llama;
use llama::sample::argmax;
use llama::tokenizer::Tokenizer;

const GGUF: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/tiny_llama.gguf"
);
const REFERENCE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/tiny_llama.safetensors"
);

fn reference() -> anyhow::Result<Checkpoint> {
    Ok(Checkpoint::load(REFERENCE, &Device::Cpu)?)
}

fn get<'a>(reference: &'a Checkpoint, name: &str) -> anyhow::Result<&'a Tensor> {
    reference
        .tensors()
        .get(name)
        .ok_or_else(|| anyhow::anyhow!("{REFERENCE} has no `{name}`"))
}

fn ids(t: &Tensor) -> anyhow::Result<Vec<u32>> {
    Ok(t.flatten_all()?
        .to_vec1::<i64>()?
        .into_iter()
        .map(|i| i as u32)
        .collect())
}

fn max_diff(a: &Tensor, b: &Tensor) -> anyhow::Result<f32> {
    Ok((a - b)?.abs()?.max_all()?.to_scalar::<f32>()?)
}

/// The prompt's logits (T, vocab) from one forward pass of the model loaded with `rows`.
fn prompt_logits(rows: QkRows) -> anyhow::Result<Tensor> {
    let dev = Device::Cpu;
    let model = Llama::from_gguf(&GgufFile::open(GGUF)?, DType::F32, &dev, rows)?;
    let prompt = ids(get(&reference()?, "prompt")?)?;
    let input = Tensor::new(prompt.as_slice(), &dev)?.unsqueeze(0)?;
    Ok(model.forward(&input, &mut model.caches())?.squeeze(0)?)
}

#[test]
fn config_json_reads_as_hf_reads_the_file() -> anyhow::Result<()> {
    let file = GgufFile::open(GGUF)?;
    let json: serde_json::Value = serde_json::from_str(&file.config_json()?)?;
    for (key, want) in [
        ("model_type", serde_json::json!("llama")),
        ("hidden_size", 64.into()),
        ("num_hidden_layers", 2.into()),
        ("intermediate_size", 128.into()),
        ("num_attention_heads", 4.into()),
        ("num_key_value_heads", 2.into()),
        ("head_dim", 16.into()),
        ("rope_theta", 100000.0.into()),
        ("max_position_embeddings", 256.into()),
        // The f32 the file holds, widened, as HF's loading reads it.
        ("rms_norm_eps", f64::from(1e-5f32).into()),
        ("vocab_size", 320.into()),
        ("tie_word_embeddings", true.into()),
    ] {
        assert_eq!(json[key], want, "{key}");
    }
    let attention = HfAttentionConfig::from_json(&file.config_json()?)?;
    let EncodingConfig::Rotary(rope) = attention.encoding else {
        anyhow::bail!("a Llama rotates: {:?}", attention.encoding);
    };
    assert_eq!((rope.base, rope.layout), (100000.0, RopeLayout::Half));
    Ok(())
}

#[test]
fn logits_and_greedy_ids_match_hf_loading_the_same_file() -> anyhow::Result<()> {
    let reference = reference()?;
    let logits = prompt_logits(QkRows::Hf)?;
    let diff = max_diff(&logits, get(&reference, "logits")?)?;
    assert!(diff <= 1e-4, "logits differ from HF's by {diff:e}");

    let dev = Device::Cpu;
    let model = Llama::from_gguf(&GgufFile::open(GGUF)?, DType::F32, &dev, QkRows::Hf)?;
    let mut caches = model.caches();
    let prompt = ids(get(&reference, "prompt")?)?;
    let mut next = model.forward_last(
        &Tensor::new(prompt.as_slice(), &dev)?.unsqueeze(0)?,
        &mut caches,
    )?;
    let mut greedy = Vec::new();
    for _ in 0..ids(get(&reference, "greedy")?)?.len() {
        let id = argmax(&next.squeeze(0)?.to_vec1::<f32>()?);
        greedy.push(id);
        next = model.forward_last(&Tensor::new(&[[id]], &dev)?, &mut caches)?;
    }
    assert_eq!(greedy, ids(get(&reference, "greedy")?)?);
    Ok(())
}

#[test]
fn decoding_token_by_token_equals_one_forward() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let model = Llama::from_gguf(&GgufFile::open(GGUF)?, DType::F32, &dev, QkRows::Hf)?;
    let prompt = ids(get(&reference()?, "prompt")?)?;
    let input = Tensor::new(prompt.as_slice(), &dev)?.unsqueeze(0)?;
    let whole = model.forward(&input, &mut model.caches())?;
    // The first 5 tokens at once, then one at a time.
    let mut caches = model.caches();
    let mut steps = vec![model.forward(&input.narrow(1, 0, 5)?, &mut caches)?];
    for t in 5..prompt.len() {
        steps.push(model.forward(&input.narrow(1, t, 1)?, &mut caches)?);
    }
    let decoded = Tensor::cat(&steps, 1)?;
    let diff = max_diff(&decoded, &whole)?;
    assert!(diff <= 1e-4, "decoding differs from one pass by {diff:e}");
    assert!(caches.iter().all(|c| c.len() == prompt.len()));
    Ok(())
}

#[test]
fn stored_rows_rotated_interleaved_match_and_rotated_by_halves_do_not() -> anyhow::Result<()> {
    let reference = reference()?;
    let hf = get(&reference, "logits")?;
    // llama.cpp's order with llama.cpp's rotation: the same model.
    let stored = prompt_logits(QkRows::Stored)?;
    let diff = max_diff(&stored, hf)?;
    assert!(
        diff <= 1e-4,
        "interleaved on stored rows differs by {diff:e}"
    );
    // llama.cpp's order with HF's rotation: another model, whose logits are far off.
    let dev = Device::Cpu;
    let file = GgufFile::open(GGUF)?;
    let wrong = Llama::from_tensors(
        &file.config_json()?,
        file.tensors(DType::F32, &dev, QkRows::Stored)?,
        DType::F32,
        &dev,
        QkRows::Hf,
    )?;
    let prompt = ids(get(&reference, "prompt")?)?;
    let input = Tensor::new(prompt.as_slice(), &dev)?.unsqueeze(0)?;
    let logits = wrong.forward(&input, &mut wrong.caches())?.squeeze(0)?;
    let diff = max_diff(&logits, hf)?;
    assert!(diff > 0.1, "the wrong rotation went unnoticed ({diff:e})");
    Ok(())
}

#[test]
fn unpermuting_puts_each_heads_pairs_back_half_a_head_apart() -> anyhow::Result<()> {
    // Two heads of width 4, one column: stored rows [h0: a0 b0 a1 b1 | h1: ...] where (a_i, b_i)
    // is HF's pair (i, i + 2).
    let stored = Tensor::new(
        &[[0f32], [2.], [1.], [3.], [4.], [6.], [5.], [7.]],
        &Device::Cpu,
    )?;
    let hf = unpermute_qk(&stored, 2)?;
    assert_eq!(
        hf.flatten_all()?.to_vec1::<f32>()?,
        [0., 1., 2., 3., 4., 5., 6., 7.]
    );
    assert!(unpermute_qk(&stored, 3).is_err());
    assert!(unpermute_qk(&stored, 0).is_err());
    Ok(())
}

#[test]
fn the_layers_share_one_rope_table() -> anyhow::Result<()> {
    let model = Llama::from_gguf(&GgufFile::open(GGUF)?, DType::F32, &Device::Cpu, QkRows::Hf)?;
    let encodings: Vec<_> = model.attention().map(|a| a.encoding().cloned()).collect();
    let first = encodings[0].as_ref().expect("RoPE");
    assert!(encodings
        .iter()
        .all(|e| e.as_ref().is_some_and(|e| Arc::ptr_eq(e, first))));
    Ok(())
}

#[test]
fn bf16_weights_stay_close_to_f32() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let model = Llama::from_gguf(&GgufFile::open(GGUF)?, DType::BF16, &dev, QkRows::Hf)?;
    let reference = reference()?;
    let prompt = ids(get(&reference, "prompt")?)?;
    let input = Tensor::new(prompt.as_slice(), &dev)?.unsqueeze(0)?;
    let logits = model.forward(&input, &mut model.caches())?.squeeze(0)?;
    let hf = get(&reference, "logits")?;
    // bf16 keeps 8 bits of mantissa: within a few percent of the logits' spread.
    let diff = max_diff(&logits, hf)?;
    assert!(diff < 0.25, "bf16 logits differ by {diff}");
    let same = (0..prompt.len())
        .filter(|&t| {
            let a = argmax(
                &logits
                    .i(t)
                    .and_then(|r| r.to_vec1::<f32>())
                    .unwrap_or_default(),
            );
            let b = argmax(&hf.i(t).and_then(|r| r.to_vec1::<f32>()).unwrap_or_default());
            a == b
        })
        .count();
    assert!(
        same + 1 >= prompt.len(),
        "argmax agrees at {same} of {} positions",
        prompt.len()
    );
    Ok(())
}

#[test]
fn the_tokenizer_splits_as_smollm2s_tokenizer_json() -> anyhow::Result<()> {
    let file = GgufFile::open(GGUF)?;
    let tokenizer = Tokenizer::from_gguf(file.metadata())?;
    let reference = reference()?;
    let strings: Vec<String> = serde_json::from_str(&reference.metadata()["strings"])?;
    for (i, text) in strings.iter().enumerate() {
        let want = ids(get(&reference, &format!("tokens.{i}"))?)?;
        assert_eq!(tokenizer.encode(text), want, "{text:?}");
        assert_eq!(tokenizer.decode(&want), *text);
    }
    assert_eq!(tokenizer.eos(), tokenizer.id("<|im_end|>"));
    Ok(())
}
