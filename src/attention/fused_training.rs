//! The fused CPU core for training: the inference core's forward keeping one maximum and one
//! inverse sum per row, and a FlashAttention-2 backward that recomputes each tile's weights
//! from q, k and the terms instead of storing them (Dao 2023, "FlashAttention-2", Algorithm 2).
//!
//! ```text
//! forward:   O = the core's output (fused_attention),  m_i, 1/l_i kept per row
//! δ_i = dO_i · O_i
//! for each (b, KV head, key tile J), each head h of its group, each query tile I that sees J:
//!     P  = e^(S_IJ − m_I) / l_I                S recomputed: cap(q kᵀ) + terms, masked
//!     dP = dO_I v_Jᵀ + G_I[c(i, j)]             G = dO_I aᵀ (relative values a, if any)
//!     dV_J += Pᵀ dO_I;   da += (Σ_{j: c(i, j) = c} P_ij)ᵀ dO_I
//!     dS = P ∘ (dP − δ_I)                       0 on a row masked whole (its weights are fixed)
//!     dterm += dS                               summed over the term's broadcast axes, per
//!                                               clamped column for rows per distance
//!     dS ← dS ∘ (1 − tanh²(s / c))              with a soft cap c of the raw logits s
//!     dQ_I += dS k_J;   dK_J += dSᵀ q_I
//! dsink_h = −Σ_{b, i} e^(sink_h − m_i) / l_i · δ_i
//! ```
//!
//! No `(B, H, Tq, Tk)` tensor exists on either side: the backward holds one query tile's
//! logits and their gradient (`rows × keys`) per thread, and its memory beyond the gradients is
//! O(T). Tasks are `(batch, KV head, share of the key tiles)`: each owns its keys' dK and dV
//! (grouped heads sum into their shared head in place), and writes dQ directly when it owns
//! every key tile of its heads, else into its own partial sum, added up after the pass in a
//! fixed order. Gradients of the terms and tables are partial per task too, so every gradient
//! is the same from run to run.
//!
//! The result is attached to candle's graph as one op of q, k and v, whose backward is this
//! pass; each term, table or sink tensor that tracks gradients is grafted on top as a link
//! that hands its own share of the same pass's results to candle (the outermost link, reached
//! first by the backward, runs the pass once for all of them).

use std::sync::{Arc, OnceLock};

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Storage, Tensor};
use rayon::prelude::*;

use super::fused_attention::{index_row, Core, CoreSpec, OutPtr, TileColumns, View};
use super::fused_softmax::{add_shifted_row, read_storage, TermGuards};
use crate::cpu::gemm::product;
use crate::cpu::zeroed;
use crate::error::{Error, Result};
use crate::graft::{graft_through, GraftBackward, Handoff};
use crate::limits::check_elements;
use crate::plug::relative::add_indexed_sums;

/// How the backward cuts its work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tiles {
    /// Query rows per tile.
    pub(crate) rows: usize,
    /// Keys per tile.
    pub(crate) keys: usize,
    /// Shares of each head's key tiles, one task each (`None`: enough tasks for twice the
    /// threads).
    pub(crate) shares: Option<usize>,
}

impl Default for Tiles {
    /// 64 query rows by 256 keys: a tile's logits and their gradient, its keys, values and
    /// their gradients stay in a core's L2.
    fn default() -> Self {
        Self {
            rows: 64,
            keys: 256,
            shares: None,
        }
    }
}

/// The core with gradients: q, k and v and every term, table and sink tensor that tracks
/// gradients get them from the fused backward.
pub(crate) struct TrainCore<'a> {
    /// The forward's operands, as the inference core takes them.
    pub(crate) core: Core<'a>,
    /// `(H)` sink logits (the rule holds their values), to receive their gradient.
    pub(crate) sinks: Option<&'a Tensor>,
    /// The backward's tiles.
    pub(crate) tiles: Tiles,
    /// Attention dropout, drawn from its seed in the forward and again in the backward.
    pub(crate) dropout: Option<super::dropout::Dropout>,
}

impl TrainCore<'_> {
    /// The attention output `(B, Tq, H, D)` (heads not yet merged), f32, in the graph of q, k,
    /// v and the terms.
    pub(crate) fn attend(&self) -> Result<Tensor> {
        let core = &self.core;
        let (backward, wanted) = self.pass()?;
        let (b, h, tq, _, d) = backward.spec.dims;
        let backward = Arc::new(backward);
        let cache = Arc::new(Handoff::default());
        let op = TrainOp {
            backward: backward.clone(),
            cache: cache.clone(),
        };
        let out = core.q.apply_op3(core.k, core.v, op)?;
        debug_assert_eq!(out.dims(), [b, tq, h, d]);
        let shared = Arc::new(Shared {
            backward,
            cache,
            q: core.q.clone(),
            k: core.k.clone(),
            v: core.v.clone(),
            o: out.clone(),
        });
        let last = wanted.len().saturating_sub(1);
        let mut linked = out;
        for (extra, tensor) in wanted.iter().enumerate() {
            linked = graft_through(
                tensor,
                &linked,
                Link {
                    shared: shared.clone(),
                    extra,
                    outermost: extra == last,
                },
            )?;
        }
        Ok(linked)
    }

    /// The forward outside candle's graph, for a caller that attaches the gradients itself
    /// ([`super::train_node`]): the output `(B, Tq, H, D)` as rows, the pass that computes
    /// the gradients from it, and the tensors besides q, k and v that get one (its extras, in
    /// order).
    pub(crate) fn detached(&self) -> Result<(Vec<f32>, Pass, Vec<Tensor>)> {
        let core = &self.core;
        let (backward, wanted) = self.pass()?;
        let (b, h, tq, _, d) = backward.spec.dims;
        let mut out = zeroed(b * tq * h * d, "fused training: output")?;
        let mut stats = zeroed(b * h * tq * 2, "fused training: statistics")?;
        let guards = [core.q, core.k, core.v].map(read_storage);
        let storage = |i: usize| match &**guards[i].0 {
            Storage::Cpu(s) => Ok((s, guards[i].1)),
            _ => Err(Error::config(
                "fused training",
                "a tensor on another device",
                "q, k and v on the CPU",
            )),
        };
        backward.spec.run(
            [storage(0)?, storage(1)?, storage(2)?],
            OutPtr(out.as_mut_ptr()),
            tq,
            Some(OutPtr(stats.as_mut_ptr())),
        )?;
        backward.set_stats(stats)?;
        Ok((out, Pass(backward), wanted))
    }

    /// The pass's spec and what it gives gradients to besides q, k and v: each dense term,
    /// each relative term's values, the value table, the sinks, where they track gradients.
    fn pass(&self) -> Result<(Backward, Vec<Tensor>)> {
        let core = &self.core;
        let mut spec = core.spec(0)?;
        spec.dropout = self.dropout;
        let (b, h, tq, _, _) = spec.dims;
        check_elements(
            "fused training statistics",
            format_args!("{b} × {h} × {tq}"),
            "two per query row",
            &[b, h, tq, 2],
        )?;
        // What receives a gradient besides q, k and v, in the order of the pass's extras: each
        // dense term, each relative term's values, the value table, the sinks.
        let mut wanted: Vec<Tensor> = Vec::new();
        let mut terms = Vec::new();
        let mut operands: Vec<(Tensor, TermKind)> = core
            .dense
            .iter()
            .map(|t| ((*t).clone(), TermKind::Dense))
            .collect();
        for (r, strided) in core.relative.iter().zip(&spec.terms[core.dense.len()..]) {
            operands.push(match strided.mixed {
                // Mixed rows get their gradient as the pass reads them: packed, a row per head.
                Some(_) => (strided.tensor().clone(), TermKind::Mixed),
                None => (r.values()?, TermKind::Relative),
            });
        }
        operands.extend(
            core.separable
                .iter()
                .map(|s| (s.packed.clone(), TermKind::Separable)),
        );
        for (index, (tensor, kind)) in operands.iter().enumerate() {
            if tensor.track_op() {
                let dims = match kind {
                    // One row per head: the queries' values, then the keys'.
                    TermKind::Separable => {
                        let (sb, sh, len) = tensor.dims3()?;
                        [sb, sh, 1, len]
                    }
                    _ => padded_dims(tensor)?,
                };
                check_grad_dims(&dims, &spec, *kind)?;
                terms.push(TermGrad {
                    index,
                    dims,
                    extra: wanted.len(),
                });
                wanted.push(tensor.clone());
            }
        }
        let table = match core.values {
            Some(v) if v.table().track_op() => {
                wanted.push(v.table().clone());
                Some(wanted.len() - 1)
            }
            _ => None,
        };
        let sinks = match self.sinks {
            Some(s) if s.track_op() => {
                wanted.push(s.clone());
                Some(wanted.len() - 1)
            }
            _ => None,
        };
        let backward = Backward {
            spec,
            stats: OnceLock::new(),
            terms,
            table,
            sinks,
            tiles: Tiles {
                rows: self.tiles.rows.max(1),
                keys: self.tiles.keys.max(1),
                shares: self.tiles.shares.map(|s| s.max(1)),
            },
            extras: wanted
                .iter()
                .map(|t| (t.dims().to_vec(), t.dtype()))
                .collect(),
        };
        Ok((backward, wanted))
    }
}

