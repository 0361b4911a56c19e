//! The block's linear projections, `y = x Wᵀ + b`, on the CPU without candle's per-call cost.
//!
//! ```text
//! x: (…, in)   W: (out, in)   b: (out)   →   y: (…, out)
//! ```
//!
//! candle 0.11's CPU matmul asks for the number of threads on every call, and without
//! `RAYON_NUM_THREADS` set that reads `/proc/cpuinfo`: 30–40 µs per call, three projections and
//! the output one per decoding step, where the whole step is 0.2–0.4 ms. When nothing tracks
//! gradients and everything is on the CPU, the products run here instead:
//! - a few rows (a decoding step's tokens, up to [`FEW_ROWS`]): the queries', keys' and
//!   values' projections as one parallel pass over the rows of their weights, each task a run
//!   of up to 64 output features of one matrix multiplied by `gemm` in f32 whatever the
//!   weights' dtype (half-precision runs widened into the thread's buffer first, never the
//!   whole matrix, which candle's half matmul widens on every call; bf16 runs as the CPU's own
//!   bf16 dot products where it has AVX-512 BF16), rounded once to the weights' dtype;
//! - more rows: bf16 on its own values where the CPU has AVX-512 BF16 (`cpu::bf16_gemm`, twice
//!   the f32 rate), else `gemm` directly (the crate candle's matmul calls) in f32 (half
//!   precision widened, x once for all three projections, each weight once per call); sums in
//!   f32, the bias added before the one rounding to the dtype;
//! - otherwise (gradients, other dtypes and devices) candle's `Linear`, unchanged.

use std::cell::RefCell;

use candle_core::{CpuStorage, DType, Storage, Tensor};
use candle_nn::Linear;
use half::{bf16, f16, slice::HalfFloatSliceExt};
use rayon::prelude::*;

use super::widen::Widen;
use crate::cpu::gemm::product;
use crate::error::{Error, Result};
use crate::matmul;

/// The tensors a projection holds: its weight and its bias, if it has one.
pub(crate) fn parts(linear: &Linear) -> impl Iterator<Item = &Tensor> {
    std::iter::once(linear.weight()).chain(linear.bias())
}

/// Rows (tokens) up to which the projections run as one pass over all their weights.
pub(crate) const FEW_ROWS: usize = 4;

/// `layer.forward(x)`, `y = x Wᵀ + b`, without candle 0.11's per-call CPU costs: the product
/// the attention block uses for its own projections, for the rest of a model built around it
/// (an MLP, an LM head).
///
/// On the CPU, for tensors that track no gradients, in f32, bf16 or f16: a few rows (a
/// decoding step's token) as one parallel pass over the weight's rows; more rows by `gemm` in
/// f32. bf16 runs on the CPU's own bf16 products where it has AVX-512 BF16, and is otherwise
/// widened to f32 like f16 (a tile at a time for a few rows, once per call for more).
/// Products and bias are summed in f32 and rounded once to the dtype, as candle's CPU matmul
/// sums a bf16 product (its f16 one rounds after each block of `gemm`'s depth, and its
/// `Linear` rounds a half-precision product again after adding the bias). Anything else
/// (gradients, another dtype or device) is candle-nn's `Linear::forward`, so this is a
/// drop-in for it.
///
/// # Shapes
/// - `x`: `(…, in)`, `layer`'s weight `(out, in)`, its bias `(out)`;
/// - returns `(…, out)` in `x`'s dtype.
///
/// # Errors
/// When the output would hold more than [`crate::limits::max_elements`] elements; when `x`'s
/// last dimension is not the weight's `in`, or `x`, the weight and the bias differ in dtype or
/// device (candle's error); when an output or a widened copy cannot be allocated.
///
/// # Example
/// ```
/// use candle_core::{DType, Device, Tensor};
/// use candle_nn::{Linear, Module};
///
/// let dev = Device::Cpu;
/// let w = Tensor::randn(0f32, 1.0, (8, 16), &dev)?.to_dtype(DType::BF16)?;
/// let layer = Linear::new(w, None);
/// let x = Tensor::randn(0f32, 1.0, (2, 3, 16), &dev)?.to_dtype(DType::BF16)?;
/// let y = candle_posenc::attention::linear(&layer, &x)?;
/// assert_eq!(y.dims(), &[2, 3, 8]);
/// let want = layer.forward(&x)?;
/// let diff = (y.to_dtype(DType::F32)? - want.to_dtype(DType::F32)?)?;
/// // The same f32 sums, rounded once to bf16: equal up to one rounding of their order.
/// let scale = want.to_dtype(DType::F32)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(diff.abs()?.max_all()?.to_scalar::<f32>()? <= scale / 128.0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn linear(layer: &Linear, x: &Tensor) -> Result<Tensor> {
    // The output's size against the budget first: x's leading axes may be huge with no
    // features at all (`(2^40, 0)` holds nothing).
    if let (Some((_, lead)), Ok((out, _))) = (x.dims().split_last(), layer.weight().dims2()) {
        let rows = lead.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        crate::limits::check_elements(
            "linear",
            format_args!("x {:?} through a weight of {out} rows", x.dims()),
            "rows × output features",
            &[rows.unwrap_or(usize::MAX), out],
        )?;
    }
    let ys = match few_rows(&[layer], x)? {
        Some(ys) => Some(ys),
        None => direct(&[layer], x)?,
    };
    match ys.and_then(|mut ys| ys.pop()) {
        Some(y) => Ok(y),
        None => matmul::linear(layer, x),
    }
}

