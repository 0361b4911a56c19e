#![allow(dead_code)] // shared by several benchmarks, each using a part
//! Helpers shared by the benchmarks: the device, and medians of timed runs.

use std::time::Instant;

use anyhow::Result;
use candle_core::Device;

/// CUDA device 0 when the build has CUDA and a GPU is present, else the CPU.
pub fn device() -> Result<Device> {
    Ok(if candle_core::utils::cuda_is_available() {
        Device::new_cuda(0)?
    } else {
        Device::Cpu
    })
}

/// Median wall time in milliseconds of `runs` calls of `f`, after one warm-up call (tables,
/// caches, page faults).
pub fn median_ms(runs: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        let t = Instant::now();
        f()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[runs / 2])
}

/// Medians in milliseconds of `runs` calls each of `a` and `b`, called in alternation (after
/// one warm-up call each), so slow phases of the machine hit both alike.
pub fn paired_median_ms(
    runs: usize,
    a: impl FnMut() -> Result<()>,
    b: impl FnMut() -> Result<()>,
) -> Result<(f64, f64)> {
    let p = paired(runs, a, b)?;
    Ok((p.a_ms, p.b_ms))
}

/// Timings of two alternated functions: both medians and the median of the per-pair ratios.
pub struct Paired {
    pub a_ms: f64,
    pub b_ms: f64,
    /// Median over pairs of `b / a`, each pair timed back to back: steadier than the ratio of
    /// the two medians when the machine drifts during the run.
    pub ratio: f64,
}

/// [`paired_median_ms`] with the median per-pair ratio as well.
pub fn paired(
    runs: usize,
    mut a: impl FnMut() -> Result<()>,
    mut b: impl FnMut() -> Result<()>,
) -> Result<Paired> {
    a()?;
    b()?;
    let (mut ta, mut tb) = (Vec::with_capacity(runs), Vec::with_capacity(runs));
    for _ in 0..runs {
        for (f, times) in [
            (&mut a as &mut dyn FnMut() -> Result<()>, &mut ta),
            (&mut b, &mut tb),
        ] {
            let t = Instant::now();
            f()?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    let mut ratios: Vec<f64> = ta.iter().zip(&tb).map(|(a, b)| b / a).collect();
    ta.sort_by(f64::total_cmp);
    tb.sort_by(f64::total_cmp);
    ratios.sort_by(f64::total_cmp);
    Ok(Paired {
        a_ms: ta[runs / 2],
        b_ms: tb[runs / 2],
        ratio: ratios[runs / 2],
    })
}
