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

/// A `VarBuilder` whose tensors are drawn as a `VarMap` draws them (same initialisers) but are
/// plain tensors, not variables: a model loaded for inference, whose attention takes the fast
/// paths (a block whose weights track gradients takes the differentiable one).
pub fn inference_vb(dev: &Device) -> candle_nn::VarBuilder<'static> {
    inference_vb_of(dev, candle_core::DType::F32)
}

/// [`inference_vb`] in another dtype (fresh weights).
pub fn inference_vb_of(dev: &Device, dtype: candle_core::DType) -> candle_nn::VarBuilder<'static> {
    struct Detached(candle_nn::VarMap);
    impl candle_nn::var_builder::SimpleBackend for Detached {
        fn get(
            &self,
            s: candle_core::Shape,
            name: &str,
            h: candle_nn::Init,
            dtype: candle_core::DType,
            dev: &Device,
        ) -> candle_core::Result<candle_core::Tensor> {
            Ok(self.0.get(s, name, h, dtype, dev)?.detach())
        }
        fn get_unchecked(
            &self,
            name: &str,
            _: candle_core::DType,
            _: &Device,
        ) -> candle_core::Result<candle_core::Tensor> {
            candle_core::bail!("no tensor `{name}` without a shape")
        }
        fn contains_tensor(&self, name: &str) -> bool {
            self.0.data().lock().is_ok_and(|d| d.contains_key(name))
        }
    }
    candle_nn::VarBuilder::from_backend(
        Box::new(Detached(candle_nn::VarMap::new())),
        dtype,
        dev.clone(),
    )
}
