//! Matrix products on the CPU in f32 through `gemm`, on raw strided views: the fused cores'
//! tiles and the one-node projections read and write their operands in place.

use rayon::prelude::*;

/// `dst (m × n) = lhs (m × k) · rhs (k × n)`, or `+=` with `accumulate`, on this thread. `dst`
/// is `(pointer, row stride, accumulate)` with unit column stride; `lhs` and `rhs` are
/// `(pointer, column stride, row stride)`; strides in elements.
///
/// # Safety
/// Every element the dimensions and strides reach must be valid (and `dst`'s writable by this
/// thread alone).
pub(crate) unsafe fn product(
    dims: (usize, usize, usize),
    dst: (*mut f32, usize, bool),
    lhs: (*const f32, usize, usize),
    rhs: (*const f32, usize, usize),
) {
    // SAFETY: the caller's contract.
    unsafe { product_on(gemm::Parallelism::None, dims, dst, lhs, rhs, 1.0) }
}

/// `scale ·` [`product`] on rayon's threads when it is large enough to share (2^17 multiply-adds or more;
/// a decoding step's projection of one token is 2^18), else on this thread. Not for use inside
/// a rayon task that holds the per-thread buffers.
///
/// # Safety
/// As [`product`].
pub(crate) unsafe fn product_parallel(
    dims: (usize, usize, usize),
    dst: (*mut f32, usize, bool),
    lhs: (*const f32, usize, usize),
    rhs: (*const f32, usize, usize),
    scale: f32,
) {
    let (m, n, k) = dims;
    let parallelism = match m.saturating_mul(n).saturating_mul(k) >= 1 << 17 {
        true => gemm::Parallelism::Rayon(rayon::current_num_threads()),
        false => gemm::Parallelism::None,
    };
    // SAFETY: the caller's contract.
    unsafe { product_on(parallelism, dims, dst, lhs, rhs, scale) }
}

/// Rows up to which [`linear`] runs as [`few_rows`] (the output's columns `W · xᵀ`, one task per
/// run of features); for more rows, `gemm`'s own split of `x Wᵀ` among threads. On SmolLM2's
/// layer, few_rows made calls of 96 and 128 tokens 21–30% faster than `gemm`'s split, the same
/// at 200 to 256, and slower from 300 on.
pub(crate) const FEW_ROWS: usize = 256;

/// Output features per task of [`few_rows`]. From 64 on, `gemm` packs its right operand (x's
/// columns) for every task (past two 32-row panels of the left one); fewer cost more calls.
/// SmolLM2's layer (576 and 192 features, 30 rows) was fastest at 48 of 32, 48, 64 and 96.
const FEATURES: usize = 48;

/// Where a linear product's value for row `r` and output feature `j` goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Place {
    /// `(rows, out)`, row-major.
    Rows,
    /// Heads first, `(B, H, T, D)` for rows `b·T + t` and features `h·D + e`.
    Heads { len: usize, heads: usize, d: usize },
}

impl Place {
    /// Where row `r` starts: the index of its feature 0.
    fn row(self, r: usize, out: usize) -> usize {
        match self {
            Place::Rows => r * out,
            Place::Heads { len, heads, d } => ((r / len) * heads * len + r % len) * d,
        }
    }

    /// How far feature `j` lies from its row's feature 0.
    fn feature(self, j: usize) -> usize {
        match self {
            Place::Rows => j,
            Place::Heads { len, d, .. } => (j / d) * len * d + j % d,
        }
    }

    /// The index of row `r`, feature `j` of `out`. Non-decreasing in `r` and in `j`, and
    /// one-to-one: the last row's last feature has the largest index.
    fn index(self, r: usize, j: usize, out: usize) -> usize {
        self.row(r, out) + self.feature(j)
    }

    /// Whether `rows × out` fits this arrangement.
    fn fits(self, rows: usize, out: usize) -> bool {
        match self {
            Place::Rows => true,
            Place::Heads { len, heads, d } => {
                len > 0 && rows.is_multiple_of(len) && heads * d == out
            }
        }
    }
}

