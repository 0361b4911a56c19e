//! Random test data that is the same on every run.
//!
//! candle's CPU generator cannot be seeded, and tests that compared two paths on its draws
//! failed now and then where a draw put a sum near its tolerance (four tests, about one run in
//! twenty-five of the suite). Every random tensor and every fresh variable of a test comes
//! from here instead: a SplitMix64 stream per thread, seeded from the thread's name (the test
//! harness names each test's thread after the test), so a test draws the same values whatever
//! runs beside it, and a failure seen once is seen again. Threads a test starts have no name
//! and may not draw: the test draws for them.
//!
//! ```text
//! state += 0x9E37_79B9_7F4A_7C15;  z = mix(state)            SplitMix64 (Steele et al., 2014)
//! u = (z >> 11) · 2^-53 ∈ [0, 1);   n = √(−2 ln(1 − u₁)) · cos(2π u₂)          Box–Muller
//! ```

use std::cell::Cell;

use candle_core::{DType, Device, FloatDType, Shape, Tensor, Var};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder, VarMap};

thread_local! {
    /// This thread's stream, started from its name on first use.
    static STATE: Cell<Option<u64>> = const { Cell::new(None) };
}

/// The thread's name hashed (FNV-1a): each test's own seed.
///
/// # Panics
/// On a thread without a name (rayon's, or one a test spawned): what such a thread draws
/// depends on which of them runs first, so a test draws its data on its own thread and hands
/// it to the others.
fn thread_seed() -> u64 {
    let thread = std::thread::current();
    let name = thread
        .name()
        .expect("test data drawn on an unnamed thread: draw it on the test's own thread");
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The next 64 random bits of this thread's stream.
fn next_u64() -> u64 {
    STATE.with(|state| {
        let s = state
            .get()
            .unwrap_or_else(thread_seed)
            .wrapping_add(0x9e37_79b9_7f4a_7c15);
        state.set(Some(s));
        let z = (s ^ (s >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        let z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    })
}

/// Uniform in `[0, 1)`, 53 bits.
fn unit() -> f64 {
    (next_u64() >> 11) as f64 * f64::EPSILON / 2.0
}

/// Standard normal (Box–Muller, one value per pair of uniforms).
fn normal() -> f64 {
    let (u1, u2) = (1.0 - unit(), unit());
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// `n` values drawn by `draw`, as a tensor of `shape` in `dtype` on `dev`.
fn tensor(
    shape: Shape,
    dtype: DType,
    dev: &Device,
    draw: impl Fn() -> f64,
) -> candle_core::Result<Tensor> {
    let values: Vec<f64> = (0..shape.elem_count()).map(|_| draw()).collect();
    Tensor::from_vec(values, shape, &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(dev)
}

/// `Tensor::randn`, from this thread's stream: normal values of `mean` and `std`.
pub fn randn<S: Into<Shape>, T: FloatDType>(
    mean: T,
    std: T,
    shape: S,
    dev: &Device,
) -> candle_core::Result<Tensor> {
    let (mean, std) = (mean.to_f64(), std.to_f64());
    tensor(shape.into(), T::DTYPE, dev, || mean + std * normal())
}

/// `Tensor::rand`, from this thread's stream: uniform values in `[lo, up)`.
pub fn rand<S: Into<Shape>, T: FloatDType>(
    lo: T,
    up: T,
    shape: S,
    dev: &Device,
) -> candle_core::Result<Tensor> {
    let (lo, up) = (lo.to_f64(), up.to_f64());
    tensor(shape.into(), T::DTYPE, dev, || lo + (up - lo) * unit())
}

/// `Var::randn`, from this thread's stream.
pub fn var_randn<S: Into<Shape>, T: FloatDType>(
    mean: T,
    std: T,
    shape: S,
    dev: &Device,
) -> candle_core::Result<Var> {
    Var::from_tensor(&randn(mean, std, shape, dev)?)
}

/// `VarBuilder::from_varmap`, whose fresh variables are drawn from this thread's stream with
/// the distribution their init hint names (candle-nn's `Init::var`: constants, normal,
/// uniform, Kaiming by fan and gain).
pub fn seeded_vb(varmap: &VarMap, dtype: DType, dev: &Device) -> VarBuilder<'static> {
    VarBuilder::from_backend(Box::new(Seeded(varmap.clone())), dtype, dev.clone())
}

/// A `VarMap` that makes its variables from the stream.
struct Seeded(VarMap);

impl SimpleBackend for Seeded {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        init: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        if dtype.is_float() {
            let mut data = self.0.data().lock().unwrap();
            if !data.contains_key(name) {
                let var = Var::from_tensor(&initial(&shape, init, dtype, dev)?)?;
                data.insert(name.to_string(), var);
            }
        }
        // The map's own shape check and, for other dtypes, its own init.
        self.0.get(shape, name, init, dtype, dev)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.0.get_unchecked(name, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.contains_tensor(name)
    }
}

/// A fresh variable's values as candle-nn's `Init::var` draws them.
fn initial(shape: &Shape, init: Init, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
    let (lo, up) = match init {
        Init::Const(c) => return tensor(shape.clone(), dtype, dev, || c),
        Init::Randn { mean, stdev } => {
            return tensor(shape.clone(), dtype, dev, || mean + stdev * normal())
        }
        Init::Uniform { lo, up } => (lo, up),
        Init::Kaiming {
            dist,
            fan,
            non_linearity,
        } => {
            let std = non_linearity.gain() / (fan.for_shape(shape) as f64).sqrt();
            match dist {
                candle_nn::init::NormalOrUniform::Normal => {
                    return tensor(shape.clone(), dtype, dev, || std * normal())
                }
                candle_nn::init::NormalOrUniform::Uniform => {
                    let bound = 3f64.sqrt() * std;
                    (-bound, bound)
                }
            }
        }
    };
    tensor(shape.clone(), dtype, dev, || lo + (up - lo) * unit())
}

/// The variables of `varmap` in the order of their names: draws made per variable go to the
/// same variable on every run (the map itself iterates in a per-process random order).
pub fn sorted_vars(varmap: &VarMap) -> Vec<Var> {
    let data = varmap.data().lock().unwrap();
    let mut named: Vec<(&String, &Var)> = data.iter().collect();
    named.sort_by(|a, b| a.0.cmp(b.0));
    named.into_iter().map(|(_, v)| v.clone()).collect()
}

/// proptest's settings for `cases` cases: a fixed seed, so that CI runs the same cases every
/// time, unless `PROPTEST_RNG_SEED` names another (to explore: `PROPTEST_RNG_SEED=$RANDOM
/// cargo test robustness`); no failure files.
pub fn proptest_config(cases: u32) -> proptest::test_runner::Config {
    let mut config = proptest::test_runner::Config {
        cases,
        failure_persistence: None,
        ..Default::default()
    };
    if std::env::var_os("PROPTEST_RNG_SEED").is_none() {
        config.rng_seed = proptest::test_runner::RngSeed::Fixed(0x5eed_da7a);
    }
    config
}
