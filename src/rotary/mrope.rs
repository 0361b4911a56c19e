//! Multimodal RoPE (M-RoPE, Qwen2-VL; the interleaved layout of Qwen3-VL): each token has three
//! positions — temporal, height, width — and each frequency band of the head rotates by one of
//! them.
//!
//! ```text
//! positions p[a, b, t],  a ∈ {temporal, height, width}
//! angle[b, t, i] = p[axis(i), b, t] · inv_freq[i],   i < rotary_dim / 2
//! contiguous (Qwen2-VL, sections s = [s_t, s_h, s_w], Σ s = rotary_dim / 2):
//!     axis(i) = temporal for i < s_t, height for i < s_t + s_h, width after
//! interleaved (Qwen3-VL):
//!     axis(i) = height if i mod 3 = 1 and i < 3·s_h; width if i mod 3 = 2 and i < 3·s_w;
//!               temporal otherwise
//! ```
//!
//! Text tokens have three equal positions, where M-RoPE is plain RoPE; image and video patches
//! take their grid coordinates ([`mrope_positions`], as HF's `get_rope_index` builds them).
//! One position per token (an offset, or `(B, T)` ids) is that position on all three axes, as
//! HF's Qwen2-VL, Qwen2.5-VL and Qwen3-VL text models expand such ids. Axial RoPE has no such
//! reading (HF's vision encoders take `(row, column)` pairs): it refuses one position per
//! token with [`Error::Positions`].
//!
//! # Shapes
//! - positions: `(3, B, T)` ([`PositionIds::multimodal`]); per-axis tables are gathered as
//!   `(B, T, rotary_dim / 2)` and combined by the band masks.
//!
//! Reference: Wang et al. 2024, "Qwen2-VL: Enhancing Vision-Language Model's Perception of the
//! World at Any Resolution"; Qwen3-VL's interleaved layout from HF transformers'
//! `apply_interleaved_mrope`.

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use crate::absolute::gather_rows;
use crate::error::{Error, Result};
use crate::positions::{PositionIds, Positions};

/// Which frequency bands rotate by which of the three axes.
///
/// Serialised (serde) as `{"sections": [16, 24, 24], "interleaved": false}` (`interleaved`
/// defaults to false).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MropeSection {
    /// Frequencies per axis: temporal, height, width (HF's `mrope_section`); they sum to
    /// `rotary_dim / 2`.
    pub sections: [usize; 3],
    /// Qwen3-VL's interleaved layout (HF's `mrope_interleaved`) instead of contiguous bands.
    #[serde(default)]
    pub interleaved: bool,
}

impl MropeSection {
    /// Contiguous bands of `sections` frequencies (Qwen2-VL, Qwen2.5-VL).
    pub fn new(sections: [usize; 3]) -> Self {
        Self {
            sections,
            interleaved: false,
        }
    }

    /// Sets the interleaved layout (Qwen3-VL).
    pub fn with_interleaved(mut self, interleaved: bool) -> Self {
        self.interleaved = interleaved;
        self
    }

    /// The axis (0 temporal, 1 height, 2 width) frequency `i` rotates by.
    pub fn axis_of(&self, i: usize) -> usize {
        let [t, h, w] = self.sections;
        if self.interleaved {
            // i < 3·h as i / 3 < h: no product of the caller's sections.
            match i % 3 {
                1 if i / 3 < h => 1,
                2 if i / 3 < w => 2,
                _ => 0,
            }
        } else if i < t {
            0
        } else if i - t < h {
            1
        } else {
            2
        }
    }

    /// Checks the sections against `half = rotary_dim / 2` frequencies.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] unless the sections sum to `half`.
    pub fn validate(&self, half: usize) -> Result<()> {
        let sum = self
            .sections
            .iter()
            .try_fold(0usize, |acc, &s| acc.checked_add(s));
        if sum != Some(half) {
            return Err(Error::config(
                "mrope_section",
                format!("{:?}", self.sections),
                format!("three sections summing to rotary_dim / 2 = {half}"),
            ));
        }
        Ok(())
    }