/// `y (rows × out) = scale · (x (rows × in) · Wᵀ + b)`, W `(out, in)`, all row-major, on rayon's threads
/// when large enough ([`product_parallel`]): the one linear product of both projection paths.
/// Few rows are computed by [`few_rows`].
///
/// # Panics
/// If a slice is shorter than its dimensions say (callers size them from the same numbers).
pub(crate) fn linear(
    y: &mut [f32],
    (x, w, bias): (&[f32], &[f32], Option<&[f32]>),
    (rows, out, inner): (usize, usize, usize),
    scale: f32,
) -> candle_core::Result<()> {
    assert!(y.len() >= rows * out && x.len() >= rows * inner && w.len() >= out * inner);
    assert!(bias.is_none_or(|b| b.len() >= out));
    if rows == 0 || out == 0 {
        return Ok(());
    }
    if rows <= FEW_ROWS && inner > 0 {
        let product = Product {
            y,
            w,
            bias,
            out,
            scale,
            place: Place::Rows,
        };
        return few_rows(x, (rows, inner), &mut [product]);
    }
    match bias {
        Some(b) => y.chunks_exact_mut(out).take(rows).for_each(|row| {
            row.iter_mut().zip(b).for_each(|(y, &b)| *y = scale * b);
        }),
        // No products: zeros.
        None if inner == 0 => y[..rows * out].fill(0.0),
        None => {}
    }
    if inner > 0 {
        // SAFETY: x holds rows × in values, W out × in, y rows × out (asserted above); `Wᵀ`
        // is read with column stride `in`.
        unsafe {
            product_parallel(
                (rows, out, inner),
                (y.as_mut_ptr(), out, bias.is_some()),
                (x.as_ptr(), 1, inner),
                (w.as_ptr(), inner, 1),
                scale,
            )
        };
    }
    Ok(())
}

/// One product of [`few_rows`]: `y = scale · (x Wᵀ + b)` written at `place`, W `(out, in)`
/// row-major.
pub(crate) struct Product<'a> {
    pub(crate) y: &'a mut [f32],
    pub(crate) w: &'a [f32],
    pub(crate) bias: Option<&'a [f32]>,
    pub(crate) out: usize,
    pub(crate) scale: f32,
    pub(crate) place: Place,
}

/// The products of one input `x (rows × in)` of at most [`FEW_ROWS`] rows. When there is
/// enough work to share (2^17 multiply-adds), in one fork: each run of [`FEATURES`] output
/// features of each product is a task, computed as the output's columns `W_run · xᵀ` into a
/// tile and then written to its places, so the tasks also do the transposition into rows or
/// heads. x is copied once as columns, which `gemm` then reads in place instead of packing
/// them for every run. Less work runs on this thread, one `gemm` call per product.
///
/// # Errors
/// The copy of x cannot be allocated.
///
/// # Panics
/// If `rows` is 0 or over [`FEW_ROWS`], `inner` is 0, a slice is shorter than its dimensions
/// say, or a product's `place` does not fit `rows × out`.
pub(crate) fn few_rows(
    x: &[f32],
    (rows, inner): (usize, usize),
    products: &mut [Product],
) -> candle_core::Result<()> {
    assert!((1..=FEW_ROWS).contains(&rows) && inner > 0 && x.len() >= rows * inner);
    for p in products.iter() {
        assert!(p.out > 0 && p.place.fits(rows, p.out) && p.w.len() >= p.out * inner);
        assert!(p.bias.is_none_or(|b| b.len() >= p.out));
        // Every index is at most the last one (`Place::index`).
        assert!(p.y.len() > p.place.index(rows - 1, p.out - 1, p.out));
    }
    let work = products.iter().map(|p| p.out).sum::<usize>() * rows * inner;
    if work < 1 << 17 {
        return products
            .iter_mut()
            .try_for_each(|p| whole(x, (rows, inner), p));
    }
    let mut xt = super::workspace::take(inner * rows, "projection: rows as columns")?;
    for (c, column) in xt.chunks_exact_mut(rows).enumerate() {
        for (r, v) in column.iter_mut().enumerate() {
            *v = x[r * inner + c];
        }
    }
    let outs: Vec<OutRows> = products
        .iter_mut()
        .map(|p| OutRows(p.y.as_mut_ptr()))
        .collect();
    let tasks: Vec<(usize, usize)> = products
        .iter()
        .enumerate()
        .flat_map(|(i, p)| (0..p.out).step_by(FEATURES).map(move |j0| (i, j0)))
        .collect();
    let run = |&(i, j0): &(usize, usize)| {
        let p = &products[i];
        let n = FEATURES.min(p.out - j0);
        let mut tile = vec![0f32; n * rows];
        with_bias(&mut tile, rows, p.bias.map(|b| &b[j0..j0 + n]), p.scale);
        // SAFETY: W's rows j0..j0 + n lie in it and xt holds in × rows values (asserted);
        // the tile holds n × rows values.
        unsafe {
            product_on(
                gemm::Parallelism::None,
                (n, rows, inner),
                (tile.as_mut_ptr(), rows, p.bias.is_some()),
                (p.w[j0 * inner..].as_ptr(), 1, inner),
                (xt.as_ptr(), 1, rows),
                p.scale,
            )
        };
        to_places(&tile, rows, (p.place, p.out, j0), |at, v| {
            // SAFETY: the index is in bounds (asserted above); features j0..j0 + n belong to
            // this task alone, and `place` is one-to-one.
            unsafe { *outs[i].at(at) = v };
        });
    };
    tasks.par_iter().for_each(run);
    super::workspace::keep(xt);
    Ok(())
}

