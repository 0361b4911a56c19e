//! A key/value cache for incremental decoding that also remembers the keys' positions.

use std::sync::Arc;

use candle_core::Tensor;

use super::short_conv::ConvState;
use crate::error::{Error, Result};
use crate::limits::max_elements;
use crate::positions::{PositionIds, Positions};

/// Positions a cache's first storage holds unless asked otherwise.
const DEFAULT_CAPACITY: usize = 512;

/// Keys and values of the tokens seen so far, with their positions.
///
/// Keys are stored after rotation (rotary encodings rotate each key once, at its own position),
/// with `num_kv_heads` heads (the fused CPU core reads each shared head in place; the other paths
/// repeat grouped heads after the cache). Storage is written in place; it starts at the
/// capacity asked for (512 positions by default, never past the budget) and doubles when a
/// chunk does not fit, so appending a token costs O(1) amortised copies and the storage follows
/// the tokens held ([`Self::capacity`]).
///
/// Beside the keys it keeps the per-token states of an encoding that reads the block's input
/// ([`Content::Input`](crate::plug::Content::Input), or FoX's cumulative log gates,
/// [`Content::RunningSums`](crate::plug::Content::RunningSums)), so that a chunk continues
/// them; truncating, a failed call and a streaming cache's eviction treat them as the keys
/// (eviction also takes the forgotten tokens' terms out of running sums). It also keeps the state of a block's short convolutions
/// ([`AttentionConfig::short_conv`](crate::AttentionConfig::short_conv): the last inputs of
/// its key and value convolutions), which eviction leaves as it is (it is the newest tokens')
/// and which cannot be truncated back.
///
/// A cache belongs to the block that filled it (and its clones): another block's call is
/// refused with [`Error::InvalidConfig`] until the cache is reset ([`Self::reset`], or
/// [`Self::truncate`] to nothing), since its keys and values would be another layer's.
///
/// A clone is an independent cache (beam search, branching): clones share storage only until
/// one of them appends, which first copies what it holds (copy on write), so no clone ever sees
/// another's keys.
///
/// # Shapes
/// keys and values: `(B, Hkv, T_cached, D)`.
///
/// # Example
/// Two continuations of one prompt, as beam search makes them:
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use candle_posenc::{AttentionConfig, AttentionOptions, KvCache, MultiHeadAttention};
///
/// let dev = Device::Cpu;
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
/// let attn = MultiHeadAttention::new(&AttentionConfig::new(16, 2).with_causal(true), None, vb)?;
/// let opts = AttentionOptions::default();
/// let mut cache = KvCache::with_capacity(64);
/// attn.forward_with(&Tensor::randn(0f32, 1.0, (1, 3, 16), &dev)?, &opts, Some(&mut cache))?;
/// let mut branch = cache.clone();
/// attn.forward_with(&Tensor::ones((1, 1, 16), DType::F32, &dev)?, &opts, Some(&mut cache))?;
/// attn.forward_with(&Tensor::zeros((1, 2, 16), DType::F32, &dev)?, &opts, Some(&mut branch))?;
/// assert_eq!((cache.len(), branch.len()), (4, 5));
/// # Ok::<(), candle_posenc::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct KvCache {
    /// `(B, Hkv, capacity, D)` buffers, allocated at the first append.
    k: Option<Tensor>,
    v: Option<Tensor>,
    /// A streaming cache's keys kept rotated, beside the unrotated `k` (see [`Frame`]).
    rotated: Option<Tensor>,
    /// Where the kept rotated keys sit, while they are valid.
    frame: Option<Frame>,
    /// The buffers' index of slot 0: a streaming cache evicts by moving its sinks forward
    /// (O(sinks)) rather than its window back, and compacts when the end is reached.
    start: usize,
    len: usize,
    /// Positions of the first allocation, as asked (capped by the budget when allocated).
    capacity: usize,
    positions: Option<Positions>,
    /// Shared by clones: a cache writes into its buffers only while it holds the only handle.
    owner: Arc<()>,
    /// `Some((sinks, window))`: a streaming cache (see [`Self::streaming`]).
    streaming: Option<(usize, usize)>,
    /// `(B, C, len)`: the held tokens' states, for an encoding that reads its input
    /// ([`Content::Input`](crate::plug::Content::Input)); detached. A view of `state_store`
    /// when appended outside a graph.
    states: Option<Tensor>,
    /// `(B, C, capacity)` storage the states are written into (doubling as they grow), and
    /// its owner, shared by clones as `owner` is for the keys.
    state_store: Option<(Tensor, Arc<()>)>,
    /// Whether the states are running sums ([`Content::RunningSums`](crate::plug::Content)),
    /// which eviction rebases.
    sums: bool,
    /// The short convolutions' last inputs after the held tokens, when the block has them.
    conv: Option<ConvState>,
    /// The block whose chunks filled the cache, until it is emptied (reset or truncated to
    /// nothing).
    block: Option<BlockId>,
}

