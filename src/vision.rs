//! Vision inputs as HF's vision towers give them: each patch's row and column, and the mask
//! that keeps packed images apart.
//!
//! ```text
//! grid t × h × w patches   ──► (N, 2) rows and columns   ──► PositionIds (3, 1, N): 0, row, column
//!   row-major (Pixtral)           image by image, each from (0, 0), frames repeated
//!   merge blocks of m × m (Qwen-VL): block by block, row-major inside a block
//! spans [0, n₀, n₀ + n₁, …] (cu_seqlens) ──► additive mask (1, 1, N, N): 0 within a span, the
//!                                            dtype's lowest value across spans
//! ```
//!
//! Order of the patches, by [`PatchOrder`] (for a grid of `h × w` patches, each of its `t`
//! frames the same):
//!
//! | order | patch `k` of a frame | HF |
//! |---|---|---|
//! | `RowMajor` | row `⌊k / w⌋`, column `k mod w` | Pixtral's `PixtralVisionModel` (its meshgrid per image) |
//! | `MergeBlocks(m)` | blocks of `m × m` patches row-major, and row-major inside a block | `get_vision_position_ids` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V, …), the order their patch merger reads |
//!
//! Packed images attend within their own span: HF's Pixtral builds a block-diagonal mask
//! (`generate_block_attention_mask`), the Qwen-VL towers split the sequence at `cu_seqlens`
//! (`get_vision_cu_seqlens`, one span per frame). [`block_diagonal_mask`] is that mask in the
//! form the block takes (`AttentionOptions::attn_mask`), so one call attends over all images at
//! once, equal to HF's.
//!
//! # Shapes
//! - HF's patch positions: `(N, 2)` (rows, columns), or `(B, N, 2)` (Gemma 4's vision tower);
//! - positions for the block: `(3, B, N)` multimodal ids (temporal 0, row, column);
//! - the mask: `(1, 1, N, N)`.

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};
use crate::limits::check_elements;
use crate::positions::{PositionIds, MAX_POSITION};

/// One image or video as patches: `t` frames of `h` rows and `w` columns (HF's `grid_thw`
/// row; an image has `t = 1`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PatchGrid {
    /// Frames (temporal patches).
    pub t: usize,
    /// Rows of patches.
    pub h: usize,
    /// Columns of patches.
    pub w: usize,
}

impl PatchGrid {
    /// An image of `h × w` patches.
    pub fn image(h: usize, w: usize) -> Self {
        Self { t: 1, h, w }
    }

    /// Patches in one frame, `h · w`, checked against `usize`.
    fn frame(&self) -> Result<usize> {
        self.h
            .checked_mul(self.w)
            .ok_or_else(|| Error::config("patch grid", format!("{self:?}"), "h × w within usize"))
    }
}

/// The order a vision tower lays its patches out in (the [module docs](self)' table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchOrder {
    /// Row by row (Pixtral).
    RowMajor,
    /// Blocks of `m × m` patches row by row, each block row by row (Qwen-VL's
    /// `spatial_merge_size`).
    MergeBlocks(usize),
}

impl PatchOrder {
    /// Patch `k` of an `h × w` frame as (row, column).
    fn at(self, k: usize, w: usize) -> (usize, usize) {
        match self {
            Self::RowMajor => (k / w, k % w),
            Self::MergeBlocks(m) => {
                let (block, inner) = (k / (m * m), k % (m * m));
                let blocks_per_row = w / m;
                let (br, bc) = (block / blocks_per_row, block % blocks_per_row);
                (br * m + inner / m, bc * m + inner % m)
            }
        }
    }

    /// Refuses a merge size that does not tile the grid (HF's reshape fails on it).
    fn check(self, grid: &PatchGrid) -> Result<()> {
        if let Self::MergeBlocks(m) = self {
            if m == 0 || !grid.h.is_multiple_of(m) || !grid.w.is_multiple_of(m) {
                return Err(Error::config(
                    "spatial merge size",
                    m,
                    format!("a size ≥ 1 dividing the grid's rows and columns ({grid:?})"),
                ));
            }
        }
        Ok(())
    }
}

