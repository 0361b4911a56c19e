//! Positions: where each token sits in its sequence.
//!
//! Every encoding in this crate takes a [`Positions`] value instead of assuming `0..T`:
//!
//! - [`Positions::Offset`]`(s)`: token `t` of every sequence is at position `s + t`. This is the
//!   common case, and the one a KV cache needs: after `n` cached tokens the next chunk starts at
//!   `n`.
//! - [`Positions::Ids`]: explicit per-token positions of shape `(B, T)` (or `(1, T)`, shared by
//!   the batch), for packed sequences or left padding; or three axes per token (temporal,
//!   height, width: [`PositionIds::multimodal`]) for multimodal RoPE.
//!
//! # Shapes
//! - position ids: `(B, T)` or `(1, T)`, any integer dtype (`u8`, `u32`, `i64`); stored as `u32`.
//!
//! Position ids are checked once, when a [`PositionIds`] is built (rank, dtype, no negative
//! value, and the largest id, which tables use to grow or to report an out-of-range position).
//! Forward passes never read them back to the host.

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};

/// Largest position id accepted (positions are stored as `u32`).
pub const MAX_POSITION: usize = u32::MAX as usize;

/// Explicit per-token position ids, validated.
#[derive(Debug, Clone)]
pub struct PositionIds {
    ids: Tensor,
    end: usize,
    /// `(3, B, T)` u32: temporal, height and width positions (multimodal RoPE).
    axes: Option<Tensor>,
}

impl PositionIds {
    /// Validates `ids` of shape `(B, T)` and integer dtype.
    ///
    /// # Errors
    /// [`Error::Rank`] unless the rank is 2, [`Error::DType`] for a float dtype, and
    /// [`Error::InvalidConfig`] for a negative id or one above [`MAX_POSITION`].
    pub fn new(ids: &Tensor) -> Result<Self> {
        if ids.rank() != 2 {
            return Err(Error::Rank {
                what: "position ids",
                expected: 2,
                got: ids.rank(),
                shape: ids.dims().to_vec(),
            });
        }
        if !matches!(ids.dtype(), DType::U8 | DType::U32 | DType::I64) {
            return Err(Error::DType {
                what: "position ids",
                expected: "an integer dtype (u8, u32 or i64)",
                got: ids.dtype(),
            });
        }
        let (_, t) = ids.dims2()?;
        check_chunk_len("position ids", t)?;
        if ids.elem_count() == 0 {
            return Ok(Self {
                ids: ids.to_dtype(DType::U32)?,
                end: 0,
                axes: None,
            });
        }
        // One host read per construction, never per forward pass.
        let as_i64 = ids.to_dtype(DType::I64)?.flatten_all()?;
        let min = as_i64.min(0)?.to_scalar::<i64>()?;
        let max = as_i64.max(0)?.to_scalar::<i64>()?;
        if min < 0 {
            return Err(Error::config("position id", min, "non-negative positions"));
        }
        if max as u64 > MAX_POSITION as u64 {
            return Err(Error::config(
                "position id",
                max,
                format!("positions up to {MAX_POSITION}"),
            ));
        }
        Ok(Self {
            ids: ids.to_dtype(DType::U32)?,
            end: max as usize + 1,
            axes: None,
        })
    }

    /// Validates multimodal positions `axes` of shape `(3, B, T)` (temporal, height, width, as
    /// Qwen2-VL's `get_rope_index` gives them, or [`crate::rotary::mrope::mrope_positions`]).
    ///
    /// Multimodal RoPE rotates each frequency band by its own axis. Everything else reads the
    /// temporal axis as the token's position, and [`Self::end`] is one past the largest position
    /// on any axis, where the text after them continues (as HF's position delta says).
    ///
    /// # Errors
    /// [`Error::Rank`] / [`Error::Shape`] unless `axes` is `(3, B, T)`; as [`Self::new`] for
    /// the dtype and the values.
    pub fn multimodal(axes: &Tensor) -> Result<Self> {
        if axes.rank() != 3 {
            return Err(Error::Rank {
                what: "multimodal position ids",
                expected: 3,
                got: axes.rank(),
                shape: axes.dims().to_vec(),
            });
        }
        if axes.dims()[0] != 3 {
            return Err(Error::shape(
                "multimodal position ids",
                "(3, B, T): temporal, height and width positions",
                axes.shape(),
            ));
        }
        let (_, b, t) = axes.dims3()?;
        check_chunk_len("multimodal position ids", b)?;
        // The checks of `new`, on all three axes at once.
        let all = Self::new(&axes.reshape((3 * b, t))?)?;
        let axes = all.ids.reshape((3, b, t))?;
        Ok(Self {
            ids: axes.get(0)?,
            end: all.end,
            axes: Some(axes),
        })
    }

