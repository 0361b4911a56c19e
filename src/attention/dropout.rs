//! Attention dropout on the fused cores: a mask that is a function of a seed and each weight's
//! place, so the backward draws the same mask again instead of storing it.
//!
//! ```text
//! keep(b, h, p, j) = u(seed, b, h, p, j) ≥ ρ        u uniform on [0, 1) in steps of 2⁻³²
//! α'_pj = α_pj · keep / (1 − ρ)                      ρ the dropout probability
//! ```
//!
//! `p` is the query's key position (its row in the chunk plus the cached keys before it), `j`
//! the key's index, so every weight of a call has its own draw whatever the tiles and query
//! blocks. As with candle's `ops::dropout` (Srivastava et al. 2014, inverted dropout), each
//! weight is kept with probability `1 − ρ` and scaled by `1 / (1 − ρ)`, so the expectation of
//! the output is the output without dropout. The draw: SplitMix64 (Steele et al. 2014) mixes the
//! seed with the row `(b, h, p)` into a 32-bit key; each key `j` of the row is
//! `lowbias32(key ⊕ j·φ)` (Wellons' integer hash, φ = 0x9E3779B9), which vectorises.

/// The dropout of one call: probability and seed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Dropout {
    /// The probability `ρ` of dropping a weight, in `(0, 1)`.
    pub(crate) p: f32,
    pub(crate) seed: u64,
}

/// A seed for a call that names none: a process-wide counter from a clock reading, mixed, so
/// that calls draw different masks.
pub(crate) fn fresh_seed() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    static START: OnceLock<u64> = OnceLock::new();
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let start = *START.get_or_init(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    mix64(start ^ mix64(CALLS.fetch_add(1, Ordering::Relaxed)))
}

/// SplitMix64's finaliser.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Wellons' `lowbias32` integer hash.
#[inline(always)]
fn lowbias32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7FEB_352D);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846C_A68B);
    x ^ (x >> 16)
}

impl Dropout {
    /// The factor each weight is multiplied by: `0` (dropped) or `1 / (1 − ρ)`.
    pub(crate) fn scale(&self) -> f32 {
        1.0 / (1.0 - self.p)
    }

    /// The 32-bit key of row `(b, h, pos)`.
    fn row_key(&self, b: usize, h: usize, pos: usize) -> u32 {
        let row = mix64(((b as u64) << 40) ^ ((h as u64) << 24) ^ mix64(pos as u64));
        (mix64(self.seed ^ row) >> 32) as u32
    }

    /// The smallest kept draw.
    fn threshold(&self) -> u32 {
        (f64::from(self.p) * 4_294_967_296.0).min(f64::from(u32::MAX)) as u32
    }

    /// Multiplies the weights of row `(b, h, pos)` at keys `j0..j0 + row.len()` by their
    /// factor: `0` or `1 / (1 − ρ)`.
    #[inline(always)]
    pub(crate) fn apply(&self, (b, h, pos): (usize, usize, usize), j0: usize, row: &mut [f32]) {
        let (key, threshold, scale) = (self.row_key(b, h, pos), self.threshold(), self.scale());
        for (k, x) in row.iter_mut().enumerate() {
            // Key indices past 2^32 wrap: the draw only hashes them.
            let j = (j0 + k) as u32;
            let kept = lowbias32(key ^ j.wrapping_mul(0x9E37_79B9)) >= threshold;
            *x *= if kept { scale } else { 0.0 };
        }
    }

    /// The factors of row `(b, h, pos)` at keys `0..len`, as [`Self::apply`] multiplies by.
    #[cfg(test)]
    pub(crate) fn factors(&self, (b, h, pos): (usize, usize, usize), len: usize) -> Vec<f32> {
        let mut row = vec![1.0; len];
        self.apply((b, h, pos), 0, &mut row);
        row
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each weight is kept with probability 1 − ρ (within five standard deviations over 2^20
    /// draws), scaled by 1 / (1 − ρ); the same seed gives the same mask, another seed and
    /// every other row another one; a tile from any key gives the whole row's factors.
    #[test]
    fn keeps_one_minus_rho_reproducibly() {
        for p in [0.1f32, 0.5, 0.9] {
            let d = Dropout { p, seed: 42 };
            let n = 1 << 20;
            let kept = (0..256)
                .flat_map(|r| d.factors((r % 2, r / 2 % 8, r), n / 256))
                .filter(|&x| x != 0.0)
                .count();
            let (mean, sd) = (n as f64 * f64::from(1.0 - p), (n as f64 * 0.25).sqrt());
            assert!(
                (kept as f64 - mean).abs() < 5.0 * sd,
                "p {p}: kept {kept} of {n}"
            );
            let row = d.factors((1, 3, 77), 300);
            assert!(row.iter().all(|&x| x == 0.0 || x == d.scale()));
            assert_eq!(row, d.factors((1, 3, 77), 300));
            let mut tail = vec![1.0; 200];
            d.apply((1, 3, 77), 100, &mut tail);
            assert_eq!(tail, row[100..]);
            assert_ne!(row, Dropout { p, seed: 43 }.factors((1, 3, 77), 300));
            for other in [(0, 3, 77), (1, 2, 77), (1, 3, 78)] {
                assert_ne!(row, d.factors(other, 300), "{other:?}");
            }
        }
    }
}