/// A block's identity for the caches it fills: fresh for each block built, kept by its
/// clones, so that a cache continues only the block that filled it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BlockId(u64);

impl BlockId {
    /// An identity no other block has.
    pub(crate) fn fresh() -> Self {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(0);
        Self(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// What [`KvCache::append`], [`KvCache::append_states`] and [`KvCache::set_conv_state`]
/// change, to put back.
pub(crate) type Mark = (usize, Option<Positions>, Option<Tensor>, Option<ConvState>);

impl Default for KvCache {
    fn default() -> Self {
        Self::new()
    }
}

impl KvCache {
    /// An empty cache (storage for 512 positions at the first append, doubling after).
    pub fn new() -> Self {
        Self::with_capacity(DEFAULT_CAPACITY)
    }

    /// An empty cache whose first storage holds `capacity` positions.
    ///
    /// The capacity is a hint: storage is allocated at the first append, for at most
    /// [`crate::limits::max_elements`] elements per buffer (so `with_capacity(10^12)` does not
    /// abort on allocation), and doubles past it as tokens arrive.
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            k: None,
            v: None,
            rotated: None,
            frame: None,
            start: 0,
            len: 0,
            capacity: capacity.max(1),
            positions: None,
            owner: Arc::new(()),
            streaming: None,
            states: None,
            state_store: None,
            sums: false,
            conv: None,
            block: None,
        }
    }

    /// A streaming cache (StreamingLLM): after each chunk it keeps the first `sinks` tokens
    /// (attention sinks) and the last `window`, and forgets the ones between.
    ///
    /// Tokens sit at their slots in the cache, not at their places in the text, as the paper
    /// does: keys are cached before the rotation, and every call rotates all of them at slots
    /// `0..len` and its queries at the slots after, so the distances the encoding sees never
    /// pass `sinks + window + chunk` however long the stream. (Rotating each key once at its
    /// text position, as the plain cache does, would leave a gap between the sinks and the
    /// window that grows without bound, past the positions the model was trained on.)
    ///
    /// Where the logits depend on positions only through their differences (RoPE at fixed
    /// frequencies, [`crate::PositionalEncoding::relative_rotation`]) the cache also keeps its
    /// keys rotated, all shifted alike, so that a decoding step rotates only its own token and
    /// the sinks rather than every held key: the same logits, at a plain cache's cost per
    /// step, for storage of the keys twice (unrotated and rotated) beside the values.
    ///
    /// Each chunk attends to the cache as it stands plus itself (causally); the eviction
    /// follows the chunk. Fed token by token, each token sees the sinks, the last `window`
    /// tokens before it and itself. Until the stream passes `sinks + window` tokens nothing is
    /// evicted and decoding equals the full forward. Positions are the cache's: a call gives
    /// none of its own. A padding mask covers the cached keys (after eviction) and the chunk.
    ///
    /// Only rotations and biases follow the slots: a block whose encoding adds positions to
    /// its input (sinusoidal, learned) refuses a streaming cache with
    /// [`crate::Error::InvalidConfig`], since each key would keep the position it arrived at
    /// and every token past the window would arrive at the same slot. Positions added before
    /// the block (an embeddings layer) have the same problem.
    ///
    /// # Example
    /// ```
    /// use candle_core::{DType, Device, Tensor};
    /// use candle_nn::{VarBuilder, VarMap};
    /// use candle_posenc::{AttentionConfig, AttentionOptions, KvCache, MultiHeadAttention};
    ///
    /// let dev = Device::Cpu;
    /// let varmap = VarMap::new();
    /// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
    /// let attn = MultiHeadAttention::new(&AttentionConfig::new(16, 2).with_causal(true), None, vb)?;
    /// let mut cache = KvCache::streaming(4, 60); // 4 sinks and the last 60 tokens
    /// for _ in 0..100 {
    ///     let token = Tensor::randn(0f32, 1.0, (1, 1, 16), &dev)?;
    ///     attn.forward_with(&token, &AttentionOptions::default(), Some(&mut cache))?;
    /// }
    /// assert_eq!(cache.len(), 64);
    /// # Ok::<(), candle_posenc::Error>(())
    /// ```
    pub fn streaming(sinks: usize, window: usize) -> Self {
        // Storage follows what the cache holds: the default first allocation, doubling as
        // tokens arrive, up to sinks + window + a chunk.
        let most = sinks.saturating_add(window).saturating_add(1);
        Self {
            streaming: Some((sinks, window)),
            ..Self::with_capacity(most.min(DEFAULT_CAPACITY))
        }
    }

    /// `Some((sinks, window))` for a [streaming](Self::streaming) cache.
    pub fn streaming_window(&self) -> Option<(usize, usize)> {
        self.streaming
    }

    /// Number of cached tokens.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions the storage holds before it grows again (0 before the first append): storage
    /// follows the tokens held, doubling as they arrive, so this is at most twice the most
    /// tokens held at once (or the capacity asked for, within the budget).
    pub fn capacity(&self) -> usize {
        self.k
            .as_ref()
            .map_or(0, |k| k.dims().get(2).copied().unwrap_or(0))
    }

    /// Positions of the cached keys (`None` while empty).
    pub fn positions(&self) -> Option<&Positions> {
        self.positions.as_ref()
    }

    /// The position a chunk that continues the cache starts at: one past the last cached
    /// offset, or one past the largest cached id of any sequence (a call given no positions
    /// continues each sequence at its own: [`Self::continuation`]).
    pub fn next_position(&self) -> usize {
        self.positions.as_ref().map_or(0, |p| p.end(self.len()))
    }

    /// The positions of a chunk of `len` tokens that continues the cache, as a call given no
    /// positions takes them: each sequence one past its own largest cached id (on any axis of
    /// multimodal ids), so that a left-padded batch, whose rows end at different ids,
    /// continues every row where it stopped; an offset when the rows end alike (or the cache
    /// holds an offset). Reads the rows' ends back to the host when the cache holds ids.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if a continued position would pass
    /// [`crate::positions::MAX_POSITION`]; device errors.
    pub fn continuation(&self, len: usize) -> Result<Positions> {
        let Some(Positions::Ids(ids)) = &self.positions else {
            return Ok(Positions::Offset(self.next_position()));
        };
        // (B, T) ids, or (3, B, T) axes: the largest per row over every axis.
        let ends: Vec<u32> = match ids.axes() {
            Some(axes) => axes.max(2)?.max(0)?.to_vec1::<u32>()?,
            None => ids.ids().max(1)?.to_vec1::<u32>()?,
        };
        let first = ends.first().copied();
        if ends.iter().all(|&e| Some(e) == first) || ends.is_empty() {
            return Ok(Positions::Offset(self.next_position()));
        }
        let rows = ends
            .iter()
            .map(|&e| {
                let start = e as usize + 1;
                let row = Positions::Offset(start);
                row.check(1, len)?;
                Ok((start..start + len).map(|p| p as u32).collect())
            })
            .collect::<Result<Vec<Vec<u32>>>>()?;
        Ok(PositionIds::from_rows(&rows, ids.ids().device())?.into())
    }

    /// Keeps the first `len` cached tokens and forgets the rest (a rejected draft in
    /// speculative decoding, or one step undone); the storage is kept for the next appends.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if `len` is more than the cache holds, or less while it holds
    /// a short convolution's state (which keeps only the newest tokens' inputs).
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if len > self.len {
            return Err(Error::config(
                "cached tokens to keep",
                len,
                format!("at most the {} cached", self.len),
            ));
        }
        if len < self.len && len > 0 && self.conv.is_some() {
            return Err(Error::config(
                "cached tokens to keep",
                len,
                format!(
                    "all {} cached, or none: the cache holds a short convolution's state, \
                     the inputs after its last token only",
                    self.len
                ),
            ));
        }
        if len == 0 {
            self.conv = None;
            self.block = None;
        }
        if len == 0 {
            self.positions = None;
        } else if let Some(p) = &self.positions {
            // Exact, so `next_position` does not count the forgotten tokens.
            self.positions = Some(p.prefix(len)?);
        }
        self.states = match &self.states {
            Some(s) if len > 0 && s.dim(2)? >= len => Some(s.narrow(2, 0, len)?),
            _ => None,
        };
        self.len = len;
        Ok(())
    }

