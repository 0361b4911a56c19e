//! A training call's whole block as one node of candle's graph, on the CPU in f32.
//!
//! ```text
//! forward:   q = s·(x W_qᵀ + b_q),  k = x W_kᵀ + b_k,  v = x W_vᵀ + b_v     heads first
//!            O = the fused training core (fused_training)    (B, T, H, D), m and 1/l per row
//!            y = O W_oᵀ + b_o                                 O read as rows of H·D
//! backward:  ∂O = ∂y W_o;   ∂W_o = ∂yᵀ O;   ∂b_o = Σ_rows ∂y
//!            ∂q, ∂k, ∂v, ∂sinks = the core's backward
//!            ∂x = s ∂q W_q + ∂k W_k + ∂v W_v;   ∂W_q = s ∂qᵀ x, …;   ∂b_q = s Σ_rows ∂q, …
//! ```
//!
//! candle's backward starts the gradient of every input of every node as a zero-filled tensor
//! and adds each contribution into a fresh one. As five nodes (three projections, the core,
//! the output projection) a step paid for about twenty tensors the size of the chunk, and the
//! page faults of each; here only x's gradient is candle's. The weights, biases and sinks hang
//! on the node through a chain of one-element links (`crate::graft`), so their gradients,
//! computed by the node's backward, reach candle without a tensor the size of the chunk.
//!
//! The block takes this node only when nothing sits between its projections and its core but
//! a rotation that declares its adjoint (`PositionalEncoding::rotation_only`, every RoPE
//! variant): q and k are rotated outside the graph and their gradients rotated back. Any
//! other encoding, a norm, a convolution or a cache would need gradients of its own inside the
//! node (`MultiHeadAttention`'s `one_node` decides).

use std::sync::{Arc, Mutex};
use std::thread::ThreadId;

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Storage, Tensor};
use candle_nn::Linear;

use super::dropout::Dropout;
use super::fused_attention::{tile_rows, Core, KEY_TILE};
use super::fused_softmax::{read_storage, RowRule};
use super::fused_training::{Pass, Tiles, TrainCore};
use crate::cpu::linear_node::{
    self, grads_of_rows, heads_to_rows, with_scratch, Arrange, WeightGrads,
};
use crate::cpu::pool::on_pool;
use crate::cpu::{gemm, zeroed};
use crate::error::{Error, Result};
use crate::graft::{graft_through, GraftBackward, Handoff};
use crate::plug::{AttentionContext, PositionalEncoding};
use crate::positions::Positions;

/// What the node computes from: the block's input and weights, and the core's rule.
pub(crate) struct Parts<'a> {
    /// `(B, T, d_model)`.
    pub(crate) x: &'a Tensor,
    /// q, k, v and o projections (q and o `H·D` wide, k and v `Hkv·D`).
    pub(crate) linears: [&'a Linear; 4],
    /// `(H, Hkv, D)`.
    pub(crate) heads: (usize, usize, usize),
    /// The softmax scale, taken into the queries' projection.
    pub(crate) q_scale: f32,
    /// `(B, T)` u8, non-zero = keep.
    pub(crate) padding: Option<&'a Tensor>,
    pub(crate) rule: RowRule,
    /// `(H)` sink logits (the rule holds their values).
    pub(crate) sinks: Option<&'a Tensor>,
    pub(crate) dropout: Option<Dropout>,
    /// An encoding that declares [`PositionalEncoding::rotation_only`], rotating q and k.
    pub(crate) rotation: Option<Rotation>,
}

impl Parts<'_> {
    /// `(B, T, d_model)` when the input, every weight and every bias are f32 on the CPU.
    pub(crate) fn f32_cpu_dims(&self) -> Option<(usize, usize, usize)> {
        let f32_cpu = |t: &Tensor| t.device().is_cpu() && t.dtype() == DType::F32;
        let mut tensors = self
            .linears
            .iter()
            .flat_map(|l| std::iter::once(l.weight()).chain(l.bias()));
        match f32_cpu(self.x) && tensors.all(f32_cpu) {
            true => self.x.dims3().ok(),
            false => None,
        }
    }
}