/// A term's dims left-padded to four axes, or [`Error::Shape`] past four.
pub(crate) fn padded_dims(t: &Tensor) -> Result<[usize; 4]> {
    let dims = t.dims();
    if dims.len() > 4 {
        return Err(Error::shape(
            "additive logits term",
            "at most four axes (batch, heads, queries, keys)",
            t.shape(),
        ));
    }
    let mut out = [1; 4];
    out[4 - dims.len()..].copy_from_slice(dims);
    Ok(out)
}

/// What kind of term a gradient goes to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum TermKind {
    Dense,
    Relative,
    Separable,
    /// Mixed rows, packed: one row per head of the bank and each query's mix.
    Mixed,
}

/// Checks that a term's gradient fits the pass: its batch, head and query axes are 1 or the
/// block's (dense terms broadcast to it, relative ones were checked against it, a separable
/// pair is one row of `Tq + Tk` per head), and its per-task partial sums fit the element
/// budget.
fn check_grad_dims(dims: &[usize; 4], spec: &CoreSpec, kind: TermKind) -> Result<()> {
    let (b, h, tq, tk, _) = spec.dims;
    let full = match kind {
        TermKind::Separable => [b, h, 1, tq + tk],
        // (The packed length was checked when the pass's terms were built.)
        TermKind::Mixed => [b, h, 1, dims[3]],
        _ => [b, h, tq, tk],
    };
    let fits = match kind {
        TermKind::Separable => dims[3] == full[3],
        _ => true,
    } && dims
        .iter()
        .zip(full)
        .take(if kind == TermKind::Dense { 4 } else { 3 })
        .all(|(&n, f)| n == 1 || n == f);
    if !fits {
        return Err(Error::shape(
            "additive logits term with gradients",
            format!("axes of 1 or {full:?} = (batch, heads, queries, keys)"),
            &Shape::from(dims.to_vec()),
        ));
    }
    check_elements(
        "additive logits term with gradients",
        format_args!("{dims:?}"),
        "its partial sums per head and task",
        &[b, h, dims[2], dims[3], 2],
    )?;
    Ok(())
}

/// A term that receives a gradient: its index among the spec's terms, its padded dims, and
/// its place among the pass's extras.
struct TermGrad {
    index: usize,
    dims: [usize; 4],
    extra: usize,
}

/// What the backward pass needs besides q, k, v, O and dO.
struct Backward {
    spec: CoreSpec,
    /// `(B, H, Tq, 2)`: each row's softmax maximum and inverse sum, set once by the forward.
    /// Not a lock held through the backward: its parallel stages may run another backward
    /// of the same graph on the same thread (rayon steals work while it waits), which would
    /// wait forever on a lock its own thread holds.
    stats: OnceLock<Vec<f32>>,
    terms: Vec<TermGrad>,
    /// The value table's place among the extras, if it gets a gradient.
    table: Option<usize>,
    /// The sinks' place among the extras, if they get a gradient.
    sinks: Option<usize>,
    tiles: Tiles,
    /// Shape and dtype of each extra.
    extras: Vec<(Vec<usize>, DType)>,
}

/// The pass's results: q, k and v's gradients, and one per extra.
pub(crate) struct Grads {
    pub(crate) qkv: [Option<Tensor>; 3],
    pub(crate) extras: Vec<Option<Tensor>>,
}

/// A detached forward's backward pass ([`TrainCore::detached`]).
pub(crate) struct Pass(Backward);

impl Pass {
    /// The gradients of q, k, v and every extra from the output `o` `(B, Tq, H, D)` and its
    /// gradient `grad_o`, for the q, k and v the forward read.
    ///
    /// # Errors
    /// Tensors of other shapes than the forward's; candle's errors.
    pub(crate) fn grads(
        &self,
        [q, k, v]: [&Tensor; 3],
        o: &Tensor,
        grad_o: &Tensor,
    ) -> candle_core::Result<Grads> {
        self.0.grads(q, k, v, o, grad_o)
    }
}

/// The fused forward as candle's op of q, k and v.
struct TrainOp {
    backward: Arc<Backward>,
    cache: Arc<Handoff<Grads>>,
}

/// What the links share: the pass, its results, and its tensors.
struct Shared {
    backward: Arc<Backward>,
    cache: Arc<Handoff<Grads>>,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
}

/// One extra's link: hands its gradient from the pass to candle.
struct Link {
    shared: Arc<Shared>,
    extra: usize,
    outermost: bool,
}

impl GraftBackward for Link {
    const NAME: &'static str = "posenc-fused-attention-term-grad";

    fn grad(&self, grad_y: &Tensor) -> candle_core::Result<Tensor> {
        let s = &self.shared;
        if self.outermost {
            let grads = s.backward.grads(&s.q, &s.k, &s.v, &s.o, grad_y)?;
            s.cache.put(std::thread::current().id(), grads)?;
        }
        // The forward's op takes the rest, where it is in the graph (q, k or v tracks); else
        // the innermost link, the last to run, drops it.
        let grad = s.cache.take_mine(
            |g| g.extras.get_mut(self.extra).and_then(Option::take),
            |_| self.extra == 0 && !s.o.track_op(),
        )?;
        grad.ok_or_else(|| {
            candle_core::Error::Msg("fused training: a term's gradient was not computed".into())
        })
    }
}

impl CustomOp3 for TrainOp {
    fn name(&self) -> &'static str {
        "posenc-fused-attention-train"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let spec = &self.backward.spec;
        let (b, h, tq, _, d) = spec.dims;
        let mut out = zeroed(b * tq * h * d, "fused training: output")?;
        let mut stats = zeroed(b * h * tq * 2, "fused training: statistics")?;
        spec.run(
            [(s1, l1), (s2, l2), (s3, l3)],
            OutPtr(out.as_mut_ptr()),
            tq,
            Some(OutPtr(stats.as_mut_ptr())),
        )?;
        self.backward.set_stats(stats)?;
        Ok((CpuStorage::F32(out), Shape::from((b, tq, h, d))))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // Computed by the outermost link when there is one; else here.
        let cached = self.cache.remove_mine()?;
        let mut grads = match cached {
            Some(g) => g,
            None => self.backward.grads(q, k, v, res, grad_res)?,
        };
        let [dq, dk, dv] = std::mem::take(&mut grads.qkv);
        let keep = |g: Option<Tensor>, t: &Tensor| g.filter(|_| t.track_op());
        Ok((keep(dq, q), keep(dk, k), keep(dv, v)))
    }
}

