//! A streaming cache's keys kept rotated, for encodings whose rotation depends on positions
//! only through their differences
//! ([`PositionalEncoding::relative_rotation`](crate::PositionalEncoding::relative_rotation)).
//!
//! A streaming cache places its tokens at slots `0..len` and rotates them there, so that the
//! distances never pass the window, however long the stream. Rotating every held key at its
//! slot on every call costs a pass over the cache per decoded token; instead, held token `j`
//! stays rotated at `j + shift` ([`Frame`]) and the chunk's queries and keys are rotated at
//! their slots plus the same `shift`: every query–key difference is the slots' difference, so
//! the logits are the slots' (to the rounding of the tables' entries). Eviction moves the
//! window towards the sinks and grows `shift`; the few sinks are rotated again from their
//! unrotated keys, and when `shift` passes a quarter of the window every held key is rotated
//! again at its slot (`shift` 0), keeping the positions the rotation reads within
//! `sinks + window + chunk + max(window / 4, 16)`.

use candle_core::Tensor;

use crate::attention::kv_cache::{Frame, KvCache};
use crate::error::Result;
use crate::positions::Positions;

/// The rotation hook with its answers checked: `(q, k, (queries, q_len), (keys, k_len))` →
/// rotated `(q, k)`.
pub(super) type Rotate<'a> = dyn Fn(Tensor, Tensor, (&Positions, usize), (&Positions, usize)) -> Result<(Tensor, Tensor)>
    + 'a;

/// Appends the chunk `(q, k, v)` (`(B, H, T, D)`, `(B, Hkv, T, D)` twice) to a streaming cache
/// and returns the rotated queries, every held key rotated in the cache's frame, every held
/// value and the keys' slot positions.
///
/// # Errors
/// The cache's and the rotation's errors; the cache is then put back by the caller's guard
/// (its kept rotated keys are rotated again at the next call).
pub(super) fn append(
    cache: &mut KvCache,
    (q, k, v): (Tensor, Tensor, Tensor),
    positions: &Positions,
    rotate: &Rotate,
) -> Result<(Tensor, Tensor, Tensor, Positions)> {
    let frame = cache.frame();
    let (slot, t) = (cache.len(), k.dim(2)?);
    // The unrotated keys are copied into the cache's storage, so `k` may be rotated in place.
    let (_, v_all, k_positions) = cache.append(&k, &v, positions)?;
    let q = match frame {
        Some(frame) => {
            let at = Positions::Offset(slot + frame.shift);
            let (q, k) = rotate(q, k, (&at, t), (&at, t))?;
            cache.write_rotated(slot, &k)?;
            rotate_sinks(cache, frame, &q, rotate)?;
            q
        }
        None => rotate_all(cache, q, (slot, t), rotate)?,
    };
    Ok((q, cache.rotated_keys()?, v_all, k_positions))
}

/// Every held key rotated at its slot (`shift` 0), and the queries at theirs.
fn rotate_all(
    cache: &mut KvCache,
    q: Tensor,
    (slot, t): (usize, usize),
    rotate: &Rotate,
) -> Result<Tensor> {
    let len = cache.len();
    let held = cache.raw_keys(0..len)?.force_contiguous()?;
    let (queries, keys) = (Positions::Offset(slot), Positions::Offset(0));
    let (q, k) = rotate(q, held, (&queries, t), (&keys, len))?;
    cache.write_rotated(0, &k)?;
    cache.keep_frame(Frame {
        shift: 0,
        sinks_shift: 0,
    });
    Ok(q)
}

/// The sinks rotated again from their unrotated keys when the frame moved since they were
/// last rotated; the frame recorded.
fn rotate_sinks(cache: &mut KvCache, frame: Frame, q: &Tensor, rotate: &Rotate) -> Result<()> {
    let sinks = cache.held_sinks();
    if sinks > 0 && frame.sinks_shift != frame.shift {
        let raw = cache.raw_keys(0..sinks)?.force_contiguous()?;
        let (b, h, _, d) = q.dims4()?;
        let none = Tensor::zeros((b, h, 0, d), q.dtype(), q.device())?;
        let at = Positions::Offset(frame.shift);
        let (_, k) = rotate(none, raw, (&at, 0), (&at, sinks))?;
        cache.write_rotated(0, &k)?;
    }
    cache.keep_frame(Frame {
        shift: frame.shift,
        sinks_shift: frame.shift,
    });
    Ok(())
}