/// One product of [`few_rows`] too small to share, on this thread as one `gemm` call of the
/// output's columns `W · xᵀ` (x read in place), then written to its places.
fn whole(x: &[f32], (rows, inner): (usize, usize), p: &mut Product) -> candle_core::Result<()> {
    let mut columns = super::workspace::take(p.out * rows, "projection columns")?;
    with_bias(&mut columns, rows, p.bias, p.scale);
    // SAFETY: W holds out × in values, x rows × in (asserted by `few_rows`), `columns`
    // out × rows; `xᵀ` is read with column stride `in`.
    unsafe {
        product_on(
            gemm::Parallelism::None,
            (p.out, rows, inner),
            (columns.as_mut_ptr(), rows, p.bias.is_some()),
            (p.w.as_ptr(), 1, inner),
            (x.as_ptr(), inner, 1),
            p.scale,
        )
    };
    to_places(&columns, rows, (p.place, p.out, 0), |at, v| p.y[at] = v);
    super::workspace::keep(columns);
    Ok(())
}

/// `columns` (features of `rows` values each) with `scale · b` in each feature's values, for a
/// product that adds to them (`accumulate`) in one rounding, as for more rows; without a bias,
/// left to the product, which writes them without reading them.
fn with_bias(columns: &mut [f32], rows: usize, bias: Option<&[f32]>, scale: f32) {
    if let Some(b) = bias {
        for (column, &b) in columns.chunks_exact_mut(rows).zip(b) {
            column.fill(scale * b);
        }
    }
}

/// `write(index, value)` for each value of `columns` (features `j0..` of `rows` values each) at
/// its place in an output of `out` features.
fn to_places(
    columns: &[f32],
    rows: usize,
    (place, out, j0): (Place, usize, usize),
    mut write: impl FnMut(usize, f32),
) {
    let starts = &mut [0usize; FEW_ROWS][..rows];
    for (r, start) in starts.iter_mut().enumerate() {
        *start = place.row(r, out);
    }
    for (c, column) in columns.chunks_exact(rows).enumerate() {
        let at = place.feature(j0 + c);
        for (&v, start) in column.iter().zip(&*starts) {
            write(start + at, v);
        }
    }
}

/// The output of [`few_rows`], written at disjoint places by its tasks.
#[derive(Clone, Copy)]
struct OutRows(*mut f32);

// SAFETY: the tasks write disjoint elements (`few_rows`).
unsafe impl Send for OutRows {}
unsafe impl Sync for OutRows {}

impl OutRows {
    /// The element `offset` past the start (a method, so closures capture the whole value).
    ///
    /// # Safety
    /// `offset` must lie inside the output.
    unsafe fn at(self, offset: usize) -> *mut f32 {
        // SAFETY: the caller keeps `offset` in bounds.
        unsafe { self.0.add(offset) }
    }
}