    /// What [`Self::append`] and [`Self::append_states`] change (the length, the positions and
    /// the states; storage past the length is free to overwrite), to [`Self::restore`] when
    /// the chunk fails after it was appended.
    pub(crate) fn mark(&self) -> Mark {
        (
            self.len,
            self.positions.clone(),
            self.states.clone(),
            self.conv.clone(),
        )
    }

    /// Puts back the length, positions and states of [`Self::mark`].
    pub(crate) fn restore(&mut self, (len, positions, states, conv): Mark) {
        self.len = len;
        self.positions = positions;
        self.states = states;
        self.conv = conv;
    }

    /// Checks that `block` may continue the cache: it is new, reset or truncated to nothing
    /// (a `streaming(0, 0)` cache holds no token after a call but still keeps its block's
    /// state), or was filled by `block` (or a clone of it).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a cache filled by another block: its keys and values are
    /// another layer's (or rotated by another encoding), which no answer of this block could
    /// read.
    pub(crate) fn check_block(&self, block: BlockId) -> Result<()> {
        match self.block {
            Some(filler) if filler != block => Err(Error::config(
                "KV cache",
                "filled by another block",
                "a cache filled by this block or a clone of it (one cache per layer; \
                 reset or truncate it to nothing to reuse it)",
            )),
            _ => Ok(()),
        }
    }

