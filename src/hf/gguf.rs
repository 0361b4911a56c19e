//! [`GgufFile`]: a GGUF file (llama.cpp's format) read as an HF model: its metadata written as
//! the model's `config.json` (for [`HfAttentionConfig::from_json`](super::HfAttentionConfig)),
//! its tensors dequantized under HF's names, the rows of q and k in the order the caller asks.
//!
//! Architectures read (one row each in `ARCHITECTURES`): `llama` (HF's `llama`).
//!
//! The metadata, `{arch}.*` unless written in full:
//!
//! | GGUF key | `config.json` key | if absent |
//! |---|---|---|
//! | `general.architecture` | `model_type` | refused |
//! | `embedding_length` | `hidden_size` | refused |
//! | `block_count` | `num_hidden_layers` | refused |
//! | `feed_forward_length` | `intermediate_size` | refused |
//! | `attention.head_count` | `num_attention_heads` | refused |
//! | `attention.head_count_kv` | `num_key_value_heads` | the heads |
//! | `attention.key_length` | `head_dim` | `hidden_size / num_attention_heads` |
//! | `rope.dimension_count` | (must equal `head_dim`: Llama rotates the whole head) | `head_dim` |
//! | `rope.freq_base` | `rope_theta` | 10000 |
//! | `context_length` | `max_position_embeddings` | 2048 |
//! | `attention.layer_norm_rms_epsilon` | `rms_norm_eps` | refused |
//! | `vocab_size` | `vocab_size` | the rows of `token_embd.weight` |
//! | `tokenizer.ggml.bos_token_id`, `tokenizer.ggml.eos_token_id` | `bos_token_id`, `eos_token_id` | left out |
//! | (no `output.weight` tensor) | `tie_word_embeddings` | |
//!
//! Floats are stored as f32 and written widened, as HF's GGUF loading reads them (`rms_norm_eps`
//! 9.999999747e-6 for a file that says 1e-5). Settings the file can hold and this reader does
//! not follow are refused rather than ignored: `rope.scaling.type` other than `none`, a
//! `rope_freqs.weight` tensor (Llama 3.1's per-frequency factors), a tensor without an HF name.
//!
//! The tensors (`blk.{i}.` → `model.layers.{i}.`):
//!
//! | GGUF | HF |
//! |---|---|
//! | `token_embd.weight` | `model.embed_tokens.weight` |
//! | `output_norm.weight` | `model.norm.weight` |
//! | `output.weight` | `lm_head.weight` |
//! | `attn_norm.weight` | `input_layernorm.weight` |
//! | `attn_q.weight`, `attn_k.weight`, `attn_v.weight`, `attn_output.weight` | `self_attn.q_proj.weight`, `.k_proj`, `.v_proj`, `.o_proj` |
//! | `ffn_norm.weight` | `post_attention_layernorm.weight` |
//! | `ffn_gate.weight`, `ffn_up.weight`, `ffn_down.weight` | `mlp.gate_proj.weight`, `.up_proj`, `.down_proj` |
//!
//! # The rows of q and k
//!
//! HF's Llama rotates feature `i` of a head with feature `i + d/2` ([`RopeLayout::Half`]);
//! llama.cpp rotates adjacent features `2i`, `2i + 1`, so its converter reorders each head's
//! rows of `q_proj` and `k_proj` (over the key/value heads for k): HF's row `i` of a head becomes
//! row `2i`, and row `i + d/2` becomes row `2i + 1`. Both models compute the same logits, each
//! with its own rotation. A file read with the wrong one runs and writes fluent-looking text
//! that is not the model's, so the choice is explicit, [`QkRows`]: un-permuted to HF's order
//! (the default; what the `config.json` written here describes), or kept as stored and rotated
//! with [`RopeLayout::Interleaved`] ([`QkRows::rope_layout`]).

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, TensorInfo, Value};
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Map};

use crate::error::{check_float, Error, Result};
use crate::limits::check_elements;
use crate::rotary::RopeLayout;

