//! Mixed rows: a relative bias whose rows are each query's mix of a bank shared by all.
//!
//! ```text
//! values[b, h, i, c] = Σ_e mix[b, h, i, e] · bank[e, c]      mix: (1|B, 1|H, 1|Tq, R), bank: (R, W)
//! bias[b, h, i, j]   = values[b, h, i, c(i, j)]              c as the bias's columns (shift or map)
//! d mix[b, h, i, e]  = Σ_j dS[b, h, i, j] · bank[e, c(i, j)]
//! d bank[e, c]       = Σ_{b, h, i} mix[b, h, i, e] · Σ_{j: c(i, j) = c} dS[b, h, i, j]
//! ```
//!
//! Inkling's relative logits have this form (R = 16 mixing weights per query and head, a bank
//! of 1024 distances). The fused CPU passes read the mix and the bank and compute a row's
//! columns as they add them to the logits, forward and backward, so a pass holds O(T·R + R·W)
//! instead of the `(B, H, Tq, W)` rows and their gradient; the other paths build the rows
//! ([`MixedRows::product`]) and read them as any rows.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};
use rayon::prelude::*;

use crate::cpu::row_scale::scale_rows;
use crate::error::{Error, Result};
use crate::limits::check_elements;
use crate::matmul::broadcast_matmul;
use crate::plug::relative::RowSegments;

/// The mix and the bank of mixed rows; see the module docs.
#[derive(Debug, Clone)]
pub(crate) struct MixedRows {
    mix: Tensor,
    bank: Tensor,
    form: MixForm,
}

/// How a [`MixedRows`]' mix is laid out.
#[derive(Debug, Clone)]
enum MixForm {
    /// `(1|B, 1|H, 1|Tq, R)`.
    Rows,
    /// `(1|B, H·R, Tq)`, per-token states channels first (head `h`'s mix at channels
    /// `h·R..(h + 1)·R`), query `i`'s times `scale[i]`: read so by the packing, with no graph
    /// node between the states and it.
    Channels {
        heads: usize,
        scale: Option<Arc<Vec<f32>>>,
    },
}

impl MixedRows {
    /// Checks and keeps `mix` `(1|B, 1|H, 1|Tq, R)` and `bank` `(R, W)`.
    ///
    /// # Errors
    /// [`Error::Rank`] unless the mix is 4-D and the bank 2-D; [`Error::Shape`] for `R = 0`,
    /// mixes and banks of different `R`, or `W` outside `1..2^32`; [`Error::DType`] for
    /// integer tensors or two dtypes; [`Error::Device`] for two devices.
    pub(crate) fn new(mix: Tensor, bank: Tensor) -> Result<Self> {
        let rank = |what, t: &Tensor, expected| Error::Rank {
            what,
            expected,
            got: t.rank(),
            shape: t.dims().to_vec(),
        };
        let (_, _, _, r) = mix.dims4().map_err(|_| rank("relative mix", &mix, 4))?;
        let (br, width) = bank.dims2().map_err(|_| rank("relative bank", &bank, 2))?;
        if r == 0 || br != r || width == 0 || width > u32::MAX as usize {
            return Err(Error::shape(
                "relative bank",
                format!(
                    "({r}, width) with 1 ≤ width ≤ 2^32 − 1 = (the mix's last axis, columns), \
                     the mix's last axis at least 1"
                ),
                bank.shape(),
            ));
        }
        crate::error::check_float("relative mix", mix.dtype())?;
        if bank.dtype() != mix.dtype() {
            return Err(Error::DType {
                what: "relative bank",
                expected: "the mix's dtype",
                got: bank.dtype(),
            });
        }
        crate::error::check_device("relative bank", &bank, mix.device())?;
        Ok(Self {
            mix,
            bank,
            form: MixForm::Rows,
        })
    }

    /// The mix given as per-token states `(1|B, H·R, Tq)` (head `h`'s weights at channels
    /// `h·R..(h + 1)·R`), query `i`'s times `scale[i]` when given (`Tq` factors), and `bank`
    /// `(R, W)`.
    ///
    /// # Errors
    /// As [`Self::new`]; [`Error::Shape`] for channels that are not `heads` times the bank's
    /// rows, or factors that are not one per query.
    pub(crate) fn channels(
        states: Tensor,
        heads: usize,
        bank: Tensor,
        scale: Option<Vec<f32>>,
    ) -> Result<Self> {
        let (b, c, tq) = states.dims3()?;
        let r = bank.dims2().map(|(r, _)| r).unwrap_or(0);
        if heads == 0 || r == 0 || c != heads * r || scale.as_ref().is_some_and(|f| f.len() != tq) {
            return Err(Error::shape(
                "relative mix (per-token states)",
                format!("(batch, {heads} × {r}, queries) with one factor per query"),
                states.shape(),
            ));
        }
        // The checks of the rows form, on the view that form would hold.
        Self::new(
            states.reshape((b, heads, r, tq))?.transpose(2, 3)?,
            bank.clone(),
        )?;
        Ok(Self {
            mix: states,
            bank,
            form: MixForm::Channels {
                heads,
                scale: scale.map(Arc::new),
            },
        })
    }