/// A rotation and what its context is made of: the chunk's positions (queries and keys alike)
/// and the block's rule.
#[derive(Clone)]
pub(crate) struct Rotation {
    pub(crate) encoding: Arc<dyn PositionalEncoding>,
    pub(crate) positions: Positions,
    pub(crate) causal: bool,
    pub(crate) train: bool,
    pub(crate) sinks: bool,
}

impl Rotation {
    /// `f` with the context the rotation hook is given: the chunk's own tokens.
    fn with_context<R>(&self, len: usize, f: impl FnOnce(&AttentionContext) -> R) -> R {
        let ctx = AttentionContext::chunk(&self.positions, len)
            .with_causal(self.causal)
            .with_train(self.train)
            .with_sinks(self.sinks);
        f(&ctx)
    }

    /// q and k rotated (or, with `adjoint`, their gradients rotated back), checked to keep
    /// their shapes, dtype and device, and packed.
    pub(crate) fn apply(&self, q: Tensor, k: Tensor, adjoint: bool) -> Result<(Tensor, Tensor)> {
        let (shapes, len) = ((q.shape().clone(), k.shape().clone()), q.dim(2)?);
        let e = &self.encoding;
        let (q, k) = self.with_context(len, |ctx| match adjoint {
            false => e.rotate(q, k, ctx),
            true => e.rotate_adjoint(q, k, ctx),
        })?;
        let what = match adjoint {
            false => "rotated queries and keys",
            true => "the rotation's adjoint of their gradients",
        };
        for (x, shape) in [(&q, &shapes.0), (&k, &shapes.1)] {
            if x.shape() != shape {
                return Err(Error::shape(
                    what,
                    format!("{shape:?} as handed over"),
                    x.shape(),
                ));
            }
            if x.dtype() != DType::F32 || !x.device().is_cpu() {
                return Err(Error::DType {
                    what,
                    expected: "f32 on the CPU, as handed over",
                    got: x.dtype(),
                });
            }
        }
        Ok((q.contiguous()?, k.contiguous()?))
    }
}

/// The block's output `(B, T, d_model)` as one node of candle's graph, or `None` where the
/// node does not apply (another device or dtype than f32 on the CPU, sizes the projection
/// nodes do not take, or a rotation whose result tracks gradients of its own); the caller then
/// runs the block's pipeline.
///
/// # Errors
/// A buffer cannot be allocated; candle's errors.
pub(crate) fn forward(parts: Parts) -> Result<Option<Tensor>> {
    let Parts { x, linears, .. } = &parts;
    let Some((b, t, d_model)) = parts.f32_cpu_dims() else {
        return Ok(None);
    };
    let (h, hkv, d) = parts.heads;
    let x_rows = x.detach().contiguous()?;
    let Some([q, k, v]) = project(&parts, &x_rows, (b, t))? else {
        return Ok(None);
    };
    let (q, k) = match &parts.rotation {
        Some(rotation) => rotation.apply(q, k, false)?,
        None => (q, k),
    };
    if q.track_op() || k.track_op() {
        // A rotation with parameters of its own that train: they would get no gradient here.
        return Ok(None);
    }
    let core = Core {
        q: &q,
        k: &k,
        v: &v,
        dense: Vec::new(),
        dense_masks: false,
        relative: Vec::new(),
        separable: Vec::new(),
        padding: parts.padding,
        rule: &parts.rule,
        values: None,
        tile: tile_rows(t),
        key_tile: KEY_TILE,
    };
    let train = TrainCore {
        core,
        sinks: parts.sinks,
        tiles: Tiles::default(),
        dropout: parts.dropout,
    };
    let (o, pass, extras) = train.detached()?;
    let o_proj = linears[3];
    let mut y = zeroed(b * t * d_model, "training block: output")?;
    with_linear(o_proj, |w, bias| {
        gemm::linear(&mut y, (&o, w, bias), (b * t, d_model, h * d), 1.0)
    })?;
    let linked = linked(linears, extras);
    if linked.is_empty() && !x.track_op() {
        return Ok(Some(Tensor::from_vec(y, (b, t, d_model), x.device())?));
    }
    let state = Arc::new(State {
        linears: linears.map(Linear::clone),
        rotation: parts.rotation.clone(),
        q_scale: parts.q_scale,
        dims: (b, t, d_model, h, hkv, d),
        saved: Saved {
            x: x_rows,
            qkv: [q, k, v],
            o: Tensor::from_vec(o, (b, t, h, d), x.device())?,
            pass,
        },
        slots: linked.iter().map(|(_, s)| *s).collect(),
        grads: Handoff::default(),
    });
    let mut anchor = Tensor::zeros(1, DType::F32, x.device())?;
    for (slot, (tensor, _)) in linked.iter().enumerate() {
        let link = Link {
            state: state.clone(),
            slot,
        };
        anchor = graft_through(tensor, &anchor, link)?;
    }
    let op = BlockOp {
        state,
        y: Mutex::new(Some(y)),
        shape: Shape::from((b, t, d_model)),
    };
    Ok(Some(x.apply_op2(&anchor, op)?))
}

