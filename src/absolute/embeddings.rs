//! The input layer of a transformer with an absolute encoding: token embeddings plus positions,
//! once, before the first block (GPT-2's `wte` + `wpe`, BERT's word + position embeddings).
//!
//! ```text
//! h = E[tokens] + p[positions]          then the encoding's dropout, in training
//! tokens: (B, T) integer ids < vocab_size,  E: (vocab_size, d_model),  h: (B, T, d_model)
//! ```
//!
//! An absolute encoding belongs here, not in every attention block: given to a
//! [`MultiHeadAttention`](crate::attention::MultiHeadAttention), its input hook adds the
//! positions to that block's input again, which is what the original Transformer's encoder
//! stack does not do. Decoding continues the positions from a cache: pass
//! `cache.continuation(chunk_len)?` for each new chunk (each sequence one past its own last
//! position, which a left-padded batch needs; `Positions::Offset(cache.next_position())` where
//! every row ends alike).

use std::sync::Arc;

use candle_core::{DType, Module, Tensor};
use candle_nn::{Embedding, Init, VarBuilder};
use serde::{Deserialize, Serialize};

use crate::error::{check_var_builder, learned, Error, Result};
use crate::limits::check_elements;
use crate::plug::{check_input_answer, AttentionContext, PositionalEncoding};
use crate::positions::Positions;

/// Configuration of [`Embeddings`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingsConfig {
    /// Number of token ids, > 0.
    pub vocab_size: usize,
    /// Width of each embedding, > 0.
    pub d_model: usize,
}

impl EmbeddingsConfig {
    /// `vocab_size` tokens of width `d_model` (no other settings: dropout is the encoding's).
    pub fn new(vocab_size: usize, d_model: usize) -> Self {
        Self {
            vocab_size,
            d_model,
        }
    }

    /// Checks every field.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a zero size or a table past the size budget.
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [("vocab_size", self.vocab_size), ("d_model", self.d_model)] {
            if v == 0 {
                return Err(Error::config(name, v, "at least 1"));
            }
        }
        check_elements(
            "vocab_size",
            self.vocab_size,
            "vocab_size × d_model",
            &[self.vocab_size, self.d_model],
        )?;
        Ok(())
    }
}

/// Token embeddings plus an optional absolute positional encoding.
///
/// # Example
/// ```
/// use std::sync::Arc;
/// use candle_core::{DType, Device, Module, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use candle_posenc::absolute::embeddings::{Embeddings, EmbeddingsConfig};
/// use candle_posenc::{LearnedConfig, LearnedPositionalEncoding, Positions};
///
/// let dev = Device::Cpu;
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
/// // GPT-2's names: `wte.weight` and `wpe.weight`.
/// let wpe = LearnedPositionalEncoding::new(&LearnedConfig::new(32).with_max_len(64), vb.pp("wpe"))?;
/// let embed = Embeddings::new(&EmbeddingsConfig::new(100, 32), Some(Arc::new(wpe)), vb.pp("wte"))?;
/// let tokens = Tensor::new(&[[3u32, 14, 15, 92]], &dev)?;
/// assert_eq!(embed.forward(&tokens)?.dims(), &[1, 4, 32]);
/// // The next token, at position 4.
/// let next = embed.forward_with(&Tensor::new(&[[65u32]], &dev)?, &Positions::Offset(4), false)?;
/// assert_eq!(next.dims(), &[1, 1, 32]);
/// # Ok::<(), candle_posenc::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Embeddings {
    config: EmbeddingsConfig,
    tokens: Embedding,
    positions: Option<Arc<dyn PositionalEncoding>>,
}

