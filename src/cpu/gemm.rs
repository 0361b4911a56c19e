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
    unsafe { product_on(gemm::Parallelism::None, dims, dst, lhs, rhs) }
}

/// [`product`] on rayon's threads when it is large enough to share (2^17 multiply-adds or more;
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
) {
    let (m, n, k) = dims;
    let parallelism = match m.saturating_mul(n).saturating_mul(k) >= 1 << 17 {
        true => gemm::Parallelism::Rayon(rayon::current_num_threads()),
        false => gemm::Parallelism::None,
    };
    // SAFETY: the caller's contract.
    unsafe { product_on(parallelism, dims, dst, lhs, rhs) }
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
                    *out = if accumulate { *out + acc } else { acc };
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
            1.0,
            false,
            false,
            false,
            parallelism,
        )
    }
}