/// The tensors that get gradients from the node's backward: each weight and bias that tracks
/// them, then each of the core's extras (the sinks), with where each gradient comes from.
fn linked(linears: &[&Linear; 4], extras: Vec<Tensor>) -> Vec<(Tensor, Slot)> {
    let mut linked: Vec<(Tensor, Slot)> = Vec::new();
    for (i, l) in linears.iter().enumerate() {
        linked.push((l.weight().clone(), Slot::Weight(i)));
        if let Some(bias) = l.bias() {
            linked.push((bias.clone(), Slot::Bias(i)));
        }
    }
    linked.extend(
        extras
            .into_iter()
            .enumerate()
            .map(|(e, t)| (t, Slot::Extra(e))),
    );
    linked.retain(|(t, _)| t.track_op());
    linked
}

/// q `(B, H, T, D)` scaled, k and v `(B, Hkv, T, D)`, outside the graph; `None` where the
/// projection nodes do not take the sizes.
fn project(parts: &Parts, x: &Tensor, (batch, len): (usize, usize)) -> Result<Option<[Tensor; 3]>> {
    let (h, hkv, head_dim) = parts.heads;
    let mut out = Vec::with_capacity(3);
    for (i, heads) in [h, hkv, hkv].into_iter().enumerate() {
        let l = parts.linears[i];
        let detached = Linear::new(l.weight().detach(), l.bias().map(Tensor::detach));
        let arrange = Arrange::Heads {
            batch,
            len,
            heads,
            head_dim,
        };
        let scale = if i == 0 { parts.q_scale } else { 1.0 };
        match linear_node::scaled(&detached, x, arrange, scale)? {
            Some(y) => out.push(y),
            None => return Ok(None),
        }
    }
    Ok(out.try_into().ok())
}

/// Where a linked tensor's gradient comes from.
#[derive(Clone, Copy)]
enum Slot {
    /// Projection `i`'s (q, k, v, o) weight, or its bias.
    Weight(usize),
    Bias(usize),
    /// The core's extra `e` (the sinks).
    Extra(usize),
}

/// What the forward keeps for the backward.
struct Saved {
    /// The input as rows, contiguous.
    x: Tensor,
    /// q (scaled), k, v, heads first.
    qkv: [Tensor; 3],
    /// The core's output `(B, T, H, D)`.
    o: Tensor,
    pass: Pass,
}

/// The node's state, shared with its links.
struct State {
    /// q, k, v, o as the block holds them.
    linears: [Linear; 4],
    rotation: Option<Rotation>,
    q_scale: f32,
    /// `(B, T, d_model, H, Hkv, D)`.
    dims: (usize, usize, usize, usize, usize, usize),
    /// Read by every backward of the node's graph (a graph may be differentiated more than
    /// once: two losses of one output).
    saved: Saved,
    /// The linked tensors' sources, in link order.
    slots: Vec<Slot>,
    /// Their gradients, left by each backward for its thread's links to take.
    grads: Handoff<Vec<Option<Tensor>>>,
}

