//! Relative terms as data: rows of values per column, and the rule by which each (query, key)
//! pair picks its column.
//!
//! ```text
//! bias[b, h, i, j]  = values[b, h, r(i), c(i, j)]          values: (1|B, 1|H, 1|Tq, W), r(i) = 0 or i
//! out[b, h, i, :]  += Σ_j α[b, h, i, j] · table[c(i, j), :]   table: (W, D)
//!
//! Columns::Shift(s):   c(i, j) = clamp(j − i + s, 0, W − 1)    (offset positions: a Toeplitz map)
//! Columns::Index(m):   c(i, j) = min(m[b, i, j], W − 1)        (any positions; m: (1|B, Tq, Tk) u32)
//! ```
//!
//! With offset positions every relative encoding has the shift form: T5 and the clipped bias
//! give one row per head over the `Tq + Tk − 1` distances of a block, Shaw's keys one row of
//! `2k + 1` products `q_i · a^K[r]` per query, the clamp doing the clipping. Any `i64` shift
//! and any index value is valid: both clamp as written above, so no value of a form can make
//! the block read outside its rows. The column sums of the value term are the adjoint of the
//! expansion: `Σ_j α_ij table[c(i, j)] = Σ_c (Σ_{j: c(i,j) = c} α_ij) table[c]`.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use rayon::prelude::*;

use super::mixed::MixedRows;
use crate::error::{Error, Result};
use crate::graft::{graft, GraftBackward};
use crate::limits::check_elements;
use crate::matmul::broadcast_matmul;

/// How each (query, key) pair picks its column of a relative term; see the module docs.
#[derive(Debug, Clone)]
pub enum Columns {
    /// `c(i, j) = clamp(j − i + shift, 0, W − 1)`: any shift is valid.
    Shift(i64),
    /// `c(i, j) = min(index[b, i, j], W − 1)`: a `(1|B, Tq, Tk)` `u32` map, for positions given
    /// as explicit ids.
    Index(Tensor),
}

impl Columns {
    /// Checks the form of an index map (rank 3, `u32`).
    fn check(&self) -> Result<()> {
        if let Columns::Index(index) = self {
            if index.rank() != 3 {
                return Err(Error::Rank {
                    what: "relative column index",
                    expected: 3,
                    got: index.rank(),
                    shape: index.dims().to_vec(),
                });
            }
            if index.dtype() != DType::U32 {
                return Err(Error::DType {
                    what: "relative column index",
                    expected: "u32",
                    got: index.dtype(),
                });
            }
        }
        Ok(())
    }

    /// Checks an index map against a block of `batch` sequences, `tq` queries and `tk` keys.
    fn check_block(&self, what: &'static str, batch: usize, tq: usize, tk: usize) -> Result<()> {
        if let Columns::Index(index) = self {
            let (b, q, k) = index.dims3()?;
            if (b != 1 && b != batch) || q != tq || k != tk {
                return Err(Error::shape(
                    what,
                    format!(
                        "a column index of (1 or {batch}, {tq}, {tk}) = (batch, queries, keys)"
                    ),
                    index.shape(),
                ));
            }
        }
        Ok(())
    }

    /// The column map as a `(1|B, Tq, Tk)` `u32` tensor with every entry below `width`, on
    /// `device` (built on the host for a shift).
    fn index(
        &self,
        tq: usize,
        tk: usize,
        width: usize,
        device: &candle_core::Device,
    ) -> Result<Tensor> {
        match self {
            Columns::Shift(shift) => {
                check_elements(
                    "queries × keys",
                    format_args!("{tq} × {tk}"),
                    "the column map",
                    &[tq, tk],
                )?;
                if tq == 0 || tk == 0 {
                    return Ok(Tensor::zeros((1, tq, tk), DType::U32, device)?);
                }
                let mut index = Vec::with_capacity(tq * tk);
                for i in 0..tq {
                    let s = row_segments(i, *shift, width, tk);
                    index.extend(std::iter::repeat_n(0u32, s.lo));
                    index.extend((s.first_col..s.first_col + (s.hi - s.lo)).map(|c| c as u32));
                    let last = (width - 1).min(u32::MAX as usize) as u32;
                    index.extend(std::iter::repeat_n(last, tk - s.hi));
                }
                Ok(Tensor::from_vec(index, (1, tq, tk), device)?)
            }
            Columns::Index(index) => Ok(index
                .to_device(device)?
                .minimum((width - 1).min(u32::MAX as usize) as u32)?),
        }
    }
}