/// `[linear(x) for linear in linears]`: a few rows of CPU tensors that track nothing in one
/// parallel pass over all the weights ([`FEW_ROWS`]), more by [`direct`] (x widened once for
/// all of them), else one candle `Linear` each.
pub(crate) fn project_all(linears: &[&Linear], x: &Tensor) -> Result<Vec<Tensor>> {
    if let Some(ys) = few_rows(linears, x)? {
        return Ok(ys);
    }
    match direct(linears, x)? {
        Some(ys) => Ok(ys),
        None => linears.iter().map(|l| matmul::linear(l, x)).collect(),
    }
}

/// `[linear(x) for linear in linears]` by `gemm` in f32 or the CPU's bf16 products, or `None`
/// when x, a weight or a bias is not a plain CPU tensor of x's dtype (f32, bf16 or f16) or a
/// weight does not fit x.
///
/// bf16 is multiplied as it is where the CPU has AVX-512 BF16 (`cpu::bf16_gemm`); otherwise
/// half precision is widened to f32 (x once for every projection). Each product is summed in
/// f32 with its bias and rounded once to the dtype: candle 0.11's bf16 matmul widens both
/// operands too, but serially, its f16 one runs `gemm`'s f16 kernel (about 0.75× the f32 rate
/// here), and its `Linear` rounds again after adding the bias in the half format.
fn direct(linears: &[&Linear], x: &Tensor) -> Result<Option<Vec<Tensor>>> {
    direct_via(linears, x, native_bf16())
}

/// [`direct`], with bf16 products on bf16 operands (`native_bf16`, AVX-512 BF16 only) or
/// widened to f32 like f16's.
fn direct_via(linears: &[&Linear], x: &Tensor, native_bf16: bool) -> Result<Option<Vec<Tensor>>> {
    let dtype = x.dtype();
    let plain = |t: &Tensor| t.device().is_cpu() && t.dtype() == dtype && !t.track_op();
    let Some(&inner) = x.dims().last() else {
        return Ok(None);
    };
    let fits = linears.iter().all(|l| {
        let w = l.weight();
        plain(w)
            && w.dims2().is_ok_and(|(_, i)| i == inner)
            && l.bias()
                .is_none_or(|b| plain(b) && b.dims() == [w.dims()[0]])
    });
    if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) || x.rank() < 2 || !plain(x) || !fits
    {
        return Ok(None);
    }
    let x = x.contiguous()?;
    // The leading axes' product (not elem_count / in, which is 0 for 0 features).
    let rows: usize = x.dims()[..x.rank() - 1].iter().product();
    let dims = (rows, inner);
    // (Read only on x86-64.)
    let _ = native_bf16;
    // bf16 on AVX-512 BF16: products on the bf16 values themselves, x read in place.
    #[cfg(target_arch = "x86_64")]
    if native_bf16 && dtype == DType::BF16 {
        let ys = with_bf16(&x, |xs| {
            outputs(linears, &x, dims, |w, bias, y, sizes| {
                with_bf16(w, |ws| {
                    crate::cpu::bf16_gemm::linear(y, (xs, ws, bias), sizes).map_err(Error::from)
                })
            })
        })?;
        return Ok(ys.flatten());
    }
    let ys = with_f32(&x, |xs| {
        outputs(linears, &x, dims, |w, bias, y, sizes| {
            with_f32(w, |ws| {
                crate::cpu::gemm::linear(y, (xs, ws, bias), sizes, 1.0).map_err(Error::from)
            })
        })
    })?;
    Ok(ys.flatten())
}

