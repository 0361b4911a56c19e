//! safetensors checkpoints: save tensors with metadata, load them back with typed errors.
//!
//! A [`Checkpoint`] holds every tensor of a file plus its string metadata. Modules load from it
//! through [`Checkpoint::var_builder`] (so HF-named tensors load by prefix, e.g.
//! `vb.pp("model.layers.0.self_attn")`), and training code restores a `VarMap` with
//! [`Checkpoint::load_into`], which checks every variable before changing any.
//!
//! # Metadata
//!
//! A file says what it holds: each configuration is one metadata entry whose value is the
//! configuration's serde serialisation as JSON.
//!
//! | key | value | written / read by |
//! |---|---|---|
//! | [`ENCODING_KEY`] `posenc.encoding` | the [`EncodingConfig`](crate::EncodingConfig), tagged by `kind` | [`EncodingConfig::to_metadata`](crate::EncodingConfig::to_metadata) / [`from_metadata`](crate::EncodingConfig::from_metadata) |
//! | [`ATTENTION_KEY`] `posenc.attention` | the [`AttentionConfig`](crate::AttentionConfig) (without its runtime settings) | [`AttentionConfig::to_metadata`](crate::AttentionConfig::to_metadata) / [`from_metadata`](crate::AttentionConfig::from_metadata) |
//!
//! For example:
//!
//! ```text
//! posenc.encoding  = {"kind":"rotary","head_dim":16,"rotary_dim":16,"base":10000.0,"layout":"half","scaling":{"rope_type":"dynamic","factor":2.0,"original_max_position_embeddings":64},"max_position":2048,"kernel":"fused"}
//! posenc.attention = {"d_model":64,"num_heads":4,"num_kv_heads":4,"head_dim":16,"bias":false,"dropout":0.0,"causal":true,"softmax_scale":0.25}
//! ```
//!
//! Reading checks the JSON and then the values, with typed errors naming the key. Other keys
//! are the caller's (a model's own settings, scores, a vocabulary) and are kept as they are.
//! Files of the earlier one-key-per-field format (`posenc.kind`, `posenc.d_model`, ...,
//! `attention.*`) are not read; the error says so.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::{is_float, largest_finite, overflowed, shown, Error, Result};

/// Metadata key whose value is the JSON of the file's [`EncodingConfig`](crate::EncodingConfig).
pub const ENCODING_KEY: &str = "posenc.encoding";

/// Metadata key whose value is the JSON of the file's [`AttentionConfig`](crate::AttentionConfig).
pub const ATTENTION_KEY: &str = "posenc.attention";

/// Tensors and metadata read from a safetensors file.
///
/// # Example
/// A self-describing checkpoint: saved with its configurations, rebuilt from the file alone.
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use candle_posenc::checkpoint::save_varmap;
/// use candle_posenc::{AttentionConfig, Checkpoint, EncodingConfig, MultiHeadAttention, T5Config};
///
/// let dev = Device::Cpu;
/// let (encoding, attention) = (EncodingConfig::T5(T5Config::new(4)), AttentionConfig::new(32, 4));
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
/// MultiHeadAttention::new(&attention, encoding.build(vb.pp("t5"))?, vb.pp("attn"))?;
/// let mut metadata = encoding.to_metadata();
/// metadata.extend(attention.to_metadata());
/// let path = std::env::temp_dir().join(format!("posenc-doc-{}.safetensors", std::process::id()));
/// save_varmap(&path, &varmap, &metadata)?;
///
/// let file = Checkpoint::load(&path, &dev)?;
/// let encoding = EncodingConfig::from_metadata(file.metadata(), file.source())?;
/// let attention = AttentionConfig::from_metadata(file.metadata(), file.source())?;
/// let vb = file.var_builder(DType::F32, &dev);
/// let block = MultiHeadAttention::new(&attention, encoding.build(vb.pp("t5"))?, vb.pp("attn"))?;
/// let y = block.forward_with(&Tensor::zeros((1, 3, 32), DType::F32, &dev)?, &Default::default(), None)?;
/// assert_eq!(y.output.dims(), &[1, 3, 32]);
/// # std::fs::remove_file(&path).ok();
/// # Ok::<(), candle_posenc::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Checkpoint {
    source: String,
    tensors: HashMap<String, Tensor>,
    metadata: HashMap<String, String>,
}