    /// The short convolutions' state after the tokens seen, when they left one: kept by a
    /// streaming cache that holds no token (`streaming(0, 0)` forgets every token after its
    /// chunk, not the inputs the next chunk's convolutions read); none in a new, reset or
    /// truncated-to-nothing cache.
    pub(crate) fn conv_state(&self) -> Option<&ConvState> {
        self.conv.as_ref()
    }

    /// Keeps the short convolutions' state after the chunk just appended.
    pub(crate) fn set_conv_state(&mut self, state: ConvState) {
        self.conv = Some(state);
    }

    /// The held tokens' states `(B, C, len)`, when the tokens were appended with them.
    pub(crate) fn states(&self) -> Option<&Tensor> {
        self.states
            .as_ref()
            .filter(|s| s.dim(2).ok() == Some(self.len))
    }

    /// Appends the states `(B, C, n)` of the chunk [`Self::append`] just appended (its last
    /// `n` tokens), returning every held token's, the chunk's still in the graph of `states`.
    /// `sums`: the states are running sums, which eviction rebases.
    ///
    /// # Errors
    /// [`Error::Shape`] for states whose batch or channels differ from the held ones, or
    /// [`Error::InvalidConfig`] when the tokens held before the chunk were appended without
    /// states (by a block whose encoding reads no input).
    pub(crate) fn append_states(&mut self, states: &Tensor, sums: bool) -> Result<Tensor> {
        self.sums = sums;
        let (b, c, n) = states.dims3()?;
        let before = self.len.checked_sub(n).ok_or_else(|| {
            Error::config("token states", n, "no more than the tokens just appended")
        })?;
        if !states.track_op() {
            if let Some(all) = self.write_states(states, before)? {
                return Ok(all);
            }
        }
        let all = match (before, &self.states) {
            (0, _) => states.clone(),
            (_, Some(held)) if held.dim(2)? == before => {
                let (hb, hc, _) = held.dims3()?;
                if (hb, hc) != (b, c) {
                    return Err(Error::shape(
                        "token states appended to the KV cache",
                        format!("(batch {hb}, {hc} channels, T) like the held states"),
                        states.shape(),
                    ));
                }
                Tensor::cat(&[held, states], 2)?
            }
            _ => {
                return Err(Error::config(
                    "KV cache",
                    "tokens held without their states",
                    "a cache filled by this block: its encoding reads the block's input, \
                     and the tokens before this chunk were cached by a block that does not",
                ))
            }
        };
        self.states = Some(all.detach());
        Ok(all)
    }