/// Where query row `i`'s columns stop being clamped: keys `j < lo` read column 0, keys
/// `lo ≤ j < hi` read `first_col + (j − lo)`, keys `j ≥ hi` read column `W − 1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RowSegments {
    pub(crate) lo: usize,
    pub(crate) hi: usize,
    pub(crate) first_col: usize,
}

/// The [`RowSegments`] of row `i` for `Columns::Shift(shift)`, `width` columns and `tk` keys,
/// exact for every `i64` shift (the arithmetic runs in `i128`).
pub(crate) fn row_segments(i: usize, shift: i64, width: usize, tk: usize) -> RowSegments {
    row_segments_from(i, shift, width, 0, tk)
}

/// The [`RowSegments`] of keys `j0..j0 + n` of row `i` (positions counted from `j0`): the same
/// columns as [`row_segments`] gives those keys of the whole row.
pub(crate) fn row_segments_from(
    i: usize,
    shift: i64,
    width: usize,
    j0: usize,
    n: usize,
) -> RowSegments {
    // Key j0 + j reads column j − first before clamping.
    let first = i as i128 - shift as i128 - j0 as i128;
    let lo = first.clamp(0, n as i128) as usize;
    let hi = (first + width as i128).clamp(0, n as i128) as usize;
    // When lo < hi, first ≤ lo < first + width, so the column lies in 0..width.
    let first_col = if lo < hi {
        (lo as i128 - first) as usize
    } else {
        0
    };
    RowSegments { lo, hi, first_col }
}

/// A relative logits bias given by rows of values per column; see the module docs.
///
/// Built through [`RelativeBias::new`], which checks the values; the block checks them against
/// each query block before anything reads them.
///
/// # Shapes
/// `values`: `(1|B, 1|H, 1|Tq, W)`; the bias it stands for is `(1|B, 1|H, Tq, Tk)`.
#[derive(Debug, Clone)]
pub struct RelativeBias {
    values: Rows,
    columns: Columns,
}

/// How a [`RelativeBias`] holds its rows.
#[derive(Debug, Clone)]
enum Rows {
    /// `(1|B, 1|H, 1|Tq, W)`.
    Values(Tensor),
    /// `mix · bank`: the fused CPU passes never build the product (see [`super::mixed`]).
    Mixed(MixedRows),
}

impl RelativeBias {
    /// Rows `values` read at `columns`.
    ///
    /// # Errors
    /// [`Error::Rank`] unless `values` is 4-D; [`Error::Shape`] for an empty last axis or one
    /// of 2^32 columns or more;
    /// [`Error::DType`] for integer values; for an index map, [`Error::Rank`] unless it is 3-D
    /// and [`Error::DType`] unless it is `u32`.
    pub fn new(values: Tensor, columns: Columns) -> Result<Self> {
        let (_, _, _, width) = values.dims4().map_err(|_| Error::Rank {
            what: "relative bias values",
            expected: 4,
            got: values.rank(),
            shape: values.dims().to_vec(),
        })?;
        // Columns are read through u32 indices.
        if width == 0 || width > u32::MAX as usize {
            return Err(Error::shape(
                "relative bias values",
                "(batch, heads, rows, width) with 1 ≤ width ≤ 2^32 − 1 (columns are u32 indices)",
                values.shape(),
            ));
        }
        check_float("relative bias values", &values)?;
        columns.check()?;
        Ok(Self {
            values: Rows::Values(values),
            columns,
        })
    }

    /// Rows given as a mix of a shared bank, `values = mix · bank`, read at `columns`: the
    /// fused CPU passes compute each row's columns as they read them, so the `(B, H, Tq, W)`
    /// rows exist only where another path asks for [`Self::values`].
    ///
    /// # Shapes
    /// `mix`: `(1|B, 1|H, 1|Tq, R)`; `bank`: `(R, W)`.
    ///
    /// # Errors
    /// [`Error::Rank`] unless the mix is 4-D and the bank 2-D; [`Error::Shape`] for `R = 0`,
    /// mixes and banks of different `R`, or `W` outside `1..2^32`; [`Error::DType`] for integer
    /// tensors or two dtypes; [`Error::Device`] for two devices; for an index map, as
    /// [`Self::new`].
    pub fn mixed(mix: Tensor, bank: Tensor, columns: Columns) -> Result<Self> {
        let rows = MixedRows::new(mix, bank)?;
        columns.check()?;
        Ok(Self {
            values: Rows::Mixed(rows),
            columns,
        })
    }