/// Writes `tensors` and `metadata` to `path` in the safetensors format.
///
/// The file is written next to its destination and renamed into place, so a crash never leaves
/// a half-written checkpoint under the final name.
///
/// # Errors
/// [`Error::Io`] when the file cannot be written; [`Error::Checkpoint`] when serialisation fails.
pub fn save<P: AsRef<Path>>(
    path: P,
    tensors: &HashMap<String, Tensor>,
    metadata: &HashMap<String, String>,
) -> Result<()> {
    let path = path.as_ref();
    let shown = path.display().to_string();
    // safetensors wants contiguous data; make copies only where needed.
    let mut owned = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        if name == "__metadata__" || name.is_empty() {
            return Err(Error::Checkpoint {
                path: shown,
                reason: format!("a tensor may not be named `{name}` (the safetensors header reserves `__metadata__`, and names are non-empty)"),
            });
        }
        owned.push((name.clone(), t.contiguous()?));
    }
    owned.sort_by(|a, b| a.0.cmp(&b.0));
    let meta = (!metadata.is_empty()).then(|| metadata.clone());
    let bytes = safetensors::tensor::serialize(owned.iter().map(|(n, t)| (n.as_str(), t)), meta)
        .map_err(|e| Error::Checkpoint {
            path: shown.clone(),
            reason: format!("cannot serialise: {e}"),
        })?;
    // A temporary name of this call's own (process and counter), so concurrent saves into one
    // folder never write each other's files.
    static SAVES: AtomicU64 = AtomicU64::new(0);
    let n = SAVES.fetch_add(1, Ordering::Relaxed);
    let file = path
        .file_name()
        .map_or_else(|| "checkpoint".into(), |f| f.to_string_lossy());
    let tmp = path.with_file_name(format!(".{file}.{}-{n}.tmp", std::process::id()));
    let written = std::fs::write(&tmp, bytes)
        .map_err(|source| Error::Io {
            path: tmp.display().to_string(),
            source,
        })
        .and_then(|()| {
            std::fs::rename(&tmp, path).map_err(|source| Error::Io {
                path: shown,
                source,
            })
        });
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Writes every variable of `varmap` (by its VarMap name) with `metadata`; see [`save`].
///
/// # Errors
/// As [`save`].
pub fn save_varmap<P: AsRef<Path>>(
    path: P,
    varmap: &VarMap,
    metadata: &HashMap<String, String>,
) -> Result<()> {
    let tensors = varmap_tensors(varmap)?;
    save(path, &tensors, metadata)
}

fn varmap_tensors(varmap: &VarMap) -> Result<HashMap<String, Tensor>> {
    let data = varmap.data().lock().map_err(|_| Error::Checkpoint {
        path: "<varmap>".into(),
        reason: "VarMap lock poisoned by a panicking thread".into(),
    })?;
    Ok(data
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
        .collect())
}