    /// Outside a graph: the chunk's states `(B, C, n)` written after the `before` held ones in
    /// this cache's own storage (grown by doubling, the held states copied once per growth),
    /// so a step copies its own states only. `None` when the held states do not continue
    /// (the checks and errors of [`Self::append_states`] then apply).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if the storage would pass [`crate::limits::max_elements`].
    fn write_states(&mut self, states: &Tensor, before: usize) -> Result<Option<Tensor>> {
        let (b, c, n) = states.dims3()?;
        let held = match (&self.states, before) {
            (_, 0) => None,
            (Some(h), _) if h.dims3()? == (b, c, before) && h.dtype() == states.dtype() => {
                Some(h.clone())
            }
            _ => return Ok(None),
        };
        let total = before + n;
        let fits = |store: &Tensor| -> Result<bool> {
            let (sb, sc, cap) = store.dims3()?;
            let backs = held
                .as_ref()
                .is_none_or(|h| crate::plug::shares_storage(h, store));
            Ok((sb, sc) == (b, c)
                && cap >= total
                && store.dtype() == states.dtype()
                && store.device().same_device(states.device())
                && backs)
        };
        let store = match &self.state_store {
            Some((store, owner)) if Arc::strong_count(owner) == 1 && fits(store)? => store.clone(),
            _ => {
                let most = max_elements() / b.saturating_mul(c).max(1);
                if total > most {
                    return Err(Error::config(
                        "cached tokens",
                        total,
                        format!(
                            "at most {most} token states of batch × channels = {}",
                            b * c
                        ),
                    ));
                }
                let capacity = total.saturating_mul(2).max(self.capacity).min(most);
                let store = Tensor::zeros((b, c, capacity), states.dtype(), states.device())?;
                if let Some(h) = &held {
                    store.slice_set(&h.contiguous()?, 2, 0)?;
                }
                self.state_store = Some((store.clone(), Arc::new(())));
                store
            }
        };
        if n > 0 {
            store.slice_set(&states.contiguous()?, 2, before)?;
        }
        let all = store.narrow(2, 0, total)?;
        self.states = Some(all.clone());
        Ok(Some(all))
    }

    /// Drops everything.
    pub fn reset(&mut self) {
        self.k = None;
        self.v = None;
        self.rotated = None;
        self.frame = None;
        self.start = 0;
        self.len = 0;
        self.positions = None;
        self.owner = Arc::new(());
        self.states = None;
        self.state_store = None;
        self.sums = false;
        self.conv = None;
        self.block = None;
    }