    /// The mix as given (rows, or per-token states).
    pub(crate) fn mix(&self) -> &Tensor {
        &self.mix
    }

    /// The mix as rows `(1|B, 1|H, 1|Tq, R)`: a view of per-token states, scaled when they are.
    pub(crate) fn mix_rows(&self) -> Result<Tensor> {
        match &self.form {
            MixForm::Rows => Ok(self.mix.clone()),
            MixForm::Channels { heads, scale } => {
                let (b, c, tq) = self.mix.dims3()?;
                let rows = self
                    .mix
                    .reshape((b, *heads, c / heads, tq))?
                    .transpose(2, 3)?;
                match scale {
                    Some(f) => scale_rows(&rows, f.as_ref().clone()),
                    None => Ok(rows),
                }
            }
        }
    }

    /// The same rows with the mix and the bank through `f` (a cast), the form kept.
    pub(crate) fn map(&self, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        Ok(Self {
            mix: f(&self.mix)?,
            bank: f(&self.bank)?,
            form: self.form.clone(),
        })
    }

    /// `(R, W)`.
    pub(crate) fn bank(&self) -> &Tensor {
        &self.bank
    }

    /// The rows' axes, `(1|B, 1|H, 1|Tq, W)`.
    pub(crate) fn dims(&self) -> (usize, usize, usize, usize) {
        let m = self.mix.dims();
        let w = self.bank.dims()[1];
        match &self.form {
            MixForm::Rows => (m[0], m[1], m[2], w),
            MixForm::Channels { heads, .. } => (m[0], *heads, m[2], w),
        }
    }

    /// The rows `mix · bank`, `(1|B, 1|H, 1|Tq, W)` in the mix's dtype, with gradients to both.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if they would pass [`crate::limits::max_elements`].
    pub(crate) fn product(&self) -> Result<Tensor> {
        let (b, h, rows, width) = self.dims();
        check_elements(
            "relative bank width",
            width,
            "batch × heads × rows × width of the rows built from a mix and a bank",
            &[b, h, rows, width],
        )?;
        broadcast_matmul(&self.mix_rows()?, &self.bank)
    }

    /// The mix and the bank packed for a fused pass over `(B, H, Tq, ·)` logits: f32
    /// `(1|B, 1|H, 1, R·W + Tq·R)`, the bank then the mix's rows (a mix shared by the queries
    /// repeated for each), gradients flowing back through the packing (on the CPU one node,
    /// [`Pack`]).
    ///
    /// # Errors
    /// [`Error::Shape`] if the mix's rows are neither 1 nor `tq`; [`Error::InvalidConfig`]
    /// past the element budget.
    pub(crate) fn packed(&self, tq: usize) -> Result<Tensor> {
        let (b, h, rows, width) = self.dims();
        let r = self.bank.dims()[0];
        if rows != 1 && rows != tq {
            return Err(Error::shape(
                "relative mix",
                format!("(batch, heads, 1 or {tq}, {r}) = (batch, heads, queries, mix)"),
                self.mix.shape(),
            ));
        }
        check_elements(
            "relative bank width",
            width,
            "batch × heads × (bank + queries' mixes) of the packed mixed rows",
            &[b, h, r * width + tq * r],
        )?;
        let bank = self.bank.to_dtype(DType::F32)?;
        if self.mix.device().is_cpu() {
            // One node of the graph, reading the mix through its strides.
            let (heads, scale) = match &self.form {
                MixForm::Rows => (None, None),
                MixForm::Channels { heads, scale } => (Some(*heads), scale.clone()),
            };
            let pack = Pack { tq, heads, scale };
            return Ok(self.mix.to_dtype(DType::F32)?.apply_op2(&bank, pack)?);
        }
        let mix = self.mix_rows()?.to_dtype(DType::F32)?;
        let bank = bank
            .reshape((1, 1, r * width))?
            .broadcast_as((b, h, r * width))?;
        let mix = match rows == tq {
            true => mix,
            false => mix.broadcast_as((b, h, tq, r))?,
        };
        let mix = mix.reshape((b, h, tq * r))?;
        Ok(Tensor::cat(&[&bank, &mix], 2)?.unsqueeze(2)?)
    }
}

