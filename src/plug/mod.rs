//! The plug between positional encodings and attention: four hooks, one context, data forms.
//!
//! Every positional encoding enters attention in one or more of four ways, and
//! [`PositionalEncoding`] has one hook for each, all no-ops by default:
//!
//! | hook | what happens | encodings |
//! |---|---|---|
//! | [`add_to_input`](PositionalEncoding::add_to_input) | `x + p[pos]` before the q/k/v projections | sinusoidal, learned |
//! | [`rotate`](PositionalEncoding::rotate) | `q' = R(pos_q) q`, `k' = R(pos_k) k` after projection | rotary |
//! | [`logits_bias`](PositionalEncoding::logits_bias) | `scores += b(pos_q, pos_k)`, may read `q` or per-token states | ALiBi, T5, clipped bias, Shaw keys, FoX |
//! | [`value_term`](PositionalEncoding::value_term) | `out_i += Σ_j α_ij table[c(i, j)]` | Shaw values |
//!
//! Each hook receives an [`AttentionContext`]: the positions of the queries and keys, how many
//! keys there are, whether attention is causal and whether it trains. An answer must be a
//! function of those positions, not of how the block cut its queries: the block asks for query
//! blocks of the sizes each execution path runs (the fused cores one block where candle's ops
//! run the logits budget's), and expects the same bias for a pair of positions in any of them.
//! Encodings answer with
//! data, not with code the block must call back: a bias is a dense tensor, rows per clamped
//! distance or one value per query plus one per key ([`LogitsBias`], [`RelativeBias`],
//! [`SeparableBias`]); a value term is a table row per clamped distance
//! ([`RelativeValues`]). The block decides how each form is consumed on each of its execution
//! paths (a fused CPU core that reads the rows directly, a row pass, plain candle ops that
//! expand them), and never looks at the concrete encoding type. Beside the hooks, an encoding
//! may declare its [`Footprint`]: how wide its answers get per query, which the block sizes its
//! query blocks from before it asks for any, and its [`Content`]: whether its answers read
//! per-token states computed from the block's input (FoX's forget gates) through a fifth hook,
//! [`PositionalEncoding::token_states`], whose answers the block (and its KV cache) keeps
//! beside the keys.
//!
//! This module depends on neither the encodings nor the attention block; both depend on it.

pub(crate) mod mixed;
pub(crate) mod relative;
pub(crate) mod separable;

pub(crate) use relative::row_segments_from;
pub use relative::{Columns, RelativeBias, RelativeValues};
pub use separable::SeparableBias;

use std::sync::Arc;

use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;

use crate::error::{check_device, Error, Result};
use crate::positions::Positions;

/// What a hook knows about the attention it serves.
///
/// For [`PositionalEncoding::add_to_input`] and [`PositionalEncoding::rotate`] the keys are the
/// chunk's own fresh tokens (`keys` and `k_len` equal `queries` and `q_len`: keys are rotated
/// once, at their own positions, before they enter a cache). For
/// [`PositionalEncoding::logits_bias`] and [`PositionalEncoding::value_term`] the queries are
/// one query block and the keys every key that block attends to, cached ones included.
///
/// The struct is `#[non_exhaustive]`: it grows (a layer index, a window) without breaking
/// encodings that read it. Build one with [`AttentionContext::new`] and the `with_*` setters.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct AttentionContext<'a> {
    /// Positions of the queries.
    pub queries: &'a Positions,
    /// Number of queries.
    pub q_len: usize,
    /// Positions of the keys.
    pub keys: &'a Positions,
    /// Number of keys.
    pub k_len: usize,
    /// Whether each query sees only keys at or before it.
    pub causal: bool,
    /// Whether the caller never reads the answers for the keys a causal query does not see
    /// (keys past its own position): they are masked and no row is masked whole (a row masked
    /// whole is uniform over every key), as in the crate's block without padding or a user's
    /// mask. A bias may then answer anything for those pairs, and Shaw's products stop at
    /// distance 0. Default `false`: a hook answers every pair exactly.
    pub masks_unseen: bool,
    /// Training mode (dropout on, gradients expected).
    pub train: bool,
    /// Whether the softmax has sink logits (gpt-oss). Without them the weights ignore a
    /// constant added along a logits row, so a bias may be given in a form that differs from
    /// its formula by one (ALiBi's per-key causal form); with them it may not.
    pub sinks: bool,
    /// The per-token states of the block's queries and keys, for an encoding that declares
    /// [`Content::Input`] (given to [`PositionalEncoding::logits_bias`] and
    /// [`PositionalEncoding::value_term`]); `None` otherwise.
    pub states: Option<&'a TokenStates>,
}

