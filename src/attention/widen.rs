//! Half-precision values widened to f32 in bulk, for the kernels that read weights or a
//! cache in the block's dtype and compute in f32.
//!
//! ```text
//! bf16 → f32:  bits << 16            (exact: bf16 is f32's upper half)
//! f16  → f32:  F16C's vcvtph2ps where the CPU has it (exact), else `half`'s scalar path
//! ```

use half::{bf16, f16, slice::HalfFloatSliceExt};

/// A half-precision value type whose slices widen to f32.
pub(crate) trait Widen: Copy {
    /// `dst[i] = src[i] as f32` (exactly) for every `i`; both have the same length.
    fn widen(src: &[Self], dst: &mut [f32]);

    /// [`Widen::widen`] compiled for the widest vectors this CPU has.
    fn widen_fast(src: &[Self], dst: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f")]
            fn avx512<T: Widen>(src: &[T], dst: &mut [f32]) {
                T::widen(src, dst)
            }
            #[target_feature(enable = "avx2")]
            fn avx2<T: Widen>(src: &[T], dst: &mut [f32]) {
                T::widen(src, dst)
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has AVX-512F (detected above).
                return unsafe { avx512(src, dst) };
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2 (detected above).
                return unsafe { avx2(src, dst) };
            }
        }
        Self::widen(src, dst)
    }
}

impl Widen for bf16 {
    /// A shift per value, inlined into the caller so that it vectorises with its instruction
    /// set (`half`'s own conversion of a bf16 slice runs value by value).
    #[inline(always)]
    fn widen(src: &[Self], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits(u32::from(s.to_bits()) << 16);
        }
    }
}

impl Widen for f16 {
    /// `half`'s slice conversion (eight values per F16C instruction where the CPU has them,
    /// detected on every call).
    #[inline(always)]
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }

    /// Sixteen values per AVX-512 conversion, or eight per F16C one, without `half`'s
    /// per-call detection (a key tile's rows are widened one call each).
    fn widen_fast(src: &[Self], dst: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::*;
            /// # Safety
            /// The CPU must have AVX2 and F16C.
            #[target_feature(enable = "avx2,f16c")]
            unsafe fn f16c(src: &[f16], dst: &mut [f32]) {
                let n = src.len().min(dst.len());
                let whole = n - n % 8;
                for i in (0..whole).step_by(8) {
                    // SAFETY: i + 8 ≤ n: eight values of each slice; unaligned loads and
                    // stores.
                    unsafe {
                        let h = _mm_loadu_si128(src.as_ptr().add(i).cast());
                        _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
                    }
                }
                src[whole..n].convert_to_f32_slice(&mut dst[whole..n]);
            }
            /// # Safety
            /// The CPU must have AVX-512F.
            #[target_feature(enable = "avx512f")]
            unsafe fn avx512(src: &[f16], dst: &mut [f32]) {
                let n = src.len().min(dst.len());
                let whole = n - n % 16;
                for i in (0..whole).step_by(16) {
                    // SAFETY: i + 16 ≤ n: sixteen values of each slice; unaligned loads and
                    // stores.
                    unsafe {
                        let h = _mm256_loadu_si256(src.as_ptr().add(i).cast());
                        _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_cvtph_ps(h));
                    }
                }
                src[whole..n].convert_to_f32_slice(&mut dst[whole..n]);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: detected above.
                return unsafe { avx512(src, dst) };
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                // SAFETY: detected above.
                return unsafe { f16c(src, dst) };
            }
        }
        Self::widen(src, dst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `T::widen` and `T::widen_fast` against `to_f32`, value by value, on every bit pattern.
    fn exact<T: Widen + std::fmt::Debug>(from_bits: fn(u16) -> T, to_f32: fn(T) -> f32) {
        let values: Vec<T> = (0..=u16::MAX).map(from_bits).collect();
        for widen in [T::widen, T::widen_fast] {
            let mut got = vec![0f32; values.len()];
            widen(&values, &mut got);
            for (x, g) in values.iter().zip(&got) {
                let want = to_f32(*x);
                assert!(
                    want.to_bits() == g.to_bits() || (want.is_nan() && g.is_nan()),
                    "{x:?}"
                );
            }
        }
    }

    #[test]
    fn exact_on_every_value() {
        exact(bf16::from_bits, bf16::to_f32);
        exact(f16::from_bits, f16::to_f32);
    }
}
