//! `attention::linear`, the block's own product offered for the rest of a model: equal to the
//! exact product within one rounding in every dtype and row count, candle-nn's `Linear` where
//! gradients are tracked, and a typed error for an input that does not fit.

// The f64 reference multiplies two plain matrices (clippy.toml sends the library's products
// through src/matmul.rs for candle's broadcast layouts, which this file does not make).
#![allow(clippy::disallowed_methods)]

use candle_core::{DType, Device, Tensor};
use candle_nn::{Linear, Module};
use candle_posenc::attention::linear;

use crate::common::{self, max_abs_diff};

fn layer(inner: usize, out: usize, bias: bool, dtype: DType) -> anyhow::Result<Linear> {
    let dev = Device::Cpu;
    let w = common::randn(0f32, 1.0, (out, inner), &dev)?.to_dtype(dtype)?;
    let b = common::randn(0f32, 1.0, out, &dev)?.to_dtype(dtype)?;
    Ok(Linear::new(w, bias.then_some(b)))
}

/// f64 `x Wᵀ + b` of the layer's own (rounded) values, x `(1, rows, in)`.
fn exact(layer: &Linear, x: &Tensor) -> anyhow::Result<Tensor> {
    let w = layer.weight().to_dtype(DType::F64)?;
    let (_, rows, inner) = x.dims3()?;
    let rows_in = x.to_dtype(DType::F64)?.reshape((rows, inner))?;
    let y = rows_in.matmul(&w.t()?)?.unsqueeze(0)?;
    Ok(match layer.bias() {
        Some(b) => y.broadcast_add(&b.to_dtype(DType::F64)?)?,
        None => y,
    })
}

/// Rows 1 and 3 (a decoding step's one pass over the weight), 40 and 300 (`gemm`, 300 past its
/// few-row split), a head-sized output (4100 features, not a multiple of any tile), with and
/// without a bias: each value within one rounding to the dtype of the exact one, plus 1e-5
/// of the output's scale for the f32 sums.
#[test]
fn equals_the_exact_product_within_one_rounding() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    for (dtype, u) in [
        (DType::F32, 0.0),
        (DType::BF16, 2f64.powi(-8)),
        (DType::F16, 2f64.powi(-11)),
    ] {
        for (inner, out, bias) in [(96, 40, true), (64, 4100, false)] {
            let layer = layer(inner, out, bias, dtype)?;
            for rows in [1, 3, 40, 300] {
                let x = common::randn(0f32, 1.0, (1, rows, inner), &dev)?.to_dtype(dtype)?;
                let y = linear(&layer, &x)?;
                assert_eq!((y.dims(), y.dtype()), (&[1, rows, out][..], dtype));
                let want = exact(&layer, &x)?;
                let scale = want.abs()?.max_all()?.to_scalar::<f64>()?;
                let err = (y.to_dtype(DType::F64)? - &want)?.abs()?;
                let bound = ((want.abs()? * u)? + 1e-5 * scale)?;
                let over = (err - bound)?.max_all()?.to_scalar::<f64>()?;
                assert!(
                    over <= 0.0,
                    "{dtype:?} {inner}->{out} {rows} rows: {over:e} past"
                );
            }
        }
    }
    Ok(())
}

/// An input that tracks gradients goes through candle-nn's `Linear`: the same values and the
/// same gradients to x and the weight.
#[test]
fn tracked_inputs_get_candles_gradients() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let w = common::var_randn(0f32, 1.0, (24, 40), &dev)?;
    let b = common::var_randn(0f32, 1.0, 24, &dev)?;
    let layer = Linear::new(w.as_tensor().clone(), Some(b.as_tensor().clone()));
    let x = common::var_randn(0f32, 1.0, (2, 5, 40), &dev)?;
    let probe = common::randn(0f32, 1.0, (2, 5, 24), &dev)?;
    let ours = linear(&layer, x.as_tensor())?;
    let theirs = layer.forward(x.as_tensor())?;
    let diff = max_abs_diff(&ours, &theirs)?;
    assert!(diff < 1e-5, "values differ by {diff}");
    let g_ours = (ours * &probe)?.sum_all()?.backward()?;
    let g_theirs = (theirs * &probe)?.sum_all()?.backward()?;
    for t in [x.as_tensor(), w.as_tensor(), b.as_tensor()] {
        let (a, b) = (g_ours.get(t), g_theirs.get(t));
        let (Some(a), Some(b)) = (a, b) else {
            anyhow::bail!("a gradient is missing");
        };
        let diff = max_abs_diff(a, b)?;
        assert!(diff < 1e-5, "gradients differ by {diff}");
    }
    Ok(())
}