impl<'a> AttentionContext<'a> {
    /// `q_len` queries at `queries` against `k_len` keys at `keys`; bidirectional, inference.
    pub fn new(queries: &'a Positions, q_len: usize, keys: &'a Positions, k_len: usize) -> Self {
        Self {
            queries,
            q_len,
            keys,
            k_len,
            causal: false,
            masks_unseen: false,
            train: false,
            sinks: false,
            states: None,
        }
    }

    /// The context of a chunk's own tokens: queries and keys at `positions`, `len` of each.
    pub fn chunk(positions: &'a Positions, len: usize) -> Self {
        Self::new(positions, len, positions, len)
    }

    /// Checks the context's positions before a hook computes distances from them: each offset
    /// with its length within [`crate::positions::MAX_POSITION`] (so every key − query
    /// distance fits `i64`), even when the other side is empty; ids holding their chunk's
    /// tokens. Every relative encoding runs this one check.
    ///
    /// # Errors
    /// [`crate::Error::InvalidConfig`] naming the position offset; [`crate::Error::Shape`] for
    /// ids of another length than `q_len` / `k_len`.
    pub fn check_positions(&self) -> Result<()> {
        crate::positions::check_ranges(self.queries, self.q_len, self.keys, self.k_len)
    }

    /// Sets causality.
    pub fn with_causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }

    /// Sets whether the caller masks the keys a causal query does not see.
    pub fn with_masks_unseen(mut self, masks_unseen: bool) -> Self {
        self.masks_unseen = masks_unseen;
        self
    }

    /// Sets training mode.
    pub fn with_train(mut self, train: bool) -> Self {
        self.train = train;
        self
    }

    /// Sets whether the softmax has sink logits.
    pub fn with_sinks(mut self, sinks: bool) -> Self {
        self.sinks = sinks;
        self
    }

    /// Sets the queries' and keys' per-token states.
    pub fn with_states(mut self, states: Option<&'a TokenStates>) -> Self {
        self.states = states;
        self
    }
}

/// What an encoding's answers read besides positions ([`PositionalEncoding::content`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Content {
    /// Positions only (the default).
    #[default]
    Positions,
    /// Per-token states computed from the block's input by
    /// [`PositionalEncoding::token_states`]: the block keeps them beside its keys (a
    /// [`KvCache`](crate::KvCache) holds the cached tokens' states) and hands each query
    /// block's to the bias and value hooks ([`AttentionContext::states`]).
    Input,
    /// As [`Content::Input`], with states that are running sums over the sequence of a
    /// per-token term (FoX's cumulative log gates), read only through their differences: a
    /// streaming cache that forgets tokens takes their terms out of the sums of the tokens
    /// it keeps after them, so that the held tokens' states are those of the held tokens in
    /// a row (as their positions are their slots).
    RunningSums,
}

impl Content {
    /// Whether the answers read per-token states from the block's input
    /// ([`Content::Input`] or [`Content::RunningSums`]).
    pub fn reads_input(self) -> bool {
        matches!(self, Content::Input | Content::RunningSums)
    }
}

/// The per-token states of one query block's queries and keys, as the block hands them to
/// the bias and value hooks of an encoding that reads its input ([`Content::Input`]).
///
/// # Shapes
/// `queries`: `(B, C, Tq)`; `keys`: `(B, C, Tk)`, the cached tokens' first; query `i`'s own
/// token is key `first + i`.
#[derive(Debug, Clone)]
pub struct TokenStates {
    /// The queries' states, `(B, C, Tq)`.
    pub queries: Tensor,
    /// Every key's states, `(B, C, Tk)`.
    pub keys: Tensor,
    /// The key index of the first query's own token.
    pub first: usize,
}

/// An additive term for the attention logits, as returned by
/// [`PositionalEncoding::logits_bias`]. New forms may be added: a `match` outside the crate
/// needs a wildcard arm.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum LogitsBias {
    /// A tensor broadcastable to `(B, H, Tq, Tk)` (e.g. ALiBi's per-key `(1, H, 1, Tk)` row).
    Dense(Tensor),
    /// Rows of values per clamped column ([`RelativeBias`]): never expanded on the fused CPU
    /// path, expanded to `(B, H, Tq, Tk)` by the others.
    Relative(RelativeBias),
    /// One value per query plus one per key ([`SeparableBias`]): never expanded on the fused
    /// CPU paths, expanded to `(B, H, Tq, Tk)` by the others.
    Separable(SeparableBias),
}

