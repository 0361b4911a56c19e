//! Bias, masks and softmax in one in-place pass over the attention logits (CPU, f32).
//!
//! ```text
//! s'[b,h,i,j] = cap(s[b,h,i,j]) + Σ dense[b,h,i,j] + Σ rel.values[b,h,i,c(i,j)]
//!               + Σ (a[b,h,i] + c[b,h,j])              separable pairs, over their keys
//! p[b,h,i,:] = softmax over kept j of s'[b,h,i,j], joined by the head's sink logit (no value)
//! kept(i, j) = j in the row's causal limit, window and chunk (RowRule) and padding[b, j] ≠ 0
//! cap(x) = c·tanh(x / c) with a soft cap c, else x
//! ```
//!
//! Masked logits take `f32::MIN`, so a fully masked row is uniform over all its keys, as in the
//! unfused path. The unfused path adds a bias into a fresh `(B, H, Tq, Tk)` tensor, fills masked
//! entries into another and normalises into a third; here each row is read and written once
//! while it is in cache. Dense terms are read through their broadcast strides (an ALiBi
//! `(1, H, 1, Tk)` row is never expanded); relative terms ([`RelativeBias`]) are read as short
//! rows of values per distance, separable ones ([`SeparableBias`](crate::plug::SeparableBias)) as
//! one value per query and one per key. Keys past the causal limit are never touched but to
//! write 0.
//! Used for inference only: the logits must not be part of a graph.

use candle_core::{CpuStorage, InplaceOp1, Layout, Storage, Tensor};
use rayon::prelude::*;

use crate::error::Result;
use crate::plug::mixed::{self, add_mixed_grads, add_mixed_row, MixedLayout};
use crate::plug::relative::add_shifted_sums_from;
use crate::plug::relative::RowSegments;
use crate::plug::separable::KeySide;
use crate::plug::{row_segments_from, Columns, RelativeBias};

/// A broadcast view of an additive term: storage offset and the strides of `(B, H, Tq, X)`,
/// where `X` is `Tk` for a dense term, the row width for a relative one, and `Tq + Tk` for a
/// separable pair (its queries' values, then its keys', on one row per head).
pub(crate) struct Strided {
    tensor: Tensor,
    offset: usize,
    strides: [usize; 4],
    /// `Some((shift, width))` for a relative term.
    pub(crate) relative: Option<(i64, usize)>,
    /// `Some((Tq, keys))` for a separable pair.
    pub(crate) separable: Option<(usize, KeySide)>,
    /// The packed layout of mixed rows (one packed row per head, see [`MixedRows::packed`]).
    pub(crate) mixed: Option<MixedLayout>,
}

/// One pair of a separable bias as the fused passes read it: `(1|B, 1|H, Tq + Tk)` f32, the
/// queries' values then the keys', and the keys of each row it covers.
pub(crate) struct SeparableTerm {
    pub(crate) packed: Tensor,
    pub(crate) side: KeySide,
}

impl SeparableTerm {
    /// The pairs of `bias` packed in f32 (gradients flow back through the packing).
    pub(crate) fn of(bias: &crate::plug::SeparableBias) -> Result<Vec<Self>> {
        bias.parts()
            .into_iter()
            .map(|(q, k, side)| {
                // Batch and head axes broadcast to the pair's own (1 where both are 1).
                let (qb, qh, tq) = q.dims3()?;
                let (kb, kh, tk) = k.dims3()?;
                let (b, h) = (qb.max(kb), qh.max(kh));
                let (q, k) = (q.broadcast_as((b, h, tq))?, k.broadcast_as((b, h, tk))?);
                let packed = Tensor::cat(&[&q, &k], 2)?.to_dtype(candle_core::DType::F32)?;
                Ok(Self { packed, side })
            })
            .collect()
    }
}

/// One block of a tile's rows for mixed rows: its first row within the tile and in the
/// block, its rows, the keys its last row sees, and the columns `(first, count)` they read.
struct MixedBlock {
    first: usize,
    r0: usize,
    count: usize,
    seen: usize,
    cols: (usize, usize),
}

impl Strided {
    /// A mixed term's packed `(b, h)` row (the bank, then each query's mix), from `src`, the
    /// term's storage.
    #[inline(always)]
    fn packed_row<'s>(&self, src: &'s [f32], bi: usize, hi: usize) -> &'s [f32] {
        &src[self.offset + bi * self.strides[0] + hi * self.strides[1]..]
    }

    /// The term's tensor, broadcast to the pass's axes.
    pub(crate) fn tensor(&self) -> &Tensor {
        &self.tensor
    }

    fn new(
        t: &Tensor,
        shape: (usize, usize, usize, usize),
        relative: Option<(i64, usize)>,
    ) -> Result<Self> {
        // (A view of the same shape would add a node whose backward sums over no axis.)
        let t = match t.dims() == [shape.0, shape.1, shape.2, shape.3] {
            true => t.clone(),
            false => t.broadcast_as(shape)?,
        };
        let l = t.layout();
        let s = l.stride();
        Ok(Self {
            offset: l.start_offset(),
            strides: [s[0], s[1], s[2], s[3]],
            tensor: t,
            relative,
            separable: None,
            mixed: None,
        })
    }

    /// Adds this term's row `(bi, hi, i)` at keys `j0..j0 + row.len()` to `row`.
    #[inline(always)]
    fn add_row(&self, src: &[f32], (bi, hi, i): (usize, usize, usize), j0: usize, row: &mut [f32]) {
        let [s0, s1, s2, s3] = self.strides;
        if let Some((tq, side)) = self.separable {
            // Contiguous packed values (checked when built): a_i, then c_j at Tq + j.
            let base = self.offset + bi * s0 + hi * s1;
            let a = src[base + i];
            let (lo, up) = side.range(i, j0, row.len());
            for (x, c) in row[lo..up].iter_mut().zip(&src[base + tq + j0 + lo..]) {
                *x += a + c;
            }
            return;
        }
        if let Some(m) = self.mixed {
            // Contiguous packed rows (built so): the bank, then each query's mix.
            let (bank, mix) = m.split(self.packed_row(src, bi, hi), i);
            let s = row_segments_from(i, m.shift, m.width, j0, row.len());
            add_mixed_row(bank, mix, s, row);
            return;
        }
        let base = self.offset + bi * s0 + hi * s1 + i * s2;
        match self.relative {
            None if s3 == 1 => {
                for (x, y) in row.iter_mut().zip(&src[base + j0..]) {
                    *x += y;
                }
            }
            None => {
                for (j, x) in row.iter_mut().enumerate() {
                    *x += src[base + (j0 + j) * s3];
                }
            }
            // Contiguous values (checked when built): one row of `width` columns.
            Some((shift, width)) => add_shifted_row(&src[base..base + width], i, shift, j0, row),
        }
    }
}