    /// The multimodal axes `(3, B, T)` u32, when built by [`Self::multimodal`].
    pub fn axes(&self) -> Option<&Tensor> {
        self.axes.as_ref()
    }

    /// Axis `axis` (0 temporal, 1 height, 2 width) as plain ids, with the end of all three.
    pub(crate) fn axis(&self, axis: usize) -> Option<PositionIds> {
        let ids = self.axes.as_ref()?.get(axis).ok()?;
        Some(PositionIds {
            ids,
            end: self.end,
            axes: None,
        })
    }

    /// Builds ids from rows of host positions (one row per sequence).
    ///
    /// # Errors
    /// [`Error::Shape`] if the rows differ in length or there are none.
    pub fn from_rows(rows: &[Vec<u32>], device: &Device) -> Result<Self> {
        let len = rows.first().map(Vec::len).unwrap_or(0);
        if rows.is_empty() || rows.iter().any(|r| r.len() != len) {
            let lens: Vec<usize> = rows.iter().map(Vec::len).collect();
            return Err(Error::Shape {
                what: "position id rows",
                expected: "at least one row, all rows of the same length".into(),
                got: lens,
            });
        }
        let flat: Vec<u32> = rows.iter().flatten().copied().collect();
        let end = flat.iter().max().map_or(0, |&m| m as usize + 1);
        let ids = Tensor::from_vec(flat, (rows.len(), len), device)?;
        Ok(Self {
            ids,
            end,
            axes: None,
        })
    }

    /// The ids, `(B, T)` `u32`.
    pub fn ids(&self) -> &Tensor {
        &self.ids
    }

    /// One past the largest id (0 when empty).
    pub fn end(&self) -> usize {
        self.end
    }

    /// Batch size of the ids (1 when shared by the batch).
    pub fn batch(&self) -> usize {
        self.ids.dims()[0]
    }

    /// Number of tokens per sequence.
    pub fn len(&self) -> usize {
        self.ids.dims()[1]
    }

    /// Whether the ids hold no token.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Concatenates along the sequence, broadcasting a batch of 1 to the other's batch. When
    /// either side has multimodal axes, the other's ids become three equal axes (text tokens).
    fn concat(&self, other: &PositionIds) -> Result<PositionIds> {
        let batch = self.batch().max(other.batch());
        // A batch of 1 broadcast to the other's, three times over with multimodal axes:
        // budgeted before any of it exists.
        let len = self.len().saturating_add(other.len());
        let axes = if self.axes.is_some() || other.axes.is_some() {
            3
        } else {
            1
        };
        crate::limits::check_elements(
            "position ids",
            format_args!("batch {batch} × length {len}"),
            "axes × batch × length of the positions of a cache and a chunk together",
            &[axes, batch, len],
        )?;
        let a = broadcast_batch(&self.ids, batch)?;
        let b = broadcast_batch(&other.ids, batch)?;
        let axes = match (&self.axes, &other.axes) {
            (None, None) => None,
            _ => {
                let three = |p: &PositionIds, ids: &Tensor| -> Result<Tensor> {
                    Ok(match &p.axes {
                        Some(axes) => {
                            let (_, _, t) = axes.dims3()?;
                            axes.broadcast_as((3, batch, t))?.contiguous()?
                        }
                        None => ids.unsqueeze(0)?.repeat((3, 1, 1))?,
                    })
                };
                Some(Tensor::cat(&[&three(self, &a)?, &three(other, &b)?], 2)?)
            }
        };
        Ok(PositionIds {
            ids: Tensor::cat(&[&a, &b], 1)?,
            end: self.end.max(other.end),
            axes,
        })
    }
}

fn broadcast_batch(ids: &Tensor, batch: usize) -> Result<Tensor> {
    let (b, t) = ids.dims2()?;
    if b == batch {
        return Ok(ids.clone());
    }
    if b != 1 {
        return Err(Error::shape(
            "position ids",
            format!("batch 1 or {batch}"),
            ids.shape(),
        ));
    }
    Ok(ids.broadcast_as((batch, t))?.contiguous()?)
}

