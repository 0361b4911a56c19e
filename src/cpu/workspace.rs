//! Buffers a call fills, reads and frees before it returns, kept for the next call: the
//! one-pass block's queries, keys, values and core output (`attention/one_pass.rs`), the
//! projections' scratch rows and the fused core's transposed keys.
//!
//! Each is the size of the chunk. Handed back to the allocator, buffers that large sit at the
//! top of its heap or in a mapping of their own, and glibc's allocator returns them to the
//! system at once (its trim threshold is twice the largest mapping freed so far, a few MiB):
//! the next call then takes every page from the kernel again, a page fault each, 5 ms of a
//! 50 ms call at B2 T1024. Kept here instead, up to [`KEEP`] values in all (process-wide,
//! whichever thread runs the call), they are written again in place. Taken while in use, so
//! nested and concurrent calls each get buffers of their own.

use std::sync::Mutex;

/// Values kept in all (64 MiB); a buffer that would pass it is freed.
pub(crate) const KEEP: usize = 1 << 24;

/// The kept buffers, each with its values (contents unspecified).
static KEPT: Mutex<Kept> = Mutex::new(Kept(Vec::new()));

/// `n` values whose contents are unspecified (a kept buffer's old values, or zeros): for a
/// caller that writes every value before reading it. A kept buffer is taken where one has
/// room ([`Kept::pick`]), else a new one is allocated.
///
/// # Errors
/// The allocation fails (an error naming `what`, not an abort).
pub(crate) fn take(n: usize, what: &str) -> candle_core::Result<Vec<f32>> {
    let picked = lock().pick(n);
    match picked {
        // Out of the lock: a gap past the buffer's old length is written with zeros.
        Some(buf) => Ok(sized(buf, n)),
        None => super::zeroed(n, what),
    }
}

/// `buf` at length `n`, within its capacity: no allocation; only values past its old length
/// are written.
fn sized(mut buf: Vec<f32>, n: usize) -> Vec<f32> {
    buf.resize(n, 0.0);
    buf
}

/// Keeps `buf` for a later [`take`], within [`KEEP`] values in all.
pub(crate) fn keep(buf: Vec<f32>) {
    lock().keep(buf, KEEP);
}

/// Frees every kept buffer; returns the values they held.
pub(crate) fn release() -> usize {
    let mut kept = lock();
    let values = kept.values();
    kept.0 = Vec::new();
    values
}

/// The values the kept buffers hold now.
pub(crate) fn kept_values() -> usize {
    lock().values()
}

/// The kept buffers, locked. No code runs under the lock that could leave them inconsistent,
/// so a lock poisoned by a panic elsewhere is taken as it is.
fn lock() -> std::sync::MutexGuard<'static, Kept> {
    KEPT.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Buffers and their values.
struct Kept(Vec<Vec<f32>>);

impl Kept {
    /// A buffer with room for `n` values, taken out: the shortest already that long (a
    /// call's sizes repeat from one call to the next), else the smallest with room.
    fn pick(&mut self, n: usize) -> Option<Vec<f32>> {
        let best = (0..self.0.len())
            .filter(|&i| self.0[i].len() >= n)
            .min_by_key(|&i| self.0[i].len())
            .or_else(|| {
                (0..self.0.len())
                    .filter(|&i| self.0[i].capacity() >= n)
                    .min_by_key(|&i| self.0[i].capacity())
            })?;
        Some(self.0.swap_remove(best))
    }

    /// Keeps `buf` unless it alone passes `cap` values; the smallest kept buffers are freed
    /// first to make room (a call's buffers are alike in size, and larger ones serve both),
    /// but none for a buffer smaller than they are, which is freed instead.
    fn keep(&mut self, buf: Vec<f32>, cap: usize) {
        if buf.capacity() == 0 || buf.capacity() > cap {
            return;
        }
        while self.values() + buf.capacity() > cap {
            let Some(smallest) = (0..self.0.len()).min_by_key(|&i| self.0[i].capacity()) else {
                break;
            };
            if self.0[smallest].capacity() > buf.capacity() {
                return;
            }
            self.0.swap_remove(smallest);
        }
        self.0.push(buf);
    }

    fn values(&self) -> usize {
        self.0.iter().map(Vec::capacity).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_back_and_stay_under_the_cap() {
        let mut kept = Kept(Vec::new());
        let a = vec![1.0f32; 1000];
        let ptr = a.as_ptr();
        kept.keep(a, 4000);
        assert_eq!(kept.values(), 1000);
        // The kept buffer serves a smaller call, in place, with its old values.
        let b = sized(kept.pick(600).unwrap(), 600);
        assert_eq!((b.len(), b.as_ptr(), b[599]), (600, ptr, 1.0));
        assert_eq!(kept.values(), 0);
        assert!(kept.pick(1).is_none());
        kept.keep(b, 4000);
        // Grown past its old length, within capacity, zeros after the old values.
        let c = sized(kept.pick(1000).unwrap(), 1000);
        assert_eq!((c.as_ptr(), c[599], c[600]), (ptr, 1.0, 0.0));
        kept.keep(c, 4000);
        // Larger than the cap: never kept; filling up frees the smallest first.
        kept.keep(Vec::with_capacity(4001), 4000);
        assert_eq!(kept.values(), 1000);
        kept.keep(Vec::with_capacity(2000), 4000);
        kept.keep(Vec::with_capacity(1500), 4000);
        assert_eq!(kept.values(), 3500);
        kept.keep(Vec::with_capacity(2500), 4000);
        // Room for 2500 takes both smaller ones.
        assert_eq!(kept.values(), 2500);
        assert!(kept.pick(3000).is_none());
        assert_eq!(sized(kept.pick(2100).unwrap(), 2100).capacity(), 2500);
        // A full set of larger buffers is not given up for a smaller one.
        kept.keep(Vec::with_capacity(2000), 4000);
        kept.keep(Vec::with_capacity(2000), 4000);
        kept.keep(Vec::with_capacity(10), 4000);
        assert_eq!(kept.values(), 4000);
        // One already as long as asked is preferred to a larger one that would need zeros.
        let mut kept = Kept(Vec::new());
        let mut large = vec![2.0f32; 1000];
        large.truncate(100);
        kept.keep(large, 4000);
        kept.keep(vec![3.0f32; 500], 4000);
        assert_eq!(sized(kept.pick(400).unwrap(), 400)[0], 3.0);
        assert_eq!(sized(kept.pick(400).unwrap(), 400)[399], 0.0);
    }
}