/// A contiguous f32 CPU tensor's values, read in place while `guard` is held.
fn contiguous_f32<'a>(
    (guard, layout): &'a (super::fused_softmax::StorageGuard<'a>, &'a Layout),
    len: usize,
) -> candle_core::Result<&'a [f32]> {
    match (&***guard, layout.contiguous_offsets()) {
        (Storage::Cpu(CpuStorage::F32(data)), Some((a, z))) if z - a == len => Ok(&data[a..z]),
        _ => candle_core::bail!("fused training: O and dO must be contiguous f32 CPU tensors"),
    }
}

/// One task's share of the pass: `(batch, KV head, key-tile share)`.
#[derive(Clone, Copy)]
struct Task {
    b: usize,
    hk: usize,
    share: usize,
}

/// One task's partial sums.
#[derive(Default)]
struct Partial {
    /// `group × Tq × D`, when the task does not own its heads' dQ.
    dq: Vec<f32>,
    /// Per gradient term: `(group | 1) × rows × width`.
    terms: Vec<Vec<f32>>,
    /// `W × D`.
    table: Vec<f32>,
}

/// Writable pointers shared by the tasks (each writes its own rows).
#[derive(Clone, Copy)]
struct Outs {
    dq: OutPtr,
    dk: OutPtr,
    dv: OutPtr,
}
// SAFETY: every task writes rows no other task writes (its keys' dK and dV; its heads' dQ when
// it owns them, else its own partial buffer).
unsafe impl Send for Outs {}
// SAFETY: as above.
unsafe impl Sync for Outs {}

impl Backward {
    /// Keeps the forward's row statistics for the backward.
    fn set_stats(&self, stats: Vec<f32>) -> candle_core::Result<()> {
        self.stats
            .set(stats)
            .map_err(|_| candle_core::Error::Msg("fused training: the forward ran twice".into()))
    }

    /// The gradients of q, k, v and every extra from `dO` = `grad_o` `(B, Tq, H, D)`.
    fn grads(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        grad_o: &Tensor,
    ) -> candle_core::Result<Grads> {
        let spec = &self.spec;
        let (b, h, tq, tk, d) = spec.dims;
        let hkv = k.dim(1)?;
        if hkv == 0 || !h.is_multiple_of(hkv) {
            candle_core::bail!("fused training: k must be (B, Hkv, Tk, D) with Hkv | H");
        }
        let group = h / hkv;
        let grad_o = grad_o.to_dtype(DType::F32)?.contiguous()?;
        let o = o.contiguous()?;
        if grad_o.dims() != [b, tq, h, d] || o.dims() != [b, tq, h, d] {
            candle_core::bail!("fused training: the output gradient must be (B, Tq, H, D)");
        }
        let stats = self.stats.get().map_or(&[][..], Vec::as_slice);
        if stats.len() != b * h * tq * 2 {
            candle_core::bail!("fused training: backward before forward");
        }
        let (do_guard, o_guard) = (read_storage(&grad_o), read_storage(&o));
        let do_host = contiguous_f32(&do_guard, b * tq * h * d)?;
        let o_host = contiguous_f32(&o_guard, b * tq * h * d)?;
        let delta = row_deltas(do_host, o_host, spec.dims)?;
        let mut dq = zeroed(b * h * tq * d, "fused training: dq")?;
        let mut dk = zeroed(b * hkv * tk * d, "fused training: dk")?;
        let mut dv = zeroed(b * hkv * tk * d, "fused training: dv")?;
        let (tasks, shares) = self.tasks(b, hkv);
        let outs = Outs {
            dq: OutPtr(dq.as_mut_ptr()),
            dk: OutPtr(dk.as_mut_ptr()),
            dv: OutPtr(dv.as_mut_ptr()),
        };
        let guards = [q, k, v].map(read_storage);
        let views = {
            let view = |i: usize, dims: [usize; 4]| match &**guards[i].0 {
                Storage::Cpu(s) => View::new(s, guards[i].1, dims),
                _ => candle_core::bail!("fused training: q, k and v must be CPU tensors"),
            };
            [
                view(0, [b, h, tq, d])?,
                view(1, [b, hkv, tk, d])?,
                view(2, [b, hkv, tk, d])?,
            ]
        };
        let term_guards = TermGuards::new(&spec.terms, spec.padding.as_ref());
        let pass = term_guards
            .pass((b, h, tq, tk), &spec.rule)?
            .with_mixed_in_tiles();
        let values_guard = spec.values.as_ref().map(|v| v.lock());
        let values = values_guard
            .as_ref()
            .map(|g| g.view((b, tq, tk, d)))
            .transpose()?;
        let width = values.as_ref().map(|(_, w, _)| *w);
        self.check_partials(tasks.len(), shares, group, width)?;
        let ctx = Ctx {
            spec,
            pass: &pass,
            stats,
            delta: &delta,
            grad_o: do_host,
            views,
            values: values.as_ref().map(|(t, w, c)| (*t, c, *w)),
            terms: &self.terms,
            want_table: self.table.is_some(),
            group,
            shares,
            tiles: self.tiles,
        };
        let partials: Vec<Partial> = tasks
            .par_iter()
            .map(|task| ctx.run(*task, outs))
            .collect::<candle_core::Result<_>>()?;
        // Partial sums, added in task order.
        if shares > 1 {
            for (task, p) in tasks.iter().zip(&partials) {
                let base = (task.b * h + task.hk * group) * tq * d;
                for (x, y) in dq[base..base + group * tq * d].iter_mut().zip(&p.dq) {
                    *x += y;
                }
            }
        }
        let mut extras = self.term_grads(&tasks, &partials, group)?;
        if let (Some(extra), Some(w)) = (self.table, width) {
            let mut grad = zeroed(w * d, "fused training: value table gradient")?;
            for p in &partials {
                for (x, y) in grad.iter_mut().zip(&p.table) {
                    *x += y;
                }
            }
            extras[extra] = Some(self.extra(extra, grad)?);
        }
        if let (Some(extra), Some(sinks)) = (self.sinks, &spec.rule.sinks) {
            let grad = sink_grads(sinks, stats, &delta, spec.dims);
            extras[extra] = Some(self.extra(extra, grad)?);
        }
        let dev = candle_core::Device::Cpu;
        Ok(Grads {
            qkv: [
                Some(Tensor::from_vec(dq, (b, h, tq, d), &dev)?),
                Some(Tensor::from_vec(dk, (b, hkv, tk, d), &dev)?),
                Some(Tensor::from_vec(dv, (b, hkv, tk, d), &dev)?),
            ],
            extras,
        })
    }

    /// The backward's tasks, one per sequence, KV head and share of the key tiles (enough
    /// shares for twice the threads unless the tiles fix them), and the shares.
    fn tasks(&self, b: usize, hkv: usize) -> (Vec<Task>, usize) {
        let tk = self.spec.dims.3;
        let key_tiles = tk.div_ceil(self.tiles.keys).max(1);
        let threads = rayon::current_num_threads().max(1);
        let shares = self
            .tiles
            .shares
            .unwrap_or((2 * threads).div_ceil((b * hkv).max(1)))
            .clamp(1, key_tiles);
        let tasks = (0..b * hkv * shares)
            .map(|n| Task {
                b: n / (hkv * shares),
                hk: (n / shares) % hkv,
                share: n % shares,
            })
            .collect();
        (tasks, shares)
    }