    /// Appends a chunk and returns every cached key and value with the keys' positions.
    ///
    /// # Errors
    /// [`Error::Shape`] for keys or values whose batch, heads or width differ from the cached
    /// ones; [`Error::DType`] for another dtype or device (an empty cache takes any);
    /// [`Error::InvalidConfig`] if the storage would pass [`crate::limits::max_elements`].
    pub(crate) fn append(
        &mut self,
        k: &Tensor,
        v: &Tensor,
        positions: &Positions,
    ) -> Result<(Tensor, Tensor, Positions)> {
        let (b, h, new_len, d) = k.dims4()?;
        if v.dims4()? != (b, h, new_len, d) {
            return Err(Error::shape(
                "values appended to the KV cache",
                format!("({b}, {h}, {new_len}, {d}) like the keys"),
                v.shape(),
            ));
        }
        // An empty cache (new, reset, or truncated to nothing) takes any chunk: storage left
        // from another batch, head layout, dtype or device is dropped, not matched.
        if self.len == 0 {
            if let Some(prev) = &self.k {
                let (pb, ph, _, pd) = prev.dims4()?;
                let same = (pb, ph, pd) == (b, h, d)
                    && prev.dtype() == k.dtype()
                    && prev.device().same_device(k.device());
                if !same {
                    self.k = None;
                    self.v = None;
                    self.rotated = None;
                }
            }
        }
        if let Some(prev) = &self.k {
            let (pb, ph, _, pd) = prev.dims4()?;
            if (pb, ph, pd) != (b, h, d) {
                return Err(Error::shape(
                    "keys appended to the KV cache",
                    format!("(batch {pb}, kv heads {ph}, T, head_dim {pd}) like the cached keys"),
                    k.shape(),
                ));
            }
            if prev.dtype() != k.dtype() || !prev.device().same_device(k.device()) {
                return Err(Error::DType {
                    what: "keys appended to the KV cache",
                    expected: "the dtype and device of the cached keys (reset the cache, or keep one per block)",
                    got: k.dtype(),
                });
            }
        }
        let all_positions = match &self.positions {
            None => positions.clone(),
            Some(p) => p.extend(self.len, positions, new_len, k.device())?,
        };
        let total = self.len.checked_add(new_len).ok_or_else(|| {
            Error::config(
                "cached tokens",
                self.len,
                "fewer than usize::MAX with the new chunk",
            )
        })?;
        self.reserve(total, (b, h, d), k)?;
        let (kb, vb) = match (&self.k, &self.v) {
            (Some(kb), Some(vb)) => (kb, vb),
            _ => return Err(no_storage()),
        };
        if new_len > 0 {
            kb.slice_set(&k.contiguous()?, 2, self.start + self.len)?;
            vb.slice_set(&v.contiguous()?, 2, self.start + self.len)?;
        }
        self.len = total;
        self.positions = Some(all_positions.clone());
        // The kept rotated keys lack this chunk's: the caller that keeps them writes them and
        // puts the frame back ([`Self::keep_rotated`]).
        self.frame = None;
        Ok((
            kb.narrow(2, self.start, total)?,
            vb.narrow(2, self.start, total)?,
            all_positions,
        ))
    }

    /// Forgets the tokens between the sinks and the window of a streaming cache (nothing for a
    /// plain one): the sinks move forward over the forgotten tokens, to the slots just before
    /// the window, which stays where it is (a copy of the sinks, not of the window).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if owning the storage (a clone shares it) would pass the
    /// budget; the cache is then unchanged.
    pub(crate) fn evict(&mut self) -> Result<()> {
        let Some((sinks, window)) = self.streaming else {
            return Ok(());
        };
        let keep = sinks.saturating_add(window);
        if self.len <= keep {
            return Ok(());
        }
        let Some(k) = &self.k else {
            return Ok(());
        };
        let (b, h, _, d) = k.dims4()?;
        let like = k.clone();
        // Own storage first (a clone may share it).
        self.reserve(self.len, (b, h, d), &like)?;
        let drop = self.len - keep;
        if let (Some(k), Some(v), true) = (&self.k, &self.v, sinks > 0) {
            for t in [k, v] {
                // A packed copy: the slots the sinks move to may overlap their own.
                let moved = t.narrow(2, self.start, sinks)?.force_contiguous()?;
                t.slice_set(&moved, 2, self.start + drop)?;
            }
        }
        if let Some(s) = self
            .states
            .as_ref()
            .filter(|s| s.dim(2).ok() == Some(self.len))
        {
            // The sinks' states, then the window's: moved within this cache's own storage
            // (a packed copy first: the slots may overlap), else into a fresh tensor.
            let window = s.narrow(2, self.len - (keep - sinks), keep - sinks)?;
            let window = match self.sums {
                true => without_forgotten(s, sinks, self.len - (keep - sinks), &window)?,
                false => window,
            };
            self.states = Some(match &self.state_store {
                Some((store, owner))
                    if Arc::strong_count(owner) == 1 && crate::plug::shares_storage(s, store) =>
                {
                    store.slice_set(&window.force_contiguous()?, 2, sinks)?;
                    store.narrow(2, 0, keep)?
                }
                _ => Tensor::cat(&[&s.narrow(2, 0, sinks)?, &window], 2)?,
            });
        }
        self.start += drop;
        self.len = keep;
        self.positions = Some(Positions::Offset(0));
        // The window moved `drop` slots towards the sinks; its kept rotated keys stay where
        // they were rotated, so the frame's offset grows by as much.
        if let Some(f) = &mut self.frame {
            f.shift = f.shift.saturating_add(drop);
        }
        Ok(())
    }