/// `row[j] += values[c(i, j0 + j)]` with `c(i, j) = clamp(j − i + shift, 0, W − 1)` over the
/// `W = values.len()` columns: query row `i`'s keys `j0..j0 + row.len()`.
#[inline(always)]
pub(crate) fn add_shifted_row(values: &[f32], i: usize, shift: i64, j0: usize, row: &mut [f32]) {
    let width = values.len();
    let s = row_segments_from(i, shift, width, j0, row.len());
    let (left, rest) = row.split_at_mut(s.lo);
    let (middle, right) = rest.split_at_mut(s.hi - s.lo);
    left.iter_mut().for_each(|x| *x += values[0]);
    for (x, y) in middle.iter_mut().zip(&values[s.first_col..]) {
        *x += y;
    }
    right.iter_mut().for_each(|x| *x += values[width - 1]);
}

/// Query rows per product of mixed rows over a tile's columns (see `add_mixed_tile`).
const MIXED_ROWS: usize = 16;

/// Lanes of the reductions below: independent accumulators, which the compiler keeps in two to
/// eight vector registers, so that consecutive max/add instructions do not wait on each other
/// (one chain of 8 lanes ran at a quarter of the loads' speed).
const LANES: usize = 32;

/// The largest value of `row` (a NaN anywhere makes the row NaN later, through `x − max`).
#[inline(always)]
fn row_max(row: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, x) in acc.iter_mut().zip(c) {
            *a = if *x > *a { *x } else { *a };
        }
    }
    tail.iter()
        .chain(&acc)
        .copied()
        .fold(f32::NEG_INFINITY, f32::max)
}

/// Exponents below which a weight is flushed to zero: e^-40 ≈ 4e-18 of the row's largest
/// weight, so even 2^20 flushed keys move the row by under 1e-11, far below f32 rounding of the
/// weights; and no weight, nor its product with a value in `α v`, comes near the subnormal
/// range, where x86 arithmetic slows down by two orders of magnitude.
const FLUSH_BELOW: f32 = -40.0;

/// `x ← e^(x − max)` over `row`, returning the sum. Results below `e^FLUSH_BELOW` are flushed
/// to zero; NaN stays NaN.
#[inline(always)]
fn exp_shifted_in_place(row: &mut [f32], max: f32) -> f32 {
    #[inline(always)]
    fn flushed_exp(x: f32, max: f32) -> f32 {
        let d = x - max;
        // Comparisons, not f32::max: a NaN must stay NaN.
        let below = d < FLUSH_BELOW;
        let e = exp(if below { FLUSH_BELOW } else { d });
        if below {
            0.0
        } else {
            e
        }
    }
    // One pass: each chunk's weights are written and summed lane-wise while in registers.
    let mut acc = [0f32; LANES];
    let mut chunks = row.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for (a, x) in acc.iter_mut().zip(c.iter_mut()) {
            *x = flushed_exp(*x, max);
            *a += *x;
        }
    }
    let tail = chunks.into_remainder();
    tail.iter_mut().for_each(|x| *x = flushed_exp(*x, max));
    tail.iter().chain(&acc).sum()
}

/// `e^x` for `x` in `[-87, 0]` (and NaN), in straight-line f32 arithmetic the compiler
/// vectorises: `x = k·ln 2 + r` with `k = round(x / ln 2)` and `|r| ≤ ln 2 / 2` (Cody–Waite, ln 2
/// split in two so `r` is exact to f32), `e^r` by its degree-6 Taylor polynomial (truncation
/// under 1.2e-7 relative), and `2^k` written straight into the exponent bits. Relative error
/// within 3e-7 of `f64::exp` (tested), against ~1e-7 for the scalar library call it replaces at
/// a fraction of the cost.
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75; // ln 2 rounded to 16 significant bits: k·LN2_HI is exact
    const LN2_LO: f32 = 1.428_606_8e-6; // ln 2 − LN2_HI
    const ROUND: f32 = 12_582_912.0; // 1.5·2^23: adding it rounds to an integer in the low bits
    let z = x * LOG2_E + ROUND;
    let k = z - ROUND;
    let ki = z.to_bits() as i32 - ROUND.to_bits() as i32;
    let r = (x - k * LN2_HI) - k * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (1.0 / 2.0
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    p * f32::from_bits(((ki + 127) << 23) as u32)
}

