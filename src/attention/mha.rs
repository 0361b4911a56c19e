//! Multi-head attention with grouped KV heads, masks, a KV cache and the positional plug.
//!
//! ```text
//! x' = enc.add_to_input(x)
//! q = x' W_qᵀ, k = x' W_kᵀ, v = x' W_vᵀ              split into H (q) and Hkv (k, v) heads
//! k, v = k + conv_k(k), v + conv_v(v)                short causal convolutions, when configured
//! q, k = q_norm(q), k_norm(k)                        when configured (RMS, per head or all)
//! q, k = enc.rotate(q, k)
//! q = q · (1 + s·ln(1 + ⌊(p + 1)/f⌋))                attention temperature, when configured
//! k, v = cache.append(k, v)                          keys rotated once, at their own position
//! s = cap((scale · q) kᵀ) + enc.logits_bias(scale · q) + attn_mask,   masked where causal,
//!                                                    outside the window or chunk, or padding
//! α = softmax(s ‖ sink_h)[..Tk],  out = α v + Σ_j α_ij enc.value_term[c(i, j)],   heads merged, W_o
//! ```
//!
//! # Shapes
//! - `x`: `(B, T, d_model)`; output `(B, T, d_model)`; weights `(B, H, T, T_keys)`.
//!
//! The forward is a pipeline; the query blocks and the four execution paths (fused core, row
//! pass, fused training core, plain ops) live in `blocks.rs`, chosen once per call.
//!
//! Weights are named like HF Llama (`q_proj`, `k_proj`, `v_proj`, `o_proj`, each with `weight`
//! and optional `bias`; `q_norm` and `k_norm` with `weight` when the queries and keys are
//! normalised; `sinks` with sink logits), so such checkpoints load through a `VarBuilder` prefix; other families' names
//! and fused layouts load through [`crate::hf`].
//! Reference: Vaswani et al. 2017; grouped-query attention: Ainslie et al. 2023.

use std::sync::Arc;

use candle_core::{DType, Module, Tensor};
use candle_nn::{linear_b, Linear, VarBuilder};

use super::blocks::Chunk;
use super::config::{AttentionConfig, AttentionOptions, AttentionOutput};
use super::dropout::{fresh_seed, Dropout};
use super::fused_softmax::RowRule;
use super::kv_cache::{BlockId, CacheGuard, KvCache};
use super::latent::LatentProjections;
use super::mask::check_padding;
use super::projection::{self, parts};
use super::qk_norm::{rms_normalized, QkNorm};
use super::short_conv::{ConvState, ShortConvs};
use super::streaming;
use super::{one_pass, train_node};
use crate::cpu::linear_node::{self, Arrange};
use crate::cpu::pool::on_pool;
use crate::error::{
    check_device, check_factor, check_float, check_var_builder, is_float, learned, Error, Result,
};
use crate::graft::{graft, GraftBackward};
use crate::limits::check_elements;
use crate::plug::{
    check_input_answer, shares_storage, AttentionContext, Content, PositionalEncoding,
};
use crate::positions::Positions;

/// Multi-head self-attention that consumes any [`PositionalEncoding`].
///
/// An absolute encoding (sinusoidal, learned) given to the block enters through its input hook:
/// the block adds the positions to its own input, so every block that holds one adds them
/// again. Models with absolute positions (GPT-2, BERT) add them once, at the input layer
/// ([`Embeddings`](crate::absolute::embeddings::Embeddings)), and give the blocks no encoding.
///
/// # Example
/// ```
/// use std::sync::Arc;
/// use candle_core::{Device, DType, Module, Tensor};
/// use candle_nn::{VarBuilder, VarMap};
/// use candle_posenc::{AttentionConfig, MultiHeadAttention, SinusoidalConfig, SinusoidalPositionalEncoding};
///
/// let dev = Device::Cpu;
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
/// let pe = SinusoidalPositionalEncoding::new(&SinusoidalConfig::new(32), &dev)?;
/// let cfg = AttentionConfig::new(32, 4).with_kv_heads(2).with_causal(true);
/// let mha = MultiHeadAttention::new(&cfg, Some(Arc::new(pe)), vb.pp("self_attn"))?;
/// let x = Tensor::randn(0f32, 1.0, (2, 7, 32), &dev)?;
/// assert_eq!(mha.forward(&x)?.dims(), &[2, 7, 32]);
/// # Ok::<(), candle_posenc::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct MultiHeadAttention {
    config: AttentionConfig,
    projections: Projections,
    o_proj: Linear,
    qk_norm: Option<QkNorm>,
    /// Short convolutions on the keys and values.
    short_conv: Option<ShortConvs>,
    /// `(H)` learned sink logits.
    sinks: Option<Tensor>,
    encoding: Option<Arc<dyn PositionalEncoding>>,
    /// Whether a call may run as one node or one pass ([`train_node`], [`one_pass`]); off
    /// only in tests that compare them with the pipeline.
    one_node: bool,
    /// Which block a cache was filled by (a clone is the same block; another encoding is not).
    id: BlockId,
}

/// Where q, k and v come from.
#[derive(Debug, Clone)]
enum Projections {
    /// `q_proj`, `k_proj`, `v_proj` (none when the values are the key projection).
    Separate {
        q: Linear,
        k: Linear,
        v: Option<Linear>,
    },
    /// Multi-head latent attention's low-rank projections.
    Latent(LatentProjections),
}