/// An architecture this reader knows: its name in GGUF, its HF `model_type`, and whether the
/// converter permuted the rows of q and k (see the module docs).
struct Architecture {
    name: &'static str,
    model_type: &'static str,
    permuted_qk: bool,
}

/// The architectures read, one row each.
const ARCHITECTURES: &[Architecture] = &[Architecture {
    name: "llama",
    model_type: "llama",
    permuted_qk: true,
}];

/// Tensors outside the layers: GGUF name → HF name.
const MODEL_TENSORS: &[(&str, &str)] = &[
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
];

/// A layer's tensors, after `blk.{i}.`: GGUF name → HF name after `model.layers.{i}.`.
const LAYER_TENSORS: &[(&str, &str)] = &[
    ("attn_norm.weight", "input_layernorm.weight"),
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
];

/// The HF name of a GGUF tensor of the architectures read, if it has one.
///
/// ```
/// use candle_posenc::hf::gguf::hf_name;
/// assert_eq!(hf_name("blk.3.attn_k.weight").as_deref(), Some("model.layers.3.self_attn.k_proj.weight"));
/// assert_eq!(hf_name("rope_freqs.weight"), None);
/// ```
pub fn hf_name(gguf: &str) -> Option<String> {
    if let Some((_, hf)) = MODEL_TENSORS.iter().find(|(g, _)| *g == gguf) {
        return Some(hf.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, name) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (_, hf) = LAYER_TENSORS.iter().find(|(g, _)| *g == name)?;
    Some(format!("model.layers.{layer}.{hf}"))
}

/// The order of the rows of q and k that [`GgufFile::tensors`] hands back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QkRows {
    /// HF's order, un-permuted at load: each head's pairs are `(i, i + d/2)`, rotated with
    /// [`RopeLayout::Half`] as the `config.json` of [`GgufFile::config_json`] says.
    #[default]
    Hf,
    /// As llama.cpp stores them: each head's pairs are `(2i, 2i + 1)`, to be rotated with
    /// [`RopeLayout::Interleaved`] (set it on the encoding read from the `config.json`).
    Stored,
}

impl QkRows {
    /// The pair layout that rotates rows in this order as the model was trained.
    pub fn rope_layout(self) -> RopeLayout {
        match self {
            QkRows::Hf => RopeLayout::Half,
            QkRows::Stored => RopeLayout::Interleaved,
        }
    }
}

/// llama.cpp's rows of a q or k projection put back in HF's order: within each of `heads`
/// heads of `d` rows, row `2i` becomes row `i` and row `2i + 1` becomes row `i + d/2`.
///
/// # Shapes
/// `w`: `(heads · d, in)` with `d` even → the same.
///
/// # Errors
/// [`Error::Shape`] for a `w` that is not 2-D or whose rows are not `heads` heads of an even
/// width; [`Error::InvalidConfig`] for zero heads.
pub fn unpermute_qk(w: &Tensor, heads: usize) -> Result<Tensor> {
    if heads == 0 {
        return Err(Error::config("heads", 0, "at least 1"));
    }
    let (rows, cols) = w
        .dims2()
        .map_err(|_| Error::shape("q/k weight", "(heads · head_dim, in)", w.shape()))?;
    if !rows.is_multiple_of(2 * heads) {
        return Err(Error::shape(
            "q/k weight",
            format!("rows a multiple of 2 × {heads} heads (an even head width)"),
            w.shape(),
        ));
    }
    Ok(w.reshape((heads, rows / heads / 2, 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((rows, cols))?)
}

/// A GGUF file's header: its metadata and where its tensors are, read once; the tensors are
/// read by [`Self::tensors`].
///
/// # Example
/// ```no_run
/// use candle_core::{DType, Device};
/// use candle_nn::VarBuilder;
/// use candle_posenc::hf::gguf::{GgufFile, QkRows};
/// use candle_posenc::hf::{HfAttentionConfig, SharedEncodings};
///
/// let file = GgufFile::open("data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")?;
/// let config = HfAttentionConfig::from_json(&file.config_json()?)?;
/// let dev = Device::Cpu;
/// let vb = VarBuilder::from_tensors(file.tensors(DType::F32, &dev, QkRows::Hf)?, DType::F32, &dev);
/// let mut shared = SharedEncodings::new();
/// let layer0 = config.load_shared(&mut shared, vb.pp("model.layers.0.self_attn"))?;
/// # Ok::<(), candle_posenc::Error>(())
/// ```
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    arch: &'static Architecture,
}

/// The path, architecture and counts (the metadata holds the whole vocabulary).
impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("architecture", &self.arch.name)
            .field("metadata", &self.content.metadata.len())
            .field("tensors", &self.content.tensor_infos.len())
            .finish()
    }
}