/// What a softmax row does besides its bias and padding: which keys it sees, the soft cap of
/// its logits and the sink logit that joins it.
///
/// Query row `i` is key `p = first + i` (the chunk's queries are its last keys). It sees keys
/// `j` with
/// ```text
/// j ≤ p                                     if causal
/// p − w < j          (causal)   or |p − j| ≤ w (bidirectional)   with a window w
/// ⌊(j − l) / c⌋ = ⌊(p − l) / c⌋              with chunks of c (causal), l = the sequence's
///                                           leading padded keys
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct RowRule {
    /// Query row `i` is key `first + i`.
    pub(crate) first: usize,
    /// Whether row `i` sees only keys `j ≤ first + i`.
    pub(crate) causal: bool,
    /// `Some(w)`: causal, the last `w` keys (`j > p − w`); bidirectional, keys within `w` of
    /// the query on either side.
    pub(crate) window: Option<usize>,
    /// `Some(c)` (with `causal`): keys of the query's own chunk of `c`, chunks counted from the
    /// sequence's first unpadded key.
    pub(crate) chunk: Option<usize>,
    /// `Some(c)`: the `q·k` logits become `c·tanh(s / c)` before the terms are added.
    pub(crate) softcap: Option<f32>,
    /// One logit per head that joins every row's softmax and carries no value (learned sinks).
    pub(crate) sinks: Option<Vec<f32>>,
}

impl RowRule {
    /// The causal rule of a chunk whose first query is key `first`.
    #[cfg(test)]
    pub(crate) fn causal(first: usize) -> Self {
        Self {
            first,
            causal: true,
            ..Self::default()
        }
    }

    /// The keys `0..visible` of row `i` out of `len` that are not causally hidden.
    #[inline(always)]
    pub(crate) fn visible(&self, i: usize, len: usize) -> usize {
        match self.causal {
            true => (self.first + i + 1).min(len),
            false => len,
        }
    }

    /// The keys `start..end` row `i` sees through its window and chunk, before padding, for a
    /// sequence whose first `left` keys are padded (`end` may pass the row's length).
    #[inline(always)]
    pub(crate) fn span(&self, i: usize, left: usize) -> (usize, usize) {
        let p = self.first + i;
        let (mut start, mut end) = match (self.window, self.causal) {
            (None, _) => (0, usize::MAX),
            (Some(w), true) => ((p + 1).saturating_sub(w), usize::MAX),
            (Some(w), false) => (p.saturating_sub(w), p.saturating_add(w).saturating_add(1)),
        };
        if let Some(c) = self.chunk.filter(|&c| c > 0) {
            // The chunk holding p, counted from `left` (keys before it form chunks too, with
            // floor division, as HF's mask has it).
            let (p, l, c) = (p as i128, left as i128, c as i128);
            let chunk_start = l + (p - l).div_euclid(c) * c;
            let clamp = |x: i128| usize::try_from(x.max(0)).unwrap_or(usize::MAX);
            start = start.max(clamp(chunk_start));
            end = end.min(clamp(chunk_start + c));
        }
        (start, end)
    }

    /// The keys `lo..hi` out of `tk` that rows `i0..i1` (`i1 > i0`) can see through the causal
    /// limit, window and chunk when no key is padded (spans move right with the row, so the
    /// first row's start and the last row's end bound them all); every key if none is left.
    pub(crate) fn keys_seen(&self, i0: usize, i1: usize, tk: usize) -> (usize, usize) {
        let last = i1 - 1;
        let lo = self.span(i0, 0).0.min(tk);
        let hi = self.visible(last, tk).min(self.span(last, 0).1);
        if lo < hi {
            (lo, hi)
        } else {
            (0, tk)
        }
    }

    /// Whether a row's window or chunk depends on the sequence's leading padding.
    pub(crate) fn needs_left(&self) -> bool {
        self.chunk.is_some()
    }
}

/// The op: additive terms, padding (`(B, Tk)`, non-zero = keep) and the row rule.
pub(crate) struct BiasMaskSoftmax {
    terms: Vec<Strided>,
    padding: Option<Tensor>,
    rule: RowRule,
}

/// Softmax of `cap(scores) + Σ dense + Σ relative` over kept keys (and the sinks), written into
/// `scores`.
///
/// `dense` terms must be f32 CPU tensors broadcastable to `scores`, `relative` terms f32 CPU
/// rows of the shift form checked against the block; `padding` `(B, Tk)` u8; `rule` as
/// [`RowRule`] says (its sinks one per head of `scores`).
pub(crate) fn bias_mask_softmax_in_place(
    scores: &Tensor,
    (dense, relative, separable): (&[&Tensor], &[&RelativeBias], &[&SeparableTerm]),
    padding: Option<&Tensor>,
    rule: &RowRule,
) -> Result<()> {
    let op = BiasMaskSoftmax {
        terms: strided_terms(scores.dims4()?, dense, relative, separable)?,
        padding: padding.map(|p| p.contiguous()).transpose()?,
        rule: rule.clone(),
    };
    scores.inplace_op1(&op)?;
    Ok(())
}