/// Every patch's (row, column) for `grids` packed one after another, each image from (0, 0),
/// each frame of a video repeating its image's positions: HF's `(N, 2)` position ids.
///
/// # Errors
/// [`Error::InvalidConfig`] for a merge size that does not tile a grid, or more patches than
/// the element budget ([`crate::limits`]) allows.
pub fn patch_rows_cols(grids: &[PatchGrid], order: PatchOrder) -> Result<Vec<[u32; 2]>> {
    let n = total_patches(grids)?;
    check_positions(n)?;
    check_elements(
        "patch positions",
        format_args!("{n} patches"),
        "two positions per patch",
        &[n, 2],
    )?;
    let mut out = Vec::with_capacity(n);
    for grid in grids {
        order.check(grid)?;
        if grid.t == 0 {
            // No frames: its patches are not in the count budgeted above.
            continue;
        }
        let frame: Vec<[u32; 2]> = (0..grid.frame()?)
            .map(|k| {
                let (r, c) = order.at(k, grid.w);
                // Below the patch count, which check_positions bounds.
                [r as u32, c as u32]
            })
            .collect();
        for _ in 0..grid.t {
            out.extend_from_slice(&frame);
        }
    }
    Ok(out)
}

/// HF's `cu_seqlens` of `grids`: the running patch count, one span per frame (a video's
/// frames attend apart, as `get_vision_cu_seqlens` gives them), starting at 0.
///
/// # Errors
/// [`Error::InvalidConfig`] when the count overflows `usize`, or the frames are more than the
/// element budget ([`crate::limits`]) allows.
pub fn cu_seqlens(grids: &[PatchGrid]) -> Result<Vec<usize>> {
    // One boundary per frame: counted and budgeted before any is written (a grid of no
    // patches still has its frames).
    let frames = grids
        .iter()
        .try_fold(1usize, |n, g| n.checked_add(g.t))
        .ok_or_else(|| Error::config("patch grids", "their frames", "a count within usize"))?;
    check_elements(
        "patch grids",
        format_args!("{} frames", frames - 1),
        "span boundaries (one per frame, and 0)",
        &[frames],
    )?;
    let mut out = Vec::with_capacity(frames);
    out.push(0);
    let mut end = 0usize;
    for grid in grids {
        let frame = grid.frame()?;
        for _ in 0..grid.t {
            end = end.checked_add(frame).ok_or_else(|| {
                Error::config("patch grids", "their patches", "a count within usize")
            })?;
            out.push(end);
        }
    }
    Ok(out)
}

/// The additive mask `(1, 1, N, N)` in `dtype` that keeps packed spans apart: 0 where query
/// and key lie in the same span of `cu_seqlens` (`[0, n₀, n₀ + n₁, …, N]`), the dtype's lowest
/// finite value elsewhere, as HF's Pixtral builds it (`generate_block_attention_mask`); for
/// `AttentionOptions::attn_mask`.
///
/// # Example
/// ```
/// use candle_core::{DType, Device};
/// use candle_posenc::vision::{block_diagonal_mask, cu_seqlens, PatchGrid};
///
/// let spans = cu_seqlens(&[PatchGrid::image(2, 3), PatchGrid::image(1, 2)])?;
/// assert_eq!(spans, [0, 6, 8]);
/// let mask = block_diagonal_mask(&spans, DType::F32, &Device::Cpu)?;
/// assert_eq!(mask.dims(), &[1, 1, 8, 8]);
/// let row: Vec<f32> = mask.squeeze(0)?.squeeze(0)?.get(6)?.to_vec1()?;
/// assert!(row[..6].iter().all(|&v| v == f32::MIN) && row[6..] == [0.0, 0.0]);
/// # Ok::<(), candle_posenc::Error>(())
/// ```
///
/// # Errors
/// [`Error::InvalidConfig`] unless `cu_seqlens` starts at 0 and never decreases;
/// [`Error::DType`] for a dtype that is not a float; [`Error::InvalidConfig`] for a mask past
/// the element budget ([`crate::limits`]).
pub fn block_diagonal_mask(cu_seqlens: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
    let ordered = cu_seqlens.first() == Some(&0) && cu_seqlens.windows(2).all(|p| p[0] <= p[1]);
    if !ordered {
        return Err(Error::config(
            "cu_seqlens",
            format!("{cu_seqlens:?}"),
            "span boundaries starting at 0 and never decreasing",
        ));
    }
    let lowest = match dtype {
        DType::F32 => f32::MIN as f64,
        DType::F64 => f64::MIN,
        DType::F16 => half::f16::MIN.to_f64(),
        DType::BF16 => half::bf16::MIN.to_f64(),
        other => {
            return Err(Error::DType {
                what: "block-diagonal attention mask",
                expected: "a float dtype (the mask is added to the logits)",
                got: other,
            })
        }
    };
    let n = cu_seqlens.last().copied().unwrap_or(0);
    check_positions(n)?;
    check_elements(
        "block-diagonal attention mask",
        format_args!("{n} patches"),
        "queries × keys",
        &[n, n],
    )?;
    // The span of each token, then a comparison of every pair.
    let mut span = vec![0u32; n];
    let spans = cu_seqlens.windows(2).filter(|w| w[0] < w[1]);
    for (i, w) in spans.enumerate() {
        // Non-empty spans are at most as many as tokens, which check_positions bounds.
        span[w[0]..w[1]].fill(i as u32);
    }
    let span = Tensor::from_vec(span, n, device)?;
    let same = span
        .unsqueeze(1)?
        .broadcast_eq(&span.unsqueeze(0)?)?
        .to_dtype(DType::F64)?;
    // same · 0 + (1 − same) · lowest
    let mask = ((same.ones_like()? - same)? * lowest)?;
    Ok(mask.to_dtype(dtype)?.reshape((1, 1, n, n))?)
}