impl LogitsBias {
    /// The bias for `tq` queries and `tk` keys as a tensor broadcastable to `(B, H, Tq, Tk)`:
    /// a dense bias as it is, rows expanded ([`RelativeBias::to_dense`]), a separable bias
    /// summed ([`SeparableBias::to_dense`]).
    ///
    /// # Errors
    /// As [`RelativeBias::to_dense`] and [`SeparableBias::to_dense`].
    pub fn to_dense(&self, tq: usize, tk: usize) -> Result<Tensor> {
        match self {
            LogitsBias::Dense(t) => Ok(t.clone()),
            LogitsBias::Relative(rows) => rows.to_dense(tq, tk),
            LogitsBias::Separable(pairs) => pairs.to_dense(tq, tk),
        }
    }
}

/// The plug: what an encoding does inside attention. Implement only the hooks you use.
///
/// # Example
/// A third-party bias is one `impl`: here `−|j − i|` for every head, as rows per distance, which
/// the block's fused CPU core reads without building a `(B, H, T, T)` tensor.
/// ```
/// use candle_core::{Device, Tensor};
/// use candle_posenc::plug::{AttentionContext, Columns, LogitsBias, PositionalEncoding, RelativeBias};
/// use candle_posenc::{Positions, Result};
///
/// #[derive(Debug)]
/// struct Distance;
///
/// impl PositionalEncoding for Distance {
///     fn logits_bias(&self, q: &Tensor, ctx: &AttentionContext) -> Result<Option<LogitsBias>> {
///         let (Positions::Offset(qs), Positions::Offset(ks)) = (ctx.queries, ctx.keys) else {
///             return Ok(None); // (a real encoding would answer explicit ids too)
///         };
///         // Column c holds distance d = c − (q_len − 1) + ks − qs.
///         let width = ctx.q_len + ctx.k_len - 1;
///         let d0 = *ks as i64 - *qs as i64 - (ctx.q_len as i64 - 1);
///         let row: Vec<f32> = (0..width as i64).map(|c| -((d0 + c).abs() as f32)).collect();
///         let values = Tensor::from_vec(row, (1, 1, 1, width), q.device())?;
///         let shift = ctx.q_len as i64 - 1;
///         Ok(Some(LogitsBias::Relative(RelativeBias::new(values, Columns::Shift(shift))?)))
///     }
/// }
/// # Ok::<(), candle_posenc::Error>(())
/// ```
pub trait PositionalEncoding: std::fmt::Debug + Send + Sync {
    /// Input hook: returns `x` with position information added.
    ///
    /// # Shapes
    /// `x`: `(B, T, d_model)` → `(B, T, d_model)`; `ctx.queries` are `x`'s positions.
    ///
    /// # Errors
    /// Implementations report shape and range problems.
    fn add_to_input(&self, x: &Tensor, ctx: &AttentionContext) -> Result<Tensor> {
        let _ = ctx;
        Ok(x.clone())
    }

    /// Rotation hook: rotates freshly projected queries and keys (before keys enter a cache).
    ///
    /// The block hands over tensors it no longer needs, so an implementation may rotate them in
    /// place and return them.
    ///
    /// # Shapes
    /// `q`: `(B, H, Tq, D)`, `k`: `(B, Hkv, Tk_new, D)`; returns the same shapes (checked by
    /// the block).
    ///
    /// # Errors
    /// Implementations report shape and range problems.
    fn rotate(&self, q: Tensor, k: Tensor, ctx: &AttentionContext) -> Result<(Tensor, Tensor)> {
        let _ = ctx;
        Ok((q, k))
    }

    /// Bias hook: an additive term for the attention logits of one query block, or `None`.
    ///
    /// `q` is the block's rotated query already multiplied by the softmax scale, so a bias that
    /// reads `q` (Shaw keys) is on the same scale as `q·kᵀ`; the bias is added to the scaled
    /// logits as is.
    ///
    /// # Shapes
    /// `q`: `(B, H, Tq, D)`; a [`LogitsBias::Dense`] broadcasts to `(B, H, Tq, Tk)`, a
    /// [`LogitsBias::Relative`] has `(1|B, 1|H, 1|Tq, W)` values, a [`LogitsBias::Separable`]
    /// `(1|B, 1|H, Tq)` and `(1|B, 1|H, Tk)` pairs (checked by the block).
    ///
    /// # Errors
    /// Implementations report shape and range problems.
    fn logits_bias(&self, q: &Tensor, ctx: &AttentionContext) -> Result<Option<LogitsBias>> {
        let _ = (q, ctx);
        Ok(None)
    }

