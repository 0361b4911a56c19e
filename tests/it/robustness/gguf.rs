//! Hostile GGUF files: headers candle's reader accepts but whose values (an alignment of 0, a
//! tensor of no dimensions, dimensions whose product overflows) must end in a typed error from
//! [`GgufFile`], never a panic.

use std::panic::{catch_unwind, AssertUnwindSafe};

use candle_core::{DType, Device};
use candle_posenc::hf::gguf::{GgufFile, QkRows};
use candle_posenc::Error;

/// A metadata value as GGUF stores it: its type code and its bytes.
enum Meta {
    U32(u32),
    F32(f32),
    Str(&'static str),
    Strs(&'static [&'static str]),
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// A GGUF v3 file: `meta`, then f32 tensors `(name, dims in GGUF's order)` at offset 0 of a
/// data section of `data` zero bytes.
fn gguf(meta: &[(&str, Meta)], tensors: &[(&str, &[u64])], data: usize) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(meta.len() as u64).to_le_bytes());
    for (key, value) in meta {
        string(&mut out, key);
        match value {
            Meta::U32(n) => {
                out.extend_from_slice(&4u32.to_le_bytes());
                out.extend_from_slice(&n.to_le_bytes());
            }
            Meta::F32(x) => {
                out.extend_from_slice(&6u32.to_le_bytes());
                out.extend_from_slice(&x.to_le_bytes());
            }
            Meta::Str(s) => {
                out.extend_from_slice(&8u32.to_le_bytes());
                string(&mut out, s);
            }
            Meta::Strs(all) => {
                out.extend_from_slice(&9u32.to_le_bytes());
                out.extend_from_slice(&8u32.to_le_bytes());
                out.extend_from_slice(&(all.len() as u64).to_le_bytes());
                for s in *all {
                    string(&mut out, s);
                }
            }
        }
    }
    for (name, dims) in tensors {
        string(&mut out, name);
        out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
        for d in *dims {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&0u32.to_le_bytes()); // f32
        out.extend_from_slice(&0u64.to_le_bytes()); // offset
    }
    out.resize(out.len().div_ceil(32) * 32 + data, 0);
    out
}

/// A Llama's metadata, complete but for what `skip` leaves out.
fn llama(skip: &[&str]) -> Vec<(&'static str, Meta)> {
    let all = [
        ("general.architecture", Meta::Str("llama")),
        ("llama.embedding_length", Meta::U32(8)),
        ("llama.block_count", Meta::U32(1)),
        ("llama.feed_forward_length", Meta::U32(16)),
        ("llama.attention.head_count", Meta::U32(2)),
        ("llama.attention.layer_norm_rms_epsilon", Meta::F32(1e-5)),
        ("llama.vocab_size", Meta::U32(4)),
    ];
    all.into_iter().filter(|(k, _)| !skip.contains(k)).collect()
}

/// Writes `bytes` to a file of this test's own and opens it, under `catch_unwind`.
fn open(
    label: &str,
    bytes: &[u8],
    then: impl FnOnce(&GgufFile) -> candle_posenc::Result<()>,
) -> Error {
    let path =
        std::env::temp_dir().join(format!("posenc_gguf_{label}_{}.gguf", std::process::id()));
    std::fs::write(&path, bytes).expect("write");
    let got = catch_unwind(AssertUnwindSafe(|| then(&GgufFile::open(&path)?)));
    let _ = std::fs::remove_file(&path);
    match got {
        Err(_) => panic!("{label}: panicked"),
        Ok(Ok(())) => panic!("{label}: returned Ok"),
        Ok(Err(e)) => e,
    }
}

/// `general.alignment` 0, behind an array of strings the walk steps over: candle divided
/// by it.
#[test]
fn an_alignment_of_zero_is_refused() {
    let mut meta = llama(&[]);
    meta.push(("tokenizer.ggml.tokens", Meta::Strs(&["a", "bc"])));
    meta.push(("general.alignment", Meta::U32(0)));
    let e = open("align0", &gguf(&meta, &[], 0), |_| Ok(()));
    assert!(matches!(e, Error::Checkpoint { .. }), "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains("`general.alignment` is 0, expected a positive alignment"),
        "{text}"
    );
    // Repeated, candle keeps the last: 32 then 0 is an alignment of 0.
    let mut meta = llama(&[]);
    meta.push(("general.alignment", Meta::U32(32)));
    meta.push(("general.alignment", Meta::U32(0)));
    let e = open("align32then0", &gguf(&meta, &[], 0), |_| Ok(()));
    assert!(e.to_string().contains("`general.alignment` is 0"), "{e}");
}

/// Token embeddings of no dimensions and no `vocab_size`: the vocabulary was read as their
/// first dimension.
#[test]
fn token_embeddings_that_are_not_a_matrix_are_refused() {
    let meta = llama(&["llama.vocab_size"]);
    let e = open(
        "scalar",
        &gguf(&meta, &[("token_embd.weight", &[])], 32),
        |f| f.config_json().map(drop),
    );
    assert!(matches!(e, Error::Checkpoint { .. }), "{e:?}");
    let text = e.to_string();
    assert!(text.contains("`token_embd.weight` is []"), "{text}");
    assert!(text.contains("expected (vocab_size, hidden)"), "{text}");
}

/// Dimensions whose product overflows: candle multiplied them unchecked when reading.
#[test]
fn tensors_past_the_budget_are_refused_at_open() {
    let big = 1u64 << 32;
    let e = open(
        "overflow",
        &gguf(&llama(&[]), &[("token_embd.weight", &[big, big, 4])], 32),
        |f| f.tensors(DType::F32, &Device::Cpu, QkRows::Hf).map(drop),
    );
    assert!(matches!(e, Error::InvalidConfig { .. }), "{e:?}");
    let text = e.to_string();
    assert!(text.contains("token_embd.weight"), "{text}");
    assert!(text.contains("at most 2147483648"), "{text}");
}
