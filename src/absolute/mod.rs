//! Absolute encodings: a vector per position, added to the token embeddings.
//!
//! They share the addition `x + p[positions]` implemented here, so each file only says how its
//! table is made; [`embeddings::Embeddings`] is the input layer that adds them once.

pub mod embeddings;
pub mod learned;
pub mod scaled_sinusoidal;
pub mod sinusoidal;

use candle_core::Tensor;

use crate::error::Result;
use crate::positions::Positions;

/// Rows of `table` (`(N, D)`) at `positions` for a chunk of `len` tokens: `(1, T, D)` for an
/// offset, `(B, T, D)` for explicit ids. The caller guarantees the positions are inside the table.
pub(crate) fn gather_rows(table: &Tensor, positions: &Positions, len: usize) -> Result<Tensor> {
    match positions {
        Positions::Offset(start) => Ok(table.narrow(0, *start, len)?.unsqueeze(0)?),
        Positions::Ids(ids) => {
            let (b, t) = ids.ids().dims2()?;
            let rows = table.index_select(&ids.ids().flatten_all()?, 0)?;
            Ok(rows.reshape((b, t, table.dim(1)?))?)
        }
    }
}

/// Adds `rows` (broadcast over the batch) to `x`, cast to `x`'s dtype, then applies dropout.
pub(crate) fn add_and_dropout(
    x: &Tensor,
    rows: &Tensor,
    dropout: f32,
    train: bool,
) -> Result<Tensor> {
    let out = x.broadcast_add(&rows.to_dtype(x.dtype())?)?;
    if train && dropout > 0.0 {
        Ok(candle_nn::ops::dropout(&out, dropout)?)
    } else {
        Ok(out)
    }
}
