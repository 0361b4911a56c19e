//! Shared test helpers: fixture loading, closeness checks, and the per-device test macro.

pub mod peak;
pub mod seeded;
pub mod zoo;

pub use seeded::{proptest_config, rand, randn, seeded_vb, sorted_vars, var_randn};

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};

/// Loads `tests/fixtures/<name>` onto `device`.
pub fn fixture(name: &str, device: &Device) -> anyhow::Result<HashMap<String, Tensor>> {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    Ok(candle_core::safetensors::load(path, device)?)
}

/// One fixture tensor, by name, with a readable failure.
pub fn get<'a>(map: &'a HashMap<String, Tensor>, name: &str) -> &'a Tensor {
    map.get(name)
        .unwrap_or_else(|| panic!("fixture has no tensor `{name}`"))
}

/// The fixture tensors under `prefix`, with the prefix removed (to feed a `VarBuilder`).
pub fn prefixed(fx: &HashMap<String, Tensor>, prefix: &str) -> HashMap<String, Tensor> {
    fx.iter()
        .filter_map(|(k, v)| k.strip_prefix(prefix).map(|n| (n.to_string(), v.clone())))
        .collect()
}

/// Largest absolute difference between two tensors of the same shape, in f64.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> anyhow::Result<f64> {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let a = a.to_dtype(DType::F64)?.flatten_all()?;
    let b = b.to_dtype(DType::F64)?.flatten_all()?;
    Ok((a - b)?.abs()?.max(0)?.to_scalar::<f64>()?)
}

/// Asserts `|a - b| <= tol` everywhere. With `POSENC_TOL_LOG=<file>` set, each call also
/// appends its site, difference, bound and label to the file (to measure how close repeated
/// runs come to each bound).
#[track_caller]
pub fn assert_close(a: &Tensor, b: &Tensor, tol: f64, what: &str) -> anyhow::Result<()> {
    let d = max_abs_diff(a, b)?;
    if let Ok(path) = std::env::var("POSENC_TOL_LOG") {
        use std::io::Write;
        let here = std::panic::Location::caller();
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        // One write per line, so that tests on other threads do not interleave.
        let line = format!("{}:{}\t{d:e}\t{tol:e}\t{what}\n", here.file(), here.line());
        f.write_all(line.as_bytes())?;
    }
    assert!(d <= tol, "{what}: max |diff| = {d:e} > {tol:e}");
    Ok(())
}

/// Whether `dev` runs kernels on tensors of no elements. candle 0.11's CUDA backend does not:
/// it launches them with a grid of 0 blocks, which the driver refuses
/// (`CUDA_ERROR_INVALID_VALUE`; `zeros` passes, a memset, but `ones` or any op after does not,
/// as an H100 showed), so the parts of a device test that build or expect empty tensors run
/// only where this holds.
pub fn holds_empty(dev: &Device) -> bool {
    Tensor::ones(0, DType::F32, dev)
        .and_then(|t| t.affine(2.0, 1.0))
        .is_ok()
}

/// Asserts `|a - b| <= max(abs, rel · max |b|)` everywhere: for two f32 computations of the
/// same values whose sums run in another order (another path, shape or blocking), where the
/// rounding grows with the values. Random blocks give outputs up to ~15 and gradients up to
/// ~1000, where an f32 ulp is 1e-6 and 6e-5; a fixed 1e-5 is then a few ulps, and such
/// comparisons failed now and then on random inputs (measured over repeated runs: see
/// `docs/exactness.md`, "Tolerances").
#[track_caller]
pub fn assert_close_scaled(
    a: &Tensor,
    b: &Tensor,
    abs: f64,
    rel: f64,
    what: &str,
) -> anyhow::Result<()> {
    let scale = f64::from(
        b.abs()?
            .max_all()?
            .to_dtype(DType::F32)?
            .to_scalar::<f32>()?,
    );
    assert_close(a, b, abs.max(rel * scale), what)
}

/// Expands `fn name(dev: &Device) -> anyhow::Result<()>` test bodies into cpu, cuda and metal
/// test functions (the latter two only with the matching cargo feature).
#[macro_export]
macro_rules! device_tests {
    ($($name:ident),* $(,)?) => {
        mod cpu {
            $(#[test]
            fn $name() -> anyhow::Result<()> {
                super::$name(&candle_core::Device::Cpu)
            })*
        }
        #[cfg(feature = "cuda")]
        mod cuda {
            $(#[test]
            fn $name() -> anyhow::Result<()> {
                super::$name(&candle_core::Device::new_cuda(0)?)
            })*
        }
        #[cfg(feature = "metal")]
        mod metal {
            $(#[test]
            fn $name() -> anyhow::Result<()> {
                super::$name(&candle_core::Device::new_metal(0)?)
            })*
        }
    };
}

/// Set in the child process of [`run_alone`].
const ALONE: &str = "CANDLE_POSENC_TEST_ALONE";

/// Whether this process is [`run_alone`]'s child.
pub fn alone() -> bool {
    std::env::var_os(ALONE).is_some()
}

/// Runs the test `path` (as `module_path!()` gives it) of this binary again in a child process
/// where it is the only test, for a test that changes or measures something process-wide, and
/// fails with the child's output unless exactly that test passed there.
pub fn run_alone(path: &str) -> anyhow::Result<()> {
    let name = path.split_once("::").map_or(path, |(_, rest)| rest);
    let out = std::process::Command::new(std::env::current_exe()?)
        .args([name, "--exact", "--test-threads=1", "--nocapture"])
        .env(ALONE, "1")
        .output()?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    anyhow::ensure!(
        out.status.success() && text.contains("test result: ok. 1 passed"),
        "{name}, alone in a child process:\n{text}"
    );
    Ok(())
}

/// Expands a per-case test body `fn name(case: &str, dev: &Device) -> anyhow::Result<()>` into
/// one test per case and device, `name::cpu::<case>` (and `name::cuda::<case>`,
/// `name::metal::<case>` with the features), so that a failure names its case and the cases
/// run side by side. Each case is `ident = "fixture tag"`.
#[macro_export]
macro_rules! case_tests {
    ($body:ident: $($case:ident = $tag:literal),* $(,)?) => {
        mod $body {
            mod cpu {
                $(#[test]
                fn $case() -> anyhow::Result<()> {
                    super::super::$body($tag, &candle_core::Device::Cpu)
                })*
            }
            #[cfg(feature = "cuda")]
            mod cuda {
                $(#[test]
                fn $case() -> anyhow::Result<()> {
                    super::super::$body($tag, &candle_core::Device::new_cuda(0)?)
                })*
            }
            #[cfg(feature = "metal")]
            mod metal {
                $(#[test]
                fn $case() -> anyhow::Result<()> {
                    super::super::$body($tag, &candle_core::Device::new_metal(0)?)
                })*
            }
        }
    };
}
