//! GELU, tanh form (Hendrycks & Gimpel 2016), as candle's `Tensor::gelu` computes it, with a
//! vectorised CPU kernel for f32 and its derivative for training.
//!
//! ```text
//! gelu(x)  = ½ x (1 + tanh u),   u = √(2/π) (x + 0.044715 x³)
//! gelu'(x) = ½ (1 + tanh u) + ½ x (1 − tanh² u) √(2/π) (1 + 3 · 0.044715 x²)
//! tanh u   = sign(u) (1 − e) / (1 + e),   e = exp(−2|u|) ∈ (0, 1]
//! ```
//!
//! candle's CPU op calls libm's `tanhf` value by value, a third of the experiment's training
//! time; here `exp` is a polynomial the compiler vectorises (relative error within 2e-7 of
//! f64's on the range it is used, tested), so one GELU costs a few vector instructions.
//! Other dtypes and devices use candle's op.
//!
//! # Shapes
//! Any shape; elementwise.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};

/// `gelu(x)`: the fast kernel for contiguous f32 CPU tensors, candle's op otherwise.
pub fn gelu(x: &Tensor) -> candle_core::Result<Tensor> {
    if x.device().is_cpu() && x.dtype() == DType::F32 {
        x.contiguous()?.apply_op1(Gelu)
    } else {
        x.gelu()
    }
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const A: f32 = 0.044_715;

/// `e^x` for `x ≤ 0` (down to −87, below which it flushes to 0): `x = k ln 2 + r`, `|r| ≤ ½ ln 2`
/// (ln 2 in two parts so `r` is exact), `e^r` by its degree-6 Taylor polynomial, `2^k` written
/// into the exponent bits.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let x = if x < -87.0 { -87.0 } else { x };
    let k = (x * std::f32::consts::LOG2_E).round();
    let r = (x - k * LN2_HI) - k * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r / 720.0)))));
    p * f32::from_bits(((k as i32 + 127) as u32) << 23)
}

/// `tanh u` and `½ (1 + tanh u)`'s pieces for one value: returns `tanh u`.
#[inline(always)]
fn tanh_of(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + A * x * x * x);
    let e = exp_nonpositive(-2.0 * u.abs());
    let t = (1.0 - e) / (1.0 + e);
    if u < 0.0 {
        -t
    } else {
        t
    }
}

#[inline(always)]
fn gelu_of(v: f32) -> f32 {
    0.5 * v * (1.0 + tanh_of(v))
}

#[inline(always)]
fn derivative_of(v: f32) -> f32 {
    let t = tanh_of(v);
    0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * A * v * v)
}

/// `f` over `x`, compiled (inlined) for AVX-512 where the CPU has it, else for the baseline.
#[inline(always)]
fn map(x: &[f32], f: impl Fn(f32) -> f32) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f")]
        fn avx512(x: &[f32], f: impl Fn(f32) -> f32) -> Vec<f32> {
            let mut out = vec![0f32; x.len()];
            for (o, &v) in out.iter_mut().zip(x) {
                *o = f(v);
            }
            out
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (detected above).
            return unsafe { avx512(x, f) };
        }
    }
    x.iter().map(|&v| f(v)).collect()
}

/// The forward op (its backward multiplies by [`GeluDerivative`]).
struct Gelu;

/// `gelu'(x)`, not differentiated further.
struct GeluDerivative;

/// The contiguous f32 values of a CPU tensor (the example's fused ops all read them so).
pub(super) fn values<'a>(s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&v[a..b]),
        _ => candle_core::bail!("a contiguous f32 CPU tensor was expected"),
    }
}

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "lm-gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let out = map(values(s, l)?, gelu_of);
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let slope = x.detach().contiguous()?.apply_op1(GeluDerivative)?;
        Ok(Some(grad.mul(&slope)?))
    }
}

impl CustomOp1 for GeluDerivative {
    fn name(&self) -> &'static str {
        "lm-gelu-derivative"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let out = map(values(s, l)?, derivative_of);
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;

    /// Values and gradients against candle's own GELU, from −12 to 12 and at the extremes.
    #[test]
    fn equals_candle_gelu() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let mut xs: Vec<f32> = (-2400..=2400).map(|i| i as f32 / 200.0).collect();
        xs.extend([-100.0, -50.0, 50.0, 100.0, 1e-20, -1e-20, 0.0]);
        let x = Var::new(xs.as_slice(), &dev)?;
        let ours = gelu(x.as_tensor())?;
        let theirs = x.as_tensor().gelu()?;
        let diff = (&ours - &theirs)?.abs()?.max(0)?.to_scalar::<f32>()?;
        assert!(diff <= 2e-6, "values: {diff:e}");
        let g_ours = ours.sum_all()?.backward()?;
        let g_theirs = theirs.sum_all()?.backward()?;
        let (a, b) = (
            g_ours.get(x.as_tensor()).expect("a gradient"),
            g_theirs.get(x.as_tensor()).expect("a gradient"),
        );
        let diff = (a - b)?.abs()?.max(0)?.to_scalar::<f32>()?;
        assert!(diff <= 2e-6, "gradients: {diff:e}");
        Ok(())
    }
}