    /// Value hook: a term added to one query block's attention output before the heads are
    /// merged, as a table row per clamped column, or `None`.
    ///
    /// # Shapes
    /// The table is `(W, D)`, shared by every batch item and head (checked by the block).
    ///
    /// # Errors
    /// Implementations report shape and range problems.
    fn value_term(&self, ctx: &AttentionContext) -> Result<Option<RelativeValues>> {
        let _ = ctx;
        Ok(None)
    }

    /// Content hook: per-token states computed from the block's input, which the bias and
    /// value hooks then read through [`AttentionContext::states`], for an encoding that
    /// declares [`Content::Input`] (the block calls it for no other). `carried` holds the
    /// states of the tokens a [`KvCache`](crate::KvCache) holds before this chunk, which a
    /// state that runs over the sequence (a cumulative sum) continues; the block appends the
    /// answer to them. Gradients flow from the answers back to `x` and to the encoding's
    /// parameters.
    ///
    /// # Shapes
    /// `x`: `(B, T, d_model)`, the block's input; `carried`: `(B, C, T_cached)`; returns
    /// `(B, C, T)` (checked by the block).
    ///
    /// # Errors
    /// Implementations report shape and range problems.
    fn token_states(
        &self,
        x: &Tensor,
        carried: Option<&Tensor>,
        ctx: &AttentionContext,
    ) -> Result<Option<Tensor>> {
        let _ = (x, carried, ctx);
        Ok(None)
    }

    /// A declaration, not a hook: what the answers read besides positions. With
    /// [`Content::Input`] the block calls [`Self::token_states`] on its input and hands each
    /// query block's states to the bias and value hooks. Default [`Content::Positions`].
    fn content(&self) -> Content {
        Content::Positions
    }

    /// A declaration, not a hook: how much of the answers for a query block of `ctx` grows
    /// with its queries, so that the block sizes its query blocks before it asks for any
    /// answer. `ctx` is the whole call (every query, every key); a declared width bounds the
    /// answers for any block of it. Default [`Footprint::Unknown`].
    fn footprint(&self, ctx: &AttentionContext) -> Footprint {
        let _ = ctx;
        Footprint::Unknown
    }

    /// A declaration, not a hook: whether the logits [`Self::rotate`] gives depend on the
    /// positions of a query and a key only through their difference, at any positions (RoPE
    /// at frequencies that do not follow the sequence's length, without xPos's scale), and
    /// the encoding has no other hook that reads positions. A streaming
    /// [`KvCache`](crate::KvCache) then keeps its keys rotated and a decoding step rotates
    /// only its own token and the cache's sinks, instead of every held key at its slot; the
    /// rotation hook may then be handed keys with no queries (`(B, H, 0, D)`), and queries
    /// already multiplied by the softmax scale (the rotation is linear in them). Default
    /// `false`.
    fn relative_rotation(&self) -> bool {
        false
    }

    /// A declaration, not a hook: whether the block may hand [`Self::rotate`] and the other
    /// hooks queries already multiplied by the softmax scale: the rotation is linear in the
    /// queries (a rotation, a factor per query) and no hook reads their values, only their
    /// shape. The block then takes the scale into the queries' projection, one pass over
    /// them fewer. Default: [`Self::relative_rotation`] (which implies it).
    fn scaled_queries(&self) -> bool {
        self.relative_rotation()
    }

    /// A declaration, not a hook: whether the encoding acts on attention only through
    /// [`Self::rotate`] (every other hook keeps its default), rotating q and k linearly (so
    /// the block may hand it queries already multiplied by the softmax scale), with
    /// [`Self::rotate_adjoint`] its adjoint. A training call of a block with nothing else
    /// between its projections and its core then runs as one node of candle's graph: q and k
    /// rotated outside the graph, their gradients by the adjoint. (A rotation whose result
    /// tracks gradients of its own, learned frequencies, is left in the graph whatever it
    /// declares.) Default `false`.
    fn rotation_only(&self) -> bool {
        false
    }

