//! Relative encodings: biases on the attention logits that depend on `j − i`, and Shaw's
//! relative representations.
//!
//! The shared mechanics live here: mapping every (query, key) pair to a bucket of its relative
//! distance (`relative_buckets`), caching those buckets per shape (`BucketCache`), the range
//! of distances a block of offsets spans (for the compact [`crate::RelativeBias`]
//! form), and a learned `(num_buckets, num_heads)` table read through them
//! ([`BucketedRelativeBias`]), which the T5 and clipped biases share.

pub mod alibi;
pub mod clipped_bias;
pub mod fox;
pub mod inkling;
pub mod shaw;
pub mod t5;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor};

use crate::error::{check_float, check_var_builder, learned, Error, Result};
use crate::plug::{AttentionContext, Columns, LogitsBias, PositionalEncoding, RelativeBias};
use crate::positions::{check_ranges, Positions};

/// Maps every query/key pair to `bucket(j − i)`: a `u32` tensor of shape `(B|1, Tq, Tk)`.
///
/// `bucket` runs on the host once per distinct distance (at most `Tq + Tk − 1` for offsets),
/// and the lookup is applied on the device; no tensor is read back.
pub(crate) fn relative_buckets(
    queries: &Positions,
    tq: usize,
    keys: &Positions,
    tk: usize,
    device: &Device,
    bucket: &dyn Fn(i64) -> u32,
) -> Result<Tensor> {
    check_ranges(queries, tq, keys, tk)?;
    crate::limits::check_elements(
        "queries × keys",
        format_args!("{tq} × {tk}"),
        "the number of (query, key) pairs",
        &[tq, tk],
    )?;
    // The smallest and largest distance j − i that can occur.
    let (q_lo, q_hi) = span(queries, tq);
    let (k_lo, k_hi) = span(keys, tk);
    let d_min = k_lo as i64 - q_hi as i64;
    let d_max = k_hi as i64 - q_lo as i64;
    if let (Positions::Offset(qs), Positions::Offset(ks)) = (queries, keys) {
        if tq == 0 || tk == 0 {
            // No pair: nothing to look up (the span of an empty side is not a range).
            return Ok(Tensor::zeros((1, tq, tk), DType::U32, device)?);
        }
        // Toeplitz: entry (i, j) is bucket(ks + j − qs − i); build it on the host directly.
        let mut data = Vec::with_capacity(tq * tk);
        let lookup: Vec<u32> = (d_min..=d_max).map(bucket).collect();
        for i in 0..tq {
            for j in 0..tk {
                let d = (*ks + j) as i64 - (*qs + i) as i64;
                data.push(lookup[(d - d_min) as usize]);
            }
        }
        return Ok(Tensor::from_vec(data, (1, tq, tk), device)?);
    }
    let dist = Positions::relative_distances(queries, tq, keys, tk, device)?;
    let (b, _, _) = dist.dims3()?;
    let range = (d_max - d_min + 1) as u64;
    if range > (b * tq * tk) as u64 {
        // Ids far apart (e.g. 0 and 2^32 − 2): a lookup over every distance in between could
        // need gigabytes, so bucket the distances that occur instead.
        let buckets: Vec<u32> = dist
            .flatten_all()?
            .to_vec1::<i64>()?
            .into_iter()
            .map(bucket)
            .collect();
        return Ok(Tensor::from_vec(buckets, (b, tq, tk), device)?);
    }
    let lookup: Vec<u32> = (d_min..=d_max).map(bucket).collect();
    let lookup = Tensor::from_vec(lookup, range as usize, device)?;
    let index = dist
        .broadcast_sub(&Tensor::new(d_min, device)?)?
        .to_dtype(DType::U32)?;
    Ok(lookup
        .index_select(&index.flatten_all()?, 0)?
        .reshape((b, tq, tk))?)
}

/// The distances `j − i` a block of `tq` queries and `tk` keys at offsets spans: `d_min ..
/// d_min + width`, with pair `(i, j)` at column `j − i + tq − 1` (a [`RelativeBias`] with
/// `shift = tq − 1`). `None` for explicit ids or an empty block.
///
/// [`RelativeBias`]: crate::RelativeBias
pub(crate) struct DistanceRange {
    pub(crate) d_min: i64,
    pub(crate) width: usize,
    /// The positions shifted so the smaller start is 0: equal ranges share one cache key.
    pub(crate) queries: Positions,
    pub(crate) keys: Positions,
}

