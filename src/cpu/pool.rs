//! Work moved onto rayon's pool: a call made from outside the pool runs there whole, so that
//! its parallel stages fork from a pool thread (a deque push) instead of each waking the pool
//! from outside and sleeping on a latch until it is done (two context switches per stage,
//! tens of microseconds, more than a small layer's stages cost).

use crate::limits::{max_elements, BudgetScope};

/// `f()` run on a thread of rayon's global pool (at once, where the caller is one), under the
/// caller's budget ([`crate::limits`] scopes are per thread).
pub(crate) fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        return f();
    }
    let budget = max_elements();
    rayon::scope(|_| {
        let _budget = BudgetScope::new(budget);
        f()
    })
}