fn lock<T>(m: &Mutex<T>) -> candle_core::Result<std::sync::MutexGuard<'_, T>> {
    m.lock()
        .map_err(|_| candle_core::Error::Msg("training block: a lock was poisoned".into()))
}

/// A read-locked f32 CPU tensor's first `n` values (contiguous from its offset).
fn f32_slice<'a>(
    (guard, layout): &'a (super::fused_softmax::StorageGuard<'a>, &'a Layout),
    n: usize,
) -> candle_core::Result<&'a [f32]> {
    match (&***guard, layout.contiguous_offsets()) {
        (Storage::Cpu(CpuStorage::F32(data)), Some((a, z))) if z - a >= n => Ok(&data[a..a + n]),
        _ => candle_core::bail!("training block: expected {n} contiguous f32 CPU values"),
    }
}

/// `f` with the values of `t` (contiguous, f32, CPU; copied first if strided).
pub(crate) fn with_values<R>(
    t: &Tensor,
    f: impl FnOnce(&[f32]) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let t = t.contiguous()?;
    let guard = read_storage(&t);
    f(f32_slice(&guard, t.elem_count())?)
}

/// `f` with a projection's weight and bias values.
pub(crate) fn with_linear<R>(
    linear: &Linear,
    f: impl FnOnce(&[f32], Option<&[f32]>) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    with_values(linear.weight(), |w| match linear.bias() {
        Some(b) => with_values(b, |b| f(w, Some(b))),
        None => f(w, None),
    })
}

impl State {
    /// ∂x (where x tracks), with every linked tensor's gradient left in `grads` for the
    /// links of the backward running on `caller`.
    fn backward(
        &self,
        x: &Tensor,
        grad_y: &Tensor,
        caller: ThreadId,
    ) -> candle_core::Result<Option<Tensor>> {
        let saved = &self.saved;
        let mut weight_grads: [WeightGrads; 4] = Default::default();
        let d_o = self.output_grads(grad_y, &mut weight_grads[3])?;
        let [q, k, v] = &saved.qkv;
        let core = saved.pass.grads([q, k, v], &saved.o, &d_o)?;
        drop(d_o);
        let [dq, dk, dv] = core.qkv;
        let (Some(dq), Some(dk), Some(dv)) = (dq, dk, dv) else {
            candle_core::bail!("training block: the core gave no gradient to q, k or v")
        };
        let (dq, dk) = match &self.rotation {
            Some(rotation) => rotation.apply(dq, dk, true)?,
            None => (dq, dk),
        };
        let dx = self.projection_grads(x, [&dq, &dk, &dv], &mut weight_grads)?;
        self.hand_out(weight_grads, core.extras, caller)?;
        Ok(dx)
    }

    /// ∂O `(B, T, H, D)` = ∂y W_o, with ∂W_o and ∂b_o into `grads`.
    fn output_grads(
        &self,
        grad_y: &Tensor,
        grads: &mut WeightGrads,
    ) -> candle_core::Result<Tensor> {
        let (b, t, d_model, h, _, d) = self.dims;
        let op = &self.linears[3];
        let grad_y = grad_y.to_dtype(DType::F32)?.contiguous()?;
        let mut d_o = zeroed(b * t * h * d, "training block: output gradient")?;
        with_values(&grad_y, |g| {
            with_values(&self.saved.o, |o| {
                with_values(op.weight(), |w| {
                    *grads = grads_of_rows(
                        g,
                        (o, w),
                        (b * t, d_model, h * d),
                        1.0,
                        Some((&mut d_o, false)),
                        self.wanted(op),
                    )?;
                    Ok(())
                })
            })
        })?;
        Tensor::from_vec(d_o, (b, t, h, d), &candle_core::Device::Cpu)
    }

