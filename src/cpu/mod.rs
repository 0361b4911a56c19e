//! The CPU kernels the block and the encodings share: strided f32 products through `gemm`
//! ([`gemm`]) and a linear projection as one node of candle's graph ([`linear_node`]). The
//! attention cores themselves are the block's paths (`attention/fused_*.rs`).

pub(crate) mod gemm;
pub(crate) mod linear_node;
pub(crate) mod pool;
pub(crate) mod row_scale;

/// `n` zeros, or an error naming `what` when the allocation fails.
pub(crate) fn zeroed(n: usize, what: &str) -> candle_core::Result<Vec<f32>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|e| candle_core::Error::Msg(format!("{what} ({n} values): {e}")))?;
    v.resize(n, 0.0);
    Ok(v)
}