impl DistanceRange {
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for offsets past [`crate::positions::MAX_POSITION`] or a range
    /// past the size budget.
    pub(crate) fn of(
        queries: &Positions,
        tq: usize,
        keys: &Positions,
        tk: usize,
    ) -> Result<Option<Self>> {
        // Before the early returns: an empty side does not excuse the other's range.
        check_ranges(queries, tq, keys, tk)?;
        let (Positions::Offset(qs), Positions::Offset(ks)) = (queries, keys) else {
            return Ok(None);
        };
        if tq == 0 || tk == 0 {
            return Ok(None);
        }
        crate::limits::check_elements(
            "queries + keys",
            format_args!("{tq} + {tk}"),
            "the distances of a block (queries + keys − 1)",
            &[tq + tk - 1],
        )?;
        let m = (*qs).min(*ks);
        Ok(Some(Self {
            d_min: *ks as i64 - (qs + tq - 1) as i64,
            width: tq + tk - 1,
            queries: Positions::Offset(qs - m),
            keys: Positions::Offset(ks - m),
        }))
    }

    /// The shift of a [`RelativeBias`](crate::RelativeBias) over this range.
    pub(crate) fn shift(&self, tq: usize) -> i64 {
        tq as i64 - 1
    }

    /// Every distance of the range, in column order.
    pub(crate) fn distances(&self) -> impl Iterator<Item = i64> {
        let d_min = self.d_min;
        (0..self.width as i64).map(move |c| d_min + c)
    }
}

/// Cache layout tag of the per-distance rows behind a [`RelativeBias`](crate::RelativeBias).
pub(crate) const ROWS_LAYOUT: (usize, usize) = (usize::MAX, 0);

/// Row `clamp(d, −k, k) + k` of a table of clipped distances (`2k + 1` rows): the clipped
/// bias's and Shaw's. Total: a `k` past `i64` clips at `i64::MAX`, a row past `u32` is
/// `u32::MAX` (their `validate` keeps `k` far below either).
pub(crate) fn clipped_row(max_distance: usize, d: i64) -> u32 {
    let k = i64::try_from(max_distance).unwrap_or(i64::MAX);
    u32::try_from(i128::from(d.clamp(-k, k)) + i128::from(k)).unwrap_or(u32::MAX)
}

/// The smallest and largest position a chunk of `len` tokens may hold.
fn span(p: &Positions, len: usize) -> (usize, usize) {
    match p {
        Positions::Offset(s) => (*s, s.saturating_add(len).saturating_sub(1)),
        Positions::Ids(ids) => (0, ids.end().saturating_sub(1)),
    }
}

fn poisoned() -> Error {
    Error::Candle(candle_core::Error::Msg(
        "relative-position cache lock poisoned by a panicking thread".into(),
    ))
}

/// Key of a cached per-shape tensor: (query start, query length, key start, key length, and a
/// caller-defined layout such as (batch, heads) for tensors expanded to full size).
type ShapeKey = (usize, usize, usize, usize, (usize, usize));

/// Caches per-shape tensors (bucket maps, fixed biases) for offset positions, and counts how
/// many it built. Explicit ids are not cached (their content, not their shape, decides).
#[derive(Debug, Default)]
pub(crate) struct BucketCache {
    map: Mutex<HashMap<ShapeKey, Tensor>>,
    builds: AtomicUsize,
    /// The buckets of a span of distances `lo..lo + n`, `(lo, (n) u32)`, from which every
    /// range inside it is read (see [`Self::distance_buckets`]).
    span: Mutex<Option<(i64, Tensor)>>,
}

/// Entries kept before the cache is cleared (decoding makes one entry per step).
const CACHE_LIMIT: usize = 64;

