//! Attention and the plug through which it consumes any positional encoding.
//!
//! Every positional encoding enters attention in one or more of four ways, and
//! [`PositionalEncoding`] has one hook for each, all no-ops by default:
//!
//! | hook | what happens | encodings |
//! |---|---|---|
//! | [`add_to_input`](PositionalEncoding::add_to_input) | `x + p[pos]` before the q/k/v projections | sinusoidal, learned |
//! | [`rotate_queries_keys`](PositionalEncoding::rotate_queries_keys) | `q' = R(pos_q) q`, `k' = R(pos_k) k` after projection | rotary |
//! | [`logits_bias`](PositionalEncoding::logits_bias) (or, compact, [`relative_logits_bias`](PositionalEncoding::relative_logits_bias)) | `scores += b(pos_q, pos_k)`, may read `q` | ALiBi, T5, relative bias, Shaw keys |
//! | [`value_term`](PositionalEncoding::value_term) (or, compact, [`relative_value_term`](PositionalEncoding::relative_value_term)) | `out += Σ_j α_ij a(i, j)` | Shaw values |
//!
//! [`MultiHeadAttention`] calls the four hooks and never looks at the concrete encoding type.

mod config;
mod fused_attention;
mod fused_softmax;
mod kv_cache;
mod mask;
mod mha;
mod relative_bias;

pub use config::{AttentionConfig, AttentionOptions, AttentionOutput, DEFAULT_LOGITS_BUDGET};
pub use kv_cache::KvCache;
pub use mha::MultiHeadAttention;
pub(crate) use relative_bias::{bucket_sums, bucket_sums_apply};
pub use relative_bias::{RelativeBias, RelativeValues};

use candle_core::Tensor;

use crate::{Positions, Result};

/// The plug: what an encoding does inside attention. Implement only the hooks you use.
///
/// All hooks receive positions as [`Positions`]; `q_positions` are the positions of the current
/// chunk of queries, `k_positions` those of every key attended to (cached keys included).
pub trait PositionalEncoding: std::fmt::Debug + Send + Sync {
    /// Input hook: returns `x` with position information added.
    ///
    /// # Shapes
    /// `x`: `(B, T, d_model)` → `(B, T, d_model)`.
    ///
    /// # Errors
    /// Implementations report shape and range problems.
    fn add_to_input(&self, x: &Tensor, positions: &Positions, train: bool) -> Result<Tensor> {
        let _ = (positions, train);
        Ok(x.clone())
    }

    /// Rotation hook: rotates freshly projected queries and keys (before keys enter a cache).
    ///
    /// # Shapes
    /// `q`: `(B, H, Tq, D)`, `k`: `(B, Hkv, Tk_new, D)`; returns the same shapes.
    ///
    /// # Errors
    /// Implementations report shape and range problems.
    fn rotate_queries_keys(
        &self,
        q: &Tensor,
        k: &Tensor,
        q_positions: &Positions,
        k_positions: &Positions,
    ) -> Result<(Tensor, Tensor)> {
        let _ = (q_positions, k_positions);
        Ok((q.clone(), k.clone()))
    }

    /// The rotation hook for queries and keys the caller no longer needs: an implementation may
    /// rotate them in place. The attention block calls this one, with freshly projected
    /// tensors. Defaults to [`Self::rotate_queries_keys`].
    ///
    /// # Shapes
    /// As [`Self::rotate_queries_keys`].
    ///
    /// # Errors
    /// As [`Self::rotate_queries_keys`].
    fn rotate_queries_keys_owned(
        &self,
        q: Tensor,
        k: Tensor,
        q_positions: &Positions,
        k_positions: &Positions,
    ) -> Result<(Tensor, Tensor)> {
        self.rotate_queries_keys(&q, &k, q_positions, k_positions)
    }

    /// Bias hook: an additive term for the attention logits, or `None`.
    ///
    /// `q` is the rotated query already multiplied by the softmax scale, so a bias that reads
    /// `q` (Shaw keys) is on the same scale as `q·kᵀ`; the returned bias is added to the scaled
    /// logits as is.
    ///
    /// # Shapes
    /// `q`: `(B, H, Tq, D)`; returns a tensor broadcastable to `(B, H, Tq, Tk)`.
    ///
    /// # Errors
    /// Implementations report shape and range problems.
    fn logits_bias(
        &self,
        q: &Tensor,
        q_positions: &Positions,
        k_positions: &Positions,
        k_len: usize,
    ) -> Result<Option<Tensor>> {
        let _ = (q, q_positions, k_positions, k_len);
        Ok(None)
    }

    /// The bias hook in compact form, for relative biases: the same bias as
    /// [`Self::logits_bias`], given as rows of values per distance ([`RelativeBias`]), or `None`
    /// (the default) to have the caller use [`Self::logits_bias`].
    ///
    /// The attention block asks for this form on its fused CPU inference path, which reads the
    /// rows directly instead of a `(B, H, Tq, Tk)` tensor. Implementations typically answer for
    /// offset positions only.
    ///
    /// # Shapes
    /// As [`Self::logits_bias`]; the values are `(1|B, H, 1|Tq, W)`.
    ///
    /// # Errors
    /// As [`Self::logits_bias`].
    fn relative_logits_bias(
        &self,
        q: &Tensor,
        q_positions: &Positions,
        k_positions: &Positions,
        k_len: usize,
    ) -> Result<Option<RelativeBias>> {
        let _ = (q, q_positions, k_positions, k_len);
        Ok(None)
    }

    /// Value hook: a term added to the attention output before the heads are merged, or `None`.
    ///
    /// # Shapes
    /// `probs`: the attention weights `(B, H, Tq, Tk)`; returns `(B, H, Tq, D)` or a tensor
    /// broadcastable to it.
    ///
    /// # Errors
    /// Implementations report shape and range problems.
    fn value_term(
        &self,
        probs: &Tensor,
        q_positions: &Positions,
        k_positions: &Positions,
    ) -> Result<Option<Tensor>> {
        let _ = (probs, q_positions, k_positions);
        Ok(None)
    }

    /// The value hook in compact form, for relative values: the same term as
    /// [`Self::value_term`], given as one table row per clamped distance ([`RelativeValues`]),
    /// or `None` (the default).
    ///
    /// The attention block's fused CPU inference path never builds the weights `value_term`
    /// reads; it sums them per distance as it goes and asks for this form instead. Without it,
    /// an encoding with a value term takes the unfused path.
    ///
    /// # Errors
    /// Implementations report shape and range problems.
    fn relative_value_term(
        &self,
        q_positions: &Positions,
        k_positions: &Positions,
    ) -> Result<Option<RelativeValues>> {
        let _ = (q_positions, k_positions);
        Ok(None)
    }

    /// Whether [`Self::value_term`] may return a term.
    ///
    /// The attention block's fused CPU inference path never builds the weights the value hook
    /// reads, so for an encoding that answers `true` it runs only with
    /// [`Self::relative_value_term`]. The default, `true`, is always correct; an encoding
    /// without a value term overrides it to get the fast path.
    fn has_value_term(&self) -> bool {
        true
    }
}
