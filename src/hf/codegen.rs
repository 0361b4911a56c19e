//! CodeGen's fused projection: `qkv_proj` as CodeGen was trained, in 4 model-parallel shards.
//!
//! ```text
//! qkv_proj.weight  (3·E, E)  =  shards s = 0 .. E/w, each rows [q_s; v_s; k_s] of w rows
//! q = [q_0; q_1; …], k = [k_0; …], v = [v_0; …]   w = ⌊E / 4⌋ (HF's `mp_num` = 4)
//! ```
//!
//! HF's `CodeGenAttention` views the projection's `3·E` outputs as rows of `3·w` and splits
//! each into query, value and key (in that order), so the shards are as many as `E / w`
//! (4 when 4 divides E). A width that `w` does not divide, or under 4, fails there, and is
//! refused here under the width's key.

use super::json::problem;
use crate::error::Result;

/// The shards HF's CodeGen attention assumes.
const MP_NUM: usize = 4;

/// The rows of q (and of k, and of v) in one shard of a `d_model`-wide layer.
pub(super) fn shard_rows(d_model: usize) -> usize {
    d_model / MP_NUM
}

/// Refuses a width whose projection HF's CodeGen attention cannot view in shards.
///
/// # Errors
/// [`Error::HfConfig`](crate::error::Error::HfConfig) naming `key` for a width under 4 or one
/// that `⌊width / 4⌋` does not divide.
pub(super) fn check_width(d_model: usize, key: &str) -> Result<()> {
    let w = shard_rows(d_model);
    if w == 0 || !d_model.is_multiple_of(w) {
        return Err(problem(
            key,
            format!(
                "is {d_model}, which HF's CodeGen attention cannot split into shards of \
                 {d_model} / {MP_NUM} = {w} rows (its qkv_proj is stored in {MP_NUM} \
                 model-parallel shards); HF fails on it"
            ),
        ));
    }
    Ok(())
}