impl MultiHeadAttention {
    /// Loads (or creates) the four projections from `vb` and plugs in `encoding`.
    ///
    /// # Errors
    /// As [`AttentionConfig::validate`]; [`Error::InvalidConfig`] for a factor that multiplies
    /// the activations (the softmax scale, the attention temperature's largest factor) past
    /// the largest finite value of the weights' dtype, or, with f16 weights, a scale ×
    /// temperature × head_dim past 2^8; [`Error::MissingTensor`] /
    /// [`Error::TensorShape`] for checkpoint tensors that are absent or misshapen;
    /// [`Error::DType`] for a `VarBuilder` that is not f32, f64, bf16 or f16, or a tensor it
    /// hands back in another dtype (a `VarMap` holds its variables in their own).
    pub fn new(
        config: &AttentionConfig,
        encoding: Option<Arc<dyn PositionalEncoding>>,
        vb: VarBuilder,
    ) -> Result<Self> {
        config.validate()?;
        check_var_builder("attention weights (the VarBuilder's dtype)", &vb)?;
        check_factors(config, vb.dtype())?;
        let (d, hd) = (config.d_model, config.head_dim);
        let (projections, values) = match &config.latent {
            None => (
                Projections::Separate {
                    q: linear_b(d, config.num_heads * hd, config.bias, vb.pp("q_proj"))?,
                    k: linear_b(d, config.num_kv_heads * hd, config.bias, vb.pp("k_proj"))?,
                    v: match config.k_eq_v {
                        true => None,
                        false => Some(linear_b(
                            d,
                            config.num_kv_heads * hd,
                            config.bias,
                            vb.pp("v_proj"),
                        )?),
                    },
                },
                hd,
            ),
            Some(latent) => (
                Projections::Latent(LatentProjections::new(
                    latent,
                    (d, config.num_heads, hd),
                    config.bias,
                    &vb,
                )?),
                latent.v_head_dim,
            ),
        };
        let o_proj = linear_b(
            config.num_heads * values,
            d,
            config.out_bias,
            vb.pp("o_proj"),
        )?;
        let qk_norm = config
            .qk_norm
            .as_ref()
            .map(|norm| QkNorm::new(norm, (config.num_heads, config.num_kv_heads, hd), &vb))
            .transpose()?;
        let short_conv = config
            .short_conv
            .map(|taps| ShortConvs::new(taps, config.num_kv_heads * hd, &vb))
            .transpose()?;
        let sinks = match config.sinks {
            true => Some(learned(
                &vb,
                "sink logits",
                config.num_heads,
                "sinks",
                candle_nn::Init::Const(0.0),
            )?),
            false => None,
        };
        let block = Self {
            config: config.clone(),
            projections,
            o_proj,
            qk_norm,
            short_conv,
            sinks,
            encoding,
            one_node: true,
            id: BlockId::fresh(),
        };
        // A `VarMap` hands back a variable it already holds in the variable's own dtype.
        for t in block.held() {
            check_float("attention weight held by the VarBuilder", t.dtype())?;
        }
        Ok(block)
    }

    /// The configuration.
    pub fn config(&self) -> &AttentionConfig {
        &self.config
    }

    /// The plugged-in encoding.
    pub fn encoding(&self) -> Option<&Arc<dyn PositionalEncoding>> {
        self.encoding.as_ref()
    }

    /// Replaces the encoding (the projections are kept).
    ///
    /// The block is then another one for a [`KvCache`]: the keys it caches are rotated by the
    /// new encoding.
    pub fn with_encoding(mut self, encoding: Option<Arc<dyn PositionalEncoding>>) -> Self {
        self.encoding = encoding;
        self.id = BlockId::fresh();
        self
    }

    /// The block with every call run through its pipeline, never as one node of the graph
    /// or one pass (for tests that compare them).
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn without_one_node(mut self) -> Self {
        self.one_node = false;
        self
    }

    /// Attention over `x` with positions, masks, an optional cache, and optional weights.
    ///
    /// With a cache, the chunk's keys and values are appended first and the queries attend to
    /// every cached key; feeding a sequence token by token gives the same outputs as one call on
    /// the whole sequence, except under a RoPE whose frequencies follow the call's length
    /// (Dynamic NTK, LongRoPE past its original length), where cached keys keep the rotation of
    /// the call that made them, as in HF transformers. A call that returns an error leaves the
    /// cache as it was.
    ///
    /// # Shapes
    /// `x`: `(B, T, d_model)` → output `(B, T, d_model)`, weights `(B, H, T, T_keys)`.
    ///
    /// # Errors
    /// [`Error::Rank`] / [`Error::Shape`] for a malformed input, positions, mask or cache
    /// chunk, or for an encoding's answer that does not fit the block; [`Error::DType`] for an
    /// input whose dtype is not the weights'; [`Error::InvalidConfig`] if the logits (batch ×
    /// heads × queries × keys), the projections of the chunk (batch × queries × the widest
    /// per-token width) or the keys with the cache (batch × KV heads × keys × head_dim) would
    /// pass [`crate::limits::max_elements`] (an empty batch counted as one sequence);
    /// [`Error::Device`]
    /// for an input, mask or position ids on another device than the block's weights; the
    /// encoding's own errors (e.g. [`Error::PositionOutOfRange`]).
    pub fn forward_with(
        &self,
        x: &Tensor,
        options: &AttentionOptions,
        cache: Option<&mut KvCache>,
    ) -> Result<AttentionOutput> {
        // On the CPU the call runs on rayon's pool, whose threads fork its stages cheaply;
        // other devices launch their kernels from the calling thread.
        match x.device().is_cpu() {
            true => on_pool(|| self.forward_on(x, options, cache)),
            false => self.forward_on(x, options, cache),
        }
    }