    /// ∂x from ∂q, ∂k and ∂v heads first (before the rotation), where x tracks, with each
    /// projection's ∂W and ∂b into `grads`.
    fn projection_grads(
        &self,
        x: &Tensor,
        d_qkv: [&Tensor; 3],
        grads: &mut [WeightGrads; 4],
    ) -> candle_core::Result<Option<Tensor>> {
        let (b, t, d_model, h, hkv, d) = self.dims;
        let rows = b * t;
        let mut dx = match x.track_op() {
            true => Some(zeroed(rows * d_model, "training block: input gradient")?),
            false => None,
        };
        let [qp, kp, vp, _] = &self.linears;
        let projections = [(qp, h, self.q_scale), (kp, hkv, 1.0), (vp, hkv, 1.0)];
        for (i, (grad, (linear, heads, scale))) in d_qkv.into_iter().zip(projections).enumerate() {
            let out = heads * d;
            grads[i] = with_values(grad, |g| {
                with_values(&self.saved.x, |xs| {
                    with_values(linear.weight(), |w| {
                        with_scratch(rows * out, |scratch| {
                            heads_to_rows(g, scratch, (t, heads, d));
                            let dxs = dx.as_deref_mut().map(|dx| (dx, i > 0));
                            grads_of_rows(
                                scratch,
                                (xs, w),
                                (rows, out, d_model),
                                scale,
                                dxs,
                                self.wanted(linear),
                            )
                        })?
                    })
                })
            })?;
        }
        dx.map(|dx| Tensor::from_vec(dx, x.shape(), x.device()))
            .transpose()
    }

    /// Each linked tensor's gradient, left in `grads` for its link on `caller`: the
    /// projections' from `weights`, the core's extras from `extras`.
    fn hand_out(
        &self,
        mut weights: [WeightGrads; 4],
        mut extras: Vec<Option<Tensor>>,
        caller: ThreadId,
    ) -> candle_core::Result<()> {
        let mut grads = Vec::with_capacity(self.slots.len());
        for slot in &self.slots {
            let (values, like) = match *slot {
                Slot::Weight(i) => (weights[i].0.take(), Some(self.linears[i].weight())),
                Slot::Bias(i) => (weights[i].1.take(), self.linears[i].bias()),
                Slot::Extra(e) => {
                    grads.push(extras.get_mut(e).and_then(Option::take));
                    continue;
                }
            };
            let grad = match (values, like) {
                (Some(g), Some(like)) => Some(Tensor::from_vec(g, like.shape(), like.device())?),
                _ => None,
            };
            grads.push(grad);
        }
        self.grads.put(caller, grads)
    }

    /// Which of a projection's gradients are wanted: (∂W, ∂b).
    fn wanted(&self, linear: &Linear) -> (bool, bool) {
        (
            linear.weight().track_op(),
            linear.bias().is_some_and(Tensor::track_op),
        )
    }
}

/// The node: its output, computed before candle records it, and the state its backward reads.
struct BlockOp {
    state: Arc<State>,
    y: Mutex<Option<Vec<f32>>>,
    shape: Shape,
}

impl CustomOp2 for BlockOp {
    fn name(&self) -> &'static str {
        "posenc-attention-block-train"
    }

    fn cpu_fwd(
        &self,
        _x: &CpuStorage,
        _lx: &Layout,
        _anchor: &CpuStorage,
        _la: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let y = lock(&self.y)?.take().ok_or_else(|| {
            candle_core::Error::Msg("training block: the node was applied twice".into())
        })?;
        Ok((CpuStorage::F32(y), self.shape.clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        anchor: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        // The links run on this thread, the backward on the pool.
        let caller = std::thread::current().id();
        let dx = on_pool(|| self.state.backward(x, grad, caller))?;
        let d_anchor = match anchor.track_op() {
            true => Some(anchor.zeros_like()?),
            false => None,
        };
        Ok((dx, d_anchor))
    }
}

/// A linked tensor: hands its gradient, left by the node's backward, to candle.
struct Link {
    state: Arc<State>,
    slot: usize,
}

impl GraftBackward for Link {
    const NAME: &'static str = "posenc-attention-block-link";

    fn grad(&self, _grad_y: &Tensor) -> candle_core::Result<Tensor> {
        let grad = self.state.grads.take_mine(
            |grads| grads.get_mut(self.slot).and_then(Option::take),
            |grads| grads.iter().all(Option::is_none),
        )?;
        grad.ok_or_else(|| {
            candle_core::Error::Msg("training block: a weight's gradient was not computed".into())
        })
    }
}
