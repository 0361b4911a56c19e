//! `y = x Wᵀ + b` with bf16 operands and f32 sums, on CPUs with AVX-512 BF16.
//!
//! ```text
//! x: (rows, in) bf16   W: (out, in) bf16   b: (out) f32   →   y: (rows, out) f32
//! y[r, o] = b[o] + Σ_k x[r, k] · W[o, k]        every product exact in f32, sums rounded in f32
//! ```
//!
//! `vdpbf16ps` adds two bf16 products into each f32 lane per instruction, twice the
//! multiply-adds of an f32 FMA (117 against 59 GMAC/s on one core of the AMD EPYC here), so a
//! bf16 product no longer costs what its f32 twin does plus the widening. The weight is packed
//! into panels of [`NR`] output features, each step of a panel holding the features' two
//! weights at one pair of inputs `(2p, 2p + 1)`; each task takes one panel for every row, in
//! blocks of [`MR`] rows, reading each row's input pairs from x in place (an odd `in` ends in a
//! zero pair). A decoding step's few rows ([`dots`]) take each weight row as stored instead,
//! 32 values per instruction, so the step reads every weight once and writes no copy of it.
//! The instruction treats subnormal inputs and results as zero (below 1.2e-38, where bf16
//! weights do not live); otherwise its sums round as f32 sums do, in another order.

use std::arch::x86_64::*;

use half::bf16;
use rayon::prelude::*;

/// Output features per panel: two vectors of 16 f32 lanes.
pub(crate) const NR: usize = 32;
/// Rows per block of the inner kernel (12 accumulators, two panel vectors, one broadcast).
const MR: usize = 6;

/// Whether this CPU runs the kernels (AVX-512 F, BW and BF16).
pub(crate) fn available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512bf16")
}

/// 32 bf16 values as `vdpbf16ps` reads them.
#[inline]
#[target_feature(enable = "avx512f")]
fn bh(v: __m512i) -> __m512bh {
    // SAFETY: both are 64 bytes of plain data; every bit pattern is a valid value of either.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
}

/// Rows of x up to which [`dots`] takes them together (a decoding step's tokens).
pub(crate) const DOT_ROWS: usize = 4;

/// `dst[o·rows + r] = Σ_k w[o·in + k] · x[r·in + k]` for `n` rows of w against `rows` ≤
/// [`DOT_ROWS`] rows of x, on this thread: each weight row read once, 32 values per
/// instruction, with no widened copy (a decoding step reads every weight once, so this is what
/// bounds it).
///
/// # Panics
/// If the CPU lacks the kernels ([`available`]), `rows` is over [`DOT_ROWS`], or a slice is
/// shorter than its dimensions say.
pub(crate) fn dots(
    w: &[bf16],
    x: &[bf16],
    dst: &mut [f32],
    (n, rows, inner): (usize, usize, usize),
) {
    assert!(available(), "bf16_gemm::dots needs AVX-512 BF16");
    assert!(rows <= DOT_ROWS);
    assert!(w.len() >= n * inner && x.len() >= rows * inner && dst.len() >= n * rows);
    // SAFETY: the CPU has the features (asserted) and the slices hold what the dimensions say
    // (asserted).
    unsafe { dots_avx512(w, x, dst, (n, rows, inner)) }
}

