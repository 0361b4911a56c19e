//! The size budget checked before anything is allocated.
//!
//! Configurations and inputs come from callers, config files and checkpoints, so a size such as
//! `max_len = 10^12` must be refused with an error instead of aborting the process when the
//! allocation fails. Every table, parameter, cache and per-call tensor whose size follows from
//! a configuration or an input is checked against one number, [`max_elements`] (by default
//! [`MAX_ELEMENTS`]), with checked arithmetic first. A program that knows its memory sets the
//! budget once with [`set_max_elements`]; code that wants another budget for its own calls
//! only (a request handler, a test beside others) takes a [`BudgetScope`] on its thread.
//!
//! The crate checks every size on the thread that made the call, before it hands any work to
//! other threads, so a scope covers everything its calls build.
//!
//! # What a call at the budget holds
//! Each check counts what its stage holds at once (a RoPE table build its two tables and the
//! f64 frequencies, f64 as two elements; a block call its logits per query block, its
//! projections, its keys and values with the cache), so a call whose sizes all sit at the
//! budget of `E` elements peaks under `8 × E` elements of its dtype beyond what was live
//! before it: measured by counting allocations (`a_call_at_the_budget_peaks_under_its_bound`
//! in `tests/it/robustness/budget.rs`) for the block with its weights returned (6.8 × E, with
//! a T5 bias 7.4 × E), its fused core (3.9 × E), a training step with gradients (6.5 × E), a
//! RoPE table (1.1 × E) and a KV cache filled to its storage limit (3.3 × E).
//!
//! # What the crate keeps between calls
//! The CPU paths keep the buffers a call fills and frees (a chunk's queries, keys, values and
//! attention output, the projections' rows, the transposed keys) for the next call, up to
//! [`KEPT_BYTES_MAX`] in all, process-wide, beside any call's budget: calls of repeating sizes
//! then write into memory they already hold instead of taking its pages from the system again.
//! [`kept_bytes`] says how much is held; [`release_kept`] frees it.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::error::{Error, Result};

/// The default budget: 2^31 elements (8 GiB of f32) in any one tensor the crate builds.
pub const MAX_ELEMENTS: usize = 1 << 31;

static BUDGET: AtomicUsize = AtomicUsize::new(MAX_ELEMENTS);

thread_local! {
    /// The innermost [`BudgetScope`] of this thread, if any.
    static SCOPED: Cell<Option<usize>> = const { Cell::new(None) };
}

/// The most elements one table, parameter, cache buffer or intermediate tensor built by this
/// crate may hold: this thread's [`BudgetScope`] if it has one, else the process's budget.
pub fn max_elements() -> usize {
    SCOPED
        .with(Cell::get)
        .unwrap_or_else(|| BUDGET.load(Ordering::Relaxed))
}

/// Sets the process's budget (at least 1) and returns the previous one. Objects built before
/// keep what they hold; later checks use the new number, except on threads inside a
/// [`BudgetScope`].
pub fn set_max_elements(elements: usize) -> usize {
    BUDGET.swap(elements.max(1), Ordering::Relaxed)
}

/// A budget for the calls this thread makes while the value lives, in place of the process's
/// (scopes nest; dropping one restores the budget that was in force when it was taken).
///
/// ```
/// use candle_posenc::limits::{max_elements, BudgetScope, MAX_ELEMENTS};
///
/// {
///     let _scope = BudgetScope::new(4096);
///     assert_eq!(max_elements(), 4096);
/// }
/// assert_eq!(max_elements(), MAX_ELEMENTS);
/// ```
#[derive(Debug)]
#[must_use = "the budget holds only while the scope lives"]
pub struct BudgetScope {
    previous: Option<usize>,
    /// Scopes belong to the thread that took them.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl BudgetScope {
    /// `elements` (at least 1) as this thread's budget until the scope is dropped.
    pub fn new(elements: usize) -> Self {
        let previous = SCOPED.with(|s| s.replace(Some(elements.max(1))));
        Self {
            previous,
            _not_send: std::marker::PhantomData,
        }
    }
}

impl Drop for BudgetScope {
    fn drop(&mut self) {
        SCOPED.with(|s| s.set(self.previous));
    }
}

/// The product of `dims`, or [`Error::InvalidConfig`] naming `name = value` if it overflows or
/// exceeds [`max_elements`]; `what` names the product in the message (e.g. `"max_len × d_model"`,
/// or `format_args!` for one that names sizes: it is formatted only when the check fails, so a
/// call that passes allocates nothing for it).
///
/// Each size must be within the budget on its own too: a zero elsewhere makes the product 0,
/// but the work around a tensor (a loop over its rows, a lookup per distance) still follows
/// every size, so `0 × 2^40` is refused like `1 × 2^40`.
pub(crate) fn check_elements(
    name: &'static str,
    value: impl std::fmt::Display,
    what: impl std::fmt::Display,
    dims: &[usize],
) -> Result<usize> {
    let budget = max_elements();
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= budget && dims.iter().all(|&d| d <= budget))
        .ok_or_else(|| Error::config(name, value, format!("{what} at most {budget}")))
}

/// The most the CPU paths keep between calls, in bytes (64 MiB).
pub const KEPT_BYTES_MAX: usize = crate::cpu::workspace::KEEP * std::mem::size_of::<f32>();

/// Bytes of the buffers the CPU paths keep between calls now (at most [`KEPT_BYTES_MAX`]).
pub fn kept_bytes() -> usize {
    crate::cpu::workspace::kept_values() * std::mem::size_of::<f32>()
}

/// Frees the buffers the CPU paths keep between calls and returns the bytes they held; later
/// calls allocate them again.
///
/// ```
/// use candle_posenc::limits::{kept_bytes, release_kept, KEPT_BYTES_MAX};
///
/// assert!(kept_bytes() <= KEPT_BYTES_MAX);
/// release_kept();
/// assert_eq!(kept_bytes(), 0);
/// ```
pub fn release_kept() -> usize {
    crate::cpu::workspace::release() * std::mem::size_of::<f32>()
}