    /// [`Self::forward_with`] on the thread it runs on.
    fn forward_on(
        &self,
        x: &Tensor,
        options: &AttentionOptions,
        cache: Option<&mut KvCache>,
    ) -> Result<AttentionOutput> {
        let call = self.check_call(x, options, cache.as_deref())?;
        if call.is_empty() {
            return self.empty_output(call.full, x, options.return_weights);
        }
        let ctx = AttentionContext::chunk(&call.positions, call.t)
            .with_causal(self.config.causal)
            .with_train(options.train)
            .with_sinks(self.config.sinks);
        let input = x;
        let x = self.add_positions(x, &ctx, call.streaming)?;
        if let Some(output) = self.one_node(&x, &call, options, cache.is_some())? {
            return Ok(AttentionOutput {
                output,
                weights: None,
            });
        }
        let differentiable = self.differentiable(&x, options);
        let mut cache = CacheGuard::open(cache);
        let conv = self.conv_input(&call, cache.get().map(|c| &*c))?;
        let (q, k, v, conv_state, q_scaled) = self.project(&x, differentiable, conv)?;
        if let (Some(state), Some(cache)) = (conv_state, cache.get()) {
            cache.set_conv_state(state);
        }
        let fresh = self.token_states(input, &ctx, cache.get().map(|c| &*c))?;
        let (q, k, v, k_positions) = self.rotate_and_cache(q, k, v, &call, &ctx, cache.get())?;
        let states = match (fresh, cache.get()) {
            (Some(fresh), Some(cache)) => {
                let sums = self
                    .encoding
                    .as_ref()
                    .is_some_and(|e| e.content() == Content::RunningSums);
                Some(cache.append_states(&fresh, sums)?)
            }
            (fresh, _) => fresh,
        };
        let dtype = v.dtype();
        let q = self.temper_queries(q, &call)?;
        let mut chunk = self.chunk(&call, (q, k, v), &k_positions, differentiable, options);
        chunk.states = states;
        chunk.q_scaled = q_scaled;
        let attended = chunk.attend()?;
        let heads = attended.out.to_dtype(dtype)?;
        let output = self.merge_and_project(&heads, (call.b, call.t), differentiable)?;
        cache.commit(self.id)?;
        Ok(AttentionOutput {
            output,
            weights: attended.weights,
        })
    }

    /// The first stage of a call: the input, positions, masks and the budget checked, before
    /// anything is computed.
    fn check_call(
        &self,
        x: &Tensor,
        options: &AttentionOptions,
        cache: Option<&KvCache>,
    ) -> Result<Call> {
        if let Some(c) = cache {
            c.check_block(self.id)?;
        }
        let streaming = cache.is_some_and(|c| c.streaming_window().is_some());
        if streaming && options.positions.is_some() {
            return Err(Error::config(
                "positions",
                "given",
                "none with a streaming KV cache, which places tokens at their cache slots",
            ));
        }
        let positions = match options.positions {
            Some(p) => p.clone(),
            // Each sequence continues where the cache's left it.
            None => match cache {
                Some(c) => c.continuation(x.dims().get(1).copied().unwrap_or(0))?,
                None => Positions::Offset(0),
            },
        };
        let (b, t) = self.check_input(x, &positions)?;
        let cached = cache.map_or(0, KvCache::len);
        let tk = cached.saturating_add(t);
        let block = self.check_logits(b, t, tk, options.return_weights)?;
        self.check_activations(b, t, tk)?;
        let full = (b, self.config.num_heads, t, tk);
        let attn_mask = self.attn_mask(options, full)?;
        let padding = options
            .padding_mask
            .map(|p| {
                check_device("padding mask", p, x.device())?;
                check_padding(p, b, tk)
            })
            .transpose()?;
        Ok(Call {
            positions,
            streaming,
            b,
            t,
            cached,
            full,
            block,
            attn_mask,
            padding,
        })
    }

    /// The input with the encoding's positions added (an input hook's answer, checked).
    fn add_positions(&self, x: &Tensor, ctx: &AttentionContext, streaming: bool) -> Result<Tensor> {
        let Some(e) = self.encoding.as_deref() else {
            return Ok(x.clone());
        };
        let added = packed(check_input_answer(e.add_to_input(x, ctx)?, x)?)?;
        // A streaming cache moves its tokens to new slots as it evicts, and only keys and
        // biases can follow them: a position added to the input stays in the token's key
        // (every token past the window would arrive at the same slot).
        if streaming && !shares_storage(&added, x) {
            return Err(Error::config(
                "KV cache",
                "streaming",
                "a plain cache with an encoding added to the input (sinusoidal, learned): \
                 a streaming cache places tokens at slots that move as it evicts",
            ));
        }
        Ok(added)
    }

    /// What the short convolutions read besides the chunk, when the block has them: the
    /// state the cache holds and the chunk's part of the padding mask.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a cache that holds tokens without a convolution state
    /// (filled by a block without short convolutions).
    fn conv_input(&self, call: &Call, cache: Option<&KvCache>) -> Result<Option<ConvInput>> {
        if self.short_conv.is_none() {
            return Ok(None);
        }
        // The state continues the tokens seen, which a streaming cache may hold none of.
        let state = match cache.map(|c| (c.conv_state(), c.is_empty())) {
            Some((Some(state), _)) => Some(state.clone()),
            Some((None, false)) => {
                return Err(Error::config(
                    "KV cache",
                    "tokens held without a short convolution state",
                    "a cache filled by this block (its keys and values are convolved over \
                     the tokens before the chunk)",
                ))
            }
            _ => None,
        };
        let keep = call
            .padding
            .as_ref()
            .map(|p| p.narrow(1, call.cached, call.t))
            .transpose()?;
        Ok(Some(ConvInput { state, keep }))
    }