/// The packing of [`MixedRows::packed`] as one op: the mix read through its layout, the
/// bank copied into each `(b, h)` row; its backward sums the bank's rows over `(b, h)` and
/// the mix's over the queries it was repeated for.
struct Pack {
    tq: usize,
    /// `Some(H)` for a mix of per-token states `(B, H·R, Tq)`.
    heads: Option<usize>,
    /// Per-query factors of such a mix.
    scale: Option<Arc<Vec<f32>>>,
}

impl Pack {
    /// `(B, H, rows, R)` of the mix, from the dims of the tensor given and the bank's `R`.
    fn mix_dims(&self, dims: &[usize], r: usize) -> candle_core::Result<[usize; 4]> {
        match (self.heads, dims) {
            (None, &[b, h, rows, r]) => Ok([b, h, rows, r]),
            (Some(h), &[b, _, tq]) => Ok([b, h, tq, r]),
            _ => candle_core::bail!("mixed rows: a mix of {dims:?}"),
        }
    }

    /// The element offsets of mix `[b, h, i, e]`: (of `[b, h, i]`, the step over `e`).
    fn at(
        &self,
        (o, st): (usize, &[usize]),
        (b, h, i): (usize, usize, usize),
        r: usize,
    ) -> (usize, usize) {
        match self.heads {
            None => (o + b * st[0] + h * st[1] + i * st[2], st[3]),
            Some(_) => (o + b * st[0] + h * r * st[1] + i * st[2], st[1]),
        }
    }

    /// Query `i`'s factor.
    fn factor(&self, i: usize) -> f32 {
        self.scale.as_ref().map_or(1.0, |f| f[i])
    }
}

/// Where element `[a, b, c, d]` of a 4-D (or `[a, b]` of a 2-D) layout lies.
fn strided(l: &Layout) -> (usize, Vec<usize>) {
    (l.start_offset(), l.stride().to_vec())
}

impl CustomOp2 for Pack {
    fn name(&self) -> &'static str {
        "posenc-mixed-rows-pack"
    }

    fn cpu_fwd(
        &self,
        ms: &CpuStorage,
        ml: &Layout,
        bs: &CpuStorage,
        bl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(m), CpuStorage::F32(bank)) = (ms, bs) else {
            candle_core::bail!("mixed rows: the mix and the bank must be f32");
        };
        let (r, w) = bl.shape().dims2()?;
        let [mb, mh, rows, _] = self.mix_dims(ml.dims(), r)?;
        let ((mo, ms), (bo, bst)) = (strided(ml), strided(bl));
        let len = r * w + self.tq * r;
        let mut out = crate::cpu::zeroed(mb * mh * len, "packed mixed rows")?;
        out.par_chunks_mut(len.max(1))
            .enumerate()
            .for_each(|(bh, dst)| {
                let (bi, hi) = (bh / mh, bh % mh);
                let (head, mixes) = dst.split_at_mut(r * w);
                for (e, row) in head.chunks_exact_mut(w).enumerate() {
                    for (c, x) in row.iter_mut().enumerate() {
                        *x = bank[bo + e * bst[0] + c * bst[1]];
                    }
                }
                for (i, row) in mixes.chunks_exact_mut(r).enumerate() {
                    let ii = if rows == 1 { 0 } else { i };
                    let (at, step) = self.at((mo, &ms), (bi, hi, ii), r);
                    let f = self.factor(ii);
                    for (e, x) in row.iter_mut().enumerate() {
                        *x = f * m[at + e * step];
                    }
                }
            });
        Ok((CpuStorage::F32(out), Shape::from((mb, mh, 1, len))))
    }

    fn bwd(
        &self,
        mix: &Tensor,
        bank: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let (r, w) = bank.dims2()?;
        let [mb, mh, rows, _] = self.mix_dims(mix.dims(), r)?;
        let g = grad.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let len = r * w + self.tq * r;
        let dbank = match bank.track_op() {
            false => None,
            true => {
                let mut d = vec![0f32; r * w];
                for row in g.chunks_exact(len.max(1)) {
                    d.iter_mut().zip(&row[..r * w]).for_each(|(x, y)| *x += y);
                }
                Some(Tensor::from_vec(d, (r, w), bank.device())?.to_dtype(bank.dtype())?)
            }
        };
        let dmix = match mix.track_op() {
            false => None,
            true => {
                // Laid out as the mix given: rows `(B, H, rows, R)`, or states `(B, H·R, Tq)`
                // (contiguous strides of either, through `at`).
                let mut d = vec![0f32; mb * mh * rows * r];
                let contiguous: Vec<usize> = match self.heads {
                    None => vec![mh * rows * r, rows * r, r, 1],
                    Some(_) => vec![mh * r * rows, rows, 1],
                };
                for (bh, row) in g.chunks_exact(len.max(1)).enumerate() {
                    let (bi, hi) = (bh / mh, bh % mh);
                    for (i, src) in row[r * w..].chunks_exact(r).enumerate() {
                        let ii = if rows == 1 { 0 } else { i };
                        let (at, step) = self.at((0, &contiguous), (bi, hi, ii), r);
                        let f = self.factor(ii);
                        for (e, y) in src.iter().enumerate() {
                            d[at + e * step] += f * y;
                        }
                    }
                }
                let d = Tensor::from_vec(d, mix.shape(), mix.device())?;
                Some(d.to_dtype(mix.dtype())?)
            }
        };
        Ok((dmix, dbank))
    }
}