impl GgufFile {
    /// Reads the header of the GGUF file at `path`.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be opened; [`Error::Checkpoint`] when it is not a
    /// GGUF file candle reads, its `general.alignment` is 0, or its `general.architecture` is
    /// missing or not one read here; [`Error::InvalidConfig`] for a tensor whose element count
    /// overflows or passes the budget ([`crate::limits`]).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let mut reader = open(&path)?;
        // candle divides by the alignment it reads: refused here first, then read back from
        // the start.
        if header::alignment(&mut reader) == Some(0) {
            return Err(bad(
                &path,
                "`general.alignment` is 0, expected a positive alignment",
            ));
        }
        reader
            .seek(SeekFrom::Start(0))
            .map_err(|source| Error::Io {
                path: path.display().to_string(),
                source,
            })?;
        let content = Content::read(&mut reader).map_err(|e| bad(&path, e.to_string()))?;
        check_tensor_infos(&path, &content)?;
        let name = match content.metadata.get("general.architecture") {
            Some(Value::String(s)) => s.clone(),
            _ => return Err(bad(&path, "no `general.architecture` string")),
        };
        let Some(arch) = ARCHITECTURES.iter().find(|a| a.name == name) else {
            let known: Vec<&str> = ARCHITECTURES.iter().map(|a| a.name).collect();
            return Err(bad(
                &path,
                format!("architecture `{name}` is not read here (expected one of {known:?})"),
            ));
        };
        Ok(Self {
            path,
            content,
            arch,
        })
    }

    /// The file's metadata (the tokenizer's vocabulary, merges and chat template included).
    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    /// Whether the converter reordered the rows of q and k for llama.cpp's rotation (see the
    /// module docs).
    pub fn permuted_qk(&self) -> bool {
        self.arch.permuted_qk
    }

    /// The model's HF `config.json`, written from the metadata (see the module docs for the
    /// keys).
    ///
    /// # Errors
    /// [`Error::Checkpoint`] naming the GGUF key that is missing, of the wrong type or a
    /// setting not read here.
    pub fn config_json(&self) -> Result<String> {
        let sizes = self.sizes()?;
        let mut map = Map::new();
        map.insert("model_type".into(), json!(self.arch.model_type));
        map.insert("hidden_size".into(), json!(sizes.hidden));
        map.insert("num_hidden_layers".into(), json!(self.int("block_count")?));
        map.insert(
            "intermediate_size".into(),
            json!(self.int("feed_forward_length")?),
        );
        map.insert("num_attention_heads".into(), json!(sizes.heads));
        map.insert("num_key_value_heads".into(), json!(sizes.kv_heads));
        map.insert("head_dim".into(), json!(sizes.head_dim));
        let theta = self.float_or("rope.freq_base", 10_000.0)?;
        map.insert("rope_theta".into(), json!(theta));
        let context = self.optional_int("context_length")?.unwrap_or(2048);
        map.insert("max_position_embeddings".into(), json!(context));
        let eps = self.float("attention.layer_norm_rms_epsilon")?;
        map.insert("rms_norm_eps".into(), json!(eps));
        map.insert("vocab_size".into(), json!(self.vocab_size()?));
        let tied = !self.content.tensor_infos.contains_key("output.weight");
        map.insert("tie_word_embeddings".into(), json!(tied));
        for (key, hf) in [
            ("bos_token_id", "bos_token_id"),
            ("eos_token_id", "eos_token_id"),
        ] {
            if let Some(id) = self.full_int(&format!("tokenizer.ggml.{key}"))? {
                map.insert(hf.into(), json!(id));
            }
        }
        self.refuse_scaling()?;
        Ok(serde_json::Value::Object(map).to_string())
    }

    /// Every tensor, dequantized to `dtype` on `device`, under its HF name, with the rows of q
    /// and k in the order `rows` asks.
    ///
    /// Each tensor is dequantized to f32 and then cast once, so the weights in memory are
    /// those of `dtype` (bf16 halves them).
    ///
    /// # Errors
    /// [`Error::DType`] for a `dtype` that is not a float; [`Error::Io`] when the file cannot
    /// be read; [`Error::Checkpoint`] for a tensor without an HF name (`rope_freqs.weight`
    /// among them) or one candle cannot dequantize; [`Error::Shape`] for q or k rows that are
    /// not whole heads.
    pub fn tensors(
        &self,
        dtype: DType,
        device: &Device,
        rows: QkRows,
    ) -> Result<HashMap<String, Tensor>> {
        check_float("GGUF tensors (the dtype asked for)", dtype)?;
        let sizes = self.sizes()?;
        let mut infos: Vec<(&String, &TensorInfo)> = self.content.tensor_infos.iter().collect();
        // In file order, so the reads go forward through the file.
        infos.sort_by_key(|(_, info)| info.offset);
        let mut reader = open(&self.path)?;
        let mut out = HashMap::with_capacity(infos.len());
        for (name, info) in infos {
            let hf = hf_name(name).ok_or_else(|| {
                bad(
                    &self.path,
                    format!("tensor `{name}` has no HF name here (not read rather than ignored)"),
                )
            })?;
            let q = info
                .read(&mut reader, self.content.tensor_data_offset, &Device::Cpu)
                .map_err(|e| bad(&self.path, format!("tensor `{name}`: {e}")))?;
            let mut t = q.dequantize(&Device::Cpu)?;
            let heads = match name.rsplit('.').nth(1) {
                Some("attn_q") => Some(sizes.heads),
                Some("attn_k") => Some(sizes.kv_heads),
                _ => None,
            };
            if let (Some(heads), true, QkRows::Hf) = (heads, self.arch.permuted_qk, rows) {
                t = unpermute_qk(&t, heads)?;
            }
            out.insert(hf, t.to_dtype(dtype)?.to_device(device)?);
        }
        Ok(out)
    }

    /// Width, heads and head width, checked against each other and the rotation.
    fn sizes(&self) -> Result<Sizes> {
        let hidden = self.int("embedding_length")?;
        let heads = self.int("attention.head_count")?;
        if heads == 0 {
            return Err(self.key_problem("attention.head_count", "is 0"));
        }
        let kv_heads = self
            .optional_int("attention.head_count_kv")?
            .unwrap_or(heads);
        let head_dim = self
            .optional_int("attention.key_length")?
            .unwrap_or(hidden / heads);
        let rotary = self
            .optional_int("rope.dimension_count")?
            .unwrap_or(head_dim);
        if rotary != head_dim {
            return Err(self.key_problem(
                "rope.dimension_count",
                format!("is {rotary}, but the heads are {head_dim} wide; a partial rotation is not read here"),
            ));
        }
        Ok(Sizes {
            hidden,
            heads,
            kv_heads,
            head_dim,
        })
    }

    /// `vocab_size`, else the rows of the token embeddings.
    fn vocab_size(&self) -> Result<usize> {
        if let Some(v) = self.optional_int("vocab_size")? {
            return Ok(v);
        }
        match self.content.tensor_infos.get("token_embd.weight") {
            Some(info) => match info.shape.dims() {
                &[rows, _] => Ok(rows),
                dims => Err(bad(
                    &self.path,
                    format!("`token_embd.weight` is {dims:?}, expected (vocab_size, hidden)"),
                )),
            },
            None => Err(bad(
                &self.path,
                "no `vocab_size` and no `token_embd.weight`",
            )),
        }
    }

    /// Refuses RoPE scaling, which this reader does not follow.
    fn refuse_scaling(&self) -> Result<()> {
        let key = format!("{}.rope.scaling.type", self.arch.name);
        match self.content.metadata.get(&key) {
            None => {}
            Some(Value::String(s)) if s == "none" => {}
            Some(v) => {
                return Err(bad(
                    &self.path,
                    format!("`{key}` is {v:?}: RoPE scaling from GGUF is not read here"),
                ))
            }
        }
        if self.content.tensor_infos.contains_key("rope_freqs.weight") {
            return Err(bad(
                &self.path,
                "tensor `rope_freqs.weight` (per-frequency RoPE factors) is not read here",
            ));
        }
        Ok(())
    }

    /// `{arch}.{key}` as an integer.
    fn int(&self, key: &str) -> Result<usize> {
        self.optional_int(key)?
            .ok_or_else(|| self.key_problem(key, "is missing"))
    }

    fn optional_int(&self, key: &str) -> Result<Option<usize>> {
        self.full_int(&format!("{}.{key}", self.arch.name))
    }

    /// The metadata at the full key `key` as an integer, if present.
    fn full_int(&self, key: &str) -> Result<Option<usize>> {
        let Some(v) = self.content.metadata.get(key) else {
            return Ok(None);
        };
        let n = match *v {
            Value::U8(n) => Some(u64::from(n)),
            Value::U16(n) => Some(u64::from(n)),
            Value::U32(n) => Some(u64::from(n)),
            Value::U64(n) => Some(n),
            Value::I8(n) => u64::try_from(n).ok(),
            Value::I16(n) => u64::try_from(n).ok(),
            Value::I32(n) => u64::try_from(n).ok(),
            Value::I64(n) => u64::try_from(n).ok(),
            _ => None,
        };
        n.and_then(|n| usize::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| {
                bad(
                    &self.path,
                    format!("`{key}` is {v:?}, expected a non-negative integer"),
                )
            })
    }

    /// `{arch}.{key}` as a float.
    fn float(&self, key: &str) -> Result<f64> {
        let full = format!("{}.{key}", self.arch.name);
        let v = match self.content.metadata.get(&full) {
            Some(Value::F32(x)) => f64::from(*x),
            Some(Value::F64(x)) => *x,
            Some(v) => return Err(self.key_problem(key, format!("is {v:?}, expected a float"))),
            None => return Err(self.key_problem(key, "is missing")),
        };
        match v.is_finite() && v > 0.0 {
            true => Ok(v),
            false => Err(self.key_problem(key, format!("is {v}, expected a positive number"))),
        }
    }

    fn float_or(&self, key: &str, default: f64) -> Result<f64> {
        let full = format!("{}.{key}", self.arch.name);
        match self.content.metadata.contains_key(&full) {
            true => self.float(key),
            false => Ok(default),
        }
    }

    fn key_problem(&self, key: &str, problem: impl std::fmt::Display) -> Error {
        bad(&self.path, format!("`{}.{key}` {problem}", self.arch.name))
    }
}

