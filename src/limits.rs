//! Size limits checked before anything is allocated.
//!
//! Configurations and inputs come from callers, config files and checkpoints, so a size such as
//! `max_len = 10^12` must be refused with an error instead of aborting the process when the
//! allocation fails. Every table, parameter and per-call tensor whose size follows from a
//! configuration value is checked against [`MAX_ELEMENTS`] with checked arithmetic first.

use crate::error::{Error, Result};

/// The most elements (2^31) one table, parameter or bias tensor built by this crate may hold.
pub const MAX_ELEMENTS: usize = 1 << 31;

/// The product of `dims`, or [`Error::InvalidConfig`] naming `name = value` if it overflows or
/// exceeds [`MAX_ELEMENTS`]; `what` names the product in the message (e.g. `"max_len × d_model"`).
pub(crate) fn check_elements(
    name: &'static str,
    value: impl std::fmt::Display,
    what: &str,
    dims: &[usize],
) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= MAX_ELEMENTS)
        .ok_or_else(|| Error::config(name, value, format!("{what} at most {MAX_ELEMENTS}")))
}