    /// The per-token states of the chunk's tokens, for an encoding that reads the block's
    /// `input` ([`Content::Input`]), continuing those of the tokens `cache` holds: checked to
    /// be `(B, C, T)` floats on the block's device, with as many channels as the held ones.
    fn token_states(
        &self,
        input: &Tensor,
        ctx: &AttentionContext,
        cache: Option<&KvCache>,
    ) -> Result<Option<Tensor>> {
        let Some(e) = self.encoding.as_deref() else {
            return Ok(None);
        };
        if !e.content().reads_input() {
            return Ok(None);
        }
        let carried = cache.and_then(KvCache::states);
        let Some(states) = e.token_states(input, carried, ctx)? else {
            return Ok(None);
        };
        let what = "token states (the content hook's answer)";
        let (b, t, _) = input.dims3()?;
        let channels = carried.map(|c| c.dim(1)).transpose()?;
        let fits = states.rank() == 3
            && states.dim(0)? == b
            && states.dim(2)? == t
            && channels.is_none_or(|c| states.dim(1).ok() == Some(c));
        if !fits {
            let c = channels.map_or("C".to_string(), |c| c.to_string());
            return Err(Error::shape(
                what,
                format!("({b}, {c}, {t}) = (batch, channels, the chunk's tokens)"),
                states.shape(),
            ));
        }
        check_float(what, states.dtype())?;
        check_device(what, &states, input.device())?;
        Ok(Some(states))
    }