impl Checkpoint {
    /// Reads a safetensors file onto `device`.
    ///
    /// # Errors
    /// [`Error::Io`] if the file cannot be read; [`Error::Checkpoint`] if it is truncated, its
    /// header is malformed, or a tensor has a dtype candle does not support.
    pub fn load<P: AsRef<Path>>(path: P, device: &Device) -> Result<Self> {
        let path = path.as_ref();
        let shown = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|source| Error::Io {
            path: shown.clone(),
            source,
        })?;
        Self::from_bytes_named(&bytes, shown, device)
    }

    /// Parses safetensors bytes onto `device`.
    ///
    /// # Errors
    /// As [`Checkpoint::load`].
    pub fn from_bytes(bytes: &[u8], device: &Device) -> Result<Self> {
        Self::from_bytes_named(bytes, "<memory>".into(), device)
    }

    fn from_bytes_named(bytes: &[u8], source: String, device: &Device) -> Result<Self> {
        let bad = |reason: String| Error::Checkpoint {
            path: source.clone(),
            reason,
        };
        let (_, header) = safetensors::SafeTensors::read_metadata(bytes)
            .map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
        let st = safetensors::SafeTensors::deserialize(bytes)
            .map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
        let mut tensors = HashMap::new();
        for (name, view) in st.tensors() {
            let t = candle_core::safetensors::Load::load(&view, device)
                .map_err(|e| bad(format!("tensor `{name}` cannot be loaded: {e}")))?;
            tensors.insert(name, t);
        }
        Ok(Self {
            source,
            tensors,
            metadata: header.metadata().clone().unwrap_or_default(),
        })
    }

    /// Where the checkpoint came from (a path, or `<memory>`).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The string metadata.
    pub fn metadata(&self) -> &HashMap<String, String> {
        &self.metadata
    }

    /// Every tensor by name.
    pub fn tensors(&self) -> &HashMap<String, Tensor> {
        &self.tensors
    }

    /// One tensor, checked against the expected shape.
    ///
    /// # Errors
    /// [`Error::MissingTensor`] or [`Error::TensorShape`].
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<&Tensor> {
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::MissingTensor { name: name.into() })?;
        if t.dims() != shape {
            return Err(Error::TensorShape {
                name: name.into(),
                expected: shape.to_vec(),
                got: t.dims().to_vec(),
            });
        }
        Ok(t)
    }

    /// Renames tensors: `rename(name)` gives the new name, or `None` to keep the old one. Use
    /// it to map a foreign naming scheme onto this crate's.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] naming both tensors when two of them would get the same name (one
    /// would be lost).
    pub fn renamed(mut self, rename: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let mut renamed = HashMap::with_capacity(self.tensors.len());
        let mut from: HashMap<String, String> = HashMap::with_capacity(self.tensors.len());
        let mut names: Vec<String> = self.tensors.keys().cloned().collect();
        names.sort();
        for old in names {
            let Some(tensor) = self.tensors.remove(&old) else {
                continue;
            };
            let new = rename(&old).unwrap_or_else(|| old.clone());
            if let Some(first) = from.get(&new) {
                return Err(Error::Checkpoint {
                    path: self.source,
                    reason: format!("renaming maps both `{first}` and `{old}` to `{new}`"),
                });
            }
            from.insert(new.clone(), old);
            renamed.insert(new, tensor);
        }
        self.tensors = renamed;
        Ok(self)
    }

    /// A `VarBuilder` over the tensors, converting to `dtype` on `device`. Missing or
    /// misshapen tensors surface as [`Error::MissingTensor`] / [`Error::TensorShape`] from the
    /// constructors that use it, and as [`Error::Checkpoint`] naming the tensor: an integer
    /// tensor where a float parameter is asked for (it is not silently converted), and a
    /// tensor with a finite value past the range of a narrower `dtype` (an f32 value past
    /// 65504 read as f16), which the conversion would turn into ±∞. NaN and ±∞ the file
    /// holds are loaded as they are.
    pub fn var_builder(&self, dtype: DType, device: &Device) -> VarBuilder<'static> {
        let backend = CheckedTensors {
            source: self.source.clone(),
            tensors: self.tensors.clone(),
        };
        VarBuilder::from_backend(Box::new(backend), dtype, device.clone())
    }

    /// Refuses to turn an integer tensor into a float parameter.
    fn check_dtype(&self, name: &str, t: &Tensor, want: DType) -> Result<()> {
        dtype_fits(&self.source, name, t, want)
    }

    /// Copies the checkpoint's values into every variable of `varmap`.
    ///
    /// All variables are checked (present, same shape) before any is written, so a failed load
    /// changes nothing. Tensors the `VarMap` does not have are ignored.
    ///
    /// # Errors
    /// [`Error::MissingTensor`] / [`Error::TensorShape`] naming the first offending variable;
    /// [`Error::Checkpoint`] for an integer tensor where the variable is a float, or a finite
    /// value past the range of a narrower variable (f32 into f16) that would become ±∞ there.
    pub fn load_into(&self, varmap: &VarMap) -> Result<()> {
        let vars = varmap.data().lock().map_err(|_| Error::Checkpoint {
            path: self.source.clone(),
            reason: "VarMap lock poisoned by a panicking thread".into(),
        })?;
        let mut names: Vec<&String> = vars.keys().collect();
        names.sort();
        let mut staged = Vec::with_capacity(names.len());
        for name in names {
            let var = &vars[name];
            let t = self.get(name, var.dims())?;
            self.check_dtype(name, t, var.dtype())?;
            staged.push((
                var,
                converted(&self.source, name, t, var.dtype(), var.device())?,
            ));
        }
        for (var, t) in staged {
            var.set(&t)?;
        }
        Ok(())
    }
}