/// The packed layout of one `(b, h)` row of [`MixedRows::packed`], with the bias's shift.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MixedLayout {
    /// Mixing weights per query, `R`.
    pub(crate) rank: usize,
    /// Columns of the bank, `W`.
    pub(crate) width: usize,
    /// The bias's column shift.
    pub(crate) shift: i64,
}

impl MixedLayout {
    /// The packed length of one `(b, h)` row for `tq` queries.
    pub(crate) fn len(&self, tq: usize) -> usize {
        self.rank * self.width + tq * self.rank
    }

    /// The bank and query `i`'s mix in one packed `(b, h)` row.
    #[inline(always)]
    pub(crate) fn split<'a>(&self, packed: &'a [f32], i: usize) -> (&'a [f32], &'a [f32]) {
        let (bank, mixes) = packed.split_at(self.rank * self.width);
        (bank, &mixes[i * self.rank..(i + 1) * self.rank])
    }
}

/// The columns a tile of query rows `i0..i0 + rows` and keys `j0..j0 + n` reads, `(first,
/// count)`: every clamped column of every pair lies among them (column 0 when a pair clamps
/// below, `W − 1` when one clamps above).
pub(crate) fn tile_columns(
    layout: &MixedLayout,
    (i0, rows): (usize, usize),
    (j0, n): (usize, usize),
) -> (usize, usize) {
    let w = layout.width as i128;
    let clamp = |c: i128| c.clamp(0, w - 1) as usize;
    let shift = layout.shift as i128;
    let lo = clamp(j0 as i128 - (i0 + rows.max(1) - 1) as i128 + shift);
    let hi = clamp((j0 + n.max(1) - 1) as i128 - i0 as i128 + shift);
    (lo, hi - lo + 1)
}

/// A tile's rows over its columns `(first, count)`: `slab[li, c] = Σ_e mix[i0 + li, e] ·
/// bank[e, first + c]`, `rows × count`, one product (`packed` is one `(b, h)` row of
/// [`MixedRows::packed`]).
pub(crate) fn tile_values(
    layout: &MixedLayout,
    packed: &[f32],
    (i0, rows): (usize, usize),
    (first, count): (usize, usize),
    slab: &mut Vec<f32>,
) {
    let (r, w) = (layout.rank, layout.width);
    slab.clear();
    slab.resize(rows * count, 0.0);
    let (bank, mixes) = packed.split_at(r * w);
    let mix = &mixes[i0 * r..(i0 + rows) * r];
    // SAFETY: slab is rows × count; mix holds rows × R values (row stride R); the bank's
    // columns first..first + count of its R rows (row stride W) lie inside it (first + count
    // ≤ W, from `tile_columns`).
    unsafe {
        crate::cpu::gemm::product(
            (rows, count, r),
            (slab.as_mut_ptr(), count, false),
            (mix.as_ptr(), 1, r),
            (bank[first..].as_ptr(), 1, w),
        )
    }
}