/// Refuses a tensor whose element count overflows or passes the budget ([`crate::limits`]):
/// each is dequantized to f32, and candle's reader multiplies its dimensions unchecked.
fn check_tensor_infos(path: &Path, content: &Content) -> Result<()> {
    for (name, info) in &content.tensor_infos {
        check_elements(
            "GGUF tensor",
            format_args!("`{name}` of {:?} in {}", info.shape.dims(), path.display()),
            "elements (dequantized to f32)",
            info.shape.dims(),
        )?;
    }
    Ok(())
}

/// The sizes the tensors' layout depends on.
struct Sizes {
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

fn open(path: &Path) -> Result<BufReader<File>> {
    File::open(path)
        .map(BufReader::new)
        .map_err(|source| Error::Io {
            path: path.display().to_string(),
            source,
        })
}

fn bad(path: &Path, reason: impl Into<String>) -> Error {
    Error::Checkpoint {
        path: path.display().to_string(),
        reason: reason.into(),
    }
}

/// The one header value candle's GGUF reader takes unchecked, found by walking the metadata
/// without allocating: anything unexpected ends the walk, and candle's reader reports it.
mod header {
    use std::io::{Read, Seek};

    const KEY: &[u8] = b"general.alignment";

    fn bytes<const N: usize>(r: &mut impl Read) -> Option<[u8; N]> {
        let mut b = [0u8; N];
        r.read_exact(&mut b).ok().map(|()| b)
    }