/// [`dots`] itself.
///
/// # Safety
/// As [`dots`]'s assertions.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn dots_avx512(
    w: &[bf16],
    x: &[bf16],
    dst: &mut [f32],
    (n, rows, inner): (usize, usize, usize),
) {
    let (full, tail) = (inner / 32, inner % 32);
    let mask: __mmask32 = ((1u64 << tail) - 1) as u32;
    for o in 0..n {
        let row = w.as_ptr().wrapping_add(o * inner);
        let mut acc = [_mm512_setzero_ps(); DOT_ROWS];
        // SAFETY: chunk c of row o and of each x row holds 32 values (the last `tail`, read
        // under the mask, which zeroes the rest and reads nothing past it).
        unsafe {
            for c in 0..full {
                let wv = bh(_mm512_loadu_si512(row.add(32 * c).cast()));
                for (r, acc) in acc.iter_mut().enumerate().take(rows) {
                    let xv = _mm512_loadu_si512(x.as_ptr().add(r * inner + 32 * c).cast());
                    *acc = _mm512_dpbf16_ps(*acc, wv, bh(xv));
                }
            }
            if tail > 0 {
                let at = 32 * full;
                let wv = _mm512_maskz_loadu_epi16(mask, row.add(at).cast());
                for (r, acc) in acc.iter_mut().enumerate().take(rows) {
                    let xv = _mm512_maskz_loadu_epi16(mask, x.as_ptr().add(r * inner + at).cast());
                    *acc = _mm512_dpbf16_ps(*acc, bh(wv), bh(xv));
                }
            }
        }
        for (r, acc) in acc.iter().enumerate().take(rows) {
            dst[o * rows + r] = _mm512_reduce_add_ps(*acc);
        }
    }
}

/// `y[r·out + o] = b[o] + Σ_k x[r·in + k] · w[o·in + k]` for `rows × out` outputs, over this
/// thread and rayon's pool.
///
/// # Errors
/// The packed weight cannot be allocated.
///
/// # Panics
/// If the CPU lacks AVX-512 BF16 ([`available`]), or a slice is shorter than its dimensions
/// say.
pub(crate) fn linear(
    y: &mut [f32],
    (x, w, bias): (&[bf16], &[bf16], Option<&[f32]>),
    (rows, out, inner): (usize, usize, usize),
) -> candle_core::Result<()> {
    assert!(available(), "bf16_gemm::linear needs AVX-512 BF16");
    assert!(y.len() >= rows * out && x.len() >= rows * inner && w.len() >= out * inner);
    assert!(bias.is_none_or(|b| b.len() >= out));
    if rows == 0 || out == 0 {
        return Ok(());
    }
    if inner == 0 {
        // No products: the bias, or zeros.
        for row in y.chunks_exact_mut(out).take(rows) {
            match bias {
                Some(b) => row.copy_from_slice(&b[..out]),
                None => row.fill(0.0),
            }
        }
        return Ok(());
    }
    let pairs = inner.div_ceil(2);
    let panel_len = pairs * NR * 2;
    let panels = pack(w, (out, inner), panel_len)?;
    // An odd `in`: rows copied with a zero at the end, so each row's last pair is whole.
    let padded;
    let (xs, stride) = match inner % 2 {
        0 => (x, inner),
        _ => {
            padded = pad_rows(x, rows, inner)?;
            (&padded[..], inner + 1)
        }
    };
    let y_rows = SendPtr(y.as_mut_ptr());
    panels
        .par_chunks(panel_len)
        .enumerate()
        .for_each(|(p, panel)| {
            let first = p * NR;
            let cols = NR.min(out - first);
            let b = bias.map(|b| &b[first..first + cols]);
            for r0 in (0..rows).step_by(MR) {
                let n = MR.min(rows - r0);
                // SAFETY: the CPU has AVX-512 BF16 (asserted); rows r0..r0 + n of xs hold
                // `pairs` whole pairs each at `stride`, the panel `pairs` steps of NR pairs;
                // this task alone writes columns first..first + cols of those rows of y,
                // which holds rows × out values (asserted).
                unsafe {
                    let x_at = xs.as_ptr().add(r0 * stride);
                    let y_at = y_rows.get().add(r0 * out + first);
                    block(
                        n,
                        (x_at, stride),
                        panel.as_ptr(),
                        pairs,
                        (y_at, out, cols),
                        b,
                    );
                }
            }
        });
    Ok(())
}