/// Where the tokens of a chunk sit: a start offset or explicit ids.
#[derive(Debug, Clone)]
pub enum Positions {
    /// Token `t` is at position `start + t` in every sequence of the batch.
    Offset(usize),
    /// Explicit per-token positions.
    Ids(PositionIds),
}

impl Default for Positions {
    fn default() -> Self {
        Positions::Offset(0)
    }
}

impl From<PositionIds> for Positions {
    fn from(ids: PositionIds) -> Self {
        Positions::Ids(ids)
    }
}

impl Positions {
    /// Positions `start..start + T`.
    pub fn offset(start: usize) -> Self {
        Positions::Offset(start)
    }

    /// Validated explicit ids of shape `(B, T)`; see [`PositionIds::new`].
    ///
    /// # Errors
    /// As [`PositionIds::new`].
    pub fn ids(ids: &Tensor) -> Result<Self> {
        Ok(Positions::Ids(PositionIds::new(ids)?))
    }

    /// Checks that these positions can describe a chunk of `batch` sequences of `len` tokens.
    ///
    /// # Errors
    /// [`Error::Shape`] if explicit ids are not `(batch, len)` or `(1, len)`;
    /// [`Error::InvalidConfig`] if an offset would pass [`MAX_POSITION`].
    pub fn check(&self, batch: usize, len: usize) -> Result<()> {
        match self {
            Positions::Offset(_) => self.check_offset(len),
            Positions::Ids(ids) => {
                if ids.len() != len || (ids.batch() != batch && ids.batch() != 1) {
                    return Err(Error::shape(
                        "position ids",
                        match batch {
                            1 => format!("(1, {len}) to match the input"),
                            _ => format!("({batch}, {len}) or (1, {len}) to match the input"),
                        },
                        ids.ids().shape(),
                    ));
                }
                Ok(())
            }
        }
    }

    /// The multimodal ids and their axes `(3, B, T)`, for an encoding that reads each token's
    /// row and column (the height and width axes): axial 2-D RoPE, RoPE-Mixed. The one check
    /// such encodings read their positions through, so that one position per token is never
    /// taken for a row and a column.
    ///
    /// # Errors
    /// [`Error::Positions`] naming `what` for an offset or ids without axes, saying which was
    /// given and that `needs` (what the encoding reads) comes only from
    /// [`PositionIds::multimodal`].
    pub(crate) fn grid_axes(
        &self,
        what: &'static str,
        needs: &str,
    ) -> Result<(&PositionIds, &Tensor)> {
        let got = match self {
            Positions::Ids(ids) => match ids.axes() {
                Some(axes) => return Ok((ids, axes)),
                None => format!(
                    "ids of shape {:?}, one position per token",
                    ids.ids().dims()
                ),
            },
            Positions::Offset(start) => format!(
                "an offset (tokens at {start}, {}, …), one position per token",
                start.saturating_add(1)
            ),
        };
        Err(Error::Positions {
            what,
            expected: format!(
                "multimodal ids (3, B, T) from PositionIds::multimodal: {needs} (one position per token has no row and column)"
            ),
            got,
        })
    }

    /// Checks that these positions can describe `len` tokens of some batch: an offset that
    /// stays within [`MAX_POSITION`], or ids holding `len` tokens per sequence.
    pub(crate) fn check_len(&self, len: usize) -> Result<()> {
        check_chunk_len("chunk length", len)?;
        match self {
            Positions::Offset(_) => self.check_offset(len),
            Positions::Ids(ids) if ids.len() != len => Err(Error::shape(
                "position ids",
                format!("(batch, {len}) to match the {len} tokens"),
                ids.ids().shape(),
            )),
            Positions::Ids(_) => Ok(()),
        }
    }

    /// For an offset, checks that `start + len` stays within `MAX_POSITION + 1`.
    fn check_offset(&self, len: usize) -> Result<()> {
        if let Positions::Offset(start) = self {
            if start.checked_add(len).is_none_or(|e| e > MAX_POSITION + 1) {
                return Err(Error::config(
                    "position offset",
                    start,
                    format!("offset + length ({len}) at most {}", MAX_POSITION + 1),
                ));
            }
        }
        Ok(())
    }