/// [`product`] with the given parallelism.
///
/// # Safety
/// As [`product`].
unsafe fn product_on(
    #[cfg_attr(miri, allow(unused_variables))] parallelism: gemm::Parallelism,
    (m, n, k): (usize, usize, usize),
    (dst, dst_rs, accumulate): (*mut f32, usize, bool),
    (lhs, lhs_cs, lhs_rs): (*const f32, usize, usize),
    (rhs, rhs_cs, rhs_rs): (*const f32, usize, usize),
    scale: f32,
) {
    // Under Miri, a scalar product through the same pointers and strides, so that Miri checks
    // every address the views and the output hand out (gemm's SIMD kernels are outside what
    // Miri interprets).
    #[cfg(miri)]
    {
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0f32;
                for p in 0..k {
                    // SAFETY: the caller's contract: (i, p) and (p, j) lie inside lhs and rhs.
                    acc += unsafe {
                        *lhs.add(i * lhs_rs + p * lhs_cs) * *rhs.add(p * rhs_rs + j * rhs_cs)
                    };
                }
                // SAFETY: the caller's contract: (i, j) lies inside dst, written by us alone.
                unsafe {
                    let out = dst.add(i * dst_rs + j);
                    *out = if accumulate {
                        *out + scale * acc
                    } else {
                        scale * acc
                    };
                }
            }
        }
    }
    // SAFETY: the caller's contract. `gemm` computes dst = alpha·dst + beta·lhs·rhs, reading
    // dst only when asked to.
    #[cfg(not(miri))]
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            accumulate,
            lhs,
            lhs_cs as isize,
            lhs_rs as isize,
            rhs,
            rhs_cs as isize,
            rhs_rs as isize,
            1.0,
            scale,
            false,
            false,
            false,
            parallelism,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values in [-1, 1) from a fixed sequence (no dependency on a random generator).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut state = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// `scale · (x Wᵀ + b)` in f64, as rows `(rows, out)`.
    fn reference(
        x: &[f32],
        w: &[f32],
        bias: Option<&[f32]>,
        dims: (usize, usize, usize),
        scale: f32,
    ) -> Vec<f64> {
        let (rows, out, inner) = dims;
        let mut y = vec![0f64; rows * out];
        for r in 0..rows {
            for j in 0..out {
                let dot: f64 = (0..inner)
                    .map(|c| f64::from(x[r * inner + c]) * f64::from(w[j * inner + c]))
                    .sum();
                y[r * out + j] = f64::from(scale) * (dot + bias.map_or(0.0, |b| f64::from(b[j])));
            }
        }
        y
    }

    /// Several products of one input in one call equal the f64 reference at their places
    /// (rows and heads first, one and two sequences), with and without a bias and a scale,
    /// for row counts from one to [`FEW_ROWS`], widths that are and are not a multiple of a
    /// task's run, and work below and above the size that is shared among threads.
    #[test]
    fn few_rows_equal_reference_at_their_places() -> candle_core::Result<()> {
        for (rows, len, inner) in [
            (1, 1, 576),
            (5, 5, 64),
            (30, 30, 576),
            (2 * 17, 17, 200),
            (64, 32, 96),
            (3, 3, 8),
            (131, 131, 64),
            (FEW_ROWS, FEW_ROWS / 2, 40),
        ] {
            let x = values(rows * inner, 1);
            // (heads, d, bias, scale): q-like, k-like with a bias, a width of 7 heads of 10.
            let shapes = [
                (9, 64, false, 0.125f32),
                (3, 64, true, 1.0),
                (7, 10, true, 0.5),
            ];
            let weights: Vec<Vec<f32>> = shapes
                .iter()
                .enumerate()
                .map(|(i, &(h, d, _, _))| values(h * d * inner, 10 + i as u64))
                .collect();
            let biases: Vec<Vec<f32>> = shapes
                .iter()
                .enumerate()
                .map(|(i, &(h, d, _, _))| values(h * d, 20 + i as u64))
                .collect();
            for heads_first in [false, true] {
                let mut ys: Vec<Vec<f32>> = shapes
                    .iter()
                    .map(|&(h, d, _, _)| vec![f32::NAN; rows * h * d])
                    .collect();
                let mut products: Vec<Product> = ys
                    .iter_mut()
                    .zip(&shapes)
                    .zip(weights.iter().zip(&biases))
                    .map(|((y, &(heads, d, has_bias, scale)), (w, b))| Product {
                        y,
                        w,
                        bias: has_bias.then_some(&b[..]),
                        out: heads * d,
                        scale,
                        place: match heads_first {
                            true => Place::Heads { len, heads, d },
                            false => Place::Rows,
                        },
                    })
                    .collect();
                few_rows(&x, (rows, inner), &mut products)?;
                for (i, &(heads, d, has_bias, scale)) in shapes.iter().enumerate() {
                    let out = heads * d;
                    let bias = has_bias.then_some(&biases[i][..]);
                    let want = reference(&x, &weights[i], bias, (rows, out, inner), scale);
                    for r in 0..rows {
                        for j in 0..out {
                            let at = match heads_first {
                                true => (((r / len) * heads + j / d) * len + r % len) * d + j % d,
                                false => r * out + j,
                            };
                            let (got, want) = (f64::from(ys[i][at]), want[r * out + j]);
                            assert!(
                                (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                                "rows {rows} inner {inner} product {i} heads first {heads_first} ({r}, {j}): {got} against {want}"
                            );
                        }
                    }
                }
            }
        }
        Ok(())
    }
}