/// Broadcast views of the dense, relative and separable terms of logits shaped `shape` =
/// `(B, H, Tq, Tk)`, in that order.
pub(crate) fn strided_terms(
    shape: (usize, usize, usize, usize),
    dense: &[&Tensor],
    relative: &[&RelativeBias],
    separable: &[&SeparableTerm],
) -> Result<Vec<Strided>> {
    let mut terms = dense
        .iter()
        .map(|t| Strided::new(t, shape, None))
        .collect::<Result<Vec<_>>>()?;
    for rel in relative {
        let Columns::Shift(shift) = rel.columns() else {
            return Err(crate::error::Error::shape(
                "relative bias for a fused pass",
                "rows with shifted columns (index maps are expanded first)",
                &candle_core::Shape::from(rel.dims()),
            ));
        };
        let width = rel.width();
        let (b, h, tq, _) = shape;
        if let Some(mixed) = rel.mixed_rows() {
            let layout = MixedLayout {
                rank: mixed.bank().dims()[0],
                width,
                shift: *shift,
            };
            let packed = mixed.packed(tq)?;
            let mut strided = Strided::new(&packed, (b, h, 1, layout.len(tq)), None)?;
            strided.mixed = Some(layout);
            terms.push(strided);
            continue;
        }
        let values = rel.values()?.contiguous()?;
        terms.push(Strided::new(
            &values,
            (b, h, tq, width),
            Some((*shift, width)),
        )?);
    }
    let (b, h, tq, tk) = shape;
    for term in separable {
        let packed = term.packed.contiguous()?;
        let (_, _, len) = packed.dims3()?;
        if len != tq + tk {
            return Err(crate::error::Error::shape(
                "separable bias for a fused pass",
                format!("(batch, heads, {tq} + {tk}) = the queries' values, then the keys'"),
                packed.shape(),
            ));
        }
        let mut strided = Strided::new(&packed.unsqueeze(2)?, (b, h, 1, len), None)?;
        strided.separable = Some((tq, term.side));
        terms.push(strided);
    }
    Ok(terms)
}

/// Read access to the terms' and the padding mask's storage, held for the length of a pass.
pub(crate) struct TermGuards<'a> {
    terms: Vec<(StorageGuard<'a>, &'a Strided)>,
    padding: Option<(StorageGuard<'a>, &'a Layout)>,
}

/// A read lock on a tensor's storage (candle's lock type, unnamed).
pub(crate) type StorageGuard<'a> = Box<dyn std::ops::Deref<Target = Storage> + 'a>;

/// Read-locks `t`'s storage.
pub(crate) fn read_storage(t: &Tensor) -> (StorageGuard<'_>, &Layout) {
    let (guard, layout) = t.storage_and_layout();
    (Box::new(guard), layout)
}

impl<'a> TermGuards<'a> {
    pub(crate) fn new(terms: &'a [Strided], padding: Option<&'a Tensor>) -> Self {
        Self {
            terms: terms
                .iter()
                .map(|t| (read_storage(&t.tensor).0, t))
                .collect(),
            padding: padding.map(read_storage),
        }
    }

    /// The row pass over logits of `dims` = `(B, H, Tq, Tk)` reading these terms.
    pub(crate) fn pass<'r>(
        &'r self,
        dims: (usize, usize, usize, usize),
        rule: &'r RowRule,
    ) -> candle_core::Result<RowPass<'r>> {
        let (b, h, tq, tk) = dims;
        let terms = self
            .terms
            .iter()
            .map(|(g, t)| match &***g {
                Storage::Cpu(CpuStorage::F32(v)) => Ok((v.as_slice(), *t)),
                _ => candle_core::bail!("fused softmax: additive terms must be f32 CPU tensors"),
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let padding = match &self.padding {
            None => None,
            Some((g, l)) => match (&***g, l.contiguous_offsets()) {
                (Storage::Cpu(CpuStorage::U8(v)), Some((a, z))) if z - a == b * tk => {
                    Some(&v[a..z])
                }
                _ => candle_core::bail!(
                    "fused softmax: the padding mask must be a contiguous ({b}, {tk}) u8 CPU tensor"
                ),
            },
        };
        if rule.sinks.as_ref().is_some_and(|s| s.len() != h) {
            candle_core::bail!("fused softmax: the sinks must be one logit per head ({h})");
        }
        Ok(RowPass {
            terms,
            padding,
            lefts: leading_padding(rule, padding, tk),
            rule,
            dims: (h, tq, tk),
            isa: Isa::detect(),
            mixed_in_tiles: false,
        })
    }
}

/// Each sequence's leading padded keys when `rule` counts chunks from them (else empty).
fn leading_padding(rule: &RowRule, padding: Option<&[u8]>, tk: usize) -> Vec<usize> {
    match (rule.needs_left(), padding) {
        (true, Some(p)) => p
            .chunks_exact(tk.max(1))
            .map(|keep| keep.iter().position(|&k| k != 0).unwrap_or(tk))
            .collect(),
        _ => Vec::new(),
    }
}

/// One row's online softmax so far: the largest logit seen (or the sink's) and the sum of
/// `e^(s − max)` over the keys seen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Running {
    pub(crate) max: f32,
    pub(crate) sum: f32,
}

/// Everything one row of the pass reads.
pub(crate) struct RowPass<'a> {
    terms: Vec<(&'a [f32], &'a Strided)>,
    padding: Option<&'a [u8]>,
    /// Each sequence's leading padded keys when the rule counts chunks from them (else empty).
    lefts: Vec<usize>,
    rule: &'a RowRule,
    /// `(H, Tq, Tk)`: `Tk` is the padding mask's row length.
    dims: (usize, usize, usize),
    isa: Isa,
    /// Whether the caller adds mixed rows per tile ([`Self::add_mixed_tile`]) before the
    /// rows see their other terms, so the row pass leaves them out.
    mixed_in_tiles: bool,
}