    /// The rows, `(1|B, 1|H, 1|Tq, W)`: the product `mix · bank` for mixed rows (computed here,
    /// in the mix's dtype, with gradients to both).
    ///
    /// # Errors
    /// For mixed rows, [`Error::InvalidConfig`] if the product would pass
    /// [`crate::limits::max_elements`].
    pub fn values(&self) -> Result<Tensor> {
        match &self.values {
            Rows::Values(t) => Ok(t.clone()),
            Rows::Mixed(m) => m.product(),
        }
    }

    /// Rows given as each query's mix `(1|B, H, Tq, R)` of per-token states `(1|B, H·R, Tq)`
    /// (head `h`'s weights at channels `h·R..(h + 1)·R`, as a content hook answers them),
    /// query `i`'s times `scale[i]` when given, and a bank `(R, W)`: the fused CPU passes read
    /// the states where they lie, with no graph node between them and the pass.
    ///
    /// # Errors
    /// As [`Self::mixed`]; [`Error::Shape`] for channels that are not `heads × R` or factors
    /// that are not one per query.
    pub(crate) fn mixed_states(
        states: Tensor,
        heads: usize,
        bank: Tensor,
        scale: Option<Vec<f32>>,
        columns: Columns,
    ) -> Result<Self> {
        let rows = MixedRows::channels(states, heads, bank, scale)?;
        columns.check()?;
        Ok(Self {
            values: Rows::Mixed(rows),
            columns,
        })
    }

    /// The mix `(1|B, 1|H, 1|Tq, R)` and the bank `(R, W)`, for mixed rows.
    ///
    /// # Errors
    /// Candle's, viewing or scaling a mix given as per-token states.
    pub fn mix_and_bank(&self) -> Result<Option<(Tensor, Tensor)>> {
        match &self.values {
            Rows::Values(_) => Ok(None),
            Rows::Mixed(m) => Ok(Some((m.mix_rows()?, m.bank().clone()))),
        }
    }

    /// The rows' axes, `(1|B, 1|H, 1|Tq, W)`.
    pub fn dims(&self) -> (usize, usize, usize, usize) {
        match &self.values {
            Rows::Values(t) => {
                let d = t.dims();
                (d[0], d[1], d[2], d[3])
            }
            Rows::Mixed(m) => m.dims(),
        }
    }

    /// The rows' device.
    pub fn device(&self) -> &candle_core::Device {
        match &self.values {
            Rows::Values(t) => t.device(),
            Rows::Mixed(m) => m.mix().device(),
        }
    }

    /// Whether the rows (or their mix or bank) track gradients.
    pub fn track_op(&self) -> bool {
        match &self.values {
            Rows::Values(t) => t.track_op(),
            Rows::Mixed(m) => m.mix().track_op() || m.bank().track_op(),
        }
    }

    /// The same bias with each of its tensors through `f` (a cast), the form kept.
    pub(crate) fn map(&self, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        match &self.values {
            Rows::Values(t) => Self::new(f(t)?, self.columns.clone()),
            Rows::Mixed(m) => Ok(Self {
                values: Rows::Mixed(m.map(f)?),
                columns: self.columns.clone(),
            }),
        }
    }

    /// The mixed form, for the fused passes.
    pub(crate) fn mixed_rows(&self) -> Option<&MixedRows> {
        match &self.values {
            Rows::Values(_) => None,
            Rows::Mixed(m) => Some(m),
        }
    }

    /// How each pair picks its column.
    pub fn columns(&self) -> &Columns {
        &self.columns
    }

    /// Columns per row, `W`.
    pub fn width(&self) -> usize {
        self.dims().3
    }