impl BucketCache {
    /// The cached tensor for these positions and `layout`, or `build()`'s result (cached for
    /// offsets).
    pub(crate) fn get_or_build(
        &self,
        queries: &Positions,
        tq: usize,
        keys: &Positions,
        tk: usize,
        layout: (usize, usize),
        build: impl FnOnce() -> Result<Tensor>,
    ) -> Result<Tensor> {
        queries.check_len(tq)?;
        keys.check_len(tk)?;
        let key = match (queries, keys) {
            (Positions::Offset(q), Positions::Offset(k)) => Some((*q, tq, *k, tk, layout)),
            _ => None,
        };
        if let Some(key) = key {
            if let Some(t) = self.lock()?.get(&key) {
                return Ok(t.clone());
            }
        }
        let t = build()?;
        self.builds.fetch_add(1, Ordering::Relaxed);
        if let Some(key) = key {
            let mut map = self.lock()?;
            if map.len() >= CACHE_LIMIT {
                map.clear();
            }
            map.insert(key, t.clone());
        }
        Ok(t)
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, HashMap<ShapeKey, Tensor>>> {
        self.map.lock().map_err(|_| poisoned())
    }

    /// The bucket of every distance of `range` (`(width)` u32, in column order): a view of
    /// one lookup over a span of distances, built again only when a range leaves it. The new
    /// span covers the old one, the range, and as much again on each side the range passed,
    /// so decoding (one more distance per step) builds it O(log L) times, not every step;
    /// a range far from the span (no overlap) gets a span of its own. A span wider than four
    /// times the range (plus 4096) or past the element budget is cut back to the range.
    pub(crate) fn distance_buckets(
        &self,
        range: &DistanceRange,
        device: &candle_core::Device,
        bucket: impl Fn(i64) -> u32,
    ) -> Result<Tensor> {
        let (a, w) = (range.d_min, range.width as i64);
        let mut span = self.span.lock().map_err(|_| poisoned())?;
        let held = span
            .as_ref()
            .map(|(lo, t)| (*lo, t.dim(0).unwrap_or(0) as i64));
        if let (Some((lo, n)), Some((_, t))) = (held, span.as_ref()) {
            if a >= lo && a + w <= lo + n {
                return Ok(t.narrow(0, (a - lo) as usize, range.width)?);
            }
        }
        let (mut lo, mut hi) = match held {
            Some((lo, n)) if a <= lo + n && a + w >= lo => (lo.min(a), (lo + n).max(a + w)),
            _ => (a, a + w),
        };
        if let Some((old_lo, n)) = held {
            let len = hi - lo;
            if a < old_lo {
                lo = lo.saturating_sub(len);
            }
            if a + w > old_lo + n {
                hi = hi.saturating_add(len);
            }
        }
        // Never more than a few times the range asked for (a decoding step's range is the
        // span's whole width but one), nor past the budget.
        let cap = (4 * w + 4096).min(crate::limits::max_elements() as i64);
        if hi - lo > cap {
            (lo, hi) = (a, a + w);
        }
        let buckets: Vec<u32> = (lo..hi).map(bucket).collect();
        let n = buckets.len();
        let t = Tensor::from_vec(buckets, n, device)?;
        self.builds.fetch_add(1, Ordering::Relaxed);
        let view = t.narrow(0, (a - lo) as usize, range.width)?;
        *span = Some((lo, t));
        Ok(view)
    }

    /// How many tensors were built (cache misses) so far.
    #[cfg(feature = "testing")]
    pub(crate) fn builds(&self) -> usize {
        self.builds.load(Ordering::Relaxed)
    }
}

/// How a learned relative bias maps distances to table rows: implemented by [`T5Config`] and
/// [`ClippedBiasConfig`], whose biases are both a [`BucketedRelativeBias`].
///
/// [`T5Config`]: t5::T5Config
/// [`ClippedBiasConfig`]: clipped_bias::ClippedBiasConfig
pub trait RelativeBucketing: std::fmt::Debug + Clone + Send + Sync {
    /// Name of the table's `VarBuilder` prefix (the tensor is `<prefix>.weight`).
    const TABLE: &'static str;
    /// Attention heads (table columns).
    fn num_heads(&self) -> usize;
    /// Table rows.
    fn num_buckets(&self) -> usize;
    /// The row of relative distance `d = j − i` for a configuration that passed
    /// [`Self::validate`] (as [`BucketedRelativeBias::new`] checks). Implementations must be
    /// total: on any other configuration they return some row without panicking; callers
    /// wanting an error there use the configs' own `bucket`, which validates.
    fn bucket(&self, d: i64) -> u32;
    /// Checks the configuration.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the bad field.
    fn validate(&self) -> Result<()>;
}

/// A learned `(num_buckets, num_heads)` bias table read at `bucket(j − i)`: the T5 and clipped
/// relative biases. Buckets are cached per shape; the table is read on every call, so gradients
/// reach it.
///
/// # Shapes
/// - bias: `(1, H, Tq, Tk)` for offsets, `(B, H, Tq, Tk)` for per-sequence ids.
/// - table `<TABLE>.weight`: `(num_buckets, num_heads)`, created N(0, 1) (as `nn.Embedding`
///   initialises it; HF T5 scales its init by `d_model^-0.5`, so checkpoints bring their own).
#[derive(Debug, Clone)]
pub struct BucketedRelativeBias<C: RelativeBucketing> {
    config: C,
    table: Tensor,
    cache: Arc<BucketCache>,
}

impl<C: RelativeBucketing> BucketedRelativeBias<C> {
    /// Loads (or creates) the table `<C::TABLE>.weight` from `vb`.
    ///
    /// # Errors
    /// The config's [`RelativeBucketing::validate`] errors; [`Error::DType`] for a
    /// `VarBuilder` (or a table) whose dtype is not f32, f64, bf16 or f16;
    /// [`Error::MissingTensor`] / [`Error::TensorShape`] for a checkpoint without the table or
    /// with another shape.
    pub fn new(config: &C, vb: candle_nn::VarBuilder) -> Result<Self> {
        config.validate()?;
        check_var_builder("relative bias table (the VarBuilder's dtype)", &vb)?;
        let table = learned(
            &vb.pp(C::TABLE),
            "relative bias table",
            (config.num_buckets(), config.num_heads()),
            "weight",
            candle_nn::Init::Randn {
                mean: 0.0,
                stdev: 1.0,
            },
        )?;
        Ok(Self {
            config: config.clone(),
            table,
            cache: Arc::new(BucketCache::default()),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &C {
        &self.config
    }

    /// The learned table, `(num_buckets, num_heads)`.
    pub fn weight(&self) -> &Tensor {
        &self.table
    }

    /// Bucket maps built so far (once per shape for offsets; every call for explicit ids).
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn bucket_builds(&self) -> usize {
        self.cache.builds()
    }

    /// The bias for queries at `queries` and keys at `keys`.
    ///
    /// # Shapes
    /// `(1, H, tq, tk)`, or `(B, H, tq, tk)` with per-sequence ids.
    ///
    /// # Errors
    /// [`Error::Shape`] if explicit ids disagree on the batch size.
    pub fn bias(
        &self,
        queries: &Positions,
        tq: usize,
        keys: &Positions,
        tk: usize,
    ) -> Result<Tensor> {
        check_ranges(queries, tq, keys, tk)?;
        let device = self.table.device();
        let cfg = &self.config;
        let buckets = self.cache.get_or_build(queries, tq, keys, tk, (0, 0), || {
            relative_buckets(queries, tq, keys, tk, device, &|d| cfg.bucket(d))
        })?;
        let (b, _, _) = buckets.dims3()?;
        Ok(self
            .table
            .index_select(&buckets.flatten_all()?, 0)?
            .reshape((b, tq, tk, cfg.num_heads()))?
            .permute((0, 3, 1, 2))?)
    }
}

impl<C: RelativeBucketing> PositionalEncoding for BucketedRelativeBias<C> {
    /// Rows of the table: for offsets, the table read at every distance of the block,
    /// `(1, H, 1, Tq + Tk − 1)` with shifted columns (the distance → bucket lookup built once
    /// per shape, the table read every call, so gradients reach it); for explicit ids, the
    /// table's `(1, H, 1, num_buckets)` rows with the bucket of every pair as the column map.
    fn logits_bias(&self, q: &Tensor, ctx: &AttentionContext) -> Result<Option<LogitsBias>> {
        let (_, h, tq, _) = check_queries(q, self.config.num_heads())?;
        check_ranges(ctx.queries, tq, ctx.keys, ctx.k_len)?;
        let (k_len, cfg, device) = (ctx.k_len, &self.config, self.table.device());
        let rows = match DistanceRange::of(ctx.queries, tq, ctx.keys, k_len)? {
            Some(range) => {
                let lookup = self
                    .cache
                    .distance_buckets(&range, device, |d| cfg.bucket(d))?;
                // Gathered along the table's transpose (H × buckets, small), so that the rows
                // come out contiguous, with no copy of the H × width answer.
                let values = self.table.t()?.contiguous()?.index_select(&lookup, 1)?;
                RelativeBias::new(
                    values.reshape((1, h, 1, range.width))?,
                    Columns::Shift(range.shift(tq)),
                )?
            }
            None => {
                let (queries, keys) = (ctx.queries, ctx.keys);
                let buckets =
                    relative_buckets(queries, tq, keys, k_len, device, &|d| cfg.bucket(d))?;
                let values = self.table.t()?.reshape((1, h, 1, cfg.num_buckets()))?;
                RelativeBias::new(values, Columns::Index(buckets))?
            }
        };
        Ok(Some(LogitsBias::Relative(rows)))
    }
}

/// The positions of logits `(B, H, Tq, Tk)` read as a candle `Module` input: keys `0..Tk`, the
/// queries the last `Tq` of them (as in decoding with a cache), so `Tq ≤ Tk`; the logits in a
/// float dtype (integer ones would round the bias away).
pub(crate) fn logits_positions(logits: &Tensor, heads: usize) -> Result<(usize, usize)> {
    check_float("attention logits", logits.dtype())?;
    let (_, h, tq, tk) = logits.dims4().map_err(|_| Error::Rank {
        what: "attention logits",
        expected: 4,
        got: logits.rank(),
        shape: logits.dims().to_vec(),
    })?;
    if h != heads || tq > tk {
        return Err(Error::shape(
            "attention logits",
            format!("(batch, {heads} heads, queries, keys) with no more queries than keys (queries are the last keys' positions)"),
            logits.shape(),
        ));
    }
    Ok((tq, tk))
}

impl<C: RelativeBucketing> candle_core::Module for BucketedRelativeBias<C> {
    /// Adds the bias to logits `(B, H, Tq, Tk)` whose queries are the last `Tq` of the `Tk`
    /// keys (all of them when `Tq = Tk`).
    fn forward(&self, logits: &Tensor) -> candle_core::Result<Tensor> {
        let (tq, tk) = logits_positions(logits, self.config.num_heads())?;
        let bias = self.bias(&Positions::Offset(tk - tq), tq, &Positions::Offset(0), tk)?;
        logits.broadcast_add(&bias.to_dtype(logits.dtype())?)
    }
}

/// `x · Wᵀ` in `x`'s dtype, `(B, T, C)`, for an encoding whose answers read the block's input
/// `x` `(B, T, d_model)` through a learned `(C, d_model)` weight (FoX's gates, Inkling's
/// relative states); `what` names the projection in the error.
///
/// # Errors
/// [`Error::Shape`] for an input of another width than `d_model`.
pub(crate) fn input_projection(
    what: &'static str,
    x: &Tensor,
    weight: &Tensor,
    d_model: usize,
) -> Result<Tensor> {
    let (_, _, d) = x.dims3()?;
    if d != d_model {
        return Err(Error::shape(
            what,
            format!("(batch, tokens, {d_model})"),
            x.shape(),
        ));
    }
    let w = weight.to_dtype(x.dtype())?;
    crate::matmul::broadcast_matmul(x, &w.t()?)
}

/// Checks that the query tensor handed to a bias hook is `(B, H, Tq, D)` and float (Shaw
/// multiplies it; the others read its shape only, but one rule serves every hook).
pub(crate) fn query_dims(q: &Tensor) -> Result<(usize, usize, usize, usize)> {
    let dims = q.dims4().map_err(|_| Error::Rank {
        what: "queries",
        expected: 4,
        got: q.rank(),
        shape: q.dims().to_vec(),
    })?;
    check_float("queries", q.dtype())?;
    Ok(dims)
}

/// Checks the query tensor handed to a bias hook: `(B, H, Tq, D)` with the expected heads.
pub(crate) fn check_queries(q: &Tensor, num_heads: usize) -> Result<(usize, usize, usize, usize)> {
    let dims = query_dims(q)?;
    if dims.1 != num_heads {
        return Err(Error::shape(
            "queries",
            format!("(batch, {num_heads} heads, seq_len, head_dim) to match the encoding's heads"),
            q.shape(),
        ));
    }
    Ok(dims)
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    /// The span's views equal a lookup built for each range alone, for a decoding run (one
    /// distance more per step, built O(log L) times), a jump far away (a span of its own)
    /// and ranges on both sides of the span.
    #[test]
    fn distance_buckets_are_views_of_a_growing_span() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let cache = BucketCache::default();
        let bucket = |d: i64| (d.clamp(-50, 50) + 50) as u32;
        let check = |qs: usize, tq: usize, tk: usize| -> anyhow::Result<()> {
            let range = DistanceRange::of(&Positions::Offset(qs), tq, &Positions::Offset(0), tk)?
                .ok_or_else(|| anyhow::anyhow!("offsets have a range"))?;
            let got = cache
                .distance_buckets(&range, &dev, bucket)?
                .to_vec1::<u32>()?;
            let want: Vec<u32> = range.distances().map(bucket).collect();
            assert_eq!(got, want, "queries {qs}+{tq}, keys {tk}");
            Ok(())
        };
        check(0, 16, 16)?;
        for len in 16..1040 {
            check(len, 1, len + 1)?;
        }
        let decoding = cache.builds();
        assert!(decoding <= 8, "{decoding} builds for 1024 steps");
        check(1_000_000, 4, 1_000_004)?;
        check(1_000_000, 4, 10)?;
        check(30, 40, 80)?;
        check(5, 2, 3)?;
        Ok(())
    }
}