/// Adds a tile row's values to its logits: `slab_row` holds the columns `first..` of
/// [`tile_columns`], `s` the row's segments (keys before `s.lo` read column 0, from `s.hi`
/// column `W − 1`, which the tile's columns hold whenever a key reads them).
#[inline(always)]
pub(crate) fn add_tile_row(slab_row: &[f32], first: usize, s: RowSegments, row: &mut [f32]) {
    let (left, rest) = row.split_at_mut(s.lo);
    let (middle, right) = rest.split_at_mut(s.hi - s.lo);
    if let Some(&v) = slab_row.first().filter(|_| !left.is_empty()) {
        left.iter_mut().for_each(|x| *x += v);
    }
    if !middle.is_empty() {
        let from = &slab_row[s.first_col - first..][..middle.len()];
        middle.iter_mut().zip(from).for_each(|(x, y)| *x += y);
    }
    if let Some(&v) = slab_row.last().filter(|_| !right.is_empty()) {
        right.iter_mut().for_each(|x| *x += v);
    }
}

/// dS of a tile row summed per column into `dslab_row` (the tile's columns from `first`), as
/// [`add_tile_row`] read them.
#[inline(always)]
pub(crate) fn add_tile_row_grads(ds: &[f32], first: usize, s: RowSegments, dslab_row: &mut [f32]) {
    let left: f32 = ds[..s.lo].iter().sum();
    let right: f32 = ds[s.hi..].iter().sum();
    if s.lo > 0 {
        dslab_row[0] += left;
    }
    let middle = &ds[s.lo..s.hi];
    if !middle.is_empty() {
        let to = &mut dslab_row[s.first_col - first..][..middle.len()];
        to.iter_mut().zip(middle).for_each(|(x, y)| *x += y);
    }
    if s.hi < ds.len() {
        let last = dslab_row.len() - 1;
        dslab_row[last] += right;
    }
}

/// The tile's gradients from its per-column sums `dslab` (`rows × count`, columns from
/// `first`): the mixes' `dmix[i0 + li] += dslab[li] · bank[:, cols]ᵀ` and the bank's
/// `dbank[:, cols] += mix[i0..]ᵀ · dslab`, two products into `grads`, one `(b, h)` row of the
/// packed gradient (laid out as [`MixedRows::packed`]).
pub(crate) fn add_tile_grads(
    layout: &MixedLayout,
    packed: &[f32],
    (i0, rows): (usize, usize),
    (first, count): (usize, usize),
    dslab: &[f32],
    grads: &mut [f32],
) {
    let (r, w) = (layout.rank, layout.width);
    let (bank, mixes) = packed.split_at(r * w);
    let mix = &mixes[i0 * r..(i0 + rows) * r];
    let (dbank, dmixes) = grads.split_at_mut(r * w);
    let dmix = &mut dmixes[i0 * r..(i0 + rows) * r];
    // SAFETY: dslab is rows × count; the bank's columns first..first + count (≤ W) of its R
    // rows are read transposed (column stride W); dmix is rows × R; mix is rows × R, read
    // transposed (column stride R); dbank's columns first.. of its R rows (row stride W).
    unsafe {
        crate::cpu::gemm::product(
            (rows, r, count),
            (dmix.as_mut_ptr(), r, true),
            (dslab.as_ptr(), 1, count),
            (bank[first..].as_ptr(), w, 1),
        );
        crate::cpu::gemm::product(
            (r, count, rows),
            (dbank[first..].as_mut_ptr(), w, true),
            (mix.as_ptr(), r, 1),
            (dslab.as_ptr(), 1, count),
        );
    }
}

/// Lanes of the loops below: one vector register of f32 under AVX-512.
const LANES: usize = 16;

/// `row[j] += Σ_e mix[e] · bank[e, c]` over the segments `s` of a row (keys before `s.lo` read
/// column 0, keys from `s.hi` column `W − 1`): the bank `(R, W)` row-major, `R = mix.len()`.
/// Each value is summed over `e` first and then added, as the built rows hold it.
#[inline(always)]
pub(crate) fn add_mixed_row(bank: &[f32], mix: &[f32], s: RowSegments, row: &mut [f32]) {
    let width = bank.len() / mix.len().max(1);
    let column = |c: usize| -> f32 {
        mix.iter()
            .enumerate()
            .map(|(e, m)| m * bank[e * width + c])
            .sum()
    };
    let (left, rest) = row.split_at_mut(s.lo);
    let (middle, right) = rest.split_at_mut(s.hi - s.lo);
    if !left.is_empty() {
        let v = column(0);
        left.iter_mut().for_each(|x| *x += v);
    }
    // Four registers of keys at a time (four independent chains of additions), every mixing
    // weight into them, then one add to the logits; then a register at a time.
    let mut c = s.first_col;
    let mut blocks = middle.chunks_exact_mut(4 * LANES);
    for block in &mut blocks {
        let mut acc = [[0f32; LANES]; 4];
        for (e, m) in mix.iter().enumerate() {
            let at = e * width + c;
            for (r, a) in acc.iter_mut().enumerate() {
                let from = lanes(&bank[at + r * LANES..at + (r + 1) * LANES]);
                for l in 0..LANES {
                    a[l] += m * from[l];
                }
            }
        }
        for (chunk, a) in block.chunks_exact_mut(LANES).zip(acc) {
            let mut x: [f32; LANES] = lanes(chunk);
            for l in 0..LANES {
                x[l] += a[l];
            }
            chunk.copy_from_slice(&x);
        }
        c += 4 * LANES;
    }
    let mut chunks = blocks.into_remainder().chunks_exact_mut(LANES);
    for chunk in &mut chunks {
        let mut acc = [0f32; LANES];
        for (e, m) in mix.iter().enumerate() {
            let from = lanes(&bank[e * width + c..e * width + c + LANES]);
            for l in 0..LANES {
                acc[l] += m * from[l];
            }
        }
        let mut x: [f32; LANES] = lanes(chunk);
        for l in 0..LANES {
            x[l] += acc[l];
        }
        chunk.copy_from_slice(&x);
        c += LANES;
    }
    for (k, x) in chunks.into_remainder().iter_mut().enumerate() {
        *x += column(c + k);
    }
    if !right.is_empty() {
        let v = column(width - 1);
        right.iter_mut().for_each(|x| *x += v);
    }
}