/// A raw pointer the tasks share; each writes its own columns.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: the tasks write disjoint columns of the output (one panel each).
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// W `(out, in)` as panels of [`NR`] features: step `p` of panel `j` holds, for each feature
/// `o = j·NR + l`, the pair `(W[o, 2p], W[o, 2p + 1])` at `2l, 2l + 1` (zeros past `out` and
/// `in`).
fn pack(
    w: &[bf16],
    (out, inner): (usize, usize),
    panel_len: usize,
) -> candle_core::Result<Vec<bf16>> {
    let mut packed = zeros(out.div_ceil(NR) * panel_len, "packed bf16 weight")?;
    packed
        .par_chunks_mut(panel_len)
        .enumerate()
        .for_each(|(j, panel)| {
            for l in 0..NR.min(out - j * NR) {
                let row = &w[(j * NR + l) * inner..(j * NR + l + 1) * inner];
                for (k, &v) in row.iter().enumerate() {
                    panel[(k / 2) * NR * 2 + 2 * l + k % 2] = v;
                }
            }
        });
    Ok(packed)
}

/// x's rows with one zero appended to each.
fn pad_rows(x: &[bf16], rows: usize, inner: usize) -> candle_core::Result<Vec<bf16>> {
    let mut padded = zeros(rows * (inner + 1), "padded bf16 rows")?;
    padded
        .par_chunks_mut(inner + 1)
        .zip(x.par_chunks(inner))
        .for_each(|(dst, src)| dst[..inner].copy_from_slice(src));
    Ok(padded)
}

/// `n` bf16 zeros, or an error naming `what` when they cannot be allocated.
fn zeros(n: usize, what: &str) -> candle_core::Result<Vec<bf16>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|e| candle_core::Error::Msg(format!("{what} ({n} values): {e}")))?;
    v.resize(n, bf16::ZERO);
    Ok(v)
}

/// Rows `0..n` (n ≤ [`MR`]) of one panel: the kernel for that many rows.
///
/// # Safety
/// As [`kernel`].
unsafe fn block(
    n: usize,
    x: (*const bf16, usize),
    panel: *const bf16,
    pairs: usize,
    y: (*mut f32, usize, usize),
    bias: Option<&[f32]>,
) {
    // SAFETY: the caller's contract, for n rows.
    unsafe {
        match n {
            1 => kernel::<1>(x, panel, pairs, y, bias),
            2 => kernel::<2>(x, panel, pairs, y, bias),
            3 => kernel::<3>(x, panel, pairs, y, bias),
            4 => kernel::<4>(x, panel, pairs, y, bias),
            5 => kernel::<5>(x, panel, pairs, y, bias),
            _ => kernel::<MR>(x, panel, pairs, y, bias),
        }
    }
}