    /// Checks the rows against a query block of `(B, H, Tq, Tk)` logits.
    ///
    /// # Errors
    /// [`Error::Shape`] naming the expected shape.
    pub(crate) fn check_block(&self, (b, h, tq, tk): (usize, usize, usize, usize)) -> Result<()> {
        let (vb, vh, rows, width) = self.dims();
        if (vb != 1 && vb != b) || (vh != 1 && vh != h) || (rows != 1 && rows != tq) {
            return Err(Error::shape(
                "relative bias values",
                format!("(1 or {b}, 1 or {h}, 1 or {tq}, width) = (batch, heads, rows, width)"),
                &Shape::from((vb, vh, rows, width)),
            ));
        }
        self.columns
            .check_block("relative bias", if vb == 1 { b } else { vb }, tq, tk)
    }

    /// The bias for `tq` queries and `tk` keys as a dense `(1|B, 1|H, Tq, Tk)` tensor;
    /// gradients flow to the values.
    ///
    /// # Errors
    /// [`Error::Shape`] if the rows or the index map do not fit `tq` and `tk`;
    /// [`Error::InvalidConfig`] if the result would pass [`crate::limits::max_elements`].
    pub fn to_dense(&self, tq: usize, tk: usize) -> Result<Tensor> {
        let (vb, vh, rows, width) = self.dims();
        let batch = match &self.columns {
            Columns::Index(index) => index.dim(0)?.max(vb),
            Columns::Shift(_) => vb,
        };
        self.check_block((batch, vh, tq, tk))?;
        check_elements(
            "queries × keys",
            format_args!("{tq} × {tk}"),
            "batch × heads × queries × keys of a dense relative bias",
            &[batch, vh, tq, tk],
        )?;
        let index = self.columns.index(tq, tk, width, self.device())?; // (1|B, Tq, Tk)
        let values = self.values()?;
        if rows == 1 && matches!(self.columns, Columns::Shift(_)) {
            return Ok(values
                .reshape((vb, vh, width))?
                .index_select(&index.flatten_all()?, 2)?
                .reshape((vb, vh, tq, tk))?);
        }
        if batch * vh * tq * tk == 0 {
            return Ok(Tensor::zeros(
                (batch, vh, tq, tk),
                values.dtype(),
                values.device(),
            )?);
        }
        // One flat index into the rows per entry, `((b·H + h)·rows + i)·W + c(i, j)` (b and i
        // 0 where the rows are shared), so nothing wider than the bias itself is built however
        // wide the table is.
        check_elements(
            "relative bias rows",
            format_args!("({vb}, {vh}, {rows}, {width})"),
            "the relative rows as one flat table",
            &[vb, vh, rows, width],
        )?;
        let device = values.device();
        let offsets = |n: usize, used: bool, stride: usize, at: usize| -> Result<Tensor> {
            let mut dims = [1usize; 4];
            dims[at] = n;
            let t = match used && n > 1 {
                true => Tensor::arange(0i64, n as i64, device)?
                    .broadcast_mul(&Tensor::new(stride as i64, device)?)?,
                false => Tensor::zeros(n, DType::I64, device)?,
            };
            Ok(t.reshape(dims.as_slice())?)
        };
        let flat = offsets(batch, vb == batch, vh * rows * width, 0)?
            .broadcast_add(&offsets(vh, true, rows * width, 1)?)?
            .broadcast_add(&offsets(tq, rows == tq, width, 2)?)?
            .broadcast_add(&index.to_dtype(DType::I64)?.unsqueeze(1)?)?;
        Ok(values
            .flatten_all()?
            .index_select(&flat.flatten_all()?, 0)?
            .reshape((batch, vh, tq, tk))?)
    }
}

/// A relative value term given by one table row per column:
/// `out[b, h, i, :] += Σ_j α[b, h, i, j] · table[c(i, j), :]`; see the module docs.
///
/// # Shapes
/// `table`: `(W, D)`, shared by every batch item and head.
#[derive(Debug, Clone)]
pub struct RelativeValues {
    table: Tensor,
    columns: Columns,
}

impl RelativeValues {
    /// Table rows read at `columns`.
    ///
    /// # Errors
    /// [`Error::Rank`] unless `table` is 2-D; [`Error::Shape`] for an empty table or one of
    /// 2^32 rows or more;
    /// [`Error::DType`] for an integer table; the index map's errors as in [`RelativeBias::new`].
    pub fn new(table: Tensor, columns: Columns) -> Result<Self> {
        let (width, d) = table.dims2().map_err(|_| Error::Rank {
            what: "relative value table",
            expected: 2,
            got: table.rank(),
            shape: table.dims().to_vec(),
        })?;
        if width == 0 || d == 0 || width > u32::MAX as usize {
            return Err(Error::shape(
                "relative value table",
                "(1 ≤ width ≤ 2^32 − 1, head_dim ≥ 1): columns are u32 indices",
                table.shape(),
            ));
        }
        check_float("relative value table", &table)?;
        columns.check()?;
        Ok(Self { table, columns })
    }