/// The gradients of one row's logits `ds` (segments `s`) into the mix's `dmix` (R) and the
/// bank's `dbank` (`R × W`), as the module docs write them.
#[inline(always)]
pub(crate) fn add_mixed_grads(
    (bank, mix): (&[f32], &[f32]),
    ds: &[f32],
    s: RowSegments,
    (dbank, dmix): (&mut [f32], &mut [f32]),
) {
    let width = bank.len() / mix.len().max(1);
    let left: f32 = ds[..s.lo].iter().sum();
    let right: f32 = ds[s.hi..].iter().sum();
    let middle = &ds[s.lo..s.hi];
    let cols = s.first_col..s.first_col + middle.len();
    for (e, (m, dm)) in mix.iter().zip(dmix.iter_mut()).enumerate() {
        let (b, db) = (
            &bank[e * width..(e + 1) * width],
            &mut dbank[e * width..(e + 1) * width],
        );
        db[0] += m * left;
        db[width - 1] += m * right;
        // One pass over the keys for both, dmix's dot product and dbank's update, four
        // registers of keys at a time into four accumulators (independent chains).
        let mut acc = [[0f32; LANES]; 4];
        let (bm, dbm) = (&b[cols.clone()], &mut db[cols.clone()]);
        let mut g4 = middle.chunks_exact(4 * LANES);
        let mut b4 = bm.chunks_exact(4 * LANES);
        let mut d4 = dbm.chunks_exact_mut(4 * LANES);
        for ((g, y), d) in (&mut g4).zip(&mut b4).zip(&mut d4) {
            for (r, a) in acc.iter_mut().enumerate() {
                let at = r * LANES..(r + 1) * LANES;
                // Copies in registers: the stores cannot alias what the loads read.
                let (g, y) = (lanes(&g[at.clone()]), lanes(&y[at.clone()]));
                let mut dv: [f32; LANES] = lanes(&d[at.clone()]);
                for l in 0..LANES {
                    a[l] += g[l] * y[l];
                    dv[l] += m * g[l];
                }
                d[at].copy_from_slice(&dv);
            }
        }
        let mut acc: [f32; LANES] = std::array::from_fn(|l| acc.iter().map(|a| a[l]).sum());
        let mut g = g4.remainder().chunks_exact(LANES);
        let mut bc = b4.remainder().chunks_exact(LANES);
        let mut dc = d4.into_remainder().chunks_exact_mut(LANES);
        for ((g, y), d) in (&mut g).zip(&mut bc).zip(&mut dc) {
            let (g, y) = (lanes(g), lanes(y));
            let mut dv: [f32; LANES] = lanes(d);
            for l in 0..LANES {
                acc[l] += g[l] * y[l];
                dv[l] += m * g[l];
            }
            d.copy_from_slice(&dv);
        }
        let mut tail = 0f32;
        for ((g, y), d) in g
            .remainder()
            .iter()
            .zip(bc.remainder())
            .zip(dc.into_remainder())
        {
            tail += g * y;
            *d += m * g;
        }
        *dm += left * b[0] + right * b[width - 1] + acc.iter().sum::<f32>() + tail;
    }
}