    /// Checks that `x` is `(B, T, d_model)` and that these positions fit it; returns `(B, T)`.
    ///
    /// # Errors
    /// [`Error::Rank`] unless `x` has rank 3, [`Error::Shape`] for another width,
    /// [`Error::DType`] for an integer dtype, [`Error::Device`] for ids on another device than
    /// `x`, and the errors of [`Self::check`]. `what` names `x` in the messages.
    pub fn check_input(
        &self,
        x: &Tensor,
        d_model: usize,
        what: &'static str,
    ) -> Result<(usize, usize)> {
        let (b, t) = match x.dims() {
            [b, t, d] if *d == d_model => (*b, *t),
            [_, _, _] => {
                return Err(Error::shape(
                    what,
                    format!("(batch, seq_len, {d_model})"),
                    x.shape(),
                ))
            }
            dims => {
                return Err(Error::Rank {
                    what,
                    expected: 3,
                    got: dims.len(),
                    shape: dims.to_vec(),
                })
            }
        };
        crate::error::check_float(what, x.dtype())?;
        check_chunk_len(what, t)?;
        if let Positions::Ids(ids) = self {
            crate::error::check_device("position ids", ids.ids(), x.device())?;
        }
        self.check(b, t)?;
        Ok((b, t))
    }

    /// One past the largest position of a chunk of `len` tokens.
    pub fn end(&self, len: usize) -> usize {
        match self {
            Positions::Offset(start) => start.saturating_add(len),
            Positions::Ids(ids) => ids.end(),
        }
    }

    /// The positions of tokens `start..start + len` of this chunk (a query block).
    ///
    /// Narrowed ids keep the whole chunk's [`PositionIds::end`], an upper bound on theirs, so
    /// nothing is read back from the device.
    ///
    /// # Errors
    /// Propagates candle's error for a range past the ids.
    pub(crate) fn narrow(&self, start: usize, len: usize) -> Result<Positions> {
        Ok(match self {
            Positions::Offset(s) => Positions::Offset(s + start),
            Positions::Ids(ids) => Positions::Ids(PositionIds {
                ids: ids.ids.narrow(1, start, len)?,
                end: ids.end,
                axes: ids
                    .axes
                    .as_ref()
                    .map(|a| a.narrow(2, start, len))
                    .transpose()?,
            }),
        })
    }

    /// The positions of the first `len` tokens with an exact [`Self::end`] (unlike
    /// `narrow`, whose ids keep the chunk's end as an upper bound): for what outlives the call,
    /// such as a truncated cache's positions. Reads the kept ids back to the host once.
    ///
    /// # Errors
    /// Propagates candle's error for a range past the ids.
    pub(crate) fn prefix(&self, len: usize) -> Result<Positions> {
        Ok(match self {
            Positions::Offset(s) => Positions::Offset(*s),
            Positions::Ids(ids) => {
                let kept = ids.ids.narrow(1, 0, len)?;
                let axes = ids.axes.as_ref().map(|a| a.narrow(2, 0, len)).transpose()?;
                // The end is over every axis that positions the tokens.
                let all = axes.as_ref().unwrap_or(&kept);
                let end = match all.elem_count() {
                    0 => 0,
                    _ => all.flatten_all()?.max(0)?.to_scalar::<u32>()? as usize + 1,
                };
                Positions::Ids(PositionIds {
                    ids: kept,
                    end,
                    axes,
                })
            }
        })
    }

    /// The positions as a `(1, len)` or `(B, len)` `u32` tensor.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if an offset would pass [`MAX_POSITION`] or `len` ids the size
    /// budget ([`crate::limits::max_elements`]); [`Error::Shape`] for ids of another length;
    /// device errors.
    pub fn to_ids(&self, len: usize, device: &Device) -> Result<Tensor> {
        match self {
            Positions::Offset(start) => {
                self.check_offset(len)?;
                crate::limits::check_elements("sequence length", len, "position ids", &[len])?;
                // In range after the check: start + len <= MAX_POSITION + 1 = 2^32.
                let ids: Vec<u32> = (*start..start + len).map(|p| p as u32).collect();
                Ok(Tensor::from_vec(ids, (1, len), device)?)
            }
            Positions::Ids(ids) => {
                self.check_len(len)?;
                Ok(ids.ids().clone())
            }
        }
    }