    /// The table, `(W, D)`.
    pub fn table(&self) -> &Tensor {
        &self.table
    }

    /// How each pair picks its row of the table.
    pub fn columns(&self) -> &Columns {
        &self.columns
    }

    /// Rows of the table, `W`.
    pub fn width(&self) -> usize {
        self.table.dims()[0]
    }

    /// Checks the term against a query block of `batch` sequences, `tq` queries, `tk` keys and
    /// head width `d`.
    ///
    /// # Errors
    /// [`Error::Shape`] naming the expected shape.
    pub(crate) fn check_block(&self, batch: usize, tq: usize, tk: usize, d: usize) -> Result<()> {
        if self.table.dims()[1] != d {
            return Err(Error::shape(
                "relative value table",
                format!("(width, {d}) to match the attention's head_dim"),
                self.table.shape(),
            ));
        }
        self.columns
            .check_block("relative value term", batch, tq, tk)
    }

    /// The term for attention weights `probs`: `Σ_j α_ij table[c(i, j)]`, computed in f32 (f64
    /// if either is f64) and returned in the weights' dtype. Gradients flow to `probs` and to
    /// the table.
    ///
    /// # Shapes
    /// `probs`: `(B, H, Tq, Tk)` → `(B, H, Tq, D)`.
    ///
    /// # Errors
    /// [`Error::Rank`] / [`Error::Shape`] for weights or an index map that do not fit;
    /// [`Error::DType`] for integer weights.
    pub fn weighted_sum(&self, probs: &Tensor) -> Result<Tensor> {
        let (b, _, tq, tk) = probs.dims4().map_err(|_| Error::Rank {
            what: "attention weights",
            expected: 4,
            got: probs.rank(),
            shape: probs.dims().to_vec(),
        })?;
        check_float("attention weights", probs)?;
        let d = self.table.dims()[1];
        self.check_block(b, tq, tk, d)?;
        let h = probs.dim(1)?;
        // The output, and the table as the product reads it (a broadcast view becomes real),
        // budgeted before they exist.
        check_elements(
            "relative value table features",
            d,
            format_args!(
                "batch ({b}) × heads ({h}) × queries ({tq}) × features ({d}) of the weighted sum"
            ),
            &[b, h, tq, d],
        )?;
        check_elements(
            "relative value table features",
            d,
            format_args!("table rows ({}) × features ({d})", self.width()),
            &[self.width(), d],
        )?;
        let sums = column_sums(probs, &self.columns, self.width())?;
        // The product in f32 at least, whatever the two dtypes (bf16 and f16 do not hold
        // each other's range: a bf16 table read in f16 could turn a zero weight's term into
        // 0 · ∞ = NaN), rounded once to the weights' dtype.
        let compute = product_dtype(probs.dtype(), self.table.dtype());
        let out = broadcast_matmul(&sums.to_dtype(compute)?, &self.table.to_dtype(compute)?)?;
        Ok(out.to_dtype(probs.dtype())?)
    }
}

/// The dtype a product of `a` and `b` values runs in: f64 if either is, else f32 (the half
/// formats do not hold each other's range, and their products accumulate in f32).
pub(crate) fn product_dtype(a: DType, b: DType) -> DType {
    match (a, b) {
        (DType::F64, _) | (_, DType::F64) => DType::F64,
        _ => DType::F32,
    }
}

fn check_float(what: &'static str, t: &Tensor) -> Result<()> {
    crate::error::check_float(what, t.dtype())
}