    fn u32(r: &mut impl Read) -> Option<u32> {
        bytes(r).map(u32::from_le_bytes)
    }

    /// A length: u32 in version 1, u64 after.
    fn len(r: &mut impl Read, v1: bool) -> Option<u64> {
        match v1 {
            true => u32(r).map(u64::from),
            false => bytes(r).map(u64::from_le_bytes),
        }
    }

    fn skip(r: &mut impl Seek, n: u64) -> Option<()> {
        // Relative, so a `BufReader` keeps its buffer (`seek` drops it on every call).
        r.seek_relative(i64::try_from(n).ok()?).ok()
    }

    /// Bytes of a scalar of GGUF type `t`, `None` for strings and arrays.
    fn scalar_size(t: u32) -> Option<u64> {
        match t {
            0 | 1 | 7 => Some(1),
            2 | 3 => Some(2),
            4..=6 => Some(4),
            10..=12 => Some(8),
            _ => None,
        }
    }

    /// Steps over a value of type `t` (arrays nested at most 64 deep, as candle reads them).
    fn skip_value(r: &mut (impl Read + Seek), t: u32, v1: bool, depth: usize) -> Option<()> {
        if let Some(n) = scalar_size(t) {
            return skip(r, n);
        }
        match t {
            8 => len(r, v1).and_then(|n| skip(r, n)),
            9 if depth < 64 => {
                let (inner, n) = (u32(r)?, len(r, v1)?);
                match scalar_size(inner) {
                    Some(size) => skip(r, size.checked_mul(n)?),
                    None => (0..n).try_for_each(|_| skip_value(r, inner, v1, depth + 1)),
                }
            }
            _ => None,
        }
    }