    /// The frame of the kept rotated keys ([`Frame`]), or `None` when they are all to be
    /// rotated again: none kept yet, a chunk appended without its rotated keys, or the
    /// window's offset grown past a quarter of the window (at least 16), so that the
    /// positions a rotation reads stay within `sinks + window + chunk + max(window / 4, 16)`.
    pub(crate) fn frame(&self) -> Option<Frame> {
        let bound = self.streaming.map_or(0, |(_, w)| (w / 4).max(16));
        self.frame.filter(|f| f.shift < bound)
    }

    /// Records where the kept rotated keys of every held token now sit.
    pub(crate) fn keep_frame(&mut self, frame: Frame) {
        self.frame = Some(frame);
    }

    /// The sinks a streaming cache holds now (at most its length).
    pub(crate) fn held_sinks(&self) -> usize {
        self.streaming.map_or(0, |(s, _)| s.min(self.len))
    }

    /// The unrotated keys of held slots `slots`, `(B, Hkv, n, D)` (a view of the storage).
    pub(crate) fn raw_keys(&self, slots: std::ops::Range<usize>) -> Result<Tensor> {
        let k = self.k.as_ref().ok_or_else(no_storage)?;
        Ok(k.narrow(2, self.start + slots.start, slots.len())?)
    }

    /// The kept rotated keys of every held token, `(B, Hkv, len, D)` (a view of the storage).
    pub(crate) fn rotated_keys(&self) -> Result<Tensor> {
        let r = self.rotated.as_ref().ok_or_else(no_storage)?;
        Ok(r.narrow(2, self.start, self.len)?)
    }

    /// Writes rotated keys `(B, Hkv, n, D)` at held slots `slot..slot + n`, making the buffer
    /// of kept rotated keys (as large as the unrotated one's) at the first write. Called after
    /// an append, which made the storage this cache's own.
    pub(crate) fn write_rotated(&mut self, slot: usize, keys: &Tensor) -> Result<()> {
        let k = self.k.as_ref().ok_or_else(no_storage)?;
        if self.rotated.is_none() {
            self.rotated = Some(Tensor::zeros(k.shape(), keys.dtype(), k.device())?);
        }
        let r = self.rotated.as_ref().ok_or_else(no_storage)?;
        r.slice_set(&keys.contiguous()?, 2, self.start + slot)?;
        Ok(())
    }

    /// Makes the buffers this cache's own and large enough for `needed` positions of
    /// `(b, h, ·, d)` in `like`'s dtype and device.
    fn reserve(
        &mut self,
        needed: usize,
        (b, h, d): (usize, usize, usize),
        like: &Tensor,
    ) -> Result<()> {
        let have = self.k.as_ref().map_or(Ok(0), |t| t.dim(2))?;
        let shared = Arc::strong_count(&self.owner) > 1;
        if self.start + needed <= have && !shared {
            return Ok(());
        }
        // Slots past a moved window's end: back to the front while a quarter of the storage
        // stays free (so moving is amortised over as many steps as it copies tokens).
        if needed.saturating_add(needed / 4) <= have && !shared {
            return self.compact();
        }
        let per_position = b.saturating_mul(h).saturating_mul(d).max(1);
        let budget = max_elements();
        let most = budget / per_position;
        if needed > most {
            return Err(Error::config(
                "cached tokens",
                needed,
                format!("at most {most} for batch × kv heads × head_dim = {per_position} (KV cache storage of at most {budget} elements)"),
            ));
        }
        // A quarter free past what is needed, so that a streaming window moves many steps
        // before it reaches the end again.
        let roomy = needed.saturating_add(needed / 4);
        let capacity = match roomy <= have {
            true => have,
            false => roomy
                .max(have.saturating_mul(2))
                .max(self.capacity)
                .min(most)
                .max(needed),
        };
        let grow = |old: &Option<Tensor>| -> Result<Tensor> {
            let fresh = Tensor::zeros((b, h, capacity, d), like.dtype(), like.device())?;
            if let Some(old) = old {
                if self.len > 0 {
                    let held = old.narrow(2, self.start, self.len)?;
                    fresh.slice_set(&held.contiguous()?, 2, 0)?;
                }
            }
            Ok(fresh)
        };
        let (k, v) = (grow(&self.k)?, grow(&self.v)?);
        let rotated = match &self.rotated {
            Some(_) => Some(grow(&self.rotated)?),
            None => None,
        };
        self.k = Some(k);
        self.v = Some(v);
        self.rotated = rotated;
        self.start = 0;
        self.owner = Arc::new(());
        Ok(())
    }