    /// Every task's partial sums at once, budgeted before any is allocated.
    fn check_partials(
        &self,
        tasks: usize,
        shares: usize,
        group: usize,
        width: Option<usize>,
    ) -> candle_core::Result<()> {
        let (_, _, tq, _, d) = self.spec.dims;
        let per_task = self
            .terms
            .iter()
            .map(|t| (if t.dims[1] == 1 { 1 } else { group }) * t.dims[2] * t.dims[3])
            .chain([
                if shares > 1 { group * tq * d } else { 0 },
                match (self.table, width) {
                    (Some(_), Some(w)) => w * d,
                    _ => 0,
                },
            ])
            .fold(0usize, usize::saturating_add);
        check_elements(
            "fused training partial sums",
            format_args!("{tasks} tasks × {per_task}"),
            "the partial gradients of every task",
            &[tasks, per_task],
        )
        .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        Ok(())
    }

    /// The tracked terms' gradients, their tasks' partial sums added in task order, at their
    /// places among the extras (the other places `None`).
    fn term_grads(
        &self,
        tasks: &[Task],
        partials: &[Partial],
        group: usize,
    ) -> candle_core::Result<Vec<Option<Tensor>>> {
        let mut extras: Vec<Option<Tensor>> = vec![None; self.extras.len()];
        for (nth, term) in self.terms.iter().enumerate() {
            let [tb, th, tr, tw] = term.dims;
            let mut grad = zeroed(tb * th * tr * tw, "fused training: term gradient")?;
            for (task, p) in tasks.iter().zip(partials) {
                let part = &p.terms[nth];
                let heads = if th == 1 { 1 } else { group };
                let bb = if tb == 1 { 0 } else { task.b };
                let h0 = if th == 1 { 0 } else { task.hk * group };
                let base = (bb * th + h0) * tr * tw;
                for (x, y) in grad[base..base + heads * tr * tw].iter_mut().zip(part) {
                    *x += y;
                }
            }
            extras[term.extra] = Some(self.extra(term.extra, grad)?);
        }
        Ok(extras)
    }

    /// The gradient of extra `extra` as a tensor of its shape and dtype.
    fn extra(&self, extra: usize, grad: Vec<f32>) -> candle_core::Result<Tensor> {
        let (dims, dtype) = &self.extras[extra];
        Tensor::from_vec(grad, dims.as_slice(), &candle_core::Device::Cpu)?.to_dtype(*dtype)
    }
}

/// δ_i = dO_i · O_i, per (b, h, i), from dO and O `(B, Tq, H, D)`.
fn row_deltas(
    do_host: &[f32],
    o_host: &[f32],
    (b, h, tq, _, d): (usize, usize, usize, usize, usize),
) -> candle_core::Result<Vec<f32>> {
    let mut delta = zeroed(b * h * tq, "fused training: row deltas")?;
    delta.par_iter_mut().enumerate().for_each(|(r, x)| {
        let (bi, hi, i) = (r / (h * tq), (r / tq) % h, r % tq);
        let at = ((bi * tq + i) * h + hi) * d;
        *x = do_host[at..at + d]
            .iter()
            .zip(&o_host[at..at + d])
            .map(|(a, b)| a * b)
            .sum();
    });
    Ok(delta)
}

/// The sinks' gradient: dsink_h = −Σ_{b, i} p_sink δ_i, p_sink = e^(sink − m_i) / l_i.
fn sink_grads(
    sinks: &[f32],
    stats: &[f32],
    delta: &[f32],
    (_, h, tq, _, _): (usize, usize, usize, usize, usize),
) -> Vec<f32> {
    let mut grad = vec![0f64; h];
    for (r, dl) in delta.iter().enumerate() {
        let hi = (r / tq) % h;
        let (m, inv) = (stats[2 * r], stats[2 * r + 1]);
        let p = ((sinks[hi] - m) as f64).exp() * inv as f64;
        grad[hi] -= p * *dl as f64;
    }
    grad.into_iter().map(|x| x as f32).collect()
}

/// Everything the tasks read.
struct Ctx<'a> {
    spec: &'a CoreSpec,
    pass: &'a super::fused_softmax::RowPass<'a>,
    stats: &'a [f32],
    delta: &'a [f32],
    grad_o: &'a [f32],
    /// q `(B, H, Tq, D)`, k and v `(B, Hkv, Tk, D)`.
    views: [View; 3],
    /// The value table `(W, D)`, its columns and `W`.
    values: Option<(&'a [f32], &'a TileColumns<'a>, usize)>,
    terms: &'a [TermGrad],
    want_table: bool,
    group: usize,
    shares: usize,
    tiles: Tiles,
}

// SAFETY: the views only read storage held under read locks for the whole pass.
unsafe impl Sync for Ctx<'_> {}

/// One task's scratch buffers, sized for a tile and reused across its tiles.
struct Scratch {
    /// The tile's logits, then its weights.
    s: Vec<f32>,
    /// dP, then dS.
    dp: Vec<f32>,
    /// The raw logits (a soft cap only).
    raw: Vec<f32>,
    /// The weights after dropout (dropout only).
    pd: Vec<f32>,
    /// dO against the value table, rows × W.
    g: Vec<f32>,
    /// The key tile's keys and values transposed, (D, n): both products that read them as the
    /// right-hand side for every query tile then read them in place instead of gathering them
    /// column by column.
    kt: Vec<f32>,
    vt: Vec<f32>,
    /// The weights summed per value-table column, rows × W.
    sums: Vec<f32>,
    /// Mixed rows over a tile's columns, then their gradient.
    slab: Vec<f32>,
}

/// The key tile a task is on: keys `j0..j0 + n`, and where their rows and gradients are.
struct KeyTile {
    j0: usize,
    n: usize,
    kp: *const f32,
    dkp: *mut f32,
    dvp: *mut f32,
}

/// The query tile within a key tile: rows `i0..i0 + rows` of head `hi` (the `gi`-th of the
/// task's group).
#[derive(Clone, Copy)]
struct QueryTile {
    gi: usize,
    hi: usize,
    i0: usize,
    rows: usize,
    /// The first row's index in the statistics, `(b · H + hi) · Tq + i0`.
    r0: usize,
    /// dO's rows, `(B, Tq, H, D)` with row stride H·D.
    dop: *const f32,
}