    /// The table rows of `len` tokens at multimodal `axes` (`(3, B, T)`), each frequency taken
    /// from its axis's row: `(B, len, half)`.
    pub(crate) fn rows(&self, table: &Tensor, ids: &PositionIds, len: usize) -> Result<Tensor> {
        let half = table.dim(1)?;
        let mut out: Option<Tensor> = None;
        for axis in 0..3 {
            let mask: Vec<f32> = (0..half)
                .map(|i| f32::from(u8::from(self.axis_of(i) == axis)))
                .collect();
            let mask = Tensor::from_vec(mask, half, table.device())?.to_dtype(table.dtype())?;
            let axis_ids = ids.axis(axis).ok_or_else(|| {
                Error::shape(
                    "multimodal position ids",
                    "(3, B, T) axes",
                    ids.ids().shape(),
                )
            })?;
            let picked =
                gather_rows(table, &Positions::Ids(axis_ids), len)?.broadcast_mul(&mask)?;
            out = Some(match out {
                None => picked,
                Some(acc) => (acc + picked)?,
            });
        }
        out.ok_or_else(|| unreachable_axes(table))
    }
}

fn unreachable_axes(table: &Tensor) -> Error {
    Error::shape("multimodal rotary table", "three axes", table.shape())
}

/// Axial 2-D RoPE over a patch grid (vision encoders): the first half of a head's frequencies
/// rotates by the patch's row, the second by its column, with positions from
/// [`PositionIds::multimodal`] (the height and width axes; [`mrope_positions`] with one
/// [`MropeSegment::Grid`] of `t = 1` builds them), the only positions it takes: an offset or
/// ids without axes are refused with [`Error::Positions`].
///
/// ```text
/// EvenOdd  (Pixtral):              f_k = base^(-2k/d), k < d/2;  rows take f_0, f_2, f_4, …,
///                                  columns f_1, f_3, f_5, …
/// Repeated (Qwen2-VL's vision):    g_k = base^(-4k/d), k < d/4;  rows take g, columns g again
/// SplitHalves (Gemma 4's vision):  the frequencies of Repeated; features [0, d/2) rotate by
///                                  rows, pairing c with c + d/4, features [d/2, d) by columns
/// angle[p, i] = row(p) · freq[i]  (i < d/4),   col(p) · freq[i]  (d/4 ≤ i < d/2)
/// ```
///
/// Under the rotate-half layout the first two pair feature `i` with `i + d/2`; SplitHalves
/// pairs within each half of the head (it is two rotate-half RoPEs side by side, which is the
/// first two's rotation with the head's middle quarters exchanged).
///
/// Reference: Heo et al. 2024, "Rotary Position Embedding for Vision Transformer" (axial
/// RoPE); Pixtral, Qwen2-VL and Gemma 4 as HF transformers implement them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AxialRope {
    /// Pixtral: the even-indexed frequencies of the head on rows, the odd ones on columns.
    EvenOdd,
    /// Qwen2-VL's (and Qwen2.5-VL's, Qwen3-VL's) vision encoder: the frequencies of a head
    /// half as wide, on rows and again on columns.
    Repeated,
    /// Gemma 4's vision encoder: the first half of the head a RoPE over rows, the second half
    /// one over columns, each with the rotate-half pairing inside its half.
    SplitHalves,
}

impl AxialRope {
    /// The `d/2` inverse frequencies in the order the bands take them: rows, then columns.
    pub fn inv_freq(&self, rotary_dim: usize, base: f64) -> Vec<f64> {
        let d = rotary_dim as f64;
        let quarter = rotary_dim / 4;
        match self {
            AxialRope::EvenOdd => {
                let f = |k: usize| 1.0 / base.powf((2 * k) as f64 / d);
                (0..quarter)
                    .map(|j| f(2 * j))
                    .chain((0..quarter).map(|j| f(2 * j + 1)))
                    .collect()
            }
            AxialRope::Repeated | AxialRope::SplitHalves => {
                let g = |k: usize| 1.0 / base.powf((4 * k) as f64 / d);
                (0..quarter).chain(0..quarter).map(g).collect()
            }
        }
    }

    /// The bands: none temporal, a quarter of the head on rows, a quarter on columns.
    pub(crate) fn bands(rotary_dim: usize) -> MropeSection {
        MropeSection::new([0, rotary_dim / 4, rotary_dim / 4])
    }
}

/// One stretch of a multimodal sequence, for [`mrope_positions`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MropeSegment {
    /// `n` text tokens: three equal positions each, continuing one by one.
    Text(usize),
    /// An image or video as the language model sees it: a grid of `t × h × w` tokens (after the
    /// vision encoder's spatial merge), in temporal, then row, then column order. The temporal
    /// position of frame `k` is `⌊k · time_interval⌋` (1 for Qwen2-VL; Qwen2.5-VL's videos use
    /// tokens per second × seconds per grid).
    Grid {
        /// Frames (temporal patches).
        t: usize,
        /// Rows.
        h: usize,
        /// Columns.
        w: usize,
        /// Spacing of the frames' temporal positions.
        time_interval: f64,
    },
}