    /// The call as one node of candle's graph ([`train_node`]) where it keeps gradients, or
    /// as one pass over buffers kept across calls ([`one_pass`]) where it does not, when it
    /// runs on the CPU in f32 and nothing sits between the three projections and the core but
    /// a rotation that declares its adjoint: no other encoding (one added to the input is in
    /// `x`, which has its positions), norm, convolution, temperature, user's mask, cache or
    /// returned weights. `None` elsewhere (and where the node or the pass does not take the
    /// weights): the pipeline runs.
    fn one_node(
        &self,
        x: &Tensor,
        call: &Call,
        options: &AttentionOptions,
        cached: bool,
    ) -> Result<Option<Tensor>> {
        let cfg = &self.config;
        let Projections::Separate { q, k, v: Some(v) } = &self.projections else {
            return Ok(None);
        };
        let rotation = match &self.encoding {
            Some(e) if e.rotation_only() => Some(train_node::Rotation {
                encoding: e.clone(),
                positions: call.positions.clone(),
                causal: cfg.causal,
                train: options.train,
                sinks: cfg.sinks,
            }),
            _ => None,
        };
        // An encoding added to the input is in `x` already.
        let acts_between = self.encoding.as_ref().is_some_and(|e| !e.input_only());
        let between = (acts_between && rotation.is_none())
            || self.qk_norm.is_some()
            || cfg.value_norm.is_some()
            || self.short_conv.is_some()
            || cfg.attention_temperature.is_some();
        let call_needs = cached
            || call.attn_mask.is_some()
            || options.return_weights
            || !x.device().is_cpu()
            || x.dtype() != DType::F32;
        if !self.one_node || between || call_needs {
            return Ok(None);
        }
        let sinks = self
            .sinks
            .as_ref()
            .map(|s| s.to_dtype(DType::F32)?.to_vec1::<f32>())
            .transpose()?;
        let rule = RowRule {
            first: 0,
            causal: cfg.causal,
            window: cfg.sliding_window,
            chunk: cfg.attention_chunk,
            softcap: cfg.logit_softcap.map(|c| c as f32),
            sinks,
        };
        let dropout = (options.train && cfg.dropout > 0.0).then(|| Dropout {
            p: cfg.dropout,
            seed: options.dropout_seed.unwrap_or_else(fresh_seed),
        });
        let parts = train_node::Parts {
            x,
            linears: [q, k, v, &self.o_proj],
            heads: (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
            q_scale: cfg.softmax_scale as f32,
            padding: call.padding.as_ref(),
            rule,
            sinks: self.sinks.as_ref(),
            dropout,
            rotation,
        };
        match self.differentiable(x, options) {
            true => train_node::forward(parts),
            false => one_pass::forward(&parts),
        }
    }

    /// Whether the call keeps gradients: whenever anything upstream tracks them (the input,
    /// the weights, an encoding's parameters, a user's mask), whatever the entry point; only
    /// then do q, k and v stay in the graph. (The inference paths read a mask as a constant:
    /// a mask learned beside a frozen block would silently get no gradient.)
    fn differentiable(&self, x: &Tensor, options: &AttentionOptions) -> bool {
        options.train
            || x.track_op()
            || self.weights_track()
            || options.attn_mask.is_some_and(Tensor::track_op)
    }

    /// Queries and keys rotated, and the chunk's keys and values appended to the cache:
    /// q `(B, H, T, D)`, every key and value `(B, Hkv, Tk, D)`, and the keys' positions. A
    /// plain cache keeps rotated keys; a streaming one keeps them unrotated, and either keeps
    /// them rotated in a frame as well (`streaming`, for rotations that read only position
    /// differences) or rotates all of them at their slots.
    fn rotate_and_cache(
        &self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        call: &Call,
        ctx: &AttentionContext,
        cache: Option<&mut KvCache>,
    ) -> Result<(Tensor, Tensor, Tensor, Positions)> {
        let (b, t) = (call.b, call.t);
        let enc = self.encoding.as_deref();
        match (cache, enc) {
            (Some(cache), Some(e)) if call.streaming && e.relative_rotation() => {
                let rotate =
                    |q, k, (qp, qn): (&Positions, usize), (kp, kn): (&Positions, usize)| {
                        let ctx = AttentionContext::new(qp, qn, kp, kn)
                            .with_causal(self.config.causal)
                            .with_train(ctx.train)
                            .with_sinks(self.config.sinks);
                        self.check_rotated(e.rotate(q, k, &ctx)?, (b, qn, kn))
                    };
                streaming::append(cache, (q, k, v), &call.positions, &rotate)
            }
            (Some(cache), enc) if call.streaming => {
                let (k, v, k_positions) = cache.append(&k, &v, &call.positions)?;
                let (q, k) = match enc {
                    Some(e) => {
                        let tk = call.full.3;
                        let all = AttentionContext::new(&call.positions, t, &k_positions, tk)
                            .with_causal(self.config.causal)
                            .with_train(ctx.train)
                            .with_sinks(self.config.sinks);
                        // A packed copy of the keys held (not `copy`, which clones the cache's
                        // whole storage): the rotation may run in place, and the cache keeps
                        // its keys unrotated.
                        self.check_rotated(e.rotate(q, k.force_contiguous()?, &all)?, (b, t, tk))?
                    }
                    None => (q, k),
                };
                Ok((q, k, v, k_positions))
            }
            (cache, enc) => {
                let (q, k) = match enc {
                    Some(e) => self.check_rotated(e.rotate(q, k, ctx)?, (b, t, t))?,
                    None => (q, k),
                };
                match cache {
                    Some(cache) => {
                        let (k, v, p) = cache.append(&k, &v, &call.positions)?;
                        Ok((q, k, v, p))
                    }
                    None => Ok((q, k, v, call.positions.clone())),
                }
            }
        }
    }

    /// The queries under the attention temperature, when the block has one (the softmax scale
    /// is the plan's, applied in the dtype its path computes in).
    fn temper_queries(&self, q: Tensor, call: &Call) -> Result<Tensor> {
        Ok(match &self.config.attention_temperature {
            // The chunk's first query sits at key index `cached`.
            Some(t) => t.apply(q, call.cached)?,
            None => q,
        })
    }

    /// The chunk as the execution paths take it.
    fn chunk<'a>(
        &'a self,
        call: &'a Call,
        (q, k, v): (Tensor, Tensor, Tensor),
        k_positions: &'a Positions,
        differentiable: bool,
        options: &AttentionOptions,
    ) -> Chunk<'a> {
        let cfg = &self.config;
        Chunk {
            attn_mask: call.attn_mask.clone(),
            padding: call.padding.clone(),
            q,
            k,
            v,
            // (Latent attention's values are v_head_dim wide, padded to the heads.)
            scale: cfg.softmax_scale,
            q_scaled: false,
            value_dim: cfg.latent.map_or(cfg.head_dim, |l| l.v_head_dim),
            q_positions: &call.positions,
            k_positions,
            causal: cfg.causal,
            window: cfg.sliding_window,
            chunk: cfg.attention_chunk,
            softcap: cfg.logit_softcap,
            sinks: self.sinks.as_ref(),
            train: options.train,
            differentiable,
            dropout: cfg.dropout,
            dropout_seed: options
                .dropout_seed
                .unwrap_or_else(super::dropout::fresh_seed),
            block: call.block,
            logits_budget: cfg.logits_budget,
            return_weights: options.return_weights,
            encoding: self.encoding.as_deref(),
            states: None,
        }
    }

    /// The heads of the core's output merged and projected to `(B, T, d_model)`.
    fn merge_and_project(
        &self,
        heads: &Tensor,
        (b, t): (usize, usize),
        differentiable: bool,
    ) -> Result<Tensor> {
        let merged = match &self.projections {
            Projections::Latent(latent) => latent.values_of(heads)?,
            Projections::Separate { .. } => heads.clone(),
        };
        // Training on the CPU in f32: the output projection as one node of the graph, reading
        // the heads `(B, T, H, D)` as rows of H·D.
        let node = match differentiable {
            true => linear_node::linear(&self.o_proj, &merged, Arrange::Rows(vec![b, t]))?,
            false => None,
        };
        match node {
            Some(output) => Ok(output),
            None => projection::linear(&self.o_proj, &merged.reshape((b, t, ()))?),
        }
    }

    /// Checks `x` and its positions against the block; returns `(B, T)`.
    fn check_input(&self, x: &Tensor, positions: &Positions) -> Result<(usize, usize)> {
        let (b, t) = positions.check_input(x, self.config.d_model, "attention input x")?;
        check_device("attention input x", x, self.o_proj.weight().device())?;
        let weights = self.o_proj.weight().dtype();
        if x.dtype() != weights {
            return Err(Error::DType {
                what: "attention input x",
                expected: match weights {
                    DType::F32 => "f32, the dtype of the attention weights",
                    DType::F64 => "f64, the dtype of the attention weights",
                    DType::BF16 => "bf16, the dtype of the attention weights",
                    DType::F16 => "f16, the dtype of the attention weights",
                    _ => "the dtype of the attention weights",
                },
                got: x.dtype(),
            });
        }
        Ok((b, t))
    }

    /// Queries per block for `t` queries against `tk` keys, after checking that one block's
    /// logits (all queries' when the weights are returned) can be allocated.
    fn check_logits(&self, b: usize, t: usize, tk: usize, weights: bool) -> Result<usize> {
        let cfg = &self.config;
        // The logits are f32 at least on every path (a half block's widened with its terms).
        let elem = self.o_proj.weight().dtype().size_in_bytes().max(4);
        let block = cfg.query_block_for(b, t, tk, elem);
        let rows = if weights { t } else { block };
        check_elements(
            "sequence length",
            t,
            format_args!(
                "batch ({b}) × heads ({}) × queries per block ({rows}) × keys ({tk}) of the attention logits",
                cfg.num_heads
            ),
            // An empty batch is checked as one sequence: its shapes still need strides that fit.
            &[b.max(1), cfg.num_heads, rows, tk],
        )?;
        Ok(block)
    }

    /// Checks that the tensors of one call that grow with its tokens can be allocated: the
    /// queries and every per-token projection `(B, T, width)` (the heads' `H · head_dim`, and
    /// latent attention's low-rank activations), the keys and values with the cache
    /// `(B, Hkv, T_keys, head_dim)`, and the output `(B, T, d_model)`. Each is what a few
    /// more tensors of the same size hold too (rotated, normalised, scaled copies), so the
    /// peak memory of a call stays a small multiple of [`crate::limits::max_elements`].
    fn check_activations(&self, b: usize, t: usize, tk: usize) -> Result<()> {
        let cfg = &self.config;
        // Latent attention expands its keys and values to every query head.
        let (width, kv_heads) = match &self.projections {
            Projections::Latent(latent) => (latent.widest_per_token(), cfg.num_heads),
            Projections::Separate { .. } => {
                (cfg.num_heads.saturating_mul(cfg.head_dim), cfg.num_kv_heads)
            }
        };
        let width = width.max(cfg.d_model);
        check_elements(
            "sequence length",
            t,
            format_args!("batch ({b}) × queries × the widest per-token projection ({width})"),
            &[b.max(1), t, width],
        )?;
        check_elements(
            "sequence length",
            t,
            format_args!(
                "batch ({b}) × KV heads ({kv_heads}) × keys with the cache ({tk}) × head_dim ({})",
                cfg.head_dim
            ),
            &[b.max(1), kv_heads, tk, cfg.head_dim],
        )?;
        Ok(())
    }

    /// The output of a chunk with no query or no sequence: empty, shaped as `full` =
    /// `(B, H, T, T_keys)` says (candle's linear layers cannot reshape an empty chunk), and
    /// nothing is appended to the cache.
    fn empty_output(
        &self,
        (b, h, t, tk): (usize, usize, usize, usize),
        x: &Tensor,
        weights: bool,
    ) -> Result<AttentionOutput> {
        let empty = |shape: &[usize]| Tensor::zeros(shape, x.dtype(), x.device());
        Ok(AttentionOutput {
            output: empty(&[b, t, self.config.d_model])?,
            weights: match weights {
                true => Some(empty(&[b, h, t, tk])?),
                false => None,
            },
        })
    }

    /// Every tensor the block holds: projection weights and biases, query/key norm scales,
    /// sink logits.
    fn held(&self) -> Vec<&Tensor> {
        let mut held: Vec<&Tensor> = match &self.projections {
            Projections::Separate { q, k, v } => parts(q)
                .chain(parts(k))
                .chain(v.iter().flat_map(parts))
                .collect(),
            Projections::Latent(latent) => latent.held(),
        };
        held.extend(parts(&self.o_proj));
        held.extend(self.qk_norm.iter().flat_map(QkNorm::held));
        held.extend(self.short_conv.iter().flat_map(ShortConvs::held));
        held.extend(&self.sinks);
        held
    }

    /// Whether any tensor the block holds tracks gradients (a `VarMap` variable).
    fn weights_track(&self) -> bool {
        self.held().into_iter().any(Tensor::track_op)
    }

    /// The projections split into heads (keys and values convolved, queries and keys
    /// normalised, when configured): q `(B, H, T, D)`, k and v `(B, Hkv, T, D)`, and the
    /// convolutions' state after the chunk, and whether q comes scaled by the softmax scale.
    /// Unless `differentiable`, they leave the graph, so they can be rotated and normalised in
    /// place.
    fn project(
        &self,
        x: &Tensor,
        differentiable: bool,
        conv: Option<ConvInput>,
    ) -> Result<Projected> {
        let cfg = &self.config;
        let (q, k, v) = match &self.projections {
            Projections::Separate { q, k, v } => (q, k, v),
            Projections::Latent(latent) => {
                let (q, k, v) = latent.project(x)?;
                let keep = |y: Tensor| if differentiable { y } else { y.detach() };
                return Ok((keep(q), keep(k), keep(v), None, false));
            }
        };
        // On the CPU in f32 without norms: each projection written heads first by `gemm` and
        // one pass (no copy of the rows), as one node of the graph when training. A few rows
        // (a decoding step) take the one pass over all three weights below instead.
        let rows = x.elem_count() / x.dims().last().copied().unwrap_or(1).max(1);
        let nodes = differentiable || rows > projection::FEW_ROWS;
        let plain = self.qk_norm.is_none() && cfg.value_norm.is_none() && conv.is_none();
        if nodes && plain {
            // The softmax scale taken into the queries' node, where what follows is linear
            // in q (no encoding, or one that declares it): one pass and one node fewer.
            let scale = match self.encoding.as_deref() {
                None => cfg.softmax_scale as f32,
                Some(e) if e.scaled_queries() => cfg.softmax_scale as f32,
                Some(_) => 1.0,
            };
            if let Some((q, k, v)) = self.project_nodes(x, (q, k, v.as_ref()), scale)? {
                return Ok((q, k, v, None, scale != 1.0));
            }
        }
        // `norm`: Some(false) queries, Some(true) keys (their norms), None values.
        let split = |y: Tensor, heads: usize, norm: Option<bool>| -> Result<Tensor> {
            let (b, len, _) = y.dims3()?;
            let normed = match norm {
                Some(_) => self.qk_norm.is_some(),
                None => cfg.value_norm.is_some(),
            };
            if differentiable && !normed {
                // One node in the graph instead of a reshape, a transpose and a copy, each of
                // whose backward passes would zero-fill and add a gradient of the whole chunk.
                let heads_first = y
                    .detach()
                    .reshape((b, len, heads, cfg.head_dim))?
                    .transpose(1, 2)?
                    // Fresh storage whatever the view (a chunk of one token or one head is
                    // laid out as the projection already): the graft reads it from its start.
                    .force_contiguous()?;
                return graft(&y, &heads_first, MergeHeads);
            }
            let y = match (&self.qk_norm, norm) {
                (Some(qk_norm), Some(keys)) => qk_norm.apply(&y, keys, heads)?,
                _ => y.reshape((b, len, heads, cfg.head_dim))?,
            };
            let y = match (cfg.value_norm, norm) {
                // Values: no scale, in f32 and cast back.
                (Some(eps), None) => {
                    rms_normalized(&y.to_dtype(DType::F32)?, eps)?.to_dtype(y.dtype())?
                }
                _ => y,
            };
            let y = y.transpose(1, 2)?.contiguous()?;
            Ok(if differentiable { y } else { y.detach() })
        };
        // One pass over the three weights when the chunk is a few tokens (a decoding step).
        let linears: Vec<&Linear> = [Some(q), Some(k), v.as_ref()]
            .into_iter()
            .flatten()
            .collect();
        let mut ys = projection::project_all(&linears, x)?.into_iter();
        let (Some(queries), Some(keys)) = (ys.next(), ys.next()) else {
            return Err(Error::config(
                "projections",
                "missing",
                "one output per projection",
            ));
        };
        let values = ys.next().unwrap_or_else(|| keys.clone());
        let (keys, values, conv_state) = match (&self.short_conv, conv) {
            (Some(convs), Some(input)) => {
                let (k, v, state) =
                    convs.apply((&keys, &values), input.state.as_ref(), input.keep.as_ref())?;
                (k, v, Some(state))
            }
            _ => (keys, values, None),
        };
        let (keys, values) = (
            split(keys, cfg.num_kv_heads, Some(true))?,
            split(values, cfg.num_kv_heads, None)?,
        );
        // Values read from the keys' projection (k = v) share its storage when nothing between
        // them copies (no norm, and a head axis or a chunk of one): the rotation hook may turn
        // the keys in place, so the values get storage of their own.
        let values = match shares_storage(&keys, &values) {
            true => values.copy()?,
            false => values,
        };
        let queries = split(queries, cfg.num_heads, Some(false))?;
        Ok((queries, keys, values, conv_state, false))
    }

    /// The projections written heads first ([`linear_node`]; nodes of the graph where
    /// anything tracks gradients), or `None` where they do not apply (another device or
    /// dtype). Each is fresh storage of its own, so the rotation hook may turn q and k in place.
    fn project_nodes(
        &self,
        x: &Tensor,
        (q, k, v): (&Linear, &Linear, Option<&Linear>),
        q_scale: f32,
    ) -> Result<Option<(Tensor, Tensor, Tensor)>> {
        let cfg = &self.config;
        let Ok((batch, len, _)) = x.dims3() else {
            return Ok(None);
        };
        // One copy of a strided input for all three (each node would make its own).
        let x = &x.contiguous()?;
        let node = |linear: &Linear, heads: usize, scale: f32| {
            let arrange = Arrange::Heads {
                batch,
                len,
                heads,
                head_dim: cfg.head_dim,
            };
            linear_node::scaled(linear, x, arrange, scale)
        };
        let (Some(queries), Some(keys)) = (
            node(q, cfg.num_heads, q_scale)?,
            node(k, cfg.num_kv_heads, 1.0)?,
        ) else {
            return Ok(None);
        };
        let values = match v {
            Some(v) => match node(v, cfg.num_kv_heads, 1.0)? {
                Some(values) => values,
                None => return Ok(None),
            },
            // Values read from the keys' projection get storage of their own, as below.
            None => keys.copy()?,
        };
        Ok(Some((queries, keys, values)))
    }

    /// Checks what the rotation hook returned: the shapes, dtype and device it was given.
    fn check_rotated(
        &self,
        (q, k): (Tensor, Tensor),
        (b, tq, tk): (usize, usize, usize),
    ) -> Result<(Tensor, Tensor)> {
        let cfg = &self.config;
        let dtype = self.o_proj.weight().dtype();
        let device = self.o_proj.weight().device();
        for (what, x, heads, t) in [
            ("rotated queries", &q, cfg.num_heads, tq),
            ("rotated keys", &k, cfg.num_kv_heads, tk),
        ] {
            if x.dims() != [b, heads, t, cfg.head_dim] {
                return Err(Error::shape(
                    what,
                    format!(
                        "({b}, {heads}, {t}, {}) as given to the rotation hook",
                        cfg.head_dim
                    ),
                    x.shape(),
                ));
            }
            if x.dtype() != dtype || !x.device().same_device(device) {
                return Err(Error::DType {
                    what,
                    expected: "the dtype and device given to the rotation hook",
                    got: x.dtype(),
                });
            }
        }
        Ok((packed(q)?, packed(k)?))
    }

    /// The additive mask broadcast to the full `(B, H, T, Tk)` logits.
    fn attn_mask(
        &self,
        options: &AttentionOptions,
        full: (usize, usize, usize, usize),
    ) -> Result<Option<Tensor>> {
        let Some(mask) = options.attn_mask else {
            return Ok(None);
        };
        check_device(
            "additive attention mask",
            mask,
            self.o_proj.weight().device(),
        )?;
        if !is_float(mask.dtype()) {
            return Err(Error::DType {
                what: "additive attention mask",
                expected: "a float mask added to the logits (0 to attend, -inf or a large negative value to hide); a 0/1 keep-mask of keys goes in padding_mask",
                got: mask.dtype(),
            });
        }
        Ok(Some(mask.broadcast_as(full).map_err(|_| {
            Error::shape(
                "additive attention mask",
                format!("a shape broadcastable to {full:?} = (batch, heads, queries, keys)"),
                mask.shape(),
            )
        })?))
    }
}