impl Ctx<'_> {
    /// One task: every key tile of its share, every head of its group, every query tile that
    /// sees the key tile.
    fn run(&self, task: Task, outs: Outs) -> candle_core::Result<Partial> {
        let (_, h, tq, tk, d) = self.spec.dims;
        let mut partial = self.partial()?;
        let dq_base = match self.shares {
            1 => outs
                .dq
                .0
                .wrapping_add((task.b * h + task.hk * self.group) * tq * d),
            _ => partial.dq.as_mut_ptr(),
        };
        let mut scratch = self.scratch();
        let key_tiles = tk.div_ceil(self.tiles.keys);
        for jt in (task.share..key_tiles).step_by(self.shares) {
            let key = self.key_tile(&task, jt, &outs, &mut scratch);
            for gi in 0..self.group {
                let hi = task.hk * self.group + gi;
                for i0 in (0..tq).step_by(self.tiles.rows) {
                    let rows = self.tiles.rows.min(tq - i0);
                    if self.spec.skip {
                        let (lo, hi_key) = self.spec.rule.keys_seen(i0, i0 + rows, tk);
                        if hi_key <= key.j0 || lo >= key.j0 + key.n {
                            continue;
                        }
                    }
                    let at = ((task.b * tq + i0) * h + hi) * d;
                    let tile = QueryTile {
                        gi,
                        hi,
                        i0,
                        rows,
                        r0: (task.b * h + hi) * tq + i0,
                        dop: self.grad_o[at..].as_ptr(),
                    };
                    self.query_tile(&task, &key, tile, dq_base, &mut scratch, &mut partial);
                }
            }
        }
        Ok(partial)
    }

    /// The task's partial sums, zeroed: dQ when it does not own its heads', each gradient
    /// term's, the value table's.
    fn partial(&self) -> candle_core::Result<Partial> {
        let (_, _, tq, _, d) = self.spec.dims;
        let mut partial = Partial {
            dq: match self.shares {
                1 => Vec::new(),
                _ => zeroed(self.group * tq * d, "fused training: partial dq")?,
            },
            terms: Vec::new(),
            table: match (self.want_table, self.values) {
                (true, Some((_, _, w))) => {
                    zeroed(w * d, "fused training: partial value table gradient")?
                }
                _ => Vec::new(),
            },
        };
        for term in self.terms {
            let [_, th, tr, tw] = term.dims;
            let heads = if th == 1 { 1 } else { self.group };
            partial.terms.push(zeroed(
                heads * tr * tw,
                "fused training: partial term gradient",
            )?);
        }
        Ok(partial)
    }

    /// Scratch buffers for one task's tiles.
    fn scratch(&self) -> Scratch {
        let d = self.spec.dims.4;
        let (rows, keys) = (self.tiles.rows, self.tiles.keys);
        let tile = rows * keys;
        let width = self.values.map_or(0, |(_, _, w)| w);
        Scratch {
            s: vec![0f32; tile],
            dp: vec![0f32; tile],
            raw: vec![
                0f32;
                if self.spec.rule.softcap.is_some() {
                    tile
                } else {
                    0
                }
            ],
            pd: vec![0f32; if self.spec.dropout.is_some() { tile } else { 0 }],
            g: vec![0f32; rows * width],
            kt: vec![0f32; d * keys],
            vt: vec![0f32; d * keys],
            sums: vec![0f32; rows * width],
            slab: Vec::new(),
        }
    }

    /// Key tile `jt` of the task: its keys and values transposed into the scratch buffers, and
    /// where its rows and gradients are.
    fn key_tile(&self, task: &Task, jt: usize, outs: &Outs, scratch: &mut Scratch) -> KeyTile {
        let (_, h, _, tk, d) = self.spec.dims;
        let [_, k, v] = self.views;
        let j0 = jt * self.tiles.keys;
        let n = self.tiles.keys.min(tk - j0);
        // SAFETY: b < B, hk < Hkv, j0 < Tk: the rows lie in the views (checked against
        // storage in `View::new`).
        let (kp, vp) = unsafe { (k.at(task.b, task.hk, j0), v.at(task.b, task.hk, j0)) };
        let kv_row = ((task.b * (h / self.group) + task.hk) * tk + j0) * d;
        // SAFETY: dk and dv are (B, Hkv, Tk, D) contiguous; this task owns keys j0..j0 + n.
        let (dkp, dvp) = unsafe { (outs.dk.add(kv_row), outs.dv.add(kv_row)) };
        let targets = [
            (kp, k.strides[2], &mut scratch.kt),
            (vp, v.strides[2], &mut scratch.vt),
        ];
        for (src, stride, dst) in targets {
            for j in 0..n {
                // SAFETY: key j0 + j's D features lie in the view (unit stride).
                let row = unsafe { std::slice::from_raw_parts(src.add(j * stride), d) };
                for (p, x) in row.iter().enumerate() {
                    dst[p * n + j] = *x;
                }
            }
        }
        KeyTile {
            j0,
            n,
            kp,
            dkp,
            dvp,
        }
    }

    /// One query tile against one key tile: the weights recomputed, dP, and every gradient
    /// the tile adds to (dV, the value table, the terms, dQ, dK).
    fn query_tile(
        &self,
        task: &Task,
        key: &KeyTile,
        tile: QueryTile,
        dq_base: *mut f32,
        scratch: &mut Scratch,
        partial: &mut Partial,
    ) {
        let (_, h, tq, _, d) = self.spec.dims;
        let [q, k, _] = self.views;
        let (rows, n) = (tile.rows, key.n);
        let Scratch {
            s,
            dp,
            raw,
            pd,
            g,
            kt,
            vt,
            sums,
            slab,
        } = scratch;
        let (s, dp) = (&mut s[..rows * n], &mut dp[..rows * n]);
        // SAFETY: q rows i0..i0 + rows of head hi, keys j0..j0 + n lie in their views; s and dp
        // are rows × n; dO rows are (B, Tq, H, D) with row stride H·D, rows i0..i0 + rows of
        // head hi in bounds.
        unsafe {
            let qp = q.at(task.b, tile.hi, tile.i0);
            product(
                (rows, n, d),
                (s.as_mut_ptr(), n, false),
                (qp, 1, q.strides[2]),
                (kt.as_ptr(), 1, n),
            );
            product(
                (rows, n, d),
                (dp.as_mut_ptr(), n, false),
                (tile.dop, 1, h * d),
                (vt.as_ptr(), 1, n),
            );
        }
        let at = (task.b, tile.hi, tile.i0, rows);
        if self.pass.mixed_in_tiles() {
            self.pass.add_mixed_tile(at, (key.j0, n), s, slab);
        }
        if self.spec.rule.softcap.is_some() {
            raw[..rows * n].copy_from_slice(s);
        }
        for (li, row) in s.chunks_exact_mut(n).enumerate() {
            let r = tile.r0 + li;
            let (m, inv) = (self.stats[2 * r], self.stats[2 * r + 1]);
            self.pass.recompute_best(r, row, key.j0, m, inv);
        }
        self.value_term_into_dp(task, key, tile, g, dp);
        let weights: &[f32] = match &self.spec.dropout {
            Some(dropout) => {
                let pd = &mut pd[..rows * n];
                self.dropped_weights(dropout, task, key, tile, s, dp, pd);
                pd
            }
            None => s,
        };
        self.table_gradient(task, key, tile, weights, sums, &mut partial.table);
        // dV_J += α'ᵀ dO_I.
        // SAFETY: dv rows j0..j0 + n are this task's; weights is rows × n.
        unsafe {
            product(
                (n, d, rows),
                (key.dvp, d, true),
                (weights.as_ptr(), n, 1),
                (tile.dop, 1, h * d),
            );
        }
        self.scores_gradient(tile, s, dp);
        self.term_gradients((task.b, key), tile, dp, (&mut partial.terms, slab));
        if let Some(c) = self.spec.rule.softcap {
            for (x, r) in dp.iter_mut().zip(&raw[..rows * n]) {
                let t = (r / c).tanh();
                *x *= 1.0 - t * t;
            }
        }
        // SAFETY: this task's dQ rows (its own heads, or its partial buffer), dK rows
        // j0..j0 + n; dp is rows × n.
        unsafe {
            let dqp = dq_base.add((tile.gi * tq + tile.i0) * d);
            product(
                (rows, d, n),
                (dqp, d, true),
                (dp.as_ptr(), 1, n),
                (key.kp, 1, k.strides[2]),
            );
            product(
                (n, d, rows),
                (key.dkp, d, true),
                (dp.as_ptr(), n, 1),
                (q.at(task.b, tile.hi, tile.i0), 1, q.strides[2]),
            );
        }
    }

    /// The relative value term's share of dP: dP_ij += dO_i · a[c(i, j)].
    fn value_term_into_dp(
        &self,
        task: &Task,
        key: &KeyTile,
        tile: QueryTile,
        g: &mut [f32],
        dp: &mut [f32],
    ) {
        let Some((table, columns, w)) = self.values else {
            return;
        };
        let (_, h, tq, tk, d) = self.spec.dims;
        let g = &mut g[..tile.rows * w];
        // SAFETY: the table is W × D contiguous, g rows × W.
        unsafe {
            product(
                (tile.rows, w, d),
                (g.as_mut_ptr(), w, false),
                (tile.dop, 1, h * d),
                (table.as_ptr(), d, 1),
            );
        }
        for (li, (dprow, grow)) in dp
            .chunks_exact_mut(key.n)
            .zip(g.chunks_exact(w))
            .enumerate()
        {
            let i = tile.i0 + li;
            match columns {
                TileColumns::Shift(shift) => add_shifted_row(grow, i, *shift, key.j0, dprow),
                TileColumns::Index(index, ib) => {
                    let columns = index_row(index, *ib, (task.b, i, key.j0, key.n), tq, tk);
                    for (x, &c) in dprow.iter_mut().zip(columns) {
                        *x += grow[(c as usize).min(w - 1)];
                    }
                }
            }
        }
    }

    /// With dropout the products read α' = α ∘ f (f = 0 or 1 / (1 − ρ), drawn again from the
    /// seed), so dα = dα' ∘ f: `pd` becomes α', `dp` is scaled by f.
    #[allow(clippy::too_many_arguments)]
    fn dropped_weights(
        &self,
        dropout: &super::dropout::Dropout,
        task: &Task,
        key: &KeyTile,
        tile: QueryTile,
        s: &[f32],
        dp: &mut [f32],
        pd: &mut [f32],
    ) {
        let n = key.n;
        for (li, ((prow, dprow), drow)) in s
            .chunks_exact(n)
            .zip(dp.chunks_exact_mut(n))
            .zip(pd.chunks_exact_mut(n))
            .enumerate()
        {
            drow.fill(1.0);
            let pos = self.spec.rule.first + tile.i0 + li;
            dropout.apply((task.b, tile.hi, pos), key.j0, drow);
            for ((x, f), p) in dprow.iter_mut().zip(drow.iter_mut()).zip(prow) {
                *x *= *f;
                *f *= p;
            }
        }
    }

    /// The value table's gradient: da += Σ_i (Σ_{j: c(i, j) = c} α'_ij) dO_i.
    fn table_gradient(
        &self,
        task: &Task,
        key: &KeyTile,
        tile: QueryTile,
        weights: &[f32],
        sums: &mut [f32],
        table: &mut [f32],
    ) {
        let (Some((_, columns, w)), true) = (self.values, self.want_table) else {
            return;
        };
        let (_, h, tq, tk, d) = self.spec.dims;
        let sums = &mut sums[..tile.rows * w];
        sums.iter_mut().for_each(|x| *x = 0.0);
        for (li, (row, srow)) in weights
            .chunks_exact(key.n)
            .zip(sums.chunks_exact_mut(w))
            .enumerate()
        {
            let i = tile.i0 + li;
            match columns {
                TileColumns::Shift(shift) => {
                    self.pass
                        .add_shifted_sums_best(row, (i, *shift, key.j0), srow)
                }
                TileColumns::Index(index, ib) => {
                    let columns = index_row(index, *ib, (task.b, i, key.j0, key.n), tq, tk);
                    add_indexed_sums(row, columns, srow);
                }
            }
        }
        // SAFETY: sums is rows × W, the partial W × D.
        unsafe {
            product(
                (w, d, tile.rows),
                (table.as_mut_ptr(), d, true),
                (sums.as_ptr(), w, 1),
                (tile.dop, 1, h * d),
            );
        }
    }

    /// dS = P ∘ (dP − δ), into `dp` (0 on a row masked whole, whose weights are constants).
    fn scores_gradient(&self, tile: QueryTile, s: &[f32], dp: &mut [f32]) {
        let n = s.len() / tile.rows.max(1);
        for (li, (prow, dprow)) in s.chunks_exact(n).zip(dp.chunks_exact_mut(n)).enumerate() {
            let r = tile.r0 + li;
            if self.stats[2 * r] == f32::MIN {
                dprow.iter_mut().for_each(|x| *x = 0.0);
                continue;
            }
            let dl = self.delta[r];
            for (x, p) in dprow.iter_mut().zip(prow) {
                *x = p * (*x - dl);
            }
        }
    }

    /// Each tracked term's gradient, dS summed as the term is read: per shifted column, per
    /// key, or whole; a separable pair's per row (its queries' values) and per key (its keys'),
    /// over the keys it covers.
    fn term_gradients(
        &self,
        (bi, key): (usize, &KeyTile),
        tile: QueryTile,
        ds: &[f32],
        (parts, slab): (&mut [Vec<f32>], &mut Vec<f32>),
    ) {
        let n = key.n;
        for (term, part) in self.terms.iter().zip(parts.iter_mut()) {
            let [_, th, tr, tw] = term.dims;
            let hrow = if th == 1 { 0 } else { tile.gi };
            let strided = &self.spec.terms[term.index];
            if strided.mixed.is_some() && self.pass.mixed_in_tiles() {
                let at = (bi, tile.hi, tile.i0, tile.rows);
                let grads = &mut part[hrow * tw..(hrow + 1) * tw];
                self.pass
                    .add_mixed_tile_grads(term.index, at, (key.j0, n), ds, (grads, slab));
                continue;
            }
            for (li, dsrow) in ds.chunks_exact(n).enumerate() {
                let i = tile.i0 + li;
                let rrow = if tr == 1 { 0 } else { i };
                let at = (hrow * tr + rrow) * tw;
                let dst = &mut part[at..at + tw];
                if strided.mixed.is_some() {
                    let at = (bi, tile.hi, i, key.j0);
                    self.pass.add_mixed_grads_best(term.index, at, dsrow, dst);
                    continue;
                }
                if let Some((tq, side)) = strided.separable {
                    let (lo, up) = side.range(i, key.j0, n);
                    dst[i] += dsrow[lo..up].iter().sum::<f32>();
                    let keys = &mut dst[tq + key.j0 + lo..tq + key.j0 + up];
                    for (x, y) in keys.iter_mut().zip(&dsrow[lo..up]) {
                        *x += y;
                    }
                    continue;
                }
                match strided.relative {
                    Some((shift, _)) => {
                        self.pass
                            .add_shifted_sums_best(dsrow, (i, shift, key.j0), dst)
                    }
                    None if tw == 1 => dst[0] += dsrow.iter().sum::<f32>(),
                    None => {
                        for (x, y) in dst[key.j0..key.j0 + n].iter_mut().zip(dsrow) {
                            *x += y;
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var, D};

    use super::*;
    use crate::attention::dropout::Dropout;
    use crate::attention::fused_softmax::RowRule;
    use crate::attention::mask::{apply_keep_mask, keep_mask};
    use crate::matmul::matmul;
    use crate::plug::{Columns, RelativeBias, RelativeValues};

    /// The operands of one check: every tensor a gradient can reach is a `Var`.
    struct Case {
        q: Var,
        k: Var,
        v: Var,
        dense: Var,
        rows: Var,
        table: Var,
        sinks: Var,
        probe: Tensor,
    }

    impl Case {
        fn new(
            (b, h, hkv, tq, tk, d, w): (usize, usize, usize, usize, usize, usize, usize),
            dev: &Device,
        ) -> anyhow::Result<Self> {
            let r = |shape: &[usize], s: f64| crate::seeded::randn(0f32, s as f32, shape, dev);
            Ok(Self {
                q: Var::from_tensor(&r(&[b, h, tq, d], 1.5)?)?,
                k: Var::from_tensor(&r(&[b, hkv, tk, d], 1.0)?)?,
                v: Var::from_tensor(&r(&[b, hkv, tk, d], 1.0)?)?,
                dense: Var::from_tensor(&r(&[1, h, 1, tk], 1.0)?)?,
                rows: Var::from_tensor(&r(&[b, h, tq, w], 1.0)?)?,
                table: Var::from_tensor(&r(&[w, d], 1.0)?)?,
                sinks: Var::from_tensor(&r(&[h], 1.0)?)?,
                probe: r(&[b, tq, h, d], 1.0)?,
            })
        }

        /// The fused training core over these operands, a dense per-key term and `relative`
        /// rows, with the forward's `(query, key)` tiles and the backward's `tiles`.
        fn attend(
            &self,
            (relative, values, padding, rule): (
                &RelativeBias,
                &RelativeValues,
                Option<&Tensor>,
                &RowRule,
            ),
            (tile, key_tile): (usize, usize),
            tiles: Tiles,
            dropout: Option<Dropout>,
        ) -> Result<Tensor> {
            TrainCore {
                core: Core {
                    q: self.q.as_tensor(),
                    k: self.k.as_tensor(),
                    v: self.v.as_tensor(),
                    dense: vec![self.dense.as_tensor()],
                    dense_masks: false,
                    relative: vec![relative],
                    separable: vec![],
                    padding,
                    rule,
                    values: Some(values),
                    tile,
                    key_tile,
                },
                sinks: rule.sinks.as_ref().map(|_| self.sinks.as_tensor()),
                tiles,
                dropout,
            }
            .attend()
        }

        fn vars(&self) -> [(&'static str, &Var); 7] {
            [
                ("q", &self.q),
                ("k", &self.k),
                ("v", &self.v),
                ("dense", &self.dense),
                ("rows", &self.rows),
                ("table", &self.table),
                ("sinks", &self.sinks),
            ]
        }
    }

    /// The same attention as candle ops (repeated heads, dense logits, candle's softmax and
    /// autograd): `(B, Tq, H, D)`.
    fn reference(
        c: &Case,
        relative: &RelativeBias,
        values: &RelativeValues,
        padding: Option<&Tensor>,
        rule: &RowRule,
        dropout: Option<&Dropout>,
    ) -> anyhow::Result<Tensor> {
        let (b, h, tq, d) = c.q.dims4()?;
        let (_, hkv, tk, _) = c.k.dims4()?;
        let rep = |t: &Tensor| -> anyhow::Result<Tensor> {
            Ok(t.unsqueeze(2)?
                .broadcast_as((b, hkv, h / hkv, tk, d))?
                .reshape((b, h, tk, d))?)
        };
        let mut s = matmul(&c.q, &rep(&c.k)?.t()?)?;
        if let Some(cap) = rule.softcap {
            let cap = f64::from(cap);
            s = ((s / cap)?.tanh()? * cap)?;
        }
        s = s.broadcast_add(c.dense.as_tensor())?;
        s = s.broadcast_add(&relative.to_dense(tq, tk)?)?;
        if let Some(keep) = keep_mask(rule, padding, b, tq, tk, c.q.device())? {
            s = apply_keep_mask(&s, &keep)?;
        }
        if rule.sinks.is_some() {
            let column = c.sinks.reshape((1, h, 1, 1))?.broadcast_as((b, h, tq, 1))?;
            s = Tensor::cat(&[&s, &column], 3)?;
        }
        let mut p = candle_nn::ops::softmax(&s, D::Minus1)?;
        if rule.sinks.is_some() {
            p = p.narrow(3, 0, tk)?;
        }
        if let Some(dropout) = dropout {
            // The same draws as a dense mask of factors.
            let mut factors = Vec::with_capacity(b * h * tq * tk);
            for (bi, hi, i) in
                (0..b).flat_map(|bi| (0..h).flat_map(move |hi| (0..tq).map(move |i| (bi, hi, i))))
            {
                factors.extend(dropout.factors((bi, hi, rule.first + i), tk));
            }
            let factors = Tensor::from_vec(factors, (b, h, tq, tk), c.q.device())?;
            let factors = factors.to_dtype(p.dtype())?;
            p = (p * factors)?;
        }
        Ok((matmul(&p, &rep(&c.v)?)? + values.weighted_sum(&p)?)?.transpose(1, 2)?)
    }

    /// The gradients of `Σ out · probe` with respect to every variable, by name.
    fn grads(c: &Case, out: &Tensor) -> anyhow::Result<Vec<(&'static str, Option<Tensor>)>> {
        let g = (out * &c.probe)?.sum_all()?.backward()?;
        Ok(c.vars()
            .iter()
            .map(|(n, v)| (*n, g.get(v.as_tensor()).cloned()))
            .collect())
    }

    /// The fused backward against candle's autograd of the same attention, within 1e-5 of
    /// each gradient's largest entry: grouped heads, a dense per-key term, rows per query read
    /// at a shift (Shaw's keys), a value table read at a shift and through an index map,
    /// padding that masks rows whole, every row rule (causal, windows, chunks, a soft cap,
    /// sinks), attention dropout (the reference multiplies by the same draws), and tiles and
    /// shares from one query row and one key up. The outputs agree too.
    #[test]
    fn backward_equals_candle_autograd() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let dims @ (b, _, _, tq, tk, _, w) = (2, 4, 2, 11, 14, 8, 5);
        let case = Case::new(dims, &dev)?;
        let first = tk - tq;
        let map: Vec<u32> = (0..b * tq * tk).map(|n| (n * 7 % (w + 2)) as u32).collect();
        let map = Tensor::from_vec(map, (b, tq, tk), &dev)?;
        // Batch item 0: its first 6 keys padded, so its first causal rows are masked whole.
        let mut keep = vec![1u8; b * tk];
        keep[..6].fill(0);
        keep[tk + 9] = 0;
        let padding = Tensor::from_vec(keep, (b, tk), &dev)?;
        let causal = RowRule::causal(first);
        let rules = [
            RowRule::default(),
            causal.clone(),
            RowRule {
                window: Some(4),
                ..causal.clone()
            },
            RowRule {
                first,
                window: Some(3),
                ..RowRule::default()
            },
            RowRule {
                chunk: Some(4),
                ..causal.clone()
            },
            RowRule {
                softcap: Some(1.5),
                sinks: Some(vec![]),
                ..causal.clone()
            },
            RowRule {
                softcap: Some(2.0),
                sinks: Some(vec![]),
                window: Some(5),
                ..RowRule::default()
            },
        ];
        let sink_values = case.sinks.as_tensor().to_vec1::<f32>()?;
        let relative =
            RelativeBias::new(case.rows.as_tensor().clone(), Columns::Shift(w as i64 / 2))?;
        let value_terms = [
            RelativeValues::new(case.table.as_tensor().clone(), Columns::Shift(2))?,
            RelativeValues::new(case.table.as_tensor().clone(), Columns::Index(map))?,
        ];
        // Under Miri (which interprets every pointer the tiles form), one rule with every term,
        // padding and dropout, on small tiles in shares.
        #[cfg(miri)]
        let rules = [rules[5].clone()];
        for rule in &rules {
            let rule = RowRule {
                sinks: rule.sinks.as_ref().map(|_| sink_values.clone()),
                ..rule.clone()
            };
            let dropouts = [None, Some(Dropout { p: 0.3, seed: 9 })];
            for (pad, dropout) in [None, Some(&padding)]
                .into_iter()
                .flat_map(|p| dropouts.map(|d| (p, d)))
                .filter(|(p, d)| !cfg!(miri) || (p.is_some() && d.is_some()))
            {
                for values in &value_terms {
                    let reference =
                        reference(&case, &relative, values, pad, &rule, dropout.as_ref())?;
                    let want = grads(&case, &reference)?;
                    let tiles = [
                        (64, 256, None),
                        (1, 1, Some(3)),
                        (4, 5, Some(2)),
                        (3, 14, None),
                    ];
                    #[cfg(miri)]
                    let tiles = [tiles[2]];
                    for (rows, keys, shares) in tiles {
                        let out = case.attend(
                            (&relative, values, pad, &rule),
                            (4, 6),
                            Tiles { rows, keys, shares },
                            dropout,
                        )?;
                        let diff = (&out - &reference)?.abs()?.max_all()?.to_scalar::<f32>()?;
                        assert!(diff < 1e-5, "output: {rule:?} {dropout:?}: {diff:e}");
                        let got = grads(&case, &out)?;
                        for ((name, want), (_, got)) in want.iter().zip(&got) {
                            let what = format!(
                                "{name}: {rule:?} padded {} {:?} {dropout:?} tiles {rows}×{keys}/{shares:?}",
                                pad.is_some(),
                                values.columns()
                            );
                            match (want, got) {
                                (None, None) => {}
                                (Some(want), Some(got)) => {
                                    let top = want.abs()?.max_all()?.to_scalar::<f32>()?;
                                    let diff =
                                        (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
                                    assert!(top > 0.0, "{what}: zero gradient");
                                    assert!(
                                        diff <= 1e-5 * top.max(1.0),
                                        "{what}: {diff:e} of {top}"
                                    );
                                }
                                _ => panic!("{what}: one side has no gradient"),
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Mixed rows (a mix per query of a shared bank) through the fused core, against the
    /// rows they stand for under candle's autograd: the output and the gradients of q, k, v,
    /// the mix and the bank within 1e-5 of each gradient's largest entry. Tiles of more rows
    /// than one product of the mix takes, and fewer; bidirectional, causal, windows, chunks
    /// and padding (the rows' tiles), and a soft cap with sinks (added row by row); a mix
    /// shared by the batch.
    #[test]
    fn mixed_rows_backward_equals_candle_autograd() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let dims @ (b, h, _, tq, tk, _, w) = (2, 4, 2, 40, 45, 8, 30);
        let case = Case::new(dims, &dev)?;
        let rank = 3;
        let mut keep = vec![1u8; b * tk];
        keep[..7].fill(0);
        keep[tk + 20] = 0;
        let padding = Tensor::from_vec(keep, (b, tk), &dev)?;
        let causal = RowRule::causal(tk - tq);
        let sinks = case.sinks.as_tensor().to_vec1::<f32>()?;
        let rules = [
            RowRule::default(),
            causal.clone(),
            RowRule {
                window: Some(9),
                ..causal.clone()
            },
            RowRule {
                chunk: Some(16),
                ..causal.clone()
            },
            RowRule {
                softcap: Some(1.5),
                sinks: Some(sinks),
                ..causal.clone()
            },
        ];
        let table =
            RelativeValues::new(Tensor::zeros((w, 8), DType::F32, &dev)?, Columns::Shift(0))?;
        for mix_batch in [b, 1] {
            let mix = crate::seeded::var_randn(0f32, 1.0, (mix_batch, h, tq, rank), &dev)?;
            let bank = crate::seeded::var_randn(0f32, 1.0, (rank, w), &dev)?;
            let relative = RelativeBias::mixed(
                mix.as_tensor().clone(),
                bank.as_tensor().clone(),
                Columns::Shift(w as i64 / 2 - 3),
            )?;
            for rule in &rules {
                for pad in [None, Some(&padding)] {
                    let reference = reference(&case, &relative, &table, pad, rule, None)?;
                    let g_want = (&reference * &case.probe)?.sum_all()?.backward()?;
                    for (rows, keys, shares) in [(64, 256, None), (20, 7, Some(2)), (5, 45, None)] {
                        let out = case.attend(
                            (&relative, &table, pad, rule),
                            (24, 10),
                            Tiles { rows, keys, shares },
                            None,
                        )?;
                        let diff = (&out - &reference)?.abs()?.max_all()?.to_scalar::<f32>()?;
                        assert!(diff < 1e-5, "output: {rule:?}: {diff:e}");
                        let g_got = (&out * &case.probe)?.sum_all()?.backward()?;
                        let vars = [
                            ("q", &case.q),
                            ("k", &case.k),
                            ("v", &case.v),
                            ("mix", &mix),
                            ("bank", &bank),
                        ];
                        for (name, var) in vars {
                            let want = g_want.get(var.as_tensor()).expect("a gradient");
                            let got = g_got.get(var.as_tensor()).expect("a gradient");
                            let top = want.abs()?.max_all()?.to_scalar::<f32>()?;
                            let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
                            assert!(
                                diff <= 1e-5 * top.max(1.0),
                                "{name}: {rule:?} padded {} mix batch {mix_batch} tiles {rows}×{keys}: {diff:e} of {top}",
                                pad.is_some()
                            );
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The fused backward against central finite differences of the same attention computed
    /// in f64 (candle's ops on f64 copies of every operand, step 1e-4): every entry of the
    /// gradients of q, k, v, a dense per-key term, Shaw-like rows per query, a value table and
    /// the sinks, within 1e-4 of each gradient's largest entry (the fused pass runs in f32).
    /// Causal with a soft cap, sinks and dropout; bidirectional with padding that masks a
    /// row whole.
    #[test]
    fn backward_equals_finite_differences_in_f64() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let dims @ (b, _, _, tq, tk, _, _) = (2, 2, 1, 4, 5, 3, 3);
        let case = Case::new(dims, &dev)?;
        let mut keep = vec![1u8; b * tk];
        keep[..4].fill(0); // batch item 0 sees only its last key: a bidirectional row
        keep[tk + 1] = 0;
        let padding = Tensor::from_vec(keep, (b, tk), &dev)?;
        let sinks = case.sinks.as_tensor().to_vec1::<f32>()?;
        let cases = [
            (
                RowRule {
                    softcap: Some(1.5),
                    sinks: Some(sinks),
                    ..RowRule::causal(tk - tq)
                },
                None,
                Some(Dropout { p: 0.25, seed: 3 }),
            ),
            (RowRule::default(), Some(&padding), None),
        ];
        for (rule, pad, dropout) in &cases {
            let relative = RelativeBias::new(case.rows.as_tensor().clone(), Columns::Shift(1))?;
            let values = RelativeValues::new(case.table.as_tensor().clone(), Columns::Shift(0))?;
            let tiles = Tiles {
                rows: 3,
                keys: 2,
                shares: Some(2),
            };
            let out = case.attend((&relative, &values, *pad, rule), (2, 3), tiles, *dropout)?;
            let got = grads(&case, &out)?;
            // The loss in f64 with one operand's entry moved.
            let vars = case.vars();
            let host: Vec<Vec<f64>> = vars
                .iter()
                .map(|(_, v)| Ok(v.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?))
                .collect::<anyhow::Result<_>>()?;
            let loss = |which: usize, at: usize, by: f64| -> anyhow::Result<f64> {
                let t = |i: usize| -> anyhow::Result<Var> {
                    let mut v = host[i].clone();
                    if i == which {
                        v[at] += by;
                    }
                    Ok(Var::from_tensor(&Tensor::from_vec(
                        v,
                        vars[i].1.shape(),
                        &dev,
                    )?)?)
                };
                let c = Case {
                    q: t(0)?,
                    k: t(1)?,
                    v: t(2)?,
                    dense: t(3)?,
                    rows: t(4)?,
                    table: t(5)?,
                    sinks: t(6)?,
                    probe: case.probe.to_dtype(DType::F64)?,
                };
                let relative = RelativeBias::new(c.rows.as_tensor().clone(), Columns::Shift(1))?;
                let values = RelativeValues::new(c.table.as_tensor().clone(), Columns::Shift(0))?;
                let out = reference(&c, &relative, &values, *pad, rule, dropout.as_ref())?;
                Ok((out * &c.probe)?.sum_all()?.to_scalar::<f64>()?)
            };
            for (which, ((name, _), (_, grad))) in vars.iter().zip(&got).enumerate() {
                let Some(grad) = grad else {
                    assert!(
                        rule.sinks.is_none() && *name == "sinks",
                        "{name}: no gradient"
                    );
                    continue;
                };
                let grad = grad.flatten_all()?.to_vec1::<f32>()?;
                let top = grad.iter().fold(0f32, |m, g| m.max(g.abs())).max(1.0) as f64;
                for (at, g) in grad.iter().enumerate() {
                    let h = 1e-4;
                    let fd = (loss(which, at, h)? - loss(which, at, -h)?) / (2.0 * h);
                    assert!(
                        (fd - *g as f64).abs() <= 1e-4 * top,
                        "{name}[{at}] {rule:?}: finite difference {fd} against {g}"
                    );
                }
            }
        }
        Ok(())
    }
}