/// The first [`LANES`] values of `x` as an array, in registers (the chunks above are exactly
/// that long; a shorter one would leave zeros).
#[inline(always)]
fn lanes(x: &[f32]) -> [f32; LANES] {
    let mut a = [0f32; LANES];
    a.iter_mut().zip(x).for_each(|(a, x)| *a = *x);
    a
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;
    use crate::plug::relative::row_segments_from;
    use crate::plug::{Columns, RelativeBias};

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect()
    }

    /// Rows added from the mix and the bank equal the built rows added as rows, for shifts
    /// that clamp on either side, key ranges inside a row and lengths around the lanes.
    #[test]
    fn mixed_rows_add_what_the_built_rows_hold() {
        let (r, width) = (5usize, 150usize);
        let bank = random(r * width, 1);
        let mix = random(r, 2);
        let values: Vec<f32> = (0..width)
            .map(|c| (0..r).map(|e| mix[e] * bank[e * width + c]).sum())
            .collect();
        for shift in [-200i64, -30, 0, 7, 90, 149, 400] {
            for (i, j0, n) in [
                (0, 0, 1),
                (3, 0, 17),
                (40, 5, 64),
                (100, 20, 131),
                (7, 0, 300),
            ] {
                let base = random(n, 3);
                let (mut got, mut want) = (base.clone(), base);
                let s = row_segments_from(i, shift, width, j0, n);
                add_mixed_row(&bank, &mix, s, &mut got);
                for (j, x) in want.iter_mut().enumerate() {
                    let c = ((j0 + j) as i64 - i as i64 + shift).clamp(0, width as i64 - 1);
                    *x += values[c as usize];
                }
                for (j, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-6,
                        "shift {shift} row {i} key {}: {g} vs {w}",
                        j0 + j
                    );
                }
            }
        }
    }

    /// The gradients of a row equal the adjoint written out key by key.
    #[test]
    fn mixed_grads_equal_the_adjoint() {
        let (r, width) = (3usize, 100usize);
        let bank = random(r * width, 4);
        let mix = random(r, 5);
        for shift in [-150i64, -10, 0, 33, 99, 250] {
            for (i, j0, n) in [(0, 0, 1), (5, 2, 19), (60, 0, 80), (90, 30, 150)] {
                let ds = random(n, 6);
                let (mut dbank, mut dmix) = (vec![0f32; r * width], vec![0f32; r]);
                let s = row_segments_from(i, shift, width, j0, n);
                add_mixed_grads((&bank, &mix), &ds, s, (&mut dbank, &mut dmix));
                let (mut wbank, mut wmix) = (vec![0f64; r * width], vec![0f64; r]);
                for (j, g) in ds.iter().enumerate() {
                    let c = ((j0 + j) as i64 - i as i64 + shift).clamp(0, width as i64 - 1);
                    for e in 0..r {
                        let at = e * width + c as usize;
                        wmix[e] += f64::from(*g) * f64::from(bank[at]);
                        wbank[at] += f64::from(mix[e]) * f64::from(*g);
                    }
                }
                for (g, w) in dmix.iter().zip(&wmix).chain(dbank.iter().zip(&wbank)) {
                    assert!((f64::from(*g) - w).abs() <= 1e-5, "shift {shift} row {i}");
                }
            }
        }
    }

    /// A tile's rows from one product equal each row's own, and the tile's gradients from two
    /// products equal the rows' own summed, for tiles that clamp on either side or not at all.
    #[test]
    fn tiles_equal_their_rows() {
        let (r, width) = (4usize, 70usize);
        let (tq, rows, n) = (40usize, 9usize, 23usize);
        let mut packed = random(r * width, 7);
        packed.extend(random(tq * r, 8));
        for shift in [-100i64, -20, 0, 15, 69, 140] {
            let layout = MixedLayout {
                rank: r,
                width,
                shift,
            };
            for (i0, j0) in [(0, 0), (5, 10), (30, 2), (31, 17)] {
                let cols = tile_columns(&layout, (i0, rows), (j0, n));
                assert!(cols.0 + cols.1 <= width);
                let mut slab = Vec::new();
                tile_values(&layout, &packed, (i0, rows), cols, &mut slab);
                let ds = random(rows * n, 9);
                let mut dslab = vec![0f32; rows * cols.1];
                let (mut want_grads, mut got_grads) =
                    (vec![0f32; packed.len()], vec![0f32; packed.len()]);
                for li in 0..rows {
                    let i = i0 + li;
                    let s = row_segments_from(i, shift, width, j0, n);
                    let base = random(n, 10 + li as u64);
                    let (mut got, mut want) = (base.clone(), base);
                    add_tile_row(&slab[li * cols.1..(li + 1) * cols.1], cols.0, s, &mut got);
                    let (bank, mix) = layout.split(&packed, i);
                    add_mixed_row(bank, mix, s, &mut want);
                    for (g, w) in got.iter().zip(&want) {
                        assert!(
                            (g - w).abs() <= 1e-5,
                            "shift {shift} tile ({i0}, {j0}) row {i}"
                        );
                    }
                    let dsrow = &ds[li * n..(li + 1) * n];
                    add_tile_row_grads(
                        dsrow,
                        cols.0,
                        s,
                        &mut dslab[li * cols.1..(li + 1) * cols.1],
                    );
                    let (dbank, dmixes) = want_grads.split_at_mut(r * width);
                    let dmix = &mut dmixes[i * r..(i + 1) * r];
                    add_mixed_grads((bank, mix), dsrow, s, (dbank, dmix));
                }
                add_tile_grads(&layout, &packed, (i0, rows), cols, &dslab, &mut got_grads);
                for (g, w) in got_grads.iter().zip(&want_grads) {
                    assert!(
                        (g - w).abs() <= 1e-5,
                        "shift {shift} tile ({i0}, {j0}): {g} vs {w}"
                    );
                }
            }
        }
    }

    /// A mix given as scaled per-token states packs, and passes its gradients back, as the
    /// same mix given as rows.
    #[test]
    fn states_pack_as_their_rows() -> crate::error::Result<()> {
        let dev = Device::Cpu;
        let (b, h, r, tq, w) = (2, 3, 4, 5, 7);
        let states = crate::seeded::var_randn(0f32, 1.0, (b, h * r, tq), &dev)?;
        let bank = crate::seeded::var_randn(0f32, 1.0, (r, w), &dev)?;
        let scale = vec![1.0f32, 1.5, 0.5, 2.0, 1.25];
        let channels = MixedRows::channels(
            states.as_tensor().clone(),
            h,
            bank.as_tensor().clone(),
            Some(scale.clone()),
        )?;
        let rows = MixedRows::new(channels.mix_rows()?, bank.as_tensor().clone())?;
        assert_eq!(channels.dims(), rows.dims());
        let (a, z) = (channels.packed(tq)?, rows.packed(tq)?);
        let diff = (&a - &z)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff == 0.0, "packed: {diff}");
        let probe = crate::seeded::randn(0f32, 1.0, a.shape(), &dev)?;
        let ga = (&a * &probe)?.sum_all()?.backward()?;
        let gz = (&z * &probe)?.sum_all()?.backward()?;
        for var in [&states, &bank] {
            let (x, y) = (
                ga.get(var).expect("a gradient"),
                gz.get(var).expect("a gradient"),
            );
            let diff = (x - y)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff <= 1e-6, "gradient: {diff}");
        }
        assert!(MixedRows::channels(
            states.as_tensor().clone(),
            2,
            bank.as_tensor().clone(),
            None
        )
        .is_err());
        Ok(())
    }

    /// A bias of mixed rows expands as the rows it stands for, and bad operands are refused
    /// with typed errors.
    #[test]
    fn mixed_bias_expands_as_its_rows_and_checks_operands() -> crate::error::Result<()> {
        let dev = Device::Cpu;
        let mix = crate::seeded::randn(0f32, 1.0, (2, 3, 4, 5), &dev)?;
        let bank = crate::seeded::randn(0f32, 1.0, (5, 9), &dev)?;
        let mixed = RelativeBias::mixed(mix.clone(), bank.clone(), Columns::Shift(4))?;
        assert_eq!(mixed.dims(), (2, 3, 4, 9));
        let rows = RelativeBias::new(
            crate::matmul::broadcast_matmul(&mix, &bank)?,
            Columns::Shift(4),
        )?;
        let diff = (mixed.to_dense(4, 6)? - rows.to_dense(4, 6)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert!(diff <= 1e-6, "{diff}");
        let wrong_rank = Tensor::zeros((6, 9), DType::F32, &dev)?;
        assert!(matches!(
            RelativeBias::mixed(mix.clone(), wrong_rank, Columns::Shift(0)),
            Err(Error::Shape { .. })
        ));
        let f64_bank = bank.to_dtype(DType::F64)?;
        assert!(matches!(
            RelativeBias::mixed(mix.clone(), f64_bank, Columns::Shift(0)),
            Err(Error::DType { .. })
        ));
        assert!(matches!(
            RelativeBias::mixed(bank.clone(), bank, Columns::Shift(0)),
            Err(Error::Rank { .. })
        ));
        Ok(())
    }
}
