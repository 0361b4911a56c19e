//! A key/value cache for incremental decoding that also remembers the keys' positions.

use candle_core::Tensor;

use crate::error::Result;
use crate::positions::Positions;

/// Keys and values of the tokens seen so far, with their positions.
///
/// Keys are stored after rotation (rotary encodings rotate each key once, at its own position),
/// with `num_kv_heads` heads (the fused CPU core reads each shared head in place; the other paths
/// repeat grouped heads after the cache). Storage is candle-nn's
/// growing [`candle_nn::kv_cache::KvCache`], so appending a token costs O(1) amortised copies.
///
/// # Shapes
/// keys and values: `(B, Hkv, T_cached, D)`.
#[derive(Debug, Clone)]
pub struct KvCache {
    inner: candle_nn::kv_cache::KvCache,
    /// Positions per storage block, as asked; capped at the first append (see `with_capacity`).
    capacity: usize,
    positions: Option<Positions>,
}

impl Default for KvCache {
    fn default() -> Self {
        Self::new()
    }
}

impl KvCache {
    /// An empty cache (storage grows by 512 positions at a time).
    pub fn new() -> Self {
        Self::with_capacity(512)
    }

    /// An empty cache whose storage grows `capacity` positions at a time.
    ///
    /// The capacity is a hint: storage is allocated at the first append, for at most
    /// [`crate::limits::MAX_ELEMENTS`] elements per block (so `with_capacity(10^12)` does not
    /// abort on allocation), and grows past it as tokens arrive.
    pub fn with_capacity(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        Self {
            inner: candle_nn::kv_cache::KvCache::new(2, capacity),
            capacity,
            positions: None,
        }
    }

    /// Number of cached tokens.
    pub fn len(&self) -> usize {
        self.inner.current_seq_len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Positions of the cached keys (`None` while empty).
    pub fn positions(&self) -> Option<&Positions> {
        self.positions.as_ref()
    }

    /// The position a chunk that continues the cache starts at: one past the last cached
    /// offset, or one past the largest cached id.
    pub fn next_position(&self) -> usize {
        self.positions.as_ref().map_or(0, |p| p.end(self.len()))
    }

    /// Drops everything.
    pub fn reset(&mut self) {
        self.inner.reset();
        self.positions = None;
    }

    /// Appends a chunk and returns every cached key and value with the keys' positions.
    pub(crate) fn append(
        &mut self,
        k: &Tensor,
        v: &Tensor,
        positions: &Positions,
    ) -> Result<(Tensor, Tensor, Positions)> {
        let cached = self.len();
        let new_len = k.dim(2)?;
        if self.inner.k()?.is_none() {
            // First append: size one storage block for this batch, heads and head width.
            let (b, h, _, d) = k.dims4()?;
            let per_position = b.saturating_mul(h).saturating_mul(d).max(1);
            let block = self
                .capacity
                .min(crate::limits::MAX_ELEMENTS / per_position)
                .max(1);
            self.inner = candle_nn::kv_cache::KvCache::new(2, block);
        }
        if let Some(prev) = self.inner.k()? {
            let (pd, kd) = (prev.dims(), k.dims());
            if pd[0] != kd[0] || pd[1] != kd[1] || pd[3] != kd[3] {
                return Err(crate::error::Error::shape(
                    "keys appended to the KV cache",
                    format!(
                        "(batch {}, kv heads {}, T, head_dim {}) like the cached keys",
                        pd[0], pd[1], pd[3]
                    ),
                    k.shape(),
                ));
            }
        }
        let all_positions = match &self.positions {
            None => positions.clone(),
            Some(p) => p.extend(cached, positions, new_len, k.device())?,
        };
        let (k, v) = self.inner.append(&k.contiguous()?, &v.contiguous()?)?;
        self.positions = Some(all_positions.clone());
        Ok((k, v, all_positions))
    }
}