/// A tensor and the parameter it fills must both be floats (f32, f64, bf16, f16) or both
/// integers: an integer table is a corrupt or foreign file, not something to convert, and
/// floats written into an integer variable would be truncated. The crate's one dtype rule.
fn dtype_fits(source: &str, name: &str, t: &Tensor, want: DType) -> Result<()> {
    if is_float(want) != is_float(t.dtype()) {
        return Err(Error::Checkpoint {
            path: source.into(),
            reason: format!(
                "tensor `{name}` has dtype {:?}, which cannot fill a {want:?} parameter (floats fill f32, f64, bf16 or f16 parameters, integers integer ones)",
                t.dtype()
            ),
        });
    }
    Ok(())
}

/// The checkpoint's tensor `name` as a `dtype` parameter on `device`. A float format narrower
/// than the file's (f16 or bf16 from f32, f32 from f64) holds fewer magnitudes: a finite value
/// past its range would become ±∞ in the conversion, so the tensor is refused, naming its
/// largest such value and the format's. NaN and ±∞ already in the file are not refused: the
/// crate never replaces non-finite values, it propagates them.
fn converted(
    source: &str,
    name: &str,
    t: &Tensor,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let moved = t.to_device(device)?;
    let cast = moved.to_dtype(dtype)?;
    if let Some(largest) = overflowed(&moved, &cast)? {
        let d = dtype.as_str();
        return Err(Error::Checkpoint {
            path: source.into(),
            reason: format!(
                "tensor `{name}` holds a finite value of magnitude {largest:e}, past {}, the largest finite value of {d}: read as a {d} parameter it would become ±∞ (read it in a wider dtype, as {})",
                shown(largest_finite(dtype).unwrap_or(f64::MAX)),
                t.dtype().as_str(),
            ),
        });
    }
    Ok(cast)
}

/// A crate error as the `VarBuilder` backend must return it: a candle error, in the form
/// `Error::from` turns back into [`Error::Checkpoint`] for that variant.
fn backend_error(err: Error) -> candle_core::Error {
    match err {
        Error::Checkpoint { path, reason } => {
            candle_core::Error::Msg(format!("checkpoint {path}: {reason}"))
        }
        other => other.into(),
    }
}

/// candle-nn's `HashMap` backend for `VarBuilder`, plus the dtype check of [`dtype_fits`] and
/// the range check of [`converted`].
struct CheckedTensors {
    source: String,
    tensors: HashMap<String, Tensor>,
}