/// The widest vector instructions the row pass is compiled for on this CPU.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Isa {
    Baseline,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Isa {
    /// Detected once per pass by the standard library's cached CPU feature test.
    fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Isa::Avx2;
            }
        }
        Isa::Baseline
    }
}

impl RowPass<'_> {
    /// The pass for a caller that adds mixed rows a tile at a time: [`Self::add_mixed_tile`]
    /// on the raw logits of every tile before the rows' pass, [`Self::add_mixed_tile_grads`]
    /// on its dS. Only without a soft cap, which must see the raw logits alone; otherwise the
    /// rows add them one by one as before.
    pub(crate) fn with_mixed_in_tiles(mut self) -> Self {
        self.mixed_in_tiles =
            self.rule.softcap.is_none() && self.terms.iter().any(|(_, t)| t.mixed.is_some());
        self
    }

    /// Whether the caller adds mixed rows per tile.
    pub(crate) fn mixed_in_tiles(&self) -> bool {
        self.mixed_in_tiles
    }

    /// Each mixed term's values for the tile of rows `i0..i0 + rows` of sequence `bi`, head
    /// `hi`, and keys `j0..j0 + n`, added to its raw logits `s` (`rows × n`): one product per
    /// block of rows over the columns it reads ([`mixed::tile_values`]), `slab` its scratch.
    pub(crate) fn add_mixed_tile(
        &self,
        (bi, hi, i0, rows): (usize, usize, usize, usize),
        (j0, n): (usize, usize),
        s: &mut [f32],
        slab: &mut Vec<f32>,
    ) {
        for (src, t) in &self.terms {
            let Some(m) = t.mixed else { continue };
            let packed = t.packed_row(src, bi, hi);
            for b in self.mixed_blocks(&m, (i0, rows), (j0, n)) {
                mixed::tile_values(&m, packed, (b.r0, b.count), b.cols, slab);
                let block = &mut s[b.first * n..(b.first + b.count) * n];
                for (li, row) in block.chunks_exact_mut(n).enumerate() {
                    let at = li * b.cols.1;
                    let seg = row_segments_from(b.r0 + li, m.shift, m.width, j0, b.seen);
                    let slab_row = &slab[at..at + b.cols.1];
                    mixed::add_tile_row(slab_row, b.cols.0, seg, &mut row[..b.seen]);
                }
            }
        }
    }

    /// Term `term`'s (mixed) gradients from the tile's dS (`rows × n`, as
    /// [`Self::add_mixed_tile`] reads its tile) into `grads`, its packed `(b, h)` row;
    /// `dslab` is scratch.
    pub(crate) fn add_mixed_tile_grads(
        &self,
        term: usize,
        (bi, hi, i0, rows): (usize, usize, usize, usize),
        (j0, n): (usize, usize),
        ds: &[f32],
        (grads, dslab): (&mut [f32], &mut Vec<f32>),
    ) {
        let (src, t) = self.terms[term];
        let Some(m) = t.mixed else { return };
        let packed = t.packed_row(src, bi, hi);
        for b in self.mixed_blocks(&m, (i0, rows), (j0, n)) {
            dslab.clear();
            dslab.resize(b.count * b.cols.1, 0.0);
            let block = &ds[b.first * n..(b.first + b.count) * n];
            for (li, dsrow) in block.chunks_exact(n).enumerate() {
                let at = li * b.cols.1;
                let seg = row_segments_from(b.r0 + li, m.shift, m.width, j0, b.seen);
                let dslab_row = &mut dslab[at..at + b.cols.1];
                mixed::add_tile_row_grads(&dsrow[..b.seen], b.cols.0, seg, dslab_row);
            }
            mixed::add_tile_grads(&m, packed, (b.r0, b.count), b.cols, dslab, &mut *grads);
        }
    }

    /// The blocks of [`MIXED_ROWS`] rows of a tile (rows `i0..i0 + rows`, keys `j0..j0 + n`)
    /// that see any of its keys, each with the keys its last row sees (the rows' pass masks
    /// the rest; their dS is 0) and the columns those read. Short blocks: the columns a block
    /// reads span its keys plus one per row more.
    fn mixed_blocks<'m>(
        &'m self,
        m: &'m MixedLayout,
        (i0, rows): (usize, usize),
        (j0, n): (usize, usize),
    ) -> impl Iterator<Item = MixedBlock> + 'm {
        (0..rows).step_by(MIXED_ROWS).filter_map(move |first| {
            let count = MIXED_ROWS.min(rows - first);
            let r0 = i0 + first;
            let seen = self.rule.visible(r0 + count - 1, j0 + n).saturating_sub(j0);
            (seen > 0 && n > 0).then(|| MixedBlock {
                first,
                r0,
                count,
                seen,
                cols: mixed::tile_columns(m, (r0, count), (j0, seen)),
            })
        })
    }

    /// Bias, masks and softmax of logits row `r` (flat over `(B, H, Tq)`), with the fastest
    /// build of [`Self::run`] this CPU runs.
    ///
    /// `row` holds the logits of keys `0..row.len()`; a caller may leave out trailing keys that
    /// no query of its rows sees (causally hidden), but only when no key is padded (a fully
    /// padded row is uniform over the keys it is given).
    #[inline(always)]
    pub(crate) fn run_best(&self, r: usize, row: &mut [f32]) {
        match self.isa {
            // SAFETY: `Isa::detect` found the instructions on this CPU.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { self.run_avx512(r, row) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { self.run_avx2(r, row) },
            Isa::Baseline => self.run(r, row),
        }
    }

    /// Soft cap, terms, padding, window and chunk of the logits of keys `j0..j0 + row.len()`
    /// of row `r` (flat over `(B, H, Tq)`), masked keys set to `f32::MIN`; returns how many of
    /// them lie before the row's causal limit (the keys past it are left as they are).
    #[inline(always)]
    fn mask_keys(&self, r: usize, row: &mut [f32], j0: usize) -> usize {
        let (h, tq, tk) = self.dims;
        let (bi, hi, i) = (r / (h * tq), (r / tq) % h, r % tq);
        let rule = self.rule;
        let visible = rule.visible(i, j0 + row.len()).saturating_sub(j0);
        let row = &mut row[..visible];
        if let Some(c) = rule.softcap {
            for x in row.iter_mut() {
                *x = c * (*x / c).tanh();
            }
        }
        for (src, t) in &self.terms {
            if !(self.mixed_in_tiles && t.mixed.is_some()) {
                t.add_row(src, (bi, hi, i), j0, row);
            }
        }
        if let Some(p) = self.padding {
            for (x, keep) in row.iter_mut().zip(&p[bi * tk + j0..]) {
                if *keep == 0 {
                    *x = f32::MIN;
                }
            }
        }
        let left = self.lefts.get(bi).copied().unwrap_or(0);
        let (start, end) = rule.span(i, left);
        let clip = |x: usize| x.saturating_sub(j0).min(visible);
        let (start, end) = (clip(start), clip(end));
        row[..start].iter_mut().for_each(|x| *x = f32::MIN);
        row[end.max(start)..].iter_mut().for_each(|x| *x = f32::MIN);
        visible
    }

    /// Bias, masks and softmax of logits row `r` (flat over `(B, H, Tq)`).
    #[inline(always)]
    fn run(&self, r: usize, row: &mut [f32]) {
        let (h, tq, _) = self.dims;
        let hi = (r / tq) % h;
        let visible = self.mask_keys(r, row, 0);
        let (row, hidden) = row.split_at_mut(visible);
        let rule = self.rule;
        let sink = rule.sinks.as_ref().map(|s| s[hi]);
        let max = row_max(row);
        if max == f32::MIN && sink.is_none() && !hidden.is_empty() {
            // Every key masked: uniform over the keys that hold the lowest value, the hidden
            // ones included, as the unfused path (which fills them with it) and the online
            // pass give; a key a user's mask set to −∞ keeps weight 0.
            let masked = row.iter().filter(|&&x| x == f32::MIN).count() + hidden.len();
            let u = 1.0 / masked as f32;
            for x in row.iter_mut() {
                *x = if *x == f32::MIN { u } else { 0.0 };
            }
            hidden.iter_mut().for_each(|x| *x = u);
            return;
        }
        // A sink joins the normalisation with no value: its weight is left out of the row.
        let (max, sink_weight) = match sink {
            None => (max, 0.0),
            Some(s) => {
                // Comparisons, not f32::max: a NaN must stay NaN.
                let m = if s > max || s.is_nan() { s } else { max };
                let d = s - m;
                (m, if d < FLUSH_BELOW { 0.0 } else { exp(d) })
            }
        };
        let inv = 1.0 / (exp_shifted_in_place(row, max) + sink_weight);
        for x in row.iter_mut() {
            *x *= inv;
        }
        // 0, or NaN when the row is NaN: what the unfused softmax gives keys masked with the
        // lowest value.
        hidden.iter_mut().for_each(|x| *x = 0.0 * inv);
    }

    /// The state row `r`'s online softmax starts from: its head's sink logit at weight 1 (the
    /// sink joins the normalisation and carries no value), or nothing.
    #[inline(always)]
    pub(crate) fn running(&self, r: usize) -> Running {
        let (h, tq, _) = self.dims;
        match &self.rule.sinks {
            Some(s) => Running {
                max: s[(r / tq) % h],
                sum: 1.0,
            },
            None => Running {
                max: f32::NEG_INFINITY,
                sum: 0.0,
            },
        }
    }

    /// One key tile of row `r`'s online softmax, with the fastest build of [`Self::online`]
    /// this CPU runs.
    #[inline(always)]
    pub(crate) fn online_best(
        &self,
        r: usize,
        row: &mut [f32],
        j0: usize,
        state: &mut Running,
    ) -> f32 {
        match self.isa {
            // SAFETY: `Isa::detect` found the instructions on this CPU.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { self.online_avx512(r, row, j0, state) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { self.online_avx2(r, row, j0, state) },
            Isa::Baseline => self.online(r, row, j0, state),
        }
    }

    /// One key tile of row `r`'s online softmax: the logits of keys `j0..j0 + row.len()` get
    /// the row's terms and masks (keys past its causal limit are masked too), then become
    /// weights `e^(s − m)` against the running maximum `m` over every tile so far, which
    /// `state` keeps with the running sum of weights. Returns the factor `e^(m_old − m)` by
    /// which everything the row accumulated from earlier tiles must be scaled.
    ///
    /// The weights of a whole row are [`Self::run`]'s once divided by the final sum, up to
    /// rounding: masked keys take `f32::MIN` here too, so a row masked whole is uniform over
    /// every key given to it.
    #[inline(always)]
    fn online(&self, r: usize, row: &mut [f32], j0: usize, state: &mut Running) -> f32 {
        let visible = self.mask_keys(r, row, j0);
        row[visible..].iter_mut().for_each(|x| *x = f32::MIN);
        let max = row_max(row);
        // Comparisons, not f32::max: a NaN must stay NaN.
        let m = if max > state.max || max.is_nan() {
            max
        } else {
            state.max
        };
        if m == f32::NEG_INFINITY {
            // Only −∞ logits so far: nothing weighs yet (a row of −∞ only ends with a sum of
            // 0 and NaN output, as `run` gives).
            row.iter_mut().for_each(|x| *x = 0.0);
            return 0.0;
        }
        let d = state.max - m;
        let alpha = if d < FLUSH_BELOW { 0.0 } else { exp(d) };
        state.sum = state.sum * alpha + exp_shifted_in_place(row, m);
        state.max = m;
        alpha
    }

    /// The weights of keys `j0..j0 + row.len()` of row `r` again, from their logits and the
    /// row's final softmax maximum `max` and inverse sum `inv` (as the online pass kept them):
    /// `e^(s − max) · inv` after the row's terms and masks, flushed as the pass flushes, so a
    /// row masked whole is uniform again. With the fastest build this CPU runs.
    #[inline(always)]
    pub(crate) fn recompute_best(&self, r: usize, row: &mut [f32], j0: usize, max: f32, inv: f32) {
        match self.isa {
            // SAFETY: `Isa::detect` found the instructions on this CPU.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { self.recompute_avx512(r, row, j0, max, inv) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { self.recompute_avx2(r, row, j0, max, inv) },
            Isa::Baseline => self.recompute(r, row, j0, max, inv),
        }
    }

    #[inline(always)]
    fn recompute(&self, r: usize, row: &mut [f32], j0: usize, max: f32, inv: f32) {
        let visible = self.mask_keys(r, row, j0);
        row[visible..].iter_mut().for_each(|x| *x = f32::MIN);
        for x in row.iter_mut() {
            let d = *x - max;
            // Comparisons, not f32::max: a NaN must stay NaN.
            let below = d < FLUSH_BELOW;
            let e = exp(if below { FLUSH_BELOW } else { d });
            *x = if below { 0.0 } else { e * inv };
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn recompute_avx2(&self, r: usize, row: &mut [f32], j0: usize, max: f32, inv: f32) {
        self.recompute(r, row, j0, max, inv)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    fn recompute_avx512(&self, r: usize, row: &mut [f32], j0: usize, max: f32, inv: f32) {
        self.recompute(r, row, j0, max, inv)
    }

    /// A value term's sums per column of row `i`'s weights at keys `j0..j0 + row.len()`
    /// ([`add_shifted_sums_from`]), with the fastest build this CPU runs: the same additions
    /// in the same order, so every build gives the same sums.
    #[inline(always)]
    pub(crate) fn add_shifted_sums_best(
        &self,
        row: &[f32],
        (i, shift, j0): (usize, i64, usize),
        sums: &mut [f32],
    ) {
        match self.isa {
            // SAFETY: `Isa::detect` found the instructions on this CPU.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { add_shifted_sums_avx512(row, (i, shift, j0), sums) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { add_shifted_sums_avx2(row, (i, shift, j0), sums) },
            Isa::Baseline => add_shifted_sums_from(row, i, shift, j0, sums),
        }
    }

    /// Mixed rows' gradients from row `i` (of sequence `bi`, head `hi`) of dS at keys
    /// `j0..j0 + ds.len()`, into `grads`, one packed row of term `term` (the bank's, then each
    /// query's mix's; [`add_mixed_grads`]), with the fastest build this CPU runs (the same
    /// operations in the same order in each).
    #[inline(always)]
    pub(crate) fn add_mixed_grads_best(
        &self,
        term: usize,
        (bi, hi, i, j0): (usize, usize, usize, usize),
        ds: &[f32],
        grads: &mut [f32],
    ) {
        let (src, t) = self.terms[term];
        let Some(m) = t.mixed else { return };
        let operands = m.split(t.packed_row(src, bi, hi), i);
        let s = row_segments_from(i, m.shift, m.width, j0, ds.len());
        let (dbank, dmixes) = grads.split_at_mut(m.rank * m.width);
        let dmix = &mut dmixes[i * m.rank..(i + 1) * m.rank];
        match self.isa {
            // SAFETY: `Isa::detect` found the instructions on this CPU.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { add_mixed_grads_avx512(operands, ds, s, (dbank, dmix)) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { add_mixed_grads_avx2(operands, ds, s, (dbank, dmix)) },
            Isa::Baseline => add_mixed_grads(operands, ds, s, (dbank, dmix)),
        }
    }

    /// [`Self::online`] compiled for AVX2 (the same operations per lane as the baseline).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn online_avx2(&self, r: usize, row: &mut [f32], j0: usize, state: &mut Running) -> f32 {
        self.online(r, row, j0, state)
    }

    /// [`Self::online`] compiled for AVX-512.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    fn online_avx512(&self, r: usize, row: &mut [f32], j0: usize, state: &mut Running) -> f32 {
        self.online(r, row, j0, state)
    }

    /// [`Self::run`] compiled for AVX2: eight lanes instead of SSE2's four. The arithmetic is
    /// the same IEEE operations in the same order per lane (no FMA contraction), so both give
    /// identical results.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn run_avx2(&self, r: usize, row: &mut [f32]) {
        self.run(r, row)
    }

    /// [`Self::run`] compiled for AVX-512: sixteen lanes per instruction; the reductions keep
    /// their [`LANES`] accumulators, so the results are again identical.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    fn run_avx512(&self, r: usize, row: &mut [f32]) {
        self.run(r, row)
    }
}

