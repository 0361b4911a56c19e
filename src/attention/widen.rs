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
    /// `half`'s slice conversion: eight values per F16C instruction when the CPU has them
    /// (detected at run time).
    #[inline(always)]
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
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