/// An input whose last dimension is not the weight's, or of another dtype: an error, not a
/// panic, on every path (one row, many rows).
#[test]
fn an_input_that_does_not_fit_is_an_error() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let layer = layer(16, 8, true, DType::F32)?;
    for rows in [1, 300] {
        let wide = Tensor::zeros((rows, 17), DType::F32, &dev)?;
        assert!(linear(&layer, &wide).is_err(), "{rows} rows of 17 features");
        let half = Tensor::zeros((rows, 16), DType::BF16, &dev)?;
        assert!(linear(&layer, &half).is_err(), "{rows} rows of bf16");
    }
    Ok(())
}

/// Views with a start offset (x and the weight narrowed out of larger tensors), leading axes
/// of more than one, and empty axes: the values of candle-nn's `Linear` (f32), and for no
/// input features the bias alone.
#[test]
fn views_and_empty_axes() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let big_w = common::randn(0f32, 1.0, (10, 16), &dev)?;
    let big_b = common::randn(0f32, 1.0, 10, &dev)?;
    let layer = Linear::new(big_w.narrow(0, 2, 8)?, Some(big_b.narrow(0, 2, 8)?));
    for rows in [2, 300] {
        let x = common::randn(0f32, 1.0, (5, rows, 16), &dev)?.narrow(0, 1, 3)?;
        let (ours, theirs) = (linear(&layer, &x)?, layer.forward(&x)?);
        assert_eq!(ours.dims(), &[3, rows, 8]);
        let diff = max_abs_diff(&ours, &theirs)?;
        assert!(diff < 1e-5, "{rows} rows of a view: {diff:e}");
    }
    // No input features: y = b on every row, in every dtype, for a few rows and many.
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let bias = Tensor::new(&[1f32, -2.0, 3.5], &dev)?.to_dtype(dtype)?;
        let empty = Linear::new(Tensor::zeros((3, 0), dtype, &dev)?, Some(bias));
        for rows in [2, 300] {
            let y = linear(&empty, &Tensor::zeros((2, rows, 0), dtype, &dev)?)?;
            assert_eq!(y.dims(), &[2, rows, 3]);
            let y = y.to_dtype(DType::F32)?.flatten_to(1)?.to_vec2::<f32>()?;
            assert_eq!(y, vec![vec![1.0, -2.0, 3.5]; 2 * rows], "{dtype:?}");
        }
    }
    // No rows, no output features.
    let y = linear(&layer, &Tensor::zeros((2, 0, 16), DType::F32, &dev)?)?;
    assert_eq!(y.dims(), &[2, 0, 8]);
    let none = Linear::new(Tensor::zeros((0, 16), DType::F32, &dev)?, None);
    let y = linear(&none, &Tensor::zeros((2, 5, 16), DType::F32, &dev)?)?;
    assert_eq!(y.dims(), &[2, 5, 0]);
    Ok(())
}

/// An output past the budget is refused before anything is allocated: leading axes of 2^40
/// rows with no features (a tensor that holds nothing), and a plain product under a small
/// scope.
#[test]
fn an_output_past_the_budget_is_an_error() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let empty = Linear::new(Tensor::zeros((3, 0), DType::F32, &dev)?, None);
    let huge = Tensor::zeros((1usize << 40, 0), DType::F32, &dev)?;
    let err = linear(&empty, &huge).err().map(|e| e.to_string());
    assert!(
        err.as_deref().is_some_and(|e| e.contains("linear")),
        "{err:?}"
    );
    let layer = layer(16, 8, false, DType::F32)?;
    let x = Tensor::zeros((20, 16), DType::F32, &dev)?;
    let _scope = candle_posenc::limits::BudgetScope::new(100);
    assert!(
        linear(&layer, &x).is_err(),
        "160 outputs under a budget of 100"
    );
    Ok(())
}