/// [`add_shifted_sums_from`] compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn add_shifted_sums_avx2(row: &[f32], (i, shift, j0): (usize, i64, usize), sums: &mut [f32]) {
    add_shifted_sums_from(row, i, shift, j0, sums)
}

/// [`add_shifted_sums_from`] compiled for AVX-512.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn add_shifted_sums_avx512(row: &[f32], (i, shift, j0): (usize, i64, usize), sums: &mut [f32]) {
    add_shifted_sums_from(row, i, shift, j0, sums)
}

impl InplaceOp1 for BiasMaskSoftmax {
    fn name(&self) -> &'static str {
        "posenc-bias-mask-softmax"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let dims = layout.shape().dims4()?;
        let (CpuStorage::F32(data), Some((start, end))) = (storage, layout.contiguous_offsets())
        else {
            candle_core::bail!("fused softmax: logits must be contiguous f32");
        };
        let guards = TermGuards::new(&self.terms, self.padding.as_ref());
        let pass = guards.pass(dims, &self.rule)?;
        data[start..end]
            .par_chunks_mut(dims.3.max(1))
            .enumerate()
            .for_each(|(r, row)| pass.run_best(r, row));
        Ok(())
    }
}

/// [`add_mixed_grads`] compiled for AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn add_mixed_grads_avx2(
    operands: (&[f32], &[f32]),
    ds: &[f32],
    s: RowSegments,
    grads: (&mut [f32], &mut [f32]),
) {
    add_mixed_grads(operands, ds, s, grads)
}

