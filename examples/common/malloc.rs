//! Keeping freed memory in the process (glibc only).
//!
//! By default glibc returns every freed block above a moving threshold to the kernel at once,
//! and trims the heap's top whenever 128 KiB are free there. Training on the CPU frees and
//! allocates tensors of the same few sizes thousands of times a second, so each step pays for
//! fresh zeroed pages again: on a 2-core machine the extrapolation experiment spent more time in
//! the kernel than in its own code. Raising both thresholds keeps those pages for reuse
//! (measured: a third less wall time, a tenth of the system time).

/// Serves blocks up to 32 MiB (glibc's ceiling) from the heap and trims it only past 1 GiB
/// free. Call at the start of `main`, before other threads exist. A no-op off glibc.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only changes the allocator's tuning parameters; it is called before
    // any other thread starts, and both values are within the documented ranges.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}
