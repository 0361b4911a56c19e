//! The CPU kernels the block and the encodings share: strided f32 products through `gemm`
//! ([`gemm`]), bf16 products on AVX-512 BF16 (`bf16_gemm`, x86-64 only) and a linear
//! projection as one node of candle's graph ([`linear_node`]). The
//! attention cores themselves are the block's paths (`attention/fused_*.rs`).

#[cfg(target_arch = "x86_64")]
pub(crate) mod bf16_gemm;
pub(crate) mod gemm;
pub(crate) mod linear_node;
pub(crate) mod pool;
pub(crate) mod row_scale;
pub(crate) mod workspace;

/// `n` zeros, or an error naming `what` when the allocation fails. The zeros come from the
/// allocator (`calloc`), which leaves memory fresh from the system as it is instead of
/// writing every page: a buffer the size of a chunk is then touched once, by whoever fills
/// it, not twice.
pub(crate) fn zeroed(n: usize, what: &str) -> candle_core::Result<Vec<f32>> {
    let fail =
        |e: &dyn std::fmt::Display| candle_core::Error::Msg(format!("{what} ({n} values): {e}"));
    if n == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<f32>(n).map_err(|e| fail(&e))?;
    // SAFETY: the layout has a non-zero size (n > 0).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<f32>();
    if ptr.is_null() {
        return Err(fail(&"out of memory"));
    }
    // SAFETY: `ptr` was allocated by the global allocator with the layout of `n` f32s (what
    // `Vec<f32>` with capacity `n` frees), and all `n` values are initialised (zero bits are
    // 0.0).
    Ok(unsafe { Vec::from_raw_parts(ptr, n, n) })
}
