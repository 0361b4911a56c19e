//! An inference call's whole block in one pass, on the CPU in f32.
//!
//! ```text
//! q = s·(x W_qᵀ + b_q),  k = x W_kᵀ + b_k,  v = x W_vᵀ + b_v     heads first, (B, H, T, D)
//! q, k = the rotation's (an encoding that declares `rotation_only`), if any
//! O = softmax(q kᵀ, the block's rule and padding) v              (B, T, H, D)
//! y = O W_oᵀ + b_o                                               O read as rows of H·D
//! ```
//!
//! The pipeline makes q, k, v and O as tensors, four allocations the size of the chunk that
//! are freed when the call returns; the allocator hands memory that large back to the system,
//! and every call took its pages again (a page fault each, about a tenth of a B2 T1024 call).
//! Here they are buffers kept across calls (`cpu::workspace`), and only the output is new.
//! The block takes this pass where the training node would apply but nothing tracks
//! gradients (`MultiHeadAttention`'s `one_node` decides); q and k handed to a rotation become
//! tensors the rotation may keep: they are allocated for the call and not kept.

use candle_core::{CpuStorage, Layout, Storage, Tensor};

use super::fused_attention::{CoreSpec, OutPtr};
use super::fused_softmax::read_storage;
use super::train_node::{with_linear, with_values, Parts};
use crate::cpu::gemm::{Place, Product};
use crate::cpu::linear_node::heads_into;
use crate::cpu::{gemm, workspace, zeroed};
use crate::error::Result;

/// The block's output `(B, T, d_model)`, or `None` where the pass does not apply (another
/// device or dtype than f32 on the CPU, or weights of other shapes than the block's); the
/// caller then runs the block's pipeline.
///
/// # Errors
/// A buffer cannot be allocated; what the rotation returns; candle's errors.
pub(crate) fn forward(parts: &Parts) -> Result<Option<Tensor>> {
    let Some((b, t, d_model)) = parts.f32_cpu_dims() else {
        return Ok(None);
    };
    let (h, hkv, d) = parts.heads;
    if !weights_fit(parts, d_model) {
        return Ok(None);
    }
    let x = parts.x.contiguous()?;
    let [q, k, v] = project(parts, &x, (b, t, d_model))?;
    let kv_layout = Layout::contiguous((b, hkv, t, d));
    let q_layout = Layout::contiguous((b, h, t, d));
    let spec = CoreSpec::plain((b, h, t, t, d), &parts.rule, parts.padding)?;
    let mut o = workspace::take(b * t * h * d, "inference block: attention output")?;
    let out = OutPtr(o.as_mut_ptr());
    let v = CpuStorage::F32(v);
    match &parts.rotation {
        None => {
            let (q, k) = (CpuStorage::F32(q), CpuStorage::F32(k));
            spec.run(
                [(&q, &q_layout), (&k, &kv_layout), (&v, &kv_layout)],
                out,
                t,
                None,
            )?;
            keep(q);
            keep(k);
        }
        Some(rotation) => {
            let dev = x.device();
            let q = Tensor::from_vec(q, (b, h, t, d), dev)?;
            let k = Tensor::from_vec(k, (b, hkv, t, d), dev)?;
            let (q, k) = rotation.apply(q, k, false)?;
            if q.track_op() || k.track_op() {
                // A rotation with parameters of its own that train: the pipeline keeps it in
                // candle's graph.
                keep(v);
                workspace::keep(o);
                return Ok(None);
            }
            let guards = [&q, &k].map(read_storage);
            let [q, k] = guards.each_ref().map(|(g, l)| match &***g {
                Storage::Cpu(s) => Ok((s, *l)),
                _ => candle_core::bail!("inference block: rotated q and k must be CPU tensors"),
            });
            spec.run([q?, k?, (&v, &kv_layout)], out, t, None)?;
        }
    }
    keep(v);
    let mut y = zeroed(b * t * d_model, "inference block: output")?;
    with_linear(parts.linears[3], |w, bias| {
        gemm::linear(&mut y, (&o, w, bias), (b * t, d_model, h * d), 1.0)
    })?;
    workspace::keep(o);
    Ok(Some(Tensor::from_vec(y, (b, t, d_model), x.device())?))
}

/// Whether each projection's weight and bias have the block's shapes (q and o `H·D` wide, k
/// and v `Hkv·D`), which the products below take on trust.
fn weights_fit(parts: &Parts, d_model: usize) -> bool {
    let (h, hkv, d) = parts.heads;
    let shapes = [
        (h * d, d_model),
        (hkv * d, d_model),
        (hkv * d, d_model),
        (d_model, h * d),
    ];
    parts.linears.iter().zip(shapes).all(|(l, (out, inner))| {
        l.weight().dims() == [out, inner] && l.bias().is_none_or(|b| b.dims() == [out])
    })
}

/// q (scaled), k and v heads first: v in a kept buffer, q and k too unless a rotation will
/// take them (as tensors it may keep). A few rows are one fork for all three
/// (`gemm::few_rows`).
fn project(
    parts: &Parts,
    x: &Tensor,
    (b, t, d_model): (usize, usize, usize),
) -> Result<[Vec<f32>; 3]> {
    let (h, hkv, d) = parts.heads;
    let heads = [h, hkv, hkv];
    let mut ys: [Vec<f32>; 3] = Default::default();
    for (i, y) in ys.iter_mut().enumerate() {
        let (n, what) = (b * heads[i] * t * d, "inference block: projection");
        *y = match parts.rotation.is_some() && i < 2 {
            true => zeroed(n, what)?,
            false => workspace::take(n, what)?,
        };
    }
    let scales = [parts.q_scale, 1.0, 1.0];
    let rows = b * t;
    with_values(x, |x| {
        if rows > gemm::FEW_ROWS || d_model == 0 {
            for (i, y) in ys.iter_mut().enumerate() {
                with_linear(parts.linears[i], |w, bias| {
                    let dims = (rows, heads[i] * d, d_model);
                    heads_into(y, (x, w, bias), dims, (t, heads[i], d), scales[i])
                })?;
            }
            return Ok(());
        }
        let [q, k, v, _] = parts.linears;
        with_linear(q, |wq, bq| {
            with_linear(k, |wk, bk| {
                with_linear(v, |wv, bv| {
                    let weights = [(wq, bq), (wk, bk), (wv, bv)];
                    let mut products: Vec<Product> = ys
                        .iter_mut()
                        .zip(weights)
                        .enumerate()
                        .map(|(i, (y, (w, bias)))| Product {
                            y,
                            w,
                            bias,
                            out: heads[i] * d,
                            scale: scales[i],
                            place: Place::Heads {
                                len: t,
                                heads: heads[i],
                                d,
                            },
                        })
                        .collect();
                    gemm::few_rows(x, (rows, d_model), &mut products)
                })
            })
        })
    })?;
    Ok(ys)
}

/// Keeps a buffer the pass made its storage.
fn keep(storage: CpuStorage) {
    if let CpuStorage::F32(values) = storage {
        workspace::keep(values);
    }
}