/// Per query, the weights summed per column: `out[b, h, i, c] = Σ_{j: c(i,j) = c}
/// probs[b, h, i, j]`, `(B, H, Tq, Tk)` → `(B, H, Tq, width)`, differentiable.
///
/// On the CPU in f32 one pass over the weights with no index tensor; elsewhere a scatter-add
/// at the expanded column map. Either way the result is grafted onto `probs` with the
/// expansion as its adjoint (candle 0.11's scatter-add backward breaks when the index is wider
/// than the target).
fn column_sums(probs: &Tensor, columns: &Columns, width: usize) -> Result<Tensor> {
    let (b, h, tq, tk) = probs.dims4()?;
    // The sums hold a row of the table's width per query: budgeted before they exist.
    check_elements(
        "relative value table width",
        width,
        format_args!("batch ({b}) × heads ({h}) × queries ({tq}) × table width ({width}) of the per-column weight sums"),
        &[b, h, tq, width],
    )?;
    let plain = probs.detach();
    let cpu = plain.device().is_cpu() && plain.dtype() == DType::F32;
    if !cpu || !plain.is_contiguous() {
        // The weights made contiguous (a broadcast view becomes real), and elsewhere the
        // column map expanded to them: budgeted before they exist.
        check_elements(
            "attention weights",
            format_args!("{:?}", plain.dims()),
            "batch × heads × queries × keys of the weights as the column sums read them",
            &[b, h, tq, tk],
        )?;
    }
    let sums = if cpu {
        let index = match columns {
            Columns::Index(index) => Some(index.to_device(plain.device())?.contiguous()?),
            Columns::Shift(_) => None,
        };
        let shift = match columns {
            Columns::Shift(s) => *s,
            Columns::Index(_) => 0,
        };
        plain.contiguous()?.apply_op1_no_bwd(&ColumnSums {
            width,
            shift,
            index,
        })?
    } else {
        let index = columns
            .index(tq, tk, width, plain.device())?
            .unsqueeze(1)?
            .broadcast_as((b, h, tq, tk))?
            .contiguous()?;
        Tensor::zeros((b, h, tq, width), plain.dtype(), plain.device())?.scatter_add(
            &index,
            &plain.contiguous()?,
            3,
        )?
    };
    if !probs.track_op() {
        return Ok(sums);
    }
    graft(
        probs,
        &sums,
        ExpandAt {
            columns: columns.clone(),
            tq,
            tk,
        },
    )
}

/// The adjoint of the column sums: each weight's gradient is its column's.
struct ExpandAt {
    columns: Columns,
    tq: usize,
    tk: usize,
}

impl GraftBackward for ExpandAt {
    const NAME: &'static str = "posenc-relative-column-sums-grad";

    fn grad(&self, grad_sums: &Tensor) -> candle_core::Result<Tensor> {
        RelativeBias::new(grad_sums.clone(), self.columns.clone())
            .and_then(|rows| rows.to_dense(self.tq, self.tk))
            .map_err(|e| candle_core::Error::Msg(e.to_string()))
    }
}

/// Adds query row `i`'s weights (keys `0..row.len()`) into `sums` per column
/// `clamp(j − i + shift, 0, sums.len() − 1)`.
pub(crate) fn add_shifted_sums(row: &[f32], i: usize, shift: i64, sums: &mut [f32]) {
    add_shifted_sums_from(row, i, shift, 0, sums)
}

/// [`add_shifted_sums`] for `row` holding the weights of keys `j0..j0 + row.len()` of row `i`.
/// Inlined, so that a caller compiled for wider vectors sums with them.
#[inline(always)]
pub(crate) fn add_shifted_sums_from(
    row: &[f32],
    i: usize,
    shift: i64,
    j0: usize,
    sums: &mut [f32],
) {
    let width = sums.len();
    let s = row_segments_from(i, shift, width, j0, row.len());
    sums[0] += lane_sum(&row[..s.lo]);
    for (c, p) in sums[s.first_col..s.first_col + (s.hi - s.lo)]
        .iter_mut()
        .zip(&row[s.lo..s.hi])
    {
        *c += p;
    }
    sums[width - 1] += lane_sum(&row[s.hi..]);
}

/// The sum of `x` over 16 independent accumulators, which the compiler keeps in vector
/// registers: a long row's clamped keys are summed at the loads' speed instead of one
/// dependent addition at a time.
#[inline(always)]
fn lane_sum(x: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let chunks = x.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    acc.iter().chain(tail).sum()
}

/// Adds a row's weights into `sums` at the columns `index` gives (clamped to the last one);
/// `index` holds at least `row.len()` entries.
pub(crate) fn add_indexed_sums(row: &[f32], index: &[u32], sums: &mut [f32]) {
    let last = sums.len() - 1;
    for (p, &c) in row.iter().zip(index) {
        sums[(c as usize).min(last)] += p;
    }
}

