//! The size budget checked before anything is allocated.
//!
//! Configurations and inputs come from callers, config files and checkpoints, so a size such as
//! `max_len = 10^12` must be refused with an error instead of aborting the process when the
//! allocation fails. Every table, parameter, cache and per-call tensor whose size follows from
//! a configuration or an input is checked against one number, [`max_elements`] (by default
//! [`MAX_ELEMENTS`]), with checked arithmetic first. A program that knows its memory sets the
//! budget once with [`set_max_elements`].

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::error::{Error, Result};

/// The default budget: 2^31 elements (8 GiB of f32) in any one tensor the crate builds.
pub const MAX_ELEMENTS: usize = 1 << 31;

static BUDGET: AtomicUsize = AtomicUsize::new(MAX_ELEMENTS);

/// The most elements one table, parameter, cache buffer or intermediate tensor built by this
/// crate may hold (process-wide).
pub fn max_elements() -> usize {
    BUDGET.load(Ordering::Relaxed)
}

/// Sets [`max_elements`] for the whole process (at least 1) and returns the previous budget.
/// Objects built before keep what they hold; later checks use the new number.
pub fn set_max_elements(elements: usize) -> usize {
    BUDGET.swap(elements.max(1), Ordering::Relaxed)
}

/// The product of `dims`, or [`Error::InvalidConfig`] naming `name = value` if it overflows or
/// exceeds [`max_elements`]; `what` names the product in the message (e.g. `"max_len × d_model"`).
///
/// Each size must be within the budget on its own too: a zero elsewhere makes the product 0,
/// but the work around a tensor (a loop over its rows, a lookup per distance) still follows
/// every size, so `0 × 2^40` is refused like `1 × 2^40`.
pub(crate) fn check_elements(
    name: &'static str,
    value: impl std::fmt::Display,
    what: &str,
    dims: &[usize],
) -> Result<usize> {
    let budget = max_elements();
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= budget && dims.iter().all(|&d| d <= budget))
        .ok_or_else(|| Error::config(name, value, format!("{what} at most {budget}")))
}