    /// The positions of `self` (covering `len` tokens) followed by `next` (covering `next_len`):
    /// used by KV caches to track the positions of every cached key.
    ///
    /// Two contiguous offsets stay an offset; anything else becomes explicit ids.
    ///
    /// # Errors
    /// [`Error::Shape`] if explicit ids disagree on the batch size; [`Error::InvalidConfig`] if
    /// an offset would pass [`MAX_POSITION`].
    pub fn extend(
        &self,
        len: usize,
        next: &Positions,
        next_len: usize,
        device: &Device,
    ) -> Result<Positions> {
        self.check_offset(len)?;
        next.check_offset(next_len)?;
        if let (Positions::Offset(a), Positions::Offset(b)) = (self, next) {
            if a + len == *b {
                return Ok(Positions::Offset(*a));
            }
        }
        let as_ids = |p: &Positions, l: usize| -> Result<PositionIds> {
            match p {
                Positions::Ids(ids) => Ok(ids.clone()),
                Positions::Offset(s) => Ok(PositionIds {
                    ids: p.to_ids(l, device)?,
                    end: s + l,
                    axes: None,
                }),
            }
        };
        Ok(Positions::Ids(
            as_ids(self, len)?.concat(&as_ids(next, next_len)?)?,
        ))
    }

    /// Relative distances `j - i` between every query and key position, as `i64` of shape
    /// `(Bq, Tq, Tk)` where `Bq` is 1 unless either side holds per-sequence ids.
    ///
    /// This is the one place relative encodings get their distance matrix from.
    ///
    /// # Errors
    /// [`Error::Shape`] if explicit ids disagree on the batch size; [`Error::InvalidConfig`] if
    /// `q_len × k_len` passes [`crate::limits::max_elements`] or an offset passes
    /// [`MAX_POSITION`].
    pub fn relative_distances(
        queries: &Positions,
        q_len: usize,
        keys: &Positions,
        k_len: usize,
        device: &Device,
    ) -> Result<Tensor> {
        crate::limits::check_elements(
            "queries × keys",
            format_args!("{q_len} × {k_len}"),
            "the number of (query, key) pairs",
            &[q_len, k_len],
        )?;
        let q = queries.to_ids(q_len, device)?.to_dtype(DType::I64)?;
        let k = keys.to_ids(k_len, device)?.to_dtype(DType::I64)?;
        let (qb, kb) = (q.dims()[0], k.dims()[0]);
        if qb != kb && qb != 1 && kb != 1 {
            return Err(Error::shape(
                "key position ids",
                format!("batch 1 or {qb} to match the query positions"),
                k.shape(),
            ));
        }
        crate::limits::check_elements(
            "queries × keys",
            format_args!("{q_len} × {k_len}"),
            "batch × queries × keys of the distances",
            &[qb.max(kb), q_len, k_len],
        )?;
        Ok(k.unsqueeze(1)?.broadcast_sub(&q.unsqueeze(2)?)?)
    }
}

/// The one check of a relative encoding's (or any pairwise hook's) positions, before any distance is computed: `tq`
/// queries at `queries` and `tk` keys at `keys`, each offset with its length within
/// [`MAX_POSITION`] (so every distance fits `i64`), ids holding their
/// chunk's tokens. Also [`crate::plug::AttentionContext::check_positions`].
///
/// # Errors
/// [`Error::InvalidConfig`] for an offset whose chunk passes `MAX_POSITION`, even when the
/// other side is empty; [`Error::Shape`] for ids of another length.
pub(crate) fn check_ranges(
    queries: &Positions,
    tq: usize,
    keys: &Positions,
    tk: usize,
) -> Result<()> {
    queries.check_len(tq)?;
    keys.check_len(tk)
}

/// Refuses an axis of tokens longer than the element budget ([`crate::limits::max_elements`]):
/// nothing of that many tokens can be computed at any width, and an empty batch of them would
/// still give shapes (`(0, T, H, D)`, `(0, H, T, T)`) whose strides overflow `usize`.
fn check_chunk_len(what: &'static str, len: usize) -> Result<()> {
    let max = crate::limits::max_elements();
    if len > max {
        return Err(Error::config(
            what,
            len,
            format!("at most {max} tokens on an axis (the element budget, limits::max_elements)"),
        ));
    }
    Ok(())
}