/// What [`MultiHeadAttention::project`] gives: q, k, v, the short convolutions' state after
/// the chunk, and whether q comes scaled by the softmax scale.
type Projected = (Tensor, Tensor, Tensor, Option<ConvState>, bool);

/// What the short convolutions read besides the chunk.
struct ConvInput {
    /// The state the cache holds (`None`: zeros, the start of the sequence).
    state: Option<ConvState>,
    /// The chunk's part of the padding mask, `(B, T)` 0/1.
    keep: Option<Tensor>,
}

/// One call's settings, checked by [`MultiHeadAttention::check_call`] and read by the stages
/// after it.
struct Call {
    /// The queries' positions (an offset after the cache's, unless given).
    positions: Positions,
    /// Whether the cache is a streaming one.
    streaming: bool,
    /// Sequences and queries.
    b: usize,
    t: usize,
    /// Keys already in the cache.
    cached: usize,
    /// The logits' shape `(B, H, T, T_keys)`.
    full: (usize, usize, usize, usize),
    /// Queries per block of logits.
    block: usize,
    attn_mask: Option<Tensor>,
    padding: Option<Tensor>,
}

impl Call {
    /// No query or no sequence: nothing to compute, nothing to cache.
    fn is_empty(&self) -> bool {
        self.t == 0 || self.b == 0
    }
}