/// [`add_mixed_grads`] compiled for AVX-512.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn add_mixed_grads_avx512(
    operands: (&[f32], &[f32]),
    ds: &[f32],
    s: RowSegments,
    grads: (&mut [f32], &mut [f32]),
) {
    add_mixed_grads(operands, ds, s, grads)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_f64_within_3e7_relative() {
        let mut worst = 0f64;
        for i in 0..=870_000 {
            let x = -(i as f32) * 1e-4;
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 3e-7, "worst relative error {worst:e}");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NAN).is_nan());
    }

    /// The AVX-512, AVX2 and baseline builds of the row pass give bit-identical rows (the
    /// baseline runs only on CPUs without AVX2, so it is checked here), for whole rows and for
    /// rows cut short after the last causally visible key.
    #[test]
    fn vector_builds_agree_bitwise() {
        let (h, tq, tk) = (1, 3, 37);
        let pad: Vec<u8> = (0..tk).map(|j| (j % 5 != 0) as u8).collect();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let rules = [
            RowRule::default(),
            RowRule::causal(30),
            RowRule {
                window: Some(9),
                softcap: Some(3.0),
                sinks: Some(vec![0.7]),
                ..RowRule::causal(30)
            },
            RowRule {
                first: 20,
                window: Some(4),
                ..RowRule::default()
            },
            RowRule {
                chunk: Some(8),
                ..RowRule::causal(30)
            },
        ];
        for rule in &rules {
            for padding in [None, Some(pad.as_slice())] {
                let pass = RowPass {
                    terms: vec![],
                    padding,
                    lefts: leading_padding(rule, padding, tk),
                    rule,
                    dims: (h, tq, tk),
                    isa: Isa::Baseline,
                    mixed_in_tiles: false,
                };
                for r in 0..tq {
                    for len in [tk, 33] {
                        let row: Vec<f32> = (0..len)
                            .map(|j| ((j * 7 + r) % 11) as f32 * 0.9 - 4.0)
                            .collect();
                        let mut base = row.clone();
                        pass.run(r, &mut base);
                        let total: f32 = base.iter().sum();
                        if rule.sinks.is_none() {
                            assert!((total - 1.0).abs() < 1e-6, "row sums to {total}");
                        } else {
                            assert!(total > 0.0 && total < 1.0, "the sink takes weight: {total}");
                        }
                        #[cfg(target_arch = "x86_64")]
                        {
                            if std::arch::is_x86_feature_detected!("avx2") {
                                let mut wide = row.clone();
                                // SAFETY: AVX2 was detected just above.
                                unsafe { pass.run_avx2(r, &mut wide) };
                                assert_eq!(bits(&base), bits(&wide));
                            }
                            if std::arch::is_x86_feature_detected!("avx512f") {
                                let mut wide = row.clone();
                                // SAFETY: AVX-512F was detected just above.
                                unsafe { pass.run_avx512(r, &mut wide) };
                                assert_eq!(bits(&base), bits(&wide));
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn shifted_exp_flushes_below_e_minus_40_and_keeps_nan() {
        let mut row = [0.0, -1.0, -41.0, f32::NAN, -39.0];
        let sum = exp_shifted_in_place(&mut row, 0.0);
        assert_eq!(row[2], 0.0);
        assert!(row[3].is_nan() && sum.is_nan());
        assert!((row[1] as f64 - (-1f64).exp()).abs() < 1e-7);
        assert!(row[4] > 0.0);
        let mut row = [1.0f32; 11];
        row[7] = 3.0;
        assert_eq!(row_max(&row), 3.0);
    }
}