/// Each linear's output for x `(…, in)` of `rows` rows: its weight made contiguous, its bias in
/// f32, `product` into a fresh f32 buffer, rounded to x's dtype; `None` when a product is.
fn outputs(
    linears: &[&Linear],
    x: &Tensor,
    (rows, inner): (usize, usize),
    mut product: impl FnMut(
        &Tensor,
        Option<&[f32]>,
        &mut [f32],
        (usize, usize, usize),
    ) -> Result<Option<()>>,
) -> Result<Option<Vec<Tensor>>> {
    let mut ys = Vec::with_capacity(linears.len());
    for linear in linears {
        let w = linear.weight().contiguous()?;
        let out = w.dims()[0];
        let bias = match linear.bias() {
            Some(b) => Some(b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?),
            None => None,
        };
        let mut y = crate::cpu::zeroed(rows * out, "projection output")?;
        if product(&w, bias.as_deref(), &mut y, (rows, out, inner))?.is_none() {
            return Ok(None);
        }
        let mut dims = x.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = out;
        }
        ys.push(narrowed(y, dims, x.dtype())?);
    }
    Ok(Some(ys))
}

/// `f(t's bf16 values)` for a contiguous CPU bf16 tensor; `None` for other storage.
#[cfg(target_arch = "x86_64")]
fn with_bf16<R>(t: &Tensor, f: impl FnOnce(&[bf16]) -> Result<R>) -> Result<Option<R>> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(CpuStorage::BF16(d)) = &*storage else {
        return Ok(None);
    };
    let start = layout.start_offset();
    d.get(start..start + t.elem_count()).map(f).transpose()
}

/// `f(t's values as f32)` for a contiguous CPU tensor: f32 storage read in place, bf16 and f16
/// widened into a fresh buffer; `None` for other storage.
fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> Result<R>) -> Result<Option<R>> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(storage) = &*storage else {
        return Ok(None);
    };
    let values = layout.start_offset()..layout.start_offset() + t.elem_count();
    fn widened<T: Widen + Sync, R>(
        src: Option<&[T]>,
        f: impl FnOnce(&[f32]) -> Result<R>,
    ) -> Result<Option<R>> {
        let Some(src) = src else { return Ok(None) };
        let mut buf = crate::cpu::zeroed(src.len(), "half-precision values widened to f32")?;
        buf.par_chunks_mut(CONVERT)
            .zip(src.par_chunks(CONVERT))
            .for_each(|(dst, src)| T::widen_fast(src, dst));
        f(&buf).map(Some)
    }
    match storage {
        CpuStorage::F32(d) => d.get(values).map(f).transpose(),
        CpuStorage::BF16(d) => widened(d.get(values), f),
        CpuStorage::F16(d) => widened(d.get(values), f),
        _ => Ok(None),
    }
}

/// f32 values as a CPU tensor of `dtype` (f32 as they are; bf16 and f16 rounded to nearest,
/// ties to even, as candle's conversion rounds).
fn narrowed(y: Vec<f32>, dims: Vec<usize>, dtype: DType) -> Result<Tensor> {
    fn to<T: Send + Copy + Default + candle_core::WithDType>(
        y: &[f32],
        dims: Vec<usize>,
        convert: fn(&mut [T], &[f32]),
    ) -> Result<Tensor> {
        let mut out = Vec::new();
        out.try_reserve_exact(y.len())
            .map_err(|e| Error::from(candle_core::Error::Msg(format!("projection output: {e}"))))?;
        out.resize(y.len(), T::default());
        out.par_chunks_mut(CONVERT)
            .zip(y.par_chunks(CONVERT))
            .for_each(|(dst, src)| convert(dst, src));
        Ok(Tensor::from_vec(out, dims, &candle_core::Device::Cpu)?)
    }
    match dtype {
        DType::BF16 => to::<bf16>(&y, dims, |d, s| d.convert_from_f32_slice(s)),
        DType::F16 => to::<f16>(&y, dims, |d, s| d.convert_from_f32_slice(s)),
        _ => Ok(Tensor::from_vec(y, dims, &candle_core::Device::Cpu)?),
    }
}