impl Embeddings {
    /// Loads (or creates, N(0, 1) as `nn.Embedding` does) the table `weight`,
    /// `(vocab_size, d_model)`, from `vb`, and adds `positions` through its input hook.
    ///
    /// # Errors
    /// As [`EmbeddingsConfig::validate`]; [`Error::DType`] for a `VarBuilder` that is not f32,
    /// f64, bf16 or f16; [`Error::MissingTensor`] / [`Error::TensorShape`] from a checkpoint.
    pub fn new(
        config: &EmbeddingsConfig,
        positions: Option<Arc<dyn PositionalEncoding>>,
        vb: VarBuilder,
    ) -> Result<Self> {
        config.validate()?;
        check_var_builder("token embeddings (the VarBuilder's dtype)", &vb)?;
        let weight = learned(
            &vb,
            "token embeddings",
            (config.vocab_size, config.d_model),
            "weight",
            Init::Randn {
                mean: 0.0,
                stdev: 1.0,
            },
        )?;
        Ok(Self {
            config: *config,
            tokens: Embedding::new(weight, config.d_model),
            positions,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &EmbeddingsConfig {
        &self.config
    }

    /// The token table, `(vocab_size, d_model)`.
    pub fn weight(&self) -> &Tensor {
        self.tokens.embeddings()
    }

    /// `E[tokens] + p[positions]`, with the encoding's dropout when `train`.
    ///
    /// # Shapes
    /// `tokens`: `(B, T)` integer ids → `(B, T, d_model)`.
    ///
    /// # Errors
    /// [`Error::Rank`] unless `tokens` is 2-D; [`Error::DType`] for float ids;
    /// [`Error::InvalidConfig`] for an id past the vocabulary, on every device (on a GPU the
    /// check reads back one byte: its gather would read outside the table); the encoding's
    /// errors for the positions; [`Error::Shape`] / [`Error::DType`] / [`Error::Device`] for
    /// an encoding whose input hook answers with another shape, dtype or device than the
    /// embeddings it was given.
    pub fn forward_with(
        &self,
        tokens: &Tensor,
        positions: &Positions,
        train: bool,
    ) -> Result<Tensor> {
        let (_, t) = tokens.dims2().map_err(|_| Error::Rank {
            what: "token ids",
            expected: 2,
            got: tokens.rank(),
            shape: tokens.dims().to_vec(),
        })?;
        if !matches!(tokens.dtype(), DType::U8 | DType::U32 | DType::I64) {
            return Err(Error::DType {
                what: "token ids",
                expected: "an integer dtype (u8, u32 or i64)",
                got: tokens.dtype(),
            });
        }
        // Checked on every device: a GPU's gather does not check its ids, so one past the
        // table would read outside it. There the check reads back one byte.
        if !tokens.device().is_cpu() && tokens.elem_count() > 0 {
            let ids = tokens.flatten_all()?.to_dtype(DType::I64)?;
            let past = ids.ge(self.config.vocab_size as i64)?;
            let bad = (past + ids.lt(0i64)?)?.max_all()?.to_scalar::<u8>()?;
            if bad == 0 {
                let x = self.tokens.forward(tokens)?;
                return self.with_positions(x, positions, t, train);
            }
        }
        if tokens.elem_count() > 0 {
            let ids = tokens
                .flatten_all()?
                .to_dtype(DType::I64)?
                .to_vec1::<i64>()?;
            if let Some(bad) = ids
                .iter()
                .find(|&&id| id < 0 || id as u64 >= self.config.vocab_size as u64)
            {
                return Err(Error::config(
                    "token id",
                    bad,
                    format!("an id in 0..{} (vocab_size)", self.config.vocab_size),
                ));
            }
        }
        let x = self.tokens.forward(tokens)?;
        self.with_positions(x, positions, t, train)
    }

    /// `x` with the encoding's input term at `positions` (`t` tokens), if there is one.
    fn with_positions(
        &self,
        x: Tensor,
        positions: &Positions,
        t: usize,
        train: bool,
    ) -> Result<Tensor> {
        let Some(p) = &self.positions else {
            return Ok(x);
        };
        let ctx = AttentionContext::chunk(positions, t).with_train(train);
        check_input_answer(p.add_to_input(&x, &ctx)?, &x)
    }
}

impl Embeddings {
    /// Positions `0..T`, the encoding's dropout when `train` (candle's `ModuleT` for a
    /// `Module` ignores the flag, so this is an inherent method).
    ///
    /// # Errors
    /// As [`Self::forward_with`].
    pub fn forward_t(&self, tokens: &Tensor, train: bool) -> Result<Tensor> {
        self.forward_with(tokens, &Positions::Offset(0), train)
    }
}

impl Module for Embeddings {
    /// Positions `0..T`, inference (no dropout).
    fn forward(&self, tokens: &Tensor) -> candle_core::Result<Tensor> {
        Ok(self.forward_with(tokens, &Positions::Offset(0), false)?)
    }
}
