//! The test binary's allocator: the system's, counting the bytes asked for, the bytes live and
//! their peak. It counts every thread, so a test that reads it runs alone in a child process
//! of the test binary ([`super::run_alone`]); elsewhere it only counts.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The system allocator, counting.
struct Counting;

/// Bytes asked for since the process started (a reallocation asks for its new size).
static ASKED: AtomicUsize = AtomicUsize::new(0);
/// Bytes live now, and the most live since [`peak_of`] last reset it.
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(bytes: usize) {
    ASKED.fetch_add(bytes, Ordering::Relaxed);
    let live = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(live, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to the system allocator unchanged; the counters only observe
// the sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        // SAFETY: the caller's contract, passed on (the system's calloc: pages zeroed lazily,
        // as the tests expect of the default allocator).
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        grew(new_size);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Bytes asked for since the process started.
pub fn asked() -> usize {
    ASKED.load(Ordering::SeqCst)
}

/// The most bytes live at once while `f` ran (and its answer was dropped), beyond those live
/// when it started.
pub fn peak_of<R>(f: impl FnOnce() -> anyhow::Result<R>) -> anyhow::Result<usize> {
    let before = LIVE.load(Ordering::SeqCst);
    PEAK.store(before, Ordering::SeqCst);
    drop(f()?);
    Ok(PEAK.load(Ordering::SeqCst).saturating_sub(before))
}