/// Values per parallel task of the conversions to and from half precision.
const CONVERT: usize = 1 << 16;

/// One weight matrix's rows as stored.
#[derive(Clone, Copy)]
enum Rows<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
}

/// The few-row products of [`project_all`], or `None` when they do not apply (too many rows,
/// a tracked tensor, another device, dtypes that differ, a weight that does not fit `x`).
fn few_rows(linears: &[&Linear], x: &Tensor) -> Result<Option<Vec<Tensor>>> {
    few_rows_via(linears, x, native_bf16())
}

/// Whether this CPU multiplies bf16 itself (AVX-512 BF16: `cpu::bf16_gemm`).
fn native_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    return crate::cpu::bf16_gemm::available();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

// A few rows are what the bf16 dot products take together.
#[cfg(target_arch = "x86_64")]
const _: () = assert!(FEW_ROWS <= crate::cpu::bf16_gemm::DOT_ROWS);

/// [`few_rows`], bf16 weights multiplied by the CPU's bf16 dot products (`native_bf16`) or
/// widened to f32.
fn few_rows_via(linears: &[&Linear], x: &Tensor, native_bf16: bool) -> Result<Option<Vec<Tensor>>> {
    let dtype = x.dtype();
    let inner = match x.dims().last() {
        Some(&n) if x.rank() >= 2 && n > 0 => n,
        _ => return Ok(None),
    };
    let rows = x.elem_count() / inner;
    let plain = |t: &Tensor| t.device().is_cpu() && t.dtype() == dtype && !t.track_op();
    let fits = linears.iter().all(|l| {
        let w = l.weight();
        plain(w)
            && w.dims2().is_ok_and(|(out, i)| i == inner && out > 0)
            && l.bias()
                .is_none_or(|b| plain(b) && b.dims() == [w.dims()[0]])
    });
    if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
        || rows == 0
        || rows > FEW_ROWS
        || linears.is_empty()
        || !plain(x)
        || !fits
    {
        return Ok(None);
    }
    let xs = x.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    // bf16 on AVX-512 BF16: x as it is, for the weights' own products (`dots`).
    let xb = match native_bf16 && dtype == DType::BF16 {
        true => Some(x.flatten_all()?.to_vec1::<bf16>()?),
        false => None,
    };
    let weights = linears
        .iter()
        .map(|l| l.weight().contiguous())
        .collect::<candle_core::Result<Vec<_>>>()?;
    let outs: Vec<usize> = weights.iter().map(|w| w.dims()[0]).collect();
    let biases = linears
        .iter()
        .map(|l| {
            l.bias()
                .map(|b| b.to_dtype(DType::F32)?.to_vec1::<f32>())
                .transpose()
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    let guards: Vec<_> = weights.iter().map(|w| w.storage_and_layout()).collect();
    let mut matrices = Vec::with_capacity(guards.len());
    for (w, (storage, layout)) in weights.iter().zip(&guards) {
        let (start, len) = (layout.start_offset(), w.elem_count());
        let Storage::Cpu(storage) = &**storage else {
            return Ok(None);
        };
        let slice = |n: usize| (start + len <= n).then_some(start..start + len);
        matrices.push(match storage {
            CpuStorage::F32(d) => slice(d.len()).map(|r| Rows::F32(&d[r])),
            CpuStorage::BF16(d) => slice(d.len()).map(|r| Rows::Bf16(&d[r])),
            CpuStorage::F16(d) => slice(d.len()).map(|r| Rows::F16(&d[r])),
            _ => None,
        });
    }
    let Some(matrices) = matrices.into_iter().collect::<Option<Vec<_>>>() else {
        return Ok(None);
    };
    // Output feature `o` of the concatenation, for every row: y[o · rows + r].
    let total: usize = outs.iter().sum();
    let mut y = Vec::new();
    y.try_reserve_exact(total * rows).map_err(|e| {
        crate::error::Error::from(candle_core::Error::Msg(format!("projection output: {e}")))
    })?;
    y.resize(total * rows, 0f32);
    let fill = |(c, ys): (usize, &mut [f32])| {
        fill(
            (&matrices, &biases, &outs),
            (&xs, xb.as_deref()),
            (inner, rows, c * CHUNK),
            ys,
        )
    };
    match total * inner * rows >= 1 << 16 {
        true => y.par_chunks_mut(CHUNK * rows).enumerate().for_each(fill),
        false => y.chunks_mut(CHUNK * rows).enumerate().for_each(fill),
    }
    // Each matrix's own (…, out) tensor: the projections never share storage (the rotation
    // hook may turn q and k in place).
    let mut ys = Vec::with_capacity(outs.len());
    let mut first = 0;
    for &out in &outs {
        let mut part = Vec::new();
        part.try_reserve_exact(rows * out).map_err(|e| {
            crate::error::Error::from(candle_core::Error::Msg(format!("projection output: {e}")))
        })?;
        part.extend((0..rows * out).map(|i| y[(first + i % out) * rows + i / out]));
        first += out;
        let mut dims = x.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = out;
        }
        ys.push(Tensor::from_vec(part, dims, x.device())?.to_dtype(dtype)?);
    }
    Ok(Some(ys))
}

/// Output features per parallel task of the few-row products.
const CHUNK: usize = 64;

thread_local! {
    /// Half-precision weight rows widened to f32 (at most [`CHUNK`] rows at a time).
    static WIDENED: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// The matrices of one pass, their biases (f32) and their numbers of rows (output features).
type Weights<'a> = (&'a [Rows<'a>], &'a [Option<Vec<f32>>], &'a [usize]);

/// Output features `first..first + ys.len() / rows` of the concatenated matrices (with their
/// biases) for each of `rows` rows of `xs` (`rows × inner`), into `ys` (`[feature][row]`):
/// each run of features within one matrix as one `gemm` product `W_run · xᵀ`, f32 rows read
/// in place, half-precision ones widened into this thread's buffer first, or bf16 ones with
/// x's bf16 values (`xb`, given where the CPU multiplies bf16 itself) as their own dot
/// products.
fn fill(
    (matrices, biases, outs): Weights,
    (xs, xb): (&[f32], Option<&[bf16]>),
    (inner, rows, first): (usize, usize, usize),
    ys: &mut [f32],
) {
    let (mut f, end) = (first, first + ys.len() / rows);
    let (mut m, mut base) = (0, 0);
    while f < end {
        // The matrix that holds feature f, and the run of its features in this chunk.
        while f >= base + outs[m] {
            base += outs[m];
            m += 1;
        }
        let (o, n) = (f - base, (base + outs[m]).min(end) - f);
        let dst = &mut ys[(f - first) * rows..(f - first + n) * rows];
        let span = o * inner..(o + n) * inner;
        let run = |w: &[f32], dst: &mut [f32]| {
            // SAFETY: w holds n rows of `inner` values, xs `rows` rows, dst n × rows.
            unsafe {
                product(
                    (n, rows, inner),
                    (dst.as_mut_ptr(), rows, false),
                    (w.as_ptr(), 1, inner),
                    (xs.as_ptr(), inner, 1),
                )
            }
        };
        match matrices[m] {
            Rows::F32(w) => run(&w[span], dst),
            Rows::Bf16(w) => match xb {
                #[cfg(target_arch = "x86_64")]
                Some(xb) => crate::cpu::bf16_gemm::dots(&w[span], xb, dst, (n, rows, inner)),
                _ => widened(&w[span], |w| run(w, dst)),
            },
            Rows::F16(w) => widened(&w[span], |w| run(w, dst)),
        }
        if let Some(b) = &biases[m] {
            for (y, b) in dst.chunks_exact_mut(rows).zip(&b[o..o + n]) {
                y.iter_mut().for_each(|y| *y += b);
            }
        }
        f += n;
    }
}

/// `then(w as f32)`, through this thread's buffer.
fn widened<T: Widen>(w: &[T], then: impl FnOnce(&[f32])) {
    WIDENED.with_borrow_mut(|buf| {
        buf.resize(w.len(), 0.0);
        T::widen_fast(w, buf);
        then(buf);
    })
}

#[cfg(test)]
mod tests {
    use candle_core::Device;
    use candle_nn::{linear_b, VarBuilder};

    use super::*;

    /// A linear layer `inner → out` with random weights (and bias) in `dtype`.
    fn random_linear(
        (inner, out): (usize, usize),
        bias: bool,
        dtype: DType,
        dev: &Device,
    ) -> anyhow::Result<Linear> {
        let vb = VarBuilder::from_tensors(
            [
                (
                    "weight".to_string(),
                    crate::seeded::randn(0f32, 1.0, (out, inner), dev)?,
                ),
                (
                    "bias".to_string(),
                    crate::seeded::randn(0f32, 1.0, out, dev)?,
                ),
            ]
            .into(),
            dtype,
            dev,
        );
        Ok(linear_b(inner, out, bias, vb)?)
    }

    /// The direct products equal candle's `Linear` in f32, with and without a bias, for a
    /// decoding step, a few tokens (the few-row products), a batch of sequences and a
    /// strided input (`gemm`).
    #[test]
    fn equals_candle_linear() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        for bias in [false, true] {
            let linear = random_linear((40, 24), bias, DType::F32, &dev)?;
            for x in [
                crate::seeded::randn(0f32, 1.0, (1, 1, 40), &dev)?,
                crate::seeded::randn(0f32, 1.0, (2, 2, 40), &dev)?,
                crate::seeded::randn(0f32, 1.0, (3, 7, 40), &dev)?,
                crate::seeded::randn(0f32, 1.0, (7, 3, 40), &dev)?.transpose(0, 1)?,
            ] {
                let want = matmul::linear(&linear, &x)?;
                let got = super::linear(&linear, &x)?;
                assert_eq!(got.dims(), want.dims());
                let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
                assert!(diff < 1e-5, "bias {bias} {:?}: {diff:e}", x.dims());
            }
        }
        Ok(())
    }

    /// The queries', keys' and values' projections (widths 96, 32, 32; 300 inputs) equal
    /// each layer in f64, for 1 to 4 tokens (the one pass over the weights), 5, 40 and 300
    /// (`gemm` directly, 300 past `gemm::FEW_ROWS`; bf16 both by the CPU's bf16 products,
    /// where it has them, and widened to f32), in f32 within 1e-5 of the output's scale
    /// and in bf16 and f16 within one rounding of the exact value (the products and the bias
    /// are summed in f32 and rounded once to the weights' dtype).
    #[test]
    fn one_pass_equals_each_layer() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let inner = 300;
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let layers = [
                random_linear((inner, 96), true, dtype, &dev)?,
                random_linear((inner, 32), false, dtype, &dev)?,
                random_linear((inner, 32), true, dtype, &dev)?,
            ];
            let refs: Vec<&Linear> = layers.iter().collect();
            for rows in [1, 2, 3, 4, 5, 40, 300] {
                let x = crate::seeded::randn(0f32, 1.0, (1, rows, inner), &dev)?.to_dtype(dtype)?;
                // bf16 past the few rows: the native products (where the CPU has them) and
                // the widened ones they replace.
                let mut runs = vec![project_all(&refs, &x)?];
                if dtype == DType::BF16 {
                    let widened = match rows > FEW_ROWS {
                        true => direct_via(&refs, &x, false)?,
                        false => few_rows_via(&refs, &x, false)?,
                    };
                    runs.push(widened.ok_or_else(|| anyhow::anyhow!("plain tensors"))?);
                }
                for (layer, y) in runs.iter().flat_map(|ys| layers.iter().zip(ys)) {
                    let exact = {
                        let w = layer.weight().to_dtype(DType::F64)?;
                        let y = matmul::broadcast_matmul(&x.to_dtype(DType::F64)?, &w.t()?)?;
                        match layer.bias() {
                            Some(b) => y.broadcast_add(&b.to_dtype(DType::F64)?)?,
                            None => y,
                        }
                    };
                    assert_eq!(y.dims(), exact.dims());
                    assert_eq!(y.dtype(), dtype);
                    let scale = exact.abs()?.max_all()?.to_scalar::<f64>()?;
                    // Relative to each value: one rounding in half precision.
                    let u = match dtype {
                        DType::BF16 => 2f64.powi(-8),
                        DType::F16 => 2f64.powi(-11),
                        _ => 0.0,
                    };
                    let err = (y.to_dtype(DType::F64)? - &exact)?.abs()?;
                    let bound = ((exact.abs()? * u)? + 1e-5 * scale)?;
                    let over = (err - bound)?.max_all()?.to_scalar::<f64>()?;
                    assert!(
                        over <= 0.0,
                        "{dtype:?} {rows} rows: {over:e} past the bound"
                    );
                }
            }
        }
        Ok(())
    }
}