/// `R` rows of y, columns `0..cols` of one panel: `y[r·y_stride + c] = bias[c] + Σ_p x pair ·
/// panel pair`.
///
/// # Safety
/// The CPU has AVX-512 F and BF16; `x` holds `R` rows of `pairs` whole pairs at `x_stride`
/// (bf16 values), `panel` `pairs` steps of [`NR`] pairs, and `y` `R` rows of `cols` ≤ [`NR`]
/// writable values at `y_stride`; `bias`, if any, holds `cols` values.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn kernel<const R: usize>(
    (x, x_stride): (*const bf16, usize),
    panel: *const bf16,
    pairs: usize,
    (y, y_stride, cols): (*mut f32, usize, usize),
    bias: Option<&[f32]>,
) {
    let mut acc = [[_mm512_setzero_ps(); 2]; R];
    for p in 0..pairs {
        // SAFETY: step p of the panel is NR pairs (64 bf16, 128 bytes); each row's pair p is
        // two bf16 (one unaligned u32).
        unsafe {
            let step = panel.add(p * NR * 2);
            let lo = bh(_mm512_loadu_si512(step.cast()));
            let hi = bh(_mm512_loadu_si512(step.add(NR).cast()));
            for (r, acc) in acc.iter_mut().enumerate() {
                let pair = x.add(r * x_stride + 2 * p).cast::<i32>().read_unaligned();
                let a = bh(_mm512_set1_epi32(pair));
                acc[0] = _mm512_dpbf16_ps(acc[0], a, lo);
                acc[1] = _mm512_dpbf16_ps(acc[1], a, hi);
            }
        }
    }
    let mut bias_lanes = [0f32; NR];
    if let Some(b) = bias {
        bias_lanes[..cols].copy_from_slice(&b[..cols]);
    }
    for (r, acc) in acc.iter().enumerate() {
        let mut lanes = [0f32; NR];
        // SAFETY: `lanes` holds NR = 2 × 16 f32.
        unsafe {
            _mm512_storeu_ps(lanes.as_mut_ptr(), acc[0]);
            _mm512_storeu_ps(lanes.as_mut_ptr().add(16), acc[1]);
        }
        // SAFETY: row r of y has `cols` writable values (the caller's contract).
        let row = unsafe { std::slice::from_raw_parts_mut(y.add(r * y_stride), cols) };
        for ((y, &v), &b) in row.iter_mut().zip(&lanes).zip(&bias_lanes) {
            *y = b + v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`dots`] against f64 for 1 to 4 rows and inputs around the vector of 32 (a tail under
    /// the mask, odd and even): within the f32 sums' error. A mutation (the mask one value
    /// short) fails it.
    #[test]
    fn dots_equal_f64_within_f32_sums() {
        if !available() {
            return;
        }
        let value = |i: usize| bf16::from_f32(((i * 7919 % 1000) as f32 - 500.0) / 250.0);
        for inner in [1, 31, 32, 33, 64, 577] {
            for rows in 1..=DOT_ROWS {
                let n = 5;
                let w: Vec<bf16> = (0..n * inner).map(|i| value(i + 3)).collect();
                let x: Vec<bf16> = (0..rows * inner).map(value).collect();
                let mut dst = vec![f32::NAN; n * rows];
                dots(&w, &x, &mut dst, (n, rows, inner));
                for o in 0..n {
                    for r in 0..rows {
                        let terms = (0..inner).map(|k| {
                            f64::from(w[o * inner + k].to_f32())
                                * f64::from(x[r * inner + k].to_f32())
                        });
                        let (sum, size) = terms.fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs()));
                        let bound = (inner + 2) as f64 * 2f64.powi(-24) * size;
                        let got = f64::from(dst[o * rows + r]);
                        assert!(
                            (got - sum).abs() <= bound,
                            "in {inner} [{o}, {r}]: {got} vs {sum}"
                        );
                    }
                }
            }
        }
    }

    /// Against f64 for rows around the block of six, features around the panel of 32, odd
    /// and even inputs, with and without a bias: each value within the f32 sums' error,
    /// `(in + 2) · 2^-24 · Σ|x w|`, of the exact one. A mutation (one pair's halves swapped in
    /// the packing) fails it.
    #[test]
    fn equals_f64_within_f32_sums() -> candle_core::Result<()> {
        if !available() {
            return Ok(());
        }
        let value = |i: usize| bf16::from_f32(((i * 7919 % 1000) as f32 - 500.0) / 250.0);
        for (rows, out, inner) in [
            (1, 1, 1),
            (5, 31, 3),
            (6, 32, 64),
            (7, 33, 65),
            (13, 100, 130),
        ] {
            for with_bias in [false, true] {
                let x: Vec<bf16> = (0..rows * inner).map(value).collect();
                let w: Vec<bf16> = (0..out * inner).map(|i| value(i + 17)).collect();
                let b: Vec<f32> = (0..out).map(|i| value(i + 5).to_f32()).collect();
                let bias = with_bias.then_some(&b[..]);
                let mut y = vec![f32::NAN; rows * out];
                linear(&mut y, (&x, &w, bias), (rows, out, inner))?;
                for r in 0..rows {
                    for o in 0..out {
                        let terms = (0..inner).map(|k| {
                            f64::from(x[r * inner + k].to_f32())
                                * f64::from(w[o * inner + k].to_f32())
                        });
                        let (sum, size) = terms.fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs()));
                        let exact = sum + bias.map_or(0.0, |b| f64::from(b[o]));
                        let bound = (inner + 2) as f64 * 2f64.powi(-24) * (size + exact.abs());
                        let got = f64::from(y[r * out + o]);
                        assert!(
                            (got - exact).abs() <= bound,
                            "{rows}×{out}×{inner} bias {with_bias} [{r}, {o}]: {got} vs {exact}"
                        );
                    }
                }
            }
        }
        Ok(())
    }
}