    /// The held slots moved back to the front of this cache's own storage.
    fn compact(&mut self) -> Result<()> {
        if self.start == 0 {
            return Ok(());
        }
        if let (Some(k), Some(v)) = (&self.k, &self.v) {
            for t in [Some(k), Some(v), self.rotated.as_ref()]
                .into_iter()
                .flatten()
            {
                if self.len > 0 {
                    let held = t.narrow(2, self.start, self.len)?.force_contiguous()?;
                    t.slice_set(&held, 2, 0)?;
                }
            }
        }
        self.start = 0;
        Ok(())
    }
}

/// Running sums `window` of the held states `s` `(B, C, len)` with the terms of the forgotten
/// tokens `sinks..first` taken out: less `s[first − 1] − s[sinks − 1]` (`s[−1] = 0`), so that
/// the first kept token after the sinks continues the sinks' sum.
fn without_forgotten(s: &Tensor, sinks: usize, first: usize, window: &Tensor) -> Result<Tensor> {
    let mut forgotten = s.narrow(2, first - 1, 1)?;
    if sinks > 0 {
        forgotten = (forgotten - s.narrow(2, sinks - 1, 1)?)?;
    }
    Ok(window.broadcast_sub(&forgotten)?)
}

/// The error for storage that should be there (after an append) and is not.
fn no_storage() -> Error {
    Error::config("KV cache", "no storage", "storage after an append")
}

/// Where a streaming cache's kept rotated keys sit. The block keeps them for encodings whose
/// rotation depends on positions only through their differences
/// ([`PositionalEncoding::relative_rotation`](crate::PositionalEncoding::relative_rotation)):
/// held token `j` (slot `j`) is rotated at position `j + shift`, so the logits are those of
/// every token rotated at its slot, as the cache's definition says, while a decoding step
/// rotates only its own token and the sinks. Evicting `n` tokens moves the window `n` slots
/// towards the sinks and adds `n` to `shift`; the sinks, which stay at slots `0..sinks`, are
/// rotated again when `sinks_shift` falls behind `shift`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Frame {
    /// Added to a held token's slot to give the position it is rotated at.
    pub(crate) shift: usize,
    /// The `shift` the kept rotated sinks were rotated with.
    pub(crate) sinks_shift: usize,
}

/// A call's KV cache, put back as it was when the guard drops uncommitted: a chunk that fails
/// at any stage after the cache is opened leaves nothing of itself in the cache.
pub(crate) struct CacheGuard<'c> {
    cache: Option<&'c mut KvCache>,
    mark: Option<Mark>,
}

impl<'c> CacheGuard<'c> {
    /// Opens `cache` (if any) for one chunk, remembering its state.
    pub(crate) fn open(cache: Option<&'c mut KvCache>) -> Self {
        let mark = cache.as_ref().map(|c| c.mark());
        Self { cache, mark }
    }

    /// The cache, to append to.
    pub(crate) fn get(&mut self) -> Option<&mut KvCache> {
        self.cache.as_deref_mut()
    }

    /// Keeps the chunk, as `block`'s: a streaming cache forgets what falls between its sinks
    /// and its window. If that fails, the cache is put back.
    pub(crate) fn commit(mut self, block: BlockId) -> Result<()> {
        if let Some(cache) = self.cache.as_deref_mut() {
            cache.evict()?;
            cache.block = Some(block);
        }
        self.mark = None;
        Ok(())
    }
}

impl Drop for CacheGuard<'_> {
    fn drop(&mut self) {
        if let (Some(cache), Some(mark)) = (self.cache.as_deref_mut(), self.mark.take()) {
            cache.restore(mark);
        }
    }
}