    /// `general.alignment` as candle reads it (an unsigned or non-negative integer of at most
    /// 32 bits), if the walk finds it: the last one, as candle keeps the last of a repeated key.
    pub(super) fn alignment(r: &mut (impl Read + Seek)) -> Option<u64> {
        let mut found = None;
        walk(r, &mut found);
        found
    }

    /// Walks the metadata, leaving each `general.alignment` it meets in `found` (`None` for
    /// one that is no such integer); stops at anything unexpected.
    fn walk(r: &mut (impl Read + Seek), found: &mut Option<u64>) -> Option<()> {
        let (_magic, version) = (u32(r)?, u32(r)?);
        let v1 = version == 1;
        let (_tensors, entries) = (len(r, v1)?, len(r, v1)?);
        for _ in 0..entries {
            let key_len = len(r, v1)?;
            let is_key = key_len == KEY.len() as u64 && bytes::<{ KEY.len() }>(r)? == *KEY;
            if key_len != KEY.len() as u64 {
                skip(r, key_len)?;
            }
            let t = u32(r)?;
            if !is_key || t > 5 {
                *found = if is_key { None } else { *found };
                skip_value(r, t, v1, 0)?;
                continue;
            }
            // Read whole (the value's bytes are consumed either way).
            *found = match t {
                0 => u64::from(bytes::<1>(r)?[0]).into(),
                1 => u64::try_from(i8::from_le_bytes(bytes(r)?)).ok(),
                2 => u64::from(u16::from_le_bytes(bytes(r)?)).into(),
                3 => u64::try_from(i16::from_le_bytes(bytes(r)?)).ok(),
                4 => u64::from(u32(r)?).into(),
                _ => u64::try_from(i32::from_le_bytes(bytes(r)?)).ok(),
            };
        }
        Some(())
    }
}