impl CheckedTensors {
    fn find(&self, name: &str, want: DType) -> candle_core::Result<&Tensor> {
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| candle_core::Error::CannotFindTensor { path: name.into() })?;
        // Only candle errors cross the backend ([`backend_error`]).
        dtype_fits(&self.source, name, t, want).map_err(backend_error)?;
        Ok(t)
    }

    /// The tensor `name` as a `dtype` parameter on `dev` ([`converted`]).
    fn convert(
        &self,
        name: &str,
        t: &Tensor,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        converted(&self.source, name, t, dtype, dev).map_err(backend_error)
    }
}

impl candle_nn::var_builder::SimpleBackend for CheckedTensors {
    fn get(
        &self,
        shape: candle_core::Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.find(name, dtype)?;
        if t.shape() != &shape {
            // The message form that `Error::from` turns into `Error::TensorShape`.
            return Err(candle_core::Error::UnexpectedShape {
                msg: format!("shape mismatch for {name}"),
                expected: shape,
                got: t.shape().clone(),
            });
        }
        self.convert(name, t, dtype, dev)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.convert(name, self.find(name, dtype)?, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
}

/// One metadata entry: `key` → `value` serialised as JSON.
pub(crate) fn json_entry<T: Serialize>(key: &str, value: &T) -> HashMap<String, String> {
    // serde_json fails only on maps with non-string keys and on a hand-written `Serialize`
    // that fails; the configurations have neither. Were it to happen, the entry says so and
    // reading it back is an `Error::Checkpoint` naming the key, not a panic here.
    let json = serde_json::to_string(value)
        .unwrap_or_else(|e| format!("<the configuration could not be serialised: {e}>"));
    HashMap::from([(key.to_string(), json)])
}

/// serde `deserialize_with` for the optional fields of configurations: a field that is present
/// must hold a `T`. `null` is refused rather than read as "not set": serde_json writes a NaN or
/// an infinity as `null`, and a configuration holding one must fail to load, not load without
/// it. (An unset field is left out when written and read back with `#[serde(default)]`.)
pub(crate) fn non_null<'de, D, T>(deserializer: D) -> std::result::Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::Deserialize<'de>,
{
    T::deserialize(deserializer).map(Some)
}

/// Longest stretch of a metadata value quoted in an error.
const QUOTED_CHARS: usize = 200;

/// Deserialises the JSON value of metadata entry `key`.
///
/// # Errors
/// [`Error::Checkpoint`] naming `key` when it is missing (pointing out keys of the earlier
/// one-key-per-field format when the file has them) or its value does not deserialise (with
/// serde_json's message and the value, shortened past [`QUOTED_CHARS`] characters).
pub(crate) fn read_json_entry<T: DeserializeOwned>(
    metadata: &HashMap<String, String>,
    source: &str,
    key: &str,
) -> Result<T> {
    let bad = |reason: String| Error::Checkpoint {
        path: source.into(),
        reason: format!("metadata `{key}`: {reason}"),
    };
    let Some(raw) = metadata.get(key) else {
        // `posenc.kind` first: it names the old format best.
        let legacy = metadata
            .keys()
            .filter(|k| {
                (k.starts_with("posenc.") || k.starts_with("attention."))
                    && ![ENCODING_KEY, ATTENTION_KEY].contains(&k.as_str())
            })
            .min_by_key(|k| (k.as_str() != "posenc.kind", k.as_str()));
        return Err(bad(match legacy {
            Some(old) => format!(
                "missing; the file has `{old}`, a key of the earlier one-key-per-field format, \
                 which is no longer read (each configuration is now one JSON value)"
            ),
            None => "missing".into(),
        }));
    };
    serde_json::from_str(raw).map_err(|e| {
        let shown: String = raw.chars().take(QUOTED_CHARS).collect();
        let more = if shown.len() < raw.len() { "..." } else { "" };
        bad(format!("{e}, in `{shown}{more}`"))
    })
}