impl PositionIds {
    /// Multimodal ids `(3, B, N)` (temporal 0, row, column) from HF's patch positions: `(N, 2)`
    /// rows and columns (Pixtral, the Qwen-VL towers' `get_vision_position_ids`) or `(B, N,
    /// 2)` (Gemma 4's vision tower), for axial RoPE.
    ///
    /// # Example
    /// ```
    /// use candle_core::{Device, Tensor};
    /// use candle_posenc::positions::PositionIds;
    ///
    /// let hf = Tensor::new(&[[0u32, 0], [0, 1], [1, 0], [1, 1]], &Device::Cpu)?;
    /// let ids = PositionIds::patches(&hf)?;
    /// assert_eq!(ids.axes().unwrap().dims(), &[3, 1, 4]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::Rank`] / [`Error::Shape`] unless the shape is `(N, 2)` or `(B, N, 2)`; as
    /// [`PositionIds::multimodal`] for the dtype and the values.
    pub fn patches(rows_cols: &Tensor) -> Result<Self> {
        let batched = match rows_cols.rank() {
            2 => rows_cols.unsqueeze(0)?,
            3 => rows_cols.clone(),
            got => {
                return Err(Error::Rank {
                    what: "patch positions",
                    expected: 2,
                    got,
                    shape: rows_cols.dims().to_vec(),
                })
            }
        };
        if batched.dims()[2] != 2 {
            return Err(Error::shape(
                "patch positions",
                "(N, 2) or (B, N, 2): each patch's row and column",
                rows_cols.shape(),
            ));
        }
        let rc = batched.permute((2, 0, 1))?; // (2, B, N)
        let temporal = rc.get(0)?.zeros_like()?.unsqueeze(0)?;
        Self::multimodal(&Tensor::cat(&[&temporal, &rc], 0)?.contiguous()?)
    }

    /// Multimodal ids `(3, 1, N)` of `grids` packed in one sequence, in `order` (as
    /// [`patch_rows_cols`]).
    ///
    /// # Example
    /// ```
    /// use candle_core::Device;
    /// use candle_posenc::positions::PositionIds;
    /// use candle_posenc::vision::{PatchGrid, PatchOrder};
    ///
    /// // Qwen2-VL: an image of 4 × 6 patches in merge blocks of 2 × 2.
    /// let grids = [PatchGrid::image(4, 6)];
    /// let ids = PositionIds::from_patch_grids(&grids, PatchOrder::MergeBlocks(2), &Device::Cpu)?;
    /// let rows: Vec<u32> = ids.axes().unwrap().get(1)?.flatten_all()?.to_vec1()?;
    /// assert_eq!(rows[..8], [0, 0, 1, 1, 0, 0, 1, 1]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// As [`patch_rows_cols`].
    pub fn from_patch_grids(
        grids: &[PatchGrid],
        order: PatchOrder,
        device: &Device,
    ) -> Result<Self> {
        let rows_cols = patch_rows_cols(grids, order)?;
        let n = rows_cols.len();
        let flat: Vec<u32> = rows_cols.into_iter().flatten().collect();
        Self::patches(&Tensor::from_vec(flat, (n, 2), device)?)
    }
}

/// The patches of `grids` together, checked against `usize`.
fn total_patches(grids: &[PatchGrid]) -> Result<usize> {
    cu_seqlens(grids).map(|spans| spans.last().copied().unwrap_or(0))
}

/// Refuses more patches than positions fit `u32` (the ids' storage).
fn check_positions(n: usize) -> Result<()> {
    if n > MAX_POSITION {
        return Err(Error::config(
            "patch count",
            n,
            format!("at most {MAX_POSITION} patches"),
        ));
    }
    Ok(())
}