/// Largest `softmax_scale × head_dim` of an f16 block, times the attention temperature's
/// largest factor when it has one ([`check_factors`]).
const F16_MAX_LOGIT_REACH: f64 = 256.0;

/// Every factor the block multiplies its activations by, checked once, when it is built,
/// against the range of its weights' `dtype` ([`check_factor`]):
/// - `softmax_scale` multiplies the queries, in their dtype on candle's ops;
/// - the attention temperature's largest factor ([`AttentionTemperature::largest_factor`])
///   multiplies the queries, rounded to their dtype;
/// - `logit_softcap` needs no check against the dtype: every path caps in f32, and
///   `|c·tanh(s/c)| ≤ |s|`, so a capped logit is never larger than the logit it came from,
///   whatever `c` (a normal f32, [`AttentionConfig::validate`]).
///
/// In f16 (2^16 at most) a logit sums head_dim products times the scale and the temperature:
/// the three together may reach 2^8 ([`F16_MAX_LOGIT_REACH`]), leaving 2^8 for the products
/// themselves. The default scale 1/√head_dim gives √head_dim, within it up to head_dim =
/// 65536. (A rotary encoding's attention factor is checked where the encoding rotates, against
/// the dtype it is handed; bias values where the block casts them to f32 to add them.)
///
/// [`AttentionTemperature::largest_factor`]: super::AttentionTemperature::largest_factor
fn check_factors(config: &AttentionConfig, dtype: DType) -> Result<()> {
    let scale = config.softmax_scale;
    check_factor(
        "softmax_scale",
        scale,
        (scale, "it multiplies the queries in their dtype"),
        dtype,
    )?;
    let temperature = config.attention_temperature.as_ref();
    if let Some(t) = temperature {
        check_factor(
            "attention_temperature.attn_scale",
            t.attn_scale,
            (
                t.largest_factor(),
                "the largest factor 1 + s·ln(1 + ⌊2^64 / floor_scale⌋) multiplies the queries in their dtype",
            ),
            dtype,
        )?;
    }
    if dtype != DType::F16 {
        return Ok(());
    }
    let head_dim = config.head_dim as f64;
    let reach = scale * head_dim;
    if reach > F16_MAX_LOGIT_REACH {
        return Err(Error::config(
            "softmax_scale",
            scale,
            format!(
                "at most {:e} for f16 weights with head_dim {}: scale × head_dim ({reach:e}) past 2^8 lets moderate queries and keys overflow f16's logits",
                F16_MAX_LOGIT_REACH / head_dim,
                config.head_dim
            ),
        ));
    }
    if let Some(t) = temperature {
        let factor = t.largest_factor();
        if reach * factor > F16_MAX_LOGIT_REACH {
            return Err(Error::config(
                "attention_temperature.attn_scale",
                t.attn_scale,
                format!(
                    "a largest factor (here {factor:e}) of at most {:e} for f16 weights with softmax_scale {scale} and head_dim {}: scale × factor × head_dim ({:e}) past 2^8 lets moderate queries and keys overflow f16's logits",
                    F16_MAX_LOGIT_REACH / reach,
                    config.head_dim,
                    reach * factor
                ),
            ));
        }
    }
    Ok(())
}

/// The adjoint of splitting `(B, T, H·D)` into heads `(B, H, T, D)`: merging them back.
struct MergeHeads;

impl GraftBackward for MergeHeads {
    const NAME: &'static str = "posenc-split-heads";

    fn grad(&self, grad_y: &Tensor) -> candle_core::Result<Tensor> {
        let (b, h, t, d) = grad_y.dims4()?;
        grad_y.transpose(1, 2)?.contiguous()?.reshape((b, t, h * d))
    }
}

/// A hook's answer with features of unit stride, as every path reads them (a view strided on
/// the last axis is copied; the block's own layouts are kept). candle's matmul refuses such
/// views with its own error.
fn packed(t: Tensor) -> Result<Tensor> {
    Ok(match t.stride().last().is_none_or(|&s| s == 1) {
        true => t,
        false => t.contiguous()?,
    })
}

impl Module for MultiHeadAttention {
    /// Attention at positions `0..T`, no mask beyond the configured causality, inference mode.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(self
            .forward_with(x, &AttentionOptions::default(), None)?
            .output)
    }
}