/// The `(3, T)` multimodal positions of a sequence of segments, and the delta HF adds to
/// text positions after it (`max + 1 − T`), as transformers' Qwen2-VL `get_rope_index` builds
/// them: text continues one by one on all three axes; a grid starting at `s` puts token
/// `(k, r, c)` at `(s + ⌊k·time_interval⌋, s + r, s + c)`, and the text after it continues at
/// `s + max(h, w)`, as transformers 5 places it (transformers 4 continued after the grid's
/// largest position on any axis, its frames included, so videos resume later there).
///
/// Returns the three axes flattened, `3 × T` values (temporal first), for
/// `Tensor::from_vec(values, (3, 1, T), device)` and [`PositionIds::multimodal`].
///
/// # Errors
/// [`Error::InvalidConfig`] for a `time_interval` that is not finite and ≥ 0, a token count
/// past [`crate::limits::max_elements`], or positions that do not fit `u32` (the next
/// position after any segment, a grid's `max(h, w)` included, at most `u32::MAX + 1`).
pub fn mrope_positions(segments: &[MropeSegment]) -> Result<(Vec<u32>, i64)> {
    let mut tokens = 0usize;
    for s in segments {
        let n = match *s {
            MropeSegment::Text(n) => n,
            MropeSegment::Grid {
                t,
                h,
                w,
                time_interval,
            } => {
                if !(time_interval.is_finite() && time_interval >= 0.0) {
                    return Err(Error::config(
                        "time_interval",
                        time_interval,
                        "a finite number ≥ 0",
                    ));
                }
                t.checked_mul(h)
                    .and_then(|n| n.checked_mul(w))
                    .ok_or_else(|| {
                        Error::config(
                            "grid",
                            format!("{t}×{h}×{w}"),
                            "a grid whose token count fits usize",
                        )
                    })?
            }
        };
        tokens = tokens.checked_add(n).ok_or_else(|| {
            Error::config("segments", "their token counts", "a total that fits usize")
        })?;
    }
    crate::limits::check_elements(
        "segments",
        tokens,
        "3 × tokens of the multimodal positions",
        &[3, tokens],
    )?;
    let mut axes = [
        Vec::with_capacity(tokens),
        Vec::with_capacity(tokens),
        Vec::with_capacity(tokens),
    ];
    let too_far = || {
        Error::config(
            "segments",
            "their positions",
            format!("positions that fit u32 (at most {})", u32::MAX),
        )
    };
    // The next position: at most u32::MAX + 1 (one past the last that fits), so every sum
    // below stays far inside u64.
    let advance = |pos: u64, by: usize| -> Result<u64> {
        u64::try_from(by)
            .ok()
            .and_then(|by| pos.checked_add(by))
            .filter(|&p| p <= u64::from(u32::MAX) + 1)
            .ok_or_else(too_far)
    };
    let mut pos: u64 = 0;
    for s in segments {
        match *s {
            MropeSegment::Text(n) => {
                let next = advance(pos, n)?;
                for p in pos..next {
                    let p = u32::try_from(p).map_err(|_| too_far())?;
                    axes.iter_mut().for_each(|a| a.push(p));
                }
                pos = next;
            }
            MropeSegment::Grid {
                t,
                h,
                w,
                time_interval,
            } => {
                // The loops below run once per token: a grid of no tokens (t × 0 × w) is
                // skipped whatever its other sides, so the work follows the budgeted count.
                let next = advance(pos, h.max(w))?;
                let rows = if h == 0 || w == 0 { 0 } else { t };
                for k in 0..rows {
                    let temporal = pos as f64 + (k as f64 * time_interval).floor();
                    if temporal > u32::MAX as f64 {
                        return Err(too_far());
                    }
                    for r in 0..h as u64 {
                        for c in 0..w as u64 {
                            axes[0].push(temporal as u32);
                            axes[1].push(u32::try_from(pos + r).map_err(|_| too_far())?);
                            axes[2].push(u32::try_from(pos + c).map_err(|_| too_far())?);
                        }
                    }
                }
                pos = next;
            }
        }
    }
    let max = axes.iter().flatten().copied().max().map_or(-1, i64::from);
    let delta = max + 1 - tokens as i64;
    Ok((axes.concat(), delta))
}
