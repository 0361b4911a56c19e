//! Matrix products on the CPU in f32 through `gemm`, on raw strided views: the fused cores'
//! tiles and the one-node projections read and write their operands in place.

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

/// Rows up to which [`linear`] computes the output's columns: `gemm` then reads the weights in
/// place, where for rows it would copy all of them into its packed panels on every call (a
/// pass over the weights that costs more than a few rows' products).
const FEW_ROWS: usize = 64;

/// `y (rows × out) = scale · (x (rows × in) · Wᵀ + b)`, W `(out, in)`, all row-major, on rayon's threads
/// when large enough ([`product_parallel`]): the one linear product of both projection paths.
/// Few rows are computed as the output's columns `W · xᵀ` (`gemm`'s native order, which reads
/// the weights unpacked), then transposed into `y`.
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
    if let (true, Some(b)) = (rows > FEW_ROWS || inner == 0, bias) {
        y.chunks_exact_mut(out).take(rows).for_each(|row| {
            row.iter_mut().zip(b).for_each(|(y, &b)| *y = scale * b);
        });
    }
    if inner == 0 {
        // No products: the bias, or zeros.
        if bias.is_none() {
            y[..rows * out].fill(0.0);
        }
        return Ok(());
    }
    if rows > FEW_ROWS {
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
        return Ok(());
    }
    let mut columns = super::zeroed(rows * out, "projection columns")?;
    if let Some(b) = bias {
        for (column, &bj) in columns.chunks_exact_mut(rows).zip(b) {
            column.fill(scale * bj);
        }
    }
    // SAFETY: W holds out × in values, x rows × in, `columns` out × rows (asserted and
    // allocated above); `xᵀ` is read with column stride `in`.
    unsafe {
        product_parallel(
            (out, rows, inner),
            (columns.as_mut_ptr(), rows, bias.is_some()),
            (w.as_ptr(), 1, inner),
            (x.as_ptr(), inner, 1),
            scale,
        )
    };
    for (r, row) in y.chunks_exact_mut(out).take(rows).enumerate() {
        for (j, v) in row.iter_mut().enumerate() {
            *v = columns[j * rows + r];
        }
    }
    Ok(())
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