/// The CPU pass of [`column_sums`]: contiguous f32 weights in, `(B, H, Tq, width)` out.
struct ColumnSums {
    width: usize,
    shift: i64,
    /// A contiguous `(1|B, Tq, Tk)` u32 index map, or `None` for the shift.
    index: Option<Tensor>,
}

impl CustomOp1 for ColumnSums {
    fn name(&self) -> &'static str {
        "posenc-relative-column-sums"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (b, h, tq, tk) = layout.shape().dims4()?;
        let (CpuStorage::F32(data), Some((start, end))) = (storage, layout.contiguous_offsets())
        else {
            candle_core::bail!("relative column sums: weights must be contiguous f32");
        };
        let probs = &data[start..end];
        let width = self.width;
        if width == 0 {
            candle_core::bail!("relative column sums: width must be at least 1");
        }
        let guard = self.index.as_ref().map(|t| t.storage_and_layout());
        let index = match &guard {
            None => None,
            Some((g, l)) => match (&**g, l.contiguous_offsets()) {
                (candle_core::Storage::Cpu(CpuStorage::U32(v)), Some((a, z))) => {
                    let bi = l.dims()[0];
                    if l.dims() != [bi, tq, tk] || (bi != 1 && bi != b) {
                        candle_core::bail!("relative column sums: the index must be (1|B, Tq, Tk)");
                    }
                    Some((&v[a..z], bi))
                }
                _ => candle_core::bail!("relative column sums: the index must be contiguous u32"),
            },
        };
        let Some(len) = [b, h, tq, width]
            .iter()
            .try_fold(1usize, |acc, &n| acc.checked_mul(n))
        else {
            candle_core::bail!("relative column sums: (B, H, Tq, width) overflows usize");
        };
        let mut out = vec![0f32; len];
        out.par_chunks_mut(width).enumerate().for_each(|(r, sums)| {
            let row = &probs[r * tk..(r + 1) * tk];
            let i = r % tq;
            match index {
                None => add_shifted_sums(row, i, self.shift, sums),
                Some((index, bi)) => {
                    let batch = if bi == 1 { 0 } else { r / (h * tq) };
                    let at = (batch * tq + i) * tk;
                    add_indexed_sums(row, &index[at..at + tk], sums);
                }
            }
        });
        Ok((CpuStorage::F32(out), Shape::from((b, h, tq, width))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The segments against the definition, for shifts far outside the window included.
    /// Weights and a table in dtypes that do not hold each other's range (f16 weights, a bf16
    /// table past f16's): a zero weight's term stays 0 (not 0 · ∞ = NaN, as reading the table
    /// in f16 would give), and a real one is the product rounded once.
    #[test]
    fn mixed_half_dtypes_multiply_in_f32() -> crate::error::Result<()> {
        let dev = candle_core::Device::Cpu;
        let table = Tensor::new(&[[1e10f32, 2.0], [3.0, 4.0]], &dev)?.to_dtype(DType::BF16)?;
        let values = RelativeValues::new(table, Columns::Shift(0))?;
        // One query, two keys: key 0 reads row 0 (weight 0), key 1 row 1 (weight 0.5).
        let probs = Tensor::new(&[0f32, 0.5], &dev)?
            .reshape((1, 1, 1, 2))?
            .to_dtype(DType::F16)?;
        let got = values.weighted_sum(&probs)?;
        assert_eq!(got.dtype(), DType::F16);
        let got = got.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(got, vec![1.5, 2.0]);
        Ok(())
    }

    #[test]
    fn segments_match_the_clamp_for_every_shift() {
        let (width, tk) = (5usize, 9usize);
        for shift in [
            i64::MIN,
            i64::MIN + 1,
            -100,
            -7,
            -1,
            0,
            3,
            11,
            100,
            i64::MAX,
        ] {
            for i in [0usize, 1, 4, 8, usize::MAX] {
                let s = row_segments(i, shift, width, tk);
                for j in 0..tk {
                    let want = (j as i128 - i as i128 + shift as i128).clamp(0, width as i128 - 1);
                    let got = if j < s.lo {
                        0
                    } else if j < s.hi {
                        (s.first_col + (j - s.lo)) as i128
                    } else {
                        width as i128 - 1
                    };
                    assert_eq!(got, want, "shift {shift} row {i} key {j}");
                }
            }
        }
    }
}