    /// A declaration, not a hook: whether the encoding acts on attention only through
    /// [`Self::add_to_input`] (every other hook keeps its default), as absolute encodings do.
    /// The block then adds the positions first and runs the rest as it runs a block without
    /// an encoding: a call with nothing else between its projections and its core as one node
    /// of candle's graph (training) or one pass (inference). Default `false`.
    fn input_only(&self) -> bool {
        false
    }

    /// The adjoint of [`Self::rotate`], for an encoding that declares
    /// [`Self::rotation_only`]: the gradients of the q and k it was handed from those of its
    /// outputs, `Rᵀ ∂q'` and `Rᵀ ∂k'` (for a rotation by θ, the rotation by −θ), with the
    /// context `rotate` was given. The block hands over gradients it owns, which may be
    /// overwritten in place.
    ///
    /// # Shapes
    /// `dq`: `(B, H, Tq, D)`, `dk`: `(B, Hkv, Tk, D)`; returns the same shapes.
    ///
    /// # Errors
    /// The default: [`Error::InvalidConfig`], as no encoding without the declaration is asked.
    fn rotate_adjoint(
        &self,
        dq: Tensor,
        dk: Tensor,
        ctx: &AttentionContext,
    ) -> Result<(Tensor, Tensor)> {
        let _ = (dq, dk, ctx);
        Err(Error::config(
            "rotate_adjoint",
            "called",
            "an encoding that declares rotation_only",
        ))
    }
}

/// How much of an encoding's answers for a query block grows with the block's queries
/// ([`PositionalEncoding::footprint`]). The fused cores allocate no logits, so answers with a
/// row per query are what their query blocks hold: a declared width lets them take as many
/// queries as the logits budget holds of those rows. A declaration is checked against the
/// first block's answers: answers wider than declared shrink the blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Footprint {
    /// Not declared: the block reads the first block's answers, at the logits' block size,
    /// and takes every query in one block only when they do not grow with the queries.
    #[default]
    Unknown,
    /// At most `bias` columns per query of a relative bias read through a shift (Shaw's
    /// `q · aᴷ` rows), and a value term of at most `values` rows read through a shift (0:
    /// none); nothing else that grows with the queries.
    Rows {
        /// Columns per query of the bias rows.
        bias: usize,
        /// Rows of the value table.
        values: usize,
    },
}

/// Whether two tensors are views of one storage: a hook may rotate what it is handed in place,
/// so the block never hands it a tensor that shares storage with one it still reads.
pub(crate) fn shares_storage(a: &Tensor, b: &Tensor) -> bool {
    let (sa, _) = a.storage_and_layout();
    let pa: *const candle_core::Storage = &*sa;
    drop(sa);
    let (sb, _) = b.storage_and_layout();
    std::ptr::eq(pa, &*sb)
}

/// Checks an input hook's answer `y` against the input `x` it was given: the same shape, dtype
/// and device (an answer with a token more, or widened to f64 for an f32 model, is not the
/// input with positions added). The one check every caller of
/// [`PositionalEncoding::add_to_input`] runs on what it gets back, before using it.
///
/// # Errors
/// [`crate::Error::Shape`], [`crate::Error::DType`] or [`crate::Error::Device`] naming the
/// answer and what the input was.
pub(crate) fn check_input_answer(y: Tensor, x: &Tensor) -> Result<Tensor> {
    let what = "input with positions added (the input hook's answer)";
    if y.dims() != x.dims() {
        return Err(Error::shape(
            what,
            format!("{:?}, the shape of the input given to the hook", x.dims()),
            y.shape(),
        ));
    }
    if y.dtype() != x.dtype() {
        return Err(Error::DType {
            what,
            expected: match x.dtype() {
                DType::F32 => "f32, the dtype of the input given to the hook",
                DType::F64 => "f64, the dtype of the input given to the hook",
                DType::BF16 => "bf16, the dtype of the input given to the hook",
                DType::F16 => "f16, the dtype of the input given to the hook",
                _ => "the dtype of the input given to the hook",
            },
            got: y.dtype(),
        });
    }
    check_device(what, &y, x.device())?;
    Ok(y)
}

/// What each configuration in `EncodingConfig` provides: its checks and the encoding it
/// builds. Implemented in each scheme's own file, beside its configuration.
pub(crate) trait SchemeConfig {
    /// Checks the configuration.
    fn validate(&self) -> Result<()>;
    /// Builds the encoding, its learned tables loaded from (or created in) `vb`.
    fn build(&self, vb: VarBuilder) -> Result<Arc<dyn PositionalEncoding>>;
}
